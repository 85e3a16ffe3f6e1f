package policy

// A session's KV generation (SessionRecord.generation) names one residency of its KV: every
// seed, reseed and truncation gives the session a new one, and every copy of its KV (a decode
// worker's, a prefill store's snapshot) is tagged with the generation it belongs to. Ordering
// decides between copies: a decode worker's resync of an older generation than the record's
// is stale (state.staleCopyLocked), a push of an older generation than the stored snapshot's
// is refused (GENERATION_STALE).
//
// Generations are therefore monotonic across leaders, not only within one: a new leader loads
// the records from etcd, written behind, so it may not know the last generation its
// predecessor gave a session (etcd restarted, or the journal's last interval never reached
// it), while a decode worker that was away still holds that copy. Each leader makes its
// generations in its own range:
//
//	generation = term << GenerationTermBits | n
//
// term is the leader's generation term, a durable counter every new leader advances in etcd
// before it serves (kvstore.Store.NextGenerationTerm), and n counts within the term. The
// first new generation a leader gives a session is term << GenerationTermBits, above every
// generation an earlier leader made (as long as no session took 2^GenerationTermBits
// generations in one term), so the acknowledged residency of this leader wins over any copy
// of an earlier one. Term 0 (not leading, or a fake cluster in tests) numbers generations
// g + 1. Generations stay below 2^53 (exact as JSON numbers, in Python and JavaScript alike)
// for MaxGenerationTerm terms. docs/decisions.md, "Generations".
const GenerationTermBits = 24

// MaxGenerationTerm is the last term whose generations stay below 2^53. A leader refuses to
// serve on a later one (state.LeadTerm; kvstore.Store.NextGenerationTerm's limit).
const MaxGenerationTerm = 1<<(53-GenerationTermBits) - 1

// MaxGeneration is the highest generation: 2^53 - 1, exact as a JSON number everywhere.
const MaxGeneration = 1<<53 - 1

// NextGeneration is the generation a session of generation g takes with a new residency made
// under generation term term. It cannot overflow: it saturates at MaxGeneration (g at or above
// it, or a term past MaxGenerationTerm, which no leader serves on; sidecars' claims above the
// generations issued are refused, state/claims.go), so a generation never wraps to a small one.
func NextGeneration(g, term uint64) uint64 {
	if g >= MaxGeneration || term > MaxGenerationTerm {
		return MaxGeneration
	}
	return min(max(g+1, term<<GenerationTermBits), MaxGeneration)
}

// GenerationTerm is the generation term generation g was made in.
func GenerationTerm(g uint64) uint64 { return g >> GenerationTermBits }
