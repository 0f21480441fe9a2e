/*
** Reductions over sets of dims, with keepdim; max/min along a dim with indices;
** argmax/argmin; sum_all/mean_all. Names are prefixed red_ (tests/test_cuda_ops.c
** includes this file).
*/
#include "harness.h"

#include <stdlib.h>
#include <string.h>

enum { RED_SUM, RED_MEAN, RED_AMAX, RED_AMIN, RED_VAR, RED_STD, RED_MAXV, RED_MAXI, RED_MINV,
       RED_MINI, RED_ARGMAX, RED_ARGMIN, RED_SUM_ALL, RED_MEAN_ALL };

typedef struct red_ctx {
  int kind;
  int nd; /* 0: all dims */
  int dims[4];
  bool keepdim;
  int corr;
} red_ctx;

static kiln_tensor *red_b(kiln_tensor **in, const void *ctx) {
  const red_ctx *c = ctx;
  const int *d = c->nd ? c->dims : NULL;
  kiln_tensor *t = in[0], *idx = NULL, *v;
  switch (c->kind) {
  case RED_SUM: return kiln_sum(t, c->nd, d, c->keepdim);
  case RED_MEAN: return kiln_mean(t, c->nd, d, c->keepdim);
  case RED_AMAX: return kiln_amax(t, c->nd, d, c->keepdim);
  case RED_AMIN: return kiln_amin(t, c->nd, d, c->keepdim);
  case RED_VAR: return kiln_var(t, c->nd, d, c->corr, c->keepdim);
  case RED_STD: return kiln_std(t, c->nd, d, c->corr, c->keepdim);
  case RED_MAXV: return kiln_max_dim(t, c->dims[0], c->keepdim, NULL);
  case RED_MINV: return kiln_min_dim(t, c->dims[0], c->keepdim, NULL);
  case RED_MAXI:
    v = kiln_max_dim(t, c->dims[0], c->keepdim, &idx);
    return v ? idx : NULL;
  case RED_MINI:
    v = kiln_min_dim(t, c->dims[0], c->keepdim, &idx);
    return v ? idx : NULL;
  case RED_ARGMAX: return kiln_argmax(t, c->dims[0], c->keepdim);
  case RED_ARGMIN: return kiln_argmin(t, c->dims[0], c->keepdim);
  case RED_SUM_ALL: return kiln_sum_all(t);
  case RED_MEAN_ALL: return kiln_mean_all(t);
  }
  return NULL;
}

/* Naive reference: walks every input element and folds it into its output slot. */
static int red_r(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in;
  const red_ctx *c = ctx;
  const h_arr *a = &in[0];
  bool red[KILN_MAX_DIMS] = {0};
  int kind = c->kind;
  bool keep = c->keepdim, all = c->nd == 0;
  if (kind == RED_SUM_ALL || kind == RED_MEAN_ALL) all = true, keep = false;
  for (int i = 0; i < c->nd && !all; i++) red[(c->dims[i] + a->ndim) % a->ndim] = true;
  if (all)
    for (int i = 0; i < a->ndim; i++) red[i] = true;
  int64_t cnt = 1;
  out->ndim = 0;
  for (int i = 0; i < a->ndim; i++) {
    if (red[i]) cnt *= a->shape[i];
    if (!red[i]) out->shape[out->ndim++] = a->shape[i];
    else if (keep) out->shape[out->ndim++] = 1;
  }
  bool needs_elems = kind != RED_SUM && kind != RED_MEAN && kind != RED_VAR && kind != RED_STD &&
                     kind != RED_SUM_ALL && kind != RED_MEAN_ALL;
  if (cnt == 0 && needs_elems) return 1; /* max of nothing is an error (PyTorch) */
  if (!out->data) return 0;
  int64_t no = h_numel(out->ndim, out->shape), na = h_numel(a->ndim, a->shape);
  double *acc = calloc((size_t)(no ? no : 1), sizeof(double));
  double *mean = calloc((size_t)(no ? no : 1), sizeof(double));
  int64_t *pos = calloc((size_t)(no ? no : 1), sizeof(int64_t));
  bool *seen = calloc((size_t)(no ? no : 1), sizeof(bool));
  for (int pass = 0; pass < 2; pass++) {
    int64_t idx[KILN_MAX_DIMS] = {0};
    for (int64_t k = 0; k < na; k++) {
      int64_t o = 0, rpos = 0;
      for (int i = 0; i < a->ndim; i++) {
        if (!red[i]) o = o * a->shape[i] + idx[i];
        else rpos = rpos * a->shape[i] + idx[i];
      }
      double x = a->data[k];
      if (pass == 0) {
        switch (kind) {
        case RED_AMAX: case RED_MAXV: case RED_MAXI: case RED_ARGMAX:
          if (!seen[o] || x > acc[o]) acc[o] = x, pos[o] = rpos;
          break;
        case RED_AMIN: case RED_MINV: case RED_MINI: case RED_ARGMIN:
          if (!seen[o] || x < acc[o]) acc[o] = x, pos[o] = rpos;
          break;
        default: acc[o] += x;
        }
        seen[o] = true;
      } else if (kind == RED_VAR || kind == RED_STD) {
        mean[o] += (x - acc[o] / (double)cnt) * (x - acc[o] / (double)cnt);
      }
      h_next_index(a->ndim, a->shape, idx);
    }
    if (kind != RED_VAR && kind != RED_STD) break;
  }
  for (int64_t o = 0; o < no; o++) {
    double v = acc[o];
    switch (kind) {
    case RED_MEAN: case RED_MEAN_ALL: v = acc[o] / (double)cnt; break;
    case RED_VAR: v = mean[o] / (double)(cnt - c->corr); break;
    case RED_STD: v = sqrt(mean[o] / (double)(cnt - c->corr)); break;
    case RED_MAXI: case RED_MINI: case RED_ARGMAX: case RED_ARGMIN: v = (double)pos[o]; break;
    default: break;
    }
    if ((kind == RED_VAR || kind == RED_STD) && cnt - c->corr <= 0) v = NAN;
    out->data[o] = v;
  }
  free(acc), free(mean), free(pos), free(seen);
  return 0;
}

#define RED_IN {{.ndim = 3, .shape = {H_SYM(0), H_SYM(1), H_SYM(2)}, .fill = H_RANDN, .diff = true}}
#define RED(nm, fl, ...)                                                                  \
  {.name = nm, .fn = red_b, .ref = red_r, .ctx = &(const red_ctx){__VA_ARGS__}, .n_in = 1,  \
   .in = RED_IN, .sym = {2, 3, 4}, .flags = (fl)}
#define NOEX H_NO_EXPAND
#define IDX (H_NO_GRAD)

static const h_case red_cases[] = {
    RED("sum all", 0, RED_SUM, 0, {0}, false, 0),
    RED("sum all keepdim", 0, RED_SUM, 0, {0}, true, 0),
    RED("sum dim0", 0, RED_SUM, 1, {0}, false, 0),
    RED("sum dim1 keepdim", 0, RED_SUM, 1, {1}, true, 0),
    RED("sum dim-1", 0, RED_SUM, 1, {-1}, false, 0),
    RED("sum dims0,2", 0, RED_SUM, 2, {0, 2}, false, 0),
    RED("sum dims2,0 keepdim", 0, RED_SUM, 2, {2, 0}, true, 0),
    RED("sum dims0,1,2", 0, RED_SUM, 3, {0, 1, 2}, false, 0),
    /* a convolution's bias gradient: the batch and the spatial dims, long enough that the
    ** range is split across blocks and a lane's steps cross the spatial rows (CUDA walks
    ** two reduced groups with an index pair); no gradcheck at this size */
    {.name = "sum dims0,2,3 (16, 5, 37, 41)", .fn = red_b, .ref = red_r,
     .ctx = &(const red_ctx){RED_SUM, 3, {0, 2, 3}, false, 0}, .n_in = 1,
     .in = {{.ndim = 4, .shape = {16, 5, 37, 41}, .fill = H_RANDN, .diff = true}}, .flags = H_NO_GRAD | H_NO_SIZE0},
    RED("mean all", 0, RED_MEAN, 0, {0}, false, 0),
    RED("mean dim1", 0, RED_MEAN, 1, {1}, false, 0),
    RED("mean dims0,2 keepdim", 0, RED_MEAN, 2, {0, 2}, true, 0),
    RED("amax dim2", NOEX, RED_AMAX, 1, {2}, false, 0),
    RED("amax dims0,1 keepdim", NOEX, RED_AMAX, 2, {0, 1}, true, 0),
    RED("amax all", NOEX, RED_AMAX, 0, {0}, false, 0),
    RED("amin dim0", NOEX, RED_AMIN, 1, {0}, false, 0),
    RED("amin dims1,2", NOEX, RED_AMIN, 2, {1, 2}, false, 0),
    RED("var dim1", 0, RED_VAR, 1, {1}, false, 1),
    RED("var dim-1 corr0 keepdim", 0, RED_VAR, 1, {-1}, true, 0),
    RED("var dims0,2", 0, RED_VAR, 2, {0, 2}, false, 1),
    RED("var all", 0, RED_VAR, 0, {0}, false, 1),
    RED("std dim2", 0, RED_STD, 1, {2}, false, 1),
    RED("std dims0,1 corr0 keepdim", 0, RED_STD, 2, {0, 1}, true, 0),
    RED("max_dim values dim1", NOEX, RED_MAXV, 1, {1}, false, 0),
    RED("max_dim values dim0 keepdim", NOEX, RED_MAXV, 1, {0}, true, 0),
    RED("max_dim indices dim1", IDX, RED_MAXI, 1, {1}, false, 0),
    RED("max_dim indices dim0 keepdim (ties when expanded)", IDX, RED_MAXI, 1, {0}, true, 0),
    RED("min_dim values dim2", NOEX, RED_MINV, 1, {2}, false, 0),
    RED("min_dim indices dim-1", IDX, RED_MINI, 1, {-1}, false, 0),
    RED("argmax dim0 (ties when expanded)", IDX, RED_ARGMAX, 1, {0}, false, 0),
    RED("argmax dim2 keepdim", IDX, RED_ARGMAX, 1, {2}, true, 0),
    RED("argmin dim1", IDX, RED_ARGMIN, 1, {1}, false, 0),
    RED("sum_all", 0, RED_SUM_ALL, 0, {0}, false, 0),
    RED("mean_all", 0, RED_MEAN_ALL, 0, {0}, false, 0),
};

static void red_extra(void) {
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();
  /* amax splits the gradient evenly between ties (PyTorch); max_dim sends it to the index */
  kiln_tensor *x = H_T(KILN_SHAPE(1, 3), KILN_F64, 1, 3, 3);
  kiln_requires_grad_(x, true);
  if (H_CHECK(kiln_backward(kiln_sum_all(kiln_amax(x, KILN_DIMS(1), false)), NULL) == KILN_OK,
              "amax backward"))
    h_tensor_close("amax ties share the gradient", kiln_grad(x), (double[]){0, 0.5, 0.5}, 3,
                   1e-12, 0);
  kiln_set_grad(x, NULL);
  kiln_tensor *idx = NULL;
  kiln_tensor *mx = kiln_max_dim(x, 1, false, &idx);
  H_CHECK(idx && kiln_dtype_of(idx) == KILN_I64 && kiln_item(idx) == 1, "max_dim ties: first index");
  if (H_CHECK(kiln_backward(kiln_sum_all(mx), NULL) == KILN_OK, "max_dim backward"))
    h_tensor_close("max_dim gradient goes to the index", kiln_grad(x), (double[]){0, 1, 0}, 3, 0,
                   0);
  /* integer sums accumulate in i64 (torch.sum of int is int64) */
  kiln_tensor *iv = H_T(KILN_SHAPE(2, 2), KILN_I32, 1, 2, 3, 4);
  kiln_tensor *is = kiln_sum(iv, 0, NULL, false);
  H_CHECK(is && kiln_dtype_of(is) == KILN_I64 && kiln_item(is) == 10, "sum of int32 is int64 10");
  kiln_tensor *ia = kiln_amax(iv, KILN_DIMS(0), false);
  H_CHECK(ia && kiln_dtype_of(ia) == KILN_I32, "amax of int32 keeps int32");
  /* f16 sums accumulate in f32: 4096 ones is exact */
  kiln_tensor *h = kiln_ones(KILN_SHAPE(4096), KILN_F16, cpu);
  kiln_tensor *hs = kiln_sum_all(h);
  H_CHECK(hs && kiln_item(hs) == 4096 && kiln_dtype_of(hs) == KILN_F16, "sum of 4096 f16 ones is 4096");
  /* NaN propagates through amax */
  kiln_tensor *nn = H_T(KILN_SHAPE(3), KILN_F32, 1, NAN, 2);
  kiln_tensor *am = kiln_amax(nn, 0, NULL, false);
  H_CHECK(am && isnan(kiln_item(am)), "amax propagates NaN");
  /* errors */
  kiln_tensor *t = kiln_ones(KILN_SHAPE(2, 3), KILN_F32, cpu);
  H_EXPECT_ERR(kiln_sum(t, KILN_DIMS(2), false), KILN_ERR_INVALID_ARGUMENT, "sum dim 2 of 2-d");
  H_EXPECT_ERR(kiln_sum(t, KILN_DIMS(-3), false), KILN_ERR_INVALID_ARGUMENT, "sum dim -3 of 2-d");
  kiln_tensor *dup = kiln_sum(t, KILN_DIMS(0, 0), false);
  H_CHECK(dup == NULL && kiln_last_error() != KILN_OK, "sum over a repeated dim is an error");
  kiln_clear_error();
  H_EXPECT_ERR(kiln_argmax(t, 5, false), KILN_ERR_INVALID_ARGUMENT, "argmax dim 5");
  kiln_tensor *e = kiln_zeros(KILN_SHAPE(0, 3), KILN_F32, cpu);
  H_CHECK(kiln_amax(e, KILN_DIMS(0), false) == NULL && kiln_last_error() != KILN_OK,
          "amax over an empty dim is an error");
  kiln_clear_error();
  kiln_tensor *se = kiln_sum(e, KILN_DIMS(0), false);
  H_CHECK(se && kiln_ndim(se) == 1 && kiln_size(se, 0) == 3 && kiln_get(se, (int64_t[]){2}) == 0,
          "sum over an empty dim is zeros of shape [3]");
  kiln_scope_end();
}

static void red_family(void) {
  h_run_cases(red_cases, (int)(sizeof red_cases / sizeof red_cases[0]));
  if (!h_cross_only()) red_extra();
}

#ifndef H_NO_MAIN
int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_reduce");
  red_family();
  return h_finish();
}
#endif
