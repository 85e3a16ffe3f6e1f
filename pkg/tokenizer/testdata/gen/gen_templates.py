#!/usr/bin/env python3
"""Renders every conversation of chats.json with each template in testdata/templates/ (copied
verbatim from models/templates/ of the llama-cpp-python 0.3.36 sdist, which llama.cpp fetched
from the models' tokenizer_config.json) the way transformers does, and writes
templates/expected.jsonl: {"template", "chat", "rendered"} or {"template", "chat", "error"}.

Usage: gen_templates.py TESTDATA_DIR
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gen_expected import render  # noqa: E402

SPECIAL = {
    "qwen": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None},
    "deepseek": {"bos_token": "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "eos_token": "<\uff5cend\u2581of\u2581sentence\uff5c>",
                 "pad_token": "<\uff5cend\u2581of\u2581sentence\uff5c>", "unk_token": None},
}


def main(td):
    chats = json.load(open(os.path.join(td, "chats.json"), encoding="utf-8"))
    tdir = os.path.join(td, "templates")
    names = sorted(n for n in os.listdir(tdir) if n.endswith(".jinja"))
    with open(os.path.join(tdir, "expected.jsonl"), "w", encoding="utf-8") as f:
        for name in names:
            src = open(os.path.join(tdir, name), encoding="utf-8").read()
            special = SPECIAL["deepseek" if name.startswith("deepseek") else "qwen"]
            for i, chat in enumerate(chats):
                rec = {"template": name, "chat": i}
                try:
                    rec["rendered"] = render(src, chat, special)
                except Exception as e:  # the template refused the conversation
                    rec["error"] = f"{type(e).__name__}: {e}"
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    print(f"{len(names)} templates x {len(chats)} chats", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
