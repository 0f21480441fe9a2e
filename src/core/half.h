/*
** f16 and bf16 <-> f32, inline, for kernels and the core. Round to nearest even;
** NaN stays NaN (quiet), infinities and subnormals are exact where representable.
*/
#ifndef KILN_HALF_H
#define KILN_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t kiln__f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static inline float kiln__bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline float kiln__bf16_to_f32(uint16_t b) { return kiln__bits_f32((uint32_t)b << 16); }

static inline uint16_t kiln__f32_to_bf16(float f) {
  uint32_t u = kiln__f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7fffu + ((u >> 16) & 1u);                                           /* RNE */
  return (uint16_t)(u >> 16);
}

static inline float kiln__f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else { /* subnormal: normalise */
      int e = -1;
      do {
        e++;
        man <<= 1;
      } while ((man & 0x400u) == 0);
      u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  return kiln__bits_f32(u);
}

static inline uint16_t kiln__f32_to_f16(float f) {
  uint32_t u = kiln__f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u); /* NaN */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* overflow (after rounding) */
  if (a < 0x38800000u) {                                     /* subnormal or zero in f16 */
    if (a < 0x33000000u) return (uint16_t)sign;              /* below half the smallest */
    uint32_t e = a >> 23;
    uint32_t man = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e; /* 14 - (e - 127) + 13 - 1 ... gives bits to drop */
    uint32_t r = man >> shift;
    uint32_t rem = man & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) r++;
    return (uint16_t)(sign | r);
  }
  uint32_t r = ((a >> 13) - ((127 - 15) << 10));
  uint32_t rem = a & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
  return (uint16_t)(sign | r);
}

#endif /* KILN_HALF_H */
