/*
** Anomaly check: an observer on the op call path that looks at every floating output of
** every op (at any depth, in forward and backward) and fails the op with
** KILN_ERR_NUMERIC when one holds a NaN or an infinity, naming the op, its input and output
** shapes, the nn module it ran in, and in a backward the forward op and module that made
** the node whose rule failed (torch.autograd.detect_anomaly, with the module name). It copies each output
** to the host and so waits for the device: a debugging mode, off by default. Turned on by
** KILN_ANOMALY=1 at load, or kiln_set_anomaly_enabled(true).
*/
#include "ops/op.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static atomic_bool enabled;

static kiln_status check(const kiln__op_event *e, void *tok, void *ctx) {
  KILN__UNUSED(tok);
  KILN__UNUSED(ctx);
  if (e->status != KILN_OK) return KILN_OK;
  for (int k = 0; k < e->n_out; k++) {
    kiln_tensor *t = e->out[k];
    if (!t || !kiln_dtype_is_float(t->dtype) || kiln_numel(t) == 0) continue;
    int64_t n = kiln_numel(t);
    double *h = malloc((size_t)n * sizeof *h);
    if (!h) return kiln_set_error(KILN_ERR_OOM, "kiln anomaly check: out of host memory (%lld values of '%s')",
                                  (long long)n, e->op->name);
    kiln_status st = KILN_OK;
    kiln_scope_begin();
    kiln_tensor *d = kiln_to_device(kiln_to_dtype(t, KILN_F64), kiln_device_cpu());
    st = d ? kiln_to_host(d, h, (size_t)n * sizeof *h) : kiln_last_error();
    kiln_scope_end();
    int64_t bad = -1;
    for (int64_t i = 0; st == KILN_OK && i < n && bad < 0; i++)
      if (!isfinite(h[i])) bad = i;
    double v = bad >= 0 ? h[bad] : 0;
    free(h);
    if (st != KILN_OK) return st;
    if (bad >= 0) {
      /* Where it happened: in forward, the module running; in backward, the node whose
      ** rule ran, i.e. the forward op and the module that made it (what PyTorch's
      ** detect_anomaly shows as a forward traceback). */
      char where[512] = "", ins[256] = "";
      const kiln__node *bn = e->backward ? kiln__backward_node() : NULL;
      const char *mod = e->backward ? (bn ? bn->module : NULL) : kiln__module_scope_current();
      if (e->backward)
        snprintf(where, sizeof where, " in the backward of '%s'%s%s%s", bn ? bn->name : "?", mod ? " (module " : "",
                 mod ? mod : "", mod ? ")" : "");
      else if (mod)
        snprintf(where, sizeof where, " in module %s", mod);
      int w = 0;
      for (int i = 0; i < e->n_in && w < (int)sizeof ins - 1; i++)
        w += snprintf(ins + w, sizeof ins - (size_t)w, "%s%s", w ? ", " : "", e->in[i] ? kiln__tshape(e->in[i]) : "NULL");
      return kiln_set_error(KILN_ERR_NUMERIC,
                            "kiln anomaly: op '%s'%s produced %s in output %d (shape %s, %s) at element %lld; "
                            "inputs %s",
                            e->op->name, where, isnan(v) ? "NaN" : "an infinity", k, kiln__tshape(t),
                            kiln_dtype_name(t->dtype), (long long)bad, ins);
    }
  }
  return KILN_OK;
}

static const kiln__observer anomaly = {"anomaly", NULL, check, NULL, NULL, NULL};

kiln_status kiln_set_anomaly_enabled(bool on) {
  bool was = atomic_exchange(&enabled, on);
  if (on == was) return KILN_OK;
  if (on) {
    kiln_status st = kiln__observer_add(&anomaly);
    if (st != KILN_OK) atomic_store(&enabled, false);
    return st;
  }
  kiln__observer_remove(&anomaly);
  return KILN_OK;
}

bool kiln_anomaly_enabled(void) { return atomic_load(&enabled); }

/* Not static: call.c refers to it, so that a static link pulls this file in (see profile.c). */
__attribute__((constructor)) void kiln__anomaly_env_init(void) {
  const char *e = getenv("KILN_ANOMALY");
  if (e && strcmp(e, "1") == 0) kiln_set_anomaly_enabled(true);
  else if (e && *e && strcmp(e, "0") != 0)
    fprintf(stderr, "kiln: KILN_ANOMALY=%s is not understood (accepted: 0, 1); the check stays off\n", e);
}
