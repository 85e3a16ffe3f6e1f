package prefill

import (
	"context"
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

// seedSidecar is a registered sidecar (pool of 8 pages of 4 tokens, store of 16 pages) on a
// settable clock, with its event log.
func seedSidecar(t *testing.T, cfg Config) (*Sidecar, *fakeClock, *syncBuf, *kvpool.Pool) {
	t.Helper()
	eng, err := rdma.New(context.Background(), rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = eng.Close() })
	clk := &fakeClock{now: time.Unix(1_700_000_000, 0)}
	var logw syncBuf
	cfg.WorkerID, cfg.StoreBytes, cfg.Now = "p", 16*2*32, clk.Now
	s := New(cfg, eng, sidecar.NewEventLog(&logw, "p", nil), zerolog.Nop())
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
	if _, err := s.RegisterKVPool(context.Background(), reg); err != nil {
		t.Fatal(err)
	}
	return s, clk, &logw, p
}

func seedChunk(room int64, pages []int64, first int64, last bool) *kvcv1.SendKVRequest {
	return &kvcv1.SendKVRequest{Room: room, SessionId: "s", Pages: pages, FirstPage: first, Last: last, Tokens: 14, Generation: 1, ToStore: true}
}

// TestStoreSeedTimeouts: a store seed whose worker stops sending is failed by the room timeout
// (its reservation freed, nothing stored, the late chunk refused, the failure logged); every
// chunk keeps its store reservation alive, and one whose reservation expired (no chunk within the
// store's reserve timeout) fails at its next chunk instead of writing into pages that are no
// longer its own. Both leave the store as it was, and the seed counts in the load while
// it runs.
func TestStoreSeedTimeouts(t *testing.T) {
	ctx := context.Background()
	t.Run("room timeout", func(t *testing.T) {
		s, clk, logw, _ := seedSidecar(t, Config{RoomTimeout: 10 * time.Second, ReserveTimeout: time.Minute})
		st := s.Store()
		if _, err := s.SendKV(ctx, seedChunk(3, []int64{0, 1}, 0, false)); err != nil {
			t.Fatal(err)
		}
		if n := len(st.Ingests()); n != 1 || s.Load().GetTransferQueueDepth() != 1 {
			t.Fatalf("%d ingests, load %v", n, s.Load())
		}
		clk.Add(11 * time.Second)
		s.expire(clk.Now())
		if n := len(st.Ingests()); n != 0 || st.UsedBytes() != 0 || s.Load().GetTransferQueueDepth() != 0 {
			t.Fatalf("after the room timeout: %d ingests, %d bytes used, load %v", n, st.UsedBytes(), s.Load())
		}
		if _, err := s.SendKV(ctx, seedChunk(3, []int64{2, 3}, 2, true)); status.Code(err) != codes.FailedPrecondition {
			t.Fatalf("late chunk: %v", err)
		}
		if _, ok := st.Get("s"); ok {
			t.Fatal("an expired seed was stored")
		}
		var rejected int
		for _, e := range logw.events(t) {
			if e.Event == sidecar.EvRecvRejected && e.Kind == "seed" && e.Room == 3 {
				rejected++
			}
		}
		if rejected != 1 {
			t.Fatalf("%d seed rejections logged: %+v", rejected, logw.events(t))
		}
	})
	t.Run("reserve timeout", func(t *testing.T) {
		s, clk, _, _ := seedSidecar(t, Config{RoomTimeout: time.Hour, ReserveTimeout: 5 * time.Second})
		if _, err := s.SendKV(ctx, seedChunk(4, []int64{0, 1}, 0, false)); err != nil {
			t.Fatal(err)
		}
		// every chunk keeps the reservation alive: a seed may take longer than the reserve timeout
		clk.Add(4 * time.Second)
		if _, err := s.SendKV(ctx, seedChunk(4, []int64{2}, 2, false)); err != nil {
			t.Fatal(err)
		}
		clk.Add(4 * time.Second)
		if s.Store().Expire(); len(s.Store().Ingests()) != 1 {
			t.Fatal("a seed whose chunks keep coming lost its reservation")
		}
		clk.Add(2 * time.Second) // 6 s since the last chunk
		s.Store().Expire()
		if _, err := s.SendKV(ctx, seedChunk(4, []int64{3}, 3, true)); status.Code(err) != codes.Aborted {
			t.Fatalf("chunk after the reservation expired: %v", err)
		}
		if _, ok := s.Store().Get("s"); ok || s.Store().UsedBytes() != 0 {
			t.Fatal("an expired seed left something in the store")
		}
	})
	t.Run("decode room", func(t *testing.T) {
		s, _, _, _ := seedSidecar(t, Config{})
		if _, err := s.OfferReceive(ctx, &kvcv1.OfferReceiveRequest{Room: 9, SessionId: "s", Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED,
			DecodeLayout: layout(), Pages: []int64{0, 1, 2, 3}, Tokens: 14, DecodePeerAddr: "127.0.0.1:1", DecodeTransferEndpoint: "127.0.0.1:1"}); err != nil {
			t.Fatal(err)
		}
		if _, err := s.SendKV(ctx, seedChunk(9, []int64{0, 1}, 0, false)); status.Code(err) != codes.FailedPrecondition {
			t.Fatalf("a store seed in a decode room: %v", err)
		}
	})
}
