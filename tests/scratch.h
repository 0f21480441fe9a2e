/* A scratch directory for tests that write files: in /dev/shm when writable (the fuzz
** loops write thousands of damaged files), else /tmp. Header-only. */
#ifndef KILN_TEST_SCRATCH_H
#define KILN_TEST_SCRATCH_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* Makes <shm or tmp>/kiln_test_<tag>_XXXXXX into dir; 0 on success, -1 (and perror). */
static inline int scratch_begin(char *dir, size_t n, const char *tag) {
  snprintf(dir, n, "%s/kiln_test_%s_XXXXXX", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp", tag);
  if (!mkdtemp(dir)) {
    perror("mkdtemp");
    return -1;
  }
  return 0;
}

/* Removes the directory and everything in it. */
static inline void scratch_end(const char *dir) {
  char cmd[600];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

#endif
