#version 450
// Small per-element kernels over view 0 (one invocation per element, C order of the
// shape in Params; views not coalesced where the op needs its indices):
//   EYE: view 0 (R, C) = (row == col); ex[0] = C.
//   TRIL: view 0 = view 1 where (col - row) <= i[0] (tril) or >= i[0] (triu, i[1] = 1),
//     else 0 bits; shape (rows..., M, N) as is; the element's bits copied (i[2] = size), so
//     every dtype, f64 too, is moved exactly.
//   UNSCALE (AMP_UNSCALE, one list entry): view 0 *= s[0] in place, computed in f32 as the
//     CPU; any non-finite product sets view 1 (the f32 flag) to 1.
#include "common.glsl"
layout(local_size_x = 256) in;

void copy_bits(int es, uint64_t dst, int od, uint64_t src, int os, bool keep) {
  if (es == 4) BU32(dst).v[od] = keep ? BU32(src).v[os] : 0u;
  else if (es == 8) BU64(dst).v[od] = keep ? BU64(src).v[os] : 0ul;
  else if (es == 2) BU16(dst).v[od] = keep ? BU16(src).v[os] : uint16_t(0);
  else BU8(dst).v[od] = keep ? BU8(src).v[os] : uint8_t(0);
}

void main() {
  Params P = pc.P;
  int k = int(kv_linear_group() * 256u + gl_LocalInvocationID.x);
  if (k >= P.n) return;
  int o[KV_MAXV];
  kv_offsets(k, o);
  if (P.op == KV_M_EYE) {
    int c = P.ex[0];
    kv_sti(0, o[0], (k / c) == (k % c) ? 1l : 0l);
  } else if (P.op == KV_M_TRIL) {
    int N = P.shape[P.ndim - 1], M = P.shape[P.ndim - 2];
    int j = k % N, i = (k / N) % M;
    bool keep = P.i[1] == 1 ? (j - i) >= P.i[0] : (j - i) <= P.i[0];
    copy_bits(P.i[2], P.addr[0], o[0], P.addr[1], o[1], keep);
  } else if (P.op == KV_M_UNSCALE) {
    precise float x = kv_ld(0, o[0]) * P.s[0];
    kv_st(0, o[0], x);
    if (isnan(x) || isinf(x)) BF32(P.addr[1]).v[0] = 1.0;
  }
}
