#version 450
// TOPK along one dim: one invocation per line (the other dims walked as cumsum.comp's),
// k rounds of a selection over the line: round t takes the first element after round
// t-1's in the order "larger first, NaN largest, ties by lower index" (i[1] = 1) or
// "smaller first, NaN last, ties by lower index" (i[1] = 0), which is the CPU's sorted
// order. O(k * len) per line: for the small k of sampling. Views: 0 values, 1 in,
// 2 indices (i64); ex[0] the line's length, ex[1..3] the views' strides along it; i[0] k.
#include "common.glsl"
layout(local_size_x = 64) in;

// true when (a, ia) comes before (b, ib) in the output order
bool before(float a, int ia, float b, int ib, bool largest) {
  bool na = isnan(a), nb = isnan(b);
  if (na != nb) return largest ? na : nb;
  if (!na && a != b) return largest ? a > b : a < b;
  return ia < ib;
}

void main() {
  Params P = pc.P;
  int k = int(kv_linear_group() * 64u + gl_LocalInvocationID.x);
  if (k >= P.n) return;
  int o[KV_MAXV];
  kv_offsets(k, o);
  int len = P.ex[0], kk = P.i[0];
  bool largest = P.i[1] == 1;
  float pv = 0.0;
  int pi = -1;
  for (int t = 0; t < kk; t++) {
    float bv = 0.0;
    int bi = -1;
    for (int j = 0; j < len; j++) {
      float v = kv_ld(1, o[1] + j * P.ex[2]);
      if (pi >= 0 && !before(pv, pi, v, j, largest)) continue; // taken in an earlier round
      if (bi < 0 || before(v, j, bv, bi, largest)) bv = v, bi = j;
    }
    kv_st(0, o[0] + t * P.ex[1], bv);
    kv_sti(2, o[2] + t * P.ex[3], int64_t(bi));
    pv = bv, pi = bi;
  }
}
