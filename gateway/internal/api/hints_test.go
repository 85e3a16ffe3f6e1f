package api

import (
	"net/http"
	"testing"
)

func TestParseHints(t *testing.T) {
	opt := Options{DefaultMaxTok: 16}
	chat := func(extra string) string {
		return `{"messages":[{"role":"user","content":"hi"}]` + extra + `}`
	}
	tests := []struct {
		name     string
		kind     Kind
		h        map[string]string
		body     string
		want     Hints
		wantCode string
	}{
		{name: "none", kind: Chat, h: map[string]string{"X-Session-ID": "s"}, body: chat("")},
		{name: "pin header", kind: Chat, h: map[string]string{"X-Session-ID": "s", HeaderPinMs: " 30000 "}, body: chat(""), want: Hints{PinMs: 30000}},
		{name: "pin metadata string", kind: Chat, h: map[string]string{"X-Session-ID": "s"}, body: chat(`,"metadata":{"kvc_pin_ms":"45000","user":"x"}`), want: Hints{PinMs: 45000}},
		{name: "pin metadata number", kind: Completion, h: map[string]string{"X-Session-ID": "s"}, body: `{"prompt":"p","metadata":{"kvc_pin_ms":1000}}`, want: Hints{PinMs: 1000}},
		{name: "header wins over metadata", kind: Chat, h: map[string]string{"X-Session-ID": "s", HeaderPinMs: "5"}, body: chat(`,"metadata":{"kvc_pin_ms":"bad"}`), want: Hints{PinMs: 5}},
		{name: "generate kvc object", kind: Generate, h: map[string]string{}, body: `{"text":"x","session_params":{"id":"g"},"kvc":{"pin_ms":2000,"priority":"low"}}`, want: Hints{PinMs: 2000, LowPriority: true}},
		{name: "generate headers", kind: Generate, h: map[string]string{"X-Session-ID": "g", HeaderRelease: "true", HeaderPriority: "LOW"}, body: `{"input_ids":[1,2]}`, want: Hints{Release: true, LowPriority: true}},
		{name: "release metadata", kind: Chat, h: map[string]string{"X-Session-ID": "s"}, body: chat(`,"metadata":{"kvc_release":"true"}`), want: Hints{Release: true}},
		{name: "release false", kind: Chat, h: map[string]string{"X-Session-ID": "s", HeaderRelease: "0"}, body: chat(""), want: Hints{}},
		{name: "priority normal", kind: Chat, h: map[string]string{"X-Session-ID": "s"}, body: chat(`,"metadata":{"kvc_priority":"normal"}`), want: Hints{}},
		{name: "pin zero", kind: Chat, h: map[string]string{"X-Session-ID": "s", HeaderPinMs: "0"}, body: chat(""), want: Hints{}},
		{name: "pin max", kind: Chat, h: map[string]string{"X-Session-ID": "s", HeaderPinMs: "86400000"}, body: chat(""), want: Hints{PinMs: MaxPinMs}},
		{name: "metadata null ignored", kind: Chat, h: map[string]string{"X-Session-ID": "s"}, body: chat(`,"metadata":{"kvc_pin_ms":null}`), want: Hints{}},

		{name: "pin negative", kind: Chat, h: map[string]string{"X-Session-ID": "s", HeaderPinMs: "-1"}, body: chat(""), wantCode: CodeInvalidPin},
		{name: "pin too long", kind: Chat, h: map[string]string{"X-Session-ID": "s", HeaderPinMs: "86400001"}, body: chat(""), wantCode: CodeInvalidPin},
		{name: "pin not a number", kind: Chat, h: map[string]string{"X-Session-ID": "s"}, body: chat(`,"metadata":{"kvc_pin_ms":"10s"}`), wantCode: CodeInvalidPin},
		{name: "pin fraction", kind: Generate, h: map[string]string{"X-Session-ID": "s"}, body: `{"text":"x","kvc":{"pin_ms":1.5}}`, wantCode: CodeInvalidPin},
		{name: "pin object", kind: Chat, h: map[string]string{"X-Session-ID": "s"}, body: chat(`,"metadata":{"kvc_pin_ms":{"a":1}}`), wantCode: "bad_request"},
		{name: "release bad", kind: Chat, h: map[string]string{"X-Session-ID": "s", HeaderRelease: "yes please"}, body: chat(""), wantCode: CodeInvalidRelease},
		{name: "priority bad", kind: Chat, h: map[string]string{"X-Session-ID": "s"}, body: chat(`,"metadata":{"kvc_priority":"urgent"}`), wantCode: CodeInvalidPriority},
		{name: "pin and release", kind: Chat, h: map[string]string{"X-Session-ID": "s", HeaderPinMs: "100", HeaderRelease: "true"}, body: chat(""), wantCode: CodeConflictingHint},
		{name: "hint without session", kind: Chat, h: map[string]string{HeaderPriority: "low"}, body: chat(""), wantCode: CodeHintNoSession},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := http.Header{}
			for k, v := range tt.h {
				h.Set(k, v)
			}
			r, err := Parse(tt.kind, h, []byte(tt.body), opt)
			if tt.wantCode != "" {
				if err == nil || err.Code != tt.wantCode || err.Status != http.StatusBadRequest {
					t.Fatalf("got %v (request %+v), want a 400 %s", err, r, tt.wantCode)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if r.Hints != tt.want {
				t.Fatalf("hints %+v, want %+v", r.Hints, tt.want)
			}
		})
	}
}

func TestParseHintsRepeatedHeader(t *testing.T) {
	h := http.Header{}
	h.Set("X-Session-ID", "s")
	h.Add(HeaderPinMs, "1")
	h.Add(HeaderPinMs, "2")
	if _, err := Parse(Chat, h, []byte(`{"messages":[{"role":"user","content":"hi"}]}`), Options{DefaultMaxTok: 1}); err == nil || err.Status != http.StatusBadRequest {
		t.Fatalf("two pin headers: %v", err)
	}
}

// FuzzParseHints: whatever the headers and the body say, an accepted request's hints are in
// range, never both pinned and released, and never without a session id; a refused one has a
// 4xx status.
func FuzzParseHints(f *testing.F) {
	f.Add(`{"text":"x","kvc":{"pin_ms":5}}`, "s", "10", "", "")
	f.Add(`{"messages":[{"role":"user","content":"x"}],"metadata":{"kvc_pin_ms":"7","kvc_priority":"low"}}`, "s", "", "false", "normal")
	f.Add(`{"prompt":"p","metadata":{"kvc_release":true}}`, "", "", "", "")
	f.Add(`{"text":"x","metadata":{"kvc_pin_ms":1e3}}`, "s", "", "", "LOW")
	f.Add(`{"text":"x","metadata":5}`, "s", "-1", "1", "x")
	f.Fuzz(func(t *testing.T, body, sid, pin, release, prio string) {
		h := http.Header{}
		for k, v := range map[string]string{"X-Session-ID": sid, HeaderPinMs: pin, HeaderRelease: release, HeaderPriority: prio} {
			if v != "" {
				h.Set(k, v)
			}
		}
		for _, k := range []Kind{Chat, Completion, Generate} {
			r, err := Parse(k, h, []byte(body), Options{DefaultMaxTok: 16})
			if err != nil {
				if err.Status < 400 || err.Status > 499 || err.Code == "" {
					t.Fatalf("refusal %+v", err)
				}
				continue
			}
			hs := r.Hints
			if hs.PinMs < 0 || hs.PinMs > MaxPinMs || (hs.PinMs > 0 && hs.Release) {
				t.Fatalf("accepted hints %+v", hs)
			}
			if (hs.PinMs > 0 || hs.Release || hs.LowPriority) && r.SessionID == "" {
				t.Fatalf("hints %+v without a session", hs)
			}
		}
	})
}
