package worker

import (
	"context"
	"testing"
	"time"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// A decode worker reports its unevictable tokens to its sidecar (ReportDemandRequest, issue 20):
// the committed KV of the sessions a request is using, in either eviction mode; idle sessions
// are not in it (the engine's LRU or the sidecar's release frees them), so with every request
// done the last report says 0 although the pool holds both sessions.
func TestDecodeReportsUnevictableTokens(t *testing.T) {
	for _, watermark := range []bool{false, true} {
		t.Run(map[bool]string{false: "lru", true: "watermark"}[watermark], func(t *testing.T) {
			h := newHub()
			p := newTestWorker(t, h, kvcv1.WorkerRole_WORKER_ROLE_PREFILL, "p0", 4096, zeroTiming())
			// a's direct turn decodes 4 tokens of 50 ms: its pin lasts long enough for a report
			// to see it (reports go out off the request's path, kickReport)
			slow := zeroTiming()
			slow.Scale, slow.DecodePerToken, slow.PrefillTokensPerS, slow.PrefillOverhead, slow.LinkGbps = 1, 50*time.Millisecond, 1e12, 0, 1e9
			d := newTestWorkerCfg(t, h, kvcv1.WorkerRole_WORKER_ROLE_DECODE, "d0", 256, slow, 10*time.Second)
			d.w.cfg.EvictOnlyByRelease = watermark
			for i, s := range []string{"a", "b"} {
				if _, dr := pd(t, p, d, s, 4, kvcReq{Mode: "SEED", SessionID: s, InputTokens: 40, Room: i64(int64(i + 1))}); dr.status != 200 {
					t.Fatalf("seed %s: %d %s", s, dr.status, dr.code)
				}
			}
			kv := sessionsOf(t, d)["a"].KVLen
			last := func() *kvcv1.ReportDemandRequest {
				r := d.sc.demandReports()
				if len(r) == 0 {
					return nil
				}
				return r[len(r)-1]
			}
			// A seed's KV is its own reservation's until its outcome: the seeds pinned nothing.
			// Their last report (running_requests back to 0) comes off their path: waited for.
			waitFor(t, func() bool { return last().GetRunningRequests() == 0 })
			before := len(d.sc.demandReports())
			for _, r := range d.sc.demandReports() {
				if r.GetUnevictableTokens() != 0 {
					t.Fatalf("report %v during the seeds", r)
				}
			}
			// A direct turn of a: while it runs, a's committed KV is unevictable.
			dr := post(t, context.Background(), d.url, body("a-1", 4, false,
				kvcReq{Mode: "DIRECT_TO_D", Role: "decode", SessionID: "a", InputTokens: kv + 8, CachedTokens: kv, Keep: bptr(true)}))
			if dr.status != 200 {
				t.Fatalf("direct turn: %d %s", dr.status, dr.code)
			}
			waitFor(t, func() bool {
				l := last()
				return len(d.sc.demandReports()) > before && l.GetUnevictableTokens() == 0 && l.GetRunningRequests() == 0
			})
			var peak int64
			for _, r := range d.sc.demandReports()[before:] {
				peak = max(peak, r.GetUnevictableTokens())
				if r.GetWaitingRequests() != 0 {
					t.Fatalf("report %v: nothing waited", r)
				}
			}
			// a was pinned with its kv tokens; what the turn added (8 + 4) is the control plane's
			// reservation, not counted; b stayed idle.
			if peak != kv {
				t.Fatalf("peak unevictable %d during a's turn; want a's KV before it, %d (b idle)", peak, kv)
			}
		})
	}
}

// unevictableLocked: a session a request uses counts its committed KV; one whose only requests
// wait in the prealloc queue of a worker that never evicts does not (the release may take it);
// an idle one never.
func TestUnevictableLocked(t *testing.T) {
	tests := []struct {
		name            string
		releaseOnly     bool
		pinned, waiting int
		want            int64
	}{
		{"idle", false, 0, 0, 0},
		{"running", false, 1, 0, 100},
		{"lru: waiting pins", false, 1, 1, 100},
		{"release-only: waiting does not pin", true, 1, 1, 0},
		{"release-only: running and waiting", true, 2, 1, 100},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := &Worker{cfg: Config{EvictOnlyByRelease: tt.releaseOnly}, sessions: map[string]*session{
				"s":    {id: "s", kvLen: 100, base: 100, pinned: tt.pinned, waiting: tt.waiting},
				"seed": {id: "seed", kvLen: 80, pinned: 1}, // created by its running request: its KV is the request's reservation
				"idle": {id: "idle", kvLen: 50},
			}}
			if got := w.unevictableLocked(); got != tt.want {
				t.Fatalf("unevictable %d, want %d", got, tt.want)
			}
		})
	}
}
