#!/usr/bin/env python3
"""Writes tests/fixtures/hf_gpt2/generate.safetensors: Hugging Face transformers' greedy
continuation of two prompts by the fixture model (tests/fixtures/hf_gpt2, written by
make_hf_gpt2_fixture.py), for tests/test_nn_generate.c (kiln_gpt_generate parity).

Run by hand when the fixture changes (CI never runs it; the file is committed). Same venv
as make_hf_gpt2_fixture.py:
    python3 -m venv --system-site-packages /tmp/hfvenv
    /tmp/hfvenv/bin/pip install 'transformers<4.40' safetensors
    /tmp/hfvenv/bin/python scripts/make_hf_gpt2_generate_fixture.py

What it writes (i64): prompt (2, 5), out (2, 5 + 20) = model.generate(prompt,
max_new_tokens=20, do_sample=False) with eos disabled (the fixture's config names token 0
as eos, which would end a row early and pad it), and out_long (1, 32): one prompt of 4
tokens continued to the full context (n_positions 32). Metadata: the versions.
"""
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import GPT2LMHeadModel

DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf_gpt2")


def main():
    torch.manual_seed(1)
    torch.set_num_threads(1)
    model = GPT2LMHeadModel.from_pretrained(DIR).eval()
    model.generation_config.eos_token_id = None
    prompt = torch.randint(0, model.config.vocab_size, (2, 5), dtype=torch.int64)
    long_prompt = torch.randint(0, model.config.vocab_size, (1, 4), dtype=torch.int64)
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                             do_sample=False, pad_token_id=0)
        out_long = model.generate(long_prompt, attention_mask=torch.ones_like(long_prompt),
                                  max_new_tokens=28, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 25) and out_long.shape == (1, 32), (out.shape, out_long.shape)
    save_file({"prompt": prompt, "out": out.contiguous(), "out_long": out_long.contiguous()},
              os.path.join(DIR, "generate.safetensors"),
              metadata={"torch": torch.__version__, "transformers": transformers.__version__})
    print("wrote generate.safetensors", out.tolist(), out_long.tolist(), file=sys.stderr)


if __name__ == "__main__":
    main()
