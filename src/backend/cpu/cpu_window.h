/*
** Window geometry shared by the CPU's convolution and pooling kernels (cpu_conv.c,
** cpu_maxpool.c): where an (n, c) plane of a 4-d view starts, and which output columns a
** window tap reads inside the image.
*/
#ifndef KILN_CPU_WINDOW_H
#define KILN_CPU_WINDOW_H

#include "../backend.h"

/* Plane q = n*C + c of a 4-d view (N, C, ...) as a byte offset. */
static inline int64_t kiln__cpu_plane_off(const kiln__view *v, int64_t q) {
  int64_t n = q / v->shape[1], c = q % v->shape[1];
  return (n * v->strides[0] + c * v->strides[1]) * (int64_t)kiln_dtype_size(v->dtype);
}

/* The output columns ow whose input column ow*s - p + off lies in [0, W): [*lo, *hi). */
static inline void kiln__cpu_valid_cols(int64_t OW, int64_t W, int64_t s, int64_t p, int64_t off, int64_t *lo,
                                        int64_t *hi) {
  int64_t base = off - p; /* w = ow*s + base */
  int64_t a = base >= 0 ? 0 : (-base + s - 1) / s;
  int64_t b = W - base <= 0 ? 0 : (W - base - 1) / s + 1;
  if (a > OW) a = OW;
  if (b > OW) b = OW;
  if (b < a) b = a;
  *lo = a, *hi = b;
}

#endif /* KILN_CPU_WINDOW_H */
