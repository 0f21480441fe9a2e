/*
** Dynamic loss scaling (torch.amp.GradScaler): the loss is multiplied by the scale before
** backward, so that small f16 gradients do not flush to zero; unscale_ divides every
** gradient of an optimizer by it in one pass (kiln_amp_unscale_dev_: one list kernel) and
** records on the device whether any is inf or NaN; step skips the optimizer's step when
** one is; update halves the scale after a skipped step and doubles it after
** growth_interval clean steps in a row. PyTorch's defaults: 2^16, x2 every 2000, x0.5.
**
** Nothing in scale, unscale_, step or update reads the device on the host (PyTorch's
** fused-optimizer path): the scale (f32), its inverse and the growth tracker (f64, exact
** to 2^53 steps) are one-element tensors on the gradients' device; the optimizer's kernels
** read the found-inf flag there and leave parameters, state and step counts untouched
** when it is set (kiln__optimizer_step_found_inf); update is kiln_amp_update_scale_ on the
** device. So an iteration queues its work without waiting and a CUDA graph can capture it
** (each replay reads and updates the live scale). The queries get_scale and found_inf, and
** the state dict, read the tensors (a wait). Until the first scale or unscale_ the state
** is the host's (init_scale, or what load_state_dict set); the tensors are made then on
** that device and move (a copy) if a later call uses another device.
*/
#include "optim_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kiln_grad_scaler {
  kiln_grad_scaler_config cfg;
  double host_scale;          /* the state before the device tensors exist */
  int64_t host_tracker;
  kiln_tensor *scale;         /* f32, 0-dim, on the device; NULL until first used */
  kiln_tensor *inv_scale;     /* f32, 0-dim: f32(1 / f64(scale)), remade by each unscale_ */
  kiln_tensor *growth_tracker; /* f64, 0-dim: clean steps in a row since the last change */
  kiln_tensor *found_inf;     /* f32, 0-dim: any optimizer's gradient was not finite (update) */
  /* Per optimizer (PyTorch's per-optimizer found_inf): its own flag, which its step reads,
  ** so an inf in one optimizer's gradients skips that optimizer only. */
  struct opt_rec {
    const kiln_optimizer *opt;
    kiln_tensor *flag; /* f32, 0-dim, on the scaler's device */
    bool unscaled;     /* unscale_ ran for it in this iteration */
  } *recs;
  int n_recs;
  bool cleared; /* found_inf was zeroed in this iteration */
  bool stepped; /* a step ran (or was skipped) in this iteration */
  bool any_unscaled;
};

kiln_grad_scaler_config kiln_grad_scaler_default_config(void) {
  kiln_grad_scaler_config c = {65536.0, 2.0, 0.5, 2000, true};
  return c;
}

kiln_grad_scaler *kiln_grad_scaler_new(const kiln_grad_scaler_config *cfg) {
  kiln_grad_scaler_config c = cfg ? *cfg : kiln_grad_scaler_default_config();
  if (!(c.init_scale > 0) || !isfinite(c.init_scale) || c.growth_interval <= 0 || !(c.growth_factor > 1) ||
      !(c.backoff_factor > 0 && c.backoff_factor < 1)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                   "kiln_grad_scaler_new: needs init_scale > 0 (got %g), growth_interval > 0 (got %lld), "
                   "growth_factor > 1 (got %g) and 0 < backoff_factor < 1 (got %g)",
                   c.init_scale, (long long)c.growth_interval, c.growth_factor, c.backoff_factor);
    return NULL;
  }
  kiln_grad_scaler *s = calloc(1, sizeof *s);
  if (!s) {
    kiln_set_error(KILN_ERR_OOM, "kiln_grad_scaler_new: out of host memory");
    return NULL;
  }
  s->cfg = c;
  s->host_scale = c.init_scale;
  return s;
}

static void free_tensors(kiln_grad_scaler *s) {
  kiln_tensor_free(s->scale);
  kiln_tensor_free(s->inv_scale);
  kiln_tensor_free(s->growth_tracker);
  kiln_tensor_free(s->found_inf);
  s->scale = s->inv_scale = s->growth_tracker = s->found_inf = NULL;
  for (int i = 0; i < s->n_recs; i++) {
    kiln_tensor_free(s->recs[i].flag);
    s->recs[i].flag = NULL;
  }
}

void kiln_grad_scaler_free(kiln_grad_scaler *s) {
  if (!s) return;
  free_tensors(s);
  free(s->recs);
  free(s);
}

/* opt's record (made on first use), NULL with KILN_ERR_OOM. */
static struct opt_rec *rec_of(kiln_grad_scaler *s, const kiln_optimizer *opt) {
  for (int i = 0; i < s->n_recs; i++)
    if (s->recs[i].opt == opt) return &s->recs[i];
  struct opt_rec *r = realloc(s->recs, (size_t)(s->n_recs + 1) * sizeof *r);
  if (!r) {
    kiln_set_error(KILN_ERR_OOM, "kiln_grad_scaler: out of host memory");
    return NULL;
  }
  s->recs = r;
  r = &s->recs[s->n_recs++];
  memset(r, 0, sizeof *r);
  r->opt = opt;
  return r;
}

/* The state tensors on dev: made from the host state the first time, moved (a copy)
** when dev changed. */
static kiln_status on_device(kiln_grad_scaler *s, kiln_device dev) {
  if (s->scale && kiln_device_equal(kiln_device_of(s->scale), dev)) return KILN_OK;
  kiln_tensor **ts[4] = {&s->scale, &s->inv_scale, &s->growth_tracker, &s->found_inf};
  if (s->scale) {
    for (int k = 0; k < 4; k++) {
      kiln_tensor *moved = kiln_keep(kiln_to_device(*ts[k], dev));
      if (!moved) return kiln_last_error();
      kiln_tensor_free(*ts[k]);
      *ts[k] = moved;
    }
    for (int i = 0; i < s->n_recs; i++) { /* made again on dev by the next unscale_ */
      kiln_tensor_free(s->recs[i].flag);
      s->recs[i].flag = NULL;
    }
    return KILN_OK;
  }
  s->scale = kiln_keep(kiln_scalar(s->host_scale, KILN_F32, dev));
  s->inv_scale = kiln_keep(kiln_scalar(1.0 / s->host_scale, KILN_F32, dev));
  s->growth_tracker = kiln_keep(kiln_scalar((double)s->host_tracker, KILN_F64, dev));
  s->found_inf = kiln_keep(kiln_zeros(KILN_SHAPE0, KILN_F32, dev));
  if (!s->scale || !s->inv_scale || !s->growth_tracker || !s->found_inf) {
    kiln_status st = kiln_last_error();
    free_tensors(s);
    return st;
  }
  return KILN_OK;
}

double kiln_grad_scaler_get_scale(const kiln_grad_scaler *s) {
  if (!s) return NAN;
  if (!s->cfg.enabled) return 1.0;
  return s->scale ? kiln_item(s->scale) : s->host_scale;
}

bool kiln_grad_scaler_found_inf(const kiln_grad_scaler *s) {
  return s && s->cfg.enabled && s->found_inf && kiln_item(s->found_inf) != 0.0;
}

kiln_tensor *kiln_grad_scaler_scale(kiln_grad_scaler *s, kiln_tensor *loss) {
  if (!loss) return NULL;
  if (!s) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_grad_scaler_scale: NULL scaler");
    return NULL;
  }
  if (!s->cfg.enabled) return kiln_mul_scalar(loss, 1.0);
  if (!kiln_dtype_is_float(kiln_dtype_of(loss))) {
    kiln_set_error(KILN_ERR_DTYPE, "kiln_grad_scaler_scale: the loss is %s, not floating",
                   kiln_dtype_name(kiln_dtype_of(loss)));
    return NULL;
  }
  if (on_device(s, kiln_device_of(loss)) != KILN_OK) return NULL;
  /* A 16-bit loss is scaled in f32: 2^16 is past f16's range (65504). */
  kiln_dtype dt = kiln_dtype_of(loss);
  if (dt == KILN_F16 || dt == KILN_BF16) return kiln_mul(kiln_to_dtype(loss, KILN_F32), s->scale);
  if (dt == KILN_F32) return kiln_mul(loss, s->scale);
  return kiln_mul(loss, kiln_to_dtype(s->scale, dt));
}

kiln_status kiln_grad_scaler_unscale_(kiln_grad_scaler *s, kiln_optimizer *opt) {
  static const char who[] = "kiln_grad_scaler_unscale_";
  if (!s || !opt) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL scaler or optimizer", who);
  if (!s->cfg.enabled) return KILN_OK;
  struct opt_rec *rec = rec_of(s, opt);
  if (!rec) return kiln_last_error();
  if (rec->unscaled)
    return kiln_set_error(KILN_ERR_STATE, "%s: already called for this optimizer since the last update", who);
  int n = kiln_optimizer_num_params(opt);
  kiln_tensor **grads = malloc((size_t)(n > 0 ? n : 1) * sizeof *grads);
  if (!grads) return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  kiln_device dev = s->scale ? kiln_device_of(s->scale) : kiln_device_cpu();
  bool have_dev = false;
  kiln_status st = KILN_OK;
  for (int i = 0; i < n; i++) {
    grads[i] = kiln_grad(kiln_optimizer_param(opt, i));
    if (!grads[i]) continue;
    if (!have_dev) {
      dev = kiln_device_of(grads[i]);
      have_dev = true;
    } else if (!kiln_device_equal(dev, kiln_device_of(grads[i]))) {
      st = kiln_set_error(KILN_ERR_DEVICE, "%s: the gradients are on more than one device", who);
    }
  }
  if (st == KILN_OK) st = on_device(s, dev);
  /* The combined flag is cleared once per iteration; each optimizer's flag at its unscale_. */
  if (st == KILN_OK && !s->cleared) st = kiln_fill_(s->found_inf, 0.0);
  if (st == KILN_OK) s->cleared = true;
  if (st == KILN_OK && !rec->flag && !(rec->flag = kiln_keep(kiln_zeros(KILN_SHAPE0, KILN_F32, dev))))
    st = kiln_last_error();
  if (st == KILN_OK) st = kiln_fill_(rec->flag, 0.0);
  bool prev = kiln_set_grad_enabled(false);
  if (st == KILN_OK) { /* PyTorch: scale.double().reciprocal().float(), on the device */
    kiln_scope_begin();
    kiln_tensor *inv = kiln_div(kiln_scalar(1.0, KILN_F64, dev), kiln_to_dtype(s->scale, KILN_F64));
    st = inv ? kiln_copy_(s->inv_scale, inv) : kiln_last_error();
    kiln_scope_end();
  }
  if (st == KILN_OK) st = kiln_amp_unscale_dev_(n, grads, rec->flag, s->inv_scale);
  if (st == KILN_OK) { /* found_inf = max(found_inf, this optimizer's flag), on the device */
    kiln_scope_begin();
    kiln_tensor *both = kiln_maximum(s->found_inf, rec->flag);
    st = both ? kiln_copy_(s->found_inf, both) : kiln_last_error();
    kiln_scope_end();
  }
  kiln_set_grad_enabled(prev);
  free(grads);
  if (st == KILN_OK) rec->unscaled = s->any_unscaled = true;
  return st;
}

kiln_status kiln_grad_scaler_step(kiln_grad_scaler *s, kiln_optimizer *opt) {
  static const char who[] = "kiln_grad_scaler_step";
  if (!s || !opt) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL scaler or optimizer", who);
  if (!s->cfg.enabled) return kiln_optimizer_step(opt);
  struct opt_rec *rec = rec_of(s, opt);
  if (!rec) return kiln_last_error();
  if (!rec->unscaled) {
    kiln_status st = kiln_grad_scaler_unscale_(s, opt);
    if (st != KILN_OK) return st;
  }
  s->stepped = true;
  /* the kernels read this optimizer's flag on the device: skipped there, no wait here */
  return kiln__optimizer_step_found_inf(opt, rec->flag);
}

kiln_status kiln_grad_scaler_update(kiln_grad_scaler *s) {
  if (!s) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_grad_scaler_update: NULL scaler");
  if (!s->cfg.enabled) return KILN_OK;
  if (!s->stepped && !s->any_unscaled)
    return kiln_set_error(KILN_ERR_STATE, "kiln_grad_scaler_update: no unscale_ or step since the last update");
  kiln_status st = kiln_amp_update_scale_(s->scale, s->growth_tracker, s->found_inf, s->cfg.growth_factor,
                                          s->cfg.backoff_factor, s->cfg.growth_interval);
  for (int i = 0; i < s->n_recs; i++) s->recs[i].unscaled = false;
  s->any_unscaled = false;
  s->stepped = false;
  s->cleared = false;
  return st;
}

/* ---- state ---- */
kiln_dict *kiln_grad_scaler_state_dict(const kiln_grad_scaler *s) {
  if (!s) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_grad_scaler_state_dict: NULL scaler");
    return NULL;
  }
  kiln_dict *d = kiln_dict_new();
  if (!d) return NULL;
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();
  /* a checkpoint is a query: the device values are read here */
  double scale = s->scale ? kiln_item(s->scale) : s->host_scale;
  double tracker = s->growth_tracker ? kiln_item(s->growth_tracker) : (double)s->host_tracker;
  kiln_status st = kiln_dict_set(d, "scale", kiln_scalar(scale, KILN_F64, cpu));
  if (st == KILN_OK) st = kiln_dict_set(d, "growth_tracker", kiln_scalar(tracker, KILN_I64, cpu));
  kiln_scope_end();
  char buf[64];
  snprintf(buf, sizeof buf, "%.17g", s->cfg.growth_factor);
  if (st == KILN_OK) st = kiln_dict_set_meta(d, "growth_factor", buf);
  snprintf(buf, sizeof buf, "%.17g", s->cfg.backoff_factor);
  if (st == KILN_OK) st = kiln_dict_set_meta(d, "backoff_factor", buf);
  snprintf(buf, sizeof buf, "%lld", (long long)s->cfg.growth_interval);
  if (st == KILN_OK) st = kiln_dict_set_meta(d, "growth_interval", buf);
  if (st != KILN_OK) {
    kiln_dict_free(d);
    return NULL;
  }
  return d;
}

kiln_status kiln__grad_scaler_load_state_dict(kiln_grad_scaler *s, const kiln_dict *d, bool apply,
                                              const char *who) {
  if (!s || !d) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL scaler or dict", who);
  kiln_tensor *sc = kiln_dict_get(d, "scale"), *gt = kiln_dict_get(d, "growth_tracker");
  if (!sc || !gt || kiln_numel(sc) != 1 || kiln_numel(gt) != 1)
    return kiln_set_error(KILN_ERR_FORMAT, "%s: needs one-element 'scale' and 'growth_tracker' entries", who);
  double scale = kiln_item(sc), tracker = kiln_item(gt);
  if (!(scale > 0) || !isfinite(scale) || tracker < 0 || tracker != floor(tracker))
    return kiln_set_error(KILN_ERR_FORMAT, "%s: scale %g or growth_tracker %g out of range", who, scale, tracker);
  if (!apply) return KILN_OK;
  kiln_status st = KILN_OK;
  if (s->scale) st = kiln_fill_(s->scale, scale);
  if (st == KILN_OK && s->growth_tracker) st = kiln_fill_(s->growth_tracker, tracker);
  if (st != KILN_OK) return st;
  s->host_scale = scale;
  s->host_tracker = (int64_t)tracker;
  for (int i = 0; i < s->n_recs; i++) s->recs[i].unscaled = false;
  s->any_unscaled = false;
  s->stepped = false;
  s->cleared = false;
  return KILN_OK;
}

kiln_status kiln_grad_scaler_load_state_dict(kiln_grad_scaler *s, const kiln_dict *d) {
  return kiln__grad_scaler_load_state_dict(s, d, true, "kiln_grad_scaler_load_state_dict");
}
