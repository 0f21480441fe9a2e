/*
** COPY between views of one dtype and FILL: the kernels every program runs (optimizer
** state made as zeros, gradients laid out, inputs made contiguous), kept in a module of
** their own. With lazy module loading (CUDA's default) the first launch of a kernel loads
** its whole .cu module, about 1 ms a megabyte on the H200 machines: here that is a few
** hundred kilobytes instead of the ~10 MB of all the unary ops and casts, whose module a
** program that never uses them never loads. Casts (COPY between dtypes) are in
** cuda_elementwise.cu (kiln__cuda_cast_view).
*/
#include "cuda_ew.cuh"

namespace {

template <class A> struct F_fill {
  A v;
  __device__ __forceinline__ A operator()(int64_t) const { return v; }
};
struct F_ident {
  template <class X> __device__ __forceinline__ X operator()(X x) const { return x; }
};

/* Same dtype: only the bits move, so one kernel per element size serves every dtype. */
template <class U>
kiln_status copy_bits(kiln__cuda_dev *d, const kiln__view *out, const kiln__view *in) {
  const kiln__view *ins[1] = {in};
  return kc_ew_launch<1, U, U, U, U>(d, out, ins, F_ident(), "copy");
}

kiln_status copy_same(kiln__cuda_dev *d, const kiln__view *out, const kiln__view *in) {
  if (in->data == out->data) { /* in place (backend.h allows it): nothing moves */
    bool same = true;
    for (int k = 0; k < in->ndim; k++) same = same && in->strides[k] == out->strides[k];
    if (same) return KILN_OK;
  }
  const kiln__view *v[2] = {out, in};
  kc_shape sh;
  kc_coalesce(&sh, v, 2);
  if (sh.numel == 0) return KILN_OK;
  if (sh.ndim == 1 && sh.st[0][0] == 1 && sh.st[1][0] == 1) {
    KC_CUDA(cudaMemcpyAsync(out->data, in->data, (size_t)sh.numel * kc_size(in->dtype),
                            cudaMemcpyDeviceToDevice, d->stream),
            "copy");
    return KILN_OK;
  }
  switch (kc_size(in->dtype)) {
  case 1: return copy_bits<uint8_t>(d, out, in);
  case 2: return copy_bits<uint16_t>(d, out, in);
  case 4: return copy_bits<uint32_t>(d, out, in);
  case 8: return copy_bits<uint64_t>(d, out, in);
  default: return kiln_set_error(KILN_ERR_DTYPE, "kiln_copy: bad dtype");
  }
}

template <class T> kiln_status fill(kiln__cuda_dev *d, const kiln__view *out, double v) {
  typedef typename kc_traits<T>::acc A;
  F_fill<A> f = {(A)v};
  return kc_ew_launch<0, T, T, T, T>(d, out, NULL, f, "fill");
}

} // namespace

extern "C" kiln_status kiln__cuda_copy_view(int device, const kiln__view *out,
                                            const kiln__view *in) {
  if (in->ndim != out->ndim)
    return kiln_set_error(KILN_ERR_SHAPE, "kiln_copy: ndim %d and %d differ", in->ndim,
                          out->ndim);
  if (in->dtype != out->dtype) return kiln__cuda_cast_view(device, out, in);
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  return copy_same(d, out, in);
}

extern "C" kiln_status kiln__cuda_fill_view(int device, const kiln__view *out, double v) {
  kiln__cuda_dev *d;
  KC_TRY(kiln__cuda_ctx(device, &d));
  if (out->dtype == KILN_BOOL) v = v != 0.0 ? 1.0 : 0.0;
  KC_SWITCH_ALL(out->dtype, T, return kiln_set_error(KILN_ERR_DTYPE, "kiln_fill: bad dtype"),
                return fill<T>(d, out, v))
  return KILN_OK;
}
