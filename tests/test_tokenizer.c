/* kiln_text's GPT-2 byte-level BPE against Hugging Face `tokenizers`: the ids of a 1 MB
** text with Unicode edge cases (tests/fixtures/tokenizer, made by
** scripts/make_tokenizer_fixtures.py) from both file formats, decode(encode(x)) == x, and
** the bad inputs: a broken merge line, a bad vocabulary entry, a token outside the
** byte-level alphabet, a missing byte, ids out of range, an empty text. */
#include <kiln_text.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "check.h"

static char dir[1024];

static const char *fixture(const char *name) {
  static char p[4][1200];
  static int k;
  k = (k + 1) % 4;
  snprintf(p[k], sizeof p[k], "%s/%s", dir, name);
  return p[k];
}

static unsigned char *read_gz(const char *path, size_t *n) {
  gzFile f = gzopen(path, "rb");
  if (!f) return NULL;
  size_t cap = 1 << 22, len = 0;
  unsigned char *buf = malloc(cap);
  int got;
  while (buf && (got = gzread(f, buf + len, (unsigned)(cap - len))) > 0) {
    len += (size_t)got;
    if (len == cap) {
      unsigned char *q = realloc(buf, cap *= 2);
      if (!q) free(buf);
      buf = q;
    }
  }
  gzclose(f);
  *n = len;
  return buf;
}

static char *read_all(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc((size_t)len + 1);
  if (buf && fread(buf, 1, (size_t)len, f) != (size_t)len) {
    free(buf);
    buf = NULL;
  }
  fclose(f);
  if (buf) buf[len] = 0;
  *n = (size_t)len;
  return buf;
}

/* A file in TMPDIR with the given text; the path is valid until the 4th next call. */
static const char *write_tmp(const char *name, const char *text) {
  static char p[16][512];
  static int k;
  k = (k + 1) % 16;
  const char *t = getenv("TMPDIR");
  snprintf(p[k], sizeof p[k], "%s/kiln_tok_%d_%s", t && *t ? t : "/tmp", (int)getpid(), name);
  FILE *f = fopen(p[k], "wb");
  if (!f) return NULL;
  fputs(text, f);
  fclose(f);
  return p[k];
}

static int has(const char *needle) {
  const char *m = kiln_last_error_message();
  if (m && strstr(m, needle)) return 1;
  fprintf(stderr, "  expected \"%s\" in: %s\n", needle, m ? m : "(none)");
  return 0;
}

static void test_ids_match_tokenizers(void) {
  size_t tn = 0, in = 0;
  unsigned char *text = read_gz(fixture("text.txt.gz"), &tn);
  unsigned char *raw = read_gz(fixture("ids.u16.gz"), &in);
  CHECK(text && raw && tn >= 1000000 && in % 2 == 0);
  if (!text || !raw) goto out;
  int64_t n_ref = (int64_t)(in / 2);
  kiln_tokenizer *toks[2] = {
      kiln_tokenizer_load_json(fixture("tokenizer.json")),
      kiln_tokenizer_load(fixture("vocab.json"), fixture("merges.txt")),
  };
  for (int w = 0; w < 2; w++) {
    kiln_tokenizer *tok = toks[w];
    CHECK(tok);
    if (!tok) continue;
    CHECK(kiln_tokenizer_vocab_size(tok) == 4096);
    CHECK(kiln_tokenizer_eos_id(tok) == 0);
    CHECK(kiln_tokenizer_token_id(tok, "<|endoftext|>") == 0);
    CHECK(kiln_tokenizer_token_id(tok, "no such token") == -1);
    for (int pass = 0; pass < 2; pass++) { /* the second pass runs from the cache */
      int32_t *ids = NULL;
      int64_t n = 0;
      CHECK(kiln_tokenizer_encode(tok, (const char *)text, tn, &ids, &n) == KILN_OK);
      CHECK(n == n_ref);
      int64_t bad = -1;
      for (int64_t i = 0; i < n && i < n_ref; i++)
        if (ids[i] != (int32_t)(raw[2 * i] | raw[2 * i + 1] << 8)) {
          bad = i;
          break;
        }
      if (bad >= 0)
        fprintf(stderr, "  %s: first different id at %lld: %d, tokenizers %d\n", w ? "vocab+merges" : "tokenizer.json",
                (long long)bad, ids[bad], raw[2 * bad] | raw[2 * bad + 1] << 8);
      CHECK(bad < 0);
      char *back = NULL;
      size_t blen = 0;
      CHECK(kiln_tokenizer_decode(tok, ids, n, &back, &blen) == KILN_OK);
      CHECK(back && blen == tn && !memcmp(back, text, tn));
      kiln_tokenizer_buffer_free(back);
      kiln_tokenizer_buffer_free(ids);
    }
    /* bytes that are no UTF-8 are encoded one by one and come back unchanged */
    const char junk[] = "ok \xff\xfe\xc3 \xe2\x82 \xed\xa0\x80 end";
    int32_t *ids = NULL;
    int64_t n = 0;
    char *back = NULL;
    size_t blen = 0;
    CHECK(kiln_tokenizer_encode(tok, junk, sizeof junk - 1, &ids, &n) == KILN_OK && n > 0);
    CHECK(kiln_tokenizer_decode(tok, ids, n, &back, &blen) == KILN_OK);
    CHECK(blen == sizeof junk - 1 && back && !memcmp(back, junk, blen));
    kiln_tokenizer_buffer_free(back);
    kiln_tokenizer_buffer_free(ids);
  }
  kiln_tokenizer_free(toks[0]);
  kiln_tokenizer_free(toks[1]);
out:
  free(text);
  free(raw);
}

static void test_empty_and_decode_errors(void) {
  kiln_tokenizer *tok = kiln_tokenizer_load(fixture("vocab.json"), fixture("merges.txt"));
  CHECK(tok);
  if (!tok) return;
  int32_t *ids = (int32_t *)1;
  int64_t n = -1;
  /* an empty prompt is 0 ids here; a model's generate refuses it (kiln_text.h) */
  CHECK(kiln_tokenizer_encode(tok, NULL, 0, &ids, &n) == KILN_OK && n == 0 && ids == NULL);
  CHECK(kiln_tokenizer_encode(tok, NULL, 3, &ids, &n) == KILN_ERR_INVALID_ARGUMENT);
  char *text = NULL;
  size_t len = 1;
  CHECK(kiln_tokenizer_decode(tok, NULL, 0, &text, &len) == KILN_OK && len == 0 && text && !text[0]);
  kiln_tokenizer_buffer_free(text);
  int32_t bad[] = {5, 4096};
  CHECK(kiln_tokenizer_decode(tok, bad, 2, &text, &len) == KILN_ERR_INDEX && text == NULL);
  CHECK(has("id 4096 at position 1 is out of range (vocab size 4096)"));
  int32_t neg[] = {-1};
  CHECK(kiln_tokenizer_decode(tok, neg, 1, &text, &len) == KILN_ERR_INDEX);
  kiln_tokenizer_free(tok);
  kiln_tokenizer_free(NULL);
}

static void test_bad_files(void) {
  const char *vocab = fixture("vocab.json");
  /* a broken merge line: named by file and line */
  const char *m = write_tmp("merges1.txt", "#version: 0.2\n\xc4\xa0 t\nbroken\n");
  CHECK(kiln_tokenizer_load(vocab, m) == NULL && kiln_last_error() == KILN_ERR_FORMAT);
  CHECK(has("merges1.txt:3: byte 19: a merge line is two tokens separated by one space, not \"broken\""));
  m = write_tmp("merges2.txt", "a  b\n");
  CHECK(kiln_tokenizer_load(vocab, m) == NULL && has("merges2.txt:1: byte 0"));
  /* a merge of a token the vocabulary lacks */
  m = write_tmp("merges3.txt", "#version: 0.2\ni n\nqqqq x\n");
  CHECK(kiln_tokenizer_load(vocab, m) == NULL && has("merges3.txt:3: byte 18: merge \"qqqq x\": the token \"qqqq\""));
  const char *good_merges = write_tmp("merges4.txt", "#version: 0.2\n");

  /* vocabulary entries: an id that is no integer, a negative id, a repeated id */
  const char *v = write_tmp("vocab1.json", "{\"a\": 1,\n \"b\": \"x\"}");
  CHECK(kiln_tokenizer_load(v, good_merges) == NULL && kiln_last_error() == KILN_ERR_FORMAT);
  CHECK(has("vocab1.json:2: byte 15: the id of token \"b\" is not an integer"));
  v = write_tmp("vocab2.json", "{\"a\": 1,\n\n \"b\": -5}");
  CHECK(kiln_tokenizer_load(v, good_merges) == NULL && has("vocab2.json:3: byte 16: the id of token \"b\" is -5"));
  v = write_tmp("vocab3.json", "{\"a\": 1, \"b\": 1}");
  CHECK(kiln_tokenizer_load(v, good_merges) == NULL && has("vocab3.json:1: byte 9: id 1 is given to both \"a\" and \"b\""));
  v = write_tmp("vocab4.json", "{\"a\": 1, \"b\" 2}");
  CHECK(kiln_tokenizer_load(v, good_merges) == NULL && has("vocab4.json:1: byte 13: expected ':', found '2'"));
  /* ids far past the number of tokens (a few bytes of file asked for gigabytes of tables;
  ** found by the fuzz targets tokenizer and tokenizer_json) */
  v = write_tmp("vocab7.json", "{\"a\": 0,\n \"b\": 2000000000}");
  CHECK(kiln_tokenizer_load(v, good_merges) == NULL && kiln_last_error() == KILN_ERR_FORMAT &&
        has("vocab7.json:2: byte 10: id 2000000000 is far past the 2 tokens (ids above 1027 are refused"));
  /* text after the object, a NUL byte included (the JSON cursor's end check, shared with
  ** kiln_gpt_hf_config) */
  v = write_tmp("vocab8.json", "{\"a\": 0}\n x");
  CHECK(kiln_tokenizer_load(v, good_merges) == NULL && has("vocab8.json:2: byte 10: more after the end of the JSON value"));
  /* ids are JSON integers, as Hugging Face's serde reads them: no leading zero, fraction or
  ** exponent (the JSON cursor's integer, shared with the safetensors header) */
  v = write_tmp("vocab9.json", "{\"a\": 007}");
  CHECK(kiln_tokenizer_load(v, good_merges) == NULL && has("vocab9.json:1: byte 6: expected an integer, found '007'"));
  v = write_tmp("vocab9.json", "{\"a\": 1.5}");
  CHECK(kiln_tokenizer_load(v, good_merges) == NULL && has("vocab9.json:1: byte 6: expected an integer, found '1.5'"));
  v = write_tmp("vocab9.json", "{\"a\": 99999999999999999999}");
  CHECK(kiln_tokenizer_load(v, good_merges) == NULL && has("vocab9.json:1: byte 6: integer out of range"));
  /* a vocabulary without all 256 bytes */
  v = write_tmp("vocab5.json", "{\"a\": 0}");
  CHECK(kiln_tokenizer_load(v, good_merges) == NULL && has("no token for byte 0x00"));

  /* a token with a character outside the byte-level alphabet (an unknown byte) */
  size_t n = 0;
  char *full = read_all(vocab, &n);
  CHECK(full && n > 2);
  if (full) {
    char *end = strrchr(full, '}');
    *end = 0;
    size_t cap = n + 64;
    char *text = malloc(cap);
    snprintf(text, cap, "%s,\n\"x\xe2\x82\xac\": 5000}", full);
    v = write_tmp("vocab6.json", text);
    CHECK(kiln_tokenizer_load(v, good_merges) == NULL && has("vocab6.json:") &&
          has("token \"x\xe2\x82\xac\" (id 5000) has the character U+20AC, which is no byte of the byte-level alphabet"));
    free(text);
    free(full);
  }

  /* tokenizer.json: a setting kiln does not implement */
  v = write_tmp("tok1.json", "{\"normalizer\": {\"type\": \"NFC\"}, \"model\": {}}");
  CHECK(kiln_tokenizer_load_json(v) == NULL && kiln_last_error() == KILN_ERR_UNSUPPORTED && has("tok1.json:1: byte 15: a normalizer"));
  v = write_tmp("tok2.json", "{\"model\": {\"type\": \"BPE\", \"merges\": [[\"a\", \"b\", \"c\"]]}}");
  CHECK(kiln_tokenizer_load_json(v) == NULL && has("a merge is a pair of two tokens"));
  /* an empty merge: refused with an error (it returned NULL with none; found by the fuzz
  ** target tokenizer_json) */
  v = write_tmp("tok4.json", "{\"model\": {\"type\": \"BPE\", \"merges\": [[]]}}");
  kiln_clear_error();
  CHECK(kiln_tokenizer_load_json(v) == NULL && kiln_last_error() == KILN_ERR_FORMAT &&
        has("tok4.json:1: byte 37: a merge is a pair of two tokens"));
  /* a special token whose id the vocabulary gives to another token (found by the fuzz
  ** target tokenizer_json: the tokens' bytes were sized by the vocabulary's text) */
  v = write_tmp("tok3.json", "{\"added_tokens\": [{\"id\": 1, \"content\": \"<|x|>\", \"special\": true}],\n"
                             " \"pre_tokenizer\": {\"type\": \"ByteLevel\"},\n"
                             " \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1}, \"merges\": []}}");
  CHECK(kiln_tokenizer_load_json(v) == NULL && kiln_last_error() == KILN_ERR_FORMAT &&
        has("tok3.json:3: byte") && has("id 1 is the special token \"<|x|>\" but \"b\" in the vocabulary"));
  CHECK(kiln_tokenizer_load("/nonexistent/vocab.json", good_merges) == NULL && kiln_last_error() == KILN_ERR_IO);

  const char *names[] = {"merges1.txt", "merges2.txt", "merges3.txt", "merges4.txt", "vocab1.json", "vocab2.json",
                         "vocab3.json", "vocab4.json", "vocab5.json", "vocab6.json", "vocab7.json", "vocab8.json", "vocab9.json", "tok1.json", "tok2.json",
                         "tok3.json", "tok4.json"};
  for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
    char p[512];
    const char *t = getenv("TMPDIR");
    snprintf(p, sizeof p, "%s/kiln_tok_%d_%s", t && *t ? t : "/tmp", (int)getpid(), names[i]);
    remove(p);
  }
}

int main(void) {
  const char *src = getenv("KILN_SOURCE_DIR");
  snprintf(dir, sizeof dir, "%s/tests/fixtures/tokenizer", src ? src : ".");
  test_ids_match_tokenizers();
  test_empty_and_decode_errors();
  test_bad_files();
  printf("test_tokenizer: %d failure(s) (Unicode %s)\n", failures, kiln_tokenizer_unicode_version());
  return failures ? 1 : 0;
}
