/*
** SOFTMAX, LOG_SOFTMAX and their backward rules along one dim (cross-entropy, which shares
** the row machinery of cuda_rows.cuh, is in cuda_cross_entropy.cu: a module of its own,
** so a training step that only needs it loads a small one on first use).
**
** Rows along the dim are handled by a warp (or a 256-thread block for long rows) when the
** dim is contiguous in the input: the max and the sum of exponentials are found in one
** pass (the "online softmax" rescaling, Milakov & Gimelshein 2018), the outputs written in
** a second. When the dim is strided (softmax over a leading dim), one thread takes a row
** instead, so that a warp reads 32 neighbouring rows at once, coalesced. Accumulation is
** f32 (f64 for f64).
*/
#include "cuda_rows.cuh"

#include <math.h>
#include <type_traits>

namespace {

enum { S_SOFTMAX, S_LOG_SOFTMAX, S_SOFTMAX_BW, S_LOG_SOFTMAX_BW };

/* Row geometry for up to three views (in0, in1, out0): kept dims and the one dim. */
struct SGeom {
  int nk;
  int64_t ksize[KILN_MAX_DIMS], kst[3][KILN_MAX_DIMS];
  int64_t C, cst[3];
};

__device__ __forceinline__ void row_base(const SGeom &g, int64_t r, int64_t *b) {
  b[0] = b[1] = b[2] = 0;
  for (int d = g.nk - 1; d >= 0; d--) {
    int64_t i = r % g.ksize[d];
    r /= g.ksize[d];
    b[0] += i * g.kst[0][d];
    b[1] += i * g.kst[1][d];
    b[2] += i * g.kst[2][d];
  }
}


/* G threads per row (G == 1: a thread per row). */
template <class T, int MODE, int G>
__global__ void __launch_bounds__(KC_THREADS)
    softmax_kernel(const T *x, const T *gr, T *out, SGeom g, int64_t rows) {
  typedef typename kc_traits<T>::acc A;
  const int per = KC_THREADS / G;
  int64_t r = (int64_t)blockIdx.x * per + threadIdx.x / G;
  int lane = threadIdx.x % G;
  if (r >= rows) return; /* uniform within a group */
  int64_t b[3];
  row_base(g, r, b);
  const T *xr = x + b[0];
  T *orow = out + b[2];
  const int64_t C = g.C, cx = g.cst[0], co = g.cst[2];
  if constexpr (MODE == S_SOFTMAX || MODE == S_LOG_SOFTMAX) {
    A m = -(A)INFINITY, s = 0;
    for (int64_t j = lane; j < C; j += G) {
      A v = kc_ld<T>(xr[j * cx]);
      if (v != v) { /* NaN: keep it (it poisons the row, as in PyTorch) */
        m = v;
        s = 1;
        continue;
      }
      if (v > m) {
        s = s * kc_exp(m - v) + (A)1;
        m = v;
      } else if (v != -(A)INFINITY) { /* -inf adds 0; with m still -inf it would be exp(NaN) */
        s += kc_exp(v - m);
      }
    }
    if constexpr (G > 1) group_ms<A, (G > 32 ? G : 32)>(m, s);
    A ls = kc_log(s);
    A inv = (A)1 / s;
    for (int64_t j = lane; j < C; j += G) {
      A v = kc_ld<T>(xr[j * cx]);
      orow[j * co] = kc_st<T>(MODE == S_SOFTMAX ? kc_exp(v - m) * inv : v - m - ls);
    }
  } else {
    const T *grow = gr + b[1];
    const int64_t cg = g.cst[1];
    A acc = 0;
    for (int64_t j = lane; j < C; j += G) {
      A gv = kc_ld<T>(grow[j * cg]);
      if (MODE == S_SOFTMAX_BW) acc += gv * kc_ld<T>(xr[j * cx]);
      else acc += gv;
    }
    if constexpr (G > 1) acc = group_sum<A, (G > 32 ? G : 32)>(acc);
    for (int64_t j = lane; j < C; j += G) {
      A y = kc_ld<T>(xr[j * cx]);
      A gv = kc_ld<T>(grow[j * cg]);
      orow[j * co] = kc_st<T>(MODE == S_SOFTMAX_BW ? y * (gv - acc) : gv - kc_exp(y) * acc);
    }
  }
}


/* Contiguous rows of C = 32 W NV elements (W per 16 bytes), a warp per row: each lane
** holds NV 16-byte vectors of the row in registers, so the row is read once and written
** once with 16-byte accesses and no online rescaling (the max is known before any exp).
** Attention's (B, H, T, T) scores have T = 1024 such rows by the hundred thousand; the
** general kernel's one-load-at-a-time loop reached 1.8 TB/s there. NaN poisons the row,
** and a row of -inf gives NaN, as the general kernel does. */
template <class T> struct alignas(16) SVec {
  static const int W = 16 / (int)sizeof(T);
  T v[W];
};

template <class T, int MODE, int NV>
__global__ void __launch_bounds__(KC_THREADS)
    softmax_reg(const T *x, const T *gr, T *out, SGeom g, int64_t rows) {
  typedef typename kc_traits<T>::acc A;
  const int W = SVec<T>::W;
  int64_t r = (int64_t)blockIdx.x * (KC_THREADS / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return; /* uniform within a warp */
  int64_t b[3];
  row_base(g, r, b);
  const SVec<T> *xv = (const SVec<T> *)(x + b[0]);
  SVec<T> *ov = (SVec<T> *)(out + b[2]);
  A v[NV * W];
#pragma unroll
  for (int k = 0; k < NV; k++) {
    SVec<T> t = xv[lane + 32 * k];
#pragma unroll
    for (int i = 0; i < W; i++) v[k * W + i] = kc_ld<T>(t.v[i]);
  }
  A res[NV * W];
  if constexpr (MODE == S_SOFTMAX || MODE == S_LOG_SOFTMAX) {
    A m = -(A)INFINITY;
    bool nan = false;
#pragma unroll
    for (int i = 0; i < NV * W; i++) {
      m = fmax(m, v[i]);
      nan |= v[i] != v[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (__any_sync(0xffffffffu, nan)) m = (A)NAN;
    const A ms = m == -(A)INFINITY ? (A)0 : m; /* a row of -inf: s = 0, NaN below */
    A s = 0;
#pragma unroll
    for (int i = 0; i < NV * W; i++) {
      res[i] = kc_exp(v[i] - ms);
      s += res[i];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (MODE == S_SOFTMAX) {
      A inv = (A)1 / s; /* a row of -inf: 0 * inf = NaN */
#pragma unroll
      for (int i = 0; i < NV * W; i++) res[i] = res[i] * inv;
    } else {
      A ls = kc_log(s);
#pragma unroll
      for (int i = 0; i < NV * W; i++) res[i] = v[i] - m - ls;
    }
  } else {
    const SVec<T> *gv = (const SVec<T> *)(gr + b[1]);
    A acc = 0;
#pragma unroll
    for (int k = 0; k < NV; k++) {
      SVec<T> t = gv[lane + 32 * k];
#pragma unroll
      for (int i = 0; i < W; i++) {
        res[k * W + i] = kc_ld<T>(t.v[i]); /* the gradient, for now */
        acc += MODE == S_SOFTMAX_BW ? res[k * W + i] * v[k * W + i] : res[k * W + i];
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
#pragma unroll
    for (int i = 0; i < NV * W; i++)
      res[i] = MODE == S_SOFTMAX_BW ? v[i] * (res[i] - acc) : res[i] - kc_exp(v[i]) * acc;
  }
#pragma unroll
  for (int k = 0; k < NV; k++) {
    SVec<T> t;
#pragma unroll
    for (int i = 0; i < W; i++) t.v[i] = kc_st<T>(res[k * W + i]);
    ov[lane + 32 * k] = t;
  }
}

/* NV for softmax_reg (0: the general kernel): every view's rows contiguous and 16-byte
** aligned, C = 32 W NV for NV in 1, 2, 4, 8. */
template <class T> int softmax_reg_nv(const kiln__kargs *a, const SGeom &g, int nviews) {
  const int64_t W = SVec<T>::W;
  if (g.C % (32 * W) != 0) return 0;
  int64_t nv = g.C / (32 * W);
  if (nv != 1 && nv != 2 && nv != 4 && nv != 8) return 0;
  const void *ptr[3] = {a->in[0].data, a->n_in > 1 ? a->in[1].data : a->in[0].data, a->out[0].data};
  for (int i = 0; i < 3; i++) {
    if (i == 1 && nviews < 3) continue;
    if (g.cst[i] != 1 || (uintptr_t)ptr[i] % 16 != 0) return 0;
    for (int d = 0; d < g.nk; d++)
      if ((g.kst[i][d] * (int64_t)sizeof(T)) % 16 != 0) return 0;
  }
  return (int)nv;
}

template <class T, int MODE>
kiln_status softmax_launch(kiln__cuda_dev *d, const kiln__kargs *a, const SGeom &g,
                           int64_t rows) {
  const T *x = (const T *)a->in[0].data;
  const T *gr = (const T *)(MODE >= S_SOFTMAX_BW ? a->in[1].data : a->in[0].data);
  T *out = (T *)a->out[0].data;
  bool contig = g.cst[0] == 1;
  int64_t blocks = (rows + KC_THREADS / 32 - 1) / (KC_THREADS / 32);
  switch (softmax_reg_nv<T>(a, g, MODE >= S_SOFTMAX_BW ? 3 : 2)) {
  case 1: softmax_reg<T, MODE, 1><<<(unsigned)blocks, KC_THREADS, 0, d->stream>>>(x, gr, out, g, rows); break;
  case 2: softmax_reg<T, MODE, 2><<<(unsigned)blocks, KC_THREADS, 0, d->stream>>>(x, gr, out, g, rows); break;
  case 4: softmax_reg<T, MODE, 4><<<(unsigned)blocks, KC_THREADS, 0, d->stream>>>(x, gr, out, g, rows); break;
  case 8: softmax_reg<T, MODE, 8><<<(unsigned)blocks, KC_THREADS, 0, d->stream>>>(x, gr, out, g, rows); break;
  default: blocks = 0; break;
  }
  if (blocks > 0) return kiln__cuda_launched(kiln__kop_name(a->op));
  if (!contig && rows >= 1024) {
    blocks = (rows + KC_THREADS - 1) / KC_THREADS;
    softmax_kernel<T, MODE, 1><<<(unsigned)blocks, KC_THREADS, 0, d->stream>>>(x, gr, out, g, rows);
  } else if (g.C > 1024) {
    softmax_kernel<T, MODE, KC_THREADS><<<(unsigned)rows, KC_THREADS, 0, d->stream>>>(x, gr, out, g, rows);
  } else {
    blocks = (rows + KC_THREADS / 32 - 1) / (KC_THREADS / 32);
    softmax_kernel<T, MODE, 32><<<(unsigned)blocks, KC_THREADS, 0, d->stream>>>(x, gr, out, g, rows);
  }
  return kiln__cuda_launched(kiln__kop_name(a->op));
}


kiln_status bad(const kiln__kargs *a) {
  return kiln_set_error(KILN_ERR_DTYPE, "kiln_%s: dtype %s not supported on cuda",
                        kiln__kop_name(a->op), kiln_dtype_name(a->in[0].dtype));
}


} // namespace

extern "C" bool kiln__cuda_softmax_supports(const kiln__kargs *a) {
  kiln_dtype dt = a->in[0].dtype;
  if (!kc_is_float(dt)) return false;
  for (int i = 0; i < a->n_in; i++)
    if (a->in[i].dtype != dt) return false;
  return a->out[0].dtype == dt;
}

extern "C" kiln_status kiln__cuda_softmax(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  if (!kiln__cuda_softmax_supports(a)) return bad(a);
  kiln_dtype dt = a->in[0].dtype;
  const kiln__view *in0 = &a->in[0], *out = &a->out[0];
  const kiln__view *in1 = a->n_in > 1 ? &a->in[1] : in0;
  int dim = (int)a->i[0];
  if (dim < 0) dim += in0->ndim;
  if (in0->ndim == 0) dim = 0;
  if (in0->ndim > 0 && (dim < 0 || dim >= in0->ndim))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_%s: dim %lld out of range for %d dims",
                          kiln__kop_name(a->op), (long long)a->i[0], in0->ndim);
  SGeom g;
  g.nk = 0;
  int64_t rows = 1;
  const kiln__view *vs[3] = {in0, in1, out};
  g.C = in0->ndim ? in0->shape[dim] : 1;
  for (int i = 0; i < 3; i++) g.cst[i] = in0->ndim ? vs[i]->strides[dim] : 1;
  for (int k = 0; k < in0->ndim; k++) {
    if (k == dim) continue;
    int64_t n = in0->shape[k];
    rows *= n;
    if (n == 1) continue;
    int last = g.nk - 1;
    bool merge = last >= 0;
    for (int i = 0; i < 3 && merge; i++)
      if (g.kst[i][last] != vs[i]->strides[k] * n) merge = false;
    if (merge) {
      g.ksize[last] *= n;
      for (int i = 0; i < 3; i++) g.kst[i][last] = vs[i]->strides[k];
    } else {
      g.ksize[g.nk] = n;
      for (int i = 0; i < 3; i++) g.kst[i][g.nk] = vs[i]->strides[k];
      g.nk++;
    }
  }
  if (rows == 0 || g.C == 0) return KILN_OK;
  if (rows > INT32_MAX)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_%s: %lld rows is too many", kiln__kop_name(a->op),
                          (long long)rows);
  switch (a->op) {
  case KILN__K_SOFTMAX:
    KC_SWITCH_FLOAT(dt, T, return bad(a), return softmax_launch<T, S_SOFTMAX>(d, a, g, rows))
    break;
  case KILN__K_LOG_SOFTMAX:
    KC_SWITCH_FLOAT(dt, T, return bad(a), return softmax_launch<T, S_LOG_SOFTMAX>(d, a, g, rows))
    break;
  case KILN__K_SOFTMAX_BACKWARD:
    KC_SWITCH_FLOAT(dt, T, return bad(a), return softmax_launch<T, S_SOFTMAX_BW>(d, a, g, rows))
    break;
  case KILN__K_LOG_SOFTMAX_BACKWARD:
    KC_SWITCH_FLOAT(dt, T, return bad(a),
                    return softmax_launch<T, S_LOG_SOFTMAX_BW>(d, a, g, rows))
    break;
  default: break;
  }
  return bad(a);
}
