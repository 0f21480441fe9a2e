/*
** Philox4x32-10 on the device, and the exact per-element mapping of kiln's random ops.
**
** NOTE FOR THE LEAD (src/core/rng.c must match this exactly; the CUDA test compares the
** CPU kernels' output with these bit for bit for uniform/int/bernoulli, and to 1e-5 for
** normal, where the device's logf/sinf/cosf may differ from libm by an ulp):
**
**   philox(key, c) -> w[4]: Philox4x32-10 (Salmon et al. 2011, Random123), key words
**     (k0, k1) = (lo32(seed), hi32(seed)), counter words (lo32(c), hi32(c), 0, 0),
**     multipliers 0xD2511F53, 0xCD9E8D57, Weyl constants 0x9E3779B9, 0xBB67AE85; ten
**     rounds, the key bumped before rounds 2..10. A round, with (hi, lo) = 64-bit product:
**       (h0, l0) = M0 * x0; (h1, l1) = M1 * x2;
**       x = (h1 ^ x1 ^ k0, l1, h0 ^ x3 ^ k1, l0)
**     This equals kiln_philox4x32(seed, 0, c, w).
**
**   Element k is the k-th element of out0 in C order; o = a->offset, s = a->seed.
**   f32 uniform (also f16, bf16): w = philox(s, o + k/4)[k%4]; u = (w >> 8) * 2^-24.
**   f64 uniform: w = philox(s, o + k/2); a = w[2*(k%2)], b = w[2*(k%2)+1];
**     u = ((a >> 5) * 2^26 + (b >> 6)) * 2^-53.
**   f32 normal (also f16, bf16): w = philox(s, o + k/4); p = (k%4)/2;
**     u1 = ((w[2p] >> 8) + 1) * 2^-24  (in (0, 1]),  u2 = (w[2p+1] >> 8) * 2^-24;
**     r = sqrtf(-2 * logf(u1)); t = 6.2831853071795864769f * u2 (a float product);
**     n = k even ? r * cosf(t) : r * sinf(t)   (all in float).
**   f64 normal: w = philox(s, o + k/2);
**     u1 = ((w0 >> 5) * 2^26 + (w1 >> 6) + 1) * 2^-53,  u2 = ((w2 >> 5) * 2^26 + (w3 >> 6)) * 2^-53;
**     r = sqrt(-2 log u1); n = k even ? r cos(2 pi u2) : r sin(2 pi u2)  (in double).
**   RAND_UNIFORM: out = lo + w * u with lo = (float)s0, w = (float)(s1 - s0), in float
**     for f32/f16/bf16 (then rounded), s0 + (s1 - s0) * u in double for f64; no fused
**     multiply-add (the device uses __fmul_rn/__fadd_rn so that it matches the host).
**   RAND_NORMAL:  out = (float)s0 + (float)s1 * n, likewise (double for f64).
**   RAND_INT (any output dtype): u is the f64 uniform above (so ranges past 2^24 stay
**     uniform); v = i0 + (int64)floor(u * ((double)i1 - (double)i0)), clamped to
**     [i0, i1 - 1].
**   RAND_BERNOULLI: u is the f32 uniform for f32/f16/bf16 outputs and the f64 uniform for
**     f64 (and the f32 one for integer outputs); out = ((double)u < s0) ? s1 : 0.
**   Counters used: ceil(n/4) blocks for the f32 mappings, ceil(n/2) for the f64 ones
**     (RAND_INT, f64 outputs); rng.c reserves ceil(n/2), which covers both.
*/
#ifndef KILN_PHILOX_CUH
#define KILN_PHILOX_CUH

#include <stdint.h>

struct kc_u32x4 {
  uint32_t x[4];
};

__host__ __device__ __forceinline__ kc_u32x4 kc_philox(uint64_t seed, uint64_t c) {
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  uint32_t x0 = (uint32_t)c, x1 = (uint32_t)(c >> 32), x2 = 0, x3 = 0;
  for (int r = 0; r < 10; r++) { /* nvcc unrolls this constant loop */
    if (r > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    uint64_t p0 = (uint64_t)0xD2511F53u * x0;
    uint64_t p1 = (uint64_t)0xCD9E8D57u * x2;
    uint32_t h0 = (uint32_t)(p0 >> 32), l0 = (uint32_t)p0;
    uint32_t h1 = (uint32_t)(p1 >> 32), l1 = (uint32_t)p1;
    x0 = h1 ^ x1 ^ k0;
    x1 = l1;
    x2 = h0 ^ x3 ^ k1;
    x3 = l0;
  }
  kc_u32x4 o;
  o.x[0] = x0;
  o.x[1] = x1;
  o.x[2] = x2;
  o.x[3] = x3;
  return o;
}

__host__ __device__ __forceinline__ float kc_u01_f32(uint32_t w) {
  return (float)(w >> 8) * (1.0f / 16777216.0f);
}
__host__ __device__ __forceinline__ double kc_u01_f64(uint32_t a, uint32_t b) {
  return ((double)(a >> 5) * 67108864.0 + (double)(b >> 6)) * (1.0 / 9007199254740992.0);
}
/* The normal pair from words (a, b) of the f32 mapping; lane 0 cos, lane 1 sin. */
__device__ __forceinline__ float kc_normal_f32(uint32_t a, uint32_t b, int odd) {
  float u1 = (float)((a >> 8) + 1) * (1.0f / 16777216.0f);
  float u2 = (float)(b >> 8) * (1.0f / 16777216.0f);
  float r = sqrtf(-2.0f * logf(u1));
  float t = 6.2831853071795864769f * u2;
  return odd ? r * sinf(t) : r * cosf(t);
}
__device__ __forceinline__ double kc_normal_f64(const kc_u32x4 &w, int odd) {
  double u1 = ((double)(w.x[0] >> 5) * 67108864.0 + (double)(w.x[1] >> 6) + 1.0) *
              (1.0 / 9007199254740992.0);
  double u2 = ((double)(w.x[2] >> 5) * 67108864.0 + (double)(w.x[3] >> 6)) *
              (1.0 / 9007199254740992.0);
  double r = sqrt(-2.0 * log(u1));
  double t = 6.283185307179586476925286766559 * u2;
  return odd ? r * sin(t) : r * cos(t);
}

#endif /* KILN_PHILOX_CUH */
