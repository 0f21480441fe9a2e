#version 450
// MATMUL's bf16 scales (for matmul_cm*_bf16, which run bf16 products on f16 tensor cores):
// the largest |x| of each row (or column) of one operand, as f32 bits atomically maxed into
// view 0 (zeroed by the host first; non-negative floats order as their bits do; a NaN or
// an infinity records +inf). ex[0] T: the lines (rows or columns) kept, ex[1] R: the
// elements each reduces, ex[2] / ex[3]: the operand's stride along a line's index / along
// the reduced dim. Invocation x of the grid takes line x and R-chunk y (64 elements), batch
// z: view 1's batch offset from kv_offsets (views 0 and 1 walked over the batch dims), the
// output's line at z * T + x.
#include "common.glsl"
layout(local_size_x = 256) in;

void main() {
  Params P = pc.P;
  int T = P.ex[0], R = P.ex[1], st = P.ex[2], sr = P.ex[3];
  int t = int(gl_GlobalInvocationID.x);
  if (t >= T) return;
  int o[KV_MAXV];
  kv_offsets(int(gl_WorkGroupID.z), o);
  int r0 = int(gl_WorkGroupID.y) * 64, r1 = min(r0 + 64, R);
  float m = 0.0;
  for (int r = r0; r < r1; r++) {
    float x = abs(kv_ld(1, o[1] + t * st + r * sr));
    m = isnan(x) ? 1.0 / 0.0 : max(m, x);
  }
  atomicMax(BU32(P.addr[0]).v[int(gl_WorkGroupID.z) * T + t], floatBitsToUint(m));
}
