/*
** bf16 scaled_dot_product_attention with its products on AVX512-BF16's dot-product
** instruction (vdpbf16ps: in each of 16 f32 lanes, two bf16 products added to the lane),
** for CPUs that have it and no AMX: AMD Zen 4 and 5, Intel Cooper Lake. On those,
** oneDNN's batched matmuls (kiln__attb_run in cpu_transformer.c, which stays the path where
** the CPU has AMX tiles) compute every pair's whole Tq x Tk scores, the masked half of a
** causal call included, in products too small for its kernels: a GPT's T 256 causal
** attention ran at about a third of the rate of its linear layers (bench/RESULTS.md).
**
** Here each (b, h) goes in blocks of 64 query rows (fewer where the keys are many: a
** block's scores stay near ATTV_BLOCK_BYTES), each block against the keys it sees
** (under the causal mask, keys up to its last row): the same arithmetic as kiln__attb_run,
**   forward   S = scale Q K^T (f32), the row pass (P = bf16(softmax), lse), O = P V;
**   backward  S and dP = dO V^T (f32), the row pass (P and dS = bf16(P (dP - delta) scale)),
**             dQ = dS K, and dK += dS^T Q, dV += P^T dO summed in f32 over the blocks and
**             rounded once;
** with the same row passes (cpu_attention_rows.c). Only the order of the f32
** sums differs from oneDNN's (pairs of products, in key order), so results agree with
** that path to the last f32 bits before the bf16 rounding, and both are held to the f64
** reference by test_ops_transformer.
**
** The products: C (rows x 64 columns, f32 in 24 registers for 6 rows) += A B, where one
** step broadcasts a pair of A's bf16 values (32 bits, read in place) and loads 64 columns
** of B for that pair of reduction steps as two bf16 each ("VNNI" layout [k/2][64][2],
** packed once per (b, h) for K, V, Q and dO, per block for P and dS). A rows come from Q
** and dO's views as they are (the head dim contiguous), from the row pass's P and dS, and
** for dK, dV from P and dS with pairs of rows interleaved ([i/2][j][2]: A's rows are then
** the keys j). Work is split over (b, h) pairs (the forward: pairs and blocks), one
** thread's packs and buffers each.
*/
#include "cpu.h"
#include "cpu_iter.h"
#include "cpu_avx512.h"
#include "../../core/kiln_int.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

#define ATTV_BQ 64    /* query rows a block, at most */
/* A block's f32 scores (S, and dP in the backward) at most about this many bytes: past
** ~16,000 keys blocks get fewer rows (16 at least), as the oneDNN path's do. */
#define ATTV_BLOCK_BYTES ((int64_t)8 << 20)
#define ATTV_NT 64    /* columns of a packed tile (four 16-lane registers) */
#define ATTV_MAXD 256 /* head dims taken */

/* AMX tiles (CPUID.7.0:EDX bit 24, AMX-TILE, with bit 22, AMX-BF16): oneDNN's kernels
** then beat these by far (kiln__attb_run stays). */
static bool attv_cpu_has_amx(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return (d >> 24 & 1) && (d >> 22 & 1);
#else
  return false;
#endif
}

bool kiln__cpu_attv_takes(const kiln__kargs *a) {
#ifdef KILN__AVX512
  static int cpu_ok = -1;
  if (cpu_ok < 0) cpu_ok = kiln__avx512bf16_ok() && !attv_cpu_has_amx();
  /* the switches read at each call, so that bench-attention compares the paths in one run;
  ** KILN_ATTENTION_BF16=0 sends bf16 to the f32 blocks whichever path would take it */
  if (!cpu_ok || !kiln__knob_on("KILN_ATTENTION_VNNI", true) || !kiln__knob_on("KILN_ATTENTION_BF16", true) ||
      (a->i[0] & 2) || a->s[1] > 0)
    return false;
  const bool bw = a->op == KILN__K_ATTENTION_BACKWARD;
  const int nin = bw ? 4 : 3, nout = bw ? 3 : 1;
  for (int i = 0; i < nin; i++)
    if (a->in[i].dtype != KILN_BF16 || a->in[i].ndim != 4 || a->in[i].strides[3] != 1) return false;
  for (int i = 0; i < nout; i++)
    if (a->out[i].dtype != KILN_BF16 || a->out[i].ndim != 4 || a->out[i].strides[3] != 1) return false;
  /* k's and v's rows are gathered 16 at a time with 32-bit offsets (attv_pack_cols) */
  for (int i = 1; i <= 2; i++)
    if (a->in[i].strides[2] > ((int64_t)1 << 26) || a->in[i].strides[2] < -((int64_t)1 << 26)) return false;
  const int64_t Tq = a->in[0].shape[2], Tk = a->in[1].shape[2], D = a->in[0].shape[3], Dv = a->in[2].shape[3];
  /* even head dims: A's pairs are read in place; 16 query rows or more: a decode step's one
  ** row would pack every key for one product */
  return Tq >= 16 && Tk > 0 && D > 0 && Dv > 0 && D % 2 == 0 && Dv % 2 == 0 && D <= ATTV_MAXD && Dv <= ATTV_MAXD;
#else
  (void)a;
  return false;
#endif
}

#ifdef KILN__AVX512
static char *attv_row(const kiln__view *v, int64_t b, int64_t h, int64_t t) {
  return (char *)v->data + (b * v->strides[0] + h * v->strides[1] + t * v->strides[2]) * 2;
}

/* lse[b, h, i] of the forward's (B, H, Tq) statistics */
static char *attv_lse(const kiln__view *v, int64_t b, int64_t h, int64_t i) {
  return (char *)v->data + (b * v->strides[0] + h * v->strides[1] + i * v->strides[2]) * (int64_t)kiln__cpu_esize(v->dtype);
}

/* The columns [16q, 16q + 16) of a tile that are below ncols. */
static inline __mmask16 attv_colmask(int q, int ncols) {
  int n = ncols - 16 * q;
  return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : kiln__mask16(n);
}

enum { ATTV_F32 = 0, ATTV_F32_ADD = 1, ATTV_BF16 = 2 };

/* C (MR rows x ncols <= 16 NQ, row stride ldc) = s sum_{p < kp} A_r[p] . B[p]: A_r[p] the two
** bf16 at A + r ars + p aps, B[p] 64 pairs at B + 128 p (of which NQ 16-column quarters are
** read). mode: f32 stored, f32 added to C, or rounded to bf16 and stored. */
#define ATTV_UKR(MR, NQ)                                                                                    \
  KILN__T512BF static void attv_ukr##MR##_##NQ(const uint16_t *A, int64_t ars, int64_t aps, const uint16_t *B, \
                                              int64_t kp, void *C, int64_t ldc, int mode, float s, int ncols) { \
    __m512 c[MR][NQ];                                                                                       \
    for (int r = 0; r < MR; r++)                                                                            \
      for (int q = 0; q < NQ; q++) c[r][q] = _mm512_setzero_ps();                                           \
    for (int64_t p = 0; p < kp; p++) {                                                                      \
      __m512bh bv[NQ];                                                                                      \
      for (int q = 0; q < NQ; q++) bv[q] = (__m512bh)_mm512_loadu_si512(B + p * 128 + 32 * q);              \
      for (int r = 0; r < MR; r++) {                                                                        \
        int32_t w;                                                                                          \
        memcpy(&w, A + r * ars + p * aps, 4);                                                               \
        __m512bh av = (__m512bh)_mm512_set1_epi32(w);                                                       \
        for (int q = 0; q < NQ; q++) c[r][q] = _mm512_dpbf16_ps(c[r][q], av, bv[q]);                        \
      }                                                                                                     \
    }                                                                                                       \
    const __m512 sv = _mm512_set1_ps(s);                                                                    \
    for (int r = 0; r < MR; r++)                                                                            \
      for (int q = 0; q < NQ; q++) {                                                                        \
        __mmask16 k = attv_colmask(q, ncols);                                                               \
        if (!k) break;                                                                                      \
        __m512 v = _mm512_mul_ps(c[r][q], sv);                                                              \
        if (mode == ATTV_BF16) {                                                                            \
          kiln__store16_bf16cvt((uint16_t *)C + r * ldc + 16 * q, v, k);                                    \
        } else {                                                                                            \
          float *o = (float *)C + r * ldc + 16 * q;                                                         \
          if (mode == ATTV_F32_ADD) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, o));                      \
          _mm512_mask_storeu_ps(o, k, v);                                                                   \
        }                                                                                                   \
      }                                                                                                     \
  }
#define ATTV_UKR_NQ(MR) ATTV_UKR(MR, 1) ATTV_UKR(MR, 2) ATTV_UKR(MR, 3) ATTV_UKR(MR, 4)
ATTV_UKR_NQ(6)
ATTV_UKR_NQ(4)
ATTV_UKR_NQ(2)
ATTV_UKR_NQ(1)

typedef void (*attv_ukr_fn)(const uint16_t *, int64_t, int64_t, const uint16_t *, int64_t, void *, int64_t, int, float,
                            int);
#define ATTV_UKR_ROW(MR) {attv_ukr##MR##_1, attv_ukr##MR##_2, attv_ukr##MR##_3, attv_ukr##MR##_4}
static const attv_ukr_fn attv_ukrs[4][4] = {ATTV_UKR_ROW(6), ATTV_UKR_ROW(4), ATTV_UKR_ROW(2), ATTV_UKR_ROW(1)};

/* What the causal mask lets a product skip, row by row of C (only zeros are skipped: the
** sums keep their bits):
**   ATTV_COLS   (S, dP: columns are keys) row r needs columns < off + r + 1;
**   ATTV_SUMS   (O, dQ: the sum runs over keys) row r needs pairs < ceil((off + r + 1) / 2);
**   ATTV_FROM   (dV, dK: rows are keys, the sum runs over query rows) row r needs pairs from
**               (off + r) / 2 on (off: the first row's key less the block's first query row). */
enum { ATTV_ALL = 0, ATTV_COLS, ATTV_SUMS, ATTV_FROM };

/* C (M x N) = s A B for A's M rows (addressing as the kernel's) and B packed in tiles of 64
** columns, tile t at B + t bts; C's element size by mode; tri and off as above. */
KILN__T512BF static void attv_gemm(const uint16_t *A, int64_t ars, int64_t aps, int64_t M, const uint16_t *B,
                                   int64_t bts, int64_t kp, int64_t N, void *C, int64_t ldc, int mode, float s,
                                   int tri, int64_t off) {
  const int64_t es = mode == ATTV_BF16 ? 2 : 4;
  for (int64_t t = 0; t * ATTV_NT < N; t++) {
    const uint16_t *Bt = B + t * bts;
    char *Ct = (char *)C + t * ATTV_NT * es;
    const int64_t nct = N - t * ATTV_NT < ATTV_NT ? N - t * ATTV_NT : ATTV_NT;
    for (int64_t r = 0; r < M;) {
      static const int mrs[4] = {6, 4, 2, 1};
      const int mi = M - r >= 6 ? 0 : M - r >= 4 ? 1 : M - r >= 2 ? 2 : 3, mr = mrs[mi];
      int64_t nc = nct, p0 = 0, p1 = kp;
      if (tri == ATTV_COLS) {
        int64_t need = off + r + mr - t * ATTV_NT; /* columns of this tile the group's last row sees */
        nc = need < nc ? need : nc;
      } else if (tri == ATTV_SUMS) {
        int64_t need = (off + r + mr + 1) / 2;
        p1 = need < kp ? need : kp;
      } else if (tri == ATTV_FROM) {
        int64_t from = (off + r) / 2;
        p0 = from < 0 ? 0 : from > kp ? kp : from;
      }
      if (nc > 0) /* (none: columns no row of the group sees, which nothing reads) */
        attv_ukrs[mi][(nc + 15) / 16 - 1](A + r * ars + p0 * aps, ars, aps, Bt + p0 * 128, p1 - p0, Ct + r * ldc * es,
                                           ldc, mode, s, (int)nc);
      r += mr;
    }
  }
}

/* Rows [0, n) of X (cols wide, row stride rs elements) as B for a product that sums over
** them: tiles of 64 columns, tile t at out + t kp 128 ([kp][64][2], kp = ceil(n / 2)),
** pair p holding rows 2p and 2p + 1; row n (n odd) and columns cols .. 64 t are 0. */
KILN__T512BF static void attv_pack_rows(const uint16_t *X, int64_t rs, int64_t n, int64_t cols, uint16_t *out) {
  const int64_t kp = (n + 1) / 2;
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                      37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24, 55, 23, 54,
                                      22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
  for (int64_t t = 0; t * ATTV_NT < cols; t++)
    for (int64_t p = 0; p < kp; p++) {
      uint16_t *o = out + (t * kp + p) * 128;
      for (int64_t c0 = t * ATTV_NT; c0 < (t + 1) * ATTV_NT; c0 += 32, o += 64) {
        int64_t left = cols - c0;
        __mmask32 k = left >= 32 ? (__mmask32)0xFFFFFFFFu : left <= 0 ? (__mmask32)0 : (__mmask32)((1u << left) - 1u);
        __m512i r0 = 2 * p < n ? _mm512_maskz_loadu_epi16(k, X + 2 * p * rs + c0) : _mm512_setzero_si512();
        __m512i r1 = 2 * p + 1 < n ? _mm512_maskz_loadu_epi16(k, X + (2 * p + 1) * rs + c0) : _mm512_setzero_si512();
        _mm512_storeu_si512(o, _mm512_permutex2var_epi16(r0, lo, r1));
        _mm512_storeu_si512(o + 32, _mm512_permutex2var_epi16(r0, hi, r1));
      }
    }
}

/* Rows [0, n) of X (cols wide, cols even) as B for a product with X^T, summing over X's
** columns: tiles of 64 rows of X, tile t at out + t kp 128 ([kp][64][2], kp = cols / 2),
** element pair (p, j) = X[64 t + j][2p, 2p + 1]; rows n .. 64 t are 0. A transpose of
** 32-bit pairs: 16 rows' pair p by one gather. */
KILN__T512BF static void attv_pack_cols(const uint16_t *X, int64_t rs, int64_t n, int64_t cols, uint16_t *out) {
  const int64_t kp = cols / 2, nt = (n + ATTV_NT - 1) / ATTV_NT;
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32((int)rs)); /* element offsets; 2-byte scale */
  for (int64_t t = 0; t < nt; t++)
    for (int64_t j0 = 0; j0 < ATTV_NT; j0 += 16) {
      const int64_t left = n - t * ATTV_NT - j0;
      const __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : kiln__mask16(left);
      const uint16_t *x = X + (t * ATTV_NT + j0) * rs;
      uint16_t *o = out + t * kp * 128 + 2 * j0;
      for (int64_t p = 0; p < kp; p++, o += 128)
        _mm512_storeu_si512(o, k ? _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), k, rows, x + 2 * p, 2)
                                 : _mm512_setzero_si512());
    }
}

typedef struct attv {
  const kiln__kargs *a;
  int64_t H, Tq, Tk, D, Dv, nqb, bq; /* bq: query rows a block */
  float scale;
  bool causal, failed;
} attv;

/* keys query rows [i0, i1) see; keys row i sees */
static int64_t attv_kend(const attv *c, int64_t i1) { return c->causal && i1 < c->Tk ? i1 : c->Tk; }
static int64_t attv_nvalid(const attv *c, int64_t i) { return c->causal && i + 1 < c->Tk ? i + 1 : c->Tk; }
static int64_t attv_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

/* Items (b, h, block of query rows); per thread the K^T tiles and V in pairs of keys of the
** item's (b, h), packed when it changes, S (f32) and P of a block. */
KILN__T512BF static void attv_fwd_range(void *vctx, int64_t lo, int64_t hi) {
  attv *c = vctx;
  const kiln__kargs *a = c->a;
  const int64_t D = c->D, Dv = c->Dv, Tk = c->Tk, Tkp = attv_up(Tk, ATTV_NT), w = Tkp;
  const int64_t kpk = attv_up(Tk, 2) / 2, vts = kpk * 128, kts = D / 2 * 128;
  size_t nb = (size_t)(Tkp * D + attv_up(Dv, ATTV_NT) * 2 * kpk + c->bq * w) * 2 + (size_t)(c->bq * w) * 4;
  char *buf = kiln__cpu_alloc(0, nb);
  if (!buf) {
    c->failed = true;
    return;
  }
  float *S = (float *)buf;
  uint16_t *KT = (uint16_t *)(S + c->bq * w), *Vp = KT + Tkp * D, *P = Vp + attv_up(Dv, ATTV_NT) * 2 * kpk;
  const int cols = c->causal ? ATTV_COLS : ATTV_ALL, sums = c->causal ? ATTV_SUMS : ATTV_ALL;
  int64_t packed = -1; /* the (b, h) whose K and V are in KT, Vp */
  for (int64_t it = lo; it < hi; it++) {
    const int64_t bh = it / c->nqb, i0 = (it % c->nqb) * c->bq, b = bh / c->H, h = bh % c->H;
    const int64_t bq = c->Tq - i0 < c->bq ? c->Tq - i0 : c->bq, kv = attv_kend(c, i0 + bq);
    if (packed != bh) {
      attv_pack_cols((const uint16_t *)attv_row(&a->in[1], b, h, 0), a->in[1].strides[2], Tk, D, KT);
      attv_pack_rows((const uint16_t *)attv_row(&a->in[2], b, h, 0), a->in[2].strides[2], Tk, Dv, Vp);
      packed = bh;
    }
    /* kv >= 1: the path is taken only with keys (kiln__cpu_attv_takes) */
    const uint16_t *Q = (const uint16_t *)attv_row(&a->in[0], b, h, i0);
    attv_gemm(Q, a->in[0].strides[2], 2, bq, KT, kts, D / 2, kv, S, w, ATTV_F32, c->scale, cols, i0);
    const int64_t kw = attv_up(kv, 32); /* P's columns the product reads (zeros past a row's keys) */
    for (int64_t r = 0; r < bq; r++)
      kiln__cpu_set_f64(attv_lse(&a->out[1], b, h, i0 + r), a->out[1].dtype,
                        (double)kiln__attb_row_forward(S + r * w, P + r * w, attv_nvalid(c, i0 + r), kw));
    attv_gemm(P, w, 2, bq, Vp, vts, attv_up(kv, 2) / 2, Dv, attv_row(&a->out[0], b, h, i0), a->out[0].strides[2],
              ATTV_BF16, 1.0f, sums, i0);
  }
  kiln__cpu_free(0, buf, nb);
}
/* One (b, h) per item: its dQ rows block by block, dK and dV summed over the blocks in f32. */
KILN__T512BF static void attv_bwd_range(void *vctx, int64_t lo, int64_t hi) {
  attv *c = vctx;
  const kiln__kargs *a = c->a;
  const int64_t D = c->D, Dv = c->Dv, Tq = c->Tq, Tk = c->Tk, Tkp = attv_up(Tk, ATTV_NT), w = Tkp;
  const int64_t kpk = attv_up(Tk, 2) / 2, kpq = attv_up(Tq, 2) / 2, D64 = attv_up(D, ATTV_NT), Dv64 = attv_up(Dv, ATTV_NT);
  /* K^T and V^T tiles (S, dP), K in pairs of keys (dQ), Q and dO in pairs of query rows
  ** (dK, dV), S and dP, P and dS, their row-pair interleaves, and the f32 dK, dV */
  const int64_t nkt = Tkp * D, nvt = Tkp * Dv, nkp = D64 * 2 * kpk, nqp = D64 * 2 * kpq, ngp = Dv64 * 2 * kpq;
  const int64_t nsw = c->bq * w;
  size_t nb = (size_t)(2 * nsw + Tk * (D + Dv)) * 4 + (size_t)(nkt + nvt + nkp + nqp + ngp + 4 * nsw) * 2;
  char *buf = kiln__cpu_alloc(0, nb);
  if (!buf) {
    c->failed = true;
    return;
  }
  float *S = (float *)buf, *dP = S + nsw, *dK = dP + nsw, *dV = dK + Tk * D;
  uint16_t *KT = (uint16_t *)(dV + Tk * Dv), *VT = KT + nkt, *Kp = VT + nvt, *Qp = Kp + nkp, *Gp = Qp + nqp;
  uint16_t *P = Gp + ngp, *dS = P + nsw, *Pi = dS + nsw, *dSi = Pi + nsw;
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2], *g = &a->in[3];
  const int cols = c->causal ? ATTV_COLS : ATTV_ALL, sums = c->causal ? ATTV_SUMS : ATTV_ALL;
  const int from = c->causal ? ATTV_FROM : ATTV_ALL;
  for (int64_t bh = lo; bh < hi; bh++) {
    const int64_t b = bh / c->H, h = bh % c->H;
    const uint16_t *Q0 = (const uint16_t *)attv_row(q, b, h, 0), *K0 = (const uint16_t *)attv_row(k, b, h, 0);
    const uint16_t *V0 = (const uint16_t *)attv_row(v, b, h, 0), *G0 = (const uint16_t *)attv_row(g, b, h, 0);
    attv_pack_cols(K0, k->strides[2], Tk, D, KT);
    attv_pack_cols(V0, v->strides[2], Tk, Dv, VT);
    attv_pack_rows(K0, k->strides[2], Tk, D, Kp);
    attv_pack_rows(Q0, q->strides[2], Tq, D, Qp);
    attv_pack_rows(G0, g->strides[2], Tq, Dv, Gp);
    memset(dK, 0, sizeof(float) * (size_t)(Tk * (D + Dv)));
    for (int64_t i0 = 0; i0 < Tq; i0 += c->bq) {
      const int64_t bq = Tq - i0 < c->bq ? Tq - i0 : c->bq, kv = attv_kend(c, i0 + bq), kw = attv_up(kv, 32);
      const int64_t kpb = (bq + 1) / 2;
      uint16_t *dQ = (uint16_t *)attv_row(&a->out[0], b, h, i0);
      const int64_t dqs = a->out[0].strides[2];
      attv_gemm(Q0 + i0 * q->strides[2], q->strides[2], 2, bq, KT, D / 2 * 128, D / 2, kv, S, w, ATTV_F32, c->scale,
                cols, i0);
      attv_gemm(G0 + i0 * g->strides[2], g->strides[2], 2, bq, VT, Dv / 2 * 128, Dv / 2, kv, dP, w, ATTV_F32, 1.0f,
                cols, i0);
      for (int64_t r = 0; r < bq; r++) {
        float lse = (float)kiln__cpu_get_f64(attv_lse(&a->out[3], b, h, i0 + r), a->out[3].dtype);
        kiln__attb_row_backward(S + r * w, dP + r * w, P + r * w, dS + r * w, attv_nvalid(c, i0 + r), kw, lse,
                                c->scale);
      }
      attv_gemm(dS, w, 2, bq, Kp, kpk * 128, attv_up(kv, 2) / 2, D, dQ, dqs, ATTV_BF16, 1.0f, sums, i0);
      /* dV += P^T dO and dK += dS^T Q: A's rows are the keys, 64 at a time from the interleaves */
      attv_pack_rows(P, w, bq, kv, Pi);
      attv_pack_rows(dS, w, bq, kv, dSi);
      for (int64_t t = 0; t * ATTV_NT < kv; t++) {
        const int64_t m = kv - t * ATTV_NT < ATTV_NT ? kv - t * ATTV_NT : ATTV_NT;
        attv_gemm(Pi + t * kpb * 128, 2, 128, m, Gp + i0 / 2 * 128, kpq * 128, kpb, Dv, dV + t * ATTV_NT * Dv, Dv,
                  ATTV_F32_ADD, 1.0f, from, t * ATTV_NT - i0);
        attv_gemm(dSi + t * kpb * 128, 2, 128, m, Qp + i0 / 2 * 128, kpq * 128, kpb, D, dK + t * ATTV_NT * D, D,
                  ATTV_F32_ADD, 1.0f, from, t * ATTV_NT - i0);
      }
    }
    for (int64_t j = 0; j < Tk; j++) {
      kiln__cpu_store(attv_row(&a->out[1], b, h, j), 2, KILN_BF16, dK + j * D, KILN_F32, D);
      kiln__cpu_store(attv_row(&a->out[2], b, h, j), 2, KILN_BF16, dV + j * Dv, KILN_F32, Dv);
    }
  }
  kiln__cpu_free(0, buf, nb);
}
#endif /* KILN__AVX512 */

kiln_status kiln__cpu_attv_run(const kiln__kargs *a) {
  const bool bw = a->op == KILN__K_ATTENTION_BACKWARD;
  const char *name = bw ? "kiln_scaled_dot_product_attention (backward)" : "kiln_scaled_dot_product_attention";
#ifdef KILN__AVX512
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2];
  attv c = {.a = a, .H = q->shape[1], .Tq = q->shape[2], .Tk = k->shape[2], .D = q->shape[3], .Dv = v->shape[3],
            .scale = (float)a->s[0], .causal = (a->i[0] & 1) != 0};
  const int64_t BH = q->shape[0] * c.H;
  c.bq = ATTV_BLOCK_BYTES / (attv_up(c.Tk, ATTV_NT) * 8) / 16 * 16; /* S and dP */
  c.bq = c.bq < 16 ? 16 : c.bq > ATTV_BQ ? ATTV_BQ : c.bq;
  c.nqb = (c.Tq + c.bq - 1) / c.bq;
  if (BH == 0) return KILN_OK;
  const int64_t work = BH * c.Tq * c.Tk * (c.D + c.Dv);
  const int64_t par = work < KILN__CPU_PAR_MIN ? INT64_MAX : 1;
  if (bw)
    kiln__cpu_parallel_for(BH, par, attv_bwd_range, &c);
  else
    kiln__cpu_parallel_for(BH * c.nqb, par, attv_fwd_range, &c);
  if (c.failed)
    return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory (B*H %lld, Tq %lld, Tk %lld, D %lld)", name,
                          (long long)BH, (long long)c.Tq, (long long)c.Tk, (long long)c.D);
  return KILN_OK;
#else
  return kiln_set_error(KILN_ERR_UNSUPPORTED, "%s: no AVX512-BF16 path in this build", name);
#endif
}
