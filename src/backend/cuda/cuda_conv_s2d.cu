/*
** Stride-2 convolutions of images with few channels (ResNet's 7x7 stem on RGB) on CUDA, as a
** stride-1 convolution of the image laid out space-to-depth: cuDNN's kernels for a 3-channel
** 16-bit NHWC input pad the channels to 8 with a separate kernel each call and then run at a
** small fraction of the tensor cores' rate; four times the channels and a quarter of the taps
** gives them a shape they run well (bench/RESULTS.md).
**
** With stride 2, padding p before and kernel kh x kw: output row o reads padded rows
** 2o .. 2o + kh - 1. Writing a padded row 2j + b (b = 0, 1) as row j of phase b:
**   y[o] = sum_{a < ceil(kh/2)} sum_{b < 2} X2[o + a][b] w[2a + b]   (w[kh] = 0)
** so X2 (N, H2, W2, C2p) with X2[n, j, i, (2 by + bx) C + c] = x[n, c, 2j + by - p, 2i + bx - p]
** (0 outside x; channels 4C .. C2p - 1 are 0, C2p = 4C rounded up to 8) convolved at stride
** 1, no padding, with W2 (OC, C2p, ceil(kh/2), ceil(kw/2)) of the taps regrouped the same way
** (taps past the kernel 0) gives y; H2 = OH + ceil(kh/2) - 1. The weight gradient is the
** stride-1 one of X2 against the output's gradient, folded back: dW[o, c, ky, kx] =
** dW2[o, (2 (ky % 2) + kx % 2) C + c, ky / 2, kx / 2]; the taps past the kernel are dropped.
** The data gradient stays on cuDNN's own path (a stem's input needs none).
**
** The same products in another order: within f32 accumulation of cuDNN's own choice, as
** any algorithm change. One difference: a non-finite input element also meets the zero
** taps past the kernel, so a NaN can reach the one output row or column beyond the window
** that held the inf in the direct convolution.
** X2, W2 and dW2 are scratch from the caching allocator for the call. KILN_CONV_S2D=0 sends
** these convolutions to cuDNN as they are (the A/B).
*/
#include "cuda_int.cuh"

#include <stdlib.h>
#include <string.h>

extern "C" bool kiln__cuda_cudnn_supports(const kiln__kargs *a);
extern "C" kiln_status kiln__cuda_cudnn_conv(const kiln__kargs *a);

namespace {

/* The transformed problem's geometry. */
struct S2d {
  int64_t N, C, H, W, OC, kh, kw, ph, pw, OH, OW;
  int64_t C2p, kh2, kw2, H2, W2;
};

bool enabled() {
  static const bool on = !kc_env_zero("KILN_CONV_S2D");
  return on;
}

/* NHWC strides of an (n, c, h, w) shape, in elements */
void nhwc_strides(const int64_t *shape, int64_t *st) {
  st[1] = 1, st[3] = shape[1], st[2] = shape[1] * shape[3], st[0] = shape[1] * shape[2] * shape[3];
}

kiln__view nhwc_view(void *data, kiln_dtype dt, int64_t n, int64_t c, int64_t h, int64_t w) {
  kiln__view v;
  memset(&v, 0, sizeof v);
  v.data = data, v.dtype = dt, v.ndim = 4;
  v.shape[0] = n, v.shape[1] = c, v.shape[2] = h, v.shape[3] = w;
  nhwc_strides(v.shape, v.strides);
  return v;
}

/* x, the weight (or its gradient) and y (or its gradient) of CONV2D / CONV2D_BACKWARD_WEIGHT */
void operands(const kiln__kargs *a, const kiln__view **x, const kiln__view **w, const kiln__view **y) {
  *x = &a->in[0];
  if (a->op == KILN__K_CONV2D) *w = &a->in[1], *y = &a->out[0];
  else *w = &a->out[0], *y = &a->in[1];
}

/* The geometry, or false where this path does not apply. */
bool plan(const kiln__kargs *a, S2d *g) {
  if ((a->op != KILN__K_CONV2D && a->op != KILN__K_CONV2D_BACKWARD_WEIGHT) || !a->params || a->i[0] != 1) return false;
  if (a->n_in < 2 || a->n_out < 1) return false;
  const kiln__conv_params *p = (const kiln__conv_params *)a->params;
  const kiln__view *x, *w, *y;
  operands(a, &x, &w, &y);
  if (x->ndim != 4 || w->ndim != 4 || y->ndim != 4) return false;
  if (x->dtype != KILN_BF16 && x->dtype != KILN_F16) return false;
  if (w->dtype != x->dtype || y->dtype != x->dtype) return false;
  for (int d = 0; d < 2; d++)
    if (p->stride[d] != 2 || p->dilation[d] != 1 || p->kernel[d] < 5 || p->padding[d] < 0) return false;
  g->N = x->shape[0], g->C = x->shape[1], g->H = x->shape[2], g->W = x->shape[3];
  g->OC = w->shape[0], g->kh = w->shape[2], g->kw = w->shape[3];
  g->ph = p->padding[0], g->pw = p->padding[1];
  g->OH = y->shape[2], g->OW = y->shape[3];
  if (g->C < 1 || g->C > 4 || w->shape[1] != g->C || g->kh != p->kernel[0] || g->kw != p->kernel[1]) return false;
  if (y->shape[0] != g->N || y->shape[1] != g->OC || g->OH < 1 || g->OW < 1 || g->N < 1 || g->OC < 1) return false;
  /* the output is the windows that fit the padded image, as for the direct convolution */
  if (g->OH != (g->H + 2 * g->ph - g->kh) / 2 + 1 || g->OW != (g->W + 2 * g->pw - g->kw) / 2 + 1) return false;
  g->C2p = (4 * g->C + 7) / 8 * 8;
  g->kh2 = (g->kh + 1) / 2, g->kw2 = (g->kw + 1) / 2;
  g->H2 = g->OH + g->kh2 - 1, g->W2 = g->OW + g->kw2 - 1;
  return true;
}

/* The inner stride-1 call on X2 (and W2 or dW2 at w2), everything else as a's. */
kiln__kargs inner(const kiln__kargs *a, const S2d &g, void *x2, void *w2, kiln__conv_params *p2) {
  kiln__kargs b = *a;
  const kiln_dtype dt = a->in[0].dtype;
  *p2 = kiln__conv_params{{g.kh2, g.kw2}, {1, 1}, {0, 0}, {1, 1}};
  b.params = p2;
  b.in[0] = nhwc_view(x2, dt, g.N, g.C2p, g.H2, g.W2);
  kiln__view wv = nhwc_view(w2, dt, g.OC, g.C2p, g.kh2, g.kw2);
  if (a->op == KILN__K_CONV2D) b.in[1] = wv;
  else b.out[0] = wv;
  return b;
}

/* X2 (N, H2, W2, C2p) from x at any strides: blockIdx.y (striding) an X2 row (n, j), a
** thread a pixel i of it, its C2p channels written in 16-byte vectors. C is a template
** parameter, so the channel loops unroll with no division (64-bit divisions a channel were
** most of the kernel's time). */
template <class T, int C> __global__ void __launch_bounds__(KC_THREADS) s2d_input(const T *__restrict__ x, kiln__view xv, S2d g,
                                                                              T *__restrict__ x2) {
  constexpr int C2p = (4 * C + 7) / 8 * 8;
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= g.W2) return;
  const int64_t *s = xv.strides;
  for (int64_t row = blockIdx.y; row < g.N * g.H2; row += gridDim.y) {
    const int64_t n = row / g.H2, j = row - n * g.H2;
    __align__(16) T v[C2p];
#pragma unroll
    for (int q = 0; q < 4; q++) {
      const int64_t h = 2 * j + q / 2 - g.ph, w = 2 * i + q % 2 - g.pw;
      const bool in = h >= 0 && h < g.H && w >= 0 && w < g.W;
      const T *px = x + n * s[0] + h * s[2] + w * s[3];
#pragma unroll
      for (int c = 0; c < C; c++) v[q * C + c] = in ? px[c * s[1]] : T(0.0f);
    }
#pragma unroll
    for (int c = 4 * C; c < C2p; c++) v[c] = T(0.0f);
    T *out = x2 + (row * g.W2 + i) * C2p;
#pragma unroll
    for (int c0 = 0; c0 < C2p; c0 += 8) *reinterpret_cast<uint4 *>(out + c0) = *reinterpret_cast<const uint4 *>(v + c0);
  }
}

template <class T>
void launch_input(const T *x, const kiln__view &xv, const S2d &g, T *x2, cudaStream_t stream) {
  const int64_t rows = g.N * g.H2;
  dim3 grid((unsigned)((g.W2 + 127) / 128), (unsigned)(rows < 65535 ? rows : 65535));
  switch (g.C) {
  case 1: s2d_input<T, 1><<<grid, 128, 0, stream>>>(x, xv, g, x2); break;
  case 2: s2d_input<T, 2><<<grid, 128, 0, stream>>>(x, xv, g, x2); break;
  case 3: s2d_input<T, 3><<<grid, 128, 0, stream>>>(x, xv, g, x2); break;
  default: s2d_input<T, 4><<<grid, 128, 0, stream>>>(x, xv, g, x2); break;
  }
}

/* W2 (OC, kh2, kw2, C2p) from the weight at any strides: a thread an element. */
template <class T> __global__ void __launch_bounds__(KC_THREADS) s2d_weight(const T *__restrict__ w, kiln__view wv, S2d g,
                                                                        T *__restrict__ w2) {
  const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, ne = g.OC * g.kh2 * g.kw2 * g.C2p;
  if (e >= ne) return;
  const int64_t c2 = e % g.C2p, ax = (e / g.C2p) % g.kw2, ay = (e / (g.C2p * g.kw2)) % g.kh2, o = e / (g.C2p * g.kw2 * g.kh2);
  const int64_t q = c2 / g.C, c = c2 - q * g.C, ky = 2 * ay + q / 2, kx = 2 * ax + q % 2;
  const int64_t *s = wv.strides;
  w2[e] = q < 4 && ky < g.kh && kx < g.kw ? w[o * s[0] + c * s[1] + ky * s[2] + kx * s[3]] : T(0.0f);
}

/* dW (any strides) from dW2 (OC, kh2, kw2, C2p): a thread an element of dW. */
template <class T> __global__ void __launch_bounds__(KC_THREADS) s2d_fold(const T *__restrict__ dw2, S2d g, T *__restrict__ dw,
                                                                      kiln__view wv) {
  const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, ne = g.OC * g.C * g.kh * g.kw;
  if (e >= ne) return;
  const int64_t kx = e % g.kw, ky = (e / g.kw) % g.kh, c = (e / (g.kw * g.kh)) % g.C, o = e / (g.kw * g.kh * g.C);
  const int64_t c2 = (2 * (ky % 2) + kx % 2) * g.C + c;
  const int64_t *s = wv.strides;
  dw[o * s[0] + c * s[1] + ky * s[2] + kx * s[3]] = dw2[((o * g.kh2 + ky / 2) * g.kw2 + kx / 2) * g.C2p + c2];
}

unsigned blocks_for(int64_t n) { return (unsigned)((n + KC_THREADS - 1) / KC_THREADS); }

template <class T> kiln_status run(const kiln__kargs *a, const S2d &g) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  const kiln__view *x, *w, *y;
  operands(a, &x, &w, &y);
  const size_t es = sizeof(T);
  const size_t x2n = (size_t)(g.N * g.H2 * g.W2 * g.C2p), w2n = (size_t)(g.OC * g.kh2 * g.kw2 * g.C2p);
  T *x2 = (T *)kiln__cuda_alloc(a->device, x2n * es);
  if (!x2) return kiln_last_error();
  T *w2 = (T *)kiln__cuda_alloc(a->device, w2n * es);
  if (!w2) {
    kiln__cuda_free(a->device, x2, x2n * es);
    return kiln_last_error();
  }
  kiln_status st = kiln__cuda_capture_note(a->device, x2, x2n * es);
  if (st == KILN_OK) st = kiln__cuda_capture_note(a->device, w2, w2n * es);
  if (st == KILN_OK) {
    launch_input<T>((const T *)x->data, *x, g, x2, d->stream);
    st = kiln__cuda_launched("conv2d (space-to-depth input)");
  }
  if (st == KILN_OK && a->op == KILN__K_CONV2D) {
    s2d_weight<T><<<blocks_for((int64_t)w2n), KC_THREADS, 0, d->stream>>>((const T *)w->data, *w, g, w2);
    st = kiln__cuda_launched("conv2d (space-to-depth weight)");
  }
  kiln__conv_params p2;
  const kiln__kargs b = inner(a, g, x2, w2, &p2);
  if (st == KILN_OK) st = kiln__cuda_cudnn_conv(&b);
  if (st == KILN_OK && a->op == KILN__K_CONV2D_BACKWARD_WEIGHT) {
    s2d_fold<T><<<blocks_for(g.OC * g.C * g.kh * g.kw), KC_THREADS, 0, d->stream>>>(w2, g, (T *)w->data, *w);
    st = kiln__cuda_launched("conv2d_backward_weight (space-to-depth fold)");
  }
  kiln__cuda_free(a->device, w2, w2n * es); /* stream-ordered reuse */
  kiln__cuda_free(a->device, x2, x2n * es);
  return st;
}

} // namespace

extern "C" bool kiln__cuda_conv_s2d_supports(const kiln__kargs *a) {
  S2d g;
  if (!enabled() || !plan(a, &g)) return false;
  /* cuDNN must take the inner call (x's address stands in for the scratch's) */
  kiln__conv_params p2;
  const kiln__kargs b = inner(a, g, a->in[0].data, a->in[0].data, &p2);
  return kiln__cuda_cudnn_supports(&b);
}

extern "C" kiln_status kiln__cuda_conv_s2d(const kiln__kargs *a) {
  S2d g;
  if (!plan(a, &g)) return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln_%s: not a space-to-depth convolution", kiln__kop_name(a->op));
  if (a->in[0].dtype == KILN_BF16) return run<__nv_bfloat16>(a, g);
  return run<__half>(a, g);
}
