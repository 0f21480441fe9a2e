/*
** The fused CROSS_ENTROPY / CROSS_ENTROPY_MEAN / CROSS_ENTROPY_BACKWARD (logits (N, C),
** class targets (N)). The forward kernels may also write dlogits (i1 flag 1): the group
** that found a row's logsumexp reads the row again and writes its gradient, so a
** unit-seeded backward costs no launch. Rows are handled by a warp (or a block for long
** rows) with the online (max, sum of exp) of cuda_rows.cuh; accumulation is f32 (f64 for
** f64).
**
** A file (a module) of its own, apart from the softmax family: under lazy module loading
** the first launch of a kernel loads its whole module, about 1 ms a megabyte.
*/
#include "cuda_rows.cuh"

#include <math.h>
#include <type_traits>

namespace {

/* ---- cross entropy ---- */
struct CEArgs {
  int64_t N, C;
  int64_t sxn, sxc, st, sl, sz, sg, son, soc; /* strides: logits, target, loss, lse, grad, out */
  int64_t sw;   /* stride of the optional per-row weight (out2) */
  int64_t sdiv; /* backward: stride of the optional per-row divisor (in4) */
  int64_t sdn, sdc; /* forward: strides of the optional dlogits (the flag's output) */
  int64_t ignore;
  double eps;
  int *flag;
  int kop;
};

/* One value into a lane's online (max, sum of exp) and plain sum. */
template <class A> __device__ __forceinline__ void ce_step(A v, A &m, A &s, A &sum) {
  sum += v;
  if (v != v) {
    m = v;
    s = 1;
    return;
  }
  if (v > m) {
    s = s * kc_exp(m - v) + (A)1;
    m = v;
  } else if (v != -(A)INFINITY) { /* -inf adds 0; with m still -inf it would be exp(NaN) */
    s += kc_exp(v - m);
  }
}

/* Values a lane loads before it uses any: one load at a time left a warp's row latency
** bound (ResNet's (256, 1000) loss took ~250 us on the H200, 16 rows a warp). */
enum { CE_ROW_U = 4 };

/* One row's loss and logsumexp, by a group of G threads (every lane gets them). kept is
** false for an ignored row (loss and lse 0, as the CPU); an out-of-range target sets the
** index flag and gives NaN. */
template <class T, class TI, int G>
__device__ __forceinline__ void ce_row(const T *x, const TI *tgt, const CEArgs &p, int64_t n,
                                       int lane, typename kc_traits<T>::acc &out,
                                       typename kc_traits<T>::acc &l, bool &kept) {
  typedef typename kc_traits<T>::acc A;
  const T *xr = x + n * p.sxn;
  A m = -(A)INFINITY, s = 0, sum = 0;
  int64_t j = lane;
  for (; j + (CE_ROW_U - 1) * G < p.C; j += CE_ROW_U * G) {
    A v[CE_ROW_U];
#pragma unroll
    for (int u = 0; u < CE_ROW_U; u++) v[u] = kc_ld<T>(xr[(j + u * G) * p.sxc]);
#pragma unroll
    for (int u = 0; u < CE_ROW_U; u++) ce_step<A>(v[u], m, s, sum);
  }
  for (; j < p.C; j += G) ce_step<A>(kc_ld<T>(xr[j * p.sxc]), m, s, sum);
  if constexpr (G > 1) { /* G == 1: a thread has the whole row */
    group_ms<A, (G > 32 ? G : 32)>(m, s);
    sum = group_sum<A, (G > 32 ? G : 32)>(sum);
  }
  l = m + kc_log(s);
  int64_t t = (int64_t)tgt[n * p.st];
  kept = t != p.ignore;
  if (!kept) {
    out = 0;
    l = 0;
  } else if (t < 0 || t >= p.C) {
    if (lane == 0) kc_flag(p.flag, p.kop);
    out = (A)NAN;
  } else {
    A xt = kc_ld<T>(xr[t * p.sxc]);
    A e = (A)p.eps;
    /* no smoothing: no sum term (0 * a -inf logit's sum would be NaN), as the CPU */
    out = l - ((A)1 - e) * xt - (p.eps != 0 ? e / (A)p.C * sum : (A)0);
  }
}

/* The number of rows whose target is not ignore_index, by a whole block of KC_THREADS
** (every thread gets it; all must call). N <= INT32_MAX (checked at launch). */
template <class TI> __device__ __forceinline__ int ce_kept(const TI *tgt, const CEArgs &p) {
  int k = 0;
  for (int64_t n = threadIdx.x; n < p.N; n += KC_THREADS) k += (int64_t)tgt[n * p.st] != p.ignore ? 1 : 0;
  return group_sum<int, KC_THREADS>(k);
}

/* Row n's gradient for upstream grad gs (the lanes of its group split the classes), as
** ce_backward computes it: gs * (softmax - smoothed one-hot); 0 for an ignored or
** out-of-range target (the flag is ce_row's to set). */
template <class T, class TI, int G>
__device__ __forceinline__ void ce_row_grad(const T *x, const TI *tgt, T *dl, const CEArgs &p,
                                            int64_t n, int lane, typename kc_traits<T>::acc l,
                                            typename kc_traits<T>::acc gs) {
  typedef typename kc_traits<T>::acc A;
  const T *xr = x + n * p.sxn;
  T *dr = dl + n * p.sdn;
  int64_t t = (int64_t)tgt[n * p.st];
  bool zero = t == p.ignore || t < 0 || t >= p.C;
  A e = (A)p.eps;
  int64_t j = lane;
  for (; j + (CE_ROW_U - 1) * G < p.C; j += CE_ROW_U * G) {
    A v[CE_ROW_U];
    if (!zero)
#pragma unroll
      for (int u = 0; u < CE_ROW_U; u++) v[u] = kc_ld<T>(xr[(j + u * G) * p.sxc]);
#pragma unroll
    for (int u = 0; u < CE_ROW_U; u++) {
      const int64_t jj = j + u * G;
      A r = 0;
      if (!zero) {
        A pj = kc_exp(v[u] - l);
        A q = (jj == t ? (A)1 - e : (A)0) + e / (A)p.C;
        r = gs * (pj - q);
      }
      dr[jj * p.sdc] = kc_st<T>(r);
    }
  }
  for (; j < p.C; j += G) {
    A r = 0;
    if (!zero) {
      A pj = kc_exp(kc_ld<T>(xr[j * p.sxc]) - l);
      A q = (j == t ? (A)1 - e : (A)0) + e / (A)p.C;
      r = gs * (pj - q);
    }
    dr[j * p.sdc] = kc_st<T>(r);
  }
}

/* One group of G threads per row. out0 loss, out1 lse (TL = their dtype), dl (NULL: not
** asked) the row's gradient for a unit upstream grad. */
template <class T, class TL, class TI, int G>
__global__ void __launch_bounds__(KC_THREADS)
    ce_forward(const T *x, const TI *tgt, TL *loss, TL *lse, TL *w, T *dl, const TL *div, CEArgs p) {
  typedef typename kc_traits<T>::acc A;
  const int per = KC_THREADS / G;
  int64_t n = (int64_t)blockIdx.x * per + threadIdx.x / G;
  int lane = threadIdx.x % G;
  if (n >= p.N) return;
  A out, l;
  bool kept;
  ce_row<T, TI, G>(x, tgt, p, n, lane, out, l, kept);
  /* l is what ce_backward would read back: TL holds A exactly (f64 logits take f64 lse) */
  if (dl) ce_row_grad<T, TI, G>(x, tgt, dl, p, n, lane, l, div ? (A)1 / (A)kc_ld<TL>(div[n * p.sdiv]) : (A)1);
  if (lane != 0) return;
  loss[n * p.sl] = kc_st<TL>(out);
  lse[n * p.sz] = kc_st<TL>(l);
  if (w) w[n * p.sw] = kc_st<TL>(kept ? 1 : 0);
}

/* CROSS_ENTROPY_MEAN: G threads per row (a warp; one thread when the rows are short, as a
** classifier's few classes are: a warp then would idle 30 lanes through 10 shuffles a row),
** rows strided over the grid; each block sums its rows' losses and kept counts in a fixed
** order. One block writes the mean itself; with more, each writes its pair to part and
** ce_mean_finish adds the pairs in block order (no atomics, so the result does not depend
** on scheduling).
** With dl (the fused gradient) every row's gradient is divided by the count of kept rows,
** which must be known before the first row is written: one block counts the targets
** itself first (N small: a read of N indices); with several blocks ce_count has put it
** in part[2 * gridDim.x] beforehand (one more launch, only where N is large). */
template <class T, class TL, class TI, int G>
__global__ void __launch_bounds__(KC_THREADS)
    ce_mean(const T *x, const TI *tgt, TL *lse, TL *mean, TL *cnt, TL *part, T *dl, CEArgs p) {
  typedef typename kc_traits<T>::acc A;
  const int groups = KC_THREADS / G, gid = threadIdx.x / G, lane = threadIdx.x % G;
  TL ls = 0, lc = 0;
  A gs = 0; /* every kept row's upstream grad: 1 / count (inf when none is kept: unused) */
  if (dl) gs = (A)1 / (gridDim.x == 1 ? (A)ce_kept<TI>(tgt, p) : (A)part[2 * gridDim.x]);
  for (int64_t n = (int64_t)blockIdx.x * groups + gid; n < p.N; n += (int64_t)gridDim.x * groups) {
    A out, l;
    bool kept;
    ce_row<T, TI, G>(x, tgt, p, n, lane, out, l, kept);
    if (dl) ce_row_grad<T, TI, G>(x, tgt, dl, p, n, lane, l, gs);
    if (lane == 0) {
      lse[n * p.sz] = kc_st<TL>(l);
      ls += (TL)out;
      lc += kept ? (TL)1 : (TL)0;
    }
  }
  /* each warp's lane-0 values (G == 32), or all 32 lanes' (G == 1), summed in order */
  if (G == 1) {
    for (int o = 16; o > 0; o >>= 1) {
      ls += __shfl_down_sync(0xffffffffu, ls, o);
      lc += __shfl_down_sync(0xffffffffu, lc, o);
    }
  }
  __shared__ TL ps[KC_THREADS / 32], pc[KC_THREADS / 32];
  if (threadIdx.x % 32 == 0) {
    ps[threadIdx.x / 32] = ls;
    pc[threadIdx.x / 32] = lc;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  TL s = 0, c = 0;
  for (int k = 0; k < KC_THREADS / 32; k++) s += ps[k], c += pc[k];
  if (gridDim.x == 1) {
    *mean = s / c; /* nothing kept: 0 / 0 = NaN, as PyTorch */
    *cnt = c;
  } else {
    part[2 * blockIdx.x] = s;
    part[2 * blockIdx.x + 1] = c;
  }
}

/* ce_mean's count of kept rows when it runs on several blocks (one block, KC_THREADS). */
template <class TI, class TL> __global__ void __launch_bounds__(KC_THREADS) ce_count(const TI *tgt, CEArgs p, TL *out) {
  int k = ce_kept<TI>(tgt, p);
  if (threadIdx.x == 0) *out = (TL)k;
}

/* One warp: lane l adds blocks l, l + 32, ..., then a fixed shuffle tree (no atomics). */
template <class TL> __global__ void ce_mean_finish(const TL *part, int nparts, TL *mean, TL *cnt) {
  TL s = 0, c = 0;
  for (int k = threadIdx.x; k < nparts; k += 32) s += part[2 * k], c += part[2 * k + 1];
  for (int o = 16; o > 0; o >>= 1) {
    s += __shfl_down_sync(0xffffffffu, s, o);
    c += __shfl_down_sync(0xffffffffu, c, o);
  }
  if (threadIdx.x != 0) return;
  *mean = s / c;
  *cnt = c;
}

template <class T, class TL, class TI>
__global__ void __launch_bounds__(KC_THREADS)
    ce_backward(const T *x, const TI *tgt, const TL *lse, const TL *grad, const TL *div, T *out,
                CEArgs p) {
  typedef typename kc_traits<T>::acc A;
  const int64_t total = p.N * p.C;
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < total;
       k += (int64_t)gridDim.x * blockDim.x) {
    int64_t n = k / p.C, j = k % p.C;
    int64_t t = (int64_t)tgt[n * p.st];
    A r;
    if (t == p.ignore) {
      r = 0;
    } else if (t < 0 || t >= p.C) {
      if (j == 0) kc_flag(p.flag, p.kop);
      r = 0;
    } else {
      A e = (A)p.eps;
      A pj = kc_exp(kc_ld<T>(x[n * p.sxn + j * p.sxc]) - (A)kc_ld<TL>(lse[n * p.sz]));
      A q = (j == t ? (A)1 - e : (A)0) + e / (A)p.C;
      A gv = (A)kc_ld<TL>(grad[n * p.sg]);
      if (div) gv = gv / (A)kc_ld<TL>(div[n * p.sdiv]);
      r = gv * (pj - q);
    }
    out[n * p.son + j * p.soc] = kc_st<T>(r);
  }
}

/* ---- long rows (C > CE_BIG_C): a block of CE_BT threads per row ----
** A language model's vocabulary (GPT-2: 50257 classes, 16384 rows) made the warp-per-row
** kernels latency bound: one 4-byte load in flight per lane and a branchy online update
** per element gave 23.5 ms for a 3.3 GB read on an H200. Here a block owns a row, reads it
** with 16-byte loads (CE_UNROLL in flight per thread) and folds each batch of loads into
** the running (max, sum of exp) with one rescale. The fused gradient needs the row a second
** time: where it fits (CE_STAGE_MAX: GPT-2's 50257 bf16 classes do, two blocks an SM) the
** first pass keeps each thread's vectors in shared memory and the second reads them back
** from there (the second read through L2 cost 227 us a chunk of 2340 GPT-2 rows on the
** H100, against 160 for the backward kernel's one read and one write); else it reads the
** row again, mostly from the 50 MB L2.
** Rows whose target is ignored (or out of range) are not read at all. */
#define CE_BIG_C 1024
#define CE_BT 512
#define CE_UNROLL 4
#define CE_STAGE_MAX (110 * 1024) /* bytes of dynamic shared memory a staged row may take */

/* W elements of T in 16 bytes, loaded or stored as one. */
template <class T> struct alignas(16) CEVec {
  static const int W = 16 / (int)sizeof(T);
  T v[W];
};

/* exp(v - m) for the row's running max m (msl = m * log2(e) for f32): one FFMA and the
** hardware exp2 in f32 (about 2 ulp), exp() in f64. */
__device__ __forceinline__ float ce_exp(float v, float m, float msl) {
  (void)m;
  return exp2f(fmaf(v, 1.4426950408889634f, -msl));
}
__device__ __forceinline__ double ce_exp(double v, double m, double msl) {
  (void)msl;
  return exp(v - m);
}
template <class A> __device__ __forceinline__ A ce_log2e(A m) { return m * (A)1.4426950408889634; }

/* The split of a contiguous row at xr (C elements) into scalar head, 16-byte vectors and a
** scalar tail: a row of an odd vocabulary starts anywhere within a 16-byte line. */
template <class T> struct CESplit {
  int64_t head, nvec, tail0; /* vectors at xr + head + k W, k < nvec; tail from tail0 */
};
template <class T> __device__ __forceinline__ CESplit<T> ce_split(const T *xr, int64_t C) {
  const int W = CEVec<T>::W;
  CESplit<T> s;
  int64_t mis = (int64_t)(((uintptr_t)xr % 16) / sizeof(T));
  s.head = mis ? W - mis : 0;
  if (s.head > C) s.head = C;
  s.nvec = (C - s.head) / W;
  s.tail0 = s.head + s.nvec * W;
  return s;
}

/* Pass 1 over row xr: this thread's (max, sum of exp(x - max)) and plain sum. vec: the row
** is contiguous (else strided scalar loads). */
template <class T, class A>
__device__ __forceinline__ void ce_big_pass1(const T *xr, int64_t C, int64_t sxc, bool vec, A &m, A &s,
                                             A &sum, CEVec<T> *stage) {
  const int W = CEVec<T>::W;
  m = -(A)INFINITY;
  s = 0;
  sum = 0;
  /* fold n values v[] into (m, s): one rescale for the batch */
  auto fold = [&](const A *v, int n) {
    A lm = m;
    for (int i = 0; i < n; i++) lm = fmax(lm, v[i]); /* NaN: ignored here, poisons sum */
    A ms = lm == -(A)INFINITY ? (A)0 : lm;         /* all -inf so far: exp(-inf - 0) = 0 */
    A msl = ce_log2e(ms);
    A acc = s * ce_exp(m, ms, msl);
    for (int i = 0; i < n; i++) {
      acc += ce_exp(v[i], ms, msl);
      sum += v[i];
    }
    s = acc;
    m = lm;
  };
  if (!vec) {
    for (int64_t j = threadIdx.x; j < C; j += CE_BT) {
      A v = kc_ld<T>(xr[j * sxc]);
      fold(&v, 1);
    }
    return;
  }
  CESplit<T> sp = ce_split(xr, C);
  if (threadIdx.x < sp.head) {
    A v = kc_ld<T>(xr[threadIdx.x]);
    fold(&v, 1);
  }
  if (threadIdx.x < C - sp.tail0) {
    A v = kc_ld<T>(xr[sp.tail0 + threadIdx.x]);
    fold(&v, 1);
  }
  const CEVec<T> *xv = (const CEVec<T> *)(xr + sp.head);
  int64_t k = threadIdx.x;
  for (; k + (CE_UNROLL - 1) * CE_BT < sp.nvec; k += CE_UNROLL * CE_BT) {
    CEVec<T> r[CE_UNROLL];
#pragma unroll
    for (int u = 0; u < CE_UNROLL; u++) r[u] = xv[k + u * CE_BT];
    if (stage)
#pragma unroll
      for (int u = 0; u < CE_UNROLL; u++) stage[k + u * CE_BT] = r[u];
    A v[CE_UNROLL * W];
#pragma unroll
    for (int u = 0; u < CE_UNROLL; u++)
#pragma unroll
      for (int i = 0; i < W; i++) v[u * W + i] = kc_ld<T>(r[u].v[i]);
    fold(v, CE_UNROLL * W);
  }
  for (; k < sp.nvec; k += CE_BT) {
    CEVec<T> r = xv[k];
    if (stage) stage[k] = r;
    A v[W];
#pragma unroll
    for (int i = 0; i < W; i++) v[i] = kc_ld<T>(r.v[i]);
    fold(v, W);
  }
}

/* Pass 2: dr[j] = gs * (exp(x[j] - l) - q[j]), q the smoothed one-hot of target t; zeros
** for a row that is not kept (zero: no read). TD, the gradient's dtype, is T or f32. */
template <class T, class TD, class A>
__device__ __forceinline__ void ce_big_pass2(const T *xr, TD *dr, int64_t C, int64_t sxc, int64_t sdc,
                                             bool vec, bool dvec, bool zero, int64_t t, A l, A gs,
                                             A eps, const CEVec<T> *stage) {
  const int W = CEVec<T>::W;
  A ls = zero ? (A)0 : l, lsl = ce_log2e(ls), off = eps / (A)C, on = (A)1 - eps;
  auto grad = [&](A v, int64_t j) -> TD {
    if (zero) return kc_st<TD>((A)0);
    A q = (j == t ? on : (A)0) + off;
    return kc_st<TD>(gs * (ce_exp(v, ls, lsl) - q));
  };
  if (!vec) {
    for (int64_t j = threadIdx.x; j < C; j += CE_BT)
      dr[j * sdc] = grad(zero ? (A)0 : kc_ld<T>(xr[j * sxc]), j);
    return;
  }
  /* vec: x and dlogits both contiguous; dvec: dr + head is 16-byte aligned too and TD has
  ** T's size (ce_big_vec), else the W results are stored one by one */
  CESplit<T> sp = ce_split(xr, C);
  if (threadIdx.x < sp.head) dr[threadIdx.x] = grad(zero ? (A)0 : kc_ld<T>(xr[threadIdx.x]), threadIdx.x);
  if (threadIdx.x < C - sp.tail0) {
    int64_t j = sp.tail0 + threadIdx.x;
    dr[j] = grad(zero ? (A)0 : kc_ld<T>(xr[j]), j);
  }
  const CEVec<T> *xv = (const CEVec<T> *)(xr + sp.head);
  TD *db = dr + sp.head;
  auto put = [&](const CEVec<T> &r, int64_t k) {
    int64_t j0 = sp.head + k * W;
    TD o[W];
#pragma unroll
    for (int i = 0; i < W; i++) o[i] = grad(zero ? (A)0 : kc_ld<T>(r.v[i]), j0 + i);
    if constexpr (sizeof(TD) == sizeof(T)) {
      if (dvec) {
        CEVec<TD> ov;
#pragma unroll
        for (int i = 0; i < W; i++) ov.v[i] = o[i];
        ((CEVec<TD> *)db)[k] = ov;
        return;
      }
    }
#pragma unroll
    for (int i = 0; i < W; i++) db[k * W + i] = o[i];
  };
  int64_t k = threadIdx.x;
  if (zero) {
    CEVec<T> r = {};
    for (; k < sp.nvec; k += CE_BT) put(r, k);
    return;
  }
  for (; k + (CE_UNROLL - 1) * CE_BT < sp.nvec; k += CE_UNROLL * CE_BT) {
    CEVec<T> r[CE_UNROLL];
#pragma unroll
    for (int u = 0; u < CE_UNROLL; u++) r[u] = stage ? stage[k + u * CE_BT] : xv[k + u * CE_BT];
#pragma unroll
    for (int u = 0; u < CE_UNROLL; u++) put(r[u], k + u * CE_BT);
  }
  for (; k < sp.nvec; k += CE_BT) put(stage ? stage[k] : xv[k], k);
}

/* Forward, a block per row: out0 loss (stride sl; for the mean, a scratch row of losses),
** lse, w (per-row weight, may be NULL), dl (may be NULL) scaled by 1 / cnt[n * sdiv] when
** cnt is given (the mean: ce_count wrote the count of kept rows there first, sdiv 0; a
** mean over several calls: their count, CROSS_ENTROPY's in2). */
template <class T, class TL, class TI, class TD>
__global__ void __launch_bounds__(CE_BT)
    ce_big_forward(const T *x, const TI *tgt, TL *loss, TL *lse, TL *w, TD *dl, const TL *cnt, bool vec,
                   bool dvec, bool staged, CEArgs p) {
  typedef typename kc_traits<T>::acc A;
  extern __shared__ __align__(16) unsigned char ce_dyn[];
  CEVec<T> *stage = staged ? reinterpret_cast<CEVec<T> *>(ce_dyn) : NULL;
  const int64_t n = blockIdx.x;
  const T *xr = x + n * p.sxn;
  int64_t t = (int64_t)tgt[n * p.st];
  bool kept = t != p.ignore, bad = kept && (t < 0 || t >= p.C);
  A out = 0, l = 0;
  if (kept && !bad) {
    A m, s, sum;
    ce_big_pass1<T, A>(xr, p.C, p.sxc, vec, m, s, sum, stage);
    group_ms<A, CE_BT>(m, s);
    sum = group_sum<A, CE_BT>(sum);
    l = sum != sum ? (A)NAN : m + kc_log(s); /* a NaN logit (or +inf with -inf): NaN, as the CPU */
    A xt = kc_ld<T>(xr[t * p.sxc]), e = (A)p.eps;
    /* no smoothing: no sum term (0 * a -inf logit's sum would be NaN), as the CPU */
    out = l - ((A)1 - e) * xt - (p.eps != 0 ? e / (A)p.C * sum : (A)0);
  } else if (bad) {
    if (threadIdx.x == 0) kc_flag(p.flag, p.kop);
    out = (A)NAN;
  }
  if (dl) {
    A gs = cnt ? (A)1 / (A)kc_ld<TL>(cnt[n * p.sdiv]) : (A)1;
    ce_big_pass2<T, TD, A>(xr, dl + n * p.sdn, p.C, p.sxc, p.sdc, vec, dvec, !kept || bad, t, l, gs,
                           (A)p.eps, stage);
  }
  if (threadIdx.x != 0) return;
  loss[n * p.sl] = kc_st<TL>(out);
  lse[n * p.sz] = kc_st<TL>(l);
  if (w) w[n * p.sw] = kc_st<TL>(kept ? 1 : 0);
}

/* The mean of the scratch row losses and the count of kept rows, in a fixed order (one
** block of KC_THREADS): the result does not depend on scheduling. */
template <class TL, class TI>
__global__ void __launch_bounds__(KC_THREADS)
    ce_big_mean_finish(const TL *rows, const TI *tgt, CEArgs p, TL *mean, TL *cnt) {
  TL s = 0;
  for (int64_t n = threadIdx.x; n < p.N; n += KC_THREADS) s += rows[n];
  s = group_sum<TL, KC_THREADS>(s);
  int k = ce_kept<TI>(tgt, p);
  if (threadIdx.x != 0) return;
  *mean = s / (TL)k; /* nothing kept: 0 / 0 = NaN, as PyTorch */
  *cnt = (TL)k;
}

/* CROSS_ENTROPY_BACKWARD, a block per row: out = grad / div * (softmax - q). */
template <class T, class TL, class TI>
__global__ void __launch_bounds__(CE_BT)
    ce_big_backward(const T *x, const TI *tgt, const TL *lse, const TL *grad, const TL *div, T *out, bool vec,
                    bool dvec, CEArgs p) {
  typedef typename kc_traits<T>::acc A;
  const int64_t n = blockIdx.x;
  int64_t t = (int64_t)tgt[n * p.st];
  bool zero = t == p.ignore || t < 0 || t >= p.C;
  if (t != p.ignore && zero && threadIdx.x == 0) kc_flag(p.flag, p.kop);
  A gv = 0, l = 0;
  if (!zero) {
    gv = (A)kc_ld<TL>(grad[n * p.sg]);
    if (div) gv = gv / (A)kc_ld<TL>(div[n * p.sdiv]);
    l = (A)kc_ld<TL>(lse[n * p.sz]);
  }
  ce_big_pass2<T, T, A>(x + n * p.sxn, out + n * p.son, p.C, p.sxc, p.soc, vec, dvec, zero, t, l, gv,
                        (A)p.eps, (const CEVec<T> *)NULL);
}

/* Whether rows of x (and of the gradient d, NULL for none) take 16-byte loads (*vec: both
** contiguous along C; rows at any offset, each finds its own head) and d 16-byte stores
** (*dvec: every row of d at the same offset within 16 bytes as its row of x, so both split
** alike). */
template <class T, class TD>
void ce_big_vec(const T *x, int64_t sxn, int64_t sxc, const TD *d, int64_t sdn, int64_t sdc, int64_t C,
                bool *vec, bool *dvec) {
  *vec = (C <= 1 || sxc == 1) && (!d || C <= 1 || sdc == 1);
  *dvec = *vec && d && sizeof(TD) == sizeof(T) && (uintptr_t)x % 16 == (uintptr_t)d % 16 &&
          ((sxn - sdn) * (int64_t)sizeof(T)) % 16 == 0;
}

/* The dynamic shared memory ce_big_forward stages a row of C classes in (0: it reads the
** row twice): contiguous rows whose gradient is fused, when they fit CE_STAGE_MAX. The
** kernel's limit (48 KB by default) is raised once per instantiation and device (the
** current one: the launch's). */
template <class T, class TL, class TI>
size_t ce_stage_bytes(int device, int64_t C, bool vec, bool fused) {
  const size_t bytes = ((size_t)C / CEVec<T>::W + 1) * sizeof(CEVec<T>);
  if (!vec || !fused || bytes > CE_STAGE_MAX) return 0;
  static unsigned long long raised; /* a bit a device below 64 (a race only repeats the call) */
  const bool known = device >= 0 && device < 64;
  if (known && (raised >> device & 1ull)) return bytes;
  if (cudaFuncSetAttribute(ce_big_forward<T, TL, TI, T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           CE_STAGE_MAX) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  if (known) raised |= 1ull << device;
  return bytes;
}

template <class T, class TL, class TI>
kiln_status ce_launch(kiln__cuda_dev *d, const kiln__kargs *a, CEArgs p) {
  const kiln__view *dlv = kiln__ce_dlogits(a);
  T *dl = dlv ? (T *)dlv->data : NULL;
  if (a->op == KILN__K_CROSS_ENTROPY) {
    const T *x = (const T *)a->in[0].data;
    const TI *t = (const TI *)a->in[1].data;
    TL *loss = (TL *)a->out[0].data, *lse = (TL *)a->out[1].data;
    TL *w = a->n_out - (dl ? 1 : 0) > 2 ? (TL *)a->out[2].data : NULL;
    const TL *div = dl && a->n_in > 2 ? (const TL *)a->in[2].data : NULL;
    if (p.C > CE_BIG_C) {
      bool vec, dvec;
      ce_big_vec<T, T>(x, p.sxn, p.sxc, dl, p.sdn, p.sdc, p.C, &vec, &dvec);
      size_t sm = ce_stage_bytes<T, TL, TI>(a->device, p.C, vec, dl != NULL);
      ce_big_forward<T, TL, TI, T><<<(unsigned)p.N, CE_BT, sm, d->stream>>>(x, t, loss, lse, w, dl, div, vec,
                                                                           dvec, sm > 0, p);
    } else {
      unsigned blocks = (unsigned)((p.N + KC_THREADS / 32 - 1) / (KC_THREADS / 32));
      ce_forward<T, TL, TI, 32><<<blocks, KC_THREADS, 0, d->stream>>>(x, t, loss, lse, w, dl, div, p);
    }
  } else if (a->op == KILN__K_CROSS_ENTROPY_MEAN && p.C > CE_BIG_C && p.N > 0) {
    /* the count of kept rows first (the gradient's scale), the rows into scratch losses,
    ** then their mean in a fixed order: three launches, each row read from DRAM once */
    const T *x = (const T *)a->in[0].data;
    const TI *t = (const TI *)a->in[1].data;
    TL *mean = (TL *)a->out[0].data, *lse = (TL *)a->out[1].data, *cnt = (TL *)a->out[2].data;
    size_t bytes = ((size_t)p.N + 1) * sizeof(TL);
    TL *rows = (TL *)kiln__cuda_alloc(a->device, bytes);
    if (!rows) return kiln_last_error();
    TL *kept = rows + p.N;
    if (dl) ce_count<TI, TL><<<1, KC_THREADS, 0, d->stream>>>(t, p, kept);
    CEArgs q = p;
    q.sl = 1;
    bool vec, dvec;
    ce_big_vec<T, T>(x, p.sxn, p.sxc, dl, p.sdn, p.sdc, p.C, &vec, &dvec);
    size_t sm = ce_stage_bytes<T, TL, TI>(a->device, p.C, vec, dl != NULL);
    ce_big_forward<T, TL, TI, T><<<(unsigned)p.N, CE_BT, sm, d->stream>>>(x, t, rows, lse, NULL, dl,
                                                                         dl ? kept : NULL, vec, dvec, sm > 0, q);
    ce_big_mean_finish<TL, TI><<<1, KC_THREADS, 0, d->stream>>>(rows, t, p, mean, cnt);
    kiln__cuda_free(a->device, rows, bytes); /* stream-ordered reuse */
  } else if (a->op == KILN__K_CROSS_ENTROPY_MEAN) {
    /* a thread per row up to 16 classes, else a warp; one block when the rows are few (a
    ** small model's step: one launch), else up to 4 blocks per SM and the finishing launch.
    ** A warp's rows run one after another: 2 a warp (16 made ResNet's (256, 1000) two
    ** blocks, latency bound) */
    const bool thread_rows = p.C <= 16;
    const int64_t rows_per_block = thread_rows ? KC_THREADS * 2 : (KC_THREADS / 32) * 2;
    int64_t want = (p.N + rows_per_block - 1) / rows_per_block;
    int64_t cap = (int64_t)(d->sm_count > 0 ? d->sm_count : 132) * 4;
    int blocks = (int)(want < 1 ? 1 : want > cap ? cap : want);
    TL *mean = (TL *)a->out[0].data, *cnt = (TL *)a->out[2].data, *part = NULL;
    size_t part_bytes = ((size_t)blocks * 2 + (dl ? 1 : 0)) * sizeof(TL); /* + the count */
    if (blocks > 1 && !(part = (TL *)kiln__cuda_alloc(a->device, part_bytes)))
      return kiln_last_error();
    const T *x = (const T *)a->in[0].data;
    const TI *t = (const TI *)a->in[1].data;
    TL *lse = (TL *)a->out[1].data;
    if (blocks > 1 && dl) ce_count<TI, TL><<<1, KC_THREADS, 0, d->stream>>>(t, p, part + 2 * blocks);
    if (thread_rows)
      ce_mean<T, TL, TI, 1><<<(unsigned)blocks, KC_THREADS, 0, d->stream>>>(x, t, lse, mean, cnt, part, dl, p);
    else
      ce_mean<T, TL, TI, 32><<<(unsigned)blocks, KC_THREADS, 0, d->stream>>>(x, t, lse, mean, cnt, part, dl, p);
    if (blocks > 1) {
      ce_mean_finish<TL><<<1, 32, 0, d->stream>>>(part, blocks, mean, cnt);
      kiln__cuda_free(a->device, part, part_bytes); /* stream-ordered reuse */
    }
  } else if (p.C > CE_BIG_C) {
    const T *x = (const T *)a->in[0].data;
    T *o = (T *)a->out[0].data;
    bool vec, dvec;
    ce_big_vec<T, T>(x, p.sxn, p.sxc, o, p.son, p.soc, p.C, &vec, &dvec);
    ce_big_backward<T, TL, TI><<<(unsigned)p.N, CE_BT, 0, d->stream>>>(
        x, (const TI *)a->in[1].data, (const TL *)a->in[2].data, (const TL *)a->in[3].data,
        a->n_in > 4 ? (const TL *)a->in[4].data : NULL, o, vec, dvec, p);
  } else {
    int blocks = kc_blocks(p.N * p.C, KC_THREADS, d->sm_count);
    ce_backward<T, TL, TI><<<blocks, KC_THREADS, 0, d->stream>>>(
        (const T *)a->in[0].data, (const TI *)a->in[1].data, (const TL *)a->in[2].data,
        (const TL *)a->in[3].data, a->n_in > 4 ? (const TL *)a->in[4].data : NULL,
        (T *)a->out[0].data, p);
  }
  return kiln__cuda_launched(kiln__kop_name(a->op));
}

template <class T>
kiln_status ce_dispatch(kiln__cuda_dev *d, const kiln__kargs *a, const CEArgs &p,
                        kiln_dtype lt, kiln_dtype it) {
  bool i64 = it == KILN_I64;
  typedef typename std::conditional<std::is_same<T, double>::value, double, float>::type TL;
  if (lt == (std::is_same<TL, double>::value ? KILN_F64 : KILN_F32))
    return i64 ? ce_launch<T, TL, int64_t>(d, a, p) : ce_launch<T, TL, int32_t>(d, a, p);
  return kiln_set_error(KILN_ERR_DTYPE, "kiln_cross_entropy: loss dtype %s not supported on cuda",
                        kiln_dtype_name(lt));
}

kiln_status bad(const kiln__kargs *a) {
  return kiln_set_error(KILN_ERR_DTYPE, "kiln_%s: dtype %s not supported on cuda",
                        kiln__kop_name(a->op), kiln_dtype_name(a->in[0].dtype));
}

bool is_ce(kiln__kop op) {
  return op == KILN__K_CROSS_ENTROPY || op == KILN__K_CROSS_ENTROPY_BACKWARD ||
         op == KILN__K_CROSS_ENTROPY_MEAN;
}
bool ce_fwd(kiln__kop op) { return op == KILN__K_CROSS_ENTROPY || op == KILN__K_CROSS_ENTROPY_MEAN; }

} // namespace

extern "C" bool kiln__cuda_cross_entropy_supports(const kiln__kargs *a) {
  kiln_dtype dt = a->in[0].dtype;
  if (!kc_is_float(dt)) return false;
  if (a->in[0].ndim != 2 || !kc_is_index(a->in[1].dtype)) return false;
  kiln_dtype lt = ce_fwd(a->op) ? a->out[0].dtype : a->in[2].dtype;
  /* the loss in f32, f64 for f64 logits (as ops_loss.c asks): other pairs are not built,
  ** which keeps this module small (see the top) */
  if (lt != (dt == KILN_F64 ? KILN_F64 : KILN_F32)) return false;
  /* the fused dlogits (flag 1): the logits' dtype and shape, after the usual outputs */
  const kiln__view *dl = kiln__ce_dlogits(a);
  int nout = a->n_out - (dl ? 1 : 0);
  if (dl && (dl->dtype != dt || dl->ndim != 2 || dl->shape[0] != a->in[0].shape[0] ||
             dl->shape[1] != a->in[0].shape[1]))
    return false;
  if (a->op == KILN__K_CROSS_ENTROPY_MEAN)
    return nout == 3 && a->out[1].dtype == lt && a->out[2].dtype == lt &&
           kc_numel(&a->out[0]) == 1 && kc_numel(&a->out[2]) == 1;
  if (a->op == KILN__K_CROSS_ENTROPY)
    return nout >= 2 && a->out[1].dtype == lt && (nout < 3 || a->out[2].dtype == lt) &&
           (a->n_in == 2 || (a->n_in == 3 && dl && a->in[2].dtype == lt && a->in[2].ndim == 1 &&
                             a->in[2].shape[0] == a->in[0].shape[0]));
  return a->n_in >= 4 && a->in[3].dtype == lt && (a->n_in < 5 || a->in[4].dtype == lt) &&
         a->out[0].dtype == dt;
}

extern "C" kiln_status kiln__cuda_cross_entropy(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  if (!is_ce(a->op) || !kiln__cuda_cross_entropy_supports(a)) return bad(a);
  kiln_dtype dt = a->in[0].dtype;
  const kiln__view *x = &a->in[0];
  CEArgs p;
  p.N = x->shape[0];
  p.C = x->shape[1];
  p.sxn = x->strides[0];
  p.sxc = x->strides[1];
  p.st = a->in[1].strides[0];
  p.ignore = a->i[0];
  p.eps = a->s[0];
  p.flag = d->err_flag;
  p.kop = (int)a->op;
  p.sdiv = 0;
  const kiln__view *dl = kiln__ce_dlogits(a);
  p.sdn = dl ? dl->strides[0] : 0;
  p.sdc = dl ? dl->strides[1] : 0;
  if (a->op == KILN__K_CROSS_ENTROPY_MEAN) {
    p.sl = p.sw = p.sg = p.son = p.soc = 0;
    p.sz = a->out[1].strides[0];
  } else if (a->op == KILN__K_CROSS_ENTROPY) {
    p.sl = a->out[0].strides[0];
    p.sz = a->out[1].strides[0];
    p.sw = a->n_out - (dl ? 1 : 0) > 2 ? a->out[2].strides[0] : 0;
    p.sg = p.son = p.soc = 0;
    p.sdiv = a->n_in > 2 ? a->in[2].strides[0] : 0;
  } else {
    p.sl = p.sw = 0;
    p.sz = a->in[2].strides[0];
    p.sg = a->in[3].strides[0];
    p.sdiv = a->n_in > 4 ? a->in[4].strides[0] : 0;
    p.son = a->out[0].strides[0];
    p.soc = a->out[0].strides[1];
  }
  /* the mean of no rows is still written (NaN), so only the other two stop here */
  if (p.N == 0 && a->op != KILN__K_CROSS_ENTROPY_MEAN) return KILN_OK;
  if (p.C == 0 && p.N > 0) {
    if (ce_fwd(a->op)) return kiln_set_error(KILN_ERR_SHAPE, "kiln_cross_entropy: no classes (C = 0)");
    return KILN_OK;
  }
  if (p.N > INT32_MAX)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_cross_entropy: %lld rows is too many",
                          (long long)p.N);
  kiln_dtype lt = ce_fwd(a->op) ? a->out[0].dtype : a->in[2].dtype;
  KC_SWITCH_FLOAT(dt, T, return bad(a), return ce_dispatch<T>(d, a, p, lt, a->in[1].dtype))
  return KILN_OK;
}
