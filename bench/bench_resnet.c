/*
** bench-resnet: kiln's ResNet training step beside PyTorch's in the same run. Both do the
** peer's workload (torch_peer.py `resnet`): torchvision's ResNet (ImageNet stem; 1000
** classes at size >= 128, else 10), SGD lr 0.1 momentum 0.9 weight decay 1e-4, one fixed
** batch of normal noise and random labels, forward (under bf16 autocast when asked) +
** cross-entropy + backward + step per timed step; the median step of steps 4..N. Prints
** images/s and peak memory for both and kiln / torch, then one --json line.
**
**   bench-resnet [--arch resnet18|resnet34|resnet50] [--size N] [--batch N] [--steps N]
**                [--device D] [--autocast bf16] [--compile] [--peer PATH] [--python PATH]
**                [--peer-threads N] [--no-peer] [--channels-last] [--channels-last-input]
**                [--profile] [--json]
**
** --channels-last lays kiln's model and batch out channels-last (kiln_module_to_format,
** kiln_contiguous_format), as the peer does on CUDA (model.to(memory_format=
** torch.channels_last)): cuDNN then reads and writes NHWC with no transposes.
** --channels-last-input lays out only the batch: the activations are channels-last all the
** way, each weight is laid out NHWC at its convolution (a copy of the weight, small beside
** the activations), and the parameters, their gradients and the optimizer stay NCHW.
**
** --profile prints kiln's per-op and per-module table (kiln_profiler_start, with device
** times: each op then waits for its device) over the steps after the first three. (KILN_PROFILE=1 does not reach this program: it links the static
** library, where nothing pulls in the profiler's load-time hook.)
** The peer: --peer PATH, else $KILN_TORCH_PEER, else the first that exists of
** .peer/torch_peer.py, ../shared/bench/torch_peer.py beside the source tree, then from the
** working directory, and /work/shared/bench/torch_peer.py (bench_peer.h). On the CPU
** it runs at OMP_NUM_THREADS 1 and kiln's thread count, and the faster is its figure (the
** peer at its best); --peer-threads N runs it at N alone. Peak memory: kiln's allocator
** high-water mark (kiln_memory_stats) and torch.cuda.max_memory_allocated; the peer reports
** none on the CPU.
** Defaults: resnet18, size 32, batch 64 on the CPU; resnet50, size 224, batch 256 on a GPU.
*/
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <kiln.h>
#include <kiln_nn.h>
#include <kiln_optim.h>

#include "bench_args.h"
#include "bench_clock.h"
#include "bench_peer.h"

#define PROG "bench-resnet"

static const char usage_text[] =
    "[--arch resnet18|resnet34|resnet50] [--size N] [--batch N] [--steps N]\n"
    "                    [--device D] [--autocast bf16] [--compile] [--peer PATH] [--python PATH]\n"
    "                    [--peer-threads N] [--no-peer] [--channels-last] [--channels-last-input]\n"
    "                    [--profile] [--json]";

typedef struct result {
  double ms, images_per_s, peak_gib, saved_gib, loss;
} result;

/* kiln's run. Returns 0, or 1 with the error printed. */
static int run_kiln(int depth, int64_t size, int64_t batch, int steps, kiln_device dev, bool bf16,
                    int channels_last, bool profile, result *out) {
  const int64_t classes = size >= 128 ? 1000 : 10;
  kiln_generator *gen = kiln_generator_new(0);
  kiln_module *model = kiln_resnet_new(depth, classes, false, KILN_F32, dev, gen);
  kiln_optim_config cfg = kiln_sgd_config(0.1);
  cfg.momentum = 0.9;
  cfg.weight_decay = 1e-4;
  kiln_optimizer *opt = model ? kiln_optimizer_new_module(&cfg, model) : NULL;
  kiln_tensor *x = kiln_randn(4, (int64_t[]){batch, 3, size, size}, KILN_F32, dev, gen);
  kiln_tensor *y = kiln_randint(0, classes, 1, (int64_t[]){batch}, KILN_I64, dev, gen);
  if (channels_last && model && x) {
    /* 1: the model and the batch; 2: the batch only */
    kiln_tensor *xc = channels_last == 2 || kiln_module_to_format(model, KILN_CHANNELS_LAST) == KILN_OK
                          ? kiln_contiguous_format(x, KILN_CHANNELS_LAST)
                          : NULL;
    kiln_tensor_free(x); /* no scope is open: xc is ours */
    x = xc;
  }
  double *t = calloc((size_t)steps, sizeof *t);
  int rc = 0;
  if (!model || !opt || !x || !y || !t) {
    fprintf(stderr, PROG ": setting up kiln's resnet: %s\n", kiln_last_error_message());
    rc = 1;
  }
  kiln_memory_reset_peak(dev);
  kiln_autograd_saved_reset_peak();
  double loss = NAN;
  for (int s = 0; s < steps && !rc; s++) {
    kiln_device_synchronize(dev);
    if (profile && s == (steps > 3 ? 3 : 0) &&
        kiln_profiler_start(&(kiln_profiler_options){.device_time = true}) != KILN_OK)
      fprintf(stderr, PROG ": --profile: %s\n", kiln_last_error_message());
    double t0 = now();
    kiln_scope_begin();
    kiln_status st = bf16 ? kiln_autocast_begin(dev.type, KILN_BF16) : KILN_OK;
    kiln_tensor *l = kiln_cross_entropy(kiln_module_forward(model, x), y, KILN_REDUCTION_MEAN, -100, 0.0);
    if (bf16 && st == KILN_OK) st = kiln_autocast_end();
    if (st == KILN_OK) st = kiln_backward(l, NULL);
    if (st == KILN_OK) st = kiln_optimizer_step(opt);
    if (st == KILN_OK) st = kiln_optimizer_zero_grad(opt);
    if (st == KILN_OK && s == steps - 1) loss = kiln_item(l);
    kiln_scope_end();
    kiln_device_synchronize(dev);
    t[s] = now() - t0;
    if (st != KILN_OK) {
      fprintf(stderr, PROG ": kiln step %d: %s\n", s, kiln_last_error_message());
      rc = 1;
    }
  }
  if (profile && kiln_profiler_enabled()) kiln_profiler_stop(stdout);
  if (!rc) {
    /* the peer's statistic: the median of the steps after the first three */
    int skip = steps > 3 ? 3 : 0;
    qsort(t + skip, (size_t)(steps - skip), sizeof *t, cmp);
    double med = t[skip + (steps - skip) / 2];
    kiln_memory_stats ms;
    out->ms = med * 1e3;
    out->images_per_s = (double)batch / med;
    out->peak_gib = kiln_memory_stats_get(dev, &ms) == KILN_OK ? (double)ms.peak_allocated / 1073741824.0 : NAN;
    int64_t live, saved_peak;
    kiln_autograd_saved_bytes(&live, &saved_peak);
    out->saved_gib = (double)saved_peak / 1073741824.0;
    out->loss = loss;
  }
  free(t);
  kiln_tensor_free(x);
  kiln_tensor_free(y);
  kiln_optimizer_free(opt);
  kiln_module_free(model);
  kiln_generator_free(gen);
  return rc;
}

/* The peer's run at its best thread count (peer_run_best: on the CPU OMP_NUM_THREADS 1 and
** kiln's count, the faster taken, both printed; flag > 0: that alone): its JSON line into
** line, parsed into out, its count into *threads (0: unset). Returns 0, or 1 with the reason
** printed. */
static int run_peer(const char *python, const char *peer, const char *arch, int64_t size,
                    int64_t batch, int steps, const char *devname, bool bf16, bool compile,
                    bool cpu, int flag, result *out, char *line, size_t line_n, int *threads) {
  char tail[2048];
  snprintf(tail, sizeof tail, "%s '%s' resnet --arch %s --size %lld --batch %lld --steps %d --device %s%s%s", python,
           peer, arch, (long long)size, (long long)batch, steps, devname, bf16 ? "" : " --no-amp",
           compile ? " --compile" : "");
  if (!peer_run_best(PROG, cpu, flag, tail, "images_per_s", "images/s", 0, line, line_n, threads)) return 1;
  out->ms = json_num(line, "ms_per_step");
  out->images_per_s = json_num(line, "images_per_s");
  out->peak_gib = json_num(line, "peak_gib");
  out->loss = json_num(line, "loss");
  return 0;
}

int main(int argc, char **argv) {
  const char *arch = "resnet18", *amp = NULL, *peer_flag = NULL, *python = "python3";
  long long size = 0, batch = 0, steps = 15;
  int peer_threads = 0;
  bool json = false, no_peer = false, compile = false, arch_set = false, profile = false;
  int channels_last = 0; /* 1: model and batch; 2: the batch only */
  bench_args cli = bench_args_begin(PROG, usage_text, argc, argv);
  static const char *const archs[] = {"resnet18", "resnet34", "resnet50", NULL};
  static const int depths[] = {18, 34, 50};
  int depth = 18;
  kiln_device dev = kiln_device_best();
  for (const char *a; (a = bench_args_next(&cli));) {
    if (!strcmp(a, "--json")) json = true;
    else if (!strcmp(a, "--no-peer")) no_peer = true;
    else if (!strcmp(a, "--compile")) compile = true;
    else if (!strcmp(a, "--profile")) profile = true;
    else if (!strcmp(a, "--channels-last")) channels_last = 1;
    else if (!strcmp(a, "--channels-last-input")) channels_last = 2;
    else if (!strcmp(a, "--arch")) {
      int ai = bench_args_choice(&cli, archs);
      arch = archs[ai], depth = depths[ai], arch_set = true;
    } else if (!strcmp(a, "--device")) bench_args_device(&cli, &dev);
    else if (!strcmp(a, "--autocast")) {
      amp = bench_args_value(&cli);
      if (strcmp(amp, "bf16")) bench_args_fail(&cli, "--autocast '%s': only bf16 (the peer's autocast dtype)", amp);
    } else if (!strcmp(a, "--peer")) peer_flag = bench_args_value(&cli);
    else if (!strcmp(a, "--python")) python = bench_args_value(&cli);
    else if (!strcmp(a, "--size")) size = bench_args_int(&cli, 16, 100000);
    else if (!strcmp(a, "--batch")) batch = bench_args_int(&cli, 1, 100000);
    else if (!strcmp(a, "--steps")) steps = bench_args_int(&cli, 1, 100000);
    else if (!strcmp(a, "--peer-threads")) peer_threads = (int)bench_args_int(&cli, 0, 100000);
    else bench_args_unknown(&cli);
  }
  bool gpu = dev.type != KILN_DEVICE_CPU;
  if (!arch_set && gpu) arch = "resnet50", depth = 50;
  if (!size) size = gpu ? 224 : 32;
  if (!batch) batch = gpu ? 256 : 64;
  char dname[32];
  kiln_device_str(dev, dname, sizeof dname);
  const bool bf16 = amp != NULL;

  result k = {NAN, NAN, NAN, NAN, NAN}, t = {NAN, NAN, NAN, NAN, NAN};
  printf("%s, size %lld, batch %lld, %s, %s%s, %lld steps (median of %s)\n", arch, size, batch,
         dname, bf16 ? "bf16 autocast" : "f32",
         channels_last == 1 ? ", kiln channels-last" : channels_last == 2 ? ", kiln channels-last input" : "", steps,
         steps > 3 ? "steps 4.." : "all");
  if (run_kiln(depth, size, batch, (int)steps, dev, bf16, channels_last, profile, &k)) return 1;
  printf("kiln : %8.1f images/s  %8.2f ms/step  peak %.2f GiB  saved for backward %.2f GiB counted per save  (%d threads)\n",
         k.images_per_s, k.ms, k.peak_gib, k.saved_gib, kiln_num_threads());
  char line[4096] = "";
  const char *peer = no_peer ? NULL : find_peer(peer_flag);
  int peer_rc = 1;
  if (!no_peer && !peer)
    fprintf(stderr, PROG ": torch_peer.py not found (pass --peer PATH or set KILN_TORCH_PEER)\n");
  if (peer && !peer_steps_ok(PROG, (long long)steps)) peer = NULL;
  if (peer) {
    /* the peer names the device as torch does: cuda, cpu */
    const char *pdev = dev.type == KILN_DEVICE_CPU ? "cpu" : dev.type == KILN_DEVICE_CUDA ? "cuda" : "auto";
    peer_rc = run_peer(python, peer, arch, size, batch, (int)steps, pdev, bf16, compile, dev.type == KILN_DEVICE_CPU,
                       peer_threads, &t, line, sizeof line, &peer_threads);
    if (!peer_rc) {
      printf("torch: %8.1f images/s  %8.2f ms/step  peak ", t.images_per_s, t.ms);
      if (isnan(t.peak_gib)) printf("n/a");
      else printf("%.2f GiB", t.peak_gib);
      char thr[48] = "default threads";
      if (peer_threads) snprintf(thr, sizeof thr, "OMP_NUM_THREADS=%d", peer_threads);
      printf("  (%s%s)\n", compile ? "torch.compile, " : "", thr);
      printf("kiln / torch: %.2fx images/s", k.images_per_s / t.images_per_s);
      if (!isnan(t.peak_gib) && t.peak_gib > 0) printf(", %.2fx peak memory", k.peak_gib / t.peak_gib);
      printf("\n");
    }
  }
  if (json) {
    double ratio = peer_rc ? NAN : k.images_per_s / t.images_per_s;
    printf("{\"bench\":\"resnet\",\"arch\":\"%s\",\"size\":%lld,\"batch\":%lld,\"device\":\"%s\","
           "\"autocast\":\"%s\",\"channels_last\":%s,\"steps\":%lld,\"threads\":%d,\"kiln_images_per_s\":%.1f,"
           "\"kiln_ms_per_step\":%.3f,\"kiln_peak_gib\":%.3f,\"kiln_saved_gib\":%.3f,\"kiln_loss\":%.4f",
           arch, size, batch, dname, bf16 ? "bf16" : "off", channels_last == 1 ? "true" : channels_last == 2 ? "\"input\"" : "false", steps, kiln_num_threads(),
           k.images_per_s, k.ms, k.peak_gib, k.saved_gib, k.loss);
    if (!peer_rc) {
      printf(",\"torch_images_per_s\":%.1f,\"torch_ms_per_step\":%.3f,\"ratio\":%.3f", t.images_per_s,
             t.ms, ratio);
      if (!isnan(t.peak_gib)) printf(",\"torch_peak_gib\":%.3f", t.peak_gib);
      printf(",\"torch_compile\":%s,\"peer_threads\":%d", compile ? "true" : "false", peer_threads);
    }
    printf(",\"kiln\":\"%s\"}\n", kiln_version());
  }
  kiln_fallback_report(stderr);
  return peer && peer_rc ? 1 : 0;
}
