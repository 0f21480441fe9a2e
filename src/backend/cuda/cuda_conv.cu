/* The convolution family on CUDA: the window kernels (IM2COL, COL2IM, MAX_POOL2D and its
** backward:
** cuda_pool.cu), the fused ReLU + max-pool and one-channel conv + ReLU + max-pool kernels
** (RELU_MAX_POOL2D, CONV1_RELU_MAX_POOL2D and their backwards: cuda_conv1.cu) and the
** convolutions (CONV2D and its backward kernels): small f32 ones with TF32 allowed on the
** tensor cores by kiln's own kernels (cuda_conv_direct.cu), stride-2 16-bit ones of images
** with at most 4 channels (a ResNet stem) and their weight gradients as stride-1 ones of the
** image laid out space-to-depth (cuda_conv_s2d.cu, then cuDNN), the rest through cuDNN
** (cuda_conv_cudnn.cu; without it supports() says no for those, and the op layer composes
** IM2COL + MATMUL). */
#include "cuda_int.cuh"

extern "C" bool kiln__cuda_window_supports(const kiln__kargs *a);
extern "C" kiln_status kiln__cuda_window(const kiln__kargs *a);
extern "C" bool kiln__cuda_cudnn_supports(const kiln__kargs *a);
extern "C" kiln_status kiln__cuda_cudnn_conv(const kiln__kargs *a);
extern "C" bool kiln__cuda_conv_direct_supports(const kiln__kargs *a);
extern "C" kiln_status kiln__cuda_conv_direct(const kiln__kargs *a);
extern "C" bool kiln__cuda_conv1_supports(const kiln__kargs *a);
extern "C" bool kiln__cuda_conv_s2d_supports(const kiln__kargs *a);
extern "C" kiln_status kiln__cuda_conv_s2d(const kiln__kargs *a);
extern "C" kiln_status kiln__cuda_conv1(const kiln__kargs *a);

static bool is_window(kiln__kop op) {
  return op == KILN__K_IM2COL || op == KILN__K_COL2IM || op == KILN__K_MAX_POOL2D ||
         op == KILN__K_MAX_POOL2D_BACKWARD;
}

static bool is_fused(kiln__kop op) {
  return op == KILN__K_RELU_MAX_POOL2D || op == KILN__K_RELU_MAX_POOL2D_BACKWARD ||
         op == KILN__K_CONV1_RELU_MAX_POOL2D || op == KILN__K_CONV1_RELU_MAX_POOL2D_BACKWARD;
}

extern "C" bool kiln__cuda_conv_supports(const kiln__kargs *a) {
  return is_window(a->op) ? kiln__cuda_window_supports(a)
         : is_fused(a->op) ? kiln__cuda_conv1_supports(a)
                           : kiln__cuda_conv_direct_supports(a) || kiln__cuda_conv_s2d_supports(a) ||
                                 kiln__cuda_cudnn_supports(a);
}

extern "C" kiln_status kiln__cuda_conv(const kiln__kargs *a) {
  if (is_window(a->op)) return kiln__cuda_window(a);
  if (is_fused(a->op)) return kiln__cuda_conv1(a);
  if (kiln__cuda_conv_direct_supports(a)) return kiln__cuda_conv_direct(a);
  return kiln__cuda_conv_s2d_supports(a) ? kiln__cuda_conv_s2d(a) : kiln__cuda_cudnn_conv(a);
}
