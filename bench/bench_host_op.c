/*
** bench-host-op: the host time of one op call, on tensors so small that the kernel costs
** next to nothing — what the op layer itself adds (checks, allocation, dispatch, autograd
** recording, observers). The eager seed-mlp step is bound by this time, so the op call
** path must not make it longer. Uses the public API only, so the same source measures
** any kiln version.
**
** Usage: bench-host-op [--device D] [--iters N] [--json]   (N: 100 to 100000000, default 20000)
** Prints ns per call for each case, the median of 7 rounds. On a GPU the figure is the
** host's cost of queueing the op (the device is synchronized after each round).
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_args.h"
#include "bench_clock.h"


typedef struct env {
  kiln_tensor *a, *b, *w, *bias, *x, *ga; /* a, b: (4, 4); ga requires grad */
} env;

/* Each case makes `calls` op calls inside one scope. */
static int case_add(env *e) { kiln_add(e->a, e->b); return 1; }
static int case_relu(env *e) { kiln_relu(e->a); return 1; }
static int case_mul_scalar(env *e) { kiln_mul_scalar(e->a, 2.0); return 1; }
static int case_sum(env *e) { kiln_sum_all(e->a); return 1; }
static int case_matmul(env *e) { kiln_matmul(e->a, e->b); return 1; }
static int case_view(env *e) { kiln_transpose(e->a, 0, 1); return 1; }
static int case_add_grad(env *e) { kiln_add(e->ga, e->b); return 1; }
/* a two-layer MLP's step on 4 samples: 3 forward ops, the loss, backward */
static int case_mlp_step(env *e) {
  kiln_tensor *h = kiln_relu(kiln_linear(e->x, e->w, e->bias));
  kiln_tensor *loss = kiln_mean_all(kiln_mul(h, h));
  kiln_backward(loss, NULL);
  return 1;
}

typedef struct bcase {
  const char *name;
  int (*fn)(env *);
} bcase;

int main(int argc, char **argv) {
  int iters = 20000;
  bool json = false;
  kiln_device dev = kiln_device_cpu();
  bench_args cli = bench_args_begin("bench-host-op", "[--device D] [--iters N] [--json]", argc, argv);
  for (const char *a; (a = bench_args_next(&cli));) {
    /* at least 100: the step case runs iters / 10 calls */
    if (!strcmp(a, "--iters")) iters = (int)bench_args_int(&cli, 100, 100000000);
    else if (!strcmp(a, "--device")) bench_args_device(&cli, &dev);
    else if (!strcmp(a, "--json")) json = true;
    else bench_args_unknown(&cli);
  }
  kiln_set_num_threads(1);
  kiln_device cpu = dev; /* the device the cases run on */
  env e;
  e.a = kiln_keep(kiln_randn(KILN_SHAPE(4, 4), KILN_F32, cpu, NULL));
  e.b = kiln_keep(kiln_randn(KILN_SHAPE(4, 4), KILN_F32, cpu, NULL));
  e.ga = kiln_keep(kiln_randn(KILN_SHAPE(4, 4), KILN_F32, cpu, NULL));
  kiln_requires_grad_(e.ga, true);
  e.x = kiln_keep(kiln_randn(KILN_SHAPE(4, 8), KILN_F32, cpu, NULL));
  e.w = kiln_keep(kiln_randn(KILN_SHAPE(8, 8), KILN_F32, cpu, NULL));
  e.bias = kiln_keep(kiln_zeros(KILN_SHAPE(8), KILN_F32, cpu));
  kiln_requires_grad_(e.w, true);
  kiln_requires_grad_(e.bias, true);
  bcase cases[] = {{"add", case_add},         {"relu", case_relu},         {"mul_scalar", case_mul_scalar},
                   {"sum", case_sum},         {"matmul_4x4", case_matmul}, {"transpose", case_view},
                   {"add_grad", case_add_grad}, {"mlp_step", case_mlp_step}};
  int nc = (int)(sizeof cases / sizeof cases[0]);
  char dname[32];
  kiln_device_str(dev, dname, sizeof dname);
  if (json) printf("{\"bench\": \"host-op\", \"device\": \"%s\", \"iters\": %d", dname, iters);
  for (int c = 0; c < nc; c++) {
    double r[7];
    int per = cases[c].fn == case_mlp_step ? iters / 10 : iters;
    for (int round = 0; round < 7; round++) {
      double t0 = now();
      for (int i = 0; i < per; i += 64) {
        kiln_scope_begin();
        for (int k = 0; k < 64 && i + k < per; k++) cases[c].fn(&e);
        kiln_scope_end();
      }
      kiln_device_synchronize(dev);
      r[round] = (now() - t0) / per * 1e9;
    }
    qsort(r, 7, sizeof r[0], cmp);
    if (json) printf(", \"%s_ns\": %.1f", cases[c].name, r[3]);
    else printf("%-12s %9.1f ns/call (min %.1f, max %.1f)\n", cases[c].name, r[3], r[0], r[6]);
  }
  if (json) printf("}\n");
  if (kiln_last_error() != KILN_OK) {
    fprintf(stderr, "bench-host-op: %s\n", kiln_last_error_message());
    return 1;
  }
  kiln_tensor_free(e.a);
  kiln_tensor_free(e.b);
  kiln_tensor_free(e.ga);
  kiln_tensor_free(e.x);
  kiln_tensor_free(e.w);
  kiln_tensor_free(e.bias);
  return 0;
}
