/* The seam between the optimizer object (src/optim/optimizer.c) and the update rules.
**
** An update rule is a function over one parameter group: the configuration, n parameters
** and their per-parameter state. The portable rules (sgd.c, adam.c) are written with
** kiln's public in-place ops, one scope per parameter; a fused kernel (one launch for the
** whole group, e.g. a CUDA multi-tensor Adam) can replace a rule by providing a function
** of the same type and choosing it in kiln__optim_rule() when every parameter of the
** group is on its device. The rule must skip parameters without a gradient, advance
** step only for those it updated, and create state tensors lazily with no scope owning
** them (kiln_keep), on the parameter's device and dtype.
**
** found_inf (loss scaling; NULL otherwise) is an f32 one-element flag on the parameters'
** device that the rule must not read on the host: when it is non-zero on the device the
** parameters, their state and their step counts stay bit-identical. With it the step
** count lives on the device (step_t, made from step); step is not advanced on the host,
** and whoever needs the count reads step_t (state_dict, device moves). */
#ifndef KILN_OPTIM_INT_H
#define KILN_OPTIM_INT_H

#include "kiln_optim.h"
#include "ext/kiln_ext.h"

enum { KILN__OPTIM_MAX_STATE = 3 };

typedef struct kiln__param_state {
  int64_t step;                             /* updates applied to this parameter */
  kiln_tensor *buf[KILN__OPTIM_MAX_STATE];  /* owned; NULL until first needed */
  kiln_tensor *step_t; /* capturable or loss-scaled: the step count (f64, 0-dim) on the
                       ** param's device; when set it is the true count, not step */
} kiln__param_state;

typedef kiln_status (*kiln__optim_rule_fn)(const kiln_optim_config *cfg, int n,
                                           kiln_tensor *const *params, kiln__param_state *states,
                                           kiln_tensor *found_inf);

kiln_status kiln__sgd_rule(const kiln_optim_config *cfg, int n, kiln_tensor *const *params,
                           kiln__param_state *states, kiln_tensor *found_inf);
/* Adam and AdamW (cfg->kind decides where weight decay goes). */
kiln_status kiln__adam_rule(const kiln_optim_config *cfg, int n, kiln_tensor *const *params,
                            kiln__param_state *states, kiln_tensor *found_inf);
/* kiln_optimizer_step with the loss scaler's found-inf flag (see the rule's found_inf
** above): nothing is read on the host; the step is skipped on the device when the flag
** is set, and the optimizer's step count (kiln_optimizer_steps) does not count it. */
kiln_status kiln__optimizer_step_found_inf(kiln_optimizer *o, kiln_tensor *found_inf);
/* Makes s->step_t (f64, on p's device) from s->step when it is missing. */
kiln_status kiln__optim_step_on_device(kiln_tensor *p, kiln__param_state *s);
/* The composed rules' skip: now[i] = found_inf != 0 ? before[i] : now[i] on the device
** (before[i] a copy taken before the update; NULL entries ignored). Temporaries go to the
** caller's scope. */
kiln_status kiln__optim_undo_if_inf(kiln_tensor *found_inf, int n, kiln_tensor *const *now,
                                    kiln_tensor *const *before);
/* s->step_t += 1, or += (found_inf == 0) with found_inf, on the device. */
kiln_status kiln__optim_advance_step(kiln__param_state *s, kiln_tensor *found_inf);
/* The rule for a group (the place a fused path plugs in). */
kiln__optim_rule_fn kiln__optim_rule(const kiln_optim_config *cfg, int n, kiln_tensor *const *params);
/* State tensor names of a kind ("momentum_buffer"; "exp_avg", "exp_avg_sq",
** "max_exp_avg_sq"); NULL past the last. */
const char *kiln__optim_state_name(kiln_optim_kind kind, int i);

/* kiln__optimizer_load_state_dict and kiln__scheduler_load_state_dict (the checked loads
** checkpoints use) are declared in ext/kiln_ext.h. */

#endif /* KILN_OPTIM_INT_H */
