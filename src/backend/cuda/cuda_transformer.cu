/* CUDA kernels for the transformer ops: layer/RMS norm, attention, cumsum, tril/triu, topk, multinomial.
** No kernel yet: supports() says no, so dispatch falls back to the CPU under the policy. */
#include "cuda_int.cuh"

extern "C" bool kiln__cuda_transformer_supports(const kiln__kargs *a) {
  (void)a;
  return false;
}

extern "C" kiln_status kiln__cuda_transformer(const kiln__kargs *a) {
  (void)a;
  return KILN_ERR_UNSUPPORTED;
}
