/* CUDA kernels for the loss scaler: AMP_UPDATE_SCALE (the scale's update, one thread) and
** the unscale-and-check (AMP_UNSCALE, PyTorch's
** _amp_foreach_non_finite_check_and_unscale_): every gradient of the list multiplied in
** place by 1/scale, and the f32 found-inf flag set to 1 when a product is inf or NaN.
**
** One launch for up to KC_AMP_MAX tensors (ADAM_MULTI's multi-tensor pattern,
** cuda_optim.cu): the tensors' pointers, sizes and dtypes travel in the kernel's
** parameters, each block finds its tensor from the running block counts and does one
** chunk of it. Tensors of different float dtypes share a launch (a model's f32 master
** grads and f16 buffers do): the dtype is per tensor and the block switches on it. The
** multiplier is read on the device when the scaler keeps it there (n_in 1), so the launch
** needs nothing from the host and a captured graph replays with the live scale. The flag
** is only ever written with 1.0f, so racing blocks agree; it is never cleared here. */
#include "cuda_int.cuh"

#include <string.h>

#define KC_AMP_MAX 64
#define KC_AMP_CHUNK (4 * KC_THREADS) /* elements a block does: 4 a thread */

struct kc_amp_list {
  int n;
  void *g[KC_AMP_MAX];
  int64_t numel[KC_AMP_MAX];
  int block_end[KC_AMP_MAX]; /* blocks of tensors 0..i together */
  int dtype[KC_AMP_MAX];     /* kiln_dtype */
};

/* x *= inv over [lo, hi), in the compute type (f32 for the 16-bit floats, as the CPU
** kernel), and whether a product was not finite. */
template <class T>
__device__ __forceinline__ bool kc_unscale_range(T *__restrict__ x, int64_t lo, int64_t hi, double inv) {
  typedef typename kc_traits<T>::acc C;
  const C s = (C)inv;
  bool bad = false;
  for (int64_t i = lo + threadIdx.x; i < hi; i += KC_THREADS) {
    C v = (C)kc_ld(x[i]) * s;
    x[i] = kc_st<T>(v);
    bad |= !isfinite(v);
  }
  return bad;
}

__global__ void __launch_bounds__(KC_THREADS)
    kc_amp_unscale_kernel(kc_amp_list L, const float *__restrict__ inv_dev, double inv_host,
                          float *__restrict__ found) {
  int t = 0;
  while (t < L.n - 1 && (int)blockIdx.x >= L.block_end[t]) t++;
  const int first = t ? L.block_end[t - 1] : 0;
  const int64_t lo = (int64_t)((int)blockIdx.x - first) * KC_AMP_CHUNK;
  const int64_t hi = lo + KC_AMP_CHUNK < L.numel[t] ? lo + KC_AMP_CHUNK : L.numel[t];
  /* PyTorch multiplies by the f32 inverse (scale.double().reciprocal().float()) */
  const double inv = inv_dev ? (double)*inv_dev : inv_host;
  bool bad = false;
  switch ((kiln_dtype)L.dtype[t]) {
  case KILN_F32: bad = kc_unscale_range<float>((float *)L.g[t], lo, hi, (double)(float)inv); break;
  case KILN_F64: bad = kc_unscale_range<double>((double *)L.g[t], lo, hi, inv); break;
  case KILN_F16: bad = kc_unscale_range<__half>((__half *)L.g[t], lo, hi, (double)(float)inv); break;
  case KILN_BF16: bad = kc_unscale_range<__nv_bfloat16>((__nv_bfloat16 *)L.g[t], lo, hi, (double)(float)inv); break;
  default: break; /* supports() turned other dtypes away */
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *found = 1.0f;
}

/* AMP_UPDATE_SCALE: torch._amp_update_scale_ on one thread (the CPU kernel's arithmetic:
** the scale in f32, the tracker in its own type). */
template <class TR>
__global__ void kc_amp_update_scale_kernel(float *scale, TR *tracker, const float *found, float growth,
                                           float backoff, double interval) {
  if (*found != 0.0f) {
    *scale = __fmul_rn(*scale, backoff);
    *tracker = (TR)0;
    return;
  }
  double t = (double)*tracker + 1.0;
  if (t == interval) {
    float grown = __fmul_rn(*scale, growth);
    if (isfinite(grown)) *scale = grown;
    *tracker = (TR)0;
  } else {
    *tracker = (TR)t;
  }
}

static bool kc_update_scale_ok(const kiln__kargs *a) {
  return a->n_in >= 1 && a->n_out >= 2 && a->in[0].dtype == KILN_F32 && a->out[0].dtype == KILN_F32 &&
         (a->out[1].dtype == KILN_F32 || a->out[1].dtype == KILN_F64);
}

extern "C" bool kiln__cuda_amp_supports(const kiln__kargs *a) {
  if (a->op == KILN__K_AMP_UPDATE_SCALE) return kc_update_scale_ok(a);
  if (a->op != KILN__K_AMP_UNSCALE) return false;
  if (a->list_w != 1 || (a->list_n > 0 && !a->list) || a->n_out < 1 || a->out[0].dtype != KILN_F32 ||
      kc_numel(&a->out[0]) != 1)
    return false;
  if (a->n_in >= 1 && (a->in[0].dtype != KILN_F32 || kc_numel(&a->in[0]) != 1)) return false;
  for (int g = 0; g < a->list_n; g++)
    if (!kc_is_float(a->list[g].dtype)) return false;
  return true; /* the op layer guarantees contiguous views */
}

extern "C" kiln_status kiln__cuda_amp(const kiln__kargs *a) {
  kiln__cuda_dev *dev;
  if (a->op == KILN__K_AMP_UPDATE_SCALE) {
    if (!kc_update_scale_ok(a))
      return kiln_set_error(KILN_ERR_INTERNAL, "kiln amp_update_scale kernel (cuda): expected f32 found_inf and "
                                               "scale, an f32/f64 tracker");
    KC_TRY(kiln__cuda_ctx(a->device, &dev));
    float *scale = (float *)a->out[0].data;
    const float *found = (const float *)a->in[0].data;
    if (a->out[1].dtype == KILN_F64)
      kc_amp_update_scale_kernel<double><<<1, 1, 0, dev->stream>>>(scale, (double *)a->out[1].data, found,
                                                                   (float)a->s[0], (float)a->s[1], (double)a->i[0]);
    else
      kc_amp_update_scale_kernel<float><<<1, 1, 0, dev->stream>>>(scale, (float *)a->out[1].data, found,
                                                                  (float)a->s[0], (float)a->s[1], (double)a->i[0]);
    return kiln__cuda_launched("amp_update_scale");
  }
  if (a->op != KILN__K_AMP_UNSCALE)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln cuda amp family: op %d is not an amp op", (int)a->op);
  KC_TRY(kiln__cuda_ctx(a->device, &dev));
  if (a->list_w != 1 || a->n_out < 1 || a->out[0].dtype != KILN_F32)
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln amp_unscale kernel (cuda): expected a list of width 1 and an f32 flag");
  const float *inv_dev = a->n_in >= 1 ? (const float *)a->in[0].data : NULL;
  float *found = (float *)a->out[0].data;
  for (int g0 = 0; g0 < a->list_n;) {
    kc_amp_list L;
    memset(&L, 0, sizeof L);
    int blocks = 0;
    for (int k = 0; k < KC_AMP_MAX && g0 + k < a->list_n; k++) {
      const kiln__view *v = &a->list[g0 + k];
      if (!kc_is_float(v->dtype))
        return kiln_set_error(KILN_ERR_DTYPE, "kiln amp_unscale kernel (cuda): tensor %d is %s, not floating", g0 + k,
                              kiln_dtype_name(v->dtype));
      int64_t n = kc_numel(v);
      int64_t nb = (n + KC_AMP_CHUNK - 1) / KC_AMP_CHUNK;
      if (nb > INT32_MAX - blocks) break; /* this launch is full; the next takes the rest */
      L.g[k] = v->data;
      L.numel[k] = n;
      L.dtype[k] = (int)v->dtype;
      blocks += (int)nb;
      L.block_end[k] = blocks;
      L.n = k + 1;
    }
    if (L.n == 0)
      return kiln_set_error(KILN_ERR_SHAPE, "kiln amp_unscale kernel (cuda): a tensor is too large for one launch");
    if (blocks > 0) {
      kc_amp_unscale_kernel<<<(unsigned)blocks, KC_THREADS, 0, dev->stream>>>(L, inv_dev, a->s[0], found);
      KC_TRY(kiln__cuda_launched("amp_unscale"));
    }
    g0 += L.n;
  }
  return KILN_OK;
}
