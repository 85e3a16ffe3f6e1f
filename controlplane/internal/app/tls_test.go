package app

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	etcdclient "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
	"github.com/kvcentric/kvcentric/pkg/tlsx/tlstest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// startTLSEtcd runs an etcd member whose client port requires a client certificate signed by
// the test CA (etcd's --client-cert-auth), and returns its https endpoint.
func startTLSEtcd(t *testing.T, server tlsx.Files) string {
	t.Helper()
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		ports := make([]int, 2)
		for i := range ports {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			ports[i] = l.Addr().(*net.TCPAddr).Port
			_ = l.Close()
		}
		cu, _ := url.Parse(fmt.Sprintf("https://127.0.0.1:%d", ports[0]))
		pu, _ := url.Parse(fmt.Sprintf("http://127.0.0.1:%d", ports[1]))
		cfg := embed.NewConfig()
		cfg.Name = "tls"
		cfg.Dir = t.TempDir()
		cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{*cu}, []url.URL{*cu}
		cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{*pu}, []url.URL{*pu}
		cfg.InitialCluster = cfg.Name + "=" + pu.String()
		cfg.ClientTLSInfo = transport.TLSInfo{CertFile: server.Cert, KeyFile: server.Key, TrustedCAFile: server.CA, ClientCertAuth: true}
		cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
		e, err := embed.StartEtcd(cfg)
		if err != nil {
			lastErr = err
			if strings.Contains(err.Error(), "address already in use") {
				continue
			}
			break
		}
		t.Cleanup(e.Close)
		select {
		case <-e.Server.ReadyNotify():
			return cu.String()
		case err := <-e.Err():
			t.Fatalf("tls etcd: %v", err)
		case <-time.After(30 * time.Second):
			t.Fatal("tls etcd not ready in 30s")
		}
	}
	t.Fatalf("tls etcd: %v", lastErr)
	return ""
}

// TestTLS runs the control plane with mutual TLS on its gRPC port and client-certificate auth
// to etcd, and checks what each role may do (reliability.md scenario 15).
func TestTLS(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	ep := startTLSEtcd(t, ca.Issue(t, "etcd", tlstest.Spec{}))
	etcdCli := ca.Issue(t, "kvc-controlplane", tlstest.Spec{})
	cpFiles := ca.Issue(t, "cp-tls", tlstest.Spec{Role: tlsx.RoleControlPlane})
	c := startCP(t, []string{ep}, "cp-tls", func(o *Options) { o.TLS, o.EtcdTLS = cpFiles, etcdCli })

	as := func(role tlsx.Role, workers ...string) *grpc.ClientConn {
		t.Helper()
		src, err := tlsx.Load(ca.Issue(t, strings.Join(append([]string{"client", string(role)}, workers...), "-"), tlstest.Spec{Role: role, Workers: workers}))
		if err != nil {
			t.Fatal(err)
		}
		conn, err := grpc.NewClient(c.grpcAddr, grpcx.DialOptions(src, tlsx.RoleControlPlane)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		return conn
	}
	reader := kvcv1.NewAdminServiceClient(as(tlsx.RoleOperatorRead))
	admin := kvcv1.NewAdminServiceClient(as(tlsx.RoleOperatorAdmin))
	waitFor(t, "leading over mTLS with etcd over mTLS", func() bool {
		r, err := reader.GetLeader(t.Context(), &kvcv1.GetLeaderRequest{})
		return err == nil && r.GetResponderIsLeader()
	})

	// operator-admin writes (the policy goes to etcd over mTLS); operator-read reads it back but
	// cannot write.
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	if _, err := admin.UpdatePolicy(ctx, &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{SeedMinTurn: proto.Int32(3)}}); err != nil {
		t.Fatalf("operator-admin UpdatePolicy: %v", err)
	}
	p, err := reader.GetPolicy(ctx, &kvcv1.GetPolicyRequest{})
	if err != nil || p.GetPolicy().GetSeedMinTurn() != 3 {
		t.Fatalf("operator-read GetPolicy: %v %v", p, err)
	}
	_, err = reader.UpdatePolicy(ctx, &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{SeedMinTurn: proto.Int32(1)}})
	if code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), `role "operator-read" may not call /kvc.v1.AdminService/UpdatePolicy`) {
		t.Fatalf("operator-read UpdatePolicy: %v", err)
	}
	_, err = reader.DrainWorker(ctx, &kvcv1.DrainWorkerRequest{WorkerId: "d0"})
	if code(err) != codes.PermissionDenied {
		t.Fatalf("operator-read DrainWorker: %v", err)
	}

	// A sidecar certificate names the workers it may register as: one for d1 cannot register
	// as d2, nor can one that names no worker; it can as d1.
	for _, tc := range []struct {
		workers []string
		hello   string
		want    string
	}{
		{[]string{"d1"}, "d2", `may not act as worker "d2"`},
		{nil, "d1", "names no worker"},
	} {
		_, _, err := open(t, &cp{conn: as(tlsx.RoleSidecar, tc.workers...)}, decodeHello(tc.hello))
		if code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), tc.want) {
			t.Fatalf("certificate for %v registering as %s: %v", tc.workers, tc.hello, err)
		}
		if _, err := reader.GetWorker(ctx, &kvcv1.GetWorkerRequest{WorkerId: tc.hello}); code(err) != codes.NotFound {
			t.Fatalf("%s registered by a certificate for %v: %v", tc.hello, tc.workers, err)
		}
	}
	if !metric(t, c, `kvc_cp_stream_messages_rejected_total{reason="worker_not_in_certificate"} 2`) {
		t.Fatal("refused hellos not counted")
	}
	d1 := &cp{conn: as(tlsx.RoleSidecar, "d1")}
	if _, w, err := open(t, d1, decodeHello("d1")); err != nil || w == nil {
		t.Fatalf("d1 certificate registering as d1: welcome %v, %v", w, err)
	}

	// A sidecar registers; a sidecar certificate cannot change the policy; a gateway
	// certificate cannot pose as a sidecar.
	sc := &cp{conn: as(tlsx.RoleSidecar, "d0")}
	if _, w, err := open(t, sc, decodeHello("d0")); err != nil || w == nil {
		t.Fatalf("sidecar over mTLS: welcome %v, %v", w, err)
	}
	waitFor(t, "d0 registered", func() bool {
		r, err := reader.GetWorker(t.Context(), &kvcv1.GetWorkerRequest{WorkerId: "d0"})
		return err == nil && r.GetWorker().GetState() == kvcv1.WorkerState_WORKER_STATE_READY
	})
	_, err = kvcv1.NewAdminServiceClient(sc.conn).UpdatePolicy(ctx, &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{}})
	if code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), `role "sidecar"`) {
		t.Fatalf("sidecar UpdatePolicy: %v", err)
	}
	if _, _, err := open(t, &cp{conn: as(tlsx.RoleGateway)}, decodeHello("d9")); code(err) != codes.PermissionDenied {
		t.Fatalf("gateway Connect: %v", err)
	}

	for _, id := range []string{"grpc", "etcd"} {
		if !metric(t, c, `kvc_tls_cert_expiry_timestamp_seconds{identity="`+id+`"}`) {
			t.Fatalf("no certificate expiry gauge for %s", id)
		}
	}

	// No client certificate: rejected at the handshake, before any handler.
	pool := x509.NewCertPool()
	pool.AddCert(ca.Cert)
	conn, err := grpc.NewClient(c.grpcAddr, append(grpcx.ClientOptions(),
		grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS13})))...)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := kvcv1.NewAdminServiceClient(conn).GetLeader(ctx, &kvcv1.GetLeaderRequest{}); code(err) != codes.Unavailable {
		t.Fatalf("no client certificate: %v", err)
	}

	// etcd itself rejects a client without a certificate.
	cli, err := etcdclient.New(etcdclient.Config{Endpoints: []string{ep}, DialTimeout: 2 * time.Second, Logger: zap.NewNop(),
		TLS: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS13}})
	if err == nil {
		defer cli.Close()
		gctx, gcancel := context.WithTimeout(t.Context(), 3*time.Second)
		_, err = cli.Get(gctx, "/kvc/")
		gcancel()
	}
	if err == nil {
		t.Fatal("etcd accepted a client without a certificate")
	}
}

// tlsHandler is a minimal sidecar for sidecar.ControlPlane.
type tlsHandler struct{ id string }

func (h tlsHandler) Hello() *kvcv1.Hello                         { return decodeHello(h.id) }
func (h tlsHandler) Resync() *kvcv1.ResidentSessions             { return &kvcv1.ResidentSessions{} }
func (h tlsHandler) Load() *kvcv1.WorkerLoad                     { return &kvcv1.WorkerLoad{} }
func (h tlsHandler) Policy(*kvcv1.Policy)                        {}
func (h tlsHandler) Apply(context.Context, *kvcv1.Command) error { return nil }

// TestTLSLeaderHint: an HA pair over mTLS (each replica with its own certificate); a sidecar
// that only knows the standby follows its leader hint to the leader, over mTLS.
func TestTLSLeaderHint(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	ep := startTLSEtcd(t, ca.Issue(t, "etcd", tlstest.Spec{}))
	etcdCli := ca.Issue(t, "kvc-controlplane", tlstest.Spec{})
	a := startCP(t, []string{ep}, "cp-a", func(o *Options) {
		o.TLS, o.EtcdTLS = ca.Issue(t, "cp-a", tlstest.Spec{Role: tlsx.RoleControlPlane}), etcdCli
	})
	opSrc, err := tlsx.Load(ca.Issue(t, "op", tlstest.Spec{Role: tlsx.RoleOperatorRead}))
	if err != nil {
		t.Fatal(err)
	}
	adminOf := func(addr string) kvcv1.AdminServiceClient {
		conn, err := grpc.NewClient(addr, grpcx.DialOptions(opSrc, tlsx.RoleControlPlane)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		return kvcv1.NewAdminServiceClient(conn)
	}
	aAdmin := adminOf(a.grpcAddr)
	waitFor(t, "cp-a leading", func() bool {
		r, err := aAdmin.GetLeader(t.Context(), &kvcv1.GetLeaderRequest{})
		return err == nil && r.GetResponderIsLeader()
	})
	b := startCP(t, []string{ep}, "cp-b", func(o *Options) {
		o.TLS, o.EtcdTLS = ca.Issue(t, "cp-b", tlstest.Spec{Role: tlsx.RoleControlPlane}), etcdCli
	})
	bAdmin := adminOf(b.grpcAddr)
	waitFor(t, "cp-b standing by and knowing the leader", func() bool {
		r, err := bAdmin.GetLeader(t.Context(), &kvcv1.GetLeaderRequest{})
		return err == nil && !r.GetResponderIsLeader() && r.GetLeaderAddr() == a.grpcAddr
	})
	scSrc, err := tlsx.Load(ca.Issue(t, "d7", tlstest.Spec{Role: tlsx.RoleSidecar, Workers: []string{"d7"}}))
	if err != nil {
		t.Fatal(err)
	}
	loop := sidecar.NewControlPlane(sidecar.CPConfig{Endpoints: []string{b.grpcAddr}, Heartbeat: 50 * time.Millisecond,
		DialOptions: []grpc.DialOption{cpclient.DialCredentials(scSrc)}}, tlsHandler{id: "d7"}, zerolog.Nop())
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan struct{})
	go func() { _ = loop.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	waitFor(t, "d7 registered on cp-a through cp-b's hint", func() bool {
		r, err := aAdmin.GetWorker(t.Context(), &kvcv1.GetWorkerRequest{WorkerId: "d7"})
		return err == nil && r.GetWorker().GetState() == kvcv1.WorkerState_WORKER_STATE_READY && r.GetWorker().GetConnectedTo() == "cp-a"
	})
}

// TestTLSWrongRole refuses to start with a certificate of another role.
func TestTLSWrongRole(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	o := NewOptions()
	o.NodeID, o.EtcdEndpoints = "cp", "http://127.0.0.1:1"
	o.TLS = ca.Issue(t, "cp", tlstest.Spec{Role: tlsx.RoleSidecar})
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	err := Run(t.Context(), o, zerolog.Nop())
	if err == nil || !strings.Contains(err.Error(), "spiffe://kvcentric/role/controlplane") {
		t.Fatalf("Run with a sidecar certificate: %v", err)
	}
}
