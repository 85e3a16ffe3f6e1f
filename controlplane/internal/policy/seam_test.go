package policy

import (
	"fmt"
	"strings"
	"testing"

	"github.com/kvcentric/kvcentric/pkg/pagehash"
	"github.com/kvcentric/kvcentric/pkg/tokenizer"
	"github.com/kvcentric/kvcentric/pkg/tokenizer/tokenizertest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func loadQwen3(t *testing.T) *tokenizer.Tokenizer {
	t.Helper()
	raw, cfg, err := tokenizertest.Qwen3Files()
	if err != nil {
		t.Fatal(err)
	}
	tok, err := tokenizer.FromJSON(raw, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// sentences makes n words of agent-like prose and code, deterministic in seed.
func sentences(seed, n int) string {
	words := []string{"the", "worker", "commits", "pages", "of", "session", "KV", "after", "each", "turn;", "func", "pagesFor(n,", "p", "int64)", "int64", "{", "return", "(n", "+", "p", "-", "1)", "/", "p", "}", "\n", "if", "err", "!=", "nil", "{", "return", "err", "}", "\n", "检查", "结果", "—", "done."}
	var b strings.Builder
	x := uint64(seed)*0x9e3779b97f4a7c15 + 1
	for i := 0; i < n; i++ {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		if i > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(words[x%uint64(len(words))])
	}
	return b.String()
}

// TestChatSeamDecisions plays chat conversations through the real Qwen3 template and the
// policy: D holds prompt_k + the ids it generated for answer k (canonical tokenization of what
// the model emitted); turn k+1's prompt is the template's re-rendering of the history plus a new
// user message. For each answer style and page size it reports how often the common prefix
// ends inside the previous answer, what the policy decided, and the resident tokens it did not
// reuse beyond the exact token-level common prefix (page rounding, the sparse chain), and
// asserts that no decision reuses a token past the common prefix and nothing before the
// previous answer is lost.
func TestChatSeamDecisions(t *testing.T) {
	if testing.Short() {
		t.Skip("loads the Qwen3 tokenizer")
	}
	tok := loadQwen3(t)
	for _, ps := range []int{16, 64} {
		h, _ := pagehash.New(ps, 0)
		for _, mode := range []string{"plain", "thinking", "no-thinking"} {
			var turns, inAnswer, inGenPrompt, truncated, direct, reseed int
			var lcpLost, decLost, answerTok int
			for c := 0; c < 12; c++ {
				opts := tokenizer.ChatOptions{AddGenerationPrompt: true}
				if mode == "no-thinking" {
					opts.Vars = map[string]any{"enable_thinking": false}
				}
				msgs := []tokenizer.Message{{Role: "system", Content: "You are coding agent " + fmt.Sprint(c) + ". " + sentences(c, 300)}}
				for k := 0; k < 6; k++ {
					msgs = append(msgs, tokenizer.Message{Role: "user", Content: sentences(c*100+k, 80+40*k) + " ?"})
					prompt, err := tok.ApplyChatTemplate(msgs, opts)
					if err != nil {
						t.Fatal(err)
					}
					promptIDs := tok.Encode(prompt, false)
					answer := "Answer " + fmt.Sprint(k) + ": " + sentences(c*1000+k, 150)
					generated := answer
					if mode == "thinking" {
						generated = "<think>\n" + sentences(c*7000+k, 400) + "\n</think>\n\n" + answer
					}
					genIDs := tok.Encode(generated+"<|im_end|>", false)
					resident := append(append([]uint32(nil), promptIDs...), genIDs...)
					msgs = append(msgs, tokenizer.Message{Role: "assistant", Content: generated})
					next, err := tok.ApplyChatTemplate(append(append([]tokenizer.Message(nil), msgs...), tokenizer.Message{Role: "user", Content: "next " + sentences(k, 30)}), opts)
					if err != nil {
						t.Fatal(err)
					}
					nextIDs := tok.Encode(next, false)
					lcp := 0
					for lcp < len(resident) && lcp < len(nextIDs) && resident[lcp] == nextIDs[lcp] {
						lcp++
					}
					sp, _ := pagehash.NewSparse(SparseTail(int64(ps)), pagehash.DefaultStride)
					sp.Append(h.Chain(resident))
					rec := resident0("d1", int64(len(resident)))
					in := &Input{Knobs: knobs(nil), Query: q(int64(len(nextIDs)), 200, int32(k+1)), Session: rec, Workers: cluster(),
						Ledger: ledger(nil), NowMs: nowMs, Content: &Content{PageSize: int64(ps), Prompt: h.Chain(nextIDs), Resident: sp}}
					d := Decide(in)
					turns++
					answerTok += len(genIDs)
					switch {
					case lcp >= len(promptIDs) && lcp < len(resident):
						inAnswer++
					case lcp < len(promptIDs):
						inGenPrompt++ // in the generation prompt's last tokens
					}
					if lcp < len(promptIDs)-8 {
						t.Fatalf("%s: the common prefix ends %d tokens before the previous answer", mode, len(promptIDs)-lcp)
					}
					reused := d.CachedTokens
					if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D {
						reused = 0
					}
					if reused > int64(lcp) && d.Reason != kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT {
						t.Fatalf("%s: reuses %d tokens past the common prefix %d", mode, reused, lcp)
					}
					switch {
					case d.Reason == kvcv1.RouteReason_ROUTE_REASON_SESSION_RESIDENT:
						direct++ // the full pages match; D checks its partial last page itself
						reused = min(reused, int64(lcp))
					case d.Reason == kvcv1.RouteReason_ROUTE_REASON_PREFIX_TRUNCATED:
						truncated++
					default:
						reseed++
					}
					lcpLost += len(resident) - lcp
					decLost += len(resident) - int(reused)
				}
			}
			t.Logf("page %d, %-11s: %d turns; the common prefix ends inside the previous answer %d, in the generation prompt %d; "+
				"decisions direct %d, truncated %d, reseed %d; resident tokens not reused per turn: %.1f at the exact common prefix, %.1f as decided (generated %.0f tokens)",
				ps, mode, turns, inAnswer, inGenPrompt, direct, truncated, reseed, float64(lcpLost)/float64(turns), float64(decLost)/float64(turns), float64(answerTok)/float64(turns))
		}
	}
}

// resident0 is a session resident on d with kv tokens (content_test's records).
func resident0(d string, kv int64) *kvcv1.SessionRecord { return resident(d, kv) }
