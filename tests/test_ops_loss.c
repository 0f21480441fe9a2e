/*
** Losses against their formulas in f64: cross_entropy (mean/sum/none, ignore_index,
** label_smoothing, (N, C) and (N, C, d)) and mse_loss. PyTorch's definitions:
**   logp = log_softmax(logits, dim 1)
**   row loss = (1 - ls) * -logp[target] + ls * -mean_c(logp[c]);  0 for ignored rows
**   mean = sum(row loss) / (number of rows not ignored)
** Names are prefixed loss_ (tests/test_cuda_ops.c includes this file).
*/
#include "harness.h"

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

static void loss_family(void) {
  h_run_cases(loss_cases, (int)(sizeof loss_cases / sizeof loss_cases[0]));
  if (!h_cross_only()) loss_extra();
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
