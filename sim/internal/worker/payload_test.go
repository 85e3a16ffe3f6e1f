package worker

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/kvcentric/kvcentric/pkg/kvhints"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// envelope wraps a payload's JSON in a kv_hints envelope (action version 2) as a body field.
func envelope(payload string) string {
	return `"kv_hints":{"protocol_version":1,"message_id":"m","actions":[{"action_id":"a","action_type":"kvc","action_version":2,"payload":` + payload + `}]}`
}

// payload is the ExecutionPayload the tests' decision shorthand k stands for: the fields the
// control plane's policy and the gateway set for a decision of that mode (the worker reads the
// fields only; the mode rides along as a label). Keep unset: every mode but PD_FALLBACK keeps.
func (k kvcReq) payload() *kvcv1.ExecutionPayload {
	mode := kvcv1.RouteMode(kvcv1.RouteMode_value["ROUTE_MODE_"+strings.ToUpper(k.Mode)])
	keep := mode != kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK
	if k.Keep != nil {
		keep = *k.Keep
	}
	local := k.LocalPrefill != nil && *k.LocalPrefill
	var room int64
	if k.Room != nil {
		room = *k.Room
	}
	p := &kvcv1.ExecutionPayload{Mode: mode, SessionId: k.SessionID, InputTokens: k.InputTokens,
		CachedTokens: k.CachedTokens, LoadPrefixTokens: k.LoadPrefix}
	if k.Role == "prefill" {
		p.Role = kvcv1.WorkerRole_WORKER_ROLE_PREFILL
		p.Send = &kvcv1.ExecutionSend{Room: room, FromToken: k.ReceiveFrom}
		return p
	}
	if k.Role == "decode" {
		p.Role = kvcv1.WorkerRole_WORKER_ROLE_DECODE
	}
	p.KeepSession, p.LocalPrefill = keep, local
	switch mode {
	case kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D:
		p.OpenSession = keep && local
	case kvcv1.RouteMode_ROUTE_MODE_SEED, kvcv1.RouteMode_ROUTE_MODE_RESEED_PREFILL, kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT:
		p.OpenSession = keep
	}
	if mode == kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || local {
		return p
	}
	p.Receive = &kvcv1.ExecutionReceive{Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED, Room: room, FromToken: k.ReceiveFrom}
	if mode == kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT {
		p.Receive.Kind, p.Receive.Tokens = kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, k.Seqlen
	}
	return p
}

// genBody is a /generate body carrying payload p in kv_hints, with session_params exactly when a
// decode worker keeps the session (SGLang's contract), plus the extra fields.
func genBody(p *kvcv1.ExecutionPayload, extra map[string]any) []byte {
	env, err := kvhints.Build("m", p)
	if err != nil {
		panic(err)
	}
	b := map[string]any{"kv_hints": env}
	if p.GetKeepSession() && p.GetRole() != kvcv1.WorkerRole_WORKER_ROLE_PREFILL && p.GetSessionId() != "" {
		b["session_params"] = map[string]any{"id": p.GetSessionId()}
	}
	for k, v := range extra {
		b[k] = v
	}
	out, _ := json.Marshal(b)
	return out
}

// TestActsOnFieldsNotMode: the worker does what the payload's fields say, whatever the mode
// label: a receive into a newly opened, kept session is a seed even under the labels
// DIRECT_TO_D (which a mode switch served from the resident session: 409) and PD_FALLBACK (which
// a mode switch kept nowhere); the label only names the request in meta_info and metrics.
func TestActsOnFieldsNotMode(t *testing.T) {
	for i, mode := range []kvcv1.RouteMode{kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D, kvcv1.RouteMode_ROUTE_MODE_PD_FALLBACK, kvcv1.RouteMode_ROUTE_MODE_UNSPECIFIED} {
		t.Run(mode.String(), func(t *testing.T) {
			h := newHub()
			p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
			d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, zeroTiming())
			room := int64(10 + i)
			pp := &kvcv1.ExecutionPayload{Mode: mode, Role: kvcv1.WorkerRole_WORKER_ROLE_PREFILL, SessionId: "s", InputTokens: 61,
				Send: &kvcv1.ExecutionSend{Room: room}}
			dp := &kvcv1.ExecutionPayload{Mode: mode, Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, SessionId: "s", InputTokens: 61,
				KeepSession: true, OpenSession: true, Receive: &kvcv1.ExecutionReceive{Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED, Room: room}}
			extra := map[string]any{"rid": "r", "text": "hello", "sampling_params": map[string]any{"max_new_tokens": 3}}
			var pr result
			done := make(chan struct{})
			go func() {
				defer close(done)
				pr = post(t, context.Background(), p.url, genBody(pp, extra))
			}()
			dr := post(t, context.Background(), d.url, genBody(dp, extra))
			<-done
			if pr.status != 200 || dr.status != 200 {
				t.Fatalf("P %d %s, D %d %s", pr.status, pr.code, dr.status, dr.code)
			}
			if k := dr.ans.MetaInfo.KVC; k.VerifiedBytes != 61*48 || k.KVLenAfter != 64 || k.Mode != modeLabel(mode) {
				t.Fatalf("decode meta %+v: want 61 tokens received and verified, 64 kept, mode label %s", k, modeLabel(mode))
			}
			if s, ok := sessionsOf(t, d)["s"]; !ok || s.KVLen != 64 {
				t.Fatalf("session after the seed: %+v (resident %v)", s, ok)
			}
		})
	}
}
