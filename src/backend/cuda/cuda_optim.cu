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

/* One element's update (PyTorch's single-tensor formulas), in the compute type C; ss is
** lr / (1 - b1^t), bc2s sqrt(1 - b2^t). Shared by the one-tensor and the list kernels. */
template <class T, class C>
__device__ __forceinline__ void kc_adam_elem(T *__restrict__ p, const T *__restrict__ g,
                                             T *__restrict__ m, T *__restrict__ v,
                                             T *__restrict__ vmax, int64_t i, C lr, C wd, C ss,
                                             C bc2s, C b1, C b2, C eps, bool decoupled,
                                             bool amsgrad) {
  C pi = (C)kc_ld(p[i]), gi = (C)kc_ld(g[i]);
  if (decoupled)
    pi = pi * ((C)1 - lr * wd);
  else if (wd != (C)0)
    gi = gi + wd * pi;
  C mi = (C)kc_ld(m[i]) * b1 + gi * ((C)1 - b1);
  C vi = (C)kc_ld(v[i]) * b2 + gi * gi * ((C)1 - b2);
  C den;
  if (amsgrad) {
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
       i += (int64_t)gridDim.x * blockDim.x)
    kc_adam_elem<T, C>(p, g, m, v, vmax, i, lr, wd, ss, bc2s, b1, b2, eps, hp.decoupled, hp.amsgrad);
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

/* ---- ADAM_MULTI: up to KC_MT_MAX tensors per launch (PyTorch's multi_tensor_apply idea):
** the tensors' pointers travel in the kernel's parameters, each block finds its tensor
** from the running block counts and updates one chunk of it, an element a thread (a small
** model's update is the latency of one round of loads: four elements a thread in turn
** took 4.9 us for seed-mlp's 8578 parameters). Capturable steps are read by every block
** and advanced by the last block to finish (a counter in device memory), so a captured
** step stays one kernel. */
#define KC_MT_MAX 32
#define KC_MT_CHUNK KC_THREADS

/* Blocks of the current ADAM_MULTI launch that are done: kiln queues its launches on one
** stream per device, so one launch at a time uses it; the last block resets it. */
__device__ unsigned int kc_adam_blocks_done;

struct kc_adam_list {
  int n;
  void *p[KC_MT_MAX], *m[KC_MT_MAX], *v[KC_MT_MAX], *vmax[KC_MT_MAX];
  const void *g[KC_MT_MAX];
  double *step_t[KC_MT_MAX];
  int64_t numel[KC_MT_MAX];
  double ss[KC_MT_MAX], bc2s[KC_MT_MAX]; /* lr / (1 - b1^t) and sqrt(1 - b2^t), host steps */
  int block_end[KC_MT_MAX]; /* blocks of tensors 0..i together */
  int any_step;             /* some step_t is set: the last block advances them */
};

struct kc_adam_hpd {
  double lr, b1, b2, eps, wd;
  int decoupled, amsgrad;
};

template <class T, class C>
__global__ void __launch_bounds__(KC_THREADS) kc_adam_multi_kernel(kc_adam_list L, kc_adam_hpd h) {
  int t = 0;
  while (t < L.n - 1 && (int)blockIdx.x >= L.block_end[t]) t++;
  const int first = t ? L.block_end[t - 1] : 0;
  const int64_t n = L.numel[t];
  const int64_t lo = (int64_t)((int)blockIdx.x - first) * KC_MT_CHUNK;
  const int64_t hi = lo + KC_MT_CHUNK < n ? lo + KC_MT_CHUNK : n;
  __shared__ double corr[2]; /* a device step: the block's corrections, worked out once */
  if (L.step_t[t]) {
    if (threadIdx.x == 0) {
      const double step = *L.step_t[t] + 1.0;
      corr[0] = h.lr / (1.0 - pow(h.b1, step));
      corr[1] = sqrt(1.0 - pow(h.b2, step));
    }
    __syncthreads();
  }
  const double ss_d = L.step_t[t] ? corr[0] : L.ss[t], bc2s_d = L.step_t[t] ? corr[1] : L.bc2s[t];
  const C lr = (C)h.lr, wd = (C)h.wd, ss = (C)ss_d, bc2s = (C)bc2s_d;
  const C b1 = (C)h.b1, b2 = (C)h.b2, eps = (C)h.eps;
  T *__restrict__ p = (T *)L.p[t];
  const T *__restrict__ g = (const T *)L.g[t];
  T *__restrict__ m = (T *)L.m[t];
  T *__restrict__ v = (T *)L.v[t];
  T *__restrict__ vmax = (T *)L.vmax[t];
  for (int64_t i = lo + threadIdx.x; i < hi; i += KC_THREADS)
    kc_adam_elem<T, C>(p, g, m, v, vmax, i, lr, wd, ss, bc2s, b1, b2, eps, h.decoupled, h.amsgrad);
  if (!L.any_step) return;
  /* every block has read its step before it counts itself done: the last one advances them */
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&kc_adam_blocks_done, 1u) == gridDim.x - 1) {
      for (int k = 0; k < L.n; k++)
        if (L.step_t[k]) *L.step_t[k] += 1.0;
      kc_adam_blocks_done = 0;
      __threadfence();
    }
  }
}

extern "C" kiln_status kiln__cuda_adam_multi(const kiln__kargs *a) {
  kiln__cuda_dev *dev;
  KC_TRY(kiln__cuda_ctx(a->device, &dev));
  const bool ams = (a->i[1] & 2) != 0, on_dev = (a->i[1] & 4) != 0;
  const int w = kiln__adam_list_width(a);
  if (w < 0) return kiln_last_error();
  if (a->list_n == 0) return KILN_OK;
  kc_adam_hpd h;
  h.lr = a->s[0];
  h.b1 = a->s[1];
  h.b2 = a->s[2];
  h.eps = a->s[3];
  memcpy(&h.wd, &a->i[2], sizeof h.wd);
  h.decoupled = (a->i[1] & 1) != 0;
  h.amsgrad = ams;
  const kiln_dtype dt = a->list[1].dtype;
  for (int g0 = 0; g0 < a->list_n;) {
    kc_adam_list L;
    memset(&L, 0, sizeof L);
    int blocks = 0;
    for (int k = 0; k < KC_MT_MAX && g0 + k < a->list_n; k++) {
      const kiln__view *v = &a->list[(size_t)(g0 + k) * (size_t)w];
      int64_t n = kc_numel(&v[1]);
      int64_t nb = (n + KC_MT_CHUNK - 1) / KC_MT_CHUNK;
      if (v[1].dtype != dt || nb > INT32_MAX - blocks) {
        if (v[1].dtype != dt)
          return kiln_set_error(KILN_ERR_DTYPE, "kiln adam_multi kernel (cuda): tensor %d is %s, the list is %s",
                                g0 + k, kiln_dtype_name(v[1].dtype), kiln_dtype_name(dt));
        break; /* this launch is full; the next takes the rest */
      }
      L.g[k] = v[0].data;
      L.p[k] = v[1].data;
      L.m[k] = v[2].data;
      L.v[k] = v[3].data;
      L.vmax[k] = ams ? v[4].data : NULL;
      L.step_t[k] = on_dev ? (double *)v[w - 1].data : NULL;
      L.numel[k] = n;
      const double step = (double)(a->list_i && a->list_i[g0 + k] > 0 ? a->list_i[g0 + k] : 1);
      L.ss[k] = h.lr / (1.0 - pow(h.b1, step));
      L.bc2s[k] = sqrt(1.0 - pow(h.b2, step));
      blocks += (int)nb;
      L.block_end[k] = blocks;
      L.n = k + 1;
    }
    if (L.n == 0) return kiln_set_error(KILN_ERR_SHAPE, "kiln adam_multi kernel (cuda): a tensor is too large for one launch");
    L.any_step = on_dev;
    if (blocks == 0 && on_dev) blocks = 1; /* only empty tensors: one block advances the steps */
    if (blocks > 0) {
      KC_SWITCH_FLOAT(dt, T,
                      return kiln_set_error(KILN_ERR_DTYPE, "kiln adam_multi kernel (cuda): %s is not a floating dtype", kiln_dtype_name(dt)),
                      {
                        typedef typename kc_traits<T>::acc C;
                        kc_adam_multi_kernel<T, C><<<(unsigned)blocks, KC_THREADS, 0, dev->stream>>>(L, h);
                      })
      KC_TRY(kiln__cuda_launched("adam_multi"));
    }
    g0 += L.n;
  }
  return KILN_OK;
}

extern "C" bool kiln__cuda_adam_multi_supports(const kiln__kargs *a) {
  const int w = a->list_w;
  if (a->list_n < 1 || w < 4 || !a->list) return a->list_n == 0;
  kiln_dtype dt = a->list[1].dtype;
  if (!kc_is_float(dt)) return false;
  const bool on_dev = (a->i[1] & 4) != 0;
  for (int g = 0; g < a->list_n; g++) {
    const kiln__view *v = &a->list[(size_t)g * (size_t)w];
    for (int k = 0; k < w - (on_dev ? 1 : 0); k++)
      if (v[k].dtype != dt || kc_numel(&v[k]) != kc_numel(&v[1])) return false;
  }
  return true;
}
