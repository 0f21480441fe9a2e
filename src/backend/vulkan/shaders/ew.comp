#version 450
// The elementwise family: unary (view 1 -> 0), unary backward (views 1 x or y, 2 grad),
// binary (views 1, 2), comparisons (bool out), WHERE (views 1 cond, 2, 3). Views are
// strided (broadcast dims have stride 0; the host merges contiguous dims first, so a
// contiguous tensor is one dim). Float dtypes compute in f32; with ex[0] = 1 every view
// is an integer dtype and the op computes in int64 (the ops the host allows for ints).
#include "common.glsl"
layout(local_size_x = 256) in;
#include "ew.glsl"

void main() {
  Params P = pc.P;
  int k = int(kv_linear_group() * 256u + gl_LocalInvocationID.x);
  if (k >= P.n) return;
  int o[KV_MAXV];
  kv_offsets(k, o);
  int op = P.op;
  if (op == KV_WHERE) {
    bool c = P.dtype[1] >= KV_I64 ? kv_ldi(1, o[1]) != 0l : kv_ld(1, o[1]) != 0.0;
    if (P.ex[0] != 0) kv_sti(0, o[0], c ? kv_ldi(2, o[2]) : kv_ldi(3, o[3]));
    else kv_st(0, o[0], c ? kv_ld(2, o[2]) : kv_ld(3, o[3]));
    return;
  }
  if (P.ex[0] != 0) { // integers
    int64_t x = kv_ldi(1, o[1]);
    int64_t r;
    if (op < KV_RELU_BW) r = op == KV_NEG ? -x : op == KV_ABS ? abs(x) : op == KV_SIGN ? sign(x) : max(x, 0l);
    else r = binary_int(op, x, kv_ldi(2, o[2]));
    kv_sti(0, o[0], r);
    return;
  }
  float x = kv_ld(1, o[1]);
  float r;
  if (op < KV_RELU_BW) r = unary(op, x);
  else if (op < KV_ADD) r = backward(op, x, kv_ld(2, o[2]));
  else r = binary(op, x, kv_ld(2, o[2]));
  kv_st(0, o[0], r);
}
