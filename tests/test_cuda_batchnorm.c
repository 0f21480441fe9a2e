/*
** batch_norm and max_pool2d_backward on CUDA (issue 15): skipped (exit 77) without a CUDA
** device.
**
** 1. test_ops_batchnorm's harness cases, part (d) only: forward and backward on cuda:0
**    against the CPU, every dtype and variant, with the fallback off (H_CUDA_NATIVE).
** 2. bn_run (test_ops_batchnorm.c) on cuda:0 against the CPU's kernels: every layout
**    (NCHW, channels-last, a channel slice, a misaligned start, a stride-0 batch, (N, C),
**    (N, C, L)), shapes that take each vector width (S or C divisible by 8, 4, neither),
**    sizes that split a channel over many blocks, f64/f32/f16/bf16 (f32 parameters for
**    the 16-bit inputs, as under autocast), training with running statistics, eval, and
**    training under a ReLU (its backward folded into BATCH_NORM_BACKWARD's mask): y,
**    the running statistics, dx, dweight, dbias. Channels-last in, channels-last out.
** 3. A mean of 1000 beside a spread of 1 over 200k values per channel, f32: against the
**    CPU's two-pass f64 statistics.
** 4. max_pool2d's gradient (the gather over the computed window range) against the CPU:
**    ResNet's 3x3/2 pad 1 window, a dilated one, a channels-last input.
** 5. kiln_batch_norm_add_relu on the device (one BATCH_NORM with the residual, flag 16; one
**    BATCH_NORM_BACKWARD that writes the residual's gradient in its first pass, flag 4):
**    against the f64 three ops on the device (test_ops_batchnorm's check), against the CPU's
**    fused op in f32, bf16 and f16, NCHW and channels-last, the residual in x's layout or
**    the other, training and eval, odd shapes (C 7, 12, 20; S 15, 49, 81, 143) and ones that
**    split a channel over many blocks; the kernels that ran (one forward, one backward, no
**    RELU_BACKWARD, nothing on the CPU); two runs the same bits.
** 7. The backward's ReLU mask recomputed from x (BATCH_NORM_BACKWARD flag 8, the default
**    on CUDA for batch_norm_relu and for a batch_norm under a ReLU) against the mask read
**    (KILN_BN_MASK_RECOMPUTE=0): dx, dweight, dbias and y bit for bit, f64/f32/bf16/f16,
**    NCHW and channels-last, training and eval, both ops, with channels whose pre-ReLU
**    values are exactly 0, tiny (an f16 positive that rounds to 0, an f32 subnormal) or
**    ties at the integers; the flags that ran (8 without a mask, or 2).
** 8. kiln__batch_norm_relu_max_pool2d (BATCH_NORM flag 32, then RELU_MAX_POOL2D_BACKWARD's
**    gather and the plain BATCH_NORM_BACKWARD: ResNet's stem): taken on CUDA for
**    channels-last x (not for NCHW), and against the same three ops on the device (y and
**    the running statistics bit for bit, the gradients within one rounding: a pixel's sums
**    over overlapping windows in another order) in bf16, f16 and f32, and against the CPU's
**    f64 ops in f32; windows 3x3/2 pad 1, tiling 2x2, 3x3/1 (every pixel in up to 9),
**    5x5/2 pad 2; odd sizes; 4 and 2 channels (narrower vectors); training and eval; ties
**    (inputs on a coarse grid, so that windows hold equal maxima).
** 6. Timings at ResNet-50's sizes, printed (not checked): batch_norm forward and forward +
**    backward on (128, 256, 56, 56) bf16, NCHW and channels-last; max_pool2d backward on
**    the stem's (128, 64, 112, 112) bf16.
** BC_GPU_IS_CPU builds it against the CPU, to check the test's own logic without a GPU.
*/
#define _POSIX_C_SOURCE 200809L /* setenv */
#define H_NO_MAIN
#include "test_ops_batchnorm.c"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef BC_GPU_IS_CPU
static kiln_device bc_gpu(void) { return kiln_device_cpu(); }
#else
static kiln_device bc_gpu(void) { return kiln_device_cuda(0); }
#endif

static void bc_tol(kiln_dtype dt, double *rtol, double *atol) {
  switch (dt) {
  case KILN_F64: *rtol = 1e-9, *atol = 1e-9; break;
  case KILN_F32: *rtol = 1e-4, *atol = 1e-5; break;
  case KILN_F16: *rtol = 2e-2, *atol = 1e-2; break;
  default: *rtol = 8e-2, *atol = 5e-2; break; /* bf16 */
  }
}

static void bc_vs_cpu(void) {
  static const struct {
    int ndim;
    int64_t shape[5];
    int layout;
  } shapes[] = {
      {4, {8, 16, 14, 14}, BN_CONTIG},  /* S 196: 4-wide for 16-bit, 4 for f32 */
      {4, {4, 32, 7, 7}, BN_CONTIG},    /* S 49: scalar, 5 rows a block */
      {4, {6, 64, 8, 8}, BN_CL},        /* C 64: 8-wide channels */
      {4, {3, 5, 6, 6}, BN_CL},         /* C 5: scalar channels */
      {2, {64, 24}, BN_CONTIG},         /* (N, C): the channels-inner kernels */
      {3, {8, 12, 50}, BN_CONTIG},      /* (N, C, L) */
      {3, {8, 16, 10}, BN_CL},
      {4, {2, 3, 4, 5}, BN_SLICE},
      {4, {4, 8, 4, 4}, BN_MISALIGNED},
      {4, {3, 4, 4, 6}, BN_EXPANDED},
      {4, {64, 4, 56, 56}, BN_CONTIG},  /* 200k per channel: many splits */
      {4, {32, 96, 7, 7}, BN_CONTIG},
      {4, {64, 40, 16, 16}, BN_CL},     /* 16k rows: many splits */
      {5, {4, 6, 3, 4, 8}, BN_CONTIG},
      /* the second version's kernels (unrolled rows, warp-per-channel finalize, tree merge) */
      {4, {64, 24, 1, 1}, BN_CONTIG},   /* S 1: (N, C) rows */
      {4, {8, 40, 7, 7}, BN_CL},        /* S 49 channels-last: 8-wide, 5 vectors a row */
      {4, {16, 20, 7, 7}, BN_CONTIG},   /* S 49 NCHW, C 20 */
      {4, {4, 64, 56, 56}, BN_CL},      /* S 3136 channels-last: ~1000 splits of a channel */
      {4, {8, 12, 14, 14}, BN_CL},      /* C 12: 4-wide for 16-bit */
      {4, {8, 7, 9, 9}, BN_CL},         /* C 7: scalar, odd */
      {4, {2, 264, 3, 3}, BN_CL},       /* C 264: 33 vectors, a second block of channels */
  };
  static const kiln_dtype dts[4] = {KILN_F64, KILN_F32, KILN_F16, KILN_BF16};
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
    for (int di = 0; di < 4; di++)
      for (int mode = 0; mode < 3; mode++) {
        bn_spec sp = bn_sweep_spec(shapes[si].ndim, shapes[si].shape, shapes[si].layout, dts[di], mode, 1.5,
                                   500 + si * 8 + (uint64_t)di * 2 + (uint64_t)mode);
        bn_out gpu, cpu;
        bool a = bn_run(&sp, bc_gpu(), &gpu), b = bn_run(&sp, kiln_device_cpu(), &cpu);
        if (a && b) {
          double rt, at;
          bc_tol(sp.dt, &rt, &at);
          bn_compare("cuda vs cpu", &sp, &gpu, &cpu, rt, at);
          if (sp.layout == BN_CL && sp.ndim == 4 && !sp.relu) /* relu makes its own layout */
            H_CHECK(gpu.cl_y && gpu.cl_dx, "cuda channels-last %s: y and dx channels-last (%d, %d)",
                    kiln_dtype_name(sp.dt), gpu.cl_y, gpu.cl_dx);
        }
        bn_out_free(&gpu), bn_out_free(&cpu);
      }
}

static void bc_offset(void) {
  bn_spec sp = {4, {64, 4, 56, 56}, BN_CONTIG, KILN_F32, KILN_F32, true, 1000.0, 77, false, false};
  bn_out gpu, cpu;
  if (bn_run(&sp, bc_gpu(), &gpu) && bn_run(&sp, kiln_device_cpu(), &cpu))
    bn_compare("mean 1000, spread 1: cuda vs cpu", &sp, &gpu, &cpu, 1e-4, 1e-5);
  bn_out_free(&gpu), bn_out_free(&cpu);
}

/* A channel of 256 * 56 * 56 values (ResNet-50's layer 1 at batch 256), both layouts,
** f32 and bf16, training alone and under a ReLU. */
static void bc_big(void) {
  static const kiln_dtype dts[2] = {KILN_F32, KILN_BF16};
  for (int lay = 0; lay < 2; lay++)
    for (int di = 0; di < 2; di++)
      for (int mode = 0; mode < 3; mode += 2) {
        const int64_t shape[5] = {256, 8, 56, 56, 0};
        bn_spec sp = bn_sweep_spec(4, shape, lay ? BN_CL : BN_CONTIG, dts[di], mode, 0.5, 700 + lay * 4 + di * 2 + mode);
        bn_out gpu, cpu;
        if (bn_run(&sp, bc_gpu(), &gpu) && bn_run(&sp, kiln_device_cpu(), &cpu)) {
          double rt, at;
          bc_tol(sp.dt, &rt, &at);
          bn_compare("256x56x56 per channel: cuda vs cpu", &sp, &gpu, &cpu, rt, at);
        }
        bn_out_free(&gpu), bn_out_free(&cpu);
      }
}

/* Same inputs, same numbers: two runs on the device agree bit for bit (DESIGN.md; the
** reductions have a fixed order, no atomics). */
static void bc_repeat(void) {
  static const struct {
    int64_t shape[5];
    int layout;
  } cfg[] = {{{64, 40, 16, 16}, BN_CL}, {{32, 24, 28, 28}, BN_CONTIG}, {{16, 64, 7, 7}, BN_CL}};
  for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++)
    for (int mode = 0; mode < 3; mode += 2) {
      bn_spec sp = bn_sweep_spec(4, cfg[ci].shape, cfg[ci].layout, KILN_BF16, mode, 1.0, 800 + ci * 2 + mode);
      bn_out a, b;
      if (bn_run(&sp, bc_gpu(), &a) && bn_run(&sp, bc_gpu(), &b)) bn_compare("cuda run twice", &sp, &a, &b, 0, 0);
      bn_out_free(&a), bn_out_free(&b);
    }
}

/* kiln_batch_norm_relu on the device: bit for bit the separate ReLU's numbers there
** (test_ops_batchnorm's check), and close to the CPU's fused op. */
static void bc_fused(void) {
  bn_relu_fused(bc_gpu());
  static const struct {
    int64_t shape[5];
    int layout;
  } cfg[] = {{{8, 40, 7, 7, 0}, BN_CL}, {{8, 24, 14, 14, 0}, BN_CONTIG}, {{4, 7, 5, 5, 0}, BN_CL}};
  static const kiln_dtype dts[2] = {KILN_F32, KILN_BF16};
  for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++)
    for (int di = 0; di < 2; di++) {
      bn_spec sp = bn_sweep_spec(4, cfg[ci].shape, cfg[ci].layout, dts[di], 2, 0.3, 850 + ci * 2 + (uint64_t)di);
      sp.fused = true;
      bn_out gpu, cpu;
      if (bn_run(&sp, bc_gpu(), &gpu) && bn_run(&sp, kiln_device_cpu(), &cpu)) {
        double rt, at;
        bc_tol(sp.dt, &rt, &at);
        bn_compare("batch_norm_relu cuda vs cpu", &sp, &gpu, &cpu, rt, at);
      }
      bn_out_free(&gpu), bn_out_free(&cpu);
    }
}

/* ---- 8. batch norm, ReLU and max-pool in one op ---- */

static double *bc_read(kiln_tensor *t) {
  kiln_tensor *h = t ? kiln_contiguous(kiln_to_dtype(kiln_to_device(t, kiln_device_cpu()), KILN_F64)) : NULL;
  if (!h) return NULL;
  int64_t n = kiln_numel(h);
  double *v = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  if (v && kiln_to_host(h, v, (size_t)n * sizeof(double)) != KILN_OK) free(v), v = NULL;
  return v;
}

static bool bc_same(const char *what, kiln_tensor *got, kiln_tensor *want, double rtol, double atol) {
  double *g = bc_read(got), *w = bc_read(want);
  bool ok = false;
  if (!g || !w || kiln_numel(got) != kiln_numel(want))
    H_CHECK(false, "%s: could not read the results (or sizes differ): %s", what, kiln_last_error_message());
  else
    ok = h_close(what, g, w, kiln_numel(want), rtol, atol);
  free(g), free(w);
  return ok;
}

typedef struct bc_pcase {
  int64_t N, C, H, W, k, s, p;
} bc_pcase;

static const bc_pcase bc_pcases[] = {
    {2, 64, 15, 16, 3, 2, 1}, /* ResNet's stem window, odd sizes */
    {3, 8, 9, 9, 2, 2, 0},    /* tiling */
    {2, 16, 7, 8, 3, 1, 1},   /* stride 1: up to 9 windows a pixel */
    {2, 4, 11, 6, 3, 2, 1},   /* 4 channels */
    {1, 2, 9, 7, 5, 2, 2},    /* 2 channels, 5x5 */
    {2, 3, 9, 10, 3, 2, 1},   /* 3 channels: a channel a thread (the generic gather) */
};

/* res: y, dx, dweight, dbias, running_mean, running_var; the fused op or the three ops */
static kiln_status bc_pool_run(const bc_pcase *k, kiln_dtype dt, kiln_device dev, bool fused, bool train,
                               const double *xv, const double *gv, kiln_tensor *res[6]) {
  const int64_t xs[4] = {k->N, k->C, k->H, k->W};
  const int64_t ks[2] = {k->k, k->k}, ss[2] = {k->s, k->s}, ps[2] = {k->p, k->p};
  const int64_t OH = (k->H + 2 * k->p - k->k) / k->s + 1, OW = (k->W + 2 * k->p - k->k) / k->s + 1;
  const int64_t ys[4] = {k->N, k->C, OH, OW};
  kiln_dtype pdt = dt == KILN_F64 ? KILN_F64 : KILN_F32;
  kiln_tensor *x = kiln_detach(bn_channels_inner(bn_on(xv, 4, xs, dt, dev)));
  kiln_tensor *g = bn_on(gv, 4, ys, dt, dev);
  double *wv = bn_host_randn(k->C, 71, 0.5, 1.0), *bv = bn_host_randn(k->C, 72, 0.3, 0.0);
  kiln_tensor *w = wv ? kiln_detach(bn_on(wv, 1, &k->C, pdt, dev)) : NULL;
  kiln_tensor *b = bv ? kiln_detach(bn_on(bv, 1, &k->C, pdt, dev)) : NULL;
  free(wv), free(bv);
  kiln_tensor *rm = kiln_zeros(1, &k->C, pdt, dev), *rv = kiln_ones(1, &k->C, pdt, dev);
  if (!x || !g || !w || !b || !rm || !rv) return kiln_last_error();
  kiln_requires_grad_(x, true), kiln_requires_grad_(w, true), kiln_requires_grad_(b, true);
  if (!train) { /* eval: running statistics of some spread */
    kiln_fill_(rm, 0.25), kiln_fill_(rv, 2.0);
  }
  kiln_tensor *y = fused ? kiln__batch_norm_relu_max_pool2d(x, rm, rv, w, b, train, 0.1, 1e-5, ks, ss, ps)
                         : kiln_max_pool2d(kiln_batch_norm_relu(x, rm, rv, w, b, train, 0.1, 1e-5), ks, ss, ps, NULL, NULL);
  kiln_tensor *loss = y ? kiln_sum_all(kiln_mul(y, g)) : NULL;
  kiln_status st = loss ? kiln_backward(loss, NULL) : kiln_last_error();
  if (st != KILN_OK) return st;
  res[0] = y, res[1] = kiln_grad(x), res[2] = kiln_grad(w), res[3] = kiln_grad(b), res[4] = rm, res[5] = rv;
  return KILN_OK;
}

static void bc_pool_fused(void) {
  static const kiln_dtype dts[3] = {KILN_BF16, KILN_F16, KILN_F32};
  static const char *const part[6] = {"y", "dx", "dweight", "dbias", "running_mean", "running_var"};
  for (size_t ci = 0; ci < sizeof bc_pcases / sizeof bc_pcases[0]; ci++)
    for (int di = 0; di < 3; di++)
      for (int train = 1; train >= 0; train--)
        for (int ties = 0; ties < 2; ties++) {
          const bc_pcase *k = &bc_pcases[ci];
          const kiln_dtype dt = dts[di];
          kiln_scope_begin();
          const int64_t OH = (k->H + 2 * k->p - k->k) / k->s + 1, OW = (k->W + 2 * k->p - k->k) / k->s + 1;
          const int64_t nx = k->N * k->C * k->H * k->W, ny = k->N * k->C * OH * OW;
          double *xv = bn_host_randn(nx, 900 + ci, 1.0, 0.2), *gv = bn_host_randn(ny, 950 + ci, 1.0, 0.0);
          for (int64_t i = 0; ties && xv && i < nx; i++) xv[i] = round(xv[i] * 2) / 2; /* a grid of halves */
          char what[200];
          snprintf(what, sizeof what, "bn_relu_pool case %zu %s %s%s", ci, kiln_dtype_name(dt), train ? "train" : "eval",
                   ties ? " ties" : "");
#ifndef BC_GPU_IS_CPU
          { /* taken on CUDA for channels-last x, not for NCHW */
            const int64_t xs[4] = {k->N, k->C, k->H, k->W};
            const int64_t ks[2] = {k->k, k->k}, ss[2] = {k->s, k->s}, ps[2] = {k->p, k->p};
            kiln_tensor *x = xv ? bn_on(xv, 4, xs, dt, bc_gpu()) : NULL;
            kiln_tensor *rm = kiln_zeros(1, &k->C, KILN_F32, bc_gpu()), *rv = kiln_ones(1, &k->C, KILN_F32, bc_gpu());
            H_CHECK(x && kiln__batch_norm_relu_max_pool2d_native(bn_channels_inner(x), rm, rv, NULL, NULL, train, ks, ss, ps),
                    "%s: not taken by the fused kernels", what);
            H_CHECK(x && !kiln__batch_norm_relu_max_pool2d_native(x, rm, rv, NULL, NULL, train, ks, ss, ps),
                    "%s: NCHW taken by the fused kernels", what);
          }
#endif
          kiln_tensor *fz[6] = {0}, *ops[6] = {0}, *ref[6] = {0};
          kiln_fallback_policy saved = kiln_fallback_policy_get();
          kiln_set_fallback_policy(KILN_FALLBACK_ERROR);
          kiln_status s1 = xv && gv ? bc_pool_run(k, dt, bc_gpu(), true, train, xv, gv, fz) : KILN_ERR_OOM;
          kiln_status s2 = s1 == KILN_OK ? bc_pool_run(k, dt, bc_gpu(), false, train, xv, gv, ops) : s1;
          kiln_set_fallback_policy(saved);
          kiln_status s3 = s2 == KILN_OK && dt == KILN_F32 ? bc_pool_run(k, KILN_F64, kiln_device_cpu(), false, train, xv, gv, ref) : s2;
          if (s1 != KILN_OK || s2 != KILN_OK || s3 != KILN_OK) {
            H_CHECK(false, "%s: a run failed: %s", what, kiln_last_error_message());
          } else {
            /* one rounding of the gradients apart (the overlapping windows' sums in another order) */
            const double tol = dt == KILN_BF16 ? 1e-2 : dt == KILN_F16 ? 2e-3 : 1e-5;
            for (int q = 0; q < 6; q++) {
              char nm[260];
              snprintf(nm, sizeof nm, "%s %s, fused vs the ops on the device", what, part[q]);
              bool exact = q == 0 || q >= 4;
              bc_same(nm, fz[q], ops[q], exact ? 0 : tol, exact ? 0 : tol);
              if (dt == KILN_F32) {
                snprintf(nm, sizeof nm, "%s %s, fused vs the CPU's f64 ops", what, part[q]);
                bc_same(nm, fz[q], ref[q], 1e-4, 1e-4);
              }
            }
          }
          free(xv), free(gv);
          kiln_scope_end();
        }
}

/* kiln_batch_norm_add_relu: the device against the CPU (both fused), every output and
** gradient (y, the running statistics, dx, dweight, dbias, dresidual). */
static void bc_add_relu(void) {
  bn_add_relu_fused(bc_gpu()); /* against the f64 three ops on the device */
  static const struct {
    int64_t shape[5];
    int layout;
    bool res_cl;
  } cfg[] = {
      {{3, 7, 5, 3, 0}, BN_CONTIG, false}, /* C 7, S 15: scalar */
      {{3, 7, 5, 3, 0}, BN_CL, true},
      {{3, 7, 5, 3, 0}, BN_CL, false},     /* the residual copied to x's layout */
      {{4, 12, 7, 7, 0}, BN_CL, true},     /* C 12: 4-wide 16-bit vectors */
      {{4, 12, 7, 7, 0}, BN_CONTIG, true},
      {{6, 20, 11, 13, 0}, BN_CONTIG, false}, /* S 143 */
      {{8, 40, 7, 7, 0}, BN_CL, true},     /* C 40: 8-wide, 5 vectors a row */
      {{16, 64, 9, 9, 0}, BN_CL, true},    /* C 64: ResNet's narrowest, 1296 rows */
      {{32, 24, 28, 28, 0}, BN_CL, true},  /* 25k rows: many splits of a channel */
      {{32, 8, 28, 28, 0}, BN_CONTIG, false},
  };
  static const kiln_dtype dts[3] = {KILN_F32, KILN_BF16, KILN_F16};
  static const char *const names[7] = {"y", "running_mean", "running_var", "dx", "dweight", "dbias", "dresidual"};
  for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++)
    for (int di = 0; di < 3; di++)
      for (int mode = 0; mode < 2; mode++) {
        bn_spec sp = bn_sweep_spec(4, cfg[ci].shape, cfg[ci].layout, dts[di], mode, 0.5,
                                   1200 + ci * 8 + (uint64_t)di * 2 + (uint64_t)mode);
        double *a[7] = {NULL}, *b[7] = {NULL};
        int64_t na[7] = {0}, nb[7] = {0};
        if (bnar_run(&sp, cfg[ci].res_cl, true, bc_gpu(), a, na) &&
            bnar_run(&sp, cfg[ci].res_cl, true, kiln_device_cpu(), b, nb)) {
          double rt, at;
          bc_tol(sp.dt, &rt, &at);
          for (int k = 0; k < 7; k++) {
            char name[192];
            snprintf(name, sizeof name, "batch_norm_add_relu cuda vs cpu [%lld, %lld, %lld, %lld] %s %s %s %s %s",
                     (long long)sp.shape[0], (long long)sp.shape[1], (long long)sp.shape[2], (long long)sp.shape[3],
                     bn_layout_name[sp.layout], cfg[ci].res_cl ? "residual CL" : "residual NCHW",
                     kiln_dtype_name(sp.dt), sp.train ? "training" : "eval", names[k]);
            H_CHECK(na[k] == nb[k], "%s: sizes %lld, %lld", name, (long long)na[k], (long long)nb[k]);
            if (na[k] == nb[k]) h_close(name, a[k], b[k], na[k], rt, at);
          }
        }
        for (int k = 0; k < 7; k++) free(a[k]), free(b[k]);
      }
  /* the kernels that ran: one forward (the residual in it), one backward (the residual's
  ** gradient written by it: no RELU_BACKWARD), nothing sent to the CPU; run twice, the
  ** same bits (fixed-order reductions) */
  for (int lay = 0; lay < 2; lay++) {
    const int64_t shape[5] = {16, 40, 9, 9, 0};
    bn_spec sp = bn_sweep_spec(4, shape, lay ? BN_CL : BN_CONTIG, KILN_BF16, 0, 0.5, 1300 + (uint64_t)lay);
    bn_seen seen = {0};
    double *a[7] = {NULL}, *b[7] = {NULL};
    int64_t na[7] = {0}, nb[7] = {0};
    kiln__dispatch_observe(bn_observe, &seen);
    bool ok = bnar_run(&sp, lay == 1, true, bc_gpu(), a, na);
    kiln__dispatch_observe(NULL, NULL);
#ifndef BC_GPU_IS_CPU
    const int relu_bwd = 0; /* flag 4 on CUDA */
#else
    const int relu_bwd = 1; /* the CPU keeps RELU_BACKWARD + the unmasked kernel */
#endif
    H_CHECK(ok && seen.fwd == 1 && seen.bwd == 1 && seen.relu_bwd == relu_bwd && seen.fell_back == 0,
            "batch_norm_add_relu %s on the device: %d forward, %d backward, %d relu_backward (want %d), %d fell back",
            lay ? "channels-last" : "NCHW", seen.fwd, seen.bwd, seen.relu_bwd, relu_bwd, seen.fell_back);
    if (ok && bnar_run(&sp, lay == 1, true, bc_gpu(), b, nb))
      for (int k = 0; k < 7; k++) {
        char name[96];
        snprintf(name, sizeof name, "batch_norm_add_relu %s run twice: %s", lay ? "channels-last" : "NCHW", names[k]);
        H_CHECK(na[k] == nb[k], "%s: sizes", name);
        if (na[k] == nb[k]) h_close(name, a[k], b[k], na[k], 0, 0);
      }
    for (int k = 0; k < 7; k++) free(a[k]), free(b[k]);
  }
}

/* Channels-last views whose rows are not evenly spaced (a slice along H of a channels-last
** tensor: the kernels step (n, s) instead of flat rows), against the CPU: y and dx, under
** a ReLU and plain. */
static void bc_cl_slice(void) {
  static const kiln_dtype dts[2] = {KILN_F32, KILN_BF16};
  for (int di = 0; di < 2; di++)
    for (int relu = 0; relu < 2; relu++) {
      double *res[2][2] = {{NULL, NULL}, {NULL, NULL}};
      int64_t nr[2] = {0, 0};
      for (int side = 0; side < 2; side++) {
        kiln_scope_begin();
        kiln_device dev = side ? kiln_device_cpu() : bc_gpu();
        const int64_t sh[4] = {6, 16, 9, 7};
        double *v = bn_host_randn(h_numel(4, sh), 41 + (uint64_t)di, 1.0, 0.5);
        double *gv = bn_host_randn(6 * 16 * 5 * 7, 43 + (uint64_t)di, 1.0, 0.0);
        kiln_tensor *base = kiln_detach(kiln_contiguous_format(bn_on(v, 4, sh, dts[di], dev), KILN_CHANNELS_LAST));
        kiln_requires_grad_(base, true);
        kiln_tensor *x = kiln_narrow(base, 2, 2, 5); /* rows (n, s) not evenly spaced */
        kiln_tensor *g = kiln_contiguous_format(bn_on(gv, 4, (const int64_t[]){6, 16, 5, 7}, dts[di], dev), KILN_CHANNELS_LAST);
        kiln_tensor *w = kiln_full(1, (const int64_t[]){16}, 1.5, KILN_F32, dev), *b = kiln_full(1, (const int64_t[]){16}, 0.25, KILN_F32, dev);
        kiln_tensor *y = kiln_batch_norm(x, NULL, NULL, w, b, true, 0.1, 1e-5);
        if (relu) y = kiln_relu(y);
        kiln_tensor *gx = NULL;
        bool ok = y && kiln_autograd_grad(1, &y, &g, 1, &base, &gx) == KILN_OK && gx;
        H_CHECK(ok, "channels-last slice %s on side %d: %s", kiln_dtype_name(dts[di]), side, kiln_last_error_message());
        if (ok) res[side][0] = h_values(y, &nr[0]), res[side][1] = h_values(gx, &nr[1]);
        free(v), free(gv);
        kiln_scope_end();
      }
      double rt, at;
      bc_tol(dts[di], &rt, &at);
      for (int k = 0; k < 2; k++) {
        char name[128];
        snprintf(name, sizeof name, "channels-last H-slice %s%s %s: cuda vs cpu", kiln_dtype_name(dts[di]),
                 relu ? " + relu" : "", k ? "dx" : "y");
        if (res[0][k] && res[1][k]) h_close(name, res[0][k], res[1][k], nr[k], rt, at);
        free(res[0][k]), free(res[1][k]);
      }
    }
}

/* ---- 7. the recomputed mask ---- */

typedef struct bc_rc_seen {
  int rc, masked, fell_back; /* backward calls with flag 8, with flag 2, not native */
} bc_rc_seen;

static void bc_rc_observe(void *ctx, kiln_device dev, const kiln__kargs *a, bool native) {
  bc_rc_seen *s = ctx;
  (void)dev;
  if (a->op != KILN__K_BATCH_NORM_BACKWARD) return;
  if (!native) s->fell_back++;
  if (a->i[0] & 8) s->rc++;
  if (a->i[0] & 2) s->masked++;
}

/* relu(batch_norm(x)) (fused: kiln_batch_norm_relu, else the ReLU peephole) forward and
** backward on the device; res: y, dx, dweight, dbias as doubles. */
static bool bc_rc_run(const int64_t *sh, kiln_dtype dt, bool cl, bool fused, bool train, const double *xv,
                      const double *gv, const double *wv, const double *bv, double **res, int64_t *nres,
                      bc_rc_seen *seen) {
  kiln_scope_begin();
  kiln_device dev = bc_gpu();
  kiln_dtype pdt = dt == KILN_F64 ? KILN_F64 : KILN_F32;
  const int64_t C = sh[1];
  kiln_tensor *x = bn_on(xv, 4, sh, dt, dev), *g = bn_on(gv, 4, sh, dt, dev);
  if (cl) x = kiln_contiguous_format(x, KILN_CHANNELS_LAST), g = kiln_contiguous_format(g, KILN_CHANNELS_LAST);
  x = kiln_detach(x);
  kiln_tensor *w = kiln_detach(bn_on(wv, 1, &C, pdt, dev)), *b = kiln_detach(bn_on(bv, 1, &C, pdt, dev));
  kiln_tensor *rm = kiln_full(1, &C, 0.0, pdt, dev), *rv = kiln_full(1, &C, 1.0, pdt, dev);
  bool ok = x && g && w && b && rm && rv && kiln_requires_grad_(x, true) == KILN_OK &&
            kiln_requires_grad_(w, true) == KILN_OK && kiln_requires_grad_(b, true) == KILN_OK;
  kiln_tensor *y = !ok ? NULL
                   : fused ? kiln_batch_norm_relu(x, rm, rv, w, b, train, 0.1, 1e-5)
                           : kiln_relu(kiln_batch_norm(x, rm, rv, w, b, train, 0.1, 1e-5));
  kiln_tensor *ins[3] = {x, w, b}, *gr[3] = {NULL, NULL, NULL};
  kiln__dispatch_observe(bc_rc_observe, seen);
  ok = y && kiln_autograd_grad(1, &y, &g, 3, ins, gr) == KILN_OK && gr[0] && gr[1] && gr[2];
  kiln__dispatch_observe(NULL, NULL);
  H_CHECK(ok, "recomputed mask: %s %s %s %s ran: %s", kiln_dtype_name(dt), cl ? "channels-last" : "NCHW",
          fused ? "batch_norm_relu" : "relu(batch_norm)", train ? "training" : "eval", kiln_last_error_message());
  if (ok) {
    res[0] = h_values(y, &nres[0]);
    for (int k = 0; k < 3; k++) res[1 + k] = h_values(gr[k], &nres[1 + k]);
  }
  kiln_scope_end();
  return ok;
}

/* The two backwards of one forward must agree bit for bit: the recomputed decision is the
** forward's (same coefficients, same fma, same rounding to the dtype). */
static void bc_mask_recompute(void) {
  static const struct {
    int64_t shape[4];
    bool cl;
  } cfg[] = {
      {{4, 16, 6, 6}, false}, /* S 36: 4-wide (2-wide f64) */
      {{4, 16, 6, 6}, true},  /* C 16: 8-wide 16-bit, 4-wide f32 */
      {{3, 12, 7, 7}, false}, /* S 49: scalar */
      {{3, 12, 7, 7}, true},  /* C 12: 4-wide 16-bit */
      {{2, 7, 5, 3}, true},   /* C 7: scalar */
      {{32, 24, 28, 28}, true},  /* 25k rows: many splits of a channel */
      {{32, 8, 28, 28}, false},
  };
  static const kiln_dtype dts[4] = {KILN_F32, KILN_BF16, KILN_F16, KILN_F64};
  static const char *const names[4] = {"y", "dx", "dweight", "dbias"};
  const char *saved_env = getenv("KILN_BN_MASK_RECOMPUTE");
  for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++) {
    const int64_t *sh = cfg[ci].shape, C = sh[1], per = sh[0] * sh[2] * sh[3], n = C * per;
    double *xv = bn_host_randn(n, 1500 + ci, 1.0, 0.0), *gv = bn_host_randn(n, 1600 + ci, 1.0, 0.0);
    double *wv = malloc((size_t)C * sizeof(double)), *bv = malloc((size_t)C * sizeof(double));
    if (!xv || !gv || !wv || !bv) {
      H_CHECK(false, "recomputed mask: out of memory");
      free(xv), free(gv), free(wv), free(bv);
      return;
    }
    /* channel kinds (c % 4): 0 weight 0 and the bias 0, +-1e-9 (an f16 positive that
    ** rounds to +0) or 1e-40 (an f32 subnormal): bn(x) = the bias exactly; 1 integers in
    ** -2..2 with weight 1, bias 0: x = 0 gives -mean k, 0 or tiny, ties; 2 a weight of
    ** 1e-30: every value tiny (0 in f16); 3 ordinary */
    static const double tiny_b[4] = {0.0, 1e-9, -1e-9, 1e-40};
    for (int64_t c = 0; c < C; c++) {
      int kind = (int)(c % 4);
      wv[c] = kind == 0 ? 0.0 : kind == 1 ? 1.0 : kind == 2 ? 1e-30 : 1.5;
      bv[c] = kind == 0 ? tiny_b[(c / 4) % 4] : kind == 3 ? 0.3 : 0.0;
      if (kind == 1)
        for (int64_t i = 0; i < sh[0]; i++)
          for (int64_t s = 0; s < sh[2] * sh[3]; s++) xv[(i * C + c) * sh[2] * sh[3] + s] = (double)((i * 7 + s * 3 + c) % 5 - 2);
    }
    for (int di = 0; di < 4; di++)
      for (int fused = 0; fused < 2; fused++)
        for (int train = 1; train >= 0; train--) {
          double *r[2][4] = {{NULL}};
          int64_t nr[2][4] = {{0}};
          bc_rc_seen seen[2] = {{0, 0, 0}, {0, 0, 0}};
          setenv("KILN_BN_MASK_RECOMPUTE", "1", 1);
          bool a = bc_rc_run(sh, dts[di], cfg[ci].cl, fused, train, xv, gv, wv, bv, r[0], nr[0], &seen[0]);
          setenv("KILN_BN_MASK_RECOMPUTE", "0", 1);
          bool b = bc_rc_run(sh, dts[di], cfg[ci].cl, fused, train, xv, gv, wv, bv, r[1], nr[1], &seen[1]);
          char what[160];
          snprintf(what, sizeof what, "[%lld, %lld, %lld, %lld] %s %s %s %s", (long long)sh[0], (long long)sh[1],
                   (long long)sh[2], (long long)sh[3], kiln_dtype_name(dts[di]), cfg[ci].cl ? "channels-last" : "NCHW",
                   fused ? "batch_norm_relu" : "relu(batch_norm)", train ? "training" : "eval");
#ifndef BC_GPU_IS_CPU
          H_CHECK(seen[0].rc == 1 && seen[0].masked == 0 && seen[0].fell_back == 0,
                  "recomputed mask %s: one backward with flag 8 and no mask (%d, %d, %d fell back)", what, seen[0].rc,
                  seen[0].masked, seen[0].fell_back);
#endif
          H_CHECK(seen[1].rc == 0 && seen[1].masked == 1 && seen[1].fell_back == 0,
                  "KILN_BN_MASK_RECOMPUTE=0 %s: one backward reading the mask (%d flag 8, %d flag 2, %d fell back)",
                  what, seen[1].rc, seen[1].masked, seen[1].fell_back);
          for (int k = 0; a && b && k < 4; k++) {
            int64_t bad = nr[0][k] == nr[1][k] ? 0 : -1, first = -1;
            for (int64_t i = 0; bad >= 0 && i < nr[0][k]; i++)
              if (memcmp(&r[0][k][i], &r[1][k][i], sizeof(double)) != 0) {
                if (first < 0) first = i;
                bad++;
              }
            H_CHECK(bad == 0, "recomputed vs read mask %s %s: %lld of %lld differ in bits (first %lld: %.9g vs %.9g)",
                    what, names[k], (long long)bad, (long long)nr[0][k], (long long)first,
                    first >= 0 ? r[0][k][first] : 0.0, first >= 0 ? r[1][k][first] : 0.0);
          }
          for (int s = 0; s < 2; s++)
            for (int k = 0; k < 4; k++) free(r[s][k]);
        }
    free(xv), free(gv), free(wv), free(bv);
  }
  if (saved_env) setenv("KILN_BN_MASK_RECOMPUTE", saved_env, 1);
  else unsetenv("KILN_BN_MASK_RECOMPUTE");
}

static void bc_max_pool(void) {
  static const struct {
    int64_t shape[4], k[2], s[2], p[2], d[2];
    bool cl;
  } cfg[] = {{{4, 8, 33, 31}, {3, 3}, {2, 2}, {1, 1}, {1, 1}, false},
             {{2, 5, 17, 20}, {2, 3}, {1, 2}, {0, 1}, {2, 1}, false},
             {{4, 16, 12, 14}, {3, 3}, {2, 2}, {1, 1}, {1, 1}, true},
             /* the channels-last kernels: 4-wide (C 12), scalar (C 5) with a dilated window,
             ** and a stride wider than the window (pixels no window covers get 0) */
             {{3, 12, 15, 13}, {3, 3}, {2, 2}, {1, 1}, {1, 1}, true},
             {{2, 5, 17, 20}, {2, 3}, {1, 2}, {0, 1}, {2, 1}, true},
             {{2, 16, 11, 11}, {2, 2}, {3, 3}, {0, 0}, {1, 1}, true}};
  static const kiln_dtype dts[3] = {KILN_F32, KILN_BF16, KILN_F64};
  for (size_t ci = 0; ci < sizeof cfg / sizeof cfg[0]; ci++)
    for (int di = 0; di < 3; di++) {
      kiln_scope_begin();
      int64_t n = h_numel(4, cfg[ci].shape);
      /* values on a coarse grid: ties between windows happen, and resolve the same way */
      double *v = bn_host_randn(n, 900 + ci, 1.0, 0.0);
      for (int64_t i = 0; i < n; i++) v[i] = round(v[i] * 4) / 4;
      double *gv = bn_host_randn(n, 950 + ci, 1.0, 0.0);
      double *res[2] = {NULL, NULL};
      int64_t nr = 0;
      for (int side = 0; side < 2; side++) {
        kiln_device dev = side ? kiln_device_cpu() : bc_gpu();
        kiln_tensor *x = bn_on(v, 4, cfg[ci].shape, dts[di], dev);
        if (cfg[ci].cl) x = kiln_detach(kiln_contiguous_format(x, KILN_CHANNELS_LAST));
        kiln_requires_grad_(x, true);
        kiln_tensor *y = kiln_max_pool2d(x, cfg[ci].k, cfg[ci].s, cfg[ci].p, cfg[ci].d, NULL);
        kiln_tensor *g = y ? bn_on(gv, 4, kiln_shape(y), dts[di], dev) : NULL;
        kiln_tensor *gx = NULL;
        if (y && g && kiln_autograd_grad(1, &y, &g, 1, &x, &gx) == KILN_OK && gx) res[side] = h_values(gx, &nr);
        else H_CHECK(false, "max_pool2d backward case %zu on %s: %s", ci, kiln__device_cstr(dev), kiln_last_error_message());
      }
      if (res[0] && res[1]) {
        char name[96];
        double rt, at;
        bc_tol(dts[di], &rt, &at);
        snprintf(name, sizeof name, "max_pool2d backward case %zu %s", ci, kiln_dtype_name(dts[di]));
        h_close(name, res[0], res[1], nr, rt, at);
      }
      free(res[0]), free(res[1]), free(v), free(gv);
      kiln_scope_end();
    }
}

static double bc_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ms per call of fn over reps calls after two warm-ups (the device waited for) */
typedef kiln_status (*bc_fn)(void *ctx);
static double bc_time(bc_fn fn, void *ctx, int reps) {
  kiln_device dev = bc_gpu();
  for (int i = 0; i < 2; i++)
    if (fn(ctx) != KILN_OK) return -1;
  if (kiln_device_synchronize(dev) != KILN_OK) return -1;
  double t0 = bc_now();
  for (int i = 0; i < reps; i++)
    if (fn(ctx) != KILN_OK) return -1;
  if (kiln_device_synchronize(dev) != KILN_OK) return -1;
  return (bc_now() - t0) * 1e3 / reps;
}

typedef struct bc_bn {
  kiln_tensor *x, *w, *b, *rm, *rv, *g;
  bool backward, relu; /* relu: ReLU(batch_norm(x)), its backward folded into batch_norm's */
  bool fused;          /* with relu: kiln_batch_norm_relu */
} bc_bn;
static kiln_status bc_bn_step(void *ctx) {
  bc_bn *c = ctx;
  kiln_scope_begin();
  kiln_tensor *y = c->relu && c->fused ? kiln_batch_norm_relu(c->x, c->rm, c->rv, c->w, c->b, true, 0.1, 1e-5)
                                       : kiln_batch_norm(c->x, c->rm, c->rv, c->w, c->b, true, 0.1, 1e-5);
  if (c->relu && !c->fused) y = kiln_relu(y);
  kiln_tensor *ins[3] = {c->x, c->w, c->b}, *gr[3] = {NULL, NULL, NULL};
  kiln_status st = !y ? kiln_last_error() : c->backward ? kiln_autograd_grad(1, &y, &c->g, 3, ins, gr) : KILN_OK;
  kiln_scope_end();
  return st;
}

typedef struct bc_pool {
  kiln_tensor *x, *g;
} bc_pool;
static kiln_status bc_pool_step(void *ctx) {
  bc_pool *c = ctx;
  kiln_scope_begin();
  kiln_tensor *y = kiln_max_pool2d(c->x, (const int64_t[]){3, 3}, (const int64_t[]){2, 2}, (const int64_t[]){1, 1}, NULL, NULL);
  kiln_tensor *gx = NULL;
  kiln_status st = y ? kiln_autograd_grad(1, &y, &c->g, 1, &c->x, &gx) : kiln_last_error();
  kiln_scope_end();
  return st;
}

/* batch_norm forward and forward + backward (under a ReLU, as ResNet's) on shape, bf16, f32
** parameters; prints ms and GB/s: forward moves x twice and y once, backward x, g and the
** mask twice and dx once. */
static void bc_time_bn(const int64_t *shape, bool cl) {
  kiln_device dev = bc_gpu();
  kiln_scope_begin();
  int64_t N = shape[0], C = shape[1], H = shape[2], W = shape[3];
  double gb = (double)(N * C * H * W) * 2 / 1e9;
  bc_bn c = {0};
  c.x = kiln_randn(KILN_SHAPE(N, C, H, W), KILN_BF16, dev, NULL);
  c.g = kiln_randn(KILN_SHAPE(N, C, H, W), KILN_BF16, dev, NULL);
  if (cl) {
    c.x = kiln_contiguous_format(c.x, KILN_CHANNELS_LAST);
    c.g = kiln_contiguous_format(c.g, KILN_CHANNELS_LAST);
  }
  c.w = kiln_ones(KILN_SHAPE(C), KILN_F32, dev), c.b = kiln_zeros(KILN_SHAPE(C), KILN_F32, dev);
  c.rm = kiln_zeros(KILN_SHAPE(C), KILN_F32, dev), c.rv = kiln_ones(KILN_SHAPE(C), KILN_F32, dev);
  kiln_requires_grad_(c.x, true), kiln_requires_grad_(c.w, true), kiln_requires_grad_(c.b, true);
  double f = bc_time(bc_bn_step, &c, 10);
  c.relu = true;
  double fr = bc_time(bc_bn_step, &c, 10);
  c.backward = true;
  double fb = bc_time(bc_bn_step, &c, 10) - fr + f;
  c.fused = true;
  double ufb = bc_time(bc_bn_step, &c, 10);
  c.backward = false;
  double uf = bc_time(bc_bn_step, &c, 10);
  H_CHECK(f > 0 && fr > 0 && fb > 0 && uf > 0 && ufb > 0, "batch_norm timing ran: %s", kiln_last_error_message());
  printf("test_cuda_batchnorm: bn (%lld,%lld,%lld,%lld) %s: fwd %.3f ms %.0f GB/s, bwd %.3f ms %.0f GB/s; "
         "+relu fwd %.3f fwd+bwd %.3f, fused %.3f %.3f\n",
         (long long)N, (long long)C, (long long)H, (long long)W, cl ? "CL" : "NCHW", f, 3 * gb / (f * 1e-3), fb - f,
         7 * gb / ((fb - f) * 1e-3), fr, fb - f + fr, uf, ufb);
  kiln_scope_end();
}

static void bc_time_pool(const int64_t *shape, bool cl) {
  kiln_device dev = bc_gpu();
  kiln_scope_begin();
  bc_pool p;
  int64_t N = shape[0], C = shape[1], H = shape[2], W = shape[3];
  p.x = kiln_randn(KILN_SHAPE(N, C, H, W), KILN_BF16, dev, NULL);
  p.g = kiln_randn(KILN_SHAPE(N, C, (H - 1) / 2 + 1, (W - 1) / 2 + 1), KILN_BF16, dev, NULL);
  if (cl) {
    p.x = kiln_contiguous_format(p.x, KILN_CHANNELS_LAST);
    p.g = kiln_contiguous_format(p.g, KILN_CHANNELS_LAST);
  }
  kiln_requires_grad_(p.x, true);
  double t = bc_time(bc_pool_step, &p, 10);
  H_CHECK(t > 0, "max_pool2d timing ran: %s", kiln_last_error_message());
  printf("test_cuda_batchnorm: max_pool2d 3x3/2 (%lld,%lld,%lld,%lld) bf16 %s fwd+bwd: %.3f ms\n", (long long)N,
         (long long)C, (long long)H, (long long)W, cl ? "CL" : "NCHW", t);
  kiln_scope_end();
}

static void bc_timings(void) {
  /* ResNet-50's batch-norm shapes at batch 256 (the stem, each stage's widest and
  ** narrowest), then (128, 256, 56, 56) as the first version's log printed it */
  static const int64_t bn_shapes[][4] = {{256, 64, 112, 112}, {256, 64, 56, 56}, {256, 256, 56, 56},
                                         {256, 128, 28, 28},  {256, 512, 28, 28}, {256, 1024, 14, 14},
                                         {256, 512, 7, 7},    {256, 2048, 7, 7}};
  const char *only = getenv("BC_TIMINGS"); /* "bn", "pool", "none", or unset for both */
  if (!only || !strcmp(only, "bn")) {
    for (size_t i = 0; i < sizeof bn_shapes / sizeof bn_shapes[0]; i++)
      for (int cl = 1; cl >= 0; cl--) bc_time_bn(bn_shapes[i], cl);
  }
  if (!only || !strcmp(only, "pool")) {
    static const int64_t pool_shapes[][4] = {{256, 64, 112, 112}, {128, 32, 28, 28}, {128, 64, 14, 14}};
    for (size_t i = 0; i < sizeof pool_shapes / sizeof pool_shapes[0]; i++)
      for (int cl = 1; cl >= 0; cl--) bc_time_pool(pool_shapes[i], cl);
  }
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0); /* a crash keeps what was printed */
  h_init(argc, argv, "test_cuda_batchnorm");
  h_set_cross_only(true);
#ifndef BC_GPU_IS_CPU
  if (kiln_device_count(KILN_DEVICE_CUDA) == 0) {
    printf("test_cuda_batchnorm: skipped (no CUDA device)\n");
    return 77;
  }
  const char *only = getenv("BC_TIMINGS_ONLY"); /* 1: just the timings (an A/B of a switch) */
  if (only && !strcmp(only, "1")) {
    bc_timings();
    return h_finish();
  }
  printf("test_cuda_batchnorm: harness cases\n");
  bn_family();
#endif
  printf("test_cuda_batchnorm: against the CPU\n");
  bc_vs_cpu();
  bc_offset();
  printf("test_cuda_batchnorm: a channel of 256x56x56, runs repeated, batch_norm_relu\n");
  bc_big();
  bc_repeat();
  bc_fused();
  bc_cl_slice();
  printf("test_cuda_batchnorm: batch_norm_add_relu\n");
  bc_add_relu();
  printf("test_cuda_batchnorm: the backward's mask recomputed against the mask read\n");
  bc_mask_recompute();
  printf("test_cuda_batchnorm: max_pool2d backward\n");
  bc_max_pool();
  printf("test_cuda_batchnorm: batch norm, ReLU and max-pool in one op\n");
  bc_pool_fused();
#ifndef BC_GPU_IS_CPU
  bc_timings();
#else
  (void)bn_family, (void)bc_timings; /* the harness's part (d) and the timings are CUDA's */
#endif
  return h_finish();
}
