/*
** fashion-mnist: an MLP or a CNN on Fashion-MNIST, the PyTorch peer's `fmnist-mlp` and
** `fmnist-cnn` workloads (../shared/bench/torch_peer.py):
**   --model mlp (default): Flatten, Linear(784, 256), ReLU, Linear(256, 10)
**   --model cnn: Conv2d(1, 32, 3), ReLU, MaxPool2d(2), Conv2d(32, 64, 3), ReLU,
**                MaxPool2d(2), Flatten, Linear(1600, 128), ReLU, Linear(128, 10)
**                (the images as (N, 1, 28, 28); no padding, as the peer)
** cross-entropy, Adam lr 1e-3, batch 128, shuffled. After each epoch: test accuracy (eval
** mode, no grad, batches of 1000) and a checkpoint (model, optimizer, RNG, epoch, step).
**
** Usage: fashion-mnist [--model mlp|cnn] [--data DIR] [--epochs N] [--batch N] [--lr X] [--device D]
**                      [--checkpoint PATH] [--resume] [--limit N] [--workers N]
**                      [--seed N] [--json] [--quiet] [--logdir DIR] [--autocast bf16|f16] [--graph] [--tf32]
** --tf32 lets f32 products and convolutions use TF32 tensor cores (kiln_set_matmul_tf32),
** as PyTorch's convolutions do by default (torch.backends.cudnn.allow_tf32); off, f32 is
** exact.
** --graph records the training step once per batch shape (the full batch and the smaller
** last one, each after one eager step at that shape) and replays it: a CUDA graph on a
** GPU, the same calls run again on the CPU (common/graph_step.h). It trains exactly as
** the eager loop does; it is for one process (the gradient all-reduce is not captured).
** The steps' losses are summed on the device and read once per epoch (each step's with
** --logdir, which logs them), so the host does not wait for the device inside an epoch.
** --autocast runs each step's forward under autocast (kiln_autocast_begin): the products in
** bf16 or f16, the loss in f32, the parameters and their gradients f32. f16 without a loss
** scaler can underflow small gradients; bf16 needs none.
** --epochs is the total: with --resume the run continues from the checkpoint's epoch up
** to N (so the same command line can be run again after an interruption).
** --limit N trains on the first N training images (for quick tests).
** --seed N seeds the initial weights and the shuffle (default 0): test accuracy after 5
** epochs moves by a few tenths of a percent from one seed to the next, so comparisons with
** the PyTorch peer's are made over several seeds.
**
** Under mpirun (mpirun -np N fashion-mnist ...) it trains data-parallel: a shard of each
** epoch per rank, batch / N images a step each, gradients averaged (kiln_ddp); rank 0
** alone prints, evaluates and writes the checkpoint, and the JSON gains world_size.
*/
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <kiln.h>
#include <kiln_checkpoint.h>
#include <kiln_dist.h>
#include <kiln_data.h>
#include <kiln_io.h>
#include <kiln_nn.h>
#include <kiln_optim.h>

#include "common/graph_step.h"
#include "common/launch.h"
#include "common/output.h"
#include "common/logdir.h"
#include "common/options.h"
#include "common/progress.h"
#include "common/fmnist_data.h"

#define PROG "fashion-mnist"
#define EVAL_BATCH 1000

static void usage(FILE *f) {
  fprintf(f,
          "usage: " PROG " [--model mlp|cnn] [--data DIR] [--epochs N] [--batch N] [--lr X] [--device D]\n"
          "                     [--checkpoint PATH] [--resume] [--limit N] [--workers N]\n"
          "                     [--seed N] [--json] [--quiet] [--logdir DIR] [--autocast bf16|f16] [--graph] [--tf32]\n"
          "  MLP 784-256-10 (--model mlp, the default) or CNN conv32-pool-conv64-pool-fc128-fc10\n"
          "  (--model cnn) on Fashion-MNIST with Adam. Defaults: data from $KILN_DATA_DIR or\n"
          "  /usr/share/datasets/fashion-mnist, 5 epochs, batch 128, lr 1e-3, the best device,\n"
          "  checkpoint fashion-mnist.ckpt.safetensors (written after every epoch).\n"
          "  --epochs is the total number of epochs; --resume continues from the checkpoint.\n"
          "  --graph records the training step once per batch shape and replays it.\n"
          "  --tf32 lets f32 products and convolutions use TF32 tensor cores.\n");
}

/* Everything main makes, released on every way out (LeakSanitizer checks the error exits
** too). NULL members are skipped: every free function takes NULL. */
static struct {
  kiln_tensor *t[6]; /* x, y, tx, ty, txd, tyd */
  kiln_module *model;
  kiln_ddp *ddp;
  kiln_optimizer *opt;
  kiln_dataset *ds, *shard;
  kiln_loader *loader;
  kiln_dist *dist;
  kiln_summary_writer *tb; /* --logdir */
  ex_graph_step gs;        /* --graph */
} R;

static void release(void) {
  ex_graph_step_free(&R.gs);
  kiln_loader_free(R.loader);
  kiln_dataset_free(R.shard);
  kiln_dataset_free(R.ds);
  kiln_ddp_free(R.ddp);
  kiln_optimizer_free(R.opt);
  kiln_module_free(R.model);
  for (int i = 0; i < 6; i++) kiln_tensor_free(R.t[i]);
  kiln_dist_free(R.dist);
  ex_log_close(R.tb);
  memset(&R, 0, sizeof R);
}

EX_DEFINE_EXITS(PROG, release)

/* (N, 28, 28) -> (N, 1, 28, 28): the CNN's first module (PyTorch's peer unsqueezes the
** data instead; kiln's loader and evaluation stay the same for both models). */
static kiln_tensor *to_nchw_forward(kiln_module *m, kiln_tensor *x) {
  (void)m;
  return kiln_unsqueeze(x, 1);
}
static const kiln_module_vtable to_nchw_vt = {"Unsqueeze", to_nchw_forward, NULL, NULL, NULL};

/* The model of --model (weights drawn from the global generator, on the CPU). NULL on
** error (the last error set). */
static kiln_module *build_model(bool cnn) {
  kiln_device cpu = kiln_device_cpu();
  if (!cnn)
    return kiln_sequential_of(4, (kiln_module *[]){kiln_flatten_new(1, -1),
                                                   kiln_linear_new(784, 256, true, KILN_F32, cpu, NULL),
                                                   kiln_relu_new(),
                                                   kiln_linear_new(256, 10, true, KILN_F32, cpu, NULL)});
  const int64_t k3[2] = {3, 3}, k2[2] = {2, 2};
  return kiln_sequential_of(11, (kiln_module *[]){kiln_module_new(&to_nchw_vt, NULL),
                                                  kiln_conv2d_new(1, 32, k3, NULL, NULL, NULL, 1, true, KILN_F32, cpu, NULL),
                                                  kiln_relu_new(),
                                                  kiln_max_pool2d_new(k2, NULL, NULL, NULL),
                                                  kiln_conv2d_new(32, 64, k3, NULL, NULL, NULL, 1, true, KILN_F32, cpu, NULL),
                                                  kiln_relu_new(),
                                                  kiln_max_pool2d_new(k2, NULL, NULL, NULL),
                                                  kiln_flatten_new(1, -1),
                                                  kiln_linear_new(64 * 5 * 5, 128, true, KILN_F32, cpu, NULL),
                                                  kiln_relu_new(),
                                                  kiln_linear_new(128, 10, true, KILN_F32, cpu, NULL)});
}

/* One training step on a batch (x, y): the eager loop's and the recorded one's, so that
** both train the same way. *loss_out gets the loss tensor (owned by the caller's scope). */
typedef struct step_ctx {
  kiln_module *model;
  kiln_optimizer *opt;
  kiln_ddp *ddp;
  kiln_device dev;
  const char *amp; /* --autocast: "bf16", "f16" or NULL */
} step_ctx;

static kiln_status train_on(step_ctx *c, kiln_tensor *x, kiln_tensor *y, kiln_tensor **loss_out) {
  kiln_status st = KILN_OK;
  if (c->amp) st = kiln_autocast_begin(c->dev.type, !strcmp(c->amp, "f16") ? KILN_F16 : KILN_BF16);
  kiln_tensor *loss = kiln_cross_entropy(kiln_module_forward(c->model, x), y, KILN_REDUCTION_MEAN, -100, 0.0);
  if (c->amp && st == KILN_OK) st = kiln_autocast_end();
  if (st != KILN_OK) loss = NULL;
  kiln_optimizer_zero_grad(c->opt);
  st = kiln_backward(loss, NULL);
  if (st == KILN_OK && c->ddp) st = kiln_ddp_sync_grads(c->ddp);
  if (st == KILN_OK) st = kiln_optimizer_step(c->opt);
  *loss_out = loss;
  return st;
}

/* ex_step_fn for --graph: the batch in the static in[0], in[1]; the loss into out_loss. */
static kiln_status graph_step(void *p, kiln_tensor *const *in, kiln_tensor *out_loss) {
  kiln_scope_begin();
  kiln_tensor *loss = NULL;
  kiln_status st = train_on(p, in[0], in[1], &loss);
  if (st == KILN_OK) st = ex_graph_store_loss(out_loss, loss);
  kiln_scope_end();
  return st;
}

/* Test accuracy: eval mode, no graph, batches of EVAL_BATCH. NAN on error. */
static double evaluate(kiln_module *model, kiln_tensor *tx, kiln_tensor *ty) {
  bool prev = kiln_set_grad_enabled(false);
  kiln_module_eval(model);
  int64_t n = kiln_size(tx, 0), correct = 0;
  bool ok = true;
  for (int64_t i = 0; i < n && ok; i += EVAL_BATCH) {
    int64_t len = n - i < EVAL_BATCH ? n - i : EVAL_BATCH;
    kiln_scope_begin();
    kiln_tensor *pred = kiln_argmax(kiln_module_forward(model, kiln_narrow(tx, 0, i, len)), 1, false);
    double c = kiln_item(kiln_sum_all(kiln_to_dtype(kiln_eq(pred, kiln_narrow(ty, 0, i, len)), KILN_I64)));
    kiln_scope_end();
    if (isnan(c)) ok = false;
    else correct += (int64_t)c;
  }
  kiln_module_train(model, true);
  kiln_set_grad_enabled(prev);
  return ok ? (double)correct / (double)n : NAN;
}

int main(int argc, char **argv) {
  long long epochs = 5, batch = 128, limit = 0, workers = 0, seed = 0;
  double lr = 1e-3;
  bool json = false, quiet = false, resume = false, graph = false;
  const char *logdir = NULL; /* --logdir: TensorBoard event files (common/logdir.h) */
  const char *amp = NULL;    /* --autocast bf16|f16 */
  const char *model_name = "mlp"; /* --model mlp|cnn */
  const char *devname = NULL, *data = NULL, *ckpt = "fashion-mnist.ckpt.safetensors";
  bool tf32 = false;
  const ex_opt opts[] = {{.name = "--json", .kind = EX_FLAG, .out = &json},
                         {.name = "--quiet", .kind = EX_FLAG, .out = &quiet, .alias = "-q"},
                         {.name = "--resume", .kind = EX_FLAG, .out = &resume},
                         {.name = "--graph", .kind = EX_FLAG, .out = &graph},
                         {.name = "--tf32", .kind = EX_FLAG, .out = &tf32},
                         {.name = "--device", .kind = EX_STR, .out = &devname},
                         {.name = "--model", .kind = EX_CHOICE, .out = &model_name, .choices = "mlp|cnn"},
                         {.name = "--data", .kind = EX_STR, .out = &data},
                         {.name = "--logdir", .kind = EX_STR, .out = &logdir},
                         {.name = "--autocast", .kind = EX_AUTOCAST, .out = &amp},
                         {.name = "--checkpoint", .kind = EX_STR, .out = &ckpt},
                         {.name = "--epochs", .kind = EX_INT, .out = &epochs, .lo = 1, .hi = 100000},
                         {.name = "--batch", .kind = EX_INT, .out = &batch, .lo = 1, .hi = 60000},
                         {.name = "--limit", .kind = EX_INT, .out = &limit, .lo = 1, .hi = 60000},
                         {.name = "--workers", .kind = EX_INT, .out = &workers, .lo = 0, .hi = 64},
                         {.name = "--seed", .kind = EX_INT, .out = &seed, .lo = 0, .hi = 2147483647},
                         {.name = "--lr", .kind = EX_NUM, .out = &lr, .lo = 0, .hi = 10},
                         {.name = NULL}};
  int prc = ex_parse_args(PROG, argc, argv, opts, usage);
  if (prc >= 0) return prc;
  if (tf32) kiln_set_matmul_tf32(true);
  if (ex_check_env(PROG, devname != NULL)) return 2; /* a bad KILN_* value is refused, not ignored */
  if (ex_check_output(PROG, ckpt)) return 2;
  ex_job job;
  int jrc = ex_launch(PROG, batch, graph, logdir, devname, &quiet, &json, &job);
  R.dist = job.dist, R.tb = job.tb;
  if (jrc) return finish(jrc);
  if (resume && ex_check_resume(PROG, ckpt)) return finish(2);
  kiln_dist *dist = job.dist;
  const int world = job.world, rank = job.rank;
  kiln_device dev = job.dev;
  const char *dname = job.dname;

  static const char needs[] = "this model takes 28 x 28 images (N, 28, 28)";
  if (ex_load_fmnist(PROG, data, needs, limit, 0, R.t)) return finish(1);
  kiln_tensor *x = R.t[0], *y = R.t[1], *tx = R.t[2], *ty = R.t[3];
  /* The test set lives on the device for the whole run (31 MB). */
  kiln_tensor *txd = kiln_to_device(tx, dev), *tyd = kiln_to_device(ty, dev);
  R.t[4] = txd, R.t[5] = tyd;
  if (!txd || !tyd) return fail("preparing the data");
  int64_t ntrain = kiln_size(x, 0);

  kiln_manual_seed((uint64_t)seed);
  bool cnn = !strcmp(model_name, "cnn");
  kiln_module *model = R.model = build_model(cnn);
  if (!model || kiln_module_to(model, dev) != KILN_OK) return fail("building the model");
  kiln_ddp *ddp = NULL; /* parameters broadcast from rank 0; gradients averaged */
  if (world > 1 && !(R.ddp = ddp = kiln_ddp_new(dist, model, NULL))) return fail("making the data-parallel wrapper");
  kiln_optim_config cfg = kiln_adam_config(lr);
  cfg.capturable = graph; /* the step count lives on the device, so replays advance it */
  kiln_optimizer *opt = R.opt = kiln_optimizer_new_module(&cfg, model);
  if (!opt) return fail("making the optimizer");

  int64_t start_epoch = 0, step = 0;
  double last_loss = NAN, test_acc = NAN;
  if (resume) {
    kiln_dict *extra = NULL;
    if (kiln_checkpoint_load(ckpt, model, opt, NULL, NULL, &start_epoch, &step, &extra) != KILN_OK)
      return fail("resuming from the checkpoint");
    ex_resume_meta(PROG, extra, start_epoch, epochs, batch, ntrain, &last_loss, &test_acc);
    kiln_dict_free(extra);
    if (!quiet) printf("resumed from %s: epoch %lld, step %lld\n", ckpt, (long long)start_epoch, (long long)step);
  }

  kiln_dataset *ds = R.ds = kiln_tensor_dataset_new(2, (kiln_tensor *[]){x, y});
  kiln_dataset *shard = R.shard = world > 1 && ds ? kiln_dist_shard_dataset(ds, rank, world, true, (uint64_t)seed, false) : NULL;
  if (world > 1 && !shard) return fail("sharding the data");
  kiln_loader_opts lo = kiln_loader_opts_default();
  lo.batch_size = batch / world;
  lo.shuffle = world == 1; /* the shard shuffles per epoch, the same on every rank */
  lo.seed = (uint64_t)seed;
  lo.num_workers = (int)workers;
  lo.device = dev;
  kiln_loader *loader = R.loader = ds ? kiln_loader_new(shard ? shard : ds, &lo) : NULL;
  if (!loader) return fail("making the loader");

  if (!quiet) {
    char pb[32];
    printf("model: %s\ndevice: %s\ntrain: %lld images, test: %lld images\n", model_name, dname, (long long)ntrain,
           (long long)kiln_size(tx, 0));
    printf("parameters: %lld (%s)\n", (long long)kiln_module_num_params(model),
           kiln_format_bytes(kiln_module_param_bytes(model), pb, sizeof pb));
    kiln_module_summary(stdout, model);
    fflush(stdout);
  }

  step_ctx sc = {model, opt, ddp, dev, amp};
  ex_graph_step *gs = &R.gs;
  ex_graph_step_init(gs, dev, 2, lo.batch_size, graph_step, &sc);
  /* no loss is read per step, captured or eager (the epoch's sum once at its end), unless
  ** --logdir logs each step's */
  gs->sum_loss = !R.tb;

  double train_s = 0;
  int64_t images = 0;
  char label[64];
  for (int64_t e = start_epoch; e < epochs; e++) {
    kiln_device_synchronize(dev);
    double t0 = ex_now();
    if (shard && kiln_dist_shard_set_epoch(shard, (uint64_t)e) != KILN_OK) return fail("reshuffling the shard");
    if (kiln_loader_epoch(loader, (uint64_t)e) != KILN_OK) return fail("starting an epoch");
    snprintf(label, sizeof label, "epoch %lld/%lld", (long long)e + 1, epochs);
    ex_progress p;
    ex_progress_begin(&p, label, ntrain, !quiet);
    double total = 0;
    int64_t n = 0, seen = 0;
    for (;;) {
      kiln_scope_begin(); /* one step */
      kiln_tensor *b[2] = {NULL, NULL};
      int r = graph ? ex_graph_step_next(gs, loader, b) : kiln_loader_next(loader, b);
      kiln_status st = KILN_OK;
      double lv = 0;
      if (r == 1 && graph) {
        st = ex_graph_step_run(gs, loader, b, &lv);
        seen += kiln_size(b[0], 0);
      } else if (r == 1) {
        kiln_tensor *loss = NULL;
        st = train_on(&sc, b[0], b[1], &loss);
        if (st == KILN_OK) st = ex_graph_step_eager_loss(gs, loss, &lv);
        seen += kiln_size(b[0], 0) * world;
      }
      kiln_scope_end();
      ex_graph_step_end(gs);
      if (r < 0 || st != KILN_OK) return fail(r < 0 ? "loading a batch" : "training step");
      if (r == 0) break;
      if (!gs->sum_loss) total += lv;
      n++;
      step++;
      ex_log_scalar(&R.tb, "train/loss", step, lv);
      ex_progress_update(&p, seen);
    }
    if (gs->sum_loss && ex_graph_step_take_sum(gs, &total) != KILN_OK) return fail("reading the loss");
    kiln_device_synchronize(dev);
    double dt = ex_now() - t0;
    ex_progress_end(&p);
    train_s += dt;
    images += seen;
    if (gs->phases) /* KILN_PHASES: where the epoch's host time went (replayed steps, summed) */
      fprintf(stderr,
              "phases: epoch %lld %.4f s, %lld steps; replays: loading ahead %.4f s, copies in %.4f s, "
              "launches %.4f s, loss reads %.4f s, device (launch to end) %.4f s; first steps: eager %.4f s, "
              "captures %.4f s\n",
              (long long)e + 1, dt, (long long)n, gs->phase_s[0], gs->phase_s[1], gs->phase_s[2], gs->phase_s[4],
              gs->device_s, gs->phase_s[3], gs->phase_s[5]);
    last_loss = n ? total / (double)n : NAN;
    if (dist && kiln_dist_allreduce_scalar(dist, &last_loss, KILN_DIST_AVG) != KILN_OK) return fail("averaging the loss");
    /* every rank holds the same parameters: rank 0 evaluates and checkpoints for all */
    if (rank != 0) continue;
    test_acc = evaluate(model, txd, tyd);
    if (isnan(test_acc)) return fail("evaluating");
    ex_log_epoch(&R.tb, step, last_loss, lr, dt > 0 ? (double)seen / dt : 0.0, dev);
    ex_log_scalar(&R.tb, "epoch/test_acc", step, test_acc);

    kiln_dict *extra = kiln_dict_new();
    ex_meta_real(extra, "train_loss", last_loss);
    ex_meta_real(extra, "test_acc", test_acc);
    ex_meta_int(extra, "batch", batch);
    ex_meta_int(extra, "train_samples", ntrain);
    kiln_dict_set_meta(extra, "model", model_name);
    kiln_status cs = kiln_checkpoint_save(ckpt, model, opt, NULL, NULL, e + 1, step, extra);
    kiln_dict_free(extra);
    if (cs != KILN_OK) return fail("saving the checkpoint");
    if (!quiet) {
      printf("Epoch %lld, Loss: %.4f, Test accuracy: %.4f (%.2f s, %.0f images/s)\n",
             (long long)e + 1, last_loss, test_acc, dt, dt > 0 ? (double)seen / dt : 0.0);
      fflush(stdout);
    }
  }
  if (isnan(test_acc) && rank == 0) {
    test_acc = evaluate(model, txd, tyd);
    if (isnan(test_acc)) return fail("evaluating");
  }
  if (!quiet) printf("test accuracy: %.4f, checkpoint: %s\n", test_acc, ckpt);
  if (json)
    printf("{\"example\":\"fashion-mnist\",\"model\":\"%s\",\"device\":\"%s\",\"epochs\":%lld,\"start_epoch\":%lld,"
           "\"batch\":%lld,\"train_samples\":%lld,\"seconds\":%.4f,\"images_per_s\":%.0f,"
           "\"final_loss\":%.17g,\"test_acc\":%.4f,\"steps\":%lld,\"world_size\":%d,\"seed\":%lld,\"autocast\":\"%s\","
           "\"graph\":%s,\"tf32\":%s,\"kiln\":\"%s\"}\n",
           model_name, dname, epochs, (long long)start_epoch, batch, (long long)ntrain, train_s,
           train_s > 0 ? (double)images / train_s : 0.0, last_loss, test_acc, (long long)step,
           world, seed, amp ? amp : "off", graph ? "true" : "false", kiln_matmul_tf32() ? "true" : "false", kiln_version());
  fflush(stdout);
  kiln_fallback_report(stderr);

  return finish(0);
}
