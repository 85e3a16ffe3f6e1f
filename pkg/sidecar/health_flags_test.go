package sidecar

import (
	"flag"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/flagenv"
)

func TestWorkerHealthFlags(t *testing.T) {
	base := []string{"--worker-id", "w", "--bridge-socket", "/tmp/x.sock", "--insecure"}
	cases := []struct {
		name    string
		args    []string
		env     map[string]string
		wantErr string
		check   func(c *Common) bool
	}{
		{"defaults", base, nil, "", func(c *Common) bool {
			return c.WorkerHealthInterval == time.Second && c.WorkerHealthThreshold == 3 && c.WorkerHealthTimeout == time.Second
		}},
		{"from env", base, map[string]string{"KVC_WORKER_HEALTH_INTERVAL": "250ms", "KVC_WORKER_HEALTH_THRESHOLD": "5", "KVC_WORKER_HEALTH_TIMEOUT": "2s"},
			"", func(c *Common) bool {
				return c.WorkerHealthInterval == 250*time.Millisecond && c.WorkerHealthThreshold == 5 && c.WorkerHealthTimeout == 2*time.Second
			}},
		{"flag wins over env", append(base, "--worker-health-threshold", "2"), map[string]string{"KVC_WORKER_HEALTH_THRESHOLD": "9"}, "",
			func(c *Common) bool { return c.WorkerHealthThreshold == 2 }},
		{"probing off", append(base, "--worker-health-interval", "0"), nil, "", func(c *Common) bool { return c.WorkerHealthInterval == 0 }},
		{"threshold zero", append(base, "--worker-health-threshold", "0"), nil, "--worker-health-threshold", nil},
		{"interval too short", base, map[string]string{"KVC_WORKER_HEALTH_INTERVAL": "1ms"}, "--worker-health-interval", nil},
		{"timeout zero", append(base, "--worker-health-timeout", "0s"), nil, "--worker-health-timeout", nil},
		{"unparsable", base, map[string]string{"KVC_WORKER_HEALTH_THRESHOLD": "many"}, "KVC_WORKER_HEALTH_THRESHOLD", nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fs := flag.NewFlagSet("x", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			var c Common
			c.Register(fs)
			err := flagenv.Parse(fs, tc.args, func(k string) string { return tc.env[k] })
			if err == nil {
				err = c.Check()
			}
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v; want one naming %s", err, tc.wantErr)
				}
				return
			}
			if err != nil || !tc.check(&c) {
				t.Fatalf("err %v, config %+v", err, c)
			}
		})
	}
}
