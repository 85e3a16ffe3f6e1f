package workers

import (
	"context"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Worker is one worker the gateway can send to.
type Worker struct {
	ID       string
	URL      string
	PeerAddr string // prefill only: the sidecar's TransferPeerService address
}

// Ref converts w into the proto form a decision carries.
func (w Worker) Ref() *kvcv1.WorkerRef {
	return &kvcv1.WorkerRef{WorkerId: w.ID, WorkerUrl: w.URL, PeerAddr: w.PeerAddr}
}

// Pool is the round-robin fail-open pool.
type Pool struct {
	mu      sync.RWMutex
	prefill []Worker
	decode  []Worker
	pn, dn  atomic.Uint64
}

// NewPool starts from the static lists.
func NewPool(prefill, decode []Worker) *Pool {
	return &Pool{prefill: prefill, decode: decode}
}

// Pick returns the next prefill and decode worker round robin, skipping workers whose URL is
// in skipURLs (a retry after a worker's death does not go back to it); ok is false when either
// role has no worker left.
func (p *Pool) Pick(skipURLs ...string) (pre, dec Worker, ok bool) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	pre, okP := next(p.prefill, &p.pn, skipURLs)
	dec, okD := next(p.decode, &p.dn, skipURLs)
	if !okP || !okD {
		return Worker{}, Worker{}, false
	}
	return pre, dec, true
}

// PickDecode returns the next decode worker round robin, skipping workers whose URL is in
// skipURLs; ok is false when none is left. The gateway's fail-open needs only a decode worker
// (it prefills the request itself).
func (p *Pool) PickDecode(skipURLs ...string) (dec Worker, ok bool) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	return next(p.decode, &p.dn, skipURLs)
}

// next is round robin over ws from counter n, skipping the URLs in skip.
func next(ws []Worker, n *atomic.Uint64, skip []string) (Worker, bool) {
	if len(ws) == 0 {
		return Worker{}, false
	}
	start := n.Add(1) - 1
	for i := 0; i < len(ws); i++ {
		w := ws[int((start+uint64(i))%uint64(len(ws)))]
		if !slices.Contains(skip, w.URL) {
			return w, true
		}
	}
	return Worker{}, false
}

// Sizes reports the list lengths.
func (p *Pool) Sizes() (prefill, decode int) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	return len(p.prefill), len(p.decode)
}

// Set replaces the lists (an empty list leaves that role unchanged).
func (p *Pool) Set(prefill, decode []Worker) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(prefill) > 0 {
		p.prefill = prefill
	}
	if len(decode) > 0 {
		p.decode = decode
	}
}

// FromList splits a ListWorkers answer into usable (ready, not draining) prefill and decode
// workers with an HTTP URL. A tensor-parallel group is one worker, listed as its rank 0 with the
// group's state and ranks (Worker.tp_ranks); its other ranks, listed as themselves, are skipped.
func FromList(ws []*kvcv1.Worker) (prefill, decode []Worker) {
	for _, w := range ws {
		if w.GetWorkerUrl() == "" || w.GetDraining() || w.GetState() != kvcv1.WorkerState_WORKER_STATE_READY ||
			(w.GetTpSize() > 1 && len(w.GetTpRanks()) == 0) {
			continue
		}
		x := Worker{ID: w.GetWorkerId(), URL: strings.TrimRight(w.GetWorkerUrl(), "/"), PeerAddr: w.GetPeerAddr()}
		switch w.GetRole() {
		case kvcv1.WorkerRole_WORKER_ROLE_PREFILL:
			prefill = append(prefill, x)
		case kvcv1.WorkerRole_WORKER_ROLE_DECODE:
			decode = append(decode, x)
		}
	}
	return prefill, decode
}

// Refresh asks the control plane replicas in turn (any replica answers reads) every interval
// until ctx ends. onResult is called after each attempt (metrics); it may be nil.
// dial are extra dial options (transport credentials); none is plaintext.
func (p *Pool) Refresh(ctx context.Context, addrs []string, interval time.Duration, log zerolog.Logger, onResult func(ok bool), dial ...grpc.DialOption) error {
	if len(addrs) == 0 {
		return nil
	}
	opts := append(grpcx.DialOptions(nil), dial...) // later credentials win over the plaintext default
	clients := make([]kvcv1.AdminServiceClient, 0, len(addrs))
	for _, a := range addrs {
		cc, err := grpc.NewClient(a, opts...)
		if err != nil {
			log.Warn().Err(err).Str("addr", a).Msg("admin client")
			continue
		}
		defer cc.Close()
		clients = append(clients, kvcv1.NewAdminServiceClient(cc))
	}
	if len(clients) == 0 {
		return nil
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	next := 0
	for {
		ok := false
		for i := 0; i < len(clients) && !ok; i++ {
			c := clients[(next+i)%len(clients)]
			cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			resp, err := c.ListWorkers(cctx, &kvcv1.ListWorkersRequest{})
			cancel()
			if err != nil {
				continue
			}
			pre, dec := FromList(resp.GetWorkers())
			p.Set(pre, dec)
			ok = true
			next = (next + i) % len(clients)
		}
		if !ok {
			next++
		}
		if onResult != nil {
			onResult(ok)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
	}
}
