package tokenizer

import (
	"encoding/json"
	"os"
	"slices"
	"strings"
	"testing"
)

// TestParityRandom is a differential check against HF on random strings across Unicode
// (testdata/gen/gen_random.py writes them with HF's ids; not committed, ~40 MB for 20,000).
// Run: python testdata/gen/gen_random.py testdata /tmp/kvc-random.jsonl &&
// KVC_TOKENIZER_RANDOM=/tmp/kvc-random.jsonl go test -run ParityRandom .
func TestParityRandom(t *testing.T) {
	path := os.Getenv("KVC_TOKENIZER_RANDOM")
	if path == "" {
		t.Skip("KVC_TOKENIZER_RANDOM not set: see this test's comment to generate the random differential set")
	}
	toks := map[string]*Tokenizer{}
	for _, m := range models {
		toks[m] = model(t, m)
	}
	raw, err := os.ReadFile(fileInTestdata("variants.json"))
	if err != nil {
		t.Fatal(err)
	}
	var variants map[string]json.RawMessage
	if err := json.Unmarshal(raw, &variants); err != nil {
		t.Fatal(err)
	}
	for name := range variants {
		if !strings.HasPrefix(name, "_") {
			tok, err := FromJSON(variantJSON(t, name), nil)
			if err != nil {
				t.Fatal(err)
			}
			toks[name] = tok
		}
	}
	lines := readJSONL[map[string]json.RawMessage](t, path)
	bad := map[string]int{}
	for i, l := range lines {
		var text string
		if err := json.Unmarshal(l["text"], &text); err != nil {
			t.Fatal(err)
		}
		for name, tok := range toks {
			var want []uint32
			if err := json.Unmarshal(l[name], &want); err != nil {
				t.Fatalf("line %d %s: %v", i+1, name, err)
			}
			if got := tok.Encode(text, true); !slices.Equal(got, want) {
				bad[name]++
				if bad[name] <= 3 {
					t.Errorf("%s line %d %+q:\n got %v\nwant %v", name, i+1, text, got, want)
				}
			}
		}
	}
	for name, n := range bad {
		t.Errorf("%s: %d of %d random strings differ", name, n, len(lines))
	}
	t.Logf("%d random strings x %d tokenizers", len(lines), len(toks))
}

func fileInTestdata(name string) string { return "testdata/" + name }
