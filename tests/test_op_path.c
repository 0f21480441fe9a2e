/*
** The op call path (src/ops/op.h): traces of a forward pass (an MLP, a small model of
** other ops), custom autograd functions (one and several outputs, many inputs, saved
** tensors, errors), observers that see every op and can fail one, NULL pass-through and
** the one-device check naming the op.
*/
#include "check.h"

#include "ops/op.h"

#include <kiln_nn.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

static kiln_device cpu;

/* Fixed weights of t's shape, so a loss is not symmetric in its elements. */
static kiln_tensor *fixed_weights(kiln_tensor *t) {
  kiln_tensor *r = kiln_arange(0, (double)kiln_numel(t), 1, kiln_dtype_of(t), kiln_device_of(t));
  return kiln_reshape(kiln_add_scalar(kiln_mul_scalar(r, 0.37), -1.0), kiln_ndim(t), kiln_shape(t));
}

static const kiln_trace_op *op_at(const kiln_trace *tr, int i) { return kiln_trace_get(tr, i); }

static bool named(const kiln_trace *tr, int i, const char *name) {
  const kiln_trace_op *op = op_at(tr, i);
  return op && strcmp(op->name, name) == 0;
}

static const kiln_attr *attr(const kiln_trace_op *op, const char *name) {
  for (int a = 0; op && a < op->n_attrs; a++)
    if (strcmp(op->attrs[a].name, name) == 0) return &op->attrs[a];
  return NULL;
}

/* An MLP written as a user writes it: Linear, ReLU, Linear, then the loss. The trace shows
** those layers in order, whatever the Sequential fuses, with each op's input the previous
** op's output, and nothing of the backward. */
static void test_trace_mlp(void) {
  kiln_scope_begin();
  kiln_module *net = kiln_sequential_new();
  kiln_sequential_append(net, kiln_linear_new(8, 16, true, KILN_F32, cpu, NULL));
  kiln_sequential_append(net, kiln_relu_new());
  kiln_sequential_append(net, kiln_linear_new(16, 3, true, KILN_F32, cpu, NULL));
  kiln_tensor *x = kiln_randn(KILN_SHAPE(5, 8), KILN_F32, cpu, NULL);
  kiln_tensor *target = kiln_randint(0, 3, KILN_SHAPE(5), KILN_I64, cpu, NULL);
  kiln_trace *tr = kiln_trace_begin();
  CHECK(tr != NULL);
  kiln_tensor *logits = kiln_module_forward(net, x);
  kiln_tensor *loss = kiln_cross_entropy(logits, target, KILN_REDUCTION_MEAN, -100, 0.0);
  CHECK(kiln_trace_end(tr) == KILN_OK);
  CHECK(kiln_backward(loss, NULL) == KILN_OK); /* after the end: not recorded either way */
  kiln_trace_print(tr, stdout);
  CHECK(kiln_trace_count(tr) == 4);
  CHECK(named(tr, 0, "linear") && named(tr, 1, "relu") && named(tr, 2, "linear") && named(tr, 3, "cross_entropy"));
  const kiln_trace_op *l0 = op_at(tr, 0), *r = op_at(tr, 1), *l1 = op_at(tr, 2), *ce = op_at(tr, 3);
  kiln_tensor *w0 = kiln_module_param(kiln_module_child_at(net, 0), "weight");
  CHECK(l0 && l0->n_inputs == 3 && l0->inputs[0] == kiln_tensor_id(x) && l0->inputs[1] == kiln_tensor_id(w0));
  CHECK(r && l0 && r->n_inputs == 1 && r->inputs[0] == l0->outputs[0]);
  CHECK(l1 && r && l1->inputs[0] == r->outputs[0]);
  CHECK(ce && l1 && ce->inputs[0] == l1->outputs[0] && ce->inputs[1] == kiln_tensor_id(target) &&
        ce->outputs[0] == kiln_tensor_id(loss));
  CHECK(l1 && l1->outputs[0] == kiln_tensor_id(logits));
  const kiln_attr *red = attr(ce, "reduction");
  CHECK(red && red->type == KILN_ATTR_STRING && red->s && strcmp(red->s, "mean") == 0);
  kiln_trace_free(tr);
  kiln_module_free(net);
  kiln_scope_end();
}

/* Other ops with attributes: the names and values a exporter reads. A trace begun inside
** another records into both; ending them out of order is refused. */
static void test_trace_small_model(void) {
  kiln_scope_begin();
  kiln_tensor *a = kiln_randn(KILN_SHAPE(2, 3, 4), KILN_F32, cpu, NULL);
  kiln_tensor *b = kiln_randn(KILN_SHAPE(4, 5), KILN_F32, cpu, NULL);
  kiln_trace *outer = kiln_trace_begin();
  kiln_tensor *m = kiln_matmul(a, b);                       /* (2, 3, 5) */
  kiln_trace *inner = kiln_trace_begin();
  kiln_tensor *s = kiln_softmax(m, -1);
  kiln_tensor *c = kiln_clamp(s, 0.1, 0.9);
  CHECK(kiln_trace_end(outer) == KILN_ERR_STATE); /* the inner one is still recording */
  kiln_clear_error();
  CHECK(kiln_trace_end(inner) == KILN_OK);
  kiln_tensor *r = kiln_sum(c, KILN_DIMS(0, 2), true);
  CHECK(kiln_trace_end(outer) == KILN_OK);
  CHECK(r != NULL);
  CHECK(kiln_trace_count(inner) == 2 && kiln_trace_count(outer) == 4);
  CHECK(named(outer, 0, "matmul") && named(outer, 1, "softmax") && named(outer, 2, "clamp") && named(outer, 3, "sum"));
  const kiln_attr *lo = attr(op_at(outer, 2), "min"), *hi = attr(op_at(outer, 2), "max");
  CHECK(lo != NULL && hi != NULL);
  CHECK(lo && hi && lo->type == KILN_ATTR_FLOAT && lo->f == 0.1 && hi->f == 0.9);
  const kiln_trace_op *sum = op_at(outer, 3);
  CHECK(sum && sum->n_attrs >= 1);
  bool saw_keep = false;
  for (int k = 0; sum && k < sum->n_attrs; k++)
    if (sum->attrs[k].type == KILN_ATTR_BOOL) saw_keep = sum->attrs[k].i == 1;
  CHECK(saw_keep);
  CHECK(op_at(outer, 1) && op_at(outer, 1)->outputs[0] == kiln_tensor_id(s) && op_at(inner, 0) &&
        op_at(inner, 0)->outputs[0] == kiln_tensor_id(s));
  kiln_trace_print(outer, stdout);
  kiln_trace_free(inner);
  kiln_trace_free(outer);
  kiln_scope_end();
}

/* ---- custom functions ---- */
static int freed_states;
static void count_free(void *p) {
  free(p);
  freed_states++;
}

/* y = x^2 * k, with k in the state */
static kiln_status sq_fwd(kiln_function_ctx *c, int n_in, kiln_tensor *const *x, int n_out, kiln_tensor **y) {
  (void)n_in, (void)n_out;
  double k = *(double *)kiln_function_state(c);
  kiln_function_save(c, x[0]);
  y[0] = kiln_mul_scalar(kiln_mul(x[0], x[0]), k);
  return y[0] ? KILN_OK : kiln_last_error();
}
static kiln_status sq_bwd(kiln_function_ctx *c, int n_out, kiln_tensor *const *gy, int n_in, kiln_tensor **gx) {
  (void)n_out, (void)n_in;
  double k = *(double *)kiln_function_state(c);
  CHECK(kiln_grad_enabled() == false);
  gx[0] = kiln_mul(gy[0], kiln_mul_scalar(kiln_function_saved(c, 0), 2.0 * k));
  return gx[0] ? KILN_OK : kiln_last_error();
}
static const kiln_function square = {"scaled_square", sq_fwd, sq_bwd};

/* two outputs: (sum of the inputs, product of the first two); any number of inputs */
static kiln_status sp_fwd(kiln_function_ctx *c, int n_in, kiln_tensor *const *x, int n_out, kiln_tensor **y) {
  (void)n_out;
  kiln_tensor *s = x[0];
  for (int i = 1; i < n_in; i++) s = kiln_add(s, x[i]);
  y[0] = s;
  y[1] = kiln_mul(x[0], x[1]);
  kiln_function_save(c, x[0]);
  kiln_function_save(c, x[1]);
  return y[0] && y[1] ? KILN_OK : kiln_last_error();
}
static kiln_status sp_bwd(kiln_function_ctx *c, int n_out, kiln_tensor *const *gy, int n_in, kiln_tensor **gx) {
  CHECK(n_out == 2);
  for (int i = 0; i < n_in; i++) {
    if (!kiln_function_grad_needed(c, i)) continue;
    kiln_tensor *g = gy[0] ? gy[0] : kiln_zeros_like(kiln_function_saved(c, 0));
    if (i < 2 && gy[1]) g = kiln_add(g, kiln_mul(gy[1], kiln_function_saved(c, 1 - i)));
    gx[i] = g;
  }
  return KILN_OK;
}
static const kiln_function sum_prod = {"sum_prod", sp_fwd, sp_bwd};

static kiln_status bad_fwd(kiln_function_ctx *c, int n_in, kiln_tensor *const *x, int n_out, kiln_tensor **y) {
  (void)c, (void)n_in, (void)n_out, (void)x, (void)y;
  return kiln_set_error(KILN_ERR_SHAPE, "bad_fwd: refused on purpose");
}
static kiln_status wrong_shape_bwd(kiln_function_ctx *c, int n_out, kiln_tensor *const *gy, int n_in, kiln_tensor **gx) {
  (void)c, (void)n_out, (void)n_in;
  gx[0] = kiln_sum_all(gy[0]); /* a scalar for a (3,) input */
  return KILN_OK;
}
static kiln_status copy_fwd(kiln_function_ctx *c, int n_in, kiln_tensor *const *x, int n_out, kiln_tensor **y) {
  (void)c, (void)n_in, (void)n_out;
  y[0] = kiln_clone(x[0]);
  return KILN_OK;
}
static const kiln_function refusing = {"refusing", bad_fwd, sq_bwd};
static const kiln_function wrong = {"wrong", copy_fwd, wrong_shape_bwd};

static void test_custom_functions(void) {
  kiln_scope_begin();
  int64_t live = kiln_live_tensors();
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(3, 4), KILN_F64, cpu, NULL);
  kiln_requires_grad_(x, true);
  double *k = malloc(sizeof *k);
  *k = 3.0;
  kiln_tensor *y;
  kiln_trace *tr = kiln_trace_begin();
  CHECK(kiln_function_apply(&square, k, count_free, 1, &x, 1, &y) == KILN_OK);
  kiln_trace_end(tr);
  CHECK(kiln_trace_count(tr) == 1 && named(tr, 0, "scaled_square")); /* its inner ops are not the user's */
  kiln_trace_free(tr);
  CHECK(y && kiln_grad_fn_name(y) && strcmp(kiln_grad_fn_name(y), "scaled_square") == 0);
  CHECK(kiln_backward(kiln_sum_all(y), NULL) == KILN_OK);
  /* d/dx sum(3 x^2) = 6x */
  kiln_tensor *want = kiln_mul_scalar(x, 6.0);
  CHECK(kiln_item(kiln_amax(kiln_abs(kiln_sub(kiln_grad(x), want)), 0, NULL, false)) < 1e-12);
  CHECK(freed_states == 0);
  kiln_scope_end();
  CHECK(freed_states == 1); /* the node went with the graph, and the state with it */

  /* no grad needed: no node, the state freed at once */
  kiln_scope_begin();
  kiln_tensor *z = kiln_ones(KILN_SHAPE(2), KILN_F32, cpu);
  double *k2 = malloc(sizeof *k2);
  *k2 = 1.0;
  CHECK(kiln_function_apply(&square, k2, count_free, 1, &z, 1, &y) == KILN_OK && !kiln_requires_grad(y));
  CHECK(freed_states == 2);
  kiln_scope_end();

  /* 9 inputs (more than any fixed node arity), two outputs; the second output alone, then
  ** both, receive gradients */
  kiln_scope_begin();
  kiln_tensor *in[9];
  for (int i = 0; i < 9; i++) {
    in[i] = kiln_full(KILN_SHAPE(2, 2), (double)(i + 1), KILN_F64, cpu);
    kiln_requires_grad_(in[i], true);
  }
  kiln_tensor *outs[2];
  CHECK(kiln_function_apply(&sum_prod, NULL, NULL, 9, in, 2, outs) == KILN_OK);
  CHECK(outs[0] && outs[1] && kiln_requires_grad(outs[0]) && kiln_requires_grad(outs[1]));
  CHECK(kiln_backward_ex(kiln_sum_all(outs[1]), NULL, true) == KILN_OK); /* kept: used again below */
  /* d sum(x0*x1)/dx0 = x1 = 2; dx1 = x0 = 1; nothing reached the others (their rule gave 0) */
  CHECK(kiln_grad(in[0]) && fabs(kiln_item(kiln_mean_all(kiln_grad(in[0]))) - 2.0) < 1e-12);
  CHECK(kiln_grad(in[1]) && fabs(kiln_item(kiln_mean_all(kiln_grad(in[1]))) - 1.0) < 1e-12);
  for (int i = 0; i < 9; i++) kiln_set_grad(in[i], NULL);
  CHECK(kiln_backward_ex(kiln_add(kiln_sum_all(outs[0]), kiln_sum_all(outs[1])), NULL, true) == KILN_OK);
  CHECK(fabs(kiln_item(kiln_mean_all(kiln_grad(in[0]))) - 3.0) < 1e-12);
  CHECK(fabs(kiln_item(kiln_mean_all(kiln_grad(in[8]))) - 1.0) < 1e-12);
  /* kiln_autograd_grad reaches a custom node's second output too */
  kiln_tensor *g[2] = {NULL, NULL};
  kiln_tensor *ins2[2] = {in[0], outs[1]};
  CHECK(kiln_autograd_grad(1, (kiln_tensor *[]){kiln_sum_all(kiln_mul_scalar(outs[1], 5.0))}, NULL, 2, ins2, g) == KILN_OK);
  CHECK(g[0] && fabs(kiln_item(kiln_mean_all(g[0])) - 10.0) < 1e-12);
  CHECK(g[1] && fabs(kiln_item(kiln_mean_all(g[1])) - 5.0) < 1e-12);
  kiln_scope_end();

  /* errors: forward's own, a gradient of the wrong shape, bad arguments */
  kiln_scope_begin();
  kiln_tensor *v = kiln_ones(KILN_SHAPE(3), KILN_F32, cpu);
  kiln_requires_grad_(v, true);
  CHECK(kiln_function_apply(&refusing, NULL, NULL, 1, &v, 1, &y) == KILN_ERR_SHAPE && y == NULL);
  CHECK(strstr(kiln_last_error_message(), "refused on purpose") != NULL);
  kiln_clear_error();
  CHECK(kiln_function_apply(&wrong, NULL, NULL, 1, &v, 1, &y) == KILN_OK);
  CHECK(kiln_backward(kiln_sum_all(y), NULL) == KILN_ERR_SHAPE);
  CHECK(strstr(kiln_last_error_message(), "wrong") != NULL);
  kiln_clear_error();
  CHECK(kiln_function_apply(&square, NULL, NULL, 1, &v, 0, &y) == KILN_ERR_INVALID_ARGUMENT);
  kiln_clear_error();
  kiln_tensor *null_in = NULL;
  CHECK(kiln_function_apply(&wrong, NULL, NULL, 1, &null_in, 1, &y) != KILN_OK);
  kiln_clear_error();
  kiln_scope_end();
  kiln_scope_end();
  CHECK(kiln_live_tensors() == live);
}

/* ---- observers ---- */
typedef struct counts {
  int begins, ends, depth0, backward;
  const char *fail_on; /* an op name the observer fails */
} counts;

static void *count_begin(const kiln__op_event *e, void *ctx) {
  counts *c = ctx;
  c->begins++;
  return (void *)e->op->name;
}
static kiln_status count_end(const kiln__op_event *e, void *tok, void *ctx) {
  counts *c = ctx;
  c->ends++;
  CHECK(tok == (void *)e->op->name);
  if (e->depth == 0) c->depth0++;
  if (e->backward) c->backward++;
  if (c->fail_on && strcmp(e->op->name, c->fail_on) == 0)
    return kiln_set_error(KILN_ERR_STATE, "observer refused '%s'", e->op->name);
  return KILN_OK;
}

static void test_observers(void) {
  counts c = {0};
  kiln__observer o = {"count", count_begin, count_end, &c, NULL, NULL};
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(4), KILN_F32, cpu, NULL);
  kiln_requires_grad_(x, true);
  CHECK(kiln__observer_add(&o) == KILN_OK);
  kiln_tensor *y = kiln_sum_all(kiln_mul(x, x));
  CHECK(c.begins == c.ends && c.depth0 >= 2);
  int before = c.backward;
  CHECK(kiln_backward(y, NULL) == KILN_OK);
  CHECK(c.backward > before); /* the rule's ops are seen, marked as backward */
  c.fail_on = "exp";
  CHECK(kiln_exp(x) == NULL && kiln_last_error() == KILN_ERR_STATE);
  kiln_clear_error();
  c.fail_on = NULL;
  kiln__observer_remove(&o);
  int seen = c.ends;
  kiln_relu(x);
  CHECK(c.ends == seen); /* removed: sees nothing */
  kiln_scope_end();
}

/* ---- a program's own Linear then ReLU: the backward peephole ---- */
static void count_kernel(void *ctx, kiln_device dev, const kiln__kargs *a, bool native) {
  (void)dev, (void)native;
  int *per_kernel = ctx;
  per_kernel[a->op]++;
}

/* relu(linear(x, W, b)) then a loss: returns the number of RELU_BACKWARD kernels the
** backward ran, and W's and x's gradients in gw, gx (kept). retain: the program asks for
** the pre-activation's gradient, which the peephole must then not touch. */
static int linear_relu_backward(kiln_tensor *x, kiln_tensor *W, kiln_tensor *b, bool retain, kiln_tensor **gw,
                                kiln_tensor **gx) {
  kiln_set_grad(W, NULL), kiln_set_grad(b, NULL), kiln_set_grad(x, NULL);
  kiln_scope_begin();
  kiln_tensor *z = kiln_linear(x, W, b);
  if (retain) kiln_retain_grad(z);
  kiln_tensor *h = kiln_relu(z);
  kiln_tensor *loss = kiln_sum_all(kiln_mul(h, fixed_weights(h)));
  int per_kernel[KILN__K_COUNT] = {0};
  kiln__dispatch_observe(count_kernel, per_kernel);
  CHECK(kiln_backward(loss, NULL) == KILN_OK);
  kiln__dispatch_observe(NULL, NULL);
  CHECK(!retain || kiln_grad(z) != NULL);
  kiln_scope_end();
  *gw = kiln_clone(kiln_grad(W));
  *gx = kiln_clone(kiln_grad(x));
  return per_kernel[KILN__K_RELU_BACKWARD];
}

static void test_linear_relu_peephole(kiln_device dev) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_to_device(kiln_randn(KILN_SHAPE(6, 8), KILN_F32, cpu, NULL), dev);
  kiln_tensor *W = kiln_to_device(kiln_randn(KILN_SHAPE(5, 8), KILN_F32, cpu, NULL), dev);
  kiln_tensor *b = kiln_to_device(kiln_randn(KILN_SHAPE(5), KILN_F32, cpu, NULL), dev);
  kiln_requires_grad_(x, true), kiln_requires_grad_(W, true), kiln_requires_grad_(b, true);
  kiln_tensor *gw_f, *gx_f, *gw_u, *gx_u;
  int fused = linear_relu_backward(x, W, b, false, &gw_f, &gx_f);
  int unfused = linear_relu_backward(x, W, b, true, &gw_u, &gx_u);
  CHECK(fused == 0 && unfused == 1);
  /* the mask read in the products gives the very numbers of the ReLU kernel on the CPU;
  ** a GPU may run the masked product with another GEMM algorithm (f32 sums in another
  ** order) */
  double tol = dev.type == KILN_DEVICE_CPU ? 0.0 : 1e-5 * kiln_item(kiln_amax(kiln_abs(gw_u), 0, NULL, false));
  CHECK(kiln_item(kiln_amax(kiln_abs(kiln_sub(gw_f, gw_u)), 0, NULL, false)) <= tol);
  tol = dev.type == KILN_DEVICE_CPU ? 0.0 : 1e-5 * kiln_item(kiln_amax(kiln_abs(gx_u), 0, NULL, false));
  CHECK(kiln_item(kiln_amax(kiln_abs(kiln_sub(gx_f, gx_u)), 0, NULL, false)) <= tol);
  /* and both are the gradients of a ReLU: some rows of the pre-activation are negative */
  CHECK(kiln_item(kiln_sum_all(kiln_abs(gw_f))) > 0);
  kiln_scope_end();
}

/* ---- the path's own checks ---- */
static void test_path_checks(void) {
  kiln_scope_begin();
  kiln_tensor *a = kiln_ones(KILN_SHAPE(2), KILN_F32, cpu);
  kiln_clear_error();
  /* a NULL input with no error pending: the op says which input */
  CHECK(kiln_add(a, NULL) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(strstr(kiln_last_error_message(), "kiln_add") != NULL);
  /* a NULL made by a failed op: that error stays */
  kiln_tensor *bad = kiln_reshape(a, KILN_SHAPE(3));
  kiln_status st = kiln_last_error();
  CHECK(bad == NULL && kiln_relu(kiln_add(a, bad)) == NULL && kiln_last_error() == st);
  kiln_clear_error();
  kiln_scope_end();
  /* with no scope open, an op's converted inputs (f32 + f64 promotes a to f64) are freed:
  ** only the result is left to the caller */
  kiln_tensor *x = kiln_ones(KILN_SHAPE(3), KILN_F32, cpu), *y = kiln_ones(KILN_SHAPE(3), KILN_F64, cpu);
  int64_t live = kiln_live_tensors();
  kiln_tensor *z = kiln_add(x, y);
  CHECK(z && kiln_dtype_of(z) == KILN_F64 && kiln_live_tensors() == live + 1);
  kiln_tensor_free(z);
  CHECK(kiln_live_tensors() == live);
  kiln_requires_grad_(x, true); /* the node keeps what it saved until z goes */
  z = kiln_add(x, y);
  CHECK(z && kiln_requires_grad(z));
  kiln_tensor_free(z);
  CHECK(kiln_live_tensors() == live);
  kiln_tensor_free(x);
  kiln_tensor_free(y);
}

int main(void) {
  cpu = kiln_device_cpu();
  kiln_manual_seed(1);
  test_trace_mlp();
  test_trace_small_model();
  test_custom_functions();
  test_observers();
  test_linear_relu_peephole(cpu);
  if (kiln_device_count(KILN_DEVICE_CUDA) > 0) test_linear_relu_peephole(kiln_device_cuda(0)); /* on a GPU machine */
  test_path_checks();
  printf("test_op_path: %d failures\n", failures);
  return failures ? 1 : 0;
}
