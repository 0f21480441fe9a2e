#!/bin/sh
# Fails if libkiln.so exports a defined dynamic symbol that is not public API: every
# exported name must start with kiln_ (and not kiln__, the internal prefix), as SQLite
# checks for sqlite3_. Usage: test_symbols.sh path/to/libkiln.so [nm]
set -eu
lib=${1:?usage: test_symbols.sh libkiln.so [nm]}
nm=${2:-nm}
[ -f "$lib" ] || { echo "test_symbols: $lib not found" >&2; exit 1; }

# "ADDR TYPE NAME"; --defined-only drops what libkiln imports from libc, cudart, etc.
syms=$("$nm" -D --defined-only "$lib" | awk 'NF >= 3 { print $3 }' | sed 's/@.*//')
[ -n "$syms" ] || { echo "test_symbols: $lib exports no symbols at all" >&2; exit 1; }

bad=$(printf '%s\n' "$syms" | grep -v -E '^(_init|_fini|_edata|_end|__bss_start|_DYNAMIC|_GLOBAL_OFFSET_TABLE_)$' |
      grep -v -E '^kiln_' || true)
internal=$(printf '%s\n' "$syms" | grep -E '^kiln__' || true)

status=0
if [ -n "$bad" ]; then
  echo "test_symbols: $lib exports symbols without the kiln_ prefix (static by mistake?" >&2
  echo "  or a dependency linked in whole):" >&2
  printf '  %s\n' $bad >&2
  status=1
fi
if [ -n "$internal" ]; then
  echo "test_symbols: $lib exports internal kiln__ symbols (KILN_API on an internal name?):" >&2
  printf '  %s\n' $internal >&2
  status=1
fi
n=$(printf '%s\n' "$syms" | grep -c -E '^kiln_' || true)
[ $status -eq 0 ] && echo "test_symbols: ok, $n kiln_ symbols exported from $lib"
exit $status
