/*
** Element-wise arithmetic: binary ops with broadcasting, scalar forms, axpy, unary math.
** Names are prefixed ew_ because tests/test_cuda_ops.c includes this file.
*/
#include "harness.h"

#include <stdlib.h>
#include <string.h>

typedef struct ew_bin {
  kiln_tensor *(*op)(kiln_tensor *, kiln_tensor *);
  double (*f)(double, double);
} ew_bin;
typedef struct ew_un {
  kiln_tensor *(*op)(kiln_tensor *);
  double (*f)(double);
} ew_un;

static kiln_tensor *ew_b_bin(kiln_tensor **in, const void *ctx) {
  return ((const ew_bin *)ctx)->op(in[0], in[1]);
}
static int ew_r_bin(const h_arr *in, int n, h_arr *out, const void *ctx) {
  (void)n;
  return h_ref_map2(&in[0], &in[1], out, ((const ew_bin *)ctx)->f);
}
static kiln_tensor *ew_b_un(kiln_tensor **in, const void *ctx) {
  return ((const ew_un *)ctx)->op(in[0]);
}
static int ew_r_un(const h_arr *in, int n, h_arr *out, const void *ctx) {
  (void)n;
  return h_ref_map1(&in[0], out, ((const ew_un *)ctx)->f);
}

static double ew_add(double a, double b) { return a + b; }
static double ew_sub(double a, double b) { return a - b; }
static double ew_mul(double a, double b) { return a * b; }
static double ew_div(double a, double b) { return a / b; }
static double ew_pow(double a, double b) { return pow(a, b); }
static double ew_max(double a, double b) { return a > b ? a : b; }
static double ew_min(double a, double b) { return a < b ? a : b; }
static double ew_axpyf(double a, double b) { return a + 0.7 * b; }
static kiln_tensor *ew_axpy07(kiln_tensor *a, kiln_tensor *b) { return kiln_axpy(a, 0.7, b); }

static const ew_bin EW_ADD = {kiln_add, ew_add}, EW_SUB = {kiln_sub, ew_sub},
                    EW_MUL = {kiln_mul, ew_mul}, EW_DIV = {kiln_div, ew_div},
                    EW_POW = {kiln_pow, ew_pow}, EW_MAX = {kiln_maximum, ew_max},
                    EW_MIN = {kiln_minimum, ew_min}, EW_AXPY = {ew_axpy07, ew_axpyf};

static double ew_neg(double x) { return -x; }
static double ew_expf(double x) { return exp(x); }
static double ew_logf(double x) { return log(x); }
static double ew_sqrtf(double x) { return sqrt(x); }
static double ew_rsqrtf(double x) { return 1.0 / sqrt(x); }
static double ew_absf(double x) { return fabs(x); }
static double ew_clampf(double x) { return x < -0.5 ? -0.5 : x > 0.7 ? 0.7 : x; }
static double ew_clamp_hi(double x) { return x > 0.3 ? 0.3 : x; }
static double ew_clamp_lo(double x) { return x < 0.1 ? 0.1 : x; }
static double ew_adds(double x) { return x + 2.5; }
static double ew_muls(double x) { return x * -1.5; }
static double ew_pows(double x) { return pow(x, 2.5); }
static double ew_pow2(double x) { return x * x; }
static double ew_pow3(double x) { return x * x * x; }
static double ew_powh(double x) { return sqrt(x); }
static kiln_tensor *ew_clamp(kiln_tensor *t) { return kiln_clamp(t, -0.5, 0.7); }
static kiln_tensor *ew_clamph(kiln_tensor *t) { return kiln_clamp(t, -INFINITY, 0.3); }
static kiln_tensor *ew_clampl(kiln_tensor *t) { return kiln_clamp(t, 0.1, INFINITY); }
static kiln_tensor *ew_addsop(kiln_tensor *t) { return kiln_add_scalar(t, 2.5); }
static kiln_tensor *ew_mulsop(kiln_tensor *t) { return kiln_mul_scalar(t, -1.5); }
static kiln_tensor *ew_powsop(kiln_tensor *t) { return kiln_pow_scalar(t, 2.5); }
static kiln_tensor *ew_pow2op(kiln_tensor *t) { return kiln_pow_scalar(t, 2.0); }
static kiln_tensor *ew_pow3op(kiln_tensor *t) { return kiln_pow_scalar(t, 3.0); }
static kiln_tensor *ew_powhop(kiln_tensor *t) { return kiln_pow_scalar(t, 0.5); }

static const ew_un EW_NEG = {kiln_neg, ew_neg}, EW_EXP = {kiln_exp, ew_expf},
                   EW_LOG = {kiln_log, ew_logf}, EW_SQRT = {kiln_sqrt, ew_sqrtf},
                   EW_RSQRT = {kiln_rsqrt, ew_rsqrtf}, EW_ABS = {kiln_abs, ew_absf},
                   EW_CLAMP = {ew_clamp, ew_clampf}, EW_CLAMPH = {ew_clamph, ew_clamp_hi},
                   EW_CLAMPL = {ew_clampl, ew_clamp_lo}, EW_ADDS = {ew_addsop, ew_adds},
                   EW_MULS = {ew_mulsop, ew_muls}, EW_POWS = {ew_powsop, ew_pows},
                   EW_POW2 = {ew_pow2op, ew_pow2}, EW_POW3 = {ew_pow3op, ew_pow3},
                   EW_POWH = {ew_powhop, ew_powh};

#define EW_M(fl) {.ndim = 2, .shape = {H_SYM(0), H_SYM(1)}, .fill = (fl), .diff = true}
#define EW_M3(fl) {.ndim = 3, .shape = {2, H_SYM(0), H_SYM(1)}, .fill = (fl), .diff = true}
#define EW_BIN(nm, c, fa, fb, fl)                                                         \
  {.name = nm, .fn = ew_b_bin, .ref = ew_r_bin, .ctx = &c, .n_in = 2,                     \
   .in = {EW_M(fa), EW_M(fb)}, .sym = {3, 4}, .flags = H_BROADCAST | (fl)}
#define EW_UN(nm, c, fa, fl)                                                              \
  {.name = nm, .fn = ew_b_un, .ref = ew_r_un, .ctx = &c, .n_in = 1, .in = {EW_M3(fa)},    \
   .sym = {3, 4}, .flags = (fl)}

static const h_case ew_cases[] = {
    EW_BIN("add", EW_ADD, H_RANDN, H_RANDN, H_INT_DTYPES),
    EW_BIN("sub", EW_SUB, H_RANDN, H_RANDN, H_INT_DTYPES),
    EW_BIN("mul", EW_MUL, H_RANDN, H_RANDN, H_INT_DTYPES),
    EW_BIN("div", EW_DIV, H_RANDN, H_POSITIVE, 0),
    EW_BIN("pow", EW_POW, H_POSITIVE, H_RANDN, 0),
    EW_BIN("maximum", EW_MAX, H_RANDN, H_RANDN, H_INT_DTYPES),
    EW_BIN("minimum", EW_MIN, H_RANDN, H_RANDN, H_INT_DTYPES),
    EW_BIN("axpy", EW_AXPY, H_RANDN, H_RANDN, 0),
    /* rank-3 against a row vector, the bias-add shape */
    {.name = "add 3d+row", .fn = ew_b_bin, .ref = ew_r_bin, .ctx = &EW_ADD, .n_in = 2,
     .in = {EW_M3(H_RANDN), {.ndim = 1, .shape = {H_SYM(1)}, .fill = H_RANDN, .diff = true}},
     .sym = {3, 4}},
    {.name = "mul col*row", .fn = ew_b_bin, .ref = ew_r_bin, .ctx = &EW_MUL, .n_in = 2,
     .in = {{.ndim = 2, .shape = {H_SYM(0), 1}, .fill = H_RANDN, .diff = true},
            {.ndim = 1, .shape = {H_SYM(1)}, .fill = H_RANDN, .diff = true}},
     .sym = {3, 4}},
    {.name = "mul by 0-dim", .fn = ew_b_bin, .ref = ew_r_bin, .ctx = &EW_MUL, .n_in = 2,
     .in = {EW_M(H_RANDN), {.ndim = 0, .fill = H_RANDN, .diff = true}}, .sym = {3, 4}},
    EW_UN("add_scalar", EW_ADDS, H_RANDN, 0),
    EW_UN("mul_scalar", EW_MULS, H_RANDN, 0),
    EW_UN("pow_scalar 2.5", EW_POWS, H_POSITIVE, 0),
    EW_UN("pow_scalar 2 (negative base)", EW_POW2, H_RANDN, 0),
    EW_UN("pow_scalar 3 (negative base)", EW_POW3, H_RANDN, 0),
    EW_UN("pow_scalar 0.5", EW_POWH, H_POSITIVE, 0),
    EW_UN("neg", EW_NEG, H_RANDN, H_INT_DTYPES),
    EW_UN("exp", EW_EXP, H_RANDN, 0),
    EW_UN("log", EW_LOG, H_POSITIVE, 0),
    EW_UN("sqrt", EW_SQRT, H_POSITIVE, 0),
    EW_UN("rsqrt", EW_RSQRT, H_POSITIVE, 0),
    EW_UN("abs", EW_ABS, H_RANDN, H_INT_DTYPES),
    EW_UN("clamp [-0.5, 0.7]", EW_CLAMP, H_RANDN, 0),
    EW_UN("clamp [-inf, 0.3]", EW_CLAMPH, H_RANDN, 0),
    EW_UN("clamp [0.1, inf]", EW_CLAMPL, H_RANDN, 0),
};

/* Hand-written checks the case table cannot express. */
static void ew_extra(void) {
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();
  /* dtype promotion (PyTorch's table) */
  kiln_tensor *f32 = kiln_ones(KILN_SHAPE(2), KILN_F32, cpu);
  kiln_tensor *f64 = kiln_ones(KILN_SHAPE(2), KILN_F64, cpu);
  kiln_tensor *i64 = kiln_ones(KILN_SHAPE(2), KILN_I64, cpu);
  kiln_tensor *i32 = kiln_ones(KILN_SHAPE(2), KILN_I32, cpu);
  kiln_tensor *f16 = kiln_ones(KILN_SHAPE(2), KILN_F16, cpu);
  kiln_tensor *bf16 = kiln_ones(KILN_SHAPE(2), KILN_BF16, cpu);
  kiln_tensor *r;
  r = kiln_add(f32, f64);
  H_CHECK(r && kiln_dtype_of(r) == KILN_F64, "add f32+f64 gives float64");
  r = kiln_add(i64, f32);
  H_CHECK(r && kiln_dtype_of(r) == KILN_F32, "add i64+f32 gives float32");
  r = kiln_add(i32, i64);
  H_CHECK(r && kiln_dtype_of(r) == KILN_I64, "add i32+i64 gives int64");
  r = kiln_mul(f16, bf16);
  H_CHECK(r && kiln_dtype_of(r) == KILN_F32, "mul f16*bf16 gives float32");
  r = kiln_mul(f16, f32);
  H_CHECK(r && kiln_dtype_of(r) == KILN_F32, "mul f16*f32 gives float32");
  H_CHECK(kiln_dtype_promote(KILN_BOOL, KILN_U8) == KILN_U8, "promote bool,u8 -> u8");
  H_CHECK(kiln_dtype_promote(KILN_U8, KILN_I32) == KILN_I32, "promote u8,i32 -> i32");
  r = kiln_add_scalar(i64, 2);
  H_CHECK(r && kiln_dtype_of(r) == KILN_I64 && kiln_get(r, (int64_t[]){1}) == 3,
          "add_scalar keeps int64 and adds");
  r = kiln_mul_scalar(f16, 3);
  H_CHECK(r && kiln_dtype_of(r) == KILN_F16 && kiln_get(r, (int64_t[]){0}) == 3,
          "mul_scalar keeps float16");

  /* mixed-dtype binary: values right after promotion */
  kiln_tensor *a = H_T(KILN_SHAPE(3), KILN_I64, 1, 2, 3);
  kiln_tensor *b = H_T(KILN_SHAPE(3), KILN_F32, 0.5, 0.25, 0.125);
  h_tensor_close("add i64+f32 values", kiln_add(a, b), (double[]){1.5, 2.25, 3.125}, 3, 0, 0);
  /* integer division truncates toward zero (the backend's documented rule) */
  kiln_tensor *n = H_T(KILN_SHAPE(4), KILN_I64, 7, -7, 7, -7);
  kiln_tensor *d = H_T(KILN_SHAPE(4), KILN_I64, 2, 2, -2, -2);
  kiln_tensor *q = kiln_div(n, d);
  if (q && kiln_dtype_of(q) == KILN_I64)
    h_tensor_close("div i64 truncates", q, (double[]){3, -3, -3, 3}, 4, 0, 0);
  else if (q)
    h_tensor_close("div i64 true division", q, (double[]){3.5, -3.5, -3.5, 3.5}, 4, 0, 0);
  else H_CHECK(false, "div i64 failed");

  /* special values */
  kiln_tensor *s = H_T(KILN_SHAPE(4), KILN_F32, 0, -1, INFINITY, NAN);
  h_tensor_close("log special", kiln_log(s), (double[]){-INFINITY, NAN, INFINITY, NAN}, 4, 0, 0);
  h_tensor_close("sqrt special", kiln_sqrt(s), (double[]){0, NAN, INFINITY, NAN}, 4, 0, 0);
  h_tensor_close("maximum propagates NaN",
                 kiln_maximum(s, kiln_zeros(KILN_SHAPE(4), KILN_F32, cpu)),
                 (double[]){0, 0, INFINITY, NAN}, 4, 0, 0);
  h_tensor_close("exp overflow", kiln_exp(H_T(KILN_SHAPE(2), KILN_F32, 100, -200)),
                 (double[]){INFINITY, 0}, 2, 0, 0);

  /* shape mismatch names the op and both shapes */
  kiln_clear_error();
  r = kiln_add(kiln_ones(KILN_SHAPE(2, 3), KILN_F32, cpu), kiln_ones(KILN_SHAPE(4), KILN_F32, cpu));
  const char *m = kiln_last_error_message();
  H_CHECK(!r && kiln_last_error() == KILN_ERR_SHAPE && strstr(m, "add") && strstr(m, "[2, 3]") &&
              strstr(m, "[4]"),
          "add [2,3]+[4]: KILN_ERR_SHAPE naming op and shapes, got \"%s\"", m);
  kiln_clear_error();
  /* NULL in, NULL out, last error untouched */
  kiln_set_error(KILN_ERR_IO, "sentinel");
  H_CHECK(!kiln_add(NULL, f32) && !kiln_exp(NULL) && !kiln_axpy(f32, 1, NULL) &&
              kiln_last_error() == KILN_ERR_IO && strcmp(kiln_last_error_message(), "sentinel") == 0,
          "NULL inputs give NULL without touching the last error");
  kiln_clear_error();
  /* integer dtypes: exp is a floating op */
  r = kiln_exp(i64);
  H_CHECK(r == NULL ? kiln_last_error() == KILN_ERR_DTYPE : kiln_dtype_is_float(kiln_dtype_of(r)),
          "exp on int64 is KILN_ERR_DTYPE or promotes to float");
  kiln_clear_error();
  kiln_scope_end();
}

static void ew_family(void) {
  h_run_cases(ew_cases, (int)(sizeof ew_cases / sizeof ew_cases[0]));
  if (!h_cross_only()) ew_extra();
}

#ifndef H_NO_MAIN
int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_elementwise");
  ew_family();
  return h_finish();
}
#endif
