package main

import (
	"bytes"
	"strings"
	"testing"
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
		{"zero credit timeout", append(base, "--snapshot-credit-timeout", "0s"), nil, "--snapshot-credit-timeout"},
		{"bad credit timeout from env", base, map[string]string{"KVC_SNAPSHOT_CREDIT_TIMEOUT": "soon"}, "KVC_SNAPSHOT_CREDIT_TIMEOUT"},
		{"bad store memory", append(base, "--store-memory", "disk"), nil, "--store-memory \"disk\": want host or cuda"},
		{"GPU store without cuda", append(base, "--store-memory", "cuda"), nil, "--store-memory cuda needs --transport cuda"},
		{"GPU store from env on tcp", base, map[string]string{"KVC_STORE_MEMORY": "cuda", "KVC_TRANSPORT": "tcp"}, "needs --transport cuda"},
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
