/*
** The batch-size sweep of torch_peer.py `bs-sweep`: the seed MLP (Linear(64,128), ReLU,
** Linear(128,2), Adam lr 1e-3, cross-entropy) for one warm-up epoch and one timed epoch
** over 20000 samples at batch 32, 128, 1024 and 8192, through the loader (shuffled).
** Prints a table and one JSON line per batch size.
**
**   bench-sweep [--device D] [--batches 32,128,1024,8192]
*/
#define _POSIX_C_SOURCE 200809L /* clock_gettime: clang does not get it by default */
#include <kiln.h>
#include <kiln_data.h>
#include <kiln_nn.h>
#include <kiln_optim.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_args.h"

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define TRY(x)                                                                            \
  do {                                                                                    \
    if (!(x)) {                                                                           \
      fprintf(stderr, "bench-sweep: %s failed: %s\n", #x, kiln_last_error_message());    \
      return 1;                                                                           \
    }                                                                                     \
  } while (0)

int main(int argc, char **argv) {
  kiln_device dev = kiln_device_best();
  int64_t batches[8] = {32, 128, 1024, 8192};
  int nb = 4;
  bench_args cli = bench_args_begin("bench-sweep", "[--device D] [--batches 32,128,...]   (up to 8 batch sizes)",
                                    argc, argv);
  for (const char *a; (a = bench_args_next(&cli));) {
    if (!strcmp(a, "--device")) bench_args_device(&cli, &dev);
    else if (!strcmp(a, "--batches")) nb = bench_args_int_list(&cli, batches, 8, 1, 1000000);
    else bench_args_unknown(&cli);
  }
  char dname[32];
  kiln_device_str(dev, dname, sizeof dname);
  kiln_manual_seed(0);
  kiln_tensor *x = kiln_randn(KILN_SHAPE(20000, 64), KILN_F32, kiln_device_cpu(), NULL);
  kiln_tensor *y = kiln_to_dtype(kiln_gt_scalar(kiln_sum(x, KILN_DIMS(1), false), 0.0), KILN_I64);
  TRY(x && y);
  kiln_tensor *fields[2] = {x, y};
  kiln_dataset *ds = kiln_tensor_dataset_new(2, fields);
  TRY(ds);
  printf("%8s %14s\n", "batch", "samples/s");
  for (int b = 0; b < nb; b++) {
    kiln_module *m = kiln_sequential_new();
    TRY(m);
    TRY(kiln_sequential_append(m, kiln_linear_new(64, 128, true, KILN_F32, dev, NULL)) == KILN_OK);
    TRY(kiln_sequential_append(m, kiln_relu_new()) == KILN_OK);
    TRY(kiln_sequential_append(m, kiln_linear_new(128, 2, true, KILN_F32, dev, NULL)) == KILN_OK);
    kiln_optim_config cfg = kiln_adam_config(1e-3);
    kiln_optimizer *opt = kiln_optimizer_new_module(&cfg, m);
    TRY(opt);
    kiln_loader_opts lo = kiln_loader_opts_default();
    lo.batch_size = batches[b];
    lo.shuffle = true;
    lo.device = dev;
    kiln_loader *ld = kiln_loader_new(ds, &lo);
    TRY(ld);
    double dt = 0;
    for (int epoch = 0; epoch < 2; epoch++) {
      kiln_device_synchronize(dev);
      double t0 = now();
      TRY(kiln_loader_epoch(ld, (uint64_t)epoch) == KILN_OK);
      for (;;) {
        kiln_scope_begin();
        kiln_tensor *bt[2];
        int r = kiln_loader_next(ld, bt);
        if (r <= 0) {
          kiln_scope_end();
          TRY(r == 0);
          break;
        }
        kiln_tensor *loss = kiln_cross_entropy(kiln_module_forward(m, bt[0]), bt[1], KILN_REDUCTION_MEAN, -100, 0.0);
        TRY(kiln_optimizer_zero_grad(opt) == KILN_OK);
        TRY(kiln_backward(loss, NULL) == KILN_OK);
        TRY(kiln_optimizer_step(opt) == KILN_OK);
        kiln_scope_end();
      }
      kiln_device_synchronize(dev);
      dt = now() - t0;
    }
    double sps = 20000.0 / dt;
    printf("%8lld %14.0f\n", (long long)batches[b], sps);
    printf("{\"workload\": \"bs-sweep\", \"engine\": \"kiln\", \"device\": \"%s\", \"batch\": %lld, \"samples_per_s\": %.0f}\n",
           dname, (long long)batches[b], sps);
    kiln_loader_free(ld);
    kiln_optimizer_free(opt);
    kiln_module_free(m);
  }
  kiln_dataset_free(ds);
  kiln_tensor_free(x);
  kiln_tensor_free(y);
  return 0;
}
