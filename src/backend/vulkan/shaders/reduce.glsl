// SUM, PROD, AMAX, AMIN: one workgroup per output element. Views: 0 out, 1 in over the
// kept dims (shape/strides); the reduced dims' sizes in ex[1..ex[0]] and in's strides
// along them in strides[2*KV_MAXD ...]; i[0] = how many elements each output reduces.
// Each invocation folds a strided share, then the workgroup's reduction (wg.glsl: subgroup
// arithmetic, or a pairwise tree in shared memory), so f32 sums stay close to the CPU's.
// With ex[15] = 1 the input is an integer dtype and the reduction runs exactly in int64
// (wrapping as the CPU's int64 does), always through the tree.
#include "common.glsl"
#include "wg.glsl"
layout(local_size_x = 256) in;
shared int64_t parti[256];

int64_t foldi(int op, int64_t a, int64_t b) {
  switch (op) {
  case KV_R_SUM: return a + b;
  case KV_R_PROD: return a * b;
  case KV_R_MAX: return max(a, b);
  case KV_R_MIN: return min(a, b);
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
  if (P.ex[15] == 1) {
    int64_t ai = op == KV_R_SUM ? 0l : op == KV_R_PROD ? 1l : op == KV_R_MAX ? -9223372036854775807l - 1l
                : 9223372036854775807l;
    for (int r = int(t); r < nred; r += 256) {
      int rr = r, off = o[1];
      for (int d = nrd - 1; d >= 0; d--) {
        int sz = P.ex[1 + d];
        off += (rr % sz) * P.strides[2 * KV_MAXD + d];
        rr /= sz;
      }
      ai = foldi(op, ai, kv_ldi(1, off));
    }
    parti[t] = ai;
    barrier();
    for (uint s = 128u; s > 0u; s >>= 1) {
      if (t < s) parti[t] = foldi(op, parti[t], parti[t + s]);
      barrier();
    }
    if (t == 0u) kv_sti(0, o[0], parti[0]);
    return;
  }
  float acc = init;
  for (int r = int(t); r < nred; r += 256) {
    int rr = r, off = o[1];
    for (int d = nrd - 1; d >= 0; d--) {
      int sz = P.ex[1 + d];
      off += (rr % sz) * P.strides[2 * KV_MAXD + d];
      rr /= sz;
    }
    acc = wg_fold2(op, acc, kv_ld(1, off));
  }
  acc = wg_reduce(op, acc);
  if (t == 0u) kv_st(0, o[0], acc);
}
