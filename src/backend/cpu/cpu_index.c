/*
** Index kernels: INDEX_SELECT, INDEX_ADD, GATHER, SCATTER_ADD along dim i0, with i64 or
** i32 indices. Every index is checked before anything is written, so a bad index leaves
** out0 as it was. The accumulating kernels (INDEX_ADD, SCATTER_ADD) visit the indices in
** order on one thread, because two indices may name the same output; INDEX_ADD still
** parallelizes inside each slice, where no two elements collide.
*/
#include "cpu.h"
#include "cpu_iter.h"

#include <stdint.h>
#include <string.h>

typedef struct kiln__idx_check {
  int64_t size;
  kiln_dtype dt;
  bool bad;
  int64_t bad_value;
} kiln__idx_check;

static void kiln__idx_check_run(void *vctx, char *const *p, const int64_t *bst, int64_t n, int64_t k0) {
  kiln__idx_check *c = (kiln__idx_check *)vctx;
  (void)k0;
  if (c->bad) return;
  for (int64_t i = 0; i < n; i++) {
    int64_t v = c->dt == KILN_I64 ? *(const int64_t *)(p[0] + i * bst[0]) : *(const int32_t *)(p[0] + i * bst[0]);
    if (v < 0 || v >= c->size) {
      c->bad = true;
      c->bad_value = v;
      return;
    }
  }
}

/* KILN_OK when every element of idx is in [0, size); else sets KILN_ERR_INDEX. */
static kiln_status kiln__check_indices(const kiln__kargs *a, const kiln__view *idx, int64_t dim, int64_t size) {
  if (idx->dtype != KILN_I64 && idx->dtype != KILN_I32)
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_%s: index dtype %s is not int64 or int32", kiln__kop_name(a->op),
                          kiln_dtype_name(idx->dtype));
  kiln__idx_check c = {size, idx->dtype, false, 0};
  kiln__view v = *idx;
  int64_t n = kiln__view_numel(&v);
  if (n == 0) return KILN_OK;
  kiln__views_coalesce(&v, 1);
  kiln__cpu_walk(&v, 1, 0, n, kiln__idx_check_run, &c);
  if (c.bad)
    return kiln_set_error(KILN_ERR_INDEX, "kiln_%s: index %lld is out of range for dim %lld of size %lld",
                          kiln__kop_name(a->op), (long long)c.bad_value, (long long)dim, (long long)size);
  return KILN_OK;
}

static int64_t kiln__idx_at(const kiln__view *idx, int64_t k) {
  const char *p = (const char *)idx->data + k * idx->strides[0] * (int64_t)kiln__cpu_esize(idx->dtype);
  return idx->dtype == KILN_I64 ? *(const int64_t *)p : *(const int32_t *)p;
}

/* v with dim d removed, its data moved to position pos along d. */
static kiln__view kiln__slice(const kiln__view *v, int d, int64_t pos) {
  kiln__view s = *v;
  s.data = (char *)v->data + pos * v->strides[d] * (int64_t)kiln__cpu_esize(v->dtype);
  for (int k = d; k < v->ndim - 1; k++) {
    s.shape[k] = v->shape[k + 1];
    s.strides[k] = v->strides[k + 1];
  }
  s.ndim = v->ndim - 1;
  return s;
}

static kiln_status kiln__check_dim(const kiln__kargs *a, int64_t d, const kiln__view *src, const kiln__view *out) {
  if (d < 0 || d >= src->ndim || src->ndim != out->ndim)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_%s: dim %lld invalid for %d dims (out has %d)",
                          kiln__kop_name(a->op), (long long)d, src->ndim, out->ndim);
  return KILN_OK;
}

/* ---- index_select ---- */
typedef struct kiln__isel {
  const kiln__kargs *a;
  int d;
} kiln__isel;

static void kiln__isel_range(void *vctx, int64_t lo, int64_t hi) {
  const kiln__isel *c = (const kiln__isel *)vctx;
  const kiln__kargs *a = c->a;
  for (int64_t k = lo; k < hi; k++) {
    kiln__kargs ca;
    memset(&ca, 0, sizeof ca);
    ca.op = KILN__K_COPY;
    ca.n_in = ca.n_out = 1;
    ca.out[0] = kiln__slice(&a->out[0], c->d, k);
    ca.in[0] = kiln__slice(&a->in[0], c->d, kiln__idx_at(&a->in[1], k));
    kiln__cpu_copy(&ca); /* same dtypes: cannot fail */
  }
}

/* Rows gathered at random from a large source (a data set) wait on memory, not on
** bandwidth: a second thread keeps twice the misses in flight, and halved the loader's
** batch gather (128 rows of 3136 bytes out of 188 MB: 92 -> 49 us on 2 cores). */
#define KILN__CPU_GATHER_PAR_BYTES ((size_t)256 << 10)

/* Whole rows of rb bytes: out row k = src row idx[k] (row strides ss, os in bytes). */
typedef struct kiln__rows {
  const char *sp;
  char *op;
  const kiln__view *idx;
  int64_t ss, os;
  size_t rb;
} kiln__rows;

static void kiln__rows_range(void *vctx, int64_t lo, int64_t hi) {
  const kiln__rows *c = (const kiln__rows *)vctx;
  for (int64_t k = lo; k < hi; k++) memcpy(c->op + k * c->os, c->sp + kiln__idx_at(c->idx, k) * c->ss, c->rb);
}

kiln_status kiln__cpu_index_select(const kiln__kargs *a) {
  const kiln__view *src = &a->in[0], *idx = &a->in[1], *out = &a->out[0];
  int64_t d = a->i[0];
  kiln_status st = kiln__check_dim(a, d, src, out);
  if (st != KILN_OK) return st;
  if (idx->ndim != 1 || out->shape[d] != idx->shape[0])
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_index_select: index must be 1-d with out's size at dim %lld",
                          (long long)d);
  st = kiln__check_indices(a, idx, d, src->shape[d]);
  if (st != KILN_OK) return st;
  int64_t K = idx->shape[0];
  int64_t row = kiln__view_numel(src) / (src->shape[d] ? src->shape[d] : 1);
  /* Fast path (the loader's batch gather): rows along dim 0, each a contiguous block in
  ** src and out of one dtype: one memcpy per row instead of a strided copy per row. */
  if (d == 0 && src->dtype == out->dtype && row > 0) {
    bool dense = true;
    int64_t s = 1;
    for (int k = src->ndim - 1; k >= 1 && dense; k--) {
      if (src->shape[k] != 1 && (src->strides[k] != s || out->strides[k] != s)) dense = false;
      s *= src->shape[k];
    }
    if (dense) {
      size_t es = kiln__cpu_esize(src->dtype), rb = (size_t)row * es;
      const char *sp = src->data;
      char *op = out->data;
      int64_t ss = src->ndim ? src->strides[0] * (int64_t)es : 0, os = out->ndim ? out->strides[0] * (int64_t)es : 0;
      kiln__rows c = {sp, op, idx, ss, os, rb};
      /* min_par in rows: KILN__CPU_GATHER_PAR_BYTES of rows before a second thread */
      kiln__cpu_parallel_for(K, (int64_t)(KILN__CPU_GATHER_PAR_BYTES / rb) + 1, kiln__rows_range, &c);
      return KILN_OK;
    }
  }
  kiln__isel c = {a, (int)d};
  int64_t work = K * row;
  kiln__cpu_parallel_for(K, work < KILN__CPU_PAR_MIN_CHEAP ? INT64_MAX : KILN__CPU_PAR_MIN_CHEAP / (row + 1) + 1,
                         kiln__isel_range, &c);
  return KILN_OK;
}

/* ---- index_add ---- */
kiln_status kiln__cpu_index_add(const kiln__kargs *a) {
  const kiln__view *src = &a->in[0], *idx = &a->in[1], *out = &a->out[0];
  int64_t d = a->i[0];
  kiln_status st = kiln__check_dim(a, d, src, out);
  if (st != KILN_OK) return st;
  if (idx->ndim != 1 || src->shape[d] != idx->shape[0])
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_index_add: index must be 1-d with src's size at dim %lld",
                          (long long)d);
  st = kiln__check_indices(a, idx, d, out->shape[d]);
  if (st != KILN_OK) return st;
  for (int64_t k = 0; k < idx->shape[0]; k++) {
    kiln__kargs ca;
    memset(&ca, 0, sizeof ca);
    ca.op = KILN__K_ADD;
    ca.n_in = 2;
    ca.n_out = 1;
    ca.s[0] = 1;
    ca.out[0] = kiln__slice(out, (int)d, kiln__idx_at(idx, k));
    ca.in[0] = ca.out[0];
    ca.in[1] = kiln__slice(src, (int)d, k);
    st = kiln__cpu_binary(&ca);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

/* ---- gather / scatter_add: one walk over index-shaped views ---- */
typedef struct kiln__gs {
  int64_t dbytes; /* byte stride of the indexed dim in the src (gather) or out (scatter) */
  kiln_dtype idt, vdt;
  size_t es;
} kiln__gs;

/* gather views: [0] out, [1] index, [2] src at index 0 along d */
static void kiln__gather_run(void *vctx, char *const *p, const int64_t *bst, int64_t n, int64_t k0) {
  const kiln__gs *g = (const kiln__gs *)vctx;
  (void)k0;
  for (int64_t i = 0; i < n; i++) {
    const char *ip = p[1] + i * bst[1];
    int64_t k = g->idt == KILN_I64 ? *(const int64_t *)ip : *(const int32_t *)ip;
    memcpy(p[0] + i * bst[0], p[2] + i * bst[2] + k * g->dbytes, g->es);
  }
}

typedef struct kiln__gs_par {
  kiln__gs g;
  kiln__view v[3];
} kiln__gs_par;

static void kiln__gather_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__gs_par *c = (kiln__gs_par *)vctx;
  kiln__cpu_walk(c->v, 3, lo, hi, kiln__gather_run, &c->g);
}

/* scatter views: [0] src, [1] index, [2] out at index 0 along d */
static void kiln__scatter_run(void *vctx, char *const *p, const int64_t *bst, int64_t n, int64_t k0) {
  const kiln__gs *g = (const kiln__gs *)vctx;
  (void)k0;
  for (int64_t i = 0; i < n; i++) {
    const char *ip = p[1] + i * bst[1];
    int64_t k = g->idt == KILN_I64 ? *(const int64_t *)ip : *(const int32_t *)ip;
    char *o = p[2] + i * bst[2] + k * g->dbytes;
    const char *s = p[0] + i * bst[0];
    switch (g->vdt) {
    case KILN_F32:
      *(float *)o += *(const float *)s;
      break;
    case KILN_F64:
      *(double *)o += *(const double *)s;
      break;
    case KILN_F16:
    case KILN_BF16:
      kiln__cpu_set_f64(o, g->vdt, kiln__cpu_get_f64(o, g->vdt) + kiln__cpu_get_f64(s, g->vdt));
      break;
    default:
      kiln__cpu_set_i64(o, g->vdt,
                        (int64_t)((uint64_t)kiln__cpu_get_i64(o, g->vdt) + (uint64_t)kiln__cpu_get_i64(s, g->vdt)));
      break;
    }
  }
}

/* Checks index's shape against the walked tensors: equal to `same`, and at most `other`
** at every dim but d (PyTorch's rule). */
static kiln_status kiln__gs_shapes(const kiln__kargs *a, int64_t d, const kiln__view *idx, const kiln__view *same,
                                   const kiln__view *other) {
  if (idx->ndim != same->ndim || idx->ndim != other->ndim)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_%s: index has %d dims, tensors %d and %d", kiln__kop_name(a->op),
                          idx->ndim, same->ndim, other->ndim);
  for (int e = 0; e < idx->ndim; e++) {
    if (idx->shape[e] != same->shape[e] || (e != d && idx->shape[e] > other->shape[e]))
      return kiln_set_error(KILN_ERR_SHAPE, "kiln_%s: index size %lld at dim %d does not fit (%lld, %lld)",
                            kiln__kop_name(a->op), (long long)idx->shape[e], e, (long long)same->shape[e],
                            (long long)other->shape[e]);
  }
  return KILN_OK;
}

kiln_status kiln__cpu_gather(const kiln__kargs *a) {
  const kiln__view *src = &a->in[0], *idx = &a->in[1], *out = &a->out[0];
  int64_t d = a->i[0];
  kiln_status st = kiln__check_dim(a, d, src, out);
  if (st == KILN_OK) st = kiln__gs_shapes(a, d, idx, out, src);
  if (st == KILN_OK && src->dtype != out->dtype)
    st = kiln_set_error(KILN_ERR_DTYPE, "kiln_gather: src %s and out %s differ", kiln_dtype_name(src->dtype),
                        kiln_dtype_name(out->dtype));
  if (st == KILN_OK) st = kiln__check_indices(a, idx, d, src->shape[d]);
  if (st != KILN_OK) return st;
  int64_t n = kiln__view_numel(out);
  if (n == 0) return KILN_OK;
  kiln__gs_par c;
  c.g.es = kiln__cpu_esize(src->dtype);
  c.g.dbytes = src->strides[d] * (int64_t)c.g.es;
  c.g.idt = idx->dtype;
  c.g.vdt = src->dtype;
  c.v[0] = *out;
  c.v[1] = *idx;
  c.v[2] = *src;
  for (int e = 0; e < out->ndim; e++) c.v[2].shape[e] = out->shape[e];
  c.v[2].strides[d] = 0;
  kiln__views_coalesce(c.v, 3);
  kiln__cpu_parallel_for(n, KILN__CPU_PAR_MIN_CHEAP, kiln__gather_range, &c);
  return KILN_OK;
}

kiln_status kiln__cpu_scatter_add(const kiln__kargs *a) {
  const kiln__view *src = &a->in[0], *idx = &a->in[1], *out = &a->out[0];
  int64_t d = a->i[0];
  kiln_status st = kiln__check_dim(a, d, src, out);
  if (st == KILN_OK) st = kiln__gs_shapes(a, d, idx, src, out);
  if (st == KILN_OK && src->dtype != out->dtype)
    st = kiln_set_error(KILN_ERR_DTYPE, "kiln_scatter_add: src %s and out %s differ", kiln_dtype_name(src->dtype),
                        kiln_dtype_name(out->dtype));
  if (st == KILN_OK) st = kiln__check_indices(a, idx, d, out->shape[d]);
  if (st != KILN_OK) return st;
  int64_t n = kiln__view_numel(src);
  if (n == 0) return KILN_OK;
  kiln__gs g;
  g.es = kiln__cpu_esize(out->dtype);
  g.dbytes = out->strides[d] * (int64_t)g.es;
  g.idt = idx->dtype;
  g.vdt = out->dtype;
  kiln__view v[3] = {*src, *idx, *out};
  for (int e = 0; e < src->ndim; e++) v[2].shape[e] = src->shape[e];
  v[2].strides[d] = 0;
  kiln__views_coalesce(v, 3);
  kiln__cpu_walk(v, 3, 0, n, kiln__scatter_run, &g); /* serial: indices may collide */
  return KILN_OK;
}
