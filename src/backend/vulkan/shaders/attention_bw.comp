#version 450
// ATTENTION_BACKWARD in three dispatches of this shader (the weights recomputed from the
// forward's lse each time, as the CPU: P_ij = exp(s_ij - lse_i), Z_ij dropout's factor,
// dp_ij = dO_i . v_j, delta_i = sum_j P Z dp, dS = P (Z dp - delta_i) scale):
//   op 1, one invocation per query row i: delta_i (saved), then dq_i = sum_j dS_ij k_j;
//   op 2, one invocation per key row j:  dk_j = sum_i dS_ij q_i (reads delta);
//   op 3, one invocation per key row j:  dv_j = sum_i P_ij Z_ij dO_i.
// No atomics and a fixed order of sums. Untiled, as the forward.
// Views: 0 the gradient written (dq, dk or dv), 1 q, 2 k, 3 v, 4 mask, 5 dO; the forward's
// lse (f32) at the address ex[12..13] with strides Params.shape[0..2]; delta (f32, one per
// query row, contiguous) at Params.flag. ex 0-11 and i, s as attention.comp.
#include "common.glsl"
layout(local_size_x = 64) in;

#include "att_common.glsl"

int lse_off(int b, int h, int i) { return b * pc.P.shape[0] + h * pc.P.shape[1] + i * pc.P.shape[2]; }

void main() {
  Params P = pc.P;
  int B = P.ex[0], H = P.ex[1], Tq = P.ex[2], Tk = P.ex[3], D = P.ex[4], Dv = P.ex[5], fl = P.ex[6];
  int op = P.op;
  int r = int(kv_linear_group() * 64u + gl_LocalInvocationID.x);
  int T = op == 1 ? Tq : Tk;
  if (r >= B * H * T) return;
  int row = r % T, bh = r / T, b = bh / H, h = bh % H;
  bool causal = (fl & 1) != 0, masked = (fl & 2) != 0, bmask = (fl & 4) != 0, drop = (fl & 8) != 0;
  float sch = uintBitsToFloat(uint(P.ex[10])), scl = uintBitsToFloat(uint(P.ex[11]));
  float scale = sch + scl;
  uint64_t lse_a = (uint64_t(uint(P.ex[13])) << 32) | uint64_t(uint(P.ex[12]));
  uint64_t off = (uint64_t(uint(P.ex[9])) << 32) | uint64_t(uint(P.ex[8]));
  const float NEG_INF = uintBitsToFloat(0xFF800000u);
  // the row in registers: q_i (op 1) or k_j (ops 2, 3), and the accumulator
  float x[KV_ATT_MAXD], acc[KV_ATT_MAXD];
  int xv = op == 1 ? 1 : 2;
  int xo = b * st(xv, 0) + h * st(xv, 1) + row * st(xv, 2);
  for (int d = 0; d < D; d++) x[d] = kv_ld(xv, xo + d * st(xv, 3));
  int na = op == 3 ? Dv : D;
  for (int d = 0; d < na; d++) acc[d] = 0.0;
  // op 1 walks keys j of query i = row; ops 2, 3 walk queries i of key j = row
  int lo = 0, hi = op == 1 ? (causal && row + 1 < Tk ? row + 1 : Tk) : Tq;
  if (op != 1 && causal) lo = row;
  float lse_row = op == 1 ? BF32(lse_a).v[lse_off(b, h, row)] : 0.0;
  float delta = 0.0;
  for (int pass = op == 1 ? 0 : 1; pass < 2; pass++) {
    for (int t = lo; t < hi; t++) {
      int i = op == 1 ? row : t, j = op == 1 ? t : row;
      float lse = op == 1 ? lse_row : BF32(lse_a).v[lse_off(b, h, i)];
      if (lse == NEG_INF) continue; // every key of row i masked: no gradient
      int yv = op == 1 ? 2 : 1;     // the other side of the score, from memory
      int yo = b * st(yv, 0) + h * st(yv, 1) + t * st(yv, 2);
      vec2 s = vec2(0.0);
      for (int d = 0; d < D; d++) {
        vec2 pr = two_prod(x[d], kv_ld(yv, yo + d * st(yv, 3)));
        vec2 u = two_sum(s.x, pr.x);
        s = vec2(u.x, s.y + (u.y + pr.y));
      }
      s = norm2(s);
      {
        vec2 pr = two_prod(s.x, sch);
        s = norm2(vec2(pr.x, pr.y + (s.x * scl + s.y * sch)));
      }
      if (masked) {
        float mv = kv_ld(4, b * st(4, 0) + h * st(4, 1) + i * st(4, 2) + j * st(4, 3));
        if (bmask) {
          if (mv == 0.0) continue;
        } else {
          vec2 u = two_sum(s.x, mv);
          s = norm2(vec2(u.x, u.y + s.y));
        }
      }
      if (s.x == NEG_INF) continue;
      float p = exp_acc((s.x - lse) + s.y);
      float z = 1.0;
      if (drop) {
        uint64_t e = (uint64_t(bh) * uint64_t(Tq) + uint64_t(i)) * uint64_t(Tk) + uint64_t(j);
        uint64_t c = off + e / 4ul;
        uvec4 bits = philox(uvec2(uint(P.i[0]), uint(P.i[1])), uvec4(uint(c), uint(c >> 32), 0u, 0u));
        z = (bits[int(e % 4ul)] >> 8) < uint(P.ex[7]) ? P.s[1] : 0.0;
      }
      int go = b * st(5, 0) + h * st(5, 1) + i * st(5, 2);
      if (op == 3) { // dv_j += P Z dO_i
        float pz = p * z;
        if (pz != 0.0)
          for (int d = 0; d < Dv; d++) acc[d] += pz * kv_ld(5, go + d * st(5, 3));
        continue;
      }
      int vo = b * st(3, 0) + h * st(3, 1) + j * st(3, 2);
      float dp = 0.0;
      for (int d = 0; d < Dv; d++) dp += kv_ld(5, go + d * st(5, 3)) * kv_ld(3, vo + d * st(3, 3));
      if (pass == 0) { // op 1's first pass: delta_i
        delta += p * z * dp;
        continue;
      }
      float di = op == 1 ? delta : BF32(P.flag).v[bh * Tq + i];
      float ds = p * (z * dp - di) * scale;
      if (ds == 0.0) continue;
      int yo2 = op == 1 ? b * st(2, 0) + h * st(2, 1) + j * st(2, 2) : b * st(1, 0) + h * st(1, 1) + i * st(1, 2);
      int ys = op == 1 ? st(2, 3) : st(1, 3);
      int yv2 = op == 1 ? 2 : 1;
      for (int d = 0; d < D; d++) acc[d] += ds * kv_ld(yv2, yo2 + d * ys);
    }
  }
  if (op == 1) BF32(P.flag).v[r] = delta;
  int oo = b * st(0, 0) + h * st(0, 1) + row * st(0, 2);
  for (int d = 0; d < na; d++) kv_st(0, oo + d * st(0, 3), acc[d]);
}
