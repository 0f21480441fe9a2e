/*
** Shared by test_amp_launches (CPU) and test_cuda_amp (CUDA): under bf16 autocast, linear's
** weight and bias gradients reach the f32 parameters as the f32 product of the bf16
** operands, unrounded (the "wide" MATMUL: 16-bit A and B, f32 out and row sums), with no
** cast kernel after it. Checked against an f64 reference from the same bf16 values:
**   - within f32 accumulation error (|err| <= 2e-5 * (|g|^T |x|), the sum of the terms'
**     magnitudes: far below bf16's 2^-9);
**   - not rounded through bf16: a gradient cast back from bf16 is bf16-representable in
**     every element, an f32 sum of 64 or more products in about 1 of 65536 (the check
**     allows 1 in 10; a sum of a few bf16 values often is one, so small batches skip it).
** Cases: fashion-mnist's two layers (linear_relu 784 -> 256 at batch 128: the mask read in
** the product and the bias gradient's row sums; linear 256 -> 10), a small product (the
** tiled kernel's size on CUDA), a 3-d input, and a layer without bias.
** Needs check.h included first; cpu is the reference device.
*/
#ifndef KILN_TEST_AMP_WIDE_CHECK_H
#define KILN_TEST_AMP_WIDE_CHECK_H

#include <math.h>
#include <stdlib.h>

/* t's values as host doubles (malloc'd), through the CPU. */
static double *wide_values(kiln_tensor *t, int64_t *n) {
  kiln_scope_begin();
  kiln_tensor *h = kiln_contiguous(kiln_to_dtype(kiln_to_device(t, kiln_device_cpu()), KILN_F64));
  *n = h ? kiln_numel(h) : 0;
  double *v = malloc((size_t)(*n > 0 ? *n : 1) * sizeof *v);
  if (!h || !v || kiln_to_host(h, v, (size_t)*n * sizeof *v) != KILN_OK) {
    free(v);
    v = NULL;
  }
  kiln_scope_end();
  return v;
}

/* got (the parameter's gradient) against ref with magnitudes mag (f64, CPU). */
static void wide_compare(const char *what, kiln_tensor *got, kiln_tensor *ref, kiln_tensor *mag, bool rounding) {
  CHECK(got && kiln_dtype_of(got) == KILN_F32);
  if (!got) return;
  int64_t n = 0, nr = 0, nm = 0;
  double *g = wide_values(got, &n), *r = wide_values(ref, &nr), *m = wide_values(mag, &nm);
  CHECK(g && r && m && n == nr && n == nm);
  int64_t bad = 0, representable = 0, nonzero = 0;
  double worst = 0;
  for (int64_t i = 0; g && r && m && n == nr && n == nm && i < n; i++) {
    double err = fabs(g[i] - r[i]), lim = 2e-5 * m[i] + 1e-30;
    if (err > lim) bad++;
    if (err / lim > worst) worst = err / lim;
    float f = (float)g[i];
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if (f != 0) {
      nonzero++;
      representable += (bits & 0xffffu) == 0;
    }
  }
  if (!rounding) representable = 0; /* a sum of a few bf16 values often is one */
  if (bad || representable * 10 > nonzero)
    fprintf(stderr, "  %s: %lld of %lld elements off (worst %.3g x the bound); %lld of %lld nonzero are bf16 values\n",
            what, (long long)bad, (long long)n, worst, (long long)representable, (long long)nonzero);
  CHECK(bad == 0);
  CHECK(nonzero > 0 && representable * 10 <= nonzero);
  free(g), free(r), free(m);
}

/* The f32 gradient is only for a cast the program does not look at: asked for through
** kiln_autograd_grad, or retained, the cast output's gradient is bf16, as its dtype. */
static void amp_wide_shown_check(kiln_device dev) {
  kiln_scope_begin();
  kiln_generator *gen = kiln_generator_new(9);
  kiln_tensor *x = kiln_to_device(kiln_randn(KILN_SHAPE(64, 24), KILN_F32, kiln_device_cpu(), gen), dev);
  kiln_tensor *W = kiln_to_device(kiln_randn(KILN_SHAPE(16, 24), KILN_F32, kiln_device_cpu(), gen), dev);
  kiln_generator_free(gen);
  kiln_requires_grad_(W, true);
  kiln_tensor *wb = kiln_to_dtype(W, KILN_BF16), *xb = kiln_to_dtype(x, KILN_BF16);
  kiln_tensor *loss = kiln_sum_all(kiln_to_dtype(kiln_linear(xb, wb, NULL), KILN_F32));
  kiln_tensor *g[2] = {NULL, NULL};
  CHECK(kiln_autograd_grad(1, &loss, NULL, 2, (kiln_tensor *[]){wb, W}, g) == KILN_OK);
  CHECK(g[0] && kiln_dtype_of(g[0]) == KILN_BF16);
  CHECK(g[1] && kiln_dtype_of(g[1]) == KILN_F32);
  /* g: owned by the scope */
  CHECK(kiln_retain_grad(wb) == KILN_OK);
  CHECK(kiln_backward(loss, NULL) == KILN_OK);
  CHECK(kiln_grad(wb) && kiln_dtype_of(kiln_grad(wb)) == KILN_BF16);
  CHECK(kiln_grad(W) && kiln_dtype_of(kiln_grad(W)) == KILN_F32);
  kiln_scope_end();
}

static void amp_wide_check(kiln_device dev) {
  amp_wide_shown_check(dev);
  static const struct {
    int nd;
    int64_t lead[2], K, N;
    bool relu, bias;
  } cases[] = {
      {2, {128, 0}, 784, 256, true, true}, /* fashion-mnist's first layer */
      {2, {128, 0}, 256, 10, false, true}, /* and its second */
      {2, {8, 0}, 24, 16, true, true},     /* small: CUDA's tiled-kernel size */
      {3, {4, 5}, 12, 7, true, true},      /* a 3-d input */
      {2, {64, 0}, 33, 17, false, false},  /* no bias */
  };
  kiln_device cpu = kiln_device_cpu();
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    kiln_scope_begin();
    kiln_generator *gen = kiln_generator_new(100 + c);
    int64_t M = cases[c].lead[0] * (cases[c].nd == 3 ? cases[c].lead[1] : 1), K = cases[c].K, N = cases[c].N;
    int64_t xs[3] = {cases[c].lead[0], cases[c].nd == 3 ? cases[c].lead[1] : K, K};
    kiln_tensor *x = kiln_to_device(kiln_randn(cases[c].nd, xs, KILN_F32, cpu, gen), dev);
    kiln_tensor *W = kiln_to_device(kiln_mul_scalar(kiln_randn(KILN_SHAPE(N, K), KILN_F32, cpu, gen), 0.2), dev);
    kiln_tensor *b = cases[c].bias ? kiln_to_device(kiln_randn(KILN_SHAPE(N), KILN_F32, cpu, gen), dev) : NULL;
    kiln_tensor *R = kiln_randn(KILN_SHAPE(M, N), KILN_F32, cpu, gen);
    kiln_generator_free(gen);
    kiln_requires_grad_(W, true);
    if (b) kiln_requires_grad_(b, true);
    CHECK(kiln_autocast_begin(dev.type, KILN_BF16) == KILN_OK);
    kiln_tensor *y = cases[c].relu ? kiln_linear_relu(x, W, b) : kiln_linear(x, W, b);
    CHECK(kiln_autocast_end() == KILN_OK);
    CHECK(y && kiln_dtype_of(y) == KILN_BF16);
    /* loss = sum(y * R): y's gradient is R, rounded to bf16 by y's cast's rule */
    kiln_tensor *loss = kiln_sum_all(kiln_mul(kiln_reshape(kiln_to_dtype(y, KILN_F32), KILN_SHAPE(M, N)),
                                              kiln_to_device(R, dev)));
    CHECK(loss && kiln_backward(loss, NULL) == KILN_OK);
    /* the reference: g = bf16(R) where y > 0, x = bf16(x), both in f64 on the CPU */
    kiln_tensor *gd = kiln_to_dtype(kiln_to_dtype(R, KILN_BF16), KILN_F64);
    if (cases[c].relu) {
      kiln_tensor *yd = kiln_reshape(kiln_to_dtype(kiln_to_device(y, cpu), KILN_F64), KILN_SHAPE(M, N));
      gd = kiln_mul(gd, kiln_to_dtype(kiln_gt(yd, kiln_zeros_like(yd)), KILN_F64));
    }
    kiln_tensor *xd = kiln_reshape(kiln_to_dtype(kiln_to_dtype(kiln_to_device(x, cpu), KILN_BF16), KILN_F64),
                                   KILN_SHAPE(M, K));
    kiln_tensor *gT = kiln_transpose(gd, 0, 1);
    kiln_tensor *dW = kiln_matmul(gT, xd), *dWmag = kiln_matmul(kiln_abs(gT), kiln_abs(xd));
    char what[96];
    snprintf(what, sizeof what, "%s case %zu: dW (%lld, %lld)", kiln_backend_name(dev.type), c, (long long)N,
             (long long)K);
    wide_compare(what, kiln_grad(W), dW, dWmag, M >= 64);
    if (b) {
      snprintf(what, sizeof what, "%s case %zu: db (%lld)", kiln_backend_name(dev.type), c, (long long)N);
      wide_compare(what, kiln_grad(b), kiln_sum(gd, KILN_DIMS(0), false), kiln_sum(kiln_abs(gd), KILN_DIMS(0), false),
                   M >= 64);
    }
    kiln_scope_end();
  }
}

#endif
