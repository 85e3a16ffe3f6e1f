package report

import (
	"strings"
	"testing"
)

// TestRecomputeCounts: refworker exactness mismatches are counted per mode and per arm, and
// report.md shows the table only when some request was checked.
func TestRecomputeCounts(t *testing.T) {
	recs := []Record{
		{Mode: "SEED", OK: true, RecomputeChecked: true, MaxAbsLogitDiff: 1e-7},
		{Mode: "RESEED_SNAPSHOT", OK: true, RecomputeChecked: true, RecomputeMismatches: 2, MaxAbsLogitDiff: 0.3, MaxAbsKVDiff: 0.5},
		{Mode: "RESEED_SNAPSHOT", OK: true, RecomputeChecked: true, MaxAbsLogitDiff: 0.1},
		{Mode: "DIRECT_TO_D", OK: false},
	}
	a := Compute("E4", recs, 1)
	for _, tc := range []struct {
		mode    string
		checked int
		mism    int64
		maxDiff float64
	}{
		{"SEED", 1, 0, 1e-7}, {"RESEED_SNAPSHOT", 2, 2, 0.3}, {"DIRECT_TO_D", 0, 0, 0},
	} {
		m := a.Modes[tc.mode]
		if m.RecomputeChecked != tc.checked || m.RecomputeMismatches != tc.mism || m.MaxAbsLogitDiff != tc.maxDiff {
			t.Errorf("%s: %+v", tc.mode, m)
		}
	}
	if a.RecomputeChecked != 3 || a.RecomputeMismatches != 2 {
		t.Fatalf("arm: %d checked, %d mismatches", a.RecomputeChecked, a.RecomputeMismatches)
	}
	md := Markdown(Meta{}, []*Arm{a})
	if !strings.Contains(md, "## Exactness against recompute") || !strings.Contains(md, "| E4 | RESEED_SNAPSHOT | 2 | 2 | 0.3 | 0.5 |") ||
		!strings.Contains(md, "| E4 | **all** | 3 | **2** | | |") {
		t.Fatalf("report.md lacks the recompute table:\n%s", md)
	}
	if md := Markdown(Meta{}, []*Arm{Compute("E1", recs[3:], 1)}); strings.Contains(md, "Exactness against recompute") {
		t.Fatal("recompute table without any checked request")
	}
}
