package report

import (
	"testing"
)

func TestPercentile(t *testing.T) {
	tests := []struct {
		vals []float64
		q    float64
		want float64
	}{
		{nil, .5, 0},
		{[]float64{1}, .99, 1},
		{[]float64{1, 2, 3, 4}, .5, 2},
		{[]float64{1, 2, 3, 4}, .75, 3},
		{[]float64{1, 2, 3, 4}, 1, 4},
	}
	for _, tt := range tests {
		if got := Percentile(tt.vals, tt.q); got != tt.want {
			t.Fatalf("Percentile(%v, %v) = %v, want %v", tt.vals, tt.q, got, tt.want)
		}
	}
}

func TestCompute(t *testing.T) {
	recs := []Record{
		{Mode: "SEED", OK: true, TTFTS: 1, LatencyS: 2, ReceivedBytes: 100, VerifiedBytes: 100},
		{Mode: "DIRECT_TO_D", OK: true, TTFTS: .04, LatencyS: .5},
		{Mode: "DIRECT_TO_D", OK: true, TTFTS: .05, LatencyS: .6},
		{Mode: "RESEED_SNAPSHOT", SnapshotUsed: true, OK: true, TTFTS: .2, LatencyS: .7, ReceivedBytes: 50, VerifiedBytes: 50},
		{Mode: "RESEED_PREFILL", OK: true, TTFTS: 2, LatencyS: 3, ReceivedBytes: 70, VerifiedBytes: 70},
		{Mode: "DIRECT_TO_D", OK: false, ErrorKind: "REJECTED_BY_D", LatencyS: .01},
		{Mode: "SEED", OK: false, ErrorKind: "TRANSFER_FAILED", ErrorCode: "kv_verify_failed", LatencyS: .3},
	}
	a := Compute("E4", recs, 1)
	s := a.Summary
	if s.OK != 5 || s.Total != 7 || s.ReseedCount != 2 || s.SnapshotHitRate != .5 || s.BytesMoved != 220 || s.KVVerifyFailures != 1 {
		t.Fatalf("%+v", s)
	}
	// TTFTs with the failures at the time they failed: .01 .04 .05 .2 .3 1 2.
	if s.DirectToDShare != round(3.0/7) || s.TTFTP50 != .2 || s.TTFTP90 != 2 || s.TTFTP99 != 2 || s.ReseedTTFTP50 != .2 {
		t.Fatalf("%+v", s)
	}
	if half := Compute("E4", recs, 0.5); half.Summary.TTFTP99 != 4 || half.Summary.LatencyP50 != 2*s.LatencyP50 {
		t.Fatalf("scaled %+v", half.Summary)
	}
	loaded := Compute("E4", []Record{
		{Mode: "PD_FALLBACK", Reason: "REAL_LARGE_APPEND", OK: true, InputTokens: 1000, PrefillLoadedTokens: 640, UncachedTokens: 360},
		{Mode: "RESEED_PREFILL", OK: true, InputTokens: 500},
		{Mode: "DIRECT_TO_D", OK: true, InputTokens: 800, CachedTokens: 700, UncachedTokens: 100},
	}, 1)
	if loaded.PrefillTokens != 1500 || loaded.PrefillLoadedTokens != 640 || loaded.AppendTokens != 100 {
		t.Fatalf("prefill %d loaded %d append %d", loaded.PrefillTokens, loaded.PrefillLoadedTokens, loaded.AppendTokens)
	}
	if a.PrefillTokens != 0 || a.ErrorKinds["REJECTED_BY_D"] != 1 || a.Modes["SEED"].Count != 2 || a.Modes["SEED"].OK != 1 {
		t.Fatalf("%+v %+v", a.ErrorKinds, a.Modes["SEED"])
	}
}

// TestPercentilesCountFailures: a failed request enters every TTFT and latency percentile at
// the time it failed and is an SLO miss, so an arm that fails its slow requests does not look
// faster than one that serves them.
func TestPercentilesCountFailures(t *testing.T) {
	served := []Record{
		{Turn: 0, OK: true, TTFTS: 1, LatencyS: 1.5, GotTokens: 2},
		{Turn: 1, OK: true, TTFTS: .1, LatencyS: .2, GotTokens: 2},
		{Turn: 2, OK: true, TTFTS: .1, LatencyS: .2, GotTokens: 2},
		{Turn: 3, OK: true, TTFTS: 5, LatencyS: 5.1, GotTokens: 2, Mode: "RESEED_PREFILL"},
	}
	failed := append([]Record(nil), served...)
	// The slow turn times out at 8 s instead; a mid-stream failure enters at its end, not its first token.
	failed[3] = Record{Turn: 3, OK: false, ErrorKind: "TIMEOUT", LatencyS: 8, Mode: "RESEED_PREFILL"}
	failed = append(failed, Record{Turn: 4, OK: false, ErrorKind: "WORKER_ERROR", TTFTS: .05, LatencyS: 3})
	slo := Options{SLO: SLO{TTFT: 2, TPOT: 1}}
	tests := []struct {
		name                         string
		recs                         []Record
		ok, total, met               int
		p99, p99Cont, latP99, reseed float64
		att                          float64
	}{
		{"all served", served, 4, 4, 3, 5, 5, 5.1, 5, .75},
		{"slow turn failed, one more broke mid-stream", failed, 3, 5, 3, 8, 8, 8, 8, .6},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := ComputeWith("X", tt.recs, 1, slo).Summary
			if s.OK != tt.ok || s.Total != tt.total || s.SLOMet != tt.met || s.SLOAttainment != tt.att {
				t.Errorf("ok %d/%d met %d attainment %v; want %d/%d %d %v", s.OK, s.Total, s.SLOMet, s.SLOAttainment, tt.ok, tt.total, tt.met, tt.att)
			}
			if s.TTFTP99 != tt.p99 || s.TTFTP99Continuing != tt.p99Cont || s.LatencyP99 != tt.latP99 || s.ReseedTTFTP50 != tt.reseed {
				t.Errorf("p99 %v continuing %v latency %v reseed p50 %v; want %v %v %v %v", s.TTFTP99, s.TTFTP99Continuing, s.LatencyP99, s.ReseedTTFTP50,
					tt.p99, tt.p99Cont, tt.latP99, tt.reseed)
			}
		})
	}
	// Continuing turns only: the first turn's 1 s is not in it.
	if s := Compute("X", served[:3], 1).Summary; s.TTFTP99Continuing != .1 || s.TTFTP99 != 1 {
		t.Errorf("continuing %v all %v", s.TTFTP99Continuing, s.TTFTP99)
	}
}

// TestSetNodes: busy seconds are divided by the time scale, link bytes kept, P's prefix-cache
// hit rate is the served tokens over the prompt tokens of every prefill worker.
func TestSetNodes(t *testing.T) {
	var s Summary
	s.SetNodes(NodeFigures{PrefillBusyS: map[string]float64{"prefill-0": 3}, DecodeBusyS: map[string]float64{"decode-0": .6},
		LinkBytes:           map[string]LinkBytes{"decode-0": {In: 10, Out: 2}},
		PrefillPromptTokens: map[string]int64{"prefill-0": 300, "prefill-1": 100}, PrefillCacheHitTokens: map[string]int64{"prefill-0": 90, "prefill-1": 10}}, .3)
	if s.PrefillBusyS["prefill-0"] != 10 || s.DecodeBusyS["decode-0"] != 2 || s.LinkBytes["decode-0"].In != 10 {
		t.Fatalf("%+v", s)
	}
	if s.PrefillPromptTokens != 400 || s.PrefillCacheHitTokens != 100 || s.PrefillCacheHitRate != .25 {
		t.Fatalf("prefill cache: %d of %d, rate %v", s.PrefillCacheHitTokens, s.PrefillPromptTokens, s.PrefillCacheHitRate)
	}
	s.SetNodes(NodeFigures{}, 1) // nothing prefilled: no rate
	if s.PrefillCacheHitRate != 0 || s.PrefillPromptTokens != 0 {
		t.Fatalf("empty: %+v", s)
	}
}
