/*
** Issues 17.5 to 17.7 for the examples: nonsense is refused before any training, with a
** message and a non-zero exit, never "(KILN_ERR_OK)"; nothing leaks on those exits (under
** `make asan` LeakSanitizer would turn the exit code into 23 and print its report); a bad
** KILN_* variable stops them. Data sets are made here (small IDX files), so this test
** runs without the Fashion-MNIST package.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>

#include <sys/stat.h>

#include "cli_run.h"

/* An IDX file of n images h x w (u8), or of n labels when h == 0. */
static void write_idx(const char *dir, const char *name, int n, int h, int w) {
  char p[512];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  FILE *f = fopen(p, "wb");
  if (!f) return;
  unsigned char hd[16] = {0, 0, 0x08, (unsigned char)(h ? 3 : 1)};
  int dims[3] = {n, h, w}, nd = h ? 3 : 1;
  for (int i = 0; i < nd; i++)
    for (int k = 0; k < 4; k++) hd[4 + 4 * i + k] = (unsigned char)(dims[i] >> (24 - 8 * k));
  fwrite(hd, 1, 4 + 4 * (size_t)nd, f);
  long cnt = (long)n * (h ? h * w : 1);
  for (long i = 0; i < cnt; i++) fputc(h ? (int)(i % 251) : (int)(i % 10), f);
  fclose(f);
}

/* A data set directory: train n x (h, w), test m x (h, w). */
static void make_set(const char *name, int n, int m, int h, int w) {
  char d[512];
  snprintf(d, sizeof d, "%s/%s", cr_tmpdir(), name);
  mkdir(d, 0700);
  write_idx(d, "train-images-idx3-ubyte", n, h, w);
  write_idx(d, "train-labels-idx1-ubyte", n, 0, 0);
  write_idx(d, "t10k-images-idx3-ubyte", m, h, w);
  write_idx(d, "t10k-labels-idx1-ubyte", m, 0, 0);
}

static void expect_refused(const char *env, const char *prog, const char *args, int code, const char *needle) {
  cr_result r = cr_run(env, prog, args);
  CR_CHECK(r.status == code && strstr(r.err, needle), "%s %s %s: exit %d (want %d), stderr:\n%s", env ? env : "",
           prog, args, r.status, code, r.err);
  CR_CHECK(!strstr(r.err, "KILN_ERR_OK") && !strstr(r.err, "LeakSanitizer"), "%s %s:\n%s", prog, args, r.err);
  CR_CHECK(!strstr(r.out, "Epoch 1"), "%s %s trained before failing:\n%s", prog, args, r.out);
  cr_free(&r);
}

int main(void) {
  int need = cr_require("fashion-mnist", false);
  if (need) return need;
  make_set("empty-train", 0, 10, 28, 28);
  make_set("empty-test", 20, 0, 28, 28);
  make_set("small-images", 20, 10, 27, 27);
  make_set("good", 20, 10, 28, 28);
  const char *fm = "fashion-mnist";
  expect_refused(NULL, fm, "--data empty-train --device cpu --checkpoint c.ckpt", 1, "the training set has no images");
  expect_refused(NULL, fm, "--data empty-test --device cpu --checkpoint c.ckpt", 1, "the test set has no images");
  expect_refused(NULL, fm, "--data small-images --device cpu --checkpoint c.ckpt", 1, "28 x 28");
  expect_refused(NULL, fm, "--data good --device cpu --autocast f8 --checkpoint c.ckpt", 2, "use bf16 or f16");
  char ck0[512];
  snprintf(ck0, sizeof ck0, "%s/c.ckpt", cr_tmpdir());
  CR_CHECK(!cr_file_exists(ck0), "a checkpoint was written from nonsense data");
  /* an output path that cannot be written: refused before the first epoch */
  expect_refused(NULL, fm, "--data good --device cpu --checkpoint /nonexistent/dir/c.ckpt", 2, "does not exist");
  expect_refused(NULL, fm, "--data good --device cpu --checkpoint .", 2, "is a directory");
  /* --resume on a FIFO fails at once (timeout: it used to block in open) */
  char fifo[512], args[1024];
  snprintf(fifo, sizeof fifo, "%s/ck.fifo", cr_tmpdir());
  if (mkfifo(fifo, 0600) == 0) {
    snprintf(args, sizeof args, "--data good --device cpu --resume --checkpoint '%s'", fifo);
    expect_refused("timeout 30", fm, args, 2, "not a regular file");
  }
  /* a FIFO in place of a data set file */
  make_set("fifo-set", 20, 10, 28, 28);
  snprintf(fifo, sizeof fifo, "%s/fifo-set/t10k-labels-idx1-ubyte", cr_tmpdir());
  remove(fifo);
  if (mkfifo(fifo, 0600) == 0)
    expect_refused("timeout 30", fm, "--data fifo-set --device cpu --checkpoint c.ckpt", 1, "a FIFO");
  /* bad environment: refused by both examples, with the accepted values */
  const char *envs[] = {"KILN_NUM_THREADS=0", "KILN_NUM_THREADS=-1", "KILN_NUM_THREADS=abc",
                        "KILN_NUM_THREADS=4x", "KILN_NUM_THREADS=100000", "KILN_FALLBACK=nonsense",
                        "KILN_DEVICE=nonsense", "KILN_PROFILE=yes", "KILN_ANOMALY=2",
                        "KILN_CONV_GEMM=off", "KILN_ATTENTION=flash"};
  const char *needles[] = {"1 to 1024", "1 to 1024", "1 to 1024", "1 to 1024", "1 to 1024",
                           "warn (the default), error or silent", "cpu, cuda or cuda:N", "device",
                           "KILN_ANOMALY='2'", "KILN_CONV_GEMM='off'", "own|cudnn-fwd|cudnn-bwd|cudnn"};
  for (int i = 0; i < 11; i++) {
    expect_refused(envs[i], fm, "--data good --checkpoint c.ckpt", 2, needles[i]);
    expect_refused(envs[i], "seed-mlp", "--epochs 1 --quiet", 2, needles[i]);
  }
  /* --device wins over KILN_DEVICE; the good set trains (one tiny epoch) and exits 0 */
  cr_result r = cr_run("KILN_DEVICE=nonsense", fm, "--data good --device cpu --epochs 1 --checkpoint c.ckpt --quiet");
  CR_CHECK(r.status == 0, "good set: %d %s", r.status, r.err);
  cr_free(&r);
  char ck[512];
  snprintf(ck, sizeof ck, "%s/c.ckpt", cr_tmpdir());
  CR_CHECK(cr_file_exists(ck), "no checkpoint after a good run");
  return cr_finish("test_examples_bad_input");
}
