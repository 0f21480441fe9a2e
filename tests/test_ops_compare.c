/*
** Comparisons (bool results) on float and integer dtypes, scalar forms, and where.
** Inputs are small integers so that ties (the == edge of every comparison) are common.
** Names are prefixed cmp_ (tests/test_cuda_ops.c includes this file).
*/
#include "harness.h"

#include <string.h>

typedef struct cmp_ctx {
  kiln_tensor *(*op)(kiln_tensor *, kiln_tensor *);
  kiln_tensor *(*sop)(kiln_tensor *, double);
  double (*f)(double, double);
  double s;
} cmp_ctx;

static double cmp_eq(double a, double b) { return a == b; }
static double cmp_ne(double a, double b) { return a != b; }
static double cmp_lt(double a, double b) { return a < b; }
static double cmp_le(double a, double b) { return a <= b; }
static double cmp_gt(double a, double b) { return a > b; }
static double cmp_ge(double a, double b) { return a >= b; }
static double cmp_where(double c, double a, double b) { return c != 0 ? a : b; }

static kiln_tensor *cmp_b(kiln_tensor **in, const void *ctx) {
  const cmp_ctx *c = ctx;
  kiln_tensor *r = c->op ? c->op(in[0], in[1]) : c->sop(in[0], c->s);
  if (r && kiln_dtype_of(r) != KILN_BOOL) {
    kiln_set_error(KILN_ERR_DTYPE, "test: comparison gave %s, not bool",
                   kiln_dtype_name(kiln_dtype_of(r)));
    return NULL;
  }
  return r;
}
static const cmp_ctx *cmp_cur;
static double cmp_sf(double a) { return cmp_cur->f(a, cmp_cur->s); }
static int cmp_r(const h_arr *in, int n, h_arr *out, const void *ctx) {
  (void)n;
  const cmp_ctx *c = ctx;
  if (c->op) return h_ref_map2(&in[0], &in[1], out, c->f);
  cmp_cur = c;
  return h_ref_map1(&in[0], out, cmp_sf);
}
static kiln_tensor *cmp_bw(kiln_tensor **in, const void *ctx) {
  (void)ctx;
  return kiln_where(in[0], in[1], in[2]);
}
static int cmp_rw(const h_arr *in, int n, h_arr *out, const void *ctx) {
  (void)n, (void)ctx;
  return h_ref_map3(&in[0], &in[1], &in[2], out, cmp_where);
}

#define CI {.ndim = 2, .shape = {H_SYM(0), H_SYM(1)}, .fill = H_INTVAL, .lo = -2, .hi = 2}
#define CMP(nm, o, fn_)                                                                   \
  {.name = nm, .fn = cmp_b, .ref = cmp_r, .ctx = &(const cmp_ctx){.op = o, .f = fn_},      \
   .n_in = 2, .in = {CI, CI}, .sym = {3, 4}, .flags = H_BROADCAST | H_INT_DTYPES}
#define CMPS(nm, o, fn_, sv)                                                              \
  {.name = nm, .fn = cmp_b, .ref = cmp_r,                                                 \
   .ctx = &(const cmp_ctx){.sop = o, .f = fn_, .s = sv}, .n_in = 1, .in = {CI},           \
   .sym = {3, 4}, .flags = H_INT_DTYPES}

static const h_case cmp_cases[] = {
    CMP("eq", kiln_eq, cmp_eq), CMP("ne", kiln_ne, cmp_ne), CMP("lt", kiln_lt, cmp_lt),
    CMP("le", kiln_le, cmp_le), CMP("gt", kiln_gt, cmp_gt), CMP("ge", kiln_ge, cmp_ge),
    CMPS("gt_scalar 0", kiln_gt_scalar, cmp_gt, 0), CMPS("lt_scalar 1", kiln_lt_scalar, cmp_lt, 1),
    CMPS("eq_scalar -1", kiln_eq_scalar, cmp_eq, -1),
    CMPS("gt_scalar 0.5 (non-integer)", kiln_gt_scalar, cmp_gt, 0.5),
    {.name = "where bool cond", .fn = cmp_bw, .ref = cmp_rw, .n_in = 3,
     .in = {{.ndim = 2, .shape = {H_SYM(0), H_SYM(1)}, .fill = H_BOOLS},
            {.ndim = 2, .shape = {H_SYM(0), H_SYM(1)}, .fill = H_RANDN, .diff = true},
            {.ndim = 2, .shape = {H_SYM(0), H_SYM(1)}, .fill = H_RANDN, .diff = true}},
     .sym = {3, 4}, .flags = H_BROADCAST},
    {.name = "where float cond (nonzero is true)", .fn = cmp_bw, .ref = cmp_rw, .n_in = 3,
     .in = {{.ndim = 2, .shape = {H_SYM(0), H_SYM(1)}, .fill = H_INTVAL, .lo = -1, .hi = 1},
            {.ndim = 1, .shape = {H_SYM(1)}, .fill = H_RANDN, .diff = true},
            {.ndim = 2, .shape = {H_SYM(0), 1}, .fill = H_RANDN, .diff = true}},
     .sym = {3, 4}},
};

static void cmp_extra(void) {
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();
  kiln_tensor *a = H_T(KILN_SHAPE(4), KILN_F32, 1, NAN, 3, -INFINITY);
  kiln_tensor *b = H_T(KILN_SHAPE(4), KILN_F32, 1, NAN, 2, -INFINITY);
  h_tensor_close("eq with NaN and -inf", kiln_eq(a, b), (double[]){1, 0, 0, 1}, 4, 0, 0);
  h_tensor_close("ne with NaN", kiln_ne(a, b), (double[]){0, 1, 1, 0}, 4, 0, 0);
  h_tensor_close("lt with NaN", kiln_lt(a, b), (double[]){0, 0, 0, 0}, 4, 0, 0);
  /* mixed dtypes compare after promotion: int 2 vs float 2.5 */
  kiln_tensor *i = H_T(KILN_SHAPE(2), KILN_I64, 2, 3);
  kiln_tensor *f = H_T(KILN_SHAPE(2), KILN_F32, 2.5, 2.5);
  h_tensor_close("lt i64 vs f32", kiln_lt(i, f), (double[]){1, 0}, 2, 0, 0);
  /* large int64 values compare exactly (not through double rounding) */
  kiln_tensor *big1 = kiln_full(KILN_SHAPE(1), 9007199254740993.0, KILN_I64, cpu);
  kiln_tensor *big2 = kiln_full(KILN_SHAPE(1), 9007199254740992.0, KILN_I64, cpu);
  int64_t v1 = 0, v2 = 0;
  if (big1 && big2 && kiln_to_host(big1, &v1, 8) == KILN_OK && kiln_to_host(big2, &v2, 8) == KILN_OK &&
      v1 != v2) {
    kiln_tensor *g = kiln_gt(big1, big2);
    H_CHECK(g && kiln_item(g) == 1, "int64 2^53+1 > 2^53");
  }
  /* comparisons carry no gradient */
  kiln_tensor *x = kiln_ones(KILN_SHAPE(2), KILN_F64, cpu);
  kiln_requires_grad_(x, true);
  kiln_tensor *c = kiln_gt(x, kiln_zeros(KILN_SHAPE(2), KILN_F64, cpu));
  H_CHECK(c && !kiln_requires_grad(c), "gt result does not require grad");
  /* where: the gradient of the unused branch is zero */
  kiln_tensor *cond = H_T(KILN_SHAPE(3), KILN_BOOL, 1, 0, 1);
  kiln_tensor *p = kiln_ones(KILN_SHAPE(3), KILN_F64, cpu), *q = kiln_ones(KILN_SHAPE(3), KILN_F64, cpu);
  kiln_requires_grad_(p, true), kiln_requires_grad_(q, true);
  if (H_CHECK(kiln_backward(kiln_sum_all(kiln_where(cond, p, q)), NULL) == KILN_OK, "where backward")) {
    h_tensor_close("where grad a", kiln_grad(p), (double[]){1, 0, 1}, 3, 0, 0);
    h_tensor_close("where grad b", kiln_grad(q), (double[]){0, 1, 0}, 3, 0, 0);
  }
  H_EXPECT_ERR(kiln_eq(kiln_ones(KILN_SHAPE(2), KILN_F32, cpu), kiln_ones(KILN_SHAPE(3), KILN_F32, cpu)),
               KILN_ERR_SHAPE, "eq [2] vs [3]");
  kiln_scope_end();
}

static void cmp_family(void) {
  h_run_cases(cmp_cases, (int)(sizeof cmp_cases / sizeof cmp_cases[0]));
  if (!h_cross_only()) cmp_extra();
}

#ifndef H_NO_MAIN
int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_compare");
  cmp_family();
  return h_finish();
}
#endif
