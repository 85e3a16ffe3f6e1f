package worker

import (
	"context"
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
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

// TestDecodeStepsBesideTheRealWork: a request's decode steps run back to back on the GPU's
// clock, the real work of each token (its KV write, the stream) beside the next step, not after
// it: from the first token's real work to the last's, 10 steps of 50 ms with 45 ms of real work
// each take 9 × 50 ms, not 9 × 95 ms (before, every step waited for the previous token's real
// work first). The tokens still never come faster than the modeled steps.
func TestDecodeStepsBesideTheRealWork(t *testing.T) {
	const steps, step, work = 10, 50 * time.Millisecond, 45 * time.Millisecond
	tm := DefaultTiming()
	tm.PrefillTokensPerS, tm.PrefillOverhead, tm.DecodePerToken, tm.Scale = 1e9, 0, step, 1
	d := newTestWorker(t, newHub(), kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 4096, tm)
	var at []time.Time // when each token's real work began (the request's own goroutine)
	d.w.stepWork = func() {
		at = append(at, time.Now())
		time.Sleep(work) // the real work of a slow stream, not a wait for anything
	}
	sent := time.Now()
	res := post(t, context.Background(), d.url, body("r1", steps, true,
		kvcReq{Mode: "PD_FALLBACK", Role: "decode", InputTokens: 8, LocalPrefill: bptr(true)}))
	if res.status != 200 || len(res.chunks) != steps || len(at) != steps {
		t.Fatalf("decode: %d %s, %d chunks, %d steps", res.status, res.code, len(res.chunks), len(at))
	}
	// Never faster than the model: the last token's work begins after all steps' modeled time
	// from the request's start (each step sleeps until its end on the GPU's clock, so a late
	// wake-up of the first token cannot make this fail).
	if all := at[steps-1].Sub(sent); all < steps*step {
		t.Fatalf("%d steps ended %v after the request was sent, faster than the modeled %v", steps, all, steps*step)
	}
	took := at[steps-1].Sub(at[0])
	if limit := (steps-1)*step + (steps-1)*work/2; took > limit {
		t.Fatalf("%d steps of %v with %v of real work each took %v (> %v): the real work was charged on top of the steps", steps-1, step, work, took, limit)
	}
}
