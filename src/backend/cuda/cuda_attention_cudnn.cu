/*
** ATTENTION and ATTENTION_BACKWARD through cuDNN's fused attention (flash attention), built
** with the backend (graph) API from the operations cudnn-frontend's CompositeSDPANode,
** CompositeSoftmaxNode and CompositeSDPABackwardNode lower to
** (include/cudnn_frontend/node/scaled_dot_product_flash_attention.h, softmax.h,
** diagonal_band_mask.h), which cuDNN's fusion engines recognise as one kernel each way:
**
**   S = Q K^T (f32)  ->  S * scale  ->  causal: select(row >= col, S, -inf)
**     -> M = rowmax(S), E = exp(S - M), L = rowsum(E), Stats = M + log L  (f32, saved)
**     -> P = E / L (the input dtype)  ->  O = P V
**
** and the backward of build_bwd below. Stats is the log-sum-exp in natural log per query
** row, the contract of kiln's kernels (backend.h), so either pass pairs with the other's
** own kernel. The default for what it serves (f16/bf16, no mask, no dropout, head dim a
** multiple of 8 up to 128, last dims contiguous, rows 16-byte aligned): measured on the H200
** at GPT-2's B16 T1024 H12 D64 causal, 118 us forward and 362 us backward a layer against
** cuda_flash.cu's 179 and 553 (417,538 against 379,006 tokens/s for the step).
** KILN_ATTENTION=own sends everything to the own kernels (the A/B), cudnn-fwd / cudnn-bwd
** one pass. One execution plan per shape (dtype, B, H, Tq, Tk, D, the layouts, causal,
** pointer alignment), built on first use outside a graph capture and kept for the process,
** deterministic engines first (the backward then writes dq straight; KILN_CUDNN_SDPA_ATOMIC=1
** takes the f32 atomic accumulator instead: no faster there). A shape cuDNN has no engine
** for is remembered as such and left to the own kernels; with KILN_CUDNN_LOG set, a line
** on stderr says which engine each shape got (or why none). Built only with cuDNN
** (KILN_HAVE_CUDNN); the handle is this file's own, on kiln's stream.
*/
#include "cuda_int.cuh"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" bool kiln__cuda_attention_cudnn_fits(const kiln__kargs *a);
extern "C" kiln_status kiln__cuda_attention_cudnn(const kiln__kargs *a);
extern "C" int64_t kiln__cuda_attention_cudnn_runs(void);

/* KILN_ATTENTION=cudnn picks cuDNN's fused attention where it serves; own (or unset): the
** kernels of cuda_flash.cu and cuda_attention.cu. */
/* Which passes run on cuDNN: bit 1 the forward, bit 2 the backward. Both unless
** KILN_ATTENTION says otherwise: own (neither: cuda_flash.cu and cuda_attention.cu, the A/B),
** cudnn-fwd or cudnn-bwd (one; the lse contract lets either pair with the own other). */
static int cudnn_wanted(void) { /* read at each call, so that a test can switch it */
  return kiln__knob_choice("KILN_ATTENTION", 3); /* own, cudnn-fwd, cudnn-bwd, cudnn */
}

/* Calls cuDNN ran (forward and backward), for the tests: a shape cuDNN has no engine for
** runs on the own kernels, and only this count tells. */
static int64_t g_runs;
extern "C" int64_t kiln__cuda_attention_cudnn_runs(void) { return __atomic_load_n(&g_runs, __ATOMIC_RELAXED); }

#ifndef KILN_HAVE_CUDNN

extern "C" bool kiln__cuda_attention_cudnn_fits(const kiln__kargs *a) {
  (void)a;
  (void)cudnn_wanted;
  (void)g_runs;
  return false;
}
extern "C" kiln_status kiln__cuda_attention_cudnn(const kiln__kargs *a) {
  (void)a;
  return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln_scaled_dot_product_attention: kiln was built without cuDNN");
}

#else

#include <cudnn.h>

#include "cuda_cudnn_graph.cuh"

#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

std::mutex g_mu; /* handles and the cache */
cudnnHandle_t g_handle[KC_MAX_DEV];

kiln_status dnn_err(cudnnStatus_t s, const char *what) {
  if (s == CUDNN_STATUS_SUCCESS) return KILN_OK;
  kiln_status code = s == CUDNN_STATUS_NOT_SUPPORTED ? KILN_ERR_UNSUPPORTED
                     : s == CUDNN_STATUS_ALLOC_FAILED ? KILN_ERR_OOM
                     : s == CUDNN_STATUS_BAD_PARAM ? KILN_ERR_INVALID_ARGUMENT
                                                   : KILN_ERR_INTERNAL;
  (void)cudaGetLastError();
  return kiln_set_error(code, "kiln_scaled_dot_product_attention: cuDNN error in %s: %s", what,
                        cudnnGetErrorString(s));
}

/* A plan, and whether its backward takes dq through the zeroed f32 buffer (ws_extra). */
struct Plan : CudnnPlan {
  bool dq_accum = false;
};

/* uids of the operands the variant pack names (virtual tensors count on from kUidVirt) */
enum : int64_t {
  kUidQ = 1, kUidK, kUidV, kUidO, kUidStats, kUidScale, kUidNegInf,
  kUidDO, kUidDQ, kUidDK, kUidDV, kUidOne, kUidSoftmaxSum, kUidDQAccum, /* backward */
  kUidVirt = 100
};

/* Builds the graph's operations in order; virtual tensors get fresh uids. */
struct Builder {
  Plan *p;
  std::vector<cudnnBackendDescriptor_t> ops;
  int64_t next_uid = kUidVirt;

  cudnnStatus_t virt(cudnnDataType_t dt, const int64_t dims[4], const int64_t st[4], cudnnBackendDescriptor_t *out) {
    return cudnn_tensor(p, next_uid++, dt, dims, st, true, false, 16, out);
  }
  /* y = mode(x[, b[, t]]) computed in comp */
  cudnnStatus_t pw(cudnnPointwiseMode_t mode, cudnnDataType_t comp, cudnnBackendDescriptor_t x,
                   cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                   int64_t axis = -1) {
    cudnnBackendDescriptor_t d, op;
    KB_TRY(p->make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR, &d));
    KB_TRY(cudnnBackendSetAttribute(d, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode));
    KB_TRY(cudnnBackendSetAttribute(d, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &comp));
    if (mode == CUDNN_POINTWISE_GEN_INDEX)
      KB_TRY(cudnnBackendSetAttribute(d, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis));
    KB_TRY(cudnnBackendFinalize(d));
    KB_TRY(p->make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, &op));
    KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                    1, &d));
    KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x));
    if (b) KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b));
    if (t) KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t));
    KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y));
    float one = 1.0f;
    KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one));
    KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one));
    KB_TRY(cudnnBackendFinalize(op));
    ops.push_back(op);
    return CUDNN_STATUS_SUCCESS;
  }
  /* y = reduce(x) over the dims where y has size 1, in f32 */
  cudnnStatus_t red(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t d, op;
    cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    KB_TRY(p->make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR, &d));
    KB_TRY(cudnnBackendSetAttribute(d, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode));
    KB_TRY(cudnnBackendSetAttribute(d, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp));
    KB_TRY(cudnnBackendFinalize(d));
    KB_TRY(p->make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, &op));
    KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x));
    KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y));
    KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &d));
    KB_TRY(cudnnBackendFinalize(op));
    ops.push_back(op);
    return CUDNN_STATUS_SUCCESS;
  }
  /* y = x in y's layout and dtype (a transpose when y's strides swap x's last two) */
  cudnnStatus_t reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t op;
    KB_TRY(p->make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, &op));
    KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x));
    KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y));
    KB_TRY(cudnnBackendFinalize(op));
    ops.push_back(op);
    return CUDNN_STATUS_SUCCESS;
  }
  /* c = a b (batched over the leading dims), f32 accumulation */
  cudnnStatus_t mm(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    cudnnBackendDescriptor_t d, op;
    cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    KB_TRY(p->make(CUDNN_BACKEND_MATMUL_DESCRIPTOR, &d));
    KB_TRY(cudnnBackendSetAttribute(d, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp));
    KB_TRY(cudnnBackendFinalize(d));
    KB_TRY(p->make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, &op));
    KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a));
    KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b));
    KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c));
    KB_TRY(cudnnBackendSetAttribute(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &d));
    KB_TRY(cudnnBackendFinalize(op));
    ops.push_back(op);
    return CUDNN_STATUS_SUCCESS;
  }
};

/* The largest power of two up to 16 dividing every operand's address: a plan is made for
** an alignment, and a view at another must not reuse it. */
int64_t alignment(const kiln__kargs *a) {
  uintptr_t bits = 16;
  for (int i = 0; i < a->n_in; i++) bits |= (uintptr_t)a->in[i].data;
  for (int i = 0; i < a->n_out; i++) bits |= (uintptr_t)a->out[i].data;
  if (a->op == KILN__K_ATTENTION_BACKWARD) bits |= (uintptr_t)((const kiln__view *)a->params)->data;
  return (int64_t)(bits & (~bits + 1));
}

void dims4(const kiln__view *v, int64_t d[4], int64_t s[4]) {
  for (int x = 0; x < 4; x++) d[x] = v->shape[x], s[x] = v->strides[x];
}

/* The graph of ops and its plan: the engines of the heuristics' lists (mode A, then the
** fallback list) in order, deterministic ones first when want_det. */
cudnnStatus_t choose_plan(cudnnHandle_t h, Plan *p, std::vector<cudnnBackendDescriptor_t> &ops, bool want_det) {
  static const cudnnBackendHeurMode_t modes[2] = {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK};
  CudnnPlanRule rule = {modes, 2, 8, (int64_t)1 << 32, want_det, NULL, NULL};
  return cudnn_choose_plan(h, p, ops.data(), (int)ops.size(), rule);
}

/* The forward graph of a's shapes and its plan. */
cudnnStatus_t build_fwd(const kiln__kargs *a, cudnnHandle_t h, Plan *p) {
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2], *o = &a->out[0], *lse = &a->out[1];
  const cudnnDataType_t dt = q->dtype == KILN_F16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
  const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
  const int64_t B = q->shape[0], H = q->shape[1], Tq = q->shape[2], Tk = k->shape[2];
  const int64_t al = alignment(a);
  int64_t d[4], s[4];
  cudnnBackendDescriptor_t tq, tkt, tv, to, tst, tscale, tninf;
  dims4(q, d, s);
  KB_TRY(cudnn_tensor(p, kUidQ, dt, d, s, false, false, al, &tq));
  /* K^T: (B, H, D, Tk), K's strides with the last two swapped */
  {
    int64_t kd[4] = {k->shape[0], k->shape[1], k->shape[3], k->shape[2]};
    int64_t ks[4] = {k->strides[0], k->strides[1], k->strides[3], k->strides[2]};
    KB_TRY(cudnn_tensor(p, kUidK, dt, kd, ks, false, false, al, &tkt));
  }
  dims4(v, d, s);
  KB_TRY(cudnn_tensor(p, kUidV, dt, d, s, false, false, al, &tv));
  dims4(o, d, s);
  KB_TRY(cudnn_tensor(p, kUidO, dt, d, s, false, false, al, &to));
  {
    int64_t sd[4] = {B, H, Tq, 1}, ss[4] = {lse->strides[0], lse->strides[1], lse->strides[2], 1};
    KB_TRY(cudnn_tensor(p, kUidStats, f32, sd, ss, false, false, al, &tst));
  }
  const int64_t one4[4] = {1, 1, 1, 1};
  KB_TRY(cudnn_tensor(p, kUidScale, f32, one4, one4, false, true, 16, &tscale));
  KB_TRY(cudnn_tensor(p, kUidNegInf, f32, one4, one4, false, true, 16, &tninf));

  Builder b{p, {}, kUidVirt};
  const int64_t sdim[4] = {B, H, Tq, Tk}, sst[4] = {H * Tq * Tk, Tq * Tk, Tk, 1};
  const int64_t rdim[4] = {B, H, Tq, 1}, rst[4] = {H * Tq, Tq, 1, 1};
  cudnnBackendDescriptor_t S, S1, Sm, M, Z, E, L, LL, P;
  KB_TRY(b.virt(f32, sdim, sst, &S));
  KB_TRY(b.mm(tq, tkt, S)); /* S = Q K^T */
  KB_TRY(b.virt(f32, sdim, sst, &S1));
  KB_TRY(b.pw(CUDNN_POINTWISE_MUL, f32, S, tscale, NULL, S1)); /* * scale */
  Sm = S1;
  if (a->i[0] & 1) { /* causal, top-left: keep key j <= query i (row >= col) */
    cudnnBackendDescriptor_t row, col, keep;
    KB_TRY(b.virt(CUDNN_DATA_INT32, sdim, sst, &row));
    KB_TRY(b.pw(CUDNN_POINTWISE_GEN_INDEX, f32, S1, NULL, NULL, row, 2));
    KB_TRY(b.virt(CUDNN_DATA_INT32, sdim, sst, &col));
    KB_TRY(b.pw(CUDNN_POINTWISE_GEN_INDEX, f32, S1, NULL, NULL, col, 3));
    KB_TRY(b.virt(CUDNN_DATA_BOOLEAN, sdim, sst, &keep));
    KB_TRY(b.pw(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, NULL, keep));
    KB_TRY(b.virt(f32, sdim, sst, &Sm));
    KB_TRY(b.pw(CUDNN_POINTWISE_BINARY_SELECT, f32, S1, tninf, keep, Sm));
  }
  KB_TRY(b.virt(f32, rdim, rst, &M));
  KB_TRY(b.red(CUDNN_REDUCE_TENSOR_MAX, Sm, M));
  KB_TRY(b.virt(f32, sdim, sst, &Z));
  KB_TRY(b.pw(CUDNN_POINTWISE_SUB, f32, Sm, M, NULL, Z));
  KB_TRY(b.virt(f32, sdim, sst, &E));
  KB_TRY(b.pw(CUDNN_POINTWISE_EXP, f32, Z, NULL, NULL, E));
  KB_TRY(b.virt(f32, rdim, rst, &L));
  KB_TRY(b.red(CUDNN_REDUCE_TENSOR_ADD, E, L));
  KB_TRY(b.virt(f32, rdim, rst, &LL));
  KB_TRY(b.pw(CUDNN_POINTWISE_LOG, f32, L, NULL, NULL, LL));
  KB_TRY(b.pw(CUDNN_POINTWISE_ADD, f32, M, LL, NULL, tst)); /* Stats = M + log L */
  KB_TRY(b.virt(dt, sdim, sst, &P));
  KB_TRY(b.pw(CUDNN_POINTWISE_DIV, f32, E, L, NULL, P));
  KB_TRY(b.mm(P, tv, to)); /* O = P V */

  return choose_plan(h, p, b.ops, true);
}

/* The backward graph (cudnn-frontend's CompositeSDPABackwardNode without dropout or bias;
** with accum, cuDNN 9's default: dq accumulated with atomics in an f32 buffer, then
** converted; without, dq written straight, the deterministic variant):
**   softmax_sum = rowsum(dO * O)                                (f32 buffer, ours)
**   E = exp(mask(Q K^T * scale) - Stats)                        (= P)
**   dV = E^T dO;  dS = (dO V^T - softmax_sum) * E * scale
**   dK = dS^T Q;  dQ = dS K  (accum: dQ_accum = dS K, f32, zeroed; dQ = identity(dQ_accum))
** The two buffers ride at the end of the workspace. */
cudnnStatus_t build_bwd(const kiln__kargs *a, cudnnHandle_t h, Plan *p, bool accum) {
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2], *go = &a->in[3];
  const kiln__view *dq = &a->out[0], *dk = &a->out[1], *dv = &a->out[2], *lse = &a->out[3];
  const kiln__view *o = (const kiln__view *)a->params;
  const cudnnDataType_t dt = q->dtype == KILN_F16 ? CUDNN_DATA_HALF : CUDNN_DATA_BFLOAT16;
  const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
  const int64_t B = q->shape[0], H = q->shape[1], Tq = q->shape[2], Tk = k->shape[2], D = q->shape[3];
  const int64_t Dv = v->shape[3];
  const int64_t al = alignment(a);
  int64_t d[4], s[4];
  cudnnBackendDescriptor_t tq, tkt, tvt, to, tdo, tst, tdq, tdk, tdv, tscale, tone, tninf, tsum, tacc = NULL;
  dims4(q, d, s);
  KB_TRY(cudnn_tensor(p, kUidQ, dt, d, s, false, false, al, &tq));
  { /* K^T and V^T: (B, H, D, Tk), the last two strides swapped */
    int64_t kd[4] = {B, H, D, Tk}, ks[4] = {k->strides[0], k->strides[1], k->strides[3], k->strides[2]};
    KB_TRY(cudnn_tensor(p, kUidK, dt, kd, ks, false, false, al, &tkt));
    int64_t vd[4] = {B, H, Dv, Tk}, vs[4] = {v->strides[0], v->strides[1], v->strides[3], v->strides[2]};
    KB_TRY(cudnn_tensor(p, kUidV, dt, vd, vs, false, false, al, &tvt));
  }
  dims4(o, d, s);
  KB_TRY(cudnn_tensor(p, kUidO, dt, d, s, false, false, al, &to));
  dims4(go, d, s);
  KB_TRY(cudnn_tensor(p, kUidDO, dt, d, s, false, false, al, &tdo));
  {
    int64_t sd[4] = {B, H, Tq, 1}, ss[4] = {lse->strides[0], lse->strides[1], lse->strides[2], 1};
    KB_TRY(cudnn_tensor(p, kUidStats, f32, sd, ss, false, false, al, &tst));
  }
  dims4(dq, d, s);
  KB_TRY(cudnn_tensor(p, kUidDQ, dt, d, s, false, false, al, &tdq));
  dims4(dk, d, s);
  KB_TRY(cudnn_tensor(p, kUidDK, dt, d, s, false, false, al, &tdk));
  dims4(dv, d, s);
  KB_TRY(cudnn_tensor(p, kUidDV, dt, d, s, false, false, al, &tdv));
  const int64_t one4[4] = {1, 1, 1, 1};
  KB_TRY(cudnn_tensor(p, kUidScale, f32, one4, one4, false, true, 16, &tscale));
  KB_TRY(cudnn_tensor(p, kUidOne, f32, one4, one4, false, true, 16, &tone));
  KB_TRY(cudnn_tensor(p, kUidNegInf, f32, one4, one4, false, true, 16, &tninf));
  const int64_t rdim[4] = {B, H, Tq, 1}, rst[4] = {H * Tq, Tq, 1, 1};
  KB_TRY(cudnn_tensor(p, kUidSoftmaxSum, f32, rdim, rst, false, false, 16, &tsum));
  const int64_t qdim[4] = {B, H, Tq, D}, qst[4] = {H * Tq * D, Tq * D, D, 1};
  if (accum) KB_TRY(cudnn_tensor(p, kUidDQAccum, f32, qdim, qst, false, false, 16, &tacc));

  Builder b{p, {}, kUidVirt};
  const int64_t sdim[4] = {B, H, Tq, Tk}, sst[4] = {H * Tq * Tk, Tq * Tk, Tk, 1};
  const int64_t tdim[4] = {B, H, Tk, Tq}, tst_[4] = {H * Tq * Tk, Tq * Tk, 1, Tk}; /* S^T over S's memory */
  const int64_t odim[4] = {B, H, Tq, Dv}, ost[4] = {H * Tq * Dv, Tq * Dv, Dv, 1};
  /* softmax_sum = rowsum(dO * O) * 1 */
  cudnnBackendDescriptor_t t1, t2;
  KB_TRY(b.virt(f32, odim, ost, &t1));
  KB_TRY(b.pw(CUDNN_POINTWISE_MUL, f32, tdo, to, NULL, t1));
  KB_TRY(b.virt(f32, rdim, rst, &t2));
  KB_TRY(b.red(CUDNN_REDUCE_TENSOR_ADD, t1, t2));
  KB_TRY(b.pw(CUDNN_POINTWISE_MUL, f32, t2, tone, NULL, tsum));
  /* E = exp(mask(Q K^T * scale) - Stats) */
  cudnnBackendDescriptor_t S, S1, Sm, Z, E;
  KB_TRY(b.virt(f32, sdim, sst, &S));
  KB_TRY(b.mm(tq, tkt, S));
  KB_TRY(b.virt(f32, sdim, sst, &S1));
  KB_TRY(b.pw(CUDNN_POINTWISE_MUL, f32, S, tscale, NULL, S1));
  Sm = S1;
  if (a->i[0] & 1) {
    cudnnBackendDescriptor_t row, col, keep;
    KB_TRY(b.virt(CUDNN_DATA_INT32, sdim, sst, &row));
    KB_TRY(b.pw(CUDNN_POINTWISE_GEN_INDEX, f32, S1, NULL, NULL, row, 2));
    KB_TRY(b.virt(CUDNN_DATA_INT32, sdim, sst, &col));
    KB_TRY(b.pw(CUDNN_POINTWISE_GEN_INDEX, f32, S1, NULL, NULL, col, 3));
    KB_TRY(b.virt(CUDNN_DATA_BOOLEAN, sdim, sst, &keep));
    KB_TRY(b.pw(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, NULL, keep));
    KB_TRY(b.virt(f32, sdim, sst, &Sm));
    KB_TRY(b.pw(CUDNN_POINTWISE_BINARY_SELECT, f32, S1, tninf, keep, Sm));
  }
  KB_TRY(b.virt(f32, sdim, sst, &Z));
  KB_TRY(b.pw(CUDNN_POINTWISE_SUB, f32, Sm, tst, NULL, Z));
  KB_TRY(b.virt(f32, sdim, sst, &E));
  KB_TRY(b.pw(CUDNN_POINTWISE_EXP, f32, Z, NULL, NULL, E));
  /* dV = E^T dO */
  cudnnBackendDescriptor_t ET;
  KB_TRY(b.virt(dt, tdim, tst_, &ET));
  KB_TRY(b.reshape(E, ET));
  KB_TRY(b.mm(ET, tdo, tdv));
  /* dS = (dO V^T - softmax_sum) * E * scale */
  cudnnBackendDescriptor_t dP, t3, t4, dS;
  KB_TRY(b.virt(f32, sdim, sst, &dP));
  KB_TRY(b.mm(tdo, tvt, dP));
  KB_TRY(b.virt(f32, sdim, sst, &t3));
  KB_TRY(b.pw(CUDNN_POINTWISE_SUB, f32, dP, tsum, NULL, t3));
  KB_TRY(b.virt(f32, sdim, sst, &t4));
  KB_TRY(b.pw(CUDNN_POINTWISE_MUL, f32, t3, E, NULL, t4));
  KB_TRY(b.virt(f32, sdim, sst, &dS));
  KB_TRY(b.pw(CUDNN_POINTWISE_MUL, f32, t4, tscale, NULL, dS));
  /* dK = dS^T Q */
  cudnnBackendDescriptor_t dST;
  KB_TRY(b.virt(dt, tdim, tst_, &dST));
  KB_TRY(b.reshape(dS, dST));
  KB_TRY(b.mm(dST, tq, tdk));
  /* dQ = dS K, through the f32 accumulator: K from K^T by a reshape to K's own layout */
  cudnnBackendDescriptor_t tk;
  {
    int64_t kd[4] = {B, H, Tk, D}, ks[4] = {k->strides[0], k->strides[1], k->strides[2], k->strides[3]};
    KB_TRY(b.virt(dt, kd, ks, &tk));
  }
  KB_TRY(b.reshape(tkt, tk));
  if (accum) { /* atomics into f32, then one conversion: cuDNN 9's default */
    KB_TRY(b.mm(dS, tk, tacc));
    KB_TRY(b.pw(CUDNN_POINTWISE_IDENTITY, f32, tacc, NULL, NULL, tdq));
  } else { /* straight into dq: the dP-workspace engines, deterministic (the frontend's
           ** is_deterministic_algorithm on Hopper) */
    KB_TRY(b.mm(dS, tk, tdq));
  }
  p->dq_accum = accum;
  return choose_plan(h, p, b.ops, !accum);
}

/* Bytes past the plan's workspace for the backward's softmax_sum (B*H*Tq f32) and dq
** accumulator (B*H*Tq*D f32), each 256-byte aligned. */
size_t sum_bytes(const kiln__kargs *a) {
  return ((size_t)(a->in[0].shape[0] * a->in[0].shape[1] * a->in[0].shape[2]) * 4 + 255) & ~(size_t)255;
}
size_t acc_bytes(const kiln__kargs *a) {
  return ((size_t)(a->in[0].shape[0] * a->in[0].shape[1] * a->in[0].shape[2] * a->in[0].shape[3]) * 4 + 255) &
         ~(size_t)255;
}

/* KILN_CUDNN_SDPA_ATOMIC=1: the backward's dq through atomics (faster where cuDNN's
** deterministic engines are not; the bits may differ from run to run). */
bool dq_atomic() {
  return kiln__knob_on("KILN_CUDNN_SDPA_ATOMIC", false);
}

std::string cache_key(const kiln__kargs *a) {
  std::string key;
  key.reserve(256);
  auto put = [&key](int64_t x) { key.append((const char *)&x, sizeof x); };
  put(a->op), put(a->device), put(a->in[0].dtype), put(a->i[0] & 1), put(alignment(a)), put(dq_atomic());
  auto view = [&put](const kiln__view *v) {
    put(v->ndim);
    for (int x = 0; x < v->ndim; x++) put(v->shape[x]), put(v->strides[x]);
  };
  for (int i = 0; i < a->n_in; i++) view(&a->in[i]);
  for (int i = 0; i < a->n_out; i++) view(&a->out[i]);
  if (a->op == KILN__K_ATTENTION_BACKWARD) view((const kiln__view *)a->params);
  return key;
}

/* The cache: a plan per shape, or NULL for a shape cuDNN has no engine for. Never dropped. */
std::unordered_map<std::string, std::unique_ptr<Plan>> g_cache;

kiln_status handle_of(int device, kiln__cuda_dev *d, cudnnHandle_t *out) {
  if (!g_handle[device]) {
    cudnnHandle_t h;
    kiln_status st = dnn_err(cudnnCreate(&h), "cudnnCreate");
    if (st != KILN_OK) return st;
    cudnnStatus_t s = cudnnSetStream(h, d->stream);
    if (s != CUDNN_STATUS_SUCCESS) {
      cudnnDestroy(h);
      return dnn_err(s, "cudnnSetStream");
    }
    g_handle[device] = h;
  }
  *out = g_handle[device];
  return KILN_OK;
}

const char *shape_str(const kiln__kargs *a, char *buf, size_t n) {
  const kiln__view *q = &a->in[0];
  snprintf(buf, n, "%s %s B%lld H%lld Tq%lld Tk%lld D%lld%s", a->op == KILN__K_ATTENTION ? "forward" : "backward",
           kiln_dtype_name(q->dtype), (long long)q->shape[0],
           (long long)q->shape[1], (long long)q->shape[2], (long long)a->in[1].shape[2], (long long)q->shape[3],
           (a->i[0] & 1) ? " causal" : "");
  return buf;
}

/* a view the fused kernels read or write: 4-d, contiguous last dim, rows 16-byte aligned */
bool rows_ok(const kiln__view *v) {
  if (v->ndim != 4 || v->strides[3] != 1) return false;
  for (int x = 0; x < 3; x++)
    if (v->shape[x] > 1 && v->strides[x] % 8 != 0) return false;
  return true;
}

} // namespace

extern "C" bool kiln__cuda_attention_cudnn_fits(const kiln__kargs *a) {
  const bool bw = a->op == KILN__K_ATTENTION_BACKWARD;
  if ((a->op != KILN__K_ATTENTION && !bw) || !(cudnn_wanted() & (bw ? 2 : 1))) return false;
  const kiln__view *q = &a->in[0], *k = &a->in[1], *v = &a->in[2];
  const kiln_dtype dt = q->dtype;
  if (dt != KILN_F16 && dt != KILN_BF16) return false;
  if ((a->i[0] & 2) || a->s[1] != 0 || a->n_in != (bw ? 4 : 3) || a->n_out != (bw ? 4 : 2)) return false;
  if (k->dtype != dt || v->dtype != dt) return false;
  const int64_t D = q->shape[3];
  if (D < 8 || D > 128 || D % 8 != 0 || k->shape[3] != D || v->shape[3] != D) return false;
  if (!rows_ok(q) || !rows_ok(k) || !rows_ok(v)) return false;
  if (q->shape[2] < 1 || k->shape[2] < 1) return false;
  const kiln__view *lse = &a->out[bw ? 3 : 1];
  if (lse->dtype != KILN_F32 || lse->ndim != 3) return false;
  for (int i = 0; i < (bw ? 3 : 1); i++)
    if (a->out[i].dtype != dt || !rows_ok(&a->out[i])) return false;
  if (bw) {
    const kiln__view *o = (const kiln__view *)a->params;
    if (a->in[3].dtype != dt || !rows_ok(&a->in[3]) || !o || o->dtype != dt || !rows_ok(o) ||
        o->shape[2] != q->shape[2] || o->shape[3] != D)
      return false;
  }
  return true;
}

/* KILN_ERR_UNSUPPORTED (and an error the caller clears) when cuDNN has no engine for the
** shape: cuda_attention.cu then runs its own kernels. */
extern "C" kiln_status kiln__cuda_attention_cudnn(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  Plan *plan = NULL;
  cudnnHandle_t h;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    std::string key = cache_key(a);
    auto it = g_cache.find(key);
    if (it == g_cache.end()) {
      char buf[128];
      if (d->capturing)
        return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln_scaled_dot_product_attention: no cuDNN plan for %s inside "
                              "a graph capture", shape_str(a, buf, sizeof buf));
      KC_TRY(handle_of(a->device, d, &h));
      std::unique_ptr<Plan> p(new Plan);
      cudnnStatus_t s = a->op == KILN__K_ATTENTION ? build_fwd(a, h, p.get()) : build_bwd(a, h, p.get(), dq_atomic());
      /* KILN_CUDNN_LOG (as the convolutions' choices): a line per shape, which engine or why none */
      bool say = kiln__knob_choice("KILN_CUDNN_LOG", 0) > 0;
      if (s != CUDNN_STATUS_SUCCESS) {
        char why[256] = "";
        cudnnGetLastErrorString(why, sizeof why);
        if (say) fprintf(stderr, "kiln cudnn attention: %s: no plan (%s: %.160s): the own kernels run it\n",
                shape_str(a, buf, sizeof buf), cudnnGetErrorString(s), why);
        p.reset();
      } else if (say) {
        fprintf(stderr, "kiln cudnn attention: %s: engine %lld%s, workspace %lld B\n", shape_str(a, buf, sizeof buf),
                (long long)p->engine, p->nondet ? " (nondeterministic)" : "", (long long)p->ws);
      }
      it = g_cache.emplace(key, std::move(p)).first;
    }
    plan = it->second.get();
    if (plan) KC_TRY(handle_of(a->device, d, &h));
  }
  if (!plan) return kiln_set_error(KILN_ERR_UNSUPPORTED, "kiln_scaled_dot_product_attention: no cuDNN plan");
  const bool bw = a->op == KILN__K_ATTENTION_BACKWARD;
  /* the plan's workspace (256-byte rounded), then the backward's two f32 buffers */
  const size_t base = ((size_t)plan->ws + 255) & ~(size_t)255;
  const bool acc = bw && plan->dq_accum;
  const size_t wbytes = base + (bw ? sum_bytes(a) : 0) + (acc ? acc_bytes(a) : 0);
  void *ws = NULL;
  if (wbytes) {
    ws = kiln__cuda_alloc(a->device, wbytes);
    if (!ws) return kiln_last_error();
    kiln_status st = kiln__cuda_capture_note(a->device, ws, wbytes);
    if (st == KILN_OK && acc) /* dq accumulates into its buffer */
      st = kiln__cuda_err(cudaMemsetAsync((char *)ws + base + sum_bytes(a), 0, acc_bytes(a), d->stream),
                          "attention_backward (cudnn dq accumulator)");
    if (st != KILN_OK) {
      kiln__cuda_free(a->device, ws, wbytes);
      return st;
    }
  }
  /* by-value scalars: the variant pack points at host memory for them */
  float scale = (float)a->s[0], ninf = -INFINITY, one = 1.0f;
  const bool causal = (a->i[0] & 1) != 0;
  void *ptrs[16];
  int64_t uids[16];
  int n = 0;
  auto put = [&](int64_t uid, void *ptr) { uids[n] = uid, ptrs[n] = ptr, n++; };
  put(kUidQ, a->in[0].data), put(kUidK, a->in[1].data), put(kUidV, a->in[2].data), put(kUidScale, &scale);
  if (causal) put(kUidNegInf, &ninf);
  if (!bw) {
    put(kUidO, a->out[0].data), put(kUidStats, a->out[1].data);
  } else {
    put(kUidDO, a->in[3].data), put(kUidO, ((const kiln__view *)a->params)->data), put(kUidStats, a->out[3].data);
    put(kUidDQ, a->out[0].data), put(kUidDK, a->out[1].data), put(kUidDV, a->out[2].data), put(kUidOne, &one);
    put(kUidSoftmaxSum, (char *)ws + base);
    if (acc) put(kUidDQAccum, (char *)ws + base + sum_bytes(a));
  }
  cudnnStatus_t s = cudnn_execute(h, plan->plan, n, uids, ptrs, ws);
  if (ws) kiln__cuda_free(a->device, ws, wbytes); /* stream-ordered reuse */
  if (s == CUDNN_STATUS_SUCCESS) __atomic_add_fetch(&g_runs, 1, __ATOMIC_RELAXED);
  return dnn_err(s, "cudnnBackendExecute");
}

#endif /* KILN_HAVE_CUDNN */
