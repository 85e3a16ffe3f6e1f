package report

import (
	"strings"
	"testing"
)

// TestEditedHistorySection: edited turns are counted with the reasons they were decided by,
// rewrites on D and verify failures, and the report shows them.
func TestEditedHistorySection(t *testing.T) {
	recs := []Record{
		{Mode: "DIRECT_TO_D", Reason: "SESSION_RESIDENT", OK: true},
		{Mode: "DIRECT_TO_D", Reason: "PREFIX_TRUNCATED", OK: true, Edit: "strip_reasoning", TruncatedTo: 1024},
		{Mode: "RESEED_PREFILL", Reason: "PREFIX_MISMATCH", OK: true, Edit: "compaction"},
		{Mode: "DIRECT_TO_D", Reason: "SESSION_RESIDENT", OK: true, Edit: "strip_reasoning", TruncatedTo: 1000},
	}
	a := Compute("E4", recs, 1)
	if a.Edited != 3 || a.Rewrites != 2 || a.EditedReasons["PREFIX_TRUNCATED"] != 1 || a.EditedReasons["PREFIX_MISMATCH"] != 1 {
		t.Fatalf("edited %d rewrites %d reasons %v", a.Edited, a.Rewrites, a.EditedReasons)
	}
	md := Markdown(Meta{}, []*Arm{a})
	if !strings.Contains(md, "## Edited history") || !strings.Contains(md, "| E4 | 3 | PREFIX_MISMATCH 1, PREFIX_TRUNCATED 1, SESSION_RESIDENT 1 | 2 | 0 |") {
		t.Fatalf("report lacks the edited-history table:\n%s", md)
	}
	if strings.Contains(Markdown(Meta{}, []*Arm{Compute("E1", recs[:1], 1)}), "## Edited history") {
		t.Fatal("an arm without edits shows the section")
	}
}

// TestPlacedOnContentSection: overlap seeds, local first turns and the prefill tokens they
// reused are counted and shown.
func TestPlacedOnContentSection(t *testing.T) {
	recs := []Record{
		{Mode: "SEED", Reason: "PREFIX_OVERLAP", OK: true},
		{Mode: "DIRECT_TO_D", Reason: "LOCAL_FIRST_TURN", OK: true, PrefixCachedTokens: 4096},
		{Mode: "DIRECT_TO_D", Reason: "LOCAL_FIRST_TURN", OK: true, PrefixCachedTokens: 2048},
		{Mode: "SEED", Reason: "NEW_SESSION", OK: true},
	}
	a := Compute("E4", recs, 1)
	if a.OverlapSeeds != 1 || a.LocalFirstTurns != 2 || a.PrefixCachedTokens != 6144 {
		t.Fatalf("overlap %d local %d saved %d", a.OverlapSeeds, a.LocalFirstTurns, a.PrefixCachedTokens)
	}
	if md := Markdown(Meta{}, []*Arm{a}); !strings.Contains(md, "| E4 | 1 | 2 | 6144 |") {
		t.Fatalf("report lacks the placement table:\n%s", md)
	}
}

// TestLargeAppendsSection: large appends are counted by where they were prefilled — the
// session's decode worker (LOCAL_LARGE_APPEND) or P (REAL_LARGE_APPEND) — with their TTFT p50
// and max in model seconds, and the section is left out when an arm has none.
func TestLargeAppendsSection(t *testing.T) {
	recs := []Record{
		{Mode: "DIRECT_TO_D", Reason: "LOCAL_LARGE_APPEND", Turn: 5, OK: true, TTFTS: 0.6},
		{Mode: "DIRECT_TO_D", Reason: "LOCAL_LARGE_APPEND", Turn: 7, OK: true, TTFTS: 1.4},
		{Mode: "DIRECT_TO_D", Reason: "LOCAL_LARGE_APPEND", Turn: 9, OK: true, TTFTS: 0.7},
		{Mode: "PD_FALLBACK", Reason: "REAL_LARGE_APPEND", Turn: 3, OK: true, TTFTS: 1.8},
		{Mode: "DIRECT_TO_D", Reason: "SESSION_RESIDENT", Turn: 2, OK: true, TTFTS: 0.1},
	}
	a := Compute("E4", recs, 2) // time scale 2: model seconds are half the measured
	if len(a.LocalAppendTTFTs) != 3 || len(a.PAppendTTFTs) != 1 {
		t.Fatalf("local %v on P %v", a.LocalAppendTTFTs, a.PAppendTTFTs)
	}
	if md := Markdown(Meta{}, []*Arm{a}); !strings.Contains(md, "| E4 | 3 | 350 ms / 700 ms | 1 | 900 ms / 900 ms |") {
		t.Fatalf("report lacks the large-append table:\n%s", md)
	}
	if strings.Contains(Markdown(Meta{}, []*Arm{Compute("SGL", recs[4:], 1)}), "## Large appends") {
		t.Fatal("an arm without large appends shows the section")
	}
}

// TestResumedMidStream: a request the gateway resumed after its decode worker died counts in the
// failures table's resumed column (a failed one does not), and an arm's gateway flags are listed.
func TestResumedMidStream(t *testing.T) {
	recs := []Record{
		{Mode: "DIRECT_TO_D", OK: true, TTFTS: 0.1, DecodeWorker: "decode-0", ResumedFrom: "decode-0", ResumedOn: "decode-3"},
		{Mode: "DIRECT_TO_D", OK: false, ErrorKind: "WORKER_ERROR", DecodeWorker: "decode-0", ResumedFrom: "decode-0"},
		{Mode: "DIRECT_TO_D", OK: true, TTFTS: 0.1},
	}
	a := Compute("E4", recs, 1)
	if a.Resumed != 1 {
		t.Fatalf("resumed %d, want 1", a.Resumed)
	}
	md := Markdown(Meta{ArmPolicies: map[string]string{"E4": "p", "SGL": "p"}, ArmGatewayArgs: map[string]string{"SGL": "--resume-mid-stream=false"}},
		[]*Arm{a, Compute("SGL", recs[2:], 1)})
	if !strings.Contains(md, "| E4 | 1 | WORKER_ERROR 1 | 0 | 0 | 1 |") || !strings.Contains(md, "| SGL | 0 | none | 0 | 0 | 0 |") {
		t.Fatalf("failures table:\n%s", md)
	}
	if !strings.Contains(md, "SGL's gateway flags: `--resume-mid-stream=false`") || strings.Contains(md, "E4's gateway flags") {
		t.Fatalf("gateway flags:\n%s", md)
	}
}
