package kvcv1_test

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/bufbuild/protocompile"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestGeneratedCodeIsCurrent compiles every .proto file and compares it with the descriptor
// embedded in the committed generated code: a .proto edited without `make proto` fails here.
func TestGeneratedCodeIsCurrent(t *testing.T) {
	generated := map[string]protoreflect.FileDescriptor{
		"kvc/v1/common.proto":    kvcv1.File_kvc_v1_common_proto,
		"kvc/v1/admin.proto":     kvcv1.File_kvc_v1_admin_proto,
		"kvc/v1/sidecar.proto":   kvcv1.File_kvc_v1_sidecar_proto,
		"kvc/v1/router.proto":    kvcv1.File_kvc_v1_router_proto,
		"kvc/v1/bridge.proto":    kvcv1.File_kvc_v1_bridge_proto,
		"kvc/v1/peer.proto":      kvcv1.File_kvc_v1_peer_proto,
		"kvc/v1/execution.proto": kvcv1.File_kvc_v1_execution_proto,
	}
	files, err := filepath.Glob("*.proto")
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != len(generated) {
		t.Fatalf("found %d .proto files, the test knows %d: add new files to this test and run make proto", len(files), len(generated))
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	c := protocompile.Compiler{Resolver: protocompile.WithStandardImports(&protocompile.SourceResolver{ImportPaths: []string{root}})}
	for name, gen := range generated {
		if _, err := os.Stat(filepath.Join(root, name)); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		res, err := c.Compile(context.Background(), name)
		if err != nil {
			t.Fatalf("compile %s: %v", name, err)
		}
		want := protodesc.ToFileDescriptorProto(res[0])
		got := protodesc.ToFileDescriptorProto(gen)
		want.SourceCodeInfo, got.SourceCodeInfo = nil, nil
		if !proto.Equal(want, got) {
			t.Errorf("%s: generated code is stale; run `make proto` and commit the result", name)
		}
	}
	_ = descriptorpb.FileDescriptorProto{}
}
