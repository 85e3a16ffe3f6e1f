package tokenizertest

import (
	"compress/gzip"
	"errors"
	"io"
	"os"
	"path/filepath"
	"runtime"
)

// qwen3Src is pkg/tokenizer/testdata/qwen3, found from this file's own path so that a test of
// any module (whatever its working directory) reaches it.
func qwen3Src() (string, error) {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		return "", errors.New("tokenizertest: no source path (built with -trimpath?)")
	}
	return filepath.Join(filepath.Dir(file), "..", "testdata", "qwen3"), nil
}

// Qwen3Files are the committed Qwen3 tokenizer's tokenizer.json (gunzipped) and
// tokenizer_config.json.
func Qwen3Files() (tokenizerJSON, config []byte, err error) {
	src, err := qwen3Src()
	if err != nil {
		return nil, nil, err
	}
	f, err := os.Open(filepath.Join(src, "tokenizer.json.gz"))
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		return nil, nil, err
	}
	if tokenizerJSON, err = io.ReadAll(zr); err != nil {
		return nil, nil, err
	}
	if config, err = os.ReadFile(filepath.Join(src, "tokenizer_config.json")); err != nil {
		return nil, nil, err
	}
	return tokenizerJSON, config, nil
}

// Qwen3Dir writes the Qwen3 tokenizer into dir (created if missing) as a model folder —
// tokenizer.json and tokenizer_config.json — that tokenizer.Load and the gateway's
// --tokenizer read, and returns dir.
func Qwen3Dir(dir string) (string, error) {
	raw, cfg, err := Qwen3Files()
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json"), raw, 0o644); err != nil {
		return "", err
	}
	return dir, os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), cfg, 0o644)
}
