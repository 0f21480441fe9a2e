/*
** CUDA graphs by stream capture: a training step recorded once and replayed with one
** launch, which removes the per-kernel launch overhead that makes small models slower on
** the GPU than they should be (DESIGN.md). The capture mode is ThreadLocal, so other
** threads may go on using CUDA (but not this device's stream) meanwhile.
**
** The caching allocator is told about the capture (cuda_memory.cu): it serves only cached
** memory while capturing, and keeps the blocks the graph uses until the graph is freed.
*/
#include "cuda_int.cuh"

#include <atomic>
#include <new>

namespace {

struct Graph {
  int device;
  int id;
  cudaGraphExec_t exec;
};

std::atomic<int> g_next_id{1};
int g_capture_id[KC_MAX_DEV];

} // namespace

extern "C" kiln_status kiln__cuda_graph_begin(int device) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  if (d->capturing)
    return kiln_set_error(KILN_ERR_STATE, "kiln: a graph capture is already open on cuda:%d",
                          device);
  int id = g_next_id.fetch_add(1);
  g_capture_id[device] = id;
  kiln__cuda_mem_capture_begin(device, id);
  d->capturing = 1;
  cudaError_t e = cudaStreamBeginCapture(d->stream, cudaStreamCaptureModeThreadLocal);
  if (e != cudaSuccess) {
    d->capturing = 0;
    kiln__cuda_mem_capture_end(device, id, false);
    return kiln__cuda_err(e, "cudaStreamBeginCapture");
  }
  return KILN_OK;
}

extern "C" kiln_status kiln__cuda_graph_end(int device, void **graph_exec) {
  *graph_exec = NULL;
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  if (!d->capturing)
    return kiln_set_error(KILN_ERR_STATE, "kiln: no graph capture is open on cuda:%d", device);
  int id = g_capture_id[device];
  cudaGraph_t graph = NULL;
  cudaError_t e = cudaStreamEndCapture(d->stream, &graph);
  d->capturing = 0;
  if (e != cudaSuccess) {
    kiln__cuda_mem_capture_end(device, id, false);
    if (graph) cudaGraphDestroy(graph);
    return kiln__cuda_err(e, "cudaStreamEndCapture (an operation in the step cannot be "
                             "captured)");
  }
  cudaGraphExec_t exec = NULL;
  e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (e != cudaSuccess) {
    kiln__cuda_mem_capture_end(device, id, false);
    return kiln__cuda_err(e, "cudaGraphInstantiate");
  }
  Graph *g = new (std::nothrow) Graph{device, id, exec};
  if (!g) {
    cudaGraphExecDestroy(exec);
    kiln__cuda_mem_capture_end(device, id, false);
    return kiln_set_error(KILN_ERR_OOM, "kiln: out of host memory for a graph");
  }
  kiln__cuda_mem_capture_end(device, id, true);
  *graph_exec = g;
  return KILN_OK;
}

extern "C" kiln_status kiln__cuda_graph_launch(int device, void *graph_exec) {
  Graph *g = (Graph *)graph_exec;
  if (!g)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln: graph launch of a NULL graph");
  if (g->device != device)
    return kiln_set_error(KILN_ERR_DEVICE, "kiln: a graph captured on cuda:%d launched on cuda:%d",
                          g->device, device);
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  if (d->capturing)
    return kiln_set_error(KILN_ERR_STATE, "kiln: graph launch inside a capture on cuda:%d", device);
  KC_CUDA(cudaGraphLaunch(g->exec, d->stream), "cudaGraphLaunch");
  return KILN_OK;
}

extern "C" void kiln__cuda_graph_free(void *graph_exec) {
  Graph *g = (Graph *)graph_exec;
  if (!g) return;
  kiln__cuda_dev *d;
  if (kiln__cuda_ctx(g->device, &d) == KILN_OK) {
    /* Launches already queued keep the executable alive (CUDA defers the destruction), and
    ** the blocks go back to the pools for work queued after them on the same stream. */
    (void)cudaGraphExecDestroy(g->exec);
    kiln__cuda_mem_graph_release(g->device, g->id);
  }
  delete g;
}
