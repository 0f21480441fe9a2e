/*
** CPU memory: 64-byte aligned blocks (a cache line, and enough for AVX-512 loads), atomic
** statistics, an optional limit, and a failing-allocator mode for OOM tests.
**
** Freed blocks up to 128 MiB are kept in a small cache keyed by their exact size (256
** blocks, 1 GiB at most): a training loop allocates the same sizes every step, and
** without the cache glibc handed the top of the heap back to the kernel after each step,
** so the next one paid a page fault per fresh page (10% of a small MLP's time). A CNN's
** activations and im2col buffers are tens of MB: with a 16 MiB bound a fifth of a step
** went to the kernel zeroing their fresh pages.
** kiln_memory_empty_cache(cpu) releases it; "reserved" counts it.
*/
#define _DEFAULT_SOURCE /* madvise, MADV_HUGEPAGE */
#include "cpu.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

static atomic_llong kiln__cpu_allocated;
static atomic_llong kiln__cpu_peak;
static atomic_llong kiln__cpu_num_allocs;
static atomic_llong kiln__cpu_num_ooms;
static atomic_llong kiln__cpu_limit; /* 0: none */
static atomic_llong kiln__cpu_num_sys_allocs; /* posix_memalign calls */

enum { CACHE_SLOTS = 256 };
#define CACHE_MAX_BLOCK ((size_t)128 << 20)
#define CACHE_MAX_BYTES ((size_t)1 << 30)
static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
  void *p;
  size_t sz;
} cache[CACHE_SLOTS];
static int cache_n;
static atomic_llong cache_bytes;

static size_t block_size(size_t nbytes) { return nbytes == 0 ? 64 : (nbytes + 63) & ~(size_t)63; }

/* Blocks from 4 MiB start on a 2 MiB boundary and ask Linux for transparent huge pages
** (where THP is "madvise", the common default, nothing else gets them). A data set read
** at random rows (the loader's batch gather: 128 rows out of 188 MB) otherwise pays a
** page walk to DRAM for nearly every row, the page tables of 188 MB being 376 KB. The
** hint costs no memory: the head skipped for alignment is never touched. */
#define HUGE_MIN ((size_t)4 << 20)
#define HUGE_ALIGN ((size_t)2 << 20)
static void *sys_alloc(size_t sz) {
  void *p = NULL;
  if (sz >= HUGE_MIN) {
    if (posix_memalign(&p, HUGE_ALIGN, sz) != 0) return NULL;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    (void)madvise(p, sz, MADV_HUGEPAGE); /* a hint: an error (no THP) changes nothing */
#endif
    return p;
  }
  return posix_memalign(&p, 64, sz) == 0 ? p : NULL;
}

static void *cache_take(size_t sz) {
  void *p = NULL;
  pthread_mutex_lock(&cache_mu);
  for (int i = cache_n - 1; i >= 0; i--) {
    if (cache[i].sz == sz) {
      p = cache[i].p;
      cache[i] = cache[--cache_n];
      atomic_fetch_sub(&cache_bytes, (long long)sz);
      break;
    }
  }
  pthread_mutex_unlock(&cache_mu);
  return p;
}

static bool cache_put(void *p, size_t sz) {
  if (sz > CACHE_MAX_BLOCK) return false;
  bool kept = false;
  pthread_mutex_lock(&cache_mu);
  if (cache_n < CACHE_SLOTS && (size_t)atomic_load(&cache_bytes) + sz <= CACHE_MAX_BYTES) {
    cache[cache_n].p = p;
    cache[cache_n].sz = sz;
    cache_n++;
    atomic_fetch_add(&cache_bytes, (long long)sz);
    kept = true;
  }
  pthread_mutex_unlock(&cache_mu);
  return kept;
}
/* Fault injection: allocations left before failing; -1 off, -2 not read from env yet. */
static atomic_llong kiln__cpu_fail_left = -2;

void kiln__cpu_fail_alloc_after(int64_t n) { atomic_store(&kiln__cpu_fail_left, n < 0 ? -1 : n); }

static bool kiln__cpu_injected_failure(void) {
  long long left = atomic_load(&kiln__cpu_fail_left);
  if (left == -2) {
    long long n = kiln__knob_int("KILN_CPU_FAIL_ALLOC_AFTER", -1);
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
  /* zero-size blocks still get a unique pointer: round every size up to a cache line */
  size_t sz = block_size(nbytes);
  void *p = cache_take(sz);
  if (!p) {
    if (!(p = sys_alloc(sz))) {
      atomic_fetch_sub(&kiln__cpu_allocated, n);
      return kiln__cpu_oom(nbytes);
    }
    atomic_fetch_add(&kiln__cpu_num_sys_allocs, 1);
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
  if (!cache_put(ptr, block_size(nbytes))) free(ptr);
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
  out->reserved = out->allocated + atomic_load(&cache_bytes);
  out->peak_allocated = atomic_load(&kiln__cpu_peak);
  out->num_allocs = atomic_load(&kiln__cpu_num_allocs);
  out->num_device_allocs = atomic_load(&kiln__cpu_num_sys_allocs);
  out->num_ooms = atomic_load(&kiln__cpu_num_ooms);
  out->limit = atomic_load(&kiln__cpu_limit);
  return KILN_OK;
}

kiln_status kiln__cpu_empty_cache(int device) {
  (void)device;
  pthread_mutex_lock(&cache_mu);
  for (int i = 0; i < cache_n; i++) free(cache[i].p);
  cache_n = 0;
  atomic_store(&cache_bytes, 0);
  pthread_mutex_unlock(&cache_mu);
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
