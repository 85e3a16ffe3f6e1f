package tokenizer

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestParityCorpus: ids equal Hugging Face tokenizers' ids on every corpus string, for both
// committed tokenizers (testdata/gen/gen_expected.py wrote the expected ids).
func TestParityCorpus(t *testing.T) {
	texts := corpus(t)
	if len(texts) < 300 {
		t.Fatalf("corpus has %d strings, want >= 300", len(texts))
	}
	for _, name := range models {
		t.Run(name, func(t *testing.T) {
			tok := model(t, name)
			want := readJSONL[idsLine](t, filepath.Join("testdata", name, "expected.jsonl"))
			if len(want) != len(texts) {
				t.Fatalf("%d expected lines for %d corpus strings", len(want), len(texts))
			}
			bad := 0
			for i, text := range texts {
				got := tok.Encode(text, true)
				if !slices.Equal(got, want[i].IDs) {
					bad++
					if bad <= 5 {
						t.Errorf("line %d %q:\n got %v\nwant %v", i+1, text, got, want[i].IDs)
					}
				}
			}
			if bad > 0 {
				t.Fatalf("%d of %d corpus strings differ", bad, len(texts))
			}
		})
	}
}

// TestParityHeapPath runs the corpus again with every word merged through the heap, so both
// merge paths are held to HF's ids.
func TestParityHeapPath(t *testing.T) {
	old := heapThreshold
	heapThreshold = 1
	defer func() { heapThreshold = old }()
	texts := corpus(t)
	for _, name := range models {
		tok := model(t, name)
		want := readJSONL[idsLine](t, filepath.Join("testdata", name, "expected.jsonl"))
		for i, text := range texts {
			if got := tok.Encode(text, true); !slices.Equal(got, want[i].IDs) {
				t.Fatalf("%s line %d %q:\n got %v\nwant %v", name, i+1, text, got, want[i].IDs)
			}
		}
	}
}

// TestParityLlamaCpp checks the Qwen tokenizer against the ids llama.cpp recorded from the
// original Hugging Face Qwen2 tokenizer (an oracle independent of our reconstruction).
func TestParityLlamaCpp(t *testing.T) {
	if n := checkLlamaCpp(t, model(t, "qwen3"), filepath.Join("testdata", "qwen3")); n < 40 {
		t.Fatalf("only %d llama.cpp cases", n)
	}
}

// TestParityChatTemplate: the Qwen3 chat template renders each conversation exactly as
// transformers does, and the rendering encodes to the same ids.
func TestParityChatTemplate(t *testing.T) {
	tok := model(t, "qwen3")
	raw, err := os.ReadFile(filepath.Join("testdata", "chats.json"))
	if err != nil {
		t.Fatal(err)
	}
	var chats []chatCase
	if err := json.Unmarshal(raw, &chats); err != nil {
		t.Fatal(err)
	}
	var rawChats []struct {
		Messages json.RawMessage `json:"messages"`
		Tools    json.RawMessage `json:"tools"`
	}
	if err := json.Unmarshal(raw, &rawChats); err != nil {
		t.Fatal(err)
	}
	want := readJSONL[chatLine](t, filepath.Join("testdata", "qwen3", "chat_expected.jsonl"))
	if len(want) != len(chats) || len(chats) < 24 {
		t.Fatalf("%d chats, %d expected", len(chats), len(want))
	}
	for i, c := range chats {
		opts := ChatOptions{AddGenerationPrompt: c.AddGenerationPrompt}
		if c.EnableThinking != nil {
			opts.Vars = map[string]any{"enable_thinking": *c.EnableThinking}
		}
		// The JSON path (key order kept) must match for every chat; the map path only for
		// chats that print no JSON object (Go maps are unordered).
		jopts := opts
		jopts.ToolsJSON = rawChats[i].Tools
		got, err := tok.ApplyChatTemplateJSON(rawChats[i].Messages, jopts)
		if err != nil {
			t.Fatalf("chat %d: %v", i, err)
		}
		if got != want[i].Rendered {
			t.Errorf("chat %d rendered (JSON):\n got %q\nwant %q", i, got, want[i].Rendered)
			continue
		}
		if len(rawChats[i].Tools) == 0 && !strings.Contains(string(rawChats[i].Messages), `"arguments": {`) {
			viaMaps, err := tok.ApplyChatTemplateMaps(c.Messages, opts)
			if err != nil || viaMaps != got {
				t.Errorf("chat %d rendered (maps): %v\n got %q\nwant %q", i, err, viaMaps, got)
			}
		}
		if ids := tok.Encode(got, false); !slices.Equal(ids, want[i].IDs) {
			t.Errorf("chat %d ids:\n got %v\nwant %v", i, ids, want[i].IDs)
		}
	}
}

// TestChatTemplateTyped renders through the typed Message API (reasoning_content, tool
// calls) and compares with the map-based rendering of the same conversation.
func TestChatTemplateTyped(t *testing.T) {
	tok := model(t, "qwen3")
	reasoning := "Keep it short."
	msgs := []Message{
		{Role: "system", Content: "You are a coding agent."},
		{Role: "user", Content: "Read main.go"},
		{Role: "assistant", ToolCalls: []ToolCall{{Type: "function", Function: struct {
			Name      string `json:"name"`
			Arguments string `json:"arguments"`
		}{Name: "read_file", Arguments: `{"path": "main.go"}`}}}},
		{Role: "tool", Content: "package main\n"},
		{Role: "assistant", Content: "Empty program.", ReasoningContent: &reasoning},
		{Role: "user", Content: "ok"},
	}
	got, err := tok.ApplyChatTemplate(msgs, ChatOptions{AddGenerationPrompt: true})
	if err != nil {
		t.Fatal(err)
	}
	want := "<|im_start|>system\nYou are a coding agent.<|im_end|>\n<|im_start|>user\nRead main.go<|im_end|>\n" +
		"<|im_start|>assistant\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"main.go\"}}\n</tool_call><|im_end|>\n" +
		"<|im_start|>user\n<tool_response>\npackage main\n\n</tool_response><|im_end|>\n" +
		"<|im_start|>assistant\nEmpty program.<|im_end|>\n<|im_start|>user\nok<|im_end|>\n<|im_start|>assistant\n"
	if got != want {
		t.Fatalf("got  %q\nwant %q", got, want)
	}
}
