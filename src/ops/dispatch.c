/*
** Dispatch: run a kernel on the device of its inputs; where that backend lacks it, fall
** back to the CPU under the policy (KILN_FALLBACK=warn|error|silent), and count it.
** Also the device-memory API, which only forwards to the backend.
*/
#include "core/kiln_int.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* ---- policy and statistics ---- */
static pthread_mutex_t fb_lock = PTHREAD_MUTEX_INITIALIZER;
static int policy = -1; /* -1: not yet read from the environment */
static struct {
  int64_t count;
  double seconds;
  bool warned;
  kiln_device_type type;
} fb_stats[KILN__K_COUNT];

static int policy_locked(void) {
  if (policy < 0) {
    policy = kiln__env_fallback_policy(); /* src/core/env.c: a bad value is warned once */
  }
  return policy;
}

void kiln_set_fallback_policy(kiln_fallback_policy p) {
  pthread_mutex_lock(&fb_lock);
  policy = (int)p;
  pthread_mutex_unlock(&fb_lock);
}

kiln_fallback_policy kiln_fallback_policy_get(void) {
  pthread_mutex_lock(&fb_lock);
  int p = policy_locked();
  pthread_mutex_unlock(&fb_lock);
  return (kiln_fallback_policy)p;
}

int kiln_fallback_stats(kiln_fallback_entry *out, int max) {
  int n = 0;
  pthread_mutex_lock(&fb_lock);
  for (int k = 0; k < KILN__K_COUNT; k++) {
    if (fb_stats[k].count == 0) continue;
    if (out && n < max) {
      out[n].op = kiln__kop_name((kiln__kop)k);
      const char *dn = kiln__device_type_name(fb_stats[k].type);
      out[n].device = dn ? dn : "?";
      out[n].count = fb_stats[k].count;
      out[n].seconds = fb_stats[k].seconds;
    }
    n++;
  }
  pthread_mutex_unlock(&fb_lock);
  return n;
}

void kiln_fallback_report(FILE *f) {
  kiln_fallback_entry e[KILN__K_COUNT];
  int n = kiln_fallback_stats(e, KILN__K_COUNT);
  if (n == 0 || !f) return;
  double total = 0;
  fprintf(f, "kiln: ops that fell back to the CPU:\n");
  fprintf(f, "  %-24s %-8s %10s %12s\n", "op", "from", "calls", "time (s)");
  for (int i = 0; i < n; i++) {
    fprintf(f, "  %-24s %-8s %10lld %12.4f\n", e[i].op, e[i].device, (long long)e[i].count, e[i].seconds);
    total += e[i].seconds;
  }
  fprintf(f, "  total time spent in fallback: %.4f s\n", total);
}

void kiln_fallback_reset(void) {
  pthread_mutex_lock(&fb_lock);
  memset(fb_stats, 0, sizeof fb_stats);
  pthread_mutex_unlock(&fb_lock);
}

/* ---- the fallback itself ---- */
typedef struct staged {
  void *host;     /* contiguous CPU copy */
  void *dev_tmp;  /* contiguous device copy (NULL when the view itself is contiguous) */
  size_t nbytes;
} staged;

static kiln__view contiguous_like(const kiln__view *v, void *data) {
  kiln__view c = *v;
  c.data = data;
  int64_t s = 1;
  for (int i = v->ndim - 1; i >= 0; i--) {
    c.strides[i] = s;
    s *= v->shape[i] > 1 ? v->shape[i] : 1;
  }
  return c;
}

/* Device view -> contiguous host buffer. */
static kiln_status stage_in(const kiln__backend *b, int dev, const kiln__view *v, staged *st) {
  st->nbytes = (size_t)kiln__view_numel(v) * kiln_dtype_size(v->dtype);
  st->host = malloc(st->nbytes ? st->nbytes : 1);
  st->dev_tmp = NULL;
  if (!st->host) return kiln_set_error(KILN_ERR_OOM, "kiln: fallback: out of host memory (%zu bytes)", st->nbytes);
  if (st->nbytes == 0) return KILN_OK;
  if (kiln__view_is_contiguous(v)) return b->copy_to_host(dev, st->host, v->data, st->nbytes);
  st->dev_tmp = b->alloc(dev, st->nbytes);
  if (!st->dev_tmp) return KILN_ERR_OOM;
  kiln__kargs c = {0};
  c.op = KILN__K_COPY;
  c.device = dev;
  c.n_in = c.n_out = 1;
  c.in[0] = *v;
  c.out[0] = contiguous_like(v, st->dev_tmp);
  kiln_status s = b->kernels[KILN__K_COPY](&c);
  if (s != KILN_OK) return s;
  return b->copy_to_host(dev, st->host, st->dev_tmp, st->nbytes);
}

/* Contiguous host buffer -> device view. */
static kiln_status stage_out(const kiln__backend *b, int dev, const kiln__view *v, staged *st) {
  if (st->nbytes == 0) return KILN_OK;
  if (!st->dev_tmp) return b->copy_from_host(dev, v->data, st->host, st->nbytes);
  kiln_status s = b->copy_from_host(dev, st->dev_tmp, st->host, st->nbytes);
  if (s != KILN_OK) return s;
  kiln__kargs c = {0};
  c.op = KILN__K_COPY;
  c.device = dev;
  c.n_in = c.n_out = 1;
  c.in[0] = contiguous_like(v, st->dev_tmp);
  c.out[0] = *v;
  return b->kernels[KILN__K_COPY](&c);
}

static kiln_status fallback(kiln_device dev, const kiln__backend *b, kiln__kargs *a) {
  const char *name = kiln__kop_name(a->op);
  pthread_mutex_lock(&fb_lock);
  int pol = policy_locked();
  bool warn = pol == KILN_FALLBACK_WARN && !fb_stats[a->op].warned;
  if (warn) fb_stats[a->op].warned = true;
  pthread_mutex_unlock(&fb_lock);
  kiln_dtype dt = a->n_in > 0 ? a->in[0].dtype : a->out[0].dtype;
  if (pol == KILN_FALLBACK_ERROR)
    return kiln_set_error(KILN_ERR_UNSUPPORTED,
                          "kiln: op '%s' (%s) is not implemented on %s and KILN_FALLBACK=error "
                          "(set KILN_FALLBACK=warn to run it on the CPU)",
                          name, kiln_dtype_name(dt), kiln__device_cstr(dev));
  if (warn)
    fprintf(stderr,
            "kiln: warning: op '%s' (%s) is not implemented on %s; running it on the CPU. "
            "kiln_fallback_report() shows what this costs; KILN_FALLBACK=silent hides this, "
            "KILN_FALLBACK=error makes it an error.\n",
            name, kiln_dtype_name(dt), kiln__device_cstr(dev));
  if (!b->kernels[KILN__K_COPY])
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln: backend %s has no copy kernel", b->name);

  double t0 = kiln__now();
  const kiln__backend *cpu = &kiln__cpu_backend;
  staged in[KILN__MAX_KIN] = {{0}}, out[KILN__MAX_KOUT] = {{0}};
  kiln__kargs c = *a;
  c.device = 0;
  kiln_status st = KILN_OK;
  for (int i = 0; i < a->n_in && st == KILN_OK; i++) {
    st = stage_in(b, dev.index, &a->in[i], &in[i]);
    c.in[i] = contiguous_like(&a->in[i], in[i].host);
  }
  /* Outputs are staged in too: some kernels accumulate into them (or read them, beta). */
  for (int i = 0; i < a->n_out && st == KILN_OK; i++) {
    st = stage_in(b, dev.index, &a->out[i], &out[i]);
    c.out[i] = contiguous_like(&a->out[i], out[i].host);
  }
  if (st == KILN_OK) st = cpu->kernels[a->op] ? cpu->kernels[a->op](&c)
                                              : kiln_set_error(KILN_ERR_INTERNAL, "kiln: no CPU kernel for '%s'", name);
  for (int i = 0; i < a->n_out && st == KILN_OK; i++) st = stage_out(b, dev.index, &a->out[i], &out[i]);
  if (st == KILN_OK && b->synchronize) st = b->synchronize(dev.index); /* temps are freed below */
  for (int i = 0; i < a->n_in; i++) {
    free(in[i].host);
    if (in[i].dev_tmp) b->free(dev.index, in[i].dev_tmp, in[i].nbytes);
  }
  for (int i = 0; i < a->n_out; i++) {
    free(out[i].host);
    if (out[i].dev_tmp) b->free(dev.index, out[i].dev_tmp, out[i].nbytes);
  }
  double dt_s = kiln__now() - t0;
  pthread_mutex_lock(&fb_lock);
  fb_stats[a->op].count++;
  fb_stats[a->op].seconds += dt_s;
  fb_stats[a->op].type = dev.type;
  pthread_mutex_unlock(&fb_lock);
  return st;
}

/* Test hook: pretend the backend of `type` lacks kernel `op` (so the fallback path can be
** tested with a real backend). Indexed by registry slot. */
static unsigned char disabled[KILN__MAX_BACKENDS][KILN__K_COUNT];
static bool any_disabled; /* set once a kernel is disabled: dispatch skips the lookup until then */
void kiln__dispatch_disable_kernel(kiln_device_type type, int op, bool off) {
  int slot = kiln__backend_slot(type);
  if (slot >= 0 && op >= 0 && op < KILN__K_COUNT) disabled[slot][op] = off;
  if (off) any_disabled = true;
}

/* Test hook: an observer told of every kernel call before it runs (the harness's support
** table). Per thread, so that only the thread that set it is watched. */
static _Thread_local kiln__dispatch_observer observer;
static _Thread_local void *observer_ctx;
void kiln__dispatch_observe(kiln__dispatch_observer fn, void *ctx) {
  observer = fn;
  observer_ctx = ctx;
}

static bool is_disabled(kiln_device dev, kiln__kop op) {
  if (!any_disabled) return false;
  int slot = kiln__backend_slot(dev.type);
  return slot >= 0 && disabled[slot][op];
}

static bool runs_here(const kiln__backend *b, kiln_device dev, const kiln__kargs *a) {
  return b->kernels[a->op] && !is_disabled(dev, a->op) && (!b->supports || b->supports(a));
}

bool kiln__dispatch_has(kiln_device dev, const kiln__kargs *a, kiln__kop op) {
  const kiln__backend *b = kiln__backend_get(dev.type);
  if (!b) return false;
  if (a) return a->op == op && runs_here(b, dev, a);
  return b->kernels[op] && !is_disabled(dev, op);
}

/* Per thread, so that counting needs no atomics and a test sees only its own calls. */
static _Thread_local int64_t dispatch_calls;
int64_t kiln__dispatch_count(void) { return dispatch_calls; }

kiln_status kiln__dispatch(kiln_device dev, kiln__kargs *a) {
  dispatch_calls++;
  const kiln__backend *b = kiln__backend_get(dev.type);
  if (!b) return kiln_set_error(KILN_ERR_UNAVAILABLE, "kiln: %s backend is not built", kiln__device_cstr(dev));
  a->device = dev.index;
  bool native = runs_here(b, dev, a);
  if (observer) observer(observer_ctx, dev, a, native);
  if (native) return b->kernels[a->op](a); /* KILN_PROFILE times ops on the call path (profile.c) */
  if (a->list_n > 0) /* the op layer checks kiln__dispatch_has before a list op */
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln: list op '%s' is not supported on %s",
                          kiln__kop_name(a->op), kiln__device_cstr(dev));
  if (b == &kiln__cpu_backend)
    return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln: op '%s' has no CPU kernel for %s",
                          kiln__kop_name(a->op),
                          kiln_dtype_name(a->n_in ? a->in[0].dtype : a->out[0].dtype));
  return fallback(dev, b, a);
}

kiln_status kiln__same_device(const char *op, int n, kiln_tensor *const *ts) {
  kiln_device d = {KILN_DEVICE_CPU, -1};
  int first = -1;
  for (int i = 0; i < n; i++) {
    if (!ts[i]) continue;
    kiln_device di = kiln_device_of(ts[i]);
    if (first < 0) {
      d = di;
      first = i;
    } else if (!kiln_device_equal(d, di)) {
      return kiln_set_error(KILN_ERR_DEVICE,
                            "%s: expected all tensors on one device, but input %d is on %s and "
                            "input %d on %s (move them with kiln_to_device)",
                            op, first, kiln__device_cstr(d), i, kiln__device_cstr(di));
    }
  }
  return KILN_OK;
}

/* ---- device memory ---- */
static const kiln__backend *mem_backend(kiln_device dev, const char *what) {
  if (kiln__check_device(dev, what) != KILN_OK) return NULL;
  return kiln__backend_get(dev.type);
}

kiln_status kiln_memory_stats_get(kiln_device dev, kiln_memory_stats *out) {
  if (!out) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_memory_stats_get: NULL out");
  const kiln__backend *b = mem_backend(dev, "kiln_memory_stats_get");
  if (!b) return kiln_last_error();
  memset(out, 0, sizeof *out);
  return b->memory_stats ? b->memory_stats(dev.index, out) : KILN_OK;
}

kiln_status kiln_memory_empty_cache(kiln_device dev) {
  const kiln__backend *b = mem_backend(dev, "kiln_memory_empty_cache");
  if (!b) return kiln_last_error();
  return b->empty_cache ? b->empty_cache(dev.index) : KILN_OK;
}

kiln_status kiln_memory_set_limit(kiln_device dev, int64_t bytes) {
  if (bytes < 0) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_memory_set_limit: negative limit");
  const kiln__backend *b = mem_backend(dev, "kiln_memory_set_limit");
  if (!b) return kiln_last_error();
  return b->set_memory_limit ? b->set_memory_limit(dev.index, bytes) : KILN_OK;
}

void kiln_memory_reset_peak(kiln_device dev) {
  const kiln__backend *b = mem_backend(dev, "kiln_memory_reset_peak");
  if (b && b->reset_peak) b->reset_peak(dev.index);
}
