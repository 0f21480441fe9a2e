/*
** The gpt example on a tiny model and a small text made here (so the test needs neither
** the Python changelog nor minutes): a few steps train and report both losses in --json
** and write a checkpoint and event files; a run resumed half-way ends with the same losses
** as a straight one (CPU, bit for bit); --generate prints the prompt and exactly N sampled
** bytes, the same for the same seed (--greedy: for any seed), past the context too;
** --checkpoint-activations (and --checkpoint-keep products) trains to the same losses;
** --autocast bf16 to nearly the same; --tokenizer trains on BPE tokens and
** the checkpoint samples with that tokenizer; --from-hf fine-tunes a Hugging Face GPT-2
** directory (made here), starting from its weights; a gzip corpus reads like a plain one;
** bad input (an empty prompt, no checkpoint, a text shorter than the windows, a --from-hf
** directory without config.json, a window past the model's context, a tokenizer of
** another vocabulary) is refused with a message.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_checkpoint.h>
#include <kiln_nn.h>

#include <dirent.h>
#include <math.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli_run.h"

#define TINY "--device cpu --n-layer 1 --n-head 2 --n-embd 16 --block 16 --batch 4 --eval-iters 2 --quiet"

static void write_text(const char *name, int lines) {
  char p[512];
  snprintf(p, sizeof p, "%s/%s", cr_tmpdir(), name);
  FILE *f = fopen(p, "wb");
  if (!f) return;
  for (int i = 0; i < lines; i++)
    fprintf(f, "- gh-issue-%d: Fix a crash in the %s module when %s.\n", 90000 + i * 7,
            (const char *[]){"os", "sys", "json", "re"}[i % 4],
            (const char *[]){"the file is empty", "a thread exits", "the path is long"}[i % 3]);
  fclose(f);
}

/* A Hugging Face GPT-2 directory dir (in the scratch directory): a 1-layer GPT over
** vocab tokens saved by kiln_gpt_save_hf, and the fixture tokenizer's vocab.json and
** merges.txt. The model is returned (the caller frees it); NULL on failure. */
static kiln_module *make_hf_dir(const char *dir, int64_t vocab, const char *src, bool tokenizer_json) {
  char p[512], q[1100];
  snprintf(p, sizeof p, "%s/%s", cr_tmpdir(), dir);
  kiln_gpt_config c = kiln_gpt2_config();
  c.n_layer = 1, c.n_head = 2, c.n_embd = 16, c.vocab_size = vocab, c.block_size = 32;
  kiln_generator *g = kiln_generator_new(3);
  kiln_module *m = kiln_gpt_new(&c, KILN_F32, kiln_device_cpu(), g);
  kiln_generator_free(g);
  bool ok = m && kiln_gpt_save_hf(m, p) == KILN_OK;
  const char *pair[2] = {"vocab.json", "merges.txt"}, *one[1] = {"tokenizer.json"};
  const char **files = tokenizer_json ? one : pair;
  for (int i = 0; i < (tokenizer_json ? 1 : 2) && ok; i++) {
    snprintf(q, sizeof q, "%s/tests/fixtures/tokenizer/%s", src, files[i]);
    char *text = cr_slurp(q);
    snprintf(q, sizeof q, "%s/%s", p, files[i]);
    FILE *f = text ? fopen(q, "wb") : NULL;
    ok = f && fputs(text, f) >= 0;
    if (f) ok = fclose(f) == 0 && ok;
    free(text);
  }
  if (!ok) {
    fprintf(stderr, "making %s: %s\n", p, kiln_last_error_message());
    kiln_module_free(m);
    return NULL;
  }
  return m;
}

static bool dir_has_file(const char *name) {
  char p[512];
  snprintf(p, sizeof p, "%s/%s", cr_tmpdir(), name);
  DIR *d = opendir(p);
  if (!d) return false;
  bool any = false;
  struct dirent *e;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.') any = true;
  closedir(d);
  return any;
}

int main(void) {
  int need = cr_require("gpt", false);
  if (need) return need;
  write_text("news.txt", 400); /* about 24 KB */
  write_text("short.txt", 2);

  /* a few steps: both losses, a checkpoint, event files */
  cr_result r = cr_run(NULL, "gpt", "--data news.txt --steps 6 --eval-every 3 --checkpoint a.ckpt --logdir logs --json " TINY);
  CR_CHECK(r.status == 0, "6 steps exited %d: %s", r.status, r.err);
  double tl = cr_json_num(r.out, "train_loss"), vl = cr_json_num(r.out, "val_loss");
  CR_CHECK(tl > 0 && tl < 6.5 && vl > 0 && vl < 6.5, "losses after 6 steps: %s", r.out); /* ln 256 = 5.55 */
  CR_CHECK(cr_json_num(r.out, "steps") == 6, "steps: %s", r.out);
  CR_CHECK(strstr(r.out, "\"example\":\"gpt\"") && strstr(r.out, "\"tokens_per_s\":"), "json: %s", r.out);
  char straight[64];
  cr_json_raw(r.out, "val_loss", straight, sizeof straight);
  cr_free(&r);
  char p[512];
  snprintf(p, sizeof p, "%s/a.ckpt", cr_tmpdir());
  CR_CHECK(cr_file_exists(p), "no checkpoint at %s", p);
  CR_CHECK(dir_has_file("logs"), "--logdir wrote nothing");

  /* 3 of 6 steps (--until), then --resume to 6: the same losses as 6 straight */
  r = cr_run(NULL, "gpt", "--data news.txt --steps 6 --until 3 --eval-every 3 --checkpoint b.ckpt --json " TINY);
  CR_CHECK(r.status == 0, "first half exited %d: %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "gpt", "--data news.txt --steps 6 --eval-every 3 --checkpoint b.ckpt --resume --json " TINY);
  CR_CHECK(r.status == 0, "resume exited %d: %s", r.status, r.err);
  CR_CHECK(cr_json_num(r.out, "start_step") == 3, "did not resume at step 3: %s", r.out);
  char resumed[64];
  cr_json_raw(r.out, "val_loss", resumed, sizeof resumed);
  CR_CHECK(straight[0] && !strcmp(straight, resumed), "resumed val_loss %s != straight %s", resumed, straight);
  cr_free(&r);

  /* sampling: the prompt, then exactly 20 bytes and a newline; the same seed, the same text */
  r = cr_run(NULL, "gpt", "--generate 'Fix ' --tokens 20 --seed 3 --checkpoint a.ckpt --device cpu");
  CR_CHECK(r.status == 0, "generate exited %d: %s", r.status, r.err);
  CR_CHECK(strlen(r.out) == 4 + 20 + 1 && !strncmp(r.out, "Fix ", 4), "generated %zu bytes: '%s'", strlen(r.out), r.out);
  char first[64];
  snprintf(first, sizeof first, "%s", r.out);
  cr_free(&r);
  r = cr_run(NULL, "gpt", "--generate 'Fix ' --tokens 20 --seed 3 --checkpoint a.ckpt --device cpu");
  CR_CHECK(r.status == 0 && !strcmp(r.out, first), "same seed, other text: '%s' vs '%s'", r.out, first);
  cr_free(&r);

  /* --greedy: the argmax at each step, whatever the seed */
  r = cr_run(NULL, "gpt", "--generate 'Fix ' --tokens 20 --greedy --seed 1 --checkpoint a.ckpt --device cpu");
  CR_CHECK(r.status == 0 && strlen(r.out) == 4 + 20 + 1, "greedy: %d '%s' %s", r.status, r.out, r.err);
  snprintf(first, sizeof first, "%s", r.out);
  cr_free(&r);
  r = cr_run(NULL, "gpt", "--generate 'Fix ' --tokens 20 --greedy --seed 2 --checkpoint a.ckpt --device cpu");
  CR_CHECK(r.status == 0 && !strcmp(r.out, first), "greedy depends on the seed: '%s' vs '%s'", r.out, first);
  cr_free(&r);
  /* --top-p, and a continuation (40) past the context (16): windows, exactly 40 bytes */
  r = cr_run(NULL, "gpt", "--generate 'Fix ' --tokens 40 --top-p 0.9 --checkpoint a.ckpt --device cpu");
  CR_CHECK(r.status == 0 && strlen(r.out) == 4 + 40 + 1, "top-p past the context: %d '%s' %s", r.status, r.out, r.err);
  cr_free(&r);
  r = cr_run(NULL, "gpt", "--generate 'Fix ' --top-p 0 --checkpoint a.ckpt --device cpu");
  CR_CHECK(r.status == 2 && strstr(r.err, "--top-p"), "top-p 0: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "gpt", "--generate 'Fix ' --top-p 1.5 --checkpoint a.ckpt --device cpu");
  CR_CHECK(r.status == 2 && strstr(r.err, "--top-p"), "top-p 1.5: %d %s", r.status, r.err);
  cr_free(&r);

  /* --checkpoint-activations: the losses of the straight run, bit for bit (CPU) */
  r = cr_run(NULL, "gpt", "--data news.txt --steps 6 --eval-every 3 --checkpoint e.ckpt --checkpoint-activations --json " TINY);
  CR_CHECK(r.status == 0, "checkpointed run exited %d: %s", r.status, r.err);
  char ckact[64];
  cr_json_raw(r.out, "val_loss", ckact, sizeof ckact);
  CR_CHECK(straight[0] && !strcmp(straight, ckact), "checkpointed val_loss %s != straight %s", ckact, straight);
  cr_free(&r);
  /* --checkpoint-keep products (the blocks checkpointed, keeping their products): the same */
  r = cr_run(NULL, "gpt", "--data news.txt --steps 6 --eval-every 3 --checkpoint e.ckpt --checkpoint-keep products --json " TINY);
  CR_CHECK(r.status == 0, "checkpointed run keeping products exited %d: %s", r.status, r.err);
  cr_json_raw(r.out, "val_loss", ckact, sizeof ckact);
  CR_CHECK(straight[0] && !strcmp(straight, ckact), "val_loss keeping products %s != straight %s", ckact, straight);
  cr_free(&r);
  r = cr_run(NULL, "gpt", "--data news.txt --steps 6 --checkpoint-keep everything " TINY);
  CR_CHECK(r.status == 2 && strstr(r.err, "--checkpoint-keep"), "--checkpoint-keep everything: %d %s", r.status, r.err);
  cr_free(&r);

  /* --autocast bf16: the step's products in bf16, the loss in f32; it trains as the f32 run
  ** does (not the same bits), and says so in its JSON; an unknown precision is refused */
  r = cr_run(NULL, "gpt", "--data news.txt --steps 6 --eval-every 3 --checkpoint f.ckpt --autocast bf16 --json " TINY);
  CR_CHECK(r.status == 0, "bf16 run exited %d: %s", r.status, r.err);
  double bfl = cr_json_num(r.out, "val_loss"), f32l = atof(straight);
  CR_CHECK(bfl > 0 && bfl < 6.5 && fabs(bfl - f32l) < 0.05 * f32l, "bf16 val_loss %g against f32 %g: %s", bfl, f32l, r.out);
  CR_CHECK(strstr(r.out, "\"autocast\":\"bf16\""), "json: %s", r.out);
  cr_free(&r);
  r = cr_run(NULL, "gpt", "--data news.txt --steps 6 --autocast fp8 " TINY);
  CR_CHECK(r.status == 2 && strstr(r.err, "--autocast"), "--autocast fp8: %d %s", r.status, r.err);
  cr_free(&r);

  /* a prompt (35 bytes) longer than the context (16) is cropped to its last 15, with a note */
  r = cr_run(NULL, "gpt", "--generate 'a prompt of more than sixteen bytes' --tokens 5 --top-k 0 --checkpoint a.ckpt --device cpu");
  CR_CHECK(r.status == 0 && strlen(r.out) == 35 + 5 + 1, "long prompt: %d '%s' %s", r.status, r.out, r.err);
  CR_CHECK(strstr(r.err, "the model sees its last 15"), "no note on the cropped prompt: %s", r.err);
  cr_free(&r);

  /* --tokenizer: BPE tokens (the fixture's 4096-token vocabulary); the checkpoint carries
  ** the tokenizer, so --generate encodes the prompt and decodes with it */
  const char *src = getenv("KILN_SOURCE_DIR");
  if (src) {
    char args[2048];
    snprintf(args, sizeof args, "--data news.txt --tokenizer '%s/tests/fixtures/tokenizer' --steps 2 --eval-every 2 "
             "--checkpoint t.ckpt --json " TINY, src);
    r = cr_run(NULL, "gpt", args);
    CR_CHECK(r.status == 0 && cr_json_num(r.out, "steps") == 2, "BPE training: %d %s %s", r.status, r.out, r.err);
    double bl = cr_json_num(r.out, "val_loss");
    CR_CHECK(bl > 6 && bl < 10, "BPE val loss %g (ln 4096 = 8.3)", bl);
    cr_free(&r);
    r = cr_run(NULL, "gpt", "--generate 'Fix a crash' --tokens 12 --seed 5 --checkpoint t.ckpt --device cpu");
    CR_CHECK(r.status == 0 && !strncmp(r.out, "Fix a crash", 11) && strlen(r.out) > 11 + 12,
             "BPE generate: %d '%s' %s", r.status, r.out, r.err);
    char bpe_first[512];
    snprintf(bpe_first, sizeof bpe_first, "%s", r.out);
    cr_free(&r);
    r = cr_run(NULL, "gpt", "--generate 'Fix a crash' --tokens 12 --seed 5 --checkpoint t.ckpt --device cpu");
    CR_CHECK(r.status == 0 && !strcmp(r.out, bpe_first), "BPE same seed, other text: '%s' vs '%s'", r.out, bpe_first);
    cr_free(&r);
  }
  /* --from-hf: the directory's model and tokenizer; with --lr 1e-9 the checkpoint's weights
  ** are the directory's within 1e-6 (the run started from them: a new model's differ by
  ** ~0.02) */
  if (src) {
    kiln_module *hf = make_hf_dir("hf", 4096, src, false);
    CR_CHECK(hf != NULL, "no Hugging Face directory to fine-tune");
    r = cr_run(NULL, "gpt", "--data news.txt --from-hf hf --steps 2 --eval-every 2 --eval-iters 2 --batch 4 --block 16 "
                            "--lr 1e-9 --checkpoint hf.ckpt --json --quiet --device cpu --n-layer 3");
    CR_CHECK(r.status == 0 && cr_json_num(r.out, "n_layer") == 1 && cr_json_num(r.out, "n_embd") == 16 &&
                 cr_json_num(r.out, "block") == 16,
             "--from-hf training: %d %s %s", r.status, r.out, r.err);
    CR_CHECK(strstr(r.err, "--n-layer, --n-head and --n-embd are ignored"), "no note on the shape flags: %s", r.err);
    double fl = cr_json_num(r.out, "val_loss"), ftl = cr_json_num(r.out, "train_loss");
    CR_CHECK(fl > 6 && fl < 10, "--from-hf val loss %g (a random model: about ln 4096 = 8.3)", fl);
    cr_free(&r);
    /* the same model with the same tokenizer as one tokenizer.json (no vocab.json): the
    ** same ids, so the same losses; its checkpoint carries that file and samples with it */
    kiln_module_free(make_hf_dir("hfj", 4096, src, true));
    r = cr_run(NULL, "gpt", "--data news.txt --from-hf hfj --steps 2 --eval-every 2 --eval-iters 2 --batch 4 "
                            "--block 16 --lr 1e-9 --checkpoint hfj.ckpt --json --quiet --device cpu");
    CR_CHECK(r.status == 0 && cr_json_num(r.out, "val_loss") == fl && cr_json_num(r.out, "train_loss") == ftl,
             "--from-hf with tokenizer.json: %d %s %s (the pair's losses: %.9g %.9g)", r.status, r.out, r.err, ftl, fl);
    cr_free(&r);
    r = cr_run(NULL, "gpt", "--generate 'Fix a crash' --tokens 8 --checkpoint hfj.ckpt --device cpu");
    CR_CHECK(r.status == 0 && !strncmp(r.out, "Fix a crash", 11) && strlen(r.out) > 11,
             "tokenizer.json checkpoint generate: %d '%s' %s", r.status, r.out, r.err);
    cr_free(&r);
    char broken[1100];
    snprintf(broken, sizeof broken, "%s/hfj/tokenizer.json", cr_tmpdir());
    FILE *bf = fopen(broken, "wb");
    if (bf) fputs("{\"model\": {\"type\": \"BPE\", \"vocab\": ", bf), fclose(bf);
    r = cr_run(NULL, "gpt", "--data news.txt --from-hf hfj --steps 2 --checkpoint c.ckpt --quiet --device cpu");
    CR_CHECK(r.status == 2 && strstr(r.err, "tokenizer.json"), "a cut tokenizer.json: %d %s", r.status, r.err);
    cr_free(&r);
    char path[1024];
    snprintf(path, sizeof path, "%s/hf.ckpt", cr_tmpdir());
    kiln_gpt_config c = *kiln_gpt_config_of(hf);
    kiln_module *back = kiln_gpt_new(&c, KILN_F32, kiln_device_cpu(), NULL);
    CR_CHECK(back && kiln_checkpoint_load(path, back, NULL, NULL, NULL, NULL, NULL, NULL) == KILN_OK,
             "reading the fine-tuned checkpoint: %s", kiln_last_error_message());
    kiln_tensor *pa[64], *pb[64];
    int na = hf && back ? kiln_module_parameters(hf, pa, 64) : -1, nb = back ? kiln_module_parameters(back, pb, 64) : -2;
    double worst = na == nb && na > 0 ? 0 : INFINITY;
    for (int i = 0; worst < 1e-6 && i < na; i++) {
      int64_t n = kiln_numel(pa[i]);
      float *x = malloc(sizeof(float) * (size_t)(n + 1)), *y = malloc(sizeof(float) * (size_t)(n + 1));
      if (!x || !y || kiln_numel(pb[i]) != n || kiln_to_host(pa[i], x, sizeof(float) * (size_t)n) != KILN_OK ||
          kiln_to_host(pb[i], y, sizeof(float) * (size_t)n) != KILN_OK)
        worst = INFINITY;
      for (int64_t k = 0; k < n && worst < 1e-6; k++)
        if (fabs((double)x[k] - (double)y[k]) > worst) worst = fabs((double)x[k] - (double)y[k]);
      free(x), free(y);
    }
    CR_CHECK(worst < 1e-6, "--from-hf with --lr 1e-9: the checkpoint's %d parameters are %g from the directory's %d",
             nb, worst, na);
    kiln_module_free(back);
    kiln_module_free(hf);
    r = cr_run(NULL, "gpt", "--generate 'Fix a crash' --tokens 8 --checkpoint hf.ckpt --device cpu");
    CR_CHECK(r.status == 0 && !strncmp(r.out, "Fix a crash", 11), "--from-hf generate: %d '%s' %s", r.status, r.out,
             r.err);
    cr_free(&r);
    /* its window (16) comes back with --resume, not the model's context (32) */
    r = cr_run(NULL, "gpt", "--data news.txt --resume --steps 3 --eval-every 3 --eval-iters 2 --batch 4 "
                            "--checkpoint hf.ckpt --json --quiet --device cpu");
    CR_CHECK(r.status == 0 && cr_json_num(r.out, "block") == 16 && cr_json_num(r.out, "steps") == 3,
             "--from-hf resumed: %d %s %s", r.status, r.out, r.err);
    cr_free(&r);
    r = cr_run(NULL, "gpt", "--data news.txt --from-hf hf --block 64 --steps 2 --checkpoint c.ckpt --quiet --device cpu");
    CR_CHECK(r.status == 2 && strstr(r.err, "longer than the model's context, 32"), "--from-hf long block: %d %s",
             r.status, r.err);
    cr_free(&r);
    kiln_module_free(make_hf_dir("hf100", 100, src, false)); /* the fixture tokenizer has 4096 tokens */
    r = cr_run(NULL, "gpt", "--data news.txt --from-hf hf100 --steps 2 --checkpoint c.ckpt --quiet --device cpu");
    CR_CHECK(r.status == 2 && strstr(r.err, "vocabulary is 100 tokens, the tokenizer's 4096"),
             "--from-hf tokenizer of another vocabulary: %d %s", r.status, r.err);
    cr_free(&r);
  }
  r = cr_run(NULL, "gpt", "--data news.txt --from-hf no-such-dir --steps 2 --checkpoint c.ckpt --quiet --device cpu");
  CR_CHECK(r.status == 2 && strstr(r.err, "no-such-dir/config.json"), "--from-hf without a directory: %d %s",
           r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "gpt", "--data news.txt --tokenizer no-such-dir --steps 2 --checkpoint c.ckpt " TINY);
  CR_CHECK(r.status == 2 && strstr(r.err, "vocab.json") && strstr(r.err, "tokenizer.json"), "missing tokenizer: %d %s",
           r.status, r.err);
  cr_free(&r);
  /* a FIFO as vocab.json: refused at once, not waited on (the example read it with a plain open) */
  char fifo_dir[1024];
  snprintf(fifo_dir, sizeof fifo_dir, "%s/fifo-tok", cr_tmpdir());
  if (mkdir(fifo_dir, 0700) == 0) {
    char fifo[1100];
    snprintf(fifo, sizeof fifo, "%s/vocab.json", fifo_dir);
    if (mkfifo(fifo, 0600) == 0) {
      r = cr_run(NULL, "gpt", "--data news.txt --tokenizer fifo-tok --steps 2 --checkpoint c.ckpt " TINY);
      CR_CHECK(r.status == 2 && strstr(r.err, "vocab.json: not a regular file"), "FIFO tokenizer: %d %s", r.status,
               r.err);
      cr_free(&r);
      remove(fifo);
    }
    rmdir(fifo_dir);
  }

  /* bad input */
  r = cr_run(NULL, "gpt", "--generate '' --checkpoint a.ckpt --device cpu");
  CR_CHECK(r.status == 2 && strstr(r.err, "prompt is empty"), "empty prompt: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "gpt", "--generate 'x' --checkpoint missing.ckpt --device cpu");
  CR_CHECK(r.status == 2 && strstr(r.err, "no checkpoint"), "missing checkpoint: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "gpt", "--data news.txt --resume --checkpoint missing.ckpt " TINY);
  CR_CHECK(r.status == 2 && strstr(r.err, "no checkpoint"), "resume without a file: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "gpt", "--data short.txt --steps 2 --checkpoint c.ckpt " TINY);
  CR_CHECK(r.status == 1 && strstr(r.err, "too short"), "short corpus: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "gpt", "--data nonexistent.txt --steps 2 --checkpoint c.ckpt " TINY);
  CR_CHECK(r.status == 1 && strstr(r.err, "no such file"), "missing corpus: %d %s", r.status, r.err);
  cr_free(&r);
  r = cr_run(NULL, "gpt", "--n-embd 15 --n-head 2 --steps 2 --data news.txt --checkpoint c.ckpt --device cpu");
  CR_CHECK(r.status == 2 && strstr(r.err, "multiple"), "n_embd %% n_head: %d %s", r.status, r.err);
  cr_free(&r);

  /* a gzip corpus (gzip is an essential Debian package) */
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "gzip -c '%s/news.txt' > '%s/news.txt.gz'", cr_tmpdir(), cr_tmpdir());
  if (system(cmd) == 0) {
    r = cr_run(NULL, "gpt", "--data news.txt.gz --steps 2 --eval-every 2 --checkpoint d.ckpt --json " TINY);
    CR_CHECK(r.status == 0 && cr_json_num(r.out, "steps") == 2, "gzip corpus: %d %s", r.status, r.err);
    cr_free(&r);
  }

  return cr_finish("test_examples_gpt");
}
