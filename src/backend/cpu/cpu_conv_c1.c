/*
** Convolutions of one input channel, stride 1, by direct loops: CONV2D and
** CONV2D_BACKWARD_WEIGHT (with the bias gradient) for the cases kiln__cpu_conv_c1_takes
** names, and CONV1_RELU_MAX_POOL2D with its backward (the conv, ReLU and a tiling max-pool
** in one pass, the pool by cpu_maxpool.c's plane loops).
**
** A convolution of one input channel (the first layer of an image CNN: Fashion-MNIST's
** 1 -> 32 3x3 on 28x28) is a few multiply-adds per output, so its cost is writing the
** output (and, for the weight gradient, reading the gradient). oneDNN's kernel for it
** writes NHWC, which then has to be reordered to NCHW: 0.8 + 1.3 ms at batch 128, where
** these loops take about the time of one pass over the output; the weight gradient
** likewise skips oneDNN's reorder of the gradient to blocked (1.1 ms of 1.8). f32 sums in
** tap order for the output (the products PyTorch's f32 adds); the weight gradient sums each
** row in f32 and the rows in f64, and the bias gradient (out1, when asked) each gradient
** plane the same way.
**
** No oneDNN here: the CONV2D dispatch (cpu_conv.c) picks these loops or oneDNN's primitive
** (cpu_dnnl.c). Built beside oneDNN only, as CONV2D is: without it the CPU has no CONV2D
** kernel (the op layer composes IM2COL + MATMUL), and CONV1_RELU_MAX_POOL2D's contract is
** the bits of CONV2D then RELU_MAX_POOL2D, i.e. of these loops, not of the GEMM.
*/
#include "cpu.h"
#include "cpu_iter.h"

#ifdef KILN_HAVE_DNNL
#include <stdlib.h>
#include <string.h>

/* the padded plane and the extended output (floats): stack buffers */
#define C1_MAX 4096
/* zeros past the padded plane (floats): the AVX2 3x3 loops load whole 8-lane chunks past a
** row's last column (the lanes past it computed, never stored) */
#define C1_SLACK 32

/* f32 and contiguous, 4-d where it is an image, a weight or a gradient */
static bool c1_dense(const kiln__view *v, bool image) {
  return v->dtype == KILN_F32 && kiln__view_is_contiguous(v) && (!image || v->ndim == 4);
}

/* Whether these loops take the arguments: one group, f32 and contiguous throughout (the
** input, the weight, the output or gradient, the bias), one input channel, stride and
** dilation 1, at most 7x7 taps, a padded plane that fits C1_MAX. */
bool kiln__cpu_conv_c1_takes(const kiln__kargs *a) {
  if (a->op != KILN__K_CONV2D && a->op != KILN__K_CONV2D_BACKWARD_WEIGHT) return false;
  static int off = -1; /* KILN_CONV_C1=0: oneDNN for these too (for comparisons) */
  if (off < 0) {
    off = !kiln__knob_on("KILN_CONV_C1", true);
  }
  if (off || !a->params || a->n_in < 2 || a->n_out < 1 || a->i[0] != 1) return false;
  for (int i = 0; i < a->n_in; i++)
    if (!c1_dense(&a->in[i], i < 2)) return false;
  for (int i = 0; i < a->n_out; i++)
    if (!c1_dense(&a->out[i], i < 1)) return false;
  const kiln__view *x = &a->in[0];
  const kiln__view *w = a->op == KILN__K_CONV2D ? &a->in[1] : &a->out[0];
  const kiln__conv_params *p = a->params;
  return x->shape[1] == 1 && p->stride[0] == 1 && p->stride[1] == 1 && p->dilation[0] == 1 &&
         p->dilation[1] == 1 && w->shape[2] * w->shape[3] <= 49 &&
         (x->shape[2] + 2 * p->padding[0]) * (x->shape[3] + 2 * p->padding[1]) + w->shape[3] + C1_SLACK <= C1_MAX;
}

typedef struct c1_job {
  const kiln__kargs *a;
  int64_t H, W, OC, OH, OW, KH, KW, ph, pw;
  const float *x, *w, *b;
  float *y;
  /* CONV1_RELU_MAX_POOL2D (NULL pool otherwise): the pool's window and pooled size; the
  ** forward's outputs py, pix; the backward's pooled gradient pg, and the forward's py, pix */
  const kiln__conv_params *pool;
  int64_t POH, POW;
  float *py;
  uint8_t *pix;
  const float *pg;
} c1_job;

/* Image n's plane zero-padded into xp ((H + 2ph) x (W + 2pw), then KW + C1_SLACK zeros). Output
** (oh, ow) then reads xp[(oh + i) * Wp + ow + j] for tap (i, j): over the "extended" output
** of OH rows of Wp columns (the last Wp - OW of each row unused) each tap is one long
** unit-stride loop, with no bounds logic, that the compiler vectorises. */
static void c1_pad(const c1_job *j, int64_t n, float *xp) {
  int64_t Wp = j->W + 2 * j->pw, Hp = j->H + 2 * j->ph;
  memset(xp, 0, (size_t)(Hp * Wp + j->KW + C1_SLACK) * sizeof *xp);
  const float *x = j->x + n * j->H * j->W;
  for (int64_t h = 0; h < j->H; h++) memcpy(xp + (h + j->ph) * Wp + j->pw, x + h * j->W, (size_t)j->W * sizeof *xp);
}

/* AVX-512 (x86-64 with GCC or clang, checked at run time): kiln's build targets the
** baseline x86-64, where the loops here compile to 4-wide SSE. */
#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(KILN_NO_TARGET_CLONES)
#include <immintrin.h>
#include "cpu_pool2_avx2.h"
#define C1_HAVE_AVX512 1
static bool c1_avx512_ok(void) {
  static int ok = -1;
  if (ok < 0) ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
  return ok;
}
/* AVX2 without AVX-512 (most laptops and desktops: AMD before Zen 4, Intel's client CPUs),
** where the portable loops were the whole path */
static bool c1_avx2_ok(void) {
  static int ok = -1;
  if (ok < 0) ok = !c1_avx512_ok() && kiln__cpu_has_fma(); /* AVX2 (and FMA, unused here) */
  return ok;
}

/* c1_plane_avx512 on 8 lanes: each output row in chunks of 8, the bias then the taps in
** (i, j) order, a product then a sum each: the portable loop's operations per output in its
** order, the same bits. Full chunks load and store plainly; the row's tail loads masked and
** stores through a buffer (AMD's masked stores are microcoded: one a chunk made this slower
** than the portable loops). */
__attribute__((target("avx2"))) static void c1_plane_avx2(const c1_job *j, const float *xp, int64_t oc, float *yp) {
  int64_t Wp = j->W + 2 * j->pw, OW = j->OW, T = j->KH * j->KW, full = OW / 8 * 8;
  const float *wp = j->w + oc * T;
  __m256 wv[49];
  for (int64_t t = 0; t < T; t++) wv[t] = _mm256_set1_ps(wp[t]);
  __m256 bv = _mm256_set1_ps(j->b ? j->b[oc] : 0.0f);
  __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(OW - full)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int64_t oh = 0; oh < j->OH; oh++) {
    for (int64_t ow = 0; ow < full; ow += 8) {
      __m256 acc = bv;
      for (int64_t i = 0; i < j->KH; i++) {
        const float *xr = xp + (oh + i) * Wp + ow;
        for (int64_t jj = 0; jj < j->KW; jj++)
          acc = _mm256_add_ps(acc, _mm256_mul_ps(wv[i * j->KW + jj], _mm256_loadu_ps(xr + jj)));
      }
      _mm256_storeu_ps(yp + oh * OW + ow, acc);
    }
    if (full < OW) {
      __m256 acc = bv;
      for (int64_t i = 0; i < j->KH; i++) {
        const float *xr = xp + (oh + i) * Wp + full;
        for (int64_t jj = 0; jj < j->KW; jj++)
          acc = _mm256_add_ps(acc, _mm256_mul_ps(wv[i * j->KW + jj], _mm256_maskload_ps(xr + jj, m)));
      }
      float tail[8];
      _mm256_storeu_ps(tail, acc);
      memcpy(yp + oh * OW + full, tail, (size_t)(OW - full) * sizeof *yp);
    }
  }
}

/* Two 3x3 conv output rows of eight columns from the four input rows at x (stride Wp):
** each output the bias then its nine products in (i, j) order, the middle rows' loads shared */
__attribute__((target("avx2"))) static inline void c1_rows3_avx2(const float *x, int64_t Wp, const __m256 w[9],
                                                                 __m256 bv, __m256 *r0, __m256 *r1) {
  __m256 a0 = bv, a1 = bv;
  for (int r = 0; r < 4; r++)
    for (int c = 0; c < 3; c++) {
      __m256 v = _mm256_loadu_ps(x + r * Wp + c);
      if (r < 3) a0 = _mm256_add_ps(a0, _mm256_mul_ps(w[r * 3 + c], v));
      if (r > 0) a1 = _mm256_add_ps(a1, _mm256_mul_ps(w[(r - 1) * 3 + c], v));
    }
  *r0 = a0, *r1 = a1;
}

/* c1_plane_avx2 for 3x3 kernels (fmnist-cnn's): the nine weights in registers, taps
** unrolled, two output rows a step sharing the loads of their middle input rows (each
** output still gets the bias then its nine products in (i, j) order: the same bits). The
** row's last chunk loads plainly past its end (c1_pad's slack; those lanes are not
** stored): AMD's masked loads are slow. */
__attribute__((target("avx2"))) static void c1_plane3_avx2(const c1_job *j, const float *xp, int64_t oc, float *yp) {
  int64_t Wp = j->W + 2 * j->pw, OW = j->OW, OH = j->OH;
  const float *wp = j->w + oc * 9;
  __m256 w[9];
  for (int t = 0; t < 9; t++) w[t] = _mm256_set1_ps(wp[t]);
  __m256 bv = _mm256_set1_ps(j->b ? j->b[oc] : 0.0f);
  for (int64_t ow = 0; ow < OW; ow += 8) {
    int64_t n = OW - ow < 8 ? OW - ow : 8;
    int64_t oh = 0;
    for (; oh + 2 <= OH; oh += 2) {
      __m256 a0, a1;
      c1_rows3_avx2(xp + oh * Wp + ow, Wp, w, bv, &a0, &a1);
      if (n == 8) {
        _mm256_storeu_ps(yp + oh * OW + ow, a0);
        _mm256_storeu_ps(yp + (oh + 1) * OW + ow, a1);
      } else {
        float t0[8], t1[8];
        _mm256_storeu_ps(t0, a0), _mm256_storeu_ps(t1, a1);
        memcpy(yp + oh * OW + ow, t0, (size_t)n * sizeof *yp);
        memcpy(yp + (oh + 1) * OW + ow, t1, (size_t)n * sizeof *yp);
      }
    }
    for (; oh < OH; oh++) {
      __m256 a0 = bv;
      for (int r = 0; r < 3; r++)
        for (int c = 0; c < 3; c++)
          a0 = _mm256_add_ps(a0, _mm256_mul_ps(w[r * 3 + c], _mm256_loadu_ps(xp + (oh + r) * Wp + ow + c)));
      float t0[8];
      _mm256_storeu_ps(t0, a0);
      memcpy(yp + oh * OW + ow, t0, (size_t)n * sizeof *yp);
    }
  }
}

/* CONV1_RELU_MAX_POOL2D's 3x3 conv and 2x2 pool of one plane in AVX2 registers: each
** pooled row's two conv rows, sixteen columns at a time, computed as c1_plane3_avx2 computes
** them (the same bits) and pooled as RELU_MAX_POOL2D pools them (kiln__rmp2_avx2), never
** stored. An odd last conv row, which the pool drops, is not computed. */
__attribute__((target("avx2"))) static void c1p_plane3_pool2_avx2(const c1_job *j, const float *xp, int64_t oc,
                                                                  float *py, uint8_t *pix) {
  int64_t Wp = j->W + 2 * j->pw, POH = j->POH, POW = j->POW;
  const float *wp = j->w + oc * 9;
  __m256 w[9];
  for (int t = 0; t < 9; t++) w[t] = _mm256_set1_ps(wp[t]);
  __m256 bv = _mm256_set1_ps(j->b ? j->b[oc] : 0.0f);
  for (int64_t ph = 0; ph < POH; ph++)
    for (int64_t pw0 = 0; pw0 < POW; pw0 += 8) {
      __m256 c[2][2]; /* [conv row][columns 0-7, 8-15] */
      for (int h = 0; h < 2; h++) {
        c1_rows3_avx2(xp + 2 * ph * Wp + 2 * pw0 + 8 * h, Wp, w, bv, &c[0][h], &c[1][h]);
      }
      __m256i at;
      __m256 best = kiln__rmp2_avx2(c[0][0], c[0][1], c[1][0], c[1][1], &at);
      kiln__rmp2_store_avx2(py + ph * POW + pw0, pix + ph * POW + pw0, best, at, POW - pw0 < 8 ? POW - pw0 : 8);
    }
}

/* planes q = n*OC + oc of y by a SIMD copy of c1_plane (plane3 for 3x3 kernels), each image
** padded once */
typedef void (*c1_plane_fn)(const c1_job *j, const float *xp, int64_t oc, float *yp);
static void c1_fwd_planes(const c1_job *j, int64_t lo, int64_t hi, c1_plane_fn plane3, c1_plane_fn plane) {
  float xp[C1_MAX];
  int64_t padded = -1;
  c1_plane_fn fn = j->KH == 3 && j->KW == 3 ? plane3 : plane;
  for (int64_t q = lo; q < hi; q++) {
    int64_t n = q / j->OC, oc = q % j->OC;
    if (n != padded) c1_pad(j, n, xp), padded = n;
    fn(j, xp, oc, j->y + q * j->OH * j->OW);
  }
}

static void c1_fwd_range_avx2(void *vctx, int64_t lo, int64_t hi) {
  c1_fwd_planes(vctx, lo, hi, c1_plane3_avx2, c1_plane_avx2);
}

/* c1_fwd_range with each output row in registers: 16 outputs a step (the last step
** masked), the bias then the taps in (i, j) order, a product then a sum each (kiln builds
** with -ffp-contract=off: no fused multiply-add), so each output gets the same f32
** operations in the same order as the portable loop below, and the same bits; written
** straight into y, without the extended row and its copy. */
__attribute__((target("avx512f,avx512vl"))) static void c1_plane_avx512(const c1_job *j, const float *xp, int64_t oc,
                                                                        float *yp) {
  int64_t Wp = j->W + 2 * j->pw, OW = j->OW;
  const float *wp = j->w + oc * j->KH * j->KW;
  __m512 bv = _mm512_set1_ps(j->b ? j->b[oc] : 0.0f);
  {
    for (int64_t oh = 0; oh < j->OH; oh++)
      for (int64_t ow = 0; ow < OW; ow += 16) {
        __mmask16 m = OW - ow >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (OW - ow)) - 1);
        __m512 acc = bv;
        for (int64_t i = 0; i < j->KH; i++) {
          const float *xr = xp + (oh + i) * Wp + ow;
          for (int64_t jj = 0; jj < j->KW; jj++)
            acc = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_set1_ps(wp[i * j->KW + jj]), _mm512_maskz_loadu_ps(m, xr + jj)));
        }
        _mm512_mask_storeu_ps(yp + oh * OW + ow, m, acc);
      }
  }
}

/* c1_plane_avx512 for 3x3 kernels (fmnist-cnn's): the nine weights held in registers and
** two output rows a step, which share the loads of their middle input rows; each output
** still gets the bias then the nine products in (i, j) order, so the same bits. */
__attribute__((target("avx512f,avx512vl"))) static void c1_plane3_avx512(const c1_job *j, const float *xp, int64_t oc,
                                                                         float *yp) {
  int64_t Wp = j->W + 2 * j->pw, OW = j->OW, OH = j->OH;
  const float *wp = j->w + oc * 9;
  __m512 w[9];
  for (int t = 0; t < 9; t++) w[t] = _mm512_set1_ps(wp[t]);
  __m512 bv = _mm512_set1_ps(j->b ? j->b[oc] : 0.0f);
  for (int64_t ow = 0; ow < OW; ow += 16) {
    __mmask16 m = OW - ow >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (OW - ow)) - 1);
    int64_t oh = 0;
    for (; oh + 2 <= OH; oh += 2) {
      __m512 x[4][3];
      for (int r = 0; r < 4; r++)
        for (int c = 0; c < 3; c++) x[r][c] = _mm512_maskz_loadu_ps(m, xp + (oh + r) * Wp + ow + c);
      __m512 a0 = bv, a1 = bv;
      for (int i = 0; i < 3; i++)
        for (int c = 0; c < 3; c++) {
          a0 = _mm512_add_ps(a0, _mm512_mul_ps(w[i * 3 + c], x[i][c]));
          a1 = _mm512_add_ps(a1, _mm512_mul_ps(w[i * 3 + c], x[i + 1][c]));
        }
      _mm512_mask_storeu_ps(yp + oh * OW + ow, m, a0);
      _mm512_mask_storeu_ps(yp + (oh + 1) * OW + ow, m, a1);
    }
    for (; oh < OH; oh++) {
      __m512 a0 = bv;
      for (int i = 0; i < 3; i++)
        for (int c = 0; c < 3; c++)
          a0 = _mm512_add_ps(a0, _mm512_mul_ps(w[i * 3 + c], _mm512_maskz_loadu_ps(m, xp + (oh + i) * Wp + ow + c)));
      _mm512_mask_storeu_ps(yp + oh * OW + ow, m, a0);
    }
  }
}

static void c1_fwd_range_avx512(void *vctx, int64_t lo, int64_t hi) {
  c1_fwd_planes(vctx, lo, hi, c1_plane3_avx512, c1_plane_avx512);
}
#endif

/* output channel oc of image xp (padded) into yp (OH x OW); e: scratch of C1_MAX floats */
static void c1_plane(const c1_job *j, const float *xp, int64_t oc, float *yp, float *e) {
  int64_t Wp = j->W + 2 * j->pw, L = j->OH * Wp;
  const float *wp = j->w + oc * j->KH * j->KW;
  float bv = j->b ? j->b[oc] : 0.0f;
  for (int64_t k = 0; k < L; k++) e[k] = bv;
  for (int64_t i = 0; i < j->KH; i++)
    for (int64_t jj = 0; jj < j->KW; jj++) {
      float wv = wp[i * j->KW + jj];
      const float *xs = xp + i * Wp + jj;
      for (int64_t k = 0; k < L; k++) e[k] += wv * xs[k];
    }
  for (int64_t oh = 0; oh < j->OH; oh++) memcpy(yp + oh * j->OW, e + oh * Wp, (size_t)j->OW * sizeof *yp);
}

/* planes q = n*OC + oc of y */
static void c1_fwd_range(void *vctx, int64_t lo, int64_t hi) {
  const c1_job *j = vctx;
  float xp[C1_MAX], e[C1_MAX];
  int64_t padded = -1;
  for (int64_t q = lo; q < hi; q++) {
    int64_t n = q / j->OC, oc = q % j->OC;
    if (n != padded) c1_pad(j, n, xp), padded = n;
    c1_plane(j, xp, oc, j->y + q * j->OH * j->OW, e);
  }
}

/* CONV1_RELU_MAX_POOL2D's planes q = n*OC + oc: the conv plane into a buffer, then pooled
** (the full-size conv output is never written to memory) */
static void c1p_fwd_range(void *vctx, int64_t lo, int64_t hi) {
  const c1_job *j = vctx;
  float xp[C1_MAX], e[C1_MAX], cb[C1_MAX];
  int64_t padded = -1, PL = j->POH * j->POW;
  bool avx = false, avx2 = false, portable = kiln__cpu_portable_loops();
#ifdef C1_HAVE_AVX512
  avx = c1_avx512_ok() && !portable;
  avx2 = c1_avx2_ok() && !portable;
#endif
  for (int64_t q = lo; q < hi; q++) {
    int64_t n = q / j->OC, oc = q % j->OC;
    if (n != padded) c1_pad(j, n, xp), padded = n;
#ifdef C1_HAVE_AVX512
    if (avx2 && j->KH == 3 && j->KW == 3 && j->pool->kernel[0] == 2 && j->pool->kernel[1] == 2) {
      c1p_plane3_pool2_avx2(j, xp, oc, j->py + q * PL, j->pix + q * PL);
      continue;
    }
    if (avx && j->KH == 3 && j->KW == 3) c1_plane3_avx512(j, xp, oc, cb);
    else if (avx) c1_plane_avx512(j, xp, oc, cb);
    else if (avx2 && j->KH == 3 && j->KW == 3) c1_plane3_avx2(j, xp, oc, cb);
    else if (avx2) c1_plane_avx2(j, xp, oc, cb);
    else
#endif
      c1_plane(j, xp, oc, cb, e);
    (void)avx, (void)avx2;
    kiln__cpu_relu_max_pool_plane_f32(cb, j->OW, j->py + q * PL, j->POW, j->pix + q * PL, j->POW, j->pool->kernel[0],
                                      j->pool->kernel[1], j->POH, j->POW, !portable);
  }
}

/* output channels oc of dW: x is j->x, the gradient j->y (read), dW j->w (written). Inlined
** into a baseline and an AVX-512 copy: the 16 running sums are one register in the latter,
** each lane summing the same products in the same order, so both give the same bits. */
static inline __attribute__((always_inline)) void c1_wgrad_body(void *vctx, int64_t lo, int64_t hi) {
  const c1_job *j = vctx;
  int64_t N = j->a->in[0].shape[0], T = j->KH * j->KW, Wp = j->W + 2 * j->pw, L = j->OH * Wp;
  float *dw = (float *)j->w, *db = j->a->n_out > 1 ? j->a->out[1].data : NULL;
  float xp[C1_MAX], ge[C1_MAX];
  double acc[50]; /* the taps', then the bias's */
  int64_t off[256]; /* CONV1_RELU_MAX_POOL2D: window offset t -> its pixel in the grid */
  if (j->pool)
    for (int64_t t = 0; t < j->pool->kernel[0] * j->pool->kernel[1]; t++)
      off[t] = (t / j->pool->kernel[1]) * Wp + t % j->pool->kernel[1];
  for (int64_t oc = lo; oc < hi; oc++) {
    for (int64_t t = 0; t <= T; t++) acc[t] = 0;
    for (int64_t n = 0; n < N; n++) {
      c1_pad(j, n, xp);
      /* the gradient on the extended grid, zeros in the unused columns */
      memset(ge, 0, (size_t)L * sizeof *ge);
      if (j->pool) { /* CONV1_RELU_MAX_POOL2D: RELU_MAX_POOL2D's backward into the grid */
        /* every window writes its max's pixel (g, or +0 where y <= 0, as the memset): no
        ** branch on the data, no division */
        int64_t PL = j->POH * j->POW, pkh = j->pool->kernel[0], pkw = j->pool->kernel[1];
        const float *g = j->pg + (n * j->OC + oc) * PL, *yv = j->py + (n * j->OC + oc) * PL;
        const uint8_t *ix = j->pix + (n * j->OC + oc) * PL;
        for (int64_t oh = 0; oh < j->POH; oh++) {
          float *gr = ge + oh * pkh * Wp;
          for (int64_t ow = 0; ow < j->POW; ow++) {
            int64_t q = oh * j->POW + ow;
            gr[off[ix[q]] + ow * pkw] = yv[q] > 0 ? g[q] : 0.0f;
          }
        }
      } else {
        const float *gp = j->y + (n * j->OC + oc) * j->OH * j->OW;
        for (int64_t oh = 0; oh < j->OH; oh++) memcpy(ge + oh * Wp, gp + oh * j->OW, (size_t)j->OW * sizeof *ge);
      }
      for (int64_t i = 0; i < j->KH; i++)
        for (int64_t jj = 0; jj < j->KW; jj++) {
          const float *xs = xp + i * Wp + jj;
          float part[16] = {0}; /* 16 running f32 sums: one AVX-512 register */
          int64_t k = 0;
          for (; k + 16 <= L; k += 16)
            for (int v = 0; v < 16; v++) part[v] += ge[k + v] * xs[k + v];
          float s = 0.0f;
          for (; k < L; k++) s += ge[k] * xs[k];
          for (int v = 0; v < 16; v++) s += part[v];
          acc[i * j->KW + jj] += s;
        }
      if (db) { /* the bias: the plane's sum, the same way (the extended grid's zeros add nothing) */
        float part[16] = {0}, s = 0.0f;
        int64_t k = 0;
        for (; k + 16 <= L; k += 16)
          for (int v = 0; v < 16; v++) part[v] += ge[k + v];
        for (; k < L; k++) s += ge[k];
        for (int v = 0; v < 16; v++) s += part[v];
        acc[T] += s;
      }
    }
    for (int64_t t = 0; t < T; t++) dw[oc * T + t] = (float)acc[t];
    if (db) db[oc] = (float)acc[T];
  }
}

static void c1_wgrad_range(void *vctx, int64_t lo, int64_t hi) { c1_wgrad_body(vctx, lo, hi); }
#ifdef C1_HAVE_AVX512
__attribute__((target("avx512f,avx512vl"))) static void c1_wgrad_range_avx512(void *vctx, int64_t lo, int64_t hi) {
  c1_wgrad_body(vctx, lo, hi);
}
/* the 16 running sums as two 8-lane registers: each lane's order unchanged, the same bits */
__attribute__((target("avx2"))) static void c1_wgrad_range_avx2(void *vctx, int64_t lo, int64_t hi) {
  c1_wgrad_body(vctx, lo, hi);
}

/* c1_wgrad_body for 3x3 kernels: the image padded once per block of up to 32 channels
** (not once per channel), the nine taps' and the bias's running sums over one pass of the
** gradient grid (one load of it, not ten), in AVX-512 or AVX2 (c1_sums3_*). Each lane of
** each sum adds the same products in the same order, and the tail and the lanes are added
** as c1_wgrad_body adds them: the same bits. */

/* Channel oc's gradient grid of image n (q = n*OC + oc): a 2x2 pool's gradient by
** RELU_MAX_POOL2D_BACKWARD's plane loop where the CPU has one (AVX-512, AVX2) and fast, else zeros and
** each window's max pixel (g where y > 0); without a pool the gradient plane copied in. */
static void c1_grid3(const c1_job *j, int64_t q, int64_t Wp, int64_t L, float *ge, bool fast) {
  int64_t PL = j->POH * j->POW;
  if (j->pool && j->pool->kernel[0] == 2 && j->pool->kernel[1] == 2 &&
      kiln__cpu_relu_max_pool_bwd2_plane_f32(ge, j->OH, Wp, j->pg + q * PL, j->py + q * PL, j->pix + q * PL, j->POH,
                                             j->POW, fast))
    return;
  memset(ge, 0, (size_t)L * sizeof *ge);
  if (j->pool) {
    int64_t pkh = j->pool->kernel[0], pkw = j->pool->kernel[1];
    for (int64_t r = 0; r < PL; r++) {
      int64_t oh = r / j->POW, ow = r % j->POW, t = j->pix[q * PL + r];
      ge[(oh * pkh + t / pkw) * Wp + ow * pkw + t % pkw] = j->py[q * PL + r] > 0 ? j->pg[q * PL + r] : 0.0f;
    }
  } else {
    const float *gp = j->y + q * j->OH * j->OW;
    for (int64_t oh = 0; oh < j->OH; oh++) memcpy(ge + oh * Wp, gp + oh * j->OW, (size_t)j->OW * sizeof *ge);
  }
}

/* the 16 running sums of each tap (part[t][v]: lane v, the elements k + v of each 16-step
** below K16) and of the bias (part[9]) */
typedef void (*c1_sums3_fn)(const float *ge, const float *xp, const int64_t toff[9], int64_t K16, float part[10][16]);

__attribute__((target("avx512f,avx512vl"))) static void c1_sums3_avx512(const float *ge, const float *xp,
                                                                        const int64_t toff[9], int64_t K16,
                                                                        float part[10][16]) {
  __m512 p[10];
  for (int t = 0; t < 10; t++) p[t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K16; k += 16) {
    __m512 g = _mm512_loadu_ps(ge + k);
    for (int t = 0; t < 9; t++) p[t] = _mm512_add_ps(p[t], _mm512_mul_ps(g, _mm512_loadu_ps(xp + toff[t] + k)));
    p[9] = _mm512_add_ps(p[9], g);
  }
  for (int t = 0; t < 10; t++) _mm512_storeu_ps(part[t], p[t]);
}

/* AVX2: one pass per half of each 16-step (lanes 0-7, then 8-15): ten sums and their
** operands fit AVX2's sixteen registers, twenty would not */
__attribute__((target("avx2"))) static void c1_sums3_avx2(const float *ge, const float *xp, const int64_t toff[9],
                                                          int64_t K16, float part[10][16]) {
  for (int h = 0; h < 2; h++) {
    __m256 p[10];
    for (int t = 0; t < 10; t++) p[t] = _mm256_setzero_ps();
    for (int64_t k = 8 * h; k < K16; k += 16) {
      __m256 g = _mm256_loadu_ps(ge + k);
      for (int t = 0; t < 9; t++) p[t] = _mm256_add_ps(p[t], _mm256_mul_ps(g, _mm256_loadu_ps(xp + toff[t] + k)));
      p[9] = _mm256_add_ps(p[9], g);
    }
    for (int t = 0; t < 10; t++) _mm256_storeu_ps(part[t] + 8 * h, p[t]);
  }
}

static void c1_wgrad3_blocks(const c1_job *j, int64_t lo, int64_t hi, c1_sums3_fn sums) {
  int64_t N = j->a->in[0].shape[0], Wp = j->W + 2 * j->pw, L = j->OH * Wp, K16 = L / 16 * 16;
  float *dw = (float *)j->w, *db = j->a->n_out > 1 ? j->a->out[1].data : NULL;
  float xp[C1_MAX], ge[C1_MAX];
  const int64_t toff[9] = {0, 1, 2, Wp, Wp + 1, Wp + 2, 2 * Wp, 2 * Wp + 1, 2 * Wp + 2};
  const bool fast = !kiln__cpu_portable_loops(); /* once a range: getenv is not free */
  for (int64_t oc0 = lo; oc0 < hi; oc0 += 32) {
    int64_t nc = hi - oc0 < 32 ? hi - oc0 : 32;
    double acc[32][10];
    memset(acc, 0, sizeof acc);
    for (int64_t n = 0; n < N; n++) {
      c1_pad(j, n, xp);
      for (int64_t c = 0; c < nc; c++) {
        c1_grid3(j, n * j->OC + oc0 + c, Wp, L, ge, fast);
        float part[10][16];
        sums(ge, xp, toff, K16, part);
        for (int t = 0; t < 10; t++) {
          if (t == 9 && !db) break;
          float sum = 0.0f;
          for (int64_t k = K16; k < L; k++) sum += t < 9 ? ge[k] * xp[toff[t] + k] : ge[k];
          for (int v = 0; v < 16; v++) sum += part[t][v];
          acc[c][t] += sum;
        }
      }
    }
    for (int64_t c = 0; c < nc; c++) {
      for (int t = 0; t < 9; t++) dw[(oc0 + c) * 9 + t] = (float)acc[c][t];
      if (db) db[oc0 + c] = (float)acc[c][9];
    }
  }
}

static void c1_wgrad3_range_avx512(void *vctx, int64_t lo, int64_t hi) {
  c1_wgrad3_blocks(vctx, lo, hi, c1_sums3_avx512);
}
static void c1_wgrad3_range_avx2(void *vctx, int64_t lo, int64_t hi) { c1_wgrad3_blocks(vctx, lo, hi, c1_sums3_avx2); }
#endif

/* The weight gradient's loop for this job: AVX-512 (3x3 its own) unless the CPU lacks it or
** KILN_CONV_C1_PORTABLE asks for the portable loops. */
static kiln__cpu_range_fn c1_wgrad_fn(const c1_job *j) {
#ifdef C1_HAVE_AVX512
  if (c1_avx512_ok() && !kiln__cpu_portable_loops()) return j->KH == 3 && j->KW == 3 ? c1_wgrad3_range_avx512 : c1_wgrad_range_avx512;
  if (c1_avx2_ok() && !kiln__cpu_portable_loops()) return j->KH == 3 && j->KW == 3 ? c1_wgrad3_range_avx2 : c1_wgrad_range_avx2;
#else
  (void)j;
#endif
  return c1_wgrad_range;
}

/* CONV2D / CONV2D_BACKWARD_WEIGHT of one input channel; the caller checked
** kiln__cpu_conv_c1_takes. The bias gradient, when asked, is the gradient's sum per channel. */
kiln_status kiln__cpu_conv_c1(const kiln__kargs *a) {
  bool fwd = a->op == KILN__K_CONV2D;
  const kiln__view *x = &a->in[0], *yv = fwd ? &a->out[0] : &a->in[1], *w = fwd ? &a->in[1] : &a->out[0];
  c1_job j = {a, x->shape[2], x->shape[3], yv->shape[1], yv->shape[2], yv->shape[3], w->shape[2], w->shape[3],
              ((const kiln__conv_params *)a->params)->padding[0], ((const kiln__conv_params *)a->params)->padding[1],
              x->data, w->data, fwd && a->n_in > 2 ? a->in[2].data : NULL, yv->data, NULL, 0, 0, NULL, NULL, NULL};
  int64_t planes = yv->shape[0] * yv->shape[1];
  if (planes == 0 || kiln__view_numel(w) == 0) {
    if (!fwd)
      for (int i = 0; i < a->n_out; i++) memset(a->out[i].data, 0, (size_t)kiln__view_numel(&a->out[i]) * sizeof(float));
    return KILN_OK;
  }
  if (fwd) {
    kiln__cpu_range_fn fwd_fn = c1_fwd_range;
#ifdef C1_HAVE_AVX512
    if (c1_avx512_ok() && !kiln__cpu_portable_loops()) fwd_fn = c1_fwd_range_avx512;
    else if (c1_avx2_ok() && !kiln__cpu_portable_loops()) fwd_fn = c1_fwd_range_avx2;
#endif
    kiln__cpu_parallel_for(planes, 1 + KILN__CPU_PAR_MIN / (j.OH * j.OW * j.KH * j.KW + 1), fwd_fn, &j);
    return KILN_OK;
  }
  kiln__cpu_range_fn wgrad_fn = c1_wgrad_fn(&j);
  kiln__cpu_parallel_for(j.OC, 1, wgrad_fn, &j); /* and the bias gradient, when asked */
  return KILN_OK;
}
/* ---- CONV1_RELU_MAX_POOL2D and its backward (backend.h) ---------------------------------- */
/* fmnist-cnn's first layers, conv 1 -> 32 3x3 on 28x28, ReLU, MaxPool2d(2): the one-channel
** direct loops above with the pool applied to each conv plane while it is in a buffer, and
** in backward the pool's gradient scattered into the plane buffer the weight gradient reads.
** The (N, OC, OH, OW) conv output and its gradient (11 MB each at batch 128) are never
** written: the separate ops wrote and read each once (the conv, relu_max_pool2d, its
** backward, the weight gradient). The same f32 operations per value as those ops, so the
** same bits. */
kiln_status kiln__cpu_conv1_relu_max_pool2d(const kiln__kargs *a) {
  bool bw = a->op == KILN__K_CONV1_RELU_MAX_POOL2D_BACKWARD;
  const kiln__conv_params *cp = a->params, *pp = cp ? cp + 1 : NULL;
  const kiln__view *x = &a->in[0], *w = bw ? &a->out[0] : &a->in[1];
  const kiln__view *py = bw ? &a->in[2] : &a->out[0], *pix = bw ? &a->in[3] : &a->out[1];
  const kiln__view *b = bw ? (a->n_out > 1 ? &a->out[1] : NULL) : (a->n_in > 2 ? &a->in[2] : NULL);
  const kiln__view *pg = bw ? &a->in[1] : NULL;
  bool ok = cp && a->n_in == (bw ? 4 : (b ? 3 : 2)) && a->n_out == (bw ? (b ? 2 : 1) : 2) && a->i[0] == 1 &&
            x->ndim == 4 && w->ndim == 4 && py->ndim == 4 && pix->ndim == 4 && x->dtype == KILN_F32 &&
            w->dtype == KILN_F32 && py->dtype == KILN_F32 && pix->dtype == KILN_U8 && x->shape[1] == 1 &&
            w->shape[1] == 1 && kiln__view_is_contiguous(x) && kiln__view_is_contiguous(w) &&
            kiln__view_is_contiguous(py) && kiln__view_is_contiguous(pix) && (!b || (b->dtype == KILN_F32 &&
            kiln__view_is_contiguous(b) && b->shape[0] == w->shape[0])) && (!pg || (pg->dtype == KILN_F32 &&
            kiln__view_is_contiguous(pg)));
  for (int d = 0; ok && d < 2; d++)
    ok = cp->stride[d] == 1 && cp->dilation[d] == 1 && cp->padding[d] >= 0 && cp->kernel[d] == w->shape[2 + d] &&
         pp->kernel[d] == pp->stride[d] && pp->padding[d] == 0 && pp->dilation[d] == 1;
  int64_t N = ok ? x->shape[0] : 0, OC = ok ? w->shape[0] : 0;
  int64_t OH = ok ? x->shape[2] + 2 * cp->padding[0] - w->shape[2] + 1 : 0;
  int64_t OW = ok ? x->shape[3] + 2 * cp->padding[1] - w->shape[3] + 1 : 0;
  ok = ok && OH >= 1 && OW >= 1 && w->shape[2] * w->shape[3] <= 49 && pp->kernel[0] * pp->kernel[1] <= 256 &&
       (x->shape[2] + 2 * cp->padding[0]) * (x->shape[3] + 2 * cp->padding[1]) + w->shape[3] + C1_SLACK <= C1_MAX &&
       py->shape[0] == N && py->shape[1] == OC && py->shape[2] == OH / pp->kernel[0] &&
       py->shape[3] == OW / pp->kernel[1] && (!pg || !memcmp(pg->shape, py->shape, sizeof(int64_t) * 4)) &&
       !memcmp(pix->shape, py->shape, sizeof(int64_t) * 4);
  if (!ok)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln: %s: arguments the CPU kernel does not take",
                          bw ? "conv1_relu_max_pool2d_backward" : "conv1_relu_max_pool2d");
  c1_job j = {a, x->shape[2], x->shape[3], OC, OH, OW, w->shape[2], w->shape[3], cp->padding[0], cp->padding[1],
              x->data, w->data, !bw && b ? b->data : NULL, NULL, pp, py->shape[2], py->shape[3], py->data,
              pix->data, pg ? pg->data : NULL};
  if (N * OC == 0 || j.POH * j.POW == 0) {
    if (bw)
      for (int i = 0; i < a->n_out; i++) memset(a->out[i].data, 0, (size_t)kiln__view_numel(&a->out[i]) * sizeof(float));
    return KILN_OK;
  }
  if (!bw) {
    kiln__cpu_parallel_for(N * OC, 1 + KILN__CPU_PAR_MIN / (OH * OW * j.KH * j.KW + 1), c1p_fwd_range, &j);
    return KILN_OK;
  }
  kiln__cpu_range_fn wgrad_fn = c1_wgrad_fn(&j);
  kiln__cpu_parallel_for(OC, 1, wgrad_fn, &j); /* dW, and db when asked (out1) */
  return KILN_OK;
}
#endif /* KILN_HAVE_DNNL */
