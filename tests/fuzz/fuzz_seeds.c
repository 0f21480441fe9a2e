/*
** Writes the seed corpus of every fuzz target: small valid files made with kiln's own
** writers (and IDX / CSV by hand), so the fuzzers start from inputs that reach deep into
** each reader. Usage: fuzz-seeds DIR  (makes DIR/<target>/seed-*). `make fuzz` runs it.
** For csv, idx_gz and checkpoint the first byte of an input picks options (fuzz_targets.c).
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_checkpoint.h>
#include <kiln_io.h>
#include <kiln_nn.h>
#include <kiln_optim.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "fuzz_targets.h"

#include "../fixture.h"

static char g_dir[1024];
static int g_fail;

static void path_of(char *out, size_t n, const char *target, const char *name) {
  snprintf(out, n, "%s/%s", g_dir, target);
  mkdir(out, 0777);
  snprintf(out, n, "%s/%s/%s", g_dir, target, name);
}

/* A file: an optional leading option byte (opt >= 0), then n bytes. */
static void put(const char *target, const char *name, int opt, const void *b, size_t n) {
  char p[1200];
  path_of(p, sizeof p, target, name);
  FILE *f = fopen(p, "wb");
  if (!f) {
    perror(p);
    g_fail = 1;
    return;
  }
  if (opt >= 0) fputc(opt, f);
  if (n) fwrite(b, 1, n, f);
  fclose(f);
}

/* A file kiln wrote at tmp, copied into the corpus with an optional option byte. */
static void put_file(const char *target, const char *name, int opt, const char *tmp) {
  size_t n = 0;
  unsigned char *b = read_all(tmp, &n);
  if (!b) {
    fprintf(stderr, "fuzz-seeds: %s was not written: %s\n", tmp, kiln_last_error_message());
    g_fail = 1;
    return;
  }
  put(target, name, opt, b, n);
  free(b);
  remove(tmp);
}

static void seeds_safetensors_npy(const char *tmp) {
  kiln_device cpu = kiln_device_cpu();
  kiln_dict *d = kiln_dict_new();
  kiln_dict_set(d, "w", kiln_randn(KILN_SHAPE(3, 2), KILN_F32, cpu, NULL));
  kiln_dict_set(d, "b", kiln_zeros(KILN_SHAPE(2), KILN_F64, cpu));
  kiln_dict_set(d, "h", kiln_ones(KILN_SHAPE(2, 1, 2), KILN_F16, cpu));
  kiln_dict_set(d, "bf", kiln_ones(KILN_SHAPE(1), KILN_BF16, cpu));
  kiln_dict_set(d, "i", kiln_arange(0, 4, 1, KILN_I64, cpu));
  kiln_dict_set(d, "j", kiln_arange(0, 3, 1, KILN_I32, cpu));
  kiln_dict_set(d, "u", kiln_arange(0, 5, 1, KILN_U8, cpu));
  kiln_dict_set(d, "m", kiln_ones(KILN_SHAPE(2, 2), KILN_BOOL, cpu));
  kiln_dict_set(d, "s", kiln_ones(KILN_SHAPE0, KILN_F32, cpu));
  kiln_dict_set(d, "e", kiln_zeros(KILN_SHAPE(0, 3), KILN_F32, cpu));
  kiln_dict_set_meta(d, "format", "pt");
  kiln_dict_set_meta(d, "note", "caf\xc3\xa9 \"q\"");
  kiln_safetensors_save(tmp, d);
  put_file("safetensors", "seed-all-dtypes", -1, tmp);
  kiln_dict *one = kiln_dict_new();
  kiln_dict_set(one, "x", kiln_ones(KILN_SHAPE(2), KILN_F32, cpu));
  kiln_safetensors_save(tmp, one);
  put_file("safetensors", "seed-one", -1, tmp);
  kiln_dict_free(one);
  /* a quantized file's dtypes (listed by open, refused by read and load) beside a held one */
  static const char qh[] = "{\"q\":{\"dtype\":\"F8_E4M3\",\"shape\":[2,3],\"data_offsets\":[0,6]},"
                           "\"p\":{\"dtype\":\"F4\",\"shape\":[4,2],\"data_offsets\":[6,10]},"
                           "\"s\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[10,18]}}";
  unsigned char qb[8 + sizeof qh - 1 + 18] = {(unsigned char)(sizeof qh - 1)};
  memcpy(qb + 8, qh, sizeof qh - 1);
  put("safetensors", "seed-quantized", -1, qb, sizeof qb);
  const char *npys[] = {"w", "b", "h", "i", "j", "u", "m", "s", "e"};
  for (size_t k = 0; k < sizeof npys / sizeof npys[0]; k++) {
    char name[32];
    snprintf(name, sizeof name, "seed-%s", npys[k]);
    kiln_npy_save(tmp, kiln_dict_get(d, npys[k]));
    put_file("npy", name, -1, tmp);
  }
  kiln_dict_free(d);
  /* numpy's other header forms: version 2, Fortran order, big-endian */
  static const char f2[] = "\x93NUMPY\x01\x00\x46\x00{'descr': '>i2', 'fortran_order': True, "
                           "'shape': (2, 2), }           \n\x00\x01\x00\x02\x00\x03\x00\x04";
  put("npy", "seed-fortran-be", -1, f2, sizeof f2 - 1);
  static const char v2[] = "\x93NUMPY\x02\x00\x3a\x00\x00\x00{'descr': '<u1', 'fortran_order': "
                           "False, 'shape': (3,), }  \n\x01\x02\x03";
  put("npy", "seed-v2", -1, v2, sizeof v2 - 1);
}

static size_t idx_u8(unsigned char *b) { /* (3, 2, 2) u8 */
  const unsigned char h[] = {0, 0, 0x08, 3, 0, 0, 0, 3, 0, 0, 0, 2, 0, 0, 0, 2};
  memcpy(b, h, sizeof h);
  for (int i = 0; i < 12; i++) b[16 + i] = (unsigned char)(i * 20);
  return 28;
}

static void seeds_idx(const char *tmp) {
  unsigned char b[256];
  size_t n = idx_u8(b);
  put("idx", "seed-u8", -1, b, n);
  put("idx_gz", "seed-u8", 0, b, n);
  const unsigned char types[] = {0x09, 0x0B, 0x0C, 0x0D, 0x0E};
  const int sizes[] = {1, 2, 4, 4, 8};
  for (int k = 0; k < 5; k++) {
    unsigned char t[64] = {0, 0, types[k], 1, 0, 0, 0, 3};
    for (int i = 0; i < 3 * sizes[k]; i++) t[8 + i] = (unsigned char)(0x3F + i);
    char name[32];
    snprintf(name, sizeof name, "seed-type-%02x", types[k]);
    put("idx", name, -1, t, 8 + 3 * (size_t)sizes[k]);
    put("idx_gz", name, 0, t, 8 + 3 * (size_t)sizes[k]);
  }
  const unsigned char lbl[] = {0, 0, 0x08, 1, 0, 0, 0, 4, 1, 2, 3, 9};
  put("idx", "seed-labels", -1, lbl, sizeof lbl);
  /* gzip streams as they are on disk (the odd option byte writes them unchanged) */
  gzFile g = gzopen(tmp, "wb9");
  gzwrite(g, b, (unsigned)n);
  gzclose(g);
  put_file("idx_gz", "seed-raw-gz", 1, tmp);
  g = gzopen(tmp, "wb1");
  gzwrite(g, lbl, sizeof lbl);
  gzclose(g);
  put_file("idx_gz", "seed-raw-gz-labels", 1, tmp);
}

static void seeds_csv(void) {
  static const char *const csv[] = {
      "label,a,b\n0,1.5,2\n1,-3,4e2\n",
      "x;y;label\r\n1;2;0\r\n3;4;1\r\n",
      "1\t2\t3\n4\t5\t6\n",
      "\"label\", \"f\"\n 1 , \" 2.5\"\n\n2,3\n",
      "a b c\n1 2 3\n",
      "0,nan,inf,-inf,1e-40\n",
  };
  const int opts[] = {0, 1 | 32 | 64, 2 | 16, 0, 3 | 8 | 16, 8};
  for (size_t i = 0; i < sizeof csv / sizeof csv[0]; i++) {
    char name[32];
    snprintf(name, sizeof name, "seed-%zu", i);
    put("csv", name, opts[i], csv[i], strlen(csv[i]));
  }
}

/* Checkpoints of the fuzz target's model (fuzz_targets.c: Linear(4,3), ReLU, Linear(3,2),
** Adam, StepLR(2, 0.5)) after 0, 1 and 3 steps, with and without optimizer and scheduler. */
static void seeds_checkpoint(const char *tmp) {
  kiln_manual_seed(1);
  kiln_module *m = kiln_sequential_new();
  kiln_sequential_append(m, kiln_linear_new(4, 3, true, KILN_F32, kiln_device_cpu(), NULL));
  kiln_sequential_append(m, kiln_relu_new());
  kiln_sequential_append(m, kiln_linear_new(3, 2, true, KILN_F32, kiln_device_cpu(), NULL));
  kiln_optim_config cfg = kiln_adam_config(1e-2);
  kiln_optimizer *o = kiln_optimizer_new_module(&cfg, m);
  kiln_scheduler *s = kiln_step_lr_new(o, 2, 0.5);
  for (int steps = 0; steps <= 3; steps++) {
    if (steps == 1 || steps == 3) {
      char name[64];
      kiln_dict *extra = kiln_dict_new();
      kiln_dict_set_meta(extra, "note", "seed");
      kiln_dict_set(extra, "t", kiln_ones(KILN_SHAPE(2), KILN_F32, kiln_device_cpu()));
      kiln_checkpoint_save(tmp, m, o, s, NULL, steps, steps * 10, extra);
      snprintf(name, sizeof name, "seed-full-%d", steps);
      put_file("checkpoint", name, 7, tmp);
      kiln_checkpoint_save(tmp, m, NULL, NULL, NULL, steps, steps, NULL);
      snprintf(name, sizeof name, "seed-model-%d", steps);
      put_file("checkpoint", name, 0, tmp);
      kiln_dict_free(extra);
    }
    if (steps == 0) {
      kiln_checkpoint_save(tmp, m, o, s, NULL, 0, 0, NULL);
      put_file("checkpoint", "seed-full-0", 3, tmp);
    }
    kiln_scope_begin();
    kiln_tensor *x = kiln_randn(KILN_SHAPE(5, 4), KILN_F32, kiln_device_cpu(), NULL);
    kiln_optimizer_zero_grad(o);
    kiln_backward(kiln_mean_all(kiln_module_forward(m, x)), NULL);
    kiln_optimizer_step(o);
    kiln_scheduler_step(s);
    kiln_scope_end();
  }
  kiln_scheduler_free(s);
  kiln_optimizer_free(o);
  kiln_module_free(m);
}

/* GPT-2's byte-level alphabet: byte b as the UTF-8 of its character (printable Latin-1
** bytes stand for themselves, the others for U+0100 onwards, in order). */
static int byte_char(int b, char *out) {
  int cp = b, k = 0;
  if (!((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae)) {
    cp = 256;
    for (int i = 0; i < b; i++) cp += !((i >= 0x21 && i <= 0x7e) || (i >= 0xa1 && i <= 0xac) || i >= 0xae);
  }
  if (cp < 0x80) {
    out[k++] = (char)cp;
  } else {
    out[k++] = (char)(0xc0 | cp >> 6);
    out[k++] = (char)(0x80 | (cp & 0x3f));
  }
  out[k] = 0;
  return k;
}

/* Tokenizer files: <|endoftext|> (id 0), the 256 bytes (1-256), and a few merges whose
** results follow ("\u0120" is the space). As vocab.json + NUL + merges.txt, and as
** tokenizer.json with each merge form ("a b" and ["a", "b"]). */
static void seeds_tokenizer(void) {
  static const char *const merges[][3] = {{"\u0120", "t", "\u0120t"}, {"h", "e", "he"},
                                          {"\u0120t", "he", "\u0120the"}, {"i", "n", "in"},
                                          {"\u0120", "a", "\u0120a"}, {"e", "r", "er"}};
  static const char *const merges_utf8[][2] = {{"\xc4\xa0", "t"}, {"h", "e"}, {"\xc4\xa0t", "he"},
                                               {"i", "n"},          {"\xc4\xa0", "a"}, {"e", "r"}};
  const int nm = (int)(sizeof merges / sizeof merges[0]);
  char vocab[8192], merge_txt[512], merge_json[2][512];
  size_t v = 0, m = 0, mj[2] = {0, 0};
  v += (size_t)snprintf(vocab + v, sizeof vocab - v, "{\"<|endoftext|>\": 0");
  for (int b = 0; b < 256; b++) {
    char c[4];
    byte_char(b, c);
    const char *esc = c[0] == '"' ? "\\\"" : c[0] == '\\' ? "\\\\" : c;
    v += (size_t)snprintf(vocab + v, sizeof vocab - v, ", \"%s\": %d", esc, b + 1);
  }
  for (int i = 0; i < nm; i++) v += (size_t)snprintf(vocab + v, sizeof vocab - v, ", \"%s\": %d", merges[i][2], 257 + i);
  v += (size_t)snprintf(vocab + v, sizeof vocab - v, "}");
  m += (size_t)snprintf(merge_txt + m, sizeof merge_txt - m, "#version: 0.2\n");
  for (int i = 0; i < nm; i++) {
    m += (size_t)snprintf(merge_txt + m, sizeof merge_txt - m, "%s %s\n", merges_utf8[i][0], merges_utf8[i][1]);
    mj[0] += (size_t)snprintf(merge_json[0] + mj[0], sizeof merge_json[0] - mj[0], "%s\"%s %s\"", i ? ", " : "",
                              merges[i][0], merges[i][1]);
    mj[1] += (size_t)snprintf(merge_json[1] + mj[1], sizeof merge_json[1] - mj[1], "%s[\"%s\", \"%s\"]", i ? ", " : "",
                              merges[i][0], merges[i][1]);
  }
  char pair[8192 + 520];
  memcpy(pair, vocab, v);
  pair[v] = 0;
  memcpy(pair + v + 1, merge_txt, m);
  put("tokenizer", "seed-pair", -1, pair, v + 1 + m);
  put("tokenizer", "seed-no-merges", -1, vocab, v);
  for (int f = 0; f < 2; f++) {
    char json[8192 + 1024];
    int n = snprintf(json, sizeof json,
                     "{\"version\": \"1.0\", \"added_tokens\": [{\"id\": 0, \"content\": \"<|endoftext|>\", "
                     "\"special\": true}], \"normalizer\": null, \"pre_tokenizer\": {\"type\": \"ByteLevel\", "
                     "\"add_prefix_space\": false}, \"model\": {\"type\": \"BPE\", \"dropout\": null, "
                     "\"vocab\": %s, \"merges\": [%s]}}",
                     vocab, merge_json[f]);
    put("tokenizer_json", f ? "seed-pair-merges" : "seed-string-merges", -1, json, (size_t)n);
  }
}

/* config.json as transformers writes it (kiln_gpt_save_hf's), and GPT-2 small's. */
static void seeds_gpt_config(void) {
  static const char small[] =
      "{\n  \"architectures\": [\"GPT2LMHeadModel\"],\n  \"model_type\": \"gpt2\",\n  \"activation_function\": "
      "\"gelu_new\",\n  \"n_layer\": 2,\n  \"n_head\": 2,\n  \"n_embd\": 8,\n  \"vocab_size\": 16,\n  "
      "\"n_positions\": 8,\n  \"n_ctx\": 8,\n  \"n_inner\": null,\n  \"layer_norm_epsilon\": 1e-05,\n  "
      "\"resid_pdrop\": 0.0,\n  \"embd_pdrop\": 0.0,\n  \"attn_pdrop\": 0.0,\n  \"tie_word_embeddings\": true,\n  "
      "\"task_specific_params\": {\"text-generation\": {\"do_sample\": true, \"max_length\": [50, {}]}}\n}\n";
  static const char gpt2[] =
      "{\"activation_function\": \"gelu_new\", \"attn_pdrop\": 0.1, \"bos_token_id\": 50256, \"embd_pdrop\": 0.1, "
      "\"eos_token_id\": 50256, \"initializer_range\": 0.02, \"layer_norm_epsilon\": 1e-05, \"model_type\": "
      "\"gpt2\", \"n_ctx\": 1024, \"n_embd\": 768, \"n_head\": 12, \"n_layer\": 12, \"n_positions\": 1024, "
      "\"resid_pdrop\": 0.1, \"scale_attn_weights\": true, \"summary_type\": \"cls_index\", \"vocab_size\": 50257}";
  put("gpt_config", "seed-small", -1, small, sizeof small - 1);
  put("gpt_config", "seed-gpt2", -1, gpt2, sizeof gpt2 - 1);
}

/* hf_index: the index of the target's two shards (fuzz_targets.h), as save_pretrained
** writes it (metadata first, one line a tensor), and the same map on one line. */
static void seeds_hf_index(void) {
  kiln_gpt_config c = kiln_fuzz_hf_config();
  kiln_module *m = kiln_gpt_new(&c, KILN_F32, kiln_device_cpu(), NULL);
  kiln_dict *d = m ? kiln_gpt_hf_state_dict(m) : NULL;
  int n = d ? kiln_dict_size(d) : 0;
  char pretty[8192], flat[8192];
  size_t lp = (size_t)snprintf(pretty, sizeof pretty, "{\n  \"metadata\": {\n    \"total_size\": 1\n  },\n  \"weight_map\": {\n");
  size_t lf = (size_t)snprintf(flat, sizeof flat, "{\"weight_map\":{");
  for (int i = 0; i < n && lp < sizeof pretty && lf < sizeof flat; i++) {
    const char *shard = i < n / 2 ? KILN_FUZZ_HF_SHARD_A : KILN_FUZZ_HF_SHARD_B;
    lp += (size_t)snprintf(pretty + lp, sizeof pretty - lp, "    \"%s\": \"%s\"%s\n", kiln_dict_key(d, i), shard,
                           i + 1 < n ? "," : "");
    lf += (size_t)snprintf(flat + lf, sizeof flat - lf, "%s\"%s\":\"%s\"", i ? "," : "", kiln_dict_key(d, i), shard);
  }
  if (!d || lp + 8 >= sizeof pretty || lf + 8 >= sizeof flat) {
    fprintf(stderr, "fuzz-seeds: hf_index: %s\n", d ? "the index does not fit" : kiln_last_error_message());
    g_fail = 1;
  } else {
    lp += (size_t)snprintf(pretty + lp, sizeof pretty - lp, "  }\n}\n");
    lf += (size_t)snprintf(flat + lf, sizeof flat - lf, "}}");
    put("hf_index", "seed-pretty", -1, pretty, lp);
    put("hf_index", "seed-flat", -1, flat, lf);
  }
  kiln_dict_free(d);
  kiln_module_free(m);
}

/* An event file kiln's writer made: as it is (first byte odd) and as its records, each a
** 2-byte length and the Event, for the target to frame (even). */
static void seeds_tfevents(void) {
  char dir[1200];
  snprintf(dir, sizeof dir, "%s/.tmp-tfevents", g_dir);
  kiln_summary_writer *w = kiln_summary_writer_open(dir);
  if (!w) {
    fprintf(stderr, "fuzz-seeds: %s\n", kiln_last_error_message());
    g_fail = 1;
    return;
  }
  kiln_summary_writer_add_scalar(w, "train/loss", 0, 2.5);
  kiln_summary_writer_add_scalar(w, "train/lr", 1, 1e-3);
  kiln_summary_writer_add_scalar(w, "val/loss", 100, -0.0);
  char path[1200];
  snprintf(path, sizeof path, "%s", kiln_summary_writer_path(w));
  kiln_summary_writer_close(w);
  size_t n = 0;
  unsigned char *b = read_all(path, &n);
  if (!b) {
    g_fail = 1;
    return;
  }
  put("tfevents", "seed-file", 1, b, n);
  unsigned char *rec = malloc(n + 1);
  size_t m = 0;
  for (size_t at = 0; rec && at + 12 <= n;) {
    size_t len = (size_t)b[at] | (size_t)b[at + 1] << 8; /* the events here are short */
    if (at + 16 + len > n) break;
    rec[m++] = (unsigned char)len;
    rec[m++] = (unsigned char)(len >> 8);
    memcpy(rec + m, b + at + 12, len);
    m += len;
    at += 16 + len;
  }
  if (rec) put("tfevents", "seed-records", 0, rec, m);
  free(rec);
  free(b);
  remove(path);
  rmdir(dir);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: fuzz-seeds DIR\n");
    return 2;
  }
  snprintf(g_dir, sizeof g_dir, "%s", argv[1]);
  mkdir(g_dir, 0777);
  char tmp[1200];
  snprintf(tmp, sizeof tmp, "%s/.tmp-seed", g_dir);
  kiln_scope_begin(); /* owns the tensors made for the files */
  seeds_safetensors_npy(tmp);
  seeds_idx(tmp);
  seeds_csv();
  seeds_checkpoint(tmp);
  seeds_tokenizer();
  seeds_gpt_config();
  seeds_hf_index();
  seeds_tfevents();
  kiln_scope_end();
  return g_fail;
}
