/*
** gpt: a small GPT (kiln_gpt_new: nanoGPT's layout) trained on bytes of a real text, and
** sampling from its checkpoint.
**
** The corpus: Python's changelog, /usr/share/doc/python3.X/NEWS.gz, shipped by the Debian
** package python3.X (pulled in by python3, which scripts/deps.sh already installs for the
** test fixtures): no download, the same bytes on every machine of one Debian release, and
** 1.4 MB of English with a strong, easily seen structure (section headings, "- gh-issue-
** NNNNN: Fix ..." entries, :func:`...` roles, "Patch by ..."), so a model of a few hundred
** thousand parameters visibly learns it in a minute or two on a CPU. --data PATH takes any
** other text file, gzip-compressed (decompressed by running gzip -dc) or plain.
**
** Byte level: vocabulary 256, token = byte, so any text (and any prompt) encodes and the
** output is the bytes sampled. The first 90% of the text trains, the last 10% validates.
** Each step takes --batch random windows of --block bytes (starts drawn from the global
** generator, so a checkpoint's RNG state continues the same sequence of batches) and
** predicts every next byte; AdamW (betas 0.9, 0.95, weight decay 0.1 on the matrices only:
** kiln_optimizer_new_module_decay_split), gradient norm clipped to 1, cosine lr with
** warmup to --lr / 10. Every --eval-every steps: "step N: train loss X, val loss Y" (the
** mean over --eval-iters fixed windows of each split, eval mode, no grad) and a
** checkpoint (model, optimizer, scheduler, RNG, step, and the model's shape).
**
** On 2 shared CPU cores the defaults (220k parameters, 600 steps of 1024 bytes) take about
** 3 minutes and reach a validation loss near 2.2 nats/byte: samples have the entries'
** layout ("- bpo-NNNNN: Fix ...", indented continuation lines), not yet the words.
** --steps 2500 (about 10 minutes) reaches about 1.6: English words, :meth:`...` roles,
** "Patch by ...".
**
** Usage: gpt [--data PATH] [--steps N] [--batch N] [--block N] [--n-layer N] [--n-head N]
**            [--n-embd N] [--dropout P] [--lr X] [--eval-every N] [--eval-iters N]
**            [--checkpoint PATH] [--resume] [--until N] [--seed N] [--device D] [--json]
**            [--quiet] [--logdir DIR] [--checkpoint-activations] [--tokenizer DIR]
**            [--autocast bf16|f16]
**        gpt --generate PROMPT [--tokens N] [--temperature T] [--top-k K] [--top-p P]
**            [--greedy] [--seed N] [--checkpoint PATH] [--device D]
** --steps is the total: with --resume the run continues from the checkpoint's step up to N,
** with the model shape and the lr schedule the checkpoint was made with (the schedule
** spans the first run's --steps; past them the lr stays at its floor, --lr / 10).
** --json ends the output with one line: example, device, steps (reached), start_step,
** batch, block (the training window), the shape, params, seconds and tokens_per_s (the
** training steps of this run, without the evaluations), train_loss and val_loss (the last
** evaluation), seed, autocast (bf16, f16 or off, as the other examples), kiln.
** --until N stops at step N of the --steps schedule (after evaluating and writing the
** checkpoint there): a long run split into sessions, each continued with --resume.
** --tokenizer DIR trains on GPT-2 byte-level BPE tokens instead of bytes: DIR holds
** vocab.json and merges.txt, or tokenizer.json (tests/fixtures/tokenizer has one of 4096
** tokens trained locally with `tokenizers` on this same changelog:
** scripts/make_tokenizer_fixtures.py);
** the model's vocabulary is the tokenizer's, and its files are stored in the checkpoint's
** metadata, so --generate and --resume encode and decode with the tokenizer the model
** was trained with. --block then counts tokens.
** --autocast runs the forward and the loss of each training step and evaluation under
** autocast (kiln_autocast_begin): the products and attention in bf16 or f16, the norms,
** softmax and loss in f32, the parameters and their gradients f32, the checkpoint f32.
** On a GPU and on a CPU with bf16 dot products (AVX512-BF16, AMX) bf16 runs the step
** faster; f16 without a loss scaler can underflow small gradients, bf16 needs none.
** --from-hf DIR fine-tunes a pretrained GPT-2 instead of training a new model: DIR is a
** Hugging Face model directory (config.json, model.safetensors, and the tokenizer's
** vocab.json and merges.txt or its tokenizer.json, as `save_pretrained` and the hub give
** them; --tokenizer takes the tokenizer from elsewhere). The model's shape and dropout come from config.json
** (--n-layer, --n-head, --n-embd are ignored; --dropout overrides), its weights from
** model.safetensors or the shards of model.safetensors.index.json (kiln_gpt_from_hf, a
** tensor at a time); --block is the training window, up to the model's
** context (n_positions; the default). The checkpoints are this program's as usual:
** --resume and --generate need nothing from DIR afterwards.
** --checkpoint-activations makes each transformer block one gradient-checkpointing
** segment (kiln_module_set_checkpoint): the block's activations are recomputed in
** backward instead of kept, for memory, all but its attention's output (T^2 work for
** what the block's input costs again); the losses are those of the run without it.
** --checkpoint-keep products (implies --checkpoint-activations) keeps each block's
** products too (KILN_CHECKPOINT_KEEP_PRODUCTS: c_attn's and attention's c_proj's outputs),
** which the backward then does not multiply again: between the two in memory and speed.
** --generate loads the checkpoint (its shape from its metadata) and prints the prompt
** followed by --tokens sampled bytes on stdout, from kiln_gpt_generate (a KV cache, and a
** CUDA graph per token on a GPU): logits / --temperature, --top-k, --top-p (nucleus; 1:
** off), or --greedy (argmax). An empty prompt (0 tokens) is refused (exit 2); a prompt
** longer than the context keeps its last block-size - 1 bytes (a note on stderr says so),
** and a continuation past the context goes on in windows that restart from the last
** half-context of bytes.
*/
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <glob.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <fcntl.h>
#include <unistd.h>

#include <kiln.h>
#include <kiln_checkpoint.h>
#include <kiln_io.h>
#include <kiln_nn.h>
#include <kiln_optim.h>
#include <kiln_text.h>

#include "common/launch.h"
#include "common/output.h"
#include "common/logdir.h"
#include "common/options.h"
#include "common/progress.h"

#define PROG "gpt"
#define VOCAB 256 /* byte level; --tokenizer: the BPE vocabulary's size */

static void usage(FILE *f) {
  fprintf(f,
          "usage: " PROG " [--data PATH] [--steps N] [--batch N] [--block N] [--n-layer N] [--n-head N]\n"
          "           [--n-embd N] [--dropout P] [--lr X] [--eval-every N] [--eval-iters N]\n"
          "           [--checkpoint PATH] [--resume] [--until N] [--seed N] [--device D] [--json]\n"
          "           [--quiet] [--logdir DIR] [--checkpoint-activations] [--tokenizer DIR]\n"
          "           [--checkpoint-keep default|products] [--autocast bf16|f16] [--from-hf DIR]\n"
          "       " PROG " --generate PROMPT [--tokens N] [--temperature T] [--top-k K] [--top-p P]\n"
          "           [--greedy] [--seed N] [--checkpoint PATH] [--device D]\n"
          "  A byte-level GPT on a text: by default Python's changelog from the Debian package\n"
          "  python3.X (/usr/share/doc/python3.X/NEWS.gz); 90%% trains, 10%% validates.\n"
          "  Defaults: 600 steps, batch 16, block 64, 4 layers, 4 heads, 64 wide, dropout 0,\n"
          "  AdamW lr 3e-3 (cosine, 60 warmup steps), eval every 100 steps over 20 windows,\n"
          "  checkpoint gpt.ckpt.safetensors. --generate: 300 tokens, temperature 0.8, top-k 40,\n"
          "  top-p 1 (off), seed 0 (KV cache). A prompt longer than the context keeps its last\n"
          "  block-size - 1 bytes. --from-hf DIR fine-tunes a Hugging Face GPT-2 (config.json,\n"
          "  model.safetensors, vocab.json and merges.txt or tokenizer.json in DIR) instead of a\n"
          "  new model.\n");
}

/* Everything main makes, released on every way out (LeakSanitizer checks the error exits
** too). NULL members are skipped: every free function takes NULL. */
static int64_t vocab = VOCAB; /* the model's vocabulary: 256 bytes, or the tokenizer's */

static struct {
  unsigned char *text;
  int32_t *tok;             /* the corpus as token ids (bytes, or BPE ids) */
  kiln_tokenizer *bpe;      /* --tokenizer, or the one a checkpoint carries */
  char *bpe_vocab, *bpe_merges; /* its files' text, stored in checkpoints: vocab.json and */
  char *bpe_json;               /* merges.txt, or tokenizer.json (the other two NULL) */
  int64_t *xb, *yb; /* one batch of windows on the host */
  kiln_module *model;
  kiln_optimizer *opt;
  kiln_scheduler *sched;
  kiln_generator *gen; /* --generate: the sampling draws; training: the eval windows */
  kiln_safetensors *ckf; /* the checkpoint opened for its metadata (its header alone) */
  int64_t window;        /* the checkpoint's training window ("extra.window"), 0: its context */
  kiln_tensor **params;  /* the model's, borrowed (for the gradient clipping) */
  kiln_summary_writer *tb;
  kiln_dtype amp;      /* --autocast: KILN_BF16 or KILN_F16; KILN_F32 for none */
} R;

static void release(void) {
  free(R.text);
  free(R.tok);
  kiln_tokenizer_free(R.bpe);
  free(R.bpe_vocab);
  free(R.bpe_merges);
  free(R.bpe_json);
  free(R.xb);
  free(R.yb);
  free(R.params);
  kiln_scheduler_free(R.sched);
  kiln_optimizer_free(R.opt);
  kiln_module_free(R.model);
  kiln_generator_free(R.gen);
  kiln_safetensors_close(R.ckf);
  ex_log_close(R.tb);
  memset(&R, 0, sizeof R);
}

EX_DEFINE_EXITS(PROG, release)

/* ---- the corpus ---------------------------------------------------------------------- */

/* NULL when path is a regular file; else why it is not one (a FIFO would wait for a writer,
** a device like /dev/zero never end). */
static const char *not_regular(const char *path) {
  struct stat st;
  if (stat(path, &st) != 0) return "no such file";
  return S_ISREG(st.st_mode) ? NULL : "not a regular file";
}

/* The default corpus: /usr/share/doc/python3.X/NEWS.gz of the package python3.X
** (python3.11 on Debian 12), the highest X installed; python3.X-dev's copy of the same file
** is not taken. Writes the path into out; false when none is installed. */
static bool default_corpus(char *out, size_t n) {
  glob_t g;
  bool found = false;
  if (glob("/usr/share/doc/python3.*/NEWS.gz", 0, NULL, &g) == 0) {
    for (size_t i = g.gl_pathc; i-- > 0 && !found;) {
      const char *x = g.gl_pathv[i] + strlen("/usr/share/doc/python3.");
      size_t digits = strspn(x, "0123456789");
      if (digits > 0 && x[digits] == '/' && !not_regular(g.gl_pathv[i])) {
        snprintf(out, n, "%s", g.gl_pathv[i]);
        found = true;
      }
    }
  }
  globfree(&g);
  return found;
}

/* Appends everything fd gives to *buf (*len bytes, *cap allocated). false on OOM or a
** read error. */
static bool read_all(int fd, unsigned char **buf, size_t *len, size_t *cap) {
  for (;;) {
    if (*cap - *len < 65536) {
      size_t nc = *cap ? *cap * 2 : 1 << 20;
      unsigned char *nb = realloc(*buf, nc);
      if (!nb) return false;
      *buf = nb, *cap = nc;
    }
    ssize_t r = read(fd, *buf + *len, *cap - *len);
    if (r < 0) return false;
    if (r == 0) return true;
    *len += (size_t)r;
  }
}

/* The whole text of path into R.text: a gzip file (magic 1f 8b) through `gzip -dc`, run
** directly (no shell), anything else as it is. Prints why and returns false on failure. */
static bool load_corpus(const char *path, int64_t *n_out) {
  const char *why = not_regular(path);
  if (why) {
    fprintf(stderr, PROG ": --data '%s': %s\n", path, why);
    return false;
  }
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, PROG ": --data '%s': cannot open it\n", path);
    return false;
  }
  unsigned char magic[2] = {0, 0};
  size_t got = fread(magic, 1, 2, f);
  size_t len = 0, cap = 0;
  bool ok;
  if (got == 2 && magic[0] == 0x1f && magic[1] == 0x8b) {
    fclose(f);
    int p[2];
    if (pipe(p) != 0) {
      fprintf(stderr, PROG ": --data '%s': cannot make a pipe for gzip\n", path);
      return false;
    }
    pid_t pid = fork();
    if (pid < 0) {
      close(p[0]), close(p[1]);
      fprintf(stderr, PROG ": --data '%s': cannot start gzip\n", path);
      return false;
    }
    if (pid == 0) {
      dup2(p[1], 1);
      close(p[0]), close(p[1]);
      execlp("gzip", "gzip", "-dc", "--", path, (char *)NULL);
      _exit(127);
    }
    close(p[1]);
    ok = read_all(p[0], &R.text, &len, &cap);
    close(p[0]);
    int ws = 0;
    waitpid(pid, &ws, 0);
    if (!WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
      fprintf(stderr, PROG ": --data '%s': gzip -dc failed (%s)\n", path,
              WIFEXITED(ws) && WEXITSTATUS(ws) == 127 ? "gzip is not installed" : "a broken gzip file?");
      return false;
    }
  } else {
    rewind(f);
    ok = read_all(fileno(f), &R.text, &len, &cap);
    fclose(f);
  }
  if (!ok) {
    fprintf(stderr, PROG ": --data '%s': reading failed (out of memory or a read error)\n", path);
    return false;
  }
  *n_out = (int64_t)len;
  return true;
}

/* ---- the BPE tokenizer (--tokenizer) ------------------------------------------------ */

/* Writes text to a new temporary file (its path into path) for kiln_tokenizer_load*, which
** read paths; false when it cannot. */
static bool temp_text(const char *name, const char *text, char *path, size_t n) {
  const char *dir = getenv("TMPDIR");
  snprintf(path, n, "%s/gpt-%s-XXXXXX", dir && *dir ? dir : "/tmp", name);
  int fd = mkstemp(path);
  if (fd < 0) return false;
  size_t len = strlen(text);
  bool ok = write(fd, text, len) == (ssize_t)len;
  close(fd);
  if (!ok) unlink(path);
  return ok;
}

/* R's tokenizer becomes t, with the text of its files for the next checkpoint (owned:
** vocab.json's and merges.txt's, or tokenizer.json's, the others NULL). */
static void set_tokenizer(kiln_tokenizer *t, char *vocab_json, char *merges_txt, char *tokenizer_json) {
  kiln_tokenizer_free(R.bpe);
  free(R.bpe_vocab);
  free(R.bpe_merges);
  free(R.bpe_json);
  R.bpe = t;
  R.bpe_vocab = vocab_json, R.bpe_merges = merges_txt, R.bpe_json = tokenizer_json;
}

/* The tokenizer a checkpoint carries, from the text of its files (vocab_json and merges_txt,
** or tokenizer_json). Prints why on failure. */
static bool load_bpe_text(const char *vocab_json, const char *merges_txt, const char *tokenizer_json) {
  char pv[1024] = "", pm[1024] = "";
  bool ok = tokenizer_json ? temp_text("tokenizer", tokenizer_json, pv, sizeof pv)
                           : temp_text("vocab", vocab_json, pv, sizeof pv) &&
                                 (temp_text("merges", merges_txt, pm, sizeof pm) || (unlink(pv), false));
  if (!ok) {
    const char *dir = getenv("TMPDIR");
    fprintf(stderr, PROG ": cannot write the tokenizer to temporary files in %s\n", dir && *dir ? dir : "/tmp");
    return false;
  }
  kiln_tokenizer *t = tokenizer_json ? kiln_tokenizer_load_json(pv) : kiln_tokenizer_load(pv, pm);
  unlink(pv);
  if (*pm) unlink(pm);
  if (!t) {
    fprintf(stderr, PROG ": the checkpoint's tokenizer: %s\n", kiln_last_error_message());
    return false;
  }
  char *v = vocab_json ? strdup(vocab_json) : NULL, *m = merges_txt ? strdup(merges_txt) : NULL;
  char *j = tokenizer_json ? strdup(tokenizer_json) : NULL;
  set_tokenizer(t, v, m, j);
  if (tokenizer_json ? !j : !v || !m) {
    fprintf(stderr, PROG ": out of memory keeping the tokenizer\n");
    return false;
  }
  return true;
}

/* A whole regular file as a NUL-terminated string; NULL with *why when it cannot be read. */
static char *read_text_file(const char *path, const char **why) {
  if ((*why = not_regular(path)) != NULL) return NULL;
  *why = "cannot read it";
  int fd = open(path, O_RDONLY);
  if (fd < 0) return NULL;
  unsigned char *buf = NULL;
  size_t len = 0, cap = 0;
  bool ok = read_all(fd, &buf, &len, &cap);
  close(fd);
  if (!ok || memchr(buf, 0, len)) { /* a NUL could not travel in the checkpoint's metadata */
    free(buf);
    return NULL;
  }
  buf[len] = 0; /* read_all leaves room: at least 64 KiB free after a read */
  return (char *)buf;
}

/* --tokenizer DIR (or --from-hf's DIR, flag says which): DIR/vocab.json and DIR/merges.txt
** (GPT-2's pair, as scripts/make_tokenizer_fixtures.py writes for tests/fixtures/tokenizer),
** or, where DIR has no vocab.json, DIR/tokenizer.json (the `tokenizers` library's one file,
** all some Hugging Face models ship). Read from DIR (errors name its files), the texts kept. */
static bool load_bpe_dir(const char *flag, const char *dir) {
  char pv[1024], pm[1024], pj[1024];
  snprintf(pv, sizeof pv, "%s/vocab.json", dir);
  snprintf(pm, sizeof pm, "%s/merges.txt", dir);
  snprintf(pj, sizeof pj, "%s/tokenizer.json", dir);
  const char *why = NULL;
  struct stat st;
  const bool one = stat(pv, &st) != 0 && errno == ENOENT && stat(pj, &st) == 0;
  char *v = NULL, *m = NULL, *j = NULL;
  if (one ? !(j = read_text_file(pj, &why)) : !(v = read_text_file(pv, &why)) || !(m = read_text_file(pm, &why))) {
    fprintf(stderr, PROG ": %s '%s': cannot read %s: %s%s\n", flag, dir, one ? pj : v ? pm : pv, why,
            one ? "" : " (the directory needs vocab.json and merges.txt, or tokenizer.json)");
    free(v);
    return false;
  }
  kiln_tokenizer *t = one ? kiln_tokenizer_load_json(pj) : kiln_tokenizer_load(pv, pm);
  if (!t) {
    fprintf(stderr, PROG ": %s '%s': %s\n", flag, dir, kiln_last_error_message());
    free(v), free(m), free(j);
    return false;
  }
  set_tokenizer(t, v, m, j);
  return true;
}

/* ---- batches and losses -------------------------------------------------------------- */

/* batch windows of block bytes from text[lo, hi) into R.xb (inputs) and R.yb (the next
** bytes), starts uniform from gen; then (B, T) i64 tensors on dev in the caller's scope. */
static kiln_status get_batch(const int32_t *text, int64_t lo, int64_t hi, int64_t batch, int64_t block,
                             kiln_generator *gen, kiln_device dev, kiln_tensor **x, kiln_tensor **y) {
  for (int64_t b = 0; b < batch; b++) {
    int64_t s = lo + (int64_t)kiln_generator_below(gen, (uint64_t)(hi - lo - block));
    for (int64_t t = 0; t < block; t++) {
      R.xb[b * block + t] = text[s + t];
      R.yb[b * block + t] = text[s + t + 1];
    }
  }
  *x = kiln_from_data(R.xb, 2, (int64_t[]){batch, block}, KILN_I64, dev);
  *y = kiln_from_data(R.yb, 2, (int64_t[]){batch, block}, KILN_I64, dev);
  return *x && *y ? KILN_OK : kiln_last_error();
}

/* Mean cross-entropy of next-byte predictions: logits (B, T, V) against y (B, T), under
** --autocast when given (the loss in f32 either way). */
static kiln_tensor *lm_loss(kiln_module *model, kiln_tensor *x, kiln_tensor *y) {
  const bool amp = R.amp != KILN_F32;
  if (amp && kiln_autocast_begin(kiln_device_of(x).type, R.amp) != KILN_OK) return NULL;
  kiln_tensor *logits = kiln_module_forward(model, x); /* (B, T, V) */
  int64_t n = kiln_numel(y);
  kiln_tensor *loss = kiln_cross_entropy(kiln_reshape(logits, 2, (int64_t[]){n, vocab}), kiln_reshape(y, 1, &n),
                                         KILN_REDUCTION_MEAN, -100, 0.0);
  if (amp && kiln_autocast_end() != KILN_OK) return NULL;
  return loss;
}

/* The loss over iters fixed windows of text[lo, hi): the generator restarts from the same
** seed each time, so every evaluation sees the same windows and the numbers compare. Eval
** mode (no dropout), no graph. NAN on error. */
static double estimate_loss(kiln_module *model, const int32_t *text, int64_t lo, int64_t hi, int64_t iters,
                            int64_t batch, int64_t block, uint64_t seed, kiln_device dev) {
  kiln_generator_seed(R.gen, seed);
  bool prev = kiln_set_grad_enabled(false);
  kiln_module_eval(model);
  double sum = 0;
  for (int64_t i = 0; i < iters && !isnan(sum); i++) {
    kiln_scope_begin();
    kiln_tensor *x, *y;
    double l = get_batch(text, lo, hi, batch, block, R.gen, dev, &x, &y) == KILN_OK
                   ? kiln_item(lm_loss(model, x, y))
                   : NAN;
    kiln_scope_end();
    sum += l;
  }
  kiln_module_train(model, true);
  kiln_set_grad_enabled(prev);
  return sum / (double)iters;
}

/* ---- the checkpoint's model shape ---------------------------------------------------- */

static bool meta_int(const kiln_dict *d, const char *key, int64_t *out) {
  const char *s = kiln_dict_get_meta(d, key);
  char *end = NULL;
  if (!s || !*s) return false;
  long long v = strtoll(s, &end, 10);
  if (*end) return false;
  *out = v;
  return true;
}

/* The shape a checkpoint was trained with (its "extra.*" metadata) into cfg. Prints why
** and returns false when the file is not one of this program's checkpoints. */
static bool read_shape(const char *path, kiln_gpt_config *cfg) {
  struct stat st;
  if (stat(path, &st) != 0) {
    fprintf(stderr, PROG ": no checkpoint at '%s' (train first, or pass --checkpoint PATH)\n", path);
    return false;
  }
  if (!S_ISREG(st.st_mode)) { /* a FIFO would block the load */
    fprintf(stderr, PROG ": '%s' is not a regular file\n", path);
    return false;
  }
  R.ckf = kiln_safetensors_open(path); /* the header: the tensors are read by the checkpoint loader */
  if (!R.ckf) {
    fprintf(stderr, PROG ": reading '%s': %s\n", path, kiln_last_error_message());
    return false;
  }
  const kiln_dict *meta = kiln_safetensors_metadata(R.ckf);
  int64_t n_vocab = 0, bias = 1;
  const char *dr = kiln_dict_get_meta(meta, "extra.dropout");
  if (!meta_int(meta, "extra.n_layer", &cfg->n_layer) || !meta_int(meta, "extra.n_head", &cfg->n_head) ||
      !meta_int(meta, "extra.n_embd", &cfg->n_embd) || !meta_int(meta, "extra.block_size", &cfg->block_size) ||
      !meta_int(meta, "extra.vocab_size", &n_vocab) || !meta_int(meta, "extra.bias", &bias) || !dr) {
    fprintf(stderr, PROG ": '%s' is not a checkpoint of " PROG " (no model shape in its metadata)\n", path);
    return false;
  }
  const char *tv = kiln_dict_get_meta(meta, "extra.tokenizer_vocab");
  const char *tm = kiln_dict_get_meta(meta, "extra.tokenizer_merges");
  const char *tj = kiln_dict_get_meta(meta, "extra.tokenizer_json");
  if ((tv && tm) || tj) { /* a BPE model: its tokenizer travels in the checkpoint */
    if (!load_bpe_text(tj ? NULL : tv, tj ? NULL : tm, tj)) return false;
    if (n_vocab != kiln_tokenizer_vocab_size(R.bpe)) {
      fprintf(stderr, PROG ": '%s' has a vocabulary of %lld but its tokenizer %lld\n", path, (long long)n_vocab,
              (long long)kiln_tokenizer_vocab_size(R.bpe));
      return false;
    }
  } else if (n_vocab != VOCAB) {
    fprintf(stderr, PROG ": '%s' has a vocabulary of %lld and no tokenizer; byte level is %d\n", path,
            (long long)n_vocab, VOCAB);
    return false;
  }
  if (!meta_int(meta, "extra.window", &R.window)) R.window = 0; /* checkpoints from before --from-hf */
  vocab = n_vocab;
  cfg->vocab_size = n_vocab;
  cfg->dropout = strtod(dr, NULL);
  cfg->bias = bias != 0;
  return true;
}

/* ---- sampling ------------------------------------------------------------------------ */

/* Writes n tokens to stdout: bytes, or decoded by the BPE tokenizer. */
static kiln_status put_tokens(const int64_t *ids, int64_t n) {
  if (!R.bpe) {
    for (int64_t i = 0; i < n; i++) putchar((int)ids[i]);
  } else {
    int32_t *t = malloc(sizeof *t * (size_t)(n ? n : 1));
    if (!t) return kiln_set_error(KILN_ERR_OOM, "out of host memory");
    for (int64_t i = 0; i < n; i++) t[i] = (int32_t)ids[i];
    char *text = NULL;
    size_t len = 0;
    kiln_status st = kiln_tokenizer_decode(R.bpe, t, n, &text, &len);
    free(t);
    if (st != KILN_OK) return st;
    fwrite(text, 1, len, stdout);
    kiln_tokenizer_buffer_free(text);
  }
  fflush(stdout);
  return KILN_OK;
}

/* Prints prompt followed by n_new sampled tokens (bytes, or BPE tokens decoded), from kiln_gpt_generate (a KV cache; a
** CUDA graph per token on a GPU). The context holds block_size bytes: a prompt longer
** than that keeps its last block_size - 1 bytes, and a continuation that would run past
** the context goes on in windows, each restarting from the last half-context of bytes
** (the learned positions stop at block_size: there is no sliding cache). */
static int generate(const char *ckpt, const char *prompt, int64_t n_new, const kiln_sample_opts *so,
                    uint64_t seed, kiln_device dev, bool quiet) {
  size_t plen = strlen(prompt);
  if (plen == 0) {
    fprintf(stderr, PROG ": --generate: the prompt is empty (0 tokens); give at least one character\n");
    return finish(2);
  }
  kiln_gpt_config cfg = kiln_gpt2_config();
  if (!read_shape(ckpt, &cfg)) return finish(2);
  kiln_safetensors_close(R.ckf);
  R.ckf = NULL;
  kiln_generator *scratch = R.gen = kiln_generator_new(0); /* takes the checkpoint's RNG state */
  if (!scratch) return fail("making a generator");
  kiln_module *model = R.model = kiln_gpt_new(&cfg, KILN_F32, dev, scratch);
  if (!model) return fail("building the model");
  if (kiln_checkpoint_load(ckpt, model, NULL, NULL, scratch, NULL, NULL, NULL) != KILN_OK)
    return fail("loading the checkpoint");
  kiln_generator_seed(R.gen, seed);
  kiln_module_eval(model);

  const int64_t block = cfg.block_size;
  if (block < 2) {
    fprintf(stderr, PROG ": the checkpoint's context is %lld byte; sampling needs at least 2\n", (long long)block);
    return finish(2);
  }
  /* the prompt's tokens: its bytes, or the checkpoint's BPE ids */
  int32_t *enc = NULL;
  int64_t n_prompt = (int64_t)plen;
  if (R.bpe && kiln_tokenizer_encode(R.bpe, prompt, plen, &enc, &n_prompt) != KILN_OK)
    return fail("encoding the prompt");
  int64_t total = n_prompt + n_new;
  int64_t *ids = R.xb = malloc(sizeof *ids * (size_t)total);
  if (!ids) {
    kiln_tokenizer_buffer_free(enc);
    return fail("allocating the sequence");
  }
  for (int64_t i = 0; i < n_prompt; i++) ids[i] = enc ? enc[i] : (unsigned char)prompt[i];
  kiln_tokenizer_buffer_free(enc);
  if (n_prompt >= block && !quiet)
    fprintf(stderr, PROG ": the prompt (%lld %s) leaves no room in the context (%lld): the model sees its last %lld\n",
            (long long)n_prompt, R.bpe ? "tokens" : "bytes", (long long)block, (long long)(block - 1));
  fwrite(prompt, 1, plen, stdout);
  fflush(stdout);

  kiln_status st = KILN_OK;
  for (int64_t n = n_prompt; n < total && st == KILN_OK;) {
    int64_t left = total - n;
    /* the window: as much history as leaves room for the rest, at least half a context */
    int64_t ctx = n < block - 1 ? n : block - 1;
    if (ctx + left > block && ctx > block / 2) ctx = n < block / 2 ? n : (block / 2 > 0 ? block / 2 : 1);
    int64_t chunk = block - ctx < left ? block - ctx : left;
    kiln_scope_begin();
    kiln_tensor *x = kiln_from_data(ids + n - ctx, 2, (int64_t[]){1, ctx}, KILN_I64, dev);
    kiln_tensor *out = kiln_gpt_generate(model, x, chunk, so, R.gen); /* (1, ctx + chunk) */
    st = out ? kiln_to_host(kiln_contiguous(kiln_narrow(out, 1, ctx, chunk)), ids + n, sizeof *ids * (size_t)chunk)
             : kiln_last_error();
    kiln_scope_end();
    if (st == KILN_OK) {
      st = put_tokens(ids + n, chunk); /* byte-level BPE: concatenated pieces decode alike */
      n += chunk;
    }
  }
  if (st != KILN_OK) {
    putchar('\n');
    return fail("sampling");
  }
  putchar('\n');
  fflush(stdout);
  kiln_fallback_report(stderr);
  return finish(0);
}

/* ---- training ------------------------------------------------------------------------ */

static kiln_status save(const char *ckpt, const kiln_gpt_config *cfg, int64_t window, int64_t step,
                        double train_loss, double val_loss, const char *corpus) {
  kiln_dict *extra = kiln_dict_new();
  if (!extra) return kiln_last_error();
  const struct {
    const char *k;
    long long v;
  } ints[] = {{"n_layer", cfg->n_layer},       {"n_head", cfg->n_head}, {"n_embd", cfg->n_embd},
              {"block_size", cfg->block_size}, {"vocab_size", vocab},   {"bias", cfg->bias},
              {"window", window}};
  kiln_status st = KILN_OK;
  for (size_t i = 0; i < sizeof ints / sizeof ints[0] && st == KILN_OK; i++)
    st = ex_meta_int(extra, ints[i].k, ints[i].v);
  if (st == KILN_OK) st = ex_meta_real(extra, "dropout", cfg->dropout);
  if (st == KILN_OK) st = ex_meta_real(extra, "train_loss", train_loss);
  if (st == KILN_OK) st = ex_meta_real(extra, "val_loss", val_loss);
  if (st == KILN_OK) st = kiln_dict_set_meta(extra, "corpus", corpus);
  if (st == KILN_OK && R.bpe_vocab) st = kiln_dict_set_meta(extra, "tokenizer_vocab", R.bpe_vocab);
  if (st == KILN_OK && R.bpe_merges) st = kiln_dict_set_meta(extra, "tokenizer_merges", R.bpe_merges);
  if (st == KILN_OK && R.bpe_json) st = kiln_dict_set_meta(extra, "tokenizer_json", R.bpe_json);
  if (st == KILN_OK) st = kiln_checkpoint_save(ckpt, R.model, R.opt, R.sched, NULL, 0, step, extra);
  kiln_dict_free(extra);
  return st;
}

/* --from-hf DIR: the model's shape and dropout from DIR/config.json into cfg, and the
** tokenizer (DIR's, or tokenizer's), whose vocabulary must be the model's. Prints why and
** returns false on failure. */
static bool hf_setup(const char *dir, const char *tokenizer, kiln_gpt_config *cfg) {
  char path[1100];
  snprintf(path, sizeof path, "%s/config.json", dir);
  if (kiln_gpt_hf_config(path, cfg) != KILN_OK) {
    fprintf(stderr, PROG ": --from-hf '%s': %s\n", dir, kiln_last_error_message());
    return false;
  }
  if (!load_bpe_dir(tokenizer ? "--tokenizer" : "--from-hf", tokenizer ? tokenizer : dir)) return false;
  if (kiln_tokenizer_vocab_size(R.bpe) != cfg->vocab_size) {
    fprintf(stderr, PROG ": --from-hf '%s': the model's vocabulary is %lld tokens, the tokenizer's %lld\n", dir,
            (long long)cfg->vocab_size, (long long)kiln_tokenizer_vocab_size(R.bpe));
    return false;
  }
  vocab = cfg->vocab_size;
  return true;
}

int main(int argc, char **argv) {
  /* block 0 and dropout -1: not given (a new model's 64 and 0; --from-hf: the model's) */
  long long steps = 600, batch = 16, block = 0, n_layer = 4, n_head = 4, n_embd = 64;
  long long eval_every = 100, eval_iters = 20, seed = 0, n_tokens = 300, top_k = 40, until = 0;
  double lr = 3e-3, dropout = -1, temperature = 0.8, top_p = 1.0;
  bool json = false, quiet = false, resume = false, shape_flag = false, arch_flag = false, greedy = false,
       ckpt_act = false;
  const char *logdir = NULL, *devname = NULL, *data = NULL, *prompt = NULL, *tokenizer = NULL, *amp = NULL;
  const char *from_hf = NULL;
  const char *ckpt_keep = NULL;
  const char *ckpt = "gpt.ckpt.safetensors";
  const ex_opt opts[] = {{.name = "--json", .kind = EX_FLAG, .out = &json},
                         {.name = "--quiet", .kind = EX_FLAG, .out = &quiet, .alias = "-q"},
                         {.name = "--resume", .kind = EX_FLAG, .out = &resume},
                         {.name = "--greedy", .kind = EX_FLAG, .out = &greedy},
                         {.name = "--checkpoint-activations", .kind = EX_FLAG, .out = &ckpt_act},
                         {.name = "--checkpoint-keep", .kind = EX_CHOICE, .out = &ckpt_keep,
                          .choices = "default|products"},
                         {.name = "--device", .kind = EX_STR, .out = &devname},
                         {.name = "--data", .kind = EX_STR, .out = &data},
                         {.name = "--logdir", .kind = EX_STR, .out = &logdir},
                         {.name = "--checkpoint", .kind = EX_STR, .out = &ckpt},
                         {.name = "--tokenizer", .kind = EX_STR, .out = &tokenizer},
                         {.name = "--from-hf", .kind = EX_STR, .out = &from_hf},
                         {.name = "--autocast", .kind = EX_AUTOCAST, .out = &amp},
                         {.name = "--generate", .kind = EX_STR, .out = &prompt},
                         {.name = "--lr", .kind = EX_NUM, .out = &lr, .lo = 0, .hi = 10},
                         {.name = "--temperature", .kind = EX_NUM, .out = &temperature, .lo = 0, .hi = 100},
                         {.name = "--top-p", .kind = EX_NUM, .out = &top_p, .lo = 0, .hi = 1},
                         /* the options that change the model's shape (shape_flag, arch_flag: see below) */
                         {.name = "--dropout", .kind = EX_NUM_0, .out = &dropout, .lo = 0, .hi = 0.9, .seen = &shape_flag},
                         {.name = "--block", .kind = EX_INT, .out = &block, .lo = 1, .hi = 65536, .seen = &shape_flag},
                         {.name = "--n-layer", .kind = EX_INT, .out = &n_layer, .lo = 1, .hi = 1024, .seen = &arch_flag},
                         {.name = "--n-head", .kind = EX_INT, .out = &n_head, .lo = 1, .hi = 1024, .seen = &arch_flag},
                         {.name = "--n-embd", .kind = EX_INT, .out = &n_embd, .lo = 1, .hi = 65536, .seen = &arch_flag},
                         {.name = "--steps", .kind = EX_INT, .out = &steps, .lo = 1, .hi = 10000000},
                         {.name = "--batch", .kind = EX_INT, .out = &batch, .lo = 1, .hi = 65536},
                         {.name = "--eval-every", .kind = EX_INT, .out = &eval_every, .lo = 1, .hi = 10000000},
                         {.name = "--until", .kind = EX_INT, .out = &until, .lo = 1, .hi = 10000000},
                         {.name = "--eval-iters", .kind = EX_INT, .out = &eval_iters, .lo = 1, .hi = 100000},
                         {.name = "--seed", .kind = EX_INT, .out = &seed, .lo = 0, .hi = 2147483647},
                         {.name = "--tokens", .kind = EX_INT, .out = &n_tokens, .lo = 1, .hi = 1000000},
                         {.name = "--top-k", .kind = EX_INT, .out = &top_k, .lo = 0, .hi = 1000000},
                         {.name = NULL}};
  int prc = ex_parse_args(PROG, argc, argv, opts, usage);
  if (prc >= 0) return prc;
  R.amp = !amp ? KILN_F32 : !strcmp(amp, "f16") ? KILN_F16 : KILN_BF16;
  if (ex_check_env(PROG, devname != NULL)) return 2; /* a bad KILN_* value is refused, not ignored */
  kiln_device dev = kiln_device_best();
  char dname[32];
  if (ex_device(PROG, devname, &dev, dname)) return 2;
  if (prompt && (tokenizer || from_hf))
    fprintf(stderr, PROG ": note: --generate samples from the checkpoint, with its own tokenizer; %s is ignored\n",
            tokenizer ? "--tokenizer" : "--from-hf");
  if (prompt) {
    kiln_sample_opts so = kiln_sample_opts_default();
    so.temperature = temperature, so.top_k = top_k, so.top_p = top_p, so.greedy = greedy;
    return generate(ckpt, prompt, n_tokens, &so, (uint64_t)seed, dev, quiet);
  }

  if (ex_check_output(PROG, ckpt)) return 2;
  R.tb = ex_log_open(PROG, logdir); /* exits on a bad directory: before anything is allocated */
  kiln_gpt_config cfg = kiln_gpt2_config();
  const bool block_given = block > 0;
  cfg.n_layer = n_layer, cfg.n_head = n_head, cfg.n_embd = n_embd, cfg.block_size = block_given ? block : 64;
  cfg.vocab_size = VOCAB, cfg.dropout = dropout >= 0 ? dropout : 0.0, cfg.bias = true;
  if (resume) {
    if (tokenizer || from_hf)
      fprintf(stderr, PROG ": note: --resume trains the checkpoint's model with its own tokenizer; %s is ignored\n",
              tokenizer ? "--tokenizer" : "--from-hf");
    if (!read_shape(ckpt, &cfg)) return finish(2);
    if (shape_flag || arch_flag)
      fprintf(stderr, PROG ": note: --resume trains the checkpoint's model (%lld layers, %lld heads, %lld wide, "
                      "block %lld); the shape flags are ignored\n",
              (long long)cfg.n_layer, (long long)cfg.n_head, (long long)cfg.n_embd,
              (long long)(R.window ? R.window : cfg.block_size));
    block = R.window ? R.window : cfg.block_size;
  } else if (from_hf) {
    if (!hf_setup(from_hf, tokenizer, &cfg)) return finish(2);
    if (arch_flag)
      fprintf(stderr, PROG ": note: --from-hf takes the model's shape from config.json (%lld layers, %lld heads, "
                      "%lld wide); --n-layer, --n-head and --n-embd are ignored\n",
              (long long)cfg.n_layer, (long long)cfg.n_head, (long long)cfg.n_embd);
    if (dropout >= 0) cfg.dropout = dropout;
    if (block_given && block > cfg.block_size) {
      fprintf(stderr, PROG ": --block %lld is longer than the model's context, %lld (n_positions in %s/config.json)\n",
              block, (long long)cfg.block_size, from_hf);
      return finish(2);
    }
    if (!block_given) block = cfg.block_size;
  } else {
    if (tokenizer) {
      if (!load_bpe_dir("--tokenizer", tokenizer)) return finish(2);
      cfg.vocab_size = vocab = kiln_tokenizer_vocab_size(R.bpe);
    }
    if (n_embd % n_head != 0) {
      fprintf(stderr, PROG ": --n-embd %lld is not a multiple of --n-head %lld\n", n_embd, n_head);
      return finish(2);
    }
    block = cfg.block_size;
  }

  char corpus[1024];
  if (data) snprintf(corpus, sizeof corpus, "%s", data);
  else if (!default_corpus(corpus, sizeof corpus)) {
    fprintf(stderr, PROG ": no corpus: /usr/share/doc/python3.X/NEWS.gz is not installed (apt-get install python3),\n"
                    "  or pass --data PATH with a text file (plain or .gz)\n");
    return finish(1);
  }
  int64_t n_text = 0;
  if (!load_corpus(corpus, &n_text)) return finish(1);
  /* the corpus as tokens: one per byte, or the BPE's ids (n_text then counts tokens) */
  if (R.bpe) {
    int64_t n_bytes = n_text;
    if (kiln_tokenizer_encode(R.bpe, (const char *)R.text, (size_t)n_text, &R.tok, &n_text) != KILN_OK)
      return fail("encoding the corpus");
    if (!quiet)
      printf("tokenizer: BPE, vocabulary %lld: %lld bytes -> %lld tokens\n", (long long)vocab, (long long)n_bytes,
             (long long)n_text);
  } else {
    R.tok = malloc(sizeof *R.tok * (size_t)(n_text ? n_text : 1));
    if (!R.tok) return fail("allocating the tokens");
    for (int64_t i = 0; i < n_text; i++) R.tok[i] = R.text[i];
  }
  /* 90% trains, 10% validates; each split must hold a window and its next byte */
  int64_t split = n_text * 9 / 10;
  if (split - block < 1 || n_text - split - block < 1) {
    fprintf(stderr, PROG ": --data '%s' has %lld tokens: too short for windows of %lld bytes in a 90/10 split "
                    "(it needs more than %lld)\n",
            corpus, (long long)n_text, block, (long long)(block + 1) * 10);
    return finish(1);
  }
  R.xb = malloc(sizeof *R.xb * (size_t)(batch * block));
  R.yb = malloc(sizeof *R.yb * (size_t)(batch * block));
  R.gen = kiln_generator_new((uint64_t)seed + 1);
  if (!R.xb || !R.yb || !R.gen) return fail("allocating the batch");

  kiln_manual_seed((uint64_t)seed);
  kiln_module *model = R.model = from_hf && !resume ? kiln_gpt_from_hf(from_hf, &cfg, KILN_F32, dev)
                                                    : kiln_gpt_new(&cfg, KILN_F32, dev, NULL);
  if (!model) return fail(from_hf && !resume ? "loading the pretrained model (--from-hf)" : "building the model");
  /* --checkpoint-activations: each block one segment (kiln_checkpoint): its activations
  ** are recomputed in backward instead of kept; --checkpoint-keep products keeps its
  ** products' outputs for the recompute */
  kiln_module *blocks = kiln_module_child(model, "h");
  if ((ckpt_act || ckpt_keep) && kiln_module_set_checkpoint(blocks, true) != KILN_OK)
    return fail("marking the blocks for checkpointing");
  if (ckpt_keep && !strcmp(ckpt_keep, "products") &&
      kiln_module_set_checkpoint_keep(blocks, KILN_CHECKPOINT_KEEP_PRODUCTS) != KILN_OK)
    return fail("keeping the blocks' products");
  kiln_optim_config oc = kiln_adamw_config(lr);
  oc.beta2 = 0.95, oc.weight_decay = 0.1; /* nanoGPT's */
  kiln_optimizer *opt = R.opt = kiln_optimizer_new_module_decay_split(&oc, model);
  if (!opt) return fail("making the optimizer");
  int64_t warmup = steps / 10 < 100 ? steps / 10 : 100;
  kiln_scheduler *sched = R.sched = kiln_cosine_lr_new(opt, steps, lr / 10, warmup, 0.0);
  if (!sched) return fail("making the lr schedule");

  int64_t step = 0;
  double train_loss = NAN, val_loss = NAN;
  if (resume) {
    kiln_dict *extra = NULL;
    if (kiln_checkpoint_load(ckpt, model, opt, sched, NULL, NULL, &step, &extra) != KILN_OK)
      return fail("resuming from the checkpoint");
    const char *s;
    if ((s = kiln_dict_get_meta(extra, "train_loss"))) train_loss = strtod(s, NULL);
    if ((s = kiln_dict_get_meta(extra, "val_loss"))) val_loss = strtod(s, NULL);
    if ((s = kiln_dict_get_meta(extra, "corpus")) && strcmp(s, corpus))
      fprintf(stderr, PROG ": warning: the checkpoint was trained on '%s', this run reads '%s'\n", s, corpus);
    kiln_dict_free(extra);
    kiln_safetensors_close(R.ckf);
    R.ckf = NULL;
    if (step > steps)
      fprintf(stderr, PROG ": warning: the checkpoint is at step %lld, past --steps %lld: nothing to train\n",
              (long long)step, steps);
    if (!quiet) printf("resumed from %s at step %lld\n", ckpt, (long long)step);
  }
  int n_params = kiln_module_parameters(model, NULL, 0); /* 148 for GPT-2, 580 for GPT-2 XL */
  kiln_tensor **params = R.params = n_params >= 0 ? malloc(sizeof *params * (size_t)(n_params + 1)) : NULL;
  if (!params || kiln_module_parameters(model, params, n_params) != n_params) return fail("listing the parameters");

  if (!quiet) {
    char pb[32];
    printf("device: %s\ncorpus: %s, %lld %s (train %lld, val %lld)\n", dname, corpus, (long long)n_text,
           R.bpe ? "tokens" : "bytes", (long long)split, (long long)(n_text - split));
    printf("model: %lld layers, %lld heads, %lld wide, context %lld, vocabulary %d (%s)\n", (long long)cfg.n_layer,
           (long long)cfg.n_head, (long long)cfg.n_embd, (long long)cfg.block_size, (int)vocab,
           R.bpe ? "BPE" : "bytes");
    if (from_hf && !resume) printf("pretrained: %s (training windows of %lld tokens)\n", from_hf, block);
    printf("parameters: %lld (%s)\n", (long long)kiln_module_num_params(model),
           kiln_format_bytes(kiln_module_param_bytes(model), pb, sizeof pb));
    fflush(stdout);
  }

  const uint64_t eval_seed = (uint64_t)seed + 1;
  double train_s = 0;
  int64_t trained = 0; /* steps this run */
  int64_t start = step;
  ex_progress p;
  char label[64];
  const int64_t stop = until > 0 && until < steps ? until : steps;
  while (step < stop) {
    int64_t chunk_end = (step / eval_every + 1) * eval_every;
    if (chunk_end > stop) chunk_end = stop;
    snprintf(label, sizeof label, "steps %lld-%lld/%lld", (long long)step + 1, (long long)chunk_end, steps);
    ex_progress_begin(&p, label, (chunk_end - step) * batch * block, !quiet);
    int64_t chunk_start = step;
    kiln_device_synchronize(dev);
    double t0 = ex_now();
    for (; step < chunk_end; step++) {
      kiln_scope_begin(); /* one step */
      kiln_tensor *x, *y;
      kiln_status st = get_batch(R.tok, 0, split, batch, block, kiln_generator_global(), dev, &x, &y);
      double lv = 0;
      kiln_tensor *loss = st == KILN_OK ? lm_loss(model, x, y) : NULL;
      kiln_optimizer_zero_grad(opt);
      if (st == KILN_OK) st = kiln_backward(loss, NULL);
      if (st == KILN_OK && isnan(kiln_clip_grad_norm(params, n_params, 1.0, 2.0))) st = kiln_last_error();
      if (st == KILN_OK) st = kiln_optimizer_step(opt);
      if (st == KILN_OK) st = kiln_scheduler_step(sched);
      if (st == KILN_OK) lv = kiln_item(loss);
      kiln_scope_end();
      if (st != KILN_OK) return fail("training step");
      ex_log_scalar(&R.tb, "train/loss", step + 1, lv);
      ex_progress_update(&p, (step + 1 - chunk_start) * batch * block);
    }
    kiln_device_synchronize(dev);
    double dt = ex_now() - t0;
    ex_progress_end(&p);
    train_s += dt;
    trained += chunk_end - chunk_start;
    train_loss = estimate_loss(model, R.tok, 0, split, eval_iters, batch, block, eval_seed, dev);
    val_loss = estimate_loss(model, R.tok, split, n_text, eval_iters, batch, block, eval_seed, dev);
    if (isnan(train_loss) || isnan(val_loss)) return fail("evaluating");
    double tps = dt > 0 ? (double)((chunk_end - chunk_start) * batch * block) / dt : 0.0;
    ex_log_epoch(&R.tb, step, train_loss, kiln_scheduler_get_lr(sched), tps, dev);
    ex_log_scalar(&R.tb, "eval/val_loss", step, val_loss);
    if (save(ckpt, &cfg, block, step, train_loss, val_loss, corpus) != KILN_OK) return fail("saving the checkpoint");
    if (!quiet) {
      printf("step %lld: train loss %.4f, val loss %.4f (lr %.2e, %.0f tokens/s)\n", (long long)step, train_loss,
             val_loss, kiln_scheduler_get_lr(sched), tps);
      fflush(stdout);
    }
  }
  if (!quiet) printf("checkpoint: %s (sample with: " PROG " --generate \"Fix \" --checkpoint %s)\n", ckpt, ckpt);
  if (json)
    printf("{\"example\":\"gpt\",\"device\":\"%s\",\"steps\":%lld,\"start_step\":%lld,\"batch\":%lld,"
           "\"block\":%lld,\"n_layer\":%lld,\"n_head\":%lld,\"n_embd\":%lld,\"params\":%lld,"
           "\"seconds\":%.4f,\"tokens_per_s\":%.0f,\"train_loss\":%.17g,\"val_loss\":%.17g,\"seed\":%lld,"
           "\"autocast\":\"%s\",\"kiln\":\"%s\"}\n",
           dname, (long long)step, (long long)start, batch, block, (long long)cfg.n_layer,
           (long long)cfg.n_head, (long long)cfg.n_embd, (long long)kiln_module_num_params(model), train_s,
           train_s > 0 ? (double)(trained * batch * block) / train_s : 0.0, train_loss, val_loss, seed,
           amp ? amp : "off", kiln_version());
  fflush(stdout);
  kiln_fallback_report(stderr);
  return finish(0);
}
