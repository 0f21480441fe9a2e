/*
** softmax and log_softmax along one dim, with fused backward kernels:
**   softmax:      dx = y * (g - sum(g * y))        (SOFTMAX_BACKWARD, in0 y, in1 g)
**   log_softmax:  dx = g - exp(y) * sum(g)         (LOG_SOFTMAX_BACKWARD, in0 y, in1 g)
** Both backward rules need only the output y, which the node saves without a cycle.
*/
#include "../core/kiln_int.h"

/* A 0-dim tensor is softmaxed as one element along a dim of size 1 (PyTorch: result 1). */
static kiln__view view1(const kiln_tensor *t) {
  kiln__view v = kiln__view_of(t);
  if (v.ndim == 0) {
    v.ndim = 1;
    v.shape[0] = 1;
    v.strides[0] = 1;
  }
  return v;
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
    a.in[0] = view1(y);
    kiln_tensor *gc = g;
    if (g->dtype != y->dtype) gc = kiln_to_dtype(g, y->dtype);
    if (!gc) return kiln_last_error();
    a.in[1] = view1(gc);
    a.out[0] = view1(dx);
    a.i[0] = n->i[0];
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

static kiln_tensor *softmax_common(const char *op, const char *name, kiln__kop kop,
                                   kiln__backward_fn bw, kiln_tensor *t, int dim) {
  if (!t) return NULL;
  if (!kiln_dtype_is_float(t->dtype))
    KILN__FAIL_NULL(KILN_ERR_DTYPE, "%s: expected a floating tensor, got %s (shape %s)", op,
                    kiln_dtype_name(t->dtype), kiln__tshape(t));
  int d = 0;
  if (t->ndim == 0) {
    if (dim != 0 && dim != -1)
      KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT,
                      "%s: dim %d out of range for a 0-dim tensor (expected 0 or -1)", op, dim);
  } else {
    d = kiln__wrap_dim(op, dim, t->ndim);
    if (d < 0) return NULL;
  }
  kiln_device dev = kiln_device_of(t);
  kiln_tensor *out = kiln__tensor_new(t->ndim, t->shape, t->dtype, dev);
  if (!out) return NULL;
  if (kiln_numel(out) > 0) {
    kiln__kargs a = {0};
    a.op = kop;
    a.n_in = 1;
    a.n_out = 1;
    a.in[0] = view1(t);
    a.out[0] = view1(out);
    a.i[0] = d;
    if (kiln__dispatch(dev, &a) != KILN_OK) {
      kiln__discard(out);
      return NULL;
    }
  }
  if (kiln__needs_grad(1, &t)) {
    kiln__node *n = kiln__node_attach(out, name, bw, 1, &t);
    if (!n) {
      kiln__discard(out);
      return NULL;
    }
    kiln__node_save_output(n, 0);
    n->i[0] = d;
  }
  return out;
}

kiln_tensor *kiln_softmax(kiln_tensor *t, int dim) {
  return softmax_common("kiln_softmax", "softmax", KILN__K_SOFTMAX, softmax_backward, t, dim);
}

kiln_tensor *kiln_log_softmax(kiln_tensor *t, int dim) {
  return softmax_common("kiln_log_softmax", "log_softmax", KILN__K_LOG_SOFTMAX,
                        log_softmax_backward, t, dim);
}
