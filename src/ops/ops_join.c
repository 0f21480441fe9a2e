/*
** Joining and splitting: cat, stack, split.
**
** cat is one op of any number of inputs: it copies each input into its slice of the
** result with the COPY kernel (a narrowed view of the output) and records one node whose
** inputs are all of its inputs; the backward hands each input that needs it the matching
** narrow of the gradient. stack is a composite (unsqueeze + cat). split stays a loop of
** narrow views (differentiable through kiln_narrow) outside the call path: it makes any
** number of pieces and the path carries at most KILN__OP_MAX_OUT outputs.
*/
#include "ops/op.h"

#include <stdlib.h>

/* cat and stack join along one dim (as given; wrapped in infer and again by the rule). */
typedef struct attrs_dim {
  int dim;
} attrs_dim;
static const kiln__attr_field dim_fields[] = {KILN__FIELD(attrs_dim, dim, KILN__A_INT32)};

/* ---- cat ---------------------------------------------------------------------------- */

/* PyTorch (legacy) lets a 1-d empty tensor join anything: it is skipped. */
static bool legacy_empty(const kiln_tensor *t) { return t->ndim == 1 && t->shape[0] == 0; }

/* Input k's slice of the gradient starts where the inputs before it end. A skipped legacy
** empty is the only input whose ndim differs from the output's: it has no slice (and gets
** no gradient, as it was never part of the result). */
static kiln_status cat_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  int dim = ((const attrs_dim *)n->attrs)->dim;
  int d = dim < 0 ? dim + n->out_ndim : dim;
  int64_t start = 0;
  for (int k = 0; k < n->n_in; k++) {
    if (n->in_ndim[k] != n->out_ndim) continue;
    int64_t len = n->in_shape[k][d];
    if (n->needs[k]) {
      kiln_status st = kiln__give_grad(&gi[k], kiln_narrow(g, d, start, len), g);
      if (st != KILN_OK) return st;
    }
    start += len;
  }
  return KILN_OK;
}

/* The first input that is not a legacy empty sets ndim, dtype and the other dims. */
static const kiln_tensor *cat_ref(int n, kiln_tensor *const *ts) {
  for (int k = 0; k < n; k++)
    if (!legacy_empty(ts[k])) return ts[k];
  return ts[0];
}

static kiln_status cat_infer(kiln__op_ctx *c) {
  int n = c->n_in;
  kiln_tensor *const *ts = c->in;
  const kiln_tensor *ref = cat_ref(n, ts);
  if (ref->ndim == 0)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_cat: a 0-dim tensor cannot be concatenated (use kiln_stack)");
  int d = kiln__wrap_dim("kiln_cat", ((const attrs_dim *)c->attrs)->dim, ref->ndim);
  if (d < 0) return kiln_last_error();
  int64_t osh[KILN_MAX_DIMS];
  for (int j = 0; j < ref->ndim; j++) osh[j] = ref->shape[j];
  osh[d] = 0;
  bool grad = false; /* whether an input that joins the result needs a gradient */
  for (int k = 0; k < n; k++) {
    const kiln_tensor *t = ts[k];
    if (legacy_empty(t) && ref->ndim != 1) continue;
    if (t->dtype != ref->dtype)
      return kiln_set_error(KILN_ERR_DTYPE, "kiln_cat: tensor %d is %s but tensor 0 is %s", k,
                            kiln_dtype_name(t->dtype), kiln_dtype_name(ref->dtype));
    bool ok = t->ndim == ref->ndim;
    for (int j = 0; ok && j < t->ndim; j++) ok = j == d || t->shape[j] == ref->shape[j];
    if (!ok)
      return kiln_set_error(KILN_ERR_SHAPE, "kiln_cat: tensor %d has shape %s, expected %s except at dim %d", k,
                            kiln__tshape(t), kiln__tshape(ref), d);
    osh[d] += t->shape[d];
    grad = grad || t->requires_grad;
  }
  kiln__op_meta(c, 0, ref->ndim, osh, ref->dtype);
  /* only skipped legacy empties need grad: no node, as before they joined one */
  c->differentiable = grad;
  c->scratch[0] = (uint64_t)d;
  return KILN_OK;
}

static kiln_status cat_forward(kiln__op_ctx *c) {
  kiln_tensor *out = c->out[0];
  int d = (int)c->scratch[0];
  int64_t start = 0;
  size_t es = kiln_dtype_size(out->dtype);
  for (int k = 0; k < c->n_in; k++) {
    const kiln_tensor *t = c->in[k];
    if (t->ndim != out->ndim) continue; /* a skipped legacy empty */
    int64_t len = t->shape[d];
    if (kiln_numel(t) > 0) {
      kiln__kargs a = {0};
      a.op = KILN__K_COPY;
      a.n_in = 1;
      a.n_out = 1;
      a.in[0] = kiln__view_of(t);
      a.out[0] = kiln__view_of(out);
      a.out[0].shape[d] = len;
      a.out[0].data = (char *)a.out[0].data + (size_t)(start * out->strides[d]) * es;
      kiln_status st = kiln__dispatch(c->device, &a);
      if (st != KILN_OK) return st;
    }
    start += len;
  }
  return KILN_OK;
}

static const kiln__op op_cat = {
    .name = "cat", .api = "kiln_cat", .n_in = KILN__OP_VARIADIC, .n_out = 1, .amp = KILN__AMP_PROMOTE, .n_kernels = 1,
    .kernels = {KILN__K_COPY}, .attrs = dim_fields, .n_attrs = 1, .attr_size = sizeof(attrs_dim),
    .infer = cat_infer, .forward = cat_forward, .backward = cat_backward};

/* The list itself is checked before the call: the path reads its n entries. */
kiln_tensor *kiln_cat(int n, kiln_tensor *const *ts, int dim) {
  if (n <= 0 || !ts)
    KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_cat: expected at least one tensor, got %d", n);
  return kiln__op_call(&op_cat, n, ts, &(attrs_dim){dim}, NULL);
}

/* ---- stack -------------------------------------------------------------------------- */

static kiln_status stack_infer(kiln__op_ctx *c) {
  const kiln_tensor *ref = c->in[0];
  if (ref->ndim + 1 > KILN_MAX_DIMS)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_stack: inputs of shape %s would give %d dims (max %d)",
                          kiln__tshape(ref), ref->ndim + 1, KILN_MAX_DIMS);
  int d = kiln__wrap_dim("kiln_stack", ((const attrs_dim *)c->attrs)->dim, ref->ndim + 1);
  if (d < 0) return kiln_last_error();
  for (int k = 1; k < c->n_in; k++) {
    bool ok = c->in[k]->ndim == ref->ndim;
    for (int j = 0; ok && j < ref->ndim; j++) ok = c->in[k]->shape[j] == ref->shape[j];
    if (!ok)
      return kiln_set_error(KILN_ERR_SHAPE, "kiln_stack: tensor %d has shape %s but tensor 0 has %s", k,
                            kiln__tshape(c->in[k]), kiln__tshape(ref));
  }
  c->scratch[0] = (uint64_t)d;
  return KILN_OK;
}

/* cat of the inputs each unsqueezed at d: those ops record the nodes. */
static kiln_status stack_forward(kiln__op_ctx *c) {
  int n = c->n_in, d = (int)c->scratch[0];
  kiln_tensor **u = malloc((size_t)n * sizeof *u);
  if (!u) return kiln_set_error(KILN_ERR_OOM, "kiln_stack: out of host memory for %d inputs", n);
  kiln_scope_begin();
  kiln_tensor *r = NULL;
  int k = 0;
  for (; k < n; k++)
    if (!(u[k] = kiln_unsqueeze(c->in[k], d))) break;
  if (k == n) r = kiln_cat(n, u, d);
  free(u);
  c->out[0] = kiln__scope_return(r);
  return c->out[0] ? KILN_OK : kiln_last_error();
}

static const kiln__op op_stack = {
    .name = "stack", .api = "kiln_stack", .n_in = KILN__OP_VARIADIC, .n_out = 1, .amp = KILN__AMP_PROMOTE,
    .flags = KILN__OP_COMPOSITE, .attrs = dim_fields, .n_attrs = 1, .attr_size = sizeof(attrs_dim),
    .infer = stack_infer, .forward = stack_forward};

kiln_tensor *kiln_stack(int n, kiln_tensor *const *ts, int dim) {
  if (n <= 0 || !ts)
    KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_stack: expected at least one tensor, got %d", n);
  return kiln__op_call(&op_stack, n, ts, &(attrs_dim){dim}, NULL);
}

/* ---- split -------------------------------------------------------------------------- */

int kiln_split(kiln_tensor *t, int64_t split_size, int dim, kiln_tensor **out, int max_out) {
  if (!t) return -1;
  int d = kiln__wrap_dim("kiln_split", dim, t->ndim);
  if (d < 0) return -1;
  int64_t size = t->shape[d];
  if (split_size <= 0 && !(split_size == 0 && size == 0)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                   "kiln_split: split_size must be positive, got %lld (shape %s)",
                   (long long)split_size, kiln__tshape(t));
    return -1;
  }
  /* An empty dim splits into one empty piece (PyTorch). */
  int64_t count = size == 0 ? 1 : (size + split_size - 1) / split_size;
  if (count > max_out || !out) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                   "kiln_split: splitting dim %d of %s by %lld gives %lld pieces but room for "
                   "%d was given",
                   d, kiln__tshape(t), (long long)split_size, (long long)count, out ? max_out : 0);
    return -1;
  }
  for (int64_t k = 0; k < count; k++) {
    int64_t s = k * split_size, len = size - s < split_size ? size - s : split_size;
    out[k] = kiln_narrow(t, d, s, size == 0 ? 0 : len);
    if (!out[k]) {
      for (int64_t j = 0; j < k; j++) {
        kiln__discard(out[j]);
        out[j] = NULL;
      }
      return -1;
    }
  }
  return (int)count;
}
