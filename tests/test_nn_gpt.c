/* The transformer modules and GPT-2 on the CPU: shapes and names, the tied embedding
** counted once, GPT-2's init, a tiny model learning a repeating sequence, the block's
** gradients against a composite of basic ops (f64), bad inputs, a safetensors round trip,
** checkpointed blocks, and per-parameter weight decay. Every check names what it proves. */
#define _GNU_SOURCE /* open_memstream */
#include <kiln.h>
#include <kiln_io.h>
#include <kiln_nn.h>
#include <kiln_optim.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "tensor_cmp.h"

#include "scratch.h"

#include "core/kiln_int.h" /* checkpoint.c's counters */

static kiln_device cpu;

/* The test model of the issue: 2 layers, 2 heads, C 32, vocab 64, context 16. */
static kiln_gpt_config tiny(void) {
  kiln_gpt_config c = kiln_gpt2_config();
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  c.vocab_size = 64;
  c.block_size = 16;
  return c;
}

/* max |a - b| / (1 + max |b|) */
static double rel_diff(kiln_tensor *a, kiln_tensor *b) {
  if (!a || !b || kiln_numel(a) != kiln_numel(b)) return INFINITY;
  double *x = host_f64(a), *y = host_f64(b), d = 0, m = 0;
  for (int64_t i = 0; i < kiln_numel(a); i++) {
    d = fmax(d, fabs(x[i] - y[i]));
    m = fmax(m, fabs(y[i]));
  }
  free(x);
  free(y);
  return d / (1 + m);
}

/* Token ids (B, T): a repeating sequence 0, 1, ..., period-1, 0, ... offset per row. */
static kiln_tensor *tokens(int64_t B, int64_t T, int64_t period, int64_t offset) {
  int64_t *v = malloc((size_t)(B * T) * sizeof *v);
  for (int64_t b = 0; b < B; b++)
    for (int64_t t = 0; t < T; t++) v[b * T + t] = (b + t + offset) % period;
  kiln_tensor *r = kiln_from_data(v, KILN_SHAPE(B, T), KILN_I64, cpu);
  free(v);
  return r;
}

static bool has_name(kiln_module *m, const char *name) {
  int n = kiln_module_named_parameters(m, NULL, NULL, 0);
  const char **names = malloc((size_t)n * sizeof *names);
  kiln_module_named_parameters(m, names, NULL, n);
  bool found = false;
  for (int i = 0; i < n; i++) found |= !strcmp(names[i], name);
  free(names);
  return found;
}

/* Logits are (B, T, vocab); nanoGPT's parameter names; no lm_head.weight of its own. */
static void test_shapes_and_names(void) {
  kiln_scope_begin();
  kiln_gpt_config c = tiny();
  kiln_generator *g = kiln_generator_new(1);
  kiln_module *gpt = kiln_gpt_new(&c, KILN_F32, cpu, g);
  CHECK(gpt != NULL);
  kiln_tensor *logits = kiln_module_forward(gpt, tokens(3, 7, 64, 0));
  CHECK(logits && kiln_ndim(logits) == 3 && kiln_size(logits, 0) == 3 && kiln_size(logits, 1) == 7 &&
        kiln_size(logits, 2) == 64);
  /* the full context works */
  kiln_tensor *full = kiln_module_forward(gpt, tokens(1, 16, 64, 0));
  CHECK(full && kiln_size(full, 1) == 16);
  const char *expect[] = {"wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.ln_1.bias",
                          "h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias", "h.0.attn.c_proj.weight",
                          "h.1.ln_2.bias", "h.1.mlp.c_fc.weight", "h.1.mlp.c_proj.bias", "ln_f.weight",
                          "ln_f.bias"};
  for (size_t i = 0; i < sizeof expect / sizeof *expect; i++) CHECK(has_name(gpt, expect[i]));
  CHECK(!has_name(gpt, "lm_head.weight"));
  CHECK(kiln_module_param(gpt, "h.0.attn.c_attn.weight") && kiln_size(kiln_module_param(gpt, "h.0.attn.c_attn.weight"), 0) == 96);
  CHECK(kiln_gpt_config_of(gpt) && kiln_gpt_config_of(gpt)->n_layer == 2);
  CHECK(kiln_gpt_config_of(kiln_module_child(gpt, "h.0")) != NULL);
  CHECK(kiln_gpt_config_of(kiln_module_child(gpt, "ln_f")) == NULL);
  /* i32 ids are accepted too, with the same logits */
  kiln_tensor *l32 = kiln_module_forward(gpt, kiln_to_dtype(tokens(3, 7, 64, 0), KILN_I32));
  CHECK(bits_equal(l32, logits));

  /* the standalone modules */
  kiln_module *emb = kiln_embedding_new(10, 4, KILN_F32, cpu, g);
  kiln_tensor *e = kiln_module_forward(emb, tokens(2, 3, 10, 0));
  CHECK(e && kiln_ndim(e) == 3 && kiln_size(e, 2) == 4);
  kiln_module *ln = kiln_layer_norm_new(4, 1e-5, true, KILN_F32, cpu);
  kiln_module *rms = kiln_rms_norm_new(4, 1e-6, KILN_F32, cpu);
  kiln_tensor *x = kiln_randn(KILN_SHAPE(2, 3, 4), KILN_F32, cpu, g);
  kiln_tensor *ref = kiln_layer_norm(x, 1, (const int64_t[]){4}, NULL, NULL, 1e-5);
  CHECK(bits_equal(kiln_module_forward(ln, x), ref)); /* weight 1, bias 0 */
  CHECK(rel_diff(kiln_module_forward(rms, x), kiln_rms_norm(x, 1, (const int64_t[]){4}, NULL, 1e-6)) == 0);
  CHECK(kiln_module_param(rms, "bias") == NULL && kiln_module_num_params(rms) == 4);
  kiln_module *lnb = kiln_layer_norm_new(4, 1e-5, false, KILN_F32, cpu);
  CHECK(lnb && kiln_module_num_params(lnb) == 4);
  kiln_module_free(lnb);
  kiln_module_free(emb);
  kiln_module_free(ln);
  kiln_module_free(rms);
  kiln_module_free(gpt);
  kiln_generator_free(g);
  kiln_scope_end();
}

/* The tied head: parameter count, state dict, optimizer and summary hold wte once; its
** gradient collects the output head's part (rows of tokens not in the input get one). */
static void test_tied_counted_once(void) {
  kiln_scope_begin();
  kiln_gpt_config c = tiny();
  kiln_module *gpt = kiln_gpt_new(&c, KILN_F32, cpu, NULL);
  const int64_t C = c.n_embd, V = c.vocab_size, L = c.n_layer;
  const int64_t expect = V * C + c.block_size * C + L * (12 * C * C + 13 * C) + 2 * C;
  CHECK(kiln_module_num_params(gpt) == expect);
  int n = kiln_module_parameters(gpt, NULL, 0);
  CHECK(n == 2 + (int)L * 12 + 2);
  kiln_dict *sd = kiln_module_state_dict(gpt);
  CHECK(sd && kiln_dict_size(sd) == n && kiln_dict_get(sd, "wte.weight") && !kiln_dict_get(sd, "lm_head.weight"));
  kiln_dict_free(sd);
  kiln_optim_config cfg = kiln_adamw_config(1e-3);
  kiln_optimizer *opt = kiln_optimizer_new_module(&cfg, gpt);
  CHECK(opt && kiln_optimizer_num_params(opt) == n);
  kiln_optimizer_free(opt);
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  CHECK(kiln_module_summary(f, gpt) == KILN_OK);
  fclose(f);
  char line[64];
  snprintf(line, sizeof line, "parameters: %lld ", (long long)expect);
  CHECK(buf && strstr(buf, line) != NULL);
  if (getenv("KILN_TEST_VERBOSE")) fputs(buf, stdout);
  free(buf);

  /* ids only from [0, 8): rows 8.. of wte get gradient only through the head */
  kiln_tensor *idx = tokens(2, 8, 8, 0);
  kiln_tensor *loss = kiln_cross_entropy(kiln_flatten(kiln_module_forward(gpt, idx), 0, 1),
                                         kiln_flatten(tokens(2, 8, 8, 1), 0, 1), KILN_REDUCTION_MEAN, -100, 0);
  CHECK(kiln_backward(loss, NULL) == KILN_OK);
  kiln_tensor *gw = kiln_grad(kiln_module_param(gpt, "wte.weight"));
  CHECK(gw != NULL);
  if (gw) {
    double *v = host_f64(gw);
    double tail = 0;
    for (int64_t i = 8 * C; i < V * C; i++) tail += fabs(v[i]);
    CHECK(tail > 0);
    free(v);
  }
  kiln_module_free(gpt);
  kiln_scope_end();
}

static void moments(kiln_tensor *t, double *mean, double *sd) {
  double *v = host_f64(t);
  int64_t n = kiln_numel(t);
  double m = 0, s = 0;
  for (int64_t i = 0; i < n; i++) m += v[i];
  m /= (double)n;
  for (int64_t i = 0; i < n; i++) s += (v[i] - m) * (v[i] - m);
  *mean = m;
  *sd = sqrt(s / (double)(n > 1 ? n - 1 : 1));
  free(v);
}

/* N(0, 0.02) weights, 0.02 / sqrt(2 n_layer) for c_proj, zero biases, LayerNorm 1 / 0. */
static void test_gpt2_init(void) {
  kiln_scope_begin();
  kiln_gpt_config c = tiny();
  c.n_embd = 64; /* more draws per tensor: sample sds within a few % */
  c.n_layer = 8;
  kiln_module *gpt = kiln_gpt_new(&c, KILN_F32, cpu, NULL);
  double m, sd;
  const char *plain[] = {"wte.weight", "wpe.weight", "h.3.attn.c_attn.weight", "h.3.mlp.c_fc.weight"};
  for (int i = 0; i < 4; i++) {
    moments(kiln_module_param(gpt, plain[i]), &m, &sd);
    CHECK(fabs(sd / 0.02 - 1) < 0.1 && fabs(m) < 0.003);
  }
  const char *proj[] = {"h.3.attn.c_proj.weight", "h.3.mlp.c_proj.weight"};
  for (int i = 0; i < 2; i++) {
    moments(kiln_module_param(gpt, proj[i]), &m, &sd);
    CHECK(fabs(sd / (0.02 / 4.0) - 1) < 0.1); /* sqrt(2 * 8) = 4 */
  }
  moments(kiln_module_param(gpt, "h.3.attn.c_attn.bias"), &m, &sd);
  CHECK(m == 0 && sd == 0);
  moments(kiln_module_param(gpt, "h.3.ln_1.weight"), &m, &sd);
  CHECK(m == 1 && sd == 0);
  moments(kiln_module_param(gpt, "ln_f.bias"), &m, &sd);
  CHECK(m == 0 && sd == 0);
  kiln_module_free(gpt);
  kiln_scope_end();
}

/* The numbers of kiln_gpt_new are those of PyTorch's order of construction: each Embedding
** and Linear first takes its default draws (N(0, 1); kaiming-uniform weight and bias), then
** GPT-2's init draws again. A replay with the public constructors from the same generator
** state must give every weight bit for bit and leave the generator at the same offset. Odd
** sizes (C 33, vocab 63, context 15) make each draw round up to a whole Philox block. */
static void test_gpt2_init_stream(void) {
  kiln_scope_begin();
  kiln_gpt_config c = tiny();
  c.n_embd = 33;
  c.n_head = 3;
  c.vocab_size = 63;
  c.block_size = 15;
  const int64_t C = c.n_embd;
  const double proj = 0.02 / sqrt(2.0 * (double)c.n_layer);
  kiln_generator *g = kiln_generator_new(7), *r = kiln_generator_new(7);
  bool grad = kiln_set_grad_enabled(false); /* the replay's in-place re-draws */
  kiln_module *gpt = kiln_gpt_new(&c, KILN_F32, cpu, g);
  kiln_module *wte = kiln_embedding_new(c.vocab_size, C, KILN_F32, cpu, r);
  kiln_module *wpe = kiln_embedding_new(c.block_size, C, KILN_F32, cpu, r);
  CHECK(kiln_normal_(kiln_module_param(wte, "weight"), 0, 0.02, r) == KILN_OK);
  CHECK(kiln_normal_(kiln_module_param(wpe, "weight"), 0, 0.02, r) == KILN_OK);
  CHECK(bits_equal(kiln_module_param(gpt, "wte.weight"), kiln_module_param(wte, "weight")));
  CHECK(bits_equal(kiln_module_param(gpt, "wpe.weight"), kiln_module_param(wpe, "weight")));
  kiln_module_free(wte);
  kiln_module_free(wpe);
  static const struct {
    const char *name;
    int64_t in, out;
    bool proj;
  } lin[] = {{"attn.c_attn", 1, 3, false}, {"attn.c_proj", 1, 1, true}, {"mlp.c_fc", 1, 4, false},
             {"mlp.c_proj", 4, 1, true}};
  for (int64_t i = 0; i < c.n_layer; i++)
    for (int k = 0; k < 4; k++) {
      kiln_module *l = kiln_linear_new(lin[k].in * C, lin[k].out * C, true, KILN_F32, cpu, r);
      CHECK(kiln_normal_(kiln_module_param(l, "weight"), 0, lin[k].proj ? proj : 0.02, r) == KILN_OK);
      char name[64];
      snprintf(name, sizeof name, "h.%lld.%s.weight", (long long)i, lin[k].name);
      bool same = bits_equal(kiln_module_param(gpt, name), kiln_module_param(l, "weight"));
      if (!same) fprintf(stderr, "%s differs from the replay\n", name);
      CHECK(same);
      kiln_module_free(l);
    }
  uint64_t og, or;
  kiln_generator_get_state(g, NULL, &og);
  kiln_generator_get_state(r, NULL, &or);
  if (og != or) fprintf(stderr, "generator offset %llu after kiln_gpt_new, %llu after the replay\n",
                       (unsigned long long)og, (unsigned long long)or);
  CHECK(og == or);
  kiln_set_grad_enabled(grad);
  kiln_module_free(gpt);
  kiln_generator_free(g);
  kiln_generator_free(r);
  kiln_scope_end();
}

static kiln_tensor *lm_loss(kiln_module *gpt, kiln_tensor *x, kiln_tensor *y) {
  return kiln_cross_entropy(kiln_flatten(kiln_module_forward(gpt, x), 0, 1), kiln_flatten(y, 0, 1),
                            KILN_REDUCTION_MEAN, -100, 0);
}

/* The tiny GPT learns a repeating sequence of period 12 (next token is determined): the
** loss falls from about log(64) to well under half of it in 30 AdamW steps. */
static void test_tiny_gpt_trains(void) {
  kiln_gpt_config c = tiny();
  kiln_generator *g = kiln_generator_new(7);
  kiln_module *gpt = kiln_gpt_new(&c, KILN_F32, cpu, g);
  kiln_optim_config cfg = kiln_adamw_config(1e-2);
  cfg.weight_decay = 0.1;
  kiln_optimizer *opt = kiln_optimizer_new_module_decay_split(&cfg, gpt);
  CHECK(opt != NULL);
  kiln_scope_begin();
  kiln_tensor *x = kiln_keep(tokens(4, 16, 12, 0)), *y = kiln_keep(tokens(4, 16, 12, 1));
  kiln_scope_end();
  double first = 0, last = 0;
  for (int step = 0; step < 30; step++) {
    kiln_scope_begin();
    kiln_tensor *loss = lm_loss(gpt, x, y);
    kiln_optimizer_zero_grad(opt);
    CHECK(kiln_backward(loss, NULL) == KILN_OK);
    CHECK(kiln_optimizer_step(opt) == KILN_OK);
    double v = kiln_item(loss);
    if (step == 0) first = v;
    last = v;
    kiln_scope_end();
  }
  if (getenv("KILN_TEST_VERBOSE")) printf("tiny gpt: loss %.4f -> %.4f\n", first, last);
  CHECK(fabs(first - log(64.0)) < 0.5);
  CHECK(last < 0.5 * first);
  kiln_tensor_free(x);
  kiln_tensor_free(y);
  kiln_optimizer_free(opt);
  kiln_module_free(gpt);
  kiln_generator_free(g);
}

/* ---- the block against basic ops ------------------------------------------------------- */

static kiln_tensor *P(kiln_module *m, const char *name) { return kiln_module_param(m, name); }

static kiln_tensor *ref_layer_norm(kiln_tensor *x, kiln_tensor *w, kiln_tensor *b) {
  int last = -1;
  kiln_tensor *mu = kiln_mean(x, 1, &last, true);
  kiln_tensor *xc = kiln_sub(x, mu);
  kiln_tensor *var = kiln_mean(kiln_mul(xc, xc), 1, &last, true);
  return kiln_add(kiln_mul(kiln_mul(xc, kiln_rsqrt(kiln_add_scalar(var, 1e-5))), w), b);
}

static kiln_tensor *ref_linear(kiln_tensor *x, kiln_tensor *w, kiln_tensor *b) {
  return kiln_add(kiln_matmul(x, kiln_transpose(w, 0, 1)), b);
}

/* 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) */
static kiln_tensor *ref_gelu_tanh(kiln_tensor *x) {
  kiln_tensor *inner = kiln_mul_scalar(kiln_add(x, kiln_mul_scalar(kiln_mul(kiln_mul(x, x), x), 0.044715)),
                                       sqrt(2.0 / M_PI));
  return kiln_mul(kiln_mul_scalar(x, 0.5), kiln_add_scalar(kiln_tanh(inner), 1.0));
}

/* nanoGPT's Block with the attention written out: scores, a -inf causal mask, softmax. */
static kiln_tensor *ref_block(kiln_module *blk, kiln_tensor *x, int64_t H) {
  const int64_t B = kiln_size(x, 0), T = kiln_size(x, 1), C = kiln_size(x, 2), D = C / H;
  kiln_tensor *a = ref_layer_norm(x, P(blk, "ln_1.weight"), P(blk, "ln_1.bias"));
  kiln_tensor *qkv = ref_linear(a, P(blk, "attn.c_attn.weight"), P(blk, "attn.c_attn.bias"));
  kiln_tensor *q = kiln_transpose(kiln_reshape(kiln_narrow(qkv, 2, 0, C), KILN_SHAPE(B, T, H, D)), 1, 2);
  kiln_tensor *k = kiln_transpose(kiln_reshape(kiln_narrow(qkv, 2, C, C), KILN_SHAPE(B, T, H, D)), 1, 2);
  kiln_tensor *v = kiln_transpose(kiln_reshape(kiln_narrow(qkv, 2, 2 * C, C), KILN_SHAPE(B, T, H, D)), 1, 2);
  kiln_tensor *att = kiln_mul_scalar(kiln_matmul(q, kiln_transpose(k, 2, 3)), 1.0 / sqrt((double)D));
  kiln_tensor *keep = kiln_tril(kiln_ones(KILN_SHAPE(T, T), KILN_BOOL, cpu), 0);
  att = kiln_softmax(kiln_where(keep, att, kiln_full_like(att, -INFINITY)), -1);
  kiln_tensor *y = kiln_reshape(kiln_transpose(kiln_matmul(att, v), 1, 2), KILN_SHAPE(B, T, C));
  x = kiln_add(x, ref_linear(y, P(blk, "attn.c_proj.weight"), P(blk, "attn.c_proj.bias")));
  kiln_tensor *b = ref_layer_norm(x, P(blk, "ln_2.weight"), P(blk, "ln_2.bias"));
  kiln_tensor *h = ref_gelu_tanh(ref_linear(b, P(blk, "mlp.c_fc.weight"), P(blk, "mlp.c_fc.bias")));
  return kiln_add(x, ref_linear(h, P(blk, "mlp.c_proj.weight"), P(blk, "mlp.c_proj.bias")));
}

/* Same values and the same gradients (input and every parameter) to 1e-10 at f64. The
** norms get random weights and biases so that their gradients are not trivially exact. */
static void test_block_vs_basic_ops(void) {
  kiln_scope_begin();
  kiln_gpt_config c = tiny();
  c.n_embd = 8;
  kiln_generator *g = kiln_generator_new(3);
  kiln_module *blk = kiln_gpt_block_new(&c, KILN_F64, cpu, g);
  CHECK(blk != NULL);
  int n = kiln_module_parameters(blk, NULL, 0);
  kiln_tensor **ps = malloc((size_t)n * sizeof *ps);
  const char **names = malloc((size_t)n * sizeof *names);
  kiln_module_named_parameters(blk, names, ps, n);
  bool prev = kiln_set_grad_enabled(false);
  for (int i = 0; i < n; i++) /* larger than GPT-2's init: O(1) activations everywhere */
    kiln_normal_(ps[i], strstr(names[i], "ln_") && strstr(names[i], "weight") ? 1.0 : 0.0, 0.3, g);
  kiln_set_grad_enabled(prev);
  kiln_tensor *x = kiln_randn(KILN_SHAPE(2, 5, 8), KILN_F64, cpu, g);
  kiln_tensor *r = kiln_randn(KILN_SHAPE(2, 5, 8), KILN_F64, cpu, g);
  kiln_requires_grad_(x, true);

  kiln_tensor *out = kiln_module_forward(blk, x);
  CHECK(kiln_backward(kiln_sum_all(kiln_mul(out, r)), NULL) == KILN_OK);
  kiln_tensor **g1 = malloc((size_t)(n + 1) * sizeof *g1);
  for (int i = 0; i < n; i++) {
    g1[i] = kiln_clone(kiln_grad(ps[i])); /* setting the grad to NULL releases it */
    kiln_set_grad(ps[i], NULL);
  }
  g1[n] = kiln_clone(kiln_grad(x));
  kiln_set_grad(x, NULL);

  kiln_tensor *ref = ref_block(blk, x, c.n_head);
  CHECK(rel_diff(out, ref) < 1e-12);
  CHECK(kiln_backward(kiln_sum_all(kiln_mul(ref, r)), NULL) == KILN_OK);
  for (int i = 0; i < n; i++) {
    double d = rel_diff(g1[i], kiln_grad(ps[i]));
    if (!(d < 1e-10)) fprintf(stderr, "  %s: gradient differs by %g\n", names[i], d);
    CHECK(d < 1e-10);
  }
  CHECK(rel_diff(g1[n], kiln_grad(x)) < 1e-10);
  free(g1);
  free(ps);
  free(names);
  kiln_module_free(blk);
  kiln_generator_free(g);
  kiln_scope_end();
}

/* ---- bad input --------------------------------------------------------------------------- */

static void test_bad_input(void) {
  kiln_scope_begin();
  kiln_gpt_config c = tiny();
  c.n_embd = 30;
  c.n_head = 4;
  CHECK(kiln_gpt_new(&c, KILN_F32, cpu, NULL) == NULL);
  CHECK(kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(strstr(kiln_last_error_message(), "n_embd 30 is not a multiple of n_head 4") != NULL);
  CHECK(kiln_causal_self_attention_new(&c, KILN_F32, cpu, NULL) == NULL);
  CHECK(strstr(kiln_last_error_message(), "n_head 4") != NULL);
  c = tiny();
  c.n_layer = 0;
  CHECK(kiln_gpt_new(&c, KILN_F32, cpu, NULL) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  c = tiny();
  c.dropout = 1.0;
  CHECK(kiln_gpt_block_new(&c, KILN_F32, cpu, NULL) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  c = tiny();
  CHECK(kiln_gpt_new(&c, KILN_I64, cpu, NULL) == NULL && kiln_last_error() == KILN_ERR_DTYPE);
  CHECK(kiln_gpt_new(NULL, KILN_F32, cpu, NULL) == NULL && kiln_last_error() == KILN_ERR_INVALID_ARGUMENT);
  CHECK(kiln_embedding_new(0, 4, KILN_F32, cpu, NULL) == NULL);
  CHECK(kiln_layer_norm_new(4, -1, true, KILN_F32, cpu) == NULL);

  kiln_module *gpt = kiln_gpt_new(&c, KILN_F32, cpu, NULL);
  CHECK(kiln_module_forward(gpt, tokens(1, 17, 64, 0)) == NULL);
  CHECK(kiln_last_error() == KILN_ERR_SHAPE);
  CHECK(strstr(kiln_last_error_message(), "sequence length 17") != NULL &&
        strstr(kiln_last_error_message(), "block_size 16") != NULL);
  CHECK(kiln_module_forward(gpt, kiln_zeros(KILN_SHAPE(2, 4), KILN_F32, cpu)) == NULL);
  CHECK(kiln_last_error() == KILN_ERR_DTYPE);
  CHECK(kiln_module_forward(gpt, kiln_zeros(KILN_SHAPE(8), KILN_I64, cpu)) == NULL);
  CHECK(kiln_last_error() == KILN_ERR_SHAPE && strstr(kiln_last_error_message(), "(B, T)") != NULL);
  CHECK(kiln_module_forward(gpt, kiln_full(KILN_SHAPE(1, 4), 64, KILN_I64, cpu)) == NULL);
  CHECK(kiln_last_error() == KILN_ERR_INDEX); /* a token id past the vocabulary */
  kiln_module *attn = kiln_module_child(gpt, "h.0.attn");
  CHECK(kiln_module_forward(attn, kiln_zeros(KILN_SHAPE(2, 4, 31), KILN_F32, cpu)) == NULL);
  CHECK(kiln_last_error() == KILN_ERR_SHAPE && strstr(kiln_last_error_message(), "(B, T, 32)") != NULL);
  kiln_module_free(gpt);
  kiln_clear_error();
  kiln_scope_end();
}

/* ---- state dict, checkpointing, weight decay ---------------------------------------------- */

/* Saved to safetensors and loaded into a model with other weights: the same logits, bit
** for bit. */
static void test_state_dict_round_trip(void) {
  char dir[256], path[300];
  if (scratch_begin(dir, sizeof dir, "nn_gpt") != 0) {
    CHECK(0);
    return;
  }
  snprintf(path, sizeof path, "%s/gpt.safetensors", dir);
  kiln_scope_begin();
  kiln_gpt_config c = tiny();
  kiln_generator *g = kiln_generator_new(11);
  kiln_module *a = kiln_gpt_new(&c, KILN_F32, cpu, g);
  kiln_module *b = kiln_gpt_new(&c, KILN_F32, cpu, g);
  kiln_tensor *idx = tokens(2, 9, 64, 5);
  kiln_tensor *la = kiln_module_forward(a, idx);
  CHECK(!bits_equal(la, kiln_module_forward(b, idx)));
  kiln_dict *sd = kiln_module_state_dict(a);
  CHECK(kiln_safetensors_save(path, sd) == KILN_OK);
  kiln_dict_free(sd);
  kiln_dict *back = kiln_safetensors_load(path, cpu);
  CHECK(back && kiln_dict_size(back) == kiln_module_parameters(a, NULL, 0));
  CHECK(kiln_module_load_state_dict(b, back, true) == KILN_OK);
  CHECK(bits_equal(la, kiln_module_forward(b, idx)));
  kiln_dict_free(back);
  kiln_module_free(a);
  kiln_module_free(b);
  kiln_generator_free(g);
  kiln_scope_end();
  scratch_end(dir);
}

/* Checkpointing gives the same loss and gradients, bit for bit, on the CPU: each block
** (marking h marks its children), each block's MLP, its attention, both, or a norm, and
** each block keeping its products (KILN_CHECKPOINT_KEEP_PRODUCTS). The
** GPT's walk over the blocks (every residual add fused with the norm after it) takes
** checkpointed attn and mlp segments whole; a checkpointed block or norm sends it back to
** each block's own forward. */
static void test_checkpointed(void) {
  static const char *const parts[][2] = {{"h", NULL},   {"mlp", NULL}, {"attn", NULL},
                                         {"mlp", "attn"}, {"ln_2", NULL}, {"h", NULL}};
  for (size_t v = 0; v < sizeof parts / sizeof parts[0]; v++) {
    kiln_scope_begin();
    kiln_gpt_config c = tiny();
    kiln_generator *g = kiln_generator_new(5);
    kiln_module *a = kiln_gpt_new(&c, KILN_F32, cpu, g);
    kiln_generator_seed(g, 5);
    kiln_module *b = kiln_gpt_new(&c, KILN_F32, cpu, g);
    kiln_module *h = kiln_module_child(b, "h");
    const bool products = v == 5;
    if (products) CHECK(kiln_module_set_checkpoint_keep(h, KILN_CHECKPOINT_KEEP_PRODUCTS) == KILN_OK);
    if (!strcmp(parts[v][0], "h")) {
      CHECK(kiln_module_set_checkpoint(h, true) == KILN_OK);
      CHECK(kiln_module_is_checkpointed(kiln_module_child(b, "h.1")));
    }
    for (int i = 0; strcmp(parts[v][0], "h") && i < kiln_module_num_children(h); i++)
      for (int k = 0; k < 2 && parts[v][k]; k++)
        CHECK(kiln_module_set_checkpoint(kiln_module_child(kiln_module_child_at(h, i), parts[v][k]), true) == KILN_OK);
    kiln_tensor *x = tokens(2, 12, 64, 3), *y = tokens(2, 12, 64, 4);
    kiln_tensor *loss_a = lm_loss(a, x, y);
    kiln_trace *tr = kiln_trace_begin();
    kiln_tensor *loss_b = lm_loss(b, x, y);
    CHECK(kiln_trace_end(tr) == KILN_OK);
    CHECK(bits_equal(loss_a, loss_b));
    /* the walk's fused norms (each residual add with the norm after it: a trace shows an
    ** add with the norm's eps, then layer_norm) with checkpointed blocks, attentions or MLPs
    ** too; a checkpointed norm turns the walk off */
    const char *rln = getenv("KILN_GPT_RESIDUAL_LN");
    int fused = 0;
    for (int i = 0; i < kiln_trace_count(tr); i++) {
      const kiln_trace_op *op = kiln_trace_get(tr, i);
      fused += !strcmp(op->name, "add") && op->n_attrs > 0 && !strcmp(op->attrs[0].name, "eps");
    }
    if (rln && !strcmp(rln, "1")) CHECK(fused == (!strcmp(parts[v][0], "ln_2") ? 0 : 2 * c.n_layer + 1));
    kiln_trace_free(tr);
    int64_t s0 = kiln__checkpoint_skipped(), f0 = kiln__checkpoint_full_again(), t0 = kiln__checkpoint_taken();
    CHECK(kiln_backward(loss_a, NULL) == KILN_OK && kiln_backward(loss_b, NULL) == KILN_OK);
    /* the recomputes skip each segment's last op: a block's residual add, an MLP's or an
    ** attention's c_proj; a norm has none to skip; and a block's or an attention's takes the
    ** attention's output kept from the forward (no dropout here), a block keeping products
    ** c_attn's and attention's c_proj's outputs too (the MLP's c_fc has its GELU fused) */
    int64_t skips = !strcmp(parts[v][0], "ln_2") ? 0 : parts[v][1] ? 2 * c.n_layer : c.n_layer;
    bool attn = !strcmp(parts[v][0], "h") || !strcmp(parts[v][0], "attn") || (parts[v][1] && !strcmp(parts[v][1], "attn"));
    CHECK(kiln__checkpoint_skipped() - s0 == skips && kiln__checkpoint_full_again() == f0);
    /* off the walk a block ends in its own residual add, so its MLP's c_proj is kept too */
    int64_t kept_products = products ? (rln && !strcmp(rln, "1") ? 2 : 3) * c.n_layer : 0;
    CHECK(kiln__checkpoint_taken() - t0 == (attn ? c.n_layer : 0) + kept_products);
    int n = kiln_module_parameters(a, NULL, 0);
    kiln_tensor **pa = malloc((size_t)n * sizeof *pa), **pb = malloc((size_t)n * sizeof *pb);
    kiln_module_parameters(a, pa, n);
    kiln_module_parameters(b, pb, n);
    int same = 0;
    for (int i = 0; i < n; i++) same += bits_equal(kiln_grad(pa[i]), kiln_grad(pb[i]));
    if (same != n) fprintf(stderr, "checkpointed %s%s%s%s: %d of %d gradients the same\n", parts[v][0],
                           parts[v][1] ? " and " : "", parts[v][1] ? parts[v][1] : "",
                           products ? ", products kept" : "", same, n);
    CHECK(same == n);
    free(pa);
    free(pb);
    kiln_module_free(a);
    kiln_module_free(b);
    kiln_generator_free(g);
    kiln_scope_end();
  }
}

/* The decay split: 2-d weights decay, biases and norm weights do not; with zero
** gradients, AdamW leaves the no-decay parameters as they were and shrinks the others by
** exactly (1 - lr wd). */
static void test_weight_decay_groups(void) {
  kiln_scope_begin();
  kiln_gpt_config c = tiny();
  c.n_layer = 1;
  kiln_module *gpt = kiln_gpt_new(&c, KILN_F32, cpu, NULL);
  kiln_optim_config cfg = kiln_adamw_config(0.1);
  cfg.weight_decay = 0.5;
  kiln_optimizer *opt = kiln_optimizer_new_module_decay_split(&cfg, gpt);
  CHECK(opt != NULL);
  int n = kiln_module_parameters(gpt, NULL, 0);
  const char **names = malloc((size_t)n * sizeof *names);
  kiln_tensor **ps = malloc((size_t)n * sizeof *ps), **before = malloc((size_t)n * sizeof *before);
  kiln_module_named_parameters(gpt, names, ps, n);
  int decayed = 0;
  for (int i = 0; i < n; i++) {
    double wd = kiln_optimizer_param_weight_decay(opt, i);
    bool two_d = kiln_ndim(ps[i]) >= 2;
    CHECK(wd == (two_d ? 0.5 : 0.0));
    decayed += wd > 0;
    before[i] = kiln_clone(ps[i]);
    kiln_set_grad(ps[i], kiln_zeros_like(ps[i]));
  }
  CHECK(decayed == 2 + 4); /* wte, wpe, c_attn, attn.c_proj, c_fc, mlp.c_proj */
  CHECK(isnan(kiln_optimizer_param_weight_decay(opt, n)));
  CHECK(kiln_optimizer_step(opt) == KILN_OK);
  for (int i = 0; i < n; i++) {
    double wd = kiln_optimizer_param_weight_decay(opt, i);
    CHECK(rel_diff(ps[i], kiln_mul_scalar(before[i], 1.0 - 0.1 * wd)) < 1e-7);
  }
  /* the setter checks its input; NULL goes back to the config's decay */
  double bad[1] = {0.1};
  CHECK(kiln_optimizer_set_weight_decays(opt, bad, 1) == KILN_ERR_INVALID_ARGUMENT);
  double *neg = calloc((size_t)n, sizeof *neg);
  neg[2] = -1;
  CHECK(kiln_optimizer_set_weight_decays(opt, neg, n) == KILN_ERR_INVALID_ARGUMENT);
  CHECK(strstr(kiln_last_error_message(), "parameter 2") != NULL);
  CHECK(kiln_optimizer_set_weight_decays(opt, NULL, 0) == KILN_OK);
  CHECK(kiln_optimizer_param_weight_decay(opt, 1) == 0.5);
  free(neg);
  free(names);
  free(ps);
  free(before);
  kiln_optimizer_free(opt);
  kiln_module_free(gpt);
  kiln_clear_error();
  kiln_scope_end();
}

int main(void) {
  cpu = kiln_device_cpu();
  test_shapes_and_names();
  test_tied_counted_once();
  test_gpt2_init();
  test_gpt2_init_stream();
  test_tiny_gpt_trains();
  test_block_vs_basic_ops();
  test_bad_input();
  test_state_dict_round_trip();
  test_checkpointed();
  test_weight_decay_groups();
  return check_finish("test_nn_gpt");
}
