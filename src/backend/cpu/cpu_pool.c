/*
** kiln's own thread pool for kiln__cpu_parallel_for (issue 17, "a busy machine").
**
** OpenMP's workers (libgomp) spin for a long time after each parallel region before they
** sleep (GOMP_SPINCOUNT, 300000 rounds by default) and the wait policy can only be set
** by an environment variable read before main. With another process busy on the cores,
** those spinning workers take the CPU from the very thread the region waits for:
** fashion-mnist fell from 196k to 15k images/s beside valgrind. This pool's workers and
** its caller spin only briefly (KILN__POOL_SPIN_NS), then sleep on a condition variable,
** so a loaded machine costs kiln its share of the cores and no more.
**
** The work is split exactly as the OpenMP region split it (share t of tn is
** [n*t/tn, n*(t+1)/tn)), so results do not change. One caller at a time: a second thread
** (a data-loader worker) that finds the pool busy runs its loop on its own, as does a
** loop started from inside a pool worker. After fork() the child starts without workers.
*/
#define _POSIX_C_SOURCE 200809L
#include "cpu_iter.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <time.h>

#define KILN__POOL_MAX 1023       /* workers; kiln_num_threads() is at most 1024 */
#define KILN__POOL_SPIN_NS 30000  /* how long a waiting thread spins before it sleeps */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv_work = PTHREAD_COND_INITIALIZER, cv_done = PTHREAD_COND_INITIALIZER;
static atomic_uint gen;            /* bumped for each job */
static atomic_int pending;         /* workers still running the current job */
static atomic_int sleepers;        /* workers asleep on cv_work */
static atomic_int caller_sleeping; /* the caller asleep on cv_done */
static atomic_flag busy = ATOMIC_FLAG_INIT;
static int nworkers;               /* guarded by busy (only the caller starts workers) */
static struct {
  kiln__cpu_range_fn fn;
  void *ctx;
  int64_t n;
  int tn;
} job;
static _Thread_local bool in_pool; /* this thread is a pool worker, or the caller in a job */

bool kiln__cpu_pool_inside(void) { return in_pool; }

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void run_share(int t) {
  int64_t lo = job.n * t / job.tn, hi = job.n * (t + 1) / job.tn;
  if (lo < hi) job.fn(job.ctx, lo, hi);
}

static unsigned first_seen[KILN__POOL_MAX]; /* gen when worker i was started */

static void *worker(void *arg) {
  const int id = (int)(intptr_t)arg; /* runs share id + 1 */
  in_pool = true;
  unsigned seen = first_seen[id]; /* not gen now: the first job may be posted already */
  for (;;) {
    /* wait for a new job: spin a little, then sleep */
    int64_t t0 = 0;
    for (int i = 0; atomic_load_explicit(&gen, memory_order_acquire) == seen; i++) {
      if ((i & 63) == 63) {
        int64_t t = now_ns();
        if (!t0) t0 = t;
        else if (t - t0 > KILN__POOL_SPIN_NS) {
          pthread_mutex_lock(&mu);
          atomic_fetch_add(&sleepers, 1);
          while (atomic_load(&gen) == seen) pthread_cond_wait(&cv_work, &mu);
          atomic_fetch_sub(&sleepers, 1);
          pthread_mutex_unlock(&mu);
          break;
        }
      }
      cpu_relax();
    }
    /* Every worker answers every job (those past tn with nothing to do), so the caller
    ** never writes the next job while one of them could still be reading this one. */
    seen = atomic_load_explicit(&gen, memory_order_acquire);
    if (id + 1 < job.tn) run_share(id + 1);
    if (atomic_fetch_sub(&pending, 1) == 1 && atomic_load(&caller_sleeping)) {
      pthread_mutex_lock(&mu);
      pthread_cond_signal(&cv_done);
      pthread_mutex_unlock(&mu);
    }
  }
  return NULL;
}

static void after_fork_child(void) {
  /* the workers did not survive the fork: start again without them */
  pthread_mutex_init(&mu, NULL);
  pthread_cond_init(&cv_work, NULL);
  pthread_cond_init(&cv_done, NULL);
  nworkers = 0;
  atomic_store(&sleepers, 0);
  atomic_store(&pending, 0);
  atomic_store(&caller_sleeping, 0);
  atomic_flag_clear(&busy);
}

static pthread_once_t once = PTHREAD_ONCE_INIT;
static void init_once(void) { pthread_atfork(NULL, NULL, after_fork_child); }

/* Starts workers until there are `want`; returns how many there are. */
static int grow(int want) {
  if (want > KILN__POOL_MAX) want = KILN__POOL_MAX;
  while (nworkers < want) {
    pthread_t th;
    pthread_attr_t at;
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    first_seen[nworkers] = atomic_load(&gen);
    int rc = pthread_create(&th, &at, worker, (void *)(intptr_t)nworkers);
    pthread_attr_destroy(&at);
    if (rc != 0) break;
    nworkers++;
  }
  return nworkers;
}

bool kiln__cpu_pool_run(int64_t n, int tn, kiln__cpu_range_fn fn, void *ctx) {
  if (tn <= 1 || in_pool) return false;
  pthread_once(&once, init_once);
  if (atomic_flag_test_and_set(&busy)) return false; /* another thread has the pool */
  if (grow(tn - 1) < tn - 1) {
    atomic_flag_clear(&busy);
    return false;
  }
  job.fn = fn;
  job.ctx = ctx;
  job.n = n;
  job.tn = tn;
  atomic_store(&pending, nworkers);
  atomic_fetch_add_explicit(&gen, 1, memory_order_seq_cst); /* publishes job */
  if (atomic_load(&sleepers) > 0) {
    pthread_mutex_lock(&mu);
    pthread_cond_broadcast(&cv_work);
    pthread_mutex_unlock(&mu);
  }
  in_pool = true; /* a loop inside share 0 runs serially */
  run_share(0);
  in_pool = false;
  int64_t t0 = 0;
  for (int i = 0; atomic_load_explicit(&pending, memory_order_acquire) > 0; i++) {
    if ((i & 63) == 63) {
      int64_t t = now_ns();
      if (!t0) t0 = t;
      else if (t - t0 > KILN__POOL_SPIN_NS) {
        pthread_mutex_lock(&mu);
        atomic_store(&caller_sleeping, 1);
        while (atomic_load(&pending) > 0) pthread_cond_wait(&cv_done, &mu);
        atomic_store(&caller_sleeping, 0);
        pthread_mutex_unlock(&mu);
        break;
      }
    }
    cpu_relax();
  }
  atomic_flag_clear(&busy);
  return true;
}
