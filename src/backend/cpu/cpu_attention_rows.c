/*
** The row passes of the CPU's bf16 attention, between its products: the forward's softmax
** of a row of f32 scores into bf16 P (with the row's log-sum-exp), and the backward's P
** again from that lse with dS = bf16(P (dP - sum P dP) scale). Shared by the two paths
** that run the products: oneDNN's matmuls (kiln__attb_run, cpu_transformer.c) and
** AVX512-BF16's dot products (cpu_attention_vnni.c), which so round P and dS alike.
*/
#include "cpu.h"
#include "cpu_iter.h"
#include "cpu_avx512.h"

#include <math.h>
#include <string.h>

#define KILN__ATTB_LANES 16

/* x[0..n) rounded to the nearest bf16 (ties to even; a NaN stays a quiet NaN), in place as
** f32 values, and their bits into p when p is given. Integer lanes only, so it vectorises. */
KILN__CPU_CLONES512 static void kiln__attb_round(float *x, uint16_t *p, int64_t n) {
  for (int64_t j = 0; j < n; j++) {
    uint32_t u;
    memcpy(&u, &x[j], 4);
    uint32_t nan = (u & 0x7FFFFFFFu) > 0x7F800000u ? 0x00400000u : 0u;
    uint32_t r = ((u | nan) + (nan ? 0u : 0x7FFFu + ((u >> 16) & 1u))) & 0xFFFF0000u;
    memcpy(&x[j], &r, 4);
    if (p) p[j] = (uint16_t)(r >> 16);
  }
}

/* s_j <- exp(s_j - c) for j < n: kiln__exp16 where the CPU has AVX-512 (kiln__expf's
** values; the generic clone's loop kept its range clamps on every vector), else the loop */
#ifdef KILN__AVX512
KILN__T512 static void kiln__attb_exp16(float *s, int64_t n, float c) {
  __m512 cv = _mm512_set1_ps(c);
  for (int64_t j = 0; j < n; j += 16) {
    __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : kiln__mask16(n - j);
    _mm512_mask_storeu_ps(s + j, k, kiln__exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), cv)));
  }
}
#endif
KILN__CPU_CLONES512 static void kiln__attb_exp(float *s, int64_t n, float c) {
#ifdef KILN__AVX512
  if (kiln__avx512_ok()) {
    kiln__attb_exp16(s, n, c);
    return;
  }
#endif
  for (int64_t j = 0; j < n; j++) s[j] = kiln__expf(s[j] - c);
}

/* Forward row: p_j = bf16(exp(s_j - m) / l) for j < n, 0 in [n, w) (s is overwritten);
** returns lse = m + log l (-inf: no key). One exp an element: the backward's
** bf16(exp(s_j - lse)) is the same number up to the f32 roundings of the two forms, so
** an element of P may differ by one bf16 ulp between the passes (FlashAttention's passes
** differ the same way); exp twice here cost ~0.4 ms of the 2.9 ms forward. */
KILN__CPU_CLONES512 static float kiln__attb_row_fwd(float *s, uint16_t *p, int64_t n, int64_t w) {
  float mv[KILN__ATTB_LANES], lv[KILN__ATTB_LANES];
  for (int k = 0; k < KILN__ATTB_LANES; k++) mv[k] = -INFINITY, lv[k] = 0;
  int64_t j = 0;
  for (; j + KILN__ATTB_LANES <= n; j += KILN__ATTB_LANES)
    for (int k = 0; k < KILN__ATTB_LANES; k++) mv[k] = s[j + k] > mv[k] ? s[j + k] : mv[k];
  float m = -INFINITY;
  for (; j < n; j++) m = s[j] > m ? s[j] : m;
  for (int k = 0; k < KILN__ATTB_LANES; k++) m = mv[k] > m ? mv[k] : m;
  float lse = -INFINITY;
  if (n > 0 && m != -INFINITY) {
    kiln__attb_exp(s, n, m);
    for (j = 0; j + KILN__ATTB_LANES <= n; j += KILN__ATTB_LANES)
      for (int k = 0; k < KILN__ATTB_LANES; k++) lv[k] += s[j + k];
    float l = 0;
    for (; j < n; j++) l += s[j];
    for (int k = 0; k < KILN__ATTB_LANES; k++) l += lv[k];
    lse = m + logf(l);
    float inv = 1.0f / l;
    for (j = 0; j < n; j++) s[j] *= inv;
    kiln__attb_round(s, p, n);
  } else {
    n = 0;
  }
  for (j = n; j < w; j++) p[j] = 0;
  return lse;
}

/* Backward row: p_j as the forward's, delta = sum p_j dp_j, ds_j = bf16(p_j (dp_j - delta)
** scale); s and dp are overwritten. */
KILN__CPU_CLONES512 static void kiln__attb_row_bwd(float *s, float *dp, uint16_t *p, uint16_t *ds, int64_t n, int64_t w,
                                                  float lse, float scale) {
  float dv[KILN__ATTB_LANES];
  for (int k = 0; k < KILN__ATTB_LANES; k++) dv[k] = 0;
  if (lse == -INFINITY) n = 0;
  int64_t j;
  kiln__attb_exp(s, n, lse);
  kiln__attb_round(s, p, n);
  for (j = 0; j + KILN__ATTB_LANES <= n; j += KILN__ATTB_LANES)
    for (int k = 0; k < KILN__ATTB_LANES; k++) dv[k] += s[j + k] * dp[j + k];
  float delta = 0;
  for (; j < n; j++) delta += s[j] * dp[j];
  for (int k = 0; k < KILN__ATTB_LANES; k++) delta += dv[k];
  for (j = 0; j < n; j++) dp[j] = s[j] * (dp[j] - delta) * scale;
  kiln__attb_round(dp, ds, n);
  for (j = n; j < w; j++) p[j] = 0, ds[j] = 0;
}

#ifdef KILN__AVX512
/* The two rows on AVX-512 in fewer passes: forward max, then exp (kiln__exp16_fma) with
** its sum, then P = bf16(e / l) written as bits (3 passes over the row where the loops
** above make 5); backward p = bf16(exp(s - lse)) with delta = sum p dp in the same pass,
** then dS = bf16(p (dp - delta) scale) (2 passes for 5). Statistics in f32 as above; the
** exp in fused multiply-adds differs from kiln__expf by an ulp or two, so an element of
** P or dS may differ by one bf16 ulp from the loops above (the tests hold both to the f64
** reference). Two copies: bf16 rounding by vcvtneps2bf16 where the CPU has AVX512-BF16,
** by integer lanes elsewhere: the same bits. */
#define KILN__ATTB_ROWS16(SUF, TGT, BITS)                                                                       \
  TGT static float kiln__attb_row_fwd16##SUF(float *s, uint16_t *p, int64_t n, int64_t w) {                    \
    __m512 mv = _mm512_set1_ps(-INFINITY);                                                                     \
    for (int64_t j = 0; j < n; j += 16) {                                                                      \
      __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : kiln__mask16(n - j);                                     \
      mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k, s + j));                       \
    }                                                                                                          \
    float m = _mm512_reduce_max_ps(mv), lse = -INFINITY;                                                       \
    if (n > 0 && m != -INFINITY) {                                                                             \
      const __m512 mm = _mm512_set1_ps(m);                                                                     \
      __m512 lv = _mm512_setzero_ps();                                                                         \
      for (int64_t j = 0; j < n; j += 16) {                                                                    \
        __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : kiln__mask16(n - j);                                  \
        __m512 e = _mm512_maskz_mov_ps(k, kiln__exp16_fma(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), mm))); \
        _mm512_mask_storeu_ps(s + j, k, e); /* masked: the next row follows at s + w */                       \
        lv = _mm512_add_ps(lv, e);                                                                             \
      }                                                                                                        \
      float l = _mm512_reduce_add_ps(lv);                                                                      \
      lse = m + logf(l);                                                                                       \
      const __m512 inv = _mm512_set1_ps(1.0f / l);                                                             \
      for (int64_t j = 0; j < n; j += 16) {                                                                    \
        __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : kiln__mask16(n - j);                                   \
        _mm256_mask_storeu_epi16(p + j, k, BITS(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), inv)));                  \
      }                                                                                                        \
    } else {                                                                                                   \
      n = 0;                                                                                                   \
    }                                                                                                          \
    if (w > n) memset(p + n, 0, (size_t)(w - n) * 2);                                                          \
    return lse;                                                                                                \
  }                                                                                                            \
  TGT static void kiln__attb_row_bwd16##SUF(float *s, float *dp, uint16_t *p, uint16_t *ds, int64_t n, int64_t w, \
                                           float lse, float scale) {                                           \
    if (lse == -INFINITY) n = 0;                                                                               \
    const __m512 lv = _mm512_set1_ps(lse);                                                                     \
    __m512 acc = _mm512_setzero_ps();                                                                          \
    for (int64_t j = 0; j < n; j += 16) { /* p, as bits and as its f32 value, and delta */                     \
      __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : kiln__mask16(n - j);                                     \
      __m256i b = BITS(kiln__exp16_fma(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), lv)));                   \
      _mm256_mask_storeu_epi16(p + j, k, b);                                                                   \
      __m512 pr = _mm512_maskz_mov_ps(k, kiln__bf16f32_16(b));                                                 \
      _mm512_mask_storeu_ps(s + j, k, pr);                                                                     \
      acc = _mm512_fmadd_ps(pr, _mm512_maskz_loadu_ps(k, dp + j), acc);                                        \
    }                                                                                                          \
    const __m512 dv = _mm512_set1_ps(_mm512_reduce_add_ps(acc)), sc = _mm512_set1_ps(scale);                   \
    for (int64_t j = 0; j < n; j += 16) {                                                                      \
      __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : kiln__mask16(n - j);                                     \
      __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), _mm512_sub_ps(_mm512_maskz_loadu_ps(k, dp + j), dv)), sc); \
      _mm256_mask_storeu_epi16(ds + j, k, BITS(t));                                                            \
    }                                                                                                          \
    if (w > n) memset(p + n, 0, (size_t)(w - n) * 2), memset(ds + n, 0, (size_t)(w - n) * 2);                  \
  }
KILN__ATTB_ROWS16(_sw, KILN__T512, kiln__bf16bits16)
KILN__ATTB_ROWS16(_bf, KILN__T512BF, kiln__bf16bits16_cvt)
#endif

/* The row passes in the best form this CPU runs (cpu.h; cpu_attention_vnni.c takes them too). */
float kiln__attb_row_forward(float *s, uint16_t *p, int64_t n, int64_t w) {
#ifdef KILN__AVX512
  if (kiln__avx512bf16_ok()) return kiln__attb_row_fwd16_bf(s, p, n, w);
  if (kiln__avx512_ok()) return kiln__attb_row_fwd16_sw(s, p, n, w);
#endif
  return kiln__attb_row_fwd(s, p, n, w);
}

void kiln__attb_row_backward(float *s, float *dp, uint16_t *p, uint16_t *ds, int64_t n, int64_t w, float lse,
                             float scale) {
#ifdef KILN__AVX512
  if (kiln__avx512bf16_ok()) {
    kiln__attb_row_bwd16_bf(s, dp, p, ds, n, w, lse, scale);
    return;
  }
  if (kiln__avx512_ok()) {
    kiln__attb_row_bwd16_sw(s, dp, p, ds, n, w, lse, scale);
    return;
  }
#endif
  kiln__attb_row_bwd(s, dp, p, ds, n, w, lse, scale);
}

