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
#ifdef KILN_HAVE_OPENMP
#define ADAM_OMP _Pragma("omp parallel for num_threads(nt) if (n > ADAM_PAR_MIN) schedule(static)")
#else
#define ADAM_OMP
#endif

typedef struct adam_hp {
  double lr, beta1, beta2, eps, wd;
  double step_size, bc2_sqrt;
  bool decoupled, amsgrad;
} adam_hp;

/* One pass over a parameter. DEC (AdamW's decay), L2 (Adam's decay) and AMS are literal
** 0/1 at each use, so every variant is a straight-line loop the compiler vectorises. */
#define ADAM_PASS(T, LOAD, STORE, CT, KSQRT, TINY, DEC, L2, AMS)                          \
  do {                                                                                    \
    T *p = a->out[0].data, *m = a->out[1].data, *v = a->out[2].data;                      \
    T *vmax = a->n_out > 3 ? a->out[3].data : p;                                          \
    const T *g = a->in[0].data;                                                           \
    const CT b1 = (CT)hp.beta1, b2 = (CT)hp.beta2, eps = (CT)hp.eps, wd = (CT)hp.wd;        \
    const CT ss = (CT)hp.step_size, bc2s = (CT)hp.bc2_sqrt, keep = (CT)(1.0 - hp.lr * hp.wd); \
    (void)wd, (void)keep, (void)vmax;                                                     \
    ADAM_OMP                                                                              \
    for (int64_t i = 0; i < n; i++) {                                                     \
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
      CT den = KSQRT(vd) / bc2s + eps;                                                    \
      STORE(m[i], mi);                                                                    \
      STORE(v[i], vi);                                                                    \
      STORE(p[i], pi - ss * (mi / den));                                                  \
    }                                                                                     \
  } while (0)

/* KSQRT: sqrt in CT (sqrtf for f32, as PyTorch). */
#define ADAM_LOOP(T, LOAD, STORE, CT, KSQRT, TINY)                                        \
  do {                                                                                    \
    bool l2 = !hp.decoupled && hp.wd != 0;                                                \
    if (hp.amsgrad) {                                                                     \
      if (hp.decoupled) ADAM_PASS(T, LOAD, STORE, CT, KSQRT, TINY, 1, 0, 1);              \
      else if (l2) ADAM_PASS(T, LOAD, STORE, CT, KSQRT, TINY, 0, 1, 1);                   \
      else ADAM_PASS(T, LOAD, STORE, CT, KSQRT, TINY, 0, 0, 1);                           \
    } else {                                                                              \
      if (hp.decoupled) ADAM_PASS(T, LOAD, STORE, CT, KSQRT, TINY, 1, 0, 0);              \
      else if (l2) ADAM_PASS(T, LOAD, STORE, CT, KSQRT, TINY, 0, 1, 0);                   \
      else ADAM_PASS(T, LOAD, STORE, CT, KSQRT, TINY, 0, 0, 0);                           \
    }                                                                                     \
  } while (0)

#define ID(x) (x)
#define SET(dst, x) ((dst) = (x))
#define LD_F16(x) kiln__f16_to_f32(x)
#define ST_F16(dst, x) ((dst) = kiln__f32_to_f16(x))
#define LD_BF16(x) kiln__bf16_to_f32(x)
#define ST_BF16(dst, x) ((dst) = kiln__f32_to_bf16(x))

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
  adam_hp hp;
  hp.lr = a->s[0];
  hp.beta1 = a->s[1];
  hp.beta2 = a->s[2];
  hp.eps = a->s[3];
  memcpy(&hp.wd, &a->i[2], sizeof hp.wd);
  hp.decoupled = (a->i[1] & 1) != 0;
  hp.amsgrad = (a->i[1] & 2) != 0 && a->n_out > 3;
  int64_t step = a->i[0] > 0 ? a->i[0] : 1;
  if ((a->i[1] & 4) && a->n_in > 1) step = (int64_t)(*(const double *)a->in[1].data) + 1;
  double bc1 = 1.0 - pow(hp.beta1, (double)step);
  double bc2 = 1.0 - pow(hp.beta2, (double)step);
  hp.step_size = hp.lr / bc1;
  hp.bc2_sqrt = sqrt(bc2);
  int nt = kiln_num_threads();
  (void)nt;
  switch (dt) {
  case KILN_F32: ADAM_LOOP(float, ID, SET, float, sqrtf, FLT_MIN); break;
  case KILN_F64: ADAM_LOOP(double, ID, SET, double, sqrt, DBL_MIN); break;
  case KILN_F16: ADAM_LOOP(uint16_t, LD_F16, ST_F16, float, sqrtf, FLT_MIN); break;
  case KILN_BF16: ADAM_LOOP(uint16_t, LD_BF16, ST_BF16, float, sqrtf, FLT_MIN); break;
  default:
    return kiln_set_error(KILN_ERR_DTYPE, "kiln adam kernel: expected a floating dtype, got %s", kiln_dtype_name(dt));
  }
  return KILN_OK;
}
