/* GPT-2's byte-level BPE: loading vocab.json + merges.txt or tokenizer.json, encoding
** (special tokens, the pre-tokenizer of pretok.c, merges by rank with a cache of recent
** pieces) and decoding. The encoding is Hugging Face `tokenizers`' for these files:
** within a piece, the adjacent pair of lowest merge rank is merged first, the leftmost
** of equal ranks, until no pair has a rank (tokenizers' Word::merge_all). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ext/kiln_ext.h"
#include "text_int.h"

/* ---- the byte-level alphabet: GPT-2's bytes_to_unicode ----
** The bytes that print as themselves in Latin-1 ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF)
** are their own character; the other 68 map, in byte order, to U+0100.. U+0143. */
static void byte_alphabet(uint32_t to_cp[256], int16_t from_cp[324]) {
  uint32_t extra = 256;
  for (int i = 0; i < 324; i++) from_cp[i] = -1;
  for (int b = 0; b < 256; b++) {
    int self = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    to_cp[b] = self ? (uint32_t)b : extra++;
    from_cp[to_cp[b]] = (int16_t)b;
  }
}

static size_t put_utf8(char *o, uint32_t cp) {
  if (cp < 0x80) { o[0] = (char)cp; return 1; }
  o[0] = (char)(0xC0 | cp >> 6); /* the alphabet stays below U+0800 */
  o[1] = (char)(0x80 | (cp & 63));
  return 2;
}

static uint64_t hash_bytes(const void *p, size_t n) {
  const unsigned char *s = p;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ s[i]) * 1099511628211ull;
  return h ^ (h >> 29);
}

static uint64_t hash_pair(int32_t a, int32_t b) {
  uint64_t h = ((uint64_t)(uint32_t)a << 32 | (uint32_t)b) * 0x9E3779B97F4A7C15ull;
  return h ^ (h >> 31);
}

typedef struct {
  uint64_t key; /* a << 32 | b; EMPTY_KEY when free */
  int32_t rank, id;
} merge_slot;
#define EMPTY_KEY UINT64_MAX

typedef struct {
  int32_t id;
  char *content; /* the text that is matched, and decoded */
  size_t len;
} special;

/* The cache: recent pieces (bytes) -> their ids. Cleared when full. */
#define CACHE_SLOTS (1u << 16)
#define CACHE_MAX_ENTRIES (CACHE_SLOTS / 2)
#define CACHE_MAX_PIECE 255
#define CACHE_KEY_BYTES (1u << 21)
#define CACHE_ID_COUNT (1u << 19)
typedef struct {
  uint64_t h; /* 0 when free */
  uint32_t koff, ioff;
  uint16_t klen, nids;
} cache_slot;

struct kiln_tokenizer {
  int32_t n_ids;
  char *str;          /* the tokens in the byte-level alphabet, NUL-terminated, one block */
  int64_t *str_off;   /* per id; -1 for an id without a token */
  char *bytes;        /* the tokens' bytes (decoded alphabet, or a special's content) */
  int64_t *bytes_off; /* per id, n_ids + 1 entries */
  int32_t *vtab;      /* token string -> id, open addressing, -1 free */
  uint32_t vmask;
  merge_slot *mtab;
  uint32_t mmask;
  int32_t byte_id[256];
  special *specials; /* longest first */
  int n_specials;
  uint8_t special_first[256];
  int ignore_merges;
  int32_t eos;
  cache_slot *cache;
  char *cache_keys;
  int32_t *cache_ids;
  uint32_t cache_n, cache_kused, cache_iused;
};

/* ---- loading ---- */

/* A token or a merge as read, with the offset in its file for the errors. */
typedef struct {
  int64_t id;
  size_t off, len, file_off; /* off/len: in the builder's string block */
  size_t off2, len2;         /* a merge's second token */
} entry;

typedef struct {
  const char *what;
  char *block;
  size_t block_len, block_cap;
  entry *vocab, *merges;
  size_t n_vocab, cap_vocab, n_merges, cap_merges;
  special *specials;
  int n_specials, cap_specials;
  int ignore_merges;
  int vocab_special_eos; /* vocab.json: "<|endoftext|>" is special */
} builder;

static int oom(const char *what) {
  kiln_set_error(KILN_ERR_OOM, "%s: out of memory", what);
  return 0;
}

static int grow(void **p, size_t *cap, size_t need, size_t elem, const char *what) {
  if (need <= *cap) return 1;
  size_t c = *cap ? *cap * 2 : 256;
  while (c < need) c *= 2;
  void *q = realloc(*p, c * elem);
  if (!q) return oom(what);
  *p = q;
  *cap = c;
  return 1;
}

/* Appends s[0, n) and a NUL to the block; its offset in *off. */
static int block_add(builder *b, const char *s, size_t n, size_t *off) {
  if (!grow((void **)&b->block, &b->block_cap, b->block_len + n + 1, 1, b->what)) return 0;
  memcpy(b->block + b->block_len, s, n);
  b->block[b->block_len + n] = 0;
  *off = b->block_len;
  b->block_len += n + 1;
  return 1;
}

static int add_vocab(builder *b, const char *s, size_t n, int64_t id, size_t file_off) {
  if (!grow((void **)&b->vocab, &b->cap_vocab, b->n_vocab + 1, sizeof(entry), b->what)) return 0;
  entry *e = &b->vocab[b->n_vocab];
  memset(e, 0, sizeof *e);
  e->id = id;
  e->len = n;
  e->file_off = file_off;
  if (!block_add(b, s, n, &e->off)) return 0;
  b->n_vocab++;
  return 1;
}

static int add_merge(builder *b, const char *x, size_t nx, const char *y, size_t ny, size_t file_off) {
  if (!grow((void **)&b->merges, &b->cap_merges, b->n_merges + 1, sizeof(entry), b->what)) return 0;
  entry *e = &b->merges[b->n_merges];
  memset(e, 0, sizeof *e);
  e->file_off = file_off;
  e->len = nx;
  e->len2 = ny;
  if (!block_add(b, x, nx, &e->off) || !block_add(b, y, ny, &e->off2)) return 0;
  b->n_merges++;
  return 1;
}

static int add_special(builder *b, const char *s, size_t n, int64_t id) {
  if (b->n_specials == b->cap_specials) {
    int c = b->cap_specials ? b->cap_specials * 2 : 8;
    special *q = realloc(b->specials, (size_t)c * sizeof *q);
    if (!q) return oom(b->what);
    b->specials = q;
    b->cap_specials = c;
  }
  char *copy = malloc(n + 1);
  if (!copy) return oom(b->what);
  memcpy(copy, s, n);
  copy[n] = 0;
  b->specials[b->n_specials++] = (special){(int32_t)id, copy, n};
  return 1;
}

static void builder_release(builder *b) {
  free(b->block);
  free(b->vocab);
  free(b->merges);
  for (int i = 0; i < b->n_specials; i++) free(b->specials[i].content);
  free(b->specials);
}

static uint32_t table_size(size_t n) {
  uint32_t s = 64;
  while (s < 2 * n + 1) s *= 2;
  return s;
}

static int32_t vocab_find(const kiln_tokenizer *t, const char *s, size_t n) {
  for (uint32_t i = (uint32_t)hash_bytes(s, n) & t->vmask;; i = (i + 1) & t->vmask) {
    int32_t id = t->vtab[i];
    if (id < 0) return -1;
    const char *u = t->str + t->str_off[id];
    if (!memcmp(u, s, n) && u[n] == 0) return id;
  }
}

static const merge_slot *merge_find(const kiln_tokenizer *t, int32_t a, int32_t b) {
  uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
  for (uint32_t i = (uint32_t)hash_pair(a, b) & t->mmask;; i = (i + 1) & t->mmask) {
    const merge_slot *m = &t->mtab[i];
    if (m->key == key) return m;
    if (m->key == EMPTY_KEY) return NULL;
  }
}

/* Where an entry's errors point: its file. */
typedef struct {
  const char *path, *s;
  size_t n;
} source;

static int fail_in(const char *what, const source *src, size_t off, kiln_status code, const char *msg) {
  kiln__jreader jr;
  kiln__jr_init(&jr, what, src->path, src->s, src->n);
  jr.code = code;
  kiln__jr_fail_at(&jr, off, "%s", msg);
  return 0;
}

/* Makes the tokenizer from what was read. vsrc/msrc: the files of the vocabulary and of
** the merges, for the errors. */
static kiln_tokenizer *build(builder *b, const source *vsrc, const source *msrc) {
  const char *what = b->what;
  char msg[400];
  kiln_tokenizer *t = calloc(1, sizeof *t);
  if (!t) return oom(what), NULL;
  t->ignore_merges = b->ignore_merges;
  t->eos = -1;
  int64_t max_id = -1;
  for (size_t i = 0; i < b->n_vocab; i++) max_id = b->vocab[i].id > max_id ? b->vocab[i].id : max_id;
  for (int i = 0; i < b->n_specials; i++) max_id = b->specials[i].id > max_id ? b->specials[i].id : max_id;
  /* The tables are indexed by id: ids far past the number of tokens would make a few bytes
  ** of file cost gigabytes. Real vocabularies run 0..n-1 with a few gaps at most. */
  const int64_t n_tokens = (int64_t)b->n_vocab + b->n_specials, id_room = 2 * n_tokens + 1024;
  if (max_id >= id_room) {
    size_t at = 0;
    for (size_t i = 0; i < b->n_vocab; i++)
      if (b->vocab[i].id == max_id) at = b->vocab[i].file_off;
    snprintf(msg, sizeof msg,
             "id %lld is far past the %lld tokens (ids above %lld are refused: a vocabulary's ids run "
             "from 0 with few gaps)",
             (long long)max_id, (long long)n_tokens, (long long)id_room - 1);
    fail_in(what, vsrc, at, KILN_ERR_FORMAT, msg);
    free(t);
    return NULL;
  }
  t->n_ids = (int32_t)(max_id + 1);
  t->str_off = malloc(((size_t)t->n_ids + 1) * sizeof *t->str_off);
  t->bytes_off = malloc(((size_t)t->n_ids + 1) * sizeof *t->bytes_off);
  const char **raw = calloc((size_t)t->n_ids + 1, sizeof *raw); /* a special's content */
  size_t *file_off = calloc((size_t)t->n_ids + 1, sizeof *file_off);
  if (!t->str_off || !t->bytes_off || !raw || !file_off) goto oom_;
  for (int32_t i = 0; i <= t->n_ids; i++) t->str_off[i] = -1;

  /* the specials first: an id of the vocabulary that is also special keeps its text */
  for (int i = 0; i < b->n_specials; i++) raw[b->specials[i].id] = b->specials[i].content;
  for (size_t i = 0; i < b->n_vocab; i++) {
    entry *e = &b->vocab[i];
    if (t->str_off[e->id] >= 0) {
      snprintf(msg, sizeof msg, "id %lld is given to both \"%.80s\" and \"%.80s\"", (long long)e->id,
               b->block + t->str_off[e->id], b->block + e->off);
      fail_in(what, vsrc, e->file_off, KILN_ERR_FORMAT, msg);
      goto fail;
    }
    if (raw[e->id] && strcmp(raw[e->id], b->block + e->off)) {
      /* decode would give the special's text for what encode made of the entry's bytes */
      snprintf(msg, sizeof msg, "id %lld is the special token \"%.80s\" but \"%.80s\" in the vocabulary",
               (long long)e->id, raw[e->id], b->block + e->off);
      fail_in(what, vsrc, e->file_off, KILN_ERR_FORMAT, msg);
      goto fail;
    }
    t->str_off[e->id] = (int64_t)e->off;
    file_off[e->id] = e->file_off;
  }
  if (b->vocab_special_eos)
    for (size_t i = 0; i < b->n_vocab; i++)
      if (!strcmp(b->block + b->vocab[i].off, "<|endoftext|>")) {
        if (!add_special(b, "<|endoftext|>", 13, b->vocab[i].id)) goto fail;
        raw[b->vocab[i].id] = b->specials[b->n_specials - 1].content;
      }
  for (int i = 0; i < b->n_specials; i++) /* a special absent from the vocabulary */
    if (t->str_off[b->specials[i].id] < 0) {
      size_t off;
      if (!block_add(b, b->specials[i].content, b->specials[i].len, &off)) goto fail;
      t->str_off[b->specials[i].id] = (int64_t)off;
    }

  /* the tokens' bytes */
  uint32_t to_cp[256];
  int16_t from_cp[324];
  byte_alphabet(to_cp, from_cp);
  size_t total = 0;
  for (int32_t id = 0; id < t->n_ids; id++)
    if (t->str_off[id] >= 0) total += strlen(raw[id] ? raw[id] : b->block + t->str_off[id]);
  t->bytes = malloc(total + 1);
  if (!t->bytes) goto oom_;
  int64_t at = 0;
  for (int32_t id = 0; id < t->n_ids; id++) {
    t->bytes_off[id] = at;
    if (t->str_off[id] < 0) continue;
    if (raw[id]) {
      size_t n = strlen(raw[id]);
      memcpy(t->bytes + at, raw[id], n);
      at += (int64_t)n;
      continue;
    }
    const unsigned char *s = (const unsigned char *)b->block + t->str_off[id];
    while (*s) {
      uint32_t cp = s[0];
      size_t k = 1;
      if (s[0] >= 0xC0 && s[0] < 0xE0 && (s[1] & 0xC0) == 0x80) cp = (uint32_t)(s[0] & 0x1F) << 6 | (s[1] & 0x3F), k = 2;
      if (cp >= 324 || from_cp[cp] < 0 || (s[0] >= 0x80 && k == 1)) {
        snprintf(msg, sizeof msg,
                 "token \"%.80s\" (id %d) has the character %s%04X, which is no byte of the "
                 "byte-level alphabet",
                 b->block + t->str_off[id], (int)id, s[0] >= 0x80 && k == 1 ? "byte 0x" : "U+",
                 s[0] >= 0x80 && k == 1 ? (unsigned)s[0] : (unsigned)cp);
        if (s[0] >= 0xC0) { /* name the whole character when it is one */
          uint32_t c = 0;
          int m = s[0] >= 0xF0 ? 4 : s[0] >= 0xE0 ? 3 : 2;
          c = s[0] & (0x7F >> m);
          for (int j = 1; j < m && s[j]; j++) c = c << 6 | (s[j] & 0x3F);
          snprintf(msg, sizeof msg,
                   "token \"%.80s\" (id %d) has the character U+%04X, which is no byte of the "
                   "byte-level alphabet",
                   b->block + t->str_off[id], (int)id, (unsigned)c);
        }
        fail_in(what, vsrc, file_off[id], KILN_ERR_FORMAT, msg);
        goto fail;
      }
      t->bytes[at++] = (char)from_cp[cp];
      s += k;
    }
  }
  t->bytes_off[t->n_ids] = at;

  /* token -> id */
  t->str = b->block; /* the block is the tokenizer's now */
  b->block = NULL;
  uint32_t vs = table_size((size_t)t->n_ids);
  t->vmask = vs - 1;
  t->vtab = malloc(vs * sizeof *t->vtab);
  if (!t->vtab) goto oom_;
  memset(t->vtab, 0xFF, vs * sizeof *t->vtab);
  for (int32_t id = 0; id < t->n_ids; id++) {
    if (t->str_off[id] < 0) continue;
    const char *s = t->str + t->str_off[id];
    size_t n = strlen(s);
    uint32_t i = (uint32_t)hash_bytes(s, n) & t->vmask;
    while (t->vtab[i] >= 0 && strcmp(t->str + t->str_off[t->vtab[i]], s)) i = (i + 1) & t->vmask;
    t->vtab[i] = id; /* a repeated token: the larger id wins, as a JSON map's last entry */
  }

  /* every byte needs a token */
  for (int c = 0; c < 256; c++) {
    char s[3];
    size_t n = put_utf8(s, to_cp[c]);
    s[n] = 0;
    t->byte_id[c] = vocab_find(t, s, n);
    if (t->byte_id[c] < 0 || raw[t->byte_id[c]]) {
      kiln_set_error(KILN_ERR_FORMAT,
                     "%s: %s: the vocabulary has no token for byte 0x%02X (\"%s\"); a byte-level "
                     "vocabulary starts with all 256",
                     what, vsrc->path, (unsigned)c, s);
      goto fail;
    }
  }

  /* merges: (a, b) -> rank, id of a + b */
  uint32_t ms = table_size(b->n_merges);
  t->mmask = ms - 1;
  t->mtab = malloc(ms * sizeof *t->mtab);
  if (!t->mtab) goto oom_;
  for (uint32_t i = 0; i < ms; i++) t->mtab[i].key = EMPTY_KEY;
  char *cat = NULL;
  size_t cat_cap = 0;
  for (size_t r = 0; r < b->n_merges; r++) {
    entry *e = &b->merges[r];
    /* the merge strings live in the block that is now t->str */
    const char *x = t->str + e->off, *y = t->str + e->off2;
    int32_t a = vocab_find(t, x, e->len), c = vocab_find(t, y, e->len2);
    if (!grow((void **)&cat, &cat_cap, e->len + e->len2 + 1, 1, what)) goto fail;
    memcpy(cat, x, e->len);
    memcpy(cat + e->len, y, e->len2);
    cat[e->len + e->len2] = 0;
    int32_t m = a >= 0 && c >= 0 ? vocab_find(t, cat, e->len + e->len2) : -1;
    if (m < 0) {
      snprintf(msg, sizeof msg, "merge \"%.80s %.80s\": %s\"%.160s\" is not in the vocabulary",
               x, y, a < 0 || c < 0 ? "the token " : "the result ", a < 0 ? x : c < 0 ? y : cat);
      free(cat);
      fail_in(what, msrc, e->file_off, KILN_ERR_FORMAT, msg);
      goto fail;
    }
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)c;
    uint32_t i = (uint32_t)hash_pair(a, c) & t->mmask;
    while (t->mtab[i].key != EMPTY_KEY && t->mtab[i].key != key) i = (i + 1) & t->mmask;
    t->mtab[i] = (merge_slot){key, (int32_t)r, m}; /* a repeated merge: the later line wins */
  }
  free(cat);

  /* specials, longest first (the longest match wins where two start at one byte) */
  t->specials = b->specials;
  t->n_specials = b->n_specials;
  b->specials = NULL;
  b->n_specials = 0;
  for (int i = 1; i < t->n_specials; i++)
    for (int j = i; j > 0 && t->specials[j].len > t->specials[j - 1].len; j--) {
      special tmp = t->specials[j];
      t->specials[j] = t->specials[j - 1];
      t->specials[j - 1] = tmp;
    }
  for (int i = 0; i < t->n_specials; i++) {
    if (t->specials[i].len) t->special_first[(unsigned char)t->specials[i].content[0]] = 1;
    if (!strcmp(t->specials[i].content, "<|endoftext|>")) t->eos = t->specials[i].id;
  }
  if (t->eos < 0) t->eos = vocab_find(t, "<|endoftext|>", 13);

  t->cache = calloc(CACHE_SLOTS, sizeof *t->cache);
  t->cache_keys = malloc(CACHE_KEY_BYTES);
  t->cache_ids = malloc(CACHE_ID_COUNT * sizeof *t->cache_ids);
  if (!t->cache || !t->cache_keys || !t->cache_ids) goto oom_;
  free(raw);
  free(file_off);
  return t;
oom_:
  oom(what);
fail:
  free(raw);
  free(file_off);
  kiln_tokenizer_free(t);
  return NULL;
}

/* vocab.json: {"token": id, ...} */
static int read_vocab(builder *b, kiln__jreader *jr) {
  int first = 1, r;
  if (!kiln__jr_object_begin(jr)) return 0;
  while ((r = kiln__jr_member(jr, &first)) == 1) {
    size_t key_pos = jr->key_pos, vpos = jr->pos;
    int c = kiln__jr_peek(jr);
    int64_t id = -1;
    if (!(c == '-' || (c >= '0' && c <= '9'))) {
      kiln__jr_fail_at(jr, vpos, "the id of token \"%.80s\" is not an integer", jr->buf);
      return 0;
    }
    /* the key is in jr->buf until the next string: copy it before reading the id */
    size_t klen = jr->len;
    if (!add_vocab(b, jr->buf, klen, 0, key_pos)) return 0;
    if (!kiln__jr_int(jr, &id)) return 0;
    if (id < 0 || id > INT32_MAX - 1) {
      kiln__jr_fail_at(jr, vpos, "the id of token \"%.80s\" is %lld, not in [0, 2^31 - 1)",
                       b->block + b->vocab[b->n_vocab - 1].off, (long long)id);
      return 0;
    }
    b->vocab[b->n_vocab - 1].id = id;
  }
  return r == 0;
}

KILN_API kiln_tokenizer *kiln_tokenizer_load(const char *vocab_json, const char *merges_txt) {
  const char *what = "kiln_tokenizer_load";
  if (!vocab_json || !merges_txt) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "%s: NULL path", what);
  size_t vn = 0, mn = 0;
  char *vs = kiln__read_regular(what, vocab_json, &vn);
  if (!vs) return NULL;
  char *ms = kiln__read_regular(what, merges_txt, &mn);
  if (!ms) {
    free(vs);
    return NULL;
  }
  builder b = {.what = what, .vocab_special_eos = 1};
  kiln__jreader jr;
  kiln__jr_init(&jr, what, vocab_json, vs, vn);
  kiln_tokenizer *t = NULL;
  if (!read_vocab(&b, &jr) || kiln__jr_end(&jr) != KILN_OK) goto done;
  /* merges.txt: lines "a b"; a first line "#version..." is skipped; \r\n ends lines too */
  source msrc = {merges_txt, ms, mn}, vsrc = {vocab_json, vs, vn};
  size_t p = 0;
  while (p < mn) {
    size_t e = p;
    while (e < mn && ms[e] != '\n') e++;
    size_t end = e > p && ms[e - 1] == '\r' ? e - 1 : e;
    if (!(p == 0 && end - p >= 8 && !memcmp(ms, "#version", 8))) {
      const char *sp = memchr(ms + p, ' ', end - p);
      if (!sp || sp == ms + p || sp + 1 == ms + end || memchr(sp + 1, ' ', (size_t)(ms + end - sp - 1))) {
        char msg[200];
        snprintf(msg, sizeof msg, "a merge line is two tokens separated by one space, not \"%.*s\"",
                 (int)(end - p > 80 ? 80 : end - p), ms + p);
        fail_in(what, &msrc, p, KILN_ERR_FORMAT, msg);
        goto done;
      }
      if (!add_merge(&b, ms + p, (size_t)(sp - ms - p), sp + 1, (size_t)(ms + end - sp - 1), p)) goto done;
    }
    p = e + 1;
  }
  t = build(&b, &vsrc, &msrc);
done:
  kiln__jr_release(&jr);
  builder_release(&b);
  free(vs);
  free(ms);
  return t;
}

static int read_bool(kiln__jreader *jr, int *v) {
  int c = kiln__jr_peek(jr);
  if (c == 't' || c == 'f') {
    *v = c == 't';
    return kiln__jr_skip(jr);
  }
  kiln__jr_fail_at(jr, jr->pos, "expected true or false");
  return 0;
}

/* Whether the value is null (then consumed). */
static int is_null(kiln__jreader *jr) {
  if (kiln__jr_peek(jr) == 'n') return kiln__jr_skip(jr);
  return 0;
}

static int unsupported(kiln__jreader *jr, size_t off, const char *setting) {
  jr->code = KILN_ERR_UNSUPPORTED;
  kiln__jr_fail_at(jr, off, "%s is not supported (kiln reads GPT-2's byte-level BPE)", setting);
  return 0;
}

static int read_added_tokens(builder *b, kiln__jreader *jr) {
  int first = 1, r;
  if (!kiln__jr_array_begin(jr)) return 0;
  while ((r = kiln__jr_element(jr, &first)) == 1) {
    size_t at = jr->pos;
    int f2 = 1, r2;
    int64_t id = -1;
    char *content = NULL;
    size_t clen = 0;
    if (!kiln__jr_object_begin(jr)) return 0;
    while ((r2 = kiln__jr_member(jr, &f2)) == 1) {
      if (!strcmp(jr->buf, "id")) {
        if (!kiln__jr_int(jr, &id)) break;
      } else if (!strcmp(jr->buf, "content")) {
        if (!kiln__jr_string(jr)) break;
        free(content);
        content = malloc(jr->len + 1);
        if (!content) { free(content); return oom(b->what); }
        memcpy(content, jr->buf, jr->len + 1);
        clen = jr->len;
      } else if (!kiln__jr_skip(jr)) break;
    }
    if (r2 != 0 || jr->failed) { free(content); return 0; }
    if (!content || clen == 0 || id < 0 || id > INT32_MAX - 1) {
      free(content);
      kiln__jr_fail_at(jr, at, "an added token needs an \"id\" in [0, 2^31 - 1) and a non-empty \"content\"");
      return 0;
    }
    int ok = add_special(b, content, clen, id);
    free(content);
    if (!ok) return 0;
  }
  return r == 0;
}

static int read_model(builder *b, kiln__jreader *jr) {
  int first = 1, r;
  if (!kiln__jr_object_begin(jr)) return 0;
  while ((r = kiln__jr_member(jr, &first)) == 1) {
    size_t vpos = jr->pos;
    if (!strcmp(jr->buf, "type")) {
      if (!kiln__jr_string(jr)) return 0;
      if (strcmp(jr->buf, "BPE")) return unsupported(jr, vpos, "a model other than BPE");
    } else if (!strcmp(jr->buf, "vocab")) {
      if (!read_vocab(b, jr)) return 0;
    } else if (!strcmp(jr->buf, "merges")) {
      int f2 = 1, r2;
      if (!kiln__jr_array_begin(jr)) return 0;
      while ((r2 = kiln__jr_element(jr, &f2)) == 1) {
        size_t at = jr->pos;
        if (kiln__jr_peek(jr) == '[') { /* ["a", "b"] (tokenizers >= 0.20) */
          int f3 = 1;
          if (!kiln__jr_array_begin(jr)) return 0;
          if (kiln__jr_element(jr, &f3) != 1) /* [] has no first token: an error of its own */
            return kiln__jr_fail_at(jr, at, "a merge is a pair of two tokens"), 0;
          if (!kiln__jr_string(jr)) return 0;
          size_t n1 = jr->len;
          char *x = malloc(n1 + 1);
          if (!x) return oom(b->what);
          memcpy(x, jr->buf, n1 + 1);
          int ok = kiln__jr_element(jr, &f3) == 1 && kiln__jr_string(jr);
          ok = ok && kiln__jr_element(jr, &f3) == 0;
          if (!ok) {
            free(x);
            kiln__jr_fail_at(jr, at, "a merge is a pair of two tokens");
            return 0;
          }
          ok = add_merge(b, x, n1, jr->buf, jr->len, at);
          free(x);
          if (!ok) return 0;
        } else { /* "a b" */
          if (!kiln__jr_string(jr)) return 0;
          const char *sp = memchr(jr->buf, ' ', jr->len);
          if (!sp || sp == jr->buf || sp + 1 == jr->buf + jr->len ||
              memchr(sp + 1, ' ', (size_t)(jr->buf + jr->len - sp - 1))) {
            kiln__jr_fail_at(jr, at, "a merge is two tokens separated by one space, not \"%.80s\"", jr->buf);
            return 0;
          }
          if (!add_merge(b, jr->buf, (size_t)(sp - jr->buf), sp + 1, (size_t)(jr->buf + jr->len - sp - 1), at))
            return 0;
        }
      }
      if (r2 != 0) return 0;
    } else if (!strcmp(jr->buf, "ignore_merges")) {
      if (!read_bool(jr, &b->ignore_merges)) return 0;
    } else if (!strcmp(jr->buf, "byte_fallback")) {
      int v;
      if (!read_bool(jr, &v)) return 0;
      if (v) return unsupported(jr, vpos, "byte_fallback");
    } else if (!strcmp(jr->buf, "dropout") || !strcmp(jr->buf, "continuing_subword_prefix") ||
               !strcmp(jr->buf, "end_of_word_suffix")) {
      char name[32];
      snprintf(name, sizeof name, "%s", jr->buf);
      if (is_null(jr)) continue;
      if (kiln__jr_peek(jr) == '"' && strcmp(name, "dropout")) {
        if (!kiln__jr_string(jr)) return 0;
        if (jr->len == 0) continue;
      }
      return unsupported(jr, vpos, name);
    } else if (!kiln__jr_skip(jr)) {
      return 0;
    }
  }
  return r == 0;
}

static int read_pre_tokenizer(kiln__jreader *jr) {
  size_t at = jr->pos;
  if (is_null(jr)) return unsupported(jr, at, "a tokenizer without the ByteLevel pre-tokenizer");
  int first = 1, r;
  if (!kiln__jr_object_begin(jr)) return 0;
  while ((r = kiln__jr_member(jr, &first)) == 1) {
    size_t vpos = jr->pos;
    int v;
    if (!strcmp(jr->buf, "type")) {
      if (!kiln__jr_string(jr)) return 0;
      if (strcmp(jr->buf, "ByteLevel")) return unsupported(jr, vpos, "a pre-tokenizer other than ByteLevel");
    } else if (!strcmp(jr->buf, "add_prefix_space")) {
      if (!read_bool(jr, &v)) return 0;
      if (v) return unsupported(jr, vpos, "add_prefix_space true");
    } else if (!strcmp(jr->buf, "use_regex")) {
      if (!read_bool(jr, &v)) return 0;
      if (!v) return unsupported(jr, vpos, "use_regex false");
    } else if (!kiln__jr_skip(jr)) {
      return 0;
    }
  }
  return r == 0;
}

KILN_API kiln_tokenizer *kiln_tokenizer_load_json(const char *tokenizer_json) {
  const char *what = "kiln_tokenizer_load_json";
  if (!tokenizer_json) KILN__FAIL_NULL(KILN_ERR_INVALID_ARGUMENT, "%s: NULL path", what);
  size_t n = 0;
  char *s = kiln__read_regular(what, tokenizer_json, &n);
  if (!s) return NULL;
  builder b = {.what = what};
  kiln__jreader jr;
  kiln__jr_init(&jr, what, tokenizer_json, s, n);
  kiln_tokenizer *t = NULL;
  int first = 1, r, have_model = 0, have_pre = 0;
  if (!kiln__jr_object_begin(&jr)) goto done;
  while ((r = kiln__jr_member(&jr, &first)) == 1) {
    size_t vpos = jr.pos;
    int ok;
    if (!strcmp(jr.buf, "added_tokens")) ok = read_added_tokens(&b, &jr);
    else if (!strcmp(jr.buf, "model")) ok = read_model(&b, &jr), have_model = 1;
    else if (!strcmp(jr.buf, "pre_tokenizer")) ok = read_pre_tokenizer(&jr), have_pre = 1;
    else if (!strcmp(jr.buf, "normalizer")) ok = is_null(&jr) || unsupported(&jr, vpos, "a normalizer");
    else ok = kiln__jr_skip(&jr);
    if (!ok) goto done;
  }
  if (r != 0 || kiln__jr_end(&jr) != KILN_OK) goto done;
  if (!have_model || !have_pre) {
    kiln__jr_fail_at(&jr, 0, "no \"%s\"", have_model ? "pre_tokenizer" : "model");
    goto done;
  }
  source src = {tokenizer_json, s, n};
  t = build(&b, &src, &src);
done:
  kiln__jr_release(&jr);
  builder_release(&b);
  free(s);
  return t;
}

KILN_API void kiln_tokenizer_free(kiln_tokenizer *t) {
  if (!t) return;
  free(t->str);
  free(t->str_off);
  free(t->bytes);
  free(t->bytes_off);
  free(t->vtab);
  free(t->mtab);
  for (int i = 0; i < t->n_specials; i++) free(t->specials[i].content);
  free(t->specials);
  free(t->cache);
  free(t->cache_keys);
  free(t->cache_ids);
  free(t);
}

KILN_API int64_t kiln_tokenizer_vocab_size(const kiln_tokenizer *t) { return t ? t->n_ids : 0; }

KILN_API int32_t kiln_tokenizer_token_id(const kiln_tokenizer *t, const char *token) {
  if (!t || !token) return -1;
  return vocab_find(t, token, strlen(token));
}

KILN_API int32_t kiln_tokenizer_eos_id(const kiln_tokenizer *t) { return t ? t->eos : -1; }

KILN_API const char *kiln_tokenizer_unicode_version(void) { return kiln__unicode_version; }

KILN_API void kiln_tokenizer_buffer_free(void *p) { free(p); }

/* ---- encoding ---- */

typedef struct {
  kiln_tokenizer *t;
  int32_t *ids;
  int64_t n, cap;
} enc;

static int push(enc *e, const int32_t *ids, size_t k) {
  if (e->n + (int64_t)k > e->cap) {
    int64_t c = e->cap ? e->cap * 2 : 1024;
    while (c < e->n + (int64_t)k) c *= 2;
    int32_t *q = realloc(e->ids, (size_t)c * sizeof *q);
    if (!q) return oom("kiln_tokenizer_encode"), 1;
    e->ids = q;
    e->cap = c;
  }
  memcpy(e->ids + e->n, ids, k * sizeof *ids);
  e->n += (int64_t)k;
  return 0;
}

static void cache_clear(kiln_tokenizer *t) {
  memset(t->cache, 0, CACHE_SLOTS * sizeof *t->cache);
  t->cache_n = t->cache_kused = t->cache_iused = 0;
}

/* BPE over one piece's bytes: sym[0, m) starts as the bytes' tokens; the pair of lowest
** rank (leftmost among equals) is merged until none has a rank. O(m^2) for a piece of m
** bytes, which is fine for the pieces of text; a very long run of one class (a base64
** blob) is slow. Returns the number of ids left in sym. */
static size_t bpe(const kiln_tokenizer *t, const unsigned char *s, size_t m, int32_t *sym, int32_t *rank,
                  int32_t *mid) {
  for (size_t i = 0; i < m; i++) sym[i] = t->byte_id[s[i]];
  for (size_t i = 0; i + 1 < m; i++) {
    const merge_slot *ms = merge_find(t, sym[i], sym[i + 1]);
    rank[i] = ms ? ms->rank : INT32_MAX;
    mid[i] = ms ? ms->id : -1;
  }
  while (m > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < m; i++)
      if (rank[i] < rank[best]) best = i;
    if (rank[best] == INT32_MAX) break;
    sym[best] = mid[best];
    size_t tail = m - best - 2; /* pairs after the merged one */
    memmove(sym + best + 1, sym + best + 2, tail * sizeof *sym);
    memmove(rank + best + 1, rank + best + 2, (tail > 0 ? tail - 1 : 0) * sizeof *rank);
    memmove(mid + best + 1, mid + best + 2, (tail > 0 ? tail - 1 : 0) * sizeof *mid);
    m--;
    for (size_t i = best > 0 ? best - 1 : 0; i <= best && i + 1 < m; i++) {
      const merge_slot *ms = merge_find(t, sym[i], sym[i + 1]);
      rank[i] = ms ? ms->rank : INT32_MAX;
      mid[i] = ms ? ms->id : -1;
    }
  }
  return m;
}

static int encode_piece(void *ctx, const char *piece, size_t m) {
  enc *e = ctx;
  kiln_tokenizer *t = e->t;
  const unsigned char *s = (const unsigned char *)piece;
  if (m == 1) return push(e, &t->byte_id[s[0]], 1);
  uint64_t h = 0;
  uint32_t slot = 0;
  if (m <= CACHE_MAX_PIECE) {
    h = hash_bytes(s, m) | 1;
    for (slot = (uint32_t)h & (CACHE_SLOTS - 1);; slot = (slot + 1) & (CACHE_SLOTS - 1)) {
      cache_slot *c = &t->cache[slot];
      if (!c->h) break;
      if (c->h == h && c->klen == m && !memcmp(t->cache_keys + c->koff, s, m))
        return push(e, t->cache_ids + c->ioff, c->nids);
    }
  }
  if (t->ignore_merges) { /* a piece that is a token is that token */
    char small[2 * CACHE_MAX_PIECE + 1], *w = m <= CACHE_MAX_PIECE ? small : malloc(2 * m + 1);
    if (!w) return oom("kiln_tokenizer_encode"), 1;
    size_t k = 0;
    for (size_t i = 0; i < m; i++) {
      const char *u = t->str + t->str_off[t->byte_id[s[i]]];
      size_t ul = strlen(u);
      memcpy(w + k, u, ul);
      k += ul;
    }
    int32_t id = vocab_find(t, w, k);
    if (w != small) free(w);
    if (id >= 0) return push(e, &id, 1);
  }
  int32_t stack[3 * 64], *buf = m <= 64 ? stack : malloc(3 * m * sizeof *buf);
  if (!buf) return oom("kiln_tokenizer_encode"), 1;
  int32_t *sym = buf, *rank = buf + m, *mid = buf + 2 * m;
  size_t k = bpe(t, s, m, sym, rank, mid);
  int r = push(e, sym, k);
  if (!r && m <= CACHE_MAX_PIECE) {
    if (t->cache_n >= CACHE_MAX_ENTRIES || t->cache_kused + m > CACHE_KEY_BYTES ||
        t->cache_iused + k > CACHE_ID_COUNT) {
      cache_clear(t);
      for (slot = (uint32_t)h & (CACHE_SLOTS - 1); t->cache[slot].h; slot = (slot + 1) & (CACHE_SLOTS - 1)) {}
    }
    cache_slot *c = &t->cache[slot];
    c->h = h;
    c->koff = t->cache_kused;
    c->klen = (uint16_t)m;
    c->ioff = t->cache_iused;
    c->nids = (uint16_t)k;
    memcpy(t->cache_keys + t->cache_kused, s, m);
    memcpy(t->cache_ids + t->cache_iused, sym, k * sizeof *sym);
    t->cache_kused += (uint32_t)m;
    t->cache_iused += (uint32_t)k;
    t->cache_n++;
  }
  if (buf != stack) free(buf);
  return r;
}

KILN_API kiln_status kiln_tokenizer_encode(kiln_tokenizer *t, const char *text, size_t len, int32_t **ids,
                                           int64_t *n) {
  if (ids) *ids = NULL;
  if (n) *n = 0;
  if (!t || !ids || !n || (!text && len))
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_tokenizer_encode: NULL %s",
                          !t ? "tokenizer" : !ids ? "ids" : !n ? "n" : "text");
  enc e = {t, NULL, 0, 0};
  size_t seg = 0;
  int r = 0;
  for (size_t i = 0; i < len && !r && t->n_specials; i++) {
    if (!t->special_first[(unsigned char)text[i]]) continue;
    for (int k = 0; k < t->n_specials; k++) {
      const special *sp = &t->specials[k];
      if (sp->len <= len - i && !memcmp(text + i, sp->content, sp->len)) {
        r = kiln__pretokenize(text + seg, i - seg, encode_piece, &e);
        if (!r) r = push(&e, &sp->id, 1);
        i += sp->len - 1;
        seg = i + 1;
        break;
      }
    }
  }
  if (!r && seg < len) r = kiln__pretokenize(text + seg, len - seg, encode_piece, &e); /* text may be NULL when len is 0 */
  if (r) {
    free(e.ids);
    return kiln_last_error();
  }
  *ids = e.ids;
  *n = e.n;
  return KILN_OK;
}

/* ---- decoding ---- */

KILN_API kiln_status kiln_tokenizer_decode(const kiln_tokenizer *t, const int32_t *ids, int64_t n, char **text,
                                           size_t *len) {
  if (text) *text = NULL;
  if (len) *len = 0;
  if (!t || !text || !len || (!ids && n) || n < 0)
    return kiln_set_error(KILN_ERR_INVALID_ARGUMENT, "kiln_tokenizer_decode: %s",
                          n < 0 ? "negative count" : "NULL argument");
  size_t total = 0;
  for (int64_t i = 0; i < n; i++) {
    int32_t id = ids[i];
    if (id < 0 || id >= t->n_ids || t->str_off[id] < 0)
      return kiln_set_error(KILN_ERR_INDEX, "kiln_tokenizer_decode: id %d at position %lld %s (vocab size %d)",
                            (int)id, (long long)i, id < 0 || id >= t->n_ids ? "is out of range" : "has no token",
                            (int)t->n_ids);
    total += (size_t)(t->bytes_off[id + 1] - t->bytes_off[id]);
  }
  char *out = malloc(total + 1);
  if (!out) return kiln_set_error(KILN_ERR_OOM, "kiln_tokenizer_decode: out of memory (%zu bytes)", total);
  size_t at = 0;
  for (int64_t i = 0; i < n; i++) {
    size_t k = (size_t)(t->bytes_off[ids[i] + 1] - t->bytes_off[ids[i]]);
    memcpy(out + at, t->bytes + t->bytes_off[ids[i]], k);
    at += k;
  }
  out[at] = 0;
  *text = out;
  *len = at;
  return KILN_OK;
}
