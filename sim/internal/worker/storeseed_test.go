package worker

import (
	"strings"
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestParseStoreSeed: the kv_hints of a seed through the prefill store (to_store and
// generation on P's half; snapshot_seqlen on D's SEED) and what is refused.
func TestParseStoreSeed(t *testing.T) {
	dec, pre := kvcv1.WorkerRole_WORKER_ROLE_DECODE, kvcv1.WorkerRole_WORKER_ROLE_PREFILL
	env := func(payload string) string {
		return `"kv_hints":{"protocol_version":1,"message_id":"m","actions":[{"action_id":"a","action_type":"kvc","action_version":1,"payload":` + payload + `}]}`
	}
	for _, tt := range []struct {
		name    string
		role    kvcv1.WorkerRole
		body    string
		wantErr string
		check   func(p *plan) bool
	}{
		{"P's half", pre, `{"bootstrap_room":3,` + env(`{"mode":"SEED","role":"prefill","session_id":"s","input_tokens":9,"room":3,"transfer":"SEED","to_store":true,"generation":4}`) + `}`, "",
			func(p *plan) bool { return p.toStore && p.storeGen == 4 && p.seedKey == "s" }},
		{"D's half loads from the store", dec, `{"session_params":{"id":"s"},` + env(`{"mode":"SEED","session_id":"s","input_tokens":9,"room":5,"transfer":"SEED","snapshot_seqlen":9,"keep_session":true}`) + `}`, "",
			func(p *plan) bool { return p.mode == ModeSeed && p.seqlen == 9 && p.room == 5 && !p.toStore }},
		{"no generation", pre, `{"bootstrap_room":3,` + env(`{"mode":"SEED","role":"prefill","session_id":"s","input_tokens":9,"room":3,"transfer":"SEED","to_store":true}`) + `}`, "to_store needs", nil},
		{"no session", pre, `{"bootstrap_room":3,` + env(`{"mode":"PD_FALLBACK","role":"prefill","input_tokens":9,"room":3,"transfer":"SEED","to_store":true,"generation":1}`) + `}`, "to_store needs", nil},
		{"to_store on D", dec, `{"session_params":{"id":"s"},` + env(`{"mode":"SEED","session_id":"s","input_tokens":9,"room":5,"transfer":"SEED","to_store":true,"generation":1,"keep_session":true}`) + `}`, "to_store needs", nil},
		{"seqlen past the input", dec, `{"session_params":{"id":"s"},` + env(`{"mode":"SEED","session_id":"s","input_tokens":9,"room":5,"transfer":"SEED","snapshot_seqlen":10,"keep_session":true}`) + `}`, "out of range", nil},
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
