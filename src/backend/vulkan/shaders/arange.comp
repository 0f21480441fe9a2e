#version 450
// ARANGE in f64 (s[0] + k*s[1] as the CPU computes it, then one conversion to the view's
// dtype), for devices with shaderFloat64 only: the host passes the two doubles as bits
// (ex[0..1] start, ex[2..3] step). RAND_INT (op 1): i[0], i[1] low word/high word of the
// seed, ex[4..5] offset, ex[6..7] low (i64), ex[8..9] high (i64); u is rng.c's f64
// Philox uniform of element k (block offset + k/2, lanes 2(k%2), 2(k%2)+1) and the value
// low + floor(u * (double(high) - double(low))), clamped to [low, high - 1] as the CPU.
#extension GL_EXT_shader_explicit_arithmetic_types_float64 : require
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

uint64_t u64_of(int lo, int hi) { return (uint64_t(uint(hi)) << 32) | uint64_t(uint(lo)); }

void main() {
  Params P = pc.P;
  int k = int(kv_linear_group() * 256u + gl_LocalInvocationID.x);
  if (k >= P.n) return;
  int o[KV_MAXV];
  kv_offsets(k, o);
  if (P.op == 1) {
    uint64_t off = u64_of(P.ex[4], P.ex[5]) + uint64_t(k / 2);
    uvec4 b = philox(uvec2(uint(P.i[0]), uint(P.i[1])), uvec4(uint(off), uint(off >> 32), 0u, 0u));
    uint w0 = (k % 2) == 0 ? b.x : b.z, w1 = (k % 2) == 0 ? b.y : b.w;
    precise double u = (double(w0 >> 5) * 67108864.0lf + double(w1 >> 6)) * (1.0lf / 9007199254740992.0lf);
    int64_t lo = int64_t(u64_of(P.ex[6], P.ex[7])), hi = int64_t(u64_of(P.ex[8], P.ex[9]));
    precise double span = double(hi) - double(lo);
    precise double t = u * span;
    int64_t v = lo + int64_t(floor(t));
    if (v > hi - 1l) v = hi - 1l;
    if (v < lo) v = lo;
    kv_sti(0, o[0], v);
    return;
  }
  double s0 = uint64BitsToDouble(u64_of(P.ex[0], P.ex[1]));
  double s1 = uint64BitsToDouble(u64_of(P.ex[2], P.ex[3]));
  precise double x = s0 + double(k) * s1;
  int dt = P.dtype[0];
  if (dt == KV_F64) BU64(P.addr[0]).v[o[0]] = doubleBitsToUint64(x);
  else if (dt == KV_F32 || dt == KV_F16 || dt == KV_BF16) kv_st(0, o[0], float(x));
  else kv_sti(0, o[0], int64_t(x));
}
