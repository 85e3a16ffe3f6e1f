package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

func TestFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"bad decode", []string{"--decode", "0"}, nil, "--decode"},
		{"bad policy", []string{"--policy-json", "{nope"}, nil, "--policy-json"},
		{"unknown policy field", []string{"--policy-json", `{"teleport": true}`}, nil, "--policy-json"},
		{"bad env", nil, map[string]string{"KVC_PREFILL": "x"}, "KVC_PREFILL"},
		{"negative scale", []string{"--time-scale", "-2"}, nil, "--time-scale"},
		{"stray arg", []string{"up"}, nil, "unexpected"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			code := run(context.Background(), tt.args, func(k string) string { return tt.env[k] }, &out, &errb)
			if code != 2 || !strings.Contains(errb.String(), tt.want) {
				t.Fatalf("code %d stderr %q", code, errb.String())
			}
		})
	}
	o, err := parse([]string{"--policy-json", `{"snapshotsEnabled": false}`, "--sim-args", "--layers 4  --page-size 8", "--time-scale", "0.1"},
		func(string) string { return "" }, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if o.cfg.Policy == nil || o.cfg.Policy.SnapshotsEnabled == nil || *o.cfg.Policy.SnapshotsEnabled {
		t.Fatalf("policy %v", o.cfg.Policy)
	}
	if got := strings.Join(o.cfg.SimArgs, " "); got != "--time-scale 0.1 --layers 4 --page-size 8" || !o.cfg.Gateway {
		t.Fatalf("sim args %q gateway %v", got, o.cfg.Gateway)
	}
}
