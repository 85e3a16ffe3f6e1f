package decode

import (
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func idRange(from, n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(5000 + from + i)
	}
	return out
}

// servePeer serves a fake prefill sidecar's TransferPeerService on a real listener.
func servePeer(t *testing.T, f kvcv1.TransferPeerServiceServer) string {
	t.Helper()
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
	return lis.Addr().String()
}

// TestCommitKeepsTokenIDs: a commit's ids are kept with the session when they are exactly the
// committed range's, each non-negative; a bad count or a negative id is INVALID_ARGUMENT and
// changes nothing; a later commit without ids leaves the session without (its range's ids are
// unknown).
func TestCommitKeepsTokenIDs(t *testing.T) {
	s := newTestSidecar(t)
	commit := func(n int64, ids []int32) error {
		_, err := s.CommitSession(context.Background(), &kvcv1.CommitSessionRequest{SessionId: "S", CommittedLen: n, Pages: pages(int((n + 3) / 4)), TokenIds: ids})
		return err
	}
	held := func() []int32 {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.sessions["S"].ids
	}
	if err := commit(10, idRange(0, 10)); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(held(), idRange(0, 10)) {
		t.Fatalf("held %v", held())
	}
	for _, bad := range [][]int32{idRange(0, 11), idRange(0, 13), append(idRange(0, 11), -7)} {
		if err := commit(12, bad); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "token_ids") {
			t.Fatalf("commit of 12 with %d ids: %v, want INVALID_ARGUMENT naming token_ids", len(bad), err)
		}
	}
	if !slices.Equal(held(), idRange(0, 10)) {
		t.Fatalf("a refused commit changed the ids: %v", held())
	}
	if err := commit(12, nil); err != nil {
		t.Fatal(err)
	}
	if held() != nil {
		t.Fatalf("a commit without ids kept %d", len(held()))
	}
}

// TestPushCarriesTokenIDs: each reservation of a push carries the ids of its own range — the
// append's [base, end) (or [0, end) while the store is not known to hold the base's ids: after
// a seed P stored, a new target), and after a base mismatch the full push's [0, end) — and a
// push of a session committed without ids carries none.
func TestPushCarriesTokenIDs(t *testing.T) {
	const mismatch = kvcv1.PeerErrorReason_PEER_ERROR_REASON_BASE_MISMATCH
	for _, c := range []struct{ withIDs, from0 bool }{{true, false}, {true, true}, {false, false}} {
		withIDs := c.withIDs
		s := newTestSidecar(t)
		pool, err := s.registeredPool()
		if err != nil {
			t.Fatal(err)
		}
		f := &scriptedStore{script: []error{peerErr(codes.FailedPrecondition, mismatch, "m"), status.Error(codes.Internal, "no"), status.Error(codes.Internal, "no")}}
		addr := servePeer(t, f)
		job := pushJob{session: "s", gen: 4, base: 8, end: 16, pages: pages(4),
			target: &kvcv1.SetSnapshotTargetCommand{SessionId: "s", PrefillWorkerId: "p", PeerAddr: addr, Generation: 4}}
		if withIDs {
			job.ids, job.idsFrom0 = idRange(0, 16), c.from0
		}
		if _, err := s.doPush(context.Background(), pool, job); err == nil {
			t.Fatal("push succeeded against a store that refuses everything")
		}
		f.mu.Lock()
		got := f.got
		f.mu.Unlock()
		if len(got) < 2 {
			t.Fatalf("%d reserves", len(got))
		}
		want := [][]int32{idRange(8, 8), idRange(0, 16)}
		if c.from0 {
			want[0] = idRange(0, 16)
		}
		for i, r := range got[:2] {
			if !withIDs {
				if len(r.GetTokenIds()) != 0 {
					t.Fatalf("reserve %d of a push without ids carried %d", i, len(r.GetTokenIds()))
				}
				continue
			}
			if !slices.Equal(r.GetTokenIds(), want[i]) {
				t.Fatalf("reserve %d (base %d) carried ids %v, want %v", i, r.GetBaseLen(), r.GetTokenIds(), want[i])
			}
		}
	}
}

// tokenPeer answers SnapshotTokens as scripted and records the requests.
type tokenPeer struct {
	kvcv1.UnimplementedTransferPeerServiceServer
	ids []int32
	err error
	mu  sync.Mutex
	got []*kvcv1.SnapshotTokensRequest
}

func (p *tokenPeer) SnapshotTokens(_ context.Context, req *kvcv1.SnapshotTokensRequest) (*kvcv1.SnapshotTokensResponse, error) {
	p.mu.Lock()
	p.got = append(p.got, req)
	p.mu.Unlock()
	if p.err != nil {
		return nil, p.err
	}
	return &kvcv1.SnapshotTokensResponse{TokenIds: p.ids, Generation: 3, StoredSeqlen: 100}, nil
}

// unimplementedPeer is a prefill sidecar from before SnapshotTokens.
type unimplementedPeer struct {
	kvcv1.UnimplementedTransferPeerServiceServer
}

// TestLoadSendsTokenIDs: a load asks the prefill peer for the snapshot's ids (its session,
// generation and seqlen) and sends them to the worker as input_ids; a snapshot without ids, a
// peer without the call, one that holds another snapshot or cannot be reached load as before
// (no input_ids); an answer that does not fit the load fails it with token_ids_invalid and
// never reaches the worker.
func TestLoadSendsTokenIDs(t *testing.T) {
	ids := idRange(0, 100)
	tests := []struct {
		name    string
		peer    kvcv1.TransferPeerServiceServer // nil: nothing listens at the address
		wantIDs bool
		fail    string // LOAD_FAILED detail (""; loaded)
		source  string // the kvc_sidecar_load_token_ids_total label counted
	}{
		{"ids", &tokenPeer{ids: ids}, true, "", "ids"},
		{"pushed without ids", &tokenPeer{}, false, "", "none"},
		{"another generation", &tokenPeer{err: status.Error(codes.FailedPrecondition, "generation 2")}, false, "", "none"},
		{"no snapshot", &tokenPeer{err: status.Error(codes.NotFound, "no snapshot")}, false, "", "none"},
		{"an older prefill sidecar", unimplementedPeer{}, false, "", "none"},
		{"unreachable", nil, false, "", "error"},
		{"too few ids", &tokenPeer{ids: ids[:99]}, false, "token_ids_invalid", "invalid"},
		{"a negative id", &tokenPeer{ids: append(slices.Clone(ids[:99]), -1)}, false, "token_ids_invalid", "invalid"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			addr := "127.0.0.1:1" // nothing listens there
			if tc.peer != nil {
				addr = servePeer(t, tc.peer)
			}
			s := newTestSidecar(t)
			var mu sync.Mutex
			var gen map[string]any
			generated := false
			w := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
				b, _ := io.ReadAll(r.Body)
				if r.URL.Path == "/open_session" {
					_, _ = rw.Write([]byte(`"S"`))
					return
				}
				mu.Lock()
				generated = true
				_ = json.Unmarshal(b, &gen)
				mu.Unlock()
				if _, err := s.CommitSession(context.Background(), &kvcv1.CommitSessionRequest{SessionId: "S", CommittedLen: 100, Pages: pages(25)}); err != nil {
					t.Errorf("commit: %v", err)
				}
				_, _ = rw.Write([]byte(`{"meta_info":{"kvc":{"kv_len_after":100,"verified_bytes":6400}}}`))
			}))
			defer w.Close()
			s.cfg.WorkerURL = w.URL
			rep := &recordingReporter{}
			s.SetReporter(rep)
			c := &kvcv1.LoadSessionCommand{SessionId: "S", SnapshotGeneration: 3, Seqlen: 100, PrefillWorkerId: "p0", PrefillPeerAddr: addr, Room: 7, DecisionId: "d-1"}
			s.loadSession(context.Background(), c)
			if tc.fail != "" {
				ev := rep.kinds(kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOAD_FAILED)["S"]
				if ev == nil || !strings.Contains(ev.GetDetail(), tc.fail) {
					t.Fatalf("want LOAD_FAILED naming %q, got %v", tc.fail, rep.evs)
				}
				if generated {
					t.Fatal("the worker was asked to load with ids that do not fit")
				}
			} else if rep.kinds(kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOADED)["S"] == nil {
				t.Fatalf("not loaded: %v", rep.evs)
			}
			if p, ok := tc.peer.(*tokenPeer); ok {
				p.mu.Lock()
				if len(p.got) != 1 || p.got[0].GetSessionId() != "S" || p.got[0].GetGeneration() != 3 || p.got[0].GetSeqlen() != 100 {
					t.Fatalf("SnapshotTokens requests %v", p.got)
				}
				p.mu.Unlock()
			}
			mu.Lock()
			defer mu.Unlock()
			raw, has := gen["input_ids"]
			if has != tc.wantIDs {
				t.Fatalf("input_ids sent: %v, want %v (body %v)", has, tc.wantIDs, gen)
			}
			if tc.wantIDs {
				var got []int32
				b, _ := json.Marshal(raw)
				if err := json.Unmarshal(b, &got); err != nil || !slices.Equal(got, ids) {
					t.Fatalf("input_ids %v, want the snapshot's %d ids", raw, len(ids))
				}
			}
			if n := testutil.ToFloat64(s.loadIDs.WithLabelValues(tc.source)); n != 1 {
				t.Fatalf("kvc_sidecar_load_token_ids_total{source=%q} = %v, want 1", tc.source, n)
			}
		})
	}
}
