#!/usr/bin/env python3
"""Fixtures for tests/test_tokenizer.c and bench/bench_tokenizer.c (tests/fixtures/tokenizer/).

Trains a GPT-2 style byte-level BPE with Hugging Face `tokenizers` (ByteLevel
pre-tokenizer, add_prefix_space False, the 256-byte initial alphabet, <|endoftext|> as a
special token, vocab 4096) on a text made here, and writes what the test needs:

  vocab.json, merges.txt   the GPT-2 file pair (ByteLevelBPETokenizer.save_model)
  tokenizer.json           the same tokenizer in the single-file format
  text.txt.gz              the >= 1 MB test text (gzip: kiln links zlib)
  ids.u16.gz               tokenizers' ids for that text, little-endian uint16, gzip

The text: the first ~1.0 MB of CPython 3.11's NEWS file, as Debian's python3.11 package
installs it (/usr/share/doc/python3.11/NEWS.gz, the PSF license), with a crafted Unicode
edge-case passage (EDGE below) inserted every 64 KiB and at both ends. The text is
committed (compressed) rather than read from the package, so that a different package
version cannot change the expected ids. Nothing is downloaded.

    pip install tokenizers && python3 scripts/make_tokenizer_fixtures.py
"""
import gzip
import os
import struct
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
NEWS = "/usr/share/doc/python3.11/NEWS.gz"

# Unicode edge cases: combining marks (precomposed and decomposed), emoji with ZWJ and
# skin tones and flags, CJK, Hangul, RTL (Hebrew, Arabic with marks), Devanagari, control
# characters other than NUL, CRLF and lone CR, many spaces and tabs, spaces before a word
# and at line ends, non-ASCII whitespace (NBSP, ideographic space, U+2028), digits of
# several scripts, Roman numerals and fractions (N but not Nd), contractions and
# not-quite-contractions, and apostrophe runs.
EDGE = (
    "caf\u00e9 cafe\u0301 na\u0131\u0308ve \u1e9b\u0323 e\u0301\u0301\u0301\n"
    "\U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466 family "
    "\U0001F44D\U0001F3FD \U0001F1EF\U0001F1F5\U0001F1FA\U0001F1F8 \u2764\ufe0f\n"
    "\u6f22\u5b57\u304b\u306a\u30ab\u30ca \u4e2d\u6587\u6d4b\u8bd5\u3002\ud55c\uad6d\uc5b4 "
    "\u05e9\u05c1\u05b8\u05dc\u05d5\u05b9\u05dd \u0627\u0644\u0633\u0651\u064e\u0644\u0627\u0645 "
    "\u0939\u093f\u0928\u094d\u0926\u0940\n"
    "ctl:\x01\x02\x07\x08\x0b\x0c\x1b[0m\x7f\u0085\u200b\u200e\u202e\ufeff end\r\n"
    "crlf line\r\nlone cr\rtab\there\t\t\ttabs   \n"
    "          ten spaces then\n   \n\n\n    \t \n"
    "nbsp\u00a0word ideo\u3000space line\u2028sep para\u2029sep\u2003em \u205fmath\n"
    "123 4567890 3.14159 1,000,000 \u0661\u0662\u0663 \u0967\u0968 \u2164\u2165 \u00bd\u00be "
    "\u00b2\u00b3 \uff11\uff12\n"
    "I'm you're we've they'll he'd it's don't Can'T ''s '' 'x O'Neil rock'n'roll "
    "\u2019s curly\u2019ll\n"
    "<|endoftext|>after special <|endoftext|><|endoftext|>\n"
    "\U00010348\U0001D400\U0001F600 \U000E0041 tags\n"
)


def make_text():
    with gzip.open(NEWS, "rt", encoding="utf-8") as f:
        news = f.read()
    base = news[:1_000_000]
    base = base[: base.rfind("\n") + 1]
    parts = [EDGE]
    for i in range(0, len(base), 65536):
        parts.append(base[i : i + 65536])
        parts.append(EDGE)
    return "".join(parts)


def main():
    text = make_text()
    assert len(text.encode("utf-8")) >= 1_000_000, "the test text must be >= 1 MB"
    os.makedirs(OUT, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        min_frequency=2,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    tok.save(os.path.join(OUT, "tokenizer.json"))
    tok.model.save(OUT)  # vocab.json + merges.txt

    ids = tok.encode(text).ids
    assert max(ids) < 65536
    assert tok.decode(ids, skip_special_tokens=False) == text
    with gzip.GzipFile(os.path.join(OUT, "text.txt.gz"), "wb", mtime=0) as f:
        f.write(text.encode("utf-8"))
    with gzip.GzipFile(os.path.join(OUT, "ids.u16.gz"), "wb", mtime=0) as f:
        f.write(struct.pack(f"<{len(ids)}H", *ids))
    print(f"text {len(text.encode('utf-8'))} bytes, {len(ids)} ids, vocab {tok.get_vocab_size()}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
