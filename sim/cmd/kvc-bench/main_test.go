package main

import (
	"io"
	"strings"
	"testing"
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
		{"kill beyond a shape", []string{"--local", "--shapes", "1P3D,2P4D", "--kill-decode", "decode-3"}, "below shape 1P3D's decode workers 3"},
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
	} {
		b.Reset()
		if rc := run(args, &b); rc != 2 || !strings.Contains(b.String(), "kvc-bench:") {
			t.Errorf("%v: rc %d, %q", args, rc, b.String())
		}
	}
	if rc := run([]string{"--local", "--workload", "mooncake", "--trace", "/nonexistent/trace.jsonl"}, &b); rc != 2 || !strings.Contains(b.String(), "workload") {
		t.Fatalf("rc %d: %s", rc, b.String())
	}
}
