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
		{Mode: "DIRECT_TO_D", OK: false, ErrorKind: "REJECTED_BY_D"},
		{Mode: "SEED", OK: false, ErrorKind: "TRANSFER_FAILED", ErrorCode: "kv_verify_failed"},
	}
	a := Compute("E4", recs, 1)
	s := a.Summary
	if s.OK != 5 || s.Total != 7 || s.ReseedCount != 2 || s.SnapshotHitRate != .5 || s.BytesMoved != 220 || s.KVVerifyFailures != 1 {
		t.Fatalf("%+v", s)
	}
	if s.DirectToDShare != round(3.0/7) || s.TTFTP50 != .2 || s.TTFTP99 != 2 || s.ReseedTTFTP50 != .2 {
		t.Fatalf("%+v", s)
	}
	if half := Compute("E4", recs, 0.5); half.Summary.TTFTP99 != 4 || half.Summary.LatencyP50 != 2*s.LatencyP50 {
		t.Fatalf("scaled %+v", half.Summary)
	}
	if a.PrefillTokens != 0 || a.ErrorKinds["REJECTED_BY_D"] != 1 || a.Modes["SEED"].Count != 2 || a.Modes["SEED"].OK != 1 {
		t.Fatalf("%+v %+v", a.ErrorKinds, a.Modes["SEED"])
	}
}
