/*
** ATTENTION and ATTENTION_BACKWARD on the tensor cores: FlashAttention-2 (Dao 2023) for
** f16 and bf16 with f32 accumulation, head dims 32, 64, 96 and 128, causal or not, any Tq and Tk,
** no mask and no dropout. cuda_attention.cu calls it first (kiln__cuda_flash_fits) and
** keeps its own kernels for everything else (f32/f64, masks, dropout, other head dims).
**
** The products are mma.sync.m16n8k16 (inline PTX) on fragments loaded with ldmatrix from
** shared memory; tiles arrive with cp.async (16 bytes a copy: the last dim must be
** contiguous and rows 16-byte aligned, which kiln__cuda_flash_fits checks). Shared rows
** are padded by 8 elements (16 bytes), so the 8 row addresses of an ldmatrix 8x8 load fall
** on distinct bank quads: a row pitch of HD + 8 halves is 4 words mod 32.
**
** Fragment layouts (PTX ISA, "mma.m16n8k16"), lane = 4 g + t: A (16x16, row) a0 (g, 2t..),
** a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..); B (16x8, col) b0 (k 2t.., n g), b1
** (k 2t+8.., n g); C (16x8 f32) c0 c1 (g, 2t, 2t+1), c2 c3 (g+8, 2t, 2t+1). A C fragment pair
** of n-tiles 2kk, 2kk+1 is exactly the A fragment of k-chunk kk, so P and dS go from one
** product's accumulator to the next product's operand in registers.
**
** Forward: a CTA of 4 warps takes 64 query rows of one (b, h), a warp 16; key/value tiles
** of 64 rows; S = Q K^T, online softmax in the exp2 domain (scale * log2 e folded in), P
** rounded to the input type (as FlashAttention does), O += P V; writes O and the f32
** log-sum-exp (natural log, the contract's). No Tq x Tk buffer.
**
** Backward: delta_i = dO_i . O_i (a small kernel, which also turns lse into the exp2
** domain), then two deterministic kernels (no atomics, so two runs give the same bits, the
** rule test_cuda_transformer checks): dq, a CTA per 64 query rows sweeping the key tiles
** (S, dP = dO V^T, dS = P (dP - delta), dq += dS K), and dk/dv, a CTA per 64 keys
** sweeping the query tiles (S^T = K Q^T, dv += P^T dO, dP^T = V dO^T, dk += dS^T Q). This
** recomputes S and dP once more than FA2's atomic dq (7 products instead of 5) but needs
** no f32 dq buffer and no conversion pass. The forward's output O comes in through
** kargs.params (backend.h).
*/
#include "cuda_int.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <type_traits>

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kThreads = 128; /* 4 warps */

struct FlashArgs {
  const void *q, *k, *v, *o, *g; /* g: the gradient of the output */
  void *out, *dq, *dk, *dv;
  float *lse;                    /* forward: written; backward: read */
  float *delta, *lse2;           /* backward workspace, (B*H, Tq) each */
  int64_t B, H, Tq, Tk;
  /* strides of dims 0..2 in elements (dim 3 is contiguous), and o's dim 3 */
  int64_t qs[3], ks[3], vs[3], os[4], gs[3], outs[3], dqs[3], dks[3], dvs[3], ls[3];
  float scale, sl2; /* sl2 = scale * log2 e */
  bool causal;
};

/* ---------------------------------------------------------------- PTX wrappers */

__device__ __forceinline__ void ldsm_x4(uint32_t r[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(kc_smem_u32(p))
               : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t r[4], const void *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(kc_smem_u32(p))
               : "memory");
}
/* c += a b for one 16x8 tile */
template <class T> __device__ __forceinline__ void mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1);
template <> __device__ __forceinline__ void mma<__half>(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* two floats as a pair of T in one register, lo in the low half (the element of lower index) */
template <class T> __device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <> __device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&h);
}
template <> __device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&h);
}
template <class T> __device__ __forceinline__ float to_f(T x);
template <> __device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

/* Rows [r0, r0 + R) of a (Tn, HD) slice (row stride rs, contiguous rows) into shared memory
** with pitch HD + 8; rows past Tn are zeros. Every thread of the CTA calls it. */
template <class T, int HD, int R>
__device__ __forceinline__ void load_rows(T *s, const T *g, int64_t rs, int64_t r0, int64_t Tn) {
  constexpr int CH = HD / 8; /* 16-byte chunks per row */
  static_assert(R * CH % kThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
  for (int it = 0; it < R * CH / kThreads; it++) {
    int e = threadIdx.x + it * kThreads, r = e / CH, c = (e % CH) * 8;
    T *dst = s + r * (HD + 8) + c;
    if (r0 + r < Tn) kc_cp_async16(dst, g + (r0 + r) * rs + c);
    else *reinterpret_cast<uint4 *>(dst) = make_uint4(0, 0, 0, 0);
  }
}

/* ldmatrix addresses. A operand, 16 rows from row0, k-chunk at column c0 (row-major in smem). */
template <int P> __device__ __forceinline__ int a_off(int lane, int row0, int c0) {
  return (row0 + (lane & 15)) * P + c0 + (lane >> 4) * 8;
}
/* B operand stored as N x K rows (the "col" layout: K for Q K^T), 16 n-rows from n0, k-chunk
** at c0: regs 0,1 are b0,b1 of n-tile n0, regs 2,3 of n-tile n0 + 8. */
template <int P> __device__ __forceinline__ int bn_off(int lane, int n0, int c0) {
  return (n0 + (lane & 7) + ((lane >> 4) << 3)) * P + c0 + ((lane >> 3) & 1) * 8;
}
/* B operand stored as K x N rows (V for P V), with ldmatrix.trans: 16 k-rows from k0,
** 16 columns from n0: regs 0,1 are b0,b1 of n-tile n0, regs 2,3 of n-tile n0 + 8. */
template <int P> __device__ __forceinline__ int bk_off(int lane, int k0, int n0) {
  return (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * P + n0 + (lane >> 4) * 8;
}
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/* ---------------------------------------------------------------- forward */
template <class T, int HD>
__global__ void __launch_bounds__(kThreads) flash_fwd(FlashArgs p) {
  constexpr int BM = 64, BN = 64, P = HD + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T *Qs = reinterpret_cast<T *>(smem); /* BM x P */
  T *Ks = Qs + BM * P;                 /* BN x P */
  T *Vs = Ks + BN * P;                 /* BN x P */
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t nqb = (p.Tq + BM - 1) / BM;
  const int64_t qb = nqb - 1 - (int64_t)blockIdx.x % nqb; /* the longest causal blocks first */
  const int64_t bh = (int64_t)blockIdx.x / nqb, b = bh / p.H, h = bh % p.H;
  const int64_t i0 = qb * BM;
  const T *qg = (const T *)p.q + b * p.qs[0] + h * p.qs[1];
  const T *kg = (const T *)p.k + b * p.ks[0] + h * p.ks[1];
  const T *vg = (const T *)p.v + b * p.vs[0] + h * p.vs[1];
  const int64_t jend = p.causal && i0 + BM < p.Tk ? i0 + BM : p.Tk; /* keys j <= the block's last row */
  const int ntiles = (int)((jend + BN - 1) / BN);
  const int64_t row0 = i0 + warp * 16 + g, row1 = row0 + 8;

  load_rows<T, HD, BM>(Qs, qg, p.qs[2], i0, p.Tq);
  load_rows<T, HD, BN>(Ks, kg, p.ks[2], 0, p.Tk);
  kc_cp_commit();

  float o[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  uint32_t qf[HD / 16][4];

  for (int jt = 0; jt < ntiles; jt++) {
    const int64_t j0 = (int64_t)jt * BN;
    __syncthreads(); /* every warp is done with Vs (the previous tile's P V) */
    load_rows<T, HD, BN>(Vs, vg, p.vs[2], j0, p.Tk);
    kc_cp_commit();
    kc_cp_wait<1>(); /* Q and this tile's K are here (V may still be in flight) */
    __syncthreads();
    if (jt == 0) {
#pragma unroll
      for (int kk = 0; kk < HD / 16; kk++) ldsm_x4(qf[kk], Qs + a_off<P>(lane, warp * 16, kk * 16));
    }
    float s[BN / 8][4];
#pragma unroll
    for (int n = 0; n < BN / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
#pragma unroll
      for (int nb = 0; nb < BN / 16; nb++) {
        uint32_t kb[4];
        ldsm_x4(kb, Ks + bn_off<P>(lane, nb * 16, kk * 16));
        mma<T>(s[2 * nb], qf[kk], kb[0], kb[1]);
        mma<T>(s[2 * nb + 1], qf[kk], kb[2], kb[3]);
      }
    }
    __syncthreads(); /* every warp is done with Ks: the next tile's keys may come */
    if (jt + 1 < ntiles) load_rows<T, HD, BN>(Ks, kg, p.ks[2], j0 + BN, p.Tk);
    kc_cp_commit(); /* possibly empty: keeps the group count uniform */

    /* scale into the exp2 domain; mask keys past Tk and (causal) past the row */
    const bool edge = j0 + BN > p.Tk || (p.causal && j0 + BN - 1 > i0 + warp * 16);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < BN / 8; n++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {
        float x = s[n][e] * p.sl2;
        if (edge) {
          int64_t j = j0 + n * 8 + 2 * t + (e & 1), i = e < 2 ? row0 : row1;
          if (j >= p.Tk || (p.causal && j > i)) x = -INFINITY;
        }
        s[n][e] = x;
        mx[e >> 1] = fmaxf(mx[e >> 1], x);
      }
    }
    float mu[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
      float mn = fmaxf(m[r], quad_max(mx[r]));
      mu[r] = mn == -INFINITY ? 0.f : mn; /* a row with nothing yet: exp2(-inf - 0) = 0, no NaN */
      float corr = exp2f(m[r] - mu[r]);
      m[r] = mn;
      l[r] *= corr;
#pragma unroll
      for (int n = 0; n < HD / 8; n++) o[n][2 * r] *= corr, o[n][2 * r + 1] *= corr;
    }
    uint32_t pa[BN / 16][4];
#pragma unroll
    for (int n = 0; n < BN / 8; n++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {
        float pr = exp2f(s[n][e] - mu[e >> 1]);
        s[n][e] = pr;
        l[e >> 1] += pr;
      }
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
      pa[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
    kc_cp_wait<1>(); /* this tile's V is here (the next K may be in flight) */
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
#pragma unroll
      for (int nb = 0; nb < HD / 16; nb++) {
        uint32_t vb[4];
        ldsm_x4_t(vb, Vs + bk_off<P>(lane, kk * 16, nb * 16));
        mma<T>(o[2 * nb], pa[kk], vb[0], vb[1]);
        mma<T>(o[2 * nb + 1], pa[kk], vb[2], vb[3]);
      }
    }
  }
  kc_cp_wait<0>();

  /* O / l and lse = ln 2 (m + log2 l), m in the exp2 domain */
  T *og = (T *)p.out + b * p.outs[0] + h * p.outs[1];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    float lr = quad_sum(l[r]);
    int64_t i = r ? row1 : row0;
    if (i >= p.Tq) continue;
    float inv = lr > 0 ? 1.f / lr : 0.f;
    T *orow = og + i * p.outs[2];
#pragma unroll
    for (int n = 0; n < HD / 8; n++)
      *reinterpret_cast<uint32_t *>(orow + n * 8 + 2 * t) = pack2<T>(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
    if (t == 0) p.lse[b * p.ls[0] + h * p.ls[1] + i * p.ls[2]] = lr > 0 ? (m[r] + log2f(lr)) * kLn2 : -INFINITY;
  }
}

/* ---------------------------------------------------------------- backward: delta */
/* A warp per query row: delta = dO . O (f32), and lse in the exp2 domain (+inf for a row
** that attends nothing, so that its P is 0). Both (B*H, Tq), contiguous. */
template <class T, int HD> __global__ void __launch_bounds__(256) flash_delta(FlashArgs p) {
  const int64_t row = (int64_t)blockIdx.x * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= p.B * p.H * p.Tq) return;
  const int64_t bh = row / p.Tq, i = row % p.Tq, b = bh / p.H, h = bh % p.H;
  const T *orow = (const T *)p.o + b * p.os[0] + h * p.os[1] + i * p.os[2];
  const T *grow = (const T *)p.g + b * p.gs[0] + h * p.gs[1] + i * p.gs[2];
  float acc = 0.f;
#pragma unroll
  for (int d = lane; d < HD; d += 32) acc += to_f<T>(orow[d * p.os[3]]) * to_f<T>(grow[d]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) {
    float L = p.lse[b * p.ls[0] + h * p.ls[1] + i * p.ls[2]];
    p.delta[row] = acc;
    p.lse2[row] = L == -INFINITY ? INFINITY : L * kLog2e;
  }
}

/* ---------------------------------------------------------------- backward: dq */
/* Key tile BN: 64 up to head dim 64, 32 past it (registers: dq's accumulator grows). */
template <int HD> struct DqCfg { static constexpr int BM = 64, BN = HD <= 64 ? 64 : 32; };

template <class T, int HD>
__global__ void __launch_bounds__(kThreads) flash_bwd_dq(FlashArgs p) {
  constexpr int BM = DqCfg<HD>::BM, BN = DqCfg<HD>::BN, P = HD + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T *Qs = reinterpret_cast<T *>(smem); /* BM x P */
  T *Gs = Qs + BM * P;                 /* BM x P: dO */
  T *KV = Gs + BM * P;                 /* two buffers of K (BN x P) then V (BN x P) */
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t nqb = (p.Tq + BM - 1) / BM;
  const int64_t qb = nqb - 1 - (int64_t)blockIdx.x % nqb;
  const int64_t bh = (int64_t)blockIdx.x / nqb, b = bh / p.H, h = bh % p.H;
  const int64_t i0 = qb * BM;
  const T *qg = (const T *)p.q + b * p.qs[0] + h * p.qs[1];
  const T *gg = (const T *)p.g + b * p.gs[0] + h * p.gs[1];
  const T *kg = (const T *)p.k + b * p.ks[0] + h * p.ks[1];
  const T *vg = (const T *)p.v + b * p.vs[0] + h * p.vs[1];
  const int64_t jend = p.causal && i0 + BM < p.Tk ? i0 + BM : p.Tk;
  const int ntiles = (int)((jend + BN - 1) / BN);
  const int64_t row0 = i0 + warp * 16 + g, row1 = row0 + 8;
  const float L0 = row0 < p.Tq ? p.lse2[bh * p.Tq + row0] : INFINITY;
  const float L1 = row1 < p.Tq ? p.lse2[bh * p.Tq + row1] : INFINITY;
  const float D0 = row0 < p.Tq ? p.delta[bh * p.Tq + row0] : 0.f;
  const float D1 = row1 < p.Tq ? p.delta[bh * p.Tq + row1] : 0.f;

  load_rows<T, HD, BM>(Qs, qg, p.qs[2], i0, p.Tq);
  load_rows<T, HD, BM>(Gs, gg, p.gs[2], i0, p.Tq);
  load_rows<T, HD, BN>(KV, kg, p.ks[2], 0, p.Tk);
  load_rows<T, HD, BN>(KV + BN * P, vg, p.vs[2], 0, p.Tk);
  kc_cp_commit();

  float dq[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; n++) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;
  uint32_t qf[HD / 16][4], gf[HD / 16][4];

  for (int jt = 0; jt < ntiles; jt++) {
    const int64_t j0 = (int64_t)jt * BN;
    __syncthreads(); /* the buffer the next tile goes to was last read in tile jt - 1 */
    if (jt + 1 < ntiles) {
      T *nb = KV + ((jt + 1) & 1) * 2 * BN * P;
      load_rows<T, HD, BN>(nb, kg, p.ks[2], j0 + BN, p.Tk);
      load_rows<T, HD, BN>(nb + BN * P, vg, p.vs[2], j0 + BN, p.Tk);
    }
    kc_cp_commit();
    kc_cp_wait<1>();
    __syncthreads();
    if (jt == 0) {
#pragma unroll
      for (int kk = 0; kk < HD / 16; kk++) {
        ldsm_x4(qf[kk], Qs + a_off<P>(lane, warp * 16, kk * 16));
        ldsm_x4(gf[kk], Gs + a_off<P>(lane, warp * 16, kk * 16));
      }
    }
    const T *Kt = KV + (jt & 1) * 2 * BN * P, *Vt = Kt + BN * P;
    float s[BN / 8][4], dp[BN / 8][4];
#pragma unroll
    for (int n = 0; n < BN / 8; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[n][e] = dp[n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
#pragma unroll
      for (int nb = 0; nb < BN / 16; nb++) {
        uint32_t kb[4], vb[4];
        ldsm_x4(kb, Kt + bn_off<P>(lane, nb * 16, kk * 16));
        mma<T>(s[2 * nb], qf[kk], kb[0], kb[1]);
        mma<T>(s[2 * nb + 1], qf[kk], kb[2], kb[3]);
        ldsm_x4(vb, Vt + bn_off<P>(lane, nb * 16, kk * 16));
        mma<T>(dp[2 * nb], gf[kk], vb[0], vb[1]);
        mma<T>(dp[2 * nb + 1], gf[kk], vb[2], vb[3]);
      }
    }
    /* dS = P (dP - delta), P = exp2(S sl2 - lse2); keys past Tk and (causal) past the row: 0 */
    const bool edge = j0 + BN > p.Tk || (p.causal && j0 + BN - 1 > i0 + warp * 16);
    uint32_t da[BN / 16][4];
#pragma unroll
    for (int n = 0; n < BN / 8; n++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const bool lo = e < 2;
        float pr = exp2f(s[n][e] * p.sl2 - (lo ? L0 : L1));
        if (edge) {
          int64_t j = j0 + n * 8 + 2 * t + (e & 1), i = lo ? row0 : row1;
          if (j >= p.Tk || (p.causal && j > i)) pr = 0.f;
        }
        s[n][e] = pr * (dp[n][e] - (lo ? D0 : D1));
      }
    }
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
      da[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      da[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      da[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      da[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
    /* dq += dS K: K as the (keys x d) B operand, rows of keys */
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
#pragma unroll
      for (int nb = 0; nb < HD / 16; nb++) {
        uint32_t kb[4];
        ldsm_x4_t(kb, Kt + bk_off<P>(lane, kk * 16, nb * 16));
        mma<T>(dq[2 * nb], da[kk], kb[0], kb[1]);
        mma<T>(dq[2 * nb + 1], da[kk], kb[2], kb[3]);
      }
    }
  }
  kc_cp_wait<0>();
  T *dqg = (T *)p.dq + b * p.dqs[0] + h * p.dqs[1];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    int64_t i = r ? row1 : row0;
    if (i >= p.Tq) continue;
    T *drow = dqg + i * p.dqs[2];
#pragma unroll
    for (int n = 0; n < HD / 8; n++)
      *reinterpret_cast<uint32_t *>(drow + n * 8 + 2 * t) =
          pack2<T>(dq[n][2 * r] * p.scale, dq[n][2 * r + 1] * p.scale);
  }
}

/* ---------------------------------------------------------------- backward: dk, dv */
/* A warp owns 16 keys; query tiles of BM: 64 up to head dim 64, 32 past it (registers: dk and
** dv grow with the head dim). K and V stay in shared memory and are re-read per tile (a fraction of the
** Q and dO traffic), which keeps dk and dv in registers at head dim 128 without spills. */
template <int HD> struct DkvCfg { static constexpr int BN = 64, BM = HD <= 64 ? 64 : 32; };

template <class T, int HD>
__global__ void __launch_bounds__(kThreads) flash_bwd_dkv(FlashArgs p) {
  constexpr int BN = DkvCfg<HD>::BN, BM = DkvCfg<HD>::BM, P = HD + 8;
  extern __shared__ __align__(16) unsigned char smem[];
  T *Ks = reinterpret_cast<T *>(smem);            /* BN x P */
  T *Vs = Ks + BN * P;                            /* BN x P */
  T *QG = Vs + BN * P;                            /* two buffers of Q (BM x P) then dO (BM x P) */
  float *LD = reinterpret_cast<float *>(QG + 4 * BM * P); /* two buffers of lse2 (BM) then delta (BM) */
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t nkb = (p.Tk + BN - 1) / BN;
  const int64_t kb_ = (int64_t)blockIdx.x % nkb; /* key block 0 has the most causal work: first */
  const int64_t bh = (int64_t)blockIdx.x / nkb, b = bh / p.H, h = bh % p.H;
  const int64_t j0 = kb_ * BN;
  const T *qg = (const T *)p.q + b * p.qs[0] + h * p.qs[1];
  const T *gg = (const T *)p.g + b * p.gs[0] + h * p.gs[1];
  const T *kg = (const T *)p.k + b * p.ks[0] + h * p.ks[1];
  const T *vg = (const T *)p.v + b * p.vs[0] + h * p.vs[1];
  const float *lse2 = p.lse2 + bh * p.Tq, *delta = p.delta + bh * p.Tq;
  /* causal: queries i >= j only; start at the tile holding the block's first key's row */
  const int64_t istart = p.causal ? (j0 / BM) * BM : 0;
  const int ntiles = istart < p.Tq ? (int)((p.Tq - istart + BM - 1) / BM) : 0;
  const int64_t key0 = j0 + warp * 16 + g, key1 = key0 + 8;

  load_rows<T, HD, BN>(Ks, kg, p.ks[2], j0, p.Tk);
  load_rows<T, HD, BN>(Vs, vg, p.vs[2], j0, p.Tk);
  if (ntiles > 0) {
    load_rows<T, HD, BM>(QG, qg, p.qs[2], istart, p.Tq);
    load_rows<T, HD, BM>(QG + BM * P, gg, p.gs[2], istart, p.Tq);
    for (int x = threadIdx.x; x < BM; x += kThreads) {
      int64_t i = istart + x;
      LD[x] = i < p.Tq ? lse2[i] : INFINITY;
      LD[BM + x] = i < p.Tq ? delta[i] : 0.f;
    }
  }
  kc_cp_commit();

  float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
  for (int n = 0; n < HD / 8; n++)
#pragma unroll
    for (int e = 0; e < 4; e++) dk[n][e] = dv[n][e] = 0.f;

  for (int it = 0; it < ntiles; it++) {
    const int64_t i0 = istart + (int64_t)it * BM;
    __syncthreads();
    if (it + 1 < ntiles) {
      const int nbuf = (it + 1) & 1;
      T *nq = QG + nbuf * 2 * BM * P;
      load_rows<T, HD, BM>(nq, qg, p.qs[2], i0 + BM, p.Tq);
      load_rows<T, HD, BM>(nq + BM * P, gg, p.gs[2], i0 + BM, p.Tq);
      float *nl = LD + nbuf * 2 * BM;
      for (int x = threadIdx.x; x < BM; x += kThreads) {
        int64_t i = i0 + BM + x;
        nl[x] = i < p.Tq ? lse2[i] : INFINITY;
        nl[BM + x] = i < p.Tq ? delta[i] : 0.f;
      }
    }
    kc_cp_commit();
    kc_cp_wait<1>();
    __syncthreads();
    const int cb = it & 1;
    const T *Qt = QG + cb * 2 * BM * P, *Gt = Qt + BM * P;
    const float *Lt = LD + cb * 2 * BM, *Dt = Lt + BM;

    /* S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys (rows) and the tile's queries */
    float s[BM / 8][4], dp[BM / 8][4];
#pragma unroll
    for (int n = 0; n < BM / 8; n++)
#pragma unroll
      for (int e = 0; e < 4; e++) s[n][e] = dp[n][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < HD / 16; kk++) {
      uint32_t kf[4], vf[4];
      ldsm_x4(kf, Ks + a_off<P>(lane, warp * 16, kk * 16));
      ldsm_x4(vf, Vs + a_off<P>(lane, warp * 16, kk * 16));
#pragma unroll
      for (int nb = 0; nb < BM / 16; nb++) {
        uint32_t qb4[4], gb4[4];
        ldsm_x4(qb4, Qt + bn_off<P>(lane, nb * 16, kk * 16));
        mma<T>(s[2 * nb], kf, qb4[0], qb4[1]);
        mma<T>(s[2 * nb + 1], kf, qb4[2], qb4[3]);
        ldsm_x4(gb4, Gt + bn_off<P>(lane, nb * 16, kk * 16));
        mma<T>(dp[2 * nb], vf, gb4[0], gb4[1]);
        mma<T>(dp[2 * nb + 1], vf, gb4[2], gb4[3]);
      }
    }
    /* P^T and dS^T; queries past Tq have lse2 +inf (P 0); causal: query i < key j gives 0 */
    const bool edge = p.causal && i0 < j0 + warp * 16 + 15;
    uint32_t pa[BM / 16][4], da[BM / 16][4];
#pragma unroll
    for (int n = 0; n < BM / 8; n++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int c = n * 8 + 2 * t + (e & 1);
        float pr = exp2f(s[n][e] * p.sl2 - Lt[c]);
        if (edge && i0 + c < ((e < 2) ? key0 : key1)) pr = 0.f;
        s[n][e] = pr;
        dp[n][e] = pr * (dp[n][e] - Dt[c]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < BM / 16; kk++) {
      pa[kk][0] = pack2<T>(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = pack2<T>(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      da[kk][0] = pack2<T>(dp[2 * kk][0], dp[2 * kk][1]);
      da[kk][1] = pack2<T>(dp[2 * kk][2], dp[2 * kk][3]);
      da[kk][2] = pack2<T>(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      da[kk][3] = pack2<T>(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
    }
    /* dv += P^T dO, dk += dS^T Q: dO and Q as (queries x d) B operands */
#pragma unroll
    for (int kk = 0; kk < BM / 16; kk++) {
#pragma unroll
      for (int nb = 0; nb < HD / 16; nb++) {
        uint32_t gb4[4], qb4[4];
        ldsm_x4_t(gb4, Gt + bk_off<P>(lane, kk * 16, nb * 16));
        mma<T>(dv[2 * nb], pa[kk], gb4[0], gb4[1]);
        mma<T>(dv[2 * nb + 1], pa[kk], gb4[2], gb4[3]);
        ldsm_x4_t(qb4, Qt + bk_off<P>(lane, kk * 16, nb * 16));
        mma<T>(dk[2 * nb], da[kk], qb4[0], qb4[1]);
        mma<T>(dk[2 * nb + 1], da[kk], qb4[2], qb4[3]);
      }
    }
  }
  kc_cp_wait<0>();
  T *dkg = (T *)p.dk + b * p.dks[0] + h * p.dks[1];
  T *dvg = (T *)p.dv + b * p.dvs[0] + h * p.dvs[1];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    int64_t j = r ? key1 : key0;
    if (j >= p.Tk) continue;
    T *krow = dkg + j * p.dks[2], *vrow = dvg + j * p.dvs[2];
#pragma unroll
    for (int n = 0; n < HD / 8; n++) {
      *reinterpret_cast<uint32_t *>(krow + n * 8 + 2 * t) =
          pack2<T>(dk[n][2 * r] * p.scale, dk[n][2 * r + 1] * p.scale);
      *reinterpret_cast<uint32_t *>(vrow + n * 8 + 2 * t) = pack2<T>(dv[n][2 * r], dv[n][2 * r + 1]);
    }
  }
}

/* ---------------------------------------------------------------- host side */
template <class K> kiln_status smem_attr(K kernel, size_t bytes, const char *what) {
  if (bytes <= 48 * 1024) return KILN_OK;
  return kiln__cuda_err(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes), what);
}

/* a view the cp.async loads can read: contiguous last dim, 16-byte aligned rows */
bool loadable(const kiln__view *v) {
  if (v->ndim != 4 || v->strides[3] != 1 || ((uintptr_t)v->data & 15) != 0) return false;
  for (int x = 0; x < 3; x++)
    if (v->shape[x] > 1 && v->strides[x] % 8 != 0) return false;
  return true;
}
/* a view the kernels write in pairs: contiguous last dim, 4-byte aligned pairs */
bool writable(const kiln__view *v) {
  if (v->ndim != 4 || v->strides[3] != 1 || ((uintptr_t)v->data & 3) != 0) return false;
  for (int x = 0; x < 3; x++)
    if (v->shape[x] > 1 && v->strides[x] % 2 != 0) return false;
  return true;
}

template <class T, int HD> kiln_status run_fwd(kiln__cuda_dev *d, FlashArgs &p) {
  constexpr int P = HD + 8;
  size_t sm = (size_t)(64 + 2 * 64) * P * sizeof(T);
  KC_TRY(smem_attr(flash_fwd<T, HD>, sm, "attention (flash forward, shared memory)"));
  int64_t blocks = p.B * p.H * ((p.Tq + 63) / 64);
  flash_fwd<T, HD><<<(unsigned)blocks, kThreads, sm, d->stream>>>(p);
  return kiln__cuda_launched("attention (flash forward)");
}

template <class T, int HD> kiln_status run_bwd(kiln__cuda_dev *d, int device, FlashArgs &p) {
  constexpr int P = HD + 8;
  int64_t rows = p.B * p.H * p.Tq;
  size_t wbytes = (size_t)(2 * rows) * sizeof(float);
  float *ws = (float *)kiln__cuda_alloc(device, wbytes);
  if (!ws) return kiln_last_error();
  p.delta = ws, p.lse2 = ws + rows;
  kiln_status st = kiln__cuda_capture_note(device, ws, wbytes);
  if (st == KILN_OK) {
    flash_delta<T, HD><<<(unsigned)((rows + 7) / 8), 256, 0, d->stream>>>(p);
    st = kiln__cuda_launched("attention_backward (flash delta)");
  }
  if (st == KILN_OK) {
    constexpr int BM = DqCfg<HD>::BM, BN = DqCfg<HD>::BN;
    size_t sm = (size_t)(2 * BM + 4 * BN) * P * sizeof(T);
    st = smem_attr(flash_bwd_dq<T, HD>, sm, "attention_backward (flash dq, shared memory)");
    if (st == KILN_OK) {
      int64_t blocks = p.B * p.H * ((p.Tq + BM - 1) / BM);
      flash_bwd_dq<T, HD><<<(unsigned)blocks, kThreads, sm, d->stream>>>(p);
      st = kiln__cuda_launched("attention_backward (flash dq)");
    }
  }
  if (st == KILN_OK) {
    constexpr int BN = DkvCfg<HD>::BN, BM = DkvCfg<HD>::BM;
    size_t sm = (size_t)(2 * BN + 4 * BM) * P * sizeof(T) + (size_t)(4 * BM) * sizeof(float);
    st = smem_attr(flash_bwd_dkv<T, HD>, sm, "attention_backward (flash dk dv, shared memory)");
    if (st == KILN_OK) {
      int64_t blocks = p.B * p.H * ((p.Tk + BN - 1) / BN);
      flash_bwd_dkv<T, HD><<<(unsigned)blocks, kThreads, sm, d->stream>>>(p);
      st = kiln__cuda_launched("attention_backward (flash dk dv)");
    }
  }
  kiln__cuda_free(device, ws, wbytes); /* stream-ordered reuse */
  return st;
}

template <class T, int HD> kiln_status run_hd(kiln__cuda_dev *d, const kiln__kargs *a, FlashArgs &p) {
  return a->op == KILN__K_ATTENTION ? run_fwd<T, HD>(d, p) : run_bwd<T, HD>(d, a->device, p);
}
template <class T> kiln_status run(kiln__cuda_dev *d, const kiln__kargs *a, FlashArgs &p, int64_t D) {
  switch (D) {
  case 32: return run_hd<T, 32>(d, a, p);
  case 64: return run_hd<T, 64>(d, a, p);
  case 96: return run_hd<T, 96>(d, a, p);
  default: return run_hd<T, 128>(d, a, p);
  }
}

void strides3(int64_t dst[3], const kiln__view *v) {
  for (int x = 0; x < 3; x++) dst[x] = v->strides[x];
}

} // namespace

/* Whether the flash kernels take these arguments: f16/bf16, q k v of one head dim 32, 64, 96 or 128,
** no mask, no dropout, keys to attend, layouts the 16-byte loads can read, and (backward)
** the forward's output in params. KILN_CUDA_ATTENTION=simple turns the path off. */
extern "C" bool kiln__cuda_flash_fits(const kiln__kargs *a) {
  const bool bw = a->op == KILN__K_ATTENTION_BACKWARD;
  if (a->op != KILN__K_ATTENTION && !bw) return false;
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2];
  kiln_dtype dt = q->dtype;
  if (dt != KILN_F16 && dt != KILN_BF16) return false;
  if ((a->i[0] & 2) || a->s[1] != 0) return false; /* a mask or dropout: cuda_attention.cu's kernels */
  if (a->n_in != (bw ? 4 : 3) || a->n_out != (bw ? 4 : 2)) return false;
  for (int i = 0; i < (bw ? 4 : 3); i++)
    if (a->in[i].dtype != dt || !loadable(&a->in[i])) return false;
  int64_t D = q->shape[3];
  if ((D != 32 && D != 64 && D != 96 && D != 128) || k->shape[3] != D || v->shape[3] != D || k->shape[2] < 1) return false;
  const kiln__view *lse = &a->out[bw ? 3 : 1];
  if (lse->dtype != KILN_F32) return false;
  for (int o = 0; o < (bw ? 3 : 1); o++)
    if (a->out[o].dtype != dt || !writable(&a->out[o])) return false;
  if (bw) {
    const kiln__view *o = (const kiln__view *)a->params;
    if (!o || o->dtype != dt || o->ndim != 4 || o->shape[3] != D || o->shape[2] != q->shape[2]) return false;
  }
  return kiln__knob_choice("KILN_CUDA_ATTENTION", 0) != 1; /* tc, simple */
}

extern "C" kiln_status kiln__cuda_flash(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  const bool bw = a->op == KILN__K_ATTENTION_BACKWARD;
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2];
  FlashArgs p;
  memset(&p, 0, sizeof p);
  p.q = q->data, p.k = k->data, p.v = v->data;
  p.B = q->shape[0], p.H = q->shape[1], p.Tq = q->shape[2], p.Tk = k->shape[2];
  strides3(p.qs, q), strides3(p.ks, k), strides3(p.vs, v);
  const kiln__view *lse = &a->out[bw ? 3 : 1];
  p.lse = (float *)lse->data;
  for (int x = 0; x < 3; x++) p.ls[x] = lse->strides[x];
  if (bw) {
    const kiln__view *o = (const kiln__view *)a->params;
    p.g = a->in[3].data, p.o = o->data;
    strides3(p.gs, &a->in[3]);
    for (int x = 0; x < 4; x++) p.os[x] = o->strides[x];
    p.dq = a->out[0].data, p.dk = a->out[1].data, p.dv = a->out[2].data;
    strides3(p.dqs, &a->out[0]), strides3(p.dks, &a->out[1]), strides3(p.dvs, &a->out[2]);
  } else {
    p.out = a->out[0].data;
    strides3(p.outs, &a->out[0]);
  }
  p.scale = (float)a->s[0];
  p.sl2 = (float)(a->s[0] * 1.4426950408889634);
  p.causal = (a->i[0] & 1) != 0;
  int64_t BH = p.B * p.H, nb = ((p.Tq > p.Tk ? p.Tq : p.Tk) + 63) / 64;
  if (BH * p.Tq == 0) return KILN_OK;
  if (BH * nb > INT32_MAX || BH * p.Tq / 8 + 1 > INT32_MAX)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_scaled_dot_product_attention: %lld x %lld rows are too many for "
                          "the cuda flash kernels", (long long)BH, (long long)p.Tq);
  if (q->dtype == KILN_F16) return run<__half>(d, a, p, q->shape[3]);
  return run<__nv_bfloat16>(d, a, p, q->shape[3]);
}
