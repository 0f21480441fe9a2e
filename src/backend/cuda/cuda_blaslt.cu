/*
** cuBLASLt plans (cuda_blaslt.cuh): the plan cache, the algorithm each plan runs
** (lt_tune) and the call. cuda_matmul.cu's MATMUL, LINEAR_GELU and MATMUL_DGELU take
** their epilogues and large 16-bit products through kc_lt_matmul.
*/
#include "cuda_blaslt.cuh"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const double kc_lt_tune_flops = 1073741824.0;

bool kc_blas_types_of(kiln_dtype dt, bool tf32, kc_blas_types *t) {
  t->f64 = false;
  switch (dt) {
  case KILN_F32:
    t->data = CUDA_R_32F;
    t->compute = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    return true;
  case KILN_F16: t->data = CUDA_R_16F; t->compute = CUBLAS_COMPUTE_32F; return true;
  case KILN_BF16: t->data = CUDA_R_16BF; t->compute = CUBLAS_COMPUTE_32F; return true;
  case KILN_F64:
    t->data = CUDA_R_64F;
    t->compute = CUBLAS_COMPUTE_64F;
    t->f64 = true;
    return true;
  default: return false;
  }
}

namespace {

/* cuBLASLt plans, cached by problem: making the descriptors and asking the heuristic costs
** tens of microseconds per call, more than a small GEMM takes on the device, so a training
** loop (the same few shapes every step) pays it once. The bias and aux pointers change per
** call and are set on the cached descriptor under the lock. */
struct LtPlan {
  bool used, ok;
  int device;
  cublasLtEpilogue_t epi; /* DEFAULT, BIAS, BGRADB, GELU(_AUX)(_BIAS) or DGELU: kc_lt_matmul says */
  cudaDataType_t data, cdata; /* A and B; C and D (f32 for a wide product) */
  cublasComputeType_t compute;
  cublasOperation_t opA, opB;
  int64_t M, N, K, lda, ldb, ldc;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, lc;
  cublasLtMatmulAlgo_t algo;       /* the one run: the heuristic's first until lt_tune picks */
  cublasLtMatmulAlgo_t cand[8];    /* the heuristic's candidates, best first */
  int ncand, tune_tries;
  bool tuned;
};
enum { LT_PLANS = 64 };
LtPlan lt_plans[LT_PLANS];
int lt_next;
pthread_mutex_t lt_lock = PTHREAD_MUTEX_INITIALIZER;

void lt_plan_destroy(LtPlan *p) {
  if (p->lc) cublasLtMatrixLayoutDestroy(p->lc);
  if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
  if (p->la) cublasLtMatrixLayoutDestroy(p->la);
  if (p->op) cublasLtMatmulDescDestroy(p->op);
  memset(p, 0, sizeof *p);
}

/* Whether an epilogue has the auxiliary matrix: LINEAR_GELU writes its pre-activation
** there, MATMUL_DGELU reads it. */
bool epi_has_aux(cublasLtEpilogue_t epi) {
  return epi == CUBLASLT_EPILOGUE_GELU_AUX || epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
         epi == CUBLASLT_EPILOGUE_DGELU;
}

/* Builds the plan in place; p->ok false when cuBLASLt has no algorithm for it. */
void lt_plan_make(kiln__cuda_dev *d, LtPlan *p) {
  cublasLtHandle_t lt = (cublasLtHandle_t)d->blaslt;
  cublasLtMatmulPreference_t pref = NULL;
  cublasLtEpilogue_t epi = p->epi;
  uint64_t ws = d->workspace_size;
  cublasLtMatmulHeuristicResult_t heur[8];
  int nres = 0;
  const void *nullbias = NULL;
  p->ok = false;
  if (cublasLtMatmulDescCreate(&p->op, p->compute, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) return;
  if (cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &p->opB, sizeof p->opB) ||
      cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &p->opA, sizeof p->opA) ||
      cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi) ||
      cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &nullbias, sizeof nullbias))
    return;
  if (epi_has_aux(epi)) { /* the pre-activation, laid out as C (the pointer is set per call) */
    int64_t ld = p->ldc;
    if (cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof ld) ||
        cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &nullbias, sizeof nullbias))
      return;
  }
  if (cublasLtMatrixLayoutCreate(&p->la, p->data, p->opB == CUBLAS_OP_N ? p->N : p->K,
                                 p->opB == CUBLAS_OP_N ? p->K : p->N, p->ldb) ||
      cublasLtMatrixLayoutCreate(&p->lb, p->data, p->opA == CUBLAS_OP_N ? p->K : p->M,
                                 p->opA == CUBLAS_OP_N ? p->M : p->K, p->lda) ||
      cublasLtMatrixLayoutCreate(&p->lc, p->cdata, p->N, p->M, p->ldc))
    return;
  if (cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                           sizeof ws) == CUBLAS_STATUS_SUCCESS &&
      cublasLtMatmulAlgoGetHeuristic(lt, p->op, p->la, p->lb, p->lc, p->lc, pref, 8, heur, &nres) ==
          CUBLAS_STATUS_SUCCESS &&
      nres > 0) {
    p->algo = heur[0].algo;
    for (int i = 0; i < nres && i < 8; i++) p->cand[p->ncand++] = heur[i].algo;
    p->ok = true;
  }
  if (pref) cublasLtMatmulPreferenceDestroy(pref);
}

/* ---- lt_tune: the plan's algorithm by timing, among those that give the same bits ----
** cuBLASLt's heuristic ranks its candidates by a model; on GPT-2's MLP products its first
** is not the fastest (bench/RESULTS.md). On a plan's first large call (2MNK >= 2^30, beta
** 0, not in a graph capture) every candidate runs on the call's operands, is timed (one
** warm run, then two), and its output (and GELU_AUX's pre-activation) is hashed: only a
** candidate whose bits equal the first's, with no split-K, may be picked. So which one
** wins the timing never changes a number (DESIGN.md: same seed, same numbers); the
** product's result is written again by the call itself. Inputs whose output is all zeros
** cannot tell algorithms apart: the plan then waits for another call (three at most).
** KILN_CUDA_LT_TUNE=0 keeps the heuristic's first (the same numbers: test_cuda_gptfuse
** checks); =2 also prints each plan's choice. */
__device__ unsigned long long lt_hash_acc[3]; /* the two outputs' hashes, nonzero elements */

__global__ void lt_hash(const char *x, int64_t rows, int64_t cols, int64_t ld, int es, int slot) {
  unsigned long long h = 0, nz = 0;
  const int64_t n = rows * cols;
  for (int64_t e = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; e < n; e += (int64_t)gridDim.x * blockDim.x) {
    const char *q = x + ((e / cols) * ld + e % cols) * es;
    uint32_t v = es == 2 ? (uint32_t)*(const uint16_t *)q : *(const uint32_t *)q;
    unsigned long long z = ((unsigned long long)e << 32 | v) + 0x9E3779B97F4A7C15ull; /* splitmix64 */
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    h += z ^ (z >> 31); /* a sum: the order the threads add in does not matter */
    nz += v != 0;
  }
  for (int o = 16; o > 0; o >>= 1) {
    h += __shfl_down_sync(0xffffffffu, h, o);
    nz += __shfl_down_sync(0xffffffffu, nz, o);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&lt_hash_acc[slot], h);
    atomicAdd(&lt_hash_acc[2], nz);
  }
}

int lt_tune_mode(void) { /* read at each plan's first calls (tests switch it) */
  return kiln__knob_choice("KILN_CUDA_LT_TUNE", 1); /* 0, 1, 2 */
}

bool lt_tune_wanted(const kiln__cuda_dev *d, const LtPlan *p, float beta) {
  return !p->tuned && p->ncand > 1 && p->tune_tries < 3 && !d->capturing && beta == 0.0f &&
         p->epi != CUBLASLT_EPILOGUE_BGRADB && 2.0 * p->M * p->N * p->K >= kc_lt_tune_flops && lt_tune_mode() != 0;
}

/* Hashes C (and aux when given) into lt_hash_acc: out[0], out[1], out[2] = nonzero count. */
bool lt_hash_outputs(kiln__cuda_dev *d, const LtPlan *p, const void *C, const void *aux, unsigned long long out[3]) {
  void *acc = NULL;
  if (cudaGetSymbolAddress(&acc, lt_hash_acc) != cudaSuccess ||
      cudaMemsetAsync(acc, 0, sizeof lt_hash_acc, d->stream) != cudaSuccess)
    return false;
  const int es = p->cdata == CUDA_R_32F ? 4 : 2;
  lt_hash<<<1056, 256, 0, d->stream>>>((const char *)C, p->M, p->N, p->ldc, es, 0);
  if (aux) lt_hash<<<1056, 256, 0, d->stream>>>((const char *)aux, p->M, p->N, p->ldc, es, 1);
  return cudaMemcpyAsync(out, acc, sizeof lt_hash_acc, cudaMemcpyDeviceToHost, d->stream) == cudaSuccess &&
         cudaStreamSynchronize(d->stream) == cudaSuccess;
}

/* Runs under lt_lock with the plan's bias and aux pointers set. Any CUDA or cuBLAS failure
** leaves the heuristic's first (and the plan tuned, so it is not tried again). */
void lt_tune(kiln__cuda_dev *d, LtPlan *p, const float *alpha, const void *B, const void *A, void *C,
             const void *aux_written) {
  cublasLtHandle_t lt = (cublasLtHandle_t)d->blaslt;
  const float beta = 0.0f;
  cudaEvent_t e0 = NULL, e1 = NULL;
  unsigned long long ref[3] = {0, 0, 0};
  float best = 0, first = 0;
  int pick = -1, same = 0;
  bool zero = false;
  p->tune_tries++;
  bool ok = cudaEventCreate(&e0) == cudaSuccess && cudaEventCreate(&e1) == cudaSuccess;
  for (int i = 0; ok && i < p->ncand; i++) {
    int splitk = 1;
    size_t sz = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&p->cand[i], CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &sz);
    if (i > 0 && splitk > 1) continue;
    bool ran = true;
    for (int r = 0; r < 3 && ran; r++) {
      if (r == 1) ran = cudaEventRecord(e0, d->stream) == cudaSuccess;
      ran = ran && cublasLtMatmul(lt, p->op, alpha, B, p->la, A, p->lb, &beta, C, p->lc, C, p->lc, &p->cand[i],
                                  d->workspace, d->workspace_size, d->stream) == CUBLAS_STATUS_SUCCESS;
    }
    ran = ran && cudaEventRecord(e1, d->stream) == cudaSuccess;
    unsigned long long h[3];
    float ms = 0;
    if (!ran || !lt_hash_outputs(d, p, C, aux_written, h) || cudaEventElapsedTime(&ms, e0, e1) != cudaSuccess) {
      if (i == 0) ok = false; /* the first must run: else nothing to compare with */
      continue;
    }
    if (i == 0) {
      memcpy(ref, h, sizeof ref);
      if (h[2] == 0) { /* an all-zero output: every algorithm agrees; wait for real data */
        zero = true;
        break;
      }
      best = first = ms, pick = 0, same = 1;
      continue;
    }
    if (h[0] != ref[0] || h[1] != ref[1] || h[2] != ref[2]) continue;
    same++;
    if (ms < best) best = ms, pick = i;
  }
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  cudaGetLastError(); /* a failure above leaves no sticky error for the next launch */
  if (zero || pick < 0) {
    p->tuned = !zero || p->tune_tries >= 3; /* a failure is not tried again; zeros are */
    return;
  }
  p->algo = p->cand[pick];
  p->tuned = true;
  if (lt_tune_mode() == 2)
    fprintf(stderr, "kiln cublaslt: %lld x %lld x %lld epilogue %d: candidate %d of %d (%d with the first's bits), "
                    "%.1f us against the first's %.1f\n",
            (long long)p->M, (long long)p->N, (long long)p->K, (int)p->epi, pick, p->ncand, same, best * 500.0f,
            first * 500.0f);
}

} // namespace

/* One 2-D product with an epilogue: BIAS adds the vector at bias to every row of kiln's C;
** BGRADB writes the sums of kiln's A's rows there (cuBLAS's B is kiln's A, and BGRADB
** reduces B over the GEMM's k); GELU_AUX(_BIAS) writes gelu_tanh(A@B (+ bias)) to C and
** the pre-activation to aux (C's layout and ld), GELU(_BIAS) the former alone; DGELU
** multiplies by gelu_tanh'(aux);
** DEFAULT is the product alone. Returns KILN_OK when done, KILN_ERR_UNSUPPORTED (without
** setting the last error) when cuBLASLt has no algorithm: then the caller does it itself. */
kiln_status kc_lt_matmul(kiln__cuda_dev *d, cublasLtEpilogue_t epi, const kc_blas_types &t, cudaDataType_t cdata,
                         cublasOperation_t opB, cublasOperation_t opA, int64_t M, int64_t N, int64_t K,
                         const void *B, int64_t ldb, const void *A, int64_t lda, void *C, int64_t ldc,
                         const void *bias, float alpha, float beta, void *aux) {
  int dev = 0;
  cudaGetDevice(&dev);
  pthread_mutex_lock(&lt_lock);
  LtPlan *p = NULL;
  for (int i = 0; i < LT_PLANS && !p; i++) {
    LtPlan *q = &lt_plans[i];
    if (q->used && q->device == dev && q->epi == epi && q->data == t.data && q->cdata == cdata &&
        q->compute == t.compute &&
        q->opA == opA && q->opB == opB && q->M == M && q->N == N && q->K == K &&
        q->lda == lda && q->ldb == ldb && q->ldc == ldc)
      p = q;
  }
  if (!p) { /* a new problem: take the next slot, round robin */
    p = &lt_plans[lt_next];
    lt_next = (lt_next + 1) % LT_PLANS;
    lt_plan_destroy(p);
    p->used = true;
    p->device = dev;
    p->epi = epi;
    p->data = t.data;
    p->cdata = cdata;
    p->compute = t.compute;
    p->opA = opA;
    p->opB = opB;
    p->M = M, p->N = N, p->K = K, p->lda = lda, p->ldb = ldb, p->ldc = ldc;
    lt_plan_make(d, p);
  }
  kiln_status st = KILN_ERR_UNSUPPORTED;
  if (p->ok &&
      cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias) ==
          CUBLAS_STATUS_SUCCESS &&
      (!epi_has_aux(epi) ||
       cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof aux) ==
           CUBLAS_STATUS_SUCCESS)) {
    if (lt_tune_wanted(d, p, beta))
      lt_tune(d, p, &alpha, B, A, C,
              epi == CUBLASLT_EPILOGUE_GELU_AUX || epi == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ? aux : NULL);
    cublasStatus_t s = cublasLtMatmul((cublasLtHandle_t)d->blaslt, p->op, &alpha, B, p->la, A, p->lb,
                                      &beta, C, p->lc, C, p->lc, &p->algo, d->workspace,
                                      d->workspace_size, d->stream);
    /* A refusal here (say, a bias pointer it will not take) leaves the plain path. */
    st = s == CUBLAS_STATUS_SUCCESS ? KILN_OK : KILN_ERR_UNSUPPORTED;
  }
  pthread_mutex_unlock(&lt_lock);
  return st;
}
