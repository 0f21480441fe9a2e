/*
** SGD_MULTI (kiln_sgd_multi_step_, and kiln's SGD through it) against the composed
** per-parameter rule SGD used before (neg, axpy, clone, mul_scalar_, axpy_; copied below
** from src/optim/sgd.c as it was), to the bit on the CPU: every combination of momentum,
** dampening, nesterov, maximize and weight decay, in f32, f64, bf16 and f16, over
** several steps and shapes (a 0-d and an empty tensor among them); the loss-scaled path
** (device step counts, a found-inf flag that skips steps, a skipped first step); the
** op's elementwise fallback for backends without the kernel (the CPU's kernel switched
** off) gives the same bits; one kernel call per step for all the parameters; bad input.
** The CUDA kernel is checked against this CPU one by test_cuda_sgd_multi (label gpu).
*/
#include "check.h"

#include "core/kiln_int.h"  /* kiln__dispatch_observe, kiln__dispatch_disable_kernel */
#include "optim/optim_int.h" /* kiln__optimizer_step_found_inf */

#include <kiln_optim.h>

#include <stdlib.h>
#include <string.h>

static const kiln_device CPU = {KILN_DEVICE_CPU, 0};

/* ---- the composed rule, as src/optim/sgd.c had it ---- */
typedef struct ref_state {
  kiln_tensor *buf, *step_t;
  int64_t step;
} ref_state;

static kiln_status ref_plain(const kiln_optim_config *c, kiln_tensor *p, kiln_tensor *g, ref_state *s) {
  if (c->maximize) g = kiln_neg(g);
  if (c->weight_decay != 0) g = kiln_axpy(g, c->weight_decay, p);
  if (!g) return kiln_last_error();
  if (c->momentum != 0) {
    if (!s->buf) {
      s->buf = kiln_keep(kiln_clone(g));
    } else {
      kiln_status st = kiln_mul_scalar_(s->buf, c->momentum);
      if (st == KILN_OK) st = kiln_axpy_(s->buf, 1.0 - c->dampening, g);
      if (st != KILN_OK) return st;
    }
    g = c->nesterov ? kiln_axpy(g, c->momentum, s->buf) : s->buf;
  }
  return kiln_axpy_(p, -c->lr, g);
}

static kiln_status ref_scaled(const kiln_optim_config *c, kiln_tensor *p, kiln_tensor *g, ref_state *s,
                              kiln_tensor *found_inf) {
  if (!s->step_t) s->step_t = kiln_keep(kiln_scalar((double)s->step, KILN_F64, CPU));
  if (c->maximize) g = kiln_neg(g);
  if (c->weight_decay != 0) g = kiln_axpy(g, c->weight_decay, p);
  kiln_tensor *now[2] = {p, NULL}, *fresh[2] = {NULL, NULL};
  if (c->momentum != 0) {
    if (!s->buf) s->buf = kiln_keep(kiln_zeros_like(p));
    kiln_tensor *later = kiln_axpy(kiln_mul_scalar(s->buf, c->momentum), 1.0 - c->dampening, g);
    kiln_tensor *first = kiln_eq_scalar(kiln_view(s->step_t, 0, NULL), 0.0);
    kiln_tensor *b = kiln_where(first, g, later);
    now[1] = s->buf;
    fresh[1] = b;
    g = c->nesterov ? kiln_axpy(g, c->momentum, b) : b;
  }
  fresh[0] = kiln_axpy(p, -c->lr, g);
  kiln_tensor *bad = found_inf ? kiln_ne(kiln_view(found_inf, 0, NULL), kiln_scalar(0.0, KILN_F32, CPU)) : NULL;
  for (int k = 0; k < 2; k++) {
    if (!now[k]) continue;
    kiln_status st = kiln_copy_(now[k], bad ? kiln_where(bad, now[k], fresh[k]) : fresh[k]);
    if (st != KILN_OK) return st;
  }
  kiln_tensor *inc = found_inf ? kiln_to_dtype(kiln_eq_scalar(kiln_view(found_inf, 0, NULL), 0.0), KILN_F64)
                               : kiln_scalar(1.0, KILN_F64, CPU);
  return kiln_axpy_(s->step_t, 1.0, inc);
}

static bool bit_equal(kiln_tensor *a, kiln_tensor *b) {
  if (!a || !b) return a == b;
  if (kiln_dtype_of(a) != kiln_dtype_of(b) || kiln_numel(a) != kiln_numel(b)) return false;
  return memcmp(kiln_data_ptr(a), kiln_data_ptr(b), kiln_nbytes(a)) == 0;
}

/* ---- kernel calls ---- */
static int64_t sgd_calls, other_calls;
static void count_kernel(void *ctx, kiln_device dev, const kiln__kargs *a, bool native) {
  (void)ctx, (void)dev, (void)native;
  if (a->op == KILN__K_SGD_MULTI) sgd_calls++;
  else other_calls++;
}

#define NP 5
static const int64_t shapes[NP][3] = {{7, 5, 0}, {13, 0, 0}, {0, 0, 0}, {3, 2, 4}, {0, 4, 0}};
static const int ndims[NP] = {2, 1, 0, 3, 2};

/* The optimizer (fused path) and the reference side by side for `steps` steps from the
** same parameters and gradients; scaled: loss-scaled steps with found_inf[k] per step. */
static void run_case(kiln_optim_config cfg, kiln_dtype dt, bool scaled, const float *inf, int steps,
                     bool count) {
  kiln_scope_begin();
  kiln_generator *gen = kiln_generator_new(42);
  kiln_tensor *p[NP], *r[NP];
  ref_state rs[NP];
  memset(rs, 0, sizeof rs);
  for (int i = 0; i < NP; i++) {
    kiln_tensor *init = kiln_to_dtype(kiln_randn(ndims[i], shapes[i], KILN_F32, CPU, gen), dt);
    p[i] = kiln_keep(kiln_clone(init));
    r[i] = kiln_keep(kiln_clone(init));
    kiln_requires_grad_(p[i], true);
  }
  kiln_optimizer *opt = kiln_optimizer_new(&cfg, p, NP);
  CHECK(opt != NULL);
  bool prev = kiln_set_grad_enabled(false);
  for (int k = 0; k < steps && opt; k++) {
    kiln_scope_begin();
    kiln_tensor *fi = scaled ? kiln_scalar(inf ? inf[k] : 0.0, KILN_F32, CPU) : NULL;
    for (int i = 0; i < NP; i++) {
      kiln_tensor *g = kiln_to_dtype(kiln_randn(ndims[i], shapes[i], KILN_F32, CPU, gen), dt);
      CHECK(kiln_set_grad(p[i], g) == KILN_OK);
      kiln_status st = scaled ? ref_scaled(&cfg, r[i], g, &rs[i], fi) : ref_plain(&cfg, r[i], g, &rs[i]);
      CHECK(st == KILN_OK);
      rs[i].step++;
    }
    sgd_calls = other_calls = 0;
    if (count) kiln__dispatch_observe(count_kernel, NULL);
    CHECK((scaled ? kiln__optimizer_step_found_inf(opt, fi) : kiln_optimizer_step(opt)) == KILN_OK);
    kiln__dispatch_observe(NULL, NULL);
    if (count) {
      /* one SGD_MULTI call for the five parameters; after the first step (which makes the
      ** buffers and step counts) nothing else but, when scaled, the optimizer's count of
      ** skipped steps (4 kernels, optimizer.c) */
      int64_t others = k == 0 ? other_calls : (scaled ? 4 : 0);
      if (sgd_calls != 1 || other_calls != others)
        fprintf(stderr, "  step %d: %lld sgd_multi calls, %lld other kernels\n", k, (long long)sgd_calls,
                (long long)other_calls);
      CHECK(sgd_calls == 1 && other_calls == others);
    }
    kiln_scope_end();
    for (int i = 0; i < NP; i++) {
      bool same = bit_equal(p[i], r[i]);
      if (!same)
        fprintf(stderr, "  %s param %d differs after step %d (momentum %g dampening %g nesterov %d maximize %d wd %g%s)\n",
                kiln_dtype_name(dt), i, k, cfg.momentum, cfg.dampening, cfg.nesterov, cfg.maximize, cfg.weight_decay,
                scaled ? ", scaled" : "");
      CHECK(same);
    }
  }
  /* the momentum buffers too, through the state dict */
  if (opt && cfg.momentum != 0) {
    kiln_dict *d = kiln_optimizer_state_dict(opt);
    CHECK(d != NULL);
    for (int i = 0; d && i < NP; i++) {
      char key[64];
      snprintf(key, sizeof key, "state.%d.momentum_buffer", i);
      kiln_tensor *b = kiln_dict_get(d, key);
      CHECK(b && bit_equal(b, rs[i].buf));
    }
    kiln_dict_free(d);
  }
  kiln_set_grad_enabled(prev);
  kiln_optimizer_free(opt);
  for (int i = 0; i < NP; i++) {
    kiln_tensor_free(p[i]);
    kiln_tensor_free(r[i]);
    kiln_tensor_free(rs[i].buf);
    kiln_tensor_free(rs[i].step_t);
  }
  kiln_generator_free(gen);
  kiln_scope_end();
}

static void test_bit_identical_every_option(void) {
  static const kiln_dtype dts[4] = {KILN_F32, KILN_F64, KILN_BF16, KILN_F16};
  for (int d = 0; d < 4; d++)
    for (int v = 0; v < 24; v++) {
      kiln_optim_config c = kiln_sgd_config(0.05);
      c.momentum = (v & 1) ? 0.9 : 0.0;
      c.dampening = (v & 2) ? 0.3 : 0.0;
      c.nesterov = (v & 4) != 0;
      c.maximize = (v & 8) != 0;
      c.weight_decay = (v & 16) ? 1e-2 : 0.0;
      if (c.nesterov && (c.momentum == 0 || c.dampening != 0)) continue; /* refused: see bad input */
      run_case(c, dts[d], false, NULL, 4, d == 0 && v == 1);
    }
  /* weight decay with everything on */
  kiln_optim_config c = kiln_sgd_config(0.1);
  c.momentum = 0.9, c.nesterov = true, c.weight_decay = 1e-4, c.maximize = true;
  for (int d = 0; d < 4; d++) run_case(c, dts[d], false, NULL, 5, false);
}

/* Loss-scaled steps: the counts on the device, a skipped first step (the buffer must stay
** as if never made), a skip later on, clean steps between. */
static void test_scaled_steps(void) {
  static const float inf[6] = {1, 0, 0, 1, 0, 0};
  static const kiln_dtype dts[3] = {KILN_F32, KILN_BF16, KILN_F64};
  for (int d = 0; d < 3; d++)
    for (int v = 0; v < 4; v++) {
      kiln_optim_config c = kiln_sgd_config(0.05);
      c.momentum = 0.9;
      c.dampening = (v & 1) ? 0.2 : 0.0;
      c.nesterov = v == 2;
      c.maximize = v == 3;
      c.weight_decay = 1e-3;
      run_case(c, dts[d], true, inf, 6, d == 0 && v == 0);
    }
}

/* The op's fallback for a backend without SGD_MULTI (elementwise ops per tensor) gives
** the same bits: the CPU's kernel switched off. */
static void test_fallback_same_bits(void) {
  kiln__dispatch_disable_kernel(KILN_DEVICE_CPU, KILN__K_SGD_MULTI, true);
  kiln_optim_config c = kiln_sgd_config(0.05);
  c.momentum = 0.9, c.dampening = 0.1, c.weight_decay = 1e-2;
  run_case(c, KILN_F32, false, NULL, 4, false);
  run_case(c, KILN_BF16, false, NULL, 4, false);
  static const float inf[4] = {1, 0, 1, 0};
  c.dampening = 0, c.nesterov = true;
  run_case(c, KILN_F32, true, inf, 4, false);
  kiln__dispatch_disable_kernel(KILN_DEVICE_CPU, KILN__K_SGD_MULTI, false);
}

static void test_bad_input(void) {
  kiln_scope_begin();
  kiln_tensor *p = kiln_zeros(KILN_SHAPE(3), KILN_F32, CPU), *g = kiln_zeros(KILN_SHAPE(3), KILN_F32, CPU);
  kiln_tensor *b = kiln_zeros(KILN_SHAPE(3), KILN_F32, CPU), *g4 = kiln_zeros(KILN_SHAPE(4), KILN_F32, CPU);
  kiln_tensor *gh = kiln_zeros(KILN_SHAPE(3), KILN_BF16, CPU), *fi = kiln_scalar(0, KILN_F32, CPU);
  kiln_tensor *st = kiln_scalar(0, KILN_F64, CPU);
  kiln_tensor *t6 = kiln_transpose(kiln_zeros(KILN_SHAPE(2, 3), KILN_F32, CPU), 0, 1);
  kiln_tensor *p6 = kiln_zeros(KILN_SHAPE(3, 2), KILN_F32, CPU);
  CHECK(kiln_sgd_multi_step_(1, &p, &g, &b, NULL, NULL, 0.1, 0.9, 0.1, 0, true, false, NULL) ==
        KILN_ERR_INVALID_ARGUMENT); /* nesterov with dampening */
  CHECK(strstr(kiln_last_error_message(), "nesterov") != NULL);
  CHECK(kiln_sgd_multi_step_(1, &p, &g4, NULL, NULL, NULL, 0.1, 0, 0, 0, false, false, NULL) == KILN_ERR_SHAPE);
  CHECK(strstr(kiln_last_error_message(), "kiln_sgd_multi_step_") != NULL);
  CHECK(strstr(kiln_last_error_message(), "[4]") != NULL && strstr(kiln_last_error_message(), "[3]") != NULL);
  CHECK(kiln_sgd_multi_step_(1, &p, &gh, NULL, NULL, NULL, 0.1, 0, 0, 0, false, false, NULL) == KILN_ERR_SHAPE);
  CHECK(kiln_sgd_multi_step_(1, &p6, &t6, NULL, NULL, NULL, 0.1, 0, 0, 0, false, false, NULL) ==
        KILN_ERR_INVALID_ARGUMENT); /* not contiguous */
  CHECK(kiln_sgd_multi_step_(1, &p, &g, NULL, NULL, NULL, 0.1, 0.9, 0, 0, false, false, NULL) ==
        KILN_ERR_INVALID_ARGUMENT); /* momentum without buffers */
  CHECK(kiln_sgd_multi_step_(1, &p, &g, NULL, NULL, NULL, 0.1, 0, 0, 0, false, false, fi) ==
        KILN_ERR_INVALID_ARGUMENT); /* found_inf without step_t */
  CHECK(strstr(kiln_last_error_message(), "step_t") != NULL);
  CHECK(kiln_sgd_multi_step_(1, &p, &g, NULL, NULL, &g, 0.1, 0, 0, 0, false, false, NULL) ==
        KILN_ERR_INVALID_ARGUMENT); /* step_t not f64 */
  CHECK(kiln_sgd_multi_step_(1, &p, &g, NULL, NULL, NULL, -1, 0, 0, 0, false, false, NULL) ==
        KILN_ERR_INVALID_ARGUMENT);
  kiln_tensor *nul = NULL;
  CHECK(kiln_sgd_multi_step_(1, &p, &nul, NULL, NULL, NULL, 0.1, 0, 0, 0, false, false, NULL) != KILN_OK);
  kiln_requires_grad_(p, true); /* grad mode on: refused */
  CHECK(kiln_sgd_multi_step_(1, &p, &g, NULL, NULL, NULL, 0.1, 0, 0, 0, false, false, NULL) == KILN_ERR_AUTOGRAD);
  /* nothing moved by the refused calls; a good one works */
  kiln_requires_grad_(p, false);
  kiln_tensor *one = kiln_ones(KILN_SHAPE(3), KILN_F32, CPU);
  CHECK(kiln_sgd_multi_step_(1, &p, &one, &b, (const bool[]){true}, &st, 0.5, 0.9, 0, 0, false, false, fi) == KILN_OK);
  CHECK(kiln_item(kiln_sum_all(p)) == -1.5 && kiln_item(kiln_sum_all(b)) == 3.0 && kiln_item(st) == 1.0);
  kiln_scope_end();
}

/* A channels-last parameter whose gradient comes contiguous (and the reverse): the
** fused update (after one copy of g into the parameter's layout, src/optim/sgd.c), one
** SGD_MULTI call for both, the same bits as the composed rule on C-order copies. */
static void test_mixed_layout_grads(void) {
  kiln_scope_begin();
  kiln_generator *gen = kiln_generator_new(9);
  kiln_optim_config cfg = kiln_sgd_config(0.1);
  cfg.momentum = 0.9, cfg.weight_decay = 1e-4;
  kiln_tensor *init0 = kiln_randn(KILN_SHAPE(6, 5, 3, 3), KILN_F32, CPU, gen);
  kiln_tensor *init1 = kiln_randn(KILN_SHAPE(4, 7, 3, 2), KILN_F32, CPU, gen);
  kiln_tensor *p[2] = {kiln_keep(kiln_contiguous_format(init0, KILN_CHANNELS_LAST)), kiln_keep(kiln_clone(init1))};
  kiln_tensor *r[2] = {kiln_keep(kiln_clone(init0)), kiln_keep(kiln_clone(init1))};
  ref_state rs[2];
  memset(rs, 0, sizeof rs);
  for (int i = 0; i < 2; i++) kiln_requires_grad_(p[i], true);
  kiln_optimizer *opt = kiln_optimizer_new(&cfg, p, 2);
  CHECK(opt != NULL);
  bool prev = kiln_set_grad_enabled(false);
  for (int k = 0; k < 3 && opt; k++) {
    kiln_scope_begin();
    kiln_tensor *g0 = kiln_randn(KILN_SHAPE(6, 5, 3, 3), KILN_F32, CPU, gen); /* contiguous, p[0] channels-last */
    kiln_tensor *g1 = kiln_contiguous_format(kiln_randn(KILN_SHAPE(4, 7, 3, 2), KILN_F32, CPU, gen), KILN_CHANNELS_LAST);
    CHECK(kiln_set_grad(p[0], g0) == KILN_OK && kiln_set_grad(p[1], g1) == KILN_OK);
    CHECK(ref_plain(&cfg, r[0], g0, &rs[0]) == KILN_OK);
    CHECK(ref_plain(&cfg, r[1], kiln_contiguous(g1), &rs[1]) == KILN_OK);
    rs[0].step++, rs[1].step++;
    sgd_calls = other_calls = 0;
    kiln__dispatch_observe(count_kernel, NULL);
    CHECK(kiln_optimizer_step(opt) == KILN_OK);
    kiln__dispatch_observe(NULL, NULL);
    CHECK(sgd_calls == 1);
    kiln_scope_end();
    for (int i = 0; i < 2; i++) CHECK(bit_equal(kiln_contiguous(p[i]), r[i]));
    CHECK(kiln_is_contiguous_format(p[0], KILN_CHANNELS_LAST) && kiln_is_contiguous(p[1]));
  }
  kiln_set_grad_enabled(prev);
  kiln_optimizer_free(opt);
  for (int i = 0; i < 2; i++) {
    kiln_tensor_free(p[i]);
    kiln_tensor_free(r[i]);
    kiln_tensor_free(rs[i].buf);
    kiln_tensor_free(rs[i].step_t);
  }
  kiln_generator_free(gen);
  kiln_scope_end();
}

int main(void) {
  test_bit_identical_every_option();
  test_scaled_steps();
  test_fallback_same_bits();
  test_bad_input();
  test_mixed_layout_grads();
  printf("test_optim_sgd_multi: %d failures\n", failures);
  return failures ? 1 : 0;
}
