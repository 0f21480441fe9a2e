#version 450
// MATMUL's bf16 operands for the f16 tensor cores (matmul_cmv.glsl): one operand, bf16,
// times its lines' power-of-two scales (mm_scale.glsl), as f16 into a packed copy. The
// operand is R rows (ex[0]) of C contiguous elements (ex[1], a multiple of 8; the row
// stride ex[2], a multiple of 8, as are the batch offsets of view 1 and its address 16-byte
// aligned: the host checks), batch z of view 1 (its offset from kv_offsets); the copy
// (view 0) is [batch, R, C] packed. A line is a row (ex[3] == 0: one scale a vector) or a
// column (ex[3] == 1: eight); the lines' largest |x| are f32 bits at view 2, line l of
// batch z at ex[4] + z * ex[5] + l. Each invocation converts one 16-byte vector, the
// workgroups in a 2-d grid (x, y) per batch (z), 256 invocations each.
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#include "common.glsl"
#include "mm_scale.glsl"
layout(local_size_x = 256) in;

layout(buffer_reference, std430, buffer_reference_align = 16) buffer BV8H { uvec4 v[]; };

void main() {
  Params P = pc.P;
  int R = P.ex[0], C8 = P.ex[1] / 8, ld = P.ex[2], per_col = P.ex[3];
  int vec = int(kv_linear_group()) * 256 + int(gl_LocalInvocationID.x);
  if (vec >= R * C8) return;
  int z = int(gl_WorkGroupID.z);
  int o[KV_MAXV];
  kv_offsets(z, o);
  int r = vec / C8, c = (vec % C8) * 8;
  uvec4 w = BV8H(P.addr[1]).v[(o[1] + r * ld + c) >> 3];
  BU32 mx = BU32(P.addr[2]);
  int l0 = P.ex[4] + z * P.ex[5];
  float s[8];
  if (per_col != 0) {
    for (int i = 0; i < 8; i++) s[i] = mm_line_scale(mx.v[l0 + c + i]);
  } else {
    float x = mm_line_scale(mx.v[l0 + r]);
    for (int i = 0; i < 8; i++) s[i] = x;
  }
  uvec4 h;
  for (int i = 0; i < 4; i++)
    h[i] = packHalf2x16(vec2(uintBitsToFloat(w[i] << 16) * s[2 * i], uintBitsToFloat(w[i] & 0xFFFF0000u) * s[2 * i + 1]));
  BV8H(P.addr[0]).v[z * R * C8 + vec] = h;
}
