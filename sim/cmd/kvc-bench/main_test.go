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
	if rc := run([]string{"--local", "--workload", "mooncake", "--trace", "/nonexistent/trace.jsonl"}, &b); rc != 2 || !strings.Contains(b.String(), "workload") {
		t.Fatalf("rc %d: %s", rc, b.String())
	}
}
