/*
** Fused optimizer kernels on CUDA: Adam/AdamW in one pass over param, grad and state.
** The element update is the CPU kernel's (cpu_optim.c), which is torch.optim 1.13's
** _single_tensor_adam on PyTorch's CPU, to the bit:
**   Adam:  g = fma(p, wd, g)                 AdamW: p = p * (1 - lr wd)
**   m = fma(g, 1 - b1, m * b1)
**   v = fma((1 - b2) * g, g, v * b2)
**   amsgrad: vmax = max(vmax, v), used for v below
**   p = p + (-(lr / (1 - b1^t)) * m) / (sqrt(v) / sqrt(1 - b2^t) + eps)
** with every scalar worked out in double on the host (as Python does) and rounded once to
** the compute type. Every operation is written with a _rn intrinsic or fma: nvcc would
** otherwise contract other pairs (p * (1 - lr wd) into the final add, for one), and the
** GPU would drift from the CPU and from PyTorch. (PyTorch's own CUDA Adam rounds
** differently again: its addcdiv is a + alpha * (b / c), and tensor / scalar multiplies by
** the reciprocal; kiln keeps one set of numbers on every backend.) Before this, the
** one-tensor kernel passed lr, betas, eps and wd as float and computed 1 - b from the
** rounded betas. One launch per parameter through a grid-stride loop, or ADAM_MULTI below.
*/
#include "cuda_int.cuh"

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <type_traits>

/* Roundings spelled out, so no contraction changes them. */
__device__ __forceinline__ float kc_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double kc_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float kc_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double kc_div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float kc_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double kc_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float kc_sqrt(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double kc_sqrt(double a) { return __dsqrt_rn(a); }
__device__ __forceinline__ float kc_fma(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double kc_fma(double a, double b, double c) { return __fma_rn(a, b, c); }

/* The step's scalars in double (the host's arithmetic, adam.py's order). */
struct kc_adam_hpd {
  double wd, keep, b1, omb1, b2, omb2, eps, lr;
  int decoupled, amsgrad;
};

static kc_adam_hpd kc_adam_scalars(const kiln__kargs *a) {
  kc_adam_hpd h;
  h.lr = a->s[0];
  h.b1 = a->s[1];
  h.b2 = a->s[2];
  h.eps = a->s[3];
  memcpy(&h.wd, &a->i[2], sizeof h.wd);
  h.keep = 1.0 - h.lr * h.wd;
  h.omb1 = 1.0 - h.b1;
  h.omb2 = 1.0 - h.b2;
  h.decoupled = (a->i[1] & 1) != 0;
  h.amsgrad = (a->i[1] & 2) != 0;
  return h;
}

/* The host's bias corrections for step t: -(lr / (1 - b1^t)) and sqrt(1 - b2^t). */
__host__ __device__ static inline void kc_adam_corr(const kc_adam_hpd &h, double t, double *nss,
                                                    double *bc2s) {
  *nss = -(h.lr / (1.0 - pow(h.b1, t)));
  *bc2s = sqrt(1.0 - pow(h.b2, t));
}

/* One element's update in the compute type C, on values: p, m, v (and vm, amsgrad's
** running max) in, updated in place. Shared by every kernel below. */
template <class C>
__device__ __forceinline__ void kc_adam_upd(C &p, C g, C &m, C &v, C &vm, const kc_adam_hpd &h, C nss, C bc2s) {
  if (h.decoupled)
    p = kc_mul(p, (C)h.keep);
  else if (h.wd != 0)
    g = kc_fma(p, (C)h.wd, g);
  m = kc_fma(g, (C)h.omb1, kc_mul(m, (C)h.b1));
  v = kc_fma(kc_mul((C)h.omb2, g), g, kc_mul(v, (C)h.b2));
  C vd = v;
  if (h.amsgrad) {
    vd = (v != v || v > vm) ? v : vm; /* torch.maximum: NaN wins */
    vm = vd;
  }
  C den = kc_add(kc_div(kc_sqrt(vd), bc2s), (C)h.eps);
  p = kc_add(p, kc_div(kc_mul(nss, m), den));
}

/* One element's update in memory. */
template <class T, class C>
__device__ __forceinline__ void kc_adam_elem(T *__restrict__ p, const T *__restrict__ g,
                                             T *__restrict__ m, T *__restrict__ v,
                                             T *__restrict__ vmax, int64_t i, const kc_adam_hpd &h,
                                             C nss, C bc2s) {
  C pi = (C)kc_ld(p[i]), mi = (C)kc_ld(m[i]), vi = (C)kc_ld(v[i]), vm = h.amsgrad ? (C)kc_ld(vmax[i]) : (C)0;
  kc_adam_upd<C>(pi, (C)kc_ld(g[i]), mi, vi, vm, h, nss, bc2s);
  if (h.amsgrad) vmax[i] = kc_st<T>(vm);
  m[i] = kc_st<T>(mi);
  v[i] = kc_st<T>(vi);
  p[i] = kc_st<T>(pi);
}

template <class T, class C>
__global__ void kc_adam_kernel(T *__restrict__ p, const T *__restrict__ g, T *__restrict__ m,
                               T *__restrict__ v, T *__restrict__ vmax, int64_t n, kc_adam_hpd h,
                               double nss_d, double bc2s_d, const double *__restrict__ step_dev,
                               const float *__restrict__ found) {
  if (found && *found != 0.0f) return; /* loss scaling found inf/NaN: the step is skipped */
  if (step_dev) kc_adam_corr(h, *step_dev + 1.0, &nss_d, &bc2s_d); /* capturable: replays */
  const C nss = (C)nss_d, bc2s = (C)bc2s_d;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    kc_adam_elem<T, C>(p, g, m, v, vmax, i, h, nss, bc2s);
}

extern "C" kiln_status kiln__cuda_adam(const kiln__kargs *a) {
  kiln__cuda_dev *dev;
  KC_TRY(kiln__cuda_ctx(a->device, &dev));
  kiln_dtype dt = a->out[0].dtype;
  int64_t n = kc_numel(&a->out[0]);
  if (n == 0) return KILN_OK;
  kc_adam_hpd h = kc_adam_scalars(a);
  h.amsgrad = h.amsgrad && a->n_out > 3;
  int64_t step = a->i[0] > 0 ? a->i[0] : 1;
  double nss, bc2s;
  kc_adam_corr(h, (double)step, &nss, &bc2s);
  int threads = KC_THREADS;
  int64_t blocks = (n + threads - 1) / threads;
  int64_t cap = (int64_t)dev->sm_count * 8;
  if (blocks > cap) blocks = cap > 0 ? cap : 1;
  void *vmax = h.amsgrad ? a->out[3].data : NULL;
  const double *step_dev = ((a->i[1] & 4) && a->n_in > 1) ? (const double *)a->in[1].data : NULL;
  /* flag 8: the found-inf flag is the last input, read by every thread on the device */
  const float *found = ((a->i[1] & 8) && a->n_in > 1) ? (const float *)a->in[a->n_in - 1].data : NULL;
  KC_SWITCH_FLOAT(dt, T,
                  return kiln_set_error(KILN_ERR_DTYPE, "kiln adam kernel (cuda): %s is not a floating dtype", kiln_dtype_name(dt)),
                  {
                    typedef typename kc_traits<T>::acc C;
                    kc_adam_kernel<T, C><<<(unsigned)blocks, threads, 0, dev->stream>>>(
                        (T *)a->out[0].data, (const T *)a->in[0].data, (T *)a->out[1].data,
                        (T *)a->out[2].data, (T *)vmax, n, h, nss, bc2s, step_dev, found);
                  })
  return kiln__cuda_launched("adam");
}

extern "C" bool kiln__cuda_adam_supports(const kiln__kargs *a) {
  if (!kc_is_float(a->out[0].dtype) || a->in[0].dtype != a->out[0].dtype) return false;
  if ((a->i[1] & 8) && (a->n_in < 2 || a->in[a->n_in - 1].dtype != KILN_F32)) return false;
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
** step stays one kernel. With flag 8 every block first reads the found-inf flag and
** leaves when it is set, so a skipped step writes nothing, inside a graph too. */
#define KC_MT_MAX 32
/* Elements a block takes: 8 a thread. At one a thread (the chunk was KC_THREADS) GPT-2's
** 124M parameters made 485k blocks of one round of 4-byte loads each: 2.05 ms a step on
** the H200, 969 GB/s of its 4.8 TB/s. Now f32 lists whose tensors are 16-byte aligned go
** four elements a load (kc_adam_vec4), two loads in flight a thread. */
#define KC_MT_CHUNK (KC_THREADS * 8)

/* Autocast's 16-bit copy of a parameter (ADAM_MULTI flag 16, SGD_MULTI flag 32: the last
** view of a group; none where its data is NULL): element i written from the parameter as
** the cast (COPY, CAST_MULTI) converts it, by the thread that just stored the parameter.
** The op layer gives copies of f32 parameters only, all of one 16-bit dtype a launch. */
template <class T>
__device__ __forceinline__ void kc_copy_store(void *cp, bool bf16, int64_t i, T v) {
  if (bf16) ((__nv_bfloat16 *)cp)[i] = kc_st<__nv_bfloat16>(kc_ld<T>(v));
  else ((__half *)cp)[i] = kc_st<__half>(kc_ld<T>(v));
}

static inline bool kc_aligned(const void *p, uintptr_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

/* Blocks of the current ADAM_MULTI launch that are done: kiln queues its launches on one
** stream per device, so one launch at a time uses it; the last block resets it. */
__device__ unsigned int kc_adam_blocks_done;

struct kc_adam_list {
  int n;
  void *p[KC_MT_MAX], *m[KC_MT_MAX], *v[KC_MT_MAX], *vmax[KC_MT_MAX];
  const void *g[KC_MT_MAX];
  double *step_t[KC_MT_MAX];
  int64_t numel[KC_MT_MAX];
  double nss[KC_MT_MAX], bc2s[KC_MT_MAX]; /* -(lr / (1 - b1^t)) and sqrt(1 - b2^t), host steps */
  int block_end[KC_MT_MAX]; /* blocks of tensors 0..i together */
  int any_step;             /* some step_t is set: the last block advances them */
  void *cp[KC_MT_MAX];      /* 16-bit copies to write (NULL: none) */
  int cp_bf16;              /* their dtype: bf16 (else f16) */
  unsigned char vec[KC_MT_MAX]; /* f32, and p, g, m, v (vmax) 16-byte and cp 8-byte aligned */
};

/* Four f32 elements from i (a multiple of 4) through 16-byte loads and stores, the copy
** through one 8-byte store: the numbers of kc_adam_elem and kc_copy_store, element by
** element (only the memory access is wider). */
__device__ __forceinline__ void kc_adam_vec4(float *__restrict__ pp, const float *__restrict__ gp,
                                             float *__restrict__ mp, float *__restrict__ vp, float *__restrict__ xp,
                                             void *cp, bool bf16, int64_t i, const kc_adam_hpd &h, float nss,
                                             float bc2s) {
  const int64_t q = i / 4;
  float4 p = reinterpret_cast<float4 *>(pp)[q];
  const float4 g = reinterpret_cast<const float4 *>(gp)[q];
  float4 m = reinterpret_cast<float4 *>(mp)[q];
  float4 v = reinterpret_cast<float4 *>(vp)[q];
  float4 x = h.amsgrad ? reinterpret_cast<float4 *>(xp)[q] : make_float4(0.f, 0.f, 0.f, 0.f);
  kc_adam_upd<float>(p.x, g.x, m.x, v.x, x.x, h, nss, bc2s);
  kc_adam_upd<float>(p.y, g.y, m.y, v.y, x.y, h, nss, bc2s);
  kc_adam_upd<float>(p.z, g.z, m.z, v.z, x.z, h, nss, bc2s);
  kc_adam_upd<float>(p.w, g.w, m.w, v.w, x.w, h, nss, bc2s);
  reinterpret_cast<float4 *>(pp)[q] = p;
  reinterpret_cast<float4 *>(mp)[q] = m;
  reinterpret_cast<float4 *>(vp)[q] = v;
  if (h.amsgrad) reinterpret_cast<float4 *>(xp)[q] = x;
  if (cp) {
    uint2 o;
    if (bf16) {
      __nv_bfloat162 a = __floats2bfloat162_rn(p.x, p.y), b = __floats2bfloat162_rn(p.z, p.w);
      o.x = *reinterpret_cast<uint32_t *>(&a), o.y = *reinterpret_cast<uint32_t *>(&b);
    } else {
      __half2 a = __floats2half2_rn(p.x, p.y), b = __floats2half2_rn(p.z, p.w);
      o.x = *reinterpret_cast<uint32_t *>(&a), o.y = *reinterpret_cast<uint32_t *>(&b);
    }
    reinterpret_cast<uint2 *>(cp)[q] = o;
  }
}

template <class T, class C>
__global__ void __launch_bounds__(KC_THREADS) kc_adam_multi_kernel(kc_adam_list L, kc_adam_hpd h,
                                                                   const float *__restrict__ found) {
  int t = 0;
  while (t < L.n - 1 && (int)blockIdx.x >= L.block_end[t]) t++;
  const int first = t ? L.block_end[t - 1] : 0;
  const int64_t n = L.numel[t];
  const int64_t lo = (int64_t)((int)blockIdx.x - first) * KC_MT_CHUNK;
  const int64_t hi = lo + KC_MT_CHUNK < n ? lo + KC_MT_CHUNK : n;
  void *const cp = L.cp[t];
  /* a found inf/NaN skips the whole step: every block leaves before counting itself, so
  ** the done counter stays 0 and no step_t advances (PyTorch's skipped step); a copy is
  ** still written, from the parameter as it stays, so it is valid either way */
  if (found && *found != 0.0f) {
    if (cp)
      for (int64_t i = lo + threadIdx.x; i < hi; i += KC_THREADS) kc_copy_store<T>(cp, L.cp_bf16, i, ((T *)L.p[t])[i]);
    return;
  }
  __shared__ double corr[2]; /* a device step: the block's corrections, worked out once */
  if (L.step_t[t]) {
    if (threadIdx.x == 0) {
      kc_adam_corr(h, *L.step_t[t] + 1.0, &corr[0], &corr[1]);
    }
    __syncthreads();
  }
  const C nss = (C)(L.step_t[t] ? corr[0] : L.nss[t]), bc2s = (C)(L.step_t[t] ? corr[1] : L.bc2s[t]);
  T *__restrict__ p = (T *)L.p[t];
  const T *__restrict__ g = (const T *)L.g[t];
  T *__restrict__ m = (T *)L.m[t];
  T *__restrict__ v = (T *)L.v[t];
  T *__restrict__ vmax = (T *)L.vmax[t];
  int64_t i0 = lo; /* where the scalar loop starts */
  if (std::is_same<T, float>::value && L.vec[t]) {
    /* lo is a multiple of 4 (KC_MT_CHUNK is): whole groups of four, then the tail */
    const int64_t h4 = lo + ((hi - lo) & ~(int64_t)3);
    for (int64_t i = lo + 4 * (int64_t)threadIdx.x; i < h4; i += 4 * KC_THREADS)
      kc_adam_vec4((float *)p, (const float *)g, (float *)m, (float *)v, (float *)vmax, cp, L.cp_bf16 != 0, i, h,
                   (float)nss, (float)bc2s);
    i0 = h4;
  }
  for (int64_t i = i0 + threadIdx.x; i < hi; i += KC_THREADS) {
    kc_adam_elem<T, C>(p, g, m, v, vmax, i, h, nss, bc2s);
    if (cp) kc_copy_store<T>(cp, L.cp_bf16, i, p[i]);
  }
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
  const bool ams = (a->i[1] & 2) != 0, on_dev = (a->i[1] & 4) != 0, copies = (a->i[1] & 16) != 0;
  const int w = kiln__adam_list_width(a);
  if (w < 0) return kiln_last_error();
  if (a->list_n == 0) return KILN_OK;
  const int ws = w - (copies ? 1 : 0); /* step_t is the last view before the copy */
  kc_adam_hpd h = kc_adam_scalars(a);
  const kiln_dtype dt = a->list[1].dtype;
  const float *found = (a->i[1] & 8) ? (const float *)a->in[0].data : NULL;
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
      L.step_t[k] = on_dev ? (double *)v[ws - 1].data : NULL;
      L.cp[k] = copies ? v[w - 1].data : NULL;
      if (L.cp[k]) L.cp_bf16 = v[w - 1].dtype == KILN_BF16;
      L.numel[k] = n;
      {
        bool al = dt == KILN_F32 && kc_aligned(L.p[k], 16) && kc_aligned(L.g[k], 16) && kc_aligned(L.m[k], 16) &&
                  kc_aligned(L.v[k], 16) && (!ams || kc_aligned(L.vmax[k], 16)) && (!L.cp[k] || kc_aligned(L.cp[k], 8));
        L.vec[k] = (unsigned char)al;
      }
      const double step = (double)(a->list_i && a->list_i[g0 + k] > 0 ? a->list_i[g0 + k] : 1);
      kc_adam_corr(h, step, &L.nss[k], &L.bc2s[k]);
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
                        kc_adam_multi_kernel<T, C><<<(unsigned)blocks, KC_THREADS, 0, dev->stream>>>(L, h, found);
                      })
      KC_TRY(kiln__cuda_launched("adam_multi"));
    }
    g0 += L.n;
  }
  return KILN_OK;
}

/* The copy column's views (the last of each group): none, or f32 parameters' copies of
** one 16-bit dtype with the parameter's element count. */
static bool kc_copies_ok(const kiln__kargs *a, int w) {
  int cdt = -1;
  for (int g = 0; g < a->list_n; g++) {
    const kiln__view *v = &a->list[(size_t)g * (size_t)w];
    const kiln__view *c = &v[w - 1];
    if (!c->data) continue;
    if (v[1].dtype != KILN_F32 || (c->dtype != KILN_BF16 && c->dtype != KILN_F16) || (cdt >= 0 && (int)c->dtype != cdt) ||
        kc_numel(c) != kc_numel(&v[1]))
      return false;
    cdt = (int)c->dtype;
  }
  return true;
}

extern "C" bool kiln__cuda_adam_multi_supports(const kiln__kargs *a) {
  const int w = a->list_w;
  if (a->list_n < 1 || w < 4 || !a->list) return a->list_n == 0;
  kiln_dtype dt = a->list[1].dtype;
  if (!kc_is_float(dt)) return false;
  const bool on_dev = (a->i[1] & 4) != 0, copies = (a->i[1] & 16) != 0;
  if ((a->i[1] & 8) && (a->n_in < 1 || a->in[0].dtype != KILN_F32 || kc_numel(&a->in[0]) != 1)) return false;
  if (copies && !kc_copies_ok(a, w)) return false;
  for (int g = 0; g < a->list_n; g++) {
    const kiln__view *v = &a->list[(size_t)g * (size_t)w];
    for (int k = 0; k < w - (on_dev ? 1 : 0) - (copies ? 1 : 0); k++)
      if (v[k].dtype != dt || kc_numel(&v[k]) != kc_numel(&v[1])) return false;
  }
  return true;
}

/* ---- SGD_MULTI: torch.optim.SGD over up to KC_SGD_MAX tensors per launch, the blocks laid
** out as ADAM_MULTI's (a chunk of one tensor each, found from the running block counts).
** The element update is the CPU kernel's (cpu_optim.c), itself the composed rule's ops
** (neg, axpy, mul_scalar_, axpy_) with their roundings: the result rounded to the dtype
** after each op (kc_sgd_rnd; nothing for f32/f64), every product and FMA spelled out so
** that nvcc contracts nothing else, and mul_scalar_'s `v * mu + 0` (-0 becomes +0). With
** a device step (flag 4) every block reads its tensor's step_t (0: the buffer takes the
** gradient) and the last block to finish advances them all, as ADAM_MULTI does; a set
** found-inf flag makes every block leave first, so a skipped step writes nothing. 48
** tensors a launch keep the parameter block near 2.3 KB (under the 4 KB of kernel
** parameters every CUDA version takes): ResNet-50's 161 parameters in 4 launches, where
** the composed rule made 1,288. */
#define KC_SGD_MAX 48

__device__ unsigned int kc_sgd_blocks_done;

struct kc_sgd_hp {
  double nlr, mu, omd, wd; /* -lr, momentum, 1 - dampening, weight decay (host doubles) */
  int nesterov, maximize;
};

struct kc_sgd_list {
  int n;
  void *p[KC_SGD_MAX], *b[KC_SGD_MAX];
  const void *g[KC_SGD_MAX];
  double *step_t[KC_SGD_MAX];
  int64_t numel[KC_SGD_MAX];
  int block_end[KC_SGD_MAX];        /* blocks of tensors 0..i together */
  unsigned char first[KC_SGD_MAX];  /* host steps: the buffer is new this step */
  int any_step;
  void *cp[KC_SGD_MAX]; /* 16-bit copies to write (NULL: none) */
  int cp_bf16;          /* their dtype: bf16 (else f16) */
};

/* x rounded to T and back (what storing an op's result in a T tensor does). */
template <class T, class C> __device__ __forceinline__ C kc_sgd_rnd(C x) { return (C)kc_ld<T>(kc_st<T>(x)); }

template <class T, class C>
__device__ __forceinline__ void kc_sgd_elem(T *__restrict__ p, const T *__restrict__ g, T *__restrict__ b,
                                            int64_t i, const kc_sgd_hp &h, bool first) {
  C pi = (C)kc_ld(p[i]), gi = (C)kc_ld(g[i]);
  if (h.maximize) gi = -gi;
  if (h.wd != 0) gi = kc_sgd_rnd<T, C>(kc_fma(pi, (C)h.wd, gi));
  if (b) {
    C bi = gi;
    if (!first) {
      C t = kc_mul((C)kc_ld(b[i]), (C)h.mu);
      t = kc_sgd_rnd<T, C>(t == (C)0 ? (C)0 : t);
      bi = kc_sgd_rnd<T, C>(kc_fma(gi, (C)h.omd, t));
    }
    b[i] = kc_st<T>(bi);
    if (h.nesterov) gi = kc_sgd_rnd<T, C>(kc_fma(bi, (C)h.mu, gi));
    else gi = bi;
  }
  p[i] = kc_st<T>(kc_fma(gi, (C)h.nlr, pi));
}

template <class T, class C>
__global__ void __launch_bounds__(KC_THREADS) kc_sgd_multi_kernel(kc_sgd_list L, kc_sgd_hp h,
                                                                  const float *__restrict__ found) {
  int t = 0;
  while (t < L.n - 1 && (int)blockIdx.x >= L.block_end[t]) t++;
  const int first_block = t ? L.block_end[t - 1] : 0;
  const int64_t n = L.numel[t];
  const int64_t lo = (int64_t)((int)blockIdx.x - first_block) * KC_MT_CHUNK;
  const int64_t hi = lo + KC_MT_CHUNK < n ? lo + KC_MT_CHUNK : n;
  void *const cp = L.cp[t];
  if (found && *found != 0.0f) { /* skipped: no block counts itself, no step_t moves; the copy as ADAM_MULTI's */
    if (cp)
      for (int64_t i = lo + threadIdx.x; i < hi; i += KC_THREADS) kc_copy_store<T>(cp, L.cp_bf16, i, ((T *)L.p[t])[i]);
    return;
  }
  const bool first = L.step_t[t] ? *L.step_t[t] == 0.0 : L.first[t] != 0;
  T *__restrict__ p = (T *)L.p[t];
  const T *__restrict__ g = (const T *)L.g[t];
  T *__restrict__ b = (T *)L.b[t];
  for (int64_t i = lo + threadIdx.x; i < hi; i += KC_THREADS) {
    kc_sgd_elem<T, C>(p, g, b, i, h, first);
    if (cp) kc_copy_store<T>(cp, L.cp_bf16, i, p[i]);
  }
  if (!L.any_step) return;
  /* every block has read its step before it counts itself done: the last one advances them */
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&kc_sgd_blocks_done, 1u) == gridDim.x - 1) {
      for (int k = 0; k < L.n; k++)
        if (L.step_t[k]) *L.step_t[k] += 1.0;
      kc_sgd_blocks_done = 0;
      __threadfence();
    }
  }
}

extern "C" kiln_status kiln__cuda_sgd_multi(const kiln__kargs *a) {
  kiln__cuda_dev *dev;
  KC_TRY(kiln__cuda_ctx(a->device, &dev));
  const int w = kiln__sgd_list_width(a);
  if (w < 0) return kiln_last_error();
  if (a->list_n == 0) return KILN_OK;
  const bool on_dev = (a->i[1] & 4) != 0, mom = (a->i[1] & 16) != 0, copies = (a->i[1] & 32) != 0;
  const int ws = w - (copies ? 1 : 0); /* step_t is the last view before the copy */
  kc_sgd_hp h;
  h.nlr = -a->s[0];
  h.mu = a->s[1];
  h.omd = 1.0 - a->s[2];
  h.wd = a->s[3];
  h.nesterov = (a->i[1] & 1) != 0;
  h.maximize = (a->i[1] & 2) != 0;
  const kiln_dtype dt = a->list[1].dtype;
  const float *found = (a->i[1] & 8) ? (const float *)a->in[0].data : NULL;
  for (int g0 = 0; g0 < a->list_n;) {
    kc_sgd_list L;
    memset(&L, 0, sizeof L);
    int blocks = 0;
    for (int k = 0; k < KC_SGD_MAX && g0 + k < a->list_n; k++) {
      const kiln__view *v = &a->list[(size_t)(g0 + k) * (size_t)w];
      const int64_t n = kc_numel(&v[1]);
      const int64_t nb = (n + KC_MT_CHUNK - 1) / KC_MT_CHUNK;
      if (v[1].dtype != dt)
        return kiln_set_error(KILN_ERR_DTYPE, "kiln sgd_multi kernel (cuda): tensor %d is %s, the list is %s", g0 + k,
                              kiln_dtype_name(v[1].dtype), kiln_dtype_name(dt));
      if (nb > INT32_MAX - blocks) break; /* this launch is full; the next takes the rest */
      L.g[k] = v[0].data;
      L.p[k] = v[1].data;
      L.b[k] = mom ? v[2].data : NULL;
      L.step_t[k] = on_dev ? (double *)v[ws - 1].data : NULL;
      L.cp[k] = copies ? v[w - 1].data : NULL;
      if (L.cp[k]) L.cp_bf16 = v[w - 1].dtype == KILN_BF16;
      L.first[k] = (unsigned char)(a->list_i && a->list_i[g0 + k] != 0);
      L.numel[k] = n;
      blocks += (int)nb;
      L.block_end[k] = blocks;
      L.n = k + 1;
    }
    if (L.n == 0) return kiln_set_error(KILN_ERR_SHAPE, "kiln sgd_multi kernel (cuda): a tensor is too large for one launch");
    L.any_step = on_dev;
    if (blocks == 0 && on_dev) blocks = 1; /* only empty tensors: one block advances the steps */
    if (blocks > 0) {
      KC_SWITCH_FLOAT(dt, T,
                      return kiln_set_error(KILN_ERR_DTYPE, "kiln sgd_multi kernel (cuda): %s is not a floating dtype", kiln_dtype_name(dt)),
                      {
                        typedef typename kc_traits<T>::acc C;
                        kc_sgd_multi_kernel<T, C><<<(unsigned)blocks, KC_THREADS, 0, dev->stream>>>(L, h, found);
                      })
      KC_TRY(kiln__cuda_launched("sgd_multi"));
    }
    g0 += L.n;
  }
  return KILN_OK;
}

extern "C" bool kiln__cuda_sgd_multi_supports(const kiln__kargs *a) {
  const bool on_dev = (a->i[1] & 4) != 0, mom = (a->i[1] & 16) != 0, copies = (a->i[1] & 32) != 0;
  const int w = 2 + (mom ? 1 : 0) + (on_dev ? 1 : 0) + (copies ? 1 : 0);
  const int ws = w - (copies ? 1 : 0);
  if (a->list_n < 1 || !a->list) return a->list_n == 0;
  if (a->list_w != w) return false;
  if (copies && !kc_copies_ok(a, w)) return false;
  const kiln_dtype dt = a->list[1].dtype;
  if (!kc_is_float(dt)) return false;
  if ((a->i[1] & 8) && (a->n_in < 1 || a->in[0].dtype != KILN_F32 || kc_numel(&a->in[0]) != 1)) return false;
  for (int g = 0; g < a->list_n; g++) {
    const kiln__view *v = &a->list[(size_t)g * (size_t)w];
    for (int k = 0; k < 2 + (mom ? 1 : 0); k++)
      if (v[k].dtype != dt || kc_numel(&v[k]) != kc_numel(&v[1])) return false;
    if (on_dev && (v[ws - 1].dtype != KILN_F64 || kc_numel(&v[ws - 1]) != 1)) return false;
  }
  return true; /* the op layer guarantees contiguous views */
}
