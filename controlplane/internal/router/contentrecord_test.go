package router

import (
	"errors"
	"fmt"
	"testing"

	"github.com/kvcentric/kvcentric/pkg/pagehash"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// chainOf is the content entry a session of kvLen tokens on decode would have (ids 1..kvLen).
func chainOf(t testing.TB, decode string, pageSize, kvLen int64, gen uint64) *contentEntry {
	t.Helper()
	h, err := pagehash.New(int(pageSize), 0)
	if err != nil {
		t.Fatal(err)
	}
	cs := newContentStore()
	e := cs.record("s", decode, pageSize, h.Chain(idsN(int(kvLen), 1)), nil, kvLen, gen)
	if e == nil {
		t.Fatal("not recorded")
	}
	return e
}

// TestContentChainEncoding: the record's value round-trips, its size is what docs/routing.md
// states (the etcd cost per session), and loadChain uses it only for the record's residency.
func TestContentChainEncoding(t *testing.T) {
	for _, tc := range []struct {
		pageSize, kvLen int64
		maxBytes        int
	}{
		{64, 32_768, 500},   // 47 hashes: the 32 pages of the last 2,048 tokens, every 32nd before
		{16, 32_768, 1_800}, // 188 hashes: a 128-page tail
		{64, 131_072, 950},  // 95 hashes
		{64, 100, 40},       // one page
	} {
		t.Run(fmt.Sprintf("page %d kv %d", tc.pageSize, tc.kvLen), func(t *testing.T) {
			e := chainOf(t, "decode-7", tc.pageSize, tc.kvLen, 3)
			b := encodeChain(e)
			t.Logf("%d hashes, %d bytes", e.chain.Len(), len(b))
			if len(b) > tc.maxBytes {
				t.Fatalf("%d bytes, more than %d", len(b), tc.maxBytes)
			}
			got, err := decodeChain(b)
			if err != nil {
				t.Fatal(err)
			}
			if got.decode != e.decode || got.kvLen != e.kvLen || got.pageSize != e.pageSize || got.gen != e.gen ||
				got.chain.Pages() != e.chain.Pages() || got.chain.Len() != e.chain.Len() {
				t.Fatalf("decoded %+v, want %+v", got, e)
			}
			h, _ := pagehash.New(int(tc.pageSize), 0)
			longer := h.Chain(idsN(int(tc.kvLen)+500, 1))
			if !got.chain.IsPrefixOf(longer) {
				t.Fatal("decoded chain is not a prefix of its own continuation")
			}
		})
	}

	e := chainOf(t, "d1", 16, 1_290, 2)
	rec := &kvcv1.SessionRecord{SessionId: "s", DecodeWorker: "d1", KvCommittedLen: 1_290, Generation: 2, ContentChain: encodeChain(e)}
	if loadChain(rec) == nil {
		t.Fatal("the record's own residency: not loaded")
	}
	for _, tc := range []struct {
		name string
		mod  func(r *kvcv1.SessionRecord)
	}{
		{"other decode worker", func(r *kvcv1.SessionRecord) { r.DecodeWorker = "d2" }},
		{"not resident", func(r *kvcv1.SessionRecord) { r.DecodeWorker = "" }},
		{"longer KV", func(r *kvcv1.SessionRecord) { r.KvCommittedLen += 16 }},
		{"new generation", func(r *kvcv1.SessionRecord) { r.Generation++ }},
		{"no chain", func(r *kvcv1.SessionRecord) { r.ContentChain = nil }},
		{"corrupt", func(r *kvcv1.SessionRecord) { r.ContentChain = r.ContentChain[:len(r.ContentChain)-3] }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := &kvcv1.SessionRecord{SessionId: rec.SessionId, DecodeWorker: rec.DecodeWorker, KvCommittedLen: rec.KvCommittedLen,
				Generation: rec.Generation, ContentChain: rec.ContentChain}
			tc.mod(r)
			if loadChain(r) != nil {
				t.Fatal("loaded")
			}
		})
	}
}

func TestDecodeChainRefuses(t *testing.T) {
	good := encodeChain(chainOf(t, "d1", 16, 320, 1))
	for _, tc := range []struct {
		name string
		b    []byte
	}{
		{"empty", nil},
		{"version", append([]byte{2}, good[1:]...)},
		{"truncated header", good[:4]},
		{"no sparse", good[:1+1+2+2+1+1]},
		{"zero page size", []byte{1, 1, 'd', 64, 0, 0, 1}},
		{"page size too large", []byte{1, 1, 'd', 64, 0x81, 0x40, 0, 1}},
		{"no decode worker", []byte{1, 0, 64, 16, 0, 1}},
		{"decode longer than the value", []byte{1, 9, 'd'}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := decodeChain(tc.b); !errors.Is(err, errChain) {
				t.Fatalf("err %v, want errChain", err)
			}
		})
	}
	// More pages than the KV length holds: a chain of 320 tokens claimed for 160.
	e := chainOf(t, "d1", 16, 320, 1)
	e.kvLen = 160
	if _, err := decodeChain(encodeChain(e)); !errors.Is(err, errChain) {
		t.Fatalf("err %v, want errChain", err)
	}
}

// FuzzDecodeChain: decodeChain never panics, refuses with errChain, and what it accepts
// re-encodes to a value that decodes to the same entry.
func FuzzDecodeChain(f *testing.F) {
	f.Add(encodeChain(chainOf(f, "d1", 16, 1_290, 2)))
	f.Add(encodeChain(chainOf(f, "decode-0", 64, 32_768, 9)))
	f.Add([]byte{1, 1, 'd', 64, 16, 0})
	f.Fuzz(func(t *testing.T, b []byte) {
		e, err := decodeChain(b)
		if err != nil {
			if !errors.Is(err, errChain) {
				t.Fatalf("err %v is not errChain", err)
			}
			return
		}
		if e.pageSize <= 0 || e.pageSize > maxPageSize || e.kvLen <= 0 || int64(e.chain.Pages()) > e.kvLen/e.pageSize || e.decode == "" {
			t.Fatalf("accepted %+v", e)
		}
		again, err := decodeChain(encodeChain(e))
		if err != nil || again.decode != e.decode || again.kvLen != e.kvLen || again.gen != e.gen || again.chain.Pages() != e.chain.Pages() {
			t.Fatalf("re-encoded: %+v, %v", again, err)
		}
	})
}
