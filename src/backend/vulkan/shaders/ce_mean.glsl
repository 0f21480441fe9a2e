// CROSS_ENTROPY_MEAN's two single-workgroup steps around ce.comp's rows. ex[0] = N rows.
// op 1: counts the kept rows of view 1 (target, stride ex[1]; i[0] ignore_index) into
//       view 2 (the count, one element), before the rows (their gradient divides by it).
// op 2: view 0 (one element) = sum of view 3 (the rows' losses, contiguous) / count.
#include "common.glsl"
layout(local_size_x = 256) in;
#include "wg.glsl"

void main() {
  Params P = pc.P;
  int t = int(gl_LocalInvocationID.x), N = P.ex[0];
  float acc = 0.0;
  for (int r = t; r < N; r += 256) {
    if (P.op == 1) acc += kv_ldi(1, r * P.ex[1]) != int64_t(P.i[0]) ? 1.0 : 0.0;
    else acc += kv_ld(3, r);
  }
  acc = wg_sum(acc);
  if (t != 0) return;
  if (P.op == 1) kv_st(2, 0, acc);
  else kv_st(0, 0, acc / kv_ld(2, 0)); // no kept rows: 0 / 0 = NaN, as the CPU
}
