/*
** The CNN ops other than convolution, alone, at the shapes of the fmnist-cnn example and of
** ResNet-18 at 32x32 (batch 64): ReLU, max_pool2d, the bias-gradient sum, batch_norm_relu
** and batch_norm_add_relu, each forward and backward, in f32 and bf16, NCHW and
** channels-last; and the machine's copy bandwidth (memcpy), the yardstick they are held to.
**
**   bench-cnn-ops [--reps R] [--only SUBSTRING] [--profile]
**
** Prints one line per case: the median ms of the forward alone and of forward + backward
** (the backward given a gradient of ones), and the bytes the forward must move at least.
** --profile prints kiln's per-op table for each case as well.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_clock.h"

typedef enum { OP_RELU_POOL, OP_POOL3, OP_BIAS_SUM, OP_BN_RELU, OP_BN_ADD_RELU, OP_RELU } op_kind;

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
  }
  return NULL;
}

static double median(double *t, int n) {
  qsort(t, (size_t)n, sizeof *t, cmp);
  return t[n / 2];
}

int main(int argc, char **argv) {
  int reps = 30;
  const char *only = NULL;
  bool profile = false;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
    else if (!strcmp(argv[i], "--profile")) profile = true;
    else {
      fprintf(stderr, "usage: bench-cnn-ops [--reps R] [--only SUBSTRING] [--profile]\n");
      return 2;
    }
  }
  if (reps < 1) reps = 1;
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
