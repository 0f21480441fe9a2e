/*
** Decoding with a KV cache on CUDA (contracts: backend.h INDEX_COPY and KV_ATTENTION; CPU
** references: cpu/cpu_kv.c). Both read their positions and lengths on the device, so a
** decode step's launches are the same every token and the step can be captured once and
** replayed (src/nn/generate.c). A bad position never synchronizes: it sets the device's
** index flag (kc_flag) and the kernel skips (INDEX_COPY) or clamps (KV_ATTENTION) it.
**
** KV_ATTENTION is flash-decoding's inner loop without the split over blocks: one block of
** NW warps per query row (b, h, i); warp w takes the keys w, w + NW, ...; lane t holds
** q[t], q[t + 32], ... (pre-scaled) and reads the same columns of the key and value rows,
** so every load is coalesced; the score is a warp sum, and the warp's running max,
** normaliser and output columns are rescaled per key. The NW partial (max, sum, acc) are
** merged through shared memory at the end. Accumulation in f32 (f64 for f64). Keys past the
** row's length are never read, so a step over a cache of max_len slots costs what its valid
** prefix costs. (The first version gave each lane a key of a 32-key tile: every load then
** touched 32 rows, and a call took ~20 us at GPT-2's 12 heads and 192 keys on the H200.)
**
** SAMPLE_TOKENS is cpu_kv.c's rule step by step, one block of 1024 threads per row, each
** thread a contiguous chunk of the vocabulary (so thread order is index order for the
** draw's prefix sum): the max; the top-k and top-p cuts by an MSB-first radix select over
** the logits' order-preserving keys, 8 bits a pass, with 64-bit integer histograms in
** shared memory (the weights are 2^-32 fixed point, so the atomics' order changes nothing:
** same seed, same token, every run); then the total, an exclusive scan of the threads'
** sums and the thread whose range holds the drawn target walks its chunk. The logits are
** read once per pass (from L1/L2: a GPT-2 row of bf16 logits is 100 KB). Temperature 0 is
** the argmax in one pass (kiln_argmax's MAX_DIM kernel took 463 us for one 50257 row on the
** H200, half of a decode step).
**
** LINEAR_DECODE is a GEMV for up to 16 rows: a warp per output column n walks weight row
** n with 16-byte loads (32 lanes: 512 contiguous bytes a step) and dots it with every row
** of x (tiny, from L1), so the weight is read once whatever the row count; the M sums are
** reduced across the warp and lane 0 adds the bias, rounds, and applies the GELU. cuBLAS
** at M = 1..16 reads the same bytes but through tiles sized for large M.
*/
#include "cuda_int.cuh"
#include "philox.cuh"

#include <math.h>

namespace {

enum { NW = 16, KV_MAXD = 128, KV_CH = KV_MAXD / 32 };

/* ---- INDEX_COPY ---- */

struct IcArgs {
  int ndim, dim;
  int64_t n, dst_size;
  int64_t shape[KILN_MAX_DIMS], ss[KILN_MAX_DIMS], ds[KILN_MAX_DIMS];
  int64_t is; /* the index's stride */
};

template <class U>
__global__ void __launch_bounds__(KC_THREADS)
    index_copy_k(const U *__restrict__ src, const int64_t *__restrict__ idx, U *dst, IcArgs p, int *flag) {
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < p.n; e += (int64_t)gridDim.x * blockDim.x) {
    int64_t rest = e, so = 0, dof = 0;
    bool ok = true;
    for (int i = p.ndim - 1; i >= 0; i--) {
      const int64_t c = rest % p.shape[i];
      rest /= p.shape[i];
      so += c * p.ss[i];
      if (i == p.dim) {
        const int64_t t = idx[c * p.is];
        if (t < 0 || t >= p.dst_size) ok = false;
        dof += t * p.ds[i];
      } else {
        dof += c * p.ds[i];
      }
    }
    if (!ok) {
      kc_flag(flag, KILN__K_INDEX_COPY);
      continue;
    }
    dst[dof] = src[so];
  }
}

kiln_status index_copy(kiln__cuda_dev *d, const kiln__kargs *a) {
  const kiln__view *src = &a->in[0], *idx = &a->in[1], *dst = &a->out[0];
  IcArgs p;
  p.ndim = src->ndim;
  p.dim = (int)a->i[0];
  p.n = kc_numel(src);
  p.dst_size = dst->shape[p.dim];
  p.is = idx->strides[0];
  for (int i = 0; i < src->ndim; i++) p.shape[i] = src->shape[i], p.ss[i] = src->strides[i], p.ds[i] = dst->strides[i];
  if (p.n == 0) return KILN_OK;
  const int blocks = kc_blocks(p.n, KC_THREADS, d->sm_count);
  const int64_t *ip = (const int64_t *)idx->data;
  switch (kc_size(dst->dtype)) {
  case 1: index_copy_k<uint8_t><<<blocks, KC_THREADS, 0, d->stream>>>((const uint8_t *)src->data, ip, (uint8_t *)dst->data, p, d->err_flag); break;
  case 2: index_copy_k<uint16_t><<<blocks, KC_THREADS, 0, d->stream>>>((const uint16_t *)src->data, ip, (uint16_t *)dst->data, p, d->err_flag); break;
  case 4: index_copy_k<uint32_t><<<blocks, KC_THREADS, 0, d->stream>>>((const uint32_t *)src->data, ip, (uint32_t *)dst->data, p, d->err_flag); break;
  case 8: index_copy_k<uint64_t><<<blocks, KC_THREADS, 0, d->stream>>>((const uint64_t *)src->data, ip, (uint64_t *)dst->data, p, d->err_flag); break;
  default: return kiln_set_error(KILN_ERR_DTYPE, "kiln_index_copy_: dtype %s has no cuda kernel", kiln_dtype_name(dst->dtype));
  }
  return kiln__cuda_launched("index_copy");
}

/* ---- KV_ATTENTION ---- */

struct KvArgs {
  int64_t H, Tq, M, D, Dv;
  int64_t qs[4], ks[4], vs[4], os[4];
  int64_t ls, nlen; /* len's stride and element count (1 or B) */
  double scale;
};

template <class A> __device__ __forceinline__ A kv_exp(A x) { return exp(x); }
template <> __device__ __forceinline__ float kv_exp<float>(float x) { return __expf(x); }

template <class T>
__global__ void __launch_bounds__(NW * 32)
    kv_att(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, T *o,
           const int64_t *__restrict__ len, KvArgs p, int *flag) {
  typedef typename kc_traits<T>::acc A;
  __shared__ A wm[NW], wl[NW];
  __shared__ A wacc[NW][KV_MAXD];
  const int64_t r = blockIdx.x;
  const int64_t b = r / (p.H * p.Tq), h = (r / p.Tq) % p.H, i = r % p.Tq;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  int64_t L = len[(p.nlen == 1 ? 0 : b) * p.ls];
  if (L < 0 || L > p.M) {
    if (threadIdx.x == 0) kc_flag(flag, KILN__K_KV_ATTENTION);
    L = L < 0 ? 0 : p.M;
  }
  const int64_t n = L - p.Tq + i + 1; /* keys 0 .. n-1 (the query is position n - 1) */
  /* lane holds q[e], e = lane + 32 c, pre-scaled: the key rows are read across the lanes */
  const T *qr = q + b * p.qs[0] + h * p.qs[1] + i * p.qs[2];
  A qv[KV_CH];
#pragma unroll
  for (int c = 0; c < KV_CH; c++) {
    const int e = lane + 32 * c;
    qv[c] = e < p.D ? (A)kc_ld<T>(qr[e * p.qs[3]]) * (A)p.scale : (A)0;
  }
  const T *kb = k + b * p.ks[0] + h * p.ks[1];
  const T *vb = v + b * p.vs[0] + h * p.vs[1];
  A m = -(A)INFINITY, l = 0, acc[KV_CH];
#pragma unroll
  for (int c = 0; c < KV_CH; c++) acc[c] = 0;
#pragma unroll 4
  for (int64_t j = w; j < n; j += NW) { /* warp-uniform: a key per warp, its row across the lanes */
    const T *kr = kb + j * p.ks[2], *vr = vb + j * p.vs[2];
    A part = 0, vv[KV_CH];
#pragma unroll
    for (int c = 0; c < KV_CH; c++) {
      const int e = lane + 32 * c;
      if (e < p.D) part += qv[c] * (A)kc_ld<T>(kr[e * p.ks[3]]);
      vv[c] = e < p.Dv ? (A)kc_ld<T>(vr[e * p.vs[3]]) : (A)0; /* in flight with the score */
    }
    const A sc = kc_warp_reduce(part, [](A x, A y) { return x + y; });
    const A mn = m > sc ? m : sc;
    const A f = kv_exp<A>(m - mn); /* 0 on the first key (m = -inf) */
    const A pj = kv_exp<A>(sc - mn);
    l = l * f + pj;
#pragma unroll
    for (int c = 0; c < KV_CH; c++) acc[c] = acc[c] * f + pj * vv[c];
    m = mn;
  }
  if (lane == 0) wm[w] = m, wl[w] = l;
#pragma unroll
  for (int c = 0; c < KV_CH; c++)
    if (lane + 32 * c < KV_MAXD) wacc[w][lane + 32 * c] = acc[c];
  __syncthreads();
  A mx = -(A)INFINITY;
#pragma unroll
  for (int u = 0; u < NW; u++) mx = wm[u] > mx ? wm[u] : mx;
  A tot = 0;
  A fw[NW];
#pragma unroll
  for (int u = 0; u < NW; u++) { /* a warp with no key has m = -inf: weight 0 */
    fw[u] = wm[u] == -(A)INFINITY ? (A)0 : kv_exp<A>(wm[u] - mx);
    tot += wl[u] * fw[u];
  }
  T *orow = o + b * p.os[0] + h * p.os[1] + i * p.os[2];
  for (int e = threadIdx.x; e < p.Dv; e += NW * 32) {
    A y = 0;
#pragma unroll
    for (int u = 0; u < NW; u++) y += wacc[u][e] * fw[u];
    orow[e * p.os[3]] = kc_st<T, A>(tot > 0 ? y / tot : (A)0); /* no key: 0, as the CPU */
  }
}

kiln_status kv_attention(kiln__cuda_dev *d, const kiln__kargs *a) {
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2], *len = &a->in[3], *o = &a->out[0];
  KvArgs p;
  p.H = q->shape[1], p.Tq = q->shape[2], p.M = k->shape[2], p.D = q->shape[3], p.Dv = v->shape[3];
  for (int i = 0; i < 4; i++) p.qs[i] = q->strides[i], p.ks[i] = k->strides[i], p.vs[i] = v->strides[i], p.os[i] = o->strides[i];
  p.ls = len->strides[0];
  p.nlen = a->i[0];
  p.scale = a->s[0];
  const int64_t rows = q->shape[0] * p.H * p.Tq;
  if (rows == 0 || p.Dv == 0) return KILN_OK;
  if (rows > 0x7fffffffLL)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_kv_attention: %lld query rows exceed one launch", (long long)rows);
  const int64_t *lp = (const int64_t *)len->data;
  KC_SWITCH_FLOAT(q->dtype, T,
                  return kiln_set_error(KILN_ERR_DTYPE, "kiln_kv_attention: dtype %s has no cuda kernel",
                                        kiln_dtype_name(q->dtype)),
                  kv_att<T><<<(unsigned)rows, NW * 32, 0, d->stream>>>((const T *)q->data, (const T *)k->data,
                                                                       (const T *)v->data, (T *)o->data, lp, p,
                                                                       d->err_flag))
  return kiln__cuda_launched("kv_attention");
}

/* ---- SAMPLE_TOKENS ---- */

enum { ST_THREADS = 1024 };

__device__ __forceinline__ uint32_t st_key(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

template <class T> struct StRow {
  const T *p;
  int64_t s;
  float inv, m;
  uint32_t kk, kp; /* keys at or above which a token is kept (0: all) */
  __device__ float z(int64_t j) const { return (float)kc_ld<T>(p[j * s]) * inv; }
  __device__ unsigned long long w(float zv) const {
    return (unsigned long long)((double)expf(zv - m) * 4294967296.0);
  }
  __device__ bool kept(float zv) const {
    const uint32_t k = st_key(zv);
    return isfinite(zv) && k >= kk && k >= kp;
  }
};

/* A block-wide reduction; every thread gets the result. sh: 32 slots. */
template <class V, class F> __device__ V st_reduce(V v, F f, V init, V *sh) {
  v = kc_warp_reduce(v, f);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  __syncthreads(); /* sh may still be read from the last call */
  if (lane == 0) sh[w] = v;
  __syncthreads();
  if (w == 0) {
    V x = lane < (int)(blockDim.x >> 5) ? sh[lane] : init;
    x = kc_warp_reduce(x, f);
    if (lane == 0) sh[0] = x;
  }
  __syncthreads();
  return sh[0];
}

/* The largest key K whose kept elements at or above it weigh >= target (1 each, or w when
** mass); 0 when all of them weigh less. */
template <class T>
__device__ uint32_t st_select(const StRow<T> &r, int64_t j0, int64_t j1, bool mass, double target,
                              unsigned long long *hist, unsigned long long *ush, int *dsh) {
  uint32_t prefix = 0;
  unsigned long long above = 0;
  for (int level = 3; level >= 0; level--) {
    const int shift = 8 * level;
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    for (int64_t j = j0; j < j1; j++) {
      const float zv = r.z(j);
      if (!r.kept(zv)) continue;
      const uint32_t k = st_key(zv);
      if (level < 3 && (k >> (shift + 8)) != (prefix >> (shift + 8))) continue;
      atomicAdd(&hist[(k >> shift) & 255u], mass ? r.w(zv) : 1ull);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long acc = above;
      int d = 255;
      for (; d >= 0; d--) {
        acc += hist[d];
        if ((double)acc >= target) break;
      }
      dsh[0] = d;
      ush[0] = d >= 0 ? acc - hist[d] : 0;
    }
    __syncthreads();
    const int d = dsh[0];
    const unsigned long long ab = ush[0];
    __syncthreads(); /* dsh, ush and hist are rewritten next */
    if (d < 0) return level == 3 ? 0u : prefix; /* block-uniform */
    prefix |= (uint32_t)d << shift;
    above = ab;
  }
  return prefix;
}

template <class T>
__global__ void __launch_bounds__(ST_THREADS)
    sample_k(const T *__restrict__ logits, int64_t ls0, int64_t ls1, int64_t V, int64_t *out, int64_t os0,
             const int64_t *__restrict__ rng, int64_t rs, float inv, int64_t top_k, double top_p, int greedy,
             int *flag) {
  __shared__ unsigned long long hist[256];
  __shared__ unsigned long long ush[32];
  __shared__ float fsh[32];
  __shared__ int dsh[1];
  const int64_t row = blockIdx.x;
  StRow<T> r;
  r.p = logits + row * ls0, r.s = ls1, r.inv = inv, r.m = -INFINITY, r.kk = 0, r.kp = 0;
  const int64_t ch = (V + blockDim.x - 1) / blockDim.x;
  const int64_t j0 = min(V, (int64_t)threadIdx.x * ch), j1 = min(V, j0 + ch);
  if (greedy) { /* the argmax: the key (NaN largest) above, the complemented index below, so
                ** the largest pair is the first maximum; 0 (no element) never wins */
    unsigned long long best = 0;
    for (int64_t j = j0; j < j1; j++) {
      const float v = (float)kc_ld<T>(r.p[j * r.s]);
      const unsigned long long k = isnan(v) ? 0xffffffffull : (unsigned long long)st_key(v);
      const unsigned long long pk = (k << 32) | (unsigned long long)(0xffffffffu - (uint32_t)j);
      best = pk > best ? pk : best;
    }
    best = st_reduce(best, [](unsigned long long a, unsigned long long b) { return a > b ? a : b; }, 0ull, ush);
    if (threadIdx.x == 0) out[row * os0] = (int64_t)(0xffffffffu - (uint32_t)(best & 0xffffffffull));
    return;
  }
  float m = -INFINITY;
  for (int64_t j = j0; j < j1; j++) {
    const float zv = r.z(j);
    if (isfinite(zv) && zv > m) m = zv;
  }
  r.m = st_reduce(m, [](float a, float b) { return a > b ? a : b; }, -INFINITY, fsh);
  if (r.m == -INFINITY) { /* no finite logit: block-uniform */
    if (threadIdx.x == 0) {
      kc_flag(flag, KILN__K_SAMPLE_TOKENS);
      out[row * os0] = 0;
    }
    return;
  }
  if (top_k > 0 && top_k < V) r.kk = st_select(r, j0, j1, false, (double)top_k, hist, ush, dsh);
  if (top_p < 1) {
    unsigned long long mine = 0;
    for (int64_t j = j0; j < j1; j++) {
      const float zv = r.z(j);
      if (r.kept(zv)) mine += r.w(zv);
    }
    const unsigned long long S = st_reduce(mine, [](unsigned long long a, unsigned long long b) { return a + b; },
                                           0ull, ush);
    r.kp = st_select(r, j0, j1, true, top_p * (double)S, hist, ush, dsh);
  }
  unsigned long long mine = 0;
  for (int64_t j = j0; j < j1; j++) {
    const float zv = r.z(j);
    if (r.kept(zv)) mine += r.w(zv);
  }
  /* exclusive scan of the threads' sums, in thread order (= index order) */
  const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
  unsigned long long inc = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  __syncthreads();
  if (lane == 31) ush[wp] = inc;
  __syncthreads();
  if (wp == 0) {
    unsigned long long x = lane < (int)(blockDim.x >> 5) ? ush[lane] : 0ull, xi = x;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned long long y = __shfl_up_sync(0xffffffffu, xi, o);
      if (lane >= o) xi += y;
    }
    ush[lane] = xi - x; /* exclusive prefix of warp sums */
    if (lane == 31) hist[0] = xi;  /* the total W */
  }
  __syncthreads();
  const unsigned long long excl = ush[wp] + inc - mine, W = hist[0];
  const uint64_t seed = (uint64_t)rng[0], off = (uint64_t)rng[rs];
  const kc_u32x4 wd = kc_philox(seed, off + (uint64_t)row / 2);
  const double u = kc_u01_f64(wd.x[2 * (row % 2)], wd.x[2 * (row % 2) + 1]);
  unsigned long long t = (unsigned long long)(u * (double)W);
  if (t >= W) t = W - 1; /* W >= 2^32: the maximum weighs 2^32 */
  if (mine > 0 && t >= excl && t < excl + mine) { /* exactly one thread */
    unsigned long long cdf = excl;
    for (int64_t j = j0; j < j1; j++) {
      const float zv = r.z(j);
      if (!r.kept(zv)) continue;
      cdf += r.w(zv);
      if (cdf > t) {
        out[row * os0] = j;
        break;
      }
    }
  }
}

kiln_status sample_tokens(kiln__cuda_dev *d, const kiln__kargs *a) {
  const kiln__view *l = &a->in[0], *rng = &a->in[1], *o = &a->out[0];
  const int64_t N = l->shape[0], V = l->shape[1];
  if (N == 0) return KILN_OK;
  if (N > 0x7fffffffLL)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_sample_tokens: %lld rows exceed one launch", (long long)N);
  const bool greedy = a->s[0] == 0; /* the argmax; no rng (in1 absent) */
  const float inv = greedy ? 0.f : (float)(1.0 / a->s[0]);
  KC_SWITCH_FLOAT(l->dtype, T,
                  return kiln_set_error(KILN_ERR_DTYPE, "kiln_sample_tokens: dtype %s has no cuda kernel",
                                        kiln_dtype_name(l->dtype)),
                  sample_k<T><<<(unsigned)N, ST_THREADS, 0, d->stream>>>(
                      (const T *)l->data, l->strides[0], l->strides[1], V, (int64_t *)o->data, o->strides[0],
                      greedy ? NULL : (const int64_t *)rng->data, greedy ? 0 : rng->strides[0], inv, a->i[0],
                      a->s[1], (int)greedy, d->err_flag))
  return kiln__cuda_launched("sample_tokens");
}

/* ---- ADD_LAYER_NORM ---- */

enum { LN_THREADS = 256 };

/* One block per row: s = x + r rounded to T and stored, then mean and variance of the
** stored s (two passes, f32 for the 16-bit types and f32, f64 for f64), then y. */
template <class T>
__global__ void __launch_bounds__(LN_THREADS)
    add_ln_k(const T *__restrict__ x, int64_t xs0, int64_t xs1, const T *__restrict__ r, int64_t rs0, int64_t rs1,
             const T *__restrict__ w, int64_t ws, const T *__restrict__ b, int64_t bs, T *y, int64_t ys0, int64_t ys1,
             T *s, int64_t ss0, int64_t ss1, int64_t N, double eps) {
  typedef typename kc_traits<T>::acc A;
  __shared__ A sh[32];
  const int64_t i = blockIdx.x;
  const T *xr = x + i * xs0, *rr = r + i * rs0;
  T *sr = s + i * ss0, *yr = y + i * ys0;
  A sum = 0;
  for (int64_t j = threadIdx.x; j < N; j += blockDim.x) {
    const T v = kc_st<T, A>((A)kc_ld<T>(xr[j * xs1]) + (A)kc_ld<T>(rr[j * rs1]));
    sr[j * ss1] = v;
    sum += (A)kc_ld<T>(v);
  }
  const A mean = st_reduce(sum, [](A p, A q) { return p + q; }, (A)0, sh) / (A)N;
  A sq = 0;
  for (int64_t j = threadIdx.x; j < N; j += blockDim.x) { /* this thread's own stores */
    const A d = (A)kc_ld<T>(sr[j * ss1]) - mean;
    sq += d * d;
  }
  const A var = st_reduce(sq, [](A p, A q) { return p + q; }, (A)0, sh) / (A)N;
  const A rstd = (A)1 / sqrt(var + (A)eps);
  for (int64_t j = threadIdx.x; j < N; j += blockDim.x) {
    A v = ((A)kc_ld<T>(sr[j * ss1]) - mean) * rstd;
    if (w) v *= (A)kc_ld<T>(w[j * ws]);
    if (b) v += (A)kc_ld<T>(b[j * bs]);
    yr[j * ys1] = kc_st<T, A>(v);
  }
}

kiln_status add_layer_norm(kiln__cuda_dev *d, const kiln__kargs *a) {
  const kiln__view *x = &a->in[0], *r = &a->in[1], *y = &a->out[0], *sm = &a->out[1];
  const kiln__view *w = (a->i[0] & 1) ? &a->in[2] : NULL;
  const kiln__view *b = (a->i[0] & 2) ? &a->in[(a->i[0] & 1) ? 3 : 2] : NULL;
  const int64_t R = x->shape[0], N = x->shape[1];
  if (R == 0 || N == 0) return KILN_OK;
  if (R > 0x7fffffffLL)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_add_layer_norm: %lld rows exceed one launch", (long long)R);
  KC_SWITCH_FLOAT(x->dtype, T,
                  return kiln_set_error(KILN_ERR_DTYPE, "kiln_add_layer_norm: dtype %s has no cuda kernel",
                                        kiln_dtype_name(x->dtype)),
                  add_ln_k<T><<<(unsigned)R, LN_THREADS, 0, d->stream>>>(
                      (const T *)x->data, x->strides[0], x->strides[1], (const T *)r->data, r->strides[0],
                      r->strides[1], w ? (const T *)w->data : NULL, w ? w->strides[0] : 0,
                      b ? (const T *)b->data : NULL, b ? b->strides[0] : 0, (T *)y->data, y->strides[0],
                      y->strides[1], (T *)sm->data, sm->strides[0], sm->strides[1], N, a->s[0]))
  return kiln__cuda_launched("add_layer_norm");
}

/* ---- LINEAR_DECODE ---- */

enum { LD_WARPS = 8, LD_MAXM = 16, LD_ROWS = 2 };

template <class T> struct ld_vec; /* 16 bytes of T as floats */
template <> struct ld_vec<__nv_bfloat16> {
  enum { N = 8 };
  static __device__ __forceinline__ void load(const __nv_bfloat16 *p, float *f) {
    const uint4 u = *reinterpret_cast<const uint4 *>(p);
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const float2 v = __bfloat1622float2(h[i]);
      f[2 * i] = v.x, f[2 * i + 1] = v.y;
    }
  }
};
template <> struct ld_vec<__half> {
  enum { N = 8 };
  static __device__ __forceinline__ void load(const __half *p, float *f) {
    const uint4 u = *reinterpret_cast<const uint4 *>(p);
    const __half2 *h = reinterpret_cast<const __half2 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const float2 v = __half22float2(h[i]);
      f[2 * i] = v.x, f[2 * i + 1] = v.y;
    }
  }
};
template <> struct ld_vec<float> {
  enum { N = 4 };
  static __device__ __forceinline__ void load(const float *p, float *f) {
    const float4 v = *reinterpret_cast<const float4 *>(p);
    f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
  }
};

template <class T, int MM>
__global__ void __launch_bounds__(LD_WARPS * 32)
    linear_decode_k(const T *__restrict__ x, int64_t xs, const T *__restrict__ w, int64_t ws, const T *__restrict__ b,
                    int64_t bs, T *y, int64_t ys0, int64_t ys1, int M, int64_t N, int64_t K, int gelu) {
  enum { V = ld_vec<T>::N };
  const int lane = threadIdx.x & 31;
  const int64_t n = (int64_t)blockIdx.x * LD_WARPS + (threadIdx.x >> 5);
  if (n >= N) return; /* warp-uniform; no block barrier below */
  float acc[MM];
#pragma unroll
  for (int m = 0; m < MM; m++) acc[m] = 0.f;
  const T *wr = w + n * ws;
#pragma unroll 2
  for (int64_t k = (int64_t)lane * V; k < K; k += 32 * V) {
    float wf[V], xf[V];
    ld_vec<T>::load(wr + k, wf);
#pragma unroll
    for (int m = 0; m < MM; m++) {
      if (m < M) {
        ld_vec<T>::load(x + m * xs + k, xf);
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < V; e++) s = fmaf(xf[e], wf[e], s);
        acc[m] += s;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MM; m++) acc[m] = kc_warp_reduce(acc[m], [](float p, float q) { return p + q; });
  if (lane != 0) return;
  const float bv = b ? (float)kc_ld<T>(b[n * bs]) : 0.f;
#pragma unroll
  for (int m = 0; m < MM; m++) {
    if (m < M) {
      const T r = kc_st<T, float>(acc[m] + bv); /* rounded as the linear's output, */
      float v = (float)kc_ld<T>(r);
      if (gelu) /* then kiln_gelu_tanh of it, as cuda_elementwise.cu's F_gelu_tanh */
        v = 0.5f * v * (1.f + tanhf(0.79788456080286535588f * (v + 0.044715f * v * v * v)));
      y[m * ys0 + n * ys1] = gelu ? kc_st<T, float>(v) : r;
    }
  }
}

template <class T> kiln_status linear_decode_run(kiln__cuda_dev *d, const kiln__kargs *a) {
  const kiln__view *x = &a->in[0], *w = &a->in[1], *y = &a->out[0];
  const kiln__view *b = (a->i[0] & 1) ? &a->in[2] : NULL;
  const int M = (int)x->shape[0];
  const int64_t K = x->shape[1], N = w->shape[0];
  const unsigned blocks = (unsigned)((N + LD_WARPS - 1) / LD_WARPS);
#define LD_LAUNCH(MM)                                                                                              \
  linear_decode_k<T, MM><<<blocks, LD_WARPS * 32, 0, d->stream>>>(                                                 \
      (const T *)x->data, x->strides[0], (const T *)w->data, w->strides[0], b ? (const T *)b->data : NULL,         \
      b ? b->strides[0] : 0, (T *)y->data, y->strides[0], y->strides[1], M, N, K, (int)a->i[1])
  if (M == 1) LD_LAUNCH(1);
  else if (M <= 4) LD_LAUNCH(4);
  else if (M <= 8) LD_LAUNCH(8);
  else LD_LAUNCH(16);
#undef LD_LAUNCH
  return kiln__cuda_launched("linear_decode");
}

bool ld_aligned(const kiln__view &v) {
  const int64_t es = (int64_t)kc_size(v.dtype);
  return v.strides[1] == 1 && ((uintptr_t)v.data % 16) == 0 && ((v.strides[0] * es) % 16) == 0;
}

bool linear_decode_supports(const kiln__kargs *a) {
  const kiln__view &x = a->in[0], &w = a->in[1];
  const kiln_dtype dt = x.dtype;
  if (dt != KILN_F32 && dt != KILN_F16 && dt != KILN_BF16) return false;
  if (w.dtype != dt || a->out[0].dtype != dt || x.ndim != 2 || w.ndim != 2) return false;
  if (a->n_in > 2 && a->in[2].dtype != dt) return false;
  const int64_t vec = 16 / (int64_t)kc_size(dt);
  if (x.shape[0] < 1 || x.shape[0] > LD_MAXM || x.shape[1] != w.shape[1] || x.shape[1] % vec != 0) return false;
  /* measured on the H200 (GPT-2 124M bf16 decode, bench-gpt2): at 1 row this kernel beats
  ** cuBLAS (937.8 against 773.3 tokens/s), at 16 cuBLAS wins (12,126 against 7,567: each
  ** warp here reloads x for every column); above LD_ROWS rows the op composes cuBLAS */
  if (x.shape[0] > LD_ROWS) return false;
  if (w.shape[0] >= (int64_t)LD_WARPS * 0x7fffffffLL) return false;
  return ld_aligned(x) && ld_aligned(w); /* the output is a fresh (M, N) tensor */
}

kiln_status linear_decode(kiln__cuda_dev *d, const kiln__kargs *a) {
  switch (a->in[0].dtype) {
  case KILN_F32: return linear_decode_run<float>(d, a);
  case KILN_F16: return linear_decode_run<__half>(d, a);
  case KILN_BF16: return linear_decode_run<__nv_bfloat16>(d, a);
  default: return kiln_set_error(KILN_ERR_DTYPE, "kiln_linear_decode: dtype %s has no cuda kernel", kiln_dtype_name(a->in[0].dtype));
  }
}

} // namespace

extern "C" bool kiln__cuda_kv_supports(const kiln__kargs *a) {
  switch (a->op) {
  case KILN__K_INDEX_COPY:
    return kc_size(a->out[0].dtype) > 0 && a->in[0].dtype == a->out[0].dtype && a->in[1].dtype == KILN_I64;
  case KILN__K_KV_ATTENTION:
    return kc_is_float(a->in[0].dtype) && a->in[3].dtype == KILN_I64 && a->in[0].shape[3] <= KV_MAXD &&
           a->in[2].shape[3] <= KV_MAXD;
  case KILN__K_SAMPLE_TOKENS: /* the argmax packs an index in 32 bits */
    return kc_is_float(a->in[0].dtype) && (a->n_in < 2 || a->in[1].dtype == KILN_I64) &&
           a->out[0].dtype == KILN_I64 && a->in[0].shape[1] <= 0xffffffffLL;
  case KILN__K_LINEAR_DECODE: return linear_decode_supports(a);
  case KILN__K_ADD_LAYER_NORM: {
    for (int i = 0; i < a->n_in; i++)
      if (a->in[i].dtype != a->in[0].dtype) return false;
    return kc_is_float(a->in[0].dtype);
  }
  default: return false;
  }
}

extern "C" kiln_status kiln__cuda_kv(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  if (!kiln__cuda_kv_supports(a))
    return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln_%s: these dtypes or sizes have no cuda kernel",
                          kiln__kop_name(a->op));
  switch (a->op) {
  case KILN__K_INDEX_COPY: return index_copy(d, a);
  case KILN__K_KV_ATTENTION: return kv_attention(d, a);
  case KILN__K_SAMPLE_TOKENS: return sample_tokens(d, a);
  case KILN__K_ADD_LAYER_NORM: return add_layer_norm(d, a);
  case KILN__K_LINEAR_DECODE: return linear_decode(d, a);
  default: return KILN_ERR_UNSUPPORTED;
  }
}
