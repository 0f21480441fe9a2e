// Reductions over a workgroup of 256 invocations, every invocation getting the result:
// wg_sum, wg_prod, wg_max and wg_min (those two propagate NaN, as the CPU's do). With
// KV_SUBGROUP 1 (the *_sg.comp shaders, for devices with subgroup arithmetic in compute)
// each subgroup reduces in registers and one barrier joins the subgroups' partials, read
// in subgroup order by every invocation; with KV_SUBGROUP 0 a pairwise tree in shared
// memory (8 barriers). Call from uniform control flow (they hold barriers); wg_part is
// free again when they return.
#if KV_SUBGROUP
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_KHR_shader_subgroup_arithmetic : require
#extension GL_KHR_shader_subgroup_vote : require
#endif

shared float wg_part[256];

// kv_ops.h's reduction codes, so reduce.glsl passes its op through
#define WG_SUM KV_R_SUM
#define WG_PROD KV_R_PROD
#define WG_MAX KV_R_MAX
#define WG_MIN KV_R_MIN

float wg_fold2(int op, float a, float b) {
  switch (op) {
  case WG_SUM: return a + b;
  case WG_PROD: return a * b;
  case WG_MAX: return isnan(b) || b > a ? b : a;
  case WG_MIN: return isnan(b) || b < a ? b : a;
  }
  return a;
}

float wg_reduce(int op, float v) {
#if KV_SUBGROUP
  float s;
  // subgroupMax/Min leave NaN to the implementation: a NaN anywhere makes the result NaN
  if ((op == WG_MAX || op == WG_MIN) && subgroupAny(isnan(v))) s = uintBitsToFloat(0x7FC00000u);
  else if (op == WG_SUM) s = subgroupAdd(v);
  else if (op == WG_PROD) s = subgroupMul(v);
  else if (op == WG_MAX) s = subgroupMax(v);
  else s = subgroupMin(v);
  if (subgroupElect()) wg_part[gl_SubgroupID] = s;
  barrier();
  float r = wg_part[0];
  for (uint i = 1u; i < gl_NumSubgroups; i++) r = wg_fold2(op, r, wg_part[i]);
  barrier();
  return r;
#else
  uint t = gl_LocalInvocationID.x;
  wg_part[t] = v;
  barrier();
  for (uint s = 128u; s > 0u; s >>= 1) {
    if (t < s) wg_part[t] = wg_fold2(op, wg_part[t], wg_part[t + s]);
    barrier();
  }
  float r = wg_part[0];
  barrier();
  return r;
#endif
}

float wg_sum(float v) { return wg_reduce(WG_SUM, v); }
float wg_max(float v) { return wg_reduce(WG_MAX, v); }
