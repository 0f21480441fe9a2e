/* Adam and AdamW: torch.optim.Adam / AdamW's single-tensor path
** (torch/optim/adam.py, _single_tensor_adam), t the parameter's step after increment:
**   g = grad (negated when maximize)
**   Adam:  g += wd * p            AdamW: p *= 1 - lr * wd
**   m = m * b1 + (1 - b1) g        exp_avg.mul_(b1).add_(g, alpha=1 - b1) (1.13; 2.x: lerp_)
**   v = v * b2 + (1 - b2) g * g    exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
**   amsgrad: vmax = max(vmax, v); v' = vmax, else v' = v
**   denom = sqrt(v') / sqrt(1 - b2^t) + eps
**   p += (-(lr / (1 - b1^t)) * m) / denom     param.addcdiv_(exp_avg, denom, value=-step_size)
** Scalars in double, as Python computes them. The fused kernel (cpu_optim.c,
** cuda_optim.cu) gives PyTorch's values to the bit; this composed path (maximize, strided
** or mixed-dtype gradients) matches it except for addcmul's FMA, which no kiln op has.
** About 10 ops per parameter. */
#include <math.h>
#include <stdlib.h>

#include "optim/optim_int.h"

/* The fused kernel (kiln_adam_step_) computes the same formulas in one pass, when the
** tensors allow it: contiguous, one dtype, no maximize. */
static bool fusable(const kiln_optim_config *c, kiln_tensor *p, kiln_tensor *g) {
  return !c->maximize && kiln_is_contiguous(p) && kiln_is_contiguous(g) &&
         kiln_dtype_of(g) == kiln_dtype_of(p);
}

/* The composed update, for what the fused kernel does not take (maximize, strided or
** mixed-dtype gradients). */
static kiln_status adam_one(const kiln_optim_config *c, kiln_tensor *p, kiln__param_state *s) {
  kiln_tensor *g = kiln_grad(p);
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
  /* PyTorch: v = fma((1 - b2) g, g, v) (addcmul); kiln's ops round the product once more */
  if ((st = kiln_axpy_(v, 1.0, kiln_mul(kiln_mul_scalar(g, 1.0 - c->beta2), g))) != KILN_OK) return st;
  if (c->amsgrad) {
    if ((st = kiln_copy_(s->buf[2], kiln_maximum(s->buf[2], v))) != KILN_OK) return st;
    v = s->buf[2];
  }
  double step_size = c->lr / (1.0 - pow(c->beta1, t));
  double bc2_sqrt = sqrt(1.0 - pow(c->beta2, t));
  kiln_tensor *bc2s = kiln_scalar(bc2_sqrt, kiln_dtype_of(v), kiln_device_of(v));
  kiln_tensor *denom = kiln_add_scalar(kiln_div(kiln_sqrt(v), bc2s), c->eps);
  kiln_tensor *upd = kiln_div(kiln_mul_scalar(m, -step_size), denom);
  if (!upd) return kiln_last_error();
  return kiln_axpy_(p, 1.0, upd);
}

/* Creates the state adam_one's fused path uses (exp_avg, exp_avg_sq[, max], step_t). */
static kiln_status fused_state(const kiln_optim_config *c, kiln_tensor *p, kiln__param_state *s) {
  int nbuf = c->amsgrad ? 3 : 2;
  for (int k = 0; k < nbuf; k++)
    if (!s->buf[k] && !(s->buf[k] = kiln_keep(kiln_zeros_like(p)))) return kiln_last_error();
  if (c->capturable && !s->step_t &&
      !(s->step_t = kiln_keep(kiln_scalar((double)s->step, KILN_F64, kiln_device_of(p)))))
    return kiln_last_error();
  return KILN_OK;
}

/* The fusable parameters go to one multi-tensor update (one launch per device and dtype
** on CUDA), the others through adam_one. */
kiln_status kiln__adam_rule(const kiln_optim_config *cfg, int n, kiln_tensor *const *params,
                            kiln__param_state *states) {
  kiln_tensor **arr = malloc((size_t)(n > 0 ? n : 1) * 7 * sizeof *arr);
  int64_t *steps = malloc((size_t)(n > 0 ? n : 1) * sizeof *steps);
  int *which = malloc((size_t)(n > 0 ? n : 1) * sizeof *which);
  if (!arr || !steps || !which) {
    free(arr), free(steps), free(which);
    return kiln_set_error(KILN_ERR_OOM, "kiln_optimizer_step: out of host memory");
  }
  kiln_tensor **P = arr, **G = arr + n, **M = arr + 2 * n, **V = arr + 3 * n, **X = arr + 4 * n,
              **T = arr + 5 * n;
  int m = 0;
  kiln_status st = KILN_OK;
  for (int i = 0; i < n && st == KILN_OK; i++) {
    kiln_tensor *g = kiln_grad(params[i]);
    if (!g) continue;
    if (fusable(cfg, params[i], g)) {
      kiln__param_state *s = &states[i];
      if ((st = fused_state(cfg, params[i], s)) != KILN_OK) break;
      P[m] = params[i], G[m] = g, M[m] = s->buf[0], V[m] = s->buf[1];
      X[m] = cfg->amsgrad ? s->buf[2] : NULL;
      T[m] = s->step_t;
      steps[m] = s->step + 1;
      which[m++] = i;
      continue;
    }
    kiln_scope_begin();
    st = adam_one(cfg, params[i], &states[i]);
    kiln_scope_end();
    if (st == KILN_OK) states[i].step++;
  }
  if (st == KILN_OK && m > 0) {
    st = kiln_adam_multi_step_(m, P, G, M, V, cfg->amsgrad ? X : NULL, steps,
                               cfg->capturable ? T : NULL, cfg->lr, cfg->beta1, cfg->beta2,
                               cfg->eps, cfg->weight_decay, cfg->kind == KILN_OPTIM_ADAMW,
                               cfg->amsgrad);
    for (int k = 0; k < m && st == KILN_OK; k++) states[which[k]].step++;
  }
  free(arr), free(steps), free(which);
  return st;
}
