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
      if (*p < 0x20) fprintf(f, "\\u%04x", *p);
      else fputc(*p, f); /* UTF-8 bytes pass through: JSON text is UTF-8 */
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
  for (int c = 0; c < t->ncols; c++)
    t->cells[t->nrows * t->ncols + c] = dupstr(cells[c]);
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
