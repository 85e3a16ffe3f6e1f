package faults

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestLoadSend drives the load generator's request against a real HTTP server that answers
// like the gateway in each case, and checks what the Result records.
func TestLoadSend(t *testing.T) {
	tests := []struct {
		name    string
		handler func(w http.ResponseWriter)
		check   func(t *testing.T, r Result)
	}{
		{"direct to D, complete stream", func(w http.ResponseWriter) {
			h := w.Header()
			h.Set("X-KVC-Mode", "DIRECT_TO_D")
			h.Set("X-KVC-Reason", "SESSION_RESIDENT")
			h.Set("X-KVC-Decode-Worker", "decode-1")
			h.Set("X-KVC-Fail-Open", "false")
			h.Set("X-KVC-Retries", "1")
			fmt.Fprint(w, "data: {\"text\": \"x\"}\n\ndata: [DONE]\n\n")
		}, func(t *testing.T, r Result) {
			if !r.OK || r.Mode != "DIRECT_TO_D" || r.Worker != "decode-1" || r.FailOpen || r.Retries != 1 || r.Status != 200 {
				t.Errorf("got %+v", r)
			}
		}},
		{"retried onto another worker", func(w http.ResponseWriter) {
			h := w.Header()
			h.Set("X-KVC-Mode", "RESEED_SNAPSHOT")
			h.Set("X-KVC-Decode-Worker", "decode-2")
			h.Set("X-KVC-Retries", "2")
			h.Set("X-KVC-Retried-From", "decode-0,decode-1")
			fmt.Fprint(w, "data: {\"text\": \"x\"}\n\ndata: [DONE]\n\n")
		}, func(t *testing.T, r Result) {
			if !r.OK || r.Worker != "decode-2" || r.Retries != 2 || !slices.Equal(r.RetriedFrom, []string{"decode-0", "decode-1"}) {
				t.Errorf("got %+v", r)
			}
		}},
		{"resumed, the continuation retried", func(w http.ResponseWriter) {
			h := w.Header()
			h.Set("Trailer", "X-KVC-Resumed-From, X-KVC-Resumed-Decode-Worker, X-KVC-Resumed-Mode, X-KVC-Resumed-Fail-Open, X-KVC-Resumed-Retried-From")
			h.Set("X-KVC-Mode", "DIRECT_TO_D")
			h.Set("X-KVC-Decode-Worker", "decode-1")
			fmt.Fprint(w, "data: {\"text\": \"x\"}\n\ndata: [DONE]\n\n")
			h.Set("X-KVC-Resumed-From", "decode-1")
			h.Set("X-KVC-Resumed-Decode-Worker", "decode-0")
			h.Set("X-KVC-Resumed-Mode", "RESEED_SNAPSHOT")
			h.Set("X-KVC-Resumed-Fail-Open", "false")
			h.Set("X-KVC-Resumed-Retried-From", "decode-2")
		}, func(t *testing.T, r Result) {
			if !r.OK || r.ResumedFrom != "decode-1" || r.FirstMode != "DIRECT_TO_D" || r.Worker != "decode-0" || r.Mode != "RESEED_SNAPSHOT" ||
				len(r.RetriedFrom) != 0 || !slices.Equal(r.ResumedRetriedFrom, []string{"decode-2"}) {
				t.Errorf("got %+v", r)
			}
		}},
		{"fail-open", func(w http.ResponseWriter) {
			w.Header().Set("X-KVC-Mode", "PD_FALLBACK")
			w.Header().Set("X-KVC-Fail-Open", "true")
			fmt.Fprint(w, "data: [DONE]\n\n")
		}, func(t *testing.T, r Result) {
			if !r.OK || !r.FailOpen {
				t.Errorf("got %+v", r)
			}
		}},
		{"error event after the first token", func(w http.ResponseWriter) {
			w.Header().Set("X-KVC-Mode", "SEED")
			fmt.Fprint(w, "data: {\"text\": \"x\"}\n\ndata: {\"error\": {\"code\": \"transfer_failed\", \"message\": \"m\", \"kind\": \"TRANSFER_FAILED\"}}\n\ndata: [DONE]\n\n")
		}, func(t *testing.T, r Result) {
			if r.OK || !strings.Contains(r.Err, "transfer_failed") || r.Mode != "SEED" {
				t.Errorf("got %+v", r)
			}
		}},
		{"stream cut before [DONE]", func(w http.ResponseWriter) {
			fmt.Fprint(w, "data: {\"text\": \"x\"}\n\n")
		}, func(t *testing.T, r Result) {
			if r.OK || !strings.Contains(r.Err, "without [DONE]") {
				t.Errorf("got %+v", r)
			}
		}},
		{"502 with an error kind", func(w http.ResponseWriter) {
			w.Header().Set("X-KVC-Error-Kind", "WORKER_ERROR")
			w.Header().Set("X-KVC-Retried-From", "decode-1")
			w.Header().Set("X-KVC-Mode", "SEED")
			w.WriteHeader(http.StatusBadGateway)
			fmt.Fprint(w, `{"error": {"code": "no_decode_worker"}}`)
		}, func(t *testing.T, r Result) {
			if r.OK || r.Status != 502 || !strings.Contains(r.Err, "WORKER_ERROR") || !strings.Contains(r.Err, "no_decode_worker") ||
				!slices.Equal(r.RetriedFrom, []string{"decode-1"}) {
				t.Errorf("got %+v", r)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var body map[string]any
			var sid string
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				sid = r.Header.Get("X-Session-ID")
				b, _ := io.ReadAll(r.Body)
				_ = json.Unmarshal(b, &body)
				tc.handler(w)
			}))
			defer srv.Close()
			l := NewLoad(LoadConfig{URL: srv.URL})
			r := l.send(t.Context(), "fs-01-0", 2, "")
			if sid != "fs-01-0" || r.Session != "fs-01-0" || r.Turn != 2 || r.Return.Before(r.Call) {
				t.Errorf("session %q, result %+v", sid, r)
			}
			ids, _ := body["input_ids"].([]any)
			if int64(len(ids)) != inputTokens(2) {
				t.Errorf("%d input ids, want %d", len(ids), inputTokens(2))
			}
			tc.check(t, r)
		})
	}
}

// TestLoadRun checks pacing, session ownership and rollover against a real HTTP server.
func TestLoadRun(t *testing.T) {
	var mu sync.Mutex
	inflight := map[string]bool{}
	overlap := false
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s := r.Header.Get("X-Session-ID")
		mu.Lock()
		if inflight[s] {
			overlap = true
		}
		inflight[s] = true
		mu.Unlock()
		w.Header().Set("X-KVC-Mode", "DIRECT_TO_D")
		fmt.Fprint(w, "data: [DONE]\n\n")
		mu.Lock()
		delete(inflight, s)
		mu.Unlock()
	}))
	defer srv.Close()
	l := NewLoad(LoadConfig{URL: srv.URL, Sessions: 4, Clients: 2, Rate: 200, Turns: 3})
	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	defer cancel()
	l.Run(ctx)
	rs, n := l.Results(0)
	if n == 0 || n > 70 { // 200/s for 0.3 s: at most ~60 (+ the in-flight ones)
		t.Fatalf("%d requests in 0.3 s at 200/s", n)
	}
	if overlap {
		t.Error("two requests of one session overlapped")
	}
	turns := map[string][]int{}
	for _, r := range rs {
		if !r.OK {
			t.Fatalf("failed: %+v", r)
		}
		turns[r.Session] = append(turns[r.Session], r.Turn)
	}
	for s, ts := range turns {
		for i, tn := range ts {
			if tn != i || tn >= 3 {
				t.Fatalf("session %s turns %v: want 0,1,2 in order", s, ts)
			}
		}
	}
	if n >= 12 && len(turns) <= 4 {
		t.Errorf("%d requests over 4 slots of 3 turns but only %d session ids: no rollover", n, len(turns))
	}
}
