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
		input    int64
		keep     bool
		seedKey  string
		maxNew   int64
		hasRoom  bool
		roomWant int64
	}{
		{"input from text, room from bootstrap_room", `{"rid":"r1","text":"abcdefgh","bootstrap_room":7,` + envelope(`{"receive":{"kind":"TRANSFER_KIND_SEED","room":"7"}}`) + `}`, 2, false, "r1", defaultMaxNew, true, 7},
		{"input ids", `{"input_ids":[1,2,3],"sampling_params":{"max_new_tokens":0},` + envelope(`{"receive":{"kind":"TRANSFER_KIND_SEED","room":"1"}}`) + `}`, 3, false, "room-1", 0, true, 1},
		{"seed keeps", `{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":9,"keep_session":true,"open_session":true,"receive":{"kind":"TRANSFER_KIND_SEED","room":"4611686018427387904"}}`) + `}`, 9, true, "s", defaultMaxNew, true, 1 << 62},
		{"direct turn by session_params", `{"session_params":{"id":"s2"},` + envelope(`{"input_tokens":9,"keep_session":true}`) + `}`, 9, true, "s2", defaultMaxNew, false, 0},
		{"receive with a session, kept nowhere", `{` + envelope(`{"session_id":"s","input_tokens":9,"receive":{"kind":"TRANSFER_KIND_SEED","room":"2"}}`) + `}`, 9, false, "s", defaultMaxNew, true, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := parseGenerate([]byte(tt.body), dec, 1000)
			if err != nil {
				t.Fatal(err)
			}
			if p.input != tt.input || p.keep != tt.keep || p.seedKey != tt.seedKey ||
				p.maxNew != tt.maxNew || p.hasRoom != tt.hasRoom || p.room != tt.roomWant {
				t.Fatalf("got %+v", p)
			}
		})
	}
}

func FuzzParseGenerate(f *testing.F) {
	for _, s := range []string{
		`{"rid":"r1","text":"abcdefgh","bootstrap_room":7}`,
		`{"sampling_params":{"max_new_tokens":-1}}`, `{`, `null`, `[]`, `{"bootstrap_room":1e99}`,
		`{"rid":"r","input_ids":[1,2],"bootstrap_room":3,"priority":-100,` + envelope(`{"send":{"room":"3"}}`) + `}`,
		`{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":9,"cached_tokens":3,"keep_session":true,"open_session":true,"receive":{"kind":"TRANSFER_KIND_SEED","room":"1"}}`) + `}`,
		`{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":9,"keep_session":true,"open_session":true,"receive":{"kind":"TRANSFER_KIND_SNAPSHOT","room":"1","tokens":"4"}}`) + `}`,
		`{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":9,"cached_tokens":9,"keep_session":true,"truncate_to":9}`) + `}`,
		`{"session_params":{"id":"s"},` + envelope(`{"session_id":"s","input_tokens":90,"keep_session":true,"receive":{"kind":"TRANSFER_KIND_SEED","room":"1","from_token":"32"}}`) + `}`,
		`{` + envelope(`{"session_id":"s","input_tokens":9,"local_prefill":true}`) + `}`,
		`{` + envelope(`{"role":"WORKER_ROLE_PREFILL","session_id":"s","input_tokens":9,"load_prefix_tokens":"4","send":{"room":"1","store_generation":"2"}}`) + `}`,
		`{"kv_hints":{"protocol_version":1,"actions":[{"action_type":"other","action_version":3,"payload":{"x":1}},{"action_type":"kvc","action_version":2,"payload":{"session_id":"s","input_tokens":9,"receive":{"kind":"TRANSFER_KIND_SEED","room":"2"}}}]}}`,
		`{"kv_hints":{"protocol_version":1,"actions":[{"action_type":"kvc","action_version":2,"payload":null}]}}`,
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
			if (p.receives() || p.sends) && (!p.hasRoom || p.room < 0) {
				t.Fatalf("transfer without room %+v", p)
			}
			if p.sessionID == "" && p.keep {
				t.Fatalf("stateful request without session %+v", p)
			}
			if p.receives() && (p.recvTokens <= 0 || p.recvTokens > p.input || p.receiveFrom < 0 || p.receiveFrom >= p.input) {
				t.Fatalf("bad receive %+v", p)
			}
			if role == kvcv1.WorkerRole_WORKER_ROLE_DECODE && !p.receives() && !p.localPrefill && !p.keep {
				t.Fatalf("nothing to serve from %+v", p)
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
			body := `{"rid":"r1","input_ids":[1,2,3],"bootstrap_room":1,` + envelope(`{"send":{"room":"1"}}`)
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

// The payload's load (a decode sidecar's LoadSessionCommand) is a zero-output SNAPSHOT receive
// of the whole input into a new session kept here, on a decode worker; anything else is a bad
// request.
func TestParseGenerateLoad(t *testing.T) {
	body := func(kind string, input, tokens, maxNew int64) string {
		return fmt.Sprintf(`{"session_params":{"id":"s"},"sampling_params":{"max_new_tokens":%d},`+envelope(`{"session_id":"s","input_tokens":%d,"cached_tokens":%d,"keep_session":true,"open_session":true,"load":true,"receive":{"kind":%q,"room":"1","tokens":%d}}`)+`}`,
			maxNew, input, tokens, kind, tokens)
	}
	tests := []struct {
		name string
		body string
		role kvcv1.WorkerRole
		ok   bool
	}{
		{"load", body("TRANSFER_KIND_SNAPSHOT", 100, 100, 0), kvcv1.WorkerRole_WORKER_ROLE_DECODE, true},
		{"generates tokens", body("TRANSFER_KIND_SNAPSHOT", 100, 100, 8), kvcv1.WorkerRole_WORKER_ROLE_DECODE, false},
		{"part of the input", body("TRANSFER_KIND_SNAPSHOT", 100, 60, 0), kvcv1.WorkerRole_WORKER_ROLE_DECODE, false},
		{"not a snapshot", body("TRANSFER_KIND_SEED", 100, 100, 0), kvcv1.WorkerRole_WORKER_ROLE_DECODE, false},
		{"on a prefill worker", body("TRANSFER_KIND_SNAPSHOT", 100, 100, 0), kvcv1.WorkerRole_WORKER_ROLE_PREFILL, false},
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
