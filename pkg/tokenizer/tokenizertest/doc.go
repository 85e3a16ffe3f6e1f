// Package tokenizertest lays out the committed Qwen3 test tokenizer (pkg/tokenizer/testdata) as a model folder, for the tests of every module.
package tokenizertest
