/*
** The autograd engine: accumulation over backward calls, non-scalar roots, retain_grad,
** no-grad mode, detach, kiln_autograd_grad, diamonds and reuse, leaf rules, errors.
*/
#include "harness.h"

#include <stdlib.h>
#include <string.h>

static kiln_device cpu;

static kiln_tensor *leaf(const double *v, int n) {
  kiln_tensor *t = h_tensor(v, 1, (const int64_t[]){n}, KILN_F64);
  kiln_requires_grad_(t, true);
  return t;
}

static void test_accumulate(void) {
  kiln_scope_begin();
  kiln_tensor *x = leaf((double[]){1, 2, 3}, 3);
  H_CHECK(kiln_is_leaf(x) && kiln_requires_grad(x) && kiln_grad(x) == NULL && !kiln_grad_fn_name(x),
          "a new leaf has no grad and no grad_fn");
  kiln_tensor *y = kiln_sum_all(kiln_mul(x, x)); /* d/dx = 2x */
  H_CHECK(y && !kiln_is_leaf(y) && kiln_grad_fn_name(y) != NULL,
          "the result has a grad_fn (%s)", y && kiln_grad_fn_name(y) ? kiln_grad_fn_name(y) : "NULL");
  H_CHECK(kiln_backward_ex(y, NULL, true) == KILN_OK, "backward, keeping the graph");
  h_tensor_close("grad 2x", kiln_grad(x), (double[]){2, 4, 6}, 3, 1e-12, 0);
  H_CHECK(kiln_backward_ex(y, NULL, true) == KILN_OK, "second backward on the kept graph");
  h_tensor_close("grads add up over two backward calls", kiln_grad(x), (double[]){4, 8, 12}, 3, 1e-12, 0);
  H_CHECK(kiln_set_grad(x, NULL) == KILN_OK && kiln_grad(x) == NULL, "set_grad NULL clears");
  kiln_backward(y, NULL);
  h_tensor_close("after clearing, one backward again", kiln_grad(x), (double[]){2, 4, 6}, 3, 1e-12, 0);
  /* non-scalar root: needs a gradient */
  kiln_tensor *z = kiln_mul_scalar(x, 3);
  kiln_set_grad(x, NULL);
  H_EXPECT_ERR(kiln_backward(z, NULL) == KILN_OK ? z : NULL, KILN_ERR_AUTOGRAD,
               "backward of a [3] root without a gradient");
  kiln_tensor *g = h_tensor((double[]){1, 10, 100}, 1, (const int64_t[]){3}, KILN_F64);
  H_CHECK(kiln_backward(z, g) == KILN_OK, "backward with a given gradient");
  h_tensor_close("grad = 3 * g", kiln_grad(x), (double[]){3, 30, 300}, 3, 1e-12, 0);
  H_EXPECT_ERR(kiln_backward(z, kiln_ones(KILN_SHAPE(4), KILN_F64, cpu)) == KILN_OK ? z : NULL,
               KILN_ERR_SHAPE, "backward with a gradient of the wrong shape");
  /* backward of something that does not require grad */
  kiln_tensor *c = kiln_ones(KILN_SHAPE0, KILN_F64, cpu);
  H_CHECK(kiln_backward(c, NULL) != KILN_OK && kiln_last_error() == KILN_ERR_AUTOGRAD,
          "backward of a tensor that does not require grad: KILN_ERR_AUTOGRAD");
  kiln_clear_error();
  kiln_scope_end();
}

static void test_retain_and_shapes(void) {
  kiln_scope_begin();
  kiln_tensor *x = leaf((double[]){1, 2}, 2);
  kiln_tensor *h = kiln_mul_scalar(x, 2);        /* non-leaf */
  kiln_tensor *y = kiln_sum_all(kiln_mul(h, h)); /* dy/dh = 2h = 4x */
  H_CHECK(kiln_retain_grad(h) == KILN_OK, "retain_grad on an intermediate");
  kiln_tensor *h2 = kiln_add_scalar(x, 1); /* not retained */
  kiln_tensor *y2 = kiln_sum_all(h2);
  kiln_backward(y, NULL);
  h_tensor_close("retained intermediate grad", kiln_grad(h), (double[]){4, 8}, 2, 1e-12, 0);
  h_tensor_close("leaf grad through it (8x)", kiln_grad(x), (double[]){8, 16}, 2, 1e-12, 0);
  kiln_backward(y2, NULL);
  H_CHECK(kiln_grad(h2) == NULL, "a non-retained intermediate keeps no grad");
  H_CHECK(kiln_retain_grad(x) == KILN_OK, "retain_grad on a leaf is allowed (no-op)");
  H_CHECK(kiln_grad(x) && kiln_dtype_of(kiln_grad(x)) == KILN_F64 && kiln_ndim(kiln_grad(x)) == 1,
          "grad has the leaf's dtype and shape");
  H_CHECK(kiln_requires_grad_(h, false) != KILN_OK, "requires_grad_ on a non-leaf is refused");
  kiln_clear_error();
  /* f32 leaf gets an f32 gradient; a broadcast input gets its own shape back */
  kiln_tensor *w = kiln_ones(KILN_SHAPE(1, 3), KILN_F32, cpu);
  kiln_requires_grad_(w, true);
  kiln_tensor *big = kiln_ones(KILN_SHAPE(4, 3), KILN_F32, cpu);
  kiln_backward(kiln_sum_all(kiln_mul(big, w)), NULL);
  kiln_tensor *gw = kiln_grad(w);
  H_CHECK(gw && kiln_dtype_of(gw) == KILN_F32 && kiln_ndim(gw) == 2 && kiln_size(gw, 0) == 1,
          "broadcast leaf [1,3] gets a [1,3] f32 gradient");
  if (gw) h_tensor_close("broadcast grad sums over rows", gw, (double[]){4, 4, 4}, 3, 0, 0);
  kiln_scope_end();
}

static void test_no_grad_detach(void) {
  kiln_scope_begin();
  kiln_tensor *x = leaf((double[]){1, 2}, 2);
  H_CHECK(kiln_grad_enabled(), "grad mode starts on");
  bool prev = kiln_set_grad_enabled(false);
  H_CHECK(prev && !kiln_grad_enabled(), "set_grad_enabled returns the previous value");
  kiln_tensor *y = kiln_mul(x, x);
  H_CHECK(y && !kiln_requires_grad(y) && kiln_grad_fn_name(y) == NULL && kiln_is_leaf(y),
          "under no-grad nothing is recorded");
  kiln_set_grad_enabled(true);
  H_CHECK(kiln_backward(kiln_sum_all(y), NULL) != KILN_OK, "backward of a no-grad result fails");
  kiln_clear_error();
  kiln_tensor *d = kiln_detach(kiln_mul_scalar(x, 5));
  H_CHECK(d && !kiln_requires_grad(d) && kiln_is_leaf(d) && kiln_get(d, (int64_t[]){1}) == 10,
          "detach cuts the graph, keeps values");
  /* detach shares data */
  kiln_tensor *src = kiln_ones(KILN_SHAPE(2), KILN_F64, cpu);
  kiln_tensor *dd = kiln_detach(src);
  kiln_fill_(dd, 7);
  H_CHECK(kiln_get(src, (int64_t[]){0}) == 7, "detach shares storage");
  /* a detached branch contributes no gradient */
  kiln_tensor *z = kiln_add(kiln_mul(x, kiln_detach(x)), x); /* d/dx = x + 1 (detached x const) */
  kiln_backward(kiln_sum_all(z), NULL);
  h_tensor_close("gradient ignores the detached factor", kiln_grad(x), (double[]){2, 3}, 2, 1e-12, 0);
  kiln_scope_end();
}

static void test_autograd_grad(void) {
  kiln_scope_begin();
  kiln_tensor *x = leaf((double[]){1, 2}, 2), *w = leaf((double[]){3, 4}, 2);
  kiln_tensor *unused = leaf((double[]){5}, 1);
  kiln_tensor *y = kiln_sum_all(kiln_mul(x, w));
  kiln_tensor *ins[3] = {x, w, unused}, *gs[3] = {NULL, NULL, NULL};
  H_CHECK(kiln_autograd_grad(1, &y, NULL, 3, ins, gs) == KILN_OK, "autograd_grad");
  h_tensor_close("dy/dx = w", gs[0], (double[]){3, 4}, 2, 1e-12, 0);
  h_tensor_close("dy/dw = x", gs[1], (double[]){1, 2}, 2, 1e-12, 0);
  H_CHECK(gs[2] == NULL, "an input that does not reach the output gets NULL");
  H_CHECK(kiln_grad(x) == NULL && kiln_grad(w) == NULL, "autograd_grad does not touch .grad");
  /* two outputs with their own gradients */
  kiln_tensor *o1 = kiln_mul_scalar(x, 2), *o2 = kiln_mul(x, x);
  kiln_tensor *outs[2] = {o1, o2};
  kiln_tensor *gos[2] = {kiln_ones(KILN_SHAPE(2), KILN_F64, cpu),
                         h_tensor((double[]){10, 10}, 1, (const int64_t[]){2}, KILN_F64)};
  kiln_tensor *gx = NULL;
  H_CHECK(kiln_autograd_grad(2, outs, gos, 1, &x, &gx) == KILN_OK, "autograd_grad, 2 outputs");
  h_tensor_close("sum of both outputs' contributions", gx, (double[]){2 + 20, 2 + 40}, 2, 1e-12, 0);
  kiln_scope_end();
}

static void test_graph_shapes(void) {
  kiln_scope_begin();
  /* diamond: a = 2x, b = x^2, y = sum(a * b) = sum(2x^3) -> 6x^2 */
  kiln_tensor *x = leaf((double[]){1, 2, -1}, 3);
  kiln_tensor *a = kiln_mul_scalar(x, 2), *b = kiln_mul(x, x);
  kiln_backward(kiln_sum_all(kiln_mul(a, b)), NULL);
  h_tensor_close("diamond gradient 6x^2", kiln_grad(x), (double[]){6, 24, 6}, 3, 1e-12, 0);
  /* the same tensor used twice in one op and across ops */
  kiln_tensor *u = leaf((double[]){3}, 1);
  kiln_tensor *v = kiln_add(kiln_mul(u, u), kiln_add(u, u)); /* u^2 + 2u -> 2u + 2 */
  kiln_backward(kiln_sum_all(v), NULL);
  h_tensor_close("tensor used twice", kiln_grad(u), (double[]){8}, 1, 1e-12, 0);
  /* a deep chain (no recursion limit in backward) */
  kiln_tensor *c = leaf((double[]){1}, 1), *h = c;
  for (int i = 0; i < 3000; i++) h = kiln_mul_scalar(h, 1.0);
  H_CHECK(kiln_backward(kiln_sum_all(h), NULL) == KILN_OK, "backward through a 3000-op chain");
  h_tensor_close("chain gradient", kiln_grad(c), (double[]){1}, 1, 1e-12, 0);
  /* only leaves that require grad get a gradient */
  kiln_tensor *p = leaf((double[]){1, 1}, 2);
  kiln_tensor *q = kiln_ones(KILN_SHAPE(2), KILN_F64, cpu);
  kiln_backward(kiln_sum_all(kiln_mul(p, q)), NULL);
  H_CHECK(kiln_grad(q) == NULL && kiln_grad(p) != NULL, "a constant gets no gradient");
  /* an integer tensor cannot require grad */
  kiln_tensor *it = kiln_ones(KILN_SHAPE(2), KILN_I64, cpu);
  kiln_status st = kiln_requires_grad_(it, true);
  H_CHECK(st != KILN_OK && !kiln_requires_grad(it), "requires_grad on int64: %s", kiln_error_name(st));
  kiln_clear_error();
  /* requires_grad_(false) on a leaf stops recording */
  kiln_requires_grad_(p, false);
  kiln_tensor *r = kiln_mul(p, p);
  H_CHECK(r && !kiln_requires_grad(r), "after requires_grad_(false) nothing is recorded");
  /* NULL arguments */
  H_CHECK(kiln_backward(NULL, NULL) != KILN_OK, "backward(NULL) fails");
  kiln_clear_error();
  kiln_scope_end();
}

static void test_views_in_graph(void) {
  kiln_scope_begin();
  /* gradients through view ops land at the right elements */
  kiln_tensor *x = kiln_reshape(kiln_arange(0, 6, 1, KILN_F64, cpu), KILN_SHAPE(2, 3));
  x = kiln_contiguous(x);
  kiln_tensor *xl = kiln_clone(x);
  kiln_requires_grad_(xl, true);
  kiln_tensor *t = kiln_transpose(xl, 0, 1);           /* (3, 2) */
  kiln_tensor *s = kiln_select(t, 0, 2);               /* xl[:, 2] */
  kiln_tensor *n = kiln_narrow(kiln_view(xl, KILN_SHAPE(6)), 0, 0, 2); /* xl[0, 0:2] */
  kiln_tensor *y = kiln_add(kiln_sum_all(kiln_mul_scalar(s, 10)), kiln_sum_all(n));
  if (H_CHECK(kiln_backward(y, NULL) == KILN_OK, "backward through views"))
    h_tensor_close("grads through select/transpose/view/narrow", kiln_grad(xl),
                   (double[]){1, 1, 10, 0, 0, 10}, 6, 0, 0);
  kiln_scope_end();
}

/* A custom function that records, during its backward, the bytes autograd still holds
** saved: the nodes after it in the chain have run by then. */
static int64_t saved_seen = -1;
static kiln_status probe_fwd(kiln_function_ctx *c, int n_in, kiln_tensor *const *x, int n_out, kiln_tensor **y) {
  (void)c, (void)n_in, (void)n_out;
  y[0] = kiln_mul_scalar(x[0], 1.0);
  return y[0] ? KILN_OK : kiln_last_error();
}
static kiln_status probe_bwd(kiln_function_ctx *c, int n_out, kiln_tensor *const *gy, int n_in, kiln_tensor **gx) {
  (void)c, (void)n_out, (void)n_in;
  kiln_autograd_saved_bytes(&saved_seen, NULL);
  gx[0] = gy[0];
  return KILN_OK;
}
static const kiln_function probe_fn = {"saved_probe", probe_fwd, probe_bwd};

/* kiln_backward lets go of each node's saved tensors once its rule ran (PyTorch's
** retain_graph=False): the live saved bytes fall during the backward, not at its end; a
** second backward fails before touching .grad; kiln_backward_ex(..., true) keeps them. */
static void test_backward_releases_saved(void) {
  kiln_scope_begin();
  int64_t live0 = 0, live = 0;
  kiln_autograd_saved_bytes(&live0, NULL);
  kiln_tensor *x = kiln_randn(KILN_SHAPE(256), KILN_F64, cpu, NULL);
  kiln_requires_grad_(x, true);
  /* x -> z = 1 * x -> mul(z, z) (saves z twice: 4 KiB) -> probe -> 4 x [exp (saves its
  ** output: 2 KiB)] -> sum. (x itself, a leaf that requires grad, is not counted.) */
  kiln_tensor *z = kiln_mul_scalar(x, 1.0);
  kiln_tensor *h = kiln_mul(z, z), *p = NULL;
  H_CHECK(kiln_function_apply(&probe_fn, NULL, NULL, 1, &h, 1, &p) == KILN_OK, "probe");
  for (int i = 0; i < 4 && p; i++) p = kiln_exp(kiln_mul_scalar(p, 0.01));
  kiln_tensor *loss = kiln_sum_all(p);
  kiln_autograd_saved_bytes(&live, NULL);
  const int64_t row = 256 * 8;
  H_CHECK(live - live0 == 2 * row + 4 * row, "saved after forward: %lld bytes, want %lld",
          (long long)(live - live0), (long long)(6 * row));
  /* kept: the probe sees everything still saved, and so does the end */
  saved_seen = -1;
  H_CHECK(kiln_backward_ex(loss, NULL, true) == KILN_OK, "backward, graph kept");
  H_CHECK(saved_seen - live0 == 6 * row, "kept graph: %lld bytes saved during backward, want %lld",
          (long long)(saved_seen - live0), (long long)(6 * row));
  kiln_autograd_saved_bytes(&live, NULL);
  H_CHECK(live - live0 == 6 * row, "kept graph: %lld bytes saved after backward", (long long)(live - live0));
  /* released: the four exps ran before the probe, so only mul's two remain there */
  double *g1 = h_values(kiln_grad(x), NULL);
  saved_seen = -1;
  H_CHECK(kiln_backward(loss, NULL) == KILN_OK, "backward, graph released");
  H_CHECK(saved_seen - live0 == 2 * row, "released: %lld bytes saved when the probe ran, want %lld (mul's)",
          (long long)(saved_seen - live0), (long long)(2 * row));
  kiln_autograd_saved_bytes(&live, NULL);
  H_CHECK(live == live0, "released: %lld bytes still saved after backward", (long long)(live - live0));
  double twice[256];
  for (int i = 0; i < 256 && g1; i++) twice[i] = 2 * g1[i];
  free(g1);
  h_tensor_close("grads of the kept then released backward add up", kiln_grad(x), twice, 256, 1e-12, 0);
  /* a third backward through the released graph: a clear error, .grad untouched */
  kiln_status st = kiln_backward(loss, NULL);
  H_CHECK(st == KILN_ERR_AUTOGRAD && strstr(kiln_last_error_message(), "freed by an earlier backward") &&
              strstr(kiln_last_error_message(), "kiln_backward_ex"),
          "backward through a released graph: %s (%s)", kiln_error_name(st), kiln_last_error_message());
  kiln_clear_error();
  h_tensor_close("the failed backward left .grad as it was", kiln_grad(x), twice, 256, 1e-12, 0);
  /* a node that saved nothing (add) can run again: only what was freed is an error */
  kiln_tensor *a = kiln_add(x, x);
  H_CHECK(kiln_backward(kiln_sum_all(a), NULL) == KILN_OK && kiln_backward(kiln_sum_all(a), NULL) == KILN_OK,
          "a graph of nodes that save nothing backwards twice");
  kiln_scope_end();
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_autograd");
  cpu = kiln_device_cpu();
  if (h_cross_only()) return h_finish();
  int64_t live0 = kiln_live_tensors();
  test_accumulate();
  test_retain_and_shapes();
  test_no_grad_detach();
  test_autograd_grad();
  test_graph_shapes();
  test_views_in_graph();
  test_backward_releases_saved();
  H_CHECK(kiln_live_tensors() == live0, "no leaks: %lld -> %lld", (long long)live0,
          (long long)kiln_live_tensors());
  return h_finish();
}
