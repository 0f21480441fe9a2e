/*
** The fashion-mnist example: one short epoch trains and evaluates (the MLP, and the CNN
** of --model cnn); a checkpoint resumes
** bit-identically on the CPU (2 epochs straight == 1 epoch, then --resume to 2); kiln
** info reads the checkpoint. Skipped (77) when the data set is not installed.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>

#include "cli_run.h"

#define ARGS "--device cpu --limit 2000 --json --quiet"

int main(void) {
  char bin[1024], exe[1100];
  cr_bin_dir(bin, sizeof bin);
  snprintf(exe, sizeof exe, "%s/fashion-mnist", bin);
  if (!cr_file_exists(exe)) {
    fprintf(stderr, "skip: %s not built\n", exe);
    return 77;
  }
  if (!cr_have_fashion_mnist()) {
    fprintf(stderr, "skip: Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)\n");
    return 77;
  }

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

  r = cr_run(NULL, "fashion-mnist", "--resume --checkpoint missing.ckpt " ARGS);
  CR_CHECK(r.status == 2 && strstr(r.err, "no checkpoint"), "resume without a file: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "fashion-mnist", "--data /nonexistent " ARGS);
  CR_CHECK(r.status == 1 && strstr(r.err, "Fashion-MNIST"), "missing data dir: %d %s", r.status, r.err);
  cr_free(&r);

  cr_cleanup();
  if (cr_failures) fprintf(stderr, "%d check(s) failed\n", cr_failures);
  else printf("test_examples_fmnist: all passed\n");
  return cr_failures ? 1 : 0;
}
