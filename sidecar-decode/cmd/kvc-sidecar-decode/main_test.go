package main

import (
	"bytes"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/tlsx"
	"github.com/kvcentric/kvcentric/pkg/tlsx/tlstest"
)

func TestBadFlags(t *testing.T) {
	base := []string{"--worker-id", "w", "--bridge-socket", "/tmp/x.sock"}
	tests := []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"unknown flag", []string{"--nope"}, nil, "flag provided but not defined"},
		{"missing worker id", []string{"--bridge-socket", "/tmp/x.sock"}, nil, "--worker-id is required"},
		{"missing socket", []string{"--worker-id", "w"}, nil, "--bridge-socket is required"},
		{"bad transport", append(base, "--transport", "carrier-pigeon"), nil, "--transport"},
		{"bad conns from env", base, map[string]string{"KVC_TRANSFER_CONNS": "0"}, "--transfer-conns"},
		{"unparsable env", base, map[string]string{"KVC_GPU_INDEX": "x"}, "KVC_GPU_INDEX"},
		{"stray argument", append(base, "extra"), nil, "unexpected arguments"},
		{"partial tls", append(base, "--tls-cert", "c.pem", "--tls-key", "k.pem"), nil, "--tls-ca missing"},
		{"partial tls from env", base, map[string]string{"KVC_TLS_CA": "ca.pem"}, "--tls-cert, --tls-key missing"},
		{"negative credit", append(base, "--snapshot-credit-pages", "-1"), nil, "--snapshot-credit-pages"},
		{"negative credit from env", base, map[string]string{"KVC_SNAPSHOT_CREDIT_PAGES": "-5"}, "--snapshot-credit-pages"},
		{"release high above 1", append(base, "--release-high-watermark", "1.5"), nil, "release high watermark"},
		{"release low above high", append(base, "--release-high-watermark", "0.7", "--release-low-watermark", "0.8"), nil, "release low watermark"},
		{"release low from env", append(base, "--release-high-watermark", "0.9"), map[string]string{"KVC_RELEASE_LOW_WATERMARK": "-0.1"}, "release low watermark"},
		{"release high from env", base, map[string]string{"KVC_RELEASE_HIGH_WATERMARK": "-1"}, "release high watermark"},
		{"idle flush negative", append(base, "--snapshot-idle-flush", "-1s"), nil, "--snapshot-idle-flush"},
		{"idle flush too long", append(base, "--snapshot-idle-flush", "2h"), nil, "--snapshot-idle-flush"},
		{"idle flush unparsable from env", base, map[string]string{"KVC_SNAPSHOT_IDLE_FLUSH": "soon"}, "KVC_SNAPSHOT_IDLE_FLUSH"},
		{"idle flush negative from env", base, map[string]string{"KVC_SNAPSHOT_IDLE_FLUSH": "-5s"}, "--snapshot-idle-flush"},
		{"release idle negative", append(base, "--release-high-watermark", "0.9", "--release-min-idle", "-1s"), nil, "minimum idle"},
		{"time scale zero", append(base, "--time-scale", "0"), nil, "--time-scale 0 out of range"},
		{"time scale negative", append(base, "--time-scale", "-0.3"), nil, "--time-scale -0.3 out of range"},
		{"time scale too large", append(base, "--time-scale", "101"), nil, "--time-scale 101 out of range"},
		{"time scale from env", base, map[string]string{"KVC_TIME_SCALE": "NaN"}, "--time-scale NaN out of range"},
		{"scaled heartbeat too short", append(base, "--time-scale", "0.1", "--heartbeat", "50ms"), nil, "--heartbeat 50ms too short"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stderr bytes.Buffer
			env := plaintextEnv(tt.args, tt.env)
			code := run(tt.args, func(k string) string { return env[k] }, &stderr)
			if code != 2 || !strings.Contains(stderr.String(), tt.want) {
				t.Fatalf("exit %d, stderr %q; want 2 and %q", code, stderr.String(), tt.want)
			}
		})
	}
}

func TestFlagWinsOverEnv(t *testing.T) {
	var stderr bytes.Buffer
	// the env would be valid; the flag is not and wins
	code := run([]string{"--worker-id", "w", "--bridge-socket", "/tmp/x.sock", "--transfer-conns", "0"},
		func(k string) string { return map[string]string{"KVC_TRANSFER_CONNS": "4", "KVC_INSECURE": "true"}[k] }, &stderr)
	if code != 2 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
}

func TestWrongCertificateRole(t *testing.T) {
	dir := t.TempDir()
	f := tlstest.NewCA(t, dir, "ca").Issue(t, "d0", tlstest.Spec{Role: tlsx.RoleGateway})
	var stderr bytes.Buffer
	code := run([]string{"--worker-id", "w", "--bridge-socket", filepath.Join(dir, "b.sock"), "--tls-cert", f.Cert, "--tls-key", f.Key, "--tls-ca", f.CA},
		func(string) string { return "" }, &stderr)
	if code == 0 || !strings.Contains(stderr.String(), "spiffe://kvcentric/role/sidecar") {
		t.Fatalf("exit %d, stderr %q", code, stderr.String())
	}
}

func TestCertificateWithoutTheWorkerID(t *testing.T) {
	dir := t.TempDir()
	f := tlstest.NewCA(t, dir, "ca").Issue(t, "d0", tlstest.Spec{Role: tlsx.RoleSidecar, Workers: []string{"d0"}})
	var stderr bytes.Buffer
	code := run([]string{"--worker-id", "d1", "--bridge-socket", filepath.Join(dir, "b.sock"), "--tls-cert", f.Cert, "--tls-key", f.Key, "--tls-ca", f.CA},
		func(string) string { return "" }, &stderr)
	if code == 0 || !strings.Contains(stderr.String(), `"d1"`) || !strings.Contains(stderr.String(), "worker:d1") {
		t.Fatalf("exit %d, stderr %q", code, stderr.String())
	}
}

// plaintextEnv adds KVC_INSECURE=true (the explicit choice of plaintext, where the binary has
// that flag; an unknown variable is ignored) to a case that names no TLS file, so that the
// case meets the error it is about.
func plaintextEnv(args []string, env map[string]string) map[string]string {
	out := map[string]string{}
	tls := false
	for k, v := range env {
		out[k] = v
		tls = tls || strings.HasPrefix(k, "KVC_TLS_")
	}
	for _, a := range args {
		tls = tls || strings.HasPrefix(a, "--tls-")
	}
	if !tls {
		out["KVC_INSECURE"] = "true"
	}
	return out
}

// TestTimeScaleScalesTimers: at --time-scale X every decision-shaping timer of the decode
// sidecar runs X times as fast (the heartbeat and the health probe through sidecar.Common, the
// idle flush, the release tick and the release's minimum idle here), so a simulation at X sees
// the same staleness in model seconds as real speed does; at 1 (the default) nothing changes.
func TestTimeScaleScalesTimers(t *testing.T) {
	base := []string{"--worker-id", "w", "--bridge-socket", "/tmp/x.sock", "--heartbeat", "2s", "--worker-health-interval", "1s",
		"--snapshot-idle-flush", "2s", "--release-high-watermark", "0.9", "--release-min-idle", "5s"}
	tests := []struct {
		name                                        string
		args                                        []string
		env                                         map[string]string
		heartbeat, health, flush, minIdle, interval time.Duration
	}{
		{"real speed", base, nil, 2 * time.Second, time.Second, 2 * time.Second, 5 * time.Second, time.Second},
		{"0.3", append(base, "--time-scale", "0.3"), nil, 600 * time.Millisecond, 300 * time.Millisecond, 600 * time.Millisecond, 1500 * time.Millisecond, 300 * time.Millisecond},
		{"0.5 from env", base, map[string]string{"KVC_TIME_SCALE": "0.5"}, time.Second, 500 * time.Millisecond, time.Second, 2500 * time.Millisecond, 500 * time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env := plaintextEnv(tt.args, tt.env)
			st, err := parse(tt.args, func(k string) string { return env[k] }, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			c := st.common
			got := []time.Duration{c.Scaled(c.Heartbeat), c.Scaled(c.WorkerHealthInterval), st.core.IdleFlush, st.core.Release.MinIdle, st.core.Release.Interval}
			want := []time.Duration{tt.heartbeat, tt.health, tt.flush, tt.minIdle, tt.interval}
			for i, name := range []string{"heartbeat", "health probe", "idle flush", "release min idle", "release tick"} {
				if got[i] != want[i] {
					t.Errorf("%s %v, want %v", name, got[i], want[i])
				}
			}
		})
	}
}
