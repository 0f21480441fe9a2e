/*
** Shared by the examples: a training step recorded once per batch shape and replayed
** (kiln_graph_capture), as --graph of seed-mlp and fashion-mnist does it. Header-only.
**
** The program gives a step function that reads its batch from static input tensors and
** writes its loss into a static scalar; this file owns those tensors and the graphs, two
** shapes at most (the full batch and the smaller last one of an epoch):
**
**   ex_graph_step gs;
**   ex_graph_step_init(&gs, dev, 2, batch, step_fn, &my_ctx);
**   for each step:
**     kiln_scope_begin();
**     int r = ex_graph_step_next(&gs, loader, b);           // the batch fetched ahead, or the loader's
**     if (r == 1) st = ex_graph_step_run(&gs, loader, b, &loss);
**     kiln_scope_end();
**     ex_graph_step_end(&gs);                                // frees the batch fetched ahead
**   ex_graph_step_free(&gs);
**
** The first step at a shape makes the static tensors, runs the step eagerly (it trains like
** any other step, creates the optimizer state and warms the memory cache and the cuDNN
** algorithm cache) and then records it. Later steps copy the batch on the device into the
** static inputs and replay. While a replay runs, the host fetches the next batch and
** queues its copy into the static inputs of its shape (behind the replay, which reads them
** first), so the loss read (kiln_item after each step) waits for the device alone.
**
** With sum_loss set (after init), the host reads no loss per step: each step (the eager
** ones too, and a program's own eager steps through ex_graph_step_eager_loss) adds its loss to an f64 sum on the device, in step order, and
** ex_graph_step_take_sum reads it once (at an epoch's end). The host then never waits for
** the device inside an epoch and queues the next replays while the device runs this one.
** The sum is the one a host loop of `total += kiln_item(loss)` makes, to the bit (f32
** losses added in f64 in the same order).
*/
#ifndef KILN_EXAMPLES_GRAPH_STEP_H
#define KILN_EXAMPLES_GRAPH_STEP_H

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include <kiln.h>
#include <kiln_data.h>

#include "progress.h"

#define EX_GRAPH_MAX_IN 4

/* The recorded step: reads in[0..n_in), writes the scalar loss (f32, on the device). */
typedef kiln_status (*ex_step_fn)(void *user, kiln_tensor *const *in, kiln_tensor *loss);

struct ex_graph_step;

/* One batch shape's static tensors and its recording. */
typedef struct ex_graph_shape {
  struct ex_graph_step *gs;
  kiln_tensor *in[EX_GRAPH_MAX_IN];
  kiln_tensor *loss;
  kiln_graph *g;
} ex_graph_shape;

typedef struct ex_graph_step {
  kiln_device dev;
  int n_in;
  int64_t full; /* the full batch's size (shape 0); any other size is shape 1 */
  ex_step_fn fn;
  void *user;
  ex_graph_shape shape[2];
  /* the batch fetched ahead during the last replay (ahead_r == EX_AHEAD_NONE: none), which
  ** shape's static inputs it was already copied into (-1: none), and the one handed out by
  ** ex_graph_step_next, freed by ex_graph_step_end */
  kiln_tensor *ahead[EX_GRAPH_MAX_IN], *held[EX_GRAPH_MAX_IN];
  int ahead_r, ahead_in;
  /* KILN_PHASES (phases true): host seconds by phase, summed over the replayed steps:
  ** [0] loading the batch ahead, [1] copies into the static inputs, [2] the graph's launch,
  ** [4] the loss read; [3] the eager warm-up step of each batch shape (waited for) and [5]
  ** its capture; and the device seconds from each replay's launch to its end. */
  bool phases;
  double phase_s[6], device_s;
  bool sum_loss;          /* set by the program after init: see above */
  kiln_tensor *loss_sum;  /* f64 scalar on the device (sum_loss) */
  /* sum_loss, eager steps (ex_graph_step_eager_loss): each loss copied into the next slot
  ** of an f32 log on the device (a copy runs natively on every backend, an f64 add may
  ** not), read and added on the host in step order when full and at take_sum */
  kiln_tensor *loss_log;
  int log_n;
  double log_sum;
} ex_graph_step;

enum { EX_AHEAD_NONE = -2, EX_LOSS_LOG = 512 };

/* For a step function: copies the step's loss into out (the loss the graph writes), with
** grad mode off so the copy records no node. */
static inline kiln_status ex_graph_store_loss(kiln_tensor *out, kiln_tensor *loss) {
  bool prev = kiln_set_grad_enabled(false);
  kiln_status st = kiln_copy_(out, loss);
  kiln_set_grad_enabled(prev);
  return st;
}

static inline void ex_graph_step_init(ex_graph_step *gs, kiln_device dev, int n_in, int64_t full_batch,
                                      ex_step_fn fn, void *user) {
  memset(gs, 0, sizeof *gs);
  gs->dev = dev;
  gs->n_in = n_in < EX_GRAPH_MAX_IN ? n_in : EX_GRAPH_MAX_IN;
  gs->full = full_batch;
  gs->fn = fn;
  gs->user = user;
  gs->ahead_r = EX_AHEAD_NONE;
  gs->ahead_in = -1;
  gs->phases = getenv("KILN_PHASES") != NULL;
  for (int k = 0; k < 2; k++) gs->shape[k].gs = gs;
}

/* kiln_graph_fn: one shape's step on its static tensors. */
static inline kiln_status ex_graph_shape_step(void *p) {
  ex_graph_shape *s = (ex_graph_shape *)p;
  kiln_status st = s->gs->fn(s->gs->user, s->in, s->loss);
  if (st == KILN_OK && s->gs->loss_sum) st = kiln_axpy_(s->gs->loss_sum, 1.0, s->loss);
  return st;
}

/* *v = the scalar t's value (one host read); a NaN read because the read itself failed
** returns that error. */
static inline kiln_status ex_read_scalar(kiln_tensor *t, double *v) {
  *v = kiln_item(t);
  return *v != *v && kiln_last_error() != KILN_OK ? kiln_last_error() : KILN_OK;
}

/* sum_loss: the sum of the losses since the last call (one host read), and the device sum
** back to 0. */
static inline kiln_status ex_loss_log_flush(ex_graph_step *gs);
static inline kiln_status ex_graph_step_take_sum(ex_graph_step *gs, double *sum) {
  kiln_status st = ex_loss_log_flush(gs);
  *sum = gs->log_sum;
  gs->log_sum = 0;
  if (st != KILN_OK || !gs->loss_sum) return st;
  double v;
  if ((st = ex_read_scalar(gs->loss_sum, &v)) != KILN_OK) return st;
  *sum += v;
  return kiln_fill_(gs->loss_sum, 0.0);
}

/* The logged losses added into log_sum (one host read), the log emptied. */
static inline kiln_status ex_loss_log_flush(ex_graph_step *gs) {
  float v[EX_LOSS_LOG];
  if (gs->log_n == 0) return KILN_OK;
  kiln_status st = kiln_to_host(gs->loss_log, v, sizeof v);
  for (int i = 0; i < gs->log_n && st == KILN_OK; i++) gs->log_sum += v[i];
  gs->log_n = 0;
  return st;
}

/* An eager step's loss: with sum_loss, logged on the device (no host read, so the host runs
** ahead of the device as in the replays; *lv gets NAN; the sum is the host loop's to the
** bit: f32 losses added in f64 in step order), else read into *lv. */
static inline kiln_status ex_graph_step_eager_loss(ex_graph_step *gs, kiln_tensor *loss, double *lv) {
  *lv = NAN;
  if (!gs->sum_loss) return ex_read_scalar(loss, lv);
  if (!gs->loss_log && !(gs->loss_log = kiln_keep(kiln_zeros(KILN_SHAPE(EX_LOSS_LOG), KILN_F32, gs->dev))))
    return kiln_last_error();
  kiln_status st = gs->log_n == EX_LOSS_LOG ? ex_loss_log_flush(gs) : KILN_OK;
  bool prev = kiln_set_grad_enabled(false);
  if (st == KILN_OK) st = kiln_copy_(kiln_select(gs->loss_log, 0, gs->log_n), loss);
  kiln_set_grad_enabled(prev);
  if (st == KILN_OK) gs->log_n++;
  return st;
}

/* The next batch into b (kiln_loader_next's return value): the one fetched during the last
** replay when there is one (kept until ex_graph_step_end), else the loader's. */
static inline int ex_graph_step_next(ex_graph_step *gs, kiln_loader *loader, kiln_tensor **b) {
  if (gs->ahead_r == EX_AHEAD_NONE) return kiln_loader_next(loader, b);
  int r = gs->ahead_r;
  for (int i = 0; i < gs->n_in; i++) {
    b[i] = r == 1 ? gs->ahead[i] : NULL;
    gs->held[i] = b[i];
    gs->ahead[i] = NULL;
  }
  gs->ahead_r = EX_AHEAD_NONE;
  return r;
}

/* After the step's scope has closed: frees the batch ex_graph_step_next handed out from
** the fetch ahead. */
static inline void ex_graph_step_end(ex_graph_step *gs) {
  for (int i = 0; i < EX_GRAPH_MAX_IN; i++) {
    kiln_tensor_free(gs->held[i]);
    gs->held[i] = NULL;
  }
}

static inline kiln_status ex_graph_copy_in(ex_graph_shape *s, kiln_tensor *const *b) {
  return kiln_copy_many_(s->gs->n_in, s->in, (kiln_tensor **)b);
}

/* One training step on batch b (its first dim the batch size); *loss gets its loss. */
static inline kiln_status ex_graph_step_run(ex_graph_step *gs, kiln_loader *loader, kiln_tensor *const *b,
                                            double *loss) {
  int k = kiln_size(b[0], 0) == gs->full ? 0 : 1;
  ex_graph_shape *s = &gs->shape[k];
  kiln_status st = KILN_OK;
  if (!s->g) {
    if (s->loss) /* made by an earlier call whose capture failed: no second try */
      return kiln_set_error(KILN_ERR_STATE, "graph step: the capture of this batch shape failed before");
    /* The static inputs in one device block (kiln_to_device_many packs host tensors),
    ** laid out as the loader lays out a batch, so that a staged batch refills them all with
    ** one copy on the device. */
    kiln_device cpu = kiln_device_cpu();
    kiln_tensor *hz[EX_GRAPH_MAX_IN] = {NULL}, *sx[EX_GRAPH_MAX_IN] = {NULL};
    for (int i = 0; i < gs->n_in && st == KILN_OK; i++)
      if (!(hz[i] = kiln_zeros(kiln_ndim(b[i]), kiln_shape(b[i]), kiln_dtype_of(b[i]), cpu))) st = kiln_last_error();
    if (st == KILN_OK) st = kiln_to_device_many(gs->n_in, hz, gs->dev, sx);
    for (int i = 0; i < gs->n_in; i++) s->in[i] = sx[i] ? kiln_keep(sx[i]) : NULL;
    if (st == KILN_OK) st = ex_graph_copy_in(s, b);
    if (st == KILN_OK && !(s->loss = kiln_keep(kiln_zeros(KILN_SHAPE0, KILN_F32, gs->dev)))) st = kiln_last_error();
    if (st == KILN_OK && gs->sum_loss && !gs->loss_sum &&
        !(gs->loss_sum = kiln_keep(kiln_zeros(KILN_SHAPE0, KILN_F64, gs->dev))))
      st = kiln_last_error();
    double w0 = gs->phases ? ex_now() : 0;
    if (st == KILN_OK) st = ex_graph_shape_step(s); /* the eager warm-up step */
    if (st == KILN_OK) *loss = kiln_item(s->loss);
    double w1 = gs->phases ? ex_now() : 0;
    if (st == KILN_OK && !(s->g = kiln_graph_capture(gs->dev, ex_graph_shape_step, s))) st = kiln_last_error();
    if (gs->phases) gs->phase_s[3] += w1 - w0, gs->phase_s[5] += ex_now() - w1;
    return st;
  }
  double p0 = gs->phases ? ex_now() : 0;
  if (gs->ahead_in != k) st = ex_graph_copy_in(s, b);
  gs->ahead_in = -1;
  double p1 = gs->phases ? ex_now() : 0;
  kiln_mark *m0 = gs->phases ? kiln_mark_record(gs->dev) : NULL;
  if (st == KILN_OK) st = kiln_graph_replay(s->g);
  kiln_mark *m1 = gs->phases ? kiln_mark_record(gs->dev) : NULL;
  double p2 = gs->phases ? ex_now() : 0, p3 = p2;
  if (st == KILN_OK) {
    kiln_tensor *a[EX_GRAPH_MAX_IN] = {NULL};
    int r = kiln_loader_next(loader, a);
    p3 = gs->phases ? ex_now() : 0;
    gs->ahead_r = r;
    if (r == 1) {
      for (int i = 0; i < gs->n_in; i++) gs->ahead[i] = kiln_keep(a[i]); /* outlive this step's scope */
      int k2 = kiln_size(a[0], 0) == gs->full ? 0 : 1;
      if (gs->shape[k2].g) {
        st = ex_graph_copy_in(&gs->shape[k2], a);
        gs->ahead_in = k2;
      }
    }
  }
  double p4 = gs->phases ? ex_now() : 0;
  *loss = NAN; /* sum_loss: not read */
  if (st == KILN_OK && !gs->sum_loss) st = ex_read_scalar(s->loss, loss);
  if (gs->phases) {
    gs->phase_s[0] += p3 - p2, gs->phase_s[1] += (p1 - p0) + (p4 - p3), gs->phase_s[2] += p2 - p1;
    gs->phase_s[4] += ex_now() - p4;
    gs->device_s += kiln_mark_elapsed_ms(m0, m1) * 1e-3;
  }
  return st;
}

/* Frees the graphs, the static tensors and any batch fetched ahead. The struct is zeroed;
** a zeroed struct frees nothing. */
static inline void ex_graph_step_free(ex_graph_step *gs) {
  for (int k = 0; k < 2; k++) {
    kiln_graph_free(gs->shape[k].g);
    for (int i = 0; i < EX_GRAPH_MAX_IN; i++) kiln_tensor_free(gs->shape[k].in[i]);
    kiln_tensor_free(gs->shape[k].loss);
  }
  kiln_tensor_free(gs->loss_sum);
  kiln_tensor_free(gs->loss_log);
  for (int i = 0; i < EX_GRAPH_MAX_IN; i++) kiln_tensor_free(gs->ahead[i]), kiln_tensor_free(gs->held[i]);
  memset(gs, 0, sizeof *gs);
}

#endif
