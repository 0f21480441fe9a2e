/* nn / optim / checkpoints on a GPU: kiln_module_to moves parameters, gradients and (for
** a module optimizer) the optimizer state; training on the GPU tracks the CPU; a
** checkpoint written from the GPU loads into a CPU model bit for bit. Exits 77 (skipped)
** without a CUDA device. */
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_checkpoint.h>
#include <kiln_io.h>
#include <kiln_nn.h>
#include <kiln_optim.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

static kiln_device cpu, gpu;

static kiln_module *net(uint64_t seed) {
  kiln_generator *g = kiln_generator_new(seed);
  kiln_module *m = kiln_sequential_new();
  kiln_sequential_append(m, kiln_linear_new(6, 32, true, KILN_F32, cpu, g));
  kiln_sequential_append(m, kiln_silu_new());
  kiln_sequential_append(m, kiln_linear_new(32, 4, true, KILN_F32, cpu, g));
  kiln_generator_free(g);
  return m;
}

static void step(kiln_module *m, kiln_optimizer *o, int s, kiln_device dev) {
  kiln_scope_begin();
  kiln_generator *dg = kiln_generator_new(500 + (uint64_t)s);
  kiln_tensor *x = kiln_to_device(kiln_randn(KILN_SHAPE(16, 6), KILN_F32, cpu, dg), dev);
  kiln_tensor *y = kiln_to_device(kiln_randint(0, 4, KILN_SHAPE(16), KILN_I64, cpu, dg), dev);
  kiln_tensor *loss = kiln_cross_entropy(kiln_module_forward(m, x), y, KILN_REDUCTION_MEAN, -100, 0.0);
  CHECK(kiln_optimizer_zero_grad(o) == KILN_OK);
  CHECK(kiln_backward(loss, NULL) == KILN_OK);
  kiln_tensor *ps[4];
  int n = kiln_module_parameters(m, ps, 4);
  CHECK(!isnan(kiln_clip_grad_norm(ps, n, 1.0, 2.0)));
  CHECK(kiln_optimizer_step(o) == KILN_OK);
  kiln_generator_free(dg);
  kiln_scope_end();
}

static double max_diff(kiln_module *a, kiln_module *b) {
  kiln_tensor *pa[4], *pb[4];
  int n = kiln_module_parameters(a, pa, 4);
  kiln_module_parameters(b, pb, 4);
  double d = 0;
  kiln_scope_begin();
  for (int i = 0; i < n; i++) {
    kiln_tensor *x = kiln_to_device(pa[i], cpu), *y = kiln_to_device(pb[i], cpu);
    d = fmax(d, kiln_item(kiln_amax(kiln_abs(kiln_sub(x, y)), 0, NULL, false)));
  }
  kiln_scope_end();
  return d;
}

int main(void) {
  cpu = kiln_device_cpu();
  if (kiln_device_count(KILN_DEVICE_CUDA) < 1) {
    printf("test_nn_cuda: no CUDA device, skipped\n");
    return 77;
  }
  gpu = kiln_device_cuda(0);
  kiln_module *ref = net(3), *m = net(3);
  kiln_optim_config cfg = kiln_adamw_config(0.01);
  kiln_optimizer *oref = kiln_optimizer_new_module(&cfg, ref);
  kiln_optimizer *o = kiln_optimizer_new_module(&cfg, m); /* made before the move */
  step(ref, oref, 0, cpu);
  step(m, o, 0, cpu);
  kiln_tensor *w_cpu = kiln_module_param(m, "0.weight");
  CHECK(kiln_module_to(m, gpu) == KILN_OK);
  kiln_tensor *w = kiln_module_param(m, "0.weight");
  CHECK(w != w_cpu && kiln_device_of(w).type == KILN_DEVICE_CUDA && kiln_requires_grad(w));
  CHECK(kiln_grad(w) && kiln_device_of(kiln_grad(w)).type == KILN_DEVICE_CUDA);
  for (int s = 1; s < 8; s++) {
    step(ref, oref, s, cpu);
    step(m, o, s, gpu);
  }
  kiln_dict *sd = kiln_optimizer_state_dict(o);
  CHECK(sd && kiln_device_of(kiln_dict_get(sd, "state.0.exp_avg")).type == KILN_DEVICE_CUDA);
  kiln_dict_free(sd);
  double d = max_diff(ref, m);
  CHECK(d < 1e-4); /* GPU and CPU arithmetic differ only in rounding */
  if (getenv("KILN_TEST_VERBOSE")) printf("max |cpu - gpu| after 8 steps: %g\n", d);

  /* Checkpoint from the GPU, loaded into a CPU model: the same bits. */
  char path[64];
  snprintf(path, sizeof path, "test_nn_cuda.%d.ckpt", (int)getpid());
  CHECK(kiln_checkpoint_save(path, m, o, NULL, NULL, 0, 8, NULL) == KILN_OK);
  kiln_module *back = net(99);
  kiln_optimizer *ob = kiln_optimizer_new_module(&cfg, back);
  CHECK(kiln_checkpoint_load(path, back, ob, NULL, NULL, NULL, NULL, NULL) == KILN_OK);
  CHECK(max_diff(back, m) == 0.0);
  /* And the other way: the CPU copy moved to the GPU continues like the original. */
  CHECK(kiln_module_to(back, gpu) == KILN_OK);
  step(back, ob, 8, gpu);
  step(m, o, 8, gpu);
  CHECK(max_diff(back, m) == 0.0);
  FILE *f = tmpfile();
  kiln_module_summary(f, m);
  rewind(f);
  char buf[4096] = {0};
  CHECK(fread(buf, 1, sizeof buf - 1, f) > 0 && strstr(buf, "device: cuda:0"));
  fclose(f);
  remove(path);
  kiln_optimizer_free(ob);
  kiln_optimizer_free(o);
  kiln_optimizer_free(oref);
  kiln_module_free(back);
  kiln_module_free(m);
  kiln_module_free(ref);
  return check_finish("test_nn_cuda");
}
