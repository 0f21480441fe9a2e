/*
** The kiln CLI's private helpers: one JSON writer, one table printer, the subcommands.
** The tool is written as a user would write it (DESIGN.md layer 6): only the public
** headers, never a kiln__ internal. Names here are cli_ (the program's own, not the
** library's; nothing here is exported).
*/
#ifndef KILN_CLI_H
#define KILN_CLI_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

/* Subcommands: argv[0] is the subcommand name. Return the process exit code. */
int cli_doctor(int argc, char **argv);
int cli_info(int argc, char **argv);
int cli_plot(int argc, char **argv); /* plot.c */

/* Wall clock in seconds (CLOCK_MONOTONIC). */
double cli_now(void);
/* Whether f is a terminal (pretty tables, colours). KILN_CLI_PLAIN=1 forces plain. */
bool cli_is_tty(FILE *f);

/* ---- JSON writer: commas and nesting are tracked, strings escaped (RFC 8259). ------- */
#define CLI_JSON_MAX_DEPTH 32
typedef struct cli_json {
  FILE *f;
  int depth;
  bool first[CLI_JSON_MAX_DEPTH];
} cli_json;

void cli_json_init(cli_json *j, FILE *f);
/* key is the member name inside an object, NULL inside an array or at the top. */
void cli_json_object_begin(cli_json *j, const char *key);
void cli_json_object_end(cli_json *j);
void cli_json_array_begin(cli_json *j, const char *key);
void cli_json_array_end(cli_json *j);
void cli_json_string(cli_json *j, const char *key, const char *v); /* NULL: null */
void cli_json_double(cli_json *j, const char *key, double v);      /* NaN/inf: null */
void cli_json_int(cli_json *j, const char *key, int64_t v);
void cli_json_bool(cli_json *j, const char *key, bool v);
void cli_json_null(cli_json *j, const char *key);
/* A JSON string literal of s (quotes included) on f. */
void cli_json_write_escaped(FILE *f, const char *s);

/* ---- text from files: names, metadata and paths are printed through these. --------- */
/* s with what a terminal would act on made visible: control bytes (C0, DEL, and the C1
** controls U+0080..U+009F, which include CSI) and bytes that are not valid UTF-8 become
** \xNN, a backslash becomes \\. Valid printable UTF-8 passes unchanged. A new string
** (free it); NULL on OOM. */
char *cli_safe_text(const char *s);
/* cli_safe_text(s) written to f. */
void cli_write_safe(FILE *f, const char *s);

/* ---- tables: box-drawn on a terminal, plain aligned columns otherwise. -------------- */
#define CLI_TABLE_MAX_COLS 8
#define CLI_TABLE_MAX_ROWS 4096
typedef struct cli_table cli_table;

cli_table *cli_table_new(int ncols, const char *const *headers);
/* Appends a row of ncols cells (copied; NULL prints as ""). Rows past the limit are
** counted and reported as "... N more" instead. */
void cli_table_row(cli_table *t, const char *const *cells);
/* Column c right-aligned (numbers). */
void cli_table_align_right(cli_table *t, int c);
void cli_table_print(FILE *f, const cli_table *t, bool pretty);
void cli_table_free(cli_table *t);

/* A section heading ("CPU", "Backends"): bold on a terminal. */
void cli_heading(FILE *f, bool pretty, const char *title);

#endif /* KILN_CLI_H */
