package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/launch"
	"github.com/kvcentric/kvcentric/sim/internal/cluster"
	"github.com/kvcentric/kvcentric/sim/internal/clustertest"
)

func TestFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"bad decode", []string{"--decode", "0"}, nil, "--decode"},
		{"bad policy", []string{"--policy-json", "{nope"}, nil, "--policy-json"},
		{"unknown policy field", []string{"--policy-json", `{"teleport": true}`}, nil, "--policy-json"},
		{"bad env", nil, map[string]string{"KVC_PREFILL": "x"}, "KVC_PREFILL"},
		{"negative scale", []string{"--time-scale", "-2"}, nil, "--time-scale"},
		{"stray arg", []string{"up"}, nil, "unexpected"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			code := run(context.Background(), tt.args, func(k string) string { return tt.env[k] }, &out, &errb)
			if code != 2 || !strings.Contains(errb.String(), tt.want) {
				t.Fatalf("code %d stderr %q", code, errb.String())
			}
		})
	}
	o, err := parse([]string{"--policy-json", `{"snapshotsEnabled": false}`, "--sim-args", "--layers 4  --page-size 8", "--time-scale", "0.1"},
		func(string) string { return "" }, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if o.cfg.Policy == nil || o.cfg.Policy.SnapshotsEnabled == nil || *o.cfg.Policy.SnapshotsEnabled {
		t.Fatalf("policy %v", o.cfg.Policy)
	}
	if got := strings.Join(o.cfg.SimArgs, " "); got != "--time-scale 0.1 --layers 4 --page-size 8" || !o.cfg.Gateway {
		t.Fatalf("sim args %q gateway %v", got, o.cfg.Gateway)
	}
	// The sidecars' timers and the policy's follow the time scale (they did not: a heartbeat
	// lasted ten model seconds at --time-scale 0.1).
	if got := strings.Join(o.cfg.SidecarArgs, " "); got != "--time-scale 0.1" {
		t.Fatalf("sidecar args %q", got)
	}
	if o.cfg.Policy.GetReservationTimeoutMs() == 0 || o.cfg.Policy.GetUnreachableGraceMs() == 0 {
		t.Fatalf("policy timers not scaled: %v", o.cfg.Policy)
	}
	real, err := parse(nil, func(string) string { return "" }, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if real.cfg.SidecarArgs != nil || real.cfg.Policy != nil {
		t.Fatalf("real speed: sidecar args %q policy %v", real.cfg.SidecarArgs, real.cfg.Policy)
	}
}

// The binary's life with the real binaries: up, ready file, SIGTERM-equivalent (ctx), exit 0.
// Skipped only when the binaries are missing and KVC_BIN_DIR is unset.
func TestRunCluster(t *testing.T) {
	dir := clustertest.BinDir(t, cluster.Binaries)
	work := t.TempDir()
	ready := filepath.Join(work, "ready.json")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errb syncBuffer
	code := make(chan int, 1)
	exited := make(chan struct{})
	go func() {
		code <- run(ctx, []string{"--bin-dir", dir, "--work-dir", filepath.Join(work, "c"), "--decode", "1",
			"--time-scale", "0", "--sim-args", "--layers 2", "--ready-file", ready}, func(string) string { return "" }, &out, &errb)
		close(exited)
	}()
	var rf struct {
		GatewayURL string `json:"gateway_url"`
	}
	wctx, wcancel := context.WithTimeout(ctx, 2*time.Minute)
	defer wcancel()
	// the ready file the cluster writes once every part serves (launch's one wait helper)
	err := launch.WaitFor(wctx, exited, 20*time.Millisecond, func() bool {
		b, err := os.ReadFile(ready)
		return err == nil && json.Unmarshal(b, &rf) == nil
	})
	if errors.Is(err, launch.ErrExited) {
		t.Fatalf("kvc-local exited %d before ready:\n%s", <-code, errb.String())
	}
	if err != nil {
		t.Fatalf("not ready: %v\n%s", err, errb.String())
	}
	resp, err := http.Get(rf.GatewayURL + "/healthz")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("gateway health: %v", err)
	}
	resp.Body.Close()
	if !strings.Contains(out.String(), "grpcurl -plaintext") || !strings.Contains(out.String(), rf.GatewayURL) {
		t.Fatalf("addresses not printed:\n%s", out.String())
	}
	cancel()
	if c := <-code; c != 0 {
		t.Fatalf("exit %d:\n%s", c, errb.String())
	}
}

// syncBuffer is a bytes.Buffer safe for the writer goroutine and the test.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
