/*
** scaled_dot_product_attention (torch.nn.functional's): softmax(q k^T * scale + mask) v
** with optional causal masking and dropout on the attention weights, as one ATTENTION
** kernel (blocked over keys with an online softmax: no Tq x Tk matrix; the CPU's is in
** src/backend/cpu/cpu_transformer.c) that also gives each query row's log-sum-exp, which
** the node keeps, and one ATTENTION_BACKWARD kernel that recomputes the weights from it,
** run through the internal op scaled_dot_product_attention_backward so that observers (the
** profiler) see it. The node also keeps the output: the tensor-core kernels take
** delta_i = dO_i . O_i from it (backend.h).
**
** Dropout draws from the Philox generator: the forward reserves B*H*Tq*Tk values and the
** node keeps the (seed, offset) (in n->i), so the backward sees the very same mask.
** Autocast class LOWER (PyTorch's list). The mask gets no gradient.
*/
#include "ops/op.h"

#include <math.h>
#include <stdatomic.h>

typedef struct attrs_attention {
  bool is_causal;
  double dropout_p;
  double scale; /* 0: 1 / sqrt(D) */
  kiln_generator *gen; /* not an attribute: where dropout draws from (NULL: global) */
} attrs_attention;
static const kiln__attr_field f_attention[] = {KILN__FIELD(attrs_attention, is_causal, KILN__A_BOOL),
                                               KILN__FIELD(attrs_attention, dropout_p, KILN__A_FLOAT),
                                               KILN__FIELD(attrs_attention, scale, KILN__A_FLOAT)};

kiln_status kiln__attention_check(const char *op, kiln_tensor *const qkv[3], double scale) {
  kiln_tensor *q = qkv[0], *k = qkv[1], *v = qkv[2];
  static const char *const names[] = {"q", "k", "v"};
  for (int i = 0; i < 3; i++) {
    kiln_tensor *t = qkv[i];
    if (t->ndim != 4)
      return kiln_set_error(KILN_ERR_SHAPE, "%s: %s must be 4-d (batch, heads, seq, head_dim), got %s", op, names[i],
                            kiln__tshape(t));
    if (!kiln_dtype_is_float(t->dtype))
      return kiln_set_error(KILN_ERR_DTYPE, "%s: %s must be floating, got %s", op, names[i], kiln_dtype_name(t->dtype));
    if (t->dtype != q->dtype)
      return kiln_set_error(KILN_ERR_DTYPE, "%s: q, k and v must have one dtype, got q %s and %s %s", op,
                            kiln_dtype_name(q->dtype), names[i], kiln_dtype_name(t->dtype));
  }
  if (k->shape[0] != q->shape[0] || v->shape[0] != q->shape[0] || k->shape[1] != q->shape[1] ||
      v->shape[1] != q->shape[1])
    return kiln_set_error(KILN_ERR_SHAPE, "%s: q %s, k %s and v %s must have the same batch and head counts", op,
                          kiln__tshape(q), kiln__tshape(k), kiln__tshape(v));
  if (k->shape[3] != q->shape[3])
    return kiln_set_error(KILN_ERR_SHAPE, "%s: q %s and k %s must have the same head dim (last dim)", op,
                          kiln__tshape(q), kiln__tshape(k));
  if (k->shape[2] != v->shape[2])
    return kiln_set_error(KILN_ERR_SHAPE, "%s: k %s and v %s must have the same sequence length (dim 2)", op,
                          kiln__tshape(k), kiln__tshape(v));
  if (!(scale >= 0.0) || isinf(scale))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: scale must be finite and >= 0 (0: 1/sqrt(head_dim)), got %g",
                          op, scale);
  return KILN_OK;
}

static kiln_status attention_infer(kiln__op_ctx *c) {
  const attrs_attention *p = c->attrs;
  const char *op = c->op->api;
  kiln_tensor *q = c->in[0], *k = c->in[1], *v = c->in[2], *m = c->in[3];
  if (kiln__attention_check(op, c->in, p->scale) != KILN_OK) return kiln_last_error();
  if (!(p->dropout_p >= 0.0 && p->dropout_p <= 1.0))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: dropout_p must be in [0, 1], got %g", op, p->dropout_p);
  if (m) {
    if (p->is_causal)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: give a mask or is_causal, not both", op);
    if (m->dtype != KILN_BOOL && !kiln_dtype_is_float(m->dtype))
      return kiln_set_error(KILN_ERR_DTYPE, "%s: the mask must be bool (true attends) or floating (added), got %s", op,
                            kiln_dtype_name(m->dtype));
    int64_t want[4] = {q->shape[0], q->shape[1], q->shape[2], k->shape[2]}, sh[KILN_MAX_DIMS];
    int nd;
    if (m->ndim > 4 || kiln__broadcast_shapes(op, m->ndim, m->shape, 4, want, &nd, sh) != KILN_OK ||
        sh[0] != want[0] || sh[1] != want[1] || sh[2] != want[2] || sh[3] != want[3]) {
      kiln_clear_error();
      return kiln_set_error(KILN_ERR_SHAPE, "%s: the mask %s does not broadcast to the scores' shape %s", op,
                            kiln__tshape(m), kiln__shape_cstr(4, want));
    }
  }
  int64_t oshape[4] = {q->shape[0], q->shape[1], q->shape[2], v->shape[3]};
  kiln__op_meta(c, 0, 4, oshape, q->dtype);
  return KILN_OK;
}

double kiln__attention_scale(double scale, int64_t d) {
  return scale > 0 ? scale : (d > 0 ? 1.0 / sqrt((double)d) : 1.0);
}

/* Whether t (B, H, T, D) lies in (B, T, H, D) memory order: the heads of a (B, T, C)
** activation split by a view and a transpose, as a transformer's q, k and v are. */
static bool heads_inner(const kiln_tensor *t) {
  return t->ndim == 4 && t->shape[1] > 1 && t->shape[2] > 1 && t->strides[1] < t->strides[2];
}

/* A new (B, H, T, D) tensor of dtype dt in (B, T, H, D) memory order when bthd (its
** transpose(1, 2) is then contiguous: (B, T, C) by a view), else contiguous. */
static kiln_tensor *new_heads(const int64_t shape[4], kiln_dtype dt, kiln_device dev, bool bthd) {
  if (!bthd) return kiln__tensor_new(4, shape, dt, dev);
  const int64_t B = shape[0], H = shape[1], T = shape[2], D = shape[3];
  kiln_tensor *base = kiln__tensor_new(4, (int64_t[]){B, T, H, D}, dt, dev);
  if (!base) return NULL;
  kiln_tensor *t = kiln__tensor_make(base->storage, 0, 4, shape, (int64_t[]){T * H * D, D, H * D, 1}, dt);
  kiln__discard(base); /* the view holds the storage */
  return t;
}

static kiln_status attention_forward(kiln__op_ctx *c) {
  const attrs_attention *p = c->attrs;
  kiln_tensor *q = c->in[0], *k = c->in[1], *v = c->in[2], *m = c->in[3];
  kiln_device dev = kiln_device_of(q);
  /* The output follows q's layout (PyTorch's flash path does the same): for a GPT's heads,
  ** split from qkv by views, it is (B, T, H, Dv) in memory, and the (B, H, T, Dv) ->
  ** (B, T, C) reshape after it is a view, not a copy (0.95 ms a step for GPT-2 at B16
  ** T1024 on the H200). */
  c->out[0] = new_heads(c->meta[0].shape, c->meta[0].dtype, dev, heads_inner(q));
  if (!c->out[0]) return kiln_last_error();
  int64_t lshape[3] = {q->shape[0], q->shape[1], q->shape[2]};
  kiln_tensor *lse = c->tmp[0] = kiln__tensor_new(3, lshape, q->dtype == KILN_F64 ? KILN_F64 : KILN_F32, dev);
  if (!lse) return kiln_last_error();
  int64_t n_scores = q->shape[0] * q->shape[1] * q->shape[2] * k->shape[2];
  c->scratch[0] = c->scratch[1] = 0;
  if (p->dropout_p > 0 && n_scores > 0)
    kiln__generator_reserve(p->gen ? p->gen : kiln_generator_global(), n_scores, &c->scratch[0], &c->scratch[1]);
  if (kiln_numel(c->out[0]) == 0) return KILN_OK;
  kiln__kargs a = {0};
  a.op = KILN__K_ATTENTION;
  a.n_in = 3;
  a.in[0] = kiln__view_of(q);
  a.in[1] = kiln__view_of(k);
  a.in[2] = kiln__view_of(v);
  int64_t sshape[4] = {q->shape[0], q->shape[1], q->shape[2], k->shape[2]};
  if (m) a.in[a.n_in++] = kiln__view_broadcast(m, 4, sshape), a.i[0] |= 2;
  if (p->is_causal) a.i[0] |= 1;
  a.n_out = 2;
  a.out[0] = kiln__view_of(c->out[0]);
  a.out[1] = kiln__view_of(lse);
  a.s[0] = kiln__attention_scale(p->scale, q->shape[3]);
  a.s[1] = p->dropout_p;
  a.seed = c->scratch[0];
  a.offset = c->scratch[1];
  return kiln__dispatch(dev, &a);
}

/* saved: 0 q, 1 k, 2 v, 3 mask (or NULL), 4 lse, 5 the output (delta_i = dO_i . O_i for the
** kernels that use it, see backend.h: FlashAttention keeps it too); n->i[0..1] dropout's
** (seed, offset) */
static void attention_save(kiln__op_ctx *c, kiln__node *n) {
  for (int i = 0; i < 4; i++) kiln__node_save(n, i, c->in[i]);
  kiln__node_save(n, 4, c->tmp[0]);
  kiln__node_save_output(n, 5);
  n->i[0] = (int64_t)c->scratch[0];
  n->i[1] = (int64_t)c->scratch[1];
}

/* The backward's kernel as an internal op, so that observers see it: the profiler times it
** and counts its FLOPs as "scaled_dot_product_attention_backward" (a kernel dispatched from
** the rule itself would be invisible to them). In: q, k, v, the output's gradient, the
** mask (or NULL), lse, the forward's output (or NULL; see backend.h). Out: dq, dk, dv. Not
** differentiable: no double backward through attention. */
typedef struct attrs_attention_bwd {
  bool is_causal;
  double dropout_p;
  double scale; /* resolved */
  int64_t seed, offset;
} attrs_attention_bwd;
static const kiln__attr_field f_attention_bwd[] = {
    KILN__FIELD(attrs_attention_bwd, is_causal, KILN__A_BOOL), KILN__FIELD(attrs_attention_bwd, dropout_p, KILN__A_FLOAT),
    KILN__FIELD(attrs_attention_bwd, scale, KILN__A_FLOAT), KILN__FIELD(attrs_attention_bwd, seed, KILN__A_INT),
    KILN__FIELD(attrs_attention_bwd, offset, KILN__A_INT)};

static kiln_status attention_bwd_infer(kiln__op_ctx *c) {
  for (int i = 0; i < 3; i++) kiln__op_meta_like(c, i, c->in[i], c->in[i]->dtype);
  return KILN_OK;
}

/* Whether q, k and v are the three thirds of one (B, T, 3, H, D) activation (a GPT's qkv
** split by views: one storage, one layout, k right after q and v after k in each row). */
static bool qkv_packed(const kiln_tensor *q, const kiln_tensor *k, const kiln_tensor *v) {
  if (q->storage != k->storage || q->storage != v->storage || q->dtype != k->dtype || q->dtype != v->dtype)
    return false;
  for (int d = 0; d < 4; d++)
    if (k->shape[d] != q->shape[d] || v->shape[d] != q->shape[d] || k->strides[d] != q->strides[d] ||
        v->strides[d] != q->strides[d])
      return false;
  const int64_t H = q->shape[1], T = q->shape[2], D = q->shape[3];
  const int64_t *s = q->strides;
  return s[3] == 1 && s[1] == D && s[2] == 3 * H * D && (q->shape[0] == 1 || s[0] == T * 3 * H * D) &&
         k->offset == q->offset + H * D && v->offset == k->offset + H * D;
}

/* dq, dk, dv: for q, k, v packed from one qkv (qkv_packed), views of one new (B, T, 3C)
** buffer in that same layout, so that qkv's gradient is that buffer itself and nothing
** stacks the three (2.7 ms a step for GPT-2 at B16 T1024 on the H200: 151 MB copied a
** layer); else each in its input's layout, as kiln__op_meta_like gives. */
static kiln_status attention_bwd_alloc(kiln__op_ctx *c) {
  kiln_tensor *q = c->in[0], *k = c->in[1], *v = c->in[2];
  if (qkv_packed(q, k, v) && kiln_numel(q) > 0) {
    const int64_t B = q->shape[0], H = q->shape[1], T = q->shape[2], D = q->shape[3];
    kiln_tensor *base = kiln__tensor_new(3, (int64_t[]){B, T, 3 * H * D}, q->dtype, c->device);
    if (!base) return kiln_last_error();
    const int64_t st[4] = {T * 3 * H * D, D, 3 * H * D, 1};
    for (int i = 0; i < 3; i++) c->out[i] = kiln__tensor_make(base->storage, i * H * D, 4, q->shape, st, q->dtype);
    kiln__discard(base); /* the views hold the storage */
  } else {
    for (int i = 0; i < 3; i++)
      c->out[i] = kiln__tensor_new_format(4, c->meta[i].shape, c->meta[i].dtype, c->device, c->meta[i].channels_last);
  }
  for (int i = 0; i < 3; i++)
    if (!c->out[i]) return kiln_last_error();
  return KILN_OK;
}

kiln_tensor *kiln__attention_qkv_grad(kiln_tensor *const dqkv[3]) {
  const kiln_tensor *g = dqkv[0];
  if (!g || !dqkv[1] || !dqkv[2] || g->ndim != 4 || !qkv_packed(g, dqkv[1], dqkv[2])) return NULL;
  const int64_t B = g->shape[0], H = g->shape[1], T = g->shape[2], D = g->shape[3];
  /* the (B, T, 3C) view must start at dq and stay inside the buffer (attention_bwd_alloc's
  ** buffers do; a packed qkv the caller split itself might not start at q) */
  size_t end = (size_t)(g->offset + B * T * 3 * H * D) * kiln_dtype_size(g->dtype);
  if (g->storage->nbytes < end) return NULL;
  return kiln__tensor_make(g->storage, g->offset, 3, (int64_t[]){B, T, 3 * H * D}, NULL, g->dtype);
}

static kiln_status attention_bwd_forward(kiln__op_ctx *c) {
  const attrs_attention_bwd *p = c->attrs;
  kiln_tensor *q = c->in[0], *m = c->in[4], *o = c->in[6];
  kiln_status ast = attention_bwd_alloc(c);
  if (ast != KILN_OK) return ast;
  kiln__kargs a = {0};
  a.op = KILN__K_ATTENTION_BACKWARD;
  a.n_in = 4;
  for (int i = 0; i < 4; i++) a.in[i] = kiln__view_of(c->in[i]);
  int64_t sshape[4] = {q->shape[0], q->shape[1], q->shape[2], c->in[1]->shape[2]};
  if (m) a.in[a.n_in++] = kiln__view_broadcast(m, 4, sshape), a.i[0] |= 2;
  if (p->is_causal) a.i[0] |= 1;
  a.n_out = 4;
  for (int i = 0; i < 3; i++) a.out[i] = kiln__view_of(c->out[i]);
  a.out[3] = kiln__view_of(c->in[5]); /* lse, read only (see backend.h) */
  kiln__view ov;
  if (o) ov = kiln__view_of(o), a.params = &ov; /* the forward's output, read only */
  a.s[0] = p->scale;
  a.s[1] = p->dropout_p;
  a.seed = (uint64_t)p->seed;
  a.offset = (uint64_t)p->offset;
  return kiln__dispatch(c->device, &a);
}

static const kiln__op op_attention_bwd = {
    .name = "scaled_dot_product_attention_backward", .api = "kiln_scaled_dot_product_attention_backward",
    .n_in = 7, .n_out = 3, .optional = (1u << 4) | (1u << 6), .flags = KILN__OP_SELF_ALLOC, .n_kernels = 1,
    .kernels = {KILN__K_ATTENTION_BACKWARD}, .attrs = f_attention_bwd, .n_attrs = 5,
    .attr_size = sizeof(attrs_attention_bwd), .infer = attention_bwd_infer, .forward = attention_bwd_forward};

static kiln_status attention_backward(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  const attrs_attention *p = n->attrs;
  kiln_tensor *q = n->saved[0], *k = n->saved[1], *v = n->saved[2], *m = n->saved[3], *lse = n->saved[4];
  kiln_tensor *o = n->saved[5];
  kiln_tensor *r[3] = {0};
  if (kiln_numel(q) == 0 || kiln_numel(k) == 0 || kiln_numel(v) == 0) {
    /* nothing to attend or nobody attends: every gradient is 0 */
    kiln_device dev = kiln_device_of(q);
    r[0] = kiln__tensor_new(q->ndim, q->shape, q->dtype, dev);
    r[1] = kiln__tensor_new(k->ndim, k->shape, k->dtype, dev);
    r[2] = kiln__tensor_new(v->ndim, v->shape, v->dtype, dev);
    if (!r[0] || !r[1] || !r[2]) return kiln_last_error();
    if (kiln_fill_(r[0], 0) != KILN_OK || kiln_fill_(r[1], 0) != KILN_OK || kiln_fill_(r[2], 0) != KILN_OK)
      return kiln_last_error();
  } else {
    attrs_attention_bwd b = {p->is_causal, p->dropout_p, kiln__attention_scale(p->scale, q->shape[3]), n->i[0],
                             n->i[1]};
    kiln_tensor *in[7] = {q, k, v, g, m, lse, o};
    if (!kiln__op_call(&op_attention_bwd, 7, in, &b, r)) return kiln_last_error();
  }
  for (int i = 0; i < 3; i++)
    if (n->needs[i]) gi[i] = kiln_keep(r[i]);
  return KILN_OK;
}

#define ATTENTION_OP(flags_)                                                                                   \
  {.name = "scaled_dot_product_attention", .api = "kiln_scaled_dot_product_attention", .n_in = 4, .n_out = 1, \
   .optional = 1u << 3, .amp = KILN__AMP_LOWER, .flags = (flags_), .n_kernels = 1,                            \
   .kernels = {KILN__K_ATTENTION}, .attrs = f_attention, .n_attrs = 3, .attr_size = sizeof(attrs_attention),  \
   .infer = attention_infer, .forward = attention_forward, .backward = attention_backward, .n_saved = 6,      \
   .save = attention_save}
/* Without dropout a checkpoint keeps the call's output and lse from its forward instead of
** recomputing them (T^2 work for a T-row output: 1.3 ms of GPT-2's 124M step); with
** dropout the recompute runs it, drawing the mask the forward drew. */
static const kiln__op op_attention = ATTENTION_OP(KILN__OP_SELF_ALLOC);
static const kiln__op op_attention_kept = ATTENTION_OP(KILN__OP_SELF_ALLOC | KILN__OP_CHECKPOINT_KEEPS);

static atomic_int sdpa_backend; /* kiln_sdpa_backend */

int kiln_sdpa_set_backend(kiln_sdpa_backend b) {
  if (b != KILN_SDPA_FUSED && b != KILN_SDPA_MATH) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_sdpa_set_backend: %d is not a backend (KILN_SDPA_FUSED 0, "
                   "KILN_SDPA_MATH 1)", (int)b);
    return -1;
  }
  return atomic_exchange(&sdpa_backend, (int)b);
}

/* PyTorch's math backend: public ops, so autograd, autocast (matmuls lowered, softmax in
** f32) and every device come with them. Causal: key j <= query i, the kernel's rule. */
static kiln_tensor *sdpa_math(kiln_tensor *q, kiln_tensor *k, kiln_tensor *v, kiln_tensor *mask, bool is_causal,
                              double scale) {
  double sc = scale > 0 ? scale : 1.0 / sqrt((double)q->shape[3]);
  kiln_tensor *s = kiln_mul_scalar(kiln_matmul(q, kiln_transpose(k, 2, 3)), sc);
  if (!s) return NULL;
  if (is_causal) {
    /* a bool mask: an f32 one is a floating input of where, whose autocast class (promote)
    ** then cast the bf16 scores to f32 (1.2 GB moved per layer at GPT-2's B16 T1024) */
    kiln_tensor *keep = kiln_gt_scalar(kiln_tril(kiln_ones(2, (int64_t[]){q->shape[2], k->shape[2]}, KILN_F32, kiln_device_of(q)), 0), 0.0);
    s = kiln_where(keep, s, kiln_scalar(-INFINITY, s->dtype, kiln_device_of(q)));
  } else if (mask) {
    s = mask->dtype == KILN_BOOL ? kiln_where(mask, s, kiln_scalar(-INFINITY, s->dtype, kiln_device_of(q)))
                                 : kiln_add(s, mask);
  }
  return kiln_matmul(kiln_softmax(s, 3), v);
}

kiln_tensor *kiln_scaled_dot_product_attention(kiln_tensor *q, kiln_tensor *k, kiln_tensor *v, kiln_tensor *mask,
                                               bool is_causal, double dropout_p, double scale, kiln_generator *gen) {
  if (atomic_load_explicit(&sdpa_backend, memory_order_relaxed) == KILN_SDPA_MATH && dropout_p == 0 && q && k &&
      v && q->ndim == 4 && k->ndim == 4 && v->ndim == 4 && !(mask && is_causal))
    return sdpa_math(q, k, v, mask, is_causal, scale);
  attrs_attention p = {is_causal, dropout_p, scale, gen};
  kiln_tensor *in[4] = {q, k, v, mask};
  return kiln__op_call(dropout_p == 0 ? &op_attention_kept : &op_attention, 4, in, &p, NULL);
}
