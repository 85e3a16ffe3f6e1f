package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"strings"
	"testing"
)

func TestParseFlags(t *testing.T) {
	base := []string{"--role", "decode", "--worker-id", "d0", "--bridge-socket", "/tmp/x.sock"}
	tests := []struct {
		name string
		args []string
		env  map[string]string
		code int
		want string
	}{
		{"missing role", []string{"--worker-id", "d0", "--bridge-socket", "/x"}, nil, 2, "--role"},
		{"bad role", append(base[2:], "--role", "router"), nil, 2, "--role"},
		{"missing socket", []string{"--role", "decode", "--worker-id", "d0"}, nil, 2, "--bridge-socket"},
		{"bad id", []string{"--role", "decode", "--worker-id", "a/b", "--bridge-socket", "/x"}, nil, 2, "forbidden"},
		{"zero scale ok but negative not", append(base, "--time-scale", "-1"), nil, 2, "time scale"},
		{"tiny capacity", append(base, "--kv-capacity-tokens", "3"), nil, 2, "at least one page"},
		{"bad env", base, map[string]string{"KVC_LINK_GBPS": "fast"}, 2, "KVC_LINK_GBPS"},
		{"zero link", base, map[string]string{"KVC_LINK_GBPS": "0"}, 2, "link bandwidth"},
		{"bad log level", append(base, "--log-level", "loud"), nil, 2, "log level"},
		{"bad eviction mode", append(base, "--evict", "never"), nil, 2, "--evict"},
		{"bad tier egress", append(base, "--tier-egress-gbps", "-1"), nil, 2, "--tier-egress-gbps"},
		{"unknown flag", append(base, "--nope"), nil, 2, "nope"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stderr bytes.Buffer
			code := run(context.Background(), tt.args, func(k string) string { return tt.env[k] }, &stderr)
			if code != tt.code || !strings.Contains(stderr.String(), tt.want) {
				t.Fatalf("code %d, stderr %q; want %d containing %q", code, stderr.String(), tt.code, tt.want)
			}
		})
	}
	o, cfg, err := parse(base, func(k string) string {
		return map[string]string{"KVC_TIME_SCALE": "0.1", "KVC_KV_CAPACITY_TOKENS": "1000"}[k]
	}, &bytes.Buffer{})
	if err != nil || cfg.Timing.Scale != 0.1 || cfg.Geometry.PageCount != 62 || o.httpAddr != "127.0.0.1:0" {
		t.Fatalf("parse: %v %+v", err, cfg)
	}
}

type registerOnly struct {
	kvcv1.UnimplementedWorkerBridgeServiceServer
	got chan *kvcv1.RegisterKVPoolRequest
}

func (r *registerOnly) RegisterKVPool(_ context.Context, req *kvcv1.RegisterKVPoolRequest) (*kvcv1.RegisterKVPoolResponse, error) {
	r.got <- req
	return &kvcv1.RegisterKVPoolResponse{KvBytesPerToken: 1, TransferEndpoint: "x"}, nil
}

// readJSONFile polls path (written atomically by the binary under test in another goroutine)
// until it holds a JSON object.
func readJSONFile(t *testing.T, path string) map[string]any {
	t.Helper()
	var m map[string]any
	deadline := time.Now().Add(20 * time.Second)
	for {
		b, err := os.ReadFile(path)
		if err == nil && json.Unmarshal(b, &m) == nil {
			return m
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s", path)
		}
		time.Sleep(10 * time.Millisecond) // polling a file another goroutine writes
	}
}

// The binary's life: bind port 0 and write the addr file before the sidecar exists, wait for
// the sidecar socket (created late), register, serve on the address it wrote, write the ready
// file, stop on cancel and remove the pool file.
func TestServeLifecycle(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "b.sock")
	ready := filepath.Join(dir, "ready.json")
	addrFile := filepath.Join(dir, "addr.json")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	code := make(chan int, 1)
	go func() {
		code <- run(ctx, []string{"--role", "decode", "--worker-id", "d0", "--bridge-socket", sock, "--http-addr", "127.0.0.1:0",
			"--ready-file", ready, "--addr-file", addrFile, "--shm-dir", dir, "--kv-capacity-tokens", "1024", "--layers", "2"},
			func(string) string { return "" }, io.Discard) // concurrent loggers: a bytes.Buffer would race
	}()
	// The bound address is known before the sidecar is up (the supervisor gives it to the
	// sidecar as --worker-url), and the port is held already.
	bound, _ := readJSONFile(t, addrFile)["http_addr"].(string)
	if !strings.HasPrefix(bound, "127.0.0.1:") || strings.HasSuffix(bound, ":0") {
		t.Fatalf("addr file http_addr %q", bound)
	}
	if _, err := os.Stat(ready); !os.IsNotExist(err) {
		t.Fatalf("ready before the sidecar registered the pool: %v", err)
	}
	if l, err := net.Listen("tcp", bound); err == nil {
		l.Close()
		t.Fatalf("%s is not bound", bound)
	}
	// The sidecar comes up after the worker.
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	fb := &registerOnly{got: make(chan *kvcv1.RegisterKVPoolRequest, 1)}
	srv := grpcx.NewServer(zerolog.Nop())
	kvcv1.RegisterWorkerBridgeServiceServer(srv, fb)
	sctx, scancel := context.WithCancel(context.Background())
	defer scancel()
	go func() { _ = srv.Serve(sctx, lis, time.Second) }()
	var req *kvcv1.RegisterKVPoolRequest
	select {
	case req = <-fb.got:
	case <-time.After(20 * time.Second):
		t.Fatal("no RegisterKVPool")
	}
	if req.GetPageCount() != 64 || len(req.GetBuffers()) != 4 || req.GetItemLen() != 16*16 {
		t.Fatalf("register %v", req)
	}
	rf := readJSONFile(t, ready)
	if rf["http_addr"] != bound {
		t.Fatalf("serving on %v, addr file said %s", rf["http_addr"], bound)
	}
	for _, path := range []string{"/health", "/metrics", "/kvc/sessions"} {
		resp, err := http.Get("http://" + rf["http_addr"].(string) + path)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("%s: %v", path, err)
		}
		resp.Body.Close()
	}
	shm := rf["shm_path"].(string)
	if _, err := os.Stat(shm); err != nil {
		t.Fatalf("pool file: %v", err)
	}
	cancel()
	if c := <-code; c != 0 {
		t.Fatalf("exit code %d", c)
	}
	if _, err := os.Stat(shm); !os.IsNotExist(err) {
		t.Fatalf("pool file left behind: %v", err)
	}
}

func TestParseTensorParallelFlags(t *testing.T) {
	base := []string{"--role", "decode", "--worker-id", "d0", "--bridge-socket", "/tmp/x.sock"}
	for _, bad := range [][]string{{"--tp-rank", "2", "--tp-size", "2"}, {"--tp-rank", "1"}, {"--tp-size", "-1"}, {"--tp-rank", "-1", "--tp-size", "2"}} {
		var stderr bytes.Buffer
		if code := run(context.Background(), append(base, bad...), func(string) string { return "" }, &stderr); code != 2 || !strings.Contains(stderr.String(), "--tp-rank") {
			t.Fatalf("%v: code %d, stderr %q", bad, code, stderr.String())
		}
	}
	_, cfg, err := parse(append(base, "--tp-rank", "1", "--tp-size", "2"), func(string) string { return "" }, &bytes.Buffer{})
	if err != nil || cfg.TPRank != 1 || cfg.TPSize != 2 {
		t.Fatalf("parse: %v %+v", err, cfg)
	}
}
