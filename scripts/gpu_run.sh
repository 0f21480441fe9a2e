#!/usr/bin/env bash
# One call on the lent GPU machine: build kiln with CUDA for sm_90, run the GPU-labelled
# tests and the rest of the suite, then the benchmarks next to their PyTorch peers.
# Logs go to $OUT (or ./gpu-out). Usage: scripts/gpu_run.sh [build|test|probe|bench|fmnist|resnet|gpt2|all]...
# The machine has no Debian dev packages: .debs/ (carried, git-ignored) holds OpenBLAS,
# zlib and cJSON, unpacked into a private prefix, never into /.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
steps=${*:-all}
B=${KILN_BUILD_DIR:-build-gpu}   # the build folder; KILN_CMAKE_EXTRA adds configure flags
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
pfx=/tmp/kiln-deps
if [ -d .debs ] && [ ! -d $pfx ]; then
  mkdir -p $pfx
  for f in .debs/*.deb; do dpkg -x "$f" $pfx; done
fi
lib=$pfx/usr/lib/x86_64-linux-gnu
export LD_LIBRARY_PATH=$lib/openblas-pthread:$lib:${LD_LIBRARY_PATH:-}
has() { case " $steps " in *" $1 "*|*" all "*) return 0;; esac; return 1; }

if has build; then
  {
    echo "== machine"; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; gcc --version | head -1; cmake --version | head -1; nvcc --version | tail -2
    zinc=; zlibf=; cj=
    if [ ! -f /usr/include/zlib.h ]; then zinc="-DZLIB_INCLUDE_DIR=$pfx/usr/include"; fi
    # cJSON from the carried debs: the tests that check kiln's JSON output with it run there too
    if [ ! -f /usr/include/cjson/cJSON.h ] && [ -f $pfx/usr/include/cjson/cJSON.h ]; then
      cj="-DKILN_CJSON_LIBRARY=$lib/libcjson.so -DKILN_CJSON_INCLUDE_DIR=$pfx/usr/include"
    fi
    for z in /usr/lib/x86_64-linux-gnu/libz.so /usr/lib/x86_64-linux-gnu/libz.so.1 /lib/x86_64-linux-gnu/libz.so.1; do
      [ -e "$z" ] && { zlibf="-DZLIB_LIBRARY=$z"; break; }
    done
    cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release -DKILN_CUDA=ON -DKILN_CUDA_ARCHS=90 \
      -DKILN_OPENBLAS_LIBRARY=$lib/openblas-pthread/libopenblas.so \
      -DKILN_CBLAS_INCLUDE_DIR=$pfx/usr/include/x86_64-linux-gnu/openblas-pthread \
      $zinc $zlibf $cj -DKILN_WERROR=OFF ${KILN_CMAKE_EXTRA:-} 2>&1
    time cmake --build $B -j16 2>&1 | grep -E "error|warning:|Error" | head -60
    ls $B/bin | head -80
  } > "$OUT/build.log" 2>&1
  tail -25 "$OUT/build.log"
fi

if has test; then
  # The machine has no Debian dataset package: the tests that need Fashion-MNIST
  # (test_examples_fmnist_cuda) skip unless pointed at a carried copy (.data/, git-ignored)
  [ -z "${KILN_DATA_DIR:-}" ] && [ -f .data/train-images-idx3-ubyte.gz ] && export KILN_DATA_DIR=$root/.data
  (cd $B && timeout 400 ctest -L gpu --output-on-failure -j4) > "$OUT/gpu-tests.log" 2>&1
  grep -E "tests passed|Failed|Passed|Skipped|\*\*\*" "$OUT/gpu-tests.log" | tail -30
  (cd $B && timeout 300 ctest -LE gpu -j16) > "$OUT/cpu-tests.log" 2>&1
  grep -E "tests passed|\*\*\*Failed" "$OUT/cpu-tests.log" | tail -10
fi

if has probe; then # the step's timing: phases and step times each way, kernels by ncu, init cost
  {
    for m in "" "--graph"; do
      echo "== seed-mlp phases $m"; KILN_PHASES=1 $B/bin/seed-mlp --device cuda $m --json --quiet
    done
    for ml in LAZY EAGER; do
      echo "== process time, 1 epoch, CUDA_MODULE_LOADING=$ml"
      TIMEFORMAT="%R s wall"
      time CUDA_MODULE_LOADING=$ml $B/bin/seed-mlp --device cuda --epochs 1 --json --quiet
    done
    echo "== first use of each kernel family (lazy module loading)"
    cc -O2 -Iinclude scripts/first_use.c -L$B/lib -lkiln -o /tmp/first_use && LD_LIBRARY_PATH=$B/lib:$LD_LIBRARY_PATH /tmp/first_use
    echo "== ncu: one captured step as a whole (graph profiling)"
    ncu --clock-control none --graph-profiling graph --launch-skip 40 --launch-count 3 --metrics gpu__time_duration.sum \
      $B/bin/seed-mlp --device cuda --epochs 1 --graph --quiet 2>&1 | grep -E "gpu__time_duration" | head -5
    echo "== ncu: one eager step's kernels (after 200 launches)"
    ncu --clock-control none --launch-skip 200 --launch-count 10 --metrics gpu__time_duration.sum \
      $B/bin/seed-mlp --device cuda --epochs 1 --quiet 2>&1 | grep -E "^  [a-z_]|gpu__time_duration|==PROF==" | head -40
  } > "$OUT/probe.log" 2>&1
  cat "$OUT/probe.log" | grep -v "^Epoch" | head -80
fi

if has bench; then
  peer=.peer/torch_peer.py   # a carried copy of ../shared/bench/torch_peer.py
  [ -f $peer ] || peer=../shared/bench/torch_peer.py
  {
    echo "== kiln doctor"; $B/bin/kiln doctor
    echo "== kiln seed-mlp profile (2 epochs)"; KILN_PROFILE=1 $B/bin/seed-mlp --device cuda --epochs 2 --json --quiet
    echo "== kiln seed-mlp (cuda)"; $B/bin/seed-mlp --device cuda --json --quiet
    echo "== kiln seed-mlp (cuda, graph)"; $B/bin/seed-mlp --device cuda --graph --json --quiet
    echo "== kiln seed-mlp (cuda, preload)"; $B/bin/seed-mlp --device cuda --preload --json --quiet
    echo "== kiln seed-mlp (cuda, preload, graph)"; $B/bin/seed-mlp --device cuda --preload --graph --json --quiet
    echo "== kiln seed-mlp graph profile (2 epochs)"; KILN_PROFILE=1 $B/bin/seed-mlp --device cuda --epochs 2 --graph --json --quiet
    echo "== kiln seed-mlp device profile (2 epochs)"; KILN_PROFILE=device $B/bin/seed-mlp --device cuda --epochs 2 --json --quiet
    if [ -n "${KILN_SAMPLE:-}" ]; then
      cc -O2 -shared -fPIC scripts/sampler.c -o /tmp/sampler.so -ldl -lrt
      for mode in "" "--graph"; do
        echo "== host samples: seed-mlp $mode (20 epochs)"
        KILN_SAMPLER_US=250 KILN_SAMPLER_OUT=/tmp/s.out LD_PRELOAD=/tmp/sampler.so $B/bin/seed-mlp --device cuda $mode --json --quiet
        python3 scripts/sampler_report.py /tmp/s.out --top 45
      done
    fi
    echo "== kiln seed-mlp phases (eager, 5 epochs)"; KILN_PHASES=1 $B/bin/seed-mlp --device cuda --epochs 5 --json --quiet
    echo "== kiln seed-mlp phases (graph, 5 epochs)"; KILN_PHASES=1 $B/bin/seed-mlp --device cuda --epochs 5 --graph --json --quiet
    echo "== kiln bench-sweep"; $B/bin/bench-sweep --device cuda
    echo "== kiln bench-ceilings"; $B/bin/bench-ceilings --device cuda
    if [ -f "$peer" ] && [ -z "${KILN_NO_PEER:-}" ]; then
      echo "== torch seed-mlp"; python3 $peer seed-mlp --device cuda
      echo "== torch seed-mlp preload"; python3 $peer seed-mlp --device cuda --preload
      echo "== torch bs-sweep"; python3 $peer bs-sweep --device cuda
      echo "== torch ceilings"; python3 $peer ceilings --device cuda
    else
      echo "torch_peer.py not found"
    fi
  } > "$OUT/bench.log" 2>&1
  grep -E "^\{|TFLOP|GB/s|samples|==" "$OUT/bench.log" | tail -40
fi

if [[ " $steps " == *" resnet "* ]]; then # issue 15's ResNet-50 (not in all): the fused stem's test, the stem's A/Bs, the compiled peer, ncu by kernel
  peer=.peer/torch_peer.py
  [ -f $peer ] || peer=../shared/bench/torch_peer.py
  R="$B/bin/bench-resnet --device cuda --autocast bf16 --channels-last --steps 12 --no-peer"
  {
    echo "== test_cuda_batchnorm (section 8: kiln__batch_norm_relu_max_pool2d), test_cuda_conv (4d: space-to-depth)"
    BC_TIMINGS=none timeout 120 $B/bin/test_cuda_batchnorm 2>&1 | grep -E "FAIL|passed" | head -20
    timeout 120 $B/bin/test_cuda_conv 2>&1 | grep -E "FAIL|passed|space-to" | head -10
    for r in 1 2; do
      echo "== round $r: default (the fused stem); KILN_RESNET_STEM_FUSED=0 (checkpointed); KILN_CONV_S2D=0"
      $R 2>&1 | grep "kiln :"
      KILN_RESNET_STEM_FUSED=0 $R 2>&1 | grep "kiln :"
      KILN_CONV_S2D=0 $R 2>&1 | grep "kiln :"
    done
    [ -f "$peer" ] && { echo "== torch resnet50 --compile"; timeout 300 python3 $peer resnet --arch resnet50 --size 224 --compile | tail -1; }
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    if [ -x "$ncu" ]; then
      echo "== ncu: one step's kernels, default (device time by kernel, top 30)"
      timeout 200 "$ncu" --clock-control none --cache-control none --metrics gpu__time_duration.sum \
        --csv ${R/--steps 12/--steps 4} > "$OUT/ncu_resnet.csv" 2> /dev/null
      python3 - "$OUT/ncu_resnet.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
h = rows[0]; k = h.index('Kernel Name'); v = h.index('Metric Value')
seq = [(r[k], float(r[v].replace(',', ''))) for r in rows[1:] if r[v].replace(',', '').replace('.', '').isdigit()]
ends = [i for i, (n, _) in enumerate(seq) if 'sgd' in n]
groups = [i for j, i in enumerate(ends) if j == 0 or ends[j - 1] != i - 1]
lo = groups[-2] if len(groups) > 1 else 0
step = seq[lo:groups[-1]] if len(groups) > 1 else seq
agg = collections.defaultdict(lambda: [0, 0.0])
for n, t in step: agg[n.split('(')[0][:90]][0] += 1; agg[n.split('(')[0][:90]][1] += t
print(f"{len(step)} kernels, {sum(t for _, t in step) / 1e6:.3f} ms of device time a step")
for n, (c, t) in sorted(agg.items(), key=lambda x: -x[1][1])[:30]: print(f"{t / 1e3:9.1f} us  n={c:3d}  {n}")
PY
    fi
  } > "$OUT/resnet.log" 2>&1
  grep -v "^ *$" "$OUT/resnet.log" | cut -c1-200 | tail -60
fi

if [[ " $steps " == *" gpt2 "* ]]; then # issue 16's GPT-2 figures (not in all): training against compiled PyTorch, checkpointed, generation
  G="$B/bin/bench-gpt2 --device cuda"
  {
    echo "== training, B16 T1024 bf16, 20 steps: kiln and the peer under torch.compile; every block checkpointed"
    echo "   (kiln and the peer's --checkpoint); each block's MLP checkpointed, and every block keeping its products (kiln alone)"
    timeout 400 $G --steps 20 --checkpoint --checkpoint-mlp --checkpoint-products --json
    echo "== kiln again (the peer's compile between: the two kiln figures bracket it)"
    timeout 60 $G --steps 20 --no-peer --json
    echo "== generation, greedy, batch 1 and 16: kiln and the peer's gpt2-generate"
    timeout 300 $G --no-train --generate --json
  } > "$OUT/gpt2.log" 2>&1
  grep -vE "^ *peer:" "$OUT/gpt2.log" | cut -c1-220 | tail -40
fi

if has fmnist; then # issue 15's fmnist-cnn: kiln (direct conv kernels, then cuDNN) and the peer, twice
  peer=.peer/torch_peer.py
  [ -f $peer ] || peer=../shared/bench/torch_peer.py
  data=${KILN_DATA_DIR:-.data}
  FM="$B/bin/fashion-mnist --model cnn --device cuda --data $data --quiet --json --epochs 5"
  {
    for r in 1 2; do
      echo "== round $r: --graph --tf32 (phases), KILN_CONV_DIRECT=1 then 0"
      for d in 1 0; do KILN_PHASES=1 KILN_CONV_DIRECT=$d $FM --graph --tf32 2>&1 | grep -E "^phases: epoch [15]|^\{"; done
      echo "== round $r: eager --tf32"; $FM --tf32
      [ -f "$peer" ] && { echo "== round $r: torch fmnist-cnn"; python3 $peer fmnist-cnn --device cuda --data $data; }
    done
    if command -v ncu > /dev/null; then
      echo "== ncu: the direct conv kernels' device time (one eager step's)"
      ncu --clock-control none -k regex:"conv_fwd|conv_wgrad|conv_prep" --launch-skip 30 --launch-count 7 \
        --metrics gpu__time_duration.sum $B/bin/fashion-mnist --model cnn --device cuda --data $data --quiet --tf32 \
        --epochs 1 --limit 12800 2>&1 | grep -E "^  [^ ]|gpu__time_duration"
    fi
  } > "$OUT/fmnist.log" 2>&1
  grep -E "^\{|phases|==|gpu__time" "$OUT/fmnist.log" | cut -c1-220 | tail -40
fi
