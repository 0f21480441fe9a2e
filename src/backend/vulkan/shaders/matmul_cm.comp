#version 450
// MATMUL of f16 on NVIDIA's tensor cores (VK_NV_cooperative_matrix, 16x16x16 fragments,
// f32 accumulation): a 64x64 tile of C per workgroup of 4 subgroups of 32, each subgroup
// 2x2 fragments (32x32), A and B read straight from memory (row-major, K and N
// contiguous). Only plain products: C = A@B (no alpha, beta, bias, ReLU or mask), M and N
// multiples of 64, K of 16, leading dimensions multiples of 8, 16-byte aligned; the host
// checks (vk_kernels.c) and uses it only when the device enabled the extension
// (KILN_VK_COOPMAT=1). Views 0 C, 1 A, 2 B walked over the batch by gl_WorkGroupID.z.
#extension GL_NV_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_shader_subgroup_basic : require
#include "common.glsl"
layout(local_size_x = 128) in;

layout(buffer_reference, std430, buffer_reference_align = 16) buffer CH { float16_t v[]; };

void main() {
  Params P = pc.P;
  int K = P.ex[2];
  uint lda = uint(P.ex[3]), ldb = uint(P.ex[5]), ldc = uint(P.ex[7]);
  int o[KV_MAXV];
  kv_offsets(int(gl_WorkGroupID.z), o);
  uint sg = gl_SubgroupID;
  uint m0 = gl_WorkGroupID.y * 64u + 32u * (sg / 2u), n0 = gl_WorkGroupID.x * 64u + 32u * (sg % 2u);
  fcoopmatNV<32, gl_ScopeSubgroup, 16, 16> acc[2][2];
  for (int i = 0; i < 2; i++)
    for (int j = 0; j < 2; j++) acc[i][j] = fcoopmatNV<32, gl_ScopeSubgroup, 16, 16>(0.0);
  CH A = CH(P.addr[1]), B = CH(P.addr[2]), C = CH(P.addr[0]);
  for (uint k = 0u; k < uint(K); k += 16u) {
    fcoopmatNV<16, gl_ScopeSubgroup, 16, 16> a[2], b[2];
    for (uint i = 0u; i < 2u; i++) coopMatLoadNV(a[i], A.v, uint(o[1]) + (m0 + 16u * i) * lda + k, lda, false);
    for (uint j = 0u; j < 2u; j++) coopMatLoadNV(b[j], B.v, uint(o[2]) + k * ldb + n0 + 16u * j, ldb, false);
    for (int i = 0; i < 2; i++)
      for (int j = 0; j < 2; j++) acc[i][j] = coopMatMulAddNV(a[i], b[j], acc[i][j]);
  }
  for (uint i = 0u; i < 2u; i++)
    for (uint j = 0u; j < 2u; j++) {
      fcoopmatNV<16, gl_ScopeSubgroup, 16, 16> c = fcoopmatNV<16, gl_ScopeSubgroup, 16, 16>(acc[i][j]);
      coopMatStoreNV(c, C.v, uint(o[0]) + (m0 + 16u * i) * ldc + n0 + 16u * j, ldc, false);
    }
}
