/*
** Views: new handles on the same storage (no copy), each differentiable. The backward
** of a view that picks elements (narrow, slice, select) scatters the gradient into zeros
** through the same view of a fresh tensor.
*/
#include "core/kiln_int.h"

#include <string.h>

static kiln_tensor *make_view(kiln_tensor *t, int64_t offset, int ndim, const int64_t *shape,
                              const int64_t *strides) {
  return kiln__tensor_make(t->storage, offset, ndim, shape, strides, t->dtype);
}

/* ---- view / reshape ---- */
/* Infers one -1 and checks the element count. */
static kiln_status infer_shape(const char *op, const kiln_tensor *t, int ndim, const int64_t *shape,
                               int64_t *out) {
  if (ndim < 0 || ndim > KILN_MAX_DIMS)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: %d dims requested; kiln tensors have 0 to %d", op,
                          ndim, KILN_MAX_DIMS);
  if (ndim > 0 && !shape) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: shape is NULL", op);
  int infer = -1;
  int64_t known = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] == -1) {
      if (infer >= 0) return kiln_set_error(KILN_ERR_SHAPE, "%s: only one dim can be -1 in %s", op, kiln__shape_cstr(ndim, shape));
      infer = i;
    } else if (shape[i] < 0) {
      return kiln_set_error(KILN_ERR_SHAPE, "%s: invalid size %lld in %s", op, (long long)shape[i], kiln__shape_cstr(ndim, shape));
    } else if (__builtin_mul_overflow(known, shape[i], &known)) {
      return kiln_set_error(KILN_ERR_SHAPE, "%s: shape %s is too large", op, kiln__shape_cstr(ndim, shape));
    }
    out[i] = shape[i];
  }
  int64_t n = kiln_numel(t);
  if (infer >= 0) {
    if (known == 0 || n % known != 0)
      return kiln_set_error(KILN_ERR_SHAPE, "%s: shape %s is invalid for a tensor of %lld elements (%s)",
                            op, kiln__shape_cstr(ndim, shape), (long long)n, kiln__tshape(t));
    out[infer] = n / known;
  } else if (known != n) {
    return kiln_set_error(KILN_ERR_SHAPE, "%s: shape %s is invalid for a tensor of %lld elements (%s)",
                          op, kiln__shape_cstr(ndim, shape), (long long)n, kiln__tshape(t));
  }
  return KILN_OK;
}

/* Strides for viewing t as newshape without a copy, or false (PyTorch's computeStride). */
static bool view_strides(const kiln_tensor *t, int ndim, const int64_t *newshape, int64_t *newstrides) {
  int64_t numel = kiln_numel(t);
  if (numel == 0) {
    kiln__contiguous_strides(ndim, newshape, newstrides);
    return true;
  }
  if (t->ndim == 0) {
    for (int i = 0; i < ndim; i++) newstrides[i] = 1;
    return true;
  }
  /* Walk the old dims from the innermost, in chunks of dims that are contiguous with each
  ** other; each chunk must map onto whole new dims. */
  int view_d = ndim - 1;
  int64_t chunk_base_stride = t->strides[t->ndim - 1];
  int64_t tensor_numel = 1, view_numel = 1;
  for (int d = t->ndim - 1; d >= 0; d--) {
    tensor_numel *= t->shape[d];
    if (d == 0 || (t->shape[d - 1] != 1 && t->strides[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || newshape[view_d] == 1)) {
        newstrides[view_d] = view_numel * chunk_base_stride;
        view_numel *= newshape[view_d];
        view_d--;
      }
      if (view_numel != tensor_numel) return false;
      if (d > 0) {
        chunk_base_stride = t->strides[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  return view_d == -1;
}

static kiln_status view_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  gi[0] = kiln_keep(kiln_reshape(g, n->in_ndim[0], n->in_shape[0]));
  return gi[0] ? KILN_OK : kiln_last_error();
}

static kiln_tensor *attach_reshape_like(kiln_tensor *out, kiln_tensor *t, const char *name) {
  if (out && kiln__needs_grad(1, &t) && !kiln__node_attach(out, name, view_backward, 1, &t)) {
    kiln__discard(out);
    return NULL;
  }
  return out;
}

kiln_tensor *kiln_view(kiln_tensor *t, int ndim, const int64_t *shape) {
  if (!t) return NULL;
  int64_t ns[KILN_MAX_DIMS], st[KILN_MAX_DIMS];
  if (infer_shape("kiln_view", t, ndim, shape, ns) != KILN_OK) return NULL;
  if (!view_strides(t, ndim, ns, st))
    KILN__FAIL_NULL(KILN_ERR_SHAPE,
                    "kiln_view: a tensor of shape %s with strides %s cannot be viewed as %s without "
                    "a copy (use kiln_reshape)",
                    kiln__tshape(t), kiln__shape_cstr(t->ndim, t->strides), kiln__shape_cstr(ndim, ns));
  return attach_reshape_like(make_view(t, t->offset, ndim, ns, st), t, "view");
}

kiln_tensor *kiln_reshape(kiln_tensor *t, int ndim, const int64_t *shape) {
  if (!t) return NULL;
  int64_t ns[KILN_MAX_DIMS], st[KILN_MAX_DIMS];
  if (infer_shape("kiln_reshape", t, ndim, shape, ns) != KILN_OK) return NULL;
  if (view_strides(t, ndim, ns, st)) return attach_reshape_like(make_view(t, t->offset, ndim, ns, st), t, "reshape");
  kiln_tensor *c = kiln_contiguous(t);
  if (!c) return NULL;
  return kiln_view(c, ndim, ns);
}

kiln_tensor *kiln_flatten(kiln_tensor *t, int start_dim, int end_dim) {
  if (!t) return NULL;
  if (t->ndim == 0) return kiln_reshape(t, KILN_SHAPE(1));
  int s = kiln__wrap_dim("kiln_flatten", start_dim, t->ndim);
  int e = kiln__wrap_dim("kiln_flatten", end_dim, t->ndim);
  if (s < 0 || e < 0) return NULL;
  if (s > e) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_flatten: start_dim %d is after end_dim %d", start_dim, end_dim);
  int64_t ns[KILN_MAX_DIMS];
  int nd = 0;
  for (int i = 0; i < s; i++) ns[nd++] = t->shape[i];
  int64_t m = 1;
  for (int i = s; i <= e; i++) m *= t->shape[i];
  ns[nd++] = m;
  for (int i = e + 1; i < t->ndim; i++) ns[nd++] = t->shape[i];
  return kiln_reshape(t, nd, ns);
}

/* ---- permute / transpose ---- */
static kiln_status permute_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  int inv[KILN_MAX_DIMS];
  for (int i = 0; i < n->out_ndim; i++) inv[n->i[i]] = i;
  gi[0] = kiln_keep(kiln_permute(g, n->out_ndim, inv));
  return gi[0] ? KILN_OK : kiln_last_error();
}

kiln_tensor *kiln_permute(kiln_tensor *t, int ndim, const int *dims) {
  if (!t) return NULL;
  if (ndim != t->ndim || (ndim > 0 && !dims))
    KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_permute: %d dims given for a tensor of %d dims (%s)",
                    ndim, t->ndim, kiln__tshape(t));
  int64_t ns[KILN_MAX_DIMS], st[KILN_MAX_DIMS];
  int perm[KILN_MAX_DIMS];
  bool seen[KILN_MAX_DIMS] = {false};
  for (int i = 0; i < ndim; i++) {
    int d = kiln__wrap_dim("kiln_permute", dims[i], ndim);
    if (d < 0) return NULL;
    if (seen[d]) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_permute: dim %d repeated", dims[i]);
    seen[d] = true;
    perm[i] = d;
    ns[i] = t->shape[d];
    st[i] = t->strides[d];
  }
  kiln_tensor *out = make_view(t, t->offset, ndim, ns, st);
  if (out && kiln__needs_grad(1, &t)) {
    kiln__node *n = kiln__node_attach(out, "permute", permute_backward, 1, &t);
    if (!n) {
      kiln__discard(out);
      return NULL;
    }
    for (int i = 0; i < ndim; i++) n->i[i] = perm[i];
  }
  return out;
}

kiln_tensor *kiln_transpose(kiln_tensor *t, int dim0, int dim1) {
  if (!t) return NULL;
  if (t->ndim < 2 && (dim0 == 0 || dim0 == -1) && (dim1 == 0 || dim1 == -1))
    return kiln__scope_track(kiln_tensor_ref(t)); /* 0-d and 1-d: nothing to swap */
  int a = kiln__wrap_dim("kiln_transpose", dim0, t->ndim);
  int b = kiln__wrap_dim("kiln_transpose", dim1, t->ndim);
  if (a < 0 || b < 0) return NULL;
  int perm[KILN_MAX_DIMS];
  for (int i = 0; i < t->ndim; i++) perm[i] = i;
  perm[a] = b;
  perm[b] = a;
  return kiln_permute(t, t->ndim, perm);
}

/* ---- narrow / slice / select: strided picks ---- */
enum { PICK_SLICE = 0, PICK_SELECT = 1 };

static kiln_tensor *pick_view(kiln_tensor *t, int kind, int d, int64_t start, int64_t len, int64_t step);

static kiln_status pick_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *z = kiln_zeros(n->in_ndim[0], n->in_shape[0], n->in_dtype[0], n->out_device);
  if (!z) return kiln_last_error();
  kiln_tensor *v = pick_view(z, (int)n->i[0], (int)n->i[1], n->i[2], n->i[3], n->i[4]);
  if (!v || kiln_copy_(v, g) != KILN_OK) return kiln_last_error();
  gi[0] = kiln_keep(z);
  return KILN_OK;
}

static kiln_tensor *pick_view(kiln_tensor *t, int kind, int d, int64_t start, int64_t len, int64_t step) {
  int64_t ns[KILN_MAX_DIMS], st[KILN_MAX_DIMS];
  int nd = 0;
  for (int i = 0; i < t->ndim; i++) {
    if (i == d) {
      if (kind == PICK_SELECT) continue;
      ns[nd] = len;
      st[nd] = t->strides[i] * step;
    } else {
      ns[nd] = t->shape[i];
      st[nd] = t->strides[i];
    }
    nd++;
  }
  int64_t off = t->offset + (len > 0 || kind == PICK_SELECT ? start * t->strides[d] : 0);
  kiln_tensor *out = make_view(t, off, nd, ns, st);
  if (out && kiln__needs_grad(1, &t)) {
    kiln__node *n = kiln__node_attach(out, kind == PICK_SELECT ? "select" : "slice", pick_backward, 1, &t);
    if (!n) {
      kiln__discard(out);
      return NULL;
    }
    n->i[0] = kind;
    n->i[1] = d;
    n->i[2] = start;
    n->i[3] = len;
    n->i[4] = step;
  }
  return out;
}

kiln_tensor *kiln_narrow(kiln_tensor *t, int dim, int64_t start, int64_t length) {
  if (!t) return NULL;
  if (t->ndim == 0) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_narrow: cannot narrow a 0-dim tensor");
  int d = kiln__wrap_dim("kiln_narrow", dim, t->ndim);
  if (d < 0) return NULL;
  int64_t size = t->shape[d];
  if (start < 0) start += size;
  if (start < 0 || length < 0 || start > size || length > size - start)
    KILN__FAIL_NULL(KILN_ERR_INDEX, "kiln_narrow: range [%lld, %lld) is outside dim %d of size %lld (%s)",
                    (long long)start, (long long)(start + length), dim, (long long)size, kiln__tshape(t));
  return pick_view(t, PICK_SLICE, d, start, length, 1);
}

kiln_tensor *kiln_slice(kiln_tensor *t, int dim, int64_t start, int64_t end, int64_t step) {
  if (!t) return NULL;
  if (t->ndim == 0) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_slice: cannot slice a 0-dim tensor");
  int d = kiln__wrap_dim("kiln_slice", dim, t->ndim);
  if (d < 0) return NULL;
  if (step <= 0) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_slice: step must be positive, got %lld", (long long)step);
  int64_t size = t->shape[d];
  if (start < 0) start += size;
  if (end < 0) end += size;
  if (start < 0) start = 0;
  if (start > size) start = size;
  if (end > size) end = size;
  if (end < start) end = start;
  int64_t len = (end - start + step - 1) / step;
  return pick_view(t, PICK_SLICE, d, start, len, step);
}

kiln_tensor *kiln_select(kiln_tensor *t, int dim, int64_t index) {
  if (!t) return NULL;
  if (t->ndim == 0) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_select: cannot index a 0-dim tensor");
  int d = kiln__wrap_dim("kiln_select", dim, t->ndim);
  if (d < 0) return NULL;
  int64_t size = t->shape[d];
  if (index < -size || index >= size)
    KILN__FAIL_NULL(KILN_ERR_INDEX, "kiln_select: index %lld is out of range for dim %d of size %lld",
                    (long long)index, dim, (long long)size);
  if (index < 0) index += size;
  return pick_view(t, PICK_SELECT, d, index, 1, 1);
}

/* ---- expand ---- */
static kiln_status expand_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  gi[0] = kiln_keep(kiln__unbroadcast(g, n->in_ndim[0], n->in_shape[0]));
  return gi[0] ? KILN_OK : kiln_last_error();
}

kiln_tensor *kiln_expand(kiln_tensor *t, int ndim, const int64_t *shape) {
  if (!t) return NULL;
  if (ndim < t->ndim || ndim > KILN_MAX_DIMS || (ndim > 0 && !shape))
    KILN__FAIL_NULL(KILN_ERR_SHAPE, "kiln_expand: cannot expand %s to %d dims", kiln__tshape(t), ndim);
  int64_t ns[KILN_MAX_DIMS], st[KILN_MAX_DIMS];
  int lead = ndim - t->ndim;
  for (int i = 0; i < ndim; i++) {
    int j = i - lead;
    int64_t want = shape[i];
    if (j < 0) {
      if (want < 0) KILN__FAIL_NULL(KILN_ERR_SHAPE, "kiln_expand: -1 is not allowed for a new leading dim (%s)", kiln__shape_cstr(ndim, shape));
      ns[i] = want;
      st[i] = 0;
    } else if (want == -1 || want == t->shape[j]) {
      ns[i] = t->shape[j];
      st[i] = t->strides[j];
    } else if (t->shape[j] == 1 && want >= 0) {
      ns[i] = want;
      st[i] = 0;
    } else {
      KILN__FAIL_NULL(KILN_ERR_SHAPE, "kiln_expand: cannot expand %s to %s (dim %d has size %lld, not 1)",
                      kiln__tshape(t), kiln__shape_cstr(ndim, shape), j, (long long)t->shape[j]);
    }
  }
  kiln_tensor *out = make_view(t, t->offset, ndim, ns, st);
  if (out && kiln__needs_grad(1, &t) && !kiln__node_attach(out, "expand", expand_backward, 1, &t)) {
    kiln__discard(out);
    return NULL;
  }
  return out;
}

/* ---- squeeze / unsqueeze ---- */
kiln_tensor *kiln_squeeze(kiln_tensor *t, int dim) {
  if (!t) return NULL;
  if (t->ndim == 0) return kiln__scope_track(kiln_tensor_ref(t));
  int d = kiln__wrap_dim("kiln_squeeze", dim, t->ndim);
  if (d < 0) return NULL;
  if (t->shape[d] != 1)
    KILN__FAIL_NULL(KILN_ERR_SHAPE, "kiln_squeeze: dim %d of %s has size %lld, not 1", dim, kiln__tshape(t),
                    (long long)t->shape[d]);
  int64_t ns[KILN_MAX_DIMS], st[KILN_MAX_DIMS];
  int nd = 0;
  for (int i = 0; i < t->ndim; i++)
    if (i != d) {
      ns[nd] = t->shape[i];
      st[nd++] = t->strides[i];
    }
  return attach_reshape_like(make_view(t, t->offset, nd, ns, st), t, "squeeze");
}

kiln_tensor *kiln_squeeze_all(kiln_tensor *t) {
  if (!t) return NULL;
  int64_t ns[KILN_MAX_DIMS], st[KILN_MAX_DIMS];
  int nd = 0;
  for (int i = 0; i < t->ndim; i++)
    if (t->shape[i] != 1) {
      ns[nd] = t->shape[i];
      st[nd++] = t->strides[i];
    }
  return attach_reshape_like(make_view(t, t->offset, nd, ns, st), t, "squeeze");
}

kiln_tensor *kiln_unsqueeze(kiln_tensor *t, int dim) {
  if (!t) return NULL;
  if (t->ndim >= KILN_MAX_DIMS)
    KILN__FAIL_NULL(KILN_ERR_SHAPE, "kiln_unsqueeze: %s already has %d dims", kiln__tshape(t), KILN_MAX_DIMS);
  int d = kiln__wrap_dim("kiln_unsqueeze", dim, t->ndim + 1);
  if (d < 0) return NULL;
  int64_t ns[KILN_MAX_DIMS], st[KILN_MAX_DIMS];
  int nd = 0;
  for (int i = 0; i <= t->ndim; i++) {
    if (i == d) {
      ns[nd] = 1;
      st[nd++] = (i < t->ndim) ? t->strides[i] * t->shape[i] : 1;
    }
    if (i < t->ndim) {
      ns[nd] = t->shape[i];
      st[nd++] = t->strides[i];
    }
  }
  return attach_reshape_like(make_view(t, t->offset, nd, ns, st), t, "unsqueeze");
}
