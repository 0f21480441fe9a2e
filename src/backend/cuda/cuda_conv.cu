/* CUDA kernels for the convolution ops: im2col/col2im, pools, convolution (cuDNN).
** No kernel yet: supports() says no, so dispatch falls back to the CPU under the policy. */
#include "cuda_int.cuh"

extern "C" bool kiln__cuda_conv_supports(const kiln__kargs *a) {
  (void)a;
  return false;
}

extern "C" kiln_status kiln__cuda_conv(const kiln__kargs *a) {
  (void)a;
  return KILN_ERR_UNSUPPORTED;
}
