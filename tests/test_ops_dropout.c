/*
** Dropout: drop rate, scaling by 1/(1-p), identity when not training or p == 0,
** determinism with a seeded generator, gradient = mask * scale, bad p.
*/
#include "harness.h"

#include <stdlib.h>
#include <string.h>

static void do_stats(kiln_dtype dt) {
  kiln_device cpu = kiln_device_cpu();
  const int64_t n = 20000;
  const double p = 0.3;
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(1234);
  kiln_tensor *x = kiln_ones(KILN_SHAPE(n), dt, cpu);
  kiln_tensor *y = kiln_dropout(x, p, true, g);
  int64_t m = 0;
  double *v = h_values(y, &m);
  if (H_CHECK(v && m == n, "dropout %s returns %lld values", kiln_dtype_name(dt), (long long)n)) {
    int64_t zeros = 0, bad = 0;
    double scale = h_round_to(1.0 / (1.0 - p), dt);
    for (int64_t k = 0; k < n; k++) {
      if (v[k] == 0) zeros++;
      else if (v[k] != scale) bad++;
    }
    double rate = (double)zeros / (double)n, sigma = sqrt(p * (1 - p) / (double)n);
    H_CHECK(fabs(rate - p) < 5 * sigma, "dropout %s drop rate %.4f, want %.2f +- %.4f",
            kiln_dtype_name(dt), rate, p, 5 * sigma);
    H_CHECK(bad == 0, "dropout %s: %lld kept values are not 1/(1-p) = %.6g", kiln_dtype_name(dt),
            (long long)bad, scale);
    H_CHECK(kiln_dtype_of(y) == dt, "dropout keeps dtype %s", kiln_dtype_name(dt));
  }
  free(v);
  kiln_generator_free(g);
  kiln_scope_end();
}

static bool same_values(kiln_tensor *a, kiln_tensor *b) {
  int64_t na = 0, nb = 0;
  double *va = h_values(a, &na), *vb = h_values(b, &nb);
  bool same = va && vb && na == nb && memcmp(va, vb, sizeof(double) * (size_t)na) == 0;
  free(va), free(vb);
  return same;
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_dropout");
  if (h_cross_only()) {
    /* same seed, same mask on every device (DESIGN.md: counter-based RNG) */
    for (int d = 0; d < kiln_device_count(KILN_DEVICE_CUDA); d++) {
      kiln_scope_begin();
      kiln_generator *g1 = kiln_generator_new(7), *g2 = kiln_generator_new(7);
      kiln_tensor *xc = kiln_ones(KILN_SHAPE(64, 33), KILN_F32, kiln_device_cpu());
      kiln_tensor *xg = kiln_ones(KILN_SHAPE(64, 33), KILN_F32, kiln_device_cuda(d));
      H_CHECK(same_values(kiln_dropout(xc, 0.4, true, g1), kiln_dropout(xg, 0.4, true, g2)),
              "dropout mask on cuda:%d equals the CPU's for the same seed", d);
      kiln_generator_free(g1), kiln_generator_free(g2);
      kiln_scope_end();
    }
    return h_finish();
  }
  kiln_device cpu = kiln_device_cpu();
  do_stats(KILN_F32);
  do_stats(KILN_F64);
  do_stats(KILN_F16);
  do_stats(KILN_BF16);

  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(8, 16), KILN_F32, cpu, NULL);
  /* identity when not training, or p == 0 */
  kiln_tensor *e = kiln_dropout(x, 0.5, false, NULL);
  H_CHECK(e && same_values(e, x), "dropout train=false is the identity");
  kiln_tensor *z = kiln_dropout(x, 0.0, true, NULL);
  H_CHECK(z && same_values(z, x), "dropout p=0 is the identity");
  /* p == 1 drops everything (PyTorch returns zeros) */
  kiln_tensor *all = kiln_dropout(x, 1.0, true, NULL);
  if (all) {
    int64_t n = 0;
    double *v = h_values(all, &n), mx = 0;
    for (int64_t k = 0; v && k < n; k++) mx = fmax(mx, fabs(v[k]));
    H_CHECK(v && mx == 0, "dropout p=1 gives zeros (max |y| %g)", mx);
    free(v);
  } else {
    H_CHECK(false, "dropout p=1 failed");
  }
  H_EXPECT_ERR(kiln_dropout(x, 1.5, true, NULL), KILN_ERR_INVALID_ARGUMENT, "dropout p=1.5");
  H_EXPECT_ERR(kiln_dropout(x, -0.1, true, NULL), KILN_ERR_INVALID_ARGUMENT, "dropout p=-0.1");

  /* determinism: the same seed gives the same mask; the next call a different one */
  kiln_generator *g1 = kiln_generator_new(42), *g2 = kiln_generator_new(42);
  kiln_tensor *a1 = kiln_dropout(x, 0.5, true, g1), *a2 = kiln_dropout(x, 0.5, true, g2);
  H_CHECK(a1 && a2 && same_values(a1, a2), "dropout with equal seeds gives equal masks");
  kiln_tensor *a3 = kiln_dropout(x, 0.5, true, g1);
  H_CHECK(a3 && !same_values(a1, a3), "the generator advances: the next mask differs");
  kiln_manual_seed(99);
  kiln_tensor *b1 = kiln_dropout(x, 0.5, true, NULL);
  kiln_manual_seed(99);
  kiln_tensor *b2 = kiln_dropout(x, 0.5, true, NULL);
  H_CHECK(b1 && b2 && same_values(b1, b2), "kiln_manual_seed makes the global generator repeat");
  /* reproducible across thread counts */
  int nt = kiln_num_threads();
  kiln_tensor *big = kiln_ones(KILN_SHAPE(100003), KILN_F32, cpu);
  kiln_generator_seed(g1, 5);
  kiln_set_num_threads(1);
  kiln_tensor *t1 = kiln_dropout(big, 0.25, true, g1);
  kiln_generator_seed(g1, 5);
  kiln_set_num_threads(2);
  kiln_tensor *t2 = kiln_dropout(big, 0.25, true, g1);
  kiln_set_num_threads(nt);
  H_CHECK(t1 && t2 && same_values(t1, t2), "dropout mask equal for 1 and 2 threads");

  /* gradient is mask * scale: for x = ones, grad == y */
  kiln_tensor *w = kiln_ones(KILN_SHAPE(5, 7), KILN_F64, cpu);
  kiln_requires_grad_(w, true);
  kiln_tensor *y = kiln_dropout(w, 0.4, true, g2);
  if (H_CHECK(y && kiln_backward_ex(kiln_sum_all(y), NULL, true) == KILN_OK, "dropout backward"))
    H_CHECK(kiln_grad(w) && same_values(kiln_grad(w), y), "dropout grad equals mask * 1/(1-p)");
  /* with an upstream gradient: grad = g * mask * scale */
  kiln_set_grad(w, NULL);
  kiln_tensor *up = kiln_randn(KILN_SHAPE(5, 7), KILN_F64, cpu, NULL);
  if (H_CHECK(kiln_backward(y, up) == KILN_OK, "dropout backward with upstream")) {
    int64_t n = 0;
    double *gy = h_values(kiln_grad(w), &n), *yv = h_values(y, NULL), *uv = h_values(up, NULL);
    double *want = malloc(sizeof(double) * (size_t)(n ? n : 1));
    for (int64_t k = 0; gy && k < n; k++) want[k] = uv[k] * yv[k];
    if (gy) h_close("dropout grad = g * mask * scale", gy, want, n, 1e-12, 0);
    free(gy), free(yv), free(uv), free(want);
  }
  kiln_generator_free(g1), kiln_generator_free(g2);
  kiln_scope_end();
  return h_finish();
}
