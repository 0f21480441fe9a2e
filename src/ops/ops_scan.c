/*
** Ops along one dim or over the last two, for transformers (issue 16):
**   cumsum(dim)            CUMSUM; backward: the reversed cumsum of the gradient (same kernel)
**   tril / triu(diagonal)  TRIL; backward: the same op on the gradient
**   topk(k, dim, ...)      TOPK: values and i64 indices; backward scatters the gradient back
**   multinomial            MULTINOMIAL: i64 samples from the Philox generator (no gradient;
**                          the exact mapping is in src/backend/cpu/cpu_scan.c)
*/
#include "ops/op.h"

/* One input, one output, two integers (CUMSUM, TRIL): t into out. A 0-d tensor is seen
** as one element (cumsum takes it; tril's inputs have 2 or more dims). */
static kiln_status run_kernel(kiln__kop op, kiln_tensor *t, kiln_tensor *out, int64_t i0, int64_t i1) {
  if (kiln_numel(out) == 0) return KILN_OK;
  kiln__kargs a = {0};
  a.op = op;
  a.n_in = 1;
  a.n_out = 1;
  a.in[0] = kiln__view_of_1d(t);
  a.out[0] = kiln__view_of_1d(out);
  a.i[0] = i0;
  a.i[1] = i1;
  return kiln__dispatch(kiln_device_of(t), &a);
}

/* The backward of an op whose gradient is a kernel of the same kind on g (the reversed
** cumsum, the same triangle): gi[0] = run_kernel(op, g). */
static kiln_status grad_by_kernel(kiln__kop op, kiln_tensor *g, int64_t i0, int64_t i1, kiln_tensor **gi) {
  kiln_tensor *dx = kiln__tensor_new(g->ndim, g->shape, g->dtype, kiln_device_of(g));
  if (!dx) return kiln_last_error();
  kiln_status st = run_kernel(op, g, dx, i0, i1);
  if (st != KILN_OK) return st;
  gi[0] = kiln_keep(dx);
  return KILN_OK;
}

/* ---- cumsum ---- */
typedef struct attrs_cumsum {
  int dim;
} attrs_cumsum;
static const kiln__attr_field f_cumsum[] = {KILN__FIELD(attrs_cumsum, dim, KILN__A_INT32)};

static int dim_of(int dim, int ndim) { return ndim == 0 ? 0 : (dim < 0 ? dim + ndim : dim); }

static kiln_status cumsum_infer(kiln__op_ctx *c) {
  const attrs_cumsum *p = c->attrs;
  kiln_tensor *t = c->in[0];
  if (t->ndim == 0 ? (p->dim != 0 && p->dim != -1) : kiln__wrap_dim(c->op->api, p->dim, t->ndim) < 0) {
    kiln_clear_error();
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: dim %d out of range for a tensor of %d dims %s",
                          c->op->api, p->dim, t->ndim, kiln__tshape(t));
  }
  /* integer and bool sums are i64, as PyTorch's */
  kiln__op_meta_like(c, 0, t, kiln_dtype_is_float(t->dtype) ? t->dtype : KILN_I64);
  return KILN_OK;
}

static kiln_status cumsum_forward(kiln__op_ctx *c) {
  const attrs_cumsum *p = c->attrs;
  return run_kernel(KILN__K_CUMSUM, c->in[0], c->out[0], dim_of(p->dim, c->in[0]->ndim), false);
}

static kiln_status cumsum_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  const attrs_cumsum *p = n->attrs;
  return grad_by_kernel(KILN__K_CUMSUM, g, dim_of(p->dim, g->ndim), true, gi);
}

static const kiln__op op_cumsum = {
    .name = "cumsum", .api = "kiln_cumsum", .n_in = 1, .n_out = 1, .amp = KILN__AMP_F32, .n_kernels = 1,
    .kernels = {KILN__K_CUMSUM}, .attrs = f_cumsum, .n_attrs = 1, .attr_size = sizeof(attrs_cumsum),
    .infer = cumsum_infer, .forward = cumsum_forward, .backward = cumsum_backward};

kiln_tensor *kiln_cumsum(kiln_tensor *t, int dim) {
  attrs_cumsum p = {dim};
  return kiln__op_call(&op_cumsum, 1, &t, &p, NULL);
}

/* ---- tril / triu ---- */
typedef struct attrs_tri {
  int64_t diagonal;
} attrs_tri;
static const kiln__attr_field f_tri[] = {KILN__FIELD(attrs_tri, diagonal, KILN__A_INT)};

static bool is_triu(const kiln__op *op) { return op->name[3] == 'u'; }

static kiln_status tri_infer(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0];
  if (t->ndim < 2)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: expected a tensor of 2 or more dims (a matrix or a batch of them), got %s",
                          c->op->api, kiln__tshape(t));
  kiln__op_meta_like(c, 0, t, t->dtype);
  return KILN_OK;
}

static kiln_status tri_forward(kiln__op_ctx *c) {
  const attrs_tri *p = c->attrs;
  return run_kernel(KILN__K_TRIL, c->in[0], c->out[0], p->diagonal, is_triu(c->op));
}

static kiln_status tri_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  const attrs_tri *p = n->attrs;
  return grad_by_kernel(KILN__K_TRIL, g, p->diagonal, is_triu(n->op), gi);
}

#define TRI_OP(fname)                                                                                      \
  static const kiln__op op_##fname = {                                                                   \
      .name = #fname, .api = "kiln_" #fname, .n_in = 1, .n_out = 1, .n_kernels = 1, .kernels = {KILN__K_TRIL}, \
      .attrs = f_tri, .n_attrs = 1, .attr_size = sizeof(attrs_tri), .infer = tri_infer, .forward = tri_forward, \
      .backward = tri_backward};
TRI_OP(tril)
TRI_OP(triu)

kiln_tensor *kiln_tril(kiln_tensor *t, int64_t diagonal) {
  attrs_tri p = {diagonal};
  return kiln__op_call(&op_tril, 1, &t, &p, NULL);
}

kiln_tensor *kiln_triu(kiln_tensor *t, int64_t diagonal) {
  attrs_tri p = {diagonal};
  return kiln__op_call(&op_triu, 1, &t, &p, NULL);
}

/* ---- topk ---- */
typedef struct attrs_topk {
  int64_t k;
  int dim;
  bool largest;
  bool sorted;
} attrs_topk;
static const kiln__attr_field f_topk[] = {
    KILN__FIELD(attrs_topk, k, KILN__A_INT), KILN__FIELD(attrs_topk, dim, KILN__A_INT32),
    KILN__FIELD(attrs_topk, largest, KILN__A_BOOL), KILN__FIELD(attrs_topk, sorted, KILN__A_BOOL)};

static kiln_status topk_infer(kiln__op_ctx *c) {
  const attrs_topk *p = c->attrs;
  const char *op = c->op->api;
  kiln_tensor *t = c->in[0];
  if (t->ndim == 0)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: expected a tensor of 1 or more dims, got a 0-dim one", op);
  int d = kiln__wrap_dim(op, p->dim, t->ndim);
  if (d < 0) return kiln_last_error();
  if (t->dtype == KILN_BOOL)
    return kiln_set_error(KILN_ERR_DTYPE, "%s: bool tensors have no order; convert to an integer dtype first", op);
  if (p->k < 0 || p->k > t->shape[d])
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: k %lld out of range for dim %d of size %lld (shape %s)", op,
                          (long long)p->k, d, (long long)t->shape[d], kiln__tshape(t));
  int64_t sh[KILN_MAX_DIMS];
  for (int i = 0; i < t->ndim; i++) sh[i] = i == d ? p->k : t->shape[i];
  kiln__op_meta(c, 0, t->ndim, sh, t->dtype);
  kiln__op_meta(c, 1, t->ndim, sh, KILN_I64);
  c->scratch[0] = (uint64_t)d;
  return KILN_OK;
}

static kiln_status topk_forward(kiln__op_ctx *c) {
  const attrs_topk *p = c->attrs;
  if (kiln_numel(c->out[0]) == 0) return KILN_OK;
  kiln__kargs a = {0};
  a.op = KILN__K_TOPK;
  a.n_in = 1;
  a.n_out = 2;
  a.in[0] = kiln__view_of(c->in[0]);
  a.out[0] = kiln__view_of(c->out[0]);
  a.out[1] = kiln__view_of(c->out[1]);
  a.i[0] = (int64_t)c->scratch[0];
  a.i[1] = p->k;
  a.i[2] = p->largest ? 1 : 0; /* always sorted: `sorted` false allows any order, this one too */
  return kiln__dispatch(kiln_device_of(c->in[0]), &a);
}

/* saved: 0 the indices (an integer output, which the path leaves out of the node) */
static void topk_save(kiln__op_ctx *c, kiln__node *n) { kiln__node_save(n, 0, c->out[1]); }

static kiln_status topk_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  const attrs_topk *p = n->attrs;
  int nd = n->in_ndim[0];
  int d = p->dim < 0 ? p->dim + nd : p->dim;
  kiln_tensor *z = kiln_zeros(nd, n->in_shape[0], g->dtype, kiln_device_of(g));
  return kiln__give_grad(&gi[0], z ? kiln_scatter_add(z, d, n->saved[0], g) : NULL, g);
}

static const kiln__op op_topk = {
    .name = "topk", .api = "kiln_topk", .n_in = 1, .n_out = 2, .n_kernels = 1, .kernels = {KILN__K_TOPK},
    .attrs = f_topk, .n_attrs = 4, .attr_size = sizeof(attrs_topk), .infer = topk_infer, .forward = topk_forward,
    .backward = topk_backward, .n_saved = 1, .save = topk_save};

kiln_tensor *kiln_topk(kiln_tensor *t, int64_t k, int dim, bool largest, bool sorted, kiln_tensor **indices) {
  if (indices) *indices = NULL;
  attrs_topk p = {k, dim, largest, sorted};
  kiln_tensor *out[2] = {NULL, NULL};
  kiln_tensor *vals = kiln__op_call(&op_topk, 1, &t, &p, out);
  if (!vals) return NULL;
  if (indices)
    *indices = out[1];
  else
    kiln__discard(out[1]);
  return vals;
}

/* ---- multinomial ---- */
typedef struct attrs_multinomial {
  int64_t num_samples;
  bool replacement;
  kiln_generator *gen; /* not an attribute (NULL: the global generator) */
} attrs_multinomial;
static const kiln__attr_field f_multinomial[] = {KILN__FIELD(attrs_multinomial, num_samples, KILN__A_INT),
                                                 KILN__FIELD(attrs_multinomial, replacement, KILN__A_BOOL)};

static kiln_status multinomial_infer(kiln__op_ctx *c) {
  const attrs_multinomial *p = c->attrs;
  const char *op = c->op->api;
  kiln_tensor *t = c->in[0];
  if (t->ndim != 1 && t->ndim != 2)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: probabilities must be 1-d (classes) or 2-d (rows, classes), got %s", op,
                          kiln__tshape(t));
  if (!kiln_dtype_is_float(t->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: probabilities must be floating, got %s", op, kiln_dtype_name(t->dtype));
  int64_t ncls = t->shape[t->ndim - 1];
  if (ncls == 0) return kiln_set_error(KILN_ERR_SHAPE, "%s: probabilities %s have no classes", op, kiln__tshape(t));
  if (p->num_samples <= 0)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: num_samples must be positive, got %lld", op,
                          (long long)p->num_samples);
  if (!p->replacement && p->num_samples > ncls)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "%s: cannot draw %lld samples without replacement from %lld classes", op,
                          (long long)p->num_samples, (long long)ncls);
  int64_t sh[2] = {t->shape[0], p->num_samples};
  if (t->ndim == 1) sh[0] = p->num_samples;
  kiln__op_meta(c, 0, t->ndim, sh, KILN_I64);
  return KILN_OK;
}

static kiln_status multinomial_forward(kiln__op_ctx *c) {
  const attrs_multinomial *p = c->attrs;
  kiln_tensor *t = c->in[0], *out = c->out[0];
  if (kiln_numel(out) == 0) return KILN_OK;
  kiln__kargs a = {0};
  a.op = KILN__K_MULTINOMIAL;
  a.n_in = 1;
  a.n_out = 1;
  a.in[0] = kiln__view_of(t);
  a.out[0] = kiln__view_of(out);
  if (t->ndim == 1) { /* one row */
    kiln__view *vs[2] = {&a.in[0], &a.out[0]};
    for (int k = 0; k < 2; k++) {
      vs[k]->ndim = 2;
      vs[k]->shape[1] = vs[k]->shape[0];
      vs[k]->strides[1] = vs[k]->strides[0];
      vs[k]->shape[0] = 1;
      vs[k]->strides[0] = 0;
    }
  }
  a.i[0] = p->replacement;
  kiln__generator_reserve(p->gen ? p->gen : kiln_generator_global(), kiln_numel(out), &a.seed, &a.offset);
  return kiln__dispatch(kiln_device_of(t), &a);
}

static const kiln__op op_multinomial = {
    .name = "multinomial", .api = "kiln_multinomial", .n_in = 1, .n_out = 1, .flags = KILN__OP_NO_GRAD,
    .n_kernels = 1, .kernels = {KILN__K_MULTINOMIAL}, .attrs = f_multinomial, .n_attrs = 2,
    .attr_size = sizeof(attrs_multinomial), .infer = multinomial_infer, .forward = multinomial_forward};

kiln_tensor *kiln_multinomial(kiln_tensor *probs, int64_t num_samples, bool replacement, kiln_generator *gen) {
  attrs_multinomial p = {num_samples, replacement, gen};
  return kiln__op_call(&op_multinomial, 1, &probs, &p, NULL);
}
