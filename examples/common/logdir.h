/*
** --logdir DIR for the examples: training curves as TensorBoard event files (kiln_io.h),
** which `tensorboard --logdir DIR` shows and `kiln plot DIR` draws. Header-only.
**   per step:  train/loss
**   per epoch: epoch/loss, epoch/lr, epoch/samples_per_s, memory/allocated_mib,
**              memory/reserved_mib, memory/saved_peak_mib (activations saved for backward)
** The writer is opened before training: a directory that cannot be made stops the program
** then, with the error, before any work is lost.
*/
#ifndef KILN_EXAMPLES_LOGDIR_H
#define KILN_EXAMPLES_LOGDIR_H

#include <kiln.h>
#include <kiln_io.h>

#include <stdio.h>

/* NULL when dir is NULL (no logging); exits 1 with the message when it cannot be opened. */
static inline kiln_summary_writer *ex_log_open(const char *prog, const char *dir) {
  if (!dir) return NULL;
  kiln_summary_writer *w = kiln_summary_writer_open(dir);
  if (!w) {
    fprintf(stderr, "%s: --logdir: %s\n", prog, kiln_last_error_message());
    exit(1);
  }
  return w;
}

/* A failed write is reported once and logging stops; training goes on. */
static inline void ex_log_scalar(kiln_summary_writer **w, const char *tag, int64_t step, double v) {
  if (!*w) return;
  if (kiln_summary_writer_add_scalar(*w, tag, step, v) != KILN_OK) {
    fprintf(stderr, "warning: logging stopped: %s\n", kiln_last_error_message());
    kiln_summary_writer_close(*w);
    *w = NULL;
  }
}

static inline void ex_log_epoch(kiln_summary_writer **w, int64_t step, double loss, double lr, double samples_per_s,
                                kiln_device dev) {
  if (!*w) return;
  kiln_memory_stats ms;
  int64_t live = 0, peak = 0;
  kiln_autograd_saved_bytes(&live, &peak);
  ex_log_scalar(w, "epoch/loss", step, loss);
  ex_log_scalar(w, "epoch/lr", step, lr);
  ex_log_scalar(w, "epoch/samples_per_s", step, samples_per_s);
  if (kiln_memory_stats_get(dev, &ms) == KILN_OK) {
    ex_log_scalar(w, "memory/allocated_mib", step, (double)ms.allocated / 1048576.0);
    ex_log_scalar(w, "memory/reserved_mib", step, (double)ms.reserved / 1048576.0);
  }
  ex_log_scalar(w, "memory/saved_peak_mib", step, (double)peak / 1048576.0);
  if (*w) kiln_summary_writer_flush(*w);
}

static inline void ex_log_close(kiln_summary_writer *w) {
  if (w && kiln_summary_writer_close(w) != KILN_OK) fprintf(stderr, "warning: %s\n", kiln_last_error_message());
}

#endif
