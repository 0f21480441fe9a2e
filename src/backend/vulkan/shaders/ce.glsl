// CROSS_ENTROPY per row, one workgroup per row (P.n rows of ex[0] classes). Views: 0
// logits, 1 target, 2 loss, 3 lse, 4 weight, 5 dlogits; strides in ex (vk_ce); ex[9]
// flags: 1 lse, 2 weight, 4 dlogits, 8 the dlogits scale is 1 / *(view 4 of the mean:
// the count, at ex[10]'s view) instead of s[1]. i[0] ignore_index; s[0] label smoothing.
#include "common.glsl"
layout(local_size_x = 256) in;
#include "wg.glsl"

float reduce(float v, bool mx) { return wg_reduce(mx ? WG_MAX : WG_SUM, v); }

void main() {
  Params P = pc.P;
  int r = int(kv_linear_group());
  if (r >= P.n) return;
  int t = int(gl_LocalInvocationID.x);
  int C = P.ex[0], flags = P.ex[9];
  int xo = r * P.ex[1], xs = P.ex[2];
  int64_t tg = kv_ldi(1, r * P.ex[3]);
  bool ignored = tg == int64_t(P.i[0]);
  float eps = P.s[0];
  float g = P.s[1];
  if ((flags & 8) != 0) g = 1.0 / kv_ld(4, 0);
  if (!ignored && (tg < 0l || tg >= int64_t(C))) {
    if (t == 0) kv_set_flag(2);
    ignored = true; // skipped: the sync reports it
  }
  if (ignored) {
    if (t == 0) {
      kv_st(2, r * P.ex[4], 0.0);
      if ((flags & 1) != 0) kv_st(3, r * P.ex[5], 0.0);
      if ((flags & 2) != 0) kv_st(4, r * P.ex[6], 0.0);
    }
    if ((flags & 4) != 0)
      for (int j = t; j < C; j += 256) kv_st(5, r * P.ex[7] + j * P.ex[8], 0.0);
    return;
  }
  float m = -1.0 / 0.0;
  for (int j = t; j < C; j += 256) { float x = kv_ld(0, xo + j * xs); m = isnan(x) || x > m ? x : m; }
  m = reduce(m, true);
  float s = 0.0, sx = 0.0;
  for (int j = t; j < C; j += 256) { float x = kv_ld(0, xo + j * xs); s += exp(x - m); sx += x; }
  s = reduce(s, false);
  if (eps != 0.0) sx = reduce(sx, false);
  float lse = m + log(s);
  int ti = int(tg);
  if (t == 0) {
    float loss = (1.0 - eps) * (lse - kv_ld(0, xo + ti * xs));
    if (eps != 0.0) loss += eps * (lse - sx / float(C));
    kv_st(2, r * P.ex[4], loss);
    if ((flags & 1) != 0) kv_st(3, r * P.ex[5], lse);
    if ((flags & 2) != 0) kv_st(4, r * P.ex[6], 1.0);
  }
  if ((flags & 4) != 0) {
    float off = eps / float(C), on = 1.0 - eps;
    for (int j = t; j < C; j += 256) {
      float d = g * (exp(kv_ld(0, xo + j * xs) - lse) - off);
      if (j == ti) d -= g * on;
      kv_st(5, r * P.ex[7] + j * P.ex[8], d);
    }
  }
}
