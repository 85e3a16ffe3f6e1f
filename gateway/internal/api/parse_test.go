package api

import (
	"net/http"
	"strings"
	"testing"
)

func TestParse(t *testing.T) {
	opt := Options{RequireSession: true, DefaultMaxTok: 64}
	hdr := func(kv ...string) http.Header {
		h := http.Header{}
		for i := 0; i+1 < len(kv); i += 2 {
			h.Set(kv[i], kv[i+1])
		}
		return h
	}
	tests := []struct {
		name    string
		kind    Kind
		h       http.Header
		body    string
		opt     *Options
		wantErr string
		check   func(t *testing.T, r *Request)
	}{
		{name: "chat header session", kind: Chat, h: hdr("X-Session-ID", "s1"), body: `{"model":"m","messages":[{"role":"user","content":"hello world!"}],"stream":true,"max_tokens":9}`,
			check: func(t *testing.T, r *Request) {
				if r.SessionID != "s1" || !r.Stream || r.MaxTokens != 9 || !r.Estimated || r.InputTokens != 5 || r.Text != "user: hello world!\n" {
					t.Fatalf("%+v", r)
				}
			}},
		{name: "chat content parts", kind: Chat, h: hdr("X-Session-ID", "s1"), body: `{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"n":1,"temperature":0}`,
			check: func(t *testing.T, r *Request) {
				if r.Text != "user: ab\n" || r.MaxTokens != 64 {
					t.Fatalf("%+v", r)
				}
			}},
		{name: "every chat role", kind: Chat, h: hdr("X-Session-ID", "s1"), body: `{"messages":[{"role":"system","content":"a"},{"role":"developer","content":"b"},{"role":"user","content":"c"},{"role":"assistant","content":"d"},{"role":"tool","content":"e"},{"role":"function","content":"f"}]}`,
			check: func(t *testing.T, r *Request) {
				if len(r.Messages) != 6 {
					t.Fatalf("%+v", r)
				}
			}},
		{name: "generate sampling n 1, temperature 0.7", kind: Generate, h: hdr("X-Session-ID", "s"), body: `{"text":"x","sampling_params":{"n":1,"temperature":0.7}}`,
			check: func(t *testing.T, r *Request) {}},
		{name: "generate session params and kvc", kind: Generate, h: http.Header{}, body: `{"text":"x","session_params":{"id":"s2"},"sampling_params":{"max_new_tokens":3},"kvc":{"input_tokens":5000,"turn":4}}`,
			check: func(t *testing.T, r *Request) {
				if r.SessionID != "s2" || r.InputTokens != 5000 || r.Estimated || r.Turn != 4 || !r.Multiturn || r.MaxTokens != 3 {
					t.Fatalf("%+v", r)
				}
			}},
		{name: "generate input ids", kind: Generate, h: hdr("X-Session-ID", "s"), body: `{"input_ids":[1,2,3]}`,
			check: func(t *testing.T, r *Request) {
				if r.InputTokens != 3 {
					t.Fatalf("%+v", r)
				}
			}},
		{name: "header count wins", kind: Completion, h: hdr("X-Session-ID", "s", "X-KVC-Input-Tokens", "777", "X-KVC-Turn", "0", "X-KVC-Multiturn", "true"), body: `{"prompt":"abc","kvc":{"input_tokens":5}}`,
			check: func(t *testing.T, r *Request) {
				if r.InputTokens != 777 || !r.Multiturn {
					t.Fatalf("%+v", r)
				}
			}},
		{name: "completion token prompt", kind: Completion, h: hdr("X-Session-ID", "s"), body: `{"prompt":[5,6]}`,
			check: func(t *testing.T, r *Request) {
				if r.InputTokens != 2 {
					t.Fatalf("%+v", r)
				}
			}},
		{name: "anonymous allowed", kind: Completion, h: http.Header{}, body: `{"prompt":"abc"}`, opt: &Options{DefaultMaxTok: 1},
			check: func(t *testing.T, r *Request) {
				if r.SessionID != "" {
					t.Fatalf("%+v", r)
				}
			}},
		{name: "missing session", kind: Chat, h: http.Header{}, body: `{"messages":[{"role":"user","content":"x"}]}`, wantErr: "missing_session_id"},
		{name: "empty", kind: Chat, h: http.Header{}, body: ``, wantErr: "empty request body"},
		{name: "malformed", kind: Chat, h: http.Header{}, body: `{"messages":`, wantErr: "malformed JSON"},
		{name: "trailing", kind: Chat, h: http.Header{}, body: `{} {}`, wantErr: "trailing data"},
		{name: "no messages", kind: Chat, h: hdr("X-Session-ID", "s"), body: `{"messages":[]}`, wantErr: "messages must be"},
		{name: "bad content", kind: Chat, h: hdr("X-Session-ID", "s"), body: `{"messages":[{"role":"user","content":7}]}`, wantErr: "content parts"},
		{name: "batch text", kind: Generate, h: hdr("X-Session-ID", "s"), body: `{"text":["a","b"]}`, wantErr: "batch"},
		{name: "generate nothing", kind: Generate, h: hdr("X-Session-ID", "s"), body: `{"stream":true}`, wantErr: "is required"},
		{name: "bad session", kind: Generate, h: hdr("X-Session-ID", "a/b"), body: `{"text":"x"}`, wantErr: "forbidden character"},
		{name: "session not string", kind: Generate, h: http.Header{}, body: `{"text":"x","session_params":{"id":5}}`, wantErr: "must be a string"},
		{name: "negative max", kind: Generate, h: hdr("X-Session-ID", "s"), body: `{"text":"x","sampling_params":{"max_new_tokens":-1}}`, wantErr: "max tokens"},
		{name: "fractional max", kind: Completion, h: hdr("X-Session-ID", "s"), body: `{"prompt":"x","max_tokens":1.5}`, wantErr: "malformed JSON"},
		{name: "impossible input", kind: Generate, h: hdr("X-Session-ID", "s"), body: `{"kvc":{"input_tokens":99999999999}}`, wantErr: "input tokens"},
		{name: "zero input", kind: Generate, h: hdr("X-Session-ID", "s", "X-KVC-Input-Tokens", "0"), body: `{"text":""}`, wantErr: "input tokens"},
		{name: "bad header", kind: Generate, h: hdr("X-Session-ID", "s", "X-KVC-Input-Tokens", "lots"), body: `{"text":"x"}`, wantErr: "X-KVC-Input-Tokens"},
		{name: "negative turn", kind: Generate, h: hdr("X-Session-ID", "s"), body: `{"text":"x","kvc":{"turn":-2}}`, wantErr: "negative"},
		{name: "two prompts", kind: Completion, h: hdr("X-Session-ID", "s"), body: `{"prompt":["a","b"]}`, wantErr: "exactly one"},
		// issue 23 item 6: inputs once served differently from what was asked, each a 400 with a stable code
		{name: "n=2", kind: Chat, h: hdr("X-Session-ID", "s"), body: `{"messages":[{"role":"user","content":"x"}],"n":2}`, wantErr: "unsupported_parameter: n = 2"},
		{name: "n=0", kind: Completion, h: hdr("X-Session-ID", "s"), body: `{"prompt":"x","n":0}`, wantErr: "unsupported_parameter"},
		{name: "sampling_params.n=3", kind: Generate, h: hdr("X-Session-ID", "s"), body: `{"text":"x","sampling_params":{"n":3}}`, wantErr: "unsupported_parameter"},
		{name: "unknown role", kind: Chat, h: hdr("X-Session-ID", "s"), body: `{"messages":[{"role":"wizard","content":"x"}]}`, wantErr: "invalid_role: messages[0].role \"wizard\""},
		{name: "role in capitals", kind: Chat, h: hdr("X-Session-ID", "s"), body: `{"messages":[{"role":"User","content":"x"}]}`, wantErr: "invalid_role"},
		{name: "image part", kind: Chat, h: hdr("X-Session-ID", "s"), body: `{"messages":[{"role":"user","content":[{"type":"text","text":"ab"},{"type":"image_url","image_url":{"url":"http://x/y.png"}}]}]}`, wantErr: "unsupported_content: messages[0].content[1]: content part type \"image_url\""},
		{name: "audio part", kind: Chat, h: hdr("X-Session-ID", "s"), body: `{"messages":[{"role":"user","content":[{"type":"input_audio"}]}]}`, wantErr: "unsupported_content"},
		{name: "negative temperature", kind: Chat, h: hdr("X-Session-ID", "s"), body: `{"messages":[{"role":"user","content":"x"}],"temperature":-0.5}`, wantErr: "invalid_parameter: temperature must be a non-negative finite number, got -0.5."},
		{name: "negative sampling temperature", kind: Generate, h: hdr("X-Session-ID", "s"), body: `{"text":"x","sampling_params":{"temperature":-1}}`, wantErr: "invalid_parameter"},
		{name: "two X-Session-ID headers", kind: Generate, h: http.Header{"X-Session-Id": {"s1", "s2"}}, body: `{"text":"x"}`, wantErr: "ambiguous_session_id"},
		{name: "the same X-Session-ID twice", kind: Generate, h: http.Header{"X-Session-Id": {"s1", "s1"}}, body: `{"text":"x"}`, wantErr: "ambiguous_session_id"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o := opt
			if tt.opt != nil {
				o = *tt.opt
			}
			r, err := Parse(tt.kind, tt.h, []byte(tt.body), o)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err = %v, want %q", err, tt.wantErr)
				}
				if err.Status != http.StatusBadRequest {
					t.Fatalf("status %d", err.Status)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tt.check(t, r)
		})
	}
}

func FuzzParse(f *testing.F) {
	for _, s := range []string{`{"messages":[{"role":"user","content":"x"}]}`, `{"text":"a","kvc":{"input_tokens":5}}`, `{"prompt":[1,2]}`, `{`, `null`, `[]`, `{"text":["a"]}`} {
		f.Add(s, "s1")
	}
	f.Fuzz(func(t *testing.T, body, sid string) {
		h := http.Header{}
		h.Set("X-Session-ID", sid)
		for _, k := range []Kind{Chat, Completion, Generate} {
			r, err := Parse(k, h, []byte(body), Options{DefaultMaxTok: 16})
			if (r == nil) == (err == nil) {
				t.Fatalf("exactly one of request and error expected: %v %v", r, err)
			}
			if r != nil && (r.InputTokens < 1 || r.MaxTokens < 1) {
				t.Fatalf("accepted impossible request %+v", r)
			}
		}
	})
}
