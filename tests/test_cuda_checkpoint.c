/* Checkpointed GPT blocks on a GPU, where the GPT walks its blocks with each residual add
** fused into the next norm and a checkpointed block is a segment of that walk: every
** block checkpointed (the default keep: attention's results), every block keeping its
** products too (KILN_CHECKPOINT_KEEP_PRODUCTS), and each block's MLP, in f32 and under
** bf16 autocast (cuDNN's attention). Each gives the unchecked run's loss and gradients
** (the recompute runs the forward's kernels on the forward's inputs: the same bits where
** the kernels are deterministic, checked to 1e-6 of the largest), and the recomputes
** skip and take what the plan says. Exits 77 (skipped) without a CUDA device. */
#include <kiln.h>
#include <kiln_nn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "check.h"
#include "tensor_cmp.h"

#include "core/kiln_int.h" /* checkpoint.c's counters */

static kiln_device gpu;

enum mode { NONE, BLOCKS, BLOCKS_PRODUCTS, MLPS, N_MODES };
static const char *const mode_names[] = {"unchecked", "every block", "every block keeping products", "each MLP"};

static kiln_gpt_config small(void) {
  kiln_gpt_config c = kiln_gpt2_config();
  c.n_layer = 3;
  c.n_head = 2;
  c.n_embd = 128; /* head dim 64, as GPT-2's */
  c.vocab_size = 256;
  c.block_size = 64;
  return c;
}

/* One forward and backward from seed 5's model: the loss, then each parameter's gradient,
** copied to the CPU; the recomputes' skips and takes in *skipped, *taken. */
static int run(enum mode mode, bool bf16, kiln_tensor **out, int cap, int64_t *skipped, int64_t *taken) {
  kiln_scope_begin();
  kiln_gpt_config c = small();
  kiln_generator *g = kiln_generator_new(5);
  kiln_module *m = kiln_gpt_new(&c, KILN_F32, gpu, g);
  kiln_module *h = kiln_module_child(m, "h");
  if (mode == BLOCKS || mode == BLOCKS_PRODUCTS) CHECK(kiln_module_set_checkpoint(h, true) == KILN_OK);
  if (mode == BLOCKS_PRODUCTS) CHECK(kiln_module_set_checkpoint_keep(h, KILN_CHECKPOINT_KEEP_PRODUCTS) == KILN_OK);
  for (int i = 0; mode == MLPS && i < kiln_module_num_children(h); i++)
    CHECK(kiln_module_set_checkpoint(kiln_module_child(kiln_module_child_at(h, i), "mlp"), true) == KILN_OK);
  kiln_tensor *x = kiln_randint(0, c.vocab_size, KILN_SHAPE(4, 64), KILN_I64, gpu, g);
  kiln_tensor *y = kiln_randint(0, c.vocab_size, KILN_SHAPE(4 * 64), KILN_I64, gpu, g);
  if (bf16) kiln_autocast_begin(KILN_DEVICE_CUDA, KILN_BF16);
  kiln_tensor *loss = kiln_gpt_forward_loss(m, x, y, -100);
  if (bf16) kiln_autocast_end();
  CHECK(loss != NULL);
  int64_t s0 = kiln__checkpoint_skipped(), t0 = kiln__checkpoint_taken();
  CHECK(kiln_backward(loss, NULL) == KILN_OK);
  *skipped = kiln__checkpoint_skipped() - s0;
  *taken = kiln__checkpoint_taken() - t0;
  int n = kiln_module_parameters(m, NULL, 0);
  CHECK(n + 1 <= cap);
  kiln_tensor **ps = malloc((size_t)n * sizeof *ps);
  kiln_module_parameters(m, ps, n);
  out[0] = kiln_keep(kiln_to_device(loss, kiln_device_cpu()));
  for (int i = 0; i < n && i + 1 < cap; i++)
    out[i + 1] = kiln_keep(kiln_to_device(kiln_grad(ps[i]), kiln_device_cpu()));
  free(ps);
  kiln_module_free(m);
  kiln_generator_free(g);
  kiln_scope_end();
  return n + 1;
}

/* max |a - b| / max |b| */
static double rel(kiln_tensor *a, kiln_tensor *b) {
  kiln_scope_begin();
  double scale = kiln_item(kiln_amax(kiln_abs(b), 0, NULL, false)), d = max_abs_diff(a, b);
  kiln_scope_end();
  return scale > 0 ? d / scale : d;
}

int main(void) {
  if (kiln_device_count(KILN_DEVICE_CUDA) < 1) {
    printf("test_cuda_checkpoint: no CUDA device, skipped\n");
    return 77;
  }
  gpu = kiln_device_cuda(0);
  enum { CAP = 64 };
  const int L = small().n_layer;
  for (int b = 0; b < 2; b++) {
    kiln_tensor *ref[CAP] = {NULL};
    int64_t s, t;
    int n = run(NONE, b, ref, CAP, &s, &t);
    CHECK(s == 0 && t == 0);
    for (int mode = BLOCKS; mode < N_MODES; mode++) {
      kiln_tensor *got[CAP] = {NULL};
      int64_t f0 = kiln__checkpoint_full_again();
      int k = run((enum mode)mode, b, got, CAP, &s, &t);
      CHECK(k == n);
      /* each segment's last op (a block's or an MLP's c_proj) skipped; a block takes the
      ** attention's results, and with products c_attn's and attention's c_proj's outputs */
      CHECK(s == L);
      CHECK(t == (mode == BLOCKS ? L : mode == BLOCKS_PRODUCTS ? 3 * L : 0));
      CHECK(kiln__checkpoint_full_again() == f0);
      int same = 0;
      double worst = 0;
      for (int i = 0; i < n; i++) {
        same += bits_equal(got[i], ref[i]);
        worst = fmax(worst, rel(got[i], ref[i]));
      }
      printf("%s, %s: %d of %d (loss, gradients) the same bits, largest difference %.2e of the largest\n",
             mode_names[mode], b ? "bf16 autocast" : "f32", same, n, worst);
      CHECK(worst <= 1e-6);
      for (int i = 0; i < k; i++) kiln_tensor_free(got[i]);
    }
    for (int i = 0; i < n; i++) kiln_tensor_free(ref[i]);
  }
  return check_finish("test_cuda_checkpoint");
}
