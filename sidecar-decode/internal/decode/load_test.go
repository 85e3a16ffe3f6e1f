package decode

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/kvcentric/kvcentric/pkg/kvhints"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func loadCmd(c *kvcv1.LoadSessionCommand) *kvcv1.Command {
	return &kvcv1.Command{Action: &kvcv1.Command_LoadSession{LoadSession: c}}
}

func TestLoadSessionRefusesBadCommands(t *testing.T) {
	good := func() *kvcv1.LoadSessionCommand {
		return &kvcv1.LoadSessionCommand{SessionId: "S", Seqlen: 100, PrefillPeerAddr: "p:1", Room: 7}
	}
	tests := []struct {
		name string
		mod  func(c *kvcv1.LoadSessionCommand)
		want string
	}{
		{"bad session id", func(c *kvcv1.LoadSessionCommand) { c.SessionId = "a/b" }, "session_id"},
		{"no seqlen", func(c *kvcv1.LoadSessionCommand) { c.Seqlen = 0 }, "seqlen"},
		{"no room", func(c *kvcv1.LoadSessionCommand) { c.Room = 0 }, "room"},
		{"room too large", func(c *kvcv1.LoadSessionCommand) { c.Room = 1 << 53 }, "room"},
		{"no peer", func(c *kvcv1.LoadSessionCommand) { c.PrefillPeerAddr = "" }, "prefill_peer_addr"},
		{"negative timeout", func(c *kvcv1.LoadSessionCommand) { c.TimeoutMs = -1 }, "timeout_ms"},
		{"no worker url", func(*kvcv1.LoadSessionCommand) {}, "--worker-url"},
	}
	s := newTestSidecar(t) // no WorkerURL
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := good()
			tc.mod(c)
			err := s.Apply(context.Background(), loadCmd(c))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Apply: %v, want an error naming %q", err, tc.want)
			}
		})
	}
}

// The load is the worker's own client API: open_session, then a zero-output RESEED_SNAPSHOT
// generate of the whole snapshot; LOADED carries the worker's kv_len and verified bytes, a
// refusal LOAD_FAILED with the worker's error.
func TestLoadSessionCallsTheWorker(t *testing.T) {
	ok := `{"meta_info":{"kvc":{"kv_len_after":100,"verified_bytes":6400,"verify_failures":0}}}`
	tests := []struct {
		name     string
		status   int
		answer   string
		commit   bool // the worker commits the session through the bridge before answering
		wantKind kvcv1.SessionEventKind
		detail   string
	}{
		{"loaded", 200, ok, true, kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOADED, "d-1"},
		{"answered without a commit", 200, ok, false, kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOAD_FAILED, "committed 0"},
		{"not a worker's answer", 200, "ok\n", true, kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOAD_FAILED, "generate"},
		{"refused", 409, `{"error":{"code":"transfer_failed","message":"room gone"}}`, false,
			kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOAD_FAILED, "transfer_failed"},
		{"verify failures", 200, `{"meta_info":{"kvc":{"kv_len_after":100,"verify_failures":3}}}`, true,
			kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOAD_FAILED, "verify failures"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			var paths []string
			var gen map[string]any
			s := newTestSidecar(t)
			w := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
				b, _ := io.ReadAll(r.Body)
				mu.Lock()
				paths = append(paths, r.URL.Path)
				if r.URL.Path == "/generate" {
					_ = json.Unmarshal(b, &gen)
				}
				mu.Unlock()
				if r.URL.Path == "/open_session" {
					_, _ = rw.Write([]byte(`"S"`))
					return
				}
				if tc.commit {
					pages := make([]int64, 25) // 100 tokens of pages of 4
					for i := range pages {
						pages[i] = int64(i)
					}
					if _, err := s.CommitSession(context.Background(), &kvcv1.CommitSessionRequest{SessionId: "S", CommittedLen: 100, Pages: pages}); err != nil {
						t.Errorf("commit: %v", err)
					}
				}
				rw.WriteHeader(tc.status)
				_, _ = rw.Write([]byte(tc.answer))
			}))
			defer w.Close()
			s.cfg.WorkerURL = w.URL
			rep := &recordingReporter{}
			s.SetReporter(rep)
			c := &kvcv1.LoadSessionCommand{SessionId: "S", Seqlen: 100, PrefillWorkerId: "p0", PrefillPeerAddr: "p:1", Room: 7, DecisionId: "d-1"}
			s.loadSession(context.Background(), c) // what Apply starts in the background
			ev := rep.kinds(tc.wantKind)["S"]
			if ev == nil || ev.GetRoom() != 7 || !strings.Contains(ev.GetDetail(), tc.detail) {
				t.Fatalf("event %v, want %s with room 7 and detail naming %q (all: %v)", ev, tc.wantKind, tc.detail, rep.evs)
			}
			if tc.wantKind == kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOADED && (ev.GetKvLen() != 100 || ev.GetBytes() != 6400) {
				t.Fatalf("loaded %v", ev)
			}
			mu.Lock()
			defer mu.Unlock()
			if strings.Join(paths, ",") != "/open_session,/generate" {
				t.Fatalf("worker calls %v", paths)
			}
			raw, _ := json.Marshal(gen["kv_hints"])
			p, err := kvhints.Parse(raw)
			r := p.GetReceive()
			if err != nil || r.GetKind() != kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT || r.GetTokens() != 100 || r.GetRoom() != 7 ||
				r.GetPeerAddr() != "p:1" || !p.GetOpenSession() || !p.GetKeepSession() || p.GetInputTokens() != 100 ||
				!p.GetLoad() || gen["sampling_params"].(map[string]any)["max_new_tokens"] != float64(0) ||
				gen["session_params"].(map[string]any)["id"] != "S" {
				t.Fatalf("generate body %v", gen)
			}
		})
	}
}
