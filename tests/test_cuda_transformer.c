/*
** The transformer kernels on CUDA (cuda_transformer.cu, cuda_attention.cu) against the CPU.
** Skipped (exit 77) without a CUDA device.
**
** 1. the harness cases of test_ops_transformer.c and test_ops_scan.c, cross-backend part
**    only, with KILN_FALLBACK=error on CUDA (h_set_native_type): each case's forward and
**    backward run on the GPU's own kernels, every dtype and variant (non-contiguous,
**    broadcast masks), against the CPU;
** 2. hand-written checks at sizes the harness does not reach: GPT-2-sized norms (768 wide,
**    thousands of rows: the two-stage weight-gradient reduction), attention at T 200..300
**    with head dims 64, 128 and 80, causal and not, Tq != Tk, q/k/v as transposed views,
**    bool and additive masks broadcast over heads, dropout (the mask must be the CPU's:
**    the outputs agree only if every dropped score is the same one) - forward and the
**    three gradients through autograd; f32 tight, bf16 loose;
** 3. determinism: two runs of the same backward give the same bits (no atomics);
**    the tensor-core (flash) kernels over T 1..1024, head dims 64/128, f16/bf16, causal
**    or not (flash_sweep);
** 4. multinomial, topk and cumsum give the CPU's very numbers (the sampling contract).
*/
#define _POSIX_C_SOURCE 200809L /* setenv */
#define H_NO_MAIN
#include "test_ops_transformer.c"
#include "test_ops_scan.c"

#include <math.h>
#include <stdio.h>

static kiln_device cpu, gpu;

static double max_rel_diff(kiln_tensor *got, kiln_tensor *want, double *max_abs) {
  int64_t n = 0, m = 0;
  double *g = h_values(got, &n), *w = h_values(want, &m), scale = 0, d = 0;
  if (!g || !w || n != m) {
    free(g), free(w);
    *max_abs = INFINITY;
    return INFINITY;
  }
  for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(w[i]));
  for (int64_t i = 0; i < n; i++) d = fmax(d, fabs(g[i] - w[i]));
  free(g), free(w);
  *max_abs = d;
  return scale > 0 ? d / scale : d;
}

/* |got - want| <= tol * max|want| over the tensor (a relative-to-scale bound: the
** gradients' small elements carry the big ones' rounding). */
static void close_to(const char *what, kiln_tensor *got, kiln_tensor *want, double tol) {
  double a = 0, r = max_rel_diff(got, want, &a);
  H_CHECK(r <= tol, "%s: max |cuda - cpu| %.3g (%.3g of the scale), bound %.3g", what, a, r, tol);
}

static bool bits_equal(kiln_tensor *a, kiln_tensor *b) {
  if (!a || !b || kiln_numel(a) != kiln_numel(b) || kiln_dtype_of(a) != kiln_dtype_of(b)) return false;
  size_t n = kiln_nbytes(a);
  char *x = malloc(n + 1), *y = malloc(n + 1);
  bool eq = x && y && kiln_to_host(a, x, n) == KILN_OK && kiln_to_host(b, y, n) == KILN_OK && memcmp(x, y, n) == 0;
  free(x), free(y);
  return eq;
}

/* ---------------------------------------------------------------- norms */
static void norm_case(bool rms, kiln_dtype dt, int64_t rows, int64_t n, double tol) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(11);
  kiln_tensor *x = kiln_mul_scalar(kiln_randn(KILN_SHAPE(rows, n), KILN_F32, cpu, g), 3.0);
  x = kiln_add_scalar(x, 0.5); /* a mean away from 0 */
  kiln_tensor *w = kiln_randn(KILN_SHAPE(n), KILN_F32, cpu, g), *b = kiln_randn(KILN_SHAPE(n), KILN_F32, cpu, g);
  kiln_tensor *gy = kiln_randn(KILN_SHAPE(rows, n), KILN_F32, cpu, g);
  kiln_generator_free(g);
  kiln_tensor *outs[2][4] = {{0}};
  kiln_device devs[2] = {cpu, gpu};
  for (int d = 0; d < 2; d++) {
    kiln_tensor *xd = kiln_to_dtype(kiln_to_device(x, devs[d]), dt), *wd = kiln_to_dtype(kiln_to_device(w, devs[d]), dt);
    kiln_tensor *bd = kiln_to_dtype(kiln_to_device(b, devs[d]), dt), *gd = kiln_to_dtype(kiln_to_device(gy, devs[d]), dt);
    kiln_tensor *leaves[3] = {xd, wd, bd};
    for (int i = 0; i < 3; i++) kiln_requires_grad_(leaves[i], true);
    kiln_tensor *y = rms ? kiln_rms_norm(xd, 1, &n, wd, 1e-5) : kiln_layer_norm(xd, 1, &n, wd, bd, 1e-5);
    kiln_tensor *gr[3] = {0};
    int nl = rms ? 2 : 3;
    H_CHECK(y && kiln_autograd_grad(1, &y, &gd, nl, leaves, gr) == KILN_OK, "%s backward on %s: %s",
            rms ? "rms_norm" : "layer_norm", d ? "cuda" : "cpu", kiln_last_error_message());
    outs[d][0] = y, outs[d][1] = gr[0], outs[d][2] = gr[1], outs[d][3] = gr[2];
    if (d == 1 && y) { /* the same backward again: the same bits (two-stage reduction, no atomics) */
      kiln_tensor *gr2[3] = {0};
      H_CHECK(kiln_autograd_grad(1, &y, &gd, nl, leaves, gr2) == KILN_OK, "second backward");
      for (int i = 0; i < nl; i++)
        H_CHECK(bits_equal(gr[i], gr2[i]), "%s (%s): gradient %d differs between two runs on cuda",
                rms ? "rms_norm" : "layer_norm", kiln_dtype_name(dt), i);
    }
  }
  static const char *const nm[4] = {"y", "dx", "dweight", "dbias"};
  for (int i = 0; i < (rms ? 3 : 4); i++) {
    char what[128];
    snprintf(what, sizeof what, "%s %s (%lld, %lld) %s", rms ? "rms_norm" : "layer_norm", kiln_dtype_name(dt),
             (long long)rows, (long long)n, nm[i]);
    if (outs[0][i] && outs[1][i]) close_to(what, outs[1][i], outs[0][i], tol);
    else H_CHECK(false, "%s: missing", what);
  }
  kiln_scope_end();
}

/* ---------------------------------------------------------------- attention */
typedef struct att_spec {
  const char *name;
  int64_t B, H, Tq, Tk, D, Dv;
  bool causal, transposed; /* transposed: q, k, v as (B, T, H, D) tensors viewed (B, H, T, D) */
  int mask;                /* 0 none, 1 additive (Tq, Tk), 2 bool (B, 1, Tq, Tk) */
  double dropout;
  kiln_dtype dt;
  double tol;
} att_spec;

static kiln_tensor *make_qkv(int64_t B, int64_t H, int64_t T, int64_t D, bool transposed, kiln_generator *g) {
  if (!transposed) return kiln_randn(KILN_SHAPE(B, H, T, D), KILN_F32, cpu, g);
  return kiln_transpose(kiln_randn(KILN_SHAPE(B, T, H, D), KILN_F32, cpu, g), 1, 2);
}

/* A view of the same layout on dev in dtype dt (transposed stays transposed). */
static kiln_tensor *moved(kiln_tensor *t, kiln_device dev, kiln_dtype dt, bool transposed) {
  if (!transposed) return kiln_to_dtype(kiln_to_device(t, dev), dt);
  kiln_tensor *c = kiln_to_dtype(kiln_to_device(kiln_contiguous(kiln_transpose(t, 1, 2)), dev), dt);
  return kiln_transpose(c, 1, 2);
}

static void att_case(const att_spec *s) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(7);
  kiln_tensor *q = make_qkv(s->B, s->H, s->Tq, s->D, s->transposed, g);
  kiln_tensor *k = make_qkv(s->B, s->H, s->Tk, s->D, s->transposed, g);
  kiln_tensor *v = make_qkv(s->B, s->H, s->Tk, s->Dv, s->transposed, g);
  kiln_tensor *gy = kiln_randn(KILN_SHAPE(s->B, s->H, s->Tq, s->Dv), KILN_F32, cpu, g);
  kiln_tensor *mask = NULL;
  if (s->mask == 1) mask = kiln_randn(KILN_SHAPE(s->Tq, s->Tk), KILN_F32, cpu, g);
  if (s->mask == 2) /* about 1 in 5 keys masked; some rows may lose every key */
    mask = kiln_gt(kiln_rand(KILN_SHAPE(s->B, 1, s->Tq, s->Tk), KILN_F32, cpu, g), kiln_scalar(0.2, KILN_F32, cpu));
  kiln_generator_free(g);
  kiln_tensor *res[2][4] = {{0}};
  kiln_device devs[2] = {cpu, gpu};
  for (int d = 0; d < 2; d++) {
    kiln_tensor *qd = moved(q, devs[d], s->dt, s->transposed), *kd = moved(k, devs[d], s->dt, s->transposed);
    kiln_tensor *vd = moved(v, devs[d], s->dt, s->transposed);
    kiln_tensor *gd = kiln_to_dtype(kiln_to_device(gy, devs[d]), s->dt);
    kiln_tensor *md = mask ? kiln_to_device(mask, devs[d]) : NULL;
    if (md && s->mask == 1) md = kiln_to_dtype(md, s->dt);
    kiln_tensor *leaves[3] = {qd, kd, vd};
    for (int i = 0; i < 3; i++) kiln_requires_grad_(leaves[i], true);
    kiln_generator *dg = kiln_generator_new(99); /* the same dropout stream on both devices */
    kiln_tensor *y = kiln_scaled_dot_product_attention(qd, kd, vd, md, s->causal, s->dropout, 0, dg);
    kiln_generator_free(dg);
    kiln_tensor *gr[3] = {0};
    H_CHECK(y && kiln_autograd_grad(1, &y, &gd, 3, leaves, gr) == KILN_OK, "%s on %s: %s", s->name,
            d ? "cuda" : "cpu", kiln_last_error_message());
    res[d][0] = y, res[d][1] = gr[0], res[d][2] = gr[1], res[d][3] = gr[2];
    if (d == 1 && y) {
      kiln_tensor *gr2[3] = {0};
      H_CHECK(kiln_autograd_grad(1, &y, &gd, 3, leaves, gr2) == KILN_OK, "%s: second backward", s->name);
      for (int i = 0; i < 3; i++)
        H_CHECK(bits_equal(gr[i], gr2[i]), "%s: gradient %d differs between two runs on cuda", s->name, i);
    }
  }
  static const char *const nm[4] = {"out", "dq", "dk", "dv"};
  double rel[4] = {0};
  for (int i = 0; i < 4; i++) {
    char what[160];
    snprintf(what, sizeof what, "%s (%s) %s", s->name, kiln_dtype_name(s->dt), nm[i]);
    if (res[0][i] && res[1][i] && s->Tk == 1 && !s->mask && s->dropout == 0 && (i == 1 || i == 2)) {
      /* one key: its weight is 1 whatever the scores, so dq and dk are exactly 0 and both
      ** devices give rounding noise (1e-7 here; delta = dO . O from the rounded O): a bound
      ** relative to that noise would test nothing, so bound it against the unit scale of
      ** the inputs instead */
      double abs_diff;
      rel[i] = max_rel_diff(res[1][i], res[0][i], &abs_diff);
      H_CHECK(abs_diff <= 1e-3 * s->tol, "%s: with one key the gradient is 0; max |cuda - cpu| %.3g, bound %.3g",
              what, abs_diff, 1e-3 * s->tol);
    } else if (res[0][i] && res[1][i]) {
      double abs_diff;
      rel[i] = max_rel_diff(res[1][i], res[0][i], &abs_diff);
      close_to(what, res[1][i], res[0][i], s->tol);
    } else {
      H_CHECK(false, "%s: missing", what);
    }
  }
  if (getenv("KILN_TEST_VERBOSE")) /* the margins, for choosing tolerances */
    printf("%s: max |cuda - cpu| / scale: out %.2g dq %.2g dk %.2g dv %.2g (bound %.2g)\n", s->name, rel[0], rel[1],
           rel[2], rel[3], s->tol);
  kiln_scope_end();
}

/* The FlashAttention-2 kernels (cuda_flash.cu: f16/bf16, head dims 32/64/96/128, no mask,
** no dropout): every T of {1, 17, 64, 200, 1024} (one row; ragged tiles; one exact tile; four
** tiles, the last ragged; GPT-2's length), causal or not, f16 and bf16, head dims 64 and 128,
** forward and the three gradients against the CPU's f64 arithmetic on the same rounded
** inputs, and the backward's bits twice (att_case). Odd T use q/k/v as transposed views
** (GPT-2's layout: rows H*D apart). Plus Tq != Tk both ways, and head dims 32 and 96.
** Tolerances: bf16 keeps 8 bits, f16 11; P and dS are rounded to the input type before
** their products (as FlashAttention does), which over hundreds of keys stays within a few
** units of the last place of the scale. */
static void flash_sweep(void) {
  static const int64_t Ts[] = {1, 17, 64, 200, 1024};
  static char names[2][2][2][5][96];
  for (int di = 0; di < 2; di++)
    for (int ti = 0; ti < 5; ti++)
      for (int c = 0; c < 2; c++)
        for (int x = 0; x < 2; x++) {
          int64_t D = di ? 128 : 64, T = Ts[ti];
          kiln_dtype dt = x ? KILN_F16 : KILN_BF16;
          bool transposed = (T % 2) == 1;
          char *nm = names[di][x][c][ti];
          snprintf(nm, 96, "flash %s T %lld D %lld%s%s", kiln_dtype_name(dt), (long long)T, (long long)D,
                   c ? " causal" : "", transposed ? " transposed" : "");
          att_spec sp = {nm, T >= 1024 ? 1 : 2, T >= 1024 ? 2 : 3, T, T, D, D, c == 1, transposed, 0, 0, dt,
                         x ? 1e-2 : 3e-2};
          att_case(&sp);
        }
  const att_spec extra[] = {
      {"flash bf16 causal Tq 100 Tk 230 D 64", 1, 3, 100, 230, 64, 64, true, false, 0, 0, KILN_BF16, 3e-2},
      {"flash f16 Tq 100 Tk 230 D 128", 1, 3, 100, 230, 128, 128, false, true, 0, 0, KILN_F16, 1e-2},
      {"flash f16 causal Tq 300 Tk 90 D 128", 2, 1, 300, 90, 128, 128, true, false, 0, 0, KILN_F16, 1e-2},
      /* the other head dims the kernels are built for */
      {"flash bf16 causal T 150 D 32", 2, 2, 150, 150, 32, 32, true, false, 0, 0, KILN_BF16, 3e-2},
      {"flash f16 T 77 D 32 transposed", 1, 3, 77, 77, 32, 32, false, true, 0, 0, KILN_F16, 1e-2},
      {"flash bf16 causal T 200 D 96 transposed", 1, 2, 200, 200, 96, 96, true, true, 0, 0, KILN_BF16, 3e-2},
      {"flash f16 Tq 40 Tk 90 D 96", 2, 2, 40, 90, 96, 96, false, false, 0, 0, KILN_F16, 1e-2},
  };
  for (size_t i = 0; i < sizeof extra / sizeof extra[0]; i++) att_case(&extra[i]);
}

/* q, k, v as GPT-2 makes them: slices of one (B, T, 3C) tensor viewed (B, H, T, D), so k and
** v start C elements into it (the flash kernels' 16-byte loads); and slices of a
** (B, H, T, D + 4) tensor, whose rows are 68 elements apart and whose q starts 4 elements in:
** the flash kernels refuse that layout and the CUDA-core kernels run. Both against the CPU,
** the gradient taken for the one tensor the three are cut from. */
static void flash_layouts(void) {
  const int64_t B = 2, H = 3, T = 130, D = 64, C = H * D;
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(13);
  kiln_tensor *src[2] = {kiln_randn(KILN_SHAPE(B, T, 3 * C), KILN_F32, cpu, g),
                         kiln_randn(KILN_SHAPE(B, H, T, D + 4), KILN_F32, cpu, g)};
  kiln_tensor *gy = kiln_randn(KILN_SHAPE(B, H, T, D), KILN_F32, cpu, g);
  kiln_generator_free(g);
  static const char *const names[2] = {"flash GPT-2 layout (slices of qkv)", "flash refused: rows 68 apart, q 4 in"};
  for (int layout = 0; layout < 2; layout++) {
    kiln_tensor *res[2][2] = {{0}};
    kiln_device devs[2] = {cpu, gpu};
    for (int d = 0; d < 2; d++) {
      kiln_tensor *base = kiln_detach(kiln_to_dtype(kiln_to_device(src[layout], devs[d]), KILN_BF16));
      kiln_tensor *gd = kiln_to_dtype(kiln_to_device(gy, devs[d]), KILN_BF16);
      H_CHECK(base && kiln_requires_grad_(base, true) == KILN_OK, "%s: base: %s", names[layout],
              kiln_last_error_message());
      kiln_tensor *part[3];
      for (int i = 0; i < 3; i++)
        part[i] = layout == 0
                      ? kiln_transpose(kiln_view(kiln_narrow(base, 2, i * C, C), KILN_SHAPE(B, T, H, D)), 1, 2)
                      : kiln_narrow(base, 3, i == 0 ? 4 : i - 1, D);
      kiln_tensor *y = kiln_scaled_dot_product_attention(part[0], part[1], part[2], NULL, true, 0, 0, NULL);
      kiln_tensor *gr = NULL;
      H_CHECK(y && kiln_autograd_grad(1, &y, &gd, 1, &base, &gr) == KILN_OK, "%s on %s: %s", names[layout],
              d ? "cuda" : "cpu", kiln_last_error_message());
      res[d][0] = y, res[d][1] = gr;
    }
    for (int i = 0; i < 2; i++) {
      char what[160];
      snprintf(what, sizeof what, "%s %s", names[layout], i ? "grad" : "out");
      if (res[0][i] && res[1][i]) close_to(what, res[1][i], res[0][i], 3e-2);
      else H_CHECK(false, "%s: missing", what);
    }
  }
  kiln_scope_end();
}

/* cuDNN's fused attention (cuda_attention_cudnn.cu, the default where it serves) on the
** cases it serves, against the CPU as the own kernels are (att_case: out, dq, dk, dv, and the
** backward's bits twice: its plans prefer deterministic engines): causal and not, T not a
** multiple of 64, Tq != Tk both ways, B*H > 1, head dims 64 and 128, bf16 and f16, q/k/v as
** transposed views, and GPT-2's qkv layout with the packed gradient (flash_layouts). How
** many calls cuDNN ran is printed (weak: a CPU build has no such function): a build
** without cuDNN, or a cuDNN with no engine for a shape, leaves it to the own kernels. */
__attribute__((weak)) int64_t kiln__cuda_attention_cudnn_runs(void);

static void cudnn_attention_checks(void) {
  const char *prev = getenv("KILN_ATTENTION");
  char saved[32] = "";
  if (prev) snprintf(saved, sizeof saved, "%s", prev);
  setenv("KILN_ATTENTION", "cudnn", 1);
  int64_t before = kiln__cuda_attention_cudnn_runs ? kiln__cuda_attention_cudnn_runs() : 0;
  const double bf16 = 3e-2, f16 = 1e-2;
  const att_spec specs[] = {
      {"cudnn bf16 causal T 256 D 64", 2, 3, 256, 256, 64, 64, true, false, 0, 0, KILN_BF16, bf16},
      {"cudnn bf16 causal T 200 D 64 transposed", 2, 3, 200, 200, 64, 64, true, true, 0, 0, KILN_BF16, bf16},
      {"cudnn f16 causal T 77 D 128", 1, 3, 77, 77, 128, 128, true, false, 0, 0, KILN_F16, f16},
      {"cudnn bf16 T 130 D 128 transposed", 2, 2, 130, 130, 128, 128, false, true, 0, 0, KILN_BF16, bf16},
      {"cudnn f16 T 200 D 64", 1, 2, 200, 200, 64, 64, false, false, 0, 0, KILN_F16, f16},
      {"cudnn bf16 causal Tq 100 Tk 230 D 64", 1, 3, 100, 230, 64, 64, true, false, 0, 0, KILN_BF16, bf16},
      {"cudnn f16 causal Tq 230 Tk 100 D 128", 1, 2, 230, 100, 128, 128, true, true, 0, 0, KILN_F16, f16},
      {"cudnn bf16 T 1 D 64", 2, 2, 1, 1, 64, 64, true, false, 0, 0, KILN_BF16, bf16},
  };
  for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) att_case(&specs[i]);
  flash_layouts();
  int64_t runs = kiln__cuda_attention_cudnn_runs ? kiln__cuda_attention_cudnn_runs() - before : -1;
  printf("cudnn attention: %lld calls ran on cuDNN\n", (long long)runs);
  if (prev) setenv("KILN_ATTENTION", saved, 1);
  else unsetenv("KILN_ATTENTION");
}

static void attention_checks(void) {
  /* the own kernels first (cuDNN takes the 16-bit cases it serves by default: its own
  ** checks come last, cudnn_attention_checks) */
  const char *prev = getenv("KILN_ATTENTION");
  char saved[32] = "";
  if (prev) snprintf(saved, sizeof saved, "%s", prev);
  setenv("KILN_ATTENTION", "own", 1);
  /* f32: the GPU sums in f32 where the CPU sums in f64; over 300 keys and head dim 128 the
  ** difference stays near 1e-6 of the scale. bf16: the inputs' and outputs' rounding. */
  const double f32 = 2e-5, bf16 = 3e-2;
  const att_spec specs[] = {
      {"att causal T 256 D 64", 2, 3, 256, 256, 64, 64, true, false, 0, 0, KILN_F32, f32},
      {"att T 200 D 128", 1, 2, 200, 200, 128, 128, false, false, 0, 0, KILN_F32, f32},
      {"att causal Tq 70 Tk 300 D 80 Dv 48", 1, 2, 70, 300, 80, 48, true, false, 0, 0, KILN_F32, f32},
      {"att causal Tq 300 Tk 70 (rows past the keys)", 1, 1, 300, 70, 32, 32, true, false, 0, 0, KILN_F32, f32},
      {"att transposed views, causal", 2, 4, 130, 130, 64, 64, true, true, 0, 0, KILN_F32, f32},
      {"att additive mask (Tq, Tk)", 2, 2, 97, 150, 64, 64, false, false, 1, 0, KILN_F32, f32},
      {"att bool mask (B, 1, Tq, Tk)", 2, 3, 64, 90, 16, 16, false, false, 2, 0, KILN_F32, f32},
      {"att dropout 0.2 causal", 2, 2, 150, 150, 64, 64, true, false, 0, 0.2, KILN_F32, f32},
      {"att dropout 0.5 bool mask", 1, 2, 40, 77, 24, 24, false, false, 2, 0.5, KILN_F32, f32},
      {"att f64 causal D 128", 1, 2, 100, 100, 128, 128, true, false, 0, 0, KILN_F64, 1e-10},
      {"att bf16 causal T 256 D 64", 2, 3, 256, 256, 64, 64, true, false, 0, 0, KILN_BF16, bf16},
      {"att f16 causal T 128 D 128", 1, 2, 128, 128, 128, 128, true, true, 0, 0.1, KILN_F16, 1e-2},
      /* the tensor-core forward (f16/bf16, D 64 or 128): ragged tiles, masks, Tq != Tk */
      {"att bf16 T 200 D 128 additive mask", 2, 2, 200, 200, 128, 128, false, false, 1, 0, KILN_BF16, bf16},
      {"att bf16 causal Tq 100 Tk 230 dropout 0.1 transposed", 1, 3, 100, 230, 64, 64, true, true, 0, 0.1,
       KILN_BF16, bf16},
      {"att bf16 causal Tq 230 Tk 100", 1, 2, 230, 100, 64, 64, true, false, 0, 0, KILN_BF16, bf16},
      {"att f16 bool mask D 64", 2, 2, 77, 129, 64, 64, false, false, 2, 0, KILN_F16, 1e-2},
  };
  for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) att_case(&specs[i]);
  flash_sweep();
  flash_layouts();
  /* the 16-bit cases once more on the simple (CUDA-core) kernels */
  setenv("KILN_CUDA_ATTENTION", "simple", 1);
  for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++)
    if (specs[i].dt == KILN_BF16 || specs[i].dt == KILN_F16) att_case(&specs[i]);
  unsetenv("KILN_CUDA_ATTENTION");
  if (prev) setenv("KILN_ATTENTION", saved, 1);
  else unsetenv("KILN_ATTENTION");
  cudnn_attention_checks();
}

/* ---------------------------------------------------------------- sampling, scans */
static void exact_checks(void) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(21);
  /* multinomial: the very same draws as the CPU from the same generator state */
  kiln_tensor *p = kiln_exp(kiln_mul_scalar(kiln_randn(KILN_SHAPE(6, 1000), KILN_F32, cpu, g), 2.0));
  for (int repl = 1; repl >= 0; repl--) {
    kiln_tensor *pg = kiln_to_device(p, gpu);
    kiln_generator *g1 = kiln_generator_new(5), *g2 = kiln_generator_new(5);
    kiln_tensor *a = kiln_multinomial(p, 16, repl, g1), *b = kiln_multinomial(pg, 16, repl, g2);
    H_CHECK(a && b && bits_equal(a, kiln_to_device(b, cpu)), "multinomial (%s replacement): cuda draws differ from the cpu's: %s",
            repl ? "with" : "without", kiln_last_error_message());
    /* bf16 probabilities: rounded the same on both sides */
    kiln_tensor *a2 = kiln_multinomial(kiln_to_dtype(p, KILN_BF16), 3, repl, g1);
    kiln_tensor *b2 = kiln_multinomial(kiln_to_dtype(pg, KILN_BF16), 3, repl, g2);
    H_CHECK(a2 && b2 && bits_equal(a2, kiln_to_device(b2, cpu)), "multinomial bf16 (%s replacement) differs",
            repl ? "with" : "without");
    kiln_generator_free(g1), kiln_generator_free(g2);
  }
  /* multinomial's bad rows give the CPU's errors on the GPU too */
  H_EXPECT_ERR(kiln_multinomial(kiln_to_device(H_T(KILN_SHAPE(3), KILN_F32, 0.5, -0.1, 0.6), gpu), 1, true, g),
               KILN_ERR_INVALID_ARGUMENT, "cuda multinomial of a negative probability");
  H_EXPECT_ERR(kiln_multinomial(kiln_to_device(H_T(KILN_SHAPE(2), KILN_F32, 0, 0), gpu), 1, true, g),
               KILN_ERR_INVALID_ARGUMENT, "cuda multinomial of a row of zeros");
  H_EXPECT_ERR(kiln_multinomial(kiln_to_device(H_T(KILN_SHAPE(3), KILN_F32, 1, 0, 1), gpu), 3, false, g),
               KILN_ERR_INVALID_ARGUMENT, "cuda multinomial: 3 samples without replacement from 2 classes");
  /* topk over a vocabulary-sized row, with ties (rounded to bf16) */
  kiln_tensor *x = kiln_to_dtype(kiln_randn(KILN_SHAPE(4, 50257), KILN_F32, cpu, g), KILN_BF16);
  for (int largest = 0; largest < 2; largest++) {
    kiln_tensor *ic = NULL, *ig = NULL;
    kiln_tensor *vc = kiln_topk(x, 50, -1, largest, true, &ic);
    kiln_tensor *vg = kiln_topk(kiln_to_device(x, gpu), 50, -1, largest, true, &ig);
    H_CHECK(vc && vg && bits_equal(vc, kiln_to_device(vg, cpu)) && bits_equal(ic, kiln_to_device(ig, cpu)),
            "topk k 50 of 50257 (%s): cuda differs from the cpu", largest ? "largest" : "smallest");
  }
  /* topk along a strided dim */
  kiln_tensor *x2 = kiln_randn(KILN_SHAPE(37, 5, 3), KILN_F32, cpu, g);
  kiln_tensor *i1 = NULL, *i2 = NULL;
  kiln_tensor *t1 = kiln_topk(x2, 7, 0, true, true, &i1), *t2 = kiln_topk(kiln_to_device(x2, gpu), 7, 0, true, true, &i2);
  H_CHECK(t1 && t2 && bits_equal(t1, kiln_to_device(t2, cpu)) && bits_equal(i1, kiln_to_device(i2, cpu)),
          "topk along dim 0 differs");
  /* cumsum: f64 accumulation in index order on both: the same bits */
  kiln_tensor *c = kiln_randn(KILN_SHAPE(3, 2000), KILN_F32, cpu, g);
  H_CHECK(bits_equal(kiln_cumsum(c, 1), kiln_to_device(kiln_cumsum(kiln_to_device(c, gpu), 1), cpu)),
          "cumsum (3, 2000) f32 differs");
  H_CHECK(bits_equal(kiln_cumsum(c, 0), kiln_to_device(kiln_cumsum(kiln_to_device(c, gpu), 0), cpu)),
          "cumsum along dim 0 differs");
  kiln_tensor *ci = kiln_to_dtype(kiln_mul_scalar(c, 100), KILN_I32);
  H_CHECK(bits_equal(kiln_cumsum(ci, 1), kiln_to_device(kiln_cumsum(kiln_to_device(ci, gpu), 1), cpu)),
          "cumsum of int32 differs");
  /* tril / triu of a transposed view */
  kiln_tensor *m = kiln_transpose(kiln_randn(KILN_SHAPE(2, 40, 33), KILN_F32, cpu, g), 1, 2);
  H_CHECK(bits_equal(kiln_tril(m, -3), kiln_to_device(kiln_tril(kiln_to_device(m, gpu), -3), cpu)), "tril differs");
  H_CHECK(bits_equal(kiln_triu(m, 2), kiln_to_device(kiln_triu(kiln_to_device(m, gpu), 2), cpu)), "triu differs");
  kiln_generator_free(g);
  kiln_scope_end();
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_cuda_transformer");
  (void)tf_att_composite, (void)tf_bad_input, (void)sc_extra; /* CPU-only checks: their own tests run them */
  h_set_cross_only(true);
  if (kiln_device_count(KILN_DEVICE_CUDA) == 0) {
    printf("test_cuda_transformer: skipped (no cuda device)\n");
    return 77;
  }
  h_set_native_type(KILN_DEVICE_CUDA);
  h_run_cases(tf_norm_cases, (int)(sizeof tf_norm_cases / sizeof tf_norm_cases[0]));
  h_run_cases(tf_att_cases, (int)(sizeof tf_att_cases / sizeof tf_att_cases[0]));
  h_run_cases(sc_cases, (int)(sizeof sc_cases / sizeof sc_cases[0]));
  if (h_support_mode()) return h_finish();
  cpu = kiln_device_cpu();
  gpu = kiln_device_cuda(0);
  /* every transformer kernel below must run on the GPU itself */
  kiln_set_fallback_policy(KILN_FALLBACK_ERROR);
  norm_case(false, KILN_F32, 4096, 768, 3e-5);
  norm_case(true, KILN_F32, 4096, 768, 3e-5);
  norm_case(false, KILN_F32, 37, 3000, 3e-5);
  /* the f32 register path's edges (N % 4 == 0 up to 1024): a partial last float4 column
  ** (772 = 6 * 128 + 4), fewer float4s than lanes (100), the widest (1024) */
  norm_case(false, KILN_F32, 50, 772, 3e-5);
  norm_case(true, KILN_F32, 65, 100, 3e-5);
  norm_case(false, KILN_F32, 333, 1024, 3e-5);
  norm_case(false, KILN_BF16, 2048, 768, 3e-2);
  norm_case(false, KILN_F64, 300, 500, 1e-10);
  attention_checks();
  exact_checks();
  return h_finish();
}
