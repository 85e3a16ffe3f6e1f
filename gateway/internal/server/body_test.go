package server

import (
	"bytes"
	"encoding/json"
	"io"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"unsafe"
)

// readBody reads a declared body into one buffer of its size (issue 16 finding 6; io.ReadAll
// allocated about twice the body on the way); wrong or missing lengths still read it all.
func TestReadBodyOneBuffer(t *testing.T) {
	const size = 8 << 20
	body := bytes.Repeat([]byte("x"), size)
	for _, tc := range []struct {
		name     string
		declared int64
		maxAlloc uint64
	}{
		{"declared", size, size + 1<<20},
		{"undeclared", -1, 0},
		{"declared too small", 10, 0},
		{"declared too large", size * 2, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var before, after runtime.MemStats
			runtime.GC()
			runtime.ReadMemStats(&before)
			got, err := readBody(bytes.NewReader(body), tc.declared, 32<<20)
			runtime.ReadMemStats(&after)
			if err != nil || !bytes.Equal(got, body) {
				t.Fatalf("read %d bytes, %v", len(got), err)
			}
			if a := after.TotalAlloc - before.TotalAlloc; tc.maxAlloc > 0 && a > tc.maxAlloc {
				t.Fatalf("allocated %d bytes for a %d-byte body", a, size)
			}
		})
	}
}

// A worker call's body is the JSON of the object with "text" added, whatever the text; a text
// that needs no escaping is sent by reference (the request's own string), not copied.
func TestWorkerBodyText(t *testing.T) {
	obj := []byte(`{"rid":"r1","stream":true,"sampling_params":{"max_new_tokens":4}}`)
	for _, text := range []string{"", "plain words <b> & é", `with "quotes"`, "back\\slash", "new\nline", "\x01ctl", "bad \xff utf8", strings.Repeat("a", 1<<20)} {
		w := withText(obj, text)
		raw, err := io.ReadAll(w.reader())
		if err != nil || int64(len(raw)) != w.size() {
			t.Fatalf("%.20q: read %d of %d bytes, %v", text, len(raw), w.size(), err)
		}
		var got, want map[string]any
		if err := json.Unmarshal(raw, &got); err != nil {
			t.Fatalf("%.20q: body is not JSON: %v", text, err)
		}
		if err := json.Unmarshal(obj, &want); err != nil {
			t.Fatal(err)
		}
		if text != "" {
			var decoded string
			enc, _ := json.Marshal(text)
			_ = json.Unmarshal(enc, &decoded)
			want["text"] = decoded
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%.20q: body %.200s", text, raw)
		}
		if plainJSONString(text) && text != "" && unsafe.StringData(w.text) != unsafe.StringData(text) {
			t.Fatalf("%.20q: a plain text was copied", text)
		}
	}
}
