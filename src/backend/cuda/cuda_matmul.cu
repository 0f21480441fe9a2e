/*
** MATMUL through cuBLAS (cublasGemmStridedBatchedEx) and cuBLASLt plans (cuda_blaslt.cu:
** the epilogues, and the large 16-bit 2-D products, whose algorithm is timed once a shape).
**
** kiln's matrices are row-major; cuBLAS's are column-major. A row-major (M, N) matrix is
** the column-major (N, M) one, so C = A B is computed as C^T = B^T A^T: the operands are
** passed swapped with m = N, n = M. A matrix whose column stride is 1 is "row-major" (op
** N); one whose row stride is 1 is a transposed view (op T); anything else is first
** copied to a contiguous temporary. Batch dims go into one strided-batched call when each
** tensor's batch offsets are a multiple of one stride (0 for a broadcast operand); else
** the innermost batch dims that do collapse make one call, looped over the outer ones.
**
** f32 is exact (CUBLAS_COMPUTE_32F) unless a->i[0] == 1 allows TF32; f16 and bf16
** accumulate in f32; f64 is DGEMM-exact. out0 = s0 * A@B + s1 * out0 + bias.
** "Wide" products: f16 or bf16 A and B with an f32 out0 (and f32 row sums), no bias: the
** f32 accumulator is written as it is (cuBLAS's 16BF/16F inputs, 32F output, compute
** 32F). Autocast's weight gradients go so straight into the f32 parameter's gradient,
** with no cast kernel after the product (ops_matmul.c, linear's rule).
** The handle and a 32 MiB workspace (from the caching allocator, so that graph capture
** never sees cuBLAS allocate) are made per device on first use, bound to its stream.
*/
#include "cuda_blaslt.cuh"
#include "cuda_int.cuh"

#include <stdio.h>
#include <string.h>

#include <cublasLt.h>
#include <cublas_v2.h>
#include <mutex>
#include <stdlib.h>

namespace {

const size_t kWorkspace = (size_t)32 << 20;
std::mutex g_blas_mu;

kiln_status blas_err(cublasStatus_t s, const char *what) {
  if (s == CUBLAS_STATUS_SUCCESS) return KILN_OK;
  kiln_status code = KILN_ERR_INTERNAL;
  if (s == CUBLAS_STATUS_ALLOC_FAILED) code = KILN_ERR_OOM;
  else if (s == CUBLAS_STATUS_NOT_SUPPORTED || s == CUBLAS_STATUS_ARCH_MISMATCH)
    code = KILN_ERR_UNSUPPORTED;
  else if (s == CUBLAS_STATUS_INVALID_VALUE) code = KILN_ERR_INVALID_ARGUMENT;
  return kiln_set_error(code, "kiln: cuBLAS error in %s: %s", what, cublasGetStatusString(s));
}
#define KC_BLAS(call, what) KC_TRY(blas_err((call), (what)))

kiln_status handles(int device, kiln__cuda_dev *d) {
  if (d->blas && d->blaslt) return KILN_OK;
  std::lock_guard<std::mutex> lock(g_blas_mu);
  if (d->blas && d->blaslt) return KILN_OK;
  if (d->capturing)
    return kiln_set_error(KILN_ERR_STATE, "kiln: the first matmul on cuda:%d ran inside a graph "
                                          "capture: run a warm-up step before capturing",
                          device);
  if (!d->workspace) {
    d->workspace = kiln__cuda_alloc(device, kWorkspace);
    if (!d->workspace) return kiln_last_error();
    d->workspace_size = kWorkspace;
  }
  cublasHandle_t h;
  KC_BLAS(cublasCreate(&h), "cublasCreate");
  cublasStatus_t s = cublasSetStream(h, d->stream);
  if (s == CUBLAS_STATUS_SUCCESS) s = cublasSetWorkspace(h, d->workspace, d->workspace_size);
  if (s != CUBLAS_STATUS_SUCCESS) {
    cublasDestroy(h);
    return blas_err(s, "cublasSetStream/SetWorkspace");
  }
  cublasLtHandle_t lt;
  s = cublasLtCreate(&lt);
  if (s != CUBLAS_STATUS_SUCCESS) {
    cublasDestroy(h);
    return blas_err(s, "cublasLtCreate");
  }
  d->blas = (void *)h;
  d->blaslt = (void *)lt;
  return KILN_OK;
}

/* How cuBLAS sees one (rows, cols) matrix with strides (sr, sc). */
struct Mat {
  bool trans; /* stored column-major (sr == 1): a transposed view */
  int64_t ld;
};
bool describe(int64_t rows, int64_t cols, int64_t sr, int64_t sc, Mat *m) {
  int64_t maxc = cols > 1 ? cols : 1, maxr = rows > 1 ? rows : 1;
  if ((sc == 1 || cols == 1) && (rows == 1 || sr >= maxc)) {
    m->trans = false;
    m->ld = rows == 1 ? maxc : sr;
  } else if ((sr == 1 || rows == 1) && (cols == 1 || sc >= maxr)) {
    m->trans = true;
    m->ld = cols == 1 ? maxr : sc;
  } else {
    return false;
  }
  return m->ld <= INT32_MAX;
}

/* The one stride that gives the offset of every batch of dims [lo, nb), if there is one
** (0 for none, or for a broadcast operand). */
bool batch_stride_from(const kiln__view *v, int lo, int nb, int64_t *out) {
  int64_t s = 0, inner = 1;
  bool have = false;
  for (int i = nb - 1; i >= lo; i--) {
    if (v->shape[i] == 1) continue;
    if (!have) {
      s = v->strides[i];
      have = true;
    } else if (v->strides[i] != s * inner) {
      return false;
    }
    inner *= v->shape[i];
  }
  *out = s;
  return true;
}
bool batch_stride(const kiln__view *v, int nb, int64_t *out) { return batch_stride_from(v, 0, nb, out); }

int64_t batch_offset(const kiln__view *v, int nb, int64_t b) {
  int64_t off = 0;
  for (int i = nb - 1; i >= 0; i--) {
    off += (b % v->shape[i]) * v->strides[i];
    b /= v->shape[i];
  }
  return off;
}

kiln__view contiguous_like(const kiln__view *v, void *mem) {
  kiln__view t = *v;
  t.data = mem;
  int64_t s = 1;
  for (int d = v->ndim - 1; d >= 0; d--) {
    t.strides[d] = s;
    s *= v->shape[d];
  }
  return t;
}


/* out[m] = sum_k A[m, k] (one thread a row; A's rows are usually a transposed view, so
** neighbouring threads read neighbouring elements). */
template <class T, class R>
__global__ void row_sums(const T *A, int64_t M, int64_t K, int64_t am, int64_t ak, R *out, int64_t so) {
  typedef typename kc_traits<T>::acc Acc;
  for (int64_t m = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; m < M; m += (int64_t)gridDim.x * blockDim.x) {
    Acc s = 0;
    for (int64_t k = 0; k < K; k++) s += (Acc)kc_ld<T>(A[m * am + k * ak]);
    out[m * so] = kc_st<R>(s);
  }
}

/* The row sums of a transposed view (A[m, k] at m + k * ak: a weight gradient's g^T, whose
** row sums are the bias gradient), in two launches: block (32, 8) sums W neighbouring rows
** a lane over a chunk of k (stride 8 a thread, then the 8 partials in thread order), into
** f32 partials (chunks, M); then the chunks are added, 8 threads a row in a fixed order.
** The one-thread-a-row kernel above walks K serially with M threads (768 for GPT-2's
** projections: a few SMs busy). */
template <class T, int W> __device__ __forceinline__ void col_ld(const T *p, float *v) {
  if constexpr (W == 8) {
    kc_ld8<T>(p, v);
  } else {
    const float4 q = kc_ld4<T>(p);
    v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
  }
}
/* W neighbouring rows a lane: 4 (one 8- or 16-byte load), or 8 for 16-bit A with rows in
** eights (one 16-byte load); a block 32 W rows, a thread one of them in the second half. */
template <class T, int W>
__global__ void __launch_bounds__(256) col_sums_part(const T *A, int64_t M, int64_t K, int64_t ak, int64_t chunk,
                                                     float *part) {
  __shared__ float sp[8][32 * W + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t m = ((int64_t)blockIdx.x * 32 + tx) * W, k0 = (int64_t)blockIdx.y * chunk;
  const int64_t k1 = k0 + chunk < K ? k0 + chunk : K;
  float a[W];
#pragma unroll
  for (int e = 0; e < W; e++) a[e] = 0;
  if (m < M) {
#pragma unroll 4
    for (int64_t k = k0 + ty; k < k1; k += 8) {
      float v[W];
      col_ld<T, W>(A + k * ak + m, v);
#pragma unroll
      for (int e = 0; e < W; e++) a[e] += v[e];
    }
  }
#pragma unroll
  for (int e = 0; e < W; e++) sp[ty][tx * W + e] = a[e];
  __syncthreads();
  const int c = ty * 32 + tx;
  const int64_t mc = (int64_t)blockIdx.x * 32 * W + c;
  if (c >= 32 * W || mc >= M) return;
  float sum = sp[0][c];
  for (int t = 1; t < 8; t++) sum += sp[t][c];
  part[blockIdx.y * M + mc] = sum;
}
template <class R>
__global__ void col_sums_finish(const float *part, int64_t chunks, int64_t M, R *out, int64_t so) {
  __shared__ float sp[8][33];
  const int64_t m = (int64_t)blockIdx.x * 32 + threadIdx.x;
  float a = 0;
  if (m < M)
    for (int64_t c = threadIdx.y; c < chunks; c += 8) a += part[c * M + m];
  sp[threadIdx.y][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y != 0 || m >= M) return;
  for (int t = 1; t < 8; t++) a += sp[t][threadIdx.x];
  out[m * so] = kc_st<R>(a);
}

/* Whether col_sums takes A (a 16-bit or f32 transposed view, rows in fours, aligned) into R
** (A's dtype, or f32 from 16-bit A). */
static bool col_sums_fit(const kiln__view *A, const kiln__view *R) {
  const int64_t M = A->shape[0];
  const size_t es = kc_size(A->dtype);
  if (A->dtype == KILN_F64 || !kc_is_float(A->dtype) || A->strides[0] != 1 || M % 4 != 0 || A->strides[1] % 4 != 0)
    return false;
  if (R->dtype != A->dtype && R->dtype != KILN_F32) return false;
  return ((uintptr_t)A->data % (4 * es)) == 0;
}

static kiln_status col_sums(kiln__cuda_dev *d, int device, const kiln__view *A, const kiln__view *R) {
  const int64_t M = A->shape[0], K = A->shape[1];
  const size_t es = kc_size(A->dtype);
  /* eight rows a lane: 16-bit A, M and the stride in eights, 16-byte aligned */
  const bool wide = es == 2 && M % 8 == 0 && A->strides[1] % 8 == 0 && ((uintptr_t)A->data % 16) == 0;
  const int64_t colb = wide ? (M + 255) / 256 : (M + 127) / 128;
  const int64_t want = ((int64_t)(d->sm_count > 0 ? d->sm_count : 132) * (wide ? 8 : 4) + colb - 1) / colb;
  int64_t chunk = (K + want - 1) / want;
  if (chunk < 32) chunk = 32;
  int64_t chunks = (K + chunk - 1) / chunk;
  if (chunks > 65535) chunks = 65535, chunk = (K + chunks - 1) / chunks;
  const size_t bytes = (size_t)(chunks * M) * sizeof(float);
  float *part = (float *)kiln__cuda_alloc(device, bytes);
  if (!part) return kiln_last_error();
  kiln_status st = kiln__cuda_capture_note(device, part, bytes);
  if (st == KILN_OK) {
    const dim3 grid((unsigned)colb, (unsigned)chunks), blk(32, 8);
    switch (A->dtype) {
    case KILN_BF16:
      if (wide)
        col_sums_part<__nv_bfloat16, 8><<<grid, blk, 0, d->stream>>>((const __nv_bfloat16 *)A->data, M, K,
                                                                     A->strides[1], chunk, part);
      else
        col_sums_part<__nv_bfloat16, 4><<<grid, blk, 0, d->stream>>>((const __nv_bfloat16 *)A->data, M, K,
                                                                     A->strides[1], chunk, part);
      break;
    case KILN_F16:
      if (wide)
        col_sums_part<__half, 8><<<grid, blk, 0, d->stream>>>((const __half *)A->data, M, K, A->strides[1], chunk,
                                                              part);
      else
        col_sums_part<__half, 4><<<grid, blk, 0, d->stream>>>((const __half *)A->data, M, K, A->strides[1], chunk,
                                                              part);
      break;
    default:
      col_sums_part<float, 4><<<grid, blk, 0, d->stream>>>((const float *)A->data, M, K, A->strides[1], chunk, part);
      break;
    }
    st = kiln__cuda_launched("matmul row sums (partials)");
  }
  if (st == KILN_OK) {
    const unsigned blocks = (unsigned)((M + 31) / 32);
    switch (R->dtype) {
    case KILN_BF16:
      col_sums_finish<__nv_bfloat16><<<blocks, dim3(32, 8), 0, d->stream>>>(part, chunks, M, (__nv_bfloat16 *)R->data,
                                                                          R->strides[0]);
      break;
    case KILN_F16:
      col_sums_finish<__half><<<blocks, dim3(32, 8), 0, d->stream>>>(part, chunks, M, (__half *)R->data, R->strides[0]);
      break;
    default:
      col_sums_finish<float><<<blocks, dim3(32, 8), 0, d->stream>>>(part, chunks, M, (float *)R->data, R->strides[0]);
      break;
    }
    st = kiln__cuda_launched("matmul row sums");
  }
  kiln__cuda_free(device, part, bytes); /* stream-ordered reuse */
  return st;
}

kiln_status launch_row_sums(kiln__cuda_dev *d, int device, const kiln__view *A, const kiln__view *R) {
  const int64_t M = A->shape[0], K = A->shape[1];
  if (M == 0) return KILN_OK;
  if (K > 0 && col_sums_fit(A, R)) return col_sums(d, device, A, R);
  int blocks = kc_blocks(M, KC_THREADS, d->sm_count);
  if (R->dtype != A->dtype) { /* wide: 16-bit A, f32 sums (the f32 accumulator unrounded) */
    if (R->dtype != KILN_F32)
      return kiln_set_error(KILN_ERR_DTYPE, "kiln_matmul: row sums of %s into %s", kiln_dtype_name(A->dtype),
                            kiln_dtype_name(R->dtype));
    KC_SWITCH_FLOAT(A->dtype, T,
                    return kiln_set_error(KILN_ERR_DTYPE, "kiln_matmul: row sums of %s", kiln_dtype_name(A->dtype)),
                    row_sums<T, float><<<blocks, KC_THREADS, 0, d->stream>>>(
                        (const T *)A->data, M, K, A->strides[0], A->strides[1], (float *)R->data, R->strides[0]))
    return kiln__cuda_launched("matmul row sums");
  }
  KC_SWITCH_FLOAT(R->dtype, T,
                  return kiln_set_error(KILN_ERR_DTYPE, "kiln_matmul: row sums of %s", kiln_dtype_name(R->dtype)),
                  row_sums<T, T><<<blocks, KC_THREADS, 0, d->stream>>>((const T *)A->data, M, K, A->strides[0],
                                                                       A->strides[1], (T *)R->data, R->strides[0]))
  return kiln__cuda_launched("matmul row sums");
}

/* Frees temporaries when the call returns (stream order keeps it safe). */
struct Temps {
  int device;
  void *p[3] = {NULL, NULL, NULL};
  Temps(int dev) : device(dev) {}
  ~Temps() {
    for (void *q : p)
      if (q) kiln__cuda_free(device, q, 0);
  }
};

} // namespace

/* Whether the large 16-bit 2-D products go through cuBLASLt plans (KILN_CUDA_LT_PLAIN=0:
** cuBLAS's strided-batched call, the A/B). Read at each such call, last in its condition:
** not on every MATMUL. */
static bool lt_plain_on(void) {
  return kiln__knob_on("KILN_CUDA_LT_PLAIN", true);
}

/* f16/bf16 operands with an f32 output, no bias (see the top) */
static bool is_wide(const kiln__kargs *a) {
  kiln_dtype in = a->in[0].dtype;
  return a->out[0].dtype == KILN_F32 && (in == KILN_F16 || in == KILN_BF16) && a->in[1].dtype == in &&
         !kiln__mm_bias(a);
}

extern "C" bool kiln__cuda_matmul_supports(const kiln__kargs *a) {
  kiln_dtype dt = a->out[0].dtype;
  const bool wide = is_wide(a);
  if (!kc_is_float(dt) || ((a->in[0].dtype != dt || a->in[1].dtype != dt) && !wide)) return false;
  const kiln__view *bias = kiln__mm_bias(a), *mask = kiln__mm_mask(a);
  if ((bias && !kc_is_float(bias->dtype)) || (mask && mask->dtype != a->in[0].dtype)) return false;
  return a->out[0].ndim >= 2 && a->in[0].ndim == a->out[0].ndim && a->in[1].ndim == a->out[0].ndim;
}

extern "C" kiln_status kiln__cuda_matmul(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  if (!kiln__cuda_matmul_supports(a))
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_matmul: dtypes %s @ %s -> %s not supported on cuda",
                          kiln_dtype_name(a->in[0].dtype), kiln_dtype_name(a->in[1].dtype),
                          kiln_dtype_name(a->out[0].dtype));
  const int device = a->device;
  kiln__view A = a->in[0], B = a->in[1];
  const kiln__view *O = &a->out[0];
  const int nd = O->ndim, nb = nd - 2;
  const int64_t M = O->shape[nd - 2], N = O->shape[nd - 1], K = A.shape[nd - 1];
  if (A.shape[nd - 2] != M || B.shape[nd - 2] != K || B.shape[nd - 1] != N)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_matmul: (%lld x %lld) @ (%lld x %lld) -> (%lld x %lld)",
                          (long long)A.shape[nd - 2], (long long)K, (long long)B.shape[nd - 2],
                          (long long)B.shape[nd - 1], (long long)M, (long long)N);
  int64_t batch = 1;
  for (int i = 0; i < nb; i++) {
    if (A.shape[i] != O->shape[i] || B.shape[i] != O->shape[i])
      return kiln_set_error(KILN_ERR_SHAPE, "kiln_matmul: batch dim %d differs", i);
    batch *= O->shape[i];
  }
  const bool has_bias = kiln__mm_bias(a) != NULL;
  const bool row_sum = a->n_out > 1; /* out1 = A's row sums (a bias gradient), 2-d only */
  const kiln__view *mask = kiln__mm_mask(a);
  if (mask && (mask->ndim != nd || memcmp(mask->shape, A.shape, sizeof(int64_t) * (size_t)nd) != 0))
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_matmul: the mask of A has another shape");
  /* small problems: one launch of the tiled kernel (strided operands as they are; the mask
  ** and the ReLU inside it) */
  int64_t sa = 0, sb = 0, sc = 0, sm = 0;
  const bool wide = is_wide(a); /* the tiled kernel stores in A's dtype: wide goes to cuBLAS */
  const bool small = !wide && kiln__cuda_matmul_small_fits(batch, M, N, K) && (!row_sum || batch == 1) &&
                     (!has_bias || a->in[2].dtype == O->dtype) && batch_stride(&A, nb, &sa) &&
                     batch_stride(&B, nb, &sb) && batch_stride(O, nb, &sc) &&
                     (!mask || batch_stride(mask, nb, &sm));
  if ((a->i[1] & 3) && !small) { /* elsewhere: mask into a temporary, ReLU after, by kernels */
    kiln__kargs k = *a;
    k.i[1] = 0;
    Temps tmp(device);
    if (mask) {
      k.n_in--;
      tmp.p[0] = kiln__cuda_alloc(device, (size_t)kc_numel(&A) * kc_size(A.dtype));
      if (!tmp.p[0]) return kiln_last_error();
      kiln__kargs r = {};
      r.op = KILN__K_RELU_BACKWARD; /* where(mask > 0, A, 0) */
      r.device = device;
      r.n_in = 2;
      r.n_out = 1;
      r.in[0] = *mask;
      r.in[1] = A;
      r.out[0] = contiguous_like(&A, tmp.p[0]);
      if (nd == 2 && A.strides[0] == 1 && A.shape[1] > 1 && A.dtype != KILN_F64) {
        /* A transposed view (a weight gradient's g^T) stays transposed in the temporary:
        ** cuBLASLt has BGRADB kernels (the bias gradient fused) with cuBLAS's B, kiln's A,
        ** transposed (TransformerEngine's wgrad layout), none with it plain: on the H200
        ** "took no BGRADB epilogue for bfloat16 256x784x128 (op NN)", and for float32 too,
        ** each a separate row-sums kernel per step. With the layout kept, bf16 took it
        ** (16:05 run: no message); f32 asks for it the same way. */
        r.out[0].strides[0] = 1;
        r.out[0].strides[1] = A.shape[0];
      }
      KC_TRY(kiln__cuda_elementwise(&r));
      k.in[0] = r.out[0];
    }
    KC_TRY(kiln__cuda_matmul(&k));
    if (!(a->i[1] & 1)) return KILN_OK;
    kiln__kargs r = {};
    r.op = KILN__K_RELU;
    r.device = device;
    r.n_in = r.n_out = 1;
    r.in[0] = r.out[0] = *O;
    return kiln__cuda_elementwise(&r);
  }
  if (row_sum && (nb != 0 || has_bias || a->out[1].ndim != 1 || a->out[1].shape[0] != M ||
                  a->out[1].dtype != O->dtype))
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_matmul: row sums want a 2-d product without bias and an (M) output of its dtype");
  const double alpha = a->s[0], beta = a->s[1];
  if (batch == 0 || M == 0 || N == 0) return row_sum ? launch_row_sums(d, device, &A, &a->out[1]) : KILN_OK;
  if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_matmul: a dim over 2^31 is not supported on cuda");

  /* out (bias added below) */
  kiln__view bias_b;
  if (has_bias) {
    const kiln__view *bv = &a->in[2];
    bias_b = *O;
    bias_b.data = bv->data;
    bias_b.dtype = bv->dtype;
    for (int i = 0; i < nd; i++) bias_b.strides[i] = 0;
    bias_b.strides[nd - 1] = bv->ndim > 0 ? bv->strides[bv->ndim - 1] : 0;
  }
  if (K == 0) {
    if (beta == 0.0) KC_TRY(kiln__cuda_fill_view(device, O, 0.0));
    else if (beta != 1.0) KC_TRY(kiln__cuda_scale_view(device, O, beta));
    if (has_bias) KC_TRY(kiln__cuda_add_view(device, O, &bias_b));
    return row_sum ? launch_row_sums(d, device, &A, &a->out[1]) : KILN_OK;
  }
  if (small) return kiln__cuda_matmul_small(d, a, A, B, *O, batch, sa, sb, sc, sm);
  KC_TRY(handles(device, d));
  KC_TRY(kiln__cuda_capture_note(device, d->workspace, d->workspace_size)); /* cuBLAS's scratch */
  kc_blas_types t; /* A's and B's data type and the compute type; C's below */
  kc_blas_types_of(A.dtype, a->i[0] == 1, &t);
  kc_blas_types tc;
  kc_blas_types_of(O->dtype, a->i[0] == 1, &tc);
  const size_t es = kc_size(A.dtype), esc = kc_size(O->dtype); /* A and B; C */
  Temps tmp(device);

  Mat ma, mb, mc;
  if (!describe(M, K, A.strides[nd - 2], A.strides[nd - 1], &ma)) {
    tmp.p[0] = kiln__cuda_alloc(device, (size_t)kc_numel(&A) * es);
    if (!tmp.p[0]) return kiln_last_error();
    kiln__view c = contiguous_like(&A, tmp.p[0]);
    KC_TRY(kiln__cuda_copy_view(device, &c, &A));
    A = c;
    describe(M, K, A.strides[nd - 2], A.strides[nd - 1], &ma);
  }
  if (!describe(K, N, B.strides[nd - 2], B.strides[nd - 1], &mb)) {
    tmp.p[1] = kiln__cuda_alloc(device, (size_t)kc_numel(&B) * es);
    if (!tmp.p[1]) return kiln_last_error();
    kiln__view c = contiguous_like(&B, tmp.p[1]);
    KC_TRY(kiln__cuda_copy_view(device, &c, &B));
    B = c;
    describe(K, N, B.strides[nd - 2], B.strides[nd - 1], &mb);
  }
  kiln__view C = *O;
  bool out_tmp = !describe(M, N, C.strides[nd - 2], C.strides[nd - 1], &mc) || mc.trans;
  if (out_tmp) {
    tmp.p[2] = kiln__cuda_alloc(device, (size_t)kc_numel(O) * esc);
    if (!tmp.p[2]) return kiln_last_error();
    C = contiguous_like(O, tmp.p[2]);
    if (beta != 0.0) KC_TRY(kiln__cuda_copy_view(device, &C, O));
    describe(M, N, C.strides[nd - 2], C.strides[nd - 1], &mc);
  }
  cublasOperation_t opA = ma.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t opB = mb.trans ? CUBLAS_OP_T : CUBLAS_OP_N;
  float af = (float)alpha, bf = (float)beta;
  const void *pa = t.f64 ? (const void *)&alpha : (const void *)&af;
  const void *pb = t.f64 ? (const void *)&beta : (const void *)&bf;
  cublasHandle_t h = (cublasHandle_t)d->blas;

  bool gemm_done = false, sums_done = false;
  /* The bias gradient by col_sums after the product where it fits (16-bit rows in eights
  ** read 16 bytes a lane), rather than cuBLASLt's BGRADB epilogue, whose helper kernel read
  ** GPT-2's gradients at 1.5-2 TB/s (bench/RESULTS.md); KILN_CUDA_BGRAD=lt takes the
  ** epilogue (the A/B; read once). */
  static const bool lt_bgrad = kiln__knob_choice("KILN_CUDA_BGRAD", 0) == 1; /* kiln, lt */
  const bool own_sums = !lt_bgrad && col_sums_fit(&A, &a->out[1]);
  if (row_sum && !own_sums && !t.f64 && !out_tmp && bf == 0.0f && (a->out[1].strides[0] == 1 || M == 1)) {
    kiln_status s = kc_lt_matmul(d, CUBLASLT_EPILOGUE_BGRADB, t, tc.data, opB, opA, M, N, K, B.data, mb.ld, A.data,
                                   ma.ld, C.data, mc.ld, a->out[1].data, af, bf);
    if (s == KILN_OK) sums_done = gemm_done = true;
    else if (s != KILN_ERR_UNSUPPORTED) return s;
  }
  if (has_bias && batch == 1 && !t.f64 && !out_tmp && a->in[2].dtype == O->dtype &&
      a->in[2].ndim >= 1 && a->in[2].shape[a->in[2].ndim - 1] == N &&
      (a->in[2].strides[a->in[2].ndim - 1] == 1 || N == 1)) {
    /* the epilogue reads N contiguous bias values (a broadcast scalar bias goes below) */
    kiln_status s = kc_lt_matmul(d, CUBLASLT_EPILOGUE_BIAS, t, tc.data, opB, opA, M, N, K, B.data, mb.ld, A.data,
                                   ma.ld, C.data, mc.ld, a->in[2].data, af, bf);
    if (s == KILN_OK) gemm_done = true;
    else if (s != KILN_ERR_UNSUPPORTED) return s;
  }
  if (!gemm_done && !has_bias && batch == 1 && (t.data == CUDA_R_16BF || t.data == CUDA_R_16F) && !out_tmp &&
      bf == 0.0f && 2.0 * M * N * K >= kc_lt_tune_flops && lt_plain_on()) {
    /* a large 16-bit product through cuBLASLt, whose algorithm lt_tune times (the
    ** strided-batched call below takes cuBLAS's pick; KILN_CUDA_LT_PLAIN=0 keeps it
    ** there: the A/B); the same plan with or without KILN_CUDA_LT_TUNE=0, so that switch
    ** changes no number */
    kiln_status s = kc_lt_matmul(d, CUBLASLT_EPILOGUE_DEFAULT, t, tc.data, opB, opA, M, N, K, B.data, mb.ld, A.data,
                                   ma.ld, C.data, mc.ld, NULL, af, bf);
    if (s == KILN_OK) gemm_done = true;
    else if (s != KILN_ERR_UNSUPPORTED) return s;
  }
  if (!gemm_done) {
    /* The batch dims [lo, nb) that collapse to one stride in A, B and C go into one
    ** strided-batched call; the dims before lo are looped over. Attention's q @ k^T has
    ** batch dims (B, H) of a permuted (B, T, H, D) tensor: H collapses (stride D), B
    ** does not, so B calls of H products each, where it was once B * H calls of one. */
    int lo = 0;
    int64_t sa = 0, sb = 0, sc = 0, inner = 1;
    while (lo < nb && !(batch_stride_from(&A, lo, nb, &sa) && batch_stride_from(&B, lo, nb, &sb) &&
                        batch_stride_from(&C, lo, nb, &sc)))
      lo++;
    for (int i = lo; i < nb; i++) inner *= O->shape[i];
    if (lo == nb || inner > INT32_MAX) { /* one product a call */
      lo = nb;
      inner = 1;
      sa = sb = sc = 0;
    }
    const int64_t outer = batch / inner;
    for (int64_t b = 0; b < outer; b++) {
      const char *pA = (const char *)A.data + batch_offset(&A, lo, b) * (int64_t)es;
      const char *pB = (const char *)B.data + batch_offset(&B, lo, b) * (int64_t)es;
      char *pC = (char *)C.data + batch_offset(&C, lo, b) * (int64_t)esc;
      KC_BLAS(cublasGemmStridedBatchedEx(h, opB, opA, (int)N, (int)M, (int)K, pa, pB, t.data,
                                         (int)mb.ld, sb, pA, t.data, (int)ma.ld, sa, pb, pC,
                                         tc.data, (int)mc.ld, sc, (int)inner, t.compute,
                                         CUBLAS_GEMM_DEFAULT),
              "cublasGemmStridedBatchedEx");
    }
    if (has_bias) {
      kiln__view bb = bias_b;
      KC_TRY(kiln__cuda_add_view(device, &C, &bb));
    }
  }
  if (out_tmp) KC_TRY(kiln__cuda_copy_view(device, O, &C));
  if (!row_sum || sums_done) return KILN_OK;
  static bool told; /* KILN_PROFILE: say once that the fused bias gradient was not had */
  const char *prof = getenv("KILN_PROFILE");
  if (!told && !own_sums && prof && strcmp(prof, "0") != 0) {
    told = true;
    fprintf(stderr, "kiln profile: cuBLASLt took no BGRADB epilogue for %s %lldx%lldx%lld (op %c%c); the bias gradient is a separate kernel\n",
            kiln_dtype_name(O->dtype), (long long)M, (long long)N, (long long)K, opA == CUBLAS_OP_T ? 'T' : 'N',
            opB == CUBLAS_OP_T ? 'T' : 'N');
  }
  return launch_row_sums(d, device, &A, &a->out[1]);
}

/* ---- LINEAR_GELU: y = gelu_tanh(A@B + bias), z = A@B + bias (backend.h) ----------------
** One cuBLASLt call with the GELU_AUX(_BIAS) epilogue: the GEMM's f32 result (+ bias)
** goes to aux rounded to the dtype, and its GELU to C, so neither the bias add nor the
** GELU is a pass over memory of its own (GPT-2's c_fc: (16384, 3072) twice). cuBLASLt's
** GELU is the tanh form (PyTorch's _addmm_activation relies on the same), which GPT-2
** uses; the f32 case of tests/test_cuda_gptfuse.c tells it from the erf form. Where the
** epilogue cannot run (operands cuBLAS does not take as they are, rows off 16 bytes,
** no algorithm) the product goes through kiln__cuda_matmul into z and a GELU_TANH kernel
** reads z: the same contract, two passes. With n_out 1 (a call that records no node: z is
** not needed) the GELU(_BIAS) epilogue writes y alone, or the product goes into y and
** the GELU runs on it in place. Kept apart from kiln__cuda_matmul so that the MATMUL path
** stays as it is. */
extern "C" bool kiln__cuda_linear_gelu_supports(const kiln__kargs *a) {
  kiln_dtype dt = a->out[0].dtype;
  if (dt != KILN_F32 && dt != KILN_F16 && dt != KILN_BF16) return false;
  if (a->n_in < 2 || a->n_in > 3 || a->n_out < 1 || a->n_out > 2) return false;
  if (a->in[0].dtype != dt || a->in[1].dtype != dt || (a->n_out == 2 && a->out[1].dtype != dt)) return false;
  if (a->n_in == 3 && (a->in[2].dtype != dt || a->in[2].ndim != 1)) return false;
  return a->in[0].ndim == 2 && a->in[1].ndim == 2 && a->out[0].ndim == 2 && (a->n_out == 1 || a->out[1].ndim == 2);
}

extern "C" kiln_status kiln__cuda_linear_gelu(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  if (!kiln__cuda_linear_gelu_supports(a))
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_linear_gelu: dtypes %s @ %s -> %s not supported on cuda",
                          kiln_dtype_name(a->in[0].dtype), kiln_dtype_name(a->in[1].dtype),
                          kiln_dtype_name(a->out[0].dtype));
  const bool has_z = a->n_out == 2; /* else y alone */
  const kiln__view &A = a->in[0], &B = a->in[1], &Y = a->out[0], &Z = a->out[has_z ? 1 : 0];
  const int64_t M = A.shape[0], K = A.shape[1], N = B.shape[1];
  if (B.shape[0] != K || Y.shape[0] != M || Y.shape[1] != N || Z.shape[0] != M || Z.shape[1] != N ||
      (a->n_in == 3 && a->in[2].shape[0] != N))
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_linear_gelu: (%lld x %lld) @ (%lld x %lld) -> (%lld x %lld)",
                          (long long)M, (long long)K, (long long)B.shape[0], (long long)N,
                          (long long)Y.shape[0], (long long)Y.shape[1]);
  if (M == 0 || N == 0) return KILN_OK;
  const bool has_bias = a->n_in == 3;
  const size_t es = kc_size(Y.dtype);
  Mat ma, mb, my, mz;
  /* the epilogue where cuBLASLt takes the operands as they are: A and B describable, Y
  ** and Z row-major with one ld (the plan's C and aux), 16-byte rows and base pointers */
  bool fused = K > 0 && M <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX &&
               describe(M, K, A.strides[0], A.strides[1], &ma) && describe(K, N, B.strides[0], B.strides[1], &mb) &&
               describe(M, N, Y.strides[0], Y.strides[1], &my) && !my.trans &&
               describe(M, N, Z.strides[0], Z.strides[1], &mz) && !mz.trans && my.ld == mz.ld &&
               (!has_bias || a->in[2].strides[0] == 1 || N == 1);
  if (fused) {
    const int64_t al = (int64_t)(16 / es);
    const void *ptrs[5] = {A.data, B.data, Y.data, Z.data, has_bias ? a->in[2].data : NULL};
    for (int i = 0; i < 5; i++) fused = fused && ((uintptr_t)ptrs[i] % 16) == 0;
    fused = fused && ma.ld % al == 0 && mb.ld % al == 0 && my.ld % al == 0;
  }
  if (fused) {
    KC_TRY(handles(a->device, d));
    KC_TRY(kiln__cuda_capture_note(a->device, d->workspace, d->workspace_size));
    kc_blas_types t;
    kc_blas_types_of(Y.dtype, a->i[0] == 1, &t);
    const cublasLtEpilogue_t epi = has_z ? (has_bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX)
                                         : (has_bias ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_GELU);
    kiln_status s = kc_lt_matmul(d, epi, t, t.data, mb.trans ? CUBLAS_OP_T : CUBLAS_OP_N,
                                 ma.trans ? CUBLAS_OP_T : CUBLAS_OP_N, M, N, K, B.data, mb.ld, A.data, ma.ld, Y.data,
                                 my.ld, has_bias ? a->in[2].data : NULL, 1.0f, 0.0f, has_z ? Z.data : NULL);
    if (s != KILN_ERR_UNSUPPORTED) return s;
  }
  kiln__kargs m = {};
  m.op = KILN__K_MATMUL;
  m.device = a->device;
  m.n_in = has_bias ? 3 : 2;
  m.in[0] = A;
  m.in[1] = B;
  if (has_bias) m.in[2] = a->in[2];
  m.n_out = 1;
  m.out[0] = Z;
  m.s[0] = 1.0;
  m.i[0] = a->i[0];
  KC_TRY(kiln__cuda_matmul(&m));
  kiln__kargs g = {};
  g.op = KILN__K_GELU_TANH;
  g.device = a->device;
  g.n_in = g.n_out = 1;
  g.in[0] = Z;
  g.out[0] = Y;
  return kiln__cuda_elementwise(&g);
}

/* ---- MATMUL_DGELU: dz = (A@B) * gelu_tanh'(z) (backend.h) ------------------------------
** GPT-2's MLP backward: the c_proj input gradient dh = g W2 (16384, 3072) and the GELU's
** backward on it in one cuBLASLt call (DGELU epilogue, z as aux): no dh tensor written and
** read again. The product is not rounded to the dtype before the GELU's derivative
** multiplies it (the composed path rounds it once more). Where cuBLASLt cannot take the
** operands (or has no algorithm) kiln__cuda_matmul into a temporary and a
** GELU_TANH_BACKWARD kernel: the contract, two passes. */
extern "C" bool kiln__cuda_matmul_dgelu_supports(const kiln__kargs *a) {
  kiln_dtype dt = a->out[0].dtype;
  if (dt != KILN_F32 && dt != KILN_F16 && dt != KILN_BF16) return false;
  if (a->n_in != 3 || a->n_out != 1) return false;
  for (int i = 0; i < 3; i++)
    if (a->in[i].dtype != dt || a->in[i].ndim != 2) return false;
  return a->out[0].ndim == 2;
}

extern "C" kiln_status kiln__cuda_matmul_dgelu(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  if (!kiln__cuda_matmul_dgelu_supports(a))
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_matmul_dgelu: dtypes %s @ %s -> %s not supported on cuda",
                          kiln_dtype_name(a->in[0].dtype), kiln_dtype_name(a->in[1].dtype),
                          kiln_dtype_name(a->out[0].dtype));
  const kiln__view &A = a->in[0], &B = a->in[1], &Z = a->in[2], &O = a->out[0];
  const int64_t M = A.shape[0], K = A.shape[1], N = B.shape[1];
  if (B.shape[0] != K || O.shape[0] != M || O.shape[1] != N || Z.shape[0] != M || Z.shape[1] != N)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_matmul_dgelu: (%lld x %lld) @ (%lld x %lld) with z (%lld x %lld)",
                          (long long)M, (long long)K, (long long)B.shape[0], (long long)N, (long long)Z.shape[0],
                          (long long)Z.shape[1]);
  if (M == 0 || N == 0) return KILN_OK;
  const size_t es = kc_size(O.dtype);
  Mat ma, mb, mo, mz;
  bool fused = K > 0 && M <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX &&
               describe(M, K, A.strides[0], A.strides[1], &ma) && describe(K, N, B.strides[0], B.strides[1], &mb) &&
               describe(M, N, O.strides[0], O.strides[1], &mo) && !mo.trans &&
               describe(M, N, Z.strides[0], Z.strides[1], &mz) && !mz.trans && mo.ld == mz.ld;
  if (fused) {
    const int64_t al = (int64_t)(16 / es);
    const void *ptrs[4] = {A.data, B.data, O.data, Z.data};
    for (int i = 0; i < 4; i++) fused = fused && ((uintptr_t)ptrs[i] % 16) == 0;
    fused = fused && ma.ld % al == 0 && mb.ld % al == 0 && mo.ld % al == 0;
  }
  if (fused) {
    KC_TRY(handles(a->device, d));
    KC_TRY(kiln__cuda_capture_note(a->device, d->workspace, d->workspace_size));
    kc_blas_types t;
    kc_blas_types_of(O.dtype, a->i[0] == 1, &t);
    kiln_status s = kc_lt_matmul(d, CUBLASLT_EPILOGUE_DGELU, t, t.data, mb.trans ? CUBLAS_OP_T : CUBLAS_OP_N,
                                   ma.trans ? CUBLAS_OP_T : CUBLAS_OP_N, M, N, K, B.data, mb.ld, A.data, ma.ld, O.data,
                                   mo.ld, NULL, 1.0f, 0.0f, (void *)Z.data);
    if (s != KILN_ERR_UNSUPPORTED) return s;
  }
  /* composed: dh = A@B into a temporary (contiguous (M, N)), then dz = gelu'(z) dh */
  void *tmp = kiln__cuda_alloc(a->device, (size_t)(M * N) * es);
  if (!tmp) return kiln_last_error();
  kiln__kargs m = {};
  m.op = KILN__K_MATMUL;
  m.device = a->device;
  m.n_in = 2;
  m.in[0] = A;
  m.in[1] = B;
  m.n_out = 1;
  m.out[0] = contiguous_like(&O, tmp);
  m.s[0] = 1.0;
  m.i[0] = a->i[0];
  kiln_status st = kiln__cuda_matmul(&m);
  if (st == KILN_OK) {
    kiln__kargs g = {};
    g.op = KILN__K_GELU_TANH_BACKWARD;
    g.device = a->device;
    g.n_in = 2;
    g.n_out = 1;
    g.in[0] = Z;
    g.in[1] = m.out[0];
    g.out[0] = O;
    st = kiln__cuda_elementwise(&g);
  }
  kiln__cuda_free(a->device, tmp, 0); /* stream-ordered reuse */
  return st;
}
