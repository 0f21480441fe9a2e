/*
** Reductions: sum, mean, amax, amin, var, std over a set of dims; max/min/argmax/argmin
** along one dim.
**
** Kernel contract (backend.h): in0 is the full input, out0 has the input's ndim with size
** 1 at the reduced dims, i0 is the bit mask of reduced dims. For keepdim=false the result
** tensor has the reduced shape and the kernel gets a keepdim-shaped view of it (the
** inserted size-1 dims have stride 0), so no copy is ever needed.
*/
#include "../core/kiln_int.h"

#include <math.h>
#include <string.h>

/* ---- helpers ---------------------------------------------------------------------- */

/* The bit mask of reduced dims. ndims 0 (dims NULL) means all dims. A 0-dim tensor takes
** dim 0 or -1 (PyTorch's rule) and has nothing to reduce. */
static kiln_status reduce_mask(const char *op, const kiln_tensor *t, int ndims, const int *dims,
                               uint32_t *mask) {
  *mask = 0;
  if (ndims < 0 || (ndims > 0 && !dims))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: invalid dims list (ndims %d, dims %s)",
                          op, ndims, dims ? "given" : "NULL");
  if (ndims == 0) {
    *mask = t->ndim ? (uint32_t)((1u << t->ndim) - 1u) : 0u;
    return KILN_OK;
  }
  if (ndims > KILN_MAX_DIMS && t->ndim > 0)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: %d dims given for a tensor of shape %s",
                          op, ndims, kiln__tshape(t));
  for (int k = 0; k < ndims; k++) {
    int d;
    if (t->ndim == 0) {
      if (dims[k] != 0 && dims[k] != -1)
        return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                              "%s: dim %d out of range for a 0-dim tensor (expected 0 or -1)", op,
                              dims[k]);
      if (ndims > 1)
        return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: dim %d appears more than once", op,
                              dims[k]);
      continue;
    }
    d = kiln__wrap_dim(op, dims[k], t->ndim);
    if (d < 0) return KILN_ERR_INVALID_ARGUMENT;
    if (*mask & (1u << d))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            "%s: dim %d appears more than once in the dims list for shape %s", op,
                            dims[k], kiln__tshape(t));
    *mask |= 1u << d;
  }
  return KILN_OK;
}

static void reduced_shape(int ndim, const int64_t *shape, uint32_t mask, bool keepdim, int *ondim,
                          int64_t *oshape) {
  int j = 0;
  for (int d = 0; d < ndim; d++) {
    if (mask & (1u << d)) {
      if (keepdim) oshape[j++] = 1;
    } else {
      oshape[j++] = shape[d];
    }
  }
  *ondim = j;
}

static int64_t reduced_count(int ndim, const int64_t *shape, uint32_t mask) {
  int64_t n = 1;
  for (int d = 0; d < ndim; d++)
    if (mask & (1u << d)) n *= shape[d];
  return n;
}

/* out (reduced shape) seen with the input's ndim: size 1, stride 0 at reduced dims. */
static kiln__view keep_view(const kiln_tensor *out, int in_ndim, uint32_t mask, bool keepdim) {
  kiln__view v = kiln__view_of(out);
  if (keepdim) return v;
  int j = 0;
  for (int d = 0; d < in_ndim; d++) {
    if (mask & (1u << d)) {
      v.shape[d] = 1;
      v.strides[d] = 0;
    } else {
      v.shape[d] = out->shape[j];
      v.strides[d] = out->strides[j];
      j++;
    }
  }
  v.ndim = in_ndim;
  return v;
}

/* Value reductions cannot reduce an empty dim (no identity): PyTorch errors too. */
static kiln_status check_nonempty(const char *op, const kiln_tensor *t, uint32_t mask) {
  for (int d = 0; d < t->ndim; d++)
    if ((mask & (1u << d)) && t->shape[d] == 0)
      return kiln_set_error(KILN_ERR_SHAPE,
                            "%s: cannot reduce dim %d of size 0 (shape %s): the operation has "
                            "no identity",
                            op, d, kiln__tshape(t));
  return KILN_OK;
}

/* Runs reduction kernel kop over mask into a new tensor of dtype odt (caller's scope). */
static kiln_tensor *reduce_raw(kiln__kop kop, kiln_tensor *t, uint32_t mask, bool keepdim,
                               kiln_dtype odt) {
  int ond;
  int64_t osh[KILN_MAX_DIMS];
  reduced_shape(t->ndim, t->shape, mask, keepdim, &ond, osh);
  kiln_tensor *out = kiln__tensor_new(ond, osh, odt, kiln_device_of(t));
  if (!out) return NULL;
  if (kiln_numel(out) == 0) return out;
  kiln__kargs a = {0};
  a.n_out = 1;
  a.out[0] = keep_view(out, t->ndim, mask, keepdim);
  if (kiln_numel(t) == 0) { /* only sums get here: an empty sum is 0 */
    a.op = KILN__K_FILL;
    a.s[0] = 0.0;
  } else {
    a.op = kop;
    a.n_in = 1;
    a.in[0] = kiln__view_of(t);
    a.i[0] = (int64_t)mask;
  }
  if (kiln__dispatch(kiln_device_of(t), &a) != KILN_OK) {
    kiln__discard(out);
    return NULL;
  }
  return out;
}

/* g (the reduced shape) unsqueezed back to the input's ndim (size 1 at reduced dims). */
static kiln_tensor *unsqueeze_back(kiln_tensor *g, int ndim, uint32_t mask, bool keepdim) {
  if (keepdim) return g;
  for (int d = 0; d < ndim && g; d++)
    if (mask & (1u << d)) g = kiln_unsqueeze(g, d);
  return g;
}

/* g broadcast back to the input shape, as a fresh contiguous tensor: the engine may add
** into what it receives, which must then not be a stride-0 view. */
static kiln_tensor *expand_back(kiln_tensor *g, int ndim, const int64_t *shape, uint32_t mask,
                                bool keepdim) {
  g = unsqueeze_back(g, ndim, mask, keepdim);
  if (!g) return NULL;
  return kiln_contiguous(kiln_expand(g, ndim, shape));
}

static int mask_to_dims(uint32_t mask, int ndim, int *dims) {
  int k = 0;
  for (int d = 0; d < ndim; d++)
    if (mask & (1u << d)) dims[k++] = d;
  return k;
}

static bool is_half(kiln_dtype dt) { return dt == KILN_F16 || dt == KILN_BF16; }

/* ---- sum ---------------------------------------------------------------------------- */

static kiln_status sum_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *r = expand_back(g, n->in_ndim[0], n->in_shape[0], (uint32_t)n->i[0], n->i[1] != 0);
  return kiln__give_grad(&gi[0], r, g);
}

kiln_tensor *kiln_sum(kiln_tensor *t, int ndims, const int *dims, bool keepdim) {
  if (!t) return NULL;
  uint32_t mask;
  if (reduce_mask("kiln_sum", t, ndims, dims, &mask) != KILN_OK) return NULL;
  if (!kiln_dtype_is_float(t->dtype)) {
    /* Integer and bool sums are i64 (PyTorch); widen first so every backend's SUM kernel
    ** only sees matching dtypes. Integers never need a gradient. */
    kiln_scope_begin();
    kiln_tensor *w = t->dtype == KILN_I64 ? t : kiln_to_dtype(t, KILN_I64);
    kiln_tensor *r = w ? reduce_raw(KILN__K_SUM, w, mask, keepdim, KILN_I64) : NULL;
    return kiln__scope_return(r);
  }
  kiln_tensor *out = reduce_raw(KILN__K_SUM, t, mask, keepdim, t->dtype);
  if (!out) return NULL;
  if (kiln__needs_grad(1, &t)) {
    kiln__node *n = kiln__node_attach(out, "sum", sum_backward, 1, &t);
    if (!n) {
      kiln__discard(out);
      return NULL;
    }
    n->i[0] = (int64_t)mask;
    n->i[1] = keepdim;
  }
  return out;
}

kiln_tensor *kiln_sum_all(kiln_tensor *t) { return kiln_sum(t, 0, NULL, false); }

/* ---- mean --------------------------------------------------------------------------- */

static kiln_status mean_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *r = expand_back(g, n->in_ndim[0], n->in_shape[0], (uint32_t)n->i[0], n->i[1] != 0);
  if (r) r = kiln_mul_scalar(r, n->s[0]);
  return kiln__give_grad(&gi[0], r, g);
}

kiln_tensor *kiln_mean(kiln_tensor *t, int ndims, const int *dims, bool keepdim) {
  if (!t) return NULL;
  if (!kiln_dtype_is_float(t->dtype))
    KILN__FAIL_NULL(KILN_ERR_DTYPE, "kiln_mean: expected a floating tensor, got %s (shape %s)",
                    kiln_dtype_name(t->dtype), kiln__tshape(t));
  uint32_t mask;
  if (reduce_mask("kiln_mean", t, ndims, dims, &mask) != KILN_OK) return NULL;
  int64_t cnt = reduced_count(t->ndim, t->shape, mask);
  /* 0/0 is NaN, like PyTorch's mean of nothing. */
  double scale = cnt ? 1.0 / (double)cnt : NAN;
  bool ng = kiln__needs_grad(1, &t);
  bool prev = kiln_set_grad_enabled(false);
  kiln_scope_begin();
  /* 16-bit floats: sum in f32 so that a large sum does not overflow f16 before the
  ** division (PyTorch accumulates in f32 too). */
  kiln_tensor *src = is_half(t->dtype) ? kiln_to_dtype(t, KILN_F32) : t;
  kiln_tensor *s = src ? reduce_raw(KILN__K_SUM, src, mask, keepdim, src->dtype) : NULL;
  kiln_tensor *r = s ? kiln_mul_scalar(s, scale) : NULL;
  if (r && r->dtype != t->dtype) r = kiln_to_dtype(r, t->dtype);
  kiln_tensor *out = kiln__scope_return(r);
  kiln_set_grad_enabled(prev);
  if (!out) return NULL;
  if (ng) {
    kiln__node *n = kiln__node_attach(out, "mean", mean_backward, 1, &t);
    if (!n) {
      kiln__discard(out);
      return NULL;
    }
    n->i[0] = (int64_t)mask;
    n->i[1] = keepdim;
    n->s[0] = scale;
  }
  return out;
}

kiln_tensor *kiln_mean_all(kiln_tensor *t) { return kiln_mean(t, 0, NULL, false); }

/* ---- amax / amin -------------------------------------------------------------------- */

/* The gradient goes to every position equal to the extreme, split evenly among ties
** (PyTorch's amax/amin rule): g * (x == m) / count(x == m). */
static kiln_status aext_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  uint32_t mask = (uint32_t)n->i[0];
  bool keepdim = n->i[1] != 0;
  kiln_tensor *x = n->saved[0], *m = n->saved[1];
  int nd = x->ndim;
  int dims[KILN_MAX_DIMS];
  int k = mask_to_dims(mask, nd, dims);
  kiln_tensor *mk = unsqueeze_back(m, nd, mask, keepdim);
  kiln_tensor *gk = unsqueeze_back(g, nd, mask, keepdim);
  kiln_tensor *hit = kiln_to_dtype(kiln_eq(x, mk), g->dtype);
  kiln_tensor *cnt = k ? kiln_sum(hit, k, dims, true) : hit;
  kiln_tensor *r = kiln_mul(hit, kiln_div(gk, cnt));
  if (r && r->dtype != n->in_dtype[0]) r = kiln_to_dtype(r, n->in_dtype[0]);
  return kiln__give_grad(&gi[0], r, g);
}

static kiln_tensor *aext(const char *op, const char *name, kiln__kop kop, kiln_tensor *t, int ndims,
                         const int *dims, bool keepdim) {
  if (!t) return NULL;
  uint32_t mask;
  if (reduce_mask(op, t, ndims, dims, &mask) != KILN_OK) return NULL;
  if (check_nonempty(op, t, mask) != KILN_OK) return NULL;
  kiln_tensor *out = reduce_raw(kop, t, mask, keepdim, t->dtype);
  if (!out) return NULL;
  if (kiln_dtype_is_float(t->dtype) && kiln__needs_grad(1, &t)) {
    kiln__node *n = kiln__node_attach(out, name, aext_backward, 1, &t);
    if (!n) {
      kiln__discard(out);
      return NULL;
    }
    n->i[0] = (int64_t)mask;
    n->i[1] = keepdim;
    kiln__node_save(n, 0, t);
    kiln__node_save_output(n, 1);
  }
  return out;
}

kiln_tensor *kiln_amax(kiln_tensor *t, int ndims, const int *dims, bool keepdim) {
  return aext("kiln_amax", "amax", KILN__K_AMAX, t, ndims, dims, keepdim);
}

kiln_tensor *kiln_amin(kiln_tensor *t, int ndims, const int *dims, bool keepdim) {
  return aext("kiln_amin", "amin", KILN__K_AMIN, t, ndims, dims, keepdim);
}

/* ---- var / std: composed, so autograd comes from the parts ------------------------- */

static kiln_tensor *var_impl(const char *op, kiln_tensor *t, int ndims, const int *dims,
                             int correction, bool keepdim, bool take_sqrt) {
  if (!t) return NULL;
  if (!kiln_dtype_is_float(t->dtype))
    KILN__FAIL_NULL(KILN_ERR_DTYPE, "%s: expected a floating tensor, got %s (shape %s)", op,
                    kiln_dtype_name(t->dtype), kiln__tshape(t));
  uint32_t mask;
  if (reduce_mask(op, t, ndims, dims, &mask) != KILN_OK) return NULL;
  int64_t cnt = reduced_count(t->ndim, t->shape, mask);
  double denom = (double)cnt - (double)correction;
  if (denom < 0) denom = 0; /* PyTorch clamps: the result is inf or NaN */
  int rd[KILN_MAX_DIMS];
  int k = mask_to_dims(mask, t->ndim, rd);
  kiln_scope_begin();
  /* 16-bit floats: compute in f32 (PyTorch does too); the casts are differentiable. */
  kiln_tensor *x = is_half(t->dtype) ? kiln_to_dtype(t, KILN_F32) : t;
  kiln_tensor *r = NULL;
  if (x) {
    kiln_tensor *m = kiln_mean(x, k, k ? rd : NULL, true);
    kiln_tensor *d = kiln_sub(x, m);
    kiln_tensor *s = kiln_sum(kiln_mul(d, d), k, k ? rd : NULL, keepdim);
    r = kiln_mul_scalar(s, denom > 0 ? 1.0 / denom : INFINITY);
    if (take_sqrt) r = kiln_sqrt(r);
    if (r && r->dtype != t->dtype) r = kiln_to_dtype(r, t->dtype);
  }
  return kiln__scope_return(r);
}

kiln_tensor *kiln_var(kiln_tensor *t, int ndims, const int *dims, int correction, bool keepdim) {
  return var_impl("kiln_var", t, ndims, dims, correction, keepdim, false);
}

kiln_tensor *kiln_std(kiln_tensor *t, int ndims, const int *dims, int correction, bool keepdim) {
  return var_impl("kiln_std", t, ndims, dims, correction, keepdim, true);
}

/* ---- max/min along one dim, argmax/argmin ------------------------------------------ */

/* The gradient goes to the position the index names (first on ties, like PyTorch). */
static kiln_status extdim_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  int nd = n->in_ndim[0];
  if (nd == 0) return kiln__give_grad(&gi[0], kiln_contiguous(g), g);
  int d = (int)n->i[0];
  bool keepdim = n->i[1] != 0;
  kiln_tensor *idx = unsqueeze_back(n->saved[0], nd, 1u << d, keepdim);
  kiln_tensor *gk = unsqueeze_back(g, nd, 1u << d, keepdim);
  kiln_tensor *z = kiln_zeros(nd, n->in_shape[0], g->dtype, kiln_device_of(g));
  return kiln__give_grad(&gi[0], kiln_scatter_add(z, d, idx, gk), g);
}

/* Values and i64 indices of the max (min) along dim; both owned by the caller's scope. */
static kiln_tensor *extdim(const char *op, const char *name, kiln__kop kop, kiln_tensor *t,
                           int dim, bool keepdim, kiln_tensor **indices, bool want_values) {
  if (indices) *indices = NULL;
  if (!t) return NULL;
  int d = 0;
  if (t->ndim == 0) {
    if (dim != 0 && dim != -1)
      KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT,
                      "%s: dim %d out of range for a 0-dim tensor (expected 0 or -1)", op, dim);
  } else {
    d = kiln__wrap_dim(op, dim, t->ndim);
    if (d < 0) return NULL;
    if (check_nonempty(op, t, 1u << d) != KILN_OK) return NULL;
  }
  uint32_t mask = t->ndim ? 1u << d : 0u;
  int ond;
  int64_t osh[KILN_MAX_DIMS];
  reduced_shape(t->ndim, t->shape, mask, keepdim, &ond, osh);
  kiln_device dev = kiln_device_of(t);
  kiln_tensor *vals = kiln__tensor_new(ond, osh, t->dtype, dev);
  kiln_tensor *idx = vals ? kiln__tensor_new(ond, osh, KILN_I64, dev) : NULL;
  if (!idx) {
    kiln__discard(vals);
    return NULL;
  }
  if (kiln_numel(vals) > 0) {
    kiln__kargs a = {0};
    a.op = kop;
    a.n_in = 1;
    a.n_out = 2;
    a.in[0] = kiln__view_of(t);
    a.out[0] = keep_view(vals, t->ndim, mask, keepdim);
    a.out[1] = keep_view(idx, t->ndim, mask, keepdim);
    if (t->ndim == 0) { /* kernels see one element along a dim of size 1 */
      kiln__view *vs[3] = {&a.in[0], &a.out[0], &a.out[1]};
      for (int k = 0; k < 3; k++) {
        vs[k]->ndim = 1;
        vs[k]->shape[0] = 1;
        vs[k]->strides[0] = 1;
      }
      mask = 1u;
    }
    a.i[0] = (int64_t)mask;
    a.i[1] = d;
    if (kiln__dispatch(dev, &a) != KILN_OK) {
      kiln__discard(idx);
      kiln__discard(vals);
      return NULL;
    }
  }
  if (want_values && kiln_dtype_is_float(t->dtype) && kiln__needs_grad(1, &t)) {
    kiln__node *n = kiln__node_attach(vals, name, extdim_backward, 1, &t);
    if (!n) {
      kiln__discard(idx);
      kiln__discard(vals);
      return NULL;
    }
    n->i[0] = d;
    n->i[1] = keepdim;
    kiln__node_save(n, 0, idx);
  }
  if (!want_values) {
    kiln__discard(vals);
    return idx;
  }
  if (indices)
    *indices = idx;
  else
    kiln__discard(idx);
  return vals;
}

kiln_tensor *kiln_max_dim(kiln_tensor *t, int dim, bool keepdim, kiln_tensor **indices) {
  return extdim("kiln_max_dim", "max_dim", KILN__K_MAX_DIM, t, dim, keepdim, indices, true);
}

kiln_tensor *kiln_min_dim(kiln_tensor *t, int dim, bool keepdim, kiln_tensor **indices) {
  return extdim("kiln_min_dim", "min_dim", KILN__K_MIN_DIM, t, dim, keepdim, indices, true);
}

kiln_tensor *kiln_argmax(kiln_tensor *t, int dim, bool keepdim) {
  return extdim("kiln_argmax", "argmax", KILN__K_MAX_DIM, t, dim, keepdim, NULL, false);
}

kiln_tensor *kiln_argmin(kiln_tensor *t, int dim, bool keepdim) {
  return extdim("kiln_argmin", "argmin", KILN__K_MIN_DIM, t, dim, keepdim, NULL, false);
}
