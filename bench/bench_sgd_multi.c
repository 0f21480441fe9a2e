/*
** bench-sgd-multi: the SGD step of ResNet-50's parameters (161 tensors, 25.6 M values;
** momentum 0.9, weight decay 1e-4, torch's ImageNet recipe), as kiln's SGD takes it now
** (kiln_optimizer_step: SGD_MULTI, one kernel call per device and dtype) against the
** composed rule it replaced (axpy for the decay, mul_scalar_ and axpy_ for the buffer,
** axpy_ for the parameter: 3-4 kernels a parameter), with the same numbers. Prints, for
** each, the step's time with a sync after it and the host's time to queue it, median of
** 5 rounds. --dtype bf16|f16|f64 for parameters of that dtype.
**
** Usage: bench-sgd-multi [--device D] [--steps N] [--dtype DT] [--json]   (N: 2 to 1000000, default 20)
** Public API only.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_nn.h>
#include <kiln_optim.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_args.h"
#include "bench_clock.h"


enum { MAXP = 256 };

/* The composed rule (src/optim/sgd.c before SGD_MULTI), momentum buffers in bufs. */
static kiln_status composed_step(int n, kiln_tensor **p, kiln_tensor **bufs, double lr, double mu, double wd) {
  for (int i = 0; i < n; i++) {
    kiln_scope_begin();
    kiln_tensor *g = kiln_axpy(kiln_grad(p[i]), wd, p[i]);
    kiln_status st = kiln_mul_scalar_(bufs[i], mu);
    if (st == KILN_OK) st = kiln_axpy_(bufs[i], 1.0, g);
    if (st == KILN_OK) st = kiln_axpy_(p[i], -lr, bufs[i]);
    kiln_scope_end();
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

int main(int argc, char **argv) {
  kiln_device dev = kiln_device_best();
  int steps = 20;
  bool json = false;
  kiln_dtype dt = KILN_F32;
  bench_args cli = bench_args_begin("bench-sgd-multi", "[--device D] [--steps N] [--dtype f32|bf16|f16|f64] [--json]",
                                    argc, argv);
  static const char *const dtype_names[] = {"f32", "bf16", "f16", "f64", NULL};
  static const kiln_dtype dtypes[] = {KILN_F32, KILN_BF16, KILN_F16, KILN_F64};
  for (const char *a; (a = bench_args_next(&cli));) {
    if (!strcmp(a, "--device")) bench_args_device(&cli, &dev);
    else if (!strcmp(a, "--steps")) steps = (int)bench_args_int(&cli, 2, 1000000); /* smaller was raised to 2 */
    else if (!strcmp(a, "--dtype")) dt = dtypes[bench_args_choice(&cli, dtype_names)];
    else if (!strcmp(a, "--json")) json = true;
    else bench_args_unknown(&cli);
  }
  kiln_module *m = kiln_resnet_new(50, 1000, false, KILN_F32, dev, NULL);
  if (!m || kiln_module_to_dtype(m, dt) != KILN_OK) {
    fprintf(stderr, "bench-sgd-multi: making ResNet-50: %s\n", kiln_last_error_message());
    return 1;
  }
  kiln_tensor *p[MAXP], *bufs[MAXP];
  int n = kiln_module_parameters(m, p, MAXP);
  int64_t values = 0;
  kiln_set_grad_enabled(false);
  kiln_generator *gen = kiln_generator_new(1);
  for (int i = 0; i < n; i++) {
    values += kiln_numel(p[i]);
    kiln_scope_begin();
    kiln_set_grad(p[i], kiln_mul_scalar(kiln_randn(kiln_ndim(p[i]), kiln_shape(p[i]), dt, dev, gen), 1e-3));
    kiln_scope_end();
    bufs[i] = kiln_keep(kiln_zeros_like(p[i]));
  }
  kiln_generator_free(gen);
  kiln_optim_config cfg = kiln_sgd_config(0.1);
  cfg.momentum = 0.9;
  cfg.weight_decay = 1e-4;
  kiln_optimizer *opt = kiln_optimizer_new(&cfg, p, n);
  if (!opt) {
    fprintf(stderr, "bench-sgd-multi: %s\n", kiln_last_error_message());
    return 1;
  }
  char dname[32];
  kiln_device_str(dev, dname, sizeof dname);
  if (json)
    printf("{\"bench\": \"sgd-multi\", \"device\": \"%s\", \"dtype\": \"%s\", \"params\": %d, \"values\": %lld", dname,
           kiln_dtype_name(dt), n, (long long)values);
  else
    printf("bench-sgd-multi on %s: ResNet-50's %d parameters (%lld values, %s), SGD momentum 0.9 wd 1e-4, %d steps a round\n",
           dname, n, (long long)values, kiln_dtype_name(dt), steps);
  for (int mode = 0; mode < 2; mode++) {
    const char *name = mode ? "sgd_multi" : "composed";
    double rw[5], rq[5];
    for (int r = -1; r < 5; r++) { /* round -1: warm-up */
      kiln_device_synchronize(dev);
      double t0 = now(), queued = 0;
      for (int k = 0; k < steps; k++) {
        double q0 = now();
        kiln_status st = mode ? kiln_optimizer_step(opt) : composed_step(n, p, bufs, 0.1, 0.9, 1e-4);
        queued += now() - q0;
        if (st != KILN_OK) {
          fprintf(stderr, "bench-sgd-multi: %s\n", kiln_last_error_message());
          return 1;
        }
        kiln_device_synchronize(dev);
      }
      if (r >= 0) {
        rw[r] = (now() - t0) / steps * 1e3;
        rq[r] = queued / steps * 1e3;
      }
    }
    qsort(rw, 5, sizeof rw[0], cmp);
    qsort(rq, 5, sizeof rq[0], cmp);
    if (json) printf(", \"%s_step_ms\": %.4f, \"%s_queue_ms\": %.4f", name, rw[2], name, rq[2]);
    else printf("%-10s step %8.4f ms (synced), host %8.4f ms to queue it\n", name, rw[2], rq[2]);
  }
  if (json) printf("}\n");
  kiln_optimizer_free(opt);
  for (int i = 0; i < n; i++) kiln_tensor_free(bufs[i]);
  kiln_module_free(m);
  return 0;
}
