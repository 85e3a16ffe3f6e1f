package kvpool

import (
	"encoding/binary"
	"hash/fnv"
)

// SessionSeed is the per-session seed of the known-bytes pattern.
func SessionSeed(sessionID string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(sessionID))
	return h.Sum64()
}

func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// FillToken writes the known bytes of (session, token position, buffer index) into dst, which is
// that token's slot in that buffer (bytes per token per buffer long). Workers (kvc-sim) write it
// when they "compute" KV; receivers verify it with CheckToken, so every transferred byte is
// checked.
func FillToken(dst []byte, seed uint64, token int64, buffer int) {
	x := splitmix(seed ^ uint64(token)*0x100000001b3 ^ uint64(buffer)<<48)
	i := 0
	for ; i+8 <= len(dst); i += 8 {
		x = splitmix(x)
		binary.LittleEndian.PutUint64(dst[i:], x)
	}
	if i < len(dst) {
		x = splitmix(x)
		var tail [8]byte
		binary.LittleEndian.PutUint64(tail[:], x)
		copy(dst[i:], tail[:])
	}
}

// CheckToken reports whether src holds the known bytes of (session, token, buffer).
func CheckToken(src []byte, seed uint64, token int64, buffer int) bool {
	x := splitmix(seed ^ uint64(token)*0x100000001b3 ^ uint64(buffer)<<48)
	i := 0
	for ; i+8 <= len(src); i += 8 {
		x = splitmix(x)
		if binary.LittleEndian.Uint64(src[i:]) != x {
			return false
		}
	}
	if i < len(src) {
		x = splitmix(x)
		var tail [8]byte
		binary.LittleEndian.PutUint64(tail[:], x)
		for j := i; j < len(src); j++ {
			if src[j] != tail[j-i] {
				return false
			}
		}
	}
	return true
}
