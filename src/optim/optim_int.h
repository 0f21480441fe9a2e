/* The seam between the optimizer object (src/optim/optimizer.c) and the update rules.
**
** An update rule is a function over one parameter group: the configuration, n parameters
** and their per-parameter state. The portable rules (sgd.c, adam.c) are written with
** kiln's public in-place ops, one scope per parameter; a fused kernel (one launch for the
** whole group, e.g. a CUDA multi-tensor Adam) can replace a rule by providing a function
** of the same type and choosing it in kiln__optim_rule() when every parameter of the
** group is on its device. The rule must skip parameters without a gradient, advance
** step only for those it updated, and create state tensors lazily with no scope owning
** them (kiln_keep), on the parameter's device and dtype. */
#ifndef KILN_OPTIM_INT_H
#define KILN_OPTIM_INT_H

#include "kiln_optim.h"
#include "ext/kiln_ext.h"

enum { KILN__OPTIM_MAX_STATE = 3 };

typedef struct kiln__param_state {
  int64_t step;                             /* updates applied to this parameter */
  kiln_tensor *buf[KILN__OPTIM_MAX_STATE];  /* owned; NULL until first needed */
  kiln_tensor *step_t; /* capturable: the step count (f64, 0-dim) on the param's device */
} kiln__param_state;

typedef kiln_status (*kiln__optim_rule_fn)(const kiln_optim_config *cfg, int n,
                                           kiln_tensor *const *params, kiln__param_state *states);

kiln_status kiln__sgd_rule(const kiln_optim_config *cfg, int n, kiln_tensor *const *params,
                           kiln__param_state *states);
/* Adam and AdamW (cfg->kind decides where weight decay goes). */
kiln_status kiln__adam_rule(const kiln_optim_config *cfg, int n, kiln_tensor *const *params,
                            kiln__param_state *states);
/* The rule for a group (the place a fused path plugs in). */
kiln__optim_rule_fn kiln__optim_rule(const kiln_optim_config *cfg, int n, kiln_tensor *const *params);
/* State tensor names of a kind ("momentum_buffer"; "exp_avg", "exp_avg_sq",
** "max_exp_avg_sq"); NULL past the last. */
const char *kiln__optim_state_name(kiln_optim_kind kind, int i);

/* kiln__optimizer_load_state_dict and kiln__scheduler_load_state_dict (the checked loads
** checkpoints use) are declared in ext/kiln_ext.h. */

#endif /* KILN_OPTIM_INT_H */
