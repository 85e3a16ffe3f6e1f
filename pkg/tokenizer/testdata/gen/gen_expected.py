#!/usr/bin/env python3
"""Writes the parity corpus and the ids/renderings Hugging Face produces for it.

Outputs (under OUT_TESTDATA_DIR):
  corpus.jsonl                  one {"text": ...} per line (hand-written cases + seeded mixes)
  chats.json                    OpenAI-style conversations (+ add_generation_prompt, enable_thinking)
  <model>/expected.jsonl        per corpus line: {"ids": [...]} from tokenizers.Tokenizer.encode
  qwen3/chat_expected.jsonl     per chat: {"rendered": ..., "ids": [...]}; rendered exactly as
                                transformers' apply_chat_template renders (jinja2
                                ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
                                loopcontrols, tojson without ASCII escaping)

  <variant>/expected.jsonl      the same for each tokenizer variants.json derives from a committed one

Usage: gen_expected.py OUT_TESTDATA_DIR   (needs: pip install tokenizers==0.23.3 jinja2==3.1.6)
       gen_expected.py --extra DIR        (expected ids for DIR/tokenizer.json, add_special_tokens=True)
"""
import gzip
import json
import os
import random
import sys

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

HAND = [
    "Hello world", " Hello world", "Hello World!", "Hello, world!", "  leading spaces", "trailing spaces   ",
    "", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r\n\r\n", " \n", "\n ", " \n \n", "a\n\n\nb", "a \n\tb",
    "tabs\tand\t\tdouble\t\t\ttabs", "x    y", "x    1", "x    !", "x    \u4e2d", "end with space ",
    "I'm sure they'll say it's fine, we've done what you'd've wanted.", "DON'T SHOUT, IT'S LOUD", "O'Reilly's 'quoted' text",
    "'s 'S 'T 're 'RE 've 'm 'll 'LL 'd", "it\u2019s curly", "'\u017f long s and 'K kelvin", "don't 've'",
    "The quick brown fox jumps over the lazy dog.", "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "0", "7", "42", "123", "1234", "12345678901234567890", "3.14159265358979", "1,234,567.89", "-273.15\u00b0C",
    "v1.2.3-rc.4+build.5", "0x7fffffff 0b1010 1e-9 6.02e23", "\u0661\u0662\u0663 arabic digits \u0967\u0968 devanagari \uff11\uff12 fullwidth",
    "Ⅻ roman numeral ½ ¾ ² ³", "2026-12-01T16:22:08Z",
    "func main() {\n\tfmt.Println(\"hello\")\n}\n",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n    pass\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i] * c; }",
    "    indented by four\n        by eight\n\t\ttabs\n",
    "if err != nil {\n\t\treturn fmt.Errorf(\"open %s: %w\", path, err)\n\t}",
    "SELECT id, name FROM users WHERE email LIKE '%@example.com' ORDER BY 2 DESC;",
    "<div class=\"x\">&nbsp;&lt;tag&gt;</div>", "https://example.com/a/b?c=d&e=f#frag", "user@example.com",
    "```python\nprint('hi')\n```", "| a | b |\n|---|---|\n| 1 | 2 |", "--- a/x.go\n+++ b/x.go\n@@ -1,3 +1,4 @@\n-old\n+new\n",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}",
    "<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"/etc/hosts\"}}\n</tool_call>",
    "<tool_response>\n{\"content\": \"127.0.0.1 localhost\"}\n</tool_response>",
    "{\"a\":[1,2,{\"b\":null,\"c\":true}],\"d\":\"\\u00e9\\n\"}",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01\u4eca\u5929\u5929\u6c14\u600e\u4e48\u6837\uff1f",
    "\u6bd5\u8001\u5e08\uff011 + 1 = 2",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3068\u30ab\u30bf\u30ab\u30ca\u3001\u3072\u3089\u304c\u306a\u3002",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8\uc785\ub2c8\ub2e4.", "\u1112\u1161\u11ab decomposed hangul jamo",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u043d\u0435\u0449\u043e \u043d\u0430 \u0411\u044a\u043b\u0433\u0430\u0440\u0441\u043a\u0438",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645", "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e", "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e0a\u0e32\u0e27\u0e42\u0e25\u0e01",
    "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5", "Ti\u1ebfng Vi\u1ec7t c\u00f3 d\u1ea5u",
    "e\u0301 combining acute", "A\u030a ring, \u212b angstrom, \u00c5 precomposed", "\ufb01 ligature \u2126 ohm",
    "\U0001f999 llama \U0001f600\U0001f601 \U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467 \U0001f1eb\U0001f1f7 \u2764\ufe0f",
    "\U0001f525\U0001f525\U0001f525 fire x3", "\u200b zero width \u200d joiner \ufeff bom",
    "nbsp\u00a0between and\u3000ideographic space and\u2003em space", "\u2028line sep\u2029para sep\u0085nel",
    "\u000b vertical tab \u000c form feed", "ctrl \u0001\u0002\u001f chars", "\u00ff\u00fe bytes-ish \u0100",
    "\u2200x \u2203y: x \u2264 y \u2227 \u00acP(x) \u2192 \u222b f dx \u2248 \u221e", "\u20ac100 \u00a350 \u00a51000 $5",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>", "<|im_start|><|im_end|>",
    "<|im_start", "<|im_end|", "<<|im_end|>>", "x<|im_end|>y", " <|im_end|> ", "<think>\nreasoning\n</think>\n\nanswer",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>", "<|vision_start|><|image_pad|><|vision_end|>",
    "<\uff5cbegin\u2581of\u2581sentence\uff5c>hello<\uff5cend\u2581of\u2581sentence\uff5c>", "<\uff5cUser\uff5c>hi<\uff5cAssistant\uff5c>",
    "!!!???...,,,;;;", "a.b,c;d:e", "--flag=value -x", "#!/bin/bash\nset -euo pipefail\n", "$HOME/.config ~/.ssh",
    "\"quoted\" 'single' `back`", "(((nested)))", "[1, 2, 3]", "a_b_c snake_case camelCase PascalCase kebab-case SCREAMING_CASE",
    # Unicode where HF and Go's tables differ (regex classes: Unicode 16 vs 15; normalization:
    # HF's older tables): letters and symbols new in Unicode 16, marks HF does not reorder,
    # a composition HF does not apply.
    "\U00013aec(Z", "x\U00014314'd", "a\U0001ccef're", " \U000140b1", "\u1c89\u1c8a", "\U0001e065'LL",
    "\u1dee\u08d3 and \u1df6\u2dfc and \u20d4\u0d3c", "\U00011935\U00011930", "a\u0301\u0316 e\u0316\u0301",
    "x" * 300, " " * 100, "\n" * 50, "ab" * 150, "\u4e2d" * 120, "\U0001f600" * 40, "1" * 101, "\t \n" * 30,
]

FRAGMENTS = [
    "the", "The", " of", " and", " model", " KV cache", " prefill", " decode", " token", "s", "'s", "n't",
    "\u7f13\u5b58", "\u89e3\u7801", "\u30c8\u30fc\u30af\u30f3", "\ud1a0\ud070", "\U0001f680", "\u2728", "\u00e9", "e\u0301",
    "0", "12", "345", "2048", "3.5", "-1", "1e6", " ", "  ", "    ", "\t", "\n", "\n\n", "\r\n", "\u00a0",
    "{", "}", "[", "]", "(", ")", ":", ",", ".", ";", "\"", "'", "`", "=", "==", "!=", "->", "=>", "::", "//", "/*", "*/", "#",
    "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<|endoftext|>",
    "func", "return", "def", "import", "json", "null", "true", "false", "\"key\": \"value\"",
    "http://", "www.", ".com", "@", "$", "%", "^", "&", "*", "+", "-", "_", "~", "|", "\\", "?", "!",
]


def corpus():
    rnd = random.Random(20261201)
    out = list(HAND)
    for _ in range(260):
        n = rnd.randint(1, 40)
        out.append("".join(rnd.choice(FRAGMENTS) for _ in range(n)))
    return out


CHATS = [
    {"messages": [{"role": "user", "content": "Hello!"}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Hello!"}], "add_generation_prompt": False},
    {"messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is 2+2?"}], "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."},
                  {"role": "assistant", "content": "7"}, {"role": "user", "content": "Another one, bigger."}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Explain KV caches."},
                  {"role": "assistant", "content": "<think>\nThe user wants a short explanation.\n</think>\n\nA KV cache stores keys and values of past tokens."},
                  {"role": "user", "content": "And paging?"}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Explain KV caches."},
                  {"role": "assistant", "content": "A KV cache stores keys and values.", "reasoning_content": "Keep it short."},
                  {"role": "user", "content": "Shorter."},
                  {"role": "assistant", "content": "<think>\nEven shorter.\n</think>\n\nCached attention state."}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "\u4f60\u597d\uff0c\u8bf7\u7528\u4e2d\u6587\u56de\u7b54\u3002"},
                  {"role": "assistant", "content": "\u597d\u7684\uff01\U0001f600"}, {"role": "user", "content": "\u8c22\u8c22"}], "add_generation_prompt": True, "enable_thinking": False},
    {"messages": [{"role": "system", "content": "You are a coding agent."},
                  {"role": "user", "content": "Read main.go"},
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "read_file", "arguments": "{\"path\": \"main.go\"}"}}]},
                  {"role": "tool", "content": "package main\n\nfunc main() {}\n"},
                  {"role": "tool", "content": "second result"},
                  {"role": "assistant", "content": "It is an empty program."},
                  {"role": "user", "content": "<tool_response>\nok\n</tool_response>"}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "a\n\n\n  b\t\tc   "}, {"role": "assistant", "content": "  spaced  "},
                  {"role": "user", "content": "x"}], "add_generation_prompt": True, "enable_thinking": True},
    {"messages": [{"role": "system", "content": "S"}, {"role": "system", "content": "second system"}, {"role": "user", "content": "u"}], "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "What's the weather in Paris?"}],
     "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Current weather for a city; unit is \"c\" or \"f\".",
                                                 "parameters": {"type": "object", "required": ["city"],
                                                                "properties": {"city": {"type": "string", "description": "City, e.g. M\u00fcnchen or \u6771\u4eac"},
                                                                               "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
                                                                               "days": {"type": "integer", "minimum": 1, "maximum": 16},
                                                                               "precision": {"type": "number", "multipleOf": 0.5}}}}},
               {"type": "function", "function": {"name": "read_file", "description": "Read a file <path> & return its text\n(tabs\tkept)",
                                                 "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "max_bytes": {"type": "integer", "default": 65536}}, "required": ["path"]}}}],
     "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "Read a.txt"},
                  {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "read_file", "arguments": {"path": "a.txt", "max_bytes": 100, "opts": {"z": 1, "a": [True, None, 1.5]}}}}]},
                  {"role": "tool", "content": "hello"}],
     "tools": [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}],
     "add_generation_prompt": True},
]


def make_long_chats():
    rnd = random.Random(7)
    out = []
    for k in range(12):
        msgs = []
        if k % 2 == 0:
            msgs.append({"role": "system", "content": "You are agent #%d. Use tools when needed." % k})
        for t in range(rnd.randint(2, 8)):
            msgs.append({"role": "user", "content": "".join(rnd.choice(FRAGMENTS) for _ in range(rnd.randint(1, 60)))})
            body = "".join(rnd.choice(FRAGMENTS) for _ in range(rnd.randint(1, 60)))
            if rnd.random() < 0.5:
                body = "<think>\n" + "".join(rnd.choice(FRAGMENTS) for _ in range(rnd.randint(1, 20))) + "\n</think>\n\n" + body
            msgs.append({"role": "assistant", "content": body})
        msgs.append({"role": "user", "content": "final question %d?" % k})
        chat = {"messages": msgs, "add_generation_prompt": k % 3 != 0}
        if k % 4 == 1:
            chat["enable_thinking"] = False
        out.append(chat)
    return out


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(msg):
    raise jinja2.exceptions.TemplateError(msg)


def render(template, chat, special):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    kw = {k: v for k, v in chat.items() if k not in ("messages", "tools")}
    return env.from_string(template).render(messages=chat["messages"], tools=chat.get("tools"), documents=None, **special, **kw)


def variant_json(testdata, name):
    """A tokenizer.json derived from a committed one by variants.json's replacements."""
    v = json.load(open(os.path.join(testdata, "variants.json"), encoding="utf-8"))[name]
    with gzip.open(os.path.join(testdata, v["base"], "tokenizer.json.gz"), "rt", encoding="utf-8") as f:
        s = f.read()
    for old, new in v["replace"]:
        assert s.count(old) == 1, (name, old[:60])
        s = s.replace(old, new)
    return s


def load(d):
    testdata, name = os.path.dirname(d), os.path.basename(d)
    variants = json.load(open(os.path.join(testdata, "variants.json"), encoding="utf-8"))
    if name in variants:
        return Tokenizer.from_str(variant_json(testdata, name))
    with gzip.open(os.path.join(d, "tokenizer.json.gz"), "rt", encoding="utf-8") as f:
        return Tokenizer.from_str(f.read())


def extra(d):
    """gen_expected.py --extra DIR: expected ids (with add_special_tokens=True) for a
    tokenizer.json that is not committed (make_testdata.py --llama3)."""
    texts = corpus()
    tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "expected.jsonl"), "w") as f:
        for t in texts:
            f.write(json.dumps({"ids": tok.encode(t, add_special_tokens=True).ids}) + "\n")


def main(out):
    texts = corpus()
    with open(os.path.join(out, "corpus.jsonl"), "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    variants = [k for k in json.load(open(os.path.join(out, "variants.json"), encoding="utf-8")) if not k.startswith("_")]
    for model in ["qwen3", "deepseek-v4"] + variants:
        tok = load(os.path.join(out, model))
        os.makedirs(os.path.join(out, model), exist_ok=True)
        with open(os.path.join(out, model, "expected.jsonl"), "w") as f:
            for t in texts:
                f.write(json.dumps({"ids": tok.encode(t).ids}) + "\n")
    chats = CHATS + make_long_chats()
    with open(os.path.join(out, "chats.json"), "w", encoding="utf-8") as f:
        json.dump(chats, f, ensure_ascii=False, indent=1)
        f.write("\n")
    cfg = json.load(open(os.path.join(out, "qwen3", "tokenizer_config.json"), encoding="utf-8"))
    special = {"bos_token": cfg["bos_token"], "eos_token": cfg["eos_token"], "pad_token": cfg["pad_token"], "unk_token": cfg["unk_token"]}
    tok = load(os.path.join(out, "qwen3"))
    with open(os.path.join(out, "qwen3", "chat_expected.jsonl"), "w", encoding="utf-8") as f:
        for chat in chats:
            s = render(cfg["chat_template"], chat, special)
            f.write(json.dumps({"rendered": s, "ids": tok.encode(s, add_special_tokens=False).ids}, ensure_ascii=False) + "\n")
    print(f"{len(texts)} corpus strings, {len(chats)} chats; tokenizers {tokenizers.__version__}, jinja2 {jinja2.__version__}", file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1] == "--extra":
        extra(sys.argv[2])
    else:
        main(sys.argv[1])
