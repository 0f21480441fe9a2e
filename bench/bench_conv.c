/*
** conv2d on the CPU (im2col + GEMM): forward, and forward + backward, for a few layer
** shapes of a ResNet at batch 8, f32. Prints ms per call and the achieved GFLOP/s
** (2*N*OC*OH*OW*C/G*kh*kw per forward; backward counted as twice the forward).
**
** No PyTorch peer yet (it is not installed on the machine this was written on); compare
** with `torch.nn.functional.conv2d` at the same shapes and thread count by hand, and add
** the peer to ../shared/bench/torch_peer.py when it is.
**
**   bench-conv [reps]   (KILN_NUM_THREADS sets the threads)
*/
#include <kiln.h>

#include <stdio.h>
#include <stdlib.h>

typedef struct shape {
  const char *name;
  int64_t n, c, h, w, oc, k, stride, pad, groups;
} shape;

static const shape shapes[] = {
    {"resnet stem 7x7/2 3->64 @112", 8, 3, 112, 112, 64, 7, 2, 3, 1},
    {"3x3 64->64 @56", 8, 64, 56, 56, 64, 3, 1, 1, 1},
    {"3x3 128->128 @28", 8, 128, 28, 28, 128, 3, 1, 1, 1},
    {"1x1 256->64 @56", 8, 256, 56, 56, 64, 1, 1, 0, 1},
    {"depthwise 3x3 128 @28", 8, 128, 28, 28, 128, 3, 1, 1, 128},
};

static double time_ms(const shape *s, int reps, bool backward) {
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(s->n, s->c, s->h, s->w), KILN_F32, cpu, NULL);
  kiln_tensor *w = kiln_randn(KILN_SHAPE(s->oc, s->c / s->groups, s->k, s->k), KILN_F32, cpu, NULL);
  kiln_tensor *b = kiln_zeros(KILN_SHAPE(s->oc), KILN_F32, cpu);
  if (backward) {
    kiln_requires_grad_(x, true);
    kiln_requires_grad_(w, true);
    kiln_requires_grad_(b, true);
  }
  int64_t st[2] = {s->stride, s->stride}, pd[2] = {s->pad, s->pad};
  double best = 1e30;
  for (int r = 0; r < reps + 1; r++) {
    kiln_scope_begin();
    kiln_mark *m0 = kiln_mark_record(cpu);
    kiln_tensor *y = kiln_conv2d(x, w, b, st, pd, NULL, s->groups);
    if (backward && y) kiln_backward(kiln_sum_all(y), NULL);
    kiln_mark *m1 = kiln_mark_record(cpu);
    double ms = kiln_mark_elapsed_ms(m0, m1);
    if (!y) {
      fprintf(stderr, "bench-conv: %s\n", kiln_last_error_message());
      exit(1);
    }
    if (r > 0 && ms < best) best = ms; /* the first call warms the allocator */
    kiln_scope_end();
  }
  kiln_scope_end();
  return best;
}

int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 3;
  printf("| shape (batch 8, f32, %d threads) | fwd ms | fwd GFLOP/s | fwd+bwd ms | fwd+bwd GFLOP/s |\n",
         kiln_num_threads());
  printf("|---|---|---|---|---|\n");
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    const shape *s = &shapes[i];
    int64_t oh = (s->h + 2 * s->pad - s->k) / s->stride + 1, ow = (s->w + 2 * s->pad - s->k) / s->stride + 1;
    double flop = 2.0 * (double)(s->n * s->oc * oh * ow) * (double)(s->c / s->groups * s->k * s->k);
    double f = time_ms(s, reps, false), fb = time_ms(s, reps, true);
    printf("| %s | %.2f | %.1f | %.2f | %.1f |\n", s->name, f, flop / f / 1e6, fb, 3 * flop / fb / 1e6);
  }
  return 0;
}
