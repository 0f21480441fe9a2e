/*
** cuDNN's backend (graph) API: the pieces its two users in kiln share, cuda_conv_cudnn.cu
** (convolutions) and cuda_attention_cudnn.cu (fused attention). A plan owns every
** descriptor it was built from; a graph of operations gets its execution plan from the
** heuristics' engine lists, each engine filtered by the caller's rule on its notes; a call
** names its memory in a variant pack. Included only where KILN_HAVE_CUDNN; the functions are
** static (one copy per file, no symbols exported).
*/
#pragma once

#include <cudnn.h>

#include <vector>

/* Returns a failing cuDNN status from the function it is used in. */
#define KB_TRY(call)                                                                      \
  do {                                                                                    \
    cudnnStatus_t s_ = (call);                                                            \
    if (s_ != CUDNN_STATUS_SUCCESS) return s_;                                            \
  } while (0)

/* Every descriptor a plan was built from, kept for the plan's life (the process's: the
** users' caches never drop an entry), destroyed in reverse order. */
struct CudnnPlan {
  std::vector<cudnnBackendDescriptor_t> owned;
  cudnnBackendDescriptor_t plan = NULL;
  int64_t ws = 0;      /* workspace bytes */
  int64_t engine = -1; /* CUDNN_ATTR_ENGINE_GLOBAL_INDEX, for the logs */
  bool nondet = false; /* the engine's note: not deterministic */
  CudnnPlan() = default;
  CudnnPlan(const CudnnPlan &) = delete;
  CudnnPlan &operator=(const CudnnPlan &) = delete;
  ~CudnnPlan() {
    for (size_t i = owned.size(); i-- > 0;) cudnnBackendDestroyDescriptor(owned[i]);
  }
  cudnnStatus_t make(cudnnBackendDescriptorType_t type, cudnnBackendDescriptor_t *out) {
    *out = NULL;
    cudnnStatus_t s = cudnnBackendCreateDescriptor(type, out);
    if (s == CUDNN_STATUS_SUCCESS) owned.push_back(*out);
    return s;
  }
};

/* A finalized 4-d tensor descriptor. virt: an intermediate the graph never stores;
** by_value: a scalar passed by the variant pack's pointer to host memory. */
static cudnnStatus_t cudnn_tensor(CudnnPlan *p, int64_t uid, cudnnDataType_t dt, const int64_t dims[4],
                                  const int64_t st[4], bool virt, bool by_value, int64_t align,
                                  cudnnBackendDescriptor_t *out) {
  cudnnBackendDescriptor_t t;
  KB_TRY(p->make(CUDNN_BACKEND_TENSOR_DESCRIPTOR, &t));
  KB_TRY(cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt));
  KB_TRY(cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims));
  KB_TRY(cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, st));
  KB_TRY(cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid));
  KB_TRY(cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align));
  if (virt) KB_TRY(cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt));
  if (by_value) KB_TRY(cudnnBackendSetAttribute(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value));
  KB_TRY(cudnnBackendFinalize(t));
  *out = t;
  return CUDNN_STATUS_SUCCESS;
}

/* What cuDNN says of the engine behind an engine config. */
struct CudnnEngineNotes {
  int64_t global = -1;       /* its global index */
  bool known = true;         /* both lists of notes were read */
  bool nondet = false;       /* NONDETERMINISTIC */
  bool lower_prec = false;   /* DOWN_CONVERT_INPUTS or REDUCED_PRECISION_REDUCTION */
  bool tensor_core = false;  /* TENSOR_CORE (TF32 for f32 operands) */
  bool compiled = false;     /* RUNTIME_COMPILATION: NVRTC at plan time */
};

/* The notes of cfg's engine; known false when either list could not be read. */
static cudnnStatus_t cudnn_engine_notes(CudnnPlan *p, cudnnBackendDescriptor_t cfg, CudnnEngineNotes *e) {
  *e = CudnnEngineNotes();
  cudnnBackendDescriptor_t eng;
  KB_TRY(p->make(CUDNN_BACKEND_ENGINE_DESCRIPTOR, &eng));
  int64_t n = 0;
  KB_TRY(cudnnBackendGetAttribute(cfg, CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n, &eng));
  (void)cudnnBackendGetAttribute(eng, CUDNN_ATTR_ENGINE_GLOBAL_INDEX, CUDNN_TYPE_INT64, 1, &n, &e->global);
  cudnnBackendNumericalNote_t notes[CUDNN_NUMERICAL_NOTE_TYPE_COUNT];
  n = 0;
  e->known = cudnnBackendGetAttribute(eng, CUDNN_ATTR_ENGINE_NUMERICAL_NOTE, CUDNN_TYPE_NUMERICAL_NOTE,
                                      CUDNN_NUMERICAL_NOTE_TYPE_COUNT, &n, notes) == CUDNN_STATUS_SUCCESS;
  if (!e->known) n = 0;
  for (int64_t i = 0; i < n; i++) {
    e->nondet |= notes[i] == CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
    e->lower_prec |= notes[i] == CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS ||
                     notes[i] == CUDNN_NUMERICAL_NOTE_REDUCED_PRECISION_REDUCTION;
    e->tensor_core |= notes[i] == CUDNN_NUMERICAL_NOTE_TENSOR_CORE;
  }
  cudnnBackendBehaviorNote_t behav[CUDNN_BEHAVIOR_NOTE_TYPE_COUNT];
  n = 0;
  if (cudnnBackendGetAttribute(eng, CUDNN_ATTR_ENGINE_BEHAVIOR_NOTE, CUDNN_TYPE_BEHAVIOR_NOTE,
                               CUDNN_BEHAVIOR_NOTE_TYPE_COUNT, &n, behav) != CUDNN_STATUS_SUCCESS)
    e->known = false, n = 0;
  for (int64_t i = 0; i < n; i++) e->compiled |= behav[i] == CUDNN_BEHAVIOR_NOTE_RUNTIME_COMPILATION;
  return CUDNN_STATUS_SUCCESS;
}

/* How a plan is chosen: the heuristics' lists asked, in order (up to max_cfg engines
** each), the caller's rule on an engine's notes, the largest workspace taken. */
struct CudnnPlanRule {
  const cudnnBackendHeurMode_t *modes;
  int n_modes;
  int max_cfg;
  int64_t max_ws;
  bool det_first; /* deterministic engines first, the others after them */
  bool (*accept)(const CudnnEngineNotes &e, const void *ctx); /* NULL: any */
  const void *ctx;
};

/* The graph of ops and its plan: the engines of rule's lists in order (deterministic ones
** first when the rule says so: DESIGN.md, same seed, same numbers), the first that the
** rule accepts and whose plan finalizes. CUDNN_STATUS_NOT_SUPPORTED when none does. */
static cudnnStatus_t cudnn_choose_plan(cudnnHandle_t h, CudnnPlan *p, const cudnnBackendDescriptor_t *ops, int n_ops,
                                       const CudnnPlanRule &rule) {
  cudnnBackendDescriptor_t graph;
  KB_TRY(p->make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, &graph));
  KB_TRY(cudnnBackendSetAttribute(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, n_ops, ops));
  KB_TRY(cudnnBackendSetAttribute(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h));
  KB_TRY(cudnnBackendFinalize(graph));

  std::vector<cudnnBackendDescriptor_t> cfgs;
  for (int mi = 0; mi < rule.n_modes; mi++) {
    cudnnBackendDescriptor_t heur;
    KB_TRY(p->make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, &heur));
    KB_TRY(cudnnBackendSetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                    &graph));
    KB_TRY(cudnnBackendSetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &rule.modes[mi]));
    if (cudnnBackendFinalize(heur) != CUDNN_STATUS_SUCCESS) continue; /* this list has nothing: the next */
    std::vector<cudnnBackendDescriptor_t> cfg((size_t)rule.max_cfg);
    for (cudnnBackendDescriptor_t &c : cfg) KB_TRY(p->make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, &c));
    int64_t n = 0;
    if (cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, rule.max_cfg, &n,
                                 cfg.data()) != CUDNN_STATUS_SUCCESS)
      continue;
    for (int64_t i = 0; i < n && i < rule.max_cfg; i++) cfgs.push_back(cfg[(size_t)i]);
  }
  for (int pass = 0; pass < (rule.det_first ? 2 : 1); pass++)
    for (cudnnBackendDescriptor_t cfg : cfgs) {
      CudnnEngineNotes e;
      if (cudnn_engine_notes(p, cfg, &e) != CUDNN_STATUS_SUCCESS) continue;
      if (rule.det_first && e.nondet != (pass == 1)) continue; /* each engine in its pass */
      if (rule.accept && !rule.accept(e, rule.ctx)) continue;
      cudnnBackendDescriptor_t plan;
      KB_TRY(p->make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan));
      KB_TRY(cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h));
      KB_TRY(cudnnBackendSetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                      &cfg));
      if (cudnnBackendFinalize(plan) != CUDNN_STATUS_SUCCESS) continue; /* this engine cannot: the next */
      int64_t ws = 0, got = 0;
      KB_TRY(cudnnBackendGetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &got, &ws));
      if (ws < 0 || ws > rule.max_ws) continue;
      p->plan = plan;
      p->ws = ws;
      p->engine = e.global;
      p->nondet = e.nondet;
      return CUDNN_STATUS_SUCCESS;
    }
  return CUDNN_STATUS_NOT_SUPPORTED;
}

/* Runs plan on h's stream with the n operands' memory (uids[i] at ptrs[i]) and workspace ws. */
static cudnnStatus_t cudnn_execute(cudnnHandle_t h, cudnnBackendDescriptor_t plan, int n, const int64_t *uids,
                                   void *const *ptrs, void *ws) {
  cudnnBackendDescriptor_t vp = NULL;
  cudnnStatus_t s = cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp);
  if (s == CUDNN_STATUS_SUCCESS)
    s = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs);
  if (s == CUDNN_STATUS_SUCCESS) s = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids);
  if (s == CUDNN_STATUS_SUCCESS) s = cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
  if (s == CUDNN_STATUS_SUCCESS) s = cudnnBackendFinalize(vp);
  if (s == CUDNN_STATUS_SUCCESS) s = cudnnBackendExecute(h, plan, vp);
  if (vp) cudnnBackendDestroyDescriptor(vp);
  return s;
}
