/*
** matmul under torch.matmul's rules (1-d promotion and squeeze, batch broadcasting) and
** linear with and without bias. Names are prefixed mm_ (tests/test_cuda_ops.c includes
** this file).
*/
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* torch.matmul on shapes: promotes 1-d operands, broadcasts batch dims. Returns false
** when the shapes do not multiply. Writes the batch shape and M, K, N. */
static bool mm_shapes(const h_arr *a, const h_arr *b, h_arr *out, int *nb, int64_t *bs,
                      int64_t *M, int64_t *K, int64_t *N) {
  if (a->ndim == 0 || b->ndim == 0) return false;
  int64_t Ka = a->shape[a->ndim - 1];
  int64_t Kb = b->ndim == 1 ? b->shape[0] : b->shape[b->ndim - 2];
  if (Ka != Kb) return false;
  *K = Ka;
  *M = a->ndim == 1 ? 1 : a->shape[a->ndim - 2];
  *N = b->ndim == 1 ? 1 : b->shape[b->ndim - 1];
  int na = a->ndim > 2 ? a->ndim - 2 : 0, nbb = b->ndim > 2 ? b->ndim - 2 : 0;
  if (!h_broadcast_shape(na, a->shape, nbb, b->shape, nb, bs)) return false;
  out->ndim = 0;
  for (int i = 0; i < *nb; i++) out->shape[out->ndim++] = bs[i];
  if (a->ndim > 1) out->shape[out->ndim++] = *M;
  if (b->ndim > 1) out->shape[out->ndim++] = *N;
  return true;
}

static int mm_r(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in, (void)ctx;
  const h_arr *a = &in[0], *b = &in[1];
  int nb;
  int64_t bs[KILN_MAX_DIMS], M, K, N;
  if (!mm_shapes(a, b, out, &nb, bs, &M, &K, &N)) return 1;
  if (!out->data) return 0;
  int na = a->ndim > 2 ? a->ndim - 2 : 0, nbb = b->ndim > 2 ? b->ndim - 2 : 0;
  int64_t nbatch = h_numel(nb, bs), idx[KILN_MAX_DIMS] = {0};
  for (int64_t t = 0; t < nbatch; t++) {
    const double *A = a->data + h_bcast_offset(na, a->shape, nb, idx) * M * K;
    const double *B = b->data + h_bcast_offset(nbb, b->shape, nb, idx) * K * N;
    double *C = out->data + t * M * N;
    for (int64_t i = 0; i < M; i++)
      for (int64_t j = 0; j < N; j++) {
        double s = 0;
        for (int64_t k = 0; k < K; k++) s += A[i * K + k] * B[k * N + j];
        C[i * N + j] = s;
      }
    h_next_index(nb, bs, idx);
  }
  return 0;
}

static kiln_tensor *mm_b(kiln_tensor **in, const void *ctx) {
  (void)ctx;
  return kiln_matmul(in[0], in[1]);
}
/* a given as (K, M) and used through its transpose: the op must handle the view */
static kiln_tensor *mm_bt(kiln_tensor **in, const void *ctx) {
  (void)ctx;
  return kiln_matmul(kiln_transpose(in[0], 0, 1), kiln_transpose(in[1], 0, 1));
}
static int mm_rt(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  h_arr t[2];
  double buf0[256], buf1[256];
  double *bufs[2] = {buf0, buf1};
  for (int q = 0; q < 2; q++) {
    t[q].ndim = 2;
    t[q].shape[0] = in[q].shape[1], t[q].shape[1] = in[q].shape[0];
    t[q].data = bufs[q];
    for (int64_t i = 0; i < in[q].shape[0]; i++)
      for (int64_t j = 0; j < in[q].shape[1]; j++)
        bufs[q][j * in[q].shape[0] + i] = in[q].data[i * in[q].shape[1] + j];
  }
  return mm_r(t, n_in, out, ctx);
}

/* linear: x (..., in) @ w(out, in)^T + bias(out) */
static kiln_tensor *mm_lin(kiln_tensor **in, const void *ctx) {
  return kiln_linear(in[0], in[1], ctx ? in[2] : NULL);
}
static int mm_rlin(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in;
  const h_arr *x = &in[0], *w = &in[1];
  int64_t I = w->shape[1], O = w->shape[0];
  if (x->ndim < 1 || x->shape[x->ndim - 1] != I) return 1;
  out->ndim = x->ndim;
  memcpy(out->shape, x->shape, sizeof out->shape);
  out->shape[x->ndim - 1] = O;
  if (!out->data) return 0;
  int64_t rows = h_numel(x->ndim - 1, x->shape);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t o = 0; o < O; o++) {
      double s = ctx ? in[2].data[o] : 0;
      for (int64_t i = 0; i < I; i++) s += x->data[r * I + i] * w->data[o * I + i];
      out->data[r * O + o] = s;
    }
  return 0;
}

/* linear_relu: relu(linear(...)), one fused op */
static kiln_tensor *mm_linrelu(kiln_tensor **in, const void *ctx) {
  return kiln_linear_relu(in[0], in[1], ctx ? in[2] : NULL);
}
static int mm_rlinrelu(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  int r = mm_rlin(in, n_in, out, ctx);
  if (r || !out->data) return r;
  int64_t n = h_numel(out->ndim, out->shape);
  for (int64_t i = 0; i < n; i++) out->data[i] = out->data[i] > 0 ? out->data[i] : 0;
  return 0;
}

/* linear_gelu: gelu_tanh(linear(...)), one fused op (GPT-2's MLP) */
static kiln_tensor *mm_lingelu(kiln_tensor **in, const void *ctx) {
  return kiln_linear_gelu(in[0], in[1], ctx ? in[2] : NULL);
}
static int mm_rlingelu(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  int r = mm_rlin(in, n_in, out, ctx);
  if (r || !out->data) return r;
  int64_t n = h_numel(out->ndim, out->shape);
  for (int64_t i = 0; i < n; i++) { /* 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))) */
    double z = out->data[i];
    out->data[i] = 0.5 * z * (1.0 + tanh(0.7978845608028654 * (z + 0.044715 * z * z * z)));
  }
  return 0;
}

#define M_ H_SYM(0)
#define K_ H_SYM(1)
#define N_ H_SYM(2)
#define B_ H_SYM(3)
#define MMIN(nd, ...) {.ndim = nd, .shape = {__VA_ARGS__}, .fill = H_RANDN, .diff = true}
#define MM(nm, fl, A, B)                                                                  \
  {.name = nm, .fn = mm_b, .ref = mm_r, .n_in = 2, .in = {A, B}, .sym = {3, 5, 4, 2},      \
   .flags = (fl)}

static const int mm_bias_on = 1;

static const h_case mm_cases[] = {
    MM("2d@2d", H_BROADCAST, MMIN(2, M_, K_), MMIN(2, K_, N_)),
    MM("1d@1d", 0, MMIN(1, K_), MMIN(1, K_)),
    MM("1d@2d", 0, MMIN(1, K_), MMIN(2, K_, N_)),
    MM("2d@1d", 0, MMIN(2, M_, K_), MMIN(1, K_)),
    MM("batched 3d@3d", H_BROADCAST, MMIN(3, B_, M_, K_), MMIN(3, B_, K_, N_)),
    MM("broadcast 4d@3d", H_BROADCAST, MMIN(4, 2, 1, M_, K_), MMIN(3, B_, K_, N_)),
    MM("3d@2d", 0, MMIN(3, B_, M_, K_), MMIN(2, K_, N_)),
    MM("2d@3d", 0, MMIN(2, M_, K_), MMIN(3, B_, K_, N_)),
    MM("3d@1d", 0, MMIN(3, B_, M_, K_), MMIN(1, K_)),
    MM("1d@3d", 0, MMIN(1, K_), MMIN(3, B_, K_, N_)),
    {.name = "transposed views aT@bT", .fn = mm_bt, .ref = mm_rt, .n_in = 2,
     .in = {MMIN(2, K_, M_), MMIN(2, N_, K_)}, .sym = {3, 5, 4, 2}},
    {.name = "linear 2d with bias", .fn = mm_lin, .ref = mm_rlin, .ctx = &mm_bias_on, .n_in = 3,
     .in = {MMIN(2, M_, K_), MMIN(2, N_, K_), MMIN(1, N_)}, .sym = {3, 5, 4, 2}},
    {.name = "linear 3d with bias", .fn = mm_lin, .ref = mm_rlin, .ctx = &mm_bias_on, .n_in = 3,
     .in = {MMIN(3, B_, M_, K_), MMIN(2, N_, K_), MMIN(1, N_)}, .sym = {3, 5, 4, 2}},
    {.name = "linear no bias", .fn = mm_lin, .ref = mm_rlin, .n_in = 2,
     .in = {MMIN(3, B_, M_, K_), MMIN(2, N_, K_)}, .sym = {3, 5, 4, 2}},
    {.name = "linear 1d input", .fn = mm_lin, .ref = mm_rlin, .ctx = &mm_bias_on, .n_in = 3,
     .in = {MMIN(1, K_), MMIN(2, N_, K_), MMIN(1, N_)}, .sym = {3, 5, 4, 2}},
    {.name = "linear_relu 2d with bias", .fn = mm_linrelu, .ref = mm_rlinrelu, .ctx = &mm_bias_on, .n_in = 3,
     .in = {MMIN(2, M_, K_), MMIN(2, N_, K_), MMIN(1, N_)}, .sym = {3, 5, 4, 2}},
    {.name = "linear_relu 3d with bias", .fn = mm_linrelu, .ref = mm_rlinrelu, .ctx = &mm_bias_on, .n_in = 3,
     .in = {MMIN(3, B_, M_, K_), MMIN(2, N_, K_), MMIN(1, N_)}, .sym = {3, 5, 4, 2}},
    {.name = "linear_relu no bias", .fn = mm_linrelu, .ref = mm_rlinrelu, .n_in = 2,
     .in = {MMIN(3, B_, M_, K_), MMIN(2, N_, K_)}, .sym = {3, 5, 4, 2}},
    {.name = "linear_relu 1d input", .fn = mm_linrelu, .ref = mm_rlinrelu, .ctx = &mm_bias_on, .n_in = 3,
     .in = {MMIN(1, K_), MMIN(2, N_, K_), MMIN(1, N_)}, .sym = {3, 5, 4, 2}},
    {.name = "linear_relu wide (64 rows, 40 out)", .fn = mm_linrelu, .ref = mm_rlinrelu, .ctx = &mm_bias_on,
     .n_in = 3, .in = {MMIN(2, 64, 33), MMIN(2, 40, 33), MMIN(1, 40)}},
    {.name = "linear_gelu 2d with bias", .fn = mm_lingelu, .ref = mm_rlingelu, .ctx = &mm_bias_on, .n_in = 3,
     .in = {MMIN(2, M_, K_), MMIN(2, N_, K_), MMIN(1, N_)}, .sym = {3, 5, 4, 2}},
    {.name = "linear_gelu 3d with bias", .fn = mm_lingelu, .ref = mm_rlingelu, .ctx = &mm_bias_on, .n_in = 3,
     .in = {MMIN(3, B_, M_, K_), MMIN(2, N_, K_), MMIN(1, N_)}, .sym = {3, 5, 4, 2}},
    {.name = "linear_gelu no bias", .fn = mm_lingelu, .ref = mm_rlingelu, .n_in = 2,
     .in = {MMIN(3, B_, M_, K_), MMIN(2, N_, K_)}, .sym = {3, 5, 4, 2}},
    {.name = "linear_gelu 1d input", .fn = mm_lingelu, .ref = mm_rlingelu, .ctx = &mm_bias_on, .n_in = 3,
     .in = {MMIN(1, K_), MMIN(2, N_, K_), MMIN(1, N_)}, .sym = {3, 5, 4, 2}},
    /* past the small-product kernel's reach: cuBLASLt's GELU epilogue on CUDA */
    {.name = "linear_gelu wide (96 rows, 72 out)", .fn = mm_lingelu, .ref = mm_rlingelu, .ctx = &mm_bias_on,
     .n_in = 3, .in = {MMIN(2, 96, 64), MMIN(2, 72, 64), MMIN(1, 72)}},
};

static void mm_extra(void) {
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();
  /* a frozen weight: only the bias gets a gradient (rows where the output counts) */
  for (int relu = 0; relu < 2; relu++) {
    kiln_tensor *x = kiln_ones(KILN_SHAPE(4, 3), KILN_F64, cpu);
    kiln_tensor *w = H_T(KILN_SHAPE(2, 3), KILN_F64, 1, 1, 1, -1, -1, -1);
    kiln_tensor *b = kiln_zeros(KILN_SHAPE(2), KILN_F64, cpu);
    kiln_requires_grad_(b, true);
    kiln_tensor *y = relu ? kiln_linear_relu(x, w, b) : kiln_linear(x, w, b);
    H_CHECK(kiln_backward(kiln_sum_all(y), NULL) == KILN_OK && kiln_grad(b) && !kiln_grad(w) &&
                kiln_get(kiln_grad(b), (int64_t[]){0}) == 4 && kiln_get(kiln_grad(b), (int64_t[]){1}) == (relu ? 0 : 4),
            "linear%s with a frozen weight: db = [4, %d]", relu ? "_relu" : "", relu ? 0 : 4);
  }
  kiln_tensor *a = kiln_ones(KILN_SHAPE(128, 64), KILN_F32, cpu);
  kiln_tensor *b = kiln_ones(KILN_SHAPE(32, 2), KILN_F32, cpu);
  kiln_clear_error();
  kiln_tensor *r = kiln_matmul(a, b);
  const char *m = kiln_last_error_message();
  H_CHECK(!r && kiln_last_error() == KILN_ERR_SHAPE && strstr(m, "matmul") &&
              strstr(m, "[128, 64]") && strstr(m, "[32, 2]"),
          "matmul [128,64]@[32,2]: KILN_ERR_SHAPE naming both shapes, got \"%s\"", m);
  kiln_clear_error();
  H_EXPECT_ERR(kiln_matmul(kiln_scalar(1, KILN_F32, cpu), a), KILN_ERR_SHAPE, "matmul of 0-dim");
  H_EXPECT_ERR(kiln_matmul(kiln_ones(KILN_SHAPE(2, 3), KILN_F32, cpu),
                           kiln_ones(KILN_SHAPE(4, 3), KILN_F32, cpu)),
               KILN_ERR_SHAPE, "matmul [2,3]@[4,3]");
  H_EXPECT_ERR(kiln_matmul(kiln_ones(KILN_SHAPE(2, 2, 3), KILN_F32, cpu),
                           kiln_ones(KILN_SHAPE(3, 3, 4), KILN_F32, cpu)),
               KILN_ERR_SHAPE, "matmul batch dims 2 and 3 do not broadcast");
  H_EXPECT_ERR(kiln_linear(kiln_ones(KILN_SHAPE(2, 3), KILN_F32, cpu),
                           kiln_ones(KILN_SHAPE(4, 3), KILN_F32, cpu),
                           kiln_ones(KILN_SHAPE(5), KILN_F32, cpu)),
               KILN_ERR_SHAPE, "linear with a bias of the wrong size");
  /* exact f32 by default; a matmul of integers in f32 is exact */
  H_CHECK(!kiln_matmul_tf32(), "TF32 is off by default");
  kiln_tensor *x = kiln_full(KILN_SHAPE(8, 33), 3, KILN_F32, cpu);
  kiln_tensor *y = kiln_full(KILN_SHAPE(33, 5), 7, KILN_F32, cpu);
  kiln_tensor *z = kiln_matmul(x, y);
  H_CHECK(z && kiln_get(z, (int64_t[]){7, 4}) == 33 * 21, "8x33 @ 33x5 of 3s and 7s is 693");
  kiln_scope_end();
}

static void mm_family(void) {
  h_run_cases(mm_cases, (int)(sizeof mm_cases / sizeof mm_cases[0]));
  if (!h_cross_only()) mm_extra();
}

#ifndef H_NO_MAIN
/* Under KILN_CPU_SGEMM (the two extra ctest entries) the f32 products took the sgemm named:
** kiln_blas_info() says oneDNN's for "dnnl" (with oneDNN and OpenBLAS built in) and not
** for "blas". */
static void sgemm_route(void) {
  const char *want = getenv("KILN_CPU_SGEMM"), *build = kiln_build_info(), *info = kiln_blas_info();
  if (!want || !info) return;
  bool dnnl = strstr(build, "dnnl=on") != NULL, openblas = strstr(build, "blas=openblas") != NULL;
  bool routed = strstr(info, "oneDNN") != NULL;
  if (!strcmp(want, "dnnl") && dnnl && openblas)
    H_CHECK(routed, "KILN_CPU_SGEMM=dnnl: kiln_blas_info() should name oneDNN's sgemm, says '%s'", info);
  if (!strcmp(want, "blas"))
    H_CHECK(!routed, "KILN_CPU_SGEMM=blas: kiln_blas_info() should not name oneDNN, says '%s'", info);
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_matmul");
  mm_family();
  sgemm_route();
  return h_finish();
}
#endif
#undef M_
#undef K_
#undef N_
#undef B_
