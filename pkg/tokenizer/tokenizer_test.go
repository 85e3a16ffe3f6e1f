package tokenizer

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// A small but complete byte-level BPE tokenizer.json: all 256 bytes, a few merges, one
// added special token, the Qwen2 regex and NFC.
func tinyTokenizerJSON(regex string) string {
	var b strings.Builder
	b.WriteString(`{"version":"1.0","added_tokens":[{"id":300,"content":"<|end|>","special":true,"normalized":false,"lstrip":false,"rstrip":false,"single_word":false}],`)
	b.WriteString(`"normalizer":{"type":"NFC"},"pre_tokenizer":{"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":`)
	b.WriteString(jsonString(regex))
	b.WriteString(`},"behavior":"Isolated","invert":false},{"type":"ByteLevel","add_prefix_space":false,"use_regex":false}]},`)
	b.WriteString(`"post_processor":null,"decoder":{"type":"ByteLevel"},"model":{"type":"BPE","vocab":{`)
	for i := 0; i < 256; i++ {
		b.WriteString(jsonString(string(byteToRune[i])) + ":" + itoa(i) + ",")
	}
	b.WriteString(`"ab":256,"Ġa":257,"abc":258},"merges":["a b","Ġ a","ab c"]}}`)
	return b.String()
}

func itoa(i int) string { return strconv.Itoa(i) }

func jsonString(s string) string {
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`, "\n", `\n`, "\r", `\r`, "\t", `\t`)
	return `"` + r.Replace(s) + `"`
}

func TestTinyTokenizer(t *testing.T) {
	tok, err := FromJSON([]byte(tinyTokenizerJSON(reQwen2)), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		in   string
		want []uint32
	}{
		{"abc", []uint32{258}},
		{"ab", []uint32{256}},
		{" a", []uint32{257}},
		{"abc<|end|>ab", []uint32{258, 300, 256}},
		{"x", []uint32{'x'}},
		{"", nil},
	} {
		if got := tok.Encode(tc.in, true); !slices.Equal(got, tc.want) {
			t.Errorf("Encode(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
	// The newer merges encoding (pairs) loads to the same tokenizer.
	pairs := strings.Replace(tinyTokenizerJSON(reQwen2), `["a b","Ġ a","ab c"]`, `[["a","b"],["Ġ","a"],["ab","c"]]`, 1)
	tok2, err := FromJSON([]byte(pairs), nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := tok2.Encode("abc ab", false); !slices.Equal(got, []uint32{258, 32, 256}) {
		t.Errorf("pair merges: %v", got)
	}
	if tok.HasChatTemplate() {
		t.Error("no config, yet a chat template")
	}
	if _, err := tok.ApplyChatTemplate(nil, ChatOptions{}); !errors.Is(err, ErrNoChatTemplate) {
		t.Errorf("ApplyChatTemplate without template: %v", err)
	}
	if id, ok := tok.TokenID("<|end|>"); !ok || id != 300 {
		t.Errorf("TokenID(<|end|>) = %d %v", id, ok)
	}
	if id, ok := tok.TokenID("Ġa"); !ok || id != 257 {
		t.Errorf("TokenID(Ġa) = %d %v", id, ok)
	}
}

// TestLoadErrors: every way a tokenizer path can be bad gives a *LoadError of the right class.
func TestLoadErrors(t *testing.T) {
	good := tinyTokenizerJSON(reQwen2)
	cases := []struct {
		name   string
		files  map[string]string // written into a fresh folder; nil: the path does not exist
		target string            // relative path passed to Load ("" = the folder)
		want   error
	}{
		{name: "missing path", files: nil, want: ErrNotFound},
		{name: "folder without tokenizer.json", files: map[string]string{"other.txt": "x"}, want: ErrNotFound},
		{name: "not json", files: map[string]string{TokenizerFile: "PK\x03\x04 this is a zip"}, want: ErrCorrupt},
		{name: "truncated json", files: map[string]string{TokenizerFile: good[:len(good)/2]}, want: ErrCorrupt},
		{name: "no model", files: map[string]string{TokenizerFile: `{"added_tokens":[]}`}, want: ErrCorrupt},
		{name: "empty vocab", files: map[string]string{TokenizerFile: `{"model":{"type":"BPE","vocab":{},"merges":[]}}`}, want: ErrCorrupt},
		{name: "merge outside vocab", files: map[string]string{TokenizerFile: strings.Replace(good, `"a b"`, `"a zz"`, 1)}, want: ErrCorrupt},
		{name: "bad merge shape", files: map[string]string{TokenizerFile: strings.Replace(good, `"a b"`, `"ab"`, 1)}, want: ErrCorrupt},
		{name: "wordpiece model", files: map[string]string{TokenizerFile: strings.Replace(good, `"type":"BPE"`, `"type":"WordPiece"`, 1)}, want: ErrUnsupported},
		{name: "byte fallback (sentencepiece)", files: map[string]string{TokenizerFile: strings.Replace(good, `"type":"BPE"`, `"type":"BPE","byte_fallback":true`, 1)}, want: ErrUnsupported},
		{name: "unknown regex", files: map[string]string{TokenizerFile: tinyTokenizerJSON(`\w+|\s+`)}, want: ErrUnsupported},
		{name: "unknown normalizer", files: map[string]string{TokenizerFile: strings.Replace(good, `{"type":"NFC"}`, `{"type":"Lowercase"}`, 1)}, want: ErrUnsupported},
		{name: "split behavior", files: map[string]string{TokenizerFile: strings.Replace(good, `"Isolated"`, `"Removed"`, 1)}, want: ErrUnsupported},
		{name: "not byte-level", files: map[string]string{TokenizerFile: `{"model":{"type":"BPE","vocab":{"hello":0,"world":1},"merges":[]}}`}, want: ErrUnsupported},
		{name: "corrupt config", files: map[string]string{TokenizerFile: good, ConfigFile: `{"chat_template": 12`}, want: ErrCorrupt},
		{name: "template does not compile", files: map[string]string{TokenizerFile: good, ConfigFile: `{"chat_template": "{% for m in messages %}{{ m.content }"}`}, want: ErrUnsupported},
		{name: "tokenizer.json named directly", files: map[string]string{"tok.json": "nope"}, target: "tok.json", want: ErrCorrupt},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "model")
			if tc.files != nil {
				if err := os.Mkdir(path, 0o755); err != nil {
					t.Fatal(err)
				}
				for n, c := range tc.files {
					if err := os.WriteFile(filepath.Join(path, n), []byte(c), 0o644); err != nil {
						t.Fatal(err)
					}
				}
			}
			if tc.target != "" {
				path = filepath.Join(path, tc.target)
			}
			tok, err := Load(path)
			if err == nil {
				t.Fatalf("Load succeeded (%d ids), want %v", tok.VocabSize(), tc.want)
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("err = %v, want class %v", err, tc.want)
			}
			var le *LoadError
			if !errors.As(err, &le) || le.Path == "" {
				t.Fatalf("err %T %v is not a *LoadError with a path", err, err)
			}
		})
	}
}

// TestLoadGoodTemplate: a folder with both files loads and renders.
func TestLoadGoodTemplate(t *testing.T) {
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, TokenizerFile), []byte(tinyTokenizerJSON(reLlama3)), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := `{"eos_token": {"content": "<|end|>"}, "chat_template": "{% for m in messages %}{{ m.role }}:{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"}`
	if err := os.WriteFile(filepath.Join(dir, ConfigFile), []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	tok, err := Load(filepath.Join(dir, TokenizerFile))
	if err != nil {
		t.Fatal(err)
	}
	got, err := tok.ApplyChatTemplate([]Message{{Role: "user", Content: "hi"}}, ChatOptions{AddGenerationPrompt: true})
	if err != nil || got != "user:hi<|end|>assistant:" {
		t.Fatalf("got %q, %v", got, err)
	}
	// A template that raises is an ErrTemplate at render time.
	bad := `{"chat_template": "{{ raise_exception('no system role') }}"}`
	if err := os.WriteFile(filepath.Join(dir, ConfigFile), []byte(bad), 0o644); err != nil {
		t.Fatal(err)
	}
	tok, err = Load(dir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tok.ApplyChatTemplate(nil, ChatOptions{}); !errors.Is(err, ErrTemplate) {
		t.Fatalf("raise_exception: %v", err)
	}
}

// TestDecodeRoundTrip: Decode(Encode(s)) is the normalized s for every corpus string.
func TestDecodeRoundTrip(t *testing.T) {
	for _, name := range models {
		tok := model(t, name)
		for _, s := range corpus(t) {
			want := tok.norm.apply(s) // NFC as HF applies it (see normalize.go)
			if got := tok.Decode(tok.Encode(s, false), false); got != want {
				t.Fatalf("%s: Decode(Encode(%q)) = %q", name, s, got)
			}
		}
	}
	tok := model(t, "qwen3")
	ids := tok.Encode("<|im_start|>user\nhi<|im_end|>", false)
	if got := tok.Decode(ids, true); got != "user\nhi" {
		t.Fatalf("skip special: %q", got)
	}
}

// TestConcurrentEncode: one tokenizer shared by goroutines (run with -race) gives the same ids.
func TestConcurrentEncode(t *testing.T) {
	tok := model(t, "qwen3")
	texts := corpus(t)
	want := make([][]uint32, len(texts))
	for i, s := range texts {
		want[i] = tok.Encode(s, false)
	}
	var wg sync.WaitGroup
	errs := make(chan string, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for k := range texts {
				i := (k*7 + g*13) % len(texts)
				if got := tok.Encode(texts[i], false); !slices.Equal(got, want[i]) {
					errs <- texts[i]
					return
				}
				if n := tok.Count(texts[i], false); n != len(want[i]) {
					errs <- "count " + texts[i]
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Errorf("concurrent encode differs for %q", e)
	}
}

// TestCacheBound: the word cache never holds more than cacheMax pieces.
func TestCacheBound(t *testing.T) {
	old := cacheMax
	cacheMax = 5000
	defer func() { cacheMax = old }()
	tok, err := FromJSON([]byte(tinyTokenizerJSON(reQwen2)), nil)
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for i := 0; i < 40000; i++ {
		b.WriteString(" w")
		b.WriteString(itoa(i * 7919 % 100003))
		b.WriteString("x")
	}
	_ = tok.Encode(b.String(), false)
	c := &tok.model.cache
	n := int(c.count.Load())
	if f := c.frozen.Load(); f != nil {
		n += len(*f)
	}
	if n > int(cacheMax) {
		t.Fatalf("cache holds %d pieces, bound %d", n, cacheMax)
	}
}

// TestChatTemplateJSONErrors: bad client JSON is an ErrTemplate, never a panic.
func TestChatTemplateJSONErrors(t *testing.T) {
	tok := model(t, "qwen3")
	deep := strings.Repeat("[", 200) + strings.Repeat("]", 200)
	for name, raw := range map[string]string{
		"not json":     `{"role": `,
		"object":       `{"role": "user", "content": "x"}`,
		"trailing":     `[{"role": "user", "content": "x"}] []`,
		"deep nesting": deep,
		"empty":        ``,
	} {
		if _, err := tok.ApplyChatTemplateJSON([]byte(raw), ChatOptions{}); !errors.Is(err, ErrTemplate) {
			t.Errorf("%s: %v", name, err)
		}
	}
	if _, err := tok.ApplyChatTemplateJSON([]byte(`[{"role":"user","content":"x"}]`), ChatOptions{ToolsJSON: []byte(`[{`)}); !errors.Is(err, ErrTemplate) {
		t.Errorf("bad tools: %v", err)
	}
	got, err := tok.ApplyChatTemplateJSON([]byte(`[{"role":"user","content":"hi"}]`), ChatOptions{AddGenerationPrompt: true})
	if err != nil || got != "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" {
		t.Fatalf("got %q, %v", got, err)
	}
}
