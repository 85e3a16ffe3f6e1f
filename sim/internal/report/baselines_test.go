package report

import (
	"encoding/json"
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

// Recovery counts the sessions the death touched, the same way whatever an arm keeps where,
// and what it cost them beyond their usual TTFT.
func TestRecovery(t *testing.T) {
	const kill = 10.0
	// s: a session with two continuing turns before the kill (usual TTFT .2 s) on worker w.
	before := func(s, w string) []Record {
		return []Record{
			{SessionID: s, Turn: 0, StartS: 0, LatencyS: 1, TTFTS: .9, OK: true, DecodeWorker: w},
			{SessionID: s, Turn: 1, StartS: 2, LatencyS: 1, TTFTS: .2, OK: true, DecodeWorker: w},
			{SessionID: s, Turn: 2, StartS: 5, LatencyS: 1, TTFTS: .2, OK: true, DecodeWorker: w},
		}
	}
	tests := []struct {
		name                      string
		recs                      []Record
		affected, unrecovered     int
		recovery, excess, ttftP50 float64
	}{
		{"untouched", append(before("a", "decode-0"),
			Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 1, TTFTS: 5, OK: true, DecodeWorker: "decode-0"}),
			0, 0, 0, 0, 0},
		{"state on the killed worker, next turn reseeds", append(before("a", "decode-1"),
			Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 1, TTFTS: .5, OK: true, DecodeWorker: "decode-2"}),
			1, 0, .5, .3, .5},
		{"next turn at its usual speed: no excess", append(before("a", "decode-1"),
			Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 1, TTFTS: .15, OK: true, DecodeWorker: "decode-2"}),
			1, 0, .15, 0, .15},
		{"a failed turn extends it to the next one", append(before("a", "decode-1"),
			Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 1, OK: false, DecodeWorker: "decode-1"},
			Record{SessionID: "a", Turn: 4, StartS: 13, LatencyS: 1, TTFTS: 1, OK: true, DecodeWorker: "decode-2"}),
			1, 0, 3, 2.8, 1},
		{"in flight at the kill, rescued by the gateway's retry", append(before("a", "decode-0"),
			Record{SessionID: "a", Turn: 3, StartS: 9.5, LatencyS: 2, TTFTS: 1.5, OK: true, DecodeWorker: "decode-2", RetriedFrom: []string{"decode-1"}},
			Record{SessionID: "a", Turn: 4, StartS: 13, LatencyS: 1, TTFTS: .2, OK: true, DecodeWorker: "decode-2"}),
			1, 0, 1.5, 1.3, 1.5},
		{"a retry before the kill is not the death's", append(before("a", "decode-0"),
			Record{SessionID: "a", Turn: 3, StartS: 7, LatencyS: 1, TTFTS: .5, OK: true, DecodeWorker: "decode-2", RetriedFrom: []string{"decode-1"}},
			Record{SessionID: "a", Turn: 4, StartS: 13, LatencyS: 1, TTFTS: .2, OK: true, DecodeWorker: "decode-2"}),
			0, 0, 0, 0, 0},
		{"routed to the killed worker after the kill", append(before("a", "decode-0"),
			Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 1, TTFTS: .1, OK: true, DecodeWorker: "decode-0"},
			Record{SessionID: "a", Turn: 4, StartS: 13, LatencyS: 1, TTFTS: .7, OK: true, DecodeWorker: "decode-3", RetriedFrom: []string{"decode-1"}}),
			1, 0, .7, .5, .7},
		{"no successful turn after the kill", append(before("a", "decode-1"),
			Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 1, OK: false}),
			1, 1, 0, 0, 0},
		{"no turn after the kill: nothing to serve again", before("a", "decode-1"), 0, 0, 0, 0, 0},
		{"a session without continuing turns before the kill uses the arm's usual TTFT", append(before("b", "decode-0"),
			Record{SessionID: "a", Turn: 0, StartS: 1, LatencyS: 1, TTFTS: .9, OK: true, DecodeWorker: "decode-1"},
			Record{SessionID: "a", Turn: 1, StartS: 12, LatencyS: 1, TTFTS: .6, OK: true, DecodeWorker: "decode-0"}),
			1, 0, .6, .4, .6},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := ComputeWith("X", tt.recs, 1, Options{Kill: &Kill{Worker: "decode-1", AtS: kill}}).Summary
			if s.AffectedSessions != tt.affected || s.Unrecovered != tt.unrecovered || s.RecoveryS != round(tt.recovery) ||
				s.RecoveryExcessS != round(tt.excess) || s.RecoveryTTFTP50 != round(tt.ttftP50) {
				t.Errorf("affected %d unrecovered %d recovery %v excess %v ttft p50 %v; want %d %d %v %v %v",
					s.AffectedSessions, s.Unrecovered, s.RecoveryS, s.RecoveryExcessS, s.RecoveryTTFTP50,
					tt.affected, tt.unrecovered, tt.recovery, tt.excess, tt.ttftP50)
			}
		})
	}
	// Divided like every other time: measured seconds ÷ the time scale.
	recs := append(before("a", "decode-1"), Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 1, TTFTS: .5, OK: true})
	if s := ComputeWith("X", recs, .5, Options{Kill: &Kill{Worker: "decode-1", AtS: kill}}).Summary; s.RecoveryS != 1 || s.RecoveryExcessS != round(.6) {
		t.Errorf("scaled: recovery %v excess %v", s.RecoveryS, s.RecoveryExcessS)
	}
}

func TestBaselineChecks(t *testing.T) {
	mk := func(name string, p99, good, excess float64, affected int, hit float64) *Arm {
		return &Arm{Name: name, Summary: Summary{TTFTP99: p99, GoodputRPS: good, RecoveryS: excess + .2, RecoveryExcessS: excess,
			AffectedSessions: affected, SnapshotHitRate: hit, ReseedCount: 10}}
	}
	tests := []struct {
		name string
		arms []*Arm
		want []string // p99, continuing p99, goodput, recovery, hit rate, verify
		rec  string   // in the recovery row's text
	}{
		{"every target met", []*Arm{mk("PD", 3, 1, 5, 2, 0), mk("SGL", 2, 1.5, 4, 2, 0), mk("LLMD", 2.5, 1.2, 3, 1, 0), mk("E4", 1, 2, 1.5, 3, .95)},
			[]string{"met", "met", "met", "met", "met", "met"}, "(LLMD, 1 affected sessions)"},
		{"goodput and recovery missed", []*Arm{mk("PD", 3, 1, 5, 2, 0), mk("SGL", 2, 1.5, 4, 2, 0), mk("LLMD", 2.5, 1.2, 3, 1, 0), mk("E4", 1, 1.7, 2, 3, .95)},
			[]string{"met", "met", "**missed**", "**missed**", "met", "met"}, "(LLMD,"},
		// A baseline the death did not touch lost nothing: its excess is 0 and it is the best.
		{"a baseline with no affected session", []*Arm{mk("PD", 3, 1, 5, 2, 0), mk("SGL", 2, 1.5, 0, 0, 0), mk("E4", 1, 2, .1, 3, .95)},
			[]string{"met", "met", "met", "**missed**", "met", "met"}, "(SGL, 0 affected sessions)"},
		{"hit rate missed", []*Arm{mk("SGL", 2, 1.5, .4, 2, 0), mk("E4", 1, 2, .1, 3, .8)},
			[]string{"met", "met", "met", "met", "**missed**", "met"}, "(SGL,"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := baselineChecks(tt.arms, true)
			if len(got) != len(tt.want) {
				t.Fatalf("%d checks: %v", len(got), got)
			}
			for i := range tt.want {
				if got[i][2] != tt.want[i] {
					t.Errorf("check %q: %q (%s)", got[i][0], got[i][2], got[i][1])
				}
			}
			if !strings.Contains(got[3][1], tt.rec) {
				t.Errorf("recovery row %q, want %q in it", got[3][1], tt.rec)
			}
		})
	}
	arms := []*Arm{mk("SGL", 2, 1.5, .4, 2, 0), mk("E4", 1, 2, .1, 3, .95)}
	if baselineChecks(arms[1:], true) != nil {
		t.Error("checks without a baseline")
	}
	if c := baselineChecks(arms, false); !strings.Contains(c[3][1], "not measured") {
		t.Errorf("%v", c[3])
	}
}

func TestWriteSweep(t *testing.T) {
	dir := t.TempDir()
	pts := []SweepPoint{
		{Load: 1, Sessions: 10, SessionsPS: .33, Arms: map[string]Summary{"PD": {GoodputRPS: 1, TTFTP50: .5, TTFTP99: 2, Total: 10, SLOMet: 10, SLOAttainment: 1}, "E4": {GoodputRPS: 1.1, TTFTP50: .1, TTFTP99: 1, Total: 10, SLOMet: 10, SLOAttainment: 1}}},
		{Load: 2, Sessions: 20, SessionsPS: .66, Arms: map[string]Summary{"PD": {GoodputRPS: 1.2, TTFTP50: 1, TTFTP99: 6, Total: 10, SLOMet: 8, SLOAttainment: .8}, "E4": {GoodputRPS: 2, TTFTP50: .1, TTFTP99: 1.5, TTFTP99Continuing: .4, Total: 10, SLOMet: 10, SLOAttainment: 1}}, Aborted: "x"},
	}
	shapes := []SweepShape{{Name: "1P3D", Points: pts}, {Name: "2P4D@700000", DecodeCapacityTokens: 700000, Points: pts[:1]}}
	if err := WriteSweep(dir, SLO{TTFT: 2, TPOT: .05}, []string{"PD", "E4"}, shapes); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{SweepFile, SweepReport, "1P3D/" + GoodputPlot, "1P3D/" + TTFTP50LoadPlot, "2P4D@700000/" + TTFTP99LoadPlot} {
		if _, err := readFile(dir, f); err != nil {
			t.Error(err)
		}
	}
	md, _ := readFile(dir, SweepReport)
	if !strings.Contains(md, "| 2 | 20 | 0.660 | E4 | 0 / 10 | 10 (100.0%) | 2.000 |") || !strings.Contains(md, "Load 2 stopped early: x") ||
		!strings.Contains(md, "| 1P3D | 1.50 | ≥ 2 |") || !strings.Contains(md, "| 2P4D@700000 | ≥ 1 | ≥ 1 |") {
		t.Errorf("sweep.md:\n%s", md)
	}
	raw, _ := readFile(dir, SweepFile)
	var got struct {
		Points []map[string]any
		SLO    map[string]map[string]float64 `json:"slo_capacity"`
	}
	if err := json.Unmarshal([]byte(raw), &got); err != nil {
		t.Fatal(err)
	}
	// One object per shape, load and arm, with the fields the issue names.
	if len(got.Points) != 6 {
		t.Fatalf("%d points: %s", len(got.Points), raw)
	}
	for _, k := range []string{"shape", "load", "sessions", "arm", "goodput_rps", "ttft_p99_s", "ttft_p99_continuing_s"} {
		if _, ok := got.Points[0][k]; !ok {
			t.Errorf("point lacks %q: %v", k, got.Points[0])
		}
	}
	if p := got.Points[3]; p["shape"] != "1P3D" || p["arm"] != "E4" || p["load"] != 2.0 || p["ttft_p99_continuing_s"] != .4 {
		t.Errorf("point 3: %v", p)
	}
	if got.SLO["1P3D"]["PD"] != 1.5 || got.SLO["1P3D"]["E4"] != 2 || got.SLO["2P4D@700000"]["PD"] != 1 {
		t.Errorf("slo_capacity %v", got.SLO)
	}
}

// TestSLOCapacity: the highest load meeting the attainment, interpolated toward the next one.
func TestSLOCapacity(t *testing.T) {
	tests := []struct {
		name       string
		loads, att []float64
		want       float64
		bound      string
	}{
		{"between two loads", []float64{1, 2, 4}, []float64{1, .95, .85}, 3, CapInterpolated},
		{"exactly at a load", []float64{1, 2, 4}, []float64{1, .9, .5}, 2, CapInterpolated},
		{"unsorted input", []float64{4, 1, 2}, []float64{.85, 1, .95}, 3, CapInterpolated},
		{"every load meets it: a lower bound", []float64{.5, 1}, []float64{1, .99}, 1, CapAtLeast},
		{"no load meets it", []float64{1, 2}, []float64{.5, .2}, 0, CapBelowLowest},
		{"a dip then recovery: the highest meeting load counts", []float64{1, 2, 3, 4}, []float64{.95, .8, .92, .6}, 3.0625, CapInterpolated},
		{"one point met", []float64{2}, []float64{.9}, 2, CapAtLeast},
		{"none", nil, nil, 0, CapBelowLowest},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, bound := SLOCapacity(tt.loads, tt.att, .9)
			if got != tt.want || bound != tt.bound {
				t.Fatalf("SLOCapacity = %v %s, want %v %s", got, bound, tt.want, tt.bound)
			}
		})
	}
}

// TestWriteShapes: summary.json has one entry per shape holding every arm, and report.md shows
// every shape with its own targets and plots.
func TestWriteShapes(t *testing.T) {
	dir := t.TempDir()
	recs := []Record{{Mode: "SEED", OK: true, TTFTS: 1, LatencyS: 2}, {Turn: 1, Mode: "DIRECT_TO_D", OK: true, TTFTS: .1, LatencyS: .3}}
	mk := func(name string) *Arm { return ComputeWith(name, recs, 1, Options{SLO: SLO{TTFT: 2}}) }
	killed := mk("E4")
	killed.Summary.SetNodes(NodeFigures{WastedKVFallbacks: 3}, 1)
	killed.Summary.SetKill(KillTarget{Worker: "decode-2", Sessions: 5, Resident: 7})
	runs := []ShapeRun{
		{Name: "1P3D", Meta: Meta{Shape: "1P3D", Targets: Targets{GoodputRatio: 1.2, Why: "prefill-bound"}, KillWorker: "most", TimeDiv: 1,
			ArmKills: map[string]float64{"E4": 45}}, Arms: []*Arm{mk("SGL"), killed}},
		{Name: "2P4D", Meta: Meta{Shape: "2P4D", Targets: Targets{GoodputRatio: 1, Why: "balanced"}}, Arms: []*Arm{mk("SGL"), mk("E4")}},
	}
	if err := WriteShapes(dir, runs); err != nil {
		t.Fatal(err)
	}
	raw, _ := readFile(dir, SummaryFile)
	var sum map[string]map[string]Summary
	if err := json.Unmarshal([]byte(raw), &sum); err != nil {
		t.Fatal(err)
	}
	if len(sum) != 2 || len(sum["1P3D"]) != 2 || len(sum["2P4D"]) != 2 || sum["2P4D"]["E4"].TTFTP99Continuing != .1 {
		t.Fatalf("summary.json: %s", raw)
	}
	if e := sum["1P3D"]["E4"]; e.WastedKVFallbacks != 3 || e.KilledWorker != "decode-2" || e.KilledWorkerSessions != 5 || e.KilledWorkerResident != 7 {
		t.Fatalf("summary.json: 1P3D E4 wasted-KV fallbacks %d, killed %s (%d sessions, %d resident)", e.WastedKVFallbacks, e.KilledWorker, e.KilledWorkerSessions, e.KilledWorkerResident)
	}
	md, _ := readFile(dir, ReportFile)
	for _, want := range []string{"## kvc-bench report: 1P3D", "## kvc-bench report: 2P4D", "### Targets against the baselines on 1P3D",
		"1.2 × the best baseline's (prefill-bound)", "1 × the best baseline's (balanced)", "](2P4D/ttft_cdf.png)", "| 2P4D | E4 | 2 / 2 |",
		"| decode-2 (5) | 0 ms | 3 |", "| 3 | 0.0 MiB | 45.00 s | decode-2 (5 / 7) |", "the decode worker holding the most sessions at that moment"} {
		if !strings.Contains(md, want) {
			t.Errorf("report.md lacks %q", want)
		}
	}
}

func readFile(dir, name string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, name))
	return string(b), err
}

// The paired excess subtracts the same (session, turn) request's TTFT in the arm's replay
// without the kill: a turn expensive in both runs costs the death ~nothing, one slow only in
// the kill run costs the difference, one with no successful counterpart falls back to the usual.
func TestRecoveryPaired(t *testing.T) {
	const kill = 10.0
	// a's usual TTFT is .2 s (two continuing turns before the kill on decode-1).
	before := []Record{
		{SessionID: "a", Turn: 0, StartS: 0, LatencyS: 1, TTFTS: .9, OK: true, DecodeWorker: "decode-1"},
		{SessionID: "a", Turn: 1, StartS: 2, LatencyS: 1, TTFTS: .2, OK: true, DecodeWorker: "decode-1"},
		{SessionID: "a", Turn: 2, StartS: 5, LatencyS: 1, TTFTS: .2, OK: true, DecodeWorker: "decode-1"},
	}
	with := func(rs ...Record) []Record { return append(append([]Record(nil), before...), rs...) }
	tests := []struct {
		name           string
		kill, control  []Record
		excess, paired float64
		fallbacks      int
	}{
		{"expensive in both runs: no paired excess",
			with(Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 2, TTFTS: 1.3, OK: true, DecodeWorker: "decode-2"}),
			with(Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 2, TTFTS: 1.25, OK: true, DecodeWorker: "decode-1"}),
			1.1, .05, 0},
		{"slow only in the kill run: the difference",
			with(Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 2, TTFTS: 1.3, OK: true, DecodeWorker: "decode-2"}),
			with(Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 1, TTFTS: .3, OK: true, DecodeWorker: "decode-1"}),
			1.1, 1, 0},
		{"faster than the control: at least 0",
			with(Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 1, TTFTS: .3, OK: true, DecodeWorker: "decode-2"}),
			with(Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 1, TTFTS: .4, OK: true, DecodeWorker: "decode-1"}),
			.1, 0, 0},
		{"a failed turn: the first successful one's counterpart, from the touched one's start",
			with(Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 1, OK: false, DecodeWorker: "decode-1"},
				Record{SessionID: "a", Turn: 4, StartS: 13, LatencyS: 1, TTFTS: 1, OK: true, DecodeWorker: "decode-2"}),
			with(Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 1, TTFTS: .2, OK: true, DecodeWorker: "decode-1"},
				Record{SessionID: "a", Turn: 4, StartS: 13, LatencyS: 1, TTFTS: .9, OK: true, DecodeWorker: "decode-1"}),
			2.8, 2.1, 0},
		{"no successful counterpart: the usual TTFT, counted",
			with(Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 2, TTFTS: 1.3, OK: true, DecodeWorker: "decode-2"}),
			with(Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 1, OK: false, DecodeWorker: "decode-1"}),
			1.1, 1.1, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := ComputeWith("X", tt.kill, 1, Options{Kill: &Kill{Worker: "decode-1", AtS: kill}, Control: tt.control}).Summary
			if s.AffectedSessions != 1 || !s.RecoveryControl || s.RecoveryExcessS != round(tt.excess) ||
				s.RecoveryExcessPairedS != round(tt.paired) || s.RecoveryPairedFallbacks != tt.fallbacks {
				t.Errorf("affected %d control %v excess %v paired %v fallbacks %d; want 1 true %v %v %d", s.AffectedSessions,
					s.RecoveryControl, s.RecoveryExcessS, s.RecoveryExcessPairedS, s.RecoveryPairedFallbacks, tt.excess, tt.paired, tt.fallbacks)
			}
			// Without a control run the paired figure is not measured and the excess is unchanged.
			u := ComputeWith("X", tt.kill, 1, Options{Kill: &Kill{Worker: "decode-1", AtS: kill}}).Summary
			if u.RecoveryControl || u.RecoveryExcessPairedS != 0 || u.RecoveryExcessS != s.RecoveryExcessS {
				t.Errorf("no control: %v %v %v", u.RecoveryControl, u.RecoveryExcessPairedS, u.RecoveryExcessS)
			}
		})
	}
	// Divided like every other time.
	k := with(Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 2, TTFTS: 1.3, OK: true, DecodeWorker: "decode-2"})
	c := with(Record{SessionID: "a", Turn: 3, StartS: 11, LatencyS: 1, TTFTS: .3, OK: true, DecodeWorker: "decode-1"})
	if s := ComputeWith("X", k, .5, Options{Kill: &Kill{Worker: "decode-1", AtS: kill}, Control: c}).Summary; s.RecoveryExcessPairedS != 2 {
		t.Errorf("scaled: paired %v", s.RecoveryExcessPairedS)
	}
}
