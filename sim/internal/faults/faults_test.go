package faults

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestFaults is `make test-faults`: the whole cluster as real processes under session load,
// every selected fault injected in turn, each checked (recovery bound, failed requests,
// linearizability of the residency history, duplicates). KVC_FAULTS selects the scenarios:
// "ci" (the CI subset), "all", or a comma list of names; unset skips the test (it needs
// KVC_BIN_DIR with the built binaries). KVC_FAULTS_OUT keeps logs and results.json there.
func TestFaults(t *testing.T) {
	sel := os.Getenv("KVC_FAULTS")
	if sel == "" {
		t.Skip("set KVC_FAULTS=ci|all|NAME,... and KVC_BIN_DIR (make test-faults)")
	}
	bin := os.Getenv("KVC_BIN_DIR")
	if bin == "" {
		t.Fatal("KVC_BIN_DIR must name the directory of the built binaries (make build)")
	}
	var picked []Scenario
	names := map[string]bool{}
	for _, n := range strings.Split(sel, ",") {
		names[strings.TrimSpace(n)] = true
	}
	for _, sc := range Scenarios() {
		if names["all"] || (names["ci"] && sc.CI) || names[sc.Name] {
			picked = append(picked, sc)
		}
	}
	if len(picked) == 0 {
		t.Fatalf("KVC_FAULTS=%q selects no scenario", sel)
	}
	work := os.Getenv("KVC_FAULTS_OUT")
	if work == "" {
		work = t.TempDir()
	}
	work = filepath.Join(work, time.Now().UTC().Format("20060102-150405"))
	ctx := t.Context()
	h, err := Start(t, ctx, Config{BinDir: bin, WorkDir: work, Log: os.Stdout})
	if err != nil {
		t.Fatalf("cluster: %v (logs in %s)", err, work)
	}
	load := NewLoad(LoadConfig{URL: h.GWURL, KeyPerClient: true})
	r := NewRunner(h, load, RunConfig{Out: os.Stdout})
	var all []Outcome
	base, err := r.Baseline(ctx, 4*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	all = append(all, base)
	var rec, lost, dup, failed int
	maxRec := 0.0
	var bad []string
	for _, sc := range picked {
		o, err := r.Run(ctx, sc)
		if err != nil {
			t.Fatalf("%s: %v", sc.Name, err)
		}
		all = append(all, o)
		if o.Recovered {
			rec++
		}
		lost += o.Lost
		dup += o.Duplicated
		failed += o.Failed
		maxRec = max(maxRec, o.Recovery)
		if !o.Passed {
			bad = append(bad, o.Name)
		}
	}
	if b, err := json.MarshalIndent(all, "", "  "); err == nil {
		_ = os.WriteFile(filepath.Join(work, "results.json"), b, 0o644)
	}
	fmt.Printf("logs and results.json in %s\n", work)
	if !base.Passed {
		t.Errorf("baseline (no fault) failed: %d failed requests, lost %d, duplicated %d", base.Failed, base.Lost, base.Duplicated)
	}
	if len(bad) > 0 {
		t.Errorf("scenarios not passed: %s (failed requests %d in all)", strings.Join(bad, ", "), failed)
	}
	fmt.Printf("faults: %d scenarios, recovered %d, lost %d, duplicated %d, max recovery %.1f s\n", len(picked), rec, lost, dup, maxRec)
}
