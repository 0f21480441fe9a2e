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
      for (int o = 16; o > 0; o >>= 1) lm += __shfl_xor_sync(0xffffffffu, lm, o), lq += __shfl_xor_sync(0xffffffffu, lq, o);
      m = (float)(lm / 768.0), q = (float)(lq / 768.0);
    }
#pragma unroll
    for (int k = 0; k < NV; k++) {
      const int64_t i = row * n4 + k * 32 + lane;
      const float4 v = make_float4(a[k].x + b[k].x + c[k].x - m - q * a[k].x, a[k].y + b[k].y + c[k].y - m - q * a[k].y,
                                   a[k].z + b[k].z + c[k].z - m - q * a[k].z, a[k].w + b[k].w + c[k].w - m - q * a[k].w);
      ds[i] = v;
      st_bf4(dr + 4 * i, v);
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
  return 0;
}
