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
static bool channels_last(const kiln_tensor *t) {
  return t && kiln_ndim(t) == 4 && kiln_is_contiguous_format(t, KILN_CHANNELS_LAST) && !kiln_is_contiguous(t);
}
static bool fusable(const kiln_optim_config *c, kiln_tensor *p, kiln_tensor *g) {
  return !c->maximize && kiln_dtype_of(g) == kiln_dtype_of(p) &&
         ((kiln_is_contiguous(p) && kiln_is_contiguous(g)) || (channels_last(p) && channels_last(g)));
}
/* A channels-last model (kiln_module_to_format): the fused kernels walk memory in order,
** so they take the (N, H, W, C) views of p, g and the state (contiguous, the same
** memory) when all share that layout (the state is made as zeros_like(p), so it does). */
static bool same_layout(const kiln_tensor *p, kiln_tensor *const *bufs, int n) {
  if (!channels_last(p)) return true;
  for (int k = 0; k < n; k++)
    if (!channels_last(bufs[k])) return false;
  return true;
}
static kiln_tensor *dense_view(kiln_tensor *t) {
  static const int to_nhwc[4] = {0, 2, 3, 1};
  return channels_last(t) ? kiln_permute(t, 4, to_nhwc) : t;
}

/* The bias corrections from the device step count t = step_t + 1, as tensors of dtype dt:
** -(lr / (1 - b1^t)) and sqrt(1 - b2^t) (the host's formulas in f64 on the device, so a
** skipped or replayed step needs no host read). */
static kiln_status device_corr(const kiln_optim_config *c, kiln_tensor *step_t, kiln_dtype dt, kiln_tensor **nss,
                               kiln_tensor **bc2s) {
  kiln_device dev = kiln_device_of(step_t);
  kiln_tensor *t = kiln_add_scalar(kiln_view(step_t, 0, NULL), 1.0);
  kiln_tensor *b1t = kiln_pow(kiln_scalar(c->beta1, KILN_F64, dev), t);
  kiln_tensor *b2t = kiln_pow(kiln_scalar(c->beta2, KILN_F64, dev), t);
  kiln_tensor *bc1 = kiln_add_scalar(kiln_neg(b1t), 1.0);
  *nss = kiln_to_dtype(kiln_neg(kiln_div(kiln_scalar(c->lr, KILN_F64, dev), bc1)), dt);
  *bc2s = kiln_to_dtype(kiln_sqrt(kiln_add_scalar(kiln_neg(b2t), 1.0)), dt);
  return *nss && *bc2s ? KILN_OK : kiln_last_error();
}

/* The composed update, for what the fused kernel does not take (maximize, strided or
** mixed-dtype gradients). With a device step count (step_t) the bias corrections are
** worked out on the device; with found_inf the update is undone on the device when the
** flag is set (copies of p and its state taken first), and step_t only advances when it
** is clear. */
static kiln_status adam_one(const kiln_optim_config *c, kiln_tensor *p, kiln__param_state *s,
                            kiln_tensor *found_inf) {
  int nkeep = c->amsgrad ? 3 : 2;
  kiln_tensor *now[4] = {p, NULL, NULL, NULL}, *before[4] = {NULL, NULL, NULL, NULL};
  if (found_inf) {
    kiln_status st0 = kiln__optim_step_on_device(p, s);
    for (int k = 0; k < nkeep && st0 == KILN_OK; k++)
      if (!s->buf[k] && !(s->buf[k] = kiln_keep(kiln_zeros_like(p)))) st0 = kiln_last_error();
    if (st0 != KILN_OK) return st0;
    before[0] = kiln_clone(p);
    for (int k = 0; k < nkeep; k++) now[1 + k] = s->buf[k], before[1 + k] = kiln_clone(s->buf[k]);
    if (!before[0] || !before[nkeep]) return kiln_last_error();
  }
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
  kiln_tensor *bc2s, *upd;
  if (s->step_t) {
    kiln_tensor *nss;
    if ((st = device_corr(c, s->step_t, kiln_dtype_of(v), &nss, &bc2s)) != KILN_OK) return st;
    kiln_tensor *denom = kiln_add_scalar(kiln_div(kiln_sqrt(v), bc2s), c->eps);
    upd = kiln_div(kiln_mul(m, nss), denom);
  } else {
    double step_size = c->lr / (1.0 - pow(c->beta1, t));
    double bc2_sqrt = sqrt(1.0 - pow(c->beta2, t));
    bc2s = kiln_scalar(bc2_sqrt, kiln_dtype_of(v), kiln_device_of(v));
    kiln_tensor *denom = kiln_add_scalar(kiln_div(kiln_sqrt(v), bc2s), c->eps);
    upd = kiln_div(kiln_mul_scalar(m, -step_size), denom);
  }
  if (!upd) return kiln_last_error();
  if ((st = kiln_axpy_(p, 1.0, upd)) != KILN_OK) return st;
  if (found_inf && (st = kiln__optim_undo_if_inf(found_inf, 1 + nkeep, now, before)) != KILN_OK) return st;
  return s->step_t ? kiln__optim_advance_step(s, found_inf) : KILN_OK;
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
                            kiln__param_state *states, kiln_tensor *found_inf) {
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
  kiln_scope_begin(); /* the channels-last views handed to the fused update */
  bool grad_was = kiln_set_grad_enabled(false);
  /* The steps live on the device when captured, loss-scaled, or once they have been. */
  bool on_dev = cfg->capturable || found_inf;
  for (int i = 0; i < n && !on_dev; i++) on_dev = states[i].step_t != NULL;
  for (int i = 0; i < n && st == KILN_OK; i++) {
    kiln_tensor *g = kiln_grad(params[i]);
    if (!g) continue;
    kiln__param_state *s = &states[i];
    if (fusable(cfg, params[i], g) && (st = fused_state(cfg, params[i], s)) != KILN_OK) break;
    if (fusable(cfg, params[i], g) && same_layout(params[i], s->buf, cfg->amsgrad ? 3 : 2)) {
      if (on_dev && (st = kiln__optim_step_on_device(params[i], s)) != KILN_OK) break;
      P[m] = dense_view(params[i]), G[m] = dense_view(g), M[m] = dense_view(s->buf[0]), V[m] = dense_view(s->buf[1]);
      X[m] = cfg->amsgrad ? dense_view(s->buf[2]) : NULL;
      if (!P[m] || !G[m] || !M[m] || !V[m] || (cfg->amsgrad && !X[m])) {
        st = kiln_last_error();
        break;
      }
      T[m] = s->step_t;
      steps[m] = s->step + 1;
      which[m++] = i;
      continue;
    }
    /* A device step count here too: a captured step that read the host's count would
    ** replay its bias corrections from the capture forever. */
    if (on_dev && (st = kiln__optim_step_on_device(params[i], &states[i])) != KILN_OK) break;
    kiln_scope_begin();
    st = adam_one(cfg, params[i], &states[i], found_inf);
    kiln_scope_end();
    if (st == KILN_OK && !found_inf) states[i].step++; /* with found_inf, step_t counts */
  }
  if (st == KILN_OK && m > 0) {
    st = kiln_adam_multi_step_amp_(m, P, G, M, V, cfg->amsgrad ? X : NULL, steps, on_dev ? T : NULL, cfg->lr,
                                   cfg->beta1, cfg->beta2, cfg->eps, cfg->weight_decay,
                                   cfg->kind == KILN_OPTIM_ADAMW, cfg->amsgrad, found_inf);
    for (int k = 0; k < m && st == KILN_OK && !found_inf; k++) states[which[k]].step++;
  }
  kiln_set_grad_enabled(grad_was);
  kiln_scope_end();
  free(arr), free(steps), free(which);
  return st;
}
