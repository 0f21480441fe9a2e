/*
** Shared by test_amp_launches (CPU) and test_cuda_amp (CUDA): autocast's kept bf16 copies
** of the parameters, rewritten by Adam (ADAM_MULTI) and SGD (SGD_MULTI) with each update,
** give the same numbers as casting every step:
**   - two identical models train 4 bf16 autocast steps; before each step one of them has
**     its parameters' versions bumped (kiln_copy_ of each parameter onto itself: an
**     in-place op), so it casts every step and never uses a copy. Losses and parameters
**     agree bit for bit after every step;
**   - the copies are used: after the steps, a forward of the first model runs one cast
**     kernel (the batch's, COPY) and no CAST_MULTI;
**   - a parameter written in place after the step (kiln_mul_scalar_) is cast afresh: the
**     next forward equals a forward on an explicit cast of the new values, bit for bit;
**   - graphs: a model with valid copies captures its step (capturable Adam), replays it 3
**     times and takes 2 eager steps after; it matches a model that casts every step
**     eagerly (within 1e-5 of the largest value: a capture may pick other cuBLAS
**     algorithms), so a capture neither reads a copy it cannot check nor leaves one
**     stale for the eager steps after the replays.
** Needs check.h included first.
*/
#ifndef KILN_TEST_AMP_COPY_CHECK_H
#define KILN_TEST_AMP_COPY_CHECK_H

#include <kiln_optim.h>

#include <string.h>

#include "core/kiln_int.h" /* kiln__dispatch_observe */

static int64_t copy_kernels[KILN__K_COUNT];
static void copy_count_kernel(void *ctx, kiln_device dev, const kiln__kargs *a, bool native) {
  (void)ctx, (void)dev, (void)native;
  copy_kernels[a->op]++;
}

static bool copy_same(kiln_tensor *a, kiln_tensor *b) {
  if (!a || !b || kiln_dtype_of(a) != kiln_dtype_of(b) || kiln_numel(a) != kiln_numel(b)) return false;
  size_t n = kiln_nbytes(a);
  unsigned char *x = malloc(n + 1), *y = malloc(n + 1);
  bool ok = x && y && kiln_to_host(a, x, n) == KILN_OK && kiln_to_host(b, y, n) == KILN_OK && memcmp(x, y, n) == 0;
  free(x), free(y);
  return ok;
}

typedef struct copy_model {
  kiln_tensor *p[4]; /* w1, b1, w2, b2 */
  kiln_optimizer *opt;
} copy_model;

static void copy_model_init2(copy_model *m, kiln_device dev, bool sgd, bool capturable) {
  kiln_generator *g = kiln_generator_new(21);
  static const int64_t shapes[4][2] = {{32, 40}, {32, 0}, {10, 32}, {10, 0}};
  kiln_scope_begin();
  for (int i = 0; i < 4; i++) {
    int nd = shapes[i][1] ? 2 : 1;
    m->p[i] = kiln_keep(kiln_to_device(kiln_mul_scalar(kiln_randn(nd, shapes[i], KILN_F32, kiln_device_cpu(), g), 0.2), dev));
    kiln_requires_grad_(m->p[i], true);
  }
  kiln_scope_end();
  kiln_generator_free(g);
  kiln_optim_config cfg = sgd ? kiln_sgd_config(0.05) : kiln_adam_config(1e-2);
  if (sgd) cfg.momentum = 0.9;
  cfg.capturable = capturable;
  m->opt = kiln_optimizer_new(&cfg, m->p, 4);
  CHECK(m->opt != NULL);
}

static void copy_model_init(copy_model *m, kiln_device dev, bool sgd) { copy_model_init2(m, dev, sgd, false); }

static void copy_model_free(copy_model *m) {
  kiln_optimizer_free(m->opt);
  for (int i = 0; i < 4; i++) kiln_tensor_free(m->p[i]);
}

static kiln_tensor *copy_forward(copy_model *m, kiln_tensor *x, kiln_tensor *y, kiln_device dev) {
  CHECK(kiln_autocast_begin(dev.type, KILN_BF16) == KILN_OK);
  kiln_tensor *loss = kiln_cross_entropy(kiln_linear(kiln_linear_relu(x, m->p[0], m->p[1]), m->p[2], m->p[3]), y,
                                         KILN_REDUCTION_MEAN, -100, 0.0);
  CHECK(kiln_autocast_end() == KILN_OK);
  return loss;
}

/* max |a - b| <= tol * max |b|, over all four parameters */
static bool copy_close(copy_model *a, copy_model *b, double tol) {
  bool ok = true;
  for (int i = 0; i < 4; i++) {
    kiln_scope_begin();
    int64_t n = kiln_numel(b->p[i]);
    kiln_tensor *d = kiln_amax(kiln_reshape(kiln_abs(kiln_sub(a->p[i], b->p[i])), KILN_SHAPE(n)), KILN_DIMS(0), false);
    kiln_tensor *m = kiln_amax(kiln_reshape(kiln_abs(b->p[i]), KILN_SHAPE(n)), KILN_DIMS(0), false);
    double dv = d ? kiln_item(d) : 1e30, mv = m ? kiln_item(m) : 0;
    if (!(dv <= tol * mv)) {
      fprintf(stderr, "  parameter %d: max difference %.3g, max value %.3g\n", i, dv, mv);
      ok = false;
    }
    kiln_scope_end();
  }
  return ok;
}

typedef struct copy_graph_ctx {
  copy_model *m;
  kiln_tensor *x, *y;
  kiln_device dev;
} copy_graph_ctx;

static kiln_status copy_graph_step(void *p) {
  copy_graph_ctx *c = p;
  kiln_scope_begin();
  kiln_tensor *loss = copy_forward(c->m, c->x, c->y, c->dev);
  kiln_status st = kiln_optimizer_zero_grad(c->m->opt);
  if (st == KILN_OK) st = loss ? kiln_backward(loss, NULL) : kiln_last_error();
  if (st == KILN_OK) st = kiln_optimizer_step(c->m->opt);
  kiln_scope_end();
  return st;
}

static void amp_copy_graph_check(kiln_device dev) {
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(6);
  kiln_tensor *x = kiln_keep(kiln_to_device(kiln_randn(KILN_SHAPE(16, 40), KILN_F32, kiln_device_cpu(), g), dev));
  kiln_tensor *y = kiln_keep(kiln_to_device(kiln_randint(0, 10, KILN_SHAPE(16), KILN_I64, kiln_device_cpu(), g), dev));
  kiln_generator_free(g);
  copy_model a, b;
  copy_model_init2(&a, dev, false, true);
  copy_model_init2(&b, dev, false, true);
  copy_graph_ctx ca = {&a, x, y, dev}, cb = {&b, x, y, dev};
  for (int s = 0; s < 7; s++) { /* b: casts every step (its copies made stale first) */
    bool prev = kiln_set_grad_enabled(false);
    for (int i = 0; i < 4; i++) CHECK(kiln_copy_(b.p[i], b.p[i]) == KILN_OK);
    kiln_set_grad_enabled(prev);
    CHECK(copy_graph_step(&cb) == KILN_OK);
  }
  kiln_graph *gr = NULL;
  for (int s = 0; s < 2; s++) CHECK(copy_graph_step(&ca) == KILN_OK); /* a: copies made, then used */
  CHECK((gr = kiln_graph_capture(dev, copy_graph_step, &ca)) != NULL);
  for (int r = 0; r < 3 && gr; r++) CHECK(kiln_graph_replay(gr) == KILN_OK);
  for (int s = 0; s < 2; s++) CHECK(copy_graph_step(&ca) == KILN_OK); /* eager again after the replays */
  CHECK(kiln_device_synchronize(dev) == KILN_OK);
  CHECK(copy_close(&a, &b, 1e-5));
  kiln_graph_free(gr);
  copy_model_free(&a);
  copy_model_free(&b);
  kiln_tensor_free(x);
  kiln_tensor_free(y);
  kiln_scope_end();
}

static void amp_copy_check(kiln_device dev) {
  amp_copy_graph_check(dev);
  for (int opt = 0; opt < 2; opt++) {
    kiln_scope_begin();
    kiln_generator *g = kiln_generator_new(5);
    kiln_tensor *x = kiln_to_device(kiln_randn(KILN_SHAPE(16, 40), KILN_F32, kiln_device_cpu(), g), dev);
    kiln_tensor *y = kiln_to_device(kiln_randint(0, 10, KILN_SHAPE(16), KILN_I64, kiln_device_cpu(), g), dev);
    kiln_generator_free(g);
    copy_model a, b;
    copy_model_init(&a, dev, opt == 1);
    copy_model_init(&b, dev, opt == 1);
    for (int s = 0; s < 4; s++) {
      kiln_scope_begin();
      bool prev = kiln_set_grad_enabled(false);
      for (int i = 0; i < 4; i++) CHECK(kiln_copy_(b.p[i], b.p[i]) == KILN_OK); /* b: copies stale */
      kiln_set_grad_enabled(prev);
      copy_model *ms[2] = {&a, &b};
      kiln_tensor *loss[2];
      for (int k = 0; k < 2; k++) {
        loss[k] = copy_forward(ms[k], x, y, dev);
        CHECK(kiln_optimizer_zero_grad(ms[k]->opt) == KILN_OK);
        CHECK(loss[k] && kiln_backward(loss[k], NULL) == KILN_OK);
        CHECK(kiln_optimizer_step(ms[k]->opt) == KILN_OK);
      }
      if (!copy_same(loss[0], loss[1]))
        fprintf(stderr, "  %s %s step %d: losses differ (%.9g, %.9g)\n", kiln_backend_name(dev.type), opt ? "sgd" : "adam",
                s, kiln_item(loss[0]), kiln_item(loss[1]));
      CHECK(copy_same(loss[0], loss[1]));
      for (int i = 0; i < 4; i++) CHECK(copy_same(a.p[i], b.p[i]));
      kiln_scope_end();
    }
    { /* a's copies are valid: its forward casts the batch alone */
      memset(copy_kernels, 0, sizeof copy_kernels);
      kiln__dispatch_observe(copy_count_kernel, NULL);
      kiln_tensor *l = copy_forward(&a, x, y, dev);
      kiln__dispatch_observe(NULL, NULL);
      if (copy_kernels[KILN__K_CAST_MULTI] != 0 || copy_kernels[KILN__K_COPY] != 1)
        fprintf(stderr, "  %s %s: forward ran %lld CAST_MULTI and %lld COPY (want 0 and 1)\n",
                kiln_backend_name(dev.type), opt ? "sgd" : "adam", (long long)copy_kernels[KILN__K_CAST_MULTI],
                (long long)copy_kernels[KILN__K_COPY]);
      CHECK(l && copy_kernels[KILN__K_CAST_MULTI] == 0 && copy_kernels[KILN__K_COPY] == 1);
    }
    /* a written in place after its step: the next forward casts the new values */
    {
      bool prev = kiln_set_grad_enabled(false);
      CHECK(kiln_mul_scalar_(a.p[0], 0.5) == KILN_OK);
      kiln_set_grad_enabled(prev);
      kiln_tensor *l1 = copy_forward(&a, x, y, dev);
      kiln_tensor *c[4];
      for (int i = 0; i < 4; i++) c[i] = kiln_to_dtype(kiln_detach(a.p[i]), KILN_BF16);
      kiln_tensor *h = kiln_linear_relu(kiln_to_dtype(x, KILN_BF16), c[0], c[1]);
      kiln_tensor *l2 = kiln_cross_entropy(kiln_to_dtype(kiln_linear(h, c[2], c[3]), KILN_F32), y, KILN_REDUCTION_MEAN, -100, 0.0);
      CHECK(copy_same(l1, l2));
    }
    copy_model_free(&a);
    copy_model_free(&b);
    kiln_scope_end();
  }
}

#endif
