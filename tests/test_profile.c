/*
** The profiler (kiln_profiler_start/stop): the table names ops and nn modules with their
** FLOPs; the Chrome trace is one JSON object whose events have the Trace Event Format's
** fields, with module spans on the host track, ops nested inside them in time and naming
** their module, backward ops marked; a trace path that cannot be written fails at start
** with nothing turned on; start twice or stop when off is a state error.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_nn.h>

#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "scratch.h"

#if defined(KILN_HAVE_CJSON) && KILN_HAVE_CJSON
#include <cjson/cJSON.h>
#endif

enum { B = 4, IN = 8, HID = 16, OUT = 3 };

static kiln_module *make_net(void) {
  kiln_manual_seed(1);
  kiln_device cpu = kiln_device_cpu();
  kiln_module *net = kiln_sequential_new();
  kiln_sequential_append(net, kiln_linear_new(IN, HID, true, KILN_F32, cpu, NULL));
  kiln_sequential_append(net, kiln_relu_new());
  kiln_sequential_append(net, kiln_linear_new(HID, OUT, true, KILN_F32, cpu, NULL));
  return net;
}

static void steps(kiln_module *net, int n) {
  for (int s = 0; s < n; s++) {
    kiln_scope_begin();
    int64_t xs[2] = {B, IN}, ys[2] = {B, OUT};
    kiln_tensor *x = kiln_randn(2, xs, KILN_F32, kiln_device_cpu(), NULL);
    kiln_tensor *y = kiln_zeros(2, ys, KILN_F32, kiln_device_cpu());
    kiln_tensor *loss = kiln_mse_loss(kiln_module_forward(net, x), y, KILN_REDUCTION_MEAN);
    CHECK(loss && kiln_backward(loss, NULL) == KILN_OK);
    kiln_scope_end();
  }
}

static char *slurp(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *s = malloc((size_t)n + 1);
  if (s && fread(s, 1, (size_t)n, f) != (size_t)n) n = 0;
  if (s) s[n] = 0;
  fclose(f);
  return s;
}

static void test_bad_path(void) {
  kiln_profiler_options o = {false, "/nonexistent-kiln-dir/trace.json"};
  CHECK(kiln_profiler_start(&o) == KILN_ERR_IO);
  CHECK(strstr(kiln_last_error_message(), "/nonexistent-kiln-dir/trace.json") != NULL);
  CHECK(!kiln_profiler_enabled());
  CHECK(kiln_profiler_stop(NULL) == KILN_ERR_STATE);
}

#if defined(KILN_HAVE_CJSON) && KILN_HAVE_CJSON
static double num(const cJSON *o, const char *k) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
  return cJSON_IsNumber(v) ? v->valuedouble : -1;
}
static const char *str(const cJSON *o, const char *k) {
  const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
  return cJSON_IsString(v) ? v->valuestring : NULL;
}

static void check_trace(const char *text) {
  const char *end = NULL;
  cJSON *j = cJSON_ParseWithOpts(text, &end, 1);
  CHECK(j != NULL);
  if (!j) return;
  cJSON *evs = cJSON_GetObjectItemCaseSensitive(j, "traceEvents");
  CHECK(cJSON_IsArray(evs));
  int n_meta = 0, n_module = 0, n_op = 0, n_bw = 0, nested = 0, bad = 0;
  bool linear_flops = false;
  cJSON *e;
  cJSON_ArrayForEach(e, evs) {
    const char *ph = str(e, "ph"), *name = str(e, "name");
    if (!ph || !name || num(e, "pid") < 0 || num(e, "tid") < 0) {
      bad++;
      continue;
    }
    if (!strcmp(ph, "M")) {
      n_meta++;
      continue;
    }
    if (strcmp(ph, "X") != 0 || num(e, "ts") < 0 || num(e, "dur") < 0 || !str(e, "cat")) {
      bad++;
      continue;
    }
    const char *cat = str(e, "cat");
    if (!strcmp(cat, "module")) n_module++;
    if (!strncmp(cat, "op", 2)) {
      n_op++;
      if (strstr(cat, "backward")) n_bw++;
      const cJSON *args = cJSON_GetObjectItemCaseSensitive(e, "args");
      CHECK(cJSON_IsObject(args) && num(args, "bytes") > 0);
      /* linear (8 -> 16) on 4 rows: 2*4*16*8 + 4*16 (bias) */
      if (!strcmp(name, "linear") && num(args, "flops") == 2.0 * B * HID * IN + B * HID) linear_flops = true;
      if (!strcmp(name, "linear_relu") && num(args, "flops") == 2.0 * B * HID * IN + 2 * B * HID) linear_flops = true;
      const char *mod = args ? str(args, "module") : NULL;
      if (mod && !strcmp(mod, "0 (Linear)") && !strstr(cat, "backward")) {
        /* within a span of its module on the same track */
        double ts = num(e, "ts"), te = ts + num(e, "dur");
        cJSON *m;
        cJSON_ArrayForEach(m, evs) {
          const char *mn = str(m, "name"), *mc = str(m, "cat");
          if (mn && mc && !strcmp(mc, "module") && !strcmp(mn, "0 (Linear)") && num(m, "tid") == num(e, "tid") &&
              num(m, "ts") <= ts + 1e-3 && ts - 1e-3 <= num(m, "ts") + num(m, "dur") && te <= num(m, "ts") + num(m, "dur") + 1e-3)
            nested++;
        }
      }
    }
  }
  CHECK(bad == 0);
  CHECK(n_meta >= 2);
  CHECK(n_module >= 3 * 3); /* the root and two layers (ReLU may fuse) per step */
  CHECK(n_op > 0 && n_bw > 0);
  CHECK(nested > 0);
  CHECK(linear_flops);
  cJSON_Delete(j);
}
#endif

static void test_trace(void) {
  char dir[512], path[600];
  if (scratch_begin(dir, sizeof dir, "profile") != 0) {
    CHECK(!"scratch dir");
    return;
  }
  snprintf(path, sizeof path, "%s/trace.json", dir);
  kiln_module *net = make_net();
  kiln_profiler_options o = {true, path};
  CHECK(kiln_profiler_start(&o) == KILN_OK);
  CHECK(kiln_profiler_enabled());
  CHECK(kiln_profiler_start(NULL) == KILN_ERR_STATE);
  steps(net, 3);
  char *table = NULL;
  size_t tn = 0;
  FILE *tf = open_memstream(&table, &tn);
  CHECK(kiln_profiler_stop(tf) == KILN_OK);
  fclose(tf);
  CHECK(!kiln_profiler_enabled());
  CHECK(table && strstr(table, "Sequential") && strstr(table, "0 (Linear)") && strstr(table, "(backward)"));
  CHECK(table && strstr(table, "GFLOP") && strstr(table, "TFLOP/s"));
  /* where the live set was largest, in and outside the backward */
  CHECK(table && strstr(table, "memory on cpu: most live after an op in a backward") &&
        strstr(table, "memory on cpu: most live after an op outside backward"));
  if (getenv("KILN_TEST_VERBOSE")) fputs(table, stderr);
  free(table);
  char *text = slurp(path);
  CHECK(text && text[0] == '{' && strstr(text, "\"traceEvents\""));
#if defined(KILN_HAVE_CJSON) && KILN_HAVE_CJSON
  if (text) check_trace(text);
#endif
  free(text);
  /* off: ops run unobserved, and the next start begins afresh */
  steps(net, 1);
  CHECK(kiln_profiler_start(NULL) == KILN_OK && kiln_profiler_stop(NULL) == KILN_OK);
  kiln_module_free(net);
  scratch_end(dir);
}

/* The GFLOP column of the table row that starts with name, or -1. */
static double table_gflop(const char *table, const char *name) {
  const char *line = table;
  while (line && *line) {
    char row[512];
    const char *nl = strchr(line, '\n');
    size_t len = nl ? (size_t)(nl - line) : strlen(line);
    if (len >= sizeof row) len = sizeof row - 1;
    memcpy(row, line, len);
    row[len] = 0;
    char *tok[12];
    int nt = 0;
    for (char *t = strtok(row, " "); t && nt < 12; t = strtok(NULL, " ")) tok[nt++] = t;
    /* name, calls, host ms, host us/c, dev us/c, MB moved, GFLOP, ...; a backward row's
    ** name is followed by "(backward)" */
    if (nt >= 8 && !strcmp(tok[0], name) && !strcmp(tok[1], "(backward)")) return atof(tok[7]);
    if (nt >= 7 && !strcmp(tok[0], name)) return atof(tok[6]);
    line = nl ? nl + 1 : NULL;
  }
  return -1;
}

/* Stops the profiler, its table as text ("" when it could not be read). */
static const char *stop_to_text(void) {
  static char text[1 << 16];
  text[0] = 0;
  FILE *f = tmpfile();
  CHECK(f != NULL);
  CHECK(kiln_profiler_stop(f) == KILN_OK);
  if (!f) return text;
  rewind(f);
  size_t n = fread(text, 1, sizeof text - 1, f);
  text[n] = 0;
  fclose(f);
  return text;
}

/* The FLOPs the table gives the norms and the optimizer steps (they had none): 8 a
** value for layer_norm, 9 a parameter value for SGD, 14 for Adam. */
static void test_flops_of_norms_and_optimizers(void) {
  kiln_device cpu = kiln_device_cpu();
  CHECK(kiln_profiler_start(NULL) == KILN_OK);
  kiln_scope_begin();
  bool prev = kiln_set_grad_enabled(false);
  kiln_tensor *x = kiln_ones(KILN_SHAPE(1000, 1000), KILN_F32, cpu);
  CHECK(kiln_layer_norm(x, 1, (const int64_t[]){1000}, NULL, NULL, 1e-5) != NULL);
  kiln_tensor *p = kiln_zeros(KILN_SHAPE(1000000), KILN_F32, cpu), *g = kiln_ones(KILN_SHAPE(1000000), KILN_F32, cpu);
  CHECK(kiln_sgd_multi_step_(1, &p, &g, NULL, NULL, NULL, 0.1, 0, 0, 0, false, false, NULL) == KILN_OK);
  kiln_tensor *m = kiln_zeros_like(p), *v = kiln_zeros_like(p);
  CHECK(kiln_adam_step_(p, g, m, v, NULL, 1e-3, 0.9, 0.999, 1e-8, 0, 1, false, false, NULL) == KILN_OK);
  kiln_set_grad_enabled(prev);
  kiln_scope_end();
  const char *text = stop_to_text();
  CHECK(table_gflop(text, "layer_norm") == 0.008);
  CHECK(table_gflop(text, "sgd_multi_step_") == 0.009);
  CHECK(table_gflop(text, "adam_step_") == 0.014);
}

/* linear's backward runs its products as kernels, not ops: the table still has them, as
** one linear_backward row with both products' FLOPs (2 M N K each), and the forward's
** own row is the forward's alone. */
static void test_linear_backward_row(void) {
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_SHAPE(500, 1000), KILN_F32, cpu), *w = kiln_ones(KILN_SHAPE(1000, 1000), KILN_F32, cpu);
  kiln_requires_grad_(x, true);
  kiln_requires_grad_(w, true);
  CHECK(kiln_profiler_start(NULL) == KILN_OK);
  kiln_tensor *y = kiln_linear(x, w, NULL);
  CHECK(y && kiln_backward(kiln_sum_all(y), NULL) == KILN_OK);
  const char *text = stop_to_text();
  CHECK(table_gflop(text, "linear") == 1.0);
  CHECK(table_gflop(text, "linear_backward") == 2.0);
  if (getenv("KILN_TEST_VERBOSE")) fputs(text, stderr);
  kiln_scope_end();
}

/* linear_cross_entropy makes the head's gradients in its forward: its row counts the
** logits' product (2 M K V) and one more for each input that wants a gradient, none
** without grad mode. */
static void test_linear_cross_entropy_row(void) {
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_SHAPE(100, 50), KILN_F32, cpu), *w = kiln_ones(KILN_SHAPE(1000, 50), KILN_F32, cpu);
  kiln_tensor *t = kiln_zeros(KILN_SHAPE(100), KILN_I64, cpu);
  kiln_requires_grad_(w, true);
  CHECK(kiln_profiler_start(NULL) == KILN_OK);
  CHECK(kiln_linear_cross_entropy(x, w, t, KILN_REDUCTION_MEAN, -100, 0.0) != NULL); /* dW only: 2 x 0.01 GFLOP */
  const char *text = stop_to_text();
  CHECK(table_gflop(text, "linear_cross_entropy") == 0.02);
  bool prev = kiln_set_grad_enabled(false);
  CHECK(kiln_profiler_start(NULL) == KILN_OK);
  /* no gradients: the logits alone */
  CHECK(kiln_linear_cross_entropy(x, w, t, KILN_REDUCTION_MEAN, -100, 0.0) != NULL);
  text = stop_to_text();
  CHECK(table_gflop(text, "linear_cross_entropy") == 0.01);
  kiln_set_grad_enabled(prev);
  kiln_scope_end();
}

int main(void) {
  test_bad_path();
  test_linear_cross_entropy_row();
  test_linear_backward_row();
  test_flops_of_norms_and_optimizers();
  test_trace();
  if (failures) fprintf(stderr, "test_profile: %d failed\n", failures);
  else printf("test_profile: ok\n");
  return failures ? 1 : 0;
}
