package tlsx_test

import (
	"crypto/tls"
	"net"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvcentric/kvcentric/pkg/tlsx"
)

// TestMakeCertsScript runs deploy/tls/make-certs.sh (openssl) and checks that its certificates
// load, carry the roles (and, for sidecars, the worker ids) asked for, and complete a mutual
// TLS 1.3 handshake with each other.
func TestMakeCertsScript(t *testing.T) {
	if _, err := exec.LookPath("openssl"); err != nil {
		t.Skip("openssl not installed")
	}
	script, err := filepath.Abs("../../deploy/tls/make-certs.sh")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	run := func(args ...string) error {
		out, err := exec.Command("bash", append([]string{script, dir}, args...)...).CombinedOutput()
		if err != nil {
			t.Logf("make-certs.sh %v: %s", args, out)
		}
		return err
	}
	if err := run("ca"); err != nil {
		t.Fatal(err)
	}
	if run("ca") == nil {
		t.Fatal("a second ca run replaced the CA")
	}
	certs := []struct {
		name    string
		role    string
		args    []string
		workers []string
	}{
		{"cp-1", "controlplane", []string{"localhost", "127.0.0.1"}, nil},
		{"n1-d0", "sidecar", []string{"worker:n1-d0", "n1.example", "10.0.0.21"}, []string{"n1-d0"}},
		{"n2", "sidecar", []string{"localhost", "worker:n2-p0", "worker:n2-d0", "127.0.0.1"}, []string{"n2-p0", "n2-d0"}},
		{"gw", "gateway", nil, nil},
		{"alice", "operator-admin", nil, nil},
		{"bob", "operator-read", nil, nil},
		{"etcd", "-", []string{"localhost"}, nil},
	}
	files := map[string]tlsx.Files{}
	for _, c := range certs {
		if err := run(append([]string{"cert", c.name, c.role}, c.args...)...); err != nil {
			t.Fatal(err)
		}
		f := tlsx.Files{Cert: filepath.Join(dir, c.name+".pem"), Key: filepath.Join(dir, c.name+"-key.pem"), CA: filepath.Join(dir, "ca.pem")}
		src, err := tlsx.Load(f)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		want := tlsx.Role(c.role)
		if c.role == "-" {
			want = ""
		}
		if src.Role() != want || src.Leaf().Subject.CommonName != c.name {
			t.Fatalf("%s: role %q CN %q", c.name, src.Role(), src.Leaf().Subject.CommonName)
		}
		if ws, err := tlsx.WorkersOf(src.Leaf()); err != nil || !slices.Equal(ws, c.workers) {
			t.Fatalf("%s: workers %q, %v; want %q", c.name, ws, err, c.workers)
		}
		for _, h := range src.Leaf().DNSNames {
			if strings.Contains(h, "worker") {
				t.Fatalf("%s: worker argument became DNS name %q", c.name, h)
			}
		}
		files[c.name] = f
	}
	for _, bad := range [][]string{
		{"cert", "x", "root"},
		{"cert", "bad/name", "sidecar", "worker:x"},
		{"cert", "x", "sidecar", "localhost"},      // a sidecar names no worker
		{"cert", "x", "gateway", "worker:d0"},      // only sidecars name workers
		{"cert", "x", "sidecar", "worker:a/b"},     // not one path segment
		{"cert", "x", "sidecar", "worker:"},        // empty id
		{"cert", "x", "sidecar", "worker:a,DNS:y"}, // would inject a SAN
	} {
		if run(bad...) == nil {
			t.Fatalf("make-certs.sh %v accepted", bad)
		}
	}

	// alice (operator-admin, client only) against cp-1 (server) over a real socket pair.
	handshake := func(server, client string) error {
		srv, err := tlsx.Load(files[server])
		if err != nil {
			t.Fatal(err)
		}
		cli, err := tlsx.Load(files[client])
		if err != nil {
			t.Fatal(err)
		}
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer lis.Close()
		done := make(chan error, 1)
		go func() {
			c, err := lis.Accept()
			if err != nil {
				done <- err
				return
			}
			defer c.Close()
			tc := tls.Server(c, srv.ServerConfig())
			err = tc.Handshake()
			if err == nil {
				_, err = tc.Write([]byte{1}) // lets the client see a rejection of its certificate
			}
			done <- err
		}()
		cfg := cli.ClientConfig()
		cfg.ServerName = "localhost"
		c, err := tls.Dial("tcp", lis.Addr().String(), cfg)
		if err == nil {
			_, err = c.Read(make([]byte, 1))
			c.Close()
		}
		if serr := <-done; err == nil {
			err = serr
		}
		return err
	}
	if err := handshake("cp-1", "alice"); err != nil {
		t.Fatalf("alice -> cp-1: %v", err)
	}
	if err := handshake("n2", "n1-d0"); err != nil {
		t.Fatalf("n1-d0 -> n2: %v", err)
	}
	// gw is a client-only certificate (clientAuth, no host name): it cannot serve.
	if err := handshake("gw", "alice"); err == nil {
		t.Fatal("a gateway certificate served TLS")
	}
}
