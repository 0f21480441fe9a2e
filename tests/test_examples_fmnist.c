/*
** The fashion-mnist example: one short epoch trains and evaluates (the MLP, and the CNN
** of --model cnn); a checkpoint resumes
** bit-identically on the CPU (2 epochs straight == 1 epoch, then --resume to 2); kiln
** info reads the checkpoint; --graph (the step recorded per batch shape and replayed,
** on the CPU the same calls again) trains exactly as the eager loop, for the MLP, the CNN
** and under bf16 autocast, and resumes bit-identically too. Skipped (77) when the data set
** is not installed.
**
** With --cuda (ctest test_examples_fmnist_cuda, label gpu; skipped without a CUDA device):
** --graph on cuda:0 (CUDA graphs, cuDNN inside them) against the eager loop there, for the
** CNN (f32, bf16 autocast, and TF32: kiln's direct convolution kernels) and the MLP: the same final loss within a tolerance (the
** kernels are the same; only the capturable Adam's bias correction, computed on the
** device, may round differently) and the same learning.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>

#include "cli_run.h"

#define ARGS "--device cpu --limit 2000 --json --quiet"

/* The final_loss of a run's JSON line (NAN when absent) */
static double fm_loss(const cr_result *r) { return cr_json_num(r->out, "final_loss"); }

/* --graph against eager on one device: args is everything else. exact: the final loss and
** test accuracy must match to the printed digit (the CPU replays the same calls). */
static void fm_graph_vs_eager(const char *args, bool exact, double tol) {
  char a[512], ag[600];
  snprintf(a, sizeof a, "%s --checkpoint ge.ckpt --json --quiet", args);
  snprintf(ag, sizeof ag, "%s --graph", a);
  cr_result r = cr_run(NULL, "fashion-mnist", a), rg = cr_run(NULL, "fashion-mnist", ag);
  CR_CHECK(r.status == 0 && rg.status == 0, "'%s': eager exited %d, --graph %d: %s %s", args, r.status, rg.status,
           r.err, rg.err);
  CR_CHECK(strstr(r.out, "\"graph\":false") && strstr(rg.out, "\"graph\":true"), "'%s': graph field: %s %s", args,
           r.out, rg.out);
  CR_CHECK(cr_json_num(r.out, "steps") == cr_json_num(rg.out, "steps"), "'%s': steps differ: %s %s", args, r.out, rg.out);
  if (exact) {
    char l[64], lg[64], t[32], tg[32];
    cr_json_raw(r.out, "final_loss", l, sizeof l);
    cr_json_raw(rg.out, "final_loss", lg, sizeof lg);
    cr_json_raw(r.out, "test_acc", t, sizeof t);
    cr_json_raw(rg.out, "test_acc", tg, sizeof tg);
    CR_CHECK(l[0] && !strcmp(l, lg) && !strcmp(t, tg), "'%s': --graph loss %s acc %s, eager %s %s", args, lg, tg, l, t);
  } else {
    double l = fm_loss(&r), lg = fm_loss(&rg);
    CR_CHECK(fabs(l - lg) <= tol * fabs(l) && fabs(cr_json_num(r.out, "test_acc") - cr_json_num(rg.out, "test_acc")) < 0.02,
             "'%s': --graph loss %.9g acc %g, eager %.9g %g", args, lg, cr_json_num(rg.out, "test_acc"), l,
             cr_json_num(r.out, "test_acc"));
  }
  cr_free(&r);
  cr_free(&rg);
}

/* --cuda: the graph runs on cuda:0 */
static int fm_cuda(void) {
  if (kiln_device_count(KILN_DEVICE_CUDA) == 0) {
    printf("test_examples_fmnist_cuda: skipped (no CUDA device)\n");
    return 77;
  }
  /* 6000 images: 46 full batches and one of 112, two recordings each run */
  fm_graph_vs_eager("--model cnn --device cuda:0 --epochs 2 --limit 6000", false, 2e-3);
  fm_graph_vs_eager("--model cnn --device cuda:0 --epochs 1 --limit 6000 --autocast bf16", false, 1e-2);
  /* TF32: the second convolution on kiln's direct kernels (cuda_conv_direct.cu), captured */
  fm_graph_vs_eager("--model cnn --device cuda:0 --epochs 2 --limit 6000 --tf32", false, 2e-3);
  fm_graph_vs_eager("--model mlp --device cuda:0 --epochs 2 --limit 6000", false, 2e-3);
  /* a resumed --graph run on the GPU learns on from the checkpoint */
  cr_result r = cr_run(NULL, "fashion-mnist", "--model cnn --device cuda:0 --epochs 1 --limit 6000 --graph --checkpoint g.ckpt --json --quiet");
  CR_CHECK(r.status == 0, "cnn --graph 1 epoch exited %d: %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "fashion-mnist", "--model cnn --device cuda:0 --epochs 2 --limit 6000 --graph --resume --checkpoint g.ckpt --json --quiet");
  CR_CHECK(r.status == 0 && cr_json_num(r.out, "start_epoch") == 1 && cr_json_num(r.out, "test_acc") > 0.7,
           "cnn --graph --resume: %d %s %s", r.status, r.out, r.err);
  cr_free(&r);
  return cr_finish("test_examples_fmnist_cuda");
}

int main(int argc, char **argv) {
  int need = cr_require("fashion-mnist", true);
  if (need) return need;
  if (argc > 1 && !strcmp(argv[1], "--cuda")) return fm_cuda();

  cr_result r = cr_run(NULL, "fashion-mnist", "--epochs 1 --checkpoint one.ckpt " ARGS);
  CR_CHECK(r.status == 0, "1 epoch exited %d: %s", r.status, r.err);
  double acc = cr_json_num(r.out, "test_acc");
  CR_CHECK(acc > 0.5 && acc <= 1, "test_acc %g after one short epoch", acc);
  CR_CHECK(cr_json_num(r.out, "train_samples") == 2000, "--limit 2000 not applied: %s", r.out);
  CR_CHECK(cr_json_num(r.out, "steps") == 16, "steps: %s", r.out);
  cr_free(&r);

  r = cr_run(NULL, "kiln", "info one.ckpt");
  CR_CHECK(r.status == 0 && strstr(r.out, "model.1.weight") && strstr(r.out, "[256, 784]"),
           "kiln info on the checkpoint: %d %s", r.status, r.err);
  cr_free(&r);

  char straight[64], resumed[64], acc_a[32], acc_b[32];
  r = cr_run(NULL, "fashion-mnist", "--epochs 2 --checkpoint a.ckpt " ARGS);
  CR_CHECK(r.status == 0, "2 epochs exited %d: %s", r.status, r.err);
  cr_json_raw(r.out, "final_loss", straight, sizeof straight);
  cr_json_raw(r.out, "test_acc", acc_a, sizeof acc_a);
  cr_free(&r);
  r = cr_run(NULL, "fashion-mnist", "--epochs 1 --checkpoint b.ckpt " ARGS);
  CR_CHECK(r.status == 0, "first half exited %d: %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "fashion-mnist", "--epochs 2 --resume --checkpoint b.ckpt " ARGS);
  CR_CHECK(r.status == 0, "resume exited %d: %s", r.status, r.err);
  CR_CHECK(cr_json_num(r.out, "start_epoch") == 1, "did not resume at epoch 1: %s", r.out);
  cr_json_raw(r.out, "final_loss", resumed, sizeof resumed);
  cr_json_raw(r.out, "test_acc", acc_b, sizeof acc_b);
  cr_free(&r);
  CR_CHECK(straight[0] && !strcmp(straight, resumed), "resumed loss %s != straight %s", resumed, straight);
  CR_CHECK(acc_a[0] && !strcmp(acc_a, acc_b), "resumed test_acc %s != straight %s", acc_b, acc_a);

  /* --model cnn: the peer's fmnist-cnn; a short epoch learns (10 classes: chance is 0.1) */
  r = cr_run(NULL, "fashion-mnist", "--model cnn --epochs 1 --checkpoint cnn.ckpt --device cpu --limit 640 --json --quiet");
  CR_CHECK(r.status == 0, "--model cnn exited %d: %s", r.status, r.err);
  acc = cr_json_num(r.out, "test_acc");
  CR_CHECK(acc > 0.4 && acc <= 1, "--model cnn: test_acc %g after 5 steps", acc);
  CR_CHECK(strstr(r.out, "\"model\":\"cnn\"") && cr_json_num(r.out, "steps") == 5, "--model cnn: %s", r.out);
  cr_free(&r);
  r = cr_run(NULL, "kiln", "info cnn.ckpt");
  CR_CHECK(r.status == 0 && strstr(r.out, "model.1.weight") && strstr(r.out, "[32, 1, 3, 3]") &&
               strstr(r.out, "[128, 1600]"),
           "kiln info on the CNN checkpoint: %d %s", r.status, r.err);
  cr_free(&r);
  /* resuming the MLP's checkpoint with the CNN fails on the keys, not silently */
  r = cr_run(NULL, "fashion-mnist", "--model cnn --epochs 2 --resume --checkpoint one.ckpt " ARGS);
  CR_CHECK(r.status == 1 && strstr(r.err, "1.weight: shape [256, 784] in the state dict, [32, 1, 3, 3] in the model"), "cnn resuming an MLP checkpoint: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "fashion-mnist", "--model bogus " ARGS);
  CR_CHECK(r.status == 2 && strstr(r.err, "--model 'bogus'") && strstr(r.err, "mlp or cnn"),
           "--model bogus: %d %s", r.status, r.err);
  cr_free(&r);

  /* --graph on the CPU (the step called again per replay) trains exactly as eager: two
  ** batch shapes (2000 = 15 * 128 + 80), the MLP, the CNN, bf16 autocast */
  fm_graph_vs_eager("--device cpu --limit 2000 --epochs 2", true, 0);
  fm_graph_vs_eager("--model cnn --device cpu --limit 700 --epochs 1", true, 0);
  fm_graph_vs_eager("--device cpu --limit 1000 --epochs 1 --autocast bf16", true, 0);
  r = cr_run(NULL, "fashion-mnist", "--tf32 --epochs 1 --checkpoint t32.ckpt " ARGS);
  CR_CHECK(r.status == 0 && strstr(r.out, "\"tf32\":true"), "--tf32: %d %s %s", r.status, r.out, r.err);
  cr_free(&r);
  /* ... and resumes: 1 epoch with --graph, then --resume --graph to 2 == 2 straight */
  r = cr_run(NULL, "fashion-mnist", "--epochs 1 --graph --checkpoint g.ckpt " ARGS);
  CR_CHECK(r.status == 0, "--graph first half exited %d: %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "fashion-mnist", "--epochs 2 --graph --resume --checkpoint g.ckpt " ARGS);
  CR_CHECK(r.status == 0 && cr_json_num(r.out, "start_epoch") == 1, "--graph resume exited %d: %s %s", r.status, r.out,
           r.err);
  cr_json_raw(r.out, "final_loss", resumed, sizeof resumed);
  CR_CHECK(!strcmp(straight, resumed), "--graph resumed loss %s != straight %s", resumed, straight);
  cr_free(&r);
  r = cr_run(NULL, "fashion-mnist", "--graph --logdir tb --epochs 1 --device cpu --limit 300 --checkpoint t.ckpt");
  CR_CHECK(r.status == 0 && strstr(r.out, "Epoch 1, Loss:"), "--graph --logdir exited %d: %s %s", r.status, r.out, r.err);
  cr_free(&r);

  r = cr_run(NULL, "fashion-mnist", "--resume --checkpoint missing.ckpt " ARGS);
  CR_CHECK(r.status == 2 && strstr(r.err, "no checkpoint"), "resume without a file: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "fashion-mnist", "--data /nonexistent " ARGS);
  CR_CHECK(r.status == 1 && strstr(r.err, "Fashion-MNIST"), "missing data dir: %d %s", r.status, r.err);
  cr_free(&r);

  return cr_finish("test_examples_fmnist");
}
