// MATMUL's second output (n_out == 2): out1 (M) = the sums of A's rows over K, A read
// through the mask as the product reads it. One workgroup per row. Views: 0 out1, 1 A,
// 4 mask; ex as matmul.comp's, ex[13] = out1's stride.
#include "common.glsl"
layout(local_size_x = 256) in;
#include "wg.glsl"

void main() {
  Params P = pc.P;
  int m = int(kv_linear_group());
  if (m >= P.ex[0]) return;
  int t = int(gl_LocalInvocationID.x);
  int K = P.ex[2];
  float acc = 0.0;
  for (int k = t; k < K; k += 256) {
    float a = kv_ld(1, m * P.ex[3] + k * P.ex[4]);
    if ((P.ex[12] & 2) != 0 && !(kv_ld(4, m * P.ex[10] + k * P.ex[11]) > 0.0)) a = 0.0;
    acc += a;
  }
  acc = wg_sum(acc);
  if (t == 0) kv_st(0, m * P.ex[13], acc);
}
