/*
** The seed-mlp example as a user runs it: two epochs on the CPU, the loss goes down, the
** closing JSON line carries the figures; bad flags are refused with a message (exit 2);
** --logdir writes TensorBoard events (a loss per step, the epoch figures), and a log
** directory that cannot be made stops the run before training.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_io.h>

#include <dirent.h>

#include "cli_run.h"
#include "scratch.h"

static double epoch_loss(const char *out, int epoch) {
  char pat[32];
  snprintf(pat, sizeof pat, "Epoch %d, Loss: ", epoch);
  const char *p = strstr(out, pat);
  return p ? strtod(p + strlen(pat), NULL) : NAN;
}

static void test_train(void) {
  cr_result r = cr_run(NULL, "seed-mlp", "--device cpu --epochs 2 --json");
  CR_CHECK(r.status == 0, "seed-mlp exited %d: %s", r.status, r.err);
  double l1 = epoch_loss(r.out, 1), l2 = epoch_loss(r.out, 2);
  CR_CHECK(l1 > 0 && l2 > 0 && l2 < l1, "loss did not decrease: %g -> %g\n%s", l1, l2, r.out);
  CR_CHECK(strstr(r.out, "device: cpu") && strstr(r.out, "parameters: 8578"), "header:\n%s", r.out);
  char line[1024];
  cr_last_line(r.out, line, sizeof line);
  CR_CHECK(line[0] == '{' && strstr(line, "\"example\":\"seed-mlp\""), "last line: %s", line);
  double fl = cr_json_num(line, "final_loss");
  CR_CHECK(fabs(fl - l2) < 1e-4, "final_loss %g vs epoch 2 %g", fl, l2);
  CR_CHECK(cr_json_num(line, "epochs") == 2 && cr_json_num(line, "batch") == 128, "epochs/batch");
  CR_CHECK(cr_json_num(line, "train_acc") > 0.9, "train_acc %g", cr_json_num(line, "train_acc"));
  CR_CHECK(cr_json_num(line, "samples_per_s") > 0 && cr_json_num(line, "us_per_step") > 0, "speed");
  cr_free(&r);

  /* --quiet --json: stdout is exactly the JSON line. */
  r = cr_run(NULL, "seed-mlp", "--device cpu --epochs 1 --batch 512 --json --quiet");
  CR_CHECK(r.status == 0, "quiet run exited %d", r.status);
  CR_CHECK(r.out[0] == '{' && strchr(r.out, '\n') == r.out + strlen(r.out) - 1,
           "quiet output is not one line: %s", r.out);
  CR_CHECK(cr_json_num(r.out, "batch") == 512, "batch 512");
  cr_free(&r);

  /* --graph: the recorded step (run eagerly on the CPU) trains exactly like the plain loop,
  ** with a smaller last batch (20000 = 156 * 128 + 32) taking its own recording. */
  r = cr_run(NULL, "seed-mlp", "--device cpu --epochs 2 --json --quiet");
  cr_result rg = cr_run(NULL, "seed-mlp", "--device cpu --epochs 2 --json --quiet --graph");
  CR_CHECK(r.status == 0 && rg.status == 0, "graph run exited %d: %s", rg.status, rg.err);
  CR_CHECK(strstr(rg.out, "\"example\":\"seed-mlp-graph\""), "graph JSON: %s", rg.out);
  CR_CHECK(cr_json_num(rg.out, "final_loss") == cr_json_num(r.out, "final_loss"),
           "graph final_loss %g vs eager %g", cr_json_num(rg.out, "final_loss"), cr_json_num(r.out, "final_loss"));
  cr_free(&r);
  cr_free(&rg);
}

static void test_bad_flags(void) {
  const char *bad[][2] = {{"--batch 0", "--batch"},        {"--epochs -1", "--epochs"},
                          {"--epochs x", "--epochs"},      {"--device tpu", "tpu"},
                          {"--lr 0", "--lr"},              {"--batch", "needs a value"},
                          {"--frobnicate", "unknown option"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    cr_result r = cr_run(NULL, "seed-mlp", bad[i][0]);
    CR_CHECK(r.status == 2, "'%s' exited %d", bad[i][0], r.status);
    CR_CHECK(strstr(r.err, bad[i][1]), "'%s': message '%s' lacks '%s'", bad[i][0], r.err, bad[i][1]);
    CR_CHECK(!strstr(r.out, "Epoch"), "'%s' trained anyway", bad[i][0]);
    cr_free(&r);
  }
}

static bool count_tags(const kiln_scalar_event *e, void *ctx) {
  int *n = ctx;
  if (!strcmp(e->tag, "train/loss")) n[0]++;
  if (!strcmp(e->tag, "epoch/loss")) n[1]++;
  if (!strcmp(e->tag, "memory/saved_peak_mib") && e->value > 0) n[2]++;
  return true;
}

static void test_logdir(void) {
  char dir[512], args[1200], logdir[640];
  if (scratch_begin(dir, sizeof dir, "logdir") != 0) return;
  snprintf(logdir, sizeof logdir, "%s/runs/mlp", dir);
  snprintf(args, sizeof args, "--device cpu --epochs 2 --quiet --logdir %s", logdir);
  cr_result r = cr_run(NULL, "seed-mlp", args);
  CR_CHECK(r.status == 0, "--logdir run exited %d: %s", r.status, r.err);
  cr_free(&r);
  int n[3] = {0, 0, 0}, files = 0;
  DIR *d = opendir(logdir);
  struct dirent *de;
  while (d && (de = readdir(d)) != NULL) {
    if (!strstr(de->d_name, "tfevents")) continue;
    char path[1400];
    snprintf(path, sizeof path, "%s/%s", logdir, de->d_name);
    files++;
    CR_CHECK(kiln_summary_read(path, count_tags, n) == KILN_OK, "reading %s: %s", path, kiln_last_error_message());
  }
  if (d) closedir(d);
  /* 20000 samples in batches of 128: 157 steps an epoch */
  CR_CHECK(files == 1 && n[0] == 2 * 157 && n[1] == 2 && n[2] == 2, "events: %d files, %d losses, %d epochs, %d memory",
           files, n[0], n[1], n[2]);
  r = cr_run(NULL, "seed-mlp", "--device cpu --epochs 1 --logdir /dev/null/x");
  CR_CHECK(r.status == 1 && strstr(r.err, "log directory") && !strstr(r.out, "Epoch"),
           "unwritable --logdir: exit %d, '%s'", r.status, r.err);
  cr_free(&r);
  scratch_end(dir);
}

int main(void) {
  int need = cr_require("seed-mlp", false);
  if (need) return need;
  test_bad_flags();
  test_train();
  test_logdir();
  return cr_finish("test_examples");
}
