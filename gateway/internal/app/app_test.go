package app

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/gateway/internal/config"
)

func TestRunServesAndWritesReadyFile(t *testing.T) {
	dir := t.TempDir()
	ready := filepath.Join(dir, "ready.json")
	cfg, err := config.Parse([]string{"--http-addr", "127.0.0.1:0", "--ready-file", ready,
		"--control-plane", "127.0.0.1:1", "--route-timeout", "100ms", "--worker-refresh", "50ms", "--insecure"}, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg, io.Discard) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}()
	var rf struct {
		PID      int    `json:"pid"`
		HTTPAddr string `json:"http_addr"`
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		raw, err := os.ReadFile(ready)
		if err == nil && json.Unmarshal(raw, &rf) == nil && rf.HTTPAddr != "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no ready file")
		}
		select {
		case err := <-done:
			t.Fatalf("Run ended: %v", err)
		case <-time.After(10 * time.Millisecond): // polling a file written by another goroutine
		}
	}
	if rf.PID != os.Getpid() {
		t.Fatalf("pid %d", rf.PID)
	}
	for _, path := range []string{"/healthz", "/readyz", "/metrics"} {
		resp, err := http.Get("http://" + rf.HTTPAddr + path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %d", path, resp.StatusCode)
		}
		if path == "/metrics" && !strings.Contains(string(body), "kvc_gateway_control_plane_connected 0") {
			t.Fatalf("metrics lack the connection gauge:\n%s", body)
		}
	}
	// No control plane and no fail-open workers: a clear 503, not a hang.
	req, _ := http.NewRequest(http.MethodPost, "http://"+rf.HTTPAddr+"/generate", strings.NewReader(`{"text":"x"}`))
	req.Header.Set("X-Session-ID", "s")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 503 || !strings.Contains(string(body), "no_workers") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
}
