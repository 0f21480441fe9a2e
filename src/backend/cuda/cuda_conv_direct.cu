/*
** Small f32 convolutions on the tensor cores (TF32): CONV2D (with its bias),
** CONV2D_BACKWARD_DATA(_ACC) and CONV2D_BACKWARD_WEIGHT (with the bias gradient) as implicit
** GEMMs, a block per image, for the arguments TF32 is allowed for (i1 flag 1), stride and
** dilation 1, ungrouped, packed NCHW, where an image's planes and 32 weight rows fit in
** shared memory. Everything else goes to cuDNN (cuda_conv_cudnn.cu); KILN_CONV_DIRECT=0
** sends these there too (A/B comparisons; bench/RESULTS.md has them).
**
** Why: fashion-mnist's CNN (issue 15) spent most of its CUDA step in cuDNN for its second
** convolution (32 -> 64 channels, 3x3 on 13x13, batch 128): too small for cuDNN's tiles,
** with layout transposes and a bias kernel around the convolution, and a per-shape plan
** and warm-up that cost a short run more than its steps. Here a block holds one image's
** zero-padded planes and 32 rows of the weight in shared memory, and its warps run
** mma.sync m16n8k8 (TF32 in, f32 sums) over them, the A fragments by ldmatrix, the im2col
** matrix read in place through a table of tap offsets: no workspace, no im2col buffer.
**
** The passes:
** - CONV2D: rows = output channels, columns = output pixels, the sum over (c, i, j). A small
**   kernel first writes the weight as TF32 rows padded for shared memory (once per call,
**   not once per block).
** - CONV2D_BACKWARD_DATA: the same kernel on the gradient (its C = OC planes, padded by
**   k - 1 - p) with the weight transposed and flipped: W'[c][o][i][j] = W[o][c][k-1-i][k-1-j].
** - CONV2D_BACKWARD_WEIGHT: rows = output channels, columns = (c, i, j), the sum over each
**   image's pixels; blocks take fixed ranges of images (set by the shapes, not the device)
**   and a finishing kernel adds their partials in order, in f64. The bias gradient is the
**   gradient's rows summed in f64 in the same blocks.
** No atomics: the same bits every run (DESIGN.md). The operands are rounded to TF32 (cvt.rna,
** to nearest); the sums are f32 (the forward's, and each block's partial of the weight
** gradient).
**
** Shared-memory layouts are padded so the fragment loads hit distinct banks: the image
** planes 8 floats apart mod 32, the weight rows 4 apart. Taps past K read a zero plane kept
** after the image's, and the weight gradient's last pixel step masks the pixels past OH*OW,
** so an inf in the image cannot turn a product that should be zero into a NaN that is kept;
** the forward's columns past OH*OW read pixel 0 and are never stored.
*/
#include "cuda_int.cuh"

#include <limits.h>
#include <mutex>
#include <utility>
#include <stdlib.h>
#include <string.h>

extern "C" bool kiln__cuda_conv_direct_supports(const kiln__kargs *a);
extern "C" kiln_status kiln__cuda_conv_direct(const kiln__kargs *a);

namespace {

constexpr int kJ = 8;             /* n-tiles of 8 columns a warp holds at most */
constexpr int kMaxRows = 128;     /* the GEMM's rows (output channels) */
constexpr int kMaxTaps = 2048;    /* C * kh * kw */
constexpr int kWgradBlocks = 128; /* the weight gradient's blocks, whatever the device */
constexpr int kU = 8;             /* loads in flight a thread while filling shared memory */

struct Geom {
  int C, H, W;    /* the GEMM's input planes (x; the gradient for the data pass) */
  int ph, pw;     /* their padding */
  int Hp, Wp, CS; /* padded plane, and the plane stride in shared memory */
  int O, Op;      /* rows: output channels, rounded up to 32 */
  int KH, KW, OH, OW, P, NT; /* kernel, output plane, pixels, pixel n-tiles */
  int K, Kp, Ks;  /* taps C*kh*kw, rounded up to 8, the weight rows' stride */
  int MW, NW, J;  /* warps along the rows (32 each), along the columns; n-tiles a warp */
  int ptiles;     /* forward: n-tiles a block covers */
  int flip;       /* backward data: the weight read transposed and flipped */
  int acc;        /* add into the output (CONV2D_BACKWARD_DATA_ACC) */
  int vec;        /* the image's planes (and the gradient's rows) load as float4 */
  kc_fastdiv hw, w, p; /* by H*W, W, P */
  /* weight gradient */
  int NTK;        /* column n-tiles: ceil(K / 8) */
  int Pp, Ps;     /* pixels rounded up to 8, the gradient rows' stride in shared memory */
  int N, ipb, G, S;
};

__device__ __forceinline__ uint32_t to_tf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(v));
  return r;
}

__device__ __forceinline__ void mma_tf32(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

/* The A fragments come from a row-major TF32 tile (row stride rs, a multiple of 4: rows
** 16-byte aligned) by ldmatrix: its four 8x8 b16 matrices are the four 8x4 TF32 quarters of
** rows r .. r+15, columns k .. k+7, in the order mma's a0..a3 take them. a_row: where this
** lane's row address starts (row r + lane % 8 + 8 * bit 3 of the lane, column 4 * bit 4);
** ldsm4 at a_row + r * rs + k. */
__device__ __forceinline__ const uint32_t *a_row(const uint32_t *tile, int rs) {
  const int lane = threadIdx.x & 31, m = lane >> 3;
  return tile + ((lane & 7) + 8 * (m & 1)) * rs + 4 * (m >> 1);
}
__device__ __forceinline__ void ldsm4(uint32_t a[4], const uint32_t *p) {
  const uint32_t addr = (uint32_t)__cvta_generic_to_shared(p);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
               : "r"(addr));
#else
  a[0] = a[1] = a[2] = a[3] = 0u;
  (void)addr;
#endif
}

/* One k-step of 8 for a warp's two m-tiles and JJ n-tiles: A (16 + 16 rows) by ldmatrix at
** a and a + 16 rows, B's column j gathered at x0[off[j]] (k-row tq) and x1[off[j]] (k-row
** tq + 4); with in0/in1 false that row reads as 0 (past the pixels: the weight gradient's
** last step). */
template <int JJ>
__device__ __forceinline__ void mma_step(float (&acc)[2][JJ][4], const uint32_t *a, int rs, const uint32_t *x0,
                                         const uint32_t *x1, const int (&off)[JJ], bool in0 = true,
                                         bool in1 = true) {
  uint32_t a0[4], a1[4];
  ldsm4(a0, a);
  ldsm4(a1, a + 16 * rs);
#pragma unroll
  for (int j = 0; j < JJ; j++) {
    const uint32_t b0 = in0 ? x0[off[j]] : 0u, b1 = in1 ? x1[off[j]] : 0u;
    mma_tf32(acc[0][j], a0, b0, b1);
    mma_tf32(acc[1][j], a1, b0, b1);
  }
}

__device__ __forceinline__ void zero_fill(uint32_t *dst, int n) {
  for (int k = threadIdx.x; k < n; k += blockDim.x) dst[k] = 0u;
}

/* Copies total floats src[k] to dst[at(k)] as TF32, kU loads (of 4 floats where vec) in
** flight a thread: a loop of one load and one store waits out the memory's latency each
** element, which was most of these kernels' time. vec: src 16-byte aligned, total % 4 == 0. */
template <class Map>
__device__ __forceinline__ void copy_in(uint32_t *dst, const float *__restrict__ src, int total, bool vec, Map at) {
  if (vec) {
    const float4 *s4 = reinterpret_cast<const float4 *>(src);
    const int t4 = total >> 2;
    for (int base = threadIdx.x; base < t4; base += blockDim.x * kU) {
      float4 v[kU];
#pragma unroll
      for (int u = 0; u < kU; u++) {
        const int k = base + u * blockDim.x;
        v[u] = k < t4 ? __ldg(s4 + k) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
#pragma unroll
      for (int u = 0; u < kU; u++) {
        const int k = base + u * blockDim.x;
        if (k < t4) {
          dst[at(4 * k)] = to_tf32(v[u].x), dst[at(4 * k + 1)] = to_tf32(v[u].y);
          dst[at(4 * k + 2)] = to_tf32(v[u].z), dst[at(4 * k + 3)] = to_tf32(v[u].w);
        }
      }
    }
    return;
  }
  for (int base = threadIdx.x; base < total; base += blockDim.x * kU) {
    float v[kU];
#pragma unroll
    for (int u = 0; u < kU; u++) {
      const int k = base + u * blockDim.x;
      v[u] = k < total ? __ldg(src + k) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kU; u++) {
      const int k = base + u * blockDim.x;
      if (k < total) dst[at(k)] = to_tf32(v[u]);
    }
  }
}

/* element k of an image's (C, H, W) planes -> its place in the padded planes */
struct PlaneAt {
  const Geom &g;
  __device__ int operator()(int k) const {
    const int c = kc_div(k, g.hw), r = k - c * g.H * g.W, h = kc_div(r, g.w);
    return c * g.CS + (h + g.ph) * g.Wp + (r - h * g.W) + g.pw;
  }
};
/* element k of a gradient image's (O, P) rows -> rows of stride Ps */
struct RowAt {
  const Geom &g;
  __device__ int operator()(int k) const {
    const int r = kc_div(k, g.p);
    return r * g.Ps + (k - r * g.P);
  }
};

/* the image's planes into xs (their padding already zero) */
__device__ __forceinline__ void load_planes(uint32_t *xs, const float *__restrict__ xn, const Geom &g) {
  copy_in(xs, xn, g.C * g.H * g.W, g.vec, PlaneAt{g});
}

/* tap k = (c, i, j) -> its offset from a pixel's top-left in the planes; past K, the zero
** plane after the C planes (a product that is kept must not read an image's inf) */
__device__ __forceinline__ int tap_offset(int k, const Geom &g) {
  if (k >= g.K) return g.C * g.CS;
  const int T = g.KH * g.KW, c = k / T, t = k - c * T, i = t / g.KW;
  return c * g.CS + i * g.Wp + (t - i * g.KW);
}

/* output pixel p -> its window's top-left in a plane; past P, 0 (the products are dropped) */
__device__ __forceinline__ int pixel_offset(int p, const Geom &g) {
  if (p >= g.P) return 0;
  const int oh = p / g.OW;
  return oh * g.Wp + (p - oh * g.OW);
}

/* The weight as the forward's A: rows Op (zero past O), stride Ks (zero past K), TF32;
** for the data pass transposed and flipped: row c, column (o, t) = W[o][c][kh*kw-1-t]. */
__global__ void __launch_bounds__(256) conv_prep_w(const float *__restrict__ w, uint32_t *__restrict__ out, Geom g) {
  const int total = g.Op * g.Ks, T = g.KH * g.KW;
  for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < total; k += gridDim.x * blockDim.x) {
    const int r = k / g.Ks, q = k - r * g.Ks;
    float v = 0.0f;
    if (r < g.O && q < g.K) {
      if (!g.flip) {
        v = w[(int64_t)r * g.K + q];
      } else { /* W (this pass's C, O, kh, kw) */
        const int o = q / T, t = q - o * T;
        v = w[((int64_t)o * g.O + r) * T + (T - 1 - t)];
      }
    }
    out[k] = to_tf32(v);
  }
}

/* Forward (and backward data): block (image, 32 rows, pixel range); warp nw makes the
** block's 32 rows (two m-tiles) for the n-tiles nw, nw + NW, ... of the range: JJ of them
** (a template parameter, so the loop over them has no tests: a tile past the range reads
** pixel 0 and is not stored). */
template <int JJ>
__global__ void __launch_bounds__(256, 2) conv_fwd(const float *__restrict__ x, const uint32_t *__restrict__ wp,
                                                   const float *__restrict__ bias, float *__restrict__ y, Geom g) {
  extern __shared__ __align__(16) uint32_t sm[];
  uint32_t *ws = sm, *xs = ws + 32 * g.Ks;
  int *koff = (int *)(xs + (g.C + 1) * g.CS), *poff = koff + g.Kp;
  const int n = blockIdx.x, r0 = blockIdx.y * 32, pt0 = blockIdx.z * g.ptiles;
  zero_fill(xs, (g.C + 1) * g.CS); /* the planes' padding and the zero plane */
  { /* the block's 32 weight rows: one contiguous run of the prepared weight */
    const uint4 *src = reinterpret_cast<const uint4 *>(wp + (int64_t)r0 * g.Ks);
    uint4 *dst = reinterpret_cast<uint4 *>(ws);
    const int t4 = 32 * g.Ks / 4;
    for (int base = threadIdx.x; base < t4; base += blockDim.x * kU) {
      uint4 v[kU];
#pragma unroll
      for (int u = 0; u < kU; u++) {
        const int k = base + u * blockDim.x;
        if (k < t4) v[u] = __ldg(src + k);
      }
#pragma unroll
      for (int u = 0; u < kU; u++) {
        const int k = base + u * blockDim.x;
        if (k < t4) dst[k] = v[u];
      }
    }
  }
  for (int k = threadIdx.x; k < g.Kp; k += blockDim.x) koff[k] = tap_offset(k, g);
  for (int k = threadIdx.x; k < g.ptiles * 8; k += blockDim.x) poff[k] = pixel_offset(pt0 * 8 + k, g);
  __syncthreads(); /* the zeros before the planes */
  load_planes(xs, x + (int64_t)n * g.C * g.H * g.W, g);
  __syncthreads();

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
  const int nw = warp;
  float acc[2][JJ][4];
  int pb[JJ];
#pragma unroll
  for (int j = 0; j < JJ; j++) {
    const int lt = nw + g.NW * j;
    pb[j] = lt < g.ptiles && pt0 + lt < g.NT ? poff[lt * 8 + gq] : 0;
#pragma unroll
    for (int e = 0; e < 4; e++) acc[0][j][e] = acc[1][j][e] = 0.0f;
  }
  const uint32_t *wa = a_row(ws, g.Ks);
  const int *kt = koff + tq;
  for (int kk = 0; kk < g.Kp; kk += 8) mma_step<JJ>(acc, wa + kk, g.Ks, xs + kt[kk], xs + kt[kk + 4], pb);
  float *yn = y + (int64_t)n * g.O * g.P;
#pragma unroll
  for (int mt = 0; mt < 2; mt++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int o = r0 + mt * 16 + gq + h * 8;
      if (o >= g.O) continue;
      const float bv = bias ? bias[o] : 0.0f;
      float *yo = yn + (int64_t)o * g.P;
#pragma unroll
      for (int j = 0; j < JJ; j++) {
        const int lt = nw + g.NW * j;
        if (lt >= g.ptiles) continue;
        const int p = (pt0 + lt) * 8 + 2 * tq;
#pragma unroll
        for (int e = 0; e < 2; e++)
          if (p + e < g.P) {
            float v = acc[mt][j][2 * h + e] + bv;
            if (g.acc) v += yo[p + e];
            yo[p + e] = v;
          }
      }
    }
}

/* Weight gradient, first stage: block (image range s, column range cr): the images'
** planes and gradient rows in shared memory one image at a time; warp (mw, nw) sums rows
** mw*32 .. +32 of dW for the column n-tiles nw, nw + NW, ... of the range over the pixels.
** Column range 0 also sums the gradient's rows (the bias gradient) in f64. */
template <int JJ>
__global__ void __launch_bounds__(256) conv_wgrad(const float *__restrict__ x, const float *__restrict__ dy,
                                                  float *__restrict__ part, double *__restrict__ part_db, Geom g) {
  extern __shared__ __align__(16) uint32_t sm[];
  uint32_t *ds = sm, *xs = ds + g.Op * g.Ps;
  int *poff = (int *)(xs + g.C * g.CS);
  const int s = blockIdx.x, cr = blockIdx.y;
  const int n0 = s * g.ipb, n1 = min(g.N, n0 + g.ipb);
  const int ct0 = cr * g.NW * g.J; /* the block's first column n-tile */
  for (int k = threadIdx.x; k < g.Pp; k += blockDim.x) poff[k] = pixel_offset(k, g);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
  const int mw = warp % g.MW, nw = warp / g.MW;
  float acc[2][JJ][4];
  int kb[JJ];
#pragma unroll
  for (int j = 0; j < JJ; j++) {
    const int nt = ct0 + nw + g.NW * j;
    kb[j] = nt < g.NTK ? tap_offset(nt * 8 + gq, g) : 0;
    if (kb[j] >= g.C * g.CS) kb[j] = 0; /* a column past K: read anything, dropped */
#pragma unroll
    for (int e = 0; e < 4; e++) acc[0][j][e] = acc[1][j][e] = 0.0f;
  }
  __shared__ double dbs[kMaxRows]; /* column range 0: the bias gradient's rows so far */
  const bool do_db = cr == 0 && part_db;
  if (do_db)
    for (int o = threadIdx.x; o < g.O; o += blockDim.x) dbs[o] = 0.0;
  zero_fill(sm, g.Op * g.Ps + g.C * g.CS); /* the rows past O, the pixels past P, the planes' padding */
  const int full = g.P / 8 * 8; /* pixel steps that need no mask */
  for (int n = n0; n < n1; n++) {
    __syncthreads(); /* the previous image's reads are done (the first time: the zeros) */
    load_planes(xs, x + (int64_t)n * g.C * g.H * g.W, g);
    const float *dn = dy + (int64_t)n * g.O * g.P;
    copy_in(ds, dn, g.O * g.P, g.vec, RowAt{g});
    if (do_db) /* warp by warp, rows in turn: the lanes' f64 sums, then a fixed shuffle tree */
      for (int o = warp; o < g.O; o += blockDim.x >> 5) {
        const float *row = dn + (int64_t)o * g.P;
        double v = 0.0;
        for (int p = lane; p < g.P; p += 32) v += (double)row[p];
        for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
        if (lane == 0) dbs[o] += v;
      }
    __syncthreads();
    const uint32_t *da = a_row(ds, g.Ps) + mw * 32 * g.Ps;
    const int *pt = poff + tq;
    for (int kk = 0; kk < full; kk += 8) mma_step<JJ>(acc, da + kk, g.Ps, xs + pt[kk], xs + pt[kk + 4], kb);
    if (full < g.P) /* the last pixels: the gradient is zero past P, the image read as 0 there */
      mma_step<JJ>(acc, da + full, g.Ps, xs + pt[full], xs + pt[full + 4], kb, full + tq < g.P,
                   full + tq + 4 < g.P);
  }
  float *ps = part + (int64_t)s * g.O * g.K;
#pragma unroll
  for (int mt = 0; mt < 2; mt++)
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int o = mw * 32 + mt * 16 + gq + h * 8;
      if (o >= g.O) continue;
#pragma unroll
      for (int j = 0; j < JJ; j++) {
        const int col = (ct0 + nw + g.NW * j) * 8 + 2 * tq; /* past K (or the range's tiles): dropped */
        if (nw + g.NW * j >= g.NW * g.J) continue;
#pragma unroll
        for (int e = 0; e < 2; e++)
          if (col + e < g.K) ps[(int64_t)o * g.K + col + e] = acc[mt][j][2 * h + e];
      }
    }
  if (do_db) {
    __syncthreads();
    for (int o = threadIdx.x; o < g.O; o += blockDim.x) part_db[(int64_t)s * g.O + o] = dbs[o];
  }
}

/* Weight gradient, second stage: kSplit threads per dW element (and per bias element),
** thread q adding partials q, q + kSplit, ... in order (f64), then the kSplit sums in a
** fixed shuffle tree: the same order every run, kSplit loads in flight per element. */
constexpr int kSplit = 8;
__global__ void __launch_bounds__(256) conv_wgrad_finish(const float *__restrict__ part,
                                                         const double *__restrict__ part_db, float *__restrict__ dw,
                                                         float *__restrict__ dbias, Geom g) {
  const int64_t OK = (int64_t)g.O * g.K, total = OK + (dbias ? g.O : 0);
  const int q = threadIdx.x % kSplit;
  /* the loop's trip count is the block's (uniform), so every lane reaches the shuffles */
  for (int64_t base = blockIdx.x * (int64_t)blockDim.x; base < total * kSplit;
       base += (int64_t)gridDim.x * blockDim.x) {
    const int64_t e = (base + threadIdx.x) / kSplit;
    double v = 0.0;
    if (e < OK)
      for (int s0 = q; s0 < g.G; s0 += kSplit) v += (double)__ldg(part + s0 * OK + e);
    else if (e < total)
      for (int s0 = q; s0 < g.G; s0 += kSplit) v += part_db[(int64_t)s0 * g.O + (e - OK)];
    for (int off = kSplit / 2; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off, kSplit);
    if (q == 0 && e < total) {
      if (e < OK) dw[e] = (float)v;
      else dbias[e - OK] = (float)v;
    }
  }
}

/* ---- host side ------------------------------------------------------------------------ */

struct DevInfo {
  bool known, ok;  /* ok: compute capability 8.0 or later (mma.sync TF32) */
  int smem_optin;  /* the most dynamic shared memory a block may ask for */
};
DevInfo g_dev[KC_MAX_DEV];
std::mutex g_dev_mu;

DevInfo dev_info(int device) {
  if (device < 0 || device >= KC_MAX_DEV) return DevInfo{true, false, 0};
  std::lock_guard<std::mutex> lock(g_dev_mu);
  DevInfo &d = g_dev[device];
  if (!d.known) {
    int major = 0, optin = 0;
    d.known = true;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
      (void)cudaGetLastError();
      d.ok = false;
    } else {
      d.ok = major >= 8;
      d.smem_optin = optin;
    }
  }
  return d;
}

/* KILN_CONV_DIRECT=0: cuDNN for these shapes too (A/B); anything else (or unset): on */
bool enabled() {
  static const bool on = !kc_env_zero("KILN_CONV_DIRECT");
  return on;
}

int round_up(int v, int m) { return (v + m - 1) / m * m; }
/* the smallest s >= v with s % 32 == r (bank spreading) */
int stride_mod32(int v, int r) { return v + ((r - v % 32) % 32 + 32) % 32; }

struct Plan {
  Geom g;
  size_t smem;
  dim3 grid;
  int threads;
  const float *in0, *w, *bias; /* the kernel's input planes, the weight (or gradient), the bias */
  float *out, *dbias;
};

bool dense_f32(const kiln__view *v, int ndim) {
  return v->ndim == ndim && v->dtype == KILN_F32 && kiln__view_is_contiguous(v) && kc_numel(v) > 0 &&
         kc_numel(v) < INT_MAX / 2;
}

bool aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

/* the planes (C, H, W) and output plane of a pass, and their derived sizes */
void planes(Geom *g, int C, int H, int W, int ph, int pw, int O, int OH, int OW) {
  g->C = C, g->H = H, g->W = W, g->ph = ph, g->pw = pw, g->O = O, g->OH = OH, g->OW = OW;
  g->Op = round_up(O, 32);
  g->Hp = H + 2 * ph, g->Wp = W + 2 * pw;
  g->CS = stride_mod32(g->Hp * g->Wp, 8);
  g->P = OH * OW, g->NT = (g->P + 7) / 8;
  g->K = C * g->KH * g->KW;
  g->hw = kc_make_fastdiv((uint32_t)(H * W)), g->w = kc_make_fastdiv((uint32_t)W);
  g->p = kc_make_fastdiv((uint32_t)g->P);
}

/* The arguments, checked, and the launch. false: not taken here (cuDNN's then). */
bool plan_of(const kiln__kargs *a, Plan *pl) {
  if (!enabled() || !a->params || a->i[0] != 1 || !(a->i[1] & 1)) return false;
  const kiln__conv_params *cp = (const kiln__conv_params *)a->params;
  const kiln__view *x, *w, *y, *b = NULL, *db = NULL;
  switch (a->op) {
  case KILN__K_CONV2D:
    if (a->n_in < 2 || a->n_in > 3 || a->n_out != 1) return false;
    x = &a->in[0], w = &a->in[1], y = &a->out[0], b = a->n_in > 2 ? &a->in[2] : NULL;
    break;
  case KILN__K_CONV2D_BACKWARD_DATA:
  case KILN__K_CONV2D_BACKWARD_DATA_ACC:
    if (a->n_in != 2 || a->n_out != 1) return false;
    y = &a->in[0], w = &a->in[1], x = &a->out[0];
    break;
  case KILN__K_CONV2D_BACKWARD_WEIGHT:
    if (a->n_in != 2 || a->n_out < 1 || a->n_out > 2) return false;
    x = &a->in[0], y = &a->in[1], w = &a->out[0], db = a->n_out > 1 ? &a->out[1] : NULL;
    break;
  default: return false;
  }
  if (!dense_f32(x, 4) || !dense_f32(w, 4) || !dense_f32(y, 4)) return false;
  const kiln__view *bv = b ? b : db;
  if (bv && (!dense_f32(bv, 1) || bv->shape[0] != w->shape[0])) return false;
  const int64_t N = x->shape[0], C = x->shape[1], H = x->shape[2], W = x->shape[3];
  const int64_t O = w->shape[0], KH = w->shape[2], KW = w->shape[3];
  if (w->shape[1] != C || y->shape[0] != N || y->shape[1] != O) return false;
  for (int d = 0; d < 2; d++)
    if (cp->stride[d] != 1 || cp->dilation[d] != 1 || cp->kernel[d] != w->shape[2 + d] || cp->padding[d] < 0 ||
        cp->padding[d] > w->shape[2 + d] - 1)
      return false;
  const int64_t ph = cp->padding[0], pw = cp->padding[1];
  if (y->shape[2] != H + 2 * ph - KH + 1 || y->shape[3] != W + 2 * pw - KW + 1) return false;
  const int64_t OH = y->shape[2], OW = y->shape[3];
  if (H * W > 4096 || OH * OW > 4096 || C * KH * KW > kMaxTaps || O * KH * KW > kMaxTaps || C > 1024 || O > 1024)
    return false;
  DevInfo di = dev_info(a->device);
  if (!di.ok) return false;

  Geom &g = pl->g;
  memset(&g, 0, sizeof g);
  g.KH = (int)KH, g.KW = (int)KW, g.N = (int)N;
  g.acc = a->op == KILN__K_CONV2D_BACKWARD_DATA_ACC;
  size_t smem;
  if (a->op != KILN__K_CONV2D_BACKWARD_WEIGHT) {
    bool bwd = a->op != KILN__K_CONV2D;
    /* the pass's input planes (the gradient's for the data pass, padded by k - 1 - p) */
    if (bwd)
      planes(&g, (int)O, (int)OH, (int)OW, (int)(KH - 1 - ph), (int)(KW - 1 - pw), (int)C, (int)H, (int)W);
    else
      planes(&g, (int)C, (int)H, (int)W, (int)ph, (int)pw, (int)O, (int)OH, (int)OW);
    g.flip = bwd;
    if (g.O > kMaxRows) return false;
    g.Kp = round_up(g.K, 8), g.Ks = stride_mod32(g.Kp, 4);
    g.MW = 1, g.NW = g.NT < 8 ? g.NT : 8;
    g.J = (g.NT + g.NW - 1) / g.NW;
    if (g.J > kJ) g.J = kJ;
    g.ptiles = g.NW * g.J;
    const float *in0 = (const float *)(bwd ? y->data : x->data);
    g.vec = (g.C * g.H * g.W) % 4 == 0 && aligned16(in0);
    smem = ((size_t)32 * g.Ks + (size_t)(g.C + 1) * g.CS + g.Kp + (size_t)g.ptiles * 8) * 4;
    pl->grid = dim3((unsigned)N, (unsigned)(g.Op / 32), (unsigned)((g.NT + g.ptiles - 1) / g.ptiles));
    pl->in0 = in0;
    pl->w = (const float *)w->data;
    pl->bias = b ? (const float *)b->data : NULL;
    pl->out = (float *)(bwd ? x->data : y->data);
    pl->dbias = NULL;
  } else {
    planes(&g, (int)C, (int)H, (int)W, (int)ph, (int)pw, (int)O, (int)OH, (int)OW);
    if (g.O > kMaxRows) return false;
    g.NTK = (g.K + 7) / 8;
    g.Pp = round_up(g.P, 8), g.Ps = stride_mod32(g.Pp, 4);
    g.MW = g.Op / 32, g.NW = 8 / g.MW;
    /* column ranges: as few as hold every n-tile (kJ a warp); the image ranges then make
    ** about kWgradBlocks blocks in all (the same split on every device) */
    g.S = (g.NTK + g.NW * kJ - 1) / (g.NW * kJ);
    int per = (g.NTK + g.S - 1) / g.S; /* n-tiles a range */
    g.J = (per + g.NW - 1) / g.NW;
    int G = kWgradBlocks / g.S;
    if (G < 1) G = 1;
    if (G > g.N) G = g.N;
    g.ipb = (g.N + G - 1) / G;
    g.G = (g.N + g.ipb - 1) / g.ipb;
    g.vec = (g.C * g.H * g.W) % 4 == 0 && (g.O * g.P) % 4 == 0 && aligned16(x->data) && aligned16(y->data);
    smem = ((size_t)g.Op * g.Ps + (size_t)g.C * g.CS + g.Pp) * 4;
    pl->grid = dim3((unsigned)g.G, (unsigned)g.S);
    pl->in0 = (const float *)x->data;
    pl->w = (const float *)y->data; /* the gradient */
    pl->bias = NULL;
    pl->out = (float *)w->data;
    pl->dbias = db ? (float *)db->data : NULL;
  }
  if (smem > (size_t)di.smem_optin) return false;
  pl->smem = smem;
  pl->threads = g.MW * g.NW * 32;
  return true;
}

/* the kernels by their tiles a warp (plan_of keeps J in 1..kJ) */
typedef void (*FwdKernel)(const float *, const uint32_t *, const float *, float *, Geom);
typedef void (*WgradKernel)(const float *, const float *, float *, double *, Geom);
template <int... Js> FwdKernel fwd_kernel(int J, std::integer_sequence<int, Js...>) {
  FwdKernel ks[] = {conv_fwd<Js + 1>...};
  return ks[J - 1];
}
template <int... Js> WgradKernel wgrad_kernel(int J, std::integer_sequence<int, Js...>) {
  WgradKernel ks[] = {conv_wgrad<Js + 1>...};
  return ks[J - 1];
}

kiln_status smem_attr(const void *kernel, size_t bytes, const char *what) {
  if (bytes <= 48 * 1024) return KILN_OK;
  return kiln__cuda_err(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes), what);
}

} // namespace

extern "C" bool kiln__cuda_conv_direct_supports(const kiln__kargs *a) {
  Plan pl;
  return plan_of(a, &pl);
}

extern "C" kiln_status kiln__cuda_conv_direct(const kiln__kargs *a) {
  Plan pl;
  if (!plan_of(a, &pl))
    return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln: %s: arguments the direct TF32 kernel does not take",
                          kiln__kop_name(a->op));
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  const char *name = kiln__kop_name(a->op);
  const Geom &g = pl.g;
  if (a->op != KILN__K_CONV2D_BACKWARD_WEIGHT) {
    /* the weight prepared once for all the blocks (TF32, padded, flipped for the data pass) */
    size_t wn = (size_t)g.Op * g.Ks * sizeof(uint32_t);
    uint32_t *wp = (uint32_t *)kiln__cuda_alloc(a->device, wn);
    if (!wp) return kiln_last_error();
    kiln_status st = kiln__cuda_capture_note(a->device, wp, wn);
    FwdKernel k = fwd_kernel(g.J, std::make_integer_sequence<int, kJ>{});
    if (st == KILN_OK) st = smem_attr((const void *)k, pl.smem, name);
    if (st == KILN_OK) {
      conv_prep_w<<<kc_blocks((int64_t)g.Op * g.Ks, 256, d->sm_count), 256, 0, d->stream>>>(pl.w, wp, g);
      st = kiln__cuda_launched("conv2d (weight as TF32)");
    }
    if (st == KILN_OK) {
      k<<<pl.grid, pl.threads, pl.smem, d->stream>>>(pl.in0, wp, pl.bias, pl.out, g);
      st = kiln__cuda_launched(name);
    }
    kiln__cuda_free(a->device, wp, wn); /* stream ordered: the kernels queued above still see it */
    return st;
  }
  /* the f32 partials, then (16-byte aligned) the bias's f64 partials */
  size_t pn = ((size_t)g.G * g.O * g.K * sizeof(float) + 15) / 16 * 16;
  size_t dn = pl.dbias ? (size_t)g.G * g.O * sizeof(double) : 0;
  char *scratch = (char *)kiln__cuda_alloc(a->device, pn + dn);
  if (!scratch) return kiln_last_error();
  float *part = (float *)scratch;
  double *part_db = pl.dbias ? (double *)(scratch + pn) : NULL;
  kiln_status st = kiln__cuda_capture_note(a->device, scratch, pn + dn);
  WgradKernel k = wgrad_kernel(g.J, std::make_integer_sequence<int, kJ>{});
  if (st == KILN_OK) st = smem_attr((const void *)k, pl.smem, name);
  if (st == KILN_OK) {
    k<<<pl.grid, pl.threads, pl.smem, d->stream>>>(pl.in0, pl.w, part, part_db, g);
    st = kiln__cuda_launched("conv2d_backward_weight (partial sums)");
  }
  if (st == KILN_OK) {
    int64_t total = ((int64_t)g.O * g.K + (pl.dbias ? g.O : 0)) * kSplit;
    conv_wgrad_finish<<<kc_blocks(total, 256, d->sm_count), 256, 0, d->stream>>>(part, part_db, pl.out, pl.dbias,
                                                                                 g);
    st = kiln__cuda_launched(name);
  }
  kiln__cuda_free(a->device, scratch, pn + dn); /* stream ordered: the kernels queued above still see it */
  return st;
}
