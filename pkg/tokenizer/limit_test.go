package tokenizer

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
)

// cancelAfter is a context whose Err turns Canceled on its n-th call: the encoders' checks are
// counted, not timed.
type cancelAfter struct {
	context.Context
	calls, n atomic.Int64
}

func newCancelAfter(n int64) *cancelAfter {
	c := &cancelAfter{Context: context.Background()}
	c.n.Store(n)
	return c
}

func (c *cancelAfter) Err() error {
	if c.calls.Add(1) >= c.n.Load() {
		return context.Canceled
	}
	return nil
}

// TestEncodeContext (issue 23 item 3): the bounded encoders give Encode's ids within their
// limits, stop with a *TokenLimitError past MaxTokens, and stop when the context ends — between
// pieces and inside one long piece's merges — instead of running to the end.
func TestEncodeContext(t *testing.T) {
	tok := model(t, "qwen3")
	text := "Hello, world! The quick brown fox jumps over the lazy dog. <|im_start|>user\nhi<|im_end|>"
	want := tok.Encode(text, true)
	many := strings.Repeat("word ", 50_000)     // 50,000 pieces
	long := strings.Repeat("a", 1<<20)          // one piece of 1 MiB (a run of letters)
	added := strings.Repeat("<|im_end|>", 5000) // added tokens only
	for _, tc := range []struct {
		name    string
		lim     Limit
		text    string
		want    []uint32
		wantErr func(error) bool
	}{
		{"no limit", Limit{}, text, want, nil},
		{"within the limit", Limit{Ctx: context.Background(), MaxTokens: len(want)}, text, want, nil},
		{"one token past the limit", Limit{MaxTokens: len(want) - 1}, text, nil, isLimit(len(want) - 1)},
		{"many pieces past the limit", Limit{MaxTokens: 1000}, many, nil, isLimit(1000)},
		{"added tokens past the limit", Limit{MaxTokens: 1000}, added, nil, isLimit(1000)},
		{"cancelled between pieces", Limit{Ctx: newCancelAfter(3)}, many, nil, isCanceled},
		{"cancelled inside one piece", Limit{Ctx: newCancelAfter(1)}, long, nil, isCanceled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tok.EncodeContext(tc.lim, tc.text, true)
			if tc.wantErr != nil {
				if got != nil || !tc.wantErr(err) {
					t.Fatalf("got %d ids, err %v", len(got), err)
				}
				return
			}
			if err != nil || !equalIDs(got, tc.want) {
				t.Fatalf("got %v, %v; want %v", got, err, tc.want)
			}
			// EncodeReuseContext agrees, from nothing and from a previous encoding.
			enc, _, err := tok.EncodeReuseContext(tc.lim, tc.text, nil)
			if err != nil || !equalIDs(enc.IDs, tok.Encode(tc.text, false)) {
				t.Fatalf("EncodeReuseContext: %v", err)
			}
		})
	}
	prev, _ := tok.EncodeReuse("<|im_start|>user\n"+many, nil)
	if _, _, err := tok.EncodeReuseContext(Limit{MaxTokens: 10}, "<|im_start|>user\n"+many+"more", prev); !isLimit(10)(err) {
		t.Fatalf("reused ids count toward the limit: %v", err)
	}
}

func isLimit(n int) func(error) bool {
	return func(err error) bool {
		var le *TokenLimitError
		return errors.As(err, &le) && le.Limit == n
	}
}

func isCanceled(err error) bool { return errors.Is(err, context.Canceled) }

func equalIDs(a, b []uint32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestPutScratchDropsHugeBuffers: a scratch goes back to the pool without the buffers a huge
// input grew, so that input's memory returns to the runtime.
func TestPutScratchDropsHugeBuffers(t *testing.T) {
	sc := &encodeScratch{pieces: make([]string, 0, maxPooledScratch+1), ids: make([]uint32, 0, 16),
		bpe: scratch{heap: make([]heapItem, 0, maxPooledScratch+1), syms: make([]uint32, 0, 8)}}
	putScratch(sc)
	if sc.pieces != nil || sc.bpe.heap != nil || sc.bpe.syms != nil {
		t.Fatalf("huge buffers kept: pieces %d, heap %d", cap(sc.pieces), cap(sc.bpe.heap))
	}
	if cap(sc.ids) != 16 {
		t.Fatalf("a small buffer was dropped: ids %d", cap(sc.ids))
	}
}
