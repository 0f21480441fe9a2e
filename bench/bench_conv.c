/*
** conv2d forward, and forward + backward, per layer shape. Prints ms per call (the best
** of reps, after a warm-up call) and the achieved GFLOP/s (2*N*OC*OH*OW*C/G*kh*kw per
** forward; backward counted as twice the forward).
**
** CPU (default): a few ResNet shapes at batch 8, and ResNet-18 32x32's (batch 64) and the
** Fashion-MNIST CNN's (batch 128), f32 (im2col + GEMM, or oneDNN; KILN_DNNL_CONV_PLAIN=1
** and KILN_CONV_C1=0 give oneDNN's plain-layout primitives for comparison).
** --cuda: ResNet-50's distinct conv layers at batch 32 on cuda:0, in f32 (TF32 off) and
** bf16, NCHW and channels-last (NHWC strides, kiln_contiguous_format), times from device
** marks. With cuDNN, CONV2D and its backward kernels run; without it im2col + cuBLAS.
** --cuda-fmnist: the Fashion-MNIST CNN's two convs at batch 128 (1->32 @28, 32->64 @13, 3x3,
** no padding) in f32 exact, TF32 and bf16, NCHW and channels-last (whether either layout or
** bf16 makes cuDNN's small convs faster), then its first layer as one op
** (kiln_conv2d_relu_max_pool2d: CONV1_RELU_MAX_POOL2D where the device has it) against
** conv2d, relu, max_pool2d (KILN_CONV_RELU_POOL=0 gives the latter in both rows), the input
** needing no gradient as in training.
**
** No PyTorch peer yet (it is not installed on the machine this was written on); compare
** with `torch.nn.functional.conv2d` at the same shapes by hand (torch.backends.cudnn.
** benchmark as KILN_CUDNN_BENCHMARK), and add the peer to ../shared/bench/torch_peer.py.
**
**   bench-conv [reps]          (KILN_NUM_THREADS sets the threads)
**   bench-conv --cuda [reps]   (KILN_CUDNN_BENCHMARK=1: measured algorithms)
**   bench-conv --cuda-fmnist [reps]
** reps (default 3) may also be given as --reps R.
*/
#include <kiln.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_args.h"

typedef struct shape {
  const char *name;
  int64_t n, c, h, w, oc, k, stride, pad, groups;
} shape;

static const shape cpu_shapes[] = {
    {"resnet stem 7x7/2 3->64 @112", 8, 3, 112, 112, 64, 7, 2, 3, 1},
    {"3x3 64->64 @56", 8, 64, 56, 56, 64, 3, 1, 1, 1},
    {"3x3 128->128 @28", 8, 128, 28, 28, 128, 3, 1, 1, 1},
    {"1x1 256->64 @56", 8, 256, 56, 56, 64, 1, 1, 0, 1},
    {"depthwise 3x3 128 @28", 8, 128, 28, 28, 128, 3, 1, 1, 128},
    /* issue 15's CPU workloads: ResNet-18 at 32x32 (batch 64), the Fashion-MNIST CNN (128) */
    {"r18-32 stem 7x7/2 3->64 @32 b64", 64, 3, 32, 32, 64, 7, 2, 3, 1},
    {"r18-32 3x3 64->64 @8 b64", 64, 64, 8, 8, 64, 3, 1, 1, 1},
    {"r18-32 3x3 128->128 @4 b64", 64, 128, 4, 4, 128, 3, 1, 1, 1},
    {"r18-32 3x3 256->256 @2 b64", 64, 256, 2, 2, 256, 3, 1, 1, 1},
    {"r18-32 3x3 512->512 @1 b64", 64, 512, 1, 1, 512, 3, 1, 1, 1},
    {"r18-32 1x1/2 128->256 @4 b64", 64, 128, 4, 4, 256, 1, 2, 0, 1},
    {"fmnist conv1 3x3 1->32 @28 b128", 128, 1, 28, 28, 32, 3, 1, 0, 1},
    {"fmnist conv2 3x3 32->64 @13 b128", 128, 32, 13, 13, 64, 3, 1, 0, 1},
};

/* ResNet-50 (torchvision, stride on the 3x3), batch 32: each distinct layer once. */
static const shape gpu_shapes[] = {
    {"stem 7x7/2 3->64 @224", 32, 3, 224, 224, 64, 7, 2, 3, 1},
    {"l1 1x1 64->64 @56", 32, 64, 56, 56, 64, 1, 1, 0, 1},
    {"l1 3x3 64->64 @56", 32, 64, 56, 56, 64, 3, 1, 1, 1},
    {"l1 1x1 64->256 @56", 32, 64, 56, 56, 256, 1, 1, 0, 1},
    {"l1 1x1 256->64 @56", 32, 256, 56, 56, 64, 1, 1, 0, 1},
    {"l2 3x3/2 128->128 @56", 32, 128, 56, 56, 128, 3, 2, 1, 1},
    {"l2 3x3 128->128 @28", 32, 128, 28, 28, 128, 3, 1, 1, 1},
    {"l2 1x1 512->128 @28", 32, 512, 28, 28, 128, 1, 1, 0, 1},
    {"l3 3x3 256->256 @14", 32, 256, 14, 14, 256, 3, 1, 1, 1},
    {"l3 1x1 1024->256 @14", 32, 1024, 14, 14, 256, 1, 1, 0, 1},
    {"l4 3x3 512->512 @7", 32, 512, 7, 7, 512, 3, 1, 1, 1},
    {"l4 1x1 512->2048 @7", 32, 512, 7, 7, 2048, 1, 1, 0, 1},
};

/* The Fashion-MNIST CNN's convs on the GPU, batch 128 (fmnist-cnn in torch_peer.py) */
static const shape fm_shapes[] = {
    {"fmnist conv1 3x3 1->32 @28 b128", 128, 1, 28, 28, 32, 3, 1, 0, 1},
    {"fmnist conv2 3x3 32->64 @13 b128", 128, 32, 13, 13, 64, 3, 1, 0, 1},
};

static double time_ms(kiln_device dev, const shape *s, kiln_dtype dt, bool nhwc, int reps, bool backward) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(s->n, s->c, s->h, s->w), dt, dev, NULL);
  kiln_tensor *w = kiln_randn(KILN_SHAPE(s->oc, s->c / s->groups, s->k, s->k), dt, dev, NULL);
  kiln_tensor *b = kiln_zeros(KILN_SHAPE(s->oc), dt, dev);
  if (nhwc) x = kiln_contiguous_format(x, KILN_CHANNELS_LAST);
  if (backward) {
    kiln_requires_grad_(x, true);
    kiln_requires_grad_(w, true);
    kiln_requires_grad_(b, true);
  }
  int64_t st[2] = {s->stride, s->stride}, pd[2] = {s->pad, s->pad};
  double best = 1e30;
  for (int r = 0; r < reps + 1; r++) {
    kiln_scope_begin();
    kiln_mark *m0 = kiln_mark_record(dev);
    kiln_tensor *y = kiln_conv2d(x, w, b, st, pd, NULL, s->groups);
    if (backward && y) kiln_backward(kiln_sum_all(y), NULL);
    kiln_mark *m1 = kiln_mark_record(dev);
    double ms = kiln_mark_elapsed_ms(m0, m1);
    if (!y) {
      fprintf(stderr, "bench-conv: %s: %s\n", s->name, kiln_last_error_message());
      exit(1);
    }
    if (r > 0 && ms < best) best = ms; /* the first call warms the allocator (and picks cuDNN's algorithm) */
    kiln_scope_end();
  }
  kiln_scope_end();
  return best;
}

/* fmnist's first layer, conv 1->32 + ReLU + MaxPool2d(2): fused (one op each way) or the
** three ops; the weight and bias need gradients, the input not (it is the data). */
static double time_layer1_ms(kiln_device dev, bool fused, int reps, bool backward) {
  const shape *s = &fm_shapes[0];
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(s->n, s->c, s->h, s->w), KILN_F32, dev, NULL);
  kiln_tensor *w = kiln_randn(KILN_SHAPE(s->oc, s->c, s->k, s->k), KILN_F32, dev, NULL);
  kiln_tensor *b = kiln_zeros(KILN_SHAPE(s->oc), KILN_F32, dev);
  kiln_requires_grad_(w, backward);
  kiln_requires_grad_(b, backward);
  int64_t pk[2] = {2, 2};
  double best = 1e30;
  for (int r = 0; r < reps + 1; r++) {
    kiln_scope_begin();
    kiln_mark *m0 = kiln_mark_record(dev);
    kiln_tensor *y = fused ? kiln_conv2d_relu_max_pool2d(x, w, b, NULL, NULL, NULL, 1, pk, NULL, NULL, NULL)
                           : kiln_max_pool2d(kiln_relu(kiln_conv2d(x, w, b, NULL, NULL, NULL, 1)), pk, NULL, NULL, NULL,
                                             NULL);
    if (backward && y) kiln_backward(kiln_sum_all(y), NULL);
    kiln_mark *m1 = kiln_mark_record(dev);
    double ms = kiln_mark_elapsed_ms(m0, m1);
    if (!y) {
      fprintf(stderr, "bench-conv: layer 1: %s\n", kiln_last_error_message());
      exit(1);
    }
    if (r > 0 && ms < best) best = ms;
    kiln_scope_end();
  }
  kiln_scope_end();
  return best;
}

static double flops(const shape *s) {
  int64_t oh = (s->h + 2 * s->pad - s->k) / s->stride + 1, ow = (s->w + 2 * s->pad - s->k) / s->stride + 1;
  return 2.0 * (double)(s->n * s->oc * oh * ow) * (double)(s->c / s->groups * s->k * s->k);
}

int main(int argc, char **argv) {
  bool fm = false, cuda = false, reps_set = false;
  int reps = 3;
  bench_args cli = bench_args_begin("bench-conv", "[--cuda | --cuda-fmnist] [--reps R | R]", argc, argv);
  for (const char *a; (a = bench_args_next(&cli));) {
    if (!strcmp(a, "--cuda") || !strcmp(a, "--cuda-fmnist")) {
      if (cuda) bench_args_fail(&cli, "%s: give one of --cuda and --cuda-fmnist, once", a);
      cuda = true, fm = !strcmp(a, "--cuda-fmnist");
    } else if (!strcmp(a, "--reps") || !bench_args_is_flag(a)) {
      if (reps_set) bench_args_fail(&cli, "reps given twice ('%s')", a);
      reps_set = true;
      reps = (int)(!strcmp(a, "--reps") ? bench_args_int(&cli, 1, 1000000)
                                        : bench_args_parse_int(&cli, "reps", a, 1, 1000000));
    } else bench_args_unknown(&cli);
  }
  if (!cuda) {
    printf("| shape (batch 8 unless said, f32, %d threads) | fwd ms | fwd GFLOP/s | fwd+bwd ms | fwd+bwd GFLOP/s |\n",
           kiln_num_threads());
    printf("|---|---|---|---|---|\n");
    for (size_t i = 0; i < sizeof cpu_shapes / sizeof cpu_shapes[0]; i++) {
      const shape *s = &cpu_shapes[i];
      double f = time_ms(kiln_device_cpu(), s, KILN_F32, false, reps, false);
      double fb = time_ms(kiln_device_cpu(), s, KILN_F32, false, reps, true);
      printf("| %s | %.2f | %.1f | %.2f | %.1f |\n", s->name, f, flops(s) / f / 1e6, fb, 3 * flops(s) / fb / 1e6);
    }
    return 0;
  }
  if (kiln_device_count(KILN_DEVICE_CUDA) == 0) {
    fprintf(stderr, "bench-conv: no CUDA device\n");
    return 77;
  }
  kiln_device dev = kiln_device_cuda(0);
  kiln_set_matmul_tf32(false);
  if (fm) {
    printf("| layer | precision | layout | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |\n");
    printf("|---|---|---|---|---|---|---|\n");
    static const char *const prec[3] = {"f32", "tf32", "bf16"};
    for (size_t i = 0; i < sizeof fm_shapes / sizeof fm_shapes[0]; i++)
      for (int pi = 0; pi < 3; pi++)
        for (int l = 0; l < 2; l++) {
          const shape *s = &fm_shapes[i];
          kiln_dtype dt = pi == 2 ? KILN_BF16 : KILN_F32;
          kiln_set_matmul_tf32(pi == 1);
          double f = time_ms(dev, s, dt, l == 1, reps, false);
          double fb = time_ms(dev, s, dt, l == 1, reps, true);
          printf("| %s | %s | %s | %.4f | %.2f | %.4f | %.2f |\n", s->name, prec[pi], l ? "NHWC" : "NCHW", f,
                 flops(s) / f / 1e9, fb, 3 * flops(s) / fb / 1e9);
          fflush(stdout);
        }
    kiln_set_matmul_tf32(false);
    printf("\n| fmnist layer 1 (conv 1->32, ReLU, MaxPool2d(2), f32, b128) | fwd ms | fwd+bwd ms (dW, db) |\n");
    printf("|---|---|---|\n");
    for (int fu = 1; fu >= 0; fu--)
      printf("| %s | %.4f | %.4f |\n", fu ? "kiln_conv2d_relu_max_pool2d" : "conv2d, relu, max_pool2d",
             time_layer1_ms(dev, fu, reps, false), time_layer1_ms(dev, fu, reps, true));
    return 0;
  }
  const char *bm = getenv("KILN_CUDNN_BENCHMARK");
  printf("cuda:0, ResNet-50 conv layers at batch 32, TF32 off, cuDNN algorithms: %s\n\n",
         bm && strcmp(bm, "0") ? "measured (KILN_CUDNN_BENCHMARK=1)" : "heuristic");
  printf("| layer | dtype | layout | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |\n");
  printf("|---|---|---|---|---|---|---|\n");
  static const kiln_dtype dts[2] = {KILN_F32, KILN_BF16};
  for (size_t i = 0; i < sizeof gpu_shapes / sizeof gpu_shapes[0]; i++) {
    const shape *s = &gpu_shapes[i];
    for (int di = 0; di < 2; di++)
      for (int l = 0; l < 2; l++) {
        double f = time_ms(dev, s, dts[di], l == 1, reps, false);
        double fb = time_ms(dev, s, dts[di], l == 1, reps, true);
        printf("| %s | %s | %s | %.3f | %.1f | %.3f | %.1f |\n", s->name, kiln_dtype_name(dts[di]), l ? "NHWC" : "NCHW",
               f, flops(s) / f / 1e9, fb, 3 * flops(s) / fb / 1e9);
        fflush(stdout);
      }
  }
  return 0;
}
