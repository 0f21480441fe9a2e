#version 450
// MATMUL of f16 A and B on NVIDIA's tensor cores (VK_NV_cooperative_matrix: 16x16x16
// fragments, f32 accumulation). A 128x128 tile of C per workgroup of 8 subgroups of 32 (the
// host requires subgroups of 32), as 2x4 subgroups of 64x32 each (4x2 fragments). K in
// steps of 32: the tiles of A (128x32) and B (32x128) are staged in shared memory, double-
// buffered (one barrier a step), the next step's global loads (16-byte vectors, two of A
// and two of B per invocation) issued before this step's products; the fragments are
// loaded from shared memory, whose rows are padded by 16 bytes so the 8 rows a fragment
// load reads at once fall in different banks.
//
// Layouts (ex[13]): bit 0: A's k is contiguous (acs == 1; else its m, ars == 1, and the
// tile is kept k-major and loaded column-major); bit 1: B's n is contiguous (bcs == 1; else
// its k, brs == 1). The contiguous dim's size, its leading stride and the batch offsets are
// multiples of 8 and the addresses 16-byte aligned (the host checks), so a 16-byte vector
// is wholly inside or outside the matrix; outside reads zeros, so M, N, K need not be
// multiples of the tile. C goes through a per-subgroup scratch in shared memory, then
// each element takes the epilogue: C = alpha*A@B + beta*C (ex[12] & 8) + bias (& 4), ReLU
// last (& 1), stored in C's dtype at any strides. Views: 0 C, 1 A, 2 B, 3 bias, walked over
// the batch by gl_WorkGroupID.z.
#extension GL_NV_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
layout(local_size_x = 256) in;

layout(buffer_reference, std430, buffer_reference_align = 16) buffer BV8H { uvec4 v[]; };

// One operand's tile in 16-byte units (8 halves): m- or n-major 128 rows x (32 + 8 pad)
// halves = 640, or k-major 32 rows x (128 + 8) = 544. [buffer][...]
const int TS = 640;
const int SK = 5;  // row stride of a 128x32 tile, in 16-byte units (40 halves)
const int SMN = 17; // row stride of a 32x128 tile (136 halves)
shared uvec4 As[2 * TS];
shared uvec4 Bs[2 * TS];

#define FRAG fcoopmatNV<16, gl_ScopeSubgroup, 16, 16>
#define ACC fcoopmatNV<32, gl_ScopeSubgroup, 16, 16>

void main() {
  Params P = pc.P;
  int M = P.ex[0], N = P.ex[1], K = P.ex[2];
  int ars = P.ex[3], acs = P.ex[4], brs = P.ex[5], bcs = P.ex[6], crs = P.ex[7], ccs = P.ex[8];
  int flags = P.ex[12], lay = P.ex[13];
  bool a_kc = (lay & 1) != 0, b_nc = (lay & 2) != 0;
  int o[KV_MAXV];
  kv_offsets(int(gl_WorkGroupID.z), o);
  int oa = o[1], ob = o[2];
  int tid = int(gl_LocalInvocationID.x);
  int sg = int(gl_SubgroupID), wm = sg >> 2, wn = sg & 3;
  int m0 = int(gl_WorkGroupID.y) * 128, n0 = int(gl_WorkGroupID.x) * 128;

  ACC acc[4][2];
  [[unroll]] for (int i = 0; i < 4; i++)
    [[unroll]] for (int j = 0; j < 2; j++) acc[i][j] = ACC(0.0);

  uvec4 ra[2], rb[2];
  int nsteps = (K + 31) / 32;
  for (int s = 0; s <= nsteps; s++) {
    int buf = s & 1;
    if (s < nsteps) { // global -> registers: step s (512 vectors of each operand)
      int k0 = s * 32;
      [[unroll]] for (int q = 0; q < 2; q++) {
        int v = tid + 256 * q;
        if (a_kc) { // 128 rows of m, 4 vectors of k each
          int m = m0 + (v >> 2), k = k0 + (v & 3) * 8;
          ra[q] = m < M && k < K ? BV8H(P.addr[1]).v[(oa + m * ars + k) >> 3] : uvec4(0u);
        } else { // 32 rows of k, 16 vectors of m each
          int k = k0 + (v >> 4), m = m0 + (v & 15) * 8;
          ra[q] = k < K && m < M ? BV8H(P.addr[1]).v[(oa + k * acs + m) >> 3] : uvec4(0u);
        }
        if (b_nc) { // 32 rows of k, 16 vectors of n each
          int k = k0 + (v >> 4), n = n0 + (v & 15) * 8;
          rb[q] = k < K && n < N ? BV8H(P.addr[2]).v[(ob + k * brs + n) >> 3] : uvec4(0u);
        } else { // 128 rows of n, 4 vectors of k each
          int n = n0 + (v >> 2), k = k0 + (v & 3) * 8;
          rb[q] = n < N && k < K ? BV8H(P.addr[2]).v[(ob + n * bcs + k) >> 3] : uvec4(0u);
        }
      }
    }
    if (s > 0) { // multiply step s - 1 from buffer 1 - buf
      int pb = (1 - buf) * TS;
      [[unroll]] for (int kk = 0; kk < 2; kk++) {
        FRAG a[4], b[2];
        [[unroll]] for (int i = 0; i < 4; i++) {
          int m = wm * 64 + 16 * i, k = kk * 16;
          if (a_kc) coopMatLoadNV(a[i], As, uint(pb + m * SK + k / 8), uint(SK), false);
          else coopMatLoadNV(a[i], As, uint(pb + k * SMN + m / 8), uint(SMN), true);
        }
        [[unroll]] for (int j = 0; j < 2; j++) {
          int n = wn * 32 + 16 * j, k = kk * 16;
          if (b_nc) coopMatLoadNV(b[j], Bs, uint(pb + k * SMN + n / 8), uint(SMN), false);
          else coopMatLoadNV(b[j], Bs, uint(pb + n * SK + k / 8), uint(SK), true);
        }
        [[unroll]] for (int i = 0; i < 4; i++)
          [[unroll]] for (int j = 0; j < 2; j++) acc[i][j] = coopMatMulAddNV(a[i], b[j], acc[i][j]);
      }
    }
    if (s < nsteps) { // registers -> shared: step s into buffer buf
      int cb = buf * TS;
      [[unroll]] for (int q = 0; q < 2; q++) {
        int v = tid + 256 * q;
        As[cb + (a_kc ? (v >> 2) * SK + (v & 3) : (v >> 4) * SMN + (v & 15))] = ra[q];
        Bs[cb + (b_nc ? (v >> 4) * SMN + (v & 15) : (v >> 2) * SK + (v & 3))] = rb[q];
      }
    }
    barrier();
  }

  // Epilogue: each subgroup stores one 16x16 f32 fragment at a time into its 1 KiB of As
  // (64 vectors, 4 to a row), then each of its 32 invocations finishes 8 elements.
  float alpha = P.s[0], beta = P.s[1];
  int lane = int(gl_SubgroupInvocationID), scr = sg * 64;
  [[unroll]] for (int i = 0; i < 4; i++)
    [[unroll]] for (int j = 0; j < 2; j++) {
      coopMatStoreNV(acc[i][j], As, uint(scr), 4u, false);
      subgroupMemoryBarrierShared();
      subgroupBarrier();
      [[unroll]] for (int t = 0; t < 8; t++) {
        int e = lane + 32 * t, r = e >> 4, c = e & 15;
        int m = m0 + wm * 64 + 16 * i + r, n = n0 + wn * 32 + 16 * j + c;
        if (m < M && n < N) {
          float x = alpha * uintBitsToFloat(As[scr + r * 4 + (c >> 2)][c & 3]);
          int co = o[0] + m * crs + n * ccs;
          if ((flags & 8) != 0) x += beta * kv_ld(0, co);
          if ((flags & 4) != 0) x += kv_ld(3, o[3] + n * P.ex[9]);
          if ((flags & 1) != 0) x = x > 0.0 ? x : (isnan(x) ? x : 0.0);
          kv_st(0, co, x);
        }
      }
      subgroupBarrier();
    }
}
