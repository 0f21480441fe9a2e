/*
** Tensor creation, accessors, reading values, dtype conversion (f16/bf16 rounding,
** float->int truncation, bool), contiguous, clone, to_device cpu->cpu.
*/
#define _POSIX_C_SOURCE 200809L /* nanosleep: clang does not get it by default */
#include "harness.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

static kiln_device cpu;

static bool values_are(kiln_tensor *t, const double *want, int64_t n) {
  return h_tensor_close(kiln_shape_str(t, (char[64]){0}, 64), t, want, n, 0, 0);
}

static void test_creation(void) {
  kiln_scope_begin();
  kiln_tensor *e = kiln_empty(KILN_SHAPE(2, 3), KILN_F32, cpu);
  H_CHECK(e && kiln_ndim(e) == 2 && kiln_size(e, 0) == 2 && kiln_size(e, -1) == 3 &&
              kiln_numel(e) == 6 && kiln_nbytes(e) == 24 && kiln_dtype_of(e) == KILN_F32 &&
              kiln_is_contiguous(e) && kiln_device_equal(kiln_device_of(e), cpu),
          "empty [2,3] f32 accessors");
  H_CHECK(e && kiln_strides(e)[0] == 3 && kiln_strides(e)[1] == 1, "contiguous strides [3, 1]");
  char buf[64];
  H_CHECK(strcmp(kiln_shape_str(e, buf, sizeof buf), "[2, 3]") == 0, "shape_str \"%s\"", buf);
  H_CHECK(strcmp(kiln_shape_str(NULL, buf, sizeof buf), "(null)") == 0, "shape_str NULL");
  values_are(kiln_zeros(KILN_SHAPE(2, 2), KILN_I32, cpu), (double[]){0, 0, 0, 0}, 4);
  values_are(kiln_ones(KILN_SHAPE(3), KILN_BF16, cpu), (double[]){1, 1, 1}, 3);
  values_are(kiln_full(KILN_SHAPE(2), -2.5, KILN_F16, cpu), (double[]){-2.5, -2.5}, 2);
  kiln_tensor *s = kiln_scalar(3.25, KILN_F64, cpu);
  H_CHECK(s && kiln_ndim(s) == 0 && kiln_numel(s) == 1 && kiln_item(s) == 3.25, "scalar 3.25");
  kiln_tensor *z0 = kiln_zeros(KILN_SHAPE0, KILN_F32, cpu);
  H_CHECK(z0 && kiln_ndim(z0) == 0 && kiln_item(z0) == 0, "zeros with ndim 0 and shape NULL");
  kiln_tensor *b = kiln_ones(KILN_SHAPE(2, 0, 3), KILN_F32, cpu);
  H_CHECK(b && kiln_numel(b) == 0 && kiln_nbytes(b) == 0, "a [2, 0, 3] tensor has no elements");
  kiln_tensor *t = kiln_full(KILN_SHAPE(2, 3), 4, KILN_I64, cpu);
  kiln_tensor *zl = kiln_zeros_like(t), *ol = kiln_ones_like(t), *fl = kiln_full_like(t, 9);
  H_CHECK(zl && ol && fl && kiln_dtype_of(zl) == KILN_I64 && kiln_numel(ol) == 6 &&
              kiln_get(fl, (int64_t[]){1, 2}) == 9 && kiln_get(ol, (int64_t[]){0, 0}) == 1 &&
              kiln_get(zl, (int64_t[]){1, 1}) == 0,
          "zeros_like / ones_like / full_like keep shape and dtype");

  values_are(kiln_arange(0, 5, 1, KILN_I64, cpu), (double[]){0, 1, 2, 3, 4}, 5);
  values_are(kiln_arange(1, 2, 0.25, KILN_F32, cpu), (double[]){1, 1.25, 1.5, 1.75}, 4);
  values_are(kiln_arange(5, 0, -2, KILN_F64, cpu), (double[]){5, 3, 1}, 3);
  kiln_tensor *ae = kiln_arange(3, 3, 1, KILN_F32, cpu);
  H_CHECK(ae && kiln_numel(ae) == 0 && kiln_ndim(ae) == 1, "arange(3, 3) is empty 1-d");
  H_EXPECT_ERR(kiln_arange(0, 1, 0, KILN_F32, cpu), KILN_ERR_INVALID_ARGUMENT, "arange step 0");
  kiln_tensor *huge = kiln_arange(0, 1e13, 1, KILN_F32, cpu);
  H_CHECK(huge == NULL && kiln_last_error() != KILN_OK, "arange of 1e13 elements is refused");
  kiln_clear_error();
  values_are(kiln_linspace(0, 1, 5, KILN_F64, cpu), (double[]){0, 0.25, 0.5, 0.75, 1}, 5);
  values_are(kiln_linspace(2, -2, 3, KILN_F32, cpu), (double[]){2, 0, -2}, 3);
  values_are(kiln_linspace(7, 9, 1, KILN_F32, cpu), (double[]){7}, 1);
  values_are(kiln_eye(2, 3, KILN_F32, cpu), (double[]){1, 0, 0, 0, 1, 0}, 6);
  values_are(kiln_eye(3, 2, KILN_I64, cpu), (double[]){1, 0, 0, 1, 0, 0}, 6);

  /* from_data copies: changing the source later does not change the tensor */
  float src[6] = {1, 2, 3, 4, 5, 6};
  kiln_tensor *fd = kiln_from_data(src, KILN_SHAPE(2, 3), KILN_F32, cpu);
  src[0] = 100;
  values_are(fd, (double[]){1, 2, 3, 4, 5, 6}, 6);
  H_CHECK(kiln_get(fd, (int64_t[]){1, 0}) == 4, "get [1, 0] is 4");
  int32_t isrc[3] = {-7, 0, 2147483647};
  values_are(kiln_from_data(isrc, KILN_SHAPE(3), KILN_I32, cpu), (double[]){-7, 0, 2147483647}, 3);
  uint8_t bsrc[3] = {1, 0, 1};
  values_are(kiln_from_data(bsrc, KILN_SHAPE(3), KILN_BOOL, cpu), (double[]){1, 0, 1}, 3);

  /* to_host of a non-contiguous view gives C order of the view */
  kiln_tensor *tr = kiln_transpose(fd, 0, 1);
  float out[6] = {0};
  H_CHECK(tr && kiln_to_host(tr, out, sizeof out) == KILN_OK && out[0] == 1 && out[1] == 4 &&
              out[2] == 2 && out[5] == 6,
          "to_host of a transposed view is in its C order");
  H_CHECK(kiln_to_host(fd, out, 8) != KILN_OK && kiln_last_error() != KILN_OK,
          "to_host with a too small buffer fails");
  /* item on more than one element */
  kiln_clear_error();
  double it = kiln_item(fd);
  H_CHECK(isnan(it) && kiln_last_error() == KILN_ERR_SHAPE, "item of [2,3] is NAN + KILN_ERR_SHAPE");
  kiln_clear_error();
  kiln_tensor *one = kiln_full(KILN_SHAPE(1, 1), 5, KILN_I32, cpu);
  H_CHECK(kiln_item(one) == 5, "item of [1,1] works");
  /* data_ptr */
  float *p = kiln_data_ptr(fd);
  H_CHECK(p && p[4] == 5, "data_ptr of a contiguous CPU tensor");
  H_CHECK(kiln_data_ptr(tr) == NULL && kiln_last_error() != KILN_OK,
          "data_ptr of a non-contiguous view is NULL with an error");
  kiln_clear_error();
  kiln_scope_end();
}

static void test_conversion(void) {
  kiln_scope_begin();
  /* f16: ulp at 1 is 2^-10; a half-ulp tie rounds to even */
  double f16in[] = {1 + 0x1p-11, 1 + 3 * 0x1p-11, 65504, 65519, 65520, 1e-8, -0.0, 0x1p-24};
  kiln_tensor *h = kiln_to_dtype(h_tensor(f16in, 1, (const int64_t[]){8}, KILN_F32), KILN_F16);
  values_are(h, (double[]){1, 1 + 0x1p-9, 65504, 65504, INFINITY, 0, 0, 0x1p-24}, 8);
  /* bf16: ulp at 1 is 2^-7 */
  double bfin[] = {1 + 0x1p-8, 1 + 3 * 0x1p-8, 3.0e38, 1e-39};
  kiln_tensor *bf = kiln_to_dtype(h_tensor(bfin, 1, (const int64_t[]){4}, KILN_F32), KILN_BF16);
  values_are(bf, (double[]){1, 1 + 0x1p-6, h_round_to(3.0e38, KILN_BF16), h_round_to(1e-39, KILN_BF16)}, 4);
  H_CHECK(h_round_to(3.0e38, KILN_BF16) != 3.0e38 && isfinite(h_round_to(3.0e38, KILN_BF16)),
          "bf16 keeps f32's range");
  /* f64 -> f16 directly, not through a lossy path that double-rounds badly */
  kiln_tensor *d = kiln_to_dtype(h_tensor((double[]){0.1, 1e5}, 1, (const int64_t[]){2}, KILN_F64), KILN_F16);
  values_are(d, (double[]){h_round_to(0.1, KILN_F16), INFINITY}, 2);
  /* float -> int truncates toward zero; -> bool is nonzero (NaN too) */
  kiln_tensor *f = h_tensor((double[]){-2.7, 2.7, -0.5, 3.0}, 1, (const int64_t[]){4}, KILN_F32);
  values_are(kiln_to_dtype(f, KILN_I64), (double[]){-2, 2, 0, 3}, 4);
  values_are(kiln_to_dtype(f, KILN_I32), (double[]){-2, 2, 0, 3}, 4);
  kiln_tensor *fb = h_tensor((double[]){0, -0.0, 0.1, NAN}, 1, (const int64_t[]){4}, KILN_F32);
  values_are(kiln_to_dtype(fb, KILN_BOOL), (double[]){0, 0, 1, 1}, 4);
  values_are(kiln_to_dtype(kiln_to_dtype(fb, KILN_BOOL), KILN_F32), (double[]){0, 0, 1, 1}, 4);
  /* u8 wraps like C for in-range values */
  values_are(kiln_to_dtype(h_tensor((double[]){0, 255, 17}, 1, (const int64_t[]){3}, KILN_I64), KILN_U8),
             (double[]){0, 255, 17}, 3);
  /* large int64 survive a round trip through i64 (not through float) */
  int64_t big[2] = {INT64_C(9007199254740993), INT64_C(-9007199254740993)};
  kiln_tensor *bi = kiln_from_data(big, KILN_SHAPE(2), KILN_I64, cpu);
  kiln_tensor *bc = kiln_clone(kiln_transpose(kiln_unsqueeze(bi, 0), 0, 1));
  int64_t back[2] = {0, 0};
  H_CHECK(bc && kiln_to_host(bc, back, sizeof back) == KILN_OK && back[0] == big[0] && back[1] == big[1],
          "int64 2^53+1 is exact through clone");
  /* same dtype: the same tensor, +1 reference */
  kiln_tensor *same = kiln_to_dtype(f, KILN_F32);
  H_CHECK(same == f, "to_dtype to its own dtype returns the same tensor");
  kiln_scope_end();
}

static void test_copies(void) {
  kiln_scope_begin();
  kiln_tensor *a = h_tensor((double[]){1, 2, 3, 4, 5, 6}, 2, (const int64_t[]){2, 3}, KILN_F32);
  kiln_tensor *t = kiln_transpose(a, 0, 1);
  H_CHECK(t && !kiln_is_contiguous(t), "transpose is not contiguous");
  kiln_tensor *c = kiln_contiguous(t);
  H_CHECK(c && kiln_is_contiguous(c) && kiln_strides(c)[0] == 2, "contiguous of a transpose");
  values_are(c, (double[]){1, 4, 2, 5, 3, 6}, 6);
  H_CHECK(kiln_contiguous(a) == a, "contiguous of a contiguous tensor is itself");
  kiln_tensor *cl = kiln_clone(a);
  H_CHECK(cl && cl != a, "clone is a new tensor");
  kiln_fill_(cl, 0);
  values_are(a, (double[]){1, 2, 3, 4, 5, 6}, 6);
  kiln_tensor *ct = kiln_clone(t);
  values_are(ct, (double[]){1, 4, 2, 5, 3, 6}, 6);
  kiln_tensor *mv = kiln_to_device(a, cpu);
  H_CHECK(mv == a, "to_device cpu -> cpu is the same tensor");
  /* copy_ broadcasts and casts */
  kiln_tensor *dst = kiln_zeros(KILN_SHAPE(2, 3), KILN_F64, cpu);
  kiln_tensor *row = h_tensor((double[]){7, 8, 9}, 1, (const int64_t[]){3}, KILN_I32);
  H_CHECK(kiln_copy_(dst, row) == KILN_OK, "copy_ broadcasts a row");
  values_are(dst, (double[]){7, 8, 9, 7, 8, 9}, 6);
  H_CHECK(kiln_copy_(dst, kiln_ones(KILN_SHAPE(4), KILN_F32, cpu)) != KILN_OK, "copy_ [4] into [2,3] fails");
  kiln_clear_error();
  H_CHECK(kiln_mul_scalar_(dst, 2) == KILN_OK && kiln_axpy_(dst, -1, kiln_ones_like(dst)) == KILN_OK,
          "mul_scalar_ and axpy_");
  values_are(dst, (double[]){13, 15, 17, 13, 15, 17}, 6);
  H_CHECK(kiln_add_scalar_(dst, -10.5) == KILN_OK, "add_scalar_");
  values_are(dst, (double[]){2.5, 4.5, 6.5, 2.5, 4.5, 6.5}, 6);
  kiln_tensor *count = kiln_zeros(0, NULL, KILN_I64, cpu); /* BatchNorm's num_batches_tracked */
  H_CHECK(kiln_add_scalar_(count, 1) == KILN_OK && kiln_add_scalar_(count, 1) == KILN_OK && kiln_item(count) == 2,
          "add_scalar_ counts in an i64 scalar");
  H_CHECK(kiln_add_scalar_(NULL, 1) != KILN_OK, "add_scalar_ on NULL is an error");
  kiln_clear_error();
  H_CHECK(kiln_zero_(dst) == KILN_OK, "zero_");
  values_are(dst, (double[]){0, 0, 0, 0, 0, 0}, 6);
  /* in-place on a tensor that requires grad is refused while grad mode is on */
  kiln_tensor *w = kiln_ones(KILN_SHAPE(2), KILN_F32, cpu);
  kiln_requires_grad_(w, true);
  H_CHECK(kiln_fill_(w, 3) == KILN_ERR_AUTOGRAD, "fill_ on a requires-grad leaf: KILN_ERR_AUTOGRAD");
  kiln_clear_error();
  bool prev = kiln_set_grad_enabled(false);
  H_CHECK(kiln_fill_(w, 3) == KILN_OK, "fill_ on it under no-grad works");
  kiln_set_grad_enabled(prev);
  values_are(w, (double[]){3, 3}, 2);
  kiln_scope_end();
}

/* kiln_to_device_many: to the CPU every tensor comes back as itself (+1 reference); a
** NULL among them is an error with out[] all NULL. (The one-transfer path to a GPU is in
** test_cuda_runtime.) */
static void test_to_device_many(void) {
  kiln_scope_begin();
  kiln_tensor *ts[3] = {kiln_arange(0, 6, 1, KILN_F32, cpu), kiln_full(KILN_SHAPE(2), 7, KILN_I64, cpu),
                        kiln_zeros(KILN_SHAPE(0), KILN_U8, cpu)};
  kiln_tensor *out[3];
  H_CHECK(kiln_to_device_many(3, ts, cpu, out) == KILN_OK && out[0] == ts[0] && out[1] == ts[1] && out[2] == ts[2],
          "to the CPU: the same tensors");
  kiln_tensor *bad[2] = {ts[0], NULL};
  out[0] = ts[0];
  H_EXPECT_ERR(kiln_to_device_many(2, bad, cpu, out) == KILN_OK, KILN_ERR_INVALID_ARGUMENT, "a NULL tensor");
  H_CHECK(out[0] == NULL && out[1] == NULL, "out[] is NULL after an error");
  H_EXPECT_ERR(kiln_to_device_many(-1, ts, cpu, out) == KILN_OK, KILN_ERR_INVALID_ARGUMENT, "n < 0");
  H_CHECK(kiln_to_device_many(0, NULL, cpu, NULL) == KILN_OK, "n = 0 is a no-op");
  /* kiln_copy_many_: pair by pair here (no packed block), values copied, errors name the pair */
  kiln_tensor *d[2] = {kiln_zeros(KILN_SHAPE(6), KILN_F32, cpu), kiln_zeros(KILN_SHAPE(2), KILN_I64, cpu)};
  kiln_tensor *src[2] = {ts[0], ts[1]};
  H_CHECK(kiln_copy_many_(2, d, src) == KILN_OK && kiln_get(d[0], (int64_t[]){5}) == 5 &&
              kiln_get(d[1], (int64_t[]){1}) == 7,
          "copy_many_ copies every pair");
  kiln_tensor *cast[2] = {kiln_zeros(KILN_SHAPE(6), KILN_F64, cpu), kiln_zeros(KILN_SHAPE(2, 2), KILN_I64, cpu)};
  H_CHECK(kiln_copy_many_(2, cast, src) == KILN_OK && kiln_get(cast[0], (int64_t[]){4}) == 4 &&
              kiln_get(cast[1], (int64_t[]){1, 0}) == 7,
          "copy_many_ casts and broadcasts as kiln_copy_ does");
  kiln_tensor *wrong[2] = {ts[0], ts[2]};
  kiln_status rc = kiln_copy_many_(2, d, wrong);
  H_CHECK(rc == KILN_ERR_SHAPE && strstr(kiln_last_error_message(), "pair 1"),
          "a pair that does not broadcast: KILN_ERR_SHAPE naming pair 1 (%s)", kiln_last_error_message());
  H_EXPECT_ERR(kiln_copy_many_(-1, d, src) == KILN_OK, KILN_ERR_INVALID_ARGUMENT, "copy_many_ with n < 0");
  kiln_scope_end();
}

/* kiln_mark on the CPU: the host clock; errors free what they are given */
static void test_marks(void) {
  kiln_mark *a = kiln_mark_record(cpu);
  struct timespec ts = {0, 2000000}; /* 2 ms */
  nanosleep(&ts, NULL);
  kiln_mark *b = kiln_mark_record(cpu);
  double ms = kiln_mark_elapsed_ms(a, b);
  H_CHECK(ms >= 1.9 && ms < 1000, "two marks around a 2 ms sleep: %.3f ms", ms);
  kiln_mark *c = kiln_mark_record(cpu);
  H_CHECK(kiln_mark_elapsed_ms(c, NULL) == -1 && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT,
          "a NULL mark: -1 and KILN_ERR_INVALID_ARGUMENT (the other mark freed)");
  kiln_clear_error();
  H_CHECK(kiln_mark_record((kiln_device){KILN_DEVICE_CUDA, 99}) == NULL &&
              (kiln_last_error() == KILN_ERR_DEVICE || kiln_last_error() == KILN_ERR_UNAVAILABLE),
          "a mark on a device that does not exist: KILN_ERR_DEVICE (or UNAVAILABLE without CUDA)");
}

/* Creation ops are ops on the one call path: a trace names each with its attributes; a
** refused call is not traced and leaves the generator where it was. */
static const kiln_attr *attr_named(const kiln_trace_op *op, const char *name) {
  for (int i = 0; op && i < op->n_attrs; i++)
    if (strcmp(op->attrs[i].name, name) == 0) return &op->attrs[i];
  return NULL;
}

static void test_creation_traced(void) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(7);
  kiln_trace *tr = kiln_trace_begin();
  kiln_tensor *f = kiln_full(KILN_SHAPE(2, 3), 1.5, KILN_F32, cpu);
  kiln_tensor *z = kiln_zeros_like(f);
  kiln_tensor *a = kiln_arange(0, 5, 2, KILN_I64, cpu);
  kiln_tensor *r = kiln_randint(3, 9, KILN_SHAPE(4), KILN_I32, cpu, g);
  H_CHECK(kiln_uniform_(f, -1, 1, g) == KILN_OK, "uniform_");
  H_CHECK(kiln_rand(KILN_SHAPE(2), KILN_I64, cpu, g) == NULL && kiln_last_error() == KILN_ERR_DTYPE,
          "rand of an integer dtype refused");
  kiln_trace_end(tr);
  H_CHECK(f && z && a && r, "creation ops");
  H_CHECK(kiln_trace_count(tr) == 5, "5 ops traced, got %d", kiln_trace_count(tr));
  const char *want[] = {"full", "zeros_like", "arange", "randint", "uniform_"};
  for (int i = 0; i < 5 && i < kiln_trace_count(tr); i++)
    H_CHECK(strcmp(kiln_trace_get(tr, i)->name, want[i]) == 0, "op %d is %s, not %s", i, kiln_trace_get(tr, i)->name,
            want[i]);
  const kiln_trace_op *o0 = kiln_trace_get(tr, 0);
  const kiln_attr *shape = attr_named(o0, "shape"), *value = attr_named(o0, "value"), *dt = attr_named(o0, "dtype");
  H_CHECK(o0 && o0->n_inputs == 0 && o0->n_outputs == 1 && o0->outputs[0] == kiln_tensor_id(f), "full: no inputs, f out");
  H_CHECK(shape && shape->n == 2 && shape->ints[0] == 2 && shape->ints[1] == 3, "full: shape [2, 3]");
  H_CHECK(value && value->f == 1.5 && dt && strcmp(dt->s, kiln_dtype_name(KILN_F32)) == 0, "full: value 1.5, dtype f32");
  const kiln_attr *hi = attr_named(kiln_trace_get(tr, 3), "high"), *step = attr_named(kiln_trace_get(tr, 2), "step");
  H_CHECK(hi && hi->i == 9 && step && step->f == 2, "randint high 9, arange step 2");
  kiln_trace_free(tr);
  /* the generator moved for randint (4 values: 2 blocks) and uniform_ (6: 3), not for the
  ** refused rand */
  uint64_t seed, off;
  kiln_generator_get_state(g, &seed, &off);
  H_CHECK(seed == 7 && off == 5, "generator offset 5, got %llu", (unsigned long long)off);
  kiln_generator_free(g);
  kiln_scope_end();
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_tensor");
  cpu = kiln_device_cpu();
  int64_t live0 = kiln_live_tensors();
  test_creation();
  test_creation_traced();
  test_conversion();
  test_copies();
  test_to_device_many();
  test_marks();
  H_CHECK(kiln_live_tensors() == live0, "no leaks: %lld -> %lld", (long long)live0,
          (long long)kiln_live_tensors());
  return h_finish();
}
