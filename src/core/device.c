#define _POSIX_C_SOURCE 200809L
/* Devices: naming, parsing, picking the best one, and the backends' availability. */
#include "kiln_int.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__has_include)
#if __has_include("kiln_build_config.h")
#include "kiln_build_config.h"
#endif
#endif
#ifndef KILN_BUILD_INFO
#define KILN_BUILD_INFO "unknown build"
#endif

const char *kiln_version(void) { return KILN_VERSION; }
const char *kiln_build_info(void) { return KILN_BUILD_INFO; }

kiln_device kiln_device_cpu(void) {
  kiln_device d = {KILN_DEVICE_CPU, 0};
  return d;
}

kiln_device kiln_device_cuda(int index) {
  kiln_device d = {KILN_DEVICE_CUDA, index};
  return d;
}

bool kiln_device_equal(kiln_device a, kiln_device b) {
  return a.type == b.type && (a.type == KILN_DEVICE_CPU || a.index == b.index);
}

const char *kiln_device_str(kiln_device dev, char *buf, size_t n) {
  if (!buf || n == 0) return buf;
  const char *name = kiln__device_type_name(dev.type);
  if (dev.type == KILN_DEVICE_CPU)
    snprintf(buf, n, "cpu");
  else if (name)
    snprintf(buf, n, "%s:%d", name, dev.index);
  else
    snprintf(buf, n, "device(%d:%d)", (int)dev.type, dev.index);
  return buf;
}

const char *kiln__device_cstr(kiln_device dev) {
  static _Thread_local char bufs[4][24];
  static _Thread_local int next;
  char *b = bufs[next++ & 3];
  return kiln_device_str(dev, b, 24);
}

/* ---- the registry, publicly ---- */
int kiln_backend_count(void) { return kiln__backend_count(); }

kiln_device_type kiln_backend_type(int i) {
  kiln_device_type t;
  return kiln__backend_at(i, &t) ? t : KILN__DEVICE_TYPE_ANY;
}

const char *kiln_backend_name(kiln_device_type type) { return kiln__device_type_name(type); }

/* ---- availability, probed once per backend (per registry slot) ---- */
static pthread_mutex_t probe_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int probe_state[KILN__MAX_BACKENDS]; /* 0 not yet, 1 works, 2 does not */
static const char *probe_why[KILN__MAX_BACKENDS];

bool kiln_backend_built(kiln_device_type type) { return kiln__backend_get(type) != NULL; }

bool kiln_backend_available(kiln_device_type type, const char **why) {
  int slot = kiln__backend_slot(type);
  if (slot < 0) {
    const char *w = kiln__backend_missing_why(type);
    if (why) *why = w ? w : "unknown device type";
    return false;
  }
  int state = atomic_load_explicit(&probe_state[slot], memory_order_acquire);
  if (state == 0) {
    pthread_mutex_lock(&probe_lock);
    state = atomic_load_explicit(&probe_state[slot], memory_order_relaxed);
    if (state == 0) {
      const kiln__backend *b = kiln__backend_get(type);
      const char *w = NULL;
      kiln_status st = b->probe ? b->probe(&w) : KILN_OK;
      probe_why[slot] = st == KILN_OK ? NULL : (w ? w : "the backend's probe failed");
      state = st == KILN_OK ? 1 : 2;
      atomic_store_explicit(&probe_state[slot], state, memory_order_release);
    }
    pthread_mutex_unlock(&probe_lock);
  }
  if (why) *why = probe_why[slot];
  return state == 1;
}

int kiln_device_count(kiln_device_type type) {
  if (!kiln_backend_available(type, NULL)) return 0;
  const kiln__backend *b = kiln__backend_get(type);
  return b->device_count ? b->device_count() : 1;
}

static kiln_status check_device(kiln_device d, const char *what) {
  if (d.type == KILN_DEVICE_CPU) return KILN_OK;
  const char *name = kiln__device_type_name(d.type);
  if (!name) return kiln_set_error(KILN_ERR_DEVICE, "%s: unknown device type %d", what, (int)d.type);
  const char *why = NULL;
  if (!kiln_backend_available(d.type, &why))
    return kiln_set_error(KILN_ERR_UNAVAILABLE, "%s: %s is not available: %s", what, name,
                          why ? why : "unknown reason");
  int n = kiln_device_count(d.type);
  if (d.index < 0 || d.index >= n)
    return kiln_set_error(KILN_ERR_DEVICE, "%s: no device %s:%d (%d %s device%s visible)", what, name,
                          d.index, n, name, n == 1 ? "" : "s");
  return KILN_OK;
}

kiln_status kiln__check_device(kiln_device d, const char *what) { return check_device(d, what); }

/* "cpu, cuda or cuda:N, testdev or testdev:N": the names a device string may use. */
static const char *device_forms(char *buf, size_t n) {
  size_t k = (size_t)snprintf(buf, n, "cpu");
  for (int t = 1; t < KILN__DEVICE_TYPE_LIMIT && k < n; t++) {
    const char *name = kiln__device_type_name((kiln_device_type)t);
    if (name) k += (size_t)snprintf(buf + k, n - k, ", %s or %s:N", name, name);
  }
  return buf;
}

kiln_status kiln_device_parse(const char *s, kiln_device *out) {
  if (!s || !out) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_device_parse: NULL argument");
  char forms[256];
  kiln_device d = kiln_device_cpu();
  if (strcmp(s, "cpu") != 0) {
    /* "<name>" or "<name>:N", name a registered backend's or a named type's */
    size_t len = strcspn(s, ":");
    kiln_device_type type = KILN__DEVICE_TYPE_ANY;
    for (int t = 1; t < KILN__DEVICE_TYPE_LIMIT; t++) {
      const char *name = kiln__device_type_name((kiln_device_type)t);
      if (name && strlen(name) == len && strncmp(s, name, len) == 0) type = (kiln_device_type)t;
    }
    long idx = 0;
    bool ok = type != KILN__DEVICE_TYPE_ANY;
    if (ok && s[len] == ':') {
      char *end = NULL;
      ok = s[len + 1] >= '0' && s[len + 1] <= '9';
      if (ok) idx = strtol(s + len + 1, &end, 10);
      ok = ok && *end == 0 && idx <= 1024;
    }
    if (!ok)
      return kiln_set_error(KILN_ERR_DEVICE, "kiln_device_parse: '%s' is not a device (use %s)", s,
                            device_forms(forms, sizeof forms));
    d.type = type;
    d.index = (int)idx;
  }
  kiln_status st = check_device(d, "kiln_device_parse");
  if (st == KILN_ERR_UNAVAILABLE) {
    const char *why = NULL;
    kiln_backend_available(d.type, &why);
    return kiln_set_error(KILN_ERR_DEVICE, "kiln_device_parse: no device %s: %s is not available (%s)", s,
                          kiln__device_type_name(d.type), why ? why : "unknown reason");
  }
  if (st != KILN_OK) return st;
  *out = d;
  return KILN_OK;
}

kiln_device kiln_device_best(void) {
  const char *env = kiln__getenv("KILN_DEVICE");
  if (env) {
    kiln_device d;
    if (kiln_device_parse(env, &d) == KILN_OK) return d;
    fprintf(stderr, "kiln: KILN_DEVICE=%s ignored: %s\n", env, kiln_last_error_message());
    kiln_clear_error();
  }
  kiln_device best = kiln_device_cpu();
  int rank = 0;
  for (int i = 0, n = kiln__backend_count(); i < n; i++) {
    kiln_device_type t;
    const kiln__backend *b = kiln__backend_at(i, &t);
    /* best_rank is read again after the count: a probe may lower it (Vulkan's, when it
    ** finds only a CPU implementation such as lavapipe) */
    if (b && b->best_rank > rank && kiln_device_count(t) > 0 && b->best_rank > rank) {
      rank = b->best_rank;
      best.type = t;
      best.index = 0;
    }
  }
  return best;
}

kiln_status kiln_device_synchronize(kiln_device dev) {
  kiln_status st = check_device(dev, "kiln_device_synchronize");
  if (st != KILN_OK) return st;
  const kiln__backend *b = kiln__backend_get(dev.type);
  return b->synchronize ? b->synchronize(dev.index) : KILN_OK;
}

/* ---- device timing ---- */
struct kiln_mark {
  kiln_device dev;
  void *dev_mark; /* the backend's (a CUDA event); NULL on the CPU */
  double host_s;
};

kiln_mark *kiln_mark_record(kiln_device dev) {
  if (check_device(dev, "kiln_mark_record") != KILN_OK) return NULL;
  const kiln__backend *b = kiln__backend_get(dev.type);
  kiln_mark *m = calloc(1, sizeof *m);
  if (!m) KILN__FAIL_NULL(KILN_ERR_OOM, "kiln_mark_record: out of host memory");
  m->dev = dev;
  if (b->mark && b->elapsed_ms) {
    if (!(m->dev_mark = b->mark(dev.index))) {
      free(m);
      KILN__FAIL_NULL(KILN_ERR_STATE, "kiln_mark_record: cannot put a mark on %s's queue (inside a "
                      "graph capture, or the device failed)", kiln__device_cstr(dev));
    }
  } else {
    m->host_s = kiln__now();
  }
  return m;
}

static void mark_free(kiln_mark *m) {
  if (!m) return;
  if (m->dev_mark) {
    const kiln__backend *b = kiln__backend_get(m->dev.type);
    b->elapsed_ms(m->dev.index, m->dev_mark, NULL); /* frees it */
  }
  free(m);
}

double kiln_mark_elapsed_ms(kiln_mark *start, kiln_mark *stop) {
  if (!start || !stop || !kiln_device_equal(start->dev, stop->dev)) {
    kiln_set_error(!start || !stop ? KILN_ERR_INVALID_ARGUMENT : KILN_ERR_DEVICE,
                   "kiln_mark_elapsed_ms: %s", !start || !stop ? "NULL mark" : "marks on two devices");
    mark_free(start);
    mark_free(stop);
    return -1;
  }
  double ms;
  if (start->dev_mark) {
    const kiln__backend *b = kiln__backend_get(start->dev.type);
    ms = b->elapsed_ms(start->dev.index, start->dev_mark, stop->dev_mark); /* frees both */
    if (ms < 0) kiln_set_error(KILN_ERR_INTERNAL, "kiln_mark_elapsed_ms: the device could not time the marks");
  } else {
    ms = (stop->host_s - start->host_s) * 1e3;
  }
  free(start);
  free(stop);
  return ms;
}

/* ---- CPU threads ---- */
#ifdef KILN_HAVE_OPENMP
#include <omp.h>
#endif
static atomic_int num_threads; /* 0: not yet read */

int kiln_num_threads(void) {
  int n = atomic_load_explicit(&num_threads, memory_order_relaxed);
  if (n > 0) return n;
  n = kiln__env_num_threads(); /* 0 when unset or invalid (warned once) */
  if (n <= 0) {
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    n = c > 0 ? (int)c : 1;
  }
  if (n > 1024) n = 1024;
  atomic_store(&num_threads, n);
  return n;
}

void kiln_set_num_threads(int n) { atomic_store(&num_threads, n > 0 ? (n > 1024 ? 1024 : n) : 0); }

/* ---- misc ---- */
double kiln__now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

const char *kiln__getenv(const char *name) {
  const char *v = getenv(name);
  return (v && *v) ? v : NULL;
}

/* ---- device details ---- */
kiln_status kiln_device_info_get(kiln_device dev, kiln_device_info *out) {
  if (!out) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_device_info_get: NULL out");
  kiln_status st = check_device(dev, "kiln_device_info_get");
  if (st != KILN_OK) return st;
  memset(out, 0, sizeof *out);
  const kiln__backend *b = kiln__backend_get(dev.type);
  if (b->device_info) return b->device_info(dev.index, out);
  snprintf(out->name, sizeof out->name, "%s device", b->name);
  return KILN_OK;
}

kiln_status kiln_device_bandwidth(kiln_device dev, double *h2d_gbs, double *d2h_gbs) {
  if (dev.type == KILN_DEVICE_CPU)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_device_bandwidth: the CPU has no host link to measure");
  kiln_status st = check_device(dev, "kiln_device_bandwidth");
  if (st != KILN_OK) return st;
  const kiln__backend *b = kiln__backend_get(dev.type);
  if (!b->bandwidth)
    return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln_device_bandwidth: %s cannot measure its host link",
                          kiln__device_cstr(dev));
  double h = 0, d = 0;
  st = b->bandwidth(dev.index, &h, &d);
  if (h2d_gbs) *h2d_gbs = h;
  if (d2h_gbs) *d2h_gbs = d;
  return st;
}
