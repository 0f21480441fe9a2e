#version 450
// FILL (and memset of odd byte ranges): view 0 = the value's bits in its dtype, made on the
// host (i[0] low word, i[1] high word; i[2] element size), so no dtype needs arithmetic.
#include "common.glsl"
layout(local_size_x = 256) in;

void main() {
  Params P = pc.P;
  int k = int(kv_linear_group() * 256u + gl_LocalInvocationID.x);
  if (k >= P.n) return;
  int o[KV_MAXV];
  kv_offsets(k, o);
  uint64_t a = P.addr[0];
  uint lo = uint(P.i[0]), hi = uint(P.i[1]);
  int es = P.i[2];
  if (es == 4) BU32(a).v[o[0]] = lo;
  else if (es == 8) BU64(a).v[o[0]] = (uint64_t(hi) << 32) | uint64_t(lo);
  else if (es == 2) BU16(a).v[o[0]] = uint16_t(lo);
  else BU8(a).v[o[0]] = uint8_t(lo);
}
