/* Learning-rate schedulers in closed form (torch.optim.lr_scheduler's
** _get_closed_form_lr where it has one). The closed form makes a resumed run set the same
** lr as an uninterrupted one: lr depends on (base_lr, t) only, never on the history.
** PyTorch's step() uses the recursive get_lr instead (lr_t from lr_{t-1}); StepLR and
** MultiStepLR below multiply as it does, so their doubles are PyTorch's; the cosine's
** recursion differs from this closed form by up to 3e-15 (relative) over 300 steps of
** CosineAnnealingLR(T_max=300), which no f32 lr sees (tests/test_optim_parity.c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "optim/optim_int.h"

typedef enum sched_kind { S_STEP, S_MULTISTEP, S_EXP, S_LINEAR, S_COSINE, S__COUNT } sched_kind;

static const char *const sched_names[S__COUNT] = {"StepLR", "MultiStepLR", "ExponentialLR",
                                                  "LinearLR", "CosineLR"};

struct kiln_scheduler {
  sched_kind kind;
  kiln_optimizer *opt;
  double base_lr;
  int64_t t;
  /* parameters */
  int64_t step_size, t_max, warmup, total_iters;
  double gamma, eta_min, start_factor, end_factor;
  int nmilestones;
  int64_t *milestones;
};

static const double PI = 3.14159265358979323846;

/* base * gamma^k as PyTorch's StepLR and MultiStepLR reach it: one multiply by gamma per
** decay (their get_lr is lr * gamma on the group's current lr), which can differ from
** base * pow(gamma, k) in the last bit of the double. Past 4096 decays, pow (the loop
** would cost more than the difference is worth). ExponentialLR keeps pow: its recursion
** has a multiply every step, and (measured over 300 steps) the two agree in f32. */
static double decayed(double base, double gamma, int64_t k) {
  if (k > 4096) return base * pow(gamma, (double)k);
  for (int64_t i = 0; i < k; i++) base *= gamma;
  return base;
}

double kiln_scheduler_lr_at(const kiln_scheduler *s, int64_t t) {
  if (!s) return NAN;
  if (t < 0) t = 0;
  double b = s->base_lr;
  switch (s->kind) {
  case S_STEP: return decayed(b, s->gamma, t / s->step_size);
  case S_MULTISTEP: {
    int k = 0;
    while (k < s->nmilestones && s->milestones[k] <= t) k++;
    return decayed(b, s->gamma, k);
  }
  case S_EXP: return b * pow(s->gamma, (double)t);
  case S_LINEAR: {
    int64_t u = t < s->total_iters ? t : s->total_iters;
    return b * (s->start_factor + (s->end_factor - s->start_factor) * (double)u / (double)s->total_iters);
  }
  case S_COSINE: {
    if (t < s->warmup)
      return b * (s->start_factor + (1.0 - s->start_factor) * (double)t / (double)s->warmup);
    int64_t T = s->t_max - s->warmup;
    int64_t u = t - s->warmup < T ? t - s->warmup : T;
    return s->eta_min + (b - s->eta_min) * (1.0 + cos(PI * (double)u / (double)T)) / 2.0;
  }
  default: return NAN;
  }
}

static kiln_scheduler *make(kiln_optimizer *opt, sched_kind kind, const char *who) {
  if (!opt) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL optimizer", who);
    return NULL;
  }
  kiln_scheduler *s = calloc(1, sizeof *s);
  if (!s) {
    kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
    return NULL;
  }
  s->kind = kind;
  s->opt = opt;
  s->base_lr = kiln_optimizer_get_lr(opt);
  return s;
}

/* PyTorch's constructor takes the first step: lr becomes the value for t = 0. */
static kiln_scheduler *start(kiln_scheduler *s) {
  if (kiln_optimizer_set_lr(s->opt, kiln_scheduler_lr_at(s, 0)) != KILN_OK) {
    kiln_scheduler_free(s);
    return NULL;
  }
  return s;
}

kiln_scheduler *kiln_step_lr_new(kiln_optimizer *opt, int64_t step_size, double gamma) {
  if (step_size < 1 || !(gamma >= 0)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_step_lr_new: step_size %lld, gamma %g",
                   (long long)step_size, gamma);
    return NULL;
  }
  kiln_scheduler *s = make(opt, S_STEP, "kiln_step_lr_new");
  if (!s) return NULL;
  s->step_size = step_size;
  s->gamma = gamma;
  return start(s);
}

kiln_scheduler *kiln_multistep_lr_new(kiln_optimizer *opt, int n, const int64_t *milestones,
                                      double gamma) {
  static const char who[] = "kiln_multistep_lr_new";
  if (n < 0 || (n > 0 && !milestones) || !(gamma >= 0)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: %d milestones, gamma %g", who, n, gamma);
    return NULL;
  }
  for (int i = 0; i < n; i++)
    if (milestones[i] < 1 || (i > 0 && milestones[i] <= milestones[i - 1])) {
      kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                     "%s: milestones must be positive and strictly increasing (milestone %d is %lld)",
                     who, i, (long long)milestones[i]);
      return NULL;
    }
  kiln_scheduler *s = make(opt, S_MULTISTEP, who);
  if (!s) return NULL;
  s->milestones = malloc((size_t)(n ? n : 1) * sizeof *s->milestones);
  if (!s->milestones) {
    kiln_scheduler_free(s);
    kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
    return NULL;
  }
  if (n) memcpy(s->milestones, milestones, (size_t)n * sizeof *milestones);
  s->nmilestones = n;
  s->gamma = gamma;
  return start(s);
}

kiln_scheduler *kiln_exponential_lr_new(kiln_optimizer *opt, double gamma) {
  if (!(gamma >= 0)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_exponential_lr_new: gamma %g", gamma);
    return NULL;
  }
  kiln_scheduler *s = make(opt, S_EXP, "kiln_exponential_lr_new");
  if (!s) return NULL;
  s->gamma = gamma;
  return start(s);
}

kiln_scheduler *kiln_linear_lr_new(kiln_optimizer *opt, double start_factor, double end_factor,
                                   int64_t total_iters) {
  /* PyTorch's checks: start in (0, 1], end in [0, 1]. */
  if (!(start_factor > 0 && start_factor <= 1) || !(end_factor >= 0 && end_factor <= 1) ||
      total_iters < 1) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                   "kiln_linear_lr_new: start_factor %g (want (0, 1]), end_factor %g (want [0, 1]), "
                   "total_iters %lld (want >= 1)", start_factor, end_factor, (long long)total_iters);
    return NULL;
  }
  kiln_scheduler *s = make(opt, S_LINEAR, "kiln_linear_lr_new");
  if (!s) return NULL;
  s->start_factor = start_factor;
  s->end_factor = end_factor;
  s->total_iters = total_iters;
  return start(s);
}

kiln_scheduler *kiln_linear_warmup_new(kiln_optimizer *opt, int64_t warmup_steps, double start_factor) {
  return kiln_linear_lr_new(opt, start_factor, 1.0, warmup_steps);
}

kiln_scheduler *kiln_cosine_lr_new(kiln_optimizer *opt, int64_t t_max, double eta_min,
                                   int64_t warmup_steps, double warmup_start_factor) {
  if (t_max < 1 || warmup_steps < 0 || warmup_steps >= t_max || !(eta_min >= 0) ||
      !(warmup_start_factor >= 0 && warmup_start_factor <= 1)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                   "kiln_cosine_lr_new: t_max %lld, eta_min %g, warmup_steps %lld (want 0 <= warmup < "
                   "t_max), warmup_start_factor %g (want [0, 1])", (long long)t_max, eta_min,
                   (long long)warmup_steps, warmup_start_factor);
    return NULL;
  }
  kiln_scheduler *s = make(opt, S_COSINE, "kiln_cosine_lr_new");
  if (!s) return NULL;
  s->t_max = t_max;
  s->eta_min = eta_min;
  s->warmup = warmup_steps;
  s->start_factor = warmup_start_factor;
  return start(s);
}

void kiln_scheduler_free(kiln_scheduler *s) {
  if (!s) return;
  free(s->milestones);
  free(s);
}

kiln_status kiln_scheduler_step(kiln_scheduler *s) {
  if (!s) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_scheduler_step: NULL scheduler");
  kiln_status st = kiln_optimizer_set_lr(s->opt, kiln_scheduler_lr_at(s, s->t + 1));
  if (st == KILN_OK) s->t++;
  return st;
}

double kiln_scheduler_get_lr(const kiln_scheduler *s) { return s ? kiln_scheduler_lr_at(s, s->t) : NAN; }

int64_t kiln_scheduler_last_epoch(const kiln_scheduler *s) { return s ? s->t : 0; }

const char *kiln_scheduler_name(const kiln_scheduler *s) { return s ? sched_names[s->kind] : "(null)"; }

kiln_dict *kiln_scheduler_state_dict(const kiln_scheduler *s) {
  if (!s) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_scheduler_state_dict: NULL scheduler");
    return NULL;
  }
  kiln_dict *d = kiln_dict_new();
  if (!d) return NULL;
  kiln_status st = kiln_dict_set_meta(d, "kind", sched_names[s->kind]);
  if (st == KILN_OK) st = kiln__meta_set_i64(d, "last_epoch", s->t);
  if (st == KILN_OK) st = kiln__meta_set_f64(d, "base_lr", s->base_lr);
  if (st == KILN_OK) st = kiln__meta_set_i64(d, "step_size", s->step_size);
  if (st == KILN_OK) st = kiln__meta_set_i64(d, "t_max", s->t_max);
  if (st == KILN_OK) st = kiln__meta_set_i64(d, "warmup", s->warmup);
  if (st == KILN_OK) st = kiln__meta_set_i64(d, "total_iters", s->total_iters);
  if (st == KILN_OK) st = kiln__meta_set_f64(d, "gamma", s->gamma);
  if (st == KILN_OK) st = kiln__meta_set_f64(d, "eta_min", s->eta_min);
  if (st == KILN_OK) st = kiln__meta_set_f64(d, "start_factor", s->start_factor);
  if (st == KILN_OK) st = kiln__meta_set_f64(d, "end_factor", s->end_factor);
  if (st == KILN_OK) {
    /* Milestones as "3,7,12". */
    kiln__sb sb = {0};
    for (int i = 0; i < s->nmilestones; i++)
      kiln__sb_printf(&sb, "%s%lld", i ? "," : "", (long long)s->milestones[i]);
    st = kiln_dict_set_meta(d, "milestones", kiln__sb_str(&sb));
    kiln__sb_free(&sb);
  }
  if (st != KILN_OK) {
    kiln_dict_free(d);
    return NULL;
  }
  return d;
}

kiln_status kiln__scheduler_load_state_dict(kiln_scheduler *s, const kiln_dict *d, bool apply,
                                            const char *who) {
  if (!s || !d) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL scheduler or dict", who);
  const char *kind = kiln_dict_get_meta(d, "kind");
  if (!kind) return kiln_set_error(KILN_ERR_FORMAT, "%s: no \"kind\" in the scheduler state", who);
  if (strcmp(kind, sched_names[s->kind]))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: the state is of a %s, this scheduler is a %s",
                          who, kind, sched_names[s->kind]);
  kiln_scheduler n = *s;
  kiln_status st = kiln__meta_i64(d, "last_epoch", &n.t, who);
  if (st == KILN_OK) st = kiln__meta_f64(d, "base_lr", &n.base_lr, who);
  if (st == KILN_OK) st = kiln__meta_i64(d, "step_size", &n.step_size, who);
  if (st == KILN_OK) st = kiln__meta_i64(d, "t_max", &n.t_max, who);
  if (st == KILN_OK) st = kiln__meta_i64(d, "warmup", &n.warmup, who);
  if (st == KILN_OK) st = kiln__meta_i64(d, "total_iters", &n.total_iters, who);
  if (st == KILN_OK) st = kiln__meta_f64(d, "gamma", &n.gamma, who);
  if (st == KILN_OK) st = kiln__meta_f64(d, "eta_min", &n.eta_min, who);
  if (st == KILN_OK) st = kiln__meta_f64(d, "start_factor", &n.start_factor, who);
  if (st == KILN_OK) st = kiln__meta_f64(d, "end_factor", &n.end_factor, who);
  if (st != KILN_OK) return st;
  /* Rates and factors must be numbers: a NaN gamma would load and then poison the lr. */
  const double reals[] = {n.base_lr, n.gamma, n.eta_min, n.start_factor, n.end_factor};
  static const char *const real_names[] = {"base_lr", "gamma", "eta_min", "start_factor", "end_factor"};
  for (int i = 0; i < 5; i++)
    if (!isfinite(reals[i]))
      return kiln_set_error(KILN_ERR_FORMAT, "%s: metadata \"%s\" is %g; it must be a finite number", who,
                            real_names[i], reals[i]);
  /* The same validity the constructors enforce: the lr formula divides by these. */
  if (n.t < 0 || (n.kind == S_STEP && n.step_size < 1) || (n.kind == S_LINEAR && n.total_iters < 1) ||
      (n.kind == S_COSINE && (n.t_max < 1 || n.warmup < 0 || n.warmup >= n.t_max)))
    return kiln_set_error(KILN_ERR_FORMAT, "%s: invalid %s state (last_epoch %lld)", who, kind,
                          (long long)n.t);
  const char *ms = kiln_dict_get_meta(d, "milestones");
  if (!ms) return kiln_set_error(KILN_ERR_FORMAT, "%s: metadata \"milestones\" is missing", who);
  int count = 0;
  for (const char *p = ms; *p; p++) count += *p == ',';
  count += ms[0] != '\0';
  int64_t *mv = malloc((size_t)(count ? count : 1) * sizeof *mv);
  if (!mv) return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  const char *p = ms;
  for (int i = 0; i < count; i++) {
    char *end = NULL;
    long long v = strtoll(p, &end, 10);
    if (end == p || (*end != ',' && *end != '\0') || (i > 0 && v <= mv[i - 1])) {
      free(mv);
      return kiln_set_error(KILN_ERR_FORMAT, "%s: bad milestones \"%s\"", who, ms);
    }
    mv[i] = v;
    p = *end ? end + 1 : end;
  }
  if (!apply) {
    free(mv);
    return KILN_OK;
  }
  free(s->milestones);
  n.milestones = mv;
  n.nmilestones = count;
  n.opt = s->opt;
  *s = n;
  return kiln_optimizer_set_lr(s->opt, kiln_scheduler_lr_at(s, s->t));
}

kiln_status kiln_scheduler_load_state_dict(kiln_scheduler *s, const kiln_dict *d) {
  return kiln__scheduler_load_state_dict(s, d, true, "kiln_scheduler_load_state_dict");
}
