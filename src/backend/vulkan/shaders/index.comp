#version 450
// INDEX_SELECT, GATHER (walk out: views 0 out, 1 src with stride 0 on dim, 2 index) and
// INDEX_ADD, SCATTER_ADD (walk src: 0 out with stride 0 on dim, 1 src, 2 index). The
// index value times ex[0] (the pointed-into tensor's stride along dim) completes the
// offset; ex[1] is its size there. An index outside [0, ex[1]) is skipped and flagged.
// The adds are compare-and-swap loops on 32-bit words (every device has 32-bit atomics;
// 16-bit float atomics are rare): an f16 or bf16 element is added in f32 and rounded to
// nearest even within the word that holds it, the word's other half written back as it was.
#include "common.glsl"
layout(local_size_x = 256) in;

void main() {
  Params P = pc.P;
  int k = int(kv_linear_group() * 256u + gl_LocalInvocationID.x);
  if (k >= P.n) return;
  int o[KV_MAXV];
  kv_offsets(k, o);
  int64_t iv = kv_ldi(2, o[2]);
  if (iv < 0l || iv >= int64_t(P.ex[1])) {
    kv_set_flag(1);
    return;
  }
  int step = int(iv) * P.ex[0];
  if (P.op == KV_INDEX_SELECT || P.op == KV_GATHER) {
    int es = P.i[0];
    uint64_t ao = P.addr[0], ai = P.addr[1];
    int so = o[1] + step;
    if (es == 4) BU32(ao).v[o[0]] = BU32(ai).v[so];
    else if (es == 8) BU64(ao).v[o[0]] = BU64(ai).v[so];
    else if (es == 2) BU16(ao).v[o[0]] = BU16(ai).v[so];
    else BU8(ao).v[o[0]] = BU8(ai).v[so];
  } else if (P.i[0] == 4) {
    float x = kv_ld(1, o[1]);
    BU32 b = BU32(P.addr[0]);
    int at = o[0] + step;
    uint old = b.v[at], seen;
    do {
      seen = old;
      old = atomicCompSwap(b.v[at], seen, floatBitsToUint(uintBitsToFloat(seen) + x));
    } while (old != seen);
  } else { // f16 / bf16: the 32-bit word that holds the element, its other half kept
    float x = kv_ld(1, o[1]);
    uint64_t byte = P.addr[0] + uint64_t(o[0] + step) * 2ul;
    BU32 w = BU32(byte & ~3ul);
    uint sh = uint(byte & 2ul) * 8u, keep = ~(0xFFFFu << sh);
    bool is_f16 = P.dtype[0] == KV_F16;
    uint old = w.v[0], seen;
    do {
      seen = old;
      uint h = (seen >> sh) & 0xFFFFu;
      float sum = (is_f16 ? unpackHalf2x16(h).x : kv_bf16_to_f32(h)) + x;
      uint nh = is_f16 ? kv_f32_to_f16(sum) : kv_f32_to_bf16(sum);
      old = atomicCompSwap(w.v[0], seen, (seen & keep) | (nh << sh));
    } while (old != seen);
  }
}
