/*
** Dropout: out = t * mask, mask = 1/(1-p) with probability 1-p, else 0.
**
** The mask comes from the RAND_BERNOULLI kernel on t's device, drawn from the counter-
** based generator (same seed, same mask on any device), and the product goes through
** kiln_mul, whose backward (g * mask) is exactly dropout's: nothing to write here.
*/
#include "../core/kiln_int.h"

#include <math.h>

kiln_tensor *kiln_dropout(kiln_tensor *t, double p, bool train, kiln_generator *gen) {
  if (!t) return NULL;
  if (!(p >= 0.0 && p <= 1.0))
    KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "kiln_dropout: p must be in [0, 1], got %g", p);
  if (!kiln_dtype_is_float(t->dtype))
    KILN__FAIL_NULL(KILN_ERR_DTYPE, "kiln_dropout: expected a floating tensor, got %s (shape %s)",
                    kiln_dtype_name(t->dtype), kiln__tshape(t));
  /* Identity: the same tensor, as a new reference for the caller's scope (PyTorch
  ** returns the input itself too). */
  if (!train || p == 0.0) return kiln__scope_track(kiln_tensor_ref(t));
  kiln_device dev = kiln_device_of(t);
  kiln_scope_begin();
  kiln_tensor *r = NULL;
  kiln_tensor *mask = kiln__tensor_new(t->ndim, t->shape, t->dtype, dev);
  if (mask) {
    kiln_status st = KILN_OK;
    int64_t n = kiln_numel(mask);
    if (n > 0) {
      double keep = 1.0 - p;
      kiln__kargs a = {0};
      a.op = KILN__K_RAND_BERNOULLI;
      a.n_out = 1;
      a.out[0] = kiln__view_of(mask);
      a.s[0] = keep;
      a.s[1] = keep > 0.0 ? 1.0 / keep : 0.0; /* p == 1: every element dropped */
      kiln__generator_reserve(gen ? gen : kiln_generator_global(), n, &a.seed, &a.offset);
      st = kiln__dispatch(dev, &a);
    }
    if (st == KILN_OK) r = kiln_mul(t, mask);
  }
  if (r) kiln_tensor_ref(r);
  kiln_scope_end();
  return kiln__scope_track(r);
}
