// SOFTMAX, LOG_SOFTMAX and their backward, one workgroup per row. Views 0 out, 1 in0 (x,
// or y for the backward), 2 in1 (grad) walk the rows (the softmax dim removed); ex[0] is
// the row length and ex[1..3] the views' strides along it.
#include "common.glsl"
layout(local_size_x = 256) in;
#include "wg.glsl"

void main() {
  Params P = pc.P;
  int g = int(kv_linear_group());
  if (g >= P.n) return;
  int t = int(gl_LocalInvocationID.x);
  int o[KV_MAXV];
  kv_offsets(g, o);
  int L = P.ex[0], s0 = P.ex[1], s1 = P.ex[2], s2 = P.ex[3];
  int op = P.op;
  if (op == KV_SOFTMAX || op == KV_LOG_SOFTMAX) {
    float m = -1.0 / 0.0;
    for (int j = t; j < L; j += 256) { float x = kv_ld(1, o[1] + j * s1); m = isnan(x) || x > m ? x : m; }
    m = wg_max(m);
    if (isinf(m) && m < 0.0) m = 0.0; // a row of -inf: exp(-inf - 0) = 0, 0/0 = NaN as the CPU
    float s = 0.0;
    for (int j = t; j < L; j += 256) s += exp(kv_ld(1, o[1] + j * s1) - m);
    s = wg_sum(s);
    float ls = log(s);
    for (int j = t; j < L; j += 256) {
      float x = kv_ld(1, o[1] + j * s1);
      kv_st(0, o[0] + j * s0, op == KV_SOFTMAX ? exp(x - m) / s : (x - m) - ls);
    }
  } else {
    float acc = 0.0;
    for (int j = t; j < L; j += 256) {
      float gj = kv_ld(2, o[2] + j * s2);
      acc += op == KV_SOFTMAX_BW ? gj * kv_ld(1, o[1] + j * s1) : gj;
    }
    acc = wg_sum(acc);
    for (int j = t; j < L; j += 256) {
      float y = kv_ld(1, o[1] + j * s1), gj = kv_ld(2, o[2] + j * s2);
      kv_st(0, o[0] + j * s0, op == KV_SOFTMAX_BW ? y * (gj - acc) : gj - exp(y) * acc);
    }
  }
}
