package tlsx_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"net"
	"net/url"
	"slices"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/tlsx"
	"github.com/kvcentric/kvcentric/pkg/tlsx/tlstest"
)

func uris(t testing.TB, s ...string) []*url.URL {
	var out []*url.URL
	for _, x := range s {
		u, err := url.Parse(x)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, u)
	}
	return out
}

func TestWorkersOf(t *testing.T) {
	tests := []struct {
		name    string
		uris    []string
		want    []string
		wantErr string
	}{
		{name: "none", uris: []string{"spiffe://kvcentric/role/sidecar"}, want: nil},
		{name: "one", uris: []string{"spiffe://kvcentric/role/sidecar", "spiffe://kvcentric/worker/d1"}, want: []string{"d1"}},
		{name: "several, duplicate dropped", uris: []string{"spiffe://kvcentric/worker/n1-d0", "spiffe://kvcentric/worker/n1-d1",
			"spiffe://kvcentric/worker/n1-d0"}, want: []string{"n1-d0", "n1-d1"}},
		{name: "escaped space", uris: []string{"spiffe://kvcentric/worker/gpu%200"}, want: []string{"gpu 0"}},
		{name: "other trust domain ignored", uris: []string{"spiffe://elsewhere/worker/d1"}, want: nil},
		{name: "other path ignored", uris: []string{"spiffe://kvcentric/workers/d1"}, want: nil},
		{name: "empty id", uris: []string{"spiffe://kvcentric/worker/"}, wantErr: "worker id is required"},
		{name: "two segments", uris: []string{"spiffe://kvcentric/worker/n1/d1"}, wantErr: "one path segment"},
		{name: "escaped slash", uris: []string{"spiffe://kvcentric/worker/n1%2Fd1"}, wantErr: "forbidden character"},
		{name: "non-canonical escape", uris: []string{"spiffe://kvcentric/worker/d%31"}, wantErr: "canonical"},
		{name: "query", uris: []string{"spiffe://kvcentric/worker/d1?x=1"}, wantErr: "malformed"},
		{name: "fragment", uris: []string{"spiffe://kvcentric/worker/d1#x"}, wantErr: "malformed"},
		{name: "user", uris: []string{"spiffe://me@kvcentric/worker/d1"}, wantErr: "malformed"},
		{name: "control character", uris: []string{"spiffe://kvcentric/worker/d%01"}, wantErr: "forbidden character"},
		{name: "bad among good", uris: []string{"spiffe://kvcentric/worker/d1", "spiffe://kvcentric/worker/d2?x"}, wantErr: "malformed"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tlsx.WorkersOf(&x509.Certificate{URIs: uris(t, tc.uris...)})
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("got %q, err %v; want error %q", got, err, tc.wantErr)
				}
				return
			}
			if err != nil || !slices.Equal(got, tc.want) {
				t.Fatalf("got %q, %v; want %q", got, err, tc.want)
			}
		})
	}
	if _, err := tlsx.WorkersOf(nil); err == nil {
		t.Fatal("nil certificate accepted")
	}
	for _, id := range []string{"d1", "n1-d0.x_y", "gpu 0", "a,b;c?", "ü%", "x:y@z"} {
		got, err := tlsx.WorkersOf(&x509.Certificate{URIs: []*url.URL{tlsx.WorkerURI(id)}})
		if err != nil || !slices.Equal(got, []string{id}) {
			t.Fatalf("round trip of %q (%s): %q, %v", id, tlsx.WorkerURI(id), got, err)
		}
		// Through the string form, as x509 parsing of a certificate does.
		got, err = tlsx.WorkersOf(&x509.Certificate{URIs: uris(t, tlsx.WorkerURI(id).String())})
		if err != nil || !slices.Equal(got, []string{id}) {
			t.Fatalf("string round trip of %q (%s): %q, %v", id, tlsx.WorkerURI(id), got, err)
		}
	}
}

func TestCertAllowsWorker(t *testing.T) {
	cert := func(s ...string) *x509.Certificate {
		c := &x509.Certificate{URIs: uris(t, s...)}
		c.Subject.CommonName = "n1"
		return c
	}
	tests := []struct {
		name     string
		cert     *x509.Certificate
		id       string
		wantCode codes.Code
		wantMsg  string
	}{
		{name: "named", cert: cert("spiffe://kvcentric/role/sidecar", "spiffe://kvcentric/worker/d1"), id: "d1"},
		{name: "second of two", cert: cert("spiffe://kvcentric/worker/d0", "spiffe://kvcentric/worker/d1"), id: "d1"},
		{name: "other worker", cert: cert("spiffe://kvcentric/worker/d1"), id: "d2", wantCode: codes.PermissionDenied,
			wantMsg: `certificate "n1" may not act as worker "d2" (it names "d1")`},
		{name: "no worker", cert: cert("spiffe://kvcentric/role/sidecar"), id: "d1", wantCode: codes.PermissionDenied, wantMsg: "names no worker"},
		{name: "malformed", cert: cert("spiffe://kvcentric/worker/d1?x"), id: "d1", wantCode: codes.PermissionDenied, wantMsg: "malformed"},
		{name: "prefix is not a match", cert: cert("spiffe://kvcentric/worker/d1"), id: "d", wantCode: codes.PermissionDenied},
		{name: "no certificate", id: "d1", wantCode: codes.Unauthenticated},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tlsx.CertAllowsWorker(tc.cert, tc.id)
			if status.Code(err) != tc.wantCode || !strings.Contains(status.Convert(err).Message(), tc.wantMsg) {
				t.Fatalf("got %v; want %v %q", err, tc.wantCode, tc.wantMsg)
			}
		})
	}
}

// TestPeerAllowsWorker checks the context forms a gRPC handler sees: no peer and a plaintext
// peer pass (plaintext mode), a TLS peer is checked against its verified leaf.
func TestPeerAllowsWorker(t *testing.T) {
	ca := tlstest.NewCA(t, t.TempDir(), "ca")
	src, err := tlsx.Load(ca.Issue(t, "n1", tlstest.Spec{Role: tlsx.RoleSidecar, Workers: []string{"d0", "d1"}}))
	if err != nil {
		t.Fatal(err)
	}
	addr := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 1}
	tlsPeer := func(chains [][]*x509.Certificate) context.Context {
		return peer.NewContext(t.Context(), &peer.Peer{Addr: addr, AuthInfo: credentials.TLSInfo{State: tls.ConnectionState{VerifiedChains: chains}}})
	}
	_, plain, err := insecure.NewCredentials().ClientHandshake(t.Context(), "x", nil)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		ctx  context.Context
		id   string
		want codes.Code
	}{
		{name: "no peer", ctx: t.Context(), id: "d9", want: codes.OK},
		{name: "plaintext", ctx: peer.NewContext(t.Context(), &peer.Peer{Addr: addr, AuthInfo: plain}), id: "d9", want: codes.OK},
		{name: "tls, named", ctx: tlsPeer([][]*x509.Certificate{{src.Leaf(), ca.Cert}}), id: "d1", want: codes.OK},
		{name: "tls, not named", ctx: tlsPeer([][]*x509.Certificate{{src.Leaf(), ca.Cert}}), id: "d2", want: codes.PermissionDenied},
		{name: "tls, unverified", ctx: tlsPeer(nil), id: "d1", want: codes.Unauthenticated},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := tlsx.PeerAllowsWorker(tc.ctx, tc.id); status.Code(err) != tc.want {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
		})
	}
}

// FuzzWorkersOf feeds arbitrary URI SANs (untrusted: any CA-signed certificate may carry them):
// WorkersOf never panics, and every id it returns is valid and named by one of the URIs.
func FuzzWorkersOf(f *testing.F) {
	for _, s := range []string{"spiffe://kvcentric/worker/d1", "spiffe://kvcentric/worker/", "spiffe://kvcentric/worker/../worker/d2",
		"spiffe://KVCENTRIC/worker/d1", "spiffe://kvcentric/worker/d1?x=1", "spiffe://kvcentric/worker/d1#frag",
		"spiffe://kvcentric/worker/d%31", "spiffe://kvcentric/worker/a%2Fb", "spiffe://kvcentric/worker/gpu%200", "urn:x", ""} {
		f.Add(s, "spiffe://kvcentric/worker/d2")
	}
	f.Fuzz(func(t *testing.T, a, b string) {
		var in []*url.URL
		for _, s := range []string{a, b} {
			if u, err := url.Parse(s); err == nil {
				in = append(in, u)
			}
		}
		ids, err := tlsx.WorkersOf(&x509.Certificate{URIs: in})
		if err != nil {
			return
		}
		for _, id := range ids {
			if id == "" || strings.ContainsAny(id, "/\x00") {
				t.Fatalf("invalid worker id %q accepted from %q %q", id, a, b)
			}
			found := false
			for _, u := range in {
				if u.String() == tlsx.WorkerURI(id).String() {
					found = true
				}
			}
			if !found {
				t.Fatalf("worker %q not named by %q %q", id, a, b)
			}
		}
	})
}
