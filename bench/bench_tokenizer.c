/* Encoding speed of kiln's GPT-2 byte-level BPE on the 1 MB test text
** (tests/fixtures/tokenizer/text.txt.gz). Prints MB/s for a cold cache (the first pass
** of a fresh tokenizer) and a warm one (the best of the next passes), and decode MB/s.
**   bench-tokenizer [FIXTURE_DIR] [PASSES]
** bench/bench_tokenizer.py runs this and Hugging Face `tokenizers` on the same text. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime: clang does not get it by default */
#include <kiln_text.h>

#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <zlib.h>

#include "bench_args.h"

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int main(int argc, char **argv) {
  const char *dir = "tests/fixtures/tokenizer";
  int passes = 5;
  bench_args cli = bench_args_begin("bench-tokenizer", "[FIXTURE_DIR [PASSES]]", argc, argv);
  for (const char *a; (a = bench_args_next(&cli));) {
    if (bench_args_positional(&cli, 2) == 0) dir = a;
    else passes = (int)bench_args_parse_int(&cli, "PASSES", a, 1, 1000000);
  }
  char path[1024], p2[1024];
  snprintf(path, sizeof path, "%s/text.txt.gz", dir);
  gzFile f = gzopen(path, "rb");
  if (!f) {
    fprintf(stderr, "bench-tokenizer: cannot open %s\n", path);
    return 1;
  }
  size_t cap = 1 << 22, len = 0;
  char *text = malloc(cap);
  int got = -1;
  if (text)
    while (len < cap && (got = gzread(f, text + len, (unsigned)(cap - len))) > 0) len += (size_t)got;
  gzclose(f);
  if (got < 0 || len == 0 || len == cap) { /* a read error, nothing to time, or a text cut short */
    fprintf(stderr, "bench-tokenizer: %s: %s\n", path,
            !text     ? "out of memory"
            : got < 0 ? "not a readable gzip file"
            : len     ? "4 MiB or more of text (the buffer's size)"
                      : "no text");
    free(text);
    return 1;
  }
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
