/* Shared by the examples: the checkpoint path checked before training, a failure reported
** the same way by each, what a resumed checkpoint says. Header-only. */
#ifndef KILN_EXAMPLES_OUTPUT_H
#define KILN_EXAMPLES_OUTPUT_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <kiln.h>
#include <kiln_io.h>

/* The checkpoint is written during training: its directory must exist and be writable,
** and the path must not be a directory, before the training starts. Prints why and
** returns 1, else 0. */
static inline int ex_check_output(const char *prog, const char *path) {
  struct stat st;
  if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
    fprintf(stderr, "%s: --checkpoint '%s' is a directory; give a file name\n", prog, path);
    return 1;
  }
  char dir[1024];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (!slash) snprintf(dir, sizeof dir, ".");
  else if (slash == dir) dir[1] = 0;
  else *slash = 0;
  if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
    fprintf(stderr, "%s: --checkpoint '%s': the directory '%s' does not exist\n", prog, path, dir);
    return 1;
  }
  if (access(dir, W_OK | X_OK) != 0) {
    fprintf(stderr, "%s: --checkpoint '%s': the directory '%s' is not writable\n", prog, path, dir);
    return 1;
  }
  return 0;
}

/* --resume's checkpoint must exist and be a regular file (a FIFO would block the load).
** Prints why and returns 1, else 0. */
static inline int ex_check_resume(const char *prog, const char *path) {
  struct stat st;
  if (stat(path, &st) != 0) {
    fprintf(stderr, "%s: --resume: no checkpoint at '%s' (train without --resume first, or pass --checkpoint PATH)\n",
            prog, path);
    return 1;
  }
  if (!S_ISREG(st.st_mode)) {
    fprintf(stderr, "%s: --resume: '%s' is not a regular file\n", prog, path);
    return 1;
  }
  return 0;
}

/* What failed, with kiln's error when there is one (a check of the example's own sets none). */
static inline void ex_report_failure(const char *prog, const char *what) {
  if (kiln_last_error() == KILN_OK)
    fprintf(stderr, "%s: %s failed\n", prog, what);
  else
    fprintf(stderr, "%s: %s: %s (%s)\n", prog, what, kiln_last_error_message(), kiln_error_name(kiln_last_error()));
}

/* main's two ways out once it has made something. Each example keeps all that main makes
** in one static struct, freed by its own release() (NULL members skipped), so that every
** exit, the error ones too, leaves nothing behind (LeakSanitizer checks them):
** finish(rc) releases and returns rc; fail(what) says what failed (ex_report_failure) and
** returns finish(1). */
#define EX_DEFINE_EXITS(prog, release_fn)                                                                 \
  static int finish(int rc) {                                                                             \
    release_fn();                                                                                         \
    return rc;                                                                                            \
  }                                                                                                       \
  static int fail(const char *what) {                                                                     \
    ex_report_failure(prog, what);                                                                        \
    return finish(1);                                                                                     \
  }

/* One value of a checkpoint's "extra" metadata (read back by ex_resume_meta and
** kiln_dict_get_meta): a real to the last bit (%.17g), an integer. kiln_dict_set_meta's
** status. */
static inline kiln_status ex_meta_real(kiln_dict *extra, const char *key, double v) {
  char buf[64];
  snprintf(buf, sizeof buf, "%.17g", v);
  return kiln_dict_set_meta(extra, key, buf);
}

static inline kiln_status ex_meta_int(kiln_dict *extra, const char *key, long long v) {
  char buf[32];
  snprintf(buf, sizeof buf, "%lld", v);
  return kiln_dict_set_meta(extra, key, buf);
}

/* What a resumed checkpoint's "extra" metadata says of the run that wrote it: its last
** loss and test accuracy into *loss and *acc (left as they are when absent), and warnings
** when it is past --epochs or was trained with another --batch or number of samples. */
static inline void ex_resume_meta(const char *prog, const kiln_dict *extra, int64_t start_epoch, long long epochs,
                                  long long batch, int64_t ntrain, double *loss, double *acc) {
  if (start_epoch > epochs)
    fprintf(stderr, "%s: warning: the checkpoint is at epoch %lld, past --epochs %lld: nothing to train\n", prog,
            (long long)start_epoch, epochs);
  const char *s;
  if ((s = kiln_dict_get_meta(extra, "train_loss"))) *loss = strtod(s, NULL);
  if ((s = kiln_dict_get_meta(extra, "test_acc"))) *acc = strtod(s, NULL);
  if ((s = kiln_dict_get_meta(extra, "batch")) && strtoll(s, NULL, 10) != batch)
    fprintf(stderr, "%s: warning: the checkpoint was trained with --batch %s, this run uses %lld\n", prog, s, batch);
  if ((s = kiln_dict_get_meta(extra, "train_samples")) && strtoll(s, NULL, 10) != ntrain)
    fprintf(stderr, "%s: warning: the checkpoint was trained on %s samples, this run uses %lld\n", prog, s,
            (long long)ntrain);
}

#endif
