/*
** CAST_MULTI: many dtype conversions in one launch (autocast's casts of one op's inputs,
** and of their gradients back: a linear layer's weight and bias cost one launch each way
** instead of two). The layout is ADAM_MULTI's (cuda_optim.cu): up to KC_CAST_MAX pairs a
** launch, their pointers in the kernel's parameters, each block one chunk of one pair,
** found from the running block counts. Every source has one dtype and every destination
** one (supports refuses other lists: the op layer then casts pair by pair). A value is
** converted as the COPY kernel converts it (kc_ld to the compute type, kc_st: round to
** nearest even), so a list cast and the casts one by one give the same bits. A module of
** its own, so that a program that never casts this way never loads it.
*/
#include "cuda_int.cuh"

#include <string.h>

#define KC_CAST_MAX 64
#define KC_CAST_CHUNK (KC_THREADS * 4)

namespace {

struct kc_cast_list {
  int n;
  const void *in[KC_CAST_MAX];
  void *out[KC_CAST_MAX];
  int64_t numel[KC_CAST_MAX];
  int block_end[KC_CAST_MAX]; /* blocks of pairs 0..i together */
};

template <class I, class O>
__global__ void __launch_bounds__(KC_THREADS) kc_cast_multi_kernel(kc_cast_list L) {
  int t = 0;
  while (t < L.n - 1 && (int)blockIdx.x >= L.block_end[t]) t++;
  const int first = t ? L.block_end[t - 1] : 0;
  const int64_t n = L.numel[t];
  const int64_t lo = (int64_t)((int)blockIdx.x - first) * KC_CAST_CHUNK;
  const int64_t hi = lo + KC_CAST_CHUNK < n ? lo + KC_CAST_CHUNK : n;
  const I *__restrict__ in = (const I *)L.in[t];
  O *__restrict__ out = (O *)L.out[t];
  for (int64_t i = lo + threadIdx.x; i < hi; i += KC_THREADS) out[i] = kc_st<O>(kc_ld<I>(in[i]));
}

template <class I, class O> kiln_status launch(kiln__cuda_dev *d, const kiln__kargs *a) {
  for (int g0 = 0; g0 < a->list_n;) {
    kc_cast_list L;
    memset(&L, 0, sizeof L);
    int blocks = 0;
    for (int k = 0; k < KC_CAST_MAX && g0 + k < a->list_n; k++) {
      const kiln__view *v = &a->list[(size_t)(g0 + k) * 2];
      const int64_t n = kc_numel(&v[1]);
      const int64_t nb = (n + KC_CAST_CHUNK - 1) / KC_CAST_CHUNK;
      if (nb > INT32_MAX - blocks) break; /* this launch is full; the next takes the rest */
      L.in[k] = v[0].data;
      L.out[k] = v[1].data;
      L.numel[k] = n;
      blocks += (int)nb;
      L.block_end[k] = blocks;
      L.n = k + 1;
    }
    if (L.n == 0) return kiln_set_error(KILN_ERR_SHAPE, "kiln cast_multi kernel (cuda): a tensor is too large for one launch");
    if (blocks > 0) {
      kc_cast_multi_kernel<I, O><<<(unsigned)blocks, KC_THREADS, 0, d->stream>>>(L);
      KC_TRY(kiln__cuda_launched("cast_multi"));
    }
    g0 += L.n;
  }
  return KILN_OK;
}

template <class I> kiln_status launch_from(kiln__cuda_dev *d, const kiln__kargs *a, kiln_dtype out) {
  KC_SWITCH_FLOAT(out, O, return kiln_set_error(KILN_ERR_DTYPE, "kiln cast_multi kernel (cuda): to %s", kiln_dtype_name(out)),
                  return launch<I, O>(d, a))
  return KILN_OK;
}

} // namespace

extern "C" kiln_status kiln__cuda_cast_multi(const kiln__kargs *a) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(a->device, &d));
  if (a->list_w != 2 || (a->list_n > 0 && !a->list))
    return kiln_set_error(KILN_ERR_INTERNAL, "kiln cast_multi kernel (cuda): expected pairs of views, got groups of %d", a->list_w);
  if (a->list_n == 0) return KILN_OK;
  const kiln_dtype in = a->list[0].dtype, out = a->list[1].dtype;
  KC_SWITCH_FLOAT(in, I, return kiln_set_error(KILN_ERR_DTYPE, "kiln cast_multi kernel (cuda): from %s", kiln_dtype_name(in)),
                  return launch_from<I>(d, a, out))
  return KILN_OK;
}

extern "C" bool kiln__cuda_cast_multi_supports(const kiln__kargs *a) {
  if (a->list_w != 2 || a->list_n < 1 || !a->list) return a->list_n == 0;
  const kiln_dtype in = a->list[0].dtype, out = a->list[1].dtype;
  if (!kc_is_float(in) || !kc_is_float(out)) return false;
  for (int g = 0; g < a->list_n; g++) {
    const kiln__view *v = &a->list[(size_t)g * 2];
    if (v[0].dtype != in || v[1].dtype != out || kc_numel(&v[0]) != kc_numel(&v[1])) return false;
  }
  return true; /* the op layer gives contiguous views */
}
