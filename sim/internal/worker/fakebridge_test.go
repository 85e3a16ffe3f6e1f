package worker

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/kvpool"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// hub plays the sidecars' transfer plane for tests: fake sidecars of several workers share it.
// Bytes really move between the workers' shared-memory pools, which the fake sidecars map by
// path exactly as a real sidecar does.
type hub struct {
	mu        sync.Mutex
	rooms     map[int64]*room
	snapshots map[string]*snapshot // D->P snapshots, taken at CommitSession
	corrupt   bool                 // flip one byte of every transfer (of the last token of a seed)
	// corruptFirst: with corrupt, a seed transfer flips a byte of its first token instead
	corruptFirst bool
	wait         time.Duration // how long a receiver waits for its sender
	// corruptLoad: LoadFromStore flips a byte of the first token it loads
	corruptLoad bool
	// loadGate, when set, runs inside LoadFromStore before it copies (a test's look at what
	// the loading worker does meanwhile)
	loadGate func()
	// pushGate, when set, runs inside a snapshot's push into a receiver before it copies (a
	// test's look at what the receiving worker does meanwhile)
	pushGate func()
}

type room struct {
	dst     *fakeSidecar
	pages   []int64
	tokens  int64
	kind    kvcv1.TransferKind
	session string
	ready   chan struct{} // receiver prepared
	done    chan struct{}
	ok      bool
	bytes   int64
	err     string
}

type snapshot struct {
	seqlen int64
	// per buffer, the token slots [0, seqlen) back to back
	bufs [][]byte
}

func newHub() *hub {
	return &hub{rooms: map[int64]*room{}, snapshots: map[string]*snapshot{}, wait: 5 * time.Second}
}

func (h *hub) room(id int64) *room {
	h.mu.Lock()
	defer h.mu.Unlock()
	r := h.rooms[id]
	if r == nil {
		r = &room{ready: make(chan struct{}), done: make(chan struct{})}
		h.rooms[id] = r
	}
	return r
}

// fakeSidecar is a WorkerBridgeService on a Unix socket, over real gRPC.
type fakeSidecar struct {
	kvcv1.UnimplementedWorkerBridgeServiceServer
	h    *hub
	name string

	mu       sync.Mutex
	bufs     [][]byte
	maps     []*kvpool.Mapping
	g        Geometry
	commits  []*kvcv1.CommitSessionRequest
	releases []*kvcv1.ReleaseSessionRequest
	// releaseGate, when set, holds ReleaseSession until closed (a push being aborted).
	releaseGate chan struct{}
	releasing   chan string
	// commitGate, when set, holds CommitSession until closed (a slow sidecar); commits in
	// progress are announced on committing.
	commitGate chan struct{}
	committing chan string
	// stop kills the fake sidecar's server (a sidecar that dies).
	stop func()
	// releaseErr, when set, is ReleaseSession's answer (a sidecar that is up but fails it).
	releaseErr error
	demands    []*kvcv1.ReportDemandRequest // ReportDemand calls, in order
}

func (f *fakeSidecar) ReportDemand(_ context.Context, req *kvcv1.ReportDemandRequest) (*kvcv1.ReportDemandResponse, error) {
	f.mu.Lock()
	f.demands = append(f.demands, req)
	f.mu.Unlock()
	return &kvcv1.ReportDemandResponse{}, nil
}

// demandReports returns the ReportDemand calls so far.
func (f *fakeSidecar) demandReports() []*kvcv1.ReportDemandRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*kvcv1.ReportDemandRequest(nil), f.demands...)
}

func (f *fakeSidecar) RegisterKVPool(_ context.Context, req *kvcv1.RegisterKVPoolRequest) (*kvcv1.RegisterKVPoolResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var bufs [][]byte
	for _, b := range req.GetBuffers() {
		m, err := kvpool.Map(b.GetShm().GetPath(), b.GetShm().GetOffset(), b.GetSizeBytes())
		if err != nil {
			return nil, status.Errorf(codes.InvalidArgument, "map: %v", err)
		}
		f.maps = append(f.maps, m)
		bufs = append(bufs, m.Bytes())
	}
	f.g = Geometry{PageSize: int(req.GetPageSize()), Layers: int(req.GetNumLayers()),
		BytesPerToken: int(req.GetItemLen()) / int(req.GetPageSize()), PageCount: req.GetPageCount()}
	f.bufs = bufs
	return &kvcv1.RegisterKVPoolResponse{KvBytesPerToken: int64(f.g.Buffers() * f.g.BytesPerToken), TransferEndpoint: f.name}, nil
}

// slot of token t in buffer b of this sidecar's worker pool.
func (f *fakeSidecar) slot(b int, pages []int64, t int64) []byte {
	off := pages[t/int64(f.g.PageSize)]*f.g.ItemLen() + (t%int64(f.g.PageSize))*int64(f.g.BytesPerToken)
	return f.bufs[b][off : off+int64(f.g.BytesPerToken)]
}

func (f *fakeSidecar) CommitSession(ctx context.Context, req *kvcv1.CommitSessionRequest) (*kvcv1.CommitSessionResponse, error) {
	f.mu.Lock()
	gate, committing := f.commitGate, f.committing
	f.mu.Unlock()
	if gate != nil {
		committing <- req.GetSessionId()
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	f.mu.Lock()
	f.commits = append(f.commits, req)
	f.mu.Unlock()
	// The "D->P push": copy the committed KV out of the worker's pages.
	s := &snapshot{seqlen: req.GetCommittedLen()}
	for b := 0; b < f.g.Buffers(); b++ {
		var out []byte
		for t := int64(0); t < req.GetCommittedLen(); t++ {
			out = append(out, f.slot(b, req.GetPages(), t)...)
		}
		s.bufs = append(s.bufs, out)
	}
	f.h.mu.Lock()
	f.h.snapshots[req.GetSessionId()] = s
	f.h.mu.Unlock()
	return &kvcv1.CommitSessionResponse{PushEnqueued: true}, nil
}

func (f *fakeSidecar) ReleaseSession(ctx context.Context, req *kvcv1.ReleaseSessionRequest) (*kvcv1.ReleaseSessionResponse, error) {
	f.mu.Lock()
	gate, releasing := f.releaseGate, f.releasing
	f.mu.Unlock()
	if gate != nil {
		releasing <- req.GetSessionId()
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.releaseErr != nil {
		return nil, f.releaseErr
	}
	f.releases = append(f.releases, req)
	return &kvcv1.ReleaseSessionResponse{PushAborted: gate != nil}, nil
}

func (f *fakeSidecar) PrepareReceive(_ context.Context, req *kvcv1.PrepareReceiveRequest) (*kvcv1.PrepareReceiveResponse, error) {
	r := f.h.room(req.GetRoom())
	r.dst, r.pages, r.tokens, r.kind, r.session = f, req.GetPages(), req.GetTokens(), req.GetKind(), req.GetSessionId()
	close(r.ready)
	if req.GetKind() == kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT {
		f.h.mu.Lock()
		s := f.h.snapshots[req.GetSessionId()]
		f.h.mu.Unlock()
		f.h.mu.Lock()
		gate := f.h.pushGate
		f.h.mu.Unlock()
		go func() {
			if gate != nil {
				gate()
			}
			if s == nil || s.seqlen < req.GetTokens() {
				r.err = "snapshot_missing"
				close(r.done)
				return
			}
			var n int64
			for b := 0; b < f.g.Buffers(); b++ {
				for t := int64(0); t < req.GetTokens(); t++ {
					bt := int64(f.g.BytesPerToken)
					n += int64(copy(f.slot(b, r.pages, t), s.bufs[b][t*bt:(t+1)*bt]))
				}
			}
			if f.h.corrupt {
				f.slot(0, r.pages, 0)[0] ^= 0xff
			}
			r.ok, r.bytes = true, n
			close(r.done)
		}()
	}
	return &kvcv1.PrepareReceiveResponse{}, nil
}

func (f *fakeSidecar) WaitReceive(ctx context.Context, req *kvcv1.WaitReceiveRequest) (*kvcv1.WaitReceiveResponse, error) {
	r := f.h.room(req.GetRoom())
	t := time.NewTimer(f.h.wait)
	defer t.Stop()
	select {
	case <-r.done:
		return &kvcv1.WaitReceiveResponse{Ok: r.ok, Bytes: r.bytes, Tokens: r.tokens, Error: r.err}, nil
	case <-t.C:
		return &kvcv1.WaitReceiveResponse{Ok: false, Error: "timeout waiting for the sender"}, nil
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

func (f *fakeSidecar) SendKV(ctx context.Context, req *kvcv1.SendKVRequest) (*kvcv1.SendKVResponse, error) {
	r := f.h.room(req.GetRoom())
	select {
	case <-r.ready:
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	if req.GetLast() && r.tokens != req.GetTokens() {
		r.err = fmt.Sprintf("sender has %d tokens, receiver wants %d", req.GetTokens(), r.tokens)
		close(r.done)
		return nil, status.Error(codes.FailedPrecondition, r.err)
	}
	// A chunk: pages hold tokens [first_page*page, ...) of the transfer.
	ps := int64(f.g.PageSize)
	from := req.GetFirstPage() * ps
	to := min((req.GetFirstPage()+int64(len(req.GetPages())))*ps, r.tokens)
	var n int64
	for b := 0; b < f.g.Buffers(); b++ {
		for t := from; t < to; t++ {
			n += int64(copy(r.dst.slot(b, r.pages, t), f.slot(b, req.GetPages(), t-from)))
		}
	}
	r.bytes += n
	if !req.GetLast() {
		return &kvcv1.SendKVResponse{Bytes: n}, nil
	}
	if f.h.corrupt {
		at := req.GetTokens() - 1
		if f.h.corruptFirst {
			at = 0
		}
		r.dst.slot(1, r.pages, at)[0] ^= 0x01
	}
	r.ok = true
	close(r.done)
	return &kvcv1.SendKVResponse{Bytes: n}, nil
}

// LoadFromStore plays the prefill sidecar's store: the session's snapshot (its decode worker's
// last commit) is copied into this worker's pages.
func (f *fakeSidecar) LoadFromStore(_ context.Context, req *kvcv1.LoadFromStoreRequest) (*kvcv1.LoadFromStoreResponse, error) {
	f.h.mu.Lock()
	s := f.h.snapshots[req.GetSessionId()]
	corrupt, gate := f.h.corruptLoad, f.h.loadGate
	f.h.mu.Unlock()
	if gate != nil {
		gate()
	}
	if s == nil {
		return nil, status.Errorf(codes.NotFound, "no snapshot of %s", req.GetSessionId())
	}
	if s.seqlen < req.GetTokens() {
		return nil, status.Errorf(codes.FailedPrecondition, "the store holds %d tokens, fewer than %d", s.seqlen, req.GetTokens())
	}
	var n int64
	bt := int64(f.g.BytesPerToken)
	for b := 0; b < f.g.Buffers(); b++ {
		for t := int64(0); t < req.GetTokens(); t++ {
			n += int64(copy(f.slot(b, req.GetPages(), t), s.bufs[b][t*bt:(t+1)*bt]))
		}
	}
	if corrupt {
		f.slot(0, req.GetPages(), 0)[0] ^= 0xff
	}
	return &kvcv1.LoadFromStoreResponse{Bytes: n, Tokens: req.GetTokens(), Seqlen: s.seqlen}, nil
}

func (f *fakeSidecar) snapshotOf() (commits []*kvcv1.CommitSessionRequest, releases []*kvcv1.ReleaseSessionRequest) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append(commits, f.commits...), append(releases, f.releases...)
}

// startFakeSidecar serves a fake sidecar on a Unix socket and returns a client of it.
func startFakeSidecar(t *testing.T, h *hub, name string) (*fakeSidecar, Bridge) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "b.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeSidecar{h: h, name: name}
	srv := grpcx.NewServer(zerolog.Nop())
	kvcv1.RegisterWorkerBridgeServiceServer(srv, f)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = srv.Serve(ctx, lis, time.Second); close(done) }()
	f.stop = func() { srv.Stop() }
	conn, err := grpc.NewClient("unix://"+sock, append(grpcx.ClientOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = conn.Close()
		cancel()
		<-done
		f.mu.Lock()
		for _, m := range f.maps {
			_ = m.Close()
		}
		f.mu.Unlock()
	})
	return f, kvcv1.NewWorkerBridgeServiceClient(conn)
}
