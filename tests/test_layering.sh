#!/bin/sh
# The layers of DESIGN.md as a build fact: each layer's sources include only what the
# layer may use, and the core's objects call nothing above the core.
#   usage: test_layering.sh SOURCE_DIR [OBJECT_DIR NM]
# OBJECT_DIR is the library's object tree (build/CMakeFiles/kiln_obj.dir); without it only
# the includes are checked.
#
# Include rules (a quoted #include is resolved as the compiler would: next to the file,
# then include/, src/, src/core/; angle includes of kiln's own headers count too):
#   core      src/core/*, src/backend/backend.h, public headers, the generated config
#   backend   src/backend/**, src/core/*, public headers, the generated config
#   ops       src/core/*, src/backend/backend.h, src/ops/*, public headers
#   autograd  src/core/*, src/ops/op.h, public headers
#   nn optim data io dist text, tools, examples, bench
#             public headers (include/kiln*.h), the extension header src/ext/kiln_ext.h,
#             and the layer's own private headers (its own folder)
#   ext       public headers only
# Exceptions:
#   src/data/copier.c: the loader's staged copies drive the backend vtable's optional async
#     entries (pinned memory, side-stream copies, events) through core/kiln_int.h; a
#     documented async-copy API in the extension header would end this exception
#   src/dist/nccl.c: NCCL works on CUDA streams and device pointers by nature
#     (backend/cuda/cuda_api.h, core/kiln_int.h)
# Symbol rule: an object of src/core/ references no symbol defined in src/ops, src/autograd
# or a layer above, except kiln__node_release (a tensor owns a reference to its grad_fn
# and drops it when freed).
set -u
SRC=$1
OBJ=${2:-}
NM=${3:-nm}
cd "$SRC" || exit 1
fail=0
tmp=${TMPDIR:-/tmp}/kiln_layering.$$
trap 'rm -f "$tmp".*' EXIT

exempt() {
  case $1 in
  src/data/copier.c | src/dist/nccl.c) return 0 ;;
  esac
  return 1
}

# layer of a source path
layer_of() {
  case $1 in
  src/core/*) echo core ;;
  src/backend/*) echo backend ;;
  src/ops/*) echo ops ;;
  src/autograd/*) echo autograd ;;
  src/ext/*) echo ext ;;
  src/nn/* | src/optim/* | src/data/* | src/io/* | src/dist/* | src/text/*) echo upper ;;
  tools/* | examples/* | bench/*) echo upper ;;
  *) echo other ;;
  esac
}

# Resolves an included name to a path relative to SRC ("" when it is no file of kiln's:
# a system header).
resolve() { # file name
  dir=$(dirname "$1")
  for base in "$dir" include src src/core; do
    if [ -f "$base/$2" ]; then
      # normalise a/b/../c
      p=$(cd "$(dirname "$base/$2")" && pwd -P)/$(basename "$2")
      echo "${p#"$(pwd -P)"/}"
      return
    fi
  done
  case $2 in kiln_build_config.h) echo generated/kiln_build_config.h ;; esac
}

allowed() { # layer file target
  case $3 in include/kiln*.h | generated/*) [ "$1" = ext ] && [ "${3#generated/}" != "$3" ] && return 1; return 0 ;; esac
  case $1 in
  core) case $3 in src/core/* | src/backend/backend.h) return 0 ;; esac ;;
  backend) case $3 in src/backend/* | src/core/*) return 0 ;; esac ;;
  ops) case $3 in src/core/* | src/backend/backend.h | src/ops/*) return 0 ;; esac ;;
  autograd) case $3 in src/core/* | src/ops/op.h) return 0 ;; esac ;;
  ext) return 1 ;;
  upper)
    [ "$3" = src/ext/kiln_ext.h ] && return 0
    own=$(echo "$2" | cut -d/ -f1-2)
    [ "${2#src/}" = "$2" ] && own=$(echo "$2" | cut -d/ -f1)
    case $3 in "$own"/*) return 0 ;; esac ;;
  esac
  return 1
}

rule_text() {
  case $1 in
  core) echo "core includes only src/core, src/backend/backend.h and public headers" ;;
  backend) echo "a backend includes only src/backend, src/core and public headers" ;;
  ops) echo "ops include only src/core, src/backend/backend.h, src/ops and public headers" ;;
  autograd) echo "autograd includes only src/core, src/ops/op.h and public headers" ;;
  ext) echo "the extension header is built on public headers only" ;;
  upper) echo "nn/optim/data/io/dist/text/tools/examples include only public headers, src/ext/kiln_ext.h and their own folder's headers" ;;
  esac
}

find src tools examples bench -type f \( -name '*.c' -o -name '*.h' -o -name '*.cu' \) 2>/dev/null | sort >"$tmp.files"
while read -r f; do
  layer=$(layer_of "$f")
  [ "$layer" = other ] && continue
  exempt "$f" && continue
  grep -n '^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]' "$f" >"$tmp.inc" || continue
  while IFS= read -r line; do
    ln=${line%%:*}
    name=$(echo "$line" | sed -E 's/.*#[[:space:]]*include[[:space:]]*["<]([^">]*)[">].*/\1/')
    case $line in
    *'<'*) # angle: only kiln's own headers matter
      case $name in kiln*.h | */*) ;; *) continue ;; esac
      target=$(resolve "$f" "$name") ;;
    *) target=$(resolve "$f" "$name") ;;
    esac
    [ -z "$target" ] && continue
    if ! allowed "$layer" "$f" "$target"; then
      echo "$f:$ln: includes $target: $(rule_text "$layer")"
      fail=1
    fi
  done <"$tmp.inc"
done <"$tmp.files"

# The core calls nothing above it.
if [ -n "$OBJ" ] && [ -d "$OBJ/src/core" ]; then
  : >"$tmp.upper"
  for f in $(ls src/ops/*.c src/autograd/*.c src/nn/*.c src/optim/*.c src/io/*.c src/data/*.c src/dist/*.c src/text/*.c 2>/dev/null); do
    [ -f "$OBJ/$f.o" ] && "$NM" -g --defined-only "$OBJ/$f.o" | awk 'NF==3{print $3}' >>"$tmp.upper"
  done
  sort -u "$tmp.upper" -o "$tmp.upper"
  for f in src/core/*.c; do
    o="$OBJ/$f.o"
    [ -f "$o" ] || { echo "$f: no object $o"; fail=1; continue; }
    "$NM" -u "$o" | awk '{print $NF}' | sort -u | comm -12 - "$tmp.upper" | while read -r sym; do
      [ "$sym" = kiln__node_release ] && continue
      echo "$f: calls $sym, defined above the core: the core calls nothing in ops, autograd or the layers above"
      echo x >>"$tmp.symfail"
    done
  done
  [ -s "$tmp.symfail" ] 2>/dev/null && fail=1
fi

if [ $fail -ne 0 ]; then
  echo "test_layering: FAILED"
  exit 1
fi
echo "test_layering: ok"
