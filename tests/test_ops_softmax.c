/*
** softmax and log_softmax along any dim, against a two-pass f64 reference.
** Names are prefixed sm_ (tests/test_cuda_ops.c includes this file).
*/
#include "harness.h"

#include <string.h>

typedef struct sm_ctx {
  bool log;
  int dim;
} sm_ctx;

static kiln_tensor *sm_b(kiln_tensor **in, const void *ctx) {
  const sm_ctx *c = ctx;
  return c->log ? kiln_log_softmax(in[0], c->dim) : kiln_softmax(in[0], c->dim);
}

static int sm_r(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in;
  const sm_ctx *c = ctx;
  const h_arr *a = &in[0];
  out->ndim = a->ndim;
  memcpy(out->shape, a->shape, sizeof out->shape);
  if (a->ndim == 0) {
    if (out->data) out->data[0] = c->log ? 0.0 : 1.0;
    return 0;
  }
  int d = (c->dim + a->ndim) % a->ndim;
  if (!out->data) return 0;
  int64_t outer = 1, inner = 1, len = a->shape[d];
  for (int i = 0; i < d; i++) outer *= a->shape[i];
  for (int i = d + 1; i < a->ndim; i++) inner *= a->shape[i];
  for (int64_t o = 0; o < outer; o++)
    for (int64_t k = 0; k < inner; k++) {
      const double *x = a->data + o * len * inner + k;
      double *y = out->data + o * len * inner + k;
      double m = -INFINITY, s = 0;
      for (int64_t j = 0; j < len; j++) m = x[j * inner] > m ? x[j * inner] : m;
      for (int64_t j = 0; j < len; j++) s += exp(x[j * inner] - m);
      for (int64_t j = 0; j < len; j++)
        y[j * inner] = c->log ? x[j * inner] - m - log(s) : exp(x[j * inner] - m) / s;
    }
  return 0;
}

#define SM(nm, lg, d)                                                                     \
  {.name = nm, .fn = sm_b, .ref = sm_r, .ctx = &(const sm_ctx){.log = lg, .dim = d},       \
   .n_in = 1,                                                                             \
   .in = {{.ndim = 3, .shape = {H_SYM(0), H_SYM(1), H_SYM(2)}, .fill = H_RANDN, .hi = 2,  \
           .diff = true}},                                                                \
   .sym = {2, 3, 5}}

static const h_case sm_cases[] = {
    SM("softmax dim-1", false, -1),    SM("softmax dim0", false, 0),
    SM("softmax dim1", false, 1),      SM("log_softmax dim-1", true, -1),
    SM("log_softmax dim0", true, 0),   SM("log_softmax dim1", true, 1),
    {.name = "softmax 1-d", .fn = sm_b, .ref = sm_r, .ctx = &(const sm_ctx){.log = false, .dim = 0},
     .n_in = 1, .in = {{.ndim = 1, .shape = {H_SYM(0)}, .fill = H_RANDN, .diff = true}},
     .sym = {7}},
};

static void sm_extra(void) {
  kiln_scope_begin();
  /* large logits: the max is subtracted, so no overflow */
  kiln_tensor *x = H_T(KILN_SHAPE(1, 3), KILN_F32, 1000, 1000, -1000);
  h_tensor_close("softmax of large logits", kiln_softmax(x, -1), (double[]){0.5, 0.5, 0}, 3, 1e-6,
                 1e-30);
  h_tensor_close("log_softmax of large logits", kiln_log_softmax(x, -1),
                 (double[]){-log(2.0), -log(2.0), -2000 - log(2.0)}, 3, 1e-6, 0);
  /* -inf entries are masked out (attention masks) */
  kiln_tensor *m = H_T(KILN_SHAPE(3), KILN_F32, 0, -INFINITY, 0);
  h_tensor_close("softmax with -inf", kiln_softmax(m, 0), (double[]){0.5, 0, 0.5}, 3, 1e-6, 0);
  H_EXPECT_ERR(kiln_softmax(x, 2), KILN_ERR_INVALID_ARGUMENT, "softmax dim 2 of 2-d");
  H_EXPECT_ERR(kiln_softmax(kiln_ones(KILN_SHAPE(2), KILN_I64, kiln_device_cpu()), 0),
               KILN_ERR_DTYPE, "softmax of int64");
  kiln_scope_end();
}

static void sm_family(void) {
  h_run_cases(sm_cases, (int)(sizeof sm_cases / sizeof sm_cases[0]));
  if (!h_cross_only()) sm_extra();
}

#ifndef H_NO_MAIN
int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_softmax");
  sm_family();
  return h_finish();
}
#endif
