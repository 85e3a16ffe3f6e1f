package grpcx_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
	"github.com/kvcentric/kvcentric/pkg/tlsx/tlstest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// admin answers GetLeader with the caller's certificate serial and role (so tests see which
// client certificate the server verified) and accepts UpdatePolicy.
type admin struct {
	kvcv1.UnimplementedAdminServiceServer
	calls atomic.Int64
}

func (a *admin) GetLeader(ctx context.Context, _ *kvcv1.GetLeaderRequest) (*kvcv1.GetLeaderResponse, error) {
	a.calls.Add(1)
	c := tlsx.PeerCertificate(ctx)
	return &kvcv1.GetLeaderResponse{ResponderId: c.SerialNumber.String(), LeaderId: string(peerRole(ctx))}, nil
}

func (a *admin) UpdatePolicy(context.Context, *kvcv1.UpdatePolicyRequest) (*kvcv1.UpdatePolicyResponse, error) {
	a.calls.Add(1)
	return &kvcv1.UpdatePolicyResponse{}, nil
}

// router answers each query with a decision naming its request id.
type router struct {
	kvcv1.UnimplementedRouterServiceServer
}

func (router) Route(s grpc.BidiStreamingServer[kvcv1.RouteRequest, kvcv1.RouteResponse]) error {
	for {
		m, err := s.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		if err := s.Send(&kvcv1.RouteResponse{Kind: &kvcv1.RouteResponse_Decision{Decision: &kvcv1.RouteDecision{
			RequestId: m.GetQuery().GetRequestId()}}}); err != nil {
			return err
		}
	}
}

type fixture struct {
	dir  string
	ca   *tlstest.CA
	addr string
	srv  *tlsx.Source
	adm  *admin
}

// start serves AdminService and RouterService over mTLS with a control-plane certificate.
func start(t *testing.T) *fixture {
	t.Helper()
	f := &fixture{dir: t.TempDir(), adm: &admin{}}
	f.ca = tlstest.NewCA(t, f.dir, "ca")
	files := f.ca.Issue(t, "cp", tlstest.Spec{Role: tlsx.RoleControlPlane})
	var err error
	if f.srv, err = tlsx.Load(files); err != nil {
		t.Fatal(err)
	}
	s := grpcx.NewServer(zerolog.Nop(), grpcx.WithTLS(f.srv))
	kvcv1.RegisterAdminServiceServer(s, f.adm)
	kvcv1.RegisterRouterServiceServer(s, router{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f.addr = lis.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, lis, time.Second) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return f
}

// client dials f with the identity name (issued with spec unless it exists) and returns an
// AdminService client; the connection is closed at cleanup.
func (f *fixture) dial(t *testing.T, creds credentials.TransportCredentials) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(f.addr, append(grpcx.ClientOptions(), grpc.WithTransportCredentials(creds))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

func (f *fixture) as(t *testing.T, name string, spec tlstest.Spec) *grpc.ClientConn {
	t.Helper()
	src, err := tlsx.Load(f.ca.Issue(t, name, spec))
	if err != nil {
		t.Fatal(err)
	}
	return f.dial(t, grpcx.Credentials(src, tlsx.RoleControlPlane))
}

func callCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func wantCode(t *testing.T, err error, want codes.Code, contains ...string) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Fatalf("code %v (%v), want %v", got, err, want)
	}
	for _, c := range contains {
		if !strings.Contains(err.Error(), c) {
			t.Fatalf("error %q does not contain %q", err, c)
		}
	}
}

func TestTLSAuthorizationPerRole(t *testing.T) {
	f := start(t)
	pol := &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{}}
	tests := []struct {
		name   string
		role   tlsx.Role
		leader codes.Code // AdminService/GetLeader (a read)
		update codes.Code // AdminService/UpdatePolicy (a mutation)
		route  codes.Code // RouterService/Route
	}{
		{"operator-admin", tlsx.RoleOperatorAdmin, codes.OK, codes.OK, codes.PermissionDenied},
		{"operator-read", tlsx.RoleOperatorRead, codes.OK, codes.PermissionDenied, codes.PermissionDenied},
		{"sidecar", tlsx.RoleSidecar, codes.PermissionDenied, codes.PermissionDenied, codes.PermissionDenied},
		{"gateway", tlsx.RoleGateway, codes.PermissionDenied, codes.PermissionDenied, codes.OK},
		{"no role", "", codes.PermissionDenied, codes.PermissionDenied, codes.PermissionDenied},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cc := f.as(t, strings.ReplaceAll(tc.name, " ", "-"), tlstest.Spec{Role: tc.role})
			adm := kvcv1.NewAdminServiceClient(cc)
			resp, err := adm.GetLeader(callCtx(t), &kvcv1.GetLeaderRequest{})
			wantCode(t, err, tc.leader)
			if err == nil && resp.GetLeaderId() != string(tc.role) {
				t.Fatalf("server saw role %q, want %q", resp.GetLeaderId(), tc.role)
			}
			_, err = adm.UpdatePolicy(callCtx(t), pol)
			if tc.update == codes.PermissionDenied {
				want := "/kvc.v1.AdminService/UpdatePolicy"
				if tc.role != "" {
					wantCode(t, err, tc.update, want, `role "`+string(tc.role)+`"`)
				} else {
					wantCode(t, err, tc.update, want, "carries no")
				}
			} else {
				wantCode(t, err, tc.update)
			}
			// Route is a stream: the denial arrives on the first Recv.
			st, err := kvcv1.NewRouterServiceClient(cc).Route(callCtx(t))
			if err == nil {
				// A Send on a stream the server already ended returns io.EOF; the stream's
				// status (the denial) is what the next Recv returns.
				_ = st.Send(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{RequestId: "r1", SessionId: "s1", InputTokens: 10}}})
				var m *kvcv1.RouteResponse
				m, err = st.Recv()
				if err == nil && m.GetDecision().GetRequestId() != "r1" {
					t.Fatalf("route answer %v", m)
				}
			}
			wantCode(t, err, tc.route)
			// Health is open to every authenticated peer.
			if _, err := healthpb.NewHealthClient(cc).Check(callCtx(t), &healthpb.HealthCheckRequest{}); err != nil {
				t.Fatalf("health: %v", err)
			}
		})
	}
}

func TestTLSHandshakeRejections(t *testing.T) {
	f := start(t)
	good := f.ca.Issue(t, "op", tlstest.Spec{Role: tlsx.RoleOperatorAdmin})
	pool := x509.NewCertPool()
	pool.AddCert(f.ca.Cert)
	rogue := tlstest.NewCA(t, t.TempDir(), "rogue")
	rogueOp := rogue.Issue(t, "op", tlstest.Spec{Role: tlsx.RoleOperatorAdmin})
	rogueSrc, err := tlsx.Load(tlsx.Files{Cert: rogueOp.Cert, Key: rogueOp.Key, CA: good.CA}) // trusts our CA, signed by another
	if err != nil {
		t.Fatal(err)
	}
	expired, err := tlsx.Load(f.ca.Issue(t, "old", tlstest.Spec{Role: tlsx.RoleOperatorAdmin, Expired: true}))
	if err != nil {
		t.Fatal(err)
	}
	distrust, err := tlsx.Load(tlsx.Files{Cert: good.Cert, Key: good.Key, CA: rogue.Path}) // good cert, does not trust the server's CA
	if err != nil {
		t.Fatal(err)
	}
	goodSrc, err := tlsx.Load(good)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name  string
		creds credentials.TransportCredentials
	}{
		{"no client certificate", credentials.NewTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS13})},
		{"client certificate from an untrusted CA", grpcx.Credentials(rogueSrc, tlsx.RoleControlPlane)},
		{"expired client certificate", grpcx.Credentials(expired, tlsx.RoleControlPlane)},
		{"client does not trust the server's CA", grpcx.Credentials(distrust, tlsx.RoleControlPlane)},
		{"server has the wrong role", grpcx.Credentials(goodSrc, tlsx.RoleSidecar)},
		{"TLS 1.2 client", credentials.NewTLS(&tls.Config{RootCAs: pool, MaxVersion: tls.VersionTLS12,
			GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
				c, err := tls.LoadX509KeyPair(good.Cert, good.Key)
				return &c, err
			}})},
		{"plaintext client", grpcx.Credentials(nil)},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before, refused := f.adm.calls.Load(), f.srv.HandshakeFailures()
			_, err := kvcv1.NewAdminServiceClient(f.dial(t, tc.creds)).GetLeader(callCtx(t), &kvcv1.GetLeaderRequest{})
			wantCode(t, err, codes.Unavailable)
			t.Logf("rejected: %v", err)
			if f.adm.calls.Load() != before {
				t.Fatal("the handler ran")
			}
			clientSide := strings.Contains(tc.name, "client does not trust") || strings.Contains(tc.name, "wrong role")
			for deadline := time.Now().Add(2 * time.Second); !clientSide && f.srv.HandshakeFailures() == refused; {
				if time.Now().After(deadline) { // TLS 1.3: the server may refuse after the client is done
					t.Fatal("the server counted no refused handshake")
				}
				time.Sleep(2 * time.Millisecond) // polling a counter with a deadline
			}
		})
	}
	// The same server accepts the good identity.
	if _, err := kvcv1.NewAdminServiceClient(f.dial(t, grpcx.Credentials(goodSrc, tlsx.RoleControlPlane))).GetLeader(callCtx(t), &kvcv1.GetLeaderRequest{}); err != nil {
		t.Fatal(err)
	}
}

// TestTLSRotation rotates the server's and a client's certificate on disk; new connections use
// the new ones without any restart.
func TestTLSRotation(t *testing.T) {
	f := start(t)
	clientFiles := f.ca.Issue(t, "op", tlstest.Spec{Role: tlsx.RoleOperatorRead})
	cli, err := tlsx.Load(clientFiles)
	if err != nil {
		t.Fatal(err)
	}
	call := func() (serverSerial, clientSerial string) {
		var p peer.Peer
		cc := f.dial(t, grpcx.Credentials(cli, tlsx.RoleControlPlane))
		resp, err := kvcv1.NewAdminServiceClient(cc).GetLeader(callCtx(t), &kvcv1.GetLeaderRequest{}, grpc.Peer(&p))
		if err != nil {
			t.Fatal(err)
		}
		_ = cc.Close()
		return p.AuthInfo.(credentials.TLSInfo).State.PeerCertificates[0].SerialNumber.String(), resp.GetResponderId()
	}
	s0, c0 := call()
	if want := tlstest.Serial(t, clientFiles.Cert).String(); c0 != want {
		t.Fatalf("server saw client serial %s, want %s", c0, want)
	}
	f.ca.Issue(t, "cp", tlstest.Spec{Role: tlsx.RoleControlPlane})
	f.ca.Issue(t, "op", tlstest.Spec{Role: tlsx.RoleOperatorRead})
	s1, c1 := call()
	if s1 == s0 || s1 != tlstest.Serial(t, f.dir+"/cp.pem").String() {
		t.Fatalf("server certificate not rotated: %s -> %s", s0, s1)
	}
	if c1 == c0 || c1 != tlstest.Serial(t, clientFiles.Cert).String() {
		t.Fatalf("client certificate not rotated: %s -> %s", c0, c1)
	}
	if f.srv.Reloads() != 1 || cli.Reloads() != 1 {
		t.Fatalf("reloads server %d client %d, want 1 each", f.srv.Reloads(), cli.Reloads())
	}
	// Rotating the role: the reader becomes an admin without a restart.
	f.ca.Issue(t, "op", tlstest.Spec{Role: tlsx.RoleOperatorAdmin})
	cc := f.dial(t, grpcx.Credentials(cli, tlsx.RoleControlPlane))
	if _, err := kvcv1.NewAdminServiceClient(cc).UpdatePolicy(callCtx(t), &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{}}); err != nil {
		t.Fatalf("after rotation to operator-admin: %v", err)
	}
}

// TestTableCoversServer registers every kvc.v1 service on a TLS server and checks that each
// method it serves has an authorization entry.
func TestTableCoversServer(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	src, err := tlsx.Load(ca.Issue(t, "cp", tlstest.Spec{Role: tlsx.RoleControlPlane}))
	if err != nil {
		t.Fatal(err)
	}
	s := grpcx.NewServer(zerolog.Nop(), grpcx.WithTLS(src))
	kvcv1.RegisterAdminServiceServer(s, kvcv1.UnimplementedAdminServiceServer{})
	kvcv1.RegisterRouterServiceServer(s, kvcv1.UnimplementedRouterServiceServer{})
	kvcv1.RegisterSidecarServiceServer(s, kvcv1.UnimplementedSidecarServiceServer{})
	kvcv1.RegisterTransferPeerServiceServer(s, kvcv1.UnimplementedTransferPeerServiceServer{})
	kvcv1.RegisterWorkerBridgeServiceServer(s, kvcv1.UnimplementedWorkerBridgeServiceServer{})
	n := 0
	for svc, info := range s.GetServiceInfo() {
		for _, m := range info.Methods {
			n++
			if _, ok := tlsx.Table["/"+svc+"/"+m.Name]; !ok {
				t.Errorf("/%s/%s has no entry in tlsx.Table", svc, m.Name)
			}
		}
	}
	if n < 20 {
		t.Fatalf("only %d methods served", n)
	}
}

// TestTLSCARotation follows the documented CA rotation: add the new CA to the bundles, move the
// leaves to it, drop the old CA; no restart, no new credentials objects.
func TestTLSCARotation(t *testing.T) {
	f := start(t) // server: f.dir/cp.pem from the old CA, bundle f.ca.Path (shared by the client)
	newCA := tlstest.NewCA(t, t.TempDir(), "ca2")
	cli, err := tlsx.Load(f.ca.Issue(t, "op", tlstest.Spec{Role: tlsx.RoleOperatorRead}))
	if err != nil {
		t.Fatal(err)
	}
	call := func(src *tlsx.Source) error {
		cc := f.dial(t, grpcx.Credentials(src, tlsx.RoleControlPlane))
		defer cc.Close()
		_, err := kvcv1.NewAdminServiceClient(cc).GetLeader(callCtx(t), &kvcv1.GetLeaderRequest{})
		return err
	}
	if err := call(cli); err != nil {
		t.Fatal(err)
	}
	// A client certificate from the new CA before the server trusts that CA: refused.
	newCA.IssueAt(t, f.dir, "op", tlstest.Spec{Role: tlsx.RoleOperatorRead})
	wantCode(t, call(cli), codes.Unavailable)
	// Step 1: the bundle holds both CAs: accepted at the next handshake.
	tlstest.WriteBundle(t, f.ca.Path, f.ca, newCA)
	if err := call(cli); err != nil {
		t.Fatalf("after adding the new CA to the bundle: %v", err)
	}
	// Step 2: the server's certificate moves to the new CA; step 3: the old CA leaves the bundle.
	newCA.IssueAt(t, f.dir, "cp", tlstest.Spec{Role: tlsx.RoleControlPlane})
	tlstest.WriteBundle(t, f.ca.Path, newCA)
	if err := call(cli); err != nil {
		t.Fatalf("after removing the old CA: %v", err)
	}
	// A certificate of the old CA is refused now.
	old, err := tlsx.Load(f.ca.Issue(t, "old", tlstest.Spec{Role: tlsx.RoleOperatorRead}))
	if err != nil {
		t.Fatal(err)
	}
	wantCode(t, call(old), codes.Unavailable)
	if f.srv.Reloads() < 2 || cli.Reloads() < 2 {
		t.Fatalf("reloads: server %d client %d", f.srv.Reloads(), cli.Reloads())
	}
}

type syncBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestRefusedHandshakeLogged is issue 16 finding 6 and issue 23 item 6: every refused TLS
// handshake leaves a warn line with the peer's address and the reason (3 refusals: 3 lines, one
// naming each peer; a line a second left 2 of 3 unlogged), and every refusal is counted; a
// flood is bounded (20 lines a second, the excess counted in a later line's "suppressed").
func TestRefusedHandshakeLogged(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	var logs syncBuf
	src, err := tlsx.Load(ca.Issue(t, "cp", tlstest.Spec{Role: tlsx.RoleControlPlane}), tlsx.WithLogger(zerolog.New(&logs)))
	if err != nil {
		t.Fatal(err)
	}
	s := grpcx.NewServer(zerolog.Nop(), grpcx.WithTLS(src))
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, lis, time.Second) }()
	t.Cleanup(func() { cancel(); <-done })
	refuse := func() string { // not TLS at all: a plaintext HTTP/2 preface
		c, err := net.Dial("tcp", lis.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		_, _ = c.Write([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
		_, _ = io.Copy(io.Discard, c) // until the server closes it
		_ = c.Close()
		return c.LocalAddr().String()
	}
	waitCounted := func(n uint64) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for src.HandshakeFailures() < n {
			if time.Now().After(deadline) {
				t.Fatalf("%d refused handshakes counted, want %d", src.HandshakeFailures(), n)
			}
			time.Sleep(5 * time.Millisecond) // polling a counter with a deadline
		}
	}
	const n = 3
	first := time.Now()
	var local []string
	for i := 0; i < n; i++ {
		local = append(local, refuse())
	}
	waitCounted(n)
	out := logs.String()
	if got := strings.Count(out, "tls: handshake refused"); got != n {
		t.Fatalf("%d log lines for %d refusals, want one each:\n%s", got, n, out)
	}
	for _, a := range local {
		if !strings.Contains(out, `"peer":"`+a+`"`) {
			t.Fatalf("no line names the refused peer %s:\n%s", a, out)
		}
	}
	if !strings.Contains(out, `"level":"warn"`) || !strings.Contains(out, `"error":`) {
		t.Fatalf("log lines lack level or reason: %s", out)
	}
	// A flood: bounded lines (at most two one-second windows of 20 within a second of the
	// first refusal), every refusal counted.
	const flood = 40
	for range flood {
		refuse()
	}
	waitCounted(n + flood)
	if lines := strings.Count(logs.String(), "tls: handshake refused"); time.Since(first) < time.Second && lines >= n+flood {
		t.Fatalf("%d lines for %d refusals within a second: the flood is not bounded", lines, n+flood)
	}
}

// peerRole is the role of the caller in ctx ("" if it has none).
func peerRole(ctx context.Context) tlsx.Role {
	r, _ := tlsx.RoleOf(tlsx.PeerCertificate(ctx))
	return r
}
