package rdma

// SetSendTuning lets benchmarks try other send arena and inline sizes.
func SetSendTuning(arena, inline int) {
	if arena > 0 {
		sendArena = arena
	}
	if inline > 0 {
		sendInline = inline
	}
}
