/*
** bench-mlp-step: where the time of fashion-mnist's MLP step goes, f32 against bf16
** autocast, on synthetic data of the same shapes (784-256-10, batch 128, Adam, the
** example's step: linear_relu, linear, cross_entropy, backward, step, one loss read).
**
** For each mode, the median of 5 rounds of N steps:
**   step_us      a step with the loss read back each step (the example's loop);
**   queue_us     a step with nothing read back (a sync after the round): the host's cost
**                of queueing it when the device keeps up;
**   fwd/bwd/opt  the host time of the forward (with its autocast region), the backward
**                and the optimizer step within queue_us;
** and the host time per call of the pieces: the cast of W1 to bf16, linear_relu in f32,
** in bf16 on inputs cast beforehand, and on f32 inputs inside an autocast region (the
** batch's cast included; W1 and b1 come from the bf16 copies autocast keeps while they are
** unchanged), each with grad mode on and W1 requiring grad as in training.
**
** With --graph, the step (forward under its autocast region, backward, Adam with its step
** count on the device) is captured once per mode with kiln_graph_capture after 20 eager
** steps, and replayed: step_us is a replay with the loss read back each step, queue_us a
** replay with nothing read back (a sync after the round: the device's time per step when
** the host keeps ahead). The pieces are not measured then.
**
** Usage: bench-mlp-step [--device D] [--steps N] [--graph] [--json]   (N: 10 to 1000000, default 300)
** Public API only, so it measures any kiln version.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_optim.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_args.h"
#include "bench_clock.h"


static double median5(double *r) {
  qsort(r, 5, sizeof r[0], cmp);
  return r[2];
}

typedef struct net {
  kiln_device dev;
  kiln_tensor *w1, *b1, *w2, *b2, *x, *y;
  kiln_optimizer *opt;
} net;

static kiln_tensor *param(kiln_device dev, int ndim, const int64_t *shape, kiln_generator *g) {
  kiln_tensor *t = kiln_keep(kiln_mul_scalar(kiln_randn(ndim, shape, KILN_F32, dev, g), 0.05));
  kiln_requires_grad_(t, true);
  return t;
}

static int net_init(net *n, kiln_device dev, bool capturable) {
  kiln_generator *g = kiln_generator_new(1);
  n->dev = dev;
  kiln_scope_begin();
  n->w1 = param(dev, KILN_SHAPE(256, 784), g);
  n->b1 = param(dev, KILN_SHAPE(256), g);
  n->w2 = param(dev, KILN_SHAPE(10, 256), g);
  n->b2 = param(dev, KILN_SHAPE(10), g);
  n->x = kiln_keep(kiln_rand(KILN_SHAPE(128, 784), KILN_F32, dev, g));
  n->y = kiln_keep(kiln_randint(0, 10, KILN_SHAPE(128), KILN_I64, dev, g));
  kiln_scope_end();
  kiln_generator_free(g);
  kiln_optim_config cfg = kiln_adam_config(1e-3);
  cfg.capturable = capturable; /* --graph: the step count on the device, advanced by replays */
  kiln_tensor *ps[4] = {n->w1, n->b1, n->w2, n->b2};
  n->opt = kiln_optimizer_new(&cfg, ps, 4);
  return n->opt && n->x && n->y ? 0 : -1;
}

static void net_free(net *n) {
  kiln_optimizer_free(n->opt);
  kiln_tensor *ts[6] = {n->w1, n->b1, n->w2, n->b2, n->x, n->y};
  for (int i = 0; i < 6; i++) kiln_tensor_free(ts[i]);
}

/* One step; t[0..2] += host seconds of forward, backward, optimizer. read: the loss is
** read back (a sync). */
static kiln_status step(net *n, bool amp, bool read, double *t) {
  kiln_scope_begin();
  double t0 = now();
  kiln_status st = amp ? kiln_autocast_begin(n->dev.type, KILN_BF16) : KILN_OK;
  kiln_tensor *loss = kiln_cross_entropy(kiln_linear(kiln_linear_relu(n->x, n->w1, n->b1), n->w2, n->b2), n->y,
                                         KILN_REDUCTION_MEAN, -100, 0.0);
  if (amp && st == KILN_OK) st = kiln_autocast_end();
  double t1 = now();
  if (st == KILN_OK) st = kiln_optimizer_zero_grad(n->opt);
  if (st == KILN_OK) st = loss ? kiln_backward(loss, NULL) : kiln_last_error();
  double t2 = now();
  if (st == KILN_OK) st = kiln_optimizer_step(n->opt);
  double t3 = now();
  if (st == KILN_OK && read) (void)kiln_item(loss);
  kiln_scope_end();
  t[0] += t1 - t0, t[1] += t2 - t1, t[2] += t3 - t2;
  return st == KILN_OK ? kiln_last_error() : st;
}

/* --graph: the captured step writes its loss into a static tensor. */
typedef struct graph_ctx {
  net *n;
  bool amp;
  kiln_tensor *loss; /* static, made before the capture */
} graph_ctx;

static kiln_status graph_step(void *p) {
  graph_ctx *c = p;
  net *n = c->n;
  kiln_scope_begin();
  kiln_status st = c->amp ? kiln_autocast_begin(n->dev.type, KILN_BF16) : KILN_OK;
  kiln_tensor *loss = kiln_cross_entropy(kiln_linear(kiln_linear_relu(n->x, n->w1, n->b1), n->w2, n->b2), n->y,
                                         KILN_REDUCTION_MEAN, -100, 0.0);
  if (c->amp && st == KILN_OK) st = kiln_autocast_end();
  if (st == KILN_OK) st = kiln_optimizer_zero_grad(n->opt);
  if (st == KILN_OK) st = loss ? kiln_backward(loss, NULL) : kiln_last_error();
  if (st == KILN_OK) st = kiln_optimizer_step(n->opt);
  if (st == KILN_OK) {
    bool prev = kiln_set_grad_enabled(false);
    st = kiln_copy_(c->loss, loss);
    kiln_set_grad_enabled(prev);
  }
  kiln_scope_end();
  return st == KILN_OK ? kiln_last_error() : st;
}

/* --graph: both modes captured and replayed; 0 on success. */
static int run_graph(kiln_device dev, int steps, bool json) {
  for (int mode = 0; mode < 2; mode++) {
    const char *name = mode ? "bf16" : "f32";
    net n;
    if (net_init(&n, dev, true) != 0) {
      fprintf(stderr, "bench-mlp-step: making the model: %s\n", kiln_last_error_message());
      return 1;
    }
    graph_ctx c = {&n, mode == 1, kiln_keep(kiln_zeros(KILN_SHAPE0, KILN_F32, dev))};
    kiln_graph *g = NULL;
    double rs[5], rq[5];
    kiln_status st = c.loss ? KILN_OK : kiln_last_error();
    for (int k = 0; k < 20 && st == KILN_OK; k++) st = graph_step(&c); /* eager: state, caches, plans */
    if (st == KILN_OK) (void)kiln_item(c.loss);
    if (st == KILN_OK && !(g = kiln_graph_capture(dev, graph_step, &c))) st = kiln_last_error();
    for (int k = 0; k < 10 && st == KILN_OK; k++) st = kiln_graph_replay(g);
    for (int r = 0; r < 5 && st == KILN_OK; r++) {
      kiln_device_synchronize(dev);
      double t0 = now();
      for (int k = 0; k < steps && st == KILN_OK; k++) {
        st = kiln_graph_replay(g);
        (void)kiln_item(c.loss);
      }
      rs[r] = (now() - t0) / steps * 1e6;
      t0 = now();
      for (int k = 0; k < steps && st == KILN_OK; k++) st = kiln_graph_replay(g);
      kiln_device_synchronize(dev);
      rq[r] = (now() - t0) / steps * 1e6;
    }
    if (st == KILN_OK) st = kiln_last_error();
    double lv = st == KILN_OK ? kiln_item(c.loss) : 0;
    bool devg = g && kiln_graph_is_device_graph(g);
    kiln_graph_free(g);
    kiln_tensor_free(c.loss);
    net_free(&n);
    if (st != KILN_OK) {
      fprintf(stderr, "bench-mlp-step --graph (%s): %s\n", name, kiln_last_error_message());
      return 1;
    }
    double s = median5(rs), q = median5(rq);
    if (json)
      printf(", \"graph_%s_step_us\": %.2f, \"graph_%s_replay_us\": %.2f", name, s, name, q);
    else
      printf("graph %-5s step %8.2f  replay %8.2f  %.0f img/s (loss %.4f%s)\n", name, s, q, 128.0 / (s * 1e-6), lv,
             devg ? "" : ", replays call the step");
  }
  return 0;
}

typedef struct piece_ctx {
  net *n;
  kiln_tensor *xb, *w1b, *b1b;
} piece_ctx;

static void piece_cast(piece_ctx *c) { kiln_to_dtype(c->n->w1, KILN_BF16); }
static void piece_lr_f32(piece_ctx *c) { kiln_linear_relu(c->n->x, c->n->w1, c->n->b1); }
static void piece_lr_bf16(piece_ctx *c) { kiln_linear_relu(c->xb, c->w1b, c->b1b); }
static void piece_lr_autocast(piece_ctx *c) {
  kiln_autocast_begin(c->n->dev.type, KILN_BF16);
  kiln_linear_relu(c->n->x, c->n->w1, c->n->b1);
  kiln_autocast_end();
}

int main(int argc, char **argv) {
  kiln_device dev = kiln_device_best();
  int steps = 300;
  bool json = false, graph = false;
  bench_args cli = bench_args_begin("bench-mlp-step", "[--device D] [--steps N] [--graph] [--json]", argc, argv);
  for (const char *a; (a = bench_args_next(&cli));) {
    if (!strcmp(a, "--device")) bench_args_device(&cli, &dev);
    else if (!strcmp(a, "--steps")) steps = (int)bench_args_int(&cli, 10, 1000000); /* smaller was raised to 10 */
    else if (!strcmp(a, "--json")) json = true;
    else if (!strcmp(a, "--graph")) graph = true;
    else bench_args_unknown(&cli);
  }
  if (graph) {
    char gname[32];
    kiln_device_str(dev, gname, sizeof gname);
    if (json) printf("{\"bench\": \"mlp-step-graph\", \"device\": \"%s\", \"steps\": %d", gname, steps);
    else printf("bench-mlp-step --graph on %s, %d replays a round, median of 5 rounds (us)\n", gname, steps);
    int rc = run_graph(dev, steps, json);
    if (json && rc == 0) printf("}\n");
    return rc;
  }
  net n;
  if (net_init(&n, dev, false) != 0) {
    fprintf(stderr, "bench-mlp-step: making the model: %s\n", kiln_last_error_message());
    return 1;
  }
  char dname[32];
  kiln_device_str(dev, dname, sizeof dname);
  if (json) printf("{\"bench\": \"mlp-step\", \"device\": \"%s\", \"steps\": %d", dname, steps);
  else printf("bench-mlp-step on %s, %d steps a round, median of 5 rounds (us)\n", dname, steps);
  for (int mode = 0; mode < 2; mode++) {
    bool amp = mode == 1;
    const char *name = amp ? "bf16" : "f32";
    double rs[5], rq[5], rf[5], rb[5], ro[5], t[3];
    for (int k = 0; k < 20; k++)
      if (step(&n, amp, true, t) != KILN_OK) goto fail; /* warm-up: plans, modules, caches */
    for (int r = 0; r < 5; r++) {
      kiln_device_synchronize(dev);
      double t0 = now();
      for (int k = 0; k < steps; k++)
        if (step(&n, amp, true, t) != KILN_OK) goto fail;
      rs[r] = (now() - t0) / steps * 1e6;
      t[0] = t[1] = t[2] = 0;
      t0 = now();
      for (int k = 0; k < steps; k++)
        if (step(&n, amp, false, t) != KILN_OK) goto fail;
      double queued = now() - t0;
      kiln_device_synchronize(dev);
      rq[r] = queued / steps * 1e6;
      rf[r] = t[0] / steps * 1e6, rb[r] = t[1] / steps * 1e6, ro[r] = t[2] / steps * 1e6;
    }
    double s = median5(rs), q = median5(rq), f = median5(rf), b = median5(rb), o = median5(ro);
    if (json)
      printf(", \"%s_step_us\": %.2f, \"%s_queue_us\": %.2f, \"%s_fwd_us\": %.2f, \"%s_bwd_us\": %.2f, \"%s_opt_us\": %.2f",
             name, s, name, q, name, f, name, b, name, o);
    else
      printf("%-5s step %8.2f  queue %8.2f  (forward %.2f, backward %.2f, optimizer %.2f)  %.0f img/s\n", name, s, q, f,
             b, o, 128.0 / (s * 1e-6));
  }
  {
    piece_ctx c = {&n, NULL, NULL, NULL};
    kiln_scope_begin();
    c.xb = kiln_to_dtype(n.x, KILN_BF16);
    c.w1b = kiln_to_dtype(n.w1, KILN_BF16);
    c.b1b = kiln_to_dtype(n.b1, KILN_BF16);
    struct {
      const char *name;
      void (*fn)(piece_ctx *);
    } pieces[] = {{"cast_w1", piece_cast},
                  {"linear_relu_f32", piece_lr_f32},
                  {"linear_relu_bf16", piece_lr_bf16},
                  {"linear_relu_autocast", piece_lr_autocast}};
    for (int p = 0; p < 4; p++) {
      double rh[5], rw[5];
      for (int r = 0; r < 5; r++) {
        kiln_device_synchronize(dev);
        double t0 = now();
        for (int k = 0; k < steps; k++) {
          kiln_scope_begin();
          pieces[p].fn(&c);
          kiln_scope_end();
        }
        rh[r] = (now() - t0) / steps * 1e6;
        kiln_device_synchronize(dev);
        t0 = now();
        for (int k = 0; k < steps; k++) {
          kiln_scope_begin();
          pieces[p].fn(&c);
          kiln_scope_end();
          kiln_device_synchronize(dev);
        }
        rw[r] = (now() - t0) / steps * 1e6;
      }
      double h = median5(rh), w = median5(rw);
      if (json) printf(", \"%s_host_us\": %.2f, \"%s_synced_us\": %.2f", pieces[p].name, h, pieces[p].name, w);
      else printf("%-22s host %8.2f us/call, with a sync each call %8.2f\n", pieces[p].name, h, w);
    }
    kiln_scope_end();
  }
  if (json) printf("}\n");
  if (kiln_last_error() != KILN_OK) goto fail;
  net_free(&n);
  return 0;
fail:
  fprintf(stderr, "bench-mlp-step: %s\n", kiln_last_error_message());
  net_free(&n);
  return 1;
}
