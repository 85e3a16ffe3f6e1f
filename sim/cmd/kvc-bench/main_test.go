package main

import (
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvcentric/kvcentric/sim/internal/report"
)

func TestParseFlags(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		wantErr string
	}{
		{"local default", []string{"--local"}, ""},
		{"url one arm", []string{"--gateway-url", "http://x:1", "--arms", "prod"}, ""},
		{"neither", nil, "exactly one of --local and --gateway-url"},
		{"both", []string{"--local", "--gateway-url", "http://x"}, "exactly one"},
		{"bad url", []string{"--gateway-url", "x:1", "--arms", "a"}, "not an http(s) URL"},
		{"url many arms", []string{"--gateway-url", "http://x"}, "runs one arm"},
		{"bad arm", []string{"--local", "--arms", "E1,E9"}, "unknown arm"},
		{"mooncake without trace", []string{"--local", "--workload", "mooncake"}, "needs --trace"},
		{"bad workload", []string{"--local", "--workload", "other"}, "want builtin or mooncake"},
		{"bad scale", []string{"--local", "--time-scale", "0"}, "time-scale"},
		{"bad bytes", []string{"--local", "--bytes-per-token-per-buffer", "0"}, "bytes-per-token-per-buffer"},
		{"unknown flag", []string{"--nope"}, "not defined"},
		{"shapes", []string{"--local", "--shapes", "1P3D,2P4D", "--kill-decode", "decode-1"}, ""},
		{"bad shape", []string{"--local", "--shapes", "1P3D,2X4D"}, `shape "2X4D": want <P>P<D>D`},
		{"shape out of range", []string{"--local", "--shapes", "0P3D"}, "must be in [1, 16]"},
		{"shape pool out of range", []string{"--local", "--shapes", "2P4D@5"}, "decode pool must be in"},
		{"shape twice", []string{"--local", "--shapes", "2P4D,2P4D"}, "given twice"},
		{"empty shapes", []string{"--local", "--shapes", ","}, "no shape given"},
		{"shapes without local", []string{"--gateway-url", "http://x:1", "--arms", "a", "--shapes", "1P3D"}, "--shapes needs --local"},
		{"kill most", []string{"--local", "--shapes", "1P3D,2P4D", "--kill-decode", "most"}, ""},
		{"kill bad name", []string{"--local", "--kill-decode", "mostly"}, `want most or decode-N`},
		{"kill beyond a shape", []string{"--local", "--shapes", "1P3D,2P4D", "--kill-decode", "decode-3"}, "below shape 1P3D's decode workers 3"},
		{"kill after requests", []string{"--local", "--kill-decode", "decode-0", "--kill-after-requests", "4"}, ""},
		{"kill after requests negative", []string{"--local", "--kill-decode", "decode-0", "--kill-after-requests", "-1"}, "--kill-after-requests -1 must be >= 0"},
		{"kill after requests without a kill", []string{"--local", "--kill-after-requests", "4"}, "--kill-after-requests needs --kill-decode"},
		{"kill after requests with a delay", []string{"--local", "--kill-decode", "decode-0", "--kill-after-requests", "4", "--kill-delay", "10s"}, ""},
		{"kill delay negative", []string{"--local", "--kill-decode", "decode-0", "--kill-after-requests", "4", "--kill-delay", "-1s"}, "--kill-delay -1s must be >= 0"},
		{"kill delay without the trigger", []string{"--local", "--kill-decode", "decode-0", "--kill-delay", "10s"}, "--kill-delay needs --kill-after-requests"},
		{"kill after requests and kill at", []string{"--local", "--kill-decode", "decode-0", "--kill-after-requests", "4", "--kill-at", "30s"}, "exclude each other"},
		{"recovery control", []string{"--local", "--kill-decode", "most", "--recovery-control"}, ""},
		{"recovery control without a kill", []string{"--local", "--recovery-control"}, "--recovery-control needs --kill-decode"},
		{"sweep", []string{"--local", "--sweep", "0.5,1"}, ""},
		{"sweep per shape", []string{"--local", "--sweep", "1P3D=0.5,1,2,3;2P4D=1,2,4,6;2P4D@700K=2"}, ""},
		{"sweep load zero", []string{"--local", "--sweep", "0,1"}, `load "0": want a number in (0, 100]`},
		{"sweep load too high", []string{"--local", "--sweep", "1P3D=1,500"}, `shape 1P3D: load "500"`},
		{"sweep load twice", []string{"--local", "--sweep", "1,2,1"}, "load 1 given twice"},
		{"sweep bad shape", []string{"--local", "--sweep", "1P3D=1;3Q=2"}, `shape "3Q"`},
		{"sweep group without loads", []string{"--local", "--sweep", "1P3D=1;2P4D"}, "want SHAPE=LOADS"},
		{"sweep per shape and --shapes", []string{"--local", "--sweep", "1P3D=1", "--shapes", "2P4D"}, "leave out --shapes"},
		{"sweep without local", []string{"--gateway-url", "http://x:1", "--arms", "a", "--sweep", "1"}, "--sweep needs --local"},
		{"sweep kill beyond a shape", []string{"--local", "--sweep", "1P3D=1;2P4D=2", "--kill-decode", "decode-3"}, "below shape 1P3D's"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o, err := parse(tt.args, io.Discard)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				if o.simTimeScale != o.timeScale {
					t.Fatalf("sim time scale %v follows --time-scale %v", o.simTimeScale, o.timeScale)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("err = %v, want %q", err, tt.wantErr)
			}
		})
	}
}

func TestRunExitCodes(t *testing.T) {
	var b strings.Builder
	if rc := run([]string{"--bogus"}, &b); rc != 2 {
		t.Fatalf("rc %d", rc)
	}
	// A sweep or shape flag out of range exits 2 with the reason (before anything starts).
	for _, args := range [][]string{
		{"--local", "--sweep", "0"}, {"--local", "--sweep", "1P3D=1;17P1D=2"}, {"--local", "--shapes", "1P3D,2P99D"},
		{"--local", "--shapes", "2P4D@1"}, {"--local", "--sweep", "1,2", "--shapes", "1P3D,1P3D"},
		{"--local", "--kill-decode", "decode-0", "--kill-after-requests", "2", "--kill-at", "5s"},
	} {
		b.Reset()
		if rc := run(args, &b); rc != 2 || !strings.Contains(b.String(), "kvc-bench:") {
			t.Errorf("%v: rc %d, %q", args, rc, b.String())
		}
	}
	b.Reset()
	if rc := run([]string{"--local", "--recovery-control"}, &b); rc != 2 || !strings.Contains(b.String(), "kvc-bench: --recovery-control needs --kill-decode") {
		t.Fatalf("--recovery-control without --kill-decode: rc %d: %s", rc, b.String())
	}
	if rc := run([]string{"--local", "--workload", "mooncake", "--trace", "/nonexistent/trace.jsonl"}, &b); rc != 2 || !strings.Contains(b.String(), "workload") {
		t.Fatalf("rc %d: %s", rc, b.String())
	}
}

// TestSweepReuseGathersPoints: with --sweep-reuse a sweep whose points were run by other
// processes (each point's summary.json in its directory) is gathered into one sweep.json without
// running anything; a point with a missing arm is not taken as finished.
func TestSweepReuseGathersPoints(t *testing.T) {
	out := t.TempDir()
	arms := []string{"SGL", "E4"}
	write := func(dir string, sums map[string]report.Summary) {
		t.Helper()
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		raw, err := json.Marshal(sums)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, report.SummaryFile), raw, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, x := range []string{"1", "2"} {
		write(filepath.Join(out, "1P3D", "load-"+x), map[string]report.Summary{
			"SGL": {OK: 10, Total: 10, SLOMet: 10, GoodputRPS: 1}, "E4": {OK: 10, Total: 10, SLOMet: 9, GoodputRPS: 0.9},
		})
	}
	for _, tc := range []struct {
		name       string
		sums, from map[string]report.Summary
		ok         bool
	}{
		{"every arm", map[string]report.Summary{"SGL": {}, "E4": {}}, nil, true},
		{"an arm missing", map[string]report.Summary{"SGL": {}}, nil, false},
		{"the missing arm in --sweep-from", map[string]report.Summary{"SGL": {}}, map[string]report.Summary{"E4": {}}, true},
		{"only in --sweep-from", nil, map[string]report.Summary{"E4": {}, "SGL": {}}, true},
		{"no file", nil, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root, other := t.TempDir(), t.TempDir()
			dir := filepath.Join(root, "2P4D", "load-1")
			if tc.sums != nil {
				write(dir, tc.sums)
			}
			if tc.from != nil {
				write(filepath.Join(other, "2P4D", "load-1"), tc.from)
			}
			if _, ok := finishedPoint(root, []string{other}, dir, arms, true); ok != tc.ok {
				t.Fatalf("finished %v, want %v", ok, tc.ok)
			}
			if _, ok := finishedPoint(root, []string{other}, dir, arms, false); ok {
				t.Fatal("finished without --sweep-reuse")
			}
		})
	}
	var b strings.Builder
	if rc := run([]string{"--local", "--arms", "SGL,E4", "--sweep", "1P3D=1,2", "--sweep-reuse", "--out", out}, &b); rc != 0 {
		t.Fatalf("rc %d: %s", rc, b.String())
	}
	if strings.Count(b.String(), "read from") != 2 {
		t.Fatalf("points not read: %s", b.String())
	}
	// --sweep-gather runs nothing: a point with an arm missing is reported, not run.
	b.Reset()
	if rc := run([]string{"--local", "--arms", "SGL,E4,PD", "--sweep", "1P3D=1", "--sweep-gather", "--out", t.TempDir()}, &b); rc != 1 || !strings.Contains(b.String(), "0 of 3 arms finished") {
		t.Fatalf("gather of an unfinished point: rc %d: %s", rc, b.String())
	}
	raw, err := os.ReadFile(filepath.Join(out, "sweep.json"))
	if err != nil {
		t.Fatal(err)
	}
	var sw struct {
		Points []map[string]any `json:"points"`
	}
	if err := json.Unmarshal(raw, &sw); err != nil || len(sw.Points) != 4 {
		t.Fatalf("sweep.json: %v, %d points: %s", err, len(sw.Points), raw)
	}
}
