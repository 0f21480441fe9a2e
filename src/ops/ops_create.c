/*
** Creation ops: full/zeros/ones (and their _like forms), scalar tensors, arange, linspace,
** eye, the random fills (rand, randn, randint, randperm) and the in-place random fills
** (uniform_, normal_). Each is a descriptor on the one call path (op.h): the creation ops
** have no tensor inputs (KILN__OP_CREATION), so their infer takes the device from the
** attribute record and checks it and the shape; the path allocates the output and forward
** runs one kernel into it. None is differentiable: a new tensor has no history.
**
** kiln_empty (an allocation, no kernel) and kiln_from_data (a host copy through the
** backend's memory vtable, no kernel) stay in src/core/tensor.c: neither runs an op, and
** the host bytes kiln_from_data copies are not an attribute a trace could carry.
*/
#include "ops/op.h"

#include <math.h>
#include <string.h>

/* ---- the record every shaped creation op fills ----
** shape/dtype/device name the output; a and b are the op's scalars (value; low, high;
** mean, std), named per op by its field table. The record holds the dims inline; ndim is
** what the caller passed (infer refuses a bad one), n_dims the count observers read (0
** unless shape holds ndim valid dims: observers see the record before infer runs), and
** null_shape keeps "ndim > 0 with a NULL shape" for infer to refuse. */
typedef struct attrs_create {
  int64_t shape[KILN_MAX_DIMS];
  int ndim, n_dims;
  kiln_dtype dtype;
  kiln_device device;
  double a, b;
  int64_t low, high;   /* randint */
  kiln_generator *gen; /* random fills; not an attribute (the (seed, offset) it gives is
                       ** reserved in forward, as the kernel needs it) */
  bool null_shape;
} attrs_create;

static attrs_create shaped(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev) {
  attrs_create r;
  r.ndim = ndim;
  r.null_shape = ndim > 0 && !shape;
  r.n_dims = ndim > 0 && ndim <= KILN_MAX_DIMS && shape ? ndim : 0;
  if (r.n_dims) memcpy(r.shape, shape, (size_t)ndim * sizeof(int64_t));
  r.dtype = dt;
  r.device = dev;
  r.a = r.b = 0.0;
  r.low = r.high = 0;
  r.gen = NULL;
  return r;
}

#define F_SHAPE KILN__FIELD_INTS(attrs_create, shape, n_dims)
#define F_DTYPE KILN__FIELD(attrs_create, dtype, KILN__A_DTYPE)
#define F_DEVICE KILN__FIELD(attrs_create, device, KILN__A_DEVICE)
#define F_SCALAR(name, f) {name, KILN__A_FLOAT, offsetof(attrs_create, f), 0, NULL}

static const kiln__attr_field f_shaped[] = {F_SHAPE, F_DTYPE, F_DEVICE};
static const kiln__attr_field f_full[] = {F_SHAPE, F_DTYPE, F_DEVICE, F_SCALAR("value", a)};
static const kiln__attr_field f_randint[] = {F_SHAPE, F_DTYPE, F_DEVICE, KILN__FIELD(attrs_create, low, KILN__A_INT),
                                             KILN__FIELD(attrs_create, high, KILN__A_INT)};

/* The checks every shaped creation makes, in the order kiln__tensor_new made them before
** the op layer (shape and dtype, then the device); the output is the record's. */
static kiln_status shaped_infer(kiln__op_ctx *c) {
  const attrs_create *p = c->attrs;
  if (kiln__check_shape(c->op->api, p->ndim, p->null_shape ? NULL : p->shape, p->dtype) != KILN_OK ||
      kiln__check_device(p->device, c->op->api) != KILN_OK)
    return kiln_last_error();
  c->device = p->device;
  kiln__op_meta(c, 0, p->ndim, p->shape, p->dtype);
  return KILN_OK;
}

/* ---- full, zeros, ones, scalar and the _like forms ---- */
static kiln_status full_forward(kiln__op_ctx *c) {
  kiln__kargs k = {0};
  k.op = KILN__K_FILL;
  k.s[0] = ((const attrs_create *)c->attrs)->a;
  return kiln__run_into(c->out[0], &k);
}

#define FULL_OP(fname, opname, api_name, fields, nfields)                                  \
  static const kiln__op op_##fname = {                                                    \
      .name = opname, .api = api_name, .n_in = 0, .n_out = 1, .flags = KILN__OP_CREATION, \
      .n_kernels = 1, .kernels = {KILN__K_FILL}, .attrs = fields, .n_attrs = nfields,     \
      .attr_size = sizeof(attrs_create), .infer = shaped_infer, .forward = full_forward};
FULL_OP(full, "full", "kiln_full", f_full, 4)
FULL_OP(zeros, "zeros", "kiln_zeros", f_shaped, 3)
FULL_OP(ones, "ones", "kiln_ones", f_shaped, 3)
FULL_OP(scalar, "scalar_tensor", "kiln_scalar", f_full, 4)
FULL_OP(full_like, "full_like", "kiln_full_like", f_full, 4)
FULL_OP(zeros_like, "zeros_like", "kiln_zeros_like", f_shaped, 3)
FULL_OP(ones_like, "ones_like", "kiln_ones_like", f_shaped, 3)

static kiln_tensor *full(const kiln__op *op, int ndim, const int64_t *shape, double value, kiln_dtype dt,
                         kiln_device dev) {
  attrs_create p = shaped(ndim, shape, dt, dev);
  p.a = value;
  return kiln__op_call(op, 0, NULL, &p, NULL);
}

kiln_tensor *kiln_full(int ndim, const int64_t *shape, double value, kiln_dtype dt, kiln_device dev) {
  return full(&op_full, ndim, shape, value, dt, dev);
}
kiln_tensor *kiln_zeros(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev) {
  return full(&op_zeros, ndim, shape, 0.0, dt, dev);
}
kiln_tensor *kiln_ones(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev) {
  return full(&op_ones, ndim, shape, 1.0, dt, dev);
}
kiln_tensor *kiln_scalar(double value, kiln_dtype dt, kiln_device dev) {
  return full(&op_scalar, 0, NULL, value, dt, dev);
}
/* The _like forms take their shape, dtype and device from t and no tensor input: the
** result does not depend on t's values (a NULL t gives NULL, leaving the last error). A
** channels-last t gives a channels-last result (PyTorch's preserve_format: an optimizer's
** state then has its parameter's layout): made as (N, H, W, C) and seen through a permute. */
static kiln_tensor *full_like(const kiln__op *op, const kiln_tensor *t, double value) {
  if (!t) return NULL;
  if (!kiln__is_channels_last(t)) return full(op, t->ndim, t->shape, value, t->dtype, kiln_device_of(t));
  static const int to_nchw[4] = {0, 3, 1, 2};
  int64_t nhwc[4] = {t->shape[0], t->shape[2], t->shape[3], t->shape[1]};
  kiln_scope_begin();
  kiln_tensor *r = kiln_permute(full(op, 4, nhwc, value, t->dtype, kiln_device_of(t)), 4, to_nchw);
  return kiln__scope_return(r);
}
kiln_tensor *kiln_full_like(const kiln_tensor *t, double value) { return full_like(&op_full_like, t, value); }
kiln_tensor *kiln_zeros_like(const kiln_tensor *t) { return full_like(&op_zeros_like, t, 0.0); }
kiln_tensor *kiln_ones_like(const kiln_tensor *t) { return full_like(&op_ones_like, t, 1.0); }

/* ---- arange, linspace, eye ---- */
typedef struct attrs_range {
  double start, end, step; /* arange */
  int64_t steps;           /* linspace */
  int64_t n, m;            /* eye */
  kiln_dtype dtype;
  kiln_device device;
} attrs_range;
#define R_DTYPE KILN__FIELD(attrs_range, dtype, KILN__A_DTYPE)
#define R_DEVICE KILN__FIELD(attrs_range, device, KILN__A_DEVICE)
static const kiln__attr_field f_arange[] = {KILN__FIELD(attrs_range, start, KILN__A_FLOAT),
                                            KILN__FIELD(attrs_range, end, KILN__A_FLOAT),
                                            KILN__FIELD(attrs_range, step, KILN__A_FLOAT), R_DTYPE, R_DEVICE};
static const kiln__attr_field f_linspace[] = {KILN__FIELD(attrs_range, start, KILN__A_FLOAT),
                                              KILN__FIELD(attrs_range, end, KILN__A_FLOAT),
                                              KILN__FIELD(attrs_range, steps, KILN__A_INT), R_DTYPE, R_DEVICE};
static const kiln__attr_field f_eye[] = {KILN__FIELD(attrs_range, n, KILN__A_INT), KILN__FIELD(attrs_range, m, KILN__A_INT),
                                         R_DTYPE, R_DEVICE};

static kiln_status range_out(kiln__op_ctx *c, int ndim, const int64_t *shape) {
  const attrs_range *p = c->attrs;
  if (kiln__check_shape(c->op->api, ndim, shape, p->dtype) != KILN_OK ||
      kiln__check_device(p->device, c->op->api) != KILN_OK)
    return kiln_last_error();
  c->device = p->device;
  kiln__op_meta(c, 0, ndim, shape, p->dtype);
  return KILN_OK;
}

static kiln_status arange_infer(kiln__op_ctx *c) {
  const attrs_range *p = c->attrs;
  if (p->step == 0 || !isfinite(p->step) || !isfinite(p->start) || !isfinite(p->end))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_arange: invalid range start %g end %g step %g", p->start,
                          p->end, p->step);
  double cnt = ceil((p->end - p->start) / p->step);
  if (cnt < 0) cnt = 0;
  if (cnt > (double)((int64_t)1 << 40)) return kiln_set_error(KILN_ERR_SHAPE, "kiln_arange: %g elements is too many", cnt);
  int64_t n = (int64_t)cnt;
  return range_out(c, 1, &n);
}
static kiln_status linspace_infer(kiln__op_ctx *c) {
  const attrs_range *p = c->attrs;
  if (p->steps < 0)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_linspace: steps must be >= 0, got %lld", (long long)p->steps);
  return range_out(c, 1, &p->steps);
}
static kiln_status eye_infer(kiln__op_ctx *c) {
  const attrs_range *p = c->attrs;
  int64_t shape[2] = {p->n, p->m < 0 ? p->n : p->m};
  return range_out(c, 2, shape);
}

/* arange and linspace share the kernel: element i = start + i * step. */
static kiln_status arange_forward(kiln__op_ctx *c) {
  const attrs_range *p = c->attrs;
  kiln__kargs k = {0};
  k.op = KILN__K_ARANGE;
  k.s[0] = p->start;
  k.s[1] = p->step;
  return kiln__run_into(c->out[0], &k);
}
static kiln_status linspace_forward(kiln__op_ctx *c) {
  const attrs_range *p = c->attrs;
  kiln__kargs k = {0};
  k.op = KILN__K_ARANGE;
  k.s[0] = p->start;
  k.s[1] = p->steps > 1 ? (p->end - p->start) / (double)(p->steps - 1) : 0.0;
  return kiln__run_into(c->out[0], &k);
}
static kiln_status eye_forward(kiln__op_ctx *c) {
  kiln__kargs k = {0};
  k.op = KILN__K_EYE;
  return kiln__run_into(c->out[0], &k);
}

#define RANGE_OP(fname, kop, fields, nfields)                                              \
  static const kiln__op op_##fname = {                                                    \
      .name = #fname, .api = "kiln_" #fname, .n_in = 0, .n_out = 1,                       \
      .flags = KILN__OP_CREATION, .n_kernels = 1, .kernels = {kop}, .attrs = fields,      \
      .n_attrs = nfields, .attr_size = sizeof(attrs_range), .infer = fname##_infer,       \
      .forward = fname##_forward};
RANGE_OP(arange, KILN__K_ARANGE, f_arange, 5)
RANGE_OP(linspace, KILN__K_ARANGE, f_linspace, 5)
RANGE_OP(eye, KILN__K_EYE, f_eye, 4)

kiln_tensor *kiln_arange(double start, double end, double step, kiln_dtype dt, kiln_device dev) {
  attrs_range p = {.start = start, .end = end, .step = step, .dtype = dt, .device = dev};
  return kiln__op_call(&op_arange, 0, NULL, &p, NULL);
}
kiln_tensor *kiln_linspace(double start, double end, int64_t steps, kiln_dtype dt, kiln_device dev) {
  attrs_range p = {.start = start, .end = end, .steps = steps, .dtype = dt, .device = dev};
  return kiln__op_call(&op_linspace, 0, NULL, &p, NULL);
}
kiln_tensor *kiln_eye(int64_t n, int64_t m, kiln_dtype dt, kiln_device dev) {
  attrs_range p = {.n = n, .m = m, .dtype = dt, .device = dev};
  return kiln__op_call(&op_eye, 0, NULL, &p, NULL);
}

/* ---- random fills (never recorded: KILN__OP_NO_GRAD) ----
** The generator's counters are reserved in forward, after the checks and the allocation
** succeeded, so a refused call leaves the generator where it was. */
static kiln_status random_run(kiln__op_ctx *c, kiln_tensor *t) {
  const attrs_create *p = c->attrs;
  kiln__kargs k = {0};
  k.op = c->op->kernels[0];
  k.s[0] = p->a;
  k.s[1] = p->b;
  k.i[0] = p->low;
  k.i[1] = p->high;
  kiln__generator_reserve(p->gen, kiln_numel(t), &k.seed, &k.offset);
  return kiln__run_into(t, &k);
}
static kiln_status random_forward(kiln__op_ctx *c) { return random_run(c, c->out[0]); }

static kiln_status rand_float_infer(kiln__op_ctx *c) {
  const attrs_create *p = c->attrs;
  if (!kiln_dtype_is_float(p->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: expected a floating dtype, got %s", c->op->api, kiln_dtype_name(p->dtype));
  return shaped_infer(c);
}
static kiln_status randint_infer(kiln__op_ctx *c) {
  const attrs_create *p = c->attrs;
  if (p->high <= p->low)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_randint: empty range [%lld, %lld)", (long long)p->low,
                          (long long)p->high);
  if (p->dtype == KILN_BOOL) return kiln_set_error(KILN_ERR_DTYPE, "kiln_randint: bool is not an integer dtype");
  return shaped_infer(c);
}

#define RANDOM_OP(fname, kop, inf, fields, nfields)                                       \
  static const kiln__op op_##fname = {                                                    \
      .name = #fname, .api = "kiln_" #fname, .n_in = 0, .n_out = 1,                       \
      .flags = KILN__OP_CREATION | KILN__OP_NO_GRAD, .n_kernels = 1, .kernels = {kop},    \
      .attrs = fields, .n_attrs = nfields, .attr_size = sizeof(attrs_create),             \
      .infer = inf, .forward = random_forward};
RANDOM_OP(rand, KILN__K_RAND_UNIFORM, rand_float_infer, f_shaped, 3)
RANDOM_OP(randn, KILN__K_RAND_NORMAL, rand_float_infer, f_shaped, 3)
RANDOM_OP(randint, KILN__K_RAND_INT, randint_infer, f_randint, 5)

static kiln_tensor *random_new(const kiln__op *op, attrs_create *p, kiln_generator *gen) {
  p->gen = gen;
  return kiln__op_call(op, 0, NULL, p, NULL);
}

kiln_tensor *kiln_rand(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev, kiln_generator *gen) {
  attrs_create p = shaped(ndim, shape, dt, dev);
  p.b = 1.0; /* U[0, 1) */
  return random_new(&op_rand, &p, gen);
}
kiln_tensor *kiln_randn(int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev, kiln_generator *gen) {
  attrs_create p = shaped(ndim, shape, dt, dev);
  p.b = 1.0; /* N(0, 1) */
  return random_new(&op_randn, &p, gen);
}
kiln_tensor *kiln_randint(int64_t low, int64_t high, int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev,
                          kiln_generator *gen) {
  attrs_create p = shaped(ndim, shape, dt, dev);
  p.low = low;
  p.high = high;
  return random_new(&op_randint, &p, gen);
}

/* randperm: the permutation is drawn on the host (kiln__randperm_fill, the one the
** loaders' shuffles use), into a CPU int64 tensor; no kernel. */
typedef struct attrs_randperm {
  int64_t n;
  kiln_generator *gen; /* not an attribute */
} attrs_randperm;
static const kiln__attr_field f_randperm[] = {KILN__FIELD(attrs_randperm, n, KILN__A_INT)};

static kiln_status randperm_infer(kiln__op_ctx *c) {
  const attrs_randperm *p = c->attrs;
  if (p->n < 0)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_randperm: n must be >= 0, got %lld", (long long)p->n);
  if (kiln__check_shape("kiln_randperm", 1, &p->n, KILN_I64) != KILN_OK) return kiln_last_error();
  c->device = kiln_device_cpu();
  kiln__op_meta(c, 0, 1, &p->n, KILN_I64);
  return KILN_OK;
}
static kiln_status randperm_forward(kiln__op_ctx *c) {
  const attrs_randperm *p = c->attrs;
  return kiln__randperm_fill(p->n, p->gen, kiln__view_of(c->out[0]).data, true);
}
static const kiln__op op_randperm = {
    .name = "randperm", .api = "kiln_randperm", .n_in = 0, .n_out = 1, .flags = KILN__OP_CREATION | KILN__OP_NO_GRAD,
    .attrs = f_randperm, .n_attrs = 1, .attr_size = sizeof(attrs_randperm), .infer = randperm_infer,
    .forward = randperm_forward};

kiln_tensor *kiln_randperm(int64_t n, kiln_generator *gen) {
  attrs_randperm p = {n, gen};
  return kiln__op_call(&op_randperm, 0, NULL, &p, NULL);
}

/* ---- in-place random fills: uniform_, normal_ (KILN__OP_INPLACE, never recorded) ---- */
typedef struct attrs_fill_random {
  double a, b;
  kiln_generator *gen; /* not an attribute */
} attrs_fill_random;
static const kiln__attr_field f_uniform_[] = {{"low", KILN__A_FLOAT, offsetof(attrs_fill_random, a), 0, NULL},
                                              {"high", KILN__A_FLOAT, offsetof(attrs_fill_random, b), 0, NULL}};
static const kiln__attr_field f_normal_[] = {{"mean", KILN__A_FLOAT, offsetof(attrs_fill_random, a), 0, NULL},
                                             {"std", KILN__A_FLOAT, offsetof(attrs_fill_random, b), 0, NULL}};

static kiln_status random__infer(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0];
  if (!kiln_dtype_is_float(t->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: expected a floating tensor, got %s", c->op->api, kiln_dtype_name(t->dtype));
  if (t->requires_grad && kiln_grad_enabled())
    return kiln_set_error(KILN_ERR_AUTOGRAD,
                          "%s: in-place update of a tensor that requires grad while grad mode "
                          "is on (use kiln_set_grad_enabled(false) around it)",
                          c->op->api);
  return KILN_OK;
}
static kiln_status random__forward(kiln__op_ctx *c) {
  const attrs_fill_random *p = c->attrs;
  kiln_tensor *t = c->in[0];
  kiln__kargs k = {0};
  k.op = c->op->kernels[0];
  k.s[0] = p->a;
  k.s[1] = p->b;
  kiln__generator_reserve(p->gen, kiln_numel(t), &k.seed, &k.offset);
  return kiln__run_into(t, &k);
}

#define RANDOM_INPLACE_OP(fname, kop, fields)                                             \
  static const kiln__op op_##fname = {                                                    \
      .name = #fname, .api = "kiln_" #fname, .n_in = 1, .n_out = 1,                       \
      .flags = KILN__OP_INPLACE | KILN__OP_NO_GRAD, .n_kernels = 1, .kernels = {kop},     \
      .attrs = fields, .n_attrs = 2, .attr_size = sizeof(attrs_fill_random),              \
      .infer = random__infer, .forward = random__forward};
RANDOM_INPLACE_OP(uniform_, KILN__K_RAND_UNIFORM, f_uniform_)
RANDOM_INPLACE_OP(normal_, KILN__K_RAND_NORMAL, f_normal_)

/* A NULL tensor is refused with this message of its own, as before the op layer (a status
** return has no NULL to pass through). */
static kiln_status random_inplace(const kiln__op *op, kiln_tensor *t, double a, double b, kiln_generator *gen) {
  if (!t) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL tensor", op->api);
  attrs_fill_random p = {a, b, gen};
  return kiln__op_call_status(op, 1, &t, &p);
}

kiln_status kiln_uniform_(kiln_tensor *t, double low, double high, kiln_generator *gen) {
  return random_inplace(&op_uniform_, t, low, high, gen);
}
kiln_status kiln_normal_(kiln_tensor *t, double mean, double std, kiln_generator *gen) {
  return random_inplace(&op_normal_, t, mean, std, gen);
}
