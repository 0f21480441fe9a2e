#!/usr/bin/env python3
"""Writes the reference-made fixture files under tests/fixtures/ for test_io_*.c.

Needs the reference implementations, which the test path never does (CI has neither):
    pip install safetensors numpy
    python3 scripts/make_fixtures.py

The values follow simple formulas that tests/test_io_safetensors.c and test_io_npy.c
repeat in C; change both together. The files are committed, so this only runs when a
fixture is added or changed.
"""
import os
import sys

import numpy as np
from safetensors import TensorSpec, serialize

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures")


def safetensors_fixture():
    arrays = {
        "a.f32": (np.arange(6, dtype=np.float32) * 0.5 - 1.25).reshape(2, 3),
        "b.f64": (np.arange(3, dtype=np.float64) + 1) / 3.0,
        "c.f16": (np.arange(4, dtype=np.float16) * np.float16(0.25) - np.float16(0.5)).reshape(2, 2),
        "e.i64": np.array([[-(1 << 40), -1], [0, 1 << 62]], dtype=np.int64),
        "f.i32": np.array([-7, 0, 2147483647], dtype=np.int32),
        "g.u8": np.array([0, 1, 127, 128, 255], dtype=np.uint8),
        "h.bool": np.array([True, False, True]),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }
    # numpy has no bfloat16: its bytes go through the low-level serializer as uint16 bits
    # (the top halves of the f32 values 1.0, -2.0, 0.5, 3.0).
    bf16 = np.array([0x3F80, 0xC000, 0x3F00, 0x4040], dtype=np.uint16)
    specs = {}
    keep = []
    for name, a in arrays.items():
        a = a.copy(order="C")  # (ascontiguousarray would make a 0-dim array 1-dim)
        keep.append(a)
        specs[name] = TensorSpec(dtype=a.dtype.name, shape=a.shape, data_ptr=a.ctypes.data, data_len=a.nbytes)
    keep.append(bf16)
    specs["d.bf16"] = TensorSpec(dtype="bfloat16", shape=[4], data_ptr=bf16.ctypes.data, data_len=bf16.nbytes)
    data = serialize(specs, {"format": "np", "kiln": "fixture \"quoted\""})
    with open(os.path.join(OUT, "all_dtypes.safetensors"), "wb") as f:
        f.write(bytes(data))


def npy_fixtures():
    def save(name, a, version=None):
        with open(os.path.join(OUT, name), "wb") as f:
            np.lib.format.write_array(f, a, version=version)

    f4 = (np.arange(6, dtype=np.float32) * 0.5 - 1.25).reshape(2, 3)
    save("f4.npy", f4)
    save("f8.npy", (np.arange(3, dtype=np.float64) + 1) / 3.0)
    save("f2.npy", (np.arange(4, dtype=np.float16) * np.float16(0.25) - np.float16(0.5)).reshape(2, 2))
    save("i8.npy", np.array([[-(1 << 40), -1], [0, 1 << 62]], dtype=np.int64))
    save("i4.npy", np.array([-7, 0, 2147483647], dtype=np.int32))
    save("u1.npy", np.array([0, 1, 127, 128, 255], dtype=np.uint8))
    save("b1.npy", np.array([True, False, True]))
    save("scalar.npy", np.array(2.5, dtype=np.float64))
    save("empty.npy", np.zeros((0, 3), dtype=np.float32))
    # Fortran order: element (i, j[, k]) is i*4 + j (2-d) or i*12 + j*4 + k (3-d) either way.
    save("fortran2.npy", np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)))
    save("fortran3.npy", np.asfortranarray(np.arange(24, dtype=np.int32).reshape(2, 3, 4)))
    save("v2.npy", f4, version=(2, 0))
    save("v3.npy", f4, version=(3, 0))
    save("big_endian.npy", f4.astype(">f4"))
    save("int16.npy", np.array([1, 2], dtype=np.int16))


def main():
    os.makedirs(OUT, exist_ok=True)
    safetensors_fixture()
    npy_fixtures()
    print("fixtures written to", os.path.normpath(OUT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
