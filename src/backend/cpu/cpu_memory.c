/*
** CPU memory: 64-byte aligned blocks (a cache line, and enough for AVX-512 loads), atomic
** statistics, an optional limit, and a failing-allocator mode for OOM tests.
*/
#define _POSIX_C_SOURCE 200112L
#include "cpu.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>

static atomic_llong kiln__cpu_allocated;
static atomic_llong kiln__cpu_peak;
static atomic_llong kiln__cpu_num_allocs;
static atomic_llong kiln__cpu_num_ooms;
static atomic_llong kiln__cpu_limit; /* 0: none */
/* Fault injection: allocations left before failing; -1 off, -2 not read from env yet. */
static atomic_llong kiln__cpu_fail_left = -2;

void kiln__cpu_fail_alloc_after(int64_t n) { atomic_store(&kiln__cpu_fail_left, n < 0 ? -1 : n); }

static bool kiln__cpu_injected_failure(void) {
  long long left = atomic_load(&kiln__cpu_fail_left);
  if (left == -2) {
    const char *e = getenv("KILN_CPU_FAIL_ALLOC_AFTER");
    long long n = (e && *e) ? atoll(e) : -1;
    long long expect = -2;
    atomic_compare_exchange_strong(&kiln__cpu_fail_left, &expect, n < 0 ? -1 : n);
    left = atomic_load(&kiln__cpu_fail_left);
  }
  while (left >= 0) {
    if (left == 0) return true; /* stays failing until reset */
    if (atomic_compare_exchange_weak(&kiln__cpu_fail_left, &left, left - 1)) return false;
  }
  return false;
}

static void *kiln__cpu_oom(size_t nbytes) {
  atomic_fetch_add(&kiln__cpu_num_ooms, 1);
  double mib = 1024.0 * 1024.0;
  long long lim = atomic_load(&kiln__cpu_limit);
  char limbuf[48];
  if (lim > 0)
    snprintf(limbuf, sizeof limbuf, "%.2f MiB", (double)lim / mib);
  else
    snprintf(limbuf, sizeof limbuf, "none");
  kiln_set_error(KILN_ERR_OOM,
                 "kiln: out of memory on cpu: tried to allocate %.2f MiB; allocated %.2f MiB, "
                 "limit %s",
                 (double)nbytes / mib, (double)atomic_load(&kiln__cpu_allocated) / mib, limbuf);
  return NULL;
}

/* Physical memory in bytes (0 when unknown). A request larger than the machine's RAM
** can only end in the kernel's OOM killer on systems that overcommit (malloc "succeeds",
** the first touch kills the process), so it is refused here as KILN_ERR_OOM. */
static size_t physical_memory(void) {
  static size_t phys;
  if (!phys) {
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    phys = (pages > 0 && psz > 0) ? (size_t)pages * (size_t)psz : (size_t)-1;
  }
  return phys;
}

void *kiln__cpu_alloc(int device, size_t nbytes) {
  (void)device;
  if (kiln__cpu_injected_failure()) return kiln__cpu_oom(nbytes);
  if (nbytes > (size_t)INT64_MAX / 2 || nbytes > physical_memory()) return kiln__cpu_oom(nbytes);
  long long n = (long long)nbytes;
  /* reserve the bytes first so concurrent allocations cannot both pass the limit */
  long long now = atomic_fetch_add(&kiln__cpu_allocated, n) + n;
  long long lim = atomic_load(&kiln__cpu_limit);
  if (lim > 0 && now > lim) {
    atomic_fetch_sub(&kiln__cpu_allocated, n);
    return kiln__cpu_oom(nbytes);
  }
  void *p = NULL;
  /* zero-size blocks still get a unique pointer: round every size up to a cache line */
  size_t sz = nbytes == 0 ? 64 : (nbytes + 63) & ~(size_t)63;
  if (posix_memalign(&p, 64, sz) != 0 || !p) {
    atomic_fetch_sub(&kiln__cpu_allocated, n);
    return kiln__cpu_oom(nbytes);
  }
  atomic_fetch_add(&kiln__cpu_num_allocs, 1);
  long long peak = atomic_load(&kiln__cpu_peak);
  while (now > peak && !atomic_compare_exchange_weak(&kiln__cpu_peak, &peak, now)) {
  }
  return p;
}

void kiln__cpu_free(int device, void *ptr, size_t nbytes) {
  (void)device;
  if (!ptr) return;
  free(ptr);
  atomic_fetch_sub(&kiln__cpu_allocated, (long long)nbytes);
}

kiln_status kiln__cpu_memcpy(int device, void *dst, const void *src, size_t nbytes) {
  (void)device;
  if (nbytes && dst != src) memmove(dst, src, nbytes);
  return KILN_OK;
}

kiln_status kiln__cpu_memset_zero(int device, void *ptr, size_t nbytes) {
  (void)device;
  if (nbytes) memset(ptr, 0, nbytes);
  return KILN_OK;
}

kiln_status kiln__cpu_synchronize(int device) {
  (void)device; /* CPU kernels run to completion before they return */
  return KILN_OK;
}

kiln_status kiln__cpu_memory_stats(int device, kiln_memory_stats *out) {
  (void)device;
  if (!out) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_memory_stats: out is NULL");
  out->allocated = atomic_load(&kiln__cpu_allocated);
  out->reserved = out->allocated; /* no cache on the CPU: malloc is the cache */
  out->peak_allocated = atomic_load(&kiln__cpu_peak);
  out->num_allocs = atomic_load(&kiln__cpu_num_allocs);
  out->num_device_allocs = out->num_allocs;
  out->num_ooms = atomic_load(&kiln__cpu_num_ooms);
  out->limit = atomic_load(&kiln__cpu_limit);
  return KILN_OK;
}

kiln_status kiln__cpu_empty_cache(int device) {
  (void)device;
  return KILN_OK;
}

kiln_status kiln__cpu_set_memory_limit(int device, int64_t bytes) {
  (void)device;
  if (bytes < 0)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "kiln_memory_set_limit: limit %lld is negative", (long long)bytes);
  atomic_store(&kiln__cpu_limit, (long long)bytes);
  return KILN_OK;
}

void kiln__cpu_reset_peak(int device) {
  (void)device;
  atomic_store(&kiln__cpu_peak, atomic_load(&kiln__cpu_allocated));
}
