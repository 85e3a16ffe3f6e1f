package worker

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// demandReportTimeout bounds one ReportDemand call (the allocation waits on it).
const demandReportTimeout = 2 * time.Second

// demandBook is the decode prealloc queue's demand: the allocations waiting now (behind
// earlier ones or for pages) and the pages they need. A worker that evicts only by the
// sidecar's release (Config.EvictOnlyByRelease, SGLang's streaming sessions) reports it to its
// sidecar on every change (WorkerBridge ReportDemand): its pages are taken before any
// PrepareReceive, so the sidecar sees no other sign of a request that waits, and without it a
// pool just under the release watermark held a reseed — and every turn queued behind it — until
// the prealloc wait ran out.
type demandBook struct {
	mu       sync.Mutex // held across a report, so that reports go out in order
	requests int32
	pages    int64
	sent     *kvcv1.ReportDemandRequest // last report sent (nil: none yet)

	// serving: the decode requests in the worker's hands (handleGenerate, from the parse to the
	// answer); queued: those of them not holding their pages yet — in an allocation (the prealloc
	// queue) or waiting for their session's previous turn. serving − queued is the report's
	// running_requests. Atomic: counted outside mu, which a report holds across its call.
	serving, queued atomic.Int32

	// The capacity report's sender (kickReport): one report goroutine at a time, none after
	// Close.
	kickMu  sync.Mutex
	pending bool
	closed  bool
	wg      sync.WaitGroup
}

// demandWaiter is one allocation's share of the demand.
type demandWaiter struct {
	w       *Worker
	n       int64
	counted bool
}

// demandWaiter returns the share of an allocation of n pages (a no-op unless this is a decode
// worker that evicts only by release).
func (w *Worker) demandWaiter(n int64) *demandWaiter {
	return &demandWaiter{w: w, n: n}
}

func (w *Worker) reportsDemand() bool {
	return w.cfg.EvictOnlyByRelease && w.cfg.Role == kvcv1.WorkerRole_WORKER_ROLE_DECODE && w.bridge != nil
}

// waiting marks the allocation as waiting (once) and reports the demand, also when it was
// already counted: the free room changed since its last try.
func (d *demandWaiter) waiting() {
	if !d.w.reportsDemand() {
		return
	}
	if !d.counted {
		d.counted = true
		d.w.demand.mu.Lock()
		d.w.demand.requests++
		d.w.demand.pages += d.n
		d.w.demand.mu.Unlock()
	}
	d.w.reportDemand()
}

// done takes the allocation's share out (served, timed out or abandoned) and reports it.
func (d *demandWaiter) done() {
	if !d.counted {
		return
	}
	d.counted = false
	d.w.demand.mu.Lock()
	d.w.demand.requests--
	d.w.demand.pages -= d.n
	d.w.demand.mu.Unlock()
	d.w.reportDemand()
}

// reportDemand sends the current demand and free room to the sidecar when they differ from the
// last report. A failure is counted and otherwise ignored: the next change reports again.
func (w *Worker) reportDemand() {
	ps := int64(w.cfg.Geometry.PageSize)
	w.demand.mu.Lock()
	defer w.demand.mu.Unlock()
	w.mu.Lock()
	free := w.alloc.available()
	if w.prad != nil {
		free += w.prad.evictable()
	}
	unevictable := w.unevictableLocked()
	w.mu.Unlock()
	req := &kvcv1.ReportDemandRequest{WaitingRequests: w.demand.requests, WaitingTokens: w.demand.pages * ps, FreeTokens: free * ps,
		UnevictableTokens: unevictable, RunningRequests: w.runningRequests()}
	if req.WaitingRequests == 0 {
		req.FreeTokens = 0 // nothing waits: the free room is no demand's business
	}
	if s := w.demand.sent; s != nil && s.WaitingRequests == req.WaitingRequests && s.WaitingTokens == req.WaitingTokens && s.FreeTokens == req.FreeTokens &&
		s.UnevictableTokens == req.UnevictableTokens && s.RunningRequests == req.RunningRequests {
		return
	}
	if w.demand.sent == nil && req.WaitingRequests == 0 && req.UnevictableTokens == 0 && req.RunningRequests == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), min(demandReportTimeout, w.cfg.BridgeTimeout))
	_, err := w.bridge.ReportDemand(ctx, req)
	cancel()
	if err != nil {
		w.m.bridgeErrors.WithLabelValues("ReportDemand").Inc()
		// unknown to the sidecar now: the next report goes out whatever it says (a zero one too)
		w.demand.sent = &kvcv1.ReportDemandRequest{WaitingRequests: -1}
		return
	}
	w.demand.sent = req
	w.m.demandReports.Inc()
}

// runningRequests is the decode requests holding their pages: pre-allocated, receiving,
// prefilling or decoding (serving less queued).
func (w *Worker) runningRequests() int32 {
	return max(0, w.demand.serving.Load()-w.demand.queued.Load())
}

// serve counts a decode request in the worker's hands, not holding its pages yet: ready marks
// it past its wait for its session's previous turn (allocations count themselves: queue) and
// end takes it out (ready or not), each having the capacity report sent (running_requests).
func (w *Worker) serve() (ready, end func()) {
	w.demand.queued.Add(1)  // first: a report never counts it running before ready
	w.demand.serving.Add(1) // running_requests unchanged: no report yet
	var once sync.Once
	ready = func() {
		once.Do(func() {
			w.demand.queued.Add(-1)
			w.kickReport()
		})
	}
	end = func() {
		w.demand.serving.Add(-1)
		once.Do(func() { w.demand.queued.Add(-1) })
		w.kickReport()
	}
	return ready, end
}

// queue counts a decode request that does not hold its pages yet (an allocation, a wait for
// its session's previous turn) until the returned func is called.
func (w *Worker) queue() func() {
	w.demand.queued.Add(1)
	w.kickReport()
	return func() {
		w.demand.queued.Add(-1)
		w.kickReport()
	}
}

// reportsUnevictable: a decode worker with a sidecar sends its capacity report (the
// unevictable tokens of ReportDemandRequest), whatever its eviction mode.
func (w *Worker) reportsUnevictable() bool {
	return w.cfg.Role == kvcv1.WorkerRole_WORKER_ROLE_DECODE && w.bridge != nil
}

// unevictableLocked is the committed KV, in tokens, of the sessions a request is using: a
// running, pre-allocated or receiving one (pinned), less those whose only requests are direct
// turns waiting in the prealloc queue of a worker that never evicts (the capacity release may
// take them, attach.go). The engine's LRU never evicts a pinned session either. Of each, the KV
// it held when the request took it (base, cut to what it holds now): what the request adds —
// a seed's whole context, a turn's new tokens — is the control plane's reservation until the
// outcome, and counting it here too would count it twice. w.mu is held.
func (w *Worker) unevictableLocked() int64 {
	var n int64
	for _, s := range w.sessions {
		use := s.pinned
		if w.cfg.EvictOnlyByRelease {
			use -= s.waiting
		}
		if use > 0 {
			n += min(s.base, s.kvLen)
		}
	}
	return n
}

// kickReport has the capacity report sent soon, off the caller's path (a request's start or
// end changed the unevictable tokens): one sender at a time, which reads the state when it
// sends, so a burst of changes sends at most one report past the first. Safe under w.mu.
func (w *Worker) kickReport() {
	if !w.reportsUnevictable() {
		return
	}
	d := &w.demand
	d.kickMu.Lock()
	defer d.kickMu.Unlock()
	if d.pending || d.closed {
		return
	}
	d.pending = true
	d.wg.Add(1)
	go func() {
		defer d.wg.Done()
		d.kickMu.Lock()
		d.pending = false
		d.kickMu.Unlock()
		w.reportDemand()
	}()
}

// stopReports waits for a report in flight and sends no more (Close).
func (w *Worker) stopReports() {
	d := &w.demand
	d.kickMu.Lock()
	d.closed = true
	d.kickMu.Unlock()
	d.wg.Wait()
}
