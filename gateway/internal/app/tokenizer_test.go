package app

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvcentric/kvcentric/gateway/internal/config"
)

// TestBadTokenizerIsAStartupError: a missing path, a folder without tokenizer.json and a
// corrupt tokenizer.json stop the gateway before it serves, with an error naming the path
// (ErrStartup: the command exits 2).
func TestBadTokenizerIsAStartupError(t *testing.T) {
	dir := t.TempDir()
	corrupt := filepath.Join(dir, "corrupt")
	if err := os.MkdirAll(corrupt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(corrupt, "tokenizer.json"), []byte(`{"model": {"type": "BPE", "vocab": `), 0o644); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.MkdirAll(empty, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, path := range map[string]string{
		"missing path":            filepath.Join(dir, "nope"),
		"folder without the file": empty,
		"corrupt tokenizer.json":  corrupt,
	} {
		t.Run(name, func(t *testing.T) {
			cfg, err := config.Parse([]string{"--http-addr", "127.0.0.1:0", "--prefill-urls", "http://127.0.0.1:1", "--decode-urls", "http://127.0.0.1:2", "--tokenizer", path}, func(string) string { return "" }, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			err = Run(context.Background(), cfg, io.Discard)
			if !errors.Is(err, ErrStartup) || !strings.Contains(err.Error(), "--tokenizer") || !strings.Contains(err.Error(), dir) {
				t.Fatalf("err = %v, want a start-up error naming --tokenizer and the path", err)
			}
		})
	}
}
