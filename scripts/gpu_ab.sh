#!/usr/bin/env bash
# Before and after, in one call on the GPU machine: builds this tree and a base tree (a
# `git archive` of the earlier commit, carried in .base/, git-ignored) with CUDA side by
# side, runs this tree's GPU tests, then each workload on the two builds in turn (after,
# before, after, before) with the PyTorch peer in the same call.
# Usage (on the device): scripts/gpu_ab.sh   Logs in $OUT. Carry .debs .base .data .peer.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
N=build-gpu
BASE=.base
DATA=${KILN_DATA_DIR:-$root/.data}
# both builds at once (16 cores); each writes its own build.log
OUT=$OUT/new scripts/gpu_run.sh build >/dev/null 2>&1 &
(cd $BASE && OUT=$OUT/base scripts/gpu_run.sh build >/dev/null 2>&1) &
wait
tail -3 "$OUT/new/build.log" "$OUT/base/build.log"
OUT=$OUT/new scripts/gpu_run.sh test
# docs/ops.md with the GPU's column run, not read from the kernel tables
scripts/ops_doc.sh $N "$OUT/ops.md" > "$OUT/ops-doc.log" 2>&1 || tail -5 "$OUT/ops-doc.log"
export LD_LIBRARY_PATH=/tmp/kiln-deps/usr/lib/x86_64-linux-gnu/openblas-pthread:/tmp/kiln-deps/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}
# bench-host-op of the base: the same source against the base library
cc -O2 -std=c11 -I$BASE/include bench/bench_host_op.c -L$BASE/$N/lib -lkiln -Wl,-rpath,$root/$BASE/$N/lib \
  -o /tmp/bench-host-op-base 2>&1 | tail -3
peer=.peer/torch_peer.py
{
  for dev in cuda cpu; do
    for r in 1 2; do
      echo "== host-op $dev new"; $N/bin/bench-host-op --device $dev --json
      echo "== host-op $dev base"; /tmp/bench-host-op-base --device $dev --json
    done
  done
  for m in "" "--graph"; do
    for r in 1 2; do
      echo "== seed-mlp cuda $m new"; $N/bin/seed-mlp --device cuda $m --json --quiet
      echo "== seed-mlp cuda $m base"; $BASE/$N/bin/seed-mlp --device cuda $m --json --quiet
    done
  done
  for r in 1 2; do
    echo "== fashion-mnist cuda new"; $N/bin/fashion-mnist --device cuda --data $DATA --epochs 5 --json --quiet
    echo "== fashion-mnist cuda base"; $BASE/$N/bin/fashion-mnist --device cuda --data $DATA --epochs 5 --json --quiet
  done
  echo "== seed-mlp cpu new"; $N/bin/seed-mlp --device cpu --json --quiet
  echo "== seed-mlp cpu base"; $BASE/$N/bin/seed-mlp --device cpu --json --quiet
  echo "== torch seed-mlp"; python3 $peer seed-mlp --device cuda
  echo "== torch fmnist-mlp"; python3 $peer fmnist-mlp --device cuda --data $DATA
  echo "== kiln doctor"; $N/bin/kiln doctor
} > "$OUT/ab.log" 2>&1
grep -E "^==|^\{" "$OUT/ab.log" | head -80
