/*
** Batch norm on the CPU: BATCH_NORM and BATCH_NORM_BACKWARD (backend.h gives the
** contracts), the reference of the CUDA kernels (cuda_batchnorm.cu).
**
** x is seen as (N, C, S) with any strides. The work is split over channels (one range of
** channels per thread: a channel's statistics, its normalization and its gradient never
** need another channel), so no reduction crosses threads and the sums are the same for
** any thread count. Values are gathered run by run into f64 (kiln__cpu_load) and every
** sum is f64; the mean and the variance take two passes (sum, then squared deviations
** from the mean), which is exact enough for any N*S and cannot cancel as E[x^2] - E[x]^2
** does when the mean is large against the spread.
**
** Runs follow memory: along S for one channel when S is the inner dim (NCHW, (N, C, L)),
** along the channels when they are (channels-last, (N, C) contiguous) or when S is short;
** then a work item is a block of BN_CB channels, so each cache line read serves every
** channel in it. (Runs of S = 4 cost a call per 4 values: ResNet-18's CPU step spent
** 11 ns per value in batch_norm before.)
*/
#include "cpu.h"
#include "cpu_iter.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define BN_RUN 256 /* elements per gathered run */
#define BN_CB 32   /* channels per work item when runs go along the channels */
#define BN_SHORT_S 32 /* S below this: runs go along the channels */

typedef struct bn_ctx {
  const kiln__kargs *a;
  int64_t N, C, S;
  bool cl;     /* channels inner: runs go along C */
  bool train;
  bool relu;   /* forward: y = max(y, 0), a ReLU fused (flag 8) */
  const kiln__view *res;       /* forward: the residual added before the ReLU (flag 16), or NULL */
  const kiln__view *x, *g, *y; /* y: forward's y or backward's dx */
  const kiln__view *mask;      /* backward: g counts where mask > 0, or NULL */
  const kiln__view *w, *b;     /* NULL when absent */
  const kiln__view *rm, *rv;   /* forward: running statistics, NULL when absent */
  const kiln__view *stats;     /* forward: written; backward: read */
  double eps, momentum;
} bn_ctx;

static size_t esz(const kiln__view *v) { return kiln__cpu_esize(v->dtype); }

/* byte address of (n, c, s) in a 3-d view */
static char *at3(const kiln__view *v, int64_t n, int64_t c, int64_t s) {
  return (char *)v->data + (n * v->strides[0] + c * v->strides[1] + s * v->strides[2]) * (int64_t)esz(v);
}
/* byte stride of a run in v */
static int64_t run_bst(const bn_ctx *k, const kiln__view *v) {
  return (k->cl ? v->strides[1] : v->strides[2]) * (int64_t)esz(v);
}
static double vec_get(const kiln__view *v, int64_t i) {
  return kiln__cpu_get_f64((const char *)v->data + i * v->strides[0] * (int64_t)esz(v), v->dtype);
}
static void vec_set(const kiln__view *v, int64_t i, double val) {
  kiln__cpu_set_f64((char *)v->data + i * v->strides[0] * (int64_t)esz(v), v->dtype, val);
}

/* Channel c's running statistics moved toward this batch's (dev: the sum of squared
** deviations over the M values; the running variance is unbiased, as PyTorch's). */
static void bn_update_running(const bn_ctx *k, int64_t c, double mean, double dev, double M) {
  double m = k->momentum;
  vec_set(k->rm, c, (1.0 - m) * vec_get(k->rm, c) + m * mean);
  vec_set(k->rv, c, (1.0 - m) * vec_get(k->rv, c) + m * (M > 1 ? dev / (M - 1.0) : NAN));
}

/* Backward, channel c: from sg = sum(g) and sgx = sum(g (x - mean)) over its M values, the
** weight and bias gradients into out[1] and out[2], and dx's coefficients
** dx = kk (g - sum(g)/M - xhat sum(g xhat)/M) = scale g + cx (x - mean) + shift
** (in eval the statistics are constants: dx = scale g). */
static void bn_bwd_channel(const bn_ctx *k, const kiln__kargs *a, int64_t c, double M, double sg, double sgx,
                           double invstd, double *scale, double *cx, double *shift) {
  double w = k->w ? vec_get(k->w, c) : 1.0, kk = w * invstd;
  double dw = sgx * invstd; /* sum of g xhat */
  vec_set(&a->out[1], c, dw);
  vec_set(&a->out[2], c, sg);
  if (k->train && M > 0) {
    *cx = -kk * invstd * dw / M;
    *shift = -kk * sg / M;
  } else {
    *cx = *shift = 0;
  }
  *scale = kk;
}

/* Eval: channel c's running statistics as its mean and 1/std. */
static void bn_running_stats(const bn_ctx *k, int64_t c, double *mean, double *invstd) {
  *mean = vec_get(k->rm, c);
  *invstd = 1.0 / sqrt(vec_get(k->rv, c) + k->eps);
}

/* Channel c's mean and 1/std into the saved statistics (2, C) for the backward, and its
** affine y = (x - mean) scale + shift (shifting after the scale: no cancellation of large
** means). */
static void bn_channel_affine(const bn_ctx *k, int64_t c, double mean, double invstd, double *scale, double *shift) {
  char *st = (char *)k->stats->data;
  int64_t es = (int64_t)esz(k->stats);
  kiln__cpu_set_f64(st + c * k->stats->strides[1] * es, k->stats->dtype, mean);
  kiln__cpu_set_f64(st + (k->stats->strides[0] + c * k->stats->strides[1]) * es, k->stats->dtype, invstd);
  *scale = (k->w ? vec_get(k->w, c) : 1.0) * invstd;
  *shift = k->b ? vec_get(k->b, c) : 0.0;
}

/* The runs of channels [c0, c1): calls fn(n, c, s, len) for each, where a run is len
** elements from (n, c, s) along S (one channel) or along C (channels c .. c+len-1). */
typedef void (*bn_run_fn)(const bn_ctx *k, int64_t n, int64_t c, int64_t s, int64_t len, void *u);
static void bn_runs(const bn_ctx *k, int64_t c0, int64_t c1, bn_run_fn fn, void *u) {
  if (!k->cl) {
    for (int64_t c = c0; c < c1; c++)
      for (int64_t n = 0; n < k->N; n++)
        for (int64_t s = 0; s < k->S; s += BN_RUN) fn(k, n, c, s, k->S - s < BN_RUN ? k->S - s : BN_RUN, u);
  } else {
    for (int64_t n = 0; n < k->N; n++)
      for (int64_t s = 0; s < k->S; s++)
        for (int64_t c = c0; c < c1; c += BN_RUN) fn(k, n, c, s, c1 - c < BN_RUN ? c1 - c : BN_RUN, u);
  }
}

/* per-channel accumulators of one work item, indexed c - c0 */
typedef struct bn_acc {
  int64_t c0;
  double *p, *q; /* forward: sum, then squared deviations; backward: sum g, sum g (x - mean) */
  const double *mean, *scale, *shift; /* pass inputs: y = (x - mean) scale + shift */
  const double *cx;                   /* backward: dx = scale g + cx (x - mean) + shift */
} bn_acc;

/* The sum of a run in four interleaved partial sums (element i into sum i % 4), added
** as (s0 + s1) + (s2 + s3): one chain of dependent f64 adds per run was the cost of the
** NCHW passes (4 cycles an element). A fixed order, so the same sums on any machine and
** any thread count. */
static double sum4(const double *b, int64_t n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) s0 += b[i], s1 += b[i + 1], s2 += b[i + 2], s3 += b[i + 3];
  if (i < n) s0 += b[i++];
  if (i < n) s1 += b[i++];
  if (i < n) s2 += b[i++];
  return (s0 + s1) + (s2 + s3);
}

static void run_sum(const bn_ctx *k, int64_t n, int64_t c, int64_t s, int64_t len, void *u) {
  bn_acc *A = u;
  double buf[BN_RUN];
  kiln__cpu_load(buf, KILN_F64, at3(k->x, n, c, s), run_bst(k, k->x), k->x->dtype, len);
  if (!k->cl) {
    A->p[c - A->c0] += sum4(buf, len);
  } else {
    for (int64_t i = 0; i < len; i++) A->p[c - A->c0 + i] += buf[i];
  }
}

static void run_dev(const bn_ctx *k, int64_t n, int64_t c, int64_t s, int64_t len, void *u) {
  bn_acc *A = u;
  double buf[BN_RUN];
  kiln__cpu_load(buf, KILN_F64, at3(k->x, n, c, s), run_bst(k, k->x), k->x->dtype, len);
  if (!k->cl) {
    double m = A->mean[c - A->c0];
    for (int64_t i = 0; i < len; i++) buf[i] = (buf[i] - m) * (buf[i] - m);
    A->q[c - A->c0] += sum4(buf, len);
  } else {
    for (int64_t i = 0; i < len; i++) {
      double d = buf[i] - A->mean[c - A->c0 + i];
      A->q[c - A->c0 + i] += d * d;
    }
  }
}

static void run_norm(const bn_ctx *k, int64_t n, int64_t c, int64_t s, int64_t len, void *u) {
  bn_acc *A = u;
  double buf[BN_RUN];
  kiln__cpu_load(buf, KILN_F64, at3(k->x, n, c, s), run_bst(k, k->x), k->x->dtype, len);
  for (int64_t i = 0; i < len; i++) {
    int64_t j = c - A->c0 + (k->cl ? i : 0);
    buf[i] = (buf[i] - A->mean[j]) * A->scale[j] + A->shift[j];
  }
  if (k->res) {
    double rb[BN_RUN];
    kiln__cpu_load(rb, KILN_F64, at3(k->res, n, c, s), run_bst(k, k->res), k->res->dtype, len);
    for (int64_t i = 0; i < len; i++) buf[i] += rb[i];
  }
  if (k->relu)
    for (int64_t i = 0; i < len; i++) buf[i] = buf[i] < 0 ? 0 : buf[i]; /* NaN passes, as kiln_relu's */
  kiln__cpu_store(at3(k->y, n, c, s), run_bst(k, k->y), k->y->dtype, buf, KILN_F64, len);
}

/* g of a run, zero where the mask (a ReLU's input) is not > 0 */
static void load_g(const bn_ctx *k, double *gb, int64_t n, int64_t c, int64_t s, int64_t len) {
  kiln__cpu_load(gb, KILN_F64, at3(k->g, n, c, s), run_bst(k, k->g), k->g->dtype, len);
  if (!k->mask) return;
  double mb[BN_RUN];
  kiln__cpu_load(mb, KILN_F64, at3(k->mask, n, c, s), run_bst(k, k->mask), k->mask->dtype, len);
  for (int64_t i = 0; i < len; i++) gb[i] = mb[i] > 0 ? gb[i] : 0.0;
}

static void run_bsum(const bn_ctx *k, int64_t n, int64_t c, int64_t s, int64_t len, void *u) {
  bn_acc *A = u;
  double xb[BN_RUN], gb[BN_RUN];
  kiln__cpu_load(xb, KILN_F64, at3(k->x, n, c, s), run_bst(k, k->x), k->x->dtype, len);
  load_g(k, gb, n, c, s, len);
  if (!k->cl) {
    int64_t j = c - A->c0;
    double m = A->mean[j];
    A->p[j] += sum4(gb, len);
    for (int64_t i = 0; i < len; i++) xb[i] = gb[i] * (xb[i] - m);
    A->q[j] += sum4(xb, len);
    return;
  }
  for (int64_t i = 0; i < len; i++) {
    int64_t j = c - A->c0 + i;
    A->p[j] += gb[i];
    A->q[j] += gb[i] * (xb[i] - A->mean[j]);
  }
}

static void run_dx(const bn_ctx *k, int64_t n, int64_t c, int64_t s, int64_t len, void *u) {
  bn_acc *A = u;
  double xb[BN_RUN], gb[BN_RUN];
  kiln__cpu_load(xb, KILN_F64, at3(k->x, n, c, s), run_bst(k, k->x), k->x->dtype, len);
  load_g(k, gb, n, c, s, len);
  for (int64_t i = 0; i < len; i++) {
    int64_t j = c - A->c0 + (k->cl ? i : 0);
    gb[i] = A->scale[j] * gb[i] + A->cx[j] * (xb[i] - A->mean[j]) + A->shift[j];
  }
  kiln__cpu_store(at3(k->y, n, c, s), run_bst(k, k->y), k->y->dtype, gb, KILN_F64, len);
}

/* work item t: the channels it owns */
static void item_range(const bn_ctx *k, int64_t t, int64_t *c0, int64_t *c1) {
  int64_t cb = k->cl ? BN_CB : 1;
  *c0 = t * cb;
  *c1 = *c0 + cb < k->C ? *c0 + cb : k->C;
}

static void fwd_items(void *vctx, int64_t lo, int64_t hi) {
  const bn_ctx *k = vctx;
  double p[BN_CB], q[BN_CB], mean[BN_CB], scale[BN_CB], shift[BN_CB];
  double M = (double)(k->N * k->S);
  for (int64_t t = lo; t < hi; t++) {
    int64_t c0, c1;
    item_range(k, t, &c0, &c1);
    int64_t nc = c1 - c0;
    bn_acc A = {c0, p, q, mean, scale, shift, NULL};
    for (int64_t j = 0; j < nc; j++) p[j] = q[j] = 0;
    double invstd[BN_CB];
    if (k->train) {
      bn_runs(k, c0, c1, run_sum, &A);
      for (int64_t j = 0; j < nc; j++) mean[j] = p[j] / M;
      bn_runs(k, c0, c1, run_dev, &A);
      for (int64_t j = 0; j < nc; j++) {
        double var = q[j] / M;
        invstd[j] = 1.0 / sqrt(var + k->eps);
        if (k->rm) bn_update_running(k, c0 + j, mean[j], q[j], M);
      }
    } else {
      for (int64_t j = 0; j < nc; j++) bn_running_stats(k, c0 + j, &mean[j], &invstd[j]);
    }
    for (int64_t j = 0; j < nc; j++) bn_channel_affine(k, c0 + j, mean[j], invstd[j], &scale[j], &shift[j]);
    bn_runs(k, c0, c1, run_norm, &A);
  }
}

static void bwd_items(void *vctx, int64_t lo, int64_t hi) {
  const bn_ctx *k = vctx;
  const kiln__kargs *a = k->a;
  double p[BN_CB], q[BN_CB], mean[BN_CB], scale[BN_CB], cx[BN_CB], shift[BN_CB];
  double M = (double)(k->N * k->S);
  const kiln__view *st = k->stats;
  int64_t es = (int64_t)esz(st);
  for (int64_t t = lo; t < hi; t++) {
    int64_t c0, c1;
    item_range(k, t, &c0, &c1);
    int64_t nc = c1 - c0;
    bn_acc A = {c0, p, q, mean, scale, shift, cx};
    double invstd[BN_CB];
    for (int64_t j = 0; j < nc; j++) {
      int64_t c = c0 + j;
      p[j] = q[j] = 0;
      mean[j] = kiln__cpu_get_f64((const char *)st->data + c * st->strides[1] * es, st->dtype);
      invstd[j] = kiln__cpu_get_f64((const char *)st->data + (st->strides[0] + c * st->strides[1]) * es, st->dtype);
    }
    bn_runs(k, c0, c1, run_bsum, &A);
    for (int64_t j = 0; j < nc; j++)
      bn_bwd_channel(k, a, c0 + j, M, p[j], q[j], invstd[j], &scale[j], &cx[j], &shift[j]);
    bn_runs(k, c0, c1, run_dx, &A);
  }
}

/* ---- f32 NCHW forward fast path ----
** x, y (and the residual) f32 with S the unit-stride inner dim: the common
** training case (every NCHW batch norm of a CNN with S >= BN_SHORT_S: ResNet-18's 8x8 and 16x16 maps).
** A work item is one channel; its values are read straight from the f32 rows (no gathered
** f64 runs) into 8
** f64 lane sums (element i of a row into lane i % 8, lanes added as a fixed tree), so the
** sums are the same for any thread count. The statistics take one pass: sum and sum of
** squares of x - K, K the channel's first value, in f64. The shift keeps x - K of the
** order of the spread (the cancellation of E[x^2] - E[x]^2 comes from a mean large against
** the spread; with K inside the data it is gone): the difference of two f32 values and its
** square are exact in f64, so only the f64 sums round, as in the two-pass form. 2 passes over x (the general path: 3).
** (A backward written this way, a channel's rows one image apart and left to the compiler,
** measured slower than the general path's gathered runs; bwd_fast below walks a block of
** channels image by image and vectorises by hand.) */
#define BN_L 8
static double lanes_sum(const double *v) {
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}
static const float *f32_row(const kiln__view *v, int64_t n, int64_t c) {
  return (const float *)v->data + n * v->strides[0] + c * v->strides[1];
}
static bool f32_rows(const kiln__view *v) { return v->dtype == KILN_F32 && (v->shape[2] <= 1 || v->strides[2] == 1); }

static void fwd_fast(void *vctx, int64_t lo, int64_t hi) {
  const bn_ctx *k = vctx;
  const int64_t N = k->N, S = k->S;
  double M = (double)(N * S);
  for (int64_t c = lo; c < hi; c++) {
    double mean, invstd;
    if (k->train) {
      double K = M > 0 ? (double)f32_row(k->x, 0, c)[0] : 0.0;
      double s[BN_L] = {0}, q[BN_L] = {0}, ts = 0, tq = 0;
      for (int64_t n = 0; n < N; n++) {
        const float *xp = f32_row(k->x, n, c);
        int64_t i = 0;
        for (; i + BN_L <= S; i += BN_L)
          for (int l = 0; l < BN_L; l++) {
            double d = (double)xp[i + l] - K;
            s[l] += d, q[l] += d * d;
          }
        for (; i < S; i++) { /* the tail into its own sums: a variable lane index would keep s, q in memory */
          double d = (double)xp[i] - K;
          ts += d, tq += d * d;
        }
      }
      double sd = lanes_sum(s) + ts, sq = lanes_sum(q) + tq;
      mean = K + sd / M;
      double dev = sq - sd * (sd / M); /* sum of (x - mean)^2 */
      if (dev < 0) dev = 0;
      invstd = 1.0 / sqrt(dev / M + k->eps);
      if (k->rm) bn_update_running(k, c, mean, dev, M);
    } else {
      bn_running_stats(k, c, &mean, &invstd);
    }
    double scale, shift;
    bn_channel_affine(k, c, mean, invstd, &scale, &shift);
    for (int64_t n = 0; n < N; n++) {
      const float *xp = f32_row(k->x, n, c);
      const float *rp = k->res ? f32_row(k->res, n, c) : NULL;
      float *yp = (float *)f32_row(k->y, n, c);
      /* in chunks, one simple loop per step: a select or a branch per element in one loop
      ** kept it scalar with a mispredicted branch per ReLU (4 ns a value) */
      for (int64_t i0 = 0; i0 < S; i0 += BN_RUN) {
        int64_t len = S - i0 < BN_RUN ? S - i0 : BN_RUN;
        double t[BN_RUN];
        for (int64_t i = 0; i < len; i++) t[i] = ((double)xp[i0 + i] - mean) * scale + shift;
        if (rp)
          for (int64_t i = 0; i < len; i++) t[i] += (double)rp[i0 + i];
        if (k->relu)
          for (int64_t i = 0; i < len; i++) t[i] = t[i] < 0 ? 0 : t[i]; /* NaN passes, as kiln_relu's */
        for (int64_t i = 0; i < len; i++) yp[i0 + i] = (float)t[i];
      }
    }
  }
}

/* ---- f32 NCHW backward fast path ----
** x, g, dx (and the mask) f32 with S the unit-stride inner dim and S >= BN_FAST_MIN_S:
** ResNet-18's 4x4, 8x8 and 16x16 maps. A work item is still a channel (the sums never cross
** threads), but a thread walks its channels a block at a time and, within the block, image
** by image: the block's rows of one image are contiguous, where the general path's runs of
** one channel jump a whole image (C*S floats: 16 KB on ResNet's layer1, so x, g, the mask
** and dx all fell on the same few L1 sets) and gathered each run through a dtype
** converter. Per row, 8 f64 lane sums (element i into lane i % 8, a fixed tree); a
** channel's rows add in image order, so the sums are the same for any thread count. dx is
** the general path's formula, in f64, rounded once. */
#define BN_FB 64 /* channels per block */
/* rows of at least one 8-lane step (ResNet's 4x4 maps: 360 -> 125 us a call against the
** channel-block runs); shorter rows (2x2, 1x1) stay with those runs */
#define BN_FAST_MIN_S 8

/* KILN_BN_FAST=0: the backward takes the general path; KILN_BN_SIMD=0: the fast path's
** portable rows instead of AVX-512 (for comparisons and tests) */
static bool env_off(const char *name, int *v) {
  if (*v < 0) *v = !kiln__knob_on(name, true);
  return *v;
}
static bool bn_fast_off(void) {
  static int v = -1;
  return env_off("KILN_BN_FAST", &v);
}


/* The portable rows (the compiler leaves these scalar: an f64 lane array fed from f32 with
** a select does not vectorise); bn_rows_avx512 below computes the same lanes. */
static void bn_row_sums(const float *x, const float *g, const float *m, int64_t S, double mean, double *ps,
                        double *qs) {
  double s[BN_L] = {0}, q[BN_L] = {0}, ts = 0, tq = 0;
  int64_t i = 0;
  for (; i + BN_L <= S; i += BN_L)
    for (int l = 0; l < BN_L; l++) {
      double gv = !m || m[i + l] > 0 ? g[i + l] : 0.0f;
      s[l] += gv, q[l] += gv * ((double)x[i + l] - mean);
    }
  for (; i < S; i++) {
    double gv = !m || m[i] > 0 ? g[i] : 0.0f;
    ts += gv, tq += gv * ((double)x[i] - mean);
  }
  *ps += lanes_sum(s) + ts;
  *qs += lanes_sum(q) + tq;
}

static void bn_row_dx(const float *x, const float *g, const float *m, float *dx, int64_t S, double mean,
                      double scale, double cx, double shift) {
  for (int64_t i = 0; i < S; i++) {
    double gv = !m || m[i] > 0 ? g[i] : 0.0f;
    dx[i] = (float)(scale * gv + cx * ((double)x[i] - mean) + shift);
  }
}

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(KILN_NO_TARGET_CLONES)
#include <immintrin.h>
#define BN_HAVE_AVX512 1
static bool bn_avx512_ok(void) {
  static int ok = -1;
  if (ok < 0) ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  return ok;
}
static bool bn_simd_off(void) {
  static int v = -1;
  return env_off("KILN_BN_SIMD", &v);
}

/* bn_row_sums and bn_row_dx with AVX-512: 8 values a step, widened to f64 (lane l of the
** register is lane l of the portable sums), the mask a compare and a zeroing move; the
** same operations in the same order (no FMA), so the same bits. */
__attribute__((target("avx512f,avx512vl"))) static void bn_row_sums_avx512(const float *x, const float *g,
                                                                            const float *m, int64_t S, double mean,
                                                                            double *ps, double *qs) {
  __m512d s = _mm512_setzero_pd(), q = _mm512_setzero_pd(), mv = _mm512_set1_pd(mean);
  int64_t i = 0;
  for (; i + BN_L <= S; i += BN_L) {
    __m256 g8 = _mm256_loadu_ps(g + i);
    if (m) g8 = _mm256_maskz_mov_ps(_mm256_cmp_ps_mask(_mm256_loadu_ps(m + i), _mm256_setzero_ps(), _CMP_GT_OQ), g8);
    __m512d gd = _mm512_cvtps_pd(g8), xd = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
    s = _mm512_add_pd(s, gd);
    q = _mm512_add_pd(q, _mm512_mul_pd(gd, _mm512_sub_pd(xd, mv)));
  }
  double sl[BN_L], ql[BN_L], ts = 0, tq = 0;
  _mm512_storeu_pd(sl, s);
  _mm512_storeu_pd(ql, q);
  for (; i < S; i++) {
    double gv = !m || m[i] > 0 ? g[i] : 0.0f;
    ts += gv, tq += gv * ((double)x[i] - mean);
  }
  *ps += lanes_sum(sl) + ts;
  *qs += lanes_sum(ql) + tq;
}

__attribute__((target("avx512f,avx512vl"))) static void bn_row_dx_avx512(const float *x, const float *g,
                                                                          const float *m, float *dx, int64_t S,
                                                                          double mean, double scale, double cx,
                                                                          double shift) {
  __m512d mv = _mm512_set1_pd(mean), sv = _mm512_set1_pd(scale), cv = _mm512_set1_pd(cx), hv = _mm512_set1_pd(shift);
  int64_t i = 0;
  for (; i + BN_L <= S; i += BN_L) {
    __m256 g8 = _mm256_loadu_ps(g + i);
    if (m) g8 = _mm256_maskz_mov_ps(_mm256_cmp_ps_mask(_mm256_loadu_ps(m + i), _mm256_setzero_ps(), _CMP_GT_OQ), g8);
    __m512d gd = _mm512_cvtps_pd(g8), xd = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
    __m512d r = _mm512_add_pd(_mm512_add_pd(_mm512_mul_pd(sv, gd), _mm512_mul_pd(cv, _mm512_sub_pd(xd, mv))), hv);
    _mm256_storeu_ps(dx + i, _mm512_cvtpd_ps(r));
  }
  if (i < S) bn_row_dx(x + i, g + i, m ? m + i : NULL, dx + i, S - i, mean, scale, cx, shift);
}

/* fwd_fast with AVX-512, a block of channels image by image (as bwd_fast): the same lane
** sums (element i of a row into lane i % 8, each lane over the channel's rows in image
** order, a lane register kept per channel between rows), the same statistics and the same
** per-value operations, so the same bits as fwd_fast; the rows of one image are
** contiguous where fwd_fast's rows of one channel jumped a whole image. */
__attribute__((target("avx512f,avx512vl"))) static void fwd_block_avx512(const bn_ctx *k, int64_t c0, int64_t nc) {
  const int64_t N = k->N, S = k->S, S8 = S / BN_L * BN_L;
  double M = (double)(N * S);
  double mean[BN_FB], scale[BN_FB], shift[BN_FB];
  if (k->train) {
    double K[BN_FB], ts[BN_FB], tq[BN_FB];
    __m512d sv[BN_FB], qv[BN_FB];
    for (int64_t j = 0; j < nc; j++) {
      K[j] = M > 0 ? (double)f32_row(k->x, 0, c0 + j)[0] : 0.0;
      ts[j] = tq[j] = 0;
      sv[j] = qv[j] = _mm512_setzero_pd();
    }
    for (int64_t n = 0; n < N; n++)
      for (int64_t j = 0; j < nc; j++) {
        const float *xp = f32_row(k->x, n, c0 + j);
        __m512d kv = _mm512_set1_pd(K[j]), s = sv[j], q = qv[j];
        for (int64_t i = 0; i < S8; i += BN_L) {
          __m512d d = _mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(xp + i)), kv);
          s = _mm512_add_pd(s, d);
          q = _mm512_add_pd(q, _mm512_mul_pd(d, d));
        }
        sv[j] = s, qv[j] = q;
        for (int64_t i = S8; i < S; i++) {
          double d = (double)xp[i] - K[j];
          ts[j] += d, tq[j] += d * d;
        }
      }
    for (int64_t j = 0; j < nc; j++) {
      int64_t c = c0 + j;
      double sl[BN_L], ql[BN_L];
      _mm512_storeu_pd(sl, sv[j]);
      _mm512_storeu_pd(ql, qv[j]);
      double sd = lanes_sum(sl) + ts[j], sq = lanes_sum(ql) + tq[j];
      mean[j] = K[j] + sd / M;
      double dev = sq - sd * (sd / M);
      if (dev < 0) dev = 0;
      double invstd = 1.0 / sqrt(dev / M + k->eps);
      if (k->rm) bn_update_running(k, c, mean[j], dev, M);
      scale[j] = invstd; /* times the weight below */
    }
  } else {
    for (int64_t j = 0; j < nc; j++) bn_running_stats(k, c0 + j, &mean[j], &scale[j]);
  }
  for (int64_t j = 0; j < nc; j++) bn_channel_affine(k, c0 + j, mean[j], scale[j], &scale[j], &shift[j]);
  for (int64_t n = 0; n < N; n++)
    for (int64_t j = 0; j < nc; j++) {
      const float *xp = f32_row(k->x, n, c0 + j);
      const float *rp = k->res ? f32_row(k->res, n, c0 + j) : NULL;
      float *yp = (float *)f32_row(k->y, n, c0 + j);
      __m512d mv = _mm512_set1_pd(mean[j]), scv = _mm512_set1_pd(scale[j]), shv = _mm512_set1_pd(shift[j]);
      int64_t i = 0;
      for (; i < S8; i += BN_L) {
        __m512d t = _mm512_add_pd(_mm512_mul_pd(_mm512_sub_pd(_mm512_cvtps_pd(_mm256_loadu_ps(xp + i)), mv), scv), shv);
        if (rp) t = _mm512_add_pd(t, _mm512_cvtps_pd(_mm256_loadu_ps(rp + i)));
        __m256 y8 = _mm512_cvtpd_ps(t);
        /* the ReLU on the value: t < 0 -> +0 (NaN passes, as kiln_relu's) */
        if (k->relu) y8 = _mm256_mask_mov_ps(y8, _mm512_cmp_pd_mask(t, _mm512_setzero_pd(), _CMP_LT_OQ), _mm256_setzero_ps());
        _mm256_storeu_ps(yp + i, y8);
      }
      for (; i < S; i++) {
        double t = ((double)xp[i] - mean[j]) * scale[j] + shift[j];
        if (rp) t += (double)rp[i];
        if (k->relu) t = t < 0 ? 0 : t;
        yp[i] = (float)t;
      }
    }
}

static void fwd_fast_avx512(void *vctx, int64_t lo, int64_t hi) {
  for (int64_t c0 = lo; c0 < hi; c0 += BN_FB) fwd_block_avx512(vctx, c0, hi - c0 < BN_FB ? hi - c0 : BN_FB);
}
#endif


static void bwd_fast(void *vctx, int64_t lo, int64_t hi) {
  const bn_ctx *k = vctx;
  const kiln__kargs *a = k->a;
  const kiln__view *st = k->stats;
  int64_t es = (int64_t)esz(st);
  double M = (double)(k->N * k->S);
  double p[BN_FB], q[BN_FB], mean[BN_FB], scale[BN_FB], cx[BN_FB], shift[BN_FB];
  void (*sums)(const float *, const float *, const float *, int64_t, double, double *, double *) = bn_row_sums;
  void (*dxrow)(const float *, const float *, const float *, float *, int64_t, double, double, double, double) =
      bn_row_dx;
#ifdef BN_HAVE_AVX512
  if (bn_avx512_ok() && !bn_simd_off()) sums = bn_row_sums_avx512, dxrow = bn_row_dx_avx512;
#endif
  for (int64_t c0 = lo; c0 < hi; c0 += BN_FB) {
    int64_t nc = hi - c0 < BN_FB ? hi - c0 : BN_FB;
    double invstd[BN_FB];
    for (int64_t j = 0; j < nc; j++) {
      int64_t c = c0 + j;
      p[j] = q[j] = 0;
      mean[j] = kiln__cpu_get_f64((const char *)st->data + c * st->strides[1] * es, st->dtype);
      invstd[j] = kiln__cpu_get_f64((const char *)st->data + (st->strides[0] + c * st->strides[1]) * es, st->dtype);
    }
    for (int64_t n = 0; n < k->N; n++)
      for (int64_t j = 0; j < nc; j++)
        sums(f32_row(k->x, n, c0 + j), f32_row(k->g, n, c0 + j), k->mask ? f32_row(k->mask, n, c0 + j) : NULL, k->S,
             mean[j], &p[j], &q[j]);
    for (int64_t j = 0; j < nc; j++)
      bn_bwd_channel(k, a, c0 + j, M, p[j], q[j], invstd[j], &scale[j], &cx[j], &shift[j]);
    for (int64_t n = 0; n < k->N; n++)
      for (int64_t j = 0; j < nc; j++)
        dxrow(f32_row(k->x, n, c0 + j), f32_row(k->g, n, c0 + j), k->mask ? f32_row(k->mask, n, c0 + j) : NULL,
              (float *)f32_row(k->y, n, c0 + j), k->S, mean[j], scale[j], cx[j], shift[j]);
  }
}

/* Whether runs should go along the channels: they are the inner dim of x, or S is too
** short to be a run worth a call (ResNet's last stages: S = 4 or 1), when channels S
** apart still share cache lines. */
static bool channels_inner(const kiln__view *x, int64_t C, int64_t S) {
  if (C <= 1) return false;
  if (S < BN_SHORT_S) return true;
  int64_t sc = x->strides[1] < 0 ? -x->strides[1] : x->strides[1];
  int64_t ss = x->strides[2] < 0 ? -x->strides[2] : x->strides[2];
  return sc < ss;
}

/* The backward's flag 4: out3 = g where the mask is > 0, else 0 (RELU_BACKWARD's values),
** element by element. The op layer asks for it on CUDA only (pass 1 writes it there); the
** CPU keeps it so that a fallback from a device gives the same results. */
static void write_masked_g(const kiln__view *g, const kiln__view *mask, const kiln__view *out) {
  for (int64_t n = 0; n < g->shape[0]; n++)
    for (int64_t c = 0; c < g->shape[1]; c++)
      for (int64_t s = 0; s < g->shape[2]; s++) {
        double mv = kiln__cpu_get_f64(at3(mask, n, c, s), mask->dtype);
        double gv = mv > 0 ? kiln__cpu_get_f64(at3(g, n, c, s), g->dtype) : 0.0;
        kiln__cpu_set_f64(at3(out, n, c, s), out->dtype, gv);
      }
}

kiln_status kiln__cpu_batch_norm(const kiln__kargs *a) {
  bool bw = a->op == KILN__K_BATCH_NORM_BACKWARD;
  const kiln__view *x = &a->in[0];
  if (x->ndim != 3 || !kiln__cpu_is_float(x->dtype))
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_%s: expected a floating (N, C, S) view, got %d dims of %s",
                          kiln__kop_name(a->op), x->ndim, kiln_dtype_name(x->dtype));
  bn_ctx k = {0};
  k.a = a;
  k.N = x->shape[0], k.C = x->shape[1], k.S = x->shape[2];
  k.cl = channels_inner(x, k.C, k.S);
  k.train = a->i[1] != 0;
  k.x = x;
  k.eps = a->s[0];
  k.momentum = a->s[1];
  int flags = (int)a->i[0];
  if (!bw && (flags & 32)) /* the pooled output: CUDA's (cpu_supports refuses it; the op layer composes the ops) */
    return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln_batch_norm: flag 32 (the max-pooled output) is not on the CPU");
  if (!bw) {
    int at = 1;
    k.w = (flags & 1) ? &a->in[at++] : NULL;
    k.b = (flags & 2) ? &a->in[at++] : NULL;
    k.y = &a->out[0];
    k.relu = (flags & 8) != 0;
    k.res = (flags & 16) ? &a->in[at] : NULL; /* after the weight and the bias */
    k.stats = &a->out[1];
    if (flags & 4) k.rm = &a->out[2], k.rv = &a->out[3];
    if (!k.train && !k.rm)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_batch_norm: eval needs the running statistics");
  } else {
    if (flags & 8) /* the mask recomputed from x: CUDA's (cpu_supports refuses it) */
      return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln_batch_norm_backward: flag 8 (the mask recomputed) is not on the CPU");
    k.g = &a->in[1];
    k.stats = &a->in[2];
    k.w = (flags & 1) ? &a->in[3] : NULL;
    k.mask = (flags & 2) ? &a->in[a->n_in - 1] : NULL;
    k.y = &a->out[0];
    if (flags & 4) {
      if (!k.mask || a->n_out < 4 || a->out[3].ndim != 3)
        return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                              "kiln_batch_norm_backward: flag 4 (the masked gradient) needs the mask and out3");
      write_masked_g(k.g, k.mask, &a->out[3]);
    }
  }
  int64_t numel = k.N * k.C * k.S;
  /* short rows (S < BN_SHORT_S: ResNet's 4x4 .. 1x1 maps) stay with the channel-block
  ** runs: a row of 4 or 1 values per loop costs more than the gather */
  bool rows = f32_rows(x) && f32_rows(k.y) && (!k.res || f32_rows(k.res));
#ifdef BN_HAVE_AVX512
  /* the AVX-512 forward on rows of 8 or more (ResNet's 4x4 maps too) */
  if (!bw && rows && k.S >= BN_FAST_MIN_S && bn_avx512_ok() && !bn_simd_off() && !bn_fast_off()) {
    if (k.C == 0) return KILN_OK;
    int64_t min_par = numel >= KILN__CPU_PAR_MIN_CHEAP / 4 ? 1 : k.C + 1;
    kiln__cpu_parallel_for(k.C, min_par, fwd_fast_avx512, &k);
    return KILN_OK;
  }
#endif
  bool fast = !bw && !k.cl && rows;
  if (fast) {
    if (k.C == 0) return KILN_OK;
    int64_t min_par = numel >= KILN__CPU_PAR_MIN_CHEAP / 4 ? 1 : k.C + 1;
    kiln__cpu_parallel_for(k.C, min_par, fwd_fast, &k);
    return KILN_OK;
  }
  if (bw && k.S >= BN_FAST_MIN_S && f32_rows(x) && f32_rows(k.g) && f32_rows(k.y) && (!k.mask || f32_rows(k.mask)) &&
      !bn_fast_off()) {
    if (k.C == 0) return KILN_OK;
    int64_t min_par = numel >= KILN__CPU_PAR_MIN_CHEAP / 4 ? 1 : k.C + 1;
    kiln__cpu_parallel_for(k.C, min_par, bwd_fast, &k);
    return KILN_OK;
  }
  int64_t items = k.cl ? (k.C + BN_CB - 1) / BN_CB : k.C;
  if (items == 0) return KILN_OK;
  /* each item is at least a channel's worth; threads start when the whole is worth it */
  int64_t min_par = numel >= KILN__CPU_PAR_MIN_CHEAP / 4 ? 1 : items + 1;
  kiln__cpu_parallel_for(items, min_par, bw ? bwd_items : fwd_items, &k);
  return KILN_OK;
}
