/* The library's one JSON reader, for the safetensors header, the tokenizer files
** (vocab.json, tokenizer.json) and a Hugging Face config.json: a cursor over the text in
** memory, read by the caller member by member, so that an error names the line and byte
** offset of the very entry that is wrong, and the same file gets the same answer in every
** build. (cJSON, which the tests use to check what kiln writes, builds a whole tree and
** reports only where the syntax broke.) Declared in ext/kiln_ext.h. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ext/kiln_ext.h"

#define JR_MAX_DEPTH 128

void kiln__jr_init(kiln__jreader *jr, const char *what, const char *path, const char *s, size_t n) {
  memset(jr, 0, sizeof *jr);
  jr->what = what;
  jr->path = path;
  jr->s = s;
  jr->n = n;
  jr->code = KILN_ERR_FORMAT;
}

void kiln__jr_release(kiln__jreader *jr) {
  free(jr->buf);
  jr->buf = NULL;
  jr->cap = jr->len = 0;
}

kiln_status kiln__jr_fail_at(kiln__jreader *jr, size_t off, const char *fmt, ...) {
  if (jr->failed) return kiln_last_error(); /* keep the first error */
  jr->failed = 1;
  if (off > jr->n) off = jr->n;
  size_t line = 1;
  for (size_t i = 0; i < off; i++) line += jr->s[i] == '\n';
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  return kiln_set_error(jr->code, "%s: %s:%zu: byte %zu: %s", jr->what, jr->path, line,
                        jr->base + off, msg);
}

static void skip_ws(kiln__jreader *jr) {
  while (jr->pos < jr->n) {
    char c = jr->s[jr->pos];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    jr->pos++;
  }
}

int kiln__jr_peek(kiln__jreader *jr) {
  if (jr->failed) return 0;
  skip_ws(jr);
  return jr->pos < jr->n ? (unsigned char)jr->s[jr->pos] : 0;
}

static const char *describe(kiln__jreader *jr) {
  if (jr->pos >= jr->n) return "the end of the file";
  static _Thread_local char d[32];
  unsigned char c = (unsigned char)jr->s[jr->pos];
  if (c >= 0x20 && c < 0x7f) snprintf(d, sizeof d, "'%c'", c);
  else snprintf(d, sizeof d, "byte 0x%02x", c);
  return d;
}

int kiln__jr_expect(kiln__jreader *jr, int c) {
  if (kiln__jr_peek(jr) == c && !jr->failed) {
    jr->pos++;
    return 1;
  }
  kiln__jr_fail_at(jr, jr->pos, "expected '%c', found %s", c, describe(jr));
  return 0;
}

int kiln__jr_accept(kiln__jreader *jr, int c) {
  if (kiln__jr_peek(jr) == c && !jr->failed) {
    jr->pos++;
    return 1;
  }
  return 0;
}

static int put(kiln__jreader *jr, const char *b, size_t k) {
  if (jr->len + k + 1 > jr->cap) {
    size_t cap = jr->cap ? jr->cap * 2 : 64;
    while (cap < jr->len + k + 1) cap *= 2;
    char *nb = realloc(jr->buf, cap);
    if (!nb) {
      jr->failed = 1;
      kiln_set_error(KILN_ERR_OOM, "%s: %s: out of memory", jr->what, jr->path);
      return 0;
    }
    jr->buf = nb;
    jr->cap = cap;
  }
  memcpy(jr->buf + jr->len, b, k);
  jr->len += k;
  jr->buf[jr->len] = 0;
  return 1;
}

static int hex4(const char *s, uint32_t *v) {
  *v = 0;
  for (int i = 0; i < 4; i++) {
    char c = s[i];
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
          : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (d < 0) return 0;
    *v = *v << 4 | (uint32_t)d;
  }
  return 1;
}

static size_t utf8_put(char *o, uint32_t cp) {
  if (cp < 0x80) { o[0] = (char)cp; return 1; }
  if (cp < 0x800) { o[0] = (char)(0xC0 | cp >> 6); o[1] = (char)(0x80 | (cp & 63)); return 2; }
  if (cp < 0x10000) {
    o[0] = (char)(0xE0 | cp >> 12); o[1] = (char)(0x80 | (cp >> 6 & 63));
    o[2] = (char)(0x80 | (cp & 63));
    return 3;
  }
  o[0] = (char)(0xF0 | cp >> 18); o[1] = (char)(0x80 | (cp >> 12 & 63));
  o[2] = (char)(0x80 | (cp >> 6 & 63)); o[3] = (char)(0x80 | (cp & 63));
  return 4;
}

int kiln__jr_string(kiln__jreader *jr) {
  if (!kiln__jr_expect(jr, '"')) return 0;
  jr->len = 0;
  if (!put(jr, "", 0)) return 0;
  size_t start = jr->pos - 1;
  while (jr->pos < jr->n) {
    size_t run = jr->pos;
    while (run < jr->n && jr->s[run] != '"' && jr->s[run] != '\\' && (unsigned char)jr->s[run] >= 0x20)
      run++;
    if (!put(jr, jr->s + jr->pos, run - jr->pos)) return 0;
    jr->pos = run;
    if (run >= jr->n) break;
    char c = jr->s[run];
    if (c == '"') {
      jr->pos++;
      return 1;
    }
    if (c != '\\') {
      kiln__jr_fail_at(jr, run, "control byte 0x%02x inside a string", (unsigned char)c);
      return 0;
    }
    if (run + 1 >= jr->n) break;
    char e = jr->s[run + 1], o[4];
    size_t k = 1;
    jr->pos = run + 2;
    switch (e) {
    case '"': o[0] = '"'; break;
    case '\\': o[0] = '\\'; break;
    case '/': o[0] = '/'; break;
    case 'b': o[0] = '\b'; break;
    case 'f': o[0] = '\f'; break;
    case 'n': o[0] = '\n'; break;
    case 'r': o[0] = '\r'; break;
    case 't': o[0] = '\t'; break;
    case 'u': {
      uint32_t cp, lo;
      if (run + 6 > jr->n || !hex4(jr->s + run + 2, &cp)) {
        kiln__jr_fail_at(jr, run, "bad \\u escape");
        return 0;
      }
      jr->pos = run + 6;
      if (cp >= 0xD800 && cp < 0xDC00) { /* a high surrogate wants its low half */
        if (jr->pos + 6 <= jr->n && jr->s[jr->pos] == '\\' && jr->s[jr->pos + 1] == 'u' &&
            hex4(jr->s + jr->pos + 2, &lo) && lo >= 0xDC00 && lo < 0xE000) {
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          jr->pos += 6;
        } else {
          kiln__jr_fail_at(jr, run, "unpaired surrogate \\u%04X", (unsigned)cp);
          return 0;
        }
      } else if (cp >= 0xDC00 && cp < 0xE000) {
        kiln__jr_fail_at(jr, run, "unpaired surrogate \\u%04X", (unsigned)cp);
        return 0;
      }
      k = utf8_put(o, cp);
      break;
    }
    default:
      kiln__jr_fail_at(jr, run, "bad escape '\\%c'", e);
      return 0;
    }
    if (!put(jr, o, k)) return 0;
  }
  kiln__jr_fail_at(jr, start, "string not terminated");
  return 0;
}

/* The JSON integer's digits at p (no redundant leading zero, no fraction or exponent) as a
** value up to max: their end, or 0 with *range set when the digits are fine but the value
** passes max. */
static size_t scan_digits(const kiln__jreader *jr, size_t p, uint64_t max, uint64_t *v,
                          int *range) {
  const char *s = jr->s;
  size_t d = p, n = jr->n;
  uint64_t x = 0;
  *range = 0;
  for (; p < n && s[p] >= '0' && s[p] <= '9'; p++) {
    unsigned k = (unsigned)(s[p] - '0');
    if (x > (max - k) / 10) *range = 1;
    else x = x * 10 + k;
  }
  if (p == d || (s[d] == '0' && p - d > 1) || (p < n && (s[p] == '.' || s[p] == 'e' || s[p] == 'E'))) {
    *range = 0;
    return 0;
  }
  if (*range) return 0;
  *v = x;
  return p;
}

int kiln__jr_int(kiln__jreader *jr, int64_t *v) {
  kiln__jr_peek(jr);
  if (jr->failed) return 0;
  size_t start = jr->pos;
  int neg = start < jr->n && jr->s[start] == '-', range;
  uint64_t x;
  size_t end = scan_digits(jr, start + (size_t)neg, (uint64_t)INT64_MAX, &x, &range);
  if (!end) {
    size_t e = start; /* show a number-like token whole: 007, 2.5, 1e3 */
    while (e < jr->n && e - start < 24 && jr->s[e] && strchr("0123456789+-.eE", jr->s[e])) e++;
    if (range) kiln__jr_fail_at(jr, start, "integer out of range");
    else if (e > start)
      kiln__jr_fail_at(jr, start, "expected an integer, found '%.*s'", (int)(e - start), jr->s + start);
    else kiln__jr_fail_at(jr, start, "expected an integer, found %s", describe(jr));
    return 0;
  }
  jr->pos = end;
  *v = neg ? -(int64_t)x : (int64_t)x;
  return 1;
}

int kiln__jr_try_uint(kiln__jreader *jr, uint64_t *v) {
  kiln__jr_peek(jr);
  if (jr->failed) return 0;
  int range;
  size_t end = scan_digits(jr, jr->pos, UINT64_MAX, v, &range);
  if (end) jr->pos = end;
  return end != 0;
}

/* The end of the JSON number at the cursor (-?digits(.digits)?([eE][+-]?digits)?, no
** leading zeros), or 0 when there is none. */
static size_t number_end(const kiln__jreader *jr) {
  const char *s = jr->s;
  size_t p = jr->pos, n = jr->n, d;
  if (p < n && s[p] == '-') p++;
  for (d = p; p < n && s[p] >= '0' && s[p] <= '9'; p++) {}
  if (p == d || (s[d] == '0' && p - d > 1)) return 0;
  if (p < n && s[p] == '.') {
    for (d = ++p; p < n && s[p] >= '0' && s[p] <= '9'; p++) {}
    if (p == d) return 0;
  }
  if (p < n && (s[p] == 'e' || s[p] == 'E')) {
    if (++p < n && (s[p] == '+' || s[p] == '-')) p++;
    for (d = p; p < n && s[p] >= '0' && s[p] <= '9'; p++) {}
    if (p == d) return 0;
  }
  return p;
}

int kiln__jr_number(kiln__jreader *jr, double *v) {
  kiln__jr_peek(jr);
  if (jr->failed) return 0;
  size_t end = number_end(jr);
  char buf[64];
  if (!end || end - jr->pos >= sizeof buf) {
    kiln__jr_fail_at(jr, jr->pos, "expected a number, found %s", describe(jr));
    return 0;
  }
  memcpy(buf, jr->s + jr->pos, end - jr->pos);
  buf[end - jr->pos] = 0;
  *v = strtod(buf, NULL);
  jr->pos = end;
  return 1;
}

static int skip_depth(kiln__jreader *jr, int depth) {
  if (depth > JR_MAX_DEPTH) {
    kiln__jr_fail_at(jr, jr->pos, "nested deeper than %d", JR_MAX_DEPTH);
    return 0;
  }
  int c = kiln__jr_peek(jr), first = 1, r;
  if (jr->failed) return 0;
  switch (c) {
  case '"': return kiln__jr_string(jr);
  case '{':
    if (!kiln__jr_object_begin(jr)) return 0;
    while ((r = kiln__jr_member(jr, &first)) == 1)
      if (!skip_depth(jr, depth + 1)) return 0;
    return r == 0;
  case '[':
    if (!kiln__jr_array_begin(jr)) return 0;
    while ((r = kiln__jr_element(jr, &first)) == 1)
      if (!skip_depth(jr, depth + 1)) return 0;
    return r == 0;
  default: break;
  }
  static const char *const words[] = {"true", "false", "null"};
  for (int i = 0; i < 3; i++) {
    size_t k = strlen(words[i]);
    if (jr->pos + k <= jr->n && !memcmp(jr->s + jr->pos, words[i], k)) {
      jr->pos += k;
      return 1;
    }
  }
  size_t end = number_end(jr);
  if (!end) {
    kiln__jr_fail_at(jr, jr->pos, "expected a value, found %s", describe(jr));
    return 0;
  }
  jr->pos = end;
  return 1;
}

int kiln__jr_skip(kiln__jreader *jr) { return skip_depth(jr, 0); }

kiln_status kiln__jr_end(kiln__jreader *jr) {
  kiln__jr_peek(jr);
  if (!jr->failed && jr->pos < jr->n) /* a NUL byte too: peek would show it as the end */
    return kiln__jr_fail_at(jr, jr->pos, "more after the end of the JSON value");
  return jr->failed ? kiln_last_error() : KILN_OK;
}

int kiln__jr_object_begin(kiln__jreader *jr) { return kiln__jr_expect(jr, '{'); }

int kiln__jr_member(kiln__jreader *jr, int *first) {
  if (jr->failed) return -1;
  if (kiln__jr_accept(jr, '}')) return 0;
  if (!*first && !kiln__jr_expect(jr, ',')) return -1;
  *first = 0;
  if (kiln__jr_peek(jr) != '"') {
    kiln__jr_fail_at(jr, jr->pos, "expected a member name, found %s", describe(jr));
    return -1;
  }
  jr->key_pos = jr->pos;
  if (!kiln__jr_string(jr) || !kiln__jr_expect(jr, ':')) return -1;
  kiln__jr_peek(jr);
  return 1;
}

int kiln__jr_array_begin(kiln__jreader *jr) { return kiln__jr_expect(jr, '['); }

int kiln__jr_element(kiln__jreader *jr, int *first) {
  if (jr->failed) return -1;
  if (kiln__jr_accept(jr, ']')) return 0;
  if (!*first && !kiln__jr_expect(jr, ',')) return -1;
  *first = 0;
  kiln__jr_peek(jr);
  return 1;
}
