/*
** Activations against closed-form f64 references (PyTorch's definitions).
** Names are prefixed act_ because tests/test_cuda_ops.c includes this file.
*/
#include "harness.h"

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

static void act_family(void) {
  h_run_cases(act_cases, (int)(sizeof act_cases / sizeof act_cases[0]));
  if (!h_cross_only()) act_extra();
}

#ifndef H_NO_MAIN
int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_activation");
  act_family();
  return h_finish();
}
#endif
