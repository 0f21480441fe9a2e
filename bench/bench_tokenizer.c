/* Encoding speed of kiln's GPT-2 byte-level BPE on the 1 MB test text
** (tests/fixtures/tokenizer/text.txt.gz). Prints MB/s for a cold cache (the first pass
** of a fresh tokenizer) and a warm one (the best of the next passes), and decode MB/s.
**   bench-tokenizer [FIXTURE_DIR] [PASSES]
** bench/bench_tokenizer.py runs this and Hugging Face `tokenizers` on the same text. */
#include <kiln_text.h>

#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <zlib.h>

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
  const char *dir = argc > 1 ? argv[1] : "tests/fixtures/tokenizer";
  int passes = argc > 2 ? atoi(argv[2]) : 5;
  char path[1024], p2[1024];
  snprintf(path, sizeof path, "%s/text.txt.gz", dir);
  gzFile f = gzopen(path, "rb");
  if (!f) {
    fprintf(stderr, "bench-tokenizer: cannot open %s\n", path);
    return 1;
  }
  size_t cap = 1 << 22, len = 0;
  char *text = malloc(cap);
  int got;
  while ((got = gzread(f, text + len, (unsigned)(cap - len))) > 0) len += (size_t)got;
  gzclose(f);
  snprintf(path, sizeof path, "%s/vocab.json", dir);
  snprintf(p2, sizeof p2, "%s/merges.txt", dir);
  double t0 = now();
  kiln_tokenizer *tok = kiln_tokenizer_load(path, p2);
  double t_load = now() - t0;
  if (!tok) {
    fprintf(stderr, "%s\n", kiln_last_error_message());
    return 1;
  }
  double cold = 0, warm = 1e9, dec = 1e9;
  int64_t n = 0;
  for (int i = 0; i < passes + 1; i++) {
    int32_t *ids;
    t0 = now();
    if (kiln_tokenizer_encode(tok, text, len, &ids, &n) != KILN_OK) return 1;
    double t = now() - t0;
    if (i == 0) cold = t;
    else if (t < warm) warm = t;
    char *back;
    size_t blen;
    t0 = now();
    kiln_tokenizer_decode(tok, ids, n, &back, &blen);
    t = now() - t0;
    if (t < dec) dec = t;
    kiln_tokenizer_buffer_free(back);
    kiln_tokenizer_buffer_free(ids);
  }
  double mb = (double)len / 1e6;
  printf("kiln: %.2f MB, %lld ids, load %.1f ms, encode cold %.1f MB/s, warm %.1f MB/s, decode %.0f MB/s\n", mb,
         (long long)n, 1e3 * t_load, mb / cold, mb / warm, mb / dec);
  kiln_tokenizer_free(tok);
  free(text);
  return 0;
}
