/*
** Window kernels of convolutional networks: IM2COL, its adjoint COL2IM, and MAX_POOL2D.
**
** Convolution itself is im2col then one GEMM (the MATMUL kernel, BLAS where built), done
** by the op layer (src/ops/ops_conv.c); these kernels only move data. Each (n, c) image
** plane is independent, so the planes are split across threads.
**
** IM2COL copies elements of any dtype bit for bit (zero bits outside the image are 0 in
** every floating dtype). COL2IM adds, in the dtype's compute type (f32 for 16-bit floats,
** rounded once per pixel). MAX_POOL2D compares in f64, which is exact for every floating
** dtype.
*/
#include "cpu.h"
#include "cpu_iter.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

typedef struct conv_job {
  const kiln__kargs *a;
  const kiln__conv_params *p;
  atomic_bool oom; /* COL2IM's plane buffer could not be had */
} conv_job;

/* Plane q of a 4-d view (N, C, ...) as a byte offset. */
static int64_t plane_off(const kiln__view *v, int64_t q) {
  int64_t n = q / v->shape[1], c = q % v->shape[1];
  return (n * v->strides[0] + c * v->strides[1]) * (int64_t)kiln_dtype_size(v->dtype);
}

/* The output columns ow whose input column ow*s - p + j*d lies in [0, W): [*lo, *hi). */
static void valid_range(int64_t OW, int64_t W, int64_t s, int64_t p, int64_t off, int64_t *lo, int64_t *hi) {
  int64_t base = off - p; /* w = ow*s + base */
  int64_t a = base >= 0 ? 0 : (-base + s - 1) / s;
  int64_t b = W - base <= 0 ? 0 : (W - base - 1) / s + 1;
  if (a > OW) a = OW;
  if (b > OW) b = OW;
  if (b < a) b = a;
  *lo = a, *hi = b;
}

/* ---- IM2COL ---------------------------------------------------------------------------- */

static void im2col_range(void *vctx, int64_t lo, int64_t hi) {
  const conv_job *j = vctx;
  const kiln__view *x = &j->a->in[0], *o = &j->a->out[0];
  const kiln__conv_params *p = j->p;
  int64_t es = (int64_t)kiln_dtype_size(x->dtype);
  int64_t H = x->shape[2], W = x->shape[3];
  int64_t KH = o->shape[2], KW = o->shape[3], OH = o->shape[4], OW = o->shape[5];
  int64_t xs3 = x->strides[3] * es, os5 = o->strides[5] * es;
  /* a row of the output copies one contiguous run of x when both are unit-stride */
  bool runs = p->stride[1] == 1 && x->strides[3] == 1 && o->strides[5] == 1;
  for (int64_t q = lo; q < hi; q++) {
    const char *xp = (const char *)x->data + plane_off(x, q);
    char *op = (char *)o->data + plane_off(o, q);
    for (int64_t i = 0; i < KH; i++)
      for (int64_t jj = 0; jj < KW; jj++) {
        char *orow = op + (i * o->strides[2] + jj * o->strides[3]) * es;
        int64_t a, b;
        valid_range(OW, W, p->stride[1], p->padding[1], jj * p->dilation[1], &a, &b);
        for (int64_t oh = 0; oh < OH; oh++) {
          int64_t h = oh * p->stride[0] - p->padding[0] + i * p->dilation[0];
          char *dst = orow + oh * o->strides[4] * es;
          if (h < 0 || h >= H || a == b) {
            if (o->strides[5] == 1) memset(dst, 0, (size_t)(OW * es));
            else for (int64_t ow = 0; ow < OW; ow++) memset(dst + ow * os5, 0, (size_t)es);
            continue;
          }
          /* first input column of the run: w(a) */
          const char *src = xp + h * x->strides[2] * es + (a * p->stride[1] - p->padding[1] + jj * p->dilation[1]) * xs3;
          if (runs) {
            memset(dst, 0, (size_t)(a * es));
            memcpy(dst + a * es, src, (size_t)((b - a) * es));
            memset(dst + b * es, 0, (size_t)((OW - b) * es));
            continue;
          }
          for (int64_t ow = 0; ow < a; ow++) memset(dst + ow * os5, 0, (size_t)es);
          int64_t step = p->stride[1] * xs3;
          if (es == 4) {
            for (int64_t ow = a; ow < b; ow++) memcpy(dst + ow * os5, src + (ow - a) * step, 4);
          } else {
            for (int64_t ow = a; ow < b; ow++) memcpy(dst + ow * os5, src + (ow - a) * step, (size_t)es);
          }
          for (int64_t ow = b; ow < OW; ow++) memset(dst + ow * os5, 0, (size_t)es);
        }
      }
  }
}

/* ---- COL2IM ---------------------------------------------------------------------------- */

/* acc[k*astep] += cols row src[k*sstep] for k < n, read as dtype dt */
static void add_row(double *acc, int64_t astep, const char *src, int64_t sstep, kiln_dtype dt, int64_t n) {
  switch (dt) {
  case KILN_F32:
    for (int64_t k = 0; k < n; k++) acc[k * astep] += *(const float *)(src + k * sstep);
    break;
  case KILN_F64:
    for (int64_t k = 0; k < n; k++) acc[k * astep] += *(const double *)(src + k * sstep);
    break;
  default:
    for (int64_t k = 0; k < n; k++) acc[k * astep] += kiln__cpu_get_f64(src + k * sstep, dt);
  }
}

static void col2im_range(void *vctx, int64_t lo, int64_t hi) {
  conv_job *j = vctx;
  const kiln__view *cv = &j->a->in[0], *x = &j->a->out[0];
  const kiln__conv_params *p = j->p;
  int64_t es = (int64_t)kiln_dtype_size(x->dtype), ces = (int64_t)kiln_dtype_size(cv->dtype);
  int64_t H = x->shape[2], W = x->shape[3];
  int64_t KH = cv->shape[2], KW = cv->shape[3], OH = cv->shape[4], OW = cv->shape[5];
  /* One plane in f64: exact sums for 16-bit floats and f32, f64 as the compute type; the
  ** plane is rounded to the dtype once. */
  double *acc = malloc((size_t)(H * W > 0 ? H * W : 1) * sizeof(double));
  if (!acc) {
    atomic_store(&j->oom, true);
    return;
  }
  for (int64_t q = lo; q < hi; q++) {
    char *xp = (char *)x->data + plane_off(x, q);
    const char *cp = (const char *)cv->data + plane_off(cv, q);
    for (int64_t h = 0; h < H; h++)
      for (int64_t w = 0; w < W; w++)
        acc[h * W + w] = kiln__cpu_get_f64(xp + (h * x->strides[2] + w * x->strides[3]) * es, x->dtype);
    for (int64_t i = 0; i < KH; i++)
      for (int64_t jj = 0; jj < KW; jj++) {
        int64_t a, b;
        valid_range(OW, W, p->stride[1], p->padding[1], jj * p->dilation[1], &a, &b);
        if (a == b) continue;
        for (int64_t oh = 0; oh < OH; oh++) {
          int64_t h = oh * p->stride[0] - p->padding[0] + i * p->dilation[0];
          if (h < 0 || h >= H) continue;
          const char *src = cp + (i * cv->strides[2] + jj * cv->strides[3] + oh * cv->strides[4] + a * cv->strides[5]) * ces;
          int64_t w0 = a * p->stride[1] - p->padding[1] + jj * p->dilation[1];
          add_row(acc + h * W + w0, p->stride[1], src, cv->strides[5] * ces, cv->dtype, b - a);
        }
      }
    for (int64_t h = 0; h < H; h++)
      for (int64_t w = 0; w < W; w++)
        kiln__cpu_set_f64(xp + (h * x->strides[2] + w * x->strides[3]) * es, x->dtype, acc[h * W + w]);
  }
  free(acc);
}

/* ---- MAX_POOL2D ------------------------------------------------------------------------ */

/* f32 planes with unit-stride rows, an i64 index output of the same layout: the common
** case (a CNN's pools) without the per-element dtype dispatch of the general loop below,
** which costs several times the comparison itself. The same windows, order and NaN rule. */
static bool max_pool_f32_fast(const kiln__view *x, const kiln__view *y, const kiln__view *ix) {
  return x->dtype == KILN_F32 && y->dtype == KILN_F32 && ix->dtype == KILN_I64 && x->strides[3] == 1 &&
         y->strides[3] == 1 && ix->strides[3] == 1 && y->strides[2] == ix->strides[2];
}

static void max_pool_range_f32(const conv_job *j, int64_t lo, int64_t hi) {
  const kiln__view *x = &j->a->in[0], *y = &j->a->out[0], *ix = &j->a->out[1];
  const kiln__conv_params *p = j->p;
  int64_t H = x->shape[2], W = x->shape[3], OH = y->shape[2], OW = y->shape[3];
  int64_t xs2 = x->strides[2], ys2 = y->strides[2];
  /* 2x2 windows, stride 2, no padding (MaxPool2d(2)): the four candidates unrolled, in the
  ** general loop's order (row by row), with its rule: the first strict maximum, a NaN wins */
  bool two = p->kernel[0] == 2 && p->kernel[1] == 2 && p->stride[0] == 2 && p->stride[1] == 2 &&
             p->padding[0] == 0 && p->padding[1] == 0 && p->dilation[0] == 1 && p->dilation[1] == 1 &&
             2 * OH <= H && 2 * OW <= W;
  for (int64_t q = lo; q < hi; q++) {
    const float *xp = (const float *)((const char *)x->data + plane_off(x, q));
    float *yp = (float *)((char *)y->data + plane_off(y, q));
    int64_t *ip = (int64_t *)((char *)ix->data + plane_off(ix, q));
    if (two) {
      for (int64_t oh = 0; oh < OH; oh++) {
        const float *r0 = xp + 2 * oh * xs2, *r1 = r0 + xs2;
        for (int64_t ow = 0; ow < OW; ow++) {
          float c[4] = {r0[2 * ow], r0[2 * ow + 1], r1[2 * ow], r1[2 * ow + 1]};
          float best = c[0];
          int k = 0;
          for (int t = 1; t < 4; t++)
            if (c[t] > best || (isnan(c[t]) && !isnan(best))) best = c[t], k = t;
          yp[oh * ys2 + ow] = best;
          ip[oh * ys2 + ow] = (2 * oh + (k >> 1)) * W + 2 * ow + (k & 1);
        }
      }
      continue;
    }
    for (int64_t oh = 0; oh < OH; oh++)
      for (int64_t ow = 0; ow < OW; ow++) {
        float best = -INFINITY;
        int64_t at = -1;
        for (int64_t i = 0; i < p->kernel[0]; i++) {
          int64_t h = oh * p->stride[0] - p->padding[0] + i * p->dilation[0];
          if (h < 0 || h >= H) continue;
          const float *row = xp + h * xs2;
          for (int64_t jj = 0; jj < p->kernel[1]; jj++) {
            int64_t w = ow * p->stride[1] - p->padding[1] + jj * p->dilation[1];
            if (w < 0 || w >= W) continue;
            float v = row[w];
            if (at < 0 || v > best || (isnan(v) && !isnan(best))) best = v, at = h * W + w;
          }
        }
        yp[oh * ys2 + ow] = best;
        ip[oh * ys2 + ow] = at < 0 ? 0 : at;
      }
  }
}

static void max_pool_range(void *vctx, int64_t lo, int64_t hi) {
  const conv_job *j = vctx;
  const kiln__view *x = &j->a->in[0], *y = &j->a->out[0], *ix = &j->a->out[1];
  const kiln__conv_params *p = j->p;
  if (max_pool_f32_fast(x, y, ix)) {
    max_pool_range_f32(j, lo, hi);
    return;
  }
  size_t es = kiln_dtype_size(x->dtype), yes = kiln_dtype_size(y->dtype), ies = kiln_dtype_size(ix->dtype);
  int64_t H = x->shape[2], W = x->shape[3], OH = y->shape[2], OW = y->shape[3];
  for (int64_t q = lo; q < hi; q++) {
    const char *xp = (const char *)x->data + plane_off(x, q);
    char *yp = (char *)y->data + plane_off(y, q);
    char *ip = (char *)ix->data + plane_off(ix, q);
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

/* ---- MAX_POOL2D_BACKWARD --------------------------------------------------------------- */

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
  const char *gp = (const char *)g->data + plane_off(g, q), *ip = (const char *)ix->data + plane_off(ix, q);
  char *xp = (char *)dx->data + plane_off(dx, q);
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
  const conv_job *j = vctx;
  const kiln__view *g = &j->a->in[0], *ix = &j->a->in[1], *dx = &j->a->out[0];
  const kiln__conv_params *p = j->p;
  if (max_pool_bwd_f32_disjoint(g, ix, dx, p)) {
    for (int64_t q = lo; q < hi; q++)
      max_pool_bwd_plane_f32(g, ix, p, (float *)((char *)dx->data + plane_off(dx, q)),
                             (const char *)g->data + plane_off(g, q), (const char *)ix->data + plane_off(ix, q),
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
    const char *gp = (const char *)g->data + plane_off(g, q);
    const char *ip = (const char *)ix->data + plane_off(ix, q);
    char *xp = (char *)dx->data + plane_off(dx, q);
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

kiln_status kiln__cpu_conv_window(const kiln__kargs *a) {
  const kiln__conv_params *p = a->params;
  if (!p) return kiln_set_error(KILN_ERR_INTERNAL, "kiln: %s without its window parameters", kiln__kop_name(a->op));
  const kiln__view *v = a->op == KILN__K_COL2IM || a->op == KILN__K_MAX_POOL2D_BACKWARD ? &a->out[0] : &a->in[0];
  if (a->op == KILN__K_MAX_POOL2D_BACKWARD &&
      (a->n_in < 2 || a->in[0].ndim != 4 || a->in[1].ndim != 4 || v->ndim != 4 || kiln__cpu_is_float(a->in[1].dtype)))
    return kiln_set_error(KILN_ERR_SHAPE, "kiln: max_pool2d_backward takes a 4-d grad, its integer indices and a 4-d dx");
  if (!kiln__cpu_is_float(v->dtype)) return kiln__cpu_dtype_error(a, v->dtype);
  int64_t planes = v->shape[0] * v->shape[1];
  if (planes == 0) return KILN_OK;
  conv_job j = {a, p, false};
  const kiln__view *big = a->op == KILN__K_MAX_POOL2D ? &a->in[0] : a->op == KILN__K_IM2COL ? &a->out[0] : &a->in[0];
  int64_t per = kiln__view_numel(big) / planes + 1;
  int64_t min_par = KILN__CPU_PAR_MIN / per + 1;
  switch (a->op) {
  case KILN__K_IM2COL: kiln__cpu_parallel_for(planes, min_par, im2col_range, &j); break;
  case KILN__K_COL2IM: kiln__cpu_parallel_for(planes, min_par, col2im_range, &j); break;
  case KILN__K_MAX_POOL2D: kiln__cpu_parallel_for(planes, min_par, max_pool_range, &j); break;
  case KILN__K_MAX_POOL2D_BACKWARD: kiln__cpu_parallel_for(planes, min_par, max_pool_bwd_range, &j); break;
  default: return kiln_set_error(KILN_ERR_INTERNAL, "kiln: %s is not a window kernel", kiln__kop_name(a->op));
  }
  if (atomic_load(&j.oom)) return kiln_set_error(KILN_ERR_OOM, "kiln: col2im: out of host memory for a plane buffer");
  return KILN_OK;
}

/* ---- CONV2D_BACKWARD_DATA, CONV2D_BACKWARD_WEIGHT ---------------------------------------- */
/* f32 on contiguous tensors through oneDNN where kiln is built with it (cpu_dnnl.c); else
** direct loops in f64, any strides and float dtype: the reference, and the fallback of a
** backend that has CONV2D but not its backward. The op layer picks these kernels on the CPU
** only where oneDNN runs them: the loops are much slower than im2col + BLAS. */

typedef struct convb_job {
  const kiln__kargs *a;
  const kiln__conv_params *p;
} convb_job;

static double at4(const kiln__view *v, int64_t a, int64_t b, int64_t c, int64_t d) {
  const char *p = (const char *)v->data +
                  (a * v->strides[0] + b * v->strides[1] + c * v->strides[2] + d * v->strides[3]) *
                      (int64_t)kiln_dtype_size(v->dtype);
  return kiln__cpu_get_f64(p, v->dtype);
}
static void put4(const kiln__view *v, int64_t a, int64_t b, int64_t c, int64_t d, double x) {
  char *p = (char *)v->data +
            (a * v->strides[0] + b * v->strides[1] + c * v->strides[2] + d * v->strides[3]) *
                (int64_t)kiln_dtype_size(v->dtype);
  kiln__cpu_set_f64(p, v->dtype, x);
}

/* planes q = n*C + c of dx */
static void convb_data_range(void *vctx, int64_t lo, int64_t hi) {
  const convb_job *j = vctx;
  const kiln__view *g = &j->a->in[0], *w = &j->a->in[1], *dx = &j->a->out[0];
  const kiln__conv_params *p = j->p;
  int64_t C = dx->shape[1], H = dx->shape[2], W = dx->shape[3];
  int64_t OC = g->shape[1], OH = g->shape[2], OW = g->shape[3], KH = w->shape[2], KW = w->shape[3];
  int64_t G = j->a->i[0], Cg = C / G, OCg = OC / G;
  for (int64_t q = lo; q < hi; q++) {
    int64_t n = q / C, c = q % C, grp = c / Cg;
    for (int64_t h = 0; h < H; h++)
      for (int64_t x = 0; x < W; x++) {
        double acc = 0;
        for (int64_t i = 0; i < KH; i++) {
          int64_t hh = h + p->padding[0] - i * p->dilation[0];
          if (hh < 0 || hh % p->stride[0] || hh / p->stride[0] >= OH) continue;
          for (int64_t jj = 0; jj < KW; jj++) {
            int64_t ww = x + p->padding[1] - jj * p->dilation[1];
            if (ww < 0 || ww % p->stride[1] || ww / p->stride[1] >= OW) continue;
            for (int64_t o = grp * OCg; o < (grp + 1) * OCg; o++)
              acc += at4(g, n, o, hh / p->stride[0], ww / p->stride[1]) * at4(w, o, c - grp * Cg, i, jj);
          }
        }
        put4(dx, n, c, h, x, acc);
      }
  }
}

/* output channels oc of dW (and db) */
static void convb_weight_range(void *vctx, int64_t lo, int64_t hi) {
  const convb_job *j = vctx;
  const kiln__view *x = &j->a->in[0], *g = &j->a->in[1], *dw = &j->a->out[0];
  const kiln__view *db = j->a->n_out > 1 ? &j->a->out[1] : NULL;
  const kiln__conv_params *p = j->p;
  int64_t N = x->shape[0], C = x->shape[1], H = x->shape[2], W = x->shape[3];
  int64_t OC = g->shape[1], OH = g->shape[2], OW = g->shape[3], KH = dw->shape[2], KW = dw->shape[3];
  int64_t G = j->a->i[0], Cg = C / G, OCg = OC / G;
  for (int64_t o = lo; o < hi; o++) {
    int64_t grp = o / OCg;
    for (int64_t cg = 0; cg < Cg; cg++)
      for (int64_t i = 0; i < KH; i++)
        for (int64_t jj = 0; jj < KW; jj++) {
          double acc = 0;
          for (int64_t n = 0; n < N; n++)
            for (int64_t oh = 0; oh < OH; oh++) {
              int64_t h = oh * p->stride[0] - p->padding[0] + i * p->dilation[0];
              if (h < 0 || h >= H) continue;
              for (int64_t ow = 0; ow < OW; ow++) {
                int64_t w = ow * p->stride[1] - p->padding[1] + jj * p->dilation[1];
                if (w < 0 || w >= W) continue;
                acc += at4(g, n, o, oh, ow) * at4(x, n, grp * Cg + cg, h, w);
              }
            }
          put4(dw, o, cg, i, jj, acc);
        }
    if (db) {
      double acc = 0;
      for (int64_t n = 0; n < N; n++)
        for (int64_t oh = 0; oh < OH; oh++)
          for (int64_t ow = 0; ow < OW; ow++) acc += at4(g, n, o, oh, ow);
      char *bp = (char *)db->data + o * db->strides[0] * (int64_t)kiln_dtype_size(db->dtype);
      kiln__cpu_set_f64(bp, db->dtype, acc);
    }
  }
}

kiln_status kiln__cpu_conv2d_backward(const kiln__kargs *a) {
  const kiln__conv_params *p = a->params;
  if (!p) return kiln_set_error(KILN_ERR_INTERNAL, "kiln: %s without its window parameters", kiln__kop_name(a->op));
  if (a->n_in < 2 || a->n_out < 1 || a->in[0].ndim != 4 || a->in[1].ndim != 4 || a->out[0].ndim != 4)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln: %s takes 4-d views", kiln__kop_name(a->op));
  if (!kiln__cpu_is_float(a->out[0].dtype)) return kiln__cpu_dtype_error(a, a->out[0].dtype);
  int64_t G = a->i[0];
  const kiln__view *img = a->op == KILN__K_CONV2D_BACKWARD_DATA ? &a->out[0] : &a->in[0];
  const kiln__view *gr = a->op == KILN__K_CONV2D_BACKWARD_DATA ? &a->in[0] : &a->in[1];
  if (G < 1 || img->shape[1] % G || gr->shape[1] % G)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln: %s: groups %lld must divide the channels %lld and %lld",
                          kiln__kop_name(a->op), (long long)G, (long long)img->shape[1], (long long)gr->shape[1]);
#ifdef KILN_HAVE_DNNL
  if (kiln__cpu_dnnl_conv_takes(a)) return kiln__cpu_dnnl_conv2d_backward(a);
#endif
  convb_job j = {a, p};
  if (a->op == KILN__K_CONV2D_BACKWARD_DATA) {
    int64_t planes = img->shape[0] * img->shape[1];
    if (planes > 0) kiln__cpu_parallel_for(planes, 1, convb_data_range, &j);
  } else if (a->op == KILN__K_CONV2D_BACKWARD_WEIGHT) {
    if (gr->shape[1] > 0) kiln__cpu_parallel_for(gr->shape[1], 1, convb_weight_range, &j);
  } else {
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln: %s is not a convolution backward kernel", kiln__kop_name(a->op));
  }
  return KILN_OK;
}
