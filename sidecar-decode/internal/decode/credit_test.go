package decode

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/rdma"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// syncEngine runs every batch to completion inside Submit (the bytes have landed when Submit
// returns; Wait hands back the results) and announces each completed batch to whoever waits on
// changed(): the store below can wait for bytes to land without polling.
type syncEngine struct {
	rdma.Engine
	mu   sync.Mutex
	ch   chan struct{}
	done map[rdma.BatchID]syncResult
}

type syncResult struct {
	sts []rdma.TaskStatus
	err error
}

func (w *syncEngine) changed() <-chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.ch == nil {
		w.ch = make(chan struct{})
	}
	return w.ch
}

func (w *syncEngine) Submit(ctx context.Context, id rdma.BatchID, reqs []rdma.Request) error {
	if err := w.Engine.Submit(ctx, id, reqs); err != nil {
		return err
	}
	sts, err := w.Engine.Wait(ctx, id)
	w.mu.Lock()
	if w.done == nil {
		w.done = map[rdma.BatchID]syncResult{}
	}
	w.done[id] = syncResult{sts, err}
	if w.ch != nil {
		close(w.ch)
	}
	w.ch = make(chan struct{})
	w.mu.Unlock()
	return nil
}

func (w *syncEngine) Wait(ctx context.Context, id rdma.BatchID) ([]rdma.TaskStatus, error) {
	w.mu.Lock()
	r, ok := w.done[id]
	delete(w.done, id)
	w.mu.Unlock()
	if !ok {
		return w.Engine.Wait(ctx, id)
	}
	return r.sts, r.err
}

// creditStore is a snapshot store's TransferPeerService over a real arena that grants credit
// like the prefill store: a reservation using credit takes the credit's first pages, and tops
// the credit up afterwards. A reservation using credit answers only once the credit pages hold
// the push's bytes (written checks them): a push that reserved before it copied would hang.
type creditStore struct {
	kvcv1.UnimplementedTransferPeerServiceServer
	endpoint string
	layout   *kvcv1.KVLayout
	written  func(ctx context.Context, pages []int64, tokens int64) error

	mu      sync.Mutex
	next    int64 // next free store page
	ingest  uint64
	credit  []int64
	id      uint64
	log     []string
	reserve map[uint64][]int64
}

func (f *creditStore) ReserveSnapshot(ctx context.Context, req *kvcv1.ReserveSnapshotRequest) (*kvcv1.ReserveSnapshotResponse, error) {
	use := req.GetUseCreditPages()
	f.mu.Lock()
	f.log = append(f.log, fmt.Sprintf("reserve(use=%d)", use))
	if use > 0 && (req.GetCreditId() != f.id || use > int64(len(f.credit))) {
		f.mu.Unlock()
		return nil, kvxfer.PeerStatus(codes.FailedPrecondition, &kvcv1.PeerError{Reason: kvcv1.PeerErrorReason_PEER_ERROR_REASON_CREDIT_REFUSED}, "credit %d is stale: its credit is now %d", req.GetCreditId(), f.id)
	}
	used := slices.Clone(f.credit[:use])
	f.mu.Unlock()
	if use > 0 {
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := f.written(wctx, used, min(use*4, req.GetTokens()))
		cancel()
		if err != nil {
			return nil, status.Errorf(codes.DeadlineExceeded, "credit pages never written before the reservation: %v", err)
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	pages := slices.Clone(used)
	f.credit = f.credit[use:]
	for int64(len(pages)) < (req.GetTokens()+3)/4 {
		pages = append(pages, f.next)
		f.next++
	}
	changed := use > 0
	for int64(len(f.credit)) < req.GetCreditPages() {
		f.credit = append(f.credit, f.next)
		f.next++
		changed = true
	}
	if changed {
		f.id++
	}
	f.ingest++
	f.reserve[f.ingest] = pages
	return &kvcv1.ReserveSnapshotResponse{IngestId: f.ingest, StoreLayout: f.layout, Pages: pages, StoreTransferEndpoint: f.endpoint,
		CreditPages: slices.Clone(f.credit), CreditId: f.id}, nil
}

func (f *creditStore) CommitSnapshot(_ context.Context, req *kvcv1.CommitSnapshotRequest) (*kvcv1.CommitSnapshotResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.log = append(f.log, "commit")
	return &kvcv1.CommitSnapshotResponse{Seqlen: 12}, nil
}

func (f *creditStore) AbortSnapshot(context.Context, *kvcv1.AbortSnapshotRequest) (*kvcv1.AbortSnapshotResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.log = append(f.log, "abort")
	return &kvcv1.AbortSnapshotResponse{}, nil
}

func (f *creditStore) takeLog() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	l := strings.Join(f.log, ",")
	f.log = nil
	return l
}

// TestPushWithCredit: a full push with store credit copies its first tokens into the credit
// pages before the reservation answers (the store answers only after they hold the bytes), then
// the rest into the reserved pages; every byte lands where the reservation says; the credit is
// used, then topped up under a new id; a stale credit id fails the attempt cleanly and the
// retry pushes without credit.
func TestPushWithCredit(t *testing.T) {
	we := &syncEngine{}
	s := newTestSidecarWith(t, func(e rdma.Engine) rdma.Engine { we.Engine = e; return we })
	s.cfg.SnapshotCreditPages = 2
	pool, err := s.registeredPool()
	if err != nil {
		t.Fatal(err)
	}
	storeEng, err := rdma.New(context.Background(), rdma.Config{Backend: "tcp", ListenAddr: "127.0.0.1:0", Conns: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = storeEng.Close() })
	store, err := kvxfer.NewArena(kvxfer.Shape{PageSize: 4, ItemLen: 32, PageCount: 64, NumLayers: 1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	if err := store.Register(storeEng, "host"); err != nil {
		t.Fatal(err)
	}
	var srcPages []int64 // the pages of the push being checked
	var srcMu sync.Mutex
	// landed reports whether tokens [0, tokens) of the push's source pages are in store pages.
	landed := func(pages []int64, tokens int64) bool {
		srcMu.Lock()
		src := srcPages
		srcMu.Unlock()
		for b := 0; b < pool.Buffers(); b++ {
			for tok := int64(0); tok < tokens; tok++ {
				if string(pool.TokenSlot(src, tok, b)) != string(store.TokenSlot(pages, tok, b)) {
					return false
				}
			}
		}
		return true
	}
	f := &creditStore{endpoint: storeEng.SegmentName(), layout: store.Layout(), reserve: map[uint64][]int64{},
		written: func(ctx context.Context, pages []int64, tokens int64) error {
			for {
				ch := we.changed()
				if landed(pages, tokens) {
					return nil
				}
				select {
				case <-ch:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
		}}
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
	addr := lis.Addr().String()
	target := &kvcv1.SetSnapshotTargetCommand{SessionId: "s", PrefillWorkerId: "p", PeerAddr: addr, Generation: 1}

	steps := []struct {
		name       string
		pages      []int64 // source pages (12 tokens)
		before     func()
		wantLog    string
		overlapped bool
	}{
		{"first push: no credit yet, asks for some", []int64{5, 9, 2}, nil, "reserve(use=0),commit", false},
		{"second push: copies into the credit first", []int64{7, 1, 11}, nil, "reserve(use=2),commit", true},
		{"third push: uses the topped-up credit", []int64{3, 4, 6}, nil, "reserve(use=2),commit", true},
		{"stale credit id: the attempt fails, the retry goes without", []int64{8, 10, 12}, func() {
			f.mu.Lock()
			f.id += 100 // as if the store had dropped and re-granted the credit
			f.mu.Unlock()
		}, "reserve(use=2),reserve(use=0),commit", false},
		{"credit again after the fallback", []int64{13, 14, 15}, nil, "reserve(use=2),commit", true},
		{"a re-opened segment drops the credit", []int64{16, 17, 18}, func() { s.segs.Forget(f.endpoint) }, "reserve(use=0),commit", false},
		{"credit again after the re-open", []int64{19, 20, 21}, nil, "reserve(use=2),commit", true},
	}
	for i, st := range steps {
		for b := 0; b < pool.Buffers(); b++ {
			for _, p := range st.pages {
				for j := range pool.Buffer(b)[p*32:][:32] {
					pool.Buffer(b)[p*32+int64(j)] = byte(i*31 + int(p)*7 + j + b*3 + 1)
				}
			}
		}
		srcMu.Lock()
		srcPages = st.pages
		srcMu.Unlock()
		if st.before != nil {
			st.before()
		}
		before, hadCredit := s.credits.get(addr)
		job := pushJob{session: fmt.Sprintf("s%d", i), gen: 1, base: 0, end: 12, pages: st.pages, target: target}
		var ph sidecar.PushPhases
		var seqlen int64
		if st.before != nil {
			seqlen, err = s.doPush(context.Background(), pool, job)
		} else {
			seqlen, _, err = s.pushOnce(context.Background(), pool, job, &ph)
		}
		if err != nil || seqlen != 12 {
			t.Fatalf("%s: push: seqlen %d, %v", st.name, seqlen, err)
		}
		if got := f.takeLog(); got != st.wantLog {
			t.Fatalf("%s: store saw %s, want %s", st.name, got, st.wantLog)
		}
		f.mu.Lock()
		pages := f.reserve[f.ingest]
		credit, id := slices.Clone(f.credit), f.id
		f.mu.Unlock()
		if !landed(pages, 12) {
			t.Fatalf("%s: bytes did not land in store pages %v", st.name, pages)
		}
		if st.overlapped {
			if !hadCredit || !slices.Equal(pages[:2], before.pages) {
				t.Fatalf("%s: reservation %v does not start with the credit %+v", st.name, pages, before)
			}
			// TransferMs is the rest's time after the credit copy ended: 0 when the rest's copy,
			// submitted behind the credit's, finished first (the two run at once).
			if !ph.ReserveOverlapped || ph.CreditMs <= 0 || ph.CreditTokens != 8 || ph.TransferMs < 0 || ph.CriticalMs() < ph.ReserveMs {
				t.Fatalf("%s: phases %+v", st.name, ph)
			}
		}
		after, ok := s.credits.get(addr)
		if !ok || after.id != id || !slices.Equal(after.pages, credit) || after.busy {
			t.Fatalf("%s: credit held %+v (%v), the store's is %v id %d", st.name, after, ok, credit, id)
		}
	}
}

func TestCreditBook(t *testing.T) {
	now := time.Unix(1000, 0)
	c := func(id uint64, seg rdma.SegmentID) *peerCredit {
		return &peerCredit{endpoint: "e", seg: seg, id: id, pages: []int64{int64(id)}, granted: now}
	}
	var b creditBook
	steps := []struct {
		name   string
		do     func()
		wantID uint64 // 0: none held
	}{
		{"offer", func() { b.offer("a", c(5, 1)) }, 5},
		{"older offer ignored", func() { b.offer("a", c(4, 1)) }, 5},
		{"newer offer taken", func() { b.offer("a", c(6, 1)) }, 6},
		{"another segment replaces", func() { b.offer("a", c(2, 2)) }, 2},
		{"claim, then offers are ignored", func() {
			if b.claim("a", now) == nil || b.claim("a", now) != nil {
				t.Fatal("claim: want one holder")
			}
			b.offer("a", c(9, 2))
		}, 2},
		{"settle with the claimer's answer", func() { b.settle("a", c(7, 2)) }, 7},
		{"no credit in an answer drops it", func() { b.offer("a", nil) }, 0},
		{"too old to use", func() {
			b.offer("a", c(8, 2))
			if b.claim("a", now.Add(creditMaxAge+time.Second)) != nil {
				t.Fatal("an old credit was claimed")
			}
		}, 0},
		{"settle nil drops", func() {
			b.offer("a", c(9, 2))
			b.claim("a", now)
			b.settle("a", nil)
		}, 0},
	}
	for _, st := range steps {
		st.do()
		got, ok := b.get("a")
		if ok != (st.wantID != 0) || got.id != st.wantID {
			t.Fatalf("%s: holding %+v (%v), want id %d", st.name, got, ok, st.wantID)
		}
	}
}

func TestCheckCreditUse(t *testing.T) {
	lay := &kvcv1.KVLayout{BufferAddrs: []uint64{1 << 20, 2 << 20}}
	cr := &peerCredit{endpoint: "store", layout: lay, pages: []int64{4, 5, 6}}
	tests := []struct {
		name  string
		ep    string
		addrs []uint64
		pages []int64
		use   int
		want  string // "" ok
	}{
		{"starts with the credit", "store", lay.BufferAddrs, []int64{4, 5, 9}, 2, ""},
		{"all of it", "store", lay.BufferAddrs, []int64{4, 5, 6}, 3, ""},
		{"other endpoint", "other", lay.BufferAddrs, []int64{4, 5, 9}, 2, "endpoint"},
		{"other layout", "store", []uint64{1 << 20, 3 << 20}, []int64{4, 5, 9}, 2, "layout"},
		{"other pages", "store", lay.BufferAddrs, []int64{5, 4, 9}, 2, "do not start"},
		{"too few pages", "store", lay.BufferAddrs, []int64{4}, 2, "do not start"},
	}
	for _, tt := range tests {
		res := &kvcv1.ReserveSnapshotResponse{StoreLayout: &kvcv1.KVLayout{BufferAddrs: tt.addrs}, Pages: tt.pages}
		err := checkCreditUse(res, cr, tt.ep, tt.use)
		if (tt.want == "") != (err == nil) || err != nil && !strings.Contains(err.Error(), tt.want) {
			t.Fatalf("%s: %v, want %q", tt.name, err, tt.want)
		}
	}
}

func TestCreditsEndpoint(t *testing.T) {
	s := newTestSidecar(t)
	now := time.Now()
	s.credits.settle("p0:1", &peerCredit{endpoint: "e0", id: 7, pages: []int64{1, 2, 3}, granted: now.Add(-2 * time.Second)})
	s.credits.settle("p1:1", &peerCredit{endpoint: "e1", id: 9, pages: []int64{4}, granted: now})
	if c := s.credits.claim("p1:1", now); c == nil {
		t.Fatal("claim p1")
	}
	mux := http.NewServeMux()
	s.Mount(mux)
	rec := httptest.NewRecorder()
	mux.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/v1/credits", nil))
	var got []CreditInfo
	if err := json.Unmarshal(rec.Body.Bytes(), &got); err != nil || rec.Code != http.StatusOK {
		t.Fatalf("GET /v1/credits: %d %s (%v)", rec.Code, rec.Body.String(), err)
	}
	if len(got) != 2 || got[0].Peer != "p0:1" || got[0].Pages != 3 || got[0].ID != 7 || got[0].InUse || got[0].AgeMs < 2000 ||
		got[1].Peer != "p1:1" || got[1].Pages != 1 || !got[1].InUse {
		t.Fatalf("credits %+v", got)
	}
}

// get returns addr's credit (a copy), for the tests.
func (b *creditBook) get(addr string) (peerCredit, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	c := b.m[addr]
	if c == nil {
		return peerCredit{}, false
	}
	cp := *c
	cp.pages = slices.Clone(c.pages)
	return cp, true
}
