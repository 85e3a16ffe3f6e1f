package kvpool

import "testing"

func TestContentPattern(t *testing.T) {
	const key = 0x6b7663
	b := make([]byte, 48)
	FillTokenContent(b, key, 42, 7, 1)
	tests := []struct {
		name string
		id   uint32
		pos  int64
		buf  int
		key  uint64
		ok   bool
	}{
		{"same token, position, buffer", 42, 7, 1, key, true},
		{"other token at the same position", 43, 7, 1, key, false},
		{"same token at another position", 42, 8, 1, key, false},
		{"other buffer", 42, 7, 2, key, false},
		{"other key", 42, 7, 1, key + 1, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := CheckTokenContent(b, tt.key, tt.id, tt.pos, tt.buf); got != tt.ok {
				t.Fatalf("CheckTokenContent = %v, want %v", got, tt.ok)
			}
		})
	}
}

// TestContentMisStitch: KV of one prompt verifies against the same ids in another session's
// pages (shared prefix), and fails exactly at the positions where an edited prompt differs.
func TestContentMisStitch(t *testing.T) {
	s := Spec{PageSize: 4, ItemLen: 4 * 16, NumLayers: 2, PageCount: 16}
	p, err := Create(t.TempDir(), s)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	const key = 1
	ids := []uint32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}
	pages := []int64{5, 2, 9}
	if err := FillContent(p, key, ids, pages, 0, 12); err != nil {
		t.Fatal(err)
	}
	if bad, err := CheckContent(p, key, ids, pages, 0, 12); err != nil || bad != 0 {
		t.Fatalf("own ids: %d bad, %v", bad, err)
	}
	edited := append([]uint32(nil), ids...)
	edited[6], edited[9] = 99, 98 // two tokens rewritten
	bad, err := CheckContent(p, key, edited, pages, 0, 12)
	if err != nil {
		t.Fatal(err)
	}
	if want := int64(2 * p.NumBuffers()); bad != want {
		t.Fatalf("edited ids: %d bad slots, want %d", bad, want)
	}
	if bad, _ := CheckContent(p, key, edited, pages, 0, 6); bad != 0 {
		t.Fatalf("common prefix [0, 6): %d bad slots", bad)
	}
	shifted := append([]uint32{0}, ids[:11]...) // one token inserted at the front
	if bad, _ := CheckContent(p, key, shifted, pages, 0, 12); bad != int64(12*p.NumBuffers()) {
		t.Fatalf("shifted prompt: %d bad slots, want all %d", bad, 12*p.NumBuffers())
	}
	if _, err := CheckContent(p, key, ids[:5], pages, 0, 12); err == nil {
		t.Fatal("too few ids: no error")
	}
	if err := FillContent(p, key, ids[:5], pages, 0, 12); err == nil {
		t.Fatal("too few ids: no error")
	}
}
