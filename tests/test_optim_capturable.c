/* Capturable Adam/AdamW (step count on the device) computes the same updates as the
** host-step path: ten steps of each on the same problem give the same parameters. */
#include <kiln.h>
#include <kiln_optim.h>

#include <math.h>
#include <stdio.h>

static double train(bool capturable, kiln_optim_kind kind, bool amsgrad) {
  kiln_generator *g = kiln_generator_new(42);
  kiln_tensor *w = kiln_keep(kiln_randn(KILN_SHAPE(8, 4), KILN_F32, kiln_device_cpu(), g));
  kiln_tensor *x = kiln_keep(kiln_randn(KILN_SHAPE(16, 8), KILN_F32, kiln_device_cpu(), g));
  kiln_requires_grad_(w, true);
  kiln_optim_config c = kind == KILN_OPTIM_ADAM ? kiln_adam_config(1e-2) : kiln_adamw_config(1e-2);
  c.capturable = capturable;
  c.amsgrad = amsgrad;
  kiln_optimizer *o = kiln_optimizer_new(&c, &w, 1);
  for (int s = 0; s < 10; s++) {
    kiln_scope_begin();
    kiln_tensor *loss = kiln_mean_all(kiln_tanh(kiln_matmul(x, w)));
    kiln_optimizer_zero_grad(o);
    kiln_backward(loss, NULL);
    kiln_optimizer_step(o);
    kiln_scope_end();
  }
  kiln_scope_begin();
  double sum = kiln_item(kiln_sum_all(kiln_mul(w, w)));
  kiln_scope_end();
  kiln_optimizer_free(o);
  kiln_tensor_free(w);
  kiln_tensor_free(x);
  kiln_generator_free(g);
  return sum;
}

int main(void) {
  int failed = 0, passed = 0;
  kiln_optim_kind kinds[2] = {KILN_OPTIM_ADAM, KILN_OPTIM_ADAMW};
  for (int k = 0; k < 2; k++)
    for (int ams = 0; ams < 2; ams++) {
      double a = train(false, kinds[k], ams), b = train(true, kinds[k], ams);
      if (!(fabs(a - b) <= 1e-6 * fabs(a)) || isnan(a)) {
        printf("FAIL kind %d amsgrad %d: host step %.9g, device step %.9g\n", k, ams, a, b);
        failed++;
      } else {
        passed++;
      }
    }
  printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
