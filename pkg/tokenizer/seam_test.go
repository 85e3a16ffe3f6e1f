package tokenizer

import (
	"fmt"
	"strings"
	"testing"

	"github.com/kvcentric/kvcentric/pkg/pagehash"
)

// TestChatSeamQwen3 measures the seam every chat turn has with the real Qwen3 template: the
// decode worker holds prompt_k + the ids it generated for answer k; turn k+1's prompt is the
// template's re-rendering of the history (answer k included) re-tokenized. It reports where
// the longest common prefix ends and how many resident tokens cannot be reused, in tokens and
// in 16-token pages, for answers with and without a reasoning block, and asserts that nothing
// before the previous answer is lost.
//
// The "generated" ids are the canonical tokenization of what the model emits; a real model
// may emit a non-canonical split, which can only move the divergence earlier inside the answer.
func TestChatSeamQwen3(t *testing.T) {
	tok := model(t, "qwen3")
	h, err := pagehash.New(16, 0)
	if err != nil {
		t.Fatal(err)
	}
	// Answers and questions from the corpus, without special-token text (the template would
	// treat a literal "</think>" in an answer as a reasoning block).
	var texts []string
	for _, s := range corpus(t) {
		if s != "" && !strings.Contains(s, "<|") && !strings.Contains(s, "think>") && !strings.Contains(s, "tool_") && !strings.Contains(s, "<｜") {
			texts = append(texts, s)
		}
	}
	type stats struct {
		turns, full, inAnswer, atStart, inGenPrompt int
		lostTok, lostPages, answerTok               int
	}
	for _, mode := range []string{"plain", "plain-leading-newline", "thinking", "no-thinking"} {
		var st stats
		for c := 0; c < 30; c++ {
			msgs := []Message{{Role: "system", Content: "You are agent " + fmt.Sprint(c) + ". " + texts[c%len(texts)]}}
			for k := 0; k < 6; k++ {
				msgs = append(msgs, Message{Role: "user", Content: texts[(c*31+k*7+3)%len(texts)] + " ?"})
				opts := ChatOptions{AddGenerationPrompt: true}
				if mode == "no-thinking" {
					opts.Vars = map[string]any{"enable_thinking": false}
				}
				prompt, err := tok.ApplyChatTemplate(msgs, opts)
				if err != nil {
					t.Fatal(err)
				}
				promptIDs := tok.Encode(prompt, false)
				history, err := tok.ApplyChatTemplate(msgs, ChatOptions{Vars: opts.Vars})
				if err != nil {
					t.Fatal(err)
				}
				historyLen := tok.Count(history, false)
				answer := "Answer " + fmt.Sprint(k) + ": " + strings.TrimSpace(texts[(c*17+k*5+1)%len(texts)])
				generated := answer
				switch mode {
				case "thinking":
					generated = "<think>\nThe user asks " + fmt.Sprint(k) + "; I look at the context first.\n</think>\n\n" + answer
				case "plain-leading-newline":
					answer = "\n" + answer
					generated = answer
				}
				resident := append(append([]uint32(nil), promptIDs...), tok.Encode(generated+"<|im_end|>", false)...)
				// The client sends the answer back as the assistant message (the reasoning, if
				// any, inside content as Qwen3 clients do; the template strips it).
				msgs = append(msgs, Message{Role: "assistant", Content: generated})
				next, err := tok.ApplyChatTemplate(append(msgs, Message{Role: "user", Content: "next"}), opts)
				if err != nil {
					t.Fatal(err)
				}
				nextIDs := tok.Encode(next, false)
				lcp := 0
				for lcp < len(resident) && lcp < len(nextIDs) && resident[lcp] == nextIDs[lcp] {
					lcp++
				}
				pages := pagehash.CommonPages(h.Chain(resident), h.Chain(nextIDs))
				st.turns++
				st.answerTok += len(resident) - len(promptIDs)
				switch {
				case lcp == len(resident):
					st.full++
				case lcp > len(promptIDs):
					st.inAnswer++
				case lcp == len(promptIDs):
					st.atStart++
				default:
					st.inGenPrompt++
					if lcp < historyLen {
						t.Errorf("%s chat %d turn %d: prefix lost inside the history (lcp %d, history %d)", mode, c, k, lcp, historyLen)
					}
				}
				st.lostTok += len(resident) - lcp
				st.lostPages += len(resident) - pages*16
			}
		}
		t.Logf("%-22s turns %d: resident reused whole %d; diverges inside the previous answer %d, at its first token %d, "+
			"inside the generation prompt %d; mean generated %d tokens; resident tokens not reusable, mean %.1f (token LCP) / %.1f (16-token pages)",
			mode, st.turns, st.full, st.inAnswer, st.atStart, st.inGenPrompt, st.answerTok/st.turns,
			float64(st.lostTok)/float64(st.turns), float64(st.lostPages)/float64(st.turns))
	}
}
