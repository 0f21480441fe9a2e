/*
** The resnet example, tiny (16 training images, 10 test images, batch 8 on the CPU: a
** step of the CIFAR-stem ResNet-18 costs about 1.7 GFLOP per image): one epoch trains,
** evaluates and prints the --json fields; the checkpoint holds the model with its
** batch-norm buffers; two epochs straight (no loader workers) equal one epoch of the same
** two-epoch schedule (--until 1, 2 workers) then --resume to two (1 worker): the same
** loss and accuracy to the last
** digit, which also checks that the augmentation does not depend on the worker count;
** bad input exits with a message. Skipped (77) when the data set is not installed.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>

#include "cli_run.h"

#define ARGS "--device cpu --limit 16 --test-limit 10 --batch 8 --json --quiet"

int main(void) {
  int need = cr_require("resnet", true);
  if (need) return need;

  cr_result r = cr_run(NULL, "resnet", "--epochs 2 --until 1 --workers 2 --checkpoint b.ckpt " ARGS);
  CR_CHECK(r.status == 0, "1 epoch exited %d: %s", r.status, r.err);
  double acc = cr_json_num(r.out, "test_acc"), loss = cr_json_num(r.out, "final_loss");
  CR_CHECK(acc >= 0 && acc <= 1, "test_acc %g", acc);
  CR_CHECK(loss > 0 && loss < 10, "final_loss %g after one tiny epoch", loss);
  CR_CHECK(cr_json_num(r.out, "train_samples") == 16, "--limit 16 not applied: %s", r.out);
  CR_CHECK(cr_json_num(r.out, "test_samples") == 10, "--test-limit 10 not applied: %s", r.out);
  CR_CHECK(cr_json_num(r.out, "steps") == 2, "steps: %s", r.out);
  CR_CHECK(cr_json_num(r.out, "batch") == 8 && cr_json_num(r.out, "epochs") == 2 &&
               cr_json_num(r.out, "start_epoch") == 0 && cr_json_num(r.out, "images_per_s") > 0 &&
               cr_json_num(r.out, "seconds") > 0,
           "json fields: %s", r.out);
  CR_CHECK(strstr(r.out, "\"example\":\"resnet\"") && strstr(r.out, "\"device\":\"cpu\"") &&
               strstr(r.out, "\"autocast\":\"off\""),
           "json fields: %s", r.out);
  cr_free(&r);

  r = cr_run(NULL, "kiln", "info b.ckpt");
  CR_CHECK(r.status == 0 && strstr(r.out, "model.layer4.1.conv2.weight") &&
               strstr(r.out, "model.layer2.0.downsample.1.running_var") && strstr(r.out, "model.fc.weight"),
           "kiln info on the checkpoint: %d %s", r.status, r.err);
  cr_free(&r);

  char straight[64], resumed[64], acc_a[32], acc_b[32];
  r = cr_run(NULL, "resnet", "--epochs 2 --workers 0 --checkpoint a.ckpt " ARGS);
  CR_CHECK(r.status == 0, "2 epochs exited %d: %s", r.status, r.err);
  cr_json_raw(r.out, "final_loss", straight, sizeof straight);
  cr_json_raw(r.out, "test_acc", acc_a, sizeof acc_a);
  CR_CHECK(cr_json_num(r.out, "steps") == 4, "steps after 2 epochs: %s", r.out);
  cr_free(&r);
  r = cr_run(NULL, "resnet", "--epochs 2 --workers 1 --resume --checkpoint b.ckpt " ARGS);
  CR_CHECK(r.status == 0, "resume exited %d: %s", r.status, r.err);
  CR_CHECK(cr_json_num(r.out, "start_epoch") == 1 && cr_json_num(r.out, "steps") == 4,
           "did not resume at epoch 1, step 2: %s", r.out);
  cr_json_raw(r.out, "final_loss", resumed, sizeof resumed);
  cr_json_raw(r.out, "test_acc", acc_b, sizeof acc_b);
  cr_free(&r);
  CR_CHECK(straight[0] && !strcmp(straight, resumed), "resumed loss %s != straight %s", resumed, straight);
  CR_CHECK(acc_a[0] && !strcmp(acc_a, acc_b), "resumed test_acc %s != straight %s", acc_b, acc_a);

  /* bad input: each refused before training, with a message (a flag after ARGS wins) */
  r = cr_run(NULL, "resnet", "--resume --checkpoint missing.ckpt " ARGS);
  CR_CHECK(r.status == 2 && strstr(r.err, "no checkpoint"), "resume without a file: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "resnet", "--data /nonexistent " ARGS);
  CR_CHECK(r.status == 1 && strstr(r.err, "Fashion-MNIST"), "missing data dir: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "resnet", "--autocast fp8 " ARGS);
  CR_CHECK(r.status == 2 && strstr(r.err, "--autocast 'fp8'"), "bad autocast: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "resnet", "--batch 0 " ARGS);
  CR_CHECK(r.status == 2 && strstr(r.err, "--batch"), "batch 0: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "resnet", "--checkpoint /nonexistent/dir/x.ckpt " ARGS);
  CR_CHECK(r.status == 2 && strstr(r.err, "does not exist"), "bad checkpoint dir: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "resnet", "--epochs 2 --until 3 " ARGS);
  CR_CHECK(r.status == 2 && strstr(r.err, "--until 3 is past --epochs 2"), "until past epochs: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "resnet", ARGS " --device nosuch");
  CR_CHECK(r.status == 2 && strstr(r.err, "--device 'nosuch'"), "bad device: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "resnet", "--frobnicate");
  CR_CHECK(r.status == 2 && strstr(r.err, "unknown option"), "unknown option: %d %s", r.status, r.err);
  cr_free(&r);
  /* a checkpoint of another model does not load: the fashion-mnist MLP's */
  r = cr_run(NULL, "fashion-mnist", "--epochs 1 --checkpoint mlp.ckpt --device cpu --limit 128 --quiet");
  CR_CHECK(r.status == 0, "fashion-mnist for a foreign checkpoint: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "resnet", "--epochs 2 --resume --checkpoint mlp.ckpt " ARGS);
  CR_CHECK(r.status == 1 && strstr(r.err, "resuming from the checkpoint") && strstr(r.err, "mlp.ckpt"),
           "a foreign checkpoint: %d %s", r.status, r.err);
  cr_free(&r);

  return cr_finish("test_examples_resnet");
}
