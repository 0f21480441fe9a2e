/*
** Random kernels. Element k (the C-order linear index within out0) takes its value from
** the core's Philox mapping at (seed, offset, k), so the numbers depend neither on the
** thread count nor on out0's strides, and match every other backend.
** The f32 uniform/normal draw serves f32/f16/bf16 (and integer) outputs, the f64 draw
** serves f64 outputs; RAND_INT always uses the f64 uniform.
*/
#include "cpu.h"
#include "cpu_iter.h"
#include "../../core/kiln_int.h"
#include "../../core/half.h"

#include <math.h>

/* The largest value of dtype dt (f32, f16 or bf16) below hi: lo + (hi-lo)*u with u < 1
** can still round up to hi, in f32 and much more often once stored as 16 bits, and the
** interval is half-open. */
static float kiln__below(float hi, kiln_dtype dt) {
  if (dt != KILN_F16 && dt != KILN_BF16) return nextafterf(hi, -INFINITY);
  bool h = dt == KILN_F16;
  uint16_t b = h ? kiln__f32_to_f16(hi) : kiln__f32_to_bf16(hi);
  float q = h ? kiln__f16_to_f32(b) : kiln__bf16_to_f32(b);
  if (q < hi) return q; /* hi itself is not representable and rounds down */
  if ((b & 0x7fffu) == 0)
    b = 0x8001u; /* +-0: the smallest negative subnormal */
  else if (b & 0x8000u)
    b = (uint16_t)(b + 1); /* negative: one step further from zero */
  else
    b = (uint16_t)(b - 1); /* positive: one step towards zero */
  return h ? kiln__f16_to_f32(b) : kiln__bf16_to_f32(b);
}

/* Elements k0 .. k0 + n of a draw into v, each Philox block computed once: blk gives a
** block's W values (the core's per-block functions, the per-element mapping's bits). */
#define KILN__DRAW_RUN(NAME, T, W)                                                                   \
  static void NAME(T *v, int64_t n, int64_t k0, const kiln__kargs *a, void (*blk)(uint64_t, uint64_t, T *)) { \
    T q[W];                                                                                          \
    uint64_t k = (uint64_t)k0;                                                                       \
    for (int64_t i = 0; i < n;) {                                                                    \
      blk(a->seed, a->offset + k / W, q);                                                            \
      for (uint64_t j = k % W; j < W && i < n; j++, i++, k++) v[i] = q[j];                           \
    }                                                                                                \
  }
KILN__DRAW_RUN(kiln__draw_f32, float, 4)
KILN__DRAW_RUN(kiln__draw_f64, double, 2)

static void kiln__rand_uniform_f32(void *o, const void *const *in, int64_t n, int64_t k0,
                                   const kiln__kargs *a) {
  float *y = (float *)o;
  float lo = (float)a->s[0], hi = (float)a->s[1], w = (float)(a->s[1] - a->s[0]);
  float top = hi > lo ? kiln__below(hi, a->out[0].dtype) : hi;
  (void)in;
  kiln__draw_f32(y, n, k0, a, kiln__philox_uniform_block);
  for (int64_t i = 0; i < n; i++) {
    float v = lo + w * y[i];
    y[i] = v > top ? top : v;
  }
}
static void kiln__rand_uniform_f64(void *o, const void *const *in, int64_t n, int64_t k0,
                                   const kiln__kargs *a) {
  double *y = (double *)o;
  double lo = a->s[0], w = a->s[1] - a->s[0];
  double top = a->s[1] > lo ? nextafter(a->s[1], -INFINITY) : a->s[1];
  (void)in;
  kiln__draw_f64(y, n, k0, a, kiln__philox_uniform_f64_block);
  for (int64_t i = 0; i < n; i++) {
    double v = lo + w * y[i];
    y[i] = v > top ? top : v;
  }
}
static void kiln__rand_normal_f32(void *o, const void *const *in, int64_t n, int64_t k0,
                                  const kiln__kargs *a) {
  float *y = (float *)o;
  float mu = (float)a->s[0], sd = (float)a->s[1];
  (void)in;
  kiln__draw_f32(y, n, k0, a, kiln__philox_normal_block);
  for (int64_t i = 0; i < n; i++) y[i] = mu + sd * y[i];
}
static void kiln__rand_normal_f64(void *o, const void *const *in, int64_t n, int64_t k0,
                                  const kiln__kargs *a) {
  double *y = (double *)o;
  (void)in;
  kiln__draw_f64(y, n, k0, a, kiln__philox_normal_f64_block);
  for (int64_t i = 0; i < n; i++) y[i] = a->s[0] + a->s[1] * y[i];
}
static void kiln__rand_int(void *o, const void *const *in, int64_t n, int64_t k0,
                           const kiln__kargs *a) {
  int64_t *y = (int64_t *)o;
  int64_t lo = a->i[0], hi = a->i[1];
  double span = (double)hi - (double)lo, u[256];
  (void)in;
  for (int64_t i0 = 0; i0 < n; i0 += 256) {
    int64_t m = n - i0 < 256 ? n - i0 : 256;
    kiln__draw_f64(u, m, k0 + i0, a, kiln__philox_uniform_f64_block);
    for (int64_t i = 0; i < m; i++) {
      int64_t v = lo + (int64_t)floor(u[i] * span);
      if (v > hi - 1) v = hi - 1; /* u*span can round up to span */
      if (v < lo) v = lo;
      y[i0 + i] = v;
    }
  }
}
static void kiln__rand_bernoulli_f32(void *o, const void *const *in, int64_t n, int64_t k0,
                                     const kiln__kargs *a) {
  float *y = (float *)o;
  float val = (float)a->s[1];
  (void)in;
  kiln__draw_f32(y, n, k0, a, kiln__philox_uniform_block);
  for (int64_t i = 0; i < n; i++) y[i] = (double)y[i] < a->s[0] ? val : 0.0f;
}
static void kiln__rand_bernoulli_f64(void *o, const void *const *in, int64_t n, int64_t k0,
                                     const kiln__kargs *a) {
  double *y = (double *)o;
  (void)in;
  kiln__draw_f64(y, n, k0, a, kiln__philox_uniform_f64_block);
  for (int64_t i = 0; i < n; i++) y[i] = y[i] < a->s[0] ? a->s[1] : 0.0;
}

kiln_status kiln__cpu_random(const kiln__kargs *a) {
  bool f64 = a->out[0].dtype == KILN_F64;
  kiln_dtype ct = f64 ? KILN_F64 : KILN_F32;
  kiln__cpu_vec_fn fn;
  switch (a->op) {
  case KILN__K_RAND_UNIFORM:
    fn = f64 ? kiln__rand_uniform_f64 : kiln__rand_uniform_f32;
    break;
  case KILN__K_RAND_NORMAL:
    fn = f64 ? kiln__rand_normal_f64 : kiln__rand_normal_f32;
    break;
  case KILN__K_RAND_INT:
    if (a->i[1] <= a->i[0])
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_randint: low %lld must be below high %lld",
                            (long long)a->i[0], (long long)a->i[1]);
    fn = kiln__rand_int;
    ct = KILN_I64;
    break;
  case KILN__K_RAND_BERNOULLI:
    fn = f64 ? kiln__rand_bernoulli_f64 : kiln__rand_bernoulli_f32;
    break;
  default:
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln_%s: not a random op", kiln__kop_name(a->op));
  }
  if ((a->op == KILN__K_RAND_UNIFORM || a->op == KILN__K_RAND_NORMAL) &&
      !kiln__cpu_is_float(a->out[0].dtype))
    return kiln__cpu_dtype_error(a, a->out[0].dtype);
  kiln_dtype cts[1] = {ct};
  return kiln__cpu_map_ex(a, &a->out[0], 0, NULL, cts, fn, KILN__CPU_PAR_MIN);
}
