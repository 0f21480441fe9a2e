/* CUDA kernels for the loss scaler's unscale-and-check (AMP_UNSCALE).
** No kernel yet: supports() says no, so dispatch falls back to the CPU under the policy. */
#include "cuda_int.cuh"

extern "C" bool kiln__cuda_amp_supports(const kiln__kargs *a) {
  (void)a;
  return false;
}

extern "C" kiln_status kiln__cuda_amp(const kiln__kargs *a) {
  (void)a;
  return KILN_ERR_UNSUPPORTED;
}
