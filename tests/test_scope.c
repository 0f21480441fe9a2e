/*
** Scopes: nesting, kiln_keep, no leaks over loops of ops + backward, misuse.
*/
#include "harness.h"

static kiln_device cpu;

static void test_nesting(void) {
  int64_t live0 = kiln_live_tensors();
  int d0 = kiln_scope_depth();
  kiln_scope_begin();
  H_CHECK(kiln_scope_depth() == d0 + 1, "depth after begin");
  kiln_tensor *outer = kiln_ones(KILN_SHAPE(4), KILN_F32, cpu);
  kiln_scope_begin();
  H_CHECK(kiln_scope_depth() == d0 + 2, "nested depth");
  kiln_tensor *inner = kiln_add(outer, outer);
  kiln_tensor *kept = kiln_keep(kiln_mul_scalar(inner, 2));
  H_CHECK(kiln_live_tensors() == live0 + 3, "three live tensors (%lld)",
          (long long)(kiln_live_tensors() - live0));
  H_CHECK(kiln_scope_end() == KILN_OK, "inner end");
  H_CHECK(kiln_live_tensors() == live0 + 2, "inner scope freed its tensor, kept one survives");
  H_CHECK(kiln_get(outer, (int64_t[]){0}) == 1, "outer tensor alive after the inner scope");
  H_CHECK(kiln_get(kept, (int64_t[]){3}) == 4, "kept tensor readable after its scope ended");
  H_CHECK(kiln_scope_end() == KILN_OK, "outer end");
  H_CHECK(kiln_live_tensors() == live0 + 1, "only the kept tensor remains");
  kiln_tensor_free(kept);
  H_CHECK(kiln_live_tensors() == live0, "freeing the kept tensor returns to the start");
  H_CHECK(kiln_scope_depth() == d0, "depth back to %d", d0);

  /* keep of a tensor no scope owns is a no-op; a ref'd tensor survives its scope */
  kiln_tensor *own = kiln_zeros(KILN_SHAPE(2), KILN_F32, cpu);
  H_CHECK(kiln_keep(own) == own, "keep outside a scope returns the tensor");
  kiln_scope_begin();
  kiln_tensor *r = kiln_tensor_ref(own);
  kiln_tensor *tmp = kiln_add_scalar(own, 1);
  kiln_tensor *tmp_ref = kiln_tensor_ref(tmp); /* an extra reference that no scope owns */
  kiln_scope_end();
  H_CHECK(r == own && kiln_get(own, (int64_t[]){0}) == 0, "tensor_ref returns t");
  H_CHECK(kiln_get(tmp_ref, (int64_t[]){1}) == 1, "a tensor with an extra reference outlives its scope");
  kiln_tensor_free(tmp_ref);
  kiln_tensor_free(r);
  kiln_tensor_free(own);
  kiln_tensor_free(NULL);
  H_CHECK(kiln_live_tensors() == live0, "refs balanced (%lld)", (long long)(kiln_live_tensors() - live0));
  /* keep twice: the second time it is no longer owned by a scope */
  kiln_scope_begin();
  kiln_tensor *k = kiln_ones(KILN_SHAPE(1), KILN_F32, cpu);
  kiln_keep(k);
  kiln_keep(k);
  kiln_scope_end();
  H_CHECK(kiln_live_tensors() == live0 + 1, "kept once and only once");
  kiln_tensor_free(k);
  H_CHECK(kiln_live_tensors() == live0, "no leak after double keep");
}

static void test_no_leak_loop(void) {
  int64_t live0 = kiln_live_tensors();
  kiln_tensor *w = kiln_randn(KILN_SHAPE(8, 4), KILN_F32, cpu, NULL);
  kiln_tensor *b = kiln_zeros(KILN_SHAPE(4), KILN_F32, cpu);
  kiln_requires_grad_(w, true);
  kiln_requires_grad_(b, true);
  int64_t live1 = kiln_live_tensors();
  kiln_memory_stats m0, m1;
  kiln_memory_stats_get(cpu, &m0);
  for (int step = 0; step < 50; step++) {
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_SHAPE(16, 8), KILN_F32, cpu, NULL);
    kiln_tensor *t = kiln_randint(0, 4, KILN_SHAPE(16), KILN_I64, cpu, NULL);
    kiln_tensor *h = kiln_relu(kiln_linear(x, kiln_transpose(w, 0, 1), b));
    kiln_tensor *loss = kiln_add(kiln_cross_entropy(h, t, KILN_REDUCTION_MEAN, -100, 0),
                                 kiln_mul_scalar(kiln_sum_all(kiln_mul(w, w)), 1e-4));
    kiln_status st = kiln_backward(loss, NULL);
    bool prev = kiln_set_grad_enabled(false);
    kiln_axpy_(w, -0.1, kiln_grad(w));
    kiln_axpy_(b, -0.1, kiln_grad(b));
    kiln_set_grad_enabled(prev);
    kiln_set_grad(w, NULL);
    kiln_set_grad(b, NULL);
    kiln_scope_end();
    if (!H_CHECK(st == KILN_OK, "training step %d", step)) break;
  }
  H_CHECK(kiln_live_tensors() == live1, "50 steps leave no tensors behind (%lld extra)",
          (long long)(kiln_live_tensors() - live1));
  kiln_memory_stats_get(cpu, &m1);
  H_CHECK(m1.allocated == m0.allocated, "allocated bytes return to %lld (now %lld)",
          (long long)m0.allocated, (long long)m1.allocated);
  /* grads kept across steps are owned by the leaf, not a scope */
  kiln_scope_begin();
  kiln_backward(kiln_sum_all(kiln_mul(w, w)), NULL);
  kiln_scope_end();
  H_CHECK(kiln_grad(w) != NULL && kiln_numel(kiln_grad(w)) == 32, "a leaf's grad outlives the step scope");
  kiln_tensor_free(w);
  kiln_tensor_free(b);
  H_CHECK(kiln_live_tensors() == live0, "freeing the parameters frees their grads (%lld extra)",
          (long long)(kiln_live_tensors() - live0));
}

static void test_misuse(void) {
  int d = kiln_scope_depth();
  while (kiln_scope_depth() > 0) kiln_scope_end();
  kiln_clear_error();
  H_CHECK(kiln_scope_end() == KILN_ERR_STATE && kiln_last_error() == KILN_ERR_STATE,
          "scope_end with none open is KILN_ERR_STATE");
  H_CHECK(kiln_scope_depth() == 0, "depth stays 0");
  kiln_clear_error();
  (void)d;
  /* a graph whose intermediates were freed by their scope still backpropagates: nodes
  ** hold what backward needs */
  kiln_tensor *x = kiln_ones(KILN_SHAPE(3), KILN_F64, cpu);
  kiln_requires_grad_(x, true);
  kiln_scope_begin();
  kiln_tensor *y = kiln_keep(kiln_sum_all(kiln_exp(kiln_mul_scalar(x, 2))));
  kiln_scope_end();
  H_CHECK(kiln_backward(y, NULL) == KILN_OK, "backward after the scope of the intermediates ended");
  H_CHECK(kiln_grad(x) && fabs(kiln_get(kiln_grad(x), (int64_t[]){0}) - 2 * exp(2.0)) < 1e-9,
          "gradient is right");
  kiln_tensor_free(y);
  kiln_tensor_free(x);
  /* many nested scopes */
  for (int i = 0; i < 200; i++) kiln_scope_begin();
  H_CHECK(kiln_scope_depth() == 200, "200 nested scopes");
  for (int i = 0; i < 200; i++) kiln_scope_end();
  H_CHECK(kiln_scope_depth() == 0, "and back");
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_scope");
  cpu = kiln_device_cpu();
  if (h_cross_only()) return h_finish();
  int64_t live0 = kiln_live_tensors();
  test_nesting();
  test_no_leak_loop();
  test_misuse();
  H_CHECK(kiln_live_tensors() == live0, "no leaks overall: %lld -> %lld", (long long)live0,
          (long long)kiln_live_tensors());
  return h_finish();
}
