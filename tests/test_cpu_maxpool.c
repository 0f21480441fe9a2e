/* The CPU's fast max_pool2d kernels (src/backend/cpu/cpu_maxpool.c: f32 and bf16, NCHW
** rows with AVX-512 or portable loops, channels-last pixels) against the general loop,
** which f64 inputs take: values, indices and the gradient must agree bit for bit, since
** a maximum is exact and each pixel's gradient is the same f64 sum rounded once. Data
** with many ties (values from a set of 7) and NaNs, so the first-maximum and NaN rules
** are exercised (PyTorch's choice on ties: the first in row-major window order); windows
** disjoint, overlapping, padded, dilated, strided 1 to 3, wider than 16 outputs (AVX-512
** chunks); inputs NCHW, channels-last, and non-contiguous (a narrowed width, a narrowed
** channel range of a channels-last tensor, a transposed H/W that takes the general loop). */
#include <kiln.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static kiln_device cpu;

/* Bitwise equality of two f64 host copies, NaN equal to NaN. */
static bool same64(kiln_tensor *a, kiln_tensor *b, const char *what) {
  if (!a || !b || kiln_numel(a) != kiln_numel(b)) {
    fprintf(stderr, "%s: missing or mismatched (%s)\n", what, kiln_last_error_message());
    return false;
  }
  int64_t n = kiln_numel(a);
  double *x = malloc(sizeof(double) * (size_t)n), *y = malloc(sizeof(double) * (size_t)n);
  kiln_to_host(kiln_contiguous(kiln_to_dtype(a, KILN_F64)), x, sizeof(double) * (size_t)n);
  kiln_to_host(kiln_contiguous(kiln_to_dtype(b, KILN_F64)), y, sizeof(double) * (size_t)n);
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < n; i++)
    if (!(x[i] == y[i] || (isnan(x[i]) && isnan(y[i])))) {
      if (first < 0) first = i;
      bad++;
    }
  if (bad) fprintf(stderr, "%s: %lld of %lld differ (first at %lld: %g vs %g)\n", what, (long long)bad, (long long)n,
                   (long long)first, x[first], y[first]);
  free(x), free(y);
  return bad == 0;
}

typedef struct pcfg {
  int64_t k[2], s[2], p[2], d[2];
  int64_t N, C, H, W;
} pcfg;

static const char *layout_name[] = {"nchw", "channels-last", "narrow-w", "narrow-c-cl", "transposed"};

/* x in the layout asked for, holding the values of the NCHW tensor base (N, C, H, W). */
static kiln_tensor *in_layout(kiln_tensor *base, int layout) {
  int64_t C = kiln_size(base, 1), W = kiln_size(base, 3);
  switch (layout) {
  case 0: return base;
  case 1: return kiln_contiguous_format(base, KILN_CHANNELS_LAST);
  case 2: { /* rows of stride W + 3 */
    kiln_tensor *wide = kiln_pad(base, 2, (const int64_t[]){1, 2}, KILN_PAD_CONSTANT, 0.0);
    return kiln_narrow(wide, 3, 1, W);
  }
  case 3: { /* channels of a channels-last tensor with more channels: pixel stride C + 2 */
    kiln_tensor *more = kiln_pad(kiln_permute(base, 4, (const int[]){0, 2, 3, 1}), 2, (const int64_t[]){0, 2},
                                 KILN_PAD_CONSTANT, 0.0);
    return kiln_narrow(kiln_permute(more, 4, (const int[]){0, 3, 1, 2}), 1, 0, C);
  }
  default: /* H and W swapped in memory: no unit-stride rows */
    return kiln_transpose(kiln_contiguous(kiln_transpose(base, 2, 3)), 2, 3);
  }
}

/* The case's input in dt and the given layout, tie- and NaN-rich (ties everywhere), needing
** a gradient, and its contiguous f64 copy, also needing one: *x and *x64, in the caller's
** scope. */
static void make_inputs(const pcfg *c, kiln_dtype dt, int layout, uint64_t seed, kiln_tensor **x, kiln_tensor **x64) {
  int64_t n = c->N * c->C * c->H * c->W;
  float *h = malloc(sizeof(float) * (size_t)n);
  srand((unsigned)seed);
  for (int64_t i = 0; i < n; i++) h[i] = (float)(rand() % 7 - 3) * 0.5f;
  for (int64_t i = 0; i < n / 97; i++) h[rand() % n] = NAN;
  kiln_tensor *base = kiln_to_dtype(kiln_from_data(h, KILN_SHAPE(c->N, c->C, c->H, c->W), KILN_F32, cpu), dt);
  free(h);
  *x = in_layout(base, layout);
  kiln_requires_grad_(*x, true);
  *x64 = kiln_contiguous(kiln_detach(kiln_to_dtype(kiln_contiguous(*x), KILN_F64)));
  kiln_requires_grad_(*x64, true);
}

/* The same g (exact in dt) into y and y64: x's gradient must be x64's, bit for bit. */
static void check_grad(kiln_tensor *x, kiln_tensor *y, kiln_tensor *x64, kiln_tensor *y64, kiln_dtype dt,
                       uint64_t seed, const char *what) {
  char w2[240];
  kiln_generator *gen = kiln_generator_new(seed + 1);
  kiln_tensor *g = y ? kiln_to_dtype(kiln_randn(4, kiln_shape(y), KILN_F32, cpu, gen), dt) : NULL;
  kiln_generator_free(gen);
  CHECK(kiln_backward(y, g) == KILN_OK);
  CHECK(kiln_backward(y64, kiln_to_dtype(g, KILN_F64)) == KILN_OK);
  snprintf(w2, sizeof w2, "%s gradient", what);
  CHECK(same64(kiln_grad(x), kiln_to_dtype(kiln_grad(x64), dt), w2));
}

static void check_case(const pcfg *c, kiln_dtype dt, int layout, uint64_t seed) {
  kiln_scope_begin();
  kiln_tensor *x, *x64;
  make_inputs(c, dt, layout, seed, &x, &x64);
  kiln_tensor *ix = NULL, *ix64 = NULL;
  kiln_tensor *y = kiln_max_pool2d(x, c->k, c->s, c->p, c->d, &ix);
  kiln_tensor *y64 = kiln_max_pool2d(x64, c->k, c->s, c->p, c->d, &ix64);
  char what[200];
  snprintf(what, sizeof what, "k %lldx%lld s %lldx%lld p %lldx%lld d %lldx%lld (%lld,%lld,%lld,%lld) %s %s",
           (long long)c->k[0], (long long)c->k[1], (long long)c->s[0], (long long)c->s[1], (long long)c->p[0],
           (long long)c->p[1], (long long)c->d[0], (long long)c->d[1], (long long)c->N, (long long)c->C,
           (long long)c->H, (long long)c->W, kiln_dtype_name(dt), layout_name[layout]);
  char w2[240];
  snprintf(w2, sizeof w2, "%s values", what);
  CHECK(same64(y, y64, w2));
  snprintf(w2, sizeof w2, "%s indices", what);
  CHECK(same64(ix, ix64, w2));
  check_grad(x, y, x64, y64, dt, seed, what);
  kiln_scope_end();
}

/* kiln_relu_max_pool2d (RELU_MAX_POOL2D and its backward for f32 where the windows tile:
** AVX-512 or AVX2 for 2x2 with unit-stride rows, portable loops otherwise; the two ops elsewhere,
** bf16 and f64 included)
** against kiln_relu then kiln_max_pool2d in f64: the same values and gradient, bit for
** bit (ReLU and a maximum are exact; each pixel's gradient is one g or zero). The same
** tie- and NaN-rich data: windows whose max is 0, negative, or NaN pass no gradient. */
static void check_relu_case(const pcfg *c, kiln_dtype dt, int layout, uint64_t seed) {
  kiln_scope_begin();
  kiln_tensor *x, *x64;
  make_inputs(c, dt, layout, seed, &x, &x64);
  kiln_tensor *y = kiln_relu_max_pool2d(x, c->k, c->s, c->p, c->d);
  kiln_tensor *y64 = kiln_max_pool2d(kiln_relu(x64), c->k, c->s, c->p, c->d, NULL);
  char what[200], w2[240];
  snprintf(what, sizeof what, "relu_max_pool2d k %lldx%lld s %lldx%lld p %lldx%lld (%lld,%lld,%lld,%lld) %s %s",
           (long long)c->k[0], (long long)c->k[1], (long long)c->s[0], (long long)c->s[1], (long long)c->p[0],
           (long long)c->p[1], (long long)c->N, (long long)c->C, (long long)c->H, (long long)c->W,
           kiln_dtype_name(dt), layout_name[layout]);
  snprintf(w2, sizeof w2, "%s values", what);
  CHECK(same64(y, y64, w2));
  check_grad(x, y, x64, y64, dt, seed, what);
  kiln_scope_end();
}

int main(void) {
  cpu = kiln_device_cpu();
  static const pcfg cfgs[] = {
      {{2, 2}, {2, 2}, {0, 0}, {1, 1}, 3, 5, 12, 12},  /* fmnist-cnn's pool */
      {{2, 2}, {2, 2}, {0, 0}, {1, 1}, 2, 3, 13, 11},  /* odd sizes: the last row/column dropped */
      {{3, 3}, {2, 2}, {1, 1}, {1, 1}, 2, 4, 16, 16},  /* ResNet's stem pool: overlapping, padded */
      {{3, 3}, {1, 1}, {1, 1}, {1, 1}, 2, 3, 9, 7},    /* stride 1 */
      {{2, 3}, {3, 2}, {1, 1}, {1, 1}, 2, 3, 10, 11},  /* anisotropic */
      {{3, 3}, {3, 3}, {0, 0}, {1, 1}, 2, 2, 10, 10},  /* stride 3: the portable path */
      {{2, 2}, {1, 2}, {0, 0}, {2, 1}, 2, 3, 9, 9},    /* dilation */
      {{3, 3}, {2, 2}, {1, 1}, {1, 1}, 1, 2, 9, 70},   /* rows of 35 outputs: three AVX-512 chunks */
      {{2, 2}, {2, 2}, {0, 0}, {1, 1}, 1, 20, 6, 6},   /* more channels than one AVX-512 vector */
      {{2, 2}, {2, 2}, {0, 0}, {1, 1}, 1, 2, 9, 71},   /* 2x2 backward: 35 outputs a row (chunk tails), odd sizes */
      {{1, 1}, {1, 1}, {0, 0}, {1, 1}, 1, 2, 5, 5},    /* a 1x1 window: identity */
  };
  const kiln_dtype dts[2] = {KILN_F32, KILN_BF16};
  uint64_t seed = 1;
  for (size_t ci = 0; ci < sizeof cfgs / sizeof *cfgs; ci++)
    for (int di = 0; di < 2; di++)
      for (int layout = 0; layout < 5; layout++) check_case(&cfgs[ci], dts[di], layout, seed++);
  static const pcfg rcfgs[] = {
      {{2, 2}, {2, 2}, {0, 0}, {1, 1}, 2, 3, 26, 26}, /* fmnist-cnn's first pool (13 outputs a row) */
      {{2, 2}, {2, 2}, {0, 0}, {1, 1}, 2, 3, 11, 11}, /* its second: odd sizes, the last row/column get zeros */
      {{2, 2}, {2, 2}, {0, 0}, {1, 1}, 1, 2, 9, 71},  /* 35 outputs a row: two full AVX-512 chunks and a tail */
      {{2, 2}, {2, 2}, {0, 0}, {1, 1}, 1, 2, 4, 32},  /* exactly one chunk */
      {{3, 2}, {3, 2}, {0, 0}, {1, 1}, 2, 2, 10, 11}, /* other tiling windows: the portable loops */
      {{3, 3}, {2, 2}, {1, 1}, {1, 1}, 2, 2, 9, 9},   /* windows that do not tile: the two ops */
  };
  const kiln_dtype rdts[3] = {KILN_F32, KILN_BF16, KILN_F64};
  for (size_t ci = 0; ci < sizeof rcfgs / sizeof *rcfgs; ci++)
    for (int di = 0; di < 3; di++)
      for (int layout = 0; layout < 5; layout++) check_relu_case(&rcfgs[ci], rdts[di], layout, seed++);
  printf("test_cpu_maxpool: %d failures\n", failures);
  return failures ? 1 : 0;
}
