/* kiln_module_summary: the "print model memory at the start" table. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "nn/nn_int.h"

const char *kiln_format_bytes(int64_t bytes, char *buf, size_t n) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) {
    snprintf(buf, n, "%" PRId64 " B", bytes);
    return buf;
  }
  double v = (double)bytes;
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    u++;
  }
  snprintf(buf, n, "%.2f %s", v, units[u]);
  return buf;
}

enum { W_NAME = 28, W_TYPE = 40, W_SHAPE = 18 };

static void rule(FILE *f) {
  for (int i = 0; i < W_NAME + W_TYPE + W_SHAPE + 32; i++) fputc('-', f);
  fputc('\n', f);
}

static void print_module(FILE *f, kiln_module *m, const char *name) {
  char repr[256] = "";
  char type[320];
  const char *tn = kiln_module_type_name(m);
  if (kiln__module_extra_repr(m, repr, sizeof repr) > 0)
    snprintf(type, sizeof type, "%s(%s)", tn, repr);
  else
    snprintf(type, sizeof type, "%s", tn);
  fprintf(f, "%-*s %s\n", W_NAME, name[0] ? name : "(root)", type);
}

static void walk(FILE *f, kiln_module *m, const char *prefix) {
  print_module(f, m, prefix);
  /* Own parameters: those named_parameters lists without a dot after the prefix. */
  int n = kiln_module_named_parameters(m, NULL, NULL, 0);
  if (n > 0) {
    const char **names = malloc((size_t)n * sizeof *names);
    kiln_tensor **ts = malloc((size_t)n * sizeof *ts);
    if (names && ts) {
      kiln_module_named_parameters(m, names, ts, n);
      for (int i = 0; i < n; i++) {
        if (strchr(names[i], '.')) continue; /* a child's: printed under the child */
        char full[512], shape[96], bytes[32];
        snprintf(full, sizeof full, "%s%s%s", prefix, prefix[0] ? "." : "", names[i]);
        kiln_shape_str(ts[i], shape, sizeof shape);
        fprintf(f, "  %-*s %-*s %-*s %-9s %12" PRId64 " %12s%s\n", W_NAME - 2, full, 10, "",
                W_SHAPE + W_TYPE - 11 - 10, shape, kiln_dtype_name(kiln_dtype_of(ts[i])),
                kiln_numel(ts[i]), kiln_format_bytes((int64_t)kiln_nbytes(ts[i]), bytes, sizeof bytes),
                kiln_requires_grad(ts[i]) ? "" : " (frozen)");
      }
    }
    free(names);
    free(ts);
  }
  for (int i = 0; i < kiln_module_num_children(m); i++) {
    char full[512];
    snprintf(full, sizeof full, "%s%s%s", prefix, prefix[0] ? "." : "", kiln_module_child_name(m, i));
    walk(f, kiln_module_child_at(m, i), full);
  }
}

kiln_status kiln_module_summary(FILE *f, kiln_module *m) {
  if (!f || !m) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_module_summary: NULL argument");
  fprintf(f, "%-*s %-*s %-*s %-9s %12s %12s\n", W_NAME, "module / parameter", 10, "", W_SHAPE + W_TYPE - 11 - 10,
          "type / shape", "dtype", "params", "bytes");
  rule(f);
  walk(f, m, "");
  rule(f);
  char b1[32], b2[32], b3[32];
  int64_t np = kiln_module_num_params(m), nt = kiln_module_num_trainable_params(m);
  fprintf(f, "parameters: %" PRId64 " (trainable %" PRId64 ", frozen %" PRId64 ")\n", np, nt, np - nt);
  fprintf(f, "weights: %s   grads: %s   buffers: %s\n",
          kiln_format_bytes(kiln_module_param_bytes(m), b1, sizeof b1),
          kiln_format_bytes(kiln_module_grad_bytes(m), b2, sizeof b2),
          kiln_format_bytes(kiln_module_buffer_bytes(m), b3, sizeof b3));
  /* Where the weights live: the device of the first parameter (a model is usually whole
  ** on one device; a mixed one says so). */
  kiln_tensor *ps[1];
  int n = kiln_module_parameters(m, ps, 1);
  if (n > 0) {
    kiln_tensor **all = malloc((size_t)n * sizeof *all);
    bool mixed = false;
    if (all) {
      kiln_module_parameters(m, all, n);
      for (int i = 1; i < n; i++)
        if (!kiln_device_equal(kiln_device_of(all[i]), kiln_device_of(all[0]))) mixed = true;
      free(all);
    }
    char dev[32];
    fprintf(f, "device: %s%s\n", kiln_device_str(kiln_device_of(ps[0]), dev, sizeof dev),
            mixed ? " (and others: mixed)" : "");
  }
  return KILN_OK;
}

/* ---- kiln_model_memory_summary ---- */

static int64_t measured(const kiln__act_measure *a, const kiln_module *m) {
  for (int i = 0; i < a->n; i++)
    if (a->mods[i] == m) return a->bytes[i];
  return -1;
}

static void walk_act(FILE *f, const kiln__act_measure *a, kiln_module *m, const char *prefix, int depth) {
  int64_t b = measured(a, m);
  char bytes[32], name[600];
  if (prefix[0]) (void)!snprintf(name, sizeof name, "%*s%s (%s)", 2 * depth, "", prefix, kiln_module_type_name(m));
  else (void)!snprintf(name, sizeof name, "%s", kiln_module_type_name(m));
  if (b >= 0) fprintf(f, "  %-48s %12s\n", name, kiln_format_bytes(b, bytes, sizeof bytes));
  else fprintf(f, "  %-48s %12s\n", name, "-"); /* its forward did not run as its own (fused) */
  for (int i = 0; i < kiln_module_num_children(m); i++) {
    char full[512];
    if (snprintf(full, sizeof full, "%s%s%s", prefix, prefix[0] ? "." : "", kiln_module_child_name(m, i)) >=
        (int)sizeof full)
      continue; /* a path past 511 characters: left out */
    walk_act(f, a, kiln_module_child_at(m, i), full, depth + 1);
  }
}

kiln_status kiln_model_memory_summary(FILE *f, kiln_module *m, const kiln_optimizer *opt, kiln_tensor *x) {
  if (!f || !m) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_model_memory_summary: NULL argument");
  char b1[32], b2[32], b3[32], b4[32], b5[32];
  int64_t pb = kiln_module_param_bytes(m), gb = kiln_module_grad_bytes(m), bb = kiln_module_buffer_bytes(m);
  int64_t ob = opt ? kiln_optimizer_state_bytes(opt) : 0;
  fprintf(f, "model memory\n");
  fprintf(f, "  parameters        %12s\n", kiln_format_bytes(pb, b1, sizeof b1));
  fprintf(f, "  gradients         %12s%s\n", kiln_format_bytes(gb, b2, sizeof b2),
          gb == 0 ? "   (none yet: made by the first backward)" : "");
  fprintf(f, "  buffers           %12s\n", kiln_format_bytes(bb, b3, sizeof b3));
  fprintf(f, "  optimizer state   %12s%s\n", kiln_format_bytes(ob, b4, sizeof b4),
          !opt ? "   (no optimizer given)" : ob == 0 ? "   (none yet: made by the first step)" : "");
  fprintf(f, "  total             %12s\n", kiln_format_bytes(pb + gb + bb + ob, b5, sizeof b5));
  if (!x) return KILN_OK;
  /* One forward on x with grad on, in its own scope: what each module leaves saved for
  ** backward (inclusive of its children), and the peak of the whole forward. */
  kiln__act_measure a = {NULL, NULL, 0, 0};
  int64_t live0 = 0, peak = 0;
  kiln_autograd_saved_bytes(&live0, NULL);
  kiln_autograd_saved_reset_peak();
  bool was = kiln_set_grad_enabled(true);
  kiln__module_measure_set(&a);
  kiln_scope_begin();
  kiln_tensor *y = kiln_module_forward(m, x);
  kiln_status st = y ? KILN_OK : kiln_last_error();
  int64_t live1 = 0;
  kiln_autograd_saved_bytes(&live1, &peak);
  kiln_scope_end();
  kiln__module_measure_set(NULL);
  kiln_set_grad_enabled(was);
  if (st == KILN_OK) {
    char shape[96];
    kiln_shape_str(x, shape, sizeof shape);
    fprintf(f, "activations saved for backward, one forward on %s %s: %s (peak %s)\n", shape,
            kiln_dtype_name(kiln_dtype_of(x)), kiln_format_bytes(live1 - live0, b1, sizeof b1),
            kiln_format_bytes(peak - live0, b2, sizeof b2));
    walk_act(f, &a, m, "", 0);
  }
  free(a.mods);
  free(a.bytes);
  return st;
}

int64_t kiln_module_activation_bytes(kiln_module *m, kiln_tensor *x, kiln_module *which) {
  if (!m || !x) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_module_activation_bytes: NULL argument");
    return -1;
  }
  kiln__act_measure a = {NULL, NULL, 0, 0};
  bool was = kiln_set_grad_enabled(true);
  kiln__module_measure_set(&a);
  kiln_scope_begin();
  kiln_tensor *y = kiln_module_forward(m, x);
  kiln_scope_end();
  kiln__module_measure_set(NULL);
  kiln_set_grad_enabled(was);
  int64_t b = y ? measured(&a, which ? which : m) : -1;
  free(a.mods);
  free(a.bytes);
  return b;
}
