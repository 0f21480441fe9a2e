/*
** rln_ceiling: what the device moves for the residual layer norm's streams at GPT-2's
** (16384, 768), without the norm's row sums: the forward's 2 reads and 2 writes (x f32, r
** bf16 in; s = x + r f32, y = bf16(s) out) and the backward's 3 reads and 2 writes (s, gs f32
** and g bf16 in; ds = s + gs + g f32, dr = bf16(ds) out), against a float4 read and copy of
** the same bytes. If these element-wise loops run where kiln's norm kernels do (~2.1-2.3
** TB/s on the H100, bench/RESULTS.md), the stream mix, not the kernels, sets the ceiling.
** Grid-stride over float4s, blocks = SMs x bps; best of 20 launches. CUDA runtime alone.
** Build: nvcc -std=c++17 -O3 -arch=sm_90 scripts/rln_ceiling.cu -o rln_ceiling
*/
#include <cuda_bf16.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                                                         \
  do {                                                                                                                \
    cudaError_t e_ = (x);                                                                                             \
    if (e_ != cudaSuccess) {                                                                                          \
      printf("%s: %s\n", #x, cudaGetErrorString(e_));                                                                \
      exit(1);                                                                                                        \
    }                                                                                                                 \
  } while (0)

__device__ __forceinline__ float4 ld_bf4(const __nv_bfloat16 *p) {
  const uint2 u = *reinterpret_cast<const uint2 *>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
__device__ __forceinline__ void st_bf4(__nv_bfloat16 *p, float4 v) {
  __nv_bfloat162 a = __floats2bfloat162_rn(v.x, v.y), b = __floats2bfloat162_rn(v.z, v.w);
  uint2 u;
  u.x = *reinterpret_cast<uint32_t *>(&a), u.y = *reinterpret_cast<uint32_t *>(&b);
  *reinterpret_cast<uint2 *>(p) = u;
}

__global__ void rd(const float4 *a, int64_t n, float *sink) {
  float t = 0;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float4 v = a[i];
    t += v.x + v.y + v.z + v.w;
  }
  if (t == 1234.5f) *sink = t; /* keeps the loads */
}
__global__ void cp(const float4 *a, float4 *b, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    b[i] = a[i];
}
/* the forward's streams: n float4s of x, r; s and y out */
__global__ void fwd(const float4 *x, const __nv_bfloat16 *r, float4 *s, __nv_bfloat16 *y, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float4 a = x[i], b = ld_bf4(r + 4 * i);
    const float4 v = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
    s[i] = v;
    st_bf4(y + 4 * i, v);
  }
}
/* the backward's streams: s, gs, g in; ds and dr out */
__global__ void bwd(const float4 *s, const float4 *gs, const __nv_bfloat16 *g, float4 *ds, __nv_bfloat16 *dr,
                    int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    const float4 a = s[i], b = gs[i], c = ld_bf4(g + 4 * i);
    const float4 v = make_float4(a.x + b.x + c.x, a.y + b.y + c.y, a.z + b.z + c.z, a.w + b.w + c.w);
    ds[i] = v;
    st_bf4(dr + 4 * i, v);
  }
}


/* the backward's streams a row at a time, a warp a row (rows interleaved over the grid), the
** row in registers (6 float4s a lane: N = 768): RED adds the norm's two row sums (double, over
** the warp) between the loads and the stores, as the kernels do; W warps a block */
template <bool RED>
__global__ void bwd_rows(const float4 *s, const float4 *gs, const __nv_bfloat16 *g, float4 *ds, __nv_bfloat16 *dr,
                         int64_t R) {
  constexpr int NV = 6, n4 = NV * 32;
  const int lane = threadIdx.x % 32, W = blockDim.x / 32;
  for (int64_t row = (int64_t)blockIdx.x * W + threadIdx.x / 32; row < R; row += (int64_t)gridDim.x * W) {
    float4 a[NV], b[NV], c[NV];
#pragma unroll
    for (int k = 0; k < NV; k++) {
      const int64_t i = row * n4 + k * 32 + lane;
      a[k] = s[i], b[k] = gs[i], c[k] = ld_bf4(g + 4 * i);
    }
    float m = 0.f, q = 0.f;
    if (RED) {
      double lm = 0, lq = 0;
#pragma unroll
      for (int k = 0; k < NV; k++) {
        lm += (double)(c[k].x + c[k].y + c[k].z + c[k].w);
        lq += (double)(c[k].x * a[k].x + c[k].y * a[k].y + c[k].z * a[k].z + c[k].w * a[k].w);
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
        lm += __shfl_xor_sync(0xffffffffu, lm, o), lq += __shfl_xor_sync(0xffffffffu, lq, o);
      m = (float)(lm / 768.0), q = (float)(lq / 768.0);
    }
#pragma unroll
    for (int k = 0; k < NV; k++) {
      const int64_t i = row * n4 + k * 32 + lane;
      const float4 v = make_float4(a[k].x + b[k].x + c[k].x - m - q * a[k].x,
                                   a[k].y + b[k].y + c[k].y - m - q * a[k].y,
                                   a[k].z + b[k].z + c[k].z - m - q * a[k].z,
                                   a[k].w + b[k].w + c[k].w - m - q * a[k].w);
      ds[i] = v;
      st_bf4(dr + 4 * i, v);
    }
  }
}

/* bwd_rows<true> plus what the real backward adds, to find what holds it above this
** ceiling: W, the norm's weight read at each row (L1); ST, the row's mean and rstd (f32
** here) read at the row; PART, the parameter gradients' three per-lane f32 accumulators
** (72 registers at N 768) and the block's warps added in double into part at the end */
template <bool W, bool ST, bool PART>
__global__ void bwd_rows_x(const float4 *s, const float4 *gs, const __nv_bfloat16 *g, float4 *ds, __nv_bfloat16 *dr,
                           int64_t R, const float4 *w, const float *mean, const float *rstd, double *part) {
  constexpr int NV = 6, n4 = NV * 32;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, NW = blockDim.x / 32;
  float4 aw[PART ? NV : 1], ab[PART ? NV : 1], ar[PART ? NV : 1];
  if (PART)
#pragma unroll
    for (int k = 0; k < NV; k++) aw[k] = ab[k] = ar[k] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int64_t row = (int64_t)blockIdx.x * NW + warp; row < R; row += (int64_t)gridDim.x * NW) {
    float4 a[NV], b[NV], c[NV];
#pragma unroll
    for (int k = 0; k < NV; k++) {
      const int64_t i = row * n4 + k * 32 + lane;
      a[k] = s[i], b[k] = gs[i], c[k] = ld_bf4(g + 4 * i);
    }
    const float mc = ST ? mean[row] : 0.f, rc = ST ? rstd[row] : 1.f;
    double lm = 0, lq = 0;
#pragma unroll
    for (int k = 0; k < NV; k++) {
      float4 cw = c[k];
      if (W) {
        const float4 wk = w[k * 32 + lane];
        cw.x *= wk.x, cw.y *= wk.y, cw.z *= wk.z, cw.w *= wk.w;
      }
      const float4 xh = make_float4((a[k].x - mc) * rc, (a[k].y - mc) * rc, (a[k].z - mc) * rc, (a[k].w - mc) * rc);
      lm += (double)(cw.x + cw.y + cw.z + cw.w);
      lq += (double)(cw.x * xh.x + cw.y * xh.y + cw.z * xh.z + cw.w * xh.w);
      if (PART) {
        aw[k].x += c[k].x * xh.x, aw[k].y += c[k].y * xh.y, aw[k].z += c[k].z * xh.z, aw[k].w += c[k].w * xh.w;
        ab[k].x += c[k].x, ab[k].y += c[k].y, ab[k].z += c[k].z, ab[k].w += c[k].w;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      lm += __shfl_xor_sync(0xffffffffu, lm, o), lq += __shfl_xor_sync(0xffffffffu, lq, o);
    const float m = (float)(lm / 768.0), q = (float)(lq / 768.0);
#pragma unroll
    for (int k = 0; k < NV; k++) {
      const int64_t i = row * n4 + k * 32 + lane;
      float4 cw = c[k];
      if (W) {
        const float4 wk = w[k * 32 + lane];
        cw.x *= wk.x, cw.y *= wk.y, cw.z *= wk.z, cw.w *= wk.w;
      }
      const float4 xh = make_float4((a[k].x - mc) * rc, (a[k].y - mc) * rc, (a[k].z - mc) * rc, (a[k].w - mc) * rc);
      const float4 v = make_float4(rc * (cw.x - m - xh.x * q) + b[k].x, rc * (cw.y - m - xh.y * q) + b[k].y,
                                   rc * (cw.z - m - xh.z * q) + b[k].z, rc * (cw.w - m - xh.w * q) + b[k].w);
      ds[i] = v;
      st_bf4(dr + 4 * i, v);
      if (PART) ar[k].x += v.x, ar[k].y += v.y, ar[k].z += v.z, ar[k].w += v.w;
    }
  }
  if (PART) { /* the block's warps in order, in double, through a (W, N) slab: as the kernels */
    __shared__ float4 slab[8][NV * 32];
    float4 *acc[3] = {aw, ab, ar};
    for (int t = 0; t < 3; t++) {
#pragma unroll
      for (int k = 0; k < NV; k++) slab[warp][k * 32 + lane] = acc[t][k];
      __syncthreads();
      for (int j = threadIdx.x; j < NV * 128; j += blockDim.x) {
        double u = 0;
        for (int v = 0; v < NW; v++) u += (double)reinterpret_cast<const float *>(slab[v])[j];
        part[((int64_t)t * gridDim.x + blockIdx.x) * NV * 128 + j] = u;
      }
      __syncthreads();
    }
  }
}

template <class F> static float best_ms(F launch) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  float best = 1e30f;
  for (int k = 0; k < 20; k++) {
    CK(cudaEventRecord(a));
    launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (k > 1 && ms < best) best = ms;
  }
  CK(cudaGetLastError());
  return best;
}

int main() {
  const int64_t R = 16384, N = 768, n4 = R * N / 4;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  float4 *f[5];
  __nv_bfloat16 *h[3];
  float *sink;
  for (auto &p : f) {
    CK(cudaMalloc(&p, R * N * 4));
    CK(cudaMemset(p, 0, R * N * 4));
  }
  for (auto &p : h) {
    CK(cudaMalloc(&p, R * N * 2));
    CK(cudaMemset(p, 0, R * N * 2));
  }
  CK(cudaMalloc(&sink, 4));
  const double f32 = R * N * 4.0, b16 = R * N * 2.0;
  printf("(%lld, %lld), %d SMs; TB/s (us) for blocks of 256 at 2, 4, 8 an SM\n", (long long)R, (long long)N, sms);
  for (int pass = 0; pass < 4; pass++) {
    const char *name[4] = {"read f32", "copy f32", "forward streams (x, r -> s, y)",
                           "backward streams (s, gs, g -> ds, dr)"};
    const double bytes[4] = {f32, 2 * f32, 2 * f32 + 2 * b16, 3 * f32 + 2 * b16};
    printf("%-40s", name[pass]);
    for (int bps : {2, 4, 8}) {
      const int blocks = sms * bps;
      float ms = best_ms([&] {
        if (pass == 0) rd<<<blocks, 256>>>(f[0], n4, sink);
        if (pass == 1) cp<<<blocks, 256>>>(f[0], f[1], n4);
        if (pass == 2) fwd<<<blocks, 256>>>(f[0], h[0], f[1], h[1], n4);
        if (pass == 3) bwd<<<blocks, 256>>>(f[0], f[2], h[0], f[3], h[2], n4);
      });
      printf("  %.2f (%.1f)", bytes[pass] / (ms * 1e-3) / 1e12, ms * 1e3);
    }
    printf("\n");
  }
  /* a warp a row: warps an SM 8, 12, 16, 24 (blocks of 4 warps) */
  for (int red = 0; red < 2; red++) {
    printf("%-40s", red ? "backward, a warp a row, row sums" : "backward, a warp a row, no sums");
    for (int wps : {8, 12, 16, 24}) {
      const int blocks = sms * wps / 4;
      float ms = best_ms([&] {
        if (red) bwd_rows<true><<<blocks, 128>>>(f[0], f[2], h[0], f[3], h[2], R);
        else bwd_rows<false><<<blocks, 128>>>(f[0], f[2], h[0], f[3], h[2], R);
      });
      printf("  %d: %.2f (%.1f)", wps, (3 * f32 + 2 * b16) / (ms * 1e-3) / 1e12, ms * 1e3);
    }
    printf("\n");
  }
  /* what the real backward adds, one at a time and together (8, 12 and 16 warps an SM) */
  float *stat;
  double *part;
  CK(cudaMalloc(&stat, R * 8));
  CK(cudaMemset(stat, 0, R * 8));
  CK(cudaMalloc(&part, (size_t)3 * sms * 8 * N * 8));
  typedef void (*xkernel)(const float4 *, const float4 *, const __nv_bfloat16 *, float4 *, __nv_bfloat16 *,
                          int64_t, const float4 *, const float *, const float *, double *);
  const xkernel xk[5] = {bwd_rows_x<true, false, false>, bwd_rows_x<false, true, false>,
                         bwd_rows_x<false, false, true>, bwd_rows_x<true, true, true>,
                         bwd_rows_x<false, false, false>};
  const char *xname[5] = {"+ weight (L1)", "+ mean, rstd", "+ partials (72 regs, slab)", "+ all three",
                          "row sums only (same kernel)"};
  for (int v = 0; v < 5; v++) {
    printf("%-40s", xname[v]);
    for (int wps : {8, 12, 16}) {
      const int blocks = sms * wps / 4;
      float ms = best_ms([&] { xk[v]<<<blocks, 128>>>(f[0], f[2], h[0], f[3], h[2], R, f[4], stat, stat, part); });
      printf("  %d: %.2f (%.1f)", wps, (3 * f32 + 2 * b16) / (ms * 1e-3) / 1e12, ms * 1e3);
    }
    printf("\n");
  }
  return 0;
}
