// Shared by every kiln shader: tensors reached by device address (GL_EXT_buffer_reference),
// the parameter block every dispatch gets (its address is the one push constant), loads
// and stores of every dtype through f32 (16-bit floats are computed in f32, as on the CPU),
// and the strided index walk. The parameter block's layout is kv_params in vk_kernels.c.
#extension GL_EXT_buffer_reference : require
#extension GL_EXT_shader_explicit_arithmetic_types_int64 : require
#extension GL_EXT_shader_8bit_storage : require
#extension GL_EXT_shader_16bit_storage : require

#include "kv_ops.h"

layout(buffer_reference, std430, buffer_reference_align = 4) buffer BF32 { float v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer BU32 { uint v[]; };
layout(buffer_reference, std430, buffer_reference_align = 4) buffer BI32 { int v[]; };
layout(buffer_reference, std430, buffer_reference_align = 8) buffer BI64 { int64_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 8) buffer BU64 { uint64_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 2) buffer BF16 { float16_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 2) buffer BU16 { uint16_t v[]; };
layout(buffer_reference, std430, buffer_reference_align = 1) buffer BU8 { uint8_t v[]; };

layout(buffer_reference, std430, buffer_reference_align = 8) readonly buffer Params {
  uint64_t addr[KV_MAXV];
  uint64_t flag;      // device address of the device's error word (bad indices)
  int ndim;
  int n;              // elements (or rows) to walk
  int op;
  int nv;             // views in use
  float s[4];
  int i[4];
  int dtype[KV_MAXV];
  int shape[KV_MAXD];
  int strides[KV_MAXV * KV_MAXD];
  int ex[16];         // per-kernel extras
};

layout(push_constant) uniform PC { Params P; } pc;

// the element index of this invocation in a 2-d grid of 1-d workgroups
uint kv_linear_group() { return gl_WorkGroupID.y * gl_NumWorkGroups.x + gl_WorkGroupID.x; }

float kv_bf16_to_f32(uint b) { return uintBitsToFloat(b << 16); }
uint kv_f32_to_bf16(float f) {
  uint u = floatBitsToUint(f);
  if (isnan(f)) return (u >> 16) | 0x40u;  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);         // round to nearest even
  return u >> 16;
}

// f16 bits of f in the low half (the driver's conversion, as kv_st's float16_t)
uint kv_f32_to_f16(float f) { return packHalf2x16(vec2(f, 0.0)) & 0xFFFFu; }

float kv_ld(int v, int off) {
  Params P = pc.P;
  uint64_t a = P.addr[v];
  switch (P.dtype[v]) {
  case KV_F32: return BF32(a).v[off];
  case KV_F16: return float(BF16(a).v[off]);
  case KV_BF16: return kv_bf16_to_f32(uint(BU16(a).v[off]));
  case KV_I64: return float(BI64(a).v[off]);
  case KV_I32: return float(BI32(a).v[off]);
  case KV_U8: return float(uint(BU8(a).v[off]));
  case KV_BOOL: return uint(BU8(a).v[off]) != 0u ? 1.0 : 0.0;
  }
  return 0.0;
}

void kv_st(int v, int off, float x) {
  Params P = pc.P;
  uint64_t a = P.addr[v];
  switch (P.dtype[v]) {
  case KV_F32: BF32(a).v[off] = x; break;
  case KV_F16: BF16(a).v[off] = float16_t(x); break;
  case KV_BF16: BU16(a).v[off] = uint16_t(kv_f32_to_bf16(x)); break;
  case KV_I64: BI64(a).v[off] = int64_t(x); break;
  case KV_I32: BI32(a).v[off] = int(x); break;
  case KV_U8: BU8(a).v[off] = uint8_t(uint(int(x))); break;
  case KV_BOOL: BU8(a).v[off] = uint8_t(x != 0.0 ? 1u : 0u); break;
  }
}

// integers exactly: i64/i32/u8/bool through int64
int64_t kv_ldi(int v, int off) {
  Params P = pc.P;
  uint64_t a = P.addr[v];
  switch (P.dtype[v]) {
  case KV_I64: return BI64(a).v[off];
  case KV_I32: return int64_t(BI32(a).v[off]);
  case KV_U8: return int64_t(uint(BU8(a).v[off]));
  case KV_BOOL: return uint(BU8(a).v[off]) != 0u ? 1l : 0l;
  }
  return int64_t(kv_ld(v, off));
}

void kv_sti(int v, int off, int64_t x) {
  Params P = pc.P;
  uint64_t a = P.addr[v];
  switch (P.dtype[v]) {
  case KV_I64: BI64(a).v[off] = x; break;
  case KV_I32: BI32(a).v[off] = int(x); break;
  case KV_U8: BU8(a).v[off] = uint8_t(uint(x & 255l)); break;
  case KV_BOOL: BU8(a).v[off] = uint8_t(x != 0l ? 1u : 0u); break;
  default: kv_st(v, off, float(x)); break;
  }
}

// Element offsets of linear index k (C order over shape[0..ndim)) in views 0..nv-1.
void kv_offsets(int k, out int o[KV_MAXV]) {
  Params P = pc.P;
  for (int v = 0; v < KV_MAXV; v++) o[v] = 0;
  for (int d = P.ndim - 1; d >= 0; d--) {
    int sz = P.shape[d];
    int idx = k % sz;
    k /= sz;
    for (int v = 0; v < P.nv; v++) o[v] += idx * P.strides[v * KV_MAXD + d];
  }
}

void kv_set_flag(int code) {
  uint64_t f = pc.P.flag;
  if (f != 0ul) atomicMax(BU32(f).v[0], uint(code));
}
