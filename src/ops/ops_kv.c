/*
** The two ops a decode step with a KV cache needs so that its shapes stay fixed for a whole
** generation (and the step can be captured once as a device graph, kiln_graph_capture):
**
** - index_copy_ (torch.Tensor.index_copy_): writes the new keys and values into the cache
**   at positions held in a device tensor (kernel INDEX_COPY), in place of a where() over
**   the whole cache;
** - kv_attention: attention of the new queries over the cache, with each row's valid
**   length read on the device (kernel KV_ATTENTION): the slots past it are neither read nor
**   masked, so a step costs what its prefix costs, not max_len.
**
** Both are inference-only (no backward) and never host-synchronising: a bad position is a
** device index error on CUDA (kc_flag, reported at the next synchronize), KILN_ERR_INDEX at
** once on the CPU.
*/
#include "ops/op.h"

#include <math.h>
#include <string.h>

/* A device other than the CPU (whose kernels are the references) without the kernel at
** all: there the ops compose other ops on the device instead of taking the CPU fallback,
** which would copy the whole cache to the host every step. */
static bool lacks_kernel(kiln_device dev, kiln__kop op) {
  return dev.type != KILN_DEVICE_CPU && !kiln__dispatch_has(dev, NULL, op);
}

/* ---- index_copy_ ---------------------------------------------------------------------- */

typedef struct attrs_index_copy {
  int64_t dim;
} attrs_index_copy;
static const kiln__attr_field f_index_copy[] = {KILN__FIELD(attrs_index_copy, dim, KILN__A_INT)};

static kiln_status index_copy__infer(kiln__op_ctx *c) {
  const attrs_index_copy *p = c->attrs;
  const char *op = c->op->api;
  kiln_tensor *dst = c->in[0], *index = c->in[1], *src = c->in[2];
  if (dst->requires_grad && kiln_grad_enabled())
    return kiln_set_error(KILN_ERR_AUTOGRAD,
                          "%s: in-place update of a tensor that requires grad while grad mode is on "
                          "(wrap it in kiln_set_grad_enabled(false))", op);
  const int64_t d = p->dim;
  if (d < 0 || d >= dst->ndim)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: dim %lld is out of range for destination %s", op,
                          (long long)d, kiln__tshape(dst));
  if (src->dtype != dst->dtype)
    return kiln_set_error(KILN_ERR_DTYPE, "%s: source is %s but destination is %s", op, kiln_dtype_name(src->dtype),
                          kiln_dtype_name(dst->dtype));
  if (index->dtype != KILN_I64)
    return kiln_set_error(KILN_ERR_DTYPE, "%s: index must be i64, got %s", op, kiln_dtype_name(index->dtype));
  bool shape_ok = src->ndim == dst->ndim;
  for (int i = 0; shape_ok && i < dst->ndim; i++)
    if (i != d && src->shape[i] != dst->shape[i]) shape_ok = false;
  if (!shape_ok)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: source %s must have destination %s's shape but along dim %lld", op,
                          kiln__tshape(src), kiln__tshape(dst), (long long)d);
  if (index->ndim > 1 || kiln_numel(index) != src->shape[d])
    return kiln_set_error(KILN_ERR_SHAPE, "%s: index %s must be 1-d with source %s's size along dim %lld (%lld)", op,
                          kiln__tshape(index), kiln__tshape(src), (long long)d, (long long)src->shape[d]);
  return KILN_OK;
}

/* A 0-d or 1-d tensor of n elements as a 1-d view. */
static kiln__view as_1d(const kiln_tensor *t) {
  kiln__view v = kiln__view_of(t);
  if (v.ndim == 0) v.ndim = 1, v.shape[0] = 1, v.strides[0] = 0;
  return v;
}

static kiln_status index_copy__forward(kiln__op_ctx *c) {
  const attrs_index_copy *p = c->attrs;
  kiln_tensor *dst = c->in[0], *index = c->in[1], *src = c->in[2];
  if (kiln_numel(src) == 0) return KILN_OK;
  kiln__kargs k = {0};
  k.op = KILN__K_INDEX_COPY;
  k.n_in = 2;
  k.in[0] = kiln__view_of(src);
  k.in[1] = as_1d(index);
  k.i[0] = p->dim;
  return kiln__run_into(dst, &k);
}

static const kiln__op op_index_copy_ = {
    .name = "index_copy_", .api = "kiln_index_copy_", .n_in = 3, .n_out = 1,
    .flags = KILN__OP_INPLACE | KILN__OP_NO_GRAD, .n_kernels = 1, .kernels = {KILN__K_INDEX_COPY},
    .attrs = f_index_copy, .n_attrs = 1, .attr_size = sizeof(attrs_index_copy),
    .infer = index_copy__infer, .forward = index_copy__forward};

kiln_status kiln_index_copy_(kiln_tensor *dst, int dim, kiln_tensor *index, kiln_tensor *src) {
  static const char who[] = "kiln_index_copy_";
  if (!dst || !index || !src) {
    if (kiln_last_error() != KILN_OK) return kiln_last_error();
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL %s", who, !dst ? "destination" : !index ? "index" : "source");
  }
  attrs_index_copy p = {dim < 0 ? dim + dst->ndim : dim};
  kiln_tensor *in[3] = {dst, index, src};
  kiln_device dev = kiln_device_of(dst);
  if (kiln_numel(index) == 1 && p.dim >= 0 && p.dim < dst->ndim && lacks_kernel(dev, KILN__K_INDEX_COPY)) {
    /* one position, on a device without the kernel (Vulkan): where(slot == index) over dst,
    ** in the device's own kernels rather than through the CPU */
    if (index_copy__infer(&(kiln__op_ctx){.op = &op_index_copy_, .attrs = &p, .n_in = 3, .in = in}) != KILN_OK)
      return kiln_last_error();
    kiln_scope_begin();
    int64_t shape[KILN_MAX_DIMS];
    for (int i = 0; i < dst->ndim; i++) shape[i] = i == p.dim ? dst->shape[i] : 1;
    kiln_tensor *slot = kiln_arange(0, (double)dst->shape[p.dim], 1, KILN_I64, dev);
    kiln_tensor *mask = kiln_eq(kiln_reshape(slot, dst->ndim, shape), kiln_reshape(index, KILN_SHAPE(1)));
    kiln_status st = mask ? kiln_copy_(dst, kiln_where(mask, src, dst)) : kiln_last_error();
    kiln_scope_end();
    return st;
  }
  return kiln__op_call_status(&op_index_copy_, 3, in, &p);
}

/* ---- kv_attention --------------------------------------------------------------------- */

typedef struct attrs_kv_attention {
  double scale; /* 0: 1 / sqrt(D) */
} attrs_kv_attention;
static const kiln__attr_field f_kv_attention[] = {KILN__FIELD(attrs_kv_attention, scale, KILN__A_FLOAT)};

static kiln_status kv_attention_infer(kiln__op_ctx *c) {
  const attrs_kv_attention *p = c->attrs;
  const char *op = c->op->api;
  kiln_tensor *q = c->in[0], *k = c->in[1], *v = c->in[2], *len = c->in[3];
  /* q (B, H, Tq, D), k (B, H, M, D), v (B, H, M, Dv) */
  if (kiln__attention_check(op, c->in, p->scale) != KILN_OK) return kiln_last_error();
  static const char *const names[] = {"q", "k", "v"};
  for (int i = 0; i < 3; i++)
    if (c->in[i]->requires_grad && kiln_grad_enabled())
      return kiln_set_error(KILN_ERR_AUTOGRAD, "%s: inference only (no gradient); %s requires grad while grad mode "
                            "is on", op, names[i]);
  if (q->shape[2] > k->shape[2])
    return kiln_set_error(KILN_ERR_SHAPE, "%s: %lld queries do not fit a cache of %lld slots (q %s, k %s)", op,
                          (long long)q->shape[2], (long long)k->shape[2], kiln__tshape(q), kiln__tshape(k));
  if (len->dtype != KILN_I64)
    return kiln_set_error(KILN_ERR_DTYPE, "%s: len must be i64, got %s", op, kiln_dtype_name(len->dtype));
  int64_t nl = kiln_numel(len);
  if (len->ndim > 1 || (nl != 1 && nl != q->shape[0]))
    return kiln_set_error(KILN_ERR_SHAPE, "%s: len %s must hold 1 or B = %lld lengths", op, kiln__tshape(len),
                          (long long)q->shape[0]);
  int64_t oshape[4] = {q->shape[0], q->shape[1], q->shape[2], v->shape[3]};
  kiln__op_meta(c, 0, 4, oshape, q->dtype);
  c->differentiable = false;
  return KILN_OK;
}

static kiln_status kv_attention_forward(kiln__op_ctx *c) {
  const attrs_kv_attention *p = c->attrs;
  kiln_tensor *q = c->in[0], *k = c->in[1], *v = c->in[2], *len = c->in[3];
  if (kiln_numel(c->out[0]) == 0) return KILN_OK;
  kiln__kargs a = {0};
  a.op = KILN__K_KV_ATTENTION;
  a.n_in = 4;
  a.in[0] = kiln__view_of(q);
  a.in[1] = kiln__view_of(k);
  a.in[2] = kiln__view_of(v);
  a.in[3] = as_1d(len);
  a.i[0] = kiln_numel(len);
  a.s[0] = kiln__attention_scale(p->scale, q->shape[3]);
  return kiln__run_into(c->out[0], &a);
}

static const kiln__op op_kv_attention = {
    .name = "kv_attention", .api = "kiln_kv_attention", .n_in = 4, .n_out = 1, .amp = KILN__AMP_LOWER,
    .flags = KILN__OP_NO_GRAD, .n_kernels = 1, .kernels = {KILN__K_KV_ATTENTION},
    .attrs = f_kv_attention, .n_attrs = 1, .attr_size = sizeof(attrs_kv_attention),
    .infer = kv_attention_infer, .forward = kv_attention_forward};

kiln_tensor *kiln_kv_attention(kiln_tensor *q, kiln_tensor *k, kiln_tensor *v, kiln_tensor *len, double scale) {
  attrs_kv_attention p = {scale};
  kiln_tensor *in[4] = {q, k, v, len};
  if (q && k && v && len && lacks_kernel(kiln_device_of(q), KILN__K_KV_ATTENTION)) {
    /* the same attention as a boolean mask, key j visible to query i of row b when
    ** j <= len[b] - Tq + i: (n, 1, Tq, M), n = 1 or B */
    kiln__op_ctx c = {.op = &op_kv_attention, .attrs = &p, .n_in = 4, .in = in};
    if (kv_attention_infer(&c) != KILN_OK) return NULL;
    const int64_t Tq = q->shape[2], M = k->shape[2], n = kiln_numel(len);
    kiln_device dev = kiln_device_of(q);
    kiln_tensor *last = kiln_add(kiln_reshape(len, KILN_SHAPE(n, 1, 1, 1)),
                                 kiln_reshape(kiln_arange((double)-Tq, 0, 1, KILN_I64, dev), KILN_SHAPE(1, 1, Tq, 1)));
    kiln_tensor *mask = kiln_le(kiln_arange(0, (double)M, 1, KILN_I64, dev), last);
    return mask ? kiln_scaled_dot_product_attention(q, k, v, mask, false, 0.0, scale, NULL) : NULL;
  }
  return kiln__op_call(&op_kv_attention, 4, in, &p, NULL);
}

/* ---- kv_attention_append ---------------------------------------------------------------- */

/* kv_attention's kernel with the append flag: inputs q, k, v, len, kv_new (k and v the
** cache's halves); outputs the attention and, declared as written, k and v. */
static kiln_status kv_append_forward(kiln__op_ctx *c) {
  const attrs_kv_attention *p = c->attrs;
  kiln_tensor *q = c->in[0];
  kiln__kargs a = {0};
  a.op = KILN__K_KV_ATTENTION;
  a.n_in = 5;
  for (int i = 0; i < 5; i++) a.in[i] = i == 3 ? as_1d(c->in[3]) : kiln__view_of(c->in[i]);
  a.i[0] = kiln_numel(c->in[3]);
  a.i[1] = 1;
  a.s[0] = kiln__attention_scale(p->scale, q->shape[3]);
  a.n_out = 3;
  a.out[1] = kiln__view_of(c->in[1]);
  a.out[2] = kiln__view_of(c->in[2]);
  return kiln__run_into(c->out[0], &a);
}

static const kiln__op op_kv_attention_append = {
    .name = "kv_attention_append", .api = "kiln_kv_attention_append", .n_in = 5, .n_out = 1,
    .amp = KILN__AMP_NONE, /* writes the cache in place: a cast would write a copy */ .flags = KILN__OP_NO_GRAD, .n_kernels = 1, .kernels = {KILN__K_KV_ATTENTION},
    .attrs = f_kv_attention, .n_attrs = 1, .attr_size = sizeof(attrs_kv_attention),
    .infer = kv_attention_infer, .forward = kv_append_forward};

kiln_tensor *kiln_kv_attention_append(kiln_tensor *q, kiln_tensor *cache, kiln_tensor *kv_new, kiln_tensor *len,
                                      double scale) {
  static const char who[] = "kiln_kv_attention_append";
  if (!q || !cache || !kv_new || !len) {
    if (kiln_last_error() == KILN_OK)
      kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL %s", who, !q ? "q" : !cache ? "cache" : !kv_new ? "kv_new" : "len");
    return NULL;
  }
  if (cache->ndim != 5 || cache->shape[0] != 2 || kv_new->ndim != 5 || kv_new->shape[0] != 2 || q->ndim != 4 ||
      kv_new->shape[1] != cache->shape[1] || kv_new->shape[2] != cache->shape[2] ||
      kv_new->shape[4] != cache->shape[4] || kv_new->shape[3] != q->shape[2]) {
    kiln_set_error(KILN_ERR_SHAPE, "%s: cache %s must be (2, B, H, M, D), kv_new %s (2, B, H, Tq, D) and q %s "
                   "(B, H, Tq, D)", who, kiln__tshape(cache), kiln__tshape(kv_new), kiln__tshape(q));
    return NULL;
  }
  if (kv_new->dtype != cache->dtype) {
    kiln_set_error(KILN_ERR_DTYPE, "%s: kv_new is %s but the cache is %s", who, kiln_dtype_name(kv_new->dtype),
                   kiln_dtype_name(cache->dtype));
    return NULL;
  }
  kiln_tensor *k = kiln_select(cache, 0, 0), *v = kiln_select(cache, 0, 1);
  if (!k || !v) return NULL;
  kiln_device dev = kiln_device_of(q);
  kiln_tensor *in[5] = {q, k, v, len, kv_new};
  attrs_kv_attention p = {scale};
  bool fused = !lacks_kernel(dev, KILN__K_KV_ATTENTION);
  if (fused) { /* the kernel where the device takes these arguments (the checks first) */
    kiln__op_ctx c = {.op = &op_kv_attention_append, .attrs = &p, .n_in = 5, .in = in};
    if (kv_attention_infer(&c) != KILN_OK) return NULL;
    kiln__kargs a = {0};
    a.op = KILN__K_KV_ATTENTION;
    a.n_in = 5;
    for (int i = 0; i < 5; i++) a.in[i] = i == 3 ? as_1d(len) : kiln__view_of(in[i]);
    a.i[0] = kiln_numel(len);
    a.i[1] = 1;
    a.n_out = 3;
    a.out[0] = a.in[0];
    a.out[0].data = NULL;
    a.out[1] = a.in[1], a.out[2] = a.in[2];
    fused = kiln__dispatch_has(dev, &a, KILN__K_KV_ATTENTION);
  }
  if (fused) return kiln__op_call(&op_kv_attention_append, 5, in, &p, NULL);
  /* the two ops: the slots len - Tq + t, per row where the rows have lengths of their own */
  const int64_t Tq = q->shape[2], B = q->shape[0], nl = kiln_numel(len);
  kiln_tensor *t = kiln_arange((double)-Tq, 0, 1, KILN_I64, dev);
  for (int64_t b = 0; b < (nl == 1 ? 1 : B); b++) {
    if (nl != 1 && b >= kiln_size(cache, 1)) break; /* a shape error: kiln_kv_attention names it */
    kiln_tensor *slots = kiln_add(kiln_narrow(kiln_reshape(len, KILN_SHAPE(nl)), 0, b, 1), t);
    kiln_tensor *dst = nl == 1 ? cache : kiln_narrow(cache, 1, b, 1), *src = nl == 1 ? kv_new : kiln_narrow(kv_new, 1, b, 1);
    if (kiln_index_copy_(dst, 3, slots, src) != KILN_OK) return NULL;
  }
  return kiln_kv_attention(q, k, v, len, scale);
}

/* ---- sample_tokens -------------------------------------------------------------------- */

typedef struct attrs_sample {
  double temperature, top_p;
  int64_t top_k;
} attrs_sample;
static const kiln__attr_field f_sample[] = {KILN__FIELD(attrs_sample, temperature, KILN__A_FLOAT),
                                            KILN__FIELD(attrs_sample, top_k, KILN__A_INT),
                                            KILN__FIELD(attrs_sample, top_p, KILN__A_FLOAT)};

static kiln_status sample_infer(kiln__op_ctx *c) {
  const attrs_sample *p = c->attrs;
  const char *op = c->op->api;
  kiln_tensor *l = c->in[0], *rng = c->in[1];
  if (l->ndim != 2 || l->shape[1] < 1 || !kiln_dtype_is_float(l->dtype))
    return kiln_set_error(KILN_ERR_SHAPE, "%s: logits %s (%s) must be floating (N, V) with V >= 1", op,
                          kiln__tshape(l), kiln_dtype_name(l->dtype));
  if (!(p->temperature >= 0) || isinf(p->temperature))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: temperature %g (must be >= 0 and finite; 0: argmax)", op,
                          p->temperature);
  if (p->temperature > 0 && !rng)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: sampling (temperature %g) needs the rng state", op,
                          p->temperature);
  if (rng && (rng->dtype != KILN_I64 || rng->ndim != 1 || rng->shape[0] != 2))
    return kiln_set_error(KILN_ERR_SHAPE, "%s: rng %s (%s) must be 2 i64 elements (seed, offset)", op,
                          kiln__tshape(rng), kiln_dtype_name(rng->dtype));
  if (p->top_k < 0)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: top_k %lld (must be >= 0; 0 keeps every token)", op,
                          (long long)p->top_k);
  if (!(p->top_p > 0 && p->top_p <= 1))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: top_p %g is outside (0, 1] (1 keeps every token)", op,
                          p->top_p);
  kiln__op_meta(c, 0, 1, l->shape, KILN_I64);
  c->differentiable = false;
  return KILN_OK;
}

static kiln_status sample_forward(kiln__op_ctx *c) {
  const attrs_sample *p = c->attrs;
  kiln__kargs a = {0};
  a.op = KILN__K_SAMPLE_TOKENS;
  a.n_in = p->temperature > 0 ? 2 : 1; /* the argmax draws nothing */
  a.in[0] = kiln__view_of(c->in[0]);
  if (a.n_in > 1) a.in[1] = kiln__view_of(c->in[1]);
  a.s[0] = p->temperature;
  a.s[1] = p->top_p;
  a.i[0] = p->top_k;
  return kiln__run_into(c->out[0], &a);
}

static const kiln__op op_sample_tokens = {
    .name = "sample_tokens", .api = "kiln_sample_tokens", .n_in = 2, .n_out = 1, .optional = 1u << 1,
    .flags = KILN__OP_NO_GRAD,
    .n_kernels = 1, .kernels = {KILN__K_SAMPLE_TOKENS}, .attrs = f_sample, .n_attrs = 3,
    .attr_size = sizeof(attrs_sample), .infer = sample_infer, .forward = sample_forward};

kiln_tensor *kiln_sample_tokens(kiln_tensor *logits, kiln_tensor *rng, double temperature, int64_t top_k,
                                double top_p) {
  attrs_sample p = {temperature, top_p, top_k};
  kiln_tensor *in[2] = {logits, rng};
  return kiln__op_call(&op_sample_tokens, 2, in, &p, NULL);
}

/* ---- add_layer_norm ------------------------------------------------------------------- */

typedef struct attrs_add_ln {
  double eps;
} attrs_add_ln;
static const kiln__attr_field f_add_ln[] = {KILN__FIELD(attrs_add_ln, eps, KILN__A_FLOAT)};

static kiln_status add_ln_infer(kiln__op_ctx *c) {
  const attrs_add_ln *p = c->attrs;
  const char *op = c->op->api;
  kiln_tensor *x = c->in[0], *r = c->in[1];
  if (x->ndim < 1 || !kiln_dtype_is_float(x->dtype))
    return kiln_set_error(KILN_ERR_SHAPE, "%s: x %s (%s) must be floating with at least one dim", op, kiln__tshape(x),
                          kiln_dtype_name(x->dtype));
  for (int i = 0; i < 4; i++) {
    kiln_tensor *t = c->in[i];
    if (!t) continue;
    if (t->dtype != x->dtype)
      return kiln_set_error(KILN_ERR_DTYPE, "%s: x is %s but input %d is %s", op, kiln_dtype_name(x->dtype), i,
                            kiln_dtype_name(t->dtype));
    if (t->requires_grad && kiln_grad_enabled())
      return kiln_set_error(KILN_ERR_AUTOGRAD, "%s: inference only (no gradient); input %d requires grad while grad "
                            "mode is on", op, i);
  }
  int nd;
  int64_t sh[KILN_MAX_DIMS];
  if (kiln__broadcast_shape(op, x, r, &nd, sh) != KILN_OK) return kiln_last_error();
  if (nd != x->ndim || memcmp(sh, x->shape, (size_t)nd * sizeof(int64_t)) != 0)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: r %s does not broadcast to x %s", op, kiln__tshape(r), kiln__tshape(x));
  const int64_t N = x->shape[x->ndim - 1];
  for (int i = 2; i < 4; i++)
    if (c->in[i] && (c->in[i]->ndim != 1 || c->in[i]->shape[0] != N))
      return kiln_set_error(KILN_ERR_SHAPE, "%s: %s %s must be (%lld), the last dim of x %s", op,
                            i == 2 ? "weight" : "bias", kiln__tshape(c->in[i]), (long long)N, kiln__tshape(x));
  if (!(p->eps >= 0) || isinf(p->eps))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: eps %g (must be >= 0 and finite)", op, p->eps);
  c->n_out = 2;
  kiln__op_meta_like(c, 0, x, x->dtype);
  kiln__op_meta_like(c, 1, x, x->dtype);
  c->differentiable = false;
  return KILN_OK;
}

static kiln_status add_ln_forward(kiln__op_ctx *c) {
  const attrs_add_ln *p = c->attrs;
  kiln_tensor *x = c->in[0], *r = c->in[1], *w = c->in[2], *b = c->in[3];
  if (kiln_numel(x) == 0) return KILN_OK;
  const int64_t N = x->shape[x->ndim - 1], R = kiln_numel(x) / N;
  /* rows: every output is fresh and contiguous; x and r are given as (R, N) views when their
  ** strides allow (r broadcast over every row: row stride 0, the embedding's position row),
  ** else made contiguous first */
  kiln_scope_begin();
  kiln_tensor *xc = kiln_is_contiguous(x) ? x : kiln_contiguous(x);
  kiln__view rv = kiln__view_broadcast(r, x->ndim, x->shape);
  bool r_rows = rv.strides[rv.ndim - 1] == 1 || N == 1, r_bcast = true, r_dense = kiln_is_contiguous(r) && kiln_numel(r) == R * N;
  for (int i = 0; i + 1 < rv.ndim; i++) r_bcast = r_bcast && (rv.strides[i] == 0 || rv.shape[i] == 1);
  kiln_tensor *rc = r_rows && (r_bcast || r_dense) ? r : kiln_contiguous(kiln_expand(r, x->ndim, x->shape));
  if (rc != r) rv = kiln__view_of(rc), r_bcast = false;
  kiln__kargs a = {0};
  a.op = KILN__K_ADD_LAYER_NORM;
  a.n_in = 2;
  const int64_t shape2[2] = {R, N};
  kiln_status st = xc && rc ? KILN_OK : kiln_last_error();
  if (st == KILN_OK) {
    a.in[0] = kiln__view_of(xc);
    a.in[1] = rv;
    for (int k = 0; k < 2; k++) {
      a.in[k].ndim = 2;
      a.in[k].shape[0] = R, a.in[k].shape[1] = N;
      a.in[k].strides[0] = k == 1 && r_bcast ? 0 : N, a.in[k].strides[1] = 1;
    }
    if (w) a.in[a.n_in++] = kiln__view_of(w), a.i[0] |= 1;
    if (b) a.in[a.n_in++] = kiln__view_of(b), a.i[0] |= 2;
    a.n_out = 2;
    for (int k = 0; k < 2; k++) {
      a.out[k] = kiln__view_of(c->out[k]);
      a.out[k].ndim = 2;
      a.out[k].shape[0] = shape2[0], a.out[k].shape[1] = shape2[1];
      a.out[k].strides[0] = N, a.out[k].strides[1] = 1;
    }
    a.s[0] = p->eps;
    st = kiln__dispatch(kiln_device_of(x), &a);
  }
  kiln_scope_end();
  return st;
}

static const kiln__op op_add_layer_norm = {
    .name = "add_layer_norm", .api = "kiln_add_layer_norm", .n_in = 4, .n_out = 2, .optional = (1u << 2) | (1u << 3),
    .amp = KILN__AMP_F32, /* as layer_norm, and as the add it fuses, which promotes to f32 */
    .flags = KILN__OP_NO_GRAD, .n_kernels = 1, .kernels = {KILN__K_ADD_LAYER_NORM}, .attrs = f_add_ln, .n_attrs = 1,
    .attr_size = sizeof(attrs_add_ln), .infer = add_ln_infer, .forward = add_ln_forward};

kiln_tensor *kiln_add_layer_norm(kiln_tensor *x, kiln_tensor *r, kiln_tensor *weight, kiln_tensor *bias, double eps,
                                 kiln_tensor **sum) {
  attrs_add_ln p = {eps};
  kiln_tensor *in[4] = {x, r, weight, bias}, *out[2] = {NULL, NULL};
  if (x && r && lacks_kernel(kiln_device_of(x), KILN__K_ADD_LAYER_NORM)) { /* the two ops it fuses */
    /* its checks, but the dtypes' under autocast, which the two ops apply themselves */
    kiln_tensor *chk[4] = {x, r, weight, bias};
    if (kiln_autocast_is_enabled(kiln_device_of(x).type))
      for (int i = 1; i < 4; i++) chk[i] = chk[i] && chk[i]->dtype != x->dtype ? kiln_to_dtype(chk[i], x->dtype) : chk[i];
    kiln__op_ctx c = {.op = &op_add_layer_norm, .attrs = &p, .n_in = 4, .in = chk};
    if (add_ln_infer(&c) != KILN_OK) return NULL;
    kiln_tensor *s = kiln_add(x, r);
    const int64_t N = s ? s->shape[s->ndim - 1] : 0;
    kiln_tensor *y = s ? kiln_layer_norm(s, 1, &N, weight, bias, eps) : NULL;
    if (sum) *sum = y ? s : NULL;
    return y;
  }
  kiln_tensor *y = kiln__op_call(&op_add_layer_norm, 4, in, &p, out);
  if (sum) *sum = y ? out[1] : NULL;
  return y;
}

/* ---- linear_decode -------------------------------------------------------------------- */

typedef struct attrs_linear_decode {
  bool gelu;
} attrs_linear_decode;
static const kiln__attr_field f_linear_decode[] = {KILN__FIELD(attrs_linear_decode, gelu, KILN__A_BOOL)};

/* The kernel's arguments for x (..., K) as (M, K), when x's rows are dense. */
static bool linear_decode_args(kiln_tensor *x, kiln_tensor *w, kiln_tensor *b, bool gelu, kiln__kargs *a) {
  if (x->ndim < 1 || w->ndim != 2 || !kiln_is_contiguous(x) || x->shape[x->ndim - 1] != w->shape[1] ||
      x->dtype != w->dtype || (b && (b->dtype != x->dtype || b->ndim != 1 || b->shape[0] != w->shape[0])))
    return false;
  const int64_t K = w->shape[1], M = K > 0 ? kiln_numel(x) / K : 0;
  memset(a, 0, sizeof *a);
  a->op = KILN__K_LINEAR_DECODE;
  a->n_in = 2;
  a->in[0] = kiln__view_of(x);
  a->in[0].ndim = 2, a->in[0].shape[0] = M, a->in[0].shape[1] = K, a->in[0].strides[0] = K, a->in[0].strides[1] = 1;
  a->in[1] = kiln__view_of(w);
  if (b) a->in[a->n_in++] = kiln__view_of(b), a->i[0] = 1;
  a->i[1] = gelu;
  a->n_out = 1;
  a->out[0] = a->in[0]; /* the output's geometry, for supports(): (M, N) dense, x's dtype */
  a->out[0].data = NULL, a->out[0].shape[1] = w->shape[0], a->out[0].strides[0] = w->shape[0];
  return M > 0 && w->shape[0] > 0;
}

static kiln_status linear_decode_infer(kiln__op_ctx *c) {
  kiln_tensor *x = c->in[0], *w = c->in[1];
  int64_t shape[KILN_MAX_DIMS];
  memcpy(shape, x->shape, (size_t)x->ndim * sizeof(int64_t));
  shape[x->ndim - 1] = w->shape[0];
  kiln__op_meta(c, 0, x->ndim, shape, x->dtype);
  c->differentiable = false;
  return KILN_OK;
}

static kiln_status linear_decode_forward(kiln__op_ctx *c) {
  const attrs_linear_decode *p = c->attrs;
  kiln__kargs a;
  if (!linear_decode_args(c->in[0], c->in[1], c->in[2], p->gelu, &a))
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln_linear_decode: arguments changed after the kernel check");
  a.out[0] = kiln__view_of(c->out[0]);
  a.out[0].ndim = 2, a.out[0].shape[0] = a.in[0].shape[0], a.out[0].shape[1] = c->in[1]->shape[0];
  a.out[0].strides[0] = c->in[1]->shape[0], a.out[0].strides[1] = 1;
  return kiln__dispatch(kiln_device_of(c->in[0]), &a);
}

static const kiln__op op_linear_decode = {
    .name = "linear_decode", .api = "kiln_linear_decode", .n_in = 3, .n_out = 1, .optional = 1u << 2,
    .amp = KILN__AMP_LOWER, /* as linear */
    .flags = KILN__OP_NO_GRAD, .n_kernels = 1, .kernels = {KILN__K_LINEAR_DECODE}, .attrs = f_linear_decode,
    .n_attrs = 1, .attr_size = sizeof(attrs_linear_decode), .infer = linear_decode_infer,
    .forward = linear_decode_forward};

kiln_tensor *kiln_linear_decode(kiln_tensor *x, kiln_tensor *weight, kiln_tensor *bias, bool gelu) {
  if (!x || !weight) return kiln_linear(x, weight, bias); /* NULL passes through, with its error */
  kiln__kargs a;
  bool grad = kiln_grad_enabled() && (kiln_requires_grad(x) || kiln_requires_grad(weight) ||
                                      (bias && kiln_requires_grad(bias)));
  /* the kernel where the device has one for these arguments; else the two ops it fuses
  ** (which also give the errors of bad arguments, and gradients) */
  /* KILN_LINEAR_DECODE=0 always composes (an A/B switch for the benchmarks) */
  static int off = -1;
  if (off < 0) {
    off = kiln__knob_choice("KILN_LINEAR_DECODE", 0) == 1; /* "0" */
  }
  if (off || grad || !kiln_device_equal(kiln_device_of(x), kiln_device_of(weight)) ||
      !linear_decode_args(x, weight, bias, gelu, &a) || !kiln__dispatch_has(kiln_device_of(x), &a, KILN__K_LINEAR_DECODE)) {
    kiln_tensor *y = kiln_linear(x, weight, bias);
    return gelu ? kiln_gelu_tanh(y) : y;
  }
  attrs_linear_decode p = {gelu};
  kiln_tensor *in[3] = {x, weight, bias};
  return kiln__op_call(&op_linear_decode, 3, in, &p, NULL);
}
