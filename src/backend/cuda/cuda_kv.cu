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
** at M = 1..16 reads the same bytes but through tiles sized for large M. 16-bit weights
** above 2 rows take ldm_k instead (tensor cores, x's rows as the mma's A), and KV_ATTENTION
** has a 16-bit path for head dims 32/64/128 (kv_att_v) that can also append the step's new
** key and value (kiln_kv_attention_append). All of them launch with PDL (pdl_launch).
*/
#include "cuda_int.cuh"
#include "philox.cuh"

#include <math.h>
#include <stdlib.h>
#include <string.h>

namespace {

enum { NW = 16, KV_MAXD = 128, KV_CH = KV_MAXD / 32 };

/* ---- programmatic dependent launch (PDL, sm_90+) ----
** A decode step is ~100 small kernels in a row, and between two of them the GPU idles while
** the first drains and the second launches. The kernels here that take part (INDEX_COPY,
** SAMPLE_TOKENS, ADD_LAYER_NORM, KV_ATTENTION's 16-bit path, LINEAR_DECODE's tensor-core
** kernel: a decode step's chain but for the embeddings and the position's update) are launched with
** programmatic stream serialization: such a kernel may start while the one before it still
** runs, so each waits (griddepcontrol.wait: the previous grid complete, its writes visible)
** before it reads or writes anything a previous kernel may touch, and lets its own
** dependents launch at once (launch_dependents). What it does before the wait is safe
** whatever ran before: LINEAR_DECODE prefetches its weight rows into L2 (a prefetch moves
** no data into the SM, and L2 is where writes land, so a weight written just before is
** still read right), so a weight streams from memory while the kernel before it runs.
** Launched without the attribute (or on an older device), the wait returns at once.
** KILN_PDL=0 turns the attribute off (an A/B switch). */
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
/* bytes (a multiple of 16, p 16-byte aligned) of global memory into L2, no data returned */
__device__ __forceinline__ void l2_prefetch(const void *p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

bool pdl_on(int device) {
  static const bool env = !kc_env_zero("KILN_PDL");
  static signed char major[KC_MAX_DEV];
  if (!env || device < 0 || device >= KC_MAX_DEV) return false;
  if (major[device] == 0) {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      cudaGetLastError();
      v = -1;
    }
    major[device] = (signed char)(v > 0 ? v : -1);
  }
  return major[device] >= 9;
}

/* k<<<grid, block, 0, stream>>>(args...), with the PDL attribute where pdl_on. */
template <class... P, class... A>
kiln_status pdl_launch(kiln__cuda_dev *d, int device, void (*k)(P...), unsigned grid, unsigned block, const char *what,
                       A... args) {
  if (!pdl_on(device)) {
    k<<<grid, block, 0, d->stream>>>(args...);
    return kiln__cuda_launched(what);
  }
  cudaLaunchConfig_t cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = 0;
  cfg.stream = d->stream;
  cudaLaunchAttribute at[1];
  memset(at, 0, sizeof at);
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, k, ((P)args)...);
  if (e != cudaSuccess) return kiln__cuda_err(e, what);
  return kiln__cuda_launched(what);
}


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
  pdl_trigger();
  pdl_wait();
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
#define IC(U) pdl_launch(d, a->device, index_copy_k<U>, (unsigned)blocks, KC_THREADS, "index_copy", (const U *)src->data, ip, (U *)dst->data, p, d->err_flag)
  switch (kc_size(dst->dtype)) {
  case 1: return IC(uint8_t);
  case 2: return IC(uint16_t);
  case 4: return IC(uint32_t);
  case 8: return IC(uint64_t);
  default: return kiln_set_error(KILN_ERR_DTYPE, "kiln_index_copy_: dtype %s has no cuda kernel", kiln_dtype_name(dst->dtype));
  }
#undef IC
}

/* ---- KV_ATTENTION ---- */

struct KvArgs {
  int64_t H, Tq, M, D, Dv;
  int64_t qs[4], ks[4], vs[4], os[4];
  int64_t ls, nlen; /* len's stride and element count (1 or B) */
  double scale;
  int64_t ns[5]; /* append (kv_att_v only): kv_new's strides */
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

/* The 16-bit fast path (D == Dv = 8 LG, LG = 4, 8 or 16: head dims 32, 64, 128; unit
** element strides, 16-byte aligned rows): LG lanes hold a key row, 8 elements each from one
** 16-byte load, so a warp scores 32 / LG keys per step (4 at GPT-2's 64) with an LG-lane
** sum, and a block of NW warps has NW * 32 / LG keys in flight; two steps' loads are issued
** before their math. Each lane group keeps its own running (max, sum, 8 output columns);
** the groups of a warp merge by shuffles, the warps through shared memory, as kv_att. */
template <class T, int LG>
__global__ void __launch_bounds__(NW * 32)
    kv_att_v(const T *__restrict__ q, const T *__restrict__ k, const T *__restrict__ v, T *o,
             const int64_t *__restrict__ len, KvArgs p, int *flag, const T *__restrict__ kn, T *kw, T *vw) {
  enum { KPW = 32 / LG, NG = NW * KPW, D = 8 * LG };
  __shared__ float wm[NW], wl[NW];
  __shared__ float wacc[NW][D];
  const int64_t r = blockIdx.x;
  const int64_t b = r / (p.H * p.Tq), h = (r / p.Tq) % p.H, i = r % p.Tq;
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, sub = lane % LG, grp = lane / LG;
  pdl_trigger();
  pdl_wait();
  int64_t L = len[(p.nlen == 1 ? 0 : b) * p.ls];
  if (L < 0 || L > p.M) {
    if (threadIdx.x == 0) kc_flag(flag, KILN__K_KV_ATTENTION);
    L = L < 0 ? 0 : p.M;
  }
  const int64_t n = L - p.Tq + i + 1; /* keys 0 .. n-1 */
  /* append (kn set; Tq == 1): the new key and value rows go to slot L - 1, and key n - 1 (that
  ** slot) is read from kn: nothing here reads what this kernel writes */
  const T *knr = kn ? kn + b * p.ns[1] + h * p.ns[2] + i * p.ns[3] + 8 * sub : NULL;
  if (kn && L < 1) {
    if (threadIdx.x == 0) kc_flag(flag, KILN__K_KV_ATTENTION);
  } else if (kn && w == 0 && grp == 0 && L == len[(p.nlen == 1 ? 0 : b) * p.ls]) { /* L unclamped */
    const int64_t off = (L - 1) * p.ks[2] + 8 * sub;
    *reinterpret_cast<uint4 *>(kw + b * p.ks[0] + h * p.ks[1] + off) = *reinterpret_cast<const uint4 *>(knr);
    *reinterpret_cast<uint4 *>(vw + b * p.vs[0] + h * p.vs[1] + (L - 1) * p.vs[2] + 8 * sub) =
        *reinterpret_cast<const uint4 *>(knr + p.ns[0]);
  }
  float qf[8], tmp[8];
  ld_vec<T>::load(q + b * p.qs[0] + h * p.qs[1] + i * p.qs[2] + 8 * sub, qf);
#pragma unroll
  for (int e = 0; e < 8; e++) qf[e] *= (float)p.scale;
  const T *kb = k + b * p.ks[0] + h * p.ks[1] + 8 * sub, *vb = v + b * p.vs[0] + h * p.vs[1] + 8 * sub;
  float m = -INFINITY, l = 0.f, acc[8];
#pragma unroll
  for (int e = 0; e < 8; e++) acc[e] = 0.f;
  for (int64_t j0 = (int64_t)w * KPW + grp; j0 - grp < n; j0 += 2 * NG) { /* warp-uniform bound */
    uint4 kr[2], vr[2];
#pragma unroll
    for (int u = 0; u < 2; u++) {
      const int64_t j = j0 + u * NG;
      const bool in = j < n, nw = knr && j == n - 1;
      kr[u] = in ? *reinterpret_cast<const uint4 *>(nw ? knr : kb + j * p.ks[2]) : make_uint4(0, 0, 0, 0);
      vr[u] = in ? *reinterpret_cast<const uint4 *>(nw ? knr + p.ns[0] : vb + j * p.vs[2]) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 2; u++) {
      const bool in = j0 + u * NG < n;
      ld_vec<T>::load(reinterpret_cast<const T *>(&kr[u]), tmp);
      float sc = 0.f;
#pragma unroll
      for (int e = 0; e < 8; e++) sc = fmaf(qf[e], tmp[e], sc);
#pragma unroll
      for (int off = LG / 2; off > 0; off >>= 1) sc += __shfl_xor_sync(0xffffffffu, sc, off);
      if (in) { /* group-uniform */
        ld_vec<T>::load(reinterpret_cast<const T *>(&vr[u]), tmp);
        const float mn = m > sc ? m : sc;
        const float f = __expf(m - mn), pj = __expf(sc - mn); /* f = 0 on the first key */
        l = l * f + pj;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[e] = acc[e] * f + pj * tmp[e];
        m = mn;
      }
    }
  }
  /* the warp's KPW groups into one (lanes of one sub across the groups) */
#pragma unroll
  for (int off = LG; off < 32; off <<= 1) {
    const float mo = __shfl_xor_sync(0xffffffffu, m, off), lo = __shfl_xor_sync(0xffffffffu, l, off);
    const float mn = m > mo ? m : mo;
    const float f = mn == -INFINITY ? 0.f : __expf(m - mn), fo = mn == -INFINITY ? 0.f : __expf(mo - mn);
    l = l * f + lo * fo;
#pragma unroll
    for (int e = 0; e < 8; e++) acc[e] = acc[e] * f + __shfl_xor_sync(0xffffffffu, acc[e], off) * fo;
    m = mn;
  }
  if (lane == 0) wm[w] = m, wl[w] = l;
  if (grp == 0)
#pragma unroll
    for (int e = 0; e < 8; e++) wacc[w][8 * sub + e] = acc[e];
  __syncthreads();
  if (threadIdx.x >= D) return;
  float mx = -INFINITY;
#pragma unroll
  for (int u = 0; u < NW; u++) mx = wm[u] > mx ? wm[u] : mx;
  float tot = 0.f, y = 0.f;
#pragma unroll
  for (int u = 0; u < NW; u++) { /* a warp with no key has m = -inf: weight 0 */
    const float f = wm[u] == -INFINITY ? 0.f : __expf(wm[u] - mx);
    tot += wl[u] * f;
    y += wacc[u][threadIdx.x] * f;
  }
  o[b * p.os[0] + h * p.os[1] + i * p.os[2] + threadIdx.x * p.os[3]] = kc_st<T, float>(tot > 0 ? y / tot : 0.f);
}

/* kv_att_v's conditions: 16-bit, D == Dv in {32, 64, 128}, unit element strides, every row
** start a multiple of 16 bytes. */
bool kv_vec_ok(const kiln__view *q, const kiln__view *k, const kiln__view *v) {
  if (q->dtype != KILN_BF16 && q->dtype != KILN_F16) return false;
  if (k->dtype != q->dtype || v->dtype != q->dtype) return false;
  const int64_t D = q->shape[3];
  if (v->shape[3] != D || (D != 32 && D != 64 && D != 128)) return false;
  const kiln__view *t[3] = {q, k, v};
  for (int i = 0; i < 3; i++) {
    if (t[i]->strides[3] != 1 || (uintptr_t)t[i]->data % 16) return false;
    for (int d = 0; d < 3; d++)
      if (t[i]->shape[d] > 1 && t[i]->strides[d] % 8) return false;
  }
  return true;
}

/* the append form (KV_ATTENTION's i1): kv_att_v's conditions, one query a row, kv_new
** (in4) of the same dtype with unit element stride and 16-byte aligned rows */
bool kv_append_ok(const kiln__kargs *a) {
  const kiln__view *q = &a->in[0], *kn = &a->in[4];
  if (a->n_in < 5 || q->shape[2] != 1 || !kv_vec_ok(q, &a->in[1], &a->in[2])) return false;
  if (kn->dtype != q->dtype || kn->ndim != 5 || kn->strides[4] != 1 || (uintptr_t)kn->data % 16) return false;
  for (int d = 0; d < 4; d++)
    if (kn->shape[d] > 1 && kn->strides[d] % 8) return false;
  return true;
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
  const bool app = a->i[1] != 0; /* supports() took it: kv_append_ok */
  for (int i = 0; i < 5; i++) p.ns[i] = app ? a->in[4].strides[i] : 0;
  if (app || kv_vec_ok(q, k, v)) {
#define KV_V(T, LG)                                                                                                \
  pdl_launch(d, a->device, kv_att_v<T, LG>, (unsigned)rows, NW * 32, "kv_attention", (const T *)q->data,           \
             (const T *)k->data, (const T *)v->data, (T *)o->data, lp, p, d->err_flag,                             \
             app ? (const T *)a->in[4].data : (const T *)NULL, (T *)k->data, (T *)v->data)
    const int64_t D = p.D;
    if (q->dtype == KILN_BF16)
      return D == 32 ? KV_V(__nv_bfloat16, 4) : D == 64 ? KV_V(__nv_bfloat16, 8) : KV_V(__nv_bfloat16, 16);
    return D == 32 ? KV_V(__half, 4) : D == 64 ? KV_V(__half, 8) : KV_V(__half, 16);
#undef KV_V
  }
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
__device__ uint32_t st_select(const StRow<T> &r, int64_t j0, int64_t j1, int64_t ch, bool mass, double target,
                              unsigned long long *hist, unsigned long long *ush, int *dsh) {
  uint32_t prefix = 0;
  unsigned long long above = 0;
  for (int level = 3; level >= 0; level--) {
    const int shift = 8 * level;
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    /* Warp-aggregated: the lanes that fall in one bin add once (the top byte of a row's keys
    ** is nearly always the same, so per-element atomics on 1024 threads serialized on one
    ** bin: a sampled step took 0.85 ms against the greedy 0.34 at batch 1 on the H200). The
    ** trip count is block-uniform (ch), so every lane of a warp runs the ballots. Integer
    ** sums: the same histogram, whatever the order. */
    for (int64_t t = 0; t < ch; t++) {
      const int64_t j = j0 + t;
      bool part = false;
      uint32_t bin = 0;
      unsigned long long val = 0;
      if (j < j1) {
        const float zv = r.z(j);
        const uint32_t k = st_key(zv);
        if (r.kept(zv) && (level == 3 || (k >> (shift + 8)) == (prefix >> (shift + 8)))) {
          part = true;
          bin = (k >> shift) & 255u;
          val = mass ? r.w(zv) : 1ull;
        }
      }
      unsigned todo = __ballot_sync(0xffffffffu, part);
      while (todo) { /* warp-uniform: one bin a round */
        const int lead = __ffs(todo) - 1;
        const uint32_t bb = __shfl_sync(0xffffffffu, bin, lead);
        const bool mine = part && bin == bb;
        const unsigned grp = __ballot_sync(0xffffffffu, mine);
        unsigned long long sum = __popc(grp);
        if (mass) sum = kc_warp_reduce(mine ? val : 0ull, [](unsigned long long x, unsigned long long y) { return x + y; });
        if ((threadIdx.x & 31) == lead) atomicAdd(&hist[bb], sum);
        todo &= ~grp;
      }
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
  pdl_trigger();
  pdl_wait();
  const int64_t row = blockIdx.x;
  StRow<T> r;
  r.p = logits + row * ls0, r.s = ls1, r.inv = inv, r.m = -INFINITY, r.kk = 0, r.kp = 0;
  const int64_t ch = (V + blockDim.x - 1) / blockDim.x;
  const int64_t j0 = min(V, (int64_t)threadIdx.x * ch), j1 = min(V, j0 + ch);
  if (greedy) { /* the argmax: the key (NaN largest) above, the complemented index below, so
                ** the largest pair is the first maximum whatever the order it is met in (0, no
                ** element, never wins); so the threads stride the row (coalesced) */
    unsigned long long best = 0;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
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
  if (top_k > 0 && top_k < V) r.kk = st_select(r, j0, j1, ch, false, (double)top_k, hist, ush, dsh);
  if (top_p < 1) {
    unsigned long long mine = 0;
    for (int64_t j = j0; j < j1; j++) {
      const float zv = r.z(j);
      if (r.kept(zv)) mine += r.w(zv);
    }
    const unsigned long long S = st_reduce(mine, [](unsigned long long a, unsigned long long b) { return a + b; },
                                           0ull, ush);
    r.kp = st_select(r, j0, j1, ch, true, top_p * (double)S, hist, ush, dsh);
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
                  return pdl_launch(d, a->device, sample_k<T>, (unsigned)N, ST_THREADS, "sample_tokens",
                      (const T *)l->data, l->strides[0], l->strides[1], V, (int64_t *)o->data, o->strides[0],
                      greedy ? NULL : (const int64_t *)rng->data, greedy ? 0 : rng->strides[0], inv, a->i[0],
                      a->s[1], (int)greedy, d->err_flag))
  return KILN_OK;
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
  pdl_trigger();
  pdl_wait();
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

/* The 16-bit form for dense rows of N % 8 == 0, N <= 8 * LNV_MAX: a thread per 8 elements
** (one 16-byte load of x and of r), so the row stays in registers: one pass over memory and
** two block sums (the generic kernel re-reads s for the variance and for y; at GPT-2's 768
** its 256 threads hold 3 elements each). Same arithmetic: s rounded to T, the statistics of
** the rounded s in f32. */
enum { LNV_MAX = 1024 };

template <class T>
__global__ void __launch_bounds__(LNV_MAX)
    add_ln_v(const T *__restrict__ x, int64_t xs0, const T *__restrict__ r, int64_t rs0, const T *__restrict__ w,
             const T *__restrict__ b, T *y, int64_t ys0, T *s, int64_t ss0, int64_t N, float eps) {
  __shared__ float sh[32];
  pdl_trigger();
  pdl_wait();
  const int64_t i = blockIdx.x, j = (int64_t)threadIdx.x * 8;
  const bool in = j < N;
  float sv[8], t[8], sum = 0.f;
  alignas(16) T pk[8];
  if (in) {
    ld_vec<T>::load(x + i * xs0 + j, sv);
    ld_vec<T>::load(r + i * rs0 + j, t);
#pragma unroll
    for (int e = 0; e < 8; e++) {
      pk[e] = kc_st<T, float>(sv[e] + t[e]);
      sv[e] = (float)kc_ld<T>(pk[e]);
      sum += sv[e];
    }
    *reinterpret_cast<uint4 *>(s + i * ss0 + j) = *reinterpret_cast<const uint4 *>(pk);
  }
  const float mean = st_reduce(sum, [](float p, float q) { return p + q; }, 0.f, sh) / (float)N;
  float sq = 0.f;
  if (in)
#pragma unroll
    for (int e = 0; e < 8; e++) sq += (sv[e] - mean) * (sv[e] - mean);
  const float var = st_reduce(sq, [](float p, float q) { return p + q; }, 0.f, sh) / (float)N;
  const float rstd = 1.f / sqrtf(var + eps);
  if (!in) return;
  float wf[8], bf[8];
  if (w) ld_vec<T>::load(w + j, wf);
  if (b) ld_vec<T>::load(b + j, bf);
#pragma unroll
  for (int e = 0; e < 8; e++) {
    float v = (sv[e] - mean) * rstd;
    if (w) v *= wf[e];
    if (b) v += bf[e];
    pk[e] = kc_st<T, float>(v);
  }
  *reinterpret_cast<uint4 *>(y + i * ys0 + j) = *reinterpret_cast<const uint4 *>(pk);
}

/* add_ln_v's conditions: 16-bit, unit element strides, 16-byte aligned rows. */
bool add_ln_vec_ok(const kiln__kargs *a, const kiln__view *w, const kiln__view *b) {
  const kiln__view *x = &a->in[0];
  if (x->dtype != KILN_BF16 && x->dtype != KILN_F16) return false;
  const int64_t N = x->shape[1];
  if (N % 8 || N > 8 * (int64_t)LNV_MAX) return false;
  const kiln__view *v[6] = {x, &a->in[1], &a->out[0], &a->out[1], w, b};
  for (int k = 0; k < 6; k++) {
    if (!v[k]) continue;
    const int last = v[k]->ndim - 1;
    if (v[k]->strides[last] != 1 || (uintptr_t)v[k]->data % 16) return false;
    if (last == 1 && v[k]->strides[0] % 8) return false;
  }
  return true;
}

kiln_status add_layer_norm(kiln__cuda_dev *d, const kiln__kargs *a) {
  const kiln__view *x = &a->in[0], *r = &a->in[1], *y = &a->out[0], *sm = &a->out[1];
  const kiln__view *w = (a->i[0] & 1) ? &a->in[2] : NULL;
  const kiln__view *b = (a->i[0] & 2) ? &a->in[(a->i[0] & 1) ? 3 : 2] : NULL;
  const int64_t R = x->shape[0], N = x->shape[1];
  if (R == 0 || N == 0) return KILN_OK;
  if (R > 0x7fffffffLL)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_add_layer_norm: %lld rows exceed one launch", (long long)R);
  if (add_ln_vec_ok(a, w, b)) {
    const unsigned threads = (unsigned)((N / 8 + 31) / 32 * 32);
#define LNV(T)                                                                                                     \
  pdl_launch(d, a->device, add_ln_v<T>, (unsigned)R, threads, "add_layer_norm", (const T *)x->data, x->strides[0],  \
             (const T *)r->data, r->strides[0], w ? (const T *)w->data : NULL, b ? (const T *)b->data : NULL,       \
             (T *)y->data, y->strides[0], (T *)sm->data, sm->strides[0], N, (float)a->s[0])
    return x->dtype == KILN_BF16 ? LNV(__nv_bfloat16) : LNV(__half);
#undef LNV
  }
  KC_SWITCH_FLOAT(x->dtype, T,
                  return kiln_set_error(KILN_ERR_DTYPE, "kiln_add_layer_norm: dtype %s has no cuda kernel",
                                        kiln_dtype_name(x->dtype)),
                  return pdl_launch(d, a->device, add_ln_k<T>, (unsigned)R, LN_THREADS, "add_layer_norm",
                      (const T *)x->data, x->strides[0], x->strides[1], (const T *)r->data, r->strides[0],
                      r->strides[1], w ? (const T *)w->data : NULL, w ? w->strides[0] : 0,
                      b ? (const T *)b->data : NULL, b ? b->strides[0] : 0, (T *)y->data, y->strides[0],
                      y->strides[1], (T *)sm->data, sm->strides[0], sm->strides[1], N, a->s[0]))
  return KILN_OK;
}

/* ---- LINEAR_DECODE ---- */

enum { LD_WARPS = 8, LD_MAXM = 16, LD_ROWS = 2 };

template <class T, int MM>
__global__ void __launch_bounds__(LD_WARPS * 32)
    linear_decode_k(const T *__restrict__ x, int64_t xs, const T *__restrict__ w, int64_t ws, const T *__restrict__ b,
                    int64_t bs, T *y, int64_t ys0, int64_t ys1, int M, int64_t N, int64_t K, int gelu) {
  enum { V = ld_vec<T>::N };
  const int lane = threadIdx.x & 31;
  const int64_t n = (int64_t)blockIdx.x * LD_WARPS + (threadIdx.x >> 5);
  if (n >= N) return; /* warp-uniform; no block barrier below */
  if (lane == 0) l2_prefetch(w + n * ws, (uint32_t)(K * (int64_t)sizeof(T))); /* before the wait: see pdl_wait */
  pdl_trigger();
  pdl_wait();
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
  pdl_launch(d, a->device, linear_decode_k<T, MM>, blocks, LD_WARPS * 32, "linear_decode", (const T *)x->data,     \
             x->strides[0], (const T *)w->data, w->strides[0], b ? (const T *)b->data : NULL, b ? b->strides[0] : 0, \
             (T *)y->data, y->strides[0], y->strides[1], M, N, K, (int)a->i[1])
  if (M == 1) return LD_LAUNCH(1);
  if (M <= 4) return LD_LAUNCH(4);
  if (M <= 8) return LD_LAUNCH(8);
  return LD_LAUNCH(16);
#undef LD_LAUNCH
}

/* The tensor-core form for 16-bit weights (LINEAR_DECODE's default for bf16/f16, any M <=
** 16): mma.sync m16n8k16 takes x's (up to) 16 rows as A and 8 weight rows as B, so every
** row of x costs the same weight pass and the f32 math is off the CUDA cores. A block is
** LDM_WARPS warps and G tiles of 8 output columns; its warps split K by 32-wide chunks
** (chunk c to warp c % LDM_WARPS) and sum through shared memory at the end, so a 768-wide
** weight row is read by 8 warps at once instead of one. Each lane loads 16 bytes of a
** weight row (row n0 + lane / 4, elements k0 + 8 (lane % 4) .. + 7) and the same 16 bytes of
** x rows lane / 4 and lane / 4 + 8: the mma's k order is a permutation of memory's (logical k
** 2q + e and 2q + 8 + e of lane group q are elements 8q + e and 8q + 2 + e for the first mma,
** 8q + 4 + e and 8q + 6 + e for the second), the same for A and B, so the dot products are
** unchanged and every load is a full 16 bytes. LDM_U chunks' loads are issued before their
** mmas (memory-level parallelism: a warp has LDM_U * G * 512 weight bytes in flight). */
enum { LDM_WARPS = 8, LDM_U = 4 };

template <class T> __device__ __forceinline__ void ldm_mma(float *c, const uint32_t *a, uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void ldm_mma<__nv_bfloat16>(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void ldm_mma<__half>(float *c, const uint32_t *a, uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* y (M, N) = x (M, K) w (N, K)^T + b, then GELU when gelu; K % 8 == 0, rows 16-byte aligned. */
template <class T, int G, bool HI>
__global__ void __launch_bounds__(LDM_WARPS * 32)
    ldm_k(const T *__restrict__ x, int64_t xs, const T *__restrict__ w, int64_t ws, const T *__restrict__ b,
          int64_t bs, T *y, int64_t ys0, int64_t ys1, int M, int64_t N, int64_t K, int gelu) {
  __shared__ float red[LDM_WARPS][G][32][4];
  const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
  const int64_t n0 = (int64_t)blockIdx.x * (8 * G);
  const int64_t nch = (K + 31) / 32;
  float acc[G][4];
#pragma unroll
  for (int t = 0; t < G; t++) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
  const T *xr0 = g < M ? x + (int64_t)g * xs : NULL, *xr1 = HI && g + 8 < M ? x + (int64_t)(g + 8) * xs : NULL;
  const T *wr[G];
#pragma unroll
  for (int t = 0; t < G; t++) wr[t] = n0 + 8 * t + g < N ? w + (n0 + 8 * t + g) * ws : NULL;
  if (threadIdx.x < 8 * G && n0 + threadIdx.x < N) /* this block's weight rows, before the wait (see pdl_wait) */
    l2_prefetch(w + (n0 + threadIdx.x) * ws, (uint32_t)(K * (int64_t)sizeof(T)));
  pdl_trigger();
  pdl_wait();
  const uint4 z = make_uint4(0, 0, 0, 0);
  for (int64_t c0 = wp; c0 < nch; c0 += (int64_t)LDM_WARPS * LDM_U) {
    uint4 wv[LDM_U][G], xa[LDM_U], xb[LDM_U];
#pragma unroll
    for (int u = 0; u < LDM_U; u++) { /* every load of LDM_U chunks first */
      const int64_t k = (c0 + (int64_t)u * LDM_WARPS) * 32 + 8 * q;
      const bool in = k < K; /* K % 8 == 0: a lane's 8 elements are all in or all out */
#pragma unroll
      for (int t = 0; t < G; t++) wv[u][t] = in && wr[t] ? __ldg(reinterpret_cast<const uint4 *>(wr[t] + k)) : z;
      xa[u] = in && xr0 ? *reinterpret_cast<const uint4 *>(xr0 + k) : z;
      xb[u] = HI && in && xr1 ? *reinterpret_cast<const uint4 *>(xr1 + k) : z;
    }
#pragma unroll
    for (int u = 0; u < LDM_U; u++) {
      const uint32_t a1[4] = {xa[u].x, xb[u].x, xa[u].y, xb[u].y}, a2[4] = {xa[u].z, xb[u].z, xa[u].w, xb[u].w};
#pragma unroll
      for (int t = 0; t < G; t++) {
        ldm_mma<T>(acc[t], a1, wv[u][t].x, wv[u][t].y);
        ldm_mma<T>(acc[t], a2, wv[u][t].z, wv[u][t].w);
      }
    }
  }
#pragma unroll
  for (int t = 0; t < G; t++)
#pragma unroll
    for (int r = 0; r < 4; r++) red[wp][t][lane][r] = acc[t][r];
  __syncthreads();
  /* output (m, n0 + 8 t + cc) is c[(m / 8) * 2 + cc % 2] of lane (m % 8) * 4 + cc / 2 */
  for (int e = threadIdx.x; e < G * 128; e += LDM_WARPS * 32) {
    const int t = e >> 7, m = (e >> 3) & 15, cc = e & 7;
    const int64_t n = n0 + 8 * t + cc;
    if (m >= M || n >= N) continue;
    const int ln = (m & 7) * 4 + (cc >> 1), r = (m >> 3) * 2 + (cc & 1);
    float s = 0.f;
#pragma unroll
    for (int u = 0; u < LDM_WARPS; u++) s += red[u][t][ln][r];
    const float bv = b ? (float)kc_ld<T>(b[n * bs]) : 0.f;
    const T o = kc_st<T, float>(s + bv); /* rounded as the linear's output, */
    float v = (float)kc_ld<T>(o);
    if (gelu) /* then kiln_gelu_tanh of it, as cuda_elementwise.cu's F_gelu_tanh */
      v = 0.5f * v * (1.f + tanhf(0.79788456080286535588f * (v + 0.044715f * v * v * v)));
    y[m * ys0 + n * ys1] = gelu ? kc_st<T, float>(v) : o;
  }
}

/* Which kernel: 16-bit weights take ldm_k above LD_ROWS rows and the warp-per-column
** kernel at 1-2 (f32 always the warp kernel, up to LD_ROWS). Measured on the H200 (bench-gpt2
** greedy, 18:40 run): at batch 1 the warp kernel gave 3,016.5 tokens/s (without PDL) against
** ldm_k's 2,945.9 (with it); at 16 ldm_k gave 39,518 against cuBLAS's 26,641. A/B switches,
** KILN_LINEAR_DECODE=warp: the warp kernel only (above 2 rows the op composes cuBLAS);
** =mma: ldm_k at every row count. */
enum { LD_AUTO, LD_WARP_ONLY, LD_MMA_ALWAYS };
int ld_mode(void) {
  static int v = -1;
  if (v < 0) {
    const int mode = kiln__knob_choice("KILN_LINEAR_DECODE", 0); /* 1, 0, warp, mma */
    v = mode == 2 ? LD_WARP_ONLY : mode == 3 ? LD_MMA_ALWAYS : LD_AUTO;
  }
  return v;
}
bool ld_use_mma(kiln_dtype dt, int64_t M) {
  if (dt == KILN_F32 || ld_mode() == LD_WARP_ONLY) return false;
  return ld_mode() == LD_MMA_ALWAYS || M > LD_ROWS;
}

template <class T> kiln_status linear_decode_mma(kiln__cuda_dev *d, const kiln__kargs *a) {
  const kiln__view *x = &a->in[0], *w = &a->in[1], *y = &a->out[0];
  const kiln__view *b = (a->i[0] & 1) ? &a->in[2] : NULL;
  const int M = (int)x->shape[0];
  const int64_t K = x->shape[1], N = w->shape[0];
  /* 4 column tiles a block where there are columns enough to fill the SMs several times
  ** over (the lm_head's 50257: x is then read once per 32 columns, not per 8) */
  const bool wide = N >= (int64_t)d->sm_count * 8 * 4 * 4;
  const int G = wide ? 4 : 1;
  const unsigned blocks = (unsigned)((N + 8 * G - 1) / (8 * G));
#define LDM_LAUNCH(GG, HH)                                                                                         \
  pdl_launch(d, a->device, ldm_k<T, GG, HH>, blocks, LDM_WARPS * 32, "linear_decode", (const T *)x->data,          \
             x->strides[0], (const T *)w->data, w->strides[0], b ? (const T *)b->data : NULL, b ? b->strides[0] : 0, \
             (T *)y->data, y->strides[0], y->strides[1], M, N, K, (int)a->i[1])
  if (wide) return M > 8 ? LDM_LAUNCH(4, true) : LDM_LAUNCH(4, false);
  return M > 8 ? LDM_LAUNCH(1, true) : LDM_LAUNCH(1, false);
#undef LDM_LAUNCH
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
  /* measured on the H200 (GPT-2 124M bf16 decode, bench-gpt2): at 1 row the warp kernel
  ** beats cuBLAS (937.8 against 773.3 tokens/s), at 16 cuBLAS wins (12,126 against 7,567:
  ** each warp reloads x for every column); so above LD_ROWS rows the warp kernel leaves the
  ** op to cuBLAS, while the tensor-core kernel (16-bit) takes up to 16 */
  if (!ld_use_mma(dt, x.shape[0]) && x.shape[0] > LD_ROWS) return false;
  if (w.shape[0] >= (int64_t)LD_WARPS * 0x7fffffffLL) return false;
  return ld_aligned(x) && ld_aligned(w); /* the output is a fresh (M, N) tensor */
}

kiln_status linear_decode(kiln__cuda_dev *d, const kiln__kargs *a) {
  switch (a->in[0].dtype) {
  case KILN_F32: return linear_decode_run<float>(d, a);
  case KILN_F16:
    return ld_use_mma(KILN_F16, a->in[0].shape[0]) ? linear_decode_mma<__half>(d, a) : linear_decode_run<__half>(d, a);
  case KILN_BF16:
    return ld_use_mma(KILN_BF16, a->in[0].shape[0]) ? linear_decode_mma<__nv_bfloat16>(d, a)
                                                     : linear_decode_run<__nv_bfloat16>(d, a);
  default: return kiln_set_error(KILN_ERR_DTYPE, "kiln_linear_decode: dtype %s has no cuda kernel", kiln_dtype_name(a->in[0].dtype));
  }
}

} // namespace

extern "C" bool kiln__cuda_kv_supports(const kiln__kargs *a) {
  switch (a->op) {
  case KILN__K_INDEX_COPY:
    return kc_size(a->out[0].dtype) > 0 && a->in[0].dtype == a->out[0].dtype && a->in[1].dtype == KILN_I64;
  case KILN__K_KV_ATTENTION:
    if (a->i[1] && !kv_append_ok(a)) return false; /* the op composes index_copy_ and kv_attention */
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
