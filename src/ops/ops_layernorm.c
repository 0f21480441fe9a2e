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

/* ---- residual_layer_norm: s = x + r, y = layer_norm(s) over the last dim ------------
** (r x's shape, or x's trailing dims repeated over the leading ones: a GPT's position
** embedding under its first block's norm; r's gradient is then summed over them).
** A transformer block's residual add and the norm after it, for training: one
** RESIDUAL_LAYER_NORM kernel where the device has it (CUDA), else ADD, LAYER_NORM and a
** cast (the reference). s's dtype is promote(x, r), as the add gives it; y's is asked
** for (y_dtype: under autocast the lower dtype the next product reads, so the f32 norm's
** output and its cast are one write). The numbers are the unfused ops' (add, f32 norm,
** cast): the kernel rounds as they do. The node keeps s, the weight and the (2, R) stats
** (row 0 the mean, row 1 rstd); its rule gets y's gradient and s's (grad_outs[1], the
** residual stream's) and gives x's (= s's total), r's (rounded to r's dtype: the cast's
** backward), the weight's and the bias's, in one RESIDUAL_LAYER_NORM_BACKWARD; where r is
** a linear's output (GPT-2's c_proj) and the device's kernel can, also that linear's bias
** gradient, r's gradient's column sums, handed to the linear's rule. Autocast class none:
** the op takes mixed dtypes itself. */
typedef struct attrs_rln {
  double eps;
  kiln_dtype y_dtype;
  bool ones; /* y padded with a ones column where the kernel can (kiln__residual_layer_norm_ones) */
} attrs_rln;
static const kiln__attr_field f_rln[] = {KILN__FIELD(attrs_rln, eps, KILN__A_FLOAT),
                                         KILN__FIELD(attrs_rln, y_dtype, KILN__A_DTYPE),
                                         KILN__FIELD(attrs_rln, ones, KILN__A_BOOL)};

static kiln_status rln_infer(kiln__op_ctx *c) {
  const attrs_rln *p = c->attrs;
  const char *op = "kiln_residual_layer_norm";
  kiln_tensor *x = c->in[0], *r = c->in[1];
  if (!kiln_dtype_is_float(x->dtype) || !kiln_dtype_is_float(r->dtype) || !kiln_dtype_is_float(p->y_dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: x %s, r %s and y_dtype %s must be floating", op,
                          kiln_dtype_name(x->dtype), kiln_dtype_name(r->dtype), kiln_dtype_name(p->y_dtype));
  /* r: x's shape, or x's trailing dims (repeated over the leading ones: a GPT's position
  ** embedding (T, C) for x (B, T, C)) */
  const int lead = x->ndim - r->ndim;
  bool same = x->ndim >= 1 && r->ndim >= 1 && lead >= 0;
  for (int d = 0; same && d < r->ndim; d++) same = x->shape[lead + d] == r->shape[d];
  if (!same)
    return kiln_set_error(KILN_ERR_SHAPE,
                          "%s: r %s must have x's shape %s or its trailing dims (at least the last one)", op,
                          kiln__tshape(r), kiln__tshape(x));
  int64_t N = x->shape[x->ndim - 1];
  static const char *const names[] = {"x", "r", "weight", "bias"};
  for (int i = 2; i < 4; i++) {
    kiln_tensor *w = c->in[i];
    if (!w) continue;
    if (w->ndim != 1 || w->shape[0] != N)
      return kiln_set_error(KILN_ERR_SHAPE, "%s: %s has shape %s, expected [%lld] (x %s)", op, names[i],
                            kiln__tshape(w), (long long)N, kiln__tshape(x));
    if (!kiln_dtype_is_float(w->dtype))
      return kiln_set_error(KILN_ERR_DTYPE, "%s: %s must be floating, got %s", op, names[i], kiln_dtype_name(w->dtype));
  }
  if (!(p->eps >= 0)) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: eps must be >= 0, got %g", op, p->eps);
  c->n_out = 2;
  kiln__op_meta(c, 0, x->ndim, x->shape, p->y_dtype);
  kiln__op_meta(c, 1, x->ndim, x->shape, kiln_dtype_promote(x->dtype, r->dtype));
  return KILN_OK;
}

/* y of x's shape with rows N + 8 apart in a new (R, N + 8) buffer (the 8 for the ones
** column, 16 bytes of a 16-bit dtype). */
static kiln_tensor *padded_rows(const kiln_tensor *x, int64_t R, int64_t N, kiln_dtype dt) {
  kiln_tensor *full = kiln__tensor_new(2, (const int64_t[]){R, N + 8}, dt, kiln_device_of(x));
  if (!full) return NULL;
  int64_t st[KILN_MAX_DIMS];
  st[x->ndim - 1] = 1;
  for (int d = x->ndim - 2; d >= 0; d--) st[d] = d == x->ndim - 2 ? N + 8 : st[d + 1] * x->shape[d + 1];
  kiln_tensor *y = kiln__tensor_make(full->storage, 0, x->ndim, x->shape, st, dt);
  kiln__discard(full); /* y holds the storage */
  return y;
}

/* tmp: 0 stats (2, R), 1 weight (contiguous, or NULL). Makes its outputs (SELF_ALLOC): y
** is padded when p->ones and the kernel takes it (flag 4; ones_col set once written). */
static kiln_status rln_forward(kiln__op_ctx *c) {
  const attrs_rln *p = c->attrs;
  kiln_tensor *x = c->in[0], *r = c->in[1];
  const int64_t N = x->shape[x->ndim - 1], R = N ? kiln_numel(x) / N : 0;
  kiln_device dev = kiln_device_of(x);
  kiln_tensor *s = c->out[1] = kiln__tensor_new(c->meta[1].ndim, c->meta[1].shape, c->meta[1].dtype, dev);
  if (!s) return kiln_last_error();
  const kiln_dtype sdt = s->dtype, stdt = sdt == KILN_F64 ? KILN_F64 : KILN_F32;
  bool pad = p->ones && kiln_dtype_size(p->y_dtype) == 2 && N % 8 == 0 && R * N > 0 && sdt == x->dtype;
  kiln_tensor *y = pad ? padded_rows(x, R, N, p->y_dtype) : NULL;
  kiln_tensor *stats = c->tmp[0] = kiln__tensor_new(2, (const int64_t[]){2, R}, stdt, dev);
  kiln_tensor *xc = contig_nograd(x), *rc = contig_nograd(r);
  kiln_tensor *wc = c->tmp[1] = contig_nograd(c->in[2]), *bc = contig_nograd(c->in[3]);
  if (!stats || !xc || !rc || (c->in[2] && !wc) || (c->in[3] && !bc)) return kiln_last_error();
  if (R * N == 0) {
    c->out[0] = kiln__tensor_new(c->meta[0].ndim, c->meta[0].shape, c->meta[0].dtype, dev);
    return c->out[0] ? KILN_OK : kiln_last_error();
  }
  const int64_t Rr = N ? kiln_numel(r) / N : 0; /* r's rows: R, or fewer repeated */
  kiln__kargs a = {0};
  a.op = KILN__K_RESIDUAL_LAYER_NORM;
  a.in[a.n_in++] = rows_view(xc, R, N);
  a.in[a.n_in++] = rows_view(rc, Rr, N);
  if (wc) a.in[a.n_in++] = vec_view(wc, N), a.i[0] |= 1;
  if (bc) a.in[a.n_in++] = vec_view(bc, N), a.i[0] |= 2;
  a.n_out = 3;
  a.out[1] = rows_view(s, R, N);
  a.out[2] = kiln__view_of(stats);
  a.s[0] = p->eps;
  if (y) { /* rows N + 8 apart, the kernel writing the ones column */
    a.out[0] = rows_view(y, R, N);
    a.out[0].strides[0] = N + 8;
    a.i[0] |= 4;
    if (!kiln__dispatch_has(dev, &a, KILN__K_RESIDUAL_LAYER_NORM)) a.i[0] &= ~4, y = NULL;
  }
  if (!y) {
    y = kiln__tensor_new(c->meta[0].ndim, c->meta[0].shape, c->meta[0].dtype, dev);
    if (!y) return kiln_last_error();
    a.out[0] = rows_view(y, R, N);
  }
  c->out[0] = y;
  if (sdt == x->dtype && kiln__dispatch_has(dev, &a, KILN__K_RESIDUAL_LAYER_NORM)) {
    kiln_status st = kiln__dispatch(dev, &a);
    if (st == KILN_OK && (a.i[0] & 4)) y->ones_col = true;
    return st;
  }
  /* composed: s = x + r (in s's dtype), the norm in s's dtype, then y in its own */
  bool prev = kiln_set_grad_enabled(false);
  kiln_tensor *xs = kiln__as_dtype_nograd(xc, sdt), *rs = kiln__as_dtype_nograd(rc, sdt);
  kiln_tensor *ys = y->dtype == sdt ? y : kiln__tensor_new(y->ndim, y->shape, sdt, dev);
  kiln_set_grad_enabled(prev);
  if (!xs || !rs || !ys) return kiln_last_error();
  kiln__kargs k = {0};
  k.op = KILN__K_ADD;
  k.n_in = 2;
  k.in[0] = kiln__view_of(xs);
  k.in[1] = kiln__view_broadcast(rs, s->ndim, s->shape);
  k.s[0] = 1.0;
  kiln_status st = kiln__run_into(s, &k);
  if (st != KILN_OK) return st;
  kiln__view mean = kiln__view_of(stats), rstd = mean;
  mean.ndim = rstd.ndim = 1;
  mean.shape[0] = rstd.shape[0] = R;
  mean.strides[0] = rstd.strides[0] = 1;
  rstd.data = (char *)rstd.data + R * (int64_t)kiln_dtype_size(stdt);
  kiln__kargs l = {0};
  l.op = KILN__K_LAYER_NORM;
  l.in[l.n_in++] = rows_view(s, R, N);
  if (wc) l.in[l.n_in++] = vec_view(wc, N), l.i[0] |= 1;
  if (bc) l.in[l.n_in++] = vec_view(bc, N), l.i[0] |= 2;
  l.out[l.n_out++] = rows_view(ys, R, N);
  l.out[l.n_out++] = mean;
  l.out[l.n_out++] = rstd;
  l.s[0] = p->eps;
  st = kiln__dispatch(dev, &l);
  if (st != KILN_OK || ys == y) return st;
  kiln__kargs cp = {0};
  cp.op = KILN__K_COPY;
  cp.n_in = 1;
  cp.in[0] = kiln__view_of(ys);
  return kiln__run_into(y, &cp);
}

/* saved: 0 s (an alias: the node's own output), 1 weight (contiguous, or NULL), 2 stats */
static void rln_save(kiln__op_ctx *c, kiln__node *n) {
  kiln_tensor *sa = kiln__tensor_alias(c->out[1], false);
  kiln__node_save(n, 0, sa);
  kiln_tensor_free(sa);
  kiln__node_save(n, 1, c->tmp[1]);
  kiln__node_save(n, 2, c->tmp[0]);
}

static kiln_status rln_backward(kiln__node *n, kiln_tensor *gy, kiln_tensor **gi) {
  kiln_tensor *s = n->saved[0], *w = n->saved[1], *stats = n->saved[2];
  kiln_tensor *gs = n->grad_outs ? n->grad_outs[1] : NULL;
  const int64_t N = s->shape[s->ndim - 1], R = N ? kiln_numel(s) / N : 0;
  kiln_device dev = kiln_device_of(s);
  const kiln_dtype sdt = s->dtype, rdt = n->in_dtype[1];
  const bool need_r = n->needs[1], need_w = n->n_in > 2 && n->needs[2] && w, need_b = n->n_in > 3 && n->needs[3];
  const bool rbc = n->in_ndim[1] < s->ndim; /* r repeated over s's leading dims: its gradient is summed */
  kiln_tensor *ds = kiln__tensor_new(s->ndim, s->shape, sdt, dev);
  kiln_tensor *dr = need_r && !rbc && rdt != sdt ? kiln__tensor_new(s->ndim, s->shape, rdt, dev) : NULL;
  kiln_tensor *dw = need_w ? kiln__tensor_new(1, &N, n->in_dtype[2], dev) : NULL;
  kiln_tensor *db = need_b ? kiln__tensor_new(1, &N, n->in_dtype[3], dev) : NULL;
  kiln_tensor *gyc = gy ? kiln_contiguous(gy) : kiln_zeros(s->ndim, s->shape, sdt, dev);
  kiln_tensor *gsc = gs ? kiln_contiguous(kiln__as_dtype_nograd(gs, sdt)) : NULL;
  if (!ds || (need_r && !rbc && rdt != sdt && !dr) || (need_w && !dw) || (need_b && !db) || !gyc || (gs && !gsc))
    return kiln_last_error();
  kiln_status st = KILN_OK;
  if (R * N == 0) {
    st = kiln_fill_(ds, 0);
    if (st == KILN_OK && dr) st = kiln_fill_(dr, 0);
    if (st == KILN_OK && dw) st = kiln_fill_(dw, 0);
    if (st == KILN_OK && db) st = kiln_fill_(db, 0);
  } else {
    kiln__kargs a = {0};
    a.op = KILN__K_RESIDUAL_LAYER_NORM_BACKWARD;
    a.in[a.n_in++] = rows_view(s, R, N);
    a.in[a.n_in++] = rows_view(gyc, R, N);
    a.in[a.n_in++] = kiln__view_of(stats);
    if (w) a.in[a.n_in++] = vec_view(w, N), a.i[0] |= 1;
    if (gsc) a.in[a.n_in++] = rows_view(gsc, R, N), a.i[0] |= 2;
    a.n_out = 4;
    a.out[0] = rows_view(ds, R, N);
    a.out[1] = dr ? rows_view(dr, R, N) : a.out[0];
    a.out[2] = dw ? vec_view(dw, N) : vec_view(ds, N);
    a.out[3] = db ? vec_view(db, N) : vec_view(ds, N);
    a.i[1] = (dr ? 1 : 0) | (dw ? 2 : 0) | (db ? 4 : 0);
    /* r made by a linear whose bias wants a gradient: that gradient is the column sums of
    ** r's, which the kernel can add up while it writes them (CUDA's chunked kernel: no
    ** column-sum kernel of the linear's own); the linear's rule takes it (bias_grad) */
    kiln__node *lin = n->next[1].node;
    kiln_dtype rsdt = KILN_F32;
    kiln_tensor *rsum = NULL;
    if (need_r && !rbc && kiln__linear_bias_handover(lin, n->next[1].index, &rsdt)) {
      if (!(rsum = kiln__tensor_new(1, &N, rsdt, dev))) return kiln_last_error();
      a.out[a.n_out++] = vec_view(rsum, N);
      a.i[1] |= 8;
      if (!kiln__dispatch_has(dev, &a, KILN__K_RESIDUAL_LAYER_NORM_BACKWARD)) a.n_out = 4, a.i[1] &= ~8, rsum = NULL;
    }
    if (kiln__dispatch_has(dev, &a, KILN__K_RESIDUAL_LAYER_NORM_BACKWARD)) {
      st = kiln__dispatch(dev, &a);
      if (st == KILN_OK && rsum) lin->bias_grad = kiln_tensor_ref(rsum);
    } else { /* composed: LAYER_NORM_BACKWARD on g in s's dtype, + gs, then r's cast */
      kiln_tensor *gys = kiln_contiguous(kiln__as_dtype_nograd(gyc, sdt));
      kiln_tensor *dxl = gsc ? kiln__tensor_new(s->ndim, s->shape, sdt, dev) : ds;
      kiln_tensor *dw2 = (dw || db) ? kiln__tensor_new(1, &N, dw ? dw->dtype : sdt, dev) : NULL;
      if (!gys || !dxl || ((dw || db) && !dw2)) return kiln_last_error();
      kiln__view mean = kiln__view_of(stats), rstd = mean;
      mean.ndim = rstd.ndim = 1;
      mean.shape[0] = rstd.shape[0] = R;
      mean.strides[0] = rstd.strides[0] = 1;
      rstd.data = (char *)rstd.data + R * (int64_t)kiln_dtype_size(stats->dtype);
      kiln__kargs l = {0};
      l.op = KILN__K_LAYER_NORM_BACKWARD;
      l.n_in = 4;
      l.in[0] = rows_view(s, R, N);
      l.in[1] = rows_view(gys, R, N);
      l.in[2] = mean;
      l.in[3] = rstd;
      if (w) l.in[l.n_in++] = vec_view(w, N), l.i[0] |= 1;
      l.out[l.n_out++] = rows_view(dxl, R, N);
      if (dw2) l.out[l.n_out++] = vec_view(dw2, N);
      if (db) l.out[l.n_out++] = vec_view(db, N);
      st = kiln__dispatch(dev, &l);
      if (st == KILN_OK && dw) st = kiln_copy_(dw, dw2);
      if (st == KILN_OK && gsc) {
        kiln__kargs k = {0};
        k.op = KILN__K_ADD;
        k.n_in = 2;
        k.in[0] = kiln__view_of(dxl);
        k.in[1] = kiln__view_of(gsc);
        k.s[0] = 1.0;
        st = kiln__run_into(ds, &k);
      }
      if (st == KILN_OK && dr) st = kiln_copy_(dr, ds);
    }
  }
  if (st != KILN_OK) return st;
  if (n->needs[0]) {
    kiln_tensor *dx = n->in_dtype[0] == sdt ? ds : kiln__as_dtype_nograd(ds, n->in_dtype[0]);
    if (!dx || kiln__give_grad(&gi[0], dx, gy) != KILN_OK) return kiln_last_error();
  }
  if (need_r && rbc) { /* the sum over the dims r was repeated over, in s's dtype, then r's (add's rule) */
    kiln_tensor *d1 = kiln__unbroadcast(ds, n->in_ndim[1], n->in_shape[1]);
    if (!d1 || kiln__give_grad(&gi[1], kiln__as_dtype_nograd(d1, rdt), gy) != KILN_OK) return kiln_last_error();
  } else if (need_r && kiln__give_grad(&gi[1], dr ? dr : ds, gy) != KILN_OK) {
    return kiln_last_error();
  }
  if (need_w && kiln__give_grad(&gi[2], dw, gy) != KILN_OK) return kiln_last_error();
  if (need_b && kiln__give_grad(&gi[3], db, gy) != KILN_OK) return kiln_last_error();
  return KILN_OK;
}

static const kiln__op op_residual_layer_norm = {
    .name = "residual_layer_norm", .api = "kiln_residual_layer_norm", .n_in = 4, .n_out = 2,
    .optional = (1u << 2) | (1u << 3), .amp = KILN__AMP_NONE, .flags = KILN__OP_SELF_ALLOC, .n_kernels = 4,
    .kernels = {KILN__K_RESIDUAL_LAYER_NORM, KILN__K_ADD, KILN__K_LAYER_NORM, KILN__K_COPY}, .attrs = f_rln,
    .n_attrs = 3, .attr_size = sizeof(attrs_rln), .infer = rln_infer, .forward = rln_forward,
    .backward = rln_backward, .n_saved = 3, .save = rln_save,
    .expands_to = (const char *const[]){"add", "layer_norm", NULL}};

static kiln_tensor *rln_call(kiln_tensor *x, kiln_tensor *r, kiln_tensor *weight, kiln_tensor *bias, double eps,
                             kiln_dtype y_dtype, bool ones, kiln_tensor **sum) {
  attrs_rln p = {eps, y_dtype, ones};
  kiln_tensor *in[4] = {x, r, weight, bias};
  kiln_tensor *out[2] = {NULL, NULL};
  kiln_tensor *y = kiln__op_call(&op_residual_layer_norm, 4, in, &p, out);
  if (sum) *sum = y ? out[1] : NULL;
  return y;
}

kiln_tensor *kiln_residual_layer_norm(kiln_tensor *x, kiln_tensor *r, kiln_tensor *weight, kiln_tensor *bias,
                                      double eps, kiln_dtype y_dtype, kiln_tensor **sum) {
  return rln_call(x, r, weight, bias, eps, y_dtype, false, sum);
}

kiln_tensor *kiln__residual_layer_norm_ones(kiln_tensor *x, kiln_tensor *r, kiln_tensor *weight, kiln_tensor *bias,
                                            double eps, kiln_dtype y_dtype, kiln_tensor **sum) {
  return rln_call(x, r, weight, bias, eps, y_dtype, true, sum);
}
