package grpcx_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
	"github.com/kvcentric/kvcentric/pkg/tlsx/tlstest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// BenchmarkMTLSOverhead measures a unary call on an open connection and a fresh connection
// (dial, handshake, one call) with mutual TLS and authorization, against plaintext measured in
// the same process, and reports the ratios (tls/plain).
func BenchmarkMTLSOverhead(b *testing.B) {
	dir := b.TempDir()
	ca := tlstest.NewCA(b, dir, "ca")
	srvSrc, err := tlsx.Load(ca.Issue(b, "cp", tlstest.Spec{Role: tlsx.RoleControlPlane}))
	if err != nil {
		b.Fatal(err)
	}
	cliSrc, err := tlsx.Load(ca.Issue(b, "op", tlstest.Spec{Role: tlsx.RoleOperatorRead}))
	if err != nil {
		b.Fatal(err)
	}
	serve := func(src *tlsx.Source) string {
		s := grpcx.NewServer(zerolog.Nop(), grpcx.WithTLS(src), grpcx.WithCallLogging(false))
		kvcv1.RegisterAdminServiceServer(s, policyOnly{})
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { _ = s.Serve(ctx, lis, time.Second); close(done) }()
		b.Cleanup(func() { cancel(); <-done })
		return lis.Addr().String()
	}
	plainAddr, tlsAddr := serve(nil), serve(srvSrc)
	call := func(cc *grpc.ClientConn) {
		if _, err := kvcv1.NewAdminServiceClient(cc).GetPolicy(context.Background(), &kvcv1.GetPolicyRequest{}); err != nil {
			b.Fatal(err)
		}
	}
	dial := func(addr string, src *tlsx.Source) *grpc.ClientConn {
		cc, err := grpc.NewClient(addr, grpcx.DialOptions(src, tlsx.RoleControlPlane)...)
		if err != nil {
			b.Fatal(err)
		}
		return cc
	}
	// perCall times n calls on one open connection; perConn times n fresh connections.
	perCall := func(addr string, src *tlsx.Source, n int) time.Duration {
		cc := dial(addr, src)
		defer cc.Close()
		call(cc)
		t0 := time.Now()
		for i := 0; i < n; i++ {
			call(cc)
		}
		return time.Since(t0) / time.Duration(n)
	}
	perConn := func(addr string, src *tlsx.Source, n int) time.Duration {
		t0 := time.Now()
		for i := 0; i < n; i++ {
			cc := dial(addr, src)
			call(cc)
			_ = cc.Close()
		}
		return time.Since(t0) / time.Duration(n)
	}
	b.ResetTimer()
	var callPlain, callTLS, connPlain, connTLS time.Duration
	for i := 0; i < b.N; i++ {
		// alternate the arms so that drift on a shared machine hits both alike
		callPlain += perCall(plainAddr, nil, 200)
		callTLS += perCall(tlsAddr, cliSrc, 200)
		connPlain += perConn(plainAddr, nil, 20)
		connTLS += perConn(tlsAddr, cliSrc, 20)
	}
	n := time.Duration(b.N)
	b.ReportMetric(float64(callPlain/n)/1e3, "call-plain-µs")
	b.ReportMetric(float64(callTLS/n)/1e3, "call-mtls-µs")
	b.ReportMetric(float64(callTLS)/float64(callPlain), "call-tls/plain")
	b.ReportMetric(float64(connPlain/n)/1e3, "conn-plain-µs")
	b.ReportMetric(float64(connTLS/n)/1e3, "conn-mtls-µs")
	b.ReportMetric(float64(connTLS)/float64(connPlain), "conn-tls/plain")
}

type policyOnly struct {
	kvcv1.UnimplementedAdminServiceServer
}

func (policyOnly) GetPolicy(context.Context, *kvcv1.GetPolicyRequest) (*kvcv1.GetPolicyResponse, error) {
	return &kvcv1.GetPolicyResponse{Policy: &kvcv1.Policy{}}, nil
}
