/*
** Fused optimizer kernels on CUDA: Adam/AdamW in one pass over param, grad and state
** (PyTorch's single-tensor formulas, as the CPU kernel in cpu_optim.c). One launch per
** parameter; vectorised through a grid-stride loop.
*/
#include "cuda_int.cuh"

#include <math.h>
#include <string.h>

struct kc_adam_hp {
  float lr, b1, b2, eps, wd, step_size, bc2_sqrt;
  int decoupled, amsgrad;
};

template <class T, class C>
__global__ void kc_adam_kernel(T *__restrict__ p, const T *__restrict__ g, T *__restrict__ m,
                               T *__restrict__ v, T *__restrict__ vmax, int64_t n, kc_adam_hp hp,
                               double lr_d, double wd_d, double ss_d, double bc2s_d,
                               const double *__restrict__ step_dev) {
  /* C is the compute type: float for f32/f16/bf16, double for f64 (hyper-parameters are
  ** passed both ways so f64 keeps full precision). */
  if (step_dev) { /* capturable: the step count lives on the device (graph replays) */
    double t = *step_dev + 1.0;
    ss_d = lr_d / (1.0 - pow((double)hp.b1, t));
    bc2s_d = sqrt(1.0 - pow((double)hp.b2, t));
    hp.step_size = (float)ss_d;
    hp.bc2_sqrt = (float)bc2s_d;
  }
  const C lr = sizeof(C) == 8 ? (C)lr_d : (C)hp.lr;
  const C wd = sizeof(C) == 8 ? (C)wd_d : (C)hp.wd;
  const C ss = sizeof(C) == 8 ? (C)ss_d : (C)hp.step_size;
  const C bc2s = sizeof(C) == 8 ? (C)bc2s_d : (C)hp.bc2_sqrt;
  const C b1 = (C)hp.b1, b2 = (C)hp.b2, eps = (C)hp.eps;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    C pi = (C)kc_ld(p[i]), gi = (C)kc_ld(g[i]);
    if (hp.decoupled)
      pi = pi * ((C)1 - lr * wd);
    else if (wd != (C)0)
      gi = gi + wd * pi;
    C mi = (C)kc_ld(m[i]) * b1 + gi * ((C)1 - b1);
    C vi = (C)kc_ld(v[i]) * b2 + gi * gi * ((C)1 - b2);
    C den;
    if (hp.amsgrad) {
      C vm = (C)kc_ld(vmax[i]);
      vm = vi > vm ? vi : vm;
      vmax[i] = kc_st<T>(vm);
      den = sqrt(vm) / bc2s + eps;
    } else {
      den = sqrt(vi) / bc2s + eps;
    }
    pi = pi - ss * (mi / den);
    m[i] = kc_st<T>(mi);
    v[i] = kc_st<T>(vi);
    p[i] = kc_st<T>(pi);
  }
}

extern "C" kiln_status kiln__cuda_adam(const kiln__kargs *a) {
  kiln__cuda_dev *dev;
  KC_TRY(kiln__cuda_ctx(a->device, &dev));
  kiln_dtype dt = a->out[0].dtype;
  int64_t n = kc_numel(&a->out[0]);
  if (n == 0) return KILN_OK;
  double wd;
  memcpy(&wd, &a->i[2], sizeof wd);
  int64_t step = a->i[0] > 0 ? a->i[0] : 1;
  double bc1 = 1.0 - pow(a->s[1], (double)step), bc2 = 1.0 - pow(a->s[2], (double)step);
  kc_adam_hp hp;
  hp.lr = (float)a->s[0];
  hp.b1 = (float)a->s[1];
  hp.b2 = (float)a->s[2];
  hp.eps = (float)a->s[3];
  hp.wd = (float)wd;
  hp.step_size = (float)(a->s[0] / bc1);
  hp.bc2_sqrt = (float)sqrt(bc2);
  hp.decoupled = (a->i[1] & 1) != 0;
  hp.amsgrad = (a->i[1] & 2) != 0 && a->n_out > 3;
  int threads = KC_THREADS;
  int64_t blocks = (n + threads - 1) / threads;
  int64_t cap = (int64_t)dev->sm_count * 8;
  if (blocks > cap) blocks = cap > 0 ? cap : 1;
  void *vmax = hp.amsgrad ? a->out[3].data : NULL;
  const double *step_dev = ((a->i[1] & 4) && a->n_in > 1) ? (const double *)a->in[1].data : NULL;
  KC_SWITCH_FLOAT(dt, T,
                  return kiln_set_error(KILN_ERR_DTYPE, "kiln adam kernel (cuda): %s is not a floating dtype", kiln_dtype_name(dt)),
                  {
                    typedef typename kc_traits<T>::acc C;
                    kc_adam_kernel<T, C><<<(unsigned)blocks, threads, 0, dev->stream>>>(
                        (T *)a->out[0].data, (const T *)a->in[0].data, (T *)a->out[1].data,
                        (T *)a->out[2].data, (T *)vmax, n, hp, a->s[0], wd, a->s[0] / bc1, sqrt(bc2), step_dev);
                  })
  return kiln__cuda_launched("adam");
}

extern "C" bool kiln__cuda_adam_supports(const kiln__kargs *a) {
  if (!kc_is_float(a->out[0].dtype) || a->in[0].dtype != a->out[0].dtype) return false;
  for (int k = 0; k < a->n_out; k++)
    if (a->out[k].dtype != a->out[0].dtype || kc_numel(&a->out[k]) != kc_numel(&a->out[0])) return false;
  return true; /* the op layer guarantees contiguous views */
}
