/*
** Losses against their formulas in f64: cross_entropy (mean/sum/none, ignore_index,
** label_smoothing, (N, C) and (N, C, d)) and mse_loss. PyTorch's definitions:
**   logp = log_softmax(logits, dim 1)
**   row loss = (1 - ls) * -logp[target] + ls * -mean_c(logp[c]);  0 for ignored rows
**   mean = sum(row loss) / (number of rows not ignored)
** Names are prefixed loss_ (tests/test_cuda_ops.c includes this file).
**
** Then the fused gradient (src/ops/ops_loss.c): the forward saves the logits' gradient for
** a unit upstream gradient, backward from the implicit seed hands it on with no kernel,
** and the engine copies it wherever a user could see or write it.
*/
#include "harness.h"
#include "core/kiln_int.h" /* kiln__dispatch_count, and the node's saved tensor */

#include <stdlib.h>
#include <string.h>

typedef struct loss_ctx {
  kiln_reduction red;
  int64_t ignore;
  double ls;
} loss_ctx;

static kiln_tensor *loss_b_ce(kiln_tensor **in, const void *ctx) {
  const loss_ctx *c = ctx;
  return kiln_cross_entropy(in[0], in[1], c->red, c->ignore, c->ls);
}

static int loss_r_ce(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in;
  const loss_ctx *c = ctx;
  const h_arr *x = &in[0], *t = &in[1];
  int64_t N = x->shape[0], C = x->shape[1];
  int64_t D = h_numel(x->ndim - 2, x->shape + 2); /* spatial positions per sample */
  if (c->red == KILN_REDUCTION_NONE) {
    out->ndim = t->ndim;
    memcpy(out->shape, t->shape, sizeof out->shape);
  } else {
    out->ndim = 0;
  }
  if (C == 0 && N * D > 0) return 1;
  if (!out->data) return 0;
  double total = 0, count = 0;
  for (int64_t n = 0; n < N; n++)
    for (int64_t d = 0; d < D; d++) {
      int64_t tgt = (int64_t)t->data[n * D + d];
      double m = -INFINITY, s = 0, sum_logp = 0;
      for (int64_t k = 0; k < C; k++) m = fmax(m, x->data[(n * C + k) * D + d]);
      for (int64_t k = 0; k < C; k++) s += exp(x->data[(n * C + k) * D + d] - m);
      double lse = m + log(s), row = 0;
      for (int64_t k = 0; k < C; k++) sum_logp += x->data[(n * C + k) * D + d] - lse;
      if (tgt != c->ignore) {
        double nll = -(x->data[(n * C + tgt) * D + d] - lse);
        row = (1 - c->ls) * nll + c->ls * (-sum_logp / (double)C);
        count += 1;
      }
      if (c->red == KILN_REDUCTION_NONE) out->data[n * D + d] = row;
      total += row;
    }
  if (c->red == KILN_REDUCTION_SUM) out->data[0] = total;
  if (c->red == KILN_REDUCTION_MEAN) out->data[0] = total / count;
  return 0;
}

static kiln_tensor *loss_b_mse(kiln_tensor **in, const void *ctx) {
  return kiln_mse_loss(in[0], in[1], ((const loss_ctx *)ctx)->red);
}
static int loss_r_mse(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in;
  const loss_ctx *c = ctx;
  if (in[0].ndim != in[1].ndim || memcmp(in[0].shape, in[1].shape, sizeof(int64_t) * (size_t)in[0].ndim))
    return 1;
  int64_t n = h_numel(in[0].ndim, in[0].shape);
  if (c->red == KILN_REDUCTION_NONE) {
    out->ndim = in[0].ndim;
    memcpy(out->shape, in[0].shape, sizeof out->shape);
  } else {
    out->ndim = 0;
  }
  if (!out->data) return 0;
  double s = 0;
  for (int64_t k = 0; k < n; k++) {
    double e = (in[0].data[k] - in[1].data[k]) * (in[0].data[k] - in[1].data[k]);
    if (c->red == KILN_REDUCTION_NONE) out->data[k] = e;
    s += e;
  }
  if (c->red == KILN_REDUCTION_SUM) out->data[0] = s;
  if (c->red == KILN_REDUCTION_MEAN) out->data[0] = s / (double)n;
  return 0;
}

#define N_ H_SYM(0)
#define C_ H_SYM(1)
#define D_ H_SYM(2)
#define LOGITS2 {.ndim = 2, .shape = {N_, C_}, .fill = H_RANDN, .hi = 2, .diff = true}
#define LOGITS3 {.ndim = 3, .shape = {N_, C_, D_}, .fill = H_RANDN, .hi = 2, .diff = true}
/* targets in [lo, C): lo = -1 puts ignore_index -1 among them */
#define TGT1(lo_, dt) {.ndim = 1, .shape = {N_}, .fill = H_INDEX, .lo = lo_, .hi_sym = 2, .dtype = dt}
#define TGT2(lo_) {.ndim = 2, .shape = {N_, D_}, .fill = H_INDEX, .lo = lo_, .hi_sym = 2}
#define CE(nm, L, T, ...)                                                                 \
  {.name = nm, .fn = loss_b_ce, .ref = loss_r_ce, .ctx = &(const loss_ctx){__VA_ARGS__},   \
   .n_in = 2, .in = {L, T}, .sym = {6, 5, 3}}
#define MSE(nm, r)                                                                        \
  {.name = nm, .fn = loss_b_mse, .ref = loss_r_mse, .ctx = &(const loss_ctx){.red = r},    \
   .n_in = 2,                                                                             \
   .in = {{.ndim = 2, .shape = {N_, C_}, .fill = H_RANDN, .diff = true},                  \
          {.ndim = 2, .shape = {N_, C_}, .fill = H_RANDN, .diff = true}},                 \
   .sym = {3, 4}}

static const h_case loss_cases[] = {
    CE("ce (N,C) mean", LOGITS2, TGT1(0, KILN_I64), .red = KILN_REDUCTION_MEAN, .ignore = -100),
    CE("ce (N,C) sum i32 targets", LOGITS2, TGT1(0, KILN_I32), .red = KILN_REDUCTION_SUM, .ignore = -100),
    CE("ce (N,C) none", LOGITS2, TGT1(0, KILN_I64), .red = KILN_REDUCTION_NONE, .ignore = -100),
    CE("ce (N,C) mean ignore_index -1", LOGITS2, TGT1(-1, KILN_I64), .red = KILN_REDUCTION_MEAN, .ignore = -1),
    CE("ce (N,C) none ignore_index -1", LOGITS2, TGT1(-1, KILN_I64), .red = KILN_REDUCTION_NONE, .ignore = -1),
    CE("ce (N,C) mean ls 0.1", LOGITS2, TGT1(0, KILN_I64), .red = KILN_REDUCTION_MEAN, .ignore = -100, .ls = 0.1),
    CE("ce (N,C) mean ls 0.2 ignore -1", LOGITS2, TGT1(-1, KILN_I64), .red = KILN_REDUCTION_MEAN, .ignore = -1, .ls = 0.2),
    CE("ce (N,C) sum ls 1", LOGITS2, TGT1(0, KILN_I64), .red = KILN_REDUCTION_SUM, .ignore = -100, .ls = 1),
    CE("ce (N,C,d) mean", LOGITS3, TGT2(0), .red = KILN_REDUCTION_MEAN, .ignore = -100),
    CE("ce (N,C,d) none", LOGITS3, TGT2(0), .red = KILN_REDUCTION_NONE, .ignore = -100),
    CE("ce (N,C,d) mean ignore -1 ls 0.1", LOGITS3, TGT2(-1), .red = KILN_REDUCTION_MEAN, .ignore = -1, .ls = 0.1),
    MSE("mse mean", KILN_REDUCTION_MEAN),
    MSE("mse sum", KILN_REDUCTION_SUM),
    MSE("mse none", KILN_REDUCTION_NONE),
};

static void loss_extra(void) {
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();
  kiln_tensor *z = kiln_zeros(KILN_SHAPE(2, 4), KILN_F32, cpu);
  kiln_tensor *t = H_T(KILN_SHAPE(2), KILN_I64, 0, 3);
  kiln_tensor *l = kiln_cross_entropy(z, t, KILN_REDUCTION_MEAN, -100, 0);
  H_CHECK(l && kiln_ndim(l) == 0 && fabs(kiln_item(l) - log(4.0)) < 1e-6,
          "cross_entropy of zero logits is log(C)");
  H_EXPECT_ERR(kiln_cross_entropy(z, H_T(KILN_SHAPE(2), KILN_I64, 0, 4), KILN_REDUCTION_MEAN, -100, 0),
               KILN_ERR_INDEX, "cross_entropy target 4 of 4 classes");
  H_EXPECT_ERR(kiln_cross_entropy(z, H_T(KILN_SHAPE(2), KILN_I64, -3, 1), KILN_REDUCTION_MEAN, -100, 0),
               KILN_ERR_INDEX, "cross_entropy target -3");
  H_EXPECT_ERR(kiln_cross_entropy(z, H_T(KILN_SHAPE(3), KILN_I64, 0, 1, 2), KILN_REDUCTION_MEAN, -100, 0),
               KILN_ERR_SHAPE, "cross_entropy 2 rows, 3 targets");
  H_EXPECT_ERR(kiln_cross_entropy(z, H_T(KILN_SHAPE(2), KILN_F32, 0, 1), KILN_REDUCTION_MEAN, -100, 0),
               KILN_ERR_DTYPE, "cross_entropy float targets");
  H_EXPECT_ERR(kiln_cross_entropy(z, t, KILN_REDUCTION_MEAN, -100, 1.5), KILN_ERR_INVALID_ARGUMENT,
               "cross_entropy label_smoothing 1.5");
  /* every target ignored: mean is NaN (0/0), as in PyTorch; sum is 0 */
  kiln_tensor *ig = H_T(KILN_SHAPE(2), KILN_I64, -100, -100);
  kiln_tensor *lm = kiln_cross_entropy(z, ig, KILN_REDUCTION_MEAN, -100, 0);
  kiln_tensor *ls = kiln_cross_entropy(z, ig, KILN_REDUCTION_SUM, -100, 0);
  H_CHECK(lm && isnan(kiln_item(lm)), "all-ignored mean is NaN");
  H_CHECK(ls && kiln_item(ls) == 0, "all-ignored sum is 0");
  /* large logits do not overflow */
  kiln_tensor *big = H_T(KILN_SHAPE(1, 2), KILN_F32, 1000, 0);
  kiln_tensor *lb = kiln_cross_entropy(big, H_T(KILN_SHAPE(1), KILN_I64, 1), KILN_REDUCTION_SUM, -100, 0);
  H_CHECK(lb && fabs(kiln_item(lb) - 1000) < 1e-3, "cross_entropy with logit 1000 is 1000");
  H_EXPECT_ERR(kiln_mse_loss(z, kiln_zeros(KILN_SHAPE(4, 2), KILN_F32, cpu), KILN_REDUCTION_MEAN),
               KILN_ERR_SHAPE, "mse_loss [2,4] vs [4,2]");
  kiln_scope_end();
}

/* ---- the fused gradient ----------------------------------------------------------- */

/* The f64 gradient of cross_entropy w.r.t. logits x (N, C, D) in C order ((N, C): D = 1;
** (C): N = D = 1) with targets t (N, D) and upstream gradient g: one per row for 'none',
** g[0] otherwise, divided by the count of kept rows for the mean. */
static void loss_ref_ce_grad(const double *x, const double *t, int64_t N, int64_t C, int64_t D,
                             const loss_ctx *c, const double *g, double *out) {
  double kept = 0;
  for (int64_t r = 0; r < N * D; r++) kept += (int64_t)t[r] != c->ignore;
  for (int64_t n = 0; n < N; n++)
    for (int64_t d = 0; d < D; d++) {
      int64_t tgt = (int64_t)t[n * D + d];
      double m = -INFINITY, s = 0;
      for (int64_t k = 0; k < C; k++) m = fmax(m, x[(n * C + k) * D + d]);
      for (int64_t k = 0; k < C; k++) s += exp(x[(n * C + k) * D + d] - m);
      double w = c->red == KILN_REDUCTION_NONE ? g[n * D + d] : g[0];
      if (c->red == KILN_REDUCTION_MEAN) w /= kept;
      for (int64_t k = 0; k < C; k++) {
        double p = exp(x[(n * C + k) * D + d] - m) / s;
        double q = (k == tgt ? 1 - c->ls : 0) + c->ls / (double)C;
        out[(n * C + k) * D + d] = tgt == c->ignore ? 0 : w * (p - q);
      }
    }
}

/* Random logits (shape sh, nd dims) and targets in [0, C), with row 1 (row 0 when there
** is one row) set to ignore when ignore != -100; fills the sizes N, C, D. */
static void loss_ce_data(int nd, const int64_t *sh, int64_t ignore, double *x, double *t, int64_t *N,
                         int64_t *C, int64_t *D) {
  *N = nd == 1 ? 1 : sh[0];
  *C = nd == 1 ? sh[0] : sh[1];
  *D = nd == 3 ? sh[2] : 1;
  for (int64_t k = 0; k < *N * *C * *D; k++) x[k] = 2 * h_rand_normal();
  for (int64_t r = 0; r < *N * *D; r++) t[r] = (double)(h_rand_u64() % (uint64_t)*C);
  if (ignore != -100) t[*N * *D > 1 ? 1 : 0] = (double)ignore;
}

/* Gradients through the fused path against loss_ref_ce_grad, for (C), (N, C), (N, C, D)
** logits, each reduction, ignore_index and label smoothing, in f64 and f32:
**   - backward from the implicit seed (one-element losses: mean, sum, and 'none' of (C)
**     logits) runs exactly one kernel, the COPY that gives the leaf logits a .grad of
**     their own (without the fusion: a FILL for the seed and CROSS_ENTROPY_BACKWARD);
**   - a second backward accumulates (2x), the graph kept as always;
**   - an explicit gradient (2.5 for one-element losses, random per row for 'none') gives
**     that multiple. */
static void loss_fused_grad(void) {
  static const struct { int nd; int64_t sh[3]; } shapes[] = {{1, {5}}, {2, {6, 5}}, {3, {3, 4, 2}}};
  static const loss_ctx ctxs[] = {
      {KILN_REDUCTION_MEAN, -100, 0}, {KILN_REDUCTION_SUM, -100, 0}, {KILN_REDUCTION_NONE, -100, 0},
      {KILN_REDUCTION_MEAN, -1, 0.1}, {KILN_REDUCTION_SUM, -1, 0.2}, {KILN_REDUCTION_NONE, -1, 0.1},
  };
  static const char *rn[] = {"none", "mean", "sum"};
  for (int di = 0; di < 2; di++) {
    kiln_dtype dt = di ? KILN_F32 : KILN_F64;
    double rtol, atol;
    h_dtype_tol(dt, &rtol, &atol);
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
      for (size_t ci = 0; ci < sizeof ctxs / sizeof ctxs[0]; ci++) {
        const loss_ctx *c = &ctxs[ci];
        int nd = shapes[si].nd;
        const int64_t *sh = shapes[si].sh;
        double x[64], t[16], g[16], want[64];
        int64_t N, C, D;
        loss_ce_data(nd, sh, c->ignore, x, t, &N, &C, &D);
        int64_t tsh[2] = {N, D}, nx = N * C * D;
        char what[160];
        snprintf(what, sizeof what, "ce fused %s %dd %s ignore %lld ls %g", kiln_dtype_name(dt), nd,
                 rn[c->red == KILN_REDUCTION_MEAN ? 1 : c->red == KILN_REDUCTION_SUM ? 2 : 0],
                 (long long)c->ignore, c->ls);
        kiln_scope_begin();
        kiln_tensor *xt = h_tensor(x, nd, sh, dt);
        kiln_tensor *tt = h_tensor(t, nd - 1, tsh, KILN_I64);
        kiln_requires_grad_(xt, true);
        kiln_tensor *loss = kiln_cross_entropy(xt, tt, c->red, c->ignore, c->ls);
        if (!H_CHECK(loss != NULL, "%s: forward: %s", what, kiln_last_error_message())) {
          kiln_scope_end();
          continue;
        }
        if (kiln_numel(loss) == 1) {
          int64_t k0 = kiln__dispatch_count();
          kiln_status st = kiln_backward_ex(loss, NULL, true); /* kept: backward twice below */
          int64_t kernels = kiln__dispatch_count() - k0;
          H_CHECK(st == KILN_OK, "%s: backward: %s", what, kiln_last_error_message());
          H_CHECK(kernels == 1, "%s: backward from the implicit seed ran %lld kernels, want 1 (the copy into x.grad)",
                  what, (long long)kernels);
          g[0] = 1;
          loss_ref_ce_grad(x, t, N, C, D, c, g, want);
          char w2[200];
          snprintf(w2, sizeof w2, "%s: grad, implicit seed", what);
          h_tensor_close(w2, kiln_grad(xt), want, nx, rtol, atol);
          H_CHECK(kiln_backward_ex(loss, NULL, true) == KILN_OK, "%s: second backward: %s", what,
                  kiln_last_error_message());
          for (int64_t k = 0; k < nx; k++) want[k] *= 2;
          snprintf(w2, sizeof w2, "%s: grad after two backward calls", what);
          h_tensor_close(w2, kiln_grad(xt), want, nx, rtol, atol);
          kiln_set_grad(xt, NULL);
        }
        int64_t ng = kiln_numel(loss);
        for (int64_t k = 0; k < ng; k++) g[k] = ng == 1 ? 2.5 : h_rand_uniform() * 4 - 2;
        kiln_tensor *gt = h_tensor(g, kiln_ndim(loss), kiln_shape(loss), dt);
        H_CHECK(kiln_backward(loss, gt) == KILN_OK, "%s: backward with a gradient: %s", what,
                kiln_last_error_message());
        loss_ref_ce_grad(x, t, N, C, D, c, g, want);
        char w3[200];
        snprintf(w3, sizeof w3, "%s: grad, explicit gradient", what);
        h_tensor_close(w3, kiln_grad(xt), want, nx, rtol, atol);
        kiln_scope_end();
      }
    }
  }
}

/* The CE node adds no kernel when its logits come from another op: backward through
** matmul then cross_entropy runs exactly the kernels of matmul's own backward given the
** logits' gradient (kiln_backward(logits, G) on a copy of the graph). */
static void loss_fused_no_kernel(void) {
  kiln_scope_begin();
  double xv[4 * 3], wv[3 * 5];
  for (int k = 0; k < 12; k++) xv[k] = h_rand_normal();
  for (int k = 0; k < 15; k++) wv[k] = h_rand_normal();
  kiln_tensor *x = h_tensor(xv, KILN_SHAPE(4, 3), KILN_F32);
  kiln_tensor *w = h_tensor(wv, KILN_SHAPE(3, 5), KILN_F32);
  kiln_tensor *t = h_tensor((const double[]){0, 4, 2, 1}, KILN_SHAPE(4), KILN_I64);
  kiln_requires_grad_(w, true);
  kiln_tensor *loss = kiln_cross_entropy(kiln_matmul(x, w), t, KILN_REDUCTION_MEAN, -100, 0);
  int64_t k0 = kiln__dispatch_count();
  H_CHECK(kiln_backward(loss, NULL) == KILN_OK, "ce(x@w) backward: %s", kiln_last_error_message());
  int64_t k_ce = kiln__dispatch_count() - k0;
  double *g1 = h_values(kiln_grad(w), NULL);
  kiln_set_grad(w, NULL);
  kiln_tensor *logits = kiln_matmul(x, w);
  kiln_tensor *G = kiln_zeros(KILN_SHAPE(4, 5), KILN_F32, kiln_device_cpu());
  k0 = kiln__dispatch_count();
  H_CHECK(kiln_backward(logits, G) == KILN_OK, "x@w backward: %s", kiln_last_error_message());
  int64_t k_mm = kiln__dispatch_count() - k0;
  H_CHECK(k_ce == k_mm, "backward through cross_entropy(x @ w) ran %lld kernels, matmul's alone %lld",
          (long long)k_ce, (long long)k_mm);
  /* and the gradient is right: w.grad = x^T dlogits */
  double want[15] = {0}, dl[20], one = 1;
  double *lg = h_values(kiln_matmul(x, w), NULL);
  loss_ref_ce_grad(lg, (const double[]){0, 4, 2, 1}, 4, 5, 1, &(const loss_ctx){KILN_REDUCTION_MEAN, -100, 0},
                   &one, dl);
  for (int k = 0; k < 3; k++)
    for (int j = 0; j < 5; j++)
      for (int n = 0; n < 4; n++) want[k * 5 + j] += xv[n * 3 + k] * dl[n * 5 + j];
  double rtol, atol;
  h_dtype_tol(KILN_F32, &rtol, &atol);
  if (g1) h_close("ce(x@w): w.grad", g1, want, 15, rtol, atol);
  free(g1);
  free(lg);
  kiln_scope_end();
}

/* The saved gradient is never handed to a user: a leaf's .grad, a retained grad and
** kiln_autograd_grad's results have storage of their own, and writing into them changes
** nothing the next backward sees. Also: the loss's own retained grad is 1, two roots on
** one CE node give twice the gradient, and the seed survives a view between the logits
** and their leaf. */
static void loss_fused_alias(void) {
  kiln_scope_begin();
  double xv[12];
  for (int k = 0; k < 12; k++) xv[k] = h_rand_normal();
  kiln_tensor *t = h_tensor((const double[]){2, 0, -100, 1}, KILN_SHAPE(4), KILN_I64);
  /* leaf logits: .grad */
  kiln_tensor *y = h_tensor(xv, KILN_SHAPE(4, 3), KILN_F32);
  kiln_requires_grad_(y, true);
  kiln_tensor *loss = kiln_cross_entropy(y, t, KILN_REDUCTION_MEAN, -100, 0.1);
  kiln__storage *saved = loss && loss->grad_fn ? loss->grad_fn->saved[0]->storage : NULL;
  H_CHECK(saved != NULL && saved->saved_grad, "ce: the node saves its gradient (marked saved_grad)");
  /* the graph kept: the saved gradient must survive a user writing into .grad */
  H_CHECK(kiln_backward_ex(loss, NULL, true) == KILN_OK, "ce backward: %s", kiln_last_error_message());
  H_CHECK(kiln_grad(y) && kiln_grad(y)->storage != saved, "leaf .grad is not the saved tensor");
  double *gy = h_values(kiln_grad(y), NULL);
  kiln_fill_(kiln_grad(y), 7);
  kiln_set_grad(y, NULL);
  H_CHECK(kiln_backward_ex(loss, NULL, true) == KILN_OK, "ce backward again: %s", kiln_last_error_message());
  if (gy) {
    double *g2 = h_values(kiln_grad(y), NULL);
    H_CHECK(g2 && memcmp(g2, gy, 12 * sizeof(double)) == 0, "leaf .grad: the same after writing 7s into the first one");
    free(g2);
  }
  /* kiln_autograd_grad: its results, the loss itself captured (1), and two roots (2x) */
  kiln_tensor *r[2] = {NULL, NULL};
  kiln_tensor *ins[2] = {y, loss};
  H_CHECK(kiln_autograd_grad(1, &loss, NULL, 2, ins, r) == KILN_OK, "autograd_grad: %s", kiln_last_error_message());
  H_CHECK(r[0] && r[0]->storage != saved, "autograd_grad's result is not the saved tensor");
  H_CHECK(r[1] && kiln_item(r[1]) == 1, "autograd_grad of the loss itself (the unit seed shown) is 1");
  if (r[0]) kiln_fill_(r[0], 7);
  kiln_tensor *outs[2] = {loss, loss}, *r2 = NULL;
  H_CHECK(kiln_autograd_grad(2, outs, NULL, 1, &y, &r2) == KILN_OK, "autograd_grad, two roots: %s",
          kiln_last_error_message());
  double *v2 = h_values(r2, NULL);
  int bad = 0;
  for (int k = 0; gy && v2 && k < 12; k++) bad += fabs(v2[k] - 2 * gy[k]) > 1e-6;
  H_CHECK(gy && v2 && bad == 0, "autograd_grad of [loss, loss]: twice the gradient (%d off)", bad);
  free(v2);
  /* retain_grad on logits made by an op, and on the loss */
  kiln_tensor *x = h_tensor(xv, KILN_SHAPE(4, 3), KILN_F32);
  kiln_requires_grad_(x, true);
  kiln_tensor *h = kiln_mul_scalar(x, 1.0);
  kiln_retain_grad(h);
  kiln_tensor *l2 = kiln_cross_entropy(h, t, KILN_REDUCTION_MEAN, -100, 0.1);
  kiln_retain_grad(l2);
  kiln__storage *saved2 = l2 && l2->grad_fn ? l2->grad_fn->saved[0]->storage : NULL;
  H_CHECK(kiln_backward_ex(l2, NULL, true) == KILN_OK, "ce(h) backward: %s", kiln_last_error_message());
  H_CHECK(kiln_grad(h) && kiln_grad(h)->storage != saved2, "retained grad is not the saved tensor");
  H_CHECK(kiln_grad(l2) && kiln_item(kiln_grad(l2)) == 1, "the loss's retained grad is 1");
  double *gh = h_values(kiln_grad(h), NULL);
  bad = 0;
  for (int k = 0; gy && gh && k < 12; k++) bad += gh[k] != gy[k];
  H_CHECK(gy && gh && bad == 0, "retained grad equals the leaf's in the same graph (%d differ)", bad);
  kiln_fill_(kiln_grad(h), 7);
  kiln_set_grad(h, NULL);
  kiln_set_grad(x, NULL);
  H_CHECK(kiln_backward(l2, NULL) == KILN_OK, "ce(h) backward again: %s", kiln_last_error_message());
  double *gh2 = h_values(kiln_grad(h), NULL), *gx2 = h_values(kiln_grad(x), NULL);
  bad = 0;
  for (int k = 0; gh && gh2 && gx2 && k < 12; k++) bad += gh2[k] != gh[k] || gx2[k] != gh[k];
  H_CHECK(gh && gh2 && gx2 && bad == 0,
          "retained and leaf grads the same after writing 7s into the first (%d differ)", bad);
  free(gh), free(gh2), free(gx2);
  /* a view between the leaf and the logits: its backward is a view of the saved gradient */
  kiln_tensor *z = h_tensor(xv, KILN_SHAPE(12), KILN_F32);
  kiln_requires_grad_(z, true);
  kiln_tensor *l3 = kiln_cross_entropy(kiln_reshape(z, KILN_SHAPE(4, 3)), t, KILN_REDUCTION_MEAN, -100, 0.1);
  kiln__storage *saved3 = l3 && l3->grad_fn ? l3->grad_fn->saved[0]->storage : NULL;
  H_CHECK(kiln_backward(l3, NULL) == KILN_OK, "ce(reshape(z)) backward: %s", kiln_last_error_message());
  H_CHECK(kiln_grad(z) && kiln_grad(z)->storage != saved3, "a leaf behind a view gets a copy, not the saved tensor");
  double *gz = h_values(kiln_grad(z), NULL);
  bad = 0;
  for (int k = 0; gy && gz && k < 12; k++) bad += gz[k] != gy[k];
  H_CHECK(gy && gz && bad == 0, "ce(reshape(z)): z.grad equals the (4, 3) leaf's (%d differ)", bad);
  free(gz);
  free(gy);
  kiln_scope_end();
}

/* CUDA against the CPU through the fused path: loss and the implicit-seed gradient (an
** explicit per-row one for 'none'), with shapes that take each kernel's layouts: a warp
** per row, a block per row (C > 1024), the mean's thread-per-row and several-block forms
** (the count then made by ce_count first). */
static void loss_fused_cross(void) {
  int nc = kiln_device_count(KILN_DEVICE_CUDA);
  static const int64_t shapes[][2] = {{37, 11}, {8, 5000}, {3000, 5}, {1500, 40}, {6, 5003}};
  static const loss_ctx ctxs[] = {
      {KILN_REDUCTION_MEAN, -100, 0}, {KILN_REDUCTION_SUM, -1, 0.1},
      {KILN_REDUCTION_NONE, -1, 0.1}, {KILN_REDUCTION_MEAN, -1, 0.2}};
  static const kiln_dtype dts[] = {KILN_F32, KILN_F64, KILN_F16, KILN_BF16};
  for (int dev = 0; dev < nc; dev++) {
    for (size_t di = 0; di < 4; di++) {
      kiln_dtype dt = dts[di];
      double rtol, atol;
      h_dtype_tol(dt, &rtol, &atol);
      for (size_t si = 0; si < 5; si++) {
        for (size_t ci = 0; ci < 4; ci++) {
          const loss_ctx *c = &ctxs[ci];
          int64_t N, C, D;
          int64_t nx = shapes[si][0] * shapes[si][1];
          double *x = malloc(sizeof(double) * (size_t)nx), *t = malloc(sizeof(double) * (size_t)shapes[si][0]);
          double *g = malloc(sizeof(double) * (size_t)shapes[si][0]);
          loss_ce_data(2, shapes[si], c->ignore, x, t, &N, &C, &D);
          for (int64_t k = 0; k < N; k++) g[k] = h_rand_uniform() + 0.5;
          char what[160];
          snprintf(what, sizeof what, "cuda:%d ce fused %s [%lld,%lld] red %d ignore %lld ls %g", dev,
                   kiln_dtype_name(dt), (long long)N, (long long)C, (int)c->red, (long long)c->ignore, c->ls);
          kiln_scope_begin();
          kiln_tensor *grads[2] = {NULL, NULL}, *losses[2] = {NULL, NULL};
          for (int side = 0; side < 2; side++) { /* 0: the CPU, 1: the GPU */
            kiln_device d = side ? kiln_device_cuda(dev) : kiln_device_cpu();
            kiln_tensor *xt = kiln_to_device(h_tensor(x, KILN_SHAPE(N, C), dt), d);
            kiln_tensor *tt = kiln_to_device(h_tensor(t, KILN_SHAPE(N), KILN_I64), d);
            kiln_requires_grad_(xt, true);
            kiln_tensor *loss = kiln_cross_entropy(xt, tt, c->red, c->ignore, c->ls);
            kiln_tensor *gt = c->red == KILN_REDUCTION_NONE ? kiln_to_device(h_tensor(g, KILN_SHAPE(N), dt), d) : NULL;
            int64_t k0 = kiln__dispatch_count();
            kiln_status st = loss ? kiln_backward(loss, gt) : kiln_last_error();
            int64_t kernels = kiln__dispatch_count() - k0;
            H_CHECK(st == KILN_OK, "%s side %d: %s", what, side, kiln_last_error_message());
            if (!gt)
              H_CHECK(kernels == 1, "%s side %d: %lld kernels in backward, want 1 (the copy into x.grad)", what,
                      side, (long long)kernels);
            losses[side] = loss;
            grads[side] = kiln_grad(xt);
          }
          double *l0 = h_values(losses[0], NULL), *g0 = h_values(grads[0], NULL);
          char w2[200];
          snprintf(w2, sizeof w2, "%s: loss", what);
          if (l0) h_tensor_close(w2, losses[1], l0, kiln_numel(losses[0]), rtol * 4, atol * 4);
          snprintf(w2, sizeof w2, "%s: grad", what);
          if (g0) h_tensor_close(w2, grads[1], g0, nx, rtol * 4, atol * 4);
          H_CHECK(l0 && g0, "%s: CPU results", what);
          free(l0), free(g0), free(x), free(t), free(g);
          kiln_scope_end();
        }
      }
    }
  }
}


/* ---- bf16 logits under autocast (KILN__OP_AMP_READS_16) ----------------------------
** The op reads bf16 logits itself instead of autocast casting them to f32: on the CPU the
** loss and the gradient must be bit-identical to the cast-then-op path (the kernel widens
** each logit exactly and computes in f32 as it would from the copy; dlogits is rounded to
** bf16 once, where the cast's backward rounds the f32 one). An explicit gradient for
** 'none' uses powers of two, for which the product is exact either way. The loss is f32
** under autocast, bf16 outside it (PyTorch). On CUDA: the same forward and backward
** against the CPU's (tolerance: the GPU sums in another order). Row 1 is ignored where
** ignore is -1; one shape takes CUDA's block-per-row kernels (C > 1024) with odd C, so
** rows start anywhere within a 16-byte line. */
static kiln_tensor *loss_bf16_run(kiln_device d, const double *x, const double *t, const double *g,
                                  int64_t N, int64_t C, const loss_ctx *c, bool autocast, bool cast,
                                  kiln_tensor **grad, int64_t *fwd_kernels) {
  kiln_tensor *xb = kiln_to_device(h_tensor(x, KILN_SHAPE(N, C), KILN_BF16), d);
  kiln_tensor *tt = kiln_to_device(h_tensor(t, KILN_SHAPE(N), KILN_I64), d);
  kiln_requires_grad_(xb, true);
  int64_t k0 = kiln__dispatch_count();
  if (autocast) kiln_autocast_begin(d.type, KILN_BF16);
  kiln_tensor *loss = kiln_cross_entropy(cast ? kiln_to_dtype(xb, KILN_F32) : xb, tt, c->red, c->ignore, c->ls);
  if (autocast) kiln_autocast_end();
  *fwd_kernels = kiln__dispatch_count() - k0;
  kiln_tensor *gt = NULL;
  if (loss && c->red == KILN_REDUCTION_NONE)
    gt = kiln_to_device(h_tensor(g, KILN_SHAPE(N), kiln_dtype_of(loss)), d);
  kiln_status st = loss ? kiln_backward(loss, gt) : kiln_last_error();
  H_CHECK(st == KILN_OK, "ce bf16 on %s: %s", kiln__device_cstr(d), kiln_last_error_message());
  *grad = st == KILN_OK ? kiln_grad(xb) : NULL;
  return st == KILN_OK ? loss : NULL;
}

static void loss_bf16_autocast(void) {
  static const int64_t shapes[][2] = {{7, 37}, {5, 3001}};
  static const loss_ctx ctxs[] = {{KILN_REDUCTION_MEAN, -100, 0}, {KILN_REDUCTION_SUM, -1, 0.1},
                                  {KILN_REDUCTION_NONE, -1, 0}, {KILN_REDUCTION_MEAN, -1, 0.2}};
  int nc = kiln_device_count(KILN_DEVICE_CUDA);
  for (size_t si = 0; si < 2; si++)
    for (size_t ci = 0; ci < 4; ci++) {
      const loss_ctx *c = &ctxs[ci];
      int64_t N, C, D;
      int64_t nx = shapes[si][0] * shapes[si][1];
      double *x = malloc(sizeof(double) * (size_t)nx), t[8], g[8];
      loss_ce_data(2, shapes[si], c->ignore, x, t, &N, &C, &D);
      for (int64_t k = 0; k < N; k++) g[k] = (double)(1 << (k % 4)) * (k % 2 ? -0.5 : 1);
      char what[160];
      snprintf(what, sizeof what, "ce bf16 autocast [%lld,%lld] red %d ignore %lld ls %g", (long long)N,
               (long long)C, (int)c->red, (long long)c->ignore, c->ls);
      kiln_scope_begin();
      kiln_device cpu = kiln_device_cpu();
      kiln_tensor *ga = NULL, *gb = NULL;
      int64_t ka = 0, kb = 0;
      kiln_tensor *la = loss_bf16_run(cpu, x, t, g, N, C, c, true, false, &ga, &ka);
      if (!h_cross_only()) {
        kiln_tensor *lb = loss_bf16_run(cpu, x, t, g, N, C, c, false, true, &gb, &kb);
        H_CHECK(la && kiln_dtype_of(la) == KILN_F32, "%s: the loss is f32 under autocast", what);
        H_CHECK(ga && kiln_dtype_of(ga) == KILN_BF16, "%s: the logits' gradient is bf16", what);
        H_CHECK(ka < kb, "%s: no cast of the logits (%lld kernels, cast-then-op %lld)", what, (long long)ka,
                (long long)kb);
        int64_t n1 = 0, n2 = 0, n3 = 0, n4 = 0;
        double *va = la ? h_values(la, &n1) : NULL, *vb = lb ? h_values(lb, &n2) : NULL;
        double *wa = ga ? h_values(ga, &n3) : NULL, *wb = gb ? h_values(gb, &n4) : NULL;
        H_CHECK(va && vb && n1 == n2 && !memcmp(va, vb, sizeof(double) * (size_t)n1),
                "%s: loss bit-identical to cast-then-op", what);
        H_CHECK(wa && wb && n3 == n4 && n3 == nx && !memcmp(wa, wb, sizeof(double) * (size_t)n3),
                "%s: gradient bit-identical to cast-then-op", what);
        free(va), free(vb), free(wa), free(wb);
        /* outside autocast: a bf16 loss, as PyTorch gives */
        kiln_tensor *xb = h_tensor(x, KILN_SHAPE(N, C), KILN_BF16);
        kiln_tensor *l2 = kiln_cross_entropy(xb, h_tensor(t, KILN_SHAPE(N), KILN_I64), c->red, c->ignore, c->ls);
        H_CHECK(l2 && kiln_dtype_of(l2) == KILN_BF16, "%s: bf16 loss outside autocast", what);
      }
      for (int dev = 0; dev < nc && la && ga; dev++) {
        kiln_tensor *gc = NULL;
        int64_t kc = 0;
        kiln_tensor *lc = loss_bf16_run(kiln_device_cuda(dev), x, t, g, N, C, c, true, false, &gc, &kc);
        double *l0 = h_values(la, NULL), *g0 = h_values(ga, NULL);
        double rtol, atol;
        h_dtype_tol(KILN_BF16, &rtol, &atol);
        char w2[200];
        snprintf(w2, sizeof w2, "cuda:%d %s: loss", dev, what);
        H_CHECK(lc && kiln_dtype_of(lc) == KILN_F32, "%s (f32)", w2);
        if (lc && l0) h_tensor_close(w2, lc, l0, kiln_numel(la), 1e-5, 1e-5);
        snprintf(w2, sizeof w2, "cuda:%d %s: grad", dev, what);
        if (gc && g0) h_tensor_close(w2, gc, g0, nx, rtol, atol);
        else H_CHECK(false, "%s: no gradient", w2);
        free(l0), free(g0);
      }
      kiln_scope_end();
      free(x);
    }
}


/* CUDA's block-per-row kernels (C > 1024) on views against the CPU: rows of a narrowed
** tensor (row stride 3010, offset 3: each row starts at another place within 16 bytes;
** the gradient, contiguous, then does not follow them: scalar stores) and a transposed
** one (class stride 6: no 16-byte loads), f32 and bf16, mean and 'none'; the backward
** kernel CROSS_ENTROPY_BACKWARD on the same rows. */
static void loss_big_views(void) {
  int nc = kiln_device_count(KILN_DEVICE_CUDA);
  enum { N = 6, C = 3001, W = 3010 };
  double *x = malloc(sizeof(double) * N * W), t[N];
  for (int k = 0; k < N * W; k++) x[k] = 2 * h_rand_normal();
  for (int r = 0; r < N; r++) t[r] = (double)(h_rand_u64() % C);
  t[2] = -1;
  for (int dev = 0; dev < nc; dev++)
    for (int di = 0; di < 2; di++)
      for (int view = 0; view < 2; view++)
        for (int red = 0; red < 2; red++) {
          kiln_dtype dt = di ? KILN_BF16 : KILN_F32;
          kiln_reduction rd = red ? KILN_REDUCTION_NONE : KILN_REDUCTION_MEAN;
          char what[160];
          snprintf(what, sizeof what, "cuda:%d ce %s %s view %s", dev, kiln_dtype_name(dt),
                   view ? "transposed" : "narrowed", red ? "none" : "mean");
          kiln_scope_begin();
          double *v[2][3] = {{NULL}};
          for (int side = 0; side < 2; side++) {
            kiln_device d = side ? kiln_device_cuda(dev) : kiln_device_cpu();
            kiln_tensor *base = view ? kiln_to_device(h_tensor(x, KILN_SHAPE(C, N), dt), d)
                                     : kiln_to_device(h_tensor(x, KILN_SHAPE(N, W), dt), d);
            kiln_requires_grad_(base, true);
            kiln_tensor *xt = view ? kiln_transpose(base, 0, 1) : kiln_narrow(base, 1, 3, C);
            kiln_tensor *tt = kiln_to_device(h_tensor(t, KILN_SHAPE(N), KILN_I64), d);
            kiln_tensor *loss = kiln_cross_entropy(xt, tt, rd, -1, 0.1);
            kiln_tensor *g = red ? kiln_to_device(h_tensor(t, KILN_SHAPE(N), kiln_dtype_of(loss)), d) : NULL;
            H_CHECK(loss && kiln_backward(loss, g) == KILN_OK, "%s side %d: %s", what, side, kiln_last_error_message());
            /* the backward kernel itself: lse and a per-row gradient (the targets as values) */
            kiln__kargs a = {0};
            kiln_tensor *lse = kiln__tensor_new(1, (const int64_t[]){N}, KILN_F32, d);
            kiln_tensor *rows = kiln__tensor_new(1, (const int64_t[]){N}, KILN_F32, d);
            kiln_tensor *gr = kiln_to_device(h_tensor(t, KILN_SHAPE(N), KILN_F32), d);
            kiln_tensor *dl = kiln__tensor_new(2, (const int64_t[]){N, C}, dt, d);
            a.op = KILN__K_CROSS_ENTROPY;
            a.n_in = 2, a.n_out = 2;
            a.in[0] = kiln__view_of(xt), a.in[1] = kiln__view_of(tt);
            a.out[0] = kiln__view_of(rows), a.out[1] = kiln__view_of(lse);
            a.i[0] = -1, a.s[0] = 0.1;
            H_CHECK(lse && rows && gr && dl && kiln__dispatch(d, &a) == KILN_OK, "%s side %d: CROSS_ENTROPY: %s", what, side, kiln_last_error_message());
            a.op = KILN__K_CROSS_ENTROPY_BACKWARD;
            a.n_in = 4, a.n_out = 1;
            a.in[0] = kiln__view_of(xt), a.in[2] = kiln__view_of(lse), a.in[3] = kiln__view_of(gr);
            a.out[0] = kiln__view_of(dl);
            H_CHECK(kiln__dispatch(d, &a) == KILN_OK, "%s side %d: CROSS_ENTROPY_BACKWARD: %s", what, side, kiln_last_error_message());
            v[side][0] = h_values(loss, NULL);
            v[side][1] = h_values(kiln_grad(base), NULL);
            v[side][2] = h_values(dl, NULL);
            if (side == 0) continue;
            double rtol, atol;
            h_dtype_tol(dt, &rtol, &atol);
            char w2[200];
            snprintf(w2, sizeof w2, "%s: loss", what);
            if (v[0][0]) h_tensor_close(w2, loss, v[0][0], kiln_numel(loss), 1e-5, 1e-5);
            snprintf(w2, sizeof w2, "%s: grad", what);
            if (v[0][1]) h_tensor_close(w2, kiln_grad(base), v[0][1], kiln_numel(base), rtol * 4, atol * 4);
            snprintf(w2, sizeof w2, "%s: CROSS_ENTROPY_BACKWARD", what);
            if (v[0][2]) h_tensor_close(w2, dl, v[0][2], N * C, rtol * 4, atol * 4);
          }
          for (int k = 0; k < 6; k++) free(v[k / 3][k % 3]);
          kiln_scope_end();
        }
  free(x);
}

static void loss_family(void) {
  h_run_cases(loss_cases, (int)(sizeof loss_cases / sizeof loss_cases[0]));
  if (!h_cross_only()) {
    loss_extra();
    loss_fused_grad();
    loss_fused_no_kernel();
    loss_fused_alias();
  }
  loss_fused_cross();
  loss_bf16_autocast();
  loss_big_views();
}

#ifndef H_NO_MAIN
int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_loss");
  loss_family();
  return h_finish();
}
#endif
#undef N_
#undef C_
#undef D_
