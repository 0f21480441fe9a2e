/*
** Which sgemm the CPU backend calls, and what the doctor says about it.
**
** OpenBLAS built for many CPUs (DYNAMIC_ARCH, as Debian's) picks its kernels at load time
** from the CPU's family and model. A model it does not know -- a newer CPU, or a virtual
** machine that reports a generic one -- gets its "Prescott" kernels (SSE3): on an AVX-512
** Xeon VM f32 products then run at 27 GFLOP/s where OpenBLAS's SkylakeX kernels (forced by
** OPENBLAS_CORETYPE) run 150-230 and oneDNN's sgemm 80-185 (bench/RESULTS.md). OpenBLAS
** reads OPENBLAS_CORETYPE in its load-time constructor, before kiln runs, so kiln cannot
** repair the choice in-process. Where OpenBLAS's kernels are one of the pre-AVX2 ones on a
** CPU with AVX2 and FMA, kiln's f32 products go to oneDNN's sgemm instead, which picks its
** kernels from the CPU's features (when kiln is built with oneDNN); kiln doctor says so.
** KILN_CPU_SGEMM=blas or =dnnl forces either (tests, A/B).
*/
#include "cpu.h"
#include "cpu_iter.h"
#include "../../core/kiln_int.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>

#ifdef KILN_HAVE_CBLAS
#include <cblas.h>
#endif
#ifdef KILN_HAVE_DNNL
#include <dnnl.h>
#endif
#ifdef KILN_HAVE_OPENMP
#include <omp.h>
#endif

/* OpenBLAS's kernel sets without AVX2 (its names, openblas_get_corename) */
static const char *const kiln__blas_old_cores[] = {
    "prescott",  "core2",   "penryn",   "dunnington", "nehalem",  "atom",      "katmai",    "coppermine",
    "northwood", "banias",  "opteron",  "opteron_sse3", "barcelona", "nano",   "bobcat",    "athlon",
    "sandybridge", "bulldozer", "piledriver", "steamroller", "unknown"};

static int kiln__sgemm_choice; /* 0 the BLAS, 1 oneDNN: decided once (kiln__sgemm_once) */
static char kiln__blas_line[256];
static const char *kiln__blas_fix; /* OPENBLAS_CORETYPE's value where OpenBLAS's pick is generic */
static pthread_once_t kiln__sgemm_once = PTHREAD_ONCE_INIT;

static const char *kiln__blas_core(void) {
#if defined(KILN_HAVE_CBLAS) && defined(OPENBLAS_VERSION)
  const char *c = openblas_get_corename();
  return c ? c : "unknown";
#else
  return NULL;
#endif
}

static bool kiln__blas_core_is_old(const char *core) {
  for (size_t i = 0; core && i < sizeof kiln__blas_old_cores / sizeof kiln__blas_old_cores[0]; i++)
    if (strcasecmp(core, kiln__blas_old_cores[i]) == 0) return true;
  return false;
}

static void kiln__sgemm_decide(void) {
  const char *core = kiln__blas_core();
  bool old = core && kiln__blas_core_is_old(core) && kiln__cpu_avx2_fma();
  const int env = kiln__knob_choice("KILN_CPU_SGEMM", -1); /* blas, dnnl; -1 unset */
  int choice = 0;
#ifdef KILN_HAVE_DNNL
  choice = env >= 0 ? env == 1 : old;
#else
  (void)env;
#endif
  bool avx512 = false;
#if defined(__x86_64__) || defined(__i386__)
  avx512 = __builtin_cpu_supports("avx512f");
#endif
  const char *cpu = avx512 ? "AVX-512" : "AVX2", *fix = avx512 ? "SkylakeX" : "Haswell";
  kiln__blas_fix = old ? fix : NULL;
  if (!core)
    snprintf(kiln__blas_line, sizeof kiln__blas_line, "%s", choice ? "f32 products on oneDNN's sgemm" : "");
  else if (old && choice)
    snprintf(kiln__blas_line, sizeof kiln__blas_line,
             "%s: generic on this %s CPU, so f32 products go to oneDNN's sgemm "
             "(OPENBLAS_CORETYPE=%s gives OpenBLAS its own)",
             core, cpu, fix);
  else if (old)
    snprintf(kiln__blas_line, sizeof kiln__blas_line,
             "%s: generic on this %s CPU (f32 products several times slower than they could be: "
             "set OPENBLAS_CORETYPE=%s)",
             core, cpu, fix);
  else
    snprintf(kiln__blas_line, sizeof kiln__blas_line, "%s%s", core,
             choice ? "; f32 products on oneDNN's sgemm (KILN_CPU_SGEMM)" : "");
  kiln__sgemm_choice = choice;
}

#ifdef KILN_HAVE_DNNL
static int kiln__sgemm_dnnl(void) {
  pthread_once(&kiln__sgemm_once, kiln__sgemm_decide);
  return kiln__sgemm_choice;
}
#endif

const char *kiln_blas_info(void) {
  pthread_once(&kiln__sgemm_once, kiln__sgemm_decide);
  return kiln__blas_line;
}

const char *kiln_blas_coretype_fix(void) {
  pthread_once(&kiln__sgemm_once, kiln__sgemm_decide);
  return kiln__blas_fix;
}

#ifdef KILN_HAVE_CBLAS
void kiln__sgemm(int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda, const float *B, int ldb,
                 float beta, float *C, int ldc, int threads) {
#ifdef KILN_HAVE_DNNL
  if (kiln__sgemm_dnnl()) {
#ifdef KILN_HAVE_OPENMP
    /* oneDNN runs on OpenMP's count for the calling thread: the count kiln gave the BLAS
    ** (one inside kiln's pool or an OpenMP region) */
    int was = omp_get_max_threads(), nt = omp_in_parallel() || kiln__cpu_pool_inside() ? 1 : threads;
    if (nt < 1) nt = 1;
    if (nt != was) omp_set_num_threads(nt);
    /* oneDNN's OpenMP workers spin between calls: kiln's loops join that team from now on
    ** rather than fight it with the pool's threads (cpu_iter.c) */
    if (nt > 1) atomic_store_explicit(&kiln__cpu_omp_loops, 1, memory_order_relaxed);
#endif
    dnnl_status_t s = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
#ifdef KILN_HAVE_OPENMP
    if (nt != was) omp_set_num_threads(was);
#endif
    if (s == dnnl_success) return; /* else (arguments oneDNN refuses) the BLAS */
  }
#endif
  (void)threads;
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K, alpha, A, lda,
              B, ldb, beta, C, ldc);
}
#endif
