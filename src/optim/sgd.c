/* SGD with momentum, dampening, Nesterov and weight decay: torch.optim.SGD's
** single-tensor path (torch/optim/sgd.py, _single_tensor_sgd):
**   g = grad (negated when maximize); g += wd * p
**   momentum: b = clone(g) on the first step, else b = mu * b + (1 - dampening) * g
**             g = nesterov ? g + mu * b : b
**   p -= lr * g
** Ops per parameter: at most 4 (axpy, mul_, axpy_, axpy, axpy_).
**
** Loss-scaled steps (found_inf given) cannot ask the host whether to step, so they compute
** the new p and b out of place and select them on the device:
**   p = found_inf ? p : p_new;  b = found_inf ? b : b_new
** with the first-step rule read from the device step count (step_t == 0: b_new = g), so a
** skipped first step leaves the buffer as if it were never made. The arithmetic of p_new
** and b_new is the in-place path's, op for op, so a clean scaled step gives the same bits.
**
** Parameters whose gradient has their dtype and which are both contiguous (all of them,
** in practice) go instead to kiln_sgd_multi_step_: one SGD_MULTI kernel call per device
** and dtype (CUDA: one launch for up to 48 tensors, where the ops above took 3-5 launches
** per parameter: 1,288 a step for ResNet-50's 161), with the same arithmetic to the bit
** on the CPU (tests/test_optim_sgd_multi.c). The functions below stay for the others. */
#include "optim/optim_int.h"

#include <stdlib.h>

static kiln_status sgd_one(const kiln_optim_config *c, kiln_tensor *p, kiln__param_state *s) {
  kiln_tensor *g = kiln_grad(p);
  if (c->maximize) g = kiln_neg(g);
  if (c->weight_decay != 0) g = kiln_axpy(g, c->weight_decay, p);
  if (!g) return kiln_last_error();
  if (c->momentum != 0) {
    if (!s->buf[0]) {
      /* The first step's buffer is the gradient itself (PyTorch: torch.clone(grad)). */
      s->buf[0] = kiln_keep(kiln_clone(g));
      if (!s->buf[0]) return kiln_last_error();
    } else {
      kiln_status st = kiln_mul_scalar_(s->buf[0], c->momentum);
      if (st == KILN_OK) st = kiln_axpy_(s->buf[0], 1.0 - c->dampening, g);
      if (st != KILN_OK) return st;
    }
    g = c->nesterov ? kiln_axpy(g, c->momentum, s->buf[0]) : s->buf[0];
    if (!g) return kiln_last_error();
  }
  return kiln_axpy_(p, -c->lr, g);
}

/* The loss-scaled step (see the top): nothing read on the host. found_inf NULL: a plain
** step with the device step count (the first-step rule from step_t). */
static kiln_status sgd_one_scaled(const kiln_optim_config *c, kiln_tensor *p, kiln__param_state *s,
                                  kiln_tensor *found_inf) {
  kiln_status st = kiln__optim_step_on_device(p, s);
  if (st != KILN_OK) return st;
  kiln_tensor *g = kiln_grad(p);
  if (c->maximize) g = kiln_neg(g);
  if (c->weight_decay != 0) g = kiln_axpy(g, c->weight_decay, p);
  if (!g) return kiln_last_error();
  kiln_tensor *now[2] = {p, NULL}, *fresh[2] = {NULL, NULL};
  if (c->momentum != 0) {
    if (!s->buf[0] && !(s->buf[0] = kiln_keep(kiln_zeros_like(p)))) return kiln_last_error();
    kiln_tensor *later = kiln_axpy(kiln_mul_scalar(s->buf[0], c->momentum), 1.0 - c->dampening, g);
    kiln_tensor *first = kiln_eq_scalar(kiln_view(s->step_t, 0, NULL), 0.0);
    kiln_tensor *b = later && first ? kiln_where(first, g, later) : NULL;
    if (!b) return kiln_last_error();
    now[1] = s->buf[0];
    fresh[1] = b;
    g = c->nesterov ? kiln_axpy(g, c->momentum, b) : b;
    if (!g) return kiln_last_error();
  }
  fresh[0] = kiln_axpy(p, -c->lr, g);
  if (!fresh[0]) return kiln_last_error();
  /* keep = the old values when found_inf is set; the fresh ones otherwise (and always
  ** without found_inf: a plain step after scaled ones) */
  kiln_tensor *bad = NULL;
  if (found_inf &&
      !(bad = kiln_ne(kiln_view(found_inf, 0, NULL), kiln_scalar(0.0, KILN_F32, kiln_device_of(found_inf)))))
    return kiln_last_error();
  for (int k = 0; k < 2; k++) {
    if (!now[k]) continue;
    if ((st = kiln_copy_(now[k], bad ? kiln_where(bad, now[k], fresh[k]) : fresh[k])) != KILN_OK) return st;
  }
  return kiln__optim_advance_step(s, found_inf);
}

static bool channels_last(const kiln_tensor *t) {
  return t && kiln_ndim(t) == 4 && kiln_is_contiguous_format(t, KILN_CHANNELS_LAST) && !kiln_is_contiguous(t);
}
/* Contiguous, or all channels-last (kiln_module_to_format: p, g and the momentum buffer,
** made as zeros_like(p)), one dtype. As in adam.c, a channels-last tensor reaches the
** kernel as its (N, H, W, C) view, which is contiguous and the same memory. */
static bool fusable(kiln_tensor *p, kiln_tensor *g, kiln_tensor *buf) {
  if (kiln_dtype_of(g) != kiln_dtype_of(p)) return false;
  if (kiln_is_contiguous(p) && kiln_is_contiguous(g)) return !buf || kiln_is_contiguous(buf);
  return channels_last(p) && channels_last(g) && (!buf || channels_last(buf));
}
static kiln_tensor *dense_view(kiln_tensor *t) {
  static const int to_nhwc[4] = {0, 2, 3, 1};
  return channels_last(t) ? kiln_permute(t, 4, to_nhwc) : t;
}

/* One kiln_sgd_multi_step_ call over m parameters (P, G, B, first or T). */
static kiln_status multi(const kiln_optim_config *c, int m, kiln_tensor **P, kiln_tensor **G, kiln_tensor **B,
                         const bool *first, kiln_tensor **T, kiln_tensor *found_inf) {
  if (m == 0) return KILN_OK;
  return kiln_sgd_multi_step_(m, P, G, c->momentum != 0 ? B : NULL, first, T, c->lr, c->momentum, c->dampening,
                              c->weight_decay, c->nesterov, c->maximize, found_inf);
}

kiln_status kiln__sgd_rule(const kiln_optim_config *cfg, int n, kiln_tensor *const *params,
                           kiln__param_state *states, kiln_tensor *found_inf) {
  size_t cap = (size_t)(n > 0 ? n : 1);
  kiln_tensor **arr = malloc(cap * 7 * sizeof *arr);
  bool *first = malloc(cap * sizeof *first);
  int *which = malloc(cap * 2 * sizeof *which);
  if (!arr || !first || !which) {
    free(arr), free(first), free(which);
    return kiln_set_error(KILN_ERR_OOM, "kiln_optimizer_step: out of host memory");
  }
  /* two lists: steps on the host (H: the first step marked here) and on the device (D:
  ** loss-scaled, or once they have been: the first step read from step_t there) */
  kiln_tensor **HP = arr, **HG = arr + n, **HB = arr + 2 * (size_t)n;
  kiln_tensor **DP = arr + 3 * (size_t)n, **DG = arr + 4 * (size_t)n, **DB = arr + 5 * (size_t)n,
              **DT = arr + 6 * (size_t)n;
  int *hw = which, *dw = which + n;
  int mh = 0, md = 0;
  kiln_status st = KILN_OK;
  kiln_scope_begin(); /* the channels-last views handed to the fused update */
  for (int i = 0; i < n && st == KILN_OK; i++) {
    kiln_tensor *g = kiln_grad(params[i]);
    if (!g) continue;
    kiln__param_state *s = &states[i];
    /* A gradient dense in the other layout than its parameter (a channels-last conv
    ** weight whose backward made the gradient contiguous): one copy into the parameter's
    ** layout, a temporary of this scope, lets the fused update take it. Without it each
    ** such parameter ran the five composed ops: ResNet-18's 20 conv weights took 27 ms of
    ** a channels-last CPU step, against 6 ms for all 62 parameters fused. The update's
    ** values are the same; only the memory order of g's reads changes. */
    if (kiln_dtype_of(g) == kiln_dtype_of(params[i]) && !fusable(params[i], g, s->buf[0])) {
      if (channels_last(params[i]) && kiln_is_contiguous(g)) g = kiln_contiguous_format(g, KILN_CHANNELS_LAST);
      else if (kiln_is_contiguous(params[i]) && channels_last(g)) g = kiln_contiguous(g);
      if (!g) {
        st = kiln_last_error();
        break;
      }
    }
    if (fusable(params[i], g, s->buf[0])) {
      bool fresh = false;
      if (cfg->momentum != 0 && !s->buf[0]) {
        if (!(s->buf[0] = kiln_keep(kiln_zeros_like(params[i])))) {
          st = kiln_last_error();
          break;
        }
        fresh = true;
      }
      if (found_inf || s->step_t) {
        if ((st = kiln__optim_step_on_device(params[i], s)) != KILN_OK) break;
        DP[md] = dense_view(params[i]), DG[md] = dense_view(g), DB[md] = dense_view(s->buf[0]), DT[md] = s->step_t;
        dw[md++] = i;
      } else {
        HP[mh] = dense_view(params[i]), HG[mh] = dense_view(g), HB[mh] = dense_view(s->buf[0]);
        first[mh] = fresh;
        hw[mh++] = i;
      }
      continue;
    }
    kiln_scope_begin(); /* the temporaries of one parameter's update */
    /* Once the count is on the device (an earlier scaled step) the first-step rule reads
    ** it there: a skipped first step left a zero buffer, which sgd_one would take for
    ** a later step's. */
    st = found_inf || s->step_t ? sgd_one_scaled(cfg, params[i], s, found_inf) : sgd_one(cfg, params[i], s);
    kiln_scope_end();
    if (st == KILN_OK && !found_inf) s->step++; /* scaled: step_t counts on the device */
  }
  if (st == KILN_OK) st = multi(cfg, mh, HP, HG, HB, first, NULL, NULL);
  for (int k = 0; k < mh && st == KILN_OK; k++) states[hw[k]].step++;
  if (st == KILN_OK) st = multi(cfg, md, DP, DG, DB, NULL, DT, found_inf);
  for (int k = 0; k < md && st == KILN_OK && !found_inf; k++) states[dw[k]].step++;
  kiln_scope_end();
  free(arr), free(first), free(which);
  return st;
}
