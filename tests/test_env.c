/* Issue 17.5: the KILN_* environment variables are checked: kiln_env_check names the
** variable, the value and what is accepted; the library's own readers warn and keep the
** default instead of taking a bad value (KILN_NUM_THREADS=100000 ran 1024 threads). The
** tuning switches the same way, from their table (src/core/knobs.c), and every KILN_ name
** the sources read or the tests set is one kiln knows. */
#define _XOPEN_SOURCE 700
#include "kiln_int.h"

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"

static void expect_bad(const char *name, const char *value, kiln_status code, const char *needle) {
  setenv(name, value, 1);
  kiln_status st = kiln_env_check(name);
  int ok = st == code && strstr(kiln_last_error_message(), name) && strstr(kiln_last_error_message(), value) &&
           strstr(kiln_last_error_message(), needle);
  if (!ok) fprintf(stderr, "%s=%s: got %s \"%s\"\n", name, value, kiln_error_name(st), kiln_last_error_message());
  CHECK(ok);
  CHECK(kiln_env_check(NULL) == code); /* all of them: the first problem */
  unsetenv(name);
}

static void expect_good(const char *name, const char *value) {
  setenv(name, value, 1);
  CHECK(kiln_env_check(name) == KILN_OK);
  unsetenv(name);
}

/* ---- the tuning switches ---- */

static void test_switches(void) {
  int n = 0;
  for (const char *prev = NULL, *name; (name = kiln_env_switch(n)) != NULL; prev = name, n++) {
    const char *what = NULL;
    CHECK(kiln_env_about(name, &what) == KILN_ENV_TUNING && what && *what);
    if (prev && strcmp(prev, name) >= 0) fprintf(stderr, "switches out of order: %s, %s\n", prev, name);
    CHECK(!prev || strcmp(prev, name) < 0); /* knobs.c's bsearch needs the order */
    unsetenv(name);
  }
  CHECK(n > 40);
  CHECK(kiln_env_switch(-1) == NULL);
  CHECK(kiln_env_check(NULL) == KILN_OK);

  expect_bad("KILN_ATTENTION", "flash", KILN_ERR_INVALID_ARGUMENT, "own|cudnn-fwd|cudnn-bwd|cudnn");
  expect_bad("KILN_CONV_GEMM", "off", KILN_ERR_INVALID_ARGUMENT, "0 or 1");
  expect_bad("KILN_BN_P3_ROWS", "0", KILN_ERR_INVALID_ARGUMENT, "from 1 to 4096");
  expect_bad("KILN_BN_P3_ROWS", "16x", KILN_ERR_INVALID_ARGUMENT, "from 1 to 4096");
  expect_bad("KILN_LCE_CHUNK_ELEMS", "-5", KILN_ERR_INVALID_ARGUMENT, "an integer from 1");
  expect_bad("KILN_CUDA_RLN", "warp,bogus", KILN_ERR_INVALID_ARGUMENT, "a comma list of");
  expect_bad("KILN_CUDA_RLN", "warp,", KILN_ERR_INVALID_ARGUMENT, "a comma list of");
  expect_good("KILN_CUDA_RLN", "warp,winter");
  expect_good("KILN_ATTENTION", "own");
  expect_good("KILN_LCE_CHUNK_ELEMS", "400");
  expect_good("KILN_VULKAN_LOADER", "/nonexistent/libvulkan.so.1");

  /* the readers: the accepted value, else the caller's default */
  setenv("KILN_CONV_GEMM", "0", 1);
  CHECK(!kiln__knob_on("KILN_CONV_GEMM", true));
  setenv("KILN_CONV_GEMM", "off", 1); /* warned once on stderr */
  CHECK(kiln__knob_on("KILN_CONV_GEMM", true) && !kiln__knob_on("KILN_CONV_GEMM", false));
  unsetenv("KILN_CONV_GEMM");
  CHECK(kiln__knob_on("KILN_CONV_GEMM", true));
  setenv("KILN_ATTENTION", "cudnn-bwd", 1);
  CHECK(kiln__knob_choice("KILN_ATTENTION", 3) == 2);
  setenv("KILN_ATTENTION", "cuDNN", 1);
  CHECK(kiln__knob_choice("KILN_ATTENTION", 3) == 3);
  unsetenv("KILN_ATTENTION");
  setenv("KILN_BN_P3_ROWS", "32", 1);
  CHECK(kiln__knob_int("KILN_BN_P3_ROWS", 16) == 32);
  setenv("KILN_BN_P3_ROWS", "5000", 1);
  CHECK(kiln__knob_int("KILN_BN_P3_ROWS", 16) == 16);
  unsetenv("KILN_BN_P3_ROWS");
  setenv("KILN_CUDA_RLN", "warp,winter", 1);
  CHECK(kiln__knob_lists("KILN_CUDA_RLN", "winter") && kiln__knob_lists("KILN_CUDA_RLN", "warp"));
  CHECK(!kiln__knob_lists("KILN_CUDA_RLN", "win") && !kiln__knob_lists("KILN_CUDA_RLN", "f64"));
  setenv("KILN_CUDA_RLN", "warp,bogus", 1); /* not accepted: none of it */
  CHECK(!kiln__knob_lists("KILN_CUDA_RLN", "warp"));
  unsetenv("KILN_CUDA_RLN");

  /* names kiln does not read, and the others it knows */
  const char *what = "x";
  CHECK(kiln_env_about("KILN_FALLBAK", &what) == KILN_ENV_UNKNOWN && what == NULL);
  CHECK(kiln_env_check("KILN_FALLBAK") == KILN_ERR_INVALID_ARGUMENT &&
        strstr(kiln_last_error_message(), "did you mean KILN_FALLBACK?"));
  CHECK(kiln_env_check("KILN_ATENTION") == KILN_ERR_INVALID_ARGUMENT &&
        strstr(kiln_last_error_message(), "did you mean KILN_ATTENTION?"));
  CHECK(kiln_env_check("KILN_SOMETHING_ELSE_ENTIRELY") == KILN_ERR_INVALID_ARGUMENT &&
        !strstr(kiln_last_error_message(), "did you mean"));
  /* the nearest name on its own (kiln doctor's fix line): settings, switches, tools' names */
  CHECK(kiln_env_nearest("KILN_FALLBAK") && !strcmp(kiln_env_nearest("KILN_FALLBAK"), "KILN_FALLBACK"));
  CHECK(kiln_env_nearest("KILN_ATENTION") && !strcmp(kiln_env_nearest("KILN_ATENTION"), "KILN_ATTENTION"));
  CHECK(kiln_env_nearest("KILN_SKIP_DEP") && !strcmp(kiln_env_nearest("KILN_SKIP_DEP"), "KILN_SKIP_DEPS"));
  CHECK(kiln_env_nearest("KILN_DEVICE") && !strcmp(kiln_env_nearest("KILN_DEVICE"), "KILN_DEVICE"));
  CHECK(!kiln_env_nearest("KILN_SOMETHING_ELSE_ENTIRELY") && !kiln_env_nearest(NULL) && !kiln_env_nearest(""));
  CHECK(kiln_env_about("KILN_DATA_DIR", &what) == KILN_ENV_SETTING && what);
  CHECK(kiln_env_about("KILN_DEVICE", NULL) == KILN_ENV_SETTING);
  CHECK(kiln_env_about("KILN_TEST_DEVICE", &what) == KILN_ENV_TOOL && what);
  CHECK(kiln_env_about("KILN_TEST_", NULL) == KILN_ENV_UNKNOWN);
  CHECK(kiln_env_about(NULL, NULL) == KILN_ENV_UNKNOWN);
}

/* ---- every KILN_ name the sources read and the tests set, known ---- */

static int scanned_files, scanned_names;
static size_t src_len; /* KILN_SOURCE_DIR's length: paths are judged below it */

/* Checks each KILN_X right after marker in text: a switch (tuning) or any known name; where
** a value follows (`KILN_X=value` in CMake and scripts), that it is accepted. assigned: only
** the names a value follows (CMake's own variables are KILN_ names too). */
static void check_names(const char *path, const char *text, const char *marker, bool tuning, bool assigned) {
  for (const char *p = strstr(text, marker); p && *p; p = strstr(p + 1, marker)) {
    const char *q = p + strlen(marker);
    if (strncmp(q, "KILN_", 5)) continue;
    char name[80];
    size_t n = 0;
    while (n + 1 < sizeof name && ((q[n] >= 'A' && q[n] <= 'Z') || (q[n] >= '0' && q[n] <= '9') || q[n] == '_'))
      name[n] = q[n], n++;
    name[n] = 0;
    if (name[n - 1] == '_' || (assigned && q[n] != '=')) continue; /* a prefix being built, not a name */
    if (assigned && p > text && ((p[-1] >= 'A' && p[-1] <= 'Z') || p[-1] == '_')) continue; /* inside a longer name */
    if (assigned) { /* a compile definition is no environment */
      const char *line = p;
      while (line > text && line[-1] != '\n') line--;
      const char *eol = strchr(p, '\n');
      char buf[512];
      snprintf(buf, sizeof buf, "%.*s", (int)(eol ? eol - line : (long)strlen(line)), line);
      if (strstr(buf, "compile_definitions")) continue;
    }
    scanned_names++;
    kiln_env_kind kind = kiln_env_about(name, NULL);
    bool ok = tuning ? kind == KILN_ENV_TUNING : kind != KILN_ENV_UNKNOWN;
    if (!ok) fprintf(stderr, "%s: %s is not %s kiln knows (src/core/knobs.c, env.c)\n", path, name, tuning ? "a switch" : "a name");
    CHECK(ok);
    const char *v = q[n] == '=' ? q + n + 1 : !strncmp(q + n, "\", \"", 4) ? q + n + 4 : NULL; /* CMake, setenv */
    const char *self = strstr(path, "tests/test_env.c"); /* its bad values are the point */
    if (v && kind == KILN_ENV_TUNING && !(self && !self[16])) { /* a value the tests run with */
      char value[64];
      size_t m = 0;
      while (m + 1 < sizeof value && v[m] && !strchr(" ;\"')\n$", v[m])) value[m] = v[m], m++;
      value[m] = 0;
      if (v[m] == '$') continue;
      setenv(name, value, 1);
      if (kiln_env_check(name) != KILN_OK) fprintf(stderr, "%s: %s=%s: %s\n", path, name, value, kiln_last_error_message());
      CHECK(kiln_env_check(name) == KILN_OK);
      unsetenv(name);
    }
  }
}

static int scan_file(const char *path, const struct stat *st, int type, struct FTW *ftw) {
  (void)ftw;
  const char *dot = strrchr(path, '.'), *base = strrchr(path, '/');
  base = base ? base + 1 : path;
  bool code = dot && (!strcmp(dot, ".c") || !strcmp(dot, ".h") || !strcmp(dot, ".cu") || !strcmp(dot, ".cuh"));
  bool cmake = !strcmp(base, "CMakeLists.txt") || (dot && !strcmp(dot, ".sh"));
  if (type != FTW_F || (!code && !cmake) || st->st_size > (4 << 20) || strstr(path + src_len, "/build")) return 0;
  FILE *f = fopen(path, "rb");
  if (!f) return 0;
  char *text = calloc(1, (size_t)st->st_size + 1);
  if (text && fread(text, 1, (size_t)st->st_size, f) == (size_t)st->st_size) {
    scanned_files++;
    static const char *const readers[] = {"kiln__knob_on(\"", "kiln__knob_int(\"", "kiln__knob_choice(\"",
                                          "kiln__knob_lists(\"", "kiln__knob_text(\"", "kc_env_zero(\"",
                                          "env_off(\""};
    for (size_t i = 0; code && i < sizeof readers / sizeof readers[0]; i++) check_names(path, text, readers[i], true, false);
    static const char *const others[] = {"getenv(\"", "setenv(\"", "unsetenv(\""};
    for (size_t i = 0; code && i < sizeof others / sizeof others[0]; i++) check_names(path, text, others[i], false, false);
    if (cmake) check_names(path, text, "", false, true);
  }
  free(text);
  fclose(f);
  return 0;
}

static void test_sources_known(void) {
  const char *src = getenv("KILN_SOURCE_DIR");
  if (!src || !*src) {
    printf("test_env: KILN_SOURCE_DIR unset: the source scan skipped\n");
    return;
  }
  src_len = strlen(src);
  const char *dirs[] = {"src", "tools", "examples", "bench", "tests", "scripts"};
  for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", src, dirs[i]);
    nftw(path, scan_file, 16, FTW_PHYS);
  }
  CHECK(scanned_files > 100 && scanned_names > 100);
  printf("test_env: %d KILN_ names in %d files known\n", scanned_names, scanned_files);
}

int main(void) {
  unsetenv("KILN_DEVICE");
  unsetenv("KILN_NUM_THREADS");
  unsetenv("KILN_FALLBACK");
  unsetenv("KILN_PROFILE");
  unsetenv("KILN_ANOMALY");
  CHECK(kiln_env_check(NULL) == KILN_OK);
  const char *bad_threads[] = {"0", "-1", "abc", "4x", "100000", " 2", "+2", "1e3", "99999999999999999999"};
  for (size_t i = 0; i < sizeof bad_threads / sizeof bad_threads[0]; i++)
    expect_bad("KILN_NUM_THREADS", bad_threads[i], KILN_ERR_INVALID_ARGUMENT, "1 to 1024");
  expect_good("KILN_NUM_THREADS", "1");
  expect_good("KILN_NUM_THREADS", "1024");
  expect_bad("KILN_FALLBACK", "nonsense", KILN_ERR_INVALID_ARGUMENT, "warn (the default), error or silent");
  expect_bad("KILN_FALLBACK", "Warn", KILN_ERR_INVALID_ARGUMENT, "silent");
  expect_good("KILN_FALLBACK", "error");
  expect_bad("KILN_DEVICE", "nonsense", KILN_ERR_INVALID_ARGUMENT, "cpu, cuda or cuda:N");
  expect_bad("KILN_DEVICE", "cuda:x", KILN_ERR_DEVICE, "cuda:x");
  expect_good("KILN_DEVICE", "cpu");
  if (!kiln_backend_available(KILN_DEVICE_CUDA, NULL))
    expect_bad("KILN_DEVICE", "cuda", KILN_ERR_DEVICE, "not available");
  expect_bad("KILN_PROFILE", "yes", KILN_ERR_INVALID_ARGUMENT, "device");
  expect_good("KILN_PROFILE", "device");
  expect_good("KILN_PROFILE", "trace:/tmp/kiln-trace.json");
  expect_bad("KILN_PROFILE", "trace:", KILN_ERR_INVALID_ARGUMENT, "trace:FILE");
  expect_bad("KILN_ANOMALY", "yes", KILN_ERR_INVALID_ARGUMENT, "0 (off)");
  expect_good("KILN_ANOMALY", "1");
  CHECK(kiln_env_check("KILN_NOPE") == KILN_ERR_INVALID_ARGUMENT);

  /* The library's readers: a bad value means the default, and the caller's last error
  ** is left alone. */
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  kiln_set_error(KILN_ERR_SHAPE, "earlier error");
  setenv("KILN_NUM_THREADS", "100000", 1);
  CHECK(kiln__env_num_threads() == 0);
  kiln_set_num_threads(0); /* forget the cached count: read the environment again */
  int n = kiln_num_threads();
  CHECK(n >= 1 && n <= (cores > 0 ? cores : 1));
  setenv("KILN_NUM_THREADS", "3", 1);
  CHECK(kiln__env_num_threads() == 3);
  unsetenv("KILN_NUM_THREADS");
  setenv("KILN_FALLBACK", "nonsense", 1);
  CHECK(kiln__env_fallback_policy() == KILN_FALLBACK_WARN);
  setenv("KILN_FALLBACK", "silent", 1);
  CHECK(kiln__env_fallback_policy() == KILN_FALLBACK_SILENT);
  unsetenv("KILN_FALLBACK");
  CHECK(kiln_last_error() == KILN_ERR_SHAPE && !strcmp(kiln_last_error_message(), "earlier error"));

  test_switches();
  test_sources_known();
  if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
  else printf("test_env: all passed\n");
  return failures ? 1 : 0;
}
