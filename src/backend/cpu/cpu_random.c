/*
** Random kernels. Element k (the C-order linear index within out0) takes its value from
** the core's Philox mapping at (seed, offset, k), so the numbers depend neither on the
** thread count nor on out0's strides, and match every other backend.
** The f32 uniform/normal draw serves f32/f16/bf16 (and integer) outputs, the f64 draw
** serves f64 outputs; RAND_INT always uses the f64 uniform.
*/
#include "cpu.h"
#include "cpu_avx512.h"
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

#ifdef KILN__AVX512
/* The high 32 bits of each lane's 32 x 32-bit product (the low ones: _mm512_mullo_epi32). */
KILN__T512 static inline __m512i kiln__mulhi_epu32(__m512i a, __m512i b) {
  __m512i even = _mm512_mul_epu32(a, b), odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), _mm512_srli_epi64(b, 32));
  return _mm512_mask_blend_epi32((__mmask16)0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

/* f32 uniforms of the 16 blocks at counters c .. c + 15 into v[0 .. 64): rng.c's block
** (the same rounds, integer arithmetic: the same words) and uniform (w >> 8) 2^-24, both
** exact, then the four words of each block put back in element order. */
KILN__T512 static void kiln__uniform64(uint64_t seed, uint64_t c, float *v) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i clo = _mm512_set1_epi32((int)(uint32_t)c), m0 = _mm512_set1_epi32((int)KILN__PHILOX_M0),
                m1 = _mm512_set1_epi32((int)KILN__PHILOX_M1);
  __m512i x0 = _mm512_add_epi32(clo, lane); /* the counter's low word; a carry into the high one */
  __mmask16 carry = _mm512_cmplt_epu32_mask(x0, clo);
  __m512i x1 = _mm512_mask_add_epi32(_mm512_set1_epi32((int)(uint32_t)(c >> 32)), carry,
                                     _mm512_set1_epi32((int)(uint32_t)(c >> 32)), _mm512_set1_epi32(1));
  __m512i x2 = _mm512_setzero_si512(), x3 = _mm512_setzero_si512();
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int r = 0; r < 10; r++) {
    __m512i lo0 = _mm512_mullo_epi32(x0, m0), hi0 = kiln__mulhi_epu32(x0, m0);
    __m512i lo1 = _mm512_mullo_epi32(x2, m1), hi1 = kiln__mulhi_epu32(x2, m1);
    x0 = _mm512_xor_si512(_mm512_xor_si512(hi1, x1), _mm512_set1_epi32((int)k0));
    x2 = _mm512_xor_si512(_mm512_xor_si512(hi0, x3), _mm512_set1_epi32((int)k1));
    x1 = lo1;
    x3 = lo0;
    k0 += KILN__PHILOX_W0;
    k1 += KILN__PHILOX_W1;
  }
  const __m512 scale = _mm512_set1_ps(1.0f / 16777216.0f);
  __m512 w[4];
  const __m512i xs[4] = {x0, x1, x2, x3};
  for (int j = 0; j < 4; j++) w[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(xs[j], 8)), scale);
  /* 4 x 16 -> 16 x 4: word j of block i to v[4 i + j] */
  __m512 t0 = _mm512_unpacklo_ps(w[0], w[1]), t1 = _mm512_unpackhi_ps(w[0], w[1]);
  __m512 t2 = _mm512_unpacklo_ps(w[2], w[3]), t3 = _mm512_unpackhi_ps(w[2], w[3]);
  __m512 u0 = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));
  __m512 u1 = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));
  __m512 u2 = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
  __m512 u3 = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
  __m512 a = _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(1, 0, 1, 0)), b = _mm512_shuffle_f32x4(u2, u3, _MM_SHUFFLE(1, 0, 1, 0));
  __m512 e = _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 2, 3, 2)), f = _mm512_shuffle_f32x4(u2, u3, _MM_SHUFFLE(3, 2, 3, 2));
  _mm512_storeu_ps(v, _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)));
  _mm512_storeu_ps(v + 16, _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  _mm512_storeu_ps(v + 32, _mm512_shuffle_f32x4(e, f, _MM_SHUFFLE(2, 0, 2, 0)));
  _mm512_storeu_ps(v + 48, _mm512_shuffle_f32x4(e, f, _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

/* kiln__draw_f32 of the f32 uniforms: on an AVX-512 CPU 16 blocks at a time between a
** scalar head (to a block boundary) and tail. */
static void kiln__draw_uniform_f32(float *v, int64_t n, int64_t k0, const kiln__kargs *a) {
#ifdef KILN__AVX512
  if (kiln__avx512_ok() && n >= 128) {
    int64_t head = (4 - k0 % 4) % 4, i = head;
    kiln__draw_f32(v, head, k0, a, kiln__philox_uniform_block);
    for (; n - i >= 64; i += 64) kiln__uniform64(a->seed, a->offset + (uint64_t)(k0 + i) / 4, v + i);
    kiln__draw_f32(v + i, n - i, k0 + i, a, kiln__philox_uniform_block);
    return;
  }
#endif
  kiln__draw_f32(v, n, k0, a, kiln__philox_uniform_block);
}

static void kiln__rand_uniform_f32(void *o, const void *const *in, int64_t n, int64_t k0,
                                   const kiln__kargs *a) {
  float *y = (float *)o;
  float lo = (float)a->s[0], hi = (float)a->s[1], w = (float)(a->s[1] - a->s[0]);
  float top = hi > lo ? kiln__below(hi, a->out[0].dtype) : hi;
  (void)in;
  kiln__draw_uniform_f32(y, n, k0, a);
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
  kiln__draw_uniform_f32(y, n, k0, a);
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
