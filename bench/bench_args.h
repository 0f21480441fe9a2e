/*
** The benchmarks' command lines, read strictly (one copy, included by each benchmark):
** a number must be the whole argument and inside its range, a flag that takes a value must
** have one, an unknown flag is refused. Every refusal names the program, the flag (or the
** positional argument) and what was given, prints the usage line, and exits 2:
**
**   bench-conv: --reps: expected an integer from 1 to 1000000, got 'abc'
**   usage: bench-conv [--cuda | --cuda-fmnist] [--reps R | R]
**
** -h and --help print the usage on stdout and exit 0. The loop of a program:
**
**   bench_args cli = bench_args_begin("bench-x", "[--device D] [--steps N]", argc, argv);
**   for (const char *a; (a = bench_args_next(&cli));) {
**     if (!strcmp(a, "--device")) bench_args_device(&cli, &dev);
**     else if (!strcmp(a, "--steps")) steps = (int)bench_args_int(&cli, 1, 1000000);
**     else bench_args_unknown(&cli);
**   }
**
** Exiting from here is safe: nothing has been allocated yet when a command line is read.
*/
#ifndef KILN_BENCH_ARGS_H
#define KILN_BENCH_ARGS_H

#include <kiln.h>

#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct bench_args {
  const char *prog;  /* "bench-conv": the start of every message */
  const char *usage; /* what follows "usage: <prog> " */
  int argc;
  char **argv;
  int i;    /* the argument bench_args_next returned last */
  int npos; /* positional arguments taken by bench_args_positional */
} bench_args;

static inline bench_args bench_args_begin(const char *prog, const char *usage, int argc, char **argv) {
  bench_args c = {prog, usage, argc, argv, 0, 0};
  return c;
}

static inline void bench_args_usage(const bench_args *c, FILE *f) {
  fprintf(f, "usage: %s %s\n", c->prog, c->usage);
}

/* "<prog>: <message>", the usage line, exit 2. */
#if defined(__GNUC__) || defined(__clang__)
__attribute__((format(printf, 2, 3)))
#endif
static inline _Noreturn void bench_args_fail(const bench_args *c, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s: ", c->prog);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  bench_args_usage(c, stderr);
  exit(2);
}

/* The next argument, NULL after the last. -h and --help print the usage and exit 0. */
/* The tuning switches set (kiln_env_switch), one line on stderr: a figure measured off
** kiln's defaults says so where it is printed. Nothing when none is set. */
static inline void bench_args_note_switches(const char *prog) {
  char set[1024] = "";
  size_t used = 0;
  for (int i = 0; kiln_env_switch(i) && used < sizeof set; i++) {
    const char *v = getenv(kiln_env_switch(i));
    if (v && *v) used += (size_t)snprintf(set + used, sizeof set - used, "%s%s=%s", used ? ", " : "", kiln_env_switch(i), v);
  }
  if (used) fprintf(stderr, "%s: tuning switches set (kiln off its defaults): %s\n", prog, set);
}

static inline const char *bench_args_next(bench_args *c) {
  if (++c->i >= c->argc) {
    if (c->i == c->argc) bench_args_note_switches(c->prog); /* the command line read: once */
    return NULL;
  }
  const char *a = c->argv[c->i];
  if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
    bench_args_usage(c, stdout);
    exit(0);
  }
  return a;
}

/* The current argument is not a flag this program knows. */
static inline _Noreturn void bench_args_unknown(const bench_args *c) {
  bench_args_fail(c, "unknown option '%s'", c->argv[c->i]);
}

/* An argument that looks like a flag (--x, or -x with a letter), rather than a value such
** as a negative number: the programs with positional arguments refuse these by name. */
static inline int bench_args_is_flag(const char *a) {
  return a[0] == '-' && (a[1] == '-' || (a[1] >= 'a' && a[1] <= 'z') || (a[1] >= 'A' && a[1] <= 'Z'));
}

/* For a program whose arguments are positional: the position (0, 1, ...) of the current
** argument. A flag, or an argument past the first max, is refused. */
static inline int bench_args_positional(bench_args *c, int max) {
  const char *a = c->argv[c->i];
  if (bench_args_is_flag(a)) bench_args_unknown(c);
  if (c->npos == max) bench_args_fail(c, "too many arguments ('%s'): at most %d", a, max);
  return c->npos++;
}

/* The value of the current flag (the next argument, consumed). */
static inline const char *bench_args_value(bench_args *c) {
  const char *flag = c->argv[c->i];
  if (c->i + 1 >= c->argc) bench_args_fail(c, "%s needs a value", flag);
  return c->argv[++c->i];
}

/* s as an integer in [lo, hi]: all of s, decimal, optionally signed, no spaces. `what`
** names it in the message: the flag, or the positional argument's name. */
static inline long long bench_args_parse_int(const bench_args *c, const char *what, const char *s, long long lo,
                                             long long hi) {
  char *end = NULL;
  errno = 0;
  /* strtoll skips leading spaces and takes "" as 0: only a sign or a digit may start s */
  long long x = (s[0] == '-' || s[0] == '+' || (s[0] >= '0' && s[0] <= '9')) ? strtoll(s, &end, 10) : 0;
  if (!end || end == s || *end || errno == ERANGE || x < lo || x > hi)
    bench_args_fail(c, "%s: expected an integer from %lld to %lld, got '%s'", what, lo, hi, s);
  return x;
}

/* s as a finite number in [lo, hi], all of s. */
static inline double bench_args_parse_double(const bench_args *c, const char *what, const char *s, double lo,
                                             double hi) {
  char *end = NULL;
  errno = 0;
  double x = (s[0] == '-' || s[0] == '+' || s[0] == '.' || (s[0] >= '0' && s[0] <= '9')) ? strtod(s, &end) : 0;
  /* !(x >= lo && x <= hi) also refuses nan */
  if (!end || end == s || *end || errno == ERANGE || !(x >= lo && x <= hi))
    bench_args_fail(c, "%s: expected a number from %g to %g, got '%s'", what, lo, hi, s);
  return x;
}

/* The current flag's value as an integer in [lo, hi]. */
static inline long long bench_args_int(bench_args *c, long long lo, long long hi) {
  const char *flag = c->argv[c->i];
  return bench_args_parse_int(c, flag, bench_args_value(c), lo, hi);
}

/* The current flag's value as a number in [lo, hi]. */
static inline double bench_args_double(bench_args *c, double lo, double hi) {
  const char *flag = c->argv[c->i];
  return bench_args_parse_double(c, flag, bench_args_value(c), lo, hi);
}

/* The current flag's value as a comma-separated list of 1 to max integers in [lo, hi]
** ("32,128,1024"); returns the count. */
static inline int bench_args_int_list(bench_args *c, int64_t *out, int max, long long lo, long long hi) {
  const char *flag = c->argv[c->i], *v = bench_args_value(c);
  char item[64];
  int n = 0;
  for (const char *s = v;; n++) {
    size_t len = strcspn(s, ",");
    if (n == max) bench_args_fail(c, "%s: at most %d values, got '%s'", flag, max, v);
    if (len == 0 || len >= sizeof item)
      bench_args_fail(c, "%s: expected a comma-separated list of integers from %lld to %lld, got '%s'", flag, lo,
                      hi, v);
    memcpy(item, s, len);
    item[len] = 0;
    out[n] = bench_args_parse_int(c, flag, item, lo, hi);
    if (!s[len]) return n + 1;
    s += len + 1;
  }
}

/* s as one of choices (NULL-terminated); returns its index. */
static inline int bench_args_parse_choice(const bench_args *c, const char *what, const char *s,
                                          const char *const *choices) {
  char list[256] = "";
  for (int k = 0; choices[k]; k++) {
    if (!strcmp(s, choices[k])) return k;
    size_t used = strlen(list);
    snprintf(list + used, sizeof list - used, "%s%s", k ? ", " : "", choices[k]);
  }
  bench_args_fail(c, "%s: expected one of %s, got '%s'", what, list, s);
}

/* The current flag's value as one of choices; returns its index. */
static inline int bench_args_choice(bench_args *c, const char *const *choices) {
  const char *flag = c->argv[c->i];
  return bench_args_parse_choice(c, flag, bench_args_value(c), choices);
}

/* The current flag's value as a device ("cpu", "cuda", "cuda:1"). */
static inline void bench_args_device(bench_args *c, kiln_device *dev) {
  const char *flag = c->argv[c->i], *v = bench_args_value(c);
  if (kiln_device_parse(v, dev) != KILN_OK) bench_args_fail(c, "%s '%s': %s", flag, v, kiln_last_error_message());
}

#endif
