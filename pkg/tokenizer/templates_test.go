package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// TestParityTemplates renders the 24 conversations with six more real chat templates
// (Qwen2.5, QwQ, Qwen3-Coder, Qwen3.5, DeepSeek-V3.1, DeepSeek-R1-Distill-Qwen) and compares
// with transformers' renderings (testdata/gen/gen_templates.py). Where transformers' template
// raises (a system message not first, arguments that are not a mapping), ours must fail too.
func TestParityTemplates(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("testdata", "chats.json"))
	if err != nil {
		t.Fatal(err)
	}
	var chats []struct {
		Messages       json.RawMessage `json:"messages"`
		Tools          json.RawMessage `json:"tools"`
		AddGen         bool            `json:"add_generation_prompt"`
		EnableThinking *bool           `json:"enable_thinking"`
	}
	if err := json.Unmarshal(raw, &chats); err != nil {
		t.Fatal(err)
	}
	type rec struct {
		Template string  `json:"template"`
		Chat     int     `json:"chat"`
		Rendered *string `json:"rendered"`
		Error    string  `json:"error"`
	}
	recs := readJSONL[rec](t, filepath.Join("testdata", "templates", "expected.jsonl"))
	compiled := map[string]*Tokenizer{}
	ok, refused := 0, 0
	for _, r := range recs {
		tk, found := compiled[r.Template]
		if !found {
			src, err := os.ReadFile(filepath.Join("testdata", "templates", r.Template))
			if err != nil {
				t.Fatal(err)
			}
			ct, err := compileTemplate(string(src))
			if err != nil {
				t.Fatalf("%s does not compile: %v", r.Template, err)
			}
			vars := map[string]any{"bos_token": nil, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": nil}
			if r.Template[:8] == "deepseek" {
				vars = map[string]any{"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>", "pad_token": "<｜end▁of▁sentence｜>", "unk_token": nil}
			}
			tk = &Tokenizer{specialVars: vars, chat: ct}
			compiled[r.Template] = tk
		}
		c := chats[r.Chat]
		opts := ChatOptions{AddGenerationPrompt: c.AddGen, ToolsJSON: c.Tools}
		if c.EnableThinking != nil {
			opts.Vars = map[string]any{"enable_thinking": *c.EnableThinking}
		}
		got, err := tk.ApplyChatTemplateJSON(c.Messages, opts)
		switch {
		case r.Rendered == nil && err == nil:
			t.Errorf("%s chat %d: transformers raised %q, we rendered %q", r.Template, r.Chat, r.Error, got)
		case r.Rendered == nil:
			refused++
		case err != nil:
			t.Errorf("%s chat %d: %v", r.Template, r.Chat, err)
		case got != *r.Rendered:
			t.Errorf("%s chat %d:\n got %q\nwant %q", r.Template, r.Chat, got, *r.Rendered)
		default:
			ok++
		}
	}
	t.Logf("%d renderings identical, %d refused by both, of %d", ok, refused, len(recs))
}
