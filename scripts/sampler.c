/*
** A host-side sampling profiler for machines without perf (the lent GPU machines have
** none): LD_PRELOAD it into any program, and every KILN_SAMPLER_US microseconds of wall
** time (default 100) the signal handler stores the main thread's call stack (so time
** spent waiting for the device shows too). At exit it writes one
** line per frame, "sample depth module offset", to $KILN_SAMPLER_OUT (default
** sampler.out); scripts/sampler_report.py symbolizes them with addr2line and prints self
** and inclusive time per function.
**
**   cc -O2 -shared -fPIC scripts/sampler.c -o sampler.so -ldl -lrt
**   KILN_SAMPLER_OUT=s.out LD_PRELOAD=./sampler.so build/bin/seed-mlp --device cuda
**   python3 scripts/sampler_report.py s.out
*/
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_SAMPLES 200000
#define DEPTH 24

static void *g_frames[MAX_SAMPLES][DEPTH];
static unsigned char g_depth[MAX_SAMPLES];
static volatile int g_n;
static timer_t g_timer;

static void on_prof(int sig, siginfo_t *si, void *uc) {
  (void)sig, (void)si, (void)uc;
  int k = g_n;
  if (k >= MAX_SAMPLES) return;
  g_n = k + 1;
  g_depth[k] = (unsigned char)backtrace(g_frames[k], DEPTH);
}

__attribute__((constructor)) static void sampler_start(void) {
  void *warm[2];
  backtrace(warm, 2); /* loads the unwinder now, not inside the handler */
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_prof;
  sa.sa_flags = SA_RESTART | SA_SIGINFO;
  sigaction(SIGPROF, &sa, NULL);
  const char *e = getenv("KILN_SAMPLER_US");
  long us = e ? atol(e) : 100;
  if (us < 20) us = 20;
  struct sigevent sev;
  memset(&sev, 0, sizeof sev);
  sev.sigev_notify = SIGEV_THREAD_ID; /* the main thread, on a high-resolution clock */
  sev.sigev_signo = SIGPROF;
  sev._sigev_un._tid = (pid_t)syscall(SYS_gettid);
  if (timer_create(CLOCK_MONOTONIC, &sev, &g_timer) != 0) {
    perror("sampler: timer_create");
    return;
  }
  struct itimerspec it = {{0, us * 1000}, {0, us * 1000}};
  timer_settime(g_timer, 0, &it, NULL);
}

__attribute__((destructor)) static void sampler_stop(void) {
  timer_delete(g_timer);
  const char *path = getenv("KILN_SAMPLER_OUT");
  FILE *f = fopen(path ? path : "sampler.out", "w");
  if (!f) return;
  int n = g_n;
  for (int k = 0; k < n; k++)
    for (int d = 2; d < g_depth[k]; d++) { /* 0: the handler, 1: the signal frame */
      Dl_info di;
      if (dladdr(g_frames[k][d], &di) && di.dli_fname)
        fprintf(f, "%d %d %s %#lx\n", k, d - 2, di.dli_fname,
                (unsigned long)((char *)g_frames[k][d] - (char *)di.dli_fbase) - (d > 2 ? 1 : 0));
      else
        fprintf(f, "%d %d ? %p\n", k, d - 2, g_frames[k][d]);
    }
  fclose(f);
  fprintf(stderr, "sampler: %d samples written\n", n);
}
