package server

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
)

func TestClientKey(t *testing.T) {
	for _, tc := range []struct {
		name   string
		header map[string]string
		remote string
		want   string
	}{
		{"bearer token", map[string]string{"Authorization": "Bearer sk-abc"}, "10.0.0.1:5555", "key:" + hashKey("sk-abc")},
		{"bearer is case-insensitive", map[string]string{"Authorization": "bearer sk-abc"}, "10.0.0.1:5555", "key:" + hashKey("sk-abc")},
		{"x-api-key", map[string]string{"X-API-Key": "k2"}, "10.0.0.1:5555", "key:" + hashKey("k2")},
		{"bearer wins over x-api-key", map[string]string{"Authorization": "Bearer a", "X-API-Key": "b"}, "10.0.0.1:1", "key:" + hashKey("a")},
		{"basic auth is not a key", map[string]string{"Authorization": "Basic dXNlcg=="}, "10.0.0.2:1", "host:10.0.0.2"},
		{"no key: the remote host", nil, "[::1]:4000", "host:::1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := httptest.NewRequest(http.MethodPost, "/generate", nil)
			r.RemoteAddr = tc.remote
			for k, v := range tc.header {
				r.Header.Set(k, v)
			}
			if got := ClientKey(r); got != tc.want {
				t.Fatalf("ClientKey = %q, want %q", got, tc.want)
			}
		})
	}
}

func hashKey(k string) string {
	r := httptest.NewRequest(http.MethodPost, "/", nil)
	r.Header.Set("X-API-Key", k)
	return ClientKey(r)[len("key:"):]
}

// TestPerClientBounds (issue 23 item 5): one client's requests in flight are bounded (429
// client_too_many_requests with Retry-After) while another client is still admitted, and so are
// the tokens its requests in flight hold (429 client_too_many_tokens); both come back when its
// requests end.
func TestPerClientBounds(t *testing.T) {
	reg := prometheus.NewRegistry()
	adm, err := NewAdmission(AdmissionLimits{MaxInflight: 100, MaxInflightBodyBytes: 1 << 20, MaxBodyBytes: 1 << 20, RetryAfter: 3e9,
		MaxInflightPerClient: 2, MaxClientTokens: 100}, reg)
	if err != nil {
		t.Fatal(err)
	}
	b := &blocker{entered: make(chan int64, 8), release: make(chan struct{})}
	var held []func(bool)
	hold := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Tokens") != "" { // takes tokens from the client's bound, then answers
			var n int64
			_ = json.Unmarshal([]byte(r.Header.Get("X-Tokens")), &n)
			rel, e := adm.HoldClientTokens(r.Context(), &api.Request{InputTokens: n})
			if e != nil {
				writeErr(w, e, nil)
				return
			}
			held = append(held, rel) // handlers of this test run one at a time
			w.WriteHeader(http.StatusOK)
			return
		}
		b.ServeHTTP(w, r)
	})
	srv := httptest.NewServer(adm.Wrap(hold))
	defer srv.Close()
	send := func(key, tokens string) admResult {
		req, _ := http.NewRequest(http.MethodPost, srv.URL, bytes.NewReader([]byte("{}")))
		req.Header.Set("X-API-Key", key)
		if tokens != "" {
			req.Header.Set("X-Tokens", tokens)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Error(err)
			return admResult{}
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		var doc struct {
			Error struct {
				Code string `json:"code"`
			} `json:"error"`
		}
		_ = json.Unmarshal(raw, &doc)
		return admResult{status: resp.StatusCode, code: doc.Error.Code, retryAfter: resp.Header.Get("Retry-After")}
	}
	done := make(chan admResult, 2)
	for i := 0; i < 2; i++ {
		go func() { done <- send("tenant-a", "") }()
		<-b.entered
	}
	if r := send("tenant-a", ""); r.status != 429 || r.code != CodeClientTooManyRequests || r.retryAfter != "3" {
		t.Fatalf("third request of tenant-a: %+v", r)
	}
	if r := send("tenant-b", "60"); r.status != 200 {
		t.Fatalf("tenant-b while tenant-a is at its bound: %+v", r)
	}
	close(b.release)
	for i := 0; i < 2; i++ {
		if r := <-done; r.status != 200 {
			t.Fatalf("tenant-a's held request: %+v", r)
		}
	}
	// Tokens: tenant-b's first request ended but its hold is still taken (60 of 100).
	if r := send("tenant-b", "60"); r.status != 429 || r.code != CodeClientTooManyTokens {
		t.Fatalf("tenant-b past its tokens: %+v", r)
	}
	for _, rel := range held {
		rel(false)
	}
	if r := send("tenant-b", "60"); r.status != 200 {
		t.Fatalf("tenant-b after its tokens came back: %+v", r)
	}
	held[len(held)-1](false)
	if n := testutil.ToFloat64(adm.clients.rejected.WithLabelValues(CodeClientTooManyRequests)); n != 1 {
		t.Fatalf("client_too_many_requests counted %v", n)
	}
	if n := testutil.ToFloat64(adm.clients.active); n != 0 {
		t.Fatalf("%v clients still tracked after every request ended", n)
	}
}

// TestAbortedRequestsStayCharged (issue 23 item 5): an aborted request's tokens stay charged to
// its client and leak out at the configured rate, so a client that aborts its streams at once
// cannot start new ones at an unbounded rate; an answered request's tokens come back at once.
func TestAbortedRequestsStayCharged(t *testing.T) {
	now := time.Unix(1000, 0)
	c := newClients(0, 100, 10) // 100 tokens, leaking 10 per second
	c.now = func() time.Time { return now }
	run := func(n int64, aborted bool) *api.Error {
		if e := c.enter("a"); e != nil {
			return e
		}
		defer c.leave("a")
		rel, e := c.hold("a", n)
		if e != nil {
			return e
		}
		rel(aborted)
		return nil
	}
	steps := []struct {
		name    string
		advance time.Duration
		n       int64
		aborted bool
		refused bool
	}{
		{"answered", 0, 60, false, false},
		{"answered again: nothing left charged", 0, 60, false, false},
		{"aborted", 0, 60, true, false},
		{"60 still charged", 0, 60, false, true},
		{"3 s later: 30 charged", 3 * time.Second, 60, false, false},
		{"6 s later: all leaked out", 3 * time.Second, 100, false, false},
		{"one request over the bound by itself", 0, 101, false, true},
	}
	for _, st := range steps {
		now = now.Add(st.advance)
		e := run(st.n, st.aborted)
		if (e != nil) != st.refused || (e != nil && e.Code != CodeClientTooManyTokens) {
			t.Fatalf("%s: %v, want refused %v", st.name, e, st.refused)
		}
		if e != nil && (e.Status == http.StatusRequestEntityTooLarge) != (st.n > 100) {
			t.Fatalf("%s: status %d (413 only for a request over the bound by itself)", st.name, e.Status)
		}
	}
	c.mu.Lock()
	n := len(c.m)
	c.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d clients still tracked after everything leaked out", n)
	}
}
