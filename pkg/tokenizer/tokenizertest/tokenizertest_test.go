package tokenizertest

import (
	"path/filepath"
	"testing"

	"go.uber.org/goleak"

	"github.com/kvcentric/kvcentric/pkg/tokenizer"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestQwen3DirLoads: the folder Qwen3Dir writes is a model folder tokenizer.Load reads, with
// its chat template, and it encodes text.
func TestQwen3DirLoads(t *testing.T) {
	dir, err := Qwen3Dir(filepath.Join(t.TempDir(), "qwen3"))
	if err != nil {
		t.Fatal(err)
	}
	tok, err := tokenizer.Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !tok.HasChatTemplate() {
		t.Fatal("no chat template in the Qwen3 folder")
	}
	if ids := tok.Encode("hello world", false); len(ids) == 0 {
		t.Fatal("Encode gave no ids")
	}
}
