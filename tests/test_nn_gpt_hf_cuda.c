/* Hugging Face GPT-2 parity on CUDA: the tiny random GPT-2 of tests/fixtures/hf_gpt2 (see
** test_nn_gpt_hf.c, which checks the same on the CPU) loaded onto cuda:0 gives
** transformers' logits within 1e-4 (f32), and a training step's gradients there match the
** CPU's. Then the same forward and backward once more with KILN_FALLBACK=error: every op of
** a GPT-2 (norms, attention, embedding, GELU, cross-entropy) must have its CUDA kernel, and
** the fallback table names any that does not. Exits 77 (skipped) without a CUDA device. */
#include <kiln.h>
#include <kiln_io.h>
#include <kiln_nn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static kiln_device cpu, gpu;

static double max_abs_diff(kiln_tensor *a, kiln_tensor *b) {
  if (!a || !b || kiln_numel(a) != kiln_numel(b)) return INFINITY;
  kiln_scope_begin();
  kiln_tensor *d = kiln_to_device(kiln_to_dtype(kiln_sub(kiln_to_device(a, cpu), kiln_to_device(b, cpu)), KILN_F64), cpu);
  double m = d ? kiln_item(kiln_amax(kiln_abs(d), 0, NULL, false)) : INFINITY;
  kiln_scope_end();
  return m;
}

static kiln_tensor *logits_of(kiln_module *m, kiln_tensor *ids) {
  if (!m) return NULL;
  kiln_module_eval(m);
  return kiln_module_forward(m, ids);
}

/* The loss over the fixture's ids (next-token targets) and every parameter's gradient. */
static kiln_tensor *loss_and_grads(kiln_module *m, kiln_tensor *ids, kiln_device dev) {
  kiln_module_eval(m); /* no dropout: the two devices would draw different masks from the global generator */
  int64_t B = kiln_size(ids, 0), T = kiln_size(ids, 1);
  kiln_tensor *x = kiln_to_device(kiln_narrow(ids, 1, 0, T - 1), dev);
  kiln_tensor *y = kiln_to_device(kiln_contiguous(kiln_narrow(ids, 1, 1, T - 1)), dev);
  kiln_tensor *logits = kiln_module_forward(m, x);
  if (!logits) return NULL;
  int64_t V = kiln_size(logits, 2);
  kiln_tensor *loss = kiln_cross_entropy(kiln_reshape(logits, 2, (int64_t[]){B * (T - 1), V}),
                                         kiln_reshape(y, 1, (int64_t[]){B * (T - 1)}), KILN_REDUCTION_MEAN, -100, 0.0);
  if (!loss || kiln_backward(loss, NULL) != KILN_OK) return NULL;
  return loss;
}

int main(void) {
  cpu = kiln_device_cpu();
  if (kiln_device_count(KILN_DEVICE_CUDA) == 0) {
    printf("test_nn_gpt_hf_cuda: skipped (no cuda device)\n");
    return 77;
  }
  gpu = kiln_device_cuda(0);
  char fix[4096], path[4200];
  const char *src = getenv("KILN_SOURCE_DIR");
  snprintf(fix, sizeof fix, "%s/tests/fixtures/hf_gpt2", src ? src : ".");
  snprintf(path, sizeof path, "%s/logits.safetensors", fix);
  kiln_dict *ref = kiln_safetensors_load(path, cpu);
  if (!ref) {
    fprintf(stderr, "fixture missing (%s): %s\n", fix, kiln_last_error_message());
    return 1;
  }
  kiln_tensor *ids = kiln_dict_get(ref, "ids"), *want = kiln_dict_get(ref, "logits");
  kiln_fallback_reset();
  for (int strict = 0; strict < 2; strict++) {
    if (strict) kiln_set_fallback_policy(KILN_FALLBACK_ERROR);
    kiln_scope_begin();
    kiln_module *mg = kiln_gpt_from_hf(fix, NULL, KILN_F32, gpu);
    kiln_module *mc = kiln_gpt_from_hf(fix, NULL, KILN_F32, cpu);
    CHECK(mg != NULL && mc != NULL);
    kiln_tensor *got = logits_of(mg, kiln_to_device(ids, gpu));
    double d = max_abs_diff(got, want);
    printf("parity on cuda%s: max |kiln - transformers| logits = %.3g (bound 1e-4)\n",
           strict ? " (fallback error)" : "", d);
    CHECK(d < 1e-4);
    /* gradients of a step against the CPU's */
    kiln_tensor *lg = mg ? loss_and_grads(mg, ids, gpu) : NULL, *lc = mc ? loss_and_grads(mc, ids, cpu) : NULL;
    CHECK(lg != NULL && lc != NULL);
    if (lg && lc) {
      kiln_tensor *pg[64], *pc[64];
      int n = kiln_module_parameters(mg, pg, 64), nc = kiln_module_parameters(mc, pc, 64);
      CHECK(n == nc && n > 0);
      double worst = 0;
      for (int i = 0; i < n && i < nc; i++) {
        double gd = max_abs_diff(kiln_grad(pg[i]), kiln_grad(pc[i]));
        if (!(gd <= worst)) worst = gd;
      }
      printf("step on cuda%s: loss %.6f (cpu %.6f), max |grad cuda - grad cpu| = %.3g (bound 1e-4)\n",
             strict ? " (fallback error)" : "", kiln_item(lg), kiln_item(lc), worst);
      CHECK(fabs(kiln_item(lg) - kiln_item(lc)) < 1e-5);
      CHECK(worst < 1e-4);
    }
    kiln_module_free(mg);
    kiln_module_free(mc);
    kiln_scope_end();
    if (!strict) {
      printf("ops that fell back to the CPU in the default run:\n");
      kiln_fallback_report(stdout);
    }
  }
  kiln_dict_free(ref);
  printf("test_nn_gpt_hf_cuda: %d failed\n", failures);
  return failures ? 1 : 0;
}
