/*
** Batch norm on CUDA: BATCH_NORM and BATCH_NORM_BACKWARD (backend.h gives the contracts;
** src/backend/cpu/cpu_batchnorm.c is the reference). x is seen as (N, C, S), in one of two
** layouts, each read along its inner dim with 16-byte vectors where the shapes allow:
**   cf: S innermost (NCHW, (N, C, L)): a channel is N runs of S contiguous elements;
**   cl: the channels innermost (channels-last, (N, C)): a row (n, s) holds C channels.
** The op layer (src/ops/ops_norm.c) gives every view of a call the same layout.
**
** Forward, training: three launches.
**   1. partial statistics: per (channel, split of its N*S elements) one block; each thread
**      keeps Welford's (count, mean, M2) over chunks of a vector (the chunk's own mean and
**      M2 merged by Chan et al.'s rule), the block merges its threads in a fixed order.
**      A channel's values never meet as E[x^2] - E[x]^2, so a mean far from 0 costs no
**      precision, however large N*S is.
**   2. one warp per channel merges the splits in f64 (lanes over splits, then a fixed
**      shuffle tree): the mean, the biased variance,
**      invstd = 1/sqrt(var + eps) (written as out1, the statistics backward reads), the
**      running statistics' update (PyTorch's rule, unbiased variance) and the per-channel
**      coefficients of pass 3.
**   3. y = (x - mean) * (w invstd) + b, elementwise, the rows in reverse: pass 1 read the
**      last rows last, and some are still in L2. Flag 8 applies the ReLU here; flag 16
**      (kiln_batch_norm_add_relu) adds the residual, read beside x, before it: ResNet's
**      block tail in this one pass instead of an add and a ReLU over the output again.
** Each thread loads 2-4 vectors before it uses any (enough bytes in flight to reach the
** bandwidth); a block's rows merge by a fixed tree.
**   With flag 32 (kiln__batch_norm_relu_max_pool2d: ResNet's stem) pass 3 is a max-pool
**   of relu(bn(x)) instead (pool_fwd_cl): each thread computes a window's values from x
**   and the coefficients, writes its maximum and a byte for the maximum's offset in the
**   window (RELU_MAX_POOL2D's outputs); the normalized map is never written.
** Eval: 2 (from the running statistics) and 3.
** Backward: the same shape: per-(channel, split) sums of g and g (x - mean) (the mean read
** from the saved statistics); one warp per channel: dbias = sum g, dweight = invstd sum g (x - mean), and dx's coefficients;
** dx = k g + cx (x - mean) + d0 elementwise (eval: k g). g goes through the mask (a ReLU's
** output, flag 2) where there is one; with flag 4 (batch_norm_add_relu's backward) pass 1,
** which reads g and the mask anyway, writes the masked g (the residual's gradient), and the
** dx pass reads that instead of g and the mask.
** Statistics and sums accumulate in f32 (f64 for f64 inputs), the splits in f64. Every
** reduction has a fixed order (no atomics): the same numbers on every run.
** Scratch (the partials and coefficients) comes from the caching allocator per call.
*/
#include "cuda_int.cuh"

#include <math.h>
#include <stdlib.h>

namespace {

enum { BN_THREADS = 256 };

/* A value of a runtime-typed per-channel vector. */
__device__ __forceinline__ double ld_vec(const void *p, int dt, int64_t i) {
  switch (dt) {
  case KILN_F32: return (double)((const float *)p)[i];
  case KILN_F64: return ((const double *)p)[i];
  case KILN_F16: return (double)__half2float(((const __half *)p)[i]);
  case KILN_BF16: return (double)__bfloat162float(((const __nv_bfloat16 *)p)[i]);
  default: return 0.0;
  }
}
__device__ __forceinline__ void st_vec(void *p, int dt, int64_t i, double v) {
  switch (dt) {
  case KILN_F32: ((float *)p)[i] = (float)v; break;
  case KILN_F64: ((double *)p)[i] = v; break;
  case KILN_F16: ((__half *)p)[i] = __float2half_rn((float)v); break;
  case KILN_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn((float)v); break;
  default: break;
  }
}

struct Vec {
  void *p;
  int dt;
  int64_t st;
};
__device__ __forceinline__ double vget(const Vec &v, int64_t i) { return ld_vec(v.p, v.dt, i * v.st); }
__device__ __forceinline__ void vset(const Vec &v, int64_t i, double x) { st_vec(v.p, v.dt, i * v.st, x); }


/* Geometry: (N, C, S), and the strides of x, of the other input (g) and of the output. */
struct Geo {
  int64_t N, C, S;
  int64_t xs[3], gs[3], ys[3];
  int64_t ms[3]; /* the third input's: the mask (backward, a ReLU folded in) or the residual (forward, flag 16) */
  int64_t os[3]; /* the masked gradient's (backward, flag 4: pass 1 writes it, pass 3 reads it as g) */
};

/* A value of g where the mask lets it through: the ReLU's backward, folded in. */
template <class T, class A> __device__ __forceinline__ A masked(T g, bool hm, int i, const T *mv) {
  A v = (A)kc_ld<T>(g);
  return hm && !((A)kc_ld<T>(mv[i]) > (A)0) ? (A)0 : v;
}

/* the fused ReLU of kiln_batch_norm_relu (flag 8): NaN passes, as kiln_relu's */
template <class A> __device__ __forceinline__ A relu_if(A v, bool relu) { return relu && v < (A)0 ? (A)0 : v; }

/* a * b + c in one rounding: written out so that the forward's normalized value and the
** backward's recomputation of it (bn_pre) are the same instruction whatever the compiler
** would contract */
__device__ __forceinline__ float bn_fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double bn_fma(double a, double b, double c) { return __fma_rn(a, b, c); }

/* bn(x) = (x - mean) k + b with the forward's per-channel coefficients, in A: the one
** definition the forward's normalizing pass and the backward's recomputed mask share. */
template <class T, class A> __device__ __forceinline__ A bn_pre(T x, A mean, A k, A b) {
  return bn_fma((A)kc_ld<T>(x) - mean, k, b);
}

/* the forward's value: bn(x), plus the residual's element where there is one (flag 16),
** then the ReLU where flag 8 asks */
template <class T, class A>
__device__ __forceinline__ T fwd_val(T x, A mean, A k, A b, bool hres, T r, bool relu) {
  A v = bn_pre<T, A>(x, mean, k, b);
  if (hres) v += (A)kc_ld<T>(r);
  return kc_st<T>(relu_if(v, relu));
}

/* The backward's recomputed mask (flag 8): whether the forward's output y = relu(bn(x)),
** or y = bn(x) under a separate ReLU, is > 0, from x and the forward's own coefficients.
** y > 0 <=> round_T(bn(x)) > 0: where bn(x) < 0 the ReLU gives +0 and the rounding of a
** negative is <= 0; where bn(x) >= 0 y is that rounding; NaN is neither. So the rounded
** value is compared, as the mask-reading path compares y: a positive that rounds to +0 (f16
** below 2^-25) is masked off on both paths. */
template <class T, class A> __device__ __forceinline__ bool fwd_pos(T x, A mean, A k, A b) {
  return (A)kc_ld<T>(kc_st<T>(bn_pre<T, A>(x, mean, k, b))) > (A)0;
}

/* The backward's arithmetic on the masked g, one definition for the mask read and the mask
** recomputed, with the fmas written out, so that the two paths are the same instructions on
** the same values (bit for bit, whatever the compiler would contract): dx = k g + cx (x -
** mean) + d0 (training), and the sum of g (x - mean) pass 1 accumulates. */
template <class A> __device__ __forceinline__ A dx_val(A k, A gv, A cx, A d, A d0) { return bn_fma(cx, d, bn_fma(k, gv, d0)); }
template <class A> __device__ __forceinline__ void gx_acc(A &sgx, A gv, A d) { sgx = bn_fma(gv, d, sgx); }

/* g where the recomputed mask passes it, else 0: masked()'s value */
template <class T, class A> __device__ __forceinline__ A rmasked(T g, T x, A mean, A k, A b) {
  return fwd_pos<T, A>(x, mean, k, b) ? (A)kc_ld<T>(g) : (A)0;
}

/* a / b where precision allows the fast path (the Welford weights) */
__device__ __forceinline__ float qdiv(float a, float b) { return __fdividef(a, b); }
__device__ __forceinline__ double qdiv(double a, double b) { return a / b; }

/* Chan et al.'s merge of (nb, mb, qb) into (n, m, q): counts, means, sums of squared
** deviations. */
template <class A> __device__ __forceinline__ void wmerge(A &n, A &m, A &q, A nb, A mb, A qb) {
  if (nb == (A)0) return;
  if (n == (A)0) {
    n = nb, m = mb, q = qb;
    return;
  }
  A nn = n + nb, d = mb - m, r = qdiv(nb, nn);
  m += d * r;
  q += qb + d * d * n * r;
  n = nn;
}

/* The Welford state of a chunk of V values merged into (n, m, q). */
template <class A, int V> __device__ __forceinline__ void wchunk(A &n, A &m, A &q, const A *v) {
  A s = 0;
#pragma unroll
  for (int i = 0; i < V; i++) s += v[i];
  A cm = s * ((A)1 / (A)V), c2 = 0;
#pragma unroll
  for (int i = 0; i < V; i++) c2 += (v[i] - cm) * (v[i] - cm);
  wmerge<A>(n, m, q, (A)V, cm, c2);
}

/* Block-wide Welford merge in a fixed order: warps by shuffles, then thread 0 merges the
** warps' results in warp order. The result is valid in thread 0. */
template <class A> __device__ void block_welford(A &n, A &m, A &q) {
  __shared__ A sh[3][BN_THREADS / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    A nb = __shfl_down_sync(0xffffffffu, n, o), mb = __shfl_down_sync(0xffffffffu, m, o),
      qb = __shfl_down_sync(0xffffffffu, q, o);
    wmerge<A>(n, m, q, nb, mb, qb);
  }
  int w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if ((threadIdx.x & 31) == 0) sh[0][w] = n, sh[1][w] = m, sh[2][w] = q;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int k = 1; k < nw; k++) wmerge<A>(n, m, q, sh[0][k], sh[1][k], sh[2][k]);
}

/* Block-wide sums of two values (fixed order); valid in thread 0. */
template <class A> __device__ void block_sum2(A &a, A &b) {
  __shared__ A sh[2][BN_THREADS / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    a += __shfl_down_sync(0xffffffffu, a, o);
    b += __shfl_down_sync(0xffffffffu, b, o);
  }
  int w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  if ((threadIdx.x & 31) == 0) sh[0][w] = a, sh[1][w] = b;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int k = 1; k < nw; k++) a += sh[0][k], b += sh[1][k];
}

/* (n, s) of the row `step` further: (dn, ds) = (step / S, step % S), one carry (ds < S). */
__device__ __forceinline__ void radv(int64_t &n, int64_t &s, int64_t dn, int64_t ds, int64_t S) {
  n += dn, s += ds;
  if (s >= S) s -= S, n++;
}

/* Rows (or vectors) a thread loads before it uses any: a lone 16-byte load in flight per
** thread left the first version latency bound (the channels-last statistics ran at about
** a third of the NCHW pass's bandwidth on the H200). */
enum { BN_U = 4 };
/* (Occupancy: ptxas gives the bf16 8-wide channels-last kernels that walk (n, s) 118-124
** registers, pass 3 and pass 1's backward: two blocks of 256 an SM. Capping them at 80
** registers for three blocks spilled 100-360 bytes a thread in the loop (ptxas -v), so they
** are left uncapped. The FLAT kernels, for evenly strided rows with the third input's
** presence a template argument, take 48-104: pass 3's forward 64 (78 with the residual),
** three or four blocks an SM.) */

/* ---- pass 1, cf: block (channel blockIdx.x, split blockIdx.y) over that channel's
** N * S/V vectors, flattened as (n, sv); (n, sv) advance by subtraction, no division in
** the loop, BN_U vectors loaded at a time. BW: the backward sums (g, g (x - mean))
** instead of the statistics, the mean read at meanp[c * mst]. RC (backward, flag 8): the
** mask recomputed from x with the forward's coefficients (fkp, fbp, stride mst) instead
** of read. */
template <class T, class A, int V, bool BW, bool RC = false>
__global__ void __launch_bounds__(BN_THREADS)
    pass1_cf(const T *__restrict__ x, const T *__restrict__ g, const T *__restrict__ mk, T *__restrict__ gm, Geo G,
             A *__restrict__ part, const A *__restrict__ meanp, int64_t mst, const A *__restrict__ fkp,
             const A *__restrict__ fbp) {
  const int64_t c = blockIdx.x, splits = gridDim.y, sp = blockIdx.y;
  const int64_t SV = G.S / V, total = G.N * SV, per = (total + splits - 1) / splits;
  const int64_t j0 = sp * per, j1 = j0 + per < total ? j0 + per : total;
  const T *xc = x + c * G.xs[1];
  const T *gc = BW ? g + c * G.gs[1] : NULL;
  const T *mc = BW && !RC && mk ? mk + c * G.ms[1] : NULL;
  T *oc = BW && !RC && gm ? gm + c * G.os[1] : NULL;
  A n = 0, m = 0, q = 0;           /* statistics */
  A sg = 0, sgx = 0, mean = 0;     /* backward sums */
  A fk = 0, fb = 0;                /* the forward's coefficients (RC) */
  if (BW) mean = meanp[c * mst];
  if (RC) fk = fkp[c * mst], fb = fbp[c * mst];
  const int64_t B = blockDim.x;
  int64_t j = j0 + threadIdx.x;
  int64_t nn = j / SV, sv = j - nn * SV;
  const int64_t dn = B / SV, dsv = B - dn * SV;
  typedef kc_vec<T, V> P;
  constexpr int U = BW ? 2 : BN_U; /* the backward loads three vectors a step */
  for (;;) {
    const int u_n = j + (U - 1) * B < j1 ? U : j < j1 ? 1 : 0; /* a full batch, or the tail one by one */
    if (u_n == 0) break;
    P px[U], pg[U], pm[U];
    int64_t oo[U]; /* where the masked g goes (flag 4) */
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (u < u_n) {
        px[u] = *reinterpret_cast<const P *>(xc + nn * G.xs[0] + sv * V);
        if (BW) {
          pg[u] = *reinterpret_cast<const P *>(gc + nn * G.gs[0] + sv * V);
          if (mc) pm[u] = *reinterpret_cast<const P *>(mc + nn * G.ms[0] + sv * V);
          oo[u] = nn * G.os[0] + sv * V;
        }
        radv(nn, sv, dn, dsv, SV);
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (u < u_n) {
        A v[V];
#pragma unroll
        for (int i = 0; i < V; i++) v[i] = (A)kc_ld<T>(px[u].v[i]);
        if (!BW) {
          wchunk<A, V>(n, m, q, v);
        } else {
          P po;
#pragma unroll
          for (int i = 0; i < V; i++) {
            A gv = RC ? rmasked<T, A>(pg[u].v[i], px[u].v[i], mean, fk, fb)
                      : masked<T, A>(pg[u].v[i], mc != NULL, i, pm[u].v);
            po.v[i] = kc_st<T>(gv); /* exact: g or 0, RELU_BACKWARD's value */
            sg += gv;
            gx_acc<A>(sgx, gv, v[i] - mean);
          }
          if (oc) *reinterpret_cast<P *>(oc + oo[u]) = po;
        }
      }
    }
    j += (int64_t)u_n * B;
  }
  if (!BW) {
    block_welford<A>(n, m, q);
    if (threadIdx.x == 0) {
      A *p = part + (c * splits + sp) * 3;
      p[0] = n, p[1] = m, p[2] = q;
    }
  } else {
    block_sum2<A>(sg, sgx);
    if (threadIdx.x == 0) {
      A *p = part + (c * splits + sp) * 2;
      p[0] = sg, p[1] = sgx;
    }
  }
}

/* One row of pass1_cl: V channels' Welford update (their count shared, so one reciprocal
** serves V updates), or the backward's sums of g and g (x - mean). */
template <class T, class A, int V, bool BW, bool RC>
__device__ __forceinline__ void cl_row(A &n, A *m, A *q, const A *mean, const kc_vec<T, V> &px,
                                       const kc_vec<T, V> &pg, bool hm, const kc_vec<T, V> &pm, kc_vec<T, V> &po,
                                       const A *fk, const A *fb) {
  if (!BW) {
    n += (A)1;
    A rc = qdiv((A)1, n);
#pragma unroll
    for (int i = 0; i < V; i++) {
      A v = (A)kc_ld<T>(px.v[i]), d = v - m[i];
      m[i] += d * rc;
      q[i] += d * (v - m[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; i++) {
      A gv = RC ? rmasked<T, A>(pg.v[i], px.v[i], mean[i], fk[i], fb[i]) : masked<T, A>(pg.v[i], hm, i, pm.v);
      po.v[i] = kc_st<T>(gv);                        /* exact: g or 0, RELU_BACKWARD's value */
      m[i] += gv;                                     /* sum g */
      gx_acc<A>(q[i], gv, (A)kc_ld<T>(px.v[i]) - mean[i]); /* sum g (x - mean) */
    }
  }
}

/* Loads pass1_cl's next batch of rows (U of them, or the tail's one) from row r on, and
** advances r, (nn, s) past them; the batch's size, 0 past r1. FLAT: every tensor's rows
** are evenly strided (strides[0] = S strides[2], as a contiguous channels-last tensor's),
** so row r is at r strides[2] and (nn, s) are not kept. */
template <class T, int V, bool BW, int U, bool FLAT>
__device__ __forceinline__ int cl_load(const T *__restrict__ x, const T *__restrict__ g, const T *__restrict__ mk,
                                       bool hm, const Geo &G, int64_t co, int64_t &r, int64_t r1, int64_t &nn,
                                       int64_t &s, int64_t dn, int64_t ds, int TY, kc_vec<T, V> *px, kc_vec<T, V> *pg,
                                       kc_vec<T, V> *pm, int64_t *oo) {
  typedef kc_vec<T, V> P;
  const int u_n = r + (int64_t)(U - 1) * TY < r1 ? U : r < r1 ? 1 : 0; /* a full batch, or the tail one by one */
#pragma unroll
  for (int u = 0; u < U; u++) {
    if (u < u_n) {
      const int64_t ru = r + (int64_t)u * TY;
      px[u] = *reinterpret_cast<const P *>(x + (FLAT ? ru * G.xs[2] : nn * G.xs[0] + s * G.xs[2]) + co);
      if (BW) {
        pg[u] = *reinterpret_cast<const P *>(g + (FLAT ? ru * G.gs[2] : nn * G.gs[0] + s * G.gs[2]) + co);
        if (hm) pm[u] = *reinterpret_cast<const P *>(mk + (FLAT ? ru * G.ms[2] : nn * G.ms[0] + s * G.ms[2]) + co);
        oo[u] = (FLAT ? ru * G.os[2] : nn * G.os[0] + s * G.os[2]) + co;
      }
      if (!FLAT) radv(nn, s, dn, ds, G.S);
    }
  }
  r += (int64_t)u_n * TY;
  return u_n;
}

/* ---- pass 1, cl: block (TX channel vectors) x (256 / TX rows); blockIdx.x picks the
** channel vectors, blockIdx.y the split of the N*S rows. A thread keeps V channels' states
** over rows ty, ty + TY, ... of its split, BN_U rows loaded at a time; the block's rows
** then merge by a fixed tree through shared memory (row k takes row k + h, h = TY/2 .. 1). */
template <class T, class A, int V, bool BW, bool RC = false, bool FLAT = false, int MKS = -1>
__global__ void __launch_bounds__(BN_THREADS)
    pass1_cl(const T *__restrict__ x, const T *__restrict__ g, const T *__restrict__ mk, T *__restrict__ gm, Geo G,
             A *__restrict__ part, const A *__restrict__ meanp, int64_t mst, const A *__restrict__ fkp,
             const A *__restrict__ fbp) {
  const int TX = blockDim.x, TY = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
  const int64_t CV = (G.C + V - 1) / V, cv = (int64_t)blockIdx.x * TX + tx;
  const int64_t R = G.N * G.S, splits = gridDim.y, sp = blockIdx.y, per = (R + splits - 1) / splits;
  const int64_t r0 = sp * per, r1 = r0 + per < R ? r0 + per : R;
  const bool on = cv < CV;
  A n = 0, m[V], q[V];
#pragma unroll
  for (int i = 0; i < V; i++) m[i] = 0, q[i] = 0;
  A mean[V];
#pragma unroll
  for (int i = 0; i < V; i++) mean[i] = BW && on ? meanp[(cv * V + i) * mst] : (A)0;
  A fk[RC ? V : 1], fb[RC ? V : 1]; /* the forward's coefficients (RC) */
  if (RC)
#pragma unroll
    for (int i = 0; i < V; i++) fk[i] = on ? fkp[(cv * V + i) * mst] : (A)0, fb[i] = on ? fbp[(cv * V + i) * mst] : (A)0;
  if (RC) mk = NULL, gm = NULL;
  /* MKS 1: the mask read and the masked g written, 0: neither, known at compile time (as
  ** pass3_cl's); -1: as mk and gm are */
  const bool hm = MKS < 0 ? mk != NULL : MKS == 1 && !RC, hg = MKS < 0 ? gm != NULL : MKS == 1 && !RC;
  typedef kc_vec<T, V> P;
  constexpr int U = BW ? 2 : BN_U;
  int64_t r = r0 + ty;
  int64_t nn = FLAT ? 0 : r / G.S, s = r - nn * G.S;
  const int64_t dn = FLAT ? 0 : TY / G.S, ds = TY - dn * G.S;
  const int64_t co = cv * V;
  if constexpr (FLAT && !BW) {
    /* the statistics, 8 rows a batch, then the tail one by one: fewer registers and twice
    ** the loads in flight of cl_load's batches of BN_U, measured faster (bench/RESULTS.md) */
    if (on) {
      const T *xr = x + co + r * G.xs[2];
      const int64_t st = TY * G.xs[2];
      P none, po;
      for (; r + 7 * (int64_t)TY < r1; r += 8 * (int64_t)TY, xr += 8 * st) {
        P px[8];
#pragma unroll
        for (int u = 0; u < 8; u++) px[u] = *reinterpret_cast<const P *>(xr + u * st);
#pragma unroll
        for (int u = 0; u < 8; u++) cl_row<T, A, V, false, false>(n, m, q, mean, px[u], none, false, none, po, fk, fb);
      }
      for (; r < r1; r += TY, xr += st)
        cl_row<T, A, V, false, false>(n, m, q, mean, *reinterpret_cast<const P *>(xr), none, false, none, po, fk, fb);
    }
  } else {
    P px[U], pg[U], pm[U];
    int64_t oo[U]; /* where the masked g goes (flag 4) */
    int u_n = on ? cl_load<T, V, BW, U, FLAT>(x, g, mk, hm, G, co, r, r1, nn, s, dn, ds, TY, px, pg, pm, oo) : 0;
    while (u_n) {
#pragma unroll
      for (int u = 0; u < U; u++)
        if (u < u_n) {
          P po;
          cl_row<T, A, V, BW, RC>(n, m, q, mean, px[u], pg[u], hm, pm[u], po, fk, fb);
          if (BW && hg) *reinterpret_cast<P *>(gm + oo[u]) = po;
        }
      u_n = cl_load<T, V, BW, U, FLAT>(x, g, mk, hm, G, co, r, r1, nn, s, dn, ds, TY, px, pg, pm, oo);
    }
  }
  /* the block's rows by a fixed tree */
  extern __shared__ __align__(16) unsigned char smem_raw[];
  A *sh = reinterpret_cast<A *>(smem_raw); /* [TY][TX][2V + 1] */
  const int W = 2 * V + 1;
  A *mine = sh + ((int64_t)ty * TX + tx) * W;
  mine[0] = n;
#pragma unroll
  for (int i = 0; i < V; i++) mine[1 + i] = m[i], mine[1 + V + i] = q[i];
  __syncthreads();
  for (int h = TY / 2; h >= 1; h >>= 1) {
    if (ty < h) {
      const A *o = sh + ((int64_t)(ty + h) * TX + tx) * W;
      if (!BW) {
        A nb = o[0];
        if (nb > (A)0) {
          if (n == (A)0) {
            n = nb;
#pragma unroll
            for (int i = 0; i < V; i++) m[i] = o[1 + i], q[i] = o[1 + V + i];
          } else {
            A nt = n + nb, rr = qdiv(nb, nt);
#pragma unroll
            for (int i = 0; i < V; i++) {
              A d = o[1 + i] - m[i];
              m[i] += d * rr;
              q[i] += o[1 + V + i] + d * d * n * rr;
            }
            n = nt;
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < V; i++) m[i] += o[1 + i], q[i] += o[1 + V + i];
      }
      mine[0] = n;
#pragma unroll
      for (int i = 0; i < V; i++) mine[1 + i] = m[i], mine[1 + V + i] = q[i];
    }
    __syncthreads();
  }
  if (ty != 0 || !on) return;
#pragma unroll
  for (int i = 0; i < V; i++) {
    int64_t c = cv * V + i;
    if (c >= G.C) break;
    if (!BW) {
      A *p = part + (c * splits + sp) * 3;
      p[0] = n, p[1] = m[i], p[2] = q[i];
    } else {
      A *p = part + (c * splits + sp) * 2;
      p[0] = m[i], p[1] = q[i];
    }
  }
}

/* ---- pass 2 (forward): per channel; coef gets [mean | w invstd | b] (3 x C). With
** statistics of 4 rows (the op layer's on CUDA), rows 2 and 3 get w invstd and b as pass 3
** uses them (coef's values, in A = the statistics' dtype: exact), for the backward's
** recomputed mask (flag 8); row 0's mean is coef's already. */
struct FinF {
  int64_t C;
  int splits;
  bool train, has_w, has_b, has_r, coef_rows;
  double eps, momentum;
  Vec w, b, rm, rv;
  void *stats;
  int stats_dt;
  int64_t st0, st1;
};
/* The finishing kernels: one block of FIN_THREADS per channel, each thread over splits t,
** t + FIN_THREADS, ..., in f64, then block_sum2's fixed tree. (One warp a channel, each lane
** merging its few dozen splits in turn, waited on each partial's load and on a chain of
** Welford merges: longer than a small layer's statistics pass, bench/RESULTS.md.) The
** statistics merge in two sums rather than Chan's chain: the count and
** sum n_k m_k give the mean, then sum q_k + n_k (m_k - mean)^2 the squared deviations --
** independent adds, no division a split, the same exactness in f64. */
enum { FIN_THREADS = 128 };

/* a + b over the block, both threads' totals, in every thread (fixed order) */
__device__ __forceinline__ void block_sum2_all(double &a, double &b) {
  __shared__ double tot[2];
  block_sum2<double>(a, b);
  if (threadIdx.x == 0) tot[0] = a, tot[1] = b;
  __syncthreads();
  a = tot[0], b = tot[1];
}

template <class A> __global__ void __launch_bounds__(FIN_THREADS) fin_fwd(const A *__restrict__ part, FinF f, A *__restrict__ coef) {
  const int64_t c = blockIdx.x;
  double mean, var;
  if (f.train) {
    const A *pc = part + c * f.splits * 3;
    double n = 0, s = 0;
#pragma unroll 4
    for (int k = threadIdx.x; k < f.splits; k += FIN_THREADS) {
      const double nk = (double)pc[k * 3];
      n += nk, s += nk * (double)pc[k * 3 + 1];
    }
    block_sum2_all(n, s);
    mean = n > 0 ? s / n : 0.0;
    double q = 0, unused = 0;
#pragma unroll 4
    for (int k = threadIdx.x; k < f.splits; k += FIN_THREADS) {
      const double d = (double)pc[k * 3 + 1] - mean;
      q += (double)pc[k * 3 + 2] + (double)pc[k * 3] * d * d;
    }
    block_sum2<double>(q, unused);
    if (threadIdx.x != 0) return;
    var = q / n;
    if (f.has_r) {
      double mo = f.momentum;
      vset(f.rm, c, (1.0 - mo) * vget(f.rm, c) + mo * mean);
      vset(f.rv, c, (1.0 - mo) * vget(f.rv, c) + mo * (n > 1 ? q / (n - 1.0) : (double)NAN));
    }
  } else {
    if (threadIdx.x != 0) return;
    mean = vget(f.rm, c);
    var = vget(f.rv, c);
  }
  double inv = 1.0 / sqrt(var + f.eps);
  st_vec(f.stats, f.stats_dt, c * f.st1, mean);
  st_vec(f.stats, f.stats_dt, f.st0 + c * f.st1, inv);
  double w = f.has_w ? vget(f.w, c) : 1.0, b = f.has_b ? vget(f.b, c) : 0.0;
  const A am = (A)mean, ak = (A)(w * inv), ab = (A)b;
  coef[c] = am;
  coef[f.C + c] = ak;
  coef[2 * f.C + c] = ab;
  if (f.coef_rows) {
    st_vec(f.stats, f.stats_dt, 2 * f.st0 + c * f.st1, (double)ak);
    st_vec(f.stats, f.stats_dt, 3 * f.st0 + c * f.st1, (double)ab);
  }
}

/* ---- pass 2 (backward): per channel; writes dweight, dbias and coef [k | cx | d0]
** (3 x C) after the mean (coef[0..C) already holds it, from the statistics); with the
** mask recomputed (flag 8), coef[4C..6C) the forward's w invstd and b (statistics rows 2
** and 3) for pass 3. */
struct FinB {
  int64_t C;
  int splits;
  bool train, has_w, rc;
  double M;
  Vec w, dw, db;
  const void *stats;
  int stats_dt;
  int64_t st0, st1;
};
/* One block per channel, as fin_fwd: the sums of g and g (x - mean) over the splits in f64.
** Also writes the mean to coef[0..C) for pass 3. */
template <class A> __global__ void __launch_bounds__(FIN_THREADS) fin_bwd(const A *__restrict__ part, FinB f, A *__restrict__ coef) {
  const int64_t c = blockIdx.x;
  const A *pc = part + c * f.splits * 2;
  double sg = 0, sgx = 0;
#pragma unroll 4
  for (int k = threadIdx.x; k < f.splits; k += FIN_THREADS) sg += (double)pc[k * 2], sgx += (double)pc[k * 2 + 1];
  block_sum2<double>(sg, sgx);
  if (threadIdx.x != 0) return;
  double inv = ld_vec(f.stats, f.stats_dt, f.st0 + c * f.st1);
  double w = f.has_w ? vget(f.w, c) : 1.0, k = w * inv, dw = sgx * inv;
  vset(f.dw, c, dw);
  vset(f.db, c, sg);
  double cx = 0, d0 = 0;
  if (f.train && f.M > 0) {
    /* dx = k (g - sum(g)/M - xhat sum(g xhat)/M), xhat = (x - mean) inv */
    cx = -k * inv * dw / f.M;
    d0 = -k * sg / f.M;
  }
  coef[c] = (A)ld_vec(f.stats, f.stats_dt, c * f.st1);
  coef[f.C + c] = (A)k;
  coef[2 * f.C + c] = (A)cx;
  coef[3 * f.C + c] = (A)d0;
  if (f.rc) {
    coef[4 * f.C + c] = (A)ld_vec(f.stats, f.stats_dt, 2 * f.st0 + c * f.st1);
    coef[5 * f.C + c] = (A)ld_vec(f.stats, f.stats_dt, 3 * f.st0 + c * f.st1);
  }
}

/* backward's first pass wants the mean in coef[0..C) */
template <class A> __global__ void load_mean(FinB f, A *__restrict__ coef) {
  int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c < f.C) coef[c] = (A)ld_vec(f.stats, f.stats_dt, c * f.st1);
}

/* ---- pass 3, cf: elementwise over rows (n, c) x their S/V vectors. RPB rows per block
** when a row has fewer vectors than threads (S = 49 at ResNet's last stage), else one row
** and a loop. Forward: y = (x - mean) k + b. Backward (BW): dx = k g + cx (x - mean) + d0
** (TRAIN), or k g (eval: x is not read); g through the mask where there is one, or (RC)
** through the mask recomputed from x with the forward's coefficients coef[4C..6C) (x read
** in eval too). */
template <class T, class A, int V, bool BW, bool TRAIN, bool RC = false>
__global__ void __launch_bounds__(BN_THREADS)
    pass3(const T *__restrict__ x, const T *__restrict__ g, const T *__restrict__ mk, T *__restrict__ y, Geo G,
          const A *__restrict__ coef, int64_t inner, int64_t rpb, bool relu, bool rev) {
  const int64_t rows = G.N * G.C;
  int64_t rr = threadIdx.x / inner, v0 = threadIdx.x - rr * inner;
  if (rr >= rpb) return;
  /* the last rows first: pass 1 read them last, so they may still be in L2 */
  const int64_t row = (int64_t)(rev ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * rpb + rr;
  if (row >= rows) return;
  const int64_t C = G.C, n = row / C, c = row - n * C;
  const int64_t step = rpb == 1 ? blockDim.x : inner;
  const int64_t xo = n * G.xs[0] + c * G.xs[1], go = n * G.gs[0] + c * G.gs[1], yo = n * G.ys[0] + c * G.ys[1],
                mo = n * G.ms[0] + c * G.ms[1];
  const A mean = coef[c], kk = coef[C + c], pp = coef[2 * C + c], qq = BW ? coef[3 * C + c] : (A)0;
  const A fk = RC ? coef[4 * C + c] : (A)0, fb = RC ? coef[5 * C + c] : (A)0;
  if (RC) mk = NULL;
  for (int64_t v = v0; v < inner; v += step) {
    kc_vec<T, V> out;
    if (!BW) {
      kc_vec<T, V> px = *reinterpret_cast<const kc_vec<T, V> *>(x + xo + v * V), pr;
      if (mk) pr = *reinterpret_cast<const kc_vec<T, V> *>(mk + mo + v * V); /* the residual */
#pragma unroll
      for (int i = 0; i < V; i++) out.v[i] = fwd_val<T, A>(px.v[i], mean, kk, pp, mk != NULL, pr.v[i], relu);
    } else {
      kc_vec<T, V> pg = *reinterpret_cast<const kc_vec<T, V> *>(g + go + v * V), pm;
      if (mk) pm = *reinterpret_cast<const kc_vec<T, V> *>(mk + mo + v * V);
      if (RC) {
        kc_vec<T, V> px = *reinterpret_cast<const kc_vec<T, V> *>(x + xo + v * V);
#pragma unroll
        for (int i = 0; i < V; i++) {
          A gv = rmasked<T, A>(pg.v[i], px.v[i], mean, fk, fb);
          out.v[i] = TRAIN ? kc_st<T>(dx_val<A>(kk, gv, pp, (A)kc_ld<T>(px.v[i]) - mean, qq)) : kc_st<T>(kk * gv);
        }
      } else if (TRAIN) {
        kc_vec<T, V> px = *reinterpret_cast<const kc_vec<T, V> *>(x + xo + v * V);
#pragma unroll
        for (int i = 0; i < V; i++)
          out.v[i] =
              kc_st<T>(dx_val<A>(kk, masked<T, A>(pg.v[i], mk != NULL, i, pm.v), pp, (A)kc_ld<T>(px.v[i]) - mean, qq));
      } else {
#pragma unroll
        for (int i = 0; i < V; i++) out.v[i] = kc_st<T>(kk * masked<T, A>(pg.v[i], mk != NULL, i, pm.v));
      }
    }
    *reinterpret_cast<kc_vec<T, V> *>(y + yo + v * V) = out;
  }
}

/* ---- pass 3, cl: block (TX channel vectors) x (TY rows) as pass 1's; each thread keeps
** its V channels' coefficients in registers and walks rows ty, ty + TY, ... of its block
** row's chunk ((n, s) advanced by subtraction), U rows loaded before
** any is used. (pass3 above reloaded three coefficient vectors per data vector here: the
** channels-last forward ran at a third of the NCHW one's bandwidth on the H200.) */
template <class T, class A, int V, bool BW, bool TRAIN, bool RC>
__device__ __forceinline__ kc_vec<T, V> p3_row(const kc_vec<T, V> &px, const kc_vec<T, V> &pg, bool hmk,
                                             const kc_vec<T, V> &pmk, const kc_vec<A, V> &pm, const kc_vec<A, V> &pk,
                                             const kc_vec<A, V> &pp, const kc_vec<A, V> &pq, bool relu,
                                             const kc_vec<A, V> &fk, const kc_vec<A, V> &fb) {
  kc_vec<T, V> out;
  if (RC) { /* the backward, its mask recomputed from x */
#pragma unroll
    for (int i = 0; i < V; i++) {
      A gv = rmasked<T, A>(pg.v[i], px.v[i], pm.v[i], fk.v[i], fb.v[i]);
      out.v[i] = TRAIN ? kc_st<T>(dx_val<A>(pk.v[i], gv, pp.v[i], (A)kc_ld<T>(px.v[i]) - pm.v[i], pq.v[i]))
                       : kc_st<T>(pk.v[i] * gv);
    }
  } else if (!BW) { /* pmk: the residual where hmk */
#pragma unroll
    for (int i = 0; i < V; i++) out.v[i] = fwd_val<T, A>(px.v[i], pm.v[i], pk.v[i], pp.v[i], hmk, pmk.v[i], relu);
  } else if (TRAIN) {
#pragma unroll
    for (int i = 0; i < V; i++)
      out.v[i] = kc_st<T>(
          dx_val<A>(pk.v[i], masked<T, A>(pg.v[i], hmk, i, pmk.v), pp.v[i], (A)kc_ld<T>(px.v[i]) - pm.v[i], pq.v[i]));
  } else {
#pragma unroll
    for (int i = 0; i < V; i++) out.v[i] = kc_st<T>(pk.v[i] * masked<T, A>(pg.v[i], hmk, i, pmk.v));
  }
  return out;
}

template <class T, class A, int V, bool BW, bool TRAIN, bool RC = false, bool FLAT = false, int MKS = -1>
__global__ void __launch_bounds__(BN_THREADS)
    pass3_cl(const T *__restrict__ x, const T *__restrict__ g, const T *__restrict__ mk, T *__restrict__ y, Geo G,
             const A *__restrict__ coef, int64_t chunk, bool relu, bool rev) {
  const int64_t CV = G.C / V, cv = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (cv >= CV) return;
  /* block row by takes rows [r0, r1), the last chunk first: pass 1 read the rows in order,
  ** so the last it read may still be in L2 (50 MB on the H200) */
  const int64_t C = G.C, R = G.N * G.S, step = blockDim.y, c0 = cv * V;
  const int64_t by = rev ? (int64_t)gridDim.y - 1 - blockIdx.y : (int64_t)blockIdx.y, r0 = by * chunk,
                r1 = r0 + chunk < R ? r0 + chunk : R;
  typedef kc_vec<A, V> PA;
  typedef kc_vec<T, V> P;
  const PA pm = *reinterpret_cast<const PA *>(coef + c0), pk = *reinterpret_cast<const PA *>(coef + C + c0),
           pp = *reinterpret_cast<const PA *>(coef + 2 * C + c0);
  PA pq, fk, fb;
  if (BW) pq = *reinterpret_cast<const PA *>(coef + 3 * C + c0);
  if (RC) {
    fk = *reinterpret_cast<const PA *>(coef + 4 * C + c0), fb = *reinterpret_cast<const PA *>(coef + 5 * C + c0);
    mk = NULL;
  }
  const bool rx = !BW || TRAIN || RC; /* x is read */
  constexpr int U = BW && (TRAIN || RC) ? 2 : BN_U; /* three loads a row in the training backward */
  int64_t r = r0 + threadIdx.y;
  if constexpr (FLAT) { /* rows evenly strided (cl_load): full batches, then the tail one by one.
    ** MKS: whether there is a third input (mask or residual), known at compile time (a
    ** run-time choice between the two doubled the forward's registers, bench/RESULTS.md) */
    constexpr bool hm = MKS == 1 && !RC;
    const T *xr = x + c0 + r * G.xs[2], *gr = g + c0 + r * G.gs[2], *mr = hm ? mk + c0 + r * G.ms[2] : NULL;
    T *yr = y + c0 + r * G.ys[2];
    const int64_t bx = U * step * G.xs[2], bg = U * step * G.gs[2], bm = U * step * G.ms[2], by = U * step * G.ys[2];
    for (; r + (int64_t)(U - 1) * step < r1; r += U * step) {
      P px[U], pg[U], pmk[U];
#pragma unroll
      for (int u = 0; u < U; u++) {
        if (rx) px[u] = *reinterpret_cast<const P *>(xr + u * step * G.xs[2]);
        if (BW) pg[u] = *reinterpret_cast<const P *>(gr + u * step * G.gs[2]);
        if (hm) pmk[u] = *reinterpret_cast<const P *>(mr + u * step * G.ms[2]);
      }
#pragma unroll
      for (int u = 0; u < U; u++)
        *reinterpret_cast<P *>(yr + u * step * G.ys[2]) =
            p3_row<T, A, V, BW, TRAIN, RC>(px[u], pg[u], hm, pmk[u], pm, pk, pp, pq, relu, fk, fb);
      xr += bx, gr += bg, yr += by;
      if (hm) mr += bm;
    }
    for (; r < r1; r += step) {
      P px, pg, pmk;
      if (rx) px = *reinterpret_cast<const P *>(x + c0 + r * G.xs[2]);
      if (BW) pg = *reinterpret_cast<const P *>(g + c0 + r * G.gs[2]);
      if (hm) pmk = *reinterpret_cast<const P *>(mk + c0 + r * G.ms[2]);
      *reinterpret_cast<P *>(y + c0 + r * G.ys[2]) =
          p3_row<T, A, V, BW, TRAIN, RC>(px, pg, hm, pmk, pm, pk, pp, pq, relu, fk, fb);
    }
    return;
  }
  int64_t n = r / G.S, s = r - n * G.S;
  const int64_t dn = step / G.S, ds = step - dn * G.S;
  for (;;) {
    const int u_n = r + (int64_t)(U - 1) * step < r1 ? U : r < r1 ? 1 : 0;
    if (u_n == 0) break;
    P px[U], pg[U], pmk[U];
    int64_t yo[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (u < u_n) {
        if (rx) px[u] = *reinterpret_cast<const P *>(x + n * G.xs[0] + s * G.xs[2] + c0);
        if (BW) pg[u] = *reinterpret_cast<const P *>(g + n * G.gs[0] + s * G.gs[2] + c0);
        if (mk) pmk[u] = *reinterpret_cast<const P *>(mk + n * G.ms[0] + s * G.ms[2] + c0); /* mask or residual */
        yo[u] = n * G.ys[0] + s * G.ys[2] + c0;
        radv(n, s, dn, ds, G.S);
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++)
      if (u < u_n)
        *reinterpret_cast<P *>(y + yo[u]) =
            p3_row<T, A, V, BW, TRAIN, RC>(px[u], pg[u], mk != NULL, pmk[u], pm, pk, pp, pq, relu, fk, fb);
    r += (int64_t)u_n * step;
  }
}

/* ---- host side ---- */

/* Tuning knobs, read once from the environment, for A/B runs on a device (.integ/bnfuse.sh
** sweeps them; the defaults are the measured choice):
**   KILN_BN_P1_BPS     pass 1's grid: blocks per SM it aims for (default 8, 4 for the FLAT
**                      statistics pass); 0: exactly the blocks the SMs hold at once (the
**                      occupancy calculator), one wave of equal blocks and no tail, at the
**                      cost of the reverse-order L2 reuse (every block's last rows are in
**                      L2 then, not the tensor's);
**   KILN_BN_P3_ROWS    channels-last pass 3: rows per thread (default 16);
**   KILN_BN_P3_REVERSE 0: pass 3 walks the rows forward instead of last first;
**   KILN_BN_FLAT       0: the channels-last passes walk (n, s) even where every tensor's
**                      rows are evenly strided. */
struct Knobs {
  int p1_bps, p3_rows;
  bool reverse, flat;
};
const Knobs &knobs() {
  static const Knobs k = [] {
    Knobs r;
    r.p1_bps = (int)kiln__knob_int("KILN_BN_P1_BPS", -1); /* -1: unset */
    r.p3_rows = (int)kiln__knob_int("KILN_BN_P3_ROWS", 16);
    r.reverse = kiln__knob_on("KILN_BN_P3_REVERSE", true);
    r.flat = kiln__knob_on("KILN_BN_FLAT", true);
    return r;
  }();
  return k;
}

/* whether a view's rows (n, s) are evenly strided: row r at r strides[2] (the FLAT kernels) */
bool rows_flat(const int64_t *st, const Geo &G) { return G.N <= 1 || st[0] == G.S * st[2]; }
/* whether channels-last pass 1 takes its FLAT kernels */
bool p1_flat(const Geo &G) {
  return knobs().flat && rows_flat(G.xs, G) && rows_flat(G.gs, G) && rows_flat(G.ms, G) && rows_flat(G.os, G);
}

bool cf_ok(const kiln__view *v) { return v->shape[2] <= 1 || v->strides[2] == 1; }
bool cl_ok(const kiln__view *v) { return v->shape[1] <= 1 || v->strides[1] == 1; }

/* The mask of a backward (a ReLU's input), or NULL. */
const kiln__view *mask_of(const kiln__kargs *a) {
  return a->op == KILN__K_BATCH_NORM_BACKWARD && (a->i[0] & 2) ? &a->in[a->n_in - 1] : NULL;
}

/* Whether a backward recomputes its mask from x (flag 8) instead of reading one. */
bool rc_of(const kiln__kargs *a) { return a->op == KILN__K_BATCH_NORM_BACKWARD && (a->i[0] & 8); }

/* The residual of a forward (flag 16: the input after the weight and the bias), or NULL. */
const kiln__view *residual_of(const kiln__kargs *a) {
  if (a->op != KILN__K_BATCH_NORM || !(a->i[0] & 16)) return NULL;
  return &a->in[1 + ((a->i[0] & 1) ? 1 : 0) + ((a->i[0] & 2) ? 1 : 0)];
}

/* The kernels' third big input (mk): the mask (backward) or the residual (forward). */
const kiln__view *aux_of(const kiln__kargs *a) { return a->op == KILN__K_BATCH_NORM ? residual_of(a) : mask_of(a); }

/* The masked gradient a backward writes (flag 4), or NULL. */
const kiln__view *gm_of(const kiln__kargs *a) {
  return a->op == KILN__K_BATCH_NORM_BACKWARD && (a->i[0] & 4) && a->n_out > 3 ? &a->out[3] : NULL;
}

/* Whether a forward pools its output (flag 32): out0 is then the pooled map, and the last
** output the maxima's offsets (u8). */
bool pool_of(const kiln__kargs *a) { return a->op == KILN__K_BATCH_NORM && (a->i[0] & 32); }
const kiln__view *offsets_of(const kiln__kargs *a) { return pool_of(a) ? &a->out[a->n_out - 1] : NULL; }

/* The big views of a call: x, y and the residual (forward; with flag 32 the pooled y and
** the offsets); x, g, dx, the mask and the masked gradient (backward). */
int big_views(const kiln__kargs *a, const kiln__view **v) {
  int n = 0;
  v[n++] = &a->in[0];
  if (a->op == KILN__K_BATCH_NORM_BACKWARD) v[n++] = &a->in[1];
  v[n++] = &a->out[0];
  if (aux_of(a)) v[n++] = aux_of(a);
  if (gm_of(a)) v[n++] = gm_of(a);
  if (offsets_of(a)) v[n++] = offsets_of(a);
  return n;
}

/* The layout all big views share: 1 cl, 0 cf, -1 none. */
int layout_of(const kiln__kargs *a) {
  const kiln__view *v[5];
  int nv = big_views(a, v);
  bool all_cf = true, all_cl = true;
  for (int i = 0; i < nv; i++) all_cf = all_cf && cf_ok(v[i]), all_cl = all_cl && cl_ok(v[i]);
  int64_t S = v[0]->shape[2];
  if (all_cl && (S <= 1 || !all_cf)) return 1;
  if (all_cf) return 0;
  return -1;
}

/* The widest vector (elements) every big view allows along the inner dim. */
int pick_vec(const kiln__kargs *a, bool cl, size_t esize) {
  const kiln__view *v[5];
  int nv = big_views(a, v);
  int64_t inner = cl ? v[0]->shape[1] : v[0]->shape[2];
  for (int V = (int)(16 / esize); V > 1; V /= 2) {
    bool ok = inner % V == 0;
    for (int i = 0; i < nv && ok; i++) {
      const size_t es = v[i]->dtype == KILN_U8 ? 1 : esize; /* flag 32's offsets */
      ok = ((uintptr_t)v[i]->data % (V * es)) == 0 && v[i]->strides[0] % V == 0 &&
           (cl ? v[i]->strides[2] % V == 0 || v[i]->shape[2] <= 1 : v[i]->strides[1] % V == 0 || v[i]->shape[1] <= 1);
    }
    if (ok) return V;
  }
  return 1;
}

Vec vec_of(const kiln__view *v) {
  Vec r;
  r.p = v->data, r.dt = (int)v->dtype, r.st = v->ndim > 0 ? v->strides[0] : 1;
  return r;
}

Geo geo_of(const kiln__kargs *a) {
  Geo G;
  const kiln__view *x = &a->in[0], *mk = aux_of(a), *gm = gm_of(a);
  const bool bw = a->op == KILN__K_BATCH_NORM_BACKWARD;
  G.N = x->shape[0], G.C = x->shape[1], G.S = x->shape[2];
  for (int d = 0; d < 3; d++) {
    G.xs[d] = x->strides[d];
    G.gs[d] = bw ? a->in[1].strides[d] : x->strides[d];
    G.ys[d] = a->out[0].strides[d];
    G.ms[d] = mk ? mk->strides[d] : 0;
    G.os[d] = gm ? gm->strides[d] : 0;
  }
  return G;
}

/* pass 1's grid: cf (C, splits); cl (channel-vector blocks, splits) with blocks of
** (tx, 256 / tx) */
struct P1 {
  dim3 grid, block;
  int splits;
  size_t smem;
};
template <class A> P1 plan1(const Geo &G, bool cl, int V, int sm_count, int bps) {
  P1 p;
  /* enough blocks to fill every SM (bps resident blocks of 256 threads each) */
  int64_t target = (int64_t)(sm_count > 0 ? sm_count : 132) * (bps > 0 ? bps : 8);
  if (!cl) {
    int64_t elems = G.N * G.S;
    int64_t splits = (target + G.C - 1) / G.C;
    int64_t most = (elems + 4095) / 4096; /* at least ~4k elements a block */
    if (splits > most) splits = most;
    if (splits < 1) splits = 1;
    if (splits > 65535) splits = 65535;
    p.grid = dim3((unsigned)G.C, (unsigned)splits);
    p.block = dim3(BN_THREADS);
    p.splits = (int)splits;
    p.smem = 0;
  } else {
    int64_t CV = (G.C + V - 1) / V;
    int tx = 1;
    while (tx < 32 && tx < CV) tx *= 2;
    int ty = BN_THREADS / tx;
    int64_t gx = (CV + tx - 1) / tx;
    int64_t rows = G.N * G.S;
    int64_t splits = (target + gx - 1) / gx;
    int64_t most = (rows + 16 * ty - 1) / (16 * ty); /* at least ~16 rows a thread (4 batches) */
    if (splits > most) splits = most;
    if (splits < 1) splits = 1;
    if (splits > 65535) splits = 65535;
    p.grid = dim3((unsigned)gx, (unsigned)splits);
    p.block = dim3(tx, ty);
    p.splits = (int)splits;
    p.smem = (size_t)BN_THREADS * (2 * V + 1) * sizeof(A);
  }
  return p;
}

/* fkp, fbp: the forward's coefficients (statistics rows 2 and 3, stride mst) where the
** backward recomputes its mask (flag 8), else NULL */
template <class T, class A, int V>
kiln_status launch_p1(kiln__cuda_dev *d, const kiln__kargs *a, const Geo &G, bool cl, bool bw, const P1 &p, A *part,
                      const A *meanp, int64_t mst, const A *fkp, const A *fbp) {
  const T *x = (const T *)a->in[0].data, *g = bw ? (const T *)a->in[1].data : NULL;
  const T *mk = bw && mask_of(a) ? (const T *)mask_of(a)->data : NULL;
  T *gm = gm_of(a) ? (T *)gm_of(a)->data : NULL;
  const bool rc = bw && rc_of(a);
  if (!cl) {
    if (rc) pass1_cf<T, A, V, true, true><<<p.grid, p.block, 0, d->stream>>>(x, g, NULL, NULL, G, part, meanp, mst, fkp, fbp);
    else if (bw) pass1_cf<T, A, V, true><<<p.grid, p.block, 0, d->stream>>>(x, g, mk, gm, G, part, meanp, mst, NULL, NULL);
    else pass1_cf<T, A, V, false><<<p.grid, p.block, 0, d->stream>>>(x, g, NULL, NULL, G, part, meanp, mst, NULL, NULL);
  } else {
    const bool fl = p1_flat(G);
#define BN_P1(BWV, RCV, MKS, ...) \
  (fl ? pass1_cl<T, A, V, BWV, RCV, true, MKS><<<p.grid, p.block, p.smem, d->stream>>>(__VA_ARGS__) \
      : pass1_cl<T, A, V, BWV, RCV><<<p.grid, p.block, p.smem, d->stream>>>(__VA_ARGS__))
    if (rc) BN_P1(true, true, 0, x, g, NULL, NULL, G, part, meanp, mst, fkp, fbp);
    else if (bw && mk && gm) BN_P1(true, false, 1, x, g, mk, gm, G, part, meanp, mst, NULL, NULL);
    else if (bw && !mk && !gm) BN_P1(true, false, 0, x, g, NULL, NULL, G, part, meanp, mst, NULL, NULL);
    else if (bw) BN_P1(true, false, -1, x, g, mk, gm, G, part, meanp, mst, NULL, NULL);
    else BN_P1(false, false, 0, x, g, NULL, NULL, G, part, meanp, mst, NULL, NULL);
#undef BN_P1
  }
  return kiln__cuda_launched(bw ? "batch_norm_backward (sums)" : "batch_norm (statistics)");
}

/* ---- flag 32: the max-pool of relu(bn(x)), channels-last. A thread V channels of one
** output pixel, its (n, oh, ow, channel group) from a flat index by multiply-shift
** divisions: the window's values computed from x with the coefficients (fwd_val, the
** normalizing pass's arithmetic, so the values are batch_norm_relu's), MAX_POOL2D's rule on
** them (the first maximum in window order, NaN wins, padding never), the maximum and its
** offset i kw + j written, the V offsets as one store where aligned (VO). */
struct PoolG {
  int H, W, OH, OW, kh, kw, sh, sw, ph, pw, CV, total;
  int64_t xs0, xs2;     /* x's (N, S) strides */
  int64_t ys[3], os[3]; /* the pooled output's and the offsets' (N, C, OH*OW) strides */
  kc_fastdiv cvd, owd, ohd;
};

template <class T, class A, int V, bool VO>
__global__ void __launch_bounds__(BN_THREADS)
    pool_fwd_cl(const T *__restrict__ x, T *__restrict__ y, uint8_t *__restrict__ off, int64_t C, PoolG Q,
                const A *__restrict__ coef) {
  typedef kc_vec<A, V> PA;
  typedef kc_vec<T, V> P;
  for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < Q.total; k += gridDim.x * blockDim.x) {
    const int r = kc_div(k, Q.cvd), cv = k - r * Q.CV;
    const int r2 = kc_div(r, Q.owd), ow = r - r2 * Q.OW;
    const int n = kc_div(r2, Q.ohd), oh = r2 - n * Q.OH;
    const int64_t c0 = (int64_t)cv * V;
    const PA pm = *reinterpret_cast<const PA *>(coef + c0), pk = *reinterpret_cast<const PA *>(coef + C + c0),
             pp = *reinterpret_cast<const PA *>(coef + 2 * C + c0);
    const T *xn = x + n * Q.xs0 + c0;
    A best[V];
    P bv;
    kc_vec<uint8_t, V> at;
    bool any = false;
    for (int i = 0; i < Q.kh; i++) {
      const int h = oh * Q.sh - Q.ph + i;
      if (h < 0 || h >= Q.H) continue;
      for (int j = 0; j < Q.kw; j++) {
        const int w = ow * Q.sw - Q.pw + j;
        if (w < 0 || w >= Q.W) continue;
        const P px = *reinterpret_cast<const P *>(xn + ((int64_t)h * Q.W + w) * Q.xs2);
        const uint8_t tap = (uint8_t)(i * Q.kw + j);
#pragma unroll
        for (int c = 0; c < V; c++) {
          const T v = fwd_val<T, A>(px.v[c], pm.v[c], pk.v[c], pp.v[c], false, px.v[c], true);
          const A va = (A)kc_ld<T>(v);
          if (!any || va > best[c] || (va != va && best[c] == best[c])) best[c] = va, bv.v[c] = v, at.v[c] = tap;
        }
        any = true;
      }
    }
    if (!any) /* a window wholly in the padding (the op layer's geometry never makes one) */
#pragma unroll
      for (int c = 0; c < V; c++) bv.v[c] = kc_st<T>((A)0), at.v[c] = 0;
    const int64_t s = (int64_t)oh * Q.OW + ow;
    *reinterpret_cast<P *>(y + n * Q.ys[0] + s * Q.ys[2] + c0) = bv;
    uint8_t *o = off + n * Q.os[0] + s * Q.os[2] + c0;
    if (VO) *reinterpret_cast<kc_vec<uint8_t, V> *>(o) = at;
    else
#pragma unroll
      for (int c = 0; c < V; c++) o[c] = at.v[c];
  }
}

/* pool_ok has checked the geometry and that the flat index fits an int */
template <class T, class A, int V>
kiln_status launch_pool(kiln__cuda_dev *d, const kiln__kargs *a, const Geo &G, const A *coef) {
  const kiln__conv_params *cp = (const kiln__conv_params *)a->params;
  const kiln__view *ov = offsets_of(a);
  PoolG P;
  P.H = (int)a->i[2], P.W = (int)a->i[3];
  P.kh = (int)cp->kernel[0], P.kw = (int)cp->kernel[1], P.sh = (int)cp->stride[0], P.sw = (int)cp->stride[1];
  P.ph = (int)cp->padding[0], P.pw = (int)cp->padding[1];
  P.OH = (P.H + 2 * P.ph - P.kh) / P.sh + 1, P.OW = (P.W + 2 * P.pw - P.kw) / P.sw + 1;
  P.CV = (int)(G.C / V);
  P.xs0 = G.xs[0], P.xs2 = G.xs[2];
  for (int k = 0; k < 3; k++) P.ys[k] = a->out[0].strides[k], P.os[k] = ov->strides[k];
  const int64_t total = G.N * P.OH * P.OW * P.CV;
  if (total == 0) return KILN_OK;
  P.total = (int)total;
  P.cvd = kc_make_fastdiv((uint32_t)P.CV), P.owd = kc_make_fastdiv((uint32_t)P.OW), P.ohd = kc_make_fastdiv((uint32_t)P.OH);
  const bool vo = V > 1 && (uintptr_t)ov->data % V == 0 && P.os[0] % V == 0 && P.os[2] % V == 0 && P.os[1] == 1;
  const unsigned blocks = (unsigned)((total + BN_THREADS - 1) / BN_THREADS);
  const T *x = (const T *)a->in[0].data;
  T *y = (T *)a->out[0].data;
  uint8_t *o = (uint8_t *)ov->data;
  if (vo) pool_fwd_cl<T, A, V, true><<<blocks, BN_THREADS, 0, d->stream>>>(x, y, o, G.C, P, coef);
  else pool_fwd_cl<T, A, V, false><<<blocks, BN_THREADS, 0, d->stream>>>(x, y, o, G.C, P, coef);
  return kiln__cuda_launched("batch_norm_relu_max_pool2d (pool)");
}

template <class T, class A, int V>
kiln_status launch_p3(kiln__cuda_dev *d, const kiln__kargs *a, const Geo &G0, bool cl, bool bw, bool train,
                      const A *coef) {
  /* a backward that wrote the masked gradient in pass 1 (flag 4) reads it as g, unmasked:
  ** one tensor less to read than g and the mask */
  Geo G = G0;
  const kiln__view *gmv = gm_of(a);
  if (gmv)
    for (int k = 0; k < 3; k++) G.gs[k] = G.os[k], G.ms[k] = 0;
  const bool relu = !bw && (a->i[0] & 8) != 0; /* kiln_batch_norm_relu */
  const bool rc = bw && rc_of(a);                /* the backward's mask recomputed (coef[4C..6C)) */
  int64_t inner = (cl ? G.C : G.S) / V; /* pick_vec chose V dividing it */
  if (inner < 1) inner = 1;
  int64_t rpb = inner >= BN_THREADS ? 1 : BN_THREADS / inner;
  int64_t rows = cl ? G.N * G.S : G.N * G.C;
  int64_t blocks = (rows + rpb - 1) / rpb;
  if (blocks < 1) return KILN_OK;
  const T *x = (const T *)a->in[0].data;
  const T *g = !bw ? NULL : gmv ? (const T *)gmv->data : (const T *)a->in[1].data;
  const T *mk = gmv || !aux_of(a) ? NULL : (const T *)aux_of(a)->data; /* the mask, or the residual (forward) */
  T *y = (T *)a->out[0].data;
  if (cl) {
    /* pass 1's block shape; rows split so that a thread takes ~16 (4 batches of U) */
    int64_t CV = G.C / V, R = G.N * G.S;
    int tx = 1;
    while (tx < 32 && tx < CV) tx *= 2;
    int ty = BN_THREADS / tx;
    const int64_t rpt = knobs().p3_rows;
    int64_t gx = (CV + tx - 1) / tx, gy = (R + (int64_t)ty * rpt - 1) / ((int64_t)ty * rpt);
    if (gy > 65535) gy = 65535;
    if (gy < 1) gy = 1;
    int64_t chunk = (R + gy - 1) / gy;
    dim3 grid((unsigned)gx, (unsigned)gy), block(tx, ty);
    const bool rev = knobs().reverse;
    const bool fl =
        knobs().flat && rows_flat(G.xs, G) && rows_flat(G.gs, G) && rows_flat(G.ms, G) && rows_flat(G.ys, G);
    /* FLAT with the third input (mask or residual) present (MKS 1) or not (0) */
#define BN_P3CL(BWV, TRV, RCV, MKS, MK) \
  (fl ? pass3_cl<T, A, V, BWV, TRV, RCV, true, MKS><<<grid, block, 0, d->stream>>>(x, g, MK, y, G, coef, chunk, relu, rev) \
      : pass3_cl<T, A, V, BWV, TRV, RCV><<<grid, block, 0, d->stream>>>(x, g, MK, y, G, coef, chunk, relu, rev))
    if (!bw && mk) BN_P3CL(false, false, false, 1, mk);
    else if (!bw) BN_P3CL(false, false, false, 0, NULL);
    else if (rc && train) BN_P3CL(true, true, true, 0, NULL);
    else if (rc) BN_P3CL(true, false, true, 0, NULL);
    else if (train && mk) BN_P3CL(true, true, false, 1, mk);
    else if (train) BN_P3CL(true, true, false, 0, NULL);
    else if (mk) BN_P3CL(true, false, false, 1, mk);
    else BN_P3CL(true, false, false, 0, NULL);
#undef BN_P3CL
    return kiln__cuda_launched(bw ? "batch_norm_backward (dx)" : "batch_norm (normalize)");
  }
#define BN_P3(BWV, TRV, RCV) \
  pass3<T, A, V, BWV, TRV, RCV><<<(unsigned)blocks, BN_THREADS, 0, d->stream>>>(x, g, mk, y, G, coef, inner, rpb, relu, \
                                                                             knobs().reverse)
  if (!bw) BN_P3(false, false, false);
  else if (rc && train) BN_P3(true, true, true);
  else if (rc) BN_P3(true, false, true);
  else if (train) BN_P3(true, true, false);
  else BN_P3(true, false, false);
#undef BN_P3
  return kiln__cuda_launched(bw ? "batch_norm_backward (dx)" : "batch_norm (normalize)");
}

/* pass 1's blocks per SM: the knob, or (0) what the occupancy calculator says the SMs hold
** of this kernel at once (cached per kernel) */
template <class T, class A, int V> int p1_blocks_per_sm(bool cl, bool bw) {
  int bps = knobs().p1_bps;
  if (bps > 0) return bps;
  if (bps < 0) return 8;
  static int cache[2][2]; /* [cl][bw]; 0 unknown */
  int &c = cache[cl][bw];
  if (c > 0) return c;
  int n = 0;
  size_t smem = cl ? (size_t)BN_THREADS * (2 * V + 1) * sizeof(A) : 0;
  cudaError_t e;
  if (!cl) e = bw ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, pass1_cf<T, A, V, true>, BN_THREADS, smem)
                  : cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, pass1_cf<T, A, V, false>, BN_THREADS, smem);
  else e = bw ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, pass1_cl<T, A, V, true>, BN_THREADS, smem)
              : cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, pass1_cl<T, A, V, false>, BN_THREADS, smem);
  if (e != cudaSuccess || n < 1) {
    (void)cudaGetLastError(); /* not sticky: clear it */
    n = 8;
  }
  c = n;
  return n;
}

template <class T, class A, int V>
kiln_status run(kiln__cuda_dev *d, const kiln__kargs *a, bool cl) {
  const bool bw = a->op == KILN__K_BATCH_NORM_BACKWARD, train = a->i[1] != 0;
  const int flags = (int)a->i[0];
  Geo G = geo_of(a);
  const int64_t C = G.C;
  const bool rc = rc_of(a);
  /* the recomputed mask (rc) takes the mask-reading kernel's plan: the same splits, so the
  ** same sums in the same order and the same bits, even under KILN_BN_P1_BPS=0 */
  int bps = p1_blocks_per_sm<T, A, V>(cl, bw);
  if (!bw && cl && knobs().p1_bps < 0 && p1_flat(G)) bps = 4; /* the FLAT statistics: measured best */
  P1 p = plan1<A>(G, cl, V, d->sm_count, bps);
  bool need_p1 = bw || train;
  size_t part_n = need_p1 ? (size_t)C * p.splits * (bw ? 2 : 3) : 0;
  size_t coef_n = (size_t)C * (rc ? 6 : 4);
  size_t bytes = (part_n + coef_n) * sizeof(A);
  A *buf = (A *)kiln__cuda_alloc(a->device, bytes);
  if (!buf) return kiln_last_error();
  kiln_status st = kiln__cuda_capture_note(a->device, buf, bytes);
  A *coef = buf, *part = buf + coef_n;
  const unsigned fin_blocks = (unsigned)C; /* a block per channel */
  if (!bw) {
    FinF f;
    f.C = C, f.splits = p.splits, f.train = train, f.eps = a->s[0], f.momentum = a->s[1];
    int at = 1;
    f.has_w = (flags & 1) != 0, f.has_b = (flags & 2) != 0, f.has_r = (flags & 4) != 0;
    if (f.has_w) f.w = vec_of(&a->in[at++]);
    if (f.has_b) f.b = vec_of(&a->in[at++]);
    if (f.has_r) f.rm = vec_of(&a->out[2]), f.rv = vec_of(&a->out[3]);
    f.stats = a->out[1].data, f.stats_dt = (int)a->out[1].dtype;
    f.st0 = a->out[1].strides[0], f.st1 = a->out[1].strides[1];
    f.coef_rows = a->out[1].ndim == 2 && a->out[1].shape[0] >= 4;
    if (st == KILN_OK && train) st = launch_p1<T, A, V>(d, a, G, cl, false, p, part, NULL, 0, NULL, NULL);
    if (st == KILN_OK) {
      fin_fwd<A><<<fin_blocks, FIN_THREADS, 0, d->stream>>>(part, f, coef);
      st = kiln__cuda_launched("batch_norm (finalize)");
    }
  } else {
    FinB f;
    f.C = C, f.splits = p.splits, f.train = train, f.M = (double)(G.N * G.S);
    f.has_w = (flags & 1) != 0, f.rc = rc;
    if (f.has_w) f.w = vec_of(&a->in[3]);
    f.dw = vec_of(&a->out[1]), f.db = vec_of(&a->out[2]);
    f.stats = a->in[2].data, f.stats_dt = (int)a->in[2].dtype;
    f.st0 = a->in[2].strides[0], f.st1 = a->in[2].strides[1];
    /* pass 1 reads the mean from the statistics where they are in its type, else from a
    ** copy in coef[0..C) */
    const A *meanp = (const A *)f.stats;
    int64_t mst = f.st1;
    if (f.stats_dt != (sizeof(A) == 8 ? KILN_F64 : KILN_F32)) {
      if (st == KILN_OK) {
        load_mean<A><<<(unsigned)((C + 127) / 128), 128, 0, d->stream>>>(f, coef);
        st = kiln__cuda_launched("batch_norm_backward (mean)");
      }
      meanp = coef, mst = 1;
    }
    /* the forward's coefficients (flag 8: the statistics are in A, kiln__cuda_batchnorm_supports) */
    const A *fkp = rc ? (const A *)f.stats + 2 * f.st0 : NULL, *fbp = rc ? (const A *)f.stats + 3 * f.st0 : NULL;
    if (st == KILN_OK) st = launch_p1<T, A, V>(d, a, G, cl, true, p, part, meanp, mst, fkp, fbp);
    if (st == KILN_OK) {
      fin_bwd<A><<<fin_blocks, FIN_THREADS, 0, d->stream>>>(part, f, coef);
      st = kiln__cuda_launched("batch_norm_backward (finalize)");
    }
  }
  if (st == KILN_OK) st = pool_of(a) ? launch_pool<T, A, V>(d, a, G, coef) : launch_p3<T, A, V>(d, a, G, cl, bw, train, coef);
  kiln__cuda_free(a->device, buf, bytes); /* stream-ordered reuse */
  return st;
}

template <class T> kiln_status run_t(kiln__cuda_dev *d, const kiln__kargs *a, bool cl) {
  typedef typename kc_traits<T>::acc A;
  int V = pick_vec(a, cl, sizeof(T));
  switch (V) {
  case 8: return run<T, A, (sizeof(T) <= 2 ? 8 : 1)>(d, a, cl);
  case 4: return run<T, A, (sizeof(T) <= 4 ? 4 : 1)>(d, a, cl);
  case 2: return run<T, A, 2>(d, a, cl);
  default: return run<T, A, 1>(d, a, cl);
  }
}

} // namespace

/* Flag 32's arguments: the ReLU and no residual, a window (dilation 1, padding at most
** half of it, at most 256 taps: a byte's offsets) over x's (H, W) = (i2, i3), the pooled
** out0 and the offsets (u8, the last output) of its output shape, all channels-last. */
static bool pool_ok(const kiln__kargs *a) {
  const kiln__conv_params *p = (const kiln__conv_params *)a->params;
  const int64_t fl = a->i[0];
  if (!p || !(fl & 8) || (fl & 16) || a->n_out != ((fl & 4) ? 5 : 3)) return false;
  const kiln__view *x = &a->in[0], *y = &a->out[0], *o = offsets_of(a);
  const int64_t H = a->i[2], W = a->i[3];
  if (H < 1 || W < 1 || H * W != x->shape[2] || o->dtype != KILN_U8 || o->ndim != 3) return false;
  int64_t os[2];
  for (int d = 0; d < 2; d++) {
    if (p->kernel[d] < 1 || p->stride[d] < 1 || p->dilation[d] != 1 || p->padding[d] < 0 || 2 * p->padding[d] > p->kernel[d])
      return false;
    os[d] = ((d ? W : H) + 2 * p->padding[d] - p->kernel[d]) / p->stride[d] + 1;
    if (os[d] < 1) return false;
  }
  if (p->kernel[0] * p->kernel[1] > 256) return false;
  /* pool_fwd_cl's flat index and coordinates are ints */
  if (H >= INT_MAX / 4 || W >= INT_MAX / 4 || x->shape[0] * x->shape[1] * os[0] * os[1] >= INT_MAX) return false;
  const kiln__view *vs[2] = {y, o};
  for (const kiln__view *v : vs)
    if (v->shape[0] != x->shape[0] || v->shape[1] != x->shape[1] || v->shape[2] != os[0] * os[1]) return false;
  return layout_of(a) == 1;
}

extern "C" bool kiln__cuda_batchnorm_supports(const kiln__kargs *a) {
  bool bw = a->op == KILN__K_BATCH_NORM_BACKWARD;
  if (a->op != KILN__K_BATCH_NORM && !bw) return false;
  const kiln__view *x = &a->in[0];
  if (x->ndim != 3 || !kc_is_float(x->dtype)) return false;
  if (!bw) {
    if (a->n_out < 2 || a->out[0].dtype != x->dtype || a->out[0].ndim != 3) return false;
    if ((a->i[0] & 4) && a->n_out < 4) return false;
    if (!a->i[1] && !(a->i[0] & 4)) return false;
    if (a->i[0] & ~(int64_t)63) return false;
    if (pool_of(a) && !pool_ok(a)) return false;
    const kiln__view *r = residual_of(a);
    if (r && (a->n_in != 2 + ((a->i[0] & 1) ? 1 : 0) + ((a->i[0] & 2) ? 1 : 0) || r->dtype != x->dtype || r->ndim != 3 ||
              r->shape[0] != x->shape[0] || r->shape[1] != x->shape[1] || r->shape[2] != x->shape[2]))
      return false;
  } else {
    if (a->n_in < 3 || a->n_out < 3 || a->in[1].dtype != x->dtype || a->out[0].dtype != x->dtype ||
        a->in[1].ndim != 3 || a->out[0].ndim != 3)
      return false;
    if (a->n_in != 3 + ((a->i[0] & 1) ? 1 : 0) + ((a->i[0] & 2) ? 1 : 0)) return false;
    if (a->i[0] & ~(int64_t)15) return false;
    if (a->i[0] & 8) { /* the mask recomputed: no mask input, the forward's coefficients in the statistics' rows 2, 3 */
      const kiln__view *s = &a->in[2];
      if ((a->i[0] & 6) || s->ndim != 2 || s->shape[0] < 4 || s->dtype != (x->dtype == KILN_F64 ? KILN_F64 : KILN_F32))
        return false;
    }
    const kiln__view *mk = mask_of(a);
    if (mk && (mk->dtype != x->dtype || mk->ndim != 3)) return false;
    if (a->i[0] & 4) { /* the masked gradient: needs the mask, written in x's dtype */
      if (!mk || a->n_out != 4 || a->out[3].dtype != x->dtype || a->out[3].ndim != 3) return false;
    } else if (a->n_out != 3) {
      return false;
    }
  }
  for (int i = 1; i < a->n_in; i++)
    if (!kc_is_float(a->in[i].dtype)) return false;
  for (int i = 1; i < a->n_out - (pool_of(a) ? 1 : 0); i++) /* flag 32's offsets are bytes (pool_ok) */
    if (!kc_is_float(a->out[i].dtype)) return false;
  return layout_of(a) >= 0;
}

extern "C" kiln_status kiln__cuda_batchnorm(const kiln__kargs *a) {
  if (!kiln__cuda_batchnorm_supports(a))
    return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln_%s: %s input (N, C, S) = (%lld, %lld, %lld) in this layout is not supported on cuda",
                          kiln__kop_name(a->op), kiln_dtype_name(a->in[0].dtype), (long long)a->in[0].shape[0],
                          (long long)a->in[0].shape[1], (long long)a->in[0].shape[2]);
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  const kiln__view *x = &a->in[0];
  if (x->shape[0] * x->shape[1] * x->shape[2] == 0) return KILN_OK;
  bool cl = layout_of(a) == 1;
  kiln_status st = KILN_OK;
  KC_SWITCH_FLOAT(x->dtype, T, return KILN_ERR_DTYPE, st = run_t<T>(d, a, cl));
  return st;
}
