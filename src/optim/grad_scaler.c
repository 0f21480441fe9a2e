/*
** Dynamic loss scaling (torch.amp.GradScaler): the loss is multiplied by the scale before
** backward, so that small f16 gradients do not flush to zero; unscale_ divides every
** gradient of an optimizer by it in one pass (kiln_amp_unscale_: one list kernel) and
** records on the device whether any is inf or NaN; step skips the optimizer's step when
** one is; update halves the scale after a skipped step and doubles it after
** growth_interval clean steps in a row. PyTorch's defaults: 2^16, x2 every 2000, x0.5.
**
** The scale is a host number here, so step and update read the found-inf flag on the
** host (one element, one wait per step). The device-side skip inside the optimizer
** kernels (no wait, graph-capturable) is the next step of issue 14.
*/
#include "optim_int.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct kiln_grad_scaler {
  kiln_grad_scaler_config cfg;
  double scale;
  int64_t growth_tracker; /* clean steps in a row since the last change */
  kiln_tensor *found_inf; /* f32 one element on the gradients' device; NULL until unscale */
  const kiln_optimizer *unscaled; /* the optimizer unscaled in this iteration */
  bool stepped;                   /* step ran (or skipped) in this iteration */
  bool last_found_inf;
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
  s->scale = c.init_scale;
  return s;
}

void kiln_grad_scaler_free(kiln_grad_scaler *s) {
  if (!s) return;
  kiln_tensor_free(s->found_inf);
  free(s);
}

double kiln_grad_scaler_get_scale(const kiln_grad_scaler *s) {
  if (!s) return NAN;
  return s->cfg.enabled ? s->scale : 1.0;
}

bool kiln_grad_scaler_found_inf(const kiln_grad_scaler *s) { return s && s->last_found_inf; }

kiln_tensor *kiln_grad_scaler_scale(kiln_grad_scaler *s, kiln_tensor *loss) {
  if (!loss) return NULL;
  if (!s) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_grad_scaler_scale: NULL scaler");
    return NULL;
  }
  if (!s->cfg.enabled) return kiln_mul_scalar(loss, 1.0);
  return kiln_mul_scalar(loss, s->scale);
}

kiln_status kiln_grad_scaler_unscale_(kiln_grad_scaler *s, kiln_optimizer *opt) {
  static const char who[] = "kiln_grad_scaler_unscale_";
  if (!s || !opt) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL scaler or optimizer", who);
  if (!s->cfg.enabled) return KILN_OK;
  if (s->unscaled == opt)
    return kiln_set_error(KILN_ERR_STATE, "%s: already called for this optimizer since the last update", who);
  int n = kiln_optimizer_num_params(opt);
  kiln_tensor **grads = malloc((size_t)(n > 0 ? n : 1) * sizeof *grads);
  if (!grads) return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  kiln_device dev = kiln_device_cpu();
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
  if (st == KILN_OK && (!s->found_inf || !kiln_device_equal(kiln_device_of(s->found_inf), dev))) {
    kiln_tensor_free(s->found_inf);
    s->found_inf = kiln_keep(kiln_zeros(KILN_SHAPE0, KILN_F32, dev));
    if (!s->found_inf) st = kiln_last_error();
  }
  if (st == KILN_OK) st = kiln_fill_(s->found_inf, 0.0);
  if (st == KILN_OK) {
    bool prev = kiln_set_grad_enabled(false);
    st = kiln_amp_unscale_(n, grads, s->found_inf, 1.0 / s->scale);
    kiln_set_grad_enabled(prev);
  }
  free(grads);
  if (st == KILN_OK) s->unscaled = opt;
  return st;
}

kiln_status kiln_grad_scaler_step(kiln_grad_scaler *s, kiln_optimizer *opt) {
  static const char who[] = "kiln_grad_scaler_step";
  if (!s || !opt) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL scaler or optimizer", who);
  if (!s->cfg.enabled) return kiln_optimizer_step(opt);
  if (s->unscaled != opt) {
    kiln_status st = kiln_grad_scaler_unscale_(s, opt);
    if (st != KILN_OK) return st;
  }
  double f = s->found_inf ? kiln_item(s->found_inf) : 0.0;
  if (isnan(f)) return kiln_last_error() != KILN_OK ? kiln_last_error() : KILN_ERR_INTERNAL;
  s->stepped = true;
  s->last_found_inf = f != 0.0;
  if (s->last_found_inf) return KILN_OK; /* skipped: parameters and optimizer state untouched */
  return kiln_optimizer_step(opt);
}

kiln_status kiln_grad_scaler_update(kiln_grad_scaler *s) {
  if (!s) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_grad_scaler_update: NULL scaler");
  if (!s->cfg.enabled) return KILN_OK;
  if (!s->stepped && !s->unscaled)
    return kiln_set_error(KILN_ERR_STATE, "kiln_grad_scaler_update: no unscale_ or step since the last update");
  bool bad = s->stepped ? s->last_found_inf : (s->found_inf && kiln_item(s->found_inf) != 0.0);
  if (bad) {
    s->scale *= s->cfg.backoff_factor;
    s->growth_tracker = 0;
  } else if (++s->growth_tracker == s->cfg.growth_interval) {
    s->scale *= s->cfg.growth_factor;
    s->growth_tracker = 0;
  }
  s->last_found_inf = bad;
  s->unscaled = NULL;
  s->stepped = false;
  return KILN_OK;
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
  kiln_status st = kiln_dict_set(d, "scale", kiln_scalar(s->scale, KILN_F64, cpu));
  if (st == KILN_OK) st = kiln_dict_set(d, "growth_tracker", kiln_scalar((double)s->growth_tracker, KILN_I64, cpu));
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

kiln_status kiln_grad_scaler_load_state_dict(kiln_grad_scaler *s, const kiln_dict *d) {
  static const char who[] = "kiln_grad_scaler_load_state_dict";
  if (!s || !d) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL scaler or dict", who);
  kiln_tensor *sc = kiln_dict_get(d, "scale"), *gt = kiln_dict_get(d, "growth_tracker");
  if (!sc || !gt || kiln_numel(sc) != 1 || kiln_numel(gt) != 1)
    return kiln_set_error(KILN_ERR_FORMAT, "%s: needs one-element 'scale' and 'growth_tracker' entries", who);
  double scale = kiln_item(sc), tracker = kiln_item(gt);
  if (!(scale > 0) || !isfinite(scale) || tracker < 0 || tracker != floor(tracker))
    return kiln_set_error(KILN_ERR_FORMAT, "%s: scale %g or growth_tracker %g out of range", who, scale, tracker);
  s->scale = scale;
  s->growth_tracker = (int64_t)tracker;
  s->unscaled = NULL;
  s->stepped = false;
  return KILN_OK;
}
