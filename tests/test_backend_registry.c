/*
** The backend registry (issue 13, part 6) with the test-only backend "testdev"
** (backend_testdev.c): it registers through the registry API alone, its devices parse and
** print, tensors round-trip to it, its own kernels run natively (its call counters and
** kiln__dispatch_has say so), every op it lacks falls back to the CPU with the right
** result (kiln_fallback_stats names it), and KILN_FALLBACK=error turns those into errors
** naming the op and "testdev:0". The optional entries it leaves NULL (graphs, timing,
** device details, async copies) take the plain path.
*/
#define _POSIX_C_SOURCE 200809L
#include "harness.h"

#include "backend_testdev.h"
#include "core/kiln_int.h"

#include <stdlib.h>
#include <string.h>

static kiln_device TD;

static const double A6[6] = {1.5, -2, 3.25, -0.5, 0, 7};
static const double B6[6] = {-1, 4, 0.5, 2, -3, 0.25};

static kiln_tensor *on_td(const double *v, kiln_dtype dt) {
  return kiln_to_device(h_tensor(v, 2, (const int64_t[]){2, 3}, dt), TD);
}

static const kiln_fallback_entry *find_fb(kiln_fallback_entry *e, int n, const char *op) {
  for (int i = 0; i < n; i++)
    if (strcmp(e[i].op, op) == 0) return &e[i];
  return NULL;
}

static void test_register(void) {
  kiln_device_type t = h_testdev_register();
  H_CHECK((int)t >= KILN__DEVICE_TYPE_DYNAMIC, "a run-time backend gets a type id past the named ones (%d)", (int)t);
  H_CHECK(h_testdev_register() == t, "registering again gives the same id");
  H_CHECK(kiln_backend_built(t) && kiln_backend_available(t, NULL), "built and available");
  H_CHECK(kiln_device_count(t) == 1, "one device");
  H_CHECK(kiln_backend_name(t) && strcmp(kiln_backend_name(t), "testdev") == 0, "its name");
  H_CHECK(kiln_backend_name(KILN_DEVICE_CUDA) && strcmp(kiln_backend_name(KILN_DEVICE_CUDA), "cuda") == 0,
          "cuda keeps its name whether or not it is built");
  bool listed = false;
  for (int i = 0; i < kiln_backend_count(); i++) listed |= kiln_backend_type(i) == t;
  H_CHECK(listed && kiln_backend_type(0) == KILN_DEVICE_CPU, "iteration: cpu first, testdev listed");
  H_CHECK((int)kiln_backend_type(kiln_backend_count()) == -1, "past the end: -1");
  kiln_device_type ft;
  H_CHECK(kiln__backend_find("testdev", &ft) == h_testdev_backend() && ft == t, "find by name");
  H_CHECK(kiln__backend_get(t) == h_testdev_backend(), "get by type");
  H_CHECK(kiln__backend_slot(KILN_DEVICE_CPU) == 0, "cpu is slot 0");

  /* bad registrations */
  kiln__backend bad = *h_testdev_backend();
  bad.name = "Bad Name";
  H_CHECK((int)kiln__backend_register(&bad) == -1 && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT,
          "a name with capitals and spaces is refused");
  kiln_clear_error();
  static kiln__backend clash;
  clash = *h_testdev_backend();
  clash.name = "cuda";
  H_CHECK((int)kiln__backend_register(&clash) == -1 && kiln_last_error() == KILN_ERR_STATE,
          "a run-time backend may not call itself cuda");
  kiln_clear_error();
  clash.name = "testdev";
  H_CHECK((int)kiln__backend_register(&clash) == -1 && kiln_last_error() == KILN_ERR_STATE,
          "a second backend named testdev is refused");
  kiln_clear_error();
  clash.name = "cpu2";
  clash.type = KILN_DEVICE_CPU;
  H_CHECK((int)kiln__backend_register(&clash) == -1 && kiln_last_error() == KILN_ERR_STATE,
          "a named type that is taken is refused");
  kiln_clear_error();
}

static void test_parse_print(void) {
  kiln_device d;
  char buf[32];
  H_CHECK(kiln_device_parse("testdev", &d) == KILN_OK && kiln_device_equal(d, TD), "parse testdev");
  H_CHECK(kiln_device_parse("testdev:0", &d) == KILN_OK && kiln_device_equal(d, TD), "parse testdev:0");
  H_CHECK(strcmp(kiln_device_str(TD, buf, sizeof buf), "testdev:0") == 0, "prints testdev:0 (%s)", buf);
  H_EXPECT_ERR(kiln_device_parse("testdev:1", &d) == KILN_OK, KILN_ERR_DEVICE, "testdev:1 does not exist");
  kiln_device_parse("testdev:1", &d);
  H_CHECK(strstr(kiln_last_error_message(), "no device testdev:1") != NULL, "says which: %s",
          kiln_last_error_message());
  kiln_clear_error();
  kiln_device_parse("testdevx", &d);
  H_CHECK(strstr(kiln_last_error_message(), "testdev or testdev:N") != NULL &&
              strstr(kiln_last_error_message(), "cuda or cuda:N") != NULL,
          "the forms listed: %s", kiln_last_error_message());
  kiln_clear_error();
  H_EXPECT_ERR(kiln_device_parse("testdev:x", &d) == KILN_OK, KILN_ERR_DEVICE, "testdev:x");
  H_CHECK(kiln_device_parse("cpu", &d) == KILN_OK && d.type == KILN_DEVICE_CPU, "cpu still parses");
  if (!kiln_backend_available(KILN_DEVICE_CUDA, NULL)) {
    H_EXPECT_ERR(kiln_device_parse("cuda:0", &d) == KILN_OK, KILN_ERR_DEVICE, "cuda:0 without cuda");
    H_CHECK(kiln_device_best().type == KILN_DEVICE_CPU, "a test backend is never the best device");
  }
  kiln_device_info info;
  H_CHECK(kiln_device_info_get(TD, &info) == KILN_OK && strcmp(info.name, "testdev device") == 0,
          "device info without the entry: the name");
  double h, w;
  H_EXPECT_ERR(kiln_device_bandwidth(TD, &h, &w) == KILN_OK, KILN_ERR_UNSUPPORTED, "no bandwidth entry");
}

static void test_round_trip(void) {
  kiln_scope_begin();
  kiln_memory_stats m0, m1, m2;
  kiln_memory_stats_get(TD, &m0);
  kiln_tensor *x = on_td(A6, KILN_F32);
  H_CHECK(x && kiln_device_equal(kiln_device_of(x), TD), "to_device lands on testdev");
  kiln_memory_stats_get(TD, &m1);
  H_CHECK(m1.allocated == m0.allocated + 24 && m1.num_allocs > m0.num_allocs, "its own memory stats (%lld)",
          (long long)m1.allocated);
  H_CHECK(kiln_data_ptr(x) == NULL && kiln_last_error() == KILN_ERR_DEVICE, "not host-visible");
  kiln_clear_error();
  h_tensor_close("round trip f32", kiln_to_device(x, kiln_device_cpu()), A6, 6, 0, 0);
  h_tensor_close("round trip via f64 on testdev", kiln_to_dtype(x, KILN_F64), A6, 6, 0, 0);
  kiln_tensor *xi = kiln_to_device(h_tensor(A6, 1, (const int64_t[]){6}, KILN_I64), TD);
  double want_i[6] = {1, -2, 3, 0, 0, 7}; /* h_tensor truncates */
  h_tensor_close("round trip i64", xi, want_i, 6, 0, 0);
  H_CHECK(kiln_item(kiln_sum_all(x)) == 9.25, "item of a testdev sum");
  kiln_scope_end();
  kiln_memory_stats_get(TD, &m2);
  H_CHECK(m2.allocated == m0.allocated, "freed (%lld)", (long long)m2.allocated);
}

static void test_native(void) {
  kiln_scope_begin();
  kiln_set_fallback_policy(KILN_FALLBACK_ERROR); /* native kernels must not need it */
  kiln_fallback_reset();
  H_CHECK(kiln__dispatch_has(TD, NULL, KILN__K_ADD) && !kiln__dispatch_has(TD, NULL, KILN__K_EXP),
          "dispatch_has: add yes, exp no");
  kiln_tensor *a = on_td(A6, KILN_F32), *b = on_td(B6, KILN_F32);
  h_testdev_reset_calls();
  kiln_tensor *c = kiln_add(a, b), *p = kiln_mul(a, b), *r = kiln_relu(a);
  kiln_tensor *s = kiln_sum(a, KILN_DIMS(1), false);
  H_CHECK(h_testdev_calls(KILN__K_ADD) == 1 && h_testdev_calls(KILN__K_MUL) == 1 &&
              h_testdev_calls(KILN__K_RELU) == 1 && h_testdev_calls(KILN__K_SUM) == 1,
          "add, mul, relu, sum ran on testdev's own kernels");
  double wc[6], wp[6], wr[6], ws[2] = {A6[0] + A6[1] + A6[2], A6[3] + A6[4] + A6[5]};
  for (int i = 0; i < 6; i++) wc[i] = A6[i] + B6[i], wp[i] = A6[i] * B6[i], wr[i] = A6[i] > 0 ? A6[i] : 0;
  h_tensor_close("add", c, wc, 6, 0, 0);
  h_tensor_close("mul", p, wp, 6, 0, 0);
  h_tensor_close("relu", r, wr, 6, 0, 0);
  h_tensor_close("sum", s, ws, 2, 0, 0);
  /* a broadcast and a strided view, still native */
  kiln_tensor *row = kiln_to_device(h_tensor(B6, 1, (const int64_t[]){3}, KILN_F32), TD);
  kiln_tensor *bt = kiln_add(kiln_transpose(a, 0, 1), kiln_transpose(a, 0, 1));
  double wb[6];
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 2; j++) wb[i * 2 + j] = 2 * A6[j * 3 + i];
  h_tensor_close("add of transposed views", bt, wb, 6, 0, 0);
  double wrow[6];
  for (int i = 0; i < 6; i++) wrow[i] = A6[i] + B6[i % 3];
  h_tensor_close("add with a broadcast row", kiln_add(a, row), wrow, 6, 0, 0);
  H_CHECK(kiln_fallback_stats(NULL, 0) == 0, "nothing fell back");
  kiln_set_fallback_policy(KILN_FALLBACK_SILENT);
  kiln_scope_end();
}

static void test_fallback(void) {
  kiln_scope_begin();
  kiln_set_fallback_policy(KILN_FALLBACK_SILENT);
  kiln_fallback_reset();
  kiln_tensor *a = on_td(A6, KILN_F32);
  kiln_tensor *e = kiln_exp(kiln_transpose(a, 0, 1)); /* staged through testdev's COPY */
  double we[6];
  for (int i = 0; i < 3; i++)
    for (int j = 0; j < 2; j++) we[i * 2 + j] = exp(A6[j * 3 + i]);
  H_CHECK(e && kiln_device_equal(kiln_device_of(e), TD), "exp's result stays on testdev");
  h_tensor_close("exp (fallback)", e, we, 6, 1e-6, 1e-6);
  /* f16 add: the kernel exists but supports() turns f16 away */
  kiln_tensor *h16 = on_td(A6, KILN_F16);
  double w2[6];
  for (int i = 0; i < 6; i++) w2[i] = 2 * A6[i];
  h_tensor_close("f16 add (fallback)", kiln_add(h16, h16), w2, 6, 0, 0);
  kiln_fallback_entry fe[16];
  int n = kiln_fallback_stats(fe, 16);
  const kiln_fallback_entry *fx = find_fb(fe, n, "exp"), *fa = find_fb(fe, n, "add");
  H_CHECK(fx && fx->count == 1 && strcmp(fx->device, "testdev") == 0, "exp counted as testdev's fallback");
  H_CHECK(fa && fa->count == 1, "f16 add counted");
  /* a test hook: disabling a kernel makes it fall back */
  kiln__dispatch_disable_kernel(TD.type, KILN__K_MUL, true);
  h_testdev_reset_calls();
  kiln_tensor *m = kiln_mul(a, a);
  kiln__dispatch_disable_kernel(TD.type, KILN__K_MUL, false);
  double wm[6];
  for (int i = 0; i < 6; i++) wm[i] = A6[i] * A6[i];
  h_tensor_close("mul disabled (fallback)", m, wm, 6, 0, 0);
  H_CHECK(h_testdev_calls(KILN__K_MUL) == 0, "the disabled kernel did not run");

  /* autograd on testdev: relu's and mul's backward use kernels it lacks */
  kiln_tensor *w = on_td(B6, KILN_F64);
  kiln_requires_grad_(w, true);
  kiln_tensor *x = on_td(A6, KILN_F64);
  kiln_tensor *loss = kiln_sum_all(kiln_relu(kiln_mul(x, w)));
  H_CHECK(kiln_backward(loss, NULL) == KILN_OK, "backward on testdev");
  double wg[6];
  for (int i = 0; i < 6; i++) wg[i] = A6[i] * B6[i] > 0 ? A6[i] : 0;
  h_tensor_close("grad of w", kiln_grad(w), wg, 6, 0, 0);
  H_CHECK(kiln_device_equal(kiln_device_of(kiln_grad(w)), TD), "the gradient is on testdev");
  kiln_scope_end();
}

static void test_fallback_error(void) {
  kiln_scope_begin();
  kiln_set_fallback_policy(KILN_FALLBACK_ERROR);
  kiln_tensor *a = on_td(A6, KILN_F32);
  H_EXPECT_ERR(kiln_exp(a) != NULL, KILN_ERR_UNSUPPORTED, "exp on testdev under KILN_FALLBACK=error");
  kiln_exp(a);
  const char *msg = kiln_last_error_message();
  H_CHECK(strstr(msg, "'exp'") && strstr(msg, "testdev:0") && strstr(msg, "float32"),
          "the error names the op, the device and the dtype: %s", msg);
  kiln_clear_error();
  H_CHECK(kiln_add(a, a) != NULL, "its own kernels still run under error");
  kiln_set_fallback_policy(KILN_FALLBACK_SILENT);
  kiln_scope_end();
}

static int steps;
static kiln_status step(void *ctx) {
  kiln_tensor *t = ctx;
  steps++;
  return kiln_mul_scalar_(t, 2.0);
}

static void test_optional_entries(void) {
  kiln_scope_begin();
  kiln_tensor *t = kiln_keep(on_td(A6, KILN_F32));
  kiln_graph *g = kiln_graph_capture(TD, step, t);
  H_CHECK(g && !kiln_graph_is_device_graph(g), "capture without graph entries: a host graph");
  H_CHECK(kiln_graph_replay(g) == KILN_OK && kiln_graph_replay(g) == KILN_OK, "replay runs the step");
  double w4[6];
  for (int i = 0; i < 6; i++) w4[i] = 4 * A6[i];
  H_CHECK(steps == 2, "the step ran at each replay (%d)", steps);
  h_tensor_close("after two replays", t, w4, 6, 0, 0);
  kiln_graph_free(g);
  kiln_mark *m0 = kiln_mark_record(TD), *m1 = kiln_mark_record(TD);
  H_CHECK(m0 && m1 && kiln_mark_elapsed_ms(m0, m1) >= 0, "marks without timing entries: host time");
  H_CHECK(kiln_device_synchronize(TD) == KILN_OK, "synchronize");
  kiln_tensor_free(t);
  kiln_scope_end();
}

int main(int argc, char **argv) {
  /* the environment variable, read once at the first use of the policy */
  setenv("KILN_FALLBACK", "error", 1);
  h_init(argc, argv, "test_backend_registry");
  H_CHECK(kiln_fallback_policy_get() == KILN_FALLBACK_ERROR, "KILN_FALLBACK=error is read");
  TD = h_testdev_device();
  test_register();
  test_fallback_error();
  test_parse_print();
  test_round_trip();
  test_native();
  test_fallback();
  test_fallback_error();
  test_optional_entries();
  H_CHECK(kiln_live_tensors() == 0, "no live tensors (%lld)", (long long)kiln_live_tensors());
  return h_finish();
}
