/*
** seed-mlp: the seed's example workload, line for line the PyTorch peer
** (../shared/bench/torch_peer.py `seed_mlp`):
**
**   torch.manual_seed(0); x = torch.randn(20000, 64); y = (x.sum(1) > 0).long()
**   model = Sequential(Linear(64, 128), ReLU(), Linear(128, 2)).to(dev)
**   CrossEntropyLoss, Adam(lr=1e-3), DataLoader(batch_size=128, shuffle=True), 20 epochs,
**   loss.item() every step, "Epoch N, Loss: X" with the mean over the epoch's batches.
**
** Usage: seed-mlp [--device cpu|cuda[:N]] [--epochs N] [--batch N] [--lr X] [--workers N]
**                 [--graph] [--preload] [--json] [--quiet] [--logdir DIR]
** The loader delivers each batch on the device: on a GPU it gathers the batch into pinned
** memory in a background thread and copies it on a side stream while the previous step
** runs. --preload keeps the 20000 samples on the device instead (the peer's --preload):
** the loader then gathers each shuffled batch there, and nothing crosses the host link
** per step.
** --graph records the training step once per batch shape (after one eager step at that
** shape, which trains like any other) and replays it: CUDA graphs on a GPU, the same
** calls run eagerly on the CPU. Each batch is copied on the device into the recorded
** step's static inputs. The loss is still read with kiln_item every step; while a replay
** runs, the host fetches the next batch and queues that copy, so the read waits for the
** device alone.
** --json ends the output with one JSON line of figures (the same names as the peer's).
**
** Under mpirun (mpirun -np N seed-mlp ...) it trains data-parallel: each rank takes its
** shard of every epoch (kiln_dist_shard_dataset), batch / N samples a step, gradients
** averaged across ranks (kiln_ddp); rank 0 alone prints, and the JSON gains world_size.
*/
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <kiln.h>
#include <kiln_data.h>
#include <kiln_dist.h>
#include <kiln_nn.h>
#include <kiln_optim.h>

#include "common/graph_step.h"
#include "common/launch.h"
#include "common/logdir.h"
#include "common/options.h"
#include "common/output.h"
#include "common/progress.h"

#define PROG "seed-mlp"
#define N_SAMPLES 20000
#define N_FEATURES 64

static void usage(FILE *f) {
  fprintf(f, "usage: " PROG " [--device cpu|cuda[:N]] [--epochs N] [--batch N] [--lr X]\n"
             "                [--workers N] [--graph] [--preload] [--json] [--quiet] [--logdir DIR]\n"
             "  The seed's MLP: 20000 x 64 Gaussian inputs, label sum > 0, Linear(64,128)-ReLU-\n"
             "  Linear(128,2), cross-entropy, Adam, shuffled batches. Defaults: the best device,\n"
             "  20 epochs, batch 128, lr 1e-3, no loader workers.\n");
}

/* The captured step (common/graph_step.h): reads the static batch in[0], in[1], writes
** the static loss. */
typedef struct step_ctx {
  kiln_module *model;
  kiln_optimizer *opt;
} step_ctx;

static kiln_status train_step(void *p, kiln_tensor *const *in, kiln_tensor *out_loss) {
  step_ctx *c = p;
  kiln_scope_begin();
  kiln_tensor *loss = kiln_cross_entropy(kiln_module_forward(c->model, in[0]), in[1],
                                         KILN_REDUCTION_MEAN, -100, 0.0);
  kiln_optimizer_zero_grad(c->opt);
  kiln_status st = kiln_backward(loss, NULL);
  if (st == KILN_OK) st = kiln_optimizer_step(c->opt);
  if (st == KILN_OK) st = ex_graph_store_loss(out_loss, loss);
  kiln_scope_end();
  return st;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* KILN_PHASES: the first steps, the steady step (median), and how much of the run the
** steps above the steady one cost beyond it (one-time work: first launches, captures). */
static void print_step_times(const double *s, int64_t n, double run_s) {
  fprintf(stderr, "steps: first");
  for (int64_t i = 0; i < n && i < 6; i++) fprintf(stderr, " %.1f", s[i] * 1e6);
  fprintf(stderr, " us\n");
  double *v = malloc(sizeof *v * (size_t)n);
  if (!v) return;
  memcpy(v, s, sizeof *v * (size_t)n);
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  double med = v[n / 2], sum = 0, excess = 0;
  for (int64_t i = 0; i < n; i++) sum += v[i], excess += v[i] > med ? v[i] - med : 0;
  fprintf(stderr, "steps: min %.1f  p10 %.1f  median %.1f  p90 %.1f  p99 %.1f  max %.1f us\n", v[0] * 1e6,
          v[n / 10] * 1e6, med * 1e6, v[n * 9 / 10] * 1e6, v[n * 99 / 100] * 1e6, v[n - 1] * 1e6);
  fprintf(stderr, "steps: %.1f ms in steps, of them %.1f ms above the median; %.1f ms of the run outside steps\n",
          sum * 1e3, excess * 1e3, (run_s - sum) * 1e3);
  free(v);
}

/* Everything main makes, released on every way out (LeakSanitizer checks the error exits
** too). NULL members are skipped: every free function takes NULL. */
static struct {
  kiln_tensor *t[4]; /* x, y, xs, ys (--preload) */
  ex_graph_step gs;  /* --graph */
  kiln_module *model;
  kiln_ddp *ddp;
  kiln_optimizer *opt;
  kiln_dataset *ds, *shard;
  kiln_loader *loader;
  kiln_dist *dist;
  double *step_s;
  kiln_summary_writer *tb; /* --logdir */
} R;

static void release(void) {
  ex_graph_step_free(&R.gs);
  kiln_loader_free(R.loader);
  kiln_dataset_free(R.shard);
  kiln_dataset_free(R.ds);
  kiln_ddp_free(R.ddp);
  kiln_optimizer_free(R.opt);
  kiln_module_free(R.model);
  for (int i = 0; i < 4; i++) kiln_tensor_free(R.t[i]);
  kiln_dist_free(R.dist);
  ex_log_close(R.tb);
  free(R.step_s);
  memset(&R, 0, sizeof R);
}

EX_DEFINE_EXITS(PROG, release)

int main(int argc, char **argv) {
  long long epochs = 20, batch = 128, workers = 0;
  double lr = 1e-3;
  bool json = false, quiet = false, graph = false, preload = false;
  const char *logdir = NULL; /* --logdir: TensorBoard event files (common/logdir.h) */
  const char *devname = NULL;
  const ex_opt opts[] = {{.name = "--json", .kind = EX_FLAG, .out = &json},
                         {.name = "--graph", .kind = EX_FLAG, .out = &graph},
                         {.name = "--preload", .kind = EX_FLAG, .out = &preload},
                         {.name = "--quiet", .kind = EX_FLAG, .out = &quiet, .alias = "-q"},
                         {.name = "--device", .kind = EX_STR, .out = &devname},
                         {.name = "--logdir", .kind = EX_STR, .out = &logdir},
                         {.name = "--epochs", .kind = EX_INT, .out = &epochs, .lo = 1, .hi = 100000},
                         {.name = "--batch", .kind = EX_INT, .out = &batch, .lo = 1, .hi = N_SAMPLES},
                         {.name = "--workers", .kind = EX_INT, .out = &workers, .lo = 0, .hi = 64},
                         {.name = "--lr", .kind = EX_NUM, .out = &lr, .lo = 0, .hi = 10},
                         {.name = NULL}};
  int prc = ex_parse_args(PROG, argc, argv, opts, usage);
  if (prc >= 0) return prc;
  if (ex_check_env(PROG, devname != NULL)) return 2; /* a bad KILN_* value is refused, not ignored */
  ex_job job;
  int jrc = ex_launch(PROG, batch, graph, logdir, devname, &quiet, &json, &job);
  R.dist = job.dist, R.tb = job.tb;
  if (jrc) return finish(jrc);
  kiln_dist *dist = job.dist;
  const int world = job.world, rank = job.rank;
  kiln_device dev = job.dev;
  const char *dname = job.dname;

  /* Data: the same draws in the same order as the peer (x first, then the layers). */
  kiln_manual_seed(0);
  kiln_tensor *x = R.t[0] = kiln_randn(KILN_SHAPE(N_SAMPLES, N_FEATURES), KILN_F32, kiln_device_cpu(), NULL);
  kiln_tensor *y = NULL;
  if (x) {
    kiln_scope_begin();
    y = R.t[1] = kiln_keep(kiln_to_dtype(kiln_gt_scalar(kiln_sum(x, KILN_DIMS(1), false), 0.0), KILN_I64));
    kiln_scope_end();
  }
  if (!x || !y) return fail("making the data");

  kiln_module *model = R.model = kiln_sequential_new();
  kiln_sequential_append(model, kiln_linear_new(N_FEATURES, 128, true, KILN_F32, kiln_device_cpu(), NULL));
  kiln_sequential_append(model, kiln_relu_new());
  kiln_sequential_append(model, kiln_linear_new(128, 2, true, KILN_F32, kiln_device_cpu(), NULL));
  if (!model || kiln_module_num_children(model) != 3 || kiln_module_to(model, dev) != KILN_OK)
    return fail("building the model");

  kiln_ddp *ddp = NULL; /* parameters broadcast from rank 0; gradients averaged */
  if (world > 1 && !(R.ddp = ddp = kiln_ddp_new(dist, model, NULL))) return fail("making the data-parallel wrapper");

  kiln_optim_config cfg = kiln_adam_config(lr);
  cfg.capturable = graph; /* the step count lives on the device, so replays advance it */
  kiln_optimizer *opt = R.opt = kiln_optimizer_new_module(&cfg, model);
  if (!opt) return fail("making the optimizer");

  kiln_tensor *xs = x, *ys = y; /* what the dataset holds: host tensors, or their device copies */
  if (preload) {
    xs = R.t[2] = kiln_keep(kiln_to_device(x, dev));
    ys = R.t[3] = kiln_keep(kiln_to_device(y, dev));
    if (!xs || !ys) return fail("moving the data to the device");
  }
  kiln_dataset *ds = R.ds = kiln_tensor_dataset_new(2, (kiln_tensor *[]){xs, ys});
  kiln_dataset *shard = R.shard = world > 1 && ds ? kiln_dist_shard_dataset(ds, rank, world, true, 0, false) : NULL;
  if (world > 1 && !shard) return fail("sharding the data");
  kiln_loader_opts lo = kiln_loader_opts_default();
  lo.batch_size = batch / world;
  lo.shuffle = world == 1; /* the shard shuffles per epoch, the same on every rank */
  lo.seed = 0;
  lo.num_workers = (int)workers;
  lo.device = dev; /* --graph copies each batch on the device into the step's static inputs */
  kiln_loader *loader = R.loader = ds ? kiln_loader_new(shard ? shard : ds, &lo) : NULL;
  if (!loader) return fail("making the loader");

  if (!quiet) {
    char pb[32];
    printf("device: %s\n", dname);
    if (world > 1) printf("data parallel: %d ranks, %lld samples a step each\n", world, batch / world);
    printf("parameters: %lld (%s)\n", (long long)kiln_module_num_params(model),
           kiln_format_bytes(kiln_module_param_bytes(model), pb, sizeof pb));
    kiln_module_summary(stdout, model);
    fflush(stdout);
  }

  /* --graph: one recorded step per batch shape (full batches, and the smaller last one) */
  step_ctx sc = {model, opt};
  ex_graph_step *gs = &R.gs;
  ex_graph_step_init(gs, dev, 2, lo.batch_size, train_step, &sc);

  /* KILN_PHASES=1: host time per phase of the eager step, printed at the end */
  const bool phases = getenv("KILN_PHASES") != NULL;
  double phase_s[6] = {0};
  /* ... and each step's whole time, to tell one-time costs (first launches, captures,
  ** epoch starts) from the steady step */
  const int64_t max_steps = epochs * ((N_SAMPLES + batch - 1) / batch) + 1;
  double *step_s = R.step_s = phases ? calloc((size_t)max_steps, sizeof *step_s) : NULL;
  double epoch_start_s = 0, device_s = 0; /* device time between marks (kiln_mark) */

  kiln_device_synchronize(dev);
  double t0 = ex_now();
  int64_t steps = 0;
  double last = NAN;
  char label[64];
  for (long long e = 0; e < epochs; e++) {
    double e0 = phases || R.tb ? ex_now() : 0;
    if (shard && kiln_dist_shard_set_epoch(shard, (uint64_t)e) != KILN_OK) return fail("reshuffling the shard");
    if (kiln_loader_epoch(loader, (uint64_t)e) != KILN_OK) return fail("starting an epoch");
    if (phases) epoch_start_s += ex_now() - e0;
    snprintf(label, sizeof label, "epoch %lld/%lld", e + 1, epochs);
    ex_progress p;
    ex_progress_begin(&p, label, N_SAMPLES, !quiet);
    double total = 0;
    int64_t n = 0, seen = 0;
    for (;;) {
      double q0 = phases ? ex_now() : 0;
      kiln_scope_begin(); /* one step: the batch, the graph and every temporary */
      kiln_tensor *b[2] = {NULL, NULL};
      int r = graph ? ex_graph_step_next(gs, loader, b) : kiln_loader_next(loader, b);
      if (phases) phase_s[0] += ex_now() - q0;
      kiln_status st = KILN_OK;
      double lv = 0;
      if (r == 1 && graph) {
        st = ex_graph_step_run(gs, loader, b, &lv);
        seen += kiln_size(b[0], 0);
      } else if (r == 1) {
        double p0 = phases ? ex_now() : 0;
        kiln_mark *m0 = phases ? kiln_mark_record(dev) : NULL;
        kiln_tensor *loss = kiln_cross_entropy(kiln_module_forward(model, b[0]), b[1],
                                               KILN_REDUCTION_MEAN, -100, 0.0);
        kiln_optimizer_zero_grad(opt);
        double p1 = phases ? ex_now() : 0;
        st = kiln_backward(loss, NULL);
        if (st == KILN_OK && ddp) st = kiln_ddp_sync_grads(ddp);
        double p2 = phases ? ex_now() : 0;
        if (st == KILN_OK) st = kiln_optimizer_step(opt);
        double p3 = phases ? ex_now() : 0;
        kiln_mark *m1 = phases ? kiln_mark_record(dev) : NULL;
        if (st == KILN_OK) lv = kiln_item(loss);
        if (phases) {
          double p4 = ex_now();
          device_s += kiln_mark_elapsed_ms(m0, m1) * 1e-3;
          phase_s[1] += p1 - p0, phase_s[2] += p2 - p1, phase_s[3] += p3 - p2, phase_s[4] += p4 - p3;
        }
        seen += kiln_size(b[0], 0) * world;
      }
      double q1 = phases ? ex_now() : 0;
      kiln_scope_end();
      ex_graph_step_end(gs);
      if (phases) phase_s[5] += ex_now() - q1;
      if (r < 0 || st != KILN_OK) return fail(r < 0 ? "loading a batch" : "training step");
      if (r == 0) break;
      if (step_s && steps < max_steps) step_s[steps] = ex_now() - q0;
      total += lv;
      n++;
      steps++;
      ex_log_scalar(&R.tb, "train/loss", steps, lv);
      ex_progress_update(&p, seen);
    }
    ex_progress_end(&p);
    last = n ? total / (double)n : NAN;
    if (dist && kiln_dist_allreduce_scalar(dist, &last, KILN_DIST_AVG) != KILN_OK) return fail("averaging the loss");
    if (R.tb) ex_log_epoch(&R.tb, steps, last, lr, (double)N_SAMPLES / (ex_now() - e0), dev);
    if (!quiet) {
      printf("Epoch %lld, Loss: %.4f\n", e + 1, last);
      fflush(stdout);
    }
  }
  kiln_device_synchronize(dev);
  double dt = ex_now() - t0;

  /* Training accuracy over all 20000 samples, no graph. */
  double acc = NAN;
  bool prev = kiln_set_grad_enabled(false);
  kiln_scope_begin();
  kiln_tensor *pred = kiln_argmax(kiln_module_forward(model, kiln_to_device(x, dev)), 1, false);
  kiln_tensor *hit = kiln_to_dtype(kiln_eq(pred, kiln_to_device(y, dev)), KILN_F32);
  acc = kiln_item(kiln_mean_all(hit));
  kiln_scope_end();
  kiln_set_grad_enabled(prev);
  if (isnan(acc)) return fail("computing the accuracy");

  if (!quiet) printf("train accuracy: %.4f, %.2f s, %.1f us/step\n", acc, dt, dt / (double)steps * 1e6);
  if (phases && graph) { /* the replayed steps' phases, which the helper timed */
    for (int k = 0; k < 6; k++) phase_s[k] += gs->phase_s[k];
    device_s += gs->device_s;
  }
  if (phases) {
    static const char *const names[2][6] = {
        {"load batch", "forward+zero_grad", "backward", "optimizer", "item (sync)", "scope end"},
        {"load batch", "copy in", "graph launch", "", "item (sync)", "scope end"}};
    for (int k = 0; k < 6; k++)
      if (*names[graph][k])
        fprintf(stderr, "phase %-18s %8.1f us/step\n", names[graph][k], phase_s[k] / (double)steps * 1e6);
    fprintf(stderr, "phase %-18s %8.1f us/step\n", "epoch starts", epoch_start_s / (double)steps * 1e6);
    fprintf(stderr, "device: %.1f us/step from %s (device marks)\n", device_s / (double)steps * 1e6,
            graph ? "the graph's launch to its end" : "the step's first op to its last");
    if (step_s && steps > 0) print_step_times(step_s, steps < max_steps ? steps : max_steps, dt);
  }
  if (json)
    printf("{\"example\":\"seed-mlp%s%s\",\"device\":\"%s\",\"epochs\":%lld,\"batch\":%lld,"
           "\"seconds\":%.4f,\"samples_per_s\":%.0f,\"us_per_step\":%.1f,\"final_loss\":%.6f,"
           "\"train_acc\":%.4f,\"world_size\":%d,\"kiln\":\"%s\"}\n",
           preload ? "-preload" : "", graph ? "-graph" : "", dname, epochs, batch, dt, (double)epochs * N_SAMPLES / dt, dt / (double)steps * 1e6,
           last, acc, world, kiln_version());
  fflush(stdout);
  kiln_fallback_report(stderr); /* prints nothing when no op fell back */

  return finish(0);
}
