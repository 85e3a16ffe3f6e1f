package workload

import "hash/fnv"

// Token ids of a session's context, as a client that keeps its conversation sends them
// (kvc-bench --send-ids): the history it holds (earlier contexts and the answers' output_ids),
// edited as the turn says, then new tokens. New tokens are a deterministic function of
// (session, position) in [0, vocab); the first SharedPrefix positions of a session of a
// SharedGroup are a function of the group instead (the shared system prompt).

// idSeed is the seed of the new tokens of key (a session or a shared group).
func idSeed(key string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(key))
	return h.Sum64()
}

// newID is the token at position i of key's new tokens.
func newID(seed uint64, i, vocab int64) int64 {
	z := seed + uint64(i+1)*0x9E3779B97F4A7C15
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	z ^= z >> 31
	return int64(z % uint64(vocab))
}

// ContextIDs is turn k's input_ids given hist, the conversation the client holds after turn
// k-1 (its context and the answer's output_ids; nil before the first turn): hist edited as the
// turn says, then cut or extended with new tokens to the turn's input length.
func (s *Session) ContextIDs(hist []int64, k int, vocab int64) []int64 {
	if vocab <= 0 {
		vocab = 1000
	}
	t := s.Turns[k]
	if e := t.Edit; e != nil && e.At <= int64(len(hist)) {
		end := min(e.At+e.Remove, int64(len(hist)))
		edited := make([]int64, 0, int64(len(hist))-(end-e.At)+e.Insert)
		edited = append(edited, hist[:e.At]...)
		seed := idSeed(s.ID + "/edit")
		for i := int64(0); i < e.Insert; i++ {
			edited = append(edited, newID(seed, int64(k)<<32|i, vocab))
		}
		hist = append(edited, hist[end:]...)
	}
	n := t.InputTokens
	if int64(len(hist)) >= n {
		return append([]int64(nil), hist[:n]...)
	}
	out := make([]int64, len(hist), n)
	copy(out, hist)
	seed, gseed := idSeed(s.ID), idSeed(s.SharedGroup)
	for i := int64(len(hist)); i < n; i++ {
		if i < s.SharedPrefix {
			out = append(out, newID(gseed, i, vocab))
		} else {
			out = append(out, newID(seed, i, vocab))
		}
	}
	return out
}
