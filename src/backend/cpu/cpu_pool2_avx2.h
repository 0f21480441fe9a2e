/*
** The 2x2 ReLU + max-pool of sixteen columns of two rows, in AVX2 registers: shared by
** RELU_MAX_POOL2D's plane loop (cpu_maxpool.c) and the fused first layer, which pools its
** convolution's rows while they are still in registers (cpu_conv_c1.c). The rule is the
** general loops' (cpu_maxpool.c's header): candidates (0,0), (0,1), (1,0), (1,1), the first
** strict maximum, a NaN over a number; then ReLU. Included only inside an x86-64 guard.
*/
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

/* Row 0's columns 0-7 and 8-15 in a0, a1, row 1's in b0, b1: the eight pooled values
** (ReLU applied), and in *at each one's window offset 0-3 as 32-bit integers. The even and
** odd columns split by a shuffle within 128-bit lanes, then 64-bit blocks 0, 2, 1, 3. */
__attribute__((target("avx2"))) static inline __m256 kiln__rmp2_avx2(__m256 a0, __m256 a1, __m256 b0, __m256 b1,
                                                                      __m256i *at) {
  __m256 cand[4];
  cand[0] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a0, a1, 0x88)), 0xD8));
  cand[1] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a0, a1, 0xDD)), 0xD8));
  cand[2] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(b0, b1, 0x88)), 0xD8));
  cand[3] = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(b0, b1, 0xDD)), 0xD8));
  __m256 best = cand[0], off = _mm256_setzero_ps(); /* offsets as float bits: blended, not computed */
  for (int t = 1; t < 4; t++) {
    __m256 v = cand[t];
    __m256 take = _mm256_or_ps(_mm256_cmp_ps(v, best, _CMP_GT_OQ),
                               _mm256_and_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), _mm256_cmp_ps(best, best, _CMP_ORD_Q)));
    best = _mm256_blendv_ps(best, v, take);
    off = _mm256_blendv_ps(off, _mm256_castsi256_ps(_mm256_set1_epi32(t)), take);
  }
  *at = _mm256_castps_si256(off);
  const __m256 zero = _mm256_setzero_ps();
  return _mm256_blendv_ps(best, zero, _mm256_cmp_ps(best, zero, _CMP_LT_OQ)); /* ReLU */
}

/* The first n (1-8) pooled values to y and their offsets to ix as bytes; fewer than eight
** through a buffer (AMD microcodes masked stores) */
__attribute__((target("avx2"))) static inline void kiln__rmp2_store_avx2(float *y, uint8_t *ix, __m256 v, __m256i at,
                                                                          int64_t n) {
  __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(at), _mm256_extracti128_si256(at, 1));
  __m128i b8 = _mm_packus_epi16(w16, w16);
  if (n == 8) {
    _mm256_storeu_ps(y, v);
    _mm_storel_epi64((__m128i *)ix, b8);
    return;
  }
  float t[8];
  uint8_t tb[16];
  _mm256_storeu_ps(t, v);
  _mm_storeu_si128((__m128i *)tb, b8);
  memcpy(y, t, (size_t)n * sizeof *y);
  memcpy(ix, tb, (size_t)n);
}
