package workers

import (
	"context"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/gateway/internal/fakecp"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func TestPickRoundRobin(t *testing.T) {
	tests := []struct {
		name     string
		pre, dec []Worker
		wantOK   bool
		wantDecs []string
	}{
		{"empty", nil, []Worker{{URL: "d1"}}, false, nil},
		{"rotate", []Worker{{URL: "p"}}, []Worker{{URL: "d1"}, {URL: "d2"}, {URL: "d3"}}, true, []string{"d1", "d2", "d3", "d1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := NewPool(tt.pre, tt.dec)
			for i, want := range tt.wantDecs {
				_, d, ok := p.Pick()
				if !ok || d.URL != want {
					t.Fatalf("pick %d = %v %v, want %s", i, d, ok, want)
				}
			}
			if _, _, ok := p.Pick(); ok != tt.wantOK {
				t.Fatalf("ok = %v", ok)
			}
		})
	}
}

func TestFromList(t *testing.T) {
	ready := kvcv1.WorkerState_WORKER_STATE_READY
	ws := []*kvcv1.Worker{
		{WorkerId: "p0", Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, WorkerUrl: "http://p0/", PeerAddr: "x:1", State: ready},
		{WorkerId: "d0", Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, WorkerUrl: "http://d0", State: ready},
		{WorkerId: "d1", Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, WorkerUrl: "http://d1", State: ready, Draining: true},
		{WorkerId: "d2", Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, WorkerUrl: "http://d2", State: kvcv1.WorkerState_WORKER_STATE_UNREACHABLE},
		{WorkerId: "d3", Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, State: ready},
	}
	pre, dec := FromList(ws)
	if len(pre) != 1 || pre[0].URL != "http://p0" || pre[0].PeerAddr != "x:1" || len(dec) != 1 || dec[0].ID != "d0" {
		t.Fatalf("got %+v %+v", pre, dec)
	}
}

func TestRefreshFromAdmin(t *testing.T) {
	cp := fakecp.Start(t, nil)
	ready := kvcv1.WorkerState_WORKER_STATE_READY
	cp.SetWorkers([]*kvcv1.Worker{
		{WorkerId: "p9", Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, WorkerUrl: "http://p9", PeerAddr: "127.0.0.1:9", State: ready},
		{WorkerId: "d9", Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, WorkerUrl: "http://d9", State: ready},
	})
	p := NewPool([]Worker{{URL: "http://static-p"}}, []Worker{{URL: "http://static-d"}})
	ctx, cancel := context.WithCancel(context.Background())
	results := make(chan bool, 16)
	done := make(chan struct{})
	go func() {
		_ = p.Refresh(ctx, []string{"127.0.0.1:1", cp.Addr}, 20*time.Millisecond, zerolog.Nop(), func(ok bool) { results <- ok })
		close(done)
	}()
	defer func() { cancel(); <-done }()
	select {
	case ok := <-results:
		if !ok {
			t.Fatal("refresh failed although one replica answers")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no refresh")
	}
	pre, dec, _ := p.Pick()
	if pre.URL != "http://p9" || pre.PeerAddr != "127.0.0.1:9" || dec.URL != "http://d9" {
		t.Fatalf("got %+v %+v", pre, dec)
	}
}

// A retry after a worker's death skips it in round robin; with every worker of a role skipped
// there is nothing to pick.
func TestPickSkips(t *testing.T) {
	p := NewPool([]Worker{{URL: "p1"}, {URL: "p2"}}, []Worker{{URL: "d1"}, {URL: "d2"}, {URL: "d3"}})
	for i := 0; i < 6; i++ {
		pre, d, ok := p.Pick("d2", "p1")
		if !ok || d.URL == "d2" || pre.URL != "p2" {
			t.Fatalf("pick %d: %v %v %v", i, pre, d, ok)
		}
	}
	if _, _, ok := p.Pick("d1", "d2", "d3"); ok {
		t.Fatal("every decode worker skipped, still picked one")
	}
	if _, _, ok := p.Pick("p1", "p2"); ok {
		t.Fatal("every prefill worker skipped, still picked one")
	}
}

// PickDecode (the fail-open plan: D prefills itself) needs no prefill worker.
func TestPickDecodeNeedsNoPrefill(t *testing.T) {
	p := NewPool(nil, []Worker{{URL: "d1"}, {URL: "d2"}})
	seen := map[string]int{}
	for i := 0; i < 4; i++ {
		d, ok := p.PickDecode("d2")
		if !ok || d.URL != "d1" {
			t.Fatalf("pick %d: %v %v", i, d, ok)
		}
		seen[d.URL]++
	}
	if d, ok := p.PickDecode(); !ok || d.URL == "" {
		t.Fatalf("pick without skips: %v %v", d, ok)
	}
	if _, ok := p.PickDecode("d1", "d2"); ok {
		t.Fatal("every decode worker skipped, still picked one")
	}
	if _, _, ok := p.Pick(); ok {
		t.Fatal("Pick without a prefill worker picked")
	}
}

// A tensor-parallel group is one worker: its rank 0 as listed (the group's state and ranks);
// the other ranks, listed as themselves, are not workers the gateway sends to.
func TestFromListTensorParallel(t *testing.T) {
	ready := kvcv1.WorkerState_WORKER_STATE_READY
	D := kvcv1.WorkerRole_WORKER_ROLE_DECODE
	ws := []*kvcv1.Worker{
		{WorkerId: "d-a0", Role: D, WorkerUrl: "http://a", State: ready, TpGroup: "http://a", TpSize: 2,
			TpRanks: []*kvcv1.TPRank{{TpRank: 0, WorkerId: "d-a0"}, {TpRank: 1, WorkerId: "d-a1"}}},
		{WorkerId: "d-a1", Role: D, WorkerUrl: "http://a", State: ready, TpGroup: "http://a", TpRank: 1, TpSize: 2},
		{WorkerId: "d-b0", Role: D, WorkerUrl: "http://b", State: kvcv1.WorkerState_WORKER_STATE_UNREACHABLE, TpGroup: "http://b", TpSize: 2,
			TpRanks: []*kvcv1.TPRank{{TpRank: 0, WorkerId: "d-b0"}, {TpRank: 1}}},
		{WorkerId: "d-b1", Role: D, WorkerUrl: "http://b", State: ready, TpGroup: "http://b", TpRank: 1, TpSize: 2},
		{WorkerId: "d1", Role: D, WorkerUrl: "http://d1", State: ready, TpGroup: "g", TpSize: 1},
	}
	_, dec := FromList(ws)
	if len(dec) != 2 || dec[0].ID != "d-a0" || dec[1].ID != "d1" {
		t.Fatalf("decode workers %+v", dec)
	}
}
