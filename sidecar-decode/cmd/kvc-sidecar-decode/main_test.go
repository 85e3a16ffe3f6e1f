package main

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"

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
