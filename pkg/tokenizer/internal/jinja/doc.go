// Package jinja is a copy of github.com/ardanlabs/jinja v1.12.0 (Apache License 2.0, see
// LICENSE; Copyright 2026 Ardan Labs), a pure-Go Jinja engine for LLM chat templates.
//
// It is vendored rather than required because v1.12.0 declares `go 1.27` in its go.mod while
// this repository builds with Go 1.26.8, and v1.8.0 (the newest release that declares an older
// Go) ignores str.split's maxsplit argument, which DeepSeek-V3.1's chat template uses
// (`content.split('</think>', 1)[1]`). The source compiles unchanged with Go 1.26.8.
//
// Changes from upstream: this file, and the import path in the two test files. Upstream's
// tests and their template/request fixtures run here as they do upstream. To update, copy
// the same files from a newer release and re-run pkg/tokenizer's parity tests.
package jinja
