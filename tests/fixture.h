/* Shared by the tests that read fixtures and write files: a fixture's path, a whole file
** read into memory, bytes written to a file. Header-only. */
#ifndef KILN_TEST_FIXTURE_H
#define KILN_TEST_FIXTURE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* tests/fixtures/<name>: under KILN_SOURCE_DIR (ctest sets it), else next to this file.
** The path is in a static buffer, good until the next call. */
static inline const char *fixture(const char *name) {
  static char out[1024];
  const char *src = getenv("KILN_SOURCE_DIR");
  if (src) snprintf(out, sizeof out, "%s/tests/fixtures/%s", src, name);
  else {
    const char *f = __FILE__, *slash = strrchr(f, '/');
    snprintf(out, sizeof out, "%.*s/fixtures/%s", slash ? (int)(slash - f) : 1, slash ? f : ".", name);
  }
  return out;
}

/* The whole file (malloc'd, one spare byte after the *n read), or NULL when it cannot be
** opened or the memory is not there. */
static inline unsigned char *read_all(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long sz = ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = sz >= 0 ? malloc((size_t)sz + 1) : NULL;
  *n = b ? fread(b, 1, (size_t)sz, f) : 0;
  fclose(f);
  return b;
}

/* n bytes of b as the whole file at path. */
static inline void write_all(const char *path, const void *b, size_t n) {
  FILE *f = fopen(path, "wb");
  if (n) fwrite(b, 1, n, f);
  fclose(f);
}

#endif
