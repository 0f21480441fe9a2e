/*
** kiln_adam_multi_step_ (the multi-tensor Adam) on the CPU: the same numbers as one
** kiln_adam_step_ per tensor, through the list kernel and through the per-tensor path a
** backend without it takes; the device step (step_t) read and advanced; bad lists refused
** before anything changes. (test_cuda_runtime compares the CUDA list kernel with these.)
*/
#include <kiln.h>

#include "backend/backend.h"
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void kiln__dispatch_disable_kernel(kiln_device_type type, int op, bool off);

enum { NT = 5 };

typedef struct set {
  kiln_tensor *p[NT], *g[NT], *m[NT], *v[NT], *x[NT], *t[NT];
} set;

/* Five parameters of mixed shapes and two dtypes (one empty), random grads, zero state. */
static void set_make(set *s, uint64_t seed) {
  static const int64_t shapes[NT][2] = {{3, 4}, {17, 1}, {0, 5}, {64, 33}, {1, 1}};
  kiln_generator *gen = kiln_generator_new(seed);
  for (int i = 0; i < NT; i++) {
    kiln_dtype dt = i == 1 ? KILN_F64 : KILN_F32;
    s->p[i] = kiln_keep(kiln_randn(2, shapes[i], dt, kiln_device_cpu(), gen));
    s->g[i] = kiln_keep(kiln_randn(2, shapes[i], dt, kiln_device_cpu(), gen));
    s->m[i] = kiln_keep(kiln_zeros(2, shapes[i], dt, kiln_device_cpu()));
    s->v[i] = kiln_keep(kiln_zeros(2, shapes[i], dt, kiln_device_cpu()));
    s->x[i] = kiln_keep(kiln_zeros(2, shapes[i], dt, kiln_device_cpu()));
    s->t[i] = kiln_keep(kiln_scalar(0, KILN_F64, kiln_device_cpu()));
  }
  kiln_generator_free(gen);
}
static void set_free(set *s) {
  for (int i = 0; i < NT; i++) {
    kiln_tensor_free(s->p[i]), kiln_tensor_free(s->g[i]), kiln_tensor_free(s->m[i]);
    kiln_tensor_free(s->v[i]), kiln_tensor_free(s->x[i]), kiln_tensor_free(s->t[i]);
  }
}

/* Largest |a - b| over every parameter and state tensor of the two sets. */
static double set_diff(set *a, set *b) {
  double worst = 0;
  for (int i = 0; i < NT; i++) {
    kiln_tensor *pa[4] = {a->p[i], a->m[i], a->v[i], a->x[i]}, *pb[4] = {b->p[i], b->m[i], b->v[i], b->x[i]};
    for (int k = 0; k < 4; k++) {
      int64_t n = 0, n2 = 0;
      double *x = h_values(pa[k], &n), *y = h_values(pb[k], &n2);
      for (int64_t j = 0; x && y && j < n; j++)
        if (!(fabs(x[j] - y[j]) <= worst)) worst = fabs(x[j] - y[j]);
      if (!x || !y || n != n2) worst = INFINITY;
      free(x), free(y);
    }
  }
  return worst;
}

static kiln_status multi(set *s, const int64_t *steps, bool dev_step, bool adamw, bool ams) {
  return kiln_adam_multi_step_(NT, s->p, s->g, s->m, s->v, ams ? s->x : NULL, steps,
                               dev_step ? s->t : NULL, 1e-2, 0.9, 0.99, 1e-8, 0.05, adamw, ams);
}

static void test_same_numbers(void) {
  for (int variant = 0; variant < 4; variant++) {
    bool adamw = variant & 1, ams = variant & 2;
    set a, b, c, d;
    set_make(&a, 11), set_make(&b, 11), set_make(&c, 11), set_make(&d, 11);
    bool prev = kiln_set_grad_enabled(false);
    for (int64_t step = 1; step <= 3; step++) {
      int64_t steps[NT];
      for (int i = 0; i < NT; i++) steps[i] = step;
      H_CHECK(multi(&a, steps, false, adamw, ams) == KILN_OK, "multi step: %s", kiln_last_error_message());
      for (int i = 0; i < NT; i++)
        H_CHECK(kiln_adam_step_(b.p[i], b.g[i], b.m[i], b.v[i], ams ? b.x[i] : NULL, 1e-2, 0.9, 0.99,
                                1e-8, 0.05, step, adamw, ams, NULL) == KILN_OK,
                "single step %d: %s", i, kiln_last_error_message());
      /* a backend without the list kernel: the op layer loops the single one */
      kiln__dispatch_disable_kernel(KILN_DEVICE_CPU, KILN__K_ADAM_MULTI, true);
      H_CHECK(multi(&c, steps, false, adamw, ams) == KILN_OK, "multi, per-tensor path: %s", kiln_last_error_message());
      kiln__dispatch_disable_kernel(KILN_DEVICE_CPU, KILN__K_ADAM_MULTI, false);
      /* the step on the "device": read as step_t + 1, then advanced */
      H_CHECK(multi(&d, NULL, true, adamw, ams) == KILN_OK, "multi, step_t: %s", kiln_last_error_message());
    }
    kiln_set_grad_enabled(prev);
    H_CHECK(set_diff(&a, &b) == 0, "adamw %d amsgrad %d: list kernel differs from single calls by %g", adamw, ams, set_diff(&a, &b));
    H_CHECK(set_diff(&c, &b) == 0, "adamw %d amsgrad %d: per-tensor path differs by %g", adamw, ams, set_diff(&c, &b));
    H_CHECK(set_diff(&d, &b) == 0, "adamw %d amsgrad %d: step_t path differs by %g", adamw, ams, set_diff(&d, &b));
    for (int i = 0; i < NT; i++) H_CHECK(kiln_item(d.t[i]) == 3, "step_t %d advanced to 3, got %g", i, kiln_item(d.t[i]));
    set_free(&a), set_free(&b), set_free(&c), set_free(&d);
  }
}

static void test_bad_lists(void) {
  set a, b;
  set_make(&a, 5), set_make(&b, 5);
  bool prev = kiln_set_grad_enabled(false);
  int64_t steps[NT] = {1, 1, 1, 1, 1};
  /* tensor 3's exp_avg has the wrong shape: refused, naming it, and nothing moved */
  kiln_tensor *keep = a.m[3];
  a.m[3] = kiln_keep(kiln_zeros(KILN_SHAPE(2, 2), KILN_F32, kiln_device_cpu()));
  kiln_status rc = multi(&a, steps, false, false, false);
  H_CHECK(rc == KILN_ERR_SHAPE && strstr(kiln_last_error_message(), "tensor 3") != NULL,
          "a mis-shaped exp_avg is KILN_ERR_SHAPE naming tensor 3: %s (%s)", kiln_error_name(rc),
          kiln_last_error_message());
  kiln_tensor_free(a.m[3]);
  a.m[3] = keep;
  H_CHECK(set_diff(&a, &b) == 0, "a refused list changes nothing");
  steps[2] = 0;
  H_EXPECT_ERR(multi(&a, steps, false, false, false) == KILN_OK, KILN_ERR_INVALID_ARGUMENT, "a step of 0");
  H_EXPECT_ERR(kiln_adam_multi_step_(NT, a.p, a.g, a.m, a.v, NULL, NULL, NULL, 1e-3, 0.9, 0.999, 1e-8, 0,
                                     false, false) == KILN_OK,
               KILN_ERR_INVALID_ARGUMENT, "neither steps nor step_t");
  H_EXPECT_ERR(kiln_adam_multi_step_(-1, a.p, a.g, a.m, a.v, NULL, steps, NULL, 1e-3, 0.9, 0.999, 1e-8, 0,
                                     false, false) == KILN_OK,
               KILN_ERR_INVALID_ARGUMENT, "a negative count");
  H_CHECK(kiln_adam_multi_step_(0, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 1e-3, 0.9, 0.999, 1e-8, 0,
                                false, false) == KILN_OK,
          "an empty list is a no-op");
  kiln_set_grad_enabled(prev);
  /* grad mode on with a parameter that requires grad: refused */
  kiln_requires_grad_(a.p[0], true);
  steps[2] = 1;
  H_EXPECT_ERR(multi(&a, steps, false, false, false) == KILN_OK, KILN_ERR_AUTOGRAD, "grad mode on");
  H_CHECK(set_diff(&a, &b) == 0, "refused lists change nothing");
  set_free(&a), set_free(&b);
}

/* More tensors than the call path's optional-input mask has bits (6 slots each, the
** max_exp_avg_sq slots NULL): the list op takes them all, with the numbers of one step per
** tensor. */
static void test_many_tensors(void) {
  enum { M = 12 };
  kiln_scope_begin();
  kiln_device cpu = kiln_device_cpu();
  kiln_tensor *p[M], *g[M], *m[M], *v[M], *p1[M], *m1[M], *v1[M];
  int64_t steps[M];
  for (int i = 0; i < M; i++) {
    p[i] = kiln_randn(KILN_SHAPE(3, i + 1), KILN_F32, cpu, NULL);
    g[i] = kiln_randn(KILN_SHAPE(3, i + 1), KILN_F32, cpu, NULL);
    m[i] = kiln_zeros(KILN_SHAPE(3, i + 1), KILN_F32, cpu);
    v[i] = kiln_zeros(KILN_SHAPE(3, i + 1), KILN_F32, cpu);
    p1[i] = kiln_clone(p[i]), m1[i] = kiln_clone(m[i]), v1[i] = kiln_clone(v[i]);
    steps[i] = 1;
  }
  H_CHECK(kiln_adam_multi_step_(M, p, g, m, v, NULL, steps, NULL, 1e-2, 0.9, 0.99, 1e-8, 0.0, false, false) == KILN_OK,
          "adam_multi of %d tensors: %s", M, kiln_last_error_message());
  double worst = 0;
  for (int i = 0; i < M; i++) {
    H_CHECK(kiln_adam_step_(p1[i], g[i], m1[i], v1[i], NULL, 1e-2, 0.9, 0.99, 1e-8, 0.0, 1, false, false, NULL) == KILN_OK,
            "adam_step %d: %s", i, kiln_last_error_message());
    double d = kiln_item(kiln_amax(kiln_abs(kiln_sub(p[i], p1[i])), 0, NULL, false));
    if (!(d <= worst)) worst = d;
  }
  H_CHECK(worst == 0, "multi and single steps agree over %d tensors (worst %g)", M, worst);
  kiln_scope_end();
}

int main(int argc, char **argv) {
  h_init(argc, argv, "test_optim_multi");
  test_same_numbers();
  test_bad_lists();
  test_many_tensors();
  return h_finish();
}
