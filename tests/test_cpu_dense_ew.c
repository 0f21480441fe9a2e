/* CPU elementwise ops on operands that share one dense, non-C-order layout (channels-last,
** a permuted 3-d tensor), which cpu_elementwise.c runs as one flat run, and the packed
** bf16 <-> f32 conversions of cpu_iter.c: both must give exactly what the C-order path
** and the scalar conversions give. Cases where the layouts differ (one operand
** channels-last, the other not; a broadcast operand) take the general walker and are
** checked the same way. */
#include <kiln.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static kiln_device cpu;

static bool same_bits(kiln_tensor *a, kiln_tensor *b, const char *what) {
  if (!a || !b || kiln_numel(a) != kiln_numel(b) || kiln_dtype_of(a) != kiln_dtype_of(b)) {
    fprintf(stderr, "%s: missing or mismatched (%s)\n", what, kiln_last_error_message());
    return false;
  }
  size_t nb = (size_t)kiln_numel(a) * kiln_dtype_size(kiln_dtype_of(a));
  char *x = malloc(nb), *y = malloc(nb);
  kiln_to_host(a, x, nb);
  kiln_to_host(b, y, nb);
  bool ok = memcmp(x, y, nb) == 0;
  if (!ok) fprintf(stderr, "%s: bits differ\n", what);
  free(x), free(y);
  return ok;
}

/* relu, add, mul, relu's backward and a comparison of x, y in layout `lay` against the
** same ops on C-order copies. */
static void check_ops(kiln_tensor *x, kiln_tensor *y, const char *name) {
  kiln_tensor *xc = kiln_contiguous(x), *yc = kiln_contiguous(y);
  char w[160];
  snprintf(w, sizeof w, "%s relu", name);
  CHECK(same_bits(kiln_contiguous(kiln_relu(x)), kiln_relu(xc), w));
  snprintf(w, sizeof w, "%s add", name);
  CHECK(same_bits(kiln_contiguous(kiln_add(x, y)), kiln_add(xc, yc), w));
  snprintf(w, sizeof w, "%s mul", name);
  CHECK(same_bits(kiln_contiguous(kiln_mul(x, y)), kiln_mul(xc, yc), w));
  snprintf(w, sizeof w, "%s eq", name);
  CHECK(same_bits(kiln_contiguous(kiln_eq(x, y)), kiln_eq(xc, yc), w));
  /* relu's backward: gradient y through relu(x) */
  kiln_tensor *xl = kiln_detach(x), *xcl = kiln_detach(xc);
  kiln_requires_grad_(xl, true);
  kiln_requires_grad_(xcl, true);
  CHECK(kiln_backward(kiln_relu(xl), y) == KILN_OK);
  CHECK(kiln_backward(kiln_relu(xcl), yc) == KILN_OK);
  snprintf(w, sizeof w, "%s relu backward", name);
  CHECK(same_bits(kiln_contiguous(kiln_grad(xl)), kiln_grad(xcl), w));
}

int main(void) {
  cpu = kiln_device_cpu();
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(5);
  const kiln_dtype dts[2] = {KILN_F32, KILN_BF16};
  for (int di = 0; di < 2; di++) {
    kiln_dtype dt = dts[di];
    char name[80];
    /* ties and signs for eq and relu: randn rounded to a coarse grid via bf16 and back */
    kiln_tensor *x = kiln_to_dtype(kiln_randn(KILN_SHAPE(4, 33, 7, 9), KILN_F32, cpu, g), dt);
    kiln_tensor *y = kiln_to_dtype(kiln_randn(KILN_SHAPE(4, 33, 7, 9), KILN_F32, cpu, g), dt);
    /* channels-last, both operands: the flat run */
    snprintf(name, sizeof name, "%s channels-last", kiln_dtype_name(dt));
    check_ops(kiln_contiguous_format(x, KILN_CHANNELS_LAST), kiln_contiguous_format(y, KILN_CHANNELS_LAST), name);
    /* a permuted 3-d layout (dims in memory order 2, 0, 1), both operands */
    kiln_tensor *a3 = kiln_permute(kiln_to_dtype(kiln_randn(KILN_SHAPE(7, 5, 300), KILN_F32, cpu, g), dt), 3,
                                   (const int[]){1, 2, 0});
    kiln_tensor *b3 = kiln_permute(kiln_to_dtype(kiln_randn(KILN_SHAPE(7, 5, 300), KILN_F32, cpu, g), dt), 3,
                                   (const int[]){1, 2, 0});
    snprintf(name, sizeof name, "%s permuted 3-d", kiln_dtype_name(dt));
    check_ops(a3, b3, name);
    /* mixed layouts: one channels-last, one not (the walker) */
    snprintf(name, sizeof name, "%s mixed layouts", kiln_dtype_name(dt));
    check_ops(kiln_contiguous_format(x, KILN_CHANNELS_LAST), y, name);
    /* a broadcast operand against a channels-last one */
    kiln_tensor *row = kiln_to_dtype(kiln_randn(KILN_SHAPE(1, 33, 1, 1), KILN_F32, cpu, g), dt);
    kiln_tensor *xcl = kiln_contiguous_format(x, KILN_CHANNELS_LAST);
    snprintf(name, sizeof name, "%s broadcast add", kiln_dtype_name(dt));
    CHECK(same_bits(kiln_contiguous(kiln_add(xcl, row)), kiln_add(x, row), name));
  }
  /* adds with a bf16 operand or result (plain and with alpha): C-contiguous operands take
  ** cpu_elementwise.c's one-pass 16-lane path, the same values as column slices of wider
  ** tensors (not dense) the general walker; the bits must agree. Odd sizes: a masked tail. */
  {
    const kiln_dtype pairs[4][2] = {{KILN_F32, KILN_BF16}, {KILN_BF16, KILN_F32}, {KILN_BF16, KILN_BF16},
                                    {KILN_F32, KILN_F32}};
    for (int pi = 0; pi < 4; pi++) {
      kiln_tensor *bx = kiln_to_dtype(kiln_randn(KILN_SHAPE(37, 602), KILN_F32, cpu, g), pairs[pi][0]);
      kiln_tensor *by = kiln_to_dtype(kiln_randn(KILN_SHAPE(37, 602), KILN_F32, cpu, g), pairs[pi][1]);
      kiln_tensor *xs = kiln_narrow(bx, 1, 0, 301), *ys = kiln_narrow(by, 1, 1, 301);
      kiln_tensor *xc = kiln_contiguous(xs), *yc = kiln_contiguous(ys);
      char w[96];
      snprintf(w, sizeof w, "add %s + %s", kiln_dtype_name(pairs[pi][0]), kiln_dtype_name(pairs[pi][1]));
      CHECK(same_bits(kiln_add(xs, ys), kiln_add(xc, yc), w));
      snprintf(w, sizeof w, "axpy %s + -0.37 %s", kiln_dtype_name(pairs[pi][0]), kiln_dtype_name(pairs[pi][1]));
      CHECK(same_bits(kiln_axpy(xs, -0.37, ys), kiln_axpy(xc, -0.37, yc), w));
      /* in place, into the bf16 or f32 x (the gradient accumulations of autograd) */
      kiln_tensor *xa = kiln_contiguous(xs), *xb = kiln_contiguous(xs);
      CHECK(kiln_axpy_(xa, 1.0, yc) == KILN_OK);
      CHECK(kiln_axpy_(xb, 1.0, ys) == KILN_OK);
      snprintf(w, sizeof w, "axpy_ %s += %s", kiln_dtype_name(pairs[pi][0]), kiln_dtype_name(pairs[pi][1]));
      CHECK(same_bits(xa, xb, w));
      /* casts between f32 and bf16 of the slices against the contiguous copies */
      snprintf(w, sizeof w, "cast %s", kiln_dtype_name(pairs[pi][0]));
      kiln_dtype to = pairs[pi][0] == KILN_F32 ? KILN_BF16 : KILN_F32;
      CHECK(same_bits(kiln_contiguous(kiln_to_dtype(xs, to)), kiln_to_dtype(xc, to), w));
    }
  }
  /* the packed conversions: every bf16 pattern to f32 and back, and f32 values around
  ** each rounding case, against the scalar conversions */
  {
    int64_t n = 65536;
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)n), *back = malloc(sizeof(uint16_t) * (size_t)n);
    float *f = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) h[i] = (uint16_t)i;
    kiln_tensor *tb = kiln_from_data(h, KILN_SHAPE(n), KILN_BF16, cpu);
    kiln_tensor *tf = kiln_to_dtype(tb, KILN_F32);
    kiln_to_host(tf, f, sizeof(float) * (size_t)n);
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
      float want = kiln_bf16_to_f32(h[i]);
      if (memcmp(&want, &f[i], 4) != 0) bad++;
    }
    CHECK(bad == 0);
    kiln_to_host(kiln_to_dtype(tf, KILN_BF16), back, sizeof(uint16_t) * (size_t)n);
    bad = 0;
    for (int64_t i = 0; i < n; i++)
      if (back[i] != kiln_f32_to_bf16(f[i])) bad++;
    CHECK(bad == 0);
    /* f32 patterns: each bf16 value with low halves 0x7fff, 0x8000, 0x8001, 0xffff (ties to
    ** even, just below and above), NaNs with payloads only in the low half included */
    const uint32_t lows[4] = {0x7fffu, 0x8000u, 0x8001u, 0xffffu};
    float *ff = malloc(sizeof(float) * (size_t)n * 4);
    for (int64_t i = 0; i < n; i++)
      for (int k = 0; k < 4; k++) {
        uint32_t u = ((uint32_t)i << 16) | lows[k];
        memcpy(&ff[i * 4 + k], &u, 4);
      }
    uint16_t *r = malloc(sizeof(uint16_t) * (size_t)n * 4);
    kiln_to_host(kiln_to_dtype(kiln_from_data(ff, KILN_SHAPE(n * 4), KILN_F32, cpu), KILN_BF16), r,
                 sizeof(uint16_t) * (size_t)n * 4);
    bad = 0;
    for (int64_t i = 0; i < n * 4; i++)
      if (r[i] != kiln_f32_to_bf16(ff[i])) bad++;
    CHECK(bad == 0);
    free(h), free(back), free(f), free(ff), free(r);
  }
  kiln_generator_free(g);
  kiln_scope_end();
  printf("test_cpu_dense_ew: %d failures\n", failures);
  return failures ? 1 : 0;
}
