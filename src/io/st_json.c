/*
** A small strict JSON parser (RFC 8259) for builds without cJSON. It covers what a
** safetensors header holds and rejects everything else: no comments, no trailing commas,
** no leading zeros, no control bytes in strings, nesting at most 64 deep (a fuzzed header
** must not exhaust the stack).
*/
#include "st_json.h"

#ifndef KILN_HAVE_CJSON
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 64

typedef struct parser {
  const char *p, *end;
} parser;

static void skip_ws(parser *ps) {
  while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
    ps->p++;
}

static kiln__json *new_node(int type) {
  kiln__json *j = calloc(1, sizeof *j);
  if (j) j->type = type;
  return j;
}

void kiln__json_delete(kiln__json *j) {
  while (j) {
    kiln__json *next = j->next;
    kiln__json_delete(j->child);
    free(j->valuestring);
    free(j->string);
    free(j);
    j = next;
  }
}

static int hex4(parser *ps, uint32_t *out) {
  if (ps->end - ps->p < 4) return 0;
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) {
    char c = ps->p[i];
    v <<= 4;
    if (c >= '0' && c <= '9') v |= (uint32_t)(c - '0');
    else if (c >= 'a' && c <= 'f') v |= (uint32_t)(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') v |= (uint32_t)(c - 'A' + 10);
    else return 0;
  }
  ps->p += 4;
  *out = v;
  return 1;
}

/* Parses a string literal at ps->p (on the opening quote) into a new UTF-8 buffer. */
static char *parse_string(parser *ps) {
  ps->p++; /* opening quote */
  size_t cap = 16, n = 0;
  char *out = malloc(cap);
  if (!out) return NULL;
  for (;;) {
    if (ps->p >= ps->end) goto fail;
    unsigned char c = (unsigned char)*ps->p;
    if (c == '"') {
      ps->p++;
      break;
    }
    if (c < 0x20) goto fail;
    char buf[4];
    size_t k = 0;
    if (c != '\\') {
      buf[k++] = (char)c;
      ps->p++;
    } else {
      ps->p++;
      if (ps->p >= ps->end) goto fail;
      char e = *ps->p++;
      uint32_t cp;
      switch (e) {
      case '"': buf[k++] = '"'; break;
      case '\\': buf[k++] = '\\'; break;
      case '/': buf[k++] = '/'; break;
      case 'b': buf[k++] = '\b'; break;
      case 'f': buf[k++] = '\f'; break;
      case 'n': buf[k++] = '\n'; break;
      case 'r': buf[k++] = '\r'; break;
      case 't': buf[k++] = '\t'; break;
      case 'u':
        if (!hex4(ps, &cp)) goto fail;
        if (cp >= 0xD800 && cp <= 0xDBFF) { /* surrogate pair */
          uint32_t lo;
          if (ps->end - ps->p < 6 || ps->p[0] != '\\' || ps->p[1] != 'u') goto fail;
          ps->p += 2;
          if (!hex4(ps, &lo) || lo < 0xDC00 || lo > 0xDFFF) goto fail;
          cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
        } else if (cp >= 0xDC00 && cp <= 0xDFFF) goto fail;
        if (cp == 0) goto fail; /* names are C strings */
        if (cp < 0x80) buf[k++] = (char)cp;
        else if (cp < 0x800) {
          buf[k++] = (char)(0xC0 | (cp >> 6));
          buf[k++] = (char)(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
          buf[k++] = (char)(0xE0 | (cp >> 12));
          buf[k++] = (char)(0x80 | ((cp >> 6) & 0x3F));
          buf[k++] = (char)(0x80 | (cp & 0x3F));
        } else {
          buf[k++] = (char)(0xF0 | (cp >> 18));
          buf[k++] = (char)(0x80 | ((cp >> 12) & 0x3F));
          buf[k++] = (char)(0x80 | ((cp >> 6) & 0x3F));
          buf[k++] = (char)(0x80 | (cp & 0x3F));
        }
        break;
      default: goto fail;
      }
    }
    if (n + k + 1 > cap) {
      cap *= 2;
      char *q = realloc(out, cap);
      if (!q) goto fail;
      out = q;
    }
    memcpy(out + n, buf, k);
    n += k;
  }
  out[n] = 0;
  return out;
fail:
  free(out);
  return NULL;
}

static int parse_number(parser *ps, double *out) {
  const char *s = ps->p;
  const char *q = s;
  if (q < ps->end && *q == '-') q++;
  if (q >= ps->end) return 0;
  if (*q == '0') q++;
  else if (*q >= '1' && *q <= '9')
    while (q < ps->end && *q >= '0' && *q <= '9') q++;
  else return 0;
  if (q < ps->end && *q == '.') {
    q++;
    if (q >= ps->end || *q < '0' || *q > '9') return 0;
    while (q < ps->end && *q >= '0' && *q <= '9') q++;
  }
  if (q < ps->end && (*q == 'e' || *q == 'E')) {
    q++;
    if (q < ps->end && (*q == '+' || *q == '-')) q++;
    if (q >= ps->end || *q < '0' || *q > '9') return 0;
    while (q < ps->end && *q >= '0' && *q <= '9') q++;
  }
  char tmp[64];
  size_t len = (size_t)(q - s);
  if (len >= sizeof tmp) return 0; /* no header number needs more digits */
  memcpy(tmp, s, len);
  tmp[len] = 0;
  *out = strtod(tmp, NULL);
  ps->p = q;
  return 1;
}

static kiln__json *parse_value(parser *ps, int depth);

static kiln__json *parse_container(parser *ps, int depth, int is_obj) {
  if (depth > MAX_DEPTH) return NULL;
  kiln__json *j = new_node(is_obj ? KILN__JSON_OBJECT : KILN__JSON_ARRAY);
  if (!j) return NULL;
  ps->p++;
  skip_ws(ps);
  if (ps->p < ps->end && *ps->p == (is_obj ? '}' : ']')) {
    ps->p++;
    return j;
  }
  kiln__json **tail = &j->child;
  for (;;) {
    char *key = NULL;
    skip_ws(ps);
    if (is_obj) {
      if (ps->p >= ps->end || *ps->p != '"') goto fail;
      key = parse_string(ps);
      if (!key) goto fail;
      skip_ws(ps);
      if (ps->p >= ps->end || *ps->p != ':') {
        free(key);
        goto fail;
      }
      ps->p++;
    }
    kiln__json *v = parse_value(ps, depth + 1);
    if (!v) {
      free(key);
      goto fail;
    }
    v->string = key;
    *tail = v;
    tail = &v->next;
    skip_ws(ps);
    if (ps->p >= ps->end) goto fail;
    if (*ps->p == ',') {
      ps->p++;
      continue;
    }
    if (*ps->p == (is_obj ? '}' : ']')) {
      ps->p++;
      return j;
    }
    goto fail;
  }
fail:
  kiln__json_delete(j);
  return NULL;
}

static int literal(parser *ps, const char *word) {
  size_t n = strlen(word);
  if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n) != 0) return 0;
  ps->p += n;
  return 1;
}

static kiln__json *parse_value(parser *ps, int depth) {
  skip_ws(ps);
  if (ps->p >= ps->end) return NULL;
  char c = *ps->p;
  if (c == '{' || c == '[') return parse_container(ps, depth, c == '{');
  if (c == '"') {
    char *s = parse_string(ps);
    if (!s) return NULL;
    kiln__json *j = new_node(KILN__JSON_STRING);
    if (!j) {
      free(s);
      return NULL;
    }
    j->valuestring = s;
    return j;
  }
  if (c == '-' || (c >= '0' && c <= '9')) {
    double v;
    if (!parse_number(ps, &v)) return NULL;
    kiln__json *j = new_node(KILN__JSON_NUMBER);
    if (j) j->valuedouble = v;
    return j;
  }
  if (literal(ps, "null")) return new_node(KILN__JSON_NULL);
  if (literal(ps, "true")) return new_node(KILN__JSON_TRUE);
  if (literal(ps, "false")) return new_node(KILN__JSON_FALSE);
  return NULL;
}

kiln__json *kiln__json_parse(const char *s, size_t n, const char **end) {
  parser ps = {s, s + n};
  kiln__json *j = parse_value(&ps, 0);
  if (end) *end = ps.p;
  return j;
}

kiln__json *kiln__json_get(const kiln__json *obj, const char *key) {
  if (!obj || obj->type != KILN__JSON_OBJECT) return NULL;
  for (kiln__json *c = obj->child; c; c = c->next)
    if (c->string && strcmp(c->string, key) == 0) return c;
  return NULL;
}

int kiln__json_array_size(const kiln__json *a) {
  int n = 0;
  if (a)
    for (const kiln__json *c = a->child; c; c = c->next) n++;
  return n;
}
#else
typedef int kiln__st_json_unused; /* ISO C forbids an empty translation unit */
#endif
