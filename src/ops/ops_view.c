/*
** Views: new handles on the same storage (no copy), each differentiable, each an op on the
** one call path (op.h) that makes its own output (KILN__OP_SELF_ALLOC). infer checks the
** arguments and, for the views that keep the input's offset, leaves the result's shape in
** meta[0] and its strides in scratch (one slot per dim); forward makes the handle. The
** backward of a view that picks elements (narrow, slice, select) scatters the gradient
** into zeros through the same view of a fresh tensor.
*/
#include "ops/op.h"

#include <string.h>

static kiln_tensor *make_view(kiln_tensor *t, int64_t offset, int ndim, const int64_t *shape,
                              const int64_t *strides) {
  return kiln__tensor_make(t->storage, offset, ndim, shape, strides, t->dtype);
}

/* The strides infer computed: scratch has KILN_MAX_DIMS slots. */
static int64_t *scratch_strides(kiln__op_ctx *c) { return (int64_t *)c->scratch; }

/* The forward of every view that keeps t's offset: meta[0] and the strides in scratch. */
static kiln_status strided_forward(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0];
  c->out[0] = make_view(t, t->offset, c->meta[0].ndim, c->meta[0].shape, scratch_strides(c));
  return c->out[0] ? KILN_OK : kiln_last_error();
}

static void meta_view(kiln__op_ctx *c, int ndim, const int64_t *shape) {
  kiln__op_meta(c, 0, ndim, shape, c->in[0]->dtype);
}

/* view, reshape and expand: a shape, held inline in the record (so its length is checked
** when the record is made, before the call). */
typedef struct attrs_shape {
  int64_t shape[KILN_MAX_DIMS];
  int ndim;
} attrs_shape;
static const kiln__attr_field f_size[] = {
    {"size", KILN__A_INTS, offsetof(attrs_shape, shape), offsetof(attrs_shape, ndim), NULL}};
static const kiln__attr_field f_shape[] = {
    {"shape", KILN__A_INTS, offsetof(attrs_shape, shape), offsetof(attrs_shape, ndim), NULL}};

static void shape_record(attrs_shape *r, int ndim, const int64_t *shape) {
  r->ndim = ndim;
  if (ndim > 0) memcpy(r->shape, shape, (size_t)ndim * sizeof(int64_t));
}

/* One int attribute: the dim of squeeze / unsqueeze. */
typedef struct attrs_dim {
  int dim;
} attrs_dim;
static const kiln__attr_field f_dim[] = {KILN__FIELD(attrs_dim, dim, KILN__A_INT32)};

/* ---- view / reshape ---- */
/* Infers one -1 and checks the element count (the dim count and a NULL shape were checked
** when the record was made: view_call). */
static kiln_status infer_shape(const char *op, const kiln_tensor *t, int ndim, const int64_t *shape,
                               int64_t *out) {
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

static kiln_status view_infer(kiln__op_ctx *c) {
  const attrs_shape *r = c->attrs;
  kiln_tensor *t = c->in[0];
  int64_t ns[KILN_MAX_DIMS];
  if (infer_shape("kiln_view", t, r->ndim, r->shape, ns) != KILN_OK) return kiln_last_error();
  if (!view_strides(t, r->ndim, ns, scratch_strides(c)))
    return kiln_set_error(KILN_ERR_SHAPE,
                          "kiln_view: a tensor of shape %s with strides %s cannot be viewed as %s without "
                          "a copy (use kiln_reshape)",
                          kiln__tshape(t), kiln__shape_cstr(t->ndim, t->strides), kiln__shape_cstr(r->ndim, ns));
  meta_view(c, r->ndim, ns);
  return KILN_OK;
}

/* reshape is a view when the strides allow one; otherwise it is contiguous + view, and
** those two ops record the nodes (as PyTorch's reshape does): infer clears differentiable
** for exactly that case, which is how forward tells the two apart. */
static kiln_status reshape_infer(kiln__op_ctx *c) {
  const attrs_shape *r = c->attrs;
  kiln_tensor *t = c->in[0];
  int64_t ns[KILN_MAX_DIMS];
  if (infer_shape("kiln_reshape", t, r->ndim, r->shape, ns) != KILN_OK) return kiln_last_error();
  c->differentiable = view_strides(t, r->ndim, ns, scratch_strides(c));
  meta_view(c, r->ndim, ns);
  return KILN_OK;
}

static kiln_status reshape_forward(kiln__op_ctx *c) {
  if (c->differentiable) return strided_forward(c);
  kiln_tensor *ct = kiln_contiguous(c->in[0]);
  c->out[0] = ct ? kiln_view(ct, c->meta[0].ndim, c->meta[0].shape) : NULL;
  return c->out[0] ? KILN_OK : kiln_last_error();
}

/* VIEW_OP(c name, op name, save, field table, count, record size, infer, forward, rule):
** the public function is kiln_<c name>. No view saves a tensor. */
#define VIEW_OP(fname, opname, sv, fields, nfields, asz, inf, fwd, bw)                         \
  static const kiln__op op_##fname = {                                                        \
      .name = opname, .api = "kiln_" #fname, .n_in = 1, .n_out = 1,                           \
      .flags = KILN__OP_SELF_ALLOC, .attrs = fields, .n_attrs = nfields, .attr_size = asz,    \
      .infer = inf, .forward = fwd, .backward = bw, .save = sv};

VIEW_OP(view, "view", NULL, f_size, 1, sizeof(attrs_shape), view_infer, strided_forward, view_backward)
VIEW_OP(reshape, "reshape", NULL, f_shape, 1, sizeof(attrs_shape), reshape_infer, reshape_forward,
        view_backward)

/* The record holds the shape inline: its length and pointer are checked as it is made (a
** NULL t passes through the call before the record is read). */
static kiln_tensor *view_call(const kiln__op *op, kiln_tensor *t, int ndim, const int64_t *shape) {
  attrs_shape r;
  r.ndim = 0;
  if (t) {
    if (ndim < 0 || ndim > KILN_MAX_DIMS)
      KILN__FAIL_NULL(KILN_ERR_SHAPE, "%s: %d dims requested; kiln tensors have 0 to %d", op->api, ndim,
                      KILN_MAX_DIMS);
    if (ndim > 0 && !shape) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "%s: shape is NULL", op->api);
    shape_record(&r, ndim, shape);
  }
  return kiln__op_call(op, 1, &t, &r, NULL);
}

kiln_tensor *kiln_view(kiln_tensor *t, int ndim, const int64_t *shape) { return view_call(&op_view, t, ndim, shape); }

kiln_tensor *kiln_reshape(kiln_tensor *t, int ndim, const int64_t *shape) {
  return view_call(&op_reshape, t, ndim, shape);
}

/* flatten: a composite of reshape. */
typedef struct attrs_flatten {
  int start_dim, end_dim;
} attrs_flatten;
static const kiln__attr_field f_flatten[] = {KILN__FIELD(attrs_flatten, start_dim, KILN__A_INT32),
                                             KILN__FIELD(attrs_flatten, end_dim, KILN__A_INT32)};

static kiln_status flatten_infer(kiln__op_ctx *c) {
  const attrs_flatten *p = c->attrs;
  kiln_tensor *t = c->in[0];
  if (t->ndim == 0) return KILN_OK; /* any dims: a 0-dim tensor flattens to [1] */
  int s = kiln__wrap_dim("kiln_flatten", p->start_dim, t->ndim);
  int e = kiln__wrap_dim("kiln_flatten", p->end_dim, t->ndim);
  if (s < 0 || e < 0) return kiln_last_error();
  if (s > e)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_flatten: start_dim %d is after end_dim %d",
                          p->start_dim, p->end_dim);
  c->scratch[0] = (uint64_t)s;
  c->scratch[1] = (uint64_t)e;
  return KILN_OK;
}

static kiln_status flatten_forward(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0];
  if (t->ndim == 0) {
    c->out[0] = kiln_reshape(t, KILN_SHAPE(1));
  } else {
    int s = (int)c->scratch[0], e = (int)c->scratch[1];
    int64_t ns[KILN_MAX_DIMS];
    int nd = 0;
    for (int i = 0; i < s; i++) ns[nd++] = t->shape[i];
    int64_t m = 1;
    for (int i = s; i <= e; i++) m *= t->shape[i];
    ns[nd++] = m;
    for (int i = e + 1; i < t->ndim; i++) ns[nd++] = t->shape[i];
    c->out[0] = kiln_reshape(t, nd, ns);
  }
  return c->out[0] ? KILN_OK : kiln_last_error();
}

static const kiln__op op_flatten = {
    .name = "flatten", .api = "kiln_flatten", .n_in = 1, .n_out = 1, .flags = KILN__OP_COMPOSITE,
    .attrs = f_flatten, .n_attrs = 2, .attr_size = sizeof(attrs_flatten), .infer = flatten_infer,
    .forward = flatten_forward};

kiln_tensor *kiln_flatten(kiln_tensor *t, int start_dim, int end_dim) {
  return kiln__op_call(&op_flatten, 1, &t, &(attrs_flatten){start_dim, end_dim}, NULL);
}

/* ---- permute / transpose ---- */
/* permute's dims, as given (the rule wraps them again), held inline like a shape. */
typedef struct attrs_dims {
  int64_t dims[KILN_MAX_DIMS];
  int ndim;
} attrs_dims;
static const kiln__attr_field f_dims[] = {KILN__FIELD_INTS(attrs_dims, dims, ndim)};

static kiln_status permute_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  const attrs_dims *p = n->attrs;
  int inv[KILN_MAX_DIMS];
  for (int i = 0; i < n->out_ndim; i++) {
    int d = (int)p->dims[i];
    inv[d < 0 ? d + n->out_ndim : d] = i;
  }
  gi[0] = kiln_keep(kiln_permute(g, n->out_ndim, inv));
  return gi[0] ? KILN_OK : kiln_last_error();
}

static kiln_status permute_infer(kiln__op_ctx *c) {
  const attrs_dims *p = c->attrs;
  kiln_tensor *t = c->in[0];
  int ndim = p->ndim;
  int64_t ns[KILN_MAX_DIMS], *st = scratch_strides(c);
  bool seen[KILN_MAX_DIMS] = {false};
  for (int i = 0; i < ndim; i++) {
    int d = kiln__wrap_dim("kiln_permute", (int)p->dims[i], ndim);
    if (d < 0) return kiln_last_error();
    if (seen[d]) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_permute: dim %d repeated", (int)p->dims[i]);
    seen[d] = true;
    ns[i] = t->shape[d];
    st[i] = t->strides[d];
  }
  meta_view(c, ndim, ns);
  return KILN_OK;
}

VIEW_OP(permute, "permute", NULL, f_dims, 1, sizeof(attrs_dims), permute_infer, strided_forward,
        permute_backward)

/* The record holds the dims inline: their count must be t's ndim before it is made. */
kiln_tensor *kiln_permute(kiln_tensor *t, int ndim, const int *dims) {
  attrs_dims r;
  r.ndim = 0;
  if (t) {
    if (ndim != t->ndim || (ndim > 0 && !dims))
      KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_permute: %d dims given for a tensor of %d dims (%s)",
                      ndim, t->ndim, kiln__tshape(t));
    r.ndim = ndim;
    for (int i = 0; i < ndim; i++) r.dims[i] = dims[i];
  }
  return kiln__op_call(&op_permute, 1, &t, &r, NULL);
}

/* transpose: a permute that swaps two dims, recorded as itself (its rule swaps them
** back). */
typedef struct attrs_transpose {
  int dim0, dim1;
} attrs_transpose;
static const kiln__attr_field f_transpose[] = {KILN__FIELD(attrs_transpose, dim0, KILN__A_INT32),
                                               KILN__FIELD(attrs_transpose, dim1, KILN__A_INT32)};

static kiln_status transpose_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  const attrs_transpose *p = n->attrs;
  gi[0] = kiln_keep(kiln_transpose(g, p->dim0, p->dim1));
  return gi[0] ? KILN_OK : kiln_last_error();
}

static kiln_status transpose_infer(kiln__op_ctx *c) {
  const attrs_transpose *p = c->attrs;
  kiln_tensor *t = c->in[0];
  int a = kiln__wrap_dim("kiln_transpose", p->dim0, t->ndim);
  int b = kiln__wrap_dim("kiln_transpose", p->dim1, t->ndim);
  if (a < 0 || b < 0) return kiln_last_error();
  int64_t ns[KILN_MAX_DIMS], *st = scratch_strides(c);
  for (int i = 0; i < t->ndim; i++) {
    int d = i == a ? b : i == b ? a : i;
    ns[i] = t->shape[d];
    st[i] = t->strides[d];
  }
  meta_view(c, t->ndim, ns);
  return KILN_OK;
}

VIEW_OP(transpose, "transpose", NULL, f_transpose, 2, sizeof(attrs_transpose), transpose_infer,
        strided_forward, transpose_backward)

kiln_tensor *kiln_transpose(kiln_tensor *t, int dim0, int dim1) {
  /* 0-d and 1-d with dims 0 / -1: nothing to swap, t itself (a new reference), as kiln
  ** has always returned; not an op (whether PyTorch gives the input or an alias here is
  ** for the lead to settle: see the conversion report). */
  if (t && t->ndim < 2 && (dim0 == 0 || dim0 == -1) && (dim1 == 0 || dim1 == -1))
    return kiln__scope_track(kiln_tensor_ref(t));
  return kiln__op_call(&op_transpose, 1, &t, &(attrs_transpose){dim0, dim1}, NULL);
}

/* ---- narrow / slice / select: strided picks ---- */
enum { PICK_SLICE = 0, PICK_SELECT = 1 };

/* t's elements start, start+step, ... (len of them) along d; select drops d. */
static kiln_tensor *pick_make(kiln_tensor *t, int kind, int d, int64_t start, int64_t len, int64_t step) {
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
  return make_view(t, off, nd, ns, st);
}

/* infer leaves the normalised pick in scratch: kind, wrapped dim, start, length, step. */
static void pick_set(kiln__op_ctx *c, int kind, int d, int64_t start, int64_t len, int64_t step) {
  c->scratch[0] = (uint64_t)kind;
  c->scratch[1] = (uint64_t)d;
  c->scratch[2] = (uint64_t)start;
  c->scratch[3] = (uint64_t)len;
  c->scratch[4] = (uint64_t)step;
}

static kiln_status pick_forward(kiln__op_ctx *c) {
  const int64_t *p = (const int64_t *)c->scratch;
  c->out[0] = pick_make(c->in[0], (int)p[0], (int)p[1], p[2], p[3], p[4]);
  return c->out[0] ? KILN_OK : kiln_last_error();
}

/* The normalised pick, for the rule: bookkeeping in n->i[0..4] (the records hold the
** arguments as given, before negative starts wrap and slices clamp). */
static void pick_save(kiln__op_ctx *c, kiln__node *n) {
  for (int k = 0; k < 5; k++) n->i[k] = (int64_t)c->scratch[k];
}

static kiln_status pick_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *z = kiln_zeros(n->in_ndim[0], n->in_shape[0], n->in_dtype[0], n->out_device);
  if (!z) return kiln_last_error();
  kiln_tensor *v = pick_make(z, (int)n->i[0], (int)n->i[1], n->i[2], n->i[3], n->i[4]);
  if (!v || kiln_copy_(v, g) != KILN_OK) return kiln_last_error();
  gi[0] = kiln_keep(z);
  return KILN_OK;
}

typedef struct attrs_narrow {
  int dim;
  int64_t start, length;
} attrs_narrow;
static const kiln__attr_field f_narrow[] = {KILN__FIELD(attrs_narrow, dim, KILN__A_INT32),
                                            KILN__FIELD(attrs_narrow, start, KILN__A_INT),
                                            KILN__FIELD(attrs_narrow, length, KILN__A_INT)};

static kiln_status narrow_infer(kiln__op_ctx *c) {
  const attrs_narrow *p = c->attrs;
  kiln_tensor *t = c->in[0];
  if (t->ndim == 0) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_narrow: cannot narrow a 0-dim tensor");
  int d = kiln__wrap_dim("kiln_narrow", p->dim, t->ndim);
  if (d < 0) return kiln_last_error();
  int64_t size = t->shape[d], start = p->start, length = p->length;
  if (start < 0) start += size;
  if (start < 0 || length < 0 || start > size || length > size - start)
    return kiln_set_error(KILN_ERR_INDEX, "kiln_narrow: range [%lld, %lld) is outside dim %d of size %lld (%s)",
                          (long long)start, (long long)(start + length), p->dim, (long long)size,
                          kiln__tshape(t));
  pick_set(c, PICK_SLICE, d, start, length, 1);
  return KILN_OK;
}

typedef struct attrs_slice {
  int dim;
  int64_t start, end, step;
} attrs_slice;
static const kiln__attr_field f_slice[] = {
    KILN__FIELD(attrs_slice, dim, KILN__A_INT32), KILN__FIELD(attrs_slice, start, KILN__A_INT),
    KILN__FIELD(attrs_slice, end, KILN__A_INT), KILN__FIELD(attrs_slice, step, KILN__A_INT)};

static kiln_status slice_infer(kiln__op_ctx *c) {
  const attrs_slice *p = c->attrs;
  kiln_tensor *t = c->in[0];
  if (t->ndim == 0) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_slice: cannot slice a 0-dim tensor");
  int d = kiln__wrap_dim("kiln_slice", p->dim, t->ndim);
  if (d < 0) return kiln_last_error();
  int64_t step = p->step;
  if (step <= 0)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_slice: step must be positive, got %lld", (long long)step);
  int64_t size = t->shape[d], start = p->start, end = p->end;
  if (start < 0) start += size;
  if (end < 0) end += size;
  if (start < 0) start = 0;
  if (start > size) start = size;
  if (end > size) end = size;
  if (end < start) end = start;
  pick_set(c, PICK_SLICE, d, start, (end - start + step - 1) / step, step);
  return KILN_OK;
}

typedef struct attrs_select {
  int dim;
  int64_t index;
} attrs_select;
static const kiln__attr_field f_select[] = {KILN__FIELD(attrs_select, dim, KILN__A_INT32),
                                            KILN__FIELD(attrs_select, index, KILN__A_INT)};

static kiln_status select_infer(kiln__op_ctx *c) {
  const attrs_select *p = c->attrs;
  kiln_tensor *t = c->in[0];
  if (t->ndim == 0) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_select: cannot index a 0-dim tensor");
  int d = kiln__wrap_dim("kiln_select", p->dim, t->ndim);
  if (d < 0) return kiln_last_error();
  int64_t size = t->shape[d], index = p->index;
  if (index < -size || index >= size)
    return kiln_set_error(KILN_ERR_INDEX, "kiln_select: index %lld is out of range for dim %d of size %lld",
                          (long long)index, p->dim, (long long)size);
  if (index < 0) index += size;
  pick_set(c, PICK_SELECT, d, index, 1, 1);
  return KILN_OK;
}

VIEW_OP(narrow, "narrow", pick_save, f_narrow, 3, sizeof(attrs_narrow), narrow_infer, pick_forward,
        pick_backward)
VIEW_OP(slice, "slice", pick_save, f_slice, 4, sizeof(attrs_slice), slice_infer, pick_forward, pick_backward)
VIEW_OP(select, "select", pick_save, f_select, 2, sizeof(attrs_select), select_infer, pick_forward,
        pick_backward)

kiln_tensor *kiln_narrow(kiln_tensor *t, int dim, int64_t start, int64_t length) {
  return kiln__op_call(&op_narrow, 1, &t, &(attrs_narrow){dim, start, length}, NULL);
}

kiln_tensor *kiln_slice(kiln_tensor *t, int dim, int64_t start, int64_t end, int64_t step) {
  return kiln__op_call(&op_slice, 1, &t, &(attrs_slice){dim, start, end, step}, NULL);
}

kiln_tensor *kiln_select(kiln_tensor *t, int dim, int64_t index) {
  return kiln__op_call(&op_select, 1, &t, &(attrs_select){dim, index}, NULL);
}

/* ---- expand ---- */
static kiln_status expand_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  gi[0] = kiln_keep(kiln__unbroadcast(g, n->in_ndim[0], n->in_shape[0]));
  return gi[0] ? KILN_OK : kiln_last_error();
}

static kiln_status expand_infer(kiln__op_ctx *c) {
  const attrs_shape *r = c->attrs;
  kiln_tensor *t = c->in[0];
  int ndim = r->ndim;
  const int64_t *shape = r->shape;
  int64_t ns[KILN_MAX_DIMS], *st = scratch_strides(c);
  int lead = ndim - t->ndim;
  for (int i = 0; i < ndim; i++) {
    int j = i - lead;
    int64_t want = shape[i];
    if (j < 0) {
      if (want < 0)
        return kiln_set_error(KILN_ERR_SHAPE, "kiln_expand: -1 is not allowed for a new leading dim (%s)",
                              kiln__shape_cstr(ndim, shape));
      ns[i] = want;
      st[i] = 0;
    } else if (want == -1 || want == t->shape[j]) {
      ns[i] = t->shape[j];
      st[i] = t->strides[j];
    } else if (t->shape[j] == 1 && want >= 0) {
      ns[i] = want;
      st[i] = 0;
    } else {
      return kiln_set_error(KILN_ERR_SHAPE, "kiln_expand: cannot expand %s to %s (dim %d has size %lld, not 1)",
                            kiln__tshape(t), kiln__shape_cstr(ndim, shape), j, (long long)t->shape[j]);
    }
  }
  meta_view(c, ndim, ns);
  return KILN_OK;
}

VIEW_OP(expand, "expand", NULL, f_size, 1, sizeof(attrs_shape), expand_infer, strided_forward,
        expand_backward)

/* The record holds the shape inline: its length is checked as it is made. */
kiln_tensor *kiln_expand(kiln_tensor *t, int ndim, const int64_t *shape) {
  attrs_shape r;
  r.ndim = 0;
  if (t) {
    if (ndim < t->ndim || ndim > KILN_MAX_DIMS || (ndim > 0 && !shape))
      KILN__FAIL_NULL(KILN_ERR_SHAPE, "kiln_expand: cannot expand %s to %d dims", kiln__tshape(t), ndim);
    shape_record(&r, ndim, shape);
  }
  return kiln__op_call(&op_expand, 1, &t, &r, NULL);
}

/* ---- squeeze / unsqueeze ---- */
static kiln_status squeeze_infer(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0];
  int dim = ((const attrs_dim *)c->attrs)->dim;
  int d = kiln__wrap_dim("kiln_squeeze", dim, t->ndim);
  if (d < 0) return kiln_last_error();
  if (t->shape[d] != 1)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_squeeze: dim %d of %s has size %lld, not 1", dim, kiln__tshape(t),
                          (long long)t->shape[d]);
  int64_t ns[KILN_MAX_DIMS], *st = scratch_strides(c);
  int nd = 0;
  for (int i = 0; i < t->ndim; i++)
    if (i != d) {
      ns[nd] = t->shape[i];
      st[nd++] = t->strides[i];
    }
  meta_view(c, nd, ns);
  return KILN_OK;
}

static kiln_status squeeze_all_infer(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0];
  int64_t ns[KILN_MAX_DIMS], *st = scratch_strides(c);
  int nd = 0;
  for (int i = 0; i < t->ndim; i++)
    if (t->shape[i] != 1) {
      ns[nd] = t->shape[i];
      st[nd++] = t->strides[i];
    }
  meta_view(c, nd, ns);
  return KILN_OK;
}

static kiln_status unsqueeze_infer(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0];
  if (t->ndim >= KILN_MAX_DIMS)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_unsqueeze: %s already has %d dims", kiln__tshape(t), KILN_MAX_DIMS);
  int d = kiln__wrap_dim("kiln_unsqueeze", ((const attrs_dim *)c->attrs)->dim, t->ndim + 1);
  if (d < 0) return kiln_last_error();
  int64_t ns[KILN_MAX_DIMS], *st = scratch_strides(c);
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
  meta_view(c, nd, ns);
  return KILN_OK;
}

/* squeeze(dim) and squeeze() are one op in traces ("squeeze"), as in PyTorch. */
VIEW_OP(squeeze, "squeeze", NULL, f_dim, 1, sizeof(attrs_dim), squeeze_infer, strided_forward, view_backward)
VIEW_OP(squeeze_all, "squeeze", NULL, NULL, 0, 0, squeeze_all_infer, strided_forward, view_backward)
VIEW_OP(unsqueeze, "unsqueeze", NULL, f_dim, 1, sizeof(attrs_dim), unsqueeze_infer, strided_forward,
        view_backward)

kiln_tensor *kiln_squeeze(kiln_tensor *t, int dim) {
  /* A 0-dim tensor has nothing to squeeze: t itself (a new reference), whatever dim, as
  ** kiln has always returned; not an op (see transpose). */
  if (t && t->ndim == 0) return kiln__scope_track(kiln_tensor_ref(t));
  return kiln__op_call(&op_squeeze, 1, &t, &(attrs_dim){dim}, NULL);
}

kiln_tensor *kiln_squeeze_all(kiln_tensor *t) { return kiln__op_call(&op_squeeze_all, 1, &t, NULL, NULL); }

kiln_tensor *kiln_unsqueeze(kiln_tensor *t, int dim) {
  return kiln__op_call(&op_unsqueeze, 1, &t, &(attrs_dim){dim}, NULL);
}
