/* Adam and AdamW: torch.optim.Adam / AdamW's single-tensor path
** (torch/optim/adam.py, _single_tensor_adam), t the parameter's step after increment:
**   g = grad (negated when maximize)
**   Adam:  g += wd * p            AdamW: p *= 1 - lr * wd
**   m = b1 m + (1 - b1) g          (PyTorch writes m.lerp_(g, 1 - b1): the same value)
**   v = b2 v + (1 - b2) g*g
**   amsgrad: vmax = max(vmax, v); v' = vmax, else v' = v
**   denom = sqrt(v') / sqrt(1 - b2^t) + eps
**   p -= lr / (1 - b1^t) * m / denom
** About 9 ops per parameter; a fused path replaces this whole function (optim_int.h). */
#include <math.h>

#include "optim/optim_int.h"

/* The fused kernel (kiln_adam_step_) computes the same formulas in one pass, when the
** tensors allow it: contiguous, one dtype, no maximize. */
static bool fusable(const kiln_optim_config *c, kiln_tensor *p, kiln_tensor *g) {
  return !c->maximize && kiln_is_contiguous(p) && kiln_is_contiguous(g) &&
         kiln_dtype_of(g) == kiln_dtype_of(p);
}

static kiln_status adam_one(const kiln_optim_config *c, kiln_tensor *p, kiln__param_state *s) {
  kiln_tensor *g = kiln_grad(p);
  if (g && fusable(c, p, g)) {
    int nbuf = c->amsgrad ? 3 : 2;
    for (int k = 0; k < nbuf; k++)
      if (!s->buf[k] && !(s->buf[k] = kiln_keep(kiln_zeros_like(p)))) return kiln_last_error();
    if (c->capturable && !s->step_t &&
        !(s->step_t = kiln_keep(kiln_scalar((double)s->step, KILN_F64, kiln_device_of(p)))))
      return kiln_last_error();
    return kiln_adam_step_(p, g, s->buf[0], s->buf[1], c->amsgrad ? s->buf[2] : NULL, c->lr,
                           c->beta1, c->beta2, c->eps, c->weight_decay, s->step + 1,
                           c->kind == KILN_OPTIM_ADAMW, c->amsgrad, s->step_t);
  }
  if (c->maximize) g = kiln_neg(g);
  if (!g) return kiln_last_error();
  kiln_status st = KILN_OK;
  if (c->weight_decay != 0) {
    if (c->kind == KILN_OPTIM_ADAMW)
      st = kiln_mul_scalar_(p, 1.0 - c->lr * c->weight_decay);
    else if (!(g = kiln_axpy(g, c->weight_decay, p)))
      return kiln_last_error();
    if (st != KILN_OK) return st;
  }
  int nbuf = c->amsgrad ? 3 : 2;
  for (int k = 0; k < nbuf; k++)
    if (!s->buf[k] && !(s->buf[k] = kiln_keep(kiln_zeros_like(p)))) return kiln_last_error();
  kiln_tensor *m = s->buf[0], *v = s->buf[1];
  double t = (double)(s->step + 1);
  if ((st = kiln_mul_scalar_(m, c->beta1)) != KILN_OK) return st;
  if ((st = kiln_axpy_(m, 1.0 - c->beta1, g)) != KILN_OK) return st;
  if ((st = kiln_mul_scalar_(v, c->beta2)) != KILN_OK) return st;
  if ((st = kiln_axpy_(v, 1.0 - c->beta2, kiln_mul(g, g))) != KILN_OK) return st;
  if (c->amsgrad) {
    if ((st = kiln_copy_(s->buf[2], kiln_maximum(s->buf[2], v))) != KILN_OK) return st;
    v = s->buf[2];
  }
  double bc1 = 1.0 - pow(c->beta1, t);
  double bc2_sqrt = sqrt(1.0 - pow(c->beta2, t));
  kiln_tensor *denom = kiln_add_scalar(kiln_mul_scalar(kiln_sqrt(v), 1.0 / bc2_sqrt), c->eps);
  kiln_tensor *upd = kiln_div(m, denom);
  if (!upd) return kiln_last_error();
  return kiln_axpy_(p, -(c->lr / bc1), upd);
}

kiln_status kiln__adam_rule(const kiln_optim_config *cfg, int n, kiln_tensor *const *params,
                            kiln__param_state *states) {
  for (int i = 0; i < n; i++) {
    if (!kiln_grad(params[i])) continue;
    kiln_scope_begin();
    kiln_status st = adam_one(cfg, params[i], &states[i]);
    kiln_scope_end();
    if (st != KILN_OK) return st;
    states[i].step++;
  }
  return KILN_OK;
}
