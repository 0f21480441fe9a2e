/*
** Helpers for the tests that run the built programs (test_cli, test_examples*): find
** build/bin, run a command line with stdout and stderr captured, pull numbers out of
** JSON output. Header-only (static inline) so each test stays one file.
*/
#ifndef KILN_TESTS_CLI_RUN_H
#define KILN_TESTS_CLI_RUN_H

#include <limits.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static int cr_failures = 0;

#define CR_CHECK(cond, ...)                                                                \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                      \
      fprintf(stderr, __VA_ARGS__);                                                        \
      fputc('\n', stderr);                                                                 \
      cr_failures++;                                                                       \
    }                                                                                      \
  } while (0)

/* build/bin: $KILN_BUILD_DIR/bin (ctest sets it), else the directory of this test. */
static inline void cr_bin_dir(char *out, size_t n) {
  const char *b = getenv("KILN_BUILD_DIR");
  if (b && *b) {
    snprintf(out, n, "%s/bin", b);
    return;
  }
  char exe[PATH_MAX];
  ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (len <= 0) {
    snprintf(out, n, ".");
    return;
  }
  exe[len] = 0;
  char *slash = strrchr(exe, '/');
  if (slash) *slash = 0;
  size_t l = strlen(exe);
  if (l >= n) l = n - 1;
  memcpy(out, exe, l);
  out[l] = 0;
}

/* A fresh scratch directory (removed by cr_cleanup). */
static char cr_tmp[64];
static inline const char *cr_tmpdir(void) {
  if (!cr_tmp[0]) {
    snprintf(cr_tmp, sizeof cr_tmp, "/tmp/kiln_cli_test_XXXXXX");
    if (!mkdtemp(cr_tmp)) {
      perror("mkdtemp");
      exit(1);
    }
  }
  return cr_tmp;
}
static inline void cr_cleanup(void) {
  if (cr_tmp[0]) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", cr_tmp);
    if (system(cmd) != 0) fprintf(stderr, "warning: could not remove %s\n", cr_tmp);
  }
}

static inline char *cr_slurp(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) return calloc(1, 1);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *s = malloc((size_t)(n > 0 ? n : 0) + 1);
  size_t got = s ? fread(s, 1, (size_t)(n > 0 ? n : 0), f) : 0;
  if (s) s[got] = 0;
  fclose(f);
  return s;
}

typedef struct cr_result {
  int status; /* exit code, or 128 + signal, or -1 */
  char *out;  /* stdout (malloc'd) */
  char *err;  /* stderr */
} cr_result;

/* Runs `<bin>/<prog> <args>` in the scratch directory (args is shell text). */
static inline cr_result cr_run(const char *env, const char *prog, const char *args) {
  char bin[1024], cmd[8192], o[256], e[256];
  cr_bin_dir(bin, sizeof bin);
  const char *t = cr_tmpdir();
  snprintf(o, sizeof o, "%s/stdout.txt", t);
  snprintf(e, sizeof e, "%s/stderr.txt", t);
  snprintf(cmd, sizeof cmd, "cd '%s' && KILN_CLI_PLAIN=1 %s '%s/%s' %s >'%s' 2>'%s' </dev/null", t,
           env ? env : "", bin, prog, args, o, e);
  int rc = system(cmd);
  cr_result r;
  if (rc == -1) r.status = -1;
  else if (WIFEXITED(rc)) r.status = WEXITSTATUS(rc);
  else if (WIFSIGNALED(rc)) r.status = 128 + WTERMSIG(rc);
  else r.status = -1;
  r.out = cr_slurp(o);
  r.err = cr_slurp(e);
  if (r.status != 0 && getenv("KILN_TEST_VERBOSE"))
    fprintf(stderr, "--- %s %s -> %d\n%s\n%s\n", prog, args, r.status, r.out, r.err);
  return r;
}

static inline void cr_free(cr_result *r) {
  free(r->out);
  free(r->err);
}

/* The number after "key": in JSON text (first occurrence); NAN when absent. */
static inline double cr_json_num(const char *text, const char *key) {
  char pat[128];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char *p = text ? strstr(text, pat) : NULL;
  if (!p) return NAN;
  p += strlen(pat);
  while (*p == ' ') p++;
  char *end;
  double v = strtod(p, &end);
  return end == p ? NAN : v;
}

/* The raw text of the number after "key": (for bit-exact comparisons). */
static inline void cr_json_raw(const char *text, const char *key, char *out, size_t n) {
  char pat[128];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char *p = text ? strstr(text, pat) : NULL;
  out[0] = 0;
  if (!p) return;
  p += strlen(pat);
  size_t len = strcspn(p, ",}\n");
  snprintf(out, n, "%.*s", (int)len, p);
}

/* The last non-empty line of text (a program's closing JSON line), in buf. */
static inline const char *cr_last_line(const char *text, char *buf, size_t n) {
  size_t len = strlen(text);
  while (len > 0 && (text[len - 1] == '\n' || text[len - 1] == '\r')) len--;
  size_t start = len;
  while (start > 0 && text[start - 1] != '\n') start--;
  snprintf(buf, n, "%.*s", (int)(len - start), text + start);
  return buf;
}

static inline bool cr_file_exists(const char *path) {
  struct stat st;
  return stat(path, &st) == 0;
}

/* Fashion-MNIST's training images are installed ($KILN_DATA_DIR, or where
** dataset-fashion-mnist puts them): the examples' tests skip without them. */
static inline bool cr_have_fashion_mnist(void) {
  const char *d = getenv("KILN_DATA_DIR");
  char p[1100];
  if (d && *d) {
    snprintf(p, sizeof p, "%s/train-images-idx3-ubyte.gz", d);
    if (cr_file_exists(p)) return true;
    snprintf(p, sizeof p, "%s/fashion-mnist/train-images-idx3-ubyte.gz", d);
    if (cr_file_exists(p)) return true;
  }
  return cr_file_exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz") ||
         cr_file_exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte");
}

/* 0 when <bin>/prog is built and, with needs_fmnist, Fashion-MNIST is installed; else 77
** (ctest's skip code) after saying why on stderr. */
static inline int cr_require(const char *prog, bool needs_fmnist) {
  char bin[1024], exe[1100];
  cr_bin_dir(bin, sizeof bin);
  snprintf(exe, sizeof exe, "%s/%s", bin, prog);
  if (!cr_file_exists(exe)) {
    fprintf(stderr, "skip: %s not built\n", exe);
    return 77;
  }
  if (needs_fmnist && !cr_have_fashion_mnist()) {
    fprintf(stderr, "skip: Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)\n");
    return 77;
  }
  return 0;
}

/* The end of a test's main: the scratch directory removed, then the count of failed checks
** on stderr, or "<name>: all passed" on stdout. The exit code: 1 when a check failed. */
static inline int cr_finish(const char *name) {
  cr_cleanup();
  if (cr_failures) fprintf(stderr, "%d check(s) failed\n", cr_failures);
  else printf("%s: all passed\n", name);
  return cr_failures ? 1 : 0;
}

#endif /* KILN_TESTS_CLI_RUN_H */
