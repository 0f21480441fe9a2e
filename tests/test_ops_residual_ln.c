/*
** residual_layer_norm (src/ops/ops_layernorm.c): the harness's cases on y + 0.37 s (f64
** reference, gradcheck through both outputs, the cross-backend part), and the mixed
** dtypes of a GPT block under bf16 autocast (x f32, r bf16, y bf16) against the unfused
** ops (add, layer_norm, cast) with gradients reaching both outputs: the CPU's composed
** path and, where there is a CUDA device, its RESIDUAL_LAYER_NORM kernels. A small GPT's
** loss and every parameter's gradient with KILN_GPT_RESIDUAL_LN=1 (opt-in: every
** residual add fused with the norm after it) against =0 (the unfused ops), f32 and under bf16 autocast.
** A linear's output as r: where the device's kernel sums r's gradient's columns (CUDA), the
** linear's bias gradient comes from there (counted: one flagged kernel, no row-sum product)
** and equals the unfused ops'; not when r's gradient also has another way to go. r of x's
** trailing dims, repeated over its batch (a position embedding). The output padded with a
** ones column for the linear after it (its bias gradient from its weight product). Bad input.
*/
#define _POSIX_C_SOURCE 200809L /* setenv */
#include "harness.h"

#include <kiln_nn.h>

#include "core/kiln_int.h" /* kiln__dispatch_observe, ones_col */
#include "ext/kiln_ext.h"    /* kiln__residual_layer_norm_ones */

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* in: x (R, N), r (R, N), w (N), b (N) -> y + 0.37 s */
static kiln_tensor *rln_b(kiln_tensor **in, const void *ctx) {
  (void)ctx;
  kiln_tensor *s = NULL;
  kiln_tensor *y = kiln_residual_layer_norm(in[0], in[1], in[2], in[3], 1e-5, kiln_dtype_of(in[0]), &s);
  return kiln_add(y, kiln_mul_scalar(s, 0.37));
}
static int rln_r(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in, (void)ctx;
  const h_arr *x = &in[0], *r = &in[1], *w = &in[2], *b = &in[3];
  int64_t N = x->shape[x->ndim - 1], R = h_numel(x->ndim, x->shape) / (N ? N : 1);
  out->ndim = x->ndim;
  memcpy(out->shape, x->shape, sizeof out->shape);
  if (!out->data) return 0;
  for (int64_t i = 0; i < R; i++) {
    double m = 0, v = 0;
    for (int64_t j = 0; j < N; j++) m += x->data[i * N + j] + r->data[i * N + j];
    m /= (double)N;
    for (int64_t j = 0; j < N; j++) {
      double d = x->data[i * N + j] + r->data[i * N + j] - m;
      v += d * d;
    }
    v /= (double)N;
    double rs = 1.0 / sqrt(v + 1e-5);
    for (int64_t j = 0; j < N; j++) {
      double sv = x->data[i * N + j] + r->data[i * N + j];
      out->data[i * N + j] = (sv - m) * rs * w->data[j] + b->data[j] + 0.37 * sv;
    }
  }
  return 0;
}

#define RIN(...) {.ndim = 2, .shape = {__VA_ARGS__}, .fill = H_RANDN, .diff = true}
#define RV {.ndim = 1, .shape = {H_SYM(1)}, .fill = H_RANDN, .diff = true}

static const h_case rln_cases[] = {
    {.name = "residual_layer_norm", .fn = rln_b, .ref = rln_r, .n_in = 4,
     .in = {RIN(H_SYM(0), H_SYM(1)), RIN(H_SYM(0), H_SYM(1)), RV, RV}, .sym = {3, 6}, .flags = H_NO_SIZE0 | H_NO_SIZE1},
    {.name = "residual_layer_norm wide rows", .fn = rln_b, .ref = rln_r, .n_in = 4,
     .in = {RIN(H_SYM(0), H_SYM(1)), RIN(H_SYM(0), H_SYM(1)), RV, RV}, .sym = {5, 77},
     .flags = H_NO_SIZE0 | H_NO_SIZE1},
};

/* The fused run's values against the reference's, or a failure when either is missing. */
static void check_pair(const char *name, const double *fused, const double *ref, int64_t n, double rtol, double atol) {
  if (fused && ref) h_close(name, fused, ref, n, rtol, atol);
  else H_CHECK(false, "%s: no result", name);
}

/* A norm's weight (1 + 0.1 N(0, 1)) and bias (0.1 N(0, 1)) of width N. */
static void norm_params(kiln_device dev, kiln_generator *gen, int64_t N, kiln_tensor **w, kiln_tensor **b) {
  *w = kiln_add_scalar(kiln_mul_scalar(kiln_randn(KILN_SHAPE(N), KILN_F32, dev, gen), 0.1), 1.0);
  *b = kiln_mul_scalar(kiln_randn(KILN_SHAPE(N), KILN_F32, dev, gen), 0.1);
}

/* A GPT block's pattern under bf16 autocast: x f32, r bf16, y bf16; loss = sum(y * gy) +
** sum(s * gs), so both outputs get gradients. Fused vs unfused on dev. */
static void block_pattern(kiln_device dev, int64_t R, int64_t N, kiln_dtype rdt, kiln_dtype ydt, bool with_gs) {
  kiln_scope_begin();
  kiln_generator *gen = kiln_generator_new(9);
  kiln_tensor *x0 = kiln_randn(KILN_SHAPE(R, N), KILN_F32, dev, gen);
  kiln_tensor *r0 = kiln_to_dtype(kiln_randn(KILN_SHAPE(R, N), KILN_F32, dev, gen), rdt);
  kiln_tensor *w0, *b0;
  norm_params(dev, gen, N, &w0, &b0);
  kiln_tensor *gy = kiln_to_dtype(kiln_randn(KILN_SHAPE(R, N), KILN_F32, dev, gen), ydt);
  kiln_tensor *gs = kiln_randn(KILN_SHAPE(R, N), KILN_F32, dev, gen);
  kiln_generator_free(gen);
  double *v[2][6] = {{NULL}};
  int64_t n[6] = {R * N, R * N, R * N, R * N, N, N};
  for (int fused = 0; fused < 2; fused++) {
    kiln_tensor *x = kiln_clone(x0), *r = kiln_clone(r0), *w = kiln_clone(w0), *b = kiln_clone(b0);
    kiln_tensor *leaves[4] = {x, r, w, b};
    for (int i = 0; i < 4; i++) kiln_requires_grad_(leaves[i], true);
    kiln_tensor *y, *s = NULL;
    if (fused) {
      y = kiln_residual_layer_norm(x, r, w, b, 1e-5, ydt, &s);
    } else {
      s = kiln_add(x, r); /* promotes r */
      y = kiln_to_dtype(kiln_layer_norm(s, 1, (const int64_t[]){N}, w, b, 1e-5), ydt);
    }
    kiln_tensor *loss = kiln_sum_all(kiln_to_dtype(kiln_mul(y, gy), KILN_F32));
    if (with_gs) loss = kiln_add(loss, kiln_sum_all(kiln_mul(s, gs)));
    H_CHECK(loss && kiln_backward(loss, NULL) == KILN_OK, "residual_layer_norm pattern fused %d: %s", fused,
            kiln_last_error_message());
    kiln_tensor *res[6] = {y, s, kiln_grad(x), kiln_grad(r), kiln_grad(w), kiln_grad(b)};
    for (int i = 0; i < 6; i++) v[fused][i] = res[i] ? h_values(res[i], NULL) : NULL;
    if (fused) {
      H_CHECK(kiln_dtype_of(y) == ydt && kiln_dtype_of(s) == KILN_F32 && res[3] && kiln_dtype_of(res[3]) == rdt,
              "residual_layer_norm dtypes: y %s, s %s, dr %s", kiln_dtype_name(kiln_dtype_of(y)),
              kiln_dtype_name(kiln_dtype_of(s)), res[3] ? kiln_dtype_name(kiln_dtype_of(res[3])) : "none");
    }
  }
  static const char *const what[6] = {"y", "s", "dx", "dr", "dweight", "dbias"};
  for (int i = 0; i < 6; i++) {
    char name[200], db[32];
    snprintf(name, sizeof name, "residual_layer_norm on %s (%lld, %lld) r %s y %s%s vs add+layer_norm+cast: %s",
             kiln_device_str(dev, db, sizeof db), (long long)R, (long long)N, kiln_dtype_name(rdt),
             kiln_dtype_name(ydt), with_gs ? ", s's own gradient" : "", what[i]);
    /* the same operations in the same order: equal up to the f32 sums' order (the weight
    ** sums over rows run in another order on CUDA), and one ulp of the 16-bit dtypes */
    double rtol = 2e-5, atol = 2e-5;
    if ((i == 0 && ydt != KILN_F32) || (i == 3 && rdt != KILN_F32)) rtol = atol = 8e-3;
    if (i >= 4) rtol = atol = 1e-4;
    check_pair(name, v[1][i], v[0][i], n[i], rtol, atol);
  }
  for (int k = 0; k < 12; k++) free(v[k / 6][k % 6]);
  kiln_scope_end();
}

/* r (T, N) repeated over x (B, T, N)'s batch (a GPT's position embedding under block 0's
** ln_1): against kiln_add's broadcast, layer_norm and the cast; r's gradient is summed
** over the batch. rdt f32 (the embedding) or bf16. */
static void broadcast_pattern(kiln_device dev, int64_t B, int64_t T, int64_t N, kiln_dtype rdt) {
  kiln_scope_begin();
  kiln_generator *gen = kiln_generator_new(13);
  kiln_tensor *x0 = kiln_randn(KILN_SHAPE(B, T, N), KILN_F32, dev, gen);
  kiln_tensor *r0 = kiln_to_dtype(kiln_randn(KILN_SHAPE(T, N), KILN_F32, dev, gen), rdt);
  kiln_tensor *w0, *b0;
  norm_params(dev, gen, N, &w0, &b0);
  kiln_tensor *gy = kiln_to_dtype(kiln_randn(KILN_SHAPE(B, T, N), KILN_F32, dev, gen), KILN_BF16);
  kiln_tensor *gs = kiln_randn(KILN_SHAPE(B, T, N), KILN_F32, dev, gen);
  kiln_generator_free(gen);
  double *v[2][6] = {{NULL}};
  int64_t n[6] = {B * T * N, B * T * N, B * T * N, T * N, N, N};
  for (int fused = 0; fused < 2; fused++) {
    kiln_tensor *x = kiln_clone(x0), *r = kiln_clone(r0), *w = kiln_clone(w0), *b = kiln_clone(b0);
    kiln_tensor *leaves[4] = {x, r, w, b};
    for (int i = 0; i < 4; i++) kiln_requires_grad_(leaves[i], true);
    kiln_tensor *y, *s = NULL;
    if (fused) {
      y = kiln_residual_layer_norm(x, r, w, b, 1e-5, KILN_BF16, &s);
    } else {
      s = kiln_add(x, r);
      y = kiln_to_dtype(kiln_layer_norm(s, 1, (const int64_t[]){N}, w, b, 1e-5), KILN_BF16);
    }
    kiln_tensor *loss = kiln_add(kiln_sum_all(kiln_to_dtype(kiln_mul(y, gy), KILN_F32)), kiln_sum_all(kiln_mul(s, gs)));
    H_CHECK(loss && kiln_backward(loss, NULL) == KILN_OK, "residual_layer_norm, r repeated, fused %d: %s", fused,
            kiln_last_error_message());
    kiln_tensor *res[6] = {y, s, kiln_grad(x), kiln_grad(r), kiln_grad(w), kiln_grad(b)};
    for (int i = 0; i < 6; i++) v[fused][i] = res[i] ? h_values(res[i], NULL) : NULL;
    if (fused)
      H_CHECK(res[3] && kiln_dtype_of(res[3]) == rdt && kiln_ndim(res[3]) == 2, "r's gradient: r's dtype and shape");
  }
  static const char *const what[6] = {"y", "s", "dx", "dr", "dweight", "dbias"};
  for (int i = 0; i < 6; i++) {
    char name[200], db[32];
    snprintf(name, sizeof name, "residual_layer_norm on %s, r %s (%lld, %lld) repeated over %lld vs add+layer_norm+cast: %s",
             kiln_device_str(dev, db, sizeof db), kiln_dtype_name(rdt), (long long)T, (long long)N, (long long)B,
             what[i]);
    double tol = (i == 0 || (i == 3 && rdt != KILN_F32)) ? 8e-3 : i >= 3 ? 1e-4 : 2e-5;
    check_pair(name, v[1][i], v[0][i], n[i], tol, tol);
  }
  for (int k = 0; k < 12; k++) free(v[k / 6][k % 6]);
  kiln_scope_end();
}

/* A small GPT, one forward (loss through kiln_gpt_forward_loss) and backward, with the
** fused norms and without: the loss and every parameter's gradient. */
static void gpt_fused_norms(kiln_device dev, kiln_dtype autocast) {
  kiln_scope_begin();
  kiln_gpt_config cfg = kiln_gpt2_config();
  cfg.n_layer = 3, cfg.n_head = 2, cfg.n_embd = 32, cfg.vocab_size = 50, cfg.block_size = 16;
  kiln_tensor *idx = kiln_randint(0, 50, KILN_SHAPE(2, 16), KILN_I64, dev, NULL);
  kiln_tensor *tgt = kiln_randint(0, 50, KILN_SHAPE(32), KILN_I64, dev, NULL);
  enum { MAXP = 64 };
  double *v[2][MAXP + 1] = {{NULL}};
  int64_t n[MAXP + 1] = {0};
  const char *names[MAXP];
  int np = 0;
  for (int fused = 0; fused < 2; fused++) {
    setenv("KILN_GPT_RESIDUAL_LN", fused ? "1" : "0", 1);
    kiln_manual_seed(4);
    kiln_module *m = kiln_gpt_new(&cfg, KILN_F32, dev, NULL);
    if (!m) break;
    if (autocast != KILN_F32) kiln_autocast_begin(dev.type, autocast);
    kiln_tensor *loss = kiln_gpt_forward_loss(m, idx, tgt, -100);
    if (autocast != KILN_F32) kiln_autocast_end();
    H_CHECK(loss && kiln_backward(loss, NULL) == KILN_OK, "gpt fused norms %d: %s", fused, kiln_last_error_message());
    v[fused][MAXP] = loss ? h_values(loss, NULL) : NULL;
    kiln_tensor *ps[MAXP];
    np = kiln_module_named_parameters(m, names, ps, MAXP);
    for (int i = 0; i < np && i < MAXP; i++) {
      kiln_tensor *g = kiln_grad(ps[i]);
      v[fused][i] = g ? h_values(g, &n[i]) : NULL;
    }
    if (fused) { /* compare while the names are alive */
      char dbuf[32];
      for (int i = -1; i < np && i < MAXP; i++) {
        int k = i < 0 ? MAXP : i;
        char name[160];
        snprintf(name, sizeof name, "GPT %s on %s, fused norms vs unfused: %s", kiln_dtype_name(autocast),
                 kiln_device_str(dev, dbuf, sizeof dbuf), i < 0 ? "loss" : names[i]);
        /* the same operations in the same order but for the f32 sums over rows of the norm
        ** parameters' gradients; bf16 products after them spread that a little */
        double tol = autocast == KILN_F32 ? 1e-4 : 2e-2;
        check_pair(name, v[1][k], v[0][k], i < 0 ? 1 : n[i], tol, tol);
      }
    }
    kiln_module_free(m);
  }
  unsetenv("KILN_GPT_RESIDUAL_LN");
  for (int f = 0; f < 2; f++)
    for (int i = 0; i <= MAXP; i++) free(v[f][i]);
  kiln_scope_end();
}

/* Kernel calls of the handover: the residual norm's backward with r's column sums (i1
** flag 8), and products that also sum rows (a linear's bias gradient of its own). */
static int rsum_calls, rowsum_products;
static void count_handover(void *ctx, kiln_device dev, const kiln__kargs *a, bool native) {
  (void)ctx, (void)dev, (void)native;
  if (a->op == KILN__K_RESIDUAL_LAYER_NORM_BACKWARD && (a->i[1] & 8)) rsum_calls++;
  if (a->op == KILN__K_MATMUL && a->n_out == 2) rowsum_products++;
}

/* kiln_backward(loss) with the hand-over kernels counted (rsum_calls, rowsum_products). */
static kiln_status counted_backward(kiln_tensor *loss) {
  rsum_calls = rowsum_products = 0;
  kiln__dispatch_observe(count_handover, NULL);
  kiln_status st = loss ? kiln_backward(loss, NULL) : kiln_last_error();
  kiln__dispatch_observe(NULL, NULL);
  return st;
}

/* r = linear(h, W, b) under bf16 autocast into the fused norm (with s's own gradient), its
** parameters' gradients against add + layer_norm + cast; shared: r's gradient has another
** way too (loss + sum(r q)), so the linear must sum it itself. */
static void linear_into_norm(kiln_device dev, int64_t R, int64_t K, int64_t N, bool shared) {
  kiln_scope_begin();
  kiln_generator *gen = kiln_generator_new(11);
  kiln_tensor *x0 = kiln_randn(KILN_SHAPE(R, N), KILN_F32, dev, gen);
  kiln_tensor *h0 = kiln_randn(KILN_SHAPE(R, K), KILN_F32, dev, gen);
  kiln_tensor *W0 = kiln_mul_scalar(kiln_randn(KILN_SHAPE(N, K), KILN_F32, dev, gen), 0.1);
  kiln_tensor *b0 = kiln_randn(KILN_SHAPE(N), KILN_F32, dev, gen);
  kiln_tensor *gy = kiln_to_dtype(kiln_randn(KILN_SHAPE(R, N), KILN_F32, dev, gen), KILN_BF16);
  kiln_tensor *gs = kiln_randn(KILN_SHAPE(R, N), KILN_F32, dev, gen);
  kiln_tensor *q = kiln_to_dtype(kiln_randn(KILN_SHAPE(R, N), KILN_F32, dev, gen), KILN_BF16);
  kiln_generator_free(gen);
  const bool cuda = dev.type == KILN_DEVICE_CUDA;
  double *v[2][3] = {{NULL}};
  int64_t n[3] = {R * K, N * K, N};
  for (int fused = 0; fused < 2; fused++) {
    kiln_tensor *h = kiln_clone(h0), *W = kiln_clone(W0), *b = kiln_clone(b0);
    kiln_tensor *leaves[3] = {h, W, b};
    for (int i = 0; i < 3; i++) kiln_requires_grad_(leaves[i], true);
    kiln_autocast_begin(dev.type, KILN_BF16);
    kiln_tensor *r = kiln_linear(h, W, b), *s = NULL, *y;
    kiln_autocast_end();
    if (fused) {
      y = kiln_residual_layer_norm(x0, r, NULL, NULL, 1e-5, KILN_BF16, &s);
    } else {
      s = kiln_add(x0, r);
      y = kiln_to_dtype(kiln_layer_norm(s, 1, (const int64_t[]){N}, NULL, NULL, 1e-5), KILN_BF16);
    }
    kiln_tensor *loss = kiln_add(kiln_sum_all(kiln_to_dtype(kiln_mul(y, gy), KILN_F32)), kiln_sum_all(kiln_mul(s, gs)));
    if (shared) loss = kiln_add(loss, kiln_sum_all(kiln_to_dtype(kiln_mul(r, q), KILN_F32)));
    kiln_status st = counted_backward(loss);
    H_CHECK(st == KILN_OK, "linear into residual_layer_norm, fused %d: %s", fused, kiln_last_error_message());
    for (int i = 0; i < 3; i++) v[fused][i] = kiln_grad(leaves[i]) ? h_values(kiln_grad(leaves[i]), NULL) : NULL;
    if (fused) {
      const bool handed = cuda && !shared; /* CUDA's kernel takes flag 8; the CPU composes */
      H_CHECK(rsum_calls == (handed ? 1 : 0) && rowsum_products == (handed ? 0 : 1),
              "linear into residual_layer_norm (%lld, %lld)%s on %s: %d backward kernels summed r's columns, %d "
              "products summed rows; expected %d and %d", (long long)R, (long long)N, shared ? ", r shared" : "",
              cuda ? "cuda" : "cpu", rsum_calls, rowsum_products, handed ? 1 : 0, handed ? 0 : 1);
    }
  }
  static const char *const what[3] = {"dh", "dW", "dbias"};
  for (int i = 0; i < 3; i++) {
    char name[200], db[32];
    snprintf(name, sizeof name, "linear (%lld, %lld) -> residual_layer_norm on %s%s vs add+layer_norm+cast: %s",
             (long long)R, (long long)N, kiln_device_str(dev, db, sizeof db), shared ? ", r shared" : "", what[i]);
    /* the same bf16 gradient of r either way; its sums over rows in another order */
    check_pair(name, v[1][i], v[0][i], n[i], 2e-3, 2e-3);
  }
  for (int k = 0; k < 6; k++) free(v[k / 3][k % 3]);
  kiln_scope_end();
}

/* The norm's output padded with a ones column (kiln__residual_layer_norm_ones) into a
** linear under bf16 autocast: y, and every gradient (the linear's bias from its weight
** product's extra column where the kernel padded y: CUDA; counted: no row-sum product)
** against the plain op. */
static void ones_column(kiln_device dev, int64_t B, int64_t T, int64_t N, int64_t M) {
  kiln_scope_begin();
  kiln_generator *gen = kiln_generator_new(17);
  kiln_tensor *x0 = kiln_randn(KILN_SHAPE(B, T, N), KILN_F32, dev, gen);
  kiln_tensor *r0 = kiln_to_dtype(kiln_randn(KILN_SHAPE(B, T, N), KILN_F32, dev, gen), KILN_BF16);
  kiln_tensor *w0, *b0;
  norm_params(dev, gen, N, &w0, &b0);
  kiln_tensor *W0 = kiln_mul_scalar(kiln_randn(KILN_SHAPE(M, N), KILN_F32, dev, gen), 0.05);
  kiln_tensor *c0 = kiln_randn(KILN_SHAPE(M), KILN_F32, dev, gen);
  kiln_tensor *q = kiln_to_dtype(kiln_randn(KILN_SHAPE(B, T, M), KILN_F32, dev, gen), KILN_BF16);
  kiln_tensor *gs = kiln_randn(KILN_SHAPE(B, T, N), KILN_F32, dev, gen);
  kiln_generator_free(gen);
  const bool cuda = dev.type == KILN_DEVICE_CUDA;
  enum { NV = 8 };
  double *v[2][NV] = {{NULL}};
  int64_t n[NV] = {B * T * N, B * T * N, B * T * N, N, N, M * N, M, B * T * M};
  for (int padded = 0; padded < 2; padded++) {
    kiln_tensor *x = kiln_clone(x0), *r = kiln_clone(r0), *w = kiln_clone(w0), *b = kiln_clone(b0);
    kiln_tensor *W = kiln_clone(W0), *c = kiln_clone(c0);
    kiln_tensor *leaves[6] = {x, r, w, b, W, c};
    for (int i = 0; i < 6; i++) kiln_requires_grad_(leaves[i], true);
    kiln_tensor *s = NULL;
    kiln_tensor *y = padded ? kiln__residual_layer_norm_ones(x, r, w, b, 1e-5, KILN_BF16, &s)
                            : kiln_residual_layer_norm(x, r, w, b, 1e-5, KILN_BF16, &s);
    if (padded && y)
      H_CHECK(y->ones_col == cuda, "ones column on %s: y %s it (expected %s)", cuda ? "cuda" : "cpu",
              y->ones_col ? "has" : "lacks", cuda ? "it" : "none");
    kiln_autocast_begin(dev.type, KILN_BF16);
    kiln_tensor *z = kiln_linear(y, W, c);
    kiln_autocast_end();
    kiln_tensor *loss = kiln_add(kiln_sum_all(kiln_to_dtype(kiln_mul(z, q), KILN_F32)), kiln_sum_all(kiln_mul(s, gs)));
    kiln_status st = counted_backward(loss);
    H_CHECK(st == KILN_OK, "ones column, padded %d: %s", padded, kiln_last_error_message());
    if (padded)
      H_CHECK(rowsum_products == (cuda ? 0 : 1), "ones column on %s: %d products summed rows (expected %d)",
              cuda ? "cuda" : "cpu", rowsum_products, cuda ? 0 : 1);
    kiln_tensor *res[NV] = {y, kiln_grad(x), kiln_grad(r), kiln_grad(w), kiln_grad(b), kiln_grad(W), kiln_grad(c), z};
    for (int i = 0; i < NV; i++) v[padded][i] = res[i] ? h_values(res[i], NULL) : NULL;
  }
  static const char *const what[NV] = {"y", "dx", "dr", "dweight", "dbias", "linear dW", "linear dbias", "z"};
  for (int i = 0; i < NV; i++) {
    char name[200], db[32];
    snprintf(name, sizeof name, "residual_layer_norm with a ones column on %s (%lld, %lld, %lld) -> linear %lld: %s",
             kiln_device_str(dev, db, sizeof db), (long long)B, (long long)T, (long long)N, (long long)M, what[i]);
    /* the same values; the linear's bias gradient summed in another order (f32) */
    const double tol = i == 6 ? 1e-3 : 1e-5;
    check_pair(name, v[1][i], v[0][i], n[i], tol, tol);
  }
  for (int k = 0; k < 2 * NV; k++) free(v[k / NV][k % NV]);
  kiln_scope_end();
}

static void bad_input(void) {
  kiln_scope_begin();
  kiln_device cpu = kiln_device_cpu();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(4, 8), KILN_F32, cpu, NULL);
  H_EXPECT_ERR(kiln_residual_layer_norm(x, kiln_randn(KILN_SHAPE(4, 7), KILN_F32, cpu, NULL), NULL, NULL, 1e-5,
                                        KILN_F32, NULL),
               KILN_ERR_SHAPE, "r of another shape");
  H_EXPECT_ERR(kiln_residual_layer_norm(x, kiln_randn(KILN_SHAPE(2, 8), KILN_F32, cpu, NULL), NULL, NULL, 1e-5,
                                        KILN_F32, NULL),
               KILN_ERR_SHAPE, "r with other leading dims (not x's trailing ones)");
  H_EXPECT_ERR(kiln_residual_layer_norm(x, kiln_randn(KILN_SHAPE(1, 4, 8), KILN_F32, cpu, NULL), NULL, NULL, 1e-5,
                                        KILN_F32, NULL),
               KILN_ERR_SHAPE, "r with more dims than x");
  H_EXPECT_ERR(kiln_residual_layer_norm(x, x, kiln_ones(KILN_SHAPE(7), KILN_F32, cpu), NULL, 1e-5, KILN_F32, NULL),
               KILN_ERR_SHAPE, "weight of another width");
  H_EXPECT_ERR(kiln_residual_layer_norm(x, kiln_zeros(KILN_SHAPE(4, 8), KILN_I64, cpu), NULL, NULL, 1e-5, KILN_F32,
                                        NULL),
               KILN_ERR_DTYPE, "integer r");
  H_EXPECT_ERR(kiln_residual_layer_norm(x, x, NULL, NULL, -1.0, KILN_F32, NULL), KILN_ERR_INVALID_ARGUMENT,
               "eps < 0");
  kiln_scope_end();
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_residual_ln");
  h_run_cases(rln_cases, (int)(sizeof rln_cases / sizeof rln_cases[0]));
  if (!h_cross_only() && !h_support_mode()) {
    kiln_device cpu = kiln_device_cpu();
    block_pattern(cpu, 37, 96, KILN_BF16, KILN_BF16, true);
    block_pattern(cpu, 37, 96, KILN_BF16, KILN_BF16, false);
    block_pattern(cpu, 20, 64, KILN_F32, KILN_F32, true);
    block_pattern(cpu, 20, 64, KILN_F16, KILN_F32, true);
    bad_input();
    gpt_fused_norms(cpu, KILN_F32);
    gpt_fused_norms(cpu, KILN_BF16);
    linear_into_norm(cpu, 40, 24, 64, false);
    broadcast_pattern(cpu, 3, 10, 64, KILN_F32);
    ones_column(cpu, 2, 12, 64, 48);
  }
  /* the RESIDUAL_LAYER_NORM kernels (test_ops_residual_ln_cuda runs only these) */
  if (h_backend_checks("cuda") && kiln_device_count(KILN_DEVICE_CUDA) > 0) {
    kiln_device cuda = kiln_device_cuda(0);
    block_pattern(cuda, 1000, 768, KILN_BF16, KILN_BF16, true); /* GPT-2's width */
    block_pattern(cuda, 1000, 768, KILN_BF16, KILN_BF16, false);
    /* the four-wide kernels at the other lane counts: a full last float4 of lanes (1024),
    ** lanes without a column (260), rows not in whole warps' worth (77, 5) */
    block_pattern(cuda, 300, 1024, KILN_BF16, KILN_BF16, true);
    block_pattern(cuda, 77, 260, KILN_BF16, KILN_BF16, false);
    block_pattern(cuda, 77, 260, KILN_BF16, KILN_BF16, true);
    block_pattern(cuda, 5, 4, KILN_BF16, KILN_BF16, true);
    setenv("KILN_CUDA_RLN", "warp,winter", 1); /* the warp kernels' blocks on interleaved rows */
    block_pattern(cuda, 1000, 768, KILN_BF16, KILN_BF16, true);
    block_pattern(cuda, 77, 260, KILN_BF16, KILN_BF16, true);
    broadcast_pattern(cuda, 4, 250, 768, KILN_F32);
    setenv("KILN_CUDA_RLN", "warp", 1); /* the four-wide kernels a warp a row both ways */
    block_pattern(cuda, 1000, 768, KILN_BF16, KILN_BF16, true);
    block_pattern(cuda, 77, 260, KILN_BF16, KILN_BF16, false);
    block_pattern(cuda, 300, 1024, KILN_BF16, KILN_BF16, true);
    broadcast_pattern(cuda, 4, 250, 768, KILN_F32);
    ones_column(cuda, 4, 250, 768, 2304);
    setenv("KILN_CUDA_RLN", "split", 1); /* the weight partials in a pass of their own */
    block_pattern(cuda, 1000, 768, KILN_BF16, KILN_BF16, true);
    setenv("KILN_CUDA_RLN", "f64", 1); /* the four-wide kernels' arithmetic in double */
    block_pattern(cuda, 1000, 768, KILN_BF16, KILN_BF16, true);
    setenv("KILN_CUDA_RLN", "nopf", 1); /* each row loaded when its warp starts on it */
    block_pattern(cuda, 1000, 768, KILN_BF16, KILN_BF16, true);
    block_pattern(cuda, 77, 260, KILN_BF16, KILN_BF16, true);
    unsetenv("KILN_CUDA_RLN");
    block_pattern(cuda, 37, 96, KILN_F32, KILN_F32, true);
    block_pattern(cuda, 37, 100, KILN_F16, KILN_BF16, true);
    gpt_fused_norms(cuda, KILN_F32);
    gpt_fused_norms(cuda, KILN_BF16);
    linear_into_norm(cuda, 1000, 256, 768, false);
    linear_into_norm(cuda, 1000, 256, 768, true);
    linear_into_norm(cuda, 77, 64, 260, false);
    broadcast_pattern(cuda, 4, 250, 768, KILN_F32); /* GPT-2's position embedding */
    ones_column(cuda, 4, 250, 768, 2304); /* GPT-2's ln_1 -> c_attn */
    ones_column(cuda, 3, 7, 64, 40);
    broadcast_pattern(cuda, 3, 33, 260, KILN_BF16);
    setenv("KILN_CUDA_RLN", "nopf", 1);
    broadcast_pattern(cuda, 4, 250, 768, KILN_F32);
    unsetenv("KILN_CUDA_RLN");
  }
  return h_finish();
}
