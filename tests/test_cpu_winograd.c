/*
** The CPU's Winograd F(2x2, 3x3) convolution (src/backend/cpu/cpu_conv_winograd.c):
** CONV2D and CONV2D_BACKWARD_DATA against f64 direct loops on random shapes (batch 1-4,
** channels 8 to 32 including counts that are not multiples of 4 or 8, maps 3 to 20 and one
** wide enough for one tile-row a block, padding 0, 1, 2 in each direction, with and without
** bias), and against oneDNN's kernel on the same inputs (what KILN_CONV_WINOGRAD=0 runs);
** the same bits on 1 and 2 threads; KILN_ERR_OOM, not a crash, when its scratch cannot be
** had; the cases it must refuse; then conv2d through the public API in f32 (forward and the
** three gradients, the Winograd kernels taking the forward and the data gradient) against
** the f64 composite on the same values.
**
** Tolerance, from the arithmetic: each output is compared relative to its own scale, the
** sum of |x w| over its window plus |bias| (what f32 rounding errors are proportional to).
** F(2x2, 3x3)'s transforms add at most 4 terms a stage (and halve the weights exactly
** only in f64), so the error stays within a small multiple of the direct f32 sum's,
** at most 3e-7 of the scale here; 2e-6 leaves room and still fails a wrong tap, tile or
** channel by orders of magnitude. Outputs are filled with NaN first: an output the
** kernel fails to write fails the check.
**
** Run again by ctest as test_cpu_winograd_off with KILN_CONV_WINOGRAD=0: the predicate must
** then refuse every case, and the public API's results must still hold.
*/
#include "kiln.h"
#include "backend/backend.h"
#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_iter.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define WG_TOL 2e-6

static bool g_off;       /* the dispatch takes nothing: KILN_CONV_WINOGRAD=0, or unset on AVX-512 */
static bool g_env_off;   /* KILN_CONV_WINOGRAD=0: the kernel is not run at all */
static double g_worst;   /* largest error / scale seen */

static uint64_t g_rng = 0x2545F4914F6CDD1Dull;
static double urand(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (double)(g_rng >> 11) / 9007199254740992.0;
}
static int64_t irand(int64_t lo, int64_t hi) { return lo + (int64_t)(urand() * (double)(hi - lo + 1)); }

/* A contiguous f32 view of the shape over malloc'd memory (exact size: ASan sees a write
** past it), values uniform in [-1, 1) or NaN. */
static kiln__view mkview(int ndim, const int64_t *shape, bool nan) {
  kiln__view v;
  memset(&v, 0, sizeof v);
  v.dtype = KILN_F32;
  v.ndim = ndim;
  int64_t n = 1;
  for (int d = ndim - 1; d >= 0; d--) v.shape[d] = shape[d], v.strides[d] = n, n *= shape[d];
  float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
  for (int64_t i = 0; i < n; i++) p[i] = nan ? NAN : (float)(2 * urand() - 1);
  v.data = p;
  return v;
}

static int64_t numel(const kiln__view *v) {
  int64_t n = 1;
  for (int d = 0; d < v->ndim; d++) n *= v->shape[d];
  return n;
}

typedef struct wcase {
  int64_t N, C, OC, H, W, ph, pw;
  bool bias;
} wcase;

/* f64 references with each output's scale (sum of |terms|). Forward: y (N, OC, OH, OW). */
static void ref_forward(const wcase *k, const float *x, const float *w, const float *b, double *y, double *sc) {
  int64_t OH = k->H + 2 * k->ph - 2, OW = k->W + 2 * k->pw - 2;
  for (int64_t n = 0; n < k->N; n++)
    for (int64_t o = 0; o < k->OC; o++)
      for (int64_t oh = 0; oh < OH; oh++)
        for (int64_t ow = 0; ow < OW; ow++) {
          double s = b ? b[o] : 0, a = b ? fabs(b[o]) : 0;
          for (int64_t c = 0; c < k->C; c++)
            for (int i = 0; i < 3; i++)
              for (int j = 0; j < 3; j++) {
                int64_t h = oh - k->ph + i, ww = ow - k->pw + j;
                if (h < 0 || h >= k->H || ww < 0 || ww >= k->W) continue;
                double t = (double)x[((n * k->C + c) * k->H + h) * k->W + ww] * w[((o * k->C + c) * 3 + i) * 3 + j];
                s += t, a += fabs(t);
              }
          int64_t q = ((n * k->OC + o) * OH + oh) * OW + ow;
          y[q] = s, sc[q] = a;
        }
}

/* Backward data: dx (N, C, H, W) from g (N, OC, OH, OW). */
static void ref_backward(const wcase *k, const float *g, const float *w, double *dx, double *sc) {
  int64_t OH = k->H + 2 * k->ph - 2, OW = k->W + 2 * k->pw - 2;
  for (int64_t n = 0; n < k->N; n++)
    for (int64_t c = 0; c < k->C; c++)
      for (int64_t h = 0; h < k->H; h++)
        for (int64_t ww = 0; ww < k->W; ww++) {
          double s = 0, a = 0;
          for (int64_t o = 0; o < k->OC; o++)
            for (int i = 0; i < 3; i++)
              for (int j = 0; j < 3; j++) {
                int64_t oh = h + k->ph - i, ow = ww + k->pw - j;
                if (oh < 0 || oh >= OH || ow < 0 || ow >= OW) continue;
                double t = (double)g[((n * k->OC + o) * OH + oh) * OW + ow] * w[((o * k->C + c) * 3 + i) * 3 + j];
                s += t, a += fabs(t);
              }
          int64_t q = ((n * k->C + c) * k->H + h) * k->W + ww;
          dx[q] = s, sc[q] = a;
        }
}

/* Every element within tol of its scale (NaN fails). */
static bool close_scaled(const char *what, const wcase *k, const float *got, const double *want, const double *sc,
                         int64_t n, double tol) {
  int64_t bad = 0, first = -1;
  for (int64_t i = 0; i < n; i++) {
    double e = fabs((double)got[i] - want[i]), s = sc[i] > 1e-30 ? sc[i] : 1e-30;
    if (e / s > g_worst && e == e) g_worst = e / s;
    if (!(e <= tol * s + 1e-30)) {
      if (first < 0) first = i;
      bad++;
    }
  }
  if (bad)
    fprintf(stderr,
            "%s (N %lld C %lld OC %lld H %lld W %lld pad %lld,%lld bias %d): %lld of %lld outside %g (first at %lld: "
            "%.9g vs %.9g, scale %g)\n",
            what, (long long)k->N, (long long)k->C, (long long)k->OC, (long long)k->H, (long long)k->W,
            (long long)k->ph, (long long)k->pw, (int)k->bias, (long long)bad, (long long)n, tol, (long long)first,
            (double)got[first], want[first], sc[first]);
  return bad == 0;
}

/* The kargs of a forward (bwd false) or backward-data call; the params outlive it. */
static kiln__kargs mkargs(bool bwd, kiln__view img, kiln__view w, const kiln__view *b, kiln__view out,
                          const kiln__conv_params *cp) {
  kiln__kargs a;
  memset(&a, 0, sizeof a);
  a.op = bwd ? KILN__K_CONV2D_BACKWARD_DATA : KILN__K_CONV2D;
  a.n_in = b ? 3 : 2, a.n_out = 1;
  a.in[0] = img, a.in[1] = w, a.out[0] = out;
  if (b) a.in[2] = *b;
  a.i[0] = 1;
  a.params = cp;
  return a;
}

static void nan_fill(kiln__view *v) {
  float *p = v->data;
  for (int64_t i = 0; i < numel(v); i++) p[i] = NAN;
}

/* One shape: forward (with the case's bias) and backward data, each against f64, oneDNN,
** and itself on one thread. */
static void one_case(const wcase *k) {
  int64_t OH = k->H + 2 * k->ph - 2, OW = k->W + 2 * k->pw - 2;
  kiln__conv_params cp = {{3, 3}, {1, 1}, {k->ph, k->pw}, {1, 1}};
  kiln__view x = mkview(4, (int64_t[]){k->N, k->C, k->H, k->W}, false);
  kiln__view w = mkview(4, (int64_t[]){k->OC, k->C, 3, 3}, false);
  kiln__view b = mkview(1, (int64_t[]){k->OC}, false);
  kiln__view g = mkview(4, (int64_t[]){k->N, k->OC, OH, OW}, false);
  kiln__view y = mkview(4, (int64_t[]){k->N, k->OC, OH, OW}, true);
  kiln__view y1 = mkview(4, (int64_t[]){k->N, k->OC, OH, OW}, true);
  kiln__view dx = mkview(4, (int64_t[]){k->N, k->C, k->H, k->W}, true);
  kiln__view dx1 = mkview(4, (int64_t[]){k->N, k->C, k->H, k->W}, true);
  int64_t ny = numel(&y), nx = numel(&x);
  double *ry = malloc((size_t)ny * sizeof *ry), *sy = malloc((size_t)ny * sizeof *sy);
  double *rx = malloc((size_t)nx * sizeof *rx), *sx = malloc((size_t)nx * sizeof *sx);
  ref_forward(k, x.data, w.data, k->bias ? b.data : NULL, ry, sy);
  ref_backward(k, g.data, w.data, rx, sx);
  for (int pass = 0; pass < 2; pass++) {
    bool bwd = pass == 1;
    kiln__view *out = bwd ? &dx : &y, *out1 = bwd ? &dx1 : &y1;
    kiln__kargs a = bwd ? mkargs(true, g, w, NULL, dx, &cp) : mkargs(false, x, w, k->bias ? &b : NULL, y, &cp);
    const char *what = bwd ? "winograd backward data vs f64" : "winograd forward vs f64";
    if (g_off) CHECK(!kiln__cpu_conv_winograd_takes(&a)); /* the dispatch refuses every case */
    if (g_env_off) continue;
    /* the kernel itself, whether or not the dispatch would pick it for this shape */
    CHECK(kiln__cpu_conv_winograd(&a) == KILN_OK);
    CHECK(close_scaled(what, k, out->data, bwd ? rx : ry, bwd ? sx : sy, bwd ? nx : ny, WG_TOL));
    /* one thread: the same bits (each output's sum is in one fixed order) */
    kiln__kargs a1 = a;
    a1.out[0] = *out1;
    int nt = kiln_num_threads();
    kiln_set_num_threads(1);
    CHECK(kiln__cpu_conv_winograd(&a1) == KILN_OK);
    kiln_set_num_threads(nt);
    CHECK(memcmp(out->data, out1->data, (size_t)numel(out) * sizeof(float)) == 0);
#ifdef KILN_HAVE_DNNL
    /* oneDNN on the same inputs (KILN_CONV_WINOGRAD=0's kernel): within the same bound */
    nan_fill(out1);
    CHECK((bwd ? kiln__cpu_dnnl_conv2d_backward(&a1) : kiln__cpu_dnnl_conv2d(&a1)) == KILN_OK);
    CHECK(close_scaled(bwd ? "onednn backward data vs f64" : "onednn forward vs f64", k, out1->data, bwd ? rx : ry,
                       bwd ? sx : sy, bwd ? nx : ny, WG_TOL));
#endif
  }
  free(x.data), free(w.data), free(b.data), free(g.data), free(y.data), free(y1.data), free(dx.data), free(dx1.data);
  free(ry), free(sy), free(rx), free(sx);
}

static void random_cases(void) {
  static const int64_t cs[] = {8, 9, 13, 16, 32}, ocs[] = {8, 9, 13, 24};
  for (int t = 0; t < 40; t++) {
    wcase k = {irand(1, 4), cs[irand(0, 4)], ocs[irand(0, 3)], irand(3, 20), irand(3, 20), irand(0, 2), irand(0, 2),
               urand() < 0.5};
    one_case(&k);
  }
  /* fixed ones: Fashion-MNIST's conv2 (32 -> 64 on 13x13, unpadded) at batch 3; a padded
  ** 8x8 with even outputs; 3x3 inputs to one output; a row of 70 tiles (one tile-row a
  ** block, nine 8-tile steps); a plane of one row */
  static const wcase fixed[] = {{3, 32, 64, 13, 13, 0, 0, true}, {2, 16, 16, 8, 8, 1, 1, true},
                                {2, 8, 8, 3, 3, 0, 0, false},    {1, 8, 12, 4, 140, 1, 0, true},
                                {2, 10, 9, 1, 17, 1, 2, true}};
  for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) one_case(&fixed[i]);
  printf("largest error / scale: %.3g (bound %g)\n", g_worst, WG_TOL);
}

/* The dispatch's choice (kiln__cpu_conv_winograd_takes): Fashion-MNIST's conv2 both ways
** and maps where it won; not 3x3, 5x5 or 4x4 outputs, 512x512 channels, or a backward data
** onto a 6x6 image (oneDNN's own Winograd won those). */
static void policy(void) {
  static const struct {
    int64_t N, C, H, W, OC, p;
    bool fwd, bwd;
  } cases[] = {{128, 32, 13, 13, 64, 0, true, true}, {8, 64, 56, 56, 64, 1, true, true},
               {64, 64, 8, 8, 64, 1, true, true},    {4, 9, 10, 12, 13, 1, true, true},
               {64, 64, 3, 3, 64, 1, false, false},  {64, 128, 5, 5, 128, 1, false, false},
               {64, 64, 4, 4, 64, 1, false, false},  {8, 512, 14, 14, 512, 1, false, false},
               {64, 128, 6, 6, 128, 1, true, false}, {2, 16, 9, 8, 8, 2, true, true}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int64_t OH = cases[i].H + 2 * cases[i].p - 2, OW = cases[i].W + 2 * cases[i].p - 2;
    kiln__conv_params cp = {{3, 3}, {1, 1}, {cases[i].p, cases[i].p}, {1, 1}};
    kiln__view x = {0}, w = {0}, y = {0};
    int64_t sx[4] = {cases[i].N, cases[i].C, cases[i].H, cases[i].W}, sw[4] = {cases[i].OC, cases[i].C, 3, 3};
    int64_t sy[4] = {cases[i].N, cases[i].OC, OH, OW};
    kiln__view *vs[3] = {&x, &w, &y};
    const int64_t *ss[3] = {sx, sw, sy};
    for (int q = 0; q < 3; q++) { /* shapes only: the predicate reads no data */
      vs[q]->dtype = KILN_F32, vs[q]->ndim = 4, vs[q]->data = &cp;
      int64_t n = 1;
      for (int d = 3; d >= 0; d--) vs[q]->shape[d] = ss[q][d], vs[q]->strides[d] = n, n *= ss[q][d];
    }
    kiln__kargs f = mkargs(false, x, w, NULL, y, &cp), b = mkargs(true, y, w, NULL, x, &cp);
    if (kiln__cpu_conv_winograd_takes(&f) != (cases[i].fwd && !g_off) ||
        kiln__cpu_conv_winograd_takes(&b) != (cases[i].bwd && !g_off)) {
      fprintf(stderr, "policy case %zu: takes forward %d backward %d\n", i, (int)kiln__cpu_conv_winograd_takes(&f),
              (int)kiln__cpu_conv_winograd_takes(&b));
      CHECK(!"the Winograd dispatch's choice");
    }
  }
}

/* What the kernel must not take: each a change of one takeable case. */
static void refusals(void) {
  kiln__conv_params cp = {{3, 3}, {1, 1}, {1, 1}, {1, 1}};
  kiln__view x = mkview(4, (int64_t[]){2, 8, 10, 10}, false), w = mkview(4, (int64_t[]){8, 8, 3, 3}, false);
  kiln__view y = mkview(4, (int64_t[]){2, 8, 10, 10}, false);
  kiln__kargs a = mkargs(false, x, w, NULL, y, &cp);
  CHECK(kiln__cpu_conv_winograd_takes(&a) == !g_off);
  kiln__conv_params bad = cp;
  bad.stride[1] = 2;
  kiln__kargs q = a;
  q.params = &bad;
  CHECK(!kiln__cpu_conv_winograd_takes(&q)); /* stride 2 */
  bad = cp, bad.dilation[0] = 2;
  CHECK(!kiln__cpu_conv_winograd_takes(&q)); /* dilation 2 */
  bad = cp, bad.padding[0] = 3;
  CHECK(!kiln__cpu_conv_winograd_takes(&q)); /* padding 3 */
  q = a, q.i[0] = 2;
  CHECK(!kiln__cpu_conv_winograd_takes(&q)); /* groups */
  q = a, q.in[0].shape[1] = 4, q.in[1].shape[1] = 4;
  CHECK(!kiln__cpu_conv_winograd_takes(&q)); /* 4 input channels */
  q = a, q.in[1].shape[0] = 4, q.out[0].shape[1] = 4;
  CHECK(!kiln__cpu_conv_winograd_takes(&q)); /* 4 output channels */
  q = a, q.in[0].dtype = KILN_F64;
  CHECK(!kiln__cpu_conv_winograd_takes(&q)); /* f64 */
  q = a, q.in[0].strides[3] = 2;
  CHECK(!kiln__cpu_conv_winograd_takes(&q)); /* not dense */
  q = a, q.in[1].shape[2] = 5, q.in[1].shape[3] = 5;
  CHECK(!kiln__cpu_conv_winograd_takes(&q)); /* 5x5 */
  q = a, q.op = KILN__K_CONV2D_BACKWARD_WEIGHT;
  CHECK(!kiln__cpu_conv_winograd_takes(&q));
  /* out of memory for the scratch: an error, not a crash */
  if (!g_env_off) {
    kiln__cpu_fail_alloc_after(0);
    kiln_status st = kiln__cpu_conv_winograd(&a);
    kiln__cpu_fail_alloc_after(-1);
    CHECK(st == KILN_ERR_OOM);
  }
  free(x.data), free(w.data), free(y.data);
}

/* conv2d through the public API in f32 (the Winograd kernels where they take it) against
** the same values in f64 (the composite): forward and the gradients of x, w and b. */
static void public_api(void) {
  /* shapes the dispatch gives to the Winograd kernels both ways (policy() checks the rule) */
  static const int64_t shapes[][6] = {{4, 32, 13, 13, 64, 0}, {3, 9, 10, 12, 13, 1}, {2, 16, 9, 8, 8, 2}};
  kiln_device cpu = kiln_device_cpu();
  for (int t = 0; t < 3; t++) {
    const int64_t *s = shapes[t];
    kiln_scope_begin();
    kiln_generator *gen = kiln_generator_new(100 + (uint64_t)t);
    kiln_tensor *x64 = kiln_randn(KILN_SHAPE(s[0], s[1], s[2], s[3]), KILN_F64, cpu, gen);
    kiln_tensor *w64 = kiln_randn(KILN_SHAPE(s[4], s[1], 3, 3), KILN_F64, cpu, gen);
    kiln_tensor *b64 = kiln_randn(KILN_SHAPE(s[4]), KILN_F64, cpu, gen);
    int64_t OH = s[2] + 2 * s[5] - 2, OW = s[3] + 2 * s[5] - 2;
    kiln_tensor *r64 = kiln_randn(KILN_SHAPE(s[0], s[4], OH, OW), KILN_F64, cpu, gen);
    kiln_generator_free(gen);
    r64 = kiln_to_dtype(kiln_to_dtype(r64, KILN_F32), KILN_F64);
    /* values f32 holds, so only the arithmetic differs */
    x64 = kiln_to_dtype(kiln_to_dtype(x64, KILN_F32), KILN_F64);
    w64 = kiln_to_dtype(kiln_to_dtype(w64, KILN_F32), KILN_F64);
    b64 = kiln_to_dtype(kiln_to_dtype(b64, KILN_F32), KILN_F64);
    kiln_tensor *ins[2][3] = {{x64, w64, b64},
                              {kiln_to_dtype(x64, KILN_F32), kiln_to_dtype(w64, KILN_F32), kiln_to_dtype(b64, KILN_F32)}};
    double *vals[2][4] = {{0}};
    int64_t nv[4] = {0};
    int64_t pad[2] = {s[5], s[5]};
    bool ran = true;
    for (int d = 0; d < 2 && ran; d++) {
      for (int i = 0; i < 3; i++) kiln_requires_grad_(ins[d][i], true);
      kiln_tensor *y = kiln_conv2d(ins[d][0], ins[d][1], ins[d][2], NULL, pad, NULL, 1);
      /* random weights on the outputs so that every position's gradient differs */
      kiln_tensor *r = kiln_to_dtype(r64, d ? KILN_F32 : KILN_F64);
      if (!y || !r || kiln_backward(kiln_sum_all(kiln_mul(y, r)), NULL) != KILN_OK) {
        CHECK(!"conv2d ran");
        ran = false;
        break;
      }
      for (int q = 0; q < 4; q++) {
        kiln_tensor *v = kiln_contiguous(kiln_to_dtype(q == 0 ? y : kiln_grad(ins[d][q - 1]), KILN_F64));
        nv[q] = kiln_numel(v);
        vals[d][q] = malloc((size_t)nv[q] * sizeof(double));
        kiln_to_host(v, vals[d][q], (size_t)nv[q] * sizeof(double));
      }
    }
    static const char *const what[4] = {"forward", "dx", "dw", "db"};
    for (int q = 0; q < 4 && ran; q++) {
      /* relative to the largest value: sums of hundreds to ~10^5 terms (dw, db) in f32 */
      double m = 0, e = 0;
      for (int64_t i = 0; i < nv[q]; i++) {
        m = fmax(m, fabs(vals[0][q][i]));
        e = fmax(e, fabs(vals[1][q][i] - vals[0][q][i]));
      }
      if (!(e <= 1e-5 * m)) fprintf(stderr, "public conv2d case %d %s: error %g of %g\n", t, what[q], e, m);
      CHECK(e <= 1e-5 * m);
    }
    for (int q = 0; q < 4; q++) free(vals[0][q]), free(vals[1][q]);
    kiln_scope_end();
  }
}

int main(void) {
  const char *e = getenv("KILN_CONV_WINOGRAD");
  g_off = g_env_off = e && strcmp(e, "0") == 0;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  /* unset, the dispatch leaves AVX-512 CPUs to oneDNN (the kernel itself still runs) */
  if (!e && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    g_off = true;
#endif
  { /* a build or CPU without the kernel (not x86-64, no AVX2+FMA): nothing to test */
    kiln__conv_params cp = {{3, 3}, {1, 1}, {0, 0}, {1, 1}};
    kiln__view x = mkview(4, (int64_t[]){1, 8, 3, 3}, false), w = mkview(4, (int64_t[]){8, 8, 3, 3}, false);
    kiln__view y = mkview(4, (int64_t[]){1, 8, 1, 1}, false);
    kiln__kargs probe = mkargs(false, x, w, NULL, y, &cp);
    kiln_status st = kiln__cpu_conv_winograd(&probe);
    free(x.data), free(w.data), free(y.data);
    if (st != KILN_OK) {
      printf("test_cpu_winograd: skipped (%s)\n", kiln_last_error_message());
      return 77;
    }
  }
  random_cases();
  policy();
  refusals();
  public_api();
  return check_finish(g_env_off ? "test_cpu_winograd (KILN_CONV_WINOGRAD=0)" : "test_cpu_winograd");
}
