/*
** CONV2D, CONV2D_BACKWARD_DATA and CONV2D_BACKWARD_WEIGHT on CUDA through cuDNN's legacy
** convolution API (cudnnConvolutionForward / BackwardData / BackwardFilter), built when
** cuDNN is found (KILN_HAVE_CUDNN, cmake/KilnCuda.cmake). Without it, supports() says no
** and the op layer composes IM2COL + MATMUL (cuda_pool.cu, cuBLAS).
**
** - Tensor descriptors take the views' strides, so NCHW and channels-last (NHWC strides)
**   inputs go in as they are; the filter must be packed NCHW or NHWC (cuDNN's filter
**   descriptor has no strides). cuDNN pads symmetrically: arguments whose padding after
**   differs from the padding before ("same" with an even kernel) are not supported here.
** - f32 is exact (CUDNN_FMA_MATH) unless i1 flag 1 allows TF32 (as MATMUL's i0); f16 and
**   bf16 use tensor-op math with f32 accumulation; f64 computes in f64.
** - The algorithm is cuDNN's heuristic (cudnnGet*_v7), or with KILN_CUDNN_BENCHMARK=1 the
**   fastest measured (cudnnFind*Ex, outside a graph capture), cached per arguments
**   (op, dtype, shapes, strides, window, groups, math, pointer alignment): asked once per
**   shape. The cache entry keeps the descriptors too, so a call with a known shape builds
**   nothing: it finds its entry and queues the convolution.
** - Groups-1 convolutions run through cuDNN's backend (graph) API: an execution plan per
**   cache entry (heuristic mode A, the same filters as the
**   legacy choice: no down-conversion, FMA-exact f32 unless TF32 is allowed, deterministic
**   first, no runtime-compiled engines), each call one variant pack and cudnnBackendExecute.
**   A shape the backend API has no plan for takes the legacy path; KILN_CUDNN_API=legacy
**   sends every shape there. Measured on the H200 (fashion-mnist CNN, batch 128, f32):
**   the legacy cudnnConvolutionForward / BackwardData / BackwardFilter cost 66 / 90 / 83 us
**   of host time per call (cuDNN 9 plans inside each legacy call), cudnnBackendExecute of a
**   cached plan with its variant pack 10 us.
** - KILN_CUDNN_LOG=1 prints each choice as it is made; KILN_CUDNN_LOG=2 also times the
**   host side of every call (clock_gettime around each part: the cache lookup, building
**   descriptors and choosing on a miss, the workspace, the cuDNN call, the bias kernel)
**   and prints the means per op at exit.
** - One handle per device on kiln's stream; the workspace comes from the caching
**   allocator for the call and is given back right after it is queued (frees are stream
**   ordered: cuda_memory.cu), so a graph capture sees no cudaMalloc. The handle is made on
**   first use, which must not be inside a capture (as cuBLAS's, cuda_matmul.cu).
** - The bias is added, and its gradient summed, by small kernels here (deterministic, any
**   strides; the gradient's sum in two fixed-order stages, f64 partials).
*/
#include "cuda_int.cuh"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

extern "C" bool kiln__cuda_cudnn_supports(const kiln__kargs *a);
extern "C" kiln_status kiln__cuda_cudnn_conv(const kiln__kargs *a);

#ifndef KILN_HAVE_CUDNN

extern "C" bool kiln__cuda_cudnn_supports(const kiln__kargs *a) {
  (void)a;
  return false;
}
extern "C" kiln_status kiln__cuda_cudnn_conv(const kiln__kargs *a) {
  return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln_%s: kiln was built without cuDNN (KILN_CUDNN)",
                        kiln__kop_name(a->op));
}

#else

#include <cudnn.h>

#include "cuda_cudnn_graph.cuh"

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

std::mutex g_mu; /* handles and the cache */
cudnnHandle_t g_handle[KC_MAX_DEV];

struct Choice {
  int algo;
  cudnnMathType_t math;
  size_t ws;
};

kiln_status dnn_err(cudnnStatus_t s, const char *what) {
  if (s == CUDNN_STATUS_SUCCESS) return KILN_OK;
  kiln_status code = s == CUDNN_STATUS_NOT_SUPPORTED ? KILN_ERR_UNSUPPORTED
                     : s == CUDNN_STATUS_ALLOC_FAILED ? KILN_ERR_OOM
                     : s == CUDNN_STATUS_BAD_PARAM ? KILN_ERR_INVALID_ARGUMENT
                                                   : KILN_ERR_INTERNAL;
  (void)cudaGetLastError();
  return kiln_set_error(code, "kiln: cuDNN error in %s: %s", what, cudnnGetErrorString(s));
}
#define KC_DNN(call, what) KC_TRY(dnn_err((call), (what)))

/* KILN_CUDNN_LOG: 0 (unset) quiet; 1 one line on stderr per choice made (once per shape:
** the cache holds it after), naming the op, the shapes, the layout, how it was chosen and
** what; 2 also the host-time table at exit (host_times below). Any other non-empty value
** counts as 1. */
int log_level() {
  static int level = -1;
  if (level < 0) {
    level = kiln__knob_choice("KILN_CUDNN_LOG", 0);
  }
  return level;
}
bool log_mode() { return log_level() >= 1; }

/* The backend (graph) API for the shapes it takes, unless KILN_CUDNN_API=legacy. */
bool backend_api() {
  static int on = -1;
  if (on < 0) {
    on = kiln__knob_choice("KILN_CUDNN_API", 0) == 0; /* graph, legacy */
  }
  return on == 1;
}

/* KILN_CUDNN_LOG=2: host time of each part of kiln__cuda_cudnn_conv, per op (forward,
** backward data, backward weight), summed in microseconds. Calls that found their cache
** entry ("hits": the steady state of a training loop) and those that built it are kept
** apart, so the table shows what a step pays per call. */
enum { kPartLookup, kPartWorkspace, kPartCall, kPartBias, kPartTotal, kParts };
struct HostTimes {
  int64_t hits = 0, misses = 0;
  double hit_us[kParts] = {0};
  double miss_us = 0; /* whole calls that built an entry (descriptors, choice, plan) */
};
HostTimes g_times[3];
std::mutex g_times_mu;

double now_us() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

void print_host_times() {
  static const char *const names[3] = {"conv2d", "conv2d_backward_data", "conv2d_backward_weight"};
  for (int k = 0; k < 3; k++) {
    const HostTimes &t = g_times[k];
    if (!t.hits && !t.misses) continue;
    double n = t.hits ? (double)t.hits : 1.0;
    fprintf(stderr,
            "kiln cudnn host %s (%s): %lld calls: lookup %.1f ws %.1f call %.1f bias %.1f total %.1f us/call; "
            "%lld misses %.1f ms\n",
            names[k], backend_api() ? "backend" : "legacy", (long long)t.hits, t.hit_us[kPartLookup] / n,
            t.hit_us[kPartWorkspace] / n, t.hit_us[kPartCall] / n, t.hit_us[kPartBias] / n, t.hit_us[kPartTotal] / n,
            (long long)t.misses, t.miss_us * 1e-3);
  }
}

int op_index(kiln__kop op) {
  return op == KILN__K_CONV2D ? 0 : op == KILN__K_CONV2D_BACKWARD_DATA ? 1 : 2;
}

void note_times(kiln__kop op, bool hit, const double *us) {
  static std::once_flag registered;
  std::call_once(registered, [] { atexit(print_host_times); });
  std::lock_guard<std::mutex> lock(g_times_mu);
  HostTimes &t = g_times[op_index(op)];
  if (hit) {
    t.hits++;
    for (int i = 0; i < kParts; i++) t.hit_us[i] += us[i];
  } else {
    t.misses++;
    t.miss_us += us[kPartTotal];
  }
}

bool benchmark_mode() {
  static int on = -1;
  if (on < 0) {
    on = kiln__knob_on("KILN_CUDNN_BENCHMARK", false);
  }
  return on == 1;
}

kiln_status handle_of(int device, kiln__cuda_dev *d, cudnnHandle_t *out) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_handle[device]) {
    if (d->capturing)
      return kiln_set_error(KILN_ERR_STATE, "kiln: the first cuDNN convolution on cuda:%d ran inside a graph "
                                            "capture: run a warm-up step before capturing", device);
    cudnnHandle_t h;
    KC_DNN(cudnnCreate(&h), "cudnnCreate");
    cudnnStatus_t s = cudnnSetStream(h, d->stream);
    if (s != CUDNN_STATUS_SUCCESS) {
      cudnnDestroy(h);
      return dnn_err(s, "cudnnSetStream");
    }
    g_handle[device] = h;
  }
  *out = g_handle[device];
  return KILN_OK;
}

bool dtype_of(kiln_dtype dt, cudnnDataType_t *t) {
  switch (dt) {
  case KILN_F32: *t = CUDNN_DATA_FLOAT; return true;
  case KILN_F64: *t = CUDNN_DATA_DOUBLE; return true;
  case KILN_F16: *t = CUDNN_DATA_HALF; return true;
  case KILN_BF16: *t = CUDNN_DATA_BFLOAT16; return true;
  default: return false;
  }
}

bool packed_nchw(const kiln__view *v) { return kiln__view_is_contiguous(v); }
/* NHWC in memory: strides (H*W*C, 1, W*C, C), size-1 dims free */
bool packed_nhwc(const kiln__view *v) {
  if (v->ndim != 4) return false;
  const int order[4] = {1, 3, 2, 0}; /* fastest first */
  int64_t want = 1;
  for (int k = 0; k < 4; k++) {
    int d = order[k];
    if (v->shape[d] != 1 && v->strides[d] != want) return false;
    want *= v->shape[d];
  }
  return true;
}

/* The three 4-d operands of each op: image x, filter w, output-side y (gradients too). */
struct Operands {
  const kiln__view *x, *w, *y, *bias, *dbias;
};

bool operands(const kiln__kargs *a, Operands *o) {
  memset(o, 0, sizeof *o);
  switch (a->op) {
  case KILN__K_CONV2D:
    if (a->n_in < 2 || a->n_out < 1) return false;
    o->x = &a->in[0], o->w = &a->in[1], o->y = &a->out[0];
    o->bias = a->n_in > 2 ? &a->in[2] : NULL;
    return true;
  case KILN__K_CONV2D_BACKWARD_DATA:
    if (a->n_in < 2 || a->n_out < 1) return false;
    o->y = &a->in[0], o->w = &a->in[1], o->x = &a->out[0];
    return true;
  case KILN__K_CONV2D_BACKWARD_WEIGHT:
    if (a->n_in < 2 || a->n_out < 1) return false;
    o->x = &a->in[0], o->y = &a->in[1], o->w = &a->out[0];
    o->dbias = a->n_out > 1 ? &a->out[1] : NULL;
    return true;
  default: return false;
  }
}

/* The output size cuDNN computes with symmetric padding equals the view's. */
bool symmetric(const kiln__conv_params *p, const Operands &o, int64_t groups) {
  for (int d = 0; d < 2; d++) {
    int64_t in = o.x->shape[2 + d], k = o.w->shape[2 + d];
    if (p->kernel[d] != k || p->stride[d] < 1 || p->dilation[d] < 1 || p->padding[d] < 0) return false;
    int64_t span = p->dilation[d] * (k - 1) + 1;
    if (in + 2 * p->padding[d] < span) return false;
    if ((in + 2 * p->padding[d] - span) / p->stride[d] + 1 != o.y->shape[2 + d]) return false;
  }
  if (o.x->shape[0] != o.y->shape[0] || o.w->shape[0] != o.y->shape[1] || groups < 1 ||
      o.w->shape[1] * groups != o.x->shape[1] || o.y->shape[1] % groups != 0)
    return false;
  return true;
}

bool fits_int(const kiln__view *v) {
  for (int d = 0; d < v->ndim; d++)
    if (v->shape[d] > INT32_MAX || v->strides[d] > INT32_MAX || v->strides[d] < 0) return false;
  return kc_numel(v) < INT32_MAX;
}

struct Descs {
  cudnnTensorDescriptor_t x = NULL, y = NULL;
  cudnnFilterDescriptor_t w = NULL;
  cudnnConvolutionDescriptor_t conv = NULL;
  Descs() = default;
  Descs(const Descs &) = delete;
  Descs &operator=(const Descs &) = delete;
  ~Descs() {
    if (x) cudnnDestroyTensorDescriptor(x);
    if (y) cudnnDestroyTensorDescriptor(y);
    if (w) cudnnDestroyFilterDescriptor(w);
    if (conv) cudnnDestroyConvolutionDescriptor(conv);
  }
};

/* One layout for the three operands (supports() checked each is packed in it): NHWC
** when any is not NCHW-packed (a tensor packed both ways, with C == 1 or H == W == 1,
** follows the others). */
bool nhwc_mode(const Operands &o) { return !packed_nchw(o.x) || !packed_nchw(o.w) || !packed_nchw(o.y); }

/* The packed strides of the layout (those of size-1 dims are free in kiln; cuDNN checks
** them, and infers the layout from them). */
kiln_status tensor_desc(cudnnTensorDescriptor_t t, const kiln__view *v, cudnnDataType_t dt, bool nhwc) {
  int dims[4], st[4];
  const int nchw[4] = {3, 2, 1, 0}, nhwc_order[4] = {1, 3, 2, 0}; /* fastest first */
  const int *order = nhwc ? nhwc_order : nchw;
  int64_t s = 1;
  for (int k = 0; k < 4; k++) {
    int d = order[k];
    dims[d] = (int)v->shape[d];
    st[d] = (int)s;
    s *= v->shape[d] > 0 ? v->shape[d] : 1;
  }
  KC_DNN(cudnnSetTensorNdDescriptor(t, dt, 4, dims, st), "cudnnSetTensorNdDescriptor");
  return KILN_OK;
}

kiln_status make_descs(const kiln__kargs *a, const Operands &o, Descs *ds, cudnnDataType_t dt,
                       cudnnMathType_t *math) {
  const kiln__conv_params *p = (const kiln__conv_params *)a->params;
  KC_DNN(cudnnCreateTensorDescriptor(&ds->x), "cudnnCreateTensorDescriptor");
  KC_DNN(cudnnCreateTensorDescriptor(&ds->y), "cudnnCreateTensorDescriptor");
  KC_DNN(cudnnCreateFilterDescriptor(&ds->w), "cudnnCreateFilterDescriptor");
  KC_DNN(cudnnCreateConvolutionDescriptor(&ds->conv), "cudnnCreateConvolutionDescriptor");
  KC_TRY(tensor_desc(ds->x, o.x, dt, nhwc_mode(o)));
  KC_TRY(tensor_desc(ds->y, o.y, dt, nhwc_mode(o)));
  cudnnTensorFormat_t fmt = nhwc_mode(o) ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW;
  KC_DNN(cudnnSetFilter4dDescriptor(ds->w, dt, fmt, (int)o.w->shape[0], (int)o.w->shape[1], (int)o.w->shape[2],
                                    (int)o.w->shape[3]),
         "cudnnSetFilter4dDescriptor");
  cudnnDataType_t compute = dt == CUDNN_DATA_DOUBLE ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
  KC_DNN(cudnnSetConvolution2dDescriptor(ds->conv, (int)p->padding[0], (int)p->padding[1], (int)p->stride[0],
                                         (int)p->stride[1], (int)p->dilation[0], (int)p->dilation[1],
                                         CUDNN_CROSS_CORRELATION, compute),
         "cudnnSetConvolution2dDescriptor");
  KC_DNN(cudnnSetConvolutionGroupCount(ds->conv, (int)a->i[0]), "cudnnSetConvolutionGroupCount");
  bool tf32 = (a->i[1] & 1) != 0;
  *math = dt == CUDNN_DATA_HALF || dt == CUDNN_DATA_BFLOAT16 ? CUDNN_TENSOR_OP_MATH
          : dt == CUDNN_DATA_FLOAT && !tf32                  ? CUDNN_FMA_MATH
                                                             : CUDNN_DEFAULT_MATH;
  KC_DNN(cudnnSetConvolutionMathType(ds->conv, *math), "cudnnSetConvolutionMathType");
  return KILN_OK;
}

/* The largest power of two up to 16 dividing every operand's address: the backend API's
** plans are made for an alignment (CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT), and a view at an
** odd offset must not reuse a plan made for aligned ones. */
int64_t alignment(const Operands &o) {
  uintptr_t bits = (uintptr_t)o.x->data | (uintptr_t)o.w->data | (uintptr_t)o.y->data | 16;
  return (int64_t)(bits & (~bits + 1));
}

std::string cache_key(const kiln__kargs *a, const Operands &o) {
  std::string k;
  k.reserve(160);
  auto put = [&k](int64_t v) { k.append((const char *)&v, sizeof v); };
  put(a->op), put(a->device), put(o.x->dtype), put(a->i[0]), put(a->i[1] & 3), put(alignment(o));
  const kiln__view *vs[3] = {o.x, o.w, o.y};
  for (const kiln__view *v : vs)
    for (int d = 0; d < 4; d++) put(v->shape[d]), put(v->strides[d]);
  const kiln__conv_params *p = (const kiln__conv_params *)a->params;
  for (int d = 0; d < 2; d++) put(p->stride[d]), put(p->padding[d]), put(p->dilation[d]);
  return k;
}

const size_t kMaxWorkspace = (size_t)1 << 30;

/* One candidate of cuDNN's list, whatever the direction. */
struct Cand {
  int algo;
  cudnnStatus_t status;
  cudnnMathType_t math;
  cudnnDeterminism_t det;
  size_t memory;
};
template <class Perf> int to_cands(const Perf *perf, int n, Cand *out) {
  for (int i = 0; i < n; i++)
    out[i] = Cand{(int)perf[i].algo, perf[i].status, perf[i].mathType, perf[i].determinism, perf[i].memory};
  return n;
}

struct Scratch {
  int device;
  void *p = NULL;
  size_t n = 0;
  ~Scratch() {
    if (p) kiln__cuda_free(device, p, n);
  }
};

kiln_status alloc_ws(int device, size_t n, Scratch *s) {
  s->device = device;
  if (n == 0) return KILN_OK;
  s->p = kiln__cuda_alloc(device, n);
  if (!s->p) return kiln_last_error();
  s->n = n;
  return kiln__cuda_capture_note(device, s->p, n);
}

/* The legacy algorithm for a new cache entry (the descriptors ds made for it). */
kiln_status choose(const kiln__kargs *a, kiln__cuda_dev *d, cudnnHandle_t h, const Operands &o, const Descs &ds,
                   cudnnMathType_t want, Choice *c) {
  enum { kMax = 16 };
  int n = 0;
  c->algo = -1;
  /* cudnnFind* writes the output: not into a sum it must add to (flag 2) */
  bool bench = benchmark_mode() && !d->capturing && !(a->i[1] & 2);
  Scratch ws;
  size_t ws_n = 0;
  if (bench) {
    /* Find*Ex times every algorithm in the workspace given: as much as the limit allows,
    ** less when the allocator cannot have it. */
    for (ws_n = (size_t)256 << 20; ws_n >= ((size_t)1 << 20); ws_n /= 4) {
      if (alloc_ws(a->device, ws_n, &ws) == KILN_OK) break;
      kiln_clear_error();
    }
    if (!ws.p) ws_n = 0;
  }
  Cand cand[kMax];
  switch (a->op) {
  case KILN__K_CONV2D: {
    cudnnConvolutionFwdAlgoPerf_t perf[kMax];
    if (bench)
      KC_DNN(cudnnFindConvolutionForwardAlgorithmEx(h, ds.x, o.x->data, ds.w, o.w->data, ds.conv, ds.y, o.y->data,
                                                    kMax, &n, perf, ws.p, ws_n),
             "cudnnFindConvolutionForwardAlgorithmEx");
    else
      KC_DNN(cudnnGetConvolutionForwardAlgorithm_v7(h, ds.x, ds.w, ds.conv, ds.y, kMax, &n, perf),
             "cudnnGetConvolutionForwardAlgorithm_v7");
    n = to_cands(perf, n, cand);
    break;
  }
  case KILN__K_CONV2D_BACKWARD_DATA: {
    cudnnConvolutionBwdDataAlgoPerf_t perf[kMax];
    if (bench)
      KC_DNN(cudnnFindConvolutionBackwardDataAlgorithmEx(h, ds.w, o.w->data, ds.y, o.y->data, ds.conv, ds.x,
                                                         o.x->data, kMax, &n, perf, ws.p, ws_n),
             "cudnnFindConvolutionBackwardDataAlgorithmEx");
    else
      KC_DNN(cudnnGetConvolutionBackwardDataAlgorithm_v7(h, ds.w, ds.y, ds.conv, ds.x, kMax, &n, perf),
             "cudnnGetConvolutionBackwardDataAlgorithm_v7");
    n = to_cands(perf, n, cand);
    break;
  }
  default: {
    cudnnConvolutionBwdFilterAlgoPerf_t perf[kMax];
    if (bench)
      KC_DNN(cudnnFindConvolutionBackwardFilterAlgorithmEx(h, ds.x, o.x->data, ds.y, o.y->data, ds.conv, ds.w,
                                                           o.w->data, kMax, &n, perf, ws.p, ws_n),
             "cudnnFindConvolutionBackwardFilterAlgorithmEx");
    else
      KC_DNN(cudnnGetConvolutionBackwardFilterAlgorithm_v7(h, ds.x, ds.y, ds.conv, ds.w, kMax, &n, perf),
             "cudnnGetConvolutionBackwardFilterAlgorithm_v7");
    n = to_cands(perf, n, cand);
  }
  }
  /* The first candidate (fastest by heuristic or measurement) that works, keeps the math
  ** contract (exact f32: FMA only; never a down-conversion), is deterministic (DESIGN.md:
  ** same seed, same numbers; some backward algorithms add with atomics) and whose
  ** workspace is reasonable; the workspace size is asked again under the math type that
  ** will be set, which also checks that the algorithm runs with it. */
  for (int pass = 0; pass < 2; pass++) {
    for (int i = 0; i < n; i++) {
      const Cand &k = cand[i];
      if (k.status != CUDNN_STATUS_SUCCESS || k.memory > kMaxWorkspace) continue;
      if (k.math == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) continue;
      if (want == CUDNN_FMA_MATH && k.math == CUDNN_TENSOR_OP_MATH) continue;
      if (pass == 0 && k.det != CUDNN_DETERMINISTIC) continue;
      cudnnMathType_t m = want == CUDNN_FMA_MATH ? CUDNN_FMA_MATH : k.math;
      if (cudnnSetConvolutionMathType(ds.conv, m) != CUDNN_STATUS_SUCCESS) continue;
      size_t exact = 0;
      cudnnStatus_t s;
      if (a->op == KILN__K_CONV2D)
        s = cudnnGetConvolutionForwardWorkspaceSize(h, ds.x, ds.w, ds.conv, ds.y, (cudnnConvolutionFwdAlgo_t)k.algo,
                                                    &exact);
      else if (a->op == KILN__K_CONV2D_BACKWARD_DATA)
        s = cudnnGetConvolutionBackwardDataWorkspaceSize(h, ds.w, ds.y, ds.conv, ds.x,
                                                         (cudnnConvolutionBwdDataAlgo_t)k.algo, &exact);
      else
        s = cudnnGetConvolutionBackwardFilterWorkspaceSize(h, ds.x, ds.y, ds.conv, ds.w,
                                                           (cudnnConvolutionBwdFilterAlgo_t)k.algo, &exact);
      if (s != CUDNN_STATUS_SUCCESS || exact > kMaxWorkspace) continue;
      c->algo = k.algo;
      c->math = m;
      c->ws = exact > k.memory ? exact : k.memory;
      pass = 2;
      break;
    }
  }
  if (!(c->algo >= 0))
    return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln_%s: cuDNN offers no algorithm for these arguments (%d tried)",
                          kiln__kop_name(a->op), n);
  if (log_mode()) {
    const kiln__view *vs[3] = {o.x, o.w, o.y};
    char sh[3][64];
    for (int i = 0; i < 3; i++)
      snprintf(sh[i], sizeof sh[i], "[%lld,%lld,%lld,%lld]", (long long)vs[i]->shape[0], (long long)vs[i]->shape[1],
               (long long)vs[i]->shape[2], (long long)vs[i]->shape[3]);
    const kiln__conv_params *p = (const kiln__conv_params *)a->params;
    fprintf(stderr,
            "kiln cudnn: %s %s x%s w%s y%s stride %lld pad %lld groups %lld %s: algo %d (%s of %d), math %s, "
            "workspace %zu B\n",
            kiln__kop_name(a->op), kiln_dtype_name(o.x->dtype), sh[0], sh[1], sh[2], (long long)p->stride[0],
            (long long)p->padding[0], (long long)a->i[0], nhwc_mode(o) ? "NHWC" : "NCHW", c->algo,
            bench ? "cudnnFind" : "heuristic", n,
            c->math == CUDNN_TENSOR_OP_MATH ? "tensor-op" : c->math == CUDNN_FMA_MATH ? "fma" : "default", c->ws);
  }
  return KILN_OK;
}

/* ---- the backend (graph) API: one execution plan per cache entry ---------------------- */

/* uids of the three operands in the plans and variant packs */
enum : int64_t { kUidX = 1, kUidW = 2, kUidY = 3 };

/* A finalized tensor descriptor: v's shape, packed in the layout (NCHW or NHWC; the filter
** too, as (K, C, R, S) dims), uid, alignment. */
cudnnStatus_t b_tensor(CudnnPlan *p, const kiln__view *v, cudnnDataType_t dt, bool nhwc, int64_t uid, int64_t align,
                       cudnnBackendDescriptor_t *out) {
  int64_t dims[4], st[4];
  const int nchw[4] = {3, 2, 1, 0}, nhwc_order[4] = {1, 3, 2, 0}; /* fastest first */
  const int *order = nhwc ? nhwc_order : nchw;
  int64_t s = 1;
  for (int k = 0; k < 4; k++) {
    int d = order[k];
    dims[d] = v->shape[d];
    st[d] = s;
    s *= v->shape[d] > 0 ? v->shape[d] : 1;
  }
  return cudnn_tensor(p, uid, dt, dims, st, false, false, align, out);
}

/* Whether an engine may run these arguments (ctx: whether f32 must stay exact): its notes
** known, never
** down-converting the inputs or reducing in lower precision (the legacy path's contract:
** f16/bf16 accumulate in f32), no TF32 for f32 unless allowed, not compiled at run time
** (NVRTC at plan time costs seconds and a library kiln does not link). */
bool b_engine_ok(const CudnnEngineNotes &e, const void *ctx) {
  const bool f32_exact = *(const bool *)ctx;
  return e.known && !e.lower_prec && !(f32_exact && e.tensor_core) && !e.compiled;
}

/* Builds p's execution plan for a's convolution (groups 1: the backend API reads groups
** from the filter's channels, which this path does not rely on). CUDNN_STATUS_NOT_SUPPORTED
** when no engine passes the filters. */
cudnnStatus_t b_build(const kiln__kargs *a, const Operands &o, cudnnHandle_t h, cudnnDataType_t dt, CudnnPlan *p) {
  const kiln__conv_params *cp = (const kiln__conv_params *)a->params;
  bool nhwc = nhwc_mode(o);
  int64_t align = alignment(o);
  cudnnBackendDescriptor_t tx, tw, ty, conv, op;
  KB_TRY(b_tensor(p, o.x, dt, nhwc, kUidX, align, &tx));
  KB_TRY(b_tensor(p, o.w, dt, nhwc, kUidW, align, &tw));
  KB_TRY(b_tensor(p, o.y, dt, nhwc, kUidY, align, &ty));

  cudnnDataType_t compute = dt == CUDNN_DATA_DOUBLE ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
  cudnnConvolutionMode_t mode = CUDNN_CROSS_CORRELATION;
  int64_t nsp = 2, pad[2] = {cp->padding[0], cp->padding[1]}, str[2] = {cp->stride[0], cp->stride[1]},
          dil[2] = {cp->dilation[0], cp->dilation[1]};
  KB_TRY(p->make(CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR, &conv));
  KB_TRY(cudnnBackendSetAttribute(conv, CUDNN_ATTR_CONVOLUTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &compute));
  KB_TRY(cudnnBackendSetAttribute(conv, CUDNN_ATTR_CONVOLUTION_CONV_MODE, CUDNN_TYPE_CONVOLUTION_MODE, 1, &mode));
  KB_TRY(cudnnBackendSetAttribute(conv, CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, CUDNN_TYPE_INT64, 1, &nsp));
  KB_TRY(cudnnBackendSetAttribute(conv, CUDNN_ATTR_CONVOLUTION_DILATIONS, CUDNN_TYPE_INT64, 2, dil));
  KB_TRY(cudnnBackendSetAttribute(conv, CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, CUDNN_TYPE_INT64, 2, str));
  KB_TRY(cudnnBackendSetAttribute(conv, CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, CUDNN_TYPE_INT64, 2, pad));
  KB_TRY(cudnnBackendSetAttribute(conv, CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, CUDNN_TYPE_INT64, 2, pad));
  KB_TRY(cudnnBackendFinalize(conv));

  /* alpha 1, beta 0: the output is overwritten, as the legacy calls do; beta 1 where i1
  ** flag 2 says the result is added (CONV2D_BACKWARD_DATA_ACC) */
  float f1 = 1.0f, f0 = 0.0f;
  double d1 = 1.0, d0 = 0.0;
  cudnnBackendAttributeType_t st = compute == CUDNN_DATA_DOUBLE ? CUDNN_TYPE_DOUBLE : CUDNN_TYPE_FLOAT;
  const void *one = compute == CUDNN_DATA_DOUBLE ? (const void *)&d1 : (const void *)&f1;
  const void *zero = compute == CUDNN_DATA_DOUBLE ? (const void *)&d0 : (const void *)&f0;
  cudnnBackendDescriptorType_t ot;
  cudnnBackendAttributeName_t ax, aw, ay, ac, aa, ab;
  switch (a->op) {
  case KILN__K_CONV2D:
    ot = CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR;
    ax = CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, aw = CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W;
    ay = CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, ac = CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC;
    aa = CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA, ab = CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA;
    break;
  case KILN__K_CONV2D_BACKWARD_DATA:
    ot = CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_DATA_DESCRIPTOR;
    ax = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DX, aw = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_W;
    ay = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_DY, ac = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_CONV_DESC;
    aa = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_ALPHA, ab = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_DATA_BETA;
    break;
  default:
    ot = CUDNN_BACKEND_OPERATION_CONVOLUTION_BACKWARD_FILTER_DESCRIPTOR;
    ax = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_X, aw = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DW;
    ay = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_DY, ac = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_CONV_DESC;
    aa = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_ALPHA, ab = CUDNN_ATTR_OPERATION_CONVOLUTION_BWD_FILTER_BETA;
  }
  KB_TRY(p->make(ot, &op));
  KB_TRY(cudnnBackendSetAttribute(op, ax, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &tx));
  KB_TRY(cudnnBackendSetAttribute(op, aw, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &tw));
  KB_TRY(cudnnBackendSetAttribute(op, ay, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &ty));
  KB_TRY(cudnnBackendSetAttribute(op, ac, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &conv));
  KB_TRY(cudnnBackendSetAttribute(op, aa, st, 1, one));
  KB_TRY(cudnnBackendSetAttribute(op, ab, st, 1, (a->i[1] & 2) ? one : zero));
  KB_TRY(cudnnBackendFinalize(op));

  /* heuristic order (mode A); deterministic engines first (DESIGN.md: same seed, same
  ** numbers), any engine when none is */
  static const cudnnBackendHeurMode_t modes[1] = {CUDNN_HEUR_MODE_A};
  const bool f32_exact = dt == CUDNN_DATA_FLOAT && (a->i[1] & 1) == 0;
  CudnnPlanRule rule = {modes, 1, 16, (int64_t)kMaxWorkspace, true, b_engine_ok, &f32_exact};
  return cudnn_choose_plan(h, p, &op, 1, rule);
}

/* One cache entry: the legacy descriptors and choice, and the backend plan when asked for
** (and one could be made). Never dropped: a process meets few shapes. */
struct Entry {
  Descs ds;
  Choice c = {-1, CUDNN_DEFAULT_MATH, 0}; /* the legacy choice (unused when bp serves) */
  std::unique_ptr<CudnnPlan> bp; /* NULL: the legacy path */
};
std::unordered_map<std::string, std::unique_ptr<Entry>> g_cache;

/* Builds the entry of key for a: the backend plan, else the descriptors and the legacy
** choice (cuDNN 9's legacy heuristics cost tens of ms per shape: not asked when a plan
** serves it). */
kiln_status build_entry(const kiln__kargs *a, kiln__cuda_dev *d, cudnnHandle_t h, const Operands &o,
                        cudnnDataType_t dt, Entry *e) {
  /* the backend plan: groups 1, heuristic choice (KILN_CUDNN_BENCHMARK keeps the legacy
  ** path, whose measured choice it is), never built inside a capture */
  if (backend_api() && a->i[0] == 1 && !benchmark_mode() && !d->capturing) {
    std::unique_ptr<CudnnPlan> bp(new CudnnPlan);
    cudnnStatus_t s = b_build(a, o, h, dt, bp.get());
    (void)cudaGetLastError();
    if (s == CUDNN_STATUS_SUCCESS) e->bp = std::move(bp);
    if (log_mode())
      fprintf(stderr, "kiln cudnn: %s %s: backend API %s (engine %lld, workspace %lld B)\n", kiln__kop_name(a->op),
              kiln_dtype_name(o.x->dtype), s == CUDNN_STATUS_SUCCESS ? "plan" : cudnnGetErrorString(s),
              (long long)(e->bp ? e->bp->engine : -1), (long long)(e->bp ? e->bp->ws : 0));
  }
  if (e->bp) return KILN_OK;
  cudnnMathType_t want;
  KC_TRY(make_descs(a, o, &e->ds, dt, &want));
  KC_TRY(choose(a, d, h, o, e->ds, want, &e->c));
  KC_DNN(cudnnSetConvolutionMathType(e->ds.conv, e->c.math), "cudnnSetConvolutionMathType");
  return KILN_OK;
}

/* The entry for a's arguments, built on the first call with them. */
kiln_status entry_of(const kiln__kargs *a, kiln__cuda_dev *d, cudnnHandle_t h, const Operands &o, cudnnDataType_t dt,
                     Entry **out, bool *hit) {
  std::string key = cache_key(a, o);
  {
    std::lock_guard<std::mutex> lock(g_mu);
    auto it = g_cache.find(key);
    if (it != g_cache.end()) {
      *out = it->second.get();
      *hit = true;
      return KILN_OK;
    }
  }
  *hit = false;
  std::unique_ptr<Entry> e(new Entry);
  KC_TRY(build_entry(a, d, h, o, dt, e.get()));
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_cache.find(key); /* another thread may have made it meanwhile: keep that one */
  if (it == g_cache.end()) it = g_cache.emplace(std::move(key), std::move(e)).first;
  *out = it->second.get();
  return KILN_OK;
}

/* y[n, c, h, w] += bias[c] */
template <class T>
__global__ void __launch_bounds__(KC_THREADS) bias_add_kernel(T *y, const T *b, int64_t bs, int64_t C, int64_t H,
                                                              int64_t W, int64_t s0, int64_t s1, int64_t s2,
                                                              int64_t s3, int64_t total) {
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = k;
    int64_t w = r % W; r /= W;
    int64_t h = r % H; r /= H;
    int64_t c = r % C;
    int64_t n = r / C;
    T *p = y + n * s0 + c * s1 + h * s2 + w * s3;
    *p = kc_st<T>(kc_ld<T>(*p) + kc_ld<T>(b[c * bs]));
  }
}

/* The bias kernels when every offset fits in 32 bits (every real case): blockIdx.y walks
** the (n, c) planes, so the channel comes from the grid and no thread divides by 64-bit
** numbers (the kernel above decodes every element with three 64-bit divisions). */
struct BiasG {
  int C, W, HW, planes, s[4], bs;
  bool dense; /* each plane's (h, w) contiguous: offset hw */
};

template <class T> __global__ void __launch_bounds__(KC_THREADS) bias_add32(T *y, const T *b, BiasG g) {
  for (int pl = blockIdx.y; pl < g.planes; pl += gridDim.y) {
    const int n = pl / g.C, c = pl - n * g.C;
    T *yp = y + n * g.s[0] + c * g.s[1];
    const typename kc_traits<T>::acc bv = kc_ld<T>(b[c * g.bs]);
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < g.HW; k += gridDim.x * blockDim.x) {
      T *p = yp + (g.dense ? k : (k / g.W) * g.s[2] + (k % g.W) * g.s[3]);
      *p = kc_st<T>(kc_ld<T>(*p) + bv);
    }
  }
}

/* db[c] = sum over (n, h, w) of g[n, c, h, w], first stage: block (c, image range s) sums
** its range (threads strided over it, then the threads in a fixed tree), one f64 partial
** each. Two stages, not one block per channel: a network's last conv layers have few
** channels (64 at fashion-mnist's 128x64x11x11: 64 blocks on 132 SMs, 26 us). The ranges
** depend on the shapes only, so the sums' order is the same on every device. */
template <class T>
__global__ void __launch_bounds__(KC_THREADS) bias_grad_part(const T *g, double *part, BiasG b, int N, int nper,
                                                             int chunks) {
  __shared__ double red[KC_THREADS];
  const int c = blockIdx.x, s = blockIdx.y, n0 = s * nper, n1 = min(N, n0 + nper);
  const int work = (n1 - n0) * b.HW;
  double acc = 0;
  for (int k = threadIdx.x; k < work; k += blockDim.x) {
    const int nn = k / b.HW, hw = k - nn * b.HW;
    const T *gp = g + (n0 + nn) * b.s[0] + c * b.s[1];
    acc += (double)kc_ld<T>(gp[b.dense ? hw : (hw / b.W) * b.s[2] + (hw % b.W) * b.s[3]]);
  }
  red[threadIdx.x] = acc;
  __syncthreads();
  for (int h = KC_THREADS / 2; h > 0; h >>= 1) {
    if ((int)threadIdx.x < h) red[threadIdx.x] += red[threadIdx.x + h];
    __syncthreads();
  }
  if (threadIdx.x == 0) part[c * chunks + s] = red[0];
}

/* second stage: one thread per channel, the ranges in order */
template <class T> __global__ void bias_grad_finish(const double *part, T *db, int dbs, int C, int chunks) {
  for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += gridDim.x * blockDim.x) {
    double v = 0;
    for (int s = 0; s < chunks; s++) v += part[c * chunks + s];
    db[c * dbs] = kc_st<T>((typename kc_traits<T>::acc)v);
  }
}

/* db[c] = sum over (n, h, w) of g[n, c, h, w]: one block per channel, a fixed order. */
template <class T>
__global__ void __launch_bounds__(KC_THREADS) bias_grad_kernel(const T *g, T *db, int64_t dbs, int64_t N, int64_t H,
                                                               int64_t W, int64_t s0, int64_t s1, int64_t s2,
                                                               int64_t s3) {
  typedef typename kc_traits<T>::acc A;
  __shared__ A part[KC_THREADS];
  int64_t c = blockIdx.x, per = N * H * W;
  A acc = 0;
  for (int64_t k = threadIdx.x; k < per; k += blockDim.x) {
    int64_t w = k % W, h = (k / W) % H, n = k / (W * H);
    acc += kc_ld<T>(g[n * s0 + c * s1 + h * s2 + w * s3]);
  }
  part[threadIdx.x] = acc;
  __syncthreads();
  for (int s = KC_THREADS / 2; s > 0; s >>= 1) {
    if ((int)threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) db[c * dbs] = kc_st<T>(part[0]);
}

/* The 32-bit geometry of y (and the bias's stride), or false where an offset could pass
** 2^30 (then the 64-bit kernels). */
bool bias_geom(const kiln__view *y, const kiln__view *b, BiasG *g) {
  int64_t span = 0;
  for (int d = 0; d < 4; d++) {
    if (y->strides[d] < 0) return false;
    span += (y->shape[d] - 1) * y->strides[d];
  }
  int64_t HW = y->shape[2] * y->shape[3], planes = y->shape[0] * y->shape[1];
  if (span >= (1 << 30) || HW * y->shape[0] >= (1 << 30) || planes >= (1 << 30) || b->strides[0] < 0 ||
      (b->shape[0] - 1) * b->strides[0] >= (1 << 30))
    return false;
  g->C = (int)y->shape[1], g->W = (int)y->shape[3], g->HW = (int)HW, g->planes = (int)planes;
  for (int d = 0; d < 4; d++) g->s[d] = (int)y->strides[d];
  g->bs = (int)b->strides[0];
  g->dense = y->strides[3] == 1 && (y->shape[2] == 1 || y->strides[2] == y->shape[3]);
  return true;
}

template <class T> kiln_status bias_add(kiln__cuda_dev *d, const kiln__view *y, const kiln__view *b) {
  int64_t total = kc_numel(y);
  if (total == 0) return KILN_OK;
  BiasG g;
  if (bias_geom(y, b, &g)) {
    int bx = (g.HW + KC_THREADS - 1) / KC_THREADS;
    dim3 grid((unsigned)bx, (unsigned)(g.planes < 65535 ? g.planes : 65535));
    bias_add32<T><<<grid, KC_THREADS, 0, d->stream>>>((T *)y->data, (const T *)b->data, g);
    return kiln__cuda_launched("conv2d (bias)");
  }
  bias_add_kernel<T><<<kc_blocks(total, KC_THREADS, d->sm_count), KC_THREADS, 0, d->stream>>>(
      (T *)y->data, (const T *)b->data, b->strides[0], y->shape[1], y->shape[2], y->shape[3], y->strides[0],
      y->strides[1], y->strides[2], y->strides[3], total);
  return kiln__cuda_launched("conv2d (bias)");
}

template <class T> kiln_status bias_grad(kiln__cuda_dev *d, const kiln__view *g, const kiln__view *db, int device) {
  int64_t C = g->shape[1];
  if (C == 0) return KILN_OK;
  BiasG bg;
  if (kc_numel(g) > 0 && C <= 65535 && bias_geom(g, db, &bg)) {
    int N = (int)g->shape[0];
    /* about 512 blocks in all, at least 2048 elements each (and one image) */
    int64_t chunks = 512 / C, most = (int64_t)N * bg.HW / 2048;
    if (chunks > most) chunks = most;
    if (chunks > N) chunks = N;
    if (chunks < 1) chunks = 1;
    int nper = (int)((N + chunks - 1) / chunks);
    chunks = (N + nper - 1) / nper;
    size_t pn = (size_t)C * chunks * sizeof(double);
    double *part = (double *)kiln__cuda_alloc(device, pn);
    if (!part) return kiln_last_error();
    kiln_status st = kiln__cuda_capture_note(device, part, pn);
    if (st == KILN_OK) {
      dim3 grid((unsigned)C, (unsigned)chunks);
      bias_grad_part<T><<<grid, KC_THREADS, 0, d->stream>>>((const T *)g->data, part, bg, N, nper, (int)chunks);
      st = kiln__cuda_launched("conv2d_backward_weight (bias, partial sums)");
    }
    if (st == KILN_OK) {
      bias_grad_finish<T><<<(unsigned)((C + 127) / 128), 128, 0, d->stream>>>(part, (T *)db->data, bg.bs, (int)C,
                                                                              (int)chunks);
      st = kiln__cuda_launched("conv2d_backward_weight (bias)");
    }
    kiln__cuda_free(device, part, pn); /* stream ordered: the kernels queued above still see it */
    return st;
  }
  bias_grad_kernel<T><<<(unsigned)C, KC_THREADS, 0, d->stream>>>((const T *)g->data, (T *)db->data, db->strides[0],
                                                                 g->shape[0], g->shape[2], g->shape[3], g->strides[0],
                                                                 g->strides[1], g->strides[2], g->strides[3]);
  return kiln__cuda_launched("conv2d_backward_weight (bias)");
}

/* CONV2D_BACKWARD_DATA_ACC is CONV2D_BACKWARD_DATA adding into its output: from here on
** that op with i1 flag 2 (beta 1; the cache keys it apart: a plan has its beta built in). */
kiln__kargs as_data(const kiln__kargs *a) {
  kiln__kargs b = *a;
  if (b.op == KILN__K_CONV2D_BACKWARD_DATA_ACC) b.op = KILN__K_CONV2D_BACKWARD_DATA, b.i[1] |= 2;
  else b.i[1] &= ~(int64_t)2;
  return b;
}

} // namespace

extern "C" bool kiln__cuda_cudnn_supports(const kiln__kargs *a0) {
  const kiln__kargs ka = as_data(a0), *a = &ka;
  Operands o;
  if (!a->params || !operands(a, &o)) return false;
  cudnnDataType_t dt;
  if (!dtype_of(o.x->dtype, &dt) || o.w->dtype != o.x->dtype || o.y->dtype != o.x->dtype) return false;
  const kiln__view *vs[3] = {o.x, o.w, o.y};
  for (const kiln__view *v : vs)
    if (v->ndim != 4 || !fits_int(v)) return false;
  /* one layout for all three; f64 NCHW only (cuDNN's double kernels are NCHW ones) */
  bool nhwc = nhwc_mode(o);
  for (const kiln__view *v : vs)
    if (nhwc ? !packed_nhwc(v) || o.x->dtype == KILN_F64 : !packed_nchw(v)) return false;
  if (!symmetric((const kiln__conv_params *)a->params, o, a->i[0])) return false;
  const kiln__view *b = o.bias ? o.bias : o.dbias;
  if (b && (b->ndim != 1 || b->shape[0] != o.y->shape[1] || b->dtype != o.x->dtype)) return false;
  return true;
}

extern "C" kiln_status kiln__cuda_cudnn_conv(const kiln__kargs *a0) {
  const kiln__kargs ka = as_data(a0), *a = &ka;
  const bool add = (a->i[1] & 2) != 0; /* CONV2D_BACKWARD_DATA_ACC */
  if (!kiln__cuda_cudnn_supports(a0))
    return kiln_set_error(KILN_ERR_UNSUPPORTED,
                          "kiln_%s: cuDNN does not take these arguments (dtype %s; views must be packed NCHW or "
                          "NHWC, padding symmetric)",
                          kiln__kop_name(a->op), kiln_dtype_name(a->in[0].dtype));
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  Operands o;
  operands(a, &o);
  if (a->op == KILN__K_CONV2D_BACKWARD_WEIGHT && o.dbias) {
    KC_SWITCH_FLOAT(o.x->dtype, T, return KILN_ERR_DTYPE, KC_TRY(bias_grad<T>(d, o.y, o.dbias, a->device)));
  }
  /* empty: nothing to compute, but the written tensor must still be defined */
  if (kc_numel(o.x) == 0 || kc_numel(o.y) == 0 || kc_numel(o.w) == 0) {
    const kiln__view *out = &a->out[0];
    if (kc_numel(out) == 0 || add) return KILN_OK; /* adding zero */
    KC_TRY(kiln__cuda_fill_view(a->device, out, 0.0));
    if (a->op == KILN__K_CONV2D && o.bias) {
      KC_SWITCH_FLOAT(o.x->dtype, T, return KILN_ERR_DTYPE, KC_TRY(bias_add<T>(d, o.y, o.bias)));
    }
    return KILN_OK;
  }
  cudnnHandle_t h;
  KC_TRY(handle_of(a->device, d, &h));
  cudnnDataType_t dt;
  dtype_of(o.x->dtype, &dt);
  const bool timed = log_level() >= 2;
  double us[kParts] = {0}, t0 = timed ? now_us() : 0, t1 = 0;
  Entry *e;
  bool hit;
  KC_TRY(entry_of(a, d, h, o, dt, &e, &hit));
  if (timed) t1 = now_us(), us[kPartLookup] = t1 - t0;
  const Descs &ds = e->ds;
  const Choice &c = e->c;
  Scratch ws;
  KC_TRY(alloc_ws(a->device, e->bp ? (size_t)e->bp->ws : c.ws, &ws));
  double t2 = timed ? now_us() : 0;
  if (timed) us[kPartWorkspace] = t2 - t1;
  if (e->bp) {
    /* the plan knows the shapes; the call names the memory */
    void *ptrs[3] = {o.x->data, o.w->data, o.y->data};
    int64_t uids[3] = {kUidX, kUidW, kUidY};
    cudnnStatus_t s = cudnn_execute(h, e->bp->plan, 3, uids, ptrs, ws.p);
    KC_DNN(s, "cudnnBackendExecute");
  } else {
    float f1 = 1.0f, f0 = 0.0f;
    double d1 = 1.0, d0 = 0.0;
    const void *one = dt == CUDNN_DATA_DOUBLE ? (const void *)&d1 : (const void *)&f1;
    const void *zero = dt == CUDNN_DATA_DOUBLE ? (const void *)&d0 : (const void *)&f0;
    const void *beta = add ? one : zero;
    switch (a->op) {
    case KILN__K_CONV2D:
      KC_DNN(cudnnConvolutionForward(h, one, ds.x, o.x->data, ds.w, o.w->data, ds.conv,
                                     (cudnnConvolutionFwdAlgo_t)c.algo, ws.p, c.ws, zero, ds.y, o.y->data),
             "cudnnConvolutionForward");
      break;
    case KILN__K_CONV2D_BACKWARD_DATA:
      KC_DNN(cudnnConvolutionBackwardData(h, one, ds.w, o.w->data, ds.y, o.y->data, ds.conv,
                                          (cudnnConvolutionBwdDataAlgo_t)c.algo, ws.p, c.ws, beta, ds.x, o.x->data),
             "cudnnConvolutionBackwardData");
      break;
    default:
      KC_DNN(cudnnConvolutionBackwardFilter(h, one, ds.x, o.x->data, ds.y, o.y->data, ds.conv,
                                            (cudnnConvolutionBwdFilterAlgo_t)c.algo, ws.p, c.ws, zero, ds.w,
                                            o.w->data),
             "cudnnConvolutionBackwardFilter");
    }
  }
  double t3 = timed ? now_us() : 0;
  if (timed) us[kPartCall] = t3 - t2;
  if (a->op == KILN__K_CONV2D && o.bias) {
    KC_SWITCH_FLOAT(o.x->dtype, T, return KILN_ERR_DTYPE, KC_TRY(bias_add<T>(d, o.y, o.bias)));
  }
  kiln_status st = kiln__cuda_launched(kiln__kop_name(a->op));
  if (timed) {
    double t4 = now_us();
    us[kPartBias] = t4 - t3, us[kPartTotal] = t4 - t0;
    note_times(a->op, hit, us);
  }
  return st;
}

#endif /* KILN_HAVE_CUDNN */
