package state

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Tensor-parallel worker groups (docs/decisions.md "Tensor parallelism: a group is one worker").
//
// An SGLang server with --tp-size N runs N scheduler processes, one GPU and one sidecar each;
// every sidecar registers as its own worker with the group's name, its rank and N
// (Hello.tp_group, tp_rank, tp_size). The records stay per rank (etcd, streams, state, load);
// what the router sees (Workers) and ListWorkers lists is derived at every publish
// (groupWorkers): a group of tp_size > 1 is ONE worker named by its rank 0's worker id, with the
// group's state (READY only when every rank is), capacity (the smallest rank's), load (the
// fullest rank's) and every rank's addresses (Worker.tp_ranks); the other ranks are not
// routable. Residency (sessions' decode_worker, snapshots' prefill_worker) names the group by
// that id. Commands for a group go to every rank (sendUnitLocked), each naming the peer group's
// rank of the same index. A decode group's residency follows its rank 0's reports; a session
// another rank no longer holds is lost for the group. A prefill group's snapshot of a session is
// what every rank holds (tpSnapLocked). Workers of tp_size 0 or 1 are their own unit: nothing
// here changes how they are handled.

// tpErrorReasonText names a refusal in logs and metrics.
var tpErrorReasonText = map[kvcv1.TPErrorReason]string{
	kvcv1.TPErrorReason_TP_ERROR_REASON_SIZE_MISMATCH: "tp_size_mismatch",
	kvcv1.TPErrorReason_TP_ERROR_REASON_RANK_TAKEN:    "tp_rank_taken",
	kvcv1.TPErrorReason_TP_ERROR_REASON_ROLE_MISMATCH: "tp_role_mismatch",
}

// ErrTP is wrapped by every TPError (errors.Is).
var ErrTP = errors.New("state: tensor-parallel group conflict")

// ErrTPMember refuses an operation that applies to a tensor-parallel group as a whole (a drain)
// when it names a rank other than the group's routable id (its rank 0's worker id).
var ErrTPMember = errors.New("state: the worker is a rank of a tensor-parallel group; name the group by its rank 0's worker id")

// TPError is a hello refused for its tensor parallelism (Attach).
type TPError struct {
	Detail *kvcv1.TPError
	msg    string
}

func (e *TPError) Error() string { return e.msg }

// Unwrap makes errors.Is(err, ErrTP) true.
func (e *TPError) Unwrap() error { return ErrTP }

// Reason is the refusal's metric label (tp_size_mismatch, tp_rank_taken, tp_role_mismatch).
func (e *TPError) Reason() string { return tpErrorReasonText[e.Detail.GetReason()] }

// tpSize is a record's tensor-parallel size (0 and 1 alike: no tensor parallelism).
func tpSize(w *kvcv1.Worker) int32 { return max(w.GetTpSize(), 1) }

// grouped: the record is a rank of a tensor-parallel group (more than one rank).
func grouped(w *kvcv1.Worker) bool { return w.GetTpSize() > 1 }

// connected: the record's sidecar has a stream (as its state says).
func connected(w *kvcv1.Worker) bool {
	st := w.GetState()
	return st != kvcv1.WorkerState_WORKER_STATE_UNREACHABLE && st != kvcv1.WorkerState_WORKER_STATE_UNSPECIFIED
}

// checkTPLocked refuses a hello that conflicts with a connected rank of its group (another
// worker id): a different tp_size, a different role, or the same rank.
func (s *State) checkTPLocked(h *kvcv1.Hello) error {
	g := h.GetTpGroup()
	if g == "" {
		return nil
	}
	size := max(h.GetTpSize(), 1)
	ids := make([]string, 0, 8)
	for id, e := range s.workers {
		if id != h.GetWorkerId() && e.stream != nil && e.w.GetTpGroup() == g {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids) // the same answer whatever the map order
	for _, id := range ids {
		w := s.workers[id].w
		d := &kvcv1.TPError{TpGroup: g, TpRank: h.GetTpRank(), TpSize: size, ConflictingWorkerId: id, ConflictingTpSize: tpSize(w)}
		var msg string
		switch {
		case tpSize(w) != size:
			d.Reason = kvcv1.TPErrorReason_TP_ERROR_REASON_SIZE_MISMATCH
			msg = fmt.Sprintf("tensor parallelism: worker %q says tp_size %d for group %q, whose connected rank %d (%q) says %d: every rank of a group has the same tp_size (restart the worker with the group's size, or give it another --tp-group)",
				h.GetWorkerId(), size, g, w.GetTpRank(), id, tpSize(w))
		case w.GetRole() != h.GetRole():
			d.Reason = kvcv1.TPErrorReason_TP_ERROR_REASON_ROLE_MISMATCH
			msg = fmt.Sprintf("tensor parallelism: worker %q is a %s rank of group %q, whose connected rank %d (%q) is %s: a group is one worker of one role",
				h.GetWorkerId(), roleName(h.GetRole()), g, w.GetTpRank(), id, roleName(w.GetRole()))
		case w.GetTpRank() == h.GetTpRank():
			d.Reason = kvcv1.TPErrorReason_TP_ERROR_REASON_RANK_TAKEN
			msg = fmt.Sprintf("tensor parallelism: rank %d of group %q is already connected as worker %q (worker %q says it is that rank too: check its --tp-group and the worker's tp rank)",
				h.GetTpRank(), g, id, h.GetWorkerId())
		default:
			continue
		}
		return &TPError{Detail: d, msg: msg}
	}
	return nil
}

func roleName(r kvcv1.WorkerRole) string {
	switch r {
	case kvcv1.WorkerRole_WORKER_ROLE_PREFILL:
		return "prefill"
	case kvcv1.WorkerRole_WORKER_ROLE_DECODE:
		return "decode"
	}
	return r.String()
}

// tpShape is what of a record the grouping depends on; a reconnect that changes it makes the
// worker another unit (its residency is dropped, as for a role change).
type tpShape struct {
	group      string
	rank, size int32
}

func shapeOf(w *kvcv1.Worker) tpShape {
	return tpShape{group: w.GetTpGroup(), rank: w.GetTpRank(), size: tpSize(w)}
}

func helloShape(h *kvcv1.Hello) tpShape {
	return tpShape{group: h.GetTpGroup(), rank: h.GetTpRank(), size: max(h.GetTpSize(), 1)}
}

// tpView is the grouping of the worker records at one publish.
type tpView struct {
	// routing is what the router sees (Workers): every worker of tp_size <= 1, and one record
	// per group with a rank 0 (groupUnit). listing adds every other rank as itself
	// (ListWorkers, GetWorker). Without any grouped record both are the records themselves.
	routing, listing []*kvcv1.Worker
	// unit maps the worker id of each chosen rank of a group with a rank 0 to the group's id
	// (its rank 0's worker id). nil when no record is grouped.
	unit map[string]string
	// ranks is each group's worker id per rank ("" when none), by the group's id.
	ranks map[string][]string
	// problems: worker id -> tp_problem, for logs and the gauge.
	problems map[string]string
}

// groupWorkers groups the worker records (sorted by id) into routable units. Pure.
func groupWorkers(raw []*kvcv1.Worker) *tpView {
	v := &tpView{routing: raw, listing: raw}
	if !slices.ContainsFunc(raw, grouped) {
		return v
	}
	v.unit, v.ranks, v.problems = map[string]string{}, map[string][]string{}, map[string]string{}
	problem := map[*kvcv1.Worker][]string{}
	note := func(w *kvcv1.Worker, p string) { problem[w] = append(problem[w], p) }
	groups := map[string][]*kvcv1.Worker{}
	var order []string
	routing := make([]*kvcv1.Worker, 0, len(raw))
	for _, w := range raw {
		switch {
		case !grouped(w):
			routing = append(routing, w)
		case w.GetTpGroup() == "":
			note(w, fmt.Sprintf("tp_size %d without tp_group: a rank of no known group is not routed", tpSize(w)))
		default:
			g := w.GetTpGroup()
			if _, ok := groups[g]; !ok {
				order = append(order, g)
			}
			groups[g] = append(groups[g], w)
		}
	}
	replaced := map[*kvcv1.Worker]*kvcv1.Worker{} // a group's rank 0 -> its unit, in the listing
	for _, g := range order {
		members := groups[g]
		// The group's size and role: a connected rank's (Attach keeps them agreeing), else its
		// rank 0's, else the first record's.
		ref := members[0]
		if i := slices.IndexFunc(members, connected); i >= 0 {
			ref = members[i]
		} else if i := slices.IndexFunc(members, func(w *kvcv1.Worker) bool { return w.GetTpRank() == 0 }); i >= 0 {
			ref = members[i]
		}
		size, role := tpSize(ref), ref.GetRole()
		chosen := make([]*kvcv1.Worker, size)
		for _, m := range members {
			r := m.GetTpRank()
			switch {
			case tpSize(m) != size:
				note(m, fmt.Sprintf("stale rank of group %q: tp_size %d, the group's is %d", g, tpSize(m), size))
				continue
			case m.GetRole() != role:
				note(m, fmt.Sprintf("stale rank of group %q: %s, the group is %s", g, roleName(m.GetRole()), roleName(role)))
				continue
			case r < 0 || r >= size:
				note(m, fmt.Sprintf("rank %d out of the group's range [0, %d)", r, size))
				continue
			}
			switch c := chosen[r]; {
			case c == nil:
				chosen[r] = m
			case connected(m) && !connected(c):
				note(c, fmt.Sprintf("rank %d of group %q is held by the connected worker %q", r, g, m.GetWorkerId()))
				chosen[r] = m
			default:
				note(m, fmt.Sprintf("rank %d of group %q is held by worker %q", r, g, c.GetWorkerId()))
			}
		}
		lead := chosen[0]
		if lead == nil {
			for _, c := range chosen {
				if c != nil {
					note(c, fmt.Sprintf("rank 0 of group %q is not registered: the group is not routable", g))
				}
			}
			continue
		}
		u, ids, missing := groupUnit(lead, chosen)
		if len(missing) > 0 {
			u.TpProblem = strings.Join(missing, "; ")
		}
		v.ranks[lead.GetWorkerId()] = ids
		for _, id := range ids {
			if id != "" {
				v.unit[id] = lead.GetWorkerId()
			}
		}
		replaced[lead] = u
		routing = append(routing, u)
	}
	// Prefill and decode pair only with equal tp_size: a worker no worker of the other role can
	// pair with says so (the policy never pairs them).
	sizes := map[kvcv1.WorkerRole]map[int32]bool{}
	for _, u := range routing {
		if sizes[u.GetRole()] == nil {
			sizes[u.GetRole()] = map[int32]bool{}
		}
		sizes[u.GetRole()][tpSize(u)] = true
	}
	for i, u := range routing {
		other := kvcv1.WorkerRole_WORKER_ROLE_PREFILL
		if u.GetRole() == kvcv1.WorkerRole_WORKER_ROLE_PREFILL {
			other = kvcv1.WorkerRole_WORKER_ROLE_DECODE
		}
		if len(sizes[other]) == 0 || sizes[other][tpSize(u)] {
			continue
		}
		var have []string
		for _, n := range slices.Sorted(maps.Keys(sizes[other])) {
			have = append(have, strconv.Itoa(int(n)))
		}
		p := fmt.Sprintf("no %s worker with tp_size %d (theirs: %s): prefill and decode pair only with equal tp_size (unequal TP on P and D is not supported); not paired with any",
			roleName(other), tpSize(u), strings.Join(have, ", "))
		if !grouped(u) { // a record of the state's: copy it before writing into it
			c := proto.Clone(u).(*kvcv1.Worker)
			replaced[u], routing[i], u = c, c, c
		}
		u.TpProblem = joinProblem(u.TpProblem, p)
	}
	listing := make([]*kvcv1.Worker, 0, len(raw))
	for _, w := range raw {
		out := w
		if u, ok := replaced[w]; ok {
			out = u
		}
		if ps := problem[w]; len(ps) > 0 {
			if out == w {
				out = proto.Clone(w).(*kvcv1.Worker)
			}
			out.TpProblem = joinProblem(out.TpProblem, strings.Join(ps, "; "))
		}
		if out.GetTpProblem() != "" {
			v.problems[out.GetWorkerId()] = out.GetTpProblem()
		}
		listing = append(listing, out)
	}
	slices.SortFunc(routing, func(a, b *kvcv1.Worker) int { return strings.Compare(a.GetWorkerId(), b.GetWorkerId()) })
	v.routing, v.listing = routing, listing
	return v
}

func joinProblem(a, b string) string {
	if a == "" {
		return b
	}
	return a + "; " + b
}

// groupUnit is a group's routable record: its rank 0's, with the group's state, capacity, load
// and ranks (fresh; the records are not modified). It returns the worker id of each rank and
// what is missing.
func groupUnit(lead *kvcv1.Worker, chosen []*kvcv1.Worker) (u *kvcv1.Worker, ids []string, missing []string) {
	u = proto.Clone(lead).(*kvcv1.Worker)
	ids = make([]string, len(chosen))
	u.TpRanks = make([]*kvcv1.TPRank, len(chosen))
	st := kvcv1.WorkerState_WORKER_STATE_READY
	var load *kvcv1.WorkerLoad
	var maxPinned int64
	u.WorkerDownSinceUnixMs, u.WorkerDownReason, u.UnreachableSinceUnixMs = 0, "", 0
	for r, c := range chosen {
		tr := &kvcv1.TPRank{TpRank: int32(r)}
		u.TpRanks[r] = tr
		if c == nil {
			missing = append(missing, fmt.Sprintf("rank %d not registered", r))
			st = kvcv1.WorkerState_WORKER_STATE_UNREACHABLE
			continue
		}
		ids[r] = c.GetWorkerId()
		tr.WorkerId, tr.PeerAddr, tr.TransferEndpoint, tr.State = c.GetWorkerId(), c.GetPeerAddr(), c.GetTransferEndpoint(), c.GetState()
		switch c.GetState() {
		case kvcv1.WorkerState_WORKER_STATE_UNREACHABLE, kvcv1.WorkerState_WORKER_STATE_UNSPECIFIED:
			missing = append(missing, fmt.Sprintf("rank %d (%s) unreachable", r, c.GetWorkerId()))
			st = kvcv1.WorkerState_WORKER_STATE_UNREACHABLE
			u.UnreachableSinceUnixMs = max(u.UnreachableSinceUnixMs, c.GetUnreachableSinceUnixMs())
		case kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN:
			missing = append(missing, fmt.Sprintf("rank %d (%s) worker down", r, c.GetWorkerId()))
			if st != kvcv1.WorkerState_WORKER_STATE_UNREACHABLE {
				st = kvcv1.WorkerState_WORKER_STATE_WORKER_DOWN
			}
			if u.WorkerDownSinceUnixMs == 0 {
				u.WorkerDownSinceUnixMs = c.GetWorkerDownSinceUnixMs()
				u.WorkerDownReason = fmt.Sprintf("rank %d (%s): %s", r, c.GetWorkerId(), c.GetWorkerDownReason())
			}
		case kvcv1.WorkerState_WORKER_STATE_DRAINING:
			if st == kvcv1.WorkerState_WORKER_STATE_READY {
				st = kvcv1.WorkerState_WORKER_STATE_DRAINING
			}
		}
		// Capacity: the smallest rank's; occupancy: the fullest rank's.
		if r == 0 || c.GetKvCapacityTokens() < u.KvCapacityTokens {
			u.KvCapacityTokens = c.GetKvCapacityTokens()
		}
		if l := c.GetLoad(); l != nil {
			if load == nil {
				load = &kvcv1.WorkerLoad{}
			}
			maxPinned = max(maxPinned, l.GetUsedTokens()-max(0, l.GetEvictableTokens()))
			load.UnevictableTokens = max(load.UnevictableTokens, l.GetUnevictableTokens())
			load.UsedTokens = max(load.UsedTokens, l.GetUsedTokens())
			load.RunningRequests = max(load.RunningRequests, l.GetRunningRequests())
			load.WaitingRequests = max(load.WaitingRequests, l.GetWaitingRequests())
			load.TransferQueueDepth = max(load.TransferQueueDepth, l.GetTransferQueueDepth())
			load.PreallocQueueDepth = max(load.PreallocQueueDepth, l.GetPreallocQueueDepth())
			load.RetractedQueueDepth = max(load.RetractedQueueDepth, l.GetRetractedQueueDepth())
			load.ResidentSessions = max(load.ResidentSessions, l.GetResidentSessions())
			load.SnapshotSessions = max(load.SnapshotSessions, l.GetSnapshotSessions())
			// A snapshot is split over the ranks' stores: their bytes add up.
			load.SnapshotBytesUsed += l.GetSnapshotBytesUsed()
			load.SnapshotBytesCapacity += l.GetSnapshotBytesCapacity()
			load.InflightPushes += l.GetInflightPushes()
			if l.GetWorkerDown() && !load.WorkerDown {
				load.WorkerDown, load.WorkerDownReason = true, l.GetWorkerDownReason()
			}
		}
	}
	if load != nil {
		load.EvictableTokens = max(0, load.UsedTokens-maxPinned)
	}
	u.Load = load
	if lead.GetDraining() && st == kvcv1.WorkerState_WORKER_STATE_READY {
		st = kvcv1.WorkerState_WORKER_STATE_DRAINING
	}
	u.State = st
	return u, ids, missing
}

// unitLocked is the routable id of worker id's unit: its group's (rank 0's worker id) for a
// rank of a group with a rank 0, "" for a rank of any other group, else id itself.
func (s *State) unitLocked(id string) string {
	if s.view.unit == nil || id == "" {
		return id
	}
	if u, ok := s.view.unit[id]; ok {
		return u
	}
	if e, ok := s.workers[id]; ok && grouped(e.w) {
		return ""
	}
	return id
}

// rankLocked is worker id's rank in its group (0 for a worker of no group).
func (s *State) rankLocked(id string) int32 {
	if s.view.unit == nil {
		return 0
	}
	if e, ok := s.workers[id]; ok && grouped(e.w) {
		return e.w.GetTpRank()
	}
	return 0
}

// unitStreamsLocked returns the streams of every rank of unit (one for a worker of no group),
// or ErrNoStream naming the first rank without one.
func (s *State) unitStreamsLocked(unit string) ([]*Stream, error) {
	ids, ok := s.view.ranks[unit]
	if !ok {
		e, ok := s.workers[unit]
		if !ok || e.stream == nil {
			return nil, fmt.Errorf("%w: %s", ErrNoStream, unit)
		}
		return []*Stream{e.stream}, nil
	}
	out := make([]*Stream, len(ids))
	for r, id := range ids {
		e, ok := s.workers[id]
		if id == "" || !ok || e.stream == nil {
			return nil, fmt.Errorf("%w: rank %d of %s", ErrNoStream, r, unit)
		}
		out[r] = e.stream
	}
	return out, nil
}

// unitConnectedLocked: every rank of unit has a stream.
func (s *State) unitConnectedLocked(unit string) bool {
	_, err := s.unitStreamsLocked(unit)
	return err == nil
}

// sendUnitLocked queues cmd for unit: on its stream, or, for a tensor-parallel group, on every
// rank's stream, each a copy naming the peer group's rank of the same index (rankCommandLocked).
// Every rank must be connected (nothing is sent otherwise).
func (s *State) sendUnitLocked(unit string, cmd *kvcv1.Command) error {
	sts, err := s.unitStreamsLocked(unit)
	if err != nil {
		s.m.cmdNoStream.Inc()
		return err
	}
	if s.view.unit == nil { // no tensor parallelism anywhere
		return s.sendLocked(sts[0], cmd)
	}
	cmds := make([]*kvcv1.Command, len(sts))
	for r := range sts {
		if cmds[r], err = s.rankCommandLocked(cmd, int32(r), int32(len(sts)), len(sts) > 1); err != nil {
			return err
		}
	}
	for r, st := range sts {
		if err := s.sendLocked(st, cmds[r]); err != nil {
			return err
		}
	}
	return nil
}

// rankCommandLocked is cmd as rank r of a unit of size ranks receives it: the peer it names (a
// snapshot target's prefill worker, a snapshot push's decode worker) replaced by that peer's
// rank r (its worker id, peer address and transfer endpoint). The peer must have the same
// tp_size (ErrTP otherwise: prefill and decode pair only with equal tensor parallelism). A copy
// when copy is set (each rank's command gets its own id).
func (s *State) rankCommandLocked(cmd *kvcv1.Command, r, size int32, copy bool) (*kvcv1.Command, error) {
	var peer string
	switch a := cmd.GetAction().(type) {
	case *kvcv1.Command_SetSnapshotTarget:
		peer = a.SetSnapshotTarget.GetPrefillWorkerId()
	case *kvcv1.Command_PushSnapshot:
		peer = a.PushSnapshot.GetDecodeWorkerId()
	}
	var pw *kvcv1.Worker
	if peer != "" {
		var err error
		if pw, err = s.peerRankLocked(peer, r, size); err != nil {
			return nil, err
		}
	}
	if !copy && pw == nil {
		return cmd, nil
	}
	c := proto.Clone(cmd).(*kvcv1.Command)
	if pw == nil {
		return c, nil
	}
	switch a := c.GetAction().(type) {
	case *kvcv1.Command_SetSnapshotTarget:
		t := a.SetSnapshotTarget
		t.PrefillWorkerId, t.PeerAddr, t.TransferEndpoint = pw.GetWorkerId(), pw.GetPeerAddr(), pw.GetTransferEndpoint()
	case *kvcv1.Command_PushSnapshot:
		p := a.PushSnapshot
		p.DecodeWorkerId, p.DecodePeerAddr, p.DecodeTransferEndpoint = pw.GetWorkerId(), pw.GetPeerAddr(), pw.GetTransferEndpoint()
	}
	return c, nil
}

// peerRankLocked is rank r's record of the peer unit a command names, or nil when the peer is a
// worker of no group and so is the receiver (size 1: the command names it already).
func (s *State) peerRankLocked(peer string, r, size int32) (*kvcv1.Worker, error) {
	ids, ok := s.view.ranks[peer]
	psize := int32(1)
	if ok {
		psize = int32(len(ids))
	} else if e, known := s.workers[peer]; known && grouped(e.w) {
		return nil, fmt.Errorf("%w: %s is a rank of a group without a routable rank 0", ErrTP, peer)
	}
	if psize != size {
		return nil, fmt.Errorf("%w: the command's peer %s has tp_size %d, the receiver %d (prefill and decode pair only with equal tp_size)", ErrTP, peer, psize, size)
	}
	if !ok {
		return nil, nil
	}
	e, known := s.workers[ids[r]]
	if ids[r] == "" || !known {
		return nil, fmt.Errorf("%w: rank %d of %s", ErrNoStream, r, peer)
	}
	return e.w, nil
}

// tpShard is what one rank of a prefill group holds of a session's snapshot.
type tpShard struct {
	seqlen, bytes, updated int64
	gen                    uint64
}

// setShardLocked records (or, with nil, forgets) rank worker id's shard of session sid.
func (s *State) setShardLocked(sid, id string, sh *tpShard) {
	if sh == nil {
		if m := s.tpSnap[sid]; m != nil {
			delete(m, id)
			if len(m) == 0 {
				delete(s.tpSnap, sid)
			}
		}
		unindex(s.tpSnapBy, id, sid)
		return
	}
	m := s.tpSnap[sid]
	if m == nil {
		m = map[string]tpShard{}
		s.tpSnap[sid] = m
	}
	m[id] = *sh
	index(s.tpSnapBy, id, sid)
}

// groupSnapshotLocked sets rec's snapshot from its shards on the group unit: the generation
// every rank holds, the shortest of their seqlens (a reseed can read only what every rank has).
// When the ranks do not all hold one generation, a snapshot on that group is cleared (another
// group's is left alone: an incomplete new one does not replace it). It reports a change.
func (s *State) groupSnapshotLocked(rec *kvcv1.SessionRecord, unit string) bool {
	ids := s.view.ranks[unit]
	if unit == "" || ids == nil {
		return false
	}
	shards := s.tpSnap[rec.GetSessionId()]
	var info *kvcv1.SnapshotInfo
	for r, id := range ids {
		sh, ok := shards[id]
		if id == "" || !ok || (info != nil && sh.gen != info.Generation) {
			info = nil
			break
		}
		if r == 0 {
			info = &kvcv1.SnapshotInfo{PrefillWorker: unit, Seqlen: sh.seqlen, Generation: sh.gen, UpdatedUnixMs: sh.updated}
		}
		info.Seqlen = min(info.Seqlen, sh.seqlen)
		info.UpdatedUnixMs = max(info.UpdatedUnixMs, sh.updated)
		info.Bytes += sh.bytes
	}
	old := rec.GetSnapshot()
	switch {
	case info == nil && old.GetPrefillWorker() == unit:
		rec.Snapshot = nil
	case info != nil && !proto.Equal(info, old):
		rec.Snapshot = info
	default:
		return false
	}
	return true
}

// applyShardsLocked records rank worker w's shards of a prefill group (events and resyncs) and
// updates each touched session's snapshot. With full set, w's shards not listed are forgotten.
func (s *State) applyShardsLocked(w string, shards map[string]*tpShard, full bool) {
	unit := s.unitLocked(w)
	touched := make([]string, 0, len(shards))
	for sid, sh := range shards {
		s.setShardLocked(sid, w, sh)
		touched = append(touched, sid)
	}
	if full {
		for _, sid := range keys(s.tpSnapBy[w]) {
			if _, ok := shards[sid]; !ok {
				s.setShardLocked(sid, w, nil)
				touched = append(touched, sid)
			}
		}
	}
	slices.Sort(touched)
	for _, sid := range touched {
		e, ok := s.sessions[sid]
		if !ok {
			if shards[sid] == nil {
				continue
			}
			e = s.createLocked(sid)
		}
		rec := e.rec
		oldD, oldP := rec.GetDecodeWorker(), rec.GetSnapshot().GetPrefillWorker()
		if s.groupSnapshotLocked(rec, unit) {
			s.changedLocked(rec, oldD, oldP)
			s.kickDrainLocked(oldD)
		}
	}
}

// tpProblemsChangedLocked logs each worker whose tensor-parallel problem appeared, changed or
// cleared at this publish, and sets the gauge.
func (s *State) tpProblemsChangedLocked(old, cur map[string]string) {
	s.m.tpProblems.Set(float64(len(cur)))
	for _, id := range slices.Sorted(maps.Keys(cur)) {
		if old[id] != cur[id] {
			s.log.Warn().Str("worker", id).Str("tp_problem", cur[id]).Msg("tensor parallelism: worker not routed as it should be")
		}
	}
	for _, id := range slices.Sorted(maps.Keys(old)) {
		if _, ok := cur[id]; !ok {
			s.log.Info().Str("worker", id).Str("was", old[id]).Msg("tensor parallelism: problem cleared")
		}
	}
}

// rankStreamsLocked returns the streams of unit's connected ranks (its own, when connected,
// for a worker of no group).
func (s *State) rankStreamsLocked(unit string) []*Stream {
	ids, ok := s.view.ranks[unit]
	if !ok {
		ids = []string{unit}
	}
	var out []*Stream
	for _, id := range ids {
		if e, ok := s.workers[id]; ok && e.stream != nil {
			out = append(out, e.stream)
		}
	}
	return out
}

// listedLocked is worker id as ListWorkers lists it (nil when unknown).
func (s *State) listedLocked(id string) *kvcv1.Worker {
	for _, w := range s.view.listing {
		if w.GetWorkerId() == id {
			return w
		}
	}
	return nil
}

// ListWorkers is how ListWorkers lists these worker records (from etcd, on a standby): sorted by
// id, a tensor-parallel group's rank 0 with the group's state and ranks, every other rank as
// itself, with its tp_problem.
func ListWorkers(raw []*kvcv1.Worker) []*kvcv1.Worker {
	ws := slices.Clone(raw)
	slices.SortFunc(ws, func(a, b *kvcv1.Worker) int { return strings.Compare(a.GetWorkerId(), b.GetWorkerId()) })
	return groupWorkers(ws).listing
}
