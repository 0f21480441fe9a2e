// COPY: view 1 -> view 0, any dtype pair. Same dtype: the bits, by element size (i[0]).
// Casts: integers among themselves exactly (int64), floats through f32 (f64 through f64 in
// the copy_f64 variant, which only devices with shaderFloat64 get).
#include "common.glsl"
#ifdef KV_HAVE_F64
layout(buffer_reference, std430, buffer_reference_align = 8) buffer BF64 { double v[]; };
#endif
layout(local_size_x = 256) in;

void main() {
  Params P = pc.P;
  int k = int(kv_linear_group() * 256u + gl_LocalInvocationID.x);
  if (k >= P.n) return;
  int o[KV_MAXV];
  kv_offsets(k, o);
  int dto = P.dtype[0], dti = P.dtype[1];
  uint64_t ao = P.addr[0], ai = P.addr[1];
  if (dto == dti) {
    int es = P.i[0];
    if (es == 4) BU32(ao).v[o[0]] = BU32(ai).v[o[1]];
    else if (es == 8) BU64(ao).v[o[0]] = BU64(ai).v[o[1]];
    else if (es == 2) BU16(ao).v[o[0]] = BU16(ai).v[o[1]];
    else BU8(ao).v[o[0]] = BU8(ai).v[o[1]];
    return;
  }
  bool ii = dti >= KV_I64, io = dto >= KV_I64;
#ifdef KV_HAVE_F64
  if (dti == KV_F64 || dto == KV_F64) {
    double x = dti == KV_F64 ? BF64(ai).v[o[1]] : (ii ? double(kv_ldi(1, o[1])) : double(kv_ld(1, o[1])));
    if (dto == KV_F64) BF64(ao).v[o[0]] = x;
    else if (dto == KV_BOOL) BU8(ao).v[o[0]] = uint8_t(x != 0.0lf ? 1u : 0u);
    else if (io) kv_sti(0, o[0], int64_t(x));
    else kv_st(0, o[0], float(x));
    return;
  }
#endif
  if (ii && io) {
    kv_sti(0, o[0], kv_ldi(1, o[1]));
  } else if (io) { // float -> integer: truncation; bool: nonzero (NaN too)
    float x = kv_ld(1, o[1]);
    if (dto == KV_BOOL) BU8(ao).v[o[0]] = uint8_t(x != 0.0 || isnan(x) ? 1u : 0u);
    else kv_sti(0, o[0], int64_t(x));
  } else {
    kv_st(0, o[0], ii ? float(kv_ldi(1, o[1])) : kv_ld(1, o[1]));
  }
}
