/*
** Internals shared by the CUDA backend's .cu files (C++ only: templates, CUDA types).
** Not API. Device state, error helpers, dtype traits and the strided-geometry helpers
** every kernel family uses.
*/
#ifndef KILN_CUDA_INT_CUH
#define KILN_CUDA_INT_CUH

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "kiln.h"
#include "../backend.h"
#include "../../core/knobs.h"
#include "cuda_api.h"

#define KC_MAX_DEV 64
#define KC_THREADS 256

/* Whether the tuning switch `name` (src/core/knobs.c) is set to 0: those that turn a default
** path off for an A/B (KILN_CONV_S2D=0, KILN_PDL=0, ...); callers read it once into a
** function-local static. */
static inline bool kc_env_zero(const char *name) { return !kiln__knob_on(name, true); }

/* ---- per-device state (cuda_backend.cu) ---- */
typedef struct kiln__cuda_dev {
  cudaStream_t stream;
  int *err_flag;      /* device alias of err_flag_host: 0, or 1 + the kop of the first bad index */
  int *err_flag_host; /* mapped pinned host memory */
  int sm_count;
  int capturing;      /* a graph capture is open on this device */
  void *blas;         /* cublasHandle_t, cuda_matmul.cu */
  void *blaslt;       /* cublasLtHandle_t */
  void *workspace;    /* cuBLAS workspace from the caching allocator */
  size_t workspace_size;
} kiln__cuda_dev;

extern "C" {
/* Makes device current on this thread and returns its state, creating the stream and
** the error flag on first use. KILN_ERR_DEVICE for a bad index. */
kiln_status kiln__cuda_ctx(int device, kiln__cuda_dev **out);
/* KILN_OK for cudaSuccess; otherwise sets the last error naming what and returns a code
** (OOM for allocation failures, STATE for capture misuse, INTERNAL otherwise). */
kiln_status kiln__cuda_err(cudaError_t e, const char *what);
/* cudaGetLastError after a launch. */
/* Small products (cuda_matmul_small.cu): whether kiln's own one-launch kernels take a
** problem of `batch` (M, K) @ (K, N) products, and the launch (operand batch strides
** sa, sb, sc, smask; MATMUL's bias, flags and row sums as in backend.h). */
bool kiln__cuda_matmul_small_fits(int64_t batch, int64_t M, int64_t N, int64_t K);
kiln_status kiln__cuda_matmul_small(kiln__cuda_dev *d, const kiln__kargs *a, const kiln__view &A,
                                    const kiln__view &B, const kiln__view &C, int64_t batch,
                                    int64_t sa, int64_t sb, int64_t sc, int64_t smask);
kiln_status kiln__cuda_launched(const char *what);
/* Reads and clears the device-side index error flag (synchronizes the stream). */
kiln_status kiln__cuda_check_flag(int device);

/* ---- caching allocator (cuda_memory.cu) ---- */
void *kiln__cuda_alloc(int device, size_t nbytes);
void kiln__cuda_free(int device, void *ptr, size_t nbytes);
kiln_status kiln__cuda_memory_stats(int device, kiln_memory_stats *out);
kiln_status kiln__cuda_empty_cache(int device);
kiln_status kiln__cuda_set_memory_limit(int device, int64_t bytes);
void kiln__cuda_reset_peak(int device);
void kiln__cuda_mem_capture_begin(int device, int id);
void kiln__cuda_mem_capture_end(int device, int id, bool ok);
void kiln__cuda_mem_graph_release(int device, int id);

/* ---- a capture's data dependencies (cuda_capture.cu) ---- */
/* Between begin and end (cuda_graph.cu), each op the kernel table runs is made to wait
** only for the ops it conflicts with (KILN_GRAPH_DEPS=0: off). */
void kiln__cuda_capture_track_begin(int device);
void kiln__cuda_capture_track_end(int device);
bool kiln__cuda_capture_tracking(int device);
kiln_status kiln__cuda_capture_op_begin(const kiln__kargs *a);
kiln_status kiln__cuda_capture_op_end(int device);
/* Memory an open op writes beyond its views (scratch, a library's workspace): called
** before the op's first use of it. A no-op outside a tracked capture. */
kiln_status kiln__cuda_capture_note(int device, const void *p, size_t n);

/* ---- kernel families ---- */
kiln_status kiln__cuda_elementwise(const kiln__kargs *a); /* copy..where */
bool kiln__cuda_elementwise_supports(const kiln__kargs *a);
kiln_status kiln__cuda_kv(const kiln__kargs *a); /* the decode step's ops (cuda_kv.cu) */
bool kiln__cuda_kv_supports(const kiln__kargs *a);
kiln_status kiln__cuda_random(const kiln__kargs *a);
bool kiln__cuda_random_supports(const kiln__kargs *a);
kiln_status kiln__cuda_reduce(const kiln__kargs *a);
bool kiln__cuda_reduce_supports(const kiln__kargs *a);
kiln_status kiln__cuda_softmax(const kiln__kargs *a); /* softmax family */
bool kiln__cuda_softmax_supports(const kiln__kargs *a);
kiln_status kiln__cuda_cross_entropy(const kiln__kargs *a); /* cuda_cross_entropy.cu */
bool kiln__cuda_cross_entropy_supports(const kiln__kargs *a);
kiln_status kiln__cuda_matmul(const kiln__kargs *a);
kiln_status kiln__cuda_adam(const kiln__kargs *a); /* cuda_optim.cu */
bool kiln__cuda_adam_supports(const kiln__kargs *a);
kiln_status kiln__cuda_adam_multi(const kiln__kargs *a);
bool kiln__cuda_adam_multi_supports(const kiln__kargs *a);
kiln_status kiln__cuda_sgd_multi(const kiln__kargs *a);
kiln_status kiln__cuda_cast_multi(const kiln__kargs *a); /* cuda_cast.cu */
bool kiln__cuda_cast_multi_supports(const kiln__kargs *a);
bool kiln__cuda_sgd_multi_supports(const kiln__kargs *a);
bool kiln__cuda_matmul_supports(const kiln__kargs *a);
kiln_status kiln__cuda_index(const kiln__kargs *a);
kiln_status kiln__cuda_binary(const kiln__kargs *a); /* binary + where (cuda_binary.cu) */
bool kiln__cuda_binary_supports(const kiln__kargs *a);
bool kiln__cuda_index_supports(const kiln__kargs *a);
kiln_status kiln__cuda_amp(const kiln__kargs *a); /* AMP_UNSCALE (cuda_amp.cu) */
bool kiln__cuda_amp_supports(const kiln__kargs *a);
kiln_status kiln__cuda_transformer(const kiln__kargs *a); /* norms, attention, scan, topk, */
bool kiln__cuda_transformer_supports(const kiln__kargs *a); /* multinomial (cuda_transformer.cu) */
kiln_status kiln__cuda_conv(const kiln__kargs *a); /* im2col, pools, conv (cuda_conv.cu) */
bool kiln__cuda_conv_supports(const kiln__kargs *a);
kiln_status kiln__cuda_batchnorm(const kiln__kargs *a); /* BATCH_NORM and backward (cuda_batchnorm.cu) */
bool kiln__cuda_batchnorm_supports(const kiln__kargs *a);

/* Internal helpers other families use (cuda_elementwise.cu): out = cast(in) with any
** strides, and out += bias broadcast along the last dim. Queue on the device's stream. */
kiln_status kiln__cuda_copy_view(int device, const kiln__view *out, const kiln__view *in);
kiln_status kiln__cuda_cast_view(int device, const kiln__view *out, const kiln__view *in); /* dtypes differ */
kiln_status kiln__cuda_fill_view(int device, const kiln__view *out, double value);
kiln_status kiln__cuda_scale_view(int device, const kiln__view *out, double s);
kiln_status kiln__cuda_add_view(int device, const kiln__view *out, const kiln__view *in);
}

#define KC_TRY(expr)                                                                      \
  do {                                                                                    \
    kiln_status kc_s_ = (expr);                                                           \
    if (kc_s_ != KILN_OK) return kc_s_;                                                   \
  } while (0)
#define KC_CUDA(call, what) KC_TRY(kiln__cuda_err((call), (what)))

/* ---- dtype traits ---- */
/* acc: the type arithmetic happens in (f32 for the 16-bit floats, int64 for integers). */
template <class T> struct kc_traits { typedef int64_t acc; };
template <> struct kc_traits<float> { typedef float acc; };
template <> struct kc_traits<double> { typedef double acc; };
template <> struct kc_traits<__half> { typedef float acc; };
template <> struct kc_traits<__nv_bfloat16> { typedef float acc; };

template <class T> __device__ __forceinline__ typename kc_traits<T>::acc kc_ld(T v) {
  return (typename kc_traits<T>::acc)v;
}
template <> __device__ __forceinline__ float kc_ld<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float kc_ld<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <> __device__ __forceinline__ int64_t kc_ld<bool>(bool v) { return v ? 1 : 0; }

/* Storage from any arithmetic value. */
template <class T> struct kc_cvt {
  template <class A> static __device__ __forceinline__ T to(A v) { return (T)v; }
};
template <> struct kc_cvt<__half> {
  template <class A> static __device__ __forceinline__ __half to(A v) {
    return __float2half_rn((float)v);
  }
};
template <> struct kc_cvt<__nv_bfloat16> {
  template <class A> static __device__ __forceinline__ __nv_bfloat16 to(A v) {
    return __float2bfloat16_rn((float)v);
  }
};
template <> struct kc_cvt<bool> {
  template <class A> static __device__ __forceinline__ bool to(A v) { return v != (A)0; }
};
template <class T, class A> __device__ __forceinline__ T kc_st(A v) { return kc_cvt<T>::to(v); }

/* Four consecutive elements as floats, in one load: 16 bytes of f32, 8 of bf16 or f16 (p
** aligned to the load's size). */
template <class T> __device__ __forceinline__ float4 kc_ld4(const T *p);
template <> __device__ __forceinline__ float4 kc_ld4<float>(const float *p) {
  return *reinterpret_cast<const float4 *>(p);
}
template <> __device__ __forceinline__ float4 kc_ld4<__nv_bfloat16>(const __nv_bfloat16 *p) {
  const uint2 u = *reinterpret_cast<const uint2 *>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}
template <> __device__ __forceinline__ float4 kc_ld4<__half>(const __half *p) {
  const uint2 u = *reinterpret_cast<const uint2 *>(p);
  const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&u.x));
  const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&u.y));
  return make_float4(a.x, a.y, b.x, b.y);
}

/* Eight consecutive 16-bit elements as floats, in one 16-byte load (p 16-byte aligned). */
template <class T> __device__ __forceinline__ void kc_ld8(const T *p, float *v) {
  const uint4 u = *reinterpret_cast<const uint4 *>(p);
  const float4 a = kc_ld4<T>(reinterpret_cast<const T *>(&u.x)), b = kc_ld4<T>(reinterpret_cast<const T *>(&u.z));
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

/* Asynchronous copies global -> shared (sm_80+): 16 bytes (.cg: past L1) or 8 (.ca), a
** group committed, then waited on until at most N groups are in flight. A thread sees its
** own copies after the wait; another thread's only after a barrier. */
__device__ __forceinline__ uint32_t kc_smem_u32(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void kc_cp_async16(void *s, const void *g) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(kc_smem_u32(s)), "l"(g) : "memory");
}
__device__ __forceinline__ void kc_cp_async8(void *s, const void *g) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(kc_smem_u32(s)), "l"(g) : "memory");
}
__device__ __forceinline__ void kc_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void kc_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

/* Runtime dtype -> C++ type. BODY sees the type as T_NAME. */
#define KC_CASE_(DT, TYPE, T_NAME, ...)                                                   \
  case DT: {                                                                              \
    typedef TYPE T_NAME;                                                                  \
    __VA_ARGS__;                                                                          \
  } break;
#define KC_FLOAT_CASES_(T_NAME, ...)                                                      \
  KC_CASE_(KILN_F32, float, T_NAME, __VA_ARGS__)                                          \
  KC_CASE_(KILN_F64, double, T_NAME, __VA_ARGS__)                                         \
  KC_CASE_(KILN_F16, __half, T_NAME, __VA_ARGS__)                                         \
  KC_CASE_(KILN_BF16, __nv_bfloat16, T_NAME, __VA_ARGS__)
#define KC_INT_CASES_(T_NAME, ...)                                                        \
  KC_CASE_(KILN_I64, int64_t, T_NAME, __VA_ARGS__)                                        \
  KC_CASE_(KILN_I32, int32_t, T_NAME, __VA_ARGS__)                                        \
  KC_CASE_(KILN_U8, uint8_t, T_NAME, __VA_ARGS__)                                         \
  KC_CASE_(KILN_BOOL, bool, T_NAME, __VA_ARGS__)
/* These evaluate to a switch; `default:` runs FAIL. */
#define KC_SWITCH_FLOAT(dt, T_NAME, FAIL, ...)                                            \
  switch (dt) {                                                                           \
    KC_FLOAT_CASES_(T_NAME, __VA_ARGS__)                                                  \
  default:                                                                                \
    FAIL;                                                                                 \
  }
#define KC_SWITCH_ALL(dt, T_NAME, FAIL, ...)                                              \
  switch (dt) {                                                                           \
    KC_FLOAT_CASES_(T_NAME, __VA_ARGS__)                                                  \
    KC_INT_CASES_(T_NAME, __VA_ARGS__)                                                    \
  default:                                                                                \
    FAIL;                                                                                 \
  }

static inline bool kc_is_float(kiln_dtype dt) {
  return dt == KILN_F32 || dt == KILN_F64 || dt == KILN_F16 || dt == KILN_BF16;
}
static inline bool kc_is_index(kiln_dtype dt) { return dt == KILN_I64 || dt == KILN_I32; }
static inline size_t kc_size(kiln_dtype dt) {
  switch (dt) {
  case KILN_F32: case KILN_I32: return 4;
  case KILN_F64: case KILN_I64: return 8;
  case KILN_F16: case KILN_BF16: return 2;
  case KILN_U8: case KILN_BOOL: return 1;
  default: return 0;
  }
}
static inline int64_t kc_numel(const kiln__view *v) {
  int64_t n = 1;
  for (int d = 0; d < v->ndim; d++) n *= v->shape[d];
  return n;
}

/* ---- strided geometry ---- */
/* nv views of one shape, coalesced: size-1 dims dropped, adjacent dims merged where
** every view is contiguous across them. C order of the elements is kept, so the linear
** index k of an element is the same before and after. */
#define KC_MAXV (KILN__MAX_KIN + KILN__MAX_KOUT)
struct kc_shape {
  int ndim, nv;
  int64_t numel;
  int64_t shape[KILN_MAX_DIMS];
  int64_t st[KC_MAXV][KILN_MAX_DIMS];
};

static inline void kc_coalesce(kc_shape *g, const kiln__view *const *v, int nv) {
  const int nd = v[0]->ndim;
  g->nv = nv;
  g->numel = kc_numel(v[0]);
  g->ndim = 0;
  if (g->numel == 0) {
    g->ndim = 1;
    g->shape[0] = 0;
    for (int i = 0; i < nv; i++) g->st[i][0] = 1;
    return;
  }
  for (int d = 0; d < nd; d++) {
    if (v[0]->shape[d] == 1) continue;
    if (g->ndim > 0) {
      int last = g->ndim - 1;
      bool merge = true;
      for (int i = 0; i < nv; i++)
        if (g->st[i][last] != v[i]->strides[d] * v[0]->shape[d]) merge = false;
      if (merge) {
        g->shape[last] *= v[0]->shape[d];
        for (int i = 0; i < nv; i++) g->st[i][last] = v[i]->strides[d];
        continue;
      }
    }
    g->shape[g->ndim] = v[0]->shape[d];
    for (int i = 0; i < nv; i++) g->st[i][g->ndim] = v[i]->strides[d];
    g->ndim++;
  }
  if (g->ndim == 0) {
    g->ndim = 1;
    g->shape[0] = 1;
    for (int i = 0; i < nv; i++) g->st[i][0] = 1;
  }
}

/* Whether every offset and the element count fit in int32 (then kernels index in 32 bits,
** which is markedly faster for the div/mod of the strided path). */
static inline bool kc_fits32(const kc_shape *g) {
  if (g->numel >= (int64_t)INT32_MAX) return false;
  for (int i = 0; i < g->nv; i++) {
    int64_t span = 0;
    for (int d = 0; d < g->ndim; d++) {
      int64_t s = g->st[i][d] < 0 ? -g->st[i][d] : g->st[i][d];
      span += (g->shape[d] - 1) * s;
    }
    if (span >= (int64_t)INT32_MAX) return false;
  }
  return true;
}

/* Geometry passed to kernels by value. */
template <int NV, class I> struct kc_geom {
  int ndim;
  I shape[KILN_MAX_DIMS];
  I st[NV][KILN_MAX_DIMS];
};
template <int NV, class I> static inline kc_geom<NV, I> kc_make_geom(const kc_shape *g) {
  kc_geom<NV, I> r;
  r.ndim = g->ndim;
  for (int d = 0; d < KILN_MAX_DIMS; d++) {
    r.shape[d] = d < g->ndim ? (I)g->shape[d] : (I)1;
    for (int i = 0; i < NV; i++) r.st[i][d] = (d < g->ndim && i < g->nv) ? (I)g->st[i][d] : 0;
  }
  return r;
}
/* Offsets (in elements) of linear index k in each view. */
template <int NV, class I>
__device__ __forceinline__ void kc_offsets(const kc_geom<NV, I> &g, I k, I *off) {
#pragma unroll
  for (int i = 0; i < NV; i++) off[i] = 0;
#pragma unroll
  for (int d = KILN_MAX_DIMS - 1; d >= 0; d--) {
    if (d < g.ndim) {
      I c = k % g.shape[d];
      k /= g.shape[d];
#pragma unroll
      for (int i = 0; i < NV; i++) off[i] += c * g.st[i][d];
    }
  }
}

static inline int kc_blocks(int64_t work, int threads, int sm_count) {
  int64_t b = (work + threads - 1) / threads;
  int64_t cap = (int64_t)(sm_count > 0 ? sm_count : 132) * 32;
  if (b > cap) b = cap;
  if (b < 1) b = 1;
  return (int)b;
}

/* Sets the device's index error flag (first error wins). */
/* The flag is mapped host memory (cuda_backend.cu): a plain store, no atomic (PCIe may not
** carry atomics). Racing writers only race over which bad op is named. */
__device__ __forceinline__ void kc_flag(int *flag, int kop) {
  volatile int *f = flag;
  if (*f == 0) *f = kop + 1;
}

/* Warp and block reductions of a value with an associative op. */
template <class T, class F> __device__ __forceinline__ T kc_warp_reduce(T v, F f) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = f(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/* V values of T as one aligned load or store (16 bytes where V * sizeof(T) is 16). */
template <class T, int V> struct alignas(sizeof(T) * V) kc_vec {
  T v[V];
};

/* n / d for 0 <= n < 2^31 by a multiply and a shift (PyTorch's IntDivider): the magic
** number m and shift s are made once on the host (kc_make_fastdiv), so a kernel's index
** arithmetic has no integer division (cuda_pool.cu, cuda_conv1.cu). */
struct kc_fastdiv {
  uint32_t d, m, s;
};
static inline kc_fastdiv kc_make_fastdiv(uint32_t d) {
  kc_fastdiv f;
  f.d = d, f.s = 0;
  while (f.s < 32 && (1u << f.s) < d) f.s++;
  f.m = (uint32_t)(((uint64_t)1 << 32) * (((uint64_t)1 << f.s) - d) / d + 1);
  return f;
}
__device__ __forceinline__ int kc_div(int n, const kc_fastdiv &f) {
  return (int)((__umulhi((uint32_t)n, f.m) + (uint32_t)n) >> f.s);
}

#endif /* KILN_CUDA_INT_CUH */
