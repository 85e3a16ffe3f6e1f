package app

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/gateway/internal/config"
	"github.com/kvcentric/kvcentric/gateway/internal/fakecp"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
	"github.com/kvcentric/kvcentric/pkg/tlsx/tlstest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestRunTLS: the gateway reaches a mutual-TLS control plane with its gateway certificate (Route
// stream up, ListWorkers refresh answered) and serves its front door over HTTPS.
func TestRunTLS(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	cpSrc, err := tlsx.Load(ca.Issue(t, "cp", tlstest.Spec{Role: tlsx.RoleControlPlane}))
	if err != nil {
		t.Fatal(err)
	}
	cp := fakecp.Start(t, nil, grpcx.WithTLS(cpSrc))
	cp.SetWorkers([]*kvcv1.Worker{{WorkerId: "d0", Role: kvcv1.WorkerRole_WORKER_ROLE_DECODE, WorkerUrl: "http://127.0.0.1:9"}})
	gw := ca.Issue(t, "gw", tlstest.Spec{Role: tlsx.RoleGateway})
	web := ca.Issue(t, "web", tlstest.Spec{}) // an ordinary server certificate, no role
	ready := filepath.Join(dir, "ready.json")
	cfg, err := config.Parse([]string{"--http-addr", "127.0.0.1:0", "--ready-file", ready, "--control-plane", cp.Addr,
		"--route-timeout", "100ms", "--worker-refresh", "50ms", "--http-tls-cert", web.Cert, "--http-tls-key", web.Key},
		func(k string) string {
			return map[string]string{"KVC_TLS_CERT": gw.Cert, "KVC_TLS_KEY": gw.Key, "KVC_TLS_CA": gw.CA}[k]
		}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg, io.Discard) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}()
	var rf struct {
		HTTPAddr string `json:"http_addr"`
		Scheme   string `json:"scheme"`
	}
	pool := x509.NewCertPool()
	pool.AddCert(ca.Cert)
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS13}}}
	metrics := ""
	deadline := time.Now().Add(10 * time.Second)
	for {
		if raw, err := os.ReadFile(ready); err == nil && json.Unmarshal(raw, &rf) == nil && rf.HTTPAddr != "" {
			if resp, err := hc.Get("https://" + rf.HTTPAddr + "/metrics"); err == nil {
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				metrics = string(b)
				if strings.Contains(metrics, "kvc_gateway_control_plane_connected 1") &&
					strings.Contains(metrics, `kvc_gateway_worker_refresh_total{result="ok"}`) {
					break
				}
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no Route stream / refresh over mTLS in time; metrics:\n%s", metrics)
		}
		select {
		case err := <-done:
			t.Fatalf("Run ended: %v", err)
		case <-time.After(20 * time.Millisecond): // polling metrics served by another goroutine
		}
	}
	for _, id := range []string{"grpc", "https"} {
		if !strings.Contains(metrics, `kvc_tls_cert_expiry_timestamp_seconds{identity="`+id+`"}`) {
			t.Fatalf("no expiry gauge for %s:\n%s", id, metrics)
		}
	}
	if rf.Scheme != "https" {
		t.Fatalf("ready file scheme %q", rf.Scheme)
	}
	// Plain HTTP on the HTTPS port fails.
	if resp, err := http.Get("http://" + rf.HTTPAddr + "/healthz"); err == nil {
		resp.Body.Close()
		if resp.StatusCode == 200 {
			t.Fatal("plain HTTP answered 200 on the HTTPS port")
		}
	}
}

func TestRunTLSWrongRole(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	f := ca.Issue(t, "gw", tlstest.Spec{Role: tlsx.RoleOperatorAdmin})
	cfg, err := config.Parse([]string{"--http-addr", "127.0.0.1:0", "--control-plane", "127.0.0.1:1",
		"--tls-cert", f.Cert, "--tls-key", f.Key, "--tls-ca", f.CA}, func(string) string { return "" }, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if err := Run(t.Context(), cfg, io.Discard); err == nil || !strings.Contains(err.Error(), "spiffe://kvcentric/role/gateway") {
		t.Fatalf("Run with an operator certificate: %v", err)
	}
}
