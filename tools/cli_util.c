/* The CLI's JSON writer and table printer (see cli.h). */
#define _POSIX_C_SOURCE 200809L
#include "cli.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

double cli_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

bool cli_is_tty(FILE *f) {
  const char *plain = getenv("KILN_CLI_PLAIN");
  if (plain && *plain && strcmp(plain, "0") != 0) return false;
  return isatty(fileno(f)) == 1;
}

/* ---- safe text ---------------------------------------------------------------------- */

/* Length of the valid UTF-8 sequence at p (1..4), or 0 when it is not one. */
static int utf8_len(const unsigned char *p) {
  unsigned c = p[0];
  int len;
  uint32_t cp, min;
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) len = 2, cp = c & 0x1F, min = 0x80;
  else if (c >= 0xE0 && c <= 0xEF) len = 3, cp = c & 0x0F, min = 0x800;
  else if (c >= 0xF0 && c <= 0xF4) len = 4, cp = c & 0x07, min = 0x10000;
  else return 0;
  for (int k = 1; k < len; k++) {
    if ((p[k] & 0xC0) != 0x80) return 0; /* also stops at the terminating NUL */
    cp = (cp << 6) | (p[k] & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
  return len;
}

char *cli_safe_text(const char *s) {
  if (!s) s = "(null)";
  size_t n = strlen(s);
  char *out = malloc(4 * n + 1); /* each byte grows to at most 4 (\xNN) */
  if (!out) return NULL;
  size_t o = 0;
  const unsigned char *p = (const unsigned char *)s;
  while (*p) {
    int len = utf8_len(p);
    bool c1 = len == 2 && p[0] == 0xC2 && p[1] < 0xA0; /* U+0080..U+009F */
    if (len == 1 && *p >= 0x20 && *p != 0x7F && *p != '\\') {
      out[o++] = (char)*p++;
    } else if (len == 1 && *p == '\\') {
      out[o++] = '\\';
      out[o++] = '\\';
      p++;
    } else if (len > 1 && !c1) {
      memcpy(out + o, p, (size_t)len);
      o += (size_t)len;
      p += len;
    } else { /* a control byte, a C1 control's two bytes, or a byte that is not UTF-8 */
      int k = len > 1 ? len : 1;
      for (int i = 0; i < k; i++, p++) o += (size_t)snprintf(out + o, 5, "\\x%02x", *p);
    }
  }
  out[o] = 0;
  return out;
}

void cli_write_safe(FILE *f, const char *s) {
  char *t = cli_safe_text(s);
  fputs(t ? t : "(out of memory)", f);
  free(t);
}

/* ---- JSON --------------------------------------------------------------------------- */

void cli_json_init(cli_json *j, FILE *f) {
  j->f = f;
  j->depth = 0;
  j->first[0] = true;
}

void cli_json_write_escaped(FILE *f, const char *s) {
  fputc('"', f);
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    switch (*p) {
    case '"': fputs("\\\"", f); break;
    case '\\': fputs("\\\\", f); break;
    case '\n': fputs("\\n", f); break;
    case '\r': fputs("\\r", f); break;
    case '\t': fputs("\\t", f); break;
    case '\b': fputs("\\b", f); break;
    case '\f': fputs("\\f", f); break;
    default:
      if (*p < 0x20 || *p == 0x7F) fprintf(f, "\\u%04x", *p);
      else if (*p < 0x80) fputc(*p, f);
      else { /* valid UTF-8 passes through (JSON text is UTF-8); C1 controls are escaped */
        int len = utf8_len(p);
        if (len == 2 && p[0] == 0xC2 && p[1] < 0xA0) fprintf(f, "\\u%04x", p[1]);
        else if (len > 1) fwrite(p, 1, (size_t)len, f);
        else fputs("\\ufffd", f); /* not UTF-8: the replacement character, so the output stays JSON */
        if (len > 1) p += len - 1;
      }
    }
  }
  fputc('"', f);
}

/* The separator and the key before a value. */
static void json_pre(cli_json *j, const char *key) {
  if (!j->first[j->depth]) fputc(',', j->f);
  j->first[j->depth] = false;
  if (key) {
    cli_json_write_escaped(j->f, key);
    fputc(':', j->f);
  }
}

static void json_open(cli_json *j, const char *key, char c) {
  json_pre(j, key);
  fputc(c, j->f);
  if (j->depth + 1 < CLI_JSON_MAX_DEPTH) j->depth++;
  j->first[j->depth] = true;
}

static void json_close(cli_json *j, char c) {
  fputc(c, j->f);
  if (j->depth > 0) j->depth--;
  if (j->depth == 0) fputc('\n', j->f); /* a top-level value ends the line */
}

void cli_json_object_begin(cli_json *j, const char *key) { json_open(j, key, '{'); }
void cli_json_object_end(cli_json *j) { json_close(j, '}'); }
void cli_json_array_begin(cli_json *j, const char *key) { json_open(j, key, '['); }
void cli_json_array_end(cli_json *j) { json_close(j, ']'); }

void cli_json_string(cli_json *j, const char *key, const char *v) {
  json_pre(j, key);
  if (v) cli_json_write_escaped(j->f, v);
  else fputs("null", j->f);
}

void cli_json_double(cli_json *j, const char *key, double v) {
  json_pre(j, key);
  if (isfinite(v)) fprintf(j->f, "%.9g", v);
  else fputs("null", j->f); /* JSON has no NaN or infinity */
}

void cli_json_int(cli_json *j, const char *key, int64_t v) {
  json_pre(j, key);
  fprintf(j->f, "%lld", (long long)v);
}

void cli_json_bool(cli_json *j, const char *key, bool v) {
  json_pre(j, key);
  fputs(v ? "true" : "false", j->f);
}

void cli_json_null(cli_json *j, const char *key) {
  json_pre(j, key);
  fputs("null", j->f);
}

/* ---- tables ------------------------------------------------------------------------- */

struct cli_table {
  int ncols, nrows, dropped;
  char *head[CLI_TABLE_MAX_COLS];
  char **cells; /* nrows * ncols */
  int cap;
  bool right[CLI_TABLE_MAX_COLS];
};

static char *dupstr(const char *s) {
  if (!s) s = "";
  size_t n = strlen(s) + 1;
  char *d = malloc(n);
  if (d) memcpy(d, s, n);
  return d;
}

/* Display width of UTF-8 text: one column per code point (the box characters and the
** text this tool prints are all single-width). */
static int text_width(const char *s) {
  int w = 0;
  for (const unsigned char *p = (const unsigned char *)s; *p; p++)
    if ((*p & 0xC0) != 0x80) w++;
  return w;
}

cli_table *cli_table_new(int ncols, const char *const *headers) {
  if (ncols < 1 || ncols > CLI_TABLE_MAX_COLS) return NULL;
  cli_table *t = calloc(1, sizeof *t);
  if (!t) return NULL;
  t->ncols = ncols;
  for (int c = 0; c < ncols; c++) t->head[c] = dupstr(headers[c]);
  return t;
}

void cli_table_row(cli_table *t, const char *const *cells) {
  if (!t) return;
  if (t->nrows >= CLI_TABLE_MAX_ROWS) {
    t->dropped++;
    return;
  }
  if (t->nrows == t->cap) {
    int cap = t->cap ? 2 * t->cap : 16;
    char **nc = realloc(t->cells, sizeof(char *) * (size_t)cap * (size_t)t->ncols);
    if (!nc) {
      t->dropped++;
      return;
    }
    t->cells = nc;
    t->cap = cap;
  }
  for (int c = 0; c < t->ncols; c++) /* cells may hold names from files: made safe to print */
    t->cells[t->nrows * t->ncols + c] = cli_safe_text(cells[c] ? cells[c] : "");
  t->nrows++;
}

void cli_table_align_right(cli_table *t, int c) {
  if (t && c >= 0 && c < t->ncols) t->right[c] = true;
}

static void put_cell(FILE *f, const char *s, int width, bool right) {
  int pad = width - text_width(s);
  if (right)
    for (int i = 0; i < pad; i++) fputc(' ', f);
  fputs(s, f);
  if (!right)
    for (int i = 0; i < pad; i++) fputc(' ', f);
}

static void rule(FILE *f, const int *w, int ncols, const char *l, const char *m, const char *r) {
  fputs(l, f);
  for (int c = 0; c < ncols; c++) {
    for (int i = 0; i < w[c] + 2; i++) fputs("─", f);
    fputs(c + 1 < ncols ? m : r, f);
  }
  fputc('\n', f);
}

void cli_table_print(FILE *f, const cli_table *t, bool pretty) {
  if (!t) return;
  int w[CLI_TABLE_MAX_COLS];
  for (int c = 0; c < t->ncols; c++) {
    w[c] = text_width(t->head[c]);
    for (int r = 0; r < t->nrows; r++) {
      int x = text_width(t->cells[r * t->ncols + c]);
      if (x > w[c]) w[c] = x;
    }
  }
  if (pretty) {
    rule(f, w, t->ncols, "┌", "┬", "┐");
    fputs("│", f);
    for (int c = 0; c < t->ncols; c++) {
      fputs(" \033[1m", f);
      put_cell(f, t->head[c], w[c], t->right[c]);
      fputs("\033[0m │", f);
    }
    fputc('\n', f);
    rule(f, w, t->ncols, "├", "┼", "┤");
    for (int r = 0; r < t->nrows; r++) {
      fputs("│", f);
      for (int c = 0; c < t->ncols; c++) {
        fputc(' ', f);
        put_cell(f, t->cells[r * t->ncols + c], w[c], t->right[c]);
        fputs(" │", f);
      }
      fputc('\n', f);
    }
    rule(f, w, t->ncols, "└", "┴", "┘");
  } else {
    for (int c = 0; c < t->ncols; c++) {
      put_cell(f, t->head[c], c + 1 < t->ncols || t->right[c] ? w[c] : 0, t->right[c]);
      fputs(c + 1 < t->ncols ? "  " : "\n", f);
    }
    for (int r = 0; r < t->nrows; r++)
      for (int c = 0; c < t->ncols; c++) {
        const char *s = t->cells[r * t->ncols + c];
        /* no trailing blanks on the last column */
        put_cell(f, s, c + 1 < t->ncols || t->right[c] ? w[c] : 0, t->right[c]);
        fputs(c + 1 < t->ncols ? "  " : "\n", f);
      }
  }
  if (t->dropped) fprintf(f, "... %d more rows\n", t->dropped);
}

void cli_table_free(cli_table *t) {
  if (!t) return;
  for (int c = 0; c < t->ncols; c++) free(t->head[c]);
  for (int i = 0; i < t->nrows * t->ncols; i++) free(t->cells[i]);
  free(t->cells);
  free(t);
}

void cli_heading(FILE *f, bool pretty, const char *title) {
  if (pretty) fprintf(f, "\n\033[1m%s\033[0m\n", title);
  else fprintf(f, "\n%s\n", title);
}
