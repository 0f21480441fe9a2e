/*
** The CPU backend's iteration engine: dtype conversion of strided runs, a walker that
** visits coalesced views run by run (a run is a stretch along the innermost dim), a
** parallel-for that only starts OpenMP when the work is large, and the elementwise "map"
** built on them (gather a chunk into the compute type, compute, scatter).
*/
#ifndef KILN_CPU_ITER_H
#define KILN_CPU_ITER_H

#include "../backend.h"
#include "../../core/knobs.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* Below this many elements an op runs on one thread. Threads cost more than the fork:
** after each parallel region libgomp's workers spin (by default ~300k pause loops,
** milliseconds) on the cores the caller wants. Beside OpenBLAS's own pthread pool (or a
** busy machine) that was ruinous: a training step that opened a region per op measured 10x
** slower on 2 cores than one that opened none, hence high thresholds there: memory-bound
** ops (add, copy, compare, sums) KILN__CPU_PAR_MIN_CHEAP elements, ops of tens of
** instructions per element (exp, tanh, erf, the RNG) KILN__CPU_PAR_MIN.
** When kiln's OpenMP pool is the only one (OpenBLAS's OpenMP build, or no BLAS) the
** workers are kiln's own and already spinning between regions, a fork/join costs 1-3 us,
** and a region pays from ~10 us of work: 128 KiB of a cheap op (the (128, 256)
** activations of an MLP step: relu 12.6 -> 9 us, its backward 13 -> 8.5 us), 8k elements
** of an expensive one. That took fashion-mnist from 176k to 184k images/s on 2 cores. */
#if defined(KILN_BLAS_OPENMP) || !defined(KILN_HAVE_CBLAS)
#define KILN__CPU_PAR_MIN 8192
#define KILN__CPU_PAR_MIN_CHEAP 32768
#else
#define KILN__CPU_PAR_MIN 131072
#define KILN__CPU_PAR_MIN_CHEAP 1048576
#endif
/* Work of one row in a row kernel (softmax, cross-entropy) beyond its elements, in
** element-equivalents: a log, the row's setup and its scalar stores. */
#define KILN__CPU_ROW_COST 64
/* KILN__CPU_CLONES before a hot loop's function: GCC compiles it twice, for AVX2 and for the
** build's baseline (SSE2 on x86-64), and picks one when the library loads (an ifunc). Only
** "avx2", not "fma" or "arch=...": without FMA contraction both copies round every
** operation the same way, so results do not depend on the machine. Only where the build
** has ifuncs (GCC on x86-64 glibc Linux); elsewhere the plain function. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && \
    defined(__GLIBC__) && !defined(KILN_NO_TARGET_CLONES)
#define KILN__CPU_CLONES __attribute__((target_clones("avx2", "default")))
#define KILN__CPU_CLONES512 __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KILN__CPU_CLONES
#define KILN__CPU_CLONES512
#endif
/* KILN__CPU_CLONES512 adds an AVX-512 copy, for the row loops of softmax, layer norm, GELU
** and attention (16 lanes pay there). AVX-512F brings FMA instructions, so the build turns
** contraction off (-ffp-contract=off, CMakeLists.txt): a*b+c is still two roundings in
** every copy, and results stay the same on every x86-64 machine. */

/* KILN__CPU_FMA before a loop that computes fused multiply-adds (fmaf/fma, one rounding):
** on x86-64 with GCC or Clang it is compiled for AVX2+FMA, where fmaf is one instruction
** and the loop vectorises; kiln__cpu_has_fma() says whether this CPU may run it. The
** caller keeps a plain copy of the same loop for the others, where fmaf is libm's
** (correctly rounded, slow), so both give the same bits and results still do not depend
** on the machine. Used where kiln follows PyTorch's CPU kernels, which are built for
** AVX2 with FMA contraction: `a + alpha * b` is one FMA there (torch.add(alpha=),
** addcmul, torch.optim's updates). */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(KILN_NO_TARGET_CLONES)
#define KILN__CPU_FMA __attribute__((target("avx2,fma")))
#else
#define KILN__CPU_FMA
#endif
bool kiln__cpu_has_fma(void); /* true where KILN__CPU_FMA code may run */
bool kiln__cpu_avx2_fma(void); /* this CPU has AVX2 and FMA, whatever the build (false off x86) */
/* KILN_CONV_C1_PORTABLE=1: the one-channel conv's and the 2x2 ReLU+max-pool's intrinsic
** loops (AVX-512, AVX2) give way to their portable twins, which the tests compare them with
** bit for bit. Read at each call (the tests switch it): call it once per kernel call. */
bool kiln__cpu_portable_loops(void);

/* Elements per chunk gathered into the compute type (fits L1 with five views). */
#define KILN__CPU_BLK 256
#define KILN__CPU_MAXV 5

/* Compute types: F32, F64, I64, or BOOL (uint8_t 0/1). */
kiln_dtype kiln__cpu_ct(kiln_dtype dt); /* f64 -> f64, other floats -> f32, ints -> i64 */
bool kiln__cpu_is_float(kiln_dtype dt);
size_t kiln__cpu_esize(kiln_dtype dt);

/* Converts n elements of dtype dt at src (byte stride bst) into dst of compute type ct
** (contiguous), and back. */
void kiln__cpu_load(void *dst, kiln_dtype ct, const char *src, int64_t bst, kiln_dtype dt,
                    int64_t n);
void kiln__cpu_store(char *dst, int64_t bst, kiln_dtype dt, const void *src, kiln_dtype ct,
                     int64_t n);
double kiln__cpu_get_f64(const char *p, kiln_dtype dt);
int64_t kiln__cpu_get_i64(const char *p, kiln_dtype dt);
void kiln__cpu_set_f64(char *p, kiln_dtype dt, double v);
void kiln__cpu_set_i64(char *p, kiln_dtype dt, int64_t v);

/* Called for each run: p[i] points at the run's first element of view i, bst[i] is its
** byte stride along the run, n the run length, k0 the C-order linear index of its first
** element. */
typedef void (*kiln__cpu_run_fn)(void *ctx, char *const *p, const int64_t *bst, int64_t n,
                                 int64_t k0);
/* Visits linear elements [lo, hi) of views v[0..nv) (same shape, ideally coalesced). */
void kiln__cpu_walk(const kiln__view *v, int nv, int64_t lo, int64_t hi, kiln__cpu_run_fn fn,
                    void *ctx);

/* Runs fn over [0, n) split into one contiguous range per thread when n >= min_par and
** more than one thread is configured; otherwise one call on this thread. */
typedef void (*kiln__cpu_range_fn)(void *ctx, int64_t lo, int64_t hi);
void kiln__cpu_parallel_for(int64_t n, int64_t min_par, kiln__cpu_range_fn fn, void *ctx);
/* Nonzero once an OpenMP library (oneDNN) has run: parallel_for then runs its loops on the
** OpenMP team instead of kiln's pool (cpu_iter.c says why). */
extern _Atomic int kiln__cpu_omp_loops;
/* The number of threads parallel_for would use for n work items (1 when serial). */
int kiln__cpu_threads_for(int64_t n, int64_t min_par);
/* kiln's thread pool (cpu_pool.c): runs fn over [0, n) in tn shares split as an OpenMP
** region would; false when it cannot (pool busy, nested, tn < 2): then run it yourself. */
bool kiln__cpu_pool_run(int64_t n, int tn, kiln__cpu_range_fn fn, void *ctx);
/* Whether this thread is inside a pool job (a nested loop then runs serially). */
bool kiln__cpu_pool_inside(void);

/* Elementwise map. fn computes n elements from contiguous arrays of the compute types:
** out (type ct[0]) from in[i] (type ct[1+i]); k0 is the linear index of element 0. out may
** alias an input (element i only reads element i). */
typedef void (*kiln__cpu_vec_fn)(void *out, const void *const *in, int64_t n, int64_t k0,
                                 const kiln__kargs *a);
/* Applies fn to out0 from in[0..nin) of a (views broadcast to out0's shape); threads
** start at min_par elements. kiln__cpu_map is the cheap-op default. */
kiln_status kiln__cpu_map_ex(const kiln__kargs *a, const kiln__view *out, int nin,
                             const kiln__view *ins, const kiln_dtype *ct, kiln__cpu_vec_fn fn,
                             int64_t min_par);
kiln_status kiln__cpu_map(const kiln__kargs *a, const kiln__view *out, int nin,
                          const kiln__view *ins, const kiln_dtype *ct, kiln__cpu_vec_fn fn);

/* exp for f32 written so that a loop of it vectorizes (libm's expf is a call per element):
** range reduction x = n ln2 + r with n rounded by the 1.5*2^23 trick, Cephes' degree-5
** polynomial on |r| <= ln2/2 (about 1 ulp), and 2^n built in the exponent bits. Below
** -87.3 it returns 0 (true values there are subnormal, < 1.2e-38), above 88.72 +inf, and
** NaN stays NaN. */
static inline float kiln__expf(float x) {
  float xc = x < -87.3f ? -87.3f : (x > 88.7228f ? 88.7228f : x);
  xc = x != x ? 0.0f : xc; /* keeps the float -> int conversion below defined */
  float t = xc * 1.44269504088896341f + 12582912.0f;
  float n = t - 12582912.0f;
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * r * r + r + 1.0f;
  /* 2^n as two factors: n reaches 128 near the top of the range, -126 at the bottom */
  int32_t ni = (int32_t)n, h = ni >> 1;
  uint32_t e1 = (uint32_t)(h + 127) << 23, e2 = (uint32_t)(ni - h + 127) << 23;
  float s1, s2;
  memcpy(&s1, &e1, 4);
  memcpy(&s2, &e2, 4);
  y = y * s1 * s2;
  y = x < -87.3f ? 0.0f : y;
  y = x > 88.7228f ? (float)INFINITY : y;
  return x != x ? x : y;
}

/* tanh for f32 that vectorizes (libm's is a call per element, and tanh() of a float is
** the double one): Cephes' tanhf. |x| < 0.625: odd polynomial (about 2 ulp); beyond:
** 1 - 2 / (exp(2|x|) + 1) with the sign put back. Both are computed and one selected, so
** a loop has no branch. NaN stays NaN. */
static inline float kiln__tanhf(float x) {
  float ax = x < 0 ? -x : x;
  float z = x * x;
  float p = -5.70498872745e-3f;
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  float small = p * z * x + x;
  float e = kiln__expf(2.0f * (ax > 44.0f ? 44.0f : ax));
  float big = 1.0f - 2.0f / (e + 1.0f);
  big = x < 0 ? -big : big;
  float r = ax < 0.625f ? small : big;
  return x != x ? x : r;
}

/* Error helper for float-only ops given another dtype. */
kiln_status kiln__cpu_dtype_error(const kiln__kargs *a, kiln_dtype dt);

#endif /* KILN_CPU_ITER_H */
