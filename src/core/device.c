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
  if (dev.type == KILN_DEVICE_CPU)
    snprintf(buf, n, "cpu");
  else if (dev.type == KILN_DEVICE_CUDA)
    snprintf(buf, n, "cuda:%d", dev.index);
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

/* ---- availability, probed once per backend ---- */
static pthread_once_t probe_once[2] = {PTHREAD_ONCE_INIT, PTHREAD_ONCE_INIT};
static bool probe_ok[2];
static const char *probe_why[2];

static void probe_type(int t) {
  const kiln__backend *b = kiln__backend_get((kiln_device_type)t);
  if (!b) {
    probe_ok[t] = false;
    probe_why[t] = t == KILN_DEVICE_CUDA ? "kiln was built without CUDA (configure with KILN_CUDA=ON "
                                           "on a machine with the CUDA toolkit)"
                                         : "backend not built";
    return;
  }
  const char *why = NULL;
  kiln_status st = b->probe ? b->probe(&why) : KILN_OK;
  probe_ok[t] = st == KILN_OK;
  probe_why[t] = probe_ok[t] ? NULL : (why ? why : "the backend's probe failed");
}
static void probe_cpu(void) { probe_type(KILN_DEVICE_CPU); }
static void probe_cuda(void) { probe_type(KILN_DEVICE_CUDA); }

bool kiln_backend_built(kiln_device_type type) { return kiln__backend_get(type) != NULL; }

bool kiln_backend_available(kiln_device_type type, const char **why) {
  if (type != KILN_DEVICE_CPU && type != KILN_DEVICE_CUDA) {
    if (why) *why = "unknown device type";
    return false;
  }
  pthread_once(&probe_once[type], type == KILN_DEVICE_CPU ? probe_cpu : probe_cuda);
  if (why) *why = probe_why[type];
  return probe_ok[type];
}

int kiln_device_count(kiln_device_type type) {
  if (!kiln_backend_available(type, NULL)) return 0;
  const kiln__backend *b = kiln__backend_get(type);
  return b->device_count ? b->device_count() : 1;
}

static kiln_status check_device(kiln_device d, const char *what) {
  if (d.type == KILN_DEVICE_CPU) return KILN_OK;
  if (d.type != KILN_DEVICE_CUDA)
    return kiln_set_error(KILN_ERR_DEVICE, "%s: unknown device type %d", what, (int)d.type);
  const char *why = NULL;
  if (!kiln_backend_available(KILN_DEVICE_CUDA, &why))
    return kiln_set_error(KILN_ERR_UNAVAILABLE, "%s: cuda is not available: %s", what,
                          why ? why : "unknown reason");
  int n = kiln_device_count(KILN_DEVICE_CUDA);
  if (d.index < 0 || d.index >= n)
    return kiln_set_error(KILN_ERR_DEVICE, "%s: no device cuda:%d (%d CUDA device%s visible)",
                          what, d.index, n, n == 1 ? "" : "s");
  return KILN_OK;
}

kiln_status kiln__check_device(kiln_device d, const char *what) { return check_device(d, what); }

kiln_status kiln_device_parse(const char *s, kiln_device *out) {
  if (!s || !out) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_device_parse: NULL argument");
  kiln_device d;
  if (strcmp(s, "cpu") == 0) {
    d = kiln_device_cpu();
  } else if (strcmp(s, "cuda") == 0) {
    d = kiln_device_cuda(0);
  } else if (strncmp(s, "cuda:", 5) == 0 && s[5] >= '0' && s[5] <= '9') {
    char *end = NULL;
    long idx = strtol(s + 5, &end, 10);
    if (*end != 0 || idx > 1024)
      return kiln_set_error(KILN_ERR_DEVICE, "kiln_device_parse: '%s' is not a device (use cpu, cuda or cuda:N)", s);
    d = kiln_device_cuda((int)idx);
  } else {
    return kiln_set_error(KILN_ERR_DEVICE, "kiln_device_parse: '%s' is not a device (use cpu, cuda or cuda:N)", s);
  }
  kiln_status st = check_device(d, "kiln_device_parse");
  if (st == KILN_ERR_UNAVAILABLE) {
    const char *why = NULL;
    kiln_backend_available(KILN_DEVICE_CUDA, &why);
    return kiln_set_error(KILN_ERR_DEVICE, "kiln_device_parse: no device %s: cuda is not available (%s)", s,
                          why ? why : "unknown reason");
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
  if (kiln_device_count(KILN_DEVICE_CUDA) > 0) return kiln_device_cuda(0);
  return kiln_device_cpu();
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
#ifdef KILN_HAVE_CUDA
#include "../backend/cuda/cuda_api.h"
#endif

static void cpu_model(char *buf, size_t n) {
  snprintf(buf, n, "unknown CPU");
  FILE *f = fopen("/proc/cpuinfo", "r");
  if (!f) return;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "model name", 10) == 0) {
      char *c = strchr(line, ':');
      if (c) {
        c++;
        while (*c == ' ') c++;
        c[strcspn(c, "\n")] = 0;
        snprintf(buf, n, "%s", c);
      }
      break;
    }
  }
  fclose(f);
}

kiln_status kiln_device_info_get(kiln_device dev, kiln_device_info *out) {
  if (!out) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_device_info_get: NULL out");
  kiln_status st = check_device(dev, "kiln_device_info_get");
  if (st != KILN_OK) return st;
  memset(out, 0, sizeof *out);
  if (dev.type == KILN_DEVICE_CPU) {
    cpu_model(out->name, sizeof out->name);
    long c = sysconf(_SC_NPROCESSORS_ONLN);
    out->multiprocessors = c > 0 ? (int)c : 1;
    long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (pages > 0 && psz > 0) out->total_memory = (int64_t)pages * psz;
    if (avail > 0 && psz > 0) out->free_memory = (int64_t)avail * psz;
    return KILN_OK;
  }
#ifdef KILN_HAVE_CUDA
  kiln__cuda_info ci;
  st = kiln__cuda_device_info(dev.index, &ci);
  if (st != KILN_OK) return st;
  snprintf(out->name, sizeof out->name, "%s", ci.name);
  out->compute_major = ci.major;
  out->compute_minor = ci.minor;
  out->multiprocessors = ci.multiprocessors;
  out->total_memory = ci.total_mem;
  out->free_memory = ci.free_mem;
  out->driver_version = ci.driver_version;
  out->runtime_version = ci.runtime_version;
  out->blas_version = ci.cublas_version;
  return KILN_OK;
#else
  return kiln_set_error(KILN_ERR_UNAVAILABLE, "kiln_device_info_get: built without CUDA");
#endif
}

kiln_status kiln_device_bandwidth(kiln_device dev, double *h2d_gbs, double *d2h_gbs) {
  if (dev.type == KILN_DEVICE_CPU)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_device_bandwidth: the CPU has no host link to measure");
  kiln_status st = check_device(dev, "kiln_device_bandwidth");
  if (st != KILN_OK) return st;
#ifdef KILN_HAVE_CUDA
  double h = 0, d = 0;
  st = kiln__cuda_bandwidth(dev.index, &h, &d);
  if (h2d_gbs) *h2d_gbs = h;
  if (d2h_gbs) *d2h_gbs = d;
  return st;
#else
  KILN__UNUSED(h2d_gbs);
  KILN__UNUSED(d2h_gbs);
  return kiln_set_error(KILN_ERR_UNAVAILABLE, "kiln_device_bandwidth: built without CUDA");
#endif
}
