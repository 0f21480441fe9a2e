/*
** Graph capture and replay (kiln.h). On a backend with device graphs (kiln__backend.graph:
** CUDA) the step runs once under capture and its work is instantiated as a graph; on one
** without (the CPU), replay calls the step again, so a program written for graphs runs
** unchanged everywhere.
*/
#include "kiln_int.h"

#include <stdlib.h>

struct kiln_graph {
  kiln_device dev;
  const kiln__backend *backend;
  kiln_graph_fn step;
  void *ctx;
  void *exec; /* the backend's executable graph; NULL where it has none (the CPU) */
};

kiln_graph *kiln_graph_capture(kiln_device dev, kiln_graph_fn step, void *ctx) {
  if (!step) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_graph_capture: NULL step function");
  if (kiln__check_device(dev, "kiln_graph_capture") != KILN_OK) return NULL;
  kiln_graph *g = calloc(1, sizeof *g);
  if (!g) KILN__FAIL_NULL(KILN_ERR_OOM, "kiln_graph_capture: out of host memory");
  g->dev = dev;
  g->backend = kiln__backend_get(dev.type);
  g->step = step;
  g->ctx = ctx;
  const kiln__backend_graph *bg = g->backend->graph;
  if (!bg) return g; /* no device graphs: replay calls the step */
  if (bg->begin(dev.index) != KILN_OK) {
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
  kiln_status end = bg->end(dev.index, &g->exec);
  if (st != KILN_OK) {
    if (g->exec && bg->free) bg->free(g->exec);
    free(g);
    kiln_set_error(st_err, "%s", msg);
    return NULL;
  }
  if (end != KILN_OK) {
    free(g);
    return NULL;
  }
  return g;
}

kiln_status kiln_graph_replay(kiln_graph *g) {
  if (!g) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_graph_replay: NULL graph");
  if (!g->exec) return g->step(g->ctx); /* the ops themselves: their writes are seen */
  kiln__write_epoch_bump(); /* a device graph writes memory without the host seeing which */
  return g->backend->graph->launch(g->dev.index, g->exec);
}

bool kiln_graph_is_device_graph(const kiln_graph *g) { return g && g->exec; }

void kiln__graph_shape(const kiln_graph *g, int *nodes, int *depth) {
  *nodes = *depth = -1;
  if (g && g->exec && g->backend->graph->shape) g->backend->graph->shape(g->exec, nodes, depth);
}

void kiln_graph_free(kiln_graph *g) {
  if (!g) return;
  if (g->exec && g->backend->graph->free) g->backend->graph->free(g->exec);
  free(g);
}
