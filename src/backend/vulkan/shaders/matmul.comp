#version 450
// MATMUL, tiled in shared memory: a 64x64 tile of C per workgroup of 256, each invocation
// 4x4 outputs (rows ty + 16i, columns tx + 16j, so loads and stores stay coalesced), K in
// steps of 16. Views: 0 C, 1 A, 2 B, 3 bias, 4 mask, walked over the batch dims by
// gl_WorkGroupID.z; the matrix dims' sizes and strides are in ex (vk_kernels.c's
// vk_matmul). C = alpha * A@B + beta * C (ex[12] & 8) + bias (& 4), ReLU last (& 1); A is
// read as where(mask > 0, A, 0) with a mask (& 2). f32 accumulation for every dtype.
#include "common.glsl"
layout(local_size_x = 16, local_size_y = 16) in;
shared float As[16][65];
shared float Bs[16][65];

void main() {
  Params P = pc.P;
  int M = P.ex[0], N = P.ex[1], K = P.ex[2];
  int ars = P.ex[3], acs = P.ex[4], brs = P.ex[5], bcs = P.ex[6], crs = P.ex[7], ccs = P.ex[8];
  int flags = P.ex[12];
  int o[KV_MAXV];
  kv_offsets(int(gl_WorkGroupID.z), o);
  int tx = int(gl_LocalInvocationID.x), ty = int(gl_LocalInvocationID.y);
  int tid = ty * 16 + tx;
  int m0 = int(gl_WorkGroupID.y) * 64, n0 = int(gl_WorkGroupID.x) * 64;
  float acc[4][4];
  for (int i = 0; i < 4; i++)
    for (int j = 0; j < 4; j++) acc[i][j] = 0.0;
  for (int k0 = 0; k0 < K; k0 += 16) {
    // A tile: 64 rows x 16 k; B tile: 16 k x 64 columns; 4 elements each per invocation
    for (int e = tid; e < 1024; e += 256) {
      int r = e / 16, kk = e % 16; // A: consecutive invocations along k
      int m = m0 + r, k = k0 + kk;
      float a = 0.0;
      if (m < M && k < K) {
        a = kv_ld(1, o[1] + m * ars + k * acs);
        if ((flags & 2) != 0 && !(kv_ld(4, o[4] + m * P.ex[10] + k * P.ex[11]) > 0.0)) a = 0.0;
      }
      As[kk][r] = a;
      int kb = e / 64, c = e % 64; // B: consecutive invocations along n
      int n = n0 + c, k2 = k0 + kb;
      Bs[kb][c] = (n < N && k2 < K) ? kv_ld(2, o[2] + k2 * brs + n * bcs) : 0.0;
    }
    barrier();
    for (int kk = 0; kk < 16; kk++) {
      float a[4], b[4];
      for (int i = 0; i < 4; i++) a[i] = As[kk][ty + 16 * i];
      for (int j = 0; j < 4; j++) b[j] = Bs[kk][tx + 16 * j];
      for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = fma(a[i], b[j], acc[i][j]);
    }
    barrier();
  }
  float alpha = P.s[0], beta = P.s[1];
  for (int i = 0; i < 4; i++) {
    int m = m0 + ty + 16 * i;
    if (m >= M) continue;
    for (int j = 0; j < 4; j++) {
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
