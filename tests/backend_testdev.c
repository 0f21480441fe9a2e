/*
** The test-only backend "testdev" (backend_testdev.h says what it is for). It uses
** nothing of kiln but backend/backend.h and the public header: the registry API, the
** kernel-argument structs and kiln_set_error.
*/
#include "backend_testdev.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* ---- memory: host malloc, with statistics of its own ---- */
static atomic_llong mem_allocated, mem_peak, mem_allocs;

static void *td_alloc(int device, size_t n) {
  (void)device;
  void *p = malloc(n ? n : 1);
  if (!p) {
    kiln_set_error(KILN_ERR_OOM, "testdev: out of memory: tried to allocate %zu bytes", n);
    return NULL;
  }
  long long now = atomic_fetch_add(&mem_allocated, (long long)n) + (long long)n;
  long long peak = atomic_load(&mem_peak);
  while (now > peak && !atomic_compare_exchange_weak(&mem_peak, &peak, now)) {
  }
  atomic_fetch_add(&mem_allocs, 1);
  return p;
}

static void td_free(int device, void *p, size_t n) {
  (void)device;
  if (!p) return;
  free(p);
  atomic_fetch_sub(&mem_allocated, (long long)n);
}

static kiln_status td_memcpy(int device, void *dst, const void *src, size_t n) {
  (void)device;
  if (n) memcpy(dst, src, n);
  return KILN_OK;
}

static kiln_status td_memset_zero(int device, void *p, size_t n) {
  (void)device;
  if (n) memset(p, 0, n);
  return KILN_OK;
}

static kiln_status td_synchronize(int device) {
  (void)device;
  return KILN_OK;
}

static kiln_status td_memory_stats(int device, kiln_memory_stats *out) {
  (void)device;
  out->allocated = out->reserved = atomic_load(&mem_allocated);
  out->peak_allocated = atomic_load(&mem_peak);
  out->num_allocs = out->num_device_allocs = atomic_load(&mem_allocs);
  return KILN_OK;
}

static void td_reset_peak(int device) {
  (void)device;
  atomic_store(&mem_peak, atomic_load(&mem_allocated));
}

static kiln_status td_probe(const char **why) {
  if (why) *why = NULL;
  return KILN_OK;
}

static int td_device_count(void) { return 1; }

/* ---- element access: every dtype through double (exact for f32/f64 arithmetic: a sum
** or product of two floats rounded once from double is the correctly rounded f32 result)
** or through int64 between integer dtypes ---- */
static double ld(const kiln__view *v, int64_t k) {
  const char *p = (const char *)v->data + k * (int64_t)kiln_dtype_size(v->dtype);
  switch (v->dtype) {
  case KILN_F32: return *(const float *)p;
  case KILN_F64: return *(const double *)p;
  case KILN_F16: return kiln_f16_to_f32(*(const uint16_t *)p);
  case KILN_BF16: return kiln_bf16_to_f32(*(const uint16_t *)p);
  case KILN_I64: return (double)*(const int64_t *)p;
  case KILN_I32: return *(const int32_t *)p;
  case KILN_U8: return *(const uint8_t *)p;
  case KILN_BOOL: return *(const uint8_t *)p != 0;
  default: return 0;
  }
}

static void st(const kiln__view *v, int64_t k, double x) {
  char *p = (char *)v->data + k * (int64_t)kiln_dtype_size(v->dtype);
  switch (v->dtype) {
  case KILN_F32: *(float *)p = (float)x; break;
  case KILN_F64: *(double *)p = x; break;
  case KILN_F16: *(uint16_t *)p = kiln_f32_to_f16((float)x); break;
  case KILN_BF16: *(uint16_t *)p = kiln_f32_to_bf16((float)x); break;
  case KILN_I64: *(int64_t *)p = (int64_t)x; break;
  case KILN_I32: *(int32_t *)p = (int32_t)x; break;
  case KILN_U8: *(uint8_t *)p = (uint8_t)(int64_t)x; break;
  case KILN_BOOL: *(uint8_t *)p = x != 0; break;
  default: break;
  }
}

static bool is_int(kiln_dtype dt) { return !kiln_dtype_is_float(dt); }

static int64_t ld_int(const kiln__view *v, int64_t k) {
  const char *p = (const char *)v->data + k * (int64_t)kiln_dtype_size(v->dtype);
  switch (v->dtype) {
  case KILN_I64: return *(const int64_t *)p;
  case KILN_I32: return *(const int32_t *)p;
  case KILN_BOOL: return *(const uint8_t *)p != 0;
  default: return *(const uint8_t *)p;
  }
}

static void st_int(const kiln__view *v, int64_t k, int64_t x) {
  char *p = (char *)v->data + k * (int64_t)kiln_dtype_size(v->dtype);
  switch (v->dtype) {
  case KILN_I64: *(int64_t *)p = x; break;
  case KILN_I32: *(int32_t *)p = (int32_t)x; break;
  case KILN_BOOL: *(uint8_t *)p = x != 0; break;
  default: *(uint8_t *)p = (uint8_t)x; break;
  }
}

/* Element offset of the multi-index idx in v. */
static int64_t off(const kiln__view *v, const int64_t *idx) {
  int64_t o = 0;
  for (int d = 0; d < v->ndim; d++) o += idx[d] * v->strides[d];
  return o;
}

static bool next(int ndim, const int64_t *shape, int64_t *idx) {
  for (int d = ndim - 1; d >= 0; d--) {
    if (++idx[d] < shape[d]) return true;
    idx[d] = 0;
  }
  return false;
}

static int64_t numel(const kiln__view *v) {
  int64_t n = 1;
  for (int d = 0; d < v->ndim; d++) n *= v->shape[d];
  return n;
}

/* ---- kernels ---- */
static atomic_llong calls[KILN__K_COUNT];

static kiln_status td_copy(const kiln__kargs *a) {
  const kiln__view *in = &a->in[0], *out = &a->out[0];
  atomic_fetch_add(&calls[KILN__K_COPY], 1);
  if (numel(out) == 0) return KILN_OK;
  size_t es = kiln_dtype_size(out->dtype);
  int64_t idx[KILN_MAX_DIMS] = {0};
  do {
    int64_t i = off(in, idx), o = off(out, idx);
    if (in->dtype == out->dtype)
      memcpy((char *)out->data + o * (int64_t)es, (const char *)in->data + i * (int64_t)es, es);
    else if (is_int(in->dtype) && is_int(out->dtype))
      st_int(out, o, ld_int(in, i));
    else
      st(out, o, ld(in, i));
  } while (next(out->ndim, out->shape, idx));
  return KILN_OK;
}

static kiln_status td_fill(const kiln__kargs *a) {
  const kiln__view *out = &a->out[0];
  atomic_fetch_add(&calls[KILN__K_FILL], 1);
  if (numel(out) == 0) return KILN_OK;
  int64_t idx[KILN_MAX_DIMS] = {0};
  do st(out, off(out, idx), a->s[0]);
  while (next(out->ndim, out->shape, idx));
  return KILN_OK;
}

/* ADD (out = in0 + s0*in1), MUL, RELU: in f64, rounded once to the output's dtype. */
static kiln_status td_elementwise(const kiln__kargs *a) {
  const kiln__view *out = &a->out[0];
  atomic_fetch_add(&calls[a->op], 1);
  if (numel(out) == 0) return KILN_OK;
  int64_t idx[KILN_MAX_DIMS] = {0};
  do {
    double x = ld(&a->in[0], off(&a->in[0], idx)), r;
    if (a->op == KILN__K_RELU) r = x > 0 ? x : (x != x ? x : 0.0); /* NaN stays NaN */
    else {
      double y = ld(&a->in[1], off(&a->in[1], idx));
      r = a->op == KILN__K_ADD ? x + a->s[0] * y : x * y;
    }
    st(out, off(out, idx), r);
  } while (next(out->ndim, out->shape, idx));
  return KILN_OK;
}

/* SUM: out0 has in0's ndim; a dim is reduced where out0's size is 1 (summing a size-1 dim
** or not is the same). Accumulates in f64 in a scratch array in out0's C order. */
static kiln_status td_sum(const kiln__kargs *a) {
  const kiln__view *in = &a->in[0], *out = &a->out[0];
  atomic_fetch_add(&calls[KILN__K_SUM], 1);
  int64_t no = numel(out);
  if (no == 0) return KILN_OK;
  double *acc = calloc((size_t)no, sizeof(double));
  if (!acc) return kiln_set_error(KILN_ERR_OOM, "testdev: sum: out of host memory");
  int64_t idx[KILN_MAX_DIMS] = {0};
  if (numel(in) > 0) do {
      int64_t k = 0;
      for (int d = 0; d < out->ndim; d++) k = k * out->shape[d] + (out->shape[d] == 1 ? 0 : idx[d]);
      acc[k] += ld(in, off(in, idx));
    } while (next(in->ndim, in->shape, idx));
  int64_t k = 0;
  memset(idx, 0, sizeof idx);
  do st(out, off(out, idx), acc[k++]);
  while (next(out->ndim, out->shape, idx));
  free(acc);
  return KILN_OK;
}

/* COPY and FILL take every dtype; the arithmetic kernels only f32 and f64 views. */
static bool td_supports(const kiln__kargs *a) {
  if (a->op == KILN__K_COPY || a->op == KILN__K_FILL) return true;
  for (int i = 0; i < a->n_in; i++)
    if (a->in[i].dtype != KILN_F32 && a->in[i].dtype != KILN_F64) return false;
  for (int i = 0; i < a->n_out; i++)
    if (a->out[i].dtype != KILN_F32 && a->out[i].dtype != KILN_F64) return false;
  return true;
}

static const kiln__backend testdev = {
    .name = "testdev",
    .type = KILN__DEVICE_TYPE_ANY, /* the registry gives it an id */
    .host_visible = false,         /* host memory, but treated as a device's */
    .probe = td_probe,
    .device_count = td_device_count,
    .alloc = td_alloc,
    .free = td_free,
    .copy_to_host = td_memcpy,
    .copy_from_host = td_memcpy,
    .copy_device = td_memcpy,
    .memset_zero = td_memset_zero,
    .synchronize = td_synchronize,
    .memory_stats = td_memory_stats,
    .reset_peak = td_reset_peak,
    .kernels =
        {
            [KILN__K_COPY] = td_copy,
            [KILN__K_FILL] = td_fill,
            [KILN__K_ADD] = td_elementwise,
            [KILN__K_MUL] = td_elementwise,
            [KILN__K_RELU] = td_elementwise,
            [KILN__K_SUM] = td_sum,
        },
    .supports = td_supports,
    /* mark, graph, async, device_info, bandwidth: NULL; best_rank 0 */
};

kiln_device_type h_testdev_register(void) { return kiln__backend_register(&testdev); }

kiln_device h_testdev_device(void) {
  kiln_device d = {h_testdev_register(), 0};
  return d;
}

const kiln__backend *h_testdev_backend(void) { return &testdev; }

int64_t h_testdev_calls(kiln__kop op) {
  return (int)op >= 0 && op < KILN__K_COUNT ? (int64_t)atomic_load(&calls[op]) : 0;
}

void h_testdev_reset_calls(void) {
  for (int k = 0; k < KILN__K_COUNT; k++) atomic_store(&calls[k], 0);
}
