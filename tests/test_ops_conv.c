/*
** The convolutional family through the harness: conv2d (stride, padding and "same",
** dilation, groups, depthwise, bias), conv1d, conv_transpose2d, max_pool2d, avg_pool2d,
** adaptive_avg_pool2d, upsample (nearest, bilinear), pad (constant, reflect), batch_norm
** (training, eval), group_norm; each against naive f64 loops here. Then what the harness
** cannot see: max_pool2d's indices, batch_norm's running statistics, dropout2d's masks,
** and bad input (messages naming the op and the shapes).
**
** The IM2COL, COL2IM and MAX_POOL2D kernels exist on the CPU and CUDA (and CONV2D with
** its backward kernels on CUDA with cuDNN): every case is H_CPU_ONLY | H_CUDA_NATIVE, so
** CUDA runs it with the fallback off (tests/test_cuda_conv.c) and other backends through
** the fallback, which is compared too.
** Names are prefixed cv_.
*/
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L /* setenv */
#endif
#include "harness.h"
#include "backend/backend.h"
#include "core/kiln_int.h"

#include <kiln_nn.h>
#include <kiln_optim.h>
#include <stdlib.h>
#include <string.h>

typedef struct cv_cfg {
  int64_t s[2], p[2], d[2], g;
  int bias;
  int64_t op[2]; /* conv_transpose2d's output_padding */
} cv_cfg;

static double cv_at(const h_arr *x, int64_t n, int64_t c, int64_t h, int64_t w) {
  return x->data[((n * x->shape[1] + c) * x->shape[2] + h) * x->shape[3] + w];
}

/* conv2d reference; returns 1 when kiln must refuse the shapes */
static int cv_conv_ref(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  const cv_cfg *k = ctx;
  const h_arr *x = &in[0], *w = &in[1];
  (void)n_in;
  int64_t N = x->shape[0], C = x->shape[1], H = x->shape[2], W = x->shape[3];
  int64_t OC = w->shape[0], Cg = w->shape[1], KH = w->shape[2], KW = w->shape[3];
  if (C % k->g || OC % k->g || Cg * k->g != C) return 1;
  int64_t pb[2], o[2], in2[2] = {H, W}, kk[2] = {KH, KW};
  for (int d = 0; d < 2; d++) {
    if (k->p[d] < 0) {
      pb[d] = k->d[d] * (kk[d] - 1) / 2;
      o[d] = in2[d];
    } else {
      pb[d] = k->p[d];
      int64_t span = k->d[d] * (kk[d] - 1) + 1;
      if (in2[d] + 2 * pb[d] < span) return 1;
      o[d] = (in2[d] + 2 * pb[d] - span) / k->s[d] + 1;
    }
  }
  out->ndim = 4;
  out->shape[0] = N, out->shape[1] = OC, out->shape[2] = o[0], out->shape[3] = o[1];
  if (!out->data) return 0;
  int64_t OCg = OC / k->g;
  for (int64_t n = 0; n < N; n++)
    for (int64_t oc = 0; oc < OC; oc++)
      for (int64_t oh = 0; oh < o[0]; oh++)
        for (int64_t ow = 0; ow < o[1]; ow++) {
          double s = k->bias ? in[2].data[oc] : 0;
          int64_t g = oc / OCg;
          for (int64_t ci = 0; ci < Cg; ci++)
            for (int64_t i = 0; i < KH; i++)
              for (int64_t j = 0; j < KW; j++) {
                int64_t h = oh * k->s[0] - pb[0] + i * k->d[0], ww = ow * k->s[1] - pb[1] + j * k->d[1];
                if (h < 0 || h >= H || ww < 0 || ww >= W) continue;
                s += cv_at(x, n, g * Cg + ci, h, ww) * w->data[((oc * Cg + ci) * KH + i) * KW + j];
              }
          out->data[((n * OC + oc) * o[0] + oh) * o[1] + ow] = s;
        }
  return 0;
}

static kiln_tensor *cv_conv(kiln_tensor **in, const void *ctx) {
  const cv_cfg *k = ctx;
  return kiln_conv2d(in[0], in[1], k->bias ? in[2] : NULL, k->s, k->p, k->d, k->g);
}

/* conv1d: the 2-d reference on (N, C, 1, L) */
static int cv_conv1d_ref(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  const cv_cfg *k = ctx;
  if (in[0].ndim != 3 || in[1].ndim != 3) return 1;
  h_arr t[3];
  for (int q = 0; q < n_in; q++) t[q] = in[q];
  for (int q = 0; q < 2; q++) {
    t[q].ndim = 4;
    t[q].shape[0] = in[q].shape[0], t[q].shape[1] = in[q].shape[1], t[q].shape[2] = 1, t[q].shape[3] = in[q].shape[2];
  }
  cv_cfg k2 = *k;
  k2.s[0] = 1, k2.p[0] = 0, k2.d[0] = 1;
  int r = cv_conv_ref(t, n_in, out, &k2);
  if (r) return r;
  out->ndim = 3;
  out->shape[2] = out->shape[3];
  return 0;
}
static kiln_tensor *cv_conv1d(kiln_tensor **in, const void *ctx) {
  const cv_cfg *k = ctx;
  return kiln_conv1d(in[0], in[1], k->bias ? in[2] : NULL, k->s[1], k->p[1], k->d[1], k->g);
}

/* conv_transpose2d: every input pixel spreads through the kernel */
static int cv_convt_ref(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  const cv_cfg *k = ctx;
  const h_arr *x = &in[0], *w = &in[1];
  (void)n_in;
  int64_t N = x->shape[0], C = x->shape[1], H = x->shape[2], W = x->shape[3];
  int64_t OCg = w->shape[1], KH = w->shape[2], KW = w->shape[3], Cg = C / k->g, OC = OCg * k->g;
  int64_t OH = (H - 1) * k->s[0] - 2 * k->p[0] + k->d[0] * (KH - 1) + k->op[0] + 1;
  int64_t OW = (W - 1) * k->s[1] - 2 * k->p[1] + k->d[1] * (KW - 1) + k->op[1] + 1;
  out->ndim = 4;
  out->shape[0] = N, out->shape[1] = OC, out->shape[2] = OH, out->shape[3] = OW;
  if (!out->data) return 0;
  int64_t n_out = N * OC * OH * OW;
  for (int64_t q = 0; q < n_out; q++) out->data[q] = k->bias ? in[2].data[(q / (OH * OW)) % OC] : 0;
  for (int64_t n = 0; n < N; n++)
    for (int64_t ci = 0; ci < C; ci++)
      for (int64_t h = 0; h < H; h++)
        for (int64_t ww = 0; ww < W; ww++)
          for (int64_t ol = 0; ol < OCg; ol++)
            for (int64_t i = 0; i < KH; i++)
              for (int64_t j = 0; j < KW; j++) {
                int64_t oy = h * k->s[0] - k->p[0] + i * k->d[0], ox = ww * k->s[1] - k->p[1] + j * k->d[1];
                if (oy < 0 || oy >= OH || ox < 0 || ox >= OW) continue;
                int64_t oc = (ci / Cg) * OCg + ol;
                out->data[((n * OC + oc) * OH + oy) * OW + ox] +=
                    cv_at(x, n, ci, h, ww) * w->data[((ci * OCg + ol) * KH + i) * KW + j];
              }
  return 0;
}
static kiln_tensor *cv_convt(kiln_tensor **in, const void *ctx) {
  const cv_cfg *k = ctx;
  return kiln_conv_transpose2d(in[0], in[1], k->bias ? in[2] : NULL, k->s, k->p, k->op, k->d, k->g);
}

/* ---- pooling: kernel in s? no: cfg reused, kernel in op[] ---------------------------- */

/* max (mode 0), mean with padding counted (mode 1), or ReLU then max (mode 2:
** relu_max_pool2d) over windows op[] (kernel) */
typedef struct cv_pool {
  int64_t k[2], s[2], p[2], d[2];
  int avg;
} cv_pool;

static int cv_pool_ref(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  const cv_pool *k = ctx;
  const h_arr *x = &in[0];
  (void)n_in;
  int64_t N = x->shape[0], C = x->shape[1], H = x->shape[2], W = x->shape[3], o[2], in2[2] = {H, W};
  for (int d = 0; d < 2; d++) {
    int64_t span = k->d[d] * (k->k[d] - 1) + 1;
    if (in2[d] + 2 * k->p[d] < span) return 1;
    o[d] = (in2[d] + 2 * k->p[d] - span) / k->s[d] + 1;
  }
  out->ndim = 4;
  out->shape[0] = N, out->shape[1] = C, out->shape[2] = o[0], out->shape[3] = o[1];
  if (!out->data) return 0;
  for (int64_t n = 0; n < N; n++)
    for (int64_t c = 0; c < C; c++)
      for (int64_t oh = 0; oh < o[0]; oh++)
        for (int64_t ow = 0; ow < o[1]; ow++) {
          double acc = k->avg == 1 ? 0 : -INFINITY;
          for (int64_t i = 0; i < k->k[0]; i++)
            for (int64_t j = 0; j < k->k[1]; j++) {
              int64_t h = oh * k->s[0] - k->p[0] + i * k->d[0], w = ow * k->s[1] - k->p[1] + j * k->d[1];
              if (h < 0 || h >= H || w < 0 || w >= W) continue;
              double v = cv_at(x, n, c, h, w);
              if (k->avg == 1) acc += v;
              else if (v > acc) acc = v;
            }
          if (k->avg == 1) acc /= (double)(k->k[0] * k->k[1]);
          if (k->avg == 2 && acc < 0) acc = 0; /* relu_max_pool2d: ReLU, then the max */
          out->data[((n * C + c) * o[0] + oh) * o[1] + ow] = acc;
        }
  return 0;
}
static kiln_tensor *cv_pool_fn(kiln_tensor **in, const void *ctx) {
  const cv_pool *k = ctx;
  if (k->avg == 2) return kiln_relu_max_pool2d(in[0], k->k, k->s, k->p, k->d);
  return k->avg ? kiln_avg_pool2d(in[0], k->k, k->s, k->p) : kiln_max_pool2d(in[0], k->k, k->s, k->p, k->d, NULL);
}

/* ---- adaptive pooling, upsampling ------------------------------------------------------ */

typedef struct cv_size {
  int64_t o[2];
  int mode; /* 0 adaptive avg, 1 nearest, 2 bilinear */
} cv_size;

static double cv_lin(const h_arr *x, int64_t n, int64_t c, int64_t oh, int64_t ow, const cv_size *k) {
  int64_t H = x->shape[2], W = x->shape[3], in2[2] = {H, W}, oo[2] = {oh, ow};
  if (k->mode == 0) {
    int64_t a[2], b[2];
    for (int d = 0; d < 2; d++) a[d] = oo[d] * in2[d] / k->o[d], b[d] = ((oo[d] + 1) * in2[d] + k->o[d] - 1) / k->o[d];
    double s = 0;
    for (int64_t h = a[0]; h < b[0]; h++)
      for (int64_t w = a[1]; w < b[1]; w++) s += cv_at(x, n, c, h, w);
    return s / (double)((b[0] - a[0]) * (b[1] - a[1]));
  }
  if (k->mode == 1) return cv_at(x, n, c, oh * H / k->o[0], ow * W / k->o[1]);
  int64_t i0[2], i1[2];
  double l[2];
  for (int d = 0; d < 2; d++) {
    double src = ((double)oo[d] + 0.5) * (double)in2[d] / (double)k->o[d] - 0.5;
    if (src < 0) src = 0;
    i0[d] = (int64_t)floor(src);
    if (i0[d] > in2[d] - 1) i0[d] = in2[d] - 1;
    i1[d] = i0[d] + 1 < in2[d] ? i0[d] + 1 : in2[d] - 1;
    l[d] = src - (double)i0[d];
  }
  return (1 - l[0]) * ((1 - l[1]) * cv_at(x, n, c, i0[0], i0[1]) + l[1] * cv_at(x, n, c, i0[0], i1[1])) +
         l[0] * ((1 - l[1]) * cv_at(x, n, c, i1[0], i0[1]) + l[1] * cv_at(x, n, c, i1[0], i1[1]));
}
static int cv_size_ref(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  const cv_size *k = ctx;
  const h_arr *x = &in[0];
  (void)n_in;
  if (x->shape[2] == 0 || x->shape[3] == 0) return 1;
  out->ndim = 4;
  out->shape[0] = x->shape[0], out->shape[1] = x->shape[1], out->shape[2] = k->o[0], out->shape[3] = k->o[1];
  if (!out->data) return 0;
  int64_t q = 0;
  for (int64_t n = 0; n < x->shape[0]; n++)
    for (int64_t c = 0; c < x->shape[1]; c++)
      for (int64_t oh = 0; oh < k->o[0]; oh++)
        for (int64_t ow = 0; ow < k->o[1]; ow++) out->data[q++] = cv_lin(x, n, c, oh, ow, k);
  return 0;
}
static kiln_tensor *cv_size_fn(kiln_tensor **in, const void *ctx) {
  const cv_size *k = ctx;
  if (k->mode == 0) return kiln_adaptive_avg_pool2d(in[0], k->o);
  return kiln_upsample(in[0], k->o, k->mode == 1 ? KILN_UPSAMPLE_NEAREST : KILN_UPSAMPLE_BILINEAR);
}

/* ---- pad: (left, right, top, bottom) on the last two dims of a 4-d input ----------------- */

typedef struct cv_padc {
  int64_t pads[4];
  int reflect;
} cv_padc;
static int cv_pad_ref(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  const cv_padc *k = ctx;
  const h_arr *x = &in[0];
  (void)n_in;
  int64_t H = x->shape[2], W = x->shape[3];
  if (k->reflect && (k->pads[0] >= W || k->pads[1] >= W || k->pads[2] >= H || k->pads[3] >= H)) return 1;
  int64_t OH = H + k->pads[2] + k->pads[3], OW = W + k->pads[0] + k->pads[1];
  out->ndim = 4;
  out->shape[0] = x->shape[0], out->shape[1] = x->shape[1], out->shape[2] = OH, out->shape[3] = OW;
  if (!out->data) return 0;
  int64_t q = 0;
  for (int64_t n = 0; n < x->shape[0]; n++)
    for (int64_t c = 0; c < x->shape[1]; c++)
      for (int64_t oh = 0; oh < OH; oh++)
        for (int64_t ow = 0; ow < OW; ow++) {
          int64_t h = oh - k->pads[2], w = ow - k->pads[0];
          if (k->reflect) {
            h = h < 0 ? -h : h >= H ? 2 * (H - 1) - h : h;
            w = w < 0 ? -w : w >= W ? 2 * (W - 1) - w : w;
            out->data[q++] = cv_at(x, n, c, h, w);
          } else {
            out->data[q++] = (h < 0 || h >= H || w < 0 || w >= W) ? 0.5 : cv_at(x, n, c, h, w);
          }
        }
  return 0;
}
static kiln_tensor *cv_pad_fn(kiln_tensor **in, const void *ctx) {
  const cv_padc *k = ctx;
  return kiln_pad(in[0], 4, k->pads, k->reflect ? KILN_PAD_REFLECT : KILN_PAD_CONSTANT, 0.5);
}

/* ---- norms ------------------------------------------------------------------------------------ */

/* batch_norm: mode 0 training (x, w, b), mode 1 eval (x, running mean, running var, w, b);
** group_norm: mode 2 (x, w, b) with 2 groups. eps 1e-5. */
static int cv_norm_ref(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  int mode = *(const int *)ctx;
  const h_arr *x = &in[0];
  (void)n_in;
  int64_t N = x->shape[0], C = x->shape[1], S = x->shape[2] * x->shape[3];
  out->ndim = 4;
  memcpy(out->shape, x->shape, sizeof out->shape);
  if (mode == 0 && N * S == 1) return 1;
  if (!out->data) return 0;
  const h_arr *w = &in[mode == 1 ? 3 : 1], *b = &in[mode == 1 ? 4 : 2];
  int64_t G = mode == 2 ? 2 : C, Cg = C / G;
  for (int64_t g = 0; g < G; g++) {
    /* statistics over (n?, channels of g, spatial) */
    int64_t nn = mode == 2 ? 1 : N;
    for (int64_t n0 = 0; n0 < (mode == 2 ? N : 1); n0++) {
      double mean = 0, var = 0, cnt = 0;
      for (int64_t n = 0; n < nn; n++)
        for (int64_t c = g * Cg; c < (g + 1) * Cg; c++)
          for (int64_t s = 0; s < S; s++) mean += x->data[((n + n0) * C + c) * S + s], cnt++;
      mean /= cnt;
      for (int64_t n = 0; n < nn; n++)
        for (int64_t c = g * Cg; c < (g + 1) * Cg; c++)
          for (int64_t s = 0; s < S; s++) {
            double dlt = x->data[((n + n0) * C + c) * S + s] - mean;
            var += dlt * dlt;
          }
      var /= cnt;
      if (mode == 1) mean = in[1].data[g], var = in[2].data[g];
      for (int64_t n = 0; n < nn; n++)
        for (int64_t c = g * Cg; c < (g + 1) * Cg; c++)
          for (int64_t s = 0; s < S; s++) {
            int64_t q = ((n + n0) * C + c) * S + s;
            out->data[q] = (x->data[q] - mean) / sqrt(var + 1e-5) * w->data[c] + b->data[c];
          }
    }
  }
  return 0;
}
static kiln_tensor *cv_norm_fn(kiln_tensor **in, const void *ctx) {
  int mode = *(const int *)ctx;
  if (mode == 0) return kiln_batch_norm(in[0], NULL, NULL, in[1], in[2], true, 0.1, 1e-5);
  if (mode == 1) return kiln_batch_norm(in[0], in[1], in[2], in[3], in[4], false, 0.1, 1e-5);
  return kiln_group_norm(in[0], 2, in[1], in[2], 1e-5);
}

#define N_ H_SYM(0)
#define CVIN(...) {.ndim = 4, .shape = {__VA_ARGS__}, .fill = H_RANDN, .diff = true}
#define CVIN3(...) {.ndim = 3, .shape = {__VA_ARGS__}, .fill = H_RANDN, .diff = true}
#define CV1(...) {.ndim = 1, .shape = {__VA_ARGS__}, .fill = H_RANDN, .diff = true}
#define CVF (H_CPU_ONLY | H_CUDA_NATIVE)

static const cv_cfg cv_plain = {{1, 1}, {0, 0}, {1, 1}, 1, 1, {0, 0}};
static const cv_cfg cv_strided = {{2, 1}, {1, 2}, {1, 1}, 1, 1, {0, 0}};
static const cv_cfg cv_dilated = {{1, 2}, {2, 1}, {2, 1}, 1, 0, {0, 0}};
static const cv_cfg cv_same = {{1, 1}, {KILN_PADDING_SAME, KILN_PADDING_SAME}, {1, 2}, 1, 1, {0, 0}};
static const cv_cfg cv_groups = {{1, 1}, {1, 1}, {1, 1}, 2, 1, {0, 0}};
static const cv_cfg cv_pad1 = {{1, 1}, {1, 1}, {1, 1}, 1, 1, {0, 0}};
static const cv_cfg cv_s2p1 = {{2, 2}, {1, 1}, {1, 1}, 1, 1, {0, 0}};
static const cv_cfg cv_depthwise = {{2, 2}, {1, 1}, {1, 1}, 4, 1, {0, 0}};
static const cv_cfg cv_1x1 = {{1, 1}, {0, 0}, {1, 1}, 1, 1, {0, 0}};
static const cv_cfg cv_1d = {{1, 2}, {1, 1}, {1, 1}, 2, 1, {0, 0}};
static const cv_cfg cv_1d_same = {{1, 1}, {0, KILN_PADDING_SAME}, {1, 1}, 1, 0, {0, 0}};
static const cv_cfg cv_t_plain = {{2, 2}, {1, 0}, {1, 1}, 1, 1, {1, 0}};
static const cv_cfg cv_t_groups = {{1, 2}, {0, 1}, {2, 1}, 2, 0, {0, 1}};
static const cv_pool cv_max = {{3, 3}, {2, 2}, {1, 1}, {1, 1}, 0};
static const cv_pool cv_max_dil = {{2, 2}, {1, 2}, {0, 0}, {2, 1}, 0};
static const cv_pool cv_avg = {{3, 2}, {2, 2}, {1, 1}, {1, 1}, 1};
static const cv_pool cv_relu_max = {{2, 2}, {2, 2}, {0, 0}, {1, 1}, 2}, cv_relu_max32 = {{3, 2}, {3, 2}, {0, 0}, {1, 1}, 2},
                     cv_relu_max_ov = {{3, 3}, {2, 2}, {1, 1}, {1, 1}, 2};
static const cv_size cv_adapt = {{3, 2}, 0}, cv_adapt_global = {{1, 1}, 0}, cv_adapt_up = {{4, 6}, 0}, cv_near = {{7, 3}, 1}, cv_bil = {{7, 9}, 2},
                     cv_bil_down = {{2, 3}, 2};
static const cv_padc cv_pad_const = {{1, 2, 0, 3}, 0}, cv_pad_refl = {{2, 1, 1, 2}, 1};
static const int cv_bn_train = 0, cv_bn_eval = 1, cv_gn = 2;

static const h_case cv_cases[] = {
    {.name = "conv2d 3x3 with bias", .fn = cv_conv, .ref = cv_conv_ref, .ctx = &cv_plain, .n_in = 3,
     .in = {CVIN(N_, 3, 5, 6), CVIN(4, 3, 3, 3), CV1(4)}, .sym = {2}, .flags = CVF},
    {.name = "conv2d stride (2,1) padding (1,2)", .fn = cv_conv, .ref = cv_conv_ref, .ctx = &cv_strided, .n_in = 3,
     .in = {CVIN(N_, 2, 6, 5), CVIN(3, 2, 3, 2), CV1(3)}, .sym = {2}, .flags = CVF},
    {.name = "conv2d dilation (2,1) no bias", .fn = cv_conv, .ref = cv_conv_ref, .ctx = &cv_dilated, .n_in = 2,
     .in = {CVIN(N_, 2, 5, 5), CVIN(3, 2, 3, 2)}, .sym = {2}, .flags = CVF},
    {.name = "conv2d padding same, even kernel", .fn = cv_conv, .ref = cv_conv_ref, .ctx = &cv_same, .n_in = 3,
     .in = {CVIN(N_, 2, 5, 4), CVIN(3, 2, 2, 3), CV1(3)}, .sym = {2}, .flags = CVF},
    {.name = "conv2d groups 2", .fn = cv_conv, .ref = cv_conv_ref, .ctx = &cv_groups, .n_in = 3,
     .in = {CVIN(N_, 4, 4, 4), CVIN(6, 2, 3, 3), CV1(6)}, .sym = {2}, .flags = CVF},
    {.name = "conv2d depthwise (x2 multiplier) stride 2", .fn = cv_conv, .ref = cv_conv_ref, .ctx = &cv_depthwise,
     .n_in = 3, .in = {CVIN(N_, 4, 5, 5), CVIN(8, 1, 3, 3), CV1(8)}, .sym = {2}, .flags = CVF},
    {.name = "conv2d 1x1 (no im2col)", .fn = cv_conv, .ref = cv_conv_ref, .ctx = &cv_1x1, .n_in = 3,
     .in = {CVIN(N_, 3, 4, 3), CVIN(5, 3, 1, 1), CV1(5)}, .sym = {2}, .flags = CVF},
    {.name = "conv1d stride 2 groups 2", .fn = cv_conv1d, .ref = cv_conv1d_ref, .ctx = &cv_1d, .n_in = 3,
     .in = {CVIN3(N_, 4, 9), CVIN3(6, 2, 3), CV1(6)}, .sym = {2}, .flags = CVF},
    {.name = "conv1d padding same", .fn = cv_conv1d, .ref = cv_conv1d_ref, .ctx = &cv_1d_same, .n_in = 2,
     .in = {CVIN3(N_, 3, 7), CVIN3(2, 3, 4)}, .sym = {2}, .flags = CVF},
    {.name = "conv_transpose2d stride 2 output_padding", .fn = cv_convt, .ref = cv_convt_ref, .ctx = &cv_t_plain,
     .n_in = 3, .in = {CVIN(N_, 3, 3, 4), CVIN(3, 2, 3, 2), CV1(2)}, .sym = {2}, .flags = CVF},
    {.name = "conv_transpose2d groups dilation", .fn = cv_convt, .ref = cv_convt_ref, .ctx = &cv_t_groups, .n_in = 2,
     .in = {CVIN(N_, 4, 3, 3), CVIN(4, 3, 2, 2)}, .sym = {2}, .flags = CVF},
    {.name = "max_pool2d 3x3 stride 2 padding 1", .fn = cv_pool_fn, .ref = cv_pool_ref, .ctx = &cv_max, .n_in = 1,
     .in = {CVIN(N_, 3, 7, 6)}, .sym = {2}, .flags = CVF | H_NO_EXPAND},
    {.name = "max_pool2d dilation", .fn = cv_pool_fn, .ref = cv_pool_ref, .ctx = &cv_max_dil, .n_in = 1,
     .in = {CVIN(N_, 2, 5, 6)}, .sym = {2}, .flags = CVF | H_NO_EXPAND},
    {.name = "relu_max_pool2d 2x2 (MaxPool2d(2)), odd sizes", .fn = cv_pool_fn, .ref = cv_pool_ref,
     .ctx = &cv_relu_max, .n_in = 1, .in = {CVIN(N_, 3, 7, 9)}, .sym = {2}, .flags = CVF | H_NO_EXPAND},
    {.name = "relu_max_pool2d 3x2 tiles", .fn = cv_pool_fn, .ref = cv_pool_ref, .ctx = &cv_relu_max32, .n_in = 1,
     .in = {CVIN(N_, 2, 7, 5)}, .sym = {2}, .flags = CVF | H_NO_EXPAND},
    {.name = "relu_max_pool2d 3x3 stride 2 padding 1 (the two ops)", .fn = cv_pool_fn, .ref = cv_pool_ref,
     .ctx = &cv_relu_max_ov, .n_in = 1, .in = {CVIN(N_, 2, 7, 6)}, .sym = {2}, .flags = CVF | H_NO_EXPAND},
    {.name = "avg_pool2d 3x2 padding 1", .fn = cv_pool_fn, .ref = cv_pool_ref, .ctx = &cv_avg, .n_in = 1,
     .in = {CVIN(N_, 3, 7, 5)}, .sym = {2}, .flags = CVF},
    {.name = "adaptive_avg_pool2d 7x5 -> 3x2", .fn = cv_size_fn, .ref = cv_size_ref, .ctx = &cv_adapt, .n_in = 1,
     .in = {CVIN(N_, 2, 7, 5)}, .sym = {2}, .flags = CVF},
    {.name = "adaptive_avg_pool2d 7x7 -> 1x1 (a mean)", .fn = cv_size_fn, .ref = cv_size_ref, .ctx = &cv_adapt_global,
     .n_in = 1, .in = {CVIN(N_, 3, 7, 7)}, .sym = {2}, .flags = CVF},
    {.name = "adaptive_avg_pool2d 1x1 -> 1x1 (a copy)", .fn = cv_size_fn, .ref = cv_size_ref, .ctx = &cv_adapt_global,
     .n_in = 1, .in = {CVIN(N_, 5, 1, 1)}, .sym = {2}, .flags = CVF},
    {.name = "adaptive_avg_pool2d 3x4 -> 4x6", .fn = cv_size_fn, .ref = cv_size_ref, .ctx = &cv_adapt_up, .n_in = 1,
     .in = {CVIN(N_, 2, 3, 4)}, .sym = {2}, .flags = CVF},
    {.name = "upsample nearest 3x2 -> 7x3", .fn = cv_size_fn, .ref = cv_size_ref, .ctx = &cv_near, .n_in = 1,
     .in = {CVIN(N_, 2, 3, 2)}, .sym = {2}, .flags = CVF},
    {.name = "upsample bilinear 3x4 -> 7x9", .fn = cv_size_fn, .ref = cv_size_ref, .ctx = &cv_bil, .n_in = 1,
     .in = {CVIN(N_, 2, 3, 4)}, .sym = {2}, .flags = CVF},
    {.name = "upsample bilinear 5x7 -> 2x3", .fn = cv_size_fn, .ref = cv_size_ref, .ctx = &cv_bil_down, .n_in = 1,
     .in = {CVIN(N_, 2, 5, 7)}, .sym = {2}, .flags = CVF},
    {.name = "pad constant (1,2,0,3)", .fn = cv_pad_fn, .ref = cv_pad_ref, .ctx = &cv_pad_const, .n_in = 1,
     .in = {CVIN(N_, 2, 3, 4)}, .sym = {2}, .flags = CVF},
    {.name = "pad reflect (2,1,1,2)", .fn = cv_pad_fn, .ref = cv_pad_ref, .ctx = &cv_pad_refl, .n_in = 1,
     .in = {CVIN(N_, 2, 4, 3)}, .sym = {2}, .flags = CVF},
    {.name = "batch_norm training", .fn = cv_norm_fn, .ref = cv_norm_ref, .ctx = &cv_bn_train, .n_in = 3,
     .in = {CVIN(N_, 3, 2, 3), CV1(3), CV1(3)}, .sym = {3}, .flags = CVF | H_NO_SIZE0},
    {.name = "batch_norm eval", .fn = cv_norm_fn, .ref = cv_norm_ref, .ctx = &cv_bn_eval, .n_in = 5,
     .in = {CVIN(N_, 3, 2, 3), {.ndim = 1, .shape = {3}, .fill = H_RANDN},
            {.ndim = 1, .shape = {3}, .fill = H_POSITIVE}, CV1(3), CV1(3)},
     .sym = {2}, .flags = CVF},
    {.name = "group_norm 2 groups", .fn = cv_norm_fn, .ref = cv_norm_ref, .ctx = &cv_gn, .n_in = 3,
     .in = {CVIN(N_, 4, 2, 3), CV1(4), CV1(4)}, .sym = {2}, .flags = CVF | H_NO_SIZE0},
};

/* ---- what the harness cannot see ------------------------------------------------------------ */

static bool cv_msg_has(const char *a, const char *b, const char *c) {
  const char *m = kiln_last_error_message();
  return m && strstr(m, a) && (!b || strstr(m, b)) && (!c || strstr(m, c));
}

static void cv_extra(void) {
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();

  /* max_pool2d's indices: flat h*W + w of each window's maximum (the first on ties) */
  kiln_tensor *x = H_T(KILN_SHAPE(1, 1, 3, 4), KILN_F32, 1, 9, 2, 3, 4, 5, 9, 0, 7, 7, 1, 2);
  kiln_tensor *idx = NULL;
  kiln_tensor *y = kiln_max_pool2d(x, (const int64_t[]){2, 2}, (const int64_t[]){1, 2}, NULL, NULL, &idx);
  H_CHECK(y && idx && kiln_dtype_of(idx) == KILN_I64 && kiln_size(idx, 2) == 2 && kiln_size(idx, 3) == 2 &&
              kiln_get(idx, (int64_t[]){0, 0, 0, 0}) == 1 && kiln_get(idx, (int64_t[]){0, 0, 0, 1}) == 6 &&
              kiln_get(idx, (int64_t[]){0, 0, 1, 0}) == 8 && kiln_get(idx, (int64_t[]){0, 0, 1, 1}) == 6 &&
              kiln_get(y, (int64_t[]){0, 0, 1, 0}) == 7,
          "max_pool2d indices [[1, 6], [8, 6]] and values");
  /* overlapping windows that share a maximum add up its gradient */
  kiln_requires_grad_(x, true);
  y = kiln_max_pool2d(x, (const int64_t[]){2, 2}, (const int64_t[]){1, 2}, NULL, NULL, NULL);
  H_CHECK(kiln_backward(kiln_sum_all(y), NULL) == KILN_OK && kiln_get(kiln_grad(x), (int64_t[]){0, 0, 1, 2}) == 2,
          "max_pool2d: a maximum two windows share gets gradient 2");

  /* batch_norm's running statistics, as PyTorch: momentum 0.1, unbiased variance */
  kiln_tensor *xb = H_T(KILN_SHAPE(2, 2, 1, 2), KILN_F64, 1, 2, 10, 20, 3, 6, 30, 50);
  kiln_tensor *rm = kiln_full(KILN_SHAPE(2), 1.0, KILN_F64, cpu), *rv = kiln_full(KILN_SHAPE(2), 2.0, KILN_F64, cpu);
  y = kiln_batch_norm(xb, rm, rv, NULL, NULL, true, 0.1, 1e-5);
  /* channel 0: 1 2 3 6 -> mean 3, unbiased var (4+1+0+9)/3; channel 1: 10 20 30 50 */
  double m0 = 3, v0 = 14.0 / 3, m1 = 27.5, v1 = (17.5 * 17.5 + 7.5 * 7.5 + 2.5 * 2.5 + 22.5 * 22.5) / 3;
  double want_m[2] = {0.9 + 0.1 * m0, 0.9 + 0.1 * m1}, want_v[2] = {1.8 + 0.1 * v0, 1.8 + 0.1 * v1};
  H_CHECK(y != NULL, "batch_norm training with running statistics runs");
  h_tensor_close("batch_norm running_mean", rm, want_m, 2, 1e-12, 1e-12);
  h_tensor_close("batch_norm running_var", rv, want_v, 2, 1e-12, 1e-12);
  /* eval then normalizes with them */
  y = kiln_batch_norm(xb, rm, rv, NULL, NULL, false, 0.1, 0.0);
  H_CHECK(y && fabs(kiln_get(y, (int64_t[]){0, 0, 0, 0}) - (1 - want_m[0]) / sqrt(want_v[0])) < 1e-12,
          "batch_norm eval uses the running statistics");

  /* dropout2d: whole channels dropped or scaled by 1/(1-p); identity in eval */
  kiln_tensor *xo = kiln_ones(KILN_SHAPE(4, 8, 3, 3), KILN_F32, cpu);
  kiln_generator *gen = kiln_generator_new(7);
  kiln_tensor *d = kiln_dropout2d(xo, 0.5, true, gen);
  int64_t n = 0;
  double *v = d ? h_values(d, &n) : NULL;
  bool whole = v != NULL, some0 = false, some2 = false;
  for (int64_t ch = 0; v && ch < 32; ch++) {
    for (int k = 0; k < 9; k++) whole = whole && v[ch * 9 + k] == v[ch * 9];
    some0 = some0 || v[ch * 9] == 0;
    some2 = some2 || v[ch * 9] == 2;
    whole = whole && (v[ch * 9] == 0 || v[ch * 9] == 2);
  }
  free(v);
  H_CHECK(whole && some0 && some2, "dropout2d drops whole channels and scales the rest by 2");
  H_CHECK(kiln_dropout2d(xo, 0.5, false, gen) == xo, "dropout2d in eval is the identity");
  kiln_generator_free(gen);

  /* bad input: the op and the shapes in the message */
  kiln_tensor *img = kiln_ones(KILN_SHAPE(1, 4, 3, 3), KILN_F32, cpu);
  kiln_tensor *w5 = kiln_ones(KILN_SHAPE(2, 4, 5, 5), KILN_F32, cpu);
  kiln_clear_error();
  H_CHECK(!kiln_conv2d(img, w5, NULL, NULL, NULL, NULL, 1) && kiln_last_error() == KILN_ERR_SHAPE &&
              cv_msg_has("kiln_conv2d", "[1, 4, 3, 3]", "[2, 4, 5, 5]"),
          "conv2d: a 5x5 kernel on a 3x3 input names the op and both shapes: %s", kiln_last_error_message());
  H_CHECK(kiln_conv2d(img, w5, NULL, NULL, (const int64_t[]){1, 1}, NULL, 1) != NULL,
          "conv2d: the same kernel fits once padded by 1");
  kiln_clear_error();
  H_CHECK(!kiln_conv2d(img, kiln_ones(KILN_SHAPE(2, 1, 1, 1), KILN_F32, cpu), NULL, NULL, NULL, NULL, 3) &&
              kiln_last_error() == KILN_ERR_SHAPE && cv_msg_has("kiln_conv2d", "groups 3", "[1, 4, 3, 3]"),
          "conv2d: groups 3 do not divide 4 channels: %s", kiln_last_error_message());
  kiln_clear_error();
  H_CHECK(!kiln_conv2d(img, kiln_ones(KILN_SHAPE(2, 4, 1, 1), KILN_F32, cpu), NULL, (const int64_t[]){2, 2},
                       (const int64_t[]){KILN_PADDING_SAME, KILN_PADDING_SAME}, NULL, 1) &&
              kiln_last_error() == KILN_ERR_INVALID_ARGUMENT && cv_msg_has("kiln_conv2d", "same", NULL),
          "conv2d: padding same with stride 2 is refused");
  kiln_clear_error();
  H_CHECK(!kiln_relu_max_pool2d(kiln_ones(KILN_SHAPE(4, 3, 3), KILN_F32, cpu), (const int64_t[]){2, 2}, NULL, NULL,
                                NULL) &&
              kiln_last_error() == KILN_ERR_SHAPE && cv_msg_has("kiln_relu_max_pool2d", "[4, 3, 3]", NULL),
          "relu_max_pool2d: a 3-d input names the op and the shape: %s", kiln_last_error_message());
  kiln_clear_error();
  H_CHECK(!kiln_relu_max_pool2d(img, (const int64_t[]){5, 5}, NULL, NULL, NULL) &&
              cv_msg_has("kiln_relu_max_pool2d", "[1, 4, 3, 3]", NULL),
          "relu_max_pool2d: a 5x5 window on a 3x3 map names the op and the shape: %s", kiln_last_error_message());
  kiln_clear_error();
  H_CHECK(!kiln_conv2d_relu_max_pool2d(kiln_ones(KILN_SHAPE(1, 1, 3, 3), KILN_F32, cpu), w5, NULL, NULL, NULL, NULL, 1,
                                       (const int64_t[]){2, 2}, NULL, NULL, NULL) &&
              kiln_last_error() == KILN_ERR_SHAPE && cv_msg_has("kiln_conv2d", "[1, 1, 3, 3]", "[2, 4, 5, 5]"),
          "conv2d_relu_max_pool2d: mismatched shapes name the conv and both shapes: %s", kiln_last_error_message());
  kiln_clear_error();
  H_CHECK(!kiln_batch_norm(kiln_ones(KILN_SHAPE(1, 3), KILN_F32, cpu), NULL, NULL, NULL, NULL, true, 0.1, 1e-5) &&
              kiln_last_error() == KILN_ERR_SHAPE && cv_msg_has("kiln_batch_norm", "[1, 3]", "one value per channel"),
          "batch_norm: training with one value per channel: %s", kiln_last_error_message());
  kiln_clear_error();
  H_CHECK(!kiln_group_norm(img, 3, NULL, NULL, 1e-5) && kiln_last_error() == KILN_ERR_SHAPE &&
              cv_msg_has("kiln_group_norm", "groups 3", "[1, 4, 3, 3]"),
          "group_norm: groups 3 do not divide 4 channels");
  kiln_clear_error();
  H_CHECK(!kiln_max_pool2d(img, (const int64_t[]){4, 4}, NULL, NULL, NULL, NULL) &&
              kiln_last_error() == KILN_ERR_SHAPE && cv_msg_has("kiln_max_pool2d", "[1, 4, 3, 3]", NULL),
          "max_pool2d: a 4x4 window on a 3x3 input");
  kiln_clear_error();
  H_CHECK(!kiln_pad(img, 2, (const int64_t[]){3, 0}, KILN_PAD_REFLECT, 0) && kiln_last_error() == KILN_ERR_SHAPE &&
              cv_msg_has("kiln_pad", "[1, 4, 3, 3]", NULL),
          "pad: reflect by 3 on a dim of 3");
  kiln_clear_error();
  H_EXPECT_ERR(kiln_conv2d(img, kiln_ones(KILN_SHAPE(2, 4, 1, 1), KILN_F64, cpu), NULL, NULL, NULL, NULL, 1),
               KILN_ERR_DTYPE, "conv2d of f32 with an f64 weight");
  kiln_scope_end();
}

/* f32 conv2d (the library's kernel and its backward rule where the CPU has CONV2D, the
** composite elsewhere) against the f64 composite on the same values: forward and the
** three gradients. The harness gradchecks only f64, which never takes the kernel. */
static void cv_f32_vs_f64(void) {
  /* then five: one input channel (the CPU's direct loops: unpadded, padded; strided
  ** and dilated ones go to oneDNN), and channel counts past oneDNN's 16-wide blocks with a
  ** map under 4x4 (its weight gradient left to the composite) and over it */
  static const cv_cfg *cfgs[] = {&cv_strided, &cv_same,  &cv_groups, &cv_depthwise, &cv_1x1,   &cv_dilated,
                                 &cv_plain,   &cv_pad1,   &cv_strided, &cv_groups,   &cv_groups,
                                 &cv_groups,  &cv_s2p1,   &cv_strided, &cv_pad1,   &cv_pad1,
                                 &cv_plain,   &cv_pad1,   &cv_s2p1,    &cv_strided, &cv_pad1,
                                 &cv_pad1,    &cv_pad1,   &cv_pad1,    &cv_plain};
  static const int64_t shapes[][8] = {
      {2, 2, 6, 5, 3, 2, 3, 2},    {2, 2, 5, 4, 3, 2, 2, 3},     {2, 4, 4, 4, 6, 2, 3, 3},
      {2, 4, 5, 5, 8, 1, 3, 3},    {2, 3, 4, 3, 5, 3, 1, 1},     {2, 2, 5, 5, 3, 2, 3, 2},
      {3, 1, 9, 8, 5, 1, 3, 3},    {2, 1, 7, 6, 4, 1, 3, 3},     {2, 1, 7, 6, 4, 1, 3, 2},
      {3, 36, 2, 3, 34, 18, 3, 3}, {2, 40, 9, 9, 24, 20, 3, 3},
      /* taps that only ever meet padding (cropped on the CPU): a 3x3 on a 1x1 map, 3x3
      ** stride 2 from 2x2 to 1x1, a crop in one dimension only, and one on a map large
      ** enough for oneDNN's weight gradient */
      {2, 8, 1, 1, 6, 4, 3, 3},    {2, 20, 2, 2, 18, 20, 3, 3},  {2, 3, 1, 4, 4, 3, 3, 5},
      {2, 4, 1, 20, 6, 4, 3, 3}, /* a 1 x 20 map: the weight gradient cropped too */
      /* one output pixel whose cut window is the whole image, ungrouped: the CPU's weight
      ** gradient as one GEMM (cpu_dnnl.c gemm_case; the s2p1 2x2 case above is one too):
      ** a 3x3 pad 1 on 1x1 maps (ResNet-18 32x32's layer4), and a 3x3 unpadded on a 3x3
      ** map (the cut is the whole weight) */
      {5, 8, 1, 1, 6, 8, 3, 3},    {3, 5, 3, 3, 4, 5, 3, 3},
      /* ungrouped outputs under 4x4 otherwise: the CPU's small-map weight gradient (cpu_dnnl.c
      ** small_case, columns written in the GEMM's layout): 2x2 -> 2x2 (ResNet-18 32x32's
      ** layer3), 4x4 -> 2x2 stride 2, and stride (2,1) padding (1,2) to 2x6 */
      {4, 6, 2, 2, 5, 6, 3, 3},    {3, 4, 4, 4, 5, 4, 3, 3},    {2, 3, 3, 3, 4, 3, 3, 2},
      /* oneDNN's Winograd on the CPU (cpu_dnnl.c winograd_case: 3x3 pad 1, channels in
      ** 16s, 4x4 to 8x8 maps), at ResNet-18 32x32's layer1 and layer2 channel counts: its
      ** rounding against f64, every pass */
      {4, 64, 8, 8, 64, 64, 3, 3}, {3, 128, 4, 4, 128, 128, 3, 3},
      /* the one-GEMM weight gradient of a 3x3 pad 1 on 1x1 maps spread into the full
      ** weight 16 (out, in) pairs a step on AVX-512 (cpu_dnnl.c spread1_range): 35 pairs
      ** (two steps and a tail of 3), 1536 */
      {3, 5, 1, 1, 7, 5, 3, 3},    {4, 32, 1, 1, 48, 32, 3, 3},
      /* one input channel with rows past 16 outputs (the AVX-512 direct loop's full and
      ** masked chunks) */
      {2, 1, 28, 21, 5, 1, 3, 3}};
  for (int t = 0; t < 25; t++) {
    const cv_cfg *k = cfgs[t];
    const int64_t *s = shapes[t];
    kiln_scope_begin();
    kiln_tensor *x64 = kiln_randn(KILN_SHAPE(s[0], s[1], s[2], s[3]), KILN_F64, kiln_device_cpu(), NULL);
    kiln_tensor *w64 = kiln_randn(KILN_SHAPE(s[4], s[5], s[6], s[7]), KILN_F64, kiln_device_cpu(), NULL);
    kiln_tensor *b64 = kiln_randn(KILN_SHAPE(s[4]), KILN_F64, kiln_device_cpu(), NULL);
    /* the values f32 can hold, so only the arithmetic differs */
    x64 = kiln_to_dtype(kiln_to_dtype(x64, KILN_F32), KILN_F64);
    w64 = kiln_to_dtype(kiln_to_dtype(w64, KILN_F32), KILN_F64);
    b64 = kiln_to_dtype(kiln_to_dtype(b64, KILN_F32), KILN_F64);
    /* f32 twice: NCHW, and the input channels-last (oneDNN reads NHWC as it is) */
    kiln_tensor *ins[3][3] = {
        {x64, w64, b64},
        {kiln_to_dtype(x64, KILN_F32), kiln_to_dtype(w64, KILN_F32), kiln_to_dtype(b64, KILN_F32)},
        {kiln_contiguous_format(kiln_to_dtype(x64, KILN_F32), KILN_CHANNELS_LAST), kiln_to_dtype(w64, KILN_F32),
         kiln_to_dtype(b64, KILN_F32)}};
    double *vals[3][4] = {{0}};
    int64_t nv[4] = {0};
    for (int d = 0; d < 3; d++) {
      for (int i = 0; i < 3; i++) kiln_requires_grad_(ins[d][i], true);
      kiln_tensor *y = kiln_conv2d(ins[d][0], ins[d][1], ins[d][2], k->s, k->p, k->d, k->g);
      /* weights 1, 2, 3, ... on the output so that every position's gradient differs */
      kiln_tensor *r = y ? kiln_reshape(kiln_arange(0, (double)kiln_numel(y), 1, kiln_dtype_of(y), kiln_device_cpu()),
                                        4, kiln_shape(y))
                         : NULL;
      if (!y || !r || kiln_backward(kiln_sum_all(kiln_mul(y, kiln_mul_scalar(r, 0.01))), NULL) != KILN_OK) {
        H_CHECK(false, "f32 vs f64 conv2d case %d ran: %s", t, kiln_last_error_message());
        break;
      }
      vals[d][0] = h_values(y, &nv[0]);
      for (int i = 0; i < 3; i++) vals[d][1 + i] = h_values(kiln_grad(ins[d][i]), &nv[1 + i]);
    }
    static const char *const what[4] = {"forward", "dx", "dw", "db"};
    char name[96];
    for (int q = 0; q < 4; q++) {
      for (int d = 1; d < 3; d++) {
        snprintf(name, sizeof name, "conv2d f32%s vs f64 case %d %s", d == 2 ? " channels-last" : "", t, what[q]);
        if (vals[0][q] && vals[d][q]) h_close(name, vals[d][q], vals[0][q], nv[q], 1e-4, 1e-5);
      }
      free(vals[0][q]), free(vals[1][q]), free(vals[2][q]);
    }
    kiln_scope_end();
  }
}

/* The one-input-channel direct loops (cpu_conv_c1.c) in AVX-512 (or AVX2 on a CPU without
** it) and portable C give the same bits: the same f32 operations per output in the same
** order (KILN_CONV_C1_PORTABLE=1 picks the portable loops). Forward, weight and bias gradients, rows of 26 outputs (a
** full 16-wide chunk and a masked one) and of 5. */
static void cv_c1_paths(void) {
  static const int64_t shapes[][4] = {{3, 1, 28, 28}, {2, 1, 9, 7}};
  for (int t = 0; t < 2; t++) {
    const int64_t *s = shapes[t];
    kiln_scope_begin();
    kiln_manual_seed(11 + (uint64_t)t);
    kiln_tensor *x = kiln_randn(KILN_SHAPE(s[0], s[1], s[2], s[3]), KILN_F32, kiln_device_cpu(), NULL);
    kiln_tensor *w = kiln_randn(KILN_SHAPE(6, 1, 3, 3), KILN_F32, kiln_device_cpu(), NULL);
    kiln_tensor *b = kiln_randn(KILN_SHAPE(6), KILN_F32, kiln_device_cpu(), NULL);
    double *vals[2][3] = {{0}};
    int64_t nv[3] = {0};
    for (int portable = 0; portable < 2; portable++) {
      setenv("KILN_CONV_C1_PORTABLE", portable ? "1" : "0", 1);
      kiln_tensor *wr = kiln_detach(w), *br = kiln_detach(b);
      kiln_requires_grad_(wr, true), kiln_requires_grad_(br, true);
      kiln_tensor *y = kiln_conv2d(x, wr, br, NULL, NULL, NULL, 1);
      kiln_tensor *r = y ? kiln_reshape(kiln_arange(0, (double)kiln_numel(y), 1, KILN_F32, kiln_device_cpu()), 4,
                                        kiln_shape(y))
                         : NULL;
      bool ok = y && r && kiln_backward(kiln_sum_all(kiln_mul(y, kiln_mul_scalar(r, 0.01))), NULL) == KILN_OK;
      H_CHECK(ok, "c1 paths case %d ran: %s", t, kiln_last_error_message());
      if (!ok) break;
      vals[portable][0] = h_values(y, &nv[0]);
      vals[portable][1] = h_values(kiln_grad(wr), &nv[1]);
      vals[portable][2] = h_values(kiln_grad(br), &nv[2]);
    }
    unsetenv("KILN_CONV_C1_PORTABLE");
    for (int q = 0; q < 3; q++) {
      if (vals[0][q] && vals[1][q])
        H_CHECK(memcmp(vals[0][q], vals[1][q], (size_t)nv[q] * sizeof(double)) == 0,
                "c1 case %d: AVX-512/AVX2 and portable %s have the same bits", t, q == 0 ? "forward" : q == 1 ? "dw" : "db");
      free(vals[0][q]), free(vals[1][q]);
    }
    kiln_scope_end();
  }
}

/* kiln_conv2d_relu_max_pool2d (the CPU's CONV1_RELU_MAX_POOL2D kernels where they apply:
** one input channel that needs no gradient, f32, tiling pool windows) against conv2d then
** relu_max_pool2d: the same output, weight and bias gradients, bit for bit (the same f32
** operations per value), with the direct loops in AVX-512 and portable C; 2x2 pools on
** 26x26 (fmnist-cnn's), odd 9x7 with padding 1, and 3x2 windows; then an input that needs
** a gradient and a two-channel one (the ops it stands for), against the same. */
static void cv_conv_relu_pool(void) {
  /* the CPU has the kernel where kiln is built with oneDNN (as CONV2D); else the op is the
  ** ops it stands for, and only the bits are checked */
  bool fused_kernel = kiln__dispatch_has(kiln_device_cpu(), NULL, KILN__K_CONV1_RELU_MAX_POOL2D);
  static const int64_t shapes[][8] = {/* N, H, W, OC, kh, kw, pad, pool (kh, kw) as [7]: 2 -> 2x2, 3 -> 3x2 */
                                      {3, 28, 28, 6, 3, 3, 0, 2}, {2, 9, 7, 5, 3, 3, 1, 2}, {2, 11, 12, 4, 2, 3, 0, 3}};
  for (int t = 0; t < 5; t++) {
    const int64_t *s = shapes[t < 3 ? t : 0];
    int64_t C = t == 4 ? 2 : 1, pk[2] = {s[7] == 2 ? 2 : 3, 2}, pad[2] = {s[6], s[6]};
    kiln_scope_begin();
    kiln_manual_seed(21 + (uint64_t)t);
    kiln_tensor *x = kiln_randn(KILN_SHAPE(s[0], C, s[1], s[2]), KILN_F32, kiln_device_cpu(), NULL);
    kiln_tensor *w = kiln_randn(KILN_SHAPE(s[3], C, s[4], s[5]), KILN_F32, kiln_device_cpu(), NULL);
    kiln_tensor *b = kiln_randn(KILN_SHAPE(s[3]), KILN_F32, kiln_device_cpu(), NULL);
    if (t == 3) kiln_requires_grad_(x, true);
    double *fast[4] = {0}; /* the fused run's values on the fast path, for the portable one */
    int64_t nf[4] = {0};
    for (int portable = 0; portable < 2; portable++) {
      setenv("KILN_CONV_C1_PORTABLE", portable ? "1" : "0", 1);
      double *vals[2][4] = {{0}};
      int64_t nv[4] = {0};
      for (int fused = 0; fused < 2; fused++) {
        kiln_tensor *wr = kiln_detach(w), *br = kiln_detach(b);
        kiln_requires_grad_(wr, true), kiln_requires_grad_(br, true);
        if (t == 3) kiln_set_grad(x, NULL);
        int64_t k0 = kiln__dispatch_count();
        kiln_tensor *y = fused ? kiln_conv2d_relu_max_pool2d(x, wr, br, NULL, pad, NULL, 1, pk, NULL, NULL, NULL)
                               : kiln_relu_max_pool2d(kiln_conv2d(x, wr, br, NULL, pad, NULL, 1), pk, NULL, NULL, NULL);
        if (fused && t < 3 && fused_kernel) /* one kernel: the fused one ran */
          H_CHECK(kiln__dispatch_count() - k0 == 1, "conv_relu_pool case %d: one kernel call (%lld)", t,
                  (long long)(kiln__dispatch_count() - k0));
        kiln_tensor *r = y ? kiln_reshape(kiln_arange(0, (double)kiln_numel(y), 1, KILN_F32, kiln_device_cpu()), 4,
                                          kiln_shape(y))
                           : NULL;
        bool ok = y && r && kiln_backward(kiln_sum_all(kiln_mul(y, kiln_mul_scalar(r, 0.01))), NULL) == KILN_OK;
        H_CHECK(ok, "conv_relu_pool case %d ran: %s", t, kiln_last_error_message());
        if (!ok) break;
        vals[fused][0] = h_values(y, &nv[0]);
        vals[fused][1] = h_values(kiln_grad(wr), &nv[1]);
        vals[fused][2] = h_values(kiln_grad(br), &nv[2]);
        vals[fused][3] = t == 3 ? h_values(kiln_grad(x), &nv[3]) : NULL;
      }
      for (int q = 0; q < 4; q++) {
        if (vals[0][q] && vals[1][q])
          H_CHECK(memcmp(vals[0][q], vals[1][q], (size_t)nv[q] * sizeof(double)) == 0,
                  "conv_relu_pool case %d%s: fused and separate %s have the same bits", t, portable ? " portable" : "",
                  q == 0 ? "output" : q == 1 ? "dw" : q == 2 ? "db" : "dx");
        /* the fast path (AVX-512, or AVX2: the conv planes, the pool, the weight gradient)
        ** and the portable loops: the same bits */
        if (!portable) {
          fast[q] = vals[1][q], nf[q] = nv[q];
          vals[1][q] = NULL;
        } else if (fast[q] && vals[1][q]) {
          H_CHECK(nf[q] == nv[q] && memcmp(fast[q], vals[1][q], (size_t)nv[q] * sizeof(double)) == 0,
                  "conv_relu_pool case %d: fast and portable fused %s have the same bits", t,
                  q == 0 ? "output" : q == 1 ? "dw" : q == 2 ? "db" : "dx");
        }
        free(vals[0][q]), free(vals[1][q]);
      }
    }
    for (int q = 0; q < 4; q++) free(fast[q]);
    unsetenv("KILN_CONV_C1_PORTABLE");
    kiln_scope_end();
  }
}

/* The CPU's CONV2D_BACKWARD_DATA/_WEIGHT kernels (the reference of CUDA's, not used by
** the ops on the CPU) against conv2d's gradients through autograd, in f64, with strided
** views as the kernels' inputs and outputs. */
static void cv_backward_kernels(void) {
  static const struct {
    int64_t N, C, H, W, OC, KH, KW, s[2], p[2], d[2], g;
  } cfg[] = {{2, 4, 7, 6, 6, 3, 2, {2, 1}, {1, 0}, {1, 2}, 2},
             {1, 3, 5, 5, 3, 3, 3, {1, 1}, {1, 1}, {1, 1}, 3},
             {2, 2, 6, 7, 4, 1, 1, {2, 2}, {0, 0}, {1, 1}, 1}};
  kiln_device cpu = kiln_device_cpu();
  for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++) {
    kiln_scope_begin();
    kiln_generator *gen = kiln_generator_new(31 + ci);
    kiln_tensor *x = kiln_randn(KILN_SHAPE(cfg[ci].N, cfg[ci].C, cfg[ci].H, cfg[ci].W), KILN_F64, cpu, gen);
    kiln_tensor *w = kiln_randn(KILN_SHAPE(cfg[ci].OC, cfg[ci].C / cfg[ci].g, cfg[ci].KH, cfg[ci].KW), KILN_F64, cpu, gen);
    kiln_tensor *b = kiln_randn(KILN_SHAPE(cfg[ci].OC), KILN_F64, cpu, gen);
    kiln_requires_grad_(x, true), kiln_requires_grad_(w, true), kiln_requires_grad_(b, true);
    kiln_tensor *y = kiln_conv2d(x, w, b, cfg[ci].s, cfg[ci].p, cfg[ci].d, cfg[ci].g);
    /* g as a transposed view: the kernels take any strides */
    kiln_tensor *gt = y ? kiln_randn(KILN_SHAPE(y->shape[0], y->shape[1], y->shape[3], y->shape[2]), KILN_F64, cpu, gen)
                        : NULL;
    kiln_generator_free(gen);
    kiln_tensor *g = gt ? kiln_transpose(gt, 2, 3) : NULL;
    kiln_tensor *loss = g ? kiln_sum_all(kiln_mul(y, g)) : NULL;
    if (!loss || kiln_backward(loss, NULL) != KILN_OK) {
      H_CHECK(false, "conv2d backward kernels case %zu: setup failed: %s", ci, kiln_last_error_message());
      kiln_scope_end();
      continue;
    }
    kiln__conv_params cp = {{cfg[ci].KH, cfg[ci].KW}, {cfg[ci].s[0], cfg[ci].s[1]}, {cfg[ci].p[0], cfg[ci].p[1]},
                            {cfg[ci].d[0], cfg[ci].d[1]}};
    /* outputs written through transposed views too */
    kiln_tensor *dxt = kiln_full(KILN_SHAPE(x->shape[0], x->shape[1], x->shape[3], x->shape[2]), 7.0, KILN_F64, cpu);
    kiln_tensor *dx = kiln_transpose(dxt, 2, 3);
    kiln_tensor *dw = kiln_full(4, w->shape, 7.0, KILN_F64, cpu), *db = kiln_full(1, b->shape, 7.0, KILN_F64, cpu);
    kiln__kargs a = {0};
    a.op = KILN__K_CONV2D_BACKWARD_DATA;
    a.n_in = 2, a.n_out = 1;
    a.in[0] = kiln__view_of(g), a.in[1] = kiln__view_of(w), a.out[0] = kiln__view_of(dx);
    a.i[0] = cfg[ci].g;
    a.params = &cp;
    H_CHECK(kiln__dispatch(cpu, &a) == KILN_OK, "CONV2D_BACKWARD_DATA case %zu: %s", ci, kiln_last_error_message());
    kiln__kargs q = a;
    q.op = KILN__K_CONV2D_BACKWARD_WEIGHT;
    q.n_out = 2;
    q.in[0] = kiln__view_of(x), q.in[1] = kiln__view_of(g), q.out[0] = kiln__view_of(dw), q.out[1] = kiln__view_of(db);
    H_CHECK(kiln__dispatch(cpu, &q) == KILN_OK, "CONV2D_BACKWARD_WEIGHT case %zu: %s", ci, kiln_last_error_message());
    kiln_tensor *pairs[3][2] = {{dx, kiln_grad(x)}, {dw, kiln_grad(w)}, {db, kiln_grad(b)}};
    static const char *const nm[3] = {"dx", "dw", "db"};
    for (int k = 0; k < 3; k++) {
      int64_t n = 0;
      double *want = h_values(pairs[k][1], &n);
      char name[96];
      snprintf(name, sizeof name, "conv2d backward kernel case %zu %s", ci, nm[k]);
      if (want) h_tensor_close(name, pairs[k][0], want, n, 1e-10, 1e-10);
      else H_CHECK(false, "%s: no gradient", name);
      free(want);
    }
    /* bad groups: an error naming the op, not a crash */
    kiln__kargs bad = a;
    bad.i[0] = 5;
    H_CHECK(kiln__dispatch(cpu, &bad) == KILN_ERR_SHAPE && strstr(kiln_last_error_message(), "conv2d_backward_data"),
            "CONV2D_BACKWARD_DATA with groups not dividing C: %s", kiln_last_error_message());
    kiln_scope_end();
  }
}

/* Memory formats: kiln_contiguous_format / kiln_is_contiguous_format on the CPU. */
static void cv_format(void) {
  kiln_scope_begin();
  kiln_device cpu = kiln_device_cpu();
  kiln_generator *gen = kiln_generator_new(3);
  kiln_tensor *x = kiln_randn(KILN_SHAPE(2, 3, 4, 5), KILN_F64, cpu, gen);
  kiln_tensor *w = kiln_randn(KILN_SHAPE(4, 3, 3, 3), KILN_F64, cpu, gen);
  kiln_generator_free(gen);
  kiln_requires_grad_(x, true);
  H_CHECK(kiln_is_contiguous_format(x, KILN_CONTIGUOUS_FORMAT) && !kiln_is_contiguous_format(x, KILN_CHANNELS_LAST),
          "a new tensor is contiguous, not channels-last");
  kiln_tensor *y = kiln_contiguous_format(x, KILN_CHANNELS_LAST);
  H_CHECK(y && kiln_is_contiguous_format(y, KILN_CHANNELS_LAST) && !kiln_is_contiguous(y),
          "contiguous_format(channels_last) gives channels-last strides: %s", kiln_last_error_message());
  if (y) {
    const int64_t *st = kiln_strides(y);
    H_CHECK(st[0] == 60 && st[1] == 1 && st[2] == 15 && st[3] == 3, "channels-last strides (%lld, %lld, %lld, %lld)",
            (long long)st[0], (long long)st[1], (long long)st[2], (long long)st[3]);
    int64_t n = 0;
    double *want = h_values(x, &n);
    if (want) h_tensor_close("contiguous_format keeps the values", y, want, n, 0, 0);
    free(want);
    H_CHECK(kiln_contiguous_format(y, KILN_CHANNELS_LAST) == y, "already channels-last: the same tensor");
    /* conv2d reads it as any strided input: the same numbers as from x */
    int64_t pd[2] = {1, 1};
    kiln_tensor *a = kiln_conv2d(y, w, NULL, NULL, pd, NULL, 1), *b = kiln_conv2d(x, w, NULL, NULL, pd, NULL, 1);
    double *vb = b ? h_values(b, &n) : NULL;
    if (a && vb) h_tensor_close("conv2d of a channels-last input", a, vb, n, 1e-12, 1e-12);
    else H_CHECK(false, "conv2d of a channels-last input failed: %s", kiln_last_error_message());
    free(vb);
    /* differentiable: the gradient of sum(y * 2) is 2 everywhere, in x's layout */
    kiln_tensor *loss = kiln_sum_all(kiln_mul_scalar(y, 2.0));
    H_CHECK(loss && kiln_backward(loss, NULL) == KILN_OK && kiln_grad(x), "backward through contiguous_format: %s",
            kiln_last_error_message());
    if (kiln_grad(x)) {
      double *g = h_values(kiln_grad(x), &n);
      bool ok = g != NULL;
      for (int64_t i = 0; ok && i < n; i++) ok = g[i] == 2.0;
      H_CHECK(ok, "the gradient through contiguous_format is 2 everywhere");
      free(g);
    }
    kiln_tensor *back = kiln_contiguous_format(y, KILN_CONTIGUOUS_FORMAT);
    H_CHECK(back && kiln_is_contiguous(back), "contiguous_format(contiguous) of a channels-last tensor is contiguous");
  }
  kiln_tensor *t3 = kiln_zeros(KILN_SHAPE(2, 3, 4), KILN_F32, cpu);
  H_EXPECT_ERR(kiln_contiguous_format(t3, KILN_CHANNELS_LAST), KILN_ERR_SHAPE, "channels_last of a 3-d tensor");
  H_EXPECT_ERR(kiln_contiguous_format(x, (kiln_memory_format)7), KILN_ERR_INVALID_ARGUMENT, "an unknown format");
  H_CHECK(!kiln_is_contiguous_format(t3, KILN_CHANNELS_LAST) && !kiln_is_contiguous_format(NULL, KILN_CONTIGUOUS_FORMAT),
          "is_contiguous_format: false for 3-d and NULL");
  kiln_scope_end();
}

/* max_pool2d's gradient in f32 against f64, for windows that do not overlap (the CPU's
** direct path: each pixel gets at most one window's gradient) and ones that do (the
** general loop), on a transposed (non-contiguous) input: equal bit for bit, since the
** gradient is only moved, or summed in f64 and rounded once. */
static void cv_max_pool_grad_f32(void) {
  static const struct {
    int64_t k[2], s[2], p[2];
  } cfg[] = {{{2, 2}, {2, 2}, {0, 0}}, {{2, 3}, {2, 3}, {1, 1}}, {{3, 3}, {2, 2}, {1, 1}}, {{1, 1}, {2, 1}, {0, 0}}};
  kiln_device cpu = kiln_device_cpu();
  for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++) {
    kiln_scope_begin();
    kiln_generator *gen = kiln_generator_new(77 + ci);
    kiln_tensor *xt = kiln_to_dtype(kiln_randn(KILN_SHAPE(2, 3, 9, 7), KILN_F32, cpu, gen), KILN_F64);
    kiln_generator_free(gen);
    double *v[2] = {NULL, NULL};
    int64_t n[2] = {0, 0};
    for (int d = 0; d < 2; d++) {
      kiln_tensor *x = kiln_to_dtype(xt, d ? KILN_F32 : KILN_F64);
      x = kiln_transpose(kiln_contiguous(kiln_transpose(x, 2, 3)), 2, 3); /* strided */
      kiln_requires_grad_(x, true);
      const int64_t one[2] = {1, 1};
      kiln_tensor *y = kiln_max_pool2d(x, cfg[ci].k, cfg[ci].s, cfg[ci].p, one, NULL);
      kiln_tensor *r = y ? kiln_reshape(kiln_arange(1, (double)kiln_numel(y) + 1, 1, kiln_dtype_of(y), cpu), 4,
                                        kiln_shape(y))
                         : NULL;
      if (!r || kiln_backward(kiln_sum_all(kiln_mul(y, r)), NULL) != KILN_OK) {
        H_CHECK(false, "max_pool2d f32 gradient case %zu ran: %s", ci, kiln_last_error_message());
        break;
      }
      v[d] = h_values(kiln_grad(x), &n[d]);
    }
    char name[80];
    snprintf(name, sizeof name, "max_pool2d f32 vs f64 gradient case %zu", ci);
    if (v[0] && v[1]) h_close(name, v[1], v[0], n[0], 0, 0);
    free(v[0]), free(v[1]);
    kiln_scope_end();
  }
}

/* The ops on a ResNet's path keep a channels-last input's memory format (PyTorch's rule)
** and give the NCHW run's values: conv2d with a bias, relu, add (same shape, and a
** broadcast operand), to_dtype and back, clone, max_pool2d (and its indices), mul_scalar;
** backward then gives x's and w's gradients with the NCHW run's values. Run on dev in dt;
** rtol/atol compare the two runs (the CPU's are exact: the same arithmetic in another
** memory order, though BLAS may sum the weight gradient in another order: grad_tol;
** cuDNN's NHWC algorithms round otherwise). grads: compare the gradients
** too (a max_pool2d argmax may flip between two near-equal 16-bit values, so not there).
** Returns whether every check passed. */
static bool cv_keep_format_on(kiln_device dev, kiln_dtype dt, double rtol, double atol, double grad_tol,
                              bool grads) {
  bool ok = true;
  kiln_scope_begin();
  kiln_generator *gen = kiln_generator_new(11);
  kiln_device cpu = kiln_device_cpu();
  kiln_tensor *x0 = kiln_randn(KILN_SHAPE(2, 8, 9, 10), KILN_F64, cpu, gen);
  kiln_tensor *w0 = kiln_randn(KILN_SHAPE(6, 8, 3, 3), KILN_F64, cpu, gen);
  kiln_tensor *b0 = kiln_randn(KILN_SHAPE(6), KILN_F64, cpu, gen);
  kiln_tensor *r0 = kiln_randn(KILN_SHAPE(2, 6, 5, 5), KILN_F64, cpu, gen);
  kiln_generator_free(gen);
  enum { NR = 7 };
  static const char *const names[NR] = {"conv2d", "relu", "add", "add (broadcast)", "to_dtype", "max_pool2d",
                                        "max_pool2d indices"};
  double *vals[2][NR + 2] = {{NULL}};
  int64_t nv[NR + 2] = {0};
  char what[160], dname[32];
  kiln_device_str(dev, dname, sizeof dname);
  for (int cl = 0; cl < 2; cl++) {
    kiln_tensor *x = kiln_detach(kiln_contiguous(kiln_to_dtype(kiln_to_device(x0, dev), dt)));
    kiln_tensor *w = kiln_detach(kiln_contiguous(kiln_to_dtype(kiln_to_device(w0, dev), dt)));
    kiln_tensor *b = kiln_to_dtype(kiln_to_device(b0, dev), dt);
    kiln_tensor *r = kiln_to_dtype(kiln_to_device(r0, dev), dt);
    if (cl) {
      /* channels-last leaves, as kiln_module_to_format and a loader's batch make them */
      x = kiln_detach(kiln_contiguous_format(x, KILN_CHANNELS_LAST));
      w = kiln_detach(kiln_contiguous_format(w, KILN_CHANNELS_LAST));
    }
    if (!x || !w || !b || !r || kiln_requires_grad_(x, true) != KILN_OK || kiln_requires_grad_(w, true) != KILN_OK) {
      ok = H_CHECK(false, "keep-format setup on %s: %s", kiln_dtype_name(dt), kiln_last_error_message());
      break;
    }
    int64_t pd[2] = {1, 1}, k3[2] = {3, 3}, s2[2] = {2, 2};
    kiln_tensor *t[NR];
    t[0] = kiln_conv2d(x, w, b, NULL, pd, NULL, 1);
    t[1] = kiln_relu(t[0]);
    t[2] = kiln_add(t[1], t[0]);
    t[3] = kiln_add(t[2], kiln_reshape(b, KILN_SHAPE(6, 1, 1)));
    kiln_dtype other = dt == KILN_F32 ? KILN_F64 : KILN_F32;
    t[4] = kiln_clone(kiln_to_dtype(kiln_to_dtype(t[3], other), dt));
    kiln_tensor *ix = NULL;
    t[5] = kiln_max_pool2d(t[4], k3, s2, pd, NULL, &ix);
    t[6] = ix;
    kiln_tensor *loss = kiln_sum_all(kiln_mul(kiln_mul_scalar(t[5], 0.5), r));
    if (!loss || kiln_backward(loss, NULL) != KILN_OK) {
      ok = H_CHECK(false, "keep-format run (%s, %s): %s", cl ? "channels-last" : "contiguous", kiln_dtype_name(dt),
                   kiln_last_error_message());
      break;
    }
    for (int i = 0; i < NR; i++) {
      if (cl) {
        snprintf(what, sizeof what, "%s of a channels-last %s input on %s is channels-last", names[i],
                 kiln_dtype_name(dt), dname);
        ok &= H_CHECK(kiln_is_contiguous_format(t[i], KILN_CHANNELS_LAST) && !kiln_is_contiguous(t[i]), "%s", what);
      }
      vals[cl][i] = h_values(i == 6 ? kiln_to_dtype(t[i], KILN_F64) : t[i], &nv[i]);
    }
    vals[cl][NR] = h_values(kiln_grad(x), &nv[NR]);
    vals[cl][NR + 1] = h_values(kiln_grad(w), &nv[NR + 1]);
  }
  for (int i = 0; i < NR + 2; i++) {
    if (!vals[0][i] || !vals[1][i]) continue;
    if (i >= NR && !grads) continue;
    bool idx = i == NR - 1;
    if (idx && rtol > 0) continue; /* argmaxes of rounded values may differ */
    snprintf(what, sizeof what, "%s (%s, %s): channels-last equals contiguous",
             i < NR ? names[i] : i == NR ? "grad x" : "grad w", kiln_dtype_name(dt), dname);
    double rt = i >= NR ? grad_tol : idx ? 0 : rtol, at = i >= NR ? grad_tol : idx ? 0 : atol;
    ok &= h_close(what, vals[1][i], vals[0][i], nv[i], rt, at);
  }
  for (int c = 0; c < 2; c++)
    for (int i = 0; i < NR + 2; i++) free(vals[c][i]);
  kiln_scope_end();
  return ok;
}

/* kiln_module_to_format: a Conv2d's weight goes channels-last (its bias stays), the
** forward gives the same numbers, and back to contiguous restores NCHW memory. */
static void cv_module_format(void) {
  kiln_scope_begin();
  kiln_generator *gen = kiln_generator_new(5);
  int64_t k3[2] = {3, 3}, pd[2] = {1, 1};
  kiln_module *m = kiln_conv2d_new(4, 5, k3, NULL, pd, NULL, 1, true, KILN_F64, kiln_device_cpu(), gen);
  kiln_tensor *x = kiln_randn(KILN_SHAPE(2, 4, 6, 6), KILN_F64, kiln_device_cpu(), gen);
  kiln_generator_free(gen);
  int64_t n = 0;
  double *before = m && x ? h_values(kiln_module_forward(m, x), &n) : NULL;
  H_CHECK(kiln_module_to_format(m, KILN_CHANNELS_LAST) == KILN_OK, "kiln_module_to_format: %s",
          kiln_last_error_message());
  kiln_tensor *w = kiln_module_param(m, "weight");
  H_CHECK(w && kiln_is_contiguous_format(w, KILN_CHANNELS_LAST) && !kiln_is_contiguous(w) &&
              kiln_requires_grad(w),
          "the weight is a channels-last parameter after kiln_module_to_format");
  H_CHECK(kiln_is_contiguous(kiln_module_param(m, "bias")), "a 1-d bias is left as it is");
  kiln_tensor *y = kiln_module_forward(m, kiln_contiguous_format(x, KILN_CHANNELS_LAST));
  if (before && y) h_tensor_close("Conv2d forward after kiln_module_to_format", y, before, n, 1e-12, 1e-12);
  H_CHECK(y && kiln_is_contiguous_format(y, KILN_CHANNELS_LAST), "a channels-last Conv2d gives channels-last");
  free(before);
  H_CHECK(kiln_module_to_format(m, KILN_CONTIGUOUS_FORMAT) == KILN_OK &&
              kiln_is_contiguous(kiln_module_param(m, "weight")),
          "kiln_module_to_format(contiguous) gives NCHW weights back");
  h_expect_err_(kiln_module_to_format(m, (kiln_memory_format)9) != KILN_OK, KILN_ERR_INVALID_ARGUMENT, __FILE__,
                __LINE__, "kiln_module_to_format with an unknown format");
  h_expect_err_(kiln_module_to_format(NULL, KILN_CHANNELS_LAST) != KILN_OK, KILN_ERR_INVALID_ARGUMENT, __FILE__,
                __LINE__, "kiln_module_to_format(NULL)");
  kiln_module_free(m);
  kiln_scope_end();
}

/* Optimizers on a channels-last model: Adam (its fused multi-tensor update through the
** (N, H, W, C) views) and SGD with momentum give the contiguous model's weights, and the
** weights stay channels-last. (On CUDA cuDNN's NHWC and NCHW algorithms round apart, and
** Adam's first step divides by |g|: rtol/atol.) */
static void cv_optim_format(kiln_device dev, double rtol, double atol) {
  for (int kind = 0; kind < 2; kind++) {
    kiln_scope_begin();
    double *w[2] = {NULL, NULL};
    int64_t n = 0;
    for (int cl = 0; cl < 2; cl++) {
      kiln_generator *gen = kiln_generator_new(9);
      int64_t k3[2] = {3, 3}, pd[2] = {1, 1};
      kiln_module *m = kiln_conv2d_new(3, 4, k3, NULL, pd, NULL, 1, true, KILN_F32, dev, gen);
      kiln_tensor *x = kiln_randn(KILN_SHAPE(2, 3, 5, 5), KILN_F32, dev, gen);
      kiln_generator_free(gen);
      if (cl && m) kiln_module_to_format(m, KILN_CHANNELS_LAST);
      if (cl) x = kiln_contiguous_format(x, KILN_CHANNELS_LAST);
      kiln_optim_config cfg = kind == 0 ? kiln_adam_config(0.01) : kiln_sgd_config(0.1);
      if (kind == 1) cfg.momentum = 0.9, cfg.weight_decay = 1e-3;
      kiln_optimizer *opt = m ? kiln_optimizer_new_module(&cfg, m) : NULL;
      kiln_status st = opt && x ? KILN_OK : kiln_last_error();
      for (int step = 0; step < 3 && st == KILN_OK; step++) {
        kiln_scope_begin();
        kiln_tensor *y = kiln_module_forward(m, x);
        kiln_tensor *loss = kiln_sum_all(kiln_mul(y, y));
        st = loss ? kiln_backward(loss, NULL) : kiln_last_error();
        if (st == KILN_OK) st = kiln_optimizer_step(opt);
        if (st == KILN_OK) st = kiln_optimizer_zero_grad(opt);
        kiln_scope_end();
      }
      H_CHECK(st == KILN_OK, "%s steps on a %s Conv2d: %s", kind ? "SGD" : "Adam", cl ? "channels-last" : "contiguous",
              kiln_last_error_message());
      kiln_tensor *wt = m ? kiln_module_param(m, "weight") : NULL;
      if (cl)
        H_CHECK(wt && kiln_is_contiguous_format(wt, KILN_CHANNELS_LAST) && !kiln_is_contiguous(wt),
                "the weight stays channels-last through %s steps", kind ? "SGD" : "Adam");
      w[cl] = wt ? h_values(wt, &n) : NULL;
      kiln_optimizer_free(opt);
      kiln_module_free(m);
    }
    if (w[0] && w[1])
      h_close(kind ? "SGD on a channels-last Conv2d equals contiguous" : "Adam on a channels-last Conv2d equals contiguous",
              w[1], w[0], n, rtol, atol);
    free(w[0]), free(w[1]);
    kiln_scope_end();
  }
}

/* RELU_MAX_POOL2D_BACKWARD on the CPU for overlapping and padded windows (the general
** loop: the reference for CUDA's gather, kiln__batch_norm_relu_max_pool2d's backward) and
** any float dtype: g sent to each window's maximum where the pooled value is > 0 must be
** the gradient of sum(max_pool2d(relu(x)) * g) that autograd gives through the two ops.
** The offsets come from max_pool2d's indices (the maximum's place in its window). */
static void cv_relu_pool_bwd_general(void) {
  static const struct {
    int64_t k, s, p;
  } cfg[] = {{3, 2, 1}, {3, 1, 1}, {2, 2, 0}, {5, 2, 2}, {2, 1, 0}};
  static const kiln_dtype dts[3] = {KILN_F64, KILN_F32, KILN_BF16};
  kiln_device cpu = kiln_device_cpu();
  for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++)
    for (int di = 0; di < 3; di++) {
      kiln_scope_begin();
      const kiln_dtype dt = dts[di];
      kiln_generator *gen = kiln_generator_new(610 + ci);
      kiln_tensor *x = kiln_to_dtype(kiln_randn(KILN_SHAPE(2, 3, 9, 8), KILN_F32, cpu, gen), dt);
      const int64_t ks[2] = {cfg[ci].k, cfg[ci].k}, ss[2] = {cfg[ci].s, cfg[ci].s}, ps[2] = {cfg[ci].p, cfg[ci].p};
      const int64_t one[2] = {1, 1};
      kiln_requires_grad_(x, true);
      kiln_tensor *ix = NULL;
      kiln_tensor *y = kiln_max_pool2d(kiln_relu(x), ks, ss, ps, one, &ix);
      kiln_tensor *g = y ? kiln_to_dtype(kiln_randn(4, kiln_shape(y), KILN_F32, cpu, gen), dt) : NULL;
      kiln_generator_free(gen);
      if (!g || !ix || kiln_backward(kiln_sum_all(kiln_mul(y, g)), NULL) != KILN_OK) {
        H_CHECK(false, "relu_max_pool2d_backward case %zu %s: the reference did not run: %s", ci, kiln_dtype_name(dt),
                kiln_last_error_message());
        kiln_scope_end();
        continue;
      }
      /* offsets: index h*W + w -> (h - oh*s + p)*k + (w - ow*s + p) */
      const int64_t *ys = kiln_shape(y), W = kiln_shape(x)[3];
      int64_t n = 0, ni = 0;
      double *iv = h_values(ix, &ni);
      uint8_t *ov = malloc((size_t)(ni > 0 ? ni : 1));
      for (int64_t e = 0; iv && ov && e < ni; e++) {
        const int64_t ow = e % ys[3], oh = (e / ys[3]) % ys[2], at = (int64_t)iv[e];
        ov[e] = (uint8_t)((at / W - oh * cfg[ci].s + cfg[ci].p) * cfg[ci].k + (at % W - ow * cfg[ci].s + cfg[ci].p));
      }
      kiln_tensor *off = iv && ov ? kiln_from_data(ov, 4, ys, KILN_U8, cpu) : NULL;
      kiln_tensor *dx = kiln_empty(4, kiln_shape(x), dt, cpu);
      free(iv), free(ov);
      kiln__conv_params cp = {{cfg[ci].k, cfg[ci].k}, {cfg[ci].s, cfg[ci].s}, {cfg[ci].p, cfg[ci].p}, {1, 1}};
      kiln__kargs a = {0};
      a.op = KILN__K_RELU_MAX_POOL2D_BACKWARD;
      a.n_in = 3, a.n_out = 1;
      if (off && dx) {
        a.in[0] = kiln__view_of(g), a.in[1] = kiln__view_of(kiln_detach(y)), a.in[2] = kiln__view_of(off);
        a.out[0] = kiln__view_of(dx);
        a.params = &cp;
      }
      kiln_status st = off && dx ? kiln__dispatch(cpu, &a) : kiln_last_error();
      H_CHECK(st == KILN_OK, "relu_max_pool2d_backward case %zu %s: %s", ci, kiln_dtype_name(dt), kiln_last_error_message());
      if (st == KILN_OK) {
        double *got = h_values(dx, &n), *want = h_values(kiln_grad(x), &ni);
        char what[120];
        snprintf(what, sizeof what, "relu_max_pool2d_backward %lldx%lld/%lld pad %lld %s", (long long)cfg[ci].k,
                 (long long)cfg[ci].k, (long long)cfg[ci].s, (long long)cfg[ci].p, kiln_dtype_name(dt));
        /* the same sums of the same values; bf16: autograd's sum rounded per add, ours once */
        if (got && want && n == ni) h_close(what, got, want, n, dt == KILN_BF16 ? 1e-2 : 1e-12, dt == KILN_BF16 ? 1e-2 : 1e-12);
        else H_CHECK(false, "%s: could not read the results", what);
        free(got), free(want);
      }
      kiln_scope_end();
    }
}

static void cv_family(void) {
  h_run_cases(cv_cases, (int)(sizeof cv_cases / sizeof cv_cases[0]));
  if (!h_cross_only() && !h_support_mode()) {
    cv_extra();
    cv_f32_vs_f64();
    cv_c1_paths();
    cv_conv_relu_pool();
    cv_backward_kernels();
    cv_max_pool_grad_f32();
    cv_relu_pool_bwd_general();
    cv_format();
    /* the CPU's runs are the same arithmetic in another memory order: equal values */
    cv_keep_format_on(kiln_device_cpu(), KILN_F64, 0, 0, 1e-12, true);
    cv_keep_format_on(kiln_device_cpu(), KILN_F32, 0, 0, 1e-5, true);
    cv_module_format();
    cv_optim_format(kiln_device_cpu(), 1e-5, 1e-6);
  }
}

#ifndef H_NO_MAIN
int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_conv");
  cv_family();
  return h_finish();
}
#endif
#undef N_
