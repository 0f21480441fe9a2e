/*
** Shared by the examples: command-line parsing, strict, with messages that name the flag and
** the value. Header-only.
**
** An example lists its options in a table and calls ex_parse_args once:
**
**   const ex_opt opts[] = {
**     {.name = "--json", .kind = EX_FLAG, .out = &json},
**     {.name = "--epochs", .kind = EX_INT, .out = &epochs, .lo = 1, .hi = 100000},
**     {.name = "--lr", .kind = EX_NUM, .out = &lr, .lo = 0, .hi = 10},              // (lo, hi]
**     {.name = "--model", .kind = EX_CHOICE, .out = &model_name, .choices = "mlp|cnn"},
**     {.name = NULL}};
**   int rc = ex_parse_args(PROG, argc, argv, opts, usage);
**   if (rc >= 0) return rc;                                  // -h (0) or a bad option (2)
**
** -h and --help print the usage on stdout; an unknown option prints it on stderr.
*/
#ifndef KILN_EXAMPLES_OPTIONS_H
#define KILN_EXAMPLES_OPTIONS_H

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- argument parsing: strict, with messages that name the flag and the value ------- */

/* A whole-string integer in [lo, hi]; false (and a message on stderr) otherwise. */
static inline bool ex_parse_int(const char *prog, const char *flag, const char *s, long long lo,
                                long long hi, long long *out) {
  char *end = NULL;
  errno = 0;
  long long v = s ? strtoll(s, &end, 10) : 0;
  if (!s || !*s || *end || errno || v < lo || v > hi) {
    fprintf(stderr, "%s: %s needs an integer in [%lld, %lld], got '%s'\n", prog, flag, lo, hi,
            s ? s : "(nothing)");
    return false;
  }
  *out = v;
  return true;
}

/* A whole-string finite number > lo_excl and <= hi. */
static inline bool ex_parse_double(const char *prog, const char *flag, const char *s,
                                   double lo_excl, double hi, double *out) {
  char *end = NULL;
  errno = 0;
  double v = s ? strtod(s, &end) : 0;
  if (!s || !*s || *end || errno || !(v > lo_excl) || !(v <= hi)) {
    fprintf(stderr, "%s: %s needs a number in (%g, %g], got '%s'\n", prog, flag, lo_excl, hi,
            s ? s : "(nothing)");
    return false;
  }
  *out = v;
  return true;
}

/* The value after a flag, or a message when it is missing. */
static inline const char *ex_flag_value(const char *prog, int argc, char **argv, int *i) {
  if (*i + 1 >= argc) {
    fprintf(stderr, "%s: %s needs a value\n", prog, argv[*i]);
    return NULL;
  }
  return argv[++*i];
}

typedef enum {
  EX_FLAG,     /* bool *: set when given */
  EX_STR,      /* const char **: the value as given */
  EX_INT,      /* long long *: an integer in [lo, hi] */
  EX_NUM,      /* double *: a number in (lo, hi] */
  EX_NUM_0,    /* double *: a number in [lo, hi] */
  EX_AUTOCAST, /* const char **: bf16 or f16 */
  EX_CHOICE    /* const char **: one of choices ("a|b|c") */
} ex_opt_kind;

typedef struct ex_opt {
  const char *name;    /* "--epochs"; NULL ends the table */
  ex_opt_kind kind;
  void *out;
  double lo, hi;       /* EX_INT, EX_NUM, EX_NUM_0 */
  const char *choices; /* EX_CHOICE */
  const char *alias;   /* another spelling ("-q" for "--quiet"), or NULL */
  bool *seen;          /* when not NULL, set true whenever the option is given */
} ex_opt;

/* Whether v is one of the '|'-separated words of list. */
static inline bool ex_choice_ok(const char *list, const char *v) {
  size_t n = strlen(v);
  for (const char *p = list; p && *p;) {
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    if (len == n && !strncmp(p, v, n)) return true;
    p = bar ? bar + 1 : NULL;
  }
  return false;
}

/* "mlp|cnn" as "mlp or cnn" (and "a|b|c" as "a, b or c") on f. */
static inline void ex_print_choices(FILE *f, const char *list) {
  for (const char *p = list; p && *p;) {
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    fprintf(f, "%.*s", (int)len, p);
    p = bar ? bar + 1 : NULL;
    if (p) fputs(strchr(p, '|') ? ", " : " or ", f);
  }
}

/* One option's value into o->out; false after saying what is wrong. */
static inline bool ex_opt_set(const char *prog, const ex_opt *o, const char *a, const char *v) {
  switch (o->kind) {
  case EX_FLAG:
    *(bool *)o->out = true;
    return true;
  case EX_STR:
    *(const char **)o->out = v;
    return true;
  case EX_INT:
    return ex_parse_int(prog, a, v, (long long)o->lo, (long long)o->hi, (long long *)o->out);
  case EX_NUM:
    return ex_parse_double(prog, a, v, o->lo, o->hi, (double *)o->out);
  case EX_NUM_0: {
    char *end = NULL;
    errno = 0;
    double x = strtod(v, &end);
    if (!*v || *end || errno || !(x >= o->lo) || !(x <= o->hi)) {
      fprintf(stderr, "%s: %s needs a number in [%g, %g], got '%s'\n", prog, a, o->lo, o->hi, v);
      return false;
    }
    *(double *)o->out = x;
    return true;
  }
  case EX_AUTOCAST:
  case EX_CHOICE: {
    const char *list = o->kind == EX_AUTOCAST ? "bf16|f16" : o->choices;
    if (!ex_choice_ok(list, v)) {
      fprintf(stderr, "%s: %s '%s': use ", prog, a, v);
      ex_print_choices(stderr, list);
      fputc('\n', stderr);
      return false;
    }
    *(const char **)o->out = v;
    return true;
  }
  }
  return false;
}

/* Parses argv[1..argc) against opts (ended by a NULL name). -1: every option taken; 0: help
** printed (exit 0); 2: a bad option, said on stderr (exit 2). */
static inline int ex_parse_args(const char *prog, int argc, char **argv, const ex_opt *opts, void (*usage)(FILE *)) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      usage(stdout);
      return 0;
    }
    const ex_opt *o = opts;
    while (o->name && strcmp(a, o->name) && !(o->alias && !strcmp(a, o->alias))) o++;
    if (!o->name) {
      fprintf(stderr, "%s: unknown option '%s'\n", prog, a);
      usage(stderr);
      return 2;
    }
    const char *v = NULL;
    if (o->kind != EX_FLAG && !(v = ex_flag_value(prog, argc, argv, &i))) return 2;
    if (!ex_opt_set(prog, o, a, v)) return 2;
    if (o->seen) *o->seen = true;
  }
  return -1;
}

#endif /* KILN_EXAMPLES_OPTIONS_H */
