/*
** Index ops: INDEX_SELECT, INDEX_ADD, GATHER, SCATTER_ADD (index views i64 or i32, i0 =
** dim). One thread per element of the iterated tensor (out for select/gather, src for the
** two adds). An index outside [0, size) is never followed: the write is skipped and the
** device's error flag set, which synchronize() and copies to the host turn into
** KILN_ERR_INDEX (the check would otherwise need a device->host round trip per op).
** The adds use atomicAdd, native on sm_90 for f32, f64, f16, bf16, int32 and int64, except
** INDEX_ADD of whole f32 rows (an embedding's gradient), which sorts the ids and sums each
** id's rows in index order: the same bits every run.
*/
#include "cuda_int.cuh"

#include <cub/device/device_radix_sort.cuh>

namespace {

enum { I_SELECT, I_ADD, I_GATHER, I_SCATTER };

struct IGeom {
  int ndim, dim;
  int64_t shape[KILN_MAX_DIMS]; /* iterated tensor */
  int64_t st_it[KILN_MAX_DIMS];
  int64_t st_other[KILN_MAX_DIMS]; /* the tensor the index points into */
  int64_t st_idx[KILN_MAX_DIMS];   /* 1-d ops: only st_idx[dim] is used */
  int64_t lim;                     /* size of the other tensor along dim */
  int64_t n;
  int *flag;
  int kop;
};

template <class T> __device__ __forceinline__ void kc_atomic_add(T *p, T v) { atomicAdd(p, v); }
template <> __device__ __forceinline__ void kc_atomic_add<int64_t>(int64_t *p, int64_t v) {
  atomicAdd((unsigned long long *)p, (unsigned long long)v);
}

template <class T, class TI, int MODE>
__global__ void __launch_bounds__(KC_THREADS)
    index_kernel(const T *src, const TI *idx, T *out, IGeom g) {
  for (int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; k < g.n;
       k += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = k, o_it = 0, o_other = 0, o_idx = 0, cdim = 0;
    for (int d = g.ndim - 1; d >= 0; d--) {
      int64_t c = r % g.shape[d];
      r /= g.shape[d];
      o_it += c * g.st_it[d];
      if (d == g.dim) cdim = c;
      else o_other += c * g.st_other[d];
      if (MODE == I_GATHER || MODE == I_SCATTER) o_idx += c * g.st_idx[d];
    }
    if (MODE == I_SELECT || MODE == I_ADD) o_idx = cdim * g.st_idx[g.dim];
    int64_t i = (int64_t)idx[o_idx];
    if (i < 0 || i >= g.lim) {
      kc_flag(g.flag, g.kop);
      continue;
    }
    o_other += i * g.st_other[g.dim];
    if constexpr (MODE == I_SELECT || MODE == I_GATHER) out[o_it] = src[o_other];
    else kc_atomic_add<T>(out + o_other, src[o_it]);
  }
}

/* Whole rows along dim 0 of 2-d tensors (an embedding's lookup and its gradient: GPT-2's
** 16384 rows of 768 f32): a thread a 16-byte piece of a row, the row and piece from one
** 32-bit division, where the generic kernel above walks each element's coordinates with
** 64-bit divisions (105 us for GPT-2's lookup on the H100). SELECT copies the piece. */
template <class TI>
__global__ void __launch_bounds__(KC_THREADS)
    rows16_select(const char *src, const TI *idx, char *out, unsigned rows, unsigned vpr, int64_t s_it,
                  int64_t s_other, int64_t s_idx, int64_t lim, int *flag, int kop) {
  const unsigned n = rows * vpr;
  for (unsigned k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += gridDim.x * blockDim.x) {
    const unsigned r = k / vpr, c = k - r * vpr;
    const int64_t i = (int64_t)idx[(int64_t)r * s_idx];
    if (i < 0 || i >= lim) {
      kc_flag(flag, kop);
      continue;
    }
    *reinterpret_cast<uint4 *>(out + r * s_it + (int64_t)c * 16) =
        *reinterpret_cast<const uint4 *>(src + i * s_other + (int64_t)c * 16);
  }
}

/* ADD of whole f32 rows, deterministic: the ids become sort keys (an id out of range: the
** flag, and the key lim, which sorts last and is skipped) with their positions as values;
** cub's radix sort is stable, so each id's positions come out in index order; then the
** thread of (run of equal ids, 16-byte piece) sums the run's pieces in that order and adds
** the sum to out once. The bits are those of the rows summed in order and then added. */
template <class TI>
__global__ void __launch_bounds__(KC_THREADS)
    rows_add_keys(const TI *idx, int64_t s_idx, unsigned rows, int64_t lim, unsigned *key, unsigned *pos, int *flag,
                  int kop) {
  for (unsigned r = blockIdx.x * blockDim.x + threadIdx.x; r < rows; r += gridDim.x * blockDim.x) {
    const int64_t i = (int64_t)idx[(int64_t)r * s_idx];
    const bool bad = i < 0 || i >= lim;
    if (bad) kc_flag(flag, kop);
    key[r] = bad ? (unsigned)lim : (unsigned)i;
    pos[r] = r;
  }
}
__global__ void __launch_bounds__(KC_THREADS)
    rows_add_runs(const char *src, const unsigned *key, const unsigned *pos, char *out, unsigned rows, unsigned vpr,
                  int64_t s_it, int64_t s_other, unsigned lim) {
  const unsigned n = rows * vpr;
  for (unsigned k = blockIdx.x * blockDim.x + threadIdx.x; k < n; k += gridDim.x * blockDim.x) {
    const unsigned j0 = k / vpr, c = k - j0 * vpr, id = key[j0];
    if (id >= lim || (j0 > 0 && key[j0 - 1] == id)) continue; /* not a run's first */
    float4 a = *reinterpret_cast<const float4 *>(src + (int64_t)pos[j0] * s_it + (int64_t)c * 16);
    for (unsigned j = j0 + 1; j < rows && key[j] == id; j++) {
      const float4 v = *reinterpret_cast<const float4 *>(src + (int64_t)pos[j] * s_it + (int64_t)c * 16);
      a.x += v.x, a.y += v.y, a.z += v.z, a.w += v.w;
    }
    float4 *o = reinterpret_cast<float4 *>(out + (int64_t)id * s_other + (int64_t)c * 16);
    float4 b = *o;
    b.x += a.x, b.y += a.y, b.z += a.z, b.w += a.w;
    *o = b;
  }
}

/* The sort and the sums of rows_add_*: scratch from the caching allocator (stream-ordered),
** noted for a graph's capture. */
kiln_status rows_add_sorted(kiln__cuda_dev *d, int device, const kiln__kargs *a, unsigned rows, unsigned vpr,
                            int64_t s_it, int64_t s_other, int64_t s_idx, int64_t lim, int *flag, int kop) {
  int bits = 1;
  while (bits < 32 && ((uint64_t)1 << bits) <= (uint64_t)lim) bits++; /* keys 0..lim */
  size_t tmp = 0;
  if (cub::DeviceRadixSort::SortPairs(NULL, tmp, (const unsigned *)NULL, (unsigned *)NULL, (const unsigned *)NULL,
                                      (unsigned *)NULL, (int)rows, 0, bits, d->stream) != cudaSuccess)
    return kiln_set_error(KILN_ERR_DEVICE, "kiln_index_add: cub radix sort: %s", cudaGetErrorString(cudaGetLastError()));
  const size_t lane = ((size_t)rows * sizeof(unsigned) + 255) / 256 * 256, bytes = 4 * lane + tmp;
  char *scratch = (char *)kiln__cuda_alloc(device, bytes);
  if (!scratch) return kiln_last_error();
  kiln_status st = kiln__cuda_capture_note(device, scratch, bytes);
  unsigned *k0 = (unsigned *)scratch, *p0 = (unsigned *)(scratch + lane), *k1 = (unsigned *)(scratch + 2 * lane),
           *p1 = (unsigned *)(scratch + 3 * lane);
  if (st == KILN_OK) {
    const int kb = kc_blocks(rows, KC_THREADS, d->sm_count);
    if (a->in[1].dtype == KILN_I64)
      rows_add_keys<int64_t><<<kb, KC_THREADS, 0, d->stream>>>((const int64_t *)a->in[1].data, s_idx, rows, lim, k0,
                                                              p0, flag, kop);
    else
      rows_add_keys<int32_t><<<kb, KC_THREADS, 0, d->stream>>>((const int32_t *)a->in[1].data, s_idx, rows, lim, k0,
                                                              p0, flag, kop);
    st = kiln__cuda_launched("index_add (keys)");
  }
  if (st == KILN_OK && cub::DeviceRadixSort::SortPairs(scratch + 4 * lane, tmp, k0, k1, p0, p1, (int)rows, 0, bits,
                                                       d->stream) != cudaSuccess)
    st = kiln_set_error(KILN_ERR_DEVICE, "kiln_index_add: cub radix sort: %s", cudaGetErrorString(cudaGetLastError()));
  if (st == KILN_OK) {
    rows_add_runs<<<kc_blocks((int64_t)rows * vpr, KC_THREADS, d->sm_count), KC_THREADS, 0, d->stream>>>(
        (const char *)a->in[0].data, k1, p1, (char *)a->out[0].data, rows, vpr, s_it, s_other, (unsigned)lim);
    st = kiln__cuda_launched("index_add (rows)");
  }
  kiln__cuda_free(device, scratch, bytes);
  return st;
}

/* The row paths when they fit: INDEX_SELECT (any dtype) or INDEX_ADD (f32, sorted) along
** dim 0 of 2-d views whose rows are dense, a multiple of 16 bytes, and start 16-byte aligned. */
kiln_status try_rows16(kiln__cuda_dev *d, const kiln__kargs *a, const IGeom &g, bool *done) {
  *done = false;
  const bool add = a->op == KILN__K_INDEX_ADD;
  if ((a->op != KILN__K_INDEX_SELECT && !add) || g.ndim != 2 || g.dim != 0) return KILN_OK;
  const size_t es = kc_size(a->out[0].dtype);
  if (add && a->out[0].dtype != KILN_F32) return KILN_OK;
  const int64_t rb = g.shape[1] * (int64_t)es; /* a row's bytes */
  if (g.st_it[1] != 1 || g.st_other[1] != 1 || rb % 16 != 0 || (g.st_it[0] * (int64_t)es) % 16 != 0 ||
      (g.st_other[0] * (int64_t)es) % 16 != 0 || ((uintptr_t)a->in[0].data | (uintptr_t)a->out[0].data) % 16 != 0 ||
      g.shape[0] * (rb / 16) > (int64_t)0x7FFFFFFF)
    return KILN_OK;
  const unsigned rows = (unsigned)g.shape[0], vpr = (unsigned)(rb / 16);
  const int64_t s_it = g.st_it[0] * (int64_t)es, s_other = g.st_other[0] * (int64_t)es, s_idx = g.st_idx[0];
  if (add && g.lim >= (int64_t)0xFFFFFFFF) return KILN_OK; /* ids past 32-bit keys: the atomics */
  *done = true;
  if (add) return rows_add_sorted(d, a->device, a, rows, vpr, s_it, s_other, s_idx, g.lim, g.flag, g.kop);
  const int blocks = kc_blocks((int64_t)rows * vpr, KC_THREADS, d->sm_count);
  const char *src = (const char *)a->in[0].data;
  char *out = (char *)a->out[0].data;
  if (a->in[1].dtype == KILN_I64)
    rows16_select<int64_t><<<blocks, KC_THREADS, 0, d->stream>>>(src, (const int64_t *)a->in[1].data, out, rows, vpr,
                                                                s_it, s_other, s_idx, g.lim, g.flag, g.kop);
  else
    rows16_select<int32_t><<<blocks, KC_THREADS, 0, d->stream>>>(src, (const int32_t *)a->in[1].data, out, rows, vpr,
                                                                s_it, s_other, s_idx, g.lim, g.flag, g.kop);
  return kiln__cuda_launched(kiln__kop_name(a->op));
}

template <class T, class TI, bool ADD>
kiln_status launch(kiln__cuda_dev *d, const kiln__kargs *a, const IGeom &g) {
  const T *src = (const T *)a->in[0].data;
  const TI *idx = (const TI *)a->in[1].data;
  T *out = (T *)a->out[0].data;
  int blocks = kc_blocks(g.n, KC_THREADS, d->sm_count);
  if constexpr (ADD) {
    if (a->op == KILN__K_INDEX_ADD)
      index_kernel<T, TI, I_ADD><<<blocks, KC_THREADS, 0, d->stream>>>(src, idx, out, g);
    else
      index_kernel<T, TI, I_SCATTER><<<blocks, KC_THREADS, 0, d->stream>>>(src, idx, out, g);
  } else {
    if (a->op == KILN__K_INDEX_SELECT)
      index_kernel<T, TI, I_SELECT><<<blocks, KC_THREADS, 0, d->stream>>>(src, idx, out, g);
    else
      index_kernel<T, TI, I_GATHER><<<blocks, KC_THREADS, 0, d->stream>>>(src, idx, out, g);
  }
  return kiln__cuda_launched(kiln__kop_name(a->op));
}

/* Copies move bits (one instantiation per element size); adds need the real type. */
template <class T, bool ADD>
kiln_status by_index(kiln__cuda_dev *d, const kiln__kargs *a, const IGeom &g) {
  if (a->in[1].dtype == KILN_I64) return launch<T, int64_t, ADD>(d, a, g);
  return launch<T, int32_t, ADD>(d, a, g);
}
template <class T> kiln_status adds(kiln__cuda_dev *d, const kiln__kargs *a, const IGeom &g) {
  return by_index<T, true>(d, a, g);
}

kiln_status shape_err(const kiln__kargs *a, const char *what) {
  return kiln_set_error(KILN_ERR_SHAPE, "kiln_%s: %s", kiln__kop_name(a->op), what);
}

bool is_add(kiln__kop op) { return op == KILN__K_INDEX_ADD || op == KILN__K_SCATTER_ADD; }

} // namespace

extern "C" bool kiln__cuda_index_supports(const kiln__kargs *a) {
  kiln_dtype dt = a->out[0].dtype;
  if (a->in[0].dtype != dt || !kc_is_index(a->in[1].dtype) || kc_size(dt) == 0) return false;
  if (is_add(a->op)) return kc_is_float(dt) || dt == KILN_I64 || dt == KILN_I32;
  return true;
}

extern "C" kiln_status kiln__cuda_index(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  if (!kiln__cuda_index_supports(a))
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_%s: dtypes %s (index %s) not supported on cuda",
                          kiln__kop_name(a->op), kiln_dtype_name(a->out[0].dtype),
                          kiln_dtype_name(a->in[1].dtype));
  const kiln__view *src = &a->in[0], *idx = &a->in[1], *out = &a->out[0];
  bool add = is_add(a->op);
  const kiln__view *it = add ? src : out;    /* iterated */
  const kiln__view *other = add ? out : src; /* indexed into */
  int nd = it->ndim;
  int dim = (int)a->i[0];
  if (dim < 0) dim += nd;
  if (nd == 0 || dim < 0 || dim >= nd || other->ndim != nd)
    return shape_err(a, "dim or ndim out of range");
  IGeom g;
  g.ndim = nd;
  g.dim = dim;
  g.n = 1;
  for (int k = 0; k < nd; k++) {
    g.shape[k] = it->shape[k];
    g.st_it[k] = it->strides[k];
    g.st_other[k] = other->strides[k];
    g.n *= it->shape[k];
    if (k != dim && it->shape[k] > other->shape[k])
      return shape_err(a, "index shape is larger than the indexed tensor on a dim not indexed");
  }
  if (a->op == KILN__K_GATHER || a->op == KILN__K_SCATTER_ADD) {
    if (idx->ndim != nd) return shape_err(a, "index must have the ndim of the tensor");
    for (int k = 0; k < nd; k++) {
      if (idx->shape[k] != it->shape[k]) return shape_err(a, "index shape differs");
      g.st_idx[k] = idx->strides[k];
    }
  } else {
    if (idx->ndim != 1 || idx->shape[0] != it->shape[dim])
      return shape_err(a, "index must be 1-d with one entry per selected slice");
    for (int k = 0; k < nd; k++) g.st_idx[k] = 0;
    g.st_idx[dim] = idx->strides[0];
  }
  g.lim = other->shape[dim];
  g.flag = d->err_flag;
  g.kop = (int)a->op;
  if (g.n == 0) return KILN_OK;
  bool done;
  kiln_status rs = try_rows16(d, a, g, &done);
  if (done || rs != KILN_OK) return rs;
  kiln_dtype dt = out->dtype;
  if (add) {
    switch (dt) {
    case KILN_F32: return adds<float>(d, a, g);
    case KILN_F64: return adds<double>(d, a, g);
    case KILN_F16: return adds<__half>(d, a, g);
    case KILN_BF16: return adds<__nv_bfloat16>(d, a, g);
    case KILN_I64: return adds<int64_t>(d, a, g);
    case KILN_I32: return adds<int32_t>(d, a, g);
    default: break;
    }
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_%s: dtype not supported on cuda", kiln__kop_name(a->op));
  }
  switch (kc_size(dt)) {
  case 1: return by_index<uint8_t, false>(d, a, g);
  case 2: return by_index<uint16_t, false>(d, a, g);
  case 4: return by_index<uint32_t, false>(d, a, g);
  case 8: return by_index<uint64_t, false>(d, a, g);
  default: break;
  }
  return kiln_set_error(KILN_ERR_DTYPE, "kiln_%s: bad dtype", kiln__kop_name(a->op));
}
