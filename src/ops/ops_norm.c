/*
** Normalization and channel dropout of convolutional networks: batch_norm, group_norm,
** dropout2d, composites on the one call path (op.h), so their backward comes from the
** ops they are made of (mean, var, sub, mul, rsqrt: exact, every backend).
**
** batch_norm follows PyTorch: in training it normalizes with the batch's statistics over
** every dim but the channels (dim 1), the biased variance, and updates the running
** statistics in place with momentum, running = (1 - m) running + m stat, the variance's
** update using the unbiased variance; in eval it normalizes with the running statistics.
** 16-bit inputs are computed in f32 (the norms' autocast class) and the result cast back.
*/
#include "ops/op.h"

static bool is_half(kiln_dtype dt) { return dt == KILN_F16 || dt == KILN_BF16; }

/* (C) -> (C, 1, ...) to broadcast against (N, C, d...) */
static kiln_tensor *per_channel(kiln_tensor *v, int ndim, kiln_dtype dt) {
  if (!v) return NULL;
  int64_t sh[KILN_MAX_DIMS];
  sh[0] = v->shape[0];
  for (int d = 1; d < ndim - 1; d++) sh[d] = 1;
  kiln_tensor *r = kiln_reshape(v, ndim - 1, sh);
  return r && r->dtype != dt ? kiln_to_dtype(r, dt) : r;
}

/* The end of both norms: y (normalized, in the compute type ct) times the per-channel
** weight, plus the bias (either may be NULL), back in the input's dtype, handed out of the
** op's scope as its output. */
static kiln_status affine_out(kiln__op_ctx *c, kiln_tensor *y, kiln_tensor *w, kiln_tensor *b, int nd, kiln_dtype ct,
                              kiln_dtype out_dt) {
  if (y && w) y = kiln_mul(y, per_channel(w, nd, ct));
  if (y && b) y = kiln_add(y, per_channel(b, nd, ct));
  if (y && y->dtype != out_dt) y = kiln_to_dtype(y, out_dt);
  c->out[0] = kiln__scope_return(y);
  return c->out[0] ? KILN_OK : kiln_last_error();
}

/* ---- batch_norm ------------------------------------------------------------------------- */

typedef struct attrs_bn {
  bool training;
  double momentum;
  double eps;
} attrs_bn;
static const kiln__attr_field f_bn[] = {KILN__FIELD(attrs_bn, training, KILN__A_BOOL),
                                        KILN__FIELD(attrs_bn, momentum, KILN__A_FLOAT),
                                        KILN__FIELD(attrs_bn, eps, KILN__A_FLOAT)};

static kiln_status check_channel_vec(const char *api, const char *what, const kiln_tensor *v, const kiln_tensor *x) {
  if (!v) return KILN_OK;
  if (v->ndim != 1 || v->shape[0] != x->shape[1])
    return kiln_set_error(KILN_ERR_SHAPE, "%s: %s must have shape [%lld] (the channels of input %s), got %s", api, what,
                          (long long)x->shape[1], kiln__tshape(x), kiln__tshape(v));
  if (!kiln_dtype_is_float(v->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: %s must be floating, got %s", api, what, kiln_dtype_name(v->dtype));
  return KILN_OK;
}

static kiln_status bn_infer(kiln__op_ctx *c) {
  const attrs_bn *p = c->attrs;
  const char *api = "kiln_batch_norm";
  kiln_tensor *x = c->in[0];
  if (!kiln_dtype_is_float(x->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: expected a floating input, got %s (shape %s)", api,
                          kiln_dtype_name(x->dtype), kiln__tshape(x));
  if (x->ndim < 2)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: expected an input (N, C, ...), got shape %s", api, kiln__tshape(x));
  static const char *const names[] = {"running_mean", "running_var", "weight", "bias"};
  for (int k = 1; k < 5; k++)
    if (check_channel_vec(api, names[k - 1], c->in[k], x) != KILN_OK) return kiln_last_error();
  if (!p->training && (!c->in[1] || !c->in[2]))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: eval mode needs running_mean and running_var (input %s)", api,
                          kiln__tshape(x));
  if (p->training && x->shape[1] > 0 && kiln_numel(x) / x->shape[1] == 1)
    return kiln_set_error(KILN_ERR_SHAPE,
                          "%s: training needs more than one value per channel, got input %s (1 value per channel)",
                          api, kiln__tshape(x));
  kiln__op_meta_like(c, 0, x, x->dtype);
  return KILN_OK;
}

static kiln_status bn_forward(kiln__op_ctx *c) {
  const attrs_bn *p = c->attrs;
  kiln_tensor *x = c->in[0], *rm = c->in[1], *rv = c->in[2], *w = c->in[3], *b = c->in[4];
  int nd = x->ndim;
  kiln_dtype ct = is_half(x->dtype) ? KILN_F32 : x->dtype;
  kiln_scope_begin();
  kiln_tensor *xf = ct != x->dtype ? kiln_to_dtype(x, ct) : x;
  kiln_tensor *mean, *inv;
  kiln_status st = KILN_OK;
  if (p->training) {
    int dims[KILN_MAX_DIMS], k = 0;
    for (int d = 0; d < nd; d++)
      if (d != 1) dims[k++] = d;
    mean = kiln_mean(xf, k, dims, true);
    kiln_tensor *var = kiln_var(xf, k, dims, 0, true);
    inv = kiln_rsqrt(kiln_add_scalar(var, p->eps));
    if (mean && var && (rm || rv)) {
      /* the running statistics: no gradient, in place */
      bool was = kiln_set_grad_enabled(false);
      double n = (double)(kiln_numel(x) / x->shape[1]);
      int64_t C = x->shape[1];
      if (rm && st == KILN_OK) {
        kiln_tensor *m = kiln_reshape(kiln_detach(mean), KILN_SHAPE(C));
        if (m && m->dtype != rm->dtype) m = kiln_to_dtype(m, rm->dtype);
        st = kiln_mul_scalar_(rm, 1.0 - p->momentum);
        if (st == KILN_OK) st = kiln_axpy_(rm, p->momentum, m);
      }
      if (rv && st == KILN_OK) {
        kiln_tensor *v = kiln_reshape(kiln_detach(var), KILN_SHAPE(C));
        if (v && v->dtype != rv->dtype) v = kiln_to_dtype(v, rv->dtype);
        st = kiln_mul_scalar_(rv, 1.0 - p->momentum);
        if (st == KILN_OK) st = kiln_axpy_(rv, p->momentum * n / (n - 1.0), v);
      }
      kiln_set_grad_enabled(was);
    }
  } else {
    mean = per_channel(rm, nd, ct);
    inv = kiln_rsqrt(kiln_add_scalar(per_channel(rv, nd, ct), p->eps));
  }
  kiln_tensor *y = st == KILN_OK ? kiln_mul(kiln_sub(xf, mean), inv) : NULL;
  return affine_out(c, y, w, b, nd, ct, x->dtype);
}

static const kiln__op op_batch_norm = {
    .name = "batch_norm", .api = "kiln_batch_norm", .n_in = 5, .n_out = 1, .optional = 0x1e,
    .amp = KILN__AMP_F32, .flags = KILN__OP_COMPOSITE, .n_kernels = 2, .kernels = {KILN__K_SUM, KILN__K_MUL},
    .attrs = f_bn, .n_attrs = 3, .attr_size = sizeof(attrs_bn), .infer = bn_infer, .forward = bn_forward};

kiln_tensor *kiln_batch_norm(kiln_tensor *x, kiln_tensor *running_mean, kiln_tensor *running_var, kiln_tensor *weight,
                             kiln_tensor *bias, bool training, double momentum, double eps) {
  attrs_bn a = {training, momentum, eps};
  kiln_tensor *in[5] = {x, running_mean, running_var, weight, bias};
  return kiln__op_call(&op_batch_norm, 5, in, &a, NULL);
}

/* ---- group_norm ------------------------------------------------------------------------- */

typedef struct attrs_gn {
  int64_t groups;
  double eps;
} attrs_gn;
static const kiln__attr_field f_gn[] = {KILN__FIELD(attrs_gn, groups, KILN__A_INT), KILN__FIELD(attrs_gn, eps, KILN__A_FLOAT)};

static kiln_status gn_infer(kiln__op_ctx *c) {
  const attrs_gn *p = c->attrs;
  const char *api = "kiln_group_norm";
  kiln_tensor *x = c->in[0];
  if (!kiln_dtype_is_float(x->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: expected a floating input, got %s (shape %s)", api,
                          kiln_dtype_name(x->dtype), kiln__tshape(x));
  if (x->ndim < 2)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: expected an input (N, C, ...), got shape %s", api, kiln__tshape(x));
  if (p->groups < 1 || x->shape[1] % p->groups != 0)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: groups %lld must divide the channels %lld (input %s)", api,
                          (long long)p->groups, (long long)x->shape[1], kiln__tshape(x));
  if (check_channel_vec(api, "weight", c->in[1], x) != KILN_OK) return kiln_last_error();
  if (check_channel_vec(api, "bias", c->in[2], x) != KILN_OK) return kiln_last_error();
  kiln__op_meta_like(c, 0, x, x->dtype);
  return KILN_OK;
}

static kiln_status gn_forward(kiln__op_ctx *c) {
  const attrs_gn *p = c->attrs;
  kiln_tensor *x = c->in[0], *w = c->in[1], *b = c->in[2];
  int nd = x->ndim;
  kiln_dtype ct = is_half(x->dtype) ? KILN_F32 : x->dtype;
  int64_t N = x->shape[0], G = p->groups, rest = x->shape[1] / G;
  for (int d = 2; d < nd; d++) rest *= x->shape[d];
  kiln_scope_begin();
  kiln_tensor *xf = ct != x->dtype ? kiln_to_dtype(x, ct) : x;
  kiln_tensor *xr = kiln_reshape(xf, KILN_SHAPE(N, G, rest));
  int dim = 2;
  kiln_tensor *mean = kiln_mean(xr, 1, &dim, true);
  kiln_tensor *inv = kiln_rsqrt(kiln_add_scalar(kiln_var(xr, 1, &dim, 0, true), p->eps));
  kiln_tensor *y = kiln_reshape(kiln_mul(kiln_sub(xr, mean), inv), nd, x->shape);
  return affine_out(c, y, w, b, nd, ct, x->dtype);
}

static const kiln__op op_group_norm = {
    .name = "group_norm", .api = "kiln_group_norm", .n_in = 3, .n_out = 1, .optional = 0x6,
    .amp = KILN__AMP_F32, .flags = KILN__OP_COMPOSITE, .n_kernels = 2, .kernels = {KILN__K_SUM, KILN__K_MUL},
    .attrs = f_gn, .n_attrs = 2, .attr_size = sizeof(attrs_gn), .infer = gn_infer, .forward = gn_forward};

kiln_tensor *kiln_group_norm(kiln_tensor *x, int64_t groups, kiln_tensor *weight, kiln_tensor *bias, double eps) {
  attrs_gn a = {groups, eps};
  kiln_tensor *in[3] = {x, weight, bias};
  return kiln__op_call(&op_group_norm, 3, in, &a, NULL);
}

/* ---- dropout2d: one draw per (sample, channel), kept channels scaled by 1/(1-p) ----------- */

typedef struct attrs_dropout2d {
  double p;
  bool train;
  kiln_generator *gen; /* not an attribute: where the mask is drawn from (NULL: global) */
} attrs_dropout2d;
static const kiln__attr_field f_dropout2d[] = {KILN__FIELD(attrs_dropout2d, p, KILN__A_FLOAT),
                                               KILN__FIELD(attrs_dropout2d, train, KILN__A_BOOL)};

static kiln_status dropout2d_infer(kiln__op_ctx *c) {
  const attrs_dropout2d *a = c->attrs;
  kiln_tensor *x = c->in[0];
  if (!(a->p >= 0.0 && a->p <= 1.0))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_dropout2d: p must be in [0, 1], got %g", a->p);
  if (!kiln_dtype_is_float(x->dtype) || x->ndim < 2)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_dropout2d: expected a floating input (N, C, ...), got %s %s",
                          kiln_dtype_name(x->dtype), kiln__tshape(x));
  kiln__op_meta_like(c, 0, x, x->dtype);
  return KILN_OK;
}

static kiln_status dropout2d_forward(kiln__op_ctx *c) {
  const attrs_dropout2d *a = c->attrs;
  kiln_tensor *x = c->in[0];
  int64_t sh[KILN_MAX_DIMS];
  for (int d = 0; d < x->ndim; d++) sh[d] = d < 2 ? x->shape[d] : 1;
  kiln_scope_begin();
  kiln_tensor *ones = kiln_full(x->ndim, sh, 1.0, x->dtype, kiln_device_of(x));
  kiln_tensor *mask = kiln_dropout(ones, a->p, true, a->gen);
  kiln_tensor *y = kiln_mul(x, mask);
  c->out[0] = kiln__scope_return(y);
  return c->out[0] ? KILN_OK : kiln_last_error();
}

static const kiln__op op_dropout2d = {
    .name = "dropout2d", .api = "kiln_dropout2d", .n_in = 1, .n_out = 1, .flags = KILN__OP_COMPOSITE,
    .n_kernels = 2, .kernels = {KILN__K_RAND_BERNOULLI, KILN__K_MUL}, .attrs = f_dropout2d, .n_attrs = 2,
    .attr_size = sizeof(attrs_dropout2d), .infer = dropout2d_infer, .forward = dropout2d_forward};

kiln_tensor *kiln_dropout2d(kiln_tensor *x, double p, bool train, kiln_generator *gen) {
  if (x && (!train || p == 0.0) && p >= 0.0 && p <= 1.0 && kiln_dtype_is_float(x->dtype) && x->ndim >= 2)
    return kiln__scope_track(kiln_tensor_ref(x));
  attrs_dropout2d a = {p, train, gen};
  return kiln__op_call(&op_dropout2d, 1, &x, &a, NULL);
}
