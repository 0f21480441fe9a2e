/*
** The op suite on CUDA: every op family's cases with only the cross-backend part (d) of
** the harness (forward and backward on each cuda:N against the CPU, every variant and
** dtype). Skipped (exit 77) without a CUDA device. It includes the family files so that
** their case tables are written once; H_NO_MAIN drops their main().
*/
#define H_NO_MAIN
#include "test_ops_elementwise.c"
#include "test_ops_activation.c"
#include "test_ops_reduce.c"
#include "test_ops_softmax.c"
#include "test_ops_matmul.c"
#include "test_ops_index.c"
#include "test_ops_compare.c"
#include "test_ops_loss.c"
#include "test_ops_view.c"

/* Rows with -inf logits (masked vocabularies, top-k sampling): softmax, log_softmax and
** cross-entropy agree with the CPU. The online max/sum once turned a lane's leading -inf
** into exp(-inf - -inf) = NaN and poisoned the row. */
static void masked_rows(void) {
  kiln_scope_begin();
  enum { R = 4, C = 300 };
  static float x[R * C];
  int64_t tgt[R];
  for (int r = 0; r < R; r++) {
    for (int j = 0; j < C; j++)
      x[r * C + j] = (j * 7 + r) % 3 == 0 || j < 2 * r + 1 ? -INFINITY : (float)((j * 37 + r * 11) % 101) / 17.0f;
    tgt[r] = 3 * r + 5 + (r % 3 == 1); /* a kept class */
    while ((tgt[r] * 7 + r) % 3 == 0) tgt[r]++;
  }
  int64_t sh[2] = {R, C}, st[1] = {R};
  kiln_device cpu = kiln_device_cpu(), gpu = kiln_device_cuda(0);
  kiln_tensor *xc = kiln_from_data(x, 2, sh, KILN_F32, cpu), *tc = kiln_from_data(tgt, 1, st, KILN_I64, cpu);
  kiln_tensor *xg = kiln_to_device(xc, gpu), *tg = kiln_to_device(tc, gpu);
  kiln_tensor *want[3] = {kiln_softmax(xc, 1), kiln_log_softmax(xc, 1), kiln_cross_entropy(xc, tc, KILN_REDUCTION_NONE, -100, 0)};
  kiln_tensor *got[3] = {kiln_softmax(xg, 1), kiln_log_softmax(xg, 1), kiln_cross_entropy(xg, tg, KILN_REDUCTION_NONE, -100, 0)};
  static const char *const what[3] = {"softmax", "log_softmax", "cross_entropy"};
  for (int i = 0; i < 3; i++) {
    double *w = want[i] ? h_values(want[i], NULL) : NULL;
    char name[80];
    snprintf(name, sizeof name, "%s of rows with -inf on cuda:0", what[i]);
    if (w && got[i]) h_tensor_close(name, got[i], w, kiln_numel(want[i]), 1e-6, 1e-5);
    else H_CHECK(false, "%s: %s", name, kiln_last_error_message());
    free(w);
  }
  kiln_scope_end();
}


/* add (alpha 1 and not), sub and mul of an f32 and a 16-bit float (either side) into f32:
** CUDA widens the 16-bit operand as it reads it (one kernel, no cast first); the result
** must be the CPU's to the bit (the widening is exact, the arithmetic the same). Contiguous
** of an odd length (the vector loop's tail), a row broadcast, a transposed operand. */
static void mixed_dtype_binary(void) {
  kiln_scope_begin();
  kiln_device cpu = kiln_device_cpu(), gpu = kiln_device_cuda(0);
  kiln_generator *g = kiln_generator_new(5);
  const kiln_dtype halves[2] = {KILN_BF16, KILN_F16};
  static const char *const layout[3] = {"contiguous", "row broadcast", "transposed"};
  for (int h = 0; h < 2; h++)
    for (int side = 0; side < 2; side++)
      for (int l = 0; l < 3; l++)
        for (int op = 0; op < 4; op++) {
          kiln_tensor *f = l == 0 ? kiln_randn(KILN_SHAPE(100003), KILN_F32, cpu, g)
                                  : kiln_randn(KILN_SHAPE(37, 129), KILN_F32, cpu, g);
          kiln_tensor *hv = l == 0 ? kiln_randn(KILN_SHAPE(100003), halves[h], cpu, g)
                          : l == 1 ? kiln_randn(KILN_SHAPE(129), halves[h], cpu, g)
                                   : kiln_transpose(kiln_randn(KILN_SHAPE(129, 37), halves[h], cpu, g), 0, 1);
          kiln_tensor *a = side ? hv : f, *b = side ? f : hv;
          kiln_tensor *ag = kiln_to_device(a, gpu), *bg = kiln_to_device(b, gpu);
          kiln_tensor *want = op == 0 ? kiln_add(a, b) : op == 1 ? kiln_axpy(a, 0.375, b) : op == 2 ? kiln_sub(a, b) : kiln_mul(a, b);
          kiln_tensor *got = op == 0 ? kiln_add(ag, bg) : op == 1 ? kiln_axpy(ag, 0.375, bg) : op == 2 ? kiln_sub(ag, bg) : kiln_mul(ag, bg);
          char name[120];
          static const char *const ops[4] = {"add", "axpy 0.375", "sub", "mul"};
          snprintf(name, sizeof name, "%s of %s and %s (%s) on cuda:0 is the CPU's", ops[op],
                   kiln_dtype_name(kiln_dtype_of(a)), kiln_dtype_name(kiln_dtype_of(b)), layout[l]);
          double *w = want ? h_values(want, NULL) : NULL;
          if (w && got && kiln_dtype_of(got) == KILN_F32) h_tensor_close(name, got, w, kiln_numel(want), 0, 0);
          else H_CHECK(false, "%s: %s", name, kiln_last_error_message());
          free(w);
        }
  kiln_generator_free(g);
  kiln_scope_end();
}

/* Batched matmul on permuted operands, attention's q @ k^T: batch dims (B, H) of a
** (B, T, H, D) tensor collapse only partly (H has stride D, B does not), so the CUDA
** path makes one strided-batched call per B of H products. Sizes past the small-matmul
** kernel's reach (cuBLAS); f32, bf16 and f16 against the CPU, forward and both gradients. */
static void matmul_permuted_batch(void) {
  enum { B = 3, T = 72, H = 5, D = 40 };
  static const kiln_dtype dts[] = {KILN_F32, KILN_BF16, KILN_F16};
  for (int di = 0; di < 3; di++) {
    kiln_scope_begin();
    kiln_dtype dt = dts[di];
    double *v[2][3] = {{NULL}};
    kiln_tensor *got[3] = {NULL};
    for (int side = 0; side < 2; side++) {
      kiln_device d = side ? kiln_device_cuda(0) : kiln_device_cpu();
      kiln_generator *gen = kiln_generator_new(7);
      kiln_tensor *q = kiln_to_dtype(kiln_randn(KILN_SHAPE(B, T, H, D), KILN_F32, d, gen), dt);
      kiln_tensor *k = kiln_to_dtype(kiln_randn(KILN_SHAPE(B, T, H, D), KILN_F32, d, gen), dt);
      kiln_tensor *g = kiln_to_dtype(kiln_randn(KILN_SHAPE(B, H, T, T), KILN_F32, d, gen), dt);
      kiln_generator_free(gen);
      kiln_requires_grad_(q, true);
      kiln_requires_grad_(k, true);
      kiln_tensor *qp = kiln_permute(q, 4, (const int[]){0, 2, 1, 3});               /* (B, H, T, D) */
      kiln_tensor *kt = kiln_permute(k, 4, (const int[]){0, 2, 3, 1});               /* (B, H, D, T) */
      kiln_tensor *s = kiln_matmul(qp, kt);                                            /* (B, H, T, T) */
      H_CHECK(s && kiln_backward(s, g) == KILN_OK, "matmul permuted %s side %d: %s", kiln_dtype_name(dt), side,
              kiln_last_error_message());
      kiln_tensor *r[3] = {s, kiln_grad(q), kiln_grad(k)};
      for (int i = 0; i < 3; i++) {
        v[side][i] = h_values(r[i], NULL);
        got[i] = r[i];
      }
    }
    double rtol, atol;
    h_dtype_tol(dt, &rtol, &atol);
    static const char *const what[3] = {"q @ k^T", "dq", "dk"};
    for (int i = 0; i < 3; i++) {
      char name[120];
      snprintf(name, sizeof name, "cuda:0 matmul permuted batch %s: %s", kiln_dtype_name(dt), what[i]);
      if (v[0][i] && got[i]) h_tensor_close(name, got[i], v[0][i], kiln_numel(got[i]), rtol * 8, atol * 8);
      else H_CHECK(false, "%s: no result", name);
    }
    for (int k = 0; k < 6; k++) free(v[k / 3][k % 3]);
    kiln_scope_end();
  }
}


/* The math attention path's two memory-bound ops at their shapes (scaled down): where
** with an f32 (T, T) causal mask broadcast over (B, H) (CUDA casts the mask once, not
** per batch, and reads it modulo T*T with 16-byte loads), and softmax / log_softmax and
** their gradients over contiguous rows of 32 W NV elements (the register-row kernel:
** C = 128, 256, 1024 for f32; 256, 1024 for bf16; a row of -inf and a NaN row among
** them), against the CPU. Also a mask broadcast along the inner dim (no 16-byte path). */
static void attention_rows(void) {
  static const kiln_dtype dts[] = {KILN_F32, KILN_BF16, KILN_F16};
  static const int64_t cs[] = {128, 256, 1024, 40};
  for (int di = 0; di < 3; di++)
    for (int ci = 0; ci < 4; ci++) {
      kiln_scope_begin();
      kiln_dtype dt = dts[di];
      const int64_t B = 2, H = 3, T = cs[ci];
      double *v[2][6] = {{NULL}};
      kiln_tensor *got[6] = {NULL};
      for (int side = 0; side < 2; side++) {
        kiln_device d = side ? kiln_device_cuda(0) : kiln_device_cpu();
        kiln_generator *gen = kiln_generator_new(11);
        kiln_tensor *x = kiln_to_dtype(kiln_randn(KILN_SHAPE(B, H, 4, T), KILN_F32, d, gen), dt);
        kiln_tensor *g = kiln_to_dtype(kiln_randn(KILN_SHAPE(B, H, 4, T), KILN_F32, d, gen), dt);
        kiln_generator_free(gen);
        kiln_requires_grad_(x, true);
        kiln_tensor *keep = kiln_tril(kiln_ones(2, (int64_t[]){4, T}, KILN_F32, d), 0);  /* (4, T) */
        kiln_tensor *col = kiln_tril(kiln_ones(2, (int64_t[]){4, 1}, KILN_F32, d), -1); /* (4, 1) */
        kiln_tensor *ninf = kiln_scalar(-INFINITY, dt, d);
        kiln_tensor *s = kiln_where(keep, x, ninf);
        kiln_tensor *s2 = kiln_where(col, x, kiln_scalar(0.0, dt, d)); /* row 0: zeros */
        kiln_tensor *p = kiln_softmax(s, 3), *lp = kiln_log_softmax(s2, 3);
        kiln_tensor *loss = kiln_add(kiln_sum_all(kiln_mul(p, g)), kiln_sum_all(kiln_mul(lp, g)));
        H_CHECK(loss && kiln_backward(loss, NULL) == KILN_OK, "attention rows %s T %lld side %d: %s",
                kiln_dtype_name(dt), (long long)T, side, kiln_last_error_message());
        /* a row of -inf and a NaN row straight into softmax */
        kiln_tensor *w = kiln_where(kiln_tril(kiln_ones(2, (int64_t[]){4, T}, KILN_F32, d), -1), x, ninf);
        kiln_tensor *row3 = kiln_eq(kiln_reshape(kiln_arange(0, 4, 1, KILN_F32, d), KILN_SHAPE(4, 1)),
                                    kiln_scalar(3.0, KILN_F32, d)); /* (4, 1): row 3 */
        kiln_tensor *pw = kiln_softmax(kiln_where(row3, kiln_scalar(NAN, dt, d), kiln_narrow(w, 1, 0, 1)), 3);
        kiln_tensor *r[6] = {s, p, lp, kiln_grad(x), pw, s2};
        for (int i = 0; i < 6; i++) {
          v[side][i] = r[i] ? h_values(r[i], NULL) : NULL;
          got[i] = r[i];
        }
      }
      double rtol, atol;
      h_dtype_tol(dt, &rtol, &atol);
      static const char *const what[6] = {"where (causal mask)", "softmax", "log_softmax", "grad", "softmax of -inf / NaN rows", "where (column mask)"};
      for (int i = 0; i < 6; i++) {
        char name[140];
        snprintf(name, sizeof name, "cuda:0 attention rows %s T %lld: %s", kiln_dtype_name(dt), (long long)T, what[i]);
        if (v[0][i] && got[i]) h_tensor_close(name, got[i], v[0][i], kiln_numel(got[i]), rtol * 4, atol * 4);
        else H_CHECK(false, "%s: no result: %s", name, kiln_last_error_message());
      }
      for (int k = 0; k < 12; k++) free(v[k / 6][k % 6]);
      kiln_scope_end();
    }
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_cuda_ops");
  h_set_cross_only(true);
  if (kiln_device_count(KILN_DEVICE_CUDA) == 0) return h_finish(); /* 77: skipped */
  ew_family();
  act_family();
  red_family();
  sm_family();
  mm_family();
  ix_family();
  cmp_family();
  loss_family();
  vw_family();
  masked_rows();
  mixed_dtype_binary();
  matmul_permuted_batch();
  attention_rows();
  return h_finish();
}
