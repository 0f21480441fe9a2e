/*
** Normalization of convolutional networks: batch_norm, group_norm, composites on the
** one call path (op.h), so their backward comes from the
** ops they are made of (mean, var, sub, mul, rsqrt: exact, every backend).
**
** batch_norm follows PyTorch: in training it normalizes with the batch's statistics over
** every dim but the channels (dim 1), the biased variance, and updates the running
** statistics in place with momentum, running = (1 - m) running + m stat, the variance's
** update using the unbiased variance; in eval it normalizes with the running statistics.
** 16-bit inputs are computed in f32 (the norms' autocast class) and the result cast back.
*/
#include "ops/op.h"

#include <stdlib.h>
#include <string.h>

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

/* Both norms' input: floating, (N, C, ...). */
static kiln_status check_nc_input(const char *api, const kiln_tensor *x) {
  if (!kiln_dtype_is_float(x->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: expected a floating input, got %s (shape %s)", api,
                          kiln_dtype_name(x->dtype), kiln__tshape(x));
  if (x->ndim < 2)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: expected an input (N, C, ...), got shape %s", api, kiln__tshape(x));
  return KILN_OK;
}

static kiln_status bn_infer(kiln__op_ctx *c) {
  const attrs_bn *p = c->attrs;
  const char *api = "kiln_batch_norm";
  kiln_tensor *x = c->in[0];
  if (check_nc_input(api, x) != KILN_OK) return kiln_last_error();
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
    .flags = KILN__OP_COMPOSITE, .n_kernels = 2, .kernels = {KILN__K_SUM, KILN__K_MUL},
    .attrs = f_bn, .n_attrs = 3, .attr_size = sizeof(attrs_bn), .infer = bn_infer, .forward = bn_forward};

/* ---- batch_norm through its kernels -------------------------------------------------------
** Where the device has BATCH_NORM (the CPU, CUDA), the op is one kernel call forward and one
** backward instead of ~18 and ~30 composed ones, and its node keeps x, the weight and the
** (2, C) f32 statistics (mean, invstd) instead of the composite's intermediates.
**
** The kernels see x as (N, C, S), S the spatial dims merged. Two layouts run without a copy:
** S innermost (NCHW, (N, C, L)) and the channels innermost (channels-last, (N, C)); the
** output and the input gradient are made in the layout of x, so a channels-last input gives
** a channels-last output (as cuDNN's convolution does). Anything else is copied contiguous
** first. The gradient is brought to x's layout when it comes in another.
**
** Under autocast the class is none, as PyTorch's batch_norm (in no autocast list): a bf16
** activation stays bf16 with f32 weight and statistics, the kernels computing in f32. */

/* The (N, C, S) view of a tensor of shape/strides (v holds its data and dtype); false when
** the spatial dims do not merge into one strided dim. */
static bool ncs_geom(int ndim, const int64_t *shape, const int64_t *strides, kiln__view *v) {
  int64_t S = 1, ss = 1;
  bool have = false;
  for (int d = ndim - 1; d >= 2; d--) {
    if (shape[d] == 1) continue;
    if (shape[d] == 0) {
      S = 0;
      break;
    }
    if (!have) {
      ss = strides[d], S = shape[d], have = true;
    } else {
      if (strides[d] != ss * S) return false;
      S *= shape[d];
    }
  }
  v->ndim = 3;
  v->shape[0] = shape[0], v->shape[1] = shape[1], v->shape[2] = S;
  v->strides[0] = strides[0], v->strides[1] = strides[1], v->strides[2] = have ? ss : 1;
  return true;
}

static bool ncs_view(const kiln_tensor *t, kiln__view *v) {
  *v = kiln__view_of(t);
  return ncs_geom(t->ndim, t->shape, t->strides, v);
}

/* The two layouts the kernels take: S innermost (cf), or the channels (cl). */
static bool view_cf(const kiln__view *v) { return v->shape[2] <= 1 || v->strides[2] == 1; }
static bool view_cl(const kiln__view *v) { return v->shape[1] <= 1 || v->strides[1] == 1; }

/* Memory for a shape on dev, contiguous or channels-last (any ndim: memory order (N, d2,
** ..., C)). */
static kiln_tensor *alloc_shape(kiln_device dev, int nd, const int64_t *shape, bool cl, kiln_dtype dt) {
  if (!cl) return kiln__tensor_new(nd, shape, dt, dev);
  if (kiln__check_shape("kiln_batch_norm", nd, shape, dt) != KILN_OK) return NULL;
  int64_t st[KILN_MAX_DIMS], acc = shape[1] > 0 ? shape[1] : 1, n = 1;
  st[1] = 1;
  for (int d = nd - 1; d >= 2; d--) {
    st[d] = acc;
    acc *= shape[d] > 0 ? shape[d] : 1;
  }
  st[0] = acc;
  for (int d = 0; d < nd; d++) n *= shape[d];
  kiln__storage *s = kiln__storage_new(dev, (size_t)n * kiln_dtype_size(dt));
  if (!s) return NULL;
  kiln_tensor *r = kiln__tensor_make(s, 0, nd, shape, st, dt);
  kiln__storage_release(s);
  return r;
}

/* Memory for t's shape in the layout asked. */
static kiln_tensor *alloc_layout(const kiln_tensor *t, bool cl, kiln_dtype dt) {
  return alloc_shape(kiln_device_of(t), t->ndim, t->shape, cl, dt);
}

/* t in the layout the kernels take alongside a tensor of layout cl (a copy without a node:
** the op's own node covers it). */
static kiln_tensor *to_layout(kiln_tensor *t, bool cl) {
  kiln__view v;
  if (ncs_view(t, &v) && (cl ? view_cl(&v) && (!view_cf(&v) || v.shape[2] <= 1) : view_cf(&v))) return t;
  bool prev = kiln_set_grad_enabled(false);
  kiln_tensor *r;
  if (!cl) {
    r = kiln_contiguous(t);
  } else {
    int nd = t->ndim, p[KILN_MAX_DIMS], q[KILN_MAX_DIMS];
    p[0] = 0, q[0] = 0;
    for (int d = 1; d < nd - 1; d++) p[d] = d + 1;
    p[nd - 1] = 1;
    for (int d = 0; d < nd; d++) q[p[d]] = d;
    r = kiln_permute(kiln_contiguous(kiln_permute(t, nd, p)), nd, q);
  }
  kiln_set_grad_enabled(prev);
  return r;
}

/* x's layout for the kernels: channels-last when the channels are its inner dim and S is
** not (a contiguous (N, C) counts as channels-last: its runs are the channels). */
static bool x_layout_cl(const kiln__view *v) { return view_cl(v) && (!view_cf(v) || v->shape[2] <= 1); }

static kiln__view vec1(const kiln_tensor *t) { return kiln__view_of(t); }

static const kiln__op op_batch_norm_relu_k, op_batch_norm_add_relu_k;

static kiln_status bnk_forward(kiln__op_ctx *c) {
  const attrs_bn *p = c->attrs;
  kiln_tensor *x = c->in[0], *rm = c->in[1], *rv = c->in[2], *w = c->in[3], *b = c->in[4];
  kiln__view xv;
  kiln_tensor *xs = x;
  if (!ncs_view(x, &xv) || (!view_cf(&xv) && !view_cl(&xv))) {
    bool prev = kiln_set_grad_enabled(false);
    xs = kiln_contiguous(x);
    kiln_set_grad_enabled(prev);
    if (!xs || !ncs_view(xs, &xv)) return kiln_last_error();
  }
  bool cl = x_layout_cl(&xv);
  int64_t C = x->shape[1];
  kiln_dtype sdt = x->dtype == KILN_F64 ? KILN_F64 : KILN_F32;
  /* tmp: 0 x as the kernel read it, 1 the statistics (saved). On CUDA, where the output can
  ** be the backward's ReLU mask (batch_norm_relu's output, or a plain batch_norm's under the
  ** ReLU peephole), 4 rows: CUDA's forward writes its normalizing coefficients (w invstd and
  ** b, as it used them) into rows 2 and 3, and the backward recomputes the mask from x with
  ** them instead of reading the output (bnb_forward). The CPU keeps 2 rows. */
  c->tmp[0] = xs;
  const bool coef_rows = kiln_device_of(x).type == KILN_DEVICE_CUDA && c->op != &op_batch_norm_add_relu_k;
  kiln_tensor *stats = c->tmp[1] = kiln__tensor_new(KILN_SHAPE(coef_rows ? 4 : 2, C), sdt, kiln_device_of(x));
  kiln_tensor *y = alloc_layout(xs, cl, x->dtype);
  if (!stats || !y) {
    kiln__discard(y);
    return kiln_last_error();
  }
  c->out[0] = y;
  if (kiln_numel(x) == 0) return kiln_fill_(stats, 0);
  kiln__kargs a = {0};
  a.op = KILN__K_BATCH_NORM;
  a.in[a.n_in++] = xv;
  if (w) a.in[a.n_in++] = vec1(w), a.i[0] |= 1;
  if (b) a.in[a.n_in++] = vec1(b), a.i[0] |= 2;
  kiln__view yv;
  ncs_view(y, &yv);
  a.out[a.n_out++] = yv;
  a.out[a.n_out++] = kiln__view_of(stats);
  if (rm && rv) {
    a.out[a.n_out++] = vec1(rm);
    a.out[a.n_out++] = vec1(rv);
    a.i[0] |= 4;
  }
  if (c->op == &op_batch_norm_relu_k) a.i[0] |= 8; /* the ReLU fused */
  if (c->op == &op_batch_norm_add_relu_k) { /* the residual (in x's layout) and the ReLU */
    kiln_tensor *rs = c->tmp[2] = to_layout(c->in[5], cl);
    if (!rs || !ncs_view(rs, &a.in[a.n_in])) {
      c->out[0] = NULL;
      kiln__discard(y);
      return rs ? kiln_set_error(KILN_ERR_INTERNAL, "kiln_batch_norm_add_relu: residual %s", kiln__tshape(rs))
                : kiln_last_error();
    }
    a.n_in++;
    a.i[0] |= 16 | 8;
  }
  a.i[1] = p->training;
  a.s[0] = p->eps;
  a.s[1] = p->momentum;
  if (coef_rows && !kiln__dispatch_has(kiln_device_of(x), &a, KILN__K_BATCH_NORM)) {
    /* it would fall back (a kernel that writes rows 0 and 1 only): 2 rows, so that the
    ** backward reads its mask instead of recomputing it from coefficients never written */
    kiln_tensor *s2 = kiln__tensor_new(KILN_SHAPE(2, C), sdt, kiln_device_of(x));
    if (!s2) {
      c->out[0] = NULL;
      kiln__discard(y);
      return kiln_last_error();
    }
    kiln__discard(stats);
    stats = c->tmp[1] = s2;
    a.out[1] = kiln__view_of(stats);
  }
  kiln_status st = kiln__dispatch(kiln_device_of(x), &a);
  if (st != KILN_OK) {
    c->out[0] = NULL;
    kiln__discard(y);
  }
  return st;
}

/* saved: 0 x (as the kernel read it), 1 weight (or NULL), 2 the statistics (2, C) ((4, C) on CUDA), 3 bias
** (or NULL: with the weight and the statistics it lets a kernel recompute y, and so the
** ReLU's mask, from x) */
static void bnk_save(kiln__op_ctx *c, kiln__node *n) {
  kiln__node_save(n, 0, c->tmp[0]);
  kiln__node_save(n, 1, c->in[3]);
  kiln__node_save(n, 2, c->tmp[1]);
  kiln__node_save(n, 3, c->in[4]);
}

/* ---- batch_norm_backward: an internal op (x, g, stats, weight, mask, bias) -> (dx,
** dweight, dbias); mask (optional): a ReLU's input that g still has to go through (the
** ReLU's rule handed g over unmasked: ops_elementwise.c's peephole, KILN__OP_GRAD_MASK),
** so no ReLU-backward kernel runs and no tensor is made for its result. The mask is
** always this batch norm's own output (the peephole's ReLU input is y; batch_norm_relu
** hands its output). op_batch_norm_bwd_own says so (batch_norm_add_relu's output, also
** handed over as a mask, is not y): there, where the statistics carry the forward's
** coefficients (rows 2 and 3, CUDA's forward), the kernel recomputes the mask from x (flag
** 8: y > 0 exactly where the forward's bn(x), rounded to x's dtype, is > 0) instead of
** reading it: x and g read twice, dx written, 5 passes of the tensor instead of 7.
** KILN_BN_MASK_RECOMPUTE=0 (read at each call, for A/B runs and the tests) reads the mask.
** The bias input is saved but unused by the kernels (its value is in the statistics). */

/* Whether the backward may recompute its mask (the environment switch above). */
static bool bn_mask_recompute(void) {
  return kiln__knob_on("KILN_BN_MASK_RECOMPUTE", true);
}

/* batch_norm_add_relu_backward: the same op with a fourth output, g masked by the mask
** (the residual's gradient), written by the kernel's first pass (flag 4): defined below. */
static const kiln__op op_batch_norm_add_relu_bwd, op_batch_norm_bwd_own;

static kiln_status bnb_infer(kiln__op_ctx *c) {
  kiln_tensor *x = c->in[0];
  for (int i = 1; i < 5; i += 3) {
    kiln_tensor *t = c->in[i];
    if (t && (t->ndim != x->ndim || memcmp(t->shape, x->shape, sizeof(int64_t) * (size_t)x->ndim) != 0))
      return kiln_set_error(KILN_ERR_SHAPE, "kiln_batch_norm_backward: %s %s does not match input %s",
                            i == 1 ? "grad" : "mask", kiln__tshape(t), kiln__tshape(x));
  }
  kiln_dtype pdt = c->in[3] ? c->in[3]->dtype : c->in[2]->dtype;
  kiln__op_meta_like(c, 0, x, x->dtype);
  kiln__op_meta(c, 1, 1, &x->shape[1], pdt);
  kiln__op_meta(c, 2, 1, &x->shape[1], pdt);
  c->n_out = 3;
  if (c->op == &op_batch_norm_add_relu_bwd) {
    if (!c->in[4]) return kiln_set_error(KILN_ERR_INTERNAL, "kiln_batch_norm_add_relu_backward: no mask");
    kiln__op_meta_like(c, 3, x, x->dtype);
    c->n_out = 4;
  }
  return KILN_OK;
}

static kiln_status bnb_forward(kiln__op_ctx *c) {
  const attrs_bn *p = c->attrs;
  kiln_tensor *x = c->in[0], *g = c->in[1], *stats = c->in[2], *w = c->in[3], *mask = c->in[4], *bias = c->in[5];
  kiln__view xv;
  if (!ncs_view(x, &xv)) return kiln_set_error(KILN_ERR_INTERNAL, "kiln_batch_norm_backward: input %s", kiln__tshape(x));
  bool cl = x_layout_cl(&xv);
  kiln_tensor *gs = c->tmp[0] = to_layout(g->dtype == x->dtype ? g : kiln__as_dtype_nograd(g, x->dtype), cl);
  if (!gs) return kiln_last_error();
  kiln_device dev = kiln_device_of(x);
  const bool with_gm = c->op == &op_batch_norm_add_relu_bwd; /* out3: g masked (flag 4) */
  /* the mask recomputed from x (flag 8) where it is this batch norm's own output, the
  ** statistics carry the forward's coefficients and the device takes it; else read */
  bool rc = false;
  if (mask && c->op == &op_batch_norm_bwd_own && stats->ndim == 2 && stats->shape[0] >= 4 && kiln_numel(x) > 0 &&
      bn_mask_recompute()) {
    kiln__kargs q = {0};
    q.op = KILN__K_BATCH_NORM_BACKWARD;
    q.in[q.n_in++] = xv;
    ncs_view(gs, &q.in[q.n_in++]);
    q.in[q.n_in++] = kiln__view_of(stats);
    if (w) q.in[q.n_in++] = vec1(w), q.i[0] |= 1;
    q.i[0] |= 8;
    q.out[q.n_out++] = xv;
    q.out[q.n_out++] = kiln__view_of(stats);
    q.out[q.n_out++] = kiln__view_of(stats);
    q.out[1].dtype = q.out[2].dtype = c->meta[1].dtype;
    q.i[1] = p->training;
    rc = kiln__dispatch_has(dev, &q, KILN__K_BATCH_NORM_BACKWARD);
  }
  kiln_tensor *ms = c->tmp[1] = mask && !rc ? to_layout(kiln__as_dtype_nograd(mask, x->dtype), cl) : NULL;
  if (mask && !rc && !ms) return kiln_last_error();
  const int n_out = with_gm ? 4 : 3;
  c->out[0] = alloc_layout(x, cl, x->dtype);
  c->out[1] = kiln__tensor_new(1, &x->shape[1], c->meta[1].dtype, dev);
  c->out[2] = kiln__tensor_new(1, &x->shape[1], c->meta[2].dtype, dev);
  if (with_gm) c->out[3] = alloc_layout(x, cl, x->dtype);
  kiln_status st = c->out[0] && c->out[1] && c->out[2] && (!with_gm || c->out[3]) ? KILN_OK : kiln_last_error();
  if (st == KILN_OK && kiln_numel(x) == 0) {
    st = kiln_fill_(c->out[1], 0);
    if (st == KILN_OK) st = kiln_fill_(c->out[2], 0);
  } else if (st == KILN_OK) {
    kiln__kargs a = {0};
    a.op = KILN__K_BATCH_NORM_BACKWARD;
    a.n_in = 3;
    a.in[0] = xv;
    ncs_view(gs, &a.in[1]);
    a.in[2] = kiln__view_of(stats);
    if (w) a.in[a.n_in++] = vec1(w), a.i[0] |= 1;
    if (ms) ncs_view(ms, &a.in[a.n_in++]), a.i[0] |= 2;
    if (rc) a.i[0] |= 8; /* the mask: recomputed from x and the statistics' rows 2, 3 */
    (void)bias; /* its value is in the statistics (row 3) */
    a.n_out = 3;
    ncs_view(c->out[0], &a.out[0]);
    a.out[1] = kiln__view_of(c->out[1]);
    a.out[2] = kiln__view_of(c->out[2]);
    if (with_gm) ncs_view(c->out[3], &a.out[a.n_out++]), a.i[0] |= 4;
    a.i[1] = p->training;
    a.s[0] = p->eps;
    st = kiln__dispatch(dev, &a);
  }
  if (st != KILN_OK)
    for (int k = 0; k < n_out; k++) kiln__discard(c->out[k]), c->out[k] = NULL;
  return st;
}

static const kiln__op op_batch_norm_bwd = {
    .name = "batch_norm_backward", .api = "kiln_batch_norm_backward", .n_in = 6, .n_out = 3,
    .optional = (1u << 3) | (1u << 4) | (1u << 5),
    .flags = KILN__OP_SELF_ALLOC | KILN__OP_NO_GRAD, .n_kernels = 1, .kernels = {KILN__K_BATCH_NORM_BACKWARD},
    .attrs = f_bn, .n_attrs = 3, .attr_size = sizeof(attrs_bn), .infer = bnb_infer, .forward = bnb_forward};

/* The same op where the mask, if any, is this batch norm's own output (bn_backward_call's
** own): its kernel may recompute it (flag 8). The same name: one entry in the profiles. */
static const kiln__op op_batch_norm_bwd_own = {
    .name = "batch_norm_backward", .api = "kiln_batch_norm_backward", .n_in = 6, .n_out = 3,
    .optional = (1u << 3) | (1u << 4) | (1u << 5),
    .flags = KILN__OP_SELF_ALLOC | KILN__OP_NO_GRAD, .n_kernels = 1, .kernels = {KILN__K_BATCH_NORM_BACKWARD},
    .attrs = f_bn, .n_attrs = 3, .attr_size = sizeof(attrs_bn), .infer = bnb_infer, .forward = bnb_forward};

static const kiln__op op_batch_norm_add_relu_bwd = {
    .name = "batch_norm_add_relu_backward", .api = "kiln_batch_norm_add_relu_backward", .n_in = 6, .n_out = 4,
    .optional = (1u << 3) | (1u << 5),
    .flags = KILN__OP_SELF_ALLOC | KILN__OP_NO_GRAD, .n_kernels = 1, .kernels = {KILN__K_BATCH_NORM_BACKWARD},
    .attrs = f_bn, .n_attrs = 3, .attr_size = sizeof(attrs_bn), .infer = bnb_infer, .forward = bnb_forward};

/* The rule: one BATCH_NORM_BACKWARD (the engine runs rules with grad mode off, so the
** gradient itself is not differentiated further, as for every kernel-backed rule). A ReLU
** right after the op may have handed g over unmasked with its input as n->grad_mask
** (KILN__OP_GRAD_MASK): the kernel applies the mask. */
static kiln_status bn_backward_masked(kiln__node *n, kiln_tensor *g, kiln_tensor *mask, bool own, kiln_tensor **gi);

static kiln_status bnk_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  return bn_backward_masked(n, g, n->grad_mask, true, gi); /* the ReLU's input: this node's output */
}

/* One BATCH_NORM_BACKWARD with mask (NULL: none) applied to g, its gradients handed to gi
** in the inputs' dtypes; with gm (and a mask), g masked too (the residual's gradient of
** batch_norm_add_relu, written by the kernel's first pass) in *gm. own: the mask is this
** node's own output (relu(bn(x)) or bn(x)), which the kernel may recompute from x. */
static kiln_status bn_backward_call(kiln__node *n, kiln_tensor *g, kiln_tensor *mask, bool own, kiln_tensor **gi,
                                    kiln_tensor **gm) {
  kiln_tensor *in[6] = {n->saved[0], g, n->saved[2], n->saved[1], mask, n->saved[3]};
  kiln_tensor *out[4] = {NULL, NULL, NULL, NULL};
  const kiln__op *op = gm ? &op_batch_norm_add_relu_bwd : own && mask ? &op_batch_norm_bwd_own : &op_batch_norm_bwd;
  if (!kiln__op_call(op, 6, in, n->attrs, out))
    return kiln_last_error();
  if (gm) *gm = out[3];
  if (n->needs[0] && kiln__give_grad(&gi[0], out[0], g) != KILN_OK) return kiln_last_error();
  for (int k = 1; k < 3; k++) {
    int i = k + 2; /* dweight -> input 3, dbias -> input 4 */
    if (!n->needs[i]) continue;
    kiln_tensor *r = out[k]->dtype != n->in_dtype[i] ? kiln_to_dtype(out[k], n->in_dtype[i]) : out[k];
    if (kiln__give_grad(&gi[i], r, g) != KILN_OK) return kiln_last_error();
  }
  return KILN_OK;
}

static kiln_status bn_backward_masked(kiln__node *n, kiln_tensor *g, kiln_tensor *mask, bool own, kiln_tensor **gi) {
  return bn_backward_call(n, g, mask, own, gi, NULL);
}

/* batch_norm_relu: the same kernel with the ReLU applied to y (flag 8), and the same
** backward with the output as the mask (out > 0 exactly where the normalized value was):
** the node keeps x and the output, which the next layer keeps anyway, instead of the
** separate ReLU's input. */
static void bnkr_save(kiln__op_ctx *c, kiln__node *n) {
  bnk_save(c, n);
  kiln__node_save_output(n, 4);
}

static kiln_status bnkr_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  return bn_backward_masked(n, g, n->saved[4], true, gi); /* the output: relu(bn(x)) */
}

static const kiln__op op_batch_norm_relu_k = {
    .name = "batch_norm_relu", .api = "kiln_batch_norm_relu", .n_in = 5, .n_out = 1, .optional = 0x1e,
    .flags = KILN__OP_SELF_ALLOC, .n_kernels = 1, .kernels = {KILN__K_BATCH_NORM}, .attrs = f_bn, .n_attrs = 3,
    .attr_size = sizeof(attrs_bn), .infer = bn_infer, .forward = bnk_forward, .backward = bnkr_backward,
    .n_saved = 5, .save = bnkr_save};

/* batch_norm_add_relu: y = relu(batch_norm(x) + residual), ResNet's block tail, in the
** same kernel (flag 16, then flag 8) where the device has it (the CPU, CUDA): no
** normalized tensor and no sum are written or kept; CUDA's normalizing pass reads the
** residual beside x.
** Backward: g masked by the output (> 0 exactly where the sum was) is the residual's
** gradient and batch_norm's upstream one. On the CPU: one RELU_BACKWARD kernel, then the
** unmasked BATCH_NORM_BACKWARD (the kernels the separate add and ReLU ran, less the
** forward's). Elsewhere (CUDA), where the device has flag 4, one BATCH_NORM_BACKWARD with
** the output as its mask writes the masked g in its first pass (it reads x, g and the mask
** there anyway) and its dx pass reads that instead of g and the mask: x, g, the mask read
** and gm written, then x and gm read and dx written, 7 passes of the tensor against the
** two kernels' 8 (3 + 5), one launch fewer. Without the residual's gradient wanted, the
** masked kernel alone (7 passes, no gm). */
static kiln_status bnar_infer(kiln__op_ctx *c) {
  if (bn_infer(c) != KILN_OK) return kiln_last_error();
  kiln_tensor *x = c->in[0], *r = c->in[5];
  if (r->ndim != x->ndim || memcmp(r->shape, x->shape, sizeof(int64_t) * (size_t)x->ndim) != 0 || r->dtype != x->dtype)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_batch_norm_add_relu: residual %s %s must match input %s %s",
                          kiln_dtype_name(r->dtype), kiln__tshape(r), kiln_dtype_name(x->dtype), kiln__tshape(x));
  return KILN_OK;
}

/* Whether the device runs BATCH_NORM_BACKWARD with the masked gradient (flag 4) for this
** node. The CPU answers no here: it keeps RELU_BACKWARD and the unmasked kernel, whose bits
** its tests know. */
static bool bnar_gm_native(kiln__node *n) {
  kiln_tensor *x = n->saved[0], *w = n->saved[1], *stats = n->saved[2], *out = n->saved[4];
  kiln_device dev = kiln_device_of(x);
  if (dev.type == KILN_DEVICE_CPU || !out || out->dtype != x->dtype) return false;
  kiln__view xv, mv;
  if (!ncs_view(x, &xv) || !ncs_view(out, &mv)) return false;
  kiln__kargs q = {0};
  q.op = KILN__K_BATCH_NORM_BACKWARD;
  q.in[q.n_in++] = xv;
  q.in[q.n_in++] = xv; /* g: made x's layout and dtype by bnb_forward */
  q.in[q.n_in++] = kiln__view_of(stats);
  if (w) q.in[q.n_in++] = vec1(w), q.i[0] |= 1;
  q.in[q.n_in++] = mv;
  q.i[0] |= 2 | 4;
  q.out[q.n_out++] = xv;
  q.out[q.n_out++] = w ? vec1(w) : kiln__view_of(stats);
  q.out[q.n_out++] = w ? vec1(w) : kiln__view_of(stats);
  q.out[q.n_out++] = xv;
  q.i[1] = ((const attrs_bn *)n->attrs)->training;
  return kiln__dispatch_has(dev, &q, KILN__K_BATCH_NORM_BACKWARD);
}

static kiln_status bnar_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *out = n->saved[4];
  if (bnar_gm_native(n)) {
    if (!n->needs[5]) return bn_backward_masked(n, g, out, false, gi); /* relu(bn(x) + r): not recomputable from x */
    kiln_tensor *gm = NULL;
    if (bn_backward_call(n, g, out, false, gi, &gm) != KILN_OK) return kiln_last_error();
    kiln_tensor *r = gm->dtype != n->in_dtype[5] ? kiln_to_dtype(gm, n->in_dtype[5]) : gm;
    return kiln__give_grad(&gi[5], r, g);
  }
  kiln_tensor *gg = g->dtype == out->dtype ? g : kiln__as_dtype_nograd(g, out->dtype);
  if (!gg) return kiln_last_error();
  bool g_cl = kiln__is_channels_last(gg) && gg->ndim == out->ndim &&
              !memcmp(gg->shape, out->shape, sizeof(int64_t) * (size_t)out->ndim);
  kiln_tensor *gm = kiln__tensor_new_like_format(g_cl ? gg : out, out->dtype);
  if (!gm) return kiln_last_error();
  kiln__kargs k = {0};
  k.op = KILN__K_RELU_BACKWARD;
  k.n_in = 2;
  k.in[0] = kiln__view_of(out); /* out > 0 exactly where the ReLU passed */
  k.in[1] = kiln__view_of(gg);
  if (kiln__run_into(gm, &k) != KILN_OK) {
    kiln__discard(gm);
    return kiln_last_error();
  }
  if (bn_backward_masked(n, gm, NULL, false, gi) != KILN_OK) { /* gm, masked already: batch_norm's own gradient */
    kiln__discard(gm);
    return kiln_last_error();
  }
  if (n->needs[5]) {
    kiln_tensor *r = gm->dtype != n->in_dtype[5] ? kiln_to_dtype(gm, n->in_dtype[5]) : gm;
    if (kiln__give_grad(&gi[5], r, g) != KILN_OK) return kiln_last_error();
  }
  return KILN_OK;
}

static const kiln__op op_batch_norm_add_relu_k = {
    .name = "batch_norm_add_relu", .api = "kiln_batch_norm_add_relu", .n_in = 6, .n_out = 1, .optional = 0x1e,
    .flags = KILN__OP_SELF_ALLOC, .n_kernels = 1, .kernels = {KILN__K_BATCH_NORM}, .attrs = f_bn, .n_attrs = 3,
    .attr_size = sizeof(attrs_bn), .infer = bnar_infer, .forward = bnk_forward, .backward = bnar_backward,
    .n_saved = 5, .save = bnkr_save};

static const kiln__op op_batch_norm_k = {
    .name = "batch_norm", .api = "kiln_batch_norm", .n_in = 5, .n_out = 1, .optional = 0x1e,
    .flags = KILN__OP_SELF_ALLOC | KILN__OP_GRAD_MASK, .n_kernels = 1, .kernels = {KILN__K_BATCH_NORM},
    .attrs = f_bn, .n_attrs = 3,
    .attr_size = sizeof(attrs_bn), .infer = bn_infer, .forward = bnk_forward, .backward = bnk_backward,
    .n_saved = 4, .save = bnk_save};

/* Whether x's device runs BATCH_NORM for these arguments (asked before the call, so that a
** backend without it, Vulkan, composes instead of copying every activation to the CPU). */
static bool bn_native(kiln_tensor *x, kiln_tensor *rm, kiln_tensor *rv, kiln_tensor *w, kiln_tensor *b, bool training,
                      bool relu, kiln_tensor *res) {
  if (!x || x->ndim < 2 || !kiln_dtype_is_float(x->dtype)) return false; /* the composite reports it */
  if (training ? (!rm) != (!rv) : (!rm || !rv)) return false;
  kiln_tensor *vecs[4] = {rm, rv, w, b};
  for (int k = 0; k < 4; k++)
    if (vecs[k] && (!kiln_dtype_is_float(vecs[k]->dtype) || !kiln_device_equal(kiln_device_of(vecs[k]), kiln_device_of(x))))
      return false;
  kiln__kargs q = {0};
  q.op = KILN__K_BATCH_NORM;
  kiln__view xv;
  if (!ncs_view(x, &xv) || (!view_cf(&xv) && !view_cl(&xv))) {
    int64_t st[KILN_MAX_DIMS];
    kiln__contiguous_strides(x->ndim, x->shape, st);
    ncs_geom(x->ndim, x->shape, st, &xv);
  }
  q.in[q.n_in++] = xv;
  if (w) q.in[q.n_in++] = vec1(w), q.i[0] |= 1;
  if (b) q.in[q.n_in++] = vec1(b), q.i[0] |= 2;
  q.out[q.n_out++] = xv;
  q.out[q.n_out] = xv;
  q.out[q.n_out].ndim = 2;
  q.out[q.n_out].shape[0] = 2, q.out[q.n_out].shape[1] = x->shape[1];
  q.out[q.n_out].strides[0] = x->shape[1], q.out[q.n_out].strides[1] = 1;
  q.out[q.n_out++].dtype = x->dtype == KILN_F64 ? KILN_F64 : KILN_F32;
  if (rm && rv) q.out[q.n_out++] = vec1(rm), q.out[q.n_out++] = vec1(rv), q.i[0] |= 4;
  if (relu) q.i[0] |= 8;
  if (res) { /* in x's layout (to_layout makes it so) */
    if (res->dtype != x->dtype || res->ndim != x->ndim || !kiln_device_equal(kiln_device_of(res), kiln_device_of(x)) ||
        memcmp(res->shape, x->shape, sizeof(int64_t) * (size_t)x->ndim) != 0)
      return false;
    q.in[q.n_in] = xv;
    q.in[q.n_in++].dtype = res->dtype;
    q.i[0] |= 16 | 8;
  }
  q.i[1] = training;
  return kiln__dispatch_has(kiln_device_of(x), &q, KILN__K_BATCH_NORM);
}

/* ---- batch_norm_relu_max_pool2d: max_pool2d(relu(batch_norm(x))), one op ---------------
** ResNet's stem (bn1, relu, maxpool 3x3 stride 2 padding 1) where the device has BATCH_NORM
** with flag 32 (CUDA, channels-last): the statistics as batch_norm's, then one pass that
** computes each window's relu(bn(x)) from x and writes only the pooled map and a byte per
** output for its maximum's offset -- the normalized map is never made or kept (it was
** 392 MiB for ResNet-50 at 224 and batch 256, which the stem kept or recomputed under a
** checkpoint). Backward: RELU_MAX_POOL2D_BACKWARD (g at each window's maximum where the
** pooled output is > 0, a gather) gives relu(bn)'s input gradient, then the plain
** BATCH_NORM_BACKWARD. The same values as the three ops (the normalizing pass's arithmetic,
** MAX_POOL2D's rule on the rounded values); the gradients up to the order of a pixel's sums
** over overlapping windows. Elsewhere the ops it stands for. Saved: x, the weight, the
** statistics, the bias, the offsets and the output. */

typedef struct attrs_bnpool {
  attrs_bn bn; /* first: the backward's batch_norm_backward reads the node's record as attrs_bn */
  int64_t kernel[2];
  int nk;
  int64_t stride[2];
  int ns;
  int64_t padding[2];
  int np;
} attrs_bnpool;
static const kiln__attr_field f_bnpool[] = {
    {"training", KILN__A_BOOL, offsetof(attrs_bnpool, bn.training), 0, NULL},
    {"momentum", KILN__A_FLOAT, offsetof(attrs_bnpool, bn.momentum), 0, NULL},
    {"eps", KILN__A_FLOAT, offsetof(attrs_bnpool, bn.eps), 0, NULL},
    KILN__FIELD_INTS(attrs_bnpool, kernel, nk),
    KILN__FIELD_INTS(attrs_bnpool, stride, ns),
    KILN__FIELD_INTS(attrs_bnpool, padding, np)};

/* The pooled (OH, OW), or an error naming the window. */
static kiln_status bnp_geometry(const attrs_bnpool *p, const kiln_tensor *x, int64_t o[2]) {
  const char *api = "kiln__batch_norm_relu_max_pool2d";
  if (x->ndim != 4)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: expected an input (N, C, H, W), got %s", api, kiln__tshape(x));
  for (int d = 0; d < 2; d++) {
    int64_t k = p->kernel[d], s = p->stride[d], pd = p->padding[d];
    if (k < 1 || s < 1 || pd < 0 || 2 * pd > k || x->shape[2 + d] + 2 * pd < k)
      return kiln_set_error(KILN_ERR_SHAPE, "%s: window %lldx%lld stride %lldx%lld padding %lldx%lld does not fit input %s",
                            api, (long long)p->kernel[0], (long long)p->kernel[1], (long long)p->stride[0],
                            (long long)p->stride[1], (long long)p->padding[0], (long long)p->padding[1], kiln__tshape(x));
    o[d] = (x->shape[2 + d] + 2 * pd - k) / s + 1;
  }
  return KILN_OK;
}

static kiln_status bnp_infer(kiln__op_ctx *c) {
  if (bn_infer(c) != KILN_OK) return kiln_last_error();
  int64_t o[2];
  if (bnp_geometry(c->attrs, c->in[0], o) != KILN_OK) return kiln_last_error();
  c->meta[0].shape[2] = o[0], c->meta[0].shape[3] = o[1];
  return KILN_OK;
}

/* BATCH_NORM's arguments with flag 32 for x (channels-last), the pooled y and the offsets
** (either may be NULL when only asking: views of the right shape stand in), stats (4, C). */
static kiln__kargs bnp_args(const attrs_bnpool *p, kiln_tensor *x, kiln_tensor *rm, kiln_tensor *rv, kiln_tensor *w,
                            kiln_tensor *b, kiln_tensor *y, kiln_tensor *off, kiln_tensor *stats, const int64_t o[2],
                            kiln__conv_params *cp) {
  kiln__kargs a = {0};
  a.op = KILN__K_BATCH_NORM;
  kiln__view xv;
  ncs_view(x, &xv);
  a.in[a.n_in++] = xv;
  if (w) a.in[a.n_in++] = vec1(w), a.i[0] |= 1;
  if (b) a.in[a.n_in++] = vec1(b), a.i[0] |= 2;
  kiln__view yv = xv; /* the pooled map, channels-last: (N, C, OH*OW) with strides (OH*OW*C, 1, C) */
  yv.shape[2] = o[0] * o[1], yv.strides[0] = yv.shape[1] * yv.shape[2], yv.strides[1] = 1, yv.strides[2] = yv.shape[1];
  if (y) ncs_view(y, &yv);
  a.out[a.n_out++] = yv;
  kiln__view sv = xv;
  sv.ndim = 2, sv.shape[0] = 4, sv.shape[1] = x->shape[1], sv.strides[0] = x->shape[1], sv.strides[1] = 1;
  sv.dtype = x->dtype == KILN_F64 ? KILN_F64 : KILN_F32;
  a.out[a.n_out++] = stats ? kiln__view_of(stats) : sv;
  if (rm && rv) a.out[a.n_out++] = vec1(rm), a.out[a.n_out++] = vec1(rv), a.i[0] |= 4;
  kiln__view ov = yv;
  ov.dtype = KILN_U8;
  if (off) ncs_view(off, &ov);
  a.out[a.n_out++] = ov;
  a.i[0] |= 8 | 32;
  a.i[1] = p->bn.training;
  a.i[2] = x->shape[2], a.i[3] = x->shape[3];
  a.s[0] = p->bn.eps;
  a.s[1] = p->bn.momentum;
  *cp = (kiln__conv_params){{p->kernel[0], p->kernel[1]}, {p->stride[0], p->stride[1]}, {p->padding[0], p->padding[1]}, {1, 1}};
  a.params = cp;
  return a;
}

static kiln_status bnp_forward(kiln__op_ctx *c) {
  const attrs_bnpool *p = c->attrs;
  kiln_tensor *x = c->in[0], *rm = c->in[1], *rv = c->in[2], *w = c->in[3], *b = c->in[4];
  kiln_device dev = kiln_device_of(x);
  int64_t o[2];
  if (bnp_geometry(p, x, o) != KILN_OK) return kiln_last_error();
  const int64_t osh[4] = {x->shape[0], x->shape[1], o[0], o[1]};
  kiln_dtype sdt = x->dtype == KILN_F64 ? KILN_F64 : KILN_F32;
  kiln_tensor *stats = c->tmp[1] = kiln__tensor_new(KILN_SHAPE(4, x->shape[1]), sdt, dev);
  kiln_tensor *off = c->tmp[2] = alloc_shape(dev, 4, osh, true, KILN_U8);
  kiln_tensor *y = alloc_shape(dev, 4, osh, true, x->dtype);
  c->tmp[0] = x;
  if (!stats || !off || !y) {
    kiln__discard(y);
    return kiln_last_error();
  }
  kiln__conv_params cp;
  kiln__kargs a = bnp_args(p, x, rm, rv, w, b, y, off, stats, o, &cp);
  kiln_status st = kiln__dispatch(dev, &a);
  if (st != KILN_OK) {
    kiln__discard(y);
    return st;
  }
  c->out[0] = y;
  return KILN_OK;
}

/* saved: 0 x, 1 weight, 2 statistics (4, C), 3 bias (as batch_norm's, for its backward), 4
** the offsets, 5 the output */
static void bnp_save(kiln__op_ctx *c, kiln__node *n) {
  bnk_save(c, n);
  kiln__node_save(n, 4, c->tmp[2]);
  kiln__node_save_output(n, 5);
}

static kiln_status bnp_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  const attrs_bnpool *p = n->attrs;
  kiln_tensor *x = n->saved[0], *off = n->saved[4], *y = n->saved[5];
  kiln_tensor *gg = g->dtype == x->dtype ? g : kiln__as_dtype_nograd(g, x->dtype);
  kiln_tensor *gh = alloc_shape(kiln_device_of(x), 4, x->shape, true, x->dtype); /* relu(bn)'s input gradient */
  if (!gg || !gh) return kiln_last_error();
  kiln__conv_params cp = {{p->kernel[0], p->kernel[1]}, {p->stride[0], p->stride[1]}, {p->padding[0], p->padding[1]}, {1, 1}};
  kiln__kargs k = {0};
  k.op = KILN__K_RELU_MAX_POOL2D_BACKWARD;
  k.n_in = 3, k.n_out = 1;
  k.in[0] = kiln__view_of(gg);
  k.in[1] = kiln__view_of(y);
  k.in[2] = kiln__view_of(off);
  k.params = &cp;
  if (kiln__run_into(gh, &k) != KILN_OK) {
    kiln__discard(gh);
    return kiln_last_error();
  }
  kiln_status st = bn_backward_masked(n, gh, NULL, false, gi);
  kiln__discard(gh);
  return st;
}

static const kiln__op op_batch_norm_relu_max_pool2d = {
    .name = "batch_norm_relu_max_pool2d", .api = "kiln__batch_norm_relu_max_pool2d", .n_in = 5, .n_out = 1,
    .optional = 0x1e, .flags = KILN__OP_SELF_ALLOC, .n_kernels = 2,
    .kernels = {KILN__K_BATCH_NORM, KILN__K_RELU_MAX_POOL2D_BACKWARD}, .attrs = f_bnpool, .n_attrs = 6,
    .attr_size = sizeof(attrs_bnpool), .infer = bnp_infer, .forward = bnp_forward, .backward = bnp_backward,
    .n_saved = 6, .save = bnp_save, .expands_to = (const char *const[]){"batch_norm_relu", "max_pool2d", NULL}};

static attrs_bnpool bnp_attrs(bool training, double momentum, double eps, const int64_t kernel[2],
                              const int64_t stride[2], const int64_t padding[2]) {
  attrs_bnpool a = {{training, momentum, eps}, {kernel[0], kernel[1]}, 2, {stride[0], stride[1]}, 2,
                    {padding[0], padding[1]}, 2};
  return a;
}

bool kiln__batch_norm_relu_max_pool2d_native(kiln_tensor *x, kiln_tensor *running_mean, kiln_tensor *running_var,
                                             kiln_tensor *weight, kiln_tensor *bias, bool training,
                                             const int64_t kernel[2], const int64_t stride[2], const int64_t padding[2]) {
  if (!x || x->ndim != 4 || !kiln__is_channels_last(x) || !kiln_dtype_is_float(x->dtype)) return false;
  if (!bn_native(x, running_mean, running_var, weight, bias, training, true, NULL)) return false;
  attrs_bnpool p = bnp_attrs(training, 0.1, 1e-5, kernel, stride, padding);
  int64_t o[2];
  if (bnp_geometry(&p, x, o) != KILN_OK) {
    kiln_clear_error();
    return false;
  }
  kiln__view xv;
  if (!ncs_view(x, &xv) || !x_layout_cl(&xv)) return false;
  kiln__conv_params cp;
  kiln__kargs a = bnp_args(&p, x, running_mean, running_var, weight, bias, NULL, NULL, NULL, o, &cp);
  if (!kiln__dispatch_has(kiln_device_of(x), &a, KILN__K_BATCH_NORM)) return false;
  /* the backward's gather, asked with channels-last views of its shapes */
  kiln__kargs q = {0};
  q.op = KILN__K_RELU_MAX_POOL2D_BACKWARD;
  q.n_in = 3, q.n_out = 1;
  kiln__view pv = kiln__view_of(x);
  pv.shape[2] = o[0], pv.shape[3] = o[1];
  pv.strides[1] = 1, pv.strides[3] = x->shape[1], pv.strides[2] = x->shape[1] * o[1], pv.strides[0] = x->shape[1] * o[0] * o[1];
  q.in[0] = pv, q.in[1] = pv, q.in[2] = pv;
  q.in[2].dtype = KILN_U8;
  q.out[0] = kiln__view_of(x);
  q.params = &cp;
  return kiln__dispatch_has(kiln_device_of(x), &q, KILN__K_RELU_MAX_POOL2D_BACKWARD);
}

kiln_tensor *kiln__batch_norm_relu_max_pool2d(kiln_tensor *x, kiln_tensor *running_mean, kiln_tensor *running_var,
                                              kiln_tensor *weight, kiln_tensor *bias, bool training, double momentum,
                                              double eps, const int64_t kernel[2], const int64_t stride[2],
                                              const int64_t padding[2]) {
  if (!kiln__batch_norm_relu_max_pool2d_native(x, running_mean, running_var, weight, bias, training, kernel, stride,
                                               padding))
    return kiln_max_pool2d(kiln_batch_norm_relu(x, running_mean, running_var, weight, bias, training, momentum, eps),
                           kernel, stride, padding, NULL, NULL);
  attrs_bnpool a = bnp_attrs(training, momentum, eps, kernel, stride, padding);
  kiln_tensor *in[5] = {x, running_mean, running_var, weight, bias};
  return kiln__op_call(&op_batch_norm_relu_max_pool2d, 5, in, &a, NULL);
}

kiln_tensor *kiln_batch_norm(kiln_tensor *x, kiln_tensor *running_mean, kiln_tensor *running_var, kiln_tensor *weight,
                             kiln_tensor *bias, bool training, double momentum, double eps) {
  attrs_bn a = {training, momentum, eps};
  kiln_tensor *in[5] = {x, running_mean, running_var, weight, bias};
  bool native = bn_native(x, running_mean, running_var, weight, bias, training, false, NULL);
  return kiln__op_call(native ? &op_batch_norm_k : &op_batch_norm, 5, in, &a, NULL);
}

kiln_tensor *kiln_batch_norm_relu(kiln_tensor *x, kiln_tensor *running_mean, kiln_tensor *running_var,
                                  kiln_tensor *weight, kiln_tensor *bias, bool training, double momentum, double eps) {
  attrs_bn a = {training, momentum, eps};
  kiln_tensor *in[5] = {x, running_mean, running_var, weight, bias};
  if (bn_native(x, running_mean, running_var, weight, bias, training, true, NULL))
    return kiln__op_call(&op_batch_norm_relu_k, 5, in, &a, NULL);
  /* elsewhere (Vulkan: no BATCH_NORM) the two ops */
  return kiln_relu(kiln_batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps));
}

kiln_tensor *kiln_batch_norm_add_relu(kiln_tensor *x, kiln_tensor *residual, kiln_tensor *running_mean,
                                      kiln_tensor *running_var, kiln_tensor *weight, kiln_tensor *bias, bool training,
                                      double momentum, double eps) {
  if (!residual) {
    if (x) kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_batch_norm_add_relu: NULL residual (input %s)", kiln__tshape(x));
    return NULL;
  }
  attrs_bn a = {training, momentum, eps};
  kiln_tensor *in[6] = {x, running_mean, running_var, weight, bias, residual};
  if (bn_native(x, running_mean, running_var, weight, bias, training, true, residual))
    return kiln__op_call(&op_batch_norm_add_relu_k, 6, in, &a, NULL);
  /* elsewhere (Vulkan, mixed dtypes, broadcasting) the three ops */
  return kiln_relu(kiln_add(kiln_batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps), residual));
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
  if (check_nc_input(api, x) != KILN_OK) return kiln_last_error();
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
