/*
** The elementwise machinery (C++ templates), shared by cuda_elementwise.cu and
** cuda_binary.cu: a functor applied to up to three inputs (or to the linear index, for
** fills) over views of one shape.
**
** Paths, fastest first:
** - vectorised: after coalescing the views are one dim, the output and every input
**   contiguous or a broadcast scalar (stride 0), and the pointers aligned: each thread
**   moves 16 bytes per load/store in a grid-stride loop (this is what reaches the copy
**   bandwidth). Also for two dims (outer, inner) where an input repeats along the outer
**   one (strides (0, 1): a bias, attention's (T, T) causal mask under (B, H, T, T)): it is
**   read at the element index modulo inner (inner a multiple of the vector width);
** - strided with 32-bit index arithmetic when every offset fits, else 64-bit. Shapes and
**   strides travel by value in the kernel's parameters.
*/
#ifndef KILN_CUDA_EW_CUH
#define KILN_CUDA_EW_CUH

#include "cuda_int.cuh"

/* Math on float or double, one spelling for the functors. */
__device__ __forceinline__ float kc_exp(float x) { return expf(x); }
__device__ __forceinline__ double kc_exp(double x) { return exp(x); }
__device__ __forceinline__ float kc_log(float x) { return logf(x); }
__device__ __forceinline__ double kc_log(double x) { return log(x); }
__device__ __forceinline__ float kc_log1p(float x) { return log1pf(x); }
__device__ __forceinline__ double kc_log1p(double x) { return log1p(x); }
__device__ __forceinline__ float kc_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double kc_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float kc_rsqrt(float x) { return rsqrtf(x); }
__device__ __forceinline__ double kc_rsqrt(double x) { return rsqrt(x); }
__device__ __forceinline__ float kc_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double kc_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float kc_erf(float x) { return erff(x); }
__device__ __forceinline__ double kc_erf(double x) { return erf(x); }
__device__ __forceinline__ float kc_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double kc_pow(double x, double y) { return pow(x, y); }
__device__ __forceinline__ int64_t kc_pow(int64_t b, int64_t e) {
  if (e < 0) return b == 1 ? 1 : (b == -1 ? ((e & 1) ? -1 : 1) : 0);
  int64_t r = 1;
  while (e) {
    if (e & 1) r *= b;
    b *= b;
    e >>= 1;
  }
  return r;
}

template <int NIN, class F, class X0, class X1, class X2>
__device__ __forceinline__ auto kc_call(const F &f, int64_t k, X0 a, X1 b, X2 c) {
  if constexpr (NIN == 0) {
    (void)a, (void)b, (void)c;
    return f(k);
  } else if constexpr (NIN == 1) {
    (void)b, (void)c, (void)k;
    return f(a);
  } else if constexpr (NIN == 2) {
    (void)c, (void)k;
    return f(a, b);
  } else {
    (void)k;
    return f(a, b, c);
  }
}

template <int NIN, int V, class F, class TO, class T0, class T1, class T2>
__global__ void __launch_bounds__(KC_THREADS)
    kc_ew_vec(TO *out, const T0 *p0, const T1 *p1, const T2 *p2, int bcast, int64_t n, F f,
              int per = 0, uint64_t period = 1) {
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  const int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const int64_t nv = n / V;
  for (int64_t i = tid; i < nv; i += step) {
    /* inputs in per repeat every period elements (a multiple of V: no vector straddles) */
    const int64_t ip = per ? (int64_t)(((uint64_t)i * V) % period) / V : i;
    kc_vec<T0, V> a0;
    kc_vec<T1, V> a1;
    kc_vec<T2, V> a2;
    if constexpr (NIN >= 1) {
      if (bcast & 1) {
#pragma unroll
        for (int j = 0; j < V; j++) a0.v[j] = p0[0];
      } else {
        a0 = *(const kc_vec<T0, V> *)(p0 + ((per & 1) ? ip : i) * V);
      }
    }
    if constexpr (NIN >= 2) {
      if (bcast & 2) {
#pragma unroll
        for (int j = 0; j < V; j++) a1.v[j] = p1[0];
      } else {
        a1 = *(const kc_vec<T1, V> *)(p1 + ((per & 2) ? ip : i) * V);
      }
    }
    if constexpr (NIN >= 3) {
      if (bcast & 4) {
#pragma unroll
        for (int j = 0; j < V; j++) a2.v[j] = p2[0];
      } else {
        a2 = *(const kc_vec<T2, V> *)(p2 + ((per & 4) ? ip : i) * V);
      }
    }
    kc_vec<TO, V> r;
#pragma unroll
    for (int j = 0; j < V; j++)
      r.v[j] = kc_st<TO>(kc_call<NIN>(f, i * V + j, kc_ld<T0>(a0.v[j]), kc_ld<T1>(a1.v[j]),
                                      kc_ld<T2>(a2.v[j])));
    *(kc_vec<TO, V> *)(out + i * V) = r;
  }
  for (int64_t k = nv * V + tid; k < n; k += step) { /* per: n is a multiple of V */
    T0 a0 = T0();
    T1 a1 = T1();
    T2 a2 = T2();
    if constexpr (NIN >= 1) a0 = p0[(bcast & 1) ? 0 : k];
    if constexpr (NIN >= 2) a1 = p1[(bcast & 2) ? 0 : k];
    if constexpr (NIN >= 3) a2 = p2[(bcast & 4) ? 0 : k];
    out[k] = kc_st<TO>(kc_call<NIN>(f, k, kc_ld<T0>(a0), kc_ld<T1>(a1), kc_ld<T2>(a2)));
  }
}

template <int NIN, class I, class F, class TO, class T0, class T1, class T2>
__global__ void __launch_bounds__(KC_THREADS)
    kc_ew_strided(TO *out, const T0 *p0, const T1 *p1, const T2 *p2, kc_geom<NIN + 1, I> g,
                  I n, F f) {
  const I step = (I)gridDim.x * blockDim.x;
  for (I k = (I)blockIdx.x * blockDim.x + threadIdx.x; k < n; k += step) {
    I off[NIN + 1];
    kc_offsets<NIN + 1, I>(g, k, off);
    T0 a0 = T0();
    T1 a1 = T1();
    T2 a2 = T2();
    if constexpr (NIN >= 1) a0 = p0[off[1]];
    if constexpr (NIN >= 2) a1 = p1[off[2]];
    if constexpr (NIN >= 3) a2 = p2[off[3]];
    out[off[0]] =
        kc_st<TO>(kc_call<NIN>(f, (int64_t)k, kc_ld<T0>(a0), kc_ld<T1>(a1), kc_ld<T2>(a2)));
  }
}

template <class A, class B> constexpr size_t kc_max_sz() { return sizeof(A) > sizeof(B) ? sizeof(A) : sizeof(B); }

/* Reorders the dims of the nv views (v[0] the output) so that the output's strides do not
** increase (a stable sort; size-1 dims stay where they are), copying the views into pv and
** pointing v at the copies; nothing when the output already is in that order. The element
** order changes, so only for kernels whose result does not depend on the linear index. */
static inline void kc_memory_order(const kiln__view **v, int nv, kiln__view *pv) {
  const kiln__view *o = v[0];
  int nd = o->ndim, perm[KILN_MAX_DIMS], n = 0;
  bool sorted = true;
  int64_t last = INT64_MAX;
  for (int d = 0; d < nd; d++) {
    if (o->shape[d] == 1) continue;
    if (o->strides[d] > last) sorted = false;
    last = o->strides[d];
  }
  if (sorted || nd > KILN_MAX_DIMS) return;
  /* the non-1 dims sorted by stride, descending and stable; then the size-1 dims */
  for (int d = 0; d < nd; d++)
    if (o->shape[d] != 1) {
      int j = n++;
      while (j > 0 && o->strides[perm[j - 1]] < o->strides[d]) {
        perm[j] = perm[j - 1];
        j--;
      }
      perm[j] = d;
    }
  for (int d = 0; d < nd; d++)
    if (o->shape[d] == 1) perm[n++] = d;
  for (int i = 0; i < nv; i++) {
    pv[i] = *v[i];
    for (int d = 0; d < nd; d++) {
      pv[i].shape[d] = v[i]->shape[perm[d]];
      pv[i].strides[d] = v[i]->strides[perm[d]];
    }
    v[i] = &pv[i];
  }
}

/* Runs f over out = f(in...) (NIN inputs; the unused T's are placeholders). */
template <int NIN, class TO, class T0, class T1, class T2, class F>
kiln_status kc_ew_launch(kiln__cuda_dev *d, const kiln__view *out, const kiln__view *const *ins,
                         F f, const char *what) {
  const kiln__view *v[4] = {out, NULL, NULL, NULL};
  for (int i = 0; i < NIN; i++) v[i + 1] = ins[i];
  /* With inputs, no functor reads the linear index, so the walk may take the dims in the
  ** output's memory order: a channels-last (or other permuted-dense) output and inputs
  ** of the same layout then coalesce to one contiguous run and take the vectorised path. */
  kiln__view pv[4];
  if (NIN >= 1) kc_memory_order(v, NIN + 1, pv);
  kc_shape sh;
  kc_coalesce(&sh, v, NIN + 1);
  if (sh.numel == 0) return KILN_OK;
  TO *po = (TO *)out->data;
  const T0 *p0 = NIN >= 1 ? (const T0 *)ins[0]->data : NULL;
  const T1 *p1 = NIN >= 2 ? (const T1 *)ins[1]->data : NULL;
  const T2 *p2 = NIN >= 3 ? (const T2 *)ins[2]->data : NULL;

  constexpr size_t maxsz =
      kc_max_sz<TO, T0>() > kc_max_sz<T1, T2>() ? kc_max_sz<TO, T0>() : kc_max_sz<T1, T2>();
  constexpr int V = (int)(16 / maxsz);
  bool vec = sh.ndim == 1 && sh.st[0][0] == 1;
  int bcast = 0;
  const void *ptrs[3] = {p0, p1, p2};
  const size_t sizes[3] = {sizeof(T0), sizeof(T1), sizeof(T2)};
  if ((uintptr_t)po % (V * sizeof(TO))) vec = false;
  for (int i = 0; i < NIN && vec; i++) {
    if (sh.st[i + 1][0] == 0) bcast |= 1 << i;
    else if (sh.st[i + 1][0] != 1 || (uintptr_t)ptrs[i] % (V * sizes[i])) vec = false;
  }
  /* (outer, inner), the output contiguous: inputs contiguous, repeating (0, 1) or scalar */
  int per = 0;
  const int64_t inner = sh.ndim == 2 ? sh.shape[1] : 0;
  bool pvec = sh.ndim == 2 && inner % V == 0 && sh.st[0][0] == inner && sh.st[0][1] == 1 &&
              (uintptr_t)po % (V * sizeof(TO)) == 0;
  for (int i = 0; i < NIN && pvec; i++) {
    const int64_t s0 = sh.st[i + 1][0], s1 = sh.st[i + 1][1];
    if (s0 == 0 && s1 == 0) bcast |= 1 << i;
    else if (s0 == 0 && s1 == 1) per |= 1 << i;
    else if (!(s0 == inner && s1 == 1)) pvec = false;
    if (s1 == 1 && (uintptr_t)ptrs[i] % (V * sizes[i])) pvec = false;
  }
  if (pvec && per) {
    int blocks = kc_blocks(sh.numel / V, KC_THREADS, d->sm_count);
    kc_ew_vec<NIN, V, F, TO, T0, T1, T2><<<blocks, KC_THREADS, 0, d->stream>>>(
        po, p0, p1, p2, bcast, sh.numel, f, per, (uint64_t)inner);
  } else if (vec) {
    int blocks = kc_blocks((sh.numel + V - 1) / V, KC_THREADS, d->sm_count);
    kc_ew_vec<NIN, V, F, TO, T0, T1, T2>
        <<<blocks, KC_THREADS, 0, d->stream>>>(po, p0, p1, p2, bcast, sh.numel, f);
  } else if (kc_fits32(&sh)) {
    int blocks = kc_blocks(sh.numel, KC_THREADS, d->sm_count);
    kc_ew_strided<NIN, int32_t, F, TO, T0, T1, T2><<<blocks, KC_THREADS, 0, d->stream>>>(
        po, p0, p1, p2, kc_make_geom<NIN + 1, int32_t>(&sh), (int32_t)sh.numel, f);
  } else {
    int blocks = kc_blocks(sh.numel, KC_THREADS, d->sm_count);
    kc_ew_strided<NIN, int64_t, F, TO, T0, T1, T2><<<blocks, KC_THREADS, 0, d->stream>>>(
        po, p0, p1, p2, kc_make_geom<NIN + 1, int64_t>(&sh), (int64_t)sh.numel, f);
  }
  return kiln__cuda_launched(what);
}

/* Inputs whose dtype is not `want` are cast into contiguous temporaries of the output's
** shape (rare: the op layer normally hands matching dtypes). The temporaries are freed
** right after the launch is queued: stream order keeps that safe. */
struct kc_temps {
  int device;
  int n;
  void *p[KILN__MAX_KIN];
  kiln__view v[KILN__MAX_KIN];
  kc_temps(int dev) : device(dev), n(0) {}
  ~kc_temps() {
    for (int i = 0; i < n; i++) kiln__cuda_free(device, p[i], 0);
  }
  /* Returns the view to use for in (cast when needed), or NULL on error. A dim along which
  ** in is broadcast (stride 0) stays broadcast: the temporary holds one copy of it (a
  ** (T, T) mask under (B, H, T, T) is cast once, not B * H times). */
  const kiln__view *cast(const kiln__view *in, const kiln__view *shape_of, kiln_dtype want) {
    if (in->dtype == want) return in;
    const bool same_rank = in->ndim == shape_of->ndim;
    kiln__view t = *in, src = *in; /* t: the temporary as the kernel sees it; src: in, compact */
    t.dtype = want;
    t.ndim = src.ndim = shape_of->ndim;
    int64_t s = 1;
    for (int d = shape_of->ndim - 1; d >= 0; d--) {
      bool rep = same_rank && in->strides[d] == 0 && shape_of->shape[d] > 1;
      t.shape[d] = shape_of->shape[d];
      t.strides[d] = rep ? 0 : s;
      src.shape[d] = rep ? 1 : shape_of->shape[d];
      if (!same_rank) src.shape[d] = shape_of->shape[d];
      s *= src.shape[d];
    }
    void *mem = kiln__cuda_alloc(device, (size_t)s * kc_size(want));
    if (!mem) return NULL;
    t.data = mem;
    kiln__view dst = t; /* the compact temporary */
    for (int d = 0; d < dst.ndim; d++) dst.shape[d] = src.shape[d];
    p[n] = mem;
    v[n] = t;
    n++;
    if (kiln__cuda_copy_view(device, &dst, same_rank ? &src : in) != KILN_OK) return NULL;
    return &v[n - 1];
  }
};

#endif /* KILN_CUDA_EW_CUH */
