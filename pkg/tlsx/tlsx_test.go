package tlsx_test

import (
	"bytes"
	"crypto/x509"
	"flag"
	"fmt"
	"net/url"
	"os"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/rs/zerolog"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

	"github.com/kvcentric/kvcentric/pkg/tlsx"
	"github.com/kvcentric/kvcentric/pkg/tlsx/tlstest"
)

func TestFilesCheck(t *testing.T) {
	tests := []struct {
		name    string
		f       tlsx.Files
		n       tlsx.Names
		wantErr string
	}{
		{name: "none without --insecure is refused", n: tlsx.GRPCNames, wantErr: "no transport security chosen: give --tls-cert, --tls-key and --tls-ca for mutual TLS, or --insecure"},
		{name: "--insecure is plaintext", f: tlsx.Files{Insecure: true}, n: tlsx.GRPCNames},
		{name: "--insecure with files", f: tlsx.Files{Cert: "c", Key: "k", CA: "a", Insecure: true}, n: tlsx.GRPCNames, wantErr: "--insecure contradicts --tls-cert, --tls-key, --tls-ca"},
		{name: "no insecure flag: none is fine", n: tlsx.Names{Cert: "etcd-cert", Key: "etcd-key", CA: "etcd-cacert"}},
		{name: "all three", f: tlsx.Files{Cert: "c", Key: "k", CA: "a"}, n: tlsx.GRPCNames},
		{name: "cert only", f: tlsx.Files{Cert: "c"}, n: tlsx.GRPCNames, wantErr: "--tls-cert given but --tls-key, --tls-ca missing"},
		{name: "no CA", f: tlsx.Files{Cert: "c", Key: "k"}, n: tlsx.GRPCNames, wantErr: "--tls-ca missing"},
		{name: "CA only", f: tlsx.Files{CA: "a"}, n: tlsx.GRPCNames, wantErr: "--tls-ca given but --tls-cert, --tls-key missing"},
		{name: "https pair", f: tlsx.Files{Cert: "c", Key: "k"}, n: tlsx.Names{Cert: "http-tls-cert", Key: "http-tls-key"}},
		{name: "https half", f: tlsx.Files{Key: "k"}, n: tlsx.Names{Cert: "http-tls-cert", Key: "http-tls-key"}, wantErr: "--http-tls-cert missing"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.f.Check(tc.n)
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("unexpected error %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("error %v, want it to contain %q", err, tc.wantErr)
			}
		})
	}
}

func TestFilesRegister(t *testing.T) {
	var f tlsx.Files
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	f.Register(fs, tlsx.GRPCNames, "of this binary")
	if err := fs.Parse([]string{"--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem"}); err != nil {
		t.Fatal(err)
	}
	if f != (tlsx.Files{Cert: "c.pem", Key: "k.pem", CA: "ca.pem"}) {
		t.Fatalf("got %+v", f)
	}
}

func TestRoleOf(t *testing.T) {
	uri := func(s ...string) []*url.URL {
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
	tests := []struct {
		name    string
		uris    []*url.URL
		want    tlsx.Role
		wantErr string
	}{
		{name: "sidecar", uris: uri("spiffe://kvcentric/role/sidecar"), want: tlsx.RoleSidecar},
		{name: "admin among others", uris: uri("https://example.com/x", "spiffe://kvcentric/role/operator-admin"), want: tlsx.RoleOperatorAdmin},
		{name: "none", wantErr: "carries no"},
		{name: "other trust domain", uris: uri("spiffe://elsewhere/role/sidecar"), wantErr: "carries no"},
		{name: "two roles", uris: uri("spiffe://kvcentric/role/sidecar", "spiffe://kvcentric/role/gateway"), wantErr: "exactly one"},
		{name: "unknown role", uris: uri("spiffe://kvcentric/role/root"), wantErr: "unknown role"},
		{name: "query", uris: uri("spiffe://kvcentric/role/operator-admin?x=1"), wantErr: "malformed"},
		{name: "escaped", uris: uri("spiffe://kvcentric/role/side%63ar"), wantErr: "malformed"},
		{name: "user info", uris: uri("spiffe://me@kvcentric/role/sidecar"), wantErr: "malformed"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := tlsx.RoleOf(&x509.Certificate{URIs: tc.uris})
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("got %q, %v; want %q", got, err, tc.want)
			}
		})
	}
	for _, r := range tlsx.Roles {
		got, err := tlsx.RoleOf(&x509.Certificate{URIs: []*url.URL{r.URI()}})
		if err != nil || got != r {
			t.Fatalf("round trip of %q: %q, %v", r, got, err)
		}
	}
}

// servedMethods lists every method of every service a kvcentric server may serve: the kvc.v1
// services plus health and reflection, from the registered descriptors.
func servedMethods(t *testing.T) []string {
	var out []string
	protoregistry.GlobalFiles.RangeFiles(func(fd protoreflect.FileDescriptor) bool {
		pkg := string(fd.Package())
		if pkg != "kvc.v1" && pkg != "grpc.health.v1" && pkg != "grpc.reflection.v1" && pkg != "grpc.reflection.v1alpha" {
			return true
		}
		for i := 0; i < fd.Services().Len(); i++ {
			sd := fd.Services().Get(i)
			for j := 0; j < sd.Methods().Len(); j++ {
				out = append(out, "/"+string(sd.FullName())+"/"+string(sd.Methods().Get(j).Name()))
			}
		}
		return true
	})
	if len(out) < 20 {
		t.Fatalf("only %d methods found in the descriptors: %v", len(out), out)
	}
	return out
}

func TestTableCoversEveryMethod(t *testing.T) {
	served := map[string]bool{}
	for _, m := range servedMethods(t) {
		served[m] = true
		if _, ok := tlsx.Table[m]; !ok {
			t.Errorf("method %s has no entry in tlsx.Table", m)
		}
	}
	for m, r := range tlsx.Table {
		if !served[m] {
			t.Errorf("tlsx.Table entry %s names no method in the descriptors", m)
		}
		for _, role := range r.Roles {
			if !role.Valid() {
				t.Errorf("%s: unknown role %q", m, role)
			}
		}
	}
}

func TestAuthorize(t *testing.T) {
	cert := func(r tlsx.Role) *x509.Certificate {
		c := &x509.Certificate{}
		if r != "" {
			c.URIs = []*url.URL{r.URI()}
		}
		return c
	}
	tests := []struct {
		method string
		role   tlsx.Role
		want   codes.Code
	}{
		{"/kvc.v1.SidecarService/Connect", tlsx.RoleSidecar, codes.OK},
		{"/kvc.v1.SidecarService/Connect", tlsx.RoleGateway, codes.PermissionDenied},
		{"/kvc.v1.SidecarService/Connect", tlsx.RoleOperatorAdmin, codes.PermissionDenied},
		{"/kvc.v1.RouterService/Route", tlsx.RoleGateway, codes.OK},
		{"/kvc.v1.RouterService/Route", tlsx.RoleSidecar, codes.PermissionDenied},
		{"/kvc.v1.AdminService/GetPolicy", tlsx.RoleOperatorRead, codes.OK},
		{"/kvc.v1.AdminService/GetPolicy", tlsx.RoleOperatorAdmin, codes.OK},
		{"/kvc.v1.AdminService/GetPolicy", tlsx.RoleSidecar, codes.PermissionDenied},
		{"/kvc.v1.AdminService/ListWorkers", tlsx.RoleGateway, codes.OK},
		{"/kvc.v1.AdminService/UpdatePolicy", tlsx.RoleOperatorAdmin, codes.OK},
		{"/kvc.v1.AdminService/UpdatePolicy", tlsx.RoleOperatorRead, codes.PermissionDenied},
		{"/kvc.v1.AdminService/UpdatePolicy", tlsx.RoleSidecar, codes.PermissionDenied},
		{"/kvc.v1.AdminService/DrainWorker", tlsx.RoleOperatorRead, codes.PermissionDenied},
		{"/kvc.v1.AdminService/DrainWorker", tlsx.RoleControlPlane, codes.PermissionDenied},
		{"/kvc.v1.TransferPeerService/CommitSnapshot", tlsx.RoleSidecar, codes.OK},
		{"/kvc.v1.TransferPeerService/CommitSnapshot", tlsx.RoleGateway, codes.PermissionDenied},
		{"/kvc.v1.WorkerBridgeService/SendKV", tlsx.RoleSidecar, codes.PermissionDenied},
		{"/grpc.health.v1.Health/Check", tlsx.RoleGateway, codes.OK},
		{"/grpc.health.v1.Health/Check", "", codes.OK},
		{"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", tlsx.RoleOperatorRead, codes.OK},
		{"/kvc.v1.AdminService/GetLeader", "", codes.PermissionDenied},
		{"/kvc.v1.AdminService/Shutdown", tlsx.RoleOperatorAdmin, codes.PermissionDenied},
	}
	for _, tc := range tests {
		t.Run(tc.method+"/"+string(tc.role), func(t *testing.T) {
			err := tlsx.Authorize(tc.method, cert(tc.role))
			if got := status.Code(err); got != tc.want {
				t.Fatalf("code %v (%v), want %v", got, err, tc.want)
			}
			if tc.want == codes.PermissionDenied && !strings.Contains(err.Error(), tc.method) {
				t.Fatalf("denial %q does not name the method", err)
			}
			if tc.want == codes.PermissionDenied && tc.role != "" && tlsx.Table[tc.method].Roles != nil && !strings.Contains(err.Error(), string(tc.role)) {
				t.Fatalf("denial %q does not name the role", err)
			}
		})
	}
	if got := status.Code(tlsx.Authorize("/kvc.v1.AdminService/GetLeader", nil)); got != codes.Unauthenticated {
		t.Fatalf("no certificate: %v", got)
	}
}

// TestDocTableMatches keeps the role table in docs/operations.md equal to tlsx.Table.
func TestDocTableMatches(t *testing.T) {
	b, err := os.ReadFile("../../docs/operations.md")
	if err != nil {
		t.Fatal(err)
	}
	const begin, end = "<!-- authz-table:begin (generated from pkg/tlsx.Table; TestDocTableMatches) -->\n", "<!-- authz-table:end -->"
	doc := string(b)
	i, j := strings.Index(doc, begin), strings.Index(doc, end)
	if i < 0 || j < i {
		t.Fatalf("docs/operations.md lacks the markers %q ... %q", begin, end)
	}
	if got, want := doc[i+len(begin):j], tlsx.MarkdownTable(); got != want {
		t.Fatalf("docs/operations.md role table is stale; replace it with:\n%s", want)
	}
}

func TestSourceReload(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	files := ca.Issue(t, "cp", tlstest.Spec{Role: tlsx.RoleControlPlane})
	src, err := tlsx.Load(files)
	if err != nil {
		t.Fatal(err)
	}
	if src.Role() != tlsx.RoleControlPlane {
		t.Fatalf("role %q", src.Role())
	}
	first := src.Leaf().SerialNumber
	if src.Reloads() != 0 {
		t.Fatalf("reloads %d before any change", src.Reloads())
	}

	// Rotate: a new certificate (new key, new role) replaces the files.
	ca.Issue(t, "cp", tlstest.Spec{Role: tlsx.RoleSidecar})
	if got := src.Leaf().SerialNumber; got.Cmp(first) == 0 || got.Cmp(tlstest.Serial(t, files.Cert)) != 0 {
		t.Fatalf("serial %v after rotation, want the new %v", got, tlstest.Serial(t, files.Cert))
	}
	if src.Role() != tlsx.RoleSidecar || src.Reloads() != 1 {
		t.Fatalf("role %q reloads %d after rotation", src.Role(), src.Reloads())
	}
	good := src.Leaf().SerialNumber

	// A broken file keeps the previous identity and counts a failure; the fix is picked up.
	if err := os.WriteFile(files.Cert, []byte("not a certificate"), 0o644); err != nil {
		t.Fatal(err)
	}
	if got := src.Leaf().SerialNumber; got.Cmp(good) != 0 || src.Failures() == 0 {
		t.Fatalf("broken file: serial %v (want %v), failures %d", got, good, src.Failures())
	}
	ca.Issue(t, "cp", tlstest.Spec{Role: tlsx.RoleGateway})
	if src.Role() != tlsx.RoleGateway || src.Reloads() != 2 {
		t.Fatalf("after repair: role %q reloads %d", src.Role(), src.Reloads())
	}
}

func TestLoadErrors(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	files := ca.Issue(t, "x", tlstest.Spec{Role: tlsx.RoleSidecar})
	other := ca.Issue(t, "y", tlstest.Spec{Role: tlsx.RoleSidecar})
	if src, err := tlsx.Load(tlsx.Files{}); src != nil || err != nil {
		t.Fatalf("no files: %v %v", src, err)
	}
	tests := []struct {
		name string
		f    tlsx.Files
	}{
		{"missing cert file", tlsx.Files{Cert: dir + "/nope.pem", Key: files.Key, CA: files.CA}},
		{"key of another cert", tlsx.Files{Cert: files.Cert, Key: other.Key, CA: files.CA}},
		{"CA file without PEM", tlsx.Files{Cert: files.Cert, Key: files.Key, CA: files.Key + ".none"}},
		{"CA is not PEM", tlsx.Files{Cert: files.Cert, Key: files.Key, CA: writeFile(t, dir, "bad-ca.pem", "garbage")}},
		{"no key", tlsx.Files{Cert: files.Cert, CA: files.CA}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := tlsx.Load(tc.f); err == nil {
				t.Fatal("Load succeeded")
			}
		})
	}
}

func writeFile(t *testing.T, dir, name, content string) string {
	p := dir + "/" + name
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestMetrics(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	files := ca.Issue(t, "cp", tlstest.Spec{Role: tlsx.RoleControlPlane})
	src, err := tlsx.Load(files)
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	if err := tlsx.RegisterMetrics(reg, "grpc", src); err != nil {
		t.Fatal(err)
	}
	if err := tlsx.RegisterMetrics(reg, "etcd", nil); err != nil {
		t.Fatal(err)
	}
	ca.Issue(t, "cp", tlstest.Spec{Role: tlsx.RoleControlPlane})
	notAfter := src.Leaf().NotAfter.Unix() // picks up the rotation
	want := fmt.Sprintf(`
# HELP kvc_tls_cert_expiry_timestamp_seconds NotAfter of the TLS certificate in use (Unix seconds); files are re-read on change.
# TYPE kvc_tls_cert_expiry_timestamp_seconds gauge
kvc_tls_cert_expiry_timestamp_seconds{identity="grpc"} %d
# HELP kvc_tls_handshake_failures_total TLS handshakes this server refused (no, expired or foreign client certificate; not TLS).
# TYPE kvc_tls_handshake_failures_total counter
kvc_tls_handshake_failures_total{identity="grpc"} 0
# HELP kvc_tls_reloads_total Reloads of TLS files after a change on disk, by result (failed: the previous certificates stay in use).
# TYPE kvc_tls_reloads_total counter
kvc_tls_reloads_total{identity="grpc",result="failed"} 0
kvc_tls_reloads_total{identity="grpc",result="ok"} 1
`, notAfter)
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want)); err != nil {
		t.Fatal(err)
	}
}

// FuzzRoleOf feeds arbitrary URI SANs (untrusted: any CA-signed certificate may carry them):
// RoleOf never panics and only ever returns a known role whose URI was present.
func FuzzRoleOf(f *testing.F) {
	for _, s := range []string{"spiffe://kvcentric/role/sidecar", "spiffe://kvcentric/role/", "spiffe://kvcentric/role/../role/gateway",
		"spiffe://KVCENTRIC/role/gateway", "spiffe://kvcentric/role/operator-admin?x=1", "spiffe://kvcentric/role/sidecar#frag",
		"spiffe://kvcentric/role/side%63ar", "urn:x", ""} {
		f.Add(s, "spiffe://kvcentric/role/gateway")
	}
	f.Fuzz(func(t *testing.T, a, b string) {
		var uris []*url.URL
		for _, s := range []string{a, b} {
			if u, err := url.Parse(s); err == nil {
				uris = append(uris, u)
			}
		}
		r, err := tlsx.RoleOf(&x509.Certificate{URIs: uris})
		if err != nil {
			return
		}
		if !r.Valid() {
			t.Fatalf("invalid role %q accepted from %q %q", r, a, b)
		}
		found := false
		for _, u := range uris {
			if u.String() == r.URI().String() {
				found = true
			}
		}
		if !found {
			t.Fatalf("role %q not named by %q %q", r, a, b)
		}
	})
}

// TestInsecureIsLoud: --insecure is a flag of GRPCNames only, and Load logs it at error level.
func TestInsecureIsLoud(t *testing.T) {
	var f tlsx.Files
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	f.Register(fs, tlsx.GRPCNames, "of this binary")
	if err := fs.Parse([]string{"--insecure"}); err != nil || !f.Insecure {
		t.Fatalf("--insecure: %v %+v", err, f)
	}
	var other tlsx.Files
	ofs := flag.NewFlagSet("y", flag.ContinueOnError)
	other.Register(ofs, tlsx.Names{Cert: "http-tls-cert", Key: "http-tls-key"}, "https")
	if ofs.Lookup("insecure") != nil {
		t.Fatal("a Names without Insecure registered --insecure")
	}
	var buf bytes.Buffer
	src, err := tlsx.Load(f, tlsx.WithLogger(zerolog.New(&buf)))
	if err != nil || src != nil {
		t.Fatalf("Load(--insecure) = %v, %v; want nil, nil", src, err)
	}
	if !strings.Contains(buf.String(), `"level":"error"`) || !strings.Contains(buf.String(), "INSECURE") {
		t.Fatalf("no loud log line: %q", buf.String())
	}
	buf.Reset()
	if _, err := tlsx.Load(tlsx.Files{}, tlsx.WithLogger(zerolog.New(&buf))); err != nil || buf.Len() != 0 {
		t.Fatalf("Load of nothing: %v, logged %q", err, buf.String())
	}
}
