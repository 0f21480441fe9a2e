/*
** Elementwise ops: broadcasting binary arithmetic, comparisons, where, unary math,
** activations, copies between dtypes and devices, and the in-place updates optimizers
** use. Each is a descriptor on the one call path (op.h); differentiable ones have a
** backward rule written with other ops.
*/
#include "ops/op.h"

#include <math.h>
#include <string.h>

/* ---- binary ---- */
/* add and axpy scale their second input (axpy: a + alpha*b); the others take no
** attribute. */
typedef struct attrs_alpha {
  double alpha;
} attrs_alpha;
static const kiln__attr_field alpha_fields[] = {KILN__FIELD(attrs_alpha, alpha, KILN__A_FLOAT)};

static bool is_cmp(kiln__kop k) { return k >= KILN__K_EQ && k <= KILN__K_GE; }

static kiln_status binary_infer(kiln__op_ctx *c) {
  kiln_tensor *a = c->in[0], *b = c->in[1];
  kiln__kop kop = c->op->kernels[0];
  int nd;
  int64_t shape[KILN_MAX_DIMS];
  if (kiln__broadcast_shape(c->op->api, a, b, &nd, shape) != KILN_OK) return kiln_last_error();
  kiln_dtype ct = kiln_dtype_promote(a->dtype, b->dtype);
  if ((kop == KILN__K_POW || kop == KILN__K_DIV) && ct == KILN_BOOL) ct = KILN_I64;
  if (kop == KILN__K_SUB && ct == KILN_BOOL)
    return kiln_set_error(KILN_ERR_DTYPE, "%s: subtraction of bool tensors is not supported", c->op->api);
  c->scratch[0] = (uint64_t)ct;
  kiln__op_meta(c, 0, nd, shape, is_cmp(kop) ? KILN_BOOL : ct);
  kiln__op_meta_keep_format(c, 0, a);
  kiln__op_meta_keep_format(c, 0, b);
  c->differentiable = c->differentiable && kiln_dtype_is_float(ct);
  return KILN_OK;
}

/* add and sub of an f32 and a 16-bit float hand the 16-bit operand to the kernel as it is
** where the device's kernel widens it while reading (CUDA): no cast kernel and no f32 copy
** first, the same values (the widening is exact). Neither op saves its operands, so nothing
** else sees the difference. Under autocast the operands arrive already cast (add and sub
** are on its promote list; branch autocast-add takes them off it, not yet run on a GPU). */
static bool binary_mixed(kiln__op_ctx *c, kiln_dtype ct) {
  kiln__kop k = c->op->kernels[0];
  kiln_dtype d0 = c->in[0]->dtype, d1 = c->in[1]->dtype;
  if ((k != KILN__K_ADD && k != KILN__K_SUB) || ct != KILN_F32 || d0 == d1) return false;
  if ((d0 != KILN_BF16 && d0 != KILN_F16) == (d1 != KILN_BF16 && d1 != KILN_F16)) return false;
  return kiln_device_of(c->out[0]).type == KILN_DEVICE_CUDA;
}

static kiln_status binary_forward(kiln__op_ctx *c) {
  kiln_dtype ct = (kiln_dtype)c->scratch[0];
  kiln_tensor *out = c->out[0];
  if (binary_mixed(c, ct)) {
    kiln__kargs k = {0};
    k.op = c->op->kernels[0];
    k.n_in = 2;
    k.in[0] = kiln__view_broadcast(c->in[0], out->ndim, out->shape);
    k.in[1] = kiln__view_broadcast(c->in[1], out->ndim, out->shape);
    k.s[0] = c->attrs ? ((const attrs_alpha *)c->attrs)->alpha : 1.0;
    k.n_out = 1;
    k.out[0] = kiln__view_of(out);
    if (kiln__dispatch_has(kiln_device_of(out), &k, k.op)) return kiln__run_into(out, &k);
  }
  kiln_tensor *ca = c->tmp[0] = kiln__as_dtype_nograd(c->in[0], ct);
  kiln_tensor *cb = c->tmp[1] = kiln__as_dtype_nograd(c->in[1], ct);
  if (!ca || !cb) return kiln_last_error();
  kiln__kargs k = {0};
  k.op = c->op->kernels[0];
  k.n_in = 2;
  k.in[0] = kiln__view_broadcast(ca, out->ndim, out->shape);
  k.in[1] = kiln__view_broadcast(cb, out->ndim, out->shape);
  k.s[0] = c->attrs ? ((const attrs_alpha *)c->attrs)->alpha : 1.0;
  return kiln__run_into(out, &k);
}

/* Saves what the rule reads, and only for the inputs that want a gradient (PyTorch's
** derivatives.yaml does the same): a slot left NULL frees its tensor as soon as nothing
** else holds it. add and sub read no operand (ResNet's residual add kept both of its
** (N, 4C, H, W) inputs to the end of the step); mul reads each operand for the other's
** gradient; div reads b always and a for b's gradient. */
static void binary_save(kiln__op_ctx *c, kiln__node *n) {
  kiln__kop k = c->op->kernels[0];
  if (k == KILN__K_ADD || k == KILN__K_SUB) return;
  bool save_a = true, save_b = true;
  if (k == KILN__K_MUL) save_a = n->needs[1], save_b = n->needs[0];
  else if (k == KILN__K_DIV) save_a = n->needs[1];
  if (save_a) kiln__node_save(n, 0, c->tmp[0]);
  if (save_b) kiln__node_save(n, 1, c->tmp[1]);
  if (k == KILN__K_POW) kiln__node_save_output(n, 2);
}

/* Gradient g for input k, reduced to that input's shape and cast to its dtype. */
static kiln_tensor *to_input(kiln__node *n, int k, kiln_tensor *g) {
  if (!g) return NULL;
  kiln_tensor *r = kiln__unbroadcast(g, n->in_ndim[k], n->in_shape[k]);
  if (r && r->dtype != n->in_dtype[k]) r = kiln_to_dtype(r, n->in_dtype[k]);
  return kiln_keep(r);
}

#define NEED(k) (n->needs[k])
#define SET_GRAD(k, expr)                                                                 \
  do {                                                                                    \
    if (NEED(k)) {                                                                        \
      gi[k] = to_input(n, k, (expr));                                                     \
      if (!gi[k]) return kiln_last_error();                                               \
    }                                                                                     \
  } while (0)

static kiln_status add_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  SET_GRAD(0, g);
  double alpha = n->attrs ? ((const attrs_alpha *)n->attrs)->alpha : 1.0;
  SET_GRAD(1, alpha == 1.0 ? g : kiln_mul_scalar(g, alpha));
  return KILN_OK;
}
static kiln_status sub_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  SET_GRAD(0, g);
  SET_GRAD(1, kiln_neg(g));
  return KILN_OK;
}
static kiln_status mul_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  SET_GRAD(0, kiln_mul(g, n->saved[1]));
  SET_GRAD(1, kiln_mul(g, n->saved[0]));
  return KILN_OK;
}
static kiln_status div_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *ga = kiln_div(g, n->saved[1]);
  SET_GRAD(0, ga);
  SET_GRAD(1, kiln_neg(kiln_div(kiln_mul(ga, n->saved[0]), n->saved[1])));
  return KILN_OK;
}
static kiln_status pow_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *a = n->saved[0], *b = n->saved[1], *y = n->saved[2];
  /* d/da a^b = b a^(b-1); d/db a^b = a^b log a, taken as 0 where a^b == 0 (PyTorch) */
  SET_GRAD(0, kiln_mul(g, kiln_mul(b, kiln_pow(a, kiln_add_scalar(b, -1.0)))));
  if (NEED(1)) {
    kiln_tensor *t = kiln_mul(g, kiln_mul(y, kiln_log(a)));
    kiln_tensor *zero = kiln_zeros_like(y);
    SET_GRAD(1, kiln_where(kiln_eq(y, zero), zero, t));
  }
  return KILN_OK;
}
/* max/min: the gradient goes to the larger (smaller) input; ties split it in half. */
static kiln_status maxmin_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi, bool is_max) {
  kiln_tensor *a = n->saved[0], *b = n->saved[1];
  kiln_tensor *win = is_max ? kiln_gt(a, b) : kiln_lt(a, b);
  kiln_tensor *tie = kiln_eq(a, b);
  kiln_tensor *wa = kiln_add(kiln_to_dtype(win, g->dtype), kiln_mul_scalar(kiln_to_dtype(tie, g->dtype), 0.5));
  SET_GRAD(0, kiln_mul(g, wa));
  SET_GRAD(1, kiln_mul(g, kiln_add_scalar(kiln_neg(wa), 1.0)));
  return KILN_OK;
}
static kiln_status maximum_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) { return maxmin_bw(n, g, gi, true); }
static kiln_status minimum_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) { return maxmin_bw(n, g, gi, false); }

#define BINARY_AMP(fname, opname, kop, bw, attr_fields, n_attr_fields, attr_sz, amp_cls) \
  static const kiln__op op_##fname = {                                                    \
      .name = opname, .api = "kiln_" opname, .n_in = 2, .n_out = 1,                      \
      .amp = amp_cls, .n_kernels = 1, .kernels = {kop},                                   \
      .flags = kop == KILN__K_ADD || kop == KILN__K_SUB ? KILN__OP_RULE_READS_INPUTS : 0u, \
      .attrs = attr_fields, .n_attrs = n_attr_fields, .attr_size = attr_sz,               \
      .infer = binary_infer, .forward = binary_forward, .backward = bw,                   \
      .n_saved = 3, .save = binary_save};
#define BINARY_OP(fname, opname, kop, bw, attr_fields, n_attr_fields, attr_sz)         \
  BINARY_AMP(fname, opname, kop, bw, attr_fields, n_attr_fields, attr_sz, KILN__AMP_PROMOTE)
#define BINARY(fname, opname, kop, bw) BINARY_OP(fname, opname, kop, bw, NULL, 0, 0)

static kiln_tensor *binary(const kiln__op *op, kiln_tensor *a, kiln_tensor *b, const attrs_alpha *at) {
  kiln_tensor *in[2] = {a, b};
  return kiln__op_call(op, 2, in, at, NULL);
}

BINARY(add, "add", KILN__K_ADD, add_bw)
BINARY_OP(axpy, "axpy", KILN__K_ADD, add_bw, alpha_fields, 1, sizeof(attrs_alpha))
BINARY(sub, "sub", KILN__K_SUB, sub_bw)
BINARY(mul, "mul", KILN__K_MUL, mul_bw)
BINARY(div, "div", KILN__K_DIV, div_bw)
BINARY_AMP(pow, "pow", KILN__K_POW, pow_bw, NULL, 0, 0, KILN__AMP_F32) /* autocast: f32 */
BINARY(maximum, "maximum", KILN__K_MAXIMUM, maximum_bw)
BINARY(minimum, "minimum", KILN__K_MINIMUM, minimum_bw)
BINARY(eq, "eq", KILN__K_EQ, NULL)
BINARY(ne, "ne", KILN__K_NE, NULL)
BINARY(lt, "lt", KILN__K_LT, NULL)
BINARY(le, "le", KILN__K_LE, NULL)
BINARY(gt, "gt", KILN__K_GT, NULL)
BINARY(ge, "ge", KILN__K_GE, NULL)

kiln_tensor *kiln_add(kiln_tensor *a, kiln_tensor *b) { return binary(&op_add, a, b, NULL); }
kiln_tensor *kiln_axpy(kiln_tensor *a, double alpha, kiln_tensor *b) { return binary(&op_axpy, a, b, &(attrs_alpha){alpha}); }
kiln_tensor *kiln_sub(kiln_tensor *a, kiln_tensor *b) { return binary(&op_sub, a, b, NULL); }
kiln_tensor *kiln_mul(kiln_tensor *a, kiln_tensor *b) { return binary(&op_mul, a, b, NULL); }
kiln_tensor *kiln_div(kiln_tensor *a, kiln_tensor *b) { return binary(&op_div, a, b, NULL); }
kiln_tensor *kiln_pow(kiln_tensor *a, kiln_tensor *b) { return binary(&op_pow, a, b, NULL); }
kiln_tensor *kiln_maximum(kiln_tensor *a, kiln_tensor *b) { return binary(&op_maximum, a, b, NULL); }
kiln_tensor *kiln_minimum(kiln_tensor *a, kiln_tensor *b) { return binary(&op_minimum, a, b, NULL); }
kiln_tensor *kiln_eq(kiln_tensor *a, kiln_tensor *b) { return binary(&op_eq, a, b, NULL); }
kiln_tensor *kiln_ne(kiln_tensor *a, kiln_tensor *b) { return binary(&op_ne, a, b, NULL); }
kiln_tensor *kiln_lt(kiln_tensor *a, kiln_tensor *b) { return binary(&op_lt, a, b, NULL); }
kiln_tensor *kiln_le(kiln_tensor *a, kiln_tensor *b) { return binary(&op_le, a, b, NULL); }
kiln_tensor *kiln_gt(kiln_tensor *a, kiln_tensor *b) { return binary(&op_gt, a, b, NULL); }
kiln_tensor *kiln_ge(kiln_tensor *a, kiln_tensor *b) { return binary(&op_ge, a, b, NULL); }

static kiln_tensor *cmp_scalar(kiln_tensor *a, double s, kiln_tensor *(*cmp)(kiln_tensor *, kiln_tensor *)) {
  if (!a) return NULL;
  kiln_dtype dt = kiln_dtype_is_float(a->dtype) ? a->dtype : (s == floor(s) ? a->dtype : KILN_F64);
  if (dt == KILN_BOOL) dt = KILN_I64;
  kiln_tensor *b = kiln_scalar(s, dt, kiln_device_of(a));
  return b ? cmp(a, b) : NULL;
}
kiln_tensor *kiln_gt_scalar(kiln_tensor *a, double s) { return cmp_scalar(a, s, kiln_gt); }
kiln_tensor *kiln_lt_scalar(kiln_tensor *a, double s) { return cmp_scalar(a, s, kiln_lt); }
kiln_tensor *kiln_eq_scalar(kiln_tensor *a, double s) { return cmp_scalar(a, s, kiln_eq); }

/* ---- where ---- */
static kiln_status where_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *cond = n->saved[0];
  kiln_tensor *zero = kiln_zeros(KILN_SHAPE0, g->dtype, kiln_device_of(g));
  if (n->needs[1]) {
    gi[1] = to_input(n, 1, kiln_where(cond, g, zero));
    if (!gi[1]) return kiln_last_error();
  }
  if (n->needs[2]) {
    gi[2] = to_input(n, 2, kiln_where(cond, zero, g));
    if (!gi[2]) return kiln_last_error();
  }
  return KILN_OK;
}

static kiln_status where_infer(kiln__op_ctx *c) {
  kiln_tensor *cond = c->in[0], *a = c->in[1], *b = c->in[2];
  int nd1, nd;
  int64_t s1[KILN_MAX_DIMS], shape[KILN_MAX_DIMS];
  if (kiln__broadcast_shape("kiln_where", a, b, &nd1, s1) != KILN_OK ||
      kiln__broadcast_shapes("kiln_where", cond->ndim, cond->shape, nd1, s1, &nd, shape) != KILN_OK)
    return kiln_last_error();
  kiln_dtype ct = kiln_dtype_promote(a->dtype, b->dtype);
  kiln__op_meta(c, 0, nd, shape, ct);
  kiln__op_meta_keep_format(c, 0, a);
  kiln__op_meta_keep_format(c, 0, b);
  kiln__op_meta_keep_format(c, 0, cond);
  c->differentiable = kiln_dtype_is_float(ct);
  return KILN_OK;
}

static kiln_status where_forward(kiln__op_ctx *c) {
  kiln_tensor *out = c->out[0];
  kiln_tensor *ca = kiln__as_dtype_nograd(c->in[1], out->dtype);
  kiln_tensor *cb = kiln__as_dtype_nograd(c->in[2], out->dtype);
  if (!ca || !cb) return kiln_last_error();
  kiln__kargs k = {0};
  k.op = KILN__K_WHERE;
  k.n_in = 3;
  k.in[0] = kiln__view_broadcast(c->in[0], out->ndim, out->shape);
  k.in[1] = kiln__view_broadcast(ca, out->ndim, out->shape);
  k.in[2] = kiln__view_broadcast(cb, out->ndim, out->shape);
  return kiln__run_into(out, &k);
}

static void where_save(kiln__op_ctx *c, kiln__node *n) { kiln__node_save(n, 0, c->in[0]); }

static const kiln__op op_where = {
    .name = "where", .api = "kiln_where", .n_in = 3, .n_out = 1, .amp = KILN__AMP_PROMOTE,
    .n_kernels = 1, .kernels = {KILN__K_WHERE}, .infer = where_infer, .forward = where_forward,
    .backward = where_bw, .n_saved = 1, .save = where_save};

kiln_tensor *kiln_where(kiln_tensor *cond, kiln_tensor *a, kiln_tensor *b) {
  kiln_tensor *in[3] = {cond, a, b};
  return kiln__op_call(&op_where, 3, in, NULL, NULL);
}

/* ---- unary ---- */
/* Every unary op's record: up to two scalars, named per op by its field table. */
typedef struct attrs_2f {
  double a, b;
} attrs_2f;
static double attr_a(const kiln__node *n) { return n->attrs ? ((const attrs_2f *)n->attrs)->a : 0.0; }
static double attr_b(const kiln__node *n) { return n->attrs ? ((const attrs_2f *)n->attrs)->b : 0.0; }

static kiln_status unary_infer(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0];
  if ((c->op->flags & KILN__OP_FLOAT_ONLY) && !kiln_dtype_is_float(t->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: expected a floating tensor, got %s %s", c->op->api,
                          kiln_dtype_name(t->dtype), kiln__tshape(t));
  kiln__op_meta_like(c, 0, t, t->dtype);
  kiln__op_meta_keep_format(c, 0, t);
  c->differentiable = c->differentiable && kiln_dtype_is_float(t->dtype);
  return KILN_OK;
}

static kiln_status unary_forward(kiln__op_ctx *c) {
  const attrs_2f *p = c->attrs;
  kiln__kargs k = {0};
  k.op = c->op->kernels[0];
  k.n_in = 1;
  k.in[0] = kiln__view_of(c->in[0]);
  k.s[0] = p ? p->a : 0.0;
  k.s[1] = p ? p->b : 0.0;
  return kiln__run_into(c->out[0], &k);
}

/* x in slot 0; ops whose rule reads the output (exp, sqrt, rsqrt, sigmoid, tanh) have
** n_saved 2 and keep only the output, in slot 1. Rules that read nothing (neg, the affine
** add_scalar and mul_scalar) keep nothing. ReLU keeps its output in slot 0 instead of its
** input: y > 0 exactly where x > 0, so the backward kernel and the gradient mask it hands
** a BN or linear (relu_bw) read the same, and y is what the next layer saves anyway
** (PyTorch's threshold_backward reads the result too). Saving x held ResNet's batch-norm
** outputs, which nothing else needs, to the end of the step. */
static void unary_save(kiln__op_ctx *c, kiln__node *n) {
  kiln__kop k = c->op->kernels[0];
  if (k == KILN__K_NEG || k == KILN__K_AFFINE) return;
  if (k == KILN__K_RELU) {
    kiln__node_save_output(n, 0);
    return;
  }
  if (c->op->n_saved > 1) {
    kiln__node_save_output(n, 1);
    return;
  }
  kiln__node_save(n, 0, c->in[0]);
}

/* Backward through a dedicated kernel: grad_in = K(saved x or y, g). */
static kiln_status kernel_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi, kiln__kop op, int saved) {
  kiln_tensor *x = n->saved[saved];
  /* in the layout of the gradient (a channels-last network stays so in backward) */
  kiln_tensor *out = kiln__is_channels_last(g) && g->ndim == x->ndim &&
                             !memcmp(g->shape, x->shape, sizeof(int64_t) * (size_t)x->ndim)
                         ? kiln__tensor_new_like_format(g, x->dtype)
                         : kiln__tensor_new_like_format(x, x->dtype);
  if (!out) return kiln_last_error();
  kiln__kargs k = {0};
  k.op = op;
  k.n_in = 2;
  k.in[0] = kiln__view_of(x);
  k.in[1] = kiln__view_of(g);
  k.s[0] = attr_a(n);
  k.s[1] = attr_b(n);
  if (kiln__run_into(out, &k) != KILN_OK) return kiln_last_error();
  gi[0] = kiln_keep(out);
  return KILN_OK;
}

#define KERNEL_BW(fn, kop, saved)                                                         \
  static kiln_status fn(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {                \
    return kernel_bw(n, g, gi, kop, saved);                                               \
  }
/* ReLU after an op that can read its gradient through a mask (linear: the mask folds
** into its two products, as linear_relu's does): when this ReLU is the only way gradient
** reaches that op (kiln__grad_mask_ok), hand it the gradient unmasked with x as the mask
** (x > 0 exactly where ReLU passes gradient) and run no kernel. A program's own Linear
** then ReLU gets the fused backward this way; the forward stays two ops. */
static kiln_status relu_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln__node *m = n->next[0].node;
  if (m && m->op && (m->op->flags & KILN__OP_GRAD_MASK) && kiln__grad_mask_ok(m, n->next[0].index)) {
    m->grad_mask = kiln_tensor_ref(n->saved[0]);
    return kiln__give_grad(&gi[0], g, g);
  }
  return kernel_bw(n, g, gi, KILN__K_RELU_BACKWARD, 0);
}
KERNEL_BW(leaky_relu_bw, KILN__K_LEAKY_RELU_BACKWARD, 0)
KERNEL_BW(gelu_bw, KILN__K_GELU_BACKWARD, 0)
KERNEL_BW(gelu_tanh_bw, KILN__K_GELU_TANH_BACKWARD, 0)
KERNEL_BW(silu_bw, KILN__K_SILU_BACKWARD, 0)
KERNEL_BW(sigmoid_bw, KILN__K_SIGMOID_BACKWARD, 1)
KERNEL_BW(tanh_bw, KILN__K_TANH_BACKWARD, 1)
KERNEL_BW(softplus_bw, KILN__K_SOFTPLUS_BACKWARD, 0)
KERNEL_BW(clamp_bw, KILN__K_CLAMP_BACKWARD, 0)

#define SET0(expr)                                                                        \
  do {                                                                                    \
    gi[0] = kiln_keep(expr);                                                              \
    return gi[0] ? KILN_OK : kiln_last_error();                                           \
  } while (0)

static kiln_status neg_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) { KILN__UNUSED(n); SET0(kiln_neg(g)); }
static kiln_status exp_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) { SET0(kiln_mul(g, n->saved[1])); }
static kiln_status log_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) { SET0(kiln_div(g, n->saved[0])); }
static kiln_status sqrt_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  SET0(kiln_div(kiln_mul_scalar(g, 0.5), n->saved[1]));
}
static kiln_status rsqrt_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  /* d/dx x^-1/2 = -1/2 x^-3/2 = -1/2 y^3 */
  kiln_tensor *y = n->saved[1];
  SET0(kiln_mul(g, kiln_mul_scalar(kiln_mul(y, kiln_mul(y, y)), -0.5)));
}
static kiln_status abs_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi);
static kiln_status pow_scalar_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  double e = attr_a(n);
  if (e == 0.0) SET0(kiln_zeros_like(g));
  SET0(kiln_mul(g, kiln_mul_scalar(kiln_pow_scalar(n->saved[0], e - 1.0), e)));
}
static kiln_status affine_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  double s = attr_a(n);
  SET0(s == 1.0 ? kiln__scope_track(kiln_tensor_ref(g)) : kiln_mul_scalar(g, s));
}

static kiln_status neg_infer(kiln__op_ctx *c) {
  if (c->in[0]->dtype == KILN_BOOL)
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_neg: negation of a bool tensor is not supported");
  return unary_infer(c);
}
static kiln_status clamp_infer(kiln__op_ctx *c) {
  const attrs_2f *p = c->attrs;
  if (p->a > p->b) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_clamp: lo %g is above hi %g", p->a, p->b);
  return unary_infer(c);
}
static kiln_status softplus_infer(kiln__op_ctx *c) {
  if (((const attrs_2f *)c->attrs)->a == 0)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_softplus: beta must not be 0");
  return unary_infer(c);
}

/* Field tables naming each op's scalars. The affine kernel (in*a + b) serves both
** mul_scalar and add_scalar; the trace names only the scalar the user gave. */
static const kiln__attr_field f_clamp[] = {{"min", KILN__A_FLOAT, offsetof(attrs_2f, a), 0, NULL},
                                           {"max", KILN__A_FLOAT, offsetof(attrs_2f, b), 0, NULL}};
static const kiln__attr_field f_slope[] = {{"negative_slope", KILN__A_FLOAT, offsetof(attrs_2f, a), 0, NULL}};
static const kiln__attr_field f_exponent[] = {{"exponent", KILN__A_FLOAT, offsetof(attrs_2f, a), 0, NULL}};
static const kiln__attr_field f_scale[] = {{"value", KILN__A_FLOAT, offsetof(attrs_2f, a), 0, NULL}};
static const kiln__attr_field f_shift[] = {{"value", KILN__A_FLOAT, offsetof(attrs_2f, b), 0, NULL}};
static const kiln__attr_field f_softplus[] = {{"beta", KILN__A_FLOAT, offsetof(attrs_2f, a), 0, NULL},
                                              {"threshold", KILN__A_FLOAT, offsetof(attrs_2f, b), 0, NULL}};

/* UNARY(c name, op name, kernel, infer, flags, rule, saved slots, field table, count) */
#define UNARY_AMP(fname, opname, kop, inf, fl, bw, nsaved, fields, nfields, amp_cls)     \
  static const kiln__op op_##fname = {                                                    \
      .name = opname, .api = "kiln_" opname, .n_in = 1, .n_out = 1, .flags = fl,         \
      .amp = amp_cls,                                                                     \
      .n_kernels = 1, .kernels = {kop}, .attrs = fields, .n_attrs = nfields,              \
      .attr_size = nfields ? sizeof(attrs_2f) : 0, .infer = inf, .forward = unary_forward, \
      .backward = bw, .n_saved = nsaved, .save = unary_save};
#define UNARY(fname, opname, kop, inf, fl, bw, nsaved, fields, nfields)                  \
  UNARY_AMP(fname, opname, kop, inf, fl, bw, nsaved, fields, nfields, KILN__AMP_NONE)
/* the ones autocast runs in f32 (PyTorch's fp32 list) */
#define UNARY_F32(fname, opname, kop, inf, fl, bw, nsaved, fields, nfields)              \
  UNARY_AMP(fname, opname, kop, inf, fl, bw, nsaved, fields, nfields, KILN__AMP_F32)
#define FLOAT_ONLY KILN__OP_FLOAT_ONLY

UNARY(neg, "neg", KILN__K_NEG, neg_infer, 0, neg_bw, 1, NULL, 0)
UNARY(sign, "sign", KILN__K_SIGN, unary_infer, 0, NULL, 0, NULL, 0)
UNARY_F32(exp, "exp", KILN__K_EXP, unary_infer, FLOAT_ONLY, exp_bw, 2, NULL, 0)
UNARY_F32(log, "log", KILN__K_LOG, unary_infer, FLOAT_ONLY, log_bw, 1, NULL, 0)
UNARY(sqrt, "sqrt", KILN__K_SQRT, unary_infer, FLOAT_ONLY, sqrt_bw, 2, NULL, 0)
UNARY_F32(rsqrt, "rsqrt", KILN__K_RSQRT, unary_infer, FLOAT_ONLY, rsqrt_bw, 2, NULL, 0)
UNARY(abs, "abs", KILN__K_ABS, unary_infer, 0, abs_bw, 1, NULL, 0)
UNARY(clamp, "clamp", KILN__K_CLAMP, clamp_infer, 0, clamp_bw, 1, f_clamp, 2)
UNARY_F32(pow_scalar, "pow_scalar", KILN__K_POW_SCALAR, unary_infer, FLOAT_ONLY, pow_scalar_bw, 1, f_exponent, 1)
UNARY(add_scalar, "add_scalar", KILN__K_AFFINE, unary_infer, 0, affine_bw, 1, f_shift, 1)
UNARY(mul_scalar, "mul_scalar", KILN__K_AFFINE, unary_infer, 0, affine_bw, 1, f_scale, 1)
UNARY(relu, "relu", KILN__K_RELU, unary_infer, FLOAT_ONLY, relu_bw, 1, NULL, 0)
UNARY(leaky_relu, "leaky_relu", KILN__K_LEAKY_RELU, unary_infer, FLOAT_ONLY, leaky_relu_bw, 1, f_slope, 1)
UNARY(gelu, "gelu", KILN__K_GELU, unary_infer, FLOAT_ONLY, gelu_bw, 1, NULL, 0)
UNARY(gelu_tanh, "gelu_tanh", KILN__K_GELU_TANH, unary_infer, FLOAT_ONLY, gelu_tanh_bw, 1, NULL, 0)
UNARY(silu, "silu", KILN__K_SILU, unary_infer, FLOAT_ONLY, silu_bw, 1, NULL, 0)
UNARY(sigmoid, "sigmoid", KILN__K_SIGMOID, unary_infer, FLOAT_ONLY, sigmoid_bw, 2, NULL, 0)
UNARY(tanh, "tanh", KILN__K_TANH, unary_infer, FLOAT_ONLY, tanh_bw, 2, NULL, 0)
UNARY_F32(softplus, "softplus", KILN__K_SOFTPLUS, softplus_infer, FLOAT_ONLY, softplus_bw, 1, f_softplus, 2)

static kiln_tensor *unary(const kiln__op *op, kiln_tensor *t, double a, double b) {
  attrs_2f p = {a, b};
  return kiln__op_call(op, 1, &t, op->n_attrs ? &p : NULL, NULL);
}

static kiln_status abs_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  SET0(kiln_mul(g, unary(&op_sign, n->saved[0], 0, 0)));
}

kiln_tensor *kiln_neg(kiln_tensor *t) { return unary(&op_neg, t, 0, 0); }
kiln_tensor *kiln_exp(kiln_tensor *t) { return unary(&op_exp, t, 0, 0); }
kiln_tensor *kiln_log(kiln_tensor *t) { return unary(&op_log, t, 0, 0); }
kiln_tensor *kiln_sqrt(kiln_tensor *t) { return unary(&op_sqrt, t, 0, 0); }
kiln_tensor *kiln_rsqrt(kiln_tensor *t) { return unary(&op_rsqrt, t, 0, 0); }
kiln_tensor *kiln_abs(kiln_tensor *t) { return unary(&op_abs, t, 0, 0); }
kiln_tensor *kiln_clamp(kiln_tensor *t, double lo, double hi) { return unary(&op_clamp, t, lo, hi); }
kiln_tensor *kiln_pow_scalar(kiln_tensor *t, double e) { return unary(&op_pow_scalar, t, e, 0); }
kiln_tensor *kiln_add_scalar(kiln_tensor *a, double s) { return unary(&op_add_scalar, a, 1.0, s); }
kiln_tensor *kiln_mul_scalar(kiln_tensor *a, double s) { return unary(&op_mul_scalar, a, s, 0.0); }
kiln_tensor *kiln_relu(kiln_tensor *t) { return unary(&op_relu, t, 0, 0); }
kiln_tensor *kiln_leaky_relu(kiln_tensor *t, double slope) { return unary(&op_leaky_relu, t, slope, 0); }
kiln_tensor *kiln_gelu(kiln_tensor *t) { return unary(&op_gelu, t, 0, 0); }
kiln_tensor *kiln_gelu_tanh(kiln_tensor *t) { return unary(&op_gelu_tanh, t, 0, 0); }
kiln_tensor *kiln_silu(kiln_tensor *t) { return unary(&op_silu, t, 0, 0); }
kiln_tensor *kiln_sigmoid(kiln_tensor *t) { return unary(&op_sigmoid, t, 0, 0); }
kiln_tensor *kiln_tanh(kiln_tensor *t) { return unary(&op_tanh, t, 0, 0); }
kiln_tensor *kiln_softplus(kiln_tensor *t, double beta, double threshold) {
  return unary(&op_softplus, t, beta, threshold);
}

/* ---- copies: clone, to_dtype, to_device ---- */
/* The gradient goes back in the input's dtype and to its device. A conversion's result is
** handed over as the only reference (kiln__give_grad), so the engine can make it a leaf's
** .grad as it is: an identity kiln_to_device on top of it added a second reference, and
** every autocast weight's gradient was copied once more (a clone per parameter a step). */
static kiln_status copy_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_device in_dev = {(kiln_device_type)n->i[0], (int)n->i[1]};
  kiln_tensor *r = kiln_to_dtype(g, n->in_dtype[0]);
  if (r && !kiln_device_equal(kiln_device_of(r), in_dev)) r = kiln_to_device(r, in_dev);
  return kiln__give_grad(&gi[0], r, g);
}

/* dst (contiguous, any device) <- src (any strides, any device), converting dtypes. */
static kiln_status copy_between(kiln_tensor *dst, kiln_tensor *src) {
  kiln_device sd = kiln_device_of(src), dd = kiln_device_of(dst);
  if (kiln_numel(dst) == 0) return KILN_OK;
  kiln__kargs k = {0};
  k.op = KILN__K_COPY;
  k.n_in = k.n_out = 1;
  if (kiln_device_equal(sd, dd)) {
    k.in[0] = kiln__view_of(src);
    k.out[0] = kiln__view_of(dst);
    return kiln__dispatch(dd, &k);
  }
  /* Across devices: convert and compact on the source, then one transfer. Through the
  ** host when neither side is the CPU. */
  kiln_status st;
  kiln_scope_begin();
  bool prev = kiln_set_grad_enabled(false);
  /* already compact and of the right dtype (a loader's batch): transferred as it is */
  bool as_is = src->dtype == dst->dtype && kiln_is_contiguous(src);
  kiln_tensor *c = as_is ? src : kiln__tensor_new(src->ndim, src->shape, dst->dtype, sd);
  st = c ? KILN_OK : kiln_last_error();
  if (st == KILN_OK && !as_is) {
    k.in[0] = kiln__view_of(src);
    k.out[0] = kiln__view_of(c);
    st = kiln__dispatch(sd, &k);
  }
  size_t nb = kiln_nbytes(dst);
  if (st == KILN_OK) {
    if (sd.type == KILN_DEVICE_CPU) {
      st = dst->storage->backend->copy_from_host(dd.index, kiln__view_of(dst).data, kiln__view_of(c).data, nb);
    } else if (dd.type == KILN_DEVICE_CPU) {
      st = c->storage->backend->copy_to_host(sd.index, kiln__view_of(dst).data, kiln__view_of(c).data, nb);
    } else {
      kiln_tensor *h = kiln__tensor_new(c->ndim, c->shape, c->dtype, kiln_device_cpu());
      st = h ? c->storage->backend->copy_to_host(sd.index, kiln__view_of(h).data, kiln__view_of(c).data, nb) : kiln_last_error();
      if (st == KILN_OK)
        st = dst->storage->backend->copy_from_host(dd.index, kiln__view_of(dst).data, kiln__view_of(h).data, nb);
    }
  }
  kiln_set_grad_enabled(prev);
  kiln_scope_end();
  return st;
}

/* clone, to_dtype and to_device: one forward (a copy into a new contiguous tensor of the
** record's dtype on the record's device), three names. */
typedef struct attrs_to {
  kiln_dtype dtype;
  kiln_device device;
} attrs_to;
static const kiln__attr_field f_to_dtype[] = {KILN__FIELD(attrs_to, dtype, KILN__A_DTYPE)};
static const kiln__attr_field f_to_device[] = {KILN__FIELD(attrs_to, device, KILN__A_DEVICE)};

static const kiln__op op_contiguous;
static kiln_status to_infer(kiln__op_ctx *c) {
  const attrs_to *p = c->attrs;
  if ((int)p->dtype < 0 || p->dtype >= KILN_DTYPE__COUNT)
    return kiln_set_error(KILN_ERR_DTYPE, "%s: invalid dtype %d", c->op->api, (int)p->dtype);
  if (!kiln_device_equal(p->device, c->device) && kiln__check_device(p->device, c->op->api) != KILN_OK)
    return kiln_last_error();
  kiln__op_meta_like(c, 0, c->in[0], p->dtype);
  /* casts and clone keep the memory format (PyTorch's preserve_format); contiguous and
  ** moves to another device give contiguous memory */
  if (c->op != &op_contiguous && kiln_device_equal(p->device, c->device))
    kiln__op_meta_keep_format(c, 0, c->in[0]);
  c->device = p->device;
  c->differentiable = kiln_dtype_is_float(p->dtype);
  return KILN_OK;
}
static kiln_status to_forward(kiln__op_ctx *c) { return copy_between(c->out[0], c->in[0]); }
static void to_save(kiln__op_ctx *c, kiln__node *n) {
  kiln_device sd = kiln_device_of(c->in[0]);
  n->i[0] = sd.type;
  n->i[1] = sd.index;
}
#define TO_OP(fname, opname, fields, nfields)                                             \
  static const kiln__op op_##fname = {                                                    \
      .name = opname, .api = "kiln_" opname, .n_in = 1, .n_out = 1, .n_kernels = 1,      \
      .kernels = {KILN__K_COPY}, .attrs = fields, .n_attrs = nfields,                     \
      .attr_size = sizeof(attrs_to), .infer = to_infer, .forward = to_forward,            \
      .backward = copy_bw, .save = to_save};
TO_OP(clone, "clone", NULL, 0)
TO_OP(contiguous, "contiguous", NULL, 0)
TO_OP(to_dtype, "to_dtype", f_to_dtype, 1)
TO_OP(to_device, "to_device", f_to_device, 1)

static kiln_tensor *copy_to(const kiln__op *op, kiln_tensor *t, kiln_dtype dt, kiln_device dev) {
  attrs_to p = {dt, dev};
  return kiln__op_call(op, 1, &t, &p, NULL);
}

kiln_tensor *kiln_clone(kiln_tensor *t) {
  return t ? copy_to(&op_clone, t, t->dtype, kiln_device_of(t)) : copy_to(&op_clone, t, KILN_F32, kiln_device_cpu());
}

/* The three conversions hand back t itself (a new reference) when there is nothing to
** do, as PyTorch's .contiguous(), .to() do; that is not an op, and a trace shows none. */
kiln_tensor *kiln_contiguous(kiln_tensor *t) {
  if (t && kiln_is_contiguous(t)) return kiln__scope_track(kiln_tensor_ref(t));
  return t ? copy_to(&op_contiguous, t, t->dtype, kiln_device_of(t)) : NULL;
}

kiln_tensor *kiln_to_dtype(kiln_tensor *t, kiln_dtype dt) {
  if (t && dt == t->dtype) return kiln__scope_track(kiln_tensor_ref(t));
  return t ? copy_to(&op_to_dtype, t, dt, kiln_device_of(t)) : NULL;
}

kiln_tensor *kiln_to_device(kiln_tensor *t, kiln_device dev) {
  if (t && kiln_device_equal(dev, kiln_device_of(t))) return kiln__scope_track(kiln_tensor_ref(t));
  return t ? copy_to(&op_to_device, t, t->dtype, dev) : NULL;
}

/* ---- to_dtype_many: several casts to one dtype in one kernel call ----
** Autocast's casts of one op's inputs (a layer's weight and bias) and, in its backward,
** of their gradients back (one CAST_MULTI call each way where the device has it; COPY
** per pair otherwise, the same numbers). One node for the first n_grad outputs (all
** when n_grad is 0): autocast puts the inputs that need a gradient first, so that the
** batch, cast in the same kernel, is not made to need one. Internal: kiln__to_dtype_many. */
typedef struct attrs_to_many {
  kiln_dtype dtype;
  int n_grad;
} attrs_to_many;
static const kiln__attr_field f_to_many[] = {KILN__FIELD(attrs_to_many, dtype, KILN__A_DTYPE)};

/* dst[k] <- src[k] converted, on dev (the same device for all). */
static kiln_status cast_pairs(kiln_device dev, int n, kiln_tensor *const *src, kiln_tensor *const *dst) {
  kiln__view list[2 * KILN__OP_MAX_OUT];
  int m = 0;
  bool contiguous = true;
  for (int k = 0; k < n; k++) {
    if (kiln_numel(dst[k]) == 0) continue;
    contiguous = contiguous && kiln_is_contiguous(src[k]);
    list[2 * m] = kiln__view_of(src[k]);
    list[2 * m + 1] = kiln__view_of(dst[k]);
    m++;
  }
  kiln__kargs a = {0};
  a.op = KILN__K_CAST_MULTI;
  a.list_n = m;
  a.list_w = 2;
  a.list = list;
  if (m > 1 && contiguous && kiln__dispatch_has(dev, &a, KILN__K_CAST_MULTI)) return kiln__dispatch(dev, &a);
  for (int k = 0; k < n; k++) {
    kiln_status st = copy_between(dst[k], src[k]);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

static kiln_status to_many_infer(kiln__op_ctx *c) {
  const attrs_to_many *p = c->attrs;
  if (c->n_in < 1 || c->n_in > KILN__OP_MAX_OUT)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: 1 to %d tensors, got %d", c->op->api, KILN__OP_MAX_OUT,
                          c->n_in);
  if (!kiln_dtype_is_float(p->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: casts to a floating dtype, not %s", c->op->api, kiln_dtype_name(p->dtype));
  c->n_out = c->n_in;
  c->n_node_out = p->n_grad;
  for (int k = 0; k < c->n_in; k++) kiln__op_meta_like(c, k, c->in[k], p->dtype);
  return KILN_OK;
}
static kiln_status to_many_forward(kiln__op_ctx *c) { return cast_pairs(c->device, c->n_in, c->in, c->out); }

/* Each gradient back to its input's dtype, again in one call. */
static kiln_status to_many_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *src[KILN__OP_MAX_OUT], *dst[KILN__OP_MAX_OUT];
  int idx[KILN__OP_MAX_OUT], m = 0;
  kiln_device dev = kiln_device_cpu();
  for (int k = 0; k < n->n_in && k < n->n_out; k++) {
    kiln_tensor *gk = k == 0 ? g : n->grad_outs[k];
    if (!n->needs[k] || !gk) continue;
    if (gk->dtype == n->in_dtype[k]) { /* given in the input's dtype already (kiln__grad_dtype) */
      kiln_status st = kiln__give_grad(&gi[k], gk, g);
      if (st != KILN_OK) return st;
      continue;
    }
    if (!kiln_is_contiguous(gk)) { /* a channels-last gradient: to_dtype keeps its layout */
      kiln_status st = kiln__give_grad(&gi[k], kiln_to_dtype(gk, n->in_dtype[k]), g);
      if (st != KILN_OK) return st;
      continue;
    }
    dev = kiln_device_of(gk);
    dst[m] = kiln__tensor_new(gk->ndim, gk->shape, n->in_dtype[k], dev);
    if (!dst[m]) return kiln_last_error();
    src[m] = gk;
    idx[m++] = k;
  }
  kiln_status st = m ? cast_pairs(dev, m, src, dst) : KILN_OK;
  for (int j = 0; j < m && st == KILN_OK; j++) st = kiln__give_grad(&gi[idx[j]], dst[j], g);
  return st;
}

static const kiln__op op_to_dtype_many = {
    .name = "to_dtype_many", .api = "kiln__to_dtype_many", .n_in = KILN__OP_VARIADIC, .n_out = KILN__OP_MAX_OUT,
    .n_kernels = 2, .kernels = {KILN__K_CAST_MULTI, KILN__K_COPY}, .attrs = f_to_many, .n_attrs = 1,
    .attr_size = sizeof(attrs_to_many), .infer = to_many_infer, .forward = to_many_forward, .backward = to_many_bw};

/* ---- amp_copy: autocast's kept 16-bit copies of parameters, as if cast now ----
** The fused optimizers rewrite a parameter's copy (t->amp_copy) with each update and stamp
** it valid (ops_optim.c); autocast then hands the op an alias of the copy through this op
** instead of casting: no kernel, and the same node as to_dtype_many's (its rule, the
** parameters' gradients back in f32). Inputs without a copy (NULL copies[k]; the op's
** batch, which needs no gradient: after those with one) are cast in the same call, so a
** layer's casts stay one op call. Internal: kiln__amp_copy_many. */
typedef struct attrs_amp_copy {
  kiln_dtype dtype;
  kiln_tensor *const *copies; /* not an attribute: copies[k] stands for input k */
} attrs_amp_copy;
static const kiln__attr_field f_amp_copy[] = {KILN__FIELD(attrs_amp_copy, dtype, KILN__A_DTYPE)};

static kiln_status amp_copy_infer(kiln__op_ctx *c) {
  const attrs_amp_copy *p = c->attrs;
  if (c->n_in < 1 || c->n_in > KILN__OP_MAX_OUT)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: 1 to %d tensors, got %d", c->op->api, KILN__OP_MAX_OUT,
                          c->n_in);
  int n_copies = 0;
  for (int k = 0; k < c->n_in; k++) {
    const kiln_tensor *t = c->in[k], *cp = p->copies[k];
    if (!cp) continue;
    if (k != n_copies++ || cp->dtype != p->dtype || cp->ndim != t->ndim ||
        memcmp(cp->shape, t->shape, (size_t)t->ndim * sizeof(int64_t)) != 0)
      return kiln_set_error(KILN_ERR_INTERNAL, "%s: copy %d does not match its tensor %s (or follows a cast)",
                            c->op->api, k, kiln__tshape(t));
  }
  for (int k = 0; k < c->n_in; k++) kiln__op_meta_like(c, k, c->in[k], p->dtype);
  c->n_out = c->n_in;
  c->n_node_out = n_copies; /* the cast inputs need no gradient */
  return KILN_OK;
}
static kiln_status amp_copy_forward(kiln__op_ctx *c) {
  const attrs_amp_copy *p = c->attrs;
  for (int k = 0; k < c->n_in; k++) {
    if (p->copies[k]) {
      c->out[k] = kiln__tensor_alias(p->copies[k], true);
    } else if ((c->out[k] = kiln__tensor_new_like_format(c->in[k], p->dtype))) {
      kiln_status st = copy_between(c->out[k], c->in[k]);
      if (st != KILN_OK) return st;
    }
    if (!c->out[k]) return kiln_last_error();
  }
  return KILN_OK;
}
static const kiln__op op_amp_copy = {
    .name = "amp_copy", .api = "kiln__amp_copy_many", .n_in = KILN__OP_VARIADIC, .n_out = KILN__OP_MAX_OUT,
    .flags = KILN__OP_SELF_ALLOC, .n_kernels = 1, .kernels = {KILN__K_COPY}, .attrs = f_amp_copy, .n_attrs = 1, .attr_size = sizeof(attrs_amp_copy),
    .infer = amp_copy_infer, .forward = amp_copy_forward, .backward = to_many_bw};

kiln_status kiln__amp_copy_many(int n, kiln_tensor *const *ins, kiln_tensor *const *copies, kiln_dtype dt,
                                kiln_tensor **outs) {
  attrs_amp_copy p = {dt, copies};
  for (int k = 0; k < n && k < KILN__OP_MAX_OUT; k++) outs[k] = NULL;
  return kiln__op_call(&op_amp_copy, n, ins, &p, outs) ? KILN_OK : kiln_last_error();
}

/* The dtype in which n's rule may give input i's gradient. When input i is a cast's
** output (to_dtype, or to_dtype_many: autocast's casts of a parameter) from an f32 tensor
** to f16/bf16, the cast's rule only converts the gradient back to f32: a rule that can
** write its product in f32 straight away (linear's weight and bias gradients: the f32
** accumulator, unrounded) saves that kernel, and the cast's rule then hands it on as it
** is. Not when the program sees the cast output's gradient (retained, or asked for by
** kiln_autograd_grad): it would be an f32 gradient of a 16-bit tensor. Otherwise input
** i's own dtype. */
kiln_dtype kiln__grad_dtype(const kiln__node *n, int i) {
  const kiln__edge *e = &n->next[i];
  kiln_dtype own = n->in_dtype[i];
  const kiln__node *c = e->node;
  if (!c || (own != KILN_F16 && own != KILN_BF16) ||
      (c->op != &op_to_dtype && c->op != &op_to_dtype_many && c->op != &op_amp_copy) ||
      e->index >= c->n_in || c->in_dtype[e->index] != KILN_F32)
    return own;
  if (kiln__grad_shown(c, e->index)) return own;
  return KILN_F32;
}

kiln_status kiln__to_dtype_many(int n, kiln_tensor *const *ins, kiln_dtype dt, int n_grad, kiln_tensor **outs) {
  attrs_to_many p = {dt, n_grad};
  for (int k = 0; k < n && k < KILN__OP_MAX_OUT; k++) outs[k] = NULL;
  return kiln__op_call(&op_to_dtype_many, n, ins, &p, outs) ? KILN_OK : kiln_last_error();
}

/* ---- in-place updates (never recorded) ---- */
static kiln_status inplace_ok(const char *op, kiln_tensor *t) {
  if (!t) {
    if (kiln_last_error() == KILN_OK) kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL tensor", op);
    return kiln_last_error();
  }
  if (t->requires_grad && kiln_grad_enabled())
    return kiln_set_error(KILN_ERR_AUTOGRAD,
                          "%s: in-place update of a tensor that requires grad while grad mode is on "
                          "(wrap it in kiln_set_grad_enabled(false))",
                          op);
  return KILN_OK;
}

/* An in-place op of two inputs (copy_, axpy_): the destination in[0] may be updated, and
** the source in[1] broadcasts to its shape (the destination's shape does not grow). */
static kiln_status inplace_from_infer(kiln__op_ctx *c) {
  const char *op = c->op->api;
  kiln_tensor *dst = c->in[0], *src = c->in[1];
  if (inplace_ok(op, dst) != KILN_OK) return kiln_last_error();
  int nd;
  int64_t shape[KILN_MAX_DIMS];
  if (kiln__broadcast_shape(op, dst, src, &nd, shape) != KILN_OK) return kiln_last_error();
  if (nd != dst->ndim || memcmp(shape, dst->shape, (size_t)nd * sizeof(int64_t)) != 0)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: source %s does not broadcast to destination %s", op, kiln__tshape(src),
                          kiln__tshape(dst));
  return KILN_OK;
}

/* dst <- src broadcast, converting the dtype; src may be on another device. */
static kiln_status copy__forward(kiln__op_ctx *c) {
  kiln_tensor *dst = c->in[0], *src = c->in[1];
  int nd = dst->ndim;
  const int64_t *shape = dst->shape;
  if (kiln_numel(dst) == 0) return KILN_OK;
  kiln_device sd = kiln_device_of(src), dd = kiln_device_of(dst);
  kiln__kargs k = {0};
  k.op = KILN__K_COPY;
  k.n_in = k.n_out = 1;
  k.out[0] = kiln__view_of(dst);
  if (kiln_device_equal(sd, dd)) {
    k.in[0] = kiln__view_broadcast(src, nd, shape);
    return kiln__dispatch(dd, &k);
  }
  /* another device, same shape, dst compact: one transfer straight into dst */
  if (nd == src->ndim && memcmp(src->shape, shape, (size_t)nd * sizeof(int64_t)) == 0 && kiln_is_contiguous(dst))
    return copy_between(dst, src);
  /* otherwise bring src over (contiguous, dst dtype), then a local strided copy */
  kiln_scope_begin();
  bool prev = kiln_set_grad_enabled(false);
  kiln_tensor *moved = kiln__tensor_new(src->ndim, src->shape, dst->dtype, dd);
  kiln_status st = moved ? copy_between(moved, src) : kiln_last_error();
  if (st == KILN_OK) {
    k.in[0] = kiln__view_broadcast(moved, nd, shape);
    st = kiln__dispatch(dd, &k);
  }
  kiln_set_grad_enabled(prev);
  kiln_scope_end();
  return st;
}

/* fill_ and mul_scalar_ : the record's scalars. */
static kiln_status scalar__infer(kiln__op_ctx *c) { return inplace_ok(c->op->api, c->in[0]); }
static kiln_status fill__forward(kiln__op_ctx *c) {
  kiln__kargs k = {0};
  k.op = KILN__K_FILL;
  k.s[0] = ((const attrs_2f *)c->attrs)->a;
  return kiln__run_into(c->in[0], &k);
}
/* t = a t + b in place (mul_scalar_: b 0; add_scalar_: a 1) */
static kiln_status affine__forward(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0];
  kiln__kargs k = {0};
  k.op = KILN__K_AFFINE;
  k.n_in = 1;
  k.in[0] = kiln__view_of(t); /* elementwise in place: each element read before written */
  k.s[0] = ((const attrs_2f *)c->attrs)->a;
  k.s[1] = ((const attrs_2f *)c->attrs)->b;
  return kiln__run_into(t, &k);
}

static kiln_status axpy__forward(kiln__op_ctx *c) {
  kiln_tensor *t = c->in[0], *x = c->in[1];
  kiln_scope_begin();
  kiln_tensor *cx = kiln__as_dtype_nograd(x, t->dtype);
  kiln_status st = cx ? KILN_OK : kiln_last_error();
  if (st == KILN_OK) {
    kiln__kargs k = {0};
    k.op = KILN__K_ADD;
    k.n_in = 2;
    k.in[0] = kiln__view_of(t);
    k.in[1] = kiln__view_broadcast(cx, t->ndim, t->shape);
    k.s[0] = ((const attrs_alpha *)c->attrs)->alpha;
    st = kiln__run_into(t, &k);
  }
  kiln_scope_end();
  return st;
}

static const kiln__attr_field f_fill[] = {{"value", KILN__A_FLOAT, offsetof(attrs_2f, a), 0, NULL}};
#define INPLACE_OP(fname, opname, nin, kop, inf, fwd, fields, nfields, asz, fl)            \
  static const kiln__op op_##fname = {                                                    \
      .name = opname, .api = "kiln_" opname, .n_in = nin, .n_out = 1,                    \
      .flags = KILN__OP_INPLACE | fl, .n_kernels = 1, .kernels = {kop}, .attrs = fields,  \
      .n_attrs = nfields, .attr_size = asz, .infer = inf, .forward = fwd};
INPLACE_OP(copy_, "copy_", 2, KILN__K_COPY, inplace_from_infer, copy__forward, NULL, 0, 0, KILN__OP_ANY_DEVICE)
INPLACE_OP(fill_, "fill_", 1, KILN__K_FILL, scalar__infer, fill__forward, f_fill, 1, sizeof(attrs_2f), 0)
INPLACE_OP(mul_scalar_, "mul_scalar_", 1, KILN__K_AFFINE, scalar__infer, affine__forward, f_scale, 1,
           sizeof(attrs_2f), 0)
INPLACE_OP(add_scalar_, "add_scalar_", 1, KILN__K_AFFINE, scalar__infer, affine__forward, f_shift, 1,
           sizeof(attrs_2f), 0)
INPLACE_OP(axpy_, "axpy_", 2, KILN__K_ADD, inplace_from_infer, axpy__forward, alpha_fields, 1, sizeof(attrs_alpha), 0)

/* NULL destinations are refused with a message of their own (a status return has no
** NULL to pass through). */
static kiln_status inplace(const kiln__op *op, int n, kiln_tensor *t, kiln_tensor *x, const void *attrs) {
  if (!t) return inplace_ok(op->api, t);
  if (n == 2 && !x)
    return kiln_last_error() != KILN_OK ? kiln_last_error()
                                        : kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL source", op->api);
  kiln_tensor *in[2] = {t, x};
  return kiln__op_call_status(op, n, in, attrs);
}

kiln_status kiln_copy_(kiln_tensor *dst, kiln_tensor *src) { return inplace(&op_copy_, 2, dst, src, NULL); }
kiln_status kiln_fill_(kiln_tensor *t, double value) { return inplace(&op_fill_, 1, t, NULL, &(attrs_2f){value, 0}); }
kiln_status kiln_zero_(kiln_tensor *t) { return kiln_fill_(t, 0.0); }
kiln_status kiln_mul_scalar_(kiln_tensor *t, double s) {
  return inplace(&op_mul_scalar_, 1, t, NULL, &(attrs_2f){s, 0});
}
kiln_status kiln_add_scalar_(kiln_tensor *t, double s) {
  return inplace(&op_add_scalar_, 1, t, NULL, &(attrs_2f){1.0, s});
}
kiln_status kiln_axpy_(kiln_tensor *t, double alpha, kiln_tensor *x) {
  return inplace(&op_axpy_, 2, t, x, &(attrs_alpha){alpha});
}
