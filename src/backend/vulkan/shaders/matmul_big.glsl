// MATMUL for large products, register-blocked (included by matmul_big_f32/f16/bf16.comp
// with KV_ELEM 0 f32, 1 f16, 2 bf16: the dtype of A and B). A 128x128 tile of C per
// workgroup of 256, each invocation 8x8 outputs: rows ty*4 + {0..3} and 64 + ty*4 + {0..3},
// columns tx*4 + {0..3} and 64 + tx*4 + {0..3}, so each step of k reads two vec4s of A and
// two of B from shared memory for 64 fma. K in steps of BK (8; 16 in matmul_big_f32_k16);
// the tiles are double-buffered in shared memory (one barrier a step) and the next step's
// global loads are issued before this step's arithmetic. Every register array is indexed by constants only (loops
// [[unroll]]ed): a dynamically indexed array goes to local memory on NVIDIA, which is what
// made the earlier 128x128 kernel 8x slower than the 64x64 one there.
//
// Layouts (the host picks this kernel only for these, ex[13]): bit 0: A's k is contiguous
// (acs == 1; else A's m is, ars == 1); bit 1: B's n is contiguous (bcs == 1; else its k,
// brs == 1); bit 2: C is f32 with n contiguous and 16-byte aligned rows (vec4 stores).
// Whole vec4 loads need the contiguous dim's leading stride and the batch offsets to be
// multiples of 4 and the addresses 16-byte aligned (8 for 16-bit types); the host checks.
// Tiles past M, N or K read zeros (a vec4 that is partly outside is read element-wise).
// Views: 0 C, 1 A, 2 B, 3 bias, walked over the batch by gl_WorkGroupID.z. C = alpha*A@B +
// beta*C (ex[12] & 8) + bias (& 4), ReLU last (& 1); no mask (matmul.comp has it).
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
layout(local_size_x = 256) in;

layout(buffer_reference, std430, buffer_reference_align = 16) buffer BV4F { vec4 v[]; };
layout(buffer_reference, std430, buffer_reference_align = 8) buffer BV2U { uvec2 v[]; };

#ifndef BK
#define BK 8 // K's step; each invocation loads BK / 8 vectors of A and of B a step
#endif
const int QL = BK / 8;
shared vec4 As[2][BK][33]; // [buffer][k][m / 4]; rows padded to 132 floats
shared vec4 Bs[2][BK][33]; // [buffer][k][n / 4]

// 4 consecutive elements at element offset off (a multiple of 4) of a view, as f32
// (base: the view's address, read from the parameters once, before the loop)
vec4 ld4(uint64_t base, int off) {
#if KV_ELEM == 0
  return BV4F(base).v[off >> 2];
#else
  uvec2 u = BV2U(base).v[off >> 2];
#if KV_ELEM == 1
  return vec4(unpackHalf2x16(u.x), unpackHalf2x16(u.y));
#else
  return vec4(uintBitsToFloat(u.x << 16), uintBitsToFloat(u.x & 0xFFFF0000u), uintBitsToFloat(u.y << 16),
              uintBitsToFloat(u.y & 0xFFFF0000u));
#endif
#endif
}

// 4 elements at off + c*step (c < 4), those with ok_c false read as 0
vec4 ld4_edge(int v, int off, int step, bvec4 ok) {
  vec4 x = vec4(0.0);
  [[unroll]] for (int c = 0; c < 4; c++)
    if (ok[c]) x[c] = kv_ld(v, off + c * step);
  return x;
}

void main() {
  Params P = pc.P;
  int M = P.ex[0], N = P.ex[1], K = P.ex[2];
  int ars = P.ex[3], acs = P.ex[4], brs = P.ex[5], bcs = P.ex[6], crs = P.ex[7], ccs = P.ex[8];
  int flags = P.ex[12], lay = P.ex[13];
  bool a_kc = (lay & 1) != 0, b_nc = (lay & 2) != 0;
  int o[KV_MAXV];
  kv_offsets(int(gl_WorkGroupID.z), o);
  int oa = o[1], ob = o[2], oc = o[0];
  // the operands' addresses in registers: the parameter block is memory, and a load of it
  // in the loop would sit in front of every global load of the operands
  uint64_t addr_a = P.addr[1], addr_b = P.addr[2];
  int tid = int(gl_LocalInvocationID.x);
  int tx = tid & 15, ty = tid >> 4;
  int m0 = int(gl_WorkGroupID.y) * 128, n0 = int(gl_WorkGroupID.x) * 128;

  // What this invocation loads each step: QL vectors of A's 128xBK tile and of B's BKx128,
  // vector v = tid + 256 q. k-contiguous operand: row v / (BK/4) of the tile, k = (v %
  // (BK/4)) * 4 .. +3 (stored transposed); mn-contiguous: k = v / 32, m or n = (v % 32) * 4
  // .. +3 (stored as is).
  int a_r[QL], a_k[QL], b_c[QL], b_k[QL];
  [[unroll]] for (int q = 0; q < QL; q++) {
    int v = tid + 256 * q;
    a_r[q] = a_kc ? v / (BK / 4) : (v & 31) * 4, a_k[q] = a_kc ? (v % (BK / 4)) * 4 : v >> 5;
    b_c[q] = b_nc ? (v & 31) * 4 : v / (BK / 4), b_k[q] = b_nc ? v >> 5 : (v % (BK / 4)) * 4;
  }
  vec4 ra[QL], rb[QL];

  float acc[8][8];
  [[unroll]] for (int i = 0; i < 8; i++)
    [[unroll]] for (int j = 0; j < 8; j++) acc[i][j] = 0.0;

  int nsteps = (K + BK - 1) / BK;
  for (int s = 0; s <= nsteps; s++) {
    int buf = s & 1;
    if (s < nsteps) { // global -> registers: step s
      int k0 = s * BK;
      [[unroll]] for (int q = 0; q < QL; q++) {
        if (a_kc) {
          int m = m0 + a_r[q], k = k0 + a_k[q], off = oa + m * ars + k;
          if (m < M && k + 3 < K) ra[q] = ld4(addr_a, off);
          else ra[q] = ld4_edge(1, off, 1, bvec4(m < M && k < K, m < M && k + 1 < K, m < M && k + 2 < K, m < M && k + 3 < K));
        } else {
          int m = m0 + a_r[q], k = k0 + a_k[q], off = oa + k * acs + m;
          if (k < K && m + 3 < M) ra[q] = ld4(addr_a, off);
          else ra[q] = ld4_edge(1, off, 1, bvec4(k < K && m < M, k < K && m + 1 < M, k < K && m + 2 < M, k < K && m + 3 < M));
        }
        if (b_nc) {
          int n = n0 + b_c[q], k = k0 + b_k[q], off = ob + k * brs + n;
          if (k < K && n + 3 < N) rb[q] = ld4(addr_b, off);
          else rb[q] = ld4_edge(2, off, 1, bvec4(k < K && n < N, k < K && n + 1 < N, k < K && n + 2 < N, k < K && n + 3 < N));
        } else {
          int n = n0 + b_c[q], k = k0 + b_k[q], off = ob + n * bcs + k;
          if (n < N && k + 3 < K) rb[q] = ld4(addr_b, off);
          else rb[q] = ld4_edge(2, off, 1, bvec4(n < N && k < K, n < N && k + 1 < K, n < N && k + 2 < K, n < N && k + 3 < K));
        }
      }
    }
    if (s > 0) { // multiply step s - 1, in buffer 1 - buf
      int pb = 1 - buf;
      [[unroll]] for (int kk = 0; kk < BK; kk++) {
        vec4 a0 = As[pb][kk][ty], a1 = As[pb][kk][ty + 16];
        vec4 b0 = Bs[pb][kk][tx], b1 = Bs[pb][kk][tx + 16];
        float a[8] = float[8](a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w);
        float b[8] = float[8](b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w);
        [[unroll]] for (int i = 0; i < 8; i++)
          [[unroll]] for (int j = 0; j < 8; j++) acc[i][j] = fma(a[i], b[j], acc[i][j]);
      }
    }
    if (s < nsteps) { // registers -> shared: step s, into buffer buf (last read two steps ago)
      [[unroll]] for (int q = 0; q < QL; q++) {
        if (a_kc) {
          [[unroll]] for (int c = 0; c < 4; c++) As[buf][a_k[q] + c][a_r[q] >> 2][a_r[q] & 3] = ra[q][c];
        } else {
          As[buf][a_k[q]][a_r[q] >> 2] = ra[q];
        }
        if (b_nc) {
          Bs[buf][b_k[q]][b_c[q] >> 2] = rb[q];
        } else {
          [[unroll]] for (int c = 0; c < 4; c++) Bs[buf][b_k[q] + c][b_c[q] >> 2][b_c[q] & 3] = rb[q][c];
        }
      }
    }
    barrier();
  }

  float alpha = P.s[0], beta = P.s[1];
  bool vec_store = (lay & 4) != 0 && (flags & 8) == 0;
  [[unroll]] for (int i = 0; i < 8; i++) {
    int m = m0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + i - 4);
    if (m >= M) continue;
    [[unroll]] for (int h = 0; h < 2; h++) {
      int nb = n0 + h * 64 + tx * 4;
      vec4 r = alpha * vec4(acc[i][4 * h], acc[i][4 * h + 1], acc[i][4 * h + 2], acc[i][4 * h + 3]);
      if ((flags & 4) != 0) {
        [[unroll]] for (int c = 0; c < 4; c++)
          if (nb + c < N) r[c] += kv_ld(3, o[3] + (nb + c) * P.ex[9]);
      }
      if (vec_store && nb + 3 < N) {
        if ((flags & 1) != 0) r = mix(max(r, vec4(0.0)), r, isnan(r));
        BV4F(P.addr[0]).v[(oc + m * crs + nb) >> 2] = r;
        continue;
      }
      [[unroll]] for (int c = 0; c < 4; c++) {
        int n = nb + c;
        if (n >= N) continue;
        int co = oc + m * crs + n * ccs;
        float x = r[c];
        if ((flags & 8) != 0) x += beta * kv_ld(0, co);
        if ((flags & 1) != 0) x = x > 0.0 ? x : (isnan(x) ? x : 0.0);
        kv_st(0, co, x);
      }
    }
  }
}
