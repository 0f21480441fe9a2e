# The commands a newcomer needs (README.md). CMake does the real work; this file runs
# the dependency check, configures build/ and drives cmake, ctest and valgrind.
#   make            deps + configure + build (Release, -j2)
#   make run        build, then `kiln doctor` and the seed-mlp example
#   make test       build, then the whole ctest suite
#   make install    PREFIX=/usr/local
#   make asan       build-asan/ with ASan+UBSan, and its tests (ASAN_CC=clang: with clang)
#   make valgrind   the tests labelled `valgrind` under memcheck
#   make ops-doc    regenerate docs/ops.md (the op x backend x dtype table) from this build
#   make fuzz       the libFuzzer targets, FUZZ_TIME seconds each (clang)
#   make clean
# Variables: BUILD_TYPE, KILN_CUDA (AUTO|ON|OFF), KILN_CUDA_ARCHS, JOBS, PREFIX, CMAKE_ARGS.

CMAKE      ?= cmake
CTEST      ?= ctest
BUILD_DIR  ?= build
ASAN_CC    ?=
ASAN_DIR   ?= build-asan$(if $(ASAN_CC),-$(notdir $(ASAN_CC)))
BUILD_TYPE ?= Release
KILN_CUDA  ?= AUTO
JOBS       ?= 2
PREFIX     ?= /usr/local
CMAKE_ARGS ?=
VALGRIND   ?= valgrind

# Only passed when given, so a value chosen at configure time is kept otherwise.
ifneq ($(strip $(KILN_CUDA_ARCHS)),)
CUDA_ARCH_ARG := "-DKILN_CUDA_ARCHS=$(KILN_CUDA_ARCHS)"
endif

MAKEFLAGS += --no-print-directory

FUZZ_DIR   ?= build-fuzz
FUZZ_TIME  ?= 60
FUZZ_JOBS  ?= $(JOBS)
FUZZ_TARGETS ?= safetensors npy idx idx_gz csv checkpoint tokenizer tokenizer_json gpt_config tfevents hf_index
FUZZ_CC    ?= clang

.PHONY: all deps configure build run test install asan valgrind clean ops-doc fuzz fuzz-build

all: build

deps:
	@./scripts/deps.sh

# Re-running cmake on an existing tree is cheap (cached checks) and picks up changed
# variables (make KILN_CUDA=OFF after a CUDA build reconfigures it).
# Its full output is in $(BUILD_DIR)/configure.log; the kiln lines and warnings show here.
configure: deps
	@mkdir -p $(BUILD_DIR)
	@$(CMAKE) -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) -DKILN_CUDA=$(KILN_CUDA) \
	  $(CUDA_ARCH_ARG) -DKILN_SANITIZE= $(CMAKE_ARGS) >$(BUILD_DIR)/configure.log 2>&1 || \
	  { cat $(BUILD_DIR)/configure.log; exit 1; }
	@grep -E '^-- kiln' $(BUILD_DIR)/configure.log || true
	@grep -E -A6 '^CMake (Warning|Deprecation)' $(BUILD_DIR)/configure.log || true

build: configure
	$(CMAKE) --build $(BUILD_DIR) -j$(JOBS)

run: build
	$(BUILD_DIR)/bin/kiln doctor
	$(BUILD_DIR)/bin/seed-mlp

test: build
	$(CTEST) --test-dir $(BUILD_DIR) --output-on-failure -j$(JOBS)

# The harness's support mode over every test_ops_* program (tests/harness.h says how).
ops-doc: build
	./scripts/ops_doc.sh $(BUILD_DIR) docs/ops.md

install: build
	$(CMAKE) --install $(BUILD_DIR) --prefix $(PREFIX)

# ASAN_CC=clang builds with clang instead (in build-asan-clang unless ASAN_DIR is given).
# A sanitized Debug build runs the example trainings several times slower (clang's
# test_examples_fmnist: 297-300+ s against the suite's 300 on 2 cores): its tests get 1800 s each.
asan: deps
	$(CMAKE) -S . -B $(ASAN_DIR) -DCMAKE_BUILD_TYPE=Debug -DKILN_CUDA=OFF \
	  $(if $(ASAN_CC),-DCMAKE_C_COMPILER=$(ASAN_CC)) -DKILN_SANITIZE=address,undefined \
	  -DKILN_TEST_TIMEOUT=1800 $(CMAKE_ARGS)
	$(CMAKE) --build $(ASAN_DIR) -j$(JOBS)
	LSAN_OPTIONS=suppressions=$(CURDIR)/tests/lsan.supp:print_suppressions=0 \
	ASAN_OPTIONS=detect_leaks=1:abort_on_error=0:strict_string_checks=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  $(CTEST) --test-dir $(ASAN_DIR) --output-on-failure -j$(JOBS)

# libFuzzer: one target per reader (tests/fuzz). Each runs FUZZ_TIME seconds (FUZZ_JOBS at
# once, niced) from a seed corpus written by fuzz-seeds plus what earlier runs found
# ($(FUZZ_DIR)/corpus/<target>), with its dictionary (tests/fuzz/dict). A crash, leak or
# broken promise lands in $(FUZZ_DIR)/crashes/<target>/: copy it into
# tests/fuzz/regressions/<target>/ with the fix, and `make test` replays it for good.
# Needs clang with libFuzzer (Debian: clang libclang-rt-dev libomp-dev; scripts/deps.sh clang).
fuzz-build:
	@./scripts/fuzz.sh check "$(FUZZ_CC)"
	@mkdir -p $(FUZZ_DIR)
	@$(CMAKE) -S . -B $(FUZZ_DIR) -DCMAKE_C_COMPILER=$(FUZZ_CC) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DKILN_CUDA=OFF -DKILN_MPI=OFF -DKILN_SANITIZE=address,undefined,fuzzer-no-link \
	  -DKILN_BUILD_FUZZERS=ON -DKILN_BUILD_TESTS=OFF -DKILN_BUILD_EXAMPLES=OFF -DKILN_BUILD_BENCH=OFF \
	  $(CMAKE_ARGS) >$(FUZZ_DIR)/configure.log 2>&1 || { cat $(FUZZ_DIR)/configure.log; exit 1; }
	$(CMAKE) --build $(FUZZ_DIR) -j$(JOBS) --target fuzz-seeds $(addprefix fuzz-,$(subst _,-,$(FUZZ_TARGETS)))

fuzz: fuzz-build
	@./scripts/fuzz.sh run "$(FUZZ_DIR)" "$(FUZZ_TIME)" "$(FUZZ_JOBS)" $(FUZZ_TARGETS)

# The list of tests is tests/CMakeLists.txt's KILN_VALGRIND_TESTS (ctest label
# `valgrind`). One thread each: thread pools only add noise to memcheck's report.
# Exit 77 is a skip, as in ctest.
valgrind: build
	@command -v $(VALGRIND) >/dev/null || { echo "valgrind is not installed (scripts/deps.sh)"; exit 1; }
	@tests=$$($(CTEST) --test-dir $(BUILD_DIR) -N -L valgrind | sed -n 's/^ *Test *#[0-9]*: *//p'); \
	if [ -z "$$tests" ]; then echo "valgrind: no tests labelled valgrind exist yet"; exit 0; fi; \
	fail=0; \
	for t in $$tests; do \
	  echo "== valgrind $$t"; \
	  KILN_SOURCE_DIR=$(CURDIR) KILN_TEST_DATA=$(CURDIR)/tests/data KILN_BUILD_DIR=$(CURDIR)/$(BUILD_DIR) \
	  KILN_NUM_THREADS=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
	  $(VALGRIND) --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite \
	    --suppressions=$(CURDIR)/tests/valgrind.supp --quiet $(BUILD_DIR)/bin/$$t; \
	  rc=$$?; \
	  if [ $$rc -eq 77 ]; then echo "   skipped"; \
	  elif [ $$rc -ne 0 ]; then echo "   FAILED (exit $$rc)"; fail=1; \
	  else echo "   ok"; fi; \
	done; \
	exit $$fail

clean:
	rm -rf $(BUILD_DIR) $(ASAN_DIR) build-asan-clang $(FUZZ_DIR)
