package kvhints

import (
	"encoding/json"
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"go.uber.org/goleak"
	"google.golang.org/protobuf/proto"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestRoundTrip: a payload built into an envelope comes back equal, with the proto field names
// on the wire and the action id naming the role.
func TestRoundTrip(t *testing.T) {
	p := &kvcv1.ExecutionPayload{
		DecisionId: "d1", Mode: kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT, Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE,
		SessionId: "s", InputTokens: 90, CachedTokens: 3, KeepSession: true, OpenSession: true,
		Receive: &kvcv1.ExecutionReceive{Kind: kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, Room: 1 << 62,
			PeerAddr: "p:1", PeerAddrs: []string{"p:1", "p:2"}, Tokens: 64, FromToken: 16},
		LoadPrefixTokens: 32, LoadGeneration: 1<<63 + 5,
	}
	env, err := Build("d1", p)
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := json.Marshal(env)
	var generic struct {
		Actions []struct {
			ActionID string         `json:"action_id"`
			Payload  map[string]any `json:"payload"`
		} `json:"actions"`
	}
	if err := json.Unmarshal(raw, &generic); err != nil {
		t.Fatal(err)
	}
	if got := generic.Actions[0].ActionID; got != "d1/decode" {
		t.Fatalf("action_id %q", got)
	}
	for _, k := range []string{"decision_id", "keep_session", "open_session", "receive", "load_prefix_tokens"} {
		if _, ok := generic.Actions[0].Payload[k]; !ok {
			t.Fatalf("payload without %q: %s", k, raw)
		}
	}
	got, err := Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(got, p) {
		t.Fatalf("round trip: got %v, want %v", got, p)
	}
}

func TestParse(t *testing.T) {
	env := func(actions string) string {
		return `{"protocol_version":1,"message_id":"m","actions":[` + actions + `]}`
	}
	for _, tc := range []struct {
		name, raw string
		want      *kvcv1.ExecutionPayload
		code      string
	}{
		{"none", ``, nil, ""},
		{"null", `null`, nil, ""},
		{"other orchestrator only", env(`{"action_type":"hicache","action_version":7,"payload":{"x":1}}`), nil, ""},
		{"camel case names, numbers and enum numbers", env(`{"action_type":"kvc","action_version":2,"payload":{"sessionId":"s","inputTokens":9,"role":2,"receive":{"kind":"TRANSFER_KIND_SEED","room":"3","fromToken":4}}}`),
			&kvcv1.ExecutionPayload{SessionId: "s", InputTokens: 9, Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE,
				Receive: &kvcv1.ExecutionReceive{Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED, Room: 3, FromToken: 4}}, ""},
		{"beside another action", env(`{"action_type":"hicache","action_version":7,"payload":[1]},{"action_type":"kvc","action_version":2,"payload":{"local_prefill":true}}`),
			&kvcv1.ExecutionPayload{LocalPrefill: true}, ""},
		{"not json", `{`, nil, CodeMalformed},
		{"protocol version", `{"protocol_version":2,"actions":[]}`, nil, CodeProtocolVersion},
		{"action version 1 (the mode-name payload)", env(`{"action_type":"kvc","action_version":1,"payload":{"mode":"SEED"}}`), nil, CodeActionVersion},
		{"two kvc actions", env(`{"action_type":"kvc","action_version":2,"payload":{}},{"action_type":"kvc","action_version":2,"payload":{}}`), nil, CodeTwoActions},
		{"unknown field", env(`{"action_type":"kvc","action_version":2,"payload":{"transfer":"SEED"}}`), nil, CodeMalformed},
		{"unknown enum name", env(`{"action_type":"kvc","action_version":2,"payload":{"mode":"SEED"}}`), nil, CodeMalformed},
		{"payload not an object", env(`{"action_type":"kvc","action_version":2,"payload":[1]}`), nil, CodeMalformed},
		{"null payload", env(`{"action_type":"kvc","action_version":2,"payload":null}`), nil, CodeMalformed},
		{"missing payload", env(`{"action_type":"kvc","action_version":2}`), nil, CodeMalformed},
		{"negative uint64", env(`{"action_type":"kvc","action_version":2,"payload":{"load_generation":-1}}`), nil, CodeMalformed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Parse(json.RawMessage(tc.raw))
			code, isErr := IsError(err)
			switch {
			case tc.code != "" && code != tc.code:
				t.Fatalf("error %v (code %q), want code %q", err, code, tc.code)
			case tc.code == "" && err != nil:
				t.Fatalf("error %v", err)
			case err != nil && !isErr:
				t.Fatalf("error %v is not an *Error", err)
			case tc.code == "" && !proto.Equal(got, tc.want):
				t.Fatalf("got %v, want %v", got, tc.want)
			}
		})
	}
}
