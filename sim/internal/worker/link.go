package worker

import (
	"context"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"
)

// The network model (docs/simulator.md, "Links"): every modeled KV movement is a flow over the
// links it crosses, and each link is shared fairly (processor sharing) among the flows on it at
// that moment: a flow's rate is min over its links of bandwidth / flows on that link. The links:
//
//   - this node's NIC, inbound (nic: the flows this worker receives or fetches, counted in
//     process, one kvc-sim being one node);
//   - a sender's outbound side, which flows of several receiving nodes share (egress: counted
//     across processes by one file per flow in a directory named after the sender — a prefill
//     node by its peer address, a KV tier by its directory — under LinkDir).
//
// A flow advances in steps of at most linkTick, re-reading the flow counts at every step, so a
// flow that starts or ends mid-transfer changes the others' rates within a tick.
const linkTick = 2 * time.Millisecond

// egressStale: a flow file older than this is a leftover of a killed process (flows refresh
// theirs every second), not a flow.
const egressStale = 10 * time.Second

// nic counts the flows on one direction of this node's NIC.
type nic struct {
	mu sync.Mutex
	n  int
}

func (l *nic) join() { l.mu.Lock(); l.n++; l.mu.Unlock() }
func (l *nic) leave() {
	l.mu.Lock()
	l.n--
	l.mu.Unlock()
}
func (l *nic) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.n
}

var flowSeq atomic.Uint64

// egress is the outbound side of a sender shared across processes: one file per flow in dir.
type egress struct {
	dir  string
	file string
	made time.Time
}

// joinEgress registers a flow out of the sender key (nil when there is no directory for it).
func joinEgress(root, key string) *egress {
	if root == "" || key == "" {
		return nil
	}
	h := fnv.New64a()
	_, _ = h.Write([]byte(key))
	dir := filepath.Join(root, fmt.Sprintf("%016x", h.Sum64()))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil
	}
	file := filepath.Join(dir, fmt.Sprintf("%d-%d", os.Getpid(), flowSeq.Add(1)))
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		return nil
	}
	return &egress{dir: dir, file: file, made: time.Now()}
}

// count is the number of live flows out of the sender (this one included).
func (e *egress) count() int {
	if e == nil {
		return 1
	}
	if time.Since(e.made) > egressStale/10 {
		now := time.Now()
		_ = os.Chtimes(e.file, now, now)
		e.made = now
	}
	ents, err := os.ReadDir(e.dir)
	if err != nil {
		return 1
	}
	n := 0
	for _, en := range ents {
		if fi, err := en.Info(); err == nil && time.Since(fi.ModTime()) < egressStale {
			n++
		}
	}
	return max(n, 1)
}

func (e *egress) leave() {
	if e != nil {
		_ = os.Remove(e.file)
	}
}

// move models moving tokens tokens of the real model's KV into this node over its NIC (and out
// of the sender named by from, "" for none) under processor sharing, and returns how long it
// took. At time scale 0 it costs nothing.
func (w *Worker) move(ctx context.Context, tokens int64, from string) (time.Duration, error) {
	return w.moveFrom(ctx, tokens, from, w.cfg.Timing.LinkGbps)
}

// fetch is move out of a KV tier (its directory names it), whose egress is TierEgressGbps.
func (w *Worker) fetch(ctx context.Context, tokens int64, tier string) (time.Duration, error) {
	eg := w.cfg.TierEgressGbps
	if eg <= 0 {
		eg = w.cfg.Timing.LinkGbps
	}
	return w.moveFrom(ctx, tokens, tier, eg)
}

func (w *Worker) moveFrom(ctx context.Context, tokens int64, from string, egressGbps float64) (time.Duration, error) {
	tm := w.cfg.Timing
	if tokens <= 0 || tm.Scale == 0 {
		return 0, ctx.Err()
	}
	// Work in model bytes; the link's rate in model bytes per wall second.
	left := float64(tokens) * float64(tm.ModelBytesPerToken)
	rate := tm.LinkGbps * 1e9 / 8 / tm.Scale
	egRate := egressGbps * 1e9 / 8 / tm.Scale
	w.inbound.join()
	defer w.inbound.leave()
	eg := joinEgress(w.cfg.LinkDir, from)
	defer eg.leave()
	t0 := time.Now()
	last := t0
	for left > 0 {
		share := min(rate/float64(max(w.inbound.count(), 1)), egRate/float64(eg.count()))
		step := min(time.Duration(left/share*float64(time.Second))+time.Microsecond, linkTick)
		if err := sleepCtx(ctx, step); err != nil {
			return time.Since(t0), err
		}
		now := time.Now()
		left -= now.Sub(last).Seconds() * share
		last = now
	}
	return time.Since(t0), nil
}
