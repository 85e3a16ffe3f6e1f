package worker

import (
	"context"
	"fmt"
	"math"
	"time"
)

// Timing is the latency model. Defaults (DefaultTiming) are calibrated to the H100/H200
// measurements of Qwen3-30B-A3B in the seeds (docs/simulator.md shows the arithmetic).
type Timing struct {
	// PrefillTokensPerS is the prefill throughput for uncached tokens.
	PrefillTokensPerS float64
	// PrefillOverhead is the fixed cost of one prefill (or append-prefill) forward pass.
	PrefillOverhead time.Duration
	// DecodePerToken is the time per output token (TPOT).
	DecodePerToken time.Duration
	// LinkGbps is the KV transfer link bandwidth in gigabits per second.
	LinkGbps float64
	// ModelBytesPerToken is the real model's KV bytes per token (all layers, K and V).
	ModelBytesPerToken int64
	// Scale multiplies every modeled duration (1 = real time; 0.1 = ten times faster).
	Scale float64
}

// DefaultTiming: Qwen3-30B-A3B bf16 on one H100/H200, one 200 Gb/s RDMA NIC.
func DefaultTiming() Timing {
	return Timing{
		PrefillTokensPerS:  20000,
		PrefillOverhead:    15 * time.Millisecond,
		DecodePerToken:     5600 * time.Microsecond,
		LinkGbps:           200,
		ModelBytesPerToken: 98304,
		Scale:              1,
	}
}

// Validate checks the model's parameters.
func (t Timing) Validate() error {
	switch {
	case !(t.PrefillTokensPerS > 0) || math.IsInf(t.PrefillTokensPerS, 0):
		return fmt.Errorf("prefill tokens per second must be > 0, got %v", t.PrefillTokensPerS)
	case t.PrefillOverhead < 0:
		return fmt.Errorf("prefill overhead must be >= 0, got %v", t.PrefillOverhead)
	case t.DecodePerToken < 0:
		return fmt.Errorf("decode time per token must be >= 0, got %v", t.DecodePerToken)
	case !(t.LinkGbps > 0) || math.IsInf(t.LinkGbps, 0):
		return fmt.Errorf("link bandwidth must be > 0 Gb/s, got %v", t.LinkGbps)
	case t.ModelBytesPerToken <= 0:
		return fmt.Errorf("model bytes per token must be > 0, got %d", t.ModelBytesPerToken)
	case !(t.Scale >= 0) || math.IsInf(t.Scale, 0):
		return fmt.Errorf("time scale must be >= 0, got %v", t.Scale)
	}
	return nil
}

func (t Timing) scaled(d time.Duration) time.Duration {
	return time.Duration(float64(d) * t.Scale)
}

// Prefill is the modeled time of one (append-)prefill pass over tokens uncached tokens.
func (t Timing) Prefill(tokens int64) time.Duration {
	if tokens < 0 {
		tokens = 0
	}
	d := t.PrefillOverhead + time.Duration(float64(tokens)/t.PrefillTokensPerS*float64(time.Second))
	return t.scaled(d)
}

// Decode is the modeled time of one decode step (one output token).
func (t Timing) Decode() time.Duration { return t.scaled(t.DecodePerToken) }

// Transfer is the modeled time to move tokens tokens of the real model's KV over the link.
func (t Timing) Transfer(tokens int64) time.Duration {
	if tokens <= 0 {
		return 0
	}
	bytesPerS := t.LinkGbps * 1e9 / 8
	return t.scaled(time.Duration(float64(tokens) * float64(t.ModelBytesPerToken) / bytesPerS * float64(time.Second)))
}

// sleepCtx sleeps d or until ctx is done.
func sleepCtx(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
