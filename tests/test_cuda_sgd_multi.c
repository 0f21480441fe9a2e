/*
** SGD_MULTI on CUDA against the CPU kernel (which test_optim_sgd_multi holds to the
** composed rule's bits): kiln's SGD over 110 parameters (more than one launch of 48; one
** tensor of 70,000 elements spans many blocks; empty and 0-d tensors) from the same
** initial values and gradients on both devices, for momentum, dampening, nesterov,
** maximize and weight decay in f32, f64, bf16 and f16, plain and loss-scaled steps (a
** skipped first step, a skip later). The element update is the same sequence of
** correctly rounded operations on both (FMA, products, round-to-nearest-even casts), so
** parameters and buffers must agree to the bit; a failure prints the largest difference.
** Exits 77 (skipped) without a CUDA device.
*/
#include "check.h"

#include "optim/optim_int.h" /* kiln__optimizer_step_found_inf */

#include <kiln_optim.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define NP 110
static kiln_device cpu, gpu;

static int64_t numel_of(int i) {
  if (i == 7) return 70000; /* many blocks */
  if (i % 23 == 5) return 0; /* empty */
  return 1 + (i * 37) % 301;
}

/* Parameters and gradients compared as f64 values: the bits when equal as values (f64
** holds every value of the other dtypes exactly; NaN never arises here). */
/* Parameter i's shape: 0-d for i == 3, else 1-d of numel_of(i). */
static kiln_tensor *randn_of(int i, kiln_dtype dt, kiln_generator *gen) {
  int64_t n = numel_of(i);
  return kiln_to_dtype(kiln_randn(i == 3 ? 0 : 1, &n, KILN_F32, cpu, gen), dt);
}

static double max_diff(kiln_tensor *a_cpu, kiln_tensor *b_gpu, int64_t *n_diff) {
  kiln_scope_begin();
  kiln_tensor *a = kiln_to_dtype(a_cpu, KILN_F64);
  kiln_tensor *b = kiln_to_dtype(kiln_to_device(b_gpu, cpu), KILN_F64);
  double m = 0;
  *n_diff = 0;
  if (!a || !b) {
    kiln_scope_end();
    *n_diff = -1;
    return INFINITY;
  }
  const double *x = kiln_data_ptr(a), *y = kiln_data_ptr(b);
  for (int64_t k = 0; k < kiln_numel(a); k++) {
    double d = fabs(x[k] - y[k]);
    if (x[k] != y[k]) (*n_diff)++;
    if (d > m || d != d) m = d;
  }
  kiln_scope_end();
  return m;
}

static void run_case(kiln_optim_config cfg, kiln_dtype dt, bool scaled) {
  static const float inf_steps[4] = {1, 0, 1, 0};
  kiln_scope_begin();
  kiln_generator *gen = kiln_generator_new(9);
  kiln_tensor *pc[NP], *pg[NP];
  for (int i = 0; i < NP; i++) {
    kiln_tensor *init = randn_of(i, dt, gen);
    pc[i] = kiln_keep(kiln_clone(init));
    pg[i] = kiln_keep(kiln_to_device(init, gpu));
    kiln_requires_grad_(pc[i], true);
    kiln_requires_grad_(pg[i], true);
  }
  kiln_optimizer *oc = kiln_optimizer_new(&cfg, pc, NP), *og = kiln_optimizer_new(&cfg, pg, NP);
  CHECK(oc && og);
  bool prev = kiln_set_grad_enabled(false);
  for (int k = 0; k < 4 && oc && og; k++) {
    kiln_scope_begin();
    for (int i = 0; i < NP; i++) {
      kiln_tensor *g = randn_of(i, dt, gen);
      CHECK(kiln_set_grad(pc[i], g) == KILN_OK);
      CHECK(kiln_set_grad(pg[i], kiln_to_device(g, gpu)) == KILN_OK);
    }
    if (scaled) {
      kiln_tensor *fc = kiln_scalar(inf_steps[k], KILN_F32, cpu), *fg = kiln_scalar(inf_steps[k], KILN_F32, gpu);
      CHECK(kiln__optimizer_step_found_inf(oc, fc) == KILN_OK);
      CHECK(kiln__optimizer_step_found_inf(og, fg) == KILN_OK);
    } else {
      CHECK(kiln_optimizer_step(oc) == KILN_OK);
      CHECK(kiln_optimizer_step(og) == KILN_OK);
    }
    kiln_scope_end();
  }
  CHECK(kiln_device_synchronize(gpu) == KILN_OK);
  /* parameters, and the buffers and step counts through the state dicts */
  kiln_dict *dc = kiln_optimizer_state_dict(oc), *dg = kiln_optimizer_state_dict(og);
  CHECK(dc && dg);
  int bad = 0;
  for (int i = 0; i < NP; i++) {
    int64_t nd;
    double m = max_diff(pc[i], pg[i], &nd);
    if (nd != 0 && bad++ < 5)
      fprintf(stderr, "  %s param %d (%lld elements): %lld differ, max |diff| %g (momentum %g dampening %g nesterov %d maximize %d wd %g%s)\n",
              kiln_dtype_name(dt), i, (long long)kiln_numel(pc[i]), (long long)nd, m, cfg.momentum, cfg.dampening,
              cfg.nesterov, cfg.maximize, cfg.weight_decay, scaled ? ", scaled" : "");
    CHECK(nd == 0);
    char key[64];
    if (cfg.momentum != 0 && dc && dg) {
      snprintf(key, sizeof key, "state.%d.momentum_buffer", i);
      kiln_tensor *bc = kiln_dict_get(dc, key), *bg = kiln_dict_get(dg, key);
      CHECK(bc && bg);
      if (bc && bg) {
        m = max_diff(bc, bg, &nd);
        if (nd != 0 && bad++ < 5) fprintf(stderr, "  %s buffer %d: %lld differ, max |diff| %g\n", kiln_dtype_name(dt), i, (long long)nd, m);
        CHECK(nd == 0);
      }
    }
    if (scaled && dc && dg) { /* 2 of the 4 steps were skipped */
      snprintf(key, sizeof key, "state.%d.step", i);
      const char *sc = kiln_dict_get_meta(dc, key), *sg = kiln_dict_get_meta(dg, key);
      CHECK(sc && sg && strcmp(sc, "2") == 0 && strcmp(sg, "2") == 0);
    }
  }
  kiln_dict_free(dc);
  kiln_dict_free(dg);
  kiln_set_grad_enabled(prev);
  kiln_optimizer_free(oc);
  kiln_optimizer_free(og);
  for (int i = 0; i < NP; i++) {
    kiln_tensor_free(pc[i]);
    kiln_tensor_free(pg[i]);
  }
  kiln_generator_free(gen);
  kiln_scope_end();
}

int main(void) {
  cpu = kiln_device_cpu();
  if (kiln_device_count(KILN_DEVICE_CUDA) < 1) {
    printf("test_cuda_sgd_multi: no CUDA device, skipped\n");
    return 77;
  }
  gpu = kiln_device_cuda(0);
  static const kiln_dtype dts[4] = {KILN_F32, KILN_F64, KILN_BF16, KILN_F16};
  for (int d = 0; d < 4; d++)
    for (int v = 0; v < 6; v++) {
      kiln_optim_config c = kiln_sgd_config(0.05);
      c.momentum = v == 0 ? 0.0 : 0.9;
      c.dampening = v == 2 ? 0.25 : 0.0;
      c.nesterov = v == 3 || v == 5;
      c.maximize = v == 4 || v == 5;
      c.weight_decay = v >= 3 ? 1e-4 : 0.0;
      run_case(c, dts[d], false);
      if (v == 1 || v == 3) run_case(c, dts[d], true);
    }
  printf("test_cuda_sgd_multi: %d failures\n", failures);
  return failures ? 1 : 0;
}
