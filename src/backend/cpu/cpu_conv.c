/*
** Convolution on the CPU: the window kernels IM2COL and its adjoint COL2IM, the choice of
** kernel for CONV2D and its backward, and the backward's reference loops.
**
** Convolution is im2col then one GEMM (the MATMUL kernel, BLAS where built), done by the
** op layer (src/ops/ops_conv.c), where the CPU has no CONV2D kernel (kiln built without
** oneDNN); IM2COL and COL2IM only move data. Each (n, c) image plane is independent, so
** the planes are split across threads. IM2COL copies elements of any dtype bit for bit
** (zero bits outside the image are 0 in every floating dtype). COL2IM adds, in the dtype's
** compute type (f32 for 16-bit floats, rounded once per pixel).
**
** With oneDNN, CONV2D and, in f32 on dense views, its backward are kernels: one input
** channel takes the direct loops of cpu_conv_c1.c, 3x3 stride-1 forward and data gradients
** on the maps and channel counts where it beat oneDNN the Winograd kernel of
** cpu_conv_winograd.c, the rest oneDNN (cpu_dnnl.c); the choice is made here, so none of
** these files knows the others.
*/
#include "cpu.h"
#include "cpu_iter.h"
#include "cpu_window.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

typedef struct conv_job {
  const kiln__kargs *a;
  const kiln__conv_params *p;
  atomic_bool oom; /* COL2IM's plane buffer could not be had */
} conv_job;

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
    const char *xp = (const char *)x->data + kiln__cpu_plane_off(x, q);
    char *op = (char *)o->data + kiln__cpu_plane_off(o, q);
    for (int64_t i = 0; i < KH; i++)
      for (int64_t jj = 0; jj < KW; jj++) {
        char *orow = op + (i * o->strides[2] + jj * o->strides[3]) * es;
        int64_t a, b;
        kiln__cpu_valid_cols(OW, W, p->stride[1], p->padding[1], jj * p->dilation[1], &a, &b);
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
    char *xp = (char *)x->data + kiln__cpu_plane_off(x, q);
    const char *cp = (const char *)cv->data + kiln__cpu_plane_off(cv, q);
    for (int64_t h = 0; h < H; h++)
      for (int64_t w = 0; w < W; w++)
        acc[h * W + w] = kiln__cpu_get_f64(xp + (h * x->strides[2] + w * x->strides[3]) * es, x->dtype);
    for (int64_t i = 0; i < KH; i++)
      for (int64_t jj = 0; jj < KW; jj++) {
        int64_t a, b;
        kiln__cpu_valid_cols(OW, W, p->stride[1], p->padding[1], jj * p->dilation[1], &a, &b);
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

kiln_status kiln__cpu_conv_window(const kiln__kargs *a) {
  const kiln__conv_params *p = a->params;
  if (!p) return kiln_set_error(KILN_ERR_INTERNAL, "kiln: %s without its window parameters", kiln__kop_name(a->op));
  if (a->op != KILN__K_IM2COL && a->op != KILN__K_COL2IM)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln: %s is not a window kernel", kiln__kop_name(a->op));
  const kiln__view *v = a->op == KILN__K_COL2IM ? &a->out[0] : &a->in[0];
  if (!kiln__cpu_is_float(v->dtype)) return kiln__cpu_dtype_error(a, v->dtype);
  int64_t planes = v->shape[0] * v->shape[1];
  if (planes == 0) return KILN_OK;
  conv_job j = {a, p, false};
  const kiln__view *big = a->op == KILN__K_IM2COL ? &a->out[0] : &a->in[0];
  int64_t per = kiln__view_numel(big) / planes + 1;
  int64_t min_par = KILN__CPU_PAR_MIN / per + 1;
  kiln__cpu_parallel_for(planes, min_par, a->op == KILN__K_IM2COL ? im2col_range : col2im_range, &j);
  if (atomic_load(&j.oom)) return kiln_set_error(KILN_ERR_OOM, "kiln: col2im: out of host memory for a plane buffer");
  return KILN_OK;
}

/* ---- CONV2D and its backward: which kernel ---------------------------------------------- */

#ifdef KILN_HAVE_DNNL
/* CONV2D (registered with oneDNN only): f32, NCHW or channels-last, as oneDNN takes it; one
** input channel by the direct loops, 3x3 stride-1 NCHW ones by Winograd where it pays. */
kiln_status kiln__cpu_conv2d(const kiln__kargs *a) {
  if (!a->params) return kiln_set_error(KILN_ERR_INTERNAL, "kiln: conv2d without its window parameters");
  if (!kiln__cpu_dnnl_conv_takes(a))
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln: the CONV2D kernel takes f32 views, NCHW or channels-last");
  if (kiln__view_numel(&a->out[0]) == 0) return KILN_OK;
  if (kiln__cpu_conv_c1_takes(a)) return kiln__cpu_conv_c1(a);
  if (kiln__cpu_conv_winograd_takes(a)) return kiln__cpu_conv_winograd(a);
  return kiln__cpu_dnnl_conv2d(a);
}

/* The backward's f32 dense cases: the weight gradient of one input channel by the direct
** loops, a 3x3 stride-1 data gradient by Winograd where it pays, the rest through oneDNN.
** An empty output: nothing to write. */
static kiln_status conv2d_backward_lib(const kiln__kargs *a) {
  for (int i = 0; i < a->n_out; i++)
    if (kiln__view_numel(&a->out[i]) == 0) return KILN_OK;
  if (kiln__cpu_conv_c1_takes(a)) return kiln__cpu_conv_c1(a);
  if (kiln__cpu_conv_winograd_takes(a)) return kiln__cpu_conv_winograd(a);
  return kiln__cpu_dnnl_conv2d_backward(a);
}
#endif

/* ---- CONV2D_BACKWARD_DATA, CONV2D_BACKWARD_WEIGHT: reference loops ------------------------ */
/* f32 on dense tensors through the kernels above where kiln is built with oneDNN; else
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
  if (kiln__cpu_dnnl_conv_takes(a)) return conv2d_backward_lib(a);
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
