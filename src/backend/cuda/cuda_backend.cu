/*
** The CUDA backend's vtable, its availability probe, the per-device state (one
** non-blocking stream each, created on first use) and the memory copies.
**
** All work for a device goes on its one stream, in the order it is queued: that is what
** makes the caching allocator's host-side frees safe (a block freed on the host is only
** reused by work queued later on the same stream) and what lets graph capture record a
** whole step. Only calls that hand data to the host synchronize.
**
** One exception, kept narrow: the data loader's host->device copies run on a side copy
** stream, so that the next batch crosses the link while the current step's kernels run.
** They meet the device's stream only through events (src/data/loader.c says how the
** loader keeps the allocator's rule: the side stream writes a block only after an event
** recorded on the device's stream behind its last user, and the device's stream waits for
** the copy before any kernel reads it).
*/
#include "cuda_int.cuh"

#include <atomic>
#include <mutex>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static kiln__cuda_dev g_dev[KC_MAX_DEV];
static std::atomic<int> g_ready[KC_MAX_DEV];
static std::mutex g_init_mu;
static int g_count = -1; /* set by probe */

/* ---- errors ---- */

extern "C" kiln_status kiln__cuda_err(cudaError_t e, const char *what) {
  if (e == cudaSuccess) return KILN_OK;
  kiln_status code = KILN_ERR_INTERNAL;
  switch (e) {
  case cudaErrorMemoryAllocation: code = KILN_ERR_OOM; break;
  case cudaErrorStreamCaptureUnsupported:
  case cudaErrorStreamCaptureInvalidated:
  case cudaErrorStreamCaptureWrongThread:
  case cudaErrorStreamCaptureUnmatched:
  case cudaErrorStreamCaptureUnjoined:
  case cudaErrorStreamCaptureIsolation:
  case cudaErrorStreamCaptureImplicit:
  case cudaErrorCapturedEvent: code = KILN_ERR_STATE; break;
  case cudaErrorInvalidDevice:
  case cudaErrorNoDevice:
  case cudaErrorInsufficientDriver: code = KILN_ERR_DEVICE; break;
  case cudaErrorInvalidValue:
  case cudaErrorInvalidConfiguration: code = KILN_ERR_INVALID_ARGUMENT; break;
  default: break;
  }
  /* Clears a non-sticky error so that later calls do not see it again. */
  (void)cudaGetLastError();
  kiln_set_error(code, "kiln: CUDA error in %s: %s (%s)", what, cudaGetErrorName(e),
                 cudaGetErrorString(e));
  return code;
}

extern "C" kiln_status kiln__cuda_launched(const char *what) {
  return kiln__cuda_err(cudaGetLastError(), what);
}

/* ---- probe ---- */

static char g_why[512];

static void ver_str(int v, char *buf, size_t n) { snprintf(buf, n, "%d.%d", v / 1000, (v % 1000) / 10); }

static kiln_status probe_once(const char **why) {
  int drv = 0, rt = 0;
  char a[32], b[32];
  cudaError_t e = cudaDriverGetVersion(&drv);
  if (e != cudaSuccess || drv == 0) {
    snprintf(g_why, sizeof g_why, "no NVIDIA driver found (libcuda not loaded)");
    *why = g_why;
    return KILN_ERR_UNAVAILABLE;
  }
  cudaRuntimeGetVersion(&rt);
  if (drv / 1000 < rt / 1000 || (rt == 0 && drv < CUDART_VERSION)) {
    ver_str(drv, a, sizeof a);
    ver_str(rt ? rt : CUDART_VERSION, b, sizeof b);
    snprintf(g_why, sizeof g_why,
             "the driver (%s) is older than the CUDA runtime kiln was built with (%s): "
             "update the driver", a, b);
    *why = g_why;
    return KILN_ERR_UNAVAILABLE;
  }
  int n = 0;
  e = cudaGetDeviceCount(&n);
  const char *vis = getenv("CUDA_VISIBLE_DEVICES");
  if (e == cudaErrorInsufficientDriver) {
    ver_str(drv, a, sizeof a);
    ver_str(rt, b, sizeof b);
    snprintf(g_why, sizeof g_why,
             "the driver (%s) is older than the CUDA runtime kiln was built with (%s): "
             "update the driver", a, b);
  } else if (e == cudaErrorNoDevice || (e == cudaSuccess && n == 0)) {
    snprintf(g_why, sizeof g_why, "no CUDA device visible (CUDA_VISIBLE_DEVICES=%s)",
             vis ? vis : "unset");
  } else if (e != cudaSuccess) {
    snprintf(g_why, sizeof g_why, "CUDA cannot start: %s (%s)%s%s", cudaGetErrorName(e),
             cudaGetErrorString(e), vis ? "; CUDA_VISIBLE_DEVICES=" : "", vis ? vis : "");
  }
  (void)cudaGetLastError();
  if (e != cudaSuccess || n == 0) {
    *why = g_why;
    return KILN_ERR_UNAVAILABLE;
  }
  g_count = n < KC_MAX_DEV ? n : KC_MAX_DEV;
  return KILN_OK;
}

static kiln_status cuda_probe(const char **why) {
  static std::once_flag once;
  static kiln_status st = KILN_ERR_UNAVAILABLE;
  static const char *saved = NULL;
  std::call_once(once, [] { st = probe_once(&saved); });
  if (why) *why = st == KILN_OK ? NULL : saved;
  return st;
}

static int cuda_device_count(void) {
  const char *why;
  return cuda_probe(&why) == KILN_OK ? g_count : 0;
}

/* ---- device state ---- */

extern "C" kiln_status kiln__cuda_ctx(int device, kiln__cuda_dev **out) {
  if (device < 0 || device >= cuda_device_count())
    return kiln_set_error(KILN_ERR_DEVICE, "kiln: no CUDA device cuda:%d (%d visible)", device,
                          cuda_device_count());
  /* Asked each time (cheap): other code on this thread (NCCL, user code) may switch. */
  int cur = -1;
  KC_CUDA(cudaGetDevice(&cur), "cudaGetDevice");
  if (cur != device) KC_CUDA(cudaSetDevice(device), "cudaSetDevice");
  kiln__cuda_dev *d = &g_dev[device];
  if (!g_ready[device].load(std::memory_order_acquire)) {
    std::lock_guard<std::mutex> lock(g_init_mu);
    if (!g_ready[device].load(std::memory_order_relaxed)) {
      KC_CUDA(cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking), "cudaStreamCreate");
      /* The index error flag lives in mapped pinned host memory: kernels write it through
      ** its device alias, and the host reads it after any synchronize with no copy, so
      ** every kiln_item() costs one transfer, not two. */
      KC_CUDA(cudaHostAlloc((void **)&d->err_flag_host, sizeof(int), cudaHostAllocMapped),
              "cudaHostAlloc (error flag)");
      *(volatile int *)d->err_flag_host = 0;
      KC_CUDA(cudaHostGetDevicePointer((void **)&d->err_flag, d->err_flag_host, 0),
              "cudaHostGetDevicePointer (error flag)");
      KC_CUDA(cudaDeviceGetAttribute(&d->sm_count, cudaDevAttrMultiProcessorCount, device),
              "cudaDeviceGetAttribute");
      KC_CUDA(cudaDeviceSynchronize(), "cudaDeviceSynchronize (init)");
      g_ready[device].store(1, std::memory_order_release);
    }
  }
  *out = d;
  return KILN_OK;
}

extern "C" kiln_status kiln__cuda_check_flag(int device) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  /* callers have synchronized the stream: the flag's host copy is up to date */
  int h = *(volatile int *)d->err_flag_host;
  if (h != 0) {
    *(volatile int *)d->err_flag_host = 0;
    kiln__kop op = (kiln__kop)(h - 1);
    return kiln_set_error(KILN_ERR_INDEX, "index out of range in %s (detected on the device)",
                          (int)op < (int)KILN__K_COUNT ? kiln__kop_name(op) : "?");
  }
  return KILN_OK;
}

extern "C" bool kiln__cuda_capturing(int device) {
  if (device < 0 || device >= KC_MAX_DEV || !g_ready[device].load()) return false;
  return g_dev[device].capturing != 0;
}

/* ---- memory copies ---- */

/* Small reads (kiln_item: a loss every step) are stored by a kernel straight into mapped
** pinned host memory, then the stream is synchronized: on the H200 machines that round
** trip took 9.5 us against 18.4 us for cudaMemcpyAsync into pinned memory and a
** synchronize (scripts/latency_probe.cu), and a read a step is on every step's critical
** path. Into pageable memory the driver stages a copy itself and the host waits longer. */
enum { KC_READ_SCRATCH = 4096 };
static struct {
  std::mutex mu;
  void *buf;     /* pinned and mapped; NULL until first use */
  void *buf_dev; /* its device alias */
  bool failed;
} g_read[KC_MAX_DEV];

/* One block: words when both ends allow, else bytes. */
__global__ void kc_read_small(const unsigned char *src, unsigned char *dst, int n) {
  if ((((uintptr_t)src | (uintptr_t)dst | (unsigned)n) & 3) == 0) {
    for (int i = threadIdx.x; i < n / 4; i += blockDim.x)
      ((unsigned *)dst)[i] = ((const unsigned *)src)[i];
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  }
}

static kiln_status cuda_copy_to_host(int device, void *dst, const void *src, size_t n) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  if (d->capturing)
    return kiln_set_error(KILN_ERR_STATE,
                          "kiln: a value was read on the host inside a captured step "
                          "(cuda:%d); move item()/to_host out of the graph", device);
  if (n == 0) return KILN_OK;
  if (n <= KC_READ_SCRATCH) {
    std::lock_guard<std::mutex> lock(g_read[device].mu);
    if (!g_read[device].buf && !g_read[device].failed) {
      if (cudaHostAlloc(&g_read[device].buf, KC_READ_SCRATCH, cudaHostAllocMapped) != cudaSuccess ||
          cudaHostGetDevicePointer(&g_read[device].buf_dev, g_read[device].buf, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        if (g_read[device].buf) cudaFreeHost(g_read[device].buf);
        g_read[device].buf = NULL;
        g_read[device].failed = true;
      }
    }
    if (g_read[device].buf) {
      kc_read_small<<<1, 128, 0, d->stream>>>((const unsigned char *)src,
                                              (unsigned char *)g_read[device].buf_dev, (int)n);
      KC_TRY(kiln__cuda_launched("copy to host"));
      KC_CUDA(cudaStreamSynchronize(d->stream), "copy to host (synchronize)");
      memcpy(dst, g_read[device].buf, n);
      return kiln__cuda_check_flag(device);
    }
  }
  KC_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, d->stream), "copy to host");
  KC_CUDA(cudaStreamSynchronize(d->stream), "copy to host (synchronize)");
  return kiln__cuda_check_flag(device);
}

/* Small host->device copies (a training batch, a scalar) go through a pinned staging
** ring: memcpy into page-locked memory, then a truly asynchronous DMA, so the host does
** not wait on the copy engine as it does for pageable memory. A region of the ring is
** written again only after the event recorded behind its copy has completed. */
enum { KC_RING_BYTES = 8 << 20, KC_RING_MAX_COPY = 1 << 20, KC_RING_EVENTS = 64 };
struct kc_ring {
  std::mutex mu;
  char *buf;      /* pinned, KC_RING_BYTES; NULL until first use (or when unavailable) */
  bool failed;    /* pinned memory could not be had: always use the plain path */
  size_t head;
  struct { cudaEvent_t ev; size_t lo, hi; } fly[KC_RING_EVENTS]; /* in-flight regions */
  int first, count;
};
static kc_ring g_ring[KC_MAX_DEV];

static bool ring_overlaps(size_t lo, size_t hi, size_t a, size_t b) { return lo < b && a < hi; }

static kiln_status ring_copy(kiln__cuda_dev *d, kc_ring *r, void *dst, const void *src, size_t n,
                             bool *done) {
  *done = false;
  std::lock_guard<std::mutex> lock(r->mu);
  if (r->failed) return KILN_OK;
  if (!r->buf) {
    if (cudaHostAlloc((void **)&r->buf, KC_RING_BYTES, cudaHostAllocDefault) != cudaSuccess) {
      (void)cudaGetLastError();
      r->buf = NULL;
      r->failed = true;
      return KILN_OK;
    }
    for (int i = 0; i < KC_RING_EVENTS; i++)
      KC_CUDA(cudaEventCreateWithFlags(&r->fly[i].ev, cudaEventDisableTiming), "cudaEventCreate");
  }
  size_t at = (r->head + 255) & ~(size_t)255;
  if (at + n > KC_RING_BYTES) at = 0;
  /* wait for the copies still reading [at, at + n) (oldest first), or for a free event */
  while (r->count > 0) {
    int i = r->first;
    if (!ring_overlaps(at, at + n, r->fly[i].lo, r->fly[i].hi) && r->count < KC_RING_EVENTS) break;
    KC_CUDA(cudaEventSynchronize(r->fly[i].ev), "staging ring (event synchronize)");
    r->first = (r->first + 1) % KC_RING_EVENTS;
    r->count--;
  }
  memcpy(r->buf + at, src, n);
  KC_CUDA(cudaMemcpyAsync(dst, r->buf + at, n, cudaMemcpyHostToDevice, d->stream), "copy from host");
  int slot = (r->first + r->count) % KC_RING_EVENTS;
  KC_CUDA(cudaEventRecord(r->fly[slot].ev, d->stream), "staging ring (event record)");
  r->fly[slot].lo = at;
  r->fly[slot].hi = at + n;
  r->count++;
  r->head = at + n;
  *done = true;
  return KILN_OK;
}

static kiln_status cuda_copy_from_host(int device, void *dst, const void *src, size_t n) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  if (n == 0) return KILN_OK;
  if (n <= KC_RING_MAX_COPY && !d->capturing) {
    bool done = false;
    KC_TRY(ring_copy(d, &g_ring[device], dst, src, n, &done));
    if (done) return KILN_OK;
  }
  /* From pageable memory this returns once src has been staged, so the caller may reuse
  ** src at once; the device sees the data in stream order. */
  KC_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, d->stream), "copy from host");
  return KILN_OK;
}

static kiln_status cuda_copy_device(int device, void *dst, const void *src, size_t n) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  if (n == 0) return KILN_OK;
  KC_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, d->stream), "copy on device");
  return KILN_OK;
}

static kiln_status cuda_memset_zero(int device, void *p, size_t n) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  if (n == 0) return KILN_OK;
  KC_CUDA(cudaMemsetAsync(p, 0, n, d->stream), "memset");
  return KILN_OK;
}

static kiln_status cuda_synchronize(int device) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  if (d->capturing)
    return kiln_set_error(KILN_ERR_STATE,
                          "kiln: synchronize inside a captured step (cuda:%d)", device);
  KC_CUDA(cudaStreamSynchronize(d->stream), "synchronize");
  return kiln__cuda_check_flag(device);
}

/* ---- exports for other layers (cuda_api.h) ---- */

extern "C" void *kiln__cuda_stream(int device) {
  kiln__cuda_dev *d;
  if (kiln__cuda_ctx(device, &d) != KILN_OK) return NULL;
  return (void *)d->stream;
}

extern "C" kiln_status kiln__cuda_host_alloc(int device, void **p, size_t n) {
  *p = NULL;
  const char *why;
  if (cuda_probe(&why) != KILN_OK)
    return kiln_set_error(KILN_ERR_UNAVAILABLE, "kiln: pinned memory needs CUDA: %s", why);
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  cudaError_t e = cudaHostAlloc(p, n ? n : 1, cudaHostAllocPortable);
  if (e != cudaSuccess) {
    *p = NULL;
    (void)cudaGetLastError();
    return kiln_set_error(KILN_ERR_OOM, "kiln: cannot pin %zu bytes of host memory: %s", n,
                          cudaGetErrorString(e));
  }
  return KILN_OK;
}

extern "C" void kiln__cuda_host_free(void *p) {
  if (p) (void)cudaFreeHost(p);
}

extern "C" kiln_status kiln__cuda_copy_from_host_async(int device, void *dst, const void *src,
                                                       size_t n) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  if (n == 0) return KILN_OK;
  KC_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, d->stream),
          "async copy from host");
  return KILN_OK;
}

/* The side copy streams, made on first use (cuda_api.h). */
static struct {
  std::mutex mu;
  cudaStream_t stream; /* NULL until first use */
} g_side[KC_MAX_DEV];

static kiln_status side_stream(int device, cudaStream_t *out) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  std::lock_guard<std::mutex> lock(g_side[device].mu);
  if (!g_side[device].stream)
    KC_CUDA(cudaStreamCreateWithFlags(&g_side[device].stream, cudaStreamNonBlocking),
            "cudaStreamCreate (side copy stream)");
  *out = g_side[device].stream;
  return KILN_OK;
}

extern "C" kiln_status kiln__cuda_side_copy_from_host(int device, void *dst, const void *src,
                                                      size_t n) {
  cudaStream_t s;
  KC_TRY(side_stream(device, &s));
  if (n == 0) return KILN_OK;
  KC_CUDA(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s), "copy from host (side stream)");
  return KILN_OK;
}

extern "C" kiln_status kiln__cuda_side_event_record(int device, void *ev) {
  cudaStream_t s;
  KC_TRY(side_stream(device, &s));
  KC_CUDA(cudaEventRecord((cudaEvent_t)ev, s), "cudaEventRecord (side stream)");
  return KILN_OK;
}

extern "C" kiln_status kiln__cuda_side_event_wait(int device, void *ev) {
  cudaStream_t s;
  KC_TRY(side_stream(device, &s));
  KC_CUDA(cudaStreamWaitEvent(s, (cudaEvent_t)ev, 0), "cudaStreamWaitEvent (side stream)");
  return KILN_OK;
}

extern "C" kiln_status kiln__cuda_event_new(int device, void **ev) {
  *ev = NULL;
  const char *why;
  if (cuda_probe(&why) != KILN_OK)
    return kiln_set_error(KILN_ERR_UNAVAILABLE, "kiln: CUDA events: %s", why);
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d)); /* the event is made on the current device */
  cudaEvent_t e;
  KC_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  *ev = (void *)e;
  return KILN_OK;
}

extern "C" void kiln__cuda_event_free(void *ev) {
  if (ev) (void)cudaEventDestroy((cudaEvent_t)ev);
}

extern "C" kiln_status kiln__cuda_event_record(int device, void *ev) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  KC_CUDA(cudaEventRecord((cudaEvent_t)ev, d->stream), "cudaEventRecord");
  return KILN_OK;
}

extern "C" kiln_status kiln__cuda_event_wait(int device, void *ev) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  KC_CUDA(cudaStreamWaitEvent(d->stream, (cudaEvent_t)ev, 0), "cudaStreamWaitEvent");
  return KILN_OK;
}

extern "C" kiln_status kiln__cuda_event_synchronize(void *ev) {
  KC_CUDA(cudaEventSynchronize((cudaEvent_t)ev), "cudaEventSynchronize");
  return KILN_OK;
}

extern "C" int kiln__cuda_event_query(void *ev) {
  cudaError_t e = cudaEventQuery((cudaEvent_t)ev);
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return 0;
  }
  kiln__cuda_err(e, "cudaEventQuery");
  return -1;
}

/* ---- the vtable ---- */

static void *cuda_alloc(int device, size_t n) { return kiln__cuda_alloc(device, n); }
static void cuda_free(int device, void *p, size_t n) { kiln__cuda_free(device, p, n); }

/* The families past ADAM_MULTI, each listing its ops (kc_family and cuda_supports). */
static constexpr bool kc_is_transformer(kiln__kop op) {
  return op == KILN__K_LAYER_NORM || op == KILN__K_LAYER_NORM_BACKWARD ||
         op == KILN__K_ATTENTION || op == KILN__K_ATTENTION_BACKWARD || op == KILN__K_CUMSUM ||
         op == KILN__K_TRIL || op == KILN__K_TOPK || op == KILN__K_MULTINOMIAL ||
         op == KILN__K_LINEAR_GELU || op == KILN__K_RESIDUAL_LAYER_NORM ||
         op == KILN__K_RESIDUAL_LAYER_NORM_BACKWARD || op == KILN__K_MATMUL_DGELU;
}

/* Decoding with a KV cache (cuda_kv.cu, issue 16's generation). */
static constexpr bool kc_is_kv(kiln__kop op) {
  return op == KILN__K_INDEX_COPY || op == KILN__K_KV_ATTENTION || op == KILN__K_SAMPLE_TOKENS ||
         op == KILN__K_ADD_LAYER_NORM || op == KILN__K_LINEAR_DECODE;
}

static constexpr bool kc_is_conv(kiln__kop op) {
  return op == KILN__K_IM2COL || op == KILN__K_COL2IM || op == KILN__K_MAX_POOL2D ||
         op == KILN__K_CONV2D || op == KILN__K_CONV2D_BACKWARD_DATA || op == KILN__K_CONV2D_BACKWARD_DATA_ACC ||
         op == KILN__K_CONV2D_BACKWARD_WEIGHT || op == KILN__K_MAX_POOL2D_BACKWARD ||
         op == KILN__K_RELU_MAX_POOL2D || op == KILN__K_RELU_MAX_POOL2D_BACKWARD ||
         op == KILN__K_CONV1_RELU_MAX_POOL2D || op == KILN__K_CONV1_RELU_MAX_POOL2D_BACKWARD;
}

static constexpr bool kc_is_batchnorm(kiln__kop op) {
  return op == KILN__K_BATCH_NORM || op == KILN__K_BATCH_NORM_BACKWARD;
}

static bool cuda_supports(const kiln__kargs *a) {
  switch (a->op) {
  case KILN__K_RAND_UNIFORM: case KILN__K_RAND_NORMAL: case KILN__K_RAND_INT:
  case KILN__K_RAND_BERNOULLI:
    return kiln__cuda_random_supports(a);
  case KILN__K_SUM: case KILN__K_PROD: case KILN__K_AMAX: case KILN__K_AMIN:
  case KILN__K_MAX_DIM: case KILN__K_MIN_DIM:
    return kiln__cuda_reduce_supports(a);
  case KILN__K_SOFTMAX: case KILN__K_LOG_SOFTMAX: case KILN__K_SOFTMAX_BACKWARD:
  case KILN__K_LOG_SOFTMAX_BACKWARD:
    return kiln__cuda_softmax_supports(a);
  case KILN__K_CROSS_ENTROPY: case KILN__K_CROSS_ENTROPY_BACKWARD: case KILN__K_CROSS_ENTROPY_MEAN:
    return kiln__cuda_cross_entropy_supports(a);
  case KILN__K_MATMUL: return kiln__cuda_matmul_supports(a);
  case KILN__K_ADAM: return kiln__cuda_adam_supports(a);
  case KILN__K_ADAM_MULTI: return kiln__cuda_adam_multi_supports(a);
  case KILN__K_SGD_MULTI: return kiln__cuda_sgd_multi_supports(a);
  case KILN__K_CAST_MULTI: return kiln__cuda_cast_multi_supports(a);
  case KILN__K_INDEX_SELECT: case KILN__K_INDEX_ADD: case KILN__K_GATHER:
  case KILN__K_SCATTER_ADD:
    return kiln__cuda_index_supports(a);
  case KILN__K_AMP_UNSCALE: case KILN__K_AMP_UPDATE_SCALE: return kiln__cuda_amp_supports(a);
  default:
    if (kc_is_kv(a->op)) return kiln__cuda_kv_supports(a);
    if (kc_is_transformer(a->op)) return kiln__cuda_transformer_supports(a);
    if (kc_is_conv(a->op)) return kiln__cuda_conv_supports(a);
    if (kc_is_batchnorm(a->op)) return kiln__cuda_batchnorm_supports(a);
    return kiln__cuda_elementwise_supports(a);
  }
}

/* ---- device timing (KILN_PROFILE=device) ---- */
static void *cuda_mark(int device) {
  kiln__cuda_dev *d;
  if (kiln__cuda_ctx(device, &d) != KILN_OK || d->capturing) return NULL; /* a capture times nothing */
  cudaEvent_t e;
  if (cudaEventCreate(&e) != cudaSuccess) return NULL;
  if (cudaEventRecord(e, d->stream) != cudaSuccess) {
    cudaEventDestroy(e);
    return NULL;
  }
  return (void *)e;
}

static double cuda_elapsed_ms(int device, void *start, void *stop) {
  (void)device;
  float ms = -1;
  if (!start || !stop || cudaEventSynchronize((cudaEvent_t)stop) != cudaSuccess ||
      cudaEventElapsedTime(&ms, (cudaEvent_t)start, (cudaEvent_t)stop) != cudaSuccess) {
    (void)cudaGetLastError();
    ms = -1;
  }
  if (start) cudaEventDestroy((cudaEvent_t)start);
  if (stop) cudaEventDestroy((cudaEvent_t)stop);
  return ms;
}

/* A kernel family's entry: during a capture with data dependencies (cuda_capture.cu) the
** op's launches are made to wait only for the ops whose memory it shares. */
template <kiln__kernel_fn F> static kiln_status kc_entry(const kiln__kargs *a) {
  if (!kiln__cuda_capture_tracking(a->device)) return F(a);
  KC_TRY(kiln__cuda_capture_op_begin(a));
  kiln_status st = F(a);
  kiln_status end = kiln__cuda_capture_op_end(a->device);
  return st != KILN_OK ? st : end;
}

/* Which family serves each op (constexpr, so the table below is a constant). */
static constexpr kiln__kernel_fn kc_family(kiln__kop op) {
  /* Every family names its ops: an op no family lists has no CUDA kernel (NULL), so that
  ** dispatch falls back to the CPU (and the op layer composes where it asks
  ** kiln__dispatch_has) instead of the elementwise family, the catch-all for the ops up
  ** to ADAM_MULTI, taking ops it does not know. */
  return op == KILN__K_AMP_UNSCALE || op == KILN__K_AMP_UPDATE_SCALE ? kc_entry<kiln__cuda_amp>
         : kc_is_kv(op) ? kc_entry<kiln__cuda_kv>
         : kc_is_transformer(op) ? kc_entry<kiln__cuda_transformer>
         : kc_is_conv(op) ? kc_entry<kiln__cuda_conv>
         : op == KILN__K_SGD_MULTI ? kc_entry<kiln__cuda_sgd_multi>
         : op == KILN__K_CAST_MULTI ? kc_entry<kiln__cuda_cast_multi>
         : kc_is_batchnorm(op) ? kc_entry<kiln__cuda_batchnorm>
         : (int)op > (int)KILN__K_ADAM_MULTI
             ? static_cast<kiln__kernel_fn>(nullptr)
         : (op == KILN__K_RAND_UNIFORM || op == KILN__K_RAND_NORMAL || op == KILN__K_RAND_INT ||
          op == KILN__K_RAND_BERNOULLI)
             ? kc_entry<kiln__cuda_random>
         : (op == KILN__K_SUM || op == KILN__K_PROD || op == KILN__K_AMAX ||
            op == KILN__K_AMIN || op == KILN__K_MAX_DIM || op == KILN__K_MIN_DIM)
             ? kc_entry<kiln__cuda_reduce>
         : (op == KILN__K_SOFTMAX || op == KILN__K_LOG_SOFTMAX ||
            op == KILN__K_SOFTMAX_BACKWARD || op == KILN__K_LOG_SOFTMAX_BACKWARD)
             ? kc_entry<kiln__cuda_softmax>
         : (op == KILN__K_CROSS_ENTROPY || op == KILN__K_CROSS_ENTROPY_BACKWARD ||
            op == KILN__K_CROSS_ENTROPY_MEAN)
             ? kc_entry<kiln__cuda_cross_entropy>
         : op == KILN__K_MATMUL ? kc_entry<kiln__cuda_matmul>
         : op == KILN__K_ADAM ? kc_entry<kiln__cuda_adam>
         : op == KILN__K_ADAM_MULTI ? kc_entry<kiln__cuda_adam_multi>
         : (op == KILN__K_INDEX_SELECT || op == KILN__K_INDEX_ADD || op == KILN__K_GATHER ||
            op == KILN__K_SCATTER_ADD)
             ? kc_entry<kiln__cuda_index>
             : kc_entry<kiln__cuda_elementwise>;
}

/* ---- the optional entries: graphs, the loader's async copies, device details ---- */
static const kiln__backend_graph cuda_graph = {
    kiln__cuda_graph_begin, kiln__cuda_graph_end,   kiln__cuda_graph_launch,
    kiln__cuda_graph_free,  kiln__cuda_graph_shape, kiln__cuda_capturing,
};

static const kiln__backend_async cuda_async = {
    kiln__cuda_host_alloc,          kiln__cuda_host_free,         kiln__cuda_event_new,
    kiln__cuda_event_free,          kiln__cuda_event_record,      kiln__cuda_event_wait,
    kiln__cuda_event_synchronize,   kiln__cuda_side_copy_from_host, kiln__cuda_side_event_record,
    kiln__cuda_side_event_wait,
};

static kiln_status cuda_device_info(int device, kiln_device_info *out) {
  kiln__cuda_info ci;
  kiln_status st = kiln__cuda_device_info(device, &ci);
  if (st != KILN_OK) return st;
  snprintf(out->name, sizeof out->name, "%s", ci.name);
  out->compute_major = ci.major;
  out->compute_minor = ci.minor;
  out->multiprocessors = ci.multiprocessors;
  out->total_memory = ci.total_mem;
  out->free_memory = ci.free_mem;
  out->driver_version = ci.driver_version;
  out->runtime_version = ci.runtime_version;
  out->blas_version = ci.cublas_version;
  out->dnn_version = ci.cudnn_version;
  return KILN_OK;
}

extern "C" const kiln__backend kiln__cuda_backend = {
    "cuda",
    KILN_DEVICE_CUDA,
    false,
    cuda_probe,
    cuda_device_count,
    cuda_alloc,
    cuda_free,
    cuda_copy_to_host,
    cuda_copy_from_host,
    cuda_copy_device,
    cuda_memset_zero,
    cuda_synchronize,
    kiln__cuda_memory_stats,
    kiln__cuda_empty_cache,
    kiln__cuda_set_memory_limit,
    kiln__cuda_reset_peak,
    {
#define KC_ENTRY(name, str) kc_family(KILN__K_##name),
        KILN__KOP_MAP(KC_ENTRY)
#undef KC_ENTRY
    },
    cuda_supports,
    cuda_mark,
    cuda_elapsed_ms,
    &cuda_graph,
    &cuda_async,
    cuda_device_info,
    kiln__cuda_bandwidth,
    100, /* best_rank: kiln_device_best prefers a working CUDA device */
};
