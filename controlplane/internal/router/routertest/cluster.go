package routertest

import (
	"errors"
	"fmt"
	"slices"
	"sync"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"google.golang.org/protobuf/proto"
)

// ErrNoStream is returned by SendCommand for workers marked offline.
var ErrNoStream = errors.New("worker has no live sidecar stream")

// Cluster is a thread-safe fake of the router's Cluster.
type Cluster struct {
	mu       sync.RWMutex
	policy   *kvcv1.Policy
	epoch    int64
	genTerm  uint64
	workers  []*kvcv1.Worker
	sessions map[string]*kvcv1.SessionRecord
	commands map[string][]*kvcv1.Command
	offline  map[string]bool
	cmdID    uint64
	// away: decode workers' commits of sessions the record did not name them for (Commit)
	away map[string]commit
}

type commit struct {
	worker string
	kvLen  int64
}

// New returns a cluster with the default policy, epoch 1, generation term 0 (generations
// numbered 1, 2, ...: policy.NextGeneration) and the given workers.
func New(workers ...*kvcv1.Worker) *Cluster {
	return &Cluster{
		policy:   policy.Defaults(),
		epoch:    1,
		workers:  workers,
		sessions: make(map[string]*kvcv1.SessionRecord),
		commands: make(map[string][]*kvcv1.Command),
		offline:  make(map[string]bool),
		away:     make(map[string]commit),
	}
}

// Policy implements router.Cluster.
func (c *Cluster) Policy() *kvcv1.Policy {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.policy
}

// Epoch implements router.Cluster.
func (c *Cluster) Epoch() int64 {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.epoch
}

// GenerationTerm implements router.Cluster.
func (c *Cluster) GenerationTerm() uint64 {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.genTerm
}

// Workers implements router.Cluster.
func (c *Cluster) Workers() []*kvcv1.Worker {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.workers
}

// Session implements router.Cluster.
func (c *Cluster) Session(id string) (*kvcv1.SessionRecord, bool) {
	c.mu.RLock()
	defer c.mu.RUnlock()
	r, ok := c.sessions[id]
	if !ok {
		return nil, false
	}
	return CopyRecord(r), true
}

// CopyRecord is a field-by-field deep copy of a session record (what a state implementation
// hands out; cheaper than proto.Clone's reflection).
func CopyRecord(r *kvcv1.SessionRecord) *kvcv1.SessionRecord {
	out := &kvcv1.SessionRecord{
		SessionId: r.SessionId, DecodeWorker: r.DecodeWorker, KvCommittedLen: r.KvCommittedLen, Turn: r.Turn,
		LastSeenUnixMs: r.LastSeenUnixMs, Epoch: r.Epoch, CreatedUnixMs: r.CreatedUnixMs, Generation: r.Generation,
		Migrations: r.Migrations, PreviousDecodeWorker: r.PreviousDecodeWorker,
		PinnedUntilUnixMs: r.PinnedUntilUnixMs, LowPriority: r.LowPriority,
	}
	if len(r.ContentChain) > 0 {
		out.ContentChain = slices.Clone(r.ContentChain)
	}
	if s := r.Snapshot; s != nil {
		out.Snapshot = &kvcv1.SnapshotInfo{PrefillWorker: s.PrefillWorker, Seqlen: s.Seqlen, Generation: s.Generation,
			UpdatedUnixMs: s.UpdatedUnixMs, Bytes: s.Bytes}
	}
	if len(r.DRejects) > 0 {
		out.DRejects = make(map[string]int32, len(r.DRejects))
		for k, v := range r.DRejects {
			out.DRejects[k] = v
		}
	}
	return out
}

// UpdateSession implements router.Cluster. As the state does (state.UpdateSession), a record
// that fn makes resident on another decode worker takes that worker's last commit (Commit) as
// its kv_committed_len, else 0, unless fn set it (a test's setup): the decode sidecar's commit is
// its one writer.
func (c *Cluster) UpdateSession(id string, fn func(rec *kvcv1.SessionRecord)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.sessions[id]
	if !ok {
		r = &kvcv1.SessionRecord{SessionId: id}
		c.sessions[id] = r
	}
	before, kv := r.DecodeWorker, r.KvCommittedLen
	fn(r)
	if d := r.DecodeWorker; d != before && d != "" && r.KvCommittedLen == kv {
		r.KvCommittedLen = 0
		if a, ok := c.away[id]; ok && a.worker == d {
			r.KvCommittedLen = a.kvLen
		}
		delete(c.away, id)
	}
}

// Commit is a decode sidecar's COMMITTED of kvLen tokens of session id on worker, applied as
// the state applies it: the record's committed length when it names worker (or no decode
// worker: then it does from now on), else kept until an update makes worker its decode worker.
func (c *Cluster) Commit(worker, id string, kvLen int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.sessions[id]
	if !ok {
		r = &kvcv1.SessionRecord{SessionId: id}
		c.sessions[id] = r
	}
	if r.DecodeWorker == "" {
		r.DecodeWorker = worker
	}
	if r.DecodeWorker != worker {
		c.away[id] = commit{worker: worker, kvLen: kvLen}
		return
	}
	r.KvCommittedLen = kvLen
	delete(c.away, id)
}

// SendCommand implements router.Cluster.
func (c *Cluster) SendCommand(workerID string, cmd *kvcv1.Command) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.offline[workerID] {
		return fmt.Errorf("%s: %w", workerID, ErrNoStream)
	}
	c.cmdID++
	cmd.CommandId = c.cmdID
	cmd.Epoch = c.epoch
	c.commands[workerID] = append(c.commands[workerID], cmd)
	return nil
}

// SetPolicy merges update into the policy (a new pointer, version bumped), after validation.
func (c *Cluster) SetPolicy(update *kvcv1.Policy) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	next := policy.Merge(c.policy, update)
	if err := policy.Validate(next); err != nil {
		return err
	}
	next.Version = c.policy.Version + 1
	c.policy = next
	return nil
}

// SetEpoch sets the leader epoch (0: not leading).
func (c *Cluster) SetEpoch(e int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.epoch = e
}

// SetGenerationTerm sets the leader's generation term (a new leader: policy.NextGeneration).
func (c *Cluster) SetGenerationTerm(term uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.genTerm = term
}

// SetWorkers replaces the worker snapshot (the slice must not be mutated afterwards).
func (c *Cluster) SetWorkers(ws ...*kvcv1.Worker) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.workers = ws
}

// UpdateWorker replaces one worker with a modified copy (copy-on-write snapshot).
func (c *Cluster) UpdateWorker(id string, fn func(w *kvcv1.Worker)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	ws := make([]*kvcv1.Worker, len(c.workers))
	for i, w := range c.workers {
		if w.WorkerId == id {
			w = proto.Clone(w).(*kvcv1.Worker)
			if w.Load == nil {
				w.Load = &kvcv1.WorkerLoad{}
			}
			fn(w)
		}
		ws[i] = w
	}
	c.workers = ws
}

// SetOffline makes SendCommand to the worker fail (or succeed again).
func (c *Cluster) SetOffline(id string, off bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.offline[id] = off
}

// PutSession stores a record (replacing any).
func (c *Cluster) PutSession(rec *kvcv1.SessionRecord) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sessions[rec.SessionId] = proto.Clone(rec).(*kvcv1.SessionRecord)
}

// Commands returns the commands sent to a worker so far.
func (c *Cluster) Commands(workerID string) []*kvcv1.Command {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return append([]*kvcv1.Command(nil), c.commands[workerID]...)
}

// Decode returns a READY decode worker.
func Decode(id string, capacity, used int64) *kvcv1.Worker {
	return &kvcv1.Worker{WorkerId: id, Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, State: kvcv1.WorkerState_WORKER_STATE_READY,
		KvCapacityTokens: capacity, Load: &kvcv1.WorkerLoad{UsedTokens: used},
		WorkerUrl: "http://" + id, PeerAddr: id + ":7000", TransferEndpoint: id + ":7001"}
}

// Prefill returns a READY prefill worker.
func Prefill(id string) *kvcv1.Worker {
	return &kvcv1.Worker{WorkerId: id, Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, State: kvcv1.WorkerState_WORKER_STATE_READY,
		Load:      &kvcv1.WorkerLoad{SnapshotBytesCapacity: 1 << 30},
		WorkerUrl: "http://" + id, PeerAddr: id + ":7000", TransferEndpoint: id + ":7001"}
}
