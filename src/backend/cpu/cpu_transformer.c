/*
** The transformer kernels of the CPU: the fused layer and RMS norms (forward saving the
** mean and rstd, backward giving dx, dweight, dbias) and scaled dot-product attention
** (forward and backward), blocked over keys with an online softmax.
**
** Every value is computed in f64 whatever the dtype (rows are gathered into f64 buffers
** with kiln__cpu_load and stored back rounded once), so f32, f16 and bf16 results are the
** f64 result rounded: the harness's f32 tolerance then measures only the final rounding.
** This is the reference path; f32 and bf16 tensors take faster f32 paths behind the same
** kernel signatures where the CPU has one (the norms on AVX-512, attention on sgemm or
** oneDNN: below).
**
** Attention (FlashAttention's algorithm, Dao et al. 2022, on one core per query row):
** for a query row i the scores s_j = scale * q_i . k_j + mask_ij are taken BK keys at a
** time; a running max m, normaliser l and accumulator acc (Dv) are rescaled by
** exp(m_old - m_new) when a block raises the max, so no Tq x Tk matrix exists, only K and
** V of one (b, h) converted to f64 (the size of the inputs) and BK scores per thread. The
** forward saves lse_i = m + log(l); the backward recomputes P_ij = exp(s_ij - lse_i)
** block by block, in two passes per query row: the first gives delta_i = sum_j P_ij Z_ij
** (dO_i . v_j) (= dO_i . O_i, which would need the output: no input slot is left for
** it), the second dv_j += P Z dO_i, dS = P (Z dO_i.v_j - delta_i), dq_i += scale dS k_j,
** dk_j += scale dS q_i. Z_ij is dropout's keep mask times 1/(1-p), drawn again from the
** same (seed, offset) as the forward. A row whose keys are all masked gives zeros (and lse
** -inf, zero gradients).
*/
#include "cpu.h"
#include "cpu_iter.h"
#include "cpu_avx512.h"
#include "../../core/kiln_int.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef KILN_HAVE_OPENMP
#include <omp.h>
#endif

#define KILN__ATT_BK 64 /* keys per block */

static char *kiln__at(const kiln__view *v, int n, const int64_t *idx) {
  int64_t off = 0;
  for (int d = 0; d < n; d++) off += idx[d] * v->strides[d];
  return (char *)v->data + off * (int64_t)kiln__cpu_esize(v->dtype);
}

static int64_t kiln__bst(const kiln__view *v, int d) {
  return v->strides[d] * (int64_t)kiln__cpu_esize(v->dtype);
}

/* ---- layer norm / RMS norm ---- */
typedef struct kiln__ln {
  const kiln__kargs *a;
  int64_t rows, n;
  const double *w, *b; /* NULL when absent */
  bool rms, failed;
} kiln__ln;

/* The norms' row arithmetic, in f64, with sums in 8 independent lanes (one dependent
** chain of adds does not vectorise without -ffast-math) and the weight/bias branches out
** of the loops; AVX-512 / AVX2 clones where GCC builds for x86-64 Linux (the build
** targets baseline x86-64). A GPT's (2048, 256) layer_norm took ~0.7 ms a call. */
#define KILN__LN_LANES 8

/* x (n) normalised in place: (x - mean) rstd (* w) (+ b); mean 0 for RMS norm. */
KILN__CPU_CLONES512 static void kiln__ln_row_fwd(double *x, int64_t n, const double *w, const double *b, bool rms,
                                             double eps, double *mean_out, double *rstd_out) {
  double l[KILN__LN_LANES] = {0}, mean = 0, var = 0;
  int64_t j;
  if (!rms) {
    for (j = 0; j + KILN__LN_LANES <= n; j += KILN__LN_LANES)
      for (int k = 0; k < KILN__LN_LANES; k++) l[k] += x[j + k];
    for (; j < n; j++) mean += x[j];
    for (int k = 0; k < KILN__LN_LANES; k++) mean += l[k], l[k] = 0;
    mean /= (double)n;
  }
  for (j = 0; j + KILN__LN_LANES <= n; j += KILN__LN_LANES)
    for (int k = 0; k < KILN__LN_LANES; k++) l[k] += (x[j + k] - mean) * (x[j + k] - mean);
  for (; j < n; j++) var += (x[j] - mean) * (x[j] - mean);
  for (int k = 0; k < KILN__LN_LANES; k++) var += l[k];
  var /= (double)n;
  double rstd = 1.0 / sqrt(var + eps);
  for (j = 0; j < n; j++) x[j] = (x[j] - mean) * rstd;
  if (w)
    for (j = 0; j < n; j++) x[j] *= w[j];
  if (b)
    for (j = 0; j < n; j++) x[j] += b[j];
  *mean_out = mean, *rstd_out = rstd;
}

/* dx in x: x <- rstd (gw - mean(gw) - xhat mean(gw xhat)), g <- g w (scratch). */
KILN__CPU_CLONES512 static void kiln__ln_row_bwd(double *x, double *g, int64_t n, const double *w, bool rms, double mean,
                                             double rstd) {
  double l1[KILN__LN_LANES] = {0}, l2[KILN__LN_LANES] = {0}, sg = 0, sgx = 0;
  int64_t j;
  for (j = 0; j < n; j++) x[j] = (x[j] - mean) * rstd;
  if (w)
    for (j = 0; j < n; j++) g[j] *= w[j];
  for (j = 0; j + KILN__LN_LANES <= n; j += KILN__LN_LANES)
    for (int k = 0; k < KILN__LN_LANES; k++) l1[k] += g[j + k], l2[k] += g[j + k] * x[j + k];
  for (; j < n; j++) sg += g[j], sgx += g[j] * x[j];
  for (int k = 0; k < KILN__LN_LANES; k++) sg += l1[k], sgx += l2[k];
  sg /= (double)n, sgx /= (double)n;
  if (rms) sg = 0;
  for (j = 0; j < n; j++) x[j] = rstd * (g[j] - sg - x[j] * sgx);
}

/* Row idx's saved statistics: rstd alone for RMS norm (out[1]), else mean (out[1]) and rstd (out[2]). */
static void kiln__ln_save_stats(const kiln__kargs *a, bool rms, const int64_t *idx, double mean, double rstd) {
  if (rms) {
    kiln__cpu_set_f64(kiln__at(&a->out[1], 1, idx), a->out[1].dtype, rstd);
  } else {
    kiln__cpu_set_f64(kiln__at(&a->out[1], 1, idx), a->out[1].dtype, mean);
    kiln__cpu_set_f64(kiln__at(&a->out[2], 1, idx), a->out[2].dtype, rstd);
  }
}

static void kiln__ln_fwd_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__ln *c = vctx;
  const kiln__kargs *a = c->a;
  int64_t n = c->n;
  double *x = malloc(sizeof(double) * (size_t)(n ? n : 1));
  if (!x) {
    c->failed = true;
    return;
  }
  const kiln__view *xv = &a->in[0], *yv = &a->out[0];
  for (int64_t r = lo; r < hi; r++) {
    int64_t idx[2] = {r, 0};
    kiln__cpu_load(x, KILN_F64, kiln__at(xv, 2, idx), kiln__bst(xv, 1), xv->dtype, n);
    double mean, rstd;
    kiln__ln_row_fwd(x, n, c->w, c->b, c->rms, a->s[0], &mean, &rstd);
    kiln__cpu_store(kiln__at(yv, 2, idx), kiln__bst(yv, 1), yv->dtype, x, KILN_F64, n);
    kiln__ln_save_stats(a, c->rms, idx, mean, rstd);
  }
  free(x);
}

static void kiln__ln_bwd_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__ln *c = vctx;
  const kiln__kargs *a = c->a;
  int64_t n = c->n;
  double *x = malloc(sizeof(double) * (size_t)(n ? 2 * n : 1));
  if (!x) {
    c->failed = true;
    return;
  }
  double *g = x + n;
  const kiln__view *xv = &a->in[0], *gv = &a->in[1], *dv = &a->out[0];
  for (int64_t r = lo; r < hi; r++) {
    int64_t idx[2] = {r, 0};
    kiln__cpu_load(x, KILN_F64, kiln__at(xv, 2, idx), kiln__bst(xv, 1), xv->dtype, n);
    kiln__cpu_load(g, KILN_F64, kiln__at(gv, 2, idx), kiln__bst(gv, 1), gv->dtype, n);
    double mean = c->rms ? 0 : kiln__cpu_get_f64(kiln__at(&a->in[2], 1, idx), a->in[2].dtype);
    double rstd = kiln__cpu_get_f64(kiln__at(&a->in[3], 1, idx), a->in[3].dtype);
    /* xhat = (x - mean) rstd, gw = g w: dx = rstd (gw - mean(gw) - xhat mean(gw xhat)),
    ** the mean(gw) term absent for RMS norm (no mean was subtracted). */
    kiln__ln_row_bwd(x, g, n, c->w, c->rms, mean, rstd);
    kiln__cpu_store(kiln__at(dv, 2, idx), kiln__bst(dv, 1), dv->dtype, x, KILN_F64, n);
  }
  free(x);
}

/* dweight_j = sum_r g_rj xhat_rj, dbias_j = sum_r g_rj: a range of columns per item,
** walked row by row (each row's slice of g and x loaded at once, mean and rstd read once
** a row; the strided element-by-element walk down each column was ~10% of a GPT step).
** Each column still sums over r in order, in f64: the same numbers. */
static void kiln__ln_wgrad_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__ln *c = vctx;
  const kiln__kargs *a = c->a;
  int64_t w = hi - lo;
  double *buf = malloc(sizeof(double) * (size_t)(4 * w + 1));
  if (!buf) {
    c->failed = true;
    return;
  }
  double *g = buf, *x = g + w, *sw = x + w, *sb = sw + w;
  for (int64_t j = 0; j < w; j++) sw[j] = 0, sb[j] = 0;
  for (int64_t r = 0; r < c->rows; r++) {
    int64_t idx[2] = {r, lo};
    kiln__cpu_load(g, KILN_F64, kiln__at(&a->in[1], 2, idx), kiln__bst(&a->in[1], 1), a->in[1].dtype, w);
    kiln__cpu_load(x, KILN_F64, kiln__at(&a->in[0], 2, idx), kiln__bst(&a->in[0], 1), a->in[0].dtype, w);
    double mean = c->rms ? 0 : kiln__cpu_get_f64(kiln__at(&a->in[2], 1, idx), a->in[2].dtype);
    double rstd = kiln__cpu_get_f64(kiln__at(&a->in[3], 1, idx), a->in[3].dtype);
    for (int64_t j = 0; j < w; j++) {
      sw[j] += g[j] * (x[j] - mean) * rstd;
      sb[j] += g[j];
    }
  }
  for (int64_t j = 0; j < w; j++) {
    int64_t jj[1] = {lo + j};
    kiln__cpu_set_f64(kiln__at(&a->out[1], 1, jj), a->out[1].dtype, sw[j]);
    if (a->n_out > 2) kiln__cpu_set_f64(kiln__at(&a->out[2], 1, jj), a->out[2].dtype, sb[j]);
  }
  free(buf);
}

/* The setup both norm paths share (the f64 one below, the f32 one on AVX-512). */

/* A 1-d view's n values in the compute type ct (F64 or F32; malloc'd; NULL on OOM). */
static void *kiln__load_vec(const kiln__view *v, int64_t n, kiln_dtype ct) {
  void *p = malloc(kiln__cpu_esize(ct) * (size_t)(n ? n : 1));
  if (p) kiln__cpu_load(p, ct, v->data, kiln__bst(v, 0), v->dtype, n);
  return p;
}

/* The weight and bias in ct (*w, *b: NULL where not given; the forward's in[1], in[2] or
** a lone bias in[1], the backward's weight in[4]); false on OOM. */
static bool kiln__ln_affine(const kiln__kargs *a, bool bw, int64_t n, kiln_dtype ct, void **w, void **b) {
  *w = *b = NULL;
  if ((a->i[0] & 1) && !(*w = kiln__load_vec(&a->in[bw ? 4 : 1], n, ct))) return false;
  if (!bw && (a->i[0] & 2) && !(*b = kiln__load_vec(&a->in[(a->i[0] & 1) ? 2 : 1], n, ct))) return false;
  return true;
}

/* The row loop's min_par for rows of n: serial under KILN__CPU_PAR_MIN of work. */
static int64_t kiln__ln_min_par(int64_t rows, int64_t n) {
  int64_t cost = n + KILN__CPU_ROW_COST;
  return rows * cost < KILN__CPU_PAR_MIN ? INT64_MAX : KILN__CPU_PAR_MIN / cost + 1;
}

/* A backward with no rows: its weight gradients (out[1], and out[2] where asked) are zeros. */
static void kiln__ln_zero_wgrads(const kiln__kargs *a) {
  for (int k = 1; k < a->n_out; k++)
    for (int64_t j = 0; j < a->out[k].shape[0]; j++)
      kiln__cpu_set_f64(kiln__at(&a->out[k], 1, &j), a->out[k].dtype, 0.0);
}

static kiln_status kiln__ln_oom(const char *name, int64_t n) {
  return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory for a row of %lld", name, (long long)n);
}

#ifdef KILN__AVX512
/* ---- the norms in f32 (AVX-512) ----
** For f32 and bf16 x (and gradients) the rows are computed in f32, 16 lanes, as PyTorch's
** CPU kernels do for these dtypes (their accumulate type is float: LayerNormKernel's
** RowwiseMoments, Welford in f32): mean = sum(x) / n, then var = sum((x - mean)^2) / n
** (two passes over the row, which sits in L1), rstd = 1 / sqrtf(var + eps),
** y = (x - mean) rstd w + b rounded once to y's dtype; the backward's dx = rstd (g w -
** mean(g w) - xhat mean(g w xhat)) likewise. Error against the f64 path: the two sums of
** n terms in 16 lanes (n/16 adds a lane, then a 16-way tree) carry a relative error of
** about (n/16 + 4) u (u = 2^-24) of the sum of |terms|, a few 1e-6 for n = 1024, and
** each element a handful of roundings more: below the f32 tolerance of the op tests
** (1e-5), and far below a bf16 output's half ulp (2^-9). The weight gradients keep the
** f64 path's f64 terms (dweight_j = sum_r g_rj (x_rj - mean_r) rstd_r, dbias_j = sum_r
** g_rj), summed in the backward's pass over the rows: per block of KILN__LNF_RB rows in
** row order, then the blocks in order (the same bits for any thread count).
** A GPT's (2048, 256) f32 layer_norm: ~0.33 ms a call in f64 (the rows widened into
** f64 buffers and back). KILN_LAYER_NORM_F32=0 turns this path off (the f64 one: A/B). */
typedef struct kiln__lnf {
  const kiln__kargs *a;
  int64_t rows, n;
  const float *w, *b; /* NULL when absent */
  double *part;       /* backward: each row block's weight sums (2n: dweight, dbias), or NULL */
  bool rms, failed;
} kiln__lnf;

/* rows a block of the backward: its weight gradients' partial sums are one unit, whatever
** the thread count */
#define KILN__LNF_RB 64

KILN__T512 static inline float kiln__hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }

/* row r of a 2-d (rows, n) view with unit inner stride */
static char *kiln__lnf_row(const kiln__view *v, int64_t r) {
  return (char *)v->data + r * v->strides[0] * (int64_t)kiln__cpu_esize(v->dtype);
}

KILN__T512 static void kiln__lnf_fwd_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__lnf *c = vctx;
  const kiln__kargs *a = c->a;
  const int64_t n = c->n;
  const kiln__view *xv = &a->in[0], *yv = &a->out[0];
  const bool xb = xv->dtype == KILN_BF16, yb = yv->dtype == KILN_BF16;
  const int64_t xe = xb ? 2 : 4, ye = yb ? 2 : 4;
  float *x = malloc(sizeof(float) * (size_t)(n + 16));
  if (!x) {
    c->failed = true;
    return;
  }
  const float eps = (float)a->s[0];
  for (int64_t r = lo; r < hi; r++) {
    const char *xr = kiln__lnf_row(xv, r);
    char *yr = kiln__lnf_row(yv, r);
    __m512 s = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) { /* x in f32 (lanes past n: 0) */
      __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : kiln__mask16(n - j);
      __m512 v = kiln__load16(xr + j * xe, xb, k);
      _mm512_storeu_ps(x + j, v);
      s = _mm512_add_ps(s, v);
    }
    const float mean = c->rms ? 0.0f : kiln__hsum16(s) / (float)n;
    const __m512 mv = _mm512_set1_ps(mean);
    s = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : kiln__mask16(n - j);
      __m512 d = _mm512_maskz_sub_ps(k, _mm512_loadu_ps(x + j), mv);
      s = _mm512_fmadd_ps(d, d, s);
    }
    const float rstd = 1.0f / sqrtf(kiln__hsum16(s) / (float)n + eps);
    const __m512 rv = _mm512_set1_ps(rstd);
    for (int64_t j = 0; j < n; j += 16) {
      __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : kiln__mask16(n - j);
      __m512 y = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(x + j), mv), rv);
      if (c->w) y = _mm512_mul_ps(y, _mm512_maskz_loadu_ps(k, c->w + j));
      if (c->b) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(k, c->b + j));
      kiln__store16(yr + j * ye, y, yb, k);
    }
    int64_t idx[1] = {r};
    kiln__ln_save_stats(a, c->rms, idx, mean, rstd);
  }
  free(x);
}

/* Row blocks [lo, hi) of KILN__LNF_RB rows: dx, and where the weight gradients are wanted
** the block's f64 sums of g (x - mean) rstd and of g per column (the f64 path's terms, x
** and g read once for both: a second pass over them by columns was ~2% of a GPT step). */
KILN__T512 static void kiln__lnf_bwd_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__lnf *c = vctx;
  const kiln__kargs *a = c->a;
  const int64_t n = c->n;
  const kiln__view *xv = &a->in[0], *gv = &a->in[1], *dv = &a->out[0];
  const bool xb = xv->dtype == KILN_BF16, gb = gv->dtype == KILN_BF16, db = dv->dtype == KILN_BF16;
  const int64_t xe = xb ? 2 : 4, ge = gb ? 2 : 4, de = db ? 2 : 4;
  float *xh = malloc(sizeof(float) * (size_t)(2 * (n + 16)));
  if (!xh) {
    c->failed = true;
    return;
  }
  float *gw = xh + n + 16;
  for (int64_t blk = lo; blk < hi; blk++) {
    int64_t r0 = blk * KILN__LNF_RB, r1 = r0 + KILN__LNF_RB < c->rows ? r0 + KILN__LNF_RB : c->rows;
    double *sw = c->part ? c->part + blk * 2 * n : NULL, *sb = sw ? sw + n : NULL;
    for (int64_t r = r0; r < r1; r++) {
      int64_t idx[1] = {r};
      const float mean = c->rms ? 0.0f : (float)kiln__cpu_get_f64(kiln__at(&a->in[2], 1, idx), a->in[2].dtype);
      const float rstd = (float)kiln__cpu_get_f64(kiln__at(&a->in[3], 1, idx), a->in[3].dtype);
      const __m512 mv = _mm512_set1_ps(mean), rv = _mm512_set1_ps(rstd);
      const __m512d md = _mm512_set1_pd(mean), rd = _mm512_set1_pd(rstd);
      const char *xr = kiln__lnf_row(xv, r), *gr = kiln__lnf_row(gv, r);
      char *dr = kiln__lnf_row(dv, r);
      __m512 s1 = _mm512_setzero_ps(), s2 = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 16) { /* xhat, g w (0 past n) and their sums */
        __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : kiln__mask16(n - j);
        __m512 x = kiln__load16(xr + j * xe, xb, k), g = kiln__load16(gr + j * ge, gb, k);
        if (sw) { /* the weight sums, 8 columns at a time, in f64: g (x - mean) rstd and g */
          for (int hlf = 0; hlf < 2 && j + 8 * hlf < n; hlf++) {
            __m512d x8 = _mm512_cvtps_pd(hlf ? _mm512_extractf32x8_ps(x, 1) : _mm512_castps512_ps256(x));
            __m512d g8 = _mm512_cvtps_pd(hlf ? _mm512_extractf32x8_ps(g, 1) : _mm512_castps512_ps256(g));
            double *pw = sw + j + 8 * hlf, *pb = sb + j + 8 * hlf;
            __mmask8 k8 = (__mmask8)(hlf ? k >> 8 : k);
            __m512d t = _mm512_mul_pd(_mm512_mul_pd(g8, _mm512_sub_pd(x8, md)), rd);
            _mm512_mask_storeu_pd(pw, k8, _mm512_add_pd(_mm512_maskz_loadu_pd(k8, pw), t));
            _mm512_mask_storeu_pd(pb, k8, _mm512_add_pd(_mm512_maskz_loadu_pd(k8, pb), g8));
          }
        }
        __m512 h = _mm512_mul_ps(_mm512_sub_ps(x, mv), rv);
        if (c->w) g = _mm512_mul_ps(g, _mm512_maskz_loadu_ps(k, c->w + j));
        _mm512_storeu_ps(xh + j, h);
        _mm512_storeu_ps(gw + j, g);
        s1 = _mm512_add_ps(s1, g);
        s2 = _mm512_fmadd_ps(g, h, s2);
      }
      const float sg = c->rms ? 0.0f : kiln__hsum16(s1) / (float)n, sgx = kiln__hsum16(s2) / (float)n;
      const __m512 sgv = _mm512_set1_ps(sg), sxv = _mm512_set1_ps(sgx);
      for (int64_t j = 0; j < n; j += 16) {
        __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : kiln__mask16(n - j);
        __m512 t = _mm512_sub_ps(_mm512_sub_ps(_mm512_loadu_ps(gw + j), sgv), _mm512_mul_ps(_mm512_loadu_ps(xh + j), sxv));
        kiln__store16(dr + j * de, _mm512_mul_ps(rv, t), db, k);
      }
    }
  }
  free(xh);
}

static bool kiln__lnf_dt(kiln_dtype dt) { return dt == KILN_F32 || dt == KILN_BF16; }

/* The f32 path's case: f32/bf16 rows with unit inner stride, f32 statistics. */
static bool kiln__lnf_takes(const kiln__kargs *a, bool bw) {
  static int enabled = -1;
  if (enabled < 0) {
    enabled = kiln__knob_on("KILN_LAYER_NORM_F32", true);
  }
  if (!enabled || !kiln__avx512_ok()) return false;
  const kiln__view *rowv[3] = {&a->in[0], &a->out[0], bw ? &a->in[1] : NULL};
  for (int i = 0; i < 3; i++)
    if (rowv[i] && (!kiln__lnf_dt(rowv[i]->dtype) || rowv[i]->ndim != 2 || rowv[i]->strides[1] != 1)) return false;
  bool rms = a->i[1] == 1;
  const kiln__view *st[2] = {bw ? &a->in[rms ? 3 : 2] : &a->out[1], bw ? &a->in[3] : &a->out[rms ? 1 : 2]};
  for (int i = 0; i < 2; i++)
    if (st[i]->dtype != KILN_F32) return false;
  return true;
}

static kiln_status kiln__lnf_run(const kiln__kargs *a, bool bw, const char *name) {
  kiln__lnf c = {.a = a, .rows = a->in[0].shape[0], .n = a->in[0].shape[1], .rms = a->i[1] == 1};
  void *w, *b;
  if (!kiln__ln_affine(a, bw, c.n, KILN_F32, &w, &b)) goto oom;
  c.w = w, c.b = b;
  int64_t work = c.rows * (c.n + KILN__CPU_ROW_COST);
  if (c.rows > 0 && c.n > 0 && !bw) {
    kiln__cpu_parallel_for(c.rows, kiln__ln_min_par(c.rows, c.n), kiln__lnf_fwd_range, &c);
  } else if (c.rows > 0 && c.n > 0) {
    const int64_t nblk = (c.rows + KILN__LNF_RB - 1) / KILN__LNF_RB;
    if (a->n_out > 1 && !(c.part = calloc((size_t)(nblk * 2 * c.n), sizeof(double)))) goto oom;
    kiln__cpu_parallel_for(nblk, work < KILN__CPU_PAR_MIN ? INT64_MAX : 1, kiln__lnf_bwd_range, &c);
    if (c.part && !c.failed) /* the blocks' sums in block order: the same bits for any thread count */
      for (int64_t j = 0; j < c.n; j++) {
        double sw = 0, sb = 0;
        for (int64_t blk = 0; blk < nblk; blk++) sw += c.part[blk * 2 * c.n + j], sb += c.part[blk * 2 * c.n + c.n + j];
        int64_t jj[1] = {j};
        kiln__cpu_set_f64(kiln__at(&a->out[1], 1, jj), a->out[1].dtype, sw);
        if (a->n_out > 2) kiln__cpu_set_f64(kiln__at(&a->out[2], 1, jj), a->out[2].dtype, sb);
      }
  } else if (bw && a->n_out > 1) {
    kiln__ln_zero_wgrads(a);
  }
  if (c.failed) goto oom;
  free(w), free(b), free(c.part);
  return KILN_OK;
oom:
  free(w), free(b), free(c.part);
  return kiln__ln_oom(name, c.n);
}
#endif /* KILN__AVX512 */

kiln_status kiln__cpu_layer_norm(const kiln__kargs *a) {
  bool bw = a->op == KILN__K_LAYER_NORM_BACKWARD;
  const char *name = bw ? "kiln_layer_norm_backward" : "kiln_layer_norm";
  const kiln__view *x = &a->in[0];
  if (x->ndim != 2 || a->out[0].ndim != 2)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: the kernel wants x as (rows, n)", name);
  if (!kiln__cpu_is_float(x->dtype)) return kiln__cpu_dtype_error(a, x->dtype);
#ifdef KILN__AVX512
  if (kiln__lnf_takes(a, bw)) return kiln__lnf_run(a, bw, name);
#endif
  kiln__ln c = {.a = a, .rows = x->shape[0], .n = x->shape[1], .rms = a->i[1] == 1};
  void *w, *b;
  if (!kiln__ln_affine(a, bw, c.n, KILN_F64, &w, &b)) goto oom;
  c.w = w, c.b = b;
  if (c.rows > 0 && c.n > 0) {
    kiln__cpu_parallel_for(c.rows, kiln__ln_min_par(c.rows, c.n), bw ? kiln__ln_bwd_range : kiln__ln_fwd_range, &c);
    if (bw && a->n_out > 1) {
      int64_t ccost = c.rows + KILN__CPU_ROW_COST;
      kiln__cpu_parallel_for(c.n, c.n * ccost < KILN__CPU_PAR_MIN ? INT64_MAX : KILN__CPU_PAR_MIN / ccost + 1,
                             kiln__ln_wgrad_range, &c);
    }
  } else if (bw && a->n_out > 1) {
    kiln__ln_zero_wgrads(a);
  }
  if (c.failed) goto oom;
  free(w), free(b);
  return KILN_OK;
oom:
  free(w), free(b);
  return kiln__ln_oom(name, c.n);
}

/* ---- attention ---- */
typedef struct kiln__att {
  const kiln__kargs *a;
  int64_t B, H, Tq, Tk, D, Dv;
  double scale, keep, zscale; /* dropout: kept with probability keep, scaled by zscale */
  bool causal, masked, dropout, failed;
  double *K, *V; /* forward: every (b, h)'s keys and values, f64, contiguous */
} kiln__att;

/* The score of query i (q, f64) and key j of (b, h): scale q.k_j + mask; -inf when the
** causal rule or the mask removes it. */
static double kiln__att_score(const kiln__att *c, const double *q, const double *kj, int64_t b, int64_t h,
                              int64_t i, int64_t j) {
  if (c->causal && j > i) return -INFINITY;
  double s = 0;
  for (int64_t d = 0; d < c->D; d++) s += q[d] * kj[d];
  s *= c->scale;
  if (c->masked) {
    int64_t idx[4] = {b, h, i, j};
    const kiln__view *m = &c->a->in[c->a->op == KILN__K_ATTENTION ? 3 : 4];
    double mv = kiln__cpu_get_f64(kiln__at(m, 4, idx), m->dtype);
    s += m->dtype == KILN_BOOL ? (mv != 0 ? 0.0 : -INFINITY) : mv; /* bool: true attends */
  }
  return s;
}

/* kiln__att_score of four consecutive keys k0..k3 (rows of D) without a mask: four
** independent dot products side by side, so the adds of one do not wait on another's (one
** chain of D dependent adds per score was the forward's limit); each sums in the same
** order as kiln__att_score, so the results are the same bits. */
static void kiln__att_dot4(const double *q, const double *k0, int64_t D, double scale, double *out) {
  const double *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (int64_t d = 0; d < D; d++) {
    double x = q[d];
    s0 += x * k0[d];
    s1 += x * k1[d];
    s2 += x * k2[d];
    s3 += x * k3[d];
  }
  out[0] = s0 * scale, out[1] = s1 * scale, out[2] = s2 * scale, out[3] = s3 * scale;
}

/* Dropout's factor Z for score (b, h, i, j): 1/keep or 0. */
static double kiln__att_z(const kiln__att *c, int64_t b, int64_t h, int64_t i, int64_t j) {
  if (!c->dropout) return 1.0;
  uint64_t k = (uint64_t)(((b * c->H + h) * c->Tq + i) * c->Tk + j);
  float u = kiln__philox_uniform(c->a->seed, c->a->offset, k);
  return (double)u < c->keep ? c->zscale : 0.0;
}

static void kiln__att_fwd_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__att *c = vctx;
  const kiln__kargs *a = c->a;
  int64_t D = c->D, Dv = c->Dv;
  double *buf = malloc(sizeof(double) * (size_t)(D + Dv + KILN__ATT_BK));
  if (!buf) {
    c->failed = true;
    return;
  }
  double *q = buf, *acc = buf + D, *s = acc + Dv;
  for (int64_t r = lo; r < hi; r++) {
    int64_t i = r % c->Tq, bh = r / c->Tq, b = bh / c->H, h = bh % c->H;
    int64_t idx[4] = {b, h, i, 0};
    kiln__cpu_load(q, KILN_F64, kiln__at(&a->in[0], 4, idx), kiln__bst(&a->in[0], 3), a->in[0].dtype, D);
    const double *K = c->K + bh * c->Tk * D, *V = c->V + bh * c->Tk * Dv;
    double m = -INFINITY, l = 0;
    for (int64_t d = 0; d < Dv; d++) acc[d] = 0;
    int64_t jend = c->causal && i + 1 < c->Tk ? i + 1 : c->Tk;
    for (int64_t j0 = 0; j0 < jend; j0 += KILN__ATT_BK) {
      int64_t nb = jend - j0 < KILN__ATT_BK ? jend - j0 : KILN__ATT_BK;
      double mb = -INFINITY;
      int64_t t = 0;
      if (!c->masked) /* the causal cut is jend: every key here counts */
        for (; t + 4 <= nb; t += 4) kiln__att_dot4(q, K + (j0 + t) * D, D, c->scale, s + t);
      for (; t < nb; t++) s[t] = kiln__att_score(c, q, K + (j0 + t) * D, b, h, i, j0 + t);
      for (t = 0; t < nb; t++)
        if (s[t] > mb) mb = s[t];
      if (mb == -INFINITY) continue; /* every key of the block masked */
      if (mb > m) {                  /* rescale what was summed under the old max */
        double corr = exp(m - mb);   /* m == -inf: 0 */
        l *= corr;
        for (int64_t d = 0; d < Dv; d++) acc[d] *= corr;
        m = mb;
      }
      for (t = 0; t < nb; t++) {
        double p = exp(s[t] - m);
        l += p;
        p *= kiln__att_z(c, b, h, i, j0 + t);
        if (p == 0) continue;
        const double *vj = V + (j0 + t) * Dv;
        for (int64_t d = 0; d < Dv; d++) acc[d] += p * vj[d];
      }
    }
    double inv = l > 0 ? 1.0 / l : 0.0;
    for (int64_t d = 0; d < Dv; d++) acc[d] *= inv;
    kiln__cpu_store(kiln__at(&a->out[0], 4, idx), kiln__bst(&a->out[0], 3), a->out[0].dtype, acc, KILN_F64, Dv);
    kiln__cpu_set_f64(kiln__at(&a->out[1], 3, idx), a->out[1].dtype, l > 0 ? m + log(l) : -INFINITY);
  }
  free(buf);
}

/* One (b, h) per item: its dq rows, and dk, dv (summed over every query row). */
static void kiln__att_bwd_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__att *c = vctx;
  const kiln__kargs *a = c->a;
  int64_t D = c->D, Dv = c->Dv, Tq = c->Tq, Tk = c->Tk;
  size_t nq = (size_t)(Tq * D), nk = (size_t)(Tk * D), nv = (size_t)(Tk * Dv), ng = (size_t)(Tq * Dv);
  double *buf = malloc(sizeof(double) * (2 * nq + 2 * nk + 2 * nv + ng + 2 * (size_t)Tk + 1));
  if (!buf) {
    c->failed = true;
    return;
  }
  double *Q = buf, *dQ = Q + nq, *K = dQ + nq, *dK = K + nk, *V = dK + nk, *dV = V + nv, *G = dV + nv;
  double *S = G + ng, *DP = S + Tk; /* row i's scores and g.v_j, computed once (no mask) */
  for (int64_t bh = lo; bh < hi; bh++) {
    int64_t b = bh / c->H, h = bh % c->H;
    for (int64_t i = 0; i < Tq; i++) {
      int64_t idx[4] = {b, h, i, 0};
      kiln__cpu_load(Q + i * D, KILN_F64, kiln__at(&a->in[0], 4, idx), kiln__bst(&a->in[0], 3), a->in[0].dtype, D);
      kiln__cpu_load(G + i * Dv, KILN_F64, kiln__at(&a->in[3], 4, idx), kiln__bst(&a->in[3], 3), a->in[3].dtype, Dv);
    }
    for (int64_t j = 0; j < Tk; j++) {
      int64_t idx[4] = {b, h, j, 0};
      kiln__cpu_load(K + j * D, KILN_F64, kiln__at(&a->in[1], 4, idx), kiln__bst(&a->in[1], 3), a->in[1].dtype, D);
      kiln__cpu_load(V + j * Dv, KILN_F64, kiln__at(&a->in[2], 4, idx), kiln__bst(&a->in[2], 3), a->in[2].dtype, Dv);
    }
    memset(dQ, 0, sizeof(double) * nq);
    memset(dK, 0, sizeof(double) * nk);
    memset(dV, 0, sizeof(double) * nv);
    for (int64_t i = 0; i < Tq; i++) {
      int64_t li[3] = {b, h, i};
      double lse = kiln__cpu_get_f64(kiln__at(&a->out[3], 3, li), a->out[3].dtype);
      if (lse == -INFINITY) continue; /* every key masked: no gradient */
      const double *q = Q + i * D, *g = G + i * Dv;
      int64_t jend = c->causal && i + 1 < Tk ? i + 1 : Tk;
      double delta = 0;
      bool pre = !c->masked; /* the same sums, four keys at a time, kept for both passes */
      if (pre) {
        int64_t j = 0;
        for (; j + 4 <= jend; j += 4) {
          kiln__att_dot4(q, K + j * D, D, c->scale, S + j);
          kiln__att_dot4(g, V + j * Dv, Dv, 1.0, DP + j);
        }
        for (; j < jend; j++) {
          S[j] = kiln__att_score(c, q, K + j * D, b, h, i, j);
          double dp = 0;
          for (int64_t d = 0; d < Dv; d++) dp += g[d] * V[j * Dv + d];
          DP[j] = dp;
        }
      }
      for (int64_t j = 0; j < jend; j++) {
        double s = pre ? S[j] : kiln__att_score(c, q, K + j * D, b, h, i, j);
        if (s == -INFINITY) continue;
        double pz = exp(s - lse) * kiln__att_z(c, b, h, i, j);
        if (pz == 0) continue;
        double dp = 0;
        if (pre) dp = DP[j];
        else
          for (int64_t d = 0; d < Dv; d++) dp += g[d] * V[j * Dv + d];
        delta += pz * dp;
      }
      for (int64_t j = 0; j < jend; j++) {
        double s = pre ? S[j] : kiln__att_score(c, q, K + j * D, b, h, i, j);
        if (s == -INFINITY) continue;
        double p = exp(s - lse), z = kiln__att_z(c, b, h, i, j);
        double dp = 0;
        if (pre) dp = DP[j];
        else
          for (int64_t d = 0; d < Dv; d++) dp += g[d] * V[j * Dv + d];
        if (p * z != 0)
          for (int64_t d = 0; d < Dv; d++) dV[j * Dv + d] += p * z * g[d];
        double ds = p * (z * dp - delta) * c->scale;
        if (ds == 0) continue;
        for (int64_t d = 0; d < D; d++) {
          dQ[i * D + d] += ds * K[j * D + d];
          dK[j * D + d] += ds * q[d];
        }
      }
    }
    for (int64_t i = 0; i < Tq; i++) {
      int64_t idx[4] = {b, h, i, 0};
      kiln__cpu_store(kiln__at(&a->out[0], 4, idx), kiln__bst(&a->out[0], 3), a->out[0].dtype, dQ + i * D, KILN_F64, D);
    }
    for (int64_t j = 0; j < Tk; j++) {
      int64_t idx[4] = {b, h, j, 0};
      kiln__cpu_store(kiln__at(&a->out[1], 4, idx), kiln__bst(&a->out[1], 3), a->out[1].dtype, dK + j * D, KILN_F64, D);
      kiln__cpu_store(kiln__at(&a->out[2], 4, idx), kiln__bst(&a->out[2], 3), a->out[2].dtype, dV + j * Dv, KILN_F64, Dv);
    }
  }
  free(buf);
}

static void kiln__att_load_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__att *c = vctx;
  const kiln__kargs *a = c->a;
  for (int64_t r = lo; r < hi; r++) { /* r = bh * Tk + j */
    int64_t j = r % c->Tk, bh = r / c->Tk;
    int64_t idx[4] = {bh / c->H, bh % c->H, j, 0};
    kiln__cpu_load(c->K + r * c->D, KILN_F64, kiln__at(&a->in[1], 4, idx), kiln__bst(&a->in[1], 3), a->in[1].dtype, c->D);
    kiln__cpu_load(c->V + r * c->Dv, KILN_F64, kiln__at(&a->in[2], 4, idx), kiln__bst(&a->in[2], 3), a->in[2].dtype, c->Dv);
  }
}

/* ---- attention, the f32 path ----
** For f32, f16 and bf16 inputs without a mask or dropout (a language model's causal
** self-attention), the f64 loops above are replaced by GEMM-shaped f32 work, as PyTorch's
** CPU flash kernel computes it (f32 products and accumulation, f32 softmax statistics):
** per (b, h) and block of BQ query rows, S = scale Q_blk K^T on sgemm, only over the keys a
** causal block can see (keys past the block's last query are never computed), the row
** softmax in f32, O = P V on sgemm; the backward recomputes P from the saved lse and runs
** dP = dO V^T, dS = P (dP - delta) scale, dQ = dS K, dK += dS^T Q, dV += P^T dO, five
** products per block. Memory: a BQ x Tk strip of scores per thread (plus one head's K, V in f32),
** never Tq x Tk. The f64 loops stay the kernel for f64 inputs, masks and dropout, and the
** reference every f32 result is tested against. */
#define KILN__ATT_BQ 64

/* The max and the sums below run in 16 independent lanes, combined at the end: a single
** accumulator is a dependent chain the compiler may not reorder (no -ffast-math), and
** the loops stayed scalar (perf: 40% of the forward in the max and sum). */
#define KILN__ATT_LANES 16

/* Row i's softmax numerators in place: p_j = exp(s_j - m) for j < n, 0 for j in [n, w);
** returns the sum of p, *m the row max. */
KILN__CPU_CLONES512 static float kiln__att_row_softmax(float *s, int64_t n, int64_t w, float *mout) {
  float mv[KILN__ATT_LANES], lv[KILN__ATT_LANES];
  for (int k = 0; k < KILN__ATT_LANES; k++) mv[k] = -INFINITY, lv[k] = 0;
  int64_t j = 0;
  for (; j + KILN__ATT_LANES <= n; j += KILN__ATT_LANES)
    for (int k = 0; k < KILN__ATT_LANES; k++) mv[k] = s[j + k] > mv[k] ? s[j + k] : mv[k];
  float m = -INFINITY;
  for (; j < n; j++) m = s[j] > m ? s[j] : m;
  for (int k = 0; k < KILN__ATT_LANES; k++) m = mv[k] > m ? mv[k] : m;
  for (j = 0; j + KILN__ATT_LANES <= n; j += KILN__ATT_LANES)
    for (int k = 0; k < KILN__ATT_LANES; k++) {
      float p = kiln__expf(s[j + k] - m);
      s[j + k] = p;
      lv[k] += p;
    }
  float l = 0;
  for (; j < n; j++) {
    float p = kiln__expf(s[j] - m);
    s[j] = p;
    l += p;
  }
  for (int k = 0; k < KILN__ATT_LANES; k++) l += lv[k];
  for (j = n; j < w; j++) s[j] = 0;
  *mout = m;
  return l;
}

/* The backward's row: s_j <- p_j = exp(s_j - lse) (j < n; 0 to w), then with dp_j:
** delta = sum_j p_j dp_j and dp_j <- p_j (dp_j - delta) scale (dS). */
KILN__CPU_CLONES512 static void kiln__att_row_grad(float *s, float *dp, int64_t n, int64_t w, float lse, float scale) {
  float dv[KILN__ATT_LANES];
  for (int k = 0; k < KILN__ATT_LANES; k++) dv[k] = 0;
  int64_t j = 0;
  for (; j + KILN__ATT_LANES <= n; j += KILN__ATT_LANES)
    for (int k = 0; k < KILN__ATT_LANES; k++) {
      float p = kiln__expf(s[j + k] - lse);
      s[j + k] = p;
      dv[k] += p * dp[j + k];
    }
  float delta = 0;
  for (; j < n; j++) {
    float p = kiln__expf(s[j] - lse);
    s[j] = p;
    delta += p * dp[j];
  }
  for (int k = 0; k < KILN__ATT_LANES; k++) delta += dv[k];
  for (j = 0; j < n; j++) dp[j] = s[j] * (dp[j] - delta) * scale;
  for (j = n; j < w; j++) s[j] = 0, dp[j] = 0;
}

typedef struct kiln__attf {
  const kiln__kargs *a;
  int64_t B, H, Tq, Tk, D, Dv, nqb;
  float scale;
  bool causal, failed;
} kiln__attf;

/* The BLAS on one thread for this thread's share: an OpenMP build of OpenBLAS sizes its
** team by the calling thread's OpenMP thread count, which is the default (every core) on
** kiln's pool workers: each share then started a team of its own (measured: the GPT's
** attention 2x slower). Returns the count to restore. */
static int kiln__attf_blas_one(void) {
#ifdef KILN_HAVE_OPENMP
  int was = omp_get_max_threads();
  if (was != 1) omp_set_num_threads(1);
  return was;
#else
  return 1;
#endif
}
static void kiln__attf_blas_restore(int was) {
#ifdef KILN_HAVE_OPENMP
  if (was != 1) omp_set_num_threads(was);
#else
  (void)was;
#endif
}

/* Rows [r0, r0 + n) of (b, h) of a 4-d view into a contiguous f32 (n, cols) buffer. */
static void kiln__attf_load(float *dst, const kiln__view *v, int64_t b, int64_t h, int64_t r0, int64_t n,
                            int64_t cols) {
  for (int64_t r = 0; r < n; r++) {
    int64_t idx[4] = {b, h, r0 + r, 0};
    kiln__cpu_load(dst + r * cols, KILN_F32, kiln__at(v, 4, idx), kiln__bst(v, 3), v->dtype, cols);
  }
}
static void kiln__attf_store(const kiln__view *v, int64_t b, int64_t h, int64_t r0, int64_t n, int64_t cols,
                             const float *src) {
  for (int64_t r = 0; r < n; r++) {
    int64_t idx[4] = {b, h, r0 + r, 0};
    kiln__cpu_store(kiln__at(v, 4, idx), kiln__bst(v, 3), v->dtype, src + r * cols, KILN_F32, cols);
  }
}

/* keys query rows [i0, i1) can see */
static int64_t kiln__attf_jend(const kiln__attf *c, int64_t i1) { return c->causal && i1 < c->Tk ? i1 : c->Tk; }
static int64_t kiln__attf_nvalid(const kiln__attf *c, int64_t i, int64_t jend) {
  return c->causal && i + 1 < jend ? i + 1 : jend;
}

/* One item: (b, h) and a block of BQ query rows. */
static void kiln__attf_fwd_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__attf *c = vctx;
  const kiln__kargs *a = c->a;
  int64_t D = c->D, Dv = c->Dv, BQ = KILN__ATT_BQ;
  float *buf = malloc(sizeof(float) * (size_t)(BQ * (D + Dv + c->Tk + 1) + c->Tk * (D + Dv) + 1));
  if (!buf) {
    c->failed = true;
    return;
  }
  float *Q = buf, *O = Q + BQ * D, *S = O + BQ * Dv, *inv = S + BQ * c->Tk, *K = inv + BQ, *V = K + c->Tk * D;
  int blas_was = kiln__attf_blas_one();
  for (int64_t it = lo; it < hi; it++) {
    int64_t bh = it / c->nqb, i0 = (it % c->nqb) * BQ, b = bh / c->H, h = bh % c->H;
    int64_t bq = c->Tq - i0 < BQ ? c->Tq - i0 : BQ, jend = kiln__attf_jend(c, i0 + bq);
    if (jend > 0) { /* the keys and values this block sees (a causal block: half on average) */
      kiln__attf_load(K, &a->in[1], b, h, 0, jend, D);
      kiln__attf_load(V, &a->in[2], b, h, 0, jend, Dv);
      kiln__attf_load(Q, &a->in[0], b, h, i0, bq, D);
      if (kiln__cpu_sgemm(0, 1, bq, jend, D, c->scale, Q, D, K, D, 0.0f, S, jend)) c->failed = true;
    }
    for (int64_t r = 0; r < bq; r++) {
      int64_t i = i0 + r, n = kiln__attf_nvalid(c, i, jend);
      float m = -INFINITY, l = n > 0 ? kiln__att_row_softmax(S + r * jend, n, jend, &m) : 0.0f;
      inv[r] = l > 0 ? 1.0f / l : 0.0f;
      int64_t li[3] = {b, h, i};
      kiln__cpu_set_f64(kiln__at(&a->out[1], 3, li), a->out[1].dtype, l > 0 ? (double)m + log((double)l) : -INFINITY);
    }
    if (jend > 0) {
      if (kiln__cpu_sgemm(0, 0, bq, Dv, jend, 1.0f, S, jend, V, Dv, 0.0f, O, Dv)) c->failed = true;
    } else {
      memset(O, 0, sizeof(float) * (size_t)(bq * Dv));
    }
    for (int64_t r = 0; r < bq; r++)
      for (int64_t d = 0; d < Dv; d++) O[r * Dv + d] *= inv[r];
    kiln__attf_store(&a->out[0], b, h, i0, bq, Dv, O);
  }
  kiln__attf_blas_restore(blas_was);
  free(buf);
}

/* One (b, h) per item: its dq rows block by block, dk and dv summed over the blocks. */
static void kiln__attf_bwd_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__attf *c = vctx;
  const kiln__kargs *a = c->a;
  int64_t D = c->D, Dv = c->Dv, Tq = c->Tq, Tk = c->Tk, BQ = KILN__ATT_BQ;
  size_t n = (size_t)(Tq * D + Tq * Dv + 2 * Tk * D + 2 * Tk * Dv + BQ * D + 2 * BQ * Tk + Tq + 1);
  float *buf = malloc(sizeof(float) * n);
  if (!buf) {
    c->failed = true;
    return;
  }
  float *Q = buf, *G = Q + Tq * D, *K = G + Tq * Dv, *V = K + Tk * D, *dK = V + Tk * Dv, *dV = dK + Tk * D;
  float *dQ = dV + Tk * Dv, *S = dQ + BQ * D, *dP = S + BQ * Tk, *lse = dP + BQ * Tk;
  int blas_was = kiln__attf_blas_one();
  for (int64_t bh = lo; bh < hi; bh++) {
    int64_t b = bh / c->H, h = bh % c->H;
    kiln__attf_load(Q, &a->in[0], b, h, 0, Tq, D);
    kiln__attf_load(K, &a->in[1], b, h, 0, Tk, D);
    kiln__attf_load(V, &a->in[2], b, h, 0, Tk, Dv);
    kiln__attf_load(G, &a->in[3], b, h, 0, Tq, Dv);
    for (int64_t i = 0; i < Tq; i++) {
      int64_t li[3] = {b, h, i};
      lse[i] = (float)kiln__cpu_get_f64(kiln__at(&a->out[3], 3, li), a->out[3].dtype);
    }
    memset(dK, 0, sizeof(float) * (size_t)(Tk * D));
    memset(dV, 0, sizeof(float) * (size_t)(Tk * Dv));
    for (int64_t i0 = 0; i0 < Tq; i0 += BQ) {
      int64_t bq = Tq - i0 < BQ ? Tq - i0 : BQ, jend = kiln__attf_jend(c, i0 + bq);
      const float *Qb = Q + i0 * D, *Gb = G + i0 * Dv;
      if (jend == 0) {
        memset(dQ, 0, sizeof(float) * (size_t)(bq * D));
      } else {
        int rc = kiln__cpu_sgemm(0, 1, bq, jend, D, c->scale, Qb, D, K, D, 0.0f, S, jend);
        rc |= kiln__cpu_sgemm(0, 1, bq, jend, Dv, 1.0f, Gb, Dv, V, Dv, 0.0f, dP, jend);
        for (int64_t r = 0; r < bq; r++) {
          int64_t i = i0 + r;
          /* lse -inf (no key): p = 0 for every key, no gradient */
          int64_t nv = lse[i] == -INFINITY ? 0 : kiln__attf_nvalid(c, i, jend);
          kiln__att_row_grad(S + r * jend, dP + r * jend, nv, jend, lse[i], c->scale);
        }
        rc |= kiln__cpu_sgemm(0, 0, bq, D, jend, 1.0f, dP, jend, K, D, 0.0f, dQ, D);
        rc |= kiln__cpu_sgemm(1, 0, jend, D, bq, 1.0f, dP, jend, Qb, D, 1.0f, dK, D);
        rc |= kiln__cpu_sgemm(1, 0, jend, Dv, bq, 1.0f, S, jend, Gb, Dv, 1.0f, dV, Dv);
        if (rc) c->failed = true;
      }
      kiln__attf_store(&a->out[0], b, h, i0, bq, D, dQ);
    }
    kiln__attf_store(&a->out[1], b, h, 0, Tk, D, dK);
    kiln__attf_store(&a->out[2], b, h, 0, Tk, Dv, dV);
  }
  kiln__attf_blas_restore(blas_was);
  free(buf);
}

/* The f32 path's case: no f64 tensor, no mask, no dropout. */
static bool kiln__attf_takes(const kiln__kargs *a) {
  if ((a->i[0] & 2) || a->s[1] > 0) return false;
  int nin = a->op == KILN__K_ATTENTION_BACKWARD ? 4 : 3;
  for (int i = 0; i < nin; i++)
    if (a->in[i].dtype == KILN_F64) return false;
  for (int i = 0; i < a->n_out; i++)
    if (a->out[i].dtype == KILN_F64) return false;
  return true;
}

static kiln_status kiln__attf_run(const kiln__kargs *a) {
  bool bw = a->op == KILN__K_ATTENTION_BACKWARD;
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2];
  kiln__attf c = {.a = a, .B = q->shape[0], .H = q->shape[1], .Tq = q->shape[2], .Tk = k->shape[2],
                  .D = q->shape[3], .Dv = v->shape[3], .scale = (float)a->s[0], .causal = (a->i[0] & 1) != 0};
  int64_t BH = c.B * c.H;
  c.nqb = (c.Tq + KILN__ATT_BQ - 1) / KILN__ATT_BQ;
  int64_t work = BH * c.Tq * (c.Tk + 1) * (c.D + c.Dv + 1);
  int64_t par = work < KILN__CPU_PAR_MIN ? INT64_MAX : 1;
  kiln__cpu_blas_serial();
  if (bw) {
    if (BH > 0) kiln__cpu_parallel_for(BH, par, kiln__attf_bwd_range, &c);
  } else if (BH * c.Tq > 0) {
    kiln__cpu_parallel_for(BH * c.nqb, par, kiln__attf_fwd_range, &c);
  }
  if (c.failed)
    return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory (B*H %lld, Tq %lld, Tk %lld, D %lld)",
                          bw ? "kiln_scaled_dot_product_attention (backward)" : "kiln_scaled_dot_product_attention",
                          (long long)BH, (long long)c.Tq, (long long)c.Tk, (long long)c.D);
  return KILN_OK;
}

/* ---- bf16 attention on oneDNN (AMX) ----
** Under bf16 autocast q, k, v arrive in bf16. PyTorch 1.13's CPU attention is then bf16
** products (aten::bmm on oneDNN: bf16 operands, f32 accumulation) around a softmax; the f32
** path above widens every operand and runs sgemm on 64-row blocks (a GPT layer's
** attention, B8 H4 T256 D64 on 2 cores: ~3 ms forward, ~5 ms backward, ~25% of a step).
** Here the products are oneDNN's bf16 matmuls over every (b, h) at once, on the tile unit:
**   forward   S = scale Q K^T (f32 out), per row m, l = sum exp(s - m), lse = m + log l,
**             P = bf16(exp(s - m) / l) (keys past the causal limit 0), O = P V (f32 acc,
**             bf16 out);
**   backward  S and dP = dO V^T (f32 out), P = bf16(exp(s - lse)) (the forward's P, up to
**             a bf16 ulp here and there), delta = sum_j P_j dP_j (f32),
**             dS = bf16(P (dP - delta) scale), dV = P^T dO, dQ = dS K, dK = dS^T Q.
** Statistics (m, l, lse, delta) in f32; the operands rounded to bf16 only where PyTorch's
** are (P and dS are bf16 tensors there too); S and dP stay f32 (PyTorch rounds them to
** bf16 as well: this is closer to the f64 result). Full Tq x Tk scores per (b, h), a
** chunk of (b, h) pairs at a time (KILN__ATTB_CHUNK_BYTES): for the causal case half of
** QK^T and PV is wasted, which AMX pays less for than blocking costs; a pair whose scores
** pass the chunk goes in blocks of query rows (below).
** Taken for bf16 q, k, v (and dO) with bf16 outputs, no mask, no dropout, when oneDNN runs
** the products (a refused layout falls back to kiln__cpu_matmul's own path, same numbers).
** KILN_ATTENTION_BF16=0 turns it off (the f32 path: A/B). The row passes between the
** products are cpu_attention_rows.c's (kiln__attb_row_forward/backward). */
#ifdef KILN_HAVE_DNNL
typedef struct kiln__attb {
  const kiln__kargs *a;
  int64_t H, Tq, Tk;
  float scale;
  bool causal, bw;
  int64_t bh0; /* the chunk's first (b, h): S, dP, P, dS hold the chunk's rows */
  int64_t r0, R, kv; /* of each pair, query rows r0 .. r0 + R and keys 0 .. kv (a row's width) */
  float *S, *dP;
  uint16_t *P, *dS;
} kiln__attb;

static void kiln__attb_rows(void *vctx, int64_t lo, int64_t hi) {
  kiln__attb *c = vctx;
  const kiln__view *lv = c->bw ? &c->a->out[3] : &c->a->out[1];
  const int64_t w = c->kv;
  for (int64_t r = lo; r < hi; r++) {
    int64_t bh = c->bh0 + r / c->R, i = c->r0 + r % c->R;
    int64_t n = c->causal ? (i + 1 < c->Tk ? i + 1 : c->Tk) : c->Tk; /* <= kv */
    int64_t li[3] = {bh / c->H, bh % c->H, i};
    float *s = c->S + r * w;
    uint16_t *p = c->P + r * w;
    if (c->bw) {
      float lse = (float)kiln__cpu_get_f64(kiln__at(lv, 3, li), lv->dtype);
      kiln__attb_row_backward(s, c->dP + r * w, p, c->dS + r * w, n, w, lse, c->scale);
    } else {
      kiln__cpu_set_f64(kiln__at(lv, 3, li), lv->dtype, (double)kiln__attb_row_forward(s, p, n, w));
    }
  }
}

/* C = s0 A @ B on 3-d (B*H, rows, cols) views of dense buffers (or one transposed in its
** last two dims). oneDNN 2.6 runs its AMX brgemm kernels only on such dense layouts: the
** (B, H, T, D) views of a GPT's qkv (row stride 3C) got its "gemm:jit" kernels, ~8x slower
** (5 ms for QK^T), hence the packing below. A layout oneDNN has no kernel for at all goes
** to the CPU's own MATMUL (f32 temporaries; the same f32-accumulated result). */
static kiln_status kiln__attb_mm(kiln__view A, kiln__view B, kiln__view C, double s0, double beta) {
  kiln__kargs m = {0};
  m.op = KILN__K_MATMUL;
  m.n_in = 2;
  m.n_out = 1;
  m.in[0] = A;
  m.in[1] = B;
  m.out[0] = C;
  m.s[0] = s0;
  m.s[1] = beta; /* C = s0 A B + beta C */
  return kiln__cpu_matmul(&m);
}

/* A 3-d (n, r, c) view of rows of cc elements, bs apart from one of the n to the next
** (r * cc: a dense buffer; more: the first r rows of each), transposed in its last two dims
** when t. */
static kiln__view kiln__attb_rview(void *data, kiln_dtype dt, int64_t n, int64_t bs, int64_t r, int64_t cc, bool t) {
  kiln__view v = {0};
  v.data = data;
  v.dtype = dt;
  v.ndim = 3;
  v.shape[0] = n;
  v.strides[0] = bs;
  if (!t) {
    v.shape[1] = r, v.shape[2] = cc, v.strides[1] = cc, v.strides[2] = 1;
  } else {
    v.shape[1] = cc, v.shape[2] = r, v.strides[1] = 1, v.strides[2] = cc;
  }
  return v;
}

static kiln__view kiln__attb_view(void *data, kiln_dtype dt, int64_t n, int64_t r, int64_t cc, bool t) {
  return kiln__attb_rview(data, dt, n, r * cc, r, cc, t);
}

/* Rows of (B, H, T, D) bf16 views to or from dense (B*H*T, D) buffers. */
typedef struct kiln__attb_pack {
  const kiln__view *v[4];
  uint16_t *d[4];
  int n;
  bool out; /* dense -> view */
  int64_t H, T;
} kiln__attb_pack;

/* Rows in (b, t, h) order, every tensor of the call for each: for heads split from one
** (B, T, 3C) qkv that walks its memory forward (q, k and v of a row are neighbours), where
** one tensor at a time in (b, h, t) order jumped 3C elements a row (measured: the packing
** was half of the attention's copies). */
static void kiln__attb_pack_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__attb_pack *c = vctx;
  for (int64_t r = lo; r < hi; r++) {
    int64_t b = r / (c->T * c->H), t = (r / c->H) % c->T, h = r % c->H;
    int64_t idx[4] = {b, h, t, 0}, row = (b * c->H + h) * c->T + t;
    for (int i = 0; i < c->n; i++) {
      const kiln__view *v = c->v[i];
      int64_t D = v->shape[3], s3 = v->strides[3];
      uint16_t *p = (uint16_t *)kiln__at(v, 4, idx), *d = c->d[i] + row * D;
      if (s3 == 1) {
        if (c->out)
          memcpy(p, d, (size_t)D * 2);
        else
          memcpy(d, p, (size_t)D * 2);
      } else {
        for (int64_t j = 0; j < D; j++)
          if (c->out)
            p[j * s3] = d[j];
          else
            d[j] = p[j * s3];
      }
    }
  }
}

static void kiln__attb_pack_go(kiln__attb_pack *c, int64_t rows, int64_t D) {
  int64_t work = rows * D * c->n;
  kiln__cpu_parallel_for(rows, work < KILN__CPU_PAR_MIN_CHEAP ? INT64_MAX : 1, kiln__attb_pack_range, c);
}

static bool kiln__attb_takes(const kiln__kargs *a) {
  static int enabled = -1;
  if (enabled < 0) {
    enabled = kiln__knob_on("KILN_ATTENTION_BF16", true);
  }
  if (!enabled || (a->i[0] & 2) || a->s[1] > 0) return false;
  int nin = a->op == KILN__K_ATTENTION_BACKWARD ? 4 : 3, nout = a->op == KILN__K_ATTENTION_BACKWARD ? 3 : 1;
  for (int i = 0; i < nin; i++)
    if (a->in[i].dtype != KILN_BF16 || a->in[i].ndim != 4) return false;
  if (a->in[1].shape[2] == 0) return false; /* no keys: zeros, the f32 path's case */
  for (int i = 0; i < nout; i++)
    if (a->out[i].dtype != KILN_BF16) return false;
  return true;
}

/* (b, h) pairs per chunk: the chunk's f32 scores (S, and dP in the backward) about this
** many bytes, so that they stay in the cores' L2 between the product that writes them, the
** row pass and the products that read P and dS. The whole (B*H, Tq, Tk) at once (8 MiB of
** f32 S for the small GPT) went to memory and back: QK^T ran at ~0.4 TFLOP/s, bound by
** its f32 output. KILN_ATTB_CHUNK_BYTES overrides it (A/B).
** Where one pair's scores are more than that (long sequences), a chunk is one pair's
** query rows in blocks (a multiple of 16 rows, 16 at least), so no Tq x Tk matrix is made:
** each block's rows are whole (keys 0 .. Tk, or under the causal mask 0 .. its last row's
** key), its softmax exact, and dK, dV summed over the blocks in f32 and rounded once.
** KILN_ATTB_ROWS sets the rows a block (A/B; 0: the rule above). */
#define KILN__ATTB_CHUNK_BYTES ((int64_t)1 << 20)

/* n f32 values to bf16 (COPY's rounding) */
static kiln_status kiln__attb_sums_out(const float *src, uint16_t *dst, int64_t n) {
  kiln__kargs cp = {0};
  cp.op = KILN__K_COPY;
  cp.n_in = cp.n_out = 1;
  cp.in[0].data = (void *)src, cp.in[0].dtype = KILN_F32;
  cp.out[0].data = dst, cp.out[0].dtype = KILN_BF16;
  cp.in[0].ndim = cp.out[0].ndim = 1;
  cp.in[0].shape[0] = cp.out[0].shape[0] = n;
  cp.in[0].strides[0] = cp.out[0].strides[0] = 1;
  return kiln__cpu_copy(&cp);
}

static kiln_status kiln__attb_run(const kiln__kargs *a) {
  bool bw = a->op == KILN__K_ATTENTION_BACKWARD;
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2];
  const int64_t B = q->shape[0], H = q->shape[1], Tq = q->shape[2], Tk = k->shape[2], D = q->shape[3],
                Dv = v->shape[3];
  const int64_t BH = B * H;
  const char *name = bw ? "kiln_scaled_dot_product_attention (backward)" : "kiln_scaled_dot_product_attention";
  if (BH * Tq == 0) return KILN_OK;
  static int64_t chunk_bytes = -1, rows_env = -1;
  if (chunk_bytes < 0) {
    chunk_bytes = kiln__knob_int("KILN_ATTB_CHUNK_BYTES", KILN__ATTB_CHUNK_BYTES);
    rows_env = kiln__knob_int("KILN_ATTB_ROWS", 0);
  }
  const int64_t row_bytes = Tk * 4 * (bw ? 2 : 1); /* one query row's f32 scores */
  int64_t R = Tq; /* query rows a block */
  if (rows_env > 0)
    R = rows_env;
  else if (Tq * row_bytes > chunk_bytes)
    R = chunk_bytes / row_bytes / 16 * 16;
  if (R < 16) R = 16;
  if (R > Tq) R = Tq;
  const bool blocks = R < Tq;
  int64_t nbh = blocks ? 1 : chunk_bytes / (Tq * row_bytes); /* blocks: one pair (dense views for oneDNN) */
  if (nbh < 1) nbh = 1;
  if (nbh > BH) nbh = BH;
  const int64_t ns = nbh * R * Tk; /* scores a chunk, at most */
  /* a chunk's S f32, P bf16 (the backward: dP f32, dS bf16 too), then q, k, v dense, and
  ** O (forward) or dO and the three dense gradients (backward), and in blocks the f32 dK
  ** and dV sums of the chunk's pairs */
  const int64_t nq = BH * Tq * D, nk = BH * Tk * D, nv = BH * Tk * Dv, ng = BH * Tq * Dv;
  const int64_t nacc = blocks && bw ? (nbh * Tk * (D + Dv) + 15) / 16 * 16 : 0;
  size_t nb = (size_t)ns * (bw ? 12 : 6) + 2 * (size_t)(nq + nk + nv) +
              (bw ? 2 * (size_t)(ng + nq + nk + nv) : 2 * (size_t)ng) + 4 * (size_t)nacc;
  char *buf = kiln__cpu_alloc(0, nb);
  if (!buf) return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory for %lld scores", name, (long long)ns);
  kiln__attb c = {.a = a, .H = H, .Tq = Tq, .Tk = Tk, .scale = (float)a->s[0], .causal = (a->i[0] & 1) != 0, .bw = bw};
  float *acc = (float *)buf; /* the sums first: whole 64-byte lines, so S keeps the buffer's alignment */
  float *S = acc + nacc, *dP = bw ? S + ns : NULL;
  uint16_t *P = (uint16_t *)(S + ns * (bw ? 2 : 1)), *dS = bw ? P + ns : NULL;
  uint16_t *Qd = (bw ? dS : P) + ns, *Kd = Qd + nq, *Vd = Kd + nk, *Gd = Vd + nv; /* Gd: O (fwd) or dO (bwd) */
  uint16_t *dQd = bw ? Gd + ng : NULL, *dKd = bw ? dQd + nq : NULL, *dVd = bw ? dKd + nk : NULL;
  c.S = S, c.dP = dP, c.P = P, c.dS = dS;
  kiln__attb_pack pk;
  if (Tq == Tk) { /* q, k, v (and dO) in one pass */
    pk = (kiln__attb_pack){.v = {q, k, v, &a->in[3]}, .d = {Qd, Kd, Vd, Gd}, .n = bw ? 4 : 3, .H = H, .T = Tq};
    kiln__attb_pack_go(&pk, BH * Tq, D);
  } else {
    pk = (kiln__attb_pack){.v = {q, &a->in[3]}, .d = {Qd, Gd}, .n = bw ? 2 : 1, .H = H, .T = Tq};
    kiln__attb_pack_go(&pk, BH * Tq, D);
    pk = (kiln__attb_pack){.v = {k, v}, .d = {Kd, Vd}, .n = 2, .H = H, .T = Tk};
    kiln__attb_pack_go(&pk, BH * Tk, D);
  }
  const kiln_dtype BF = KILN_BF16;
  kiln_status st = KILN_OK;
  for (int64_t c0 = 0; c0 < BH && st == KILN_OK; c0 += nbh) {
    const int64_t n = BH - c0 < nbh ? BH - c0 : nbh; /* (b, h) pairs in this chunk */
    uint16_t *Qc = Qd + c0 * Tq * D, *Kc = Kd + c0 * Tk * D, *Vc = Vd + c0 * Tk * Dv, *Gc = Gd + c0 * Tq * Dv;
    float *dK32 = acc, *dV32 = acc + n * Tk * D; /* blocks: the chunk's dK, dV sums */
    if (nacc) memset(acc, 0, sizeof(float) * (size_t)(n * Tk * (D + Dv)));
    for (int64_t r0 = 0; r0 < Tq && st == KILN_OK; r0 += R) {
      const int64_t rr = Tq - r0 < R ? Tq - r0 : R;                     /* rows of each pair */
      const int64_t kv = blocks && c.causal && r0 + rr < Tk ? r0 + rr : Tk; /* keys they see */
      kiln__view Qv = kiln__attb_rview(Qc + r0 * D, BF, n, Tq * D, rr, D, false);
      kiln__view Gv = kiln__attb_rview(Gc + r0 * Dv, BF, n, Tq * Dv, rr, Dv, false);
      kiln__view Kv = kiln__attb_rview(Kc, BF, n, Tk * D, kv, D, false), Kt = kiln__attb_rview(Kc, BF, n, Tk * D, kv, D, true);
      kiln__view Vv = kiln__attb_rview(Vc, BF, n, Tk * Dv, kv, Dv, false), Vt = kiln__attb_rview(Vc, BF, n, Tk * Dv, kv, Dv, true);
      st = kiln__attb_mm(Qv, Kt, kiln__attb_view(S, KILN_F32, n, rr, kv, false), a->s[0], 0); /* S = scale Q K^T */
      if (st == KILN_OK && bw) /* dP = dO V^T */
        st = kiln__attb_mm(Gv, Vt, kiln__attb_view(dP, KILN_F32, n, rr, kv, false), 1.0, 0);
      if (st == KILN_OK) {
        int64_t work = n * rr * kv * 8;
        c.bh0 = c0, c.r0 = r0, c.R = rr, c.kv = kv;
        kiln__cpu_parallel_for(n * rr, work < KILN__CPU_PAR_MIN ? INT64_MAX : 1, kiln__attb_rows, &c);
      }
      if (st == KILN_OK && !bw) st = kiln__attb_mm(kiln__attb_view(P, BF, n, rr, kv, false), Vv, Gv, 1.0, 0); /* O = P V */
      if (st == KILN_OK && bw) {
        kiln__view Pt = kiln__attb_view(P, BF, n, rr, kv, true), dSt = kiln__attb_view(dS, BF, n, rr, kv, true);
        /* dV = P^T dO and dK = dS^T Q: the chunk's rows at once, or summed over the blocks */
        kiln__view dVv = blocks ? kiln__attb_rview(dV32, KILN_F32, n, Tk * Dv, kv, Dv, false)
                                : kiln__attb_view(dVd + c0 * Tk * Dv, BF, n, Tk, Dv, false);
        kiln__view dKv = blocks ? kiln__attb_rview(dK32, KILN_F32, n, Tk * D, kv, D, false)
                                : kiln__attb_view(dKd + c0 * Tk * D, BF, n, Tk, D, false);
        st = kiln__attb_mm(Pt, Gv, dVv, 1.0, blocks ? 1.0 : 0);
        if (st == KILN_OK) /* dQ = dS K */
          st = kiln__attb_mm(kiln__attb_view(dS, BF, n, rr, kv, false), Kv,
                             kiln__attb_rview(dQd + c0 * Tq * D + r0 * D, BF, n, Tq * D, rr, D, false), 1.0, 0);
        if (st == KILN_OK) st = kiln__attb_mm(dSt, Qv, dKv, 1.0, blocks ? 1.0 : 0);
      }
    }
    if (st == KILN_OK && nacc) { /* the sums, rounded once into the dense gradients */
      st = kiln__attb_sums_out(dK32, dKd + c0 * Tk * D, n * Tk * D);
      if (st == KILN_OK) st = kiln__attb_sums_out(dV32, dVd + c0 * Tk * Dv, n * Tk * Dv);
    }
  }
  if (st == KILN_OK && !bw) {
    pk = (kiln__attb_pack){.v = {&a->out[0]}, .d = {Gd}, .n = 1, .out = true, .H = H, .T = Tq};
    kiln__attb_pack_go(&pk, BH * Tq, Dv);
  }
  if (st == KILN_OK && bw) {
    if (Tq == Tk) {
      pk = (kiln__attb_pack){.v = {&a->out[0], &a->out[1], &a->out[2]}, .d = {dQd, dKd, dVd}, .n = 3, .out = true,
                             .H = H, .T = Tq};
      kiln__attb_pack_go(&pk, BH * Tq, D);
    } else {
      pk = (kiln__attb_pack){.v = {&a->out[0]}, .d = {dQd}, .n = 1, .out = true, .H = H, .T = Tq};
      kiln__attb_pack_go(&pk, BH * Tq, D);
      pk = (kiln__attb_pack){.v = {&a->out[1], &a->out[2]}, .d = {dKd, dVd}, .n = 2, .out = true, .H = H, .T = Tk};
      kiln__attb_pack_go(&pk, BH * Tk, D);
    }
  }
  kiln__cpu_free(0, buf, nb);
  return st;
}
#endif /* KILN_HAVE_DNNL */

kiln_status kiln__cpu_attention(const kiln__kargs *a) {
  bool bw = a->op == KILN__K_ATTENTION_BACKWARD;
  const char *name = bw ? "kiln_scaled_dot_product_attention (backward)" : "kiln_scaled_dot_product_attention";
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2];
  if (q->ndim != 4 || k->ndim != 4 || v->ndim != 4)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: the kernel wants 4-d q, k, v", name);
  for (int i = 0; i < 3; i++)
    if (!kiln__cpu_is_float(a->in[i].dtype)) return kiln__cpu_dtype_error(a, a->in[i].dtype);
  if (kiln__cpu_attv_takes(a)) return kiln__cpu_attv_run(a);
#ifdef KILN_HAVE_DNNL
  if (kiln__attb_takes(a)) return kiln__attb_run(a);
#endif
  if (kiln__attf_takes(a)) return kiln__attf_run(a);
  kiln__att c = {.a = a, .B = q->shape[0], .H = q->shape[1], .Tq = q->shape[2], .Tk = k->shape[2],
                 .D = q->shape[3], .Dv = v->shape[3], .scale = a->s[0], .causal = (a->i[0] & 1) != 0,
                 .masked = (a->i[0] & 2) != 0, .dropout = a->s[1] > 0};
  c.keep = 1.0 - a->s[1];
  c.zscale = c.keep > 0 ? 1.0 / c.keep : 0.0;
  int64_t BH = c.B * c.H;
  int64_t work = BH * c.Tq * (c.Tk + 1) * (c.D + c.Dv + 1);
  if (bw) {
    if (BH > 0) kiln__cpu_parallel_for(BH, work < KILN__CPU_PAR_MIN ? INT64_MAX : 1, kiln__att_bwd_range, &c);
  } else {
    size_t nk = (size_t)(BH * c.Tk);
    c.K = malloc(sizeof(double) * (nk * (size_t)(c.D + c.Dv) + 1));
    if (!c.K) goto oom;
    c.V = c.K + nk * (size_t)c.D;
    if (nk > 0) kiln__cpu_parallel_for((int64_t)nk, work < KILN__CPU_PAR_MIN ? INT64_MAX : 1, kiln__att_load_range, &c);
    if (BH * c.Tq > 0)
      kiln__cpu_parallel_for(BH * c.Tq, work < KILN__CPU_PAR_MIN ? INT64_MAX : 1, kiln__att_fwd_range, &c);
    free(c.K);
  }
  if (c.failed) goto oom;
  return KILN_OK;
oom:
  return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory (B*H %lld, Tq %lld, Tk %lld, D %lld)", name,
                        (long long)BH, (long long)c.Tq, (long long)c.Tk, (long long)c.D);
}
