#version 450
// RAND_UNIFORM, RAND_NORMAL, RAND_BERNOULLI (f32 outputs): Philox4x32-10 with src/core/rng.c's
// mapping, so the same seed gives the same numbers as the CPU (the uniform's and the
// Bernoulli's bits exactly; the normal's through this device's log/cos/sin). Element k
// of view 0 in C order uses block offset + k/4, lane k%4. i[0], i[1]: seed (low, high);
// ex[0], ex[1]: offset (low, high); uniform: s[0] lo, s[1] width, ex[2] the largest
// value (bits); normal: s[0] mean, s[1] std; bernoulli: ex[3] = ceil(p * 2^24), s[1] value.
#include "common.glsl"
layout(local_size_x = 256) in;

uvec4 philox(uvec2 key, uvec4 c) {
  for (int r = 0; r < 10; r++) {
    uint hi0, lo0, hi1, lo1;
    umulExtended(0xD2511F53u, c.x, hi0, lo0);
    umulExtended(0xCD9E8D57u, c.z, hi1, lo1);
    c = uvec4(hi1 ^ c.y ^ key.x, lo1, hi0 ^ c.w ^ key.y, lo0);
    key += uvec2(0x9E3779B9u, 0xBB67AE85u);
  }
  return c;
}

void main() {
  Params P = pc.P;
  int k = int(kv_linear_group() * 256u + gl_LocalInvocationID.x);
  if (k >= P.n) return;
  int o[KV_MAXV];
  kv_offsets(k, o);
  uint64_t off = (uint64_t(uint(P.ex[1])) << 32) | uint64_t(uint(P.ex[0]));
  uint64_t c = off + uint64_t(k / 4);
  uvec4 b = philox(uvec2(uint(P.i[0]), uint(P.i[1])), uvec4(uint(c), uint(c >> 32), 0u, 0u));
  int lane = k % 4;
  const float TWO_M24 = 1.0 / 16777216.0;
  float y;
  if (P.op == KV_RAND_NORMAL) {
    uint w1 = lane < 2 ? b.x : b.z, w2 = lane < 2 ? b.y : b.w;
    float u1 = float((w1 >> 8) + 1u) * TWO_M24, u2 = float(w2 >> 8) * TWO_M24;
    float r = sqrt(-2.0 * log(u1));
    float th = 6.283185307179586 * u2;
    y = P.s[0] + P.s[1] * ((lane % 2) == 0 ? r * cos(th) : r * sin(th));
  } else {
    uint w = b[lane];
    if (P.op == KV_RAND_BERNOULLI) {
      y = (w >> 8) < uint(P.ex[3]) ? P.s[1] : 0.0;
    } else {
      precise float t = P.s[1] * (float(w >> 8) * TWO_M24); // no FMA: the CPU rounds twice
      y = P.s[0] + t;
      float top = intBitsToFloat(P.ex[2]);
      y = y > top ? top : y;
    }
  }
  kv_st(0, o[0], y);
}
