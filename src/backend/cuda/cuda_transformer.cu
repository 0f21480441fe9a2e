/*
** CUDA kernels for the transformer ops (contracts: backend.h; CPU references:
** cpu/cpu_transformer.c and cpu/cpu_scan.c): the fused layer and RMS norms forward and
** backward, the residual add fused with a layer norm (training), cumsum, tril/triu, topk
** and multinomial. Attention is in cuda_attention.cu,
** LINEAR_GELU and MATMUL_DGELU (claimed here, cuBLASLt epilogues) in cuda_matmul.cu.
**
** Determinism (DESIGN.md: same seed, same numbers): no kernel here uses atomics. The
** norm's parameter gradients are reduced in two stages, each a fixed order: stage 1 gives
** per-chunk-of-rows partial sums into scratch, stage 2 sums the chunks in chunk order.
**
** Bit-for-bit agreement with the CPU where the contract asks for it: cumsum accumulates
** floats in f64 and integers in i64 in index order as the CPU does; multinomial sums its
** weights and prefix sums in f64 in class order, one thread per draw, with the CPU's Philox
** mapping; topk copies the selected elements themselves. The norms compute their statistics
** in f32 (f64 for f64), so f32 results are within the harness's f32 tolerance of the CPU's
** f64 computation, not equal to it.
*/
#include "cuda_int.cuh"
#include "cuda_ew.cuh"
#include "philox.cuh"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <atomic>
#include <type_traits>
#include <vector>

extern "C" kiln_status kiln__cuda_attention(const kiln__kargs *a); /* cuda_attention.cu */
extern "C" bool kiln__cuda_attention_supports(const kiln__kargs *a);
extern "C" kiln_status kiln__cuda_linear_gelu(const kiln__kargs *a); /* cuda_matmul.cu */
extern "C" bool kiln__cuda_linear_gelu_supports(const kiln__kargs *a);
extern "C" kiln_status kiln__cuda_matmul_dgelu(const kiln__kargs *a); /* cuda_matmul.cu */
extern "C" bool kiln__cuda_matmul_dgelu_supports(const kiln__kargs *a);

namespace {

/* The accumulation type: f64 for f32 too, as the CPU computes in f64, so that f32 results
** are the exact result rounded (the first H200 run of the harness found f32 accumulation
** 1.5x past its f32 tolerance where cancellation leaves a result near 0); f32 for the
** 16-bit types (their tolerance is far looser), f64 for f64. */
template <class T> struct wide_acc { typedef typename kc_traits<T>::acc type; };
template <> struct wide_acc<float> { typedef double type; };

/* A value of a runtime-typed vector (weights, biases, mean, rstd), as A. */
template <class A> __device__ __forceinline__ A ld_any(const void *p, int dt, int64_t i) {
  switch (dt) {
  case KILN_F32: return (A)((const float *)p)[i];
  case KILN_F64: return (A)((const double *)p)[i];
  case KILN_F16: return (A)__half2float(((const __half *)p)[i]);
  case KILN_BF16: return (A)__bfloat162float(((const __nv_bfloat16 *)p)[i]);
  case KILN_I64: return (A)((const int64_t *)p)[i];
  case KILN_I32: return (A)((const int32_t *)p)[i];
  case KILN_U8: return (A)((const uint8_t *)p)[i];
  case KILN_BOOL: return ((const bool *)p)[i] ? (A)1 : (A)0;
  default: return (A)0;
  }
}
template <class A> __device__ __forceinline__ void st_any(void *p, int dt, int64_t i, A v) {
  switch (dt) {
  case KILN_F32: ((float *)p)[i] = (float)v; break;
  case KILN_F64: ((double *)p)[i] = (double)v; break;
  case KILN_F16: ((__half *)p)[i] = __float2half_rn((float)v); break;
  case KILN_BF16: ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn((float)v); break;
  default: break;
  }
}

/* A runtime-typed 1-d vector: pointer, dtype, stride. */
struct Vec {
  const void *p;
  int dt;
  int64_t st;
};
static Vec vec_of(const kiln__view *v) {
  Vec r = {v->data, (int)v->dtype, v->ndim > 0 ? v->strides[0] : 1};
  return r;
}

template <class A> __device__ __forceinline__ A warp_sum(A v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

kiln_status dtype_error(const kiln__kargs *a, kiln_dtype dt) {
  return kiln_set_error(KILN_ERR_DTYPE, "kiln_%s: dtype %s not supported on cuda", kiln__kop_name(a->op),
                        kiln_dtype_name(dt));
}

/* ================================================================ layer / RMS norm */
/* x (R, N) with row stride xs0 and element stride xs1; one warp per row (8 rows per
** 256-thread block): GPT rows are 768..4096 wide, which a warp streams at full width. */
struct LnArgs {
  int64_t R, N;
  int64_t xs0, xs1, ys0, ys1, gs0, gs1;
  Vec w, b, mean, rstd, out_mean, out_rstd;
  bool has_w, has_b, rms;
  double eps;
};

template <class T, class A>
__global__ void __launch_bounds__(KC_THREADS) ln_fwd(const T *x, T *y, LnArgs p) {
  int64_t r = (int64_t)blockIdx.x * (KC_THREADS / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (r >= p.R) return;
  const T *xr = x + r * p.xs0;
  A mean = 0, var = 0;
  if (!p.rms) {
    for (int64_t j = lane; j < p.N; j += 32) mean += kc_ld<T>(xr[j * p.xs1]);
    mean = warp_sum(mean) / (A)p.N;
  }
  for (int64_t j = lane; j < p.N; j += 32) { /* two passes, as the CPU: no cancellation */
    A d = kc_ld<T>(xr[j * p.xs1]) - mean;
    var += d * d;
  }
  var = warp_sum(var) / (A)p.N;
  A rstd = (A)1 / sqrt(var + (A)p.eps);
  T *yr = y + r * p.ys0;
  for (int64_t j = lane; j < p.N; j += 32) {
    A v = (kc_ld<T>(xr[j * p.xs1]) - mean) * rstd;
    if (p.has_w) v *= ld_any<A>(p.w.p, p.w.dt, j * p.w.st);
    if (p.has_b) v += ld_any<A>(p.b.p, p.b.dt, j * p.b.st);
    yr[j * p.ys1] = kc_st<T>(v);
  }
  if (lane == 0) {
    if (p.rms) {
      st_any<A>((void *)p.out_mean.p, p.out_mean.dt, r * p.out_mean.st, rstd);
    } else {
      st_any<A>((void *)p.out_mean.p, p.out_mean.dt, r * p.out_mean.st, mean);
      st_any<A>((void *)p.out_rstd.p, p.out_rstd.dt, r * p.out_rstd.st, rstd);
    }
  }
}

/* dx = rstd (gw - mean(gw) - xhat mean(gw xhat)), gw = g w (the mean(gw) term absent for
** RMS norm). One warp per row. */
template <class T, class A>
__global__ void __launch_bounds__(KC_THREADS) ln_bwd_dx(const T *x, const T *g, T *dx, LnArgs p) {
  int64_t r = (int64_t)blockIdx.x * (KC_THREADS / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (r >= p.R) return;
  const T *xr = x + r * p.xs0, *gr = g + r * p.gs0;
  A mean = p.rms ? (A)0 : ld_any<A>(p.mean.p, p.mean.dt, r * p.mean.st);
  A rstd = ld_any<A>(p.rstd.p, p.rstd.dt, r * p.rstd.st);
  A sg = 0, sgx = 0;
  for (int64_t j = lane; j < p.N; j += 32) {
    A xh = (kc_ld<T>(xr[j * p.xs1]) - mean) * rstd;
    A gw = kc_ld<T>(gr[j * p.gs1]);
    if (p.has_w) gw *= ld_any<A>(p.w.p, p.w.dt, j * p.w.st);
    sg += gw;
    sgx += gw * xh;
  }
  sg = warp_sum(sg) / (A)p.N;
  sgx = warp_sum(sgx) / (A)p.N;
  if (p.rms) sg = 0;
  T *dr = dx + r * p.ys0;
  for (int64_t j = lane; j < p.N; j += 32) {
    A xh = (kc_ld<T>(xr[j * p.xs1]) - mean) * rstd;
    A gw = kc_ld<T>(gr[j * p.gs1]);
    if (p.has_w) gw *= ld_any<A>(p.w.p, p.w.dt, j * p.w.st);
    dr[j * p.ys1] = kc_st<T>(rstd * (gw - sg - xh * sgx));
  }
}

/* Stage 1 of dweight_j = sum_r g_rj xhat_rj and dbias_j = sum_r g_rj: block (32, 8) takes
** 32 columns and chunk rows [c*chunk, (c+1)*chunk); each thread sums its rows (stride 8)
** in order, then the 8 partials are added in thread order; part is (2, chunks, N). */
template <class T, class A>
__global__ void ln_bwd_wpart(const T *x, const T *g, A *part, int64_t chunk, int64_t chunks, LnArgs p) {
  __shared__ A sw[8][33], sb[8][33];
  int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x;
  int64_t c = blockIdx.y;
  int64_t r0 = c * chunk, r1 = r0 + chunk < p.R ? r0 + chunk : p.R;
  A aw = 0, ab = 0;
  if (j < p.N) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      A mean = p.rms ? (A)0 : ld_any<A>(p.mean.p, p.mean.dt, r * p.mean.st);
      A rstd = ld_any<A>(p.rstd.p, p.rstd.dt, r * p.rstd.st);
      A gv = kc_ld<T>(g[r * p.gs0 + j * p.gs1]);
      aw += gv * (kc_ld<T>(x[r * p.xs0 + j * p.xs1]) - mean) * rstd;
      ab += gv;
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && j < p.N) {
    for (int t = 1; t < 8; t++) aw += sw[t][threadIdx.x], ab += sb[t][threadIdx.x];
    part[c * p.N + j] = aw;
    part[(chunks + c) * p.N + j] = ab;
  }
}

/* Stage 2: the chunk partials of column j summed by block (32, Y): thread y takes chunks
** y, y + Y, ... in order, then the Y sums are added in thread order (a fixed order: the
** same numbers every run). One thread a column walking all the chunks in a row was 15 us
** a call at GPT-2's 22 chunks, every load waiting on the one before; Y = 32 where the
** chunks are many (the fused residual norm's backward has one a block, a wave of them). */
/* Where the chunk sums go: part k of (parts, chunks, N) into out[k] where want[k] (the
** norm's weight, its bias, and for the residual norm r's gradient's column sums). */
struct Wsum {
  Vec out[3];
  bool want[3];
  int parts;
};
static Wsum wsum2(Vec dw, Vec db, bool want_w, bool want_b) {
  Wsum w;
  memset(&w, 0, sizeof w);
  w.out[0] = dw, w.out[1] = db, w.want[0] = want_w, w.want[1] = want_b, w.parts = 2;
  return w;
}

template <class A, int Y> __global__ void ln_bwd_wsum(const A *part, int64_t chunks, int64_t N, Wsum o) {
  __shared__ A sh[3][Y][33];
  const int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x;
  A acc[3] = {0, 0, 0}; /* constant indices only (unrolled, k < parts a predicate): registers */
  if (j < N)
    for (int64_t c = threadIdx.y; c < chunks; c += Y) {
#pragma unroll
      for (int k = 0; k < 3; k++)
        if (k < o.parts) acc[k] += part[(k * chunks + c) * N + j];
    }
#pragma unroll
  for (int k = 0; k < 3; k++) sh[k][threadIdx.y][threadIdx.x] = acc[k];
  __syncthreads();
  if (threadIdx.y != 0 || j >= N) return;
#pragma unroll
  for (int k = 0; k < 3; k++) {
    if (k >= o.parts) continue;
    for (int t = 1; t < Y; t++) acc[k] += sh[k][t][threadIdx.x];
    if (o.want[k]) st_any<A>((void *)o.out[k].p, o.out[k].dt, j * o.out[k].st, acc[k]);
  }
}

/* Stage 1 for f32 rows x read as float4s and g as four f32 or bf16 (8 bytes) a lane: block
** (32, 8) takes 128 columns, four a lane, and chunk rows (stride 8 a thread, then the 8
** partials in thread order, as ln_bwd_wpart); the same products in double. The element-a-
** lane kernels move 64 or 128 bytes a warp a load: 186 us a call on GPT-2's (16384, 768)
** rows, 0.4 TB/s. x rows 16-byte, g rows 8- (bf16) or 16-byte (f32) aligned, N % 4 == 0. */
template <class S> __device__ __forceinline__ double ld_stat(const Vec &v, int64_t r);
template <> __device__ __forceinline__ double ld_stat<float>(const Vec &v, int64_t r) {
  return (double)((const float *)v.p)[r]; /* f32 statistics, stride 1: no dtype switch in the loop */
}
template <> __device__ __forceinline__ double ld_stat<void>(const Vec &v, int64_t r) {
  return ld_any<double>(v.p, v.dt, r * v.st);
}
template <class G, class S>
__global__ void __launch_bounds__(256, 2) wpart_v4(const float *x, int64_t xs0, const G *g, int64_t gs0, Vec mean,
                                                Vec rstd, bool rms, int64_t R, int64_t N, double *part,
                                                int64_t chunk, int64_t chunks) {
  __shared__ double sw[8][128], sb[8][128];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t j = ((int64_t)blockIdx.x * 32 + tx) * 4, c = blockIdx.y;
  const int64_t r0 = c * chunk, r1 = r0 + chunk < R ? r0 + chunk : R;
  double aw[4] = {0, 0, 0, 0}, ab[4] = {0, 0, 0, 0};
  if (j < N) {
#pragma unroll(std::is_same<S, float>::value ? 4 : 2) /* the dtype switch of ld_any: more registers */
    for (int64_t r = r0 + ty; r < r1; r += 8) {
      const double m = rms ? 0.0 : ld_stat<S>(mean, r);
      const double rs = ld_stat<S>(rstd, r);
      const float4 xv = *reinterpret_cast<const float4 *>(x + r * xs0 + j);
      const float4 gv = kc_ld4<G>(g + r * gs0 + j);
      aw[0] += (double)gv.x * ((double)xv.x - m) * rs, ab[0] += (double)gv.x;
      aw[1] += (double)gv.y * ((double)xv.y - m) * rs, ab[1] += (double)gv.y;
      aw[2] += (double)gv.z * ((double)xv.z - m) * rs, ab[2] += (double)gv.z;
      aw[3] += (double)gv.w * ((double)xv.w - m) * rs, ab[3] += (double)gv.w;
    }
  }
#pragma unroll
  for (int e = 0; e < 4; e++) sw[ty][tx * 4 + e] = aw[e], sb[ty][tx * 4 + e] = ab[e];
  __syncthreads();
  if (ty != 0 || j >= N) return;
  for (int t = 1; t < 8; t++)
#pragma unroll
    for (int e = 0; e < 4; e++) aw[e] += sw[t][tx * 4 + e], ab[e] += sb[t][tx * 4 + e];
#pragma unroll
  for (int e = 0; e < 4; e++) part[c * N + j + e] = aw[e], part[(chunks + c) * N + j + e] = ab[e];
}

/* whether a norm's saved statistics are f32 with stride 1 (the rms norm has no mean) */
static bool stats_f32(const Vec &mean, const Vec &rstd, bool rms) {
  return (rms || (mean.dt == KILN_F32 && mean.st == 1)) && rstd.dt == KILN_F32 && rstd.st == 1;
}

/* The weight and bias gradients of a norm over R rows of N in two stages: stage1(grid,
** part, chunk, chunks) launches the chunk partials (o.parts, chunks, N) with blocks of
** `cols` columns, ln_bwd_wsum adds them into o's vectors. Chunks: `want` of them, or where
** want is 0 about 4 blocks an SM; at least 32 rows each. The partials live in the caching
** allocator for the two launches. */
template <class A, class F>
static kiln_status norm_wgrad(kiln__cuda_dev *d, int dev, int64_t R, int64_t N, int64_t cols, int64_t want,
                              const Wsum &o, const char *what1, const char *what2, F stage1) {
  const int64_t colb = (N + cols - 1) / cols;
  if (want <= 0) want = ((int64_t)(d->sm_count > 0 ? d->sm_count : 132) * 4 + colb - 1) / colb;
  int64_t chunk = (R + want - 1) / want;
  if (chunk < 32) chunk = 32;
  int64_t chunks = (R + chunk - 1) / chunk;
  if (chunks > 65535) chunks = 65535, chunk = (R + chunks - 1) / chunks;
  const size_t bytes = (size_t)(o.parts * chunks * N) * sizeof(A);
  A *part = (A *)kiln__cuda_alloc(dev, bytes);
  if (!part) return kiln_last_error();
  kiln_status st = kiln__cuda_capture_note(dev, part, bytes);
  if (st == KILN_OK) {
    stage1(dim3((unsigned)colb, (unsigned)chunks), part, chunk, chunks);
    st = kiln__cuda_launched(what1);
  }
  if (st == KILN_OK) {
    const unsigned blocks = (unsigned)((N + 31) / 32);
    if (chunks >= 128)
      ln_bwd_wsum<A, 32><<<blocks, dim3(32, 32), 0, d->stream>>>(part, chunks, N, o);
    else
      ln_bwd_wsum<A, 8><<<blocks, dim3(32, 8), 0, d->stream>>>(part, chunks, N, o);
    st = kiln__cuda_launched(what2);
  }
  kiln__cuda_free(dev, part, bytes); /* stream-ordered reuse */
  return st;
}

/* f32 rows of up to LN_VMAX * 128 elements, contiguous and 16-byte aligned (GPT-2's 768: the
** common case under autocast, where layer_norm runs in f32): the row is read once, into
** registers, as float4s (ln_fwd reads it three times, one float a lane a load: 95 us for
** GPT-2's (16384, 768) on the H200, 0.8 TB/s). The same arithmetic in double (the sums'
** order within a lane differs: 4 consecutive elements a chunk). The weight and bias go
** through float4 loads too when they are f32 and contiguous (wb_vec), else ld_any. */
#define LN_VMAX 8

__device__ __forceinline__ float4 ln_ld4(const Vec &v, bool vec, int64_t j) {
  if (vec) return reinterpret_cast<const float4 *>(v.p)[j / 4];
  return make_float4(ld_any<float>(v.p, v.dt, j * v.st), ld_any<float>(v.p, v.dt, (j + 1) * v.st),
                     ld_any<float>(v.p, v.dt, (j + 2) * v.st), ld_any<float>(v.p, v.dt, (j + 3) * v.st));
}

__global__ void __launch_bounds__(KC_THREADS) ln_fwd_f32v(const float *x, float *y, LnArgs p, bool wvec, bool bvec) {
  const int64_t r = (int64_t)blockIdx.x * (KC_THREADS / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= p.R) return;
  const float4 *xr = reinterpret_cast<const float4 *>(x + r * p.xs0);
  const int nv = (int)(p.N / 4);
  float4 v[LN_VMAX];
#pragma unroll
  for (int k = 0; k < LN_VMAX; k++) {
    const int c = k * 32 + lane;
    v[k] = c < nv ? xr[c] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  double mean = 0, var = 0;
  if (!p.rms) {
#pragma unroll
    for (int k = 0; k < LN_VMAX; k++)
      if (k * 32 + lane < nv) mean += ((double)v[k].x + (double)v[k].y) + ((double)v[k].z + (double)v[k].w);
    mean = warp_sum(mean) / (double)p.N;
  }
#pragma unroll
  for (int k = 0; k < LN_VMAX; k++) {
    if (k * 32 + lane >= nv) continue;
    const double a0 = v[k].x - mean, a1 = v[k].y - mean, a2 = v[k].z - mean, a3 = v[k].w - mean;
    var += (a0 * a0 + a1 * a1) + (a2 * a2 + a3 * a3);
  }
  var = warp_sum(var) / (double)p.N;
  const double rstd = 1.0 / sqrt(var + p.eps);
  float4 *yr = reinterpret_cast<float4 *>(y + r * p.ys0);
#pragma unroll
  for (int k = 0; k < LN_VMAX; k++) {
    const int c = k * 32 + lane;
    if (c >= nv) continue;
    double o[4] = {(v[k].x - mean) * rstd, (v[k].y - mean) * rstd, (v[k].z - mean) * rstd, (v[k].w - mean) * rstd};
    if (p.has_w) {
      const float4 w = ln_ld4(p.w, wvec, (int64_t)c * 4);
      o[0] *= w.x, o[1] *= w.y, o[2] *= w.z, o[3] *= w.w;
    }
    if (p.has_b) {
      const float4 b = ln_ld4(p.b, bvec, (int64_t)c * 4);
      o[0] += b.x, o[1] += b.y, o[2] += b.z, o[3] += b.w;
    }
    yr[c] = make_float4((float)o[0], (float)o[1], (float)o[2], (float)o[3]);
  }
  if (lane == 0) {
    if (p.rms) {
      st_any<double>((void *)p.out_mean.p, p.out_mean.dt, r * p.out_mean.st, rstd);
    } else {
      st_any<double>((void *)p.out_mean.p, p.out_mean.dt, r * p.out_mean.st, mean);
      st_any<double>((void *)p.out_rstd.p, p.out_rstd.dt, r * p.out_rstd.st, rstd);
    }
  }
}

/* ln_bwd_dx for the rows ln_fwd_f32v takes (x, g and dx contiguous, 16-byte aligned): x and
** g read once each into registers. */
__global__ void __launch_bounds__(KC_THREADS) ln_bwd_dx_f32v(const float *x, const float *g, float *dx, LnArgs p,
                                                             bool wvec) {
  const int64_t r = (int64_t)blockIdx.x * (KC_THREADS / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= p.R) return;
  const float4 *xr = reinterpret_cast<const float4 *>(x + r * p.xs0);
  const float4 *gr = reinterpret_cast<const float4 *>(g + r * p.gs0);
  const int nv = (int)(p.N / 4);
  const double mean = p.rms ? 0.0 : ld_any<double>(p.mean.p, p.mean.dt, r * p.mean.st);
  const double rstd = ld_any<double>(p.rstd.p, p.rstd.dt, r * p.rstd.st);
  float4 xv[LN_VMAX], gv[LN_VMAX]; /* gv: g w */
#pragma unroll
  for (int k = 0; k < LN_VMAX; k++) {
    const int c = k * 32 + lane;
    xv[k] = c < nv ? xr[c] : make_float4(0.f, 0.f, 0.f, 0.f);
    gv[k] = c < nv ? gr[c] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  double sg = 0, sgx = 0;
#pragma unroll
  for (int k = 0; k < LN_VMAX; k++) {
    const int c = k * 32 + lane;
    if (c >= nv) continue;
    double gw[4] = {gv[k].x, gv[k].y, gv[k].z, gv[k].w};
    if (p.has_w) {
      const float4 w = ln_ld4(p.w, wvec, (int64_t)c * 4);
      gw[0] *= w.x, gw[1] *= w.y, gw[2] *= w.z, gw[3] *= w.w;
    }
    const double xh[4] = {(xv[k].x - mean) * rstd, (xv[k].y - mean) * rstd, (xv[k].z - mean) * rstd,
                          (xv[k].w - mean) * rstd};
    sg += (gw[0] + gw[1]) + (gw[2] + gw[3]);
    sgx += (gw[0] * xh[0] + gw[1] * xh[1]) + (gw[2] * xh[2] + gw[3] * xh[3]);
  }
  sg = warp_sum(sg) / (double)p.N;
  sgx = warp_sum(sgx) / (double)p.N;
  if (p.rms) sg = 0;
  float4 *dr = reinterpret_cast<float4 *>(dx + r * p.ys0);
#pragma unroll
  for (int k = 0; k < LN_VMAX; k++) {
    const int c = k * 32 + lane;
    if (c >= nv) continue;
    double gw[4] = {gv[k].x, gv[k].y, gv[k].z, gv[k].w};
    if (p.has_w) {
      const float4 w = ln_ld4(p.w, wvec, (int64_t)c * 4);
      gw[0] *= w.x, gw[1] *= w.y, gw[2] *= w.z, gw[3] *= w.w;
    }
    const double xh[4] = {(xv[k].x - mean) * rstd, (xv[k].y - mean) * rstd, (xv[k].z - mean) * rstd,
                          (xv[k].w - mean) * rstd};
    dr[c] = make_float4((float)(rstd * (gw[0] - sg - xh[0] * sgx)), (float)(rstd * (gw[1] - sg - xh[1] * sgx)),
                        (float)(rstd * (gw[2] - sg - xh[2] * sgx)), (float)(rstd * (gw[3] - sg - xh[3] * sgx)));
  }
}

static bool al16(const void *p) { return ((uintptr_t)p & 15) == 0; }
/* a runtime-typed vector the float4 path may read: f32, contiguous, 16-byte aligned */
static bool vec4_ok(const Vec &v) { return v.dt == KILN_F32 && v.st == 1 && al16(v.p); }

/* Whether ln_fwd_f32v / ln_bwd_dx_f32v take these rows (KILN_CUDA_LN=simple: never). */
static bool ln_f32v_fits(const kiln__kargs *a, const LnArgs &p, bool bw) {
  if (a->in[0].dtype != KILN_F32 || p.N % 4 != 0 || p.N > LN_VMAX * 128) return false;
  if (p.xs1 != 1 || p.ys1 != 1 || p.xs0 % 4 != 0 || p.ys0 % 4 != 0) return false;
  if (!al16(a->in[0].data) || !al16(a->out[0].data)) return false;
  if (bw && (p.gs1 != 1 || p.gs0 % 4 != 0 || !al16(a->in[1].data))) return false;
  return kiln__knob_choice("KILN_CUDA_LN", 0) != 1; /* vec, simple */
}

template <class T>
kiln_status ln_run(kiln__cuda_dev *d, const kiln__kargs *a, LnArgs &p) {
  typedef typename wide_acc<T>::type A;
  bool bw = a->op == KILN__K_LAYER_NORM_BACKWARD;
  unsigned blocks = (unsigned)((p.R + KC_THREADS / 32 - 1) / (KC_THREADS / 32));
  const bool f32v = ln_f32v_fits(a, p, bw);
  if (!bw) {
    if (f32v)
      ln_fwd_f32v<<<blocks, KC_THREADS, 0, d->stream>>>((const float *)a->in[0].data, (float *)a->out[0].data, p,
                                                         p.has_w && vec4_ok(p.w), p.has_b && vec4_ok(p.b));
    else
      ln_fwd<T, A><<<blocks, KC_THREADS, 0, d->stream>>>((const T *)a->in[0].data, (T *)a->out[0].data, p);
    return kiln__cuda_launched("layer_norm");
  }
  const T *x = (const T *)a->in[0].data, *g = (const T *)a->in[1].data;
  if (f32v)
    ln_bwd_dx_f32v<<<blocks, KC_THREADS, 0, d->stream>>>((const float *)x, (const float *)g, (float *)a->out[0].data, p,
                                                          p.has_w && vec4_ok(p.w));
  else
    ln_bwd_dx<T, A><<<blocks, KC_THREADS, 0, d->stream>>>(x, g, (T *)a->out[0].data, p);
  KC_TRY(kiln__cuda_launched("layer_norm_backward"));
  if (a->n_out < 2) return KILN_OK;
  Vec dw = vec_of(&a->out[1]), db = a->n_out > 2 ? vec_of(&a->out[2]) : dw;
  const char *w1 = "layer_norm_backward (weight partials)", *w2 = "layer_norm_backward (weight sums)";
  if (f32v && std::is_same<A, double>::value) /* f32 x and g, rows 16-byte aligned */
    return norm_wgrad<double>(d, a->device, p.R, p.N, 128, 0, wsum2(dw, db, true, a->n_out > 2), w1, w2,
                              [&](dim3 grid, double *part, int64_t chunk, int64_t chunks) {
                                if (stats_f32(p.mean, p.rstd, p.rms))
                                  wpart_v4<float, float><<<grid, dim3(32, 8), 0, d->stream>>>(
                                      (const float *)x, p.xs0, (const float *)g, p.gs0, p.mean, p.rstd, p.rms, p.R,
                                      p.N, part, chunk, chunks);
                                else
                                  wpart_v4<float, void><<<grid, dim3(32, 8), 0, d->stream>>>(
                                      (const float *)x, p.xs0, (const float *)g, p.gs0, p.mean, p.rstd, p.rms, p.R,
                                      p.N, part, chunk, chunks);
                              });
  return norm_wgrad<A>(d, a->device, p.R, p.N, 32, 0, wsum2(dw, db, true, a->n_out > 2), w1, w2,
                       [&](dim3 grid, A *part, int64_t chunk, int64_t chunks) {
                         ln_bwd_wpart<T, A><<<grid, dim3(32, 8), 0, d->stream>>>(x, g, part, chunk, chunks, p);
                       });
}

bool ln_supports(const kiln__kargs *a) {
  kiln_dtype dt = a->in[0].dtype;
  if (!kc_is_float(dt) || a->in[0].ndim != 2 || a->out[0].ndim != 2 || a->out[0].dtype != dt) return false;
  if (a->op == KILN__K_LAYER_NORM_BACKWARD && a->in[1].dtype != dt) return false;
  for (int i = 1; i < a->n_in; i++)
    if (!kc_is_float(a->in[i].dtype)) return false;
  for (int i = 1; i < a->n_out; i++)
    if (!kc_is_float(a->out[i].dtype)) return false;
  return true;
}

kiln_status layer_norm(kiln__cuda_dev *d, const kiln__kargs *a) {
  bool bw = a->op == KILN__K_LAYER_NORM_BACKWARD;
  const kiln__view *x = &a->in[0], *y = &a->out[0];
  LnArgs p;
  p.R = x->shape[0], p.N = x->shape[1];
  p.xs0 = x->strides[0], p.xs1 = x->strides[1];
  p.ys0 = y->strides[0], p.ys1 = y->strides[1];
  p.gs0 = bw ? a->in[1].strides[0] : 0, p.gs1 = bw ? a->in[1].strides[1] : 0;
  p.rms = a->i[1] == 1;
  p.eps = a->s[0];
  p.has_w = (a->i[0] & 1) != 0;
  p.has_b = !bw && (a->i[0] & 2) != 0;
  Vec none = {NULL, 0, 0};
  p.w = p.b = p.mean = p.rstd = p.out_mean = p.out_rstd = none;
  if (!bw) {
    if (p.has_w) p.w = vec_of(&a->in[1]);
    if (p.has_b) p.b = vec_of(&a->in[p.has_w ? 2 : 1]);
    p.out_mean = vec_of(&a->out[1]);
    if (!p.rms) p.out_rstd = vec_of(&a->out[2]);
  } else {
    p.mean = vec_of(&a->in[2]);
    p.rstd = vec_of(&a->in[3]);
    if (p.has_w) p.w = vec_of(&a->in[4]);
  }
  if (p.R == 0 || p.N == 0) {
    for (int k = 1; bw && k < a->n_out; k++) KC_TRY(kiln__cuda_fill_view(a->device, &a->out[k], 0.0));
    return KILN_OK;
  }
  if (p.R > (int64_t)INT32_MAX * 8)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_%s: %lld rows is too many", kiln__kop_name(a->op), (long long)p.R);
  KC_SWITCH_FLOAT(x->dtype, T, return dtype_error(a, x->dtype), return ln_run<T>(d, a, p))
  return KILN_OK;
}

/* ================================================================ residual add + layer norm */
/* RESIDUAL_LAYER_NORM(_BACKWARD) (backend.h): a transformer block's residual add and the
** layer norm after it in one pass, forward and backward, the way the unfused ops compute
** them: s = x + r in x's arithmetic (r converted exactly), the statistics as ln_fwd's
** (two passes, A = wide_acc), y rounded to x's dtype then to y's (the f32 norm, then the
** cast autocast's product makes), and in the backward ln_bwd_dx's formula on g read in
** its own dtype, rounded to s's dtype, plus the gradient gs that reached s elsewhere (the
** engine's accumulation), then rounded to r's dtype (the cast's backward). Under bf16
** autocast the unfused pair moved about 400 MB a norm of GPT-2 at B=16, T=1024 forward
** (r's cast to f32, the add, the norm's f32 output, its cast to bf16); this moves 150.
** One warp a row (GPT rows: 768 wide); column stride 1, row strides free; r, y, g and dr
** in any float dtype (read and written through ld_any / st_any: warp-uniform switches). */
struct RlnArgs {
  int64_t R, N;
  int64_t rT; /* forward: r's rows (R, or fewer that repeat: r broadcast over x's leading dims) */
  int64_t xs0, rs0, ys0, ss0, gs0, gss0, dss0, drs0;
  int rdt, ydt, gdt, drdt;
  const void *r, *g;
  void *y, *dr;
  Vec w, b, mean, rstd;
  bool y_ones; /* forward: after each y row a bf16 1 and seven 0s (rows N + 8 apart) */
  bool has_w, has_b, has_gs, want_dr, want_rs; /* want_rs: r's gradient's column sums (the third partials) */
  bool stats_ahead; /* staged backward: the next row's mean and rstd read when its copy starts */
  double eps;
};
/* r's row for x's row (r broadcast over x's leading dims repeats every rT rows) */
__device__ __forceinline__ int64_t rln_rrow(const RlnArgs &p, int64_t row) { return p.rT == p.R ? row : row % p.rT; }

template <class T, class A>
__global__ void __launch_bounds__(KC_THREADS) rln_fwd(const T *x, T *s, RlnArgs p) {
  typedef typename kc_traits<T>::acc S; /* the add's arithmetic: the ADD kernel's */
  int64_t row = (int64_t)blockIdx.x * (KC_THREADS / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= p.R) return;
  const T *xr = x + row * p.xs0;
  T *sr = s + row * p.ss0;
  A mean = 0, var = 0;
  for (int64_t j = lane; j < p.N; j += 32) { /* each lane rereads only what it wrote */
    T sv = kc_st<T>(kc_ld<T>(xr[j]) + ld_any<S>(p.r, p.rdt, rln_rrow(p, row) * p.rs0 + j));
    sr[j] = sv;
    mean += (A)kc_ld<T>(sv);
  }
  mean = warp_sum(mean) / (A)p.N;
  for (int64_t j = lane; j < p.N; j += 32) {
    A dv = (A)kc_ld<T>(sr[j]) - mean;
    var += dv * dv;
  }
  var = warp_sum(var) / (A)p.N;
  A rstd = (A)1 / sqrt(var + (A)p.eps);
  for (int64_t j = lane; j < p.N; j += 32) {
    A v = ((A)kc_ld<T>(sr[j]) - mean) * rstd;
    if (p.has_w) v *= ld_any<A>(p.w.p, p.w.dt, j * p.w.st);
    if (p.has_b) v += ld_any<A>(p.b.p, p.b.dt, j * p.b.st);
    st_any<A>(p.y, p.ydt, row * p.ys0 + j, (A)kc_ld<T>(kc_st<T>(v)));
  }
  if (lane == 0) {
    st_any<A>((void *)p.mean.p, p.mean.dt, row * p.mean.st, mean);
    st_any<A>((void *)p.rstd.p, p.rstd.dt, row * p.rstd.st, rstd);
  }
}

template <class T, class A>
__global__ void __launch_bounds__(KC_THREADS) rln_bwd_ds(const T *s, const T *gs, T *ds, RlnArgs p) {
  int64_t row = (int64_t)blockIdx.x * (KC_THREADS / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= p.R) return;
  const T *sr = s + row * p.ss0;
  A mean = ld_any<A>(p.mean.p, p.mean.dt, row * p.mean.st);
  A rstd = ld_any<A>(p.rstd.p, p.rstd.dt, row * p.rstd.st);
  A sg = 0, sgx = 0;
  for (int64_t j = lane; j < p.N; j += 32) {
    A xh = ((A)kc_ld<T>(sr[j]) - mean) * rstd;
    A gw = ld_any<A>(p.g, p.gdt, row * p.gs0 + j);
    if (p.has_w) gw *= ld_any<A>(p.w.p, p.w.dt, j * p.w.st);
    sg += gw;
    sgx += gw * xh;
  }
  sg = warp_sum(sg) / (A)p.N;
  sgx = warp_sum(sgx) / (A)p.N;
  T *dr = ds + row * p.dss0;
  for (int64_t j = lane; j < p.N; j += 32) {
    A xh = ((A)kc_ld<T>(sr[j]) - mean) * rstd;
    A gw = ld_any<A>(p.g, p.gdt, row * p.gs0 + j);
    if (p.has_w) gw *= ld_any<A>(p.w.p, p.w.dt, j * p.w.st);
    T dv = kc_st<T>(rstd * (gw - sg - xh * sgx));
    if (p.has_gs) dv = kc_st<T>(kc_ld<T>(dv) + kc_ld<T>(gs[row * p.gss0 + j]));
    dr[j] = dv;
    if (p.want_dr) st_any<A>(p.dr, p.drdt, row * p.drs0 + j, (A)kc_ld<T>(dv));
  }
}

/* Stage 1 of the weight and bias gradients, as ln_bwd_wpart with g in its own dtype. */
template <class T, class A>
__global__ void rln_bwd_wpart(const T *s, A *part, int64_t chunk, int64_t chunks, RlnArgs p) {
  __shared__ A sw[8][33], sb[8][33];
  int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x;
  int64_t c = blockIdx.y;
  int64_t r0 = c * chunk, r1 = r0 + chunk < p.R ? r0 + chunk : p.R;
  A aw = 0, ab = 0;
  if (j < p.N) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) {
      A mean = ld_any<A>(p.mean.p, p.mean.dt, r * p.mean.st);
      A rstd = ld_any<A>(p.rstd.p, p.rstd.dt, r * p.rstd.st);
      A gv = ld_any<A>(p.g, p.gdt, r * p.gs0 + j);
      aw += gv * ((A)kc_ld<T>(s[r * p.ss0 + j]) - mean) * rstd;
      ab += gv;
    }
  }
  sw[threadIdx.y][threadIdx.x] = aw;
  sb[threadIdx.y][threadIdx.x] = ab;
  __syncthreads();
  if (threadIdx.y == 0 && j < p.N) {
    for (int t = 1; t < 8; t++) aw += sw[t][threadIdx.x], ab += sb[t][threadIdx.x];
    part[c * p.N + j] = aw;
    part[(chunks + c) * p.N + j] = ab;
  }
}

/* The GPT case under bf16 autocast (x, s, gs f32; r, y, g, dr bf16; N <= 32 * RLN_V):
** the same arithmetic as rln_fwd / rln_bwd_ds (f32 add, f64 statistics, the same
** roundings), with the row's values held in registers: each lane loads its RLN_V
** elements once, back to back, where the general kernels walk the row three times
** through runtime-typed loads (135 us a call at GPT-2's sizes in the 18:40 profile, 1.1
** TB/s: latency, not bandwidth). */
#define RLN_V 32
__global__ void __launch_bounds__(KC_THREADS) rln_fwd_fast(const float *x, float *s, RlnArgs p) {
  int64_t row = (int64_t)blockIdx.x * (KC_THREADS / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= p.R) return;
  const float *xr = x + row * p.xs0;
  const __nv_bfloat16 *rr = (const __nv_bfloat16 *)p.r + rln_rrow(p, row) * p.rs0;
  float *sr = s + row * p.ss0;
  float v[RLN_V];
  double mean = 0, var = 0;
#pragma unroll
  for (int k = 0; k < RLN_V; k++) {
    int64_t j = lane + 32 * k;
    v[k] = 0.0f;
    if (j < p.N) {
      v[k] = xr[j] + __bfloat162float(rr[j]);
      sr[j] = v[k];
      mean += (double)v[k];
    }
  }
  mean = warp_sum(mean) / (double)p.N;
#pragma unroll
  for (int k = 0; k < RLN_V; k++) {
    if (lane + 32 * k < p.N) {
      double dv = (double)v[k] - mean;
      var += dv * dv;
    }
  }
  var = warp_sum(var) / (double)p.N;
  double rstd = 1.0 / sqrt(var + p.eps);
  __nv_bfloat16 *yr = (__nv_bfloat16 *)p.y + row * p.ys0;
#pragma unroll
  for (int k = 0; k < RLN_V; k++) {
    int64_t j = lane + 32 * k;
    if (j < p.N) {
      double t = ((double)v[k] - mean) * rstd;
      if (p.has_w) t *= ld_any<double>(p.w.p, p.w.dt, j * p.w.st);
      if (p.has_b) t += ld_any<double>(p.b.p, p.b.dt, j * p.b.st);
      yr[j] = __float2bfloat16_rn((float)t);
    }
  }
  if (lane == 0) {
    st_any<double>((void *)p.mean.p, p.mean.dt, row * p.mean.st, mean);
    st_any<double>((void *)p.rstd.p, p.rstd.dt, row * p.rstd.st, rstd);
  }
}

__global__ void __launch_bounds__(KC_THREADS) rln_bwd_ds_fast(const float *s, const float *gs, float *ds, RlnArgs p) {
  int64_t row = (int64_t)blockIdx.x * (KC_THREADS / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= p.R) return;
  const float *sr = s + row * p.ss0;
  const __nv_bfloat16 *gr = (const __nv_bfloat16 *)p.g + row * p.gs0;
  double mean = ld_any<double>(p.mean.p, p.mean.dt, row * p.mean.st);
  double rstd = ld_any<double>(p.rstd.p, p.rstd.dt, row * p.rstd.st);
  float sv[RLN_V];
  double gw[RLN_V];
  double sg = 0, sgx = 0;
#pragma unroll
  for (int k = 0; k < RLN_V; k++) {
    int64_t j = lane + 32 * k;
    sv[k] = 0.0f, gw[k] = 0.0;
    if (j < p.N) {
      sv[k] = sr[j];
      gw[k] = (double)__bfloat162float(gr[j]);
      if (p.has_w) gw[k] *= ld_any<double>(p.w.p, p.w.dt, j * p.w.st);
      double xh = ((double)sv[k] - mean) * rstd;
      sg += gw[k];
      sgx += gw[k] * xh;
    }
  }
  sg = warp_sum(sg) / (double)p.N;
  sgx = warp_sum(sgx) / (double)p.N;
  float *dsr = ds + row * p.dss0;
  __nv_bfloat16 *drr = p.want_dr ? (__nv_bfloat16 *)p.dr + row * p.drs0 : NULL;
#pragma unroll
  for (int k = 0; k < RLN_V; k++) {
    int64_t j = lane + 32 * k;
    if (j < p.N) {
      double xh = ((double)sv[k] - mean) * rstd;
      float dv = (float)(rstd * (gw[k] - sg - xh * sgx));
      if (p.has_gs) dv = dv + gs[row * p.gss0 + j];
      dsr[j] = dv;
      if (drr) drr[j] = __float2bfloat16_rn(dv);
    }
  }
}

/* rln_fwd_fast / rln_bwd_ds_fast with 16-byte f32 and 8-byte bf16 accesses (four
** consecutive elements a lane a load, as ln_fwd_f32v): N % 4 == 0, N <= LN_VMAX * 128,
** rows aligned (rln_v4_fits). C, the type of the per-element arithmetic: double is the
** element-a-lane kernels' arithmetic (the statistics' sums in another order); float is
** PyTorch's (its layer norm computes in f32), with each lane's partial sums of the row
** statistics made in f32 over its few elements (24 for GPT-2) and added across the warp in
** double. In double the kernels waited on the f64 pipe and its conversions more than on
** memory (bench/RESULTS.md); KILN_CUDA_RLN=f64 keeps double. */
__device__ __forceinline__ float4 bf4_round(float4 v) { /* each to bf16 and back */
  return make_float4(__bfloat162float(__float2bfloat16_rn(v.x)), __bfloat162float(__float2bfloat16_rn(v.y)),
                     __bfloat162float(__float2bfloat16_rn(v.z)), __bfloat162float(__float2bfloat16_rn(v.w)));
}
__device__ __forceinline__ void bf4_st(void *base, int64_t q, float x, float y, float z, float w) {
  __nv_bfloat162 a = __floats2bfloat162_rn(x, y), b = __floats2bfloat162_rn(z, w);
  uint2 u;
  u.x = *reinterpret_cast<uint32_t *>(&a), u.y = *reinterpret_cast<uint32_t *>(&b);
  reinterpret_cast<uint2 *>(base)[q] = u;
}

/* The rows of group g of a block's G (a warp of the warp kernels, a row group of the
** row-group forward): with chunk > 0 the block's chunk of rows [b chunk, (b + 1) chunk), group g
** every G-th from g; with chunk 0 every (blocks G)-th row from b G + g, so that the groups of
** all blocks work on neighbouring rows at a time (the backward's partials add whatever rows
** a block takes). KILN_CUDA_RLN=rgchunk / winter pick chunks / interleaved rows for the
** row-group / warp kernels. */
struct RgRows {
  int64_t first, step, end;
};
__device__ __forceinline__ RgRows rows_of(int64_t chunk, int64_t R, int64_t G, int64_t g) {
  if (chunk > 0) {
    const int64_t r0 = (int64_t)blockIdx.x * chunk;
    return {r0 + g, G, r0 + chunk < R ? r0 + chunk : R};
  }
  return {(int64_t)blockIdx.x * G + g, (int64_t)gridDim.x * G, R};
}

/* The staged kernels' row loop (PF): the warp's first row fetched before the loop, and at
** each row the next one (row + W, while there is one) started into the other buffer
** before waiting for this row's copies (each lane's own: no barrier). */
template <bool PF, class F> __device__ __forceinline__ void rln_stage_first(int64_t row, int64_t r1, F &fetch) {
  if constexpr (PF) {
    if (row < r1) fetch(row, 0);
  }
}
template <bool PF, class F>
__device__ __forceinline__ void rln_stage_next(int64_t row, int64_t r1, int64_t step, int buf, F &fetch) {
  if constexpr (PF) {
    if (row + step < r1) {
      fetch(row + step, buf ^ 1);
      kc_cp_wait<1>();
    } else {
      kc_cp_wait<0>();
    }
  }
}

/* The forward: block b takes rows [b chunk, (b + 1) chunk), warp w every W-th of them from
** w (chunk W: a row a warp). NV float4s a lane. PF: a warp's next row (x and r) comes by
** cp.async into the other of its two shared buffers while it works on this one (chunks of
** several rows a warp, one wave of blocks: rln_fwd_v4_pf_nv); rln_fwd_stage_bytes of
** dynamic shared memory. At most 80 registers: 3 blocks an SM (GPT-2's 768: 69; 85 when
** left to ptxas, 2 blocks). r is bf16 (a product's output) or f32 (rf32: a GPT's position
** embedding, broadcast over the batch), a uniform branch. */
template <int NV> constexpr size_t rln_fwd_stage_bytes(bool rf32) {
  return (size_t)(KC_THREADS / 32) * 2 * NV * 32 * (16 + (rf32 ? 16 : 8));
}
template <class C, int NV, bool PF>
__global__ void __launch_bounds__(KC_THREADS, 3) rln_fwd_v4(const float *x, float *s, RlnArgs p, bool wvec, bool bvec,
                                                         int64_t chunk) {
  constexpr int W = KC_THREADS / 32, S = NV * 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nv = (int)(p.N / 4);
  const bool rf32 = p.rdt == KILN_F32;
  extern __shared__ float4 stage[]; /* PF: x (W, 2, S) float4, r (W, 2, S) uint2 (bf16) or float4 (f32) */
  float4 *st_x = stage, *st_rf = stage + W * 2 * S;
  uint2 *st_r = reinterpret_cast<uint2 *>(st_rf);
  auto fetch = [&](int64_t row, int b) {
    const float *xr = x + row * p.xs0;
    const int64_t ro = rln_rrow(p, row) * p.rs0;
    const int o = (warp * 2 + b) * S;
#pragma unroll
    for (int k = 0; k < NV; k++) {
      const int c = k * 32 + lane;
      if (c < nv) {
        kc_cp_async16(&st_x[o + c], xr + 4 * c);
        if (rf32)
          kc_cp_async16(&st_rf[o + c], (const float *)p.r + ro + 4 * c);
        else
          kc_cp_async8(&st_r[o + c], (const __nv_bfloat16 *)p.r + ro + 4 * c);
      }
    }
    kc_cp_commit();
  };
  const RgRows rw = rows_of(chunk, p.R, W, warp);
  rln_stage_first<PF>(rw.first, rw.end, fetch);
  int buf = 0;
#pragma unroll 1
  for (int64_t row = rw.first; row < rw.end; row += rw.step, buf ^= 1) {
    const int o = (warp * 2 + buf) * S;
    rln_stage_next<PF>(row, rw.end, rw.step, buf, fetch);
    const float4 *xr = reinterpret_cast<const float4 *>(x + row * p.xs0);
    const int64_t ro = rln_rrow(p, row) * p.rs0;
    float4 *sr = reinterpret_cast<float4 *>(s + row * p.ss0);
    float4 v[NV];
    C lm = 0, lv = 0;
#pragma unroll
    for (int k = 0; k < NV; k++) {
      const int c = k * 32 + lane;
      v[k] = make_float4(0.f, 0.f, 0.f, 0.f);
      if (c < nv) {
        const float4 xv = PF ? st_x[o + c] : xr[c];
        const float4 rv = rf32 ? (PF ? st_rf[o + c] : kc_ld4((const float *)p.r + ro + 4 * c))
                               : PF ? kc_ld4(reinterpret_cast<const __nv_bfloat16 *>(&st_r[o + c]))
                                    : kc_ld4((const __nv_bfloat16 *)p.r + ro + 4 * c);
        v[k] = make_float4(xv.x + rv.x, xv.y + rv.y, xv.z + rv.z, xv.w + rv.w);
        sr[c] = v[k];
        lm += ((C)v[k].x + (C)v[k].y) + ((C)v[k].z + (C)v[k].w);
      }
    }
    const double mean = warp_sum((double)lm) / (double)p.N;
    const C mc = (C)mean;
#pragma unroll
    for (int k = 0; k < NV; k++) {
      if (k * 32 + lane >= nv) continue;
      const C a0 = v[k].x - mc, a1 = v[k].y - mc, a2 = v[k].z - mc, a3 = v[k].w - mc;
      lv += (a0 * a0 + a1 * a1) + (a2 * a2 + a3 * a3);
    }
    const double var = warp_sum((double)lv) / (double)p.N;
    const double rstd = 1.0 / sqrt(var + p.eps);
    const C rc = (C)rstd;
    __nv_bfloat16 *yr = (__nv_bfloat16 *)p.y + row * p.ys0;
#pragma unroll
    for (int k = 0; k < NV; k++) {
      const int c = k * 32 + lane;
      if (c >= nv) continue;
      C t[4] = {(v[k].x - mc) * rc, (v[k].y - mc) * rc, (v[k].z - mc) * rc, (v[k].w - mc) * rc};
      if (p.has_w) {
        const float4 w = ln_ld4(p.w, wvec, (int64_t)c * 4);
        t[0] *= (C)w.x, t[1] *= (C)w.y, t[2] *= (C)w.z, t[3] *= (C)w.w;
      }
      if (p.has_b) {
        const float4 b = ln_ld4(p.b, bvec, (int64_t)c * 4);
        t[0] += (C)b.x, t[1] += (C)b.y, t[2] += (C)b.z, t[3] += (C)b.w;
      }
      bf4_st(yr, c, (float)t[0], (float)t[1], (float)t[2], (float)t[3]);
    }
    if (lane == 0) {
      st_any<double>((void *)p.mean.p, p.mean.dt, row * p.mean.st, mean);
      st_any<double>((void *)p.rstd.p, p.rstd.dt, row * p.rstd.st, rstd);
      if (p.y_ones) *reinterpret_cast<uint4 *>(yr + p.N) = make_uint4(0x3F80u, 0u, 0u, 0u); /* bf16 1, then 0s */
    }
  }
}

/* A block's W warps' f32 column sums (the slab, column j at float j of each warp's row)
** added in warp order in double into out[0, N). */
template <int NV, int W>
__device__ __forceinline__ void rln_slab_sum(const float4 (*slab)[NV * 32], int64_t N, double *out) {
  for (int j = threadIdx.x; j < (int)N; j += W * 32) {
    double t = 0;
#pragma unroll
    for (int w = 0; w < W; w++) t += (double)reinterpret_cast<const float *>(slab[w])[j];
    out[j] = t;
  }
}

/* The backward, with the weight and bias gradients' partials when WG: block b (W warps)
** takes rows [b chunk, (b + 1) chunk), warp w every W-th of them from w; without WG chunk
** is W (a row a warp). NV float4s a lane (N <= NV * 128: the row in registers, no slots for
** columns the row lacks). With WG each lane adds g xhat and g of its columns over the
** warp's rows into f32 registers (a warp's rows are few: R / (chunks * W), about 8 for
** GPT-2), and with p.want_rs the column sums of r's gradient as written (dr's bf16 values,
** or ds): the bias gradient of the linear that made r, which the op layer hands over to
** it. Then the block adds its warps in warp order in double into part (2 or 3, chunks, N)
** for ln_bwd_wsum: the norm's parameter gradients without wpart_v4's second read of s and
** g, and no column-sum kernel for that bias. The same ds and dr bits either way. With WG
** the accumulators take 2 or 3 NV float4s a lane more: blocks of 4 warps keep them in
** registers where 8-warp blocks capped at 2 an SM spill. C: the per-element arithmetic
** (above). PF (with WG): a warp's next row (s, g and gs) comes by cp.async into the other
** of its two shared buffers while it works on this one, so the loads of one row wait
** behind the sums of the last rather than after them; the dynamic shared memory is
** rln_stage_bytes, the buffers become the slab at the end. */
constexpr int rln_warps(bool wg) { return wg ? 4 : KC_THREADS / 32; }
template <int NV> constexpr size_t rln_stage_bytes(bool has_gs) {
  return (size_t)rln_warps(true) * 2 * NV * 32 * (16 + 8 + (has_gs ? 16 : 0));
}
template <int NV, bool WG, class C, bool PF>
__global__ void __launch_bounds__(rln_warps(WG) * 32) rln_bwd_v4(const float *s, const float *gs, float *ds, RlnArgs p,
                                                                 bool wvec, int64_t chunk, int64_t chunks, double *part) {
  static_assert(!PF || WG, "the staged loads are for the chunked (WG) kernel");
  constexpr int W = rln_warps(WG), S = NV * 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int nv = (int)(p.N / 4);
  extern __shared__ float4 stage[]; /* PF: s (W, 2, S) float4, gs (W, 2, S) float4 if has_gs, g (W, 2, S) uint2 */
  float4 *st_s = stage, *st_gs = stage + W * 2 * S;
  uint2 *st_g = reinterpret_cast<uint2 *>(stage + (p.has_gs ? 2 : 1) * W * 2 * S);
  auto fetch = [&](int64_t row, int b) { /* PF: row's s, g, gs into buffer b, one commit group */
    const float *sr = s + row * p.ss0, *gsr = p.has_gs ? gs + row * p.gss0 : NULL;
    const __nv_bfloat16 *gr = (const __nv_bfloat16 *)p.g + row * p.gs0;
    const int o = (warp * 2 + b) * S;
#pragma unroll
    for (int k = 0; k < NV; k++) {
      const int c = k * 32 + lane;
      if (c < nv) {
        kc_cp_async16(&st_s[o + c], sr + 4 * c);
        kc_cp_async8(&st_g[o + c], gr + 4 * c);
        if (gsr) kc_cp_async16(&st_gs[o + c], gsr + 4 * c);
      }
    }
    kc_cp_commit();
  };
  float4 aw[WG ? NV : 1], ab[WG ? NV : 1], ar[WG ? NV : 1];
  if constexpr (WG) {
#pragma unroll
    for (int k = 0; k < NV; k++) aw[k] = ab[k] = ar[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const RgRows rw = rows_of(chunk, p.R, W, warp);
  rln_stage_first<PF>(rw.first, rw.end, fetch);
  /* stats_ahead (PF): the row's mean and rstd were read with its copy, a row ahead, so the
  ** row's sums do not start behind a dependent load of its own */
  const bool ahead = PF && p.stats_ahead;
  auto stat = [&](const Vec &v, int64_t row) { return row < rw.end ? (C)ld_any<double>(v.p, v.dt, row * v.st) : (C)0; };
  C mc_next = ahead ? stat(p.mean, rw.first) : (C)0, rc_next = ahead ? stat(p.rstd, rw.first) : (C)0;
  int buf = 0;
#pragma unroll 1
  for (int64_t row = rw.first; row < rw.end; row += rw.step, buf ^= 1) {
    const int o = (warp * 2 + buf) * S;
    rln_stage_next<PF>(row, rw.end, rw.step, buf, fetch);
    const float4 *sr = reinterpret_cast<const float4 *>(s + row * p.ss0);
    const __nv_bfloat16 *gr = (const __nv_bfloat16 *)p.g + row * p.gs0;
    const C mc = ahead ? mc_next : stat(p.mean, row);
    const C rc = ahead ? rc_next : stat(p.rstd, row);
    if (ahead) mc_next = stat(p.mean, row + rw.step), rc_next = stat(p.rstd, row + rw.step);
    float4 sv[PF ? 1 : NV], gv[PF ? 1 : NV]; /* unstaged: s and g as read, all loads first */
    C lsg = 0, lsgx = 0;
    if constexpr (!PF) {
#pragma unroll
      for (int k = 0; k < NV; k++) {
        const int c = k * 32 + lane;
        sv[k] = gv[k] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (c < nv) sv[k] = sr[c], gv[k] = kc_ld4(gr + 4 * c);
      }
    }
#pragma unroll
    for (int k = 0; k < NV; k++) {
      const int c = k * 32 + lane;
      if (c >= nv) continue;
      const float4 g4 = PF ? kc_ld4(reinterpret_cast<const __nv_bfloat16 *>(&st_g[o + c])) : gv[k];
      const float4 s4 = PF ? st_s[o + c] : sv[k];
      C gw[4] = {g4.x, g4.y, g4.z, g4.w};
      if (p.has_w) {
        const float4 w = ln_ld4(p.w, wvec, (int64_t)c * 4);
        gw[0] *= (C)w.x, gw[1] *= (C)w.y, gw[2] *= (C)w.z, gw[3] *= (C)w.w;
      }
      const C xh[4] = {((C)s4.x - mc) * rc, ((C)s4.y - mc) * rc, ((C)s4.z - mc) * rc, ((C)s4.w - mc) * rc};
      lsg += (gw[0] + gw[1]) + (gw[2] + gw[3]);
      lsgx += (gw[0] * xh[0] + gw[1] * xh[1]) + (gw[2] * xh[2] + gw[3] * xh[3]);
      if constexpr (WG) {
        aw[k].x += (float)((C)g4.x * xh[0]), aw[k].y += (float)((C)g4.y * xh[1]);
        aw[k].z += (float)((C)g4.z * xh[2]), aw[k].w += (float)((C)g4.w * xh[3]);
        ab[k].x += g4.x, ab[k].y += g4.y, ab[k].z += g4.z, ab[k].w += g4.w;
      }
    }
    const C sg = (C)(warp_sum((double)lsg) / (double)p.N);
    const C sgx = (C)(warp_sum((double)lsgx) / (double)p.N);
    float4 *dsr = reinterpret_cast<float4 *>(ds + row * p.dss0);
    const float4 *gsr = p.has_gs ? (PF ? st_gs + o : reinterpret_cast<const float4 *>(gs + row * p.gss0)) : NULL;
    __nv_bfloat16 *drr = p.want_dr ? (__nv_bfloat16 *)p.dr + row * p.drs0 : NULL;
#pragma unroll
    for (int k = 0; k < NV; k++) {
      const int c = k * 32 + lane;
      if (c >= nv) continue;
      /* staged: s and g read again from shared memory, not held in registers across the
      ** row's sums (room for the third accumulator) */
      const float4 g4 = PF ? kc_ld4(reinterpret_cast<const __nv_bfloat16 *>(&st_g[o + c])) : gv[k];
      const float4 s4 = PF ? st_s[o + c] : sv[k];
      C gw[4] = {g4.x, g4.y, g4.z, g4.w};
      if (p.has_w) { /* recomputed, not held in registers across the row's sums */
        const float4 w = ln_ld4(p.w, wvec, (int64_t)c * 4);
        gw[0] *= (C)w.x, gw[1] *= (C)w.y, gw[2] *= (C)w.z, gw[3] *= (C)w.w;
      }
      const C xh[4] = {((C)s4.x - mc) * rc, ((C)s4.y - mc) * rc, ((C)s4.z - mc) * rc, ((C)s4.w - mc) * rc};
      float4 dv = make_float4((float)(rc * (gw[0] - sg - xh[0] * sgx)), (float)(rc * (gw[1] - sg - xh[1] * sgx)),
                              (float)(rc * (gw[2] - sg - xh[2] * sgx)), (float)(rc * (gw[3] - sg - xh[3] * sgx)));
      if (gsr) {
        const float4 o4 = gsr[c];
        dv.x = dv.x + o4.x, dv.y = dv.y + o4.y, dv.z = dv.z + o4.z, dv.w = dv.w + o4.w;
      }
      dsr[c] = dv;
      if (drr) bf4_st(drr, c, dv.x, dv.y, dv.z, dv.w);
      if constexpr (WG) {
        if (p.want_rs) { /* r's gradient as written: dr's bf16 values, or ds */
          const float4 q = drr ? bf4_round(dv) : dv;
          ar[k].x += q.x, ar[k].y += q.y, ar[k].z += q.z, ar[k].w += q.w;
        }
      }
    }
  }
  if constexpr (WG) { /* the warps' sums in warp order, w then b, through one (W, N) f32 slab */
    float4(*slab)[S];
    if constexpr (PF) {
      __syncthreads(); /* every warp past its last row: the buffers are free */
      slab = reinterpret_cast<float4(*)[S]>(stage);
    } else {
      __shared__ float4 slab_s[W][S];
      slab = slab_s;
    }
#pragma unroll
    for (int k = 0; k < NV; k++) slab[warp][k * 32 + lane] = aw[k];
    __syncthreads();
    rln_slab_sum<NV, W>(slab, p.N, part + (int64_t)blockIdx.x * p.N);
    __syncthreads();
#pragma unroll
    for (int k = 0; k < NV; k++) slab[warp][k * 32 + lane] = ab[k];
    __syncthreads();
    rln_slab_sum<NV, W>(slab, p.N, part + ((int64_t)chunks + blockIdx.x) * p.N);
    if (p.want_rs) {
      __syncthreads();
#pragma unroll
      for (int k = 0; k < NV; k++) slab[warp][k * 32 + lane] = ar[k];
      __syncthreads();
      rln_slab_sum<NV, W>(slab, p.N, part + (2 * (int64_t)chunks + blockIdx.x) * p.N);
    }
  }
}

/* rln_bwd_v4 for N's float4s a lane (1..LN_VMAX; 3 takes 4's kernel: ptxas gave the NV 3
** kernels 213 registers, or spills, against 4's 126); PF's shared memory asked for once a
** device and kernel (more than the default 48 KB from NV 5 on). */
template <int NV, bool WG, class C, bool PF> static size_t rln_bwd_v4_smem(int dev, bool has_gs) {
  if constexpr (!PF) {
    return 0;
  } else {
    static std::atomic<uint64_t> set{0};
    const size_t bytes = rln_stage_bytes<NV>(true);
    if (dev >= 0 && dev < 64 && !(set.load() >> dev & 1)) {
      cudaFuncSetAttribute(rln_bwd_v4<NV, WG, C, PF>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
      cudaFuncSetAttribute(rln_bwd_v4<NV, WG, C, PF>, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared); /* else the driver's pick held it to 2 blocks an SM */
      set.fetch_or(1ull << dev);
    }
    return rln_stage_bytes<NV>(has_gs);
  }
}
template <bool WG, class C, bool PF>
static void rln_bwd_v4_launch(cudaStream_t st, int dev, unsigned blocks, const float *s, const float *gs, float *ds,
                              const RlnArgs &p, bool wvec, int64_t chunk, int64_t chunks, double *part) {
  switch ((p.N / 4 + 31) / 32) {
#define RLN_NV(n)                                                                                                     \
  case n:                                                                                                             \
    rln_bwd_v4<n, WG, C, PF><<<blocks, rln_warps(WG) * 32, rln_bwd_v4_smem<n, WG, C, PF>(dev, p.has_gs), st>>>(       \
        s, gs, ds, p, wvec, chunk, chunks, part);                                                                     \
    break;
    RLN_NV(1) RLN_NV(2) case 3: RLN_NV(4) RLN_NV(5) RLN_NV(6) RLN_NV(7) RLN_NV(8)
#undef RLN_NV
  default: break;
  }
}

/* The row-group forward (the default where the four-wide forward would run;
** KILN_CUDA_RLN=warp keeps that one): a row's nv = N / 4 float4s go one a thread over a row
** group of G = 32 ceil(nv / 32) threads, RG groups a block (blockDim (G, RG)), and the row's
** sums are added across the group's warps in shared memory behind a named barrier of the
** group's own. A thread holds four columns of a row where the warp kernels' lanes hold 4 NV
** (GPT-2: 24), so more rows are in flight an SM, and each thread reads its next row into
** registers while this one is summed. Persistent: one wave of blocks (the occupancy
** calculator's count an SM), group g of block b taking every (blocks RG)-th row from
** b RG + g (or a chunk of rows a block with rgchunk). The per-element arithmetic is the warp
** kernels'; a row's sums go each thread's four in C, then threads and warps in double, in a
** fixed order (the same bits every run). */
#define RG_MAXW 8 /* warps a group: N <= 1024, as the four-wide kernels */
#define RG_MAXG 8 /* groups a block: named barriers 1..8 */
__device__ __forceinline__ void rg_bar(int grp, int G) {
  asm volatile("bar.sync %0, %1;" ::"r"(grp + 1), "r"(G) : "memory");
}
/* The group's sums of K per-thread values in double, warp by warp in order; red is one
** of two slots used in turn (a slot is written again only after the next barrier, which
** every thread reaches after reading it). */
template <int K>
__device__ __forceinline__ void rg_sum(double (&v)[K], double (*red)[RG_MAXW][2], int grp, int G) {
#pragma unroll
  for (int k = 0; k < K; k++) v[k] = warp_sum(v[k]);
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0) {
#pragma unroll
    for (int k = 0; k < K; k++) red[grp][warp][k] = v[k];
  }
  rg_bar(grp, G);
#pragma unroll
  for (int k = 0; k < K; k++) v[k] = red[grp][0][k];
  for (int w = 1; w < G / 32; w++) {
#pragma unroll
    for (int k = 0; k < K; k++) v[k] += red[grp][w][k];
  }
}
/* the row-group kernels' rows: group threadIdx.y of blockDim.y */
__device__ __forceinline__ RgRows rg_rows(int64_t chunk, int64_t R) {
  return rows_of(chunk, R, blockDim.y, threadIdx.y);
}
/* a block's shape for nv float4s a row: G threads a group, RG groups (up to RG_THREADS
** threads; at most 56 registers a thread, so 3 blocks fit an SM) */
#define RG_THREADS 384
static dim3 rg_block(int64_t N) {
  const int G = (int)((N / 4 + 31) / 32) * 32, fit = RG_THREADS / G;
  return dim3((unsigned)G, (unsigned)(fit < 1 ? 1 : fit > RG_MAXG ? RG_MAXG : fit));
}

template <class C>
__global__ void __launch_bounds__(RG_THREADS, 3) rln_fwd_rg(const float *x, float *s, RlnArgs p, bool wvec,
                                                             bool bvec, int64_t chunk) {
  const int G = blockDim.x, t = threadIdx.x, grp = threadIdx.y;
  const bool col = t < (int)(p.N / 4), rf32 = p.rdt == KILN_F32;
  __shared__ double red[2][RG_MAXG][RG_MAXW][2];
  float4 w4 = make_float4(1.f, 1.f, 1.f, 1.f), b4 = make_float4(0.f, 0.f, 0.f, 0.f);
  if (col && p.has_w) w4 = ln_ld4(p.w, wvec, (int64_t)t * 4);
  if (col && p.has_b) b4 = ln_ld4(p.b, bvec, (int64_t)t * 4);
  auto load = [&](int64_t row, float4 &xo, float4 &ro) {
    xo = ro = make_float4(0.f, 0.f, 0.f, 0.f);
    if (!col) return;
    xo = reinterpret_cast<const float4 *>(x + row * p.xs0)[t];
    const int64_t ro0 = rln_rrow(p, row) * p.rs0 + 4 * (int64_t)t;
    ro = rf32 ? kc_ld4((const float *)p.r + ro0) : kc_ld4((const __nv_bfloat16 *)p.r + ro0);
  };
  const RgRows q = rg_rows(chunk, p.R);
  float4 xv, rv, xn = make_float4(0.f, 0.f, 0.f, 0.f), rn = xn;
  if (q.first < q.end) load(q.first, xv, rv);
  int ph = 0;
#pragma unroll 1
  for (int64_t row = q.first; row < q.end; row += q.step) {
    if (row + q.step < q.end) load(row + q.step, xn, rn); /* the next row, read while this one is summed */
    const float4 v = make_float4(xv.x + rv.x, xv.y + rv.y, xv.z + rv.z, xv.w + rv.w);
    if (col) reinterpret_cast<float4 *>(s + row * p.ss0)[t] = v;
    double m[1] = {col ? (double)(((C)v.x + (C)v.y) + ((C)v.z + (C)v.w)) : 0.0};
    rg_sum<1>(m, red[ph], grp, G), ph ^= 1;
    const double mean = m[0] / (double)p.N;
    const C mc = (C)mean;
    const C a0 = v.x - mc, a1 = v.y - mc, a2 = v.z - mc, a3 = v.w - mc;
    double ss[1] = {col ? (double)((a0 * a0 + a1 * a1) + (a2 * a2 + a3 * a3)) : 0.0};
    rg_sum<1>(ss, red[ph], grp, G), ph ^= 1;
    const double rstd = 1.0 / sqrt(ss[0] / (double)p.N + p.eps);
    const C rc = (C)rstd;
    __nv_bfloat16 *yr = (__nv_bfloat16 *)p.y + row * p.ys0;
    if (col) {
      C y[4] = {a0 * rc, a1 * rc, a2 * rc, a3 * rc};
      if (p.has_w) y[0] *= (C)w4.x, y[1] *= (C)w4.y, y[2] *= (C)w4.z, y[3] *= (C)w4.w;
      if (p.has_b) y[0] += (C)b4.x, y[1] += (C)b4.y, y[2] += (C)b4.z, y[3] += (C)b4.w;
      bf4_st(yr, t, (float)y[0], (float)y[1], (float)y[2], (float)y[3]);
    }
    if (t == 0) {
      st_any<double>((void *)p.mean.p, p.mean.dt, row * p.mean.st, mean);
      st_any<double>((void *)p.rstd.p, p.rstd.dt, row * p.rstd.st, rstd);
      if (p.y_ones) *reinterpret_cast<uint4 *>(yr + p.N) = make_uint4(0x3F80u, 0u, 0u, 0u); /* bf16 1, then 0s */
    }
    xv = xn, rv = rn;
  }
}

/* blocks of rg_block(N) one wave holds on the device (at least one an SM) */
template <class K> static int64_t rg_wave(kiln__cuda_dev *d, K kernel, dim3 blk) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, (int)(blk.x * blk.y), 0) != cudaSuccess || n < 1)
    (void)cudaGetLastError(), n = 1;
  return (int64_t)(d->sm_count > 0 ? d->sm_count : 132) * n;
}
/* one wave of blocks over R rows: chunk rows a block, *blocks of them */
template <class K> static unsigned rg_grid(kiln__cuda_dev *d, K kernel, dim3 blk, int64_t R, int64_t *chunk) {
  const int64_t want = rg_wave(d, kernel, blk);
  *chunk = (R + want - 1) / want;
  return (unsigned)((R + *chunk - 1) / *chunk);
}

/* Whether the fast kernels above take a: f32 x/s, bf16 r/y (forward), bf16 g/dr (dr when
** wanted), f32 stats, N <= 32 * RLN_V. */
bool rln_fast(const kiln__kargs *a) {
  if (a->in[0].dtype != KILN_F32 || a->in[1].dtype != KILN_BF16 || a->in[0].shape[1] > 32 * RLN_V) return false;
  if (a->op == KILN__K_RESIDUAL_LAYER_NORM) return a->out[0].dtype == KILN_BF16;
  return !(a->i[1] & 1) || a->out[1].dtype == KILN_BF16;
}

bool unit_cols(const kiln__view &v) { return v.ndim == 2 && (v.strides[1] == 1 || v.shape[1] <= 1); }

static RlnArgs rln_args(const kiln__kargs *a);
static bool rln_env(const char *w);
static bool rln_rg(void);
static bool rln_bwd_chunked(const kiln__kargs *a, const RlnArgs &p);
static bool rln_v4_ok(const kiln__kargs *a, const RlnArgs &p);
bool rln_supports(const kiln__kargs *a) {
  kiln_dtype dt = a->in[0].dtype, st = dt == KILN_F64 ? KILN_F64 : KILN_F32;
  if (!kc_is_float(dt) || !kc_is_float(a->in[1].dtype) || !unit_cols(a->in[0]) || !unit_cols(a->in[1])) return false;
  const int64_t R = a->in[0].shape[0], N = a->in[0].shape[1], Rr = a->in[1].shape[0];
  if (a->in[1].shape[1] != N) return false;
  if (a->op == KILN__K_RESIDUAL_LAYER_NORM ? (Rr < 1 || R % Rr != 0) : Rr != R) return false; /* r may repeat */
  if (a->op == KILN__K_RESIDUAL_LAYER_NORM) {
    int nv = 2 + ((a->i[0] & 1) ? 1 : 0) + ((a->i[0] & 2) ? 1 : 0);
    if (a->n_in != nv || a->n_out != 3) return false;
    for (int i = 2; i < nv; i++)
      if (!kc_is_float(a->in[i].dtype) || a->in[i].ndim != 1 || a->in[i].shape[0] != N) return false;
    if (!(kc_is_float(a->out[0].dtype) && unit_cols(a->out[0]) && a->out[1].dtype == dt && unit_cols(a->out[1]) &&
          a->out[2].dtype == st && a->out[2].ndim == 2 && a->out[2].shape[0] == 2 && a->out[2].shape[1] == R))
      return false;
    /* y's ones column (flag 4): the four-wide kernels write it, bf16 rows N + 8 apart */
    return !(a->i[0] & 4) || (a->out[0].dtype == KILN_BF16 && N % 8 == 0 && a->out[0].strides[0] == N + 8 &&
                              ((uintptr_t)a->out[0].data & 15) == 0 && rln_v4_ok(a, rln_args(a)));
  }
  int nv = 3 + ((a->i[0] & 1) ? 1 : 0) + ((a->i[0] & 2) ? 1 : 0);
  const bool rs = (a->i[1] & 8) != 0;
  if (a->n_in != nv || a->n_out != (rs ? 5 : 4)) return false;
  const kiln__view &stats = a->in[2];
  if (stats.dtype != st || stats.ndim != 2 || stats.shape[0] != 2 || stats.shape[1] != R) return false;
  if ((a->i[0] & 1) && (!kc_is_float(a->in[3].dtype) || a->in[3].ndim != 1 || a->in[3].shape[0] != N)) return false;
  if (a->i[0] & 2) {
    const kiln__view &gs = a->in[nv - 1];
    if (gs.dtype != dt || !unit_cols(gs) || gs.shape[0] != R || gs.shape[1] != N) return false;
  }
  if (a->out[0].dtype != dt || !unit_cols(a->out[0])) return false;
  if ((a->i[1] & 1) && (!kc_is_float(a->out[1].dtype) || !unit_cols(a->out[1]))) return false;
  for (int k = 2; k < a->n_out; k++)
    if ((a->i[1] & (1 << (k - 1))) && (!kc_is_float(a->out[k].dtype) || a->out[k].ndim != 1 || a->out[k].shape[0] != N))
      return false;
  /* r's column sums: the chunked kernel's third partials only */
  return !rs || (!rln_env("nors") && rln_bwd_chunked(a, rln_args(a)));
}

/* Whether KILN_CUDA_RLN (a comma-separated list, for an A/B on the device) names w:
** "warp" (the four-wide forward a warp a row, not the row-group one), "rgchunk" (the
** row-group forward's blocks on chunks of neighbouring rows), "winter" (the staged warp
** kernels' blocks on interleaved rows), "split" (the v4 backward leaves the weight partials
** to wpart_v4's second pass), "f64" (the v4 kernels' per-element arithmetic in double),
** "fast" (no v4 kernels), "nopf" (the chunked backward loads each row when it starts on it,
** no staged next row), "nors" (no column sums of r's gradient: the linear that made r sums
** its bias gradient itself), "nostatpf" (the staged backward reads each row's mean and rstd
** at the row, not a row ahead); "f64" and "nopf" are the warp kernels' variants and take
** them. */
static bool rln_env(const char *w) { return kiln__knob_lists("KILN_CUDA_RLN", w); }
/* the row-group forward, where the four-wide one would run (a row-group backward ran no
** faster than rln_bwd_v4 and was removed: bench/RESULTS.md, 2026-12-06 18:59) */
static bool rln_rg(void) { return !rln_env("warp") && !rln_env("nopf") && !rln_env("f64"); }

/* Whether the v4 kernels take a (on top of rln_fast): N % 4 == 0 up to LN_VMAX * 128, the
** f32 rows 16-byte and the bf16 rows 8-byte aligned. KILN_CUDA_RLN=fast keeps the
** element-a-lane kernels (the v4 ones: GPT-2's step 49.5 -> 38.2 ms on the H100). */
static bool al8(const void *q) { return ((uintptr_t)q & 7) == 0; }
bool rln_v4_fits(const kiln__kargs *a, const RlnArgs &p) {
  if (p.N % 4 != 0 || p.N > LN_VMAX * 128) return false;
  if (rln_env("fast")) return false;
  if (a->op == KILN__K_RESIDUAL_LAYER_NORM)
    return al16(a->in[0].data) && p.xs0 % 4 == 0 && al16(a->out[1].data) && p.ss0 % 4 == 0 &&
           (p.rdt == KILN_F32 ? al16(p.r) : al8(p.r)) && p.rs0 % 4 == 0 && al8(p.y) && p.ys0 % 4 == 0;
  return al16(a->in[0].data) && p.ss0 % 4 == 0 && al8(p.g) && p.gs0 % 4 == 0 && al16(a->out[0].data) &&
         p.dss0 % 4 == 0 && (!p.has_gs || (al16(a->in[a->n_in - 1].data) && p.gss0 % 4 == 0)) &&
         (!p.want_dr || (al8(p.dr) && p.drs0 % 4 == 0));
}


/* rln_bwd_v4<., true>'s chunks: the blocks one wave holds (the occupancy calculator's count
** an SM, with the staged kernel's shared memory), so every warp's few rows are added in
** registers and the partials stay small. */
static int64_t rln_bwd_chunks(kiln__cuda_dev *d, int dev, const RlnArgs &p, bool pf) {
  int n = 0;
  cudaError_t e = cudaErrorInvalidValue;
  switch ((p.N / 4 + 31) / 32) {
#define RLN_OCC(k)                                                                                                    \
  case k:                                                                                                             \
    e = pf ? cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, rln_bwd_v4<k, true, float, true>, rln_warps(true) * 32, \
                                                           rln_bwd_v4_smem<k, true, float, true>(dev, p.has_gs))      \
           : cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, rln_bwd_v4<k, true, float, false>, rln_warps(true) * 32, 0); \
    break;
    RLN_OCC(1) RLN_OCC(2) case 3: RLN_OCC(4) RLN_OCC(5) RLN_OCC(6) RLN_OCC(7) RLN_OCC(8)
#undef RLN_OCC
  default: break;
  }
  if (e != cudaSuccess || n < 1) (void)cudaGetLastError(), n = 1;
  return (int64_t)(d->sm_count > 0 ? d->sm_count : 132) * n;
}

/* rln_fwd_v4<float, NV, true> in one wave of blocks (the occupancy calculator's count an
** SM), each a chunk of rows; its shared memory asked for once a device and kernel. NV 3
** takes 4's kernel (as rln_bwd_v4_launch). */
template <int NV>
static void rln_fwd_v4_pf_nv(kiln__cuda_dev *d, int dev, const float *x, float *s, const RlnArgs &p, bool wv, bool bv) {
  static std::atomic<uint64_t> set{0};
  const size_t bytes = rln_fwd_stage_bytes<NV>(p.rdt == KILN_F32);
  if (dev >= 0 && dev < 64 && !(set.load() >> dev & 1)) {
    cudaFuncSetAttribute(rln_fwd_v4<float, NV, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         (int)rln_fwd_stage_bytes<NV>(true));
    cudaFuncSetAttribute(rln_fwd_v4<float, NV, true>, cudaFuncAttributePreferredSharedMemoryCarveout,
                         cudaSharedmemCarveoutMaxShared);
    set.fetch_or(1ull << dev);
  }
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, rln_fwd_v4<float, NV, true>, KC_THREADS, bytes) != cudaSuccess ||
      n < 1)
    (void)cudaGetLastError(), n = 1;
  const int64_t want = (int64_t)(d->sm_count > 0 ? d->sm_count : 132) * n;
  const int64_t chunk = (p.R + want - 1) / want, blocks = (p.R + chunk - 1) / chunk;
  rln_fwd_v4<float, NV, true><<<(unsigned)blocks, KC_THREADS, bytes, d->stream>>>(x, s, p, wv, bv,
                                                                                 rln_env("winter") ? 0 : chunk);
}
static void rln_fwd_v4_pf_launch(kiln__cuda_dev *d, int dev, const float *x, float *s, const RlnArgs &p, bool wv,
                                 bool bv) {
  switch ((p.N / 4 + 31) / 32) {
  case 1: rln_fwd_v4_pf_nv<1>(d, dev, x, s, p, wv, bv); break;
  case 2: rln_fwd_v4_pf_nv<2>(d, dev, x, s, p, wv, bv); break;
  case 3:
  case 4: rln_fwd_v4_pf_nv<4>(d, dev, x, s, p, wv, bv); break;
  case 5: rln_fwd_v4_pf_nv<5>(d, dev, x, s, p, wv, bv); break;
  case 6: rln_fwd_v4_pf_nv<6>(d, dev, x, s, p, wv, bv); break;
  case 7: rln_fwd_v4_pf_nv<7>(d, dev, x, s, p, wv, bv); break;
  case 8: rln_fwd_v4_pf_nv<8>(d, dev, x, s, p, wv, bv); break;
  default: break;
  }
}

template <class T>
kiln_status rln_run(kiln__cuda_dev *d, const kiln__kargs *a, RlnArgs &p) {
  typedef typename wide_acc<T>::type A;
  unsigned blocks = (unsigned)((p.R + KC_THREADS / 32 - 1) / (KC_THREADS / 32));
  const bool fast = rln_fast(a);
  const bool v4 = rln_v4_ok(a, p);
  if (a->op == KILN__K_RESIDUAL_LAYER_NORM) {
    const float *xp = (const float *)a->in[0].data;
    float *sp = (float *)a->out[1].data;
    const bool wv = p.has_w && vec4_ok(p.w), bv = p.has_b && vec4_ok(p.b);
    if (v4 && rln_env("f64")) {
      rln_fwd_v4<double, LN_VMAX, false><<<blocks, KC_THREADS, 0, d->stream>>>(xp, sp, p, wv, bv, KC_THREADS / 32);
    } else if (v4 && rln_rg()) {
      const dim3 blk = rg_block(p.N);
      int64_t chunk = 0;
      const unsigned nb = rg_grid(d, rln_fwd_rg<float>, blk, p.R, &chunk);
      rln_fwd_rg<float><<<nb, blk, 0, d->stream>>>(xp, sp, p, wv, bv, rln_env("rgchunk") ? chunk : 0);
    } else if (v4 && !rln_env("nopf")) {
      rln_fwd_v4_pf_launch(d, a->device, xp, sp, p, wv, bv);
    } else if (v4) {
      rln_fwd_v4<float, LN_VMAX, false><<<blocks, KC_THREADS, 0, d->stream>>>(xp, sp, p, wv, bv, KC_THREADS / 32);
    } else if (fast) {
      rln_fwd_fast<<<blocks, KC_THREADS, 0, d->stream>>>((const float *)a->in[0].data, (float *)a->out[1].data, p);
    } else {
      rln_fwd<T, A><<<blocks, KC_THREADS, 0, d->stream>>>((const T *)a->in[0].data, (T *)a->out[1].data, p);
    }
    return kiln__cuda_launched("residual_layer_norm");
  }
  const T *s = (const T *)a->in[0].data;
  const T *gs = p.has_gs ? (const T *)a->in[a->n_in - 1].data : NULL;
  const bool want_w = (a->i[1] & 2) != 0, want_b = (a->i[1] & 4) != 0;
  Vec dw = vec_of(&a->out[2]), db = vec_of(&a->out[3]);
  const char *w1 = "residual_layer_norm_backward (weight partials)", *w2 = "residual_layer_norm_backward (weight sums)";
  const bool f64 = rln_env("f64"), wv = p.has_w && vec4_ok(p.w);
  float *dsp = (float *)a->out[0].data;
  if ((want_w || want_b || p.want_rs) && rln_bwd_chunked(a, p)) { /* f32 s, bf16 g: the partials in the rows' pass */
    const bool pf = !f64 && !rln_env("nopf");
    Wsum o = wsum2(dw, db, want_w, want_b);
    if (p.want_rs) o.out[2] = vec_of(&a->out[4]), o.want[2] = true, o.parts = 3;
    return norm_wgrad<double>(d, a->device, p.R, p.N, KC_THREADS, rln_bwd_chunks(d, a->device, p, pf), o,
                              "residual_layer_norm_backward", w2,
                              [&](dim3 grid, double *part, int64_t chunk, int64_t chunks) {
                                const float *sf = (const float *)s, *gf = (const float *)gs;
                                if (f64)
                                  rln_bwd_v4_launch<true, double, false>(d->stream, a->device, grid.y, sf, gf, dsp, p,
                                                                         wv, chunk, chunks, part);
                                else if (pf)
                                  rln_bwd_v4_launch<true, float, true>(d->stream, a->device, grid.y, sf, gf, dsp, p,
                                                                       wv, rln_env("winter") ? 0 : chunk, chunks, part);
                                else
                                  rln_bwd_v4_launch<true, float, false>(d->stream, a->device, grid.y, sf, gf, dsp, p,
                                                                        wv, chunk, chunks, part);
                              });
  }
  if (v4 && f64) {
    rln_bwd_v4_launch<false, double, false>(d->stream, a->device, blocks, (const float *)s, (const float *)gs, dsp, p,
                                            wv, rln_warps(false), blocks, NULL);
  } else if (v4) {
    rln_bwd_v4_launch<false, float, false>(d->stream, a->device, blocks, (const float *)s, (const float *)gs, dsp, p,
                                           wv, rln_warps(false), blocks, NULL);
  } else if (fast) {
    rln_bwd_ds_fast<<<blocks, KC_THREADS, 0, d->stream>>>((const float *)s, (const float *)gs, (float *)a->out[0].data, p);
  } else {
    rln_bwd_ds<T, A><<<blocks, KC_THREADS, 0, d->stream>>>(s, gs, (T *)a->out[0].data, p);
  }
  KC_TRY(kiln__cuda_launched("residual_layer_norm_backward"));
  if (!want_w && !want_b) return KILN_OK;
  if (v4) /* f32 s, bf16 g */
    return norm_wgrad<double>(d, a->device, p.R, p.N, 128, 0, wsum2(dw, db, want_w, want_b), w1, w2,
                              [&](dim3 grid, double *part, int64_t chunk, int64_t chunks) {
                                if (stats_f32(p.mean, p.rstd, false))
                                  wpart_v4<__nv_bfloat16, float><<<grid, dim3(32, 8), 0, d->stream>>>(
                                      (const float *)s, p.ss0, (const __nv_bfloat16 *)p.g, p.gs0, p.mean, p.rstd,
                                      false, p.R, p.N, part, chunk, chunks);
                                else
                                  wpart_v4<__nv_bfloat16, void><<<grid, dim3(32, 8), 0, d->stream>>>(
                                      (const float *)s, p.ss0, (const __nv_bfloat16 *)p.g, p.gs0, p.mean, p.rstd,
                                      false, p.R, p.N, part, chunk, chunks);
                              });
  return norm_wgrad<A>(d, a->device, p.R, p.N, 32, 0, wsum2(dw, db, want_w, want_b), w1, w2,
                       [&](dim3 grid, A *part, int64_t chunk, int64_t chunks) {
                         rln_bwd_wpart<T, A><<<grid, dim3(32, 8), 0, d->stream>>>(s, part, chunk, chunks, p);
                       });
}

/* The kernels' arguments from a (either direction). */
static RlnArgs rln_args(const kiln__kargs *a) {
  const bool bw = a->op == KILN__K_RESIDUAL_LAYER_NORM_BACKWARD;
  const kiln__view &x = a->in[0];
  RlnArgs p;
  memset(&p, 0, sizeof p);
  p.R = x.shape[0], p.N = x.shape[1];
  p.rT = p.R;
  p.eps = a->s[0];
  p.has_w = (a->i[0] & 1) != 0;
  Vec none = {NULL, 0, 0};
  p.w = p.b = none;
  const kiln__view &stats = bw ? a->in[2] : a->out[2];
  p.mean = {stats.data, (int)stats.dtype, stats.strides[1]};
  p.rstd = {(const char *)stats.data + stats.strides[0] * (int64_t)kc_size(stats.dtype), (int)stats.dtype,
            stats.strides[1]};
  if (!bw) {
    p.xs0 = x.strides[0];
    p.r = a->in[1].data, p.rdt = (int)a->in[1].dtype, p.rs0 = a->in[1].strides[0];
    p.rT = a->in[1].shape[0];
    p.y_ones = (a->i[0] & 4) != 0;
    p.has_b = (a->i[0] & 2) != 0;
    if (p.has_w) p.w = vec_of(&a->in[2]);
    if (p.has_b) p.b = vec_of(&a->in[p.has_w ? 3 : 2]);
    p.y = a->out[0].data, p.ydt = (int)a->out[0].dtype, p.ys0 = a->out[0].strides[0];
    p.ss0 = a->out[1].strides[0];
  } else {
    p.ss0 = x.strides[0];
    p.g = a->in[1].data, p.gdt = (int)a->in[1].dtype, p.gs0 = a->in[1].strides[0];
    if (p.has_w) p.w = vec_of(&a->in[3]);
    p.has_gs = (a->i[0] & 2) != 0;
    if (p.has_gs) p.gss0 = a->in[a->n_in - 1].strides[0];
    p.dss0 = a->out[0].strides[0];
    p.want_dr = (a->i[1] & 1) != 0;
    if (p.want_dr) p.dr = a->out[1].data, p.drdt = (int)a->out[1].dtype, p.drs0 = a->out[1].strides[0];
    p.want_rs = (a->i[1] & 8) != 0;
  }
  p.stats_ahead = !rln_env("nostatpf"); /* KILN_CUDA_RLN=nostatpf: each row's stats read at the row (the A/B) */
  return p;
}

/* Whether the four-wide kernels take a: rln_fast's dtypes, or in the forward an f32 r as
** well; alignment (rln_v4_fits). */
static bool rln_v4_ok(const kiln__kargs *a, const RlnArgs &p) {
  const bool fwd_f32r = a->op == KILN__K_RESIDUAL_LAYER_NORM && a->in[0].dtype == KILN_F32 &&
                        a->in[1].dtype == KILN_F32 && a->out[0].dtype == KILN_BF16 && p.N <= LN_VMAX * 128;
  return (rln_fast(a) || fwd_f32r) && rln_v4_fits(a, p);
}

/* Whether the backward takes the chunked four-wide kernel (rln_bwd_v4<., true>), the one
** that sums the parameter gradients (and r's gradient's columns) in the rows' pass. */
static bool rln_bwd_chunked(const kiln__kargs *a, const RlnArgs &p) {
  return rln_fast(a) && rln_v4_fits(a, p) && !rln_env("split");
}

kiln_status residual_layer_norm(kiln__cuda_dev *d, const kiln__kargs *a) {
  const bool bw = a->op == KILN__K_RESIDUAL_LAYER_NORM_BACKWARD;
  const kiln__view &x = a->in[0];
  RlnArgs p = rln_args(a);
  if (p.R == 0) return KILN_OK;
  if (p.N == 0) { /* no columns: empty rows, zero parameter gradients */
    for (int k = 2; bw && k < a->n_out; k++)
      if (a->i[1] & (1 << (k - 1))) KC_TRY(kiln__cuda_fill_view(a->device, &a->out[k], 0.0));
    return KILN_OK;
  }
  if (p.R > (int64_t)INT32_MAX * 8)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_%s: %lld rows is too many", kiln__kop_name(a->op), (long long)p.R);
  KC_SWITCH_FLOAT(x.dtype, T, return dtype_error(a, x.dtype), return rln_run<T>(d, a, p))
  return KILN_OK;
}

/* ================================================================ lines along one dim */
/* The start offsets of line L (every index but dim d) in up to 3 views of one shape. */
struct Lines {
  int nd, d;
  int64_t shape[KILN_MAX_DIMS];
  int64_t st[3][KILN_MAX_DIMS];
  int64_t n_lines, len;
};
static Lines lines_of(const kiln__view *const *v, int nv, int d) {
  Lines g;
  g.nd = v[0]->ndim, g.d = d;
  g.n_lines = 1;
  for (int k = 0; k < g.nd; k++) {
    g.shape[k] = v[0]->shape[k];
    for (int i = 0; i < 3; i++) g.st[i][k] = i < nv ? v[i]->strides[k] : 0;
    if (k != d) g.n_lines *= g.shape[k];
  }
  g.len = g.nd ? v[0]->shape[d] : 1;
  return g;
}
__device__ __forceinline__ void line_base(const Lines &g, int64_t L, int64_t *b) {
  b[0] = b[1] = b[2] = 0;
  for (int k = g.nd - 1; k >= 0; k--) {
    if (k == g.d) continue;
    int64_t i = L % g.shape[k];
    L /= g.shape[k];
    b[0] += i * g.st[0][k], b[1] += i * g.st[1][k], b[2] += i * g.st[2][k];
  }
}

/* ---- cumsum: a thread per line, in index order (f64 for floats, i64 for integers) ---- */
template <class TI, class TO, class S>
__global__ void cumsum_k(const TI *x, TO *y, Lines g, bool rev) {
  int64_t L = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (L >= g.n_lines) return;
  int64_t b[3];
  line_base(g, L, b);
  const int64_t sx = g.st[0][g.d], sy = g.st[1][g.d];
  S s = 0;
  for (int64_t t = 0; t < g.len; t++) {
    int64_t j = rev ? g.len - 1 - t : t;
    s += (S)kc_ld<TI>(x[b[0] + j * sx]);
    y[b[1] + j * sy] = kc_st<TO>(s);
  }
}

kiln_status cumsum(kiln__cuda_dev *d, const kiln__kargs *a) {
  int dim = (int)a->i[0];
  const kiln__view *x = &a->in[0], *y = &a->out[0];
  if (dim < 0 || dim >= x->ndim)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_cumsum: dim %d invalid for %d dims", dim, x->ndim);
  const kiln__view *vs[2] = {x, y};
  Lines g = lines_of(vs, 2, dim);
  if (g.n_lines == 0 || g.len == 0) return KILN_OK;
  unsigned blocks = (unsigned)((g.n_lines + 127) / 128);
  bool rev = a->i[1] == 1;
  if (kc_is_float(x->dtype)) {
    KC_SWITCH_FLOAT(x->dtype, T, return dtype_error(a, x->dtype),
                    cumsum_k<T, T, double><<<blocks, 128, 0, d->stream>>>((const T *)x->data, (T *)y->data, g, rev))
  } else {
    KC_SWITCH_ALL(x->dtype, T, return dtype_error(a, x->dtype),
                  cumsum_k<T, int64_t, int64_t>
                  <<<blocks, 128, 0, d->stream>>>((const T *)x->data, (int64_t *)y->data, g, rev))
  }
  return kiln__cuda_launched("cumsum");
}

/* ---- tril / triu: elementwise over out's C order, the element copied as bits ---- */
template <class U>
__global__ void tril_k(const U *x, U *y, kc_geom<2, int64_t> g, int64_t n, int64_t diag, bool upper,
                       int64_t ncol, int64_t nrow) {
  for (int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    int64_t off[2];
    kc_offsets<2, int64_t>(g, e, off);
    int64_t j = e % ncol, i = (e / ncol) % nrow;
    bool keep = upper ? j - i >= diag : j - i <= diag;
    y[off[1]] = keep ? x[off[0]] : (U)0; /* all-zero bits: 0 in every dtype */
  }
}

kiln_status tril(kiln__cuda_dev *d, const kiln__kargs *a) {
  const kiln__view *x = &a->in[0], *y = &a->out[0];
  if (x->ndim < 2 || x->dtype != y->dtype)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_tril: the kernel wants 2 or more dims and one dtype");
  int64_t n = kc_numel(x);
  if (n == 0) return KILN_OK;
  /* geometry over the full shape (not coalesced: the last two indices are needed) */
  kc_geom<2, int64_t> g;
  g.ndim = x->ndim;
  for (int k = 0; k < KILN_MAX_DIMS; k++) {
    g.shape[k] = k < x->ndim ? x->shape[k] : 1;
    g.st[0][k] = k < x->ndim ? x->strides[k] : 0;
    g.st[1][k] = k < x->ndim ? y->strides[k] : 0;
  }
  int64_t ncol = x->shape[x->ndim - 1], nrow = x->shape[x->ndim - 2];
  int blocks = kc_blocks(n, KC_THREADS, d->sm_count);
  bool upper = a->i[1] == 1;
  switch (kc_size(x->dtype)) {
  case 1: tril_k<uint8_t><<<blocks, KC_THREADS, 0, d->stream>>>((const uint8_t *)x->data, (uint8_t *)y->data, g, n, a->i[0], upper, ncol, nrow); break;
  case 2: tril_k<uint16_t><<<blocks, KC_THREADS, 0, d->stream>>>((const uint16_t *)x->data, (uint16_t *)y->data, g, n, a->i[0], upper, ncol, nrow); break;
  case 4: tril_k<uint32_t><<<blocks, KC_THREADS, 0, d->stream>>>((const uint32_t *)x->data, (uint32_t *)y->data, g, n, a->i[0], upper, ncol, nrow); break;
  case 8: tril_k<uint64_t><<<blocks, KC_THREADS, 0, d->stream>>>((const uint64_t *)x->data, (uint64_t *)y->data, g, n, a->i[0], upper, ncol, nrow); break;
  default: return dtype_error(a, x->dtype);
  }
  return kiln__cuda_launched("tril");
}

/* ---- topk: a block per line, k rounds of a block-wide selection ----
** The order is total (NaN largest, then value, then the lower index first), so round t
** needs no record of what was taken: it picks the best element strictly after round
** t-1's pick. k rounds of len/256 loads each: right for the small k of sampling (top-k
** over a vocabulary); TOPK_MAX_K bounds it, larger k fall back to the CPU's sort. */
enum { TOPK_MAX_K = 1024, TOPK_THREADS = 256 };

/* Whether (va, ia) comes before (vb, ib) in the order (largest: descending). */
__device__ __forceinline__ bool before(double va, int64_t ia, double vb, int64_t ib, bool largest) {
  bool na = va != va, nb = vb != vb;
  if (na != nb) return largest ? na : nb;
  if (!na && va != vb) return largest ? va > vb : va < vb;
  return ia < ib;
}

template <class T>
__global__ void __launch_bounds__(TOPK_THREADS) topk_k(const T *x, T *vals, int64_t *idx, Lines g, int64_t k,
                                                      bool largest) {
  __shared__ double sv[TOPK_THREADS];
  __shared__ int64_t si[TOPK_THREADS];
  int64_t L = blockIdx.x;
  int64_t b[3];
  line_base(g, L, b);
  const int64_t sx = g.st[0][g.d], so = g.st[1][g.d], sk = g.st[2][g.d];
  double pv = 0;
  int64_t pi = -1; /* the previous pick; -1: none yet */
  for (int64_t t = 0; t < k; t++) {
    double bv = 0;
    int64_t bi = -1;
    for (int64_t j = threadIdx.x; j < g.len; j += TOPK_THREADS) {
      double v = (double)kc_ld<T>(x[b[0] + j * sx]);
      if (pi >= 0 && !before(pv, pi, v, j, largest)) continue; /* taken already */
      if (bi < 0 || before(v, j, bv, bi, largest)) bv = v, bi = j;
    }
    sv[threadIdx.x] = bv, si[threadIdx.x] = bi;
    __syncthreads();
    for (int s = TOPK_THREADS / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s) {
        int64_t oi = si[threadIdx.x + s];
        double ov = sv[threadIdx.x + s];
        if (oi >= 0 && (si[threadIdx.x] < 0 || before(ov, oi, sv[threadIdx.x], si[threadIdx.x], largest)))
          sv[threadIdx.x] = ov, si[threadIdx.x] = oi;
      }
      __syncthreads();
    }
    pv = sv[0], pi = si[0];
    __syncthreads(); /* everyone has read the winner before the next round writes */
    if (threadIdx.x == 0) {
      vals[b[1] + t * so] = x[b[0] + pi * sx];
      idx[b[2] + t * sk] = pi;
    }
  }
}

kiln_status topk(kiln__cuda_dev *d, const kiln__kargs *a) {
  int dim = (int)a->i[0];
  const kiln__view *x = &a->in[0];
  if (dim < 0 || dim >= x->ndim || a->i[1] < 0 || a->i[1] > x->shape[dim] || a->out[0].shape[dim] != a->i[1] ||
      a->out[0].dtype != x->dtype)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_topk: dim %d and k %lld do not fit the views", dim,
                          (long long)a->i[1]);
  const kiln__view *vs[3] = {x, &a->out[0], &a->out[1]};
  Lines g = lines_of(vs, 3, dim);
  if (g.n_lines == 0 || a->i[1] == 0) return KILN_OK;
  if (g.n_lines > INT32_MAX) return kiln_set_error(KILN_ERR_SHAPE, "kiln_topk: too many rows");
  bool largest = (a->i[2] & 1) != 0;
  KC_SWITCH_ALL(x->dtype, T, return dtype_error(a, x->dtype),
                topk_k<T><<<(unsigned)g.n_lines, TOPK_THREADS, 0, d->stream>>>(
                    (const T *)x->data, (T *)a->out[0].data, (int64_t *)a->out[1].data, g, a->i[1], largest))
  return kiln__cuda_launched("topk");
}

/* ---- multinomial ---- */
/* Per row: the first bad class (value not finite or negative) and the count of nonzero
** weights, for the checks the CPU makes before drawing. */
struct MnCheck {
  int64_t bad;  /* first bad class, or -1 */
  double value; /* its value */
  int64_t nz;
};

template <class T>
__global__ void mn_check(const T *p, int64_t ps0, int64_t ps1, int64_t N, int64_t C, MnCheck *out) {
  int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= N) return;
  MnCheck c = {-1, 0, 0};
  for (int64_t j = 0; j < C; j++) {
    double v = (double)kc_ld<T>(p[r * ps0 + j * ps1]);
    if (!(v >= 0) || isinf(v)) {
      c.bad = j, c.value = v;
      break;
    }
    c.nz += v > 0;
  }
  out[r] = c;
}

/* Sample s of row r, the CPU's mapping exactly (cpu_scan.c): one thread per draw with
** replacement, one per row without (its draws depend on each other). */
template <class T>
__global__ void mn_draw(const T *p, int64_t ps0, int64_t ps1, int64_t *o, int64_t os0, int64_t os1, int64_t N,
                        int64_t C, int64_t S, bool repl, uint64_t seed, uint64_t offset, int *flag) {
  int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (repl ? t >= N * S : t >= N) return;
  int64_t r = repl ? t / S : t;
  int64_t s0 = repl ? t % S : 0, s1 = repl ? s0 + 1 : S;
  const T *pr = p + r * ps0;
  for (int64_t s = s0; s < s1; s++) {
    double tot = 0;
    int64_t last = -1;
    for (int64_t j = 0; j < C; j++) {
      double w = (double)kc_ld<T>(pr[j * ps1]);
      if (!repl)
        for (int64_t q = 0; q < s; q++)
          if (o[r * os0 + q * os1] == j) w = 0;
      tot += w;
      if (w > 0) last = j;
    }
    if (!(tot > 0) || last < 0) { /* only reachable in a captured step, where nothing was checked */
      kc_flag(flag, KILN__K_MULTINOMIAL);
      o[r * os0 + s * os1] = 0;
      continue;
    }
    uint64_t k = (uint64_t)(r * S + s);
    kc_u32x4 wd = kc_philox(seed, offset + k / 2);
    double u = kc_u01_f64(wd.x[2 * (k % 2)], wd.x[2 * (k % 2) + 1]) * tot;
    double cdf = 0;
    int64_t pick = last;
    for (int64_t j = 0; j < C; j++) {
      double w = (double)kc_ld<T>(pr[j * ps1]);
      if (!repl)
        for (int64_t q = 0; q < s; q++)
          if (o[r * os0 + q * os1] == j) w = 0;
      cdf += w;
      if (cdf > u) {
        pick = j;
        break;
      }
    }
    o[r * os0 + s * os1] = pick;
  }
}

template <class T> kiln_status mn_run(kiln__cuda_dev *d, const kiln__kargs *a) {
  const kiln__view *p = &a->in[0], *o = &a->out[0];
  int64_t N = p->shape[0], C = p->shape[1], S = o->shape[1];
  bool repl = a->i[0] == 1;
  const T *pp = (const T *)p->data;
  /* The checks read the data, as the CPU's do: outside a capture the stream is synchronized
  ** to give the CPU's errors; inside one nothing may synchronize, and a bad row sets the
  ** device flag instead (reported at the next synchronize). */
  if (!kiln__cuda_capturing(a->device) && N > 0) {
    size_t bytes = (size_t)N * sizeof(MnCheck);
    MnCheck *dc = (MnCheck *)kiln__cuda_alloc(a->device, bytes);
    if (!dc) return kiln_last_error();
    mn_check<T><<<(unsigned)((N + 127) / 128), 128, 0, d->stream>>>(pp, p->strides[0], p->strides[1], N, C, dc);
    kiln_status st = kiln__cuda_launched("multinomial (checks)");
    std::vector<MnCheck> hc;
    try {
      hc.resize((size_t)N);
    } catch (...) {
      st = kiln_set_error(KILN_ERR_OOM, "kiln_multinomial: out of host memory for %lld rows", (long long)N);
    }
    if (st == KILN_OK)
      st = kiln__cuda_err(cudaMemcpyAsync(hc.data(), dc, bytes, cudaMemcpyDeviceToHost, d->stream),
                          "multinomial (checks)");
    if (st == KILN_OK) st = kiln__cuda_err(cudaStreamSynchronize(d->stream), "multinomial (synchronize)");
    kiln__cuda_free(a->device, dc, bytes);
    if (st != KILN_OK) return st;
    for (int64_t r = 0; r < N; r++) {
      const MnCheck &c = hc[(size_t)r];
      if (c.bad >= 0)
        return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                              "kiln_multinomial: probabilities must be finite and non-negative; row %lld "
                              "class %lld is %g",
                              (long long)r, (long long)c.bad, c.value);
      if (c.nz == 0)
        return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_multinomial: row %lld of the probabilities sums to 0",
                              (long long)r);
      if (!repl && c.nz < S)
        return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                              "kiln_multinomial: %lld samples without replacement, but row %lld has only %lld "
                              "classes of nonzero probability",
                              (long long)S, (long long)r, (long long)c.nz);
    }
  }
  if (N == 0 || S == 0) return KILN_OK;
  int64_t threads = repl ? N * S : N;
  mn_draw<T><<<(unsigned)((threads + 127) / 128), 128, 0, d->stream>>>(
      pp, p->strides[0], p->strides[1], (int64_t *)o->data, o->strides[0], o->strides[1], N, C, S, repl, a->seed,
      a->offset, d->err_flag);
  return kiln__cuda_launched("multinomial");
}

kiln_status multinomial(kiln__cuda_dev *d, const kiln__kargs *a) {
  const kiln__view *p = &a->in[0], *o = &a->out[0];
  if (p->ndim != 2 || o->ndim != 2 || o->shape[0] != p->shape[0])
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_multinomial: the kernel wants probabilities (N, C) and out (N, S)");
  KC_SWITCH_FLOAT(p->dtype, T, return dtype_error(a, p->dtype), return mn_run<T>(d, a))
  return KILN_OK;
}

} // namespace

extern "C" bool kiln__cuda_transformer_supports(const kiln__kargs *a) {
  switch (a->op) {
  case KILN__K_LAYER_NORM:
  case KILN__K_LAYER_NORM_BACKWARD: return ln_supports(a);
  case KILN__K_ATTENTION:
  case KILN__K_ATTENTION_BACKWARD: return kiln__cuda_attention_supports(a);
  case KILN__K_LINEAR_GELU: return kiln__cuda_linear_gelu_supports(a);
  case KILN__K_MATMUL_DGELU: return kiln__cuda_matmul_dgelu_supports(a);
  case KILN__K_RESIDUAL_LAYER_NORM:
  case KILN__K_RESIDUAL_LAYER_NORM_BACKWARD: return rln_supports(a);
  case KILN__K_CUMSUM: {
    kiln_dtype di = a->in[0].dtype, dout = a->out[0].dtype;
    if (kc_is_float(di)) return dout == di;
    return kc_size(di) > 0 && dout == KILN_I64;
  }
  case KILN__K_TRIL: return kc_size(a->in[0].dtype) > 0 && a->out[0].dtype == a->in[0].dtype;
  case KILN__K_TOPK:
    return kc_size(a->in[0].dtype) > 0 && a->i[1] <= TOPK_MAX_K && a->n_out == 2 && a->out[1].dtype == KILN_I64;
  case KILN__K_MULTINOMIAL:
    return kc_is_float(a->in[0].dtype) && a->out[0].dtype == KILN_I64 && a->in[0].ndim == 2;
  default: return false;
  }
}

extern "C" kiln_status kiln__cuda_transformer(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  if (!kiln__cuda_transformer_supports(a))
    return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln_%s: these dtypes or sizes have no cuda kernel",
                          kiln__kop_name(a->op));
  switch (a->op) {
  case KILN__K_LAYER_NORM:
  case KILN__K_LAYER_NORM_BACKWARD: return layer_norm(d, a);
  case KILN__K_ATTENTION:
  case KILN__K_ATTENTION_BACKWARD: return kiln__cuda_attention(a);
  case KILN__K_LINEAR_GELU: return kiln__cuda_linear_gelu(a);
  case KILN__K_MATMUL_DGELU: return kiln__cuda_matmul_dgelu(a);
  case KILN__K_RESIDUAL_LAYER_NORM:
  case KILN__K_RESIDUAL_LAYER_NORM_BACKWARD: return residual_layer_norm(d, a);
  case KILN__K_CUMSUM: return cumsum(d, a);
  case KILN__K_TRIL: return tril(d, a);
  case KILN__K_TOPK: return topk(d, a);
  case KILN__K_MULTINOMIAL: return multinomial(d, a);
  default: return KILN_ERR_UNSUPPORTED;
  }
}
