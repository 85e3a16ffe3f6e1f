package worker

import (
	"fmt"
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func TestParseGenerateDefaults(t *testing.T) {
	dec := kvcv1.WorkerRole_WORKER_ROLE_DECODE
	tests := []struct {
		name     string
		body     string
		mode     Mode
		input    int64
		keep     bool
		seedKey  string
		maxNew   int64
		hasRoom  bool
		roomWant int64
	}{
		{"plain sglang request", `{"rid":"r1","text":"abcdefgh","bootstrap_room":7}`, ModePDFallback, 2, false, "r1", defaultMaxNew, true, 7},
		{"input ids", `{"input_ids":[1,2,3],"bootstrap_room":1,"sampling_params":{"max_new_tokens":0}}`, ModePDFallback, 3, false, "room-1", 0, true, 1},
		{"seed keeps", `{"kvc":{"mode":"ROUTE_MODE_SEED","session_id":"s","input_tokens":9,"room":4611686018427387904}}`, ModeSeed, 9, true, "s", defaultMaxNew, true, 1 << 62},
		{"session params", `{"session_params":{"id":"s2"},"kvc":{"mode":"direct_to_d","input_tokens":9}}`, ModeDirectToD, 9, true, "s2", defaultMaxNew, false, 0},
		{"fallback with session", `{"kvc":{"mode":"PD_FALLBACK","session_id":"s","input_tokens":9,"room":2}}`, ModePDFallback, 9, false, "s", defaultMaxNew, true, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := parseGenerate([]byte(tt.body), dec, 1000)
			if err != nil {
				t.Fatal(err)
			}
			if p.mode != tt.mode || p.input != tt.input || p.keep != tt.keep || p.seedKey != tt.seedKey ||
				p.maxNew != tt.maxNew || p.hasRoom != tt.hasRoom || p.room != tt.roomWant {
				t.Fatalf("got %+v", p)
			}
		})
	}
}

func FuzzParseGenerate(f *testing.F) {
	for _, s := range []string{
		`{"rid":"r1","text":"abcdefgh","bootstrap_room":7}`,
		`{"kvc":{"mode":"SEED","session_id":"s","input_tokens":9,"room":1,"cached_tokens":3}}`,
		`{"kvc":{"mode":"RESEED_SNAPSHOT","session_id":"s","input_tokens":9,"room":1,"snapshot_seqlen":4}}`,
		`{"kvc":{"mode":"DIRECT_TO_D","session_id":"s","input_tokens":9,"cached_tokens":9}}`,
		`{"sampling_params":{"max_new_tokens":-1}}`, `{`, `null`, `[]`, `{"bootstrap_room":1e99}`,
		`{"rid":"r","input_ids":[1,2],"bootstrap_room":3,"priority":-100}`, `{"input_ids":[1],"bootstrap_room":3,"priority":1e3}`,
		`{"session_params":{"id":"s"},"kv_hints":{"protocol_version":1,"message_id":"m","actions":[{"action_id":"a","action_type":"kvc","action_version":1,"payload":{"mode":"SEED","session_id":"s","input_tokens":9,"room":1,"transfer":"SEED","keep_session":true}}]}}`,
		`{"kv_hints":{"protocol_version":1,"actions":[{"action_type":"other","action_version":3,"payload":{"x":1}},{"action_type":"kvc","action_version":1,"payload":{"mode":"PD_FALLBACK","session_id":"s","input_tokens":9,"room":2,"keep_session":false}}]}}`,
		`{"session_params":{"id":"s"},"kv_hints":{"protocol_version":1,"actions":[{"action_type":"kvc","action_version":1,"payload":{"mode":"RESEED_SNAPSHOT","session_id":"s","input_tokens":9,"room":1,"transfer":"SNAPSHOT","snapshot_seqlen":4,"keep_session":true}}]}}`,
		`{"kv_hints":{"protocol_version":1,"actions":[{"action_type":"kvc","action_version":1,"payload":null}]}}`,
		`{"kv_hints":null,"kvc":null}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, role := range []kvcv1.WorkerRole{kvcv1.WorkerRole_WORKER_ROLE_PREFILL, kvcv1.WorkerRole_WORKER_ROLE_DECODE} {
			p, err := parseGenerate(b, role, 4096)
			if err != nil {
				continue
			}
			if p.input <= 0 || p.input > 4096 || p.cached < 0 || p.cached > p.input || p.maxNew < 0 || p.seedKey == "" {
				t.Fatalf("accepted an invalid plan %+v from %q", p, b)
			}
			if role == kvcv1.WorkerRole_WORKER_ROLE_DECODE && p.input+p.maxNew > 4096 {
				t.Fatalf("accepted a plan beyond capacity %+v", p)
			}
			if p.transfers() && (!p.hasRoom || p.room < 0) {
				t.Fatalf("transfer without room %+v", p)
			}
			if p.sessionID == "" && (p.mode != ModePDFallback || p.keep) {
				t.Fatalf("stateful request without session %+v", p)
			}
			if p.mode == ModeReseedSnapshot && (p.seqlen <= 0 || p.seqlen > p.input) {
				t.Fatalf("bad seqlen %+v", p)
			}
		}
	})
}

// TestParseGeneratePriority: SGLang's request priority (GenerateReqInput.priority, a signed
// 64-bit integer) reaches the plan; anything else is a bad request.
func TestParseGeneratePriority(t *testing.T) {
	pre := kvcv1.WorkerRole_WORKER_ROLE_PREFILL
	tests := []struct {
		name string
		prio string // the field's JSON ("" = absent)
		want int64
		bad  bool
	}{
		{"absent", "", 0, false},
		{"null", "null", 0, false},
		{"low (kvcentric's prefill priority 100)", "-100", -100, false},
		{"high", "7", 7, false},
		{"int64 min", "-9223372036854775808", -1 << 63, false},
		{"beyond int64", "9223372036854775808", 0, true},
		{"fraction", "1.5", 0, true},
		{"string", `"low"`, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			body := `{"rid":"r1","input_ids":[1,2,3],"bootstrap_room":1`
			if tt.prio != "" {
				body += `,"priority":` + tt.prio
			}
			p, err := parseGenerate([]byte(body+"}"), pre, 1000)
			if tt.bad {
				if err == nil {
					t.Fatalf("accepted priority %s", tt.prio)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if p.priority != tt.want {
				t.Fatalf("priority %d, want %d", p.priority, tt.want)
			}
		})
	}
}

// kv_hints load (a decode sidecar's LoadSessionCommand) is a zero-output RESEED_SNAPSHOT of the
// whole input that keeps the session, on a decode worker; anything else is a bad request.
func TestParseGenerateLoad(t *testing.T) {
	body := func(mode string, input, seqlen, maxNew int64) string {
		transfer := "SNAPSHOT"
		if mode != "RESEED_SNAPSHOT" {
			transfer = "SEED"
		}
		return fmt.Sprintf(`{"session_params":{"id":"s"},"sampling_params":{"max_new_tokens":%d},"kv_hints":{"protocol_version":1,"actions":[{"action_type":"kvc","action_version":1,"payload":{"mode":%q,"session_id":"s","input_tokens":%d,"cached_tokens":%d,"room":1,"transfer":%q,"snapshot_seqlen":%d,"keep_session":true,"load":true}}]}}`,
			maxNew, mode, input, seqlen, transfer, seqlen)
	}
	tests := []struct {
		name string
		body string
		role kvcv1.WorkerRole
		ok   bool
	}{
		{"load", body("RESEED_SNAPSHOT", 100, 100, 0), kvcv1.WorkerRole_WORKER_ROLE_DECODE, true},
		{"generates tokens", body("RESEED_SNAPSHOT", 100, 100, 8), kvcv1.WorkerRole_WORKER_ROLE_DECODE, false},
		{"part of the input", body("RESEED_SNAPSHOT", 100, 60, 0), kvcv1.WorkerRole_WORKER_ROLE_DECODE, false},
		{"not a snapshot", body("SEED", 100, 100, 0), kvcv1.WorkerRole_WORKER_ROLE_DECODE, false},
		{"on a prefill worker", body("RESEED_SNAPSHOT", 100, 100, 0), kvcv1.WorkerRole_WORKER_ROLE_PREFILL, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := parseGenerate([]byte(tc.body), tc.role, 10_000)
			if (err == nil) != tc.ok {
				t.Fatalf("parseGenerate: %v, want ok %v", err, tc.ok)
			}
			if tc.ok && !p.load {
				t.Fatal("load not set")
			}
		})
	}
}
