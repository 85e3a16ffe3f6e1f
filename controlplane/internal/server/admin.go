package server

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/controlplane/internal/election"
	"github.com/kvcentric/kvcentric/controlplane/internal/state"
	"github.com/kvcentric/kvcentric/pkg/kvstore"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Leadership is what the services need to know about the election.
type Leadership interface {
	IsLeader() bool
	Current() (election.Leader, bool)
	NotLeaderError() error
}

// Admin implements kvc.v1.AdminService.
type Admin struct {
	kvcv1.UnimplementedAdminServiceServer
	NodeID string
	State  *state.State
	Store  *kvstore.Store
	Lead   Leadership
}

// leaderReads reports whether reads come from memory (this replica leads and has loaded).
func (a *Admin) leaderReads() bool { return a.Lead.IsLeader() && a.State.Leading() }

// etcdErr maps a store error to a stable gRPC code: the caller's own deadline or cancel
// (ctx done) keeps its code; a value or database over etcd's limits is permanent
// (RESOURCE_EXHAUSTED); anything else, an etcd that did not answer within the store's call
// timeout included, is retryable (UNAVAILABLE).
func etcdErr(ctx context.Context, err error) error {
	switch {
	case ctx.Err() != nil:
		return status.FromContextError(ctx.Err()).Err()
	case errors.Is(err, kvstore.ErrTooLarge), errors.Is(err, kvstore.ErrNoSpace):
		return status.Errorf(codes.ResourceExhausted, "etcd: %v", err)
	}
	return status.Errorf(codes.Unavailable, "etcd: %v", err)
}

// GetLeader names the current leader. Any replica answers.
func (a *Admin) GetLeader(context.Context, *kvcv1.GetLeaderRequest) (*kvcv1.GetLeaderResponse, error) {
	resp := &kvcv1.GetLeaderResponse{ResponderId: a.NodeID, ResponderIsLeader: a.Lead.IsLeader()}
	if l, ok := a.Lead.Current(); ok {
		resp.LeaderId, resp.LeaderAddr, resp.Epoch = l.NodeID, l.Addr, l.Epoch
	}
	return resp, nil
}

// ListWorkers lists workers, optionally of one role. A tensor-parallel group is listed as its
// rank 0 with the group's state and ranks, and every other rank as itself (state.ListWorkers).
func (a *Admin) ListWorkers(ctx context.Context, req *kvcv1.ListWorkersRequest) (*kvcv1.ListWorkersResponse, error) {
	var ws []*kvcv1.Worker
	if a.leaderReads() {
		ws = a.State.ListedWorkers()
	} else {
		var err error
		if ws, err = a.Store.ListWorkers(ctx); err != nil {
			return nil, etcdErr(ctx, err)
		}
		ws = state.ListWorkers(ws)
	}
	out := &kvcv1.ListWorkersResponse{}
	for _, w := range ws {
		if req.GetRole() == kvcv1.WorkerRole_WORKER_ROLE_UNSPECIFIED || w.GetRole() == req.GetRole() {
			out.Workers = append(out.Workers, w)
		}
	}
	return out, nil
}

// GetWorker returns one worker.
func (a *Admin) GetWorker(ctx context.Context, req *kvcv1.GetWorkerRequest) (*kvcv1.GetWorkerResponse, error) {
	var w *kvcv1.Worker
	var ok bool
	if a.leaderReads() {
		w, ok = a.State.Worker(req.GetWorkerId())
	} else {
		ws, err := a.Store.ListWorkers(ctx) // a group's rank 0 is listed with its group's state
		if err != nil {
			return nil, etcdErr(ctx, err)
		}
		for _, x := range state.ListWorkers(ws) {
			if x.GetWorkerId() == req.GetWorkerId() {
				w, ok = x, true
				break
			}
		}
	}
	if !ok {
		return nil, status.Errorf(codes.NotFound, "worker %q not found", req.GetWorkerId())
	}
	return &kvcv1.GetWorkerResponse{Worker: w}, nil
}

// ListSessions pages through sessions (page token: the last session id of the previous page).
func (a *Admin) ListSessions(ctx context.Context, req *kvcv1.ListSessionsRequest) (*kvcv1.ListSessionsResponse, error) {
	size := int(req.GetPageSize())
	if size == 0 {
		size = 100
	}
	if a.leaderReads() {
		recs, next := a.State.ListSessions(req.GetPageToken(), size, req.GetWorkerId())
		return &kvcv1.ListSessionsResponse{Sessions: recs, NextPageToken: next}, nil
	}
	var keep func(*kvcv1.SessionRecord) bool
	if w := req.GetWorkerId(); w != "" {
		keep = func(r *kvcv1.SessionRecord) bool { return r.GetDecodeWorker() == w }
	}
	recs, next, err := a.Store.ListSessions(ctx, req.GetPageToken(), size, keep)
	if err != nil {
		return nil, etcdErr(ctx, err)
	}
	return &kvcv1.ListSessionsResponse{Sessions: recs, NextPageToken: next}, nil
}

// GetSession returns one session record.
func (a *Admin) GetSession(ctx context.Context, req *kvcv1.GetSessionRequest) (*kvcv1.GetSessionResponse, error) {
	var r *kvcv1.SessionRecord
	var ok bool
	if a.leaderReads() {
		r, ok = a.State.Session(req.GetSessionId())
	} else {
		var err error
		if r, ok, err = a.Store.GetSession(ctx, req.GetSessionId()); err != nil {
			return nil, etcdErr(ctx, err)
		}
	}
	if !ok {
		return nil, status.Errorf(codes.NotFound, "session %q not found", req.GetSessionId())
	}
	return &kvcv1.GetSessionResponse{Session: r}, nil
}

// GetPolicy returns the policy with defaults filled in.
func (a *Admin) GetPolicy(ctx context.Context, _ *kvcv1.GetPolicyRequest) (*kvcv1.GetPolicyResponse, error) {
	if a.leaderReads() {
		return &kvcv1.GetPolicyResponse{Policy: proto.Clone(a.State.Policy()).(*kvcv1.Policy)}, nil
	}
	p, ok, err := a.Store.GetPolicy(ctx)
	if err != nil {
		return nil, etcdErr(ctx, err)
	}
	if !ok {
		p = nil
	}
	return &kvcv1.GetPolicyResponse{Policy: state.FillPolicy(a.State.Defaults(), p)}, nil
}

// UpdatePolicy merges, validates and stores a policy update (leader only).
func (a *Admin) UpdatePolicy(ctx context.Context, req *kvcv1.UpdatePolicyRequest) (*kvcv1.UpdatePolicyResponse, error) {
	if !a.Lead.IsLeader() {
		return nil, a.Lead.NotLeaderError()
	}
	p, err := a.State.UpdatePolicy(ctx, req.GetPolicy())
	switch {
	case err == nil:
		return &kvcv1.UpdatePolicyResponse{Policy: p}, nil
	case errors.Is(err, state.ErrInvalidPolicy):
		return nil, status.Error(codes.InvalidArgument, err.Error())
	case errors.Is(err, state.ErrPolicyTooLarge):
		return nil, status.Error(codes.ResourceExhausted, err.Error())
	case errors.Is(err, state.ErrNotLeader):
		return nil, a.Lead.NotLeaderError()
	default:
		return nil, etcdErr(ctx, err)
	}
}

// DrainWorker sets or clears a worker's draining flag (leader only). It answers once the
// change is in etcd: a drain only in this leader's memory would be lost by a failover, so when
// etcd does not take it within the store's call timeout the answer is UNAVAILABLE (retrying is
// harmless: the call is idempotent).
func (a *Admin) DrainWorker(ctx context.Context, req *kvcv1.DrainWorkerRequest) (*kvcv1.DrainWorkerResponse, error) {
	if !a.Lead.IsLeader() {
		return nil, a.Lead.NotLeaderError()
	}
	w, err := a.State.Drain(req.GetWorkerId(), !req.GetUndrain())
	if err == nil && a.Store != nil {
		fctx, cancel := context.WithTimeout(ctx, a.Store.CallTimeout())
		ferr := a.State.Flush(fctx)
		cancel()
		switch {
		case ferr == nil:
		case ctx.Err() != nil:
			return nil, status.FromContextError(ctx.Err()).Err()
		case errors.Is(ferr, kvstore.ErrFenced), errors.Is(ferr, state.ErrNotLeader):
			return nil, a.Lead.NotLeaderError()
		default:
			return nil, status.Errorf(codes.Unavailable, "drain of %q applied on this leader but not persisted: etcd did not take it within %s (%v); retry (the call is idempotent)",
				req.GetWorkerId(), a.Store.CallTimeout(), ferr)
		}
	}
	switch {
	case err == nil:
		resp := &kvcv1.DrainWorkerResponse{Worker: w}
		resp.Status, _, _ = a.State.DrainStatus(req.GetWorkerId())
		return resp, nil
	case errors.Is(err, state.ErrUnknownWorker):
		return nil, status.Errorf(codes.NotFound, "worker %q not found", req.GetWorkerId())
	case errors.Is(err, state.ErrTPMember):
		return nil, status.Error(codes.FailedPrecondition, err.Error())
	case errors.Is(err, state.ErrNotLeader):
		return nil, a.Lead.NotLeaderError()
	default:
		return nil, status.Error(codes.Internal, err.Error())
	}
}

// GetDrainStatus reports a worker's drain progress (leader only: the move runs there). NOT_FOUND
// when the worker is unknown or has not drained under this leader's term.
func (a *Admin) GetDrainStatus(_ context.Context, req *kvcv1.GetDrainStatusRequest) (*kvcv1.GetDrainStatusResponse, error) {
	if !a.Lead.IsLeader() {
		return nil, a.Lead.NotLeaderError()
	}
	st, ok, err := a.State.DrainStatus(req.GetWorkerId())
	switch {
	case errors.Is(err, state.ErrNotLeader):
		return nil, a.Lead.NotLeaderError()
	case err != nil:
		return nil, status.Error(codes.Internal, err.Error())
	case !ok:
		return nil, status.Errorf(codes.NotFound, "worker %q has no drain under this leader (DrainWorker starts one)", req.GetWorkerId())
	}
	return &kvcv1.GetDrainStatusResponse{Status: st}, nil
}

// ForgetWorker removes a decommissioned worker, its residency and its per-worker policy
// override (leader only). It answers once the removal is in etcd (UNAVAILABLE otherwise; retrying is harmless: NOT_FOUND then
// means it is gone). A connected worker is refused with FAILED_PRECONDITION unless forced.
func (a *Admin) ForgetWorker(ctx context.Context, req *kvcv1.ForgetWorkerRequest) (*kvcv1.ForgetWorkerResponse, error) {
	if !a.Lead.IsLeader() {
		return nil, a.Lead.NotLeaderError()
	}
	unbound, snaps, err := a.State.ForgetWorker(req.GetWorkerId(), req.GetForce())
	switch {
	case err == nil:
	case errors.Is(err, state.ErrUnknownWorker):
		return nil, status.Errorf(codes.NotFound, "worker %q not found", req.GetWorkerId())
	case errors.Is(err, state.ErrWorkerConnected):
		return nil, status.Errorf(codes.FailedPrecondition, "worker %q is connected: stop its sidecar first, or set force", req.GetWorkerId())
	case errors.Is(err, state.ErrNotLeader):
		return nil, a.Lead.NotLeaderError()
	default:
		return nil, status.Error(codes.Internal, err.Error())
	}
	if a.Store != nil {
		fctx, cancel := context.WithTimeout(ctx, a.Store.CallTimeout())
		ferr := a.State.Flush(fctx)
		cancel()
		switch {
		case ferr == nil:
		case ctx.Err() != nil:
			return nil, status.FromContextError(ctx.Err()).Err()
		case errors.Is(ferr, kvstore.ErrFenced), errors.Is(ferr, state.ErrNotLeader):
			return nil, a.Lead.NotLeaderError()
		default:
			return nil, status.Errorf(codes.Unavailable, "worker %q forgotten on this leader but not persisted: etcd did not take it within %s (%v)",
				req.GetWorkerId(), a.Store.CallTimeout(), ferr)
		}
	}
	// Its per-worker policy override would stay in the record forever (overrides are accepted
	// only for known workers, so it could not be set again either): remove it.
	if _, ok := a.State.StoredPolicy().GetMaxConcurrentTransfersPerWorker()[req.GetWorkerId()]; ok {
		rm := &kvcv1.Policy{MaxConcurrentTransfersPerWorker: map[string]int32{req.GetWorkerId(): -1}}
		if _, err := a.State.UpdatePolicy(ctx, rm); err != nil {
			return nil, status.Errorf(codes.Unavailable, "worker %q forgotten, but its max_concurrent_transfers_per_worker override was not removed (%v); remove it with UpdatePolicy (a negative value)",
				req.GetWorkerId(), err)
		}
	}
	return &kvcv1.ForgetWorkerResponse{SessionsUnbound: int64(unbound), SnapshotsDropped: int64(snaps)}, nil
}
