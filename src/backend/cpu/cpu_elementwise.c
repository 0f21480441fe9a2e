/*
** Elementwise kernels: copy/cast, fill, arange, eye, unary ops and their backward rules,
** binary arithmetic and comparisons, where. Each op is a loop over contiguous arrays of
** its compute type (f32 for f32/f16/bf16, f64, or i64 for integers and bool), written
** once per type by macro; kiln__cpu_map feeds it strided/broadcast/16-bit views chunk by
** chunk, and hands it the tensors' own memory when they already are of that type and
** contiguous, so the common case is one vectorizable loop.
*/
/* Kernels never read the FP exception flags, so comparisons may be treated as not
** trapping: that is what lets GCC turn the selects in these loops (clamps, relu, NaN
** checks, the range limits of kiln__expf) into vector blends instead of branches. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-trapping-math")
#endif
#include "cpu.h"
#include "cpu_iter.h"
#include "cpu_avx512.h"

#include <stdint.h>
#include <string.h>
#include <tgmath.h>

/* Saturating double -> int64 for integer scalars (inf bounds of clamp, etc.). */
static int64_t kiln__sat(double v) {
  if (v != v) return 0;
  if (v >= 9223372036854775807.0) return INT64_MAX;
  if (v <= -9223372036854775808.0) return INT64_MIN;
  return (int64_t)v;
}

#define KILN__VEC_HEAD(NAME)                                                              \
  static void NAME(void *o_, const void *const *in, int64_t n, int64_t k0,                \
                   const kiln__kargs *a)

/* unary: v = input, r = result; s0 s1 scalars */
#define KILN__U(NAME, T, BODY)                                                            \
  KILN__VEC_HEAD(NAME) {                                                                  \
    T *y = (T *)o_;                                                                       \
    const T *x = (const T *)in[0];                                                        \
    const T s0 = (T)a->s[0], s1 = (T)a->s[1];                                             \
    (void)k0;                                                                             \
    (void)s0;                                                                             \
    (void)s1;                                                                             \
    for (int64_t i = 0; i < n; i++) {                                                     \
      const T v = x[i];                                                                   \
      T r;                                                                                \
      BODY;                                                                               \
      y[i] = r;                                                                           \
    }                                                                                     \
  }
#define KILN__UI(NAME, BODY)                                                              \
  KILN__VEC_HEAD(NAME) {                                                                  \
    int64_t *y = (int64_t *)o_;                                                           \
    const int64_t *x = (const int64_t *)in[0];                                            \
    const int64_t s0 = kiln__sat(a->s[0]), s1 = kiln__sat(a->s[1]);                       \
    (void)k0;                                                                             \
    (void)s0;                                                                             \
    (void)s1;                                                                             \
    for (int64_t i = 0; i < n; i++) {                                                     \
      const int64_t v = x[i];                                                             \
      int64_t r;                                                                          \
      BODY;                                                                               \
      y[i] = r;                                                                           \
    }                                                                                     \
  }
/* two inputs: x, y (binary) or v = forward input/output, g = grad (backward) */
#define KILN__B(NAME, T, BODY)                                                            \
  KILN__VEC_HEAD(NAME) {                                                                  \
    T *z = (T *)o_;                                                                       \
    const T *x = (const T *)in[0];                                                        \
    const T *y = (const T *)in[1];                                                        \
    const T s0 = (T)a->s[0], s1 = (T)a->s[1];                                             \
    (void)k0;                                                                             \
    (void)s0;                                                                             \
    (void)s1;                                                                             \
    for (int64_t i = 0; i < n; i++) {                                                     \
      const T v = x[i], g = y[i];                                                         \
      T r;                                                                                \
      BODY;                                                                               \
      z[i] = r;                                                                           \
    }                                                                                     \
  }
#define KILN__BI(NAME, BODY)                                                              \
  KILN__VEC_HEAD(NAME) {                                                                  \
    int64_t *z = (int64_t *)o_;                                                           \
    const int64_t *x = (const int64_t *)in[0];                                            \
    const int64_t *y = (const int64_t *)in[1];                                            \
    const int64_t s0 = kiln__sat(a->s[0]);                                                \
    (void)k0;                                                                             \
    (void)s0;                                                                             \
    for (int64_t i = 0; i < n; i++) {                                                     \
      const int64_t v = x[i], g = y[i];                                                   \
      int64_t r;                                                                          \
      BODY;                                                                               \
      z[i] = r;                                                                           \
    }                                                                                     \
  }
/* comparisons: bool (uint8 0/1) out */
#define KILN__C(NAME, T, EXPR)                                                            \
  KILN__VEC_HEAD(NAME) {                                                                  \
    uint8_t *z = (uint8_t *)o_;                                                           \
    const T *x = (const T *)in[0];                                                        \
    const T *y = (const T *)in[1];                                                        \
    (void)k0;                                                                             \
    (void)a;                                                                              \
    for (int64_t i = 0; i < n; i++) {                                                     \
      const T v = x[i], g = y[i];                                                         \
      z[i] = (uint8_t)(EXPR);                                                             \
    }                                                                                     \
  }

#define KILN__UF(NAME, BODY)                                                              \
  KILN__U(NAME##_f32, float, BODY)                                                        \
  KILN__U(NAME##_f64, double, BODY)
#define KILN__BF(NAME, BODY)                                                              \
  KILN__B(NAME##_f32, float, BODY)                                                        \
  KILN__B(NAME##_f64, double, BODY)
#define KILN__CF(NAME, EXPR)                                                              \
  KILN__C(NAME##_f64, double, EXPR)                                                       \
  KILN__C(NAME##_i64, int64_t, EXPR)

/* exp and tanh of the element's own type: the vectorizable f32 versions, libm for f64 */
#define KILN__EXP(v) _Generic((v), float: kiln__expf, default: exp)(v)
#define KILN__TANH(v) _Generic((v), float: kiln__tanhf, default: tanh)(v)

/* 1/sqrt(2), sqrt(2/pi), 1/sqrt(2*pi) */
#define KILN__RSQRT2 0.70710678118654752440
#define KILN__SQRT_2_PI 0.79788456080286535588
#define KILN__RSQRT_2PI 0.39894228040143267794

/* ---- unary ---- */
KILN__UF(neg, r = -v)
KILN__UI(neg_i64, r = (int64_t)(0u - (uint64_t)v))
KILN__UF(abs, r = fabs(v))
KILN__UI(abs_i64, r = v < 0 ? (int64_t)(0u - (uint64_t)v) : v)
KILN__UF(sign, r = v > 0 ? 1 : (v < 0 ? -1 : v)) /* keeps +-0 and NaN */
KILN__UI(sign_i64, r = (v > 0) - (v < 0))
KILN__UF(exp, r = KILN__EXP(v))
KILN__UF(log, r = log(v))
KILN__UF(sqrt, r = sqrt(v))
KILN__UF(rsqrt, r = 1 / sqrt(v))
KILN__UF(relu, r = v < 0 ? 0 : v) /* NaN passes through, as in PyTorch */
KILN__UI(relu_i64, r = v < 0 ? 0 : v)
KILN__UF(leaky_relu, r = v > 0 ? v : v * s0)
KILN__U(gelu_f32, float, r = 0.5f * v * (1.0f + erf(v * (float)KILN__RSQRT2)))
KILN__U(gelu_f64, double, r = 0.5 * v * (1.0 + erf(v * KILN__RSQRT2)))
/* The tanh GELU (GPT-2's MLP), f32: 0.5 v (1 + tanh(u)) = v sigmoid(2u) = v / (1 + exp(-2u)),
** u = sqrt(2/pi) (v + 0.044715 v^3): one exp and one division, no cancellation near 0 (the
** tanh form needed tanhf's polynomial branch there). On a CPU with AVX-512 every f32 GELU
** (a contiguous f32/bf16 tensor in one pass, kiln__gelu_fast, and the chunks the walker
** hands gelu_tanh_f32 for strided or f16 ones) runs kiln__gelu16: the same numbers for
** any layout. Elsewhere the portable loops (gelu_tanh_f32_c, AVX2 clones where GCC
** builds for x86-64), which differ from kiln__gelu16 by an ulp or two (its exp and
** polynomial in fused multiply-adds). */
#define KILN__GELU_K2 ((float)(-2.0 * KILN__SQRT_2_PI))
KILN__CPU_CLONES512
KILN__U(gelu_tanh_f32_c, float, r = v / (1.0f + kiln__expf(KILN__GELU_K2 * (v + 0.044715f * v * v * v))))
KILN__U(gelu_tanh_f64, double,
        r = 0.5 * v * (1.0 + tanh(KILN__SQRT_2_PI * (v + 0.044715 * v * v * v))))
KILN__UF(silu, r = v / (1 + KILN__EXP(-v)))
KILN__UF(sigmoid, r = 1 / (1 + KILN__EXP(-v)))
KILN__UF(tanh, r = KILN__TANH(v))
/* softplus(x) = log(1 + exp(beta x)) / beta, linear above the threshold (PyTorch's) */
KILN__UF(softplus, r = v * s0 > s1 ? v : log1p(exp(v * s0)) / s0)
KILN__UF(clamp, r = v < s0 ? s0 : v; r = r > s1 ? s1 : r)
KILN__UI(clamp_i64, r = v < s0 ? s0 : v; r = r > s1 ? s1 : r)
/* squares and square roots are the common exponents; pow() is slow and not vectorized */
KILN__UF(pow_scalar, r = s0 == 2 ? v * v : (s0 == 1 ? v : (s0 == 0.5 ? sqrt(v) : pow(v, s0))))
KILN__UF(affine, r = v * s0 + s1)
KILN__VEC_HEAD(affine_i64) {
  int64_t *y = (int64_t *)o_;
  const int64_t *x = (const int64_t *)in[0];
  (void)k0;
  for (int64_t i = 0; i < n; i++) y[i] = kiln__sat((double)x[i] * a->s[0] + a->s[1]);
}

/* ---- unary backward: v = x (or y), g = grad ---- */
KILN__BF(relu_bw, r = v > 0 ? g : 0)
KILN__BF(leaky_relu_bw, r = v > 0 ? g : g * s0)
KILN__B(gelu_bw_f32, float,
        r = g * (0.5f * (1.0f + erf(v * (float)KILN__RSQRT2)) +
                 v * (float)KILN__RSQRT_2PI * exp(-0.5f * v * v)))
KILN__B(gelu_bw_f64, double,
        r = g * (0.5 * (1.0 + erf(v * KILN__RSQRT2)) + v * KILN__RSQRT_2PI * exp(-0.5 * v * v)))
/* its derivative in the same terms: s = sigmoid(2u) = 1 / (1 + exp(-2u)),
** d/dv = s + 2 v s (1 - s) u', u' = sqrt(2/pi) (1 + 3 0.044715 v^2) (= the tanh form's
** 0.5 (1 + t) + 0.5 v (1 - t^2) u' with t = 2s - 1) */
KILN__CPU_CLONES512
KILN__B(gelu_tanh_bw_f32_c, float, {
  float s = 1.0f / (1.0f + kiln__expf(KILN__GELU_K2 * (v + 0.044715f * v * v * v)));
  float du = (float)KILN__SQRT_2_PI * (1.0f + 3.0f * 0.044715f * v * v);
  r = g * (s + 2.0f * v * s * (1.0f - s) * du);
})
KILN__B(gelu_tanh_bw_f64, double, {
  double t = tanh(KILN__SQRT_2_PI * (v + 0.044715 * v * v * v));
  r = g * (0.5 * (1.0 + t) +
           0.5 * v * (1.0 - t * t) * KILN__SQRT_2_PI * (1.0 + 3.0 * 0.044715 * v * v));
})
#ifdef KILN__AVX512
/* GELU_TANH and its backward, 16 lanes, f32 arithmetic on f32 or bf16 memory (bf16 read
** and written in the loop: the generic map widened each 256-element chunk into a buffer).
** -2u = v (k2 + k2 0.044715 v^2) (k2 = -2 sqrt(2/pi)), e = exp(-2u) (kiln__exp16_fma),
** y = v / (1 + e); the backward's s = 1 / (1 + e), u' = sqrt(2/pi) + 3 0.044715 sqrt(2/pi)
** v^2, dx = g (s + 2 v s (1 - s) u') with s (1 - s) = s - s s fused. The exact divisions
** stay (a reciprocal estimate saved nothing measurable: the loop is bound by the exp and
** the memory). A GPT's (2048, 1024) bf16 GELU: 1.37 -> 0.78 ms on one core with the FMA
** exp and vcvtneps2bf16 stores, against kiln__exp16 and the integer rounding. */
typedef struct kiln__gelu_job {
  const char *x, *g;
  char *y;
  bool bf, bw;
} kiln__gelu_job;

#define KILN__GELU_K2C ((float)(-2.0 * KILN__SQRT_2_PI * 0.044715))
#define KILN__GELU_KD ((float)KILN__SQRT_2_PI)
#define KILN__GELU_KD3 ((float)(KILN__SQRT_2_PI * 3.0 * 0.044715))

KILN__T512 static inline __m512 kiln__gelu16(__m512 v) {
  __m512 v2 = _mm512_mul_ps(v, v);
  __m512 m2u = _mm512_mul_ps(v, _mm512_fmadd_ps(_mm512_set1_ps(KILN__GELU_K2C), v2, _mm512_set1_ps(KILN__GELU_K2)));
  return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), kiln__exp16_fma(m2u)));
}

KILN__T512 static inline __m512 kiln__gelu16_bw(__m512 v, __m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 v2 = _mm512_mul_ps(v, v);
  __m512 m2u = _mm512_mul_ps(v, _mm512_fmadd_ps(_mm512_set1_ps(KILN__GELU_K2C), v2, _mm512_set1_ps(KILN__GELU_K2)));
  __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, kiln__exp16_fma(m2u)));
  __m512 du = _mm512_fmadd_ps(_mm512_set1_ps(KILN__GELU_KD3), v2, _mm512_set1_ps(KILN__GELU_KD));
  __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_add_ps(v, v), _mm512_fnmadd_ps(s, s, s)), du);
  return _mm512_mul_ps(g, _mm512_add_ps(s, t));
}

KILN__T512 static void kiln__gelu16_range(void *vctx, int64_t lo, int64_t hi) {
  const kiln__gelu_job *j = vctx;
  const int64_t es = j->bf ? 2 : 4;
  for (int64_t i = lo; i < hi; i += 16) {
    __mmask16 k = hi - i >= 16 ? (__mmask16)0xFFFF : kiln__mask16(hi - i);
    __m512 v = kiln__load16(j->x + i * es, j->bf, k);
    __m512 r = j->bw ? kiln__gelu16_bw(v, kiln__load16(j->g + i * es, j->bf, k)) : kiln__gelu16(v);
    kiln__store16(j->y + i * es, r, j->bf, k);
  }
}

/* bf16 memory on a CPU with AVX512-BF16: the same values, stored by vcvtneps2bf16 */
KILN__T512BF static void kiln__gelu16_range_bf(void *vctx, int64_t lo, int64_t hi) {
  const kiln__gelu_job *j = vctx;
  for (int64_t i = lo; i < hi; i += 16) {
    __mmask16 k = hi - i >= 16 ? (__mmask16)0xFFFF : kiln__mask16(hi - i);
    __m512 v = kiln__load16(j->x + i * 2, true, k);
    __m512 r = j->bw ? kiln__gelu16_bw(v, kiln__load16(j->g + i * 2, true, k)) : kiln__gelu16(v);
    kiln__store16_bf16cvt(j->y + i * 2, r, k);
  }
}
#endif

/* the walker's f32 GELU (strided, broadcast or f16 tensors, chunk by chunk): kiln__gelu16
** where the CPU has AVX-512, so every layout gives the contiguous path's bits */
KILN__VEC_HEAD(gelu_tanh_f32) {
#ifdef KILN__AVX512
  if (kiln__avx512_ok()) {
    kiln__gelu_job j = {in[0], NULL, o_, false, false};
    kiln__gelu16_range(&j, 0, n);
    return;
  }
#endif
  gelu_tanh_f32_c(o_, in, n, k0, a);
}
KILN__VEC_HEAD(gelu_tanh_bw_f32) {
#ifdef KILN__AVX512
  if (kiln__avx512_ok()) {
    kiln__gelu_job j = {in[0], in[1], o_, false, true};
    kiln__gelu16_range(&j, 0, n);
    return;
  }
#endif
  gelu_tanh_bw_f32_c(o_, in, n, k0, a);
}

/* sigmoid written twice: the compiler folds it, and the macro stays type-generic */
KILN__BF(silu_bw, r = g * (1 / (1 + KILN__EXP(-v))) * (1 + v * (1 - 1 / (1 + KILN__EXP(-v)))))
KILN__BF(sigmoid_bw, r = g * v * (1 - v))
KILN__BF(tanh_bw, r = g * (1 - v * v))
KILN__BF(softplus_bw, r = v * s0 > s1 ? g : g / (1 + exp(-v * s0)))
KILN__BF(clamp_bw, r = (v >= s0 && v <= s1) ? g : 0)

/* ---- binary: v = in0, g = in1 ---- */
/* x + alpha * y (kiln_axpy) is one FMA, as in PyTorch's CPU add: its AVX2 kernels are
** built with FMA contraction, so torch.add(alpha=) rounds once (measured on torch 1.13).
** torch.optim's SGD is made of such adds (p.add_(d_p, alpha=-lr), the momentum buffer,
** weight decay, Nesterov), and kiln's SGD rounds as PyTorch's only with them. Both copies
** compute the same fused value (see KILN__CPU_FMA). */
#define KILN__AXPY(NAME, ATTR, T, KFMA)                                                   \
  static ATTR void NAME(T *z, const T *x, const T *y, T al, int64_t n) {                  \
    for (int64_t i = 0; i < n; i++) z[i] = KFMA(y[i], al, x[i]);                          \
  }
KILN__AXPY(axpy_f32_fma, KILN__CPU_FMA, float, fmaf)
KILN__AXPY(axpy_f32_plain, , float, fmaf)
KILN__AXPY(axpy_f64_fma, KILN__CPU_FMA, double, __builtin_fma)
KILN__AXPY(axpy_f64_plain, , double, __builtin_fma)

KILN__VEC_HEAD(add_f32) {
  float *z = (float *)o_;
  const float *x = (const float *)in[0], *y = (const float *)in[1];
  float al = (float)a->s[0];
  (void)k0;
  if (al == 1.0f) {
    for (int64_t i = 0; i < n; i++) z[i] = x[i] + y[i];
  } else {
    (kiln__cpu_has_fma() ? axpy_f32_fma : axpy_f32_plain)(z, x, y, al, n);
  }
}
KILN__VEC_HEAD(add_f64) {
  double *z = (double *)o_;
  const double *x = (const double *)in[0], *y = (const double *)in[1];
  double al = a->s[0];
  (void)k0;
  if (al == 1.0) {
    for (int64_t i = 0; i < n; i++) z[i] = x[i] + y[i];
  } else {
    (kiln__cpu_has_fma() ? axpy_f64_fma : axpy_f64_plain)(z, x, y, al, n);
  }
}
KILN__BI(add_i64, r = (int64_t)((uint64_t)v + (uint64_t)s0 * (uint64_t)g))
KILN__BF(sub, r = v - g)
KILN__BI(sub_i64, r = (int64_t)((uint64_t)v - (uint64_t)g))
KILN__BF(mul, r = v * g)
KILN__BI(mul_i64, r = (int64_t)((uint64_t)v * (uint64_t)g))
KILN__BF(div, r = v / g)
/* C's truncating division; x/0 gives 0 instead of a crash (PyTorch raises; a kernel must
** not abort), and INT64_MIN/-1 wraps. */
KILN__BI(div_i64, r = g == 0 ? 0 : (g == -1 ? (int64_t)(0u - (uint64_t)v) : v / g))
KILN__BF(pow, r = pow(v, g))
KILN__VEC_HEAD(pow_i64) {
  int64_t *z = (int64_t *)o_;
  const int64_t *x = (const int64_t *)in[0], *y = (const int64_t *)in[1];
  (void)k0;
  (void)a;
  for (int64_t i = 0; i < n; i++) {
    int64_t b = x[i], e = y[i];
    uint64_t r = 1, ub = (uint64_t)b;
    if (e < 0) {
      z[i] = b == 1 ? 1 : (b == -1 ? ((e & 1) ? -1 : 1) : 0);
      continue;
    }
    while (e) { /* square-and-multiply, wrapping like int64 arithmetic */
      if (e & 1) r *= ub;
      ub *= ub;
      e >>= 1;
    }
    z[i] = (int64_t)r;
  }
}
KILN__BF(maximum, r = (v != v || v > g) ? v : g) /* NaN in either wins */
KILN__BI(maximum_i64, r = v > g ? v : g)
KILN__BF(minimum, r = (v != v || v < g) ? v : g)
KILN__BI(minimum_i64, r = v < g ? v : g)
KILN__CF(eq, v == g)
KILN__CF(ne, v != g)
KILN__CF(lt, v < g)
KILN__CF(le, v <= g)
KILN__CF(gt, v > g)
KILN__CF(ge, v >= g)

typedef struct kiln__ew_entry {
  int nin;
  bool heavy; /* transcendental: threads pay off sooner */
  kiln__cpu_vec_fn f32, f64, i64;
} kiln__ew_entry;

#define KILN__E1(OP, NAME) [KILN__K_##OP] = {1, false, NAME##_f32, NAME##_f64, NULL}
#define KILN__E1H(OP, NAME) [KILN__K_##OP] = {1, true, NAME##_f32, NAME##_f64, NULL}
#define KILN__E1I(OP, NAME) [KILN__K_##OP] = {1, false, NAME##_f32, NAME##_f64, NAME##_i64}
#define KILN__E2(OP, NAME) [KILN__K_##OP] = {2, false, NAME##_f32, NAME##_f64, NULL}
#define KILN__E2H(OP, NAME) [KILN__K_##OP] = {2, true, NAME##_f32, NAME##_f64, NULL}
#define KILN__E2I(OP, NAME) [KILN__K_##OP] = {2, false, NAME##_f32, NAME##_f64, NAME##_i64}
#define KILN__E2IH(OP, NAME) [KILN__K_##OP] = {2, true, NAME##_f32, NAME##_f64, NAME##_i64}
#define KILN__EC(OP, NAME) [KILN__K_##OP] = {2, false, NULL, NAME##_f64, NAME##_i64}

static const kiln__ew_entry kiln__ew_table[KILN__K_COUNT] = {
    KILN__E1I(NEG, neg),
    KILN__E1H(EXP, exp),
    KILN__E1H(LOG, log),
    KILN__E1(SQRT, sqrt),
    KILN__E1H(RSQRT, rsqrt),
    KILN__E1I(ABS, abs),
    KILN__E1I(SIGN, sign),
    KILN__E1I(RELU, relu),
    KILN__E1(LEAKY_RELU, leaky_relu),
    KILN__E1H(GELU, gelu),
    KILN__E1H(GELU_TANH, gelu_tanh),
    KILN__E1H(SILU, silu),
    KILN__E1H(SIGMOID, sigmoid),
    KILN__E1H(TANH, tanh),
    KILN__E1H(SOFTPLUS, softplus),
    KILN__E1I(CLAMP, clamp),
    KILN__E1H(POW_SCALAR, pow_scalar),
    KILN__E1I(AFFINE, affine),
    KILN__E2(RELU_BACKWARD, relu_bw),
    KILN__E2(LEAKY_RELU_BACKWARD, leaky_relu_bw),
    KILN__E2H(GELU_BACKWARD, gelu_bw),
    KILN__E2H(GELU_TANH_BACKWARD, gelu_tanh_bw),
    KILN__E2H(SILU_BACKWARD, silu_bw),
    KILN__E2(SIGMOID_BACKWARD, sigmoid_bw),
    KILN__E2(TANH_BACKWARD, tanh_bw),
    KILN__E2H(SOFTPLUS_BACKWARD, softplus_bw),
    KILN__E2(CLAMP_BACKWARD, clamp_bw),
    KILN__E2I(ADD, add),
    KILN__E2I(SUB, sub),
    KILN__E2I(MUL, mul),
    KILN__E2I(DIV, div),
    KILN__E2IH(POW, pow),
    KILN__E2I(MAXIMUM, maximum),
    KILN__E2I(MINIMUM, minimum),
    KILN__EC(EQ, eq),
    KILN__EC(NE, ne),
    KILN__EC(LT, lt),
    KILN__EC(LE, le),
    KILN__EC(GT, gt),
    KILN__EC(GE, ge),
};

/* Whether v is dense in some order of its dims (C order, channels-last, any permutation:
** numel distinct elements in one block that starts at v->data). */
static bool kiln__ew_dense(const kiln__view *v) {
  int64_t st[KILN_MAX_DIMS], sz[KILN_MAX_DIMS];
  int nd = 0;
  for (int d = 0; d < v->ndim; d++) {
    if (v->shape[d] == 0) return false;
    if (v->shape[d] == 1) continue;
    /* insertion by stride, largest first */
    int k = nd++;
    while (k > 0 && st[k - 1] < v->strides[d]) st[k] = st[k - 1], sz[k] = sz[k - 1], k--;
    st[k] = v->strides[d], sz[k] = v->shape[d];
  }
  int64_t want = 1;
  for (int k = nd - 1; k >= 0; k--) {
    if (st[k] != want) return false;
    want *= sz[k];
  }
  return true;
}

/* Elementwise ops whose operands all have one shape and one dense layout (a channels-last
** network's activations and gradients) are one flat run: the walker, which runs along
** the last logical dim, would otherwise take W-long runs of stride C and gather each into
** a buffer (ReLU on fmnist-cnn's (128, 32, 26, 26) channels-last: 3.1 ms against 0.4 ms
** contiguous). The table's functions do not use the element's linear index (k0), so
** the order of the elements does not matter. */
static bool kiln__ew_flatten(const kiln__kargs *a, int nin, kiln__view *out, kiln__view *ins) {
  const kiln__view *o = &a->out[0];
  if (kiln__view_is_contiguous(o) || !kiln__ew_dense(o)) return false;
  for (int i = 0; i < nin; i++) {
    const kiln__view *v = &a->in[i];
    if (v->ndim != o->ndim) return false;
    for (int d = 0; d < o->ndim; d++)
      if (v->shape[d] != o->shape[d] || (o->shape[d] > 1 && v->strides[d] != o->strides[d])) return false;
  }
  int64_t n = kiln__view_numel(o);
  *out = *o;
  out->ndim = 1, out->shape[0] = n, out->strides[0] = 1;
  for (int i = 0; i < nin; i++) {
    ins[i] = a->in[i];
    ins[i].ndim = 1, ins[i].shape[0] = n, ins[i].strides[0] = 1;
  }
  return true;
}


#ifdef KILN__AVX512
typedef struct kiln__gelu_blocks_ctx {
  kiln__gelu_job j;
  int64_t n;
} kiln__gelu_blocks_ctx;

static void kiln__gelu16_blocks(void *vctx, int64_t lo, int64_t hi) {
  kiln__gelu_blocks_ctx *c = vctx;
  int64_t e0 = lo * 16, e1 = hi * 16 < c->n ? hi * 16 : c->n;
  if (c->j.bf && kiln__avx512bf16_ok())
    kiln__gelu16_range_bf(&c->j, e0, e1);
  else
    kiln__gelu16_range(&c->j, e0, e1);
}

static bool kiln__dense(const kiln__view *v, int64_t n) {
  int64_t run = 1;
  for (int d = v->ndim - 1; d >= 0; d--) {
    if (v->shape[d] != 1 && v->strides[d] != run) return false;
    run *= v->shape[d];
  }
  return run == n;
}

/* true when it ran (the arguments its case and the CPU able) */
static bool kiln__gelu_fast(const kiln__kargs *a) {
  bool bw = a->op == KILN__K_GELU_TANH_BACKWARD;
  kiln_dtype dt = a->out[0].dtype;
  if (!kiln__avx512_ok() || (dt != KILN_F32 && dt != KILN_BF16)) return false;
  int64_t n = kiln__view_numel(&a->out[0]);
  for (int i = 0; i < (bw ? 2 : 1); i++)
    if (a->in[i].dtype != dt || kiln__view_numel(&a->in[i]) != n || !kiln__dense(&a->in[i], n)) return false;
  if (!kiln__dense(&a->out[0], n)) return false;
  kiln__gelu_blocks_ctx c = {{a->in[0].data, bw ? a->in[1].data : NULL, a->out[0].data, dt == KILN_BF16, bw}, n};
  if (n > 0) kiln__cpu_parallel_for((n + 15) / 16, KILN__CPU_PAR_MIN / 16, kiln__gelu16_blocks, &c);
  return true;
}

/* ---- dense f32/bf16 casts and adds, 16 lanes ----
** A cast between f32 and bf16, and an add with a bf16 operand or result (alpha as ADD's:
** x + y, or fma(y, alpha, x)), on C-contiguous tensors of one numel: autocast's casts of
** activations and gradients, a transformer's residual adds of the f32 stream and a bf16
** branch. One pass, bf16 widened and rounded in registers; the generic map copied each
** chunk of 256 into a buffer, converted it and ran the op (2-3 passes: a GPT step's casts
** and adds were ~5% of it on 2 cores). The same bits: the op in f32 on the widened
** values, rounded once as kiln__store16 rounds. */
typedef struct kiln__d16 {
  const char *x, *y;
  char *o;
  bool xb, yb, ob, add;
  float al;
  int64_t n;
} kiln__d16;

KILN__T512 static inline __m512 kiln__d16_val(const kiln__d16 *j, int64_t i, __mmask16 k) {
  __m512 x = kiln__load16(j->x + i * (j->xb ? 2 : 4), j->xb, k);
  if (!j->add) return x;
  __m512 y = kiln__load16(j->y + i * (j->yb ? 2 : 4), j->yb, k);
  return j->al == 1.0f ? _mm512_add_ps(x, y) : _mm512_fmadd_ps(y, _mm512_set1_ps(j->al), x);
}

KILN__T512 static void kiln__d16_range(const kiln__d16 *j, int64_t lo, int64_t hi) {
  const int64_t oe = j->ob ? 2 : 4;
  for (int64_t i = lo; i < hi; i += 16) {
    __mmask16 k = hi - i >= 16 ? (__mmask16)0xFFFF : kiln__mask16(hi - i);
    kiln__store16(j->o + i * oe, kiln__d16_val(j, i, k), j->ob, k);
  }
}

KILN__T512BF static void kiln__d16_range_bf(const kiln__d16 *j, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; i += 16) {
    __mmask16 k = hi - i >= 16 ? (__mmask16)0xFFFF : kiln__mask16(hi - i);
    kiln__store16_bf16cvt(j->o + i * 2, kiln__d16_val(j, i, k), k);
  }
}

static void kiln__d16_blocks(void *vctx, int64_t lo, int64_t hi) {
  const kiln__d16 *j = vctx;
  int64_t e0 = lo * 16, e1 = hi * 16 < j->n ? hi * 16 : j->n;
  if (j->ob && kiln__avx512bf16_ok())
    kiln__d16_range_bf(j, e0, e1);
  else
    kiln__d16_range(j, e0, e1);
}

static bool kiln__d16_dt(kiln_dtype dt) { return dt == KILN_F32 || dt == KILN_BF16; }

/* true when it ran: a cast (COPY between f32 and bf16) or an ADD in this case */
static bool kiln__d16_try(const kiln__kargs *a, bool add) {
  if (!kiln__avx512_ok()) return false;
  const int nin = add ? 2 : 1;
  const kiln__view *o = &a->out[0];
  bool any_bf = o->dtype == KILN_BF16;
  int64_t n = kiln__view_numel(o);
  if (!kiln__d16_dt(o->dtype) || !kiln__dense(o, n)) return false;
  for (int i = 0; i < nin; i++) {
    const kiln__view *v = &a->in[i];
    if (!kiln__d16_dt(v->dtype) || kiln__view_numel(v) != n || !kiln__dense(v, n)) return false;
    any_bf = any_bf || v->dtype == KILN_BF16;
  }
  if (!any_bf || (!add && a->in[0].dtype == o->dtype)) return false;
  kiln__d16 j = {.x = a->in[0].data, .y = add ? a->in[1].data : NULL, .o = o->data, .xb = a->in[0].dtype == KILN_BF16,
                 .yb = add && a->in[1].dtype == KILN_BF16, .ob = o->dtype == KILN_BF16, .add = add,
                 .al = add ? (float)a->s[0] : 1.0f, .n = n};
  if (n > 0) kiln__cpu_parallel_for((n + 15) / 16, KILN__CPU_PAR_MIN_CHEAP / 16, kiln__d16_blocks, &j);
  return true;
}
#endif

static kiln_status kiln__ew_run(const kiln__kargs *a, bool cmp) {
  const kiln__ew_entry *e = (unsigned)a->op < KILN__K_COUNT ? &kiln__ew_table[a->op] : NULL;
  if (!e || e->nin == 0)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln_%s: not an elementwise op", kiln__kop_name(a->op));
  kiln_dtype cts[3];
  kiln__cpu_vec_fn fn;
  if (cmp) {
    kiln_dtype d0 = a->in[0].dtype, d1 = a->in[1].dtype;
    bool fl = kiln__cpu_is_float(d0) || kiln__cpu_is_float(d1);
    /* doubles hold every f32/f16/bf16 value exactly; two integers compare as i64 */
    cts[1] = cts[2] = fl ? KILN_F64 : KILN_I64;
    cts[0] = KILN_BOOL;
    fn = fl ? e->f64 : e->i64;
  } else {
    kiln_dtype ct = kiln__cpu_ct(a->out[0].dtype);
    fn = ct == KILN_F32 ? e->f32 : (ct == KILN_F64 ? e->f64 : e->i64);
    if (!fn) return kiln__cpu_dtype_error(a, a->out[0].dtype);
    if (!e->i64) { /* float-only: the inputs must be floats too */
      for (int i = 0; i < e->nin; i++)
        if (!kiln__cpu_is_float(a->in[i].dtype)) return kiln__cpu_dtype_error(a, a->in[i].dtype);
    }
    cts[0] = cts[1] = cts[2] = ct;
  }
  kiln__view fo, fi[2];
  if (kiln__ew_flatten(a, e->nin, &fo, fi))
    return kiln__cpu_map_ex(a, &fo, e->nin, fi, cts, fn, e->heavy ? KILN__CPU_PAR_MIN : KILN__CPU_PAR_MIN_CHEAP);
  return kiln__cpu_map_ex(a, &a->out[0], e->nin, a->in, cts, fn,
                          e->heavy ? KILN__CPU_PAR_MIN : KILN__CPU_PAR_MIN_CHEAP);
}

kiln_status kiln__cpu_unary(const kiln__kargs *a) {
#ifdef KILN__AVX512
  if ((a->op == KILN__K_GELU_TANH || a->op == KILN__K_GELU_TANH_BACKWARD) && kiln__gelu_fast(a)) return KILN_OK;
#endif
  return kiln__ew_run(a, false);
}

kiln_status kiln__cpu_binary(const kiln__kargs *a) {
#ifdef KILN__AVX512
  if (a->op == KILN__K_ADD && kiln__d16_try(a, true)) return KILN_OK;
#endif
  bool cmp = a->op >= KILN__K_EQ && a->op <= KILN__K_GE;
  return kiln__ew_run(a, cmp);
}

/* ---- where ---- */
#define KILN__WHERE(NAME, T)                                                              \
  KILN__VEC_HEAD(NAME) {                                                                  \
    T *z = (T *)o_;                                                                       \
    const uint8_t *c = (const uint8_t *)in[0];                                            \
    const T *x = (const T *)in[1], *y = (const T *)in[2];                                 \
    (void)k0;                                                                             \
    (void)a;                                                                              \
    for (int64_t i = 0; i < n; i++) z[i] = c[i] ? x[i] : y[i];                            \
  }
KILN__WHERE(where_f32, float)
KILN__WHERE(where_f64, double)
KILN__WHERE(where_i64, int64_t)

kiln_status kiln__cpu_where(const kiln__kargs *a) {
  kiln_dtype ct = kiln__cpu_ct(a->out[0].dtype);
  kiln_dtype cts[4] = {ct, KILN_BOOL, ct, ct};
  kiln__cpu_vec_fn fn = ct == KILN_F32 ? where_f32 : (ct == KILN_F64 ? where_f64 : where_i64);
  return kiln__cpu_map(a, &a->out[0], 3, a->in, cts, fn);
}

/* ---- copy ---- */
typedef struct kiln__raw_ctx {
  size_t es;
} kiln__raw_ctx;

/* Same dtype: bits are moved as they are (NaN payloads, -0.0, bool bytes intact). */
static void kiln__raw_run(void *vctx, char *const *p, const int64_t *bst, int64_t n, int64_t k0) {
  size_t es = ((kiln__raw_ctx *)vctx)->es;
  (void)k0;
  if (p[0] == p[1] && bst[0] == bst[1]) return; /* in place: nothing to move */
  if (bst[0] == (int64_t)es && bst[1] == (int64_t)es) {
    memcpy(p[0], p[1], (size_t)n * es);
    return;
  }
  char *d = p[0];
  const char *s = p[1];
  switch (es) {
  case 8:
    for (int64_t i = 0; i < n; i++) *(uint64_t *)(d + i * bst[0]) = *(const uint64_t *)(s + i * bst[1]);
    break;
  case 4:
    for (int64_t i = 0; i < n; i++) *(uint32_t *)(d + i * bst[0]) = *(const uint32_t *)(s + i * bst[1]);
    break;
  case 2:
    for (int64_t i = 0; i < n; i++) *(uint16_t *)(d + i * bst[0]) = *(const uint16_t *)(s + i * bst[1]);
    break;
  default:
    for (int64_t i = 0; i < n; i++) d[i * bst[0]] = s[i * bst[1]];
    break;
  }
}

typedef struct kiln__raw_par {
  kiln__view v[2];
  kiln__raw_ctx rc;
} kiln__raw_par;

static void kiln__raw_range(void *vctx, int64_t lo, int64_t hi) {
  kiln__raw_par *c = (kiln__raw_par *)vctx;
  kiln__cpu_walk(c->v, 2, lo, hi, kiln__raw_run, &c->rc);
}

#define KILN__IDENT(NAME, T)                                                              \
  KILN__VEC_HEAD(NAME) {                                                                  \
    (void)k0;                                                                             \
    (void)a;                                                                              \
    memcpy(o_, in[0], (size_t)n * sizeof(T));                                             \
  }
KILN__IDENT(ident_f32, float)
KILN__IDENT(ident_f64, double)
KILN__IDENT(ident_i64, int64_t)

kiln_status kiln__cpu_copy(const kiln__kargs *a) {
  kiln_dtype od = a->out[0].dtype, id = a->in[0].dtype;
  int64_t numel = kiln__view_numel(&a->out[0]);
  if (numel == 0) return KILN_OK;
  if (od == id) {
    kiln__raw_par c;
    c.v[0] = a->out[0];
    c.v[1] = a->in[0];
    c.rc.es = kiln__cpu_esize(od);
    kiln__views_coalesce(c.v, 2);
    kiln__cpu_parallel_for(numel, KILN__CPU_PAR_MIN_CHEAP, kiln__raw_range, &c);
    return KILN_OK;
  }
#ifdef KILN__AVX512
  if (kiln__d16_try(a, false)) return KILN_OK;
#endif
  kiln_dtype ct;
  if (od == KILN_F64 || id == KILN_F64)
    ct = KILN_F64;
  else if (kiln__cpu_is_float(od) || kiln__cpu_is_float(id))
    ct = KILN_F32; /* f32 <-> 16-bit floats <-> ints: exact enough, and fast */
  else
    ct = KILN_I64;
  kiln_dtype cts[2] = {ct, ct};
  kiln__cpu_vec_fn fn = ct == KILN_F32 ? ident_f32 : (ct == KILN_F64 ? ident_f64 : ident_i64);
  return kiln__cpu_map(a, &a->out[0], 1, a->in, cts, fn);
}

/* ---- fill, arange, eye ---- */
KILN__VEC_HEAD(fill_f32) {
  float *y = (float *)o_, v = (float)a->s[0];
  (void)in;
  (void)k0;
  for (int64_t i = 0; i < n; i++) y[i] = v;
}
KILN__VEC_HEAD(fill_f64) {
  double *y = (double *)o_, v = a->s[0];
  (void)in;
  (void)k0;
  for (int64_t i = 0; i < n; i++) y[i] = v;
}
KILN__VEC_HEAD(fill_i64) {
  int64_t *y = (int64_t *)o_, v = kiln__sat(a->s[0]);
  (void)in;
  (void)k0;
  /* bool: any nonzero (NaN included) is true */
  if (a->out[0].dtype == KILN_BOOL) v = a->s[0] != 0;
  for (int64_t i = 0; i < n; i++) y[i] = v;
}

kiln_status kiln__cpu_fill(const kiln__kargs *a) {
  kiln_dtype ct = kiln__cpu_ct(a->out[0].dtype);
  kiln_dtype cts[1] = {ct};
  kiln__cpu_vec_fn fn = ct == KILN_F32 ? fill_f32 : (ct == KILN_F64 ? fill_f64 : fill_i64);
  return kiln__cpu_map(a, &a->out[0], 0, NULL, cts, fn);
}

KILN__VEC_HEAD(arange_f64) {
  double *y = (double *)o_;
  (void)in;
  for (int64_t i = 0; i < n; i++) y[i] = a->s[0] + (double)(k0 + i) * a->s[1];
}

kiln_status kiln__cpu_arange(const kiln__kargs *a) {
  kiln_dtype cts[1] = {KILN_F64};
  return kiln__cpu_map(a, &a->out[0], 0, NULL, cts, arange_f64);
}

KILN__VEC_HEAD(eye_i64) {
  int64_t *y = (int64_t *)o_;
  int64_t m = a->out[0].shape[1];
  (void)in;
  for (int64_t i = 0; i < n; i++) {
    int64_t k = k0 + i;
    y[i] = (k / m) == (k % m);
  }
}

kiln_status kiln__cpu_eye(const kiln__kargs *a) {
  if (a->out[0].ndim != 2)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_eye: out must be 2-d, got %d dims", a->out[0].ndim);
  kiln_dtype cts[1] = {KILN_I64};
  return kiln__cpu_map(a, &a->out[0], 0, NULL, cts, eye_i64);
}

/* CAST_MULTI: the list's pairs converted one by one by the COPY kernel (on the CPU a list
** saves nothing but dispatches; the numbers are COPY's). */
kiln_status kiln__cpu_cast_multi(const kiln__kargs *a) {
  if (a->list_w != 2 || (a->list_n > 0 && !a->list))
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln cast_multi kernel: expected pairs of views, got groups of %d", a->list_w);
  for (int g = 0; g < a->list_n; g++) {
    kiln__kargs k = {0};
    k.op = KILN__K_COPY;
    k.device = a->device;
    k.n_in = k.n_out = 1;
    k.in[0] = a->list[(size_t)g * 2];
    k.out[0] = a->list[(size_t)g * 2 + 1];
    kiln_status st = kiln__cpu_copy(&k);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}
