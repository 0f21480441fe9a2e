/* Message building and metadata numbers for nn, optim and checkpoints. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nn/nn_int.h"

void kiln__sb_printf(kiln__sb *sb, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char tmp[512];
  int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (k < 0) return;
  size_t n = (size_t)k < sizeof tmp ? (size_t)k : sizeof tmp - 1;
  if (sb->len + n + 1 > sb->cap) {
    size_t nc = sb->cap ? sb->cap * 2 : 256;
    while (nc < sb->len + n + 1) nc *= 2;
    char *nb = realloc(sb->buf, nc);
    if (!nb) return;
    sb->buf = nb;
    sb->cap = nc;
  }
  memcpy(sb->buf + sb->len, tmp, n);
  sb->len += n;
  sb->buf[sb->len] = '\0';
}

const char *kiln__sb_str(const kiln__sb *sb) { return sb->buf ? sb->buf : ""; }

void kiln__sb_free(kiln__sb *sb) {
  free(sb->buf);
  sb->buf = NULL;
  sb->len = sb->cap = 0;
}

/* Names listed per kind before "and N more": keeps the whole message inside the 1 KiB
** last-error buffer while still naming enough keys to see the pattern. */
enum { LIST_MAX = 6 };

static void list_add(kiln__sb *sb, int *count, const char *text) {
  if (*count < LIST_MAX) kiln__sb_printf(sb, "%s%s", *count ? ", " : "", text);
  (*count)++;
}

void kiln__problems_missing(kiln__problems *p, const char *name) {
  list_add(&p->missing, &p->n_missing, name);
}

void kiln__problems_unexpected(kiln__problems *p, const char *name) {
  list_add(&p->unexpected, &p->n_unexpected, name);
}

void kiln__problems_mismatch(kiln__problems *p, kiln_status code, const char *fmt, ...) {
  char tmp[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(tmp, sizeof tmp, fmt, ap);
  va_end(ap);
  if (p->n_mismatch == 0) p->mismatch_code = code;
  if (p->n_mismatch < LIST_MAX) kiln__sb_printf(&p->mismatch, "%s%s", p->n_mismatch ? "; " : "", tmp);
  p->n_mismatch++;
}

int kiln__problems_count(const kiln__problems *p) {
  return p->n_missing + p->n_unexpected + p->n_mismatch;
}

static void list_more(kiln__sb *out, int n) {
  if (n > LIST_MAX) kiln__sb_printf(out, " and %d more", n - LIST_MAX);
}

kiln_status kiln__problems_report(kiln__problems *p, const char *who) {
  if (kiln__problems_count(p) == 0) return KILN_OK;
  kiln__sb out = {0};
  const char *sep = "";
  if (p->n_missing) {
    kiln__sb_printf(&out, "%d missing key%s: %s", p->n_missing, p->n_missing == 1 ? "" : "s",
                    kiln__sb_str(&p->missing));
    list_more(&out, p->n_missing);
    sep = "; ";
  }
  if (p->n_unexpected) {
    kiln__sb_printf(&out, "%s%d unexpected key%s: %s", sep, p->n_unexpected,
                    p->n_unexpected == 1 ? "" : "s", kiln__sb_str(&p->unexpected));
    list_more(&out, p->n_unexpected);
    sep = "; ";
  }
  if (p->n_mismatch) {
    kiln__sb_printf(&out, "%s%d mismatched entr%s: %s", sep, p->n_mismatch,
                    p->n_mismatch == 1 ? "y" : "ies", kiln__sb_str(&p->mismatch));
    list_more(&out, p->n_mismatch);
  }
  /* Shape or dtype trouble is the more specific code; key trouble is a wrong argument. */
  kiln_status code = p->n_mismatch ? p->mismatch_code : KILN_ERR_INVALID_ARGUMENT;
  kiln_set_error(code, "%s: %s", who, kiln__sb_str(&out));
  kiln__sb_free(&out);
  return code;
}

void kiln__problems_free(kiln__problems *p) {
  kiln__sb_free(&p->missing);
  kiln__sb_free(&p->unexpected);
  kiln__sb_free(&p->mismatch);
}

kiln_status kiln__meta_i64(const kiln_dict *d, const char *key, int64_t *out, const char *who) {
  const char *s = kiln_dict_get_meta(d, key);
  if (!s) return kiln_set_error(KILN_ERR_FORMAT, "%s: metadata \"%s\" is missing", who, key);
  errno = 0;
  char *end = NULL;
  long long v = strtoll(s, &end, 10);
  if (errno || end == s || *end != '\0')
    return kiln_set_error(KILN_ERR_FORMAT, "%s: metadata \"%s\" = \"%s\" is not an integer", who,
                          key, s);
  *out = (int64_t)v;
  return KILN_OK;
}

kiln_status kiln__meta_f64(const kiln_dict *d, const char *key, double *out, const char *who) {
  const char *s = kiln_dict_get_meta(d, key);
  if (!s) return kiln_set_error(KILN_ERR_FORMAT, "%s: metadata \"%s\" is missing", who, key);
  errno = 0;
  char *end = NULL;
  double v = strtod(s, &end);
  if (end == s || *end != '\0')
    return kiln_set_error(KILN_ERR_FORMAT, "%s: metadata \"%s\" = \"%s\" is not a number", who,
                          key, s);
  *out = v;
  return KILN_OK;
}

kiln_status kiln__meta_set_i64(kiln_dict *d, const char *key, int64_t v) {
  char buf[32];
  snprintf(buf, sizeof buf, "%" PRId64, v);
  return kiln_dict_set_meta(d, key, buf);
}

kiln_status kiln__meta_set_f64(kiln_dict *d, const char *key, double v) {
  /* %.17g round-trips every double exactly through strtod. */
  char buf[40];
  snprintf(buf, sizeof buf, "%.17g", v);
  return kiln_dict_set_meta(d, key, buf);
}
