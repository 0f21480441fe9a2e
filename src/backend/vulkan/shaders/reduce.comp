#version 450
// SUM, PROD, AMAX, AMIN: one workgroup per output element. Views: 0 out, 1 in over the
// kept dims (shape/strides); the reduced dims' sizes in ex[1..ex[0]] and in's strides
// along them in strides[2*KV_MAXD ...]; i[0] = how many elements each output reduces.
// Each invocation folds a strided share, then a tree in shared memory: 256 partial sums,
// pairwise, so f32 sums stay close to the CPU's.
#include "common.glsl"
layout(local_size_x = 256) in;
shared float part[256];

float fold(int op, float a, float b) {
  switch (op) {
  case KV_R_SUM: return a + b;
  case KV_R_PROD: return a * b;
  case KV_R_MAX: return isnan(b) || b > a ? b : a;  // NaN propagates
  case KV_R_MIN: return isnan(b) || b < a ? b : a;
  }
  return a;
}

void main() {
  Params P = pc.P;
  int g = int(kv_linear_group());
  if (g >= P.n) return; // uniform per workgroup
  uint t = gl_LocalInvocationID.x;
  int o[KV_MAXV];
  kv_offsets(g, o);
  int op = P.op, nred = P.i[0], nrd = P.ex[0];
  float init = op == KV_R_SUM ? 0.0 : op == KV_R_PROD ? 1.0 : op == KV_R_MAX ? -1.0 / 0.0 : 1.0 / 0.0;
  float acc = init;
  for (int r = int(t); r < nred; r += 256) {
    int rr = r, off = o[1];
    for (int d = nrd - 1; d >= 0; d--) {
      int sz = P.ex[1 + d];
      off += (rr % sz) * P.strides[2 * KV_MAXD + d];
      rr /= sz;
    }
    acc = fold(op, acc, kv_ld(1, off));
  }
  part[t] = acc;
  barrier();
  for (uint s = 128u; s > 0u; s >>= 1) {
    if (t < s) part[t] = fold(op, part[t], part[t + s]);
    barrier();
  }
  if (t == 0u) kv_st(0, o[0], part[0]);
}
