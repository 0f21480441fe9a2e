/*
** Indexing: index_select, gather, scatter_add, embedding.
**
** Index tensors are i64 or i32 (kernels read either). Shapes are checked here; an entry
** out of range is found by the kernel, which reports KILN_ERR_INDEX. Backward rules
** accumulate into zeros with the INDEX_ADD / SCATTER_ADD kernels, so repeated indices
** add up their gradients.
*/
#include "../core/kiln_int.h"

static bool is_index_dtype(kiln_dtype dt) { return dt == KILN_I64 || dt == KILN_I32; }

static kiln_status check_index(const char *op, const kiln_tensor *index) {
  if (!is_index_dtype(index->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: index must be int64 or int32, got %s (shape %s)", op,
                          kiln_dtype_name(index->dtype), kiln__tshape(index));
  return KILN_OK;
}

/* Kernels see a 0-dim tensor as one element of a 1-d view. */
static kiln__view view1(const kiln_tensor *t) {
  kiln__view v = kiln__view_of(t);
  if (v.ndim == 0) {
    v.ndim = 1;
    v.shape[0] = 1;
    v.strides[0] = 1;
  }
  return v;
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

/* ---- index_select ------------------------------------------------------------------- */

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
  a.out[0] = view1(z);
  a.i[0] = d;
  return kiln__dispatch(kiln_device_of(z), &a);
}


/* index_select and gather: the gradient is scattered back through the same index into
** zeros, with the accumulating kernel the forward recorded in n->i[1] (INDEX_ADD for
** index_select, SCATTER_ADD for gather); repeated indices add up. */
static kiln_status index_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *index = n->saved[0];
  kiln_tensor *z = zeros_like_input(n, 0, g);
  if (!z) return kiln_last_error();
  kiln_tensor *gc = g->dtype == z->dtype ? g : kiln_to_dtype(g, z->dtype);
  if (!gc) return kiln_last_error();
  kiln_status st = accumulate((kiln__kop)n->i[1], z, (int)n->i[0], view1(gc), view1(index));
  if (st != KILN_OK) return st;
  return kiln__give_grad(&gi[0], z, g);
}

/* The common tail of index_select and gather: run the kernel into out (src t, index,
** along dim d) and record the node whose rule accumulates back through the same index. */
static kiln_tensor *index_run(kiln__kop op, const char *name, kiln_tensor *t, kiln_tensor *index,
                              kiln_tensor *out, int d) {
  if (kiln_numel(out) > 0) {
    kiln__kargs a = {0};
    a.op = op;
    a.n_in = 2;
    a.n_out = 1;
    a.in[0] = view1(t);
    a.in[1] = view1(index);
    a.out[0] = view1(out);
    a.i[0] = d;
    if (kiln__dispatch(kiln_device_of(t), &a) != KILN_OK) {
      kiln__discard(out);
      return NULL;
    }
  }
  if (kiln_dtype_is_float(t->dtype) && kiln__needs_grad(1, &t)) {
    kiln__node *n = kiln__node_attach(out, name, index_backward, 1, &t);
    if (!n) {
      kiln__discard(out);
      return NULL;
    }
    kiln__node_save(n, 0, index);
    n->i[0] = d;
    n->i[1] = op == KILN__K_GATHER ? KILN__K_SCATTER_ADD : KILN__K_INDEX_ADD;
  }
  return out;
}

kiln_tensor *kiln_index_select(kiln_tensor *t, int dim, kiln_tensor *index) {
  if (!t || !index) return NULL;
  kiln_tensor *ts[2] = {t, index};
  if (kiln__same_device("kiln_index_select", 2, ts) != KILN_OK) return NULL;
  if (check_index("kiln_index_select", index) != KILN_OK) return NULL;
  if (index->ndim > 1)
    KILN__FAIL_NULL(KILN_ERR_SHAPE, "kiln_index_select: index must be 1-d, got shape %s",
                    kiln__tshape(index));
  int d = wrap_dim0("kiln_index_select", dim, t->ndim);
  if (d < 0) return NULL;
  int64_t osh[KILN_MAX_DIMS];
  for (int k = 0; k < t->ndim; k++) osh[k] = t->shape[k];
  int ond = t->ndim;
  if (t->ndim == 0) { /* a scalar: the result follows the index's shape */
    ond = index->ndim;
    if (ond) osh[0] = index->shape[0];
  } else {
    osh[d] = kiln_numel(index);
  }
  kiln_device dev = kiln_device_of(t);
  kiln_tensor *out = kiln__tensor_new(ond, osh, t->dtype, dev);
  if (!out) return NULL;
  return index_run(KILN__K_INDEX_SELECT, "index_select", t, index, out, d);
}

/* ---- gather ------------------------------------------------------------------------- */


kiln_tensor *kiln_gather(kiln_tensor *t, int dim, kiln_tensor *index) {
  if (!t || !index) return NULL;
  kiln_tensor *ts[2] = {t, index};
  if (kiln__same_device("kiln_gather", 2, ts) != KILN_OK) return NULL;
  if (check_index("kiln_gather", index) != KILN_OK) return NULL;
  int d = wrap_dim0("kiln_gather", dim, t->ndim);
  if (d < 0) return NULL;
  if (index->ndim != t->ndim)
    KILN__FAIL_NULL(KILN_ERR_SHAPE,
                    "kiln_gather: index %s must have the same number of dims as input %s",
                    kiln__tshape(index), kiln__tshape(t));
  for (int k = 0; k < t->ndim; k++)
    if (k != d && index->shape[k] > t->shape[k])
      KILN__FAIL_NULL(KILN_ERR_SHAPE,
                      "kiln_gather: index %s is larger than input %s at dim %d (gather dim %d)",
                      kiln__tshape(index), kiln__tshape(t), k, d);
  kiln_device dev = kiln_device_of(t);
  kiln_tensor *out = kiln__tensor_new(index->ndim, index->shape, t->dtype, dev);
  if (!out) return NULL;
  return index_run(KILN__K_GATHER, "gather", t, index, out, d);
}

/* ---- scatter_add -------------------------------------------------------------------- */

/* grad_t = g; grad_src = gather(g, dim, index), placed in zeros when src is larger than
** index (only the index-shaped corner of src takes part, as in PyTorch). */
static kiln_status scatter_add_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  if (n->needs[0]) {
    kiln_status st = kiln__give_grad(&gi[0], g, g);
    if (st != KILN_OK) return st;
  }
  if (n->needs[1]) {
    kiln_tensor *index = n->saved[0];
    int d = (int)n->i[0];
    kiln_tensor *r = kiln_gather(g, d, index);
    if (!r) return kiln_last_error();
    bool same = true;
    for (int k = 0; k < index->ndim; k++) same = same && index->shape[k] == n->in_shape[1][k];
    if (!same) {
      kiln_tensor *z = zeros_like_input(n, 1, g);
      kiln_tensor *corner = z;
      for (int k = 0; k < index->ndim && corner; k++)
        corner = kiln_narrow(corner, k, 0, index->shape[k]);
      if (!corner) return kiln_last_error();
      kiln_status st = kiln_copy_(corner, r);
      if (st != KILN_OK) return st;
      r = z;
    }
    return kiln__give_grad(&gi[1], r, g);
  }
  return KILN_OK;
}

kiln_tensor *kiln_scatter_add(kiln_tensor *t, int dim, kiln_tensor *index, kiln_tensor *src) {
  if (!t || !index || !src) return NULL;
  kiln_tensor *ts[3] = {t, index, src};
  if (kiln__same_device("kiln_scatter_add", 3, ts) != KILN_OK) return NULL;
  if (check_index("kiln_scatter_add", index) != KILN_OK) return NULL;
  if (src->dtype != t->dtype)
    KILN__FAIL_NULL(KILN_ERR_DTYPE, "kiln_scatter_add: src is %s but the input is %s",
                    kiln_dtype_name(src->dtype), kiln_dtype_name(t->dtype));
  int d = wrap_dim0("kiln_scatter_add", dim, t->ndim);
  if (d < 0) return NULL;
  if (index->ndim != t->ndim || src->ndim != t->ndim)
    KILN__FAIL_NULL(KILN_ERR_SHAPE,
                    "kiln_scatter_add: input %s, index %s and src %s must have the same number "
                    "of dims",
                    kiln__tshape(t), kiln__tshape(index), kiln__tshape(src));
  for (int k = 0; k < t->ndim; k++)
    if (index->shape[k] > src->shape[k] || (k != d && index->shape[k] > t->shape[k]))
      KILN__FAIL_NULL(KILN_ERR_SHAPE,
                      "kiln_scatter_add: index %s is larger than src %s or input %s at dim %d",
                      kiln__tshape(index), kiln__tshape(src), kiln__tshape(t), k);
  kiln_device dev = kiln_device_of(t);
  kiln_tensor *out = kiln__tensor_new(t->ndim, t->shape, t->dtype, dev);
  if (!out) return NULL;
  if (kiln_numel(out) > 0) {
    kiln__kargs a = {0};
    a.op = KILN__K_COPY;
    a.n_in = 1;
    a.n_out = 1;
    a.in[0] = view1(t);
    a.out[0] = view1(out);
    kiln_status st = kiln__dispatch(dev, &a);
    /* Only the index-shaped corner of src is read. */
    kiln__view sv = view1(src);
    for (int k = 0; k < index->ndim; k++) sv.shape[k] = index->shape[k];
    if (st == KILN_OK) st = accumulate(KILN__K_SCATTER_ADD, out, d, sv, view1(index));
    if (st != KILN_OK) {
      kiln__discard(out);
      return NULL;
    }
  }
  kiln_tensor *gts[2] = {t, src};
  if (kiln_dtype_is_float(t->dtype) && kiln__needs_grad(2, gts)) {
    kiln__node *n = kiln__node_attach(out, "scatter_add", scatter_add_backward, 2, gts);
    if (!n) {
      kiln__discard(out);
      return NULL;
    }
    kiln__node_save(n, 0, index);
    n->i[0] = d;
  }
  return out;
}

/* ---- embedding ---------------------------------------------------------------------- */

static kiln_status embedding_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *ids = n->saved[0]; /* contiguous */
  int64_t cnt = kiln_numel(ids), D = n->in_shape[0][1];
  kiln_tensor *z = zeros_like_input(n, 0, g);
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

kiln_tensor *kiln_embedding(kiln_tensor *weight, kiln_tensor *ids) {
  if (!weight || !ids) return NULL;
  kiln_tensor *ts[2] = {weight, ids};
  if (kiln__same_device("kiln_embedding", 2, ts) != KILN_OK) return NULL;
  if (!is_index_dtype(ids->dtype))
    KILN__FAIL_NULL(KILN_ERR_DTYPE, "kiln_embedding: ids must be int64 or int32, got %s (shape %s)",
                    kiln_dtype_name(ids->dtype), kiln__tshape(ids));
  if (weight->ndim != 2)
    KILN__FAIL_NULL(KILN_ERR_SHAPE, "kiln_embedding: weight must be 2-d (num, dim), got %s",
                    kiln__tshape(weight));
  if (ids->ndim + 1 > KILN_MAX_DIMS)
    KILN__FAIL_NULL(KILN_ERR_SHAPE, "kiln_embedding: ids %s have too many dims (the result would "
                    "have %d > %d)", kiln__tshape(ids), ids->ndim + 1, KILN_MAX_DIMS);
  int64_t D = weight->shape[1], cnt = kiln_numel(ids);
  int64_t osh[KILN_MAX_DIMS];
  for (int k = 0; k < ids->ndim; k++) osh[k] = ids->shape[k];
  osh[ids->ndim] = D;
  kiln_device dev = kiln_device_of(weight);
  kiln_tensor *idc = kiln_contiguous(ids); /* a flat 1-d view of the ids for the kernel */
  if (!idc) return NULL;
  kiln_tensor *out = kiln__tensor_new(ids->ndim + 1, osh, weight->dtype, dev);
  if (!out) {
    kiln__discard(idc);
    return NULL;
  }
  if (kiln_numel(out) > 0) {
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
    if (kiln__dispatch(dev, &a) != KILN_OK) {
      kiln__discard(out);
      kiln__discard(idc);
      return NULL;
    }
  }
  if (kiln_dtype_is_float(weight->dtype) && kiln__needs_grad(1, &weight)) {
    kiln__node *n = kiln__node_attach(out, "embedding", embedding_backward, 1, &weight);
    if (!n) {
      kiln__discard(out);
      kiln__discard(idc);
      return NULL;
    }
    kiln__node_save(n, 0, idc);
  }
  kiln__discard(idc);
  return out;
}
