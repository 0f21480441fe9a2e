// Shared by attention.comp and attention_bw.comp: Philox, the view strides, and the
// exact-arithmetic helpers that keep the scores (and so lse and the recomputed weights)
// within about an f32 ulp of the CPU's f64 values.
#define KV_ATT_MAXD 128

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

