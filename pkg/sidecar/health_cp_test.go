package sidecar_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/pkg/sidecar"
	"github.com/kvcentric/kvcentric/pkg/sidecar/cptest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// The worker's health rides on the hello and on a load report sent at once on every change
// (the heartbeat here is an hour: only the change can send it).
func TestControlPlaneWorkerDownSentAtOnce(t *testing.T) {
	srv, err := cptest.Start(1, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	cp := sidecar.NewControlPlane(sidecar.CPConfig{Endpoints: []string{srv.Addr}, Heartbeat: time.Hour}, &fakeHandler{id: "d0"}, zerolog.Nop())
	cp.SetWorkerDown(true, "bridge closed")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = cp.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	wctx := wctx(t)
	if err := srv.Wait(wctx, func(v *cptest.View) bool {
		h, l := v.Hello("d0"), v.Load("d0")
		return h != nil && h.GetWorkerDown() && h.GetWorkerDownReason() == "bridge closed" && l.GetWorkerDown() && l.GetUsedTokens() == 42
	}); err != nil {
		t.Fatalf("hello/first load without worker_down: %v", err)
	}
	cp.SetWorkerDown(false, "ignored when up")
	if err := srv.Wait(wctx, func(v *cptest.View) bool {
		l := v.Load("d0")
		return l != nil && !l.GetWorkerDown() && l.GetWorkerDownReason() == ""
	}); err != nil {
		t.Fatalf("recovery not sent at once: %v", err)
	}
	cp.SetWorkerDown(true, "3 health probes failed")
	if err := srv.Wait(wctx, func(v *cptest.View) bool {
		return v.Load("d0").GetWorkerDownReason() == "3 health probes failed"
	}); err != nil {
		t.Fatalf("second outage not sent at once: %v", err)
	}
}

// KickLoad sends a load report at once (the heartbeat here is an hour: only the kick can send
// a second one).
func TestControlPlaneKickLoadSendsAtOnce(t *testing.T) {
	srv, err := cptest.Start(1, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	h := &loadHandler{fakeHandler: &fakeHandler{id: "d0"}}
	h.used.Store(42)
	cp := sidecar.NewControlPlane(sidecar.CPConfig{Endpoints: []string{srv.Addr}, Heartbeat: time.Hour}, h, zerolog.Nop())
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = cp.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	wctx := wctx(t)
	if err := srv.Wait(wctx, func(v *cptest.View) bool { return v.Load("d0").GetUsedTokens() == 42 }); err != nil {
		t.Fatalf("first load: %v", err)
	}
	h.used.Store(7)
	cp.KickLoad()
	if err := srv.Wait(wctx, func(v *cptest.View) bool { return v.Load("d0").GetUsedTokens() == 7 }); err != nil {
		t.Fatalf("kicked load not sent at once: %v", err)
	}
}

// loadHandler is a fakeHandler whose load reports used tokens the test sets.
type loadHandler struct {
	*fakeHandler
	used atomic.Int64
}

func (h *loadHandler) Load() *kvcv1.WorkerLoad { return &kvcv1.WorkerLoad{UsedTokens: h.used.Load()} }
