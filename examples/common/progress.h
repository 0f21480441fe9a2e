/*
** Header-only helpers shared by the example programs (the build makes one program per
** top-level examples/ .c file, so shared code lives here as static inline functions).
**
** Progress: on a terminal (isatty(2)) a one-line bar on stderr with percent, samples/s
** and ETA, redrawn at most 10 times a second and erased when the loop ends; otherwise
** nothing (the program prints one plain line per epoch on stdout instead).
**
**   ex_progress p;
**   ex_progress_begin(&p, "epoch 3/5", total_samples, !quiet);
**   ... ex_progress_update(&p, samples_done);
**   ex_progress_end(&p);
**
** Define _POSIX_C_SOURCE 200809L before the first #include of the program.
*/
#ifndef KILN_EXAMPLES_PROGRESS_H
#define KILN_EXAMPLES_PROGRESS_H

#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static inline double ex_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

typedef struct ex_progress {
  bool on;          /* drawing (a terminal and not quiet) */
  const char *label;
  int64_t total;
  int64_t done;
  double t0;
  double last_draw;
} ex_progress;

static inline void ex_progress_draw(ex_progress *p, double now) {
  double el = now - p->t0;
  double frac = p->total > 0 ? (double)p->done / (double)p->total : 1.0;
  if (frac > 1) frac = 1;
  double rate = el > 0 ? (double)p->done / el : 0;
  double eta = rate > 0 ? (double)(p->total - p->done) / rate : 0;
  enum { W = 30 };
  char bar[W + 1];
  int fill = (int)(frac * W + 0.5);
  for (int i = 0; i < W; i++) bar[i] = i < fill ? '#' : '.';
  bar[W] = 0;
  fprintf(stderr, "\r%s [%s] %3.0f%%  %8.0f samples/s  ETA %4.0fs\033[K", p->label, bar,
          100.0 * frac, rate, eta);
  fflush(stderr);
  p->last_draw = now;
}

static inline void ex_progress_begin(ex_progress *p, const char *label, int64_t total,
                                     bool enabled) {
  const char *plain = getenv("KILN_CLI_PLAIN");
  p->on = enabled && isatty(2) == 1 && !(plain && *plain && strcmp(plain, "0"));
  p->label = label;
  p->total = total;
  p->done = 0;
  p->t0 = ex_now();
  p->last_draw = 0;
}

static inline void ex_progress_update(ex_progress *p, int64_t done) {
  p->done = done;
  if (!p->on) return;
  double now = ex_now();
  if (now - p->last_draw >= 0.1) ex_progress_draw(p, now);
}

static inline void ex_progress_end(ex_progress *p) {
  if (!p->on) return;
  fputs("\r\033[K", stderr); /* erase the bar; the caller prints the epoch's line */
  fflush(stderr);
}

#endif /* KILN_EXAMPLES_PROGRESS_H */
