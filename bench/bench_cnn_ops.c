/*
** The CNN ops other than convolution, alone, at the shapes of the fmnist-cnn example and of
** ResNet-18 at 32x32 (batch 64): ReLU, max_pool2d, the bias-gradient sum, batch_norm_relu
** and batch_norm_add_relu, each forward and backward, in f32 and bf16, NCHW and
** channels-last; and the machine's copy bandwidth (memcpy), the yardstick they are held to.
**
**   bench-cnn-ops [--reps R] [--only SUBSTRING] [--profile] [--device D]
**
** Prints one line per case: the median ms of the forward alone and of forward + backward
** (the backward given a gradient of ones), and the bytes the forward must move at least.
** --profile prints kiln's per-op table for each case as well.
**
** --device D (cuda, cuda:1, ...; anything but the CPU): ResNet-50's batch norms at batch
** 256 instead, bf16 channels-last with f32 parameters (as under autocast with
** --channels-last): batch_norm_relu (bn1, bn2 and the stem), batch_norm_add_relu (bn3 with
** the identity), the plain batch_norm (the downsample's) and, beside each
** batch_norm_add_relu, the three ops it replaces (relu(add(batch_norm))). Timed on the device:
** R calls between two kiln_device_synchronize, the median of 5 such rounds. Each shape
** first times a device copy of the tensor (kiln_copy_: one read, one write), the
** yardstick; then per case the forward (grad off), the backward (forward + backward less
** the forward) and the GB/s of the passes a one-kernel-per-direction batch norm must make
** over the tensor: forward x twice (statistics, normalize) and y once, + the residual once
** for add_relu; backward x and g twice and dx once (5), + the mask (the output) twice under
** a ReLU (7); add_relu's backward: x, g, the mask read and gm (the residual's gradient)
** written, then x and gm read and dx written (7). The three-op rows use the fused op's
** bytes, so their GB/s is the fused one's equivalent. batch_norm_relu's backward runs
** twice, each a row: "mask recomputed" (the default on CUDA: BATCH_NORM_BACKWARD
** recomputes the ReLU's decision from x, 5 passes) and "mask read"
** (KILN_BN_MASK_RECOMPUTE=0: it reads the output as the mask, 7 passes); the environment
** variable is set for each and restored after.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_args.h"
#include "bench_clock.h"

typedef enum { OP_RELU_POOL, OP_POOL3, OP_BIAS_SUM, OP_BN_RELU, OP_BN_ADD_RELU, OP_RELU, OP_BN, OP_BN_ADD_RELU3 } op_kind;

typedef struct bcase {
  const char *name;
  op_kind op;
  int64_t shape[4];
} bcase;

typedef struct state {
  kiln_tensor *x, *r, *g, *w, *b, *rm, *rv;
} state;

static kiln_tensor *run_fwd(const bcase *c, state *s) {
  static const int64_t k2[2] = {2, 2}, k3[2] = {3, 3}, s2[2] = {2, 2}, p1[2] = {1, 1};
  switch (c->op) {
  case OP_RELU: return kiln_relu(s->x);
  case OP_RELU_POOL: return kiln_max_pool2d(kiln_relu(s->x), k2, s2, NULL, NULL, NULL);
  case OP_POOL3: return kiln_max_pool2d(s->x, k3, s2, p1, NULL, NULL);
  case OP_BIAS_SUM: {
    int dims[3] = {0, 2, 3};
    return kiln_sum(s->x, 3, dims, false);
  }
  case OP_BN_RELU: return kiln_batch_norm_relu(s->x, s->rm, s->rv, s->w, s->b, true, 0.1, 1e-5);
  case OP_BN_ADD_RELU: return kiln_batch_norm_add_relu(s->x, s->r, s->rm, s->rv, s->w, s->b, true, 0.1, 1e-5);
  case OP_BN: return kiln_batch_norm(s->x, s->rm, s->rv, s->w, s->b, true, 0.1, 1e-5);
  case OP_BN_ADD_RELU3:
    return kiln_relu(kiln_add(kiln_batch_norm(s->x, s->rm, s->rv, s->w, s->b, true, 0.1, 1e-5), s->r));
  }
  return NULL;
}

static double median(double *t, int n) {
  qsort(t, (size_t)n, sizeof *t, cmp);
  return t[n / 2];
}

/* ---- on a device: ResNet-50's batch norms ---- */

/* passes over the tensor a one-kernel batch norm must make: forward, backward */
static void passes(op_kind op, int *fwd, int *bwd) {
  switch (op) {
  case OP_BN: *fwd = 3, *bwd = 5; break;
  case OP_BN_RELU: *fwd = 3, *bwd = 7; break;
  default: *fwd = 4, *bwd = 7; break; /* batch_norm_add_relu, fused or not */
  }
}

typedef struct dev_step {
  const bcase *c;
  state *s;
  kiln_tensor *g;
  bool backward;
} dev_step;

static kiln_status dev_run(void *ctx) {
  const dev_step *d = ctx;
  kiln_scope_begin();
  kiln_set_grad_enabled(d->backward);
  kiln_tensor *y = run_fwd(d->c, d->s);
  kiln_status st = !y ? kiln_last_error() : d->backward ? kiln_backward(y, d->g) : KILN_OK;
  kiln_set_grad_enabled(true);
  kiln_set_grad(d->s->x, NULL), kiln_set_grad(d->s->r, NULL), kiln_set_grad(d->s->w, NULL), kiln_set_grad(d->s->b, NULL);
  kiln_scope_end();
  return st;
}

typedef struct copy_step {
  kiln_tensor *dst, *src;
} copy_step;
static kiln_status copy_run(void *ctx) {
  const copy_step *c = ctx;
  return kiln_copy_(c->dst, c->src);
}

/* ms per call of fn: reps calls between two synchronizations, the median of 5 such rounds
** (two calls first, untimed); -1 when a call fails (the error printed) */
static double dev_time(kiln_device dev, int reps, kiln_status (*fn)(void *), void *ctx) {
  double t[5];
  bool ok = fn(ctx) == KILN_OK && fn(ctx) == KILN_OK && kiln_device_synchronize(dev) == KILN_OK;
  for (int k = 0; ok && k < 5; k++) {
    double t0 = now();
    for (int i = 0; ok && i < reps; i++) ok = fn(ctx) == KILN_OK;
    ok = ok && kiln_device_synchronize(dev) == KILN_OK;
    t[k] = (now() - t0) * 1e3 / reps;
  }
  if (ok) return median(t, 5);
  printf("  failed: %s\n", kiln_last_error_message());
  return -1;
}

static int run_device(kiln_device dev, int reps, const char *only, bool profile) {
  if (kiln_device_synchronize(dev) != KILN_OK) {
    fprintf(stderr, "bench-cnn-ops: device: %s\n", kiln_last_error_message());
    return 77;
  }
  static const bcase cases[] = {
      {"rn50 stem bn_relu (256,64,112,112)", OP_BN_RELU, {256, 64, 112, 112}},
      {"rn50 l1 bn_relu (256,64,56,56)", OP_BN_RELU, {256, 64, 56, 56}},
      {"rn50 l1 bn_add_relu (256,256,56,56)", OP_BN_ADD_RELU, {256, 256, 56, 56}},
      {"rn50 l1 3 ops (256,256,56,56)", OP_BN_ADD_RELU3, {256, 256, 56, 56}},
      {"rn50 l1 ds bn (256,256,56,56)", OP_BN, {256, 256, 56, 56}},
      {"rn50 l2 bn_relu (256,128,28,28)", OP_BN_RELU, {256, 128, 28, 28}},
      {"rn50 l2 bn_add_relu (256,512,28,28)", OP_BN_ADD_RELU, {256, 512, 28, 28}},
      {"rn50 l2 3 ops (256,512,28,28)", OP_BN_ADD_RELU3, {256, 512, 28, 28}},
      {"rn50 l3 bn_relu (256,256,14,14)", OP_BN_RELU, {256, 256, 14, 14}},
      {"rn50 l3 bn_add_relu (256,1024,14,14)", OP_BN_ADD_RELU, {256, 1024, 14, 14}},
      {"rn50 l3 3 ops (256,1024,14,14)", OP_BN_ADD_RELU3, {256, 1024, 14, 14}},
      {"rn50 l4 bn_relu (256,512,7,7)", OP_BN_RELU, {256, 512, 7, 7}},
      {"rn50 l4 bn_add_relu (256,2048,7,7)", OP_BN_ADD_RELU, {256, 2048, 7, 7}},
      {"rn50 l4 3 ops (256,2048,7,7)", OP_BN_ADD_RELU3, {256, 2048, 7, 7}},
  };
  char dname[32];
  kiln_device_str(dev, dname, sizeof dname);
  printf("%s, bf16 channels-last, f32 parameters, training; %d calls a round, median of 5 rounds\n", dname, reps);
  printf("%-54s %8s %8s %8s %8s %9s %7s\n", "case", "fwd ms", "fwd GB/s", "bwd ms", "bwd GB/s", "f+b ms", "MB");
  kiln_generator *gen = kiln_generator_new(1);
  const int64_t *last_shape = NULL;
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
    const bcase *c = &cases[ci];
    if (only && !strstr(c->name, only)) continue;
    kiln_scope_begin();
    const kiln_dtype dt = KILN_BF16;
    double bytes = (double)(c->shape[0] * c->shape[1] * c->shape[2] * c->shape[3]) * (double)kiln_dtype_size(dt);
    state s = {0};
    int64_t C = c->shape[1];
    s.x = kiln_contiguous_format(kiln_randn(4, c->shape, dt, dev, gen), KILN_CHANNELS_LAST);
    if (c->op == OP_BN_ADD_RELU || c->op == OP_BN_ADD_RELU3)
      s.r = kiln_contiguous_format(kiln_randn(4, c->shape, dt, dev, gen), KILN_CHANNELS_LAST);
    s.w = kiln_ones(KILN_SHAPE(C), KILN_F32, dev);
    s.b = kiln_zeros(KILN_SHAPE(C), KILN_F32, dev);
    s.rm = kiln_zeros(KILN_SHAPE(C), KILN_F32, dev);
    s.rv = kiln_ones(KILN_SHAPE(C), KILN_F32, dev);
    if (!s.x || ((c->op == OP_BN_ADD_RELU || c->op == OP_BN_ADD_RELU3) && !s.r) || !s.rv) {
      printf("%-54s %s\n", c->name, kiln_last_error_message());
      kiln_scope_end();
      continue;
    }
    kiln_requires_grad_(s.x, true), kiln_requires_grad_(s.w, true), kiln_requires_grad_(s.b, true);
    if (s.r) kiln_requires_grad_(s.r, true);
    if (!last_shape || memcmp(last_shape, c->shape, sizeof c->shape)) { /* the yardstick, once a shape */
      copy_step cp = {kiln_zeros_like(s.x), s.x}; /* channels-last, as x */
      double tc = cp.dst ? dev_time(dev, reps, copy_run, &cp) : -1;
      if (tc > 0) printf("%-54s %8.3f %8.0f %35.1f\n", "  copy (kiln_copy_, read + write)", tc, 2 * bytes / tc / 1e6, bytes / 1e6);
      last_shape = c->shape;
    }
    kiln_tensor *y0 = run_fwd(c, &s);
    kiln_tensor *g = y0 ? kiln_ones_like(y0) : NULL;
    if (!g) {
      printf("%-54s %s\n", c->name, kiln_last_error_message());
      kiln_scope_end();
      continue;
    }
    dev_step f = {c, &s, g, false}, fb = {c, &s, g, true};
    if (profile) kiln_profiler_start(&(kiln_profiler_options){.device_time = true});
    double tf = dev_time(dev, reps, dev_run, &f);
    /* batch_norm_relu: the backward with its mask recomputed (5 passes), then read (7) */
    const bool ab = c->op == OP_BN_RELU;
    const char *env0 = getenv("KILN_BN_MASK_RECOMPUTE");
    char env_saved[16] = "";
    if (env0) snprintf(env_saved, sizeof env_saved, "%s", env0);
    for (int v = 0; v < (ab ? 2 : 1); v++) {
      if (ab) setenv("KILN_BN_MASK_RECOMPUTE", v ? "0" : "1", 1);
      double tfb = dev_time(dev, reps, dev_run, &fb);
      int pf, pb;
      passes(c->op, &pf, &pb);
      if (ab && !v) pb = 5;
      double tb = tfb - tf;
      char label[64];
      snprintf(label, sizeof label, "%s%s", c->name, !ab ? "" : v ? " mask read" : " mask recomputed");
      if (tf > 0 && tfb > 0)
        printf("%-54s %8.3f %8.0f %8.3f %8.0f %9.3f %7.1f\n", label, tf, pf * bytes / tf / 1e6, tb,
               tb > 0 ? pb * bytes / tb / 1e6 : 0.0, tfb, bytes / 1e6);
    }
    if (ab) {
      if (env0) setenv("KILN_BN_MASK_RECOMPUTE", env_saved, 1);
      else unsetenv("KILN_BN_MASK_RECOMPUTE");
    }
    if (profile) kiln_profiler_stop(stdout);
    fflush(stdout);
    kiln_scope_end();
  }
  kiln_generator_free(gen);
  return 0;
}

int main(int argc, char **argv) {
  int reps = 30;
  const char *only = NULL;
  kiln_device dev = kiln_device_cpu();
  bool profile = false;
  bench_args cli =
      bench_args_begin("bench-cnn-ops", "[--reps R] [--only SUBSTRING] [--profile] [--device D]", argc, argv);
  for (const char *a; (a = bench_args_next(&cli));) {
    if (!strcmp(a, "--reps")) reps = (int)bench_args_int(&cli, 1, 1000000);
    else if (!strcmp(a, "--only")) only = bench_args_value(&cli);
    else if (!strcmp(a, "--device")) bench_args_device(&cli, &dev);
    else if (!strcmp(a, "--profile")) profile = true;
    else bench_args_unknown(&cli);
  }
  if (dev.type != KILN_DEVICE_CPU) return run_device(dev, reps, only, profile);
  /* the yardstick: memcpy of 64 MiB (out of cache), both cores' worth being one stream */
  {
    size_t n = (size_t)64 << 20;
    char *a = malloc(n), *b = malloc(n);
    memset(a, 1, n), memset(b, 2, n);
    double t[9];
    for (int r = 0; r < 9; r++) {
      double t0 = now();
      memcpy(b, a, n);
      t[r] = now() - t0;
    }
    double m = median(t, 9);
    printf("memcpy 64 MiB: %.2f ms, %.1f GB/s (read + write)\n", m * 1e3, 2.0 * (double)n / m / 1e9);
    free(a), free(b);
  }
  static const bcase cases[] = {
      {"fmnist relu (128,32,26,26)", OP_RELU, {128, 32, 26, 26}},
      {"fmnist relu+pool2 (128,32,26,26)", OP_RELU_POOL, {128, 32, 26, 26}},
      {"fmnist relu+pool2 (128,64,11,11)", OP_RELU_POOL, {128, 64, 11, 11}},
      {"fmnist bias-sum (128,32,26,26)", OP_BIAS_SUM, {128, 32, 26, 26}},
      {"fmnist bias-sum (128,64,11,11)", OP_BIAS_SUM, {128, 64, 11, 11}},
      {"resnet pool3/2 (64,64,16,16)", OP_POOL3, {64, 64, 16, 16}},
      {"resnet bn_relu (64,64,8,8)", OP_BN_RELU, {64, 64, 8, 8}},
      {"resnet bn_relu (64,128,4,4)", OP_BN_RELU, {64, 128, 4, 4}},
      {"resnet bn_relu (64,256,2,2)", OP_BN_RELU, {64, 256, 2, 2}},
      {"resnet bn_relu (64,512,1,1)", OP_BN_RELU, {64, 512, 1, 1}},
      {"resnet bn_add_relu (64,64,8,8)", OP_BN_ADD_RELU, {64, 64, 8, 8}},
      {"resnet bn_add_relu (64,512,1,1)", OP_BN_ADD_RELU, {64, 512, 1, 1}},
  };
  kiln_device cpu = kiln_device_cpu();
  kiln_generator *gen = kiln_generator_new(1);
  printf("%-36s %-5s %-3s %10s %10s %9s\n", "case", "dtype", "fmt", "fwd ms", "fwd+bwd ms", "fwd MB");
  for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++)
    for (int dti = 0; dti < 2; dti++)
      for (int cl = 0; cl < 2; cl++) {
        const bcase *c = &cases[ci];
        kiln_dtype dt = dti ? KILN_BF16 : KILN_F32;
        char label[128];
        snprintf(label, sizeof label, "%s %s %s", c->name, dti ? "bf16" : "f32", cl ? "nhwc" : "nchw");
        if (only && !strstr(label, only)) continue;
        kiln_scope_begin();
        state s = {0};
        int64_t C = c->shape[1];
        s.x = kiln_randn(4, c->shape, dt, cpu, gen);
        s.r = kiln_randn(4, c->shape, dt, cpu, gen);
        if (cl) s.x = kiln_contiguous_format(s.x, KILN_CHANNELS_LAST), s.r = kiln_contiguous_format(s.r, KILN_CHANNELS_LAST);
        s.w = kiln_ones(KILN_SHAPE(C), KILN_F32, cpu);
        s.b = kiln_zeros(KILN_SHAPE(C), KILN_F32, cpu);
        s.rm = kiln_zeros(KILN_SHAPE(C), KILN_F32, cpu);
        s.rv = kiln_ones(KILN_SHAPE(C), KILN_F32, cpu);
        kiln_requires_grad_(s.x, true);
        kiln_requires_grad_(s.r, true);
        kiln_requires_grad_(s.w, true);
        kiln_requires_grad_(s.b, true);
        kiln_tensor *y0 = run_fwd(c, &s);
        if (!y0) {
          printf("%-36s %s\n", label, kiln_last_error_message());
          kiln_scope_end();
          continue;
        }
        kiln_tensor *g = kiln_ones_like(y0);
        double mb = 0;
        {
          double es = (double)kiln_dtype_size(dt), n = (double)kiln_numel(s.x), no = (double)kiln_numel(y0);
          mb = (n * es + no * es) / 1e6;
        }
        double *tf = malloc(sizeof(double) * (size_t)reps), *tb = malloc(sizeof(double) * (size_t)reps);
        if (profile) kiln_profiler_start(NULL);
        for (int r = -3; r < reps; r++) {
          kiln_scope_begin();
          kiln_set_grad_enabled(false);
          double t0 = now();
          kiln_tensor *y = run_fwd(c, &s);
          double t1 = now();
          kiln_set_grad_enabled(true);
          double t2 = now();
          y = run_fwd(c, &s);
          kiln_status st = kiln_backward(y, g);
          double t3 = now();
          if (st != KILN_OK) printf("%s: %s\n", label, kiln_last_error_message());
          if (r >= 0) tf[r] = t1 - t0, tb[r] = t3 - t2;
          kiln_set_grad(s.x, NULL), kiln_set_grad(s.r, NULL), kiln_set_grad(s.w, NULL), kiln_set_grad(s.b, NULL);
          kiln_scope_end();
        }
        if (profile) kiln_profiler_stop(stdout);
        printf("%-36s %-5s %-3s %10.3f %10.3f %9.2f\n", c->name, dti ? "bf16" : "f32", cl ? "nhwc" : "nchw",
               median(tf, reps) * 1e3, median(tb, reps) * 1e3, mb);
        fflush(stdout);
        free(tf), free(tb);
        kiln_scope_end();
      }
  kiln_generator_free(gen);
  return 0;
}
