/*
** AVX-512 helpers for the CPU kernels that are written with intrinsics (row loops whose
** portable C the compiler vectorises poorly): a 16-lane exp that is kiln__expf (cpu_iter.h)
** operation for operation, so both give the same bits, and 16-element f32/bf16 loads and
** stores (bf16 rounded to nearest even, a NaN kept quiet: kiln__f32_to_bf16's rule).
** Only where GCC or Clang build for x86-64 (KILN__AVX512 defined); the caller checks
** kiln__avx512_ok() at run time and keeps its portable loop for other CPUs.
*/
#ifndef KILN_CPU_AVX512_H
#define KILN_CPU_AVX512_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

#include "../../core/knobs.h"

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(KILN_NO_TARGET_CLONES)
#include <immintrin.h>
#define KILN__AVX512 1
#define KILN__T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

/* whether this CPU runs KILN__T512 code */
static inline bool kiln__avx512_ok(void) {
  static int ok = -1;
  if (ok < 0)
    ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
}

/* kiln__expf on 16 lanes, operation for operation (no FMA: two roundings each) */
KILN__T512 static inline __m512 kiln__exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f), hi = _mm512_set1_ps(88.7228f), big = _mm512_set1_ps(12582912.0f);
  __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), over = _mm512_cmp_ps_mask(x, hi, _CMP_GT_OQ);
  __mmask16 out = (__mmask16)(nan | under | over); /* lanes outside [-87.3, 88.7228] or NaN */
  __m512 xc = x;
  if (out) { /* rare: the clamps, skipped when every lane is in range (the same values) */
    xc = _mm512_mask_blend_ps(under, x, lo);
    xc = _mm512_mask_blend_ps(over, xc, hi);
    xc = _mm512_mask_blend_ps(nan, xc, _mm512_setzero_ps());
  }
  __m512 t = _mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)), big);
  __m512 n = _mm512_sub_ps(t, big);
  __m512 r = _mm512_sub_ps(xc, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  __m512 y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
  __m512i ni = _mm512_cvttps_epi32(n), h = _mm512_srai_epi32(ni, 1), b127 = _mm512_set1_epi32(127);
  __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(h, b127), 23));
  __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_sub_epi32(ni, h), b127), 23));
  y = _mm512_mul_ps(_mm512_mul_ps(y, s1), s2);
  if (!out) return y;
  y = _mm512_mask_blend_ps(under, y, _mm512_setzero_ps());
  y = _mm512_mask_blend_ps(over, y, _mm512_set1_ps(INFINITY));
  return _mm512_mask_blend_ps(nan, y, x);
}

/* exp on 16 lanes with FMA: n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts, fused),
** kiln__expf's polynomial in Horner form on fused multiply-adds, 2^n by scalef (which also
** gives inf and the subnormal/0 tail without clamps). x is clamped to [-104, 88.8] first
** (past either end the result is 0 or inf anyway; NaN passes). Within 1-2 ulp of expf,
** but not kiln__expf's bits: for kernels whose every path runs it (GELU), not for those
** that must match a scalar loop. About half the instructions of kiln__exp16. */
KILN__T512 static inline __m512 kiln__exp16_fma(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.8f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x)); /* NaN: kept */
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

/* the mask of the first n (< 16) lanes */
static inline __mmask16 kiln__mask16(int64_t n) { return (__mmask16)((1u << n) - 1u); }

/* 16 elements (the lanes of k) of f32 or bf16 (bf: true) at p, widened to f32; others 0 */
KILN__T512 static inline __m512 kiln__load16(const void *p, bool bf, __mmask16 k) {
  if (bf)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
  return _mm512_maskz_loadu_ps(k, p);
}

/* v's 16 lanes rounded to bf16 bits, to nearest even (NaN: quiet) */
KILN__T512 static inline __m256i kiln__bf16bits16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i hi = _mm512_srli_epi32(u, 16);
  __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), _mm512_and_si512(hi, _mm512_set1_epi32(1))), 16);
  __m512i q = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, q);
  return _mm512_cvtepi32_epi16(r);
}

/* 16 bf16 bits widened to f32 (exact) */
KILN__T512 static inline __m512 kiln__bf16f32_16(__m256i b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

/* the lanes of k of v to p as f32, or as bf16 rounded to nearest even (NaN: quiet) */
KILN__T512 static inline void kiln__store16(void *p, __m512 v, bool bf, __mmask16 k) {
  if (!bf) {
    _mm512_mask_storeu_ps(p, k, v);
    return;
  }
  _mm256_mask_storeu_epi16(p, k, kiln__bf16bits16(v));
}

/* AVX512-BF16 (Cooper Lake, Sapphire Rapids): vcvtneps2bf16 rounds 16 f32 lanes to bf16 in
** one instruction, ties to even and NaN quiet as kiln__store16, but it flushes subnormal
** inputs to 0 (kiln__store16 rounds them, as PyTorch's c10::BFloat16 does): a vector with a
** nonzero |value| below FLT_MIN takes kiln__store16 instead, so the bits are the same.
** KILN_CPU_AVX512BF16=0 takes the integer rounding instead (tests run both). */
#define KILN__T512BF __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
static inline bool kiln__avx512bf16_ok(void) {
  static int ok = -1;
  if (ok < 0) {
    ok = kiln__avx512_ok() && __builtin_cpu_supports("avx512bf16") && kiln__knob_on("KILN_CPU_AVX512BF16", true);
  }
  return ok;
}
KILN__T512BF static inline __m256i kiln__bf16bits16_cvt(__m512 v) {
  __m512 a = _mm512_abs_ps(v);
  __mmask16 sub = _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.17549435e-38f), _CMP_LT_OQ) &
                  _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_UQ);
  if (sub) return kiln__bf16bits16(v);
  return (__m256i)_mm512_cvtneps_pbh(v);
}
KILN__T512BF static inline void kiln__store16_bf16cvt(void *p, __m512 v, __mmask16 k) {
  _mm256_mask_storeu_epi16(p, k, kiln__bf16bits16_cvt(v));
}
#endif

#endif /* KILN_CPU_AVX512_H */
