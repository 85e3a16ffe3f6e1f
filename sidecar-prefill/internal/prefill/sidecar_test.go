package prefill

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func newTestSidecar(t *testing.T, register bool) *Sidecar {
	t.Helper()
	return newTestSidecarWith(t, register, nil)
}

// newTestSidecarWith is newTestSidecar whose tcp engine is wrapped by wrap (nil: none).
func newTestSidecarWith(t *testing.T, register bool, wrap func(rdma.Engine) rdma.Engine) *Sidecar {
	t.Helper()
	eng, err := rdma.New(context.Background(), rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = eng.Close() })
	if wrap != nil {
		eng = wrap(eng)
	}
	s := New(Config{WorkerID: "p", StoreBytes: 16 * 2 * 32}, eng, nil, zerolog.Nop())
	t.Cleanup(s.Close)
	if !register {
		return s
	}
	p, err := kvpool.Create(t.TempDir(), kvpool.Spec{PageSize: 4, ItemLen: 32, NumLayers: 1, PageCount: 8})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	req := &kvcv1.RegisterKVPoolRequest{PageSize: 4, ItemLen: 32, PageCount: 8, NumLayers: 1}
	for i, k := range []kvcv1.KVKind{kvcv1.KVKind_KV_KIND_K, kvcv1.KVKind_KV_KIND_V} {
		req.Buffers = append(req.Buffers, &kvcv1.KVBuffer{Layer: 0, Kind: k, Memory: &kvcv1.KVBuffer_Shm{Shm: &kvcv1.SharedMemoryRef{Path: p.Path(), Offset: p.Offset(i)}}})
	}
	if _, err := s.RegisterKVPool(context.Background(), req); err != nil {
		t.Fatal(err)
	}
	return s
}

func layout() *kvcv1.KVLayout {
	return &kvcv1.KVLayout{PageSize: 4, ItemLen: 32, NumLayers: 1, PageCount: 8, BufferAddrs: []uint64{1 << 20, 2 << 20}}
}

func TestBeforeRegistration(t *testing.T) {
	s := newTestSidecar(t, false)
	_, err := s.ReserveSnapshot(context.Background(), &kvcv1.ReserveSnapshotRequest{SessionId: "a", Tokens: 4, SourceLayout: layout()})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("reserve before registration: %v", err)
	}
	if _, err := s.SendKV(context.Background(), &kvcv1.SendKVRequest{Room: 1, Pages: []int64{0}}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("SendKV before registration: %v", err)
	}
}

func TestPeerValidation(t *testing.T) {
	s := newTestSidecar(t, true)
	ctx := context.Background()
	good := func() *kvcv1.OfferReceiveRequest {
		return &kvcv1.OfferReceiveRequest{Room: 9, SessionId: "a", Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED, DecodeLayout: layout(),
			Pages: []int64{0, 1}, Tokens: 8, DecodePeerAddr: "127.0.0.1:1", DecodeTransferEndpoint: "127.0.0.1:1"}
	}
	tests := []struct {
		name string
		mod  func(r *kvcv1.OfferReceiveRequest)
		want codes.Code
	}{
		{"no room", func(r *kvcv1.OfferReceiveRequest) { r.Room = 0 }, codes.InvalidArgument},
		{"no tokens", func(r *kvcv1.OfferReceiveRequest) { r.Tokens = 0 }, codes.InvalidArgument},
		{"pages short", func(r *kvcv1.OfferReceiveRequest) { r.Tokens = 9 }, codes.InvalidArgument},
		{"no layout", func(r *kvcv1.OfferReceiveRequest) { r.DecodeLayout = nil }, codes.InvalidArgument},
		{"unknown kind", func(r *kvcv1.OfferReceiveRequest) { r.Kind = 7 }, codes.InvalidArgument},
		{"no peer", func(r *kvcv1.OfferReceiveRequest) { r.DecodePeerAddr = "" }, codes.InvalidArgument},
		{"bad session", func(r *kvcv1.OfferReceiveRequest) { r.SessionId = "a/b" }, codes.InvalidArgument},
		{"ok", func(*kvcv1.OfferReceiveRequest) {}, codes.OK},
		{"twice", func(*kvcv1.OfferReceiveRequest) {}, codes.AlreadyExists},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := good()
			tt.mod(r)
			if _, err := s.OfferReceive(ctx, r); status.Code(err) != tt.want {
				t.Fatalf("got %v, want %v", err, tt.want)
			}
		})
	}
	// reserve: layout mismatch, larger than the store (16 pages), then a good one
	bad := layout()
	bad.ItemLen = 64
	if _, err := s.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: "a", Tokens: 4, SourceLayout: bad}); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("layout mismatch: %v", err)
	}
	if _, err := s.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: "a", Tokens: 65, SourceLayout: layout()}); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("too large: %v", err)
	}
	r, err := s.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: "a", Generation: 1, Tokens: 10, SourceLayout: layout()})
	if err != nil || len(r.GetPages()) != 3 || r.GetStoreTransferEndpoint() == "" || len(r.GetStoreLayout().GetBufferAddrs()) != 2 {
		t.Fatalf("reserve: %v %v", r, err)
	}
	if c, err := s.CommitSnapshot(ctx, &kvcv1.CommitSnapshotRequest{IngestId: r.GetIngestId()}); err != nil || c.GetSeqlen() != 10 {
		t.Fatalf("commit: %v %v", c, err)
	}
	if rs := s.Resync(); len(rs.GetSnapshots()) != 1 || rs.GetSnapshots()[0].GetSeqlen() != 10 {
		t.Fatalf("resync %v", rs)
	}
	// a push for a session the store lacks is refused at once
	err = s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_PushSnapshot{PushSnapshot: &kvcv1.PushSnapshotCommand{SessionId: "zz", Room: 77}}})
	if err == nil {
		t.Fatal("push of a missing snapshot accepted")
	}
	// a drain is the control plane's business: it sends a prefill sidecar none, and one that
	// comes is refused like any command for a decode sidecar (it was acked and ignored before)
	err = s.Apply(ctx, &kvcv1.Command{Action: &kvcv1.Command_Drain{Drain: &kvcv1.DrainCommand{Draining: true}}})
	if err == nil || !strings.Contains(err.Error(), "not for a prefill sidecar") {
		t.Fatalf("drain command: %v, want refused", err)
	}
}

func TestSnapshotStatusHTTP(t *testing.T) {
	s := newTestSidecar(t, true)
	ctx := context.Background()
	r, err := s.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: "sess", Generation: 2, Tokens: 6, SourceLayout: layout(), SourceWorkerId: "d"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.CommitSnapshot(ctx, &kvcv1.CommitSnapshotRequest{IngestId: r.GetIngestId()}); err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	s.Mount(mux)
	tests := []struct {
		path   string
		code   int
		exists bool
		seqlen int64
	}{
		{"/v1/sessions/sess/snapshot_status", 200, true, 6},
		{"/v1/sessions/other/snapshot_status", 200, false, 0},
		{"/v1/sessions/%01/snapshot_status", 400, false, 0},
		{"/v1/sessions/other/snapshot_kv", 404, false, 0},
	}
	for _, tt := range tests {
		t.Run(tt.path, func(t *testing.T) {
			w := httptest.NewRecorder()
			mux.ServeHTTP(w, httptest.NewRequest("GET", tt.path, nil))
			if w.Code != tt.code {
				t.Fatalf("HTTP %d: %s", w.Code, w.Body)
			}
			if tt.code != 200 {
				return
			}
			var st snapshotStatus
			if err := json.Unmarshal(w.Body.Bytes(), &st); err != nil {
				t.Fatal(err)
			}
			if st.Exists != tt.exists || st.Seqlen != tt.seqlen || (tt.exists && (st.Generation != 2 || st.Source != "d")) {
				t.Fatalf("status %+v", st)
			}
		})
	}
	w := httptest.NewRecorder()
	mux.ServeHTTP(w, httptest.NewRequest("GET", "/v1/sessions/sess/snapshot_kv", nil))
	if w.Code != 200 || w.Body.Len() != 6*8*2 {
		t.Fatalf("snapshot_kv: HTTP %d, %d bytes", w.Code, w.Body.Len())
	}
}

// waitEngine gives a tcp engine a WaitReady, like the cuda engine's.
type waitEngine struct {
	rdma.Engine
	err     error
	handles [][]byte
}

func (w *waitEngine) WaitReady(_ context.Context, h []byte) error {
	w.handles = append(w.handles, h)
	return w.err
}

// TestCommitReadyEvent: a commit carrying a ready event waits for it and commits; a failed
// wait aborts the ingest (the session can reserve again); a bad handle or an engine without
// ready events is refused and leaves the ingest as it was.
func TestCommitReadyEvent(t *testing.T) {
	ctx := context.Background()
	ev := make([]byte, rdma.ReadyEventSize)
	ev[3] = 9
	reserve := func(t *testing.T, s *Sidecar) uint64 {
		t.Helper()
		r, err := s.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: "a", Generation: 1, Tokens: 8, SourceLayout: layout()})
		if err != nil {
			t.Fatal(err)
		}
		return r.GetIngestId()
	}
	t.Run("waits then commits", func(t *testing.T) {
		w := &waitEngine{}
		s := newTestSidecarWith(t, true, func(e rdma.Engine) rdma.Engine { w.Engine = e; return w })
		c, err := s.CommitSnapshot(ctx, &kvcv1.CommitSnapshotRequest{IngestId: reserve(t, s), ReadyEvent: ev})
		if err != nil || c.GetSeqlen() != 8 {
			t.Fatalf("commit: %v %v", c, err)
		}
		if len(w.handles) != 1 || string(w.handles[0]) != string(ev) {
			t.Fatalf("waited on %v", w.handles)
		}
	})
	t.Run("failed wait aborts", func(t *testing.T) {
		w := &waitEngine{err: context.DeadlineExceeded}
		s := newTestSidecarWith(t, true, func(e rdma.Engine) rdma.Engine { w.Engine = e; return w })
		id := reserve(t, s)
		if _, err := s.CommitSnapshot(ctx, &kvcv1.CommitSnapshotRequest{IngestId: id, ReadyEvent: ev}); status.Code(err) != codes.Aborted {
			t.Fatalf("commit after a failed wait: %v, want Aborted", err)
		}
		if _, err := s.CommitSnapshot(ctx, &kvcv1.CommitSnapshotRequest{IngestId: id}); err == nil {
			t.Fatal("the aborted ingest committed")
		}
		if rs := s.Resync(); len(rs.GetSnapshots()) != 0 {
			t.Fatalf("snapshots after an aborted ingest: %v", rs.GetSnapshots())
		}
		reserve(t, s) // the session's reservation is gone: a new one is accepted
	})
	t.Run("refused", func(t *testing.T) {
		s := newTestSidecar(t, true) // plain tcp: no ready events
		id := reserve(t, s)
		if _, err := s.CommitSnapshot(ctx, &kvcv1.CommitSnapshotRequest{IngestId: id, ReadyEvent: ev[:10]}); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("short handle: %v, want InvalidArgument", err)
		}
		if _, err := s.CommitSnapshot(ctx, &kvcv1.CommitSnapshotRequest{IngestId: id, ReadyEvent: ev}); status.Code(err) != codes.FailedPrecondition {
			t.Fatalf("ready event on tcp: %v, want FailedPrecondition", err)
		}
		if c, err := s.CommitSnapshot(ctx, &kvcv1.CommitSnapshotRequest{IngestId: id}); err != nil || c.GetSeqlen() != 8 {
			t.Fatalf("the refused commits left the ingest unusable: %v %v", c, err)
		}
	})
}
