#!/bin/sh
# Installs this build into a scratch prefix, then builds tests/consumer against it twice:
# with CMake's find_package(kiln) (shared and static targets) and with
# `pkg-config --cflags --libs kiln`. Each program must run and print a tensor.
# Usage: test_install_consumer.sh BUILD_DIR CONSUMER_SRC CMAKE CC [CONFIG]
set -eu
build=${1:?}; src=${2:?}; cmake=${3:?}; cc=${4:?}; config=${5:-}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kiln-consumer.XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM
prefix="$tmp/prefix"

step() { echo "== $*"; }

step "install $build into $prefix"
if [ -n "$config" ]; then
  "$cmake" --install "$build" --prefix "$prefix" --config "$config" >"$tmp/install.log" 2>&1 ||
    { cat "$tmp/install.log"; exit 1; }
else
  "$cmake" --install "$build" --prefix "$prefix" >"$tmp/install.log" 2>&1 ||
    { cat "$tmp/install.log"; exit 1; }
fi
for f in include/kiln.h; do
  [ -f "$prefix/$f" ] || { echo "missing after install: $f" >&2; exit 1; }
done
libdir=$(dirname "$(find "$prefix" -name 'libkiln.so' -o -name 'libkiln.dylib' | head -n 1)")
[ -d "$libdir" ] && [ "$libdir" != "." ] || { echo "no libkiln.so under $prefix" >&2; exit 1; }
[ -f "$libdir/libkiln.a" ] || { echo "no libkiln.a in $libdir" >&2; exit 1; }
[ -f "$libdir/pkgconfig/kiln.pc" ] || { echo "no kiln.pc in $libdir/pkgconfig" >&2; exit 1; }
[ -f "$libdir/cmake/kiln/kilnConfig.cmake" ] || { echo "no kilnConfig.cmake" >&2; exit 1; }

step "find_package(kiln): configure and build tests/consumer"
"$cmake" -S "$src" -B "$tmp/cbuild" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_BUILD_TYPE=Release >"$tmp/configure.log" 2>&1 || { cat "$tmp/configure.log"; exit 1; }
"$cmake" --build "$tmp/cbuild" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }

check_run() { # name, command...: must exit 0 and print "kiln <version>" and a tensor
  name=$1; shift
  out=$("$@") || { echo "$name failed (exit $?):"; echo "$out"; exit 1; }
  echo "$out"
  echo "$out" | grep -q '^kiln [0-9]' || { echo "$name: no version line" >&2; exit 1; }
  echo "$out" | grep -q 'tensor(' || { echo "$name: no tensor printed" >&2; exit 1; }
}
step "run (kiln::kiln)"
check_run consumer "$tmp/cbuild/consumer"
step "run (kiln::kiln_static)"
check_run consumer_static "$tmp/cbuild/consumer_static"

step "pkg-config --cflags --libs kiln"
if command -v pkg-config >/dev/null 2>&1; then
  PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --exists --print-errors kiln
  flags=$(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --cflags --libs kiln)
  echo "flags: $flags"
  # shellcheck disable=SC2086 # word splitting of the flags is intended
  "$cc" -std=c11 -Wall -Wextra -Werror "$src/main.c" -o "$tmp/consumer_pc" $flags
  LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    DYLD_LIBRARY_PATH="$libdir" check_run consumer_pc "$tmp/consumer_pc"
  step "pkg-config --static --libs kiln"
  # -lkiln would pick libkiln.so; this half links the archive itself.
  sflags=$(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --static --cflags --libs kiln |
           tr ' ' '\n' | grep -v -x -e '-lkiln' | tr '\n' ' ')
  # shellcheck disable=SC2086
  "$cc" -std=c11 "$src/main.c" -o "$tmp/consumer_pc_static" "$libdir/libkiln.a" $sflags
  check_run consumer_pc_static "$tmp/consumer_pc_static"
else
  echo "pkg-config not installed: skipping that half" >&2
fi
echo "test_install_consumer: ok"
