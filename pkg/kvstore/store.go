package kvstore

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// DefaultPrefix is the default key prefix.
const DefaultPrefix = "/kvc/v1/"

// Errors.
var (
	// ErrFenced means the writer is no longer the leader: the fencing compare failed and
	// nothing was written.
	ErrFenced = errors.New("kvstore: fenced: writer is not the leader any more")
	// ErrGenerationTermExhausted means the generation term cannot advance: the stored term (or
	// the caller's floor) is already at the caller's limit, so a new term would leave the range
	// its generations must stay in (or wrap the counter). Nothing was written; a leader must not
	// serve on such a term.
	ErrGenerationTermExhausted = errors.New("kvstore: generation term exhausted")
	// ErrGenerationTermCorrupt means the stored generation term is not a number.
	ErrGenerationTermCorrupt = errors.New("kvstore: generation term corrupt")
	// ErrTooLarge means a single value cannot fit in one Txn.
	ErrTooLarge = errors.New("kvstore: value too large for one transaction")
	// ErrClosed means the batcher no longer accepts writes.
	ErrClosed = errors.New("kvstore: batcher closed")
	// ErrNoSpace means etcd refused a write because its backend quota is exhausted (etcd's
	// NOSPACE alarm): nothing is written until an operator compacts, defragments and disarms
	// the alarm. Permanent for a caller: RESOURCE_EXHAUSTED.
	ErrNoSpace = errors.New("kvstore: etcd database space exceeded (quota)")
	// ErrUnavailable means etcd did not answer one call within the store's call timeout
	// (WithCallTimeout) although the caller's own context had time left: etcd is unreachable,
	// without quorum or overloaded. Callers answer UNAVAILABLE.
	ErrUnavailable = errors.New("kvstore: etcd unavailable")
)

// DefaultCallTimeout bounds every single etcd call the Store makes (a Get, a page of a scan, a
// Txn) unless the caller's context ends sooner. Without it a call to an unreachable etcd waits
// as long as the caller's context (forever without a deadline: the etcd client waits for a
// connection to become ready).
const DefaultCallTimeout = 2 * time.Second

// Store reads and writes kvcentric records in etcd.
type Store struct {
	cli         *clientv3.Client
	prefix      string
	metrics     *metrics
	callTimeout time.Duration
}

// Option configures a Store.
type Option func(*Store) error

// WithPrefix sets the key prefix; it must start and end with '/'.
func WithPrefix(p string) Option {
	return func(s *Store) error {
		if !strings.HasPrefix(p, "/") || !strings.HasSuffix(p, "/") || len(p) < 2 {
			return fmt.Errorf("kvstore: prefix %q must start and end with '/'", p)
		}
		s.prefix = p
		return nil
	}
}

// WithRegisterer registers the store's metrics (flushes, ops, bytes, failures) with reg.
func WithRegisterer(reg prometheus.Registerer) Option {
	return func(s *Store) error {
		s.metrics = newMetrics(reg)
		return nil
	}
}

// WithCallTimeout bounds every single etcd call (default DefaultCallTimeout); d must be
// positive.
func WithCallTimeout(d time.Duration) Option {
	return func(s *Store) error {
		if d <= 0 {
			return fmt.Errorf("kvstore: call timeout %s must be positive", d)
		}
		s.callTimeout = d
		return nil
	}
}

// CallTimeout is the bound on one etcd call.
func (s *Store) CallTimeout() time.Duration { return s.callTimeout }

// call runs one etcd call under the call timeout. When the timeout (not the caller's context)
// ended it, the error wraps ErrUnavailable as well as the etcd client's error.
func (s *Store) call(ctx context.Context, fn func(context.Context) error) error {
	cctx, cancel := context.WithTimeout(ctx, s.callTimeout)
	defer cancel()
	err := fn(cctx)
	if err != nil && ctx.Err() == nil && cctx.Err() != nil {
		return fmt.Errorf("%w: no answer within %s: %w", ErrUnavailable, s.callTimeout, err)
	}
	return err
}

// New returns a Store over cli.
func New(cli *clientv3.Client, opts ...Option) (*Store, error) {
	if cli == nil {
		return nil, errors.New("kvstore: nil etcd client")
	}
	s := &Store{cli: cli, prefix: DefaultPrefix, callTimeout: DefaultCallTimeout}
	for _, o := range opts {
		if err := o(s); err != nil {
			return nil, err
		}
	}
	if s.metrics == nil {
		s.metrics = newMetrics(nil)
	}
	return s, nil
}

// Client returns the underlying etcd client.
func (s *Store) Client() *clientv3.Client { return s.cli }

// Prefix returns the key prefix.
func (s *Store) Prefix() string { return s.prefix }

// ElectionPrefix is the prefix under which replicas campaign.
func (s *Store) ElectionPrefix() string { return s.prefix + "leader/" }

// WorkerKey is the key of a worker record.
func (s *Store) WorkerKey(id string) string { return s.prefix + "workers/" + id }

// SessionKey is the key of a session record.
func (s *Store) SessionKey(id string) string { return s.prefix + "sessions/" + id }

// PolicyKey is the key of the policy record.
func (s *Store) PolicyKey() string { return s.prefix + "policy" }

// GenerationTermKey holds the generation term: a counter every new leader advances before it
// serves (NextGenerationTerm), decimal ASCII.
func (s *Store) GenerationTermKey() string { return s.prefix + "generation-term" }

// VolatilePrefix is the prefix of the volatile journal's keys.
func (s *Store) VolatilePrefix() string { return s.prefix + "volatile/" }

// VolatileKey is the key of the volatile journal entry batch with sequence number seq:
// <prefix>volatile/<16 lower-case hex digits>, so that key order is seq order.
func (s *Store) VolatileKey(seq uint64) string {
	const hexDigits = "0123456789abcdef"
	var b [16]byte
	for i := 15; i >= 0; i-- {
		b[i] = hexDigits[seq&0xf]
		seq >>= 4
	}
	return s.VolatilePrefix() + string(b[:])
}

// ParseVolatileName returns the sequence number of a journal key's name (the part after
// VolatilePrefix); ok is false unless it is exactly 16 lower-case hex digits.
func ParseVolatileName(name string) (seq uint64, ok bool) {
	if len(name) != 16 {
		return 0, false
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case c >= '0' && c <= '9':
			seq = seq<<4 | uint64(c-'0')
		case c >= 'a' && c <= 'f':
			seq = seq<<4 | uint64(c-'a'+10)
		default:
			return 0, false
		}
	}
	return seq, true
}

func (s *Store) workersPrefix() string  { return s.prefix + "workers/" }
func (s *Store) sessionsPrefix() string { return s.prefix + "sessions/" }

// Fence is the fencing token of a leader: its election key and that key's create revision
// (the epoch).
type Fence struct {
	Key string
	Rev int64
}

func (f Fence) cmp() clientv3.Cmp {
	return clientv3.Compare(clientv3.CreateRevision(f.Key), "=", f.Rev)
}

// Op is one write in a fenced transaction: a put of Value (already marshaled) or a delete.
type Op struct {
	Key    string
	Value  []byte
	Delete bool
}

// size estimates the op's share of an encoded TxnRequest.
func (o Op) size() int { return len(o.Key) + len(o.Value) + opOverhead }

// opOverhead bounds the protobuf framing of one RequestOp (tags and length varints).
const opOverhead = 16

func (o Op) clientOp() clientv3.Op {
	if o.Delete {
		return clientv3.OpDelete(o.Key)
	}
	return clientv3.OpPut(o.Key, string(o.Value))
}

// Apply writes ops in one Txn guarded by f. It returns ErrFenced when f no longer holds.
func (s *Store) Apply(ctx context.Context, f Fence, ops []Op) error {
	if f.Key == "" || f.Rev <= 0 {
		return fmt.Errorf("kvstore: invalid fence %q@%d", f.Key, f.Rev)
	}
	cops := make([]clientv3.Op, len(ops))
	size := 0
	for i, o := range ops {
		cops[i] = o.clientOp()
		size += o.size()
	}
	if size > DefaultMaxBytes {
		return fmt.Errorf("%w: %d bytes, limit %d", ErrTooLarge, size, DefaultMaxBytes)
	}
	var resp *clientv3.TxnResponse
	t0 := time.Now()
	err := s.call(ctx, func(ctx context.Context) (err error) {
		resp, err = s.cli.Txn(ctx).If(f.cmp()).Then(cops...).Commit()
		return err
	})
	if s.metrics != nil {
		s.metrics.txnSeconds.Observe(time.Since(t0).Seconds())
	}
	if err != nil {
		return fmt.Errorf("kvstore: txn: %w", classify(err))
	}
	if !resp.Succeeded {
		return ErrFenced
	}
	return nil
}

// NextGenerationTerm advances the generation term under the fence, synchronously, and returns
// the new value: max(stored, floor) + 1 (a key lost or never written counts as 0; floor is the
// highest term the caller saw in use, e.g. in the generations it loaded). Every leader calls it
// once before serving, so each term's value is above every earlier term's (the KV generations
// made in a term are numbered in its range: policy.NextGeneration). It returns ErrFenced when
// f no longer holds, ErrGenerationTermExhausted when max(stored, floor) is already limit or
// more (the next term would pass limit, the last term the caller can number generations in;
// with a stored 2^64-1 the +1 would wrap to 0 and restart every later leader's generations),
// and an error when the stored value is not a number or changed meanwhile.
func (s *Store) NextGenerationTerm(ctx context.Context, f Fence, floor, limit uint64) (uint64, error) {
	if f.Key == "" || f.Rev <= 0 {
		return 0, fmt.Errorf("kvstore: invalid fence %q@%d", f.Key, f.Rev)
	}
	key := s.GenerationTermKey()
	resp, err := s.getOne(ctx, key)
	if err != nil {
		return 0, fmt.Errorf("kvstore: get %s: %w", key, err)
	}
	var cur uint64
	var modRev int64
	if len(resp.Kvs) == 1 {
		modRev = resp.Kvs[0].ModRevision
		if cur, err = strconv.ParseUint(string(resp.Kvs[0].Value), 10, 64); err != nil {
			return 0, fmt.Errorf("%w: %s holds %q, not a number (delete it: the next leader counts on from the loaded generations): %w",
				ErrGenerationTermCorrupt, key, resp.Kvs[0].Value, err)
		}
	}
	if m := max(cur, floor); m >= limit {
		return 0, fmt.Errorf("%w: %s holds %d, floor %d, the last usable term is %d", ErrGenerationTermExhausted, key, cur, floor, limit)
	}
	next := max(cur, floor) + 1
	var tresp *clientv3.TxnResponse
	err = s.call(ctx, func(ctx context.Context) (err error) {
		tresp, err = s.cli.Txn(ctx).
			If(f.cmp(), clientv3.Compare(clientv3.ModRevision(key), "=", modRev)).
			Then(clientv3.OpPut(key, strconv.FormatUint(next, 10))).
			Else(clientv3.OpGet(f.Key)).
			Commit()
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("kvstore: txn: %w", classify(err))
	}
	if !tresp.Succeeded {
		if r := tresp.Responses[0].GetResponseRange(); r == nil || len(r.Kvs) != 1 || r.Kvs[0].CreateRevision != f.Rev {
			return 0, ErrFenced
		}
		return 0, fmt.Errorf("kvstore: %s changed while advancing it", key)
	}
	return next, nil
}

// PutPolicy stores the policy (the operator's overrides) under the fence, synchronously.
func (s *Store) PutPolicy(ctx context.Context, f Fence, p *kvcv1.Policy) error {
	b, err := proto.Marshal(p)
	if err != nil {
		return err
	}
	return s.Apply(ctx, f, []Op{{Key: s.PolicyKey(), Value: b}})
}

// PutWorker stores a worker record under the fence, synchronously.
func (s *Store) PutWorker(ctx context.Context, f Fence, w *kvcv1.Worker) error {
	b, err := proto.Marshal(w)
	if err != nil {
		return err
	}
	return s.Apply(ctx, f, []Op{{Key: s.WorkerKey(w.GetWorkerId()), Value: b}})
}

// GetPolicy reads the stored policy. ok is false when none is stored.
func (s *Store) GetPolicy(ctx context.Context) (p *kvcv1.Policy, ok bool, err error) {
	p = &kvcv1.Policy{}
	ok, err = s.get(ctx, s.PolicyKey(), p)
	return p, ok, err
}

// GetWorker reads one worker record.
func (s *Store) GetWorker(ctx context.Context, id string) (*kvcv1.Worker, bool, error) {
	w := &kvcv1.Worker{}
	ok, err := s.get(ctx, s.WorkerKey(id), w)
	return w, ok, err
}

// GetSession reads one session record.
func (s *Store) GetSession(ctx context.Context, id string) (*kvcv1.SessionRecord, bool, error) {
	r := &kvcv1.SessionRecord{}
	ok, err := s.get(ctx, s.SessionKey(id), r)
	return r, ok, err
}

// classify marks etcd's permanent refusals with ErrTooLarge or ErrNoSpace (the etcd error stays
// in the chain).
func classify(err error) error {
	switch {
	case errors.Is(err, rpctypes.ErrRequestTooLarge) || strings.Contains(err.Error(), "request is too large"):
		return fmt.Errorf("%w: %w", ErrTooLarge, err)
	case errors.Is(err, rpctypes.ErrNoSpace) || strings.Contains(err.Error(), "database space exceeded"):
		return fmt.Errorf("%w: %w", ErrNoSpace, err)
	}
	return err
}

// getOne is one bounded Get.
func (s *Store) getOne(ctx context.Context, key string, opts ...clientv3.OpOption) (resp *clientv3.GetResponse, err error) {
	err = s.call(ctx, func(ctx context.Context) (err error) {
		resp, err = s.cli.Get(ctx, key, opts...)
		return err
	})
	return resp, err
}

func (s *Store) get(ctx context.Context, key string, m proto.Message) (bool, error) {
	resp, err := s.getOne(ctx, key)
	if err != nil {
		return false, fmt.Errorf("kvstore: get %s: %w", key, err)
	}
	if len(resp.Kvs) == 0 {
		return false, nil
	}
	if err := proto.Unmarshal(resp.Kvs[0].Value, m); err != nil {
		return false, fmt.Errorf("kvstore: decode %s: %w", key, err)
	}
	return true, nil
}

// ListWorkers reads every worker record.
func (s *Store) ListWorkers(ctx context.Context) ([]*kvcv1.Worker, error) {
	var out []*kvcv1.Worker
	err := s.scan(ctx, s.workersPrefix(), "", 0, 0, func(_ string, v []byte) (bool, error) {
		w := &kvcv1.Worker{}
		if proto.Unmarshal(v, w) != nil {
			return true, nil // a malformed record is skipped, never fatal for the listing
		}
		out = append(out, w)
		return true, nil
	})
	return out, err
}

// ListSessions returns up to limit session records with id > after, in id order, that pass
// keep (nil keeps all). next is the last returned id when more may follow, else "".
func (s *Store) ListSessions(ctx context.Context, after string, limit int, keep func(*kvcv1.SessionRecord) bool) (recs []*kvcv1.SessionRecord, next string, err error) {
	if limit <= 0 {
		limit = 100
	}
	more := false
	err = s.scan(ctx, s.sessionsPrefix(), after, 0, 0, func(_ string, v []byte) (bool, error) {
		r := &kvcv1.SessionRecord{}
		if proto.Unmarshal(v, r) != nil {
			return true, nil // a malformed record is skipped, never fatal for the listing
		}
		if keep != nil && !keep(r) {
			return true, nil
		}
		if len(recs) == limit {
			more = true
			return false, nil
		}
		recs = append(recs, r)
		return true, nil
	})
	if err != nil {
		return nil, "", err
	}
	if more && len(recs) > 0 {
		next = recs[len(recs)-1].GetSessionId()
	}
	return recs, next, nil
}

// Snapshot is everything a new leader loads before serving, read at one revision.
type Snapshot struct {
	Revision int64
	Workers  []*kvcv1.Worker
	Sessions []*kvcv1.SessionRecord
	Policy   *kvcv1.Policy // nil when none stored
	// Volatile is the volatile journal in seq order (see VolatileKey); applying it over
	// Sessions is the reader's job (kvc.v1.VolatileBatch says how).
	Volatile  []*kvcv1.VolatileBatch
	Malformed int // records that failed to decode (skipped, logged by the caller)
	// PolicyErr is why the stored policy did not decode (Policy is nil then, and Malformed
	// counts it): a corrupt record, not an absent one.
	PolicyErr error
	// MalformedVolatile are journal keys whose name or value did not decode (full keys).
	MalformedVolatile []string
}

// LoadAll reads all workers, sessions and the policy at a single revision, in pages.
func (s *Store) LoadAll(ctx context.Context) (*Snapshot, error) {
	resp, err := s.getOne(ctx, s.PolicyKey())
	if err != nil {
		return nil, fmt.Errorf("kvstore: load policy: %w", err)
	}
	snap := &Snapshot{Revision: resp.Header.Revision}
	if len(resp.Kvs) == 1 {
		p := &kvcv1.Policy{}
		if err := proto.Unmarshal(resp.Kvs[0].Value, p); err != nil {
			snap.Malformed++
			snap.PolicyErr = fmt.Errorf("kvstore: %s does not decode (%d bytes): %w", s.PolicyKey(), len(resp.Kvs[0].Value), err)
		} else {
			snap.Policy = p
		}
	}
	err = s.scan(ctx, s.workersPrefix(), "", snap.Revision, 0, func(_ string, v []byte) (bool, error) {
		w := &kvcv1.Worker{}
		if proto.Unmarshal(v, w) != nil {
			snap.Malformed++
			return true, nil
		}
		snap.Workers = append(snap.Workers, w)
		return true, nil
	})
	if err != nil {
		return nil, err
	}
	// The records are decoded into chunks of loadChunk, one heap object per chunk instead of
	// one per session: a leader holds them for its whole term, and every GC cycle marks them.
	var chunk []kvcv1.SessionRecord
	err = s.scan(ctx, s.sessionsPrefix(), "", snap.Revision, 0, func(_ string, v []byte) (bool, error) {
		if len(chunk) == 0 {
			chunk = make([]kvcv1.SessionRecord, loadChunk)
		}
		r := &chunk[0]
		if proto.Unmarshal(v, r) != nil { // the slot serves the next record (Unmarshal resets it)
			snap.Malformed++
			return true, nil
		}
		chunk = chunk[1:]
		snap.Sessions = append(snap.Sessions, r)
		return true, nil
	})
	if err != nil {
		return nil, err
	}
	vp := s.VolatilePrefix()
	err = s.scan(ctx, vp, "", snap.Revision, 0, func(name string, v []byte) (bool, error) {
		seq, ok := ParseVolatileName(name)
		b := &kvcv1.VolatileBatch{}
		if !ok || proto.Unmarshal(v, b) != nil {
			snap.Malformed++
			snap.MalformedVolatile = append(snap.MalformedVolatile, vp+name)
			return true, nil
		}
		b.Seq = seq // the key's name is authoritative
		snap.Volatile = append(snap.Volatile, b)
		return true, nil
	})
	if err != nil {
		return nil, err
	}
	return snap, nil
}

const scanPage = 1000

// loadChunk is how many session records LoadAll decodes into one allocation: as many as fit
// in 64 KiB, so that the allocation fills its pages.
const loadChunk = int(64 << 10 / unsafe.Sizeof(kvcv1.SessionRecord{}))

// scan visits keys under prefix with name > after, in key order, pageSize at a time, at rev
// (0 = latest), until fn returns false.
func (s *Store) scan(ctx context.Context, prefix, after string, rev int64, pageSize int, fn func(name string, v []byte) (bool, error)) error {
	if pageSize <= 0 {
		pageSize = scanPage
	}
	end := clientv3.GetPrefixRangeEnd(prefix)
	start := prefix
	if after != "" {
		start = prefix + after + "\x00"
	}
	for {
		opts := []clientv3.OpOption{clientv3.WithRange(end), clientv3.WithLimit(int64(pageSize)),
			clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend)}
		if rev > 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		resp, err := s.getOne(ctx, start, opts...)
		if err != nil {
			return fmt.Errorf("kvstore: scan %s: %w", prefix, err)
		}
		for _, kv := range resp.Kvs {
			goOn, err := fn(strings.TrimPrefix(string(kv.Key), prefix), kv.Value)
			if err != nil {
				return fmt.Errorf("kvstore: decode %s: %w", kv.Key, err)
			}
			if !goOn {
				return nil
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return nil
		}
		start = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// WatchPolicy calls fn with every stored policy: the current one first (if any), then each
// change, until ctx ends. A deleted policy is reported as nil; a stored value that does not
// decode is reported to bad (when not nil) and not to fn, so the caller keeps what it has.
// The watch is re-established after errors.
func (s *Store) WatchPolicy(ctx context.Context, fn func(*kvcv1.Policy), bad func(error)) error {
	decode := func(v []byte) {
		p := &kvcv1.Policy{}
		if err := proto.Unmarshal(v, p); err != nil {
			if bad != nil {
				bad(fmt.Errorf("kvstore: %s does not decode (%d bytes): %w", s.PolicyKey(), len(v), err))
			}
			return
		}
		fn(p)
	}
	for ctx.Err() == nil {
		resp, err := s.getOne(ctx, s.PolicyKey())
		if err != nil {
			if !sleepCtx(ctx, 500*time.Millisecond) {
				break
			}
			continue
		}
		if len(resp.Kvs) == 1 {
			decode(resp.Kvs[0].Value)
		}
		wch := s.cli.Watch(clientv3.WithRequireLeader(ctx), s.PolicyKey(), clientv3.WithRev(resp.Header.Revision+1))
		for wr := range wch {
			if wr.Err() != nil {
				break
			}
			for _, ev := range wr.Events {
				if ev.Type == clientv3.EventTypeDelete {
					fn(nil)
					continue
				}
				decode(ev.Kv.Value)
			}
		}
		if !sleepCtx(ctx, 200*time.Millisecond) {
			break
		}
	}
	return nil
}

// IsIdle reports whether a session has been idle for at least ttl at now (last_seen, or
// created when never seen). A ttl <= 0 never expires anything.
func IsIdle(r *kvcv1.SessionRecord, ttl time.Duration, now time.Time) bool {
	if ttl <= 0 {
		return false
	}
	last := r.GetLastSeenUnixMs()
	if last == 0 {
		last = r.GetCreatedUnixMs()
	}
	return now.UnixMilli()-last >= ttl.Milliseconds()
}

// ExpireIdleSessions deletes, under the fence, every stored session idle for at least ttl at
// now. Each delete is guarded by the record's mod revision too, so a record updated meanwhile
// is kept. It returns the number deleted.
func (s *Store) ExpireIdleSessions(ctx context.Context, f Fence, ttl time.Duration, now time.Time) (int, error) {
	type victim struct {
		key string
		rev int64
	}
	var victims []victim
	prefix := s.sessionsPrefix()
	end := clientv3.GetPrefixRangeEnd(prefix)
	start := prefix
	for {
		resp, err := s.getOne(ctx, start, clientv3.WithRange(end), clientv3.WithLimit(scanPage),
			clientv3.WithSort(clientv3.SortByKey, clientv3.SortAscend))
		if err != nil {
			return 0, fmt.Errorf("kvstore: expire scan: %w", err)
		}
		for _, kv := range resp.Kvs {
			r := &kvcv1.SessionRecord{}
			if proto.Unmarshal(kv.Value, r) != nil {
				continue
			}
			if IsIdle(r, ttl, now) {
				victims = append(victims, victim{string(kv.Key), kv.ModRevision})
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			break
		}
		start = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
	n := 0
	for _, v := range victims {
		var tr *clientv3.TxnResponse
		err := s.call(ctx, func(ctx context.Context) (err error) {
			tr, err = s.cli.Txn(ctx).
				If(f.cmp(), clientv3.Compare(clientv3.ModRevision(v.key), "=", v.rev)).
				Then(clientv3.OpDelete(v.key)).Commit()
			return err
		})
		if err != nil {
			return n, fmt.Errorf("kvstore: expire: %w", err)
		}
		if !tr.Succeeded {
			var fr *clientv3.TxnResponse
			err := s.call(ctx, func(ctx context.Context) (err error) {
				fr, err = s.cli.Txn(ctx).If(f.cmp()).Commit()
				return err
			})
			if err == nil && !fr.Succeeded {
				return n, ErrFenced
			}
			continue
		}
		n++
	}
	return n, nil
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
