#!/usr/bin/env python3
"""CPU benchmark: kiln's examples against the PyTorch peer, in the same run.

Runs (building nothing):
  build/bin/seed-mlp --device cpu --json --quiet
  python3 ../shared/bench/torch_peer.py seed-mlp --device cpu
  build/bin/fashion-mnist --device cpu --json --quiet --data DIR
  python3 ../shared/bench/torch_peer.py fmnist-mlp --device cpu --data DIR
prints both figures and the ratio, and appends a dated set of rows to bench/RESULTS.md
with the machine (CPU model, cores).

  bench/run_cpu.py [--build DIR] [--data DIR] [--fmnist-epochs N] [--skip-fmnist]
                   [--repeat N] [--seeds N] [--no-append] [--python /usr/bin/python3]

The figure of each side is the best of --repeat runs (default 1); the peer's, the better
of OMP_NUM_THREADS 1 and the CPU count (the peer at its best). The PyTorch side runs
under /usr/bin/python3 (Debian's python3-torch).

--seeds N (default 0: off) also trains fmnist-mlp with seeds 0..N-1 on both sides and adds
a row with the mean and range of the test accuracy: after 5 epochs it moves by a few tenths
of a percent from one seed to the next on either side, more than the two sides differ, so
one seed's accuracy says little. The peer has no --seed flag; its fmnist_train(seed=...)
is called through an import of torch_peer.py.
"""
import argparse, datetime, json, os, platform, subprocess, sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_json(cmd, env=None):
    """Runs cmd; returns the last stdout line that parses as a JSON object."""
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if p.returncode != 0:
        sys.stderr.write(p.stdout + p.stderr)
        raise SystemExit("failed (exit %d): %s" % (p.returncode, " ".join(cmd)))
    if p.stderr.strip():
        sys.stderr.write(p.stderr)
    for line in reversed(p.stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit("no JSON line from: " + " ".join(cmd))


def best(cmd, key, repeat, higher=True, env=None):
    runs = [run_json(cmd, env) for _ in range(repeat)]
    return (max if higher else min)(runs, key=lambda r: r[key])


def best_peer(cmd, key, repeat, higher=True, env=None):
    """The peer at its best thread count: OMP_NUM_THREADS 1 and the CPU count (PyTorch 1.13
    starts one OpenMP thread on this project's 2-core VMs; its MLPs run fastest at 1, its
    GPT at 2), the better run kept, with "omp_threads" added."""
    runs = []
    for n in sorted({1, os.cpu_count() or 1}):
        r = best(cmd, key, repeat, higher, dict(env or os.environ, OMP_NUM_THREADS=str(n)))
        r["omp_threads"] = n
        print("peer at OMP_NUM_THREADS=%d: %s %s" % (n, key, r[key]), file=sys.stderr)
        runs.append(r)
    return (max if higher else min)(runs, key=lambda r: r[key])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.environ.get("KILN_BUILD_DIR", os.path.join(ROOT, "build")))
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--fmnist-epochs", type=int, default=5)
    ap.add_argument("--skip-fmnist", action="store_true")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seeds", type=int, default=0)
    ap.add_argument("--no-append", action="store_true")
    ap.add_argument("--python", default="/usr/bin/python3")
    ap.add_argument("--peer", default=os.path.join(ROOT, "..", "shared", "bench", "torch_peer.py"))
    a = ap.parse_args()

    bindir = os.path.join(a.build, "bin")
    peer = os.path.normpath(a.peer)
    for p in (os.path.join(bindir, "seed-mlp"), peer):
        if not os.path.exists(p):
            raise SystemExit("missing %s (build kiln first, e.g. make; or pass --build DIR)" % p)
    info = run_json([os.path.join(bindir, "kiln"), "doctor", "--json"]) if os.path.exists(
        os.path.join(bindir, "kiln")) else {}

    # The peer at its best BLAS: where OpenBLAS picked generic kernels for this CPU (kiln
    # doctor's blas_kernels names the fix), PyTorch loads the same OpenBLAS: give it the fix.
    peer_env = None
    fix = (info.get("cpu") or {}).get("blas_coretype_fix")
    if fix and not os.environ.get("OPENBLAS_CORETYPE"):
        peer_env = dict(os.environ, OPENBLAS_CORETYPE=fix)
        print("peer: OPENBLAS_CORETYPE=%s (OpenBLAS's own pick is generic on this CPU)" % fix, file=sys.stderr)

    load0 = os.getloadavg()[0]
    rows = []
    k = best([os.path.join(bindir, "seed-mlp"), "--device", "cpu", "--json", "--quiet"], "us_per_step", a.repeat, higher=False)
    t = best_peer([a.python, peer, "seed-mlp", "--device", "cpu"], "us_per_step", a.repeat, higher=False, env=peer_env)
    ratio = t["us_per_step"] / k["us_per_step"]
    print("seed-mlp   kiln %8.1f us/step  PyTorch %8.1f us/step  kiln faster by %.2fx  "
          "(loss %.4f vs %.4f, train acc %.4f vs %.4f)" % (
              k["us_per_step"], t["us_per_step"], ratio, k["final_loss"], t["final_loss"],
              k["train_acc"], t["train_acc"]))
    rows.append("| seed-mlp (20 epochs, batch 128) | %.1f us/step (%.0f samples/s) | %.1f us/step (OMP %d) | **%.2fx** | loss %.4f, acc %.4f | loss %.4f, acc %.4f |" % (
        k["us_per_step"], k["samples_per_s"], t["us_per_step"], t["omp_threads"], ratio, k["final_loss"], k["train_acc"],
        t["final_loss"], t["train_acc"]))
    torch_ver = t.get("torch", "?")

    if not a.skip_fmnist:
        if not os.path.isdir(a.data):
            print("fmnist: no data at %s, skipped" % a.data)
        else:
            n = str(a.fmnist_epochs)
            ck = os.path.join("/tmp", "kiln-bench-fmnist-%d.ckpt.safetensors" % os.getpid())
            k = best([os.path.join(bindir, "fashion-mnist"), "--device", "cpu", "--json", "--quiet",
                      "--data", a.data, "--epochs", n, "--checkpoint", ck], "images_per_s", a.repeat)
            try:
                os.remove(ck)
            except OSError:
                pass
            t = best_peer([a.python, peer, "fmnist-mlp", "--device", "cpu", "--data", a.data, "--epochs", n],
                     "images_per_s", a.repeat, env=peer_env)
            ratio = k["images_per_s"] / t["images_per_s"]
            print("fmnist-mlp kiln %8.0f images/s PyTorch %8.0f images/s kiln faster by %.2fx  "
                  "(test acc %.4f vs %.4f)" % (k["images_per_s"], t["images_per_s"], ratio,
                                                k["test_acc"], t["test_acc"]))
            rows.append("| fmnist-mlp (%s epochs, batch 128) | %.0f images/s | %.0f images/s (OMP %d) | **%.2fx** | test acc %.4f | test acc %.4f |" % (
                n, k["images_per_s"], t["images_per_s"], t["omp_threads"], ratio, k["test_acc"], t["test_acc"]))

    if a.seeds > 0 and not a.skip_fmnist and os.path.isdir(a.data):
        n = str(a.fmnist_epochs)
        ck = os.path.join("/tmp", "kiln-bench-fmnist-%d.ckpt.safetensors" % os.getpid())
        peer_call = ("import sys; sys.path.insert(0, %r); import torch, torch_peer; "
                     "torch_peer.fmnist_train(torch.device('cpu'), %r, 'mlp', %d, 128, seed=%%d)" % (
                         os.path.dirname(peer), a.data, a.fmnist_epochs))
        ka, ta = [], []
        for s in range(a.seeds):
            ka.append(run_json([os.path.join(bindir, "fashion-mnist"), "--device", "cpu", "--json", "--quiet",
                                "--data", a.data, "--epochs", n, "--seed", str(s), "--checkpoint", ck])["test_acc"])
            ta.append(run_json([a.python, "-c", peer_call % s], peer_env)["test_acc"])
        try:
            os.remove(ck)
        except OSError:
            pass
        mean = lambda v: sum(v) / len(v)
        print("fmnist-mlp test acc over seeds 0..%d: kiln %.4f (%.4f-%.4f), PyTorch %.4f (%.4f-%.4f)" % (
            a.seeds - 1, mean(ka), min(ka), max(ka), mean(ta), min(ta), max(ta)))
        rows.append("| fmnist-mlp test acc, seeds 0-%d (%s epochs) | | | | mean %.4f (%.4f-%.4f) | mean %.4f (%.4f-%.4f) |" % (
            a.seeds - 1, n, mean(ka), min(ka), max(ka), mean(ta), min(ta), max(ta)))

    if a.no_append:
        return
    env = " ".join("%s=%s" % (v, os.environ[v]) for v in
                   ("KILN_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY",
                    "GOMP_SPINCOUNT", "OPENBLAS_CORETYPE") if v in os.environ)
    if peer_env:
        env = (env + "; " if env else "") + "peer OPENBLAS_CORETYPE=" + peer_env["OPENBLAS_CORETYPE"]
    load = "; load average %.1f at start, %.1f at end (other processes share the cores)" % (
        load0, os.getloadavg()[0])
    head = "## %s — %s, %d cores; kiln %s (%s); torch %s%s%s" % (
        datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), cpu_model(), os.cpu_count() or 0,
        info.get("version", "?"), info.get("build", "?"), torch_ver, ("; env " + env) if env else "", load)
    text = "\n".join([head, "", "| workload (cpu) | kiln | PyTorch | ratio | kiln result | PyTorch result |",
                      "|---|---|---|---|---|---|"] + rows) + "\n\n"
    path = os.path.join(HERE, "RESULTS.md")
    new = not os.path.exists(path)
    with open(path, "a") as f:
        if new:
            f.write("# kiln CPU benchmark results\n\nAppended by `bench/run_cpu.py` (one set of rows per run). "
                    "The ratio is PyTorch time / kiln time (above 1: kiln is faster).\n\n")
        f.write(text)
    print("appended to " + path)


if __name__ == "__main__":
    main()
