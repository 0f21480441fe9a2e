/* The fuzz targets (see fuzz_targets.h). Built only on the public headers. */
#define _POSIX_C_SOURCE 200809L
#include "fuzz_targets.h"

#include <kiln.h>
#include <kiln_checkpoint.h>
#include <kiln_data.h>
#include <kiln_io.h>
#include <kiln_nn.h>
#include <kiln_optim.h>
#include <kiln_text.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

const char *const kiln_fuzz_target_names[] = {"safetensors", "npy",       "idx",      "idx_gz",
                                              "csv",         "checkpoint", "tokenizer", "tokenizer_json",
                                              "gpt_config",  "tfevents",   "hf_index",  NULL};

/* One scratch file per process, in memory when /dev/shm is there. */
static const char *scratch_path(void) {
  static char path[128];
  if (!path[0])
    snprintf(path, sizeof path, "%s/kiln_fuzz_%ld",
             access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp", (long)getpid());
  return path;
}

static int write_file(const char *path, const uint8_t *data, size_t size) {
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  if (size && fwrite(data, 1, size, f) != size) {
    fclose(f);
    return -1;
  }
  return fclose(f) == 0 ? 0 : -1;
}

/* data gzip-compressed into a file (the IDX reader's usual input). */
static int write_gz(const char *path, const uint8_t *data, size_t size) {
  gzFile g = gzopen(path, "wb1");
  if (!g) return -1;
  if (size && gzwrite(g, data, (unsigned)size) != (int)size) {
    gzclose(g);
    return -1;
  }
  return gzclose(g) == Z_OK ? 0 : -1;
}

/* ---- tokenizer: what a loaded tokenizer promises ---------------------------------------
** Loading checks that every byte has a token, so any bytes encode, every id is in the
** vocabulary, and decode gives the very bytes back (special tokens included). */
static int tok_round_trip(kiln_tokenizer *tok, const char *what, const char *text, size_t len) {
  int32_t *ids = NULL;
  int64_t n = -1;
  char *back = NULL;
  size_t blen = 0;
  int rc = 0;
  if (kiln_tokenizer_encode(tok, text, len, &ids, &n) != KILN_OK) {
    fprintf(stderr, "fuzz tokenizer: encoding the %s failed: %s\n", what, kiln_last_error_message());
    return -1;
  }
  for (int64_t i = 0; i < n && rc == 0; i++)
    if (ids[i] < 0 || ids[i] >= kiln_tokenizer_vocab_size(tok)) {
      fprintf(stderr, "fuzz tokenizer: the %s encoded to id %d, outside the vocabulary of %lld\n", what, ids[i],
              (long long)kiln_tokenizer_vocab_size(tok));
      rc = -1;
    }
  if (rc == 0 && (n < 0 || (size_t)n > len || (len > 0) != (n > 0))) {
    fprintf(stderr, "fuzz tokenizer: %zu bytes of the %s gave %lld ids\n", len, what, (long long)n);
    rc = -1;
  }
  if (rc == 0 && kiln_tokenizer_decode(tok, ids, n, &back, &blen) != KILN_OK) {
    fprintf(stderr, "fuzz tokenizer: decoding the %s's ids failed: %s\n", what, kiln_last_error_message());
    rc = -1;
  }
  if (rc == 0 && (blen != len || (len && memcmp(back, text, len)) || back[blen] != 0)) {
    fprintf(stderr, "fuzz tokenizer: the %s did not decode back to itself (%zu bytes, %zu back)\n", what, len, blen);
    rc = -1;
  }
  kiln_tokenizer_buffer_free(back);
  kiln_tokenizer_buffer_free(ids);
  return rc;
}

/* The file loaded whole, and opened and read tensor by tensor: both take it or both refuse
** it with the same error, and agree on every name, dtype, shape and byte; or load refuses
** a dtype kiln does not hold, which open lists and read refuses too. */
static int run_safetensors(const char *path) {
  kiln_dict *d = kiln_safetensors_load(path, kiln_device_cpu());
  kiln_status ld = d ? KILN_OK : kiln_last_error();
  kiln_safetensors *f = kiln_safetensors_open(path);
  kiln_status op = f ? KILN_OK : kiln_last_error();
  int rc = 0;
  if (ld == KILN_ERR_DTYPE && f) {
    int unheld = 0;
    for (int i = 0; i < kiln_safetensors_count(f) && rc == 0; i++) {
      kiln_dtype dt;
      if (kiln_safetensors_info(f, i, &dt, NULL) < 0 || dt != KILN_DTYPE__COUNT) continue;
      unheld++;
      kiln_tensor *t = kiln_safetensors_read(f, i, kiln_device_cpu());
      if (t || kiln_last_error() != KILN_ERR_DTYPE || !kiln_safetensors_dtype(f, i)) rc = -1;
      kiln_tensor_free(t);
    }
    if (!unheld || rc) {
      fprintf(stderr, "fuzz safetensors: load refused a dtype; open found %d such tensors\n", unheld);
      rc = -1;
    }
    ld = op;
  }
  if (ld != op) {
    fprintf(stderr, "fuzz safetensors: load gave %s, open %s\n", kiln_error_name(ld), kiln_error_name(op));
    rc = -1;
  }
  int n = d && f ? kiln_dict_size(d) : 0;
  if (d && f && kiln_safetensors_count(f) != n) rc = -1;
  for (int i = 0; i < n && rc == 0; i++) {
    kiln_tensor *want = kiln_dict_value(d, i), *got = kiln_safetensors_read(f, i, kiln_device_cpu());
    int64_t shape[KILN_MAX_DIMS];
    kiln_dtype dt;
    int nd = kiln_safetensors_info(f, i, &dt, shape);
    const char *name = kiln_safetensors_name(f, i);
    int same = got && name && !strcmp(name, kiln_dict_key(d, i)) && kiln_safetensors_find(f, name) == i &&
               nd == kiln_ndim(want) && dt == kiln_dtype_of(want) && kiln_ndim(got) == nd &&
               kiln_dtype_of(got) == dt && kiln_nbytes(got) == kiln_nbytes(want);
    for (int k = 0; same && k < nd; k++) same = shape[k] == kiln_size(want, k) && kiln_size(got, k) == shape[k];
    if (same && kiln_nbytes(want))
      same = !memcmp(kiln_data_ptr(got), kiln_data_ptr(want), kiln_nbytes(want));
    if (!same) {
      fprintf(stderr, "fuzz safetensors: tensor %d differs between load and open + read\n", i);
      rc = -1;
    }
    kiln_tensor_free(got);
  }
  kiln_safetensors_close(f);
  kiln_dict_free(d);
  return rc;
}

static int run_tokenizer(kiln_tokenizer *tok, const uint8_t *body, size_t bsize) {
  if (!tok) {
    const char *m = kiln_last_error_message();
    kiln_status code = kiln_last_error();
    if (code == KILN_OK || !m || !*m) {
      fprintf(stderr, "fuzz tokenizer: NULL without an error\n");
      return -1;
    }
    return 0;
  }
  int rc = 0;
  const int64_t vs = kiln_tokenizer_vocab_size(tok);
  const int32_t eos = kiln_tokenizer_eos_id(tok);
  if (vs < 256 || eos < -1 || eos >= vs) {
    fprintf(stderr, "fuzz tokenizer: vocabulary size %lld, eos id %d\n", (long long)vs, eos);
    rc = -1;
  }
  /* every kind of piece GPT-2's pattern cuts, special tokens, invalid UTF-8 */
  static const char sample[] = "Hello, world! It's  <|endoftext|>\t\n 12345 caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac "
                               "\xf0\x9f\x98\x80 \xff\xfe\xc3 've'll  \r\n<|endoftext|><|endoftext";
  if (rc == 0) rc = tok_round_trip(tok, "sample text", sample, sizeof sample - 1);
  if (rc == 0) rc = tok_round_trip(tok, "input's own bytes", (const char *)body, bsize < 4096 ? bsize : 4096);
  /* ids from the input: decoded, or refused as out of the vocabulary */
  int32_t ids[64];
  int64_t n = 0;
  for (size_t i = 0; i + 2 <= bsize && n < 64; i += 2) ids[n++] = (int32_t)(body[i] | body[i + 1] << 8) - 256;
  char *text = NULL;
  size_t len = 0;
  kiln_status st = kiln_tokenizer_decode(tok, ids, n, &text, &len);
  if (rc == 0 && st != KILN_OK && st != KILN_ERR_INDEX) {
    fprintf(stderr, "fuzz tokenizer: decoding ids failed with %s\n", kiln_last_error_message());
    rc = -1;
  }
  if (rc == 0 && st != KILN_OK && text) {
    fprintf(stderr, "fuzz tokenizer: a refused decode still gave text\n");
    rc = -1;
  }
  kiln_tokenizer_buffer_free(text);
  kiln_tokenizer_free(tok);
  return rc;
}

/* ---- gpt_config: a Hugging Face config.json ------------------------------------------
** What kiln_gpt_hf_config promises when it accepts a file: a config kiln_gpt_new takes. */
static int run_gpt_config(const char *path) {
  kiln_gpt_config c;
  memset(&c, 0x5a, sizeof c);
  const kiln_gpt_config before = c;
  kiln_status st = kiln_gpt_hf_config(path, &c);
  if (st != KILN_OK) {
    if (memcmp(&c, &before, sizeof c)) {
      fprintf(stderr, "fuzz gpt_config: a refused file (%s) changed the config\n", kiln_last_error_message());
      return -1;
    }
    return 0;
  }
  const int64_t big = INT64_C(1) << 31;
  if (c.n_layer < 1 || c.n_head < 1 || c.n_embd < 1 || c.vocab_size < 1 || c.block_size < 1 || c.n_layer >= big ||
      c.n_head >= big || c.n_embd >= big || c.vocab_size >= big || c.block_size >= big || c.n_embd % c.n_head ||
      !(c.dropout >= 0 && c.dropout < 1)) {
    fprintf(stderr, "fuzz gpt_config: accepted n_layer %lld n_head %lld n_embd %lld vocab %lld block %lld dropout %g\n",
            (long long)c.n_layer, (long long)c.n_head, (long long)c.n_embd, (long long)c.vocab_size,
            (long long)c.block_size, c.dropout);
    return -1;
  }
  return 0;
}

/* ---- hf_index: a sharded Hugging Face checkpoint's model.safetensors.index.json --------
** A directory made once a process holds kiln_fuzz_hf_config's GPT in two shards (fuzz_targets.h);
** each input is its index. kiln_safetensors_open_index opens one or both shards or refuses
** it; kiln_gpt_from_hf loads the model (only from an index the reader took) or refuses it
** with one of the errors it documents; no tensor outlives the call (kiln_fuzz_run checks). */
static char hf_dir[192];

static int hf_setup(void) {
  if (hf_dir[0]) return 0;
  snprintf(hf_dir, sizeof hf_dir, "%s.hf", scratch_path());
  if (mkdir(hf_dir, 0700) != 0 && errno != EEXIST) return -1;
  kiln_gpt_config c = kiln_fuzz_hf_config();
  kiln_generator *g = kiln_generator_new(1);
  kiln_module *m = kiln_gpt_new(&c, KILN_F32, kiln_device_cpu(), g);
  kiln_dict *d = m ? kiln_gpt_hf_state_dict(m) : NULL, *a = kiln_dict_new(), *b = kiln_dict_new();
  int n = d ? kiln_dict_size(d) : 0, rc = d && a && b ? 0 : -1;
  for (int i = 0; i < n && rc == 0; i++)
    if (kiln_dict_set(i < n / 2 ? a : b, kiln_dict_key(d, i), kiln_dict_value(d, i)) != KILN_OK) rc = -1;
  char path[256];
  snprintf(path, sizeof path, "%s/" KILN_FUZZ_HF_SHARD_A, hf_dir);
  if (rc == 0 && kiln_safetensors_save(path, a) != KILN_OK) rc = -1;
  snprintf(path, sizeof path, "%s/" KILN_FUZZ_HF_SHARD_B, hf_dir);
  if (rc == 0 && kiln_safetensors_save(path, b) != KILN_OK) rc = -1;
  if (rc) fprintf(stderr, "fuzz hf_index: cannot make the shards in %s: %s\n", hf_dir, kiln_last_error_message());
  kiln_dict_free(a);
  kiln_dict_free(b);
  kiln_dict_free(d);
  kiln_module_free(m);
  kiln_generator_free(g);
  return rc;
}

static int run_hf_index(const uint8_t *data, size_t size) {
  if (hf_setup() != 0) return -1;
  char path[256];
  snprintf(path, sizeof path, "%s/model.safetensors.index.json", hf_dir);
  if (write_file(path, data, size)) return 0;
  /* the index reader alone: the shards (at most the two there, each once) or one error */
  kiln_safetensors **sh = NULL;
  int ns = kiln_safetensors_open_index(path, &sh);
  kiln_status ist = ns < 0 ? kiln_last_error() : KILN_OK;
  if ((ns < 0) != (sh == NULL) || ns == 0 || ns > 2 ||
      (ns < 0 && ist != KILN_ERR_FORMAT && ist != KILN_ERR_IO && ist != KILN_ERR_OOM)) {
    fprintf(stderr, "fuzz hf_index: kiln_safetensors_open_index gave %d: %s\n", ns, kiln_last_error_message());
    return -1;
  }
  for (int i = 0; i < ns; i++) kiln_safetensors_close(sh[i]);
  free(sh);
  kiln_gpt_config c = kiln_fuzz_hf_config();
  kiln_module *m = kiln_gpt_from_hf(hf_dir, &c, KILN_F32, kiln_device_cpu());
  kiln_status st = m ? KILN_OK : kiln_last_error();
  kiln_module_free(m);
  if (m && ns < 0) {
    fprintf(stderr, "fuzz hf_index: the model loaded from an index its reader refused\n");
    return -1;
  }
  if (st != KILN_OK && st != KILN_ERR_FORMAT && st != KILN_ERR_IO && st != KILN_ERR_OOM && st != KILN_ERR_SHAPE &&
      st != KILN_ERR_DTYPE) {
    fprintf(stderr, "fuzz hf_index: %s (%s)\n", kiln_last_error_message(), kiln_error_name(st));
    return -1;
  }
  return 0;
}

/* ---- tfevents: TensorBoard's event files --------------------------------------------
** Records framed with their CRCs here (uint64 length, masked CRC-32C of it, the bytes,
** their masked CRC), so the fuzzer's changes reach the Event reader instead of its CRC
** check. in: records of a 2-byte little-endian length and that many bytes. */
static uint32_t tf_masked_crc(const void *p, size_t n) {
  uint32_t c = kiln_crc32c(p, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

static int write_framed(const char *path, const uint8_t *in, size_t n) {
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  for (size_t at = 0; at + 2 <= n;) {
    size_t len = (size_t)(in[at] | in[at + 1] << 8);
    at += 2;
    if (len > n - at) len = n - at;
    uint8_t head[12];
    for (int i = 0; i < 8; i++) head[i] = (uint8_t)((uint64_t)len >> (8 * i));
    uint32_t c = tf_masked_crc(head, 8), d = tf_masked_crc(in + at, len);
    for (int i = 0; i < 4; i++) head[8 + i] = (uint8_t)(c >> (8 * i));
    uint8_t tail[4] = {(uint8_t)d, (uint8_t)(d >> 8), (uint8_t)(d >> 16), (uint8_t)(d >> 24)};
    fwrite(head, 1, 12, f);
    if (len) fwrite(in + at, 1, len, f);
    fwrite(tail, 1, 4, f);
    at += len;
  }
  return fclose(f) == 0 ? 0 : -1;
}

static bool tf_event(const kiln_scalar_event *e, void *ctx) {
  if (!e->tag) {
    fprintf(stderr, "fuzz tfevents: a scalar without a tag\n");
    *(int *)ctx = -1;
    return false;
  }
  volatile size_t n = strlen(e->tag); /* ASan: the tag ends inside its buffer */
  (void)n;
  return true;
}

/* ---- checkpoint: a small model, Adam and a step scheduler, made once ------------------ */
static kiln_module *ck_model;
static kiln_optimizer *ck_opt;
static kiln_scheduler *ck_sched;

static int64_t ck_base; /* live tensors before the objects were made */

static void ck_teardown(void) {
  kiln_scheduler_free(ck_sched);
  kiln_optimizer_free(ck_opt);
  kiln_module_free(ck_model);
  ck_sched = NULL;
  ck_opt = NULL;
  ck_model = NULL;
}

static int ck_setup(void) {
  if (ck_model) return 0;
  ck_base = kiln_live_tensors();
  kiln_manual_seed(1);
  ck_model = kiln_sequential_new();
  kiln_sequential_append(ck_model, kiln_linear_new(4, 3, true, KILN_F32, kiln_device_cpu(), NULL));
  kiln_sequential_append(ck_model, kiln_relu_new());
  kiln_sequential_append(ck_model, kiln_linear_new(3, 2, true, KILN_F32, kiln_device_cpu(), NULL));
  kiln_optim_config cfg = kiln_adam_config(1e-2);
  ck_opt = ck_model ? kiln_optimizer_new_module(&cfg, ck_model) : NULL;
  ck_sched = ck_opt ? kiln_step_lr_new(ck_opt, 2, 0.5) : NULL;
  return ck_sched ? 0 : -1;
}

/* The model's parameters as one host array (n floats), for before/after comparisons. */
static float *ck_snapshot(size_t *n) {
  kiln_dict *d = kiln_module_state_dict(ck_model);
  if (!d) return NULL;
  size_t total = 0;
  for (int i = 0; i < kiln_dict_size(d); i++) total += (size_t)kiln_numel(kiln_dict_value(d, i));
  float *v = malloc((total ? total : 1) * sizeof *v);
  size_t at = 0;
  for (int i = 0; v && i < kiln_dict_size(d); i++) {
    kiln_tensor *t = kiln_dict_value(d, i);
    kiln_to_host(t, v + at, kiln_nbytes(t));
    at += (size_t)kiln_numel(t);
  }
  kiln_dict_free(d);
  *n = total;
  return v;
}

/* What a loaded checkpoint promises: training goes on from it. One step of the model,
** the optimizer and the scheduler must succeed and leave a finite learning rate. */
static int train_step(void) {
  kiln_scope_begin();
  kiln_tensor *x = kiln_ones(KILN_SHAPE(2, 4), KILN_F32, kiln_device_cpu());
  kiln_status st = kiln_optimizer_zero_grad(ck_opt);
  if (st == KILN_OK) st = kiln_backward(kiln_mean_all(kiln_module_forward(ck_model, x)), NULL);
  if (st == KILN_OK) st = kiln_optimizer_step(ck_opt);
  if (st == KILN_OK) st = kiln_scheduler_step(ck_sched);
  kiln_scope_end();
  double lr = kiln_optimizer_get_lr(ck_opt);
  if (st != KILN_OK || !isfinite(lr)) {
    fprintf(stderr, "fuzz checkpoint: the load succeeded but the next step failed: %s (lr %g)\n",
            st != KILN_OK ? kiln_last_error_message() : "ok", lr);
    return -1;
  }
  return 0;
}

static int run_checkpoint(const char *path, uint8_t flags) {
  if (ck_setup() != 0) {
    fprintf(stderr, "fuzz checkpoint: setup failed: %s\n", kiln_last_error_message());
    return -1;
  }
  size_t n0 = 0, n1 = 0;
  float *before = ck_snapshot(&n0);
  int64_t steps0 = kiln_optimizer_steps(ck_opt);
  double lr0 = kiln_optimizer_get_lr(ck_opt);
  int64_t epoch = -7, step = -7;
  kiln_dict *extra = NULL;
  kiln_status st = kiln_checkpoint_load(path, ck_model, (flags & 1) ? ck_opt : NULL,
                                        (flags & 2) ? ck_sched : NULL, NULL, &epoch, &step,
                                        (flags & 4) ? &extra : NULL);
  int rc = 0;
  if (st != KILN_OK) {
    float *after = ck_snapshot(&n1);
    if (!before || !after || n0 != n1 || memcmp(before, after, n0 * sizeof *before) ||
        kiln_optimizer_steps(ck_opt) != steps0 ||
        !(kiln_optimizer_get_lr(ck_opt) == lr0 || (isnan(lr0) && isnan(kiln_optimizer_get_lr(ck_opt))))) {
      fprintf(stderr, "fuzz checkpoint: a failed load (%s) changed the objects\n",
              kiln_last_error_message());
      rc = -1;
    }
    if (epoch != -7 || step != -7 || extra) {
      fprintf(stderr, "fuzz checkpoint: a failed load set epoch/step/extra\n");
      rc = -1;
    }
    free(after);
  } else if (epoch < 0 || step < 0) {
    fprintf(stderr, "fuzz checkpoint: loaded a negative epoch %lld or step %lld\n",
            (long long)epoch, (long long)step);
    rc = -1;
  }
  if (st == KILN_OK && rc == 0 && train_step() != 0) rc = -1;
  kiln_dict_free(extra);
  free(before);
  if (st == KILN_OK) {
    /* A load may rightly give the optimizer state tensors it did not have: start the next
    ** input from fresh objects, and count leaks against the count before they existed. */
    ck_teardown();
    return rc ? rc : 1;
  }
  return rc;
}

int kiln_fuzz_run(const char *name, const uint8_t *data, size_t size) {
  const char *path = scratch_path();
  int64_t live0 = kiln_live_tensors();
  int rc = 0;
  /* The first byte of csv, idx_gz and checkpoint inputs picks options; the rest is the file. */
  uint8_t opt = size ? data[0] : 0;
  const uint8_t *body = size ? data + 1 : data;
  size_t bsize = size ? size - 1 : 0;
  if (!strcmp(name, "safetensors")) {
    if (write_file(path, data, size)) return 0;
    rc = run_safetensors(path);
  } else if (!strcmp(name, "npy")) {
    if (write_file(path, data, size)) return 0;
    kiln_tensor_free(kiln_npy_load(path, kiln_device_cpu()));
  } else if (!strcmp(name, "idx")) {
    if (write_file(path, data, size)) return 0;
    kiln_tensor_free(kiln_idx_load(path));
  } else if (!strcmp(name, "idx_gz")) {
    /* odd first byte: the rest is written as it is (damaged gzip streams);
    ** even: the rest is an IDX file, gzip-compressed on the way */
    if ((opt & 1) ? write_file(path, body, bsize) : write_gz(path, body, bsize)) return 0;
    kiln_tensor_free(kiln_idx_load(path));
  } else if (!strcmp(name, "csv")) {
    if (write_file(path, body, bsize)) return 0;
    static const char delims[4] = {0, ';', '\t', ' '};
    kiln_csv_opts o;
    memset(&o, 0, sizeof o);
    o.delimiter = delims[opt & 3];
    o.header = (kiln_csv_header)((opt >> 2) % 3);
    o.no_label = (opt >> 4) & 1;
    o.label_col = (opt >> 5) & 1 ? -1 : 0;
    if ((opt >> 6) & 1) o.label_name = "label";
    kiln_tensor *x = NULL, *y = NULL;
    if (kiln_csv_load(path, &o, &x, o.no_label ? NULL : &y) == KILN_OK) {
      if (!x || (!o.no_label && !y)) {
        fprintf(stderr, "fuzz csv: success without tensors\n");
        rc = -1;
      }
      kiln_tensor_free(x);
      kiln_tensor_free(y);
    } else if (x || y) {
      fprintf(stderr, "fuzz csv: an error that still set the outputs\n");
      rc = -1;
    }
  } else if (!strcmp(name, "tokenizer")) {
    /* vocab.json, a NUL byte, merges.txt (empty when there is no NUL) */
    char path2[160];
    snprintf(path2, sizeof path2, "%s.merges", path);
    const uint8_t *nul = memchr(data, 0, size);
    size_t vn = nul ? (size_t)(nul - data) : size;
    if (write_file(path, data, vn) || write_file(path2, nul ? nul + 1 : data, nul ? size - vn - 1 : 0)) return 0;
    rc = run_tokenizer(kiln_tokenizer_load(path, path2), data, size);
    remove(path2);
  } else if (!strcmp(name, "tokenizer_json")) {
    if (write_file(path, data, size)) return 0;
    rc = run_tokenizer(kiln_tokenizer_load_json(path), data, size);
  } else if (!strcmp(name, "gpt_config")) {
    if (write_file(path, data, size)) return 0;
    rc = run_gpt_config(path);
  } else if (!strcmp(name, "hf_index")) {
    rc = run_hf_index(data, size);
  } else if (!strcmp(name, "tfevents")) {
    /* odd first byte: the rest is the file as it is (its framing and CRCs); even: records
    ** framed here */
    if ((opt & 1) ? write_file(path, body, bsize) : write_framed(path, body, bsize)) return 0;
    int bad = 0;
    kiln_status st = kiln_summary_read(path, tf_event, &bad);
    if (bad) rc = -1;
    if (st != KILN_OK && st != KILN_ERR_FORMAT && st != KILN_ERR_OOM) {
      fprintf(stderr, "fuzz tfevents: %s\n", kiln_last_error_message());
      rc = -1;
    }
  } else if (!strcmp(name, "checkpoint")) {
    if (write_file(path, body, bsize)) return 0;
    if (ck_setup() != 0) return -1;
    live0 = kiln_live_tensors(); /* the model and optimizer stay between inputs */
    rc = run_checkpoint(path, opt);
    if (rc == 1) { /* loaded; the objects were freed */
      rc = 0;
      live0 = ck_base;
    }
  } else {
    return -2;
  }
  kiln_clear_error();
  if (kiln_live_tensors() != live0) {
    fprintf(stderr, "fuzz %s: %lld tensor(s) leaked\n", name,
            (long long)(kiln_live_tensors() - live0));
    rc = -1;
  }
  return rc;
}
