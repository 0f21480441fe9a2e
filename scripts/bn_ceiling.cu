/*
** bn_ceiling: batch norm's channels-last loops (the statistics pass and the normalizing pass
** of src/backend/cuda/cuda_batchnorm.cu, bf16, contiguous rows) against a 16-byte read and
** copy of the same bytes, on ResNet-50's shapes at batch 256: how far kiln's kernels are
** from what the device moves, and which loop shapes get there. CUDA runtime alone (no kiln).
**   p1: Welford statistics, U rows loaded a batch, PF: the next batch loaded before this one
**       is used; the grid aims for bps blocks an SM (kiln's plan1)
**   p3: y = relu((x - mean) k + b), U rows a batch, rpt rows a thread; p3res adds a residual
**       (where two copies of the tensor do not fit the buffer the residual is x itself, so
**       those rows read half their bytes from L2: not a DRAM figure)
** Build: nvcc -std=c++17 -O3 -arch=sm_90 --extended-lambda scripts/bn_ceiling.cu -o bn_ceiling
** bench/RESULTS.md, "2026-12-06 16:51-17:22", quotes its H100 output.
*/
#include <cuda_bf16.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
typedef __nv_bfloat16 bf;
struct __align__(16) V8 { bf v[8]; };

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e_)); exit(1); } } while (0)

/* ---- statistics: Welford per channel, as kiln's pass1_cl; U rows loaded at a time; PF: the
** next batch loaded before the current is used */
template <int U, bool PF>
__global__ void __launch_bounds__(256) p1(const bf *__restrict__ x, int64_t R, int C, float *__restrict__ part) {
  const int TX = blockDim.x, TY = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
  const int CV = C / 8, cv = blockIdx.x * TX + tx;
  const int64_t splits = gridDim.y, sp = blockIdx.y, per = (R + splits - 1) / splits;
  const int64_t r0 = sp * per, r1 = r0 + per < R ? r0 + per : R;
  const bool on = cv < CV;
  float n = 0, m[8], q[8];
#pragma unroll
  for (int i = 0; i < 8; i++) m[i] = 0, q[i] = 0;
  const bf *xp = x + cv * 8;
  int64_t r = r0 + ty;
  auto row = [&](const V8 &p) {
    n += 1.f;
    float rc = __fdividef(1.f, n);
#pragma unroll
    for (int i = 0; i < 8; i++) {
      float v = __bfloat162float(p.v[i]), d = v - m[i];
      m[i] += d * rc;
      q[i] += d * (v - m[i]);
    }
  };
  if (on) {
    if (!PF) {
      for (; r + (int64_t)(U - 1) * TY < r1; r += (int64_t)U * TY) {
        V8 px[U];
#pragma unroll
        for (int u = 0; u < U; u++) px[u] = *reinterpret_cast<const V8 *>(xp + (r + (int64_t)u * TY) * C);
#pragma unroll
        for (int u = 0; u < U; u++) row(px[u]);
      }
    } else {
      if (r + (int64_t)(U - 1) * TY < r1) {
        V8 cur[U];
#pragma unroll
        for (int u = 0; u < U; u++) cur[u] = *reinterpret_cast<const V8 *>(xp + (r + (int64_t)u * TY) * C);
        r += (int64_t)U * TY;
        for (;;) {
          const bool more = r + (int64_t)(U - 1) * TY < r1;
          V8 nx[U];
          if (more)
#pragma unroll
            for (int u = 0; u < U; u++) nx[u] = *reinterpret_cast<const V8 *>(xp + (r + (int64_t)u * TY) * C);
#pragma unroll
          for (int u = 0; u < U; u++) row(cur[u]);
          if (!more) break;
#pragma unroll
          for (int u = 0; u < U; u++) cur[u] = nx[u];
          r += (int64_t)U * TY;
        }
      }
    }
    for (; r < r1; r += TY) row(*reinterpret_cast<const V8 *>(xp + r * C));
  }
  extern __shared__ float sh[];
  const int W = 17;
  float *mine = sh + (ty * TX + tx) * W;
  mine[0] = n;
#pragma unroll
  for (int i = 0; i < 8; i++) mine[1 + i] = m[i], mine[9 + i] = q[i];
  __syncthreads();
  for (int h = TY / 2; h >= 1; h >>= 1) {
    if (ty < h) {
      const float *o = sh + ((ty + h) * TX + tx) * W;
      float nb = o[0];
      if (nb > 0) {
        if (n == 0) {
          n = nb;
#pragma unroll
          for (int i = 0; i < 8; i++) m[i] = o[1 + i], q[i] = o[9 + i];
        } else {
          float nt = n + nb, rr = __fdividef(nb, nt);
#pragma unroll
          for (int i = 0; i < 8; i++) {
            float d = o[1 + i] - m[i];
            m[i] += d * rr;
            q[i] += o[9 + i] + d * d * n * rr;
          }
          n = nt;
        }
      }
      mine[0] = n;
#pragma unroll
      for (int i = 0; i < 8; i++) mine[1 + i] = m[i], mine[9 + i] = q[i];
    }
    __syncthreads();
  }
  if (ty != 0 || !on) return;
#pragma unroll
  for (int i = 0; i < 8; i++) {
    float *p = part + ((int64_t)(cv * 8 + i) * splits + sp) * 3;
    p[0] = n, p[1] = m[i], p[2] = q[i];
  }
}

/* ---- normalizing: y = relu((x - mean) k + b), coefficients in registers; U rows a batch */
template <int U, bool RES>
__global__ void __launch_bounds__(256) p3(const bf *__restrict__ x, bf *__restrict__ y, int64_t R, int C,
                                          const float *__restrict__ coef, int64_t chunk, const bf *__restrict__ res) {
  const int CV = C / 8, cv = blockIdx.x * blockDim.x + threadIdx.x;
  if (cv >= CV) return;
  const int64_t step = blockDim.y, r0 = (int64_t)blockIdx.y * chunk, r1 = r0 + chunk < R ? r0 + chunk : R;
  float mean[8], k[8], b[8];
#pragma unroll
  for (int i = 0; i < 8; i++) mean[i] = coef[cv * 8 + i], k[i] = coef[C + cv * 8 + i], b[i] = coef[2 * C + cv * 8 + i];
  const int64_t co = cv * 8;
  auto f = [&](const V8 &p, const V8 &q) {
    V8 o;
#pragma unroll
    for (int i = 0; i < 8; i++) {
      float v = __fmaf_rn(__bfloat162float(p.v[i]) - mean[i], k[i], b[i]);
      if (RES) v += __bfloat162float(q.v[i]);
      o.v[i] = __float2bfloat16_rn(v < 0 ? 0.f : v);
    }
    return o;
  };
  int64_t r = r0 + threadIdx.y;
  for (; r + (U - 1) * step < r1; r += U * step) {
    V8 px[U], pr[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
      px[u] = *reinterpret_cast<const V8 *>(x + (r + u * step) * C + co);
      if (RES) pr[u] = *reinterpret_cast<const V8 *>(res + (r + u * step) * C + co);
    }
#pragma unroll
    for (int u = 0; u < U; u++) *reinterpret_cast<V8 *>(y + (r + u * step) * C + co) = f(px[u], pr[u]);
  }
  for (; r < r1; r += step) {
    V8 q;
    if (RES) q = *reinterpret_cast<const V8 *>(res + r * C + co);
    *reinterpret_cast<V8 *>(y + r * C + co) = f(*reinterpret_cast<const V8 *>(x + r * C + co), q);
  }
}

/* ---- baselines: a flat 16-byte read (sum) and copy, grid-stride, U loads at a time */
template <int U> __global__ void __launch_bounds__(256) rd(const V8 *__restrict__ x, int64_t nv, float *out) {
  float s = 0;
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, st = (int64_t)gridDim.x * blockDim.x;
  for (; i + (U - 1) * st < nv; i += U * st) {
    V8 p[U];
#pragma unroll
    for (int u = 0; u < U; u++) p[u] = x[i + u * st];
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
      for (int j = 0; j < 8; j++) s += __bfloat162float(p[u].v[j]);
  }
  for (; i < nv; i += st) s += __bfloat162float(x[i].v[0]);
  if (s == 12345.f) out[0] = s;
}
template <int U> __global__ void __launch_bounds__(256) cp(const V8 *__restrict__ x, V8 *__restrict__ y, int64_t nv) {
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, st = (int64_t)gridDim.x * blockDim.x;
  for (; i + (U - 1) * st < nv; i += U * st) {
    V8 p[U];
#pragma unroll
    for (int u = 0; u < U; u++) p[u] = x[i + u * st];
#pragma unroll
    for (int u = 0; u < U; u++) y[i + u * st] = p[u];
  }
  for (; i < nv; i += st) y[i] = x[i];
}

static cudaEvent_t e0, e1;
template <class F> float timeit(F f, int reps = 20) {
  f(); f();
  CK(cudaDeviceSynchronize());
  CK(cudaEventRecord(e0));
  for (int i = 0; i < reps; i++) f();
  CK(cudaEventRecord(e1));
  CK(cudaEventSynchronize(e1));
  float ms;
  CK(cudaEventElapsedTime(&ms, e0, e1));
  CK(cudaGetLastError());
  return ms * 1000 / reps; /* us */
}

int sms;
template <int U, bool PF> float run_p1(const bf *x, int64_t R, int C, float *part, int bps, int minrows) {
  int CV = C / 8, tx = 1;
  while (tx < 32 && tx < CV) tx *= 2;
  int ty = 256 / tx;
  int64_t gx = (CV + tx - 1) / tx, target = (int64_t)sms * bps;
  int64_t splits = (target + gx - 1) / gx, most = (R + (int64_t)minrows * ty - 1) / ((int64_t)minrows * ty);
  if (splits > most) splits = most;
  if (splits < 1) splits = 1;
  dim3 g(gx, splits), b(tx, ty);
  return timeit([&] { p1<U, PF><<<g, b, 256 * 17 * 4>>>(x, R, C, part); });
}
template <int U, bool RES = false> float run_p3(const bf *x, bf *y, int64_t R, int C, const float *coef, int rpt, const bf *res = NULL) {
  int CV = C / 8, tx = 1;
  while (tx < 32 && tx < CV) tx *= 2;
  int ty = 256 / tx;
  int64_t gx = (CV + tx - 1) / tx, gy = (R + (int64_t)ty * rpt - 1) / ((int64_t)ty * rpt);
  if (gy > 65535) gy = 65535;
  int64_t chunk = (R + gy - 1) / gy;
  dim3 g(gx, gy), b(tx, ty);
  return timeit([&] { p3<U, RES><<<g, b>>>(x, y, R, C, coef, chunk, res); });
}

int main() {
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const int64_t maxe = 256LL * 112 * 112 * 64;
  bf *x, *y;
  float *part, *coef;
  CK(cudaMalloc(&x, maxe * 2));
  CK(cudaMalloc(&y, maxe * 2));
  CK(cudaMalloc(&part, 64 << 20));
  CK(cudaMalloc(&coef, 3 * 4096 * 4));
  std::vector<bf> h(maxe);
  for (int64_t i = 0; i < maxe; i++) h[i] = __float2bfloat16((float)((i * 2654435761u) % 1000) / 500.f - 1.f);
  CK(cudaMemcpy(x, h.data(), maxe * 2, cudaMemcpyHostToDevice));
  std::vector<float> hc(3 * 4096, 0.5f);
  CK(cudaMemcpy(coef, hc.data(), hc.size() * 4, cudaMemcpyHostToDevice));
  struct S { int64_t R; int C; } shapes[] = {{256LL * 12544, 64}, {256LL * 3136, 64}, {256LL * 3136, 256}, {256LL * 3136, 128},
                                            {256LL * 784, 128},   {256LL * 784, 512},  {256LL * 196, 256},  {256LL * 196, 1024},
                                            {256LL * 49, 512},    {256LL * 49, 2048}};
  printf("SMs %d\n", sms);
  double tot[32] = {0};
  const char *names[] = {"p1 U4 bps8 (main)", "p1 U4 bps3", "p1 U4 bps16", "p1 U8 bps8", "p1 U8 bps4", "p1 U4PF bps8",
                         "p1 U4PF bps4", "p1 U8PF bps4", "p1 U4 bps8 min32", "p1 U2PF bps8",
                         "p3 U4 rpt16 (main)", "p3 U8 rpt16", "p3 U4 rpt32", "p3 U8 rpt32", "p3 U4 rpt64", "p3 U2 rpt16",
                         "read U8", "copy U4", "p3res U4 rpt16", "p3res U2 rpt16", "p3res U8 rpt16"};
  const int NV = sizeof names / sizeof names[0];
  for (auto &s : shapes) {
    const int64_t e = s.R * s.C;
    const double gb = e * 2 / 1e9;
    float t[32];
    int k = 0;
    t[k++] = run_p1<4, false>(x, s.R, s.C, part, 8, 16);
    t[k++] = run_p1<4, false>(x, s.R, s.C, part, 3, 16);
    t[k++] = run_p1<4, false>(x, s.R, s.C, part, 16, 16);
    t[k++] = run_p1<8, false>(x, s.R, s.C, part, 8, 16);
    t[k++] = run_p1<8, false>(x, s.R, s.C, part, 4, 16);
    t[k++] = run_p1<4, true>(x, s.R, s.C, part, 8, 16);
    t[k++] = run_p1<4, true>(x, s.R, s.C, part, 4, 16);
    t[k++] = run_p1<8, true>(x, s.R, s.C, part, 4, 16);
    t[k++] = run_p1<4, false>(x, s.R, s.C, part, 8, 32);
    t[k++] = run_p1<2, true>(x, s.R, s.C, part, 8, 16);
    t[k++] = run_p3<4>(x, y, s.R, s.C, coef, 16);
    t[k++] = run_p3<8>(x, y, s.R, s.C, coef, 16);
    t[k++] = run_p3<4>(x, y, s.R, s.C, coef, 32);
    t[k++] = run_p3<8>(x, y, s.R, s.C, coef, 32);
    t[k++] = run_p3<4>(x, y, s.R, s.C, coef, 64);
    t[k++] = run_p3<2>(x, y, s.R, s.C, coef, 16);
    {
      int64_t nv = e / 8;
      int blocks = sms * 8;
      t[k++] = timeit([&] { rd<8><<<blocks, 256>>>((const V8 *)x, nv, part); });
      t[k++] = timeit([&] { cp<4><<<blocks, 256>>>((const V8 *)x, (V8 *)y, nv); });
    }
    bf *res = x + e; /* the residual: the rest of x's buffer when it fits, else x itself */
    if (2 * e > maxe) res = x;
    t[k++] = run_p3<4, true>(x, y, s.R, s.C, coef, 16, res);
    t[k++] = run_p3<2, true>(x, y, s.R, s.C, coef, 16, res);
    t[k++] = run_p3<8, true>(x, y, s.R, s.C, coef, 16, res);
    printf("(R %lld, C %d) %.0f MB\n", (long long)s.R, s.C, gb * 1e3);
    for (int i = 0; i < NV; i++) {
      int mv = i >= 18 ? 3 : i >= 10 && i != 16 ? 2 : 1;
      printf("  %-22s %8.1f us %6.0f GB/s\n", names[i], t[i], mv * gb / (t[i] * 1e-6));
      tot[i] += t[i];
    }
  }
  printf("sums over the shapes (us):\n");
  for (int i = 0; i < NV; i++) printf("  %-22s %9.1f\n", names[i], tot[i]);
  return 0;
}
