/*
** ATTENTION and ATTENTION_BACKWARD on CUDA (contract: backend.h; the reference is the CPU's
** cpu/cpu_transformer.c, whose algorithm this follows).
**
** FlashAttention's scheme (Dao et al. 2022; the backward's split as in FlashAttention-2):
** no Tq x Tk matrix exists in global memory. A block of NW warps takes NW query rows of
** one (b, h), one warp a row; keys and values come through shared memory BK at a time,
** each lane scoring one key of the tile, and the row's running max m, normaliser l and
** output accumulator (lane e owns output columns e, e+32, ...) are rescaled by
** exp(m_old - m_new) when a tile raises the max. The forward writes lse = m + log l.
**
** The backward recomputes the probabilities P_ij = exp(s_ij - lse_i) and is deterministic
** (no atomics): one kernel per query row gives delta_i = sum_j P_ij Z_ij (dO_i . v_j) in a
** first sweep over the keys (the CPU's formula: the output O is not an input of the
** kernel) and dq_i = scale sum_j dS_ij k_j in a second; another, a warp per key row j,
** sweeps the query tiles for dv_j = sum_i P_ij Z_ij dO_i and dk_j = scale sum_i dS_ij q_i,
** with dS_ij = P_ij (Z_ij dO_i.v_j - delta_i). Z is dropout's keep factor (0 or 1/(1-p)),
** drawn from the Philox mapping backend.h gives, so the CPU and the GPU drop the same
** scores. Causal masking skips every key tile past a block's last query (forward, dq) and
** every query tile before a block's first key (dk, dv).
**
** Which kernel runs: f16/bf16 at head dim 32, 64, 96 or 128 without a mask or dropout (GPT-2's
** training case) goes to the FlashAttention-2 kernels of cuda_flash.cu (mma.sync, forward
** and backward; kiln__cuda_flash_fits says exactly what they take). What they do not cover
** runs here: the forward of f16/bf16 at head dim 64/128 with a mask or dropout on the WMMA
** kernel below (att_fwd_tc), and everything else (f32, f64, other head dims, every masked
** or dropout backward) on the CUDA-core kernels, f32 arithmetic for the 16-bit types and
** f64 for f32 and f64. Head dims up to 128 (KMAX_D); larger ones fall back to the CPU.
*/
#include "cuda_int.cuh"
#include "cuda_ew.cuh"
#include "philox.cuh"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <mma.h>
#include <type_traits>

namespace {

/* The accumulation type: f64 for f32 too, as the CPU computes in f64, so that f32 results
** are the exact result rounded (the first H200 run of the harness found f32 accumulation
** 1.5x past its f32 tolerance where cancellation leaves a result near 0); f32 for the
** 16-bit types (their tolerance is far looser), f64 for f64. */
template <class T> struct wide_acc { typedef typename kc_traits<T>::acc type; };
template <> struct wide_acc<float> { typedef double type; };

enum { NW = 4, BK = 32, KMAX_D = 128, KCH = KMAX_D / 32 };

struct AttArgs {
  int64_t B, H, Tq, Tk, D, Dv;
  int64_t qs[4], ks[4], vs[4], os[4], gs[4], ms[4], dqs[4], dks[4], dvs[4], ls[3];
  const void *mask;
  int mask_dt;
  bool causal, masked, dropout;
  double scale, keep, zscale;
  uint64_t seed, offset;
};

template <class A> __device__ __forceinline__ A mask_at(const AttArgs &p, int64_t b, int64_t h, int64_t i, int64_t j) {
  int64_t o = b * p.ms[0] + h * p.ms[1] + i * p.ms[2] + j * p.ms[3];
  switch (p.mask_dt) {
  case KILN_BOOL: return ((const bool *)p.mask)[o] ? (A)0 : -(A)INFINITY; /* true attends */
  case KILN_F32: return (A)((const float *)p.mask)[o];
  case KILN_F64: return (A)((const double *)p.mask)[o];
  case KILN_F16: return (A)__half2float(((const __half *)p.mask)[o]);
  case KILN_BF16: return (A)__bfloat162float(((const __nv_bfloat16 *)p.mask)[o]);
  default: return 0;
  }
}

/* Dropout's factor for score (b, h, i, j): 1/keep or 0 (cpu_transformer.c's kiln__att_z). */
template <class A> __device__ __forceinline__ A drop_z(const AttArgs &p, int64_t b, int64_t h, int64_t i, int64_t j) {
  uint64_t k = (uint64_t)(((b * p.H + h) * p.Tq + i) * p.Tk + j);
  kc_u32x4 w = kc_philox(p.seed, p.offset + k / 4);
  float u = kc_u01_f32(w.x[k % 4]);
  return (double)u < p.keep ? (A)p.zscale : (A)0;
}

template <class A> __device__ __forceinline__ A wmax(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
template <class A> __device__ __forceinline__ A wsum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

/* Rows [r0, r0 + BK) of a (T, n) slice at base with row stride rs and element stride es,
** into shared memory with row pitch pitch (zeros past T). */
template <class T, class A>
__device__ __forceinline__ void load_tile(A *dst, int pitch, const T *base, int64_t rs, int64_t es, int64_t r0,
                                          int64_t T_, int64_t n) {
  for (int64_t e = threadIdx.x; e < BK * n; e += blockDim.x) {
    int64_t t = e / n, c = e % n;
    dst[t * pitch + c] = r0 + t < T_ ? kc_ld<T>(base[(r0 + t) * rs + c * es]) : (A)0;
  }
}

/* ---------------------------------------------------------------- forward */
template <class T, class A>
__global__ void __launch_bounds__(NW * 32) att_fwd(const T *q, const T *k, const T *v, T *o, void *lse, int lse_dt,
                                                   AttArgs p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A *Ks = (A *)smem_raw;              /* BK x (D + 1): the pad keeps lanes on distinct banks */
  A *Vs = Ks + BK * (p.D + 1);        /* BK x Dv */
  A *Qs = Vs + BK * p.Dv;             /* NW x D */
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t nt = (p.Tq + NW - 1) / NW;
  const int64_t bh = blockIdx.x / nt, i_first = (blockIdx.x % nt) * NW;
  const int64_t b = bh / p.H, h = bh % p.H, i = i_first + warp;
  const bool valid = i < p.Tq;
  const T *qb = q + b * p.qs[0] + h * p.qs[1];
  const T *kb = k + b * p.ks[0] + h * p.ks[1];
  const T *vb = v + b * p.vs[0] + h * p.vs[1];
  if (valid)
    for (int64_t d = lane; d < p.D; d += 32) Qs[warp * p.D + d] = kc_ld<T>(qb[i * p.qs[2] + d * p.qs[3]]);
  int64_t i_last = i_first + NW - 1 < p.Tq ? i_first + NW - 1 : p.Tq - 1;
  int64_t jend_blk = p.causal && i_last + 1 < p.Tk ? i_last + 1 : p.Tk;
  int64_t jend = p.causal && i + 1 < p.Tk ? i + 1 : p.Tk;
  A acc[KCH];
#pragma unroll
  for (int c = 0; c < KCH; c++) acc[c] = 0;
  A m = -(A)INFINITY, l = 0;
  const A scale = (A)p.scale;
  for (int64_t j0 = 0; j0 < jend_blk; j0 += BK) {
    __syncthreads(); /* the previous tile is consumed (and Qs is written, the first time) */
    load_tile<T, A>(Ks, (int)p.D + 1, kb, p.ks[2], p.ks[3], j0, p.Tk, p.D);
    load_tile<T, A>(Vs, (int)p.Dv, vb, p.vs[2], p.vs[3], j0, p.Tk, p.Dv);
    __syncthreads();
    if (!valid || j0 >= jend) continue; /* a causal tile wholly past this row */
    const int64_t j = j0 + lane;
    A s = -(A)INFINITY;
    if (j < jend) {
      A dot = 0;
      for (int64_t d = 0; d < p.D; d++) dot += Qs[warp * p.D + d] * Ks[lane * (p.D + 1) + d];
      s = dot * scale;
      if (p.masked) s += mask_at<A>(p, b, h, i, j);
    }
    A mb = wmax(s);
    if (mb == -(A)INFINITY) continue; /* every key of the tile masked */
    if (mb > m) {
      A corr = kc_exp(m - mb); /* m == -inf: 0 */
      l *= corr;
#pragma unroll
      for (int c = 0; c < KCH; c++) acc[c] *= corr;
      m = mb;
    }
    A pj = s == -(A)INFINITY ? (A)0 : kc_exp(s - m);
    l += wsum(pj);
    if (p.dropout && pj != 0) pj *= drop_z<A>(p, b, h, i, j);
    const int nk = (int)(jend - j0 < BK ? jend - j0 : BK);
    for (int t = 0; t < nk; t++) {
      A pt = __shfl_sync(0xffffffffu, pj, t);
      if (pt == 0) continue; /* uniform across the warp */
#pragma unroll
      for (int c = 0; c < KCH; c++) {
        int64_t e = lane + 32 * c;
        if (e < p.Dv) acc[c] += pt * Vs[t * p.Dv + e];
      }
    }
  }
  if (!valid) return;
  A inv = l > 0 ? (A)1 / l : (A)0;
  T *ob = o + b * p.os[0] + h * p.os[1] + i * p.os[2];
#pragma unroll
  for (int c = 0; c < KCH; c++) {
    int64_t e = lane + 32 * c;
    if (e < p.Dv) ob[e * p.os[3]] = kc_st<T>(acc[c] * inv);
  }
  if (lane == 0) {
    int64_t lo = b * p.ls[0] + h * p.ls[1] + i * p.ls[2];
    A lv = l > 0 ? m + kc_log(l) : -(A)INFINITY;
    if (lse_dt == KILN_F64) ((double *)lse)[lo] = (double)lv;
    else ((float *)lse)[lo] = (float)lv;
  }
}

template <class A> __device__ __forceinline__ A lse_at(const void *lse, int dt, const AttArgs &p, int64_t b,
                                                       int64_t h, int64_t i) {
  int64_t lo = b * p.ls[0] + h * p.ls[1] + i * p.ls[2];
  return dt == KILN_F64 ? (A)((const double *)lse)[lo] : (A)((const float *)lse)[lo];
}

/* ---------------------------------------------------------------- backward: delta and dq */
template <class T, class A>
__global__ void __launch_bounds__(NW * 32) att_bwd_dq(const T *q, const T *k, const T *v, const T *g, T *dq,
                                                      const void *lse, int lse_dt, A *delta_out, AttArgs p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A *Ks = (A *)smem_raw;           /* BK x (D + 1) */
  A *Vs = Ks + BK * (p.D + 1);     /* BK x (Dv + 1) */
  A *Qs = Vs + BK * (p.Dv + 1);    /* NW x D */
  A *Gs = Qs + NW * p.D;           /* NW x Dv */
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t nt = (p.Tq + NW - 1) / NW;
  const int64_t bh = blockIdx.x / nt, i_first = (blockIdx.x % nt) * NW;
  const int64_t b = bh / p.H, h = bh % p.H, i = i_first + warp;
  const T *kb = k + b * p.ks[0] + h * p.ks[1];
  const T *vb = v + b * p.vs[0] + h * p.vs[1];
  A L = i < p.Tq ? lse_at<A>(lse, lse_dt, p, b, h, i) : -(A)INFINITY;
  const bool valid = i < p.Tq && L != -(A)INFINITY; /* every key masked: no gradient */
  if (i < p.Tq) {
    for (int64_t d = lane; d < p.D; d += 32)
      Qs[warp * p.D + d] = kc_ld<T>(q[b * p.qs[0] + h * p.qs[1] + i * p.qs[2] + d * p.qs[3]]);
    for (int64_t e = lane; e < p.Dv; e += 32)
      Gs[warp * p.Dv + e] = kc_ld<T>(g[b * p.gs[0] + h * p.gs[1] + i * p.gs[2] + e * p.gs[3]]);
  }
  int64_t i_last = i_first + NW - 1 < p.Tq ? i_first + NW - 1 : p.Tq - 1;
  int64_t jend_blk = p.causal && i_last + 1 < p.Tk ? i_last + 1 : p.Tk;
  int64_t jend = p.causal && i + 1 < p.Tk ? i + 1 : p.Tk;
  const A scale = (A)p.scale;
  A delta = 0;
  A acc[KCH];
#pragma unroll
  for (int c = 0; c < KCH; c++) acc[c] = 0;
  for (int pass = 0; pass < 2; pass++) {
    for (int64_t j0 = 0; j0 < jend_blk; j0 += BK) {
      __syncthreads();
      load_tile<T, A>(Ks, (int)p.D + 1, kb, p.ks[2], p.ks[3], j0, p.Tk, p.D);
      load_tile<T, A>(Vs, (int)p.Dv + 1, vb, p.vs[2], p.vs[3], j0, p.Tk, p.Dv);
      __syncthreads();
      if (!valid || j0 >= jend) continue;
      const int64_t j = j0 + lane;
      A pz = 0, ds = 0;
      if (j < jend) {
        A dot = 0;
        for (int64_t d = 0; d < p.D; d++) dot += Qs[warp * p.D + d] * Ks[lane * (p.D + 1) + d];
        A s = dot * scale;
        if (p.masked) s += mask_at<A>(p, b, h, i, j);
        if (s != -(A)INFINITY) {
          A pr = kc_exp(s - L), z = p.dropout ? drop_z<A>(p, b, h, i, j) : (A)1;
          A dp = 0;
          for (int64_t e = 0; e < p.Dv; e++) dp += Gs[warp * p.Dv + e] * Vs[lane * (p.Dv + 1) + e];
          pz = pr * z * dp;
          ds = pr * (z * dp - delta) * scale;
        }
      }
      if (pass == 0) {
        delta += wsum(pz); /* each tile's sum added in tile order: deterministic */
        continue;
      }
      const int nk = (int)(jend - j0 < BK ? jend - j0 : BK);
      for (int t = 0; t < nk; t++) {
        A st = __shfl_sync(0xffffffffu, ds, t);
        if (st == 0) continue;
#pragma unroll
        for (int c = 0; c < KCH; c++) {
          int64_t d = lane + 32 * c;
          if (d < p.D) acc[c] += st * Ks[t * (p.D + 1) + d];
        }
      }
    }
  }
  if (i >= p.Tq) return;
  T *qo = dq + b * p.dqs[0] + h * p.dqs[1] + i * p.dqs[2];
#pragma unroll
  for (int c = 0; c < KCH; c++) {
    int64_t d = lane + 32 * c;
    if (d < p.D) qo[d * p.dqs[3]] = kc_st<T>(acc[c]);
  }
  if (lane == 0) delta_out[bh * p.Tq + i] = delta;
}

/* ---------------------------------------------------------------- backward: dk and dv */
template <class T, class A>
__global__ void __launch_bounds__(NW * 32) att_bwd_dkv(const T *q, const T *k, const T *v, const T *g, T *dk, T *dv,
                                                       const void *lse, int lse_dt, const A *delta, AttArgs p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A *Qs = (A *)smem_raw;           /* BK x (D + 1) */
  A *Gs = Qs + BK * (p.D + 1);     /* BK x (Dv + 1) */
  A *Ls = Gs + BK * (p.Dv + 1);    /* BK lse */
  A *Ds = Ls + BK;                 /* BK delta */
  A *Kw = Ds + BK;                 /* NW x D */
  A *Vw = Kw + NW * p.D;           /* NW x Dv */
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t nt = (p.Tk + NW - 1) / NW;
  const int64_t bh = blockIdx.x / nt, j_first = (blockIdx.x % nt) * NW;
  const int64_t b = bh / p.H, h = bh % p.H, j = j_first + warp;
  const bool valid = j < p.Tk;
  const T *qb = q + b * p.qs[0] + h * p.qs[1];
  const T *gb = g + b * p.gs[0] + h * p.gs[1];
  if (valid) {
    for (int64_t d = lane; d < p.D; d += 32)
      Kw[warp * p.D + d] = kc_ld<T>(k[b * p.ks[0] + h * p.ks[1] + j * p.ks[2] + d * p.ks[3]]);
    for (int64_t e = lane; e < p.Dv; e += 32)
      Vw[warp * p.Dv + e] = kc_ld<T>(v[b * p.vs[0] + h * p.vs[1] + j * p.vs[2] + e * p.vs[3]]);
  }
  const A scale = (A)p.scale;
  A ak[KCH], av[KCH];
#pragma unroll
  for (int c = 0; c < KCH; c++) ak[c] = av[c] = 0;
  /* causal: queries i >= j only; the block's first tile holds its first key's row */
  int64_t i_start = p.causal ? (j_first / BK) * BK : 0;
  for (int64_t i0 = i_start; i0 < p.Tq; i0 += BK) {
    __syncthreads();
    load_tile<T, A>(Qs, (int)p.D + 1, qb, p.qs[2], p.qs[3], i0, p.Tq, p.D);
    load_tile<T, A>(Gs, (int)p.Dv + 1, gb, p.gs[2], p.gs[3], i0, p.Tq, p.Dv);
    for (int t = threadIdx.x; t < BK; t += blockDim.x) {
      int64_t i = i0 + t;
      Ls[t] = i < p.Tq ? lse_at<A>(lse, lse_dt, p, b, h, i) : -(A)INFINITY;
      Ds[t] = i < p.Tq ? delta[bh * p.Tq + i] : (A)0;
    }
    __syncthreads();
    if (!valid || (p.causal && i0 + BK <= j)) continue; /* every query of the tile before this key */
    const int64_t i = i0 + lane;
    A pz = 0, ds = 0;
    if (i < p.Tq && Ls[lane] != -(A)INFINITY && !(p.causal && j > i)) {
      A dot = 0;
      for (int64_t d = 0; d < p.D; d++) dot += Qs[lane * (p.D + 1) + d] * Kw[warp * p.D + d];
      A s = dot * scale;
      if (p.masked) s += mask_at<A>(p, b, h, i, j);
      if (s != -(A)INFINITY) {
        A pr = kc_exp(s - Ls[lane]), z = p.dropout ? drop_z<A>(p, b, h, i, j) : (A)1;
        A dp = 0;
        for (int64_t e = 0; e < p.Dv; e++) dp += Gs[lane * (p.Dv + 1) + e] * Vw[warp * p.Dv + e];
        pz = pr * z;
        ds = pr * (z * dp - Ds[lane]) * scale;
      }
    }
    for (int t = 0; t < BK; t++) {
      A pt = __shfl_sync(0xffffffffu, pz, t), st = __shfl_sync(0xffffffffu, ds, t);
      if (pt != 0) {
#pragma unroll
        for (int c = 0; c < KCH; c++) {
          int64_t e = lane + 32 * c;
          if (e < p.Dv) av[c] += pt * Gs[t * (p.Dv + 1) + e];
        }
      }
      if (st != 0) {
#pragma unroll
        for (int c = 0; c < KCH; c++) {
          int64_t d = lane + 32 * c;
          if (d < p.D) ak[c] += st * Qs[t * (p.D + 1) + d];
        }
      }
    }
  }
  if (!valid) return;
  T *ko = dk + b * p.dks[0] + h * p.dks[1] + j * p.dks[2];
  T *vo = dv + b * p.dvs[0] + h * p.dvs[1] + j * p.dvs[2];
#pragma unroll
  for (int c = 0; c < KCH; c++) {
    int64_t d = lane + 32 * c;
    if (d < p.D) ko[d * p.dks[3]] = kc_st<T>(ak[c]);
    if (d < p.Dv) vo[d * p.dvs[3]] = kc_st<T>(av[c]);
  }
}

/* Dynamic shared memory past 48 KiB needs the kernel's opt-in (f64 at head dim 128). */
template <class K> kiln_status smem_opt_in(K kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return KILN_OK;
  return kiln__cuda_err(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                        "attention (shared memory)");
}


/* ---------------------------------------------------------------- forward, tensor cores */
/* f16/bf16 with head dim 64 or 128 (D == Dv): the same online softmax, with the two
** products on the tensor cores (WMMA 16x16x16, f32 accumulation). A block of TC_W warps
** takes TC_BQ = 16 * TC_W query rows, a warp 16 of them; key tiles of TC_BK. Per tile a
** warp computes its S = Q K^T (16 x TC_BK, f32) into shared memory, two lanes per row
** apply scale, mask, causal rule and the running max/sum (FlashAttention-2's rescaling of
** O, which lives in shared memory in f32 since a WMMA accumulator's layout is opaque),
** write P (rounded to the input dtype, as FlashAttention does) and then O += P V. */
enum { TC_W = 4, TC_BQ = 16 * TC_W, TC_BK = 64 };

template <class T, int HD>
__global__ void __launch_bounds__(TC_W * 32) att_fwd_tc(const T *q, const T *k, const T *v, T *o, void *lse,
                                                       int lse_dt, AttArgs p) {
  using namespace nvcuda;
  extern __shared__ __align__(128) unsigned char tc_smem[]; /* WMMA wants 32-byte aligned tiles */
  T *Qs = (T *)tc_smem;                    /* TC_BQ x HD */
  T *Ks = Qs + TC_BQ * HD;                  /* TC_BK x HD */
  T *Vs = Ks + TC_BK * HD;                  /* TC_BK x HD */
  T *Ps = Vs + TC_BK * HD;                  /* TC_BQ x TC_BK */
  float *Ss = (float *)(Ps + TC_BQ * TC_BK); /* TC_BQ x TC_BK */
  float *Os = Ss + TC_BQ * TC_BK;            /* TC_BQ x HD */
  float *Cs = Os + TC_BQ * HD;               /* TC_BQ: this tile's rescale factor per row */
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t nt = (p.Tq + TC_BQ - 1) / TC_BQ;
  const int64_t bh = blockIdx.x / nt, i_first = (blockIdx.x % nt) * TC_BQ;
  const int64_t b = bh / p.H, h = bh % p.H;
  const T *qb = q + b * p.qs[0] + h * p.qs[1];
  const T *kb = k + b * p.ks[0] + h * p.ks[1];
  const T *vb = v + b * p.vs[0] + h * p.vs[1];
  for (int e = threadIdx.x; e < TC_BQ * HD; e += blockDim.x) {
    int r = e / HD, c = e % HD;
    int64_t i = i_first + r;
    Qs[e] = i < p.Tq ? qb[i * p.qs[2] + c * p.qs[3]] : kc_st<T>(0.0f);
    Os[e] = 0.0f;
  }
  /* row r = warp * 16 + lane / 2 of the block; the two lanes of a row split its columns */
  const int r = warp * 16 + lane / 2, half = lane % 2;
  const int64_t i = i_first + r;
  float m = -INFINITY, l = 0;
  const float scale = (float)p.scale;
  int64_t i_last_blk = i_first + TC_BQ - 1 < p.Tq ? i_first + TC_BQ - 1 : p.Tq - 1;
  int64_t jend_blk = p.causal && i_last_blk + 1 < p.Tk ? i_last_blk + 1 : p.Tk;
  int64_t i_last_w = i_first + warp * 16 + 15; /* the warp's last row: its causal limit */
  int64_t jend_w = p.causal && i_last_w + 1 < p.Tk ? i_last_w + 1 : p.Tk;
  int64_t jend = p.causal && i + 1 < p.Tk ? i + 1 : p.Tk;
  for (int64_t j0 = 0; j0 < jend_blk; j0 += TC_BK) {
    __syncthreads();
    for (int e = threadIdx.x; e < TC_BK * HD; e += blockDim.x) {
      int t = e / HD, c = e % HD;
      int64_t j = j0 + t;
      Ks[e] = j < p.Tk ? kb[j * p.ks[2] + c * p.ks[3]] : kc_st<T>(0.0f);
      Vs[e] = j < p.Tk ? vb[j * p.vs[2] + c * p.vs[3]] : kc_st<T>(0.0f);
    }
    __syncthreads();
    if (j0 >= jend_w || i_first + warp * 16 >= p.Tq) continue; /* warp-uniform */
    /* S = Q K^T for the warp's 16 rows */
#pragma unroll
    for (int nb = 0; nb < TC_BK / 16; nb++) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < HD / 16; kk++) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> fb;
        wmma::load_matrix_sync(fa, Qs + warp * 16 * HD + kk * 16, HD);
        wmma::load_matrix_sync(fb, Ks + nb * 16 * HD + kk * 16, HD); /* K^T: column n is key n */
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(Ss + warp * 16 * TC_BK + nb * 16, acc, TC_BK, wmma::mem_row_major);
    }
    __syncwarp();
    /* the row's scores: scale, mask, causal; max, rescale, P */
    float *srow = Ss + r * TC_BK;
    float mb = -INFINITY;
    for (int c = half; c < TC_BK; c += 2) {
      int64_t j = j0 + c;
      float s = -INFINITY;
      if (i < p.Tq && j < jend) {
        s = srow[c] * scale;
        if (p.masked) s += mask_at<float>(p, b, h, i, j);
      }
      srow[c] = s;
      mb = fmaxf(mb, s);
    }
    mb = fmaxf(mb, __shfl_xor_sync(0xffffffffu, mb, 1));
    float mn = fmaxf(m, mb);
    float corr = mn == -INFINITY ? 1.0f : expf(m - mn); /* m == -inf, mn finite: 0 */
    float ls = 0;
    T *prow = Ps + r * TC_BK;
    for (int c = half; c < TC_BK; c += 2) {
      float s = srow[c];
      float pr = s == -INFINITY ? 0.0f : expf(s - mn);
      ls += pr;
      if (p.dropout && pr != 0) pr *= drop_z<float>(p, b, h, i, j0 + c);
      prow[c] = kc_st<T>(pr);
    }
    ls += __shfl_xor_sync(0xffffffffu, ls, 1);
    l = l * corr + ls;
    m = mn;
    if (half == 0) Cs[r] = corr;
    __syncwarp();
    for (int e = lane; e < 16 * HD; e += 32) Os[warp * 16 * HD + e] *= Cs[warp * 16 + e / HD];
    __syncwarp();
    /* O += P V */
#pragma unroll
    for (int nb = 0; nb < HD / 16; nb++) {
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, Os + warp * 16 * HD + nb * 16, HD, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < TC_BK / 16; kk++) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> fa;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> fb;
        wmma::load_matrix_sync(fa, Ps + warp * 16 * TC_BK + kk * 16, TC_BK);
        wmma::load_matrix_sync(fb, Vs + kk * 16 * HD + nb * 16, HD);
        wmma::mma_sync(acc, fa, fb, acc);
      }
      wmma::store_matrix_sync(Os + warp * 16 * HD + nb * 16, acc, HD, wmma::mem_row_major);
    }
    __syncwarp();
  }
  __syncthreads(); /* the warps that skipped their last tiles see their rows' O too */
  if (i >= p.Tq) return;
  float inv = l > 0 ? 1.0f / l : 0.0f;
  T *ob = o + b * p.os[0] + h * p.os[1] + i * p.os[2];
  for (int c = half; c < HD; c += 2) ob[c * p.os[3]] = kc_st<T>(Os[r * HD + c] * inv);
  if (half == 0) {
    int64_t lo = b * p.ls[0] + h * p.ls[1] + i * p.ls[2];
    float lv = l > 0 ? m + logf(l) : -INFINITY;
    if (lse_dt == KILN_F64) ((double *)lse)[lo] = (double)lv;
    else ((float *)lse)[lo] = lv;
  }
}

/* Whether the tensor-core forward takes these arguments (KILN_CUDA_ATTENTION=simple turns
** it off, for comparison and as a way around it). */
static bool tc_fits(const kiln__kargs *a, const AttArgs &p) {
  kiln_dtype dt = a->in[0].dtype;
  if (a->op != KILN__K_ATTENTION || (dt != KILN_F16 && dt != KILN_BF16)) return false;
  if (p.D != p.Dv || (p.D != 64 && p.D != 128)) return false;
  return kiln__knob_choice("KILN_CUDA_ATTENTION", 0) != 1; /* tc, simple */
}

template <class T, int HD> kiln_status tc_launch(kiln__cuda_dev *d, const kiln__kargs *a, const AttArgs &p) {
  int64_t blocks = p.B * p.H * ((p.Tq + TC_BQ - 1) / TC_BQ);
  size_t sm = (size_t)(TC_BQ * HD + 2 * TC_BK * HD + TC_BQ * TC_BK) * sizeof(T) +
              (size_t)(TC_BQ * TC_BK + TC_BQ * HD + TC_BQ) * sizeof(float);
  KC_TRY(smem_opt_in(att_fwd_tc<T, HD>, sm));
  att_fwd_tc<T, HD><<<(unsigned)blocks, TC_W * 32, sm, d->stream>>>(
      (const T *)a->in[0].data, (const T *)a->in[1].data, (const T *)a->in[2].data, (T *)a->out[0].data,
      a->out[1].data, (int)a->out[1].dtype, p);
  return kiln__cuda_launched("attention (tensor cores)");
}

template <class T> kiln_status att_run(kiln__cuda_dev *d, const kiln__kargs *a, const AttArgs &p) {
  typedef typename wide_acc<T>::type A;
  const T *q = (const T *)a->in[0].data, *k = (const T *)a->in[1].data, *v = (const T *)a->in[2].data;
  int64_t BH = p.B * p.H;
  if (a->op == KILN__K_ATTENTION) {
    if (tc_fits(a, p)) {
      if constexpr (std::is_same<T, __half>::value || std::is_same<T, __nv_bfloat16>::value)
        return p.D == 64 ? tc_launch<T, 64>(d, a, p) : tc_launch<T, 128>(d, a, p);
    }
    int64_t blocks = BH * ((p.Tq + NW - 1) / NW);
    size_t sm = (size_t)(BK * (p.D + 1) + BK * p.Dv + NW * p.D) * sizeof(A);
    KC_TRY(smem_opt_in(att_fwd<T, A>, sm));
    att_fwd<T, A><<<(unsigned)blocks, NW * 32, sm, d->stream>>>(q, k, v, (T *)a->out[0].data, a->out[1].data,
                                                                 (int)a->out[1].dtype, p);
    return kiln__cuda_launched("attention");
  }
  const T *g = (const T *)a->in[3].data;
  const kiln__view *lse = &a->out[3];
  size_t dbytes = (size_t)(BH * p.Tq) * sizeof(A);
  A *delta = (A *)kiln__cuda_alloc(a->device, dbytes);
  if (!delta) return kiln_last_error();
  kiln_status st = kiln__cuda_capture_note(a->device, delta, dbytes);
  if (st == KILN_OK) {
    int64_t blocks = BH * ((p.Tq + NW - 1) / NW);
    size_t sm = (size_t)(BK * (p.D + 1) + BK * (p.Dv + 1) + NW * (p.D + p.Dv)) * sizeof(A);
    st = smem_opt_in(att_bwd_dq<T, A>, sm);
    if (st == KILN_OK) {
      att_bwd_dq<T, A><<<(unsigned)blocks, NW * 32, sm, d->stream>>>(q, k, v, g, (T *)a->out[0].data, lse->data,
                                                                      (int)lse->dtype, delta, p);
      st = kiln__cuda_launched("attention_backward (dq)");
    }
  }
  if (st == KILN_OK) {
    int64_t blocks = BH * ((p.Tk + NW - 1) / NW);
    size_t sm = (size_t)(BK * (p.D + 1) + BK * (p.Dv + 1) + 2 * BK + NW * (p.D + p.Dv)) * sizeof(A);
    st = smem_opt_in(att_bwd_dkv<T, A>, sm);
    if (st == KILN_OK) {
      att_bwd_dkv<T, A><<<(unsigned)blocks, NW * 32, sm, d->stream>>>(
          q, k, v, g, (T *)a->out[1].data, (T *)a->out[2].data, lse->data, (int)lse->dtype, delta, p);
      st = kiln__cuda_launched("attention_backward (dk, dv)");
    }
  }
  kiln__cuda_free(a->device, delta, dbytes); /* stream-ordered reuse */
  return st;
}

} // namespace

extern "C" bool kiln__cuda_attention_supports(const kiln__kargs *a) {
  bool bw = a->op == KILN__K_ATTENTION_BACKWARD;
  kiln_dtype dt = a->in[0].dtype;
  if (!kc_is_float(dt)) return false;
  for (int i = 0; i < 3; i++)
    if (a->in[i].dtype != dt || a->in[i].ndim != 4) return false;
  if (bw && a->in[3].dtype != dt) return false;
  if (a->in[0].shape[3] > KMAX_D || a->in[2].shape[3] > KMAX_D) return false;
  if (a->i[0] & 2) {
    kiln_dtype md = a->in[bw ? 4 : 3].dtype;
    if (md != KILN_BOOL && !kc_is_float(md)) return false;
  }
  const kiln__view *lse = &a->out[bw ? 3 : 1];
  if (lse->dtype != KILN_F32 && lse->dtype != KILN_F64) return false;
  for (int o = 0; o < (bw ? 3 : 1); o++)
    if (a->out[o].dtype != dt) return false;
  return true;
}

extern "C" bool kiln__cuda_flash_fits(const kiln__kargs *a); /* cuda_flash.cu */
extern "C" kiln_status kiln__cuda_flash(const kiln__kargs *a);

extern "C" bool kiln__cuda_attention_cudnn_fits(const kiln__kargs *a); /* cuda_attention_cudnn.cu */
extern "C" kiln_status kiln__cuda_attention_cudnn(const kiln__kargs *a);

extern "C" kiln_status kiln__cuda_attention(const kiln__kargs *a) {
  /* cuDNN's fused attention where it has an engine for the shape (KILN_ATTENTION=own: never) */
  if (kiln__cuda_attention_cudnn_fits(a)) {
    kiln_status st = kiln__cuda_attention_cudnn(a);
    if (st != KILN_ERR_UNSUPPORTED) return st;
    kiln_clear_error();
  }
  if (kiln__cuda_flash_fits(a)) return kiln__cuda_flash(a);
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  bool bw = a->op == KILN__K_ATTENTION_BACKWARD;
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2];
  AttArgs p;
  p.B = q->shape[0], p.H = q->shape[1], p.Tq = q->shape[2], p.Tk = k->shape[2];
  p.D = q->shape[3], p.Dv = v->shape[3];
  for (int x = 0; x < 4; x++) {
    p.qs[x] = q->strides[x], p.ks[x] = k->strides[x], p.vs[x] = v->strides[x];
    p.os[x] = bw ? 0 : a->out[0].strides[x];
    p.gs[x] = bw ? a->in[3].strides[x] : 0;
    p.dqs[x] = bw ? a->out[0].strides[x] : 0;
    p.dks[x] = bw ? a->out[1].strides[x] : 0;
    p.dvs[x] = bw ? a->out[2].strides[x] : 0;
  }
  const kiln__view *lse = &a->out[bw ? 3 : 1];
  for (int x = 0; x < 3; x++) p.ls[x] = lse->strides[x];
  p.causal = (a->i[0] & 1) != 0;
  p.masked = (a->i[0] & 2) != 0;
  p.mask = NULL, p.mask_dt = 0;
  for (int x = 0; x < 4; x++) p.ms[x] = 0;
  if (p.masked) {
    const kiln__view *m = &a->in[bw ? 4 : 3];
    p.mask = m->data, p.mask_dt = (int)m->dtype;
    for (int x = 0; x < 4; x++) p.ms[x] = m->strides[x];
  }
  p.scale = a->s[0];
  p.dropout = a->s[1] > 0;
  p.keep = 1.0 - a->s[1];
  p.zscale = p.keep > 0 ? 1.0 / p.keep : 0.0;
  p.seed = a->seed, p.offset = a->offset;
  if (p.B * p.H * p.Tq == 0 || (bw && p.Tk == 0)) {
    /* nothing to compute; the op layer handles empty inputs before the kernel */
    return KILN_OK;
  }
  if (p.B * p.H * ((p.Tq > p.Tk ? p.Tq : p.Tk) + NW) / NW > INT32_MAX)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_scaled_dot_product_attention: too many rows for the cuda kernel");
  KC_SWITCH_FLOAT(q->dtype, T, return kiln_set_error(KILN_ERR_DTYPE, "kiln_%s: dtype %s not supported on cuda",
                                                     kiln__kop_name(a->op), kiln_dtype_name(q->dtype)),
                  return att_run<T>(d, a, p))
  return KILN_OK;
}
