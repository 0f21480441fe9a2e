/* kiln's optimizers against PyTorch's numbers: the MLP of tests/fixtures/optim/ (Linear(16,
** 32) -> ReLU -> Linear(32, 10), cross-entropy), loaded from PyTorch's initial state dict
** and trained in f32 on PyTorch's batches, must give PyTorch's loss at every one of the
** 300 steps and PyTorch's final parameters, for each optimizer configuration the fixtures
** hold (SGD plain / momentum with dampening / Nesterov / weight decay, Adam, Adam with L2,
** AdamW, amsgrad, StepLR and CosineAnnealingLR). scripts/make_optim_fixtures.py made the
** fixtures with torch.optim (foreach=False); the settings come from each file's metadata.
**
** Tolerances: every loss within 1e-5 relative, every final parameter within 1e-5
** absolute (the parameters are O(0.1..1)). What is left between kiln and PyTorch is the
** rounding of the forward and backward (matmul summation order), ~1e-7 a step; a wrong
** order of operations in an optimizer (1 - beta2 rounded to f32 after beta2 is 4.7e-5 off
** in relative terms) drifts past 1e-5 within a few hundred steps. The margin of each
** configuration is printed.
**
**   test_optim_parity          on the CPU
**   test_optim_parity --cuda   on CUDA device 0 (ctest's test_optim_parity_cuda, label
**                              gpu); exits 77 (skipped) without a device
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_io.h>
#include <kiln_nn.h>
#include <kiln_optim.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define LOSS_RTOL 1e-5
#define PARAM_ATOL 1e-5

static const char *const configs[] = {
    "sgd",  "sgd_momentum", "sgd_nesterov", "sgd_weight_decay",    "adam",
    "adam_l2", "adamw",     "adam_amsgrad", "sgd_momentum_steplr", "adam_cosine",
};

/* tests/fixtures/optim/<name>.safetensors, from KILN_SOURCE_DIR (set by ctest) or next to
** the source file. */
static const char *fixture(const char *name) {
  static char out[1024];
  const char *src = getenv("KILN_SOURCE_DIR");
  if (src) {
    snprintf(out, sizeof out, "%s/tests/fixtures/optim/%s.safetensors", src, name);
  } else {
    const char *f = __FILE__, *slash = strrchr(f, '/');
    snprintf(out, sizeof out, "%.*s/fixtures/optim/%s.safetensors", slash ? (int)(slash - f) : 1,
             slash ? f : ".", name);
  }
  return out;
}

static double meta_f64(const kiln_dict *d, const char *key, double dflt) {
  const char *v = kiln_dict_get_meta(d, key);
  return v ? strtod(v, NULL) : dflt;
}

static kiln_optim_config config_of(const kiln_dict *d) {
  const char *kind = kiln_dict_get_meta(d, "optimizer");
  double lr = meta_f64(d, "lr", NAN);
  kiln_optim_config c = !strcmp(kind, "sgd")    ? kiln_sgd_config(lr)
                        : !strcmp(kind, "adam") ? kiln_adam_config(lr)
                                                : kiln_adamw_config(lr);
  c.weight_decay = meta_f64(d, "weight_decay", 0.0);
  c.momentum = meta_f64(d, "momentum", 0.0);
  c.dampening = meta_f64(d, "dampening", 0.0);
  c.nesterov = meta_f64(d, "nesterov", 0) != 0;
  c.amsgrad = meta_f64(d, "amsgrad", 0) != 0;
  return c; /* betas (0.9, 0.999) and eps 1e-8: the defaults of both */
}

static kiln_scheduler *scheduler_of(const kiln_dict *d, kiln_optimizer *o) {
  const char *s = kiln_dict_get_meta(d, "scheduler");
  if (!s) return NULL;
  if (!strcmp(s, "step"))
    return kiln_step_lr_new(o, (int64_t)meta_f64(d, "step_size", 0), meta_f64(d, "gamma", 0));
  if (!strcmp(s, "cosine"))
    return kiln_cosine_lr_new(o, (int64_t)meta_f64(d, "t_max", 0), meta_f64(d, "eta_min", 0), 0, 0.0);
  fprintf(stderr, "unknown scheduler %s\n", s);
  failures++;
  return NULL;
}

/* Trains one configuration on dev; returns false when a check failed. */
static bool run(const char *name, const kiln_dict *init, const kiln_dict *batches, kiln_device dev) {
  kiln_dict *ref = kiln_safetensors_load(fixture(name), kiln_device_cpu());
  CHECK(ref != NULL);
  if (!ref) return false;
  int before = failures;
  kiln_module *net = kiln_sequential_new();
  CHECK(kiln_sequential_append(net, kiln_linear_new(16, 32, true, KILN_F32, dev, NULL)) == KILN_OK);
  CHECK(kiln_sequential_append(net, kiln_relu_new()) == KILN_OK);
  CHECK(kiln_sequential_append(net, kiln_linear_new(32, 10, true, KILN_F32, dev, NULL)) == KILN_OK);
  CHECK(kiln_module_load_state_dict(net, init, true) == KILN_OK);
  kiln_optim_config cfg = config_of(ref);
  kiln_optimizer *opt = kiln_optimizer_new_module(&cfg, net);
  CHECK(opt != NULL);
  kiln_scheduler *sched = scheduler_of(ref, opt);

  kiln_tensor *x = kiln_to_device(kiln_dict_get(batches, "x"), dev); /* (8, 32, 16) */
  kiln_tensor *y = kiln_to_device(kiln_dict_get(batches, "y"), dev); /* (8, 32) i64 */
  const float *want = kiln_data_ptr(kiln_dict_get(ref, "losses"));
  const int64_t steps = kiln_numel(kiln_dict_get(ref, "losses"));
  const int64_t nb = kiln_shape(x)[0];
  const char *trace = getenv("KILN_PARITY_TRACE"); /* a configuration's name: every step */
  double worst = 0;
  int64_t worst_step = -1, first_bad = -1;
  for (int64_t s = 0; s < steps && opt; s++) {
    kiln_scope_begin();
    kiln_tensor *logits = kiln_module_forward(net, kiln_select(x, 0, s % nb));
    kiln_tensor *loss = kiln_cross_entropy(logits, kiln_select(y, 0, s % nb), KILN_REDUCTION_MEAN, -100, 0.0);
    CHECK(kiln_optimizer_zero_grad(opt) == KILN_OK);
    CHECK(kiln_backward(loss, NULL) == KILN_OK);
    CHECK(kiln_optimizer_step(opt) == KILN_OK);
    if (sched) CHECK(kiln_scheduler_step(sched) == KILN_OK);
    double got = kiln_item(loss), rel = fabs(got - want[s]) / fabs((double)want[s]);
    if (trace && !strcmp(trace, name))
      printf("    step %3lld loss %.9g PyTorch %.9g relative %.3g\n", (long long)s, got, (double)want[s], rel);
    if (!(rel <= worst)) worst = rel, worst_step = s; /* a NaN is the worst too */
    if (!(rel <= LOSS_RTOL) && first_bad < 0) {
      first_bad = s;
      fprintf(stderr, "%s: step %lld: loss %.9g, PyTorch %.9g (relative %.3g)\n", name,
              (long long)s, got, (double)want[s], rel);
    }
    kiln_scope_end();
  }
  CHECK(first_bad < 0);

  /* The final parameters, by name. */
  double pworst = 0;
  const char *pname = "";
  const char *names[4];
  kiln_tensor *ps[4];
  int n = kiln_module_named_parameters(net, names, ps, 4);
  CHECK(n == 4);
  kiln_scope_begin();
  for (int i = 0; i < n; i++) {
    kiln_tensor *got = kiln_contiguous(kiln_to_device(ps[i], kiln_device_cpu()));
    kiln_tensor *exp = kiln_dict_get(ref, names[i]);
    CHECK(exp && kiln_numel(exp) == kiln_numel(got));
    if (!exp || !got || kiln_numel(exp) != kiln_numel(got)) continue;
    const float *g = kiln_data_ptr(got), *e = kiln_data_ptr(exp);
    for (int64_t k = 0; k < kiln_numel(got); k++) {
      double d = fabs((double)g[k] - (double)e[k]);
      if (!(d <= pworst)) pworst = d, pname = names[i];
    }
  }
  kiln_scope_end();
  CHECK(pworst <= PARAM_ATOL);
  printf("  %-22s max loss deviation %.3g (relative, step %lld of %lld)   max param deviation "
         "%.3g (absolute, %s)%s\n",
         name, worst, (long long)worst_step, (long long)steps, pworst, pname,
         failures > before ? "   FAILED" : "");

  kiln_tensor_free(x);
  kiln_tensor_free(y);
  kiln_scheduler_free(sched);
  kiln_optimizer_free(opt);
  kiln_module_free(net);
  kiln_dict_free(ref);
  return failures == before;
}

int main(int argc, char **argv) {
  bool cuda = argc > 1 && !strcmp(argv[1], "--cuda");
  if (cuda && kiln_device_count(KILN_DEVICE_CUDA) < 1) {
    printf("test_optim_parity --cuda: no CUDA device, skipped\n");
    return 77;
  }
  kiln_device dev = cuda ? kiln_device_cuda(0) : kiln_device_cpu();
  kiln_dict *init = kiln_safetensors_load(fixture("init"), kiln_device_cpu());
  kiln_dict *batches = kiln_safetensors_load(fixture("batches"), kiln_device_cpu());
  CHECK(init && batches);
  if (!init || !batches) return 1;
  printf("test_optim_parity on %s, against torch %s (losses within %g relative, parameters "
         "within %g absolute):\n", cuda ? "cuda:0" : "the CPU", kiln_dict_get_meta(init, "torch"),
         LOSS_RTOL, PARAM_ATOL);
  int passed = 0, total = (int)(sizeof configs / sizeof *configs);
  for (int i = 0; i < total; i++) passed += run(configs[i], init, batches, dev);
  kiln_dict_free(init);
  kiln_dict_free(batches);
  printf("test_optim_parity: %d/%d configurations match, %d failed checks\n", passed, total, failures);
  return failures ? 1 : 0;
}
