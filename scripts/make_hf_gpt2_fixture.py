#!/usr/bin/env python3
"""Writes tests/fixtures/hf_gpt2/: a tiny random GPT-2 saved by Hugging Face transformers
and its logits for one batch, for tests/test_nn_gpt_hf.c (kiln_gpt_from_hf parity).

Run by hand when the fixture should change (CI never runs it; the files are committed).
Needs PyTorch, transformers and safetensors; on Debian with python3-torch 1.13:
    python3 -m venv --system-site-packages /tmp/hfvenv
    /tmp/hfvenv/bin/pip install 'transformers<4.40' safetensors
    /tmp/hfvenv/bin/python scripts/make_hf_gpt2_fixture.py

What it writes:
  model.safetensors   GPT2LMHeadModel.save_pretrained(safe_serialization=True): Hugging
                      Face's names ("transformer.h.0.attn.c_attn.weight", ...), Conv1D
                      weights stored (in, out); the tied lm_head.weight is left out, as
                      transformers does.
  config.json         the GPT2Config (n_layer 2, n_head 2, n_embd 32, vocab_size 100,
                      n_positions 32, dropout 0).
  logits.safetensors  ids (2, 16) i64 and logits (2, 16, 100) f32: the model's output in
                      eval mode; metadata: the torch and transformers versions.

The weights are HF's init with initializer_range 0.1 (instead of 0.02, so the logits are
not all near zero), then every LayerNorm weight and bias and every Conv1D bias perturbed
(HF inits them to 1 and 0, and a swapped ln_1/ln_2 or a dropped bias would go unseen).
"""
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf_gpt2")


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name and name.endswith(".weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    os.makedirs(OUT, exist_ok=True)
    model.save_pretrained(OUT, safe_serialization=True)
    gen = os.path.join(OUT, "generation_config.json")
    if os.path.exists(gen):
        os.remove(gen)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), dtype=torch.int64)
    with torch.no_grad():
        logits = model(ids).logits.float().contiguous()
    save_file({"ids": ids, "logits": logits}, os.path.join(OUT, "logits.safetensors"),
              metadata={"torch": torch.__version__, "transformers": transformers.__version__})
    print("wrote", OUT, "torch", torch.__version__, "transformers", transformers.__version__,
          "max |logit|", float(logits.abs().max()), file=sys.stderr)


if __name__ == "__main__":
    main()
