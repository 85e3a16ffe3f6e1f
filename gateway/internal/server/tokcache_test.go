package server

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/workers"
	"github.com/kvcentric/kvcentric/pkg/tokenizer"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// encodedOf encodes text with no previous encoding (its Size is what the cache charges).
func encodedOf(tok *tokenizer.Tokenizer, text string) *tokenizer.Encoded {
	e, _ := tok.EncodeReuse(text, nil)
	return e
}

// TestTokCacheLRU: the cache is bounded by bytes (a chat turn's kept messages included),
// evicts the least recently used session, replaces a session's entry, does not keep an entry
// larger than the bound, and is off at 0.
func TestTokCacheLRU(t *testing.T) {
	tok, _ := qwen3(t)
	a, b, c := encodedOf(tok, "<|im_start|>user\naaaa<|im_end|>"), encodedOf(tok, "<|im_start|>user\nbbbb<|im_end|>"), encodedOf(tok, "<|im_start|>user\ncccc<|im_end|>")
	one := a.Size() + 2 // each key below is 2 bytes
	chat, err := tok.RenderChat([]tokenizer.Message{{Role: "user", Content: "aaaa"}}, tokenizer.ChatOptions{AddGenerationPrompt: true}, nil)
	if err != nil || chat.Size() <= 0 {
		t.Fatalf("render: %v", err)
	}
	withChat := one + chat.Size() // a turn's messages count too
	for _, tc := range []struct {
		name     string
		max      int64
		ops      func(c *tokCache)
		want     []string // sessions present
		wantUsed int64
	}{
		{"off", 0, func(tc *tokCache) { tc.put("s1", a) }, nil, 0},
		{"two fit", 2 * one, func(tc *tokCache) { tc.put("s1", a); tc.put("s2", b) }, []string{"s1", "s2"}, 2 * one},
		{"third evicts the oldest", 2 * one, func(tc *tokCache) { tc.put("s1", a); tc.put("s2", b); tc.put("s3", c) }, []string{"s2", "s3"}, 2 * one},
		{"a get makes it recent", 2 * one, func(tc *tokCache) { tc.put("s1", a); tc.put("s2", b); tc.get("s1"); tc.put("s3", c) }, []string{"s1", "s3"}, 2 * one},
		{"replace keeps one entry", 2 * one, func(tc *tokCache) { tc.put("s1", a); tc.put("s1", b) }, []string{"s1"}, one},
		{"too large is not kept", one - 1, func(tc *tokCache) { tc.put("s1", a) }, nil, 0},
		{"too large replaces and drops", one, func(tc *tokCache) {
			tc.put("s1", a)
			tc.put("s1", encodedOf(tok, "<|im_start|>user\nlonger than the first one<|im_end|>"))
		}, nil, 0},
		{"no session id", 2 * one, func(tc *tokCache) { tc.put("", a) }, nil, 0},
		{"a chat turn counts its messages", withChat + one, func(tc *tokCache) { tc.putTurn("s1", a, chat); tc.put("s2", b) }, []string{"s1", "s2"}, withChat + one},
		{"a chat turn evicts by its size", withChat + one - 1, func(tc *tokCache) { tc.put("s1", a); tc.putTurn("s2", b, chat) }, []string{"s2"}, withChat},
		{"a chat turn replaced by a plain one", 2 * one, func(tc *tokCache) { tc.putTurn("s1", a, chat); tc.put("s1", b) }, []string{"s1"}, one},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cache := newTokCache(tc.max)
			tc.ops(cache)
			n, used := cache.stats()
			if n != len(tc.want) || used != tc.wantUsed {
				t.Fatalf("%d sessions, %d bytes; want %d, %d", n, used, len(tc.want), tc.wantUsed)
			}
			for _, k := range tc.want {
				if cache.get(k) == nil {
					t.Fatalf("session %q evicted", k)
				}
			}
		})
	}
}

// TestTokCacheBytes: the bound comes from the Content (negative: off), else the default.
func TestTokCacheBytes(t *testing.T) {
	for _, tc := range []struct{ configured, want int64 }{
		{0, DefaultTokenizeCacheBytes}, {4096, 4096}, {-1, -1},
	} {
		if got := tokCacheBytes(tc.configured); got != tc.want {
			t.Errorf("configured %d: %d, want %d", tc.configured, got, tc.want)
		}
	}
}

// agentTurns is a session's conversation growing turn by turn; edit changes its first user
// message (an agent framework rewriting history).
type agentTurns struct{ msgs []tokenizer.Message }

func (a *agentTurns) next(session string, turn int, edit bool) []tokenizer.Message {
	if len(a.msgs) == 0 {
		a.msgs = []tokenizer.Message{{Role: "system", Content: "You are a coding agent in a Go repository."}}
	}
	if edit && len(a.msgs) > 2 {
		a.msgs[1].Content = fmt.Sprintf("(compacted by the agent at turn %d)", turn)
	}
	if turn > 0 {
		a.msgs = append(a.msgs, tokenizer.Message{Role: "assistant", Content: fmt.Sprintf("%s answer %d: `go test -race ./...` passes; 表驱动 tests added.", session, turn)})
	}
	a.msgs = append(a.msgs, tokenizer.Message{Role: "user", Content: fmt.Sprintf("%s step %d: now read internal/server/exec.go and fix classify().", session, turn)})
	return slices.Clone(a.msgs)
}

// TestIncrementalTokenizationHTTP: through the gateway's HTTP API with the Qwen3 tokenizer and
// the cache on, a session's turns (appended, then an early message edited, then appended
// again) reach the worker as exactly the full encode of the chat template's rendering; the
// cache holds the session's last rendering. With the cache off the ids are the same.
func TestIncrementalTokenizationHTTP(t *testing.T) {
	tok, _ := qwen3(t)
	for _, cacheBytes := range []int64{1 << 20, -1} {
		t.Run(fmt.Sprintf("cache=%d", cacheBytes), func(t *testing.T) {
			dw := newIDsWorker(t, []int64{1})
			rr := &recRouter{decision: func(q *kvcv1.RouteQuery) *kvcv1.RouteDecision {
				return &kvcv1.RouteDecision{DecisionId: "d", Mode: kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D,
					Decode:    &kvcv1.WorkerRef{WorkerId: "d0", WorkerUrl: dw.URL},
					Execution: &kvcv1.RouteExecution{CallDecode: true, KeepSession: true}}
			}}
			content := &Content{Tok: tok, PageSize: 16, TokenizeCacheBytes: cacheBytes}
			m := NewMetrics(prometheus.NewRegistry())
			s := New(rr, workers.NewPool(nil, nil), Options{RequestTimeout: 10 * time.Second, ConnectTimeout: time.Second, MaxBodyBytes: 1 << 20,
				Parse: api.Options{RequireSession: true, DefaultMaxTok: 4}, Content: content}, zerolog.Nop(), m)
			mux := http.NewServeMux()
			s.Register(mux)
			gw := httptest.NewServer(mux)
			defer gw.Close()

			var conv agentTurns
			for turn := 0; turn < 6; turn++ {
				msgs := conv.next("s-http", turn, turn == 3)
				raw, _ := json.Marshal(map[string]any{"model": "qwen3", "max_tokens": 1, "messages": msgs})
				req, _ := http.NewRequest(http.MethodPost, gw.URL+"/v1/chat/completions", bytes.NewReader(raw))
				req.Header.Set("X-Session-ID", "s-http")
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					t.Fatalf("turn %d: status %d", turn, resp.StatusCode)
				}
				text, err := tok.ApplyChatTemplate(msgs, tokenizer.ChatOptions{AddGenerationPrompt: true})
				if err != nil {
					t.Fatal(err)
				}
				want := tok.Encode(text, false)
				dw.mu.Lock()
				got := dw.body["input_ids"].([]any)
				dw.mu.Unlock()
				if len(got) != len(want) {
					t.Fatalf("turn %d: %d ids, want %d", turn, len(got), len(want))
				}
				for i := range want {
					if int64(got[i].(float64)) != int64(want[i]) {
						t.Fatalf("turn %d: id %d is %v, want %d", turn, i, got[i], want[i])
					}
				}
				cached, chat := content.cache.getTurn("s-http")
				if (cacheBytes > 0) != (cached != nil) || (cached != nil && (cached.Text != text || chat == nil || chat.Text != text)) {
					t.Fatalf("turn %d: cache holds %v", turn, cached != nil)
				}
			}
			// Turn 0 and the edited turn 3 render in full; the others only from the last question on.
			inc, full := testutil.ToFloat64(m.ChatRenders.WithLabelValues("incremental")), testutil.ToFloat64(m.ChatRenders.WithLabelValues("full"))
			if want := map[bool][2]float64{true: {4, 2}, false: {0, 0}}[cacheBytes > 0]; inc != want[0] || full != want[1] {
				t.Fatalf("chat renders: %v incremental, %v full; want %v", inc, full, want)
			}
		})
	}
}

// TestIncrementalTokenizationConcurrent: many sessions' turns prepared at once, several
// goroutines per session (-race), against a cache small enough to evict: every request's ids
// are exactly the full encode, and the cache stays within its bound.
func TestIncrementalTokenizationConcurrent(t *testing.T) {
	tok, _ := qwen3(t)
	const bound = 16 << 10
	content := &Content{Tok: tok, TokenizeCacheBytes: bound}
	m := NewMetrics(prometheus.NewRegistry())
	s := New(&recRouter{}, workers.NewPool(nil, nil), Options{Content: content}, zerolog.Nop(), m)
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := 0; g < 12; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			session := fmt.Sprintf("s%d", g%4) // three goroutines share each session
			var conv agentTurns
			for turn := 0; turn < 8; turn++ {
				msgs := conv.next(session, turn, turn == 5 && g%2 == 0)
				req := &api.Request{Kind: api.Chat, SessionID: session, Messages: msgs, Estimated: true, InputTokens: 1}
				release, perr := s.prepare(context.Background(), req)
				release()
				if perr != nil {
					errs <- fmt.Errorf("prepare: %v", perr.Message)
					return
				}
				text, _ := tok.ApplyChatTemplate(msgs, tokenizer.ChatOptions{AddGenerationPrompt: true})
				want := tok.Encode(text, false)
				if len(req.InputIDs) != len(want) || req.InputTokens != int64(len(want)) {
					errs <- fmt.Errorf("%s turn %d: %d ids, want %d", session, turn, len(req.InputIDs), len(want))
					return
				}
				for i := range want {
					if req.InputIDs[i] != int64(want[i]) {
						errs <- fmt.Errorf("%s turn %d: id %d differs", session, turn, i)
						return
					}
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if n, used := content.cache.stats(); n == 0 || used > bound {
		t.Fatalf("cache: %d sessions, %d bytes (bound %d)", n, used, bound)
	}
	if inc := testutil.ToFloat64(m.ChatRenders.WithLabelValues("incremental")); inc == 0 {
		t.Fatal("no turn rendered incrementally")
	}
}
