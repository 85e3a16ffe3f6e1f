package worker

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/kvcentric/kvcentric/pkg/kvhints"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Limits on what a request may ask for.
const (
	maxBodyBytes     = 8 << 20
	maxNewTokenLimit = 1 << 20
	defaultMaxNew    = 128
)

// generateRequest is the subset of SGLang's GenerateReqInput kvc-sim reads: kvcentric's decision
// comes as the "kvc" action of kv_hints, an ExecutionPayload (pkg/kvhints).
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
	Priority *json.Number    `json:"priority"`
	KVHints  json.RawMessage `json:"kv_hints"`
}

// plan is a validated request: what the payload's fields tell this worker to do.
type plan struct {
	rid        string
	decisionID string
	// mode is the decision's mode: a label for metrics and meta_info.kvc.mode only.
	mode      string
	role      kvcv1.WorkerRole
	sessionID string // "" for a single-shot request
	seedKey   string // key of the known-bytes pattern: session id, else rid, else room
	input     int64
	cached    int64
	maxNew    int64
	room      int64 // the receive's (D) or the send's (P) room
	hasRoom   bool
	peer      string
	peers     []string // a tensor-parallel prefill worker's rank peers (receive.peer_addrs)
	keep      bool     // keep_session
	open      bool     // open_session: a copy held here is stale
	// recvKind is how KV arrives on D (UNSPECIFIED: nothing is received); the transfer covers
	// [receiveFrom, recvTokens).
	recvKind   kvcv1.TransferKind
	recvTokens int64
	// sends: P sends what it computes (the payload's send).
	sends  bool
	stream bool
	// ids are the request's input_ids (the content its KV is computed from; positions without
	// one get made-up ids, see tokenIDs).
	ids []uint32
	// truncateTo: the decision's truncate_to (0 = none).
	truncateTo int64
	// localPrefill: the decision's local_prefill (content.go).
	localPrefill bool
	// toStore, storeGen: P's seed goes into its sidecar's store (send.store_generation).
	toStore  bool
	storeGen uint64
	// priority: the request's SGLang priority (0 when absent, as SGLang's req.priority or 0).
	priority int64
	// loadPrefix, loadGen: P loads [0, loadPrefix) of the session's snapshot from its store
	// before it prefills (load_prefix_tokens, load_generation).
	loadPrefix int64
	loadGen    uint64
	// receiveFrom: the transfer covers only [receiveFrom, input) (from_token of the receive on
	// D, of the send on P).
	receiveFrom int64
	// load: the payload's load (a LoadSessionCommand's request).
	load bool
}

// receives reports whether KV arrives into this (decode) worker by transfer.
func (p *plan) receives() bool { return p.recvKind != kvcv1.TransferKind_TRANSFER_KIND_UNSPECIFIED }

// modeLabel is a payload's mode as a metric label ("DIRECT_TO_D", ...; "NONE" when absent).
func modeLabel(m kvcv1.RouteMode) string {
	if m == kvcv1.RouteMode_ROUTE_MODE_UNSPECIFIED {
		return "NONE"
	}
	return strings.TrimPrefix(m.String(), "ROUTE_MODE_")
}

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
// Every error is a bad_request. The worker does what the payload's fields say; no rule reads
// the mode.
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
	k, err := kvhints.Parse(r.KVHints)
	if err != nil {
		return nil, err
	}
	if k == nil {
		return nil, errors.New("no kvcentric decision: kv_hints carries no kvc action (kvc-sim serves only what kvc-gateway sends)")
	}
	p.decisionID, p.mode = k.GetDecisionId(), modeLabel(k.GetMode())
	if pr := k.GetRole(); pr != kvcv1.WorkerRole_WORKER_ROLE_UNSPECIFIED && pr != role {
		return nil, fmt.Errorf("the payload's role is %s but this is a %s worker", roleName(pr), roleName(role))
	}
	if s := k.GetSessionId(); s != "" {
		if p.sessionID != "" && p.sessionID != s {
			return nil, fmt.Errorf("kvc.session_id %q differs from session_params.id %q", s, p.sessionID)
		}
		p.sessionID = s
	}
	p.input, p.cached = k.GetInputTokens(), k.GetCachedTokens()
	if p.input < 0 {
		return nil, fmt.Errorf("kvc.input_tokens %d must be > 0", p.input)
	}
	p.keep, p.open = k.GetKeepSession(), k.GetOpenSession()
	p.truncateTo, p.localPrefill = k.GetTruncateTo(), k.GetLocalPrefill()
	p.loadPrefix, p.loadGen, p.load = k.GetLoadPrefixTokens(), k.GetLoadGeneration(), k.GetLoad()
	roomOf := func(v int64) error {
		if v < 0 {
			return fmt.Errorf("kvc room %d is not in [0, 2^63)", v)
		}
		if hasRoom && room != v {
			return fmt.Errorf("kvc room %d differs from bootstrap_room %d", v, room)
		}
		p.room, p.hasRoom = v, true
		return nil
	}
	decode := role == kvcv1.WorkerRole_WORKER_ROLE_DECODE
	switch {
	case decode && k.GetSend() != nil:
		return nil, errors.New("kvc.send is for a prefill worker; this is a decode worker")
	case !decode && k.GetReceive() != nil:
		return nil, errors.New("kvc.receive is for a decode worker; this is a prefill worker")
	case !decode && k.GetSend() == nil:
		return nil, errors.New("a prefill worker needs kvc.send (where the KV it computes goes)")
	}
	if rc := k.GetReceive(); rc != nil {
		p.recvKind, p.recvTokens, p.receiveFrom = rc.GetKind(), rc.GetTokens(), rc.GetFromToken()
		p.peer, p.peers = rc.GetPeerAddr(), rc.GetPeerAddrs()
		if !p.receives() {
			return nil, errors.New("kvc.receive.kind must be TRANSFER_KIND_SEED or TRANSFER_KIND_SNAPSHOT")
		}
		if err := roomOf(rc.GetRoom()); err != nil {
			return nil, err
		}
	}
	if sd := k.GetSend(); sd != nil {
		p.sends, p.receiveFrom = true, sd.GetFromToken()
		p.storeGen = sd.GetStoreGeneration()
		p.toStore = p.storeGen != 0
		if err := roomOf(sd.GetRoom()); err != nil {
			return nil, err
		}
	}
	// SGLang's contract: D keeps a session exactly when the request carries session_params (its
	// streaming session); P never gets session_params (it prefills the full context).
	hasParams := r.SessionParams != nil && r.SessionParams.ID != ""
	switch {
	case !decode && hasParams:
		return nil, errors.New("a prefill worker takes the full context without session_params")
	case decode && p.keep != hasParams:
		return nil, fmt.Errorf("kv_hints keep_session %v but session_params %s: a decode worker keeps the session exactly when the request names it", p.keep, map[bool]string{true: "given", false: "missing"}[hasParams])
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
	if p.recvKind == kvcv1.TransferKind_TRANSFER_KIND_SEED && p.recvTokens == 0 {
		p.recvTokens = p.input // a receive of the prefill's KV covers the prompt
	}
	if p.sessionID != "" {
		if err := kvcv1.ValidateID("session id", p.sessionID); err != nil {
			return nil, err
		}
	}
	if p.sessionID == "" && (p.keep || p.toStore || p.loadPrefix != 0 || p.receiveFrom != 0) {
		return nil, errors.New("missing session id: a request without one is single-shot: it keeps nothing, and neither loads, stores nor receives a suffix")
	}
	if p.open && !p.keep {
		return nil, errors.New("kvc.open_session without keep_session: a session is opened to be kept")
	}
	if p.input > capacity {
		return nil, fmt.Errorf("input_tokens %d exceeds this worker's KV capacity of %d tokens", p.input, capacity)
	}
	if p.cached < 0 || p.cached > p.input {
		return nil, fmt.Errorf("cached_tokens %d out of range [0, input_tokens %d]", p.cached, p.input)
	}
	if decode && !p.receives() && !p.localPrefill && !p.keep {
		return nil, errors.New("nothing to serve from: a decode worker without kvc.receive and without local_prefill serves the session it holds, which needs keep_session")
	}
	if p.truncateTo != 0 && (p.receives() || p.localPrefill || p.truncateTo < 0 || p.truncateTo != p.cached) {
		return nil, fmt.Errorf("kvc.truncate_to %d: only a turn on the session held here (no receive, no local prefill) truncates, to its cached_tokens (%d)", p.truncateTo, p.cached)
	}
	if p.localPrefill && (!decode || p.receives() || p.keep && !p.open) {
		return nil, fmt.Errorf("kvc.local_prefill: only a decode worker prefills locally, receiving nothing, for a new session (open_session) or keeping nothing (keep_session %v, open_session %v)", p.keep, p.open)
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
	if decode && p.input+p.maxNew > capacity {
		return nil, fmt.Errorf("input_tokens %d + max_new_tokens %d exceed this worker's KV capacity of %d tokens", p.input, p.maxNew, capacity)
	}
	if (p.receives() || p.sends) && !p.hasRoom {
		return nil, errors.New("a transfer needs a room (kvc.receive.room, kvc.send.room or bootstrap_room)")
	}
	switch p.recvKind {
	case kvcv1.TransferKind_TRANSFER_KIND_SEED:
		if p.recvTokens != p.input {
			return nil, fmt.Errorf("kvc.receive.tokens %d: a SEED receive covers the prompt (input_tokens %d)", p.recvTokens, p.input)
		}
	case kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT:
		if p.recvTokens <= 0 || p.recvTokens > p.input {
			return nil, fmt.Errorf("kvc.receive.tokens (the snapshot's length) %d out of range [1, input_tokens %d]", p.recvTokens, p.input)
		}
	}
	if p.load && (!decode || p.recvKind != kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT || p.maxNew != 0 || p.recvTokens != p.input || !p.keep) {
		return nil, errors.New("kvc.load: only a decode worker loads, a SNAPSHOT receive of the whole input (receive.tokens = input_tokens) that keeps the session and generates nothing (max_new_tokens 0)")
	}
	if p.loadPrefix != 0 && (p.toStore || p.loadPrefix < 0 || p.loadPrefix >= p.input) {
		// (the decode half gets it too, and only learns that P computed on loaded KV)
		return nil, fmt.Errorf("kvc.load_prefix_tokens %d: only a session's prefill loads from its store, fewer tokens than input_tokens %d and not in a seed through the store", p.loadPrefix, p.input)
	}
	if p.receiveFrom != 0 && (p.receiveFrom < 0 || p.receiveFrom >= p.input ||
		decode && (p.recvKind != kvcv1.TransferKind_TRANSFER_KIND_SEED || p.open || !p.keep)) {
		return nil, fmt.Errorf("kvc from_token %d: only a large append (a SEED receive extending the session held here: keep_session without open_session) receives a suffix, from below input_tokens %d", p.receiveFrom, p.input)
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
