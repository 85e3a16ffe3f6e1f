package rdma

// SetSendTuning lets benchmarks try other sender arena and copy thresholds.
func SetSendTuning(arena, copyMax int) {
	if arena > 0 {
		sendArena = arena
	}
	if copyMax >= 0 {
		sendCopyMax = copyMax
	}
}
