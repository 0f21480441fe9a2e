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
#define KV_ATT_MAXD 128
layout(local_size_x = 64) in;

uvec4 philox(uvec2 key, uvec4 c) {
  for (int r = 0; r < 10; r++) {
    uint hi0, lo0, hi1, lo1;
    umulExtended(0xD2511F53u, c.x, hi0, lo0);
    umulExtended(0xCD9E8D57u, c.z, hi1, lo1);
    c = uvec4(hi1 ^ c.y ^ key.x, lo1, hi0 ^ c.w ^ key.y, lo0);
    key += uvec2(0x9E3779B9u, 0xBB67AE85u);
  }
  return c;
}

int st(int v, int d) { return pc.P.strides[v * KV_MAXD + d]; }

// exp(x) for x <= 0 to about 1 ulp: the lse this kernel saves feeds the backward's
// exp(s - lse), where an error of a few 1e-6 (GLSL's exp may be off by 3 + 2|x| ulp, and
// lavapipe's is) shows in the gradients. Cody-Waite: x = n ln2 + r, |r| <= ln2/2, ln2
// split in two so n ln2 is exact; exp(r) by its Taylor series to r^8 (error < 1e-9).
// Scores as unevaluated sums hi + lo (about 48 bits): q.k with exact products and
// Knuth's two-sum, then times the scale given as hi + lo (ex[10], ex[11] bits). The lse
// the backward reads must agree with the f64 scores the CPU recomputes to about one f32
// ulp; plain f32 dot products left it a few ulp off, and the gradients 1e-4 off.
vec2 two_sum(float a, float b) {
  precise float s = a + b;
  precise float bb = s - a;
  precise float e = (a - (s - bb)) + (b - bb);
  return vec2(s, e);
}

// a b = p + e exactly (Dekker's product, Veltkamp's split): not fma, which a driver may
// round twice (GLSL lets fma be a multiply and an add; lavapipe's is).
vec2 split(float a) {
  precise float c = 4097.0 * a;
  precise float ah = c - (c - a);
  precise float al = a - ah;
  return vec2(ah, al);
}

vec2 two_prod(float a, float b) {
  precise float p = a * b;
  vec2 A = split(a), B = split(b);
  precise float e = ((A.x * B.x - p) + A.x * B.y + A.y * B.x) + A.y * B.y;
  return vec2(p, e);
}

vec2 norm2(vec2 v) {
  precise float s = v.x + v.y;
  precise float e = v.y - (s - v.x);
  return vec2(s, e);
}

float exp_acc(float x) {
  if (x < -104.0) return 0.0;
  float n = round(x * 1.44269504);
  precise float r = fma(-n, 0.693145752, x);
  r = fma(-n, 1.42860677e-06, r);
  float p = 2.48015873e-05;
  p = fma(p, r, 1.98412698e-04);
  p = fma(p, r, 1.38888889e-03);
  p = fma(p, r, 8.33333333e-03);
  p = fma(p, r, 4.16666667e-02);
  p = fma(p, r, 1.66666667e-01);
  p = fma(p, r, 0.5);
  p = fma(p, r, 1.0);
  p = fma(p, r, 1.0);
  return ldexp(p, int(n));
}

// m + log(l) (m = hi + lo, l >= 1) rounded once, so it is the CPU's f64 lse rounded to f32
// but for near-ties: l = 2^e f with f in [sqrt(1/2), sqrt(2)), log f = 2 atanh(u), u =
// (f - 1)/(f + 1) (|u| < 0.172: the series to u^9 is off by < 1e-9), e ln2 in two parts.
float lse_acc(vec2 m, float l) {
  int e;
  float f = frexp(l, e); // l = f 2^e, f in [0.5, 1)
  if (f < 0.70710678) f *= 2.0, e -= 1;
  float u = (f - 1.0) / (f + 1.0), u2 = u * u;
  float lf = 2.0 * u * (1.0 + u2 * (1.0 / 3.0 + u2 * (0.2 + u2 * (1.0 / 7.0 + u2 * (1.0 / 9.0)))));
  vec2 a = two_sum(m.x, float(e) * 0.693145752);
  precise float rest = a.y + (m.y + (float(e) * 1.42860677e-06 + lf));
  precise float r = a.x + rest;
  return r;
}

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
