#version 450
// MAX_DIM, MIN_DIM (op 1 max, 2 min): one workgroup per row along the dim. Views walk the
// rows as softmax.comp's: 0 values, 1 input, 2 indices (i64); ex[0] the row length,
// ex[1..3] the strides along it. As the CPU: the first NaN wins, ties go to the first
// index.
#include "common.glsl"
layout(local_size_x = 256) in;
shared float pv[256];
shared int pi[256];

// whether (vb, ib) beats (va, ia)
bool beats(bool mx, float va, int ia, float vb, int ib) {
  if (ib < 0) return false;
  if (ia < 0) return true;
  bool na = isnan(va), nb = isnan(vb);
  if (na || nb) return nb && (!na || ib < ia);
  if (vb == va) return ib < ia;
  return mx ? vb > va : vb < va;
}

void main() {
  Params P = pc.P;
  int g = int(kv_linear_group());
  if (g >= P.n) return;
  int t = int(gl_LocalInvocationID.x);
  int o[KV_MAXV];
  kv_offsets(g, o);
  int L = P.ex[0];
  bool mx = P.op == 1;
  float bv = 0.0;
  int bi = -1;
  for (int j = t; j < L; j += 256) {
    float x = kv_ld(1, o[1] + j * P.ex[2]);
    if (beats(mx, bv, bi, x, j)) { bv = x; bi = j; }
    if (isnan(x)) break;
  }
  pv[t] = bv;
  pi[t] = bi;
  barrier();
  for (int s = 128; s > 0; s >>= 1) {
    if (t < s && beats(mx, pv[t], pi[t], pv[t + s], pi[t + s])) { pv[t] = pv[t + s]; pi[t] = pi[t + s]; }
    barrier();
  }
  if (t == 0) {
    kv_st(0, o[0], pv[0]);
    BI64(P.addr[2]).v[o[2]] = int64_t(max(pi[0], 0));
  }
}
