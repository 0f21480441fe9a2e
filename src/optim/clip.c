/* Gradient clipping: torch.nn.utils.clip_grad_norm_ and clip_grad_value_.
** The total norm is the norm of the per-gradient norms (PyTorch's definition), each
** computed on the gradient's device in at least f32 (16-bit gradients are widened so the
** sum of squares cannot overflow), then read back once: one wait per call. */
#include <math.h>
#include <stdlib.h>

#include "kiln_optim.h"

/* The 0-dim per-gradient quantity combined on the host: max |g| (inf), else sum |g|^p. */
static kiln_tensor *partial(kiln_tensor *g, double p) {
  kiln_dtype dt = kiln_dtype_of(g);
  if (dt == KILN_F16 || dt == KILN_BF16) g = kiln_to_dtype(g, KILN_F32);
  if (isinf(p)) return kiln_amax(kiln_abs(g), 0, NULL, false);
  if (p == 2.0) return kiln_sum_all(kiln_mul(g, g));
  if (p == 1.0) return kiln_sum_all(kiln_abs(g));
  return kiln_sum_all(kiln_pow_scalar(kiln_abs(g), p));
}

double kiln_clip_grad_norm(kiln_tensor *const *params, int n, double max_norm, double norm_type) {
  static const char who[] = "kiln_clip_grad_norm";
  if (n < 0 || (n > 0 && !params)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: %d parameters", who, n);
    return NAN;
  }
  if (!(norm_type >= 1)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: norm_type %g (use 2.0, INFINITY or p >= 1)", who, norm_type);
    return NAN;
  }
  if (isnan(max_norm)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: max_norm is NaN", who);
    return NAN;
  }
  bool prev = kiln_set_grad_enabled(false);
  kiln_scope_begin();
  double total = 0.0;
  kiln_status st = KILN_OK;
  int ng = 0;
  bool mixed = false;
  kiln_tensor **parts = calloc((size_t)(n ? n : 1), sizeof *parts);
  if (!parts) st = kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  for (int i = 0; i < n && st == KILN_OK; i++) {
    if (!params[i]) {
      st = kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: parameter %d is NULL", who, i);
      break;
    }
    kiln_tensor *g = kiln_grad(params[i]);
    if (!g) continue;
    kiln_tensor *q = kiln_to_dtype(partial(g, norm_type), KILN_F64);
    if (!q) st = kiln_last_error();
    if (ng > 0 && q && !kiln_device_equal(kiln_device_of(q), kiln_device_of(parts[0])))
      mixed = true;
    parts[ng++] = q;
  }
  if (st == KILN_OK && mixed)
    for (int i = 0; i < ng && st == KILN_OK; i++)
      if (!(parts[i] = kiln_to_device(parts[i], kiln_device_cpu()))) st = kiln_last_error();
  if (st == KILN_OK && ng > 0) {
    /* 0-dim f64 partials on one device: one stack, one read back. */
    kiln_tensor *all = kiln_stack(ng, parts, 0);
    double *v = malloc((size_t)ng * sizeof *v);
    if (!all || !v)
      st = all ? kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who) : kiln_last_error();
    else
      st = kiln_to_host(all, v, (size_t)ng * sizeof *v);
    for (int i = 0; i < ng && st == KILN_OK; i++) {
      if (isinf(norm_type))
        total = v[i] > total || isnan(v[i]) ? v[i] : total;
      else
        total += v[i];
    }
    free(v);
    if (!isinf(norm_type)) total = norm_type == 1.0 ? total : pow(total, 1.0 / norm_type);
  }
  if (st == KILN_OK && ng > 0) {
    double coef = max_norm / (total + 1e-6);
    /* PyTorch multiplies by min(coef, 1); a factor of exactly 1 changes nothing, so it is
    ** skipped. */
    if (coef < 1.0)
      for (int i = 0; i < n && st == KILN_OK; i++)
        if (kiln_grad(params[i])) st = kiln_mul_scalar_(kiln_grad(params[i]), coef);
  }
  free(parts);
  kiln_scope_end();
  kiln_set_grad_enabled(prev);
  return st == KILN_OK ? total : NAN;
}

kiln_status kiln_clip_grad_value(kiln_tensor *const *params, int n, double clip) {
  static const char who[] = "kiln_clip_grad_value";
  if (n < 0 || (n > 0 && !params))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: %d parameters", who, n);
  if (!(clip >= 0)) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: clip value %g", who, clip);
  bool prev = kiln_set_grad_enabled(false);
  kiln_status st = KILN_OK;
  for (int i = 0; i < n && st == KILN_OK; i++) {
    if (!params[i]) {
      st = kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: parameter %d is NULL", who, i);
      break;
    }
    kiln_tensor *g = kiln_grad(params[i]);
    if (!g) continue;
    kiln_scope_begin();
    kiln_tensor *c = kiln_clamp(g, -clip, clip);
    st = c ? kiln_copy_(g, c) : kiln_last_error();
    kiln_scope_end();
  }
  kiln_set_grad_enabled(prev);
  return st;
}
