package app

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestEmbeddedEtcdListsServices is what `grpcurl -plaintext ADDR list` checks: a control plane
// on its embedded etcd serves the three kvc services and health, through reflection.
func TestEmbeddedEtcdListsServices(t *testing.T) {
	dir := t.TempDir()
	o := NewOptions()
	o.NodeID = "cp-embedded"
	o.GRPCAddr, o.HTTPAddr = "127.0.0.1:0", "127.0.0.1:0"
	o.EmbeddedEtcdClientAddr, o.EmbeddedEtcdPeerAddr = "127.0.0.1:0", "127.0.0.1:0"
	o.DataDir = filepath.Join(dir, "etcd")
	o.ElectionTTL = 2 * time.Second
	o.ReadyFile = filepath.Join(dir, "ready.json")
	o.TLS.Insecure = true
	if err := o.Validate(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, o, zerolog.Nop()) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("run: %v", err)
		}
	}()
	var info readyInfo
	waitFor(t, "ready file", func() bool {
		b, err := os.ReadFile(o.ReadyFile)
		return err == nil && json.Unmarshal(b, &info) == nil
	})
	if info.EtcdClientAddr == "" || info.PID != os.Getpid() || info.NodeID != "cp-embedded" {
		t.Fatalf("ready file %+v", info)
	}
	conn, err := grpc.NewClient(info.GRPCAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	st, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}); err != nil {
		t.Fatal(err)
	}
	resp, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range resp.GetListServicesResponse().GetService() {
		names = append(names, s.GetName())
	}
	for _, want := range []string{"kvc.v1.AdminService", "kvc.v1.RouterService", "kvc.v1.SidecarService", "grpc.health.v1.Health"} {
		if !slices.Contains(names, want) {
			t.Errorf("service %s not listed (got %v)", want, names)
		}
	}
	admin := kvcv1.NewAdminServiceClient(conn)
	waitFor(t, "leading on embedded etcd", func() bool {
		r, err := admin.GetLeader(t.Context(), &kvcv1.GetLeaderRequest{})
		return err == nil && r.GetResponderIsLeader()
	})
}
