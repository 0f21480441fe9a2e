/*
** The environment variables kiln reads, checked in one place (issue 17.5): each has a
** parser that says what is accepted. kiln_env_check() reports a bad value as an error
** (the examples and `kiln doctor` use it); the library's own readers warn once on stderr
** and keep the default, since kiln_num_threads() and the fallback policy cannot fail.
*/
#include "kiln_int.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_THREADS 1024

/* KILN_NUM_THREADS: 1..1024, digits only (no sign, no suffix, no spaces). */
static kiln_status parse_threads(const char *v, int *out) {
  bool digits = *v != 0;
  for (const char *p = v; *p; p++)
    if (*p < '0' || *p > '9') digits = false;
  long n = 0;
  if (digits) {
    errno = 0;
    n = strtol(v, NULL, 10);
    if (errno) n = MAX_THREADS + 1;
  }
  if (!digits || n < 1 || n > MAX_THREADS)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "KILN_NUM_THREADS='%s' is not a thread count: use an integer from 1 to %d, "
                          "or unset it for one thread per core",
                          v, MAX_THREADS);
  *out = (int)n;
  return KILN_OK;
}

static kiln_status parse_fallback(const char *v, int *out) {
  if (!strcmp(v, "warn")) *out = KILN_FALLBACK_WARN;
  else if (!strcmp(v, "error")) *out = KILN_FALLBACK_ERROR;
  else if (!strcmp(v, "silent")) *out = KILN_FALLBACK_SILENT;
  else
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "KILN_FALLBACK='%s' is not a fallback policy: use warn (the default), "
                          "error or silent", v);
  return KILN_OK;
}

static kiln_status parse_profile(const char *v) {
  if (!strcmp(v, "0") || !strcmp(v, "1") || !strcmp(v, "device")) return KILN_OK;
  if (!strncmp(v, "trace:", 6) && v[6]) return KILN_OK; /* the path is checked when the profiler opens it */
  return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                        "KILN_PROFILE='%s' is not a profile mode: use 1 (host time per op), device "
                        "(also device time), trace:FILE (also a Chrome trace) or 0 (off)", v);
}

static kiln_status parse_anomaly(const char *v) {
  if (!strcmp(v, "0") || !strcmp(v, "1")) return KILN_OK;
  return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                        "KILN_ANOMALY='%s' is not understood: use 1 (check every op's outputs for NaN "
                        "and infinity) or 0 (off)", v);
}

static kiln_status check_device_var(const char *v) {
  kiln_device d;
  if (kiln_device_parse(v, &d) == KILN_OK) return KILN_OK;
  bool syntax = strcmp(v, "cpu") && strcmp(v, "cuda") && strncmp(v, "cuda:", 5);
  char msg[600];
  snprintf(msg, sizeof msg, "%s", kiln_last_error_message());
  if (syntax)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "KILN_DEVICE='%s' is not a device: use cpu, cuda or cuda:N", v);
  return kiln_set_error(KILN_ERR_DEVICE, "KILN_DEVICE='%s' cannot be used: %s", v, msg);
}

static const char *const checked[] = {"KILN_DEVICE", "KILN_NUM_THREADS", "KILN_FALLBACK",
                                      "KILN_PROFILE", "KILN_ANOMALY"};

kiln_status kiln_env_check(const char *name) {
  if (!name) {
    for (size_t i = 0; i < sizeof checked / sizeof checked[0]; i++) {
      kiln_status st = kiln_env_check(checked[i]);
      if (st != KILN_OK) return st;
    }
    return KILN_OK;
  }
  bool known = false;
  for (size_t i = 0; i < sizeof checked / sizeof checked[0]; i++) known |= !strcmp(name, checked[i]);
  const char *v = getenv(name);
  int x;
  if (known && (!v || !*v)) return KILN_OK;
  if (!strcmp(name, "KILN_NUM_THREADS")) return parse_threads(v, &x);
  if (!strcmp(name, "KILN_FALLBACK")) return parse_fallback(v, &x);
  if (!strcmp(name, "KILN_PROFILE")) return parse_profile(v);
  if (!strcmp(name, "KILN_ANOMALY")) return parse_anomaly(v);
  if (!strcmp(name, "KILN_DEVICE")) return check_device_var(v);
  return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                        "kiln_env_check: '%s' is not a variable kiln reads (KILN_DEVICE, "
                        "KILN_NUM_THREADS, KILN_FALLBACK, KILN_PROFILE, KILN_ANOMALY)", name);
}

/* The library's readers: a bad value is said once on stderr, then the default is used.
** The thread-local last error is left as the caller had it. */
static void warn_once(atomic_int *flag, const char *what) {
  if (atomic_exchange(flag, 1) == 0) fprintf(stderr, "kiln: %s; using the default\n", what);
}

int kiln__env_num_threads(void) {
  static atomic_int warned;
  const char *v = kiln__getenv("KILN_NUM_THREADS");
  if (!v) return 0;
  char saved[1024];
  kiln_status code = kiln_last_error();
  snprintf(saved, sizeof saved, "%s", kiln_last_error_message());
  int n = 0;
  if (parse_threads(v, &n) != KILN_OK) {
    warn_once(&warned, kiln_last_error_message());
    n = 0;
  }
  if (code == KILN_OK) kiln_clear_error();
  else kiln_set_error(code, "%s", saved);
  return n;
}

int kiln__env_fallback_policy(void) {
  static atomic_int warned;
  const char *v = kiln__getenv("KILN_FALLBACK");
  if (!v) return KILN_FALLBACK_WARN;
  char saved[1024];
  kiln_status code = kiln_last_error();
  snprintf(saved, sizeof saved, "%s", kiln_last_error_message());
  int p = KILN_FALLBACK_WARN;
  if (parse_fallback(v, &p) != KILN_OK) {
    warn_once(&warned, kiln_last_error_message());
    p = KILN_FALLBACK_WARN;
  }
  if (code == KILN_OK) kiln_clear_error();
  else kiln_set_error(code, "%s", saved);
  return p;
}
