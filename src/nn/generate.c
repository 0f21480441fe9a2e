/* Generation for the GPT-2 of transformer.c: a key/value cache per layer, the forward
** that appends to it, logit filters (temperature, top-k, top-p) and sampling, and
** kiln_gpt_generate.
**
** Two forwards over the cache:
** - eager (the prompt, kiln_gpt_forward_cached): the host knows the position p; the new
**   keys and values are copied into cache[:, :, p:p+T] and the queries attend
**   cache[:, :, :p+T] (a view);
** - the decode step (one token per row, every token after the prompt): its position lives
**   in a device tensor pos; kiln_index_copy_ writes the new keys and values at slot pos and
**   kiln_kv_attention attends the slots < pos + 1, a length it reads on the device. Every
**   shape is fixed for the whole generation and nothing is read on the host, so the step
**   is recorded once (kiln_graph_capture: a CUDA graph) and replayed per token; where there
**   is no device graph (the CPU) or graphs are off, the same step runs eagerly, so the
**   tokens are the same either way. Greedy decoding without eos also takes the argmax
**   inside the step and writes the token into the output and the next step's input, so a
**   token costs one replay and no host work; sampling (and eos) reads the step's logits
**   and samples after it.
**
** The ATTENTION kernel's causal flag lines query i up with key i (top-left), which is right
** only when Tq == Tk; a prefix of queries that starts at p > 0 is given an explicit mask
** (key j visible to query i when j <= p + i) instead. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "nn/nn_int.h"

struct kiln_kv_cache {
  int64_t n_layer, batch, max_len, n_head, head_dim;
  int64_t len;       /* positions filled (eager path; the static path advances it too) */
  /* per layer (2, B, H, max_len, D), keys then values, so that the decode step writes both
  ** with one index_copy_; k[l] and v[l] are its two halves (views). Owned; NULL until the
  ** first write. */
  kiln_tensor **kv, **k, **v;
};

/* What a cached forward needs besides the input. */
typedef struct kv_step {
  kiln_kv_cache *c;
  int64_t pos;          /* eager: the first new position */
  kiln_tensor *pos_dev; /* decode step: (1) i64, the position of the one new token; NULL: eager */
  kiln_tensor *len_dev; /* decode step: (1) i64, pos + 1: the slots valid once it is written */
} kv_step;

static bool is_gpt(const kiln_module *m) {
  return m && kiln_gpt_config_of(m) && kiln_module_child(m, "wte") && kiln_module_child(m, "h");
}

kiln_kv_cache *kiln_kv_cache_new(const kiln_module *gpt, int64_t batch, int64_t max_len) {
  static const char who[] = "kiln_kv_cache_new";
  if (!is_gpt(gpt)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: the module is not a GPT (kiln_gpt_new)", who);
    return NULL;
  }
  const kiln_gpt_config *cfg = kiln_gpt_config_of(gpt);
  if (batch < 1 || max_len < 1 || max_len > cfg->block_size) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: batch %lld, max_len %lld (batch >= 1, 1 <= max_len <= "
                   "block_size %lld)", who, (long long)batch, (long long)max_len, (long long)cfg->block_size);
    return NULL;
  }
  kiln_kv_cache *c = calloc(1, sizeof *c);
  if (c) {
    c->kv = calloc((size_t)cfg->n_layer, sizeof *c->kv);
    c->k = calloc((size_t)cfg->n_layer, sizeof *c->k);
    c->v = calloc((size_t)cfg->n_layer, sizeof *c->v);
  }
  if (!c || !c->kv || !c->k || !c->v) {
    if (c) free(c->kv), free(c->k), free(c->v);
    free(c);
    kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
    return NULL;
  }
  c->n_layer = cfg->n_layer;
  c->batch = batch;
  c->max_len = max_len;
  c->n_head = cfg->n_head;
  c->head_dim = cfg->n_embd / cfg->n_head;
  return c;
}

void kiln_kv_cache_free(kiln_kv_cache *c) {
  if (!c) return;
  for (int64_t l = 0; l < c->n_layer; l++) {
    kiln_tensor_free(c->k[l]);
    kiln_tensor_free(c->v[l]);
    kiln_tensor_free(c->kv[l]);
  }
  free(c->kv);
  free(c->k);
  free(c->v);
  free(c);
}

int64_t kiln_kv_cache_length(const kiln_kv_cache *c) { return c ? c->len : 0; }

void kiln_kv_cache_reset(kiln_kv_cache *c) {
  if (c) c->len = 0; /* stale slots are never read: the eager path views [0, len), the static one masks */
}

/* The cache of layer l, made at its first write with the dtype and device of the keys
** (under autocast the keys are bf16/f16 while the weights are f32). Zeroed, so the masked
** slots of the static path hold finite values. */
static kiln_status cache_ensure(kiln_kv_cache *c, int64_t l, kiln_tensor *k) {
  if (c->kv[l]) return KILN_OK;
  const int64_t shape[5] = {2, c->batch, c->n_head, c->max_len, c->head_dim};
  c->kv[l] = kiln_keep(kiln_zeros(5, shape, kiln_dtype_of(k), kiln_device_of(k)));
  if (!c->kv[l]) return kiln_last_error();
  c->k[l] = kiln_keep(kiln_select(c->kv[l], 0, 0));
  c->v[l] = kiln_keep(kiln_select(c->kv[l], 0, 1));
  return c->k[l] && c->v[l] ? KILN_OK : kiln_last_error();
}

/* A Linear child of m on x, with the tanh GELU after it when gelu: one kiln_linear_decode
** in the decode step (s->pos_dev set: one token a row, a pass over the weight), else the
** module's forward (and GELU). */
static kiln_tensor *lin(kiln_module *m, const char *name, kiln_tensor *x, const kv_step *s, bool gelu) {
  kiln_module *l = kiln_module_child(m, name);
  if (!s->pos_dev) {
    kiln_tensor *y = kiln_module_forward(l, x);
    return gelu ? kiln_gelu_tanh(y) : y;
  }
  const kiln_gpt_config *cfg = kiln_gpt_config_of(m);
  return kiln_linear_decode(x, kiln_module_param(l, "weight"), cfg->bias ? kiln_module_param(l, "bias") : NULL, gelu);
}

/* Causal self-attention of a GPT attention module with the cache of layer l.
** x (B, T, C) -> (B, T, C); no dropout (inference). */
static kiln_tensor *attn_cached(kiln_module *m, kiln_tensor *x, kv_step *s, int64_t l) {
  const kiln_gpt_config *cfg = kiln_gpt_config_of(m);
  const int64_t C = cfg->n_embd, H = cfg->n_head, D = C / H;
  const int64_t B = kiln_size(x, 0), T = kiln_size(x, 1);
  kiln_tensor *qkv = lin(m, "c_attn", x, s, false); /* (B, T, 3C) */
  if (!qkv) return NULL;
  kiln_tensor *part[3];
  if (kiln_split(qkv, C, 2, part, 3) != 3) return NULL;
  for (int i = 0; i < 3; i++) /* (B, T, C) -> (B, H, T, D) */
    part[i] = kiln_transpose(kiln_view(part[i], KILN_SHAPE(B, T, H, D)), 1, 2);
  if (!part[0] || !part[1] || !part[2]) return NULL;
  kiln_kv_cache *c = s->c;
  if (cache_ensure(c, l, part[1]) != KILN_OK) return NULL;
  kiln_tensor *K = c->k[l], *V = c->v[l], *y;
  if (s->pos_dev) { /* decode step: write slot pos of every row, attend the slots <= pos */
    /* the new keys and values as one (2, B, H, T, D) view of qkv[..., C:3C] */
    kiln_tensor *kv_new = kiln_permute(kiln_view(kiln_narrow(qkv, 2, C, 2 * C), KILN_SHAPE(B, T, 2, H, D)), 5,
                                       (const int[]){2, 0, 3, 1, 4});
    /* one kernel on CUDA (the write fused into the attention: a launch less per layer);
    ** KILN_KV_APPEND=0 keeps the two ops (an A/B switch for the benchmarks) */
    static int fuse = -1;
    if (fuse < 0) {
      fuse = kiln__knob_on("KILN_KV_APPEND", true);
    }
    if (fuse) {
      y = kiln_kv_attention_append(part[0], c->kv[l], kv_new, s->len_dev, 0.0); /* slot len - 1 = pos */
    } else {
      if (kiln_index_copy_(c->kv[l], 3, s->pos_dev, kv_new) != KILN_OK) return NULL;
      y = kiln_kv_attention(part[0], K, V, s->len_dev, 0.0);
    }
  } else {
    const int64_t p = s->pos;
    kiln_status st = kiln_copy_(kiln_narrow(K, 2, p, T), part[1]);
    if (st == KILN_OK) st = kiln_copy_(kiln_narrow(V, 2, p, T), part[2]);
    if (st != KILN_OK) return NULL;
    if (p == 0) { /* the prompt alone: Tq == Tk, the kernel's causal flag is right */
      y = kiln_scaled_dot_product_attention(part[0], part[1], part[2], NULL, T > 1, 0.0, 0.0, NULL);
    } else {
      kiln_tensor *keys = kiln_narrow(K, 2, 0, p + T), *vals = kiln_narrow(V, 2, 0, p + T);
      kiln_tensor *mask = NULL; /* one query sees every cached key: no mask */
      if (T > 1) { /* key j visible to query i when j <= p + i: (T, p + T) bool */
        kiln_device dev = kiln_device_of(x);
        kiln_tensor *kj = kiln_arange(0, (double)(p + T), 1, KILN_I64, dev);
        kiln_tensor *qi = kiln_view(kiln_arange((double)p, (double)(p + T), 1, KILN_I64, dev), KILN_SHAPE(T, 1));
        mask = kiln_le(kj, qi);
        if (!mask) return NULL;
      }
      y = kiln_scaled_dot_product_attention(part[0], keys, vals, mask, false, 0.0, 0.0, NULL);
    }
  }
  y = kiln_reshape(kiln_transpose(y, 1, 2), KILN_SHAPE(B, T, C)); /* (B, H, T, D) -> (B, T, C) */
  return lin(m, "c_proj", y, s, false);
}

static kiln_tensor *block_cached(kiln_module *blk, kiln_tensor *x, kv_step *s, int64_t l) {
  kiln_tensor *a = kiln_module_forward(kiln_module_child(blk, "ln_1"), x);
  x = kiln_add(x, attn_cached(kiln_module_child(blk, "attn"), a, s, l));
  if (!x) return NULL;
  kiln_tensor *b = kiln_module_forward(kiln_module_child(blk, "ln_2"), x);
  return kiln_add(x, kiln_module_forward(kiln_module_child(blk, "mlp"), b));
}

/* The eager forward (the prompt, kiln_gpt_forward_cached): idx (B, T) at the host-known
** positions s->pos .. s->pos + T - 1 -> logits (B, T, V), or (B, 1, V) for the last only. */
static kiln_tensor *gpt_cached(kiln_module *gpt, kiln_tensor *idx, kv_step *s, bool last_only) {
  const kiln_gpt_config *cfg = kiln_gpt_config_of(gpt);
  const int64_t T = kiln_size(idx, 1);
  kiln_tensor *pos = kiln_arange((double)s->pos, (double)(s->pos + T), 1, KILN_I64, kiln_device_of(idx));
  kiln_tensor *x = kiln_add(kiln_module_forward(kiln_module_child(gpt, "wte"), idx),  /* (B, T, C) */
                            kiln_module_forward(kiln_module_child(gpt, "wpe"), pos)); /* + (T, C) */
  kiln_module *h = kiln_module_child(gpt, "h");
  for (int64_t l = 0; l < cfg->n_layer && x; l++) x = block_cached(kiln_module_child_at(h, (int)l), x, s, l);
  if (x && last_only && T > 1) x = kiln_narrow(x, 1, T - 1, 1);
  x = kiln_module_forward(kiln_module_child(gpt, "ln_f"), x);
  return kiln_linear(x, kiln_module_param(gpt, "wte.weight"), NULL); /* tied lm_head */
}

/* ln's layer norm of x + r; *sum gets x + r. */
static kiln_tensor *add_ln(kiln_module *ln, const kiln_gpt_config *cfg, kiln_tensor *x, kiln_tensor *r,
                           kiln_tensor **sum) {
  return kiln_add_layer_norm(x, r, kiln_module_param(ln, "weight"), cfg->bias ? kiln_module_param(ln, "bias") : NULL,
                             KILN__GPT_LN_EPS, sum);
}

/* The decode step's forward: tok (B, 1) at s->pos_dev -> logits (B, 1, V). Each residual
** add is fused with the layer norm that reads it (kiln_add_layer_norm): the embedding sum
** with block 0's ln_1, the attention branch with the block's ln_2, the MLP branch with the
** next block's ln_1 (ln_f after the last); every product is kiln_linear_decode (one pass
** over the weight), the MLP's GELU fused into its first. A block is 8 kernels on CUDA. */
static kiln_tensor *gpt_decode(kiln_module *gpt, kiln_tensor *tok, kv_step *s) {
  const kiln_gpt_config *cfg = kiln_gpt_config_of(gpt);
  kiln_module *h = kiln_module_child(gpt, "h");
  kiln_tensor *x = NULL; /* the residual stream (B, 1, C) */
  kiln_tensor *a = add_ln(kiln_module_child(kiln_module_child_at(h, 0), "ln_1"), cfg,
                          kiln_module_forward(kiln_module_child(gpt, "wte"), tok),        /* (B, 1, C) */
                          kiln_module_forward(kiln_module_child(gpt, "wpe"), s->pos_dev), /* + (1, C) */
                          &x);
  for (int64_t l = 0; l < cfg->n_layer && a; l++) {
    kiln_module *blk = kiln_module_child_at(h, (int)l);
    kiln_tensor *b = add_ln(kiln_module_child(blk, "ln_2"), cfg, x, attn_cached(kiln_module_child(blk, "attn"), a, s, l),
                            &x);
    kiln_module *mlp = kiln_module_child(blk, "mlp"); /* c_fc + GELU, c_proj; no dropout (inference) */
    kiln_tensor *m = lin(mlp, "c_proj", lin(mlp, "c_fc", b, s, true), s, false);
    kiln_module *next = l + 1 < cfg->n_layer ? kiln_module_child(kiln_module_child_at(h, (int)l + 1), "ln_1")
                                             : kiln_module_child(gpt, "ln_f");
    a = add_ln(next, cfg, x, m, &x);
  }
  return kiln_linear_decode(a, kiln_module_param(gpt, "wte.weight"), NULL, false); /* tied lm_head */
}

/* The checks every cached forward makes; T is the number of new positions. */
static kiln_status check_cached(kiln_module *gpt, kiln_tensor *idx, kiln_kv_cache *c, const char *who) {
  if (!is_gpt(gpt)) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: the module is not a GPT (kiln_gpt_new)", who);
  if (!c) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL cache", who);
  const kiln_gpt_config *cfg = kiln_gpt_config_of(gpt);
  if (c->n_layer != cfg->n_layer || c->n_head != cfg->n_head || c->head_dim * c->n_head != cfg->n_embd)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: the cache was made for another GPT shape", who);
  char b[96];
  if (kiln_ndim(idx) != 2 || kiln_size(idx, 0) != c->batch || kiln_size(idx, 1) < 1)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: idx has shape %s; expected (%lld, T) with T >= 1 (the cache's batch)",
                          who, kiln_shape_str(idx, b, sizeof b), (long long)c->batch);
  kiln_dtype dt = kiln_dtype_of(idx);
  if (dt != KILN_I64 && dt != KILN_I32)
    return kiln_set_error(KILN_ERR_DTYPE, "%s: idx has dtype %s; expected i64 or i32 token ids", who, kiln_dtype_name(dt));
  if (c->len + kiln_size(idx, 1) > c->max_len)
    return kiln_set_error(KILN_ERR_SHAPE, "%s: %lld cached + %lld new positions exceed the cache's max_len %lld", who,
                          (long long)c->len, (long long)kiln_size(idx, 1), (long long)c->max_len);
  return KILN_OK;
}

kiln_tensor *kiln_gpt_forward_cached(kiln_module *gpt, kiln_tensor *idx, kiln_kv_cache *cache) {
  if (!idx) return NULL;
  if (check_cached(gpt, idx, cache, "kiln_gpt_forward_cached") != KILN_OK) return NULL;
  bool prev = kiln_set_grad_enabled(false);
  kv_step s = {cache, cache->len, NULL, NULL};
  kiln_tensor *y = gpt_cached(gpt, idx, &s, false);
  kiln_set_grad_enabled(prev);
  if (y) cache->len += kiln_size(idx, 1);
  return y;
}

/* ---- sampling ---------------------------------------------------------------------------- */

kiln_sample_opts kiln_sample_opts_default(void) {
  kiln_sample_opts o;
  memset(&o, 0, sizeof o);
  o.temperature = 1.0;
  o.top_k = 0;
  o.top_p = 1.0;
  o.greedy = false;
  o.eos_id = -1;
  o.graph = KILN_GEN_GRAPH_AUTO;
  return o;
}

static kiln_status check_opts(const kiln_sample_opts *o, const char *who) {
  if (!o) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL options (start from kiln_sample_opts_default())", who);
  if (!(o->temperature >= 0) || isinf(o->temperature))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: temperature %g (must be >= 0 and finite; 0 is greedy)", who,
                          o->temperature);
  if (o->top_k < 0)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: top_k %lld (must be >= 0; 0 keeps every token)", who,
                          (long long)o->top_k);
  if (!(o->top_p > 0 && o->top_p <= 1))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: top_p %g is outside (0, 1] (1 keeps every token)", who,
                          o->top_p);
  if (o->graph != KILN_GEN_GRAPH_AUTO && o->graph != KILN_GEN_GRAPH_OFF && o->graph != KILN_GEN_GRAPH_ON)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: graph %d is not a kiln_gen_graph value", who, (int)o->graph);
  return KILN_OK;
}

static bool is_greedy(const kiln_sample_opts *o) { return o->greedy || o->temperature == 0; }

/* logits (N, V) f32 -> the same with -inf where top-k / top-p remove a token. */
static kiln_tensor *filter_f32(kiln_tensor *l, const kiln_sample_opts *o) {
  const int64_t V = kiln_size(l, 1);
  kiln_tensor *ninf = kiln_scalar(-INFINITY, KILN_F32, kiln_device_of(l));
  if (o->top_k > 0 && o->top_k < V) {
    kiln_tensor *kth = kiln_narrow(kiln_topk(l, o->top_k, 1, true, true, NULL), 1, o->top_k - 1, 1); /* (N, 1) */
    l = kiln_where(kiln_lt(l, kth), ninf, l);
  }
  if (o->top_p < 1) {
    /* nucleus (Holtzman et al. 2019, as transformers' TopPLogitsWarper): with the
    ** tokens in decreasing order, keep a token while the probability of the tokens before
    ** it is < top_p (the first is always kept); the rest go. The cut is applied as a
    ** threshold on the logit, so a token tied with the last kept one is kept too. */
    kiln_tensor *sorted = kiln_topk(l, V, 1, true, true, NULL);   /* (N, V) decreasing */
    kiln_tensor *p = kiln_softmax(sorted, 1);
    kiln_tensor *before = kiln_sub(kiln_cumsum(p, 1), p);          /* mass strictly before */
    kiln_tensor *keep = kiln_to_dtype(kiln_lt_scalar(before, o->top_p), KILN_I64);
    kiln_tensor *last = kiln_add_scalar(kiln_sum(keep, 1, (const int[]){1}, true), -1); /* (N, 1) */
    kiln_tensor *thresh = kiln_gather(sorted, 1, last);           /* (N, 1) */
    l = kiln_where(kiln_lt(l, thresh), ninf, l);
  }
  return l;
}

static kiln_tensor *as_rows(kiln_tensor *logits, const char *who) {
  if (!logits) return NULL;
  char b[96];
  if (kiln_ndim(logits) != 2 || kiln_size(logits, 1) < 1 || !kiln_dtype_is_float(kiln_dtype_of(logits))) {
    kiln_set_error(KILN_ERR_SHAPE, "%s: logits have shape %s, dtype %s; expected floating (N, V) with V >= 1", who,
                   kiln_shape_str(logits, b, sizeof b), kiln_dtype_name(kiln_dtype_of(logits)));
    return NULL;
  }
  return kiln_to_dtype(logits, KILN_F32);
}

kiln_tensor *kiln_sample_filter(kiln_tensor *logits, const kiln_sample_opts *opts) {
  static const char who[] = "kiln_sample_filter";
  if (!logits) return NULL;
  if (check_opts(opts, who) != KILN_OK) return NULL;
  bool prev = kiln_set_grad_enabled(false);
  kiln_tensor *l = as_rows(logits, who);
  if (l && !is_greedy(opts) && opts->temperature != 1) l = kiln_mul_scalar(l, 1.0 / opts->temperature);
  if (l && !is_greedy(opts)) l = filter_f32(l, opts);
  kiln_set_grad_enabled(prev);
  return l;
}

kiln_tensor *kiln_sample_next(kiln_tensor *logits, const kiln_sample_opts *opts, kiln_generator *gen) {
  static const char who[] = "kiln_sample_next";
  if (!logits) return NULL;
  if (check_opts(opts, who) != KILN_OK) return NULL;
  bool prev = kiln_set_grad_enabled(false);
  kiln_tensor *l = as_rows(logits, who), *tok;
  if (is_greedy(opts)) {
    tok = kiln_argmax(l, 1, false);
  } else {
    if (l && opts->temperature != 1) l = kiln_mul_scalar(l, 1.0 / opts->temperature);
    tok = kiln_squeeze(kiln_multinomial(kiln_softmax(filter_f32(l, opts), 1), 1, true, gen), 1);
  }
  kiln_set_grad_enabled(prev);
  return tok;
}

/* ---- generate ---------------------------------------------------------------------------- */

/* How the decode step ends: with the next tokens chosen inside it (the argmax, or a draw
** by kiln_sample_tokens from the RNG state held on the device), written into out and tok,
** or with the logits for the host to choose from (eos: a finished row must be known). */
typedef enum step_mode { STEP_ARGMAX, STEP_SAMPLE, STEP_LOGITS } step_mode;

/* The decode step, for kiln_graph_capture: reads tok (B, 1), the tokens at position pos
** (1); chooses the next tokens into out (B, M) at column pos + 1 and into tok, or writes the
** last logits (B, V) f32; then advances pos (and the RNG offset after a draw). What it
** touches outside its own scope is static (owned by generate, out by the caller's scope),
** so every replay reads and writes the same addresses. */
typedef struct decode_ctx {
  kiln_module *gpt;
  kiln_kv_cache *cache;
  kiln_tensor *tok, *pos, *logits, *out;
  kiln_tensor *rng;  /* (2) i64: the generator's (seed, offset) while it draws on the device */
  step_mode mode;
  const kiln_sample_opts *opts;
} decode_ctx;

/* Draws from logits (B, V) with d->rng and advances its offset as kiln_multinomial advances
** a generator for B draws: (B, 1) i64. */
static kiln_tensor *draw(decode_ctx *d, kiln_tensor *logits) {
  const kiln_sample_opts *o = d->opts;
  kiln_tensor *t = kiln_sample_tokens(logits, d->rng, o->temperature, o->top_k, o->top_p);
  kiln_tensor *off = kiln_narrow(d->rng, 0, 1, 1);
  kiln_status st = t ? kiln_copy_(off, kiln_add_scalar(off, (double)((kiln_size(logits, 0) + 1) / 2))) : kiln_last_error();
  return st == KILN_OK ? kiln_unsqueeze(t, 1) : NULL;
}

/* The first maximum of each row of logits (B, V), NaN largest, as kiln_argmax, in one pass
** (kiln_sample_tokens at temperature 0: the MAX_DIM kernel took 463 us a 50257 row on the
** H200): (B, 1) i64. 16-bit logits convert to f32 exactly, so it is the argmax
** kiln_sample_next takes after its cast. */
static kiln_tensor *argmax(kiln_tensor *logits) {
  return kiln_unsqueeze(kiln_sample_tokens(logits, NULL, 0.0, 0, 1.0), 1);
}

static kiln_status decode_step(void *p) {
  decode_ctx *d = p;
  kiln_scope_begin();
  kiln_tensor *len = kiln_add_scalar(d->pos, 1); /* (1): the slots valid once pos is written */
  kv_step s = {d->cache, 0, d->pos, len};
  kiln_tensor *y = len ? kiln_select(gpt_decode(d->gpt, d->tok, &s), 1, 0) : NULL; /* (B, V) */
  kiln_status st = y ? KILN_OK : kiln_last_error();
  if (st == KILN_OK && d->mode != STEP_LOGITS) {
    kiln_tensor *next = d->mode == STEP_ARGMAX ? argmax(y) : draw(d, y); /* (B, 1) */
    st = next ? kiln_copy_(d->tok, next) : kiln_last_error();
    if (st == KILN_OK) st = kiln_index_copy_(d->out, 1, len, next);
  } else if (st == KILN_OK) {
    st = kiln_copy_(d->logits, y);
  }
  if (st == KILN_OK) st = kiln_copy_(d->pos, len);
  kiln_scope_end();
  return st;
}

/* One decode step: a replay once the graph exists; else the step eagerly (the first one
** always: it fills the memory cache the capture draws from), then, when graphs are wanted
** and none was tried yet, the capture (which records the step without running it). Under
** AUTO a step that cannot be captured (an op on the CPU fallback reads the device) stays
** eager; under ON that is an error. */
static kiln_status run_step(decode_ctx *d, kiln_graph **graph, bool *tried, bool want_graph, kiln_gen_graph mode,
                            kiln_device dev) {
  if (*graph) return kiln_graph_replay(*graph);
  kiln_status st = decode_step(d);
  if (st != KILN_OK || !want_graph || *tried) return st;
  *tried = true;
  *graph = kiln_graph_capture(dev, decode_step, d);
  if (*graph) return KILN_OK;
  if (mode != KILN_GEN_GRAPH_AUTO) return kiln_last_error();
  kiln_clear_error();
  return KILN_OK;
}

kiln_tensor *kiln_gpt_generate(kiln_module *gpt, kiln_tensor *ids, int64_t n_new, const kiln_sample_opts *opts,
                               kiln_generator *gen) {
  static const char who[] = "kiln_gpt_generate";
  if (!ids) return NULL;
  if (!is_gpt(gpt)) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: the module is not a GPT (kiln_gpt_new)", who);
    return NULL;
  }
  if (check_opts(opts, who) != KILN_OK) return NULL;
  const kiln_gpt_config *cfg = kiln_gpt_config_of(gpt);
  char b[96];
  kiln_dtype idt = kiln_dtype_of(ids);
  if (kiln_ndim(ids) != 2 || (idt != KILN_I64 && idt != KILN_I32)) {
    kiln_set_error(KILN_ERR_SHAPE, "%s: ids have shape %s, dtype %s; expected (B, T0) i64 or i32 token ids", who,
                   kiln_shape_str(ids, b, sizeof b), kiln_dtype_name(idt));
    return NULL;
  }
  const int64_t B = kiln_size(ids, 0), T0 = kiln_size(ids, 1);
  if (B < 1 || T0 < 1) {
    kiln_set_error(KILN_ERR_SHAPE, "%s: the prompt has shape %s; generation needs at least one token per row (T0 >= 1)",
                   who, kiln_shape_str(ids, b, sizeof b));
    return NULL;
  }
  if (n_new < 0 || T0 + n_new > cfg->block_size) {
    kiln_set_error(KILN_ERR_SHAPE, "%s: prompt of %lld tokens + n_new %lld exceeds the context (block_size %lld); "
                   "crop the prompt or generate in windows", who, (long long)T0, (long long)n_new,
                   (long long)cfg->block_size);
    return NULL;
  }
  if (opts->eos_id >= cfg->vocab_size) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: eos_id %lld is outside the vocabulary (%lld)", who,
                   (long long)opts->eos_id, (long long)cfg->vocab_size);
    return NULL;
  }
  const int64_t M = T0 + n_new;
  kiln_device dev = kiln_device_of(ids);
  const bool want_graph =
      opts->graph == KILN_GEN_GRAPH_ON || (opts->graph == KILN_GEN_GRAPH_AUTO && dev.type != KILN_DEVICE_CPU);
  bool prev = kiln_set_grad_enabled(false);
  kiln_kv_cache *cache = kiln_kv_cache_new(gpt, B, M);
  /* out lives in the caller's scope (the loop's scopes do not own it) */
  kiln_tensor *out = kiln_zeros(KILN_SHAPE(B, M), KILN_I64, dev), *logits = NULL, *done = NULL;
  const bool greedy = is_greedy(opts);
  decode_ctx d = {gpt, cache, NULL, NULL, NULL, out, NULL,
                  opts->eos_id >= 0 ? STEP_LOGITS : greedy ? STEP_ARGMAX : STEP_SAMPLE, opts};
  kiln_generator *g = gen ? gen : kiln_generator_global();
  uint64_t seed = 0, off0 = 0;
  int64_t n_draws = 0; /* draws made on the device: the generator advances by them at the end */
  kiln_graph *graph = NULL;
  bool tried = false;
  kiln_status st = cache && out ? kiln_copy_(kiln_narrow(out, 1, 0, T0), ids) : kiln_last_error();
  int64_t n_done = 0;
  if (st == KILN_OK && n_new > 0) { /* the prompt in one pass */
    kiln_scope_begin();
    kv_step s = {cache, 0, NULL, NULL};
    logits = kiln_keep(kiln_select(gpt_cached(gpt, ids, &s, true), 1, 0)); /* (B, V) */
    kiln_scope_end();
    cache->len = T0;
    if (!logits) st = kiln_last_error();
  }
  if (st == KILN_OK && n_new > 0) {
    d.tok = kiln_keep(kiln_zeros(KILN_SHAPE(B, 1), KILN_I64, dev));
    d.pos = kiln_keep(kiln_full(KILN_SHAPE(1), (double)T0, KILN_I64, dev));
    if (d.mode == STEP_LOGITS) d.logits = kiln_keep(kiln_zeros(KILN_SHAPE(B, kiln_size(logits, 1)), KILN_F32, dev));
    if (!greedy) { /* the generator's state moves to the device for the whole generation */
      kiln_generator_get_state(g, &seed, &off0);
      int64_t state[2];
      memcpy(&state[0], &seed, sizeof seed);
      memcpy(&state[1], &off0, sizeof off0);
      d.rng = kiln_keep(kiln_from_data(state, KILN_SHAPE(2), KILN_I64, dev));
    }
    if (!d.tok || !d.pos || (d.mode == STEP_LOGITS && !d.logits) || (!greedy && !d.rng)) st = kiln_last_error();
  }
  if (st == KILN_OK && n_new > 0 && d.mode != STEP_LOGITS) {
    /* the first token from the prompt's logits, then one step per token: the step chooses
    ** the next token and writes it into out and tok itself, so the host only launches */
    kiln_scope_begin();
    kiln_tensor *tok = greedy ? argmax(logits) : draw(&d, logits); /* (B, 1) */
    n_draws += !greedy;
    st = tok ? kiln_copy_(kiln_narrow(out, 1, T0, 1), tok) : kiln_last_error();
    if (st == KILN_OK) st = kiln_copy_(d.tok, tok);
    kiln_scope_end();
    for (n_done = 1; st == KILN_OK && n_done < n_new; n_done++) {
      st = run_step(&d, &graph, &tried, want_graph, opts->graph, dev);
      cache->len++;
      n_draws += !greedy;
    }
  }
  while (st == KILN_OK && d.mode == STEP_LOGITS && n_done < n_new) {
    kiln_scope_begin();
    kiln_tensor *tok = kiln_squeeze(greedy ? argmax(logits) : draw(&d, logits), 1); /* (B) i64 */
    n_draws += !greedy;
    if (tok && opts->eos_id >= 0) { /* a finished row repeats eos */
      kiln_tensor *eos = kiln_scalar((double)opts->eos_id, KILN_I64, dev);
      if (done) tok = kiln_where(done, eos, tok);
      kiln_tensor *nd = kiln_eq(tok, eos);
      nd = done ? kiln_maximum(kiln_to_dtype(done, KILN_I64), kiln_to_dtype(nd, KILN_I64)) : nd;
      kiln_tensor_free(done);
      done = kiln_keep(kiln_to_dtype(nd, KILN_BOOL));
      if (!done) tok = NULL;
    }
    st = tok ? kiln_copy_(kiln_narrow(out, 1, T0 + n_done, 1), kiln_unsqueeze(tok, 1)) : kiln_last_error();
    n_done++;
    bool stop = n_done == n_new;
    if (st == KILN_OK && !stop && done) { /* one host read per token, only with eos */
      kiln_tensor *all = kiln_amin(kiln_to_dtype(done, KILN_I64), 0, NULL, false);
      stop = all && kiln_item(all) == 1;
      if (!all) st = kiln_last_error();
    }
    if (st == KILN_OK && !stop) {
      st = kiln_copy_(d.tok, kiln_unsqueeze(tok, 1));
      if (st == KILN_OK) st = run_step(&d, &graph, &tried, want_graph, opts->graph, dev);
      cache->len++;
      if (st == KILN_OK && logits != d.logits) {
        kiln_tensor_free(logits);
        logits = d.logits; /* borrowed from here on */
      }
    }
    kiln_scope_end();
    if (st == KILN_OK && stop) break;
  }
  if (logits != d.logits) kiln_tensor_free(logits);
  kiln_tensor_free(done);
  kiln_graph_free(graph);
  kiln_tensor_free(d.tok);
  kiln_tensor_free(d.pos);
  kiln_tensor_free(d.logits);
  kiln_tensor_free(d.rng);
  kiln_kv_cache_free(cache);
  if (n_draws > 0) kiln_generator_set_state(g, seed, off0 + (uint64_t)n_draws * (uint64_t)((B + 1) / 2));
  kiln_set_grad_enabled(prev);
  if (st != KILN_OK) {
    if (kiln_scope_depth() == 0) kiln_tensor_free(out); /* no scope: it was ours to free */
    return NULL;
  }
  if (n_done == n_new) return out;
  kiln_tensor *res = kiln_narrow(out, 1, 0, T0 + n_done); /* stopped at eos: the tokens made */
  if (kiln_scope_depth() == 0) kiln_tensor_free(out);
  return res;
}
