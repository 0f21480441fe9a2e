/*
** layer_norm and rms_norm over the last dims (PyTorch's normalized_shape), fused: one
** LAYER_NORM kernel gives y and each row's mean and rstd, which the node keeps (forward
** intermediates parked in c->tmp and saved), and one LAYER_NORM_BACKWARD kernel gives dx,
** dweight and dbias from them:
**   layer norm: y = (x - mean) rstd w + b,  rstd = 1 / sqrt(var + eps) (var biased)
**   rms norm:   y = x rstd w,               rstd = 1 / sqrt(mean(x^2) + eps)
**   dx = rstd (g w - mean(g w) - xhat mean(g w xhat)), xhat = (x - mean) rstd; RMS norm
**   without the mean(g w) term. dweight = sum over rows of g xhat, dbias = sum of g.
** The kernels see x as (rows, n): a non-contiguous x is copied first. Autocast class
** F32 (PyTorch runs both norms in f32).
*/
#include "ops/op.h"

#include <string.h>

typedef struct attrs_norm {
  int64_t shape[KILN_MAX_DIMS]; /* normalized_shape */
  int ndims;
  double eps;
} attrs_norm;
static const kiln__attr_field f_norm[] = {KILN__FIELD_INTS(attrs_norm, shape, ndims),
                                          KILN__FIELD(attrs_norm, eps, KILN__A_FLOAT)};

static bool is_rms(const kiln__op *op) { return op->kernels[0] == KILN__K_LAYER_NORM && op->n_in == 2; }

/* The 2-d kernel view (rows, n) of a contiguous tensor. */
static kiln__view rows_view(const kiln_tensor *t, int64_t rows, int64_t n) {
  kiln__view v = kiln__view_of(t);
  v.ndim = 2;
  v.shape[0] = rows, v.shape[1] = n;
  v.strides[0] = n, v.strides[1] = 1;
  return v;
}

static kiln__view vec_view(const kiln_tensor *t, int64_t n) {
  kiln__view v = kiln__view_of(t);
  v.ndim = 1;
  v.shape[0] = n;
  v.strides[0] = 1;
  return v;
}

/* contiguous without a node (the op's own node covers it) */
static kiln_tensor *contig_nograd(kiln_tensor *t) {
  if (!t || kiln_is_contiguous(t)) return t;
  bool prev = kiln_set_grad_enabled(false);
  kiln_tensor *r = kiln_contiguous(t);
  kiln_set_grad_enabled(prev);
  return r;
}

static kiln_status norm_infer(kiln__op_ctx *c) {
  const attrs_norm *p = c->attrs;
  const char *op = c->op->api;
  kiln_tensor *x = c->in[0];
  if (!kiln_dtype_is_float(x->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: expected a floating tensor, got %s (shape %s)", op,
                          kiln_dtype_name(x->dtype), kiln__tshape(x));
  if (p->ndims < 1 || p->ndims > x->ndim)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: normalized_shape has %d dims; the input %s has %d (expected 1 to %d)",
                          op, p->ndims, kiln__tshape(x), x->ndim, x->ndim);
  for (int d = 0; d < p->ndims; d++)
    if (x->shape[x->ndim - p->ndims + d] != p->shape[d])
      return kiln_set_error(KILN_ERR_SHAPE, "%s: normalized_shape %s does not match the last dims of the input %s",
                            op, kiln__shape_cstr(p->ndims, p->shape), kiln__tshape(x));
  if (!(p->eps >= 0))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: eps must be >= 0, got %g", op, p->eps);
  static const char *const names[] = {"input", "weight", "bias"};
  for (int i = 1; i < c->n_in; i++) {
    kiln_tensor *w = c->in[i];
    if (!w) continue;
    bool same = w->ndim == p->ndims;
    for (int d = 0; same && d < p->ndims; d++) same = w->shape[d] == p->shape[d];
    if (!same)
      return kiln_set_error(KILN_ERR_SHAPE, "%s: %s has shape %s, expected normalized_shape %s", op, names[i],
                            kiln__tshape(w), kiln__shape_cstr(p->ndims, p->shape));
    if (!kiln_dtype_is_float(w->dtype))
      return kiln_set_error(KILN_ERR_DTYPE, "%s: %s must be floating, got %s", op, names[i], kiln_dtype_name(w->dtype));
  }
  kiln__op_meta_like(c, 0, x, x->dtype);
  return KILN_OK;
}

static kiln_status norm_forward(kiln__op_ctx *c) {
  const attrs_norm *p = c->attrs;
  bool rms = is_rms(c->op);
  kiln_tensor *x = c->in[0], *w = c->in[1], *b = rms ? NULL : c->in[2];
  int64_t n = kiln__shape_numel(p->ndims, p->shape);
  int64_t rows = kiln__shape_numel(x->ndim - p->ndims, x->shape);
  kiln_dtype st = x->dtype == KILN_F64 ? KILN_F64 : KILN_F32;
  kiln_device dev = kiln_device_of(x);
  /* tmp: 0 x (contiguous), 1 mean, 2 rstd, 3 weight, 4 bias (contiguous) */
  kiln_tensor *xc = c->tmp[0] = contig_nograd(x);
  kiln_tensor *mean = c->tmp[1] = kiln__tensor_new(1, &rows, st, dev);
  kiln_tensor *rstd = c->tmp[2] = kiln__tensor_new(1, &rows, st, dev);
  kiln_tensor *wc = c->tmp[3] = contig_nograd(w);
  kiln_tensor *bc = c->tmp[4] = contig_nograd(b);
  if (!xc || !mean || !rstd || (w && !wc) || (b && !bc)) return kiln_last_error();
  if (rows * n == 0) return KILN_OK;
  kiln__kargs a = {0};
  a.op = KILN__K_LAYER_NORM;
  a.in[a.n_in++] = rows_view(xc, rows, n);
  if (wc) a.in[a.n_in++] = vec_view(wc, n), a.i[0] |= 1;
  if (bc) a.in[a.n_in++] = vec_view(bc, n), a.i[0] |= 2;
  a.out[a.n_out++] = rows_view(c->out[0], rows, n);
  a.out[a.n_out++] = kiln__view_of(rms ? rstd : mean);
  if (!rms) a.out[a.n_out++] = kiln__view_of(rstd);
  a.s[0] = p->eps;
  a.i[1] = rms;
  return kiln__dispatch(dev, &a);
}

/* saved: 0 x (contiguous), 1 weight (contiguous, or NULL), 2 mean, 3 rstd */
static void norm_save(kiln__op_ctx *c, kiln__node *n) {
  kiln__node_save(n, 0, c->tmp[0]);
  kiln__node_save(n, 1, c->tmp[3]);
  kiln__node_save(n, 2, c->tmp[1]);
  kiln__node_save(n, 3, c->tmp[2]);
}

static kiln_status norm_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  const attrs_norm *p = n->attrs;
  bool rms = is_rms(n->op);
  kiln_tensor *x = n->saved[0], *w = n->saved[1], *mean = n->saved[2], *rstd = n->saved[3];
  int64_t nn = kiln__shape_numel(p->ndims, p->shape);
  int64_t rows = kiln__shape_numel(x->ndim - p->ndims, x->shape);
  kiln_device dev = kiln_device_of(x);
  bool need_w = w && n->needs[1], need_b = !rms && n->n_in > 2 && n->needs[2];
  kiln_tensor *dx = kiln__tensor_new(x->ndim, x->shape, x->dtype, dev);
  kiln_tensor *dw = need_w || need_b ? kiln__tensor_new(1, &nn, w ? w->dtype : x->dtype, dev) : NULL;
  kiln_tensor *db = need_b ? kiln__tensor_new(1, &nn, n->in_dtype[2], dev) : NULL;
  kiln_tensor *gc = kiln_contiguous(g);
  if (!dx || !gc || ((need_w || need_b) && !dw) || (need_b && !db)) return kiln_last_error();
  if (rows * nn == 0) {
    if (kiln_fill_(dx, 0) != KILN_OK || (dw && kiln_fill_(dw, 0) != KILN_OK) || (db && kiln_fill_(db, 0) != KILN_OK))
      return kiln_last_error();
  } else {
    kiln__kargs a = {0};
    a.op = KILN__K_LAYER_NORM_BACKWARD;
    a.n_in = 4;
    a.in[0] = rows_view(x, rows, nn);
    a.in[1] = rows_view(gc, rows, nn);
    a.in[2] = kiln__view_of(mean);
    a.in[3] = kiln__view_of(rstd);
    if (w) a.in[a.n_in++] = vec_view(w, nn), a.i[0] |= 1;
    a.out[a.n_out++] = rows_view(dx, rows, nn);
    if (dw) a.out[a.n_out++] = vec_view(dw, nn);
    if (db) a.out[a.n_out++] = vec_view(db, nn);
    a.i[1] = rms;
    kiln_status st = kiln__dispatch(dev, &a);
    if (st != KILN_OK) return st;
  }
  if (n->needs[0]) gi[0] = kiln_keep(dx);
  if (need_w) gi[1] = kiln_keep(kiln_reshape(dw, p->ndims, p->shape));
  if (need_b) gi[2] = kiln_keep(kiln_reshape(db, p->ndims, p->shape));
  if ((need_w && !gi[1]) || (need_b && !gi[2])) return kiln_last_error();
  return KILN_OK;
}

static const kiln__op op_layer_norm = {
    .name = "layer_norm", .api = "kiln_layer_norm", .n_in = 3, .n_out = 1, .optional = (1u << 1) | (1u << 2),
    .amp = KILN__AMP_F32, .n_kernels = 1, .kernels = {KILN__K_LAYER_NORM}, .attrs = f_norm, .n_attrs = 2,
    .attr_size = sizeof(attrs_norm), .infer = norm_infer, .forward = norm_forward, .backward = norm_backward,
    .n_saved = 4, .save = norm_save};
/* n_in 2 tells the shared functions it is the RMS norm */
static const kiln__op op_rms_norm = {
    .name = "rms_norm", .api = "kiln_rms_norm", .n_in = 2, .n_out = 1, .optional = 1u << 1,
    .amp = KILN__AMP_F32, .n_kernels = 1, .kernels = {KILN__K_LAYER_NORM}, .attrs = f_norm, .n_attrs = 2,
    .attr_size = sizeof(attrs_norm), .infer = norm_infer, .forward = norm_forward, .backward = norm_backward,
    .n_saved = 4, .save = norm_save};

static bool norm_attrs(const char *api, int ndims, const int64_t *shape, double eps, attrs_norm *p) {
  memset(p, 0, sizeof *p);
  if (ndims < 1 || ndims > KILN_MAX_DIMS || !shape) {
    kiln_set_error(KILN_ERR_SHAPE, "%s: normalized_shape must have 1 to %d dims, got %d%s", api, KILN_MAX_DIMS, ndims,
                   shape ? "" : " (NULL)");
    return false;
  }
  memcpy(p->shape, shape, sizeof(int64_t) * (size_t)ndims);
  p->ndims = ndims;
  p->eps = eps;
  return true;
}

kiln_tensor *kiln_layer_norm(kiln_tensor *x, int ndims, const int64_t *normalized_shape, kiln_tensor *weight,
                             kiln_tensor *bias, double eps) {
  attrs_norm p;
  if (!norm_attrs("kiln_layer_norm", ndims, normalized_shape, eps, &p)) return NULL;
  kiln_tensor *in[3] = {x, weight, bias};
  return kiln__op_call(&op_layer_norm, 3, in, &p, NULL);
}

kiln_tensor *kiln_rms_norm(kiln_tensor *x, int ndims, const int64_t *normalized_shape, kiln_tensor *weight,
                           double eps) {
  attrs_norm p;
  if (!norm_attrs("kiln_rms_norm", ndims, normalized_shape, eps, &p)) return NULL;
  kiln_tensor *in[2] = {x, weight};
  return kiln__op_call(&op_rms_norm, 2, in, &p, NULL);
}
