package api

import (
	"encoding/json"
	"net/http"
	"runtime"
	"strings"
	"testing"
)

// aliasString decodes exactly what encoding/json decodes, whether it aliases the body or not.
func FuzzAliasString(f *testing.F) {
	for _, s := range []string{`"plain"`, `""`, `"a\"b"`, `"\u00e9t\u00e9"`, `"été"`, "\"\xff\xfe\"", `"tab\tx"`, `null`, `12`, `["a"]`, `"a\\"`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if !json.Valid(b) {
			return // Parse hands aliasString only slices of a valid document
		}
		var want string
		werr := json.Unmarshal(b, &want)
		got, err := rawField(b).aliasString()
		if (err != nil) != (werr != nil) || got != want {
			t.Fatalf("%q: got %q, %v; encoding/json %q, %v", b, got, err, want, werr)
		}
	})
}

// A large text prompt is held once, in the body: Parse allocates a small fraction of the body
// (it used to copy it about three times: the Decoder's buffer, the raw field, the string;
// issue 16 finding 6).
func TestParseLargeTextWithoutCopies(t *testing.T) {
	const size = 8 << 20
	raw := []byte(`{"text": "` + strings.Repeat("a", size) + `", "sampling_params": {"max_new_tokens": 1}}`)
	h := http.Header{"X-Session-Id": []string{"s"}}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	r, perr := Parse(Generate, h, raw, Options{})
	runtime.ReadMemStats(&after)
	if perr != nil {
		t.Fatal(perr)
	}
	if len(r.Text) != size || r.InputTokens != size/CharsPerToken {
		t.Fatalf("text of %d bytes, %d tokens", len(r.Text), r.InputTokens)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > size/8 {
		t.Fatalf("Parse allocated %d bytes for a %d-byte text", got, size)
	}
	// With an escape the text is decoded (copied) — and still right.
	raw = []byte(`{"text": "x\n` + strings.Repeat("b", 100) + `", "sampling_params": {"max_new_tokens": 1}}`)
	if r, perr = Parse(Generate, h, raw, Options{}); perr != nil {
		t.Fatal(perr)
	}
	if r.Text != "x\n"+strings.Repeat("b", 100) {
		t.Fatalf("escaped text %q", r.Text)
	}
}
