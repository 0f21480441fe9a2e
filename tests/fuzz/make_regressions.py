#!/usr/bin/env python3
"""Writes tests/fuzz/regressions/<target>/issue17-*: the bad inputs of issue 17 as fuzz
inputs, replayed by test_fuzz_corpus (and by make asan under ASan/UBSan). Later findings
are added as libFuzzer wrote them (crash-<sha1>), with a line in README.md.
Usage: make_regressions.py SEED_DIR  (build-fuzz/seeds, written by fuzz-seeds)."""
import json, os, struct, sys

here = os.path.dirname(os.path.abspath(__file__))
out = os.path.join(here, "regressions")
seeds = sys.argv[1]

def put(target, name, data):
    os.makedirs(os.path.join(out, target), exist_ok=True)
    with open(os.path.join(out, target, name), "wb") as f:
        f.write(data)

def st_file(header_bytes, data=b""):
    return struct.pack("<Q", len(header_bytes)) + header_bytes + data

# 17.1: a zero dim beside dims whose product passes 2^63
put("safetensors", "issue17-1-zero-dim-overflow",
    st_file(b'{"a":{"dtype":"F32","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}}'))
hdr = b"{'descr': '<f4', 'fortran_order': False, 'shape': (0, 281474976710656, 281474976710656), }"
hdr += b" " * ((64 - (10 + len(hdr) + 1) % 64) % 64) + b"\n"
put("npy", "issue17-1-zero-dim-overflow", b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr)) + hdr)
idx = bytes([0, 0, 8, 8]) + b"\x00\x00\x00\x00" + b"\xff\xff\xff\xff" * 7
put("idx", "issue17-1-zero-dim-overflow", idx)
put("idx_gz", "issue17-1-zero-dim-overflow", b"\x00" + idx)  # even first byte: gzipped
# 17.3: raw non-UTF-8 name, escaped NUL names, C1/ESC in names
put("safetensors", "issue17-3-non-utf8-name",
    st_file(b'{"\xff\xfe":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x07"))
put("safetensors", "issue17-3-escaped-nul-names",
    st_file(b'{"a\\u0000x":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
            b'"a\\u0000y":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', b"\x01\x02"))
put("safetensors", "issue17-3-non-utf8-metadata",
    st_file(b'{"__metadata__":{"k":"\xc0\xaf"}}'))
put("safetensors", "issue17-3-escape-sequence-name",
    st_file(b'{"\\u001b]0;x\\u0007\xc2\x9b":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x01"))

# 17.2: checkpoints with inconsistent state (the option byte 7: optimizer, scheduler, extra)
def read_st(path):
    b = open(path, "rb").read()[1:]  # the seed's option byte
    n = struct.unpack("<Q", b[:8])[0]
    return json.loads(b[8:8 + n]), b[8 + n:]

def write_st(h, data):
    hb = json.dumps(h, separators=(",", ":")).encode()
    hb += b" " * ((8 - (8 + len(hb)) % 8) % 8)
    return b"\x07" + st_file(hb, data)

h0, d0 = read_st(os.path.join(seeds, "checkpoint", "seed-full-3"))
def variant(name, edit):
    h = json.loads(json.dumps(h0))
    edit(h["__metadata__"], h)
    put("checkpoint", "issue17-2-" + name, write_st(h, d0))

def no_steps(m, h):
    for k in [k for k in m if k.startswith("optim.state.") and k.endswith(".step")]:
        del m[k]
variant("moments-without-steps", no_steps)
variant("step-for-missing-param", lambda m, h: m.__setitem__("optim.state.9.step", "3"))
variant("step-minus-one", lambda m, h: m.__setitem__("optim.state.0.step", "-1"))
variant("negative-epoch", lambda m, h: m.__setitem__("epoch", "-1"))
variant("has-optim-0", lambda m, h: m.__setitem__("has_optim", "0"))
variant("nan-gamma", lambda m, h: m.__setitem__("sched.gamma", "nan"))
