/*
** The CPU iteration engine (see cpu_iter.h).
*/
/* Kernels never read the FP exception flags, so comparisons may be treated as not
** trapping: that is what lets GCC turn the selects in these loops (clamps, relu, NaN
** checks, the range limits of kiln__expf) into vector blends instead of branches. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#include "cpu_iter.h"
#include "cpu_avx512.h"

#include <stdatomic.h>

#include "../../core/half.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef KILN_HAVE_OPENMP
#include <omp.h>
#endif

bool kiln__cpu_avx2_fma(void) {
#if (defined(__GNUC__) || defined(__clang__)) && (defined(__x86_64__) || defined(__i386__))
  static int has = -1; /* a benign race: every thread stores the same value */
  if (has < 0) {
    __builtin_cpu_init();
    has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  return has != 0;
#else
  return false;
#endif
}

bool kiln__cpu_has_fma(void) {
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(KILN_NO_TARGET_CLONES)
  return kiln__cpu_avx2_fma();
#else
  return true; /* KILN__CPU_FMA is empty: the code runs anywhere */
#endif
}

bool kiln__cpu_portable_loops(void) {
  return kiln__knob_on("KILN_CONV_C1_PORTABLE", false);
}

kiln_dtype kiln__cpu_ct(kiln_dtype dt) {
  switch (dt) {
  case KILN_F64:
    return KILN_F64;
  case KILN_F32:
  case KILN_F16:
  case KILN_BF16:
    return KILN_F32;
  default:
    return KILN_I64;
  }
}

bool kiln__cpu_is_float(kiln_dtype dt) {
  return dt == KILN_F32 || dt == KILN_F64 || dt == KILN_F16 || dt == KILN_BF16;
}

size_t kiln__cpu_esize(kiln_dtype dt) {
  switch (dt) {
  case KILN_F64:
  case KILN_I64:
    return 8;
  case KILN_F32:
  case KILN_I32:
    return 4;
  case KILN_F16:
  case KILN_BF16:
    return 2;
  default:
    return 1;
  }
}

kiln_status kiln__cpu_dtype_error(const kiln__kargs *a, kiln_dtype dt) {
  return kiln_set_error(KILN_ERR_DTYPE, "kiln_%s: dtype %s is not supported on cpu",
                        kiln__kop_name(a->op), kiln_dtype_name(dt));
}

/* Float to integer the way C truncates, but defined for NaN and out-of-range values
** (NaN -> 0, saturating), so that sanitizers stay quiet and results do not depend on the
** compiler. */
static inline int64_t kiln__f2i(double v) {
  if (v != v) return 0;
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}

/* ---- load: dtype dt (strided) -> compute type (contiguous) ---- */
#define KILN__LOAD_LOOP(T, EXPR)                                                          \
  do {                                                                                    \
    T *d_ = (T *)dst;                                                                     \
    for (int64_t i = 0; i < n; i++) {                                                     \
      const char *q = src + i * bst;                                                      \
      d_[i] = (T)(EXPR);                                                                  \
    }                                                                                     \
  } while (0)

#define KILN__LOAD_ALL(T, F16CONV)                                                        \
  switch (dt) {                                                                           \
  case KILN_F32:                                                                          \
    KILN__LOAD_LOOP(T, *(const float *)q);                                                \
    break;                                                                                \
  case KILN_F64:                                                                          \
    KILN__LOAD_LOOP(T, *(const double *)q);                                               \
    break;                                                                                \
  case KILN_F16:                                                                          \
    KILN__LOAD_LOOP(T, F16CONV(kiln__f16_to_f32(*(const uint16_t *)q)));                  \
    break;                                                                                \
  case KILN_BF16:                                                                         \
    KILN__LOAD_LOOP(T, F16CONV(kiln__bf16_to_f32(*(const uint16_t *)q)));                 \
    break;                                                                                \
  case KILN_I64:                                                                          \
    KILN__LOAD_LOOP(T, *(const int64_t *)q);                                              \
    break;                                                                                \
  case KILN_I32:                                                                          \
    KILN__LOAD_LOOP(T, *(const int32_t *)q);                                              \
    break;                                                                                \
  case KILN_U8:                                                                           \
    KILN__LOAD_LOOP(T, *(const uint8_t *)q);                                              \
    break;                                                                                \
  default:                                                                                \
    KILN__LOAD_LOOP(T, *(const uint8_t *)q != 0);                                         \
    break;                                                                                \
  }

#define KILN__ID(x) (x)
#define KILN__F2I(x) kiln__f2i(x)
#define KILN__NZ(x) ((x) != 0)

/* bf16 <-> f32 over packed runs, the conversions of every bf16 elementwise op and cast:
** written so that they vectorise (the generic loops below convert one element at a time
** through a dtype switch; ReLU on 2.8M bf16 elements took 1.5 ms against 0.4 in f32).
** The same bits as kiln__bf16_to_f32 / kiln__f32_to_bf16 (RNE, NaN kept quiet). */
KILN__CPU_CLONES
static void kiln__load_bf16_packed(float *restrict d, const uint16_t *restrict s, int64_t n) {
  for (int64_t i = 0; i < n; i++) d[i] = kiln__bf16_to_f32(s[i]);
}

#ifdef KILN__AVX512
/* the same bits by vcvtneps2bf16 (cpu_avx512.h: subnormals by the integer rule), on CPUs
** with AVX512-BF16: bf16 results of the walker's ops and of the row kernels (a language
** model's dlogits: 8M elements a step) */
KILN__T512BF static void kiln__store_bf16_packed16(uint16_t *d, const float *s, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    __mmask16 k = n - i >= 16 ? (__mmask16)0xFFFF : kiln__mask16(n - i);
    kiln__store16_bf16cvt(d + i, _mm512_maskz_loadu_ps(k, s + i), k);
  }
}
#endif

KILN__CPU_CLONES
static void kiln__store_bf16_packed_c(uint16_t *restrict d, const float *restrict s, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    uint32_t u;
    memcpy(&u, &s[i], 4);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, q = (u >> 16) | 0x40u;
    d[i] = (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? q : r);
  }
}

static void kiln__store_bf16_packed(uint16_t *d, const float *s, int64_t n) {
#ifdef KILN__AVX512
  if (n >= 16 && kiln__avx512bf16_ok()) {
    kiln__store_bf16_packed16(d, s, n);
    return;
  }
#endif
  kiln__store_bf16_packed_c(d, s, n);
}

/* f32 <-> f64 over packed runs (batch norm's f64 passes over f32 activations). */
KILN__CPU_CLONES
static void kiln__load_f32_f64_packed(double *restrict d, const float *restrict s, int64_t n) {
  for (int64_t i = 0; i < n; i++) d[i] = (double)s[i];
}

KILN__CPU_CLONES
static void kiln__store_f64_f32_packed(float *restrict d, const double *restrict s, int64_t n) {
  for (int64_t i = 0; i < n; i++) d[i] = (float)s[i];
}

/* bf16 -> f64 over packed runs (exact: bf16 -> f32 -> f64), for the f64 sums over bf16
** rows: a linear layer's bias gradient under autocast (kiln__mm_colsum_range), which went
** through the generic one-element loop (~4% of a bf16 GPT step). */
KILN__CPU_CLONES512
static void kiln__load_bf16_f64_packed(double *restrict d, const uint16_t *restrict s, int64_t n) {
  for (int64_t i = 0; i < n; i++) d[i] = (double)kiln__bf16_to_f32(s[i]);
}

void kiln__cpu_load(void *dst, kiln_dtype ct, const char *src, int64_t bst, kiln_dtype dt,
                    int64_t n) {
  if (ct == KILN_F64 && dt == KILN_F32 && bst == 4) {
    kiln__load_f32_f64_packed((double *)dst, (const float *)src, n);
    return;
  }
  if (ct == KILN_F32 && dt == KILN_F32 && bst == 4) {
    memcpy(dst, src, (size_t)n * 4);
    return;
  }
  if (ct == KILN_F32 && dt == KILN_BF16 && bst == 2) {
    kiln__load_bf16_packed((float *)dst, (const uint16_t *)src, n);
    return;
  }
  if (ct == KILN_F64 && dt == KILN_F64 && bst == 8) {
    memcpy(dst, src, (size_t)n * 8);
    return;
  }
  if (ct == KILN_F64 && dt == KILN_BF16 && bst == 2) {
    kiln__load_bf16_f64_packed((double *)dst, (const uint16_t *)src, n);
    return;
  }
  switch (ct) {
  case KILN_F32:
    KILN__LOAD_ALL(float, KILN__ID);
    break;
  case KILN_F64:
    KILN__LOAD_ALL(double, KILN__ID);
    break;
  case KILN_I64:
    switch (dt) {
    case KILN_F32:
      KILN__LOAD_LOOP(int64_t, kiln__f2i(*(const float *)q));
      break;
    case KILN_F64:
      KILN__LOAD_LOOP(int64_t, kiln__f2i(*(const double *)q));
      break;
    case KILN_F16:
      KILN__LOAD_LOOP(int64_t, kiln__f2i(kiln__f16_to_f32(*(const uint16_t *)q)));
      break;
    case KILN_BF16:
      KILN__LOAD_LOOP(int64_t, kiln__f2i(kiln__bf16_to_f32(*(const uint16_t *)q)));
      break;
    case KILN_I64:
      KILN__LOAD_LOOP(int64_t, *(const int64_t *)q);
      break;
    case KILN_I32:
      KILN__LOAD_LOOP(int64_t, *(const int32_t *)q);
      break;
    case KILN_U8:
      KILN__LOAD_LOOP(int64_t, *(const uint8_t *)q);
      break;
    default:
      KILN__LOAD_LOOP(int64_t, *(const uint8_t *)q != 0);
      break;
    }
    break;
  default: /* BOOL */
    switch (dt) {
    case KILN_F32:
      KILN__LOAD_LOOP(uint8_t, *(const float *)q != 0);
      break;
    case KILN_F64:
      KILN__LOAD_LOOP(uint8_t, *(const double *)q != 0);
      break;
    case KILN_F16:
    case KILN_BF16:
      /* any bit set other than the sign means nonzero (NaN included) */
      KILN__LOAD_LOOP(uint8_t, (*(const uint16_t *)q & 0x7fffu) != 0);
      break;
    case KILN_I64:
      KILN__LOAD_LOOP(uint8_t, *(const int64_t *)q != 0);
      break;
    case KILN_I32:
      KILN__LOAD_LOOP(uint8_t, *(const int32_t *)q != 0);
      break;
    default:
      KILN__LOAD_LOOP(uint8_t, *(const uint8_t *)q != 0);
      break;
    }
    break;
  }
}

/* ---- store: compute type (contiguous) -> dtype dt (strided) ---- */
#define KILN__STORE_LOOP(ST, T, EXPR)                                                     \
  do {                                                                                    \
    const T *s_ = (const T *)src;                                                         \
    for (int64_t i = 0; i < n; i++) {                                                     \
      T v = s_[i];                                                                        \
      *(ST *)(dst + i * bst) = (ST)(EXPR);                                                \
    }                                                                                     \
  } while (0)

/* the floating destinations: the same from a floating or an integer compute type */
#define KILN__STORE_TO_FLOATS(T)                                                          \
  case KILN_F32:                                                                          \
    KILN__STORE_LOOP(float, T, v);                                                        \
    break;                                                                                \
  case KILN_F64:                                                                          \
    KILN__STORE_LOOP(double, T, v);                                                       \
    break;                                                                                \
  case KILN_F16:                                                                          \
    KILN__STORE_LOOP(uint16_t, T, kiln__f32_to_f16((float)v));                            \
    break;                                                                                \
  case KILN_BF16:                                                                         \
    KILN__STORE_LOOP(uint16_t, T, kiln__f32_to_bf16((float)v));                           \
    break;

/* the integer destinations differ: a float is converted by kiln__f2i, an integer wraps */
#define KILN__STORE_FLOAT(T)                                                              \
  switch (dt) {                                                                           \
    KILN__STORE_TO_FLOATS(T)                                                              \
  case KILN_I64:                                                                          \
    KILN__STORE_LOOP(int64_t, T, kiln__f2i(v));                                           \
    break;                                                                                \
  case KILN_I32:                                                                          \
    KILN__STORE_LOOP(int32_t, T, (int32_t)kiln__f2i(v));                                  \
    break;                                                                                \
  case KILN_U8:                                                                           \
    KILN__STORE_LOOP(uint8_t, T, (uint8_t)kiln__f2i(v));                                  \
    break;                                                                                \
  default:                                                                                \
    KILN__STORE_LOOP(uint8_t, T, v != 0);                                                 \
    break;                                                                                \
  }

#define KILN__STORE_INT(T)                                                                \
  switch (dt) {                                                                           \
    KILN__STORE_TO_FLOATS(T)                                                              \
  case KILN_I64:                                                                          \
    KILN__STORE_LOOP(int64_t, T, v);                                                      \
    break;                                                                                \
  case KILN_I32:                                                                          \
    KILN__STORE_LOOP(int32_t, T, (int32_t)(uint32_t)(uint64_t)v);                         \
    break;                                                                                \
  case KILN_U8:                                                                           \
    KILN__STORE_LOOP(uint8_t, T, (uint8_t)(uint64_t)v);                                   \
    break;                                                                                \
  default:                                                                                \
    KILN__STORE_LOOP(uint8_t, T, v != 0);                                                 \
    break;                                                                                \
  }

void kiln__cpu_store(char *dst, int64_t bst, kiln_dtype dt, const void *src, kiln_dtype ct,
                     int64_t n) {
  if (ct == KILN_F64 && dt == KILN_F32 && bst == 4) {
    kiln__store_f64_f32_packed((float *)dst, (const double *)src, n);
    return;
  }
  if (ct == KILN_F32 && dt == KILN_F32 && bst == 4) {
    memcpy(dst, src, (size_t)n * 4);
    return;
  }
  if (ct == KILN_F32 && dt == KILN_BF16 && bst == 2) {
    kiln__store_bf16_packed((uint16_t *)dst, (const float *)src, n);
    return;
  }
  if (ct == KILN_F64 && dt == KILN_F64 && bst == 8) {
    memcpy(dst, src, (size_t)n * 8);
    return;
  }
  switch (ct) {
  case KILN_F32:
    KILN__STORE_FLOAT(float);
    break;
  case KILN_F64:
    KILN__STORE_FLOAT(double);
    break;
  case KILN_I64:
    KILN__STORE_INT(int64_t);
    break;
  default:
    KILN__STORE_INT(uint8_t);
    break;
  }
}

double kiln__cpu_get_f64(const char *p, kiln_dtype dt) {
  double v;
  kiln__cpu_load(&v, KILN_F64, p, 0, dt, 1);
  return v;
}
int64_t kiln__cpu_get_i64(const char *p, kiln_dtype dt) {
  int64_t v;
  kiln__cpu_load(&v, KILN_I64, p, 0, dt, 1);
  return v;
}
void kiln__cpu_set_f64(char *p, kiln_dtype dt, double v) { kiln__cpu_store(p, 0, dt, &v, KILN_F64, 1); }
void kiln__cpu_set_i64(char *p, kiln_dtype dt, int64_t v) { kiln__cpu_store(p, 0, dt, &v, KILN_I64, 1); }

/* ---- walker ---- */
void kiln__cpu_walk(const kiln__view *v, int nv, int64_t lo, int64_t hi, kiln__cpu_run_fn fn,
                    void *ctx) {
  if (lo >= hi) return;
  int nd = v[0].ndim;
  if (nd == 0) { /* 0-d view: one element */
    char *p[KILN__CPU_MAXV];
    int64_t bst[KILN__CPU_MAXV];
    for (int i = 0; i < nv; i++) {
      p[i] = (char *)v[i].data;
      bst[i] = 0;
    }
    fn(ctx, p, bst, 1, 0);
    return;
  }
  int64_t idx[KILN_MAX_DIMS];
  int64_t rem = lo;
  for (int d = nd - 1; d >= 0; d--) {
    int64_t s = v[0].shape[d];
    idx[d] = rem % s;
    rem /= s;
  }
  int64_t bst[KILN__CPU_MAXV], es[KILN__CPU_MAXV];
  for (int i = 0; i < nv; i++) {
    es[i] = (int64_t)kiln__cpu_esize(v[i].dtype);
    bst[i] = v[i].strides[nd - 1] * es[i];
  }
  int64_t inner = v[0].shape[nd - 1];
  int64_t k = lo;
  while (k < hi) {
    char *p[KILN__CPU_MAXV];
    for (int i = 0; i < nv; i++) {
      int64_t off = 0;
      for (int d = 0; d < nd; d++) off += idx[d] * v[i].strides[d];
      p[i] = (char *)v[i].data + off * es[i];
    }
    int64_t len = inner - idx[nd - 1];
    if (len > hi - k) len = hi - k;
    fn(ctx, p, bst, len, k);
    k += len;
    idx[nd - 1] += len;
    for (int d = nd - 1; d > 0 && idx[d] >= v[0].shape[d]; d--) {
      idx[d] = 0;
      idx[d - 1]++;
    }
  }
}

/* ---- parallel for ---- */
atomic_int kiln__cpu_omp_loops; /* set by cpu_dnnl_matmul.c when oneDNN first runs a product */
int kiln__cpu_threads_for(int64_t n, int64_t min_par) {
#ifdef KILN_HAVE_OPENMP
  if (n < min_par || omp_in_parallel() || kiln__cpu_pool_inside()) return 1;
  int nt = kiln_num_threads();
  if (nt <= 1) return 1;
  int64_t most = n / (min_par / 4 > 0 ? min_par / 4 : 1); /* keep each share worthwhile */
  if (most < nt) nt = most < 1 ? 1 : (int)most;
  return nt;
#else
  (void)n;
  (void)min_par;
  return 1;
#endif
}

void kiln__cpu_parallel_for(int64_t n, int64_t min_par, kiln__cpu_range_fn fn, void *ctx) {
  if (n <= 0) return;
  int nt = kiln__cpu_threads_for(n, min_par);
  if (nt <= 1) {
    fn(ctx, 0, n);
    return;
  }
#ifdef KILN_HAVE_OPENMP
  /* Once an OpenMP library (oneDNN) runs kiln's products, its team's workers spin after
  ** each call (GOMP_SPINCOUNT, unless OMP_WAIT_POLICY=passive, read before main): a pool
  ** of kiln's own then fights them for the cores (bf16 GPT on 2 cores: 8.6k tok/s, 14k
  ** with OMP_WAIT_POLICY=passive). The loops then run on that same OpenMP team, whose
  ** spinning workers take them at once (PyTorch's arrangement). Same split, same results. */
  if (atomic_load_explicit(&kiln__cpu_omp_loops, memory_order_relaxed)) {
#pragma omp parallel num_threads(nt)
    {
      int t = omp_get_thread_num(), tn = omp_get_num_threads();
      int64_t lo = n * t / tn, hi = n * (t + 1) / tn;
      if (lo < hi) fn(ctx, lo, hi);
    }
    return;
  }
#endif
  /* kiln's own pool, whose waits sleep: OpenMP's spinning workers made every loop crawl
  ** on a machine busy with another process (cpu_pool.c). Same split, same results. */
  if (!kiln__cpu_pool_run(n, nt, fn, ctx)) fn(ctx, 0, n);
}

/* ---- elementwise map ---- */
typedef struct kiln__map_ctx {
  const kiln__kargs *a;
  kiln__view v[KILN__CPU_MAXV]; /* v[0] = out, v[1..] = ins */
  int nv;
  kiln_dtype ct[KILN__CPU_MAXV];
  int64_t csz[KILN__CPU_MAXV];
  kiln__cpu_vec_fn fn;
} kiln__map_ctx;

static void kiln__map_run(void *vctx, char *const *p, const int64_t *bst, int64_t n,
                          int64_t k0) {
  kiln__map_ctx *c = (kiln__map_ctx *)vctx;
  /* one chunk buffer per view, 8 bytes per element covers every compute type */
  _Alignas(64) double buf[KILN__CPU_MAXV][KILN__CPU_BLK];
  bool direct[KILN__CPU_MAXV];
  bool all_direct = true;
  for (int i = 0; i < c->nv; i++) {
    direct[i] = c->v[i].dtype == c->ct[i] && bst[i] == c->csz[i];
    if (!direct[i]) all_direct = false;
  }
  int64_t step = all_direct ? n : KILN__CPU_BLK;
  for (int64_t off = 0; off < n; off += step) {
    int64_t len = n - off < step ? n - off : step;
    const void *in[KILN__CPU_MAXV];
    for (int i = 1; i < c->nv; i++) {
      if (direct[i]) {
        in[i - 1] = p[i] + off * bst[i];
      } else {
        kiln__cpu_load(buf[i], c->ct[i], p[i] + off * bst[i], bst[i], c->v[i].dtype, len);
        in[i - 1] = buf[i];
      }
    }
    void *out = direct[0] ? (void *)(p[0] + off * bst[0]) : (void *)buf[0];
    c->fn(out, in, len, k0 + off, c->a);
    if (!direct[0]) kiln__cpu_store(p[0] + off * bst[0], bst[0], c->v[0].dtype, buf[0], c->ct[0], len);
  }
}

static void kiln__map_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__map_ctx *c = (kiln__map_ctx *)vctx;
  kiln__cpu_walk(c->v, c->nv, lo, hi, kiln__map_run, c);
}

kiln_status kiln__cpu_map(const kiln__kargs *a, const kiln__view *out, int nin,
                          const kiln__view *ins, const kiln_dtype *ct, kiln__cpu_vec_fn fn) {
  return kiln__cpu_map_ex(a, out, nin, ins, ct, fn, KILN__CPU_PAR_MIN_CHEAP);
}

kiln_status kiln__cpu_map_ex(const kiln__kargs *a, const kiln__view *out, int nin,
                             const kiln__view *ins, const kiln_dtype *ct, kiln__cpu_vec_fn fn,
                             int64_t min_par) {
  /* A small op on compact operands already of the compute types (most ops of a small
  ** model's step): one call over the whole range, without copying and coalescing the
  ** views, which cost more host time than the arithmetic at this size. */
  int64_t n_small = kiln__view_numel(out);
  if (n_small < min_par && out->dtype == ct[0] && kiln__view_is_contiguous(out)) {
    const void *p[KILN__CPU_MAXV];
    bool compact = true;
    for (int i = 0; i < nin && compact; i++) {
      compact = ins[i].dtype == ct[i + 1] && kiln__view_is_contiguous(&ins[i]);
      p[i] = ins[i].data;
    }
    if (compact) {
      if (n_small > 0) fn(out->data, p, n_small, 0, a);
      return KILN_OK;
    }
  }
  kiln__map_ctx c;
  c.a = a;
  c.nv = nin + 1;
  c.fn = fn;
  c.v[0] = *out;
  for (int i = 0; i < nin; i++) c.v[i + 1] = ins[i];
  for (int i = 0; i < c.nv; i++) {
    c.ct[i] = ct[i];
    c.csz[i] = (int64_t)kiln__cpu_esize(ct[i]);
  }
  int64_t numel = kiln__view_numel(out);
  if (numel == 0) return KILN_OK;
  kiln__views_coalesce(c.v, c.nv);
  kiln__cpu_parallel_for(numel, min_par, kiln__map_range, &c);
  return KILN_OK;
}
