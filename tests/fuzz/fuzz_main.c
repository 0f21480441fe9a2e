/*
** libFuzzer entry point for one kiln fuzz target: built once per target with
** -DKILN_FUZZ_TARGET="\"name\"" (tests/fuzz/CMakeLists.txt; `make fuzz` runs them). A
** broken promise (fuzz_targets.h) aborts, so libFuzzer saves the input as a crash.
*/
#include <stdlib.h>

#include "fuzz_targets.h"

#ifndef KILN_FUZZ_TARGET
#error "define KILN_FUZZ_TARGET as the target's name"
#endif

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (kiln_fuzz_run(KILN_FUZZ_TARGET, data, size) != 0) abort();
  return 0;
}
