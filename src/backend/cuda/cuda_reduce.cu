/*
** Reductions: SUM, PROD, AMAX, AMIN over a set of dims, and MAX_DIM / MIN_DIM (value and
** first index) along one dim. Accumulation is in f32 for f32/f16/bf16, f64 for f64 and
** int64 for the integer dtypes (backend.h).
**
** The input's dims are split into kept dims (one output element per combination) and
** reduced dims, each group coalesced. Then one of:
** - rows: the reduced elements of an output are contiguous (the common "sum over the last
**   dim"): a warp, or a whole block when rows are long, per output, coalesced loads;
** - columns: consecutive outputs are contiguous in the input (sum over a leading dim): one
**   thread per output walking the reduced dim, so a warp's loads are coalesced;
** - otherwise rows with strided offsets.
** When there are too few outputs to fill the device, the reduced range is split across
** blockIdx.y into partials (in the accumulation type) and a second kernel combines them.
*/
#include "cuda_int.cuh"

#include <math.h>
#include <type_traits>

namespace {

struct RGeom {
  int nk, nr;
  int64_t ksize[KILN_MAX_DIMS], kin[KILN_MAX_DIMS], kout[2][KILN_MAX_DIMS];
  int64_t rsize[KILN_MAX_DIMS], rin[KILN_MAX_DIMS];
};

__device__ __forceinline__ void kept_offsets(const RGeom &g, int64_t o, int64_t *in_off,
                                             int64_t *out0, int64_t *out1) {
  int64_t a = 0, b = 0, c = 0;
  for (int d = g.nk - 1; d >= 0; d--) {
    int64_t i = o % g.ksize[d];
    o /= g.ksize[d];
    a += i * g.kin[d];
    b += i * g.kout[0][d];
    c += i * g.kout[1][d];
  }
  *in_off = a;
  *out0 = b;
  *out1 = c;
}
__device__ __forceinline__ int64_t red_offset(const RGeom &g, int64_t r) {
  if (g.nr == 1) return r * g.rin[0];
  int64_t a = 0;
  for (int d = g.nr - 1; d >= 0; d--) {
    a += (r % g.rsize[d]) * g.rin[d];
    r /= g.rsize[d];
  }
  return a;
}

/* Walks the reduced range from r in steps of G, the input offset of each element made
** without a division per element: one or two reduced groups (a row; a "sum over N and the
** spatial dims" as a bias gradient takes) carry an index pair, more groups fall back to
** red_offset. 64-bit division costs dozens of instructions, more than the load itself. */
struct RIter {
  int64_t i0, i1, s1, in0, in1, q, rem, r;
  const RGeom *g;
  __device__ __forceinline__ RIter(const RGeom &geom, int64_t start, int64_t G) : g(&geom) {
    r = start;
    if (geom.nr == 2) {
      s1 = geom.rsize[1], in0 = geom.rin[0], in1 = geom.rin[1];
      i0 = start / s1, i1 = start - i0 * s1;
      q = G / s1, rem = G - q * s1;
    } else {
      s1 = in1 = i1 = rem = 0;
      in0 = geom.rin[0], i0 = start, q = G;
    }
  }
  __device__ __forceinline__ int64_t offset() const {
    if (g->nr <= 2) return i0 * in0 + i1 * in1;
    return red_offset(*g, r);
  }
  __device__ __forceinline__ void next(int64_t G) {
    r += G;
    i0 += q, i1 += rem;
    if (i1 >= s1 && g->nr == 2) i1 -= s1, i0++;
  }
};

/* ---- the four value reductions ---- */
template <class A> struct R_sum {
  __device__ __forceinline__ A init() const { return (A)0; }
  __device__ __forceinline__ A operator()(A a, A b) const { return a + b; }
};
template <class A> struct R_prod {
  __device__ __forceinline__ A init() const { return (A)1; }
  __device__ __forceinline__ A operator()(A a, A b) const { return a * b; }
};
template <class A> struct R_max {
  __device__ __forceinline__ A init() const {
    if constexpr (std::is_same<A, int64_t>::value) return (A)INT64_MIN;
    else return -(A)INFINITY;
  }
  __device__ __forceinline__ A operator()(A a, A b) const {
    return a != a ? a : (b != b ? b : (a > b ? a : b));
  }
};
template <class A> struct R_min {
  __device__ __forceinline__ A init() const {
    if constexpr (std::is_same<A, int64_t>::value) return (A)INT64_MAX;
    else return (A)INFINITY;
  }
  __device__ __forceinline__ A operator()(A a, A b) const {
    return a != a ? a : (b != b ? b : (a < b ? a : b));
  }
};

template <class A, class Op, int G> __device__ __forceinline__ A group_reduce(A v, Op op) {
  v = kc_warp_reduce(v, op);
  if constexpr (G > 32) {
    __shared__ A part[G / 32];
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    if (l == 0) part[w] = v;
    __syncthreads();
    v = op.init();
    if (w == 0) {
      if (l < G / 32) v = part[l];
      v = kc_warp_reduce(v, op);
    }
  }
  return v;
}

/* G threads per output row; blockIdx.y picks a chunk of the reduced range. */
template <class T, class TO, class Op, int G>
__global__ void __launch_bounds__(KC_THREADS)
    reduce_rows(const T *in, TO *out, typename kc_traits<T>::acc *partial, RGeom g, int64_t O,
                int64_t R, int64_t chunk, Op op) {
  typedef typename kc_traits<T>::acc A;
  const int per = KC_THREADS / G;
  int64_t row = (int64_t)blockIdx.x * per + threadIdx.x / G;
  int lane = threadIdx.x % G;
  if (row >= O) return; /* uniform across a group (G == 256: the whole block) */
  int64_t base, o0, o1;
  kept_offsets(g, row, &base, &o0, &o1);
  int64_t r0 = (int64_t)blockIdx.y * chunk, r1 = r0 + chunk < R ? r0 + chunk : R;
  A acc = op.init();
  for (RIter it(g, r0 + lane, G); it.r < r1; it.next(G)) acc = op(acc, kc_ld<T>(in[base + it.offset()]));
  if constexpr (G <= 32) {
    acc = kc_warp_reduce(acc, op);
  } else {
    acc = group_reduce<A, Op, G>(acc, op);
  }
  if (lane == 0) {
    if (gridDim.y == 1) out[o0] = kc_st<TO>(acc);
    else partial[(int64_t)blockIdx.y * O + row] = acc;
  }
}

/* One thread per output; consecutive threads are consecutive in the input. */
template <class T, class TO, class Op>
__global__ void __launch_bounds__(KC_THREADS)
    reduce_cols(const T *in, TO *out, typename kc_traits<T>::acc *partial, RGeom g, int64_t O,
                int64_t R, int64_t chunk, Op op) {
  typedef typename kc_traits<T>::acc A;
  int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= O) return;
  int64_t base, o0, o1;
  kept_offsets(g, o, &base, &o0, &o1);
  int64_t r0 = (int64_t)blockIdx.y * chunk, r1 = r0 + chunk < R ? r0 + chunk : R;
  A acc = op.init();
  for (RIter it(g, r0, 1); it.r < r1; it.next(1)) acc = op(acc, kc_ld<T>(in[base + it.offset()]));
  if (gridDim.y == 1) out[o0] = kc_st<TO>(acc);
  else partial[(int64_t)blockIdx.y * O + o] = acc;
}

template <class A, class TO, class Op>
__global__ void reduce_finish(const A *partial, TO *out, RGeom g, int64_t O, int splits, Op op) {
  int64_t o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (o >= O) return;
  A acc = op.init();
  for (int s = 0; s < splits; s++) acc = op(acc, partial[(int64_t)s * O + o]);
  int64_t base, o0, o1;
  kept_offsets(g, o, &base, &o0, &o1);
  out[o0] = kc_st<TO>(acc);
}

/* ---- geometry ---- */
struct Plan {
  RGeom g;
  int64_t O, R;
};

/* Groups in0's dims into kept and reduced (mask bit d set = reduced) and coalesces each.
** out views give the kept dims' output strides; outdim[d] is the out dim of in dim d. */
void plan(Plan *p, const kiln__view *in, const kiln__view *o0, const kiln__view *o1,
          unsigned mask, const int *outdim) {
  RGeom &g = p->g;
  g.nk = g.nr = 0;
  p->O = p->R = 1;
  for (int d = 0; d < in->ndim; d++) {
    int64_t n = in->shape[d];
    if ((mask >> d) & 1u) {
      p->R *= n;
      if (n == 1) continue;
      if (g.nr > 0 && g.rin[g.nr - 1] == in->strides[d] * n) {
        g.rsize[g.nr - 1] *= n;
        g.rin[g.nr - 1] = in->strides[d];
      } else {
        g.rsize[g.nr] = n;
        g.rin[g.nr] = in->strides[d];
        g.nr++;
      }
    } else {
      p->O *= n;
      if (n == 1) continue;
      int od = outdim[d];
      int64_t s0 = o0->strides[od], s1 = o1 ? o1->strides[od] : 0;
      int k = g.nk - 1;
      if (k >= 0 && g.kin[k] == in->strides[d] * n && g.kout[0][k] == s0 * n &&
          g.kout[1][k] == s1 * n) {
        g.ksize[k] *= n;
        g.kin[k] = in->strides[d];
        g.kout[0][k] = s0;
        g.kout[1][k] = s1;
      } else {
        g.ksize[g.nk] = n;
        g.kin[g.nk] = in->strides[d];
        g.kout[0][g.nk] = s0;
        g.kout[1][g.nk] = s1;
        g.nk++;
      }
    }
  }
  if (g.nr == 0) {
    g.nr = 1;
    g.rsize[0] = 1;
    g.rin[0] = 1;
  }
}

template <class T, class TO, template <class> class OpT>
kiln_status reduce_launch(kiln__cuda_dev *d, int device, const Plan &p, const T *in, TO *out,
                          const char *what) {
  typedef typename kc_traits<T>::acc A;
  OpT<A> op;
  const int64_t O = p.O, R = p.R;
  const int sms = d->sm_count > 0 ? d->sm_count : 132;
  bool rows = p.g.nr == 1 && p.g.rin[0] == 1;
  bool cols = !rows && p.g.nk >= 1 && p.g.kin[p.g.nk - 1] == 1;
  int64_t blocks;
  int G = 32;
  if (cols) {
    blocks = (O + KC_THREADS - 1) / KC_THREADS;
  } else {
    G = (rows && R >= 2048) ? KC_THREADS : 32;
    blocks = (O + (KC_THREADS / G) - 1) / (KC_THREADS / G);
  }
  int splits = 1;
  const int64_t min_chunk = cols ? 64 : 4096;
  if (blocks < 2 * sms && R > min_chunk) {
    int64_t want = (4 * sms + blocks - 1) / blocks;
    int64_t most = (R + min_chunk - 1) / min_chunk;
    splits = (int)(want < most ? want : most);
    if (splits > 65535) splits = 65535;
    if (splits < 1) splits = 1;
  }
  int64_t chunk = (R + splits - 1) / splits;
  A *partial = NULL;
  if (splits > 1) {
    partial = (A *)kiln__cuda_alloc(device, (size_t)splits * (size_t)O * sizeof(A));
    if (!partial) return kiln_last_error();
  }
  if (blocks > INT32_MAX) blocks = INT32_MAX; /* O beyond 2^31 * 8 rows is not reachable */
  dim3 grid((unsigned)blocks, (unsigned)splits);
  if (cols) reduce_cols<T, TO, OpT<A>><<<grid, KC_THREADS, 0, d->stream>>>(in, out, partial, p.g, O, R, chunk, op);
  else if (G == 32) reduce_rows<T, TO, OpT<A>, 32><<<grid, KC_THREADS, 0, d->stream>>>(in, out, partial, p.g, O, R, chunk, op);
  else reduce_rows<T, TO, OpT<A>, KC_THREADS><<<grid, KC_THREADS, 0, d->stream>>>(in, out, partial, p.g, O, R, chunk, op);
  kiln_status st = kiln__cuda_launched(what);
  if (st == KILN_OK && splits > 1) {
    int fb = (int)((O + KC_THREADS - 1) / KC_THREADS);
    reduce_finish<A, TO, OpT<A>><<<fb, KC_THREADS, 0, d->stream>>>(partial, out, p.g, O, splits, op);
    st = kiln__cuda_launched(what);
  }
  if (partial) kiln__cuda_free(device, partial, 0);
  return st;
}

template <class T, class TO>
kiln_status reduce_op(kiln__cuda_dev *d, const kiln__kargs *a, const Plan &p) {
  const T *in = (const T *)a->in[0].data;
  TO *out = (TO *)a->out[0].data;
  const char *w = kiln__kop_name(a->op);
  switch (a->op) {
  case KILN__K_SUM: return reduce_launch<T, TO, R_sum>(d, a->device, p, in, out, w);
  case KILN__K_PROD: return reduce_launch<T, TO, R_prod>(d, a->device, p, in, out, w);
  case KILN__K_AMAX: return reduce_launch<T, TO, R_max>(d, a->device, p, in, out, w);
  case KILN__K_AMIN: return reduce_launch<T, TO, R_min>(d, a->device, p, in, out, w);
  default: return kiln_set_error(KILN_ERR_INTERNAL, "kiln: cuda reduce: bad op");
  }
}

/* ---- MAX_DIM / MIN_DIM ---- */
template <class A, bool MAX>
__device__ __forceinline__ void arg_combine(A &v, int64_t &i, A v2, int64_t i2) {
  if (i2 < 0) return;
  if (i < 0) {
    v = v2;
    i = i2;
    return;
  }
  bool n1 = v != v, n2 = v2 != v2;
  bool take;
  if (n1 || n2) take = n2 && (!n1 || i2 < i);
  else if (MAX) take = v2 > v || (v2 == v && i2 < i);
  else take = v2 < v || (v2 == v && i2 < i);
  if (take) {
    v = v2;
    i = i2;
  }
}

template <class T, bool MAX, bool ROWS>
__global__ void __launch_bounds__(KC_THREADS)
    argreduce(const T *in, T *vals, int64_t *idx, RGeom g, int64_t O, int64_t R) {
  typedef typename kc_traits<T>::acc A;
  int64_t o;
  int lane;
  if (ROWS) {
    o = (int64_t)blockIdx.x * (KC_THREADS / 32) + threadIdx.x / 32;
    lane = threadIdx.x % 32;
  } else {
    o = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    lane = 0;
  }
  if (o >= O) return;
  int64_t base, o0, o1;
  kept_offsets(g, o, &base, &o0, &o1);
  A v = A();
  int64_t i = -1;
  const int step = ROWS ? 32 : 1;
  for (int64_t r = lane; r < R; r += step) arg_combine<A, MAX>(v, i, kc_ld<T>(in[base + r * g.rin[0]]), r);
  if (ROWS) {
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
      A v2 = __shfl_xor_sync(0xffffffffu, v, s);
      int64_t i2 = __shfl_xor_sync(0xffffffffu, i, s);
      arg_combine<A, MAX>(v, i, v2, i2);
    }
  }
  if (lane == 0) {
    vals[o0] = kc_st<T>(v);
    idx[o1] = i;
  }
}

template <class T>
kiln_status argreduce_op(kiln__cuda_dev *d, const kiln__kargs *a, const Plan &p) {
  bool rows = p.g.rin[0] == 1 || p.g.nk == 0 || p.g.kin[p.g.nk - 1] != 1;
  bool mx = a->op == KILN__K_MAX_DIM;
  const T *in = (const T *)a->in[0].data;
  T *vals = (T *)a->out[0].data;
  int64_t *idx = (int64_t *)a->out[1].data;
  int64_t blocks = rows ? (p.O + 7) / 8 : (p.O + KC_THREADS - 1) / KC_THREADS;
  if (blocks > INT32_MAX) blocks = INT32_MAX;
  unsigned b = (unsigned)blocks;
  if (rows && mx) argreduce<T, true, true><<<b, KC_THREADS, 0, d->stream>>>(in, vals, idx, p.g, p.O, p.R);
  else if (rows) argreduce<T, false, true><<<b, KC_THREADS, 0, d->stream>>>(in, vals, idx, p.g, p.O, p.R);
  else if (mx) argreduce<T, true, false><<<b, KC_THREADS, 0, d->stream>>>(in, vals, idx, p.g, p.O, p.R);
  else argreduce<T, false, false><<<b, KC_THREADS, 0, d->stream>>>(in, vals, idx, p.g, p.O, p.R);
  return kiln__cuda_launched(kiln__kop_name(a->op));
}

kiln_status bad(const kiln__kargs *a, const char *what) {
  return kiln_set_error(KILN_ERR_DTYPE, "kiln_%s: %s not supported on cuda (in %s, out %s)",
                        kiln__kop_name(a->op), what, kiln_dtype_name(a->in[0].dtype),
                        kiln_dtype_name(a->out[0].dtype));
}

/* The out dtypes the value reductions store directly. */
bool out_ok(kiln_dtype in, kiln_dtype out) {
  if (in == out) return true;
  if (out == KILN_I64 && !kc_is_float(in)) return true;
  if (out == KILN_F32 && (in == KILN_F16 || in == KILN_BF16)) return true;
  return false;
}

} // namespace

extern "C" bool kiln__cuda_reduce_supports(const kiln__kargs *a) {
  kiln_dtype in = a->in[0].dtype, out = a->out[0].dtype;
  if (kc_size(in) == 0 || kc_size(out) == 0) return false;
  if (a->op == KILN__K_MAX_DIM || a->op == KILN__K_MIN_DIM)
    return in == out && a->n_out >= 2 && a->out[1].dtype == KILN_I64;
  return out_ok(in, out);
}

extern "C" kiln_status kiln__cuda_reduce(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  if (!kiln__cuda_reduce_supports(a)) return bad(a, "dtypes");
  const kiln__view *in = &a->in[0];
  const kiln__view *out = &a->out[0];
  int outdim[KILN_MAX_DIMS];
  unsigned mask = 0;
  Plan p;
  if (a->op == KILN__K_MAX_DIM || a->op == KILN__K_MIN_DIM) {
    int dim = (int)a->i[1];
    if (dim < 0) dim += in->ndim;
    if (dim < 0 || dim >= in->ndim)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_%s: dim %lld out of range for %d dims",
                            kiln__kop_name(a->op), (long long)a->i[1], in->ndim);
    bool keep = out->ndim == in->ndim;
    for (int k = 0; k < in->ndim; k++) outdim[k] = keep ? k : (k < dim ? k : k - 1);
    outdim[dim] = 0;
    mask = 1u << dim;
    plan(&p, in, out, &a->out[1], mask, outdim);
    /* the reduced group is the one dim, uncoalesced */
    p.g.nr = 1;
    p.g.rsize[0] = in->shape[dim];
    p.g.rin[0] = in->strides[dim];
    if (p.O == 0) return KILN_OK;
    if (p.R == 0)
      return kiln_set_error(KILN_ERR_SHAPE, "kiln_%s: cannot reduce an empty dim %d",
                            kiln__kop_name(a->op), dim);
    KC_SWITCH_ALL(in->dtype, T, return bad(a, "dtype"), return argreduce_op<T>(d, a, p))
    return KILN_OK;
  }
  if (out->ndim != in->ndim)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_%s: out has %d dims, in %d",
                          kiln__kop_name(a->op), out->ndim, in->ndim);
  for (int k = 0; k < in->ndim; k++) {
    outdim[k] = k;
    bool red = (out->shape[k] == 1 && in->shape[k] != 1) || ((a->i[0] >> k) & 1);
    if (red) mask |= 1u << k;
    else if (out->shape[k] != in->shape[k])
      return kiln_set_error(KILN_ERR_SHAPE, "kiln_%s: out dim %d is %lld, in %lld",
                            kiln__kop_name(a->op), k, (long long)out->shape[k],
                            (long long)in->shape[k]);
  }
  plan(&p, in, out, NULL, mask, outdim);
  if (p.O == 0) return KILN_OK;
  if (p.R == 0) {
    if (a->op == KILN__K_AMAX || a->op == KILN__K_AMIN)
      return kiln_set_error(KILN_ERR_SHAPE, "kiln_%s: cannot reduce an empty tensor",
                            kiln__kop_name(a->op));
    return kiln__cuda_fill_view(a->device, out, a->op == KILN__K_PROD ? 1.0 : 0.0);
  }
  /* Only size-1 dims reduced: the same elements, maybe another dtype. */
  if (p.R == 1) return kiln__cuda_copy_view(a->device, out, in);
  kiln_dtype it = in->dtype, ot = out->dtype;
  if (it == ot) {
    KC_SWITCH_ALL(it, T, return bad(a, "dtype"), return reduce_op<T, T>(d, a, p))
  } else if (ot == KILN_I64) {
    switch (it) {
    case KILN_I32: return reduce_op<int32_t, int64_t>(d, a, p);
    case KILN_U8: return reduce_op<uint8_t, int64_t>(d, a, p);
    case KILN_BOOL: return reduce_op<bool, int64_t>(d, a, p);
    default: return bad(a, "dtypes");
    }
  } else if (it == KILN_F16) {
    return reduce_op<__half, float>(d, a, p);
  } else if (it == KILN_BF16) {
    return reduce_op<__nv_bfloat16, float>(d, a, p);
  }
  return bad(a, "dtypes");
}
