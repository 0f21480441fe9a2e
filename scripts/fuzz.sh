#!/usr/bin/env bash
# Helper of `make fuzz` (see the Makefile).
#   fuzz.sh check CC                 says what is missing for a libFuzzer build, exit 1
#   fuzz.sh run DIR SECONDS JOBS T... runs each target for SECONDS, JOBS at a time
set -uo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)

case "${1:-}" in
check)
  cc=${2:-clang}
  if ! command -v "$cc" >/dev/null 2>&1; then
    echo "make fuzz: '$cc' is not installed. libFuzzer comes with clang:" >&2
    echo "  Debian/Ubuntu: sudo apt-get install clang libclang-rt-dev libomp-dev  (or: scripts/deps.sh clang)" >&2
    echo "  or name another clang: make fuzz FUZZ_CC=clang-15" >&2
    exit 1
  fi
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  printf '#include <stddef.h>\n#include <stdint.h>\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n);\nint LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n' >"$tmp/t.c"
  if ! "$cc" -fsanitize=fuzzer,address,undefined "$tmp/t.c" -o "$tmp/t" >"$tmp/log" 2>&1; then
    echo "make fuzz: '$cc' cannot link a libFuzzer program (-fsanitize=fuzzer,address,undefined):" >&2
    sed 's/^/  /' "$tmp/log" | head -5 >&2
    echo "  Debian/Ubuntu: sudo apt-get install libclang-rt-dev  (the sanitizer and libFuzzer runtimes)" >&2
    exit 1
  fi
  printf '#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n' >"$tmp/o.c"
  if ! "$cc" -fopenmp "$tmp/o.c" -o "$tmp/o" >"$tmp/log" 2>&1; then
    echo "make fuzz: note: '$cc' has no OpenMP (libomp-dev); kiln builds without it" >&2
  fi
  ;;
run)
  dir=$2 secs=$3 jobs=$4
  shift 4
  "$dir/bin/fuzz-seeds" "$dir/seeds" || { echo "make fuzz: writing the seed corpus failed" >&2; exit 1; }
  status=0
  pids=() names=()
  run_one() {
    local t=$1 exe="$dir/bin/fuzz-${1//_/-}"
    mkdir -p "$dir/corpus/$t" "$dir/crashes/$t" "$dir/logs"
    local dict=()
    [[ -f "$src/tests/fuzz/dict/$t.dict" ]] && dict=(-dict="$src/tests/fuzz/dict/$t.dict")
    local reg=()
    [[ -d "$src/tests/fuzz/regressions/$t" ]] && reg=("$src/tests/fuzz/regressions/$t")
    # detect_leaks: libFuzzer's own leak check; the target also counts kiln's tensors.
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    KILN_NUM_THREADS=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \
      nice -n 19 "$exe" "$dir/corpus/$t" "$dir/seeds/$t" "${reg[@]}" "${dict[@]}" \
        -max_total_time="$secs" -max_len=8192 -timeout=20 -rss_limit_mb=2048 \
        -artifact_prefix="$dir/crashes/$t/" -print_final_stats=1 >"$dir/logs/$t.log" 2>&1
  }
  for t in "$@"; do
    run_one "$t" &
    pids+=($!) names+=("$t")
    while (( $(jobs -rp | wc -l) >= jobs )); do sleep 1; done
  done
  for i in "${!pids[@]}"; do
    t=${names[$i]}
    if wait "${pids[$i]}"; then r=ok; else r=FOUND; status=1; fi
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$dir/logs/$t.log" | grep -o '[0-9]*$' | tail -1)
    cov=$(grep -o 'cov: [0-9]*' "$dir/logs/$t.log" | tail -1)
    printf 'fuzz-%-12s %-5s %10s execs in %ss  %s  (log %s)\n' "$t" "$r" "${execs:-?}" "$secs" "$cov" "$dir/logs/$t.log"
  done
  if (( status )); then
    echo "make fuzz: findings are in $dir/crashes/<target>/; fix them and add each input to tests/fuzz/regressions/<target>/" >&2
  fi
  exit $status
  ;;
*)
  echo "usage: fuzz.sh check CC | fuzz.sh run DIR SECONDS JOBS TARGET..." >&2
  exit 2
  ;;
esac
