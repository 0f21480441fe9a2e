/*
** latency_probe: the floor under a small training step on this GPU, measured with the
** CUDA runtime alone (no kiln), so kiln's own figures can be read against it.
**   1. a kernel and a 4-byte read back, four ways: cudaMemcpyAsync into pinned memory then
**      cudaStreamSynchronize; the kernel storing into mapped pinned memory then a stream
**      synchronize; the same with the host spinning on the mapped word; an event sync.
**   2. a graph of K small dependent kernels (a chain, as a step's ops are), replayed and
**      waited for: the per-kernel cost inside a graph, with and without programmatic
**      dependent launch (PDL: the next kernel's blocks start while the last one drains,
**      and wait in cudaGridDependencySynchronize for its results).
** Build: nvcc -O2 -arch=sm_90 scripts/latency_probe.cu -o latency_probe
*/
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      fprintf(stderr, "%s: %s (line %d)\n", #x, cudaGetErrorString(e_), __LINE__);            \
      exit(1);                                                                                 \
    }                                                                                          \
  } while (0)

static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec * 1e-3;
}

__global__ void bump(float *x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * 0.5f + 1.0f;
}

__global__ void bump_store(float *x, int n, volatile unsigned *flag, unsigned seq) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = x[i] * 0.5f + 1.0f;
  if (i == 0) {
    __threadfence_system();
    *flag = seq;
  }
}

/* One link of a chain: reads what the previous kernel wrote, writes its own output. */
/* PDL: let the next kernel launch at once (its blocks wait in cudaGridDependencySynchronize
** until this grid has finished and its stores are visible), then wait for the last one. */
template <bool PDL>
__global__ void link(const float *in, float *out, int n) {
  if (PDL) cudaTriggerProgrammaticLaunchCompletion();
  if (PDL) cudaGridDependencySynchronize();
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  float acc = 0.f;
  for (int k = 0; k < 8; k++) acc += in[(i + k * 97) % n];
  if (i < n) out[i] = acc * 0.125f;
}

static int cmpd(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, n, sizeof *v, cmpd);
  return v[n / 2];
}

enum { ITERS = 2000 };

/* One link of the chain on stream s, with or without the PDL attribute. */
static void launch_link(cudaStream_t s, int blocks, int pdl, const float *in, float *out, int n) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(256);
  cfg.stream = s;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = pdl ? 1 : 0;
  if (pdl)
    CK(cudaLaunchKernelEx(&cfg, link<true>, in, out, n));
  else
    CK(cudaLaunchKernelEx(&cfg, link<false>, in, out, n));
}

int main(void) {
  cudaStream_t s;
  CK(cudaSetDevice(0));
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const int n = 128 * 64;
  float *x, *bufs[2];
  CK(cudaMalloc(&x, n * sizeof(float)));
  CK(cudaMemset(x, 0, n * sizeof(float)));
  for (int i = 0; i < 2; i++) {
    CK(cudaMalloc(&bufs[i], n * sizeof(float)));
    CK(cudaMemset(bufs[i], 0, n * sizeof(float)));
  }
  float *pin;
  unsigned *mapped, *mapped_dev;
  CK(cudaHostAlloc((void **)&pin, 64, cudaHostAllocDefault));
  CK(cudaHostAlloc((void **)&mapped, 64, cudaHostAllocMapped));
  CK(cudaHostGetDevicePointer((void **)&mapped_dev, mapped, 0));
  *(volatile unsigned *)mapped = 0;
  cudaEvent_t ev;
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  static double t[ITERS];
  int blocks = (n + 255) / 256;

  /* 1. kernel + read back */
  const char *names[] = {"kernel + sync (no read)", "kernel + memcpy D2H pinned + stream sync",
                         "kernel storing to mapped memory + stream sync",
                         "kernel storing to mapped memory + host spin",
                         "kernel + event record + event sync"};
  for (int way = 0; way < 5; way++) {
    for (int it = 0; it < ITERS + 100; it++) {
      double t0 = now_us();
      unsigned seq = (unsigned)(way * 100000 + it + 1);
      if (way == 2 || way == 3)
        bump_store<<<blocks, 256, 0, s>>>(x, n, mapped_dev, seq);
      else
        bump<<<blocks, 256, 0, s>>>(x, n);
      if (way == 1) CK(cudaMemcpyAsync(pin, x, 4, cudaMemcpyDeviceToHost, s));
      if (way == 3) {
        while (*(volatile unsigned *)mapped != seq) {
        }
      } else if (way == 4) {
        CK(cudaEventRecord(ev, s));
        CK(cudaEventSynchronize(ev));
      } else {
        CK(cudaStreamSynchronize(s));
      }
      if (it >= 100) t[it - 100] = now_us() - t0;
    }
    printf("%-48s median %6.2f us\n", names[way], median(t, ITERS));
  }

  /* 2. graphs of K dependent kernels */
  int ks[] = {1, 4, 8, 12};
  for (int pdl = 0; pdl < 2; pdl++) {
    for (int kk = 0; kk < 4; kk++) {
      int K = ks[kk];
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
      for (int k = 0; k < K; k++) launch_link(s, blocks, pdl, bufs[k & 1], bufs[(k + 1) & 1], n);
      CK(cudaStreamEndCapture(s, &g));
      CK(cudaGraphInstantiate(&ge, g, 0));
      for (int it = 0; it < 50; it++) CK(cudaGraphLaunch(ge, s));
      CK(cudaStreamSynchronize(s));
      for (int it = 0; it < ITERS; it++) {
        double t0 = now_us();
        CK(cudaGraphLaunch(ge, s));
        CK(cudaStreamSynchronize(s));
        t[it] = now_us() - t0;
      }
      double m = median(t, ITERS);
      /* device time alone: many replays back to back between two events */
      cudaEvent_t a, b;
      CK(cudaEventCreate(&a));
      CK(cudaEventCreate(&b));
      CK(cudaEventRecord(a, s));
      for (int it = 0; it < 200; it++) CK(cudaGraphLaunch(ge, s));
      CK(cudaEventRecord(b, s));
      CK(cudaEventSynchronize(b));
      float ms;
      CK(cudaEventElapsedTime(&ms, a, b));
      printf("graph of %2d kernels%s: launch+sync median %6.2f us; back to back %6.2f us a replay\n",
             K, pdl ? " (PDL)" : "      ", m, ms * 1e3 / 200);
      /* the same chain launched eagerly on the stream */
      for (int it = 0; it < ITERS; it++) {
        double t0 = now_us();
        for (int k = 0; k < K; k++) launch_link(s, blocks, pdl, bufs[k & 1], bufs[(k + 1) & 1], n);
        CK(cudaStreamSynchronize(s));
        t[it] = now_us() - t0;
      }
      printf("stream of %2d kernels%s: launch+sync median %6.2f us\n", K, pdl ? " (PDL)" : "      ",
             median(t, ITERS));
      CK(cudaGraphExecDestroy(ge));
      CK(cudaGraphDestroy(g));
    }
  }
  return 0;
}
