#!/usr/bin/env python3
"""kiln's tokenizer and Hugging Face `tokenizers` on the same 1 MB text, in one run.
    python3 bench/bench_tokenizer.py [BUILD_DIR]     (needs `pip install tokenizers`)
tokenizers: encode() of the whole text as one string (one thread: the work is one
sequence), best of 5 after a first pass, plus encode_batch() of its lines (which
tokenizers spreads over its thread pool). The id counts are printed side by side;
tests/test_tokenizer.c checks the ids themselves."""
import gzip
import os
import subprocess
import sys
import time

from tokenizers import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
build = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "build-cpu")
print(subprocess.run([os.path.join(build, "bin", "bench-tokenizer"), FIX, "5"], check=True,
                     capture_output=True, text=True).stdout.strip())
text = gzip.open(os.path.join(FIX, "text.txt.gz"), "rb").read().decode("utf-8")
mb = len(text.encode("utf-8")) / 1e6
t0 = time.perf_counter()
tok = Tokenizer.from_file(os.path.join(FIX, "tokenizer.json"))
load = time.perf_counter() - t0
times = []
for _ in range(6):
    t0 = time.perf_counter()
    ids = tok.encode(text).ids
    times.append(time.perf_counter() - t0)
lines = text.splitlines(keepends=True)
bt = []
for _ in range(3):
    t0 = time.perf_counter()
    tok.encode_batch(lines)
    bt.append(time.perf_counter() - t0)
dt = []
for _ in range(3):
    t0 = time.perf_counter()
    tok.decode(ids, skip_special_tokens=False)
    dt.append(time.perf_counter() - t0)
print(f"tokenizers {__import__('tokenizers').__version__}: {mb:.2f} MB, {len(ids)} ids, load {1e3*load:.1f} ms, "
      f"encode cold {mb/times[0]:.1f} MB/s, warm {mb/min(times[1:]):.1f} MB/s, "
      f"encode_batch(lines) {mb/min(bt):.1f} MB/s (RAYON threads: {os.environ.get('RAYON_NUM_THREADS', 'all')}), "
      f"decode {mb/min(dt):.0f} MB/s")
