/*
** Fused optimizer kernels for the CPU: one pass over param, grad and state per tensor
** instead of a dozen elementwise ops. The formulas are PyTorch's Adam/AdamW
** (torch/optim/adam.py, single-tensor path), computed in the parameter's precision
** (f32 for the 16-bit floats).
**
** One deliberate difference: m and v are flushed to zero once they fall below the
** smallest normal number of the compute type. A parameter whose gradient stays zero (a
** pixel that is black in every image, a dead ReLU unit) has m decay by beta1 each step,
** into the subnormals after ~800 steps at f32; from then on every multiply on it takes a
** microcode assist (x86 handles subnormal results in microcode, ~100 cycles), and the
** Adam pass of fashion-mnist slowed 3.5x from its third epoch. The update such an m or v
** would contribute is below lr * FLT_MIN / eps (~1e-33): zero at any parameter scale.
*/
#include "core/kiln_int.h"
#include "core/half.h"
#include "cpu.h"
#include "cpu_iter.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* Threads pay off from 64k elements when OpenBLAS shares kiln's OpenMP pool; beside the
** pthread OpenBLAS's own pool, only for very large tensors. */
#if defined(KILN_BLAS_OPENMP) || !defined(KILN_HAVE_CBLAS)
#define ADAM_PAR_MIN 65536
#else
#define ADAM_PAR_MIN (1 << 20)
#endif

typedef struct adam_job {
  void *p, *m, *v, *vmax;
  const void *g;
  double lr, beta1, beta2, eps, wd;
  double step_size, inv_bc2_sqrt;
  bool decoupled, amsgrad;
} adam_job;

/* One pass over elements [lo, hi) of a parameter. DEC (AdamW's decay), L2 (Adam's decay)
** and AMS are literal 0/1, so every variant is a straight-line loop the compiler
** vectorises; KILN__CPU_CLONES adds an AVX2 copy (no FMA, so the same roundings as the
** SSE2 one: two square roots and two divides per element made the SSE2 loop
** divider-bound). The denominator is sqrt(v) * (1 / sqrt(bc2)) + eps, where PyTorch
** divides by sqrt(bc2): one divide fewer, a difference of at most 1 ulp in den. */
#define ADAM_RANGE(NAME, T, LOAD, STORE, CT, KSQRT, TINY, DEC, L2, AMS)                   \
  static KILN__CPU_CLONES void NAME(void *ctx, int64_t lo, int64_t hi) {                  \
    const adam_job *j = (const adam_job *)ctx;                                            \
    T *p = j->p, *m = j->m, *v = j->v, *vmax = j->vmax;                                   \
    const T *g = j->g;                                                                    \
    const CT b1 = (CT)j->beta1, b2 = (CT)j->beta2, eps = (CT)j->eps, wd = (CT)j->wd;      \
    const CT ss = (CT)j->step_size, ibc2s = (CT)j->inv_bc2_sqrt;                          \
    const CT keep = (CT)(1.0 - j->lr * j->wd);                                            \
    (void)wd, (void)keep, (void)vmax;                                                     \
    for (int64_t i = lo; i < hi; i++) {                                                   \
      CT pi = LOAD(p[i]), gi = LOAD(g[i]);                                                \
      if (DEC) pi = pi * keep;                                                            \
      if (L2) gi = gi + wd * pi;                                                          \
      CT mi = LOAD(m[i]) * b1 + gi * ((CT)1 - b1);                                        \
      CT vi = LOAD(v[i]) * b2 + gi * gi * ((CT)1 - b2);                                   \
      mi = mi < (CT)TINY && mi > -(CT)TINY ? (CT)0 : mi; /* no subnormal state */         \
      vi = vi < (CT)TINY ? (CT)0 : vi;                                                    \
      CT vd = vi;                                                                         \
      if (AMS) {                                                                          \
        CT vm = LOAD(vmax[i]);                                                            \
        vd = vi > vm ? vi : vm;                                                           \
        STORE(vmax[i], vd);                                                               \
      }                                                                                   \
      CT den = KSQRT(vd) * ibc2s + eps;                                                   \
      STORE(m[i], mi);                                                                    \
      STORE(v[i], vi);                                                                    \
      STORE(p[i], pi - ss * (mi / den));                                                  \
    }                                                                                     \
  }

/* The six variants of one storage type, and a table of them indexed by
** amsgrad * 3 + (decoupled ? 2 : l2 ? 1 : 0). */
#define ADAM_FNS(SUF, T, LOAD, STORE, CT, KSQRT, TINY)                                    \
  ADAM_RANGE(adam_##SUF##_000, T, LOAD, STORE, CT, KSQRT, TINY, 0, 0, 0)                  \
  ADAM_RANGE(adam_##SUF##_010, T, LOAD, STORE, CT, KSQRT, TINY, 0, 1, 0)                  \
  ADAM_RANGE(adam_##SUF##_100, T, LOAD, STORE, CT, KSQRT, TINY, 1, 0, 0)                  \
  ADAM_RANGE(adam_##SUF##_001, T, LOAD, STORE, CT, KSQRT, TINY, 0, 0, 1)                  \
  ADAM_RANGE(adam_##SUF##_011, T, LOAD, STORE, CT, KSQRT, TINY, 0, 1, 1)                  \
  ADAM_RANGE(adam_##SUF##_101, T, LOAD, STORE, CT, KSQRT, TINY, 1, 0, 1)                  \
  static const kiln__cpu_range_fn adam_##SUF[6] = {adam_##SUF##_000, adam_##SUF##_010,    \
                                                   adam_##SUF##_100, adam_##SUF##_001,    \
                                                   adam_##SUF##_011, adam_##SUF##_101};

#define ID(x) (x)
#define SET(dst, x) ((dst) = (x))
#define LD_F16(x) kiln__f16_to_f32(x)
#define ST_F16(dst, x) ((dst) = kiln__f32_to_f16(x))
#define LD_BF16(x) kiln__bf16_to_f32(x)
#define ST_BF16(dst, x) ((dst) = kiln__f32_to_bf16(x))

ADAM_FNS(f32, float, ID, SET, float, sqrtf, FLT_MIN)
ADAM_FNS(f64, double, ID, SET, double, sqrt, DBL_MIN)
ADAM_FNS(f16, uint16_t, LD_F16, ST_F16, float, sqrtf, FLT_MIN)
ADAM_FNS(bf16, uint16_t, LD_BF16, ST_BF16, float, sqrtf, FLT_MIN)

kiln_status kiln__cpu_adam(const kiln__kargs *a) {
  if (a->n_in < 1 || a->n_out < 3)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln adam kernel: expected 1 input and 3-4 outputs");
  kiln_dtype dt = a->out[0].dtype;
  int64_t n = kiln__view_numel(&a->out[0]);
  for (int k = 0; k < a->n_out; k++)
    if (a->out[k].dtype != dt || !kiln__view_is_contiguous(&a->out[k]) || kiln__view_numel(&a->out[k]) != n)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln adam kernel: state %d must be contiguous %s of %lld elements", k, kiln_dtype_name(dt), (long long)n);
  if (a->in[0].dtype != dt || !kiln__view_is_contiguous(&a->in[0]))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln adam kernel: grad must be contiguous %s", kiln_dtype_name(dt));
  adam_job j;
  j.p = a->out[0].data;
  j.m = a->out[1].data;
  j.v = a->out[2].data;
  j.vmax = a->n_out > 3 ? a->out[3].data : NULL;
  j.g = a->in[0].data;
  j.lr = a->s[0];
  j.beta1 = a->s[1];
  j.beta2 = a->s[2];
  j.eps = a->s[3];
  memcpy(&j.wd, &a->i[2], sizeof j.wd);
  j.decoupled = (a->i[1] & 1) != 0;
  j.amsgrad = (a->i[1] & 2) != 0 && a->n_out > 3;
  int64_t step = a->i[0] > 0 ? a->i[0] : 1;
  if ((a->i[1] & 4) && a->n_in > 1) step = (int64_t)(*(const double *)a->in[1].data) + 1;
  double bc1 = 1.0 - pow(j.beta1, (double)step);
  double bc2 = 1.0 - pow(j.beta2, (double)step);
  j.step_size = j.lr / bc1;
  j.inv_bc2_sqrt = 1.0 / sqrt(bc2);
  int variant = (j.amsgrad ? 3 : 0) + (j.decoupled ? 2 : (j.wd != 0 ? 1 : 0));
  const kiln__cpu_range_fn *fns;
  switch (dt) {
  case KILN_F32: fns = adam_f32; break;
  case KILN_F64: fns = adam_f64; break;
  case KILN_F16: fns = adam_f16; break;
  case KILN_BF16: fns = adam_bf16; break;
  default:
    return kiln_set_error(KILN_ERR_DTYPE, "kiln adam kernel: expected a floating dtype, got %s", kiln_dtype_name(dt));
  }
  kiln__cpu_parallel_for(n, ADAM_PAR_MIN, fns[variant], &j);
  return KILN_OK;
}

/* ADAM_MULTI: the single-tensor kernel per group (the CPU gains nothing from fewer calls
** but the dispatch), then each step_t advanced when the step lives with the tensors. */
kiln_status kiln__cpu_adam_multi(const kiln__kargs *a) {
  const bool ams = (a->i[1] & 2) != 0, on_dev = (a->i[1] & 4) != 0;
  const int w = kiln__adam_list_width(a);
  if (w < 0) return kiln_last_error();
  for (int g = 0; g < a->list_n; g++) {
    const kiln__view *v = &a->list[(size_t)g * (size_t)w];
    kiln__kargs k = {0};
    k.op = KILN__K_ADAM;
    k.n_in = on_dev ? 2 : 1;
    k.in[0] = v[0];
    if (on_dev) k.in[1] = v[w - 1];
    k.n_out = ams ? 4 : 3;
    for (int o = 0; o < k.n_out; o++) k.out[o] = v[1 + o];
    memcpy(k.s, a->s, sizeof k.s);
    k.i[0] = a->list_i ? a->list_i[g] : 1;
    k.i[1] = a->i[1];
    k.i[2] = a->i[2];
    kiln_status st = kiln__cpu_adam(&k);
    if (st != KILN_OK) return st;
  }
  if (on_dev)
    for (int g = 0; g < a->list_n; g++) *(double *)a->list[(size_t)g * (size_t)w + (size_t)(w - 1)].data += 1.0;
  return KILN_OK;
}
