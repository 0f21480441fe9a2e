#!/usr/bin/env python3
"""Parity fixtures for kiln's ResNets (tests/test_nn_resnet.c) from torchvision's own code.

Needs PyTorch and torchvision (Debian: python3-torch, python3-torchvision); writes
safetensors with its own few lines (no safetensors package needed).

    python3 scripts/make_resnet_fixture.py                 # the committed small fixtures
    python3 scripts/make_resnet_fixture.py --full DIR      # torchvision's resnet18 (45 MB), into DIR

Small fixtures (tests/fixtures/resnet_small/): torchvision's ResNet at width 8 instead of
64. torchvision's ResNet.__init__ hard-codes 64/128/256/512 channels, so SmallResNet below
is that __init__ with the four numbers scaled (asserted equal to resnet18/50 at width 64);
the blocks (BasicBlock, Bottleneck), _make_layer, the initialisation loop and forward are
torchvision's. Models:
  basic18   BasicBlock [2,2,2,2], ImageNet stem (7x7/2 conv, 3x3/2 max pool), 10 classes
  cifar     BasicBlock [1,1,1,1], CIFAR stem (conv1 3x3/1, no max pool), 10 classes
  bottle    Bottleneck [1,1,1,1], ImageNet stem, 10 classes
Each model gives two files:
  NAME.weights.safetensors  the state dict before any forward (torchvision's names,
                            including running_mean/var and num_batches_tracked)
  NAME.io.safetensors       x (4, 3, 48, 48) f32 (cifar: 32, 32), y (4,) i64; logits_train: forward in train
                            mode (BatchNorm on batch statistics); after.<buffer>: a few running
                            statistics after that forward; grad.<param>: gradients of
                            cross_entropy(logits_train, y) (mean) for a few parameters;
                            logits_eval: then a forward in eval mode (the updated running stats);
                            grad64.<param>: the same gradients of the same model and batch in f64
                            (the f32 gradients are at the mercy of ReLU flips, as below: the
                            cifar model has a ReLU input 3.4e-7 from zero in layer2.0)
--full writes the same two files for torchvision.models.resnet18(num_classes=10) with
x (4, 3, 64, 64) and every parameter's gradient, as DIR/resnet18.*.safetensors, plus
grad64.<param>: the gradients of the same model and batch in f64. At this size an f32
gradient comparison is at the mercy of ReLU inputs within rounding of zero: with seed 0,
one of 512 channels of layer4.1 flips its mask between torch and kiln (both in f32), and
every gradient behind it moves by 0.5-7% while the other channels agree to 1e-7.
"""
import copy
import json
import os
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models import resnet

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures", "resnet_small")

DTYPES = {torch.float32: "F32", torch.int64: "I64", torch.float64: "F64"}


def save_safetensors(tensors, path, metadata=None):
    """The safetensors layout: u64 little-endian header size, a JSON header (name ->
    dtype, shape, data_offsets), the raw little-endian data."""
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        data = t.numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


class SmallResNet(resnet.ResNet):
    """torchvision 0.14's ResNet.__init__ with the widths 64, 128, 256, 512 scaled to width."""

    def __init__(self, block, layers, width, num_classes):
        nn.Module.__init__(self)
        self._norm_layer = nn.BatchNorm2d
        self.inplanes = width
        self.dilation = 1
        self.groups = 1
        self.base_width = 64
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(block, width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(block, width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)


def cifar_stem(model, width):
    model.conv1 = nn.Conv2d(3, width, kernel_size=3, stride=1, padding=1, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
    model.maxpool = nn.Identity()
    return model


def check_same_structure():
    """SmallResNet at width 64 has torchvision's resnet18 / resnet50 names and shapes."""
    for small, ref in ((SmallResNet(resnet.BasicBlock, [2, 2, 2, 2], 64, 1000), resnet.resnet18()),
                       (SmallResNet(resnet.Bottleneck, [3, 4, 6, 3], 64, 1000), resnet.resnet50())):
        a = {k: tuple(v.shape) for k, v in small.state_dict().items()}
        b = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
        assert a == b, "SmallResNet is not torchvision's ResNet"


def run(model, x, y, grads, buffers, out_dir, name, meta, f64=False):
    save_safetensors(model.state_dict(), os.path.join(out_dir, name + ".weights.safetensors"), meta)
    io = {}
    if f64:  # the same model and batch in f64: gradients free of f32 ReLU-mask flips
        m64 = copy.deepcopy(model).double().train()
        F.cross_entropy(m64(x.double()), y).backward()
        for k, p in m64.named_parameters():
            if grads is None or k in grads:
                io["grad64." + k] = p.grad
    model.train()
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    params = dict(model.named_parameters())
    io.update({"x": x, "y": y, "logits_train": logits, "loss": loss.reshape(1)})
    for g in grads if grads is not None else params:
        io["grad." + g] = params[g].grad
    sd = model.state_dict()
    for b in buffers:
        io["after." + b] = sd[b]
    model.eval()
    with torch.no_grad():
        io["logits_eval"] = model(x)
    save_safetensors(io, os.path.join(out_dir, name + ".io.safetensors"), meta)
    print(name, "loss %.6f" % loss.item(), "params", sum(p.numel() for p in model.parameters()))


GRADS_BASIC = ["conv1.weight", "bn1.weight", "bn1.bias", "layer1.0.conv1.weight", "layer2.0.downsample.0.weight",
               "layer2.0.downsample.1.weight", "layer3.1.bn2.bias", "layer4.1.conv2.weight", "fc.weight", "fc.bias"]
GRADS_SMALL = ["conv1.weight", "bn1.weight", "layer1.0.conv2.weight", "layer2.0.downsample.0.weight",
               "layer4.0.bn2.weight", "fc.weight", "fc.bias"]
GRADS_BOTTLE = ["conv1.weight", "layer1.0.downsample.0.weight", "layer1.0.conv3.weight", "layer2.0.conv2.weight",
                "layer4.0.bn3.bias", "fc.weight"]
BUFFERS = ["bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked", "layer4.0.bn1.running_var"]


def main():
    torch.use_deterministic_algorithms(True)
    if len(sys.argv) == 3 and sys.argv[1] == "--full":
        torch.manual_seed(0)
        model = resnet.resnet18(num_classes=10)
        x = torch.randn(4, 3, 64, 64)
        y = torch.randint(0, 10, (4,))
        run(model, x, y, None, BUFFERS + ["layer4.1.bn2.running_mean"], sys.argv[2], "resnet18",
            {"model": "torchvision.models.resnet18(num_classes=10)", "torch": torch.__version__}, f64=True)
        return
    if len(sys.argv) != 1:
        sys.exit(__doc__)
    check_same_structure()
    os.makedirs(OUT, exist_ok=True)
    cases = [("basic18", resnet.BasicBlock, [2, 2, 2, 2], False, GRADS_BASIC),
             ("cifar", resnet.BasicBlock, [1, 1, 1, 1], True, GRADS_SMALL),
             ("bottle", resnet.Bottleneck, [1, 1, 1, 1], False, GRADS_BOTTLE)]
    for i, (name, block, layers, cifar, grads) in enumerate(cases):
        torch.manual_seed(100 + i)
        model = SmallResNet(block, layers, 8, 10)
        if cifar:
            model = cifar_stem(model, 8)
        # 48x48 with the ImageNet stem leaves 2x2 at layer4 (16 values per BatchNorm channel);
        # at 32x32 it is 1x1 (4 values) and torch's own f32 gradients are 1.4e-4 off its f64
        # ones, too ill-conditioned for a 1e-4 comparison (3e-6 at 48x48).
        hw = 32 if cifar else 48
        x = torch.randn(4, 3, hw, hw)
        y = torch.randint(0, 10, (4,))
        run(model, x, y, grads, BUFFERS, OUT, name,
            {"block": block.__name__, "layers": layers, "width": 8, "cifar_stem": cifar, "num_classes": 10,
             "torch": torch.__version__}, f64=True)


if __name__ == "__main__":
    main()
