/* The grad-ready hook: called once per backward per hooked leaf, after its gradient is
** complete (all paths in), before backward returns. */
#include <kiln.h>

#include <math.h>
#include <stdio.h>

static int calls;
static double seen;

static void hook(kiln_tensor *t, void *ctx) {
  calls++;
  seen = kiln_item(kiln_grad(t));
  *(int *)ctx += 1;
}

int main(void) {
  int failures = 0, ctx = 0;
  kiln_scope_begin();
  kiln_tensor *w = kiln_scalar(3.0, KILN_F64, kiln_device_cpu());
  kiln_requires_grad_(w, true);
  if (kiln_set_grad_ready_hook(w, hook, &ctx) != KILN_OK) failures++;
  /* w used on three paths: y = w*w + 2w -> dy/dw = 2w + 2 = 8 */
  kiln_tensor *y = kiln_add(kiln_mul(w, w), kiln_mul_scalar(w, 2.0));
  if (kiln_backward(y, NULL) != KILN_OK) failures++;
  if (calls != 1 || ctx != 1) { printf("FAIL hook called %d times, want 1\n", calls); failures++; }
  if (fabs(seen - 8.0) > 1e-12) { printf("FAIL hook saw grad %g, want 8 (complete)\n", seen); failures++; }
  kiln_tensor *x = kiln_ones(KILN_SHAPE(2), KILN_F64, kiln_device_cpu());
  if (kiln_set_grad_ready_hook(x, hook, &ctx) == KILN_OK) { printf("FAIL hook on a non-grad tensor accepted\n"); failures++; }
  kiln_set_grad_ready_hook(w, NULL, NULL);
  kiln_tensor *y2 = kiln_mul(w, w);
  kiln_backward(y2, NULL);
  if (calls != 1) { printf("FAIL removed hook still called\n"); failures++; }
  kiln_scope_end();
  printf("%d passed, %d failed\n", 5 - failures, failures);
  return failures ? 1 : 0;
}
