/*
** KILN_PROFILE: an observer on the op call path that times every op the program calls
** (depth 0: a composite op counts whole, not again for its parts; backward's ops are
** counted apart as "name (backward)"), and prints the table at exit.
**   KILN_PROFILE=1       host time per op: on a GPU the cost of queueing the op, on the
**                        CPU the whole op;
**   KILN_PROFILE=device  also the device time between marks around each op (waits for
**                        each op: slow, and the host column then includes the waits).
** The first 20 calls of each op are left out (module loading, library handles, caches
** warming): the table is the steady state. Off (unset or "0"), nothing is registered and
** the path pays only its observer check. Any other value is refused with a message.
** Counts are kept under a lock: ops may run on several threads.
*/
#include "ops/op.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_ROWS 256

typedef struct row {
  const char *name;
  bool backward;
  int64_t warm, count;
  double host_s, device_s;
} row;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static row rows[MAX_ROWS];
static int n_rows;
static int mode; /* 1 host, 2 host and device */

typedef struct token {
  double t0;
  kiln_mark *m0;
} token;

static void *prof_begin(const kiln__op_event *e, void *ctx) {
  KILN__UNUSED(ctx);
  if (e->depth != 0) return NULL;
  token *t = malloc(sizeof *t);
  if (!t) return NULL;
  t->m0 = NULL;
  if (mode == 2 && e->n_in > 0 && e->in[0]) t->m0 = kiln_mark_record(kiln_device_of(e->in[0]));
  t->t0 = kiln__now();
  return t;
}

static kiln_status prof_end(const kiln__op_event *e, void *tok, void *ctx) {
  KILN__UNUSED(ctx);
  token *t = tok;
  if (!t) return KILN_OK;
  double ms = 0;
  if (t->m0) {
    ms = kiln_mark_elapsed_ms(t->m0, kiln_mark_record(kiln_device_of(e->in[0])));
    if (ms < 0) ms = 0;
  }
  double host = kiln__now() - t->t0;
  free(t);
  pthread_mutex_lock(&lock);
  int r = 0;
  while (r < n_rows && !(rows[r].name == e->op->name && rows[r].backward == e->backward)) r++;
  if (r == n_rows && n_rows < MAX_ROWS) {
    rows[r].name = e->op->name;
    rows[r].backward = e->backward;
    n_rows++;
  }
  if (r < n_rows && ++rows[r].warm > 20) {
    rows[r].count++;
    rows[r].host_s += host;
    rows[r].device_s += ms * 1e-3;
  }
  pthread_mutex_unlock(&lock);
  return KILN_OK;
}

static const kiln__observer profiler = {"profile", prof_begin, prof_end, NULL};

static void report(void) {
  double total = 0, dtotal = 0;
  for (int r = 0; r < n_rows; r++) total += rows[r].host_s, dtotal += rows[r].device_s;
  fprintf(stderr, "kiln profile (KILN_PROFILE=%s; per op, after 20 calls of each): host %.4f s", mode == 2 ? "device" : "1", total);
  if (mode == 2) fprintf(stderr, ", device %.4f s", dtotal);
  fprintf(stderr, "\n  %-32s %10s %10s %9s%s\n", "op", "calls", "host (s)", "us/call", mode == 2 ? "  device us/call" : "");
  for (int r = 0; r < n_rows; r++) {
    if (!rows[r].count) continue;
    char name[64];
    snprintf(name, sizeof name, "%s%s", rows[r].name, rows[r].backward ? " (backward)" : "");
    double n = (double)rows[r].count;
    fprintf(stderr, "  %-32s %10lld %10.4f %9.2f", name, (long long)rows[r].count, rows[r].host_s, 1e6 * rows[r].host_s / n);
    if (mode == 2) fprintf(stderr, "  %15.2f", 1e6 * rows[r].device_s / n);
    fprintf(stderr, "\n");
  }
}

/* Read once, when the library is loaded: the path itself never looks at the variable. */
__attribute__((constructor)) static void profile_init(void) {
  const char *e = getenv("KILN_PROFILE");
  if (!e || !*e || strcmp(e, "0") == 0) return;
  if (strcmp(e, "1") == 0) {
    mode = 1;
  } else if (strcmp(e, "device") == 0) {
    mode = 2;
  } else {
    fprintf(stderr, "kiln: KILN_PROFILE=%s is not understood (accepted: 0, 1, device); not profiling\n", e);
    return;
  }
  if (kiln__observer_add(&profiler) == KILN_OK) atexit(report);
}
