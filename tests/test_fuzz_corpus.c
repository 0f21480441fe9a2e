/* Replays every input that ever broke a reader (tests/fuzz/regressions/<target>/) through
** the same fuzz target code libFuzzer runs (tests/fuzz/fuzz_targets.c), so the suite keeps
** them fixed without a fuzzer: each must now be handled (a value or an error), leak no
** tensor, and, for checkpoints, change nothing when refused. Under `make asan` the same
** replay runs with ASan and UBSan. */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz/fuzz_targets.c"

static int replay_dir(const char *root, const char *target, int *count) {
  char dir[1200];
  snprintf(dir, sizeof dir, "%s/%s", root, target);
  DIR *d = opendir(dir);
  if (!d) return 0; /* no findings for this target yet */
  int bad = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char p[1500];
    snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
    FILE *f = fopen(p, "rb");
    if (!f) continue;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc((size_t)(n > 0 ? n : 1));
    size_t got = b ? fread(b, 1, (size_t)n, f) : 0;
    fclose(f);
    int rc = kiln_fuzz_run(target, b, got);
    if (rc != 0) {
      fprintf(stderr, "FAIL %s/%s (rc %d)\n", target, e->d_name, rc);
      bad++;
    }
    (*count)++;
    free(b);
  }
  closedir(d);
  return bad;
}

int main(void) {
  const char *src = getenv("KILN_SOURCE_DIR");
  char root[1024];
  snprintf(root, sizeof root, "%s/tests/fuzz/regressions", src && *src ? src : ".");
  kiln_set_num_threads(1);
  int bad = 0, count = 0;
  for (int i = 0; kiln_fuzz_target_names[i]; i++)
    bad += replay_dir(root, kiln_fuzz_target_names[i], &count);
  ck_teardown();
  remove(scratch_path());
  if (count == 0) {
    fprintf(stderr, "test_fuzz_corpus: no inputs under %s\n", root);
    return 1;
  }
  printf("test_fuzz_corpus: %d inputs replayed, %d failed\n", count, bad);
  return bad ? 1 : 0;
}
