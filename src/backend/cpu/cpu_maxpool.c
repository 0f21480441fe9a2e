/*
** MAX_POOL2D and MAX_POOL2D_BACKWARD in f32 and bf16, NCHW (unit-stride rows) and
** channels-last (unit-stride channels): the layouts and dtypes a CNN trains in. Any other
** case (f16, f64, odd strides) goes to the general loops at the end of this file, which
** define the results these kernels reproduce bit for bit:
**
** forward: the window's candidates in row-major order (i, then j), the first strict
** maximum, a NaN winning over a number (the first NaN); padding never wins; the index is
** h*W + w in x's plane (PyTorch's choice on ties: it scans the same order with `>`).
** backward: dx[p] is the sum of the gradients of the outputs whose index is p and lies in
** that output's own window (an index from max_pool2d always does), added in f64 and
** rounded once to dx's dtype.
**
** Why kernels beside the general loops: those compare in f64 through a per-element dtype
** dispatch and branch on every comparison. On random data the argmax is unpredictable,
** so the 2x2 fast path that was there paid a branch miss or two per output (3.3 ms for
** fmnist-cnn's (128, 32, 26, 26) against a memcpy of its bytes well under 1 ms). Here the
** comparison is a select on whole rows of outputs (NCHW: one output row at a time, each
** window offset (i, j) a pass over the row; channels-last: one output pixel's channels at
** a time), which GCC vectorises, and rows or pixels are split across the threads.
*/
#include "cpu.h"
#include "cpu_iter.h"
#include "cpu_window.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct mp_job {
  const kiln__kargs *a;
  const kiln__conv_params *p;
  bool oom;
} mp_job;

static inline float bf16_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Exact for a value that came from bf16 (the pooled maximum always did). */
static inline uint16_t f32_to_bf16_exact(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return (uint16_t)(u >> 16);
}

/* One NCHW plane: for each window offset (i, j) in order, a pass over the output rows
** it reaches, each output taking the candidate with `take`, the general loop's rule as
** selects. One call per plane (not per row: ResNet's rows are 8 outputs long, and a call
** per row and offset cost more than the comparisons). SW: the column stride, a constant
** in the specialised copies so that the loads vectorise. */
#define MP_PLANE(NAME, T, LOAD, SW)                                                                    \
  KILN__CPU_CLONES                                                                                     \
  static void NAME(float *restrict best, int32_t *restrict at, const T *restrict xp, int64_t xs2,       \
                   const kiln__conv_params *p, int64_t H, int64_t W, int64_t OH, int64_t OW) {          \
    const int64_t sw = SW;                                                                             \
    for (int64_t i = 0; i < p->kernel[0]; i++)                                                          \
      for (int64_t jj = 0; jj < p->kernel[1]; jj++) {                                                  \
        int64_t off = jj * p->dilation[1], a, b;                                                        \
        kiln__cpu_valid_cols(OW, W, sw, p->padding[1], off, &a, &b);                                    \
        for (int64_t oh = 0; oh < OH && a < b; oh++) {                                                  \
          int64_t h = oh * p->stride[0] - p->padding[0] + i * p->dilation[0];                           \
          if (h < 0 || h >= H) continue;                                                                \
          int64_t w0 = a * sw - p->padding[1] + off;                                                    \
          const T *src = xp + h * xs2 + w0;                                                             \
          float *bo = best + oh * OW + a;                                                               \
          int32_t *ao = at + oh * OW + a, id0 = (int32_t)(h * W + w0);                                  \
          for (int64_t k = 0; k < b - a; k++) {                                                         \
            float v = LOAD(src[k * sw]), bb = bo[k];                                                    \
            bool take = (ao[k] < 0) | (v > bb) | ((v != v) & (bb == bb));                               \
            bo[k] = take ? v : bb;                                                                      \
            ao[k] = take ? id0 + (int32_t)(k * sw) : ao[k];                                             \
          }                                                                                             \
        }                                                                                               \
      }                                                                                                 \
  }
#define MP_F32(v) (v)
#define MP_BF16(v) bf16_to_f32(v)
MP_PLANE(mp_plane_f32_s1, float, MP_F32, 1)
MP_PLANE(mp_plane_f32_s2, float, MP_F32, 2)
MP_PLANE(mp_plane_f32_sn, float, MP_F32, p->stride[1])
MP_PLANE(mp_plane_bf16_s1, uint16_t, MP_BF16, 1)
MP_PLANE(mp_plane_bf16_s2, uint16_t, MP_BF16, 2)
MP_PLANE(mp_plane_bf16_sn, uint16_t, MP_BF16, p->stride[1])

/* Channels-last: every channel of one pixel against the same index. */
KILN__CPU_CLONES
static void mp_update_c_f32(float *restrict best, int32_t *restrict at, const float *restrict src, int64_t n,
                            int32_t id) {
  for (int64_t k = 0; k < n; k++) {
    float v = src[k], b = best[k];
    bool take = (at[k] < 0) | (v > b) | ((v != v) & (b == b));
    best[k] = take ? v : b;
    at[k] = take ? id : at[k];
  }
}

KILN__CPU_CLONES
static void mp_update_c_bf16(float *restrict best, int32_t *restrict at, const uint16_t *restrict src, int64_t n,
                             int32_t id) {
  for (int64_t k = 0; k < n; k++) {
    float v = bf16_to_f32(src[k]), b = best[k];
    bool take = (at[k] < 0) | (v > b) | ((v != v) & (b == b));
    best[k] = take ? v : b;
    at[k] = take ? id : at[k];
  }
}

/* n running maxima and their indices in one allocation (*at after the maxima); NULL, with
** j->oom set, when out of memory. */
static float *mp_scratch(mp_job *j, int64_t n, int32_t **at) {
  float *best = malloc((size_t)n * (sizeof(float) + sizeof(int32_t)));
  if (!best) {
    j->oom = true;
    return NULL;
  }
  *at = (int32_t *)(best + n);
  return best;
}

static void mp_init(float *best, int32_t *at, int64_t n) {
  for (int64_t k = 0; k < n; k++) best[k] = -INFINITY, at[k] = -1;
}

/* Stores n results at y (element stride ys) and ix (stride is); a window with no
** candidate (not possible with padding at most half the kernel) gives index 0. */
static void mp_store(const float *best, const int32_t *at, int64_t n, char *y, int64_t ys, bool bf, int64_t *ix,
                     int64_t is) {
  if (bf) {
    uint16_t *yb = (uint16_t *)y;
    for (int64_t k = 0; k < n; k++) yb[k * ys] = f32_to_bf16_exact(best[k]);
  } else {
    float *yf = (float *)y;
    for (int64_t k = 0; k < n; k++) yf[k * ys] = best[k];
  }
  for (int64_t k = 0; k < n; k++) ix[k * is] = at[k] < 0 ? 0 : at[k];
}

/* NCHW rows with AVX-512 (column stride 1 or 2): an output row in chunks of 16, each
** chunk's best values and indices held in two registers across the window, the
** candidates of one window offset loaded at once (masked: the lanes outside the image
** or past the row are not read; stride 2 loads 32 elements and keeps the even ones), the
** rule as mask operations. The portable plane loops above vectorise only within a row,
** with a scalar tail that branches (ResNet's rows are 8 outputs, fmnist-cnn's 13 and 5):
** 2.7 ms for ResNet's stem pool against 0.4 ms here. Max is exact, so both give the
** same bits. */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(KILN_NO_TARGET_CLONES)
#include <immintrin.h>
#include "cpu_pool2_avx2.h"
#define MP_HAVE_AVX512 1
static bool mp_avx512_ok(void) {
  static int ok = -1;
  if (ok < 0)
    ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("bmi2");
  return ok;
}

__attribute__((target("avx512f,avx512bw,avx512vl,bmi2"))) static void
mp_plane_avx512(const char *xp, bool bf, int64_t xs2, const kiln__conv_params *p, int64_t H, int64_t W, int64_t OH,
                int64_t OW, char *yp, int64_t ys2, int64_t *ip, int64_t is2) {
  const int64_t sw = p->stride[1], es = bf ? 2 : 4;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i lane_sw = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)sw));
  /* each window column's valid output range, once per plane: kiln__cpu_valid_cols divides by the
  ** stride, and two i64 divisions per tap per row chunk were most of the time on small
  ** maps (fmnist-cnn's 11x11 -> 5x5 planes: 5 outputs a row, 4 taps) */
  enum { KW_PRE = 16 };
  int64_t ca[KW_PRE], cb[KW_PRE];
  const bool pre = p->kernel[1] <= KW_PRE;
  for (int64_t jj = 0; pre && jj < p->kernel[1]; jj++)
    kiln__cpu_valid_cols(OW, W, sw, p->padding[1], jj * p->dilation[1], &ca[jj], &cb[jj]);
  for (int64_t oh = 0; oh < OH; oh++)
    for (int64_t ow0 = 0; ow0 < OW; ow0 += 16) {
      int64_t nout = OW - ow0 < 16 ? OW - ow0 : 16;
      __m512 best = _mm512_set1_ps(-INFINITY);
      __m512i at = _mm512_set1_epi32(-1);
      for (int64_t i = 0; i < p->kernel[0]; i++) {
        int64_t h = oh * p->stride[0] - p->padding[0] + i * p->dilation[0];
        if (h < 0 || h >= H) continue;
        const char *row = xp + h * xs2 * es;
        for (int64_t jj = 0; jj < p->kernel[1]; jj++) {
          int64_t off = jj * p->dilation[1], a, b;
          if (pre) a = ca[jj], b = cb[jj];
          else kiln__cpu_valid_cols(OW, W, sw, p->padding[1], off, &a, &b);
          if (a < ow0) a = ow0;
          if (b > ow0 + nout) b = ow0 + nout;
          if (a >= b) continue;
          __mmask16 m = (__mmask16)(((1u << (b - a)) - 1) << (a - ow0));
          int64_t w0 = ow0 * sw - p->padding[1] + off; /* column of lane 0 (maybe outside) */
          /* lane l reads column w0 + l*sw; only lanes in m, whose columns are in [0, W) */
          const char *base = row + w0 * es;
          __m512 v;
          if (sw == 1) {
            if (bf)
              v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, base)), 16));
            else
              v = _mm512_maskz_loadu_ps(m, base);
          } else {
            uint32_t m2 = _pdep_u32(m, 0x55555555u); /* element 2l for lane l */
            if (bf)
              v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_maskz_loadu_epi16(m2, base), 16));
            else
              v = _mm512_permutex2var_ps(_mm512_maskz_loadu_ps((__mmask16)m2, base), even,
                                         _mm512_maskz_loadu_ps((__mmask16)(m2 >> 16), (const float *)base + 16));
          }
          __m512i id = _mm512_add_epi32(_mm512_set1_epi32((int)(h * W + w0)), lane_sw);
          __mmask16 take = _mm512_mask_cmplt_epi32_mask(m, at, _mm512_setzero_si512()) |
                           _mm512_mask_cmp_ps_mask(m, v, best, _CMP_GT_OQ) |
                           (_mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q) & _mm512_cmp_ps_mask(best, best, _CMP_ORD_Q));
          best = _mm512_mask_mov_ps(best, take, v);
          at = _mm512_mask_mov_epi32(at, take, id);
        }
      }
      __mmask16 mo = (__mmask16)((1u << nout) - 1);
      if (bf)
        _mm512_mask_cvtepi32_storeu_epi16(yp + (oh * ys2 + ow0) * 2, mo, _mm512_srli_epi32(_mm512_castps_si512(best), 16));
      else
        _mm512_mask_storeu_ps(yp + (oh * ys2 + ow0) * 4, mo, best);
      at = _mm512_max_epi32(at, _mm512_setzero_si512()); /* no candidate: index 0 */
      int64_t *io = ip + oh * is2 + ow0;
      _mm512_mask_storeu_epi64(io, (__mmask8)mo, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(at)));
      _mm512_mask_storeu_epi64(io + 8, (__mmask8)(mo >> 8), _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(at, 1)));
    }
}
#endif

/* NCHW: items are planes (n, c). */
static void mp_planes(void *vctx, int64_t lo, int64_t hi) {
  mp_job *j = vctx;
  const kiln__view *x = &j->a->in[0], *y = &j->a->out[0], *ix = &j->a->out[1];
  const kiln__conv_params *p = j->p;
  bool bf = x->dtype == KILN_BF16;
  int64_t es = bf ? 2 : 4;
  int64_t C = x->shape[1], H = x->shape[2], W = x->shape[3], OH = y->shape[2], OW = y->shape[3];
  int32_t *at;
  float *best = mp_scratch(j, OH * OW, &at);
  if (!best) return;
  int64_t sw = p->stride[1];
#ifdef MP_HAVE_AVX512
  bool use512 = (sw == 1 || sw == 2) && y->strides[3] == 1 && ix->strides[3] == 1 && mp_avx512_ok();
#endif
  for (int64_t q = lo; q < hi; q++) {
    int64_t n = q / C, c = q % C;
    const char *xp = (const char *)x->data + (n * x->strides[0] + c * x->strides[1]) * es;
#ifdef MP_HAVE_AVX512
    if (use512) {
      mp_plane_avx512(xp, bf, x->strides[2], p, H, W, OH, OW,
                      (char *)y->data + (n * y->strides[0] + c * y->strides[1]) * es, y->strides[2],
                      (int64_t *)ix->data + n * ix->strides[0] + c * ix->strides[1], ix->strides[2]);
      continue;
    }
#endif
    mp_init(best, at, OH * OW);
    if (bf) {
      const uint16_t *xb = (const uint16_t *)xp;
      if (sw == 1) mp_plane_bf16_s1(best, at, xb, x->strides[2], p, H, W, OH, OW);
      else if (sw == 2) mp_plane_bf16_s2(best, at, xb, x->strides[2], p, H, W, OH, OW);
      else mp_plane_bf16_sn(best, at, xb, x->strides[2], p, H, W, OH, OW);
    } else {
      const float *xf = (const float *)xp;
      if (sw == 1) mp_plane_f32_s1(best, at, xf, x->strides[2], p, H, W, OH, OW);
      else if (sw == 2) mp_plane_f32_s2(best, at, xf, x->strides[2], p, H, W, OH, OW);
      else mp_plane_f32_sn(best, at, xf, x->strides[2], p, H, W, OH, OW);
    }
    for (int64_t oh = 0; oh < OH; oh++) {
      char *yp = (char *)y->data + (n * y->strides[0] + c * y->strides[1] + oh * y->strides[2]) * es;
      int64_t *ip = (int64_t *)ix->data + n * ix->strides[0] + c * ix->strides[1] + oh * ix->strides[2];
      mp_store(best + oh * OW, at + oh * OW, OW, yp, y->strides[3], bf, ip, ix->strides[3]);
    }
  }
  free(best);
}

/* Channels-last: items are output pixels (n, oh, ow), each all C channels. */
static void mp_pixels(void *vctx, int64_t lo, int64_t hi) {
  mp_job *j = vctx;
  const kiln__view *x = &j->a->in[0], *y = &j->a->out[0], *ix = &j->a->out[1];
  const kiln__conv_params *p = j->p;
  bool bf = x->dtype == KILN_BF16;
  int64_t es = bf ? 2 : 4;
  int64_t C = x->shape[1], H = x->shape[2], W = x->shape[3], OH = y->shape[2], OW = y->shape[3];
  int32_t *at;
  float *best = mp_scratch(j, C, &at);
  if (!best) return;
  for (int64_t r = lo; r < hi; r++) {
    int64_t ow = r % OW, t = r / OW, oh = t % OH, n = t / OH;
    const char *xn = (const char *)x->data + n * x->strides[0] * es;
    mp_init(best, at, C);
    for (int64_t i = 0; i < p->kernel[0]; i++) {
      int64_t h = oh * p->stride[0] - p->padding[0] + i * p->dilation[0];
      if (h < 0 || h >= H) continue;
      for (int64_t jj = 0; jj < p->kernel[1]; jj++) {
        int64_t w = ow * p->stride[1] - p->padding[1] + jj * p->dilation[1];
        if (w < 0 || w >= W) continue;
        const char *src = xn + (h * x->strides[2] + w * x->strides[3]) * es;
        if (bf) mp_update_c_bf16(best, at, (const uint16_t *)src, C, (int32_t)(h * W + w));
        else mp_update_c_f32(best, at, (const float *)src, C, (int32_t)(h * W + w));
      }
    }
    char *yp = (char *)y->data + (n * y->strides[0] + oh * y->strides[2] + ow * y->strides[3]) * es;
    int64_t *ip = (int64_t *)ix->data + n * ix->strides[0] + oh * ix->strides[2] + ow * ix->strides[3];
    mp_store(best, at, C, yp, y->strides[1], bf, ip, ix->strides[1]);
  }
  free(best);
}

/* ---- backward ---------------------------------------------------------------------------- */

/* Whether index `at` lies in the window of output (oh, ow), without a division (an i64
** division per output cost more than the rest of the scatter) and without a branch on
** the index (which is random: a branch on it missed every other time). */
static inline bool in_window(int64_t at, int64_t oh, int64_t ow, const kiln__conv_params *p, int64_t H, int64_t W) {
  int64_t h0 = oh * p->stride[0] - p->padding[0], w0 = ow * p->stride[1] - p->padding[1];
  int64_t rel = at - (h0 * W + w0), span = (p->kernel[1] - 1) * p->dilation[1], rstep = p->dilation[0] * W;
  bool ok = false;
  for (int64_t i = 0; i < p->kernel[0]; i++) {
    int64_t rr = rel - i * rstep; /* the column offset, if at is in window row i */
    int64_t h = h0 + i * p->dilation[0], w = w0 + rr;
    ok |= ((uint64_t)rr <= (uint64_t)span) & ((uint64_t)h < (uint64_t)H) & ((uint64_t)w < (uint64_t)W) &
          (p->dilation[1] == 1 || rr % p->dilation[1] == 0);
  }
  return ok;
}

static bool disjoint(const kiln__conv_params *p) {
  return p->kernel[0] <= p->stride[0] && p->kernel[1] <= p->stride[1] && p->dilation[0] == 1 &&
         p->dilation[1] == 1;
}

typedef struct mpb_job {
  const kiln__kargs *a;
  const kiln__conv_params *p;
  bool cl;
  bool oom;
} mpb_job;

/* NCHW windows that tile the plane (kernel == stride, no padding or dilation: MaxPool2d(2)
** and the like): every pixel of dx is written once, the gradient where the index points
** and zero elsewhere, row by row, instead of zeroing the plane and scattering into it
** (two passes over dx, the second at random). Pixels past the last window (an odd
** size's last row or column) are zeroed. The index test is the same as in_window's
** (an index only counts in its own window), since each output only looks at its own
** window's pixels. */
#define MPB_TILE(NAME, T)                                                                                    \
  KILN__CPU_CLONES                                                                                           \
  static void NAME(T *restrict xp, const T *restrict gp, int64_t gs2, int64_t gs3, const int64_t *restrict ip, \
                   int64_t is2, int64_t is3, int64_t kh, int64_t kw, int64_t H, int64_t W, int64_t OH,       \
                   int64_t OW) {                                                                             \
    int64_t cw = OW * kw; /* columns covered by windows */                                                   \
    for (int64_t oh = 0; oh < OH; oh++) {                                                                    \
      const T *gr = gp + oh * gs2;                                                                           \
      const int64_t *ir = ip + oh * is2;                                                                     \
      for (int64_t i = 0; i < kh; i++) {                                                                     \
        int64_t h = oh * kh + i;                                                                             \
        T *row = xp + h * W;                                                                                 \
        if (kw == 2) {                                                                                       \
          for (int64_t ow = 0; ow < OW; ow++) {                                                              \
            int64_t at = ir[ow * is3] - h * W - 2 * ow;                                                      \
            T gv = gr[ow * gs3], z = 0;                                                                      \
            row[2 * ow] = at == 0 ? gv : z;                                                                  \
            row[2 * ow + 1] = at == 1 ? gv : z;                                                              \
          }                                                                                                  \
        } else {                                                                                             \
          for (int64_t ow = 0; ow < OW; ow++) {                                                              \
            int64_t at = ir[ow * is3] - h * W - kw * ow;                                                     \
            T gv = gr[ow * gs3], z = 0;                                                                      \
            for (int64_t jj = 0; jj < kw; jj++) row[kw * ow + jj] = at == jj ? gv : z;                       \
          }                                                                                                  \
        }                                                                                                    \
        for (int64_t w = cw; w < W; w++) row[w] = 0;                                                         \
      }                                                                                                      \
    }                                                                                                        \
    for (int64_t h = OH * kh; h < H; h++)                                                                    \
      for (int64_t w = 0; w < W; w++) xp[h * W + w] = 0;                                                     \
  }
MPB_TILE(mpb_tile_f32, float)
MPB_TILE(mpb_tile_u16, uint16_t) /* bf16 bits: the gradient is copied, zero is +0 */

#ifdef MP_HAVE_AVX512
/* mpb_tile_f32 for 2x2 windows (MaxPool2d(2)) with unit column strides in g and the
** indices, 16 outputs (32 dx columns) at a time: the two candidate columns of each output
** are masked copies of g, interleaved; the same values as the scalar loop (a copy or
** zero per pixel). */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void
mpb_tile2_f32_avx512(float *restrict xp, const float *restrict gp, int64_t gs2, const int64_t *restrict ip,
                     int64_t is2, int64_t H, int64_t W, int64_t OH, int64_t OW) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512i two = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), one = _mm512_set1_epi64(1);
  int64_t cw = OW * 2;
  for (int64_t oh = 0; oh < OH; oh++) {
    const float *gr = gp + oh * gs2;
    const int64_t *ir = ip + oh * is2;
    for (int64_t i = 0; i < 2; i++) {
      int64_t h = oh * 2 + i;
      float *row = xp + h * W;
      for (int64_t ow0 = 0; ow0 < OW; ow0 += 16) {
        int64_t n = OW - ow0 < 16 ? OW - ow0 : 16;
        __mmask16 m = (__mmask16)((1u << n) - 1);
        /* at - (h*W + 2*ow): 0 or 1 when the index is in this row of the window */
        __m512i b0 = _mm512_add_epi64(_mm512_set1_epi64(h * W + 2 * ow0), two);
        __m512i b1 = _mm512_add_epi64(b0, _mm512_set1_epi64(16));
        __m512i r0 = _mm512_sub_epi64(_mm512_maskz_loadu_epi64((__mmask8)m, ir + ow0), b0);
        __m512i r1 = _mm512_sub_epi64(_mm512_maskz_loadu_epi64((__mmask8)(m >> 8), ir + ow0 + 8), b1);
        __mmask16 e = (__mmask16)(_mm512_cmpeq_epi64_mask(r0, _mm512_setzero_si512()) |
                                  (_mm512_cmpeq_epi64_mask(r1, _mm512_setzero_si512()) << 8));
        __mmask16 o = (__mmask16)(_mm512_cmpeq_epi64_mask(r0, one) | (_mm512_cmpeq_epi64_mask(r1, one) << 8));
        __m512 g = _mm512_maskz_loadu_ps(m, gr + ow0);
        __m512 ge = _mm512_maskz_mov_ps(e & m, g), go = _mm512_maskz_mov_ps(o & m, g);
        uint32_t m2 = (uint32_t)((1ull << (2 * n)) - 1); /* dx columns written */
        _mm512_mask_storeu_ps(row + 2 * ow0, (__mmask16)m2, _mm512_permutex2var_ps(ge, lo, go));
        _mm512_mask_storeu_ps(row + 2 * ow0 + 16, (__mmask16)(m2 >> 16), _mm512_permutex2var_ps(ge, hi, go));
      }
      for (int64_t w = cw; w < W; w++) row[w] = 0;
    }
  }
  for (int64_t h = OH * 2; h < H; h++)
    for (int64_t w = 0; w < W; w++) xp[h * W + w] = 0;
}
#endif

static bool tiles(const kiln__conv_params *p) {
  return p->kernel[0] == p->stride[0] && p->kernel[1] == p->stride[1] && p->padding[0] == 0 &&
         p->padding[1] == 0 && p->dilation[0] == 1 && p->dilation[1] == 1;
}

/* Items are planes (NCHW: one (n, c); channels-last: one image n, all channels). dx is
** dense in its layout (the op allocates it), so a plane is one block: off is p's flat
** index in the block times the channel count (1 for NCHW) plus the channel. */
static void mpb_planes(void *vctx, int64_t lo, int64_t hi) {
  mpb_job *j = vctx;
  const kiln__view *g = &j->a->in[0], *ix = &j->a->in[1], *dx = &j->a->out[0];
  const kiln__conv_params *p = j->p;
  bool bf = dx->dtype == KILN_BF16, cl = j->cl, dis = disjoint(p);
  int64_t es = bf ? 2 : 4;
  int64_t C = dx->shape[1], H = dx->shape[2], W = dx->shape[3], OH = g->shape[2], OW = g->shape[3];
  int64_t CB = cl ? C : 1; /* channels in one block */
  int64_t blk = H * W * CB;
  double *acc = NULL;
  if (!dis) {
    acc = malloc(sizeof(double) * (size_t)blk);
    if (!acc) {
      j->oom = true;
      return;
    }
  }
  for (int64_t q = lo; q < hi; q++) {
    int64_t n = cl ? q : q / C, c0 = cl ? 0 : q % C;
    char *xb = (char *)dx->data + (n * dx->strides[0] + c0 * dx->strides[1]) * es;
    const char *gb = (const char *)g->data + (n * g->strides[0] + c0 * g->strides[1]) * es;
    const int64_t *ib = (const int64_t *)ix->data + n * ix->strides[0] + c0 * ix->strides[1];
    if (!cl && dis && tiles(p)) {
#ifdef MP_HAVE_AVX512
      if (!bf && p->kernel[0] == 2 && p->kernel[1] == 2 && g->strides[3] == 1 && ix->strides[3] == 1 &&
          mp_avx512_ok()) {
        mpb_tile2_f32_avx512((float *)xb, (const float *)gb, g->strides[2], ib, ix->strides[2], H, W, OH, OW);
        continue;
      }
#endif
      if (bf)
        mpb_tile_u16((uint16_t *)xb, (const uint16_t *)gb, g->strides[2], g->strides[3], ib, ix->strides[2],
                     ix->strides[3], p->kernel[0], p->kernel[1], H, W, OH, OW);
      else
        mpb_tile_f32((float *)xb, (const float *)gb, g->strides[2], g->strides[3], ib, ix->strides[2],
                     ix->strides[3], p->kernel[0], p->kernel[1], H, W, OH, OW);
      continue;
    }
    if (dis) memset(xb, 0, (size_t)(blk * es));
    else memset(acc, 0, sizeof(double) * (size_t)blk);
    for (int64_t oh = 0; oh < OH; oh++)
      for (int64_t ow = 0; ow < OW; ow++)
        for (int64_t c = 0; c < CB; c++) {
          int64_t at = ib[oh * ix->strides[2] + ow * ix->strides[3] + c * ix->strides[1]];
          if (!in_window(at, oh, ow, p, H, W)) continue;
          const char *gp = gb + (oh * g->strides[2] + ow * g->strides[3] + c * g->strides[1]) * es;
          int64_t off = at * CB + c;
          if (dis) { /* one gradient per pixel: its bits */
            if (bf) ((uint16_t *)xb)[off] = *(const uint16_t *)gp;
            else ((float *)xb)[off] = *(const float *)gp;
          } else acc[off] += bf ? (double)bf16_to_f32(*(const uint16_t *)gp) : (double)*(const float *)gp;
        }
    if (!dis) kiln__cpu_store(xb, es, dx->dtype, acc, KILN_F64, blk);
  }
  free(acc);
}

/* ---- RELU_MAX_POOL2D and its backward ---------------------------------------------------- */
/* A CNN's ReLU then MaxPool2d over tiling windows, in one pass each way. Pooling first is
** the same: relu is monotone, so relu(max(x)) = max(relu(x)) (with ReLU's v < 0 ? 0 : v,
** NaN passing, and MAX_POOL2D's rule, NaN winning); the backward sends g to the window's
** max where y > 0, which is where the pair's backward sends it (a window whose max is <= 0
** or NaN gets nothing through ReLU's mask either way). What the pair did on fmnist-cnn's
** (128, 32, 26, 26): ReLU's pass over the map each way, then max_pool2d's, and its backward
** ran the forward again for the i64 indices; here the forward reads the map once and writes
** a quarter of it plus a byte per output (the max's offset in its window, which the
** backward reads instead of recomputing), and the backward writes dx once. */

typedef struct rmp_job {
  const kiln__kargs *a;
  const kiln__conv_params *p;
} rmp_job;

#ifdef MP_HAVE_AVX512
/* 2x2 windows, f32, unit column strides: 16 outputs a step from 32 columns of two rows,
** the four candidates split into even and odd columns by one permute each and taken in
** window order with the portable rule as masks; the same values and offsets. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void
rmp_fwd2_avx512(const float *restrict xp, int64_t xs2, float *restrict yp, int64_t ys2, uint8_t *restrict ip,
                int64_t is2, int64_t OH, int64_t OW) {
  const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t oh = 0; oh < OH; oh++) {
    const float *r0 = xp + 2 * oh * xs2, *r1 = r0 + xs2;
    for (int64_t ow0 = 0; ow0 < OW; ow0 += 16) {
      int64_t n = OW - ow0 < 16 ? OW - ow0 : 16, cols = 2 * n;
      __mmask16 m = (__mmask16)((1u << n) - 1);
      __mmask16 lo = cols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << cols) - 1);
      __mmask16 hi = cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
      const float *a = r0 + 2 * ow0, *b = r1 + 2 * ow0;
      __m512 a0 = _mm512_maskz_loadu_ps(lo, a), a1 = _mm512_maskz_loadu_ps(hi, a + 16);
      __m512 b0 = _mm512_maskz_loadu_ps(lo, b), b1 = _mm512_maskz_loadu_ps(hi, b + 16);
      __m512 cand[4] = {_mm512_permutex2var_ps(a0, ev, a1), _mm512_permutex2var_ps(a0, od, a1),
                        _mm512_permutex2var_ps(b0, ev, b1), _mm512_permutex2var_ps(b0, od, b1)};
      __m512 best = cand[0];
      __m512i at = _mm512_setzero_si512();
      for (int t = 1; t < 4; t++) {
        __m512 v = cand[t];
        __mmask16 take = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ) |
                         (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) & _mm512_cmp_ps_mask(best, best, _CMP_ORD_Q));
        best = _mm512_mask_mov_ps(best, take, v);
        at = _mm512_mask_mov_epi32(at, take, _mm512_set1_epi32(t));
      }
      best = _mm512_mask_mov_ps(best, _mm512_cmp_ps_mask(best, zero, _CMP_LT_OQ), zero); /* ReLU */
      _mm512_mask_storeu_ps(yp + oh * ys2 + ow0, m, best);
      _mm_mask_storeu_epi8(ip + oh * is2 + ow0, m, _mm512_cvtepi32_epi8(at));
    }
  }
}

/* its backward on a dense (H, W) plane: each output row's two dx rows as masked copies of
** g interleaved (mpb_tile2_f32_avx512's way), then the rows and columns no window covers
** zeroed. */
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void
rmp_bwd2_avx512(float *restrict xp, const float *restrict gp, int64_t gs2, const float *restrict yp, int64_t ys2,
                const uint8_t *restrict ip, int64_t is2, int64_t H, int64_t W, int64_t OH, int64_t OW) {
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t oh = 0; oh < OH; oh++) {
    for (int64_t ow0 = 0; ow0 < OW; ow0 += 16) {
      int64_t n = OW - ow0 < 16 ? OW - ow0 : 16;
      __mmask16 m = (__mmask16)((1u << n) - 1);
      __m512 g = _mm512_maskz_loadu_ps(m, gp + oh * gs2 + ow0);
      __mmask16 pos = _mm512_cmp_ps_mask(_mm512_maskz_loadu_ps(m, yp + oh * ys2 + ow0), zero, _CMP_GT_OQ) & m;
      __m512i at = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, ip + oh * is2 + ow0));
      uint32_t m2 = (uint32_t)((1ull << (2 * n)) - 1); /* dx columns written */
      for (int i = 0; i < 2; i++) {
        __mmask16 e = pos & _mm512_cmpeq_epi32_mask(at, _mm512_set1_epi32(2 * i));
        __mmask16 o = pos & _mm512_cmpeq_epi32_mask(at, _mm512_set1_epi32(2 * i + 1));
        __m512 ge = _mm512_maskz_mov_ps(e, g), go = _mm512_maskz_mov_ps(o, g);
        float *row = xp + (2 * oh + i) * W + 2 * ow0;
        _mm512_mask_storeu_ps(row, (__mmask16)m2, _mm512_permutex2var_ps(ge, lo, go));
        _mm512_mask_storeu_ps(row + 16, (__mmask16)(m2 >> 16), _mm512_permutex2var_ps(ge, hi, go));
      }
    }
    for (int i = 0; i < 2; i++)
      for (int64_t w = 2 * OW; w < W; w++) xp[(2 * oh + i) * W + w] = 0;
  }
  for (int64_t h = 2 * OH; h < H; h++)
    for (int64_t w = 0; w < W; w++) xp[h * W + w] = 0;
}
#endif

#ifdef MP_HAVE_AVX512
/* AVX2 (the x86-64 CPUs without AVX-512: AMD before Zen 4, Intel's laptops and desktops):
** rmp_fwd2_avx512's scheme 8 outputs a step, the even and odd columns split by a shuffle
** and a cross-lane permute, the row's tail by masked loads (full chunks load and store
** plainly: AMD microcodes masked stores), the offsets stored byte by byte;
** the portable rule as compare masks and blends: the same values and offsets. */

__attribute__((target("avx2"))) static void rmp_fwd2_avx2(const float *restrict xp, int64_t xs2, float *restrict yp,
                                                          int64_t ys2, uint8_t *restrict ip, int64_t is2, int64_t OH,
                                                          int64_t OW, const float *xend) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t oh = 0; oh < OH; oh++) {
    const float *r0 = xp + 2 * oh * xs2, *r1 = r0 + xs2;
    for (int64_t ow0 = 0; ow0 < OW; ow0 += 8) {
      int64_t n = OW - ow0 < 8 ? OW - ow0 : 8, cols = 2 * n;
      __m256 a0, a1, b0, b1;
      const float *a = r0 + 2 * ow0, *b = r1 + 2 * ow0;
      if (n == 8 || (a + 16 <= xend && b + 16 <= xend)) { /* plain loads (AMD's masked ones are slow); a tail's lanes past its 2n
                                         ** columns read the buffer's next elements, and give outputs not stored */
        a0 = _mm256_loadu_ps(a), a1 = _mm256_loadu_ps(a + 8), b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
      } else { /* the buffer's end: the 2n columns, lanes past them not read */
        __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(cols < 8 ? cols : 8)), lane);
        __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(cols > 8 ? cols - 8 : 0)), lane);
        a0 = _mm256_maskload_ps(a, m0), a1 = _mm256_maskload_ps(a + 8, m1);
        b0 = _mm256_maskload_ps(b, m0), b1 = _mm256_maskload_ps(b + 8, m1);
      }
      __m256i at;
      __m256 best = kiln__rmp2_avx2(a0, a1, b0, b1, &at);
      kiln__rmp2_store_avx2(yp + oh * ys2 + ow0, ip + oh * is2 + ow0, best, at, n);
    }
  }
}

/* rmp_bwd2_avx512 on eight outputs a step: the gradient kept where y > 0 and the offset
** names the dx column (even or odd) of each of the two dx rows, the two interleaved by
** unpacks and a 128-bit permute; the row's tail read and written through buffers */
__attribute__((target("avx2"))) static void rmp_bwd2_avx2(float *restrict xp, const float *restrict gp, int64_t gs2,
                                                          const float *restrict yp, int64_t ys2,
                                                          const uint8_t *restrict ip, int64_t is2, int64_t H, int64_t W,
                                                          int64_t OH, int64_t OW) {
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t oh = 0; oh < OH; oh++) {
    for (int64_t ow0 = 0; ow0 < OW; ow0 += 8) {
      int64_t n = OW - ow0 < 8 ? OW - ow0 : 8;
      __m256 g, y;
      __m256i at;
      if (n == 8) {
        g = _mm256_loadu_ps(gp + oh * gs2 + ow0), y = _mm256_loadu_ps(yp + oh * ys2 + ow0);
        at = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ip + oh * is2 + ow0)));
      } else {
        float tg[8] = {0}, ty[8] = {0};
        uint8_t ti[16] = {0};
        memcpy(tg, gp + oh * gs2 + ow0, (size_t)n * sizeof *tg), memcpy(ty, yp + oh * ys2 + ow0, (size_t)n * sizeof *ty);
        memcpy(ti, ip + oh * is2 + ow0, (size_t)n);
        g = _mm256_loadu_ps(tg), y = _mm256_loadu_ps(ty), at = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)ti));
      }
      __m256 pos = _mm256_cmp_ps(y, zero, _CMP_GT_OQ);
      for (int i = 0; i < 2; i++) {
        __m256 e = _mm256_and_ps(pos, _mm256_castsi256_ps(_mm256_cmpeq_epi32(at, _mm256_set1_epi32(2 * i))));
        __m256 o = _mm256_and_ps(pos, _mm256_castsi256_ps(_mm256_cmpeq_epi32(at, _mm256_set1_epi32(2 * i + 1))));
        __m256 ge = _mm256_and_ps(e, g), go = _mm256_and_ps(o, g);
        __m256 lo = _mm256_unpacklo_ps(ge, go), hi = _mm256_unpackhi_ps(ge, go);
        __m256 c0 = _mm256_permute2f128_ps(lo, hi, 0x20), c1 = _mm256_permute2f128_ps(lo, hi, 0x31);
        float *row = xp + (2 * oh + i) * W + 2 * ow0;
        if (n == 8) {
          _mm256_storeu_ps(row, c0), _mm256_storeu_ps(row + 8, c1);
        } else {
          float t[16];
          _mm256_storeu_ps(t, c0), _mm256_storeu_ps(t + 8, c1);
          memcpy(row, t, (size_t)(2 * n) * sizeof *row);
        }
      }
    }
    for (int i = 0; i < 2; i++)
      for (int64_t w = 2 * OW; w < W; w++) xp[(2 * oh + i) * W + w] = 0;
  }
  for (int64_t h = 2 * OH; h < H; h++)
    for (int64_t w = 0; w < W; w++) xp[h * W + w] = 0;
}
#endif

/* One f32 plane of RELU_MAX_POOL2D with tiling (kh, kw) windows, for a fused caller that
** has the pre-activation plane in a buffer of its own (cpu_conv_c1.c's one-channel conv): the
** same values and offsets as the kernel. */
void kiln__cpu_relu_max_pool_plane_f32(const float *xp, int64_t xs2, float *yp, int64_t ys2, uint8_t *ip, int64_t is2,
                                       int64_t kh, int64_t kw, int64_t OH, int64_t OW, bool fast) {
#ifdef MP_HAVE_AVX512
  if (kh == 2 && kw == 2 && mp_avx512_ok()) {
    rmp_fwd2_avx512(xp, xs2, yp, ys2, ip, is2, OH, OW);
    return;
  }
  if (kh == 2 && kw == 2 && fast && kiln__cpu_has_fma()) {
    rmp_fwd2_avx2(xp, xs2, yp, ys2, ip, is2, OH, OW, xp + (2 * OH - 1) * xs2 + 2 * OW); /* the rows pooled */
    return;
  }
#endif
  (void)fast;
  for (int64_t oh = 0; oh < OH; oh++)
    for (int64_t ow = 0; ow < OW; ow++) {
      const float *w0 = xp + oh * kh * xs2 + ow * kw;
      float best = w0[0];
      int at = 0;
      for (int64_t i = 0; i < kh; i++)
        for (int64_t jj = 0; jj < kw; jj++) {
          float v = w0[i * xs2 + jj];
          if (v > best || (v != v && best == best)) best = v, at = (int)(i * kw + jj);
        }
      yp[oh * ys2 + ow] = best < 0 ? 0.0f : best;
      ip[oh * is2 + ow] = (uint8_t)at;
    }
}

/* RELU_MAX_POOL2D_BACKWARD for 2x2 windows of one f32 plane into a dense (H, W) buffer of a
** fused caller's (cpu_conv_c1.c): every element written. False (nothing done) without AVX-512
** or AVX2, or unless fast (the caller's reading of kiln__cpu_portable_loops). */
bool kiln__cpu_relu_max_pool_bwd2_plane_f32(float *dx, int64_t H, int64_t W, const float *g, const float *y,
                                            const uint8_t *ix, int64_t OH, int64_t OW, bool fast) {
#ifdef MP_HAVE_AVX512
  if (fast && mp_avx512_ok()) {
    rmp_bwd2_avx512(dx, g, OW, y, OW, ix, OW, H, W, OH, OW);
    return true;
  }
  if (fast && kiln__cpu_has_fma()) {
    rmp_bwd2_avx2(dx, g, OW, y, OW, ix, OW, H, W, OH, OW);
    return true;
  }
#endif
  (void)dx, (void)H, (void)W, (void)g, (void)y, (void)ix, (void)OH, (void)OW, (void)fast;
  return false;
}

/* planes q = n*C + c */
static void rmp_fwd_planes(void *vctx, int64_t lo, int64_t hi) {
  const rmp_job *j = vctx;
#ifdef MP_HAVE_AVX512
  const bool avx2 = kiln__cpu_has_fma() && !kiln__cpu_portable_loops(); /* once a range: getenv is not free */
#endif
  const kiln__view *x = &j->a->in[0], *y = &j->a->out[0], *ix = &j->a->out[1];
  const kiln__conv_params *p = j->p;
  int64_t C = y->shape[1], OH = y->shape[2], OW = y->shape[3], kh = p->kernel[0], kw = p->kernel[1];
#ifdef MP_HAVE_AVX512
  const float *xend = (const float *)x->data + kiln__view_extent(x); /* past x's last element */
#endif
  for (int64_t q = lo; q < hi; q++) {
    int64_t n = q / C, c = q % C;
    const float *xb = (const float *)x->data + n * x->strides[0] + c * x->strides[1];
    float *yb = (float *)y->data + n * y->strides[0] + c * y->strides[1];
    uint8_t *ib = (uint8_t *)ix->data + n * ix->strides[0] + c * ix->strides[1];
#ifdef MP_HAVE_AVX512
    if (kh == 2 && kw == 2 && x->strides[3] == 1 && y->strides[3] == 1 && ix->strides[3] == 1 && mp_avx512_ok()) {
      rmp_fwd2_avx512(xb, x->strides[2], yb, y->strides[2], ib, ix->strides[2], OH, OW);
      continue;
    }
    if (kh == 2 && kw == 2 && x->strides[3] == 1 && y->strides[3] == 1 && ix->strides[3] == 1 && avx2) {
      rmp_fwd2_avx2(xb, x->strides[2], yb, y->strides[2], ib, ix->strides[2], OH, OW, xend);
      continue;
    }
#endif
    for (int64_t oh = 0; oh < OH; oh++)
      for (int64_t ow = 0; ow < OW; ow++) {
        const int64_t h0 = oh * kh, w0 = ow * kw;
        float best = xb[h0 * x->strides[2] + w0 * x->strides[3]];
        int at = 0;
        for (int64_t i = 0; i < kh; i++)
          for (int64_t jj = 0; jj < kw; jj++) {
            float v = xb[(h0 + i) * x->strides[2] + (w0 + jj) * x->strides[3]];
            if (v > best || (v != v && best == best)) best = v, at = (int)(i * kw + jj);
          }
        yb[oh * y->strides[2] + ow * y->strides[3]] = best < 0 ? 0.0f : best;
        ib[oh * ix->strides[2] + ow * ix->strides[3]] = (uint8_t)at;
      }
  }
}

static void rmp_bwd_planes(void *vctx, int64_t lo, int64_t hi) {
  const rmp_job *j = vctx;
  const kiln__view *g = &j->a->in[0], *y = &j->a->in[1], *ix = &j->a->in[2], *dx = &j->a->out[0];
#ifdef MP_HAVE_AVX512
  const bool avx2 = kiln__cpu_has_fma() && !kiln__cpu_portable_loops(); /* once a range: getenv is not free */
#endif
  const kiln__conv_params *p = j->p;
  int64_t C = dx->shape[1], H = dx->shape[2], W = dx->shape[3], OH = g->shape[2], OW = g->shape[3];
  int64_t kh = p->kernel[0], kw = p->kernel[1];
  for (int64_t q = lo; q < hi; q++) {
    int64_t n = q / C, c = q % C;
    float *xb = (float *)dx->data + n * dx->strides[0] + c * dx->strides[1];
    const float *gb = (const float *)g->data + n * g->strides[0] + c * g->strides[1];
    const float *yb = (const float *)y->data + n * y->strides[0] + c * y->strides[1];
    const uint8_t *ib = (const uint8_t *)ix->data + n * ix->strides[0] + c * ix->strides[1];
#ifdef MP_HAVE_AVX512
    if (kh == 2 && kw == 2 && dx->strides[3] == 1 && dx->strides[2] == W && g->strides[3] == 1 && y->strides[3] == 1 &&
        ix->strides[3] == 1 && mp_avx512_ok()) {
      rmp_bwd2_avx512(xb, gb, g->strides[2], yb, y->strides[2], ib, ix->strides[2], H, W, OH, OW);
      continue;
    }
    if (kh == 2 && kw == 2 && dx->strides[3] == 1 && dx->strides[2] == W && g->strides[3] == 1 && y->strides[3] == 1 &&
        ix->strides[3] == 1 && avx2) {
      rmp_bwd2_avx2(xb, gb, g->strides[2], yb, y->strides[2], ib, ix->strides[2], H, W, OH, OW);
      continue;
    }
#endif
    for (int64_t h = 0; h < H; h++)
      for (int64_t w = 0; w < W; w++) xb[h * dx->strides[2] + w * dx->strides[3]] = 0.0f;
    for (int64_t oh = 0; oh < OH; oh++)
      for (int64_t ow = 0; ow < OW; ow++) {
        if (!(yb[oh * y->strides[2] + ow * y->strides[3]] > 0)) continue;
        int at = ib[oh * ix->strides[2] + ow * ix->strides[3]];
        int64_t h = oh * kh + at / kw, w = ow * kw + at % kw;
        xb[h * dx->strides[2] + w * dx->strides[3]] = gb[oh * g->strides[2] + ow * g->strides[3]];
      }
  }
}

/* RELU_MAX_POOL2D_BACKWARD for any window (overlapping, padded, no dilation), any float
** dtype and strides: per pixel, the windows that cover it in order (oh, then ow), each
** adding g where its offset names the pixel and y > 0, in f64, rounded once. The reference
** for CUDA's gather (kiln__batch_norm_relu_max_pool2d's backward); the tiling f32 loops
** above are its fast case. */
static bool rmp_bwd_general_ok(const kiln__kargs *a) {
  const kiln__conv_params *p = a->params;
  if (!p || a->op != KILN__K_RELU_MAX_POOL2D_BACKWARD || a->n_in != 3 || a->n_out != 1) return false;
  const kiln__view *g = &a->in[0], *y = &a->in[1], *o = &a->in[2], *x = &a->out[0];
  if (g->ndim != 4 || y->ndim != 4 || o->ndim != 4 || x->ndim != 4 || !kiln__cpu_is_float(x->dtype) ||
      g->dtype != x->dtype || y->dtype != x->dtype || o->dtype != KILN_U8)
    return false;
  for (int d = 0; d < 2; d++) {
    if (p->kernel[d] < 1 || p->stride[d] < 1 || p->padding[d] < 0 || p->dilation[d] != 1) return false;
    int64_t od = (x->shape[2 + d] + 2 * p->padding[d] - p->kernel[d]) / p->stride[d] + 1;
    if (g->shape[2 + d] != od || y->shape[2 + d] != od || o->shape[2 + d] != od) return false;
  }
  for (int d = 0; d < 2; d++)
    if (g->shape[d] != x->shape[d] || y->shape[d] != x->shape[d] || o->shape[d] != x->shape[d]) return false;
  return p->kernel[0] * p->kernel[1] <= 256;
}

static void rmp_bwd_general(void *vctx, int64_t lo, int64_t hi) {
  const rmp_job *j = vctx;
  const kiln__view *g = &j->a->in[0], *y = &j->a->in[1], *o = &j->a->in[2], *x = &j->a->out[0];
  const kiln__conv_params *p = j->p;
  const size_t es = kiln_dtype_size(x->dtype);
  const int64_t H = x->shape[2], W = x->shape[3], OH = g->shape[2], OW = g->shape[3];
  for (int64_t q = lo; q < hi; q++) {
    const char *gp = (const char *)g->data + kiln__cpu_plane_off(g, q), *yp = (const char *)y->data + kiln__cpu_plane_off(y, q);
    const uint8_t *op = (const uint8_t *)o->data + kiln__cpu_plane_off(o, q);
    char *xp = (char *)x->data + kiln__cpu_plane_off(x, q);
    for (int64_t h = 0; h < H; h++)
      for (int64_t w = 0; w < W; w++) {
        const int64_t nh = h + p->padding[0] - p->kernel[0] + 1, nw = w + p->padding[1] - p->kernel[1] + 1;
        const int64_t oh0 = nh > 0 ? (nh + p->stride[0] - 1) / p->stride[0] : 0;
        const int64_t ow0 = nw > 0 ? (nw + p->stride[1] - 1) / p->stride[1] : 0;
        int64_t oh1 = (h + p->padding[0]) / p->stride[0], ow1 = (w + p->padding[1]) / p->stride[1];
        if (oh1 > OH - 1) oh1 = OH - 1;
        if (ow1 > OW - 1) ow1 = OW - 1;
        double acc = 0;
        for (int64_t oh = oh0; oh <= oh1; oh++)
          for (int64_t ow = ow0; ow <= ow1; ow++) {
            const int64_t tap = (h + p->padding[0] - oh * p->stride[0]) * p->kernel[1] + (w + p->padding[1] - ow * p->stride[1]);
            if (op[oh * o->strides[2] + ow * o->strides[3]] != tap) continue;
            if (!(kiln__cpu_get_f64(yp + (oh * y->strides[2] + ow * y->strides[3]) * (int64_t)es, y->dtype) > 0)) continue;
            acc += kiln__cpu_get_f64(gp + (oh * g->strides[2] + ow * g->strides[3]) * (int64_t)es, g->dtype);
          }
        kiln__cpu_set_f64(xp + (h * x->strides[2] + w * x->strides[3]) * (int64_t)es, x->dtype, acc);
      }
  }
}

/* RELU_MAX_POOL2D / _BACKWARD: the arguments checked (the op layer asks first; a call that
** gets here otherwise is a bug, reported, not run). */
kiln_status kiln__cpu_relu_max_pool2d(const kiln__kargs *a) {
  const kiln__conv_params *p = a->params;
  bool bw = a->op == KILN__K_RELU_MAX_POOL2D_BACKWARD;
  if (bw && p && !(tiles(p) && a->out[0].dtype == KILN_F32) && rmp_bwd_general_ok(a)) {
    const kiln__view *x = &a->out[0];
    int64_t planes = x->shape[0] * x->shape[1];
    if (planes == 0 || kiln__view_numel(x) == 0) return KILN_OK;
    rmp_job j = {a, p};
    kiln__cpu_parallel_for(planes, KILN__CPU_PAR_MIN_CHEAP / (x->shape[2] * x->shape[3] + 1) + 1, rmp_bwd_general, &j);
    return KILN_OK;
  }
  const kiln__view *big = bw ? &a->out[0] : &a->in[0], *small = bw ? &a->in[0] : &a->out[0];
  const kiln__view *y = bw ? &a->in[1] : &a->out[0], *ix = bw ? &a->in[2] : &a->out[1];
  kiln_dtype dt = big->dtype;
  bool ok = p && a->n_in == (bw ? 3 : 1) && a->n_out == (bw ? 1 : 2) && tiles(p) &&
            p->kernel[0] * p->kernel[1] <= 256 && dt == KILN_F32 &&
            small->dtype == dt && y->dtype == dt && ix->dtype == KILN_U8 && big->ndim == 4 && small->ndim == 4 &&
            y->ndim == 4 && ix->ndim == 4;
  for (int d = 0; ok && d < 4; d++)
    ok = small->shape[d] == y->shape[d] && small->shape[d] == ix->shape[d] &&
         (d < 2 ? big->shape[d] == small->shape[d] : big->shape[d] / p->kernel[d - 2] == small->shape[d]);
  if (!ok)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln: %s: arguments the CPU kernel does not take",
                          bw ? "relu_max_pool2d_backward" : "relu_max_pool2d");
  int64_t planes = big->shape[0] * big->shape[1];
  if (planes == 0 || kiln__view_numel(big) == 0) return KILN_OK;
  rmp_job j = {a, p};
  int64_t per = big->shape[2] * big->shape[3] + 1;
  kiln__cpu_parallel_for(planes, KILN__CPU_PAR_MIN_CHEAP / per + 1, bw ? rmp_bwd_planes : rmp_fwd_planes, &j);
  return KILN_OK;
}

/* ---- the general loops: any float dtype, any strides ------------------------------------ */
/* The definition of max_pool2d and its backward that the kernels above reproduce bit for
** bit (the header gives the rules); the comparisons in f64, exact for every float dtype. */

/* MAX_POOL2D */

static void max_pool_range(void *vctx, int64_t lo, int64_t hi) {
  const mp_job *j = vctx;
  const kiln__view *x = &j->a->in[0], *y = &j->a->out[0], *ix = &j->a->out[1];
  const kiln__conv_params *p = j->p;
  size_t es = kiln_dtype_size(x->dtype), yes = kiln_dtype_size(y->dtype), ies = kiln_dtype_size(ix->dtype);
  int64_t H = x->shape[2], W = x->shape[3], OH = y->shape[2], OW = y->shape[3];
  for (int64_t q = lo; q < hi; q++) {
    const char *xp = (const char *)x->data + kiln__cpu_plane_off(x, q);
    char *yp = (char *)y->data + kiln__cpu_plane_off(y, q);
    char *ip = (char *)ix->data + kiln__cpu_plane_off(ix, q);
    for (int64_t oh = 0; oh < OH; oh++)
      for (int64_t ow = 0; ow < OW; ow++) {
        double best = -INFINITY;
        int64_t at = -1;
        for (int64_t i = 0; i < p->kernel[0]; i++) {
          int64_t h = oh * p->stride[0] - p->padding[0] + i * p->dilation[0];
          if (h < 0 || h >= H) continue;
          for (int64_t jj = 0; jj < p->kernel[1]; jj++) {
            int64_t w = ow * p->stride[1] - p->padding[1] + jj * p->dilation[1];
            if (w < 0 || w >= W) continue;
            double v = kiln__cpu_get_f64(xp + (h * x->strides[2] + w * x->strides[3]) * (int64_t)es, x->dtype);
            if (at < 0 || v > best || (isnan(v) && !isnan(best))) best = v, at = h * W + w;
          }
        }
        kiln__cpu_set_f64(yp + (oh * y->strides[2] + ow * y->strides[3]) * (int64_t)yes, y->dtype, best);
        kiln__cpu_set_i64(ip + (oh * ix->strides[2] + ow * ix->strides[3]) * (int64_t)ies, ix->dtype, at < 0 ? 0 : at);
      }
  }
}

/* MAX_POOL2D_BACKWARD */

/* Windows that do not overlap (each no taller or wider than its stride, no dilation) send
** each pixel at most one gradient: dx is zeros with g written where the indices point, which
** is exactly what the general loop computes, at a fraction of its cost (no search of the
** windows around every pixel, no per-element dtype dispatch). f32, rows packed. */
static bool max_pool_bwd_f32_disjoint(const kiln__view *g, const kiln__view *ix, const kiln__view *dx,
                                      const kiln__conv_params *p) {
  return g->dtype == KILN_F32 && dx->dtype == KILN_F32 && ix->dtype == KILN_I64 && dx->strides[3] == 1 &&
         dx->strides[2] == dx->shape[3] && p->kernel[0] <= p->stride[0] && p->kernel[1] <= p->stride[1] &&
         p->dilation[0] == 1 && p->dilation[1] == 1;
}

static void max_pool_bwd_plane_f32(const kiln__view *g, const kiln__view *ix, const kiln__conv_params *p, float *xp,
                                   const char *gp, const char *ip, int64_t H, int64_t W) {
  int64_t OH = g->shape[2], OW = g->shape[3];
  memset(xp, 0, (size_t)(H * W) * sizeof *xp);
  for (int64_t oh = 0; oh < OH; oh++)
    for (int64_t ow = 0; ow < OW; ow++) {
      int64_t at = *(const int64_t *)(ip + (oh * ix->strides[2] + ow * ix->strides[3]) * (int64_t)sizeof(int64_t));
      /* an index outside its window (kiln_max_pool2d_backward takes any indices; max_pool2d
      ** never makes one) adds nothing, as in the general loop */
      int64_t h = at / W, w = at % W, h0 = oh * p->stride[0] - p->padding[0], w0 = ow * p->stride[1] - p->padding[1];
      if (at < 0 || h >= H || h < h0 || h >= h0 + p->kernel[0] || w < w0 || w >= w0 + p->kernel[1]) continue;
      xp[at] = *(const float *)(gp + (oh * g->strides[2] + ow * g->strides[3]) * (int64_t)sizeof(float));
    }
}

/* Overlapping windows (ResNet's 3x3 stride 2), f32: each output's gradient is added at its
** index into an f64 plane, outputs in order, then the plane is rounded to dx. The general
** loop below searches up to kernel-size windows around every pixel with a dtype dispatch
** per element (12 ms for ResNet-18's 64x64x16x16 at batch 64); a pixel gets the same f64
** sum of the same gradients (at most four with a 3x3 stride-2 window, whose sum in f64 is
** exact but for exponent spreads beyond 29 bits), so the result is the same. */
static bool max_pool_bwd_f32_scatter(const kiln__view *g, const kiln__view *ix, const kiln__view *dx) {
  return g->dtype == KILN_F32 && dx->dtype == KILN_F32 && ix->dtype == KILN_I64;
}

static void max_pool_bwd_plane_scatter(const kiln__view *g, const kiln__view *ix, const kiln__view *dx,
                                       const kiln__conv_params *p, double *acc, int64_t q) {
  int64_t H = dx->shape[2], W = dx->shape[3], OH = g->shape[2], OW = g->shape[3];
  const char *gp = (const char *)g->data + kiln__cpu_plane_off(g, q), *ip = (const char *)ix->data + kiln__cpu_plane_off(ix, q);
  char *xp = (char *)dx->data + kiln__cpu_plane_off(dx, q);
  memset(acc, 0, (size_t)(H * W) * sizeof *acc);
  for (int64_t oh = 0; oh < OH; oh++)
    for (int64_t ow = 0; ow < OW; ow++) {
      int64_t at = *(const int64_t *)(ip + (oh * ix->strides[2] + ow * ix->strides[3]) * (int64_t)sizeof(int64_t));
      int64_t h = at / W, w = at % W;
      /* as the general loop: only an index inside its own window adds (dilated windows: on
      ** the window's grid) */
      int64_t dh = h + p->padding[0] - oh * p->stride[0], dw = w + p->padding[1] - ow * p->stride[1];
      if (at < 0 || h >= H || dh < 0 || dw < 0 || dh % p->dilation[0] || dw % p->dilation[1] ||
          dh / p->dilation[0] >= p->kernel[0] || dw / p->dilation[1] >= p->kernel[1])
        continue;
      acc[at] += *(const float *)(gp + (oh * g->strides[2] + ow * g->strides[3]) * (int64_t)sizeof(float));
    }
  for (int64_t h = 0; h < H; h++)
    for (int64_t w = 0; w < W; w++)
      *(float *)(xp + (h * dx->strides[2] + w * dx->strides[3]) * (int64_t)sizeof(float)) = (float)acc[h * W + w];
}

/* Per pixel, the windows that contain it (at most one per (i, j)), in that order; f64 sums. */
static void max_pool_bwd_range(void *vctx, int64_t lo, int64_t hi) {
  const mp_job *j = vctx;
  const kiln__view *g = &j->a->in[0], *ix = &j->a->in[1], *dx = &j->a->out[0];
  const kiln__conv_params *p = j->p;
  if (max_pool_bwd_f32_disjoint(g, ix, dx, p)) {
    for (int64_t q = lo; q < hi; q++)
      max_pool_bwd_plane_f32(g, ix, p, (float *)((char *)dx->data + kiln__cpu_plane_off(dx, q)),
                             (const char *)g->data + kiln__cpu_plane_off(g, q), (const char *)ix->data + kiln__cpu_plane_off(ix, q),
                             dx->shape[2], dx->shape[3]);
    return;
  }
  if (max_pool_bwd_f32_scatter(g, ix, dx)) {
    double *acc = malloc(sizeof(double) * (size_t)(dx->shape[2] * dx->shape[3] + 1));
    if (acc) {
      for (int64_t q = lo; q < hi; q++) max_pool_bwd_plane_scatter(g, ix, dx, p, acc, q);
      free(acc);
      return;
    } /* no memory for the plane: the general loop needs none */
  }
  size_t ges = kiln_dtype_size(g->dtype), ies = kiln_dtype_size(ix->dtype), xes = kiln_dtype_size(dx->dtype);
  int64_t H = dx->shape[2], W = dx->shape[3], OH = g->shape[2], OW = g->shape[3];
  for (int64_t q = lo; q < hi; q++) {
    const char *gp = (const char *)g->data + kiln__cpu_plane_off(g, q);
    const char *ip = (const char *)ix->data + kiln__cpu_plane_off(ix, q);
    char *xp = (char *)dx->data + kiln__cpu_plane_off(dx, q);
    for (int64_t h = 0; h < H; h++)
      for (int64_t w = 0; w < W; w++) {
        double acc = 0;
        for (int64_t i = 0; i < p->kernel[0]; i++) {
          int64_t hh = h + p->padding[0] - i * p->dilation[0];
          if (hh < 0 || hh % p->stride[0] || hh / p->stride[0] >= OH) continue;
          int64_t oh = hh / p->stride[0];
          for (int64_t jj = 0; jj < p->kernel[1]; jj++) {
            int64_t ww = w + p->padding[1] - jj * p->dilation[1];
            if (ww < 0 || ww % p->stride[1] || ww / p->stride[1] >= OW) continue;
            int64_t ow = ww / p->stride[1];
            int64_t at = kiln__cpu_get_i64(ip + (oh * ix->strides[2] + ow * ix->strides[3]) * (int64_t)ies, ix->dtype);
            if (at == h * W + w)
              acc += kiln__cpu_get_f64(gp + (oh * g->strides[2] + ow * g->strides[3]) * (int64_t)ges, g->dtype);
          }
        }
        kiln__cpu_set_f64(xp + (h * dx->strides[2] + w * dx->strides[3]) * (int64_t)xes, dx->dtype, acc);
      }
  }
}

/* MAX_POOL2D / _BACKWARD by the general loops, the arguments checked. */
static kiln_status mp_general(const kiln__kargs *a) {
  const kiln__conv_params *p = a->params;
  if (!p) return kiln_set_error(KILN_ERR_INTERNAL, "kiln: %s without its window parameters", kiln__kop_name(a->op));
  if (a->op != KILN__K_MAX_POOL2D && a->op != KILN__K_MAX_POOL2D_BACKWARD)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln: %s is not a max-pool kernel", kiln__kop_name(a->op));
  bool bw = a->op == KILN__K_MAX_POOL2D_BACKWARD;
  const kiln__view *v = bw ? &a->out[0] : &a->in[0];
  if (bw && (a->n_in < 2 || a->in[0].ndim != 4 || a->in[1].ndim != 4 || v->ndim != 4 ||
             kiln__cpu_is_float(a->in[1].dtype)))
    return kiln_set_error(KILN_ERR_SHAPE,
                          "kiln: max_pool2d_backward takes a 4-d grad, its integer indices and a 4-d dx");
  if (!kiln__cpu_is_float(v->dtype)) return kiln__cpu_dtype_error(a, v->dtype);
  int64_t planes = v->shape[0] * v->shape[1];
  if (planes == 0) return KILN_OK;
  mp_job j = {a, p, false};
  int64_t per = kiln__view_numel(&a->in[0]) / planes + 1;
  kiln__cpu_parallel_for(planes, KILN__CPU_PAR_MIN / per + 1, bw ? max_pool_bwd_range : max_pool_range, &j);
  return KILN_OK;
}

/* ---- entry ------------------------------------------------------------------------------- */

static bool fast_dtype(kiln_dtype dt) { return dt == KILN_F32 || dt == KILN_BF16; }

/* dx dense in NCHW (cl false) or channels-last (cl true). */
static bool dense(const kiln__view *v, bool cl) {
  int64_t C = v->shape[1], H = v->shape[2], W = v->shape[3];
  if (cl) return v->strides[1] == 1 && v->strides[3] == C && v->strides[2] == W * C && v->strides[0] == H * W * C;
  return v->strides[3] == 1 && v->strides[2] == W && v->strides[1] == H * W && v->strides[0] == C * H * W;
}

kiln_status kiln__cpu_max_pool2d(const kiln__kargs *a) {
  const kiln__conv_params *p = a->params;
  if (!p) return mp_general(a);
  if (a->op == KILN__K_MAX_POOL2D) {
    if (a->n_in < 1 || a->n_out < 2 || a->in[0].ndim != 4 || a->out[0].ndim != 4 || a->out[1].ndim != 4)
      return mp_general(a);
    const kiln__view *x = &a->in[0], *y = &a->out[0], *ix = &a->out[1];
    if (!fast_dtype(x->dtype) || y->dtype != x->dtype || ix->dtype != KILN_I64 ||
        x->shape[2] * x->shape[3] >= INT32_MAX)
      return mp_general(a);
    int64_t N = y->shape[0], C = y->shape[1], OH = y->shape[2], OW = y->shape[3];
    if (N * C * OH * OW == 0) return KILN_OK;
    int64_t win = p->kernel[0] * p->kernel[1];
    mp_job j = {a, p, false};
    bool cl = x->strides[1] == 1 && x->strides[3] != 1 && C > 1;
    if (cl) {
      int64_t items = N * OH * OW, per = C * win + 1;
      kiln__cpu_parallel_for(items, KILN__CPU_PAR_MIN_CHEAP / per + 1, mp_pixels, &j);
    } else if (x->strides[3] == 1) {
      int64_t items = N * C, per = OH * OW * win + 1;
      kiln__cpu_parallel_for(items, KILN__CPU_PAR_MIN_CHEAP / per + 1, mp_planes, &j);
    } else {
      return mp_general(a);
    }
    if (j.oom) return kiln_set_error(KILN_ERR_OOM, "kiln: max_pool2d: out of host memory for a row buffer");
    return KILN_OK;
  }
  if (a->op == KILN__K_MAX_POOL2D_BACKWARD) {
    if (a->n_in < 2 || a->in[0].ndim != 4 || a->in[1].ndim != 4 || a->out[0].ndim != 4)
      return mp_general(a); /* which sets the error */
    const kiln__view *g = &a->in[0], *ix = &a->in[1], *dx = &a->out[0];
    if (!fast_dtype(dx->dtype) || g->dtype != dx->dtype || ix->dtype != KILN_I64) return mp_general(a);
    bool cl = dense(dx, true) && dx->shape[1] > 1 && !dense(dx, false);
    if (!cl && !dense(dx, false)) return mp_general(a);
    int64_t N = dx->shape[0], C = dx->shape[1];
    if (N * C * dx->shape[2] * dx->shape[3] == 0) return KILN_OK;
    mpb_job j = {a, p, cl, false};
    int64_t items = cl ? N : N * C, per = kiln__view_numel(dx) / items + 1;
    kiln__cpu_parallel_for(items, KILN__CPU_PAR_MIN_CHEAP / per + 1, mpb_planes, &j);
    if (j.oom) return kiln_set_error(KILN_ERR_OOM, "kiln: max_pool2d_backward: out of host memory for a plane buffer");
    return KILN_OK;
  }
  return mp_general(a);
}
