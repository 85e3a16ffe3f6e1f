// Package tokenizer encodes text into token ids exactly as Hugging Face `tokenizers` does for
// byte-level BPE models (Qwen2/Qwen3, Llama-3, DeepSeek, GPT-2 style), and renders the model's
// Jinja chat template (tokenizer_config.json `chat_template`) for OpenAI-style messages.
//
// It is pure Go (the binaries are built with CGO_ENABLED=0). A model is loaded from a folder
// holding tokenizer.json (and, for the chat template and special tokens, tokenizer_config.json):
//
//	tok, err := tokenizer.Load("/models/qwen3")
//	ids := tok.Encode(prompt, false)
//
// The pre-tokenizer regexes of these models use a lookahead (`\s+(?!\S)`) that Go's RE2 cannot
// express, so each known pattern has a hand-written splitter with the same leftmost-first
// semantics (see pretok.go); a tokenizer.json with a pattern or component this package does not
// know is refused at load time with ErrUnsupported rather than encoded approximately.
//
// Errors from Load are *LoadError values; errors.Is(err, ErrNotFound | ErrCorrupt |
// ErrUnsupported) tells the class. A loaded *Tokenizer is immutable and safe for concurrent use.
//
// Parity with Hugging Face `tokenizers` is tested on a committed corpus (testdata/) for the
// DeepSeek-V4 and Qwen3 tokenizers; docs/tokenization.md describes the choices and the figures.
package tokenizer
