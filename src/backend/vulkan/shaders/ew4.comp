#version 450
// The elementwise family's fast path: every view f32, contiguous (one dim of stride 1
// after the host merged dims) and 16-byte aligned, so each invocation moves vec4s, and
// the grid is capped and walked in strides (each invocation takes several vec4s), which
// is what brings a large add near the device's copy bandwidth. Ops and Params as ew.comp
// (not WHERE, not integers); the last n % 4 elements are done one by one.
#include "common.glsl"
layout(local_size_x = 256) in;
#include "ew.glsl"

layout(buffer_reference, std430, buffer_reference_align = 16) buffer BV4 { vec4 v[]; };

float one(int op, float x, float y) {
  if (op < KV_RELU_BW) return unary(op, x);
  if (op < KV_ADD) return backward(op, x, y);
  return binary(op, x, y);
}

void main() {
  Params P = pc.P;
  int op = P.op;
  bool two = op >= KV_RELU_BW;
  uint n4 = uint(P.n) / 4u;
  uint stride = gl_NumWorkGroups.x * gl_NumWorkGroups.y * 256u;
  BV4 o = BV4(P.addr[0]), a = BV4(P.addr[1]), b = BV4(two ? P.addr[2] : P.addr[1]);
  for (uint k = kv_linear_group() * 256u + gl_LocalInvocationID.x; k < n4; k += stride) {
    vec4 x = a.v[k], y = two ? b.v[k] : x, r;
    r.x = one(op, x.x, y.x);
    r.y = one(op, x.y, y.y);
    r.z = one(op, x.z, y.z);
    r.w = one(op, x.w, y.w);
    o.v[k] = r;
  }
  uint t = n4 * 4u + kv_linear_group() * 256u + gl_LocalInvocationID.x;
  if (t < uint(P.n)) {
    float x = BF32(P.addr[1]).v[t], y = two ? BF32(P.addr[2]).v[t] : x;
    BF32(P.addr[0]).v[t] = one(op, x, y);
  }
}
