#version 450
// ADAM on one contiguous tensor, in the CPU kernel's order and roundings (cpu_optim.c):
// views 0 param, 1 exp_avg, 2 exp_avg_sq, 3 max_exp_avg_sq, 4 grad. The scalars, rounded
// to f32 on the host, are float bits in ex: 0 keep, 1 b1, 2 1-b1, 3 b2, 4 1-b2, 5 wd,
// 6 sqrt(bias correction 2), 7 eps, 8 -step size. i[0] flags: 1 decoupled decay, 2 L2
// decay, 4 amsgrad.
#include "common.glsl"
layout(local_size_x = 256) in;

float X(int j) { return intBitsToFloat(pc.P.ex[j]); }

void main() {
  Params P = pc.P;
  int k = int(kv_linear_group() * 256u + gl_LocalInvocationID.x);
  if (k >= P.n) return;
  int fl = P.i[0];
  float p = kv_ld(0, k), g = kv_ld(4, k);
  if ((fl & 1) != 0) p = p * X(0);
  if ((fl & 2) != 0) g = fma(p, X(5), g);
  float m = fma(g, X(2), kv_ld(1, k) * X(1));
  float v = fma(X(4) * g, g, kv_ld(2, k) * X(3));
  const float TINY = 1.17549435e-38;
  m = m < TINY && m > -TINY ? 0.0 : m;
  v = v < TINY ? 0.0 : v;
  float vd = v;
  if ((fl & 4) != 0) {
    float vm = kv_ld(3, k);
    vd = (isnan(v) || v > vm) ? v : vm;
    kv_st(3, k, vd);
  }
  float den = sqrt(vd) / X(6) + X(7);
  kv_st(1, k, m);
  kv_st(2, k, v);
  kv_st(0, k, p + (X(8) * m) / den);
}
