/*
** linear_cross_entropy (src/ops/ops_linear_ce.c): the harness's cases (f64 reference of
** the loss, gradcheck of x and W, the cross-backend part), and against the unfused pair
** kiln_linear then kiln_cross_entropy, with the rows split into several chunks
** (KILN_LCE_CHUNK_ELEMS), ignored targets, mean and sum, f32/bf16/f16; kiln_gpt_forward_loss
** against the model's logits and cross_entropy; bad input.
*/
#define _POSIX_C_SOURCE 200809L /* setenv */
#include "harness.h"

#include <kiln_nn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const int lce_sum = 1;

/* in: x (M, K), W (V, K), target (M) */
static kiln_tensor *lce_b(kiln_tensor **in, const void *ctx) {
  return kiln_linear_cross_entropy(in[0], in[1], in[2], ctx ? KILN_REDUCTION_SUM : KILN_REDUCTION_MEAN, -100, 0.0);
}
static int lce_r(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in;
  const h_arr *x = &in[0], *w = &in[1], *t = &in[2];
  int64_t M = x->shape[0], K = x->shape[1], V = w->shape[0];
  out->ndim = 0;
  if (!out->data) return 0;
  double s = 0;
  for (int64_t r = 0; r < M; r++) {
    double mx = -INFINITY, z[64];
    for (int64_t v = 0; v < V; v++) {
      double a = 0;
      for (int64_t k = 0; k < K; k++) a += x->data[r * K + k] * w->data[v * K + k];
      z[v] = a;
      mx = a > mx ? a : mx;
    }
    double se = 0;
    for (int64_t v = 0; v < V; v++) se += exp(z[v] - mx);
    s += mx + log(se) - z[(int64_t)t->data[r]];
  }
  out->data[0] = ctx ? s : s / (double)M;
  return 0;
}

#define LX {.ndim = 2, .shape = {H_SYM(0), H_SYM(1)}, .fill = H_RANDN, .diff = true}
#define LW {.ndim = 2, .shape = {H_SYM(2), H_SYM(1)}, .fill = H_RANDN, .diff = true}
#define LT {.ndim = 1, .shape = {H_SYM(0)}, .fill = H_INDEX, .hi_sym = 3, .dtype = KILN_I64}

static const h_case lce_cases[] = {
    {.name = "linear_cross_entropy mean", .fn = lce_b, .ref = lce_r, .n_in = 3, .in = {LX, LW, LT},
     .sym = {5, 4, 7, 7}, .flags = H_NO_SIZE0 | H_NO_SIZE1},
    {.name = "linear_cross_entropy sum", .fn = lce_b, .ref = lce_r, .ctx = &lce_sum, .n_in = 3, .in = {LX, LW, LT},
     .sym = {5, 4, 7, 7}, .flags = H_NO_SIZE0 | H_NO_SIZE1},
};

/* The fused op against linear + cross_entropy on dev: loss, dx, dW; targets with ignored
** rows; several chunks when chunk_elems > 0. */
static void against_pair(kiln_device dev, kiln_dtype dt, int64_t M, int64_t K, int64_t V, kiln_reduction red,
                         const char *chunk_elems) {
  kiln_scope_begin();
  if (chunk_elems) setenv("KILN_LCE_CHUNK_ELEMS", chunk_elems, 1);
  else unsetenv("KILN_LCE_CHUNK_ELEMS");
  kiln_generator *gen = kiln_generator_new(5);
  kiln_tensor *x0 = kiln_randn(KILN_SHAPE(M, K), KILN_F32, dev, gen);
  kiln_tensor *w0 = kiln_mul_scalar(kiln_randn(KILN_SHAPE(V, K), KILN_F32, dev, gen), 0.3);
  kiln_tensor *t = kiln_randint(0, V, KILN_SHAPE(M), KILN_I64, dev, gen);
  kiln_generator_free(gen);
  /* every third target ignored */
  kiln_tensor *th = kiln_to_device(t, kiln_device_cpu());
  int64_t *tv = th ? (int64_t *)kiln_data_ptr(th) : NULL;
  for (int64_t r = 0; tv && r < M; r += 3) tv[r] = -100;
  t = th ? kiln_to_device(th, dev) : NULL;
  double *v[2][3] = {{NULL}};
  for (int fused = 0; fused < 2; fused++) {
    kiln_tensor *x = kiln_to_dtype(x0, dt), *w = kiln_to_dtype(w0, dt);
    if (x == x0) x = kiln_clone(x0);
    if (w == w0) w = kiln_clone(w0);
    kiln_requires_grad_(x, true);
    kiln_requires_grad_(w, true);
    kiln_tensor *loss = fused ? kiln_linear_cross_entropy(x, w, t, red, -100, 0.0)
                              : kiln_cross_entropy(kiln_linear(x, w, NULL), t, red, -100, 0.0);
    H_CHECK(loss && kiln_backward(loss, NULL) == KILN_OK, "linear_cross_entropy %s fused %d: %s",
            kiln_dtype_name(dt), fused, kiln_last_error_message());
    kiln_tensor *r[3] = {loss, kiln_grad(x), kiln_grad(w)};
    for (int i = 0; i < 3; i++) v[fused][i] = r[i] ? h_values(r[i], NULL) : NULL;
  }
  double rtol, atol;
  h_dtype_tol(dt, &rtol, &atol);
  static const char *const what[3] = {"loss", "dx", "dW"};
  int64_t n[3] = {1, M * K, V * K};
  for (int i = 0; i < 3; i++) {
    char name[200];
    snprintf(name, sizeof name, "linear_cross_entropy %s on %s (%lld, %lld) x (%lld, %lld)^T %s chunks %s vs the pair: %s",
             kiln_dtype_name(dt), kiln_device_str(dev, (char[32]){0}, 32), (long long)M, (long long)K, (long long)V,
             (long long)K, red == KILN_REDUCTION_SUM ? "sum" : "mean", chunk_elems ? chunk_elems : "default", what[i]);
    /* dW sums its chunks in the dtype (one rounding a chunk): 16-bit gets 4x the tolerance */
    double s = (i == 2 && dt != KILN_F32 && dt != KILN_F64) ? 4.0 : 1.0;
    if (v[0][i] && v[1][i]) h_close(name, v[1][i], v[0][i], n[i], rtol * s, atol * s);
    else H_CHECK(false, "%s: no result", name);
  }
  for (int k = 0; k < 6; k++) free(v[k / 3][k % 3]);
  unsetenv("KILN_LCE_CHUNK_ELEMS");
  kiln_scope_end();
}

/* kiln_gpt_forward_loss against the model's logits and cross_entropy (a small GPT). */
static void gpt_loss(kiln_device dev) {
  kiln_scope_begin();
  setenv("KILN_LCE_CHUNK_ELEMS", "400", 1); /* several chunks */
  kiln_gpt_config cfg = kiln_gpt2_config();
  cfg.n_layer = 2, cfg.n_head = 2, cfg.n_embd = 16, cfg.vocab_size = 37, cfg.block_size = 8;
  kiln_tensor *idx = kiln_randint(0, 37, KILN_SHAPE(3, 8), KILN_I64, dev, NULL);
  kiln_tensor *tgt = kiln_randint(0, 37, KILN_SHAPE(24), KILN_I64, dev, NULL);
  double *v[2][2] = {{NULL}};
  kiln_module *m = NULL;
  for (int fused = 0; fused < 2; fused++) {
    kiln_module_free(m);
    kiln_manual_seed(3); /* the same model twice */
    m = kiln_gpt_new(&cfg, KILN_F32, dev, NULL);
    H_CHECK(m != NULL, "kiln_gpt_new: %s", kiln_last_error_message());
    if (!m) break;
    kiln_tensor *loss = fused ? kiln_gpt_forward_loss(m, idx, tgt, -100)
                              : kiln_cross_entropy(kiln_reshape(kiln_module_forward(m, idx), KILN_SHAPE(24, 37)), tgt,
                                                   KILN_REDUCTION_MEAN, -100, 0.0);
    H_CHECK(loss && kiln_backward(loss, NULL) == KILN_OK, "gpt loss fused %d: %s", fused, kiln_last_error_message());
    v[fused][0] = loss ? h_values(loss, NULL) : NULL;
    kiln_tensor *g = kiln_grad(kiln_module_param(m, "wte.weight"));
    v[fused][1] = g ? h_values(g, NULL) : NULL;
  }
  char name[96];
  snprintf(name, sizeof name, "kiln_gpt_forward_loss on %s: loss", kiln_device_str(dev, (char[32]){0}, 32));
  if (v[0][0] && v[1][0]) h_close(name, v[1][0], v[0][0], 1, 1e-5, 1e-6);
  else H_CHECK(false, "%s: no result", name);
  snprintf(name, sizeof name, "kiln_gpt_forward_loss on %s: wte grad", kiln_device_str(dev, (char[32]){0}, 32));
  if (v[0][1] && v[1][1]) h_close(name, v[1][1], v[0][1], 37 * 16, 1e-5, 1e-6);
  else H_CHECK(false, "%s: no result", name);
  /* bad input: another module, targets of another size */
  kiln_module *lin = kiln_linear_new(4, 4, true, KILN_F32, dev, NULL);
  H_EXPECT_ERR(kiln_gpt_forward_loss(lin, idx, tgt, -100), KILN_ERR_INVALID_ARGUMENT, "forward_loss of a Linear");
  H_EXPECT_ERR(kiln_gpt_forward_loss(m, idx, kiln_narrow(tgt, 0, 0, 10), -100), KILN_ERR_SHAPE,
               "forward_loss with 10 targets for 24 tokens");
  kiln_module_free(lin);
  for (int k = 0; k < 4; k++) free(v[k / 2][k % 2]);
  kiln_module_free(m);
  unsetenv("KILN_LCE_CHUNK_ELEMS");
  kiln_scope_end();
}

static void bad_input(void) {
  kiln_scope_begin();
  kiln_device cpu = kiln_device_cpu();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(4, 3), KILN_F32, cpu, NULL);
  kiln_tensor *w = kiln_randn(KILN_SHAPE(5, 3), KILN_F32, cpu, NULL);
  kiln_tensor *t = kiln_zeros(KILN_SHAPE(4), KILN_I64, cpu);
  H_EXPECT_ERR(kiln_linear_cross_entropy(x, kiln_randn(KILN_SHAPE(5, 2), KILN_F32, cpu, NULL), t,
                                         KILN_REDUCTION_MEAN, -100, 0),
               KILN_ERR_SHAPE, "weight of another width");
  H_EXPECT_ERR(kiln_linear_cross_entropy(x, w, kiln_zeros(KILN_SHAPE(3), KILN_I64, cpu), KILN_REDUCTION_MEAN, -100, 0),
               KILN_ERR_SHAPE, "3 targets for 4 rows");
  H_EXPECT_ERR(kiln_linear_cross_entropy(x, w, kiln_zeros(KILN_SHAPE(4), KILN_F32, cpu), KILN_REDUCTION_MEAN, -100, 0),
               KILN_ERR_DTYPE, "float targets");
  H_EXPECT_ERR(kiln_linear_cross_entropy(x, kiln_to_dtype(w, KILN_F64), t, KILN_REDUCTION_MEAN, -100, 0),
               KILN_ERR_DTYPE, "f32 input, f64 weight");
  H_EXPECT_ERR(kiln_linear_cross_entropy(x, w, t, KILN_REDUCTION_NONE, -100, 0), KILN_ERR_INVALID_ARGUMENT,
               "reduction none");
  H_CHECK(!kiln_linear_cross_entropy(x, w, kiln_zeros(KILN_SHAPE(2), KILN_I64, cpu), KILN_REDUCTION_SUM, -100, 0),
          "2 targets for 4 rows fails");
  const char *msg = kiln_last_error_message();
  H_CHECK(msg && strstr(msg, "kiln_linear_cross_entropy"), "the error names the op: %s", msg ? msg : "(none)");
  kiln_scope_end();
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_linear_ce");
  h_run_cases(lce_cases, (int)(sizeof lce_cases / sizeof lce_cases[0]));
  static const kiln_dtype dts[] = {KILN_F32, KILN_BF16, KILN_F16};
  if (!h_cross_only() && !h_support_mode()) {
    kiln_device cpu = kiln_device_cpu();
    for (int i = 0; i < 3; i++) {
      against_pair(cpu, dts[i], 37, 24, 29, KILN_REDUCTION_MEAN, "100"); /* 3 rows a chunk: 13 chunks */
      against_pair(cpu, dts[i], 37, 24, 29, KILN_REDUCTION_SUM, NULL);
      /* the mean in one chunk (CROSS_ENTROPY_MEAN's fused D), the sum over several (each
      ** chunk's fused D), and V a multiple of the pad (no pad columns: D is not filled) */
      against_pair(cpu, dts[i], 37, 24, 29, KILN_REDUCTION_MEAN, NULL);
      against_pair(cpu, dts[i], 37, 24, 29, KILN_REDUCTION_SUM, "100");
      against_pair(cpu, dts[i], 37, 24, 64, KILN_REDUCTION_MEAN, NULL);
      against_pair(cpu, dts[i], 37, 24, 64, KILN_REDUCTION_SUM, "200"); /* 3 rows a chunk */
    }
    gpt_loss(cpu);
    bad_input();
  }
  /* the chunked path on cuBLAS: odd V, padded rows (test_ops_linear_ce_cuda runs only these) */
  if (h_backend_checks("cuda") && kiln_device_count(KILN_DEVICE_CUDA) > 0) {
    kiln_device cuda = kiln_device_cuda(0);
    for (int i = 0; i < 3; i++) {
      against_pair(cuda, dts[i], 300, 64, 1001, KILN_REDUCTION_MEAN, "50000"); /* 49 rows a chunk: 7 chunks */
      against_pair(cuda, dts[i], 300, 64, 1001, KILN_REDUCTION_SUM, NULL);
      /* long rows (the block-a-row kernels): the mean's D with the count as a divisor,
      ** rows staged in shared memory (f32 50257 is too long to stage: read twice) */
      against_pair(cuda, dts[i], 120, 32, 3001, KILN_REDUCTION_MEAN, "40000"); /* 13 rows a chunk */
      against_pair(cuda, dts[i], 24, 16, 50257, KILN_REDUCTION_MEAN, "400000"); /* 7 rows a chunk */
    }
    gpt_loss(cuda);
  }
  return h_finish();
}
