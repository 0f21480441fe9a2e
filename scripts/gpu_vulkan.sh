#!/usr/bin/env bash
# One call on the GPU machine for the Vulkan backend and the CPU before/after: builds this
# tree with CUDA and Vulkan (NVIDIA's Vulkan driver; the loader and the shaders compiled
# here are carried in .gl/, git-ignored: libvulkan1, libvulkan-dev and vk_spirv.c of the
# same commit) and the base tree (.base/) CPU-only, then: kiln doctor, the op harness on
# vulkan:0, seed-mlp and fashion-mnist on Vulkan against PyTorch on CUDA, seed-mlp on the
# CPU before and after in turn, and docs/ops.md with the CUDA and Vulkan columns run.
# Usage (on the device): scripts/gpu_vulkan.sh   Logs in $OUT. Carry .debs .gl .base .data .peer.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
# the loader and the GL dispatch libraries NVIDIA's ICD links against go into /; the
# headers elsewhere (the device tool's notes: other packages can break /)
for f in .gl/*.deb; do case $f in *-dev_*) ;; *) dpkg -x "$f" / ;; esac; done
mkdir -p /tmp/vkdev && dpkg -x .gl/libvulkan-dev_*.deb /tmp/vkdev
ldconfig
ldconfig -p | grep -q libvulkan || echo "NO VULKAN LOADER"
icd=$(find /usr/local/nvidia /usr/share/vulkan /etc/vulkan -name 'nvidia_icd*.json' 2>/dev/null | head -1)
echo "ICD: ${icd:-none found}"
[ -n "$icd" ] && export VK_DRIVER_FILES=$icd
[ -n "$icd" ] && grep library_path "$icd"
N=build-gpu
DATA=$root/.data
KILN_CMAKE_EXTRA="-DKILN_VULKAN=ON -DKILN_VULKAN_HEADER_DIR=/tmp/vkdev/usr/include -DKILN_VULKAN_SPIRV_C=$root/.gl/vk_spirv.c" \
  OUT=$OUT/new scripts/gpu_run.sh build >/dev/null 2>&1 &
AB=${KILN_AB:-1} # 0: no base build and no CPU before/after
[ "$AB" = 1 ] && (cd .base && KILN_BUILD_DIR=build-cpu KILN_CMAKE_EXTRA="-DKILN_CUDA=OFF" OUT=$OUT/base scripts/gpu_run.sh build >/dev/null 2>&1) &
wait
grep -E "error|Error" "$OUT/new/build.log" | head -5
OUT=$OUT/new scripts/gpu_run.sh test
peer=.peer/torch_peer.py
{
  echo "== kiln doctor"; $N/bin/kiln doctor
  for t in elementwise reduce softmax matmul loss index activation compare view scan transformer conv; do
    echo "== harness on vulkan: test_ops_$t"; KILN_TEST_DEVICE=vulkan timeout 120 $N/bin/test_ops_$t 2>&1 | tail -2
  done
  # strict: every kernel native (f64 is expected to fail: no f64 arithmetic on Vulkan)
  for t in scan transformer; do
    echo "== strict harness on vulkan: test_ops_$t (non-f64 failures)"
    KILN_TEST_DEVICE=vulkan KILN_HARNESS_STRICT=1 timeout 120 $N/bin/test_ops_$t 2>&1 | grep FAIL | grep -vc float64
  done
  echo "== test_vulkan_backend"; timeout 120 $N/bin/test_vulkan_backend 2>&1 | tail -3
  for r in 1 2; do
    echo "== seed-mlp vulkan"; timeout 120 $N/bin/seed-mlp --device vulkan --json --quiet
    echo "== seed-mlp cuda"; $N/bin/seed-mlp --device cuda --json --quiet
  done
  echo "== fashion-mnist vulkan"; timeout 120 $N/bin/fashion-mnist --device vulkan --data $DATA --epochs 5 --json --quiet
  echo "== bench-ceilings vulkan"; timeout 60 $N/bin/bench-ceilings --device vulkan 2>&1 | tail -12
  [ "$AB" = 1 ] && for th in 2 16; do
    for r in 1 2 3; do
      echo "== seed-mlp cpu threads=$th new"; KILN_NUM_THREADS=$th $N/bin/seed-mlp --device cpu --json --quiet
      echo "== seed-mlp cpu threads=$th base"; KILN_NUM_THREADS=$th .base/build-cpu/bin/seed-mlp --device cpu --json --quiet
    done
  done
  [ "$AB" = 1 ] && for r in 1 2; do
    echo "== fashion-mnist cpu threads=2 new"; KILN_NUM_THREADS=2 $N/bin/fashion-mnist --device cpu --data $DATA --epochs 1 --json --quiet
    echo "== fashion-mnist cpu threads=2 base"; KILN_NUM_THREADS=2 .base/build-cpu/bin/fashion-mnist --device cpu --data $DATA --epochs 1 --json --quiet
  done
  echo "== torch seed-mlp cuda"; python3 $peer seed-mlp --device cuda
  echo "== torch fmnist-mlp cuda"; python3 $peer fmnist-mlp --device cuda --data $DATA
  echo "== torch seed-mlp cpu (2 threads)"; OMP_NUM_THREADS=1 taskset -c 0,1 python3 $peer seed-mlp --device cpu
} > "$OUT/vk.log" 2>&1
KILN_HARNESS_TESTDEV=0 scripts/ops_doc.sh $N "$OUT/ops.md" > "$OUT/ops-doc.log" 2>&1 || tail -5 "$OUT/ops-doc.log"
grep -E "^==|^\{|passed|failed|FAIL|vulkan:0|GB/s|TFLOP" "$OUT/vk.log" | head -120
