// MATMUL of f16 A and B on NVIDIA's tensor cores (VK_NV_cooperative_matrix: 16x16x16
// fragments, f32 accumulation), included by matmul_cm*.comp, which set the tiling: WM x WN
// subgroups of 32 (the host requires subgroups of 32), each FM x FN fragments, so a
// workgroup computes a BM x BN = (WM*FM*16) x (WN*FN*16) tile of C; K in steps of BK (16
// or 32). The tiles of A (BM x BK) and B (BK x BN) are staged in shared memory, double-
// buffered (one barrier a step), the next step's global loads (16-byte vectors) issued
// before this step's products; the fragments are loaded from shared memory, whose rows are
// padded by 16 bytes so the 8 rows a fragment load reads at once fall in different banks.
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
//
// With KV_CM_BF16 (matmul_cm*_bf16.comp) A and B are bf16, which tensor cores cannot take
// through this extension: each row of A and each column of B is scaled by a power of two
// that brings its largest |x| into [2^14, 2^15) and converted to f16 while staged (exact
// for every element within 2^-28 of its line's largest; smaller ones lose bits, far below
// the f32 accumulation's rounding), and the epilogue divides the scales out again. The
// lines' largest |x| come from mm_absmax.comp, as f32 bits in view 4: A's rows at
// z * M + m, B's columns at ex[14] * M + z * N + n (ex[14]: the batch count).
#extension GL_NV_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"

const int NT = WM * WN * 32;              // invocations
const int BM = WM * FM * 16, BN = WN * FN * 16;
const int SK = BK / 8 + 1;                // row stride (16-byte units) of an m- or n-major tile
const int SMA = BM / 8 + 1, SMB = BN / 8 + 1; // of a k-major tile of A, of B
const int TSA = BM * SK > BK * SMA ? BM * SK : BK * SMA; // a tile's size, either layout
const int TSB = BN * SK > BK * SMB ? BN * SK : BK * SMB;
const int QA = BM * BK / 8 / NT, QB = BK * BN / 8 / NT; // vectors each invocation stages
layout(local_size_x = NT) in;

layout(buffer_reference, std430, buffer_reference_align = 16) buffer BV8H { uvec4 v[]; };

shared uvec4 As[2 * TSA];
shared uvec4 Bs[2 * TSB]; // also the epilogue's scratch: 64 vectors per subgroup

#ifdef KV_CM_BF16
// The scale for a line whose largest |x| has f32 bits mb: 2^(15 - e) for largest in
// [2^(e-1), 2^e); 1 for an all-zero line and for one holding an infinity or a NaN.
float line_scale(uint mb) {
  float mx = uintBitsToFloat(mb);
  if (mb == 0u || mb >= 0x7F800000u) return 1.0;
  int e;
  frexp(mx, e);
  return exp2(float(clamp(15 - e, -126, 127)));
}

float scale_at(int i) { return line_scale(BU32(pc.P.addr[4]).v[i]); }

// 8 bf16 (a 16-byte vector) times their scales, as 8 f16
uvec4 bf16_to_f16(uvec4 w, vec4 s0, vec4 s1) {
  uvec4 r;
  r.x = packHalf2x16(vec2(uintBitsToFloat(w.x << 16) * s0.x, uintBitsToFloat(w.x & 0xFFFF0000u) * s0.y));
  r.y = packHalf2x16(vec2(uintBitsToFloat(w.y << 16) * s0.z, uintBitsToFloat(w.y & 0xFFFF0000u) * s0.w));
  r.z = packHalf2x16(vec2(uintBitsToFloat(w.z << 16) * s1.x, uintBitsToFloat(w.z & 0xFFFF0000u) * s1.y));
  r.w = packHalf2x16(vec2(uintBitsToFloat(w.w << 16) * s1.z, uintBitsToFloat(w.w & 0xFFFF0000u) * s1.w));
  return r;
}
#endif

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
  // the operands' addresses in registers: the parameter block is memory, and a load of it
  // in the loop would sit in front of every global load of the operands
  BV8H gA = BV8H(P.addr[1]), gB = BV8H(P.addr[2]);
  int tid = int(gl_LocalInvocationID.x);
  int sg = int(gl_SubgroupID), wm = sg / WN, wn = sg % WN;
  int m0 = int(gl_WorkGroupID.y) * BM, n0 = int(gl_WorkGroupID.x) * BN;

  ACC acc[FM][FN];
  [[unroll]] for (int i = 0; i < FM; i++)
    [[unroll]] for (int j = 0; j < FN; j++) acc[i][j] = ACC(0.0);

  uvec4 ra[QA], rb[QB];
#ifdef KV_CM_BF16
  // The scales of the lines this invocation stages (the same every step): one for a vector
  // along k, eight for one along m or n.
  int z = int(gl_WorkGroupID.z), sa0 = z * M, sb0 = P.ex[14] * M + z * N;
  vec4 sa[QA][2], sb[QB][2];
  [[unroll]] for (int q = 0; q < QA; q++) {
    int v = tid + NT * q;
    if (a_kc) {
      int m = m0 + v / (BK / 8);
      float x = m < M ? scale_at(sa0 + m) : 1.0;
      sa[q][0] = vec4(x), sa[q][1] = vec4(x);
    } else {
      int m = m0 + (v % (BM / 8)) * 8;
      [[unroll]] for (int c = 0; c < 8; c++) sa[q][c >> 2][c & 3] = m + c < M ? scale_at(sa0 + m + c) : 1.0;
    }
  }
  [[unroll]] for (int q = 0; q < QB; q++) {
    int v = tid + NT * q;
    if (b_nc) {
      int n = n0 + (v % (BN / 8)) * 8;
      [[unroll]] for (int c = 0; c < 8; c++) sb[q][c >> 2][c & 3] = n + c < N ? scale_at(sb0 + n + c) : 1.0;
    } else {
      int n = n0 + v / (BK / 8);
      float x = n < N ? scale_at(sb0 + n) : 1.0;
      sb[q][0] = vec4(x), sb[q][1] = vec4(x);
    }
  }
#define CVT_A(q, w) bf16_to_f16(w, sa[q][0], sa[q][1])
#define CVT_B(q, w) bf16_to_f16(w, sb[q][0], sb[q][1])
#else
#define CVT_A(q, w) (w)
#define CVT_B(q, w) (w)
#endif
  int nsteps = (K + BK - 1) / BK;
  for (int s = 0; s <= nsteps; s++) {
    int buf = s & 1;
    if (s < nsteps) { // global -> registers: step s
      int k0 = s * BK;
      [[unroll]] for (int q = 0; q < QA; q++) {
        int v = tid + NT * q;
        if (a_kc) { // BM rows of m, BK / 8 vectors of k each
          int m = m0 + v / (BK / 8), k = k0 + (v % (BK / 8)) * 8;
          ra[q] = m < M && k < K ? gA.v[(oa + m * ars + k) >> 3] : uvec4(0u);
        } else { // BK rows of k, BM / 8 vectors of m each
          int k = k0 + v / (BM / 8), m = m0 + (v % (BM / 8)) * 8;
          ra[q] = k < K && m < M ? gA.v[(oa + k * acs + m) >> 3] : uvec4(0u);
        }
      }
      [[unroll]] for (int q = 0; q < QB; q++) {
        int v = tid + NT * q;
        if (b_nc) { // BK rows of k, BN / 8 vectors of n each
          int k = k0 + v / (BN / 8), n = n0 + (v % (BN / 8)) * 8;
          rb[q] = k < K && n < N ? gB.v[(ob + k * brs + n) >> 3] : uvec4(0u);
        } else { // BN rows of n, BK / 8 vectors of k each
          int n = n0 + v / (BK / 8), k = k0 + (v % (BK / 8)) * 8;
          rb[q] = n < N && k < K ? gB.v[(ob + n * bcs + k) >> 3] : uvec4(0u);
        }
      }
    }
    if (s > 0) { // multiply step s - 1 from buffer 1 - buf
      int pa = (1 - buf) * TSA, pb = (1 - buf) * TSB;
      [[unroll]] for (int kk = 0; kk < BK / 16; kk++) {
        FRAG a[FM], b[FN];
        int k = kk * 16;
        [[unroll]] for (int i = 0; i < FM; i++) {
          int m = (wm * FM + i) * 16;
          if (a_kc) coopMatLoadNV(a[i], As, uint(pa + m * SK + k / 8), uint(SK), false);
          else coopMatLoadNV(a[i], As, uint(pa + k * SMA + m / 8), uint(SMA), true);
        }
        [[unroll]] for (int j = 0; j < FN; j++) {
          int n = (wn * FN + j) * 16;
          if (b_nc) coopMatLoadNV(b[j], Bs, uint(pb + k * SMB + n / 8), uint(SMB), false);
          else coopMatLoadNV(b[j], Bs, uint(pb + n * SK + k / 8), uint(SK), true);
        }
        [[unroll]] for (int i = 0; i < FM; i++)
          [[unroll]] for (int j = 0; j < FN; j++) acc[i][j] = coopMatMulAddNV(a[i], b[j], acc[i][j]);
      }
    }
    if (s < nsteps) { // registers -> shared: step s into buffer buf (read two steps ago)
      int ca = buf * TSA, cb = buf * TSB;
      [[unroll]] for (int q = 0; q < QA; q++) {
        int v = tid + NT * q;
        As[ca + (a_kc ? (v / (BK / 8)) * SK + v % (BK / 8) : (v / (BM / 8)) * SMA + v % (BM / 8))] = CVT_A(q, ra[q]);
      }
      [[unroll]] for (int q = 0; q < QB; q++) {
        int v = tid + NT * q;
        Bs[cb + (b_nc ? (v / (BN / 8)) * SMB + v % (BN / 8) : (v / (BK / 8)) * SK + v % (BK / 8))] = CVT_B(q, rb[q]);
      }
    }
    barrier();
  }

  // Epilogue: each subgroup stores one 16x16 f32 fragment at a time into its 1 KiB of Bs
  // (64 vectors, 4 to a row), then each of its 32 invocations finishes 8 elements.
  float alpha = P.s[0], beta = P.s[1];
  int lane = int(gl_SubgroupInvocationID), scr = sg * 64;
  [[unroll]] for (int i = 0; i < FM; i++)
    [[unroll]] for (int j = 0; j < FN; j++) {
      coopMatStoreNV(acc[i][j], Bs, uint(scr), 4u, false);
      subgroupMemoryBarrierShared();
      subgroupBarrier();
      [[unroll]] for (int t = 0; t < 8; t++) {
        int e = lane + 32 * t, r = e >> 4, c = e & 15;
        int m = m0 + (wm * FM + i) * 16 + r, n = n0 + (wn * FN + j) * 16 + c;
        if (m < M && n < N) {
          float x = alpha * uintBitsToFloat(Bs[scr + r * 4 + (c >> 2)][c & 3]);
#ifdef KV_CM_BF16
          x = x / scale_at(sa0 + m) / scale_at(sb0 + n); // powers of two: exact
#endif
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
