/*
** Joining and splitting: cat, stack, split.
**
** cat copies each input into its slice of the result with the COPY kernel (a narrowed
** view of the output), and its backward hands each input the matching narrow of the
** gradient. A node holds at most KILN__NODE_MAX_IN inputs, so only the inputs that need
** a gradient become node inputs; when more than that many do, the cat is done as a tree
** of cats of at most that many parts (each level copies once more, only in that case).
** stack is unsqueeze + cat; split is narrow views (differentiable through kiln_narrow).
*/
#define KILN__NODE_MAX_IN 4 /* temporary */
#include "../core/kiln_int.h"

#include <stdlib.h>

/* ---- cat ---------------------------------------------------------------------------- */

static kiln_status cat_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  int d = (int)n->i[0];
  for (int k = 0; k < n->n_in; k++) {
    if (!n->needs[k]) continue;
    kiln_status st = kiln__give_grad(&gi[k], kiln_narrow(g, d, n->i[1 + k], n->i[5 + k]), g);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

/* PyTorch (legacy) lets a 1-d empty tensor join anything: it is skipped. */
static bool legacy_empty(const kiln_tensor *t) { return t->ndim == 1 && t->shape[0] == 0; }

static kiln_tensor *cat_list(int n, kiln_tensor *const *ts, int d);

/* More inputs need a gradient than a node holds: cat groups, then cat the groups. */
static kiln_tensor *cat_tree(int n, kiln_tensor *const *ts, int d) {
  int chunk = (n + KILN__NODE_MAX_IN - 1) / KILN__NODE_MAX_IN;
  kiln_tensor *parts[KILN__NODE_MAX_IN];
  int np = 0;
  kiln_scope_begin();
  kiln_tensor *r = NULL;
  for (int s = 0; s < n; s += chunk) {
    int m = n - s < chunk ? n - s : chunk;
    parts[np] = cat_list(m, ts + s, d);
    if (!parts[np]) return kiln__scope_return(NULL);
    np++;
  }
  r = cat_list(np, parts, d);
  return kiln__scope_return(r);
}

/* cat of a checked list (no legacy empties, all of one ndim/dtype/device, d wrapped). */
static kiln_tensor *cat_list(int n, kiln_tensor *const *ts, int d) {
  int ngrad = 0;
  for (int k = 0; k < n; k++) ngrad += kiln__needs_grad(1, &ts[k]) ? 1 : 0;
  if (ngrad > KILN__NODE_MAX_IN) return cat_tree(n, ts, d);
  const kiln_tensor *ref = ts[0];
  int64_t osh[KILN_MAX_DIMS];
  for (int k = 0; k < ref->ndim; k++) osh[k] = ref->shape[k];
  osh[d] = 0;
  for (int k = 0; k < n; k++) osh[d] += ts[k]->shape[d];
  kiln_device dev = kiln_device_of(ref);
  kiln_tensor *out = kiln__tensor_new(ref->ndim, osh, ref->dtype, dev);
  if (!out) return NULL;
  kiln_tensor *gins[KILN__NODE_MAX_IN];
  int64_t gstart[KILN__NODE_MAX_IN], glen[KILN__NODE_MAX_IN];
  int ng = 0;
  int64_t start = 0;
  size_t es = kiln_dtype_size(ref->dtype);
  for (int k = 0; k < n; k++) {
    const kiln_tensor *t = ts[k];
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
      if (kiln__dispatch(dev, &a) != KILN_OK) {
        kiln__discard(out);
        return NULL;
      }
    }
    if (kiln__needs_grad(1, &ts[k])) {
      gins[ng] = ts[k];
      gstart[ng] = start;
      glen[ng] = len;
      ng++;
    }
    start += len;
  }
  if (ng > 0) {
    kiln__node *nd = kiln__node_attach(out, "cat", cat_backward, ng, gins);
    if (!nd) {
      kiln__discard(out);
      return NULL;
    }
    nd->i[0] = d;
    for (int k = 0; k < ng; k++) nd->i[1 + k] = gstart[k], nd->i[5 + k] = glen[k];
  }
  return out;
}

kiln_tensor *kiln_cat(int n, kiln_tensor *const *ts, int dim) {
  if (n <= 0 || !ts)
    KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_cat: expected at least one tensor, got %d", n);
  for (int k = 0; k < n; k++)
    if (!ts[k]) return NULL;
  if (kiln__same_device("kiln_cat", n, ts) != KILN_OK) return NULL;
  const kiln_tensor *ref = NULL;
  for (int k = 0; k < n && !ref; k++)
    if (!legacy_empty(ts[k])) ref = ts[k];
  if (!ref) ref = ts[0];
  if (ref->ndim == 0)
    KILN__FAIL_NULL(KILN_ERR_SHAPE, "kiln_cat: a 0-dim tensor cannot be concatenated (use kiln_stack)");
  int d = kiln__wrap_dim("kiln_cat", dim, ref->ndim);
  if (d < 0) return NULL;
  kiln_tensor **use = malloc((size_t)n * sizeof *use);
  if (!use) KILN__FAIL_NULL(KILN_ERR_OOM, "kiln_cat: out of host memory for %d inputs", n);
  int m = 0;
  for (int k = 0; k < n; k++) {
    kiln_tensor *t = ts[k];
    if (legacy_empty(t) && ref->ndim != 1) continue;
    if (t->dtype != ref->dtype) {
      kiln_set_error(KILN_ERR_DTYPE, "kiln_cat: tensor %d is %s but tensor 0 is %s", k,
                     kiln_dtype_name(t->dtype), kiln_dtype_name(ref->dtype));
      free(use);
      return NULL;
    }
    bool ok = t->ndim == ref->ndim;
    for (int j = 0; ok && j < t->ndim; j++) ok = j == d || t->shape[j] == ref->shape[j];
    if (!ok) {
      kiln_set_error(KILN_ERR_SHAPE,
                     "kiln_cat: tensor %d has shape %s, expected %s except at dim %d", k,
                     kiln__tshape(t), kiln__tshape(ref), d);
      free(use);
      return NULL;
    }
    use[m++] = t;
  }
  kiln_tensor *out = cat_list(m, use, d);
  free(use);
  return out;
}

/* ---- stack -------------------------------------------------------------------------- */

kiln_tensor *kiln_stack(int n, kiln_tensor *const *ts, int dim) {
  if (n <= 0 || !ts)
    KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_stack: expected at least one tensor, got %d", n);
  for (int k = 0; k < n; k++)
    if (!ts[k]) return NULL;
  const kiln_tensor *ref = ts[0];
  if (ref->ndim + 1 > KILN_MAX_DIMS)
    KILN__FAIL_NULL(KILN_ERR_SHAPE, "kiln_stack: inputs of shape %s would give %d dims (max %d)",
                    kiln__tshape(ref), ref->ndim + 1, KILN_MAX_DIMS);
  int d = kiln__wrap_dim("kiln_stack", dim, ref->ndim + 1);
  if (d < 0) return NULL;
  for (int k = 1; k < n; k++) {
    bool ok = ts[k]->ndim == ref->ndim;
    for (int j = 0; ok && j < ref->ndim; j++) ok = ts[k]->shape[j] == ref->shape[j];
    if (!ok)
      KILN__FAIL_NULL(KILN_ERR_SHAPE, "kiln_stack: tensor %d has shape %s but tensor 0 has %s", k,
                      kiln__tshape(ts[k]), kiln__tshape(ref));
  }
  kiln_tensor **u = malloc((size_t)n * sizeof *u);
  if (!u) KILN__FAIL_NULL(KILN_ERR_OOM, "kiln_stack: out of host memory for %d inputs", n);
  kiln_scope_begin();
  kiln_tensor *r = NULL;
  int k = 0;
  for (; k < n; k++)
    if (!(u[k] = kiln_unsqueeze(ts[k], d))) break;
  if (k == n) r = kiln_cat(n, u, d);
  free(u);
  return kiln__scope_return(r);
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
