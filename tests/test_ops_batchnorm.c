/*
** batch_norm through its kernels (BATCH_NORM, BATCH_NORM_BACKWARD; src/ops/ops_norm.c).
**
** 1. Harness cases (f64 reference here, gradcheck, non-contiguous and expanded variants,
**    every dtype, other backends): (N, C), (N, C, L), 5-d, no affine, training with
**    running statistics, eval.
** 2. The kernels against the composite (the path a device without them takes, checked
**    by the harness since it was written): the same call with the CPU's BATCH_NORM
**    disabled, over dtypes (f64, f32, f16, bf16 with f32 parameters, as under autocast),
**    layouts (contiguous, channels-last, a channel slice, a misaligned start, a stride-0
**    batch) and modes (training with running statistics, eval): y, the running
**    statistics, dx, dweight, dbias.
**    With a ReLU after it (mode 3): the ReLU's backward folded into the kernel's.
** 3. What a value check cannot see: the kernels ran (a dispatch observer; after a ReLU, no
**    ReLU-backward kernel), a
**    channels-last input gives channels-last y and dx, a mean of 1e4 beside a spread of 1
**    loses nothing, PyTorch's running-statistics rule with bf16 input and f32 buffers.
** 4. The CPU kernel's flag 4 (the masked gradient CUDA's batch_norm_add_relu backward
**    writes; the CPU's only for a fallback): g masked exactly, dx/dweight/dbias the masked
**    kernel's bits.
** The runner bn_run is shared with tests/test_cuda_batchnorm.c (CUDA against the CPU).
** Names are prefixed bn_.
*/
#include "harness.h"
#include "backend/backend.h"
#include "ops/op.h"
#include "core/kiln_int.h"

#include <stdlib.h>
#include <string.h>

/* ---- 1. harness cases --------------------------------------------------------------------- */

/* modes: 0 training (x, w, b); 1 eval (x, rm, rv, w, b); 2 training, no affine (x);
** 3 training with running statistics made in the builder (x, w, b) */
static int bn_ref(const h_arr *in, int n_in, h_arr *out, const void *ctx) {
  int mode = *(const int *)ctx;
  const h_arr *x = &in[0];
  (void)n_in;
  int64_t N = x->shape[0], C = x->shape[1], S = 1;
  for (int d = 2; d < x->ndim; d++) S *= x->shape[d];
  out->ndim = x->ndim;
  memcpy(out->shape, x->shape, sizeof out->shape);
  if (mode != 1 && N * S == 1) return 1;
  if (!out->data) return 0;
  for (int64_t c = 0; c < C; c++) {
    double mean = 0, var = 0;
    for (int64_t n = 0; n < N; n++)
      for (int64_t s = 0; s < S; s++) mean += x->data[(n * C + c) * S + s];
    mean /= (double)(N * S);
    for (int64_t n = 0; n < N; n++)
      for (int64_t s = 0; s < S; s++) {
        double d = x->data[(n * C + c) * S + s] - mean;
        var += d * d;
      }
    var /= (double)(N * S);
    if (mode == 1) mean = in[1].data[c], var = in[2].data[c];
    double w = mode == 2 ? 1 : in[mode == 1 ? 3 : 1].data[c], b = mode == 2 ? 0 : in[mode == 1 ? 4 : 2].data[c];
    for (int64_t n = 0; n < N; n++)
      for (int64_t s = 0; s < S; s++) {
        int64_t q = (n * C + c) * S + s;
        out->data[q] = (x->data[q] - mean) / sqrt(var + 1e-5) * w + b;
      }
  }
  return 0;
}

static kiln_tensor *bn_fn(kiln_tensor **in, const void *ctx) {
  int mode = *(const int *)ctx;
  if (mode == 0) return kiln_batch_norm(in[0], NULL, NULL, in[1], in[2], true, 0.1, 1e-5);
  if (mode == 1) return kiln_batch_norm(in[0], in[1], in[2], in[3], in[4], false, 0.1, 1e-5);
  if (mode == 2) return kiln_batch_norm(in[0], NULL, NULL, NULL, NULL, true, 0.1, 1e-5);
  /* the buffers live outside the graph, f32 whatever x is (a model's buffers under autocast) */
  int64_t C = kiln_shape(in[0])[1];
  kiln_tensor *rm = kiln_zeros(KILN_SHAPE(C), KILN_F32, kiln_device_of(in[0]));
  kiln_tensor *rv = kiln_full(KILN_SHAPE(C), 1.0, KILN_F32, kiln_device_of(in[0]));
  return kiln_batch_norm(in[0], rm, rv, in[1], in[2], true, 0.1, 1e-5);
}

#define BN_N H_SYM(0)
#define BN_X(nd, ...) {.ndim = nd, .shape = {__VA_ARGS__}, .fill = H_RANDN, .diff = true}
#define BN_V(c) {.ndim = 1, .shape = {c}, .fill = H_RANDN, .diff = true}
#define BN_F (H_CPU_ONLY | H_CUDA_NATIVE)
static const int bn_train = 0, bn_eval = 1, bn_plain = 2, bn_running = 3;

/* (N, C) skips the stride-0 variant: it repeats one row, so each channel has variance 0 and
** its gradients are rounding noise. */
static const h_case bn_cases[] = {
    {.name = "batch_norm (N, C) training", .fn = bn_fn, .ref = bn_ref, .ctx = &bn_train, .n_in = 3,
     .in = {BN_X(2, BN_N, 5), BN_V(5), BN_V(5)}, .sym = {4}, .flags = BN_F | H_NO_SIZE0 | H_NO_EXPAND},
    {.name = "batch_norm (N, C, L) training", .fn = bn_fn, .ref = bn_ref, .ctx = &bn_train, .n_in = 3,
     .in = {BN_X(3, BN_N, 3, 7), BN_V(3), BN_V(3)}, .sym = {2}, .flags = BN_F | H_NO_SIZE0},
    {.name = "batch_norm 5-d training", .fn = bn_fn, .ref = bn_ref, .ctx = &bn_train, .n_in = 3,
     .in = {BN_X(5, BN_N, 2, 2, 3, 2), BN_V(2), BN_V(2)}, .sym = {2}, .flags = BN_F | H_NO_SIZE0},
    {.name = "batch_norm training, no affine", .fn = bn_fn, .ref = bn_ref, .ctx = &bn_plain, .n_in = 1,
     .in = {BN_X(4, BN_N, 3, 4, 5)}, .sym = {2}, .flags = BN_F | H_NO_SIZE0},
    {.name = "batch_norm training with running statistics", .fn = bn_fn, .ref = bn_ref, .ctx = &bn_running,
     .n_in = 3, .in = {BN_X(4, BN_N, 4, 3, 3), BN_V(4), BN_V(4)}, .sym = {3}, .flags = BN_F | H_NO_SIZE0},
    {.name = "batch_norm (N, C, L) eval", .fn = bn_fn, .ref = bn_ref, .ctx = &bn_eval, .n_in = 5,
     .in = {BN_X(3, BN_N, 3, 6), {.ndim = 1, .shape = {3}, .fill = H_RANDN},
            {.ndim = 1, .shape = {3}, .fill = H_POSITIVE}, BN_V(3), BN_V(3)},
     .sym = {2}, .flags = BN_F},
};

/* ---- the shared runner -------------------------------------------------------------------- */

enum { BN_CONTIG, BN_CL, BN_SLICE, BN_MISALIGNED, BN_EXPANDED, BN_LAYOUTS };
static const char *const bn_layout_name[BN_LAYOUTS] = {"contiguous", "channels-last", "channel slice",
                                                       "misaligned", "stride-0 batch"};

typedef struct bn_spec {
  int ndim;
  int64_t shape[5];
  int layout;
  kiln_dtype dt, pdt; /* x's dtype, the parameters' and buffers' */
  bool train;         /* training with running statistics, else eval */
  double offset;      /* added to x: a mean far from 0 */
  uint64_t seed;
  bool relu;          /* relu(batch_norm(x)): the ReLU's backward folds into the kernel's */
  bool fused;         /* with relu: kiln_batch_norm_relu, one op */
} bn_spec;

/* The spec of one sweep case: mode 0 training, 1 eval, 2 training under a ReLU; the
** parameters in f64 for f64 inputs, else f32. Shared by the CPU and CUDA sweeps. */
static bn_spec bn_sweep_spec(int ndim, const int64_t *shape, int layout, kiln_dtype dt, int mode, double offset,
                             uint64_t seed) {
  bn_spec sp = {0};
  sp.ndim = ndim;
  memcpy(sp.shape, shape, sizeof sp.shape);
  sp.layout = layout;
  sp.dt = dt;
  sp.pdt = dt == KILN_F64 ? KILN_F64 : KILN_F32;
  sp.train = mode != 1;
  sp.relu = mode == 2; /* the ReLU's backward folded into the kernel's */
  sp.offset = offset;
  sp.seed = seed;
  return sp;
}

/* Host values of each result (malloc'd, NULL when missing) and their counts. */
typedef struct bn_out {
  double *v[6]; /* y, running_mean, running_var, dx, dweight, dbias */
  int64_t n[6];
  bool cl_y, cl_dx; /* y and dx came back channels-last (4-d channels-last input) */
} bn_out;
static const char *const bn_out_name[6] = {"y", "running_mean", "running_var", "dx", "dweight", "dbias"};

static void bn_out_free(bn_out *o) {
  for (int k = 0; k < 6; k++) free(o->v[k]), o->v[k] = NULL;
}

/* deterministic host values */
static double *bn_host_randn(int64_t n, uint64_t seed, double scale, double offset) {
  double *v = malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; v && i < n; i++) {
    /* two splitmix64 draws -> a Box-Muller normal */
    double u[2];
    for (int k = 0; k < 2; k++) {
      uint64_t z = (s += 0x9E3779B97F4A7C15ull);
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      z ^= z >> 31;
      u[k] = ((double)(z >> 11) + 0.5) / 9007199254740992.0;
    }
    v[i] = offset + scale * sqrt(-2 * log(u[0])) * cos(6.283185307179586 * u[1]);
  }
  return v;
}

static kiln_tensor *bn_on(const double *v, int ndim, const int64_t *shape, kiln_dtype dt, kiln_device dev) {
  kiln_tensor *h = h_tensor(v, ndim, shape, KILN_F64);
  return kiln_to_device(kiln_to_dtype(h, dt), dev);
}

/* t in channels-inner memory (channels-last for 4-d), same values */
static kiln_tensor *bn_channels_inner(kiln_tensor *t) {
  int nd = kiln_ndim(t), p[KILN_MAX_DIMS], q[KILN_MAX_DIMS];
  p[0] = 0;
  for (int d = 1; d < nd - 1; d++) p[d] = d + 1;
  p[nd - 1] = 1;
  for (int d = 0; d < nd; d++) q[p[d]] = d;
  return kiln_permute(kiln_contiguous(kiln_permute(t, nd, p)), nd, q);
}

/* Runs batch_norm forward and backward on dev as the spec says; false (and a failed
** check) when a call fails. The leaf is the tensor the layout is made from, so dx is its
** gradient (for a stride-0 batch: summed over the batch). */
static bool bn_run(const bn_spec *sp, kiln_device dev, bn_out *o) {
  memset(o, 0, sizeof *o);
  kiln_scope_begin();
  int nd = sp->ndim;
  int64_t C = sp->shape[1], numel = h_numel(nd, sp->shape);
  int64_t bshape[5];
  memcpy(bshape, sp->shape, sizeof bshape);
  kiln_tensor *leaf = NULL, *x = NULL;
  double *xv = NULL;
  switch (sp->layout) {
  case BN_SLICE: /* channels 1 .. C of C + 2 */
    bshape[1] = C + 2;
    xv = bn_host_randn(h_numel(nd, bshape), sp->seed, 1.0, sp->offset);
    leaf = bn_on(xv, nd, bshape, sp->dt, dev);
    kiln_requires_grad_(leaf, true);
    x = kiln_narrow(leaf, 1, 1, C);
    break;
  case BN_MISALIGNED: { /* one element in: no 16-byte vectors */
    int64_t n1 = numel + 1;
    xv = bn_host_randn(n1, sp->seed, 1.0, sp->offset);
    leaf = bn_on(xv, 1, &n1, sp->dt, dev);
    kiln_requires_grad_(leaf, true);
    x = kiln_reshape(kiln_narrow(leaf, 0, 1, numel), nd, sp->shape);
    break;
  }
  case BN_EXPANDED:
    bshape[0] = 1;
    xv = bn_host_randn(h_numel(nd, bshape), sp->seed, 1.0, sp->offset);
    leaf = bn_on(xv, nd, bshape, sp->dt, dev);
    kiln_requires_grad_(leaf, true);
    x = kiln_expand(leaf, nd, sp->shape);
    break;
  default:
    xv = bn_host_randn(numel, sp->seed, 1.0, sp->offset);
    leaf = bn_on(xv, nd, sp->shape, sp->dt, dev);
    if (sp->layout == BN_CL) leaf = kiln_detach(bn_channels_inner(leaf));
    kiln_requires_grad_(leaf, true);
    x = leaf;
  }
  free(xv);
  double *wv = bn_host_randn(C, sp->seed + 1, 1.0, 0.5), *bv = bn_host_randn(C, sp->seed + 2, 1.0, 0.0);
  double *mv = bn_host_randn(C, sp->seed + 3, 1.0, sp->offset), *vv = bn_host_randn(C, sp->seed + 4, 0.3, 1.5);
  double *rv_ = bn_host_randn(numel, sp->seed + 5, 1.0, 0.0);
  kiln_tensor *w = bn_on(wv, 1, &C, sp->pdt, dev), *b = bn_on(bv, 1, &C, sp->pdt, dev);
  kiln_tensor *rm = bn_on(mv, 1, &C, sp->pdt, dev), *rvar = bn_on(vv, 1, &C, sp->pdt, dev);
  kiln_tensor *r = bn_on(rv_, nd, sp->shape, sp->dt, dev);
  free(wv), free(bv), free(mv), free(vv), free(rv_);
  kiln_requires_grad_(w, true);
  kiln_requires_grad_(b, true);
  /* the upstream gradient in x's layout where x has one (its own layout otherwise) */
  if (sp->layout == BN_CL) r = bn_channels_inner(r);
  kiln_tensor *y = sp->relu && sp->fused ? kiln_batch_norm_relu(x, rm, rvar, w, b, sp->train, 0.1, 1e-5)
                                         : kiln_batch_norm(x, rm, rvar, w, b, sp->train, 0.1, 1e-5);
  if (sp->relu && !sp->fused) y = kiln_relu(y);
  kiln_tensor *ins[3] = {leaf, w, b}, *grads[3] = {NULL, NULL, NULL};
  bool ok = y && kiln_autograd_grad(1, &y, &r, 3, ins, grads) == KILN_OK;
  H_CHECK(ok, "batch_norm %s %s %s%s on %s ran: %s", bn_layout_name[sp->layout], kiln_dtype_name(sp->dt),
          sp->train ? "training" : "eval", sp->relu ? " + relu" : "", kiln__device_cstr(dev), kiln_last_error_message());
  if (ok) {
    kiln_tensor *res[6] = {y, rm, rvar, grads[0], grads[1], grads[2]};
    for (int k = 0; k < 6; k++) o->v[k] = res[k] ? h_values(res[k], &o->n[k]) : NULL;
    o->cl_y = kiln_is_contiguous_format(y, KILN_CHANNELS_LAST);
    o->cl_dx = grads[0] && kiln_is_contiguous_format(grads[0], KILN_CHANNELS_LAST);
  }
  kiln_scope_end();
  return ok;
}

/* Compares two runs' results with tolerances (rtol, atol) for the activations and the
** gradients, and f32-level ones for the buffers. */
static void bn_compare(const char *what, const bn_spec *sp, const bn_out *got, const bn_out *want, double rtol,
                       double atol) {
  for (int k = 0; k < 6; k++) {
    char name[192];
    snprintf(name, sizeof name, "%s %s %s %s%s %s [%lld, %lld, ...]", what, bn_layout_name[sp->layout],
             kiln_dtype_name(sp->dt), sp->train ? "training" : "eval", sp->relu ? " + relu" : "", bn_out_name[k],
             (long long)sp->shape[0], (long long)sp->shape[1]);
    if (!got->v[k] || !want->v[k] || got->n[k] != want->n[k]) {
      H_CHECK(false, "%s: missing or of different sizes", name);
      continue;
    }
    bool buffer = k == 1 || k == 2;
    double r = rtol, a = atol;
    if (buffer) h_dtype_tol(sp->pdt == KILN_F64 && sp->dt == KILN_F64 ? KILN_F64 : KILN_F32, &r, &a);
    if (buffer && sp->dt != KILN_F64 && sp->dt != KILN_F32) r *= 4, a *= 4; /* stats of rounded x */
    h_close(name, got->v[k], want->v[k], got->n[k], r, a);
  }
}

/* ---- 2. the kernels against the composite ------------------------------------------------- */

static void bn_vs_composite(void) {
  kiln_device cpu = kiln_device_cpu();
  static const struct {
    int ndim;
    int64_t shape[5];
    int layout;
  } shapes[] = {
      {4, {4, 3, 5, 6}, BN_CONTIG},  {4, {3, 5, 4, 3}, BN_CL},        {4, {2, 3, 4, 5}, BN_SLICE},
      {4, {2, 4, 3, 3}, BN_MISALIGNED}, {4, {3, 2, 3, 4}, BN_EXPANDED}, {2, {7, 6}, BN_CONTIG},
      {3, {3, 4, 9}, BN_CONTIG},     {3, {4, 3, 5}, BN_CL},          {5, {2, 3, 2, 2, 3}, BN_CONTIG},
      {4, {5, 6, 1, 1}, BN_CONTIG},  {4, {2, 70, 2, 2}, BN_CONTIG},  {4, {2, 70, 2, 2}, BN_CL},
      {4, {4, 8, 32, 32}, BN_CONTIG}, {4, {4, 80, 8, 8}, BN_CL},
      {3, {3, 4, 37}, BN_CONTIG}, /* rows past BN_SHORT_S that are not a multiple of 8 lanes */
      {4, {3, 5, 4, 4}, BN_CONTIG}, {3, {2, 3, 11}, BN_CONTIG}, /* the f32 backward's short rows (8 <= S < 32) */
  };
  static const kiln_dtype dts[4] = {KILN_F64, KILN_F32, KILN_F16, KILN_BF16};
  int ncase = 0;
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
    for (int di = 0; di < 4; di++)
      for (int mode = 0; mode < 3; mode++) {
        bn_spec sp = bn_sweep_spec(shapes[si].ndim, shapes[si].shape, shapes[si].layout, dts[di], mode, 2.0,
                                   100 + si * 8 + (uint64_t)di * 2 + (uint64_t)mode);
        bn_out nat, comp;
        bool a = bn_run(&sp, cpu, &nat);
        kiln__dispatch_disable_kernel(KILN_DEVICE_CPU, KILN__K_BATCH_NORM, true);
        bool b = bn_run(&sp, cpu, &comp);
        kiln__dispatch_disable_kernel(KILN_DEVICE_CPU, KILN__K_BATCH_NORM, false);
        if (a && b) {
          double rt, at;
          h_dtype_tol(sp.dt, &rt, &at);
          bn_compare("kernel vs composite", &sp, &nat, &comp, rt * 2, at * 2);
          if (sp.layout == BN_CL && sp.ndim == 4 && !sp.relu) /* relu makes its own layout */
            H_CHECK(nat.cl_y && nat.cl_dx, "channels-last %s: y and dx channels-last (%d, %d)", kiln_dtype_name(sp.dt),
                    nat.cl_y, nat.cl_dx);
        }
        bn_out_free(&nat), bn_out_free(&comp);
        ncase++;
      }
  H_CHECK(ncase == 204, "all kernel-vs-composite cases ran (%d)", ncase);
}

/* ---- 3. what a value check cannot see ------------------------------------------------------ */

typedef struct bn_seen {
  int fwd, bwd, relu_bwd, other_native, fell_back;
} bn_seen;
static void bn_observe(void *ctx, kiln_device dev, const kiln__kargs *a, bool native) {
  bn_seen *s = ctx;
  (void)dev;
  if (!native) s->fell_back++;
  else if (a->op == KILN__K_BATCH_NORM) s->fwd++;
  else if (a->op == KILN__K_BATCH_NORM_BACKWARD) s->bwd++;
  else if (a->op == KILN__K_RELU_BACKWARD) s->relu_bwd++;
  else s->other_native++;
}

static void bn_extra(void) {
  kiln_device cpu = kiln_device_cpu();
  kiln_scope_begin();
  /* one kernel forward, one backward; nothing else but the parameters' gradient adds */
  kiln_tensor *x = kiln_randn(KILN_SHAPE(4, 3, 5, 5), KILN_F32, cpu, NULL);
  kiln_tensor *w = kiln_ones(KILN_SHAPE(3), KILN_F32, cpu), *b = kiln_zeros(KILN_SHAPE(3), KILN_F32, cpu);
  kiln_tensor *rm = kiln_zeros(KILN_SHAPE(3), KILN_F32, cpu), *rv = kiln_ones(KILN_SHAPE(3), KILN_F32, cpu);
  kiln_tensor *g = kiln_randn(KILN_SHAPE(4, 3, 5, 5), KILN_F32, cpu, NULL);
  kiln_requires_grad_(x, true), kiln_requires_grad_(w, true), kiln_requires_grad_(b, true);
  bn_seen seen = {0};
  kiln__dispatch_observe(bn_observe, &seen);
  kiln_tensor *y = kiln_batch_norm(x, rm, rv, w, b, true, 0.1, 1e-5);
  kiln_status st = y ? kiln_backward(y, g) : kiln_last_error();
  kiln__dispatch_observe(NULL, NULL);
  H_CHECK(st == KILN_OK && seen.fwd == 1 && seen.bwd == 1 && seen.fell_back == 0,
          "one BATCH_NORM and one BATCH_NORM_BACKWARD ran (%d, %d; %d other kernels): %s", seen.fwd, seen.bwd,
          seen.other_native, kiln_last_error_message());
  H_CHECK(y && kiln_grad_fn_name(y) && !strcmp(kiln_grad_fn_name(y), "batch_norm"), "y's node is batch_norm");
  /* relu(batch_norm(x)): the ReLU's backward runs inside BATCH_NORM_BACKWARD (no kernel of its own) */
  bn_seen seen2 = {0};
  kiln_tensor *yr = kiln_relu(kiln_batch_norm(x, rm, rv, w, b, true, 0.1, 1e-5));
  kiln__dispatch_observe(bn_observe, &seen2);
  st = yr ? kiln_backward(yr, g) : kiln_last_error();
  kiln__dispatch_observe(NULL, NULL);
  H_CHECK(st == KILN_OK && seen2.bwd == 1 && seen2.fell_back == 0 && seen2.relu_bwd == 0,
          "relu(batch_norm) backward: one BATCH_NORM_BACKWARD, no RELU_BACKWARD (%d, %d): %s", seen2.bwd,
          seen2.relu_bwd, kiln_last_error_message());

  /* a mean of 1e4 beside a spread of 1: the normalized channels have mean 0 and var 1 */
  kiln_tensor *big = kiln_add_scalar(kiln_randn(KILN_SHAPE(16, 2, 32, 32), KILN_F32, cpu, NULL), 1e4);
  kiln_tensor *yb = kiln_batch_norm(big, NULL, NULL, NULL, NULL, true, 0.1, 0.0);
  int64_t n = 0;
  double *v = yb ? h_values(yb, &n) : NULL;
  bool good = v != NULL;
  for (int c = 0; v && c < 2; c++) {
    double m = 0, q = 0;
    int64_t cnt = 0;
    for (int64_t i = 0; i < 16; i++)
      for (int64_t s = 0; s < 1024; s++) m += v[(i * 2 + c) * 1024 + s], cnt++;
    m /= (double)cnt;
    for (int64_t i = 0; i < 16; i++)
      for (int64_t s = 0; s < 1024; s++) q += (v[(i * 2 + c) * 1024 + s] - m) * (v[(i * 2 + c) * 1024 + s] - m);
    q /= (double)cnt;
    good = good && fabs(m) < 1e-4 && fabs(q - 1) < 1e-4;
  }
  free(v);
  H_CHECK(good, "batch_norm of 1e4 + N(0, 1) in f32: mean 0 and var 1 per channel");

  /* PyTorch's rule with a bf16 input and f32 buffers: the statistics of the bf16 values */
  kiln_tensor *xh = H_T(KILN_SHAPE(2, 2, 1, 2), KILN_BF16, 1, 2, 10, 20, 3, 6, 30, 50);
  kiln_tensor *rm2 = kiln_full(KILN_SHAPE(2), 1.0, KILN_F32, cpu), *rv2 = kiln_full(KILN_SHAPE(2), 2.0, KILN_F32, cpu);
  kiln_tensor *yh = kiln_batch_norm(xh, rm2, rv2, NULL, NULL, true, 0.1, 1e-5);
  double m0 = 3, v0 = 14.0 / 3, m1 = 27.5, v1 = (17.5 * 17.5 + 7.5 * 7.5 + 2.5 * 2.5 + 22.5 * 22.5) / 3;
  double want_m[2] = {0.9 + 0.1 * m0, 0.9 + 0.1 * m1}, want_v[2] = {1.8 + 0.1 * v0, 1.8 + 0.1 * v1};
  H_CHECK(yh && kiln_dtype_of(yh) == KILN_BF16 && kiln_dtype_of(rm2) == KILN_F32, "bf16 in, bf16 out, f32 buffers");
  h_tensor_close("bf16 batch_norm running_mean", rm2, want_m, 2, 1e-6, 1e-6);
  h_tensor_close("bf16 batch_norm running_var", rv2, want_v, 2, 1e-6, 1e-6);

  /* under autocast a bf16 activation stays bf16 (class none, as PyTorch's batch_norm) */
  H_CHECK(kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16) == KILN_OK, "autocast begins");
  kiln_tensor *ya = kiln_batch_norm(kiln_to_dtype(x, KILN_BF16), rm, rv, w, b, true, 0.1, 1e-5);
  H_CHECK(kiln_autocast_end() == KILN_OK && ya && kiln_dtype_of(ya) == KILN_BF16,
          "batch_norm of bf16 under autocast gives bf16");

  /* bad input keeps its messages */
  kiln_clear_error();
  H_CHECK(!kiln_batch_norm(kiln_ones(KILN_SHAPE(1, 3, 1, 1), KILN_F32, cpu), NULL, NULL, NULL, NULL, true, 0.1, 1e-5) &&
              kiln_last_error() == KILN_ERR_SHAPE && strstr(kiln_last_error_message(), "one value per channel"),
          "training with one value per channel: %s", kiln_last_error_message());
  kiln_clear_error();
  H_CHECK(!kiln_batch_norm(x, NULL, NULL, kiln_ones(KILN_SHAPE(4), KILN_F32, cpu), NULL, true, 0.1, 1e-5) &&
              kiln_last_error() == KILN_ERR_SHAPE && strstr(kiln_last_error_message(), "weight") &&
              strstr(kiln_last_error_message(), "[4, 3, 5, 5]"),
          "a weight of the wrong size names it and the input: %s", kiln_last_error_message());
  kiln_clear_error();
  H_CHECK(!kiln_batch_norm(x, NULL, NULL, NULL, NULL, false, 0.1, 1e-5) && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT,
          "eval without running statistics: %s", kiln_last_error_message());
  kiln_scope_end();
}

/* kiln_batch_norm_relu against kiln_relu(kiln_batch_norm(...)) on dev: the same kernel
** and the same mask (the output is > 0 exactly where the normalized value was), so the
** same numbers bit for bit: y, the running statistics, dx, dweight, dbias. Both layouts,
** training and eval, every dtype. */
static void bn_relu_fused(kiln_device dev) {
  static const struct {
    int ndim;
    int64_t shape[5];
    int layout;
  } shapes[] = {{4, {4, 6, 5, 5}, BN_CONTIG}, {4, {3, 16, 4, 6}, BN_CL}, {2, {32, 12, 0, 0, 0}, BN_CONTIG},
                {4, {2, 5, 3, 3}, BN_SLICE}, {4, {3, 4, 6, 7}, BN_CONTIG}};
  static const kiln_dtype dts[4] = {KILN_F64, KILN_F32, KILN_F16, KILN_BF16};
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
    for (int di = 0; di < 4; di++)
      for (int mode = 0; mode < 2; mode++) {
        bn_spec sp = bn_sweep_spec(shapes[si].ndim, shapes[si].shape, shapes[si].layout, dts[di], mode, 0.0,
                                   900 + si * 8 + (uint64_t)di * 2 + (uint64_t)mode);
        sp.relu = true;
        bn_out fused, sep;
        sp.fused = true;
        bool a = bn_run(&sp, dev, &fused);
        sp.fused = false;
        bool b = bn_run(&sp, dev, &sep);
        if (a && b) bn_compare("batch_norm_relu vs relu(batch_norm)", &sp, &fused, &sep, 0, 0);
        bn_out_free(&fused), bn_out_free(&sep);
      }
}

/* ---- batch_norm_add_relu: relu(batch_norm(x) + residual) ---------------------------------- */

/* y, running_mean, running_var, dx, dweight, dbias, dresidual of one run on dev, fused
** (kiln_batch_norm_add_relu) or as the three ops in f64 from the same values rounded to
** x's dtype (the reference: one rounding, as the fused op's); the residual channels-last
** when res_cl (x's layout from sp). false (and a failed check) when a call fails. */
static bool bnar_run(const bn_spec *sp, bool res_cl, bool fused, kiln_device dev, double **v, int64_t *nv) {
  kiln_scope_begin();
  int nd = sp->ndim;
  int64_t C = sp->shape[1], numel = h_numel(nd, sp->shape);
  double *xv = bn_host_randn(numel, sp->seed, 1.0, sp->offset), *rv_ = bn_host_randn(numel, sp->seed + 9, 1.0, 0.0);
  double *gv = bn_host_randn(numel, sp->seed + 5, 1.0, 0.0);
  double *wv = bn_host_randn(C, sp->seed + 1, 1.0, 0.5), *bv = bn_host_randn(C, sp->seed + 2, 1.0, 0.0);
  double *mv = bn_host_randn(C, sp->seed + 3, 1.0, sp->offset), *vv = bn_host_randn(C, sp->seed + 4, 0.3, 1.5);
  kiln_tensor *x = bn_on(xv, nd, sp->shape, sp->dt, dev), *res = bn_on(rv_, nd, sp->shape, sp->dt, dev);
  kiln_tensor *g = bn_on(gv, nd, sp->shape, sp->dt, dev);
  kiln_dtype pdt = sp->pdt;
  if (!fused) { /* the reference in f64 from the rounded values */
    x = kiln_to_dtype(x, KILN_F64), res = kiln_to_dtype(res, KILN_F64), g = kiln_to_dtype(g, KILN_F64);
    pdt = KILN_F64;
  }
  if (sp->layout == BN_CL) x = kiln_detach(bn_channels_inner(x)), g = bn_channels_inner(g);
  if (res_cl) res = kiln_detach(bn_channels_inner(res));
  kiln_tensor *w = bn_on(wv, 1, &C, pdt, dev), *b = bn_on(bv, 1, &C, pdt, dev);
  kiln_tensor *rm = bn_on(mv, 1, &C, pdt, dev), *rvar = bn_on(vv, 1, &C, pdt, dev);
  free(xv), free(rv_), free(gv), free(wv), free(bv), free(mv), free(vv);
  kiln_requires_grad_(x, true), kiln_requires_grad_(res, true), kiln_requires_grad_(w, true), kiln_requires_grad_(b, true);
  kiln_tensor *y = fused ? kiln_batch_norm_add_relu(x, res, rm, rvar, w, b, sp->train, 0.1, 1e-5)
                         : kiln_relu(kiln_add(kiln_batch_norm(x, rm, rvar, w, b, sp->train, 0.1, 1e-5), res));
  kiln_tensor *ins[4] = {x, w, b, res}, *gr[4] = {NULL, NULL, NULL, NULL};
  bool ok = y && kiln_autograd_grad(1, &y, &g, 4, ins, gr) == KILN_OK;
  H_CHECK(ok, "batch_norm_add_relu %s %s %s on %s ran: %s", fused ? "fused" : "three ops f64", kiln_dtype_name(sp->dt),
          sp->train ? "training" : "eval", kiln__device_cstr(dev), kiln_last_error_message());
  if (ok) {
    kiln_tensor *r[7] = {y, rm, rvar, gr[0], gr[1], gr[2], gr[3]};
    for (int k = 0; k < 7; k++) v[k] = h_values(r[k], &nv[k]);
  }
  kiln_scope_end();
  return ok;
}

/* kiln_batch_norm_add_relu against the three ops in f64 on dev (from the same rounded
** values), every output and gradient within x's dtype's tolerance; both layouts, the
** residual in x's layout or the other, training and eval, every dtype. (Against the three
** ops in x's dtype a sum within a rounding of 0 can fall the other side of the ReLU.) */
static void bn_add_relu_fused(kiln_device dev) {
  static const struct {
    int ndim;
    int64_t shape[5];
    int layout;
    bool res_cl;
  } shapes[] = {{4, {4, 6, 5, 5}, BN_CONTIG, false}, {4, {3, 16, 4, 6}, BN_CL, true},
                {4, {3, 16, 4, 6}, BN_CL, false},    {4, {2, 5, 3, 3}, BN_CONTIG, true}};
  static const kiln_dtype dts[4] = {KILN_F64, KILN_F32, KILN_F16, KILN_BF16};
  static const char *const names[7] = {"y", "running_mean", "running_var", "dx", "dweight", "dbias", "dresidual"};
  for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
    for (int di = 0; di < 4; di++)
      for (int mode = 0; mode < 2; mode++) {
        bn_spec sp = bn_sweep_spec(shapes[si].ndim, shapes[si].shape, shapes[si].layout, dts[di], mode, 0.0,
                                   950 + si * 8 + (uint64_t)di * 2 + (uint64_t)mode);
        double *a[7] = {NULL}, *b[7] = {NULL};
        int64_t na[7] = {0}, nb[7] = {0};
        if (bnar_run(&sp, shapes[si].res_cl, true, dev, a, na) && bnar_run(&sp, shapes[si].res_cl, false, dev, b, nb)) {
          double rt, at;
          h_dtype_tol(sp.dt, &rt, &at);
          for (int k = 0; k < 7; k++) {
            char name[160];
            snprintf(name, sizeof name, "batch_norm_add_relu vs relu(batch_norm + residual) f64 %s %s %s %s %s",
                     bn_layout_name[sp.layout], shapes[si].res_cl ? "residual CL" : "residual NCHW",
                     kiln_dtype_name(sp.dt), sp.train ? "training" : "eval", names[k]);
            H_CHECK(na[k] == nb[k], "%s: sizes", name);
            if (na[k] == nb[k]) h_close(name, a[k], b[k], na[k], rt, at);
          }
        }
        for (int k = 0; k < 7; k++) free(a[k]), free(b[k]);
      }
  /* a residual of another shape or dtype runs the three ops (same numbers as them) */
  kiln_scope_begin();
  kiln_tensor *x = kiln_randn(KILN_SHAPE(2, 3, 4, 4), KILN_F32, dev, NULL);
  kiln_tensor *r = kiln_randn(KILN_SHAPE(1, 3, 4, 4), KILN_F32, dev, NULL);
  kiln_tensor *y = kiln_batch_norm_add_relu(x, r, NULL, NULL, NULL, NULL, true, 0.1, 1e-5);
  kiln_tensor *z = kiln_relu(kiln_add(kiln_batch_norm(x, NULL, NULL, NULL, NULL, true, 0.1, 1e-5), r));
  double *yv = y ? h_values(y, NULL) : NULL, *zv = z ? h_values(z, NULL) : NULL;
  H_CHECK(yv && zv, "batch_norm_add_relu with a broadcast residual ran: %s", kiln_last_error_message());
  if (yv && zv) h_close("batch_norm_add_relu broadcast residual", yv, zv, 96, 0, 0);
  free(yv), free(zv);
  H_CHECK(!kiln_batch_norm_add_relu(x, NULL, NULL, NULL, NULL, NULL, true, 0.1, 1e-5) &&
              kiln_last_error() == KILN_ERR_INVALID_ARGUMENT && strstr(kiln_last_error_message(), "residual"),
          "a NULL residual: %s", kiln_last_error_message());
  kiln_clear_error();
  kiln_scope_end();
}

/* The CPU's BATCH_NORM_BACKWARD with flag 4 (CUDA's masked gradient, which the op layer
** asks for on CUDA only; the CPU has it for a fallback): out3 is g where the mask is > 0,
** else 0, and dx, dweight, dbias are the masked kernel's to the bit. */
static void bn_cpu_flag4(void) {
  kiln_device cpu = kiln_device_cpu();
  static const kiln_dtype dts[2] = {KILN_F32, KILN_BF16};
  for (int di = 0; di < 2; di++) {
    kiln_scope_begin();
    const int64_t N = 3, C = 5, S = 7;
    kiln_dtype dt = dts[di];
    kiln_tensor *x = kiln_randn(KILN_SHAPE(N, C, S), dt, cpu, NULL), *g = kiln_randn(KILN_SHAPE(N, C, S), dt, cpu, NULL);
    kiln_tensor *mask = kiln_randn(KILN_SHAPE(N, C, S), dt, cpu, NULL);
    kiln_tensor *stats = kiln_full(2, (const int64_t[]){2, C}, 0.75, KILN_F32, cpu);
    kiln_tensor *w = kiln_full(1, &C, 1.5, KILN_F32, cpu);
    kiln_tensor *o[7];
    for (int k = 0; k < 7; k++)
      o[k] = k % 3 == 0 || k == 6 ? kiln_zeros(KILN_SHAPE(N, C, S), dt, cpu) : kiln_zeros(1, &C, KILN_F32, cpu);
    kiln_status st = KILN_OK;
    for (int pass = 0; pass < 2 && st == KILN_OK; pass++) { /* flag 2, then flags 2 and 4 */
      kiln__kargs a = {0};
      a.op = KILN__K_BATCH_NORM_BACKWARD;
      a.in[a.n_in++] = kiln__view_of(x), a.in[a.n_in++] = kiln__view_of(g), a.in[a.n_in++] = kiln__view_of(stats);
      a.in[a.n_in++] = kiln__view_of(w), a.in[a.n_in++] = kiln__view_of(mask);
      a.i[0] = 1 | 2 | (pass ? 4 : 0), a.i[1] = 1, a.s[0] = 1e-5;
      for (int k = 0; k < 3; k++) a.out[a.n_out++] = kiln__view_of(o[pass * 3 + k]);
      if (pass) a.out[a.n_out++] = kiln__view_of(o[6]);
      st = kiln__dispatch(cpu, &a);
    }
    H_CHECK(st == KILN_OK, "cpu flag 4 %s ran: %s", kiln_dtype_name(dt), kiln_last_error_message());
    if (st == KILN_OK) {
      int64_t n = 0;
      for (int k = 0; k < 3; k++) {
        double *a = h_values(o[k], &n), *b = h_values(o[3 + k], NULL);
        h_close(k == 0 ? "cpu flag 4: dx" : k == 1 ? "cpu flag 4: dweight" : "cpu flag 4: dbias", a, b, n, 0, 0);
        free(a), free(b);
      }
      double *gv = h_values(g, &n), *mv = h_values(mask, NULL), *gm = h_values(o[6], NULL);
      for (int64_t i = 0; i < n; i++) gv[i] = mv[i] > 0 ? gv[i] : 0.0;
      h_close("cpu flag 4: the masked gradient", gm, gv, n, 0, 0);
      free(gv), free(mv), free(gm);
    }
    kiln_scope_end();
  }
}

static void bn_family(void) {
  h_run_cases(bn_cases, (int)(sizeof bn_cases / sizeof bn_cases[0]));
  if (!h_cross_only() && !h_support_mode()) {
    bn_vs_composite();
    bn_extra();
    bn_relu_fused(kiln_device_cpu());
    bn_add_relu_fused(kiln_device_cpu());
    bn_cpu_flag4();
  }
}

#ifndef H_NO_MAIN
int main(int argc, char **argv) {
  h_init(argc, argv, "test_ops_batchnorm");
  bn_family();
  return h_finish();
}
#endif
