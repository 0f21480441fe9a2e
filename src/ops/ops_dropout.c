/*
** Dropout: out = t * mask, mask = 1/(1-p) with probability 1-p, else 0. A composite on
** the one call path (op.h), with PyTorch's attributes p and train. dropout2d draws one
** such mask element per (sample, channel) and broadcasts it over the rest.
**
** The mask comes from the RAND_BERNOULLI kernel on t's device, drawn from the counter-
** based generator (same seed, same mask on any device), and the product goes through
** kiln_mul, whose backward (g * mask) is exactly dropout's: nothing to write here.
*/
#include "ops/op.h"

#include <math.h>

typedef struct attrs_dropout {
  double p;
  bool train;
  kiln_generator *gen; /* not an attribute: where the mask is drawn from (NULL: global) */
} attrs_dropout;
static const kiln__attr_field f_dropout[] = {KILN__FIELD(attrs_dropout, p, KILN__A_FLOAT),
                                             KILN__FIELD(attrs_dropout, train, KILN__A_BOOL)};

static kiln_status check_p(const kiln__op_ctx *c) {
  const attrs_dropout *a = c->attrs;
  if (!(a->p >= 0.0 && a->p <= 1.0))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: p must be in [0, 1], got %g", c->op->api, a->p);
  return KILN_OK;
}

static kiln_status dropout_infer(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0];
  if (check_p(c) != KILN_OK) return kiln_last_error();
  if (!kiln_dtype_is_float(t->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_dropout: expected a floating tensor, got %s (shape %s)",
                          kiln_dtype_name(t->dtype), kiln__tshape(t));
  return KILN_OK;
}

/* train, p > 0 (kiln_dropout returned the identity cases) */
static kiln_status dropout_forward(kiln__op_ctx *c) {
  const attrs_dropout *a = c->attrs;
  kiln_tensor *t = c->in[0];
  kiln_device dev = kiln_device_of(t);
  kiln_scope_begin();
  kiln_tensor *r = NULL;
  kiln_tensor *mask = kiln__tensor_new(t->ndim, t->shape, t->dtype, dev);
  if (mask) {
    kiln_status st = KILN_OK;
    int64_t n = kiln_numel(mask);
    if (n > 0) {
      double keep = 1.0 - a->p;
      kiln__kargs k = {0};
      k.op = KILN__K_RAND_BERNOULLI;
      k.n_out = 1;
      k.out[0] = kiln__view_of(mask);
      k.s[0] = keep;
      k.s[1] = keep > 0.0 ? 1.0 / keep : 0.0; /* p == 1: every element dropped */
      kiln__generator_reserve(a->gen ? a->gen : kiln_generator_global(), n, &k.seed, &k.offset);
      st = kiln__dispatch(dev, &k);
    }
    if (st == KILN_OK) r = kiln_mul(t, mask);
  }
  c->out[0] = kiln__scope_return(r);
  return c->out[0] ? KILN_OK : kiln_last_error();
}

/* A composite: the mask's kernel is its own; the product is kiln_mul's (and so is the
** node). No autocast class: dropout runs in the dtype it is given (PyTorch's lists leave
** it out). */
static const kiln__op op_dropout = {
    .name = "dropout", .api = "kiln_dropout", .n_in = 1, .n_out = 1, .flags = KILN__OP_COMPOSITE,
    .n_kernels = 1, .kernels = {KILN__K_RAND_BERNOULLI}, .attrs = f_dropout, .n_attrs = 2,
    .attr_size = sizeof(attrs_dropout), .infer = dropout_infer, .forward = dropout_forward};

kiln_tensor *kiln_dropout(kiln_tensor *t, double p, bool train, kiln_generator *gen) {
  /* Identity (eval mode, p 0): the same tensor, as a new reference for the caller's
  ** scope, as PyTorch returns the input itself; that is not an op, and a trace shows none.
  ** Arguments infer would refuse still go to the call, for its error. */
  if (t && (!train || p == 0.0) && p >= 0.0 && p <= 1.0 && kiln_dtype_is_float(t->dtype))
    return kiln__scope_track(kiln_tensor_ref(t));
  attrs_dropout a = {p, train, gen};
  return kiln__op_call(&op_dropout, 1, &t, &a, NULL);
}

/* ---- dropout2d: one draw per (sample, channel), kept channels scaled by 1/(1-p) ----------- */

static kiln_status dropout2d_infer(kiln__op_ctx *c) {
  kiln_tensor *x = c->in[0];
  if (check_p(c) != KILN_OK) return kiln_last_error();
  if (!kiln_dtype_is_float(x->dtype) || x->ndim < 2)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_dropout2d: expected a floating input (N, C, ...), got %s %s",
                          kiln_dtype_name(x->dtype), kiln__tshape(x));
  kiln__op_meta_like(c, 0, x, x->dtype);
  return KILN_OK;
}

static kiln_status dropout2d_forward(kiln__op_ctx *c) {
  const attrs_dropout *a = c->attrs;
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
    .n_kernels = 2, .kernels = {KILN__K_RAND_BERNOULLI, KILN__K_MUL}, .attrs = f_dropout, .n_attrs = 2,
    .attr_size = sizeof(attrs_dropout), .infer = dropout2d_infer, .forward = dropout2d_forward};

kiln_tensor *kiln_dropout2d(kiln_tensor *x, double p, bool train, kiln_generator *gen) {
  if (x && (!train || p == 0.0) && p >= 0.0 && p <= 1.0 && kiln_dtype_is_float(x->dtype) && x->ndim >= 2)
    return kiln__scope_track(kiln_tensor_ref(x));
  attrs_dropout a = {p, train, gen};
  return kiln__op_call(&op_dropout2d, 1, &x, &a, NULL);
}
