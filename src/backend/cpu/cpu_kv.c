/*
** The CPU kernels of decoding with a KV cache (contracts: backend.h, INDEX_COPY and
** KV_ATTENTION): the reference the CUDA kernels (cuda/cuda_kv.cu) are tested against.
**
** KV_ATTENTION computes in f64 whatever the dtype (rows converted once), with a running
** max and normaliser (online softmax), so the result is the f64 result rounded once.
** Every index and length is checked before anything is written: a bad one leaves the
** output untouched and is KILN_ERR_INDEX.
*/
#include "cpu.h"
#include "cpu_iter.h"
#include "../../core/kiln_int.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int64_t get_len(const kiln__view *v, int64_t i) {
  return kiln__cpu_get_i64((const char *)v->data + i * v->strides[0] * (int64_t)kiln__cpu_esize(v->dtype), v->dtype);
}

/* ---- INDEX_COPY ---- */

kiln_status kiln__cpu_index_copy(const kiln__kargs *a) {
  const kiln__view *src = &a->in[0], *idx = &a->in[1], *dst = &a->out[0];
  const int d = (int)a->i[0];
  const int64_t T = src->shape[d], n_dst = dst->shape[d];
  for (int64_t t = 0; t < T; t++) {
    int64_t p = get_len(idx, t);
    if (p < 0 || p >= n_dst)
      return kiln_set_error(KILN_ERR_INDEX, "kiln_index_copy_: index %lld (entry %lld) is out of range for size %lld "
                            "of dim %d", (long long)p, (long long)t, (long long)n_dst, d);
  }
  const size_t es = kiln__cpu_esize(dst->dtype);
  int64_t n = 1;
  for (int i = 0; i < src->ndim; i++) n *= src->shape[i];
  int64_t coord[KILN_MAX_DIMS] = {0};
  for (int64_t e = 0; e < n; e++) {
    int64_t so = 0, dof = 0;
    for (int i = 0; i < src->ndim; i++) {
      so += coord[i] * src->strides[i];
      dof += (i == d ? get_len(idx, coord[i]) : coord[i]) * dst->strides[i];
    }
    memcpy((char *)dst->data + dof * (int64_t)es, (const char *)src->data + so * (int64_t)es, es);
    for (int i = src->ndim - 1; i >= 0; i--) { /* next coordinate, last dim fastest */
      if (++coord[i] < src->shape[i]) break;
      coord[i] = 0;
    }
  }
  return KILN_OK;
}

/* ---- KV_ATTENTION ---- */

typedef struct kv_ctx {
  const kiln__kargs *a;
  int64_t H, Tq, D, Dv;
  kiln_status st; /* OOM in a range */
} kv_ctx;

static const char *at4(const kiln__view *v, int64_t i0, int64_t i1, int64_t i2) {
  return (const char *)v->data +
         (i0 * v->strides[0] + i1 * v->strides[1] + i2 * v->strides[2]) * (int64_t)kiln__cpu_esize(v->dtype);
}

/* rows lo..hi of (B, H, Tq) */
static void kv_range(void *vctx, int64_t lo, int64_t hi) {
  kv_ctx *c = vctx;
  const kiln__kargs *a = c->a;
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2], *len = &a->in[3], *o = &a->out[0];
  const int64_t H = c->H, Tq = c->Tq, D = c->D, Dv = c->Dv;
  const double scale = a->s[0];
  double *buf = malloc((size_t)(2 * D + 2 * Dv) * sizeof(double));
  if (!buf) {
    c->st = KILN_ERR_OOM;
    return;
  }
  double *qr = buf, *kr = qr + D, *vr = kr + D, *acc = vr + Dv;
  for (int64_t r = lo; r < hi; r++) {
    const int64_t b = r / (H * Tq), h = (r / Tq) % H, i = r % Tq;
    const int64_t L = get_len(len, a->i[0] == 1 ? 0 : b);
    const int64_t last = L - Tq + i; /* the query's own position */
    kiln__cpu_load(qr, KILN_F64, at4(q, b, h, i), q->strides[3] * (int64_t)kiln__cpu_esize(q->dtype), q->dtype, D);
    double m = -INFINITY, l = 0;
    for (int64_t e = 0; e < Dv; e++) acc[e] = 0;
    for (int64_t j = 0; j <= last; j++) {
      kiln__cpu_load(kr, KILN_F64, at4(k, b, h, j), k->strides[3] * (int64_t)kiln__cpu_esize(k->dtype), k->dtype, D);
      double s = 0;
      for (int64_t e = 0; e < D; e++) s += qr[e] * kr[e];
      s *= scale;
      if (s > m) { /* rescale what came before to the new max */
        double f = exp(m - s);
        l *= f;
        for (int64_t e = 0; e < Dv; e++) acc[e] *= f;
        m = s;
      }
      double w = exp(s - m);
      l += w;
      kiln__cpu_load(vr, KILN_F64, at4(v, b, h, j), v->strides[3] * (int64_t)kiln__cpu_esize(v->dtype), v->dtype, Dv);
      for (int64_t e = 0; e < Dv; e++) acc[e] += w * vr[e];
    }
    for (int64_t e = 0; e < Dv; e++) acc[e] = l > 0 ? acc[e] / l : 0.0; /* no key: 0 */
    kiln__cpu_store((char *)at4(o, b, h, i), o->strides[3] * (int64_t)kiln__cpu_esize(o->dtype), o->dtype, acc,
                    KILN_F64, Dv);
  }
  free(buf);
}

kiln_status kiln__cpu_kv_attention(const kiln__kargs *a) {
  const kiln__view *q = &a->in[0], *k = &a->in[1], *len = &a->in[3];
  const int64_t B = q->shape[0], M = k->shape[2];
  for (int64_t b = 0; b < (a->i[0] == 1 ? 1 : B); b++) {
    int64_t L = get_len(len, b);
    if (L < 0 || L > M)
      return kiln_set_error(KILN_ERR_INDEX, "kiln_kv_attention: length %lld of row %lld is outside the cache's [0, %lld]",
                            (long long)L, (long long)b, (long long)M);
  }
  if (a->i[1]) { /* append: in4 kv_new (2, B, H, Tq, D) into k and v at slots L_b - Tq + t, first */
    const kiln__view *k_ = &a->in[1], *v_ = &a->in[2], *kn = &a->in[4];
    const int64_t H = q->shape[1], Tq = q->shape[2], D = q->shape[3];
    for (int64_t b = 0; b < B; b++)
      if (get_len(len, a->i[0] == 1 ? 0 : b) < Tq)
        return kiln_set_error(KILN_ERR_INDEX, "kiln_kv_attention_append: length %lld of row %lld leaves no room for "
                              "%lld new positions", (long long)get_len(len, a->i[0] == 1 ? 0 : b), (long long)b,
                              (long long)Tq);
    const int64_t es = (int64_t)kiln__cpu_esize(k_->dtype);
    for (int64_t b = 0; b < B; b++) {
      const int64_t L = get_len(len, a->i[0] == 1 ? 0 : b);
      for (int64_t h = 0; h < H; h++)
        for (int64_t t = 0; t < Tq; t++)
          for (int half = 0; half < 2; half++) {
            const kiln__view *dst = half ? v_ : k_;
            char *d = (char *)at4(dst, b, h, L - Tq + t);
            const char *sp = (const char *)kn->data +
                             (half * kn->strides[0] + b * kn->strides[1] + h * kn->strides[2] + t * kn->strides[3]) * es;
            for (int64_t e = 0; e < D; e++) memcpy(d + e * dst->strides[3] * es, sp + e * kn->strides[4] * es, (size_t)es);
          }
    }
  }
  kv_ctx c = {a, q->shape[1], q->shape[2], q->shape[3], a->in[2].shape[3], KILN_OK};
  const int64_t rows = B * c.H * c.Tq;
  kiln__cpu_parallel_for(rows, 4, kv_range, &c);
  if (c.st != KILN_OK) return kiln_set_error(KILN_ERR_OOM, "kiln_kv_attention: out of host memory for row buffers");
  return KILN_OK;
}

/* ---- SAMPLE_TOKENS ----
** The rule (kiln.h, kiln_sample_tokens), which cuda_kv.cu follows step by step: z = x * (1/T)
** in f32; weights w = floor(exp(z - max) * 2^32) (exact integer sums); the top-k and top-p
** cuts are found as keys (the float's bits mapped to an order-preserving u32) by an MSB-first
** radix select: the largest key K whose elements at or above it weigh at least a target. */

static uint32_t fkey(float f) {
  uint32_t b;
  memcpy(&b, &f, sizeof b);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

typedef struct srow {
  const char *p;
  int64_t bst, V;
  kiln_dtype dt;
  float inv, m;
  uint32_t kk, kp; /* keys at or above which a token is kept (0: all) */
} srow;

static float s_z(const srow *r, int64_t j) { return (float)kiln__cpu_get_f64(r->p + j * r->bst, r->dt) * r->inv; }
static bool s_ok(float z) { return isfinite(z); }
static uint64_t s_w(const srow *r, float z) { return (uint64_t)((double)expf(z - r->m) * 4294967296.0); }

/* the largest key K with (sum of weight over kept elements with key >= K) >= target; 0 when
** even every kept element weighs less. mass: 1 per element (top-k) or w (top-p). */
static uint32_t s_select(const srow *r, bool mass, double target) {
  uint32_t prefix = 0;
  uint64_t above = 0;
  for (int level = 3; level >= 0; level--) {
    const int shift = 8 * level;
    uint64_t hist[256] = {0};
    for (int64_t j = 0; j < r->V; j++) {
      float z = s_z(r, j);
      uint32_t k = fkey(z);
      if (!s_ok(z) || k < r->kk || k < r->kp) continue;
      if (level < 3 && (k >> (shift + 8)) != (prefix >> (shift + 8))) continue;
      hist[(k >> shift) & 255u] += mass ? s_w(r, z) : 1;
    }
    uint64_t acc = above;
    int d = 255;
    for (; d >= 0; d--) {
      acc += hist[d];
      if ((double)acc >= target) break;
    }
    if (d < 0) return level == 3 ? 0 : prefix; /* unreachable below the top level */
    prefix |= (uint32_t)d << shift;
    above = acc - hist[d];
  }
  return prefix;
}

kiln_status kiln__cpu_sample_tokens(const kiln__kargs *a) {
  const kiln__view *l = &a->in[0], *rng = &a->in[1], *o = &a->out[0];
  const int64_t N = l->shape[0], V = l->shape[1];
  const int64_t es = (int64_t)kiln__cpu_esize(l->dtype);
  if (a->s[0] == 0) { /* the argmax: the first maximum, NaN largest (no rng: in1 absent) */
    for (int64_t i = 0; i < N; i++) {
      const char *p = (const char *)l->data + i * l->strides[0] * es;
      int64_t best = 0;
      uint32_t bk = 0;
      for (int64_t j = 0; j < V; j++) {
        const float v = (float)kiln__cpu_get_f64(p + j * l->strides[1] * es, l->dtype);
        const uint32_t k = isnan(v) ? 0xffffffffu : fkey(v);
        if (j == 0 || k > bk) bk = k, best = j;
      }
      kiln__cpu_set_i64((char *)o->data + i * o->strides[0] * 8, KILN_I64, best);
    }
    return KILN_OK;
  }
  const uint64_t seed = (uint64_t)get_len(rng, 0), offset = (uint64_t)get_len(rng, 1);
  for (int64_t i = 0; i < N; i++) {
    srow r = {(const char *)l->data + i * l->strides[0] * es, l->strides[1] * es, V, l->dtype,
              (float)(1.0 / a->s[0]), -INFINITY, 0, 0};
    for (int64_t j = 0; j < V; j++) {
      float z = s_z(&r, j);
      if (s_ok(z) && z > r.m) r.m = z;
    }
    int64_t pick = 0;
    if (r.m == -INFINITY) {
      kiln__cpu_set_i64((char *)o->data + i * o->strides[0] * 8, KILN_I64, 0);
      return kiln_set_error(KILN_ERR_INDEX, "kiln_sample_tokens: row %lld has no finite logit", (long long)i);
    }
    if (a->i[0] > 0 && a->i[0] < V) r.kk = s_select(&r, false, (double)a->i[0]);
    if (a->s[1] < 1) {
      uint64_t S = 0;
      for (int64_t j = 0; j < V; j++) {
        float z = s_z(&r, j);
        if (s_ok(z) && fkey(z) >= r.kk) S += s_w(&r, z);
      }
      r.kp = s_select(&r, true, a->s[1] * (double)S);
    }
    uint64_t W = 0;
    for (int64_t j = 0; j < V; j++) {
      float z = s_z(&r, j);
      if (s_ok(z) && fkey(z) >= r.kk && fkey(z) >= r.kp) W += s_w(&r, z);
    }
    uint64_t t = (uint64_t)(kiln__philox_uniform_f64(seed, offset, (uint64_t)i) * (double)W);
    if (t >= W) t = W - 1; /* W >= 2^32: the maximum weighs 2^32 */
    uint64_t cdf = 0;
    for (int64_t j = 0; j < V; j++) {
      float z = s_z(&r, j);
      if (!s_ok(z) || fkey(z) < r.kk || fkey(z) < r.kp) continue;
      cdf += s_w(&r, z);
      if (cdf > t) {
        pick = j;
        break;
      }
    }
    kiln__cpu_set_i64((char *)o->data + i * o->strides[0] * 8, KILN_I64, pick);
  }
  return KILN_OK;
}

/* ---- ADD_LAYER_NORM: s = x + r rounded to the dtype, then layer_norm(s), in f64 ---- */

kiln_status kiln__cpu_add_layer_norm(const kiln__kargs *a) {
  const kiln__view *x = &a->in[0], *r = &a->in[1], *y = &a->out[0], *sm = &a->out[1];
  const int64_t R = x->shape[0], N = x->shape[1];
  const kiln__view *w = (a->i[0] & 1) ? &a->in[2] : NULL;
  const kiln__view *b = (a->i[0] & 2) ? &a->in[(a->i[0] & 1) ? 3 : 2] : NULL;
  const int64_t es = (int64_t)kiln__cpu_esize(x->dtype);
  double *buf = malloc((size_t)(4 * N) * sizeof(double));
  if (!buf) return kiln_set_error(KILN_ERR_OOM, "kiln_add_layer_norm: out of host memory for %lld values", (long long)(4 * N));
  double *xs = buf, *rs = xs + N, *wv = rs + N, *bv = wv + N;
  for (int64_t j = 0; j < N; j++) wv[j] = 1, bv[j] = 0;
  if (w) kiln__cpu_load(wv, KILN_F64, w->data, w->strides[0] * (int64_t)kiln__cpu_esize(w->dtype), w->dtype, N);
  if (b) kiln__cpu_load(bv, KILN_F64, b->data, b->strides[0] * (int64_t)kiln__cpu_esize(b->dtype), b->dtype, N);
  for (int64_t i = 0; i < R; i++) {
    char *sp = (char *)sm->data + i * sm->strides[0] * es;
    kiln__cpu_load(xs, KILN_F64, (const char *)x->data + i * x->strides[0] * es, x->strides[1] * es, x->dtype, N);
    kiln__cpu_load(rs, KILN_F64, (const char *)r->data + i * r->strides[0] * es, r->strides[1] * es, r->dtype, N);
    for (int64_t j = 0; j < N; j++) xs[j] += rs[j];
    kiln__cpu_store(sp, sm->strides[1] * es, sm->dtype, xs, KILN_F64, N); /* rounded once, */
    kiln__cpu_load(xs, KILN_F64, sp, sm->strides[1] * es, sm->dtype, N);  /* and normed as stored */
    double mean = 0, var = 0;
    for (int64_t j = 0; j < N; j++) mean += xs[j];
    mean /= (double)N;
    for (int64_t j = 0; j < N; j++) var += (xs[j] - mean) * (xs[j] - mean);
    const double rstd = 1.0 / sqrt(var / (double)N + a->s[0]);
    for (int64_t j = 0; j < N; j++) xs[j] = (xs[j] - mean) * rstd * wv[j] + bv[j];
    kiln__cpu_store((char *)y->data + i * y->strides[0] * es, y->strides[1] * es, y->dtype, xs, KILN_F64, N);
  }
  free(buf);
  return KILN_OK;
}
