#version 450
// The window kernels of convolutional networks (one invocation per element walked):
//   IM2COL: walks cols (view 0: N, C, kh, kw, OH, OW) and copies x's element (view 1:
//     N, C, H, W) bit for bit, or 0 bits outside x (i[2] = element size).
//   COL2IM: walks x (view 0, accumulated into) and adds every column entry (view 1) read
//     from that pixel: a gather, so no atomics and a fixed order (f32 sums).
//   MAXPOOL: walks out (view 0: N, C, OH, OW), view 1 x, view 2 the i64 index h*W + w;
//     padding never wins, NaN propagates, the first maximum on ties (as the CPU).
// The walked view's shape is in Params.shape (not coalesced), each view's strides in
// Params.strides. ex: 0-1 kernel, 2-3 stride, 4-5 padding, 6-7 dilation, 8 H, 9 W,
// 10 OH, 11 OW.
#include "common.glsl"
layout(local_size_x = 256) in;

int st(int v, int d) { return pc.P.strides[v * KV_MAXD + d]; }

void main() {
  Params P = pc.P;
  int k = int(kv_linear_group() * 256u + gl_LocalInvocationID.x);
  if (k >= P.n) return;
  int idx[6];
  int rem = k;
  for (int d = P.ndim - 1; d >= 0; d--) {
    idx[d] = rem % P.shape[d];
    rem /= P.shape[d];
  }
  int kh = P.ex[0], kw = P.ex[1], sh = P.ex[2], sw = P.ex[3], ph = P.ex[4], pw = P.ex[5];
  int dh = P.ex[6], dw = P.ex[7], H = P.ex[8], W = P.ex[9], OH = P.ex[10], OW = P.ex[11];
  int n = idx[0], c = idx[1];
  if (P.op == KV_W_IM2COL) {
    int i = idx[2], j = idx[3], oh = idx[4], ow = idx[5];
    int h = oh * sh - ph + i * dh, w = ow * sw - pw + j * dw;
    bool in_x = h >= 0 && h < H && w >= 0 && w < W;
    int od = n * st(0, 0) + c * st(0, 1) + i * st(0, 2) + j * st(0, 3) + oh * st(0, 4) + ow * st(0, 5);
    int os = in_x ? n * st(1, 0) + c * st(1, 1) + h * st(1, 2) + w * st(1, 3) : 0;
    uint64_t dst = P.addr[0], src = P.addr[1];
    int es = P.i[2];
    if (es == 4) BU32(dst).v[od] = in_x ? BU32(src).v[os] : 0u;
    else if (es == 8) BU64(dst).v[od] = in_x ? BU64(src).v[os] : 0ul;
    else BU16(dst).v[od] = in_x ? BU16(src).v[os] : uint16_t(0);
  } else if (P.op == KV_W_COL2IM) {
    int h = idx[2], w = idx[3];
    int xo = n * st(0, 0) + c * st(0, 1) + h * st(0, 2) + w * st(0, 3);
    float acc = kv_ld(0, xo);
    int cb = n * st(1, 0) + c * st(1, 1);
    for (int i = 0; i < kh; i++) {
      int th = h + ph - i * dh; // = oh * sh
      if (th < 0 || th % sh != 0) continue;
      int oh = th / sh;
      if (oh >= OH) continue;
      for (int j = 0; j < kw; j++) {
        int tw = w + pw - j * dw;
        if (tw < 0 || tw % sw != 0) continue;
        int ow = tw / sw;
        if (ow >= OW) continue;
        acc += kv_ld(1, cb + i * st(1, 2) + j * st(1, 3) + oh * st(1, 4) + ow * st(1, 5));
      }
    }
    kv_st(0, xo, acc);
  } else {
    int oh = idx[2], ow = idx[3];
    int xb = n * st(1, 0) + c * st(1, 1);
    float best = 0.0;
    int at = -1;
    for (int i = 0; i < kh; i++) {
      int h = oh * sh - ph + i * dh;
      if (h < 0 || h >= H) continue;
      for (int j = 0; j < kw; j++) {
        int w = ow * sw - pw + j * dw;
        if (w < 0 || w >= W) continue;
        float v = kv_ld(1, xb + h * st(1, 2) + w * st(1, 3));
        if (at < 0 || v > best || (isnan(v) && !isnan(best))) best = v, at = h * W + w;
      }
    }
    if (at < 0) best = uintBitsToFloat(0xFF800000u); // -inf: an empty window (as the CPU)
    kv_st(0, n * st(0, 0) + c * st(0, 1) + oh * st(0, 2) + ow * st(0, 3), best);
    kv_sti(2, n * st(2, 0) + c * st(2, 1) + oh * st(2, 2) + ow * st(2, 3), at < 0 ? 0l : int64_t(at));
  }
}
