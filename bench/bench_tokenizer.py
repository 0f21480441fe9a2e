#!/usr/bin/env python3
"""kiln's tokenizer, Hugging Face `tokenizers` and (when installed) OpenAI's `tiktoken` on
the same 1 MB text, in one run.
    python3 bench/bench_tokenizer.py [BUILD_DIR]     (needs `pip install tokenizers`;
                                                      `pip install tiktoken` adds its row)
tokenizers: encode() of the whole text as one string (one thread: the work is one
sequence), best of 5 after a first pass, plus encode_batch() of its lines (which
tokenizers spreads over its thread pool). tiktoken: an Encoding made here from the same
vocabulary (its ranks are the ids; GPT-2's split pattern; <|endoftext|> special), encode()
of the whole text on one thread, its ids checked against the fixture's. The id counts are
printed side by side; tests/test_tokenizer.c checks kiln's ids themselves."""
import gzip
import json
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


try:
    import tiktoken
except ImportError:
    tiktoken = None
if tiktoken is None:
    print("tiktoken: not installed (pip install tiktoken)")
else:
    tj = json.load(open(os.path.join(FIX, "tokenizer.json"), encoding="utf-8"))
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    byte_of = {chr(c): b for b, c in zip(bs, cs)}
    special = {t["content"]: t["id"] for t in tj["added_tokens"]}
    ranks = {bytes(byte_of[ch] for ch in tok): i for tok, i in tj["model"]["vocab"].items() if tok not in special}
    pat = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    enc = tiktoken.Encoding("kiln-fixture", pat_str=pat, mergeable_ranks=ranks, special_tokens=special)
    tt = []
    for _ in range(6):
        t0 = time.perf_counter()
        tids = enc.encode(text, allowed_special="all")
        tt.append(time.perf_counter() - t0)
    raw = gzip.open(os.path.join(FIX, "ids.u16.gz"), "rb").read()
    want = [int.from_bytes(raw[i:i + 2], "little") for i in range(0, len(raw), 2)]
    print(f"tiktoken {tiktoken.__version__}: {mb:.2f} MB, {len(tids)} ids "
          f"({'the fixture' + chr(39) + 's ids' if tids == want else 'NOT the fixture' + chr(39) + 's ids'}), "
          f"encode cold {mb/tt[0]:.1f} MB/s, warm {mb/min(tt[1:]):.1f} MB/s")
