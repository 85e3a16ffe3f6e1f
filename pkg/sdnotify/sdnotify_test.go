package sdnotify

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// notifySocket listens on a unix datagram socket and sets NOTIFY_SOCKET to it, as systemd does
// for a Type=notify unit.
func notifySocket(t *testing.T) *net.UnixConn {
	t.Helper()
	p := filepath.Join(t.TempDir(), "notify.sock")
	conn, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: p, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	t.Setenv("NOTIFY_SOCKET", p)
	return conn
}

// recv reads one datagram, waiting at most d (0: only one already queued); "" when none.
func recv(t *testing.T, conn *net.UnixConn, d time.Duration) string {
	t.Helper()
	if d == 0 {
		// A deadline already past fails the read before it is tried; a queued datagram is read
		// at once, before a deadline in the future is waited for.
		d = 20 * time.Millisecond
	}
	if err := conn.SetReadDeadline(time.Now().Add(d)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	n, err := conn.Read(buf)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return ""
	}
	if err != nil {
		t.Fatal(err)
	}
	return string(buf[:n])
}

func TestStates(t *testing.T) {
	t.Setenv("NOTIFY_SOCKET", "")
	t.Setenv("WATCHDOG_USEC", "")
	n := New(zerolog.Nop(), nil)
	n.Ready("x") // nowhere to send: nothing happens
	conn := notifySocket(t)
	for _, tc := range []struct {
		send func()
		want string
	}{
		{func() { n.Ready("") }, "READY=1"},
		{func() { n.Ready("serving on 127.0.0.1:1") }, "READY=1\nSTATUS=serving on 127.0.0.1:1"},
		{func() { n.Status("waiting for\nthe worker") }, "STATUS=waiting for the worker"},
		{func() { n.Stopping("draining") }, "STOPPING=1\nSTATUS=draining"},
		{func() { n.Stopping("again"); n.Status("after") }, "STATUS=after"}, // STOPPING=1 once
	} {
		tc.send()
		if got := recv(t, conn, 10*time.Second); got != tc.want {
			t.Errorf("got %q, want %q", got, tc.want)
		}
	}
}

func TestWatchdogOff(t *testing.T) {
	notifySocket(t)
	for _, tc := range []struct{ usec, pid string }{
		{"", ""},                           // no WatchdogSec
		{"1000000", "1"},                   // meant for another process (pid 1)
		{"soon", ""},                       // malformed: logged, off
		{"-5", ""},                         // malformed
		{"1000000", strconv.Itoa(1 << 30)}, // another pid
	} {
		t.Setenv("WATCHDOG_USEC", tc.usec)
		t.Setenv("WATCHDOG_PID", tc.pid)
		n := New(zerolog.Nop(), nil)
		if n.WatchdogInterval() != 0 {
			t.Errorf("WATCHDOG_USEC=%q WATCHDOG_PID=%q: interval %v, want off", tc.usec, tc.pid, n.WatchdogInterval())
		}
		called := false
		if err := n.Watchdog(t.Context(), func(context.Context) error { called = true; return nil }); err != nil || called {
			t.Errorf("off watchdog: err %v, check called %v", err, called)
		}
	}
}

// TestWatchdogPingsOnlyWhileHealthy: WATCHDOG=1 comes at half of WATCHDOG_USEC while the check
// passes, none while it fails, and again once it passes. The check reports each call, so the
// test knows when a loop iteration (check, then ping or not) has completed.
func TestWatchdogPingsOnlyWhileHealthy(t *testing.T) {
	conn := notifySocket(t)
	t.Setenv("WATCHDOG_USEC", "40000") // 40ms: pings every 20ms
	t.Setenv("WATCHDOG_PID", strconv.Itoa(os.Getpid()))
	reg := prometheus.NewRegistry()
	n := New(zerolog.Nop(), reg)
	if n.WatchdogInterval() != 40*time.Millisecond {
		t.Fatalf("interval %v", n.WatchdogInterval())
	}
	var healthy atomic.Bool
	healthy.Store(true)
	calls := make(chan bool)
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() {
		done <- n.Watchdog(ctx, func(cctx context.Context) error {
			if _, ok := cctx.Deadline(); !ok {
				t.Error("check without a deadline")
			}
			ok := healthy.Load()
			select {
			case calls <- ok:
			case <-ctx.Done():
			}
			if !ok {
				return errors.New("sick")
			}
			return nil
		})
	}()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("watchdog returned %v", err)
		}
	}()
	// waitCalls waits for k more check calls that returned ok.
	waitCalls := func(k int, ok bool) {
		t.Helper()
		for k > 0 {
			select {
			case got := <-calls:
				if got == ok {
					k--
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("no check call (want ok=%v)", ok)
			}
		}
	}
	for range 2 {
		waitCalls(1, true)
		if got := recv(t, conn, 10*time.Second); got != "WATCHDOG=1" {
			t.Fatalf("healthy: got %q, want WATCHDOG=1", got)
		}
	}
	healthy.Store(false)
	// The second failing call starts after the first has ended, and the first after every
	// earlier healthy one's ping: drain those, then let two more failing calls end.
	waitCalls(2, false)
	for recv(t, conn, 0) != "" {
	}
	waitCalls(3, false)
	if got := recv(t, conn, 0); got != "" {
		t.Fatalf("unhealthy: got %q, want no ping", got)
	}
	if f := testutil.ToFloat64(n.checks.WithLabelValues("failed")); f < 4 {
		t.Fatalf("failed checks counted %v, want >= 4", f)
	}
	healthy.Store(true)
	waitCalls(1, true)
	if got := recv(t, conn, 10*time.Second); got != "WATCHDOG=1" {
		t.Fatalf("healthy again: got %q, want WATCHDOG=1", got)
	}
	if c, err := testutil.GatherAndCount(reg, "kvc_watchdog_checks_total"); err != nil || c != 2 {
		t.Fatalf("kvc_watchdog_checks_total series %d (%v), want 2", c, err)
	}
}

func TestHTTPProbe(t *testing.T) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	mux.HandleFunc("GET /sick", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusServiceUnavailable) })
	plain := httptest.NewServer(mux)
	defer plain.Close()
	secure := httptest.NewTLSServer(mux)
	defer secure.Close()
	any4, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	anySrv := &http.Server{Handler: mux, ReadHeaderTimeout: time.Second}
	go func() { _ = anySrv.Serve(any4) }()
	defer anySrv.Close()
	closed, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedAddr := closed.Addr()
	_ = closed.Close()

	for _, tc := range []struct {
		name string
		addr net.Addr
		path string
		tls  bool
		ok   bool
	}{
		{"healthy", plain.Listener.Addr(), "/healthz", false, true},
		{"503", plain.Listener.Addr(), "/sick", false, false},
		{"404", plain.Listener.Addr(), "/nothing", false, false},
		{"https", secure.Listener.Addr(), "/healthz", true, true},
		{"http to https", secure.Listener.Addr(), "/healthz", false, false},
		{"unspecified address probed on loopback", any4.Addr(), "/healthz", false, true},
		{"nothing listens", closedAddr, "/healthz", false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			err := HTTPProbe(tc.addr, tc.path, tc.tls)(ctx)
			if (err == nil) != tc.ok {
				t.Fatalf("err %v, want ok=%v", err, tc.ok)
			}
		})
	}
}

// WatchdogInterval is systemd's watchdog timeout (WatchdogSec=) for this process; 0: none.
func (n *Notifier) WatchdogInterval() time.Duration { return n.interval }
