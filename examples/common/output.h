/* Shared by the examples: the checkpoint path checked before training. Header-only. */
#ifndef KILN_EXAMPLES_OUTPUT_H
#define KILN_EXAMPLES_OUTPUT_H

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The checkpoint is written during training: its directory must exist and be writable,
** and the path must not be a directory, before the training starts. Prints why and
** returns 1, else 0. */
static inline int ex_check_output(const char *prog, const char *path) {
  struct stat st;
  if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
    fprintf(stderr, "%s: --checkpoint '%s' is a directory; give a file name\n", prog, path);
    return 1;
  }
  char dir[1024];
  snprintf(dir, sizeof dir, "%s", path);
  char *slash = strrchr(dir, '/');
  if (!slash) snprintf(dir, sizeof dir, ".");
  else if (slash == dir) dir[1] = 0;
  else *slash = 0;
  if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) {
    fprintf(stderr, "%s: --checkpoint '%s': the directory '%s' does not exist\n", prog, path, dir);
    return 1;
  }
  if (access(dir, W_OK | X_OK) != 0) {
    fprintf(stderr, "%s: --checkpoint '%s': the directory '%s' is not writable\n", prog, path, dir);
    return 1;
  }
  return 0;
}

#endif
