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
// split into chunks of prefillChunkTokens, each holding the GPU alone. It returns how long its
// chunks waited for the GPU (a decode step or another request's chunk held it).
func (w *Worker) gpuPrefill(ctx context.Context, n int64) (time.Duration, error) {
	total := w.cfg.Timing.Prefill(n)
	chunks := max(1, (n+prefillChunkTokens-1)/prefillChunkTokens)
	per := total / time.Duration(chunks)
	var wait time.Duration
	for i := int64(0); i < chunks; i++ {
		d := per
		if i == chunks-1 {
			d = total - per*time.Duration(chunks-1)
		}
		tw := time.Now()
		w.gpu.mu.Lock()
		t0 := time.Now()
		wait += t0.Sub(tw)
		err := sleepCtx(ctx, d)
		w.m.prefillBusy.Add(time.Since(t0).Seconds())
		w.gpu.mu.Unlock()
		if err != nil {
			return wait, err
		}
	}
	return wait, nil
}

// gpuDecodeStep models one decode step of a request in the running batch, the one after the
// step that ended at prev (the zero time: the first), and returns when it ends. The steps run
// back to back on the GPU's clock: a step starts when the previous one ended, not after the
// real work the request did since (writing its token's KV, streaming the token: in SGLang the
// detokenizer and the HTTP stream run beside the next forward), unless a prefill chunk held
// the GPU meanwhile, when it starts at the chunk's end. Paced after the real work instead, each
// step added that work's wall time (3.3x at time scale 0.3, more under CPU contention) to the
// modeled step: at 1P3D load 7 on 2 cores at time scale 0.3 a reseed's 80 decode steps took
// 0.76 model-s where at time scale 1 they took 0.55. A request whose real work falls behind
// catches up without sleeping, so its tokens never come faster than the modeled steps on
// average. wait (may be nil) gets the time the step waited for a prefill chunk.
func (w *Worker) gpuDecodeStep(ctx context.Context, prev time.Time, wait *time.Duration) (time.Time, error) {
	start := prev
	if !w.gpu.mu.TryRLock() {
		tw := time.Now()
		w.gpu.mu.RLock() // a prefill chunk holds the GPU: the step starts when it ends
		start = time.Now()
		if wait != nil {
			*wait += start.Sub(tw)
		}
	}
	defer w.gpu.mu.RUnlock()
	if start.IsZero() {
		start = time.Now()
	}
	end := start.Add(w.cfg.Timing.Decode())
	return end, sleepCtx(ctx, time.Until(end))
}
