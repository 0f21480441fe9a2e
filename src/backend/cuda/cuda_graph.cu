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
#include <unordered_map>
#include <vector>

namespace {

struct Graph {
  int device;
  int id;
  cudaGraphExec_t exec;
  int nodes, depth; /* the captured graph's nodes, and the most of them on one path */
};

/* Nodes, and the longest chain of dependent nodes (what a replay waits for in turn), empty
** nodes not counted. */
void graph_shape(cudaGraph_t g, int *nodes, int *depth) {
  *nodes = *depth = -1;
  size_t n = 0, ne = 0;
#if CUDART_VERSION >= 13000
  if (cudaGraphGetNodes(g, NULL, &n) != cudaSuccess || cudaGraphGetEdges(g, NULL, NULL, NULL, &ne) != cudaSuccess) {
#else
  if (cudaGraphGetNodes(g, NULL, &n) != cudaSuccess || cudaGraphGetEdges(g, NULL, NULL, &ne) != cudaSuccess) {
#endif
    (void)cudaGetLastError();
    return;
  }
  try {
    std::vector<cudaGraphNode_t> all(n), from(ne), to(ne);
#if CUDART_VERSION >= 13000
    cudaError_t e = cudaGraphGetEdges(g, from.data(), to.data(), NULL, &ne);
#else
    cudaError_t e = cudaGraphGetEdges(g, from.data(), to.data(), &ne);
#endif
    if (cudaGraphGetNodes(g, all.data(), &n) != cudaSuccess || e != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    /* longest path, nodes taken in a topological order (Kahn) */
    std::unordered_map<cudaGraphNode_t, int> idx;
    for (size_t i = 0; i < n; i++) idx[all[i]] = (int)i;
    std::vector<std::vector<int>> out(n);
    /* an empty node is no work: it does not count */
    std::vector<int> indeg(n, 0), weight(n, 1), len(n), ready;
    for (size_t i = 0; i < n; i++) {
      cudaGraphNodeType type;
      if (cudaGraphNodeGetType(all[i], &type) == cudaSuccess && type == cudaGraphNodeTypeEmpty) weight[i] = 0;
      len[i] = weight[i]; /* the longest path that ends at node i */
    }
    for (size_t i = 0; i < ne; i++) {
      out[idx[from[i]]].push_back(idx[to[i]]);
      indeg[idx[to[i]]]++;
    }
    for (size_t i = 0; i < n; i++)
      if (!indeg[i]) ready.push_back((int)i);
    int best = 0;
    while (!ready.empty()) {
      int u = ready.back();
      ready.pop_back();
      best = len[u] > best ? len[u] : best;
      for (int v : out[u]) {
        if (len[v] < len[u] + weight[v]) len[v] = len[u] + weight[v];
        if (--indeg[v] == 0) ready.push_back(v);
      }
    }
    *nodes = (int)n;
    *depth = best;
  } catch (const std::bad_alloc &) { /* the shape stays unknown */
  }
}

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
  kiln__cuda_capture_track_begin(device);
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
  kiln__cuda_capture_track_end(device);
  cudaError_t e = cudaStreamEndCapture(d->stream, &graph);
  d->capturing = 0;
  if (e != cudaSuccess) {
    kiln__cuda_mem_capture_end(device, id, false);
    if (graph) cudaGraphDestroy(graph);
    return kiln__cuda_err(e, "cudaStreamEndCapture (an operation in the step cannot be "
                             "captured)");
  }
  int nodes, depth;
  graph_shape(graph, &nodes, &depth);
  cudaGraphExec_t exec = NULL;
  e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (e != cudaSuccess) {
    kiln__cuda_mem_capture_end(device, id, false);
    return kiln__cuda_err(e, "cudaGraphInstantiate");
  }
  Graph *g = new (std::nothrow) Graph{device, id, exec, nodes, depth};
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

extern "C" void kiln__cuda_graph_shape(const void *graph_exec, int *nodes, int *depth) {
  const Graph *g = (const Graph *)graph_exec;
  *nodes = g ? g->nodes : -1;
  *depth = g ? g->depth : -1;
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
