#!/usr/bin/env python3
"""Reads a TensorBoard event file with TensorBoard's own loader and prints one line per
scalar: 'tag step value' (test_summary_writer --tensorboard compares them). Exit 77 when
the tensorboard package is not installed."""
import sys

try:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.backend.event_processing import event_accumulator
except ImportError:
    print("tensorboard is not installed", file=sys.stderr)
    sys.exit(77)

path, logdir = sys.argv[1], sys.argv[2]
version = None
for ev in EventFileLoader(path).Load():
    if ev.HasField("file_version"):
        version = ev.file_version
    for v in ev.summary.value:
        # TensorBoard's loader migrates simple_value to a scalar tensor on load
        if v.HasField("simple_value"):
            val = v.simple_value
        else:
            val = v.tensor.float_val[0] if v.tensor.float_val else 0.0
        print(f"{v.tag} {ev.step} {val!r}")
print(f"version {version}")
# and the accumulator TensorBoard's scalar dashboard uses, on the directory
acc = event_accumulator.EventAccumulator(logdir)
acc.Reload()
for tag in sorted(acc.Tags()["scalars"]):
    print(f"acc {tag} {len(acc.Scalars(tag))}")
