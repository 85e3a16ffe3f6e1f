package tokenizer

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"unicode/utf8"
)

// dsRender renders a conversation in DeepSeek's chat format (the committed DeepSeek
// tokenizer_config.json has no chat template): BOS, system text, <｜User｜>q<｜Assistant｜>a
// <｜end▁of▁sentence｜> per turn, <｜Assistant｜> as the generation prompt.
func dsRender(msgs []Message) string {
	var b strings.Builder
	b.WriteString("<｜begin▁of▁sentence｜>")
	for _, m := range msgs {
		switch m.Role {
		case "system":
			b.WriteString(m.Content)
		case "user":
			b.WriteString("<｜User｜>" + m.Content)
		case "assistant":
			b.WriteString("<｜Assistant｜>" + m.Content + "<｜end▁of▁sentence｜>")
		}
	}
	b.WriteString("<｜Assistant｜>")
	return b.String()
}

// render renders msgs with the model's chat template (Qwen3) or DeepSeek's format.
func renderFor(tb testing.TB, name string, tok *Tokenizer, msgs []Message) string {
	tb.Helper()
	if name == "deepseek-v4" {
		return dsRender(msgs)
	}
	text, err := tok.ApplyChatTemplate(msgs, ChatOptions{AddGenerationPrompt: true})
	if err != nil {
		tb.Fatal(err)
	}
	return text
}

// checkReuse encodes text reusing prev and checks the result against the full encode: ids
// identical, the reused ids decode to a prefix of the bytes text shares with prev.
func checkReuse(tb testing.TB, tok *Tokenizer, text string, prev *Encoded) (*Encoded, int) {
	tb.Helper()
	got, reused := tok.EncodeReuse(text, prev)
	want := tok.Encode(text, false)
	if !slices.Equal(got.IDs, want) {
		i := 0
		for i < min(len(got.IDs), len(want)) && got.IDs[i] == want[i] {
			i++
		}
		tb.Fatalf("EncodeReuse differs from Encode at id %d of %d/%d (reused %d)", i, len(got.IDs), len(want), reused)
	}
	if got.Text != text || reused > len(want) {
		tb.Fatalf("text kept %q, reused %d of %d", got.Text, reused, len(want))
	}
	if reused > 0 {
		// The reused ids are those of a cut of text within the bytes it shares with prev.
		at := -1
		for _, c := range got.cuts {
			if c.ids == reused {
				at = c.at
				break
			}
		}
		if l := commonPrefix(prev.Text, text); at < 0 || at > l {
			tb.Fatalf("reused %d ids: cut at %d, %d bytes shared", reused, at, l)
		}
		if !slices.Equal(tok.Encode(text[:at], false), want[:reused]) {
			tb.Fatalf("reused %d ids are not Encode(text[:%d])", reused, at)
		}
	}
	// The cuts are ascending, start at 0 and end at the text's end with every id.
	if c := got.cuts; len(c) == 0 || c[0] != (encCut{}) || c[len(c)-1] != (encCut{at: len(text), ids: len(want)}) {
		tb.Fatalf("cuts %v", got.cuts)
	}
	for k := 1; k < len(got.cuts); k++ {
		if got.cuts[k].at <= got.cuts[k-1].at || got.cuts[k].ids < got.cuts[k-1].ids {
			tb.Fatalf("cuts not ascending: %v", got.cuts)
		}
	}
	return got, reused
}

// TestEncodeReuseConversations: random multi-turn agent conversations (appended turns, and at a
// rate edited history: an early message changed, reasoning stripped, history compacted)
// encoded turn after turn from the previous turn's encoding give exactly the ids of the full
// encode, for the committed Qwen3 (its real chat template) and DeepSeek tokenizers; appended
// turns reuse the previous prompt, and an edit is never reused past it.
func TestEncodeReuseConversations(t *testing.T) {
	texts := corpus(t)
	for _, name := range models {
		t.Run(name, func(t *testing.T) {
			tok := model(t, name)
			rng := rand.New(rand.NewPCG(7, uint64(len(name))))
			pick := func() string { return texts[rng.IntN(len(texts))] }
			var appended, reusedAppended, edits, tokensReused, tokensTotal int
			for c := 0; c < 12; c++ {
				msgs := []Message{{Role: "system", Content: "You are an agent. " + pick()}}
				var prev *Encoded
				for turn := 0; turn < 10; turn++ {
					edited := -1
					switch r := rng.IntN(10); {
					case r == 0 && len(msgs) > 2: // edit an early message
						edited = 1 + rng.IntN(len(msgs)-1)
						msgs[edited].Content = pick() + " (edited)"
					case r == 1 && len(msgs) > 4: // compaction: drop old turns
						msgs = append(msgs[:1], msgs[3:]...)
						edited = 1
					}
					msgs = append(msgs, Message{Role: "assistant", Content: pick()}, Message{Role: "user", Content: pick()})
					if turn == 0 {
						msgs = msgs[:len(msgs)-2]
						msgs = append(msgs, Message{Role: "user", Content: pick()})
					}
					text := renderFor(t, name, tok, msgs)
					var prevText string
					if prev != nil {
						prevText = prev.Text
					}
					enc, reused := checkReuse(t, tok, text, prev)
					tokensReused += reused
					tokensTotal += len(enc.IDs)
					if edited >= 0 {
						edits++
						// Nothing of the edited message (or after it) comes from the cache: the
						// reused ids decode to text before the first changed byte.
						l := commonPrefix(prevText, text)
						if at := reusedBytes(enc, reused); at > l {
							t.Fatalf("edited message %d: reused %d bytes past the %d unchanged", edited, at, l)
						}
					} else if prev != nil {
						appended++
						if reused > 0 {
							reusedAppended++
						}
					}
					prev = enc
				}
			}
			if appended == 0 || edits == 0 {
				t.Fatalf("%d appended turns, %d edits: the test did not exercise both", appended, edits)
			}
			if name == "qwen3" && reusedAppended != appended {
				t.Fatalf("qwen3: %d of %d appended turns reused the previous prompt", reusedAppended, appended)
			}
			t.Logf("%s: %d appended turns (%d reused), %d edited, %.0f%% of tokens reused", name, appended, reusedAppended, edits, 100*float64(tokensReused)/float64(tokensTotal))
		})
	}
}

// TestEncodeReuseEdges: the cuts that must not be used, table-driven — prev ends inside an
// added token, the new text grows an added token across prev's end, identical, shorter,
// unrelated and empty texts, and added tokens with lstrip/rstrip that move a boundary.
func TestEncodeReuseEdges(t *testing.T) {
	qwen := model(t, "qwen3")
	strip := strings.Replace(tinyTokenizerJSON(reQwen2), `"lstrip":false,"rstrip":false`, `"lstrip":true,"rstrip":true`, 1)
	tiny, err := FromJSON([]byte(strip), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name       string
		tok        *Tokenizer
		prev, text string
		wantReuse  int // -1: any
	}{
		{"nil prev", qwen, "", "<|im_start|>user\nhi<|im_end|>", 0},
		{"empty text", qwen, "<|im_start|>user\nhi", "", 0},
		{"both empty", qwen, "", "", 0},
		{"identical", qwen, "<|im_start|>user\nhi<|im_end|>\n", "<|im_start|>user\nhi<|im_end|>\n", -1},
		{"prev ends inside an added token", qwen, "abc<|im_st", "abc<|im_start|>x", 0},
		{"prev ends mid-word", qwen, "<|im_start|>user\nhel", "<|im_start|>user\nhello", 1},
		{"new text is shorter", qwen, "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", "<|im_start|>user\nhello<|im_end|>", -1},
		{"unrelated", qwen, "<|im_start|>user\nA<|im_end|>", "<|im_start|>user\nB<|im_end|>", 1},
		{"first byte differs", qwen, "x<|im_start|>", "y<|im_start|>", 0},
		{"appended turn", qwen, "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n", -1},
		{"rstrip eats spaces after prev's end", tiny, "ab<|end|>", "ab<|end|>  abc", -1},
		{"lstrip eats spaces before an added token", tiny, "ab  ", "ab  <|end|>c", 0},
		{"lstrip: prev's cut moves", tiny, "ab  <|end|>c", "ab  <|end|>cab <|end|> a", -1},
		{"invalid utf-8 tail", qwen, "<|im_start|>\xe4\xbd", "<|im_start|>\xe4\xbd\xa0", 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var prev *Encoded
			if tc.name != "nil prev" {
				prev, _ = checkReuse(t, tc.tok, tc.prev, nil)
			}
			_, reused := checkReuse(t, tc.tok, tc.text, prev)
			if tc.wantReuse >= 0 && reused != tc.wantReuse {
				t.Fatalf("reused %d ids, want %d", reused, tc.wantReuse)
			}
		})
	}
}

// TestEncodeReuseConcurrent: one shared Encoded reused by many goroutines at once (-race):
// every result is exact and the shared one is unchanged.
func TestEncodeReuseConcurrent(t *testing.T) {
	tok := model(t, "qwen3")
	texts := corpus(t)
	var msgs []Message
	for i := 0; i < 20; i++ {
		msgs = append(msgs, Message{Role: "user", Content: texts[i%len(texts)]}, Message{Role: "assistant", Content: texts[(i+7)%len(texts)]})
	}
	base, _ := tok.EncodeReuse(renderFor(t, "qwen3", tok, msgs), nil)
	snapshot := slices.Clone(base.IDs)
	var wg sync.WaitGroup
	errs := make(chan string, 16)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 5; i++ {
				m := append(slices.Clone(msgs), Message{Role: "user", Content: fmt.Sprintf("goroutine %d turn %d: %s", g, i, texts[(g*5+i)%len(texts)])})
				text := renderFor(t, "qwen3", tok, m)
				got, reused := tok.EncodeReuse(text, base)
				if !slices.Equal(got.IDs, tok.Encode(text, false)) || reused == 0 {
					errs <- fmt.Sprintf("goroutine %d turn %d: reused %d, ids differ", g, i, reused)
					return
				}
				got.IDs[0]++ // the result does not alias base
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
	if !slices.Equal(base.IDs, snapshot) {
		t.Fatal("a reuse modified the shared Encoded")
	}
}

// FuzzEncodeReuse: for any two texts (and the second appended to the first), encoding the
// second from the first's encoding is exactly the full encode, for both committed tokenizers.
func FuzzEncodeReuse(f *testing.F) {
	for _, s := range [][2]string{
		{"<|im_start|>user\nhi<|im_end|>\n", "<|im_start|>assistant\nok<|im_end|>"},
		{"abc<|im_st", "art|>x"},
		{"<｜begin▁of▁sentence｜>sys<｜User｜>q<｜Assistant｜>a<｜end▁of▁sentence｜>", "<｜User｜>q2"},
		{"你好 ", " 123456 🦙"},
		{"e", "\u0301'S 'll"},
	} {
		f.Add(s[0], s[1], uint8(0))
	}
	toks := []*Tokenizer{model(f, "qwen3"), model(f, "deepseek-v4")}
	f.Fuzz(func(t *testing.T, a, b string, cut uint8) {
		if !utf8.ValidString(a) || !utf8.ValidString(b) {
			return
		}
		for _, tok := range toks {
			prev, _ := checkReuse(t, tok, a, nil)
			checkReuse(t, tok, a+b, prev)
			checkReuse(t, tok, b, prev)
			// An edit inside a: the text shares only a's first bytes.
			if k := int(cut) % (len(a) + 1); k < len(a) {
				checkReuse(t, tok, a[:k]+"<|im_end|>"+b+a[k:], prev)
			}
		}
	})
}

// reusedBytes is the byte offset of the cut where the reused ids end.
func reusedBytes(e *Encoded, reused int) int {
	for _, c := range e.cuts {
		if c.ids == reused {
			return c.at
		}
	}
	return len(e.Text)
}
