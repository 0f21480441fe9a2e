/*
** Indexing: index_select, gather, scatter_add, embedding, each a descriptor on the one call
** path (op.h).
**
** Index tensors are i64 or i32 (kernels read either). Shapes are checked in infer; an
** entry out of range is found by the kernel, which reports KILN_ERR_INDEX. Backward rules
** accumulate into zeros with the INDEX_ADD / SCATTER_ADD kernels, so repeated indices
** add up their gradients. The index is a node input like any other (it never needs a
** gradient), so rules find its shape in n->in_shape.
*/
#include "ops/op.h"

/* Every op here but embedding takes one attribute, the dim it indexes along (as given:
** rules wrap it again from the input's ndim, which the node keeps). */
typedef struct attrs_dim {
  int dim;
} attrs_dim;
static const kiln__attr_field dim_fields[] = {KILN__FIELD(attrs_dim, dim, KILN__A_INT32)};

static bool is_index_dtype(kiln_dtype dt) { return dt == KILN_I64 || dt == KILN_I32; }

static kiln_status check_index(const char *op, const kiln_tensor *index) {
  if (!is_index_dtype(index->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: index must be int64 or int32, got %s (shape %s)", op,
                          kiln_dtype_name(index->dtype), kiln__tshape(index));
  return KILN_OK;
}

/* Accepts dim 0 / -1 for a 0-dim tensor (PyTorch), else wraps dim; -1 on error. */
static int wrap_dim0(const char *op, int dim, int ndim) {
  if (ndim == 0) {
    if (dim == 0 || dim == -1) return 0;
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                   "%s: dim %d out of range for a 0-dim tensor (expected 0 or -1)", op, dim);
    return -1;
  }
  return kiln__wrap_dim(op, dim, ndim);
}

/* The record's dim wrapped for a rule (it was checked when the op ran). */
static int node_dim(const kiln__node *n) {
  int dim = ((const attrs_dim *)n->attrs)->dim;
  return dim < 0 ? dim + (n->in_ndim[0] ? n->in_ndim[0] : 1) : dim;
}

static kiln_tensor *zeros_like_input(kiln__node *n, int k, kiln_tensor *g) {
  return kiln_zeros(n->in_ndim[k], n->in_shape[k], n->in_dtype[k], kiln_device_of(g));
}

static kiln_status accumulate(kiln__kop kop, kiln_tensor *z, int d, kiln__view src, kiln__view idx) {
  if (kiln__view_numel(&src) == 0) return KILN_OK;
  kiln__kargs a = {0};
  a.op = kop;
  a.n_in = 2;
  a.n_out = 1;
  a.in[0] = src;
  a.in[1] = idx;
  a.out[0] = kiln__view_of_1d(z);
  a.i[0] = d;
  return kiln__dispatch(kiln_device_of(z), &a);
}

/* The index is saved in slot 0 by index_select, gather and scatter_add. */
static void save_index(kiln__op_ctx *c, kiln__node *n) { kiln__node_save(n, 0, c->in[1]); }

/* ---- index_select and gather -------------------------------------------------------- */

static const kiln__op op_index_select, op_gather;

/* index_select and gather: the gradient is scattered back through the same index into
** zeros, with the accumulating kernel that undoes the forward's (INDEX_ADD for
** index_select, SCATTER_ADD for gather); repeated indices add up. */
static kiln_status index_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *index = n->saved[0];
  kiln_tensor *z = zeros_like_input(n, 0, g);
  if (!z) return kiln_last_error();
  kiln_tensor *gc = g->dtype == z->dtype ? g : kiln_to_dtype(g, z->dtype);
  if (!gc) return kiln_last_error();
  kiln__kop kop = n->op == &op_gather ? KILN__K_SCATTER_ADD : KILN__K_INDEX_ADD;
  kiln_status st = accumulate(kop, z, node_dim(n), kiln__view_of_1d(gc), kiln__view_of_1d(index));
  if (st != KILN_OK) return st;
  return kiln__give_grad(&gi[0], z, g);
}

/* The forward of both: the kernel reads input 0 through index along the wrapped dim
** (infer left it in scratch[0]). */
static kiln_status index_forward(kiln__op_ctx *c) {
  kiln_tensor *out = c->out[0];
  if (kiln_numel(out) == 0) return KILN_OK;
  kiln__kargs a = {0};
  a.op = c->op->kernels[0];
  a.n_in = 2;
  a.n_out = 1;
  a.in[0] = kiln__view_of_1d(c->in[0]);
  a.in[1] = kiln__view_of_1d(c->in[1]);
  a.out[0] = kiln__view_of_1d(out);
  a.i[0] = (int64_t)c->scratch[0];
  return kiln__dispatch(c->device, &a);
}

static kiln_status index_select_infer(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0], *index = c->in[1];
  if (check_index("kiln_index_select", index) != KILN_OK) return kiln_last_error();
  if (index->ndim > 1)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_index_select: index must be 1-d, got shape %s",
                          kiln__tshape(index));
  int d = wrap_dim0("kiln_index_select", ((const attrs_dim *)c->attrs)->dim, t->ndim);
  if (d < 0) return kiln_last_error();
  int64_t osh[KILN_MAX_DIMS];
  for (int k = 0; k < t->ndim; k++) osh[k] = t->shape[k];
  int ond = t->ndim;
  if (t->ndim == 0) { /* a scalar: the result follows the index's shape */
    ond = index->ndim;
    if (ond) osh[0] = index->shape[0];
  } else {
    osh[d] = kiln_numel(index);
  }
  kiln__op_meta(c, 0, ond, osh, t->dtype);
  c->scratch[0] = (uint64_t)d;
  return KILN_OK;
}

static kiln_status gather_infer(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0], *index = c->in[1];
  if (check_index("kiln_gather", index) != KILN_OK) return kiln_last_error();
  int d = wrap_dim0("kiln_gather", ((const attrs_dim *)c->attrs)->dim, t->ndim);
  if (d < 0) return kiln_last_error();
  if (index->ndim != t->ndim)
    return kiln_set_error(KILN_ERR_SHAPE,
                          "kiln_gather: index %s must have the same number of dims as input %s",
                          kiln__tshape(index), kiln__tshape(t));
  for (int k = 0; k < t->ndim; k++)
    if (k != d && index->shape[k] > t->shape[k])
      return kiln_set_error(KILN_ERR_SHAPE,
                            "kiln_gather: index %s is larger than input %s at dim %d (gather dim %d)",
                            kiln__tshape(index), kiln__tshape(t), k, d);
  kiln__op_meta_like(c, 0, index, t->dtype);
  c->scratch[0] = (uint64_t)d;
  return KILN_OK;
}

static const kiln__op op_index_select = {
    .name = "index_select", .api = "kiln_index_select", .n_in = 2, .n_out = 1,
    .n_kernels = 1, .kernels = {KILN__K_INDEX_SELECT}, .attrs = dim_fields, .n_attrs = 1,
    .attr_size = sizeof(attrs_dim), .infer = index_select_infer, .forward = index_forward,
    .backward = index_backward, .n_saved = 1, .save = save_index};

static const kiln__op op_gather = {
    .name = "gather", .api = "kiln_gather", .n_in = 2, .n_out = 1, .n_kernels = 1,
    .kernels = {KILN__K_GATHER}, .attrs = dim_fields, .n_attrs = 1, .attr_size = sizeof(attrs_dim),
    .infer = gather_infer, .forward = index_forward, .backward = index_backward, .n_saved = 1,
    .save = save_index};

kiln_tensor *kiln_index_select(kiln_tensor *t, int dim, kiln_tensor *index) {
  kiln_tensor *in[2] = {t, index};
  return kiln__op_call(&op_index_select, 2, in, &(attrs_dim){dim}, NULL);
}

kiln_tensor *kiln_gather(kiln_tensor *t, int dim, kiln_tensor *index) {
  kiln_tensor *in[2] = {t, index};
  return kiln__op_call(&op_gather, 2, in, &(attrs_dim){dim}, NULL);
}

/* ---- scatter_add -------------------------------------------------------------------- */

/* Inputs (t, index, src). grad_t = g; grad_src = gather(g, dim, index), placed in zeros
** when src is larger than index (only the index-shaped corner of src takes part, as in
** PyTorch). */
static kiln_status scatter_add_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  if (n->needs[0]) {
    kiln_status st = kiln__give_grad(&gi[0], g, g);
    if (st != KILN_OK) return st;
  }
  if (n->needs[2]) {
    kiln_tensor *index = n->saved[0];
    kiln_tensor *r = kiln_gather(g, node_dim(n), index);
    if (!r) return kiln_last_error();
    bool same = true;
    for (int k = 0; k < index->ndim; k++) same = same && index->shape[k] == n->in_shape[2][k];
    if (!same) {
      kiln_tensor *z = zeros_like_input(n, 2, g);
      kiln_tensor *corner = z;
      for (int k = 0; k < index->ndim && corner; k++)
        corner = kiln_narrow(corner, k, 0, index->shape[k]);
      if (!corner) return kiln_last_error();
      kiln_status st = kiln_copy_(corner, r);
      if (st != KILN_OK) return st;
      r = z;
    }
    return kiln__give_grad(&gi[2], r, g);
  }
  return KILN_OK;
}

static kiln_status scatter_add_infer(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0], *index = c->in[1], *src = c->in[2];
  if (check_index("kiln_scatter_add", index) != KILN_OK) return kiln_last_error();
  if (src->dtype != t->dtype)
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_scatter_add: src is %s but the input is %s",
                          kiln_dtype_name(src->dtype), kiln_dtype_name(t->dtype));
  int d = wrap_dim0("kiln_scatter_add", ((const attrs_dim *)c->attrs)->dim, t->ndim);
  if (d < 0) return kiln_last_error();
  if (index->ndim != t->ndim || src->ndim != t->ndim)
    return kiln_set_error(KILN_ERR_SHAPE,
                          "kiln_scatter_add: input %s, index %s and src %s must have the same number "
                          "of dims",
                          kiln__tshape(t), kiln__tshape(index), kiln__tshape(src));
  for (int k = 0; k < t->ndim; k++)
    if (index->shape[k] > src->shape[k] || (k != d && index->shape[k] > t->shape[k]))
      return kiln_set_error(KILN_ERR_SHAPE,
                            "kiln_scatter_add: index %s is larger than src %s or input %s at dim %d",
                            kiln__tshape(index), kiln__tshape(src), kiln__tshape(t), k);
  kiln__op_meta_like(c, 0, t, t->dtype);
  c->scratch[0] = (uint64_t)d;
  return KILN_OK;
}

/* out = t, then src's index-shaped corner added in through index. */
static kiln_status scatter_add_forward(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0], *index = c->in[1], *src = c->in[2], *out = c->out[0];
  if (kiln_numel(out) == 0) return KILN_OK;
  kiln__kargs a = {0};
  a.op = KILN__K_COPY;
  a.n_in = 1;
  a.n_out = 1;
  a.in[0] = kiln__view_of_1d(t);
  a.out[0] = kiln__view_of_1d(out);
  kiln_status st = kiln__dispatch(c->device, &a);
  /* Only the index-shaped corner of src is read. */
  kiln__view sv = kiln__view_of_1d(src);
  for (int k = 0; k < index->ndim; k++) sv.shape[k] = index->shape[k];
  if (st == KILN_OK) st = accumulate(KILN__K_SCATTER_ADD, out, (int)c->scratch[0], sv, kiln__view_of_1d(index));
  return st;
}

static const kiln__op op_scatter_add = {
    .name = "scatter_add", .api = "kiln_scatter_add", .n_in = 3, .n_out = 1, .amp = KILN__AMP_PROMOTE, .n_kernels = 2,
    .kernels = {KILN__K_COPY, KILN__K_SCATTER_ADD}, .attrs = dim_fields, .n_attrs = 1,
    .attr_size = sizeof(attrs_dim), .infer = scatter_add_infer, .forward = scatter_add_forward,
    .backward = scatter_add_backward, .n_saved = 1, .save = save_index};

kiln_tensor *kiln_scatter_add(kiln_tensor *t, int dim, kiln_tensor *index, kiln_tensor *src) {
  kiln_tensor *in[3] = {t, index, src};
  return kiln__op_call(&op_scatter_add, 3, in, &(attrs_dim){dim}, NULL);
}

/* ---- embedding ---------------------------------------------------------------------- */

/* Inputs (weight, ids); ids saved in slot 0 as given (read flat: made contiguous here
** when they are not, which only a strided view of ids needs). */
static kiln_status embedding_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *ids = n->saved[0];
  if (!kiln_is_contiguous(ids) && !(ids = kiln_contiguous(ids))) return kiln_last_error();
  int64_t cnt = kiln_numel(ids), D = n->in_shape[0][1];
  /* the rows added straight into the weight's gradient where one is pending (a tied
  ** weight: the head's gradient came first), else into zeros */
  kiln_tensor *z = kiln__grad_into(n, 0);
  if (z && (z->dtype != n->in_dtype[0] || z->ndim != 2 || z->shape[0] != n->in_shape[0][0] || z->shape[1] != D ||
            !kiln_is_contiguous(z) || !kiln_device_equal(kiln_device_of(z), kiln_device_of(g))))
    z = NULL;
  if (!z) z = zeros_like_input(n, 0, g);
  kiln_tensor *g2 = kiln_reshape(g, KILN_SHAPE(cnt, D));
  if (g2 && g2->dtype != n->in_dtype[0]) g2 = kiln_to_dtype(g2, n->in_dtype[0]);
  if (!z || !g2) return kiln_last_error();
  kiln__view iv = kiln__view_of(ids);
  iv.ndim = 1;
  iv.shape[0] = cnt;
  iv.strides[0] = 1;
  kiln_status st = accumulate(KILN__K_INDEX_ADD, z, 0, kiln__view_of(g2), iv);
  if (st != KILN_OK) return st;
  return kiln__give_grad(&gi[0], z, g);
}

static kiln_status embedding_infer(kiln__op_ctx *c) {
  kiln_tensor *weight = c->in[0], *ids = c->in[1];
  if (!is_index_dtype(ids->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_embedding: ids must be int64 or int32, got %s (shape %s)",
                          kiln_dtype_name(ids->dtype), kiln__tshape(ids));
  if (weight->ndim != 2)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_embedding: weight must be 2-d (num, dim), got %s",
                          kiln__tshape(weight));
  if (ids->ndim + 1 > KILN_MAX_DIMS)
    return kiln_set_error(KILN_ERR_SHAPE,
                          "kiln_embedding: ids %s have too many dims (the result would have %d > %d)",
                          kiln__tshape(ids), ids->ndim + 1, KILN_MAX_DIMS);
  int64_t osh[KILN_MAX_DIMS];
  for (int k = 0; k < ids->ndim; k++) osh[k] = ids->shape[k];
  osh[ids->ndim] = weight->shape[1];
  kiln__op_meta(c, 0, ids->ndim + 1, osh, weight->dtype);
  return KILN_OK;
}

/* out (cnt, D) = rows of weight picked by the ids read as one flat list. */
static kiln_status embedding_forward(kiln__op_ctx *c) {
  kiln_tensor *weight = c->in[0], *ids = c->in[1], *out = c->out[0];
  if (kiln_numel(out) == 0) return KILN_OK;
  int64_t D = weight->shape[1], cnt = kiln_numel(ids);
  kiln_tensor *idc = kiln_is_contiguous(ids) ? ids : kiln_contiguous(ids);
  if (!idc) return kiln_last_error();
  kiln__kargs a = {0};
  a.op = KILN__K_INDEX_SELECT;
  a.n_in = 2;
  a.n_out = 1;
  a.in[0] = kiln__view_of(weight);
  a.in[1] = kiln__view_of(idc);
  a.in[1].ndim = 1;
  a.in[1].shape[0] = cnt;
  a.in[1].strides[0] = 1;
  a.out[0] = kiln__view_of(out);
  a.out[0].ndim = 2;
  a.out[0].shape[0] = cnt;
  a.out[0].shape[1] = D;
  a.out[0].strides[0] = D;
  a.out[0].strides[1] = 1;
  a.i[0] = 0;
  kiln_status st = kiln__dispatch(c->device, &a);
  if (idc != ids) kiln__discard(idc);
  return st;
}

static void embedding_save(kiln__op_ctx *c, kiln__node *n) { kiln__node_save(n, 0, c->in[1]); }

static const kiln__op op_embedding = {
    .name = "embedding", .api = "kiln_embedding", .n_in = 2, .n_out = 1, .n_kernels = 1,
    .kernels = {KILN__K_INDEX_SELECT}, .infer = embedding_infer, .forward = embedding_forward,
    .backward = embedding_backward, .n_saved = 1, .save = embedding_save};

kiln_tensor *kiln_embedding(kiln_tensor *weight, kiln_tensor *ids) {
  kiln_tensor *in[2] = {weight, ids};
  return kiln__op_call(&op_embedding, 2, in, NULL, NULL);
}
