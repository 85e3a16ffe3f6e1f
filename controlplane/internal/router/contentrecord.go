package router

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/kvcentric/kvcentric/pkg/pagehash"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// A session's compact chain in its record (SessionRecord.content_chain), so that a new leader
// keeps appending to resident sessions on content after a failover (issue 16 finding 7):
//
//	version byte 1 | uvarint len(decode) | decode | uvarint kv_len | uvarint page_size |
//	uvarint generation | pagehash.Sparse encoding
//
// The header names what the chain describes: a new leader uses it only when the record still
// names that decode worker, committed length and KV generation (a journal entry or a sidecar resync may have
// moved kv_committed_len on without the chain, e.g. a turn whose outcome carried no hashes).
// About 30 bytes plus the Sparse: ~720 bytes for 32K tokens in 64-token pages.

const chainVersion = 1

// errChain is the class of content_chain values loadChain refuses.
var errChain = errors.New("router: invalid content chain")

// encodeChain is e's value for SessionRecord.content_chain.
func encodeChain(e *contentEntry) []byte {
	sp, err := e.chain.MarshalBinary()
	if err != nil {
		return nil
	}
	b := make([]byte, 0, 1+binary.MaxVarintLen64*4+len(e.decode)+len(sp))
	b = append(b, chainVersion)
	b = binary.AppendUvarint(b, uint64(len(e.decode)))
	b = append(b, e.decode...)
	b = binary.AppendUvarint(b, uint64(e.kvLen))
	b = binary.AppendUvarint(b, uint64(e.pageSize))
	b = binary.AppendUvarint(b, e.gen)
	return append(b, sp...)
}

// decodeChain parses encodeChain's output; anything else is an errChain.
func decodeChain(b []byte) (*contentEntry, error) {
	bad := func(why string) (*contentEntry, error) { return nil, fmt.Errorf("%w: %s", errChain, why) }
	if len(b) == 0 || b[0] != chainVersion {
		return bad("unknown version")
	}
	b = b[1:]
	n, k := binary.Uvarint(b)
	if k <= 0 || n > kvcv1.MaxIDLen || uint64(len(b)-k) < n {
		return bad("decode worker")
	}
	decode := string(b[k : k+int(n)])
	b = b[k+int(n):]
	var vals [3]uint64
	for i := range vals {
		v, k := binary.Uvarint(b)
		if k <= 0 {
			return bad("truncated header")
		}
		vals[i], b = v, b[k:]
	}
	kvLen, pageSize, gen := vals[0], vals[1], vals[2]
	if decode == "" || kvLen == 0 || kvLen > 1<<50 || pageSize == 0 || pageSize > maxPageSize {
		return bad("header out of range")
	}
	sp := new(pagehash.Sparse)
	if err := sp.UnmarshalBinary(b); err != nil {
		return nil, fmt.Errorf("%w: %w", errChain, err)
	}
	if uint64(sp.Pages()) > kvLen/pageSize {
		return bad("more pages than the KV length holds")
	}
	return &contentEntry{decode: decode, kvLen: int64(kvLen), pageSize: int64(pageSize), gen: gen, chain: sp}, nil
}

// loadChain gives the content entry a new leader learns from rec's content_chain: nil unless
// it decodes and describes rec's residency (decode worker, committed length, KV generation:
// a reseed or truncation since it was written bumped the generation). Its pages do not
// go into the prefix index (a Sparse holds only some of the first pages, and the index needs
// all of them), and it has no snapshot anchors (not persisted: the session's next commit
// brings them back).
func loadChain(rec *kvcv1.SessionRecord) *contentEntry {
	if rec == nil || len(rec.ContentChain) == 0 || rec.DecodeWorker == "" {
		return nil
	}
	e, err := decodeChain(rec.ContentChain)
	if err != nil || e.decode != rec.DecodeWorker || e.kvLen != rec.KvCommittedLen || e.gen != rec.Generation {
		return nil
	}
	return e
}
