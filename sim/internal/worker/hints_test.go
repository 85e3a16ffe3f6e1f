package worker

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/kvcentric/kvcentric/pkg/kvhints"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// hintsBody is a /generate body the way kvc-gateway sends it to real SGLang: the decision in
// the kv_hints envelope beside another orchestrator's action, session_params when asked.
func hintsBody(rid string, maxNew int64, stream bool, k kvcReq, sessionParams bool) []byte {
	env, _ := kvhints.Build(rid, k.payload())
	env.Actions = append([]kvhints.Action{{ActionID: "other", ActionType: "hicache", ActionVersion: 7, Payload: json.RawMessage(`{"x":1}`)}}, env.Actions...)
	b := map[string]any{
		"rid": rid, "text": "hello", "stream": stream, "sampling_params": map[string]any{"max_new_tokens": maxNew},
		"kv_hints": env,
	}
	if sessionParams {
		b["session_params"] = map[string]any{"id": k.SessionID}
	}
	out, _ := json.Marshal(b)
	return out
}

func sessionPost(t *testing.T, url, path, body string) (int, string) {
	t.Helper()
	resp, err := http.Post(url+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var buf bytes.Buffer
	_, _ = buf.ReadFrom(resp.Body)
	return resp.StatusCode, strings.TrimSpace(buf.String())
}

// TestSGLangHTTPContract drives kvc-sim the way the gateway drives a real SGLang decode worker:
// open_session, SEED with kv_hints (P without session_params), a direct turn on the session,
// a refused second open while the session is held, close_session releasing it to the sidecar.
func TestSGLangHTTPContract(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, zeroTiming())

	if st, b := sessionPost(t, d.url, "/open_session", `{"session_id":"s1","streaming":true,"timeout":86400,"capacity_of_str_len":44000000}`); st != 200 || b != `"s1"` {
		t.Fatalf("open: %d %s", st, b)
	}
	k := kvcReq{Mode: "SEED", SessionID: "s1", InputTokens: 101, Room: i64(9), Keep: bptr(true)}
	kp, kd := k, k
	kp.Role, kd.Role = "prefill", "decode"
	var wg sync.WaitGroup
	var pr result
	wg.Add(1)
	go func() {
		defer wg.Done()
		pr = post(t, context.Background(), p.url, hintsBody("r1", 5, false, kp, false))
	}()
	dr := post(t, context.Background(), d.url, hintsBody("r1", 5, true, kd, true))
	wg.Wait()
	if pr.status != 200 || dr.status != 200 || dr.ans.MetaInfo.KVC.VerifiedBytes != 101*48 || dr.ans.MetaInfo.KVC.KVLenAfter != 106 {
		t.Fatalf("seed: P %d %s, D %d %s %+v", pr.status, pr.code, dr.status, dr.code, dr.ans.MetaInfo.KVC)
	}
	if s := sessionsOf(t, d)["s1"]; s.KVLen != 106 {
		t.Fatalf("after seed: %+v", s)
	}
	// A second open of a held session is refused (SGLang: the id is taken).
	if st, _ := sessionPost(t, d.url, "/open_session", `{"session_id":"s1","streaming":true}`); st != 400 {
		t.Fatalf("second open: %d", st)
	}
	// Direct turn on the streaming session.
	res := post(t, context.Background(), d.url, hintsBody("r2", 2, false,
		kvcReq{Mode: "DIRECT_TO_D", Role: "decode", SessionID: "s1", InputTokens: 120, CachedTokens: 106, Keep: bptr(true)}, true))
	if res.status != 200 || res.ans.MetaInfo.KVC.PrefillTokens != 14 || res.ans.MetaInfo.KVC.KVLenAfter != 122 {
		t.Fatalf("direct: %d %s %+v", res.status, res.code, res.ans.MetaInfo.KVC)
	}
	// close_session releases it (the sidecar hears ReleaseSession) and frees the pages.
	if st, b := sessionPost(t, d.url, "/close_session", `{"session_id":"s1"}`); st != 200 || !strings.Contains(b, `"closed":true`) {
		t.Fatalf("close: %d %s", st, b)
	}
	if _, ok := sessionsOf(t, d)["s1"]; ok {
		t.Fatal("closed session still resident")
	}
	if st := d.w.stats(); st.FreePages != st.PageCount {
		t.Fatalf("pages not freed after close: %+v", st)
	}
	if _, rel := d.sc.snapshotOf(); len(rel) == 0 || rel[len(rel)-1].GetSessionId() != "s1" {
		t.Fatalf("sidecar did not hear the release: %v", rel)
	}
	// Closing again, or a session never held, is fine; now it opens again.
	if st, b := sessionPost(t, d.url, "/close_session", `{"session_id":"s1"}`); st != 200 || !strings.Contains(b, `"closed":false`) {
		t.Fatalf("second close: %d %s", st, b)
	}
	if st, _ := sessionPost(t, d.url, "/open_session", `{"session_id":"s1","streaming":true}`); st != 200 {
		t.Fatalf("reopen: %d", st)
	}
}

func TestSessionCallsBadInput(t *testing.T) {
	h := newHub()
	p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
	d := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, zeroTiming())
	for _, tt := range []struct {
		name, url, path, body string
	}{
		{"prefill worker", p.url, "/open_session", `{"session_id":"s","streaming":true}`},
		{"not streaming", d.url, "/open_session", `{"session_id":"s"}`},
		{"bad id", d.url, "/open_session", `{"session_id":"a/b","streaming":true}`},
		{"empty id", d.url, "/close_session", `{}`},
		{"malformed", d.url, "/close_session", `{`},
		{"negative timeout", d.url, "/open_session", `{"session_id":"s","streaming":true,"timeout":-1}`},
	} {
		if st, b := sessionPost(t, tt.url, tt.path, tt.body); st != 400 || !strings.Contains(b, "bad_request") {
			t.Errorf("%s: %d %s", tt.name, st, b)
		}
	}
}

// TestParseKVHints: the payload's fields become the plan; SGLang's session contract and the
// envelope's versions are checked.
func TestParseKVHints(t *testing.T) {
	dec, pre := kvcv1.WorkerRole_WORKER_ROLE_DECODE, kvcv1.WorkerRole_WORKER_ROLE_PREFILL
	seed := `"receive":{"kind":"TRANSFER_KIND_SEED","room":"3"}`
	for _, tt := range []struct {
		name    string
		role    kvcv1.WorkerRole
		body    string
		wantErr string
		check   func(p *plan) bool
	}{
		{"seed on D with session_params", dec, `{"session_params":{"id":"s"},` + envelope(`{"mode":"ROUTE_MODE_SEED","session_id":"s","input_tokens":9,"keep_session":true,"open_session":true,`+seed+`}`) + `}`, "",
			func(p *plan) bool {
				return p.mode == "SEED" && p.keep && p.open && p.sessionID == "s" && p.room == 3 && p.recvTokens == 9 &&
					p.recvKind == kvcv1.TransferKind_TRANSFER_KIND_SEED
			}},
		{"camelCase names (protojson's JSON names)", dec, `{"session_params":{"id":"s"},` + envelope(`{"sessionId":"s","inputTokens":9,"keepSession":true,"openSession":true,"receive":{"kind":2,"room":3,"tokens":4}}`) + `}`, "",
			func(p *plan) bool {
				return p.keep && p.open && p.recvKind == kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT && p.recvTokens == 4 && p.mode == "NONE"
			}},
		{"receive without keep_session keeps nothing", dec, `{` + envelope(`{"mode":"ROUTE_MODE_PD_FALLBACK","session_id":"s","input_tokens":9,`+seed+`}`) + `}`, "",
			func(p *plan) bool { return !p.keep && p.seedKey == "s" && p.receives() }},
		{"prefill half by session id in the payload", pre, `{"bootstrap_room":3,` + envelope(`{"role":"WORKER_ROLE_PREFILL","session_id":"s","input_tokens":9,"send":{"room":"3","from_token":"4"}}`) + `}`, "",
			func(p *plan) bool {
				return p.seedKey == "s" && p.room == 3 && p.sends && p.receiveFrom == 4 && !p.toStore
			}},
		{"snapshot", dec, `{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":9,"keep_session":true,"open_session":true,"receive":{"kind":"TRANSFER_KIND_SNAPSHOT","room":"3","tokens":"8"}}`) + `}`, "",
			func(p *plan) bool {
				return p.recvKind == kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT && p.recvTokens == 8
			}},
		{"keep without session_params", dec, `{` + envelope(`{"session_id":"s","input_tokens":9,"keep_session":true,`+seed+`}`) + `}`, "session_params missing", nil},
		{"session_params without keep", dec, `{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":9,`+seed+`}`) + `}`, "session_params given", nil},
		{"prefill with session_params", pre, `{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":9,"send":{"room":"3"}}`) + `}`, "without session_params", nil},
		{"the old top-level kvc block is not read", dec, `{"kvc":{"mode":"SEED","session_id":"s","input_tokens":9,"room":3}}`, "no kvcentric decision", nil},
		{"two kvc actions", dec, `{"kv_hints":{"protocol_version":1,"actions":[{"action_type":"kvc","action_version":2,"payload":{}},{"action_type":"kvc","action_version":2,"payload":{}}]}}`, "more than one", nil},
		{"protocol version", dec, `{"kv_hints":{"protocol_version":2,"actions":[]}}`, "protocol_version", nil},
		{"action version", dec, `{"kv_hints":{"protocol_version":1,"actions":[{"action_type":"kvc","action_version":1,"payload":{}}]}}`, "action_version", nil},
		{"bad payload", dec, `{"kv_hints":{"protocol_version":1,"actions":[{"action_type":"kvc","action_version":2,"payload":[1]}]}}`, "payload", nil},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p, err := parseGenerate([]byte(tt.body), tt.role, 1000)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || !tt.check(p) {
				t.Fatalf("plan %+v err %v", p, err)
			}
		})
	}
}
