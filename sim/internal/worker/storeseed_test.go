package worker

import (
	"strings"
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestParseStoreSeed: the kv_hints of a seed through the prefill store (send.store_generation
// on P's half; a SNAPSHOT receive of the whole prompt on D's) and what is refused.
func TestParseStoreSeed(t *testing.T) {
	dec, pre := kvcv1.WorkerRole_WORKER_ROLE_DECODE, kvcv1.WorkerRole_WORKER_ROLE_PREFILL
	env := envelope
	for _, tt := range []struct {
		name    string
		role    kvcv1.WorkerRole
		body    string
		wantErr string
		check   func(p *plan) bool
	}{
		{"P's half", pre, `{"bootstrap_room":3,` + env(`{"role":"WORKER_ROLE_PREFILL","session_id":"s","input_tokens":9,"send":{"room":"3","store_generation":"4"}}`) + `}`, "",
			func(p *plan) bool { return p.toStore && p.storeGen == 4 && p.seedKey == "s" }},
		{"D's half loads from the store", dec, `{"session_params":{"id":"s"},` + env(`{"session_id":"s","input_tokens":9,"keep_session":true,"open_session":true,"receive":{"kind":"TRANSFER_KIND_SNAPSHOT","room":"5","tokens":"9"}}`) + `}`, "",
			func(p *plan) bool {
				return p.recvKind == kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT && p.recvTokens == 9 && p.room == 5 && !p.toStore
			}},
		{"no session", pre, `{"bootstrap_room":3,` + env(`{"role":"WORKER_ROLE_PREFILL","input_tokens":9,"send":{"room":"3","store_generation":"1"}}`) + `}`, "missing session id", nil},
		{"store_generation on D", dec, `{"session_params":{"id":"s"},` + env(`{"session_id":"s","input_tokens":9,"keep_session":true,"send":{"room":"5","store_generation":"1"}}`) + `}`, "for a prefill worker", nil},
		{"snapshot past the input", dec, `{"session_params":{"id":"s"},` + env(`{"session_id":"s","input_tokens":9,"keep_session":true,"open_session":true,"receive":{"kind":"TRANSFER_KIND_SNAPSHOT","room":"5","tokens":"10"}}`) + `}`, "out of range", nil},
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
