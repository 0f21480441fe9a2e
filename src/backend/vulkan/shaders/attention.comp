#version 450
// ATTENTION forward: one invocation per query row (b, h, i), the keys walked one at a time
// with an online softmax (running max m, normaliser l, accumulator acc rescaled by
// exp(m_old - m_new) when the max rises), so no Tq x Tk matrix exists; the row's lse =
// m + log(l) is saved for the backward. Not yet tiled (keys and values are read from
// global memory by every row; a shared-memory tile of keys per workgroup is the next
// step), so it is for correctness and moderate sizes.
// Views: 0 out (B, H, Tq, Dv), 1 q, 2 k, 3 v, 4 mask (B, H, Tq, Tk; stride 0 where
// broadcast), 5 lse (B, H, Tq); each view's strides in Params.strides (not coalesced).
// ex: 0 B, 1 H, 2 Tq, 3 Tk, 4 D, 5 Dv, 6 flags (1 causal, 2 mask, 4 the mask is bool, 8 dropout),
// 7 dropout's keep threshold t (kept when the f32 Philox uniform's 24 bits j < t, i.e.
// u < 1 - p, as the CPU), 8-9 the offset, 10-11 the scale as f32 hi + lo (bits); i[0],
// i[1] the seed; s[1] 1/(1-p) (0 when p = 1). D and Dv at most KV_ATT_MAXD.
#include "common.glsl"
layout(local_size_x = 64) in;

#include "att_common.glsl"

void main() {
  Params P = pc.P;
  int B = P.ex[0], H = P.ex[1], Tq = P.ex[2], Tk = P.ex[3], D = P.ex[4], Dv = P.ex[5], fl = P.ex[6];
  int r = int(kv_linear_group() * 64u + gl_LocalInvocationID.x);
  if (r >= B * H * Tq) return;
  int i = r % Tq, bh = r / Tq, b = bh / H, h = bh % H;
  bool causal = (fl & 1) != 0, masked = (fl & 2) != 0, bmask = (fl & 4) != 0, drop = (fl & 8) != 0;
  float q[KV_ATT_MAXD], acc[KV_ATT_MAXD];
  int qo = b * st(1, 0) + h * st(1, 1) + i * st(1, 2);
  for (int d = 0; d < D; d++) q[d] = kv_ld(1, qo + d * st(1, 3));
  for (int d = 0; d < Dv; d++) acc[d] = 0.0;
  int kb = b * st(2, 0) + h * st(2, 1), vb = b * st(3, 0) + h * st(3, 1);
  int mo = b * st(4, 0) + h * st(4, 1) + i * st(4, 2);
  uint64_t off = (uint64_t(uint(P.ex[9])) << 32) | uint64_t(uint(P.ex[8]));
  uint64_t k0 = uint64_t(r) * uint64_t(Tk); // the dropout element of (b, h, i, 0)
  const float NEG_INF = uintBitsToFloat(0xFF800000u);
  vec2 m = vec2(NEG_INF, 0.0);
  float l = 0.0, lc = 0.0; // l summed with Kahan's compensation lc
  float sch = uintBitsToFloat(uint(P.ex[10])), scl = uintBitsToFloat(uint(P.ex[11]));
  int jend = causal && i + 1 < Tk ? i + 1 : Tk;
  for (int j = 0; j < jend; j++) {
    vec2 s = vec2(0.0);
    int ko = kb + j * st(2, 2);
    for (int d = 0; d < D; d++) {
      float kd = kv_ld(2, ko + d * st(2, 3));
      vec2 pr = two_prod(q[d], kd);
      vec2 t = two_sum(s.x, pr.x);
      s = vec2(t.x, s.y + (t.y + pr.y));
    }
    s = norm2(s);
    {
      vec2 pr = two_prod(s.x, sch);
      s = norm2(vec2(pr.x, pr.y + (s.x * scl + s.y * sch)));
    }
    if (masked) {
      float mv = kv_ld(4, mo + j * st(4, 3));
      if (bmask) {
        if (mv == 0.0) continue;
      } else {
        vec2 t = two_sum(s.x, mv);
        s = norm2(vec2(t.x, t.y + s.y));
      }
    }
    if (s.x == NEG_INF) continue;
    bool nan_s = isnan(s.x); // NaN never becomes the max; it spreads through l and acc
    if (!nan_s && (s.x > m.x || (s.x == m.x && s.y > m.y))) {
      float corr = m.x == NEG_INF ? 0.0 : exp_acc((m.x - s.x) + (m.y - s.y));
      l *= corr;
      lc *= corr;
      for (int d = 0; d < Dv; d++) acc[d] *= corr;
      m = s;
    }
    float p = nan_s ? s.x : exp_acc((s.x - m.x) + (s.y - m.y));
    precise float yk = p - lc;
    precise float tk = l + yk;
    precise float nc = (tk - l) - yk;
    lc = nc;
    l = tk;
    if (drop) {
      uint64_t e = k0 + uint64_t(j);
      uint64_t c = off + e / 4ul;
      uvec4 bits = philox(uvec2(uint(P.i[0]), uint(P.i[1])), uvec4(uint(c), uint(c >> 32), 0u, 0u));
      p *= (bits[int(e % 4ul)] >> 8) < uint(P.ex[7]) ? P.s[1] : 0.0;
      if (p == 0.0) continue;
    }
    int vo = vb + j * st(3, 2);
    for (int d = 0; d < Dv; d++) acc[d] += p * kv_ld(3, vo + d * st(3, 3));
  }
  float inv = l > 0.0 ? 1.0 / l : 0.0;
  int oo = b * st(0, 0) + h * st(0, 1) + i * st(0, 2);
  for (int d = 0; d < Dv; d++) kv_st(0, oo + d * st(0, 3), acc[d] * inv);
  kv_st(5, b * st(5, 0) + h * st(5, 1) + i * st(5, 2), l > 0.0 ? lse_acc(m, l) : NEG_INF);
}
