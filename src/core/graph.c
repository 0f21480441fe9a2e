/*
** Graph capture and replay (kiln.h). On CUDA the step runs once under stream capture and
** its work is instantiated as a CUDA graph; on the CPU, replay calls the step again, so a
** program written for graphs runs unchanged everywhere.
*/
#include "kiln_int.h"

#include <stdlib.h>

#ifdef KILN_HAVE_CUDA
#include "../backend/cuda/cuda_api.h"
#endif

struct kiln_graph {
  kiln_device dev;
  kiln_graph_fn step;
  void *ctx;
  void *exec; /* cudaGraphExec_t, NULL on the CPU */
};

kiln_graph *kiln_graph_capture(kiln_device dev, kiln_graph_fn step, void *ctx) {
  if (!step) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_graph_capture: NULL step function");
  if (kiln__check_device(dev, "kiln_graph_capture") != KILN_OK) return NULL;
  kiln_graph *g = calloc(1, sizeof *g);
  if (!g) KILN__FAIL_NULL(KILN_ERR_OOM, "kiln_graph_capture: out of host memory");
  g->dev = dev;
  g->step = step;
  g->ctx = ctx;
  if (dev.type == KILN_DEVICE_CPU) return g;
#ifdef KILN_HAVE_CUDA
  if (kiln__cuda_graph_begin(dev.index) != KILN_OK) {
    free(g);
    return NULL;
  }
  kiln_status st = step(ctx);
  if (st != KILN_OK && kiln_last_error() == KILN_OK)
    kiln_set_error(st, "kiln_graph_capture: the step returned %s", kiln_error_name(st));
  /* End the capture in every case, so the stream leaves capture mode. Keep the step's
  ** error, which says more than the capture's. */
  kiln_status st_err = kiln_last_error();
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", kiln_last_error_message());
  kiln_status end = kiln__cuda_graph_end(dev.index, &g->exec);
  if (st != KILN_OK) {
    kiln__cuda_graph_free(g->exec);
    free(g);
    kiln_set_error(st_err, "%s", msg);
    return NULL;
  }
  if (end != KILN_OK) {
    free(g);
    return NULL;
  }
  return g;
#else
  free(g);
  KILN__FAIL_NULL(KILN_ERR_UNAVAILABLE, "kiln_graph_capture: kiln was built without CUDA");
#endif
}

kiln_status kiln_graph_replay(kiln_graph *g) {
  if (!g) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_graph_replay: NULL graph");
  if (!g->exec) return g->step(g->ctx);
#ifdef KILN_HAVE_CUDA
  return kiln__cuda_graph_launch(g->dev.index, g->exec);
#else
  return kiln_set_error(KILN_ERR_INTERNAL, "kiln_graph_replay: device graph without CUDA");
#endif
}

bool kiln_graph_is_device_graph(const kiln_graph *g) { return g && g->exec; }

void kiln__graph_shape(const kiln_graph *g, int *nodes, int *depth) {
  *nodes = *depth = -1;
#ifdef KILN_HAVE_CUDA
  if (g && g->exec) kiln__cuda_graph_shape(g->exec, nodes, depth);
#else
  KILN__UNUSED(g);
#endif
}

void kiln_graph_free(kiln_graph *g) {
  if (!g) return;
#ifdef KILN_HAVE_CUDA
  kiln__cuda_graph_free(g->exec);
#endif
  free(g);
}
