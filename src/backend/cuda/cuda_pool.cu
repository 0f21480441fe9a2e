/*
** The window kernels of convolutional networks on CUDA: IM2COL, its adjoint COL2IM, and
** MAX_POOL2D (backend.h gives their contracts; src/backend/cpu/cpu_conv.c and
** cpu_maxpool.c are the references). Any strides, f32/f64/f16/bf16.
**
** One thread per element of the tensor written, so no two threads write one address:
** - IM2COL: per column entry, a copy of one pixel or 0 (bits moved, no arithmetic);
** - COL2IM: per pixel, a gather of the column entries that read it (at most kh*kw),
**   added to the pixel in the compute type (f32 for 16-bit floats, f64 for f64) in the
**   CPU's order (i, then j), and rounded once. A scatter with atomics would be shorter
**   but its sums would change from run to run (DESIGN.md: same seed, same numbers);
** - MAX_POOL2D: per output, the window's max compared in the compute type (exact: a
**   16-bit float widens to f32 without rounding), the first maximum on ties, NaN wins;
** - MAX_POOL2D_BACKWARD: per pixel, a gather of the grads whose index names it, over the
**   range of windows that can hold it (computed, not searched tap by tap).
** Offsets are 32-bit when every offset fits (the div/mod chain is much cheaper).
*/
#include "cuda_int.cuh"

#include <math.h>

namespace {

/* Geometry of one call: the 4-d image view (N, C, H, W), the other view's shape and
** strides (6-d columns, or the 4-d pooled output and its indices), and the window. */
template <class I> struct WGeom {
  I N, C, H, W;
  I xs[4];            /* image strides */
  I KH, KW, OH, OW;
  I os[6];            /* columns (N, C, kh, kw, OH, OW), or pooled (N, C, OH, OW) */
  I is[4];            /* MAX_POOL2D: the indices' strides */
  I sh, sw, ph, pw, dh, dw;
  I total;            /* threads' work items */
  bool cl;            /* MAX_POOL2D(_BACKWARD): channels innermost in image and pooled
                      ** views, so consecutive threads take consecutive channels */
};

/* Work item k as (n, c, a, b) over an (A, B) plane: b fastest (NCHW), or with cl the
** channels fastest (memory order of NHWC), so that a warp reads consecutive addresses. */
template <class I>
__device__ __forceinline__ void kc_pool_item(I k, I C, I A, I B, bool cl, I *n, I *c, I *a, I *b) {
  if (cl) {
    *c = k % C; k /= C;
    *b = k % B; k /= B;
    *a = k % A;
    *n = k / A;
  } else {
    *b = k % B; k /= B;
    *a = k % A; k /= A;
    *c = k % C;
    *n = k / C;
  }
}

template <class T, class I>
__global__ void __launch_bounds__(KC_THREADS) im2col_kernel(const T *x, T *cols, WGeom<I> g) {
  for (I k = (I)blockIdx.x * blockDim.x + threadIdx.x; k < g.total; k += (I)gridDim.x * blockDim.x) {
    I r = k;
    I ow = r % g.OW; r /= g.OW;
    I oh = r % g.OH; r /= g.OH;
    I j = r % g.KW; r /= g.KW;
    I i = r % g.KH; r /= g.KH;
    I c = r % g.C;
    I n = r / g.C;
    I h = oh * g.sh - g.ph + i * g.dh, w = ow * g.sw - g.pw + j * g.dw;
    T v = kc_st<T>(0.0f);
    if (h >= 0 && h < g.H && w >= 0 && w < g.W)
      v = x[n * g.xs[0] + c * g.xs[1] + h * g.xs[2] + w * g.xs[3]];
    cols[n * g.os[0] + c * g.os[1] + i * g.os[2] + j * g.os[3] + oh * g.os[4] + ow * g.os[5]] = v;
  }
}

template <class T, class I>
__global__ void __launch_bounds__(KC_THREADS) col2im_kernel(const T *cols, T *x, WGeom<I> g) {
  typedef typename kc_traits<T>::acc A;
  for (I k = (I)blockIdx.x * blockDim.x + threadIdx.x; k < g.total; k += (I)gridDim.x * blockDim.x) {
    I r = k;
    I w = r % g.W; r /= g.W;
    I h = r % g.H; r /= g.H;
    I c = r % g.C;
    I n = r / g.C;
    T *px = x + n * g.xs[0] + c * g.xs[1] + h * g.xs[2] + w * g.xs[3];
    const T *cp = cols + n * g.os[0] + c * g.os[1];
    A acc = kc_ld<T>(*px);
    for (I i = 0; i < g.KH; i++) {
      I hh = h + g.ph - i * g.dh; /* = oh * sh */
      if (hh < 0 || hh % g.sh != 0) continue;
      I oh = hh / g.sh;
      if (oh >= g.OH) continue;
      for (I j = 0; j < g.KW; j++) {
        I ww = w + g.pw - j * g.dw;
        if (ww < 0 || ww % g.sw != 0) continue;
        I ow = ww / g.sw;
        if (ow >= g.OW) continue;
        acc += kc_ld<T>(cp[i * g.os[2] + j * g.os[3] + oh * g.os[4] + ow * g.os[5]]);
      }
    }
    *px = kc_st<T>(acc);
  }
}

template <class A> __device__ __forceinline__ bool kc_isnan(A v) { return v != v; }


template <class T, class I>
__global__ void __launch_bounds__(KC_THREADS) max_pool_kernel(const T *x, T *y, int64_t *idx, WGeom<I> g) {
  typedef typename kc_traits<T>::acc A;
  for (I k = (I)blockIdx.x * blockDim.x + threadIdx.x; k < g.total; k += (I)gridDim.x * blockDim.x) {
    I n, c, oh, ow;
    kc_pool_item<I>(k, g.C, g.OH, g.OW, g.cl, &n, &c, &oh, &ow);
    const T *xp = x + n * g.xs[0] + c * g.xs[1];
    A best = 0;
    int64_t at = -1;
    for (I i = 0; i < g.KH; i++) {
      I h = oh * g.sh - g.ph + i * g.dh;
      if (h < 0 || h >= g.H) continue;
      for (I j = 0; j < g.KW; j++) {
        I w = ow * g.sw - g.pw + j * g.dw;
        if (w < 0 || w >= g.W) continue;
        A v = kc_ld<T>(xp[h * g.xs[2] + w * g.xs[3]]);
        if (at < 0 || v > best || (kc_isnan(v) && !kc_isnan(best))) best = v, at = (int64_t)h * g.W + w;
      }
    }
    /* A window wholly in padding cannot happen (the op layer bounds the padding); as
    ** the CPU, it would give -inf and index 0. */
    y[n * g.os[0] + c * g.os[1] + oh * g.os[2] + ow * g.os[3]] = kc_st<T>(at < 0 ? (A)-INFINITY : best);
    idx[n * g.is[0] + c * g.is[1] + oh * g.is[2] + ow * g.is[3]] = at < 0 ? 0 : at;
  }
}

/* MAX_POOL2D_BACKWARD: per pixel, a gather of the grads of the windows whose index names
** it: no atomics, the same sums every run (a scatter_add's atomics add in whatever order
** threads arrive). The windows that can hold pixel (h, w) are a range computed once per
** pixel, PyTorch's max_pool_backward_nchw bounds, [(h + ph - ext) / sh + 1 (0 when
** h + ph < ext), (h + ph) / sh] with ext the dilated kernel extent, and the same for w:
** a handful of divisions per pixel. (The first version walked the kh * kw taps with a
** division and a remainder per tap: 2.35 ms for ResNet-50's stem, 128x64x112x112 bf16, on
** the H200, integer division bound.) blockIdx.y walks the (n, c) planes, so a thread
** decodes (h, w) from its index in the plane with one division. Candidates are visited
** in the CPU's order (taps i then j, i.e. oh then ow descending). */
template <class T, class I>
__global__ void __launch_bounds__(KC_THREADS) max_pool_bwd_kernel(const T *g, const int64_t *idx, T *dx, WGeom<I> gm) {
  typedef typename kc_traits<T>::acc A;
  const I HW = gm.H * gm.W, planes = gm.N * gm.C;
  const I exth = (gm.KH - 1) * gm.dh + 1, extw = (gm.KW - 1) * gm.dw + 1;
  for (I pl = blockIdx.y; pl < planes; pl += gridDim.y) {
    const I n = pl / gm.C, c = pl - n * gm.C;
    const T *gp = g + n * gm.os[0] + c * gm.os[1];
    const int64_t *ip = idx + n * gm.is[0] + c * gm.is[1];
    T *xp = dx + n * gm.xs[0] + c * gm.xs[1];
    for (I p = (I)blockIdx.x * blockDim.x + threadIdx.x; p < HW; p += (I)gridDim.x * blockDim.x) {
      const I h = p / gm.W, w = p - h * gm.W;
      const I hp = h + gm.ph, wp = w + gm.pw;
      const I oh0 = hp < exth ? 0 : (hp - exth) / gm.sh + 1, ow0 = wp < extw ? 0 : (wp - extw) / gm.sw + 1;
      I oh1 = hp / gm.sh, ow1 = wp / gm.sw; /* last candidates, inclusive */
      if (oh1 > gm.OH - 1) oh1 = gm.OH - 1;
      if (ow1 > gm.OW - 1) ow1 = gm.OW - 1;
      const int64_t me = (int64_t)h * gm.W + w;
      A acc = 0;
      for (I oh = oh1; oh >= oh0; oh--)
        for (I ow = ow1; ow >= ow0; ow--)
          if (ip[oh * gm.is[2] + ow * gm.is[3]] == me) acc += kc_ld<T>(gp[oh * gm.os[2] + ow * gm.os[3]]);
      xp[h * gm.xs[2] + w * gm.xs[3]] = kc_st<T>(acc);
    }
  }
}

/* MAX_POOL2D_BACKWARD when every offset fits in 32 bits (ResNet's stem and about every
** real case): the same gather, without the integer divisions that bound the kernel above
** (1.46 ms for the stem's 128x64x112x112 bf16 on the H200). Blocks are 32 x 8 pixel tiles
** (x along w, so NCHW writes coalesce) and blockIdx.z walks the planes, so (h, w) come
** from the grid; the window ranges divide by the stride through kc_fastdiv. */
struct PoolB {
  int H, W, OH, OW, C, planes, ph, pw, exth, extw;
  int xs[4], gs[4], is[4];
  kc_fastdiv sh, sw, cdiv;
};
template <class T>
__global__ void __launch_bounds__(256) max_pool_bwd_fast(const T *g, const int64_t *idx, T *dx, PoolB b) {
  typedef typename kc_traits<T>::acc A;
  const int w = blockIdx.x * 32 + threadIdx.x, h = blockIdx.y * 8 + threadIdx.y;
  if (w >= b.W || h >= b.H) return;
  const int hp = h + b.ph, wp = w + b.pw;
  const int oh0 = hp < b.exth ? 0 : kc_div(hp - b.exth, b.sh) + 1;
  const int ow0 = wp < b.extw ? 0 : kc_div(wp - b.extw, b.sw) + 1;
  const int oh1 = min(kc_div(hp, b.sh), b.OH - 1), ow1 = min(kc_div(wp, b.sw), b.OW - 1); /* inclusive */
  const int64_t me = (int64_t)h * b.W + w;
  for (int pl = blockIdx.z; pl < b.planes; pl += gridDim.z) {
    const int n = kc_div(pl, b.cdiv), c = pl - n * b.C;
    const T *gp = g + n * b.gs[0] + c * b.gs[1];
    const int64_t *ip = idx + n * b.is[0] + c * b.is[1];
    A acc = 0;
    for (int oh = oh1; oh >= oh0; oh--)
      for (int ow = ow1; ow >= ow0; ow--)
        if (ip[oh * b.is[2] + ow * b.is[3]] == me) acc += kc_ld<T>(gp[oh * b.gs[2] + ow * b.gs[3]]);
    dx[n * b.xs[0] + c * b.xs[1] + h * b.xs[2] + w * b.xs[3]] = kc_st<T>(acc);
  }
}

/* MAX_POOL2D and its backward on channels-last views (the channels stride 1 in x, y, the
** indices and dx), V channels a thread: one 16-byte load of x (or g) a tap, the indices
** 8 bytes each in 16-byte pairs. The work items (n, a, b, channel vector) are decoded with
** kc_fastdiv. (The generic kernels above take one channel a thread and decode every item by
** three integer divisions; channels-last, max_pool_bwd_fast walks w across threads, so its
** writes are C elements apart: 3.4 ms for ResNet-50's stem at batch 256 on the H200.)
** Same window order, tie rule and gather order as the kernels above, so the same numbers. */
struct PoolCL {
  int N, H, W, OH, OW, KH, KW, sh, sw, ph, pw, dh, dw, exth, extw, CV, total;
  int xs[4], ys[4], is[4]; /* image, pooled (y or g), indices: element strides */
  kc_fastdiv cvd, bd, ad;     /* by CV, by the plane's width and height (OW, OH or W, H) */
  kc_fastdiv shd, swd;
};

template <class T, int V> __device__ __forceinline__ kc_vec<T, V> ldp(const T *p) {
  return *reinterpret_cast<const kc_vec<T, V> *>(p);
}

template <class T, int V>
__global__ void __launch_bounds__(256) max_pool_cl(const T *__restrict__ x, T *__restrict__ y, int64_t *__restrict__ idx,
                                                   PoolCL p) {
  typedef typename kc_traits<T>::acc A;
  for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < p.total; k += gridDim.x * blockDim.x) {
    int r = kc_div(k, p.cvd);
    const int cv = k - r * p.CV;
    int r2 = kc_div(r, p.bd);
    const int ow = r - r2 * p.OW;
    const int n = kc_div(r2, p.ad), oh = r2 - n * p.OH;
    const T *xp = x + (int64_t)n * p.xs[0] + cv * V;
    A best[V];
    int at[V];
#pragma unroll
    for (int t = 0; t < V; t++) best[t] = 0, at[t] = -1;
    for (int i = 0; i < p.KH; i++) {
      const int h = oh * p.sh - p.ph + i * p.dh;
      if (h < 0 || h >= p.H) continue;
      for (int j = 0; j < p.KW; j++) {
        const int w = ow * p.sw - p.pw + j * p.dw;
        if (w < 0 || w >= p.W) continue;
        kc_vec<T, V> px = ldp<T, V>(xp + h * p.xs[2] + w * p.xs[3]);
        const int me = h * p.W + w;
#pragma unroll
        for (int t = 0; t < V; t++) {
          A v = kc_ld<T>(px.v[t]);
          if (at[t] < 0 || v > best[t] || (kc_isnan(v) && !kc_isnan(best[t]))) best[t] = v, at[t] = me;
        }
      }
    }
    kc_vec<T, V> out;
#pragma unroll
    for (int t = 0; t < V; t++) out.v[t] = kc_st<T>(at[t] < 0 ? (A)-INFINITY : best[t]);
    *reinterpret_cast<kc_vec<T, V> *>(y + (int64_t)n * p.ys[0] + oh * p.ys[2] + ow * p.ys[3] + cv * V) = out;
    int64_t *ip = idx + (int64_t)n * p.is[0] + oh * p.is[2] + ow * p.is[3] + cv * V;
    if (V == 1) {
      ip[0] = at[0] < 0 ? 0 : at[0];
    } else {
#pragma unroll
      for (int t = 0; t + 1 < V; t += 2) {
        kc_vec<int64_t, 2> q;
        q.v[0] = at[t] < 0 ? 0 : at[t], q.v[1] = at[t + 1] < 0 ? 0 : at[t + 1];
        *reinterpret_cast<kc_vec<int64_t, 2> *>(ip + t) = q;
      }
    }
  }
}

template <class T, int V>
__global__ void __launch_bounds__(256) max_pool_bwd_cl(const T *__restrict__ g, const int64_t *__restrict__ idx,
                                                       T *__restrict__ dx, PoolCL p) {
  typedef typename kc_traits<T>::acc A;
  for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < p.total; k += gridDim.x * blockDim.x) {
    int r = kc_div(k, p.cvd);
    const int cv = k - r * p.CV;
    int r2 = kc_div(r, p.bd);
    const int w = r - r2 * p.W;
    const int n = kc_div(r2, p.ad), h = r2 - n * p.H;
    const int hp = h + p.ph, wp = w + p.pw;
    const int oh0 = hp < p.exth ? 0 : kc_div(hp - p.exth, p.shd) + 1;
    const int ow0 = wp < p.extw ? 0 : kc_div(wp - p.extw, p.swd) + 1;
    const int oh1 = min(kc_div(hp, p.shd), p.OH - 1), ow1 = min(kc_div(wp, p.swd), p.OW - 1); /* inclusive */
    const int64_t me = (int64_t)h * p.W + w;
    const T *gp = g + (int64_t)n * p.ys[0] + cv * V;
    const int64_t *ipp = idx + (int64_t)n * p.is[0] + cv * V;
    A acc[V];
#pragma unroll
    for (int t = 0; t < V; t++) acc[t] = 0;
    for (int oh = oh1; oh >= oh0; oh--)
      for (int ow = ow1; ow >= ow0; ow--) {
        kc_vec<T, V> pg = ldp<T, V>(gp + oh * p.ys[2] + ow * p.ys[3]);
        const int64_t *ip = ipp + oh * p.is[2] + ow * p.is[3];
        int64_t iv[V];
        if (V == 1) {
          iv[0] = ip[0];
        } else {
#pragma unroll
          for (int t = 0; t + 1 < V; t += 2) {
            kc_vec<int64_t, 2> q = *reinterpret_cast<const kc_vec<int64_t, 2> *>(ip + t);
            iv[t] = q.v[0], iv[t + 1] = q.v[1];
          }
        }
#pragma unroll
        for (int t = 0; t < V; t++)
          if (iv[t] == me) acc[t] += kc_ld<T>(pg.v[t]);
      }
    kc_vec<T, V> out;
#pragma unroll
    for (int t = 0; t < V; t++) out.v[t] = kc_st<T>(acc[t]);
    *reinterpret_cast<kc_vec<T, V> *>(dx + (int64_t)n * p.xs[0] + h * p.xs[2] + w * p.xs[3] + cv * V) = out;
  }
}

/* The channel vector width the channels-last kernels can take for this call (0: none):
** every view channels-innermost, C and every other stride a multiple of V, the data
** aligned to V elements (16 bytes for the indices). */
int pool_cl_vec(const kiln__kargs *a, const kiln__view *img, const kiln__view *other, const kiln__view *iv) {
  const kiln__view *v[3] = {img, other, iv};
  int64_t C = img->shape[1];
  for (int k = 0; k < 3; k++)
    if (v[k]->ndim != 4 || (v[k]->strides[1] != 1 && C > 1)) return 0;
  size_t es = kiln_dtype_size(img->dtype);
  for (int V = (int)(16 / es); V >= 1; V /= 2) {
    bool ok = C % V == 0;
    for (int k = 0; k < 3 && ok; k++) {
      size_t e = k == 2 ? 8 : es;
      size_t al = k == 2 ? (V >= 2 ? 16 : 8) : V * es;
      ok = (uintptr_t)v[k]->data % al == 0;
      for (int d = 0; d < 4 && ok; d++)
        if (d != 1 && v[k]->shape[d] > 1) ok = v[k]->strides[d] % V == 0;
      (void)e;
    }
    if (ok) return V;
  }
  (void)a;
  return 0;
}

template <class T, int V>
kiln_status launch_cl(kiln__cuda_dev *d, const kiln__kargs *a, const kiln__view *img, const kiln__view *other,
                      const kiln__view *iv) {
  const kiln__conv_params *cp = (const kiln__conv_params *)a->params;
  const bool bw = a->op == KILN__K_MAX_POOL2D_BACKWARD;
  PoolCL p;
  p.N = (int)img->shape[0], p.H = (int)img->shape[2], p.W = (int)img->shape[3];
  p.OH = (int)other->shape[2], p.OW = (int)other->shape[3];
  p.KH = (int)cp->kernel[0], p.KW = (int)cp->kernel[1], p.sh = (int)cp->stride[0], p.sw = (int)cp->stride[1];
  p.ph = (int)cp->padding[0], p.pw = (int)cp->padding[1], p.dh = (int)cp->dilation[0], p.dw = (int)cp->dilation[1];
  p.exth = (p.KH - 1) * p.dh + 1, p.extw = (p.KW - 1) * p.dw + 1;
  p.CV = (int)(img->shape[1] / V);
  for (int k = 0; k < 4; k++)
    p.xs[k] = (int)img->strides[k], p.ys[k] = (int)other->strides[k], p.is[k] = (int)iv->strides[k];
  int A_ = bw ? p.H : p.OH, B_ = bw ? p.W : p.OW;
  p.total = (int)((int64_t)p.N * A_ * B_ * p.CV);
  p.cvd = kc_make_fastdiv((uint32_t)p.CV), p.bd = kc_make_fastdiv((uint32_t)B_), p.ad = kc_make_fastdiv((uint32_t)A_);
  p.shd = kc_make_fastdiv((uint32_t)p.sh), p.swd = kc_make_fastdiv((uint32_t)p.sw);
  int64_t blocks = ((int64_t)p.total + 255) / 256;
  if (blocks < 1) return KILN_OK;
  if (!bw)
    max_pool_cl<T, V><<<(unsigned)blocks, 256, 0, d->stream>>>((const T *)img->data, (T *)other->data,
                                                              (int64_t *)iv->data, p);
  else
    max_pool_bwd_cl<T, V><<<(unsigned)blocks, 256, 0, d->stream>>>((const T *)other->data, (const int64_t *)iv->data,
                                                                  (T *)img->data, p);
  return kiln__cuda_launched(bw ? "max_pool2d_backward (channels-last)" : "max_pool2d (channels-last)");
}

template <class T>
kiln_status try_cl(kiln__cuda_dev *d, const kiln__kargs *a, const kiln__view *img, const kiln__view *other, bool *done) {
  const kiln__view *iv = a->op == KILN__K_MAX_POOL2D ? &a->out[1] : &a->in[1];
  int V = pool_cl_vec(a, img, other, iv);
  *done = V > 0;
  switch (V) {
  case 8: return launch_cl<T, (sizeof(T) <= 2 ? 8 : 1)>(d, a, img, other, iv);
  case 4: return launch_cl<T, (sizeof(T) <= 4 ? 4 : 1)>(d, a, img, other, iv);
  case 2: return launch_cl<T, 2>(d, a, img, other, iv);
  case 1: return launch_cl<T, 1>(d, a, img, other, iv);
  default: return KILN_OK;
  }
}

/* The largest offset a view reaches (elements), for the 32-bit choice. */
int64_t span_of(const kiln__view *v) {
  int64_t s = 0;
  for (int d = 0; d < v->ndim; d++) {
    if (v->shape[d] == 0) return 0;
    s += (v->shape[d] - 1) * (v->strides[d] < 0 ? -v->strides[d] : v->strides[d]);
  }
  return s;
}

template <class I> WGeom<I> make_geom(const kiln__kargs *a, const kiln__view *img, const kiln__view *other,
                                      const kiln__conv_params *p, int64_t total) {
  WGeom<I> g;
  g.N = (I)img->shape[0], g.C = (I)img->shape[1], g.H = (I)img->shape[2], g.W = (I)img->shape[3];
  for (int d = 0; d < 4; d++) g.xs[d] = (I)img->strides[d];
  for (int d = 0; d < 6; d++) g.os[d] = d < other->ndim ? (I)other->strides[d] : 0;
  const kiln__view *iv = a->op == KILN__K_MAX_POOL2D ? &a->out[1] : a->op == KILN__K_MAX_POOL2D_BACKWARD ? &a->in[1] : NULL;
  for (int d = 0; d < 4; d++) g.is[d] = iv ? (I)iv->strides[d] : 0;
  if (other->ndim == 6) {
    g.KH = (I)other->shape[2], g.KW = (I)other->shape[3], g.OH = (I)other->shape[4], g.OW = (I)other->shape[5];
  } else {
    g.KH = (I)p->kernel[0], g.KW = (I)p->kernel[1], g.OH = (I)other->shape[2], g.OW = (I)other->shape[3];
  }
  g.sh = (I)p->stride[0], g.sw = (I)p->stride[1], g.ph = (I)p->padding[0], g.pw = (I)p->padding[1];
  g.dh = (I)p->dilation[0], g.dw = (I)p->dilation[1];
  g.total = (I)total;
  g.cl = (a->op == KILN__K_MAX_POOL2D || a->op == KILN__K_MAX_POOL2D_BACKWARD) && g.C > 1 && img->strides[1] == 1 &&
         other->strides[1] == 1;
  return g;
}

template <class T, class I>
kiln_status launch(kiln__cuda_dev *d, const kiln__kargs *a, const kiln__view *img, const kiln__view *other,
                   int64_t total) {
  WGeom<I> g = make_geom<I>(a, img, other, (const kiln__conv_params *)a->params, total);
  int blocks = kc_blocks(total, KC_THREADS, d->sm_count);
  switch (a->op) {
  case KILN__K_IM2COL:
    im2col_kernel<T, I><<<blocks, KC_THREADS, 0, d->stream>>>((const T *)a->in[0].data, (T *)a->out[0].data, g);
    break;
  case KILN__K_COL2IM:
    col2im_kernel<T, I><<<blocks, KC_THREADS, 0, d->stream>>>((const T *)a->in[0].data, (T *)a->out[0].data, g);
    break;
  case KILN__K_MAX_POOL2D_BACKWARD: {
    if (sizeof(I) == 4 && (g.H + 7) / 8 <= 65535) {
      PoolB b;
      b.H = (int)g.H, b.W = (int)g.W, b.OH = (int)g.OH, b.OW = (int)g.OW, b.C = (int)g.C, b.planes = (int)(g.N * g.C);
      b.ph = (int)g.ph, b.pw = (int)g.pw;
      b.exth = (int)((g.KH - 1) * g.dh + 1), b.extw = (int)((g.KW - 1) * g.dw + 1);
      for (int k = 0; k < 4; k++) b.xs[k] = (int)g.xs[k], b.gs[k] = (int)g.os[k], b.is[k] = (int)g.is[k];
      b.sh = kc_make_fastdiv((uint32_t)g.sh), b.sw = kc_make_fastdiv((uint32_t)g.sw);
      b.cdiv = kc_make_fastdiv((uint32_t)g.C);
      dim3 grid((unsigned)((b.W + 31) / 32), (unsigned)((b.H + 7) / 8),
                (unsigned)(b.planes < 65535 ? b.planes : 65535));
      max_pool_bwd_fast<T><<<grid, dim3(32, 8), 0, d->stream>>>((const T *)a->in[0].data,
                                                                (const int64_t *)a->in[1].data, (T *)a->out[0].data, b);
      break;
    }
    /* x: the chunks of a plane's pixels; y: planes (strided past the grid's limit) */
    int64_t hw = (int64_t)g.H * g.W, planes = (int64_t)g.N * g.C;
    int64_t bx = (hw + KC_THREADS - 1) / KC_THREADS;
    if (bx > 1024) bx = 1024;
    if (bx < 1) bx = 1;
    dim3 grid((unsigned)bx, (unsigned)(planes < 65535 ? planes : 65535));
    max_pool_bwd_kernel<T, I><<<grid, KC_THREADS, 0, d->stream>>>((const T *)a->in[0].data,
                                                                  (const int64_t *)a->in[1].data, (T *)a->out[0].data, g);
    break;
  }
  default:
    max_pool_kernel<T, I><<<blocks, KC_THREADS, 0, d->stream>>>((const T *)a->in[0].data, (T *)a->out[0].data,
                                                                (int64_t *)a->out[1].data, g);
  }
  return kiln__cuda_launched(kiln__kop_name(a->op));
}

} // namespace

extern "C" bool kiln__cuda_window_supports(const kiln__kargs *a) {
  if (!a->params || a->n_in < 1 || a->n_out < 1) return false;
  kiln_dtype dt = a->in[0].dtype;
  if (!kc_is_float(dt) || a->out[0].dtype != dt) return false;
  switch (a->op) {
  case KILN__K_IM2COL: return a->in[0].ndim == 4 && a->out[0].ndim == 6;
  case KILN__K_COL2IM: return a->in[0].ndim == 6 && a->out[0].ndim == 4;
  case KILN__K_MAX_POOL2D:
    return a->n_out == 2 && a->in[0].ndim == 4 && a->out[0].ndim == 4 && a->out[1].ndim == 4 &&
           a->out[1].dtype == KILN_I64;
  case KILN__K_MAX_POOL2D_BACKWARD:
    return a->n_in == 2 && a->in[0].ndim == 4 && a->in[1].ndim == 4 && a->out[0].ndim == 4 &&
           a->in[1].dtype == KILN_I64;
  default: return false;
  }
}

extern "C" kiln_status kiln__cuda_window(const kiln__kargs *a) {
  if (!kiln__cuda_window_supports(a))
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_%s: dtype %s (or ranks %d -> %d) not supported on cuda",
                          kiln__kop_name(a->op), kiln_dtype_name(a->in[0].dtype), a->in[0].ndim, a->out[0].ndim);
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  bool to_img = a->op == KILN__K_COL2IM || a->op == KILN__K_MAX_POOL2D_BACKWARD; /* the image is written */
  const kiln__view *img = to_img ? &a->out[0] : &a->in[0];
  const kiln__view *other = to_img ? &a->in[0] : &a->out[0];
  /* the work items: the written tensor's elements */
  int64_t total = kc_numel(to_img ? img : other);
  if (total == 0) return KILN_OK;
  int64_t big = span_of(img) + 1;
  int64_t so = span_of(other) + 1;
  if (so > big) big = so;
  if (total > big) big = total;
  if (a->op == KILN__K_MAX_POOL2D && span_of(&a->out[1]) + 1 > big) big = span_of(&a->out[1]) + 1;
  if (a->op == KILN__K_MAX_POOL2D_BACKWARD && span_of(&a->in[1]) + 1 > big) big = span_of(&a->in[1]) + 1;
  /* h * W + w and the window arithmetic stay within a few spans; a margin keeps int32 safe */
  bool small = big < (int64_t)INT32_MAX / 4 && img->shape[2] * img->shape[3] < (int64_t)INT32_MAX / 4;
  kiln_status st = KILN_OK;
  if (small && (a->op == KILN__K_MAX_POOL2D || a->op == KILN__K_MAX_POOL2D_BACKWARD) && img->shape[1] > 1) {
    bool done = false;
    KC_SWITCH_FLOAT(img->dtype, T, return KILN_ERR_DTYPE, st = (try_cl<T>(d, a, img, other, &done)));
    if (st != KILN_OK || done) return st;
  }
  if (small) {
    KC_SWITCH_FLOAT(img->dtype, T, return KILN_ERR_DTYPE, st = (launch<T, int32_t>(d, a, img, other, total)));
  } else {
    KC_SWITCH_FLOAT(img->dtype, T, return KILN_ERR_DTYPE, st = (launch<T, int64_t>(d, a, img, other, total)));
  }
  return st;
}
