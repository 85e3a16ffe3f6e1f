package prefill

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// syncBuf is an io.Writer safe for the event log's writes and the test's reads.
type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *syncBuf) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *syncBuf) events(t *testing.T) []sidecar.Event {
	t.Helper()
	w.mu.Lock()
	defer w.mu.Unlock()
	var out []sidecar.Event
	for _, line := range strings.Split(strings.TrimSpace(w.b.String()), "\n") {
		if line == "" {
			continue
		}
		var e sidecar.Event
		if err := json.Unmarshal([]byte(line), &e); err != nil {
			t.Fatalf("event %q: %v", line, err)
		}
		out = append(out, e)
	}
	return out
}

// fakeClock is a settable clock.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Add(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// TestExpiredReservationLeavesNothing: a reservation whose pusher never commits or aborts is
// freed by the store's deadline, and — the store's pending table being the only record of an
// ingest — nothing of it is left anywhere: not in the store's table, not as pages or write
// guard, not for the peer API (commit and abort of it are NOT_FOUND), and the expiry is logged.
func TestExpiredReservationLeavesNothing(t *testing.T) {
	eng, err := rdma.New(context.Background(), rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = eng.Close() })
	clk := &fakeClock{now: time.Unix(1_700_000_000, 0)}
	var logw syncBuf
	ev := sidecar.NewEventLog(&logw, "p", nil)
	s := New(Config{WorkerID: "p", StoreBytes: 16 * 2 * 32, ReserveTimeout: 30 * time.Second, Now: clk.Now}, eng, ev, zerolog.Nop())
	t.Cleanup(s.Close)
	p, err := kvpool.Create(t.TempDir(), kvpool.Spec{PageSize: 4, ItemLen: 32, NumLayers: 1, PageCount: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	reg := &kvcv1.RegisterKVPoolRequest{PageSize: 4, ItemLen: 32, PageCount: 8, NumLayers: 1}
	for i, k := range []kvcv1.KVKind{kvcv1.KVKind_KV_KIND_K, kvcv1.KVKind_KV_KIND_V} {
		reg.Buffers = append(reg.Buffers, &kvcv1.KVBuffer{Layer: 0, Kind: k, Memory: &kvcv1.KVBuffer_Shm{Shm: &kvcv1.SharedMemoryRef{Path: p.Path(), Offset: p.Offset(i)}}})
	}
	ctx := context.Background()
	if _, err := s.RegisterKVPool(ctx, reg); err != nil {
		t.Fatal(err)
	}
	st := s.Store()
	used0 := st.UsedBytes()

	tests := []struct {
		name   string
		expire func() // how the deadline is noticed
	}{
		{"periodic expiry", func() { s.expire(clk.Now()) }},
		{"next reservation", func() {
			// another session's reserve runs the expiry first; its own reservation is then aborted
			r, err := s.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: "other", Generation: 1, Tokens: 4,
				SourceWorkerId: "d", SourceLayout: layout()})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := s.AbortSnapshot(ctx, &kvcv1.AbortSnapshotRequest{IngestId: r.GetIngestId(), Reason: "test"}); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			res, err := s.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: "a", Generation: 1, Tokens: 10,
				SourceWorkerId: "d", SourceLayout: layout(), SourceTransferEndpoint: "decode-seg"})
			if err != nil {
				t.Fatal(err)
			}
			id := res.GetIngestId()
			in, ok := st.Ingest(id)
			if !ok || in.Session != "a" || in.Tokens != 10 || in.Source != "d" {
				t.Fatalf("open ingest %d: %+v %v", id, in, ok)
			}
			if st.UsedBytes() == used0 {
				t.Fatal("a reservation took no pages")
			}
			bufs := s.arena.Layout().GetBufferAddrs()
			if err := st.CheckWrite("decode-seg", bufs[0]+uint64(res.GetPages()[0])*32, 32); err != nil {
				t.Fatalf("write into the open reservation refused: %v", err)
			}

			clk.Add(29 * time.Second)
			s.expire(clk.Now())
			if _, ok := st.Ingest(id); !ok {
				t.Fatal("expired before its deadline")
			}
			clk.Add(2 * time.Second)
			tc.expire()

			if _, ok := st.Ingest(id); ok || len(st.Ingests()) != 0 || st.Pending() != 0 {
				t.Fatalf("after expiry: ingest %d still open (%d open, %d pending)", id, len(st.Ingests()), st.Pending())
			}
			if u := st.UsedBytes(); u != used0 {
				t.Fatalf("after expiry %d bytes used, %d before the reservation", u, used0)
			}
			if err := st.CheckWrite("decode-seg", bufs[0]+uint64(res.GetPages()[0])*32, 32); err == nil {
				t.Fatal("the write guard still accepts the expired reservation's pages")
			}
			if _, err := s.CommitSnapshot(ctx, &kvcv1.CommitSnapshotRequest{IngestId: id}); status.Code(err) != codes.NotFound {
				t.Fatalf("commit after expiry: %v, want NotFound", err)
			}
			if _, err := s.AbortSnapshot(ctx, &kvcv1.AbortSnapshotRequest{IngestId: id}); status.Code(err) != codes.NotFound {
				t.Fatalf("abort after expiry: %v, want NotFound", err)
			}
			if _, ok := st.Get("a"); ok {
				t.Fatal("an expired full push left a snapshot")
			}
			var found bool
			for _, e := range logw.events(t) {
				if e.Event == sidecar.EvRecvRejected && e.Session == "a" && strings.HasPrefix(e.Reason, "expired: ingest ") && e.Tokens == 10 && e.Peer == "d" {
					found = true
				}
			}
			if !found {
				t.Fatalf("no snapshot_recv_rejected event for the expiry: %+v", logw.events(t))
			}
			// the session can ingest again at once
			r2, err := s.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: "a", Generation: 1, Tokens: 4,
				SourceWorkerId: "d", SourceLayout: layout()})
			if err != nil {
				t.Fatalf("reserve after expiry: %v", err)
			}
			if _, err := s.AbortSnapshot(ctx, &kvcv1.AbortSnapshotRequest{IngestId: r2.GetIngestId()}); err != nil {
				t.Fatal(err)
			}
		})
	}
}
