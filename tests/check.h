/*
** The check macro of the test programs that count failures and go on (one failed check
** does not hide the next). Each program includes this once, uses CHECK(cond), and ends
** main with `return failures ? 1 : 0` after printing the count (check_finish does both). The failing line is
** printed with kiln's last error, which usually says what went wrong.
*/
#ifndef KILN_TEST_CHECK_H
#define KILN_TEST_CHECK_H

#include <kiln.h>

#include <stdio.h>

static int failures; /* failed checks in this program */

#define CHECK(cond)                                                                       \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      fprintf(stderr, "%s:%d: CHECK(%s) failed; last error: %s\n", __FILE__, __LINE__,    \
              #cond, kiln_last_error_message());                                          \
      failures++;                                                                         \
    }                                                                                     \
  } while (0)

/* The end of a test's main: "<name>: N check(s) failed" on stderr and 1, else "<name>: all
** passed" on stdout and 0. */
static inline int check_finish(const char *name) {
  if (failures) {
    fprintf(stderr, "%s: %d check(s) failed\n", name, failures);
    return 1;
  }
  printf("%s: all passed\n", name);
  return 0;
}

#endif
