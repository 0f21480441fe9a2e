/*
** Decoding with a KV cache on CUDA (contracts: backend.h INDEX_COPY and KV_ATTENTION; CPU
** references: cpu/cpu_kv.c). Both read their positions and lengths on the device, so a
** decode step's launches are the same every token and the step can be captured once and
** replayed (src/nn/generate.c). A bad position never synchronizes: it sets the device's
** index flag (kc_flag) and the kernel skips (INDEX_COPY) or clamps (KV_ATTENTION) it.
**
** KV_ATTENTION is flash-decoding's inner loop without the split over blocks: one block of
** NW warps per query row (b, h, i); warp w takes the tiles of 32 keys w, w + NW, ...; in a
** tile lane t scores key j0 + t against q (held in shared memory, pre-scaled), the warp
** updates its running max and normaliser once per tile, and lane t accumulates output
** columns t, t + 32, ... (the tile's weights broadcast by shuffles). The NW partial
** (max, sum, acc) are merged through shared memory at the end. Accumulation in f32 (f64
** for f64). Keys past the row's length are never read, so a step over a cache of max_len
** slots costs what its valid prefix costs.
*/
#include "cuda_int.cuh"

#include <math.h>

namespace {

enum { NW = 8, KV_MAXD = 128, KV_CH = KV_MAXD / 32 };

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
  __shared__ A qsh[KV_MAXD];
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
  const T *qr = q + b * p.qs[0] + h * p.qs[1] + i * p.qs[2];
  for (int e = threadIdx.x; e < p.D; e += NW * 32) qsh[e] = (A)kc_ld<T>(qr[e * p.qs[3]]) * (A)p.scale;
  __syncthreads();
  const T *kb = k + b * p.ks[0] + h * p.ks[1];
  const T *vb = v + b * p.vs[0] + h * p.vs[1];
  A m = -(A)INFINITY, l = 0, acc[KV_CH];
#pragma unroll
  for (int c = 0; c < KV_CH; c++) acc[c] = 0;
  for (int64_t j0 = (int64_t)w * 32; j0 < n; j0 += NW * 32) { /* warp-uniform: j0 and n */
    const int64_t j = j0 + lane;
    A s = -(A)INFINITY;
    if (j < n) {
      const T *kr = kb + j * p.ks[2];
      A dot = 0;
      for (int64_t e = 0; e < p.D; e++) dot += qsh[e] * (A)kc_ld<T>(kr[e * p.ks[3]]);
      s = dot;
    }
    const A tmax = kc_warp_reduce(s, [](A x, A y) { return x > y ? x : y; }); /* finite: lane 0's key exists */
    const A mn = m > tmax ? m : tmax;
    const A f = kv_exp<A>(m - mn); /* 0 on the first tile (m = -inf) */
    const A pj = j < n ? kv_exp<A>(s - mn) : (A)0;
    l = l * f + kc_warp_reduce(pj, [](A x, A y) { return x + y; });
#pragma unroll
    for (int c = 0; c < KV_CH; c++) acc[c] *= f;
    const int cnt = (int)(n - j0 < 32 ? n - j0 : 32);
    for (int t = 0; t < cnt; t++) {
      const A pw = __shfl_sync(0xffffffffu, pj, t);
      const T *vr = vb + (j0 + t) * p.vs[2];
#pragma unroll
      for (int c = 0; c < KV_CH; c++) {
        const int e = lane + 32 * c;
        if (e < p.Dv) acc[c] += pw * (A)kc_ld<T>(vr[e * p.vs[3]]);
      }
    }
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

} // namespace

extern "C" bool kiln__cuda_kv_supports(const kiln__kargs *a) {
  switch (a->op) {
  case KILN__K_INDEX_COPY:
    return kc_size(a->out[0].dtype) > 0 && a->in[0].dtype == a->out[0].dtype && a->in[1].dtype == KILN_I64;
  case KILN__K_KV_ATTENTION:
    return kc_is_float(a->in[0].dtype) && a->in[3].dtype == KILN_I64 && a->in[0].shape[3] <= KV_MAXD &&
           a->in[2].shape[3] <= KV_MAXD;
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
  default: return KILN_ERR_UNSUPPORTED;
  }
}
