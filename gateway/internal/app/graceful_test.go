package app

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/gateway/internal/config"
)

// streamingWorkers are fail-open P and D workers: P answers at once, D streams its first chunk
// and holds the rest until release is closed.
func streamingWorkers(t *testing.T, release <-chan struct{}) (p, d *httptest.Server) {
	p = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"text":"","meta_info":{"prompt_tokens":1,"completion_tokens":0}}`)
	}))
	d = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		fl := w.(http.Flusher)
		fmt.Fprint(w, "data: {\"text\":\"first\",\"meta_info\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\n")
		fl.Flush()
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		fmt.Fprint(w, "data: {\"text\":\"first last\",\"meta_info\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n")
		fl.Flush()
	}))
	t.Cleanup(p.Close)
	t.Cleanup(d.Close)
	return p, d
}

type started struct {
	HTTPAddr  string `json:"http_addr"`
	AdminAddr string `json:"admin_addr"`
}

func startGateway(t *testing.T, args ...string) (context.CancelFunc, <-chan error, started) {
	t.Helper()
	ready := filepath.Join(t.TempDir(), "ready.json")
	cfg, err := config.Parse(append([]string{"--http-addr", "127.0.0.1:0", "--ready-file", ready}, args...), func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg, io.Discard) }()
	t.Cleanup(cancel)
	var rf started
	deadline := time.Now().Add(10 * time.Second)
	for {
		raw, err := os.ReadFile(ready)
		if err == nil && json.Unmarshal(raw, &rf) == nil && rf.HTTPAddr != "" {
			return cancel, done, rf
		}
		if time.Now().After(deadline) {
			t.Fatal("no ready file")
		}
		time.Sleep(10 * time.Millisecond) // polling a file written by another goroutine
	}
}

func status(url string) int {
	resp, err := http.Get(url)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// openStream starts a streaming /generate and returns its reader after the first chunk.
func openStream(t *testing.T, addr string) (*http.Response, *bufio.Reader) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, "http://"+addr+"/generate", strings.NewReader(`{"text":"hello","stream":true}`))
	req.Header.Set("X-Session-ID", "s-graceful")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("stream: %d %s", resp.StatusCode, b)
	}
	br := bufio.NewReader(resp.Body)
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("first chunk: %v", err)
		}
		if strings.Contains(line, "first") {
			return resp, br
		}
	}
}

// TestGracefulStopWaitsForStream: on stop the gateway turns /readyz not ready first, refuses
// new connections, lets the stream in flight finish, and only then returns; /metrics stays on
// the admin listener and is not on the client port.
func TestGracefulStopWaitsForStream(t *testing.T) {
	release := make(chan struct{})
	p, d := streamingWorkers(t, release)
	cancel, done, rf := startGateway(t, "--admin-addr", "127.0.0.1:0", "--shutdown-grace", "20s",
		"--prefill-urls", p.URL, "--decode-urls", d.URL)
	if rf.AdminAddr == "" {
		t.Fatal("no admin_addr in the ready file")
	}
	if got := status("http://" + rf.HTTPAddr + "/metrics"); got != http.StatusNotFound {
		t.Fatalf("/metrics on the client port: %d, want 404", got)
	}
	for _, path := range []string{"/metrics", "/readyz", "/healthz"} {
		if got := status("http://" + rf.AdminAddr + path); got != 200 {
			t.Fatalf("admin %s: %d", path, got)
		}
	}
	resp, br := openStream(t, rf.HTTPAddr)
	defer resp.Body.Close()

	cancel() // SIGTERM
	deadline := time.Now().Add(10 * time.Second)
	for status("http://"+rf.AdminAddr+"/readyz") != http.StatusServiceUnavailable {
		if time.Now().After(deadline) {
			t.Fatal("/readyz still ready after the stop began")
		}
		time.Sleep(5 * time.Millisecond) // polling another goroutine's state with a deadline
	}
	for {
		c, err := net.DialTimeout("tcp", rf.HTTPAddr, time.Second)
		if err != nil {
			break // the client listener is closed
		}
		c.Close()
		if time.Now().After(deadline) {
			t.Fatal("client listener still accepting during the stop")
		}
		time.Sleep(5 * time.Millisecond)
	}
	select {
	case err := <-done:
		t.Fatalf("Run returned (%v) with a stream in flight", err)
	default:
	}
	close(release)
	rest, err := io.ReadAll(br)
	if err != nil || !strings.Contains(string(rest), "last") {
		t.Fatalf("rest of the stream: %q %v", rest, err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after the stream finished")
	}
}

// TestGracefulStopCutsAfterGrace: a stream that outlives --shutdown-grace is cut and the
// gateway exits.
func TestGracefulStopCutsAfterGrace(t *testing.T) {
	release := make(chan struct{})
	defer close(release)
	p, d := streamingWorkers(t, release)
	const grace = 300 * time.Millisecond
	cancel, done, rf := startGateway(t, "--shutdown-grace", grace.String(), "--prefill-urls", p.URL, "--decode-urls", d.URL)
	resp, br := openStream(t, rf.HTTPAddr)
	defer resp.Body.Close()
	start := time.Now()
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after the grace")
	}
	if took := time.Since(start); took < grace {
		t.Fatalf("stopped after %s, before the %s grace", took, grace)
	}
	if rest, _ := io.ReadAll(br); strings.Contains(string(rest), "[DONE]") {
		t.Fatalf("cut stream completed: %q", rest)
	}
}
