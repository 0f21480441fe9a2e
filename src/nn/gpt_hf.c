/* Hugging Face interop for GPT-2: transformers' GPT2LMHeadModel / GPT2Model names and
** layout to and from kiln's GPT (src/nn/transformer.c).
**
** The two state dicts differ in three ways only:
** - names: HF's "transformer.h.0.attn.c_attn.weight" is kiln's "h.0.attn.c_attn.weight"
**   (GPT2Model, the bare body, has no "transformer." prefix);
** - HF's c_attn, c_proj and c_fc are Conv1D modules whose weight is stored (in, out)
**   (y = x W + b), where kiln's Linear holds (out, in) (y = x W^T + b): transposed;
** - HF may list lm_head.weight (the tied head: a copy of wte) and, in older files, the
**   attention buffers attn.bias (the causal mask) and attn.masked_bias; kiln has none.
** Everything else (LayerNorm eps 1e-5, GELU tanh approximation "gelu_new", q k v in that
** order along c_attn's output, scaled attention) is the same model. */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "nn/nn_int.h"

#define HF_PREFIX "transformer."

static bool ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), m = strlen(suffix);
  return n >= m && strcmp(s + n - m, suffix) == 0;
}

/* A Conv1D weight (stored (in, out) by HF). */
static bool is_conv1d_weight(const char *kiln_name) {
  return ends_with(kiln_name, "attn.c_attn.weight") || ends_with(kiln_name, "attn.c_proj.weight") ||
         ends_with(kiln_name, "mlp.c_fc.weight") || ends_with(kiln_name, "mlp.c_proj.weight");
}

/* HF's buffers that kiln does not keep: the causal mask and the masked value. */
static bool is_hf_buffer(const char *name) {
  return ends_with(name, ".attn.bias") || ends_with(name, ".attn.masked_bias");
}

static const char *shape_of(const kiln_tensor *t, char *b, size_t n) { return kiln_shape_str(t, b, n); }

/* The GPT module's parameter names (borrowed) and tensors; n, -1 on error. */
static int gpt_params(kiln_module *gpt, const char ***names, kiln_tensor ***ts, const char *who) {
  *names = NULL;
  *ts = NULL;
  const kiln_gpt_config *c = kiln_gpt_config_of(gpt);
  if (!gpt || !c || !kiln_module_child(gpt, "wte")) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: the module is not a GPT (kiln_gpt_new)", who);
    return -1;
  }
  int n = kiln_module_named_parameters(gpt, NULL, NULL, 0);
  if (n < 0) return -1;
  *names = malloc((size_t)(n ? n : 1) * sizeof **names);
  *ts = malloc((size_t)(n ? n : 1) * sizeof **ts);
  if (!*names || !*ts) {
    free(*names);
    free(*ts);
    *names = NULL;
    *ts = NULL;
    kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
    return -1;
  }
  kiln_module_named_parameters(gpt, *names, *ts, n);
  return n;
}

/* Where the HF tensors come from: a dict in memory (kiln_gpt_load_hf), or safetensors files
** read a tensor at a time (kiln_gpt_from_hf: model.safetensors, or the shards a
** model.safetensors.index.json lists; no file is ever whole in memory). */
typedef struct hf_src {
  const kiln_dict *dict;
  kiln_safetensors **files;
  int n_files;
} hf_src;

static int src_count(const hf_src *s) {
  if (s->dict) return kiln_dict_size(s->dict);
  int n = 0;
  for (int f = 0; f < s->n_files; f++) n += kiln_safetensors_count(s->files[f]);
  return n;
}

/* Entry i: the files' tensors one file after another. */
static const char *src_key(const hf_src *s, int i) {
  if (s->dict) return kiln_dict_key(s->dict, i);
  for (int f = 0; f < s->n_files; i -= kiln_safetensors_count(s->files[f++]))
    if (i < kiln_safetensors_count(s->files[f])) return kiln_safetensors_name(s->files[f], i);
  return NULL;
}

/* The file holding name (its index in *at), or NULL. */
static kiln_safetensors *src_file(const hf_src *s, const char *name, int *at) {
  for (int f = 0; f < s->n_files; f++)
    if ((*at = kiln_safetensors_find(s->files[f], name)) >= 0) return s->files[f];
  return NULL;
}

/* name's dtype and shape (*ndim dims); false when absent. */
static bool src_info(const hf_src *s, const char *name, kiln_dtype *dt, int *ndim, int64_t *shape) {
  if (s->dict) {
    kiln_tensor *t = kiln_dict_get(s->dict, name);
    if (!t) return false;
    *dt = kiln_dtype_of(t);
    *ndim = kiln_ndim(t);
    memcpy(shape, kiln_shape(t), sizeof(int64_t) * (size_t)*ndim);
    return true;
  }
  int i;
  kiln_safetensors *f = src_file(s, name, &i);
  return f && (*ndim = kiln_safetensors_info(f, i, dt, shape)) >= 0;
}

/* name's dtype for a message: kiln's name, or the file's for one kiln does not hold. */
static const char *src_dtype_name(const hf_src *s, const char *name, kiln_dtype dt) {
  int i;
  kiln_safetensors *f = dt == KILN_DTYPE__COUNT && !s->dict ? src_file(s, name, &i) : NULL;
  return f ? kiln_safetensors_dtype(f, i) : kiln_dtype_name(dt);
}

/* name's values: the dict's own tensor (on its device), or read from its file onto the CPU
** into the current scope; NULL with the error set (absent: KILN_ERR_INTERNAL, the checks
** come first). */
static kiln_tensor *src_get(const hf_src *s, const char *name) {
  if (!s->dict) {
    int i;
    kiln_safetensors *f = src_file(s, name, &i);
    if (f) return kiln_safetensors_read(f, i, kiln_device_cpu());
  } else {
    kiln_tensor *t = kiln_dict_get(s->dict, name);
    if (t) return t;
  }
  kiln_set_error(KILN_ERR_INTERNAL, "kiln_gpt_load_hf: %s vanished after the checks", name);
  return NULL;
}

static void src_close(hf_src *s) {
  for (int f = 0; f < s->n_files; f++) kiln_safetensors_close(s->files[f]);
  free(s->files);
  *s = (hf_src){0};
}

/* One file (model.safetensors, or any path given), or a sharded checkpoint's index. */
static kiln_status src_open(hf_src *s, const char *path, bool index, const char *who) {
  if (index) {
    s->n_files = kiln_safetensors_open_index(path, &s->files);
    if (s->n_files < 0) s->n_files = 0;
    return s->files ? KILN_OK : kiln_last_error();
  }
  s->files = malloc(sizeof *s->files);
  if (!s->files) return kiln_set_error(KILN_ERR_OOM, "%s: out of host memory", who);
  s->files[0] = kiln_safetensors_open(path);
  s->n_files = s->files[0] ? 1 : 0;
  return s->n_files ? KILN_OK : kiln_last_error();
}

/* "n_layer 3, n_embd 64, vocab_size 100, n_positions 32" of a HF state, read from the
** names and shapes (what can be read; "" when nothing). */
static void describe_hf(const hf_src *src, const char *prefix, char *out, size_t n) {
  char key[128];
  int64_t layers = 0, wte[KILN_MAX_DIMS], wpe[KILN_MAX_DIMS];
  const size_t pl = strlen(prefix);
  for (int i = 0; i < src_count(src); i++) {
    const char *k = src_key(src, i);
    if (strncmp(k, prefix, pl) == 0 && strncmp(k + pl, "h.", 2) == 0) {
      long long l = strtoll(k + pl + 2, NULL, 10);
      if (l + 1 > layers) layers = l + 1;
    }
  }
  kiln_dtype dt;
  int nte = 0, npe = 0;
  snprintf(key, sizeof key, "%swte.weight", prefix);
  if (!src_info(src, key, &dt, &nte, wte)) nte = 0;
  snprintf(key, sizeof key, "%swpe.weight", prefix);
  if (!src_info(src, key, &dt, &npe, wpe)) npe = 0;
  int len = snprintf(out, n, "n_layer %lld", (long long)layers);
  if (nte == 2 && len >= 0 && (size_t)len < n)
    len += snprintf(out + len, n - (size_t)len, ", n_embd %lld, vocab_size %lld", (long long)wte[1], (long long)wte[0]);
  if (npe == 2 && len >= 0 && (size_t)len < n)
    snprintf(out + len, n - (size_t)len, ", n_positions %lld", (long long)wpe[0]);
}

/* true when a and b hold the same values (bit for bit; of different dtypes, as f64 on the host). */
static bool same_values(kiln_tensor *a, kiln_tensor *b) {
  if (kiln_numel(a) != kiln_numel(b)) return false;
  /* a file's two entries (host, contiguous): compared where they lie, no copy of either */
  if (kiln_dtype_of(a) == kiln_dtype_of(b) && kiln_is_contiguous(a) && kiln_is_contiguous(b) &&
      kiln_device_of(a).type == KILN_DEVICE_CPU && kiln_device_of(b).type == KILN_DEVICE_CPU)
    return memcmp(kiln__tensor_data(a), kiln__tensor_data(b), kiln_nbytes(a)) == 0;
  kiln_scope_begin();
  kiln_tensor *x = kiln_to_dtype(a, KILN_F64), *y = kiln_to_dtype(b, KILN_F64);
  size_t nb = x && y ? kiln_nbytes(x) : 0;
  double *u = malloc(nb ? nb : 8), *v = malloc(nb ? nb : 8);
  bool eq = x && y && u && v && kiln_to_host(x, u, nb) == KILN_OK && kiln_to_host(y, v, nb) == KILN_OK &&
            memcmp(u, v, nb) == 0;
  free(u);
  free(v);
  kiln_scope_end();
  return eq;
}

/* Every check of kiln_gpt_load_hf against src (names, shapes, dtypes, the tied head), then
** each parameter copied in from its entry, one at a time. */
static kiln_status load_hf(kiln_module *gpt, const hf_src *src, const char *who) {
  const char **names;
  kiln_tensor **params;
  int n = gpt_params(gpt, &names, &params, who);
  if (n < 0) return kiln_last_error();
  kiln_dtype dt;
  int nd;
  int64_t shape[KILN_MAX_DIMS];
  const bool prefixed = src_info(src, HF_PREFIX "wte.weight", &dt, &nd, shape);
  const char *prefix = prefixed ? HF_PREFIX : "";
  if (!prefixed && !src_info(src, "wte.weight", &dt, &nd, shape)) {
    free(names);
    free(params);
    return kiln_set_error(KILN_ERR_FORMAT,
                          "%s: neither transformer.wte.weight nor wte.weight is present: not a Hugging "
                          "Face GPT-2 state dict (GPT2LMHeadModel or GPT2Model)", who);
  }
  const size_t pl = strlen(prefix);
  kiln__problems p = {0};
  kiln_status st = KILN_OK;
  char key[256], b1[96], b2[96];
  /* Every parameter of the model has its HF entry, of its shape and a floating dtype. */
  for (int i = 0; i < n; i++) {
    snprintf(key, sizeof key, "%s%s", prefix, names[i]);
    if (!src_info(src, key, &dt, &nd, shape)) {
      kiln__problems_missing(&p, key);
      continue;
    }
    const bool conv = is_conv1d_weight(names[i]);
    const kiln_tensor *want = params[i];
    bool ok = nd == kiln_ndim(want);
    for (int k = 0; ok && k < nd; k++) ok = shape[k] == kiln_size(want, conv ? kiln_ndim(want) - 1 - k : k);
    if (!ok) {
      if (conv) /* say it in HF's (in, out) terms */
        snprintf(b2, sizeof b2, "[%lld, %lld]", (long long)kiln_size(want, 1), (long long)kiln_size(want, 0));
      else
        shape_of(want, b2, sizeof b2);
      kiln__problems_mismatch(&p, KILN_ERR_SHAPE, "%s has shape %s in the file; the model expects %s", key,
                              kiln_dims_str(nd, shape, b1, sizeof b1), b2);
      continue;
    }
    if (!kiln_dtype_is_float(dt))
      kiln__problems_mismatch(&p, KILN_ERR_DTYPE, "%s has dtype %s; expected a floating dtype", key,
                              src_dtype_name(src, key, dt));
  }
  /* Every HF entry is one of those, a buffer kiln does not keep, or the tied head. */
  kiln_scope_begin();
  for (int i = 0; i < src_count(src) && st == KILN_OK; i++) {
    const char *k = src_key(src, i);
    if (is_hf_buffer(k)) continue;
    if (strcmp(k, "lm_head.weight") == 0) {
      kiln_tensor *head = src_get(src, k), *wte = src_get(src, prefixed ? HF_PREFIX "wte.weight" : "wte.weight");
      if (!head || !wte) {
        st = kiln_last_error();
        break;
      }
      if (kiln_ndim(head) != 2 || kiln_ndim(wte) != 2 || kiln_size(head, 0) != kiln_size(wte, 0) ||
          kiln_size(head, 1) != kiln_size(wte, 1) || !same_values(head, wte))
        kiln__problems_mismatch(&p, KILN_ERR_FORMAT,
                                "lm_head.weight differs from %swte.weight: an untied output head, which "
                                "kiln's GPT (head tied to wte) cannot hold", prefix);
      continue;
    }
    bool known = false;
    if (strncmp(k, prefix, pl) == 0)
      for (int j = 0; j < n && !known; j++) known = strcmp(k + pl, names[j]) == 0;
    if (!known) kiln__problems_unexpected(&p, k);
  }
  kiln_scope_end();
  if (st == KILN_OK && kiln__problems_count(&p)) {
    kiln__problems_report(&p, who);
    /* A file of another size or another model: a format problem, with both sizes said. */
    const kiln_gpt_config *c = kiln_gpt_config_of(gpt);
    char file[160], msg[1024];
    describe_hf(src, prefix, file, sizeof file);
    snprintf(msg, sizeof msg, "%s (the file: %s; the model: n_layer %lld, n_embd %lld, vocab_size %lld, "
             "n_positions %lld)", kiln_last_error_message(), file, (long long)c->n_layer, (long long)c->n_embd,
             (long long)c->vocab_size, (long long)c->block_size);
    st = kiln_set_error(p.n_mismatch ? p.mismatch_code : KILN_ERR_FORMAT, "%s", msg);
  }
  kiln__problems_free(&p);
  /* Each parameter from its entry: transposed (Conv1D), in the model's dtype, onto its
  ** device, one at a time (a scope each: at most one entry's copies are alive). */
  bool prev = kiln_set_grad_enabled(false);
  for (int i = 0; i < n && st == KILN_OK; i++) {
    snprintf(key, sizeof key, "%s%s", prefix, names[i]);
    kiln_scope_begin();
    kiln_tensor *t = src_get(src, key), *want = params[i];
    kiln_tensor *v = t && is_conv1d_weight(names[i]) ? kiln_contiguous(kiln_transpose(t, 0, 1)) : t;
    if (v && kiln_dtype_of(v) != kiln_dtype_of(want)) v = kiln_to_dtype(v, kiln_dtype_of(want));
    if (v && !kiln_device_equal(kiln_device_of(v), kiln_device_of(want))) v = kiln_to_device(v, kiln_device_of(want));
    st = v ? kiln_copy_(want, v) : kiln_last_error();
    kiln_scope_end();
  }
  kiln_set_grad_enabled(prev);
  free(names);
  free(params);
  return st;
}

kiln_status kiln_gpt_load_hf(kiln_module *gpt, const kiln_dict *hf) {
  if (!hf) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_gpt_load_hf: NULL dict");
  hf_src src = {.dict = hf};
  return load_hf(gpt, &src, "kiln_gpt_load_hf");
}

kiln_dict *kiln_gpt_hf_state_dict(kiln_module *gpt) {
  static const char *who = "kiln_gpt_hf_state_dict";
  const char **names;
  kiln_tensor **params;
  int n = gpt_params(gpt, &names, &params, who);
  if (n < 0) return NULL;
  kiln_dict *d = kiln_dict_new();
  kiln_status st = d ? KILN_OK : kiln_last_error();
  char key[256];
  bool prev = kiln_set_grad_enabled(false);
  kiln_scope_begin();
  for (int i = 0; i < n && st == KILN_OK; i++) {
    snprintf(key, sizeof key, HF_PREFIX "%s", names[i]);
    kiln_tensor *v = is_conv1d_weight(names[i]) ? kiln_contiguous(kiln_transpose(params[i], 0, 1)) : params[i];
    st = v ? kiln_dict_set(d, key, v) : kiln_last_error();
  }
  if (st == KILN_OK) st = kiln_dict_set_meta(d, "format", "pt"); /* transformers requires it */
  kiln_scope_end();
  kiln_set_grad_enabled(prev);
  free(names);
  free(params);
  if (st != KILN_OK) {
    kiln_dict_free(d);
    return NULL;
  }
  return d;
}

/* ---- config.json ---------------------------------------------------------------------
** Only the top-level members matter; the JSON cursor the tokenizer files are read with
** (kiln__jr_*, kiln_ext.h) walks them and checks and skips every value kiln does not need. */

/* The members kiln reads. Numbers are NAN and strings "" when absent. */
typedef struct hf_cfg {
  double n_layer, n_head, n_embd, vocab_size, n_positions, n_inner, eps;
  double resid_pdrop, embd_pdrop, attn_pdrop;
  char activation[32], model_type[32];
  int tie, scale_attn, scale_by_layer; /* -1 absent, 0 false, 1 true */
} hf_cfg;

/* The member whose name kiln__jr_member left in jr->buf; 1 when read, 0 on an error. */
static int read_member(kiln__jreader *jr, hf_cfg *h) {
  static const struct {
    const char *key;
    size_t off;
  } nums[] = {{"n_layer", offsetof(hf_cfg, n_layer)},         {"n_head", offsetof(hf_cfg, n_head)},
              {"n_embd", offsetof(hf_cfg, n_embd)},           {"vocab_size", offsetof(hf_cfg, vocab_size)},
              {"n_positions", offsetof(hf_cfg, n_positions)}, {"n_inner", offsetof(hf_cfg, n_inner)},
              {"layer_norm_epsilon", offsetof(hf_cfg, eps)},  {"resid_pdrop", offsetof(hf_cfg, resid_pdrop)},
              {"embd_pdrop", offsetof(hf_cfg, embd_pdrop)},   {"attn_pdrop", offsetof(hf_cfg, attn_pdrop)}};
  char key[40] = ""; /* a longer name, or one with a \u0000 in it, is none of these: skipped */
  if (jr->len < sizeof key && strlen(jr->buf) == jr->len) memcpy(key, jr->buf, jr->len + 1);
  for (size_t k = 0; k < sizeof nums / sizeof nums[0]; k++) {
    if (strcmp(key, nums[k].key) != 0) continue;
    if (kiln__jr_peek(jr) == 'n' && jr->pos + 4 <= jr->n && !memcmp(jr->s + jr->pos, "null", 4))
      return kiln__jr_skip(jr); /* absent */
    return kiln__jr_number(jr, (double *)((char *)h + nums[k].off));
  }
  char *text = !strcmp(key, "activation_function") ? h->activation : !strcmp(key, "model_type") ? h->model_type : NULL;
  if (text) {
    if (!kiln__jr_string(jr)) return 0;
    snprintf(text, sizeof h->activation, "%s", jr->buf);
    return 1;
  }
  int *flag = strcmp(key, "tie_word_embeddings") == 0           ? &h->tie
              : strcmp(key, "scale_attn_weights") == 0            ? &h->scale_attn
              : strcmp(key, "scale_attn_by_inverse_layer_idx") == 0 ? &h->scale_by_layer
                                                                  : NULL;
  int c = kiln__jr_peek(jr);
  if (flag && (c == 't' || c == 'f')) *flag = c == 't';
  return kiln__jr_skip(jr);
}

kiln_status kiln_gpt_hf_config(const char *path, kiln_gpt_config *cfg) {
  static const char *who = "kiln_gpt_hf_config";
  if (!path || !cfg) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL argument", who);
  size_t n;
  char *s = kiln__read_regular(who, path, &n);
  if (!s) return kiln_last_error();
  kiln__jreader jr;
  kiln__jr_init(&jr, who, path, s, n);
  hf_cfg h = {NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN, "", "", -1, -1, -1};
  int first = 1, r = -1;
  if (kiln__jr_object_begin(&jr))
    while ((r = kiln__jr_member(&jr, &first)) == 1)
      if (!read_member(&jr, &h)) {
        r = -1;
        break;
      }
  if (r == 0 && kiln__jr_end(&jr) != KILN_OK) r = -1;
  kiln__jr_release(&jr);
  free(s);
  if (r != 0) return kiln_last_error();
  /* The model, its sizes, then what kiln's GPT cannot be. */
  if (h.model_type[0] && strcmp(h.model_type, "gpt2") != 0)
    return kiln_set_error(KILN_ERR_FORMAT, "%s: %s is model_type \"%s\"; kiln reads \"gpt2\"", who, path,
                          h.model_type);
  const char *missing = isnan(h.n_layer)      ? "n_layer"
                        : isnan(h.n_head)     ? "n_head"
                        : isnan(h.n_embd)     ? "n_embd"
                        : isnan(h.vocab_size) ? "vocab_size"
                        : isnan(h.n_positions) ? "n_positions"
                                              : NULL;
  if (missing) return kiln_set_error(KILN_ERR_FORMAT, "%s: %s has no %s", who, path, missing);
  if (h.activation[0] && strcmp(h.activation, "gelu_new") != 0 && strcmp(h.activation, "gelu_pytorch_tanh") != 0)
    return kiln_set_error(KILN_ERR_FORMAT,
                          "%s: %s has activation_function \"%s\"; kiln's GPT uses the tanh GELU "
                          "(\"gelu_new\")", who, path, h.activation);
  if (!isnan(h.eps) && fabs(h.eps - 1e-5) > 1e-12)
    return kiln_set_error(KILN_ERR_FORMAT, "%s: %s has layer_norm_epsilon %g; kiln's GPT uses 1e-05", who, path,
                          h.eps);
  if (!isnan(h.n_inner) && h.n_inner != 4 * h.n_embd)
    return kiln_set_error(KILN_ERR_FORMAT, "%s: %s has n_inner %g; kiln's GPT uses 4 * n_embd (%g)", who, path,
                          h.n_inner, 4 * h.n_embd);
  if (h.tie == 0 || h.scale_attn == 0 || h.scale_by_layer == 1)
    return kiln_set_error(KILN_ERR_FORMAT, "%s: %s has %s; kiln's GPT does not", who, path,
                          h.tie == 0 ? "tie_word_embeddings false (an untied head)"
                          : h.scale_attn == 0 ? "scale_attn_weights false"
                                              : "scale_attn_by_inverse_layer_idx true");
  /* The sizes kiln_gpt_new takes, so a wrong file is named here rather than by the model. */
  const struct {
    const char *key;
    double v;
  } sizes[] = {{"n_layer", h.n_layer}, {"n_head", h.n_head}, {"n_embd", h.n_embd}, {"vocab_size", h.vocab_size},
               {"n_positions", h.n_positions}};
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++)
    if (!(sizes[k].v >= 1 && sizes[k].v <= INT32_MAX && sizes[k].v == floor(sizes[k].v)))
      return kiln_set_error(KILN_ERR_FORMAT, "%s: %s has %s %g; a size is a whole number from 1 to %d", who, path,
                            sizes[k].key, sizes[k].v, INT32_MAX);
  if (fmod(h.n_embd, h.n_head) != 0)
    return kiln_set_error(KILN_ERR_FORMAT, "%s: %s has n_embd %g, not a multiple of n_head %g", who, path, h.n_embd,
                          h.n_head);
  /* an absent rate is transformers' GPT2Config default */
  if (isnan(h.resid_pdrop)) h.resid_pdrop = 0.1;
  if (isnan(h.embd_pdrop)) h.embd_pdrop = 0.1;
  if (isnan(h.attn_pdrop)) h.attn_pdrop = 0.1;
  const struct {
    const char *key;
    double v;
  } rates[] = {{"resid_pdrop", h.resid_pdrop}, {"embd_pdrop", h.embd_pdrop}, {"attn_pdrop", h.attn_pdrop}};
  for (size_t k = 0; k < sizeof rates / sizeof rates[0]; k++)
    if (!(rates[k].v >= 0 && rates[k].v < 1))
      return kiln_set_error(KILN_ERR_FORMAT, "%s: %s has %s %g; a dropout rate is in [0, 1)", who, path,
                            rates[k].key, rates[k].v);
  kiln_gpt_config c = kiln_gpt2_config();
  c.n_layer = (int64_t)h.n_layer;
  c.n_head = (int64_t)h.n_head;
  c.n_embd = (int64_t)h.n_embd;
  c.vocab_size = (int64_t)h.vocab_size;
  c.block_size = (int64_t)h.n_positions;
  c.dropout = h.resid_pdrop; /* kiln has one rate; HF's three are equal in GPT-2's files */
  c.bias = true;
  if (h.embd_pdrop != h.resid_pdrop || h.attn_pdrop != h.resid_pdrop)
    fprintf(stderr, "%s: %s: dropout rates differ (resid %g, embd %g, attn %g); kiln uses resid_pdrop for all\n",
            who, path, h.resid_pdrop, h.embd_pdrop, h.attn_pdrop);
  *cfg = c;
  return KILN_OK;
}

/* path is a directory (config.json, model.safetensors or model.safetensors.index.json in it)
** or a .safetensors file (config.json beside it). */
static bool hf_paths(const char *path, char *weights, char *config, size_t n) {
  struct stat sb;
  if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) {
    snprintf(weights, n, "%s/model.safetensors", path);
    snprintf(config, n, "%s/config.json", path);
    return true;
  }
  snprintf(weights, n, "%s", path);
  const char *slash = strrchr(path, '/');
  if (slash) snprintf(config, n, "%.*s/config.json", (int)(slash - path), path);
  else snprintf(config, n, "config.json");
  return false;
}

kiln_module *kiln_gpt_from_hf(const char *path, const kiln_gpt_config *cfg, kiln_dtype dt, kiln_device dev) {
  static const char *who = "kiln_gpt_from_hf";
  if (!path) {
    kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL path", who);
    return NULL;
  }
  char weights[4096], config[4096];
  const bool is_dir = hf_paths(path, weights, config, sizeof weights);
  kiln_gpt_config c;
  if (cfg) c = *cfg;
  else if (kiln_gpt_hf_config(config, &c) != KILN_OK) return NULL;
  hf_src src = {0};
  struct stat sb;
  kiln_status st;
  if (is_dir && stat(weights, &sb) != 0) { /* no model.safetensors: a sharded checkpoint? */
    snprintf(weights, sizeof weights, "%s/model.safetensors.index.json", path);
    st = stat(weights, &sb) == 0 ? src_open(&src, weights, true, who)
                                 : kiln_set_error(KILN_ERR_IO, "%s: %s has neither model.safetensors nor "
                                                               "model.safetensors.index.json", who, path);
  } else { /* a .safetensors file, or an index given by its path */
    st = src_open(&src, weights, ends_with(weights, ".index.json"), who);
  }
  if (st != KILN_OK) {
    src_close(&src);
    return NULL;
  }
  /* load_hf writes every weight (a missing one is an error and the model goes): none is drawn */
  kiln_module *m = kiln__gpt_new_undrawn(&c, dt, dev);
  if (m && load_hf(m, &src, "kiln_gpt_load_hf") != KILN_OK) {
    char msg[1024];
    kiln_status code = kiln_last_error();
    snprintf(msg, sizeof msg, "%s", kiln_last_error_message());
    kiln_set_error(code, "%s: %s", weights, msg);
    kiln_module_free(m);
    m = NULL;
  }
  src_close(&src);
  return m;
}

kiln_status kiln_gpt_save_hf(kiln_module *gpt, const char *dir) {
  static const char *who = "kiln_gpt_save_hf";
  if (!dir || !*dir) return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "%s: NULL or empty directory", who);
  kiln_dict *d = kiln_gpt_hf_state_dict(gpt);
  if (!d) return kiln_last_error();
  const kiln_gpt_config *c = kiln_gpt_config_of(gpt);
  if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
    kiln_dict_free(d);
    return kiln_set_error(KILN_ERR_IO, "%s: cannot make %s: %s", who, dir, strerror(errno));
  }
  char path[4096], json[2048];
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  kiln_status st = kiln_safetensors_save(path, d);
  kiln_dict_free(d);
  if (st != KILN_OK) return st;
  int n = snprintf(json, sizeof json,
                   "{\n  \"architectures\": [\"GPT2LMHeadModel\"],\n  \"model_type\": \"gpt2\",\n"
                   "  \"activation_function\": \"gelu_new\",\n  \"n_layer\": %lld,\n  \"n_head\": %lld,\n"
                   "  \"n_embd\": %lld,\n  \"vocab_size\": %lld,\n  \"n_positions\": %lld,\n  \"n_ctx\": %lld,\n"
                   "  \"n_inner\": null,\n  \"layer_norm_epsilon\": 1e-05,\n  \"resid_pdrop\": %.17g,\n"
                   "  \"embd_pdrop\": %.17g,\n  \"attn_pdrop\": %.17g,\n  \"scale_attn_weights\": true,\n"
                   "  \"tie_word_embeddings\": true\n}\n",
                   (long long)c->n_layer, (long long)c->n_head, (long long)c->n_embd, (long long)c->vocab_size,
                   (long long)c->block_size, (long long)c->block_size, c->dropout, c->dropout, c->dropout);
  snprintf(path, sizeof path, "%s/config.json", dir);
  return kiln_file_write_atomic(path, json, (size_t)n);
}
