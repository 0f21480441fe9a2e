/*
** The kernels autocast adds to a training step, counted on the CPU so that the overhead
** cannot come back unnoticed. On a GPU a small model's step is bound by launches (the
** fashion-mnist MLP's bf16 step was 0.68-0.78x the f32 one), and each kernel counted
** here is one launch and one op call there.
**
** The step is fashion-mnist's (Linear+ReLU as linear_relu, Linear, cross_entropy, Adam
** over the parameter list), at small sizes. Under bf16 autocast it may add exactly:
**   forward:  the batch's cast (1 COPY, outside any node: else an extra MATMUL for its
**             gradient); the weights come as Adam left their bf16 copies (amp_copy, no
**             kernel: ADAM_MULTI writes them with the update);
**   backward: nothing: linear's rule writes the weight and bias gradients in f32 (the
**             "wide" product, kiln__grad_dtype) and the casts' rules hand them on.
** Not allowed (each was there once): the weights' casts each step (2 CAST_MULTI: x, W1,
** b1; W2, b2), a cast per parameter (4 COPY forward, 4 backward), the gradients' casts
** back to f32 (2 CAST_MULTI), a copy of every parameter's gradient
** on its way to .grad (4 COPY: a rule handing on its gradient held a second reference),
** the logits' cast to f32 and its gradient's back to bf16 (2 COPY: cross_entropy reads
** bf16 logits itself).
** Also checked: cross_entropy on bf16 logits under autocast gives the loss and the
** logits' gradient bit for bit as on the logits cast to f32 by hand, and the autocast
** step's parameter gradients equal those of explicit casts.
*/
#include "check.h"
#include "tensor_cmp.h"

#include "core/kiln_int.h" /* kiln__dispatch_observe, kiln__kop_name */

#include <kiln_optim.h>

#include <stdlib.h>
#include <string.h>

#include "amp_copy_check.h"
#include "amp_wide_check.h"

static const kiln_device CPU = {KILN_DEVICE_CPU, 0};

/* ---- kernel calls by kernel op ---- */
static int64_t per_op[KILN__K_COUNT];
static int64_t total;
static void count_kernel(void *ctx, kiln_device dev, const kiln__kargs *a, bool native) {
  (void)ctx, (void)dev, (void)native;
  per_op[a->op]++;
  total++;
}
static void counts_reset(void) {
  memset(per_op, 0, sizeof per_op);
  total = 0;
}

typedef struct model {
  kiln_tensor *w1, *b1, *w2, *b2;
  kiln_optimizer *opt;
} model;

static kiln_tensor *param(int ndim, const int64_t *shape, kiln_generator *g) {
  kiln_tensor *t = kiln_keep(kiln_mul_scalar(kiln_randn(ndim, shape, KILN_F32, CPU, g), 0.1));
  kiln_requires_grad_(t, true);
  return t;
}

static void model_init(model *m, uint64_t seed) {
  kiln_generator *g = kiln_generator_new(seed);
  kiln_scope_begin();
  m->w1 = param(KILN_SHAPE(16, 24), g);
  m->b1 = param(KILN_SHAPE(16), g);
  m->w2 = param(KILN_SHAPE(10, 16), g);
  m->b2 = param(KILN_SHAPE(10), g);
  kiln_scope_end();
  kiln_generator_free(g);
  kiln_optim_config cfg = kiln_adam_config(1e-3);
  kiln_tensor *ps[4] = {m->w1, m->b1, m->w2, m->b2};
  m->opt = kiln_optimizer_new(&cfg, ps, 4);
  CHECK(m->opt != NULL);
}

static void model_free(model *m) {
  kiln_optimizer_free(m->opt);
  kiln_tensor_free(m->w1);
  kiln_tensor_free(m->b1);
  kiln_tensor_free(m->w2);
  kiln_tensor_free(m->b2);
}

/* One step as fashion-mnist runs it; the kernels of the step (not of making the batch)
** are counted when count is set. */
static void step(model *m, kiln_tensor *x, kiln_tensor *y, bool amp, bool count) {
  kiln_scope_begin();
  if (count) kiln__dispatch_observe(count_kernel, NULL);
  kiln_status st = amp ? kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16) : KILN_OK;
  kiln_tensor *h = kiln_linear_relu(x, m->w1, m->b1);
  kiln_tensor *loss = kiln_cross_entropy(kiln_linear(h, m->w2, m->b2), y, KILN_REDUCTION_MEAN, -100, 0.0);
  if (amp && st == KILN_OK) st = kiln_autocast_end();
  CHECK(st == KILN_OK && loss && kiln_dtype_of(loss) == KILN_F32);
  CHECK(kiln_optimizer_zero_grad(m->opt) == KILN_OK);
  CHECK(kiln_backward(loss, NULL) == KILN_OK);
  CHECK(kiln_optimizer_step(m->opt) == KILN_OK);
  kiln__dispatch_observe(NULL, NULL);
  kiln_scope_end();
}

static void print_counts(const char *what) {
  fprintf(stderr, "  %s: %lld kernels:", what, (long long)total);
  for (int k = 0; k < KILN__K_COUNT; k++)
    if (per_op[k]) fprintf(stderr, " %s %lld", kiln__kop_name((kiln__kop)k), (long long)per_op[k]);
  fprintf(stderr, "\n");
}

static void test_step_kernels(void) {
  kiln_generator *g = kiln_generator_new(7);
  kiln_tensor *x = kiln_keep(kiln_randn(KILN_SHAPE(8, 24), KILN_F32, CPU, g));
  kiln_tensor *y = kiln_keep(kiln_randint(0, 10, KILN_SHAPE(8), KILN_I64, CPU, g));
  kiln_generator_free(g);
  int64_t f32_op[KILN__K_COUNT], f32_total;
  model m;
  model_init(&m, 1);
  step(&m, x, y, false, false); /* the optimizer's state is made in the first step */
  counts_reset();
  step(&m, x, y, false, true);
  memcpy(f32_op, per_op, sizeof per_op);
  f32_total = total;
  print_counts("f32 step");
  step(&m, x, y, true, false);
  counts_reset();
  step(&m, x, y, true, true);
  print_counts("bf16 autocast step");
  model_free(&m);
  /* every other kernel op runs as often (MATMUL too: no gradient for the batch's cast);
  ** one COPY: the batch's cast */
  for (int k = 0; k < KILN__K_COUNT; k++) {
    int64_t extra = k == KILN__K_COPY ? 1 : 0;
    if (per_op[k] != f32_op[k] + extra)
      fprintf(stderr, "  %s: %lld calls under autocast, %lld in f32 (+%lld expected)\n", kiln__kop_name((kiln__kop)k),
              (long long)per_op[k], (long long)f32_op[k], (long long)extra);
    CHECK(per_op[k] == f32_op[k] + extra);
  }
  CHECK(total - f32_total == 1);
  kiln_tensor_free(x);
  kiln_tensor_free(y);
}

/* cross_entropy reads the bf16 logits itself under autocast: the loss (f32) and the
** logits' gradient (bf16) are those of the logits cast to f32 by hand, for each
** reduction, with an ignored row and label smoothing. */
static void test_cross_entropy_reads_bf16(void) {
  static const kiln_reduction reds[3] = {KILN_REDUCTION_MEAN, KILN_REDUCTION_SUM, KILN_REDUCTION_NONE};
  for (int r = 0; r < 3; r++)
    for (int ls = 0; ls < 2; ls++) {
      kiln_scope_begin();
      kiln_generator *g = kiln_generator_new(11 + (uint64_t)r);
      kiln_tensor *base = kiln_mul_scalar(kiln_randn(KILN_SHAPE(6, 7), KILN_F32, CPU, g), 3.0);
      kiln_generator_free(g);
      kiln_tensor *y = kiln_from_data((const int64_t[]){0, 6, -100, 3, 2, 5}, KILN_SHAPE(6), KILN_I64, CPU);
      double eps = ls ? 0.1 : 0.0;
      /* by hand: bf16 leaf, cast to f32, cross_entropy */
      kiln_tensor *l1 = kiln_to_dtype(base, KILN_BF16);
      kiln_requires_grad_(l1, true);
      kiln_tensor *loss1 = kiln_cross_entropy(kiln_to_dtype(l1, KILN_F32), y, reds[r], -100, eps);
      kiln_tensor *s1 = reds[r] == KILN_REDUCTION_NONE ? kiln_sum_all(loss1) : loss1;
      CHECK(kiln_backward(s1, NULL) == KILN_OK);
      /* autocast: the same bf16 leaf straight in */
      kiln_tensor *l2 = kiln_to_dtype(base, KILN_BF16);
      kiln_requires_grad_(l2, true);
      CHECK(kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16) == KILN_OK);
      int64_t k0 = kiln__dispatch_count();
      kiln_tensor *loss2 = kiln_cross_entropy(l2, y, reds[r], -100, eps);
      int64_t kernels = kiln__dispatch_count() - k0;
      CHECK(kiln_autocast_end() == KILN_OK);
      CHECK(loss2 && kiln_dtype_of(loss2) == KILN_F32);
      /* mean: one kernel; sum: rows then their sum; none: rows (no cast kernel) */
      CHECK(kernels == (reds[r] == KILN_REDUCTION_SUM ? 2 : 1));
      kiln_tensor *s2 = reds[r] == KILN_REDUCTION_NONE ? kiln_sum_all(loss2) : loss2;
      CHECK(kiln_backward(s2, NULL) == KILN_OK);
      CHECK(bits_equal(loss1, loss2));
      CHECK(kiln_grad(l2) && kiln_dtype_of(kiln_grad(l2)) == KILN_BF16);
      CHECK(bits_equal(kiln_grad(l1), kiln_grad(l2)));
      kiln_scope_end();
    }
}

/* The step's parameter gradients under autocast equal explicit casts' (the copy that
** no longer happens changed no value). */
static void test_step_grads_equal_explicit_casts(void) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(3);
  kiln_tensor *x = kiln_randn(KILN_SHAPE(8, 24), KILN_F32, CPU, g);
  kiln_tensor *y = kiln_randint(0, 10, KILN_SHAPE(8), KILN_I64, CPU, g);
  kiln_generator_free(g);
  model m;
  model_init(&m, 5);
  kiln_tensor *ps[4] = {m.w1, m.b1, m.w2, m.b2};
  CHECK(kiln_autocast_begin(KILN_DEVICE_CPU, KILN_BF16) == KILN_OK);
  kiln_tensor *loss = kiln_cross_entropy(kiln_linear(kiln_linear_relu(x, m.w1, m.b1), m.w2, m.b2), y,
                                         KILN_REDUCTION_MEAN, -100, 0.0);
  CHECK(kiln_autocast_end() == KILN_OK);
  CHECK(kiln_backward(loss, NULL) == KILN_OK);
  kiln_tensor *ga[4];
  for (int i = 0; i < 4; i++) {
    ga[i] = kiln_grad(ps[i]);
    CHECK(ga[i] && kiln_dtype_of(ga[i]) == KILN_F32);
    kiln__scope_track(kiln_tensor_ref(ga[i])); /* ours until the scope ends */
    kiln_set_grad(ps[i], NULL);
  }
  kiln_tensor *c[4];
  for (int i = 0; i < 4; i++) c[i] = kiln_to_dtype(ps[i], KILN_BF16);
  kiln_tensor *logits = kiln_linear(kiln_linear_relu(kiln_to_dtype(x, KILN_BF16), c[0], c[1]), c[2], c[3]);
  kiln_tensor *loss2 = kiln_cross_entropy(kiln_to_dtype(logits, KILN_F32), y, KILN_REDUCTION_MEAN, -100, 0.0);
  CHECK(bits_equal(loss, loss2));
  CHECK(kiln_backward(loss2, NULL) == KILN_OK);
  for (int i = 0; i < 4; i++) CHECK(bits_equal(ga[i], kiln_grad(ps[i])));
  model_free(&m);
  kiln_scope_end();
}

int main(void) {
  test_step_kernels();
  test_cross_entropy_reads_bf16();
  test_step_grads_equal_explicit_casts();
  amp_wide_check(CPU); /* the weight gradients in f32, unrounded */
  amp_copy_check(CPU);
  printf("test_amp_launches: %d failures\n", failures);
  return failures ? 1 : 0;
}
