#version 450
// MATMUL for large products: a 128x128 tile of C per workgroup of 256, each invocation
// 8x8 outputs (rows ty + 16i, columns tx + 16j: conflict-free reads of shared memory,
// coalesced stores), K in steps of 8. Twice matmul.comp's work per value read from
// shared memory (64 fma per 16 reads), and the next K step's tiles are loaded into
// registers while this one is multiplied (a register double buffer), so global loads
// overlap the arithmetic. Views, ex and flags as matmul.comp (C = alpha A@B + beta C +
// bias, ReLU, A masked).
#include "common.glsl"
layout(local_size_x = 16, local_size_y = 16) in;
shared float As[8][132];
shared float Bs[8][132];

void main() {
  Params P = pc.P;
  int M = P.ex[0], N = P.ex[1], K = P.ex[2];
  int ars = P.ex[3], acs = P.ex[4], brs = P.ex[5], bcs = P.ex[6], crs = P.ex[7], ccs = P.ex[8];
  int flags = P.ex[12];
  bool masked = (flags & 2) != 0;
  int o[KV_MAXV];
  kv_offsets(int(gl_WorkGroupID.z), o);
  int tx = int(gl_LocalInvocationID.x), ty = int(gl_LocalInvocationID.y);
  int tid = ty * 16 + tx;
  int m0 = int(gl_WorkGroupID.y) * 128, n0 = int(gl_WorkGroupID.x) * 128;
  float acc[8][8];
  for (int i = 0; i < 8; i++)
    for (int j = 0; j < 8; j++) acc[i][j] = 0.0;
  // each invocation loads 4 of A's 128x8 tile (along k first) and 4 of B's 8x128 (along n)
  float ra[4], rb[4];
  for (int q = 0; q < 4; q++) {
    int e = tid + 256 * q;
    int r = e / 8, kk = e % 8, m = m0 + r, k = kk;
    float a = 0.0;
    if (m < M && k < K) {
      a = kv_ld(1, o[1] + m * ars + k * acs);
      if (masked && !(kv_ld(4, o[4] + m * P.ex[10] + k * P.ex[11]) > 0.0)) a = 0.0;
    }
    ra[q] = a;
    int kb = e / 128, c = e % 128, n = n0 + c;
    rb[q] = (n < N && kb < K) ? kv_ld(2, o[2] + kb * brs + n * bcs) : 0.0;
  }
  for (int k0 = 0; k0 < K; k0 += 8) {
    for (int q = 0; q < 4; q++) {
      int e = tid + 256 * q;
      As[e % 8][e / 8] = ra[q];
      Bs[e / 128][e % 128] = rb[q];
    }
    barrier();
    if (k0 + 8 < K) { // the next step's tiles, while this one is multiplied
      for (int q = 0; q < 4; q++) {
        int e = tid + 256 * q;
        int r = e / 8, kk = e % 8, m = m0 + r, k = k0 + 8 + kk;
        float a = 0.0;
        if (m < M && k < K) {
          a = kv_ld(1, o[1] + m * ars + k * acs);
          if (masked && !(kv_ld(4, o[4] + m * P.ex[10] + k * P.ex[11]) > 0.0)) a = 0.0;
        }
        ra[q] = a;
        int kb = k0 + 8 + e / 128, c = e % 128, n = n0 + c;
        rb[q] = (n < N && kb < K) ? kv_ld(2, o[2] + kb * brs + n * bcs) : 0.0;
      }
    }
    for (int kk = 0; kk < 8; kk++) {
      float a[8], b[8];
      for (int i = 0; i < 8; i++) a[i] = As[kk][ty + 16 * i];
      for (int j = 0; j < 8; j++) b[j] = Bs[kk][tx + 16 * j];
      for (int i = 0; i < 8; i++)
        for (int j = 0; j < 8; j++) acc[i][j] = fma(a[i], b[j], acc[i][j]);
    }
    barrier();
  }
  float alpha = P.s[0], beta = P.s[1];
  for (int i = 0; i < 8; i++) {
    int m = m0 + ty + 16 * i;
    if (m >= M) continue;
    for (int j = 0; j < 8; j++) {
      int n = n0 + tx + 16 * j;
      if (n >= N) continue;
      int co = o[0] + m * crs + n * ccs;
      float r = alpha * acc[i][j];
      if ((flags & 8) != 0) r += beta * kv_ld(0, co);
      if ((flags & 4) != 0) r += kv_ld(3, o[3] + n * P.ex[9]);
      if ((flags & 1) != 0) r = r > 0.0 ? r : (isnan(r) ? r : 0.0);
      kv_st(0, co, r);
    }
  }
}
