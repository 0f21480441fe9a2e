/*
** libFuzzer target for kiln's file readers: safetensors, .npy, IDX (raw and gzip) and CSV.
** The first input byte picks the reader; the rest is the file. Not part of the normal
** build (tests/CMakeLists.txt globs only tests/test_*.c); the unit tests replay the same
** kinds of damage (every truncation and bit flip of the fixtures) on every run.
**
** Build and run (clang, from the repository root, against an instrumented static library):
**   cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DKILN_SANITIZE=address,undefined \
**         -DKILN_CUDA=OFF && cmake --build build-fuzz --target kiln_static -j2
**   clang -g -O1 -fsanitize=fuzzer,address,undefined -Iinclude tests/fuzz/fuzz_io.c \
**         build-fuzz/lib/libkiln.a -lcjson -lz -lm -lpthread $(pkg-config --libs openblas) \
**         -fopenmp -o build-fuzz/fuzz_io
**   mkdir -p /tmp/corpus && for f in tests/fixtures/[a-z]*; do
**     case $f in *.safetensors) p=0;; *.npy) p=1;; esac
**     { printf "\\$(printf %o $p)"; cat "$f"; } > /tmp/corpus/$(basename "$f"); done
**   build-fuzz/fuzz_io /tmp/corpus -max_len=4096 -max_total_time=600
** Every reader must return an error value (never crash, never leak) on any input.
*/
#define _POSIX_C_SOURCE 200809L
#include <kiln.h>
#include <kiln_data.h>
#include <kiln_io.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  static char path[128];
  if (!path[0])
    snprintf(path, sizeof path, "%s/kiln_fuzz_%ld", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp",
             (long)getpid());
  FILE *f = fopen(path, "wb");
  if (!f) return 0;
  if (size > 1) fwrite(data + 1, 1, size - 1, f);
  fclose(f);
  int64_t live0 = kiln_live_tensors();
  switch (data[0] % 4) {
  case 0: kiln_dict_free(kiln_safetensors_load(path, kiln_device_cpu())); break;
  case 1: kiln_tensor_free(kiln_npy_load(path, kiln_device_cpu())); break;
  case 2: kiln_tensor_free(kiln_idx_load(path)); break;
  default: {
    kiln_tensor *x = NULL, *y = NULL;
    if (kiln_csv_load(path, NULL, &x, &y) == KILN_OK) {
      kiln_tensor_free(x);
      kiln_tensor_free(y);
    }
  }
  }
  if (kiln_live_tensors() != live0) abort(); /* a leaked tensor is a bug */
  return 0;
}
