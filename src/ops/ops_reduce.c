/*
** Reductions: sum, mean, amax, amin, var, std over a set of dims; max/min/argmax/argmin
** along one dim. Each is a descriptor on the one call path (op.h); var and std are
** composites (their forward calls mean, sub, mul, sum, so autograd comes from the parts).
**
** Kernel contract (backend.h): in0 is the full input, out0 has the input's ndim with size
** 1 at the reduced dims, i0 is the bit mask of reduced dims. For keepdim=false the result
** tensor has the reduced shape and the kernel gets a keepdim-shaped view of it (the
** inserted size-1 dims have stride 0), so no copy is ever needed.
**
** The rules read the dims and keepdim from the node's copy of the attribute record and
** rebuild the mask from the input's ndim (the dims were checked when the op ran).
*/
#include "ops/op.h"

#include <math.h>
#include <string.h>

/* ---- attributes --------------------------------------------------------------------- */

/* sum, mean, amax, amin, var, std: PyTorch's dim (n_dim 0: every dim), keepdim and, for
** var/std, correction. */
typedef struct attrs_reduce {
  int64_t dim[KILN_MAX_DIMS];
  int n_dim;
  bool keepdim;
  int correction;
  /* Not attributes: the list as the caller passed it, for infer's messages about a
  ** malformed one (a negative count, a NULL list, more dims than dim[] holds). */
  int ndims_given;
  bool dims_null;
} attrs_reduce;

static const kiln__attr_field f_reduce[] = {KILN__FIELD_INTS(attrs_reduce, dim, n_dim),
                                            KILN__FIELD(attrs_reduce, keepdim, KILN__A_BOOL)};
static const kiln__attr_field f_var[] = {KILN__FIELD_INTS(attrs_reduce, dim, n_dim),
                                         KILN__FIELD(attrs_reduce, correction, KILN__A_INT32),
                                         KILN__FIELD(attrs_reduce, keepdim, KILN__A_BOOL)};

/* The record of a call: at most KILN_MAX_DIMS dims are kept (a longer list is an error
** that infer reports from ndims_given and dim[0]). */
static attrs_reduce reduce_attrs(int ndims, const int *dims, bool keepdim, int correction) {
  attrs_reduce p;
  int n = !dims || ndims < 0 ? 0 : ndims > KILN_MAX_DIMS ? KILN_MAX_DIMS : ndims;
  for (int k = 0; k < n; k++) p.dim[k] = dims[k];
  p.n_dim = n;
  p.keepdim = keepdim;
  p.correction = correction;
  p.ndims_given = ndims;
  p.dims_null = dims == NULL;
  return p;
}

/* max_dim, min_dim, argmax, argmin: one dim. */
typedef struct attrs_dim {
  int dim;
  bool keepdim;
} attrs_dim;
static const kiln__attr_field f_dim[] = {KILN__FIELD(attrs_dim, dim, KILN__A_INT32),
                                         KILN__FIELD(attrs_dim, keepdim, KILN__A_BOOL)};

/* ---- helpers ---------------------------------------------------------------------- */

/* The bit mask of reduced dims. n_dim 0 means all dims. A 0-dim tensor takes dim 0 or -1
** (PyTorch's rule) and has nothing to reduce. */
static kiln_status reduce_mask(const char *op, const kiln_tensor *t, const attrs_reduce *p, uint32_t *mask) {
  int ndims = p->ndims_given;
  *mask = 0;
  if (ndims < 0 || (ndims > 0 && p->dims_null))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: invalid dims list (ndims %d, dims %s)",
                          op, ndims, p->dims_null ? "NULL" : "given");
  if (ndims == 0) {
    *mask = t->ndim ? (uint32_t)((1u << t->ndim) - 1u) : 0u;
    return KILN_OK;
  }
  if (ndims > KILN_MAX_DIMS && t->ndim > 0)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: %d dims given for a tensor of shape %s",
                          op, ndims, kiln__tshape(t));
  /* a 0-dim tensor with more than KILN_MAX_DIMS dims fails at dim[0] or dim[1] below */
  for (int k = 0; k < ndims; k++) {
    int dk = (int)p->dim[k];
    int d;
    if (t->ndim == 0) {
      if (dk != 0 && dk != -1)
        return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                              "%s: dim %d out of range for a 0-dim tensor (expected 0 or -1)", op,
                              dk);
      if (ndims > 1)
        return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: dim %d appears more than once", op,
                              dk);
      continue;
    }
    d = kiln__wrap_dim(op, dk, t->ndim);
    if (d < 0) return KILN_ERR_INVALID_ARGUMENT;
    if (*mask & (1u << d))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            "%s: dim %d appears more than once in the dims list for shape %s", op,
                            dk, kiln__tshape(t));
    *mask |= 1u << d;
  }
  return KILN_OK;
}

/* The mask of a record infer already accepted, for an input of ndim dims (the rules). */
static uint32_t attr_mask(const attrs_reduce *p, int ndim) {
  if (ndim == 0) return 0u;
  if (p->n_dim == 0) return (uint32_t)((1u << ndim) - 1u);
  uint32_t mask = 0;
  for (int k = 0; k < p->n_dim; k++) mask |= 1u << (p->dim[k] < 0 ? p->dim[k] + ndim : p->dim[k]);
  return mask;
}

static void reduced_shape(int ndim, const int64_t *shape, uint32_t mask, bool keepdim, int *ondim,
                          int64_t *oshape) {
  int j = 0;
  for (int d = 0; d < ndim; d++) {
    if (mask & (1u << d)) {
      if (keepdim) oshape[j++] = 1;
    } else {
      oshape[j++] = shape[d];
    }
  }
  *ondim = j;
}

static int64_t reduced_count(int ndim, const int64_t *shape, uint32_t mask) {
  int64_t n = 1;
  for (int d = 0; d < ndim; d++)
    if (mask & (1u << d)) n *= shape[d];
  return n;
}

/* 1/count, or NaN for a mean of nothing (0/0, as PyTorch gives). */
static double mean_scale(int ndim, const int64_t *shape, uint32_t mask) {
  int64_t cnt = reduced_count(ndim, shape, mask);
  return cnt ? 1.0 / (double)cnt : NAN;
}

/* out (reduced shape) seen with the input's ndim: size 1, stride 0 at reduced dims. */
static kiln__view keep_view(const kiln_tensor *out, int in_ndim, uint32_t mask, bool keepdim) {
  kiln__view v = kiln__view_of(out);
  if (keepdim) return v;
  int j = 0;
  for (int d = 0; d < in_ndim; d++) {
    if (mask & (1u << d)) {
      v.shape[d] = 1;
      v.strides[d] = 0;
    } else {
      v.shape[d] = out->shape[j];
      v.strides[d] = out->strides[j];
      j++;
    }
  }
  v.ndim = in_ndim;
  return v;
}

/* Value reductions cannot reduce an empty dim (no identity): PyTorch errors too. */
static kiln_status check_nonempty(const char *op, const kiln_tensor *t, uint32_t mask) {
  for (int d = 0; d < t->ndim; d++)
    if ((mask & (1u << d)) && t->shape[d] == 0)
      return kiln_set_error(KILN_ERR_SHAPE,
                            "%s: cannot reduce dim %d of size 0 (shape %s): the operation has "
                            "no identity",
                            op, d, kiln__tshape(t));
  return KILN_OK;
}

/* Runs reduction kernel kop of t over mask into out (the reduced shape). */
static kiln_status reduce_into(kiln__kop kop, kiln_tensor *t, kiln_tensor *out, uint32_t mask, bool keepdim) {
  if (kiln_numel(out) == 0) return KILN_OK;
  kiln__kargs a = {0};
  a.n_out = 1;
  a.out[0] = keep_view(out, t->ndim, mask, keepdim);
  if (kiln_numel(t) == 0) { /* only sums get here: an empty sum is 0 */
    a.op = KILN__K_FILL;
    a.s[0] = 0.0;
  } else {
    a.op = kop;
    a.n_in = 1;
    a.in[0] = kiln__view_of(t);
    a.i[0] = (int64_t)mask;
  }
  return kiln__dispatch(kiln_device_of(t), &a);
}

/* g (the reduced shape) unsqueezed back to the input's ndim (size 1 at reduced dims). */
static kiln_tensor *unsqueeze_back(kiln_tensor *g, int ndim, uint32_t mask, bool keepdim) {
  if (keepdim) return g;
  for (int d = 0; d < ndim && g; d++)
    if (mask & (1u << d)) g = kiln_unsqueeze(g, d);
  return g;
}

/* g broadcast back to the input shape, as a fresh contiguous tensor: the engine may add
** into what it receives, which must then not be a stride-0 view. */
static kiln_tensor *expand_back(kiln_tensor *g, int ndim, const int64_t *shape, uint32_t mask,
                                bool keepdim) {
  g = unsqueeze_back(g, ndim, mask, keepdim);
  if (!g) return NULL;
  return kiln_contiguous(kiln_expand(g, ndim, shape));
}

static int mask_to_dims(uint32_t mask, int ndim, int *dims) {
  int k = 0;
  for (int d = 0; d < ndim; d++)
    if (mask & (1u << d)) dims[k++] = d;
  return k;
}

static bool is_half(kiln_dtype dt) { return dt == KILN_F16 || dt == KILN_BF16; }

static kiln_status float_only(const kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0];
  if (kiln_dtype_is_float(t->dtype)) return KILN_OK;
  return kiln_set_error(KILN_ERR_DTYPE, "%s: expected a floating tensor, got %s (shape %s)", c->op->api,
                        kiln_dtype_name(t->dtype), kiln__tshape(t));
}

/* The mask (into scratch[0], for forward) and output 0's reduced shape of dtype dt. */
static kiln_status reduce_meta(kiln__op_ctx *c, kiln_dtype dt) {
  const attrs_reduce *p = c->attrs;
  kiln_tensor *t = c->in[0];
  uint32_t mask;
  if (reduce_mask(c->op->api, t, p, &mask) != KILN_OK) return kiln_last_error();
  c->scratch[0] = mask;
  int ond;
  int64_t osh[KILN_MAX_DIMS];
  reduced_shape(t->ndim, t->shape, mask, p->keepdim, &ond, osh);
  kiln__op_meta(c, 0, ond, osh, dt);
  return KILN_OK;
}

static kiln_tensor *reduce_call(const kiln__op *op, kiln_tensor *t, const attrs_reduce *p) {
  return kiln__op_call(op, 1, &t, p, NULL);
}

/* ---- sum ---------------------------------------------------------------------------- */

/* Integer and bool sums are i64 (PyTorch). */
static kiln_status sum_infer(kiln__op_ctx *c) {
  kiln_dtype dt = c->in[0]->dtype;
  return reduce_meta(c, kiln_dtype_is_float(dt) ? dt : KILN_I64);
}

static kiln_status sum_forward(kiln__op_ctx *c) {
  const attrs_reduce *p = c->attrs;
  kiln_tensor *t = c->in[0];
  uint32_t mask = (uint32_t)c->scratch[0];
  if (kiln_dtype_is_float(t->dtype)) return reduce_into(KILN__K_SUM, t, c->out[0], mask, p->keepdim);
  /* Integers are widened first so every backend's SUM kernel only sees matching dtypes.
  ** Integers never need a gradient. */
  kiln_scope_begin();
  kiln_tensor *w = t->dtype == KILN_I64 ? t : kiln_to_dtype(t, KILN_I64);
  kiln_status st = w ? reduce_into(KILN__K_SUM, w, c->out[0], mask, p->keepdim) : kiln_last_error();
  kiln_scope_end();
  return st;
}

static kiln_status sum_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  const attrs_reduce *p = n->attrs;
  int nd = n->in_ndim[0];
  kiln_tensor *r = expand_back(g, nd, n->in_shape[0], attr_mask(p, nd), p->keepdim);
  return kiln__give_grad(&gi[0], r, g);
}

static const kiln__op op_sum = {
    .name = "sum", .api = "kiln_sum", .n_in = 1, .n_out = 1, .amp = KILN__AMP_F32, .n_kernels = 2,
    .kernels = {KILN__K_SUM, KILN__K_FILL}, .attrs = f_reduce, .n_attrs = 2,
    .attr_size = sizeof(attrs_reduce), .infer = sum_infer, .forward = sum_forward,
    .backward = sum_backward};

kiln_tensor *kiln_sum(kiln_tensor *t, int ndims, const int *dims, bool keepdim) {
  attrs_reduce p = reduce_attrs(ndims, dims, keepdim, 0);
  return reduce_call(&op_sum, t, &p);
}

kiln_tensor *kiln_sum_all(kiln_tensor *t) { return kiln_sum(t, 0, NULL, false); }

/* ---- mean --------------------------------------------------------------------------- */

static kiln_status mean_infer(kiln__op_ctx *c) {
  if (float_only(c) != KILN_OK) return kiln_last_error();
  return reduce_meta(c, c->in[0]->dtype);
}

/* out = in * s, elementwise (the AFFINE kernel kiln_mul_scalar runs; in may be out). */
static kiln_status scale_into(kiln_tensor *out, kiln_tensor *in, double s) {
  kiln__kargs k = {0};
  k.op = KILN__K_AFFINE;
  k.n_in = 1;
  k.in[0] = kiln__view_of(in);
  k.s[0] = s;
  k.s[1] = 0.0;
  return kiln__run_into(out, &k);
}

/* The sum, then the scale in place: the kernels (and so the bits) of sum then mul_scalar,
** without a tensor between them. */
static kiln_status mean_forward(kiln__op_ctx *c) {
  const attrs_reduce *p = c->attrs;
  kiln_tensor *t = c->in[0], *out = c->out[0];
  uint32_t mask = (uint32_t)c->scratch[0];
  double scale = mean_scale(t->ndim, t->shape, mask);
  if (!is_half(t->dtype)) {
    kiln_status st = reduce_into(KILN__K_SUM, t, out, mask, p->keepdim);
    return st == KILN_OK ? scale_into(out, out, scale) : st;
  }
  /* 16-bit floats: sum in f32 so that a large sum does not overflow f16 before the
  ** division (PyTorch accumulates in f32 too), then one copy into out. */
  kiln_scope_begin();
  kiln_tensor *x = kiln__as_dtype_nograd(t, KILN_F32);
  kiln_tensor *s = x ? kiln__tensor_new(out->ndim, out->shape, KILN_F32, kiln_device_of(t)) : NULL;
  kiln_status st = s ? reduce_into(KILN__K_SUM, x, s, mask, p->keepdim) : kiln_last_error();
  if (st == KILN_OK) st = scale_into(s, s, scale);
  if (st == KILN_OK) {
    kiln__kargs k = {0};
    k.op = KILN__K_COPY;
    k.n_in = 1;
    k.in[0] = kiln__view_of(s);
    st = kiln__run_into(out, &k);
  }
  kiln_scope_end();
  return st;
}

static kiln_status mean_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  const attrs_reduce *p = n->attrs;
  int nd = n->in_ndim[0];
  uint32_t mask = attr_mask(p, nd);
  kiln_tensor *r = expand_back(g, nd, n->in_shape[0], mask, p->keepdim);
  if (r) r = kiln_mul_scalar(r, mean_scale(nd, n->in_shape[0], mask));
  return kiln__give_grad(&gi[0], r, g);
}

static const kiln__op op_mean = {
    .name = "mean", .api = "kiln_mean", .n_in = 1, .n_out = 1, .amp = KILN__AMP_F32, .n_kernels = 4,
    .kernels = {KILN__K_SUM, KILN__K_FILL, KILN__K_AFFINE, KILN__K_COPY}, .attrs = f_reduce, .n_attrs = 2,
    .attr_size = sizeof(attrs_reduce), .infer = mean_infer, .forward = mean_forward,
    .backward = mean_backward};

kiln_tensor *kiln_mean(kiln_tensor *t, int ndims, const int *dims, bool keepdim) {
  attrs_reduce p = reduce_attrs(ndims, dims, keepdim, 0);
  return reduce_call(&op_mean, t, &p);
}

kiln_tensor *kiln_mean_all(kiln_tensor *t) { return kiln_mean(t, 0, NULL, false); }

/* ---- amax / amin -------------------------------------------------------------------- */

static kiln_status aext_infer(kiln__op_ctx *c) {
  kiln_status st = reduce_meta(c, c->in[0]->dtype);
  if (st == KILN_OK) st = check_nonempty(c->op->api, c->in[0], (uint32_t)c->scratch[0]);
  return st;
}

static kiln_status aext_forward(kiln__op_ctx *c) {
  const attrs_reduce *p = c->attrs;
  return reduce_into(c->op->kernels[0], c->in[0], c->out[0], (uint32_t)c->scratch[0], p->keepdim);
}

/* saved: 0 the input x, 1 the output m */
static void aext_save(kiln__op_ctx *c, kiln__node *n) {
  kiln__node_save(n, 0, c->in[0]);
  kiln__node_save_output(n, 1);
}

/* The gradient goes to every position equal to the extreme, split evenly among ties
** (PyTorch's amax/amin rule): g * (x == m) / count(x == m). */
static kiln_status aext_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  const attrs_reduce *p = n->attrs;
  kiln_tensor *x = n->saved[0], *m = n->saved[1];
  int nd = x->ndim;
  uint32_t mask = attr_mask(p, nd);
  int dims[KILN_MAX_DIMS];
  int k = mask_to_dims(mask, nd, dims);
  kiln_tensor *mk = unsqueeze_back(m, nd, mask, p->keepdim);
  kiln_tensor *gk = unsqueeze_back(g, nd, mask, p->keepdim);
  kiln_tensor *hit = kiln_to_dtype(kiln_eq(x, mk), g->dtype);
  kiln_tensor *cnt = k ? kiln_sum(hit, k, dims, true) : hit;
  kiln_tensor *r = kiln_mul(hit, kiln_div(gk, cnt));
  if (r && r->dtype != n->in_dtype[0]) r = kiln_to_dtype(r, n->in_dtype[0]);
  return kiln__give_grad(&gi[0], r, g);
}

/* amax and friends select an element and accumulate nothing: no autocast class (PyTorch's
** autocast lists leave them out too). */
#define AEXT_OP(fname, kop)                                                                          \
  static const kiln__op op_##fname = {                                                               \
      .name = #fname, .api = "kiln_" #fname, .n_in = 1, .n_out = 1, .n_kernels = 1, .kernels = {kop}, \
      .attrs = f_reduce, .n_attrs = 2, .attr_size = sizeof(attrs_reduce), .infer = aext_infer,       \
      .forward = aext_forward, .backward = aext_backward, .n_saved = 2, .save = aext_save};
AEXT_OP(amax, KILN__K_AMAX)
AEXT_OP(amin, KILN__K_AMIN)

kiln_tensor *kiln_amax(kiln_tensor *t, int ndims, const int *dims, bool keepdim) {
  attrs_reduce p = reduce_attrs(ndims, dims, keepdim, 0);
  return reduce_call(&op_amax, t, &p);
}

kiln_tensor *kiln_amin(kiln_tensor *t, int ndims, const int *dims, bool keepdim) {
  attrs_reduce p = reduce_attrs(ndims, dims, keepdim, 0);
  return reduce_call(&op_amin, t, &p);
}

/* ---- var / std: composites, so autograd comes from the parts ----------------------- */

static kiln_status var_infer(kiln__op_ctx *c) {
  if (float_only(c) != KILN_OK) return kiln_last_error();
  return reduce_meta(c, c->in[0]->dtype);
}

static kiln_status var_common(kiln__op_ctx *c, bool take_sqrt) {
  const attrs_reduce *p = c->attrs;
  kiln_tensor *t = c->in[0];
  uint32_t mask = (uint32_t)c->scratch[0];
  double denom = (double)reduced_count(t->ndim, t->shape, mask) - (double)p->correction;
  if (denom < 0) denom = 0; /* PyTorch clamps: the result is inf or NaN */
  int rd[KILN_MAX_DIMS];
  int k = mask_to_dims(mask, t->ndim, rd);
  kiln_scope_begin();
  /* 16-bit floats: compute in f32 (PyTorch does too); the casts are differentiable. */
  kiln_tensor *x = is_half(t->dtype) ? kiln_to_dtype(t, KILN_F32) : t;
  kiln_tensor *r = NULL;
  if (x) {
    kiln_tensor *m = kiln_mean(x, k, k ? rd : NULL, true);
    kiln_tensor *d = kiln_sub(x, m);
    kiln_tensor *s = kiln_sum(kiln_mul(d, d), k, k ? rd : NULL, p->keepdim);
    r = kiln_mul_scalar(s, denom > 0 ? 1.0 / denom : INFINITY);
    if (take_sqrt) r = kiln_sqrt(r);
    if (r && r->dtype != t->dtype) r = kiln_to_dtype(r, t->dtype);
  }
  c->out[0] = kiln__scope_return(r);
  return c->out[0] ? KILN_OK : kiln_last_error();
}
static kiln_status var_forward(kiln__op_ctx *c) { return var_common(c, false); }
static kiln_status std_forward(kiln__op_ctx *c) { return var_common(c, true); }

/* No kernels of their own: the parts (mean, sub, mul, sum, mul_scalar, sqrt) name theirs. */
static const kiln__op op_var = {
    .name = "var", .api = "kiln_var", .n_in = 1, .n_out = 1, .amp = KILN__AMP_F32,
    .flags = KILN__OP_COMPOSITE, .attrs = f_var, .n_attrs = 3, .attr_size = sizeof(attrs_reduce),
    .infer = var_infer, .forward = var_forward};
static const kiln__op op_std = {
    .name = "std", .api = "kiln_std", .n_in = 1, .n_out = 1, .amp = KILN__AMP_F32,
    .flags = KILN__OP_COMPOSITE, .attrs = f_var, .n_attrs = 3, .attr_size = sizeof(attrs_reduce),
    .infer = var_infer, .forward = std_forward};

kiln_tensor *kiln_var(kiln_tensor *t, int ndims, const int *dims, int correction, bool keepdim) {
  attrs_reduce p = reduce_attrs(ndims, dims, keepdim, correction);
  return reduce_call(&op_var, t, &p);
}

kiln_tensor *kiln_std(kiln_tensor *t, int ndims, const int *dims, int correction, bool keepdim) {
  attrs_reduce p = reduce_attrs(ndims, dims, keepdim, correction);
  return reduce_call(&op_std, t, &p);
}

/* ---- max/min along one dim, argmax/argmin ------------------------------------------ */

/* The wrapped dim (into scratch[0]) and the outputs: max_dim/min_dim give (values,
** indices), argmax/argmin the indices only. */
static kiln_status extdim_infer(kiln__op_ctx *c) {
  const attrs_dim *p = c->attrs;
  const char *op = c->op->api;
  kiln_tensor *t = c->in[0];
  int d = 0;
  if (t->ndim == 0) {
    if (p->dim != 0 && p->dim != -1)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            "%s: dim %d out of range for a 0-dim tensor (expected 0 or -1)", op, p->dim);
  } else {
    d = kiln__wrap_dim(op, p->dim, t->ndim);
    if (d < 0) return kiln_last_error();
    if (check_nonempty(op, t, 1u << d) != KILN_OK) return kiln_last_error();
  }
  c->scratch[0] = (uint64_t)d;
  int ond;
  int64_t osh[KILN_MAX_DIMS];
  reduced_shape(t->ndim, t->shape, t->ndim ? 1u << d : 0u, p->keepdim, &ond, osh);
  if (c->op->n_out == 2) {
    kiln__op_meta(c, 0, ond, osh, t->dtype);
    kiln__op_meta(c, 1, ond, osh, KILN_I64);
  } else {
    kiln__op_meta(c, 0, ond, osh, KILN_I64);
  }
  return KILN_OK;
}

static kiln_status extdim_forward(kiln__op_ctx *c) {
  const attrs_dim *p = c->attrs;
  kiln_tensor *t = c->in[0];
  int d = (int)c->scratch[0];
  bool with_values = c->op->n_out == 2;
  kiln_tensor *idx = with_values ? c->out[1] : c->out[0];
  if (kiln_numel(idx) == 0) return KILN_OK;
  kiln_device dev = kiln_device_of(t);
  /* the kernel writes both; argmax's values are a temporary */
  kiln_tensor *vals = with_values ? c->out[0] : kiln__tensor_new(idx->ndim, idx->shape, t->dtype, dev);
  if (!vals) return kiln_last_error();
  uint32_t mask = t->ndim ? 1u << d : 0u;
  kiln__kargs a = {0};
  a.op = c->op->kernels[0];
  a.n_in = 1;
  a.n_out = 2;
  a.in[0] = kiln__view_of(t);
  a.out[0] = keep_view(vals, t->ndim, mask, p->keepdim);
  a.out[1] = keep_view(idx, t->ndim, mask, p->keepdim);
  if (t->ndim == 0) { /* kernels see one element along a dim of size 1 */
    kiln__view *vs[3] = {&a.in[0], &a.out[0], &a.out[1]};
    for (int k = 0; k < 3; k++) {
      vs[k]->ndim = 1;
      vs[k]->shape[0] = 1;
      vs[k]->strides[0] = 1;
    }
    mask = 1u;
  }
  a.i[0] = (int64_t)mask;
  a.i[1] = d;
  kiln_status st = kiln__dispatch(dev, &a);
  if (!with_values) kiln__discard(vals);
  return st;
}

/* saved: 0 the indices. The path leaves them (an integer output) out of the node. */
static void extdim_save(kiln__op_ctx *c, kiln__node *n) { kiln__node_save(n, 0, c->out[1]); }

/* The gradient goes to the position the index names (first on ties, like PyTorch). */
static kiln_status extdim_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  const attrs_dim *p = n->attrs;
  int nd = n->in_ndim[0];
  if (nd == 0) return kiln__give_grad(&gi[0], kiln_contiguous(g), g);
  int d = p->dim < 0 ? p->dim + nd : p->dim;
  kiln_tensor *idx = unsqueeze_back(n->saved[0], nd, 1u << d, p->keepdim);
  kiln_tensor *gk = unsqueeze_back(g, nd, 1u << d, p->keepdim);
  kiln_tensor *z = kiln_zeros(nd, n->in_shape[0], g->dtype, kiln_device_of(g));
  return kiln__give_grad(&gi[0], kiln_scatter_add(z, d, idx, gk), g);
}

/* max_dim/min_dim: values (differentiable) and indices; argmax/argmin: indices, never
** recorded. No autocast class (see amax). */
#define EXTDIM_OP(fname, kop, nout, bw, nsaved, sv)                                                   \
  static const kiln__op op_##fname = {                                                               \
      .name = #fname, .api = "kiln_" #fname, .n_in = 1, .n_out = nout, .n_kernels = 1,              \
      .kernels = {kop}, .attrs = f_dim, .n_attrs = 2, .attr_size = sizeof(attrs_dim),                \
      .infer = extdim_infer, .forward = extdim_forward, .backward = bw, .n_saved = nsaved, .save = sv};
EXTDIM_OP(max_dim, KILN__K_MAX_DIM, 2, extdim_backward, 1, extdim_save)
EXTDIM_OP(min_dim, KILN__K_MIN_DIM, 2, extdim_backward, 1, extdim_save)
EXTDIM_OP(argmax, KILN__K_MAX_DIM, 1, NULL, 0, NULL)
EXTDIM_OP(argmin, KILN__K_MIN_DIM, 1, NULL, 0, NULL)

/* Values and i64 indices of the max (min) along dim; both owned by the caller's scope. */
static kiln_tensor *extdim(const kiln__op *op, kiln_tensor *t, int dim, bool keepdim, kiln_tensor **indices) {
  if (indices) *indices = NULL;
  attrs_dim p = {dim, keepdim};
  kiln_tensor *out[2] = {NULL, NULL};
  kiln_tensor *vals = kiln__op_call(op, 1, &t, &p, out);
  if (!vals) return NULL;
  if (indices)
    *indices = out[1];
  else
    kiln__discard(out[1]);
  return vals;
}

kiln_tensor *kiln_max_dim(kiln_tensor *t, int dim, bool keepdim, kiln_tensor **indices) {
  return extdim(&op_max_dim, t, dim, keepdim, indices);
}

kiln_tensor *kiln_min_dim(kiln_tensor *t, int dim, bool keepdim, kiln_tensor **indices) {
  return extdim(&op_min_dim, t, dim, keepdim, indices);
}

kiln_tensor *kiln_argmax(kiln_tensor *t, int dim, bool keepdim) {
  attrs_dim p = {dim, keepdim};
  return kiln__op_call(&op_argmax, 1, &t, &p, NULL);
}

kiln_tensor *kiln_argmin(kiln_tensor *t, int dim, bool keepdim) {
  attrs_dim p = {dim, keepdim};
  return kiln__op_call(&op_argmin, 1, &t, &p, NULL);
}
