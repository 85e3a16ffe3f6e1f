package report

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestGoodputRecoveryContinuing(t *testing.T) {
	recs := []Record{
		// s1 on decode-1 before the kill at 10 s; its next turn fails, the one after succeeds.
		{SessionID: "s1", Turn: 0, StartS: 0, LatencyS: 2, TTFTS: 1, GotTokens: 11, OK: true, Mode: "SEED", DecodeWorker: "decode-1"},
		{SessionID: "s1", Turn: 1, StartS: 12, LatencyS: 1, OK: false, Mode: "DIRECT_TO_D", ErrorKind: "REJECTED_BY_D"},
		{SessionID: "s1", Turn: 2, StartS: 14, LatencyS: 3, TTFTS: 2, GotTokens: 2, OK: true, Mode: "RESEED_SNAPSHOT", SnapshotUsed: true, Reason: "SESSION_LOST"},
		// s2 on decode-0: not affected.
		{SessionID: "s2", Turn: 0, StartS: 1, LatencyS: 1, TTFTS: .5, GotTokens: 1, OK: true, Mode: "SEED", DecodeWorker: "decode-0"},
		{SessionID: "s2", Turn: 1, StartS: 11, LatencyS: 1, TTFTS: .1, GotTokens: 1, OK: true, Mode: "DIRECT_TO_D", DecodeWorker: "decode-0"},
		// s3 on decode-1, its only later turn fails: unrecovered.
		{SessionID: "s3", Turn: 0, StartS: 2, LatencyS: 1, TTFTS: .5, GotTokens: 1, OK: true, Mode: "SEED", DecodeWorker: "decode-1"},
		{SessionID: "s3", Turn: 1, StartS: 15, LatencyS: 5, OK: false, Mode: "RESEED_PREFILL", Reason: "SNAPSHOT_STALE"},
	}
	a := ComputeWith("E4", recs, 1, Options{SLO: SLO{TTFT: 1.5, TPOT: 0.05}, Kill: &Kill{Worker: "decode-1", AtS: 10}})
	s := a.Summary
	// Span 0 → 20 s; within the SLO: s1 t0 (ttft 1, tpot .1 > .05: no), s2 t0, s2 t1, s3 t0 → 3.
	if s.GoodputRPS != round(3.0/20) {
		t.Errorf("goodput %v, want %v", s.GoodputRPS, 3.0/20)
	}
	// Continuing turns: 4, direct: 2.
	if s.DirectToDShareContinuing != .5 || s.SnapshotStale != 1 {
		t.Errorf("continuing %v stale %d", s.DirectToDShareContinuing, s.SnapshotStale)
	}
	// s1: next turn arrived at 12, first token of its first OK turn at 14+2 → 4 s.
	if s.AffectedSessions != 2 || s.Unrecovered != 1 || s.RecoveryS != 4 || s.RecoveryTTFTP50 != 2 {
		t.Errorf("recovery %+v", s)
	}
	if b := Compute("E4", recs, 1).Summary; b.RecoveryS != 0 || b.AffectedSessions != 0 || b.GoodputRPS != round(5.0/20) {
		t.Errorf("no options: %+v", b)
	}
}

func TestBaselineChecks(t *testing.T) {
	mk := func(name string, p99, good, rec float64, affected int, hit float64) *Arm {
		return &Arm{Name: name, Summary: Summary{TTFTP99: p99, GoodputRPS: good, RecoveryS: rec, AffectedSessions: affected, SnapshotHitRate: hit, ReseedCount: 10}}
	}
	arms := []*Arm{mk("PD", 3, 1, 5, 2, 0), mk("SGL", 2, 1.5, 4, 2, 0), mk("LLMD", 2.5, 1.2, 0, 0, 0), mk("E4", 1, 2, 1.5, 3, .95)}
	got := baselineChecks(arms, true)
	want := []string{"met", "met", "met", "met", "met"}
	if len(got) != len(want) {
		t.Fatalf("%d checks: %v", len(got), got)
	}
	for i := range want {
		if got[i][2] != want[i] {
			t.Errorf("check %q: %q (%s)", got[i][0], got[i][2], got[i][1])
		}
	}
	// The best recovery is SGL's 4 s (LLMD lost no session); 2.5 s is above half of it.
	arms[3].Summary.RecoveryS = 2.5
	arms[3].Summary.GoodputRPS = 1.7 // < 1.2 × 1.5
	got = baselineChecks(arms, true)
	if !strings.Contains(got[1][2], "missed") || !strings.Contains(got[2][2], "missed") || !strings.Contains(got[2][1], "SGL") {
		t.Errorf("%v", got)
	}
	if baselineChecks(arms[3:], true) != nil {
		t.Error("checks without a baseline")
	}
	if c := baselineChecks(arms, false); !strings.Contains(c[2][1], "not measured") {
		t.Errorf("%v", c[2])
	}
}

func TestWriteSweep(t *testing.T) {
	dir := t.TempDir()
	pts := []SweepPoint{
		{Load: 1, Sessions: 10, SessionsPS: .33, Arms: map[string]Summary{"PD": {GoodputRPS: 1, TTFTP50: .5, TTFTP99: 2}, "E4": {GoodputRPS: 1.1, TTFTP50: .1, TTFTP99: 1}}},
		{Load: 2, Sessions: 20, SessionsPS: .66, Arms: map[string]Summary{"PD": {GoodputRPS: 1.2, TTFTP50: 1, TTFTP99: 6}, "E4": {GoodputRPS: 2, TTFTP50: .1, TTFTP99: 1.5}}, Aborted: "x"},
	}
	if err := WriteSweep(dir, SLO{TTFT: 2, TPOT: .05}, []string{"PD", "E4"}, pts); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{SweepFile, SweepReport, GoodputPlot, TTFTP50LoadPlot, TTFTP99LoadPlot} {
		if _, err := readFile(dir, f); err != nil {
			t.Error(err)
		}
	}
	md, _ := readFile(dir, SweepReport)
	if !strings.Contains(md, "| 2 | 20 | 0.660 | E4 | 0 / 0 | 2.000 |") || !strings.Contains(md, "Load 2 stopped early: x") {
		t.Errorf("sweep.md:\n%s", md)
	}
}

func readFile(dir, name string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, name))
	return string(b), err
}
