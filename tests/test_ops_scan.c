/*
** cumsum, tril/triu, topk and multinomial against naive f64 references (multinomial's
** reimplements the Philox mapping documented in src/backend/cpu/cpu_scan.c), gradchecked
** where differentiable. Every case is H_CPU_ONLY: CUDA and Vulkan have no kernels for
** these ops yet, so there the harness checks the CPU fallback. Names are prefixed sc_.
*/
#include "harness.h"

#include <stdlib.h>
#include <string.h>

typedef struct sc_ctx {
  int dim;
  int64_t k; /* tril/triu diagonal; topk k; multinomial samples */
  bool flag; /* triu; topk largest; multinomial replacement */
  bool indices;
} sc_ctx;

/* an (outer, len, inner) split of shape around dim d */
static void sc_split(const h_arr *a, int d, int64_t *outer, int64_t *len, int64_t *inner) {
  *outer = h_numel(d, a->shape);
  *len = a->shape[d];
  *inner = h_numel(a->ndim - d - 1, a->shape + d + 1);
}

/* ---- cumsum ---- */
static kiln_tensor *sc_cumsum_b(kiln_tensor **in, const void *ctx) {
  return kiln_cumsum(in[0], ((const sc_ctx *)ctx)->dim);
}

static int sc_cumsum_r(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in;
  const h_arr *a = &in[0];
  *out = (h_arr){.ndim = a->ndim, .data = out->data};
  memcpy(out->shape, a->shape, sizeof out->shape);
  if (!out->data) return 0;
  int d = (((const sc_ctx *)ctx)->dim + a->ndim) % a->ndim;
  int64_t o, l, n;
  sc_split(a, d, &o, &l, &n);
  for (int64_t i = 0; i < o; i++)
    for (int64_t k = 0; k < n; k++) {
      double s = 0;
      for (int64_t j = 0; j < l; j++) out->data[(i * l + j) * n + k] = s += a->data[(i * l + j) * n + k];
    }
  return 0;
}

/* ---- tril / triu ---- */
static kiln_tensor *sc_tri_b(kiln_tensor **in, const void *ctx) {
  const sc_ctx *c = ctx;
  return c->flag ? kiln_triu(in[0], c->k) : kiln_tril(in[0], c->k);
}

static int sc_tri_r(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in;
  const sc_ctx *c = ctx;
  const h_arr *a = &in[0];
  out->ndim = a->ndim;
  memcpy(out->shape, a->shape, sizeof out->shape);
  if (!out->data) return 0;
  int64_t M = a->shape[a->ndim - 2], N = a->shape[a->ndim - 1], n = h_numel(a->ndim, a->shape);
  for (int64_t e = 0; e < n; e++) {
    int64_t j = e % N, i = (e / N) % M;
    bool keep = c->flag ? j - i >= c->k : j - i <= c->k;
    out->data[e] = keep ? a->data[e] : 0;
  }
  return 0;
}

/* ---- topk ---- */
static kiln_tensor *sc_topk_b(kiln_tensor **in, const void *ctx) {
  const sc_ctx *c = ctx;
  kiln_tensor *idx = NULL;
  kiln_tensor *v = kiln_topk(in[0], c->k, c->dim, c->flag, true, c->indices ? &idx : NULL);
  return c->indices ? (v ? idx : NULL) : v;
}

static int sc_topk_r(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in;
  const sc_ctx *c = ctx;
  const h_arr *a = &in[0];
  int d = (c->dim + a->ndim) % a->ndim;
  if (c->k > a->shape[d]) return 1;
  out->ndim = a->ndim;
  memcpy(out->shape, a->shape, sizeof out->shape);
  out->shape[d] = c->k;
  if (!out->data) return 0;
  int64_t o, l, n;
  sc_split(a, d, &o, &l, &n);
  bool *used = malloc((size_t)(l ? l : 1));
  for (int64_t i = 0; i < o; i++)
    for (int64_t q = 0; q < n; q++) {
      memset(used, 0, (size_t)(l ? l : 1));
      for (int64_t t = 0; t < c->k; t++) { /* selection: the best unused, lower index on ties */
        int64_t best = -1;
        for (int64_t j = 0; j < l; j++) {
          if (used[j]) continue;
          double x = a->data[(i * l + j) * n + q], bx = best < 0 ? 0 : a->data[(i * l + best) * n + q];
          if (best < 0 || (c->flag ? x > bx : x < bx)) best = j;
        }
        used[best] = true;
        out->data[(i * c->k + t) * n + q] = c->indices ? (double)best : a->data[(i * l + best) * n + q];
      }
    }
  free(used);
  return 0;
}

/* ---- multinomial ---- */
#define SC_SEED 77u
static kiln_tensor *sc_mn_b(kiln_tensor **in, const void *ctx) {
  const sc_ctx *c = ctx;
  kiln_generator *g = kiln_generator_new(SC_SEED);
  kiln_tensor *r = kiln_multinomial(in[0], c->k, c->flag, g);
  kiln_generator_free(g);
  return r;
}

/* rng.c's f64 uniform of element k at (seed, offset 0) */
static double sc_u64(uint64_t seed, uint64_t k) {
  uint32_t b[4];
  kiln_philox4x32(seed, 0, k / 2, b);
  uint32_t x = b[2 * (k % 2)], y = b[2 * (k % 2) + 1];
  return ((double)(x >> 5) * 67108864.0 + (double)(y >> 6)) * (1.0 / 9007199254740992.0);
}

static int sc_mn_r(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  (void)n_in;
  const sc_ctx *c = ctx;
  const h_arr *a = &in[0];
  int64_t N = a->ndim == 2 ? a->shape[0] : 1, C = a->shape[a->ndim - 1], S = c->k;
  if (C == 0 || (!c->flag && S > C)) return 1;
  out->ndim = a->ndim;
  out->shape[0] = a->ndim == 2 ? N : S;
  out->shape[1] = S;
  if (!out->data) return 0;
  double *w = malloc(sizeof(double) * (size_t)C);
  for (int64_t r = 0; r < N; r++) {
    memcpy(w, a->data + r * C, sizeof(double) * (size_t)C);
    for (int64_t s = 0; s < S; s++) {
      double tot = 0;
      for (int64_t j = 0; j < C; j++) tot += w[j];
      double u = sc_u64(SC_SEED, (uint64_t)(r * S + s)) * tot, cdf = 0;
      int64_t pick = -1;
      for (int64_t j = 0; j < C && pick < 0; j++)
        if ((cdf += w[j]) > u) pick = j;
      out->data[r * S + s] = (double)pick;
      if (!c->flag) w[pick] = 0;
    }
  }
  free(w);
  return 0;
}

#define SC_X3 {.ndim = 3, .shape = {H_SYM(0), H_SYM(1), H_SYM(2)}, .fill = H_RANDN, .diff = true}
#define SC_X2 {.ndim = 2, .shape = {H_SYM(0), H_SYM(1)}, .fill = H_RANDN, .diff = true}
#define SC_P2 {.ndim = 2, .shape = {H_SYM(0), H_SYM(1)}, .fill = H_POSITIVE}

static const h_case sc_cases[] = {
    {.name = "cumsum dim -1", .fn = sc_cumsum_b, .ref = sc_cumsum_r, .ctx = &(const sc_ctx){.dim = -1}, .n_in = 1,
     .in = {SC_X3}, .sym = {2, 3, 5}, .flags = H_CPU_ONLY | H_VK_NATIVE},
    {.name = "cumsum dim 1", .fn = sc_cumsum_b, .ref = sc_cumsum_r, .ctx = &(const sc_ctx){.dim = 1}, .n_in = 1,
     .in = {SC_X3}, .sym = {2, 4, 3}, .flags = H_CPU_ONLY | H_VK_NATIVE},
    {.name = "tril 0", .fn = sc_tri_b, .ref = sc_tri_r, .ctx = &(const sc_ctx){.k = 0}, .n_in = 1,
     .in = {SC_X3}, .sym = {2, 4, 5}, .flags = H_CPU_ONLY | H_VK_NATIVE},
    {.name = "tril -1", .fn = sc_tri_b, .ref = sc_tri_r, .ctx = &(const sc_ctx){.k = -1}, .n_in = 1,
     .in = {SC_X2}, .sym = {4, 3}, .flags = H_CPU_ONLY | H_VK_NATIVE},
    {.name = "triu 1", .fn = sc_tri_b, .ref = sc_tri_r, .ctx = &(const sc_ctx){.k = 1, .flag = true}, .n_in = 1,
     .in = {SC_X3}, .sym = {2, 4, 5}, .flags = H_CPU_ONLY | H_VK_NATIVE},
    {.name = "triu -2", .fn = sc_tri_b, .ref = sc_tri_r, .ctx = &(const sc_ctx){.k = -2, .flag = true}, .n_in = 1,
     .in = {SC_X2}, .sym = {5, 3}, .flags = H_CPU_ONLY | H_VK_NATIVE},
    /* ties (the expanded variant's equal rows, 16-bit rounding) would make the order and
    ** the gradient's position depend on rounding: H_NO_EXPAND, and indices in f32/f64 */
    {.name = "topk largest k 2 dim -1", .fn = sc_topk_b, .ref = sc_topk_r,
     .ctx = &(const sc_ctx){.dim = -1, .k = 2, .flag = true}, .n_in = 1, .in = {SC_X3}, .sym = {2, 3, 6},
     .flags = H_CPU_ONLY | H_VK_NATIVE | H_NO_EXPAND | H_NO_LOWP},
    {.name = "topk smallest k 3 dim 0", .fn = sc_topk_b, .ref = sc_topk_r,
     .ctx = &(const sc_ctx){.dim = 0, .k = 3, .flag = false}, .n_in = 1, .in = {SC_X2}, .sym = {5, 4},
     .flags = H_CPU_ONLY | H_VK_NATIVE | H_NO_EXPAND | H_NO_LOWP},
    {.name = "topk indices", .fn = sc_topk_b, .ref = sc_topk_r,
     .ctx = &(const sc_ctx){.dim = 1, .k = 2, .flag = true, .indices = true}, .n_in = 1, .in = {SC_X3},
     .sym = {2, 5, 3}, .flags = H_CPU_ONLY | H_VK_NATIVE | H_NO_EXPAND | H_NO_LOWP | H_NO_GRAD},
    /* integer samples: the f16/bf16 runs draw from the rounded probabilities, as the f64
    ** run they are compared with does, so they match exactly */
    {.name = "multinomial with replacement", .fn = sc_mn_b, .ref = sc_mn_r,
     .ctx = &(const sc_ctx){.k = 7, .flag = true}, .n_in = 1, .in = {SC_P2}, .sym = {3, 5},
     .flags = H_CPU_ONLY | H_NO_GRAD},
    {.name = "multinomial without replacement", .fn = sc_mn_b, .ref = sc_mn_r,
     .ctx = &(const sc_ctx){.k = 4, .flag = false}, .n_in = 1, .in = {SC_P2}, .sym = {3, 6},
     .flags = H_CPU_ONLY | H_NO_GRAD | H_NO_SIZE1},
    {.name = "multinomial 1-d", .fn = sc_mn_b, .ref = sc_mn_r, .ctx = &(const sc_ctx){.k = 5, .flag = true},
     .n_in = 1, .in = {{.ndim = 1, .shape = {H_SYM(0)}, .fill = H_POSITIVE}}, .sym = {4},
     .flags = H_CPU_ONLY | H_NO_GRAD},
};

static void sc_extra(void) {
  kiln_scope_begin();
  kiln_device cpu = kiln_device_cpu();
  /* integer cumsum is i64 and exact */
  kiln_tensor *ci = kiln_cumsum(kiln_to_dtype(H_T(KILN_SHAPE(4), KILN_F64, 1, 2, 3, 4), KILN_I32), 0);
  H_CHECK(ci && kiln_dtype_of(ci) == KILN_I64, "cumsum of int32 is int64");
  if (ci) h_tensor_close("cumsum of int32", ci, (double[]){1, 3, 6, 10}, 4, 0, 0);
  /* a class of probability 0 is never drawn; the frequencies follow the weights */
  kiln_tensor *p = H_T(KILN_SHAPE(4), KILN_F32, 0.1, 0, 0.6, 0.3);
  kiln_generator *g = kiln_generator_new(3);
  kiln_tensor *s = kiln_multinomial(p, 20000, true, g);
  int64_t n = 0;
  double *v = h_values(s, &n), cnt[4] = {0};
  for (int64_t i = 0; v && i < n; i++) cnt[(int)v[i]]++;
  H_CHECK(v && cnt[1] == 0, "multinomial drew a class of probability 0 %g times", cnt[1]);
  H_CHECK(v && fabs(cnt[2] / 20000 - 0.6) < 0.02 && fabs(cnt[0] / 20000 - 0.1) < 0.01,
          "multinomial frequencies %g %g %g %g, expected 0.1 0 0.6 0.3", cnt[0] / 2e4, cnt[1] / 2e4, cnt[2] / 2e4,
          cnt[3] / 2e4);
  free(v);
  /* without replacement: distinct classes in every row */
  kiln_tensor *d = kiln_multinomial(kiln_ones(KILN_SHAPE(2, 6), KILN_F32, cpu), 6, false, g);
  v = h_values(d, &n);
  bool distinct = v != NULL;
  for (int r = 0; v && r < 2; r++)
    for (int i = 0; i < 6; i++)
      for (int j = 0; j < i; j++) distinct &= v[r * 6 + i] != v[r * 6 + j];
  H_CHECK(distinct, "multinomial without replacement repeated a class");
  free(v);
  H_EXPECT_ERR(kiln_multinomial(H_T(KILN_SHAPE(3), KILN_F32, 0.5, -0.1, 0.6), 1, true, g), KILN_ERR_INVALID_ARGUMENT,
               "multinomial of a negative probability");
  H_EXPECT_ERR(kiln_multinomial(H_T(KILN_SHAPE(2), KILN_F32, 0, 0), 1, true, g), KILN_ERR_INVALID_ARGUMENT,
               "multinomial of a row of zeros");
  H_EXPECT_ERR(kiln_multinomial(H_T(KILN_SHAPE(3), KILN_F32, 1, 0, 1), 3, false, g), KILN_ERR_INVALID_ARGUMENT,
               "multinomial: 3 samples without replacement from 2 nonzero classes");
  H_EXPECT_ERR(kiln_multinomial(p, 5, false, g), KILN_ERR_INVALID_ARGUMENT, "multinomial: 5 of 4 classes");
  H_EXPECT_ERR(kiln_multinomial(p, 0, true, g), KILN_ERR_INVALID_ARGUMENT, "multinomial: 0 samples");
  kiln_generator_free(g);
  H_EXPECT_ERR(kiln_tril(H_T(KILN_SHAPE(3), KILN_F32, 1, 2, 3), 0), KILN_ERR_SHAPE, "tril of a 1-d tensor");
  H_EXPECT_ERR(kiln_topk(p, 5, 0, true, true, NULL), KILN_ERR_INVALID_ARGUMENT, "topk k 5 of 4");
  H_EXPECT_ERR(kiln_cumsum(p, 1), KILN_ERR_INVALID_ARGUMENT, "cumsum dim 1 of a 1-d tensor");
  kiln_scope_end();
}

#ifndef H_NO_MAIN
int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_scan");
  h_run_cases(sc_cases, (int)(sizeof sc_cases / sizeof sc_cases[0]));
  if (!h_cross_only() && !h_support_mode()) sc_extra();
  return h_finish();
}
#endif
