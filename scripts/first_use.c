/* Probe: the host time of each kernel family's first call on the GPU (lazy module
** loading), against its second call. Built and run by scripts/gpu_run.sh probe. */
#include <kiln.h>
#include <kiln_nn.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

#define TIME2(label, expr)                                                                 \
  for (int rep = 0; rep < 2; rep++) {                                                      \
    double t0 = now();                                                                     \
    kiln_scope_begin();                                                                    \
    (void)(expr);                                                                          \
    kiln_device_synchronize(dev);                                                          \
    kiln_scope_end();                                                                      \
    printf("%-28s %s %9.1f us\n", label, rep ? "again" : "first", (now() - t0) * 1e6);     \
  }

int main(void) {
  double t0 = now();
  kiln_device dev = kiln_device_best();
  kiln_tensor *w = kiln_keep(kiln_randn(KILN_SHAPE(128, 64), KILN_F32, dev, NULL));
  printf("%-28s       %9.1f us\n", "context + randn", (now() - t0) * 1e6);
  kiln_tensor *x = kiln_keep(kiln_randn(KILN_SHAPE(128, 64), KILN_F32, dev, NULL));
  kiln_tensor *y = kiln_keep(kiln_zeros(KILN_SHAPE(128), KILN_I64, dev));
  TIME2("fill (ones)", kiln_ones(KILN_SHAPE(128), KILN_F32, dev));
  TIME2("add", kiln_add(x, x));
  TIME2("relu", kiln_relu(x));
  TIME2("sum", kiln_sum_all(x));
  TIME2("matmul 128x64x128 (small)", kiln_matmul(x, kiln_transpose(w, 0, 1)));
  TIME2("matmul 128x64x2 (thin)", kiln_matmul(x, kiln_narrow(kiln_transpose(w, 0, 1), 1, 0, 2)));
  TIME2("matmul 1024^3 (cublas)", kiln_matmul(kiln_zeros(KILN_SHAPE(1024, 1024), KILN_F32, dev),
                                               kiln_zeros(KILN_SHAPE(1024, 1024), KILN_F32, dev)));
  TIME2("cross_entropy", kiln_cross_entropy(x, y, KILN_REDUCTION_MEAN, -100, 0.0));
  TIME2("index_select", kiln_index_select(x, 0, y));
  TIME2("item", kiln_item(kiln_sum_all(x)));
  printf("%-28s       %9.1f us\n", "total", (now() - t0) * 1e6);
  return 0;
}
