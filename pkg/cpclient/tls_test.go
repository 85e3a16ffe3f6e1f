package cpclient_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/cpclient"
	"github.com/kvcentric/kvcentric/pkg/grpcx"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
	"github.com/kvcentric/kvcentric/pkg/tlsx/tlstest"
)

// TestDialCredentials: a control-plane client reaches a server holding a controlplane
// certificate, refuses one holding a sidecar certificate, and dials plaintext without TLS.
func TestDialCredentials(t *testing.T) {
	dir := t.TempDir()
	ca := tlstest.NewCA(t, dir, "ca")
	cli, err := tlsx.Load(ca.Issue(t, "gw", tlstest.Spec{Role: tlsx.RoleGateway}))
	if err != nil {
		t.Fatal(err)
	}
	serve := func(src *tlsx.Source) string {
		s := grpcx.NewServer(zerolog.Nop(), grpcx.WithTLS(src))
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { _ = s.Serve(ctx, lis, time.Second); close(done) }()
		t.Cleanup(func() { cancel(); <-done })
		return lis.Addr().String()
	}
	load := func(name string, r tlsx.Role) *tlsx.Source {
		s, err := tlsx.Load(ca.Issue(t, name, tlstest.Spec{Role: r}))
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	tests := []struct {
		name   string
		server *tlsx.Source
		client *tlsx.Source
		want   codes.Code
	}{
		{"controlplane server", load("cp", tlsx.RoleControlPlane), cli, codes.OK},
		{"sidecar posing as the control plane", load("sc", tlsx.RoleSidecar), cli, codes.Unavailable},
		{"plaintext", nil, nil, codes.OK},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cc, err := grpc.NewClient(serve(tc.server), append(grpcx.ClientOptions(), cpclient.DialCredentials(tc.client))...)
			if err != nil {
				t.Fatal(err)
			}
			defer cc.Close()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err = healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
			if got := status.Code(err); got != tc.want {
				t.Fatalf("code %v (%v), want %v", got, err, tc.want)
			}
		})
	}
}
