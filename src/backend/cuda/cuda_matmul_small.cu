/*
** Small products (MATMUL up to kSmallMacs multiply-adds, K <= 512): kiln's own kernels,
** one launch each, in place of cuBLAS(Lt).
**
** cuBLAS(Lt) picks split-K kernels for a small model's products (128x128x64 and smaller):
** two or three launches of 3-10 us each, plus 9-12 us of host time in cublasLtMatmul.
** These kernels take any strides (no contiguous temporaries) and fuse MATMUL's extras:
** the bias, the ReLU of the output (flag 1), A read through a ReLU mask (flag 2) and A's
** row sums (out1, a bias gradient). Arithmetic is the exact FMA of the compute type, as
** cuBLAS's SIMT kernels do; only the order of the sums differs.
**
** Three shapes, each a different bottleneck (a small product's time is the latency of
** its loads and of its dependent arithmetic, not its FLOPs):
**   tiny K (K <= 16: a gradient through a classifier head, (M, 2) @ (2, N)): one output a
**     thread, operands straight from L1/L2, no shared memory and no barrier;
**   thin (one output dim <= 8: a head's forward (M, K) @ (K, 2), its weight gradient
**     (2, M) @ (M, N)): the other operand's K x 8 panel in shared memory, K split across
**     lanes or warps and reduced, so no thread walks all of K alone;
**   the rest: 16x16 output tiles, K in slices of 64 with the next slice's loads in flight.
** The thin kernel wants the small dim as N; an (M <= 8, N) product is computed as its
** transpose, C^T = B^T A^T, by swapping strides (A's row sums become B's column sums).
*/
#include "cuda_int.cuh"

namespace {

const double kSmallMacs = 4194304.0; /* 2^22 */
const int kSmallMaxK = 512;          /* a longer K: cuBLAS splits it better */

/* ---- tiny K -------------------------------------------------------------------------- */

const int kTinyK = 16;

template <class T>
__global__ void __launch_bounds__(256)
    tinyk_gemm(const T *__restrict__ A, int64_t am, int64_t ak, int64_t sa, const T *__restrict__ B,
               int64_t bk, int64_t bn, int64_t sb, T *C, int64_t cm, int64_t cn, int64_t sc, int M,
               int N, int K, typename kc_traits<T>::acc alpha, typename kc_traits<T>::acc beta,
               const T *__restrict__ bias, int64_t sbias, T *rowsum, int64_t srow,
               const T *__restrict__ mask, int64_t mm, int64_t mk, int64_t smask, int relu,
               int n_fast) {
  typedef typename kc_traits<T>::acc Acc;
  A += (int64_t)blockIdx.z * sa;
  B += (int64_t)blockIdx.z * sb;
  C += (int64_t)blockIdx.z * sc;
  if (mask) mask += (int64_t)blockIdx.z * smask;
  const int64_t total = (int64_t)M * N;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    /* neighbouring threads take neighbouring outputs along C's unit-stride dim */
    const int m = n_fast ? (int)(i / N) : (int)(i % M), n = n_fast ? (int)(i % N) : (int)(i / M);
    const Acc bv = bias ? (Acc)kc_ld<T>(bias[n * sbias]) : (Acc)0; /* in flight with the rest */
    Acc acc = 0, rs = 0;
#pragma unroll 4
    for (int k = 0; k < K; k++) { /* the mask's load beside A's, not behind it */
      Acc a = (Acc)kc_ld<T>(A[m * am + k * ak]);
      if (mask && !((Acc)kc_ld<T>(mask[m * mm + k * mk]) > (Acc)0)) a = 0;
      rs += a;
      acc += a * (Acc)kc_ld<T>(B[k * bk + n * bn]);
    }
    Acc v = alpha * acc + bv;
    T *c = C + m * cm + n * cn;
    if (beta != (Acc)0) v += beta * (Acc)kc_ld<T>(*c);
    if (relu && !(v > (Acc)0)) v = v != v ? v : (Acc)0; /* ReLU keeps NaN, as kiln_relu */
    *c = kc_st<T>(v);
    if (rowsum && n == 0) rowsum[m * srow] = kc_st<T>(rs);
  }
}

/* ---- thin: N <= 8 -------------------------------------------------------------------- */

const int kThinN = 8;
const int kThinG = 8; /* A's loads a thread issues together: one wait for 8, not 8 in turn */

/* a[u] = A[m, k + step u] (through the mask when there is one), 0 at or past k_end */
template <class T>
__device__ __forceinline__ void thin_load(typename kc_traits<T>::acc *a, const T *__restrict__ A,
                                          const T *__restrict__ mask, int m, int k, int step,
                                          int k_end, int64_t am, int64_t ak, int64_t ms0, int64_t ms1) {
  typedef typename kc_traits<T>::acc Acc;
  Acc mv[kThinG];
#pragma unroll
  for (int u = 0; u < kThinG; u++) {
    const int kk = k + step * u;
    a[u] = kk < k_end ? (Acc)kc_ld<T>(A[m * am + kk * ak]) : (Acc)0;
    mv[u] = mask && kk < k_end ? (Acc)kc_ld<T>(mask[m * ms0 + kk * ms1]) : (Acc)1;
  }
#pragma unroll
  for (int u = 0; u < kThinG; u++)
    if (!(mv[u] > (Acc)0)) a[u] = 0;
}

/* C (M, N <= 8) = A (M, K) B (K, N). B's panel goes to shared memory once per block. With
** lanes_k (A's K is its unit-stride dim) a warp takes a row of C, its lanes split K and a
** shuffle sums them; otherwise a thread takes a row (neighbouring threads, neighbouring
** rows: coalesced when A's rows are) and the block's 8 warps split K, summed through
** shared memory. The mask reads through A (mask_b 0) or B (mask_b 1); sums are A's row
** sums (sums_b 0) or B's column sums (sums_b 1); the bias runs along n or, for a
** transposed problem, along m (bias_m). */
template <class T>
__global__ void __launch_bounds__(256)
    thin_gemm(const T *__restrict__ A, int64_t am, int64_t ak, int64_t sa, const T *__restrict__ B,
              int64_t bk, int64_t bn, int64_t sb, T *C, int64_t cm, int64_t cn, int64_t sc, int M,
              int N, int K, typename kc_traits<T>::acc alpha, typename kc_traits<T>::acc beta,
              const T *__restrict__ bias, int64_t sbias, int bias_m, T *sums, int64_t ss, int sums_b,
              const T *__restrict__ mask, int64_t ms0, int64_t ms1, int64_t smask, int mask_b,
              int relu, int lanes_k) {
  typedef typename kc_traits<T>::acc Acc;
  /* B's panel while computing; the warps' partial sums after (the panel is dead by then) */
  __shared__ Acc buf[kSmallMaxK * kThinN];
  A += (int64_t)blockIdx.z * sa;
  B += (int64_t)blockIdx.z * sb;
  C += (int64_t)blockIdx.z * sc;
  if (mask) mask += (int64_t)blockIdx.z * smask;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  {
    /* every load of the panel issued before any is used: one wait, not one per pass */
    enum { PER = kSmallMaxK * kThinN / 256 };
    const bool k_fast = bk == 1 && bn != 1; /* walk B's unit-stride dim with the thread index */
    const bool mb = mask && mask_b;
    Acc pv[PER], pm[PER];
#pragma unroll
    for (int u = 0; u < PER; u++) {
      const int e = threadIdx.x + 256 * u;
      const int k = k_fast ? e % K : e / kThinN, n = k_fast ? e / K : e % kThinN;
      const bool in = e < K * kThinN && n < N;
      pv[u] = in ? (Acc)kc_ld<T>(B[k * bk + n * bn]) : (Acc)0;
      pm[u] = in && mb ? (Acc)kc_ld<T>(mask[k * ms0 + n * ms1]) : (Acc)1;
    }
#pragma unroll
    for (int u = 0; u < PER; u++) {
      const int e = threadIdx.x + 256 * u;
      const int k = k_fast ? e % K : e / kThinN, n = k_fast ? e / K : e % kThinN;
      if (e < K * kThinN) buf[k * kThinN + n] = pm[u] > (Acc)0 ? pv[u] : (Acc)0;
    }
  }
  __syncthreads();
  if (sums && sums_b && blockIdx.x == 0 && warp < N) { /* warp n sums column n */
    Acc s = 0;
    for (int k = lane; k < K; k += 32) s += buf[k * kThinN + warp];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) sums[warp * ss] = kc_st<T>(s);
  }
  const bool a_sums = sums && !sums_b;
  /* the bias along n, loaded now so that its latency hides behind the product's */
  Acc bn_v[kThinN];
#pragma unroll
  for (int j = 0; j < kThinN; j++) bn_v[j] = bias && !bias_m && j < N ? (Acc)kc_ld<T>(bias[j * sbias]) : (Acc)0;
  Acc acc[kThinN], rs = 0;
#pragma unroll
  for (int j = 0; j < kThinN; j++) acc[j] = 0;
  int m;
  if (lanes_k) {
    m = blockIdx.x * 8 + warp;
    if (m < M)
      for (int k0 = lane; k0 < K; k0 += 32 * kThinG) {
        Acc a[kThinG];
        thin_load<T>(a, A, mask_b ? NULL : mask, m, k0, 32, K, am, ak, ms0, ms1);
#pragma unroll
        for (int u = 0; u < kThinG; u++) {
          rs += a[u];
#pragma unroll
          for (int j = 0; j < kThinN; j++)
            acc[j] += a[u] * (k0 + 32 * u < K ? buf[(k0 + 32 * u) * kThinN + j] : (Acc)0);
        }
      }
#pragma unroll
    for (int j = 0; j < kThinN; j++)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
    if (a_sums)
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) rs += __shfl_xor_sync(0xffffffffu, rs, o);
    if (lane != 0 || m >= M) return; /* lane 0 writes the row */
  } else {
    m = blockIdx.x * 32 + lane;
    const int chunk = (K + 7) / 8, k0 = warp * chunk, k1 = min(K, k0 + chunk);
    if (m < M)
      for (int k = k0; k < k1; k += kThinG) {
        Acc a[kThinG];
        thin_load<T>(a, A, mask_b ? NULL : mask, m, k, 1, k1, am, ak, ms0, ms1);
#pragma unroll
        for (int u = 0; u < kThinG; u++) {
          rs += a[u];
#pragma unroll
          for (int j = 0; j < kThinN; j++) acc[j] += a[u] * (k + u < k1 ? buf[(k + u) * kThinN + j] : (Acc)0);
        }
      }
    __syncthreads(); /* the panel is dead: reuse it for the 8 warps' partial sums */
    Acc *red = buf + (warp * 32 + lane) * (kThinN + 1);
#pragma unroll
    for (int j = 0; j < kThinN; j++) red[j] = acc[j];
    red[kThinN] = rs;
    __syncthreads();
    if (warp != 0 || m >= M) return;
#pragma unroll
    for (int j = 0; j <= kThinN; j++) {
      Acc s = 0;
      for (int w = 0; w < 8; w++) s += buf[(w * 32 + lane) * (kThinN + 1) + j];
      if (j < kThinN) acc[j] = s;
      else rs = s;
    }
  }
  if (a_sums) sums[m * ss] = kc_st<T>(rs);
  const Acc bm = bias && bias_m ? (Acc)kc_ld<T>(bias[m * sbias]) : (Acc)0;
#pragma unroll
  for (int j = 0; j < kThinN; j++) {
    if (j >= N) break;
    T *c = C + m * cm + j * cn;
    Acc v = alpha * acc[j] + (bias_m ? bm : bn_v[j]);
    if (beta != (Acc)0) v += beta * (Acc)kc_ld<T>(*c);
    if (relu && !(v > (Acc)0)) v = v != v ? v : (Acc)0;
    *c = kc_st<T>(v);
  }
}

/* ---- the rest: 16x16 tiles ----------------------------------------------------------- */

/* A 16x16 output tile a block, one output a thread: against 32x32 tiles (four outputs a
** thread) four times the blocks and half the shared-memory reads per SM. Measured on the
** H200 with seed-mlp's products (Nsight Compute, serialised): 4.3-7.9 us against 5.8-10.9,
** and the eager step 84 against 107-112 us. */
const int kSlice = 64, kTile = 16;

template <class T>
__global__ void __launch_bounds__(256)
    small_gemm(const T *__restrict__ A, int64_t am, int64_t ak, int64_t sa, const T *__restrict__ B,
               int64_t bk, int64_t bn, int64_t sb, T *C, int64_t cm, int64_t cn, int64_t sc, int M,
               int N, int K, typename kc_traits<T>::acc alpha, typename kc_traits<T>::acc beta,
               const T *__restrict__ bias, int64_t sbias, T *rowsum, int64_t srow,
               const T *__restrict__ mask, int64_t mm, int64_t mk, int64_t smask, int relu) {
  typedef typename kc_traits<T>::acc Acc;
  /* K in slices of kSlice, the next slice's loads in flight (in registers) while the block
  ** computes on this one: a small product's time is mostly the latency of its loads */
  __shared__ Acc As[kTile][kSlice + 1]; /* [m][k] */
  __shared__ Acc Bs[kSlice][kTile + 1]; /* [k][n] */
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16; /* output (ty, tx) of the tile */
  const int m0 = blockIdx.y * kTile, n0 = blockIdx.x * kTile;
  A += (int64_t)blockIdx.z * sa;
  B += (int64_t)blockIdx.z * sb;
  C += (int64_t)blockIdx.z * sc;
  if (mask) mask += (int64_t)blockIdx.z * smask;
  /* loads walk the operand's unit-stride dim with the thread index (coalesced) */
  const bool a_rows = ak == 1 || am != 1, b_rows = bn == 1 || bk != 1;
  const bool sums = rowsum && blockIdx.x == 0;
  enum { PER = kTile * kSlice / 256 }; /* elements of each operand a thread loads */
  Acc ra[PER], rb[PER], rm[PER];
  auto load = [&](int k0) {
#pragma unroll
    for (int i = 0; i < PER; i++) {
      int e = threadIdx.x + 256 * i;
      int r = a_rows ? e / kSlice : e % kTile, c = a_rows ? e % kSlice : e / kTile; /* (m, k) */
      const bool in = m0 + r < M && k0 + c < K;
      ra[i] = in ? (Acc)kc_ld<T>(A[(m0 + r) * am + (k0 + c) * ak]) : (Acc)0;
      rm[i] = mask && in ? (Acc)kc_ld<T>(mask[(m0 + r) * mm + (k0 + c) * mk]) : (Acc)1; /* beside A's load */
      r = b_rows ? e / kTile : e % kSlice, c = b_rows ? e % kTile : e / kSlice; /* (k, n) */
      rb[i] = (k0 + r < K && n0 + c < N) ? (Acc)kc_ld<T>(B[(k0 + r) * bk + (n0 + c) * bn]) : (Acc)0;
    }
  };
  const int m = m0 + ty, n = n0 + tx;
  const Acc bv = bias && n < N ? (Acc)kc_ld<T>(bias[n * sbias]) : (Acc)0; /* in flight with slice 0 */
  Acc acc = 0, rs = 0;
  load(0);
  for (int k0 = 0; k0 < K; k0 += kSlice) {
#pragma unroll
    for (int i = 0; i < PER; i++) {
      int e = threadIdx.x + 256 * i;
      int r = a_rows ? e / kSlice : e % kTile, c = a_rows ? e % kSlice : e / kTile;
      As[r][c] = rm[i] > (Acc)0 ? ra[i] : (Acc)0;
      r = b_rows ? e / kTile : e % kSlice, c = b_rows ? e % kTile : e / kSlice;
      Bs[r][c] = rb[i];
    }
    __syncthreads();
    if (k0 + kSlice < K) load(k0 + kSlice);
#pragma unroll 16
    for (int kk = 0; kk < kSlice; kk++) acc += As[ty][kk] * Bs[kk][tx];
    /* A's row sums: each thread four columns of its row, the 16 threads of the row summed
    ** by shuffles at the end (one thread walking the row took ~1 us a slice) */
    if (sums)
#pragma unroll
      for (int j = 0; j < kSlice / 16; j++) rs += As[ty][tx + 16 * j];
    __syncthreads();
  }
  if (sums) { /* the 16 threads of a row are one half of a warp */
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) rs += __shfl_xor_sync(0xffffffffu, rs, o, 16);
    if (tx == 0 && m < M) rowsum[m * srow] = kc_st<T>(rs);
  }
  if (m >= M || n >= N) return;
  T *c = C + m * cm + n * cn;
  Acc v = alpha * acc + bv;
  if (beta != (Acc)0) v += beta * (Acc)kc_ld<T>(*c);
  if (relu && !(v > (Acc)0)) v = v != v ? v : (Acc)0; /* ReLU keeps NaN, as kiln_relu */
  *c = kc_st<T>(v);
}

} // namespace

bool kiln__cuda_matmul_small_fits(int64_t batch, int64_t M, int64_t N, int64_t K) {
  return batch > 0 && M > 0 && N > 0 && K > 0 &&
         (double)batch * (double)M * (double)N * (double)K <= kSmallMacs && batch <= 65535 &&
         K <= kSmallMaxK && (M + kTile - 1) / kTile <= 65535;
}

kiln_status kiln__cuda_matmul_small(kiln__cuda_dev *d, const kiln__kargs *a, const kiln__view &A,
                                    const kiln__view &B, const kiln__view &C, int64_t batch,
                                    int64_t sa, int64_t sb, int64_t sc, int64_t smask) {
  const int nd = C.ndim;
  const int64_t M = C.shape[nd - 2], N = C.shape[nd - 1], K = A.shape[nd - 1];
  const kiln__view *bias = kiln__mm_bias(a), *mask = kiln__mm_mask(a);
  const kiln__view *rs = a->n_out > 1 ? &a->out[1] : NULL;
  const int64_t am = A.strides[nd - 2], ak = A.strides[nd - 1], bk = B.strides[nd - 2],
                bn = B.strides[nd - 1], cm = C.strides[nd - 2], cn = C.strides[nd - 1];
  const int64_t sbias = bias && bias->ndim > 0 ? bias->strides[bias->ndim - 1] : 0;
  const int64_t mm = mask ? mask->strides[nd - 2] : 0, mk = mask ? mask->strides[nd - 1] : 0;
  const int64_t srow = rs ? rs->strides[0] : 0;
  const int relu = (a->i[1] & 1) ? 1 : 0;
  const unsigned z = (unsigned)batch;
  KC_SWITCH_FLOAT(C.dtype, T, return kiln_set_error(KILN_ERR_DTYPE, "kiln_matmul: %s", kiln_dtype_name(C.dtype)), {
    typedef typename kc_traits<T>::acc Acc;
    const T *pa = (const T *)A.data, *pb = (const T *)B.data;
    const T *pbias = bias ? (const T *)bias->data : (const T *)NULL;
    const T *pmask = mask ? (const T *)mask->data : (const T *)NULL;
    T *pc = (T *)C.data, *prs = rs ? (T *)rs->data : (T *)NULL;
    const Acc alpha = (Acc)a->s[0], beta = (Acc)a->s[1];
    if (K <= kTinyK) {
      const int64_t total = M * N;
      const unsigned blocks = (unsigned)((total + 255) / 256 < 4096 ? (total + 255) / 256 : 4096);
      tinyk_gemm<T><<<dim3(blocks, 1, z), 256, 0, d->stream>>>(
          pa, am, ak, sa, pb, bk, bn, sb, pc, cm, cn, sc, (int)M, (int)N, (int)K, alpha, beta, pbias, sbias,
          prs, srow, pmask, mm, mk, smask, relu, cn == 1 || cm != 1);
    } else if (N <= kThinN) { /* C (M, N) directly */
      const bool lanes_k = ak == 1 && am != 1;
      const unsigned blocks = (unsigned)(lanes_k ? (M + 7) / 8 : (M + 31) / 32);
      thin_gemm<T><<<dim3(blocks, 1, z), 256, 0, d->stream>>>(
          pa, am, ak, sa, pb, bk, bn, sb, pc, cm, cn, sc, (int)M, (int)N, (int)K, alpha, beta, pbias, sbias,
          0, prs, srow, 0, pmask, mm, mk, smask, 0, relu, lanes_k);
    } else if (M <= kThinN) { /* C^T (N, M) = B^T (N, K) A^T (K, M): A's row sums are A^T's column sums */
      const bool lanes_k = bk == 1 && bn != 1;
      const unsigned blocks = (unsigned)(lanes_k ? (N + 7) / 8 : (N + 31) / 32);
      thin_gemm<T><<<dim3(blocks, 1, z), 256, 0, d->stream>>>(
          pb, bn, bk, sb, pa, ak, am, sa, pc, cn, cm, sc, (int)N, (int)M, (int)K, alpha, beta, pbias, sbias,
          1, prs, srow, 1, pmask, mk, mm, smask, 1, relu, lanes_k);
    } else {
      dim3 grid((unsigned)((N + kTile - 1) / kTile), (unsigned)((M + kTile - 1) / kTile), z);
      small_gemm<T><<<grid, 256, 0, d->stream>>>(pa, am, ak, sa, pb, bk, bn, sb, pc, cm, cn, sc, (int)M, (int)N,
                                                 (int)K, alpha, beta, pbias, sbias, prs, srow, pmask, mm, mk,
                                                 smask, relu);
    }
  })
  return kiln__cuda_launched("matmul (small)");
}
