/* Transformer modules: Embedding, LayerNorm, RMSNorm, and GPT-2 (causal self-attention,
** MLP, block, the model) with nanoGPT's layout, parameter names and initialisation
** (github.com/karpathy/nanoGPT, model.py). Each forward looks its tensors up by name at
** every call (kiln_module_to may have replaced them) and runs its children through
** kiln_module_forward, so module scopes, activation measurement and checkpointing see
** every sub-module. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nn/nn_int.h"

/* GPT-2's initial standard deviation for weights (nanoGPT's _init_weights). */
#define GPT_INIT_STD 0.02

static void *dup_cfg(const void *src, size_t n, const char *who) {
  void *c = malloc(n);
  if (!c) {
    kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
    return NULL;
  }
  memcpy(c, src, n);
  return c;
}

/* Where add_param leaves the values unset (a loader writes them). */
#define UNDRAWN (-1.0)

/* A new parameter of shape (n0) or (n0, n1): normal(0, std) when std > 0, not set when std
** is UNDRAWN, else the constant value. Registered under name; the status of the whole. */
static kiln_status add_param(kiln_module *m, const char *name, int ndim, int64_t n0, int64_t n1,
                             double std, double value, kiln_dtype dt, kiln_device dev,
                             kiln_generator *gen) {
  const int64_t shape[2] = {n0, n1};
  kiln_tensor *t = kiln_empty(ndim, shape, dt, dev);
  kiln_status st = !t              ? kiln_last_error()
                    : std > 0        ? kiln_normal_(t, 0.0, std, gen)
                    : std == UNDRAWN ? KILN_OK
                                     : kiln_fill_(t, value);
  if (st != KILN_OK) {
    kiln_tensor_free(kiln_keep(t));
    return st;
  }
  return kiln_module_register_parameter(m, name, t, true);
}

static kiln_module *fail(kiln_module *m) {
  kiln_module_free(m);
  return NULL;
}

static kiln_status check_dtype(kiln_dtype dt, const char *who) {
  if (!kiln_dtype_is_float(dt))
    return kiln_set_error(KILN_ERR_DTYPE, "%s: dtype %s is not floating", who, kiln_dtype_name(dt));
  return KILN_OK;
}

/* ---- Embedding ------------------------------------------------------------------------- */

typedef struct embedding_cfg {
  int64_t num, dim;
} embedding_cfg;

static kiln_tensor *embedding_forward(kiln_module *m, kiln_tensor *ids) {
  return kiln_embedding(kiln_module_param(m, "weight"), ids);
}

static int embedding_repr(const kiln_module *m, char *buf, size_t n) {
  const embedding_cfg *c = kiln_module_impl(m);
  return snprintf(buf, n, "%lld, %lld", (long long)c->num, (long long)c->dim);
}

static const kiln_module_vtable embedding_vt = {"Embedding", embedding_forward, NULL, free, embedding_repr};

/* An Embedding of weight N(0, std) (UNDRAWN: not set). */
static kiln_module *embedding_new(int64_t num_embeddings, int64_t embedding_dim, double std, kiln_dtype dt,
                                  kiln_device dev, kiln_generator *gen) {
  static const char who[] = "kiln_embedding_new";
  if (num_embeddings < 1 || embedding_dim < 1) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: num_embeddings %lld, embedding_dim %lld (both must be >= 1)",
                   who, (long long)num_embeddings, (long long)embedding_dim);
    return NULL;
  }
  if (check_dtype(dt, who) != KILN_OK) return NULL;
  embedding_cfg cfg = {num_embeddings, embedding_dim};
  void *c = dup_cfg(&cfg, sizeof cfg, who);
  kiln_module *m = c ? kiln_module_new(&embedding_vt, c) : NULL;
  if (!m) return NULL;
  if (add_param(m, "weight", 2, num_embeddings, embedding_dim, std, 0, dt, dev, gen) != KILN_OK) return fail(m);
  return m;
}

kiln_module *kiln_embedding_new(int64_t num_embeddings, int64_t embedding_dim, kiln_dtype dt, kiln_device dev,
                                kiln_generator *gen) {
  return embedding_new(num_embeddings, embedding_dim, 1.0, dt, dev, gen);
}

/* ---- LayerNorm, RMSNorm ------------------------------------------------------------------ */

typedef struct norm_cfg {
  int64_t dim;
  double eps;
  bool bias;
} norm_cfg;

static kiln_tensor *layer_norm_forward(kiln_module *m, kiln_tensor *x) {
  const norm_cfg *c = kiln_module_impl(m);
  return kiln_layer_norm(x, 1, &c->dim, kiln_module_param(m, "weight"),
                         c->bias ? kiln_module_param(m, "bias") : NULL, c->eps);
}

static kiln_tensor *rms_norm_forward(kiln_module *m, kiln_tensor *x) {
  const norm_cfg *c = kiln_module_impl(m);
  return kiln_rms_norm(x, 1, &c->dim, kiln_module_param(m, "weight"), c->eps);
}

static int norm_repr(const kiln_module *m, char *buf, size_t n) {
  const norm_cfg *c = kiln_module_impl(m);
  return snprintf(buf, n, "(%lld,), eps=%g%s", (long long)c->dim, c->eps, c->bias ? "" : ", bias=false");
}

static const kiln_module_vtable layer_norm_vt = {"LayerNorm", layer_norm_forward, NULL, free, norm_repr};
static const kiln_module_vtable rms_norm_vt = {"RMSNorm", rms_norm_forward, NULL, free, norm_repr};

static kiln_module *norm_new(const kiln_module_vtable *vt, int64_t dim, double eps, bool bias,
                             kiln_dtype dt, kiln_device dev, const char *who) {
  if (dim < 1 || !(eps >= 0) || isinf(eps)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: dim %lld, eps %g (dim >= 1, eps >= 0 finite)", who,
                   (long long)dim, eps);
    return NULL;
  }
  if (check_dtype(dt, who) != KILN_OK) return NULL;
  norm_cfg cfg = {dim, eps, bias};
  void *c = dup_cfg(&cfg, sizeof cfg, who);
  kiln_module *m = c ? kiln_module_new(vt, c) : NULL;
  if (!m) return NULL;
  kiln_status st = add_param(m, "weight", 1, dim, 0, 0, 1.0, dt, dev, NULL);
  if (st == KILN_OK && bias) st = add_param(m, "bias", 1, dim, 0, 0, 0.0, dt, dev, NULL);
  return st == KILN_OK ? m : fail(m);
}

kiln_module *kiln_layer_norm_new(int64_t dim, double eps, bool bias, kiln_dtype dt, kiln_device dev) {
  return norm_new(&layer_norm_vt, dim, eps, bias, dt, dev, "kiln_layer_norm_new");
}

kiln_module *kiln_rms_norm_new(int64_t dim, double eps, kiln_dtype dt, kiln_device dev) {
  return norm_new(&rms_norm_vt, dim, eps, false, dt, dev, "kiln_rms_norm_new");
}

/* ---- GPT-2 ------------------------------------------------------------------------------- */

kiln_gpt_config kiln_gpt2_config(void) {
  kiln_gpt_config c;
  memset(&c, 0, sizeof c);
  c.n_layer = 12;
  c.n_head = 12;
  c.n_embd = 768;
  c.vocab_size = 50257;
  c.block_size = 1024;
  c.dropout = 0.0;
  c.bias = true;
  return c;
}

static kiln_status check_gpt_config(const kiln_gpt_config *c, kiln_dtype dt, const char *who) {
  if (!c) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL config", who);
  if (c->n_layer < 1 || c->n_head < 1 || c->n_embd < 1 || c->vocab_size < 1 || c->block_size < 1)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT,
                          "%s: n_layer %lld, n_head %lld, n_embd %lld, vocab_size %lld, block_size %lld "
                          "(each must be >= 1)", who, (long long)c->n_layer, (long long)c->n_head,
                          (long long)c->n_embd, (long long)c->vocab_size, (long long)c->block_size);
  if (c->n_embd % c->n_head != 0)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: n_embd %lld is not a multiple of n_head %lld", who,
                          (long long)c->n_embd, (long long)c->n_head);
  if (!(c->dropout >= 0 && c->dropout < 1))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: dropout %g is not in [0, 1)", who, c->dropout);
  return check_dtype(dt, who);
}

/* How the GPT constructors set their weights: GPT-2's init from gen (draw), or not at all
** (a loader writes every one; gen is untouched). */
typedef struct gpt_init {
  kiln_generator *gen;
  bool draw;
} gpt_init;

/* A Linear of N(0, std) weight and zero bias. Its numbers are those of PyTorch's order
** (kiln_linear_new's kaiming draws, then these): the first draws are skipped, not made. */
static kiln_module *gpt_linear(int64_t in, int64_t out, bool bias, double std, kiln_dtype dt, kiln_device dev,
                               const gpt_init *init) {
  kiln_module *l = kiln__linear_new_undrawn(in, out, bias, dt, dev);
  if (!l || !init->draw) return l;
  kiln__linear_skip_init(in, out, bias, init->gen);
  /* in place on fresh parameters: no graph records it */
  bool prev = kiln_set_grad_enabled(false);
  kiln_status st = kiln_normal_(kiln_module_param(l, "weight"), 0.0, std, init->gen);
  if (st == KILN_OK && bias) st = kiln_zero_(kiln_module_param(l, "bias"));
  kiln_set_grad_enabled(prev);
  return st == KILN_OK ? l : fail(l);
}

/* The residual projections: 0.02 / sqrt(2 n_layer), since each block adds two branches to
** the residual stream (GPT-2 paper, 2.3; nanoGPT applies it to every c_proj.weight). */
static double proj_std(const kiln_gpt_config *c) { return GPT_INIT_STD / sqrt(2.0 * (double)c->n_layer); }

static int gpt_repr(const kiln_module *m, char *buf, size_t n) {
  const kiln_gpt_config *c = kiln_module_impl(m);
  return snprintf(buf, n, "n_layer=%lld, n_head=%lld, n_embd=%lld, vocab_size=%lld, block_size=%lld, dropout=%g%s, "
                  "lm_head tied to wte.weight",
                  (long long)c->n_layer, (long long)c->n_head, (long long)c->n_embd, (long long)c->vocab_size,
                  (long long)c->block_size, c->dropout, c->bias ? "" : ", bias=false");
}

static int attn_repr(const kiln_module *m, char *buf, size_t n) {
  const kiln_gpt_config *c = kiln_module_impl(m);
  return snprintf(buf, n, "n_head=%lld, n_embd=%lld, causal", (long long)c->n_head, (long long)c->n_embd);
}

static const kiln_module_vtable block_vt;

/* The GPT modules below run their bodies in a scope of their own and return only the
** output (kiln__scope_return): what a node saved survives (nodes hold their own aliases),
** every other intermediate goes when the module returns. Without it the step's scope kept
** each block's dead tensors to the end of the step: the f32 norm outputs once cast to
** bf16, the bf16 branch outputs and their f32 casts once added to the residual stream
** (15 KiB a token a block under bf16 autocast: 3 GiB for GPT-2 124M at B=16, T=1024). */

/* x (B, T, C) -> (B, T, C). */
static kiln_tensor *attn_body(kiln_module *m, kiln_tensor *x);
static kiln_tensor *attn_forward(kiln_module *m, kiln_tensor *x) {
  kiln_scope_begin();
  return kiln__scope_return(attn_body(m, x));
}

/* qkv (B, T, 3C) -> q, k, v (B, H, T, D): views (split, view, transpose), one node whose
** backward takes the three gradients as they come when attention's backward wrote them into
** one (B, T, 3C) buffer (kiln__attention_qkv_grad: no copy at all), and else stacks them
** into qkv's layout in one op. Through the views'
** own rules each gradient became a zero (B, T, 3C) tensor with its slice copied in, and
** the three were added: about 0.8 GB of memory traffic a layer for GPT-2 at B=16, T=1024
** (3 zeros, 3 copies, 2 adds of 75 MB tensors: 4 ms a step on the H200, 18:40 profile)
** where the stack moves 0.15 GB. state: {B, T, H, D}. */
static kiln_status qkv_heads_fwd(kiln_function_ctx *ctx, int n_in, kiln_tensor *const *in, int n_out,
                                 kiln_tensor **out) {
  (void)n_in, (void)n_out;
  const int64_t *d = kiln_function_state(ctx);
  const int64_t B = d[0], T = d[1], H = d[2], D = d[3];
  kiln_tensor *part[3];
  if (kiln_split(in[0], H * D, 2, part, 3) != 3) return kiln_last_error();
  for (int i = 0; i < 3; i++) { /* (B, T, C) -> (B, T, H, D) -> (B, H, T, D) */
    out[i] = kiln_transpose(kiln_view(part[i], KILN_SHAPE(B, T, H, D)), 1, 2);
    if (!out[i]) return kiln_last_error();
  }
  return KILN_OK;
}

static kiln_status qkv_heads_bwd(kiln_function_ctx *ctx, int n_out, kiln_tensor *const *gy, int n_in,
                                 kiln_tensor **gx) {
  (void)n_out, (void)n_in;
  if (!kiln_function_grad_needed(ctx, 0)) return KILN_OK;
  const int64_t *d = kiln_function_state(ctx);
  const int64_t B = d[0], T = d[1], H = d[2], D = d[3];
  kiln_tensor *any = gy[0] ? gy[0] : gy[1] ? gy[1] : gy[2];
  if (!any) return KILN_OK; /* no gradient reached q, k or v */
  if (gy[0] && gy[1] && gy[2] && (gx[0] = kiln__attention_qkv_grad(gy)) != NULL)
    return KILN_OK; /* attention's backward wrote dq, dk, dv into one (B, T, 3C) buffer */
  kiln_tensor *t[3];
  for (int i = 0; i < 3; i++) /* (B, H, T, D) -> (B, T, H, D) views; zeros where none came */
    t[i] = gy[i] ? kiln_transpose(gy[i], 1, 2)
                 : kiln_zeros(KILN_SHAPE(B, T, H, D), kiln_dtype_of(any), kiln_device_of(any));
  gx[0] = kiln_reshape(kiln_stack(3, t, 2), KILN_SHAPE(B, T, 3 * H * D)); /* (B, T, 3, H, D) */
  return gx[0] ? KILN_OK : kiln_last_error();
}

static const kiln_function qkv_heads = {"qkv_heads", qkv_heads_fwd, qkv_heads_bwd};

static kiln_tensor *attn_body(kiln_module *m, kiln_tensor *x) {
  const kiln_gpt_config *c = kiln_module_impl(m);
  const int64_t C = c->n_embd, H = c->n_head, D = C / H;
  if (kiln_ndim(x) != 3 || kiln_size(x, 2) != C) {
    char b[96];
    kiln_set_error(KILN_ERR_SHAPE, "CausalSelfAttention: input has shape %s; expected (B, T, %lld)",
                   kiln_shape_str(x, b, sizeof b), (long long)C);
    return NULL;
  }
  const int64_t B = kiln_size(x, 0), T = kiln_size(x, 1);
  kiln_tensor *qkv = kiln_module_forward(kiln_module_child(m, "c_attn"), x); /* (B, T, 3C) */
  if (!qkv) return NULL;
  kiln_tensor *part[3];
  int64_t *st = malloc(4 * sizeof *st);
  if (!st) {
    kiln_set_error(KILN_ERR_OOM, "CausalSelfAttention: out of host memory");
    return NULL;
  }
  st[0] = B, st[1] = T, st[2] = H, st[3] = D;
  if (kiln_function_apply(&qkv_heads, st, free, 1, &qkv, 3, part) != KILN_OK) return NULL;
  double p = kiln_module_is_training(m) ? c->dropout : 0.0;
  kiln_tensor *y = kiln_scaled_dot_product_attention(part[0], part[1], part[2], NULL, true, p, 0.0, NULL);
  y = kiln_reshape(kiln_transpose(y, 1, 2), KILN_SHAPE(B, T, C)); /* (B, H, T, D) -> (B, T, C) */
  y = kiln_module_forward(kiln_module_child(m, "c_proj"), y);
  return kiln_module_forward(kiln_module_child(m, "resid_dropout"), y);
}

/* c_fc then its tanh GELU run as one op, kiln_linear_gelu (on CUDA one cuBLASLt call
** with a GELU epilogue: no pass over the (B, T, 4C) pre-activation for the bias or the
** GELU), in c_fc's module scope (the GELU gets no span of its own, as a Sequential's
** Linear+ReLU); either of them checkpointed on its own runs them as two modules. */
static kiln_tensor *mlp_forward(kiln_module *m, kiln_tensor *x) {
  const kiln_gpt_config *c = kiln_module_impl(m);
  kiln_module *fc = kiln_module_child(m, "c_fc"), *act = kiln_module_child(m, "gelu");
  kiln_scope_begin();
  if (fc && act && !kiln_module_is_checkpointed(fc) && !kiln_module_is_checkpointed(act)) {
    kiln__module_scope_push(kiln__module_label(fc));
    int64_t s0 = 0, s1 = 0;
    if (kiln__module_measuring()) kiln_autograd_saved_bytes(&s0, NULL);
    x = kiln_linear_gelu(x, kiln_module_param(fc, "weight"), c->bias ? kiln_module_param(fc, "bias") : NULL);
    if (kiln__module_measuring()) {
      kiln_autograd_saved_bytes(&s1, NULL);
      kiln__module_measure_note(fc, s1 - s0);
    }
    kiln__module_scope_pop();
  } else {
    x = kiln_module_forward(act, kiln_module_forward(fc, x));
  }
  x = kiln_module_forward(kiln_module_child(m, "c_proj"), x);
  return kiln__scope_return(kiln_module_forward(kiln_module_child(m, "dropout"), x));
}

/* Whether the residual adds and the layer norms after them run as kiln_residual_layer_norm
** (CUDA: one kernel each way, the norm's output straight in the autocast dtype): in a
** Block, x + attn and ln_2; in the GPT's own walk over its blocks, also the MLP's add
** with the next block's ln_1 (and the last one's with ln_f), and the embeddings' add
** (tokens + positions, the positions repeated over the batch) with block 0's ln_1. On
** where x's device has the fused kernels (CUDA: GPT-2's step 42.0 -> 38.2 ms on the H100,
** bench/RESULTS.md), off where they would be composed of the same ops (the CPU, Vulkan);
** KILN_GPT_RESIDUAL_LN=1 or =0 forces it either way (read at each call, so a test can
** compare both ways). */
static bool residual_ln_on(const kiln_tensor *x) {
  return kiln__knob_on("KILN_GPT_RESIDUAL_LN", x && kiln_device_of(x).type == KILN_DEVICE_CUDA);
}

/* The dtype a fused norm gives its output: the autocast dtype in a region (for f32 x: the
** next product reads it so), else x's. */
static kiln_dtype norm_out_dtype(kiln_tensor *x) {
  kiln_device_type dt = kiln_device_of(x).type;
  return kiln_autocast_is_enabled(dt) && kiln_dtype_of(x) == KILN_F32 ? kiln_autocast_dtype(dt) : kiln_dtype_of(x);
}

/* ln (a LayerNorm module) of x + r as one op in ln's module scope; *sum gets x + r.
** ones: the output goes to a linear alone (c_attn, c_fc), so it may come padded with a
** ones column, and that linear's bias gradient is then a column of its weight gradient's
** product (no column-sum kernel). KILN_GPT_ONES_COLUMN (read at each call, an A/B switch):
** unset both, fc c_fc's (ln_2) only, 0 none. (c_fc only saves device time by ncu, c_attn's
** 776-wide weight product costing more than its column sums; one wall-clock pair said the
** opposite within the noise: bench/RESULTS.md. Both, as measured before, until a run
** settles it.) */
static bool ones_column(bool for_c_fc) {
  const int mode = kiln__knob_choice("KILN_GPT_ONES_COLUMN", 0); /* 1, 0, fc */
  return mode == 0 || (mode == 2 && for_c_fc);
}

static kiln_tensor *fused_norm(kiln_module *ln, kiln_tensor *x, kiln_tensor *r, kiln_dtype ydt, bool ones,
                               kiln_tensor **sum) {
  const norm_cfg *nc = kiln_module_impl(ln);
  kiln__module_scope_push(kiln__module_label(ln));
  kiln_tensor *w = kiln_module_param(ln, "weight"), *b = nc->bias ? kiln_module_param(ln, "bias") : NULL;
  kiln_tensor *y = ones ? kiln__residual_layer_norm_ones(x, r, w, b, nc->eps, ydt, sum)
                        : kiln_residual_layer_norm(x, r, w, b, nc->eps, ydt, sum);
  kiln__module_scope_pop();
  return y;
}

static kiln_tensor *block_forward(kiln_module *m, kiln_tensor *x) {
  kiln_scope_begin();
  kiln_tensor *a = kiln_module_forward(kiln_module_child(m, "ln_1"), x);
  kiln_tensor *att = kiln_module_forward(kiln_module_child(m, "attn"), a);
  kiln_module *ln2 = kiln_module_child(m, "ln_2");
  kiln_tensor *b = NULL;
  if (att && ln2 && residual_ln_on(x) && !kiln_module_is_checkpointed(ln2)) {
    kiln_tensor *sum = NULL; /* s = x + att and b = ln_2(s) in one op */
    b = fused_norm(ln2, x, att, norm_out_dtype(x), ones_column(true), &sum);
    x = b ? sum : NULL;
  } else {
    x = kiln_add(x, att);
    b = x ? kiln_module_forward(ln2, x) : NULL;
  }
  x = x ? kiln_add(x, kiln_module_forward(kiln_module_child(m, "mlp"), b)) : NULL;
  return kiln__scope_return(x);
}

/* idx (B, T) -> logits (B, T, vocab). */
static kiln_tensor *gpt_body(kiln_module *m, kiln_tensor *idx);
static kiln_tensor *gpt_forward(kiln_module *m, kiln_tensor *idx) {
  kiln_scope_begin();
  return kiln__scope_return(gpt_body(m, idx));
}

static kiln_tensor *gpt_hidden(kiln_module *m, kiln_tensor *idx);
static kiln_tensor *gpt_body(kiln_module *m, kiln_tensor *idx) {
  kiln_tensor *x = gpt_hidden(m, idx);
  return kiln_linear(x, kiln_module_param(m, "wte.weight"), NULL); /* tied lm_head: (B, T, V) */
}

/* Whether the GPT can walk h's blocks itself (kiln_residual_layer_norm across blocks):
** every child a Block, and no norm checkpointed (the walk replaces its forward by the fused
** one); attn and mlp go through kiln_module_forward, so each may be checkpointed (the usual
** MLP-only checkpointing keeps the fused norms), and a checkpointed block is one segment of
** the walk's own (block_step_checkpointed). */
static bool blocks_walkable(kiln_module *h) {
  if (!h || kiln_module_is_checkpointed(h)) return false;
  for (int i = 0; i < kiln_module_num_children(h); i++) {
    kiln_module *b = kiln_module_child_at(h, i);
    if (kiln__module_vtable(b) != &block_vt) return false;
    static const char *const parts[] = {"ln_1", "attn", "ln_2", "mlp"};
    for (int k = 0; k < 4; k++) {
      kiln_module *p = kiln_module_child(b, parts[k]);
      if (!p || ((k == 0 || k == 2) && kiln_module_is_checkpointed(p))) return false;
    }
  }
  return true;
}

/* One block on the residual stream *x with the previous block's MLP output r still to be
** added (NULL before the first block): r's add runs with ln_1, attn's with ln_2; returns
** this block's MLP output (its add is the next norm's), *x the stream after attn's add.
** In the block's module scope and a scope of its own (two results handed out). */
static kiln_tensor *block_step(kiln_module *blk, kiln_tensor **x, kiln_tensor *r, kiln_dtype ydt) {
  kiln__module_scope_push(kiln__module_label(blk));
  int64_t s0 = 0, s1 = 0;
  if (kiln__module_measuring()) kiln_autograd_saved_bytes(&s0, NULL);
  kiln_scope_begin();
  kiln_tensor *xs = *x;
  kiln_tensor *a = r ? fused_norm(kiln_module_child(blk, "ln_1"), xs, r, ydt, ones_column(false), &xs)
                     : kiln_module_forward(kiln_module_child(blk, "ln_1"), xs);
  kiln_tensor *att = a ? kiln_module_forward(kiln_module_child(blk, "attn"), a) : NULL;
  kiln_tensor *b = att ? fused_norm(kiln_module_child(blk, "ln_2"), xs, att, ydt, ones_column(true), &xs) : NULL;
  kiln_tensor *out = b ? kiln_module_forward(kiln_module_child(blk, "mlp"), b) : NULL;
  if (out) kiln_tensor_ref(xs);
  out = kiln__scope_return(out);
  *x = out ? kiln__scope_track(xs) : NULL;
  if (kiln__module_measuring()) {
    kiln_autograd_saved_bytes(&s1, NULL);
    kiln__module_measure_note(blk, s1 - s0);
  }
  kiln__module_scope_pop();
  return out;
}

/* A checkpointed block in the walk: block_step as one segment (ctx: the block), from the
** stream and the previous block's MLP output still to be added (the add its ln_1 does) to
** this block's MLP output and the stream after attn's add. The segment starts where the
** block's first norm does, so the norms stay fused, and its MLP output, which no op of the
** segment reads, is the c_proj product the recompute skips (autograd/checkpoint.c). */
static kiln_status block_step_segment(void *ctx, int n_in, kiln_tensor *const *in, int n_out, kiln_tensor **out) {
  (void)n_out;
  kiln_tensor *x = in[0];
  out[0] = block_step(ctx, &x, n_in > 1 ? in[1] : NULL, norm_out_dtype(x));
  out[1] = out[0] ? x : NULL;
  return out[0] ? KILN_OK : kiln_last_error();
}

static kiln_tensor *block_step_checkpointed(kiln_module *blk, kiln_tensor **x, kiln_tensor *r) {
  kiln_tensor *in[2] = {*x, r}, *out[2] = {NULL, NULL};
  const kiln_checkpoint_options o = {0, NULL, kiln_module_checkpoint_keep(blk)};
  if (kiln_checkpoint_with(block_step_segment, blk, &o, r ? 2 : 1, in, 2, out) != KILN_OK) {
    *x = NULL;
    return NULL;
  }
  *x = out[1];
  return out[0];
}

/* h's blocks then ln_f, every residual add fused with the norm after it; r (or NULL) is
** added to x under the first block's ln_1 (the position embedding). */
static kiln_tensor *walk_blocks(kiln_module *m, kiln_module *h, kiln_tensor *x, kiln_tensor *r) {
  const kiln_dtype ydt = norm_out_dtype(x);
  kiln__module_scope_push(kiln__module_label(h));
  for (int i = 0; i < kiln_module_num_children(h) && x; i++) {
    kiln_module *blk = kiln_module_child_at(h, i);
    r = kiln_module_is_checkpointed(blk) ? block_step_checkpointed(blk, &x, r) : block_step(blk, &x, r, ydt);
  }
  kiln__module_scope_pop();
  if (!x) return NULL;
  kiln_module *lnf = kiln_module_child(m, "ln_f");
  return r ? fused_norm(lnf, x, r, ydt, false, NULL) : kiln_module_forward(lnf, x);
}

/* idx (B, T) -> ln_f's output (B, T, C). */
static kiln_tensor *gpt_hidden(kiln_module *m, kiln_tensor *idx) {
  const kiln_gpt_config *c = kiln_module_impl(m);
  char b[96];
  if (kiln_ndim(idx) != 2) {
    kiln_set_error(KILN_ERR_SHAPE, "GPT: idx has shape %s; expected (B, T) token ids",
                   kiln_shape_str(idx, b, sizeof b));
    return NULL;
  }
  kiln_dtype dt = kiln_dtype_of(idx);
  if (dt != KILN_I64 && dt != KILN_I32) {
    kiln_set_error(KILN_ERR_DTYPE, "GPT: idx has dtype %s; expected i64 or i32 token ids", kiln_dtype_name(dt));
    return NULL;
  }
  const int64_t T = kiln_size(idx, 1);
  if (T > c->block_size) {
    kiln_set_error(KILN_ERR_SHAPE, "GPT: sequence length %lld is longer than the context (block_size %lld)",
                   (long long)T, (long long)c->block_size);
    return NULL;
  }
  kiln_tensor *pos = kiln_arange(0, (double)T, 1, KILN_I64, kiln_device_of(idx)); /* (T) */
  kiln_tensor *tok = kiln_module_forward(kiln_module_child(m, "wte"), idx);      /* (B, T, C) */
  kiln_tensor *pe = kiln_module_forward(kiln_module_child(m, "wpe"), pos);       /* (T, C) */
  kiln_module *h = kiln_module_child(m, "h"), *drop = kiln_module_child(m, "drop");
  /* no dropout on the sum (p 0, or eval): its add goes under block 0's ln_1 */
  const bool drop_none = drop && !strcmp(kiln_module_type_name(drop), "Dropout") &&
                         (c->dropout == 0 || !kiln_module_is_training(drop));
  if (tok && pe && drop_none && residual_ln_on(tok) && blocks_walkable(h)) return walk_blocks(m, h, tok, pe);
  kiln_tensor *x = kiln_module_forward(drop, kiln_add(tok, pe));
  if (x && residual_ln_on(x) && blocks_walkable(h)) return walk_blocks(m, h, x, NULL);
  x = kiln_module_forward(h, x);
  return kiln_module_forward(kiln_module_child(m, "ln_f"), x);
}

static const kiln_module_vtable attn_vt = {"CausalSelfAttention", attn_forward, NULL, free, attn_repr};
static const kiln_module_vtable mlp_vt = {"MLP", mlp_forward, NULL, free, NULL};
static const kiln_module_vtable block_vt = {"Block", block_forward, NULL, free, NULL};
static const kiln_module_vtable gpt_vt = {"GPT", gpt_forward, NULL, free, gpt_repr};

kiln_tensor *kiln_gpt_forward_loss(kiln_module *m, kiln_tensor *idx, kiln_tensor *targets, int64_t ignore_index) {
  if (!m || kiln__module_vtable(m) != &gpt_vt) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_gpt_forward_loss: %s is not a kiln_gpt_new module",
                   m ? kiln_module_type_name(m) : "NULL");
    return NULL;
  }
  if (!idx || !targets) return NULL;
  if (kiln_ndim(idx) == 2 && kiln_numel(targets) != kiln_numel(idx)) {
    char a[96], b[96];
    kiln_set_error(KILN_ERR_SHAPE, "kiln_gpt_forward_loss: targets %s do not match idx %s (one class id a token)",
                   kiln_shape_str(targets, a, sizeof a), kiln_shape_str(idx, b, sizeof b));
    return NULL;
  }
  /* the model's own module scope (what kiln_module_forward would push), its forward's
  ** intermediates in a scope of their own, the head and loss fused (the logits never whole) */
  kiln__module_scope_push(kiln__module_label(m));
  kiln_scope_begin();
  kiln_tensor *x = gpt_hidden(m, idx);
  kiln_tensor *t = x ? kiln_reshape(targets, 2, kiln_shape(idx)) : NULL;
  kiln_tensor *loss = t ? kiln_linear_cross_entropy(x, kiln_module_param(m, "wte.weight"), t, KILN_REDUCTION_MEAN,
                                                    ignore_index, 0.0)
                        : NULL;
  loss = kiln__scope_return(loss);
  kiln__module_scope_pop();
  return loss;
}

const kiln_gpt_config *kiln_gpt_config_of(const kiln_module *m) {
  const kiln_module_vtable *vt = kiln__module_vtable(m);
  if (vt == &attn_vt || vt == &mlp_vt || vt == &block_vt || vt == &gpt_vt) return kiln_module_impl(m);
  return NULL;
}

/* A module of vt whose impl is a copy of cfg, after the checks. */
static kiln_module *gpt_module(const kiln_module_vtable *vt, const kiln_gpt_config *cfg, kiln_dtype dt,
                               const char *who) {
  if (check_gpt_config(cfg, dt, who) != KILN_OK) return NULL;
  void *c = dup_cfg(cfg, sizeof *cfg, who);
  return c ? kiln_module_new(vt, c) : NULL;
}

static kiln_module *attn_new(const kiln_gpt_config *cfg, kiln_dtype dt, kiln_device dev, const gpt_init *in) {
  kiln_module *m = gpt_module(&attn_vt, cfg, dt, "kiln_causal_self_attention_new");
  if (!m) return NULL;
  const int64_t C = cfg->n_embd;
  kiln_status st = kiln_module_add_child(m, "c_attn", gpt_linear(C, 3 * C, cfg->bias, GPT_INIT_STD, dt, dev, in));
  if (st == KILN_OK) st = kiln_module_add_child(m, "c_proj", gpt_linear(C, C, cfg->bias, proj_std(cfg), dt, dev, in));
  if (st == KILN_OK) st = kiln_module_add_child(m, "resid_dropout", kiln_dropout_new(cfg->dropout, NULL));
  return st == KILN_OK ? m : fail(m);
}

static kiln_module *mlp_new(const kiln_gpt_config *cfg, kiln_dtype dt, kiln_device dev, const gpt_init *in) {
  kiln_module *m = gpt_module(&mlp_vt, cfg, dt, "kiln_gpt_mlp_new");
  if (!m) return NULL;
  const int64_t C = cfg->n_embd;
  kiln_status st = kiln_module_add_child(m, "c_fc", gpt_linear(C, 4 * C, cfg->bias, GPT_INIT_STD, dt, dev, in));
  if (st == KILN_OK) st = kiln_module_add_child(m, "gelu", kiln_gelu_new(KILN_GELU_TANH));
  if (st == KILN_OK)
    st = kiln_module_add_child(m, "c_proj", gpt_linear(4 * C, C, cfg->bias, proj_std(cfg), dt, dev, in));
  if (st == KILN_OK) st = kiln_module_add_child(m, "dropout", kiln_dropout_new(cfg->dropout, NULL));
  return st == KILN_OK ? m : fail(m);
}

static kiln_module *block_new(const kiln_gpt_config *cfg, kiln_dtype dt, kiln_device dev, const gpt_init *in) {
  kiln_module *m = gpt_module(&block_vt, cfg, dt, "kiln_gpt_block_new");
  if (!m) return NULL;
  const int64_t C = cfg->n_embd;
  kiln_status st = kiln_module_add_child(m, "ln_1", kiln_layer_norm_new(C, KILN__GPT_LN_EPS, cfg->bias, dt, dev));
  if (st == KILN_OK) st = kiln_module_add_child(m, "attn", attn_new(cfg, dt, dev, in));
  if (st == KILN_OK) st = kiln_module_add_child(m, "ln_2", kiln_layer_norm_new(C, KILN__GPT_LN_EPS, cfg->bias, dt, dev));
  if (st == KILN_OK) st = kiln_module_add_child(m, "mlp", mlp_new(cfg, dt, dev, in));
  return st == KILN_OK ? m : fail(m);
}

static kiln_module *gpt_new(const kiln_gpt_config *cfg, kiln_dtype dt, kiln_device dev, const gpt_init *in) {
  kiln_module *m = gpt_module(&gpt_vt, cfg, dt, "kiln_gpt_new");
  if (!m) return NULL;
  const int64_t C = cfg->n_embd;
  kiln_status st = KILN_OK;
  /* GPT-2's N(0, 0.02) in place of Embedding's N(0, 1), whose draws (both tables', as
  ** PyTorch makes them before re-initialising either) are skipped */
  if (in->draw) {
    kiln__generator_skip(in->gen, cfg->vocab_size * C);
    kiln__generator_skip(in->gen, cfg->block_size * C);
  }
  kiln_module *wte = embedding_new(cfg->vocab_size, C, UNDRAWN, dt, dev, NULL);
  kiln_module *wpe = wte ? embedding_new(cfg->block_size, C, UNDRAWN, dt, dev, NULL) : NULL;
  if (wte && wpe && in->draw) {
    bool prev = kiln_set_grad_enabled(false);
    st = kiln_normal_(kiln_module_param(wte, "weight"), 0.0, GPT_INIT_STD, in->gen);
    if (st == KILN_OK) st = kiln_normal_(kiln_module_param(wpe, "weight"), 0.0, GPT_INIT_STD, in->gen);
    kiln_set_grad_enabled(prev);
  }
  if (!wte || !wpe || st != KILN_OK) {
    kiln_module_free(wte);
    kiln_module_free(wpe);
    return fail(m);
  }
  st = kiln_module_add_child(m, "wte", wte);
  if (st == KILN_OK) st = kiln_module_add_child(m, "wpe", wpe);
  else kiln_module_free(wpe);
  if (st == KILN_OK) st = kiln_module_add_child(m, "drop", kiln_dropout_new(cfg->dropout, NULL));
  kiln_module *h = st == KILN_OK ? kiln_sequential_new() : NULL;
  if (st == KILN_OK) st = kiln_module_add_child(m, "h", h);
  for (int64_t i = 0; i < cfg->n_layer && st == KILN_OK; i++)
    st = kiln_sequential_append(h, block_new(cfg, dt, dev, in));
  if (st == KILN_OK) st = kiln_module_add_child(m, "ln_f", kiln_layer_norm_new(C, KILN__GPT_LN_EPS, cfg->bias, dt, dev));
  return st == KILN_OK ? m : fail(m);
}

kiln_module *kiln_causal_self_attention_new(const kiln_gpt_config *cfg, kiln_dtype dt, kiln_device dev,
                                            kiln_generator *gen) {
  return attn_new(cfg, dt, dev, &(gpt_init){gen, true});
}

kiln_module *kiln_gpt_mlp_new(const kiln_gpt_config *cfg, kiln_dtype dt, kiln_device dev, kiln_generator *gen) {
  return mlp_new(cfg, dt, dev, &(gpt_init){gen, true});
}

kiln_module *kiln_gpt_block_new(const kiln_gpt_config *cfg, kiln_dtype dt, kiln_device dev, kiln_generator *gen) {
  return block_new(cfg, dt, dev, &(gpt_init){gen, true});
}

kiln_module *kiln_gpt_new(const kiln_gpt_config *cfg, kiln_dtype dt, kiln_device dev, kiln_generator *gen) {
  return gpt_new(cfg, dt, dev, &(gpt_init){gen, true});
}

kiln_module *kiln__gpt_new_undrawn(const kiln_gpt_config *cfg, kiln_dtype dt, kiln_device dev) {
  return gpt_new(cfg, dt, dev, &(gpt_init){NULL, false});
}
