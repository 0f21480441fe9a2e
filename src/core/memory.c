/*
** Memory you can read: the bytes autograd holds in saved tensors (live and peak), the
** modules that saved the most in their last forward, the one-call summary of a device's
** memory, and the breakdown and advice that an out-of-memory error carries.
**
** Saved bytes are counted where a node saves a tensor and where it lets go of one
** (autograd/node.c): the logical bytes of each saved view (numel x element size), so two
** slots over one storage count twice, and a view of a larger block counts its own
** elements only. Saved parameters (leaves that require grad) are not activations and are
** not counted. The module table is fed by the module scope (ops/module_scope.c) when
** a module's forward ends: what autograd holds more than when it began.
*/
#include "kiln_int.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static atomic_llong saved_live, saved_peak;

void kiln__saved_bytes_add(int64_t delta) {
  long long now = atomic_fetch_add_explicit(&saved_live, delta, memory_order_relaxed) + delta;
  long long peak = atomic_load_explicit(&saved_peak, memory_order_relaxed);
  while (now > peak && !atomic_compare_exchange_weak(&saved_peak, &peak, now)) {
  }
}

int64_t kiln__saved_bytes_live(void) { return atomic_load_explicit(&saved_live, memory_order_relaxed); }

void kiln_autograd_saved_bytes(int64_t *live, int64_t *peak) {
  if (live) *live = atomic_load(&saved_live);
  if (peak) *peak = atomic_load(&saved_peak);
}

void kiln_autograd_saved_reset_peak(void) { atomic_store(&saved_peak, atomic_load(&saved_live)); }

/* ---- the modules that saved the most ---- */
#define MAX_SAVERS 8
static pthread_mutex_t savers_lock = PTHREAD_MUTEX_INITIALIZER;
static struct {
  const char *label;
  int64_t bytes;
} savers[MAX_SAVERS];

void kiln__memory_note_saver(const char *label, int64_t bytes) {
  pthread_mutex_lock(&savers_lock);
  int slot = -1, smallest = 0;
  for (int i = 0; i < MAX_SAVERS; i++) {
    if (savers[i].label == label) {
      slot = i;
      break;
    }
    if (savers[i].bytes < savers[smallest].bytes) smallest = i;
  }
  if (slot < 0 && bytes > savers[smallest].bytes) slot = smallest;
  if (slot >= 0) {
    savers[slot].label = label;
    savers[slot].bytes = bytes;
  }
  pthread_mutex_unlock(&savers_lock);
}

int kiln__memory_top_savers(const char **labels, int64_t *bytes, int max) {
  pthread_mutex_lock(&savers_lock);
  int n = 0;
  bool used[MAX_SAVERS] = {false};
  while (n < max) {
    int best = -1;
    for (int i = 0; i < MAX_SAVERS; i++)
      if (!used[i] && savers[i].label && savers[i].bytes > 0 && (best < 0 || savers[i].bytes > savers[best].bytes))
        best = i;
    if (best < 0) break;
    used[best] = true;
    labels[n] = savers[best].label;
    bytes[n] = savers[best].bytes;
    n++;
  }
  pthread_mutex_unlock(&savers_lock);
  return n;
}

static const char *fmt(int64_t b, char *buf, size_t n) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)b;
  int u = 0;
  while ((v >= 1024.0 || v <= -1024.0) && u < 4) v /= 1024.0, u++;
  if (u == 0) snprintf(buf, n, "%" PRId64 " B", b);
  else snprintf(buf, n, "%.2f %s", v, units[u]);
  return buf;
}

/* ---- the summary ---- */
kiln_status kiln_memory_summary(kiln_device dev, FILE *f) {
  if (!f) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_memory_summary: NULL file");
  if (kiln__check_device(dev, "kiln_memory_summary") != KILN_OK) return kiln_last_error();
  const kiln__backend *b = kiln__backend_get(dev.type);
  kiln_memory_stats s;
  memset(&s, 0, sizeof s);
  if (b->memory_stats) {
    kiln_status st = b->memory_stats(dev.index, &s);
    if (st != KILN_OK) return st;
  }
  char a[32], r[32], p[32], c[32], l[32], sv[32], sp[32];
  int64_t live, peak;
  kiln_autograd_saved_bytes(&live, &peak);
  int64_t cached = s.reserved - s.allocated;
  fprintf(f, "kiln memory on %s\n", kiln__device_cstr(dev));
  fprintf(f, "  allocated (live tensors)      %12s   peak %s\n", fmt(s.allocated, a, sizeof a),
          fmt(s.peak_allocated, p, sizeof p));
  fprintf(f, "  reserved from the device      %12s\n", fmt(s.reserved, r, sizeof r));
  /* Fragmentation as the allocator can say it: the share of reserved bytes that hold no
  ** tensor (cached blocks, split remainders). The largest free block is not tracked. */
  fprintf(f, "  cached, not in use            %12s   (%.1f%% of reserved: cache and fragmentation)\n",
          fmt(cached, c, sizeof c), s.reserved > 0 ? 100.0 * (double)cached / (double)s.reserved : 0.0);
  if (s.limit) fprintf(f, "  limit                         %12s\n", fmt(s.limit, l, sizeof l));
  fprintf(f, "  allocations %" PRId64 ", device allocations %" PRId64 ", out-of-memory errors %" PRId64 "\n",
          s.num_allocs, s.num_device_allocs, s.num_ooms);
  fprintf(f, "  saved for backward (all devices) %9s   peak %s\n", fmt(live, sv, sizeof sv), fmt(peak, sp, sizeof sp));
  const char *labels[4];
  int64_t bytes[4];
  int n = kiln__memory_top_savers(labels, bytes, 4);
  for (int i = 0; i < n; i++) fprintf(f, "    saved by %-32s %s (its last forward)\n", labels[i], fmt(bytes[i], a, sizeof a));
  return KILN_OK;
}

/* Appends what the process holds and what to try to the OOM error just set. */
void kiln__oom_annotate(kiln_device dev) {
  if (kiln_last_error() != KILN_ERR_OOM) return;
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", kiln_last_error_message());
  kiln_memory_stats s;
  memset(&s, 0, sizeof s);
  const kiln__backend *b = kiln__backend_get(dev.type);
  /* The allocator's lock is not held here (the error is set after it lets go). */
  if (b && b->memory_stats) b->memory_stats(dev.index, &s);
  int64_t live, peak;
  kiln_autograd_saved_bytes(&live, &peak);
  char a[32], c[32], sv[32], sp[32], extra[1024];
  int k = snprintf(extra, sizeof extra,
                   ". Held: %s in tensors, of which %s saved for backward (peak %s); %s cached by the allocator",
                   fmt(s.allocated, a, sizeof a), fmt(live, sv, sizeof sv), fmt(peak, sp, sizeof sp),
                   fmt(s.reserved - s.allocated, c, sizeof c));
  const char *labels[3];
  int64_t bytes[3];
  int n = kiln__memory_top_savers(labels, bytes, 3);
  k += snprintf(extra + k, sizeof extra - (size_t)k,
                ". To fit: a smaller batch; mixed precision (autocast to bf16/f16 halves most activations)");
  if (n > 0) {
    k += snprintf(extra + k, sizeof extra - (size_t)k, "; checkpointing the modules that save the most (");
    for (int i = 0; i < n && k < (int)sizeof extra; i++)
      k += snprintf(extra + k, sizeof extra - (size_t)k, "%s%s: %s", i ? ", " : "", labels[i], fmt(bytes[i], a, sizeof a));
    if (k < (int)sizeof extra) k += snprintf(extra + k, sizeof extra - (size_t)k, ")");
  } else {
    k += snprintf(extra + k, sizeof extra - (size_t)k, "; activation checkpointing");
  }
  if (k < (int)sizeof extra)
    snprintf(extra + k, sizeof extra - (size_t)k, "; kiln_memory_empty_cache() returns cached blocks to the device");
  kiln_set_error(KILN_ERR_OOM, "%s%s", msg, extra);
}
