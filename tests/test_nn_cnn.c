/* Convolutional modules (src/nn/conv_layers.c): PyTorch's default initialisation,
** forward equal to the op with the module's configuration, finite-difference gradients
** through the modules (f64), non-contiguous inputs, BatchNorm's buffers (names, state dict,
** train / eval, momentum and the cumulative average, num_batches_tracked), GroupNorm,
** Dropout2d, and the configuration errors. CPU only; the ops themselves are checked on
** every backend by test_ops_conv. */
#include <kiln.h>
#include <kiln_io.h>
#include <kiln_nn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static kiln_device cpu;

static double max_abs_diff(kiln_tensor *a, kiln_tensor *b) {
  if (!a || !b || kiln_numel(a) != kiln_numel(b)) return INFINITY;
  return kiln_item(kiln_amax(kiln_abs(kiln_sub(kiln_to_dtype(a, KILN_F64), kiln_to_dtype(b, KILN_F64))), 0, NULL, false));
}

static double scalar(kiln_tensor *t) { return kiln_item(kiln_to_dtype(t, KILN_F64)); }

/* kaiming_uniform(a = sqrt(5)): U(-b, b) with b = 1/sqrt(fan_in); its variance b^2/3. */
static void check_uniform(kiln_tensor *w, double bound, const char *what) {
  double mx = kiln_item(kiln_amax(kiln_abs(w), 0, NULL, false));
  kiln_tensor *w64 = kiln_to_dtype(w, KILN_F64);
  double mean = kiln_item(kiln_mean(w64, 0, NULL, false));
  double var = kiln_item(kiln_mean(kiln_mul(w64, w64), 0, NULL, false)) - mean * mean;
  bool ok = mx <= bound && mx > 0.95 * bound && fabs(var / (bound * bound / 3) - 1) < 0.05;
  if (!ok) fprintf(stderr, "%s: max %g bound %g var %g want %g\n", what, mx, bound, var, bound * bound / 3);
  CHECK(ok);
}

static void test_conv_init_and_forward(void) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(7);
  const int64_t k3[2] = {3, 3}, s2[2] = {2, 2}, p1[2] = {1, 1}, d2[2] = {2, 2};
  kiln_module *c = kiln_conv2d_new(64, 128, k3, s2, p1, d2, 2, true, KILN_F32, cpu, g);
  CHECK(c && !strcmp(kiln_module_type_name(c), "Conv2d"));
  kiln_tensor *w = kiln_module_param(c, "weight"), *b = kiln_module_param(c, "bias");
  CHECK(w && kiln_ndim(w) == 4 && kiln_size(w, 0) == 128 && kiln_size(w, 1) == 32 && kiln_size(w, 3) == 3);
  check_uniform(w, 1 / sqrt(32.0 * 9), "Conv2d weight"); /* fan_in = in/groups * kh * kw */
  CHECK(b && kiln_item(kiln_amax(kiln_abs(b), 0, NULL, false)) <= 1 / sqrt(32.0 * 9));
  kiln_tensor *x = kiln_randn(KILN_SHAPE(2, 64, 9, 9), KILN_F32, cpu, g);
  kiln_tensor *y = kiln_module_forward(c, x);
  CHECK(y && max_abs_diff(y, kiln_conv2d(x, w, b, s2, p1, d2, 2)) == 0.0);
  CHECK(y && kiln_size(y, 1) == 128 && kiln_size(y, 2) == 4); /* (9 + 2 - 4 - 1) / 2 + 1 */
  /* the same generator state draws the same weights */
  kiln_generator *g1 = kiln_generator_new(3), *g2 = kiln_generator_new(3);
  kiln_module *a1 = kiln_conv2d_new(4, 8, k3, NULL, NULL, NULL, 1, true, KILN_F32, cpu, g1);
  kiln_module *a2 = kiln_conv2d_new(4, 8, k3, NULL, NULL, NULL, 1, true, KILN_F32, cpu, g2);
  CHECK(max_abs_diff(kiln_module_param(a1, "weight"), kiln_module_param(a2, "weight")) == 0.0);
  CHECK(max_abs_diff(kiln_module_param(a1, "bias"), kiln_module_param(a2, "bias")) == 0.0);
  /* padding "same" keeps the size (an even kernel puts the extra column after) */
  const int64_t same[2] = {KILN_PADDING_SAME, KILN_PADDING_SAME}, k4[2] = {4, 2};
  kiln_module *cs = kiln_conv2d_new(3, 5, k4, NULL, same, NULL, 1, false, KILN_F32, cpu, g);
  kiln_tensor *ys = cs ? kiln_module_forward(cs, kiln_randn(KILN_SHAPE(1, 3, 7, 6), KILN_F32, cpu, g)) : NULL;
  CHECK(ys && kiln_size(ys, 2) == 7 && kiln_size(ys, 3) == 6 && !kiln_module_param(cs, "bias"));
  /* Conv1d: weight (out, in/groups, k), "same" */
  kiln_module *c1 = kiln_conv1d_new(6, 4, 5, 1, KILN_PADDING_SAME, 1, 2, true, KILN_F32, cpu, g);
  CHECK(c1 && kiln_size(kiln_module_param(c1, "weight"), 1) == 3 && kiln_ndim(kiln_module_param(c1, "weight")) == 3);
  kiln_tensor *x1 = kiln_randn(KILN_SHAPE(2, 6, 11), KILN_F32, cpu, g);
  kiln_tensor *y1 = c1 ? kiln_module_forward(c1, x1) : NULL;
  CHECK(y1 && kiln_size(y1, 2) == 11 &&
        max_abs_diff(y1, kiln_conv1d(x1, kiln_module_param(c1, "weight"), kiln_module_param(c1, "bias"), 1,
                                     KILN_PADDING_SAME, 1, 2)) == 0.0);
  /* ConvTranspose2d: weight (in, out/groups, kh, kw), fan_in from dim 1: out/groups * k area */
  const int64_t op1[2] = {1, 1};
  kiln_module *ct = kiln_conv_transpose2d_new(16, 96, k3, s2, p1, op1, NULL, 1, true, KILN_F32, cpu, g);
  kiln_tensor *wt = ct ? kiln_module_param(ct, "weight") : NULL;
  CHECK(wt && kiln_size(wt, 0) == 16 && kiln_size(wt, 1) == 96);
  if (wt) check_uniform(wt, 1 / sqrt(96.0 * 9), "ConvTranspose2d weight");
  kiln_tensor *yt = ct ? kiln_module_forward(ct, kiln_randn(KILN_SHAPE(1, 16, 5, 5), KILN_F32, cpu, g)) : NULL;
  CHECK(yt && kiln_size(yt, 2) == 10 && kiln_size(yt, 3) == 10); /* (5-1)*2 - 2 + 2 + 1 + 1 */
  kiln_module_free(c), kiln_module_free(a1), kiln_module_free(a2), kiln_module_free(cs);
  kiln_module_free(c1), kiln_module_free(ct);
  kiln_generator_free(g), kiln_generator_free(g1), kiln_generator_free(g2);
  kiln_scope_end();
}

static void test_pools(void) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(11);
  kiln_tensor *x = kiln_randn(KILN_SHAPE(2, 3, 9, 8), KILN_F32, cpu, g);
  const int64_t k3[2] = {3, 3}, s2[2] = {2, 2}, p1[2] = {1, 1}, o[2] = {2, 3};
  kiln_module *mp = kiln_max_pool2d_new(k3, s2, p1, NULL);
  kiln_module *ap = kiln_avg_pool2d_new(k3, NULL, p1);
  kiln_module *ad = kiln_adaptive_avg_pool2d_new(o);
  CHECK(mp && ap && ad);
  CHECK(max_abs_diff(kiln_module_forward(mp, x), kiln_max_pool2d(x, k3, s2, p1, NULL, NULL)) == 0.0);
  kiln_tensor *ya = kiln_module_forward(ap, x); /* stride NULL: the kernel */
  CHECK(ya && kiln_size(ya, 2) == 3 && max_abs_diff(ya, kiln_avg_pool2d(x, k3, k3, p1)) == 0.0);
  kiln_tensor *yd = kiln_module_forward(ad, x);
  CHECK(yd && kiln_size(yd, 2) == 2 && kiln_size(yd, 3) == 3 && max_abs_diff(yd, kiln_adaptive_avg_pool2d(x, o)) == 0.0);
  /* errors */
  const int64_t big_pad[2] = {2, 2}, zero[2] = {0, 3};
  CHECK(!kiln_max_pool2d_new(k3, NULL, big_pad, NULL) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT &&
        strstr(kiln_last_error_message(), "padding 2"));
  CHECK(!kiln_avg_pool2d_new(zero, NULL, NULL) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(!kiln_adaptive_avg_pool2d_new(zero) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(!kiln_max_pool2d_new(NULL, NULL, NULL, NULL) && strstr(kiln_last_error_message(), "kernel_size is NULL"));
  /* a kernel larger than the padded input: the op's error, naming the op */
  const int64_t k9[2] = {9, 9};
  kiln_module *huge = kiln_max_pool2d_new(k9, NULL, NULL, NULL);
  CHECK(huge && !kiln_module_forward(huge, kiln_randn(KILN_SHAPE(1, 1, 4, 4), KILN_F32, cpu, g)) &&
        kiln_last_error() == KILN_ERR_SHAPE && strstr(kiln_last_error_message(), "max_pool2d"));
  kiln_module_free(mp), kiln_module_free(ap), kiln_module_free(ad), kiln_module_free(huge);
  kiln_generator_free(g);
  kiln_scope_end();
}

/* d/dp of sum(forward(x) * r) by central differences against backward (f64), at a dozen
** entries of p; the worst error relative to the largest gradient. The module runs in train
** mode (BatchNorm on batch statistics). */
static double fd_err(kiln_module *m, kiln_tensor *x, kiln_tensor *p, kiln_tensor *r) {
  kiln_scope_begin();
  kiln_tensor *ps[16];
  int np = kiln_module_parameters(m, ps, 16);
  for (int i = 0; i < np && i < 16; i++)
    if (kiln_grad(ps[i])) kiln_zero_(kiln_grad(ps[i])); /* backward accumulates */
  kiln_backward(kiln_sum_all(kiln_mul(kiln_module_forward(m, x), r)), NULL);
  kiln_tensor *gr = kiln_grad(p);
  int64_t n = kiln_numel(p);
  double *v = malloc((size_t)n * sizeof *v), *ga = malloc((size_t)n * sizeof *ga), worst = 0, scale = 1e-3;
  kiln_to_host(p, v, (size_t)n * sizeof *v);
  kiln_to_host(gr, ga, (size_t)n * sizeof *ga);
  bool was = kiln_set_grad_enabled(false);
  for (int64_t i = 0; i < n; i += n > 24 ? n / 12 : 1) {
    const double h = 1e-6, v0 = v[i];
    double f[2];
    for (int s = 0; s < 2; s++) {
      v[i] = v0 + (s ? -h : h);
      kiln_copy_(p, kiln_from_data(v, kiln_ndim(p), kiln_shape(p), KILN_F64, cpu));
      f[s] = kiln_item(kiln_sum_all(kiln_mul(kiln_module_forward(m, x), r)));
    }
    v[i] = v0;
    kiln_copy_(p, kiln_from_data(v, kiln_ndim(p), kiln_shape(p), KILN_F64, cpu));
    double fd = (f[0] - f[1]) / (2 * h);
    worst = fmax(worst, fabs(fd - ga[i]));
    scale = fmax(scale, fabs(ga[i]));
  }
  kiln_set_grad_enabled(was);
  free(v), free(ga);
  kiln_scope_end();
  return worst / scale;
}

static void test_gradients_and_views(void) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(5);
  const int64_t k3[2] = {3, 3}, p1[2] = {1, 1}, s2[2] = {2, 2};
  kiln_module *net = kiln_sequential_of(3, (kiln_module *[]){
      kiln_conv2d_new(4, 6, k3, s2, p1, NULL, 2, true, KILN_F64, cpu, g),
      kiln_batch_norm2d_new(6, 1e-5, 0.1, true, true, KILN_F64, cpu),
      kiln_group_norm_new(3, 6, 1e-5, true, KILN_F64, cpu)});
  CHECK(net != NULL);
  /* x (N, C, H, W) as a permuted view of (N, H, W, C): not contiguous */
  kiln_tensor *xs = kiln_randn(KILN_SHAPE(3, 7, 6, 4), KILN_F64, cpu, g);
  kiln_requires_grad_(xs, true); /* before the view, so the view records its backward */
  kiln_tensor *x = kiln_permute(xs, 4, (const int[]){0, 3, 1, 2});
  CHECK(x && !kiln_is_contiguous(x));
  kiln_tensor *r = kiln_randn(KILN_SHAPE(3, 6, 4, 3), KILN_F64, cpu, g);
  /* a forward on the view equals one on its contiguous copy (eval: no running-stat update) */
  kiln_module_eval(net);
  CHECK(max_abs_diff(kiln_module_forward(net, x), kiln_module_forward(net, kiln_contiguous(x))) < 1e-12);
  kiln_module_train(net, true);
  /* (the conv's bias is left out: BatchNorm removes each channel's mean, so its gradient
  ** is zero) */
  const char *names[] = {"input", "0.weight", "1.weight", "1.bias", "2.weight", "2.bias"};
  for (int i = 0; i < 6; i++) {
    kiln_tensor *p = i == 0 ? xs : kiln_module_param(net, names[i]);
    double e = p ? fd_err(net, x, p, r) : INFINITY;
    if (!(e < 1e-6) || getenv("KILN_TEST_VERBOSE")) fprintf(stderr, "gradient of %s: relative error %g\n", names[i], e);
    CHECK(e < 1e-6);
  }
  kiln_module_free(net);
  kiln_generator_free(g);
  kiln_scope_end();
}

static void test_batch_norm(void) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(9);
  kiln_module *bn = kiln_batch_norm2d_new(3, 1e-5, 0.1, true, true, KILN_F32, cpu);
  CHECK(bn && !strcmp(kiln_module_type_name(bn), "BatchNorm2d"));
  /* parameters for the optimizer: weight, bias; buffers: the three statistics */
  CHECK(kiln_module_parameters(bn, NULL, 0) == 2);
  const char *bnames[4];
  CHECK(kiln_module_named_buffers(bn, bnames, NULL, 4) == 3 && !strcmp(bnames[0], "running_mean") &&
        !strcmp(bnames[1], "running_var") && !strcmp(bnames[2], "num_batches_tracked"));
  kiln_dict *sd = kiln_module_state_dict(bn);
  CHECK(sd && kiln_dict_size(sd) == 5 && kiln_dict_get(sd, "num_batches_tracked") &&
        kiln_dtype_of(kiln_dict_get(sd, "num_batches_tracked")) == KILN_I64);
  CHECK(kiln_item(kiln_amin(kiln_module_param(bn, "weight"), 0, NULL, false)) == 1.0);
  CHECK(kiln_item(kiln_amax(kiln_abs(kiln_module_param(bn, "bias")), 0, NULL, false)) == 0.0);
  /* train: batch statistics, then running = 0.9 running + 0.1 stat (unbiased var) */
  kiln_tensor *x = kiln_add_scalar(kiln_mul_scalar(kiln_randn(KILN_SHAPE(4, 3, 5, 5), KILN_F32, cpu, g), 2.0), 3.0);
  const int dims[3] = {0, 2, 3};
  kiln_tensor *mean = kiln_mean(x, 3, dims, false);
  kiln_tensor *d = kiln_sub(x, kiln_reshape(mean, KILN_SHAPE(1, 3, 1, 1)));
  kiln_tensor *var_b = kiln_mean(kiln_mul(d, d), 3, dims, false);      /* biased */
  kiln_tensor *var_u = kiln_mul_scalar(var_b, 100.0 / 99.0);             /* unbiased, n = 100 */
  kiln_tensor *y = kiln_module_forward(bn, x);
  kiln_tensor *want = kiln_div(d, kiln_sqrt(kiln_add_scalar(kiln_reshape(var_b, KILN_SHAPE(1, 3, 1, 1)), 1e-5)));
  CHECK(max_abs_diff(y, want) < 1e-5);
  CHECK(max_abs_diff(kiln_module_buffer(bn, "running_mean"), kiln_mul_scalar(mean, 0.1)) < 1e-6);
  CHECK(max_abs_diff(kiln_module_buffer(bn, "running_var"), kiln_add_scalar(kiln_mul_scalar(var_u, 0.1), 0.9)) < 1e-5);
  CHECK(scalar(kiln_module_buffer(bn, "num_batches_tracked")) == 1.0);
  kiln_module_forward(bn, x);
  CHECK(scalar(kiln_module_buffer(bn, "num_batches_tracked")) == 2.0);
  /* eval: the running statistics, no update */
  kiln_module_eval(bn);
  kiln_tensor *rm = kiln_reshape(kiln_module_buffer(bn, "running_mean"), KILN_SHAPE(1, 3, 1, 1));
  kiln_tensor *rv = kiln_reshape(kiln_module_buffer(bn, "running_var"), KILN_SHAPE(1, 3, 1, 1));
  kiln_tensor *ye = kiln_module_forward(bn, x);
  CHECK(max_abs_diff(ye, kiln_div(kiln_sub(x, rm), kiln_sqrt(kiln_add_scalar(rv, 1e-5)))) < 1e-5);
  CHECK(scalar(kiln_module_buffer(bn, "num_batches_tracked")) == 2.0);
  /* the state dict round trip carries the buffers */
  kiln_module *bn2 = kiln_batch_norm2d_new(3, 1e-5, 0.1, true, true, KILN_F32, cpu);
  kiln_dict_free(sd);
  sd = kiln_module_state_dict(bn);
  CHECK(kiln_module_load_state_dict(bn2, sd, true) == KILN_OK);
  CHECK(max_abs_diff(kiln_module_buffer(bn2, "running_var"), kiln_module_buffer(bn, "running_var")) == 0.0);
  CHECK(scalar(kiln_module_buffer(bn2, "num_batches_tracked")) == 2.0);
  /* to_dtype casts the floating buffers, not the count */
  CHECK(kiln_module_to_dtype(bn2, KILN_F64) == KILN_OK &&
        kiln_dtype_of(kiln_module_buffer(bn2, "running_mean")) == KILN_F64 &&
        kiln_dtype_of(kiln_module_buffer(bn2, "num_batches_tracked")) == KILN_I64);
  /* momentum NAN: the cumulative average of the batch means */
  kiln_module *cum = kiln_batch_norm1d_new(3, 1e-5, NAN, false, true, KILN_F32, cpu);
  kiln_tensor *a = kiln_randn(KILN_SHAPE(8, 3), KILN_F32, cpu, g), *b = kiln_randn(KILN_SHAPE(8, 3), KILN_F32, cpu, g);
  CHECK(cum && kiln_module_parameters(cum, NULL, 0) == 0);
  kiln_module_forward(cum, a);
  kiln_module_forward(cum, b);
  kiln_tensor *avg = kiln_mul_scalar(kiln_add(kiln_mean(a, 1, (const int[]){0}, false), kiln_mean(b, 1, (const int[]){0}, false)), 0.5);
  CHECK(max_abs_diff(kiln_module_buffer(cum, "running_mean"), avg) < 1e-6);
  /* track_running_stats false: no buffers, batch statistics in eval too */
  kiln_module *nt = kiln_batch_norm1d_new(3, 1e-5, 0.1, true, false, KILN_F32, cpu);
  CHECK(nt && kiln_module_named_buffers(nt, NULL, NULL, 0) == 0);
  kiln_module_eval(nt);
  kiln_tensor *yn = nt ? kiln_module_forward(nt, a) : NULL;
  CHECK(yn && fabs(kiln_item(kiln_mean(yn, 0, NULL, false))) < 1e-5);
  /* BatchNorm1d on (N, C, L) */
  kiln_module *b1 = kiln_batch_norm1d_new(3, 1e-5, 0.1, true, true, KILN_F32, cpu);
  CHECK(b1 && kiln_module_forward(b1, kiln_randn(KILN_SHAPE(2, 3, 4), KILN_F32, cpu, g)) != NULL);
  /* errors: rank, channels, one value per channel in training, bad arguments */
  CHECK(!kiln_module_forward(b1, kiln_randn(KILN_SHAPE(2, 3, 4, 4), KILN_F32, cpu, g)) &&
        kiln_last_error() == KILN_ERR_SHAPE && strstr(kiln_last_error_message(), "BatchNorm1d"));
  CHECK(!kiln_module_forward(bn, kiln_randn(KILN_SHAPE(2, 4, 4, 4), KILN_F32, cpu, g)) &&
        kiln_last_error() == KILN_ERR_SHAPE && strstr(kiln_last_error_message(), "4 channels"));
  CHECK(!kiln_module_forward(b1, kiln_randn(KILN_SHAPE(1, 3), KILN_F32, cpu, g)) &&
        kiln_last_error() == KILN_ERR_SHAPE);
  CHECK(!kiln_batch_norm2d_new(0, 1e-5, 0.1, true, true, KILN_F32, cpu) &&
        kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(!kiln_batch_norm2d_new(3, 1e-5, 1.5, true, true, KILN_F32, cpu) &&
        strstr(kiln_last_error_message(), "momentum 1.5"));
  CHECK(!kiln_batch_norm2d_new(3, 1e-5, 0.1, true, true, KILN_I64, cpu) && kiln_last_error() == KILN_ERR_DTYPE);
  kiln_dict_free(sd);
  kiln_module_free(bn), kiln_module_free(bn2), kiln_module_free(cum), kiln_module_free(nt), kiln_module_free(b1);
  kiln_generator_free(g);
  kiln_scope_end();
}

static void test_group_norm_and_dropout2d(void) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(13);
  kiln_module *gn = kiln_group_norm_new(2, 6, 1e-5, true, KILN_F32, cpu);
  kiln_tensor *x = kiln_randn(KILN_SHAPE(3, 6, 4, 4), KILN_F32, cpu, g);
  CHECK(gn && kiln_module_parameters(gn, NULL, 0) == 2 &&
        max_abs_diff(kiln_module_forward(gn, x), kiln_group_norm(x, 2, NULL, NULL, 1e-5)) < 1e-6);
  CHECK(!kiln_group_norm_new(4, 6, 1e-5, true, KILN_F32, cpu) && strstr(kiln_last_error_message(), "num_groups 4"));
  kiln_module *gn0 = kiln_group_norm_new(3, 6, 1e-5, false, KILN_F32, cpu);
  CHECK(gn0 && kiln_module_parameters(gn0, NULL, 0) == 0);
  /* Dropout2d: each (n, c) plane all zero or all x / (1 - p); eval: identity */
  kiln_module *dr = kiln_dropout2d_new(0.5, g);
  kiln_tensor *ones = kiln_ones(KILN_SHAPE(8, 16, 3, 3), KILN_F32, cpu);
  kiln_tensor *y = dr ? kiln_module_forward(dr, ones) : NULL;
  kiln_tensor *pmin = y ? kiln_amin(y, 2, (const int[]){2, 3}, false) : NULL;
  kiln_tensor *pmax = y ? kiln_amax(y, 2, (const int[]){2, 3}, false) : NULL;
  CHECK(pmin && max_abs_diff(pmin, pmax) == 0.0); /* constant planes */
  double kept = pmax ? kiln_item(kiln_sum_all(pmax)) / 2.0 : -1;   /* each kept plane is 2 */
  CHECK(kept > 128 * 0.3 && kept < 128 * 0.7 && kiln_item(kiln_amax(y, 0, NULL, false)) == 2.0);
  kiln_module_eval(dr);
  CHECK(max_abs_diff(kiln_module_forward(dr, ones), ones) == 0.0);
  CHECK(!kiln_dropout2d_new(1.5, NULL) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  kiln_module_free(gn), kiln_module_free(gn0), kiln_module_free(dr);
  kiln_generator_free(g);
  kiln_scope_end();
}

static void test_conv_errors(void) {
  const int64_t k3[2] = {3, 3}, s2[2] = {2, 2}, same[2] = {KILN_PADDING_SAME, KILN_PADDING_SAME};
  const int64_t k0[2] = {0, 3}, neg[2] = {-2, 0};
  CHECK(!kiln_conv2d_new(6, 4, k3, NULL, NULL, NULL, 4, true, KILN_F32, cpu, NULL) &&
        kiln_last_error() == KILN_ERR_INVALID_ARGUMENT && strstr(kiln_last_error_message(), "groups 4"));
  CHECK(!kiln_conv2d_new(3, 4, k3, s2, same, NULL, 1, true, KILN_F32, cpu, NULL) &&
        strstr(kiln_last_error_message(), "\"same\""));
  CHECK(!kiln_conv2d_new(3, 4, k0, NULL, NULL, NULL, 1, true, KILN_F32, cpu, NULL) &&
        strstr(kiln_last_error_message(), "kernel 0"));
  CHECK(!kiln_conv2d_new(3, 4, k3, NULL, neg, NULL, 1, true, KILN_F32, cpu, NULL) &&
        strstr(kiln_last_error_message(), "padding -2"));
  CHECK(!kiln_conv2d_new(3, 4, NULL, NULL, NULL, NULL, 1, true, KILN_F32, cpu, NULL) &&
        strstr(kiln_last_error_message(), "kernel_size is NULL"));
  CHECK(!kiln_conv2d_new(0, 4, k3, NULL, NULL, NULL, 1, true, KILN_F32, cpu, NULL));
  CHECK(!kiln_conv2d_new(3, 4, k3, NULL, NULL, NULL, 1, true, KILN_I32, cpu, NULL) &&
        kiln_last_error() == KILN_ERR_DTYPE);
  CHECK(!kiln_conv1d_new(3, 4, 3, 2, KILN_PADDING_SAME, 1, 1, true, KILN_F32, cpu, NULL));
  CHECK(!kiln_conv_transpose2d_new(3, 4, k3, NULL, NULL, s2, NULL, 1, true, KILN_F32, cpu, NULL) &&
        strstr(kiln_last_error_message(), "output_padding 2"));
  /* forward: a kernel larger than the input, a channel mismatch: the op names the shapes */
  kiln_scope_begin();
  kiln_module *c = kiln_conv2d_new(3, 4, k3, NULL, NULL, NULL, 1, true, KILN_F32, cpu, NULL);
  CHECK(!kiln_module_forward(c, kiln_zeros(KILN_SHAPE(1, 3, 2, 2), KILN_F32, cpu)) &&
        kiln_last_error() == KILN_ERR_SHAPE && strstr(kiln_last_error_message(), "conv2d"));
  CHECK(!kiln_module_forward(c, kiln_zeros(KILN_SHAPE(1, 5, 8, 8), KILN_F32, cpu)) &&
        kiln_last_error() == KILN_ERR_SHAPE && strstr(kiln_last_error_message(), "[1, 5, 8, 8]"));
  kiln_module_free(c);
  kiln_scope_end();
}

int main(void) {
  cpu = kiln_device_cpu();
  test_conv_init_and_forward();
  test_pools();
  test_gradients_and_views();
  test_batch_norm();
  test_group_norm_and_dropout2d();
  test_conv_errors();
  printf("test_nn_cnn: %d failure(s)\n", failures);
  return failures ? 1 : 0;
}
