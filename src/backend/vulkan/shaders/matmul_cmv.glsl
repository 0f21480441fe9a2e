// MATMUL of f16 A and B on NVIDIA's tensor cores (VK_NV_cooperative_matrix: 16x16x16
// fragments, f32 accumulation), included by matmul_cmv_*.comp, which set the tiling: WM x
// WN subgroups of 32 (the host requires subgroups of 32), each FM x FN fragments, so a
// workgroup computes a BM x BN = (WM*FM*16) x (WN*FN*16) tile of C; K in steps of BK
// (16, 32 or 64), staged in shared memory in STAGES buffers (2: one barrier a step, the
// next step's tile stored into the other buffer while this one is multiplied; 1: two
// barriers a step, half the shared memory, so bigger tiles fit NVIDIA's 48 KiB). Either
// way the next step's global loads (16-byte vectors into registers) are issued before this
// step's products. Fragments are loaded from shared memory, whose rows are padded by 16
// bytes so the 8 rows of one 8x8 block a fragment load reads at once fall in different
// banks.
//
// The layout is specialisation constant 0 (LAY), so the driver compiles one branch-free
// build per layout (a uniform branch inside the unrolled inner loop splits it into blocks
// the scheduler cannot interleave): bit 0: A's k is contiguous (acs == 1; else its m,
// ars == 1, and the tile is kept k-major and loaded column-major); bit 1: B's n is
// contiguous (bcs == 1; else its k, brs == 1); bit 2: C is f16 with n contiguous, 16-byte
// aligned rows and no beta, bias, ReLU or scales, so whole fragments inside C are
// converted to f16 and stored straight from the registers. The contiguous dim's size, its
// leading stride and the batch offsets are multiples of 8 and the addresses 16-byte
// aligned (the host checks), so a 16-byte vector is wholly inside or outside the matrix;
// outside reads zeros, so M, N, K need not be multiples of the tile. Other fragments go
// through a per-subgroup scratch in shared memory, then each element takes the epilogue:
// C = alpha*A@B + beta*C (ex[12] & 8) + bias (& 4), scales divided out (& 16), ReLU last
// (& 1), stored in C's dtype at any strides. Views: 0 C, 1 A, 2 B, 3 bias, 4 the scales,
// walked over the batch by gl_WorkGroupID.z.
//
// Scales (bf16 products): the host converts bf16 A and B to f16 first (mm_cvt_f16.comp),
// each row of A and column of B times the power of two that brings its largest |x| into
// [2^14, 2^15) (mm_scale.glsl); the epilogue divides them out. View 4 holds the lines'
// largest |x| as f32 bits: A's rows at z * M + m, B's columns at ex[14] * M + z * N + n
// (ex[14]: the batch count).
//
// KV_CM_EMU (matmul_cmv_*_emu.comp, taken with KILN_VK_CM_EMU=1 on a device without
// tensor cores, e.g. lavapipe in the tests): the fragments emulated, so every index of this
// file is tested on the CPU. A "subgroup" is then 32 consecutive invocations (whatever the
// device's subgroups); an accumulator holds element lane + 32 t (t < 8) of its 16x16 in
// each invocation, the order the scratch epilogue reads back, so no invocation reads what
// another wrote; an A or B fragment is only where it lies in shared memory, read when
// multiplied (the step's tile stays put until the barrier that ends it).
#ifndef KV_CM_EMU
#extension GL_NV_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#endif
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_control_flow_attributes : require
#include "common.glsl"
#include "mm_scale.glsl"

#define NT_ (WM * WN * 32)
#define BM_ (WM * FM * 16)
#define BN_ (WN * FN * 16)
#define SK_ (BK / 8 + 1)
#define TSA_ (BM_ * SK_ > BK * (BM_ / 8 + 1) ? BM_ * SK_ : BK * (BM_ / 8 + 1))
#define TSB_ (BN_ * SK_ > BK * (BN_ / 8 + 1) ? BN_ * SK_ : BK * (BN_ / 8 + 1))
#if (BM_ * BK / 8) % NT_ != 0 || (BN_ * BK / 8) % NT_ != 0
#error "each invocation must stage whole vectors of A and B"
#endif
#if BN_ * SK_ * STAGES < WM * WN * 64 && BK * (BN_ / 8 + 1) * STAGES < WM * WN * 64 // TSB_ * STAGES <
#error "the epilogue's scratch (64 vectors per subgroup) must fit in Bs"
#endif
#if BK % 16 != 0
#error "K steps are whole fragments"
#endif

layout(constant_id = 0) const int LAY = 0;
const bool A_KC = (LAY & 1) != 0;
const bool B_NC = (LAY & 2) != 0;
const bool C_DIRECT = (LAY & 4) != 0;

const int NT = NT_, BM = BM_, BN = BN_;
const int SK = SK_;                       // row stride (16-byte units) of an m- or n-major tile
const int SMA = BM / 8 + 1, SMB = BN / 8 + 1; // of a k-major tile of A, of B
const int TSA = TSA_, TSB = TSB_;         // a tile's size, either layout
const int QA = BM * BK / 8 / NT, QB = BK * BN / 8 / NT; // vectors each invocation stages
layout(local_size_x = NT_) in;

layout(buffer_reference, std430, buffer_reference_align = 16) buffer BV8H { uvec4 v[]; };

shared uvec4 As[STAGES * TSA_];
shared uvec4 Bs[STAGES * TSB_]; // also the epilogue's scratch: 64 vectors per subgroup

#ifndef KV_CM_EMU
#define FRAG fcoopmatNV<16, gl_ScopeSubgroup, 16, 16>
#define ACC fcoopmatNV<32, gl_ScopeSubgroup, 16, 16>
#define ACC_ZERO ACC(0.0)
#define SG_ID int(gl_SubgroupID)
#define SG_LANE int(gl_SubgroupInvocationID)
#define LOAD_A(f, off, st, col) coopMatLoadNV(f, As, uint(off), uint(st), col)
#define LOAD_B(f, off, st, col) coopMatLoadNV(f, Bs, uint(off), uint(st), col)
#define MMA(a, b, c) coopMatMulAddNV(a, b, c)
#define STORE_SCRATCH(c, off) coopMatStoreNV(c, Bs, uint(off), 4u, false)
#define STORE_F16(c, alpha, off, st) coopMatStoreNV(FRAG((c) * (alpha)), BV8H(P.addr[0]).v, uint(off), uint(st), false)
#define SG_SYNC() subgroupMemoryBarrierShared(); subgroupBarrier()
#else
struct FRAG { int off, st; bool col; };
struct ACC { float v[8]; };
#define ACC_ZERO ACC(float[8](0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
#define SG_ID (int(gl_LocalInvocationID.x) >> 5)
#define SG_LANE (int(gl_LocalInvocationID.x) & 31)
#define LOAD_A(f, off, st, col) f = FRAG(off, st, col)
#define LOAD_B(f, off, st, col) f = FRAG(off, st, col)
// element (r, c) of a fragment in a uvec4 array: 16-byte units, 8 halves each
#define EMU_AT(arr, f, r, c)                                                                \
  unpackHalf2x16(arr[(f).col ? (f).off + (c) * (f).st + ((r) >> 3) : (f).off + (r) * (f).st + ((c) >> 3)] \
                    [((f).col ? (r) & 7 : (c) & 7) >> 1])[((f).col ? (r) : (c)) & 1]
ACC emu_mma(FRAG a, FRAG b, ACC c) {
  int lane = SG_LANE;
  for (int t = 0; t < 8; t++) {
    int e = lane + 32 * t, r = e >> 4, cc = e & 15;
    float x = c.v[t];
    for (int k = 0; k < 16; k++) x += EMU_AT(As, a, r, k) * EMU_AT(Bs, b, k, cc);
    c.v[t] = x;
  }
  return c;
}
#define MMA(a, b, c) emu_mma(a, b, c)
void emu_store_scratch(ACC c, int off) {
  for (int t = 0; t < 8; t++) {
    int e = SG_LANE + 32 * t, r = e >> 4, cc = e & 15;
    Bs[off + r * 4 + (cc >> 2)][cc & 3] = floatBitsToUint(c.v[t]);
  }
}
#define STORE_SCRATCH(c, off) emu_store_scratch(c, off)
#define STORE_F16(c, alpha, off, st)                                                        \
  for (int t_ = 0; t_ < 8; t_++) {                                                          \
    int e_ = SG_LANE + 32 * t_;                                                            \
    BF16(P.addr[0]).v[(off) * 8 + (e_ >> 4) * (st) * 8 + (e_ & 15)] = float16_t((c).v[t_] * (alpha)); \
  }
#define SG_SYNC()
#endif

void main() {
  Params P = pc.P;
  int M = P.ex[0], N = P.ex[1], K = P.ex[2];
  int ars = P.ex[3], acs = P.ex[4], brs = P.ex[5], bcs = P.ex[6], crs = P.ex[7], ccs = P.ex[8];
  int flags = P.ex[12];
  int o[KV_MAXV];
  kv_offsets(int(gl_WorkGroupID.z), o);
  // the operands' addresses in registers: the parameter block is memory, and a load of it
  // in the loop would sit in front of every global load of the operands
  BV8H gA = BV8H(P.addr[1]), gB = BV8H(P.addr[2]);
  int tid = int(gl_LocalInvocationID.x);
  int sg = SG_ID, wm = sg / WN, wn = sg % WN;
  int m0 = int(gl_WorkGroupID.y) * BM, n0 = int(gl_WorkGroupID.x) * BN;

  // What each invocation stages, the same every step but for k: its vectors' index at
  // k = 0 (in 16-byte units; 0 for a line outside the matrix, never read), whether the
  // line is inside, the vector's k within the step, and where it goes in shared memory.
  // Step s reads index + s * step while k0 + kq < K.
  int ga[QA], ka[QA], sa[QA], gb[QB], kb[QB], sb[QB];
  bool la[QA], lb[QB];
  [[unroll]] for (int q = 0; q < QA; q++) {
    int v = tid + NT * q;
    if (A_KC) { // BM rows of m, BK / 8 vectors of k each
      int m = m0 + v / (BK / 8);
      ka[q] = (v % (BK / 8)) * 8;
      la[q] = m < M;
      ga[q] = la[q] ? (o[1] + m * ars + ka[q]) >> 3 : 0;
      sa[q] = (v / (BK / 8)) * SK + v % (BK / 8);
    } else { // BK rows of k, BM / 8 vectors of m each
      int m = m0 + (v % (BM / 8)) * 8;
      ka[q] = v / (BM / 8);
      la[q] = m < M;
      ga[q] = la[q] ? (o[1] + ka[q] * acs + m) >> 3 : 0;
      sa[q] = (v / (BM / 8)) * SMA + v % (BM / 8);
    }
  }
  [[unroll]] for (int q = 0; q < QB; q++) {
    int v = tid + NT * q;
    if (B_NC) { // BK rows of k, BN / 8 vectors of n each
      int n = n0 + (v % (BN / 8)) * 8;
      kb[q] = v / (BN / 8);
      lb[q] = n < N;
      gb[q] = lb[q] ? (o[2] + kb[q] * brs + n) >> 3 : 0;
      sb[q] = (v / (BN / 8)) * SMB + v % (BN / 8);
    } else { // BN rows of n, BK / 8 vectors of k each
      int n = n0 + v / (BK / 8);
      kb[q] = (v % (BK / 8)) * 8;
      lb[q] = n < N;
      gb[q] = lb[q] ? (o[2] + n * bcs + kb[q]) >> 3 : 0;
      sb[q] = (v / (BK / 8)) * SK + v % (BK / 8);
    }
  }
  int stepa = A_KC ? BK / 8 : BK * (acs >> 3), stepb = B_NC ? BK * (brs >> 3) : BK / 8;

  ACC acc[FM][FN];
  [[unroll]] for (int i = 0; i < FM; i++)
    [[unroll]] for (int j = 0; j < FN; j++) acc[i][j] = ACC_ZERO;

  uvec4 ra[QA], rb[QB];
  int nsteps = (K + BK - 1) / BK;

#define LOAD_STEP(s)                                                                         \
  {                                                                                          \
    int k0_ = (s) * BK;                                                                      \
    [[unroll]] for (int q = 0; q < QA; q++)                                                  \
      ra[q] = la[q] && k0_ + ka[q] < K ? gA.v[ga[q] + (s) * stepa] : uvec4(0u);              \
    [[unroll]] for (int q = 0; q < QB; q++)                                                  \
      rb[q] = lb[q] && k0_ + kb[q] < K ? gB.v[gb[q] + (s) * stepb] : uvec4(0u);              \
  }
#define STORE_STEP(buf)                                                                      \
  {                                                                                          \
    [[unroll]] for (int q = 0; q < QA; q++) As[(buf) * TSA + sa[q]] = ra[q];                 \
    [[unroll]] for (int q = 0; q < QB; q++) Bs[(buf) * TSB + sb[q]] = rb[q];                 \
  }

  LOAD_STEP(0)
  STORE_STEP(0)
  barrier();
  for (int s = 0; s < nsteps; s++) {
    bool more = s + 1 < nsteps;
    if (more) LOAD_STEP(s + 1)
    int pa = STAGES == 2 ? (s & 1) * TSA : 0, pb = STAGES == 2 ? (s & 1) * TSB : 0;
    [[unroll]] for (int kk = 0; kk < BK / 16; kk++) {
      FRAG a[FM], b[FN];
      int k = kk * 16;
      [[unroll]] for (int i = 0; i < FM; i++) {
        int m = (wm * FM + i) * 16;
        if (A_KC) LOAD_A(a[i], pa + m * SK + k / 8, SK, false);
        else LOAD_A(a[i], pa + k * SMA + m / 8, SMA, true);
      }
      [[unroll]] for (int j = 0; j < FN; j++) {
        int n = (wn * FN + j) * 16;
        if (B_NC) LOAD_B(b[j], pb + k * SMB + n / 8, SMB, false);
        else LOAD_B(b[j], pb + n * SK + k / 8, SK, true);
      }
      [[unroll]] for (int i = 0; i < FM; i++)
        [[unroll]] for (int j = 0; j < FN; j++) acc[i][j] = MMA(a[i], b[j], acc[i][j]);
    }
    if (STAGES == 2) {
      // buffer (s + 1) & 1 was last read in step s - 1, which every subgroup finished
      // before the barrier that ended it
      if (more) STORE_STEP((s + 1) & 1)
      barrier();
    } else {
      barrier(); // every subgroup is done with the buffer
      if (more) {
        STORE_STEP(0)
        barrier();
      }
    }
  }

  // Epilogue. Whole fragments of a plain f16 C (LAY bit 2) go straight to memory;
  // the rest through the subgroup's 1 KiB of Bs (64 vectors, 4 to a row), each of its 32
  // invocations finishing 8 elements.
  float alpha = P.s[0], beta = P.s[1];
  int lane = SG_LANE, scr = sg * 64;
  int z = int(gl_WorkGroupID.z), sa0 = z * M, sb0 = P.ex[14] * M + z * N;
  [[unroll]] for (int i = 0; i < FM; i++)
    [[unroll]] for (int j = 0; j < FN; j++) {
      int mf = m0 + (wm * FM + i) * 16, nf = n0 + (wn * FN + j) * 16;
      if (C_DIRECT && mf + 16 <= M && nf + 16 <= N) {
        STORE_F16(acc[i][j], alpha, (o[0] + mf * crs + nf) >> 3, crs >> 3);
        continue;
      }
      STORE_SCRATCH(acc[i][j], scr);
      SG_SYNC();
      [[unroll]] for (int t = 0; t < 8; t++) {
        int e = lane + 32 * t, r = e >> 4, c = e & 15;
        int m = mf + r, n = nf + c;
        if (m < M && n < N) {
          float x = alpha * uintBitsToFloat(Bs[scr + r * 4 + (c >> 2)][c & 3]);
          if ((flags & 16) != 0) // powers of two: exact
            x = x / mm_line_scale(BU32(P.addr[4]).v[sa0 + m]) / mm_line_scale(BU32(P.addr[4]).v[sb0 + n]);
          int co = o[0] + m * crs + n * ccs;
          if ((flags & 8) != 0) x += beta * kv_ld(0, co);
          if ((flags & 4) != 0) x += kv_ld(3, o[3] + n * P.ex[9]);
          if ((flags & 1) != 0) x = x > 0.0 ? x : (isnan(x) ? x : 0.0);
          kv_st(0, co, x);
        }
      }
#ifndef KV_CM_EMU
      subgroupBarrier();
#endif
    }
}
