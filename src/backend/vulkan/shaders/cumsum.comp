#version 450
// CUMSUM along one dim: one invocation per line (the views' other dims walked as the
// softmax's rows: shape and strides in Params without the dim), the line scanned in order
// (from its end when i[0] = 1). ex[0] the line's length, ex[1], ex[2] the strides of view
// 0 (out) and view 1 (in) along it. Floats add in f32; integer and bool inputs add
// exactly in int64 into an i64 output.
#include "common.glsl"
layout(local_size_x = 64) in;

void main() {
  Params P = pc.P;
  int k = int(kv_linear_group() * 64u + gl_LocalInvocationID.x);
  if (k >= P.n) return;
  int o[KV_MAXV];
  kv_offsets(k, o);
  int len = P.ex[0], so = P.ex[1], si = P.ex[2];
  bool rev = P.i[0] == 1;
  int dt = P.dtype[1];
  bool fl = dt == KV_F32 || dt == KV_F16 || dt == KV_BF16;
  float sf = 0.0;
  int64_t sn = 0;
  for (int t = 0; t < len; t++) {
    int j = rev ? len - 1 - t : t;
    if (fl) {
      sf += kv_ld(1, o[1] + j * si);
      kv_st(0, o[0] + j * so, sf);
    } else {
      sn += kv_ldi(1, o[1] + j * si);
      kv_sti(0, o[0] + j * so, sn);
    }
  }
}
