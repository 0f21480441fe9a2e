/*
** A captured step keeps only its data dependencies (cuda_graph.cu captures by stream
** capture; this file turns the stream's chain into a DAG).
**
** Stream capture records one chain: every kernel waits for the one before it, although
** in a training step many do not need to (a layer's weight gradient and its input
** gradient read the same upstream gradient and nothing of each other). In a replay each
** dependent launch costs the latency of a small kernel, so kernels the chain serialises
** for nothing lengthen the step. Here each op dispatched to the CUDA backend during a
** capture declares the bytes it reads (its input views) and writes (its output views,
** the scratch it allocates, the cuBLAS workspace), and before its launches the stream's
** capture dependencies are set to the ops it conflicts with: the last writers of what it
** reads or writes, and the readers since then of what it writes (read-after-write,
** write-after-read, write-after-write on overlapping byte ranges). Ranges are a view's
** hull, so gaps between strided elements count as touched: conservative, never unsafe.
**
** Anything else queued on the stream during the capture (copies through the backend's
** memory table, events, another layer's work on kiln__cuda_stream) is not declared, so
** between ops the stream depends on every leaf of the DAG so far: undeclared work waits
** for all of it, and the next op sees that the stream moved on and makes that work the
** new base every later op waits for. Addresses, not tensors, are tracked, so memory the
** caching allocator hands out again inside the capture is ordered like any other reuse.
**
** KILN_GRAPH_DEPS=0 turns it off (the chain, as captured). Steps of large kernels can
** lose by the overlap this allows: a GPT-2 training step recorded with the DAG ran far
** slower on the H100 than with the chain, which ran as fast as eager (bench/RESULTS.md,
** the twentieth session); measure both before recording such a step.
*/
#include "cuda_int.cuh"

#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <new>
#include <vector>

namespace {

struct Range {
  uintptr_t lo, hi; /* [lo, hi) */
};

struct OpRec {
  std::vector<Range> reads, writes;
  std::vector<cudaGraphNode_t> ends; /* the stream's dependencies after the op: its last nodes */
};

struct Tracker {
  bool on;   /* tracking this device's capture */
  bool open; /* an op is between begin and end */
  std::vector<cudaGraphNode_t> base;     /* what an op with no conflicts waits for */
  std::vector<OpRec> ops;                /* since base */
  std::vector<cudaGraphNode_t> frontier; /* nodes nothing recorded waits for: the stream's dependencies between ops */
  OpRec cur;
  std::vector<cudaGraphNode_t> cur_deps; /* what cur was made to wait for */
};

Tracker g_track[KC_MAX_DEV];

/* ---- the runtime's capture calls (their signatures changed in CUDA 13) ---- */

cudaError_t capture_deps(cudaStream_t s, const cudaGraphNode_t **deps, size_t *n) {
  cudaStreamCaptureStatus status;
#if CUDART_VERSION >= 13000
  cudaError_t e = cudaStreamGetCaptureInfo(s, &status, NULL, NULL, deps, NULL, n);
#else
  cudaError_t e = cudaStreamGetCaptureInfo_v2(s, &status, NULL, NULL, deps, n);
#endif
  if (e == cudaSuccess && status != cudaStreamCaptureStatusActive) return cudaErrorStreamCaptureInvalidated;
  return e;
}

cudaError_t set_deps(cudaStream_t s, std::vector<cudaGraphNode_t> &nodes, unsigned flags) {
#if CUDART_VERSION >= 13000
  return cudaStreamUpdateCaptureDependencies(s, nodes.data(), NULL, nodes.size(), flags);
#else
  return cudaStreamUpdateCaptureDependencies(s, nodes.data(), nodes.size(), flags);
#endif
}

/* ---- ranges ---- */

bool view_range(const kiln__view &v, Range *r) {
  if (!v.data) return false;
  int64_t lo = 0, hi = 0;
  for (int i = 0; i < v.ndim; i++) {
    if (v.shape[i] == 0) return false; /* no elements: touches nothing */
    const int64_t span = (v.shape[i] - 1) * v.strides[i];
    if (span < 0) lo += span;
    else hi += span;
  }
  const int64_t es = (int64_t)kiln_dtype_size(v.dtype);
  r->lo = (uintptr_t)v.data + (uintptr_t)(lo * es);
  r->hi = (uintptr_t)v.data + (uintptr_t)((hi + 1) * es);
  return true;
}

void add_view(std::vector<Range> &to, const kiln__view &v) {
  Range r;
  if (view_range(v, &r)) to.push_back(r);
}

bool overlaps(const std::vector<Range> &a, const Range &r) {
  for (const Range &x : a)
    if (x.lo < r.hi && r.lo < x.hi) return true;
  return false;
}

void add_nodes(std::vector<cudaGraphNode_t> &to, const std::vector<cudaGraphNode_t> &from) {
  for (cudaGraphNode_t n : from)
    if (std::find(to.begin(), to.end(), n) == to.end()) to.push_back(n);
}

/* The ends of the recorded ops that an access of r (a write when `write`) must follow. */
void conflicts(const Tracker &t, const Range &r, bool write, std::vector<cudaGraphNode_t> &deps) {
  for (const OpRec &op : t.ops)
    if (overlaps(op.writes, r) || (write && overlaps(op.reads, r))) add_nodes(deps, op.ends);
}

bool same_set(const cudaGraphNode_t *a, size_t n, const std::vector<cudaGraphNode_t> &b) {
  if (n != b.size()) return false;
  for (size_t i = 0; i < n; i++)
    if (std::find(b.begin(), b.end(), a[i]) == b.end()) return false;
  return true;
}

kiln_status no_memory(void) {
  return kiln_set_error(KILN_ERR_OOM, "kiln: out of host memory tracking a graph capture");
}

kiln_status fail(cudaError_t e, const char *what) {
  char msg[160];
  snprintf(msg, sizeof msg, "%s (graph capture with data dependencies; KILN_GRAPH_DEPS=0 captures one chain)", what);
  return kiln__cuda_err(e, msg);
}

} // namespace

extern "C" void kiln__cuda_capture_track_begin(int device) {
  Tracker &t = g_track[device];
  t.on = kiln__knob_on("KILN_GRAPH_DEPS", true);
  t.open = false;
  t.base.clear(), t.ops.clear(), t.frontier.clear(), t.cur_deps.clear();
}

extern "C" void kiln__cuda_capture_track_end(int device) {
  Tracker &t = g_track[device];
  t.on = t.open = false;
  std::vector<OpRec>().swap(t.ops); /* a capture's records are not kept */
  t.base.clear(), t.frontier.clear(), t.cur_deps.clear();
}

extern "C" bool kiln__cuda_capture_tracking(int device) {
  return device >= 0 && device < KC_MAX_DEV && g_track[device].on;
}

extern "C" kiln_status kiln__cuda_capture_op_begin(const kiln__kargs *a) {
  Tracker &t = g_track[a->device];
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  const cudaGraphNode_t *now;
  size_t n_now;
  cudaError_t e = capture_deps(d->stream, &now, &n_now);
  if (e != cudaSuccess) return fail(e, "cudaStreamGetCaptureInfo");
  try {
    if (!same_set(now, n_now, t.frontier)) { /* work no op declared: everything waits for it */
      t.base.assign(now, now + n_now);
      t.frontier = t.base;
      t.ops.clear();
    }
    t.cur.reads.clear(), t.cur.writes.clear(), t.cur.ends.clear();
    for (int i = 0; i < a->n_in; i++) add_view(t.cur.reads, a->in[i]);
    for (int i = 0; i < a->n_out; i++) add_view(t.cur.writes, a->out[i]);
    for (int i = 0; i < a->list_n * a->list_w; i++) add_view(t.cur.writes, a->list[i]); /* in place */
    t.cur_deps.clear();
    for (const Range &r : t.cur.reads) conflicts(t, r, false, t.cur_deps);
    for (const Range &r : t.cur.writes) conflicts(t, r, true, t.cur_deps);
    /* No conflict: after the base; before any base, after the frontier, so that the
    ** stream's dependencies are never emptied in mid-capture (an op that touches nothing
    ** touched before is a root only at the capture's start or right after undeclared work). */
    if (t.cur_deps.empty()) t.cur_deps = t.base.empty() ? t.frontier : t.base;
  } catch (const std::bad_alloc &) {
    return no_memory();
  }
  if (!same_set(now, n_now, t.cur_deps)) {
    e = set_deps(d->stream, t.cur_deps, cudaStreamSetCaptureDependencies);
    if (e != cudaSuccess) return fail(e, "cudaStreamUpdateCaptureDependencies");
  }
  t.open = true;
  return KILN_OK;
}

extern "C" kiln_status kiln__cuda_capture_note(int device, const void *p, size_t n) {
  if (!kiln__cuda_capture_tracking(device) || !g_track[device].open || !p || n == 0) return KILN_OK;
  Tracker &t = g_track[device];
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  const Range r = {(uintptr_t)p, (uintptr_t)p + n};
  std::vector<cudaGraphNode_t> more;
  try {
    t.cur.writes.push_back(r);
    conflicts(t, r, true, more);
  } catch (const std::bad_alloc &) {
    return no_memory();
  }
  if (more.empty()) return KILN_OK;
  /* added to the stream's current dependencies: the op's launches so far stay before */
  cudaError_t e = set_deps(d->stream, more, cudaStreamAddCaptureDependencies);
  if (e != cudaSuccess) return fail(e, "cudaStreamUpdateCaptureDependencies");
  add_nodes(t.cur_deps, more);
  return KILN_OK;
}

extern "C" kiln_status kiln__cuda_capture_op_end(int device) {
  Tracker &t = g_track[device];
  if (!t.open) return KILN_OK;
  t.open = false;
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  const cudaGraphNode_t *now;
  size_t n_now;
  cudaError_t e = capture_deps(d->stream, &now, &n_now);
  if (e != cudaSuccess) return fail(e, "cudaStreamGetCaptureInfo");
  try {
    t.cur.ends.assign(now, now + n_now);
    /* frontier: less what the op waited for, plus its last nodes */
    std::vector<cudaGraphNode_t> f;
    for (cudaGraphNode_t x : t.frontier)
      if (std::find(t.cur_deps.begin(), t.cur_deps.end(), x) == t.cur_deps.end()) f.push_back(x);
    add_nodes(f, t.cur.ends);
    t.frontier.swap(f);
    t.ops.push_back(t.cur);
  } catch (const std::bad_alloc &) {
    return no_memory();
  }
  /* between ops the stream waits for every leaf: work no op declares is ordered after all */
  if (t.frontier.empty() || same_set(now, n_now, t.frontier)) return KILN_OK;
  e = set_deps(d->stream, t.frontier, cudaStreamSetCaptureDependencies);
  if (e != cudaSuccess) return fail(e, "cudaStreamUpdateCaptureDependencies");
  return KILN_OK;
}
