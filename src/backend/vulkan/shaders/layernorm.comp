#version 450
// LAYER_NORM and RMS norm over the last dim of x (R, N), and their backward.
//   FWD (one workgroup per row): views 0 y, 1 x, 2 weight, 3 bias, 4 mean, 5 rstd; the
//     mean, then the variance of (x - mean) (two passes over the row, as the CPU, so no
//     cancellation), rstd = 1/sqrt(var + eps).
//   BWD (one workgroup per row): views 0 dx, 1 x, 2 grad, 3 mean, 4 rstd, 5 weight:
//     dx = rstd (gw - mean(gw) - xhat mean(gw xhat)), gw = g w (no mean(gw) for RMS).
//   WGRAD (one invocation per column j): views 0 dweight, 1 x, 2 grad, 3 mean, 4 rstd,
//     5 dbias: sums over the rows of g xhat and of g.
// ex: 0 R, 1 N, 2-3 x strides, 4-5 grad strides, 6-7 y/dx strides, 8 mean stride, 9 rstd
// stride, 10 weight stride, 11 bias/dbias stride, 12 flags (1 weight, 2 bias/dbias,
// 4 RMS). s[0] eps. All in f32 (the CPU computes in f64: the harness's tolerance).
#include "common.glsl"
layout(local_size_x = 256) in;

shared float red_a[256], red_b[256];

// the sums of a and b over the workgroup, in every invocation
vec2 wg_sum2(float a, float b) {
  uint t = gl_LocalInvocationID.x;
  red_a[t] = a;
  red_b[t] = b;
  barrier();
  for (uint s = 128u; s > 0u; s >>= 1) {
    if (t < s) {
      red_a[t] += red_a[t + s];
      red_b[t] += red_b[t + s];
    }
    barrier();
  }
  vec2 r = vec2(red_a[0], red_b[0]);
  barrier();
  return r;
}

void main() {
  Params P = pc.P;
  int R = P.ex[0], N = P.ex[1], fl = P.ex[12];
  bool hw = (fl & 1) != 0, hb = (fl & 2) != 0, rms = (fl & 4) != 0;
  int t = int(gl_LocalInvocationID.x);
  if (P.op == KV_LN_WGRAD) {
    int j = int(kv_linear_group() * 256u) + t;
    if (j >= N) return;
    float sw = 0.0, sb = 0.0;
    for (int r = 0; r < R; r++) {
      float g = kv_ld(2, r * P.ex[4] + j * P.ex[5]);
      float x = kv_ld(1, r * P.ex[2] + j * P.ex[3]);
      float mean = rms ? 0.0 : kv_ld(3, r * P.ex[8]);
      float rstd = kv_ld(4, r * P.ex[9]);
      sw += g * ((x - mean) * rstd);
      sb += g;
    }
    kv_st(0, j * P.ex[10], sw);
    if (hb) kv_st(5, j * P.ex[11], sb);
    return;
  }
  int r = int(kv_linear_group());
  if (r >= R) return;
  int xo = r * P.ex[2], x1 = P.ex[3];
  if (P.op == KV_LN_FWD) {
    float mean = 0.0;
    if (!rms) {
      float s = 0.0;
      for (int j = t; j < N; j += 256) s += kv_ld(1, xo + j * x1);
      mean = wg_sum2(s, 0.0).x / float(N);
    }
    float v = 0.0;
    for (int j = t; j < N; j += 256) {
      float d = kv_ld(1, xo + j * x1) - mean;
      v += d * d;
    }
    float var = wg_sum2(v, 0.0).x / float(N);
    float rstd = 1.0 / sqrt(var + P.s[0]);
    int yo = r * P.ex[6];
    for (int j = t; j < N; j += 256) {
      float y = (kv_ld(1, xo + j * x1) - mean) * rstd;
      if (hw) y *= kv_ld(2, j * P.ex[10]);
      if (hb) y += kv_ld(3, j * P.ex[11]);
      kv_st(0, yo + j * P.ex[7], y);
    }
    if (t == 0) {
      if (!rms) kv_st(4, r * P.ex[8], mean);
      kv_st(5, r * P.ex[9], rstd);
    }
    return;
  }
  // KV_LN_BWD
  float mean = rms ? 0.0 : kv_ld(3, r * P.ex[8]);
  float rstd = kv_ld(4, r * P.ex[9]);
  int go = r * P.ex[4];
  float sg = 0.0, sgx = 0.0;
  for (int j = t; j < N; j += 256) {
    float g = kv_ld(2, go + j * P.ex[5]);
    if (hw) g *= kv_ld(5, j * P.ex[10]);
    float xh = (kv_ld(1, xo + j * x1) - mean) * rstd;
    sg += g;
    sgx += g * xh;
  }
  vec2 s = wg_sum2(sg, sgx) / float(N);
  if (rms) s.x = 0.0;
  int dxo = r * P.ex[6];
  for (int j = t; j < N; j += 256) {
    float g = kv_ld(2, go + j * P.ex[5]);
    if (hw) g *= kv_ld(5, j * P.ex[10]);
    float xh = (kv_ld(1, xo + j * x1) - mean) * rstd;
    kv_st(0, dxo + j * P.ex[7], rstd * (g - s.x - xh * s.y));
  }
}
