/*
** resnet: ResNet-18 (kiln_resnet_new, torchvision's structure with the CIFAR stem: a 3x3
** stride-1 first conv and no max-pool) trained on Fashion-MNIST padded to 32x32, the
** usual CIFAR recipe: augmentation by random crop (padding 4) and horizontal flip on the
** loader's worker threads (kiln_transform_dataset_new), SGD momentum 0.9, weight decay
** 5e-4 on every parameter, lr 0.1 annealed by a per-step cosine to 0 over the run, batch
** 128, cross-entropy. After each epoch: test accuracy (eval mode: batch norm's running
** statistics) and a checkpoint (model with its batch-norm buffers, optimizer, scheduler,
** RNG, epoch, step).
**
** The images have one channel; the model is torchvision's, which takes three (so its
** weights and names stay those of the parity test): each batch's channel is replicated to
** three (as torchvision's Grayscale(num_output_channels=3)), on the device, after the
** loader. Normalization uses Fashion-MNIST's training mean and std (0.2860, 0.3530).
**
** Usage: resnet [--data DIR] [--epochs N] [--batch N] [--lr X] [--device D]
**               [--checkpoint PATH] [--resume] [--until N] [--limit N] [--test-limit N]
**               [--workers N] [--seed N] [--json] [--quiet] [--logdir DIR]
**               [--autocast bf16|f16]
** --epochs is the total (default 20): with --resume the run continues from the
** checkpoint's epoch up to N. The cosine schedule spans --epochs, so a run split into
** sessions keeps --epochs and stops each session with --until N (after epoch N, with its
** checkpoint), as the gpt example's --until does for steps. --limit N trains on the first N training images, --test-limit N evaluates on the
** first N test images (quick runs: on 2 CPU cores one step of batch 128 takes seconds, so
** the full run is for a GPU, where the goal is test accuracy >= 0.93).
** Same seed, same numbers: the weights come from --seed, the shuffle from (seed, epoch),
** the augmentation from (seed, epoch, image), whatever --workers.
*/
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <kiln.h>
#include <kiln_checkpoint.h>
#include <kiln_data.h>
#include <kiln_io.h>
#include <kiln_nn.h>
#include <kiln_optim.h>

#include "common/launch.h"
#include "common/logdir.h"
#include "common/output.h"
#include "common/options.h"
#include "common/progress.h"
#include "common/fmnist_data.h"

#define PROG "resnet"
#define EVAL_BATCH 500

static const float FM_MEAN[1] = {0.2860f}, FM_STD[1] = {0.3530f};

static void usage(FILE *f) {
  fprintf(f,
          "usage: " PROG " [--data DIR] [--epochs N] [--batch N] [--lr X] [--device D]\n"
          "              [--checkpoint PATH] [--resume] [--until N] [--limit N] [--test-limit N]\n"
          "              [--workers N] [--seed N] [--json] [--quiet] [--logdir DIR] [--autocast bf16|f16]\n"
          "  ResNet-18 (CIFAR stem) on Fashion-MNIST padded to 32x32, random crop + flip, SGD\n"
          "  momentum 0.9, weight decay 5e-4, cosine lr from 0.1. Defaults: data from\n"
          "  $KILN_DATA_DIR or /usr/share/datasets/fashion-mnist, 20 epochs, batch 128, 2 loader\n"
          "  workers, the best device, checkpoint resnet.ckpt.safetensors (after every epoch).\n"
          "  --epochs is the total number of epochs (the cosine spans them); --until N stops after\n"
          "  epoch N; --resume continues from the checkpoint.\n");
}

/* Everything main makes, released on every way out. NULL members are skipped. */
static struct {
  kiln_tensor *t[4]; /* x, y, tx, ty */
  kiln_module *model;
  kiln_optimizer *opt;
  kiln_scheduler *sched;
  kiln_dataset *ds, *aug, *tds, *tnorm;
  kiln_loader *loader, *tloader;
  kiln_summary_writer *tb;
} R;

static void release(void) {
  kiln_loader_free(R.loader);
  kiln_loader_free(R.tloader);
  kiln_dataset_free(R.aug);
  kiln_dataset_free(R.tnorm);
  kiln_dataset_free(R.ds);
  kiln_dataset_free(R.tds);
  kiln_scheduler_free(R.sched);
  kiln_optimizer_free(R.opt);
  kiln_module_free(R.model);
  for (int i = 0; i < 4; i++) kiln_tensor_free(R.t[i]);
  ex_log_close(R.tb);
  memset(&R, 0, sizeof R);
}

EX_DEFINE_EXITS(PROG, release)

/* (B, 1, 32, 32) -> (B, 3, 32, 32): the grey channel three times, as the model takes RGB. */
static kiln_tensor *to_rgb(kiln_tensor *x) {
  if (!x) return NULL;
  return kiln_contiguous(kiln_expand(x, 4, (int64_t[]){kiln_size(x, 0), 3, kiln_size(x, 2), kiln_size(x, 3)}));
}

/* Test accuracy over the test loader: eval mode, no graph. NAN on error. */
static double evaluate(kiln_module *model, kiln_loader *tl, const char *amp, kiln_device dev) {
  bool prev = kiln_set_grad_enabled(false);
  kiln_module_eval(model);
  int64_t n = 0, correct = 0;
  bool ok = kiln_loader_epoch(tl, 0) == KILN_OK;
  while (ok) {
    kiln_scope_begin();
    kiln_tensor *b[2];
    int r = kiln_loader_next(tl, b);
    if (r == 1) {
      kiln_status st = amp ? kiln_autocast_begin(dev.type, !strcmp(amp, "f16") ? KILN_F16 : KILN_BF16) : KILN_OK;
      kiln_tensor *logits = st == KILN_OK ? kiln_module_forward(model, to_rgb(b[0])) : NULL;
      if (amp && st == KILN_OK && kiln_autocast_end() != KILN_OK) logits = NULL;
      double c = kiln_item(kiln_sum_all(kiln_to_dtype(kiln_eq(kiln_argmax(logits, 1, false), b[1]), KILN_I64)));
      if (isnan(c)) ok = false;
      correct += (int64_t)c;
      n += kiln_size(b[1], 0);
    }
    kiln_scope_end();
    if (r != 1) {
      ok = ok && r == 0;
      break;
    }
  }
  kiln_module_train(model, true);
  kiln_set_grad_enabled(prev);
  return ok && n > 0 ? (double)correct / (double)n : NAN;
}

int main(int argc, char **argv) {
  long long epochs = 20, until = 0, batch = 128, limit = 0, test_limit = 0, workers = 2, seed = 0;
  double lr = 0.1;
  bool json = false, quiet = false, resume = false;
  const char *logdir = NULL, *amp = NULL;
  const char *devname = NULL, *data = NULL, *ckpt = "resnet.ckpt.safetensors";
  const ex_opt opts[] = {{.name = "--json", .kind = EX_FLAG, .out = &json},
                         {.name = "--quiet", .kind = EX_FLAG, .out = &quiet, .alias = "-q"},
                         {.name = "--resume", .kind = EX_FLAG, .out = &resume},
                         {.name = "--device", .kind = EX_STR, .out = &devname},
                         {.name = "--data", .kind = EX_STR, .out = &data},
                         {.name = "--logdir", .kind = EX_STR, .out = &logdir},
                         {.name = "--autocast", .kind = EX_AUTOCAST, .out = &amp},
                         {.name = "--checkpoint", .kind = EX_STR, .out = &ckpt},
                         {.name = "--epochs", .kind = EX_INT, .out = &epochs, .lo = 1, .hi = 100000},
                         {.name = "--until", .kind = EX_INT, .out = &until, .lo = 1, .hi = 100000},
                         {.name = "--batch", .kind = EX_INT, .out = &batch, .lo = 1, .hi = 60000},
                         {.name = "--limit", .kind = EX_INT, .out = &limit, .lo = 1, .hi = 60000},
                         {.name = "--test-limit", .kind = EX_INT, .out = &test_limit, .lo = 1, .hi = 10000},
                         {.name = "--workers", .kind = EX_INT, .out = &workers, .lo = 0, .hi = 64},
                         {.name = "--seed", .kind = EX_INT, .out = &seed, .lo = 0, .hi = 2147483647},
                         {.name = "--lr", .kind = EX_NUM, .out = &lr, .lo = 0, .hi = 10},
                         {.name = NULL}};
  int prc = ex_parse_args(PROG, argc, argv, opts, usage);
  if (prc >= 0) return prc;
  if (until > epochs) {
    fprintf(stderr, PROG ": --until %lld is past --epochs %lld\n", until, epochs);
    return 2;
  }
  if (ex_check_env(PROG, devname != NULL)) return 2;
  if (ex_check_output(PROG, ckpt)) return 2;
  kiln_device dev = kiln_device_best();
  char dname[32];
  if (ex_device(PROG, devname, &dev, dname)) return 2;
  if (resume && ex_check_resume(PROG, ckpt)) return 2;
  R.tb = ex_log_open(PROG, logdir);

  static const char needs[] = "this example pads 28 x 28 images (N, 28, 28) to 32 x 32";
  if (ex_load_fmnist(PROG, data, needs, limit, test_limit, R.t)) return finish(1);
  kiln_tensor *x = R.t[0], *y = R.t[1], *tx = R.t[2], *ty = R.t[3];
  const int64_t ntrain = kiln_size(x, 0), ntest = kiln_size(tx, 0);

  /* Training images: pad 28 -> 32, then RandomCrop(32, padding=4) and a flip, then
  ** Normalize; test images: pad and Normalize only. Both run on the loader's workers. */
  kiln_transform train_t[4] = {
      kiln_transform_pad(2, KILN_PAD_CONSTANT),
      kiln_transform_random_crop(32, 32, 4, KILN_PAD_CONSTANT),
      kiln_transform_random_hflip(0.5),
      kiln_transform_normalize(1, FM_MEAN, FM_STD),
  };
  kiln_transform test_t[2] = {kiln_transform_pad(2, KILN_PAD_CONSTANT),
                              kiln_transform_normalize(1, FM_MEAN, FM_STD)};
  R.ds = kiln_tensor_dataset_new(2, (kiln_tensor *[]){x, y});
  R.tds = kiln_tensor_dataset_new(2, (kiln_tensor *[]){tx, ty});
  R.aug = R.ds ? kiln_transform_dataset_new(R.ds, 0, 4, train_t, (uint64_t)seed) : NULL;
  R.tnorm = R.tds ? kiln_transform_dataset_new(R.tds, 0, 2, test_t, 0) : NULL;
  if (!R.aug || !R.tnorm) return fail("making the image transforms");
  kiln_loader_opts lo = kiln_loader_opts_default();
  lo.batch_size = batch;
  lo.shuffle = true;
  lo.seed = (uint64_t)seed;
  lo.num_workers = (int)workers;
  lo.device = dev;
  R.loader = kiln_loader_new(R.aug, &lo);
  lo.batch_size = EVAL_BATCH;
  lo.shuffle = false;
  R.tloader = kiln_loader_new(R.tnorm, &lo);
  if (!R.loader || !R.tloader) return fail("making the loaders");
  const int64_t steps_per_epoch = kiln_loader_len(R.loader);

  kiln_manual_seed((uint64_t)seed);
  kiln_module *model = R.model = kiln_resnet_new(18, 10, true, KILN_F32, dev, NULL);
  if (!model) return fail("building the model");
  kiln_optim_config cfg = kiln_sgd_config(lr);
  cfg.momentum = 0.9;
  cfg.weight_decay = 5e-4;
  kiln_optimizer *opt = R.opt = kiln_optimizer_new_module(&cfg, model);
  if (!opt) return fail("making the optimizer");
  kiln_scheduler *sched = R.sched = kiln_cosine_lr_new(opt, epochs * steps_per_epoch, 0.0, 0, 0.0);
  if (!sched) return fail("making the lr schedule");

  int64_t start_epoch = 0, step = 0;
  double last_loss = NAN, test_acc = NAN;
  if (resume) {
    kiln_dict *extra = NULL;
    if (kiln_checkpoint_load(ckpt, model, opt, sched, NULL, &start_epoch, &step, &extra) != KILN_OK)
      return fail("resuming from the checkpoint");
    ex_resume_meta(PROG, extra, start_epoch, epochs, batch, ntrain, &last_loss, &test_acc);
    const char *s;
    if ((s = kiln_dict_get_meta(extra, "epochs")) && strtoll(s, NULL, 10) != epochs)
      fprintf(stderr, PROG ": warning: the checkpoint's cosine schedule spans %s epochs, this run's %lld: the lr "
                      "continues from the checkpoint's schedule\n", s, epochs);
    kiln_dict_free(extra);
    if (!quiet) printf("resumed from %s: epoch %lld, step %lld\n", ckpt, (long long)start_epoch, (long long)step);
  }

  if (!quiet) {
    char pb[32];
    printf("device: %s\ntrain: %lld images, test: %lld images, %lld steps per epoch\n", dname,
           (long long)ntrain, (long long)ntest, (long long)steps_per_epoch);
    printf("parameters: %lld (%s)\n", (long long)kiln_module_num_params(model),
           kiln_format_bytes(kiln_module_param_bytes(model), pb, sizeof pb));
    fflush(stdout);
  }

  double train_s = 0;
  int64_t images = 0;
  char label[64];
  const int64_t stop = until ? until : epochs;
  for (int64_t e = start_epoch; e < stop; e++) {
    kiln_device_synchronize(dev);
    double t0 = ex_now();
    if (kiln_loader_epoch(R.loader, (uint64_t)e) != KILN_OK) return fail("starting an epoch");
    snprintf(label, sizeof label, "epoch %lld/%lld", (long long)e + 1, epochs);
    ex_progress p;
    ex_progress_begin(&p, label, ntrain, !quiet);
    double total = 0;
    int64_t n = 0, seen = 0;
    for (;;) {
      kiln_scope_begin(); /* one step */
      kiln_tensor *b[2];
      int r = kiln_loader_next(R.loader, b);
      kiln_status st = KILN_OK;
      double lv = 0;
      if (r == 1) {
        if (amp) st = kiln_autocast_begin(dev.type, !strcmp(amp, "f16") ? KILN_F16 : KILN_BF16);
        kiln_tensor *loss = kiln_cross_entropy(kiln_module_forward(model, to_rgb(b[0])), b[1],
                                               KILN_REDUCTION_MEAN, -100, 0.0);
        if (amp && st == KILN_OK) st = kiln_autocast_end();
        if (st != KILN_OK) loss = NULL;
        kiln_optimizer_zero_grad(opt);
        st = kiln_backward(loss, NULL);
        if (st == KILN_OK) st = kiln_optimizer_step(opt);
        if (st == KILN_OK) st = kiln_scheduler_step(sched);
        if (st == KILN_OK) lv = kiln_item(loss);
        seen += kiln_size(b[0], 0);
      }
      kiln_scope_end();
      if (r < 0 || st != KILN_OK) return fail(r < 0 ? "loading a batch" : "training step");
      if (r == 0) break;
      total += lv;
      n++;
      step++;
      ex_log_scalar(&R.tb, "train/loss", step, lv);
      ex_progress_update(&p, seen);
    }
    kiln_device_synchronize(dev);
    double dt = ex_now() - t0;
    ex_progress_end(&p);
    train_s += dt;
    images += seen;
    last_loss = n ? total / (double)n : NAN;
    test_acc = evaluate(model, R.tloader, amp, dev);
    if (isnan(test_acc)) return fail("evaluating");
    ex_log_epoch(&R.tb, step, last_loss, kiln_scheduler_get_lr(sched), dt > 0 ? (double)seen / dt : 0.0, dev);
    ex_log_scalar(&R.tb, "epoch/test_acc", step, test_acc);

    kiln_dict *extra = kiln_dict_new();
    ex_meta_real(extra, "train_loss", last_loss);
    ex_meta_real(extra, "test_acc", test_acc);
    ex_meta_int(extra, "batch", batch);
    ex_meta_int(extra, "epochs", epochs);
    ex_meta_int(extra, "train_samples", ntrain);
    kiln_status cs = kiln_checkpoint_save(ckpt, model, opt, sched, NULL, e + 1, step, extra);
    kiln_dict_free(extra);
    if (cs != KILN_OK) return fail("saving the checkpoint");
    if (!quiet) {
      printf("Epoch %lld, Loss: %.4f, Test accuracy: %.4f, lr %.4g (%.2f s, %.0f images/s)\n", (long long)e + 1,
             last_loss, test_acc, kiln_scheduler_get_lr(sched), dt, dt > 0 ? (double)seen / dt : 0.0);
      fflush(stdout);
    }
  }
  if (isnan(test_acc)) {
    test_acc = evaluate(model, R.tloader, amp, dev);
    if (isnan(test_acc)) return fail("evaluating");
  }
  if (!quiet) printf("test accuracy: %.4f, checkpoint: %s\n", test_acc, ckpt);
  if (json)
    printf("{\"example\":\"resnet\",\"device\":\"%s\",\"epochs\":%lld,\"start_epoch\":%lld,"
           "\"batch\":%lld,\"train_samples\":%lld,\"test_samples\":%lld,\"seconds\":%.4f,\"images_per_s\":%.0f,"
           "\"final_loss\":%.17g,\"test_acc\":%.4f,\"steps\":%lld,\"world_size\":1,\"seed\":%lld,"
           "\"workers\":%lld,\"autocast\":\"%s\",\"kiln\":\"%s\"}\n",
           dname, epochs, (long long)start_epoch, batch, (long long)ntrain, (long long)ntest, train_s,
           train_s > 0 ? (double)images / train_s : 0.0, last_loss, test_acc, (long long)step, seed,
           workers, amp ? amp : "off", kiln_version());
  fflush(stdout);
  kiln_fallback_report(stderr);
  return finish(0);
}
