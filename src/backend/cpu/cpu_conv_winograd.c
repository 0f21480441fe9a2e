/*
** f32 3x3 stride-1 convolutions on the CPU by Winograd's F(2x2, 3x3) (Lavin and Gray,
** "Fast Algorithms for Convolutional Neural Networks", 2015): CONV2D and
** CONV2D_BACKWARD_DATA for the cases kiln__cpu_conv_winograd_takes names, on AVX2+FMA.
**
** Each 2x2 block of outputs ("tile") of an output plane is Y = A^T [sum_c (G g G^T) o
** (B^T d B)] A, d the tile's 4x4 input patch in channel c, g the 3x3 weight of (oc, c), o
** the elementwise product: 16 multiplies per (tile, oc, c) instead of the direct sum's 36.
** So the work is 16 independent GEMMs, M[xi] (OC, tiles) = U[xi] (OC, C) V[xi] (C, tiles),
** one per element xi of the 4x4 transformed tile, between the transforms of the input (V)
** and of the output (Y from M). Backward data of a stride-1 convolution is the same
** convolution of the output gradient, padded by 2 - padding, with the weights turned by
** 180 degrees and their in/out channels swapped: the same engine with another weight
** transform.
**
** Cache: the tile-rows of all images are cut into blocks of ~64 tiles. A thread takes
** a block, transforms its input into V (C, 16, tiles), then for each group of 16 output
** channels runs the 16 GEMMs into M (16, 16, tiles), xi outermost so that V's slice for xi
** stays in L1 through the group, and transforms M straight into the NCHW output (bias added
** there). U (16, OC/4, C, 4), transformed once a call (the weights change every step), V
** and M stay in L2. The GEMM micro-kernel holds 4 output channels x 24 tiles in 12 ymm
** accumulators and sums over c in order with FMA, so every output is the same f32
** operations whatever the thread count.
**
** Rounding: the transforms' additions (B, A: +-1 entries; G: halves, computed in f64 and
** rounded once) change the rounding from the direct sum's, within ~1e-6 of the output's
** scale (tests/test_cpu_winograd.c checks against f64 loops).
**
** Scratch (U, and V, M and a padded plane per thread) comes from kiln's allocator per call:
** its cache of freed blocks hands the same sizes back each step.
** The dispatch (cpu_conv.c) takes this kernel only where it beat oneDNN (wg_pays);
** KILN_CONV_WINOGRAD=0 turns it off (oneDNN then runs these convolutions); on a CPU with
** AVX-512 it is off unless KILN_CONV_WINOGRAD=1 (wg_mode).
*/
#include "cpu.h"
#include "cpu_avx512.h"
#include "cpu_iter.h"
#include "../../core/kiln_int.h"

#include <stdlib.h>
#include <string.h>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(KILN_NO_TARGET_CLONES)
#include <immintrin.h>
#define WG_X86 1
#endif

/* Tiles a block aims at (V is 16 C 80 floats: 160 KiB at 32 channels), and groups of 4
** output channels a pass over V (M is 16 x 16 x 80 floats, 80 KiB). Measured on Fashion-
** MNIST's conv2 (one thread, Zen 1, forward and backward data): 32 to 96 tiles within the
** noise; one group a pass (V read from L2 by every group) 1.2x slower than four or eight. */
#define WG_TILES 64
#define WG_GROUP 4

/* KILN_CONV_WINOGRAD: "0" never, "1" wherever the rule below holds, unset: so too, but not
** on a CPU with AVX-512, where oneDNN's direct kernels run twice as wide (and it has a
** Winograd kernel of its own, cpu_dnnl.c): the rule was measured against oneDNN's AVX2
** kernels only. Read once (a benign race: every thread stores the same value). */
static int wg_mode(void) {
  static int mode = -1;
  if (mode < 0) {
    mode = kiln__knob_choice("KILN_CONV_WINOGRAD", 2); /* 0, 1, auto */
  }
  return mode;
}

static bool wg_off(void) {
  int m = wg_mode();
#ifdef KILN__AVX512
  if (m == 2 && kiln__avx512_ok()) return true;
#endif
  return m == 0;
}

static bool wg_dense(const kiln__view *v, int ndim) {
  return v->dtype == KILN_F32 && v->ndim == ndim && kiln__view_is_contiguous(v);
}

/* Whether the kernel computes these arguments: CONV2D or CONV2D_BACKWARD_DATA, f32, dense
** NCHW (and a dense bias), ungrouped 3x3, stride and dilation 1, padding 0..2, 8 channels
** or more each side, something to compute, a CPU with AVX2 and FMA. */
static bool wg_supported(const kiln__kargs *a) {
#ifdef WG_X86
  if (a->op != KILN__K_CONV2D && a->op != KILN__K_CONV2D_BACKWARD_DATA) return false;
  if (!a->params || a->n_in < 2 || a->n_out < 1 || a->i[0] != 1) return false;
  bool fwd = a->op == KILN__K_CONV2D;
  if (!wg_dense(&a->in[0], 4) || !wg_dense(&a->in[1], 4) || !wg_dense(&a->out[0], 4)) return false;
  if (fwd && a->n_in > 2 && !wg_dense(&a->in[2], 1)) return false;
  if (!fwd && a->n_in > 2) return false;
  const kiln__conv_params *p = a->params;
  const kiln__view *w = &a->in[1];
  const kiln__view *x = fwd ? &a->in[0] : &a->out[0], *y = fwd ? &a->out[0] : &a->in[0];
  if (w->shape[2] != 3 || w->shape[3] != 3 || w->shape[1] != x->shape[1] || w->shape[0] != y->shape[1] ||
      x->shape[0] != y->shape[0])
    return false;
  for (int d = 0; d < 2; d++)
    if (p->stride[d] != 1 || p->dilation[d] != 1 || p->padding[d] < 0 || p->padding[d] > 2 ||
        y->shape[2 + d] != x->shape[2 + d] + 2 * p->padding[d] - 2)
      return false;
  if (x->shape[1] < 8 || y->shape[1] < 8 || kiln__view_numel(&a->in[0]) == 0 || kiln__view_numel(&a->out[0]) == 0)
    return false;
  return kiln__cpu_has_fma();
#else
  (void)a;
  (void)wg_dense;
  return false;
#endif
}

/* Whether it beats oneDNN on these (supported) arguments: measured on one thread of a Zen 1
** EPYC against oneDNN 2.6's jit:avx2 (direct, or its own F(4x4, 3x3) Winograd on 4x4 to 8x8
** maps), bench/RESULTS.md. It won 1.1-1.9x where the output map (the input gradient's, for
** backward data) has 6 rows and columns or more (8 for backward data, where oneDNN's
** Winograd is the rival) and its 2x2 tiles waste at most a quarter (11x11: 144 computed for
** 121; 5x5 and 7x7, 36/25 and 64/49, lost or tied), and lost with 512x512 channels (U, 16
** MiB, streamed from memory for every block: 0.95x at 14x14). */
static bool wg_pays(const kiln__kargs *a) {
  bool fwd = a->op == KILN__K_CONV2D;
  const kiln__view *o = &a->out[0]; /* the map the transforms produce: y, or dx */
  int64_t OH = o->shape[2], OW = o->shape[3], least = fwd ? 6 : 8;
  int64_t computed = 4 * ((OH + 1) / 2) * ((OW + 1) / 2);
  return OH >= least && OW >= least && 4 * computed <= 5 * OH * OW && a->in[1].shape[0] * a->in[1].shape[1] <= 65536;
}

bool kiln__cpu_conv_winograd_takes(const kiln__kargs *a) {
  return !wg_off() && wg_supported(a) && wg_pays(a) && !kiln__cpu_portable_loops();
}

#ifdef WG_X86

typedef struct wg_job {
  const float *x;    /* the image (N, C, H, W): the input, or the output gradient */
  float *y;          /* (N, OC, OH, OW): the output, or the input gradient */
  const float *bias; /* (OC) or NULL */
  const float *w;    /* the weight as given: (OC, C, 3, 3), or (C, OC, 3, 3) when rot */
  bool rot;          /* backward data: w read turned by 180 degrees, in/out swapped */
  int64_t N, C, H, W, OC, OH, OW, ph, pw;
  int64_t TH, TW;   /* tiles a plane: down, across */
  int64_t R;        /* tile-rows a block */
  int64_t nrows;    /* N * TH */
  int64_t nblk;     /* blocks */
  int64_t nch;      /* 8-tile chunks a tile-row */
  int64_t LD;       /* floats a row of V or M (a block's tiles, rounded, and slack) */
  int64_t RBW;      /* floats a row of the padded plane */
  int64_t OCB;      /* groups of 4 output channels */
  int64_t G;        /* of those, how many a pass over V */
  float *U;         /* (16, OCB, C, 4) */
  float *scratch;   /* per share: V (C, 16, LD), M (16, 4, LD), a padded plane (2 TH + 2, RBW) */
  int64_t share;    /* floats per share */
  int nt;
} wg_job;

static int64_t wg_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

/* U rows for output-channel groups [lo, hi): U[xi][ob][c][o%4] = (G g G^T)[xi], computed in
** f64 and rounded once; zeros for the channels past OC in the last group. */
static void wg_weights_range(void *vctx, int64_t lo, int64_t hi) {
  const wg_job *j = vctx;
  int64_t C = j->C, OC = j->OC, OCB = j->OCB;
  for (int64_t ob = lo; ob < hi; ob++)
    for (int64_t c = 0; c < C; c++)
      for (int64_t r = 0; r < 4; r++) {
        int64_t o = ob * 4 + r;
        double u[16] = {0};
        if (o < OC) {
          double g[3][3], t[4][3];
          for (int i = 0; i < 3; i++)
            for (int jj = 0; jj < 3; jj++)
              g[i][jj] = j->rot ? j->w[((c * OC + o) * 3 + 2 - i) * 3 + 2 - jj] : j->w[((o * C + c) * 3 + i) * 3 + jj];
          for (int jj = 0; jj < 3; jj++) { /* G g: G = [1 0 0; .5 .5 .5; .5 -.5 .5; 0 0 1] */
            t[0][jj] = g[0][jj];
            t[1][jj] = 0.5 * (g[0][jj] + g[1][jj] + g[2][jj]);
            t[2][jj] = 0.5 * (g[0][jj] - g[1][jj] + g[2][jj]);
            t[3][jj] = g[2][jj];
          }
          for (int i = 0; i < 4; i++) { /* (G g) G^T */
            u[i * 4 + 0] = t[i][0];
            u[i * 4 + 1] = 0.5 * (t[i][0] + t[i][1] + t[i][2]);
            u[i * 4 + 2] = 0.5 * (t[i][0] - t[i][1] + t[i][2]);
            u[i * 4 + 3] = t[i][2];
          }
        }
        for (int xi = 0; xi < 16; xi++) j->U[((xi * OCB + ob) * C + c) * 4 + r] = (float)u[xi];
      }
}

/* Image rows [h0, h1) of image n, channel c, into the zero-padded plane pb ((2 TH + 2, RBW):
** pb[h + ph][w + pw] = x[n][c][h][w]). The padding is never written but with zeros: it
** stays the zeros the share's buffer started with. Eight floats a step, the row's tail by a
** masked load whose zero lanes land on the right padding (RBW leaves room for them): a
** libc memcpy per row cost more than the transform on 13-wide rows. */
__attribute__((target("avx2,fma"))) static void wg_copy_rows(const wg_job *j, int64_t n, int64_t c, int64_t h0,
                                                             int64_t h1, float *pb) {
  const float *xp = j->x + (n * j->C + c) * j->H * j->W;
  int64_t W = j->W, full = W / 8 * 8;
  __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(W - full)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int64_t h = h0; h < h1; h++) {
    const float *sr = xp + h * W;
    float *d = pb + (h + j->ph) * j->RBW + j->pw;
    int64_t k = 0;
    for (; k < full; k += 8) _mm256_storeu_ps(d + k, _mm256_loadu_ps(sr + k));
    if (k < W) _mm256_storeu_ps(d + k, _mm256_maskload_ps(sr + k, m));
  }
}

/* Columns k, k+1 of eight tiles from one buffer row (tile t's patch starts at column 2t):
** e lanes t = p[2t], o lanes t = p[2t + 1]. Built from 128-bit loads: a lane-crossing
** shuffle (vperm2f128) is slow on Zen 1. */
__attribute__((target("avx2,fma"))) static inline void wg_deint(const float *p, __m256 *e, __m256 *o) {
  __m256 lo = _mm256_set_m128(_mm_loadu_ps(p + 8), _mm_loadu_ps(p));      /* 0-3, 8-11 */
  __m256 hi = _mm256_set_m128(_mm_loadu_ps(p + 12), _mm_loadu_ps(p + 4)); /* 4-7, 12-15 */
  *e = _mm256_shuffle_ps(lo, hi, 0x88);
  *o = _mm256_shuffle_ps(lo, hi, 0xDD);
}

/* One row of d B for eight tiles (B^T = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]): the row's
** four columns d0..d3 (p[2t + k]) into d0 - d2, d1 + d2, d2 - d1, d1 - d3. */
__attribute__((target("avx2,fma"))) static inline void wg_rowB(const float *p, __m256 e[4]) {
  __m256 d0, d1, d2, d3;
  wg_deint(p, &d0, &d1);
  wg_deint(p + 2, &d2, &d3);
  e[0] = _mm256_sub_ps(d0, d2);
  e[1] = _mm256_add_ps(d1, d2);
  e[2] = _mm256_sub_ps(d2, d1);
  e[3] = _mm256_sub_ps(d1, d3);
}

/* V for the block's tile-rows [r0, r1): V[c][xi][t], t = (row - r0) * TW + tx, as
** B^T (d B), eight tiles a step. A tile-row's last
** step writes eight lanes however many tiles are left: the next tile-row's writes (or the
** slack past the block) take the extra ones. c outermost: one channel's 16 rows of V are
** 16 LD floats in a row, written while they are in L1. */
__attribute__((target("avx2,fma"))) static void wg_input(const wg_job *j, int64_t r0, int64_t r1, float *V, float *pb) {
  int64_t C = j->C, LD = j->LD, TW = j->TW, RBW = j->RBW, TH = j->TH;
  for (int64_t c = 0; c < C; c++)
    for (int64_t ra = r0; ra < r1;) { /* the tile-rows of one image: [ra, rb) */
      int64_t n = ra / TH, rb = (n + 1) * TH < r1 ? (n + 1) * TH : r1;
      int64_t h0 = 2 * (ra - n * TH) - j->ph, h1 = 2 * (rb - 1 - n * TH) - j->ph + 4;
      wg_copy_rows(j, n, c, h0 > 0 ? h0 : 0, h1 < j->H ? h1 : j->H, pb);
      for (int64_t row = ra; row < rb; row++) {
        const float *pr = pb + 2 * (row - n * TH) * RBW;
        float *vb = V + c * 16 * LD + (row - r0) * TW;
        for (int64_t q = 0; q < j->nch; q++) {
          const float *p = pr + 16 * q;
          float *vq = vb + 8 * q;
          /* rows 1 and 2 of d B first, then 0 and 3 one at a time: 13 ymm live, no spills */
          __m256 e1[4], e2[4], e[4];
          wg_rowB(p + RBW, e1);
          wg_rowB(p + 2 * RBW, e2);
          wg_rowB(p, e);
          for (int jj = 0; jj < 4; jj++) _mm256_storeu_ps(vq + jj * LD, _mm256_sub_ps(e[jj], e2[jj]));
          wg_rowB(p + 3 * RBW, e);
          for (int jj = 0; jj < 4; jj++) {
            _mm256_storeu_ps(vq + (12 + jj) * LD, _mm256_sub_ps(e1[jj], e[jj]));
            _mm256_storeu_ps(vq + (4 + jj) * LD, _mm256_add_ps(e1[jj], e2[jj]));
            _mm256_storeu_ps(vq + (8 + jj) * LD, _mm256_sub_ps(e2[jj], e1[jj]));
          }
        }
      }
      ra = rb;
    }
}

/* m (4, ldm) [0, 8 NV) = u (C, 4) v (C, ldv) [0, 8 NV): four output channels by 8 NV tiles
** in 4 NV accumulators, the sum over c in order. Named accumulators, not an array: GCC
** kept an array's copy in memory and stored all twelve every step (bound by the store
** port, 2x slower). */
/* row r's accumulators += u[c][r] * the loaded tiles: one broadcast live at a time (12
** accumulators, 3 tile vectors and it fill the 16 ymm registers) */
#define WG_ROW3(r)                                                                                     \
  do {                                                                                                 \
    __m256 ur = _mm256_broadcast_ss(u + 4 * c + r);                                                    \
    a##r##0 = _mm256_fmadd_ps(ur, v0, a##r##0), a##r##1 = _mm256_fmadd_ps(ur, v1, a##r##1);            \
    a##r##2 = _mm256_fmadd_ps(ur, v2, a##r##2);                                                        \
  } while (0)
#define WG_ROW2(r)                                                                                     \
  do {                                                                                                 \
    __m256 ur = _mm256_broadcast_ss(u + 4 * c + r);                                                    \
    a##r##0 = _mm256_fmadd_ps(ur, v0, a##r##0), a##r##1 = _mm256_fmadd_ps(ur, v1, a##r##1);            \
  } while (0)
#define WG_ROW1(r) a##r##0 = _mm256_fmadd_ps(_mm256_broadcast_ss(u + 4 * c + r), v0, a##r##0)
#define WG_KERN_HEAD(NV)                                                                               \
  __attribute__((target("avx2,fma"))) static void wg_kern##NV(const float *u, const float *v,         \
                                                              int64_t ldv, int64_t C, float *m,       \
                                                              int64_t ldm)
WG_KERN_HEAD(3) {
  __m256 a00 = _mm256_setzero_ps(), a10 = a00, a20 = a00, a30 = a00, a01 = a00, a11 = a00, a21 = a00, a31 = a00;
  __m256 a02 = a00, a12 = a00, a22 = a00, a32 = a00;
  for (int64_t c = 0; c < C; c++) {
    const float *vc = v + c * ldv;
    __m256 v0 = _mm256_loadu_ps(vc), v1 = _mm256_loadu_ps(vc + 8), v2 = _mm256_loadu_ps(vc + 16);
    WG_ROW3(0);
    WG_ROW3(1);
    WG_ROW3(2);
    WG_ROW3(3);
  }
  _mm256_storeu_ps(m, a00), _mm256_storeu_ps(m + 8, a01), _mm256_storeu_ps(m + 16, a02);
  _mm256_storeu_ps(m + ldm, a10), _mm256_storeu_ps(m + ldm + 8, a11), _mm256_storeu_ps(m + ldm + 16, a12);
  _mm256_storeu_ps(m + 2 * ldm, a20), _mm256_storeu_ps(m + 2 * ldm + 8, a21), _mm256_storeu_ps(m + 2 * ldm + 16, a22);
  _mm256_storeu_ps(m + 3 * ldm, a30), _mm256_storeu_ps(m + 3 * ldm + 8, a31), _mm256_storeu_ps(m + 3 * ldm + 16, a32);
}
WG_KERN_HEAD(2) {
  __m256 a00 = _mm256_setzero_ps(), a10 = a00, a20 = a00, a30 = a00, a01 = a00, a11 = a00, a21 = a00, a31 = a00;
  for (int64_t c = 0; c < C; c++) {
    const float *vc = v + c * ldv;
    __m256 v0 = _mm256_loadu_ps(vc), v1 = _mm256_loadu_ps(vc + 8);
    WG_ROW2(0);
    WG_ROW2(1);
    WG_ROW2(2);
    WG_ROW2(3);
  }
  _mm256_storeu_ps(m, a00), _mm256_storeu_ps(m + 8, a01);
  _mm256_storeu_ps(m + ldm, a10), _mm256_storeu_ps(m + ldm + 8, a11);
  _mm256_storeu_ps(m + 2 * ldm, a20), _mm256_storeu_ps(m + 2 * ldm + 8, a21);
  _mm256_storeu_ps(m + 3 * ldm, a30), _mm256_storeu_ps(m + 3 * ldm + 8, a31);
}
WG_KERN_HEAD(1) {
  __m256 a00 = _mm256_setzero_ps(), a10 = a00, a20 = a00, a30 = a00;
  for (int64_t c = 0; c < C; c++) {
    __m256 v0 = _mm256_loadu_ps(v + c * ldv);
    WG_ROW1(0);
    WG_ROW1(1);
    WG_ROW1(2);
    WG_ROW1(3);
  }
  _mm256_storeu_ps(m, a00), _mm256_storeu_ps(m + ldm, a10), _mm256_storeu_ps(m + 2 * ldm, a20);
  _mm256_storeu_ps(m + 3 * ldm, a30);
}

/* Eight tiles of one output channel from M (16 rows of stride ms, tile at column 0) into
** the output rows 2ty, 2ty+1 of plane yp, columns [16q, 16q + 16) cut to OW:
** Y = A^T m A, A^T = [1 1 1 0; 0 1 -1 -1], plus the bias. */
__attribute__((target("avx2,fma"))) static void wg_out8(const wg_job *j, const float *m, int64_t ms, __m256 bv,
                                                        float *yp, int64_t ty, int64_t q) {
  __m256 s[2][4];
  for (int jj = 0; jj < 4; jj++) { /* A^T m */
    __m256 m0 = _mm256_loadu_ps(m + (0 + jj) * ms), m1 = _mm256_loadu_ps(m + (4 + jj) * ms);
    __m256 m2 = _mm256_loadu_ps(m + (8 + jj) * ms), m3 = _mm256_loadu_ps(m + (12 + jj) * ms);
    s[0][jj] = _mm256_add_ps(_mm256_add_ps(m0, m1), m2);
    s[1][jj] = _mm256_sub_ps(_mm256_sub_ps(m1, m2), m3);
  }
  int64_t OW = j->OW, c0 = 16 * q, nc = OW - c0 < 16 ? OW - c0 : 16;
  for (int i = 0; i < 2; i++) {
    int64_t oh = 2 * ty + i;
    if (oh >= j->OH) break;
    /* (A^T m) A: columns 0 and 1 of the eight tiles, then interleaved into one row */
    __m256 y0 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(s[i][0], s[i][1]), s[i][2]), bv);
    __m256 y1 = _mm256_add_ps(_mm256_sub_ps(_mm256_sub_ps(s[i][1], s[i][2]), s[i][3]), bv);
    __m256 lo = _mm256_unpacklo_ps(y0, y1), hi = _mm256_unpackhi_ps(y0, y1); /* tiles 0 1 4 5, 2 3 6 7 */
    float *d = yp + oh * OW + c0;
    /* the row's 16 columns in four pieces; a cut one stored 2 and 1 floats at a time (a libc
    ** memcpy per row cost more than the transform on 11-wide rows) */
    __m128 pc[4] = {_mm256_castps256_ps128(lo), _mm256_castps256_ps128(hi), _mm256_extractf128_ps(lo, 1),
                    _mm256_extractf128_ps(hi, 1)};
    int64_t k = 0;
    for (; k + 4 <= nc; k += 4) _mm_storeu_ps(d + k, pc[k / 4]);
    if (k < nc) {
      __m128 v = pc[k / 4];
      if (nc - k >= 2) {
        _mm_storel_pi((__m64 *)(d + k), v);
        v = _mm_movehl_ps(v, v);
        k += 2;
      }
      if (k < nc) _mm_store_ss(d + k, v);
    }
  }
}

/* One block: tile-rows [r0, r1). */
__attribute__((target("avx2,fma"))) static void wg_block(const wg_job *j, int64_t r0, int64_t r1, float *V, float *M,
                                                         float *pb) {
  int64_t C = j->C, LD = j->LD, TW = j->TW, OCB = j->OCB, OC = j->OC;
  int64_t nt = wg_up((r1 - r0) * TW, 8); /* tiles the GEMMs compute */
  wg_input(j, r0, r1, V, pb);
  int64_t G = j->G, MS = 4 * G * LD; /* M's stride between xi */
  for (int64_t og = 0; og < OCB; og += G) {
    int64_t ge = og + G < OCB ? og + G : OCB;
    for (int xi = 0; xi < 16; xi++) /* V[:, xi] stays in L1 through the group's channels */
      for (int64_t ob = og; ob < ge; ob++) {
        const float *u = j->U + (xi * OCB + ob) * C * 4, *v = V + xi * LD;
        float *m = M + xi * MS + (ob - og) * 4 * LD;
        int64_t t = 0;
        for (; t + 24 <= nt; t += 24) wg_kern3(u, v + t, 16 * LD, C, m + t, LD);
        if (nt - t == 16) wg_kern2(u, v + t, 16 * LD, C, m + t, LD);
        else if (nt - t == 8) wg_kern1(u, v + t, 16 * LD, C, m + t, LD);
      }
    for (int64_t oc = og * 4; oc < ge * 4 && oc < OC; oc++) {
      __m256 bv = _mm256_set1_ps(j->bias ? j->bias[oc] : 0.0f);
      for (int64_t row = r0; row < r1; row++) {
        int64_t n = row / j->TH, ty = row % j->TH;
        float *yp = j->y + (n * OC + oc) * j->OH * j->OW;
        const float *m = M + (oc - og * 4) * LD + (row - r0) * TW;
        for (int64_t q = 0; q < j->nch; q++) wg_out8(j, m + 8 * q, MS, bv, yp, ty, q);
      }
    }
  }
}

/* Shares [lo, hi) of the blocks, share s on scratch s. */
static void wg_range(void *vctx, int64_t lo, int64_t hi) {
  const wg_job *j = vctx;
  for (int64_t s = lo; s < hi; s++) {
    float *V = j->scratch + s * j->share, *M = V + 16 * j->C * j->LD, *pb = M + 16 * 4 * j->G * j->LD;
    /* M past the GEMMs' columns is read (the last step's lanes, not stored): defined zeros */
    memset(M, 0, (size_t)(16 * 4 * j->G * j->LD) * sizeof *M);
    /* and V past the input transform's writes, which the GEMMs read up to the next 8 */
    memset(V, 0, (size_t)(16 * j->C * j->LD) * sizeof *V);
    memset(pb, 0, (size_t)((2 * j->TH + 2) * j->RBW) * sizeof *pb); /* the padding: zeros for good */
    int64_t b0 = j->nblk * s / j->nt, b1 = j->nblk * (s + 1) / j->nt;
    for (int64_t b = b0; b < b1; b++) {
      int64_t r0 = b * j->R, r1 = r0 + j->R < j->nrows ? r0 + j->R : j->nrows;
      wg_block(j, r0, r1, V, M, pb);
    }
  }
}
#endif /* WG_X86 */

kiln_status kiln__cpu_conv_winograd(const kiln__kargs *a) {
#ifdef WG_X86
  if (!wg_supported(a))
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln: %s: not a Winograd case", kiln__kop_name(a->op));
  const kiln__conv_params *p = a->params;
  bool fwd = a->op == KILN__K_CONV2D;
  const kiln__view *x = &a->in[0], *w = &a->in[1], *y = &a->out[0];
  wg_job j;
  memset(&j, 0, sizeof j);
  j.x = x->data, j.y = y->data, j.w = w->data, j.rot = !fwd;
  j.bias = fwd && a->n_in > 2 ? a->in[2].data : NULL;
  j.N = x->shape[0], j.C = x->shape[1], j.H = x->shape[2], j.W = x->shape[3];
  j.OC = y->shape[1], j.OH = y->shape[2], j.OW = y->shape[3];
  /* backward data: the gradient padded by 2 - padding (the kernel's reach past it) */
  j.ph = fwd ? p->padding[0] : 2 - p->padding[0];
  j.pw = fwd ? p->padding[1] : 2 - p->padding[1];
  j.TH = (j.OH + 1) / 2, j.TW = (j.OW + 1) / 2;
  j.nrows = j.N * j.TH;
  j.R = WG_TILES / j.TW > 1 ? WG_TILES / j.TW : 1;
  j.nblk = (j.nrows + j.R - 1) / j.R;
  j.nch = (j.TW + 7) / 8;
  /* V's and M's rows: the block's tiles rounded to the GEMM's 8, and the last tile-row's
  ** eight-lane writes past them; in 16s, so rows start on cache lines */
  j.LD = wg_up(wg_up(j.R * j.TW, 8) + 8, 16);
  /* the padded plane's rows: 16 columns a chunk and the two more the last one reads, and
  ** the row copy's last eight-float store */
  int64_t rbw = 16 * j.nch + 2 > j.W + j.pw + 8 ? 16 * j.nch + 2 : j.W + j.pw + 8;
  j.RBW = wg_up(rbw, 16);
  j.OCB = (j.OC + 3) / 4;
  j.G = WG_GROUP < j.OCB ? WG_GROUP : j.OCB;
  j.share = wg_up(16 * j.C * j.LD + 16 * 4 * j.G * j.LD + (2 * j.TH + 2) * j.RBW, 16);
  j.nt = kiln__cpu_threads_for(j.nblk, 2);
  size_t un = (size_t)wg_up(16 * j.OCB * j.C * 4, 16);
  size_t bytes = (un + (size_t)(j.nt * j.share)) * sizeof(float);
  float *buf = kiln__cpu_alloc(0, bytes);
  if (!buf) return kiln_last_error();
  j.U = buf;
  j.scratch = buf + un;
  kiln__cpu_parallel_for(j.OCB, 1 + KILN__CPU_PAR_MIN / (j.C * 200 + 1), wg_weights_range, &j);
  kiln__cpu_parallel_for(j.nt, 1, wg_range, &j);
  kiln__cpu_free(0, buf, bytes);
  return KILN_OK;
#else
  return kiln_set_error(KILN_ERR_INTERNAL, "kiln: %s: the Winograd kernel is not built here", kiln__kop_name(a->op));
#endif
}
