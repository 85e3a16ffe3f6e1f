package server

import (
	"fmt"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// maxStrLen bounds free-text fields (URLs, endpoints, versions, tp groups) in sidecar messages.
const maxStrLen = 1024

// maxTPSize bounds Hello.tp_size (the sidecars' own limit on a registration, kvxfer.MaxTPSize).
const maxTPSize = 1024

func checkStr(field, v string) error {
	if len(v) > maxStrLen {
		return fmt.Errorf("%s is %d bytes, longer than %d", field, len(v), maxStrLen)
	}
	return nil
}

func nonNeg(field string, v int64) error {
	if v < 0 {
		return fmt.Errorf("%s = %d is negative", field, v)
	}
	return nil
}

func firstErr(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

func validateHello(h *kvcv1.Hello) error {
	role := h.GetRole()
	if role != kvcv1.WorkerRole_WORKER_ROLE_PREFILL && role != kvcv1.WorkerRole_WORKER_ROLE_DECODE {
		return fmt.Errorf("role %d is not prefill or decode", int32(role))
	}
	// Tensor parallelism: rank tp_rank of tp_size (0 or 1: none); a worker of several ranks names
	// its group (the ranks of one server are routed as one worker).
	switch rank, size := h.GetTpRank(), h.GetTpSize(); {
	case size < 0 || size > maxTPSize:
		return fmt.Errorf("tp_size %d out of range [0, %d]", size, maxTPSize)
	case rank < 0 || rank >= max(size, 1):
		return fmt.Errorf("tp_rank %d out of range [0, %d)", rank, max(size, 1))
	case size > 1 && h.GetTpGroup() == "":
		return fmt.Errorf("tp_size %d without tp_group: the ranks of a tensor-parallel worker must name their group (sidecar --tp-group, or --worker-url, which they share)", size)
	}
	return firstErr(
		kvcv1.ValidateID("worker_id", h.GetWorkerId()),
		kvcv1.ValidateOptionalID("node", h.GetNode()),
		nonNeg("gpu_index", int64(h.GetGpuIndex())),
		nonNeg("kv_capacity_tokens", h.GetKvCapacityTokens()),
		nonNeg("kv_bytes_per_token", h.GetKvBytesPerToken()),
		nonNeg("last_epoch_seen", h.GetLastEpochSeen()),
		checkStr("worker_url", h.GetWorkerUrl()),
		checkStr("transfer_endpoint", h.GetTransferEndpoint()),
		checkStr("transport", h.GetTransport()),
		checkStr("peer_addr", h.GetPeerAddr()),
		checkStr("version", h.GetVersion()),
		checkStr("tp_group", h.GetTpGroup()),
	)
}

func validateLoad(l *kvcv1.WorkerLoad) error {
	if l == nil {
		return fmt.Errorf("load is required")
	}
	return firstErr(
		nonNeg("used_tokens", l.GetUsedTokens()),
		nonNeg("running_requests", int64(l.GetRunningRequests())),
		nonNeg("waiting_requests", int64(l.GetWaitingRequests())),
		nonNeg("transfer_queue_depth", int64(l.GetTransferQueueDepth())),
		nonNeg("prealloc_queue_depth", int64(l.GetPreallocQueueDepth())),
		nonNeg("retracted_queue_depth", int64(l.GetRetractedQueueDepth())),
		nonNeg("snapshot_bytes_used", l.GetSnapshotBytesUsed()),
		nonNeg("snapshot_bytes_capacity", l.GetSnapshotBytesCapacity()),
		nonNeg("resident_sessions", int64(l.GetResidentSessions())),
		nonNeg("snapshot_sessions", int64(l.GetSnapshotSessions())),
		nonNeg("inflight_pushes", int64(l.GetInflightPushes())),
	)
}

func validateResident(role kvcv1.WorkerRole, rs *kvcv1.ResidentSessions) (reason string, err error) {
	if role == kvcv1.WorkerRole_WORKER_ROLE_PREFILL && len(rs.GetSessions()) > 0 {
		return "role_mismatch", fmt.Errorf("a prefill worker reported resident decode sessions")
	}
	if role == kvcv1.WorkerRole_WORKER_ROLE_DECODE && len(rs.GetSnapshots()) > 0 {
		return "role_mismatch", fmt.Errorf("a decode worker reported snapshots")
	}
	seen := make(map[string]struct{}, len(rs.GetSessions())+len(rs.GetSnapshots()))
	dup := func(id string) error {
		if _, ok := seen[id]; ok {
			return fmt.Errorf("session %q listed twice", id)
		}
		seen[id] = struct{}{}
		return nil
	}
	for i, s := range rs.GetSessions() {
		if err := firstErr(kvcv1.ValidateID(fmt.Sprintf("sessions[%d].session_id", i), s.GetSessionId()),
			nonNeg(fmt.Sprintf("sessions[%d].kv_committed_len", i), s.GetKvCommittedLen()), dup(s.GetSessionId())); err != nil {
			return "invalid_resident", err
		}
	}
	for i, s := range rs.GetSnapshots() {
		if err := firstErr(kvcv1.ValidateID(fmt.Sprintf("snapshots[%d].session_id", i), s.GetSessionId()),
			nonNeg(fmt.Sprintf("snapshots[%d].seqlen", i), s.GetSeqlen()),
			nonNeg(fmt.Sprintf("snapshots[%d].bytes", i), s.GetBytes()),
			kvcv1.ValidateOptionalID(fmt.Sprintf("snapshots[%d].source_worker", i), s.GetSourceWorker()),
			dup(s.GetSessionId())); err != nil {
			return "invalid_resident", err
		}
	}
	return "", nil
}

func validateEvent(role kvcv1.WorkerRole, ev *kvcv1.SessionEvent) (reason string, err error) {
	k := ev.GetKind()
	if _, ok := kvcv1.SessionEventKind_name[int32(k)]; !ok || k == kvcv1.SessionEventKind_SESSION_EVENT_KIND_UNSPECIFIED {
		return "unknown_event_kind", fmt.Errorf("unknown session event kind %d", int32(k))
	}
	if err := firstErr(kvcv1.ValidateID("session_id", ev.GetSessionId()),
		nonNeg("kv_len", ev.GetKvLen()), nonNeg("bytes", ev.GetBytes()),
		kvcv1.ValidateOptionalID("peer_worker", ev.GetPeerWorker()),
		checkStr("detail", ev.GetDetail())); err != nil {
		return "invalid_event", err
	}
	switch k {
	case kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, kvcv1.SessionEventKind_SESSION_EVENT_KIND_RELEASED,
		kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED, kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOADED,
		kvcv1.SessionEventKind_SESSION_EVENT_KIND_LOAD_FAILED:
		if role != kvcv1.WorkerRole_WORKER_ROLE_DECODE {
			return "role_mismatch", fmt.Errorf("%s from a %s worker", k, role)
		}
	case kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_INGESTED, kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_EVICTED:
		if role != kvcv1.WorkerRole_WORKER_ROLE_PREFILL {
			return "role_mismatch", fmt.Errorf("%s from a %s worker", k, role)
		}
	}
	return "", nil
}
