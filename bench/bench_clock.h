/*
** The benchmarks' clock and the comparison their medians sort with (one copy, included by
** each benchmark that times steps on the host).
*/
#ifndef KILN_BENCH_CLOCK_H
#define KILN_BENCH_CLOCK_H

#include <time.h>

/* Seconds on the monotonic clock. */
static inline double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* qsort's comparison of doubles, ascending. */
static inline int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

#endif
