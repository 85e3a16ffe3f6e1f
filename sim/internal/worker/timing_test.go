package worker

import (
	"testing"
	"time"
)

// The defaults must reproduce the seeds' figures (DESIGN §1, V2_DEEP_ANALYSIS §3/§4).
func TestDefaultTimingMatchesSeeds(t *testing.T) {
	tm := DefaultTiming()
	if err := tm.Validate(); err != nil {
		t.Fatal(err)
	}
	within := func(name string, got, lo, hi time.Duration) {
		t.Helper()
		if got < lo || got > hi {
			t.Errorf("%s = %v, want in [%v, %v]", name, got, lo, hi)
		}
	}
	// direct-to-D: ~341 uncached tokens append + first token → TTFT p50 41 ms.
	within("direct-to-D TTFT (341 tokens)", tm.Prefill(341)+tm.Decode(), 35*time.Millisecond, 47*time.Millisecond)
	// reseed re-prefill of ~30K-60K tokens: 1.5-3 s.
	within("re-prefill 30K", tm.Prefill(30000), 1400*time.Millisecond, 1700*time.Millisecond)
	within("re-prefill 60K", tm.Prefill(60000), 2800*time.Millisecond, 3100*time.Millisecond)
	// transfer of a 50K-token session over one 200 Gb/s NIC: ~200 ms (200-400 ms in the seeds).
	within("transfer 50K", tm.Transfer(50000), 190*time.Millisecond, 210*time.Millisecond)
	// TPOT p50 5.56 ms.
	within("decode", tm.Decode(), 5500*time.Microsecond, 5700*time.Microsecond)
}

func TestTimingScaleAndValidate(t *testing.T) {
	tm := DefaultTiming()
	tm.Scale = 0.1
	if got, want := tm.Prefill(20000), 101500*time.Microsecond; got != want {
		t.Fatalf("scaled prefill = %v, want %v", got, want)
	}
	if tm.Transfer(0) != 0 || tm.Transfer(-5) != 0 {
		t.Fatal("no tokens must cost no transfer time")
	}
	bad := []func(*Timing){
		func(t *Timing) { t.PrefillTokensPerS = 0 },
		func(t *Timing) { t.LinkGbps = -1 },
		func(t *Timing) { t.ModelBytesPerToken = 0 },
		func(t *Timing) { t.Scale = -1 },
		func(t *Timing) { t.DecodePerToken = -1 },
	}
	for i, f := range bad {
		x := DefaultTiming()
		f(&x)
		if x.Validate() == nil {
			t.Errorf("case %d: want error", i)
		}
	}
}
