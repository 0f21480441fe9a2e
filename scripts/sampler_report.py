#!/usr/bin/env python3
"""Self and inclusive host time per function from scripts/sampler.c's output.

  python3 scripts/sampler_report.py sampler.out [--top N]

Frames are symbolized with addr2line (binutils), one call per module.
"""
import argparse, collections, subprocess


def symbolize(module, offsets):
    if module == "?":
        return {o: o for o in offsets}
    try:
        p = subprocess.run(["addr2line", "-f", "-C", "-e", module], input="\n".join(offsets),
                           capture_output=True, text=True, timeout=300)
        lines = p.stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired):
        lines = []
    names = {}
    base = module.rsplit("/", 1)[-1]
    for i, o in enumerate(offsets):
        fn = lines[2 * i] if 2 * i < len(lines) else "??"
        names[o] = (fn if fn != "??" else o) + " [" + base + "]"
    return names


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=35)
    a = ap.parse_args()
    frames = collections.defaultdict(list)  # sample -> [(depth, module, offset)]
    want = collections.defaultdict(set)
    with open(a.path) as f:
        for line in f:
            parts = line.split()
            if len(parts) != 4:
                continue
            k, d, mod, off = int(parts[0]), int(parts[1]), parts[2], parts[3]
            frames[k].append((d, mod, off))
            want[mod].add(off)
    names = {}
    for mod, offs in want.items():
        offs = sorted(offs)
        for o, n in symbolize(mod, offs).items():
            names[(mod, o)] = n
    n = len(frames)
    self_c, incl_c = collections.Counter(), collections.Counter()
    for k, fr in frames.items():
        fr.sort()
        if fr:
            self_c[names[(fr[0][1], fr[0][2])]] += 1
        for fn in {names[(m, o)] for _, m, o in fr}:
            incl_c[fn] += 1
    print("samples: %d" % n)
    for title, c in (("self", self_c), ("inclusive", incl_c)):
        print("\n%-9s   %%  function" % title)
        for fn, v in c.most_common(a.top):
            print("%9d %5.1f  %s" % (v, 100.0 * v / max(n, 1), fn[:150]))


if __name__ == "__main__":
    main()
