/*
** Device facts and a copy-bandwidth measurement, for `kiln doctor`.
*/
#include "cuda_int.cuh"

#include <cublas_v2.h>
#include <string.h>
#ifdef KILN_HAVE_CUDNN
#include <cudnn.h>
#endif

extern "C" kiln_status kiln__cuda_device_info(int device, kiln__cuda_info *out) {
  memset(out, 0, sizeof *out);
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  cudaDeviceProp prop;
  KC_CUDA(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  strncpy(out->name, prop.name, sizeof out->name - 1);
  out->major = prop.major;
  out->minor = prop.minor;
  out->multiprocessors = prop.multiProcessorCount;
  size_t fr = 0, tot = 0;
  KC_CUDA(cudaMemGetInfo(&fr, &tot), "cudaMemGetInfo");
  out->total_mem = (int64_t)tot;
  out->free_mem = (int64_t)fr;
  KC_CUDA(cudaDriverGetVersion(&out->driver_version), "cudaDriverGetVersion");
  KC_CUDA(cudaRuntimeGetVersion(&out->runtime_version), "cudaRuntimeGetVersion");
  int ma = 0, mi = 0, pa = 0;
  if (cublasGetProperty(MAJOR_VERSION, &ma) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(MINOR_VERSION, &mi) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(PATCH_LEVEL, &pa) == CUBLAS_STATUS_SUCCESS)
    out->cublas_version = ma * 10000 + mi * 100 + pa; /* CUBLAS_VERSION's layout */
#ifdef KILN_HAVE_CUDNN
  out->cudnn_version = (int)cudnnGetVersion(); /* the loaded library's, not the header's */
#endif
  return KILN_OK;
}

namespace {

/* Best of reps timed copies, in GB/s. */
kiln_status time_copy(cudaStream_t s, void *dst, const void *src, size_t n, cudaMemcpyKind kind,
                      cudaEvent_t e0, cudaEvent_t e1, double *gbs) {
  const int reps = 5;
  float best = 0;
  KC_CUDA(cudaMemcpyAsync(dst, src, n, kind, s), "bandwidth warm-up");
  for (int r = 0; r < reps; r++) {
    KC_CUDA(cudaEventRecord(e0, s), "cudaEventRecord");
    KC_CUDA(cudaMemcpyAsync(dst, src, n, kind, s), "bandwidth copy");
    KC_CUDA(cudaEventRecord(e1, s), "cudaEventRecord");
    KC_CUDA(cudaEventSynchronize(e1), "cudaEventSynchronize");
    float ms = 0;
    KC_CUDA(cudaEventElapsedTime(&ms, e0, e1), "cudaEventElapsedTime");
    if (r == 0 || ms < best) best = ms;
  }
  *gbs = best > 0 ? (double)n / (best * 1e-3) / 1e9 : 0.0;
  return KILN_OK;
}

} // namespace

extern "C" kiln_status kiln__cuda_bandwidth(int device, double *h2d_gbs, double *d2h_gbs) {
  *h2d_gbs = *d2h_gbs = 0;
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  if (d->capturing)
    return kiln_set_error(KILN_ERR_STATE, "kiln: bandwidth test during graph capture");
  const size_t n = (size_t)64 << 20;
  void *host = NULL, *dev = NULL;
  cudaEvent_t e0 = NULL, e1 = NULL;
  kiln_status st = kiln__cuda_err(cudaHostAlloc(&host, n, cudaHostAllocDefault), "cudaHostAlloc");
  /* Outside the caching allocator on purpose: a one-off 64 MiB should not stay cached. */
  if (st == KILN_OK) st = kiln__cuda_err(cudaMalloc(&dev, n), "cudaMalloc (bandwidth)");
  if (st == KILN_OK) st = kiln__cuda_err(cudaEventCreate(&e0), "cudaEventCreate");
  if (st == KILN_OK) st = kiln__cuda_err(cudaEventCreate(&e1), "cudaEventCreate");
  if (st == KILN_OK) {
    memset(host, 1, n);
    st = time_copy(d->stream, dev, host, n, cudaMemcpyHostToDevice, e0, e1, h2d_gbs);
  }
  if (st == KILN_OK) st = time_copy(d->stream, host, dev, n, cudaMemcpyDeviceToHost, e0, e1, d2h_gbs);
  if (e1) cudaEventDestroy(e1);
  if (e0) cudaEventDestroy(e0);
  if (dev) {
    cudaStreamSynchronize(d->stream);
    cudaFree(dev);
  }
  if (host) cudaFreeHost(host);
  return st;
}
