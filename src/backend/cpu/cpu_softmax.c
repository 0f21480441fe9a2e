/*
** Softmax and log-softmax along one dim (numerically stable: the row max is subtracted
** before exp), their backward rules, and the fused cross-entropy loss with its backward.
** Each row is gathered into a contiguous buffer of the compute type (f32 for f32/f16/bf16,
** f64 for f64), so strided and 16-bit inputs take the same loops; sums over a row
** accumulate in f64 so that long rows (vocabularies) lose nothing.
*/
/* Kernels never read the FP exception flags, so comparisons may be treated as not
** trapping: that is what lets GCC turn the selects in these loops (clamps, relu, NaN
** checks, the range limits of kiln__expf) into vector blends instead of branches. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#include "cpu.h"
#include "cpu_iter.h"
#include "cpu_avx512.h"

#include <stdint.h>
#include <stdlib.h>
#include <tgmath.h>

#define KILN__EXP(v) _Generic((v), float: kiln__expf, default: exp)(v)

/* The row loops (exp, sums, max) in AVX-512 / AVX2 clones picked at load time, where GCC
** builds for x86-64 Linux: the build targets baseline x86-64, and a language model's
** head (2048 rows of 4096 logits, forward and backward) spent ~35 ms a step in them at 4
** lanes. Called once a row, so the indirect call costs nothing. */

/* Rows up to this long use stack buffers; longer ones one heap buffer per thread. */
#define KILN__SM_STACK 2048

typedef struct kiln__rows {
  const kiln__kargs *a;
  kiln__view v[5];    /* per-row base pointers: one view per tensor, row dim removed */
  int nv;
  int64_t len;        /* row length */
  int64_t bst[5];     /* byte stride along the row, per view */
  kiln_dtype ct;      /* F32 or F64 */
  int failed;         /* heap buffer allocation failed */
  double gscale;      /* cross entropy's fused dlogits: the upstream grad of every row */
} kiln__rows;

/* ---- softmax family: row kernels on contiguous T arrays ---- */

/* ---- AVX-512 row loops for the f32 compute type (cross-entropy, softmax) ----
** A language model's head (2048 rows of 4096 logits, bf16, the small GPT on 2 cores) spent
** ~12 ms a step in the rows: rowmax stayed scalar (its NaN rule is a select GCC does not
** vectorise: 1.8 cycles an element), sumexp ran 8 lanes wide (its eight f64 sums). Written
** here with intrinsics, 16 lanes, picked at run time where the CPU has AVX-512F/DQ:
**   rowmax   the same value (max is exact; a row with a NaN takes the portable loop, which
**            returns its NaN as before);
**   sumexp   exp by kiln__exp16_fma (fused multiply-adds: within an ulp or two of the
**            portable loop's kiln__expf, not its bits; about half its instructions), each
**            value widened to f64 exactly and summed in 16 f64 lanes;
**   ce_bw    x_i = g (exp(x_i - lse) - off), the same exp: the forward's fused dlogits and
**            CROSS_ENTROPY_BACKWARD still agree bit for bit (both run ce_bw16).
** On an AVX-512 CPU every row takes these (a row with a NaN: NaN either way), so the
** numbers do not depend on a tensor's layout. (kiln__exp16_fma: cpu_avx512.h) */
#ifdef KILN__AVX512
/* the max of x[0..n), n > 0; false (nothing set) when the row holds a NaN */
KILN__T512 static bool kiln__rowmax16(const float *x, int64_t n, float *out) {
  __m512 m = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, v);
  }
  if (i < n) {
    __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
    __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, v);
  }
  if (nan) return false;
  float r = _mm512_reduce_max_ps(m);
  *out = r == -INFINITY ? 0 : r; /* all -inf: keep exp finite, as the portable loop */
  return true;
}

/* sum of exp(x_i - m) over x[0..n), in f64 */
KILN__T512 static double kiln__sumexp16(const float *x, int64_t n, float m) {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  __m512 mv = _mm512_set1_ps(m);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 e = kiln__exp16_fma(_mm512_sub_ps(_mm512_loadu_ps(x + i), mv));
    a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
  }
  if (i < n) {
    __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
    __m512 e = _mm512_maskz_mov_ps(k, kiln__exp16_fma(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), mv)));
    a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
    a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
}

/* x_i <- g (exp(x_i - lse) - off) over x[0..n) */
KILN__T512 static void kiln__ce_bw16(float *x, int64_t n, float lse, float off, float g) {
  __m512 lv = _mm512_set1_ps(lse), ov = _mm512_set1_ps(off), gv = _mm512_set1_ps(g);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(x + i, _mm512_mul_ps(gv, _mm512_sub_ps(kiln__exp16_fma(_mm512_sub_ps(_mm512_loadu_ps(x + i), lv)), ov)));
  if (i < n) {
    __mmask16 k = (__mmask16)((1u << (n - i)) - 1);
    __m512 v = _mm512_maskz_loadu_ps(k, x + i);
    _mm512_mask_storeu_ps(x + i, k, _mm512_mul_ps(gv, _mm512_sub_ps(kiln__exp16_fma(_mm512_sub_ps(v, lv)), ov)));
  }
}
#endif

#define KILN__SM_FNS(T, SUF)                                                              \
  /* sum of exp(x - m) in f64, eight independent lanes so the loop vectorizes */          \
  KILN__CPU_CLONES512 static double kiln__sumexp_##SUF(const T *x, int64_t n, T m) {                          \
    double s8[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                              \
    int64_t i = 0;                                                                        \
    for (; i + 8 <= n; i += 8)                                                            \
      for (int j = 0; j < 8; j++) s8[j] += (double)KILN__EXP(x[i + j] - m);               \
    for (; i < n; i++) s8[0] += (double)KILN__EXP(x[i] - m);                              \
    return ((s8[0] + s8[1]) + (s8[2] + s8[3])) + ((s8[4] + s8[5]) + (s8[6] + s8[7]));     \
  }                                                                                       \
  KILN__CPU_CLONES512 static double kiln__sum_##SUF(const T *x, int64_t n) {                                  \
    double s8[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                              \
    int64_t i = 0;                                                                        \
    for (; i + 8 <= n; i += 8)                                                            \
      for (int j = 0; j < 8; j++) s8[j] += (double)x[i + j];                              \
    for (; i < n; i++) s8[0] += (double)x[i];                                             \
    return ((s8[0] + s8[1]) + (s8[2] + s8[3])) + ((s8[4] + s8[5]) + (s8[6] + s8[7]));     \
  }                                                                                       \
  KILN__CPU_CLONES512 static T kiln__rowmax_##SUF(const T *x, int64_t n) {                                    \
    T m = -INFINITY;                                                                      \
    for (int64_t i = 0; i < n; i++) m = (x[i] > m || x[i] != x[i]) ? x[i] : m;            \
    return m == -INFINITY ? 0 : m; /* all -inf: keep exp finite (NaN results, as torch) */ \
  }                                                                                       \
  KILN__CPU_CLONES512 static void kiln__softmax_row_##SUF(T *x, int64_t n, bool logsm) {                      \
    T m = kiln__rowmax_##SUF(x, n);                                                       \
    if (logsm) {                                                                          \
      /* (x - m) - log(s), not x - (m + log(s)): m + log(s) rounds at m's magnitude */    \
      T ls = (T)log(kiln__sumexp_##SUF(x, n, m));                                         \
      for (int64_t i = 0; i < n; i++) x[i] = (x[i] - m) - ls;                             \
    } else {                                                                              \
      for (int64_t i = 0; i < n; i++) x[i] = KILN__EXP(x[i] - m);                         \
      T inv = (T)(1.0 / kiln__sum_##SUF(x, n));                                           \
      for (int64_t i = 0; i < n; i++) x[i] *= inv;                                        \
    }                                                                                     \
  }                                                                                       \
  /* y (softmax out) and g: y <- y*(g - sum(g*y)); logsm: y <- g - exp(y)*sum(g) */        \
  KILN__CPU_CLONES512 static void kiln__softmax_bw_row_##SUF(T *y, const T *g, int64_t n, bool logsm) {       \
    double s = 0;                                                                         \
    if (logsm) {                                                                          \
      T ts = (T)kiln__sum_##SUF(g, n);                                                    \
      for (int64_t i = 0; i < n; i++) y[i] = g[i] - KILN__EXP(y[i]) * ts;                 \
    } else {                                                                              \
      for (int64_t i = 0; i < n; i++) s += (double)g[i] * (double)y[i];                   \
      T ts = (T)s;                                                                        \
      for (int64_t i = 0; i < n; i++) y[i] = y[i] * (g[i] - ts);                          \
    }                                                                                     \
  }
KILN__SM_FNS(float, f32)
KILN__SM_FNS(double, f64)

static void kiln__sm_run(void *vctx, char *const *p, const int64_t *bst, int64_t n, int64_t k0) {
  kiln__rows *c = (kiln__rows *)vctx;
  const kiln__kargs *a = c->a;
  bool bw = a->op == KILN__K_SOFTMAX_BACKWARD || a->op == KILN__K_LOG_SOFTMAX_BACKWARD;
  bool logsm = a->op == KILN__K_LOG_SOFTMAX || a->op == KILN__K_LOG_SOFTMAX_BACKWARD;
  int64_t len = c->len;
  _Alignas(64) double sb[2][KILN__SM_STACK];
  double *b0 = sb[0], *b1 = sb[1], *heap = NULL;
  (void)k0;
  if (len > KILN__SM_STACK) {
    heap = (double *)malloc((size_t)len * 2 * sizeof(double));
    if (!heap) {
      c->failed = 1;
      return;
    }
    b0 = heap;
    b1 = heap + len;
  }
  /* view order: [0] out, [1] in0, [2] in1 */
  for (int64_t r = 0; r < n; r++) {
    char *po = p[0] + r * bst[0];
    kiln__cpu_load(b0, c->ct, p[1] + r * bst[1], c->bst[1], c->v[1].dtype, len);
    if (bw) kiln__cpu_load(b1, c->ct, p[2] + r * bst[2], c->bst[2], c->v[2].dtype, len);
    if (c->ct == KILN_F32) {
      if (bw)
        kiln__softmax_bw_row_f32((float *)b0, (const float *)b1, len, logsm);
      else
        kiln__softmax_row_f32((float *)b0, len, logsm);
    } else {
      if (bw)
        kiln__softmax_bw_row_f64(b0, b1, len, logsm);
      else
        kiln__softmax_row_f64(b0, len, logsm);
    }
    kiln__cpu_store(po, c->bst[0], c->v[0].dtype, b0, c->ct, len);
  }
  free(heap);
}

static void kiln__rows_range(void *vctx, int64_t lo, int64_t hi);

/* Sets up c for rows along dim d of views vs[0..nv) (all with in0's shape). */
static void kiln__rows_init(kiln__rows *c, const kiln__kargs *a, const kiln__view *vs, int nv, int d) {
  c->a = a;
  c->nv = nv;
  c->failed = 0;
  c->gscale = 1;
  c->len = vs[0].shape[d];
  for (int i = 0; i < nv; i++) {
    c->v[i] = vs[i];
    c->bst[i] = vs[i].strides[d] * (int64_t)kiln__cpu_esize(vs[i].dtype);
    for (int k = d; k < vs[i].ndim - 1; k++) {
      c->v[i].shape[k] = c->v[i].shape[k + 1];
      c->v[i].strides[k] = c->v[i].strides[k + 1];
    }
    c->v[i].ndim = vs[i].ndim - 1;
  }
}

typedef struct kiln__rows_job {
  kiln__rows *c;
  kiln__cpu_run_fn fn;
} kiln__rows_job;

static void kiln__rows_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__rows_job *j = (kiln__rows_job *)vctx;
  kiln__cpu_walk(j->c->v, j->c->nv, lo, hi, j->fn, j->c);
}

static kiln_status kiln__rows_go(kiln__rows *c, kiln__cpu_run_fn fn) {
  int64_t nrows = kiln__view_numel(&c->v[0]); /* 0-d view after removing the only dim: 1 */
  if (nrows == 0 || c->len == 0) return KILN_OK;
  kiln__views_coalesce(c->v, c->nv);
  kiln__rows_job j = {c, fn};
  int64_t rw = c->len + KILN__CPU_ROW_COST, work = nrows * rw;
  kiln__cpu_parallel_for(nrows, work < KILN__CPU_PAR_MIN ? INT64_MAX : KILN__CPU_PAR_MIN / rw + 1,
                         kiln__rows_range, &j);
  if (c->failed)
    return kiln_set_error(KILN_ERR_OOM, "kiln_%s: out of host memory for a row of %lld",
                          kiln__kop_name(c->a->op), (long long)c->len);
  return KILN_OK;
}

kiln_status kiln__cpu_softmax(const kiln__kargs *a) {
  const kiln__view *in = &a->in[0];
  int64_t d = a->i[0];
  if (d < 0 || d >= in->ndim)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_%s: dim %lld invalid for %d dims",
                          kiln__kop_name(a->op), (long long)d, in->ndim);
  bool bw = a->op == KILN__K_SOFTMAX_BACKWARD || a->op == KILN__K_LOG_SOFTMAX_BACKWARD;
  if (!kiln__cpu_is_float(a->out[0].dtype)) return kiln__cpu_dtype_error(a, a->out[0].dtype);
  for (int i = 0; i < (bw ? 2 : 1); i++)
    if (!kiln__cpu_is_float(a->in[i].dtype)) return kiln__cpu_dtype_error(a, a->in[i].dtype);
  kiln__view vs[3] = {a->out[0], a->in[0], bw ? a->in[1] : a->in[0]};
  kiln__rows c;
  kiln__rows_init(&c, a, vs, bw ? 3 : 2, (int)d);
  c.ct = kiln__cpu_ct(a->out[0].dtype);
  return kiln__rows_go(&c, kiln__sm_run);
}

/* ---- cross entropy ---- */
/* Checks every target before anything is written. */
static kiln_status kiln__ce_check(const kiln__kargs *a, const char *name) {
  const kiln__view *lg = &a->in[0], *tg = &a->in[1];
  if (lg->ndim != 2 || tg->ndim != 1 || tg->shape[0] != lg->shape[0])
    return kiln_set_error(KILN_ERR_SHAPE, "%s: logits must be (N, C) and target (N)", name);
  if (tg->dtype != KILN_I64 && tg->dtype != KILN_I32)
    return kiln_set_error(KILN_ERR_DTYPE, "%s: target dtype %s is not int64 or int32", name,
                          kiln_dtype_name(tg->dtype));
  if (!kiln__cpu_is_float(lg->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: logits dtype %s is not a float dtype", name,
                          kiln_dtype_name(lg->dtype));
  int64_t nrow = lg->shape[0], ncls = lg->shape[1];
  size_t es = kiln__cpu_esize(tg->dtype);
  for (int64_t r = 0; r < nrow; r++) {
    int64_t t = kiln__cpu_get_i64((const char *)tg->data + r * tg->strides[0] * (int64_t)es, tg->dtype);
    if (t == a->i[0]) continue;
    if (t < 0 || t >= ncls)
      return kiln_set_error(KILN_ERR_INDEX, "%s: target %lld is out of range for %lld classes (row %lld)",
                            name, (long long)t, (long long)ncls, (long long)r);
  }
  return KILN_OK;
}

#define KILN__CE_FNS(T, SUF)                                                              \
  /* x: one row of logits; returns the loss, *lse_out the logsumexp */                    \
  KILN__CPU_CLONES512 static T kiln__ce_row_##SUF(const T *x, int64_t n, int64_t t, double eps, T *lse_out) { \
    T mm = kiln__rowmax_##SUF(x, n);                                                      \
    double lse = (double)mm + log(kiln__sumexp_##SUF(x, n, mm));                          \
    *lse_out = (T)lse;                                                                    \
    double loss = (1.0 - eps) * (lse - (double)x[t]);                                     \
    if (eps != 0) loss += eps * (lse - kiln__sum_##SUF(x, n) / (double)n);                \
    return (T)loss;                                                                       \
  }                                                                                       \
  KILN__CPU_CLONES512 static void kiln__ce_bw_row_##SUF(T *x, int64_t n, int64_t t, double eps, T lse, T g) { \
    T off = (T)(eps / (double)n), on = (T)(1.0 - eps);                                    \
    for (int64_t i = 0; i < n; i++) x[i] = g * (KILN__EXP(x[i] - lse) - off);                   \
    x[t] -= g * on;                                                                       \
  }
KILN__CE_FNS(float, f32)
KILN__CE_FNS(double, f64)

/* kiln__ce_row_f32 and kiln__ce_bw_row_f32 on the AVX-512 loops where they run (the same
** formulas; the exp: see above) */
static float kiln__ce_row_f32x(const float *x, int64_t n, int64_t t, double eps, float *lse_out) {
#ifdef KILN__AVX512
  float mm;
  if (n > 0 && kiln__avx512_ok() && kiln__rowmax16(x, n, &mm)) { /* a NaN: the portable row */
    double lse = (double)mm + log(kiln__sumexp16(x, n, mm));
    *lse_out = (float)lse;
    double loss = (1.0 - eps) * (lse - (double)x[t]);
    if (eps != 0) loss += eps * (lse - kiln__sum_f32(x, n) / (double)n);
    return (float)loss;
  }
#endif
  return kiln__ce_row_f32(x, n, t, eps, lse_out);
}
static void kiln__ce_bw_row_f32x(float *x, int64_t n, int64_t t, double eps, float lse, float g) {
#ifdef KILN__AVX512
  if (kiln__avx512_ok()) {
    float off = (float)(eps / (double)n), on = (float)(1.0 - eps);
    kiln__ce_bw16(x, n, lse, off, g);
    x[t] -= g * on;
    return;
  }
#endif
  kiln__ce_bw_row_f32(x, n, t, eps, lse, g);
}

/* view order, forward: [0] logits row, [1] target, [2] loss, [3] lse, [4] weight;
** backward: [0] dlogits row, [1] logits row, [2] target, [3] lse, [4] grad.
** The forward's optional dlogits (kiln__ce_dlogits) is addressed by row index, as the
** backward's divisor is: the walk takes at most five views. */
static void kiln__ce_run(void *vctx, char *const *p, const int64_t *bst, int64_t n, int64_t k0) {
  kiln__rows *c = (kiln__rows *)vctx;
  const kiln__kargs *a = c->a;
  bool bw = a->op == KILN__K_CROSS_ENTROPY_BACKWARD;
  int64_t len = c->len;
  double eps = a->s[0];
  _Alignas(64) double sb[KILN__SM_STACK];
  double *b0 = sb, *heap = NULL;
  if (len > KILN__SM_STACK) {
    heap = (double *)malloc((size_t)len * sizeof(double));
    if (!heap) {
      c->failed = 1;
      return;
    }
    b0 = heap;
  }
  int ti = bw ? 2 : 1;
  /* backward with n_in == 5: in4 (N) divides each row's grad (the mean's count); the
  ** forward's fused gradient with n_in == 3: in2 */
  const kiln__view *div = bw ? (a->n_in > 4 ? &a->in[4] : NULL) : (a->n_in > 2 ? &a->in[2] : NULL);
  const kiln__view *dl = kiln__ce_dlogits(a);
  int64_t dles = dl ? (int64_t)kiln__cpu_esize(dl->dtype) : 0;
  for (int64_t r = 0; r < n; r++) {
    int64_t t = kiln__cpu_get_i64(p[ti] + r * bst[ti], c->v[ti].dtype);
    bool ignored = t == a->i[0];
    if (!bw) {
      double loss = 0, lse = 0;
      if (!ignored) {
        kiln__cpu_load(b0, c->ct, p[0] + r * bst[0], c->bst[0], c->v[0].dtype, len);
        if (c->ct == KILN_F32) {
          float l32;
          loss = kiln__ce_row_f32x((const float *)b0, len, t, eps, &l32);
          lse = l32;
        } else {
          loss = kiln__ce_row_f64(b0, len, t, eps, &lse);
        }
      }
      kiln__cpu_set_f64(p[2] + r * bst[2], c->v[2].dtype, loss);
      if (c->nv > 3) kiln__cpu_set_f64(p[3] + r * bst[3], c->v[3].dtype, lse);
      if (c->nv > 4) kiln__cpu_set_f64(p[4] + r * bst[4], c->v[4].dtype, ignored ? 0.0 : 1.0);
      if (dl) { /* the row still in b0: its gradient in place, as the backward kernel's */
        double g = c->gscale;
        if (div && !ignored)
          g /= kiln__cpu_get_f64((const char *)div->data + (k0 + r) * div->strides[0] *
                                                              (int64_t)kiln__cpu_esize(div->dtype),
                                 div->dtype);
        if (ignored)
          for (int64_t i = 0; i < len; i++) b0[i] = 0;
        else if (c->ct == KILN_F32)
          kiln__ce_bw_row_f32x((float *)b0, len, t, eps, (float)lse, (float)g);
        else
          kiln__ce_bw_row_f64(b0, len, t, eps, lse, g);
        kiln__cpu_store((char *)dl->data + (k0 + r) * dl->strides[0] * dles, dl->strides[1] * dles,
                        dl->dtype, b0, c->ct, len);
      }
    } else {
      if (ignored) {
        for (int64_t i = 0; i < len; i++) b0[i] = 0; /* zeros in any compute type */
      } else {
        double lse = kiln__cpu_get_f64(p[3] + r * bst[3], c->v[3].dtype);
        double g = kiln__cpu_get_f64(p[4] + r * bst[4], c->v[4].dtype);
        if (div)
          g /= kiln__cpu_get_f64((const char *)div->data + (k0 + r) * div->strides[0] *
                                                              (int64_t)kiln__cpu_esize(div->dtype),
                                 div->dtype);
        kiln__cpu_load(b0, c->ct, p[1] + r * bst[1], c->bst[1], c->v[1].dtype, len);
        if (c->ct == KILN_F32)
          kiln__ce_bw_row_f32x((float *)b0, len, t, eps, (float)lse, (float)g);
        else
          kiln__ce_bw_row_f64(b0, len, t, eps, lse, g);
      }
      kiln__cpu_store(p[0] + r * bst[0], c->bst[0], c->v[0].dtype, b0, c->ct, len);
    }
  }
  free(heap);
}

/* Row views: a 1-d view (N) gets a fake dim of size C with stride 0, so every view has the
** logits' shape and the row dim can be removed from all alike. */
static kiln__view kiln__ce_rowview(const kiln__view *v, int64_t ncls) {
  kiln__view r = *v;
  r.ndim = 2;
  r.shape[1] = ncls;
  r.strides[1] = 0;
  return r;
}

/* CROSS_ENTROPY with every row's fused gradient (if asked for) scaled by gscale. */
static kiln_status kiln__ce_forward(const kiln__kargs *a, double gscale) {
  kiln_status st = kiln__ce_check(a, "kiln_cross_entropy");
  if (st != KILN_OK) return st;
  if (!kiln__cpu_is_float(a->out[0].dtype)) return kiln__cpu_dtype_error(a, a->out[0].dtype);
  int64_t ncls = a->in[0].shape[1];
  const kiln__view *dl = kiln__ce_dlogits(a);
  int nout = a->n_out - (dl ? 1 : 0); /* loss, lse, weight: those given */
  if (dl && (dl->ndim != 2 || dl->shape[0] != a->in[0].shape[0] || dl->shape[1] != ncls))
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_cross_entropy: dlogits must have the logits' shape (N, C)");
  if (dl && !kiln__cpu_is_float(dl->dtype)) return kiln__cpu_dtype_error(a, dl->dtype);
  kiln__view vs[5] = {a->in[0], kiln__ce_rowview(&a->in[1], ncls), kiln__ce_rowview(&a->out[0], ncls),
                      nout > 1 ? kiln__ce_rowview(&a->out[1], ncls) : a->in[0],
                      nout > 2 ? kiln__ce_rowview(&a->out[2], ncls) : a->in[0]};
  kiln__rows c;
  kiln__rows_init(&c, a, vs, nout > 2 ? 5 : (nout > 1 ? 4 : 3), 1);
  c.ct = kiln__cpu_ct(a->in[0].dtype);
  c.gscale = gscale;
  if (ncls == 0) { /* no classes: nothing to normalise; loss is undefined, write NaN */
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_cross_entropy: logits have 0 classes");
  }
  return kiln__rows_go(&c, kiln__ce_run);
}

kiln_status kiln__cpu_cross_entropy(const kiln__kargs *a) { return kiln__ce_forward(a, 1.0); }

/* The mean in one call: the per-row kernel into scratch rows (loss, weight), then one
** ordered f64 sum of each. The fused gradient needs the count first: the targets are
** counted before the rows run, and each row's gradient is scaled by 1 / count (1 / 0 =
** inf when every row is ignored, but then no row is scaled: zeros). */
kiln_status kiln__cpu_cross_entropy_mean(const kiln__kargs *a) {
  const kiln__view *dl = kiln__ce_dlogits(a);
  int nout = a->n_out - (dl ? 1 : 0);
  if (nout < 3 || kiln__view_numel(&a->out[0]) != 1 || kiln__view_numel(&a->out[2]) != 1)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln_cross_entropy: the mean kernel wants 3 outputs "
                          "(4 with dlogits), one element in out0 and out2");
  kiln_status st = kiln__ce_check(a, "kiln_cross_entropy");
  if (st != KILN_OK) return st;
  kiln_dtype lt = a->out[0].dtype;
  if (lt != KILN_F32 && lt != KILN_F64) return kiln__cpu_dtype_error(a, lt);
  int64_t nrow = a->in[0].shape[0];
  size_t es = kiln__cpu_esize(lt);
  char *scratch = malloc((size_t)(nrow > 0 ? nrow : 1) * 2 * es);
  if (!scratch) return kiln_set_error(KILN_ERR_OOM, "kiln_cross_entropy: out of host memory for %lld rows", (long long)nrow);
  double sum = 0, cnt = 0;
  if (nrow > 0) {
    kiln__kargs r = *a;
    r.op = KILN__K_CROSS_ENTROPY;
    r.n_out = dl ? 4 : 3;
    r.out[0] = a->out[1]; /* shape and dtype of an (N) row view; data replaced below */
    r.out[0].data = scratch;
    r.out[0].strides[0] = 1;
    r.out[0].dtype = lt;
    r.out[1] = a->out[1];
    r.out[2] = r.out[0];
    r.out[2].data = scratch + (size_t)nrow * es;
    double gscale = 1.0;
    if (dl) {
      const kiln__view *tg = &a->in[1];
      int64_t tes = (int64_t)kiln__cpu_esize(tg->dtype), kept = 0;
      for (int64_t i = 0; i < nrow; i++)
        kept += kiln__cpu_get_i64((const char *)tg->data + i * tg->strides[0] * tes, tg->dtype) != a->i[0];
      gscale = 1.0 / (double)kept;
      r.out[3] = *dl;
    }
    st = kiln__ce_forward(&r, gscale);
    for (int64_t i = 0; i < nrow && st == KILN_OK; i++) {
      sum += kiln__cpu_get_f64(scratch + (size_t)i * es, lt);
      cnt += kiln__cpu_get_f64(scratch + (size_t)(nrow + i) * es, lt);
    }
  }
  free(scratch);
  if (st != KILN_OK) return st;
  kiln__cpu_set_f64(a->out[0].data, lt, sum / cnt); /* no kept rows: 0 / 0 = NaN */
  kiln__cpu_set_f64(a->out[2].data, a->out[2].dtype, cnt);
  return KILN_OK;
}

kiln_status kiln__cpu_cross_entropy_backward(const kiln__kargs *a) {
  kiln_status st = kiln__ce_check(a, "kiln_cross_entropy_backward");
  if (st != KILN_OK) return st;
  if (!kiln__cpu_is_float(a->out[0].dtype)) return kiln__cpu_dtype_error(a, a->out[0].dtype);
  int64_t ncls = a->in[0].shape[1];
  kiln__view vs[5] = {a->out[0], a->in[0], kiln__ce_rowview(&a->in[1], ncls),
                      kiln__ce_rowview(&a->in[2], ncls), kiln__ce_rowview(&a->in[3], ncls)};
  kiln__rows c;
  kiln__rows_init(&c, a, vs, 5, 1);
  c.ct = kiln__cpu_ct(a->out[0].dtype);
  return kiln__rows_go(&c, kiln__ce_run);
}
