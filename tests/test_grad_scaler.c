/*
** Loss scaling: PyTorch's defaults, unscale to the true gradients, a step skipped on an
** inf/NaN gradient with the parameters and optimizer untouched, backoff and growth, the
** list unscale over mixed dtypes (the flag is never cleared by it), the state round
** trip, and the bad configurations.
*/
#include "check.h"

#include <kiln_optim.h>

#include <math.h>
#include <string.h>

static const kiln_device CPU = {KILN_DEVICE_CPU, 0};

static kiln_tensor *leaf(double v) {
  kiln_tensor *p = kiln_keep(kiln_full(KILN_SHAPE(3), v, KILN_F32, CPU));
  kiln_requires_grad_(p, true);
  return p;
}

static void test_defaults_and_bad_config(void) {
  kiln_grad_scaler_config c = kiln_grad_scaler_default_config();
  CHECK(c.init_scale == 65536.0 && c.growth_factor == 2.0 && c.backoff_factor == 0.5 && c.growth_interval == 2000);
  kiln_grad_scaler *s = kiln_grad_scaler_new(NULL);
  CHECK(s && kiln_grad_scaler_get_scale(s) == 65536.0);
  kiln_grad_scaler_free(s);
  c.init_scale = 0;
  CHECK(kiln_grad_scaler_new(&c) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  c.init_scale = -2;
  CHECK(kiln_grad_scaler_new(&c) == NULL);
  c = kiln_grad_scaler_default_config();
  c.growth_interval = 0;
  CHECK(kiln_grad_scaler_new(&c) == NULL && strstr(kiln_last_error_message(), "growth_interval") != NULL);
  kiln_grad_scaler_free(NULL);
  kiln_clear_error();
}

/* d(scale * sum(p * x))/dp unscaled is x; a clean step moves p, a bad one does not. */
static void test_unscale_step_skip_update(void) {
  kiln_tensor *p = leaf(1.0);
  kiln_optim_config oc = kiln_adam_config(0.1);
  kiln_optimizer *opt = kiln_optimizer_new(&oc, &p, 1);
  kiln_grad_scaler_config c = kiln_grad_scaler_default_config();
  c.growth_interval = 2;
  kiln_grad_scaler *s = kiln_grad_scaler_new(&c);
  for (int it = 0; it < 4; it++) {
    kiln_scope_begin();
    kiln_optimizer_zero_grad(opt);
    double xv = it == 2 ? INFINITY : 3.0;
    kiln_tensor *x = kiln_full(KILN_SHAPE(3), xv, KILN_F32, CPU);
    kiln_tensor *loss = kiln_sum_all(kiln_mul(p, x));
    double scale = kiln_grad_scaler_get_scale(s);
    CHECK(kiln_backward(kiln_grad_scaler_scale(s, loss), NULL) == KILN_OK);
    CHECK(kiln_grad_scaler_unscale_(s, opt) == KILN_OK);
    CHECK(kiln_grad_scaler_unscale_(s, opt) == KILN_ERR_STATE);
    if (it != 2) CHECK(kiln_item(kiln_sum_all(kiln_grad(p))) == 9.0);
    double before = kiln_item(kiln_sum_all(p));
    int64_t steps = kiln_optimizer_steps(opt);
    CHECK(kiln_grad_scaler_step(s, opt) == KILN_OK);
    double after = kiln_item(kiln_sum_all(p));
    if (it == 2) {
      CHECK(kiln_grad_scaler_found_inf(s) && after == before && kiln_optimizer_steps(opt) == steps);
    } else {
      CHECK(!kiln_grad_scaler_found_inf(s) && after < before);
    }
    CHECK(kiln_grad_scaler_update(s) == KILN_OK);
    double want = it == 1 ? scale * 2 : it == 2 ? scale * 0.5 : scale;
    CHECK(kiln_grad_scaler_get_scale(s) == want);
    kiln_scope_end();
  }
  CHECK(kiln_grad_scaler_update(s) == KILN_ERR_STATE);
  kiln_clear_error();
  kiln_grad_scaler_free(s);
  kiln_optimizer_free(opt);
  kiln_tensor_free(p);
}

static void test_list_unscale_mixed_dtypes(void) {
  kiln_scope_begin();
  kiln_tensor *a = kiln_full(KILN_SHAPE(4), 8.0, KILN_F32, CPU);
  kiln_tensor *b = kiln_full(KILN_SHAPE(2, 2), 8.0, KILN_BF16, CPU);
  kiln_tensor *c = kiln_full(KILN_SHAPE(3), 8.0, KILN_F64, CPU);
  kiln_tensor *fi = kiln_zeros(KILN_SHAPE0, KILN_F32, CPU);
  kiln_tensor *gs[4] = {a, NULL, b, c};
  CHECK(kiln_amp_unscale_(4, gs, fi, 0.25) == KILN_OK);
  CHECK(kiln_item(kiln_sum_all(a)) == 8.0 && kiln_item(kiln_sum_all(b)) == 8.0 && kiln_item(kiln_sum_all(c)) == 6.0);
  CHECK(kiln_item(fi) == 0.0);
  kiln_fill_(c, NAN);
  CHECK(kiln_amp_unscale_(4, gs, fi, 1.0) == KILN_OK && kiln_item(fi) == 1.0);
  kiln_fill_(c, 1.0);
  CHECK(kiln_amp_unscale_(4, gs, fi, 1.0) == KILN_OK && kiln_item(fi) == 1.0); /* never cleared */
  kiln_tensor *bad = kiln_zeros(KILN_SHAPE(2), KILN_F64, CPU);
  CHECK(kiln_amp_unscale_(1, gs, bad, 1.0) == KILN_ERR_INVALID_ARGUMENT);
  kiln_tensor *ints = kiln_zeros(KILN_SHAPE(2), KILN_I32, CPU);
  CHECK(kiln_amp_unscale_(1, &ints, fi, 1.0) == KILN_ERR_DTYPE);
  kiln_clear_error();
  kiln_scope_end();
}

static void test_state_round_trip(void) {
  kiln_grad_scaler *s = kiln_grad_scaler_new(NULL), *t = kiln_grad_scaler_new(NULL);
  kiln_tensor *p = leaf(1.0);
  kiln_optim_config oc = kiln_sgd_config(0.1);
  kiln_optimizer *opt = kiln_optimizer_new(&oc, &p, 1);
  kiln_scope_begin();
  CHECK(kiln_backward(kiln_grad_scaler_scale(s, kiln_sum_all(kiln_mul_scalar(p, INFINITY))), NULL) == KILN_OK);
  CHECK(kiln_grad_scaler_step(s, opt) == KILN_OK && kiln_grad_scaler_update(s) == KILN_OK);
  kiln_scope_end();
  CHECK(kiln_grad_scaler_get_scale(s) == 32768.0);
  kiln_dict *d = kiln_grad_scaler_state_dict(s);
  CHECK(d && kiln_grad_scaler_load_state_dict(t, d) == KILN_OK);
  CHECK(kiln_grad_scaler_get_scale(t) == 32768.0);
  kiln_dict_free(d);
  kiln_dict *e = kiln_dict_new();
  CHECK(kiln_grad_scaler_load_state_dict(t, e) == KILN_ERR_FORMAT);
  kiln_dict_free(e);
  kiln_clear_error();
  kiln_optimizer_free(opt);
  kiln_tensor_free(p);
  kiln_grad_scaler_free(s);
  kiln_grad_scaler_free(t);
}

int main(void) {
  test_defaults_and_bad_config();
  test_unscale_step_skip_update();
  test_list_unscale_mixed_dtypes();
  test_state_round_trip();
  printf("test_grad_scaler: %d failures\n", failures);
  return failures ? 1 : 0;
}
