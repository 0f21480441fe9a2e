/* Issue 17.5: the KILN_* environment variables are checked: kiln_env_check names the
** variable, the value and what is accepted; the library's own readers warn and keep the
** default instead of taking a bad value (KILN_NUM_THREADS=100000 ran 1024 threads). */
#define _POSIX_C_SOURCE 200809L
#include "kiln_int.h"

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
  if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
  else printf("test_env: all passed\n");
  return failures ? 1 : 0;
}
