package kvpool

import "testing"

func TestPatternRoundTrip(t *testing.T) {
	tests := []struct {
		name  string
		size  int
		token int64
		buf   int
	}{
		{"aligned", 64, 0, 0}, {"tail", 13, 7, 3}, {"one byte", 1, 1 << 20, 95}, {"big", 4096, 123456, 17},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			seed := SessionSeed("sess-" + tt.name)
			b := make([]byte, tt.size)
			FillToken(b, seed, tt.token, tt.buf)
			if !CheckToken(b, seed, tt.token, tt.buf) {
				t.Fatal("pattern does not verify")
			}
			if CheckToken(b, seed, tt.token+1, tt.buf) && tt.size >= 8 {
				t.Fatal("pattern verifies for another token")
			}
			if CheckToken(b, seed, tt.token, tt.buf+1) && tt.size >= 8 {
				t.Fatal("pattern verifies for another buffer")
			}
			b[len(b)-1] ^= 1
			if CheckToken(b, seed, tt.token, tt.buf) {
				t.Fatal("corruption not detected")
			}
		})
	}
}
