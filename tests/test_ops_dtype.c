/*
** Every op on every dtype: the floating dtypes run (forward and backward) and keep their
** dtype; the integer dtypes run where the header says they are valid (arithmetic,
** comparisons, selection, indexing) and give KILN_ERR_DTYPE where they are not (math
** and activation functions, softmax, mean/var/std, losses, dropout). Ops whose integer
** support PyTorch and the header leave open may do either, but must not crash or return
** a float result without saying so.
*/
#include "harness.h"

#include <stdlib.h>
#include <string.h>

enum { INT_OK, INT_ERR, INT_ANY };
enum { OUT_SAME, OUT_BOOL, OUT_I64, OUT_SUM }; /* OUT_SUM: ints widen to i64 */

typedef struct dt_op {
  const char *name;
  kiln_tensor *(*fn)(kiln_tensor *x); /* x: (3, 4) of the dtype under test */
  int ints, out;
  bool grad;
} dt_op;

static kiln_device dt_cpu(void) { return kiln_device_cpu(); }
static kiln_tensor *dt_like(kiln_tensor *x, double v) { return kiln_full_like(x, v); }
static kiln_tensor *dt_idx(int n, const double *v) {
  return h_tensor(v, 1, (const int64_t[]){n}, KILN_I64);
}

static kiln_tensor *op_add(kiln_tensor *x) { return kiln_add(x, dt_like(x, 2)); }
static kiln_tensor *op_sub(kiln_tensor *x) { return kiln_sub(x, dt_like(x, 2)); }
static kiln_tensor *op_mul(kiln_tensor *x) { return kiln_mul(x, dt_like(x, 2)); }
static kiln_tensor *op_div(kiln_tensor *x) { return kiln_div(x, dt_like(x, 2)); }
static kiln_tensor *op_pow(kiln_tensor *x) { return kiln_pow(x, dt_like(x, 2)); }
static kiln_tensor *op_maximum(kiln_tensor *x) { return kiln_maximum(x, dt_like(x, 2)); }
static kiln_tensor *op_minimum(kiln_tensor *x) { return kiln_minimum(x, dt_like(x, 2)); }
static kiln_tensor *op_add_s(kiln_tensor *x) { return kiln_add_scalar(x, 3); }
static kiln_tensor *op_mul_s(kiln_tensor *x) { return kiln_mul_scalar(x, 3); }
static kiln_tensor *op_pow_s(kiln_tensor *x) { return kiln_pow_scalar(x, 2); }
static kiln_tensor *op_axpy(kiln_tensor *x) { return kiln_axpy(x, 2, dt_like(x, 1)); }
static kiln_tensor *op_clamp(kiln_tensor *x) { return kiln_clamp(x, 1, 2); }
static kiln_tensor *op_leaky(kiln_tensor *x) { return kiln_leaky_relu(x, 0.1); }
static kiln_tensor *op_softplus(kiln_tensor *x) { return kiln_softplus(x, 1, 20); }
static kiln_tensor *op_eq(kiln_tensor *x) { return kiln_eq(x, dt_like(x, 2)); }
static kiln_tensor *op_lt(kiln_tensor *x) { return kiln_lt(x, dt_like(x, 2)); }
static kiln_tensor *op_ge(kiln_tensor *x) { return kiln_ge(x, dt_like(x, 2)); }
static kiln_tensor *op_gts(kiln_tensor *x) { return kiln_gt_scalar(x, 1); }
static kiln_tensor *op_where(kiln_tensor *x) {
  return kiln_where(kiln_gt_scalar(x, 1), x, dt_like(x, 0));
}
static kiln_tensor *op_sum(kiln_tensor *x) { return kiln_sum(x, KILN_DIMS(1), false); }
static kiln_tensor *op_mean(kiln_tensor *x) { return kiln_mean(x, KILN_DIMS(1), false); }
static kiln_tensor *op_amax(kiln_tensor *x) { return kiln_amax(x, KILN_DIMS(0), true); }
static kiln_tensor *op_amin(kiln_tensor *x) { return kiln_amin(x, KILN_DIMS(0), true); }
static kiln_tensor *op_var(kiln_tensor *x) { return kiln_var(x, KILN_DIMS(1), 1, false); }
static kiln_tensor *op_std(kiln_tensor *x) { return kiln_std(x, KILN_DIMS(1), 1, false); }
static kiln_tensor *op_sum_all(kiln_tensor *x) { return kiln_sum_all(x); }
static kiln_tensor *op_mean_all(kiln_tensor *x) { return kiln_mean_all(x); }
static kiln_tensor *op_max_dim(kiln_tensor *x) { return kiln_max_dim(x, 1, false, NULL); }
static kiln_tensor *op_argmax(kiln_tensor *x) { return kiln_argmax(x, 1, false); }
static kiln_tensor *op_argmin(kiln_tensor *x) { return kiln_argmin(x, 0, false); }
static kiln_tensor *op_softmax(kiln_tensor *x) { return kiln_softmax(x, 1); }
static kiln_tensor *op_lsm(kiln_tensor *x) { return kiln_log_softmax(x, 1); }
static kiln_tensor *op_matmul(kiln_tensor *x) { return kiln_matmul(x, kiln_transpose(x, 0, 1)); }
static kiln_tensor *op_linear(kiln_tensor *x) {
  return kiln_linear(x, dt_like(kiln_ones(KILN_SHAPE(2, 4), kiln_dtype_of(x), dt_cpu()), 1),
                     kiln_ones(KILN_SHAPE(2), kiln_dtype_of(x), dt_cpu()));
}
static kiln_tensor *op_cat(kiln_tensor *x) {
  kiln_tensor *ts[2] = {x, x};
  return kiln_cat(2, ts, 0);
}
static kiln_tensor *op_stack(kiln_tensor *x) {
  kiln_tensor *ts[2] = {x, x};
  return kiln_stack(2, ts, 1);
}
static kiln_tensor *op_isel(kiln_tensor *x) { return kiln_index_select(x, 1, dt_idx(2, (double[]){3, 0})); }
static kiln_tensor *op_gather(kiln_tensor *x) {
  return kiln_gather(x, 1, h_tensor((double[]){0, 1, 2, 3, 3, 0}, 2, (const int64_t[]){3, 2}, KILN_I64));
}
static kiln_tensor *op_scatter(kiln_tensor *x) {
  return kiln_scatter_add(x, 1, h_tensor((double[]){0, 1, 2, 3, 3, 0}, 2, (const int64_t[]){3, 2}, KILN_I64),
                          kiln_ones(KILN_SHAPE(3, 2), kiln_dtype_of(x), dt_cpu()));
}
static kiln_tensor *op_emb(kiln_tensor *x) { return kiln_embedding(x, dt_idx(3, (double[]){2, 0, 2})); }
static kiln_tensor *op_dropout(kiln_tensor *x) { return kiln_dropout(x, 0.5, true, NULL); }
static kiln_tensor *op_ce(kiln_tensor *x) {
  return kiln_cross_entropy(x, dt_idx(3, (double[]){0, 3, 1}), KILN_REDUCTION_MEAN, -100, 0.1);
}
static kiln_tensor *op_mse(kiln_tensor *x) { return kiln_mse_loss(x, dt_like(x, 1), KILN_REDUCTION_MEAN); }
static kiln_tensor *op_contig(kiln_tensor *x) { return kiln_contiguous(kiln_transpose(x, 0, 1)); }
static kiln_tensor *op_reshape(kiln_tensor *x) { return kiln_reshape(kiln_transpose(x, 0, 1), KILN_SHAPE(12)); }

static const dt_op dt_ops[] = {
    {"add", op_add, INT_OK, OUT_SAME, true},
    {"sub", op_sub, INT_OK, OUT_SAME, true},
    {"mul", op_mul, INT_OK, OUT_SAME, true},
    {"div", op_div, INT_ANY, OUT_SAME, true},
    {"pow", op_pow, INT_ANY, OUT_SAME, true},
    {"maximum", op_maximum, INT_OK, OUT_SAME, true},
    {"minimum", op_minimum, INT_OK, OUT_SAME, true},
    {"add_scalar", op_add_s, INT_OK, OUT_SAME, true},
    {"mul_scalar", op_mul_s, INT_OK, OUT_SAME, true},
    {"pow_scalar", op_pow_s, INT_ANY, OUT_SAME, true},
    {"axpy", op_axpy, INT_OK, OUT_SAME, true},
    {"neg", kiln_neg, INT_OK, OUT_SAME, true},
    {"abs", kiln_abs, INT_OK, OUT_SAME, true},
    {"exp", kiln_exp, INT_ERR, OUT_SAME, true},
    {"log", kiln_log, INT_ERR, OUT_SAME, true},
    {"sqrt", kiln_sqrt, INT_ERR, OUT_SAME, true},
    {"rsqrt", kiln_rsqrt, INT_ERR, OUT_SAME, true},
    {"clamp", op_clamp, INT_ANY, OUT_SAME, true},
    {"relu", kiln_relu, INT_ANY, OUT_SAME, true},
    {"leaky_relu", op_leaky, INT_ERR, OUT_SAME, true},
    {"gelu", kiln_gelu, INT_ERR, OUT_SAME, true},
    {"gelu_tanh", kiln_gelu_tanh, INT_ERR, OUT_SAME, true},
    {"silu", kiln_silu, INT_ERR, OUT_SAME, true},
    {"sigmoid", kiln_sigmoid, INT_ERR, OUT_SAME, true},
    {"tanh", kiln_tanh, INT_ERR, OUT_SAME, true},
    {"softplus", op_softplus, INT_ERR, OUT_SAME, true},
    {"eq", op_eq, INT_OK, OUT_BOOL, false},
    {"lt", op_lt, INT_OK, OUT_BOOL, false},
    {"ge", op_ge, INT_OK, OUT_BOOL, false},
    {"gt_scalar", op_gts, INT_OK, OUT_BOOL, false},
    {"where", op_where, INT_OK, OUT_SAME, true},
    {"sum", op_sum, INT_OK, OUT_SUM, true},
    {"mean", op_mean, INT_ERR, OUT_SAME, true},
    {"amax", op_amax, INT_OK, OUT_SAME, true},
    {"amin", op_amin, INT_OK, OUT_SAME, true},
    {"var", op_var, INT_ERR, OUT_SAME, true},
    {"std", op_std, INT_ERR, OUT_SAME, true},
    {"sum_all", op_sum_all, INT_OK, OUT_SUM, true},
    {"mean_all", op_mean_all, INT_ERR, OUT_SAME, true},
    {"max_dim", op_max_dim, INT_OK, OUT_SAME, true},
    {"argmax", op_argmax, INT_OK, OUT_I64, false},
    {"argmin", op_argmin, INT_OK, OUT_I64, false},
    {"softmax", op_softmax, INT_ERR, OUT_SAME, true},
    {"log_softmax", op_lsm, INT_ERR, OUT_SAME, true},
    {"matmul", op_matmul, INT_ANY, OUT_SAME, true},
    {"linear", op_linear, INT_ANY, OUT_SAME, true},
    {"cat", op_cat, INT_OK, OUT_SAME, true},
    {"stack", op_stack, INT_OK, OUT_SAME, true},
    {"index_select", op_isel, INT_OK, OUT_SAME, true},
    {"gather", op_gather, INT_OK, OUT_SAME, true},
    {"scatter_add", op_scatter, INT_OK, OUT_SAME, true},
    {"embedding", op_emb, INT_ANY, OUT_SAME, true},
    {"dropout", op_dropout, INT_ERR, OUT_SAME, true},
    {"cross_entropy", op_ce, INT_ERR, OUT_SAME, true},
    {"mse_loss", op_mse, INT_ERR, OUT_SAME, true},
    {"contiguous", op_contig, INT_OK, OUT_SAME, true},
    {"reshape", op_reshape, INT_OK, OUT_SAME, true},
};

static kiln_dtype expect_dtype(const dt_op *op, kiln_dtype dt) {
  switch (op->out) {
  case OUT_BOOL: return KILN_BOOL;
  case OUT_I64: return KILN_I64;
  case OUT_SUM: return kiln_dtype_is_float(dt) ? dt : KILN_I64;
  default: return dt;
  }
}

static void run_op(const dt_op *op, kiln_dtype dt) {
  kiln_scope_begin();
  const char *dn = kiln_dtype_name(dt);
  /* values 0.5 .. 6 (ints: 0 .. 6): positive so log/sqrt are finite */
  double v[12];
  for (int i = 0; i < 12; i++) v[i] = 0.5 * (i + 1);
  kiln_tensor *x = h_tensor(v, 2, (const int64_t[]){3, 4}, dt);
  bool is_float = kiln_dtype_is_float(dt);
  if (is_float && op->grad) kiln_requires_grad_(x, true);
  kiln_clear_error();
  kiln_tensor *y = op->fn(x);
  if (is_float || op->ints == INT_OK) {
    if (H_CHECK(y != NULL, "%s on %s returns a tensor", op->name, dn)) {
      kiln_dtype want = expect_dtype(op, dt);
      H_CHECK(kiln_dtype_of(y) == want, "%s on %s gives %s, want %s", op->name, dn,
              kiln_dtype_name(kiln_dtype_of(y)), kiln_dtype_name(want));
      int64_t n = 0;
      double *vals = h_values(y, &n);
      bool finite = vals != NULL;
      for (int64_t k = 0; vals && k < n; k++) finite &= isfinite(vals[k]) != 0;
      H_CHECK(finite, "%s on %s: values readable and finite", op->name, dn);
      free(vals);
      if (is_float && op->grad) {
        kiln_status st = kiln_backward(kiln_sum_all(y), NULL);
        kiln_tensor *g = kiln_grad(x);
        H_CHECK(st == KILN_OK && g && kiln_dtype_of(g) == dt && kiln_ndim(g) == 2,
                "%s on %s: backward gives a %s gradient of x's shape (status %s)", op->name, dn,
                dn, kiln_error_name(st));
      }
    }
  } else if (op->ints == INT_ERR) {
    H_CHECK(y == NULL && kiln_last_error() == KILN_ERR_DTYPE,
            "%s on %s must fail with KILN_ERR_DTYPE (got %s, %s)", op->name, dn,
            y ? "a result" : "NULL", kiln_error_name(kiln_last_error()));
  } else {
    H_CHECK(y != NULL || kiln_last_error() == KILN_ERR_DTYPE,
            "%s on %s: a result or KILN_ERR_DTYPE (got %s)", op->name, dn,
            kiln_error_name(kiln_last_error()));
  }
  kiln_clear_error();
  kiln_scope_end();
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_dtype");
  if (h_cross_only()) return h_finish();
  static const kiln_dtype dts[] = {KILN_F32, KILN_F64, KILN_F16, KILN_BF16, KILN_I64, KILN_I32};
  int64_t live0 = kiln_live_tensors();
  for (size_t i = 0; i < sizeof dt_ops / sizeof dt_ops[0]; i++)
    for (size_t d = 0; d < sizeof dts / sizeof dts[0]; d++) run_op(&dt_ops[i], dts[d]);
  /* requires_grad on an integer tensor is refused */
  kiln_tensor *it = kiln_ones(KILN_SHAPE(2), KILN_I64, kiln_device_cpu());
  H_CHECK(kiln_requires_grad_(it, true) != KILN_OK && !kiln_requires_grad(it),
          "requires_grad on int64 is an error");
  kiln_clear_error();
  kiln_tensor_free(it);
  H_CHECK(kiln_live_tensors() == live0, "no tensors leak: %lld before, %lld after",
          (long long)live0, (long long)kiln_live_tensors());
  return h_finish();
}
