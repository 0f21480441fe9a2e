/*
** scaled_dot_product_attention, forward and forward + backward: kiln's fused kernels
** (ATTENTION, ATTENTION_BACKWARD) against the composition a framework without them runs
** (batched matmul q k^T, scale, causal mask, softmax, matmul with v; autograd's backward
** through the same ops), at GPT-2's shape by default: B 16, H 12, T 1024, D 64, bf16,
** causal. On CUDA (the default device) the fused rows are the tensor-core FlashAttention-2
** kernels of cuda_flash.cu where they apply and, with KILN_CUDA_ATTENTION=simple, the
** CUDA-core ones of cuda_attention.cu; on the CPU (--device cpu) the fused call's own
** choice (for bf16 on a CPU with AVX512-BF16 and no AMX, cpu_attention_vnni.c's products)
** and, with KILN_ATTENTION_VNNI=0, oneDNN's batched matmuls (cpu_transformer.c).
**
** FLOPs counted as FlashAttention's papers count them: 4 B H T^2 D for the forward (two
** products), halved when causal; the backward 2.5 times the forward (five products). The
** composite gets the same count (it does the masked half too, which is its loss). Prints
** ms (best of the runs after a warm-up) and TFLOP/s; the backward's column is the best
** fwd+bwd less the best forward.
**
**   bench-attention [--device D] [B H T D [f32|bf16|f16 [causal 0|1 [reps]]]]
** Runs under KILN_FALLBACK=error: a kernel missing on the GPU is an error, not a CPU time.
*/
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <kiln.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench_args.h"

static int64_t B = 16, H = 12, T = 1024, D = 64;
static kiln_dtype dt = KILN_BF16;
static bool causal = true;
static int reps = 10;

static kiln_tensor *composite(kiln_tensor *q, kiln_tensor *k, kiln_tensor *v, kiln_tensor *neg) {
  kiln_tensor *s = kiln_mul_scalar(kiln_matmul(q, kiln_transpose(k, -1, -2)), 1.0 / sqrt((double)D));
  if (neg) s = kiln_add(s, neg);
  return kiln_matmul(kiln_softmax(s, -1), v);
}

static void die(const char *what) {
  fprintf(stderr, "bench-attention: %s: %s\n", what, kiln_last_error_message());
  exit(1);
}

/* Best ms over reps runs after one warm-up; fused or composite; with backward or not. */
static kiln_device dev;

static double time_ms(bool fused, bool backward) {
  kiln_device gpu = dev;
  kiln_scope_begin();
  kiln_generator *g = kiln_generator_new(1);
  kiln_tensor *q = kiln_to_dtype(kiln_randn(KILN_SHAPE(B, H, T, D), KILN_F32, gpu, g), dt);
  kiln_tensor *k = kiln_to_dtype(kiln_randn(KILN_SHAPE(B, H, T, D), KILN_F32, gpu, g), dt);
  kiln_tensor *v = kiln_to_dtype(kiln_randn(KILN_SHAPE(B, H, T, D), KILN_F32, gpu, g), dt);
  kiln_tensor *gy = kiln_to_dtype(kiln_randn(KILN_SHAPE(B, H, T, D), KILN_F32, gpu, g), dt);
  kiln_generator_free(g);
  kiln_tensor *neg = NULL;
  if (causal && !fused) neg = kiln_to_dtype(kiln_triu(kiln_full(KILN_SHAPE(T, T), -INFINITY, KILN_F32, gpu), 1), dt);
  kiln_tensor *leaves[3] = {q, k, v};
  if (backward)
    for (int i = 0; i < 3; i++) kiln_requires_grad_(leaves[i], true);
  double best = INFINITY;
  for (int r = 0; r <= reps; r++) {
    kiln_scope_begin();
    if (kiln_device_synchronize(gpu) != KILN_OK) die("synchronize");
    kiln_mark *m0 = kiln_mark_record(gpu);
    kiln_tensor *y = fused ? kiln_scaled_dot_product_attention(q, k, v, NULL, causal, 0, 0, NULL)
                           : composite(q, k, v, neg);
    if (!y) die(fused ? "fused forward" : "composite forward");
    if (backward) {
      kiln_tensor *gr[3] = {0};
      if (kiln_autograd_grad(1, &y, &gy, 3, leaves, gr) != KILN_OK) die("backward");
    }
    kiln_mark *m1 = kiln_mark_record(gpu);
    if (kiln_device_synchronize(gpu) != KILN_OK) die("synchronize");
    double ms = kiln_mark_elapsed_ms(m0, m1);
    if (r > 0 && ms < best) best = ms; /* run 0 warms the allocator and loads the modules */
    kiln_scope_end();
  }
  kiln_scope_end();
  return best;
}

int main(int argc, char **argv) {
  /* positional: B H T D (all four or none), then dtype, causal, reps */
  bench_args cli =
      bench_args_begin("bench-attention", "[--device D] [B H T D [f32|bf16|f16 [causal 0|1 [reps]]]]", argc, argv);
  dev = kiln_device_cuda(0);
  static const char *const pos[7] = {"B", "H", "T", "D", "dtype", "causal", "reps"};
  /* bounds that keep B H T D (and the T x T mask) inside int64 */
  static const long long hi[4] = {1 << 16, 1 << 10, 1 << 20, 1 << 10};
  int64_t *const dims[4] = {&B, &H, &T, &D};
  static const char *const dtype_names[] = {"f32", "bf16", "f16", NULL};
  static const kiln_dtype dtypes[] = {KILN_F32, KILN_BF16, KILN_F16};
  for (const char *a; (a = bench_args_next(&cli));) {
    if (!strcmp(a, "--device")) {
      bench_args_device(&cli, &dev);
      continue;
    }
    int np = bench_args_positional(&cli, 7);
    if (np < 4) *dims[np] = bench_args_parse_int(&cli, pos[np], a, 1, hi[np]);
    else if (np == 4) dt = dtypes[bench_args_parse_choice(&cli, pos[np], a, dtype_names)];
    else if (np == 5) causal = bench_args_parse_int(&cli, pos[np], a, 0, 1) != 0;
    else reps = (int)bench_args_parse_int(&cli, pos[np], a, 1, 1000000);
  }
  if (cli.npos > 0 && cli.npos < 4) bench_args_fail(&cli, "B H T D come together: got %d of the 4", cli.npos);
  const bool cpu = dev.type == KILN_DEVICE_CPU;
  if (dev.type == KILN_DEVICE_CUDA && kiln_device_count(KILN_DEVICE_CUDA) <= dev.index) {
    printf("bench-attention: no cuda device\n");
    return 77;
  }
  kiln_set_fallback_policy(KILN_FALLBACK_ERROR);
  double fwd_flop = 4.0 * (double)(B * H) * (double)T * (double)T * (double)D * (causal ? 0.5 : 1.0);
  char dname[64];
  kiln_device_str(dev, dname, sizeof dname);
  printf("attention on %s: B %lld H %lld T %lld D %lld %s%s, best of %d\n", dname, (long long)B, (long long)H,
         (long long)T, (long long)D, kiln_dtype_name(dt), causal ? " causal" : "", reps);
  printf("| path | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |\n"
         "|---|---|---|---|---|---|---|\n");
  static const char *const names[2][3] = {
      {"kiln fused (flash: cuda_flash.cu)", "kiln fused, KILN_CUDA_ATTENTION=simple", "composite (cuBLAS matmul + softmax)"},
      {"kiln fused (the CPU's choice)", "kiln fused, KILN_ATTENTION_VNNI=0", "composite (matmul + softmax)"}};
  const char *knob = cpu ? "KILN_ATTENTION_VNNI" : "KILN_CUDA_ATTENTION";
  for (int path = 0; path < 3; path++) {
    if (path == 1) setenv(knob, cpu ? "0" : "simple", 1);
    if (path == 2) unsetenv(knob);
    double f = time_ms(path < 2, false), fb = time_ms(path < 2, true);
    double bw = fb - f;
    printf("| %s | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", names[cpu][path], f, fwd_flop / f / 1e9, bw,
           bw > 0 ? 2.5 * fwd_flop / bw / 1e9 : 0.0, fb, 3.5 * fwd_flop / fb / 1e9);
  }
  return 0;
}
