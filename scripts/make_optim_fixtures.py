#!/usr/bin/env python3
"""Writes tests/fixtures/optim/*.safetensors: PyTorch's training run of a small MLP under
each optimizer configuration, for tests/test_optim_parity.c.

Run by hand when a configuration is added or changed (CI never runs it; the files are
committed). Needs PyTorch and numpy only (Debian: apt-get install python3-torch):
    /usr/bin/python3 scripts/make_optim_fixtures.py

What it writes (all f32 unless said; names of parameters are nn.Sequential's):
  init.safetensors      0.weight (32, 16), 0.bias (32), 2.weight (10, 32), 2.bias (10):
                        the initial parameters (a state dict, as a user would load one).
  batches.safetensors   x (8, 32, 16) and y (8, 32) i64: 8 batches of 32 used cyclically
                        (step s trains on batch s % 8).
  <config>.safetensors  losses (STEPS): the loss of every step before its update, in f32;
                        the four parameters after STEPS updates; metadata: the optimizer
                        and scheduler settings (floats written with repr(), so strtod reads
                        back the same double), and the torch version.

The model: Linear(16, 32) -> ReLU -> Linear(32, 10), cross-entropy (mean). The loop is
what a user writes: zero_grad, forward, loss, backward, optimizer.step(), then
scheduler.step(). One thread, so the run does not depend on the machine's core count.
The fixtures were made on an AVX2+FMA CPU: PyTorch's CPU kernels for that capability fuse
`a + alpha * b` into one FMA (the elementwise ops of torch.optim see this), and kiln's
kernels follow that; see src/backend/cpu/cpu_optim.c.
"""
import json
import os
import struct

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures", "optim")
STEPS = 300
BATCHES, BATCH, IN, HIDDEN, CLASSES = 8, 32, 16, 32, 10

# name -> optimizer settings (kiln's names: sgd/adam/adamw, as kiln_optim_config) and an
# optional scheduler. Every float is a Python float: PyTorch does its scalar arithmetic
# in double on these.
CONFIGS = {
    "sgd": dict(optimizer="sgd", lr=0.1),
    "sgd_momentum": dict(optimizer="sgd", lr=0.05, momentum=0.9, dampening=0.1),
    "sgd_nesterov": dict(optimizer="sgd", lr=0.02, momentum=0.9, nesterov=True),
    "sgd_weight_decay": dict(optimizer="sgd", lr=0.1, weight_decay=0.01),
    "adam": dict(optimizer="adam", lr=1e-2),
    "adam_l2": dict(optimizer="adam", lr=1e-2, weight_decay=0.01),
    "adamw": dict(optimizer="adamw", lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": dict(optimizer="adam", lr=1e-2, amsgrad=True),
    "sgd_momentum_steplr": dict(optimizer="sgd", lr=0.05, momentum=0.9,
                                scheduler="step", step_size=60, gamma=0.7),
    "adam_cosine": dict(optimizer="adam", lr=1e-2, scheduler="cosine", t_max=STEPS,
                        eta_min=1e-5),
}


def save_safetensors(path, tensors, metadata):
    """The safetensors layout: u64 header size, JSON header, then the raw bytes."""
    header, blobs, off = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        dtype = {np.float32: "F32", np.int64: "I64"}[a.dtype.type]
        b = a.astype(a.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def model():
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
                               torch.nn.Linear(HIDDEN, CLASSES))


def make_optimizer(cfg, params):
    kw = dict(lr=cfg["lr"], weight_decay=cfg.get("weight_decay", 0.0), foreach=False)
    if cfg["optimizer"] == "sgd":
        return torch.optim.SGD(params, momentum=cfg.get("momentum", 0.0),
                               dampening=cfg.get("dampening", 0.0),
                               nesterov=cfg.get("nesterov", False), **kw)
    cls = torch.optim.Adam if cfg["optimizer"] == "adam" else torch.optim.AdamW
    return cls(params, betas=(0.9, 0.999), eps=1e-8, amsgrad=cfg.get("amsgrad", False), **kw)


def make_scheduler(cfg, opt):
    s = cfg.get("scheduler")
    if s == "step":
        return torch.optim.lr_scheduler.StepLR(opt, cfg["step_size"], cfg["gamma"])
    if s == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, cfg["t_max"], cfg["eta_min"])
    return None


def main():
    torch.set_num_threads(1)
    torch.manual_seed(13)
    init = model()
    x = torch.randn(BATCHES, BATCH, IN)
    teacher = torch.randn(IN, CLASSES)
    y = (x @ teacher).argmax(-1)  # a learnable labelling
    os.makedirs(OUT, exist_ok=True)
    meta = {"torch": torch.__version__}
    save_safetensors(os.path.join(OUT, "init.safetensors"),
                     {k: v.detach().numpy() for k, v in init.state_dict().items()}, meta)
    save_safetensors(os.path.join(OUT, "batches.safetensors"),
                     {"x": x.numpy(), "y": y.numpy().astype(np.int64)}, meta)
    for name, cfg in CONFIGS.items():
        net = model()
        net.load_state_dict(init.state_dict())
        opt = make_optimizer(cfg, net.parameters())
        sched = make_scheduler(cfg, opt)
        losses = []
        for s in range(STEPS):
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(net(x[s % BATCHES]), y[s % BATCHES])
            loss.backward()
            opt.step()
            if sched:
                sched.step()
            losses.append(loss.item())
        out = {k: v.detach().numpy() for k, v in net.state_dict().items()}
        out["losses"] = np.array(losses, dtype=np.float32)
        meta = {k: (repr(v) if isinstance(v, float) else int(v) if isinstance(v, bool) else v)
                for k, v in cfg.items()}
        meta.update(torch=torch.__version__, steps=STEPS)
        save_safetensors(os.path.join(OUT, name + ".safetensors"), out, meta)
        print(f"{name:22s} loss {losses[0]:.6f} -> {losses[-1]:.6f}")


if __name__ == "__main__":
    main()
