/*
** Device ceilings through kiln, for comparison with torch_peer.py `ceilings`: an 8192^3
** matrix product (bf16, f16, f32 exact, f32 with TF32) and large elementwise ops against
** the device's copy bandwidth. Prints a table and one JSON line per figure.
**
**   bench-ceilings [--device cuda:0] [--n 8192] [--mib 1024] [--reps 20] [--only NAME]
**                  [--calls C]
** --only runs the one workload NAME (matmul-f16, add, ...); --calls times C products
** issued back to back between two syncs (the figure is per product), which separates a
** per-sync cost from the kernels' own time.
*/
#define _POSIX_C_SOURCE 200809L /* clock_gettime: clang does not get it by default */
#include <kiln.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_args.h"
#include "bench_clock.h"

/* Median seconds of reps runs of fn, each timed between device syncs. */
typedef kiln_status (*bench_fn)(void *ctx);
static double time_median(kiln_device dev, bench_fn fn, void *ctx, int reps) {
  double *t = malloc(sizeof(double) * (size_t)reps);
  for (int w = 0; w < 3; w++) fn(ctx);
  kiln_device_synchronize(dev);
  for (int r = 0; r < reps; r++) {
    double t0 = now();
    if (fn(ctx) != KILN_OK) {
      fprintf(stderr, "bench: %s\n", kiln_last_error_message());
      free(t);
      return -1;
    }
    kiln_device_synchronize(dev);
    t[r] = now() - t0;
  }
  qsort(t, (size_t)reps, sizeof(double), cmp);
  double m = t[reps / 2];
  free(t);
  return m;
}

typedef struct mm_ctx {
  kiln_tensor *a[2], *b[2];
  int k, calls;
} mm_ctx;

static kiln_status mm_run(void *p) {
  mm_ctx *c = p;
  kiln_status st = KILN_OK;
  for (int i = 0; i < c->calls && st == KILN_OK; i++) {
    kiln_scope_begin();
    /* two input sets in turn, so repeated runs do not measure a warm cache */
    kiln_tensor *y = kiln_matmul(c->a[c->k & 1], c->b[c->k & 1]);
    c->k++;
    st = y ? KILN_OK : kiln_last_error();
    kiln_scope_end();
  }
  return st;
}

typedef struct ew_ctx {
  kiln_tensor *x, *y, *out;
  int op; /* 0 copy, 1 add, 2 mul_scalar (in place), 3 relu */
} ew_ctx;

static kiln_status ew_run(void *p) {
  ew_ctx *c = p;
  if (c->op == 0) return kiln_copy_(c->out, c->x);
  if (c->op == 2) return kiln_mul_scalar_(c->out, 1.0000001);
  kiln_scope_begin();
  kiln_tensor *r = c->op == 1 ? kiln_add(c->x, c->y) : kiln_relu(c->x);
  kiln_status st = r ? KILN_OK : kiln_last_error();
  kiln_scope_end();
  return st;
}

/* The workloads --only may name: the products (mms[] in main), then the elementwise ops. */
static const char *const workloads[] = {"matmul-bf16", "matmul-f16", "matmul-tf32", "matmul-f32",
                                        "copy",        "add",        "mul_scalar_", "relu",
                                        NULL};

int main(int argc, char **argv) {
  kiln_device dev = kiln_device_best();
  int64_t n = 8192, mib = 1024;
  int reps = 20, calls = 1;
  const char *only = NULL;
  bench_args cli = bench_args_begin("bench-ceilings",
                                    "[--device D] [--n N] [--mib M] [--reps R] [--only NAME] [--calls C]", argc, argv);
  for (const char *a; (a = bench_args_next(&cli));) {
    if (!strcmp(a, "--device")) bench_args_device(&cli, &dev);
    else if (!strcmp(a, "--n")) n = bench_args_int(&cli, 1, 1 << 16);
    else if (!strcmp(a, "--mib")) mib = bench_args_int(&cli, 1, 1 << 20);
    else if (!strcmp(a, "--reps")) reps = (int)bench_args_int(&cli, 1, 1000000);
    else if (!strcmp(a, "--only")) only = workloads[bench_args_choice(&cli, workloads)];
    else if (!strcmp(a, "--calls")) calls = (int)bench_args_int(&cli, 1, 1000000);
    else bench_args_unknown(&cli);
  }
  char dname[32];
  kiln_device_str(dev, dname, sizeof dname);
  printf("%-28s %12s\n", "workload", "rate");
  struct {
    const char *name;
    kiln_dtype dt;
    bool tf32;
  } mms[] = {{workloads[0], KILN_BF16, false},
             {workloads[1], KILN_F16, false},
             {workloads[2], KILN_F32, true},
             {workloads[3], KILN_F32, false}};
  for (size_t k = 0; k < sizeof mms / sizeof mms[0]; k++) {
    if (only && strcmp(only, mms[k].name) != 0) continue;
    kiln_set_matmul_tf32(mms[k].tf32);
    mm_ctx c = {{NULL, NULL}, {NULL, NULL}, 0, calls};
    for (int s = 0; s < 2; s++) {
      c.a[s] = kiln_keep(kiln_randn(KILN_SHAPE(n, n), mms[k].dt, dev, NULL));
      c.b[s] = kiln_keep(kiln_randn(KILN_SHAPE(n, n), mms[k].dt, dev, NULL));
    }
    if (!c.a[1] || !c.b[1]) {
      fprintf(stderr, "bench-ceilings: %s\n", kiln_last_error_message());
      return 1;
    }
    double t = time_median(dev, mm_run, &c, dev.type == KILN_DEVICE_CPU ? 3 : reps);
    double tflops = t > 0 ? 2.0 * (double)n * (double)n * (double)n * calls / t / 1e12 : 0;
    t /= calls;
    printf("%-28s %9.1f TFLOP/s\n", mms[k].name, tflops);
    if (dev.type == KILN_DEVICE_VULKAN) { /* which kernel ran: the first thing to check */
      char path[512];
      if (kiln_vulkan_matmul_path(dev.index, mms[k].dt, n, n, n, path, sizeof path) == KILN_OK)
        printf("  path: %s\n", path);
      else kiln_clear_error();
    }
    printf("{\"workload\": \"ceilings\", \"device\": \"%s\", \"op\": \"%s\", \"n\": %lld, \"seconds\": %.6f, \"tflops\": %.2f}\n",
           dname, mms[k].name, (long long)n, t, tflops);
    for (int s = 0; s < 2; s++) kiln_tensor_free(c.a[s]), kiln_tensor_free(c.b[s]);
    kiln_memory_empty_cache(dev);
  }
  kiln_set_matmul_tf32(false);
  if (only && strncmp(only, "matmul", 6) == 0) return 0;
  int64_t elems = mib * (1 << 20) / 4;
  ew_ctx e;
  e.x = kiln_keep(kiln_randn(KILN_SHAPE(elems), KILN_F32, dev, NULL));
  e.y = kiln_keep(kiln_randn(KILN_SHAPE(elems), KILN_F32, dev, NULL));
  e.out = kiln_keep(kiln_empty(KILN_SHAPE(elems), KILN_F32, dev));
  if (!e.x || !e.y || !e.out) {
    fprintf(stderr, "bench-ceilings: %s\n", kiln_last_error_message());
    return 1;
  }
  const char *const *names = workloads + 4; /* copy, add, mul_scalar_, relu */
  const double passes[] = {2, 3, 2, 2}; /* bytes moved per element / 4 */
  double copy_gbs = 0;
  for (int op = 0; op < 4; op++) {
    if (only && strcmp(only, names[op]) != 0) continue;
    e.op = op;
    double t = time_median(dev, ew_run, &e, dev.type == KILN_DEVICE_CPU ? 3 : reps);
    double gbs = t > 0 ? passes[op] * 4.0 * (double)elems / t / 1e9 : 0;
    if (op == 0) copy_gbs = gbs;
    printf("%-28s %9.1f GB/s  (%.0f%% of copy)\n", names[op], gbs, copy_gbs > 0 ? 100 * gbs / copy_gbs : 0);
    printf("{\"workload\": \"ceilings\", \"device\": \"%s\", \"op\": \"%s\", \"bytes\": %.0f, \"seconds\": %.6f, \"gbs\": %.1f}\n",
           dname, names[op], passes[op] * 4.0 * (double)elems, t, gbs);
  }
  kiln_tensor_free(e.x);
  kiln_tensor_free(e.y);
  kiln_tensor_free(e.out);
  return 0;
}
