/*
** MATMUL: out0 (B..., M, N) = s0 * A (B..., M, K) @ B (B..., K, N) + s1 * out0 + bias (N).
**
** Per batch element the product goes to sgemm/dgemm when built with a CBLAS (f32 through
** kiln__sgemm, cpu_blas.c: oneDNN's where OpenBLAS runs generic kernels)
** (KILN_HAVE_CBLAS), else to a blocked portable GEMM. An operand whose last two dims have
** a unit stride in either position is handed over as it is (row-major, or transposed with
** CblasTrans); any other layout is first copied to a contiguous temporary. An output in
** column-major layout is computed as C^T = B^T A^T. When B is shared by the whole batch
** (stride 0) and the batch dims of A and out0 fold into M, the batch becomes one big GEMM
** ((B, T, C) @ (C, D) is one (B*T, C) @ (C, D)). bf16 products go to oneDNN where it is
** built in (cpu_dnnl_matmul.c: AMX, no temporaries); f16, and bf16 layouts oneDNN has no
** fast kernel for, go through f32 temporaries.
** s1 == 0 means out0 is never read (it may hold NaN or garbage).
*/
#include "cpu.h"
#include "cpu_iter.h"
#include "cpu_avx512.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef KILN_HAVE_CBLAS
#include <cblas.h>
#endif
#ifdef KILN_HAVE_OPENMP
#include <omp.h>
#endif

#if defined(KILN_HAVE_CBLAS) && defined(OPENBLAS_VERSION)
#include <stdatomic.h>
/* OpenBLAS keeps its own thread pool; give it kiln's thread count (KILN_NUM_THREADS,
** kiln_set_num_threads) whenever that changes, so one setting governs every kernel —
** except for small products, which get one thread: below ~8M multiply-adds the split
** saves less than a wake-up costs, and on a busy machine a descheduled BLAS worker
** turned each small GEMM into milliseconds. */
#define KILN__MM_BLAS_PAR_MACS ((int64_t)1 << 23)
static atomic_int kiln__blas_threads;
static void kiln__blas_sync_threads(int64_t macs) {
  int nt = macs < KILN__MM_BLAS_PAR_MACS ? 1 : kiln_num_threads();
  if (atomic_load_explicit(&kiln__blas_threads, memory_order_relaxed) != nt) {
    atomic_store(&kiln__blas_threads, nt);
    openblas_set_num_threads(nt);
  }
}
static int kiln__blas_nt(void) { return atomic_load_explicit(&kiln__blas_threads, memory_order_relaxed); }
#else
static void kiln__blas_sync_threads(int64_t macs) { (void)macs; }
#endif
#ifdef KILN_HAVE_CBLAS
#ifndef OPENBLAS_VERSION
static int kiln__blas_nt(void) { return kiln_num_threads(); }
#endif
/* cblas_sgemm's arguments to kiln__sgemm (cpu_blas.c: OpenBLAS, or oneDNN where OpenBLAS
** runs generic kernels) */
static void kiln__cblas_sgemm(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                              const float *B, int ldb, float beta, float *C, int ldc) {
  (void)order;
  kiln__sgemm(ta == CblasTrans, tb == CblasTrans, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, kiln__blas_nt());
}
#endif

/* Below this many multiply-adds a GEMM runs on one thread, and batches run in parallel. */
#define KILN__MM_PAR_FLOPS (1 << 22)

/* Whether a (rows, cols) matrix with strides (rs, cs) can be passed to a row-major GEMM,
** untransposed (*trans = 0) or transposed (*trans = 1), and with which leading dim. */
static bool kiln__mm_layout(int64_t rows, int64_t cols, int64_t rs, int64_t cs, int *trans, int64_t *ld) {
  int64_t mc = cols > 1 ? cols : 1, mr = rows > 1 ? rows : 1;
  if ((cols == 1 || cs == 1) && (rows == 1 || rs >= mc)) {
    *trans = 0;
    *ld = rows == 1 ? mc : rs;
    return true;
  }
  if ((rows == 1 || rs == 1) && (cols == 1 || cs >= mr)) {
    *trans = 1;
    *ld = cols == 1 ? mr : cs;
    return true;
  }
  return false;
}

#define KILN__MM_MB 64
#define KILN__MM_KB 128
#define KILN__MM_NB 256

#define KILN__MM_FNS(T, SUF, CBLAS_GEMM)                                                   \
  /* C (row-major, ldc) = alpha * A @ B + beta * C; A, B given by element strides. */     \
  typedef struct kiln__pg_##SUF {                                                         \
    int64_t M, N, K;                                                                      \
    T alpha, beta;                                                                        \
    const T *A;                                                                           \
    int64_t ars, acs;                                                                     \
    const T *B;                                                                           \
    int64_t brs, bcs;                                                                     \
    T *C;                                                                                 \
    int64_t ldc;                                                                          \
    int failed;                                                                           \
  } kiln__pg_##SUF;                                                                       \
  static void kiln__pg_range_##SUF(void *vctx, int64_t lo, int64_t hi) {                  \
    kiln__pg_##SUF *g = (kiln__pg_##SUF *)vctx;                                           \
    int64_t i_lo = lo * KILN__MM_MB, i_hi = hi * KILN__MM_MB;                             \
    if (i_hi > g->M) i_hi = g->M;                                                         \
    for (int64_t i = i_lo; i < i_hi; i++) {                                               \
      T *c = g->C + i * g->ldc;                                                           \
      if (g->beta == 0)                                                                   \
        for (int64_t j = 0; j < g->N; j++) c[j] = 0;                                      \
      else if (g->beta != 1)                                                              \
        for (int64_t j = 0; j < g->N; j++) c[j] *= g->beta;                               \
    }                                                                                     \
    T *bp = (T *)malloc(sizeof(T) * KILN__MM_KB * KILN__MM_NB);                           \
    if (!bp) {                                                                            \
      g->failed = 1;                                                                      \
      return;                                                                             \
    }                                                                                     \
    for (int64_t j0 = 0; j0 < g->N; j0 += KILN__MM_NB) {                                  \
      int64_t nb = g->N - j0 < KILN__MM_NB ? g->N - j0 : KILN__MM_NB;                     \
      for (int64_t k0 = 0; k0 < g->K; k0 += KILN__MM_KB) {                                \
        int64_t kb = g->K - k0 < KILN__MM_KB ? g->K - k0 : KILN__MM_KB;                   \
        /* pack the B panel contiguous so the inner loop is a unit-stride axpy */         \
        for (int64_t k = 0; k < kb; k++) {                                                \
          const T *brow = g->B + (k0 + k) * g->brs + j0 * g->bcs;                         \
          T *dst = bp + k * nb;                                                           \
          if (g->bcs == 1)                                                                \
            memcpy(dst, brow, sizeof(T) * (size_t)nb);                                    \
          else                                                                            \
            for (int64_t j = 0; j < nb; j++) dst[j] = brow[j * g->bcs];                   \
        }                                                                                 \
        for (int64_t i = i_lo; i < i_hi; i++) {                                           \
          T *c = g->C + i * g->ldc + j0;                                                  \
          const T *arow = g->A + i * g->ars + k0 * g->acs;                                \
          int64_t k = 0;                                                                  \
          for (; k + 4 <= kb; k += 4) { /* four rows of B per pass over the C row */      \
            T a0 = g->alpha * arow[k * g->acs], a1 = g->alpha * arow[(k + 1) * g->acs];   \
            T a2 = g->alpha * arow[(k + 2) * g->acs], a3 = g->alpha * arow[(k + 3) * g->acs]; \
            const T *b0 = bp + k * nb, *b1 = b0 + nb, *b2 = b1 + nb, *b3 = b2 + nb;       \
            for (int64_t j = 0; j < nb; j++)                                              \
              c[j] += a0 * b0[j] + a1 * b1[j] + a2 * b2[j] + a3 * b3[j];                  \
          }                                                                               \
          for (; k < kb; k++) {                                                           \
            T a0 = g->alpha * arow[k * g->acs];                                           \
            const T *b0 = bp + k * nb;                                                    \
            for (int64_t j = 0; j < nb; j++) c[j] += a0 * b0[j];                          \
          }                                                                               \
        }                                                                                 \
      }                                                                                   \
    }                                                                                     \
    free(bp);                                                                             \
  }                                                                                       \
  /* One GEMM on operands already in a BLAS layout (row-major C). */                      \
  static int kiln__gemm_##SUF(int ta, int tb, int64_t M, int64_t N, int64_t K, T alpha,   \
                              const T *A, int64_t lda, const T *B, int64_t ldb, T beta, T *C, \
                              int64_t ldc) {                                              \
    CBLAS_GEMM                                                                            \
    kiln__pg_##SUF g = {M, N, K, alpha, beta, A, ta ? 1 : lda, ta ? lda : 1,              \
                        B, tb ? 1 : ldb, tb ? ldb : 1, C, ldc, 0};                        \
    int64_t nblk = (M + KILN__MM_MB - 1) / KILN__MM_MB;                                   \
    bool big = (double)M * (double)N * (double)K >= KILN__MM_PAR_FLOPS;                   \
    kiln__cpu_parallel_for(nblk, big ? 1 : INT64_MAX, kiln__pg_range_##SUF, &g);          \
    return g.failed ? -1 : 0;                                                             \
  }                                                                                       \
  /* Copies a strided (rows, cols) matrix into a contiguous one. */                       \
  static void kiln__pack_##SUF(T *dst, const T *src, int64_t rows, int64_t cols, int64_t rs, \
                               int64_t cs) {                                              \
    for (int64_t r = 0; r < rows; r++)                                                    \
      for (int64_t c = 0; c < cols; c++) dst[r * cols + c] = src[r * rs + c * cs];        \
  }                                                                                       \
  /* C (strides cm, cn) = alpha * A @ B + beta * C for any strides; tmp: scratch, NULL */ \
  /* when none is needed; returns 0, or -1 when out of memory. */                         \
  static int kiln__gemm_any_##SUF(int64_t M, int64_t N, int64_t K, T alpha, const T *A,   \
                                  int64_t am, int64_t ak, const T *B, int64_t bk,         \
                                  int64_t bn, T beta, T *C, int64_t cm, int64_t cn) {     \
    int ta, tb, tc;                                                                       \
    int64_t lda, ldb, ldc;                                                                \
    T *ta_buf = NULL, *tb_buf = NULL, *tc_buf = NULL;                                     \
    int rc = 0;                                                                           \
    if (!kiln__mm_layout(M, K, am, ak, &ta, &lda)) {                                      \
      ta_buf = (T *)malloc(sizeof(T) * (size_t)(M * K));                                  \
      if (!ta_buf) return -1;                                                             \
      kiln__pack_##SUF(ta_buf, A, M, K, am, ak);                                          \
      A = ta_buf;                                                                         \
      ta = 0;                                                                             \
      lda = K > 1 ? K : 1;                                                                \
    }                                                                                     \
    if (!kiln__mm_layout(K, N, bk, bn, &tb, &ldb)) {                                      \
      tb_buf = (T *)malloc(sizeof(T) * (size_t)(K * N));                                  \
      if (!tb_buf) {                                                                      \
        free(ta_buf);                                                                     \
        return -1;                                                                        \
      }                                                                                   \
      kiln__pack_##SUF(tb_buf, B, K, N, bk, bn);                                          \
      B = tb_buf;                                                                         \
      tb = 0;                                                                             \
      ldb = N > 1 ? N : 1;                                                                \
    }                                                                                     \
    if (kiln__mm_layout(M, N, cm, cn, &tc, &ldc)) {                                       \
      if (!tc)                                                                            \
        rc = kiln__gemm_##SUF(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);      \
      else /* column-major C: C^T = B^T A^T */                                            \
        rc = kiln__gemm_##SUF(!tb, !ta, N, M, K, alpha, B, ldb, A, lda, beta, C, ldc);    \
    } else {                                                                              \
      tc_buf = (T *)malloc(sizeof(T) * (size_t)(M * N));                                  \
      if (!tc_buf) {                                                                      \
        rc = -1;                                                                          \
      } else {                                                                            \
        if (beta != 0) kiln__pack_##SUF(tc_buf, C, M, N, cm, cn);                         \
        rc = kiln__gemm_##SUF(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, tc_buf,       \
                              N > 1 ? N : 1);                                             \
        for (int64_t i = 0; i < M; i++)                                                   \
          for (int64_t j = 0; j < N; j++) C[i * cm + j * cn] = tc_buf[i * N + j];         \
      }                                                                                   \
    }                                                                                     \
    free(ta_buf);                                                                         \
    free(tb_buf);                                                                         \
    free(tc_buf);                                                                         \
    return rc;                                                                            \
  }

#ifdef KILN_HAVE_CBLAS
#if defined(KILN_HAVE_OPENMP) && defined(KILN_BLAS_OPENMP)
/* A mid-sized product on several threads is split by kiln, not by the BLAS: one
** single-threaded BLAS call per thread on a slice of C's columns or rows (an OpenMP
** build of OpenBLAS runs single-threaded inside a parallel region). OpenBLAS's own split
** syncs its threads several times per call (spinning and sched_yield), and picks a
** partition that can be a poor one for the shapes of a small MLP. Measured on 2 cores,
** 2 threads, us (OpenBLAS 0.3.21 SkylakeX kernels; C cold, as in a training step):
**   (M, N, K)                 OpenBLAS  slices of N  slices of M
**   NT  128  256  784            252        243          262   x W1^T (fashion-mnist)
**   TN  256  784  128            241        249          214   dW1 = g^T x
**   NN  512  512  512           1029       1031          969
**   NT  256 1024 1024           1925       1972         2196
**   TN 1024 1024  256           1966       2025         1911
**   NN  128 4096 1024           4378       4319         4758
**   NN 4096  128 1024           4527       5117         4214
**   NN 1024 1024 1024           7551       7756         7744
** Slices of M pack all of B in every thread, slices of N all of A; rows of A that are
** few and long (K > M) make the second cheaper. From 256M multiply-adds the BLAS's own
** threads (which share their packed panels) win again. */
#define KILN__MM_SPLIT_MAX_MACS ((int64_t)1 << 28)
/* kiln's fork costs 1-3 us where OpenBLAS's wake-up cost more (KILN__MM_BLAS_PAR_MACS), so
** kiln splits from 256k multiply-adds (~5 us on one core): the small products of an MLP's
** output layer, (128, 256) x (256, 10) and its two gradients, run on both cores too. */
#define KILN__MM_SPLIT_MIN_MACS ((int64_t)1 << 18)
static int kiln__mm_split_parts(int64_t M, int64_t N, int64_t K, bool *along_n) {
  int64_t macs = M * N * K;
  /* Few rows: slices of N measured slower than one call (10 x 256 x 128: 9.2 against 5.5 us). */
  if (M < 64 || macs < KILN__MM_SPLIT_MIN_MACS || macs >= KILN__MM_SPLIT_MAX_MACS || omp_in_parallel() ||
      kiln__cpu_pool_inside())
    return 0;
  int nt = kiln_num_threads();
  /* slices of 32 rows or columns at least; N when K > M and there are enough columns */
  *along_n = K > M && N >= 64;
  int64_t len = *along_n ? N : M, most = len / 32;
  if (most < nt) nt = (int)most;
  return nt > 1 ? nt : 0;
}
#define KILN__MM_SPLIT_FNS(T, SUF, FN)                                                    \
  typedef struct kiln__bs_##SUF {                                                         \
    int ta, tb, parts;                                                                    \
    bool along_n;                                                                         \
    int64_t M, N, K, lda, ldb, ldc;                                                       \
    T alpha, beta;                                                                        \
    const T *A, *B;                                                                       \
    T *C;                                                                                 \
  } kiln__bs_##SUF;                                                                       \
  static void kiln__bs_range_##SUF(void *vctx, int64_t lo, int64_t hi) {                  \
    const kiln__bs_##SUF *g = (const kiln__bs_##SUF *)vctx;                               \
    int64_t len = g->along_n ? g->N : g->M, al = g->along_n ? 16 : 8; /* vector-aligned */\
    int64_t s0 = len * lo / g->parts / al * al, s1 = hi == g->parts ? len : len * hi / g->parts / al * al; \
    if (s1 <= s0) return;                                                                 \
    const T *A = g->A, *B = g->B;                                                         \
    T *C = g->C;                                                                          \
    int64_t M = g->M, N = g->N;                                                           \
    if (g->along_n) {                                                                     \
      B += g->tb ? s0 * g->ldb : s0;                                                      \
      C += s0;                                                                            \
      N = s1 - s0;                                                                        \
    } else {                                                                              \
      A += g->ta ? s0 : s0 * g->lda;                                                      \
      C += s0 * g->ldc;                                                                   \
      M = s1 - s0;                                                                        \
    }                                                                                     \
    FN(CblasRowMajor, g->ta ? CblasTrans : CblasNoTrans, g->tb ? CblasTrans : CblasNoTrans, \
       (int)M, (int)N, (int)g->K, g->alpha, A, (int)g->lda, B, (int)g->ldb, g->beta, C, (int)g->ldc); \
  }
KILN__MM_SPLIT_FNS(float, f32, kiln__cblas_sgemm)
KILN__MM_SPLIT_FNS(double, f64, cblas_dgemm)
#define KILN__MM_SPLIT(SUF)                                                               \
  bool along_n_ = false;                                                                  \
  int parts_ = kiln__mm_split_parts(M, N, K, &along_n_);                                  \
  if (parts_) {                                                                           \
    kiln__bs_##SUF bs_ = {ta, tb, parts_, along_n_, M, N, K, lda, ldb, ldc, alpha, beta, A, B, C}; \
    kiln__blas_sync_threads(0); /* one BLAS thread per slice: kiln's pool runs the slices */ \
    kiln__cpu_parallel_for(parts_, 1, kiln__bs_range_##SUF, &bs_);                        \
    return 0;                                                                             \
  }
#else
#define KILN__MM_SPLIT(SUF)
#endif
#define KILN__CBLAS_CALL(FN, SUF)                                                         \
  if (M > 0 && N > 0) {                                                                   \
    if (K == 0) { /* BLAS leaves C alone for K == 0 only when beta == 1; be explicit */   \
      for (int64_t i = 0; i < M; i++)                                                     \
        for (int64_t j = 0; j < N; j++) C[i * ldc + j] = beta == 0 ? 0 : beta * C[i * ldc + j]; \
      return 0;                                                                           \
    }                                                                                     \
    KILN__MM_SPLIT(SUF)                                                                   \
    FN(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,     \
       (int)M, (int)N, (int)K, alpha, A, (int)lda, B, (int)ldb, beta, C, (int)ldc);       \
  }                                                                                       \
  return 0;
KILN__MM_FNS(float, f32, KILN__CBLAS_CALL(kiln__cblas_sgemm, f32))
KILN__MM_FNS(double, f64, KILN__CBLAS_CALL(cblas_dgemm, f64))
#else
KILN__MM_FNS(float, f32, )
KILN__MM_FNS(double, f64, )
#endif

typedef struct kiln__mm_job {
  const kiln__kargs *a;
  kiln_dtype dt;
  int64_t M, N, K;
  int nb;                         /* batch dims */
  int64_t nbatch;
  int64_t bshape[KILN_MAX_DIMS];
  int64_t am, ak, bk, bn, cm, cn; /* matrix strides */
  const void *bias;               /* contiguous bias in the compute type, or NULL */
  int failed;
} kiln__mm_job;

/* Element offsets of batch element b in views v (batch dims [0, nb)). */
static int64_t kiln__mm_boff(const kiln__mm_job *j, const kiln__view *v, int64_t b) {
  int64_t off = 0;
  for (int d = j->nb - 1; d >= 0; d--) {
    int64_t s = j->bshape[d];
    off += (b % s) * v->strides[d];
    b /= s;
  }
  return off;
}

/* Adds the bias to each row of the (M, N) result at C (compute type T). */
#define KILN__MM_BIAS(T, C, M, N, cm, cn, bias)                                           \
  do {                                                                                    \
    const T *bb_ = (const T *)(bias);                                                     \
    for (int64_t i_ = 0; i_ < (M); i_++) {                                                \
      T *row_ = (C) + i_ * (cm);                                                          \
      if ((cn) == 1)                                                                      \
        for (int64_t j_ = 0; j_ < (N); j_++) row_[j_] += bb_[j_];                         \
      else                                                                                \
        for (int64_t j_ = 0; j_ < (N); j_++) row_[j_ * (cn)] += bb_[j_];                  \
    }                                                                                     \
  } while (0)

/* One batch element (or the folded batch) on f32/f64 data in place. */
static int kiln__mm_one(const kiln__mm_job *j, int64_t M, const char *A, const char *B, char *C) {
  const kiln__kargs *a = j->a;
  if (j->dt == KILN_F32) {
    float *c = (float *)C;
    if (kiln__gemm_any_f32(M, j->N, j->K, (float)a->s[0], (const float *)A, j->am, j->ak, (const float *)B,
                           j->bk, j->bn, (float)a->s[1], c, j->cm, j->cn))
      return -1;
    if (j->bias) KILN__MM_BIAS(float, c, M, j->N, j->cm, j->cn, j->bias);
  } else {
    double *c = (double *)C;
    if (kiln__gemm_any_f64(M, j->N, j->K, a->s[0], (const double *)A, j->am, j->ak, (const double *)B, j->bk,
                           j->bn, a->s[1], c, j->cm, j->cn))
      return -1;
    if (j->bias) KILN__MM_BIAS(double, c, M, j->N, j->cm, j->cn, j->bias);
  }
  return 0;
}

/* 16-bit: convert a strided (rows, cols) matrix to contiguous f32 and back. */
static void kiln__mm_to_f32(float *dst, const char *src, kiln_dtype dt, int64_t rows, int64_t cols, int64_t rs,
                            int64_t cs) {
  int64_t es = (int64_t)kiln__cpu_esize(dt);
  for (int64_t r = 0; r < rows; r++) kiln__cpu_load(dst + r * cols, KILN_F32, src + r * rs * es, cs * es, dt, cols);
}
static void kiln__mm_from_f32(char *dst, kiln_dtype dt, const float *src, int64_t rows, int64_t cols, int64_t rs,
                              int64_t cs) {
  int64_t es = (int64_t)kiln__cpu_esize(dt);
  for (int64_t r = 0; r < rows; r++) kiln__cpu_store(dst + r * rs * es, cs * es, dt, src + r * cols, KILN_F32, cols);
}

static int kiln__mm_one_half(const kiln__mm_job *j, int64_t M, const char *A, const char *B, char *C,
                             float *ta, float *tb, float *tc) {
  const kiln__kargs *a = j->a;
  int64_t N = j->N, K = j->K;
  kiln__mm_to_f32(ta, A, j->dt, M, K, j->am, j->ak);
  kiln__mm_to_f32(tb, B, j->dt, K, N, j->bk, j->bn);
  if (a->s[1] != 0) kiln__mm_to_f32(tc, C, j->dt, M, N, j->cm, j->cn);
  if (kiln__gemm_any_f32(M, N, K, (float)a->s[0], ta, K, 1, tb, N, 1, (float)a->s[1], tc, N, 1)) return -1;
  if (j->bias) KILN__MM_BIAS(float, tc, M, N, N, 1, j->bias);
  kiln__mm_from_f32(C, j->dt, tc, M, N, j->cm, j->cn);
  return 0;
}

typedef struct kiln__mm_bjob {
  kiln__mm_job *j;
  const kiln__view *A, *B, *C;
} kiln__mm_bjob;

static void kiln__mm_batch_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__mm_bjob *bj = (kiln__mm_bjob *)vctx;
  kiln__mm_job *j = bj->j;
  int64_t es = (int64_t)kiln__cpu_esize(j->dt);
  float *ta = NULL, *tb = NULL, *tc = NULL;
  bool half = j->dt == KILN_F16 || j->dt == KILN_BF16;
  if (half) {
    ta = (float *)malloc(sizeof(float) * (size_t)(j->M * j->K + 1));
    tb = (float *)malloc(sizeof(float) * (size_t)(j->K * j->N + 1));
    tc = (float *)malloc(sizeof(float) * (size_t)(j->M * j->N + 1));
    if (!ta || !tb || !tc) {
      j->failed = 1;
      lo = hi;
    }
  }
  for (int64_t b = lo; b < hi; b++) {
    const char *A = (const char *)bj->A->data + kiln__mm_boff(j, bj->A, b) * es;
    const char *B = (const char *)bj->B->data + kiln__mm_boff(j, bj->B, b) * es;
    char *C = (char *)bj->C->data + kiln__mm_boff(j, bj->C, b) * es;
    int rc = half ? kiln__mm_one_half(j, j->M, A, B, C, ta, tb, tc) : kiln__mm_one(j, j->M, A, B, C);
    if (rc) j->failed = 1;
  }
  free(ta);
  free(tb);
  free(tc);
}

/* out1 (M) = the sums of A's rows over K (MATMUL with n_out == 2, 2-d only), by the SUM
** kernel (vectorised, threaded) with out1 seen as (M, 1). */
typedef struct kiln__mm_cs {
  const kiln__view *A, *out;
  int failed;
} kiln__mm_cs;

/* Columns [lo, hi) of out's rows when A is transposed (unit stride along M: A = g^T, the
** bias gradient's column sums of g): g's rows are walked contiguously, each loaded once
** and added into f64 sums. SUM's walk went down A's rows at g's row stride, element by
** element (3.5% of a bf16 GPT step). */
#ifdef KILN__AVX512
/* acc[0..w) = the f64 sums over k of the w f32/bf16 values at base + k rs (bytes), k in
** order: the loop below's sums, the same bits. 64 columns at a time in 8 f64 registers
** (a bias gradient's (2048, 1024) bf16 g: the widening into a row buffer and the adds from
** it were ~3% of a GPT step on 2 cores). */
KILN__T512 static void kiln__mm_colsum16(const char *base, int64_t rs, bool bf, int64_t w, int64_t K, double *acc) {
  const int64_t es = bf ? 2 : 4;
  int64_t i = 0;
  for (; i + 64 <= w; i += 64) {
    __m512d a[8];
    for (int q = 0; q < 8; q++) a[q] = _mm512_setzero_pd();
    for (int64_t k = 0; k < K; k++) {
      const char *p = base + k * rs + i * es;
      for (int q = 0; q < 4; q++) {
        __m512 v = kiln__load16(p + q * 16 * es, bf, (__mmask16)0xFFFF);
        a[2 * q] = _mm512_add_pd(a[2 * q], _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
        a[2 * q + 1] = _mm512_add_pd(a[2 * q + 1], _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
      }
    }
    for (int q = 0; q < 8; q++) _mm512_storeu_pd(acc + i + 8 * q, a[q]);
  }
  for (; i < w; i += 16) {
    __mmask16 m = w - i >= 16 ? (__mmask16)0xFFFF : kiln__mask16(w - i);
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    for (int64_t k = 0; k < K; k++) {
      __m512 v = kiln__load16(base + k * rs + i * es, bf, m);
      a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
      a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
    }
    _mm512_mask_storeu_pd(acc + i, (__mmask8)m, a0);
    _mm512_mask_storeu_pd(acc + i + 8, (__mmask8)(m >> 8), a1);
  }
}
#endif

static void kiln__mm_colsum_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__mm_cs *c = (kiln__mm_cs *)vctx;
  const kiln__view *A = c->A;
  int64_t w = hi - lo, K = A->shape[1], es = (int64_t)kiln__cpu_esize(A->dtype);
  double *acc = (double *)malloc(sizeof(double) * (size_t)(2 * w + 1));
  if (!acc) {
    c->failed = 1;
    return;
  }
  double *row = acc + w;
  for (int64_t i = 0; i < w; i++) acc[i] = 0;
#ifdef KILN__AVX512
  if (kiln__avx512_ok() && (A->dtype == KILN_BF16 || A->dtype == KILN_F32)) {
    kiln__mm_colsum16((const char *)A->data + lo * es, A->strides[1] * es, A->dtype == KILN_BF16, w, K, acc);
    K = 0; /* done: the loop below adds nothing */
  }
#endif
  for (int64_t k = 0; k < K; k++) {
    kiln__cpu_load(row, KILN_F64, (const char *)A->data + (k * A->strides[1] + lo) * es, es, A->dtype, w);
    for (int64_t i = 0; i < w; i++) acc[i] += row[i];
  }
  int64_t os = (int64_t)kiln__cpu_esize(c->out->dtype);
  kiln__cpu_store((char *)c->out->data + lo * c->out->strides[0] * os, c->out->strides[0] * os, c->out->dtype, acc,
                  KILN_F64, w);
  free(acc);
}

static kiln_status kiln__mm_row_sums(const kiln__view *A, const kiln__view *out) {
  if (A->ndim == 2 && A->strides[0] == 1 && A->shape[0] > 1 && A->shape[1] > 0 &&
      kiln__cpu_is_float(A->dtype)) {
    kiln__mm_cs c = {A, out, 0};
    kiln__cpu_parallel_for(A->shape[0], A->shape[0] * A->shape[1] >= KILN__CPU_PAR_MIN_CHEAP ? 64 : INT64_MAX,
                           kiln__mm_colsum_range, &c);
    return c.failed ? kiln_set_error(KILN_ERR_OOM, "kiln_matmul: out of host memory for the row sums") : KILN_OK;
  }
  kiln__kargs r = {0};
  r.op = KILN__K_SUM;
  r.n_in = r.n_out = 1;
  r.in[0] = *A;
  r.out[0] = *out;
  r.out[0].ndim = 2;
  r.out[0].shape[0] = A->shape[0];
  r.out[0].shape[1] = 1;
  r.out[0].strides[1] = 0;
  r.i[0] = 2; /* dim 1 reduced, also when K == 1 */
  return kiln__cpu_backend.kernels[KILN__K_SUM](&r);
}

/* MATMUL's flags by composition: A masked into a temporary (RELU_BACKWARD's where(mask >
** 0, A, 0)), the plain product (row sums included), then ReLU in place on out0. */
static kiln_status kiln__mm_flags(const kiln__kargs *a) {
  const kiln__view *A = &a->in[0], *mask = kiln__mm_mask(a);
  kiln__kargs k = *a;
  k.i[1] = 0;
  void *tmp = NULL;
  if (mask) {
    if (mask->ndim != A->ndim || memcmp(mask->shape, A->shape, sizeof(int64_t) * (size_t)A->ndim) != 0)
      return kiln_set_error(KILN_ERR_SHAPE, "kiln_matmul: the mask of A has another shape");
    int64_t n = kiln__view_numel(A);
    tmp = malloc((size_t)(n > 0 ? n : 1) * kiln__cpu_esize(A->dtype));
    if (!tmp) return kiln_set_error(KILN_ERR_OOM, "kiln_matmul: out of host memory for a masked operand");
    kiln__kargs r = {0};
    r.op = KILN__K_RELU_BACKWARD;
    r.n_in = 2;
    r.n_out = 1;
    r.in[0] = *mask;
    r.in[1] = *A;
    r.out[0] = *A;
    r.out[0].data = tmp;
    /* dense, in A's own memory order (a transposed A stays transposed: the product then
    ** runs on the layout it would have had without the mask) */
    int order[KILN_MAX_DIMS];
    for (int d = 0; d < A->ndim; d++) order[d] = d;
    for (int i = 1; i < A->ndim; i++) /* insertion sort: largest stride first */
      for (int j = i; j > 0 && llabs(A->strides[order[j]]) > llabs(A->strides[order[j - 1]]); j--) {
        int t = order[j];
        order[j] = order[j - 1];
        order[j - 1] = t;
      }
    int64_t st = 1;
    for (int i = A->ndim - 1; i >= 0; i--) {
      r.out[0].strides[order[i]] = st;
      st *= A->shape[order[i]] > 0 ? A->shape[order[i]] : 1;
    }
    /* the elementwise kernel walks C order: hand it the views with their dims in memory
    ** order (all three permuted alike), so a transposed A is a plain contiguous run */
    kiln__kargs rp = r;
    for (int v = 0; v < 3; v++) {
      kiln__view *src = v == 0 ? &r.in[0] : v == 1 ? &r.in[1] : &r.out[0];
      kiln__view *dst = v == 0 ? &rp.in[0] : v == 1 ? &rp.in[1] : &rp.out[0];
      for (int i = 0; i < A->ndim; i++) {
        dst->shape[i] = src->shape[order[i]];
        dst->strides[i] = src->strides[order[i]];
      }
    }
    kiln_status s = kiln__cpu_backend.kernels[KILN__K_RELU_BACKWARD](&rp);
    if (s != KILN_OK) {
      free(tmp);
      return s;
    }
    k.n_in--;
    k.in[0] = r.out[0];
  }
  kiln_status st = kiln__cpu_matmul(&k);
  free(tmp);
  if (st != KILN_OK || !(a->i[1] & 1)) return st;
  kiln__kargs r = {0};
  r.op = KILN__K_RELU;
  r.n_in = r.n_out = 1;
  r.in[0] = r.out[0] = a->out[0];
  return kiln__cpu_backend.kernels[KILN__K_RELU](&r);
}

/* An f32 product (and row sums) of 16-bit operands (autocast's weight gradients, given
** straight to the f32 parameter): A and B are widened into f32 temporaries (exact) and the
** f32 product runs on them. The 16-bit path computes the same way (f32 temporaries, f32
** accumulation) and only rounds at the end, so this is that result unrounded. */
static kiln_status kiln__mm_wide(const kiln__kargs *a) {
  kiln__kargs k = *a;
  void *tmp[2] = {NULL, NULL};
  kiln_status st = KILN_OK;
  for (int i = 0; i < 2 && st == KILN_OK; i++) {
    const kiln__view *v = &a->in[i];
    int64_t n = kiln__view_numel(v);
    tmp[i] = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!tmp[i]) {
      st = kiln_set_error(KILN_ERR_OOM, "kiln_matmul: out of host memory for a widened operand");
      break;
    }
    kiln__kargs c = {0};
    c.op = KILN__K_COPY;
    c.n_in = c.n_out = 1;
    c.in[0] = *v;
    c.out[0] = *v;
    c.out[0].data = tmp[i];
    c.out[0].dtype = KILN_F32;
    int64_t run = 1; /* contiguous strides */
    for (int d = v->ndim - 1; d >= 0; d--) {
      c.out[0].strides[d] = run;
      run *= v->shape[d] > 0 ? v->shape[d] : 1;
    }
    st = kiln__cpu_copy(&c);
    k.in[i] = c.out[0];
  }
  if (st == KILN_OK) st = kiln__cpu_matmul(&k);
  free(tmp[0]);
  free(tmp[1]);
  return st;
}

kiln_status kiln__cpu_matmul(const kiln__kargs *a) {
  const kiln__view *A = &a->in[0], *B = &a->in[1], *C = &a->out[0];
  if (a->i[1] & 3) return kiln__mm_flags(a);
#ifdef KILN_HAVE_DNNL
  { /* bf16 products on oneDNN (AMX where the CPU has it), f32-accumulated */
    kiln_status st;
    if (kiln__cpu_dnnl_matmul(a, &st)) return st;
    /* dW = g^T x with the bias gradient's row sums (autocast: bf16 in, f32 out): the
    ** product on oneDNN, the row sums by SUM (f64 accumulation) from the bf16 rows */
    if (a->n_out == 2 && C->ndim == 2 && a->out[1].ndim == 1 && a->out[1].shape[0] == C->shape[0] &&
        a->out[1].dtype == C->dtype) {
      kiln__kargs one = *a;
      one.n_out = 1;
      if (kiln__cpu_dnnl_matmul(&one, &st)) return st == KILN_OK ? kiln__mm_row_sums(A, &a->out[1]) : st;
    }
  }
#endif
  if (C->dtype == KILN_F32 && A->dtype == B->dtype && (A->dtype == KILN_F16 || A->dtype == KILN_BF16) &&
      !kiln__mm_bias(a))
    return kiln__mm_wide(a);
  if (a->n_out > 1) {
    if (C->ndim != 2 || a->out[1].ndim != 1 || a->out[1].shape[0] != C->shape[0] || a->out[1].dtype != C->dtype)
      return kiln_set_error(KILN_ERR_SHAPE, "kiln_matmul: row sums want a 2-d product and an (M) output of its dtype");
    kiln__kargs one = *a;
    one.n_out = 1;
    kiln_status st = kiln__cpu_matmul(&one);
    return st == KILN_OK ? kiln__mm_row_sums(A, &a->out[1]) : st;
  }
  int nd = C->ndim;
  if (nd < 2 || A->ndim != nd || B->ndim != nd)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_matmul: operands must have the same ndim >= 2 (got %d, %d, %d)",
                          A->ndim, B->ndim, nd);
  kiln_dtype dt = C->dtype;
  if (!kiln__cpu_is_float(dt)) return kiln__cpu_dtype_error(a, dt);
  if (A->dtype != dt || B->dtype != dt || (kiln__mm_bias(a) && kiln__mm_bias(a)->dtype != dt))
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_matmul: dtypes %s @ %s -> %s differ", kiln_dtype_name(A->dtype),
                          kiln_dtype_name(B->dtype), kiln_dtype_name(dt));
  kiln__mm_job j;
  memset(&j, 0, sizeof j);
  j.a = a;
  j.dt = dt;
  j.M = C->shape[nd - 2];
  j.N = C->shape[nd - 1];
  j.K = A->shape[nd - 1];
  if (A->shape[nd - 2] != j.M || B->shape[nd - 2] != j.K || B->shape[nd - 1] != j.N)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_matmul: (%lld, %lld) @ (%lld, %lld) -> (%lld, %lld) do not match",
                          (long long)A->shape[nd - 2], (long long)j.K, (long long)B->shape[nd - 2],
                          (long long)B->shape[nd - 1], (long long)j.M, (long long)j.N);
  j.nb = nd - 2;
  j.nbatch = 1;
  for (int d = 0; d < j.nb; d++) {
    if (A->shape[d] != C->shape[d] || B->shape[d] != C->shape[d])
      return kiln_set_error(KILN_ERR_SHAPE, "kiln_matmul: batch dim %d differs (%lld, %lld, %lld)", d,
                            (long long)A->shape[d], (long long)B->shape[d], (long long)C->shape[d]);
    j.bshape[d] = C->shape[d];
    j.nbatch *= C->shape[d];
  }
  if (j.nbatch == 0 || j.M == 0 || j.N == 0) return KILN_OK;
  if ((j.M * j.N > INT32_MAX || j.M * j.K > INT32_MAX || j.K * j.N > INT32_MAX))
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_matmul: matrices over 2^31 elements are not supported on cpu");
  j.am = A->strides[nd - 2];
  j.ak = A->strides[nd - 1];
  j.bk = B->strides[nd - 2];
  j.bn = B->strides[nd - 1];
  j.cm = C->strides[nd - 2];
  j.cn = C->strides[nd - 1];

  /* bias, converted once to a contiguous vector of the compute type */
  _Alignas(64) double bias_stack[512];
  void *bias_heap = NULL;
  if (kiln__mm_bias(a)) {
    const kiln__view *bv = kiln__mm_bias(a);
    kiln_dtype bct = dt == KILN_F64 ? KILN_F64 : KILN_F32;
    void *dst = bias_stack;
    if (j.N > 512) {
      dst = bias_heap = malloc(sizeof(double) * (size_t)j.N);
      if (!dst) return kiln_set_error(KILN_ERR_OOM, "kiln_matmul: out of host memory for the bias");
    }
    kiln__cpu_load(dst, bct, (const char *)bv->data, bv->strides[bv->ndim - 1] * (int64_t)kiln__cpu_esize(dt), dt,
                   j.N);
    j.bias = dst;
  }

  kiln_status st = KILN_OK;
  bool half = dt == KILN_F16 || dt == KILN_BF16;
  kiln__blas_sync_threads(j.M * j.N * j.K * (j.nbatch > 0 ? j.nbatch : 1));
  /* fold the batch into M when B is shared and A's/out0's (batch..., M) dims merge */
  bool fold = false;
  if (j.nb > 0 && j.nbatch > 1) {
    bool shared = true;
    for (int d = 0; d < j.nb; d++)
      if (B->strides[d] != 0 && B->shape[d] != 1) shared = false;
    if (shared) {
      kiln__view fv[2] = {*A, *C};
      for (int i = 0; i < 2; i++) fv[i].ndim = nd - 1;
      fv[0].shape[nd - 2] = fv[1].shape[nd - 2] = j.M;
      if (kiln__views_coalesce(fv, 2) == 1) {
        fold = true;
        int64_t Mt = fv[0].shape[0];
        j.am = fv[0].strides[0];
        j.cm = fv[1].strides[0];
        int rc;
        if (half) {
          float *ta = (float *)malloc(sizeof(float) * (size_t)(Mt * j.K + 1));
          float *tb = (float *)malloc(sizeof(float) * (size_t)(j.K * j.N + 1));
          float *tc = (float *)malloc(sizeof(float) * (size_t)(Mt * j.N + 1));
          rc = (ta && tb && tc) ? kiln__mm_one_half(&j, Mt, (const char *)A->data, (const char *)B->data,
                                                    (char *)C->data, ta, tb, tc)
                                : -1;
          free(ta);
          free(tb);
          free(tc);
        } else {
          rc = kiln__mm_one(&j, Mt, (const char *)A->data, (const char *)B->data, (char *)C->data);
        }
        if (rc) j.failed = 1;
      }
    }
  }
  if (!fold) {
    kiln__mm_bjob bj = {&j, A, B, C};
    bool small = (double)j.M * (double)j.N * (double)j.K < KILN__MM_PAR_FLOPS;
    bool par = small && j.nbatch > 1 && (double)j.nbatch * j.M * j.N * j.K >= KILN__MM_PAR_FLOPS;
#ifdef KILN_HAVE_CBLAS
    /* concurrent calls into the BLAS may serialize or oversubscribe its own threads */
    par = false;
#endif
    kiln__cpu_parallel_for(j.nbatch, par ? 1 : INT64_MAX, kiln__mm_batch_range, &bj);
  }
  if (j.failed) st = kiln_set_error(KILN_ERR_OOM, "kiln_matmul: out of host memory for temporaries");
  free(bias_heap);
  return st;
}

/* For kernels that run their own parallel loops (attention): one f32 GEMM on row-major
** operands, C = alpha op(A) op(B) + beta C, run on the calling thread when it is inside
** kiln's pool (the BLAS split and kiln's are skipped there). Call kiln__cpu_blas_serial()
** once before the parallel loop so that the BLAS does not start its own threads under it. */
int kiln__cpu_sgemm(int ta, int tb, int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                    const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  return kiln__gemm_f32(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}
void kiln__cpu_blas_serial(void) { kiln__blas_sync_threads(0); }

