package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestSIGTERMWaitsForStream runs the real binary: SIGTERM turns /readyz (on --admin-addr) not
// ready while a stream is in flight, the stream finishes, then the process exits 0.
func TestSIGTERMWaitsForStream(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the binary")
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "kvc-gateway")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	release := make(chan struct{})
	p := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"text":"","meta_info":{"prompt_tokens":1,"completion_tokens":0}}`)
	}))
	defer p.Close()
	d := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"text\":\"first\",\"meta_info\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\n")
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
			return
		}
		fmt.Fprint(w, "data: {\"text\":\"first last\",\"meta_info\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n")
	}))
	defer d.Close()
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()

	ready := filepath.Join(dir, "ready.json")
	cmd := exec.Command(bin, "--http-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0", "--ready-file", ready,
		"--prefill-urls", p.URL, "--decode-urls", d.URL, "--shutdown-grace", "20s", "--log-level", "warn")
	var logs strings.Builder
	cmd.Stderr = &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() { _ = cmd.Process.Kill() }()
	var rf struct {
		HTTPAddr  string `json:"http_addr"`
		AdminAddr string `json:"admin_addr"`
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		b, err := os.ReadFile(ready)
		if err == nil && json.Unmarshal(b, &rf) == nil && rf.AdminAddr != "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no ready file; logs:\n%s", logs.String())
		}
		time.Sleep(20 * time.Millisecond) // polling a file another process writes
	}
	req, _ := http.NewRequest(http.MethodPost, "http://"+rf.HTTPAddr+"/generate", strings.NewReader(`{"text":"hi","stream":true}`))
	req.Header.Set("X-Session-ID", "s-term")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if line, err := br.ReadString('\n'); err != nil || !strings.Contains(line, "first") {
		t.Fatalf("first chunk %q %v", line, err)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	for {
		r, err := http.Get("http://" + rf.AdminAddr + "/readyz")
		if err == nil {
			r.Body.Close()
			if r.StatusCode == http.StatusServiceUnavailable {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("/readyz did not turn not ready after SIGTERM")
		}
		time.Sleep(5 * time.Millisecond) // polling another process's state with a deadline
	}
	select {
	case err := <-exited:
		t.Fatalf("exited (%v) with a stream in flight", err)
	default:
	}
	close(release)
	rest, _ := io.ReadAll(br)
	if !strings.Contains(string(rest), "[DONE]") {
		t.Fatalf("stream cut: %q", rest)
	}
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("exit: %v; logs:\n%s", err, logs.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatal("did not exit after the stream finished")
	}
}
