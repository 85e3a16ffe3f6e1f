package kvstore

import (
	"cmp"
	"context"
	"errors"
	"slices"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Batcher limits and defaults.
const (
	DefaultMaxDelay = 50 * time.Millisecond
	DefaultMaxOps   = 128
	// DefaultMaxBytes keeps a Txn under etcd's default 1.5 MiB request limit, leaving room
	// for the fencing compare and the request framing.
	DefaultMaxBytes = 1536*1024 - 8*1024
)

// FlushInfo describes one Txn sent by a Batcher (for metrics and tests).
type FlushInfo struct {
	Ops       int
	Bytes     int
	OldestAge time.Duration
	Err       error
}

// BatcherOption configures a Batcher.
type BatcherOption func(*Batcher)

// WithMaxDelay bounds how long a write waits before it is flushed (default 50 ms).
func WithMaxDelay(d time.Duration) BatcherOption {
	return func(b *Batcher) {
		if d > 0 {
			b.maxDelay = d
		}
	}
}

// WithMaxOps bounds the operations per Txn (default 128, etcd's default limit).
func WithMaxOps(n int) BatcherOption {
	return func(b *Batcher) {
		if n > 0 {
			b.maxOps = n
		}
	}
}

// WithMaxBytes bounds the encoded size of a Txn's operations (default just under 1.5 MiB).
func WithMaxBytes(n int) BatcherOption {
	return func(b *Batcher) {
		if n > 0 {
			b.maxBytes = n
		}
	}
}

// WithOnTxn calls fn after every Txn the batcher sends (from the Run goroutine).
func WithOnTxn(fn func(FlushInfo)) BatcherOption { return func(b *Batcher) { b.onTxn = fn } }

// WithRetryDelay sets the pause before a failed (not fenced) flush is retried (default 100 ms).
func WithRetryDelay(d time.Duration) BatcherOption {
	return func(b *Batcher) {
		if d > 0 {
			b.retry = d
		}
	}
}

// DefaultTxnTimeout bounds one Txn of a flush. A Txn sent to an etcd member that just lost
// leadership, or over a connection that went dark, otherwise waits for etcd's own request
// timeout (about 7 s) before the batcher can retry; a bounded Txn is retried after the retry
// delay, and retrying is harmless: every op is a fenced put or delete of a whole value.
const DefaultTxnTimeout = 2 * time.Second

// WithTxnTimeout bounds each Txn of a flush (default DefaultTxnTimeout).
func WithTxnTimeout(d time.Duration) BatcherOption {
	return func(b *Batcher) {
		if d > 0 {
			b.txnTimeout = d
		}
	}
}

type pendingOp struct {
	op  Op
	seq uint64
	at  time.Time
}

// Batcher is a fenced write-behind queue: writes are coalesced per key and flushed within
// MaxDelay in Txns guarded by the fence.
type Batcher struct {
	store    *Store
	fence    Fence
	maxDelay time.Duration
	maxOps   int
	maxBytes int
	retry    time.Duration
	onTxn    func(FlushInfo)
	// txnTimeout bounds one Txn (WithTxnTimeout).
	txnTimeout time.Duration

	mu       sync.Mutex
	pending  map[string]*pendingOp
	seq      uint64 // last sequence number handed out
	done     uint64 // every write with seq <= done is in etcd (or superseded and in etcd)
	urgent   bool   // a Flush is waiting: do not wait out the delay
	err      error  // terminal error (ErrFenced, ErrClosed)
	kick     chan struct{}
	progress chan struct{} // closed and replaced whenever done or err changes
}

// NewBatcher returns a Batcher writing through s under fence f. Call Run to start it.
func NewBatcher(s *Store, f Fence, opts ...BatcherOption) *Batcher {
	b := &Batcher{
		store: s, fence: f,
		maxDelay: DefaultMaxDelay, maxOps: DefaultMaxOps, maxBytes: DefaultMaxBytes,
		retry: 100 * time.Millisecond, txnTimeout: DefaultTxnTimeout,
		pending:  make(map[string]*pendingOp),
		kick:     make(chan struct{}, 1),
		progress: make(chan struct{}),
	}
	for _, o := range opts {
		o(b)
	}
	return b
}

// Fence returns the batcher's fence.
func (b *Batcher) Fence() Fence { return b.fence }

// Put queues a put of m at key.
func (b *Batcher) Put(key string, m proto.Message) error {
	v, err := proto.Marshal(m)
	if err != nil {
		return err
	}
	return b.enqueue(Op{Key: key, Value: v})
}

// PutBytes queues a put of an already encoded value at key. The batcher keeps v until it is
// written: the caller must not modify it afterwards.
func (b *Batcher) PutBytes(key string, v []byte) error {
	return b.enqueue(Op{Key: key, Value: v})
}

// Delete queues a delete of key.
func (b *Batcher) Delete(key string) error { return b.enqueue(Op{Key: key, Delete: true}) }

// PutSession queues a session record.
func (b *Batcher) PutSession(r *kvcv1.SessionRecord) error {
	return b.Put(b.store.SessionKey(r.GetSessionId()), r)
}

// DeleteSession queues the delete of a session record.
func (b *Batcher) DeleteSession(id string) error { return b.Delete(b.store.SessionKey(id)) }

// PutWorker queues a worker record.
func (b *Batcher) PutWorker(w *kvcv1.Worker) error {
	return b.Put(b.store.WorkerKey(w.GetWorkerId()), w)
}

func (b *Batcher) enqueue(op Op) error {
	if op.size() > b.maxBytes {
		return ErrTooLarge
	}
	b.mu.Lock()
	if b.err != nil {
		err := b.err
		b.mu.Unlock()
		return err
	}
	b.seq++
	now := time.Now()
	if p, ok := b.pending[op.Key]; ok {
		p.op, p.seq = op, b.seq // coalesce: the latest value wins, the oldest time stays
	} else {
		b.pending[op.Key] = &pendingOp{op: op, seq: b.seq, at: now}
	}
	n := len(b.pending)
	b.mu.Unlock()
	b.store.metrics.pending.Set(float64(n))
	b.signal()
	return nil
}

func (b *Batcher) signal() {
	select {
	case b.kick <- struct{}{}:
	default:
	}
}

// Pending returns the number of coalesced writes waiting.
func (b *Batcher) Pending() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.pending)
}

// Err returns the terminal error (ErrFenced when deposed), or nil while the batcher works.
func (b *Batcher) Err() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.err
}

// Flush waits until every write queued before the call is in etcd, the batcher fails
// terminally, or ctx ends. Run must be running.
func (b *Batcher) Flush(ctx context.Context) error {
	b.mu.Lock()
	target := b.seq
	b.urgent = true
	b.mu.Unlock()
	b.signal()
	for {
		b.mu.Lock()
		done, err, ch := b.done, b.err, b.progress
		b.mu.Unlock()
		if done >= target {
			return nil
		}
		if err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ch:
		}
	}
}

// Run sends flushes until ctx ends (then makes one last attempt to write what is pending,
// bounded by finalTimeout) or the fence fails (then it returns ErrFenced and drops what is
// pending: the new leader owns the data).
func (b *Batcher) Run(ctx context.Context) error {
	const finalTimeout = 2 * time.Second
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		b.mu.Lock()
		oldest, urgent, n := b.oldestLocked(), b.urgent, len(b.pending)
		b.mu.Unlock()
		if n > 0 && (urgent || time.Since(oldest) >= b.maxDelay || n >= b.maxOps) {
			if err := b.flushOnce(ctx); err != nil {
				if errors.Is(err, ErrFenced) {
					return err
				}
				if ctx.Err() != nil {
					break
				}
				if !sleepCtx(ctx, b.retry) {
					break
				}
			}
			continue
		}
		if n > 0 {
			timer.Reset(b.maxDelay - time.Since(oldest))
		}
		select {
		case <-ctx.Done():
		case <-b.kick:
			timer.Stop()
			continue
		case <-timer.C:
			continue
		}
		break
	}
	fctx, cancel := context.WithTimeout(context.Background(), finalTimeout)
	defer cancel()
	for b.Pending() > 0 && fctx.Err() == nil {
		if err := b.flushOnce(fctx); err != nil {
			if errors.Is(err, ErrFenced) {
				return err
			}
			sleepCtx(fctx, b.retry)
		}
	}
	b.fail(ErrClosed)
	return nil
}

func (b *Batcher) oldestLocked() time.Time {
	var t time.Time
	for _, p := range b.pending {
		if t.IsZero() || p.at.Before(t) {
			t = p.at
		}
	}
	return t
}

// flushOnce cuts everything pending and writes it in as many Txns as the limits need.
func (b *Batcher) flushOnce(ctx context.Context) error {
	b.mu.Lock()
	cut := b.pending
	cutSeq := b.seq
	b.pending = make(map[string]*pendingOp)
	b.urgent = false
	b.mu.Unlock()
	b.store.metrics.pending.Set(0)
	b.store.metrics.flushes.Inc()

	// Deterministic order: by sequence number (enqueue order of the latest value).
	ops := make([]*pendingOp, 0, len(cut))
	for _, p := range cut {
		ops = append(ops, p)
	}
	sortBySeq(ops)
	for len(ops) > 0 {
		n, size := 0, 0
		oldest := ops[0].at
		for n < len(ops) && n < b.maxOps && size+ops[n].op.size() <= b.maxBytes {
			size += ops[n].op.size()
			if ops[n].at.Before(oldest) {
				oldest = ops[n].at
			}
			n++
		}
		batch := make([]Op, n)
		for i := range batch {
			batch[i] = ops[i].op
		}
		age := time.Since(oldest)
		b.store.metrics.oldestMs.Observe(float64(age.Microseconds()) / 1000)
		tctx, tcancel := context.WithTimeout(ctx, b.txnTimeout)
		err := b.store.Apply(tctx, b.fence, batch)
		tcancel()
		if b.onTxn != nil {
			b.onTxn(FlushInfo{Ops: n, Bytes: size, OldestAge: age, Err: err})
		}
		switch {
		case err == nil:
			b.store.metrics.txns.WithLabelValues("ok").Inc()
			b.store.metrics.ops.Add(float64(n))
			b.store.metrics.bytes.Add(float64(size))
			ops = ops[n:]
		case errors.Is(err, ErrFenced):
			b.store.metrics.txns.WithLabelValues("fenced").Inc()
			b.fail(ErrFenced)
			return err
		default:
			b.store.metrics.txns.WithLabelValues("error").Inc()
			b.requeue(ops)
			return err
		}
	}
	b.mu.Lock()
	if cutSeq > b.done {
		b.done = cutSeq
	}
	b.notifyLocked()
	b.mu.Unlock()
	return nil
}

// requeue puts unwritten ops back unless a newer write of the same key arrived meanwhile.
func (b *Batcher) requeue(ops []*pendingOp) {
	b.mu.Lock()
	for _, p := range ops {
		if cur, ok := b.pending[p.op.Key]; ok {
			if p.at.Before(cur.at) {
				cur.at = p.at
			}
			continue
		}
		b.pending[p.op.Key] = p
	}
	n := len(b.pending)
	b.mu.Unlock()
	b.store.metrics.pending.Set(float64(n))
}

func (b *Batcher) fail(err error) {
	b.mu.Lock()
	if b.err == nil {
		b.err = err
	}
	if errors.Is(err, ErrFenced) {
		b.pending = make(map[string]*pendingOp)
	}
	b.notifyLocked()
	b.mu.Unlock()
}

func (b *Batcher) notifyLocked() {
	close(b.progress)
	b.progress = make(chan struct{})
}

func sortBySeq(ops []*pendingOp) {
	slices.SortFunc(ops, func(a, b *pendingOp) int { return cmp.Compare(a.seq, b.seq) })
}
