/*
** cross_entropy on CUDA at a classifier head's sizes (issue 15: ResNet's (256, 1000)):
** skipped (exit 77) without a CUDA device.
**
** 1. Mean and per-row losses, and the logits' gradient (the mean's is fused into its
**    forward kernel), against the CPU for rows of a warp's width and past it: C 17 (a
**    tail shorter than the 4 loads a lane takes at once), 130, 1000; N 3 to 1000 (one
**    block, several blocks and the finishing warp); f32 and bf16; ignore_index and label
**    smoothing on one shape; long rows (C 3001 and 50257, a block a row); rows 16-byte
**    aligned: more rows than SMs with an ignored row and smoothing, f32 rows staged in
**    shared memory, and GPT-2's head (50257 classes in rows of 50304: a tail, and a
**    gradient whose rows are not aligned as the logits').
** 2. The same inputs twice on the device: the same bits (the blocks' partials are added
**    in a fixed order).
*/
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

typedef struct ce_case {
  int64_t N, C;
  kiln_reduction red;
  int64_t ignore;
  double ls;
  int64_t pad; /* the logits a view of the first C columns of (N, C + pad) */
} ce_case;

/* loss and dlogits of case k on dev for dtype dt (host values, malloc'd; NULL on failure) */
static bool ce_run(const ce_case *k, kiln_dtype dt, kiln_device dev, double **loss, int64_t *nl, double **grad,
                   int64_t *ng) {
  kiln_scope_begin();
  kiln_generator *gen = kiln_generator_new(1234 + (uint64_t)k->N * 7 + (uint64_t)k->C);
  kiln_tensor *x = kiln_to_dtype(
      kiln_mul_scalar(kiln_randn(KILN_SHAPE(k->N, k->C + k->pad), KILN_F32, kiln_device_cpu(), gen), 3.0), dt);
  int64_t *tv = malloc((size_t)k->N * sizeof(int64_t));
  for (int64_t n = 0; n < k->N; n++) tv[n] = (n * 37 + 11) % k->C;
  if (k->ignore >= 0 && k->N > 2) tv[1] = k->ignore; /* one ignored row */
  kiln_tensor *t = kiln_from_data(tv, 1, (const int64_t[]){k->N}, KILN_I64, kiln_device_cpu());
  free(tv);
  kiln_generator_free(gen);
  x = kiln_narrow(kiln_detach(kiln_to_device(x, dev)), 1, 0, k->C);
  t = kiln_to_device(t, dev);
  kiln_requires_grad_(x, true);
  kiln_tensor *l = kiln_cross_entropy(x, t, k->red, k->ignore >= 0 ? k->ignore : -100, k->ls);
  kiln_tensor *seed = l ? kiln_ones_like(l) : NULL, *gx = NULL;
  bool ok = l && seed && kiln_autograd_grad(1, &l, &seed, 1, &x, &gx) == KILN_OK && gx;
  H_CHECK(ok, "cross_entropy (%lld, %lld) %s on %s ran: %s", (long long)k->N, (long long)k->C, kiln_dtype_name(dt),
          dev.type == KILN_DEVICE_CUDA ? "cuda" : "cpu", kiln_last_error_message());
  if (ok) {
    *loss = h_values(l, nl);
    *grad = h_values(gx, ng);
  }
  kiln_scope_end();
  return ok;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  h_init(argc, argv, "test_cuda_cross_entropy");
  if (kiln_device_count(KILN_DEVICE_CUDA) == 0) {
    printf("test_cuda_cross_entropy: skipped (no CUDA device)\n");
    return 77;
  }
  static const ce_case cases[] = {
      {256, 1000, KILN_REDUCTION_MEAN, -1, 0.0, 0}, {3, 130, KILN_REDUCTION_MEAN, -1, 0.0, 0},
      {1000, 17, KILN_REDUCTION_MEAN, -1, 0.0, 0},  {64, 1000, KILN_REDUCTION_NONE, -1, 0.0, 0},
      {200, 130, KILN_REDUCTION_MEAN, 5, 0.1, 0},   {5000, 130, KILN_REDUCTION_MEAN, -1, 0.0, 0},
      /* long rows, a block a row: a language model's vocabulary (bf16 rows staged in shared
      ** memory for the fused gradient, f32 ones of 50257 read twice), odd C (rows at every
      ** offset within 16 bytes) */
      {40, 50257, KILN_REDUCTION_MEAN, -1, 0.0, 0}, {33, 3001, KILN_REDUCTION_MEAN, 7, 0.1, 0},
      {20, 50257, KILN_REDUCTION_NONE, -1, 0.0, 0},
      /* aligned rows: 300 of 50304, 150 of 8000 (f32 rows staged too), GPT-2's head */
      {300, 50304, KILN_REDUCTION_MEAN, 5, 0.1, 0}, {150, 8000, KILN_REDUCTION_NONE, -1, 0.0, 0},
      {150, 8000, KILN_REDUCTION_MEAN, 3, 0.0, 0}, {200, 50257, KILN_REDUCTION_MEAN, -1, 0.0, 47},
  };
  static const kiln_dtype dts[2] = {KILN_F32, KILN_BF16};
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
    for (int di = 0; di < 2; di++) {
      const ce_case *k = &cases[ci];
      double *lg = NULL, *gg = NULL, *lc = NULL, *gc = NULL, *lg2 = NULL, *gg2 = NULL;
      int64_t nlg = 0, ngg = 0, nlc = 0, ngc = 0, n2 = 0, m2 = 0;
      bool a = ce_run(k, dts[di], kiln_device_cuda(0), &lg, &nlg, &gg, &ngg);
      bool b = ce_run(k, dts[di], kiln_device_cpu(), &lc, &nlc, &gc, &ngc);
      bool c = ce_run(k, dts[di], kiln_device_cuda(0), &lg2, &n2, &gg2, &m2);
      char name[160];
      /* bf16 logits: the loss is f32 from the same rounded logits on both sides */
      double rt = dts[di] == KILN_F32 ? 1e-5 : 2e-2, at = dts[di] == KILN_F32 ? 1e-6 : 1e-3;
      if (a && b) {
        snprintf(name, sizeof name, "cross_entropy (%lld, %lld) %s %s loss: cuda vs cpu", (long long)k->N,
                 (long long)k->C, kiln_dtype_name(dts[di]), k->red == KILN_REDUCTION_MEAN ? "mean" : "none");
        H_CHECK(nlg == nlc, "%s: sizes %lld and %lld", name, (long long)nlg, (long long)nlc);
        if (nlg == nlc) h_close(name, lg, lc, nlg, rt, at);
        snprintf(name, sizeof name, "cross_entropy (%lld, %lld) %s %s dlogits: cuda vs cpu", (long long)k->N,
                 (long long)k->C, kiln_dtype_name(dts[di]), k->red == KILN_REDUCTION_MEAN ? "mean" : "none");
        if (ngg == ngc) h_close(name, gg, gc, ngg, rt, at);
      }
      if (a && c) {
        snprintf(name, sizeof name, "cross_entropy (%lld, %lld) %s twice on cuda: same bits", (long long)k->N,
                 (long long)k->C, kiln_dtype_name(dts[di]));
        h_close(name, lg, lg2, nlg, 0, 0);
        h_close(name, gg, gg2, ngg, 0, 0);
      }
      free(lg), free(gg), free(lc), free(gc), free(lg2), free(gg2);
    }
  return h_finish();
}
