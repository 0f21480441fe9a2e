/* Hugging Face GPT-2 interop on the CPU (kiln_gpt_from_hf, kiln_gpt_load_hf,
** kiln_gpt_save_hf): the logits of a tiny random GPT-2 that transformers saved match
** transformers' own logits (scripts/make_hf_gpt2_fixture.py, tests/fixtures/hf_gpt2/);
** saving back gives HF's names, shapes and values and reloads to the same logits; names
** without "transformer.", the tied lm_head and HF's buffers are accepted; a checkpoint of
** another size, an untied head, a config kiln's GPT is not, are refused with errors that
** name the problem, and a refused load changes nothing. */
#define _GNU_SOURCE /* mkdtemp */
#include <kiln.h>
#include <kiln_io.h>
#include <kiln_nn.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "tensor_cmp.h"
#include "scratch.h"

static kiln_device cpu;
static char fix[4096];

static bool same_shape(kiln_tensor *a, kiln_tensor *b) {
  if (!a || !b || kiln_ndim(a) != kiln_ndim(b)) return false;
  for (int i = 0; i < kiln_ndim(a); i++)
    if (kiln_size(a, i) != kiln_size(b, i)) return false;
  return true;
}

static bool msg_has(const char *s) { return strstr(kiln_last_error_message(), s) != NULL; }

static kiln_tensor *logits_of(kiln_module *m, kiln_tensor *ids) {
  if (!m) return NULL;
  kiln_module_eval(m);
  return kiln_module_forward(m, ids);
}

static kiln_gpt_config fixture_cfg(void) {
  kiln_gpt_config c = kiln_gpt2_config();
  c.n_layer = 2, c.n_head = 2, c.n_embd = 32, c.vocab_size = 100, c.block_size = 32;
  return c;
}

/* The logits of the loaded model against transformers' (f32 both; the difference is
** summation order: a few ulps of logits of size ~2). */
static void test_parity(kiln_dict *ref) {
  kiln_scope_begin();
  kiln_tensor *ids = kiln_dict_get(ref, "ids"), *want = kiln_dict_get(ref, "logits");
  kiln_module *m = kiln_gpt_from_hf(fix, NULL, KILN_F32, cpu);
  CHECK(m != NULL);
  const kiln_gpt_config *c = kiln_gpt_config_of(m);
  CHECK(c && c->n_layer == 2 && c->n_head == 2 && c->n_embd == 32 && c->vocab_size == 100 && c->block_size == 32);
  kiln_tensor *got = logits_of(m, ids);
  double d = max_abs_diff(got, want);
  printf("parity: max |kiln - transformers| logits = %.3g (bound 1e-4)\n", d);
  CHECK(d < 1e-4);
  /* The .safetensors file itself (config.json beside it) gives the same model. */
  char file[4200];
  snprintf(file, sizeof file, "%s/model.safetensors", fix);
  kiln_module *m2 = kiln_gpt_from_hf(file, NULL, KILN_F32, cpu);
  CHECK(bits_equal(logits_of(m2, ids), got));
  /* f64: the same weights, closer still to transformers' f32 (its own rounding dominates). */
  kiln_module *m64 = kiln_gpt_from_hf(fix, NULL, KILN_F64, cpu);
  double d64 = max_abs_diff(logits_of(m64, ids), want);
  printf("parity f64: max |kiln - transformers| logits = %.3g\n", d64);
  CHECK(d64 < 1e-4);
  kiln_module_free(m);
  kiln_module_free(m2);
  kiln_module_free(m64);
  kiln_scope_end();
}

/* Save back: HF's names and shapes, the file's values bit for bit, a config.json that
** kiln_gpt_from_hf reads, and the same logits. */
static void test_save_roundtrip(kiln_dict *ref, kiln_dict *hf) {
  char dir[256], out[300], file[400];
  if (scratch_begin(dir, sizeof dir, "gpt_hf") != 0) {
    failures++;
    return;
  }
  kiln_scope_begin();
  kiln_tensor *ids = kiln_dict_get(ref, "ids");
  kiln_module *m = kiln_gpt_from_hf(fix, NULL, KILN_F32, cpu);
  snprintf(out, sizeof out, "%s/out", dir);
  CHECK(kiln_gpt_save_hf(m, out) == KILN_OK);
  snprintf(file, sizeof file, "%s/model.safetensors", out);
  kiln_dict *back = kiln_safetensors_load(file, cpu);
  CHECK(back != NULL);
  CHECK(kiln_dict_size(back) == kiln_dict_size(hf));
  for (int i = 0; i < kiln_dict_size(hf); i++) {
    const char *k = kiln_dict_key(hf, i);
    kiln_tensor *a = kiln_dict_get(back, k), *b = kiln_dict_value(hf, i);
    if (!same_shape(a, b) || !bits_equal(a, b)) {
      fprintf(stderr, "saved entry %s differs from the HF file's\n", k);
      failures++;
    }
  }
  CHECK(back && kiln_dict_get_meta(back, "format") && strcmp(kiln_dict_get_meta(back, "format"), "pt") == 0);
  kiln_module *r = kiln_gpt_from_hf(out, NULL, KILN_F32, cpu);
  CHECK(r != NULL);
  CHECK(bits_equal(logits_of(r, ids), logits_of(m, ids)));
  /* A directory that cannot be made. */
  snprintf(out, sizeof out, "%s/no/such/dir", dir);
  CHECK(kiln_gpt_save_hf(m, out) == KILN_ERR_IO && msg_has(out));
  kiln_dict_free(back);
  kiln_module_free(m);
  kiln_module_free(r);
  kiln_scope_end();
  scratch_end(dir);
}

/* GPT2Model's names (no prefix), the tied lm_head and HF's attention buffers load too. */
static void test_variants(kiln_dict *ref, kiln_dict *hf) {
  kiln_scope_begin();
  kiln_tensor *ids = kiln_dict_get(ref, "ids");
  kiln_dict *bare = kiln_dict_new();
  for (int i = 0; i < kiln_dict_size(hf); i++)
    kiln_dict_set(bare, kiln_dict_key(hf, i) + strlen("transformer."), kiln_dict_value(hf, i));
  kiln_dict_set(bare, "lm_head.weight", kiln_clone(kiln_dict_get(hf, "transformer.wte.weight")));
  kiln_dict_set(bare, "h.0.attn.bias", kiln_ones(KILN_SHAPE(1, 1, 32, 32), KILN_F32, cpu));
  kiln_dict_set(bare, "h.0.attn.masked_bias", kiln_full(KILN_SHAPE0, -1e4, KILN_F32, cpu));
  kiln_gpt_config c = fixture_cfg();
  kiln_module *m = kiln_gpt_new(&c, KILN_F32, cpu, NULL);
  CHECK(kiln_gpt_load_hf(m, bare) == KILN_OK);
  /* a head of another dtype holding wte's values is tied too; one value off is not */
  kiln_dict *wide = kiln_dict_new();
  for (int i = 0; i < kiln_dict_size(bare); i++) kiln_dict_set(wide, kiln_dict_key(bare, i), kiln_dict_value(bare, i));
  kiln_tensor *head64 = kiln_to_dtype(kiln_dict_get(hf, "transformer.wte.weight"), KILN_F64);
  kiln_dict_set(wide, "lm_head.weight", head64);
  CHECK(kiln_gpt_load_hf(m, wide) == KILN_OK);
  bool grad = kiln_set_grad_enabled(false);
  CHECK(kiln_fill_(kiln_narrow(kiln_narrow(head64, 0, 7, 1), 1, 3, 1), 0.5) == KILN_OK);
  kiln_set_grad_enabled(grad);
  CHECK(kiln_gpt_load_hf(m, wide) == KILN_ERR_FORMAT && msg_has("untied"));
  kiln_dict_free(wide);
  kiln_module *ref_m = kiln_gpt_from_hf(fix, NULL, KILN_F32, cpu);
  CHECK(bits_equal(logits_of(m, ids), logits_of(ref_m, ids)));
  /* The same entries in a file, which kiln_gpt_from_hf reads a tensor at a time: the same
  ** model, nothing left alive after it; an untied head there is refused as in a dict. */
  char dir[256], file[300];
  if (scratch_begin(dir, sizeof dir, "hfv") == 0) {
    snprintf(file, sizeof file, "%s/bare.safetensors", dir);
    CHECK(kiln_safetensors_save(file, bare) == KILN_OK);
    kiln_module *fm = kiln_gpt_from_hf(file, &c, KILN_F32, cpu);
    CHECK(fm && bits_equal(logits_of(fm, ids), logits_of(ref_m, ids)));
    int64_t live = kiln_live_tensors();
    kiln_module_free(kiln_gpt_from_hf(file, &c, KILN_F32, cpu));
    CHECK(kiln_live_tensors() == live);
    kiln_dict *untied = kiln_dict_new();
    for (int i = 0; i < kiln_dict_size(bare); i++) kiln_dict_set(untied, kiln_dict_key(bare, i), kiln_dict_value(bare, i));
    kiln_dict_set(untied, "lm_head.weight", kiln_randn(KILN_SHAPE(100, 32), KILN_F32, cpu, NULL));
    CHECK(kiln_safetensors_save(file, untied) == KILN_OK);
    live = kiln_live_tensors();
    CHECK(kiln_gpt_from_hf(file, &c, KILN_F32, cpu) == NULL && kiln_last_error() == KILN_ERR_FORMAT &&
          msg_has("bare.safetensors") && msg_has("untied"));
    CHECK(kiln_live_tensors() == live);
    kiln_dict_free(untied);
    kiln_module_free(fm);
    scratch_end(dir);
  }
  /* An f16 file loads into an f32 model (converted). */
  kiln_dict *half = kiln_dict_new();
  for (int i = 0; i < kiln_dict_size(hf); i++)
    kiln_dict_set(half, kiln_dict_key(hf, i), kiln_to_dtype(kiln_dict_value(hf, i), KILN_F16));
  CHECK(kiln_gpt_load_hf(m, half) == KILN_OK);
  double d = max_abs_diff(logits_of(m, ids), logits_of(ref_m, ids));
  CHECK(d > 0 && d < 0.05);
  kiln_dict_free(half);
  kiln_dict_free(bare);
  kiln_module_free(m);
  kiln_module_free(ref_m);
  kiln_scope_end();
}

/* Checkpoints of another size and other bad input: the error names the key, both shapes
** or both sizes; the model keeps its values. */
/* Writes text to dir/name. */
static void put_text(const char *dir, const char *name, const char *text) {
  char p[600];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  FILE *f = fopen(p, "wb");
  if (f) {
    fputs(text, f);
    fclose(f);
  }
}

/* A sharded checkpoint (model.safetensors.index.json and two shards, as save_pretrained
** writes a large model): the same model as the single file; an index that puts a tensor
** in the wrong shard, names a path instead of a file, or two shards holding one tensor are
** refused by name. */
static void test_sharded(kiln_dict *ref, kiln_dict *hf) {
  char dir[256], cfg[4200];
  if (scratch_begin(dir, sizeof dir, "gpt_hf_shards") != 0) {
    CHECK(0);
    return;
  }
  snprintf(cfg, sizeof cfg, "%s/config.json", fix);
  FILE *f = fopen(cfg, "rb");
  char text[4096] = {0};
  size_t n = f ? fread(text, 1, sizeof text - 1, f) : 0;
  if (f) fclose(f);
  CHECK(n > 0);
  put_text(dir, "config.json", text);
  kiln_dict *a = kiln_dict_new(), *b = kiln_dict_new();
  char *map = malloc(65536);
  size_t len = (size_t)snprintf(map, 65536, "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {");
  const int N = kiln_dict_size(hf);
  for (int i = 0; i < N; i++) {
    kiln_dict_set(i < N / 2 ? a : b, kiln_dict_key(hf, i), kiln_dict_value(hf, i));
    len += (size_t)snprintf(map + len, 65536 - len, "%s\"%s\": \"model-0000%d-of-00002.safetensors\"", i ? ", " : "",
                            kiln_dict_key(hf, i), i < N / 2 ? 1 : 2);
  }
  snprintf(map + len, 65536 - len, "}}");
  char path[600];
  snprintf(path, sizeof path, "%s/model-00001-of-00002.safetensors", dir);
  CHECK(kiln_safetensors_save(path, a) == KILN_OK);
  snprintf(path, sizeof path, "%s/model-00002-of-00002.safetensors", dir);
  CHECK(kiln_safetensors_save(path, b) == KILN_OK);
  put_text(dir, "model.safetensors.index.json", map);
  kiln_scope_begin();
  kiln_tensor *ids = kiln_dict_get(ref, "ids");
  kiln_module *m = kiln_gpt_from_hf(dir, NULL, KILN_F32, cpu), *one = kiln_gpt_from_hf(fix, NULL, KILN_F32, cpu);
  CHECK(m && one && bits_equal(logits_of(m, ids), logits_of(one, ids)));
  kiln_module_free(m);
  /* the index given by its path: the same model (its config.json from the fixture) */
  char ixp[600];
  snprintf(ixp, sizeof ixp, "%s/model.safetensors.index.json", dir);
  kiln_gpt_config fc = fixture_cfg();
  m = kiln_gpt_from_hf(ixp, &fc, KILN_F32, cpu);
  CHECK(m && bits_equal(logits_of(m, ids), logits_of(one, ids)));
  kiln_module_free(m);
  kiln_module_free(one);
  kiln_scope_end();
  /* the wrong shard for the first tensor: the index names the tensor and the file */
  char *bad = strdup(map), *first = strstr(bad, "model-00001");
  first[10] = '2';
  put_text(dir, "model.safetensors.index.json", bad);
  CHECK(kiln_gpt_from_hf(dir, NULL, KILN_F32, cpu) == NULL && kiln_last_error() == KILN_ERR_FORMAT &&
        msg_has(kiln_dict_key(hf, 0)) && msg_has("which does not hold it") && msg_has("index.json"));
  free(bad);
  bad = strdup(map);
  first = strstr(bad, "model-00001");
  memcpy(first, "../../x", 7);
  put_text(dir, "model.safetensors.index.json", bad);
  CHECK(kiln_gpt_from_hf(dir, NULL, KILN_F32, cpu) == NULL && kiln_last_error() == KILN_ERR_FORMAT &&
        msg_has("is not a file name in the directory"));
  free(bad);
  /* a tensor in both shards */
  kiln_dict_set(b, kiln_dict_key(hf, 0), kiln_dict_value(hf, 0));
  CHECK(kiln_safetensors_save(path, b) == KILN_OK);
  put_text(dir, "model.safetensors.index.json", map);
  CHECK(kiln_gpt_from_hf(dir, NULL, KILN_F32, cpu) == NULL && kiln_last_error() == KILN_ERR_FORMAT &&
        msg_has("which an earlier shard holds too"));
  put_text(dir, "model.safetensors.index.json", "{\"weight_map\": {}, \"weight_map\": {}}");
  CHECK(kiln_gpt_from_hf(dir, NULL, KILN_F32, cpu) == NULL && kiln_last_error() == KILN_ERR_FORMAT &&
        msg_has("\"weight_map\" twice"));
  put_text(dir, "model.safetensors.index.json", "{\"metadata\": {}}");
  CHECK(kiln_gpt_from_hf(dir, NULL, KILN_F32, cpu) == NULL && kiln_last_error() == KILN_ERR_FORMAT &&
        msg_has("no \"weight_map\""));
  snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
  remove(path);
  CHECK(kiln_gpt_from_hf(dir, NULL, KILN_F32, cpu) == NULL && kiln_last_error() == KILN_ERR_IO &&
        msg_has("neither model.safetensors nor model.safetensors.index.json"));
  free(map);
  kiln_dict_free(a);
  kiln_dict_free(b);
  scratch_end(dir);
}

static void test_bad_input(kiln_dict *hf) {
  kiln_scope_begin();
  kiln_gpt_config c = fixture_cfg();
  /* Wider model: every entry mismatches; the message names wte and both shapes. */
  c.n_embd = 64;
  kiln_module *wide = kiln_gpt_new(&c, KILN_F32, cpu, NULL);
  kiln_tensor *before = kiln_clone(kiln_module_param(wide, "wte.weight"));
  CHECK(kiln_gpt_load_hf(wide, hf) == KILN_ERR_SHAPE);
  printf("another width: %s\n", kiln_last_error_message());
  CHECK(msg_has("transformer.wte.weight has shape [100, 32] in the file; the model expects [100, 64]"));
  CHECK(msg_has("the file: n_layer 2, n_embd 32, vocab_size 100, n_positions 32"));
  CHECK(msg_has("the model: n_layer 2, n_embd 64"));
  /* Conv1D shapes are said in HF's (in, out) terms. */
  CHECK(msg_has("transformer.h.0.attn.c_attn.weight has shape [32, 96] in the file; the model expects [64, 192]"));
  CHECK(bits_equal(kiln_module_param(wide, "wte.weight"), before));
  kiln_module_free(wide);
  /* More layers in the model: missing keys. */
  c = fixture_cfg();
  c.n_layer = 3;
  kiln_module *deep = kiln_gpt_new(&c, KILN_F32, cpu, NULL);
  CHECK(kiln_gpt_load_hf(deep, hf) == KILN_ERR_FORMAT);
  printf("more layers: %s\n", kiln_last_error_message());
  CHECK(msg_has("missing key") && msg_has("transformer.h.2.ln_1.weight") && msg_has("the model: n_layer 3"));
  kiln_module_free(deep);
  /* Fewer layers in the model: unexpected keys. */
  c.n_layer = 1;
  kiln_module *shallow = kiln_gpt_new(&c, KILN_F32, cpu, NULL);
  CHECK(kiln_gpt_load_hf(shallow, hf) == KILN_ERR_FORMAT);
  printf("fewer layers: %s\n", kiln_last_error_message());
  CHECK(msg_has("unexpected key") && msg_has("transformer.h.1.") && msg_has("the file: n_layer 2"));
  kiln_module_free(shallow);
  /* A larger vocabulary in the model (config given by the caller): SHAPE, the file named. */
  c = fixture_cfg();
  c.vocab_size = 200;
  CHECK(kiln_gpt_from_hf(fix, &c, KILN_F32, cpu) == NULL && kiln_last_error() == KILN_ERR_SHAPE);
  CHECK(msg_has("model.safetensors") && msg_has("[100, 32] in the file; the model expects [200, 32]"));
  /* An untied head; a missing key; not a GPT state dict; not a GPT module. */
  c = fixture_cfg();
  kiln_module *m = kiln_gpt_new(&c, KILN_F32, cpu, NULL);
  before = kiln_clone(kiln_module_param(m, "h.0.attn.c_attn.weight"));
  kiln_dict *d = kiln_dict_new();
  for (int i = 0; i < kiln_dict_size(hf); i++) kiln_dict_set(d, kiln_dict_key(hf, i), kiln_dict_value(hf, i));
  kiln_dict_set(d, "lm_head.weight", kiln_randn(KILN_SHAPE(100, 32), KILN_F32, cpu, NULL));
  CHECK(kiln_gpt_load_hf(m, d) == KILN_ERR_FORMAT && msg_has("lm_head.weight differs") && msg_has("untied"));
  CHECK(bits_equal(kiln_module_param(m, "h.0.attn.c_attn.weight"), before));
  kiln_dict_free(d);
  d = kiln_dict_new();
  for (int i = 0; i < kiln_dict_size(hf); i++)
    if (strcmp(kiln_dict_key(hf, i), "transformer.ln_f.bias") != 0)
      kiln_dict_set(d, kiln_dict_key(hf, i), kiln_dict_value(hf, i));
  CHECK(kiln_gpt_load_hf(m, d) == KILN_ERR_FORMAT && msg_has("1 missing key: transformer.ln_f.bias"));
  kiln_dict_free(d);
  d = kiln_dict_new();
  kiln_dict_set(d, "fc1.weight", kiln_zeros(KILN_SHAPE(2, 2), KILN_F32, cpu));
  CHECK(kiln_gpt_load_hf(m, d) == KILN_ERR_FORMAT && msg_has("not a Hugging Face GPT-2"));
  kiln_dict_free(d);
  kiln_module *lin = kiln_linear_new(2, 2, true, KILN_F32, cpu, NULL);
  CHECK(kiln_gpt_load_hf(lin, hf) == KILN_ERR_INVALID_ARGUMENT && msg_has("not a GPT"));
  CHECK(kiln_gpt_hf_state_dict(lin) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_gpt_load_hf(m, NULL) == KILN_ERR_INVALID_ARGUMENT);
  kiln_module_free(lin);
  kiln_module_free(m);
  kiln_scope_end();
}

static kiln_status config_text(const char *dir, const char *text, kiln_gpt_config *c) {
  char path[400];
  snprintf(path, sizeof path, "%s/config.json", dir);
  FILE *f = fopen(path, "wb");
  fputs(text, f);
  fclose(f);
  return kiln_gpt_hf_config(path, c);
}

/* config.json: nested members skipped, the sizes read; GPT-2s kiln's GPT is not refused. */
static void test_config(void) {
  char dir[256];
  if (scratch_begin(dir, sizeof dir, "gpt_hf_cfg") != 0) {
    failures++;
    return;
  }
  kiln_gpt_config c;
  CHECK(config_text(dir, "{\"task_specific_params\": {\"n_layer\": 9, \"x\": [1, {\"n_head\": 7}]},"
                         " \"n_layer\": 3, \"n_head\": 4, \"n_embd\": 64, \"vocab_size\": 50,"
                         " \"n_positions\": 16, \"n_inner\": null, \"resid_pdrop\": 0.1,"
                         " \"embd_pdrop\": 0.1, \"attn_pdrop\": 0.1, \"name\": \"a \\\"q\\\" }\"}",
                    &c) == KILN_OK);
  CHECK(c.n_layer == 3 && c.n_head == 4 && c.n_embd == 64 && c.vocab_size == 50 && c.block_size == 16 &&
        c.dropout == 0.1 && c.bias);
  CHECK(config_text(dir, "{\"n_layer\": 3, \"n_embd\": 64, \"vocab_size\": 50, \"n_positions\": 16}", &c) ==
            KILN_ERR_FORMAT && msg_has("has no n_head"));
  CHECK(config_text(dir, "{\"n_layer\": 1, \"n_head\": 1, \"n_embd\": 8, \"vocab_size\": 5, \"n_positions\": 4,"
                         " \"activation_function\": \"relu\"}", &c) == KILN_ERR_FORMAT && msg_has("\"relu\""));
  CHECK(config_text(dir, "{\"n_layer\": 1, \"n_head\": 1, \"n_embd\": 8, \"vocab_size\": 5, \"n_positions\": 4,"
                         " \"layer_norm_epsilon\": 1e-6}", &c) == KILN_ERR_FORMAT && msg_has("layer_norm_epsilon"));
  CHECK(config_text(dir, "{\"n_layer\": 1, \"n_head\": 1, \"n_embd\": 8, \"vocab_size\": 5, \"n_positions\": 4,"
                         " \"tie_word_embeddings\": false}", &c) == KILN_ERR_FORMAT && msg_has("untied"));
  CHECK(config_text(dir, "{\"model_type\": \"llama\"}", &c) == KILN_ERR_FORMAT && msg_has("llama"));
  /* sizes kiln_gpt_new would refuse (or a cast could not hold) are named here, and a
  ** refused file leaves the config alone; an absent dropout rate is transformers' 0.1 */
  static const struct {
    const char *sizes, *msg;
  } bad_sizes[] = {
      {"\"n_layer\": 2, \"n_head\": 11, \"n_embd\": 768", "n_embd 768, not a multiple of n_head 11"},
      {"\"n_layer\": 2.5, \"n_head\": 2, \"n_embd\": 8", "n_layer 2.5; a size is a whole number"},
      {"\"n_layer\": 1e30, \"n_head\": 2, \"n_embd\": 8", "n_layer 1e+30"},
      {"\"n_layer\": 2, \"n_head\": 0, \"n_embd\": 8", "n_head 0"},
      {"\"n_layer\": -3, \"n_head\": 2, \"n_embd\": 8", "n_layer -3"},
      {"\"n_layer\": 2, \"n_head\": 2, \"n_embd\": 2147483648", "n_embd 2.14748e+09"},
      {"\"n_layer\": nan, \"n_head\": 2, \"n_embd\": 8", "byte 12: expected a number, found 'n'"},
      {"\"n_layer\": inf, \"n_head\": 2, \"n_embd\": 8", "byte 12: expected a number, found 'i'"},
      {"\"n_layer\": 0x10, \"n_head\": 2, \"n_embd\": 8", "byte 13: expected ',', found 'x'"},
      {"\"n_layer\": 2, \"n_head\": 2, \"n_embd\": 8, \"resid_pdrop\": 1.5", "resid_pdrop 1.5; a dropout rate is in [0, 1)"},
      {"\"n_layer\": 2, \"n_head\": 2, \"n_embd\": 8, \"attn_pdrop\": -0.1", "attn_pdrop -0.1"},
  };
  for (size_t i = 0; i < sizeof bad_sizes / sizeof bad_sizes[0]; i++) {
    char text[300];
    snprintf(text, sizeof text, "{%s, \"vocab_size\": 5, \"n_positions\": 4}", bad_sizes[i].sizes);
    kiln_gpt_config keep = fixture_cfg(), got = keep;
    kiln_status st = config_text(dir, text, &got);
    if (st != KILN_ERR_FORMAT || !msg_has(bad_sizes[i].msg))
      fprintf(stderr, "  %s: %s \"%s\", want \"%s\"\n", text, kiln_error_name(st), kiln_last_error_message(),
              bad_sizes[i].msg);
    CHECK(st == KILN_ERR_FORMAT && msg_has(bad_sizes[i].msg) && !memcmp(&got, &keep, sizeof got));
  }
  CHECK(config_text(dir, "{\"n_layer\": 2, \"n_head\": 2, \"n_embd\": 8.0, \"vocab_size\": 5E0, \"n_positions\": 4}",
                    &c) == KILN_OK &&
        c.n_embd == 8 && c.vocab_size == 5 && c.dropout == 0.1);
  /* names are JSON strings: escapes decoded (as Python's json reads them), a \u0000 kept */
  CHECK(config_text(dir, "{\"\\u006e_layer\": 3, \"n_head\": 2, \"n_embd\": 8, \"vocab_size\": 5, \"n_positions\": 4,"
                         " \"n_layer\\u0000x\": 7}", &c) == KILN_OK && c.n_layer == 3);
  CHECK(config_text(dir, "{\"n_layer\" 3}", &c) == KILN_ERR_FORMAT && msg_has("config.json:1: byte 11: expected ':', found '3'"));
  CHECK(config_text(dir, "[1, 2]", &c) == KILN_ERR_FORMAT);
  CHECK(config_text(dir, "{\"n_layer\": 3, ", &c) == KILN_ERR_FORMAT);
  /* what is skipped is JSON too: not a bare word, a bracket that does not match, or text after */
  CHECK(config_text(dir, "{\"eos_token_id\": 50256`, \"n_layer\": 3}", &c) == KILN_ERR_FORMAT &&
        msg_has(":1: byte 22: expected ',', found '`'"));
  CHECK(config_text(dir, "{\"x\": maybe}", &c) == KILN_ERR_FORMAT && msg_has(":1: byte 6: expected a value, found 'm'"));
  CHECK(config_text(dir, "{\"x\": [1, {\"y\": 2]]}", &c) == KILN_ERR_FORMAT && msg_has(":1: byte 17: expected ',', found ']'"));
  char deep[512] = "{\"x\": ";
  for (int k = 0; k < 2; k++) { /* values nested 129 deep are read, 200 refused */
    const int levels = k ? 200 : 129;
    memset(deep + 6, '[', (size_t)levels);
    memset(deep + 6 + levels, ']', (size_t)levels);
    snprintf(deep + 6 + 2 * levels, sizeof deep - 6 - 2 * (size_t)levels, ", \"n_layer\": 3}");
    CHECK(config_text(dir, deep, &c) == KILN_ERR_FORMAT && msg_has(k ? "nested deeper than 128" : "has no n_head"));
  }
  CHECK(config_text(dir, "{\"n_layer\": 3} x", &c) == KILN_ERR_FORMAT && msg_has(":1: byte 15: more after the end of the JSON value"));
  char path[400];
  snprintf(path, sizeof path, "%s/none.json", dir);
  CHECK(kiln_gpt_hf_config(path, &c) == KILN_ERR_IO && msg_has("none.json"));
  /* kiln_gpt_from_hf with no config.json beside the file says which file is missing. */
  snprintf(path, sizeof path, "%s/config.json", dir);
  remove(path);
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  CHECK(kiln_gpt_from_hf(path, NULL, KILN_F32, cpu) == NULL && kiln_last_error() == KILN_ERR_IO &&
        msg_has("config.json"));
  scratch_end(dir);
}

int main(void) {
  cpu = kiln_device_cpu();
  const char *src = getenv("KILN_SOURCE_DIR");
  snprintf(fix, sizeof fix, "%s/tests/fixtures/hf_gpt2", src ? src : ".");
  char path[4200];
  snprintf(path, sizeof path, "%s/logits.safetensors", fix);
  kiln_dict *ref = kiln_safetensors_load(path, cpu);
  snprintf(path, sizeof path, "%s/model.safetensors", fix);
  kiln_dict *hf = kiln_safetensors_load(path, cpu);
  if (!ref || !hf) {
    fprintf(stderr, "fixture missing (%s): %s\n", fix, kiln_last_error_message());
    return 1;
  }
  test_parity(ref);
  test_save_roundtrip(ref, hf);
  test_variants(ref, hf);
  test_sharded(ref, hf);
  test_bad_input(hf);
  test_config();
  kiln_dict_free(ref);
  kiln_dict_free(hf);
  printf("%d failures\n", failures);
  return failures ? 1 : 0;
}
