/*
** The convolution family on CUDA (issue 15): skipped (exit 77) without a CUDA device.
**
** 1. The family's harness cases (test_ops_conv.c), part (d) only: forward and backward
**    on cuda:0 against the CPU in f64/f32/f16/bf16, every variant, with the fallback off
**    (H_CUDA_NATIVE): IM2COL, COL2IM, MAX_POOL2D, and with cuDNN CONV2D and its backward.
** 2. conv2d forward and backward (autograd) on CUDA against the CPU over random, strided,
**    padded, dilated, grouped, depthwise, 1x1, asymmetric ("same", even kernel) shapes,
**    with contiguous, non-contiguous (a transposed view) and channels-last-strided inputs:
**    f64 and f32 tight (TF32 off), f16/bf16 loose. The fallback policy is "error", so a
**    kernel that fell back to the CPU fails the run. With cuDNN a channels-last input
**    must give a channels-last output.
** 3. The CUDA kernels called directly against the CPU's: CONV2D_BACKWARD_DATA/_WEIGHT
**    (with the bias gradient) when the device has them (cuDNN); MAX_POOL2D's indices on
**    ties and NaN (must be identical).
** 4. A conv forward + backward captured into a CUDA graph and replayed equals eager.
** 4b. conv2d_relu_max_pool2d (the fused one-channel conv, ReLU, max-pool and its weight and
**    bias gradients) against the CPU, and relu_max_pool2d's values and gradients with ties,
**    NaN and an uncovered edge (identical bits).
** 4c. The direct TF32 kernels (cuda_conv_direct.cu: small f32 convolutions with TF32
**    allowed, stride and dilation 1, ungrouped): forward with and without bias, the input
**    gradient (written and added, CONV2D_BACKWARD_DATA_ACC), the weight and bias
**    gradients, over shapes that cover the kernels' edges (rows not a multiple of 16 or
**    over 64, taps not a multiple of 8, pixel ranges split over blocks, image ranges in
**    the weight gradient), against the CPU in f64 within TF32's rounding; fashion-mnist's
**    second convolution must be taken by them (unless KILN_CONV_DIRECT=0), and a captured
**    step equals the eager one to the bit.
** 4d. Stride-2 16-bit convolutions of images with at most 4 channels (a ResNet stem) on
**    CUDA, whose forward and weight gradient go through the space-to-depth path
**    (cuda_conv_s2d.cu; KILN_CONV_S2D=0 turns it off): the path must take them (and not
**    the data gradient), and y, dx, dw, db must match the CPU's f64 on the same
**    bf16/f16-rounded inputs, with channels-last and contiguous weights, odd sizes, one to
**    four channels, padding other than k/2, an even kernel.
** 5. Channels-last end to end (cv_keep_format_on, test_ops_conv.c): conv2d, relu, add,
**    casts, max_pool2d keep the format on CUDA and give the NCHW run's values (f64, f32
**    with gradients; f16/bf16 forward), and with cuDNN a channels-last step (forward and
**    backward, also under bf16 autocast) makes no layout copy (no contiguous or
**    contiguous_format op runs, counted by an observer).
** It prints whether cuDNN serves CONV2D, so a log says which path was tested.
*/
#define H_NO_MAIN
#include "test_ops_conv.c"

#include "backend/backend.h"
#include "core/kiln_int.h"
#include "ops/op.h"

#include <math.h>
#include <stdio.h>

static bool cc_cudnn; /* cuda:0 runs CONV2D (cuDNN) */
#if defined(KILN_HAVE_CUDA) && !defined(CC_GPU_IS_CPU)
bool kiln__cuda_conv_direct_supports(const kiln__kargs *a); /* cuda_conv_direct.cu */
bool kiln__cuda_conv_s2d_supports(const kiln__kargs *a);    /* cuda_conv_s2d.cu */
#endif

static kiln_device cc_cpu(void) { return kiln_device_cpu(); }
#ifdef CC_GPU_IS_CPU /* a check of the test's own logic on a machine without a GPU */
static kiln_device cc_gpu(void) { return kiln_device_cpu(); }
#else
static kiln_device cc_gpu(void) { return kiln_device_cuda(0); }
#endif

/* t as f64 host values (malloc'd; NULL on failure) */
static double *cc_host(kiln_tensor *t) {
  if (!t) return NULL;
  kiln_tensor *h = kiln_contiguous(kiln_to_dtype(kiln_to_device(t, cc_cpu()), KILN_F64));
  if (!h) return NULL;
  int64_t n = kiln_numel(h);
  double *v = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  if (v && kiln_to_host(h, v, (size_t)n * sizeof(double)) != KILN_OK) {
    free(v);
    v = NULL;
  }
  return v;
}

static void cc_tol(kiln_dtype dt, double *rtol, double *atol) {
  switch (dt) {
  case KILN_F64: *rtol = 1e-10, *atol = 1e-10; break;
  case KILN_F32: *rtol = 1e-4, *atol = 1e-5; break;
  case KILN_F16: *rtol = 2e-2, *atol = 1e-2; break;
  default: *rtol = 8e-2, *atol = 5e-2; break; /* bf16 */
  }
}

static bool cc_same(const char *what, kiln_tensor *got, kiln_tensor *want, kiln_dtype dt) {
  if (!got || !want) return H_CHECK(false, "%s: %s result missing", what, got ? "the CPU's" : "the CUDA");
  double *g = cc_host(got), *w = cc_host(want);
  bool ok = false;
  if (!g || !w) {
    H_CHECK(false, "%s: could not read the results: %s", what, kiln_last_error_message());
  } else if (kiln_numel(got) != kiln_numel(want)) {
    H_CHECK(false, "%s: %lld elements, expected %lld", what, (long long)kiln_numel(got),
            (long long)kiln_numel(want));
  } else {
    double rtol, atol;
    cc_tol(dt, &rtol, &atol);
    ok = h_close(what, g, w, kiln_numel(want), rtol, atol);
  }
  free(g), free(w);
  return ok;
}

/* layouts of x: 0 contiguous, 1 a transposed view (H and W swapped in memory), 2
** channels-last strides (N, H, W, C in memory) */
static const char *const cc_layout_name[3] = {"contiguous", "transposed", "channels-last"};

static kiln_tensor *cc_layout(kiln_tensor *x, int layout) {
  if (layout == 1) {
    kiln_tensor *t = kiln_contiguous(kiln_transpose(x, 2, 3)); /* (N, C, W, H) in memory */
    return kiln_transpose(t, 2, 3);
  }
  if (layout == 2) {
    int to_nhwc[4] = {0, 2, 3, 1}, to_nchw[4] = {0, 3, 1, 2};
    return kiln_permute(kiln_contiguous(kiln_permute(x, 4, to_nhwc)), 4, to_nchw);
  }
  return x;
}

typedef struct cc_conv {
  int64_t N, C, H, W, OC, KH, KW;
  int64_t s[2], p[2], d[2], g;
  int bias;
} cc_conv;

static const cc_conv cc_convs[] = {
    {2, 3, 9, 8, 4, 3, 3, {1, 1}, {1, 1}, {1, 1}, 1, 1},                                 /* 3x3 same-size */
    {2, 4, 11, 10, 6, 3, 2, {2, 1}, {1, 0}, {1, 2}, 2, 1},                               /* strided dilated grouped */
    {1, 6, 7, 7, 6, 3, 3, {2, 2}, {1, 1}, {1, 1}, 6, 0},                                 /* depthwise */
    {3, 8, 5, 6, 5, 1, 1, {1, 1}, {0, 0}, {1, 1}, 1, 1},                                 /* 1x1 */
    {2, 3, 8, 9, 4, 4, 2, {1, 1}, {KILN_PADDING_SAME, KILN_PADDING_SAME}, {1, 1}, 1, 1}, /* asymmetric pad */
    {2, 16, 14, 14, 32, 3, 3, {2, 2}, {1, 1}, {1, 1}, 1, 0},                             /* a ResNet-like layer */
    {1, 2, 6, 5, 2, 5, 5, {1, 1}, {2, 2}, {1, 1}, 1, 1},                                 /* kernel as big as x */
};

/* y = conv2d(x, w, b); loss = sum(y * r); returns y and the three gradients */
static kiln_status cc_run(const cc_conv *k, kiln_tensor *xb, kiln_tensor *wb, kiln_tensor *bb, kiln_tensor *rb,
                          kiln_dtype dt, kiln_device dev, int layout, kiln_tensor *res[4]) {
  /* detached leaves of their own (on the CPU the conversions return the bases themselves) */
  kiln_tensor *x = kiln_detach(kiln_contiguous(kiln_to_dtype(kiln_to_device(xb, dev), dt)));
  kiln_tensor *w = kiln_detach(kiln_contiguous(kiln_to_dtype(kiln_to_device(wb, dev), dt)));
  kiln_tensor *b = k->bias ? kiln_detach(kiln_contiguous(kiln_to_dtype(kiln_to_device(bb, dev), dt))) : NULL;
  kiln_tensor *r = kiln_to_dtype(kiln_to_device(rb, dev), dt);
  if (!x || !w || !r || (k->bias && !b)) return kiln_last_error();
  if (kiln_requires_grad_(x, true) != KILN_OK || kiln_requires_grad_(w, true) != KILN_OK ||
      (b && kiln_requires_grad_(b, true) != KILN_OK))
    return kiln_last_error();
  kiln_tensor *xv = cc_layout(x, layout);
  kiln_tensor *y = kiln_conv2d(xv, w, b, k->s, k->p, k->d, k->g);
  kiln_tensor *loss = kiln_sum_all(kiln_mul(y, r));
  if (!loss) return kiln_last_error();
  kiln_status st = kiln_backward(loss, NULL);
  if (st != KILN_OK) return st;
  res[0] = y, res[1] = kiln_grad(x), res[2] = kiln_grad(w), res[3] = b ? kiln_grad(b) : NULL;
  return KILN_OK;
}

static void cc_conv_vs_cpu(void) {
  static const kiln_dtype dts[4] = {KILN_F64, KILN_F32, KILN_F16, KILN_BF16};
  kiln_set_matmul_tf32(false);
  for (size_t ci = 0; ci < sizeof cc_convs / sizeof cc_convs[0]; ci++) {
    const cc_conv *k = &cc_convs[ci];
    for (int layout = 0; layout < 3; layout++)
      for (int di = 0; di < 4; di++) {
        kiln_dtype dt = dts[di];
        kiln_scope_begin();
        kiln_generator *gen = kiln_generator_new(1000 + ci);
        kiln_tensor *xb = kiln_randn(KILN_SHAPE(k->N, k->C, k->H, k->W), KILN_F64, cc_cpu(), gen);
        kiln_tensor *wb = kiln_randn(KILN_SHAPE(k->OC, k->C / k->g, k->KH, k->KW), KILN_F64, cc_cpu(), gen);
        kiln_tensor *bb = kiln_randn(KILN_SHAPE(k->OC), KILN_F64, cc_cpu(), gen);
        /* the output's shape, from a CPU run in f64 */
        kiln_tensor *y0 = kiln_conv2d(xb, wb, bb, k->s, k->p, k->d, k->g);
        kiln_tensor *rb = y0 ? kiln_randn(4, kiln_shape(y0), KILN_F64, cc_cpu(), gen) : NULL;
        kiln_generator_free(gen);
        char what[160];
        snprintf(what, sizeof what, "conv case %zu %s %s", ci, cc_layout_name[layout], kiln_dtype_name(dt));
        kiln_tensor *want[4] = {0}, *got[4] = {0};
        kiln_fallback_policy saved = kiln_fallback_policy_get();
        kiln_status s1 = rb ? cc_run(k, xb, wb, bb, rb, dt, cc_cpu(), layout, want) : kiln_last_error();
        kiln_set_fallback_policy(KILN_FALLBACK_ERROR);
        kiln_status s2 = rb ? cc_run(k, xb, wb, bb, rb, dt, cc_gpu(), layout, got) : kiln_last_error();
        kiln_set_fallback_policy(saved);
        if (s1 != KILN_OK || s2 != KILN_OK) {
          H_CHECK(false, "%s: %s run failed: %s", what, s1 != KILN_OK ? "CPU" : "CUDA", kiln_last_error_message());
        } else {
          /* with cuDNN a channels-last input gives a channels-last output */
          if (layout == 2 && cc_cudnn && dt != KILN_F64 && k->p[0] != KILN_PADDING_SAME) /* asymmetric: composed */
            H_CHECK(kiln_is_contiguous_format(got[0], KILN_CHANNELS_LAST), "%s: the output is not channels-last", what);
          static const char *const part[4] = {"y", "dx", "dw", "db"};
          for (int q = 0; q < 4; q++) {
            if (!want[q] && !got[q]) continue;
            char name[200];
            snprintf(name, sizeof name, "%s %s", what, part[q]);
            cc_same(name, got[q], want[q], dt);
          }
        }
        kiln_scope_end();
      }
  }
}

/* The backward kernels on cuda:0 against the CPU's reference loops, through dispatch. */
static void cc_backward_kernels(void) {
  for (size_t ci = 0; ci < sizeof cc_convs / sizeof cc_convs[0]; ci++) {
    const cc_conv *k = &cc_convs[ci];
    if (k->p[0] == KILN_PADDING_SAME) continue; /* asymmetric: cuDNN does not take it */
    for (int di = 0; di < 2; di++) {
      kiln_dtype dt = di ? KILN_BF16 : KILN_F32;
      kiln_scope_begin();
      kiln_generator *gen = kiln_generator_new(77 + ci);
      kiln_tensor *x = kiln_to_dtype(kiln_randn(KILN_SHAPE(k->N, k->C, k->H, k->W), KILN_F64, cc_cpu(), gen), dt);
      kiln_tensor *w = kiln_to_dtype(kiln_randn(KILN_SHAPE(k->OC, k->C / k->g, k->KH, k->KW), KILN_F64, cc_cpu(), gen), dt);
      kiln_tensor *y = kiln_conv2d(x, w, NULL, k->s, k->p, k->d, k->g);
      kiln_tensor *g = y ? kiln_to_dtype(kiln_randn(4, kiln_shape(y), KILN_F64, cc_cpu(), gen), dt) : NULL;
      kiln_generator_free(gen);
      if (!g) {
        H_CHECK(false, "backward kernels: setup failed: %s", kiln_last_error_message());
        kiln_scope_end();
        continue;
      }
      kiln__conv_params cp = {{k->KH, k->KW}, {k->s[0], k->s[1]}, {k->p[0], k->p[1]}, {k->d[0], k->d[1]}};
      for (int op = 0; op < 2; op++) {
        kiln__kop kop = op ? KILN__K_CONV2D_BACKWARD_WEIGHT : KILN__K_CONV2D_BACKWARD_DATA;
        kiln_tensor *in0 = op ? x : g, *in1 = op ? g : w, *like = op ? w : x;
        kiln_tensor *outs[2][2] = {{0}};
        kiln_device devs[2] = {cc_cpu(), cc_gpu()};
        bool ran[2] = {false, false};
        for (int d = 0; d < 2; d++) {
          kiln_tensor *a0 = kiln_to_device(in0, devs[d]), *a1 = kiln_to_device(in1, devs[d]);
          outs[d][0] = kiln_empty(4, kiln_shape(like), dt, devs[d]);
          outs[d][1] = op ? kiln_empty(KILN_SHAPE(k->OC), dt, devs[d]) : NULL;
          if (!a0 || !a1 || !outs[d][0]) break;
          kiln__kargs a = {0};
          a.op = kop;
          a.n_in = 2;
          a.in[0] = kiln__view_of(a0), a.in[1] = kiln__view_of(a1);
          a.n_out = op ? 2 : 1;
          a.out[0] = kiln__view_of(outs[d][0]);
          if (op) a.out[1] = kiln__view_of(outs[d][1]);
          a.i[0] = k->g;
          a.params = &cp;
          if (d == 1 && !kiln__dispatch_has(devs[1], &a, kop)) {
            if (ci == 0) printf("test_cuda_conv: cuda:0 has no %s kernel (built without cuDNN?): skipped\n", kiln__kop_name(kop));
            break;
          }
          kiln_status st = kiln__dispatch(devs[d], &a);
          if (st != KILN_OK) {
            H_CHECK(false, "%s on %s: %s", kiln__kop_name(kop), d ? "cuda" : "cpu", kiln_last_error_message());
            break;
          }
          ran[d] = true;
        }
        if (ran[0] && ran[1]) {
          char name[160];
          snprintf(name, sizeof name, "%s case %zu %s", kiln__kop_name(kop), ci, kiln_dtype_name(dt));
          cc_same(name, outs[1][0], outs[0][0], dt);
          if (op) {
            snprintf(name, sizeof name, "%s (bias) case %zu %s", kiln__kop_name(kop), ci, kiln_dtype_name(dt));
            cc_same(name, outs[1][1], outs[0][1], dt);
          }
        }
      }
      kiln_scope_end();
    }
  }
}

/* MAX_POOL2D: the values and indices must be identical to the CPU's, ties and NaN included. */
static void cc_max_pool(void) {
  kiln_scope_begin();
  int64_t n = 2 * 3 * 9 * 10;
  double *v = malloc((size_t)n * sizeof(double));
  for (int64_t i = 0; i < n; i++) v[i] = (double)((i * 7919) % 5); /* many ties */
  v[17] = NAN, v[200] = NAN;
  kiln_tensor *x = kiln_from_data(v, KILN_SHAPE(2, 3, 9, 10), KILN_F64, cc_cpu());
  free(v);
  static const kiln_dtype dts[4] = {KILN_F64, KILN_F32, KILN_F16, KILN_BF16};
  int64_t kk[2] = {3, 2}, st[2] = {2, 1}, pd[2] = {1, 1}, dl[2] = {1, 2};
  for (int di = 0; di < 4; di++) {
    for (int layout = 0; layout < 3; layout++) {
      kiln_tensor *idx[2] = {0}, *y[2] = {0}, *gx[3] = {0};
      kiln_device devs[2] = {cc_cpu(), cc_gpu()};
      for (int d = 0; d < 3; d++) {
        /* d == 2: cuda again, for the backward's determinism */
        kiln_tensor *leaf = kiln_detach(kiln_contiguous(kiln_to_dtype(kiln_to_device(x, devs[d ? 1 : 0]), dts[di])));
        kiln_requires_grad_(leaf, true);
        kiln_tensor *xd = cc_layout(leaf, layout);
        kiln_tensor *yy, *ii;
        yy = kiln_max_pool2d(xd, kk, st, pd, dl, &ii);
        if (d < 2) y[d] = yy, idx[d] = ii;
        /* a weighted sum, so that windows sharing a maximum add different grads */
        kiln_tensor *wts = yy ? kiln_to_dtype(kiln_arange(0, (double)kiln_numel(yy), 1, KILN_F64, devs[d ? 1 : 0]), dts[di]) : NULL;
        kiln_tensor *loss = wts ? kiln_sum_all(kiln_mul(kiln_reshape(yy, 1, (int64_t[]){kiln_numel(yy)}), wts)) : NULL;
        if (loss && kiln_backward(loss, NULL) == KILN_OK) gx[d] = kiln_grad(leaf);
      }
      char gname[128];
      snprintf(gname, sizeof gname, "max_pool2d %s %s backward", kiln_dtype_name(dts[di]), cc_layout_name[layout]);
      if (gx[0] && gx[1] && gx[2]) {
        cc_same(gname, gx[1], gx[0], dts[di]);
        double *a2 = cc_host(gx[1]), *b2 = cc_host(gx[2]);
        strcat(gname, " (run twice: the same bits)");
        if (a2 && b2) h_close(gname, a2, b2, kiln_numel(gx[1]), 0, 0);
        free(a2), free(b2);
      } else {
        H_CHECK(false, "%s failed: %s", gname, kiln_last_error_message());
      }
      char name[128];
      snprintf(name, sizeof name, "max_pool2d %s %s values", kiln_dtype_name(dts[di]), cc_layout_name[layout]);
      double *a = cc_host(y[1]), *b = cc_host(y[0]);
      if (a && b) h_close(name, a, b, kiln_numel(y[0]), 0, 0);
      else H_CHECK(false, "%s: could not read: %s", name, kiln_last_error_message());
      free(a), free(b);
      snprintf(name, sizeof name, "max_pool2d %s %s indices", kiln_dtype_name(dts[di]), cc_layout_name[layout]);
      a = cc_host(idx[1]), b = cc_host(idx[0]);
      if (a && b) h_close(name, a, b, kiln_numel(idx[0]), 0, 0);
      else H_CHECK(false, "%s: could not read: %s", name, kiln_last_error_message());
      free(a), free(b);
    }
  }
  kiln_scope_end();
}

/* ---- the fused first layer: conv (one input channel) + ReLU + max-pool -------------------- */

typedef struct cc_cpool {
  int64_t N, H, W, OC, KH, KW, pad, PK[2];
  int bias;
} cc_cpool;

/* odd sizes, with and without bias, padding 0 and 1, 2x2 and 3x2 pools, a 5x5 kernel, and
** fmnist-cnn's first layer at batch 37 (the backward's image ranges uneven) */
static const cc_cpool cc_cpools[] = {
    {3, 9, 8, 5, 3, 3, 0, {2, 2}, 1},   {3, 9, 8, 5, 3, 3, 1, {2, 2}, 0},  {2, 7, 11, 4, 3, 2, 1, {3, 2}, 1},
    {2, 11, 7, 3, 5, 5, 0, {2, 3}, 0},  {4, 6, 5, 7, 2, 3, 1, {1, 1}, 1},  {37, 28, 28, 32, 3, 3, 0, {2, 2}, 1},
    {5, 13, 15, 9, 3, 3, 1, {2, 2}, 1},
};

/* y = conv2d_relu_max_pool2d(x, w, b); loss = sum(y * r); y, dW, db */
static kiln_status cc_cpool_run(const cc_cpool *k, kiln_tensor *xb, kiln_tensor *wb, kiln_tensor *bb, kiln_tensor *rb,
                                kiln_device dev, kiln_tensor *res[3]) {
  kiln_tensor *x = kiln_to_device(xb, dev), *r = kiln_to_device(rb, dev);
  kiln_tensor *w = kiln_detach(kiln_contiguous(kiln_to_device(wb, dev)));
  kiln_tensor *b = k->bias ? kiln_detach(kiln_contiguous(kiln_to_device(bb, dev))) : NULL;
  if (!x || !w || !r || (k->bias && !b)) return kiln_last_error();
  if (kiln_requires_grad_(w, true) != KILN_OK || (b && kiln_requires_grad_(b, true) != KILN_OK))
    return kiln_last_error();
  int64_t pad[2] = {k->pad, k->pad};
  kiln_tensor *y = kiln_conv2d_relu_max_pool2d(x, w, b, NULL, pad, NULL, 1, k->PK, NULL, NULL, NULL);
  kiln_tensor *loss = kiln_sum_all(kiln_mul(y, r));
  if (!loss) return kiln_last_error();
  kiln_status st = kiln_backward(loss, NULL);
  if (st != KILN_OK) return st;
  res[0] = y, res[1] = kiln_grad(w), res[2] = b ? kiln_grad(b) : NULL;
  return KILN_OK;
}

/* kiln_conv2d_relu_max_pool2d on cuda:0 (CONV1_RELU_MAX_POOL2D and its backward) against
** the CPU, f32: the output bit for bit (the same f32 operations in the same order), the
** weight and bias gradients within f32 rounding, and the gradients of two CUDA runs
** identical (the fixed-order sums). The fallback is an error: the op must run on CUDA. */
static void cc_conv_relu_pool(void) {
  if (!kiln__dispatch_has(cc_gpu(), NULL, KILN__K_CONV1_RELU_MAX_POOL2D)) {
    H_CHECK(false, "cuda:0 has no conv1_relu_max_pool2d kernel");
    return;
  }
  for (size_t ci = 0; ci < sizeof cc_cpools / sizeof cc_cpools[0]; ci++) {
    const cc_cpool *k = &cc_cpools[ci];
    kiln_scope_begin();
    kiln_generator *gen = kiln_generator_new(500 + ci);
    kiln_tensor *xb = kiln_randn(KILN_SHAPE(k->N, 1, k->H, k->W), KILN_F32, cc_cpu(), gen);
    kiln_tensor *wb = kiln_randn(KILN_SHAPE(k->OC, 1, k->KH, k->KW), KILN_F32, cc_cpu(), gen);
    kiln_tensor *bb = kiln_randn(KILN_SHAPE(k->OC), KILN_F32, cc_cpu(), gen);
    int64_t OH = (k->H + 2 * k->pad - k->KH + 1) / k->PK[0], OW = (k->W + 2 * k->pad - k->KW + 1) / k->PK[1];
    kiln_tensor *rb = kiln_randn(KILN_SHAPE(k->N, k->OC, OH, OW), KILN_F32, cc_cpu(), gen);
    kiln_generator_free(gen);
    kiln_tensor *want[3] = {0}, *got[3] = {0}, *again[3] = {0};
    kiln_fallback_policy saved = kiln_fallback_policy_get();
    kiln_status s1 = cc_cpool_run(k, xb, wb, bb, rb, cc_cpu(), want);
    kiln_set_fallback_policy(KILN_FALLBACK_ERROR);
    kiln_status s2 = cc_cpool_run(k, xb, wb, bb, rb, cc_gpu(), got);
    kiln_status s3 = cc_cpool_run(k, xb, wb, bb, rb, cc_gpu(), again);
    kiln_set_fallback_policy(saved);
    char what[200];
    snprintf(what, sizeof what,
             "conv2d_relu_max_pool2d case %zu (%lldx1x%lldx%lld, %lld out, %lldx%lld pad %lld, pool %lldx%lld%s)", ci,
             (long long)k->N, (long long)k->H, (long long)k->W, (long long)k->OC, (long long)k->KH,
             (long long)k->KW, (long long)k->pad, (long long)k->PK[0], (long long)k->PK[1], k->bias ? ", bias" : "");
    if (s1 != KILN_OK || s2 != KILN_OK || s3 != KILN_OK) {
      H_CHECK(false, "%s: %s run failed: %s", what, s1 != KILN_OK ? "CPU" : "CUDA", kiln_last_error_message());
      kiln_scope_end();
      continue;
    }
    static const char *const part[3] = {"y", "dw", "db"};
    /* the CPU's fused kernel (built with oneDNN) makes the output with the same f32
    ** operations; without it the CPU composes conv2d from a GEMM (other sums) */
    bool cpu_fused = kiln__dispatch_has(cc_cpu(), NULL, KILN__K_CONV1_RELU_MAX_POOL2D);
    for (int q = 0; q < 3; q++) {
      if (!want[q] && !got[q]) continue;
      char name[280];
      snprintf(name, sizeof name, "%s %s", what, part[q]);
      cc_same(name, got[q], want[q], KILN_F32);
      if (q == 0 && !cpu_fused) continue;
      double *a = cc_host(got[q]), *b = cc_host(q ? again[q] : want[q]);
      snprintf(name, sizeof name, "%s %s %s", what, part[q], q ? "(two CUDA runs: the same bits)" : "(the CPU's bits)");
      if (a && b) h_close(name, a, b, kiln_numel(got[q]), 0, 0);
      else H_CHECK(false, "%s: could not read: %s", name, kiln_last_error_message());
      free(a), free(b);
    }
    kiln_scope_end();
  }
}

/* kiln_relu_max_pool2d on cuda:0 (RELU_MAX_POOL2D and its backward): values, and the input
** gradient, identical to the CPU's with ties, NaN, negatives (ReLU) and an uncovered edge
** (9x10 with 2x3 windows); an input with transposed (h, w) strides included. */
static void cc_relu_max_pool(void) {
  kiln_scope_begin();
  int64_t n = 2 * 3 * 9 * 10;
  double *v = malloc((size_t)n * sizeof(double));
  for (int64_t i = 0; i < n; i++) v[i] = (double)((i * 7919) % 5) - 2.0; /* ties, negatives */
  v[17] = NAN, v[200] = NAN;
  kiln_tensor *x = kiln_from_data(v, KILN_SHAPE(2, 3, 9, 10), KILN_F32, cc_cpu());
  free(v);
  int64_t kk[2] = {2, 3};
  for (int layout = 0; layout < 2; layout++) {
    kiln_tensor *y[2] = {0}, *gx[2] = {0};
    kiln_device devs[2] = {cc_cpu(), cc_gpu()};
    for (int d = 0; d < 2; d++) {
      kiln_tensor *leaf = kiln_detach(kiln_contiguous(kiln_to_device(x, devs[d])));
      kiln_requires_grad_(leaf, true);
      /* layout 1: (h, w) transposed in memory, strides (270, 90, 1, 9) */
      kiln_tensor *xd = layout ? kiln_transpose(kiln_contiguous(kiln_transpose(leaf, 2, 3)), 2, 3) : leaf;
      y[d] = kiln_relu_max_pool2d(xd, kk, NULL, NULL, NULL);
      kiln_tensor *wts = y[d] ? kiln_arange(0, (double)kiln_numel(y[d]), 1, KILN_F32, devs[d]) : NULL;
      kiln_tensor *flat = y[d] ? kiln_reshape(y[d], 1, (int64_t[]){kiln_numel(y[d])}) : NULL;
      kiln_tensor *loss = wts ? kiln_sum_all(kiln_mul(flat, wts)) : NULL;
      if (loss && kiln_backward(loss, NULL) == KILN_OK) gx[d] = kiln_grad(leaf);
    }
    char name[128];
    snprintf(name, sizeof name, "relu_max_pool2d 2x3 %s values", layout ? "strided" : "contiguous");
    double *a = cc_host(y[1]), *b = cc_host(y[0]);
    if (a && b) h_close(name, a, b, kiln_numel(y[0]), 0, 0);
    else H_CHECK(false, "%s: could not read: %s", name, kiln_last_error_message());
    free(a), free(b);
    snprintf(name, sizeof name, "relu_max_pool2d 2x3 %s backward", layout ? "strided" : "contiguous");
    a = cc_host(gx[1]), b = cc_host(gx[0]);
    if (a && b) h_close(name, a, b, kiln_numel(gx[0]), 0, 0);
    else H_CHECK(false, "%s: could not read: %s", name, kiln_last_error_message());
    free(a), free(b);
  }
  kiln_scope_end();
}

/* ---- a captured conv step ---------------------------------------------------------------- */

typedef struct cc_step {
  kiln_tensor *x, *w, *b, *out; /* out: [y | dx | dw] results copied in */
  kiln_tensor *y, *dx, *dw;
  bool stride1; /* stride 1 (the direct kernels' case) instead of 2 */
} cc_step;

static kiln_status cc_step_fn(void *vctx) {
  cc_step *s = vctx;
  kiln_scope_begin();
  kiln_tensor *x = kiln_detach(s->x), *w = kiln_detach(s->w);
  kiln_requires_grad_(x, true), kiln_requires_grad_(w, true);
  int64_t st[2] = {2, 2}, pd[2] = {1, 1};
  kiln_tensor *y = kiln_conv2d(x, w, s->b, s->stride1 ? NULL : st, pd, NULL, 1);
  kiln_tensor *loss = kiln_sum_all(kiln_mul(y, y));
  kiln_status r = loss ? kiln_backward(loss, NULL) : kiln_last_error();
  if (r == KILN_OK) r = kiln_copy_(s->y, y);
  if (r == KILN_OK) r = kiln_copy_(s->dx, kiln_grad(x));
  if (r == KILN_OK) r = kiln_copy_(s->dw, kiln_grad(w));
  kiln_status e = kiln_scope_end();
  return r != KILN_OK ? r : e;
}

static void cc_capture(void) {
  kiln_scope_begin();
  kiln_device dev = cc_gpu();
  kiln_generator *gen = kiln_generator_new(5);
  cc_step s = {0};
  s.x = kiln_randn(KILN_SHAPE(4, 8, 16, 16), KILN_F32, dev, gen);
  s.w = kiln_randn(KILN_SHAPE(16, 8, 3, 3), KILN_F32, dev, gen);
  s.b = kiln_randn(KILN_SHAPE(16), KILN_F32, dev, gen);
  kiln_generator_free(gen);
  s.y = kiln_zeros(KILN_SHAPE(4, 16, 8, 8), KILN_F32, dev);
  s.dx = kiln_zeros(KILN_SHAPE(4, 8, 16, 16), KILN_F32, dev);
  s.dw = kiln_zeros(KILN_SHAPE(16, 8, 3, 3), KILN_F32, dev);
  kiln_status st = cc_step_fn(&s); /* eager, and the warm-up the capture asks for */
  kiln_tensor *eager[3] = {kiln_clone(s.y), kiln_clone(s.dx), kiln_clone(s.dw)};
  kiln_graph *g = st == KILN_OK ? kiln_graph_capture(dev, cc_step_fn, &s) : NULL;
  if (!g) {
    H_CHECK(false, "conv capture failed: %s", kiln_last_error_message());
  } else {
    kiln_fill_(s.y, 0), kiln_fill_(s.dx, 0), kiln_fill_(s.dw, 0);
    st = kiln_graph_replay(g);
    if (st == KILN_OK) st = kiln_device_synchronize(dev);
    if (st != KILN_OK) {
      H_CHECK(false, "conv replay failed: %s", kiln_last_error_message());
    } else {
      printf("test_cuda_conv: conv step captured (%s)\n", kiln_graph_is_device_graph(g) ? "a CUDA graph" : "no device graph");
      kiln_tensor *got[3] = {s.y, s.dx, s.dw};
      static const char *const nm[3] = {"capture y", "capture dx", "capture dw"};
      for (int q = 0; q < 3; q++) {
        double *a = cc_host(got[q]), *b = cc_host(eager[q]);
        if (a && b) h_close(nm[q], a, b, kiln_numel(got[q]), 0, 0); /* same kernels, same numbers */
        else H_CHECK(false, "%s: could not read: %s", nm[q], kiln_last_error_message());
        free(a), free(b);
      }
    }
    kiln_graph_free(g);
  }
  kiln_scope_end();
}

/* ---- 4c. the direct TF32 kernels ---------------------------------------------------- */

/* t (f64) rounded to f32 values, so that the CPU's f64 run and CUDA's f32 one read the same inputs */
static kiln_tensor *cc_f32_values(kiln_tensor *t) { return kiln_to_dtype(kiln_to_dtype(t, KILN_F32), KILN_F64); }

typedef struct cc_dconv {
  int64_t N, C, H, W, OC, K, pad;
  int bias;
} cc_dconv;

static const cc_dconv cc_dconvs[] = {
    {20, 32, 13, 13, 64, 3, 0, 1}, /* fashion-mnist's second convolution (batch cut to 20) */
    {20, 32, 14, 14, 64, 3, 1, 1}, /* the same, padded */
    {3, 5, 9, 7, 24, 3, 1, 1},     /* 24 rows: not a multiple of 16 */
    {2, 3, 6, 11, 70, 5, 2, 0},    /* 70 rows: three row warps; 75 taps */
    {300, 2, 5, 5, 8, 1, 0, 1},    /* 1x1; 300 images: several a weight-gradient block */
    {2, 40, 30, 30, 16, 3, 0, 1},  /* 784 pixels: the forward's pixel ranges split */
    {4, 1, 28, 28, 32, 3, 0, 1},   /* one channel: 9 taps */
    {2, 4, 5, 5, 6, 3, 2, 1},      /* padding k - 1: the data pass pads nothing */
};

/* |got - want| <= rtol*|want| + atol * scale, scale = the largest |want| (TF32 rounds each
** operand to 11 bits; a wrong index is off by the whole scale) */
static bool cc_close_scaled(const char *what, kiln_tensor *got, kiln_tensor *want, double tol) {
  double *g = cc_host(got), *w = cc_host(want);
  bool ok = false;
  if (!g || !w || kiln_numel(got) != kiln_numel(want)) {
    H_CHECK(false, "%s: could not read the results (or sizes differ): %s", what, kiln_last_error_message());
  } else {
    double scale = 0;
    for (int64_t i = 0; i < kiln_numel(want); i++) scale = fmax(scale, fabs(w[i]));
    ok = h_close(what, g, w, kiln_numel(want), tol, tol * (scale > 1 ? scale : 1));
  }
  free(g), free(w);
  return ok;
}

/* y = conv2d(x, w, b) at stride st and padding pad (x and w channels-last where asked, b
** NULL-able); loss = sum(y * r); res: y and the gradients of x, w, b */
static kiln_status cc_grad_step(kiln_tensor *xb, kiln_tensor *wb, kiln_tensor *bb, kiln_tensor *rb, int64_t st,
                                int64_t pad, bool x_cl, bool w_cl, kiln_dtype dt, kiln_device dev, kiln_tensor *res[4]) {
  kiln_tensor *x = kiln_detach(kiln_to_dtype(kiln_to_device(xb, dev), dt));
  kiln_tensor *w = kiln_detach(kiln_to_dtype(kiln_to_device(wb, dev), dt));
  kiln_tensor *b = bb ? kiln_detach(kiln_to_dtype(kiln_to_device(bb, dev), dt)) : NULL;
  kiln_tensor *r = kiln_to_dtype(kiln_to_device(rb, dev), dt);
  if (!x || !w || !r || (bb && !b)) return kiln_last_error();
  kiln_requires_grad_(x, true), kiln_requires_grad_(w, true);
  if (b) kiln_requires_grad_(b, true);
  int64_t sd[2] = {st, st}, pd[2] = {pad, pad};
  kiln_tensor *y = kiln_conv2d(x_cl ? cc_layout(x, 2) : x, w_cl ? cc_layout(w, 2) : w, b, sd, pd, NULL, 1);
  kiln_tensor *loss = kiln_sum_all(kiln_mul(y, r));
  kiln_status s = loss ? kiln_backward(loss, NULL) : kiln_last_error();
  if (s != KILN_OK) return s;
  res[0] = y, res[1] = kiln_grad(x), res[2] = kiln_grad(w), res[3] = b ? kiln_grad(b) : NULL;
  return KILN_OK;
}

static kiln_status cc_dstep(const cc_dconv *k, kiln_tensor *xb, kiln_tensor *wb, kiln_tensor *bb, kiln_tensor *rb,
                            kiln_dtype dt, kiln_device dev, kiln_tensor *res[4]) {
  return cc_grad_step(xb, wb, k->bias ? bb : NULL, rb, 1, k->pad, false, false, dt, dev, res);
}

/* the kargs of op for case k's tensors on dev (outputs allocated; ACC: out0 = acc) */
static kiln__kargs cc_dargs(kiln__kop op, const cc_dconv *k, kiln_tensor *x, kiln_tensor *w, kiln_tensor *g,
                            kiln_tensor *outs[2], const kiln__conv_params *cp) {
  kiln__kargs a = {0};
  a.op = op;
  a.n_in = 2, a.n_out = 1;
  a.i[0] = 1, a.i[1] = 1; /* ungrouped, TF32 allowed */
  a.params = cp;
  if (op == KILN__K_CONV2D_BACKWARD_WEIGHT) {
    a.in[0] = kiln__view_of(x), a.in[1] = kiln__view_of(g), a.out[0] = kiln__view_of(outs[0]);
    a.n_out = 2, a.out[1] = kiln__view_of(outs[1]);
  } else if (op == KILN__K_CONV2D) {
    a.in[0] = kiln__view_of(x), a.in[1] = kiln__view_of(w), a.out[0] = kiln__view_of(outs[0]);
  } else {
    a.in[0] = kiln__view_of(g), a.in[1] = kiln__view_of(w), a.out[0] = kiln__view_of(outs[0]);
  }
  (void)k;
  return a;
}

static void cc_direct(void) {
#if defined(KILN_HAVE_CUDA) && !defined(CC_GPU_IS_CPU)
  const char *env = getenv("KILN_CONV_DIRECT");
  bool want_direct = !(env && !strcmp(env, "0"));
#endif
  for (size_t ci = 0; ci < sizeof cc_dconvs / sizeof cc_dconvs[0]; ci++) {
    const cc_dconv *k = &cc_dconvs[ci];
    kiln_scope_begin();
    kiln_generator *gen = kiln_generator_new(4200 + ci);
    int64_t OH = k->H + 2 * k->pad - k->K + 1, OW = k->W + 2 * k->pad - k->K + 1;
    kiln_tensor *xb = cc_f32_values(kiln_randn(KILN_SHAPE(k->N, k->C, k->H, k->W), KILN_F64, cc_cpu(), gen));
    kiln_tensor *wb = cc_f32_values(kiln_randn(KILN_SHAPE(k->OC, k->C, k->K, k->K), KILN_F64, cc_cpu(), gen));
    kiln_tensor *bb = cc_f32_values(kiln_randn(KILN_SHAPE(k->OC), KILN_F64, cc_cpu(), gen));
    kiln_tensor *rb = cc_f32_values(kiln_randn(KILN_SHAPE(k->N, k->OC, OH, OW), KILN_F64, cc_cpu(), gen));
    kiln_tensor *ab = cc_f32_values(kiln_randn(KILN_SHAPE(k->N, k->C, k->H, k->W), KILN_F64, cc_cpu(), gen));
    kiln_generator_free(gen);
    char what[200];
    kiln__conv_params cp = {{k->K, k->K}, {1, 1}, {k->pad, k->pad}, {1, 1}};
#if defined(KILN_HAVE_CUDA) && !defined(CC_GPU_IS_CPU)
    /* every pass is the direct kernels' (the first case: fashion-mnist's layer) */
    {
      kiln_tensor *x = kiln_to_device(kiln_to_dtype(xb, KILN_F32), cc_gpu());
      kiln_tensor *w = kiln_to_device(kiln_to_dtype(wb, KILN_F32), cc_gpu());
      kiln_tensor *g = kiln_to_device(kiln_to_dtype(rb, KILN_F32), cc_gpu());
      kiln_tensor *o1[2] = {kiln_empty(KILN_SHAPE(k->N, k->OC, OH, OW), KILN_F32, cc_gpu()), NULL};
      kiln_tensor *o2[2] = {kiln_empty(KILN_SHAPE(k->N, k->C, k->H, k->W), KILN_F32, cc_gpu()), NULL};
      kiln_tensor *o3[2] = {kiln_empty(KILN_SHAPE(k->OC, k->C, k->K, k->K), KILN_F32, cc_gpu()),
                            kiln_empty(KILN_SHAPE(k->OC), KILN_F32, cc_gpu())};
      if (x && w && g && o1[0] && o2[0] && o3[0] && o3[1]) {
        kiln__kop ops[4] = {KILN__K_CONV2D, KILN__K_CONV2D_BACKWARD_DATA, KILN__K_CONV2D_BACKWARD_DATA_ACC,
                            KILN__K_CONV2D_BACKWARD_WEIGHT};
        kiln_tensor **outs[4] = {o1, o2, o2, o3};
        for (int q = 0; q < 4; q++) {
          kiln__kargs a = cc_dargs(ops[q], k, x, w, g, outs[q], &cp);
          a.device = 0;
          bool has = kiln__cuda_conv_direct_supports(&a);
          if (ci == 0)
            H_CHECK(has == want_direct, "fashion-mnist's conv: %s %s by the direct kernels", kiln__kop_name(ops[q]),
                    has ? "taken" : "not taken");
          if (ci == 0 && q == 0)
            printf("test_cuda_conv: direct TF32 kernels %s\n", has ? "on" : "off (KILN_CONV_DIRECT=0 or the device)");
        }
      }
    }
#endif
    /* through autograd: y, dx, dw, db against the CPU's f64 */
    kiln_tensor *want[4] = {0}, *got[4] = {0};
    kiln_set_matmul_tf32(true);
    kiln_fallback_policy saved = kiln_fallback_policy_get();
    kiln_status s1 = cc_dstep(k, xb, wb, bb, rb, KILN_F64, cc_cpu(), want);
    kiln_set_fallback_policy(KILN_FALLBACK_ERROR);
    kiln_status s2 = cc_dstep(k, xb, wb, bb, rb, KILN_F32, cc_gpu(), got);
    kiln_set_fallback_policy(saved);
    if (s1 != KILN_OK || s2 != KILN_OK) {
      H_CHECK(false, "direct case %zu: %s run failed: %s", ci, s1 != KILN_OK ? "CPU" : "CUDA",
              kiln_last_error_message());
    } else {
      static const char *const part[4] = {"y", "dx", "dw", "db"};
      for (int q = 0; q < 4; q++) {
        if (!want[q] && !got[q]) continue;
        snprintf(what, sizeof what, "direct case %zu %s", ci, part[q]);
        cc_close_scaled(what, got[q], want[q], 4e-3);
      }
    }
    /* CONV2D_BACKWARD_DATA_ACC through dispatch: acc + dx */
    {
      kiln_tensor *w = kiln_to_device(kiln_to_dtype(wb, KILN_F32), cc_gpu());
      kiln_tensor *g = kiln_to_device(kiln_to_dtype(rb, KILN_F32), cc_gpu());
      kiln_tensor *acc = kiln_contiguous(kiln_to_device(kiln_to_dtype(ab, KILN_F32), cc_gpu()));
      kiln_tensor *outs[2] = {acc, NULL};
      if (w && g && acc) {
        kiln__kargs a = cc_dargs(KILN__K_CONV2D_BACKWARD_DATA_ACC, k, NULL, w, g, outs, &cp);
        if (kiln__dispatch_has(cc_gpu(), &a, KILN__K_CONV2D_BACKWARD_DATA_ACC)) {
          kiln_status st = kiln__dispatch(cc_gpu(), &a);
          H_CHECK(st == KILN_OK, "direct case %zu: backward data acc: %s", ci, kiln_last_error_message());
          kiln_tensor *expect = want[1] ? kiln_add(ab, want[1]) : NULL;
          snprintf(what, sizeof what, "direct case %zu dx added", ci);
          if (st == KILN_OK && expect) cc_close_scaled(what, acc, expect, 4e-3);
        }
      }
    }
    kiln_set_matmul_tf32(false);
    kiln_scope_end();
  }
  /* a captured step replays the eager one's bits (fashion-mnist's shape) */
  kiln_set_matmul_tf32(true);
  kiln_scope_begin();
  kiln_device dev = cc_gpu();
  kiln_generator *gen = kiln_generator_new(6);
  cc_step s = {0};
  s.x = kiln_randn(KILN_SHAPE(8, 32, 14, 14), KILN_F32, dev, gen); /* padding 1: 14x14 out */
  s.w = kiln_randn(KILN_SHAPE(64, 32, 3, 3), KILN_F32, dev, gen);
  s.b = kiln_randn(KILN_SHAPE(64), KILN_F32, dev, gen);
  kiln_generator_free(gen);
  s.y = kiln_zeros(KILN_SHAPE(8, 64, 14, 14), KILN_F32, dev);
  s.dx = kiln_zeros(KILN_SHAPE(8, 32, 14, 14), KILN_F32, dev);
  s.dw = kiln_zeros(KILN_SHAPE(64, 32, 3, 3), KILN_F32, dev);
  s.stride1 = true;
  kiln_status st = cc_step_fn(&s);
  kiln_tensor *eager[3] = {kiln_clone(s.y), kiln_clone(s.dx), kiln_clone(s.dw)};
  kiln_graph *gr = st == KILN_OK ? kiln_graph_capture(dev, cc_step_fn, &s) : NULL;
  if (!gr) {
    H_CHECK(false, "direct conv capture failed: %s", kiln_last_error_message());
  } else {
    kiln_fill_(s.y, 0), kiln_fill_(s.dx, 0), kiln_fill_(s.dw, 0);
    st = kiln_graph_replay(gr);
    if (st == KILN_OK) st = kiln_device_synchronize(dev);
    H_CHECK(st == KILN_OK, "direct conv replay failed: %s", kiln_last_error_message());
    kiln_tensor *gotc[3] = {s.y, s.dx, s.dw};
    static const char *const nm[3] = {"direct capture y", "direct capture dx", "direct capture dw"};
    for (int q = 0; q < 3 && st == KILN_OK; q++) {
      double *a = cc_host(gotc[q]), *b = cc_host(eager[q]);
      if (a && b) h_close(nm[q], a, b, kiln_numel(gotc[q]), 0, 0);
      else H_CHECK(false, "%s: could not read: %s", nm[q], kiln_last_error_message());
      free(a), free(b);
    }
    kiln_graph_free(gr);
  }
  kiln_scope_end();
  kiln_set_matmul_tf32(false);
}

/* ---- 4d. the space-to-depth path ----------------------------------------------------- */

typedef struct cc_sconv {
  int64_t N, C, H, W, OC, K, pad;
  int bias, w_cl; /* a bias; the weight channels-last too */
} cc_sconv;

static const cc_sconv cc_sconvs[] = {
    {2, 3, 32, 30, 16, 7, 3, 1, 1}, /* a ResNet stem, cut down */
    {3, 1, 17, 19, 8, 5, 2, 0, 0},  /* one channel, odd sizes, contiguous weight */
    {2, 4, 15, 16, 24, 7, 2, 1, 0}, /* four channels, padding 2 of a 7x7 */
    {1, 2, 9, 9, 8, 6, 1, 1, 1},    /* an even kernel: no tap past it */
};

/* the case's step: stride 2, x channels-last, w as the case says */
static kiln_status cc_sstep(const cc_sconv *k, kiln_tensor *xb, kiln_tensor *wb, kiln_tensor *bb, kiln_tensor *rb,
                            kiln_dtype dt, kiln_device dev, kiln_tensor *res[4]) {
  return cc_grad_step(xb, wb, k->bias ? bb : NULL, rb, 2, k->pad, true, k->w_cl, dt, dev, res);
}

static void cc_s2d(void) {
#if defined(KILN_HAVE_CUDA) && !defined(CC_GPU_IS_CPU)
  const char *env = getenv("KILN_CONV_S2D");
  bool want = cc_cudnn && !(env && !strcmp(env, "0"));
  printf("test_cuda_conv: space-to-depth path %s\n", want ? "expected" : "off (KILN_CONV_S2D=0 or no cuDNN)");
#endif
  static const kiln_dtype dts[2] = {KILN_BF16, KILN_F16};
  for (size_t ci = 0; ci < sizeof cc_sconvs / sizeof cc_sconvs[0]; ci++)
    for (int di = 0; di < 2; di++) {
      const cc_sconv *k = &cc_sconvs[ci];
      const kiln_dtype dt = dts[di];
      kiln_scope_begin();
      kiln_generator *gen = kiln_generator_new(7100 + ci);
      int64_t OH = (k->H + 2 * k->pad - k->K) / 2 + 1, OW = (k->W + 2 * k->pad - k->K) / 2 + 1;
      /* inputs rounded to dt, so that the CPU's f64 run reads what CUDA reads */
      kiln_tensor *xb = kiln_to_dtype(kiln_to_dtype(kiln_randn(KILN_SHAPE(k->N, k->C, k->H, k->W), KILN_F64, cc_cpu(), gen), dt), KILN_F64);
      kiln_tensor *wb = kiln_to_dtype(kiln_to_dtype(kiln_randn(KILN_SHAPE(k->OC, k->C, k->K, k->K), KILN_F64, cc_cpu(), gen), dt), KILN_F64);
      kiln_tensor *bb = kiln_to_dtype(kiln_to_dtype(kiln_randn(KILN_SHAPE(k->OC), KILN_F64, cc_cpu(), gen), dt), KILN_F64);
      kiln_tensor *rb = kiln_to_dtype(kiln_to_dtype(kiln_randn(KILN_SHAPE(k->N, k->OC, OH, OW), KILN_F64, cc_cpu(), gen), dt), KILN_F64);
      kiln_generator_free(gen);
      char what[200];
#if defined(KILN_HAVE_CUDA) && !defined(CC_GPU_IS_CPU)
      { /* the path takes the forward and the weight gradient, not the data gradient */
        kiln__conv_params cp = {{k->K, k->K}, {2, 2}, {k->pad, k->pad}, {1, 1}};
        kiln_tensor *x = cc_layout(kiln_to_device(kiln_to_dtype(xb, dt), cc_gpu()), 2);
        kiln_tensor *w = kiln_to_device(kiln_to_dtype(wb, dt), cc_gpu());
        kiln_tensor *g = cc_layout(kiln_to_device(kiln_to_dtype(rb, dt), cc_gpu()), 2);
        kiln_tensor *o1[2] = {cc_layout(kiln_empty(KILN_SHAPE(k->N, k->OC, OH, OW), dt, cc_gpu()), 2), NULL};
        kiln_tensor *o2[2] = {cc_layout(kiln_empty(KILN_SHAPE(k->N, k->C, k->H, k->W), dt, cc_gpu()), 2), NULL};
        kiln_tensor *o3[2] = {kiln_empty(KILN_SHAPE(k->OC, k->C, k->K, k->K), dt, cc_gpu()),
                              kiln_empty(KILN_SHAPE(k->OC), dt, cc_gpu())};
        if (x && w && g && o1[0] && o2[0] && o3[0] && o3[1]) {
          kiln__kop ops[3] = {KILN__K_CONV2D, KILN__K_CONV2D_BACKWARD_WEIGHT, KILN__K_CONV2D_BACKWARD_DATA};
          kiln_tensor **outs[3] = {o1, o3, o2};
          for (int q = 0; q < 3; q++) {
            kiln__kargs a = cc_dargs(ops[q], NULL, x, w, g, outs[q], &cp);
            a.device = 0, a.i[1] = 0;
            bool has = kiln__cuda_conv_s2d_supports(&a);
            H_CHECK(has == (want && q < 2), "s2d case %zu %s: %s %s by the space-to-depth path", ci,
                    kiln_dtype_name(dt), kiln__kop_name(ops[q]), has ? "taken" : "not taken");
          }
        } else {
          H_CHECK(false, "s2d case %zu: set-up failed: %s", ci, kiln_last_error_message());
        }
      }
#endif
      kiln_tensor *want_r[4] = {0}, *got[4] = {0};
      kiln_fallback_policy saved = kiln_fallback_policy_get();
      kiln_status s1 = cc_sstep(k, xb, wb, bb, rb, KILN_F64, cc_cpu(), want_r);
      kiln_set_fallback_policy(KILN_FALLBACK_ERROR);
      kiln_status s2 = cc_sstep(k, xb, wb, bb, rb, dt, cc_gpu(), got);
      kiln_set_fallback_policy(saved);
      if (s1 != KILN_OK || s2 != KILN_OK) {
        H_CHECK(false, "s2d case %zu %s: %s run failed: %s", ci, kiln_dtype_name(dt), s1 != KILN_OK ? "CPU" : "CUDA",
                kiln_last_error_message());
      } else {
        static const char *const part[4] = {"y", "dx", "dw", "db"};
        for (int q = 0; q < 4; q++) {
          if (!want_r[q] && !got[q]) continue;
          snprintf(what, sizeof what, "s2d case %zu %s %s", ci, kiln_dtype_name(dt), part[q]);
          /* one rounding to dt of an f32 sum: 2^-8 (bf16) or 2^-11 (f16) of the largest */
          cc_close_scaled(what, got[q], want_r[q], dt == KILN_BF16 ? 1e-2 : 2e-3);
        }
      }
      kiln_scope_end();
    }
}

/* Layout copies seen by the observer: contiguous of a channels-last tensor (NHWC to NCHW)
** and contiguous_format (to NHWC). Not counted: a contiguous made of a broadcast (a sum's
** backward materialises its expanded gradient), which moves no layout. The first few are
** described for the failure message. */
static int cc_copies;
static char cc_copy_what[4][160];
static void *cc_obs_begin(const kiln__op_event *e, void *ctx) {
  (void)ctx;
  const kiln_tensor *t = e->n_in > 0 ? e->in[0] : NULL;
  bool to_nchw = !strcmp(e->op->name, "contiguous") && kiln__is_channels_last(t);
  bool to_nhwc = !strcmp(e->op->name, "contiguous_format");
  if (!t || !(to_nchw || to_nhwc)) return NULL;
  if (cc_copies < 4) {
    const int64_t *sh = t->shape, *st = t->strides;
    snprintf(cc_copy_what[cc_copies], sizeof cc_copy_what[0], "%s%s depth %d %s [%lld,%lld,%lld,%lld] strides [%lld,%lld,%lld,%lld]",
             e->op->name, e->backward ? " (backward)" : "", e->depth, kiln_dtype_name(t->dtype), (long long)sh[0],
             (long long)sh[1], (long long)sh[2], (long long)sh[3], (long long)st[0], (long long)st[1],
             (long long)st[2], (long long)st[3]);
  }
  cc_copies++;
  return NULL;
}
static kiln_status cc_obs_end(const kiln__op_event *e, void *tok, void *ctx) {
  (void)e, (void)tok, (void)ctx;
  return KILN_OK;
}
static const kiln__observer cc_obs = {"cc_copies", cc_obs_begin, cc_obs_end, NULL, NULL, NULL};

static void cc_keep_format(void) {
  kiln_set_matmul_tf32(false);
  cv_keep_format_on(cc_gpu(), KILN_F64, 1e-10, 1e-10, 1e-10, true);
  cv_keep_format_on(cc_gpu(), KILN_F32, 1e-4, 1e-5, 1e-4, true);
  cv_keep_format_on(cc_gpu(), KILN_F16, 2e-2, 1e-2, 0, false);
  cv_keep_format_on(cc_gpu(), KILN_BF16, 8e-2, 5e-2, 0, false);
  kiln_set_matmul_tf32(false);
  cv_optim_format(cc_gpu(), 1e-3, 1e-4); /* with cuDNN the weight's gradient is channels-last: Adam's fused path */
  if (!cc_cudnn) return;
  /* A ResNet-like step, channels-last leaves: cuDNN reads and writes NHWC, the other ops
  ** keep it, so nothing is ever transposed. */
  for (int amp = 0; amp < 2; amp++) {
    kiln_scope_begin();
    kiln_generator *gen = kiln_generator_new(2);
    kiln_tensor *x = kiln_contiguous_format(kiln_randn(KILN_SHAPE(4, 16, 14, 14), KILN_F32, cc_gpu(), gen),
                                            KILN_CHANNELS_LAST);
    kiln_tensor *w1 = kiln_contiguous_format(kiln_randn(KILN_SHAPE(16, 16, 3, 3), KILN_F32, cc_gpu(), gen),
                                             KILN_CHANNELS_LAST);
    kiln_tensor *w2 = kiln_contiguous_format(kiln_randn(KILN_SHAPE(32, 16, 1, 1), KILN_F32, cc_gpu(), gen),
                                             KILN_CHANNELS_LAST);
    kiln_generator_free(gen);
    kiln_requires_grad_(w1, true);
    kiln_requires_grad_(w2, true);
    int64_t pd[2] = {1, 1}, k3[2] = {3, 3}, s2[2] = {2, 2};
    cc_copies = 0;
    H_CHECK(kiln__observer_add(&cc_obs) == KILN_OK, "observer: %s", kiln_last_error_message());
    kiln_status st = amp ? kiln_autocast_begin(KILN_DEVICE_CUDA, KILN_BF16) : KILN_OK;
    kiln_tensor *h = kiln_relu(kiln_conv2d(x, w1, NULL, NULL, pd, NULL, 1));
    h = kiln_relu(kiln_add(h, x));
    h = kiln_max_pool2d(h, k3, s2, pd, NULL, NULL);
    /* ending in a relu, as a block does: the loss's broadcast gradient becomes
    ** channels-last again in relu's backward (it takes its input's layout) */
    h = kiln_relu(kiln_conv2d(h, w2, NULL, NULL, NULL, NULL, 1));
    kiln_tensor *loss = kiln_sum_all(kiln_to_dtype(h, KILN_F32));
    if (amp && st == KILN_OK) st = kiln_autocast_end();
    if (st == KILN_OK && loss) st = kiln_backward(loss, NULL);
    kiln__observer_remove(&cc_obs);
    H_CHECK(st == KILN_OK && loss && kiln_grad(w1) && kiln_grad(w2), "channels-last step%s: %s",
            amp ? " (bf16 autocast)" : "", kiln_last_error_message());
    H_CHECK(h && kiln_is_contiguous_format(h, KILN_CHANNELS_LAST) && !kiln_is_contiguous(h),
            "the step's output is channels-last%s", amp ? " (bf16 autocast)" : "");
    H_CHECK(cc_copies == 0, "a channels-last step%s made %d layout copies (contiguous/contiguous_format)%s%s%s%s%s%s",
            amp ? " (bf16 autocast)" : "", cc_copies, cc_copies > 0 ? ": " : "", cc_copy_what[0],
            cc_copies > 1 ? "; " : "", cc_copies > 1 ? cc_copy_what[1] : "", cc_copies > 2 ? "; " : "",
            cc_copies > 2 ? cc_copy_what[2] : "");
    /* Without autocast the weight's gradient comes from cuDNN in NHWC. Under autocast it
    ** is the cast back of the bf16 gradient, whose layout is the cast's (a performance
    ** matter for the optimizer, not a value): said, not checked. */
    bool gcl = kiln_grad(w1) && kiln_is_contiguous_format(kiln_grad(w1), KILN_CHANNELS_LAST);
    if (!amp) H_CHECK(gcl, "a channels-last weight's gradient is channels-last");
    else printf("test_cuda_conv: under bf16 autocast a channels-last weight's gradient is %s\n",
                gcl ? "channels-last" : "NCHW (the cast back of its gradient made it so)");
    kiln_scope_end();
  }
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0); /* a crash keeps what was printed */
  h_init(argc, argv, "test_cuda_conv");
  h_set_cross_only(true);
#ifndef CC_GPU_IS_CPU
  if (kiln_device_count(KILN_DEVICE_CUDA) == 0) {
    printf("test_cuda_conv: skipped (no CUDA device)\n");
    return 77;
  }
#endif
  {
    /* which path conv2d takes on cuda:0 (cuDNN or im2col + cuBLAS) */
    kiln_scope_begin();
    kiln_tensor *x = kiln_zeros(KILN_SHAPE(1, 2, 5, 5), KILN_F32, cc_gpu());
    kiln_tensor *w = kiln_zeros(KILN_SHAPE(3, 2, 3, 3), KILN_F32, cc_gpu());
    kiln_tensor *y = kiln_zeros(KILN_SHAPE(1, 3, 3, 3), KILN_F32, cc_gpu());
    kiln__conv_params cp = {{3, 3}, {1, 1}, {0, 0}, {1, 1}};
    kiln__kargs a = {0};
    a.op = KILN__K_CONV2D;
    a.n_in = 2, a.n_out = 1;
    a.in[0] = kiln__view_of(x), a.in[1] = kiln__view_of(w), a.out[0] = kiln__view_of(y);
    a.i[0] = 1;
    a.params = &cp;
    cc_cudnn = kiln__dispatch_has(cc_gpu(), &a, KILN__K_CONV2D);
#ifdef CC_GPU_IS_CPU
    cc_cudnn = false; /* the CPU's CONV2D (oneDNN) keeps no format */
#endif
    printf("test_cuda_conv: CONV2D on cuda:0: %s\n", cc_cudnn ? "cuDNN" : "none (im2col + cuBLAS)");
    kiln_scope_end();
  }
#ifndef CC_GPU_IS_CPU
  printf("test_cuda_conv: harness cases\n");
  cv_family();
#endif
  printf("test_cuda_conv: conv2d against the CPU\n");
  cc_conv_vs_cpu();
  printf("test_cuda_conv: backward kernels\n");
  cc_backward_kernels();
  printf("test_cuda_conv: max_pool2d\n");
  cc_max_pool();
  printf("test_cuda_conv: conv2d_relu_max_pool2d (the fused first layer)\n");
  cc_conv_relu_pool();
  printf("test_cuda_conv: relu_max_pool2d\n");
  cc_relu_max_pool();
  printf("test_cuda_conv: graph capture\n");
  cc_capture();
  printf("test_cuda_conv: the direct TF32 kernels\n");
  cc_direct();
  printf("test_cuda_conv: the space-to-depth path (stride-2 convolutions of few channels)\n");
  cc_s2d();
  printf("test_cuda_conv: channels-last end to end\n");
  cc_keep_format();
  return h_finish();
}
