package worker

import (
	"context"
	"sync"
	"time"
)

// prefillChunkTokens is the chunk a decode worker's GPU prefills between decode steps (SGLang's
// --chunked-prefill-size, 8192 by default on large GPUs).
const prefillChunkTokens = 8192

// decodeGPU is a decode worker's one GPU, shared by its running decode batch and the
// (append-)prefills it runs itself (direct-to-D turns, reseed tails, local first turns and
// fallbacks). Decode steps of different requests run together (a batch: TPOT is independent of
// the batch size) and take it shared; a prefill takes it alone, one chunk at a time, so a decode
// step that falls due during a chunk waits for the chunk's end (SGLang's scheduler runs a
// prefill batch, then a decode batch), and concurrent prefills queue.
type decodeGPU struct {
	mu sync.RWMutex
}

// gpuPrefill models the prefill of n tokens on the decode worker's GPU: Prefill(n) in all,
// split into chunks of prefillChunkTokens, each holding the GPU alone.
func (w *Worker) gpuPrefill(ctx context.Context, n int64) error {
	total := w.cfg.Timing.Prefill(n)
	chunks := max(1, (n+prefillChunkTokens-1)/prefillChunkTokens)
	per := total / time.Duration(chunks)
	for i := int64(0); i < chunks; i++ {
		d := per
		if i == chunks-1 {
			d = total - per*time.Duration(chunks-1)
		}
		w.gpu.mu.Lock()
		t0 := time.Now()
		err := sleepCtx(ctx, d)
		w.m.prefillBusy.Add(time.Since(t0).Seconds())
		w.gpu.mu.Unlock()
		if err != nil {
			return err
		}
	}
	return nil
}

// gpuDecodeStep models one decode step of a request in the running batch.
func (w *Worker) gpuDecodeStep(ctx context.Context) error {
	w.gpu.mu.RLock()
	defer w.gpu.mu.RUnlock()
	return sleepCtx(ctx, w.cfg.Timing.Decode())
}
