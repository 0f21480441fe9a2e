/*
** softmax and log_softmax along one dim (attribute dim), descriptors on the one call path
** (op.h) with fused backward kernels:
**   softmax:      dx = y * (g - sum(g * y))        (SOFTMAX_BACKWARD, in0 y, in1 g)
**   log_softmax:  dx = g - exp(y) * sum(g)         (LOG_SOFTMAX_BACKWARD, in0 y, in1 g)
** Both backward rules need only the output y, which the node saves without a cycle, and
** the dim, which they read from the node's copy of the attribute record.
*/
#include "ops/op.h"

typedef struct attrs_softmax {
  int dim;
} attrs_softmax;
static const kiln__attr_field f_softmax[] = {KILN__FIELD(attrs_softmax, dim, KILN__A_INT32)};

/* The dim a record names for an input of ndim dims (infer checked it; 0 for a 0-dim one). */
static int wrapped_dim(const attrs_softmax *p, int ndim) {
  if (ndim == 0) return 0;
  return p->dim < 0 ? p->dim + ndim : p->dim;
}

static kiln_status softmax_bw_common(kiln__node *n, kiln_tensor *g, kiln_tensor **gi, kiln__kop op) {
  kiln_tensor *y = n->saved[0];
  kiln_tensor *dx = kiln__tensor_new(y->ndim, y->shape, y->dtype, kiln_device_of(y));
  if (!dx) return kiln_last_error();
  if (kiln_numel(dx) > 0) {
    kiln__kargs a = {0};
    a.op = op;
    a.n_in = 2;
    a.n_out = 1;
    a.in[0] = kiln__view_of_1d(y);
    kiln_tensor *gc = g;
    if (g->dtype != y->dtype) gc = kiln_to_dtype(g, y->dtype);
    if (!gc) return kiln_last_error();
    a.in[1] = kiln__view_of_1d(gc);
    a.out[0] = kiln__view_of_1d(dx);
    a.i[0] = wrapped_dim(n->attrs, y->ndim);
    kiln_status st = kiln__dispatch(kiln_device_of(y), &a);
    if (st != KILN_OK) return st;
  }
  gi[0] = kiln_keep(dx); /* the engine's reference; no copy */
  return KILN_OK;
}

static kiln_status softmax_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  return softmax_bw_common(n, g, gi, KILN__K_SOFTMAX_BACKWARD);
}

static kiln_status log_softmax_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  return softmax_bw_common(n, g, gi, KILN__K_LOG_SOFTMAX_BACKWARD);
}

static kiln_status softmax_infer(kiln__op_ctx *c) {
  const attrs_softmax *p = c->attrs;
  const char *op = c->op->api;
  kiln_tensor *t = c->in[0];
  if (!kiln_dtype_is_float(t->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: expected a floating tensor, got %s (shape %s)", op,
                          kiln_dtype_name(t->dtype), kiln__tshape(t));
  if (t->ndim == 0) {
    if (p->dim != 0 && p->dim != -1)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            "%s: dim %d out of range for a 0-dim tensor (expected 0 or -1)", op, p->dim);
  } else if (kiln__wrap_dim(op, p->dim, t->ndim) < 0) {
    return kiln_last_error();
  }
  kiln__op_meta_like(c, 0, t, t->dtype);
  return KILN_OK;
}

static kiln_status softmax_forward(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0], *out = c->out[0];
  if (kiln_numel(out) == 0) return KILN_OK;
  kiln__kargs a = {0};
  a.op = c->op->kernels[0];
  a.n_in = 1;
  a.n_out = 1;
  a.in[0] = kiln__view_of_1d(t);
  a.out[0] = kiln__view_of_1d(out);
  a.i[0] = wrapped_dim(c->attrs, t->ndim);
  return kiln__dispatch(kiln_device_of(t), &a);
}

/* saved: 0 the output y */
static void softmax_save(kiln__op_ctx *c, kiln__node *n) {
  KILN__UNUSED(c);
  kiln__node_save_output(n, 0);
}

#define SOFTMAX_OP(fname, kop, bw)                                                                    \
  static const kiln__op op_##fname = {                                                               \
      .name = #fname, .api = "kiln_" #fname, .n_in = 1, .n_out = 1, .amp = KILN__AMP_F32,            \
      .n_kernels = 1, .kernels = {kop}, .attrs = f_softmax, .n_attrs = 1,                            \
      .attr_size = sizeof(attrs_softmax), .infer = softmax_infer, .forward = softmax_forward,        \
      .backward = bw, .n_saved = 1, .save = softmax_save};
SOFTMAX_OP(softmax, KILN__K_SOFTMAX, softmax_backward)
SOFTMAX_OP(log_softmax, KILN__K_LOG_SOFTMAX, log_softmax_backward)

kiln_tensor *kiln_softmax(kiln_tensor *t, int dim) {
  attrs_softmax p = {dim};
  return kiln__op_call(&op_softmax, 1, &t, &p, NULL);
}

kiln_tensor *kiln_log_softmax(kiln_tensor *t, int dim) {
  attrs_softmax p = {dim};
  return kiln__op_call(&op_log_softmax, 1, &t, &p, NULL);
}
