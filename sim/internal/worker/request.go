package worker

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Mode is the execution mode of one request on this worker (kvc.mode).
type Mode int

// Modes, named as in docs/interfaces.md (and RouteMode without its prefix).
const (
	ModeDirectToD Mode = iota + 1
	ModeSeed
	ModeReseedSnapshot
	ModeReseedPrefill
	ModePDFallback
)

var modeNames = map[Mode]string{
	ModeDirectToD: "DIRECT_TO_D", ModeSeed: "SEED", ModeReseedSnapshot: "RESEED_SNAPSHOT",
	ModeReseedPrefill: "RESEED_PREFILL", ModePDFallback: "PD_FALLBACK",
}

func (m Mode) String() string {
	if s, ok := modeNames[m]; ok {
		return s
	}
	return "UNKNOWN"
}

// ParseMode accepts "SEED" or "ROUTE_MODE_SEED" (any case).
func ParseMode(s string) (Mode, error) {
	u := strings.TrimPrefix(strings.ToUpper(strings.TrimSpace(s)), "ROUTE_MODE_")
	for m, n := range modeNames {
		if n == u {
			return m, nil
		}
	}
	return 0, fmt.Errorf("unknown kvc.mode %q (want DIRECT_TO_D, SEED, RESEED_SNAPSHOT, RESEED_PREFILL or PD_FALLBACK)", s)
}

// Limits on what a request may ask for.
const (
	maxBodyBytes     = 8 << 20
	maxNewTokenLimit = 1 << 20
	defaultMaxNew    = 128
)

// kvcHints is kvcentric's decision for one half of a request: the payload of the "kvc" action
// in SGLang's kv_hints envelope (or, for one more release, the top-level "kvc" block).
type kvcHints struct {
	DecisionID      string       `json:"decision_id"`
	Mode            string       `json:"mode"`
	Role            string       `json:"role"`
	SessionID       string       `json:"session_id"`
	InputTokens     *int64       `json:"input_tokens"`
	CachedTokens    *int64       `json:"cached_tokens"`
	Room            *json.Number `json:"room"`
	Transfer        *string      `json:"transfer"` // SEED, SNAPSHOT, or "" for none
	PrefillPeerAddr string       `json:"prefill_peer_addr"`
	// PrefillPeerAddrs: a tensor-parallel prefill worker's rank peers, in rank order (rank r
	// receives from entry r).
	PrefillPeerAddrs []string `json:"prefill_peer_addrs"`
	SnapshotSeqlen   int64    `json:"snapshot_seqlen"`
	KeepSession      *bool    `json:"keep_session"`
	// TruncateTo: keep only the first truncate_to tokens of the held session before the
	// append-prefill (RouteExecution.truncate_to); 0 or absent = no truncation.
	TruncateTo *int64 `json:"truncate_to"`
	// LocalPrefill: a new session's first turn prefilled here (RouteExecution.local_prefill),
	// reusing cached_tokens of KV this worker holds for other sessions.
	LocalPrefill *bool `json:"local_prefill"`
	// ToStore and Generation: a seed through the prefill store (RouteExecution.store_generation):
	// P's SendKV goes into its sidecar's own store as the session's snapshot of this generation.
	ToStore    bool   `json:"to_store"`
	Generation uint64 `json:"generation"`
	// LoadPrefixTokens and LoadGeneration: prefill from the snapshot
	// (RouteExecution.load_prefix_tokens): P loads [0, n) of the session's snapshot of that
	// generation from its sidecar's store first and prefills only the rest.
	LoadPrefixTokens int64  `json:"load_prefix_tokens"`
	LoadGeneration   uint64 `json:"load_generation"`
	// ReceiveFrom: suffix-only receive (RouteExecution.receive_from): D keeps [0, n) of the
	// session it holds and P sends only the pages past it.
	ReceiveFrom int64 `json:"receive_from"`
	// Load: a decode sidecar's LoadSessionCommand (re-homing): a zero-output RESEED_SNAPSHOT of
	// the whole snapshot that only creates the session here. Without input_ids its content is
	// not known: received bytes that do not match the made-up ids are kept unverified, and the
	// session's next turn checks them against its prompt before reusing them (reusable).
	Load bool `json:"load"`
}

// kvHintsEnvelope is SGLang's KvHintsEnvelope (sglang.srt.managers.kv_hints).
type kvHintsEnvelope struct {
	ProtocolVersion int    `json:"protocol_version"`
	MessageID       string `json:"message_id"`
	Actions         []struct {
		ActionID      string          `json:"action_id"`
		ActionType    string          `json:"action_type"`
		ActionVersion int             `json:"action_version"`
		Payload       json.RawMessage `json:"payload"`
	} `json:"actions"`
}

// kvHintsAction is the action type of kvcentric's decision in the envelope.
const kvHintsAction = "kvc"

// kvcFromHints returns the "kvc" action's payload of env (nil when there is none). More than one
// kvc action, an unknown protocol or action version, or a malformed payload is an error.
func kvcFromHints(env *kvHintsEnvelope) (*kvcHints, error) {
	if env.ProtocolVersion != 1 {
		return nil, fmt.Errorf("kv_hints.protocol_version %d is not supported (want 1)", env.ProtocolVersion)
	}
	var out *kvcHints
	for i, a := range env.Actions {
		if a.ActionType != kvHintsAction {
			continue // another orchestrator's action: not ours
		}
		if a.ActionVersion != 1 {
			return nil, fmt.Errorf("kv_hints.actions[%d]: kvc action_version %d is not supported (want 1)", i, a.ActionVersion)
		}
		if out != nil {
			return nil, errors.New("kv_hints carries more than one kvc action")
		}
		out = &kvcHints{}
		dec := json.NewDecoder(bytes.NewReader(a.Payload))
		dec.UseNumber()
		if err := dec.Decode(out); err != nil {
			return nil, fmt.Errorf("kv_hints.actions[%d].payload: %v", i, err)
		}
	}
	return out, nil
}

// generateRequest is the subset of SGLang's GenerateReqInput kvc-sim reads: kvcentric's decision
// comes in kv_hints (or the older top-level kvc block).
type generateRequest struct {
	RID            json.RawMessage `json:"rid"`
	Text           json.RawMessage `json:"text"`
	InputIDs       json.RawMessage `json:"input_ids"`
	SamplingParams *struct {
		MaxNewTokens *int64 `json:"max_new_tokens"`
	} `json:"sampling_params"`
	Stream        bool `json:"stream"`
	SessionParams *struct {
		ID string `json:"id"`
	} `json:"session_params"`
	BootstrapRoom *json.Number `json:"bootstrap_room"`
	// Priority is SGLang's request priority (GenerateReqInput.priority; higher is more
	// important): under --radix-eviction-policy priority a prefill worker's prefix cache evicts
	// the pages of lower priorities first.
	Priority *json.Number     `json:"priority"`
	KVHints  *kvHintsEnvelope `json:"kv_hints"`
	KVC      *kvcHints        `json:"kvc"` // before kv_hints; accepted for one release
}

// plan is a validated request.
type plan struct {
	rid        string
	decisionID string
	mode       Mode
	role       kvcv1.WorkerRole
	sessionID  string // "" for a single-shot request
	seedKey    string // key of the known-bytes pattern: session id, else rid, else room
	input      int64
	cached     int64
	maxNew     int64
	room       int64
	hasRoom    bool
	peer       string
	peers      []string // a tensor-parallel prefill worker's rank peers (kv_hints prefill_peer_addrs)
	seqlen     int64
	keep       bool
	stream     bool
	hinted     bool // the decision came in kv_hints
	// ids are the request's input_ids (the content its KV is computed from; positions without
	// one get made-up ids, see tokenIDs).
	ids []uint32
	// truncateTo: the decision's truncate_to (0 = none).
	truncateTo int64
	// localPrefill: the decision's local_prefill (content.go).
	localPrefill bool
	// toStore, storeGen: P's seed goes into its sidecar's store (kv_hints to_store, generation);
	// on D, a SEED with snapshot_seqlen loads [0, seqlen) from that store instead.
	toStore  bool
	storeGen uint64
	// priority: the request's SGLang priority (0 when absent, as SGLang's req.priority or 0).
	priority int64
	// loadPrefix, loadGen: P loads [0, loadPrefix) of the session's snapshot from its store
	// before it prefills (kv_hints load_prefix_tokens, load_generation).
	loadPrefix int64
	loadGen    uint64
	// receiveFrom: the transfer covers only [receiveFrom, input) (kv_hints receive_from).
	receiveFrom int64
	// load: kv_hints load (a LoadSessionCommand's request).
	load bool
}

// checkTransfer: the payload's transfer kind must be the one the mode implies.
func checkTransfer(t string, m Mode, local bool) error {
	want := "SEED"
	switch {
	case m == ModeDirectToD || local:
		want = ""
	case m == ModeReseedSnapshot:
		want = "SNAPSHOT"
	}
	if !strings.EqualFold(t, want) {
		return fmt.Errorf("transfer %q does not match mode %s (want %q)", t, m, want)
	}
	return nil
}

// transfers reports whether the mode moves KV into (decode) or out of (prefill) this worker.
func (p *plan) transfers() bool { return p.mode != ModeDirectToD && !p.localPrefill }

func parseRoom(n *json.Number) (int64, bool, error) {
	if n == nil {
		return 0, false, nil
	}
	v, err := strconv.ParseInt(n.String(), 10, 64)
	if err != nil || v < 0 {
		return 0, false, fmt.Errorf("room %q is not an integer in [0, 2^63)", n.String())
	}
	return v, true, nil
}

// parseGenerate validates a /generate body for a worker of role with capacity tokens of KV.
// Every error is a bad_request.
func parseGenerate(body []byte, role kvcv1.WorkerRole, capacity int64) (*plan, error) {
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	var r generateRequest
	if err := dec.Decode(&r); err != nil {
		return nil, fmt.Errorf("malformed JSON body: %v", err)
	}
	if dec.More() {
		return nil, errors.New("malformed JSON body: trailing data after the object")
	}
	p := &plan{role: role, stream: r.Stream, maxNew: defaultMaxNew}
	if len(r.RID) > 0 && string(r.RID) != "null" {
		if err := json.Unmarshal(r.RID, &p.rid); err != nil {
			return nil, errors.New("rid must be a string (batch requests are not supported)")
		}
		if err := kvcv1.ValidateOptionalID("rid", p.rid); err != nil {
			return nil, err
		}
	}
	var text string
	if len(r.Text) > 0 && string(r.Text) != "null" {
		if err := json.Unmarshal(r.Text, &text); err != nil {
			return nil, errors.New("text must be a string (batch requests are not supported)")
		}
	}
	var ids []int64
	if len(r.InputIDs) > 0 && string(r.InputIDs) != "null" {
		if err := json.Unmarshal(r.InputIDs, &ids); err != nil {
			return nil, errors.New("input_ids must be a list of integers (batch requests are not supported)")
		}
	}
	if r.SamplingParams != nil && r.SamplingParams.MaxNewTokens != nil {
		p.maxNew = *r.SamplingParams.MaxNewTokens
	}
	room, hasRoom, err := parseRoom(r.BootstrapRoom)
	if err != nil {
		return nil, fmt.Errorf("bootstrap_room: %v", err)
	}
	p.room, p.hasRoom = room, hasRoom
	if r.Priority != nil {
		v, err := strconv.ParseInt(r.Priority.String(), 10, 64)
		if err != nil {
			return nil, fmt.Errorf("priority %q is not a signed 64-bit integer", r.Priority.String())
		}
		p.priority = v
	}
	if r.SessionParams != nil {
		p.sessionID = r.SessionParams.ID
	}
	p.mode = ModePDFallback
	keepSet := false
	k := r.KVC
	if r.KVHints != nil {
		hk, err := kvcFromHints(r.KVHints)
		if err != nil {
			return nil, err
		}
		if hk != nil && k != nil {
			return nil, errors.New("the decision is given twice (kv_hints and the kvc block): send one")
		}
		if hk != nil {
			k = hk
			p.hinted = true
		}
	}
	if k != nil {
		p.decisionID = k.DecisionID
		if k.Mode != "" {
			if p.mode, err = ParseMode(k.Mode); err != nil {
				return nil, err
			}
		}
		switch strings.ToLower(k.Role) {
		case "":
		case "prefill":
			if role != kvcv1.WorkerRole_WORKER_ROLE_PREFILL {
				return nil, errors.New("kvc.role is prefill but this is a decode worker")
			}
		case "decode":
			if role != kvcv1.WorkerRole_WORKER_ROLE_DECODE {
				return nil, errors.New("kvc.role is decode but this is a prefill worker")
			}
		default:
			return nil, fmt.Errorf("unknown kvc.role %q (want prefill or decode)", k.Role)
		}
		if k.SessionID != "" {
			if p.sessionID != "" && p.sessionID != k.SessionID {
				return nil, fmt.Errorf("kvc.session_id %q differs from session_params.id %q", k.SessionID, p.sessionID)
			}
			p.sessionID = k.SessionID
		}
		if k.InputTokens != nil {
			p.input = *k.InputTokens
			if p.input <= 0 {
				return nil, fmt.Errorf("kvc.input_tokens %d must be > 0", p.input)
			}
		}
		if k.CachedTokens != nil {
			p.cached = *k.CachedTokens
		}
		kr, kHas, err := parseRoom(k.Room)
		if err != nil {
			return nil, fmt.Errorf("kvc.room: %v", err)
		}
		if kHas {
			if p.hasRoom && p.room != kr {
				return nil, fmt.Errorf("kvc.room %d differs from bootstrap_room %d", kr, p.room)
			}
			p.room, p.hasRoom = kr, true
		}
		p.peer, p.peers = k.PrefillPeerAddr, k.PrefillPeerAddrs
		p.seqlen = k.SnapshotSeqlen
		p.toStore, p.storeGen = k.ToStore, k.Generation
		p.loadPrefix, p.loadGen, p.receiveFrom = k.LoadPrefixTokens, k.LoadGeneration, k.ReceiveFrom
		p.load = k.Load
		if k.KeepSession != nil {
			p.keep, keepSet = *k.KeepSession, true
		}
		if k.TruncateTo != nil {
			p.truncateTo = *k.TruncateTo
		}
		if k.LocalPrefill != nil {
			p.localPrefill = *k.LocalPrefill
		}
		if k.Transfer != nil {
			if err := checkTransfer(*k.Transfer, p.mode, p.localPrefill); err != nil {
				return nil, err
			}
		}
	}
	if p.hinted {
		// SGLang's contract: D keeps a session exactly when the request carries session_params
		// (its streaming session); P never gets session_params (it prefills the full context).
		hasParams := r.SessionParams != nil && r.SessionParams.ID != ""
		switch {
		case role == kvcv1.WorkerRole_WORKER_ROLE_PREFILL && hasParams:
			return nil, errors.New("a prefill worker takes the full context without session_params")
		case role == kvcv1.WorkerRole_WORKER_ROLE_DECODE && keepSet && p.keep != hasParams:
			return nil, fmt.Errorf("kv_hints keep_session %v but session_params %s: a decode worker keeps the session exactly when the request names it", p.keep, map[bool]string{true: "given", false: "missing"}[hasParams])
		}
	}
	if !keepSet {
		p.keep = p.mode != ModePDFallback
	}
	if p.input == 0 {
		switch {
		case len(ids) > 0:
			p.input = int64(len(ids))
		case text != "":
			p.input = max(1, int64(len(text))/4) // ~4 characters per token
		default:
			return nil, errors.New("no input: give kvc.input_tokens, input_ids or text")
		}
	}
	if p.sessionID != "" {
		if err := kvcv1.ValidateID("session id", p.sessionID); err != nil {
			return nil, err
		}
	}
	if p.sessionID == "" && (p.mode != ModePDFallback || p.keep) {
		return nil, fmt.Errorf("missing session id: a request without one is single-shot and may only run as PD_FALLBACK without keep_session (mode %s)", p.mode)
	}
	if p.input > capacity {
		return nil, fmt.Errorf("input_tokens %d exceeds this worker's KV capacity of %d tokens", p.input, capacity)
	}
	if p.cached < 0 || p.cached > p.input {
		return nil, fmt.Errorf("cached_tokens %d out of range [0, input_tokens %d]", p.cached, p.input)
	}
	if p.truncateTo != 0 && (p.mode != ModeDirectToD || p.truncateTo < 0 || p.truncateTo != p.cached) {
		return nil, fmt.Errorf("kvc.truncate_to %d: only a DIRECT_TO_D turn truncates, to its cached_tokens (%d)", p.truncateTo, p.cached)
	}
	if p.localPrefill && (role != kvcv1.WorkerRole_WORKER_ROLE_DECODE || p.truncateTo != 0 ||
		(p.mode != ModeDirectToD && (p.mode != ModePDFallback || p.keep))) {
		return nil, fmt.Errorf("kvc.local_prefill: only a decode worker prefills locally, for a DIRECT_TO_D turn (a new session) or a PD_FALLBACK that keeps nothing (mode %s, keep_session %v)", p.mode, p.keep)
	}
	if len(ids) > 0 {
		p.ids = make([]uint32, min(int64(len(ids)), p.input))
		for i := range p.ids {
			if ids[i] < 0 || ids[i] > math.MaxUint32 {
				return nil, fmt.Errorf("input_ids[%d] = %d is not a token id in [0, 2^32)", i, ids[i])
			}
			p.ids[i] = uint32(ids[i])
		}
	}
	if p.maxNew < 0 || p.maxNew > maxNewTokenLimit {
		return nil, fmt.Errorf("max_new_tokens %d out of range [0, %d]", p.maxNew, maxNewTokenLimit)
	}
	if role == kvcv1.WorkerRole_WORKER_ROLE_DECODE && p.input+p.maxNew > capacity {
		return nil, fmt.Errorf("input_tokens %d + max_new_tokens %d exceed this worker's KV capacity of %d tokens", p.input, p.maxNew, capacity)
	}
	if role == kvcv1.WorkerRole_WORKER_ROLE_PREFILL && (p.mode == ModeDirectToD || p.mode == ModeReseedSnapshot) {
		return nil, fmt.Errorf("mode %s has no prefill half", p.mode)
	}
	if p.transfers() && !p.hasRoom {
		return nil, fmt.Errorf("mode %s moves KV and needs a room (kvc.room or bootstrap_room)", p.mode)
	}
	if p.mode == ModeReseedSnapshot && (p.seqlen <= 0 || p.seqlen > p.input) {
		return nil, fmt.Errorf("kvc.snapshot_seqlen %d out of range [1, input_tokens %d]", p.seqlen, p.input)
	}
	if p.seqlen < 0 || p.seqlen > p.input {
		return nil, fmt.Errorf("kvc.snapshot_seqlen %d out of range [0, input_tokens %d]", p.seqlen, p.input)
	}
	if p.load && (role != kvcv1.WorkerRole_WORKER_ROLE_DECODE || p.mode != ModeReseedSnapshot || p.maxNew != 0 || p.seqlen != p.input || !p.keep) {
		return nil, errors.New("kvc.load: only a decode worker loads, as a RESEED_SNAPSHOT of the whole input (snapshot_seqlen = input_tokens) that keeps the session and generates nothing (max_new_tokens 0)")
	}
	if p.toStore && (role != kvcv1.WorkerRole_WORKER_ROLE_PREFILL || p.storeGen == 0 || p.sessionID == "") {
		return nil, fmt.Errorf("kvc.to_store needs the prefill half, a session and a generation > 0")
	}
	if p.loadPrefix != 0 && (p.sessionID == "" || p.toStore || p.loadPrefix < 0 || p.loadPrefix >= p.input) {
		// (the decode half gets it too, and only learns that P computed on loaded KV)
		return nil, fmt.Errorf("kvc.load_prefix_tokens %d: only a session's prefill loads from its store, fewer tokens than input_tokens %d and not in a seed through the store", p.loadPrefix, p.input)
	}
	if p.receiveFrom != 0 && (p.mode != ModePDFallback || !p.keep && role == kvcv1.WorkerRole_WORKER_ROLE_DECODE ||
		p.sessionID == "" || p.receiveFrom < 0 || p.receiveFrom >= p.input) {
		return nil, fmt.Errorf("kvc.receive_from %d: only a large append (PD_FALLBACK keeping the session) receives a suffix, from below input_tokens %d", p.receiveFrom, p.input)
	}
	switch {
	case p.sessionID != "":
		p.seedKey = p.sessionID
	case p.rid != "":
		p.seedKey = p.rid
	default:
		p.seedKey = "room-" + strconv.FormatInt(p.room, 10)
	}
	return p, nil
}
