#!/usr/bin/env python3
"""Differential check input: N random strings drawn across Unicode (every general category,
astral planes, unassigned code points, combining sequences, whitespace of every kind, special
tokens, contractions) with the ids HF `tokenizers` gives for each committed tokenizer and
variant. Not committed (large); TestParityRandom reads it when KVC_TOKENIZER_RANDOM names it.

Usage: gen_random.py TESTDATA_DIR OUT.jsonl [N] [SEED]
"""
import json
import os
import random
import sys
import unicodedata

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_expected import load  # noqa: E402

PIECES = ["'s", "'S", "'ll", "'LL", "'re", "'Ve", "'d", "'m", "'t", "'\u017f", "'K", "\u212a",
          "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</tool_call>",
          "<\uff5cUser\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>", " ", "  ", "\t", "\n", "\r\n", "\r", "\u00a0",
          "\u3000", "\u2028", "\u0085", "\u200b", "\ufeff", "e\u0301", "\u1100\u1161\u11a8", "123", "4567", "\u0663\u0664",
          "\U0001f600", "\U0001f468\u200d\U0001f469", "\ufe0f", "!!", "?", "...", "```", "{\"a\": 1}", "\\n", "x", "Hello", "\u4e2d\u6587",
          "\u3053\u3093\u306b\u3061\u306f", "\u30ab\u30bf\u30ab\u30ca", "\ud55c\uad6d", "\u0645\u0631\u062d\u0628\u0627", "\u0928\u092e\u0938\u094d\u0924\u0947"]


def rand_char(rnd):
    r = rnd.random()
    if r < 0.35:
        return chr(rnd.randrange(0x20, 0x7f))
    if r < 0.55:
        return chr(rnd.randrange(0xa0, 0x3000))
    if r < 0.75:
        return chr(rnd.randrange(0x3000, 0xd800))
    if r < 0.85:
        return chr(rnd.randrange(0xe000, 0x10000))
    if r < 0.95:
        return chr(rnd.randrange(0x10000, 0x30000))
    return chr(rnd.choice([0x0, 0x1, 0x7, 0x8, 0xb, 0xc, 0x1c, 0x1f, 0x7f, 0x9f]))


def rand_string(rnd):
    out = []
    for _ in range(rnd.randint(1, 30)):
        if rnd.random() < 0.4:
            out.append(rnd.choice(PIECES))
        else:
            out.append("".join(rand_char(rnd) for _ in range(rnd.randint(1, 6))))
    return "".join(out)


def main(testdata, out, n=20000, seed=1):
    rnd = random.Random(seed)
    texts = [rand_string(rnd) for _ in range(n)]
    variants = [k for k in json.load(open(os.path.join(testdata, "variants.json"))) if not k.startswith("_")]
    models = ["qwen3", "deepseek-v4"] + variants
    toks = {m: load(os.path.join(testdata, m)) for m in models}
    with open(out, "w", encoding="utf-8") as f:
        for t in texts:
            rec = {"text": t}
            for m in models:
                rec[m] = toks[m].encode(t, add_special_tokens=True).ids
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"{n} strings, unicodedata {unicodedata.unidata_version}", file=sys.stderr)


if __name__ == "__main__":
    a = sys.argv
    main(a[1], a[2], int(a[3]) if len(a) > 3 else 20000, int(a[4]) if len(a) > 4 else 1)
