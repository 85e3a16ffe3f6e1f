package sidecar

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

type transition struct {
	down   bool
	reason string
	fails  int64 // failed probes answered when the transition was made
}

// healthWorker is a worker's /health: 200 while ok, 503 otherwise (counted).
type healthWorker struct {
	ok    atomic.Bool
	fails atomic.Int64
	srv   *httptest.Server
}

func newHealthWorker(t *testing.T) *healthWorker {
	w := &healthWorker{}
	w.ok.Store(true)
	w.srv = httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/health" {
			http.NotFound(rw, r)
			return
		}
		if !w.ok.Load() {
			w.fails.Add(1)
			http.Error(rw, "down", http.StatusServiceUnavailable)
			return
		}
		_, _ = rw.Write([]byte("ok\n"))
	}))
	t.Cleanup(w.srv.Close)
	return w
}

func runHealth(t *testing.T, cfg HealthConfig, w *healthWorker) (*WorkerHealth, chan transition, chan string) {
	t.Helper()
	changes := make(chan transition, 16)
	hooks := make(chan string, 1024)
	cfg.OnChange = func(down bool, reason string) {
		var f int64
		if w != nil {
			f = w.fails.Load()
		}
		changes <- transition{down, reason, f}
	}
	h := NewWorkerHealth(cfg, zerolog.Nop())
	h.testHook = func(what string) {
		select {
		case hooks <- what:
		default:
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = h.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return h, changes, hooks
}

func waitChange(t *testing.T, ch <-chan transition, down bool) transition {
	t.Helper()
	select {
	case tr := <-ch:
		if tr.down != down {
			t.Fatalf("transition to down=%v (%s); want down=%v", tr.down, tr.reason, down)
		}
		return tr
	case <-time.After(10 * time.Second):
		t.Fatalf("no transition to down=%v within 10s", down)
	}
	return transition{}
}

func waitHook(t *testing.T, ch <-chan string, want string) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		select {
		case got := <-ch:
			if got == want {
				return
			}
		case <-deadline:
			t.Fatalf("no %q within 10s", want)
		}
	}
}

func TestWorkerHealthProbeThreshold(t *testing.T) {
	for _, threshold := range []int{1, 3} {
		t.Run(strings.Repeat("x", threshold), func(t *testing.T) {
			w := newHealthWorker(t)
			h, changes, _ := runHealth(t, HealthConfig{URL: w.srv.URL + "/", Interval: 5 * time.Millisecond, Threshold: threshold,
				Timeout: 2 * time.Second}, w)
			h.Registered()
			w.ok.Store(false)
			tr := waitChange(t, changes, true)
			if tr.fails != int64(threshold) {
				t.Fatalf("down after %d failed probes; want exactly %d", tr.fails, threshold)
			}
			if !strings.Contains(tr.reason, "HTTP 503") {
				t.Fatalf("reason %q does not name the status", tr.reason)
			}
			if down, reason, since := h.Down(); !down || reason != tr.reason || since.IsZero() {
				t.Fatalf("Down() = %v %q %v", down, reason, since)
			}
			w.ok.Store(true)
			tr = waitChange(t, changes, false)
			if down, reason, _ := h.Down(); down || reason != "" {
				t.Fatalf("Down() after recovery = %v %q", down, reason)
			}
			// A second outage is detected again (the failure count was reset by the success).
			before := w.fails.Load()
			w.ok.Store(false)
			tr = waitChange(t, changes, true)
			if tr.fails-before != int64(threshold) {
				t.Fatalf("second outage: down after %d failed probes; want %d", tr.fails-before, threshold)
			}
		})
	}
}

func TestWorkerHealthNotJudgedBeforeRegistration(t *testing.T) {
	w := newHealthWorker(t)
	w.ok.Store(false)
	h, changes, hooks := runHealth(t, HealthConfig{URL: w.srv.URL, Interval: 5 * time.Millisecond, Threshold: 1}, w)
	// /health fails, but the worker never registered: nothing is judged.
	waitHook(t, hooks, "probe-skipped")
	waitHook(t, hooks, "probe-skipped")
	select {
	case tr := <-changes:
		t.Fatalf("a transition before the worker registered: %+v", tr)
	default:
	}
	if w.fails.Load() != 0 {
		t.Fatalf("%d probes before registration", w.fails.Load())
	}
	// Registered while /health fails: the probes take it down.
	h.Registered()
	waitChange(t, changes, true)
	// Re-registering brings it back even while /health still fails.
	h.Registered()
	if tr := waitChange(t, changes, false); !strings.Contains(tr.reason, "registered") {
		t.Fatalf("reason %q", tr.reason)
	}
}

// fakeBridge is the worker-facing side: RegisterKVPool only.
type fakeBridge struct {
	kvcv1.UnimplementedWorkerBridgeServiceServer
}

func (fakeBridge) CommitSession(context.Context, *kvcv1.CommitSessionRequest) (*kvcv1.CommitSessionResponse, error) {
	return &kvcv1.CommitSessionResponse{}, nil
}

func (fakeBridge) RegisterKVPool(context.Context, *kvcv1.RegisterKVPoolRequest) (*kvcv1.RegisterKVPoolResponse, error) {
	return &kvcv1.RegisterKVPoolResponse{TransferEndpoint: "x"}, nil
}

// serveBridge serves a bridge wired to h on a Unix socket.
func serveBridge(t *testing.T, h *WorkerHealth) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "bridge.sock")
	lis, err := ListenUnix(path)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpcx.NewServer(zerolog.Nop(), h.ServerOptions()...)
	kvcv1.RegisterWorkerBridgeServiceServer(srv, fakeBridge{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = srv.Serve(ctx, lis, time.Second); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return path
}

// workerConnect is a worker process: it connects to the bridge and registers its pool.
func workerConnect(t *testing.T, path string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := kvcv1.NewWorkerBridgeServiceClient(conn).RegisterKVPool(ctx, &kvcv1.RegisterKVPoolRequest{}); err != nil {
		t.Fatal(err)
	}
	return conn
}

func TestWorkerHealthBridgeDrop(t *testing.T) {
	dead, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	deadURL := "http://" + dead.Addr().String()
	_ = dead.Close() // nothing listens there: connection refused
	alive := newHealthWorker(t)
	cases := []struct {
		name     string
		url      string
		wantDown bool
		reason   string
	}{
		{"no url: the drop alone", "", true, "bridge connection closed"},
		{"drop and /health refused", deadURL, true, "refused"},
		{"drop but /health answers (idle close)", alive.srv.URL, false, ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// Interval 0: only the drop triggers a probe.
			h, changes, hooks := runHealth(t, HealthConfig{URL: tc.url, Timeout: 2 * time.Second}, nil)
			path := serveBridge(t, h)
			conn := workerConnect(t, path)
			waitHook(t, hooks, "registered")
			_ = conn.Close() // the worker process exits: its socket closes
			if !tc.wantDown {
				waitHook(t, hooks, "closed-healthy")
				if down, _, _ := h.Down(); down {
					t.Fatal("an idle close with /health ok marked the worker down")
				}
				return
			}
			tr := waitChange(t, changes, true)
			if !strings.Contains(tr.reason, tc.reason) {
				t.Fatalf("reason %q; want it to mention %q", tr.reason, tc.reason)
			}
			if tc.url == "" {
				// Without a URL, a call on a new connection (the close was an idle one) is
				// proof of life.
				c2, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
				if err != nil {
					t.Fatal(err)
				}
				defer c2.Close()
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				if _, err := kvcv1.NewWorkerBridgeServiceClient(c2).CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "s"}); err != nil {
					t.Fatal(err)
				}
				if tr := waitChange(t, changes, false); !strings.Contains(tr.reason, "called the bridge again") {
					t.Fatalf("up reason %q", tr.reason)
				}
				return
			}
			// The restarted worker connects and registers its pool again: up.
			conn = workerConnect(t, path)
			defer conn.Close()
			if tr := waitChange(t, changes, false); !strings.Contains(tr.reason, "registered") {
				t.Fatalf("up reason %q", tr.reason)
			}
		})
	}
}

func TestWorkerHealthSecondConnectionKeepsItUp(t *testing.T) {
	h, changes, hooks := runHealth(t, HealthConfig{}, nil)
	path := serveBridge(t, h)
	c1 := workerConnect(t, path)
	c2 := workerConnect(t, path) // e.g. a worker with two channels, or a restart racing the old close
	defer c2.Close()
	waitHook(t, hooks, "registered")
	_ = c1.Close()
	waitHook(t, hooks, "closed-ignored")
	select {
	case tr := <-changes:
		t.Fatalf("transition with a bridge connection still open: %+v", tr)
	default:
	}
}
