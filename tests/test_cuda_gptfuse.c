/*
** The GPT-2 step's CUDA paths against the CPU (issue 16, speed and memory): linear with
** odd dims and rows off 16 bytes (GPT-2's head has V = 50257; cuBLAS takes them as they
** are: padded copies were tried and measured slower, 18:40 run), and linear_gelu at sizes
** that take cuBLASLt's GELU epilogue and, with rows off 16 bytes, the composed path; an
** MLP (linear_gelu then linear), whose backward takes the DGELU hand-over; the same MLP
** at a size whose products cuda_matmul.cu's lt_tune times, untuned and tuned, bit for bit;
** linear_gelu outside autograd (y alone) against the recording call, bit for bit.
** Forward and the gradients of x, W and the bias. Skipped (exit 77) without a CUDA device.
*/
#define _POSIX_C_SOURCE 200809L /* setenv */
#include "harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* linear(x, W) forward and both gradients on the CPU and cuda:0 from the same numbers,
** with x (M, K) read through a column window [off, off + K) of an (M, K + off + pad)
** tensor when off or pad is not 0 (rows whose ld is odd and whose start is off 16 bytes). */
static void padded_linear(kiln_dtype dt, int64_t M, int64_t K, int64_t N, int64_t off, int64_t pad,
                          bool bias, bool gelu) {
  kiln_scope_begin();
  double *v[2][4] = {{NULL}};
  kiln_tensor *got[4] = {NULL};
  for (int side = 0; side < 2; side++) {
    kiln_device d = side ? kiln_device_cuda(0) : kiln_device_cpu();
    kiln_generator *gen = kiln_generator_new(11);
    kiln_tensor *xw = kiln_to_dtype(kiln_randn(KILN_SHAPE(M, K + off + pad), KILN_F32, d, gen), dt);
    kiln_tensor *W = kiln_to_dtype(kiln_mul_scalar(kiln_randn(KILN_SHAPE(N, K), KILN_F32, d, gen), 0.1), dt);
    kiln_tensor *b = bias ? kiln_to_dtype(kiln_randn(KILN_SHAPE(N), KILN_F32, d, gen), dt) : NULL;
    kiln_tensor *g = kiln_to_dtype(kiln_randn(KILN_SHAPE(M, N), KILN_F32, d, gen), dt);
    kiln_generator_free(gen);
    kiln_requires_grad_(xw, true);
    kiln_requires_grad_(W, true);
    if (b) kiln_requires_grad_(b, true);
    kiln_tensor *x = kiln_narrow(xw, 1, off, K);
    kiln_tensor *y = gelu ? kiln_linear_gelu(x, W, b) : kiln_linear(x, W, b);
    H_CHECK(y && kiln_backward(y, g) == KILN_OK, "padded linear %s side %d: %s", kiln_dtype_name(dt), side,
            kiln_last_error_message());
    kiln_tensor *r[4] = {y, kiln_grad(xw), kiln_grad(W), b ? kiln_grad(b) : NULL};
    for (int i = 0; i < 4; i++) {
      v[side][i] = r[i] ? h_values(r[i], NULL) : NULL;
      got[i] = r[i];
    }
  }
  double rtol, atol;
  h_dtype_tol(dt, &rtol, &atol);
  static const char *const what[4] = {"y", "dx", "dW", "db"};
  for (int i = 0; i < (bias ? 4 : 3); i++) {
    char name[160];
    snprintf(name, sizeof name, "cuda:0 linear%s %s (%lld, %lld) x (%lld, %lld)^T, x window at %lld of %lld%s: %s",
             gelu ? "_gelu" : "", kiln_dtype_name(dt), (long long)M, (long long)K, (long long)N, (long long)K, (long long)off,
             (long long)(K + off + pad), bias ? ", bias" : "", what[i]);
    /* 16-bit products accumulate in f32 on both sides; the roundings of the result differ
    ** by an ulp of the dtype at most, as in test_cuda_ops' products */
    if (v[0][i] && got[i]) h_tensor_close(name, got[i], v[0][i], kiln_numel(got[i]), rtol * 8, atol * 8);
    else H_CHECK(false, "%s: no result", name);
  }
  for (int k = 0; k < 8; k++) free(v[k / 4][k % 4]);
  kiln_scope_end();
}

/* GPT-2's MLP on cuda:0 against the CPU: linear(linear_gelu(x, W1, b1), W2, b2) forward
** and every gradient; on CUDA the first product's GELU backward runs inside the second
** layer's input-gradient product (MATMUL_DGELU, cuBLASLt's DGELU epilogue). */
/* The MLP y = linear(linear_gelu(x, W1, b1), W2, b2) forward and backward on d from seed
** 21: y and the gradients of x, W1, b1, W2, b2 into v (malloc'd, NULL where missing). */
static void mlp_run(kiln_device d, kiln_dtype dt, int64_t M, int64_t C, double *v[6]) {
  kiln_scope_begin();
  kiln_generator *gen = kiln_generator_new(21);
  kiln_tensor *x = kiln_to_dtype(kiln_randn(KILN_SHAPE(M, C), KILN_F32, d, gen), dt);
  kiln_tensor *W1 = kiln_to_dtype(kiln_mul_scalar(kiln_randn(KILN_SHAPE(4 * C, C), KILN_F32, d, gen), 0.1), dt);
  kiln_tensor *b1 = kiln_to_dtype(kiln_mul_scalar(kiln_randn(KILN_SHAPE(4 * C), KILN_F32, d, gen), 0.1), dt);
  kiln_tensor *W2 = kiln_to_dtype(kiln_mul_scalar(kiln_randn(KILN_SHAPE(C, 4 * C), KILN_F32, d, gen), 0.1), dt);
  kiln_tensor *b2 = kiln_to_dtype(kiln_mul_scalar(kiln_randn(KILN_SHAPE(C), KILN_F32, d, gen), 0.1), dt);
  kiln_tensor *g = kiln_to_dtype(kiln_randn(KILN_SHAPE(M, C), KILN_F32, d, gen), dt);
  kiln_generator_free(gen);
  kiln_tensor *leaves[5] = {x, W1, b1, W2, b2};
  for (int i = 0; i < 5; i++) kiln_requires_grad_(leaves[i], true);
  kiln_tensor *y = kiln_linear(kiln_linear_gelu(x, W1, b1), W2, b2);
  H_CHECK(y && kiln_backward(y, g) == KILN_OK, "mlp chain %s on %s: %s", kiln_dtype_name(dt),
          d.type == KILN_DEVICE_CPU ? "cpu" : "cuda:0", kiln_last_error_message());
  kiln_tensor *r[6] = {y, kiln_grad(x), kiln_grad(W1), kiln_grad(b1), kiln_grad(W2), kiln_grad(b2)};
  for (int i = 0; i < 6; i++) v[i] = r[i] ? h_values(r[i], NULL) : NULL;
  kiln_scope_end();
}

static void mlp_chain(kiln_dtype dt, int64_t M, int64_t C) {
  double *v[2][6] = {{NULL}};
  int64_t n[6] = {M * C, M * C, 4 * C * C, 4 * C, 4 * C * C, C};
  mlp_run(kiln_device_cpu(), dt, M, C, v[0]);
  mlp_run(kiln_device_cuda(0), dt, M, C, v[1]);
  double rtol, atol;
  h_dtype_tol(dt, &rtol, &atol);
  static const char *const what[6] = {"y", "dx", "dW1", "db1", "dW2", "db2"};
  for (int i = 0; i < 6; i++) {
    char name[160];
    snprintf(name, sizeof name, "cuda:0 MLP %s (%lld, %lld): %s", kiln_dtype_name(dt), (long long)M, (long long)C,
             what[i]);
    /* the DGELU epilogue does not round g W2 to the dtype before the GELU's derivative:
    ** one rounding fewer than the CPU's composed path */
    if (v[0][i] && v[1][i]) h_close(name, v[1][i], v[0][i], n[i], rtol * 16, atol * 16);
    else H_CHECK(false, "%s: no result", name);
  }
  for (int k = 0; k < 12; k++) free(v[k / 6][k % 6]);
}

/* cuda_matmul.cu's lt_tune times cuBLASLt's candidates for products of 2MNK >= 2^30 and
** picks only among those with the heuristic's first's bits: the MLP at that size (C 256,
** M 2048: each of its products) gives the same bits untuned (KILN_CUDA_LT_TUNE=0, which
** the plans' first calls see) and then tuned. Runs before any other product of its shapes. */
static void tuned_bits(kiln_dtype dt) {
  enum { M = 2048, C = 256 };
  double *v[3][6] = {{NULL}};
  int64_t n[6] = {M * C, M * C, 4 * C * C, 4 * C, 4 * C * C, C};
  setenv("KILN_CUDA_LT_TUNE", "0", 1);
  mlp_run(kiln_device_cuda(0), dt, M, C, v[0]);
  setenv("KILN_CUDA_LT_TUNE", "1", 1);
  mlp_run(kiln_device_cuda(0), dt, M, C, v[1]); /* the plans' tuning calls */
  mlp_run(kiln_device_cuda(0), dt, M, C, v[2]); /* the tuned plans */
  unsetenv("KILN_CUDA_LT_TUNE");
  static const char *const what[6] = {"y", "dx", "dW1", "db1", "dW2", "db2"};
  for (int r = 1; r < 3; r++)
    for (int i = 0; i < 6; i++)
      H_CHECK(v[0][i] && v[r][i] && memcmp(v[0][i], v[r][i], (size_t)n[i] * sizeof(double)) == 0,
              "cuda:0 MLP %s (%d, %d) %s, run %d: the same bits with the products' algorithms timed as untimed",
              kiln_dtype_name(dt), M, C, what[i], r);
  for (int k = 0; k < 18; k++) free(v[k / 6][k % 6]);
}

/* linear_gelu in a call that records no node (grad mode off: eval, generation, a
** checkpoint's forward) writes y alone (the GELU(_BIAS) epilogue, no pre-activation): the
** same y, bit for bit, as the recording call's GELU_AUX(_BIAS), which a checkpoint's
** recompute runs; and close to the CPU's. */
static void gelu_y_alone(kiln_dtype dt, int64_t M, int64_t K, int64_t N, bool bias) {
  kiln_scope_begin();
  kiln_tensor *y[3] = {NULL};
  for (int side = 0; side < 3; side++) { /* the CPU, cuda:0 recording, cuda:0 with grad mode off */
    kiln_device d = side ? kiln_device_cuda(0) : kiln_device_cpu();
    kiln_generator *gen = kiln_generator_new(23);
    kiln_tensor *x = kiln_to_dtype(kiln_randn(KILN_SHAPE(M, K), KILN_F32, d, gen), dt);
    kiln_tensor *W = kiln_to_dtype(kiln_mul_scalar(kiln_randn(KILN_SHAPE(N, K), KILN_F32, d, gen), 0.1), dt);
    kiln_tensor *b = bias ? kiln_to_dtype(kiln_randn(KILN_SHAPE(N), KILN_F32, d, gen), dt) : NULL;
    kiln_generator_free(gen);
    kiln_requires_grad_(W, true);
    bool prev = kiln_set_grad_enabled(side != 2);
    y[side] = kiln_linear_gelu(x, W, b);
    kiln_set_grad_enabled(prev);
    H_CHECK(y[side] && (side == 2) == (kiln_grad_fn_name(y[side]) == NULL), "linear_gelu %s side %d: %s",
            kiln_dtype_name(dt), side, kiln_last_error_message());
  }
  char name[128];
  snprintf(name, sizeof name, "cuda:0 linear_gelu %s (%lld, %lld) x (%lld, %lld)^T%s, y alone", kiln_dtype_name(dt),
           (long long)M, (long long)K, (long long)N, (long long)K, bias ? ", bias" : "");
  if (y[0] && y[1] && y[2]) {
    double *ref = h_values(y[0], NULL), *a = h_values(y[1], NULL), *c = h_values(y[2], NULL);
    int64_t n = kiln_numel(y[0]), differ = 0;
    for (int64_t i = 0; i < n; i++) differ += memcmp(&a[i], &c[i], sizeof a[i]) != 0;
    H_CHECK(differ == 0, "%s: %lld of %lld values differ from the recording call's", name, (long long)differ,
            (long long)n);
    double rtol, atol;
    h_dtype_tol(dt, &rtol, &atol);
    h_tensor_close(name, y[2], ref, n, rtol * 8, atol * 8);
    free(ref), free(a), free(c);
  }
  kiln_scope_end();
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_cuda_gptfuse");
  if (kiln_device_count(KILN_DEVICE_CUDA) == 0) {
    printf("test_cuda_gptfuse: skipped (no cuda device)\n");
    return 77;
  }
  tuned_bits(KILN_BF16);
  tuned_bits(KILN_F16);
  static const kiln_dtype dts[] = {KILN_BF16, KILN_F16, KILN_F32};
  for (int di = 0; di < 3; di++) {
    kiln_dtype dt = dts[di];
    for (int gelu = 0; gelu < 2; gelu++) {
      padded_linear(dt, 150, 96, 101, 0, 0, false, gelu); /* the head's case: N odd (y's and dy's rows) */
      padded_linear(dt, 150, 101, 96, 0, 0, true, gelu);  /* K odd: x's rows */
      padded_linear(dt, 130, 96, 72, 1, 2, true, gelu);   /* x a window: ld 99, rows start 2 bytes off */
      padded_linear(dt, 257, 77, 203, 3, 0, false, gelu); /* everything odd */
    }
    /* GPT-2's c_fc at a small scale (C 128, 4C 512): aligned, the GELU epilogue */
    padded_linear(dt, 256, 128, 512, 0, 0, true, true);
    padded_linear(dt, 256, 128, 512, 0, 0, false, true);
    gelu_y_alone(dt, 256, 128, 512, true);
    gelu_y_alone(dt, 256, 128, 512, false);
    gelu_y_alone(dt, 130, 99, 72, true); /* rows off 16 bytes: the composed path, y in place */
    if (dt == KILN_BF16) gelu_y_alone(dt, 2048, 768, 3072, true); /* GPT-2's c_fc, a tuned product */
    mlp_chain(dt, 256, 64);
    mlp_chain(dt, 100, 24);
    if (dt == KILN_BF16) mlp_chain(dt, 2048, 256); /* the tuned products against the CPU */
  }
  return h_finish();
}
