package tokenizer

import (
	"errors"
	"slices"
	"testing"
	"unicode/utf8"
)

// FuzzEncode: for any valid UTF-8 text, both merge paths agree, Count matches, and decoding
// gives back the normalized text (nothing dropped, nothing invented).
func FuzzEncode(f *testing.F) {
	for _, s := range []string{"", "hello world", "  x\n\n y", "<|im_start|>a<|im_end|>", "你好 🦙 123456", "e\u0301'S 'll"} {
		f.Add(s)
	}
	tok := model(f, "qwen3")
	ds := model(f, "deepseek-v4")
	f.Fuzz(func(t *testing.T, s string) {
		if !utf8.ValidString(s) {
			return
		}
		for _, tk := range []*Tokenizer{tok, ds} {
			ids := tk.Encode(s, false)
			if n := tk.Count(s, false); n != len(ids) {
				t.Fatalf("Count %d, Encode %d", n, len(ids))
			}
			want := tk.norm.apply(s)
			if got := tk.Decode(ids, false); got != want {
				t.Fatalf("Decode(Encode(%q)) = %q", s, got)
			}
		}
		old, oldMax := heapThreshold, cacheMax
		heapThreshold, cacheMax = 1, 0
		heapIDs := tok.Encode(s, false)
		heapThreshold, cacheMax = old, oldMax
		if scan := tok.Encode(s, false); !slices.Equal(scan, heapIDs) {
			t.Fatalf("%q: scan %v, heap %v", s, scan, heapIDs)
		}
	})
}

// FuzzFromJSON: arbitrary bytes as tokenizer.json never panic; they load or fail with a
// classified *LoadError.
func FuzzFromJSON(f *testing.F) {
	f.Add([]byte(tinyTokenizerJSON(reQwen2)), []byte(`{"chat_template":"{{ messages }}"}`))
	f.Add([]byte(`{"model":{"type":"BPE","vocab":{"a":0},"merges":["a a"]}}`), []byte(nil))
	f.Add([]byte(`{"model":null}`), []byte(`{"bos_token":{"content":1}}`))
	f.Fuzz(func(t *testing.T, tokJSON, cfgJSON []byte) {
		tok, err := FromJSON(tokJSON, cfgJSON)
		if err != nil {
			var le *LoadError
			if !asLoadError(err, &le) {
				t.Fatalf("unclassified error %T: %v", err, err)
			}
			return
		}
		_ = tok.Encode("hello <|end|> world 123", true)
	})
}

func asLoadError(err error, target **LoadError) bool {
	le, ok := err.(*LoadError)
	if ok {
		*target = le
	}
	return ok
}

// FuzzChatTemplateJSON: arbitrary request JSON renders or fails with ErrTemplate.
func FuzzChatTemplateJSON(f *testing.F) {
	f.Add([]byte(`[{"role":"user","content":"hi"}]`), []byte(`[{"type":"function","function":{"name":"f","parameters":{}}}]`))
	f.Add([]byte(`[{"role":"assistant","content":"","tool_calls":[{"function":{"name":"f","arguments":{"a":1.5}}}]}]`), []byte(nil))
	tok := model(f, "qwen3")
	f.Fuzz(func(t *testing.T, msgs, tools []byte) {
		_, err := tok.ApplyChatTemplateJSON(msgs, ChatOptions{AddGenerationPrompt: true, ToolsJSON: tools})
		if err != nil && !errors.Is(err, ErrTemplate) {
			t.Fatalf("unclassified error: %v", err)
		}
	})
}
