package tokenizer

import (
	"bufio"
	"compress/gzip"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// models are the committed test tokenizers (testdata/<name>/tokenizer.json.gz + config).
var models = []string{"qwen3", "deepseek-v4"}

var (
	loadedMu sync.Mutex
	loaded   = map[string]*Tokenizer{}
)

// modelDir unpacks testdata/<name> into a temporary folder laid out as a model folder.
func modelDir(tb testing.TB, name string) string {
	tb.Helper()
	dir := tb.TempDir()
	src := filepath.Join("testdata", name)
	f, err := os.Open(filepath.Join(src, "tokenizer.json.gz"))
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		tb.Fatal(err)
	}
	out, err := os.Create(filepath.Join(dir, TokenizerFile))
	if err != nil {
		tb.Fatal(err)
	}
	if _, err := io.Copy(out, zr); err != nil {
		tb.Fatal(err)
	}
	if err := out.Close(); err != nil {
		tb.Fatal(err)
	}
	cfg, err := os.ReadFile(filepath.Join(src, ConfigFile))
	if err != nil {
		tb.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, ConfigFile), cfg, 0o644); err != nil {
		tb.Fatal(err)
	}
	return dir
}

// model loads (once per test binary) a committed test tokenizer.
func model(tb testing.TB, name string) *Tokenizer {
	tb.Helper()
	loadedMu.Lock()
	defer loadedMu.Unlock()
	if t, ok := loaded[name]; ok {
		return t
	}
	t, err := Load(modelDir(tb, name))
	if err != nil {
		tb.Fatalf("load %s: %v", name, err)
	}
	loaded[name] = t
	return t
}

// readJSONL decodes every line of a JSON-lines file into a fresh T.
func readJSONL[T any](tb testing.TB, path string) []T {
	tb.Helper()
	f, err := os.Open(path)
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	var out []T
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<24)
	for sc.Scan() {
		var v T
		if err := json.Unmarshal(sc.Bytes(), &v); err != nil {
			tb.Fatalf("%s line %d: %v", path, len(out)+1, err)
		}
		out = append(out, v)
	}
	if err := sc.Err(); err != nil {
		tb.Fatal(err)
	}
	return out
}

type corpusLine struct {
	Text string `json:"text"`
}

type idsLine struct {
	IDs []uint32 `json:"ids"`
}

type chatLine struct {
	Rendered string   `json:"rendered"`
	IDs      []uint32 `json:"ids"`
}

type chatCase struct {
	Messages            []map[string]any `json:"messages"`
	AddGenerationPrompt bool             `json:"add_generation_prompt"`
	EnableThinking      *bool            `json:"enable_thinking"`
}

func corpus(tb testing.TB) []string {
	lines := readJSONL[corpusLine](tb, filepath.Join("testdata", "corpus.jsonl"))
	out := make([]string, len(lines))
	for i, l := range lines {
		out[i] = l.Text
	}
	return out
}
