#version 450
// CROSS_ENTROPY_BACKWARD, one invocation per logit (P.n = N * C). Views: 0 dlogits,
// 1 logits, 2 target, 3 lse, 4 grad, 5 divisor (ex[9] & 1); strides in ex (vk_ce_bw).
#include "common.glsl"
layout(local_size_x = 256) in;

void main() {
  Params P = pc.P;
  int k = int(kv_linear_group() * 256u + gl_LocalInvocationID.x);
  if (k >= P.n) return;
  int C = P.ex[0];
  int r = k / C, j = k % C;
  int64_t tg = kv_ldi(2, r * P.ex[3]);
  float d = 0.0;
  if (tg != int64_t(P.i[0])) {
    if (tg < 0l || tg >= int64_t(C)) {
      kv_set_flag(2);
    } else {
      float g = kv_ld(4, r * P.ex[5]);
      if ((P.ex[9] & 1) != 0) g /= kv_ld(5, r * P.ex[6]);
      float eps = P.s[0];
      d = g * (exp(kv_ld(1, r * P.ex[1] + j * P.ex[2]) - kv_ld(3, r * P.ex[4])) - eps / float(C));
      if (int64_t(j) == tg) d -= g * (1.0 - eps);
    }
  }
  kv_st(0, r * P.ex[7] + j * P.ex[8], d);
}
