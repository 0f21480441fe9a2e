/* kiln_optimizer: the parameter list, per-parameter state, zero_grad/step, and the state
** dict. The update rules live in sgd.c and adam.c behind optim_int.h's seam. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "optim/optim_int.h"

struct kiln_optimizer {
  kiln_optim_config cfg;
  int n;
  kiln_tensor **params;      /* one reference each */
  kiln__param_state *st;     /* n entries */
  kiln_module *module;       /* not owned; NULL for a list optimizer */
  kiln_tensor **scratch;     /* n borrowed pointers, for re-reading the module */
  double *wd;                /* n per-parameter weight decays; NULL: cfg.weight_decay */
  int64_t steps;             /* step calls; the skipped ones are counted in skipped */
  /* Steps skipped on the device by the loss scaler (f64, one element, on found_inf's
  ** device; NULL until a scaled step): steps - skipped is the count of applied steps,
  ** read on the host only when asked. */
  kiln_tensor *skipped;
};

/* Applied steps: the host count less those the device skipped (a query: may wait). */
static int64_t applied_steps(const kiln_optimizer *o) {
  if (!o->skipped) return o->steps;
  double v = kiln_item(o->skipped);
  return v == v ? o->steps - (int64_t)v : o->steps;
}

static const char *const kind_names[KILN_OPTIM__COUNT] = {"sgd", "adam", "adamw"};

kiln_optim_config kiln_sgd_config(double lr) {
  kiln_optim_config c;
  memset(&c, 0, sizeof c);
  c.kind = KILN_OPTIM_SGD;
  c.lr = lr;
  c.beta1 = 0.9;
  c.beta2 = 0.999;
  c.eps = 1e-8;
  return c;
}

kiln_optim_config kiln_adam_config(double lr) {
  kiln_optim_config c = kiln_sgd_config(lr);
  c.kind = KILN_OPTIM_ADAM;
  return c;
}

kiln_optim_config kiln_adamw_config(double lr) {
  kiln_optim_config c = kiln_sgd_config(lr);
  c.kind = KILN_OPTIM_ADAMW;
  c.weight_decay = 0.01;
  return c;
}

const char *kiln__optim_state_name(kiln_optim_kind kind, int i) {
  static const char *const sgd[] = {"momentum_buffer", NULL};
  static const char *const adam[] = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", NULL};
  const char *const *names = kind == KILN_OPTIM_SGD ? sgd : adam;
  int count = kind == KILN_OPTIM_SGD ? 1 : 3;
  return i >= 0 && i < count ? names[i] : NULL;
}

kiln__optim_rule_fn kiln__optim_rule(const kiln_optim_config *cfg, int n, kiln_tensor *const *params) {
  (void)n;
  (void)params; /* a fused path would look at the devices of params here */
  return cfg->kind == KILN_OPTIM_SGD ? kiln__sgd_rule : kiln__adam_rule;
}

kiln_status kiln__optim_step_on_device(kiln_tensor *p, kiln__param_state *s) {
  if (s->step_t) return KILN_OK;
  s->step_t = kiln_keep(kiln_scalar((double)s->step, KILN_F64, kiln_device_of(p)));
  return s->step_t ? KILN_OK : kiln_last_error();
}

kiln_status kiln__optim_undo_if_inf(kiln_tensor *found_inf, int n, kiln_tensor *const *now,
                                    kiln_tensor *const *before) {
  kiln_device dev = kiln_device_of(found_inf);
  kiln_tensor *bad = kiln_ne(kiln_view(found_inf, 0, NULL), kiln_scalar(0.0, KILN_F32, dev));
  if (!bad) return kiln_last_error();
  for (int i = 0; i < n; i++) {
    if (!now[i] || !before[i]) continue;
    kiln_status st = kiln_copy_(now[i], kiln_where(bad, before[i], now[i]));
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

kiln_status kiln__optim_advance_step(kiln__param_state *s, kiln_tensor *found_inf) {
  if (!found_inf) return kiln_axpy_(s->step_t, 1.0, kiln_scalar(1.0, KILN_F64, kiln_device_of(s->step_t)));
  kiln_tensor *ok = kiln_to_dtype(kiln_eq_scalar(kiln_view(found_inf, 0, NULL), 0.0), KILN_F64);
  return ok ? kiln_axpy_(s->step_t, 1.0, ok) : kiln_last_error();
}

/* PyTorch's constructor checks, same wording where it has one. */
static kiln_status check_config(const kiln_optim_config *c, const char *who) {
  if (!c) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL config", who);
  if ((int)c->kind < 0 || c->kind >= KILN_OPTIM__COUNT)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: unknown optimizer kind %d", who, (int)c->kind);
  if (!(c->lr >= 0) || isinf(c->lr))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: invalid learning rate: %g", who, c->lr);
  if (!(c->weight_decay >= 0))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: invalid weight_decay value: %g", who,
                          c->weight_decay);
  if (c->kind == KILN_OPTIM_SGD) {
    if (!(c->momentum >= 0))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: invalid momentum value: %g", who, c->momentum);
    if (isnan(c->dampening))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: invalid dampening value: %g", who, c->dampening);
    if (c->nesterov && (c->momentum <= 0 || c->dampening != 0))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                            "%s: nesterov momentum requires a momentum and zero dampening "
                            "(momentum %g, dampening %g)", who, c->momentum, c->dampening);
  } else {
    if (!(c->eps >= 0)) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: invalid epsilon value: %g", who, c->eps);
    if (!(c->beta1 >= 0 && c->beta1 < 1))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: invalid beta parameter at index 0: %g", who, c->beta1);
    if (!(c->beta2 >= 0 && c->beta2 < 1))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: invalid beta parameter at index 1: %g", who, c->beta2);
  }
  return KILN_OK;
}

static kiln_optimizer *alloc_opt(const kiln_optim_config *cfg, int n, const char *who) {
  kiln_optimizer *o = calloc(1, sizeof *o);
  if (o) {
    o->params = calloc((size_t)(n ? n : 1), sizeof *o->params);
    o->st = calloc((size_t)(n ? n : 1), sizeof *o->st);
    o->scratch = calloc((size_t)(n ? n : 1), sizeof *o->scratch);
  }
  if (!o || !o->params || !o->st || !o->scratch) {
    if (o) {
      free(o->params);
      free(o->st);
      free(o->scratch);
      free(o);
    }
    kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
    return NULL;
  }
  o->cfg = *cfg;
  o->n = n;
  return o;
}

static kiln_status check_params(kiln_tensor *const *ps, int n, const char *who) {
  for (int i = 0; i < n; i++) {
    if (!ps[i]) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: parameter %d is NULL", who, i);
    if (!kiln_dtype_is_float(kiln_dtype_of(ps[i])))
      return kiln_set_error(KILN_ERR_DTYPE, "%s: parameter %d has dtype %s; can only optimize floating tensors",
                            who, i, kiln_dtype_name(kiln_dtype_of(ps[i])));
    if (!kiln_is_leaf(ps[i]))
      return kiln_set_error(KILN_ERR_AUTOGRAD, "%s: parameter %d is not a leaf tensor", who, i);
    for (int j = 0; j < i; j++)
      if (ps[j] == ps[i])
        return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                              "%s: parameter %d is the same tensor as parameter %d", who, i, j);
  }
  return KILN_OK;
}

kiln_optimizer *kiln_optimizer_new(const kiln_optim_config *cfg, kiln_tensor *const *params, int n) {
  static const char who[] = "kiln_optimizer_new";
  if (check_config(cfg, who) != KILN_OK) return NULL;
  if (n < 0 || (n > 0 && !params)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: %d parameters at %p", who, n, (const void *)params);
    return NULL;
  }
  if (check_params(params, n, who) != KILN_OK) return NULL;
  kiln_optimizer *o = alloc_opt(cfg, n, who);
  if (!o) return NULL;
  for (int i = 0; i < n; i++) o->params[i] = kiln_tensor_ref(params[i]);
  return o;
}

kiln_optimizer *kiln_optimizer_new_module(const kiln_optim_config *cfg, kiln_module *m) {
  static const char who[] = "kiln_optimizer_new_module";
  if (check_config(cfg, who) != KILN_OK) return NULL;
  if (!m) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL module", who);
    return NULL;
  }
  int n = kiln_module_parameters(m, NULL, 0);
  if (n < 0) return NULL;
  kiln_optimizer *o = alloc_opt(cfg, n, who);
  if (!o) return NULL;
  kiln_module_parameters(m, o->scratch, n);
  if (check_params(o->scratch, n, who) != KILN_OK) {
    kiln_optimizer_free(o);
    return NULL;
  }
  for (int i = 0; i < n; i++) o->params[i] = kiln_tensor_ref(o->scratch[i]);
  o->module = m;
  return o;
}

void kiln_optimizer_free(kiln_optimizer *o) {
  if (!o) return;
  for (int i = 0; i < o->n; i++) {
    kiln_tensor_free(o->params[i]);
    for (int k = 0; k < KILN__OPTIM_MAX_STATE; k++) kiln_tensor_free(o->st[i].buf[k]);
    kiln_tensor_free(o->st[i].step_t);
  }
  free(o->params);
  free(o->st);
  free(o->scratch);
  free(o->wd);
  kiln_tensor_free(o->skipped);
  free(o);
}

/* A copy of t on dev with dtype dt, owned by the caller (no scope). */
static kiln_tensor *owned_copy(kiln_tensor *t, kiln_device dev, kiln_dtype dt) {
  kiln_scope_begin();
  kiln_tensor *r = kiln_clone(kiln_to_dtype(kiln_to_device(t, dev), dt));
  kiln_keep(r);
  kiln_scope_end();
  return r;
}

/* For a module optimizer: picks up parameters that kiln_module_to() replaced, moving
** their state to the new device and dtype. All or nothing. */
static kiln_status sync_module(kiln_optimizer *o, const char *who) {
  if (!o->module) return KILN_OK;
  int n = kiln_module_parameters(o->module, NULL, 0);
  if (n < 0) return kiln_last_error();
  if (n != o->n)
    return kiln_set_error(KILN_ERR_STATE,
                          "%s: the module now has %d parameters; the optimizer was made for %d", who, n, o->n);
  kiln_module_parameters(o->module, o->scratch, n);
  bool changed = false;
  for (int i = 0; i < n; i++) changed |= o->scratch[i] != o->params[i];
  if (!changed) return KILN_OK;
  kiln_tensor *moved[KILN__OPTIM_MAX_STATE];
  /* Convert every state first; swap only when all succeeded. */
  kiln_tensor **fresh = calloc((size_t)n * KILN__OPTIM_MAX_STATE, sizeof *fresh);
  if (!fresh) return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  bool prev = kiln_set_grad_enabled(false);
  kiln_status st = KILN_OK;
  for (int i = 0; i < n && st == KILN_OK; i++) {
    if (o->scratch[i] == o->params[i]) continue;
    kiln_tensor *p = o->scratch[i];
    for (int k = 0; k < KILN__OPTIM_MAX_STATE && st == KILN_OK; k++) {
      kiln_tensor *b = o->st[i].buf[k];
      if (!b) continue;
      moved[k] = owned_copy(b, kiln_device_of(p), kiln_dtype_of(p));
      if (!moved[k]) st = kiln_last_error();
      fresh[(size_t)i * KILN__OPTIM_MAX_STATE + k] = moved[k];
    }
  }
  kiln_set_grad_enabled(prev);
  for (int i = 0; i < n; i++) {
    if (o->scratch[i] == o->params[i]) continue;
    for (int k = 0; k < KILN__OPTIM_MAX_STATE; k++) {
      kiln_tensor **f = &fresh[(size_t)i * KILN__OPTIM_MAX_STATE + k];
      if (st != KILN_OK) {
        kiln_tensor_free(*f);
        continue;
      }
      if (o->st[i].buf[k]) {
        kiln_tensor_free(o->st[i].buf[k]);
        o->st[i].buf[k] = *f;
      }
    }
    if (st == KILN_OK) {
      if (o->st[i].step_t) { /* the device holds the true count (skipped or replayed steps) */
        double v = kiln_item(o->st[i].step_t);
        if (v == v) o->st[i].step = (int64_t)v;
      }
      kiln_tensor_free(o->st[i].step_t); /* made again on the new device from .step */
      o->st[i].step_t = NULL;
      kiln_tensor_free(o->params[i]);
      o->params[i] = kiln_tensor_ref(o->scratch[i]);
    }
  }
  free(fresh);
  return st;
}

kiln_status kiln_optimizer_zero_grad(kiln_optimizer *o) {
  if (!o) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_optimizer_zero_grad: NULL optimizer");
  kiln_status st = sync_module(o, "kiln_optimizer_zero_grad");
  if (st != KILN_OK) return st;
  for (int i = 0; i < o->n; i++)
    if (kiln_grad(o->params[i]) && (st = kiln_set_grad(o->params[i], NULL)) != KILN_OK) return st;
  return KILN_OK;
}

/* One rule call per distinct weight decay (in order of first appearance), over gathered
** copies of the parameters and their state, written back after (the rule creates state
** lazily and advances step counts). */
static kiln_status step_groups(kiln_optimizer *o, kiln_tensor *found_inf) {
  int n = o->n;
  kiln_tensor **ps = malloc((size_t)(n ? n : 1) * sizeof *ps);
  kiln__param_state *ss = malloc((size_t)(n ? n : 1) * sizeof *ss);
  int *idx = malloc((size_t)(n ? n : 1) * sizeof *idx);
  bool *done = calloc((size_t)(n ? n : 1), sizeof *done);
  kiln_status st = KILN_OK;
  if (!ps || !ss || !idx || !done) st = kiln_set_error(KILN_ERR_OOM, "kiln_optimizer_step: out of host memory");
  for (int i = 0; i < n && st == KILN_OK; i++) {
    if (done[i]) continue;
    int m = 0;
    for (int j = i; j < n; j++)
      if (!done[j] && o->wd[j] == o->wd[i]) {
        done[j] = true;
        ps[m] = o->params[j];
        ss[m] = o->st[j];
        idx[m++] = j;
      }
    kiln_optim_config cfg = o->cfg;
    cfg.weight_decay = o->wd[i];
    st = kiln__optim_rule(&cfg, m, ps)(&cfg, m, ps, ss, found_inf);
    for (int k = 0; k < m; k++) o->st[idx[k]] = ss[k];
  }
  free(ps), free(ss), free(idx), free(done);
  return st;
}

kiln_status kiln_optimizer_set_weight_decays(kiln_optimizer *o, const double *wd, int n) {
  static const char who[] = "kiln_optimizer_set_weight_decays";
  if (!o) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL optimizer", who);
  if (!wd) {
    if (n != 0) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL decays with n %d", who, n);
    free(o->wd);
    o->wd = NULL;
    return KILN_OK;
  }
  if (n != o->n)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: %d decays for an optimizer of %d parameters", who, n,
                          o->n);
  for (int i = 0; i < n; i++)
    if (!(wd[i] >= 0) || isinf(wd[i]))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: invalid weight_decay value for parameter %d: %g", who,
                            i, wd[i]);
  double *copy = malloc((size_t)(n ? n : 1) * sizeof *copy);
  if (!copy) return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  memcpy(copy, wd, (size_t)n * sizeof *copy);
  free(o->wd);
  o->wd = copy;
  return KILN_OK;
}

double kiln_optimizer_param_weight_decay(const kiln_optimizer *o, int i) {
  if (!o || i < 0 || i >= o->n) return NAN;
  return o->wd ? o->wd[i] : o->cfg.weight_decay;
}

kiln_optimizer *kiln_optimizer_new_module_decay_split(const kiln_optim_config *cfg, kiln_module *m) {
  kiln_optimizer *o = kiln_optimizer_new_module(cfg, m);
  if (!o) return NULL;
  double *wd = malloc((size_t)(o->n ? o->n : 1) * sizeof *wd);
  if (!wd) {
    kiln_optimizer_free(o);
    kiln_set_error(KILN_ERR_OOM, "kiln_optimizer_new_module_decay_split: out of host memory");
    return NULL;
  }
  for (int i = 0; i < o->n; i++) wd[i] = kiln_ndim(o->params[i]) >= 2 ? cfg->weight_decay : 0.0;
  kiln_status st = kiln_optimizer_set_weight_decays(o, wd, o->n);
  free(wd);
  if (st != KILN_OK) {
    kiln_optimizer_free(o);
    return NULL;
  }
  return o;
}

kiln_status kiln_optimizer_step(kiln_optimizer *o) {
  return kiln__optimizer_step_found_inf(o, NULL);
}

kiln_status kiln__optimizer_step_found_inf(kiln_optimizer *o, kiln_tensor *found_inf) {
  static const char who[] = "kiln_optimizer_step";
  if (!o) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL optimizer", who);
  if (found_inf && (kiln_dtype_of(found_inf) != KILN_F32 || kiln_numel(found_inf) != 1))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: found_inf must be one float32 element", who);
  kiln_status st = sync_module(o, who);
  if (st != KILN_OK) return st;
  /* Gradients must match their parameters; checked up front so a bad one fails the
  ** step before anything moves. */
  bool any = false;
  for (int i = 0; i < o->n; i++) {
    kiln_tensor *p = o->params[i], *g = kiln_grad(p);
    if (!g) continue;
    any = true;
    char b1[96], b2[96], d1[16], d2[16];
    if (kiln_numel(g) != kiln_numel(p) || kiln_ndim(g) != kiln_ndim(p))
      return kiln_set_error(KILN_ERR_SHAPE, "%s: parameter %d has shape %s but its gradient %s", who, i,
                            kiln_shape_str(p, b1, sizeof b1), kiln_shape_str(g, b2, sizeof b2));
    if (!kiln_device_equal(kiln_device_of(g), kiln_device_of(p)))
      return kiln_set_error(KILN_ERR_DEVICE, "%s: parameter %d is on %s but its gradient on %s", who, i,
                            kiln_device_str(kiln_device_of(p), d1, sizeof d1),
                            kiln_device_str(kiln_device_of(g), d2, sizeof d2));
    if (found_inf && !kiln_device_equal(kiln_device_of(found_inf), kiln_device_of(p)))
      return kiln_set_error(KILN_ERR_DEVICE, "%s: parameter %d is on %s but found_inf on %s", who, i,
                            kiln_device_str(kiln_device_of(p), d1, sizeof d1),
                            kiln_device_str(kiln_device_of(found_inf), d2, sizeof d2));
  }
  if (!any) return KILN_OK;
  bool prev = kiln_set_grad_enabled(false); /* updates are not part of any graph */
  if (o->wd) {
    st = step_groups(o, found_inf);
  } else {
    kiln__optim_rule_fn rule = kiln__optim_rule(&o->cfg, o->n, o->params);
    st = rule(&o->cfg, o->n, o->params, o->st, found_inf);
  }
  if (st == KILN_OK && found_inf) { /* skipped += (found_inf != 0), on the device */
    kiln_device fd = kiln_device_of(found_inf);
    if (o->skipped && !kiln_device_equal(kiln_device_of(o->skipped), fd)) {
      kiln_tensor *moved = kiln_keep(kiln_to_device(o->skipped, fd));
      kiln_tensor_free(o->skipped);
      o->skipped = moved;
      if (!moved) st = kiln_last_error();
    }
    if (st == KILN_OK && !o->skipped && !(o->skipped = kiln_keep(kiln_zeros(KILN_SHAPE0, KILN_F64, fd))))
      st = kiln_last_error();
    if (st == KILN_OK) {
      kiln_scope_begin();
      kiln_tensor *bad = kiln_to_dtype(kiln_ne(kiln_view(found_inf, 0, NULL), kiln_scalar(0.0, KILN_F32, fd)),
                                       KILN_F64);
      st = bad ? kiln_axpy_(o->skipped, 1.0, bad) : kiln_last_error();
      kiln_scope_end();
    }
  }
  kiln_set_grad_enabled(prev);
  if (st == KILN_OK) o->steps++;
  return st;
}

kiln_status kiln_optimizer_set_lr(kiln_optimizer *o, double lr) {
  if (!o) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_optimizer_set_lr: NULL optimizer");
  if (!(lr >= 0) || isinf(lr))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_optimizer_set_lr: invalid learning rate: %g", lr);
  o->cfg.lr = lr;
  return KILN_OK;
}

double kiln_optimizer_get_lr(const kiln_optimizer *o) { return o ? o->cfg.lr : NAN; }

kiln_optim_config kiln_optimizer_config(const kiln_optimizer *o) {
  if (o) return o->cfg;
  kiln_optim_config c;
  memset(&c, 0, sizeof c);
  return c;
}

int kiln_optimizer_num_params(const kiln_optimizer *o) { return o ? o->n : 0; }

kiln_tensor *kiln_optimizer_param(kiln_optimizer *o, int i) {
  if (!o || i < 0 || i >= o->n) return NULL;
  if (sync_module(o, "kiln_optimizer_param") != KILN_OK) return NULL;
  return o->params[i];
}

int64_t kiln_optimizer_steps(const kiln_optimizer *o) { return o ? applied_steps(o) : 0; }

int64_t kiln_optimizer_state_bytes(const kiln_optimizer *o) {
  if (!o) return 0;
  int64_t s = 0;
  for (int i = 0; i < o->n; i++)
    for (int k = 0; k < KILN__OPTIM_MAX_STATE; k++)
      if (o->st[i].buf[k]) s += (int64_t)kiln_nbytes(o->st[i].buf[k]);
  return s;
}

/* ---- state dict ------------------------------------------------------------------------- */

kiln_dict *kiln_optimizer_state_dict(const kiln_optimizer *co) {
  static const char who[] = "kiln_optimizer_state_dict";
  if (!co) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL optimizer", who);
    return NULL;
  }
  kiln_optimizer *o = (kiln_optimizer *)co; /* sync only swaps equal-valued handles */
  if (sync_module(o, who) != KILN_OK) return NULL;
  kiln_dict *d = kiln_dict_new();
  if (!d) return NULL;
  const kiln_optim_config *c = &o->cfg;
  kiln_status st = kiln_dict_set_meta(d, "kind", kind_names[c->kind]);
  if (st == KILN_OK) st = kiln__meta_set_f64(d, "lr", c->lr);
  if (st == KILN_OK) st = kiln__meta_set_f64(d, "weight_decay", c->weight_decay);
  if (st == KILN_OK) st = kiln__meta_set_i64(d, "maximize", c->maximize);
  if (st == KILN_OK) st = kiln__meta_set_f64(d, "momentum", c->momentum);
  if (st == KILN_OK) st = kiln__meta_set_f64(d, "dampening", c->dampening);
  if (st == KILN_OK) st = kiln__meta_set_i64(d, "nesterov", c->nesterov);
  if (st == KILN_OK) st = kiln__meta_set_f64(d, "beta1", c->beta1);
  if (st == KILN_OK) st = kiln__meta_set_f64(d, "beta2", c->beta2);
  if (st == KILN_OK) st = kiln__meta_set_f64(d, "eps", c->eps);
  if (st == KILN_OK) st = kiln__meta_set_i64(d, "amsgrad", c->amsgrad);
  if (st == KILN_OK) st = kiln__meta_set_i64(d, "num_params", o->n);
  if (st == KILN_OK) st = kiln__meta_set_i64(d, "steps", applied_steps(o));
  char key[64];
  for (int i = 0; i < o->n && st == KILN_OK; i++) {
    if (o->st[i].step_t) { /* capturable: the device holds the true count (graph replays) */
      double v = kiln_item(o->st[i].step_t);
      if (v == v) ((kiln_optimizer *)o)->st[i].step = (int64_t)v;
    }
    if (o->st[i].step) {
      snprintf(key, sizeof key, "state.%d.step", i);
      st = kiln__meta_set_i64(d, key, o->st[i].step);
    }
    for (int k = 0; k < KILN__OPTIM_MAX_STATE && st == KILN_OK; k++) {
      if (!o->st[i].buf[k]) continue;
      snprintf(key, sizeof key, "state.%d.%s", i, kiln__optim_state_name(c->kind, k));
      st = kiln_dict_set(d, key, o->st[i].buf[k]);
    }
  }
  if (st != KILN_OK) {
    kiln_dict_free(d);
    return NULL;
  }
  return d;
}

/* "state.<i>.<name>" -> i and k; false when the key has another form. */
static bool parse_state_key(const char *key, kiln_optim_kind kind, int n, int *pi, int *pk) {
  if (strncmp(key, "state.", 6)) return false;
  char *end = NULL;
  long i = strtol(key + 6, &end, 10);
  if (end == key + 6 || *end != '.' || i < 0 || i >= n) return false;
  for (int k = 0; kiln__optim_state_name(kind, k); k++)
    if (!strcmp(end + 1, kiln__optim_state_name(kind, k))) {
      *pi = (int)i;
      *pk = k;
      return true;
    }
  return false;
}

static kiln_status read_config(const kiln_dict *d, kiln_optim_config *c, const char *who) {
  int64_t b;
  kiln_status st = kiln__meta_f64(d, "lr", &c->lr, who);
  if (st == KILN_OK) st = kiln__meta_f64(d, "weight_decay", &c->weight_decay, who);
  if (st == KILN_OK && (st = kiln__meta_i64(d, "maximize", &b, who)) == KILN_OK) c->maximize = b != 0;
  if (st == KILN_OK) st = kiln__meta_f64(d, "momentum", &c->momentum, who);
  if (st == KILN_OK) st = kiln__meta_f64(d, "dampening", &c->dampening, who);
  if (st == KILN_OK && (st = kiln__meta_i64(d, "nesterov", &b, who)) == KILN_OK) c->nesterov = b != 0;
  if (st == KILN_OK) st = kiln__meta_f64(d, "beta1", &c->beta1, who);
  if (st == KILN_OK) st = kiln__meta_f64(d, "beta2", &c->beta2, who);
  if (st == KILN_OK) st = kiln__meta_f64(d, "eps", &c->eps, who);
  if (st == KILN_OK && (st = kiln__meta_i64(d, "amsgrad", &b, who)) == KILN_OK) c->amsgrad = b != 0;
  return st;
}

kiln_status kiln__optimizer_load_state_dict(kiln_optimizer *o, const kiln_dict *d, bool apply,
                                            const char *who) {
  if (!o || !d) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL optimizer or dict", who);
  kiln_status st = sync_module(o, who);
  if (st != KILN_OK) return st;
  const char *kind = kiln_dict_get_meta(d, "kind");
  if (!kind) return kiln_set_error(KILN_ERR_FORMAT, "%s: no \"kind\" in the optimizer state", who);
  if (strcmp(kind, kind_names[o->cfg.kind]))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: the state is of a %s optimizer, this one is %s",
                          who, kind, kind_names[o->cfg.kind]);
  int64_t n = 0, steps = 0;
  if ((st = kiln__meta_i64(d, "num_params", &n, who)) != KILN_OK) return st;
  if (n != o->n)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "%s: the state is for %lld parameters, this optimizer has %d", who, (long long)n, o->n);
  if ((st = kiln__meta_i64(d, "steps", &steps, who)) != KILN_OK) return st;
  if (steps < 0)
    return kiln_set_error(KILN_ERR_FORMAT, "%s: metadata \"steps\" is %lld; it must be 0 or more", who,
                          (long long)steps);
  kiln_optim_config cfg = o->cfg;
  if ((st = read_config(d, &cfg, who)) != KILN_OK) return st;
  if ((st = check_config(&cfg, who)) != KILN_OK) return st;

  kiln__problems p = {0};
  int64_t *stepv = calloc((size_t)(o->n ? o->n : 1), sizeof *stepv);
  kiln_tensor **src = calloc((size_t)(o->n ? o->n : 1) * KILN__OPTIM_MAX_STATE, sizeof *src);
  if (!stepv || !src) {
    free(stepv);
    free(src);
    return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  }
  char key[64];
  for (int i = 0; i < o->n; i++) {
    snprintf(key, sizeof key, "state.%d.step", i);
    if (kiln_dict_get_meta(d, key) && (st = kiln__meta_i64(d, key, &stepv[i], who)) != KILN_OK) break;
    if (stepv[i] < 0) {
      st = kiln_set_error(KILN_ERR_FORMAT, "%s: metadata \"%s\" is %lld; it must be 0 or more", who, key,
                          (long long)stepv[i]);
      break;
    }
  }
  /* Metadata under "state." other than a step count of one of our parameters (an index
  ** past the model's, a name this optimizer does not keep) is unexpected. */
  for (int j = 0; j < kiln_dict_meta_size(d) && st == KILN_OK; j++) {
    const char *name = kiln_dict_meta_key(d, j);
    if (strncmp(name, "state.", 6)) continue;
    char *end = NULL;
    long i = strtol(name + 6, &end, 10);
    if (end == name + 6 || name[6] == '-' || name[6] == '+' || i < 0 || i >= o->n || strcmp(end, ".step"))
      kiln__problems_unexpected(&p, name);
  }
  for (int j = 0; j < kiln_dict_size(d) && st == KILN_OK; j++) {
    int i, k;
    const char *name = kiln_dict_key(d, j);
    if (!parse_state_key(name, cfg.kind, o->n, &i, &k)) {
      kiln__problems_unexpected(&p, name);
      continue;
    }
    kiln_tensor *t = kiln_dict_value(d, j), *par = o->params[i];
    char b1[96], b2[96];
    if (kiln_numel(t) != kiln_numel(par) || kiln_ndim(t) != kiln_ndim(par) ||
        memcmp(kiln_shape(t), kiln_shape(par), sizeof(int64_t) * (size_t)kiln_ndim(t)))
      kiln__problems_mismatch(&p, KILN_ERR_SHAPE, "%s: shape %s, parameter %d has %s", name,
                              kiln_shape_str(t, b1, sizeof b1), i, kiln_shape_str(par, b2, sizeof b2));
    else if (kiln_dtype_of(t) != kiln_dtype_of(par))
      kiln__problems_mismatch(&p, KILN_ERR_DTYPE, "%s: dtype %s, parameter %d has %s", name,
                              kiln_dtype_name(kiln_dtype_of(t)), i, kiln_dtype_name(kiln_dtype_of(par)));
    else if (!stepv[i]) /* state is made by a parameter's first step: none without a step count */
      kiln__problems_unexpected(&p, name);
    else
      src[(size_t)i * KILN__OPTIM_MAX_STATE + k] = t;
  }
  /* Adam state must be whole for every parameter that has taken a step. */
  if (st == KILN_OK && cfg.kind != KILN_OPTIM_SGD)
    for (int i = 0; i < o->n; i++) {
      if (!stepv[i]) continue;
      for (int k = 0; k < (cfg.amsgrad ? 3 : 2); k++) {
        snprintf(key, sizeof key, "state.%d.%s", i, kiln__optim_state_name(cfg.kind, k));
        if (!kiln_dict_get(d, key)) kiln__problems_missing(&p, key);
      }
    }
  if (st == KILN_OK) st = kiln__problems_report(&p, who);
  kiln__problems_free(&p);

  if (st == KILN_OK && apply) {
    /* Copies first (they can fail on OOM), then the swap. */
    kiln_tensor **fresh = calloc((size_t)(o->n ? o->n : 1) * KILN__OPTIM_MAX_STATE, sizeof *fresh);
    if (!fresh) st = kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
    bool prev = kiln_set_grad_enabled(false);
    for (size_t j = 0; fresh && j < (size_t)o->n * KILN__OPTIM_MAX_STATE && st == KILN_OK; j++) {
      if (!src[j]) continue;
      kiln_tensor *par = o->params[j / KILN__OPTIM_MAX_STATE];
      fresh[j] = owned_copy(src[j], kiln_device_of(par), kiln_dtype_of(par));
      if (!fresh[j]) st = kiln_last_error();
    }
    kiln_set_grad_enabled(prev);
    if (fresh) {
      for (size_t j = 0; j < (size_t)o->n * KILN__OPTIM_MAX_STATE; j++) {
        if (st != KILN_OK) {
          kiln_tensor_free(fresh[j]);
          continue;
        }
        kiln__param_state *s = &o->st[j / KILN__OPTIM_MAX_STATE];
        kiln_tensor_free(s->buf[j % KILN__OPTIM_MAX_STATE]);
        s->buf[j % KILN__OPTIM_MAX_STATE] = fresh[j];
      }
      if (st == KILN_OK) {
        for (int i = 0; i < o->n; i++) {
          o->st[i].step = stepv[i];
          kiln_tensor_free(o->st[i].step_t); /* made again from .step */
          o->st[i].step_t = NULL;
        }
        o->cfg = cfg;
        o->steps = steps;
        kiln_tensor_free(o->skipped); /* steps is the applied count */
        o->skipped = NULL;
      }
      free(fresh);
    }
  }
  free(stepv);
  free(src);
  return st;
}

kiln_status kiln_optimizer_load_state_dict(kiln_optimizer *o, const kiln_dict *d) {
  return kiln__optimizer_load_state_dict(o, d, true, "kiln_optimizer_load_state_dict");
}
