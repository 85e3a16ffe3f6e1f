package e2e

import (
	"bytes"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
	"github.com/kvcentric/kvcentric/pkg/tlsx/tlstest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func tlsArgs(f tlsx.Files) []string {
	return []string{"--tls-cert", f.Cert, "--tls-key", f.Key, "--tls-ca", f.CA}
}

// TestMutualTLS runs the real binaries with mutual TLS everywhere: kvc-controlplane with a
// controlplane certificate, a prefill and a decode sidecar with sidecar certificates. The
// sidecars register over mTLS, a seed transfer and the D→P snapshot pushes after it go through
// the sidecars' TransferPeerService over mTLS, and a plaintext sidecar is turned away. Sidecar
// certificates name their worker ids: one cannot act as another worker, neither towards the
// control plane nor towards a peer sidecar.
func TestMutualTLS(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	if bins["kvc-controlplane"] == "" {
		t.Fatal("kvc-controlplane binary not available")
	}
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	etcd := etcdtest.Start(t)
	cpProc := start(t, "cp-tls", bins["kvc-controlplane"], append([]string{"--node-id", "cp-tls", "--grpc-addr", "127.0.0.1:0",
		"--http-addr", "127.0.0.1:0", "--etcd-endpoints", strings.Join(etcd.Endpoints(), ","), "--etcd-prefix", "/kvc-e2e-tls/",
		"--election-ttl", "2s", "--flush-delay", "20ms"}, tlsArgs(ca.Issue(t, "cp", tlstest.Spec{Role: tlsx.RoleControlPlane}))...)...)
	cpAddr := cpProc.ReadyString("grpc_addr")
	dialAs := func(role tlsx.Role) *grpc.ClientConn {
		t.Helper()
		src, err := tlsx.Load(ca.Issue(t, "client-"+string(role), tlstest.Spec{Role: role}))
		if err != nil {
			t.Fatal(err)
		}
		conn, err := grpc.NewClient(cpAddr, grpcx.DialOptions(src, tlsx.RoleControlPlane)...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		return conn
	}
	admin := kvcv1.NewAdminServiceClient(dialAs(tlsx.RoleOperatorAdmin))
	waitFor(t, "the TLS control plane leading", 30*time.Second, func() bool {
		r, err := admin.GetLeader(ctxT(t, time.Second), &kvcv1.GetLeaderRequest{})
		return err == nil && r.GetResponderIsLeader()
	})
	if _, err := admin.UpdatePolicy(ctxT(t, 5*time.Second), &kvcv1.UpdatePolicyRequest{Policy: &kvcv1.Policy{
		SnapshotDeltaTokens: ptr(int64(64))}}); err != nil {
		t.Fatal(err)
	}

	p0 := startSidecar(t, "prefill", "p0", cpAddr, tlsArgs(ca.Issue(t, "p0", tlstest.Spec{Role: tlsx.RoleSidecar, Workers: []string{"p0"}}))...)
	d1 := &dworker{sc: startSidecar(t, "decode", "d1", cpAddr, tlsArgs(ca.Issue(t, "d1", tlstest.Spec{Role: tlsx.RoleSidecar, Workers: []string{"d1"}}))...),
		pages: map[string][]int64{}}
	pw := newWorker(t, p0, 256)
	d1.w = newWorker(t, d1.sc, 256)
	waitFor(t, "p0 and d1 registered over mTLS", 20*time.Second, func() bool {
		r, err := admin.ListWorkers(ctxT(t, time.Second), &kvcv1.ListWorkersRequest{})
		n := 0
		for _, w := range r.GetWorkers() {
			if w.GetState() == kvcv1.WorkerState_WORKER_STATE_READY {
				n++
			}
		}
		return err == nil && n == 2
	})

	// The peer port of a sidecar speaks mTLS only, and only to sidecars.
	for _, role := range []tlsx.Role{tlsx.RoleGateway, tlsx.RoleOperatorAdmin} {
		src, err := tlsx.Load(ca.Issue(t, "peer-"+string(role), tlstest.Spec{Role: role}))
		if err != nil {
			t.Fatal(err)
		}
		conn, err := grpc.NewClient(p0.peerAddr, grpcx.DialOptions(src, tlsx.RoleSidecar)...)
		if err != nil {
			t.Fatal(err)
		}
		_, err = kvcv1.NewTransferPeerServiceClient(conn).AbortSnapshot(ctxT(t, 5*time.Second), &kvcv1.AbortSnapshotRequest{IngestId: 1, Reason: "test"})
		_ = conn.Close()
		if status.Code(err) != codes.PermissionDenied {
			t.Fatalf("%s calling a sidecar's AbortSnapshot: %v", role, err)
		}
	}

	// A sidecar certificate acts only as the workers it names: one for d1 cannot reserve p0's
	// store pages as source d2, nor offer receive pages as decode worker d2 (the certificate
	// for d1 acting as d1 is what the seed and the snapshot pushes below do).
	d1Src, err := tlsx.Load(ca.Issue(t, "d1-client", tlstest.Spec{Role: tlsx.RoleSidecar, Workers: []string{"d1"}}))
	if err != nil {
		t.Fatal(err)
	}
	d1Conn, err := grpc.NewClient(p0.peerAddr, grpcx.DialOptions(d1Src, tlsx.RoleSidecar)...)
	if err != nil {
		t.Fatal(err)
	}
	defer d1Conn.Close()
	asD1 := kvcv1.NewTransferPeerServiceClient(d1Conn)
	layout := &kvcv1.KVLayout{PageSize: pageSize, ItemLen: 64, NumLayers: 1, BufferAddrs: []uint64{0, 0}, PageCount: 8}
	_, err = asD1.ReserveSnapshot(ctxT(t, 5*time.Second), &kvcv1.ReserveSnapshotRequest{SessionId: "sess-x", Generation: 1, Tokens: 16,
		SourceWorkerId: "d2", SourceLayout: layout})
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), `may not act as worker "d2"`) {
		t.Fatalf("ReserveSnapshot as d2 with d1's certificate: %v", err)
	}
	_, err = asD1.OfferReceive(ctxT(t, 5*time.Second), &kvcv1.OfferReceiveRequest{Room: 7, SessionId: "sess-x",
		Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED, DecodeWorkerId: "d2", DecodeTransferEndpoint: "127.0.0.1:1", DecodeLayout: layout,
		Pages: []int64{0}, Tokens: 16, DecodePeerAddr: "127.0.0.1:1"})
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), `may not act as worker "d2"`) {
		t.Fatalf("OfferReceive as d2 with d1's certificate: %v", err)
	}
	// An ingest d1 reserved can be committed or aborted only by a certificate naming d1.
	ing, err := asD1.ReserveSnapshot(ctxT(t, 5*time.Second), &kvcv1.ReserveSnapshotRequest{SessionId: "sess-y", Generation: 1, Tokens: 16,
		SourceWorkerId: "d1", SourceLayout: &kvcv1.KVLayout{PageSize: pageSize, ItemLen: itemLen, NumLayers: numLayers, PageCount: 8, BufferAddrs: make([]uint64, 2*numLayers)}})
	if err != nil {
		t.Fatalf("ReserveSnapshot as d1: %v", err)
	}
	d2Src, err := tlsx.Load(ca.Issue(t, "d2-client", tlstest.Spec{Role: tlsx.RoleSidecar, Workers: []string{"d2"}}))
	if err != nil {
		t.Fatal(err)
	}
	d2Conn, err := grpc.NewClient(p0.peerAddr, grpcx.DialOptions(d2Src, tlsx.RoleSidecar)...)
	if err != nil {
		t.Fatal(err)
	}
	defer d2Conn.Close()
	asD2 := kvcv1.NewTransferPeerServiceClient(d2Conn)
	if _, err := asD2.CommitSnapshot(ctxT(t, 5*time.Second), &kvcv1.CommitSnapshotRequest{IngestId: ing.GetIngestId()}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("CommitSnapshot of d1's ingest with d2's certificate: %v", err)
	}
	if _, err := asD2.AbortSnapshot(ctxT(t, 5*time.Second), &kvcv1.AbortSnapshotRequest{IngestId: ing.GetIngestId()}); status.Code(err) != codes.PermissionDenied {
		t.Fatalf("AbortSnapshot of d1's ingest with d2's certificate: %v", err)
	}
	if _, err := asD1.AbortSnapshot(ctxT(t, 5*time.Second), &kvcv1.AbortSnapshotRequest{IngestId: ing.GetIngestId(), Reason: "test"}); err != nil {
		t.Fatalf("AbortSnapshot of its own ingest by d1: %v", err)
	}

	// A gateway's Route stream: SEED into d1, P→D transfer through the peer services, then the
	// decode sidecar pushes snapshots to p0 (peer calls the other way).
	st, err := kvcv1.NewRouterServiceClient(dialAs(tlsx.RoleGateway)).Route(ctxT(t, 60*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	rt := &router{stream: st}
	const S, input, output = "sess-tls", 150, 10
	dec := rt.query(t, S, 0, input, output)
	if dec.GetMode() != kvcv1.RouteMode_ROUTE_MODE_SEED || dec.GetDecode().GetWorkerId() != "d1" {
		t.Fatalf("decision %v", dec)
	}
	ppages := pw.alloc((input+pageSize-1)/pageSize, 1)
	if err := kvpool.FillTokens(pw.pool, kvpool.SessionSeed(S), ppages, 0, input); err != nil {
		t.Fatal(err)
	}
	res := d1.receive(t, S, dec, kvcv1.TransferKind_TRANSFER_KIND_SEED, input, func() {
		if _, err := p0.bridge.SendKV(ctxT(t, 10*time.Second), &kvcv1.SendKVRequest{Room: dec.GetBootstrapRoom(), SessionId: S,
			Pages: ppages, Last: true, Tokens: input}); err != nil {
			t.Fatal(err)
		}
	})
	if !res.GetOk() {
		t.Fatalf("seed transfer over mTLS peers: %v", res)
	}
	d1.compute(t, S, input, input+output)
	rt.outcome(t, dec, input+output)
	waitFor(t, "the snapshot pushed to p0 over mTLS", 20*time.Second, func() bool {
		r, err := admin.GetSession(ctxT(t, time.Second), &kvcv1.GetSessionRequest{SessionId: S})
		return err == nil && r.GetSession().GetSnapshot().GetSeqlen() == input+output && r.GetSession().GetSnapshot().GetPrefillWorker() == "p0"
	})
	if got, want := snapshotKV(t, p0, S), kvBytes(d1.w, d1.pages[S], input+output); !bytes.Equal(got, want) {
		t.Fatalf("p0's snapshot: %d bytes differ from d1's KV (%d bytes)", len(got), len(want))
	}

	// The control plane's certificate is rotated on disk: the next connection gets the new one,
	// without a restart; the sidecars' streams stay up.
	ca.Issue(t, "cp", tlstest.Spec{Role: tlsx.RoleControlPlane})
	var pr peer.Peer
	if _, err := kvcv1.NewAdminServiceClient(dialAs(tlsx.RoleOperatorRead)).GetLeader(ctxT(t, 5*time.Second), &kvcv1.GetLeaderRequest{}, grpc.Peer(&pr)); err != nil {
		t.Fatal(err)
	}
	if got, want := pr.AuthInfo.(credentials.TLSInfo).State.PeerCertificates[0].SerialNumber, tlstest.Serial(t, filepath.Join(dir, "cp.pem")); got.Cmp(want) != 0 {
		t.Fatalf("control plane serves certificate %v after rotation, want %v", got, want)
	}
	if r, err := admin.GetWorker(ctxT(t, 5*time.Second), &kvcv1.GetWorkerRequest{WorkerId: "d1"}); err != nil || r.GetWorker().GetState() != kvcv1.WorkerState_WORKER_STATE_READY {
		t.Fatalf("d1 after the rotation: %v %v", r, err)
	}

	// A sidecar without certificates cannot reach the control plane: it keeps retrying and is
	// never registered.
	plain := startSidecar(t, "decode", "d-plain", cpAddr)
	newWorker(t, plain, 64)
	waitFor(t, "the plaintext sidecar turned away", 20*time.Second, func() bool {
		return strings.Count(plain.Log(), "control plane stream ended") >= 2
	})
	if _, err := admin.GetWorker(ctxT(t, 5*time.Second), &kvcv1.GetWorkerRequest{WorkerId: "d-plain"}); status.Code(err) != codes.NotFound {
		t.Fatalf("plaintext sidecar registered? %v", err)
	}

	// A sidecar whose certificate names another worker does not start (it would be refused at
	// its hello: the control plane's side of that check is TestTLS in controlplane/internal/app),
	// and says which worker id the certificate must name.
	wf := ca.Issue(t, "d3", tlstest.Spec{Role: tlsx.RoleSidecar, Workers: []string{"d9"}})
	cmd := exec.CommandContext(ctxT(t, 30*time.Second), bins["kvc-sidecar-decode"], append([]string{"--worker-id", "d3",
		"--bridge-socket", filepath.Join(t.TempDir(), "b.sock"), "--control-plane", cpAddr, "--transport", "tcp"}, tlsArgs(wf)...)...)
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), `may not act as worker "d3"`) || !strings.Contains(string(out), "worker:d3") {
		t.Fatalf("a sidecar with a certificate for d9 as d3: %v\n%s", err, out)
	}
	if _, err := admin.GetWorker(ctxT(t, 5*time.Second), &kvcv1.GetWorkerRequest{WorkerId: "d3"}); status.Code(err) != codes.NotFound {
		t.Fatalf("d3 registered with a certificate for d9? %v", err)
	}
}
