/* SGD with momentum, dampening, Nesterov and weight decay: torch.optim.SGD's
** single-tensor path (torch/optim/sgd.py, _single_tensor_sgd):
**   g = grad (negated when maximize); g += wd * p
**   momentum: b = clone(g) on the first step, else b = mu * b + (1 - dampening) * g
**             g = nesterov ? g + mu * b : b
**   p -= lr * g
** Ops per parameter: at most 4 (axpy, mul_, axpy_, axpy, axpy_). */
#include "optim/optim_int.h"

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

kiln_status kiln__sgd_rule(const kiln_optim_config *cfg, int n, kiln_tensor *const *params,
                           kiln__param_state *states) {
  for (int i = 0; i < n; i++) {
    if (!kiln_grad(params[i])) continue;
    kiln_scope_begin(); /* the temporaries of one parameter's update */
    kiln_status st = sgd_one(cfg, params[i], &states[i]);
    kiln_scope_end();
    if (st != KILN_OK) return st;
    states[i].step++;
  }
  return KILN_OK;
}
