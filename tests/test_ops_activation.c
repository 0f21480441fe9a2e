/*
** Activations against closed-form f64 references (PyTorch's definitions).
** Names are prefixed act_ because tests/test_cuda_ops.c includes this file.
*/
#include "harness.h"

#include <stdlib.h>
#include <string.h>

typedef struct act_un {
  kiln_tensor *(*op)(kiln_tensor *);
  double (*f)(double);
} act_un;

static kiln_tensor *act_b(kiln_tensor **in, const void *ctx) {
  return ((const act_un *)ctx)->op(in[0]);
}
static int act_r(const h_arr *in, int n, h_arr *out, const void *ctx) {
  (void)n;
  return h_ref_map1(&in[0], out, ((const act_un *)ctx)->f);
}

static double act_relu(double x) { return x > 0 ? x : 0; }
static double act_leaky(double x) { return x > 0 ? x : 0.1 * x; }
static double act_gelu(double x) { return 0.5 * x * (1 + erf(x / sqrt(2.0))); }
static double act_gelu_tanh(double x) {
  return 0.5 * x * (1 + tanh(sqrt(2.0 / 3.14159265358979323846) * (x + 0.044715 * x * x * x)));
}
static double act_sigmoid(double x) { return 1 / (1 + exp(-x)); }
static double act_silu(double x) { return x / (1 + exp(-x)); }
static double act_tanh(double x) { return tanh(x); }
static double act_softplus(double x) { return x > 20 ? x : log1p(exp(x)); }
/* beta 2, threshold 1: linear where beta*x > threshold */
static double act_softplus2(double x) { return 2 * x > 1 ? x : log1p(exp(2 * x)) / 2; }

static kiln_tensor *act_leaky_op(kiln_tensor *t) { return kiln_leaky_relu(t, 0.1); }
static kiln_tensor *act_softplus_op(kiln_tensor *t) { return kiln_softplus(t, 1, 20); }
static kiln_tensor *act_softplus2_op(kiln_tensor *t) { return kiln_softplus(t, 2, 1); }

static const act_un ACT_RELU = {kiln_relu, act_relu}, ACT_LEAKY = {act_leaky_op, act_leaky},
                    ACT_GELU = {kiln_gelu, act_gelu}, ACT_GELU_T = {kiln_gelu_tanh, act_gelu_tanh},
                    ACT_SILU = {kiln_silu, act_silu}, ACT_SIG = {kiln_sigmoid, act_sigmoid},
                    ACT_TANH = {kiln_tanh, act_tanh}, ACT_SP = {act_softplus_op, act_softplus},
                    ACT_SP2 = {act_softplus2_op, act_softplus2};

/* randn times 3 so that the tails (sigmoid saturation, softplus threshold) are reached */
#define ACT(nm, c)                                                                        \
  {.name = nm, .fn = act_b, .ref = act_r, .ctx = &c, .n_in = 1,                           \
   .in = {{.ndim = 3, .shape = {2, H_SYM(0), H_SYM(1)}, .fill = H_RANDN, .hi = 3,          \
           .diff = true}},                                                                \
   .sym = {3, 5}}

static const h_case act_cases[] = {
    ACT("relu", ACT_RELU),          ACT("leaky_relu 0.1", ACT_LEAKY), ACT("gelu", ACT_GELU),
    ACT("gelu_tanh", ACT_GELU_T),   ACT("silu", ACT_SILU),            ACT("sigmoid", ACT_SIG),
    ACT("tanh", ACT_TANH),          ACT("softplus", ACT_SP),          ACT("softplus beta2 th1", ACT_SP2),
};

static void act_extra(void) {
  kiln_scope_begin();
  /* saturation stays finite and exact at the extremes */
  kiln_tensor *x = H_T(KILN_SHAPE(4), KILN_F32, -100, 100, -1000, 30);
  h_tensor_close("sigmoid extremes", kiln_sigmoid(x), (double[]){0, 1, 0, 1}, 4, 1e-6, 1e-30);
  h_tensor_close("tanh extremes", kiln_tanh(x), (double[]){-1, 1, -1, 1}, 4, 1e-6, 0);
  h_tensor_close("softplus extremes", kiln_softplus(x, 1, 20), (double[]){0, 100, 0, 30}, 4, 1e-6,
                 1e-30);
  h_tensor_close("silu extremes", kiln_silu(x), (double[]){0, 100, 0, 30}, 4, 1e-6, 1e-30);
  /* relu gradient at a negative input is exactly zero */
  kiln_tensor *w = H_T(KILN_SHAPE(3), KILN_F64, -1, 2, -3);
  kiln_requires_grad_(w, true);
  if (H_CHECK(kiln_backward(kiln_sum_all(kiln_relu(w)), NULL) == KILN_OK, "relu backward"))
    h_tensor_close("relu grad", kiln_grad(w), (double[]){0, 1, 0}, 3, 0, 0);
  kiln_clear_error();
  H_CHECK(kiln_relu(kiln_ones(KILN_SHAPE(2), KILN_BOOL, kiln_device_cpu())) == NULL ?
              kiln_last_error() == KILN_ERR_DTYPE : true,
          "relu on bool: KILN_ERR_DTYPE if refused");
  kiln_clear_error();
  kiln_scope_end();
}

/* gelu_tanh and its gradient in f32 and bf16 (GPT-2's MLP under autocast) on a
** contiguous tensor of 1000 + 13 elements (vector chunks and a tail), against the f64
** closed forms on the same (rounded) inputs, and f32 contiguous against f32 strided: the
** CPU runs those two through different loops (AVX-512 with bf16 read and written in the
** loop, and the generic map), which must give the same bits. Tolerance: one rounding of
** the output in the dtype plus a few f32 ulps of the arithmetic (the f32 exp is within
** ~1 ulp, the division and products one each): 2^-20 relative in f32 (of max(|want|,
** 1e-3): tiny outputs near 0 are sums of terms of size ~1 e.g. the derivative) and 2^-8
** in bf16. */
static double act_gelu_tanh_d(double x) {
  double k = sqrt(2.0 / 3.14159265358979323846), t = tanh(k * (x + 0.044715 * x * x * x));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
}

static void act_gelu_tanh_paths(void) {
  const int64_t n = 1013;
  double *x = malloc(sizeof(double) * n), *g = malloc(sizeof(double) * n);
  for (int64_t i = 0; i < n; i++) {
    x[i] = 4 * h_rand_normal();
    g[i] = h_rand_normal();
  }
  x[0] = -30, x[1] = 30, x[2] = 0, x[3] = -1e-6, x[4] = 12; /* saturation, 0, tiny */
  static const kiln_dtype dts[2] = {KILN_F32, KILN_BF16};
  for (int di = 0; di < 2; di++) {
    kiln_scope_begin();
    kiln_dtype dt = dts[di];
    kiln_tensor *xt = h_tensor(x, 1, (int64_t[]){n}, dt), *gt = h_tensor(g, 1, (int64_t[]){n}, dt);
    double *xr = h_values(xt, NULL), *gr = h_values(gt, NULL); /* the rounded inputs */
    double *yw = malloc(sizeof(double) * n), *dw = malloc(sizeof(double) * n);
    for (int64_t i = 0; i < n; i++) yw[i] = act_gelu_tanh(xr[i]), dw[i] = gr[i] * act_gelu_tanh_d(xr[i]);
    kiln_requires_grad_(xt, true);
    kiln_tensor *y = kiln_gelu_tanh(xt);
    kiln_tensor *dx = NULL;
    H_CHECK(y && kiln_autograd_grad(1, &y, &gt, 1, &xt, &dx) == KILN_OK, "gelu_tanh %s backward",
            kiln_dtype_name(dt));
    double tol = dt == KILN_F32 ? 1.0 / (1 << 17) : 1.0 / (1 << 7);
    char what[64];
    snprintf(what, sizeof what, "gelu_tanh %s forward", kiln_dtype_name(dt));
    h_tensor_close(what, y, yw, n, tol, tol);
    snprintf(what, sizeof what, "gelu_tanh %s gradient", kiln_dtype_name(dt));
    h_tensor_close(what, dx, dw, n, tol, tol);
    if (dt == KILN_F32 && y && dx) { /* strided (every other element of a 2n buffer): the same bits */
      double *x2 = calloc((size_t)(2 * n), sizeof(double)), *g2 = calloc((size_t)(2 * n), sizeof(double));
      for (int64_t i = 0; i < n; i++) x2[2 * i] = xr[i], g2[2 * i] = gr[i];
      kiln_tensor *xs = kiln_narrow(kiln_view(h_tensor(x2, 1, (int64_t[]){2 * n}, dt), 2, (int64_t[]){n, 2}), 1, 0, 1);
      kiln_tensor *gs = kiln_narrow(kiln_view(h_tensor(g2, 1, (int64_t[]){2 * n}, dt), 2, (int64_t[]){n, 2}), 1, 0, 1);
      kiln_requires_grad_(xs, true);
      kiln_tensor *ys = kiln_gelu_tanh(xs), *dxs = NULL;
      H_CHECK(ys && kiln_autograd_grad(1, &ys, &gs, 1, &xs, &dxs) == KILN_OK, "gelu_tanh strided backward");
      double *a = h_values(y, NULL), *b = ys ? h_values(ys, NULL) : NULL;
      double *c = h_values(dx, NULL), *d = dxs ? h_values(dxs, NULL) : NULL;
      H_CHECK(a && b && !memcmp(a, b, sizeof(double) * n), "gelu_tanh f32: contiguous and strided the same bits");
      H_CHECK(c && d && !memcmp(c, d, sizeof(double) * n), "gelu_tanh f32 gradient: contiguous and strided the same bits");
      free(a), free(b), free(c), free(d), free(x2), free(g2);
    }
    free(xr), free(gr), free(yw), free(dw);
    kiln_scope_end();
  }
  free(x), free(g);
}

static void act_family(void) {
  h_run_cases(act_cases, (int)(sizeof act_cases / sizeof act_cases[0]));
  if (!h_cross_only()) act_extra();
  if (!h_cross_only()) act_gelu_tanh_paths();
}

#ifndef H_NO_MAIN
int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_activation");
  act_family();
  return h_finish();
}
#endif
