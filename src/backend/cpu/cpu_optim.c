/*
** Fused optimizer kernels for the CPU: one pass over param, grad and state per tensor
** instead of a dozen elementwise ops. The values are PyTorch's Adam/AdamW to the bit: the
** operations of torch/optim/adam.py's _single_tensor_adam (torch 1.13, foreach=False) in
** their order and with their roundings, in the parameter's precision (f32 for the 16-bit
** floats). Per element, t the step, with the scalars worked out in double as Python does
** and rounded once to the compute type (that is what a Python float becomes in an op):
**   g = grad
**   Adam:  g = fma(p, wd, g)                     grad.add(param, alpha=wd)
**   AdamW: p = p * (1 - lr wd)                   param.mul_(1 - lr * wd)
**   m = fma(g, 1 - b1, m * b1)                   exp_avg.mul_(b1).add_(g, alpha=1 - b1)
**   v = fma((1 - b2) * g, g, v * b2)             exp_avg_sq.mul_(b2).addcmul_(g, g, value=1 - b2)
**   amsgrad: vmax = max(vmax, v), used for v below
**   den = sqrt(v) / sqrt(1 - b2^t) + eps         (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
**   p = p + (-(lr / (1 - b1^t)) * m) / den       param.addcdiv_(exp_avg, denom, value=-step_size)
** The FMAs are PyTorch's: its CPU kernels for AVX2 are compiled with -mfma and GCC
** contracts `a + alpha * b` (add with alpha, addcmul) into one FMA; the add of addcdiv
** follows a division and stays apart. (Measured on torch 1.13's AVX2 kernels against
** numpy, element by element; PyTorch's kernels for CPUs without AVX2 round twice, kiln
** keeps the FMA there too, through libm, so its results do not depend on the machine.)
** What kiln did before: 1 - b1 and 1 - b2 from the f32-rounded betas (1 - 0.999f is
** 4.7e-5 away from 0.001f), den = sqrt(v) * (1 / sqrt(bc2)) + eps, p - ss * (m / den),
** v from (g * g) * (1 - b2), and no FMA.
** PyTorch 2.x writes the first moment as exp_avg.lerp_(grad, 1 - beta1); its CPU lerp is
** m + w * (g - m) for w = 1 - b1 < 0.5 (g - (g - m) * (1 - w) above), which rounds
** differently from 1.13's mul_/add_ above. The fixtures of tests/test_optim_parity.c come
** from 1.13, so kiln follows 1.13; moving to 2.x's numbers means changing the m line here
** and in cuda_optim.cu, and making the fixtures again.
**
** One deliberate difference: m and v are flushed to zero once they fall below the
** smallest normal number of the compute type. A parameter whose gradient stays zero (a
** pixel that is black in every image, a dead ReLU unit) has m decay by beta1 each step,
** into the subnormals after ~800 steps at f32; from then on every multiply on it takes a
** microcode assist (x86 handles subnormal results in microcode, ~100 cycles), and the
** Adam pass of fashion-mnist slowed 3.5x from its third epoch. The update such an m or v
** would contribute is below lr * FLT_MIN / eps (~1e-33): zero at any parameter scale.
** (It never fires within test_optim_parity's 300 steps, where PyTorch's m and v stay
** normal; a run long enough to reach it differs from PyTorch by such updates only.)
*/
#include "core/kiln_int.h"
#include "core/half.h"
#include "cpu.h"
#include "cpu_iter.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Threads pay off from 64k elements when OpenBLAS shares kiln's OpenMP pool; beside the
** pthread OpenBLAS's own pool, only for very large tensors. */
#if defined(KILN_BLAS_OPENMP) || !defined(KILN_HAVE_CBLAS)
#define ADAM_PAR_MIN 65536
#else
#define ADAM_PAR_MIN (1 << 20)
#endif

/* The scalars of one update, in double; each kernel rounds them once to its type. */
typedef struct adam_job {
  void *p, *m, *v, *vmax;
  const void *g;
  double wd, keep, b1, omb1, b2, omb2, bc2_sqrt, eps, neg_step_size;
} adam_job;

/* One pass over elements [lo, hi) of a parameter. DEC (AdamW's decay), L2 (Adam's decay)
** and AMS are literal 0/1, so every variant is a straight-line loop the compiler
** vectorises. ATTR is KILN__CPU_FMA for the copy that runs where the CPU has FMA (KFMA one
** instruction), empty for the plain copy (KFMA libm's). */
#define ADAM_RANGE(NAME, ATTR, T, LOAD, STORE, CT, KSQRT, KFMA, TINY, DEC, L2, AMS)        \
  static ATTR void NAME(void *ctx, int64_t lo, int64_t hi) {                              \
    const adam_job *j = (const adam_job *)ctx;                                            \
    T *p = j->p, *m = j->m, *v = j->v, *vmax = j->vmax;                                   \
    const T *g = j->g;                                                                    \
    const CT b1 = (CT)j->b1, omb1 = (CT)j->omb1, b2 = (CT)j->b2, omb2 = (CT)j->omb2;      \
    const CT wd = (CT)j->wd, keep = (CT)j->keep, bc2s = (CT)j->bc2_sqrt, eps = (CT)j->eps; \
    const CT nss = (CT)j->neg_step_size;                                                  \
    (void)wd, (void)keep, (void)vmax;                                                     \
    for (int64_t i = lo; i < hi; i++) {                                                   \
      CT pi = LOAD(p[i]), gi = LOAD(g[i]);                                                \
      if (DEC) pi = pi * keep;                                                            \
      if (L2) gi = KFMA(pi, wd, gi);                                                      \
      CT mi = KFMA(gi, omb1, LOAD(m[i]) * b1);                                            \
      CT vi = KFMA(omb2 * gi, gi, LOAD(v[i]) * b2);                                       \
      mi = mi < (CT)TINY && mi > -(CT)TINY ? (CT)0 : mi; /* no subnormal state */         \
      vi = vi < (CT)TINY ? (CT)0 : vi;                                                    \
      CT vd = vi;                                                                         \
      if (AMS) {                                                                          \
        CT vm = LOAD(vmax[i]);                                                            \
        vd = (vi != vi || vi > vm) ? vi : vm; /* torch.maximum: NaN wins */               \
        STORE(vmax[i], vd);                                                               \
      }                                                                                   \
      CT den = KSQRT(vd) / bc2s + eps;                                                    \
      STORE(m[i], mi);                                                                    \
      STORE(v[i], vi);                                                                    \
      STORE(p[i], pi + (nss * mi) / den);                                                 \
    }                                                                                     \
  }

/* The six variants of one storage type and one ATTR, and a table of them indexed by
** amsgrad * 3 + (decoupled ? 2 : l2 ? 1 : 0). */
#define ADAM_SIX(SUF, ATTR, T, LOAD, STORE, CT, KSQRT, KFMA, TINY)                          \
  ADAM_RANGE(adam_##SUF##_000, ATTR, T, LOAD, STORE, CT, KSQRT, KFMA, TINY, 0, 0, 0)        \
  ADAM_RANGE(adam_##SUF##_010, ATTR, T, LOAD, STORE, CT, KSQRT, KFMA, TINY, 0, 1, 0)        \
  ADAM_RANGE(adam_##SUF##_100, ATTR, T, LOAD, STORE, CT, KSQRT, KFMA, TINY, 1, 0, 0)        \
  ADAM_RANGE(adam_##SUF##_001, ATTR, T, LOAD, STORE, CT, KSQRT, KFMA, TINY, 0, 0, 1)        \
  ADAM_RANGE(adam_##SUF##_011, ATTR, T, LOAD, STORE, CT, KSQRT, KFMA, TINY, 0, 1, 1)        \
  ADAM_RANGE(adam_##SUF##_101, ATTR, T, LOAD, STORE, CT, KSQRT, KFMA, TINY, 1, 0, 1)        \
  static const kiln__cpu_range_fn adam_##SUF[6] = {adam_##SUF##_000, adam_##SUF##_010,    \
                                                   adam_##SUF##_100, adam_##SUF##_001,    \
                                                   adam_##SUF##_011, adam_##SUF##_101};

/* Both copies of one storage type: adam_<suf>_fma and adam_<suf>_plain. */
#define ADAM_FNS(SUF, T, LOAD, STORE, CT, KSQRT, KFMA, TINY)                                \
  ADAM_SIX(SUF##_fma, KILN__CPU_FMA, T, LOAD, STORE, CT, KSQRT, KFMA, TINY)                  \
  ADAM_SIX(SUF##_plain, , T, LOAD, STORE, CT, KSQRT, KFMA, TINY)

#define ID(x) (x)
#define SET(dst, x) ((dst) = (x))
#define LD_F16(x) kiln__f16_to_f32(x)
#define ST_F16(dst, x) ((dst) = kiln__f32_to_f16(x))
#define LD_BF16(x) kiln__bf16_to_f32(x)
#define ST_BF16(dst, x) ((dst) = kiln__f32_to_bf16(x))

ADAM_FNS(f32, float, ID, SET, float, sqrtf, fmaf, FLT_MIN)
ADAM_FNS(f64, double, ID, SET, double, sqrt, fma, DBL_MIN)
ADAM_FNS(f16, uint16_t, LD_F16, ST_F16, float, sqrtf, fmaf, FLT_MIN)
ADAM_FNS(bf16, uint16_t, LD_BF16, ST_BF16, float, sqrtf, fmaf, FLT_MIN)

/* An update with the parameter's bf16 copy written as it goes (ADAM_MULTI's copy column
** for an f32 parameter): blocks of ADAM_COPY_BLK elements updated, then converted while
** they are in L1, instead of a second pass over every parameter afterwards (write_copies:
** ~1 ms of a 4.3M-parameter step on 2 cores, memory-bound). The conversion is COPY's
** (kiln__cpu_store, f32 -> bf16 to nearest even): the same bits. */
#define ADAM_COPY_BLK 4096
typedef struct adam_cjob {
  const adam_job *j;
  kiln__cpu_range_fn fn;
  uint16_t *copy;
} adam_cjob;

static void adam_copy_range(void *ctx, int64_t lo, int64_t hi) {
  const adam_cjob *c = ctx;
  for (int64_t b0 = lo; b0 < hi; b0 += ADAM_COPY_BLK) {
    int64_t b1 = hi - b0 < ADAM_COPY_BLK ? hi : b0 + ADAM_COPY_BLK;
    c->fn((void *)c->j, b0, b1);
    kiln__cpu_store((char *)(c->copy + b0), 2, KILN_BF16, (const float *)c->j->p + b0, KILN_F32, b1 - b0);
  }
}

/* copy: the f32 parameter's bf16 copy (contiguous, n elements) to write with the update, or
** NULL */
static kiln_status cpu_adam(const kiln__kargs *a, uint16_t *copy) {
  if (a->n_in < 1 || a->n_out < 3)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln adam kernel: expected 1 input and 3-4 outputs");
  kiln_dtype dt = a->out[0].dtype;
  int64_t n = kiln__view_numel(&a->out[0]);
  for (int k = 0; k < a->n_out; k++)
    if (a->out[k].dtype != dt || !kiln__view_is_contiguous(&a->out[k]) || kiln__view_numel(&a->out[k]) != n)
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln adam kernel: state %d must be contiguous %s of %lld elements", k, kiln_dtype_name(dt), (long long)n);
  if (a->in[0].dtype != dt || !kiln__view_is_contiguous(&a->in[0]))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln adam kernel: grad must be contiguous %s", kiln_dtype_name(dt));
  /* flag 8: the found-inf flag is the last input; a set flag skips the step untouched */
  if ((a->i[1] & 8) && a->n_in > 1 && *(const float *)a->in[a->n_in - 1].data != 0.0f) return KILN_OK;
  adam_job j;
  j.p = a->out[0].data;
  j.m = a->out[1].data;
  j.v = a->out[2].data;
  j.vmax = a->n_out > 3 ? a->out[3].data : NULL;
  j.g = a->in[0].data;
  const double lr = a->s[0], beta1 = a->s[1], beta2 = a->s[2];
  memcpy(&j.wd, &a->i[2], sizeof j.wd);
  const bool decoupled = (a->i[1] & 1) != 0, amsgrad = (a->i[1] & 2) != 0 && a->n_out > 3;
  int64_t step = a->i[0] > 0 ? a->i[0] : 1;
  if ((a->i[1] & 4) && a->n_in > 1) step = (int64_t)(*(const double *)a->in[1].data) + 1;
  /* Python's arithmetic on Python floats, in adam.py's order. */
  j.keep = 1.0 - lr * j.wd;
  j.b1 = beta1;
  j.omb1 = 1.0 - beta1;
  j.b2 = beta2;
  j.omb2 = 1.0 - beta2;
  j.eps = a->s[3];
  j.bc2_sqrt = sqrt(1.0 - pow(beta2, (double)step));
  j.neg_step_size = -(lr / (1.0 - pow(beta1, (double)step)));
  int variant = (amsgrad ? 3 : 0) + (decoupled ? 2 : (j.wd != 0 ? 1 : 0));
  const bool fma_cpu = kiln__cpu_has_fma();
  const kiln__cpu_range_fn *fns;
  switch (dt) {
  case KILN_F32: fns = fma_cpu ? adam_f32_fma : adam_f32_plain; break;
  case KILN_F64: fns = fma_cpu ? adam_f64_fma : adam_f64_plain; break;
  case KILN_F16: fns = fma_cpu ? adam_f16_fma : adam_f16_plain; break;
  case KILN_BF16: fns = fma_cpu ? adam_bf16_fma : adam_bf16_plain; break;
  default:
    return kiln_set_error(KILN_ERR_DTYPE, "kiln adam kernel: expected a floating dtype, got %s", kiln_dtype_name(dt));
  }
  if (copy && dt == KILN_F32) {
    adam_cjob c = {&j, fns[variant], copy};
    kiln__cpu_parallel_for(n, ADAM_PAR_MIN, adam_copy_range, &c);
  } else {
    kiln__cpu_parallel_for(n, ADAM_PAR_MIN, fns[variant], &j);
  }
  return KILN_OK;
}

kiln_status kiln__cpu_adam(const kiln__kargs *a) { return cpu_adam(a, NULL); }

/* The list kernels' copy column (ADAM_MULTI flag 16, SGD_MULTI flag 32): each group's last
** view, when it has data, gets the parameter (v[1]) converted as COPY converts it, after
** the update (or as it is, when the step was skipped). */
static kiln_status write_copies(const kiln__kargs *a, int w, const bool *done) {
  for (int g = 0; g < a->list_n; g++) {
    const kiln__view *v = &a->list[(size_t)g * (size_t)w];
    if (!v[w - 1].data || (done && done[g])) continue;
    kiln__kargs c = {0};
    c.op = KILN__K_COPY;
    c.n_in = c.n_out = 1;
    c.in[0] = v[1];
    c.out[0] = v[w - 1];
    kiln_status st = kiln__cpu_copy(&c);
    if (st != KILN_OK) return st;
  }
  return KILN_OK;
}

/* ADAM_MULTI: the single-tensor kernel per group (the CPU gains nothing from fewer calls
** but the dispatch), then each step_t advanced when the step lives with the tensors. */
kiln_status kiln__cpu_adam_multi(const kiln__kargs *a) {
  const bool ams = (a->i[1] & 2) != 0, on_dev = (a->i[1] & 4) != 0, copies = (a->i[1] & 16) != 0;
  const int w = kiln__adam_list_width(a);
  if (w < 0) return kiln_last_error();
  const int ws = w - (copies ? 1 : 0); /* step_t is the last view before the copy */
  /* flag 8: in0 is the found-inf flag; set, the step is skipped and no step_t advances */
  if (a->i[1] & 8) {
    if (a->n_in < 1 || a->in[0].dtype != KILN_F32)
      return kiln_set_error(KILN_ERR_INTERNAL, "kiln adam_multi kernel: flag 8 needs an f32 found_inf as in0");
    if (*(const float *)a->in[0].data != 0.0f) return copies ? write_copies(a, w, NULL) : KILN_OK;
  }
  bool *done = copies && a->list_n > 0 ? calloc((size_t)a->list_n, sizeof(bool)) : NULL;
  for (int g = 0; g < a->list_n; g++) {
    const kiln__view *v = &a->list[(size_t)g * (size_t)w];
    kiln__kargs k = {0};
    k.op = KILN__K_ADAM;
    k.n_in = on_dev ? 2 : 1;
    k.in[0] = v[0];
    if (on_dev) k.in[1] = v[ws - 1];
    k.n_out = ams ? 4 : 3;
    for (int o = 0; o < k.n_out; o++) k.out[o] = v[1 + o];
    memcpy(k.s, a->s, sizeof k.s);
    k.i[0] = a->list_i ? a->list_i[g] : 1;
    k.i[1] = a->i[1] & ~(int64_t)(8 | 16); /* the flag was read above; the copy is ours */
    k.i[2] = a->i[2];
    /* an f32 parameter's bf16 copy: written with the update (cpu_adam) */
    const kiln__view *cp = &v[w - 1];
    uint16_t *copy = NULL;
    if (copies && cp->data && cp->dtype == KILN_BF16 && v[1].dtype == KILN_F32 && kiln__view_is_contiguous(cp) &&
        kiln__view_numel(cp) == kiln__view_numel(&v[1]) && kiln__view_is_contiguous(&v[1]))
      copy = cp->data;
    kiln_status st = cpu_adam(&k, copy);
    if (st != KILN_OK) {
      free(done);
      return st;
    }
    if (done) done[g] = copy != NULL;
  }
  if (copies) {
    kiln_status st = write_copies(a, w, done);
    if (st != KILN_OK) {
      free(done);
      return st;
    }
  }
  free(done);
  if (on_dev)
    for (int g = 0; g < a->list_n; g++) *(double *)a->list[(size_t)g * (size_t)w + (size_t)(ws - 1)].data += 1.0;
  return KILN_OK;
}

/* AMP_UNSCALE: g *= inv_scale in place over every view of the list, and the found-inf
** flag (out0, f32) set when any product is not finite (an inf or NaN gradient stays one
** after the multiplication, so the check reads the products). 16-bit grads are computed
** in f32 and rounded back, as the elementwise kernels do. */
kiln_status kiln__cpu_amp_unscale(const kiln__kargs *a) {
  if (a->list_w != 1 || a->n_out < 1 || a->out[0].dtype != KILN_F32)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln amp_unscale kernel: expected a list of width 1 and an f32 flag");
  /* with n_in 1 the multiplier lives on the device (the scaler's 1/scale tensor) */
  const double inv = a->n_in >= 1 ? (double)*(const float *)a->in[0].data : a->s[0];
  bool bad = false;
  for (int g = 0; g < a->list_n; g++) {
    const kiln__view *v = &a->list[g];
    if (!kiln__view_is_contiguous(v))
      return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln amp_unscale kernel: tensor %d is not contiguous", g);
    int64_t n = kiln__view_numel(v);
    switch (v->dtype) {
    case KILN_F32: {
      float *p = v->data, s = (float)inv;
      for (int64_t k = 0; k < n; k++) {
        p[k] *= s;
        bad |= !isfinite(p[k]);
      }
      break;
    }
    case KILN_F64: {
      double *p = v->data;
      for (int64_t k = 0; k < n; k++) {
        p[k] *= inv;
        bad |= !isfinite(p[k]);
      }
      break;
    }
    case KILN_F16: {
      uint16_t *p = v->data;
      for (int64_t k = 0; k < n; k++) {
        float x = kiln_f16_to_f32(p[k]) * (float)inv;
        p[k] = kiln_f32_to_f16(x);
        bad |= !isfinite(x);
      }
      break;
    }
    case KILN_BF16: {
      uint16_t *p = v->data;
      for (int64_t k = 0; k < n; k++) {
        float x = kiln_bf16_to_f32(p[k]) * (float)inv;
        p[k] = kiln_f32_to_bf16(x);
        bad |= !isfinite(x);
      }
      break;
    }
    default:
      return kiln_set_error(KILN_ERR_DTYPE, "kiln amp_unscale kernel: tensor %d is %s, not floating", g,
                            kiln_dtype_name(v->dtype));
    }
  }
  if (bad) *(float *)a->out[0].data = 1.0f;
  return KILN_OK;
}

/* AMP_UPDATE_SCALE: PyTorch's _amp_update_scale_ (aten/src/ATen/native/cuda/AmpKernels.cu)
** on one element, the scale's arithmetic in f32 as there. */
kiln_status kiln__cpu_amp_update_scale(const kiln__kargs *a) {
  if (a->n_in < 1 || a->n_out < 2 || a->in[0].dtype != KILN_F32 || a->out[0].dtype != KILN_F32 ||
      (a->out[1].dtype != KILN_F32 && a->out[1].dtype != KILN_F64))
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln amp_update_scale kernel: expected f32 found_inf and scale, "
                                             "an f32/f64 tracker");
  float *scale = a->out[0].data;
  const float found = *(const float *)a->in[0].data;
  double tracker = a->out[1].dtype == KILN_F64 ? *(double *)a->out[1].data : (double)*(float *)a->out[1].data;
  if (found != 0.0f) {
    *scale = *scale * (float)a->s[1];
    tracker = 0;
  } else {
    double t = tracker + 1;
    if (t == (double)a->i[0]) {
      float grown = *scale * (float)a->s[0];
      if (isfinite(grown)) *scale = grown;
      tracker = 0;
    } else {
      tracker = t;
    }
  }
  if (a->out[1].dtype == KILN_F64) *(double *)a->out[1].data = tracker;
  else *(float *)a->out[1].data = (float)tracker;
  return KILN_OK;
}

/* ---- SGD_MULTI: torch.optim.SGD over a list of tensors ----
** The composed rule (src/optim/sgd.c: neg, axpy, clone, mul_scalar_, axpy_ per
** parameter) to the bit, in one pass: each of those ops rounds its result to the tensor's
** dtype, so the pass rounds there too (RND: nothing for f32/f64; f16/bf16 round to
** nearest even, as a store would); every scalar is rounded once to the compute type from
** the host's double, as an op's kernel does with its own; axpy is one FMA (the elementwise
** kernel's fmaf/fma); mul_scalar_ is AFFINE's `v * s + 0`, whose `+ 0` turns -0 into +0
** (written out below, so the FMA build cannot contract it differently). Per element:
**   g = grad (negated when maximize);  g = fma(p, wd, g)      (weight decay)
**   momentum: b = g on its first step, else b = fma(g, 1 - dampening, b * mu)
**             g = nesterov ? fma(b, mu, g) : b
**   p = fma(g, -lr, p) */
typedef struct sgd_job {
  void *p, *b;
  const void *g;
  double wd, mu, omd, nlr;
  bool maximize, momentum, nesterov, first;
} sgd_job;

/* One loop per combination of the flags (literal after inlining, so each is a straight
** loop the compiler vectorises; a branch on them inside the loop kept it scalar: 25% slower
** than the composed ops on ResNet-50's parameters). maximize is a multiplication by -1,
** which is negation exactly. */
#define SGD_RANGE(NAME, ATTR, T, LOAD, STORE, RND, CT, KFMA)                                 \
  static inline __attribute__((always_inline)) void NAME##_loop(                           \
      const sgd_job *j, int64_t lo, int64_t hi, const bool l2, const bool mom, const bool first, \
      const bool nest) {                                                                    \
    T *restrict p = j->p, *restrict b = j->b;                                               \
    const T *restrict g = j->g;                                                             \
    const CT wd = (CT)j->wd, mu = (CT)j->mu, omd = (CT)j->omd, nlr = (CT)j->nlr;            \
    const CT sgn = j->maximize ? (CT)-1 : (CT)1;                                            \
    for (int64_t i = lo; i < hi; i++) {                                                     \
      CT pi = LOAD(p[i]), gi = LOAD(g[i]) * sgn;                                            \
      if (l2) gi = RND(KFMA(pi, wd, gi));                                                   \
      if (mom) {                                                                            \
        CT bi = gi;                                                                         \
        if (!first) {                                                                       \
          CT t = LOAD(b[i]) * mu;                                                           \
          t = RND(t == 0 ? (CT)0 : t);                                                      \
          bi = RND(KFMA(gi, omd, t));                                                       \
        }                                                                                   \
        STORE(b[i], bi);                                                                    \
        gi = nest ? RND(KFMA(bi, mu, gi)) : bi;                                             \
      }                                                                                     \
      STORE(p[i], KFMA(gi, nlr, pi));                                                       \
    }                                                                                       \
  }                                                                                         \
  static ATTR void NAME(void *ctx, int64_t lo, int64_t hi) {                                \
    const sgd_job *j = (const sgd_job *)ctx;                                                \
    const int f = (j->wd != 0 ? 1 : 0) | (j->momentum ? 2 : 0) | (j->first ? 4 : 0) |      \
                  (j->nesterov ? 8 : 0);                                                    \
    switch (f & (j->momentum ? 15 : 1)) { /* first and nesterov only with a momentum */     \
    case 0: NAME##_loop(j, lo, hi, 0, 0, 0, 0); break;                                      \
    case 1: NAME##_loop(j, lo, hi, 1, 0, 0, 0); break;                                      \
    case 2: NAME##_loop(j, lo, hi, 0, 1, 0, 0); break;                                      \
    case 3: NAME##_loop(j, lo, hi, 1, 1, 0, 0); break;                                      \
    case 6: NAME##_loop(j, lo, hi, 0, 1, 1, 0); break;                                      \
    case 7: NAME##_loop(j, lo, hi, 1, 1, 1, 0); break;                                      \
    case 10: NAME##_loop(j, lo, hi, 0, 1, 0, 1); break;                                     \
    case 11: NAME##_loop(j, lo, hi, 1, 1, 0, 1); break;                                     \
    case 14: NAME##_loop(j, lo, hi, 0, 1, 1, 1); break;                                     \
    default: NAME##_loop(j, lo, hi, 1, 1, 1, 1); break;                                     \
    }                                                                                       \
  }
#define SGD_FNS(SUF, T, LOAD, STORE, RND, CT, KFMA)                                          \
  SGD_RANGE(sgd_##SUF##_fma, KILN__CPU_FMA, T, LOAD, STORE, RND, CT, KFMA)                   \
  SGD_RANGE(sgd_##SUF##_plain, , T, LOAD, STORE, RND, CT, KFMA)
#define RND_F16(x) kiln__f16_to_f32(kiln__f32_to_f16(x))
#define RND_BF16(x) kiln__bf16_to_f32(kiln__f32_to_bf16(x))
SGD_FNS(f32, float, ID, SET, ID, float, fmaf)
SGD_FNS(f64, double, ID, SET, ID, double, fma)
SGD_FNS(f16, uint16_t, LD_F16, ST_F16, RND_F16, float, fmaf)
SGD_FNS(bf16, uint16_t, LD_BF16, ST_BF16, RND_BF16, float, fmaf)

kiln_status kiln__cpu_sgd_multi(const kiln__kargs *a) {
  const int w = kiln__sgd_list_width(a);
  if (w < 0) return kiln_last_error();
  const bool on_dev = (a->i[1] & 4) != 0, mom = (a->i[1] & 16) != 0, copies = (a->i[1] & 32) != 0;
  const int ws = w - (copies ? 1 : 0); /* step_t is the last view before the copy */
  /* flag 8: in0 is the found-inf flag; set, the step is skipped and no step_t advances */
  if (a->i[1] & 8) {
    if (a->n_in < 1 || a->in[0].dtype != KILN_F32)
      return kiln_set_error(KILN_ERR_INTERNAL, "kiln sgd_multi kernel: flag 8 needs an f32 found_inf as in0");
    if (*(const float *)a->in[0].data != 0.0f) return copies ? write_copies(a, w, NULL) : KILN_OK;
  }
  const bool fma_cpu = kiln__cpu_has_fma();
  for (int gi = 0; gi < a->list_n; gi++) {
    const kiln__view *v = &a->list[(size_t)gi * (size_t)w];
    const kiln_dtype dt = v[1].dtype;
    const int64_t n = kiln__view_numel(&v[1]);
    for (int k = 0; k < 2 + (mom ? 1 : 0); k++)
      if (v[k].dtype != dt || !kiln__view_is_contiguous(&v[k]) || kiln__view_numel(&v[k]) != n)
        return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                              "kiln sgd_multi kernel: tensor %d of group %d must be contiguous %s of %lld elements",
                              k, gi, kiln_dtype_name(dt), (long long)n);
    sgd_job j;
    j.g = v[0].data;
    j.p = v[1].data;
    j.b = mom ? v[2].data : NULL;
    j.nlr = -a->s[0];
    j.mu = a->s[1];
    j.omd = 1.0 - a->s[2];
    j.wd = a->s[3];
    j.nesterov = (a->i[1] & 1) != 0;
    j.maximize = (a->i[1] & 2) != 0;
    j.momentum = mom;
    /* the first step takes the gradient as the buffer: the device count says when, or
    ** the host's mark */
    j.first = on_dev ? *(const double *)v[ws - 1].data == 0.0 : (a->list_i && a->list_i[gi] != 0);
    kiln__cpu_range_fn fn;
    switch (dt) {
    case KILN_F32: fn = fma_cpu ? sgd_f32_fma : sgd_f32_plain; break;
    case KILN_F64: fn = fma_cpu ? sgd_f64_fma : sgd_f64_plain; break;
    case KILN_F16: fn = fma_cpu ? sgd_f16_fma : sgd_f16_plain; break;
    case KILN_BF16: fn = fma_cpu ? sgd_bf16_fma : sgd_bf16_plain; break;
    default:
      return kiln_set_error(KILN_ERR_DTYPE, "kiln sgd_multi kernel: expected a floating dtype, got %s", kiln_dtype_name(dt));
    }
    kiln__cpu_parallel_for(n, ADAM_PAR_MIN, fn, &j);
  }
  if (copies) {
    kiln_status st = write_copies(a, w, NULL);
    if (st != KILN_OK) return st;
  }
  if (on_dev)
    for (int g = 0; g < a->list_n; g++) *(double *)a->list[(size_t)g * (size_t)w + (size_t)(ws - 1)].data += 1.0;
  return KILN_OK;
}
