/* Fused optimizer updates: one kernel per parameter instead of a dozen elementwise ops. */
#include "core/kiln_int.h"

#include <string.h>

kiln_status kiln_adam_step_(kiln_tensor *param, kiln_tensor *grad, kiln_tensor *exp_avg,
                            kiln_tensor *exp_avg_sq, kiln_tensor *max_exp_avg_sq, double lr,
                            double beta1, double beta2, double eps, double weight_decay,
                            int64_t step, bool decoupled, bool amsgrad, kiln_tensor *step_t) {
  kiln_tensor *ts[5] = {param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq};
  int n = amsgrad ? 5 : 4;
  for (int i = 0; i < n; i++)
    if (!ts[i]) {
      if (kiln_last_error() == KILN_OK)
        kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_adam_step_: tensor %d is NULL", i);
      return kiln_last_error();
    }
  if (param->requires_grad && kiln_grad_enabled())
    return kiln_set_error(KILN_ERR_AUTOGRAD, "kiln_adam_step_: grad mode is on (wrap the step in kiln_set_grad_enabled(false))");
  if (kiln__same_device("kiln_adam_step_", n, ts) != KILN_OK) return kiln_last_error();
  if (!kiln_dtype_is_float(param->dtype))
    return kiln_set_error(KILN_ERR_DTYPE, "kiln_adam_step_: parameter is %s, not a floating dtype", kiln_dtype_name(param->dtype));
  for (int i = 0; i < n; i++) {
    if (ts[i]->dtype != param->dtype || ts[i]->ndim != param->ndim ||
        memcmp(ts[i]->shape, param->shape, (size_t)param->ndim * sizeof(int64_t)) != 0)
      return kiln_set_error(KILN_ERR_SHAPE, "kiln_adam_step_: tensor %d is %s %s; the parameter is %s %s", i,
                            kiln_dtype_name(ts[i]->dtype), kiln__tshape(ts[i]), kiln_dtype_name(param->dtype),
                            kiln__tshape(param));
    if (!kiln_is_contiguous(ts[i]))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_adam_step_: tensor %d is not contiguous", i);
  }
  if (step_t) {
    if (step_t->dtype != KILN_F64 || kiln_numel(step_t) != 1 ||
        !kiln_device_equal(kiln_device_of(step_t), kiln_device_of(param)))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            "kiln_adam_step_: step_t must be one float64 element on %s",
                            kiln__device_cstr(kiln_device_of(param)));
    step = 1; /* unused by the kernel */
  }
  if (step < 1) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_adam_step_: step must be >= 1, got %lld", (long long)step);
  if (kiln_numel(param) == 0) return KILN_OK;
  kiln__kargs a = {0};
  a.op = KILN__K_ADAM;
  a.n_in = 1;
  a.in[0] = kiln__view_of(grad);
  a.n_out = amsgrad ? 4 : 3;
  a.out[0] = kiln__view_of(param);
  a.out[1] = kiln__view_of(exp_avg);
  a.out[2] = kiln__view_of(exp_avg_sq);
  if (amsgrad) a.out[3] = kiln__view_of(max_exp_avg_sq);
  a.s[0] = lr;
  a.s[1] = beta1;
  a.s[2] = beta2;
  a.s[3] = eps;
  a.i[0] = step;
  a.i[1] = (decoupled ? 1 : 0) | (amsgrad ? 2 : 0) | (step_t ? 4 : 0);
  memcpy(&a.i[2], &weight_decay, sizeof weight_decay);
  if (step_t) {
    a.n_in = 2;
    a.in[1] = kiln__view_of(step_t);
  }
  kiln_status st = kiln__dispatch(kiln_device_of(param), &a);
  if (st != KILN_OK || !step_t) return st;
  /* step_t += 1, on the device, after the kernel read it (stream order) */
  kiln__kargs inc = {0};
  inc.op = KILN__K_AFFINE;
  inc.n_in = inc.n_out = 1;
  inc.in[0] = inc.out[0] = kiln__view_of(step_t);
  inc.s[0] = 1.0;
  inc.s[1] = 1.0;
  return kiln__dispatch(kiln_device_of(step_t), &inc);
}
