package kvpool

import "fmt"

// The content pattern: known bytes that are a function of (token id, position, buffer) and a
// cluster key, not of the session. KV computed for the same token at the same position is
// the same bytes in every session (two sessions sharing a system prompt hold identical pages,
// as real KV of an identical prefix is), while KV reused under another prompt — the resident
// or snapshot KV of a session whose history was edited — does not verify against the new
// prompt's ids at any position where the ids differ. kvc-sim writes it when it "computes" KV
// and checks it against the ids of the request that reuses KV (docs/simulator.md).

// contentSeed mixes a token id into the key: the per-token seed of FillToken.
func contentSeed(key uint64, id uint32) uint64 {
	return splitmix(key ^ (uint64(id)+1)*0x9e3779b97f4a7c15)
}

// FillTokenContent writes the known bytes of token id at position pos in buffer into dst.
func FillTokenContent(dst []byte, key uint64, id uint32, pos int64, buffer int) {
	FillToken(dst, contentSeed(key, id), pos, buffer)
}

// CheckTokenContent reports whether src holds the known bytes of token id at position pos.
func CheckTokenContent(src []byte, key uint64, id uint32, pos int64, buffer int) bool {
	return CheckToken(src, contentSeed(key, id), pos, buffer)
}

func checkIDs(ids []uint32, from, to int64) error {
	if to > int64(len(ids)) {
		return fmt.Errorf("%w: %d token ids do not cover [%d, %d)", ErrBadSpec, len(ids), from, to)
	}
	return nil
}

// FillContent writes the content pattern of tokens [from, to) — ids[t] at position t — into
// every buffer of p; pages lists the session's pages in token order.
func FillContent(p Buffers, key uint64, ids []uint32, pages []int64, from, to int64) error {
	if err := checkIDs(ids, from, to); err != nil {
		return err
	}
	return tokenSlots(p, pages, from, to, func(slot []byte, token int64, buffer int) {
		FillTokenContent(slot, key, ids[token], token, buffer)
	})
}

// CheckContent counts the (token, buffer) slots of [from, to) that do not hold the content
// pattern of ids; 0 means every byte is the KV of exactly these ids at these positions. The
// error reports bad arguments, not mismatches.
func CheckContent(p Buffers, key uint64, ids []uint32, pages []int64, from, to int64) (mismatches int64, err error) {
	if err := checkIDs(ids, from, to); err != nil {
		return 0, err
	}
	err = tokenSlots(p, pages, from, to, func(slot []byte, token int64, buffer int) {
		if !CheckTokenContent(slot, key, ids[token], token, buffer) {
			mismatches++
		}
	})
	return mismatches, err
}
