package server

import (
	"bytes"
	"runtime"
	"testing"
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
