/*
** The environment variables kiln reads, checked in one place (issue 17.5): each setting has
** a parser that says what is accepted, the tuning switches their table (knobs.c).
** kiln_env_check() reports a bad value as an error (the examples and `kiln doctor` use
** it); the library's own readers warn once on stderr and keep the default, since
** kiln_num_threads() and the fallback policy cannot fail.
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

#define N_OF(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* The settings: the first N_CHECKED have a parser above; KILN_DATA_DIR is a path the data
** readers check. */
static const char *const settings[] = {"KILN_DEVICE",  "KILN_NUM_THREADS", "KILN_FALLBACK",
                                       "KILN_PROFILE", "KILN_ANOMALY",     "KILN_DATA_DIR"};
#define N_CHECKED 5
static const char *const setting_about[] = {
    "the default device: cpu, cuda or cuda:N",
    "threads of the CPU backend: 1 to 1024 (unset: one a core)",
    "an op a device lacks: warn (the default), error or silent",
    "the op profiler: 1 (host time), device (also device time), trace:FILE, 0",
    "NaN and infinity checks on every op's outputs: 1 or 0",
    "where the data sets are (Fashion-MNIST's idx files, ...)"};

/* Read by kiln's programs, tests, scripts and build rather than the library: known, so that
** kiln doctor takes none of them for a typo. */
static const char *const tool_vars[] = {"KILN_AB",          "KILN_BUILD_DIR",  "KILN_CLI_PLAIN",
                                        "KILN_CMAKE_EXTRA", "KILN_CUDA",       "KILN_CUDA_ARCHS",
                                        "KILN_NO_PEER",     "KILN_PARITY_TRACE", "KILN_PHASES",
                                        "KILN_PYTHON",      "KILN_SAMPLE",     "KILN_SAMPLER_OUT",
                                        "KILN_SAMPLER_US",  "KILN_SKIP_DEPS",  "KILN_SOURCE_DIR",
                                        "KILN_TORCH_PEER"};
static const char *const tool_prefixes[] = {"KILN_TEST_", "KILN_HARNESS_", "KILN_BUILD_"};

kiln_env_kind kiln_env_about(const char *name, const char **what) {
  const char *w = NULL;
  kiln_env_kind kind = KILN_ENV_UNKNOWN;
  for (int i = 0; name && i < N_OF(settings) && !kind; i++)
    if (!strcmp(name, settings[i])) kind = KILN_ENV_SETTING, w = setting_about[i];
  if (name && !kind && (w = kiln__knob_about(name)) != NULL) kind = KILN_ENV_TUNING;
  for (int i = 0; name && !kind && i < N_OF(tool_vars); i++)
    if (!strcmp(name, tool_vars[i])) kind = KILN_ENV_TOOL;
  for (int i = 0; name && !kind && i < N_OF(tool_prefixes); i++)
    if (!strncmp(name, tool_prefixes[i], strlen(tool_prefixes[i])) && name[strlen(tool_prefixes[i])])
      kind = KILN_ENV_TOOL;
  if (kind == KILN_ENV_TOOL) w = "read by kiln's programs, tests or build, not the library";
  if (what) *what = w;
  return kind;
}

/* Edit distance of a and b, capped at cap + 1 (names are short). */
static int distance(const char *a, const char *b, int cap) {
  int la = (int)strlen(a), lb = (int)strlen(b);
  if (la > 63 || lb > 63 || abs(la - lb) > cap) return cap + 1;
  int row[64];
  for (int j = 0; j <= lb; j++) row[j] = j;
  for (int i = 1; i <= la; i++) {
    int diag = row[0];
    row[0] = i;
    for (int j = 1; j <= lb; j++) {
      int up = row[j], best = diag + (a[i - 1] != b[j - 1]);
      if (up + 1 < best) best = up + 1;
      if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
      diag = up;
      row[j] = best;
    }
  }
  return row[lb];
}

const char *kiln_env_nearest(const char *name) {
  const char *best = NULL;
  if (!name) return NULL;
  int bd = 3;
  for (int i = 0; i < N_OF(settings) + kiln__knob_count() + N_OF(tool_vars); i++) {
    const int k = i - N_OF(settings), t = k - kiln__knob_count();
    const char *c = k < 0 ? settings[i] : t < 0 ? kiln__knob_name(k) : tool_vars[t];
    int d = distance(name, c, 2);
    if (d < bd) bd = d, best = c;
  }
  return best;
}

kiln_status kiln_env_check(const char *name) {
  if (!name) {
    for (int i = 0; i < N_CHECKED; i++) {
      kiln_status st = kiln_env_check(settings[i]);
      if (st != KILN_OK) return st;
    }
    for (int i = 0; i < kiln__knob_count(); i++) {
      kiln_status st = kiln__knob_check(kiln__knob_name(i));
      if (st != KILN_OK) return st;
    }
    return KILN_OK;
  }
  bool known = false;
  for (int i = 0; i < N_CHECKED; i++) known |= !strcmp(name, settings[i]);
  const char *v = getenv(name);
  int x;
  if (known && (!v || !*v)) return KILN_OK;
  if (!strcmp(name, "KILN_NUM_THREADS")) return parse_threads(v, &x);
  if (!strcmp(name, "KILN_FALLBACK")) return parse_fallback(v, &x);
  if (!strcmp(name, "KILN_PROFILE")) return parse_profile(v);
  if (!strcmp(name, "KILN_ANOMALY")) return parse_anomaly(v);
  if (!strcmp(name, "KILN_DEVICE")) return check_device_var(v);
  kiln_env_kind kind = kiln_env_about(name, NULL);
  if (kind == KILN_ENV_TUNING) return kiln__knob_check(name);
  if (kind != KILN_ENV_UNKNOWN) return KILN_OK; /* KILN_DATA_DIR and the tools' own: checked where read */
  const char *near = kiln_env_nearest(name);
  char hint[96] = "";
  if (near) snprintf(hint, sizeof hint, "; did you mean %s?", near);
  return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                        "kiln_env_check: '%s' is not a variable kiln reads%s (the settings: KILN_DEVICE, "
                        "KILN_NUM_THREADS, KILN_FALLBACK, KILN_PROFILE, KILN_ANOMALY, KILN_DATA_DIR; "
                        "`kiln doctor --switches` lists the tuning switches)",
                        name, hint);
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

const char *kiln_env_switch(int i) { return kiln__knob_name(i); }
