/*
** Elementwise ops: broadcasting binary arithmetic, comparisons, where, unary math,
** activations, copies between dtypes and devices, and the in-place updates optimizers
** use. Each differentiable op records a node whose rule is written with other ops.
*/
#include "core/kiln_int.h"

#include <math.h>
#include <string.h>

/* ---- helpers ---- */
static kiln_status broadcast_shape(const char *op, const kiln_tensor *a, const kiln_tensor *b,
                                   int *ndim, int64_t *shape) {
  int n = a->ndim > b->ndim ? a->ndim : b->ndim;
  for (int i = 0; i < n; i++) {
    int ia = i - (n - a->ndim), ib = i - (n - b->ndim);
    int64_t sa = ia >= 0 ? a->shape[ia] : 1, sb = ib >= 0 ? b->shape[ib] : 1;
    if (sa != sb && sa != 1 && sb != 1)
      return kiln_set_error(KILN_ERR_SHAPE,
                            "%s: shapes %s and %s cannot be broadcast (dim %d: %lld vs %lld)", op,
                            kiln__tshape(a), kiln__tshape(b), i, (long long)sa, (long long)sb);
    shape[i] = sa == 1 ? sb : sa;
  }
  *ndim = n;
  return KILN_OK;
}

/* t itself when it already has dtype dt, else a converted copy (no autograd: callers
** record their own node on the original inputs). */
static kiln_tensor *as_dtype_nograd(kiln_tensor *t, kiln_dtype dt) {
  if (t->dtype == dt) return t;
  bool prev = kiln_set_grad_enabled(false);
  kiln_tensor *c = kiln_to_dtype(t, dt);
  kiln_set_grad_enabled(prev);
  return c;
}

static kiln_status run(kiln_tensor *out, kiln__kargs *a) {
  a->n_out = a->n_out ? a->n_out : 1;
  a->out[0] = kiln__view_of(out);
  if (kiln_numel(out) == 0) return KILN_OK;
  return kiln__dispatch(kiln_device_of(out), a);
}

static kiln_tensor *fail_discard(kiln_tensor *out) {
  kiln__discard(out);
  return NULL;
}

/* ---- binary ---- */
typedef enum { BIN_ARITH, BIN_CMP } bin_kind;

static kiln_tensor *binary(const char *name, kiln__kop op, kiln_tensor *a, kiln_tensor *b, double alpha,
                           bin_kind kind, kiln__backward_fn bw) {
  if (!a || !b) return NULL;
  kiln_tensor *ab[2] = {a, b};
  if (kiln__same_device(name, 2, ab) != KILN_OK) return NULL;
  int nd;
  int64_t shape[KILN_MAX_DIMS];
  if (broadcast_shape(name, a, b, &nd, shape) != KILN_OK) return NULL;
  kiln_dtype ct = kiln_dtype_promote(a->dtype, b->dtype);
  if ((op == KILN__K_POW || op == KILN__K_DIV) && ct == KILN_BOOL) ct = KILN_I64;
  if (op == KILN__K_SUB && ct == KILN_BOOL)
    KILN__FAIL_NULL(KILN_ERR_DTYPE, "%s: subtraction of bool tensors is not supported", name);
  kiln_dtype odt = kind == BIN_CMP ? KILN_BOOL : ct;
  kiln_tensor *ca = as_dtype_nograd(a, ct), *cb = as_dtype_nograd(b, ct);
  if (!ca || !cb) return NULL;
  kiln_tensor *out = kiln__tensor_new(nd, shape, odt, kiln_device_of(a));
  if (!out) return NULL;
  kiln__kargs k = {0};
  k.op = op;
  k.n_in = 2;
  k.in[0] = kiln__view_broadcast(ca, nd, shape);
  k.in[1] = kiln__view_broadcast(cb, nd, shape);
  k.s[0] = alpha;
  if (run(out, &k) != KILN_OK) return fail_discard(out);
  if (bw && kind == BIN_ARITH && kiln_dtype_is_float(ct) && kiln__needs_grad(2, ab)) {
    kiln__node *n = kiln__node_attach(out, name + 5 /* skip "kiln_" */, bw, 2, ab);
    if (!n) return fail_discard(out);
    kiln__node_save(n, 0, ca);
    kiln__node_save(n, 1, cb);
    n->s[0] = alpha;
    if (op == KILN__K_POW) kiln__node_save_output(n, 2);
  }
  return out;
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
  SET_GRAD(1, n->s[0] == 1.0 ? g : kiln_mul_scalar(g, n->s[0]));
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

kiln_tensor *kiln_add(kiln_tensor *a, kiln_tensor *b) { return binary("kiln_add", KILN__K_ADD, a, b, 1.0, BIN_ARITH, add_bw); }
kiln_tensor *kiln_axpy(kiln_tensor *a, double alpha, kiln_tensor *b) { return binary("kiln_axpy", KILN__K_ADD, a, b, alpha, BIN_ARITH, add_bw); }
kiln_tensor *kiln_sub(kiln_tensor *a, kiln_tensor *b) { return binary("kiln_sub", KILN__K_SUB, a, b, 1.0, BIN_ARITH, sub_bw); }
kiln_tensor *kiln_mul(kiln_tensor *a, kiln_tensor *b) { return binary("kiln_mul", KILN__K_MUL, a, b, 1.0, BIN_ARITH, mul_bw); }
kiln_tensor *kiln_div(kiln_tensor *a, kiln_tensor *b) { return binary("kiln_div", KILN__K_DIV, a, b, 1.0, BIN_ARITH, div_bw); }
kiln_tensor *kiln_pow(kiln_tensor *a, kiln_tensor *b) { return binary("kiln_pow", KILN__K_POW, a, b, 1.0, BIN_ARITH, pow_bw); }
kiln_tensor *kiln_maximum(kiln_tensor *a, kiln_tensor *b) { return binary("kiln_maximum", KILN__K_MAXIMUM, a, b, 1.0, BIN_ARITH, maximum_bw); }
kiln_tensor *kiln_minimum(kiln_tensor *a, kiln_tensor *b) { return binary("kiln_minimum", KILN__K_MINIMUM, a, b, 1.0, BIN_ARITH, minimum_bw); }
kiln_tensor *kiln_eq(kiln_tensor *a, kiln_tensor *b) { return binary("kiln_eq", KILN__K_EQ, a, b, 1.0, BIN_CMP, NULL); }
kiln_tensor *kiln_ne(kiln_tensor *a, kiln_tensor *b) { return binary("kiln_ne", KILN__K_NE, a, b, 1.0, BIN_CMP, NULL); }
kiln_tensor *kiln_lt(kiln_tensor *a, kiln_tensor *b) { return binary("kiln_lt", KILN__K_LT, a, b, 1.0, BIN_CMP, NULL); }
kiln_tensor *kiln_le(kiln_tensor *a, kiln_tensor *b) { return binary("kiln_le", KILN__K_LE, a, b, 1.0, BIN_CMP, NULL); }
kiln_tensor *kiln_gt(kiln_tensor *a, kiln_tensor *b) { return binary("kiln_gt", KILN__K_GT, a, b, 1.0, BIN_CMP, NULL); }
kiln_tensor *kiln_ge(kiln_tensor *a, kiln_tensor *b) { return binary("kiln_ge", KILN__K_GE, a, b, 1.0, BIN_CMP, NULL); }

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

kiln_tensor *kiln_where(kiln_tensor *cond, kiln_tensor *a, kiln_tensor *b) {
  if (!cond || !a || !b) return NULL;
  kiln_tensor *ts[3] = {cond, a, b};
  if (kiln__same_device("kiln_where", 3, ts) != KILN_OK) return NULL;
  int nd1, nd;
  int64_t s1[KILN_MAX_DIMS], shape[KILN_MAX_DIMS];
  if (broadcast_shape("kiln_where", a, b, &nd1, s1) != KILN_OK) return NULL;
  kiln_tensor tmp; /* shape carrier for the second broadcast */
  memset(&tmp, 0, sizeof tmp);
  tmp.ndim = nd1;
  memcpy(tmp.shape, s1, sizeof s1);
  if (broadcast_shape("kiln_where", cond, &tmp, &nd, shape) != KILN_OK) return NULL;
  kiln_dtype ct = kiln_dtype_promote(a->dtype, b->dtype);
  kiln_tensor *ca = as_dtype_nograd(a, ct), *cb = as_dtype_nograd(b, ct);
  if (!ca || !cb) return NULL;
  kiln_tensor *out = kiln__tensor_new(nd, shape, ct, kiln_device_of(a));
  if (!out) return NULL;
  kiln__kargs k = {0};
  k.op = KILN__K_WHERE;
  k.n_in = 3;
  k.in[0] = kiln__view_broadcast(cond, nd, shape);
  k.in[1] = kiln__view_broadcast(ca, nd, shape);
  k.in[2] = kiln__view_broadcast(cb, nd, shape);
  if (run(out, &k) != KILN_OK) return fail_discard(out);
  kiln_tensor *ab[2] = {a, b};
  if (kiln_dtype_is_float(ct) && kiln__needs_grad(2, ab)) {
    kiln__node *n = kiln__node_attach(out, "where", where_bw, 3, ts);
    if (!n) return fail_discard(out);
    kiln__node_save(n, 0, cond);
  }
  return out;
}

/* ---- unary ---- */
static kiln_tensor *unary(const char *name, kiln__kop op, kiln_tensor *t, double s0, double s1,
                          bool float_only, kiln__backward_fn bw, bool save_out) {
  if (!t) return NULL;
  if (float_only && !kiln_dtype_is_float(t->dtype))
    KILN__FAIL_NULL(KILN_ERR_DTYPE, "%s: expected a floating tensor, got %s %s", name,
                    kiln_dtype_name(t->dtype), kiln__tshape(t));
  kiln_tensor *out = kiln__tensor_new(t->ndim, t->shape, t->dtype, kiln_device_of(t));
  if (!out) return NULL;
  kiln__kargs k = {0};
  k.op = op;
  k.n_in = 1;
  k.in[0] = kiln__view_of(t);
  k.s[0] = s0;
  k.s[1] = s1;
  if (run(out, &k) != KILN_OK) return fail_discard(out);
  if (bw && kiln_dtype_is_float(t->dtype) && kiln__needs_grad(1, &t)) {
    kiln__node *n = kiln__node_attach(out, name + 5, bw, 1, &t);
    if (!n) return fail_discard(out);
    kiln__node_save(n, 0, t);
    if (save_out) kiln__node_save_output(n, 1);
    n->s[0] = s0;
    n->s[1] = s1;
  }
  return out;
}

/* Backward through a dedicated kernel: grad_in = K(saved x or y, g). */
static kiln_status kernel_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi, kiln__kop op, int saved) {
  kiln_tensor *x = n->saved[saved];
  kiln_tensor *out = kiln__tensor_new(x->ndim, x->shape, x->dtype, kiln_device_of(x));
  if (!out) return kiln_last_error();
  kiln__kargs k = {0};
  k.op = op;
  k.n_in = 2;
  k.in[0] = kiln__view_of(x);
  k.in[1] = kiln__view_of(g);
  k.s[0] = n->s[0];
  k.s[1] = n->s[1];
  if (run(out, &k) != KILN_OK) return kiln_last_error();
  gi[0] = kiln_keep(out);
  return KILN_OK;
}

#define KERNEL_BW(fn, kop, saved)                                                         \
  static kiln_status fn(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {                \
    return kernel_bw(n, g, gi, kop, saved);                                               \
  }
KERNEL_BW(relu_bw, KILN__K_RELU_BACKWARD, 0)
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
static kiln_status abs_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_tensor *sg = unary("kiln_sign", KILN__K_SIGN, n->saved[0], 0, 0, false, NULL, false);
  SET0(kiln_mul(g, sg));
}
static kiln_status pow_scalar_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  double e = n->s[0];
  if (e == 0.0) SET0(kiln_zeros_like(g));
  SET0(kiln_mul(g, kiln_mul_scalar(kiln_pow_scalar(n->saved[0], e - 1.0), e)));
}
static kiln_status affine_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  SET0(n->s[0] == 1.0 ? kiln__scope_track(kiln_tensor_ref(g)) : kiln_mul_scalar(g, n->s[0]));
}

kiln_tensor *kiln_neg(kiln_tensor *t) {
  if (t && t->dtype == KILN_BOOL) KILN__FAIL_NULL(KILN_ERR_DTYPE, "kiln_neg: negation of a bool tensor is not supported");
  return unary("kiln_neg", KILN__K_NEG, t, 0, 0, false, neg_bw, false);
}
kiln_tensor *kiln_exp(kiln_tensor *t) { return unary("kiln_exp", KILN__K_EXP, t, 0, 0, true, exp_bw, true); }
kiln_tensor *kiln_log(kiln_tensor *t) { return unary("kiln_log", KILN__K_LOG, t, 0, 0, true, log_bw, false); }
kiln_tensor *kiln_sqrt(kiln_tensor *t) { return unary("kiln_sqrt", KILN__K_SQRT, t, 0, 0, true, sqrt_bw, true); }
kiln_tensor *kiln_rsqrt(kiln_tensor *t) { return unary("kiln_rsqrt", KILN__K_RSQRT, t, 0, 0, true, rsqrt_bw, true); }
kiln_tensor *kiln_abs(kiln_tensor *t) { return unary("kiln_abs", KILN__K_ABS, t, 0, 0, false, abs_bw, false); }
kiln_tensor *kiln_clamp(kiln_tensor *t, double lo, double hi) {
  if (t && lo > hi) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_clamp: lo %g is above hi %g", lo, hi);
  return unary("kiln_clamp", KILN__K_CLAMP, t, lo, hi, false, clamp_bw, false);
}
kiln_tensor *kiln_pow_scalar(kiln_tensor *t, double e) {
  return unary("kiln_pow_scalar", KILN__K_POW_SCALAR, t, e, 0, true, pow_scalar_bw, false);
}
kiln_tensor *kiln_add_scalar(kiln_tensor *a, double s) {
  return unary("kiln_add_scalar", KILN__K_AFFINE, a, 1.0, s, false, affine_bw, false);
}
kiln_tensor *kiln_mul_scalar(kiln_tensor *a, double s) {
  return unary("kiln_mul_scalar", KILN__K_AFFINE, a, s, 0.0, false, affine_bw, false);
}

kiln_tensor *kiln_relu(kiln_tensor *t) { return unary("kiln_relu", KILN__K_RELU, t, 0, 0, true, relu_bw, false); }
kiln_tensor *kiln_leaky_relu(kiln_tensor *t, double slope) {
  return unary("kiln_leaky_relu", KILN__K_LEAKY_RELU, t, slope, 0, true, leaky_relu_bw, false);
}
kiln_tensor *kiln_gelu(kiln_tensor *t) { return unary("kiln_gelu", KILN__K_GELU, t, 0, 0, true, gelu_bw, false); }
kiln_tensor *kiln_gelu_tanh(kiln_tensor *t) {
  return unary("kiln_gelu_tanh", KILN__K_GELU_TANH, t, 0, 0, true, gelu_tanh_bw, false);
}
kiln_tensor *kiln_silu(kiln_tensor *t) { return unary("kiln_silu", KILN__K_SILU, t, 0, 0, true, silu_bw, false); }
kiln_tensor *kiln_sigmoid(kiln_tensor *t) { return unary("kiln_sigmoid", KILN__K_SIGMOID, t, 0, 0, true, sigmoid_bw, true); }
kiln_tensor *kiln_tanh(kiln_tensor *t) { return unary("kiln_tanh", KILN__K_TANH, t, 0, 0, true, tanh_bw, true); }
kiln_tensor *kiln_softplus(kiln_tensor *t, double beta, double threshold) {
  if (t && beta == 0) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_softplus: beta must not be 0");
  return unary("kiln_softplus", KILN__K_SOFTPLUS, t, beta, threshold, true, softplus_bw, false);
}

/* ---- copies: clone, to_dtype, to_device ---- */
static kiln_status copy_bw(kiln__node *n, kiln_tensor *g, kiln_tensor **gi) {
  kiln_device in_dev = {(kiln_device_type)n->i[0], (int)n->i[1]};
  kiln_tensor *r = kiln_to_dtype(g, n->in_dtype[0]);
  SET0(kiln_to_device(r, in_dev));
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

kiln_tensor *kiln__copy_as(kiln_tensor *t, kiln_dtype dt, kiln_device dev, const char *name) {
  if (!t) return NULL;
  kiln_tensor *out = kiln__tensor_new(t->ndim, t->shape, dt, dev);
  if (!out) return NULL;
  if (copy_between(out, t) != KILN_OK) return fail_discard(out);
  if (kiln_dtype_is_float(dt) && kiln__needs_grad(1, &t)) {
    kiln__node *n = kiln__node_attach(out, name, copy_bw, 1, &t);
    if (!n) return fail_discard(out);
    kiln_device sd = kiln_device_of(t);
    n->i[0] = sd.type;
    n->i[1] = sd.index;
  }
  return out;
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

kiln_status kiln_copy_(kiln_tensor *dst, kiln_tensor *src) {
  if (inplace_ok("kiln_copy_", dst) != KILN_OK) return kiln_last_error();
  if (!src) return kiln_last_error() != KILN_OK ? kiln_last_error() : kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_copy_: NULL source");
  /* src broadcasts to dst's shape */
  int nd;
  int64_t shape[KILN_MAX_DIMS];
  if (broadcast_shape("kiln_copy_", dst, src, &nd, shape) != KILN_OK) return kiln_last_error();
  if (nd != dst->ndim || memcmp(shape, dst->shape, (size_t)nd * sizeof(int64_t)) != 0)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_copy_: source %s does not broadcast to destination %s",
                          kiln__tshape(src), kiln__tshape(dst));
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
  if (nd == src->ndim && memcmp(src->shape, dst->shape, (size_t)nd * sizeof(int64_t)) == 0 &&
      kiln_is_contiguous(dst))
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

kiln_status kiln_fill_(kiln_tensor *t, double value) {
  if (inplace_ok("kiln_fill_", t) != KILN_OK) return kiln_last_error();
  kiln__kargs k = {0};
  k.op = KILN__K_FILL;
  k.s[0] = value;
  return run(t, &k);
}

kiln_status kiln_zero_(kiln_tensor *t) { return kiln_fill_(t, 0.0); }

kiln_status kiln_mul_scalar_(kiln_tensor *t, double s) {
  if (inplace_ok("kiln_mul_scalar_", t) != KILN_OK) return kiln_last_error();
  kiln__kargs k = {0};
  k.op = KILN__K_AFFINE;
  k.n_in = 1;
  k.in[0] = kiln__view_of(t); /* elementwise in place: each element read before written */
  k.s[0] = s;
  k.s[1] = 0.0;
  return run(t, &k);
}

kiln_status kiln_axpy_(kiln_tensor *t, double alpha, kiln_tensor *x) {
  if (inplace_ok("kiln_axpy_", t) != KILN_OK) return kiln_last_error();
  if (!x) return kiln_last_error() != KILN_OK ? kiln_last_error() : kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_axpy_: NULL x");
  kiln_tensor *tx[2] = {t, x};
  if (kiln__same_device("kiln_axpy_", 2, tx) != KILN_OK) return kiln_last_error();
  int nd;
  int64_t shape[KILN_MAX_DIMS];
  if (broadcast_shape("kiln_axpy_", t, x, &nd, shape) != KILN_OK) return kiln_last_error();
  if (nd != t->ndim || memcmp(shape, t->shape, (size_t)nd * sizeof(int64_t)) != 0)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_axpy_: %s does not broadcast to %s", kiln__tshape(x), kiln__tshape(t));
  kiln_scope_begin();
  kiln_tensor *cx = as_dtype_nograd(x, t->dtype);
  kiln_status st = cx ? KILN_OK : kiln_last_error();
  if (st == KILN_OK) {
    kiln__kargs k = {0};
    k.op = KILN__K_ADD;
    k.n_in = 2;
    k.in[0] = kiln__view_of(t);
    k.in[1] = kiln__view_broadcast(cx, nd, shape);
    k.s[0] = alpha;
    st = run(t, &k);
  }
  kiln_scope_end();
  return st;
}
