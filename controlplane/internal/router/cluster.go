package router

import (
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Cluster is the router's view of the cluster (implemented by controlplane/internal/state).
type Cluster interface {
	// Policy returns the current policy with every default filled in. Read-only.
	Policy() *kvcv1.Policy
	// Epoch is the leader epoch (create revision of the leader key); 0 when not leading.
	Epoch() int64
	// GenerationTerm is the leader's generation term (policy.NextGeneration): the range of the
	// KV generations this leader gives sessions; 0 when not leading.
	GenerationTerm() uint64
	// Workers returns an immutable snapshot of all workers with state and last load. Do not mutate.
	// A tensor-parallel group is one record (its rank 0's worker id, the group's state, capacity,
	// load and tp_ranks); its other ranks are left out.
	Workers() []*kvcv1.Worker
	// Session returns a copy of the session record.
	Session(id string) (*kvcv1.SessionRecord, bool)
	// UpdateSession applies fn to the live record (created with session_id set if missing) under
	// the state lock, then persists it write-behind. fn must be quick and must not call Cluster.
	// To change the snapshot, fn replaces rec.Snapshot (or sets it to nil), never modifies the
	// SnapshotInfo in place.
	UpdateSession(id string, fn func(rec *kvcv1.SessionRecord))
	// SendCommand queues a command on the worker's sidecar stream; command_id and epoch are filled
	// in. It fails when the worker has no live stream. For a tensor-parallel group it goes to
	// every rank, each naming the peer group's rank of the same index.
	SendCommand(workerID string, cmd *kvcv1.Command) error
}

// resyncer is implemented by a Cluster that knows when a new leader still waits for decode
// workers to report what they hold (state.State); policy.Input.Resyncing.
type resyncer interface{ Resyncing() bool }

// issuer is implemented by a Cluster that bounds the generations sidecars may report by what
// it issued (state.State.IssueGeneration): a decision that names a generation before its
// outcome makes it records it there.
type issuer interface{ IssueGeneration(g uint64) }

func (s *Service) resyncing() bool {
	r, ok := s.c.(resyncer)
	return ok && r.Resyncing()
}
