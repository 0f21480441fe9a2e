/*
** ReLU + max-pool and a one-channel conv + ReLU + max-pool in one pass each way on CUDA:
** RELU_MAX_POOL2D, RELU_MAX_POOL2D_BACKWARD, CONV1_RELU_MAX_POOL2D and its backward
** (backend.h gives the contracts; src/backend/cpu/cpu_maxpool.c and cpu_conv_c1.c are the
** references). f32 only, tiling windows (stride = kernel, no padding or dilation); and
** RELU_MAX_POOL2D_BACKWARD for any window and float dtype as a gather (below).
**
** Why: fashion-mnist's CNN (issue 15) ran its first layer on CUDA as cuDNN's conv (51-65 us
** for 1 -> 32 channels, 3x3, on 128x28x28: 4-8 TFLOP/s at this size), the bias, ReLU
** (14 us), max_pool2d (15 us, i64 indices) and their three backwards (cuDNN's weight
** gradient 63-84 us, the bias's channel sum 26 us, max_pool2d's 18-28 us), writing and
** reading the 11 MB conv output and its gradient on the way. Here the conv output is never
** made: the forward computes each pool window's conv values from the image (a few
** multiply-adds each), takes the max and writes only the pooled output and a byte per
** output for the max's offset; the backward sends the pooled gradient straight into the
** weight's and the bias's sums.
**
** Numbers:
** - the forward's conv values are the CPU's bits: the bias, then the taps in (i, j) order,
**   each a product then a sum rounded apart (__fmul_rn / __fadd_rn: nvcc would fuse them
**   into an FMA, which the CPU's -ffp-contract=off build never does), then MAX_POOL2D's
**   rule (the first maximum in window order, NaN wins) and ReLU (v < 0 ? 0 : v);
** - the weight and bias gradients sum f32 products in f64, in a fixed order: per block a
**   fixed range of images of one channel (threads strided over it, then a shuffle tree and
**   the warps in order), then one finishing kernel adds the blocks in order. No atomics,
**   and the split depends on the shapes only, not on the device: the same bits every run
**   (DESIGN.md). They agree with the CPU's (f32 rows summed in f64) within f32 rounding.
** - RELU_MAX_POOL2D(_BACKWARD): the CPU's plane loops' values exactly (a max and a select).
** Offsets are 32-bit (supports() says no where a view's span would not fit).
*/
#include "cuda_int.cuh"

#include <limits.h>
#include <string.h>

extern "C" bool kiln__cuda_conv1_supports(const kiln__kargs *a);
extern "C" kiln_status kiln__cuda_conv1(const kiln__kargs *a);

namespace {

/* the largest element offset a view reaches (INT64_MAX for a negative stride) */
int64_t span(const kiln__view *v) {
  int64_t s = 0;
  for (int d = 0; d < v->ndim; d++) {
    if (v->shape[d] == 0) return 0;
    if (v->strides[d] < 0) return INT64_MAX;
    s += (v->shape[d] - 1) * v->strides[d];
  }
  return s;
}
bool fits32(const kiln__view *v) { return span(v) < INT_MAX / 2 && kc_numel(v) < INT_MAX / 2; }

/* tiling windows: stride = kernel, no padding, no dilation, at most 256 taps */
bool tiling(const kiln__conv_params *p) {
  for (int d = 0; d < 2; d++)
    if (p->kernel[d] < 1 || p->stride[d] != p->kernel[d] || p->padding[d] != 0 || p->dilation[d] != 1) return false;
  return p->kernel[0] * p->kernel[1] <= 256;
}

/* ---- RELU_MAX_POOL2D and its backward ------------------------------------------------- */

struct RGeom {
  int C, H, W, OH, OW, KH, KW, total;
  int xs[4], ys[4], is[4], gs[4];
  kc_fastdiv cdiv, ohdiv, owdiv; /* by C, by the rows and columns of the grid walked */
};

/* one thread per pooled output: the window's max (first on ties, NaN wins), ReLU, offset */
__global__ void __launch_bounds__(256) relu_pool_fwd(const float *__restrict__ x, float *__restrict__ y,
                                                     uint8_t *__restrict__ ix, RGeom g) {
  for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < g.total; k += gridDim.x * blockDim.x) {
    int r = kc_div(k, g.owdiv);
    const int ow = k - r * g.OW;
    int pl = kc_div(r, g.ohdiv);
    const int oh = r - pl * g.OH;
    const int n = kc_div(pl, g.cdiv), c = pl - n * g.C;
    const float *xp = x + n * g.xs[0] + c * g.xs[1] + oh * g.KH * g.xs[2] + ow * g.KW * g.xs[3];
    float best = xp[0];
    int at = 0;
    for (int i = 0; i < g.KH; i++)
      for (int j = 0; j < g.KW; j++) {
        float v = xp[i * g.xs[2] + j * g.xs[3]];
        if (v > best || (v != v && best == best)) best = v, at = i * g.KW + j;
      }
    y[n * g.ys[0] + c * g.ys[1] + oh * g.ys[2] + ow * g.ys[3]] = best < 0 ? 0.0f : best;
    ix[n * g.is[0] + c * g.is[1] + oh * g.is[2] + ow * g.is[3]] = (uint8_t)at;
  }
}

/* one thread per window of the grid ceil(H / kh) x ceil(W / kw): the window's pixels all
** written, g at its max where y > 0, zeros elsewhere (and in the rows and columns no
** window covers) */
__global__ void __launch_bounds__(256) relu_pool_bwd(const float *__restrict__ gr, const float *__restrict__ y,
                                                     const uint8_t *__restrict__ ix, float *__restrict__ dx, RGeom g,
                                                     int EH, int EW) {
  for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < g.total; k += gridDim.x * blockDim.x) {
    int r = kc_div(k, g.owdiv);
    const int b = k - r * EW;
    int pl = kc_div(r, g.ohdiv);
    const int a = r - pl * EH;
    const int n = kc_div(pl, g.cdiv), c = pl - n * g.C;
    int t = -1;
    float v = 0.0f;
    if (a < g.OH && b < g.OW) {
      t = ix[n * g.is[0] + c * g.is[1] + a * g.is[2] + b * g.is[3]];
      const float yv = y[n * g.ys[0] + c * g.ys[1] + a * g.ys[2] + b * g.ys[3]];
      v = yv > 0 ? gr[n * g.gs[0] + c * g.gs[1] + a * g.gs[2] + b * g.gs[3]] : 0.0f;
    }
    float *dp = dx + n * g.xs[0] + c * g.xs[1];
    for (int i = 0; i < g.KH; i++) {
      const int h = a * g.KH + i;
      if (h >= g.H) break;
      for (int j = 0; j < g.KW; j++) {
        const int w = b * g.KW + j;
        if (w >= g.W) break;
        dp[h * g.xs[2] + w * g.xs[3]] = i * g.KW + j == t ? v : 0.0f;
      }
    }
  }
}

void strides4(const kiln__view *v, int s[4]) {
  for (int d = 0; d < 4; d++) s[d] = (int)v->strides[d];
}

bool relu_pool_supports(const kiln__kargs *a) {
  const kiln__conv_params *p = (const kiln__conv_params *)a->params;
  bool bw = a->op == KILN__K_RELU_MAX_POOL2D_BACKWARD;
  if (!p || !tiling(p) || a->n_in != (bw ? 3 : 1) || a->n_out != (bw ? 1 : 2)) return false;
  const kiln__view *x = bw ? &a->out[0] : &a->in[0], *y = bw ? &a->in[1] : &a->out[0];
  const kiln__view *ix = bw ? &a->in[2] : &a->out[1], *g = bw ? &a->in[0] : y;
  const kiln__view *vs[4] = {x, y, ix, g};
  for (const kiln__view *v : vs)
    if (v->ndim != 4 || !fits32(v) || v->dtype != (v == ix ? KILN_U8 : KILN_F32)) return false;
  for (int d = 0; d < 2; d++)
    if (y->shape[d] != x->shape[d] || ix->shape[d] != x->shape[d] || g->shape[d] != x->shape[d]) return false;
  for (int d = 2; d < 4; d++)
    if (y->shape[d] != x->shape[d] / p->kernel[d - 2] || ix->shape[d] != y->shape[d] || g->shape[d] != y->shape[d])
      return false;
  return true;
}

kiln_status relu_pool(kiln__cuda_dev *d, const kiln__kargs *a) {
  const kiln__conv_params *p = (const kiln__conv_params *)a->params;
  bool bw = a->op == KILN__K_RELU_MAX_POOL2D_BACKWARD;
  const kiln__view *x = bw ? &a->out[0] : &a->in[0], *y = bw ? &a->in[1] : &a->out[0];
  const kiln__view *ix = bw ? &a->in[2] : &a->out[1];
  RGeom g;
  g.C = (int)x->shape[1], g.H = (int)x->shape[2], g.W = (int)x->shape[3];
  g.OH = (int)y->shape[2], g.OW = (int)y->shape[3], g.KH = (int)p->kernel[0], g.KW = (int)p->kernel[1];
  strides4(x, g.xs), strides4(y, g.ys), strides4(ix, g.is);
  if (bw) strides4(&a->in[0], g.gs);
  else memcpy(g.gs, g.ys, sizeof g.gs);
  int64_t planes = x->shape[0] * x->shape[1];
  /* the backward walks the windows that cover x: ceil, so the uncovered edge is zeroed */
  int EH = bw ? (g.H + g.KH - 1) / g.KH : g.OH, EW = bw ? (g.W + g.KW - 1) / g.KW : g.OW;
  int64_t total = planes * EH * EW;
  if (total == 0) return KILN_OK;
  if (total >= INT_MAX / 2)
    return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln_%s: too many elements for cuda", kiln__kop_name(a->op));
  g.total = (int)total;
  g.cdiv = kc_make_fastdiv((uint32_t)g.C);
  g.ohdiv = kc_make_fastdiv((uint32_t)EH), g.owdiv = kc_make_fastdiv((uint32_t)EW);
  int blocks = kc_blocks(total, 256, d->sm_count);
  if (!bw)
    relu_pool_fwd<<<blocks, 256, 0, d->stream>>>((const float *)x->data, (float *)y->data, (uint8_t *)ix->data, g);
  else
    relu_pool_bwd<<<blocks, 256, 0, d->stream>>>((const float *)a->in[0].data, (const float *)y->data,
                                                 (const uint8_t *)ix->data, (float *)x->data, g, EH, EW);
  return kiln__cuda_launched(kiln__kop_name(a->op));
}

/* ---- CONV1_RELU_MAX_POOL2D and its backward ------------------------------------------- */

struct CGeom {
  int N, H, W, OC, KH, KW, ph, pw, PKH, PKW, POH, POW, PL, Hp, Wp;
  int ocpb;   /* forward: output channels a block */
  int chunks; /* backward: image ranges per channel (fixed by the shapes) */
  int nper;   /* backward: images per range */
  int T1;     /* backward: the sums made (taps, + 1 for the bias when asked) */
};

/* Forward: block (n, channel group); the zero-padded image and the group's weights and
** biases in shared memory, one thread per pooled output. KH_ .. PKW_ > 0: the shape is
** known at compile time (fmnist-cnn's 3x3 conv, 2x2 pool), else read from g. */
template <int KH_, int KW_, int PKH_, int PKW_>
__global__ void __launch_bounds__(256) conv1_fwd(const float *__restrict__ x, const float *__restrict__ w,
                                                 const float *__restrict__ bias, float *__restrict__ y,
                                                 uint8_t *__restrict__ ix, CGeom g) {
  const int KH = KH_ > 0 ? KH_ : g.KH, KW = KW_ > 0 ? KW_ : g.KW, PKH = PKH_ > 0 ? PKH_ : g.PKH,
            PKW = PKW_ > 0 ? PKW_ : g.PKW, T = KH * KW;
  extern __shared__ float sm[];
  float *xs = sm, *ws = sm + g.Hp * g.Wp, *bs = ws + g.ocpb * T;
  const int n = blockIdx.x, oc0 = blockIdx.y * g.ocpb;
  const int noc = min(g.ocpb, g.OC - oc0);
  const float *xn = x + (int64_t)n * g.H * g.W;
  for (int k = threadIdx.x; k < g.Hp * g.Wp; k += blockDim.x) {
    const int h = k / g.Wp - g.ph, c = k % g.Wp - g.pw;
    xs[k] = h >= 0 && h < g.H && c >= 0 && c < g.W ? xn[h * g.W + c] : 0.0f;
  }
  for (int k = threadIdx.x; k < noc * T; k += blockDim.x) ws[k] = w[oc0 * T + k];
  for (int k = threadIdx.x; k < noc; k += blockDim.x) bs[k] = bias ? bias[oc0 + k] : 0.0f;
  __syncthreads();
  const int work = noc * g.PL;
  for (int k = threadIdx.x; k < work; k += blockDim.x) {
    const int o = k / g.PL, r = k - o * g.PL, poh = r / g.POW, pw_ = r - poh * g.POW;
    const float *wo = ws + o * T;
    float best = 0.0f;
    int at = 0;
    for (int pi = 0; pi < PKH; pi++)
      for (int pj = 0; pj < PKW; pj++) {
        const float *xp = xs + (poh * PKH + pi) * g.Wp + pw_ * PKW + pj;
        float acc = bs[o];
#pragma unroll
        for (int i = 0; i < KH; i++)
#pragma unroll
          for (int j = 0; j < KW; j++) acc = __fadd_rn(acc, __fmul_rn(wo[i * KW + j], xp[i * g.Wp + j]));
        const int t = pi * PKW + pj;
        if (t == 0 || acc > best || (acc != acc && best == best)) best = acc, at = t;
      }
    const int64_t q = ((int64_t)n * g.OC + oc0 + o) * g.PL + r;
    y[q] = best < 0 ? 0.0f : best;
    ix[q] = (uint8_t)at;
  }
}

/* Backward, first stage: block (channel oc, image range s); each thread sums, in f64, the
** f32 products of the pooled gradient (where y > 0) and the image pixel each tap read for
** the window's max, over the pooled outputs k = tid, tid + 256, ... of the range; then the
** warps' shuffle trees, the warps in order, one partial per (oc, s, sum). */
template <int KH_, int KW_>
__global__ void __launch_bounds__(256) conv1_bwd_part(const float *__restrict__ x, const float *__restrict__ gr,
                                                      const float *__restrict__ y, const uint8_t *__restrict__ ix,
                                                      double *__restrict__ part, CGeom g) {
  constexpr int TM = KH_ > 0 ? KH_ * KW_ + 1 : 50;
  const int KH = KH_ > 0 ? KH_ : g.KH, KW = KW_ > 0 ? KW_ : g.KW, T = KH * KW;
  const int oc = blockIdx.x, s = blockIdx.y;
  const int n0 = s * g.nper, n1 = min(g.N, n0 + g.nper);
  double acc[TM];
#pragma unroll
  for (int t = 0; t < TM; t++) acc[t] = 0.0;
  const int work = (n1 - n0) * g.PL;
  for (int k = threadIdx.x; k < work; k += blockDim.x) {
    const int nn = k / g.PL, r = k - nn * g.PL, n = n0 + nn;
    const int64_t q = ((int64_t)n * g.OC + oc) * g.PL + r;
    const float yv = y[q];
    if (!(yv > 0)) continue; /* the pair's gradient there is 0: nothing to add */
    const float gv = gr[q];
    const int t = ix[q], poh = r / g.POW, pw_ = r - poh * g.POW;
    const int oh = poh * g.PKH + t / g.PKW, ow = pw_ * g.PKW + t % g.PKW;
    const float *xn = x + (int64_t)n * g.H * g.W;
    if (KH_ > 0) { /* unrolled: the sums stay in registers */
#pragma unroll
      for (int i = 0; i < (KH_ > 0 ? KH_ : 1); i++) {
        const int h = oh + i - g.ph;
        const bool hin = h >= 0 && h < g.H;
#pragma unroll
        for (int j = 0; j < (KW_ > 0 ? KW_ : 1); j++) {
          const int c = ow + j - g.pw;
          const float xv = hin && c >= 0 && c < g.W ? xn[h * g.W + c] : 0.0f;
          acc[i * KW + j] += (double)__fmul_rn(gv, xv);
        }
      }
    } else {
      for (int t = 0; t < T; t++) {
        const int i = t / KW, j = t - i * KW, h = oh + i - g.ph, c = ow + j - g.pw;
        const float xv = h >= 0 && h < g.H && c >= 0 && c < g.W ? xn[h * g.W + c] : 0.0f;
        acc[t] += (double)__fmul_rn(gv, xv);
      }
    }
    acc[T] += (double)gv;
  }
  __shared__ double red[8][TM];
  const int lane = threadIdx.x & 31, wp = threadIdx.x >> 5;
#pragma unroll
  for (int t = 0; t < TM; t++) {
    double v = acc[t];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) red[wp][t] = v;
  }
  __syncthreads();
  const int nw = blockDim.x >> 5;
  for (int t = threadIdx.x; t < g.T1; t += blockDim.x) {
    double v = 0.0; /* t == T: the bias's sum */
    for (int k = 0; k < nw; k++) v += red[k][t];
    part[((int64_t)oc * g.chunks + s) * g.T1 + t] = v;
  }
}

/* Backward, second stage: one thread per (oc, sum): the ranges' partials in order */
__global__ void __launch_bounds__(256) conv1_bwd_finish(const double *__restrict__ part, float *__restrict__ dw,
                                                        float *__restrict__ db, CGeom g) {
  const int T = g.KH * g.KW;
  for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < g.OC * g.T1; k += gridDim.x * blockDim.x) {
    const int oc = k / g.T1, t = k - oc * g.T1;
    double v = 0.0;
    for (int s = 0; s < g.chunks; s++) v += part[((int64_t)oc * g.chunks + s) * g.T1 + t];
    if (t < T) dw[oc * T + t] = (float)v;
    else db[oc] = (float)v;
  }
}

/* the arguments, checked as cpu_conv_c1.c checks them (at most 49 taps: the backward's
** per-thread sums; the padded image at most 8192 floats: the forward's shared memory) */
bool conv1_args(const kiln__kargs *a, CGeom *g) {
  bool bw = a->op == KILN__K_CONV1_RELU_MAX_POOL2D_BACKWARD;
  const kiln__conv_params *cp = (const kiln__conv_params *)a->params, *pp = cp ? cp + 1 : NULL;
  if (!cp || a->i[0] != 1) return false;
  const kiln__view *x = &a->in[0], *w = bw ? &a->out[0] : &a->in[1];
  const kiln__view *py = bw ? &a->in[2] : &a->out[0], *pix = bw ? &a->in[3] : &a->out[1];
  const kiln__view *b = bw ? (a->n_out > 1 ? &a->out[1] : NULL) : (a->n_in > 2 ? &a->in[2] : NULL);
  const kiln__view *pg = bw ? &a->in[1] : NULL;
  if (a->n_in != (bw ? 4 : (b ? 3 : 2)) || a->n_out != (bw ? (b ? 2 : 1) : 2)) return false;
  const kiln__view *dense[5] = {x, w, py, pg, b};
  for (const kiln__view *v : dense)
    if (v && (v->dtype != KILN_F32 || !kiln__view_is_contiguous(v) || !fits32(v))) return false;
  if (pix->dtype != KILN_U8 || !kiln__view_is_contiguous(pix) || !fits32(pix)) return false;
  if (x->ndim != 4 || w->ndim != 4 || py->ndim != 4 || pix->ndim != 4 || x->shape[1] != 1 || w->shape[1] != 1)
    return false;
  if (b && (b->ndim != 1 || b->shape[0] != w->shape[0])) return false;
  for (int d = 0; d < 2; d++)
    if (cp->stride[d] != 1 || cp->dilation[d] != 1 || cp->padding[d] < 0 || cp->kernel[d] != w->shape[2 + d])
      return false;
  if (!tiling(pp) || w->shape[2] * w->shape[3] > 49) return false;
  int64_t OH = x->shape[2] + 2 * cp->padding[0] - w->shape[2] + 1;
  int64_t OW = x->shape[3] + 2 * cp->padding[1] - w->shape[3] + 1;
  if (OH < 1 || OW < 1) return false;
  int64_t sh[4] = {x->shape[0], w->shape[0], OH / pp->kernel[0], OW / pp->kernel[1]};
  for (int d = 0; d < 4; d++)
    if (py->shape[d] != sh[d] || pix->shape[d] != sh[d] || (pg && pg->shape[d] != sh[d])) return false;
  int64_t Hp = x->shape[2] + 2 * cp->padding[0], Wp = x->shape[3] + 2 * cp->padding[1];
  if (Hp * Wp > 8192) return false; /* the forward's padded image in shared memory (32 KB) */
  g->N = (int)x->shape[0], g->H = (int)x->shape[2], g->W = (int)x->shape[3], g->OC = (int)w->shape[0];
  g->KH = (int)w->shape[2], g->KW = (int)w->shape[3], g->ph = (int)cp->padding[0], g->pw = (int)cp->padding[1];
  g->PKH = (int)pp->kernel[0], g->PKW = (int)pp->kernel[1], g->POH = (int)sh[2], g->POW = (int)sh[3];
  g->PL = g->POH * g->POW, g->Hp = (int)Hp, g->Wp = (int)Wp;
  g->T1 = g->KH * g->KW + (bw && b ? 1 : 0);
  return true;
}

kiln_status conv1(kiln__cuda_dev *d, const kiln__kargs *a) {
  CGeom g;
  if (!conv1_args(a, &g))
    return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln: %s: arguments the CUDA kernel does not take",
                          kiln__kop_name(a->op));
  bool bw = a->op == KILN__K_CONV1_RELU_MAX_POOL2D_BACKWARD;
  const int T = g.KH * g.KW;
  bool k3p2 = g.KH == 3 && g.KW == 3 && g.PKH == 2 && g.PKW == 2;
  if (!bw) {
    if ((int64_t)g.N * g.OC * g.PL == 0) return KILN_OK;
    /* enough blocks for the device (about four per SM), at least one channel each */
    int64_t want = 4 * (int64_t)(d->sm_count > 0 ? d->sm_count : 132);
    int64_t groups = (want + g.N - 1) / g.N;
    if (groups > g.OC) groups = g.OC;
    if (groups < 1) groups = 1;
    g.ocpb = (int)((g.OC + groups - 1) / groups);
    /* the image and the group's weights and biases within 48 KB of shared memory (the
    ** image is at most 8192 floats: room for 81 channels of 49 taps) */
    int most = (12288 - g.Hp * g.Wp) / (T + 1);
    if (g.ocpb > most) g.ocpb = most;
    groups = (g.OC + g.ocpb - 1) / g.ocpb;
    g.chunks = g.nper = 0;
    size_t smem = (size_t)(g.Hp * g.Wp + g.ocpb * T + g.ocpb) * sizeof(float);
    if (smem > 48 * 1024)
      return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln: %s: image too large", kiln__kop_name(a->op));
    dim3 grid((unsigned)g.N, (unsigned)groups);
    const float *b = a->n_in > 2 ? (const float *)a->in[2].data : NULL;
    if (k3p2)
      conv1_fwd<3, 3, 2, 2><<<grid, 256, smem, d->stream>>>((const float *)a->in[0].data, (const float *)a->in[1].data,
                                                           b, (float *)a->out[0].data, (uint8_t *)a->out[1].data, g);
    else
      conv1_fwd<0, 0, 0, 0><<<grid, 256, smem, d->stream>>>((const float *)a->in[0].data, (const float *)a->in[1].data,
                                                           b, (float *)a->out[0].data, (uint8_t *)a->out[1].data, g);
    return kiln__cuda_launched(kiln__kop_name(a->op));
  }
  if (g.OC == 0) return KILN_OK;
  if ((int64_t)g.N * g.PL == 0) { /* nothing summed: zeros */
    for (int i = 0; i < a->n_out; i++) KC_TRY(kiln__cuda_fill_view(a->device, &a->out[i], 0.0));
    return KILN_OK;
  }
  /* the image ranges: about 512 blocks in all, fixed by the shapes (not the device), so
  ** the sums' order and bits are the same on every device */
  int chunks = 512 / g.OC;
  if (chunks < 1) chunks = 1;
  if (chunks > g.N) chunks = g.N;
  g.nper = (g.N + chunks - 1) / chunks;
  g.chunks = (g.N + g.nper - 1) / g.nper;
  g.ocpb = 0;
  size_t pn = (size_t)g.OC * g.chunks * g.T1 * sizeof(double);
  double *part = (double *)kiln__cuda_alloc(a->device, pn);
  if (!part) return kiln_last_error();
  kiln_status st = kiln__cuda_capture_note(a->device, part, pn);
  if (st == KILN_OK) {
    dim3 grid((unsigned)g.OC, (unsigned)g.chunks);
    const float *x = (const float *)a->in[0].data, *gr = (const float *)a->in[1].data;
    const float *y = (const float *)a->in[2].data;
    const uint8_t *ix = (const uint8_t *)a->in[3].data;
    if (g.KH == 3 && g.KW == 3)
      conv1_bwd_part<3, 3><<<grid, 256, 0, d->stream>>>(x, gr, y, ix, part, g);
    else
      conv1_bwd_part<0, 0><<<grid, 256, 0, d->stream>>>(x, gr, y, ix, part, g);
    st = kiln__cuda_launched("conv1_relu_max_pool2d_backward (partial sums)");
  }
  if (st == KILN_OK) {
    int blocks = (int)((g.OC * g.T1 + 255) / 256);
    conv1_bwd_finish<<<blocks, 256, 0, d->stream>>>(part, (float *)a->out[0].data,
                                                    a->n_out > 1 ? (float *)a->out[1].data : NULL, g);
    st = kiln__cuda_launched(kiln__kop_name(a->op));
  }
  kiln__cuda_free(a->device, part, pn); /* stream ordered: the kernels queued above still see it */
  return st;
}

/* ---- RELU_MAX_POOL2D_BACKWARD for any window (overlapping, padded) and float dtype: a
** gather, so no atomics (kiln__batch_norm_relu_max_pool2d's backward: ResNet's 3x3 stride-2
** stem pool). blockIdx.y (striding) an input row (n, h); a thread V channels of one pixel
** (V > 1 where every view is channels-last and C a multiple of V): the windows covering it
** in order (oh, then ow), each adding g where its offset names this pixel and y > 0, in the
** accumulation type, rounded once. */
struct GGeom {
  int64_t N, C, H, W, OH, OW, kh, kw, sh, sw, ph, pw;
  int64_t gs[4], ys[4], os[4], xs[4];
};

template <class T, int V>
__global__ void __launch_bounds__(256) relu_pool_gather(const T *__restrict__ g, const T *__restrict__ y,
                                                        const uint8_t *__restrict__ off, T *__restrict__ dx, GGeom q) {
  typedef typename kc_traits<T>::acc A;
  const int64_t CV = q.C / V, t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (t >= q.W * CV) return;
  const int64_t w = t / CV, c0 = (t - w * CV) * V;
  for (int64_t row = blockIdx.y; row < q.N * q.H; row += gridDim.y) {
    const int64_t n = row / q.H, h = row - n * q.H;
    const int64_t nh = h + q.ph - q.kh + 1, nw = w + q.pw - q.kw + 1;
    const int64_t oh0 = nh > 0 ? (nh + q.sh - 1) / q.sh : 0, oh1 = min((h + q.ph) / q.sh, q.OH - 1);
    const int64_t ow0 = nw > 0 ? (nw + q.sw - 1) / q.sw : 0, ow1 = min((w + q.pw) / q.sw, q.OW - 1);
    A acc[V];
#pragma unroll
    for (int c = 0; c < V; c++) acc[c] = 0;
    for (int64_t oh = oh0; oh <= oh1; oh++)
      for (int64_t ow = ow0; ow <= ow1; ow++) {
        const int tap = (int)((h + q.ph - oh * q.sh) * q.kw + (w + q.pw - ow * q.sw));
        const int64_t go = n * q.gs[0] + c0 * q.gs[1] + oh * q.gs[2] + ow * q.gs[3];
        const int64_t yo = n * q.ys[0] + c0 * q.ys[1] + oh * q.ys[2] + ow * q.ys[3];
        const int64_t oo = n * q.os[0] + c0 * q.os[1] + oh * q.os[2] + ow * q.os[3];
#pragma unroll
        for (int c = 0; c < V; c++)
          if (off[oo + c * q.os[1]] == tap && (A)kc_ld<T>(y[yo + c * q.ys[1]]) > (A)0) acc[c] += (A)kc_ld<T>(g[go + c * q.gs[1]]);
      }
    T *o = dx + n * q.xs[0] + c0 * q.xs[1] + h * q.xs[2] + w * q.xs[3];
#pragma unroll
    for (int c = 0; c < V; c++) o[c * q.xs[1]] = kc_st<T>(acc[c]);
  }
}

/* the channels-last gather (gather_vec's V > 1: every view's channels contiguous, aligned
** to V elements): a thread V channels of one pixel, its (n, h, w, channel group) from a flat
** index by multiply-shift divisions, each window's offsets, y and g read as one vector each
** (the generic kernel above reads them element by element with 64-bit arithmetic, many
** times slower on ResNet's stem: bench/RESULTS.md); the same windows in the same order, so
** the same sums. */
struct GCl {
  int H, W, OH, OW, kh, kw, sh, sw, ph, pw, CV, total;
  int64_t gs[4], ys[4], os[4], xs[4];
  kc_fastdiv cvd, wd, hd, shd, swd;
};

template <class T, int V>
__global__ void __launch_bounds__(256) relu_pool_gather_cl(const T *__restrict__ g, const T *__restrict__ y,
                                                           const uint8_t *__restrict__ off, T *__restrict__ dx, GCl q) {
  typedef typename kc_traits<T>::acc A;
  for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < q.total; k += gridDim.x * blockDim.x) {
    const int r = kc_div(k, q.cvd), cv = k - r * q.CV;
    const int r2 = kc_div(r, q.wd), w = r - r2 * q.W;
    const int n = kc_div(r2, q.hd), h = r2 - n * q.H;
    const int hp = h + q.ph, wp = w + q.pw;
    const int oh0 = hp < q.kh ? 0 : kc_div(hp - q.kh, q.shd) + 1, oh1 = min(kc_div(hp, q.shd), q.OH - 1);
    const int ow0 = wp < q.kw ? 0 : kc_div(wp - q.kw, q.swd) + 1, ow1 = min(kc_div(wp, q.swd), q.OW - 1);
    const int64_t c0 = (int64_t)cv * V;
    const T *gp = g + n * q.gs[0] + c0, *yp = y + n * q.ys[0] + c0;
    const uint8_t *op = off + n * q.os[0] + c0;
    A acc[V];
#pragma unroll
    for (int c = 0; c < V; c++) acc[c] = 0;
    for (int oh = oh0; oh <= oh1; oh++)
      for (int ow = ow0; ow <= ow1; ow++) {
        const int tap = (hp - oh * q.sh) * q.kw + (wp - ow * q.sw);
        const kc_vec<uint8_t, V> o = *reinterpret_cast<const kc_vec<uint8_t, V> *>(op + oh * q.os[2] + ow * q.os[3]);
        const kc_vec<T, V> yv = *reinterpret_cast<const kc_vec<T, V> *>(yp + oh * q.ys[2] + ow * q.ys[3]);
        const kc_vec<T, V> gv = *reinterpret_cast<const kc_vec<T, V> *>(gp + oh * q.gs[2] + ow * q.gs[3]);
#pragma unroll
        for (int c = 0; c < V; c++)
          if (o.v[c] == tap && (A)kc_ld<T>(yv.v[c]) > (A)0) acc[c] += (A)kc_ld<T>(gv.v[c]);
      }
    kc_vec<T, V> out;
#pragma unroll
    for (int c = 0; c < V; c++) out.v[c] = kc_st<T>(acc[c]);
    *reinterpret_cast<kc_vec<T, V> *>(dx + n * q.xs[0] + (int64_t)h * q.xs[2] + (int64_t)w * q.xs[3] + c0) = out;
  }
}

/* the flat index and every coordinate fit an int (the views' offsets stay 64-bit) */
bool gather_cl_args(const GGeom &g, int V, GCl *q) {
  const int64_t total = g.N * g.H * g.W * (g.C / V);
  if (V < 2 || total >= INT_MAX || g.H + g.ph >= INT_MAX / 2 || g.W + g.pw >= INT_MAX / 2) return false;
  q->H = (int)g.H, q->W = (int)g.W, q->OH = (int)g.OH, q->OW = (int)g.OW, q->kh = (int)g.kh, q->kw = (int)g.kw;
  q->sh = (int)g.sh, q->sw = (int)g.sw, q->ph = (int)g.ph, q->pw = (int)g.pw, q->CV = (int)(g.C / V);
  q->total = (int)total;
  for (int d = 0; d < 4; d++) q->gs[d] = g.gs[d], q->ys[d] = g.ys[d], q->os[d] = g.os[d], q->xs[d] = g.xs[d];
  q->cvd = kc_make_fastdiv((uint32_t)q->CV), q->wd = kc_make_fastdiv((uint32_t)q->W);
  q->hd = kc_make_fastdiv((uint32_t)q->H), q->shd = kc_make_fastdiv((uint32_t)q->sh);
  q->swd = kc_make_fastdiv((uint32_t)q->sw);
  return true;
}

bool gather_args(const kiln__kargs *a, GGeom *q) {
  const kiln__conv_params *p = (const kiln__conv_params *)a->params;
  if (a->op != KILN__K_RELU_MAX_POOL2D_BACKWARD || !p || a->n_in != 3 || a->n_out != 1) return false;
  const kiln__view *g = &a->in[0], *y = &a->in[1], *o = &a->in[2], *x = &a->out[0];
  if (g->ndim != 4 || y->ndim != 4 || o->ndim != 4 || x->ndim != 4 || !kc_is_float(x->dtype) || g->dtype != x->dtype ||
      y->dtype != x->dtype || o->dtype != KILN_U8)
    return false;
  q->N = x->shape[0], q->C = x->shape[1], q->H = x->shape[2], q->W = x->shape[3];
  q->kh = p->kernel[0], q->kw = p->kernel[1], q->sh = p->stride[0], q->sw = p->stride[1];
  q->ph = p->padding[0], q->pw = p->padding[1];
  if (q->kh < 1 || q->kw < 1 || q->sh < 1 || q->sw < 1 || q->ph < 0 || q->pw < 0 || p->dilation[0] != 1 ||
      p->dilation[1] != 1 || q->kh * q->kw > 256)
    return false;
  q->OH = (q->H + 2 * q->ph - q->kh) / q->sh + 1, q->OW = (q->W + 2 * q->pw - q->kw) / q->sw + 1;
  const kiln__view *outs[3] = {g, y, o};
  for (const kiln__view *v : outs)
    if (v->shape[0] != q->N || v->shape[1] != q->C || v->shape[2] != q->OH || v->shape[3] != q->OW) return false;
  for (int d = 0; d < 4; d++) q->gs[d] = g->strides[d], q->ys[d] = y->strides[d], q->os[d] = o->strides[d], q->xs[d] = x->strides[d];
  return q->N * q->H < INT64_MAX / 2;
}

/* the widest V (channels a thread) every view allows: channels-last, C a multiple, aligned */
int gather_vec(const kiln__kargs *a, const GGeom &q) {
  const size_t es = kiln_dtype_size(a->out[0].dtype);
  for (int V = (int)(16 / es); V > 1; V /= 2) {
    bool ok = q.C % V == 0;
    const kiln__view *vs[4] = {&a->in[0], &a->in[1], &a->in[2], &a->out[0]};
    for (const kiln__view *v : vs) {
      const size_t e = v->dtype == KILN_U8 ? 1 : es;
      ok = ok && v->strides[1] == 1 && (uintptr_t)v->data % (V * e) == 0;
      for (int d : {0, 2, 3}) ok = ok && v->strides[d] % V == 0;
    }
    if (ok) return V;
  }
  return 1;
}

template <class T> kiln_status gather_t(kiln__cuda_dev *d, const kiln__kargs *a, const GGeom &q) {
  const int V = gather_vec(a, q);
  const int64_t per_row = q.W * (q.C / V), rows = q.N * q.H;
  if (per_row == 0 || rows == 0) return KILN_OK;
  dim3 grid((unsigned)((per_row + 255) / 256), (unsigned)(rows < 65535 ? rows : 65535));
  const T *g = (const T *)a->in[0].data, *y = (const T *)a->in[1].data;
  const uint8_t *o = (const uint8_t *)a->in[2].data;
  T *dx = (T *)a->out[0].data;
  GCl c;
  if (gather_cl_args(q, V, &c)) {
    const unsigned blocks = (unsigned)((c.total + 255) / 256);
    switch (V) {
    case 8: relu_pool_gather_cl<T, (sizeof(T) <= 2 ? 8 : 1)><<<blocks, 256, 0, d->stream>>>(g, y, o, dx, c); break;
    case 4: relu_pool_gather_cl<T, (sizeof(T) <= 4 ? 4 : 1)><<<blocks, 256, 0, d->stream>>>(g, y, o, dx, c); break;
    default: relu_pool_gather_cl<T, 2><<<blocks, 256, 0, d->stream>>>(g, y, o, dx, c); break;
    }
    return kiln__cuda_launched("relu_max_pool2d_backward (gather, channels-last)");
  }
  switch (V) {
  case 8: relu_pool_gather<T, (sizeof(T) <= 2 ? 8 : 1)><<<grid, 256, 0, d->stream>>>(g, y, o, dx, q); break;
  case 4: relu_pool_gather<T, (sizeof(T) <= 4 ? 4 : 1)><<<grid, 256, 0, d->stream>>>(g, y, o, dx, q); break;
  case 2: relu_pool_gather<T, 2><<<grid, 256, 0, d->stream>>>(g, y, o, dx, q); break;
  default: relu_pool_gather<T, 1><<<grid, 256, 0, d->stream>>>(g, y, o, dx, q); break;
  }
  return kiln__cuda_launched("relu_max_pool2d_backward (gather)");
}

} // namespace

extern "C" bool kiln__cuda_conv1_supports(const kiln__kargs *a) {
  GGeom q;
  switch (a->op) {
  case KILN__K_RELU_MAX_POOL2D: return relu_pool_supports(a);
  case KILN__K_RELU_MAX_POOL2D_BACKWARD: return relu_pool_supports(a) || gather_args(a, &q);
  case KILN__K_CONV1_RELU_MAX_POOL2D:
  case KILN__K_CONV1_RELU_MAX_POOL2D_BACKWARD: {
    CGeom g;
    return conv1_args(a, &g);
  }
  default: return false;
  }
}

extern "C" kiln_status kiln__cuda_conv1(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  switch (a->op) {
  case KILN__K_RELU_MAX_POOL2D:
  case KILN__K_RELU_MAX_POOL2D_BACKWARD: {
    GGeom q;
    if (relu_pool_supports(a)) return relu_pool(d, a);
    if (gather_args(a, &q)) {
      kiln_status st = KILN_OK;
      KC_SWITCH_FLOAT(a->out[0].dtype, T, return KILN_ERR_DTYPE, st = gather_t<T>(d, a, q));
      return st;
    }
    return kiln_set_error(KILN_ERR_UNSUPPORTED,
                          "kiln: %s: arguments the CUDA kernels do not take (the forward: f32, tiling windows; the "
                          "backward: dilation 1, at most 256 taps)",
                          kiln__kop_name(a->op));
  }
  default: return conv1(d, a);
  }
}
