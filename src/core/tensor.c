/*
** Tensor handles: shapes, lifetime, accessors, kernel views, allocation (kiln_empty), the
** host copy into a new tensor (kiln_from_data) and reading single values. Everything that
** runs a kernel (creation with a value, random fills, copies, transfers of strided
** tensors) is an op in src/ops/: the core never calls up into the op layer
** (tests/test_layering.sh checks it).
*/
#include "kiln_int.h"
#include "half.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static atomic_llong live_tensors;
static atomic_llong next_id;

int64_t kiln_live_tensors(void) { return atomic_load(&live_tensors); }

/* ---- shapes ---- */
int64_t kiln__shape_numel(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int i = 0; i < ndim; i++) n *= shape[i];
  return n;
}

void kiln__contiguous_strides(int ndim, const int64_t *shape, int64_t *strides) {
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    strides[i] = s;
    s *= shape[i] > 1 ? shape[i] : 1;
  }
}

const char *kiln__shape_cstr(int ndim, const int64_t *shape) {
  static _Thread_local char bufs[8][160];
  static _Thread_local int next;
  char *b = bufs[next++ & 7];
  size_t n = 0;
  n += (size_t)snprintf(b + n, 160 - n, "[");
  for (int i = 0; i < ndim && n < 150; i++)
    n += (size_t)snprintf(b + n, 160 - n, i ? ", %lld" : "%lld", (long long)shape[i]);
  snprintf(b + n, 160 - n, "]");
  return b;
}

const char *kiln__tshape(const kiln_tensor *t) {
  return t ? kiln__shape_cstr(t->ndim, t->shape) : "(null)";
}

kiln_status kiln__check_shape(const char *op, int ndim, const int64_t *shape, kiln_dtype dt) {
  if (ndim < 0 || ndim > KILN_MAX_DIMS)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: %d dims requested; kiln tensors have 0 to %d", op,
                          ndim, KILN_MAX_DIMS);
  if (ndim > 0 && !shape)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: shape is NULL for %d dims", op, ndim);
  if ((int)dt < 0 || dt >= KILN_DTYPE__COUNT)
    return kiln_set_error(KILN_ERR_DTYPE, "%s: invalid dtype %d", op, (int)dt);
  /* Every partial product of the dims, times elsize, must fit in 2^62: refuse absurd
  ** shapes before any arithmetic can overflow. A zero dim counts as 1 here, as it does in
  ** kiln__contiguous_strides: [0, 2^40, 2^40] has no elements but its strides would still
  ** overflow (signed overflow is undefined behaviour). */
  const int64_t limit = (int64_t)1 << 62;
  int64_t n = (int64_t)kiln_dtype_size(dt);
  for (int i = 0; i < ndim; i++)
    if (shape[i] < 0)
      return kiln_set_error(KILN_ERR_SHAPE, "%s: negative size %lld in dim %d of shape %s", op,
                            (long long)shape[i], i, kiln__shape_cstr(ndim, shape));
  for (int i = ndim - 1; i >= 0; i--) {
    int64_t d = shape[i] > 1 ? shape[i] : 1;
    if (n > limit / d)
      return kiln_set_error(KILN_ERR_SHAPE, "%s: shape %s of %s is too large (over 2^62 bytes)",
                            op, kiln__shape_cstr(ndim, shape), kiln_dtype_name(dt));
    n *= d;
  }
  return KILN_OK;
}

int kiln__wrap_dim(const char *op, int dim, int ndim) {
  int n = ndim > 0 ? ndim : 1; /* a 0-dim tensor accepts dim 0 and -1, as in PyTorch */
  int d = dim < 0 ? dim + n : dim;
  if (d < 0 || d >= n) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: dim %d is out of range for a tensor of %d dims",
                   op, dim, ndim);
    return -1;
  }
  return d;
}

/* ---- handles ---- */
kiln_tensor *kiln__tensor_make(kiln__storage *s, int64_t offset, int ndim, const int64_t *shape,
                               const int64_t *strides, kiln_dtype dt) {
  kiln_tensor *t = calloc(1, sizeof *t);
  if (!t) {
    kiln_set_error(KILN_ERR_OOM, "kiln: out of host memory for a tensor handle");
    return NULL;
  }
  atomic_init(&t->refcount, 1);
  kiln__storage_retain(s);
  t->storage = s;
  t->offset = offset;
  t->ndim = ndim;
  for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
  if (strides)
    for (int i = 0; i < ndim; i++) t->strides[i] = strides[i];
  else
    kiln__contiguous_strides(ndim, t->shape, t->strides);
  t->dtype = dt;
  t->id = atomic_fetch_add_explicit(&next_id, 1, memory_order_relaxed) + 1;
  atomic_fetch_add_explicit(&live_tensors, 1, memory_order_relaxed);
  return kiln__scope_track(t);
}

kiln_tensor *kiln__tensor_new(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev) {
  if (kiln__check_shape("kiln_empty", ndim, shape, dt) != KILN_OK) return NULL;
  size_t nbytes = (size_t)kiln__shape_numel(ndim, shape) * kiln_dtype_size(dt);
  kiln__storage *s = kiln__storage_new(dev, nbytes);
  if (!s) return NULL;
  kiln_tensor *t = kiln__tensor_make(s, 0, ndim, shape, NULL, dt);
  kiln__storage_release(s); /* the handle holds its own reference */
  return t;
}

kiln_tensor *kiln_tensor_ref(kiln_tensor *t) {
  if (t) atomic_fetch_add_explicit(&t->refcount, 1, memory_order_relaxed);
  return t;
}

void kiln_tensor_free(kiln_tensor *t) {
  if (!t) return;
  if (atomic_fetch_sub_explicit(&t->refcount, 1, memory_order_acq_rel) != 1) return;
  if (t->grad_fn) {
    kiln__node *n = t->grad_fn;
    if (n->out_weak == t) n->out_weak = NULL;
    if (t->grad_fn_index > 0 && n->outs_weak[t->grad_fn_index] == t) n->outs_weak[t->grad_fn_index] = NULL;
    kiln__node_release(n);
  }
  kiln_tensor_free(t->grad);
  kiln_tensor_free(t->amp_copy);
  kiln__storage_release(t->storage);
  atomic_fetch_sub_explicit(&live_tensors, 1, memory_order_relaxed);
  free(t);
}

/* ---- accessors ---- */
int64_t kiln_tensor_id(const kiln_tensor *t) { return t ? t->id : 0; }
int kiln_ndim(const kiln_tensor *t) { return t ? t->ndim : -1; }
int64_t kiln_size(const kiln_tensor *t, int dim) {
  if (!t) return -1;
  int d = kiln__wrap_dim("kiln_size", dim, t->ndim);
  if (d < 0) return -1;
  return t->ndim == 0 ? 1 : t->shape[d];
}
const int64_t *kiln_shape(const kiln_tensor *t) { return t ? t->shape : NULL; }
const int64_t *kiln_strides(const kiln_tensor *t) { return t ? t->strides : NULL; }
int64_t kiln_numel(const kiln_tensor *t) { return t ? kiln__shape_numel(t->ndim, t->shape) : 0; }
kiln_dtype kiln_dtype_of(const kiln_tensor *t) { return t ? t->dtype : KILN_DTYPE__COUNT; }
kiln_device kiln_device_of(const kiln_tensor *t) {
  return t ? t->storage->device : kiln_device_cpu();
}
size_t kiln_nbytes(const kiln_tensor *t) {
  return t ? (size_t)kiln_numel(t) * kiln_dtype_size(t->dtype) : 0;
}

bool kiln_is_contiguous(const kiln_tensor *t) {
  if (!t) return false;
  int64_t s = 1;
  for (int i = t->ndim - 1; i >= 0; i--) {
    if (t->shape[i] == 0) return true;
    if (t->shape[i] != 1 && t->strides[i] != s) return false;
    s *= t->shape[i];
  }
  return true;
}

const char *kiln_shape_str(const kiln_tensor *t, char *buf, size_t n) {
  if (!buf || n == 0) return buf;
  snprintf(buf, n, "%s", t ? kiln__tshape(t) : "(null)");
  return buf;
}

const char *kiln_dims_str(int ndim, const int64_t *shape, char *buf, size_t n) {
  if (!buf || n == 0) return buf;
  snprintf(buf, n, "%s", ndim >= 0 && ndim <= KILN_MAX_DIMS && (shape || !ndim) ? kiln__shape_cstr(ndim, shape) : "(invalid)");
  return buf;
}

void *kiln__tensor_data(const kiln_tensor *t) {
  kiln__storage_bump(t->storage); /* a raw pointer may write */
  return (char *)t->storage->data + (size_t)t->offset * kiln_dtype_size(t->dtype);
}

kiln__view kiln__view_of(const kiln_tensor *t) {
  kiln__view v;
  memset(&v, 0, sizeof v);
  v.data = (char *)t->storage->data + t->offset * (int64_t)kiln_dtype_size(t->dtype);
  v.dtype = t->dtype;
  v.ndim = t->ndim;
  for (int i = 0; i < t->ndim; i++) {
    v.shape[i] = t->shape[i];
    v.strides[i] = t->strides[i];
  }
  return v;
}

kiln__view kiln__view_of_1d(const kiln_tensor *t) {
  kiln__view v = kiln__view_of(t);
  if (v.ndim == 0) {
    v.ndim = 1;
    v.shape[0] = 1;
    v.strides[0] = 1;
  }
  return v;
}

kiln__view kiln__view_broadcast(const kiln_tensor *t, int ndim, const int64_t *shape) {
  kiln__view v = kiln__view_of(t);
  int lead = ndim - t->ndim;
  for (int i = ndim - 1; i >= 0; i--) {
    int j = i - lead;
    v.shape[i] = shape[i];
    v.strides[i] = (j >= 0 && t->shape[j] == shape[i]) ? t->strides[j] : 0;
  }
  v.ndim = ndim;
  return v;
}

/* ---- allocation and host data ----
** Neither runs a kernel, so neither is an op: kiln_empty allocates; kiln_from_data
** allocates and copies the caller's host bytes through the backend's memory vtable (the
** bytes are not an attribute an op record or a trace could carry). The creation ops that
** fill a tensor (full, arange, rand, ...) are in src/ops/ops_create.c. */
kiln_tensor *kiln_empty(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev) {
  return kiln__tensor_new(ndim, shape, dt, dev);
}

kiln_tensor *kiln_from_data(const void *data, int ndim, const int64_t *shape, kiln_dtype dt,
                            kiln_device dev) {
  if (kiln__check_shape("kiln_from_data", ndim, shape, dt) != KILN_OK) return NULL;
  size_t nbytes = (size_t)kiln__shape_numel(ndim, shape) * kiln_dtype_size(dt);
  if (!data && nbytes > 0)
    KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_from_data: data is NULL for shape %s",
                    kiln__shape_cstr(ndim, shape));
  kiln_tensor *t = kiln__tensor_new(ndim, shape, dt, dev);
  if (!t) return NULL;
  if (nbytes > 0) {
    kiln_status st = t->storage->backend->copy_from_host(dev.index, t->storage->data, data, nbytes);
    if (st != KILN_OK) {
      kiln__discard(t);
      return NULL;
    }
  }
  return t;
}

/* ---- reading values ---- */
static double load_as_double(const void *p, kiln_dtype dt) {
  switch (dt) {
  case KILN_F32: return *(const float *)p;
  case KILN_F64: return *(const double *)p;
  case KILN_F16: return kiln__f16_to_f32(*(const uint16_t *)p);
  case KILN_BF16: return kiln__bf16_to_f32(*(const uint16_t *)p);
  case KILN_I64: return (double)*(const int64_t *)p;
  case KILN_I32: return *(const int32_t *)p;
  case KILN_U8: return *(const uint8_t *)p;
  case KILN_BOOL: return *(const uint8_t *)p ? 1.0 : 0.0;
  default: return NAN;
  }
}

double kiln__load_double(const void *p, kiln_dtype dt) { return load_as_double(p, dt); }

double kiln_item(const kiln_tensor *t) {
  if (!t) {
    if (kiln_last_error() == KILN_OK)
      kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_item: NULL tensor");
    return NAN;
  }
  if (kiln_numel(t) != 1) {
    kiln_set_error(KILN_ERR_SHAPE, "kiln_item: tensor of shape %s has %lld elements, not 1",
                   kiln__tshape(t), (long long)kiln_numel(t));
    return NAN;
  }
  unsigned char buf[8];
  size_t es = kiln_dtype_size(t->dtype);
  kiln_device dev = kiln_device_of(t);
  if (t->storage->backend->copy_to_host(dev.index, buf, (char *)t->storage->data + t->offset * (int64_t)es, es) != KILN_OK)
    return NAN;
  return load_as_double(buf, t->dtype);
}

double kiln_get(const kiln_tensor *t, const int64_t *index) {
  if (!t) return NAN;
  int64_t off = t->offset;
  for (int i = 0; i < t->ndim; i++) {
    if (!index || index[i] < 0 || index[i] >= t->shape[i]) {
      kiln_set_error(KILN_ERR_INDEX, "kiln_get: index out of range for shape %s", kiln__tshape(t));
      return NAN;
    }
    off += index[i] * t->strides[i];
  }
  unsigned char buf[8];
  size_t es = kiln_dtype_size(t->dtype);
  kiln_device dev = kiln_device_of(t);
  if (t->storage->backend->copy_to_host(dev.index, buf, (char *)t->storage->data + off * (int64_t)es, es) != KILN_OK)
    return NAN;
  return load_as_double(buf, t->dtype);
}

void *kiln_data_ptr(kiln_tensor *t) {
  if (!t) return NULL;
  if (!t->storage->backend->host_visible) {
    kiln_set_error(KILN_ERR_DEVICE, "kiln_data_ptr: tensor is on %s; copy it with kiln_to_host",
                   kiln__device_cstr(kiln_device_of(t)));
    return NULL;
  }
  if (!kiln_is_contiguous(t)) {
    kiln_set_error(KILN_ERR_STATE, "kiln_data_ptr: tensor %s is not contiguous (use kiln_contiguous)",
                   kiln__tshape(t));
    return NULL;
  }
  kiln__storage_bump(t->storage); /* the program may write through it */
  return (char *)t->storage->data + t->offset * (int64_t)kiln_dtype_size(t->dtype);
}

kiln_tensor *kiln__tensor_alias(const kiln_tensor *t, bool track) {
  kiln_tensor *a = calloc(1, sizeof *a);
  if (!a) {
    kiln_set_error(KILN_ERR_OOM, "kiln: out of host memory for a tensor handle");
    return NULL;
  }
  atomic_init(&a->refcount, 1);
  kiln__storage_retain(t->storage);
  a->storage = t->storage;
  a->offset = t->offset;
  a->ndim = t->ndim;
  memcpy(a->shape, t->shape, sizeof a->shape);
  memcpy(a->strides, t->strides, sizeof a->strides);
  a->dtype = t->dtype;
  a->ones_col = t->ones_col;
  a->id = atomic_fetch_add_explicit(&next_id, 1, memory_order_relaxed) + 1;
  atomic_fetch_add_explicit(&live_tensors, 1, memory_order_relaxed);
  return track ? kiln__scope_track(a) : a;
}
