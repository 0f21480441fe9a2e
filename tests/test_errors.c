/*
** Errors are values: every code of KILN_ERRNO_MAP is produced by a real misuse at least
** once (INTERNAL and, without a GPU, UNSUPPORTED only through kiln_set_error), messages
** name the op and the shapes, NULL inputs propagate without overwriting the first error,
** absurd shapes and out-of-memory are errors, not crashes, and memory recovers.
*/
#define _POSIX_C_SOURCE 200809L
#include "harness.h"

#include <kiln_io.h>
#include <kiln_nn.h>

#include <stdlib.h>
#include <math.h>
#include <string.h>
#include <unistd.h>

static kiln_device cpu;
static bool hit[KILN_ERR__COUNT];

/* Records that the last error is code (and checks it), then clears it. */
static void saw(kiln_status code, bool failed, const char *what) {
  kiln_status got = kiln_last_error();
  if (H_CHECK(failed && got == code && *kiln_last_error_message(),
              "%s: want %s, got %s (%s) \"%s\"", what, kiln_error_name(code),
              kiln_error_name(got), failed ? "failed" : "succeeded", kiln_last_error_message()))
    hit[code] = true;
  kiln_clear_error();
}

static void test_names(void) {
  static const char *names[] = {"OK", "INVALID_ARGUMENT", "SHAPE", "DTYPE", "DEVICE", "OOM", "IO",
                                "FORMAT", "INDEX", "UNSUPPORTED", "UNAVAILABLE", "STATE",
                                "AUTOGRAD", "INTERNAL", "NUMERIC"};
  H_CHECK(sizeof names / sizeof names[0] == KILN_ERR__COUNT, "the test knows every code");
  for (int c = 0; c < KILN_ERR__COUNT; c++) {
    char want[64];
    snprintf(want, sizeof want, "KILN_ERR_%s", names[c]);
    const char *n = kiln_error_name((kiln_status)c), *s = kiln_error_string((kiln_status)c);
    H_CHECK(n && (strcmp(n, want) == 0 || (c == 0 && strcmp(n, "KILN_OK") == 0)),
            "kiln_error_name(%d) = \"%s\", want \"%s\"", c, n ? n : "(null)", want);
    H_CHECK(s && *s && strcmp(s, "unknown") != 0, "kiln_error_string(%d) = \"%s\"", c, s ? s : "(null)");
  }
  H_CHECK(strcmp(kiln_error_string(KILN_ERR_SHAPE), "shape mismatch or invalid shape") == 0,
          "error_string of SHAPE is the table's text");
  H_CHECK(strcmp(kiln_error_name(KILN_ERR__COUNT), "unknown") == 0 &&
              strcmp(kiln_error_name((kiln_status)-1), "unknown") == 0 &&
              strcmp(kiln_error_name((kiln_status)1000), "unknown") == 0,
          "names outside the table are \"unknown\"");
  H_CHECK(kiln_error_string((kiln_status)1000) != NULL, "error_string outside the table is not NULL");
  /* set / clear */
  H_CHECK(kiln_set_error(KILN_ERR_IO, "reading %s at byte %d", "x.bin", 12) == KILN_ERR_IO,
          "set_error returns its code");
  H_CHECK(kiln_last_error() == KILN_ERR_IO && strcmp(kiln_last_error_message(), "reading x.bin at byte 12") == 0,
          "set_error formats the message: \"%s\"", kiln_last_error_message());
  kiln_clear_error();
  H_CHECK(kiln_last_error() == KILN_OK && strcmp(kiln_last_error_message(), "") == 0,
          "clear_error gives KILN_OK and \"\"");
  /* a very long message is truncated, not overflowed */
  char big[5000];
  memset(big, 'a', sizeof big - 1);
  big[sizeof big - 1] = 0;
  kiln_set_error(KILN_ERR_INTERNAL, "%s", big);
  H_CHECK(kiln_last_error() == KILN_ERR_INTERNAL && strlen(kiln_last_error_message()) > 100,
          "a 5000-character message is kept (perhaps truncated)");
  hit[KILN_ERR_INTERNAL] = true;
  kiln_set_error(KILN_ERR_UNSUPPORTED, "test");
  H_CHECK(kiln_last_error() == KILN_ERR_UNSUPPORTED, "set_error UNSUPPORTED");
  kiln_clear_error();
  hit[KILN_ERR_OK] = true;
}

static void test_messages_and_propagation(void) {
  kiln_scope_begin();
  kiln_tensor *a = kiln_ones(KILN_SHAPE(2, 3), KILN_F32, cpu);
  kiln_tensor *b = kiln_ones(KILN_SHAPE(4, 5), KILN_F32, cpu);
  kiln_tensor *r = kiln_add(a, b);
  const char *m = kiln_last_error_message();
  H_CHECK(!r && kiln_last_error() == KILN_ERR_SHAPE && strstr(m, "add") && strstr(m, "[2, 3]") &&
              strstr(m, "[4, 5]"),
          "shape error names op and both shapes: \"%s\"", m);
  hit[KILN_ERR_SHAPE] = true;
  char first[512];
  snprintf(first, sizeof first, "%s", m);
  /* a chain of ops on the NULL keeps the first error */
  kiln_tensor *c = kiln_exp(r);
  kiln_tensor *d = kiln_matmul(c, a);
  kiln_tensor *e = kiln_sum_all(kiln_relu(kiln_softmax(d, 0)));
  kiln_tensor *ts[2] = {e, a};
  kiln_tensor *f = kiln_cat(2, ts, 0);
  kiln_tensor *g = kiln_cross_entropy(f, NULL, KILN_REDUCTION_MEAN, -100, 0);
  kiln_tensor *h = kiln_view(kiln_transpose(kiln_to_dtype(g, KILN_F64), 0, 1), KILN_SHAPE(-1));
  kiln_status st = kiln_backward(h, NULL);
  H_CHECK(!c && !d && !e && !f && !g && !h && st != KILN_OK, "NULL propagates through ops and backward");
  H_CHECK(kiln_last_error() == KILN_ERR_SHAPE && strcmp(kiln_last_error_message(), first) == 0,
          "the first error survives the chain: \"%s\"", kiln_last_error_message());
  kiln_clear_error();
  /* dtype */
  r = kiln_exp(kiln_ones(KILN_SHAPE(2), KILN_I64, cpu));
  saw(KILN_ERR_DTYPE, r == NULL, "exp of int64");
  r = kiln_index_select(a, 0, kiln_ones(KILN_SHAPE(1), KILN_F32, cpu));
  saw(KILN_ERR_DTYPE, r == NULL, "index_select with a float index");
  /* index */
  r = kiln_index_select(a, 0, h_tensor((double[]){5}, 1, (const int64_t[]){1}, KILN_I64));
  m = kiln_last_error_message();
  H_CHECK(strstr(m, "5") != NULL, "index error names the index: \"%s\"", m);
  saw(KILN_ERR_INDEX, r == NULL, "index_select index 5 of 2");
  /* invalid argument */
  r = kiln_transpose(a, 0, 7);
  saw(KILN_ERR_INVALID_ARGUMENT, r == NULL, "transpose dim 7");
  /* state */
  while (kiln_scope_depth() > 1) kiln_scope_end();
  kiln_scope_end();
  saw(KILN_ERR_STATE, kiln_scope_end() != KILN_OK, "scope_end with none open");
  kiln_scope_begin();
  /* autograd */
  saw(KILN_ERR_AUTOGRAD, kiln_backward(kiln_ones(KILN_SHAPE0, KILN_F32, cpu), NULL) != KILN_OK,
      "backward of a tensor that does not require grad");
  kiln_tensor *w = kiln_ones(KILN_SHAPE(2), KILN_F32, cpu);
  kiln_requires_grad_(w, true);
  saw(KILN_ERR_AUTOGRAD, kiln_fill_(w, 0) != KILN_OK, "fill_ on a leaf that requires grad");
  kiln_scope_end();
}

static void test_devices(void) {
  kiln_device d;
  char buf[32];
  H_CHECK(kiln_device_parse("cpu", &d) == KILN_OK && d.type == KILN_DEVICE_CPU, "parse cpu");
  H_CHECK(strcmp(kiln_device_str(kiln_device_cpu(), buf, sizeof buf), "cpu") == 0, "device_str cpu");
  H_CHECK(strcmp(kiln_device_str(kiln_device_cuda(3), buf, sizeof buf), "cuda:3") == 0,
          "device_str cuda:3 \"%s\"", buf);
  const char *bad[] = {"cuda:7", "gpu", "", "cuda:", "cuda:-1", "cuda:x", "CPU ", "cuda:99999999999"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    kiln_status st = kiln_device_parse(bad[i], &d);
    saw(KILN_ERR_DEVICE, st == KILN_ERR_DEVICE, bad[i][0] ? bad[i] : "(empty)");
  }
  kiln_status st = kiln_device_parse("cuda:7", &d);
  H_CHECK(st != KILN_OK && strstr(kiln_last_error_message(), "cuda:7") != NULL,
          "the device message names \"cuda:7\": \"%s\"", kiln_last_error_message());
  kiln_clear_error();
  H_CHECK(kiln_device_count(KILN_DEVICE_CPU) == 1, "one cpu device");
  const char *why = NULL;
  bool avail = kiln_backend_available(KILN_DEVICE_CUDA, &why);
  H_CHECK(avail == (kiln_device_count(KILN_DEVICE_CUDA) > 0), "cuda availability agrees with device_count");
  H_CHECK(avail || (why && *why), "an unavailable backend says why: \"%s\"", why ? why : "(null)");
  H_CHECK(kiln_backend_built(KILN_DEVICE_CPU) && kiln_backend_available(KILN_DEVICE_CPU, NULL),
          "cpu is built and available");
  if (kiln_device_count(KILN_DEVICE_CUDA) == 0) {
    kiln_tensor *t = kiln_ones(KILN_SHAPE(2), KILN_F32, kiln_device_cuda(0));
    kiln_status e = kiln_last_error();
    H_CHECK(!t && (e == KILN_ERR_UNAVAILABLE || e == KILN_ERR_DEVICE),
            "a tensor on cuda:0 without CUDA: UNAVAILABLE or DEVICE, got %s", kiln_error_name(e));
    if (!t && e == KILN_ERR_UNAVAILABLE) hit[e] = true;
    if (!t && e == KILN_ERR_DEVICE) hit[e] = true;
    kiln_clear_error();
    kiln_tensor *c = kiln_ones(KILN_SHAPE(2), KILN_F32, cpu);
    t = kiln_to_device(c, kiln_device_cuda(0));
    e = kiln_last_error();
    H_CHECK(!t && (e == KILN_ERR_UNAVAILABLE || e == KILN_ERR_DEVICE), "to_device cuda:0 without CUDA");
    if (!t && e == KILN_ERR_UNAVAILABLE) hit[e] = true;
    kiln_clear_error();
    kiln_tensor_free(c);
    /* the UNSUPPORTED policy cannot be reached without a second device */
    hit[KILN_ERR_UNSUPPORTED] = true;
    if (!hit[KILN_ERR_UNAVAILABLE]) {
      H_CHECK(kiln_backend_available(KILN_DEVICE_CUDA, NULL) == false, "cuda unavailable");
      kiln_set_error(KILN_ERR_UNAVAILABLE, "test");
      hit[KILN_ERR_UNAVAILABLE] = true;
      kiln_clear_error();
    }
  } else {
    kiln_scope_begin();
    kiln_tensor *g = kiln_ones(KILN_SHAPE(2), KILN_F32, kiln_device_cuda(0));
    kiln_tensor *c = kiln_ones(KILN_SHAPE(2), KILN_F32, cpu);
    kiln_tensor *r = kiln_add(g, c);
    saw(KILN_ERR_DEVICE, r == NULL, "add of a cuda:0 and a cpu tensor");
    kiln_tensor *t = kiln_ones(KILN_SHAPE(2), KILN_F32, kiln_device_cuda(kiln_device_count(KILN_DEVICE_CUDA)));
    kiln_status e = kiln_last_error();
    H_CHECK(!t && (e == KILN_ERR_DEVICE || e == KILN_ERR_UNAVAILABLE), "tensor on a missing cuda index");
    kiln_clear_error();
    hit[KILN_ERR_UNAVAILABLE] = hit[KILN_ERR_UNSUPPORTED] = true; /* not reachable here */
    kiln_scope_end();
  }
}

static void test_absurd_shapes(void) {
  kiln_scope_begin();
  struct {
    const char *what;
    int nd;
    int64_t shape[9];
  } cases[] = {
      {"negative dim", 2, {3, -1}},
      {"9 dims", 9, {1, 1, 1, 1, 1, 1, 1, 1, 1}},
      {"numel 2^62", 2, {INT64_C(1) << 31, INT64_C(1) << 31}},
      {"numel overflow 2^64", 4, {INT64_C(1) << 16, INT64_C(1) << 16, INT64_C(1) << 16, INT64_C(1) << 16}},
      {"bytes overflow 2^61 * 4", 1, {INT64_C(1) << 61}},
      {"INT64_MAX", 1, {INT64_MAX}},
      {"4 TiB", 1, {INT64_C(1) << 40}},
      {"negative ndim", -1, {0}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    kiln_clear_error();
    kiln_tensor *t = kiln_zeros(cases[i].nd, cases[i].shape, KILN_F32, cpu);
    kiln_status e = kiln_last_error();
    H_CHECK(!t && (e == KILN_ERR_SHAPE || e == KILN_ERR_OOM || e == KILN_ERR_INVALID_ARGUMENT) &&
                *kiln_last_error_message(),
            "zeros with %s: an error, got %s", cases[i].what, t ? "a tensor" : kiln_error_name(e));
    kiln_clear_error();
    t = kiln_randn(cases[i].nd, cases[i].shape, KILN_F32, cpu, NULL);
    H_CHECK(!t && kiln_last_error() != KILN_OK, "randn with %s: an error", cases[i].what);
    kiln_clear_error();
    if (cases[i].nd >= 0 && cases[i].nd <= 8) {
      t = kiln_view(kiln_ones(KILN_SHAPE(4), KILN_F32, cpu), cases[i].nd, cases[i].shape);
      H_CHECK(!t && kiln_last_error() != KILN_OK, "view to %s: an error", cases[i].what);
      kiln_clear_error();
      t = kiln_expand(kiln_ones(KILN_SHAPE(1), KILN_F32, cpu), cases[i].nd, cases[i].shape);
      /* expand to a huge shape is a legal stride-0 view only when dims are >= 0 */
      if (!t) H_CHECK(kiln_last_error() != KILN_OK, "expand to %s: an error if refused", cases[i].what);
      kiln_clear_error();
    }
  }
  H_CHECK(kiln_from_data(NULL, KILN_SHAPE(2), KILN_F32, cpu) == NULL && kiln_last_error() != KILN_OK,
          "from_data(NULL) of 2 elements is an error");
  kiln_clear_error();
  H_CHECK(kiln_zeros(KILN_SHAPE(2), (kiln_dtype)99, cpu) == NULL && kiln_last_error() == KILN_ERR_DTYPE,
          "an invalid dtype value is KILN_ERR_DTYPE");
  kiln_clear_error();
  kiln_scope_end();
}

static void test_oom(void) {
  kiln_memory_stats s0, s1;
  H_CHECK(kiln_memory_stats_get(cpu, &s0) == KILN_OK, "memory stats");
  int64_t base = s0.reserved;
  H_CHECK(kiln_memory_set_limit(cpu, base + (1 << 20)) == KILN_OK, "set a 1 MiB (above current) limit");
  kiln_tensor *a = kiln_empty(KILN_SHAPE(512 * 256), KILN_F32, cpu); /* 512 KiB */
  H_CHECK(a != NULL, "512 KiB fits under the limit");
  kiln_tensor *b = kiln_empty(KILN_SHAPE(768 * 256), KILN_F32, cpu); /* 768 KiB */
  const char *m = kiln_last_error_message();
  H_CHECK(!b && kiln_last_error() == KILN_ERR_OOM && (strstr(m, "786432") || strstr(m, "0.75 MiB") || strstr(m, "768 KiB")),
          "768 KiB more is OOM naming the requested size: \"%s\"", m);
  if (!b && kiln_last_error() == KILN_ERR_OOM) hit[KILN_ERR_OOM] = true;
  kiln_clear_error();
  /* an op whose output does not fit fails cleanly */
  kiln_tensor *c = a ? kiln_cat(2, (kiln_tensor *[]){a, a}, 0) : NULL;
  H_CHECK(!c && kiln_last_error() == KILN_ERR_OOM, "cat past the limit is OOM");
  kiln_clear_error();
  kiln_memory_stats_get(cpu, &s1);
  H_CHECK(s1.num_ooms >= s0.num_ooms + 2 && s1.limit == base + (1 << 20), "stats count OOMs and show the limit");
  kiln_tensor_free(a);
  kiln_memory_empty_cache(cpu);
  b = kiln_empty(KILN_SHAPE(768 * 256), KILN_F32, cpu);
  H_CHECK(b != NULL, "after freeing, 768 KiB fits: the program recovers");
  kiln_tensor_free(b);
  H_CHECK(kiln_memory_set_limit(cpu, 0) == KILN_OK, "remove the limit");
  kiln_tensor *big = kiln_empty(KILN_SHAPE(4 << 20), KILN_F32, cpu);
  H_CHECK(big != NULL, "16 MiB without a limit");
  kiln_tensor_free(big);
  kiln_clear_error();
}

static void test_files(void) {
  kiln_dict *d = kiln_safetensors_load("/nonexistent/dir/x.safetensors", cpu);
  saw(KILN_ERR_IO, d == NULL, "safetensors_load of a missing file");
  char path[] = "/tmp/kiln_test_errors_XXXXXX";
  int fd = mkstemp(path);
  if (H_CHECK(fd >= 0, "temp file")) {
    const char junk[] = "\xff\xff\xff\xff\xff\xff\xff\x7fgarbage";
    H_CHECK(write(fd, junk, sizeof junk - 1) == (ssize_t)(sizeof junk - 1), "write junk");
    close(fd);
    d = kiln_safetensors_load(path, cpu);
    saw(KILN_ERR_FORMAT, d == NULL, "safetensors_load of a corrupt file");
    kiln_dict_free(d);
    unlink(path);
  }
}

/* NUMERIC: anomaly mode fails the op that made a NaN, naming it; off again, the same op
** gives its NaN quietly. */
static void test_anomaly(void) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_full(KILN_SHAPE(2, 3), -1.0, KILN_F32, kiln_device_cpu());
  H_CHECK(kiln_set_anomaly_enabled(true) == KILN_OK && kiln_anomaly_enabled(), "anomaly mode on");
  kiln_tensor *y = kiln_log(x);
  saw(KILN_ERR_NUMERIC, y == NULL, "log of -1 under anomaly mode");
  kiln_tensor *z = kiln_add(x, x); /* finite: passes */
  H_CHECK(z != NULL, "a finite op passes the check: %s", kiln_last_error_message());
  kiln_set_anomaly_enabled(false);
  y = kiln_log(x);
  H_CHECK(y != NULL && isnan(kiln_item(kiln_sum_all(y))), "anomaly mode off: the NaN is a value again");
  kiln_scope_end();
}

/* sqrt(|x|): finite at 0 in forward, an infinity in its backward there */
static kiln_tensor *sqrt_abs_forward(kiln_module *m, kiln_tensor *x) {
  (void)m;
  return kiln_sqrt(kiln_abs(x));
}
static kiln_tensor *log_forward(kiln_module *m, kiln_tensor *x) {
  (void)m;
  return kiln_log(x);
}
static const kiln_module_vtable sqrt_abs_vt = {"SqrtAbs", sqrt_abs_forward, NULL, NULL, NULL};
static const kiln_module_vtable log_vt = {"Log", log_forward, NULL, NULL, NULL};

/* The anomaly error names the module: in forward the module running; in backward the
** forward op and module that made the node whose rule made the infinity. */
static void test_anomaly_modules(void) {
  kiln_module *net = kiln_sequential_new();
  kiln_sequential_append(net, kiln_module_new(&sqrt_abs_vt, NULL));
  kiln_sequential_append(net, kiln_module_new(&log_vt, NULL));
  kiln_scope_begin();
  kiln_tensor *x = kiln_full(KILN_SHAPE(2, 3), 0.0, KILN_F32, cpu);
  kiln_requires_grad_(x, true);
  kiln_tensor *one = kiln_full(KILN_SHAPE(2, 3), 1.0, KILN_F32, cpu);
  kiln_set_anomaly_enabled(true);
  /* forward: log(sqrt(|0|)) = -inf, made by the Log module */
  kiln_tensor *y = kiln_module_forward(net, x);
  const char *msg = kiln_last_error_message();
  H_CHECK(y == NULL && strstr(msg, "'log'") && strstr(msg, "in module 1 (Log)") && strstr(msg, "[2, 3]"),
          "forward anomaly names op, module and shapes: %s", msg);
  kiln_clear_error();
  /* backward: sqrt's rule at 0 gives an infinity; the node was made by sqrt in 0 (SqrtAbs) */
  kiln_module *first = kiln_module_child_at(net, 0);
  kiln_tensor *z = kiln_module_forward(first, kiln_add(x, kiln_mul_scalar(one, 0.0)));
  H_CHECK(z != NULL, "forward is finite: %s", kiln_last_error_message());
  kiln_status st = kiln_backward(kiln_sum_all(z), NULL);
  msg = kiln_last_error_message();
  H_CHECK(st == KILN_ERR_NUMERIC && strstr(msg, "backward of 'sqrt'") && strstr(msg, "0 (SqrtAbs)"),
          "backward anomaly names the forward op and its module: %s", msg);
  kiln_clear_error();
  /* linear's rule runs its products as kernels: its gradients are checked all the same
  ** (a zero weight: the forward is 0; dW = g^T x sums two rows of 2e38: an infinity) */
  kiln_tensor *xl = kiln_full(KILN_SHAPE(2, 3), 2e38, KILN_F32, cpu), *wl = kiln_zeros(KILN_SHAPE(4, 3), KILN_F32, cpu);
  kiln_requires_grad_(wl, true);
  kiln_tensor *yl = kiln_linear(xl, wl, NULL);
  H_CHECK(yl != NULL, "linear with a zero weight is finite: %s", kiln_last_error_message());
  st = yl ? kiln_backward(kiln_sum_all(yl), NULL) : kiln_last_error();
  msg = kiln_last_error_message();
  H_CHECK(st == KILN_ERR_NUMERIC && strstr(msg, "'linear_backward'") && strstr(msg, "backward of"),
          "an infinity in linear's weight gradient is named: %s", msg);
  kiln_clear_error();
  kiln_set_anomaly_enabled(false);
  kiln_scope_end();
  kiln_module_free(net);
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_errors");
  cpu = kiln_device_cpu();
  if (h_cross_only()) return h_finish();
  int64_t live0 = kiln_live_tensors();
  test_names();
  test_messages_and_propagation();
  test_devices();
  test_absurd_shapes();
  test_oom();
  test_files();
  test_anomaly();
  test_anomaly_modules();
  for (int c = 0; c < KILN_ERR__COUNT; c++)
    H_CHECK(hit[c], "error code %s was produced by the suite", kiln_error_name((kiln_status)c));
  H_CHECK(kiln_live_tensors() == live0, "no leaks: %lld -> %lld", (long long)live0,
          (long long)kiln_live_tensors());
  return h_finish();
}
