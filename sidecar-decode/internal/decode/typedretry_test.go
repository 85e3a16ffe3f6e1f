package decode

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// scriptedStore answers ReserveSnapshot with the next scripted refusal and records every
// request; it is served over real gRPC, so the refusals' details cross the wire.
type scriptedStore struct {
	kvcv1.UnimplementedTransferPeerServiceServer
	mu     sync.Mutex
	script []error
	got    []*kvcv1.ReserveSnapshotRequest
}

func (f *scriptedStore) ReserveSnapshot(_ context.Context, req *kvcv1.ReserveSnapshotRequest) (*kvcv1.ReserveSnapshotResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.got = append(f.got, req)
	if len(f.script) == 0 {
		return nil, status.Error(codes.Internal, "script exhausted")
	}
	err := f.script[0]
	f.script = f.script[1:]
	return nil, err
}

func (f *scriptedStore) reserves() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var b []string
	for _, r := range f.got {
		b = append(b, fmt.Sprintf("base=%d/retag=%d", r.GetBaseLen(), r.GetRetagFromGeneration()))
	}
	return strings.Join(b, " ")
}

func peerErr(code codes.Code, r kvcv1.PeerErrorReason, msg string) error {
	return kvxfer.PeerStatus(code, &kvcv1.PeerError{Reason: r}, "%s", msg)
}

// TestTypedRetry: each retry path of a push follows the store's typed refusal — a base mismatch
// is followed by one full push at once, a stale generation is never retried, anything else
// (ingest busy, store full) is retried once with the same range — and a refusal without the
// detail is never read by its text (the message of a base mismatch alone is an ordinary failure).
func TestTypedRetry(t *testing.T) {
	const (
		mismatch = kvcv1.PeerErrorReason_PEER_ERROR_REASON_BASE_MISMATCH
		stale    = kvcv1.PeerErrorReason_PEER_ERROR_REASON_GENERATION_STALE
		busy     = kvcv1.PeerErrorReason_PEER_ERROR_REASON_INGEST_BUSY
		full     = kvcv1.PeerErrorReason_PEER_ERROR_REASON_STORE_FULL
	)
	tests := []struct {
		name   string
		base   int64
		retag  uint64
		script []error
		want   string // the reserves sent
		is     error  // the push's error
	}{
		{"base mismatch: one full push at once", 8, 0,
			[]error{peerErr(codes.FailedPrecondition, mismatch, "m"), peerErr(codes.ResourceExhausted, full, "f"), peerErr(codes.ResourceExhausted, full, "f")},
			"base=8/retag=0 base=0/retag=0 base=0/retag=0", kvxfer.ErrStoreFull},
		{"re-tag refused: full push without re-tag", 8, 3,
			[]error{peerErr(codes.FailedPrecondition, mismatch, "m"), peerErr(codes.FailedPrecondition, stale, "s")},
			"base=8/retag=3 base=0/retag=0", kvxfer.ErrGenerationStale},
		{"a second base mismatch is not followed by a third full push", 8, 0,
			[]error{peerErr(codes.FailedPrecondition, mismatch, "m"), peerErr(codes.FailedPrecondition, mismatch, "m"), peerErr(codes.FailedPrecondition, mismatch, "m")},
			"base=8/retag=0 base=0/retag=0 base=0/retag=0", kvxfer.ErrBaseMismatch},
		{"stale generation: never retried", 8, 0,
			[]error{peerErr(codes.FailedPrecondition, stale, "s")},
			"base=8/retag=0", kvxfer.ErrGenerationStale},
		{"ingest busy: retried once", 8, 0,
			[]error{peerErr(codes.Aborted, busy, "b"), peerErr(codes.Aborted, busy, "b")},
			"base=8/retag=0 base=8/retag=0", kvxfer.ErrIngestBusy},
		{"the old message without a detail is no base mismatch", 8, 0,
			[]error{status.Error(codes.FailedPrecondition, "base_len 8 does not match the stored seqlen 0 of generation 1"),
				status.Error(codes.FailedPrecondition, "base_len 8 does not match the stored seqlen 0 of generation 1")},
			"base=8/retag=0 base=8/retag=0", nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := newTestSidecar(t)
			pool, err := s.registeredPool()
			if err != nil {
				t.Fatal(err)
			}
			f := &scriptedStore{script: tc.script}
			srv := grpcx.NewServer(zerolog.Nop())
			kvcv1.RegisterTransferPeerServiceServer(srv, f)
			lis, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithCancel(context.Background())
			served := make(chan struct{})
			go func() { defer close(served); _ = srv.Serve(ctx, lis, time.Second) }()
			t.Cleanup(func() { cancel(); <-served })
			job := pushJob{session: "s", gen: 4, base: tc.base, end: 16, retag: tc.retag, pages: pages(4),
				target: &kvcv1.SetSnapshotTargetCommand{SessionId: "s", PrefillWorkerId: "p", PeerAddr: lis.Addr().String(), Generation: 4}}
			_, err = s.doPush(context.Background(), pool, job)
			if err == nil {
				t.Fatal("push succeeded against a store that refuses everything")
			}
			if got := f.reserves(); got != tc.want {
				t.Fatalf("reserves %q, want %q", got, tc.want)
			}
			if tc.is != nil && !errors.Is(err, tc.is) {
				t.Fatalf("push error %v, want %v", err, tc.is)
			}
			if tc.is == nil && status.Code(err) != codes.FailedPrecondition {
				t.Fatalf("push error %v", err)
			}
		})
	}
}

// TestValidBase: a target carrying a valid base (the snapshot a reseed wrote here) makes the
// base count as pushed: the next push is an append from it that re-tags the store's entry; a
// target of the same generation (after a sidecar restart) appends without re-tag; a base longer
// than the commit, or without its generation, is ignored.
func TestValidBase(t *testing.T) {
	tests := []struct {
		name      string
		before    bool // the target arrives before the first commit
		base      int64
		from, gen uint64
		committed int64
		wantLast  int64
		wantRetag uint64
	}{
		{"reseed, target after the commit", false, 40, 3, 4, 60, 40, 3},
		{"reseed, target before the commit", true, 40, 3, 4, 60, 40, 3},
		{"same generation (restart)", false, 40, 4, 4, 60, 40, 0},
		{"base longer than the commit", false, 80, 3, 4, 60, 0, 0},
		{"no base generation", false, 40, 0, 4, 60, 0, 0},
		{"base generation newer than the target's", false, 40, 5, 4, 60, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := newTestSidecar(t)
			tgt := &kvcv1.SetSnapshotTargetCommand{SessionId: "s", PrefillWorkerId: "p", PeerAddr: "127.0.0.1:1", TransferEndpoint: "x",
				Generation: tc.gen, ValidBaseLen: tc.base, BaseGeneration: tc.from}
			commit := func() {
				if _, err := s.CommitSession(context.Background(), &kvcv1.CommitSessionRequest{SessionId: "s", CommittedLen: tc.committed, Pages: pages(int(tc.committed+3) / 4)}); err != nil {
					t.Fatal(err)
				}
			}
			if tc.before {
				if err := s.setTarget(tgt); err != nil {
					t.Fatal(err)
				}
				commit()
			} else {
				commit()
				if err := s.setTarget(tgt); err != nil {
					t.Fatal(err)
				}
			}
			s.mu.Lock()
			ss := s.sessions["s"]
			last, retag := ss.lastPushed, ss.retagFrom
			s.mu.Unlock()
			if last != tc.wantLast || retag != tc.wantRetag {
				t.Fatalf("last pushed %d, re-tag from %d; want %d, %d", last, retag, tc.wantLast, tc.wantRetag)
			}
			// the resync tells the control plane the target is known
			rs := s.Resync()
			if len(rs.GetSessions()) != 1 || !rs.GetSessions()[0].GetHasSnapshotTarget() {
				t.Fatalf("resync %v", rs)
			}
		})
	}
}
