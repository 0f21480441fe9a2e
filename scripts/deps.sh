#!/usr/bin/env bash
# Checks that the system packages kiln builds and tests with are installed, and installs
# the missing ones (Debian/Ubuntu). Run by `make` before every configure, so it must be a
# fast no-op when everything is there: it asks dpkg-query (local, milliseconds), never apt.
#   root, something missing:     apt-get update + apt-get install (noninteractive)
#   not root, something missing: prints the exact sudo command and exits 1
#   not Debian-like:             prints what is needed and exits 0 (the build may still
#                                work; CMake says what it did not find)
# KILN_SKIP_DEPS=1 skips the check.
set -euo pipefail

if [[ "${KILN_SKIP_DEPS:-0}" == 1 ]]; then
  exit 0
fi

# build: compiler, cmake, pkg-config, BLAS, zlib, cJSON, MPI; protobuf-c (TensorBoard
# events through the library; optional), cairo (`kiln plot`; optional) and oneDNN (the
# CPU's f32 convolutions; optional: im2col + BLAS without it).
# tests: the Fashion-MNIST package, python3 + numpy (fixtures), valgrind.
# Vulkan: the headers and glslc to build the backend; the loader and Mesa's drivers
# (lavapipe, a Vulkan device on the CPU) so its tests run on any machine; vulkan-tools
# for vulkaninfo.
packages=(
  build-essential cmake pkg-config
  libopenblas-dev libopenblas0-pthread libopenblas-openmp-dev
  zlib1g-dev libcjson-dev
  openmpi-bin libopenmpi-dev
  libprotobuf-c-dev protobuf-c-compiler libcairo2-dev libdnnl-dev
  dataset-fashion-mnist python3 python3-numpy valgrind
  libvulkan-dev libvulkan1 glslc mesa-vulkan-drivers vulkan-tools
)
# `scripts/deps.sh clang`: also clang, its sanitizer/libFuzzer runtimes and OpenMP, for
# `make fuzz` and `make asan ASAN_CC=clang` (not needed by the normal build).
if [[ "${1:-}" == clang ]]; then
  packages+=(clang libclang-rt-dev libomp-dev)
fi
# `scripts/deps.sh peer`: Debian's PyTorch 1.13 and torchvision, the CPU benchmarks' peer
# (bench/run_cpu.py, bench-resnet, bench-gpt2 run ../shared/bench/torch_peer.py under
# /usr/bin/python3; not needed by the build or the tests).
if [[ "${1:-}" == peer ]]; then
  packages+=(python3-torch python3-torchvision)
fi

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "deps.sh: not a Debian-like system; make sure these (or your system's equivalents)" >&2
  echo "  are installed: a C11 compiler, cmake >= 3.25, pkg-config, OpenBLAS, zlib, cJSON," >&2
  echo "  OpenMP, Open MPI (optional), python3 with numpy, valgrind (optional), the Vulkan" >&2
  echo "  headers, loader and glslc (optional: the Vulkan backend)." >&2
  exit 0
fi

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  if [[ "$status" != "installed" ]]; then
    missing+=("$p")
  fi
done

if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

cmd="apt-get install -y --no-install-recommends ${missing[*]}"
if [[ $(id -u) -ne 0 ]]; then
  echo "deps.sh: missing packages: ${missing[*]}" >&2
  echo "deps.sh: install them with:" >&2
  echo "  sudo apt-get update && sudo DEBIAN_FRONTEND=noninteractive $cmd" >&2
  echo "deps.sh: (or run with KILN_SKIP_DEPS=1 to build without the check)" >&2
  exit 1
fi

echo "deps.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# shellcheck disable=SC2086 # word splitting of the package list is intended
apt-get install -y -q --no-install-recommends "${missing[@]}"
