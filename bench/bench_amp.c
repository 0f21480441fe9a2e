/*
** Issue 14's benchmark lines: mixed precision with the loss scaler, and gradient
** checkpointing, on a deep MLP.
**
** (a) The same MLP (depth hidden layers of width, ReLU, Adam 1e-3), the same data (a
**     fixed pool of batches labelled by a random linear teacher) and the same seeds,
**     trained in f32 and under f16 autocast with kiln_grad_scaler (PyTorch's defaults:
**     2^16, x2 every 2000 clean steps, x0.5 on inf). Prints the two loss curves side by
**     side, the steps the scaler skipped and the scale's trajectory (every change), then
**     images/s for both from a second, timed run that reads nothing back per step (the
**     scaled step needs no host sync, so the loop only queues work).
** (b) A deeper MLP (blocks of 4 x (linear + GELU)) with and without kiln_checkpoint on
**     each block (kiln_module_set_checkpoint): the activation bytes autograd saved (peak), the
**     peak of allocated device memory during a step above what was live before it, the
**     step time, and the largest gradient difference between the two (0 on the CPU).
** (c) --json: one summary line at the end.
**
**   bench-amp [--device cpu|cuda[:N]] [--steps N] [--width W] [--depth D] [--batch B]
**             [--ck-depth D] [--ck-width W] [--ck-batch B] [--ck-steps N] [--part a|b] [--json]
**
** The defaults are sized for the device: on CUDA the 8 x 1024 (batch 256) and a
** 48-layer (12-block) checkpointing model of width 4096 at batch 8192; on the CPU a smaller one that runs in about a minute on
** 2 cores (f16 matmuls on the CPU are not fast; the CPU's own autocast dtype is bf16, f16
** here is for the scaler's sake).
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_nn.h>
#include <kiln_optim.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_args.h"

typedef struct opts {
  kiln_device dev;
  int steps, width, depth, batch, in, classes;
  int ck_depth, ck_width, ck_batch, ck_steps;
  char part; /* 'a', 'b' or 0: both */
  bool json;
} opts;

enum { POOL = 8 };
/* Layers (linear + GELU) per checkpointed block: a block keeps its input instead of the
** 2 * CK_INNER tensors its layers save, so deeper blocks show more of what it saves. */
enum { CK_INNER = 4 };

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void die(const char *what) {
  fprintf(stderr, "bench-amp: %s: %s\n", what, kiln_last_error_message());
  exit(1);
}

/* ---- (a) f16 autocast + scaler against f32 ---- */
typedef struct data {
  kiln_tensor *x[POOL], *y[POOL];
} data;

static data make_data(const opts *o) {
  data d;
  kiln_generator *g = kiln_generator_new(1);
  kiln_scope_begin();
  kiln_tensor *teacher = kiln_randn(KILN_SHAPE(o->in, o->classes), KILN_F32, kiln_device_cpu(), g);
  for (int b = 0; b < POOL; b++) {
    kiln_tensor *x = kiln_randn(KILN_SHAPE(o->batch, o->in), KILN_F32, kiln_device_cpu(), g);
    kiln_tensor *y = kiln_argmax(kiln_matmul(x, teacher), 1, false);
    d.x[b] = kiln_keep(kiln_to_device(x, o->dev));
    d.y[b] = kiln_keep(kiln_to_device(y, o->dev));
    if (!d.x[b] || !d.y[b]) die("making the data");
  }
  kiln_scope_end();
  kiln_generator_free(g);
  return d;
}

static kiln_module *mlp(const opts *o) {
  kiln_generator *g = kiln_generator_new(2);
  kiln_module *net = kiln_sequential_new();
  kiln_sequential_append(net, kiln_linear_new(o->in, o->width, true, KILN_F32, o->dev, g));
  kiln_sequential_append(net, kiln_relu_new());
  for (int i = 1; i < o->depth; i++) {
    kiln_sequential_append(net, kiln_linear_new(o->width, o->width, true, KILN_F32, o->dev, g));
    kiln_sequential_append(net, kiln_relu_new());
  }
  kiln_sequential_append(net, kiln_linear_new(o->width, o->classes, true, KILN_F32, o->dev, g));
  kiln_generator_free(g);
  return net;
}

typedef struct run_out {
  double *loss, *scale; /* per step (scale: amp only) */
  int64_t applied;      /* optimizer steps applied */
} run_out;

/* One training run of o->steps steps. record: read the loss (and scale) every step;
** otherwise read only the last loss (a timed run). Returns the seconds the steps took
** after the first 3 (allocator and autocast caches warm). */
static double train(const opts *o, const data *d, bool amp, bool record, run_out *out) {
  kiln_module *net = mlp(o);
  kiln_optim_config oc = kiln_adam_config(1e-3);
  kiln_optimizer *opt = kiln_optimizer_new_module(&oc, net);
  kiln_grad_scaler *sc = amp ? kiln_grad_scaler_new(NULL) : NULL;
  if (!net || !opt || (amp && !sc)) die("building the model");
  double t0 = 0;
  kiln_tensor *last = NULL;
  for (int s = 0; s < o->steps; s++) {
    if (s == 3) {
      if (last) (void)kiln_item(last); /* the queue drained before the clock starts */
      t0 = now_s();
    }
    kiln_tensor_free(last);
    last = NULL;
    kiln_scope_begin();
    kiln_optimizer_zero_grad(opt);
    if (amp && kiln_autocast_begin(o->dev.type, KILN_F16) != KILN_OK) die("autocast");
    kiln_tensor *logits = kiln_module_forward(net, d->x[s % POOL]);
    kiln_tensor *loss = kiln_cross_entropy(logits, d->y[s % POOL], KILN_REDUCTION_MEAN, -100, 0.0);
    if (amp) kiln_autocast_end();
    if (!loss) die("forward");
    kiln_status st = kiln_backward(amp ? kiln_grad_scaler_scale(sc, loss) : loss, NULL);
    if (st == KILN_OK) st = amp ? kiln_grad_scaler_step(sc, opt) : kiln_optimizer_step(opt);
    if (st == KILN_OK && amp) st = kiln_grad_scaler_update(sc);
    if (st != KILN_OK) die("training step");
    if (record) {
      out->loss[s] = kiln_item(loss);
      if (amp) out->scale[s] = kiln_grad_scaler_get_scale(sc);
    }
    last = kiln_keep(loss);
    kiln_scope_end();
  }
  double end_loss = last ? kiln_item(last) : NAN; /* waits for the last step */
  double secs = now_s() - t0;
  (void)end_loss;
  kiln_tensor_free(last);
  if (out) out->applied = kiln_optimizer_steps(opt);
  kiln_grad_scaler_free(sc);
  kiln_optimizer_free(opt);
  kiln_module_free(net);
  return secs;
}

typedef struct result_a {
  double f32_ips, amp_ips, max_rel_diff, final_f32, final_amp, final_scale;
  int64_t skipped, skipped_after_10;
} result_a;

static result_a part_a(const opts *o) {
  result_a r;
  memset(&r, 0, sizeof r);
  data d = make_data(o);
  run_out f = {calloc((size_t)o->steps, sizeof(double)), NULL, 0};
  run_out a = {calloc((size_t)o->steps, sizeof(double)), calloc((size_t)o->steps, sizeof(double)), 0};
  printf("(a) MLP %d x %d (in %d, %d classes), batch %d, Adam 1e-3, %d steps on %s: f32 vs f16 autocast + "
         "grad scaler\n", o->depth, o->width, o->in, o->classes, o->batch, o->steps,
         o->dev.type == KILN_DEVICE_CUDA ? "cuda" : "cpu");
  train(o, &d, false, true, &f);
  train(o, &d, true, true, &a);
  printf("  %6s %12s %12s %10s %10s\n", "step", "loss f32", "loss amp", "rel diff", "scale");
  int every = o->steps >= 20 ? o->steps / 20 : 1;
  double prev_scale = 65536.0;
  for (int s = 0; s < o->steps; s++) {
    double rel = fabs(a.loss[s] - f.loss[s]) / fmax(fabs(f.loss[s]), 1e-12);
    if (s > 0 && rel > r.max_rel_diff && !isnan(rel)) r.max_rel_diff = rel; /* step 0: same params */
    bool changed = a.scale[s] != prev_scale;
    if (s % every == 0 || s == o->steps - 1 || changed)
      printf("  %6d %12.6f %12.6f %10.2e %10.0f%s\n", s, f.loss[s], a.loss[s], rel, a.scale[s],
             changed ? (a.scale[s] < prev_scale ? "  (inf: skipped, backoff)" : "  (grown)") : "");
    if (changed && a.scale[s] < prev_scale && s >= 10) r.skipped_after_10++;
    prev_scale = a.scale[s];
  }
  r.skipped = o->steps - a.applied;
  r.final_f32 = f.loss[o->steps - 1];
  r.final_amp = a.loss[o->steps - 1];
  r.final_scale = a.scale[o->steps - 1];
  printf("  skipped steps: %lld of %d (%lld after step 10); final scale %.0f; largest relative loss "
         "difference %.3g\n", (long long)r.skipped, o->steps, (long long)r.skipped_after_10, r.final_scale,
         r.max_rel_diff);
  double tf = train(o, &d, false, false, NULL), ta = train(o, &d, true, false, NULL);
  int timed = o->steps - 3;
  r.f32_ips = timed > 0 ? (double)timed * o->batch / tf : 0;
  r.amp_ips = timed > 0 ? (double)timed * o->batch / ta : 0;
  printf("  images/s (steps 3..%d, no per-step reads): f32 %.0f, f16 autocast + scaler %.0f (%.2fx)\n",
         o->steps - 1, r.f32_ips, r.amp_ips, r.amp_ips / r.f32_ips);
  for (int b = 0; b < POOL; b++) kiln_tensor_free(d.x[b]), kiln_tensor_free(d.y[b]);
  free(f.loss), free(a.loss), free(a.scale);
  return r;
}

/* ---- (b) checkpointing ---- */
static kiln_module *ck_mlp(const opts *o) {
  kiln_generator *g = kiln_generator_new(3);
  kiln_module *net = kiln_sequential_new();
  for (int i = 0; i < o->ck_depth; i++) {
    kiln_module *blk = kiln_sequential_new();
    for (int k = 0; k < CK_INNER; k++) {
      kiln_sequential_append(blk, kiln_linear_new(o->ck_width, o->ck_width, true, KILN_F32, o->dev, g));
      kiln_sequential_append(blk, kiln_gelu_new(KILN_GELU_TANH));
    }
    kiln_sequential_append(net, blk);
  }
  kiln_generator_free(g);
  return net;
}

typedef struct result_b {
  double saved_mib[2], peak_mib[2], ms[2], grad_diff;
} result_b;

static void ck_run(const opts *o, bool ck, result_b *r, kiln_tensor ***grads_out) {
  kiln_module *net = ck_mlp(o);
  if (ck && kiln_module_set_checkpoint(net, true) != KILN_OK) die("set_checkpoint");
  kiln_optim_config oc = kiln_sgd_config(1e-3);
  kiln_optimizer *opt = kiln_optimizer_new_module(&oc, net);
  kiln_generator *g = kiln_generator_new(4);
  kiln_tensor *x = kiln_keep(kiln_randn(KILN_SHAPE(o->ck_batch, o->ck_width), KILN_F32, o->dev, g));
  kiln_generator_free(g);
  double total = 0;
  int n = 0;
  for (int s = 0; s <= o->ck_steps; s++) {
    kiln_scope_begin();
    kiln_optimizer_zero_grad(opt);
    if (s == 1) { /* step 0 made the gradients; from here the peaks are a step's own */
      kiln_memory_reset_peak(o->dev);
      kiln_autograd_saved_reset_peak();
    }
    kiln_memory_stats m0;
    kiln_memory_stats_get(o->dev, &m0);
    double t = now_s();
    kiln_tensor *y = kiln_module_forward(net, x);
    kiln_tensor *loss = kiln_mean_all(kiln_mul(y, y));
    if (!loss || kiln_backward(loss, NULL) != KILN_OK) die("checkpointing step");
    if (s == 0 && grads_out) { /* the first step's gradients, for the comparison */
      int np = kiln_module_parameters(net, NULL, 0);
      kiln_tensor **gs = calloc((size_t)np + 1, sizeof *gs);
      kiln_tensor **ps = calloc((size_t)np + 1, sizeof *ps);
      kiln_module_parameters(net, ps, np);
      for (int i = 0; i < np; i++) gs[i] = kiln_keep(kiln_clone(kiln_grad(ps[i])));
      free(ps);
      *grads_out = gs;
    }
    if (kiln_optimizer_step(opt) != KILN_OK) die("sgd step");
    (void)kiln_item(loss);
    double dt = now_s() - t;
    if (s >= 1) {
      total += dt;
      n++;
      kiln_memory_stats m1;
      kiln_memory_stats_get(o->dev, &m1);
      double peak = (double)(m1.peak_allocated - m0.allocated) / 1048576.0;
      if (peak > r->peak_mib[ck]) r->peak_mib[ck] = peak;
    }
    kiln_scope_end();
  }
  int64_t live, peak_saved;
  kiln_autograd_saved_bytes(&live, &peak_saved);
  r->saved_mib[ck] = (double)peak_saved / 1048576.0;
  r->ms[ck] = n ? 1e3 * total / n : 0;
  kiln_tensor_free(x);
  kiln_optimizer_free(opt);
  kiln_module_free(net);
}

static result_b part_b(const opts *o) {
  result_b r;
  memset(&r, 0, sizeof r);
  printf("(b) checkpointing: %d blocks of %d x (linear %d x %d + GELU), batch %d, %d timed steps (SGD)\n",
         o->ck_depth, CK_INNER, o->ck_width, o->ck_width, o->ck_batch, o->ck_steps);
  kiln_tensor **g0 = NULL, **g1 = NULL;
  ck_run(o, false, &r, &g0);
  ck_run(o, true, &r, &g1);
  kiln_scope_begin();
  for (int i = 0; g0 && g1 && g0[i] && g1[i]; i++) {
    double d = kiln_item(kiln_amax(kiln_abs(kiln_sub(g0[i], g1[i])), 0, NULL, false));
    if (d > r.grad_diff) r.grad_diff = d;
  }
  kiln_scope_end();
  for (int i = 0; g0 && g0[i]; i++) kiln_tensor_free(g0[i]);
  for (int i = 0; g1 && g1[i]; i++) kiln_tensor_free(g1[i]);
  free(g0), free(g1);
  printf("  %-22s %14s %18s %10s\n", "", "saved (MiB)", "step peak (MiB)", "ms/step");
  printf("  %-22s %14.1f %18.1f %10.1f\n", "without checkpointing", r.saved_mib[0], r.peak_mib[0], r.ms[0]);
  printf("  %-22s %14.1f %18.1f %10.1f\n", "kiln_checkpoint/block", r.saved_mib[1], r.peak_mib[1], r.ms[1]);
  printf("  saved activations %.2fx smaller, step peak %.2fx smaller, at %.2fx the speed; largest gradient "
         "difference %.3g\n", r.saved_mib[0] / fmax(r.saved_mib[1], 1e-9), r.peak_mib[0] / fmax(r.peak_mib[1], 1e-9),
         r.ms[0] / fmax(r.ms[1], 1e-9), r.grad_diff);
  return r;
}

int main(int argc, char **argv) {
  opts o;
  memset(&o, 0, sizeof o);
  o.dev = kiln_device_cpu();
  o.in = 256;
  o.classes = 10;
  int steps = 0, width = 0, depth = 0, batch = 0, ckd = 0, ckw = 0, ckb = 0, cks = 0;
  bench_args cli = bench_args_begin("bench-amp",
                                    "[--device cpu|cuda[:N]] [--steps N] [--width W] [--depth D] [--batch B]\n"
                                    "                 [--ck-depth D] [--ck-width W] [--ck-batch B] [--ck-steps N]"
                                    " [--part a|b] [--json]",
                                    argc, argv);
  static const char *const parts[] = {"a", "b", NULL};
  enum { MAXN = 1000000 }; /* the counts' bound; 0 in them below means the device's default */
  for (const char *a; (a = bench_args_next(&cli));) {
    if (!strcmp(a, "--json")) o.json = true;
    else if (!strcmp(a, "--device")) bench_args_device(&cli, &o.dev);
    else if (!strcmp(a, "--part")) o.part = parts[bench_args_choice(&cli, parts)][0];
    else if (!strcmp(a, "--steps")) steps = (int)bench_args_int(&cli, 4, MAXN); /* 3 warm-up steps are not timed */
    else if (!strcmp(a, "--width")) width = (int)bench_args_int(&cli, 1, MAXN);
    else if (!strcmp(a, "--depth")) depth = (int)bench_args_int(&cli, 1, MAXN);
    else if (!strcmp(a, "--batch")) batch = (int)bench_args_int(&cli, 1, MAXN);
    else if (!strcmp(a, "--ck-depth")) ckd = (int)bench_args_int(&cli, 1, MAXN);
    else if (!strcmp(a, "--ck-width")) ckw = (int)bench_args_int(&cli, 1, MAXN);
    else if (!strcmp(a, "--ck-batch")) ckb = (int)bench_args_int(&cli, 1, MAXN);
    else if (!strcmp(a, "--ck-steps")) cks = (int)bench_args_int(&cli, 1, MAXN);
    else bench_args_unknown(&cli);
  }
  if (o.dev.type != KILN_DEVICE_CPU && o.dev.index >= kiln_device_count(o.dev.type)) {
    fprintf(stderr, "bench-amp: --device: no such device on this machine\n");
    return 1;
  }
  bool gpu = o.dev.type != KILN_DEVICE_CPU;
  o.steps = steps ? steps : gpu ? 300 : 60;
  o.width = width ? width : gpu ? 1024 : 256;
  o.depth = depth ? depth : 8;
  o.batch = batch ? batch : gpu ? 256 : 64;
  o.ck_depth = ckd ? ckd : gpu ? 12 : 6;
  o.ck_width = ckw ? ckw : gpu ? 4096 : 384;
  o.ck_batch = ckb ? ckb : gpu ? 8192 : 256;
  o.ck_steps = cks ? cks : gpu ? 10 : 3;
  result_a ra;
  result_b rb;
  memset(&ra, 0, sizeof ra);
  memset(&rb, 0, sizeof rb);
  if (o.part != 'b') ra = part_a(&o);
  if (o.part != 'a') rb = part_b(&o);
  if (o.json) {
    char dev[32];
    kiln_device_str(o.dev, dev, sizeof dev);
    printf("{\"bench\":\"amp\",\"device\":\"%s\"", dev);
    if (o.part != 'b')
      printf(",\"mlp\":{\"depth\":%d,\"width\":%d,\"batch\":%d,\"steps\":%d,\"f32_img_s\":%.1f,\"amp_img_s\":%.1f,"
             "\"skipped\":%lld,\"skipped_after_10\":%lld,\"final_scale\":%.0f,\"max_rel_loss_diff\":%.4g,"
             "\"final_loss_f32\":%.6f,\"final_loss_amp\":%.6f}",
             o.depth, o.width, o.batch, o.steps, ra.f32_ips, ra.amp_ips, (long long)ra.skipped,
             (long long)ra.skipped_after_10, ra.final_scale, ra.max_rel_diff, ra.final_f32, ra.final_amp);
    if (o.part != 'a')
      printf(",\"checkpoint\":{\"blocks\":%d,\"layers_per_block\":%d,\"width\":%d,\"batch\":%d,\"saved_mib\":%.2f,\"saved_mib_ck\":%.2f,"
             "\"peak_mib\":%.2f,\"peak_mib_ck\":%.2f,\"ms\":%.2f,\"ms_ck\":%.2f,\"grad_max_diff\":%.3g}",
             o.ck_depth, CK_INNER, o.ck_width, o.ck_batch, rb.saved_mib[0], rb.saved_mib[1], rb.peak_mib[0], rb.peak_mib[1],
             rb.ms[0], rb.ms[1], rb.grad_diff);
    printf("}\n");
  }
  return 0;
}
