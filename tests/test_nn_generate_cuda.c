/* Generation on CUDA device 0 (label gpu; skipped, 77, without a working device): the
** per-token step recorded as a CUDA graph (KILN_GEN_GRAPH_AUTO) gives the same tokens as
** the eager step (KILN_GEN_GRAPH_OFF), greedy and seeded sampling alike, in f32 and under
** bf16 autocast; greedy f32 tokens equal the CPU's; the cached forward's logits equal the
** full forward's on the device; transformers' greedy tokens on the hf_gpt2 fixture, graph
** on and off, to the end of its context. */
#include <kiln.h>
#include <kiln_io.h>
#include <kiln_nn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

static bool ids_equal(kiln_tensor *a, kiln_tensor *b) {
  if (!a || !b || kiln_numel(a) != kiln_numel(b)) return false;
  kiln_scope_begin();
  size_t n = (size_t)kiln_numel(a) * 8;
  int64_t *x = malloc(n), *y = malloc(n);
  kiln_to_host(kiln_contiguous(kiln_to_dtype(a, KILN_I64)), x, n);
  kiln_to_host(kiln_contiguous(kiln_to_dtype(b, KILN_I64)), y, n);
  bool eq = memcmp(x, y, n) == 0;
  free(x);
  free(y);
  kiln_scope_end();
  return eq;
}

static kiln_module *model(kiln_device dev) {
  kiln_gpt_config c = kiln_gpt2_config();
  c.n_layer = 3, c.n_head = 4, c.n_embd = 128, c.vocab_size = 300, c.block_size = 96;
  kiln_generator *g = kiln_generator_new(1);
  kiln_module *m = kiln_gpt_new(&c, KILN_F32, kiln_device_cpu(), g);
  kiln_generator_free(g);
  kiln_scope_begin();
  bool prev = kiln_set_grad_enabled(false);
  kiln_tensor *ps[128];
  int np = m ? kiln_module_parameters(m, ps, 128) : 0;
  for (int i = 0; i < np && i < 128; i++) /* margins for greedy comparisons */
    if (kiln_ndim(ps[i]) == 2) kiln_mul_scalar_(ps[i], 4.0);
  kiln_set_grad_enabled(prev);
  kiln_scope_end();
  if (m) kiln_module_eval(m);
  if (m && dev.type != KILN_DEVICE_CPU && kiln_module_to(m, dev) != KILN_OK) {
    kiln_module_free(m);
    return NULL;
  }
  return m;
}

/* transformers' greedy generate (tests/fixtures/hf_gpt2, scripts' fixture) on the device. */
static void hf_parity(kiln_device dev) {
  const char *src = getenv("KILN_SOURCE_DIR");
  char dir[4096], path[4200];
  snprintf(dir, sizeof dir, "%s/tests/fixtures/hf_gpt2", src ? src : ".");
  snprintf(path, sizeof path, "%s/generate.safetensors", dir);
  FILE *f = fopen(path, "rb");
  if (!f) { /* a copy of the tree without the binary fixtures (test_nn_generate checks them on the CPU) */
    printf("hf_gpt2 fixture not found (%s): transformers parity on cuda skipped\n", path);
    return;
  }
  fclose(f);
  kiln_dict *ref = kiln_safetensors_load(path, dev);
  kiln_module *m = ref ? kiln_gpt_from_hf(dir, NULL, KILN_F32, dev) : NULL;
  CHECK(ref && m);
  for (int i = 0; m && i < 2; i++) {
    kiln_scope_begin();
    kiln_module_eval(m);
    kiln_sample_opts o = kiln_sample_opts_default();
    o.greedy = true;
    o.graph = i ? KILN_GEN_GRAPH_ON : KILN_GEN_GRAPH_OFF;
    kiln_tensor *out = kiln_gpt_generate(m, kiln_dict_get(ref, "prompt"), 20, &o, NULL);
    CHECK(ids_equal(out, kiln_dict_get(ref, "out")));
    kiln_tensor *lp = kiln_narrow(kiln_dict_get(ref, "out_long"), 1, 0, 4);
    kiln_tensor *lng = kiln_gpt_generate(m, lp, 28, &o, NULL); /* to the full context, 32 */
    CHECK(ids_equal(lng, kiln_dict_get(ref, "out_long")));
    kiln_scope_end();
  }
  kiln_module_free(m);
  kiln_dict_free(ref);
}

int main(void) {
  const char *why = NULL;
  if (!kiln_backend_available(KILN_DEVICE_CUDA, &why) || kiln_device_count(KILN_DEVICE_CUDA) < 1) {
    printf("skipped: no CUDA device (%s)\n", why ? why : "none");
    return 77;
  }
  kiln_device cuda = kiln_device_cuda(0), cpu = kiln_device_cpu();
  kiln_module *mc = model(cpu), *mg = model(cuda);
  CHECK(mc && mg);
  kiln_scope_begin();
  kiln_generator *g0 = kiln_generator_new(3);
  kiln_tensor *ids_cpu = kiln_randint(0, 300, KILN_SHAPE(4, 7), KILN_I64, cpu, g0);
  kiln_generator_free(g0);
  kiln_tensor *ids = kiln_to_device(ids_cpu, cuda);

  /* cached vs full logits on the device */
  kiln_tensor *full = kiln_module_forward(mg, ids);
  kiln_kv_cache *c = kiln_kv_cache_new(mg, 4, 7);
  kiln_tensor *a = kiln_gpt_forward_cached(mg, kiln_narrow(ids, 1, 0, 4), c);
  kiln_tensor *b = kiln_gpt_forward_cached(mg, kiln_narrow(ids, 1, 4, 3), c);
  kiln_tensor *d = kiln_amax(kiln_abs(kiln_sub(full, kiln_cat(2, (kiln_tensor *[]){a, b}, 1))), 0, NULL, false);
  double dv = d ? kiln_item(d) : INFINITY;
  printf("cached vs full logits on cuda: max diff %g\n", dv);
  CHECK(dv < 1e-3); /* TF32 off by default: f32 rounding of logits of size ~10 */
  kiln_kv_cache_free(c);

  kiln_sample_opts o = kiln_sample_opts_default();
  o.greedy = true;
  o.graph = KILN_GEN_GRAPH_OFF;
  kiln_tensor *eager = kiln_gpt_generate(mg, ids, 80, &o, NULL);
  o.graph = KILN_GEN_GRAPH_AUTO; /* a CUDA graph on this device */
  kiln_tensor *graph = kiln_gpt_generate(mg, ids, 80, &o, NULL);
  kiln_tensor *host = kiln_gpt_generate(mc, ids_cpu, 80, &o, NULL);
  CHECK(eager && kiln_size(eager, 1) == 87);
  CHECK(ids_equal(eager, graph));
  CHECK(ids_equal(eager, host));

  o = kiln_sample_opts_default();
  o.temperature = 0.9, o.top_k = 50, o.top_p = 0.9;
  kiln_tensor *r[2];
  for (int i = 0; i < 2; i++) {
    o.graph = i ? KILN_GEN_GRAPH_ON : KILN_GEN_GRAPH_OFF;
    kiln_generator *g = kiln_generator_new(42);
    r[i] = kiln_gpt_generate(mg, ids, 80, &o, g);
    if (!r[i]) printf("sampled generation (%s) failed: %s\n", i ? "graph" : "eager", kiln_last_error_message());
    kiln_generator_free(g);
  }
  CHECK(r[0] && r[1] && ids_equal(r[0], r[1]));

  /* bf16 autocast: graph and eager agree with each other */
  kiln_autocast_begin(KILN_DEVICE_CUDA, KILN_BF16);
  o = kiln_sample_opts_default();
  o.greedy = true;
  o.graph = KILN_GEN_GRAPH_OFF;
  kiln_tensor *e16 = kiln_gpt_generate(mg, ids, 80, &o, NULL);
  o.graph = KILN_GEN_GRAPH_ON;
  kiln_tensor *g16 = kiln_gpt_generate(mg, ids, 80, &o, NULL);
  kiln_autocast_end();
  CHECK(e16 && ids_equal(e16, g16));
  kiln_scope_end();
  kiln_module_free(mc);
  kiln_module_free(mg);
  hf_parity(cuda);
  printf("%d failures\n", failures);
  return failures ? 1 : 0;
}
