/* Tensor handles: creation, lifetime, accessors, host transfer, conversion. */
#include "kiln_int.h"
#include "half.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static atomic_llong live_tensors;

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
    if (t->grad_fn->out_weak == t) t->grad_fn->out_weak = NULL;
    kiln__node_release(t->grad_fn);
  }
  kiln_tensor_free(t->grad);
  kiln__storage_release(t->storage);
  atomic_fetch_sub_explicit(&live_tensors, 1, memory_order_relaxed);
  free(t);
}

/* ---- accessors ---- */
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

/* ---- creation ---- */
kiln_tensor *kiln_empty(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev) {
  return kiln__tensor_new(ndim, shape, dt, dev);
}

kiln_tensor *kiln_full(int ndim, const int64_t *shape, double value, kiln_dtype dt, kiln_device dev) {
  kiln_tensor *t = kiln__tensor_new(ndim, shape, dt, dev);
  if (!t) return NULL;
  if (kiln_fill_(t, value) != KILN_OK) {
    kiln__discard(t);
    return NULL;
  }
  return t;
}

kiln_tensor *kiln_zeros(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev) {
  return kiln_full(ndim, shape, 0.0, dt, dev);
}
kiln_tensor *kiln_ones(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev) {
  return kiln_full(ndim, shape, 1.0, dt, dev);
}
kiln_tensor *kiln_scalar(double value, kiln_dtype dt, kiln_device dev) {
  return kiln_full(0, NULL, value, dt, dev);
}
kiln_tensor *kiln_full_like(const kiln_tensor *t, double value) {
  if (!t) return NULL;
  return kiln_full(t->ndim, t->shape, value, t->dtype, kiln_device_of(t));
}
kiln_tensor *kiln_zeros_like(const kiln_tensor *t) { return kiln_full_like(t, 0.0); }
kiln_tensor *kiln_ones_like(const kiln_tensor *t) { return kiln_full_like(t, 1.0); }

static kiln_tensor *run_creation(kiln_tensor *t, kiln__kargs *a) {
  if (!t) return NULL;
  a->n_out = 1;
  a->out[0] = kiln__view_of(t);
  a->device = kiln_device_of(t).index;
  if (kiln__dispatch(kiln_device_of(t), a) != KILN_OK) {
    kiln__discard(t);
    return NULL;
  }
  return t;
}

kiln_tensor *kiln_arange(double start, double end, double step, kiln_dtype dt, kiln_device dev) {
  if (step == 0 || !isfinite(step) || !isfinite(start) || !isfinite(end))
    KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_arange: invalid range start %g end %g step %g",
                    start, end, step);
  double cnt = ceil((end - start) / step);
  if (cnt < 0) cnt = 0;
  if (cnt > (double)((int64_t)1 << 40))
    KILN__FAIL_NULL(KILN_ERR_SHAPE, "kiln_arange: %g elements is too many", cnt);
  int64_t n = (int64_t)cnt;
  kiln__kargs a = {0};
  a.op = KILN__K_ARANGE;
  a.s[0] = start;
  a.s[1] = step;
  return run_creation(kiln__tensor_new(1, &n, dt, dev), &a);
}

kiln_tensor *kiln_linspace(double start, double end, int64_t steps, kiln_dtype dt, kiln_device dev) {
  if (steps < 0)
    KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_linspace: steps must be >= 0, got %lld",
                    (long long)steps);
  kiln__kargs a = {0};
  a.op = KILN__K_ARANGE;
  a.s[0] = start;
  a.s[1] = steps > 1 ? (end - start) / (double)(steps - 1) : 0.0;
  return run_creation(kiln__tensor_new(1, &steps, dt, dev), &a);
}

kiln_tensor *kiln_eye(int64_t n, int64_t m, kiln_dtype dt, kiln_device dev) {
  int64_t shape[2] = {n, m < 0 ? n : m};
  kiln__kargs a = {0};
  a.op = KILN__K_EYE;
  return run_creation(kiln__tensor_new(2, shape, dt, dev), &a);
}

static kiln_tensor *random_fill(kiln_tensor *t, kiln__kop op, double s0, double s1, int64_t i0,
                                int64_t i1, kiln_generator *gen) {
  if (!t) return NULL;
  kiln__kargs a = {0};
  a.op = op;
  a.s[0] = s0;
  a.s[1] = s1;
  a.i[0] = i0;
  a.i[1] = i1;
  kiln__generator_reserve(gen, kiln_numel(t), &a.seed, &a.offset);
  return run_creation(t, &a);
}

kiln_tensor *kiln_rand(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev,
                       kiln_generator *gen) {
  if (!kiln_dtype_is_float(dt))
    KILN__FAIL_NULL(KILN_ERR_DTYPE, "kiln_rand: expected a floating dtype, got %s", kiln_dtype_name(dt));
  return random_fill(kiln__tensor_new(ndim, shape, dt, dev), KILN__K_RAND_UNIFORM, 0, 1, 0, 0, gen);
}

kiln_tensor *kiln_randn(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev,
                        kiln_generator *gen) {
  if (!kiln_dtype_is_float(dt))
    KILN__FAIL_NULL(KILN_ERR_DTYPE, "kiln_randn: expected a floating dtype, got %s", kiln_dtype_name(dt));
  return random_fill(kiln__tensor_new(ndim, shape, dt, dev), KILN__K_RAND_NORMAL, 0, 1, 0, 0, gen);
}

kiln_tensor *kiln_randint(int64_t low, int64_t high, int ndim, const int64_t *shape, kiln_dtype dt,
                          kiln_device dev, kiln_generator *gen) {
  if (high <= low)
    KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_randint: empty range [%lld, %lld)",
                    (long long)low, (long long)high);
  if (dt == KILN_BOOL)
    KILN__FAIL_NULL(KILN_ERR_DTYPE, "kiln_randint: bool is not an integer dtype");
  return random_fill(kiln__tensor_new(ndim, shape, dt, dev), KILN__K_RAND_INT, 0, 0, low, high, gen);
}

static kiln_status refuse_grad_inplace(const char *op, const kiln_tensor *t) {
  if (t->requires_grad && kiln_grad_enabled())
    return kiln_set_error(KILN_ERR_AUTOGRAD,
                          "%s: in-place update of a tensor that requires grad while grad mode "
                          "is on (use kiln_set_grad_enabled(false) around it)",
                          op);
  return KILN_OK;
}

/* uniform_ and normal_: a random kernel into an existing tensor, never recorded. */
static kiln_status random_inplace(const char *op, kiln_tensor *t, kiln__kop kop, double s0,
                                  double s1, kiln_generator *gen) {
  if (!t) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL tensor", op);
  if (!kiln_dtype_is_float(t->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: expected a floating tensor, got %s", op,
                          kiln_dtype_name(t->dtype));
  if (refuse_grad_inplace(op, t) != KILN_OK) return kiln_last_error();
  kiln__kargs a = {0};
  a.op = kop;
  a.s[0] = s0;
  a.s[1] = s1;
  a.n_out = 1;
  a.out[0] = kiln__view_of(t);
  a.device = kiln_device_of(t).index;
  kiln__generator_reserve(gen, kiln_numel(t), &a.seed, &a.offset);
  return kiln__dispatch(kiln_device_of(t), &a);
}

kiln_status kiln_uniform_(kiln_tensor *t, double low, double high, kiln_generator *gen) {
  return random_inplace("kiln_uniform_", t, KILN__K_RAND_UNIFORM, low, high, gen);
}

kiln_status kiln_normal_(kiln_tensor *t, double mean, double std, kiln_generator *gen) {
  return random_inplace("kiln_normal_", t, KILN__K_RAND_NORMAL, mean, std, gen);
}

kiln_tensor *kiln_randperm(int64_t n, kiln_generator *gen) {
  if (n < 0) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_randperm: n must be >= 0, got %lld", (long long)n);
  kiln_tensor *t = kiln__tensor_new(1, &n, KILN_I64, kiln_device_cpu());
  if (!t) return NULL;
  if (kiln__randperm_fill(n, gen, t->storage->data, true) != KILN_OK) {
    kiln__discard(t);
    return NULL;
  }
  return t;
}

kiln_status kiln__randperm_fill(int64_t n, kiln_generator *gen, int64_t *p, bool parallel) {
  for (int64_t i = 0; i < n; i++) p[i] = i;
  if (n <= 1) return KILN_OK;
  /* Fisher-Yates from the generator: one counter block per draw, so the sequence depends
  ** only on the generator state. The draws first (in parallel), then the swaps. */
  int64_t *j = malloc(sizeof(int64_t) * (size_t)(n - 1));
  if (!j) return kiln_set_error(KILN_ERR_OOM, "kiln_randperm: out of host memory for %lld draws", (long long)n);
  kiln__generator_shuffle_draws(gen, n, j, parallel);
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t k = j[n - 1 - i], tmp = p[i];
    p[i] = p[k];
    p[k] = tmp;
  }
  free(j);
  return KILN_OK;
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
kiln_status kiln_to_host(const kiln_tensor *t, void *dst, size_t nbytes) {
  if (!t) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_to_host: NULL tensor");
  size_t need = kiln_nbytes(t);
  if (!dst && need > 0) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_to_host: NULL destination");
  if (nbytes < need)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "kiln_to_host: destination holds %zu bytes; tensor %s of %s needs %zu",
                          nbytes, kiln__tshape(t), kiln_dtype_name(t->dtype), need);
  if (need == 0) return KILN_OK;
  kiln_device dev = kiln_device_of(t);
  const kiln__backend *b = t->storage->backend;
  size_t es = kiln_dtype_size(t->dtype);
  if (kiln_is_contiguous(t))
    return b->copy_to_host(dev.index, dst, (char *)t->storage->data + t->offset * (int64_t)es, need);
  /* Non-contiguous: make it contiguous on its device first (one kernel, one transfer). */
  bool prev = kiln_set_grad_enabled(false);
  kiln_scope_begin();
  kiln_tensor *c = kiln_contiguous((kiln_tensor *)t);
  kiln_status st = c ? b->copy_to_host(dev.index, dst, (char *)c->storage->data + c->offset * (int64_t)es, need)
                     : kiln_last_error();
  kiln_scope_end();
  kiln_set_grad_enabled(prev);
  return st;
}

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
  return (char *)t->storage->data + t->offset * (int64_t)kiln_dtype_size(t->dtype);
}

/* ---- conversion and movement ---- */
kiln_tensor *kiln_contiguous(kiln_tensor *t) {
  if (!t) return NULL;
  if (kiln_is_contiguous(t)) return kiln__scope_track(kiln_tensor_ref(t));
  return kiln_clone(t);
}

kiln_tensor *kiln_to_dtype(kiln_tensor *t, kiln_dtype dt) {
  if (!t) return NULL;
  if ((int)dt < 0 || dt >= KILN_DTYPE__COUNT)
    KILN__FAIL_NULL(KILN_ERR_DTYPE, "kiln_to_dtype: invalid dtype %d", (int)dt);
  if (dt == t->dtype) return kiln__scope_track(kiln_tensor_ref(t));
  return kiln__copy_as(t, dt, kiln_device_of(t), "to_dtype");
}

kiln_tensor *kiln_clone(kiln_tensor *t) {
  if (!t) return NULL;
  return kiln__copy_as(t, t->dtype, kiln_device_of(t), "clone");
}

kiln_tensor *kiln_to_device(kiln_tensor *t, kiln_device dev) {
  if (!t) return NULL;
  if (kiln_device_equal(dev, kiln_device_of(t))) return kiln__scope_track(kiln_tensor_ref(t));
  if (kiln__check_device(dev, "kiln_to_device") != KILN_OK) return NULL;
  return kiln__copy_as(t, t->dtype, dev, "to_device");
}

/* n tensors in one transfer: packed (each at a 256-byte offset) into one host buffer, one
** copy into one device block, and each result a view of its part. A transfer costs the
** host several microseconds whatever its size, and a batch has several fields. */
kiln_status kiln_to_device_many(int n, kiln_tensor *const *ts, kiln_device dev, kiln_tensor **out) {
  if (n < 0 || (n > 0 && (!ts || !out)))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_to_device_many: n must be >= 0 and the arrays given");
  for (int i = 0; i < n; i++) out[i] = NULL;
  for (int i = 0; i < n; i++)
    if (!ts[i]) return kiln_last_error() != KILN_OK ? kiln_last_error()
                                                   : kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_to_device_many: tensor %d is NULL", i);
  if (kiln__check_device(dev, "kiln_to_device_many") != KILN_OK) return kiln_last_error();
  /* one block only when every tensor is a compact host tensor (the loader's case) and they
  ** are small together: past that, per-transfer costs no longer matter and packing would
  ** add a copy (and fresh pages for the packing buffer: 2x slower at batch 8192) */
  bool pack = dev.type != KILN_DEVICE_CPU && n > 1;
  size_t total = 0;
  for (int i = 0; i < n && pack; i++) {
    if (ts[i]->storage->device.type != KILN_DEVICE_CPU || !kiln_is_contiguous(ts[i]) || ts[i]->requires_grad)
      pack = false;
    total += (kiln_nbytes(ts[i]) + 255) / 256 * 256;
  }
  if (total > ((size_t)128 << 10)) pack = false;
  if (!pack) {
    for (int i = 0; i < n; i++)
      if (!(out[i] = kiln_to_device(ts[i], dev))) {
        kiln_status st = kiln_last_error();
        for (int k = 0; k < i; k++) kiln__discard(out[k]), out[k] = NULL;
        return st;
      }
    return KILN_OK;
  }
  char *host = malloc(total ? total : 1);
  if (!host) return kiln_set_error(KILN_ERR_OOM, "kiln_to_device_many: out of host memory (%zu bytes)", total);
  size_t off = 0;
  for (int i = 0; i < n; i++) {
    memcpy(host + off, kiln__view_of(ts[i]).data, kiln_nbytes(ts[i]));
    off += (kiln_nbytes(ts[i]) + 255) / 256 * 256;
  }
  kiln__storage *s = kiln__storage_new(dev, total);
  if (s) s->packed = true;
  kiln_status st = s ? s->backend->copy_from_host(dev.index, s->data, host, total) : kiln_last_error();
  free(host);
  off = 0;
  for (int i = 0; i < n && st == KILN_OK; i++) {
    size_t es = kiln_dtype_size(ts[i]->dtype);
    out[i] = kiln__tensor_make(s, (int64_t)(off / es), ts[i]->ndim, ts[i]->shape, NULL, ts[i]->dtype);
    if (!out[i]) st = kiln_last_error();
    off += (kiln_nbytes(ts[i]) + 255) / 256 * 256;
  }
  kiln__storage_release(s); /* the views hold it */
  if (st != KILN_OK)
    for (int i = 0; i < n; i++) kiln__discard(out[i]), out[i] = NULL;
  return st;
}

/* Whether src can be copied into dst as bytes: compact, one dtype and shape (no cast, no
** broadcast), dst not refused by kiln_copy_ (which then reports why). */
static bool copy_as_bytes(const kiln_tensor *dst, const kiln_tensor *src) {
  return dst && src && kiln_is_contiguous(dst) && kiln_is_contiguous(src) && src->dtype == dst->dtype &&
         src->ndim == dst->ndim && memcmp(src->shape, dst->shape, sizeof(int64_t) * (size_t)dst->ndim) == 0 &&
         !(dst->requires_grad && kiln_grad_enabled());
}

static size_t byte_offset(const kiln_tensor *t) { return (size_t)t->offset * kiln_dtype_size(t->dtype); }

/* kiln_copy_ for n pairs. When the destinations are the views of one block made by
** kiln_to_device_many (so the bytes between them are padding nobody reads), the whole span
** goes in one transfer: from compact host tensors of their shapes and dtypes, or on the
** device from views of one other block laid out the same way (a staged loader batch). A
** captured step's static inputs are refilled so every step. Other pairs on one device
** with one dtype and shape take one device copy each instead of a copy kernel. */
kiln_status kiln_copy_many_(int n, kiln_tensor *const *dsts, kiln_tensor *const *srcs) {
  if (n < 0 || (n > 0 && (!dsts || !srcs)))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_copy_many_: n must be >= 0 and the arrays given");
  bool one = n > 1, from_host = n > 0 && srcs[0] && srcs[0]->storage->device.type == KILN_DEVICE_CPU;
  size_t lo = SIZE_MAX, hi = 0;
  int64_t delta = 0; /* device to device: a source's byte offset minus its destination's */
  for (int i = 0; i < n && one; i++) {
    kiln_tensor *d = dsts[i], *s = srcs[i];
    if (!copy_as_bytes(d, s) || !d->storage->packed || d->storage != dsts[0]->storage) {
      one = false;
      break;
    }
    if (from_host) {
      one = s->storage->device.type == KILN_DEVICE_CPU;
    } else {
      if (i == 0) delta = (int64_t)byte_offset(s) - (int64_t)byte_offset(d);
      one = s->storage == srcs[0]->storage && s->storage != d->storage &&
            kiln_device_equal(s->storage->device, d->storage->device) &&
            (int64_t)byte_offset(s) - (int64_t)byte_offset(d) == delta;
    }
    size_t off = byte_offset(d);
    if (off < lo) lo = off;
    if (off + kiln_nbytes(d) > hi) hi = off + kiln_nbytes(d);
  }
  if (one && hi > lo) {
    kiln__storage *st = dsts[0]->storage;
    if (!from_host) /* both spans lie inside their blocks: each view does */
      return st->backend->copy_device(st->device.index, (char *)st->data + lo,
                                      (char *)srcs[0]->storage->data + (int64_t)lo + delta, hi - lo);
    char *host = calloc(hi - lo, 1);
    if (!host) return kiln_set_error(KILN_ERR_OOM, "kiln_copy_many_: out of host memory (%zu bytes)", hi - lo);
    for (int i = 0; i < n; i++)
      memcpy(host + byte_offset(dsts[i]) - lo, kiln__view_of(srcs[i]).data, kiln_nbytes(srcs[i]));
    kiln_status rc = st->backend->copy_from_host(st->device.index, (char *)st->data + lo, host, hi - lo);
    free(host);
    return rc;
  }
  for (int i = 0; i < n; i++) {
    kiln_tensor *d = dsts ? dsts[i] : NULL, *s = srcs ? srcs[i] : NULL;
    kiln_status st;
    if (copy_as_bytes(d, s) && d->storage != s->storage &&
        kiln_device_equal(d->storage->device, s->storage->device))
      st = kiln_nbytes(d) ? d->storage->backend->copy_device(d->storage->device.index, kiln__view_of(d).data,
                                                             kiln__view_of(s).data, kiln_nbytes(d))
                          : KILN_OK;
    else
      st = kiln_copy_(d, s);
    if (st != KILN_OK) {
      char msg[512];
      snprintf(msg, sizeof msg, "%s", kiln_last_error_message());
      return kiln_set_error(st, "%s (pair %d)", msg, i);
    }
  }
  return KILN_OK;
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
  atomic_fetch_add_explicit(&live_tensors, 1, memory_order_relaxed);
  return track ? kiln__scope_track(a) : a;
}
