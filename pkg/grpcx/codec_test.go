package grpcx_test

import (
	"context"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/pkg/grpcx"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// rawCodec sends and receives raw bytes, so a test can put anything on the wire.
type rawCodec struct{}

func (rawCodec) Name() string { return "proto" }
func (rawCodec) Marshal(v any) (mem.BufferSlice, error) {
	return mem.BufferSlice{mem.SliceBuffer(*v.(*[]byte))}, nil
}
func (rawCodec) Unmarshal(data mem.BufferSlice, v any) error {
	*v.(*[]byte) = data.Materialize()
	return nil
}

type echoAdmin struct {
	kvcv1.UnimplementedAdminServiceServer
}

func (echoAdmin) GetWorker(_ context.Context, r *kvcv1.GetWorkerRequest) (*kvcv1.GetWorkerResponse, error) {
	return &kvcv1.GetWorkerResponse{Worker: &kvcv1.Worker{WorkerId: r.GetWorkerId()}}, nil
}

type echoRouter struct {
	kvcv1.UnimplementedRouterServiceServer
}

func (echoRouter) Route(s grpc.BidiStreamingServer[kvcv1.RouteRequest, kvcv1.RouteResponse]) error {
	for {
		m, err := s.Recv()
		if err != nil {
			return err
		}
		if err := s.Send(&kvcv1.RouteResponse{Kind: &kvcv1.RouteResponse_Decision{Decision: &kvcv1.RouteDecision{
			RequestId: m.GetQuery().GetRequestId()}}}); err != nil {
			return err
		}
	}
}

func serveRaw(t *testing.T, opts ...grpcx.Option) *grpc.ClientConn {
	t.Helper()
	s := grpcx.NewServer(zerolog.Nop(), opts...)
	kvcv1.RegisterAdminServiceServer(s, echoAdmin{})
	kvcv1.RegisterRouterServiceServer(s, echoRouter{})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Serve(ctx, lis, time.Second) }()
	t.Cleanup(func() { cancel(); <-done })
	cc, err := grpc.NewClient(lis.Addr().String(), append(grpcx.ClientOptions(),
		grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithDefaultCallOptions(grpc.ForceCodecV2(rawCodec{})))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// stringField encodes field num as a length-delimited string of raw bytes.
func stringField(num protowire.Number, v string) []byte {
	b := protowire.AppendTag(nil, num, protowire.BytesType)
	return protowire.AppendString(b, v)
}

// TestDecodeErrorsAreInvalidArgument is issue 16 finding 6: malformed wire bytes and strings
// that are not UTF-8 are answered INVALID_ARGUMENT (not INTERNAL) without reaching the
// handler, on unary calls and on a stream's messages; valid bytes still work.
func TestDecodeErrorsAreInvalidArgument(t *testing.T) {
	cc := serveRaw(t)
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	valid, _ := proto.Marshal(&kvcv1.GetWorkerRequest{WorkerId: "d0"})
	for _, tc := range []struct {
		name string
		in   []byte
		want codes.Code
	}{
		{"valid", valid, codes.OK},
		{"truncated varint", []byte{0x08, 0xff}, codes.InvalidArgument},
		{"truncated length", []byte{0x0a, 0x7f, 'a'}, codes.InvalidArgument},
		{"bad wire type", []byte{0x0f}, codes.InvalidArgument},
		{"field number 0", []byte{0x02, 0x00}, codes.InvalidArgument},
		{"not UTF-8", stringField(1, "d\xff\xfe"), codes.InvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in, out := tc.in, []byte(nil)
			err := cc.Invoke(ctx, kvcv1.AdminService_GetWorker_FullMethodName, &in, &out)
			if status.Code(err) != tc.want {
				t.Fatalf("code %v (%v), want %v", status.Code(err), err, tc.want)
			}
			if tc.want == codes.OK {
				var r kvcv1.GetWorkerResponse
				if err := proto.Unmarshal(out, &r); err != nil || r.GetWorker().GetWorkerId() != "d0" {
					t.Fatalf("reply %v %v", &r, err)
				}
			} else if !strings.Contains(status.Convert(err).Message(), "malformed request message") {
				t.Fatalf("message %q", status.Convert(err).Message())
			}
		})
	}

	st, err := cc.NewStream(ctx, &grpc.StreamDesc{StreamName: "Route", ServerStreams: true, ClientStreams: true}, kvcv1.RouterService_Route_FullMethodName)
	if err != nil {
		t.Fatal(err)
	}
	good, _ := proto.Marshal(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{RequestId: "r1"}}})
	if err := st.SendMsg(&good); err != nil {
		t.Fatal(err)
	}
	var out []byte
	if err := st.RecvMsg(&out); err != nil {
		t.Fatalf("valid stream message: %v", err)
	}
	// RouteRequest{query (field 1): RouteQuery{request_id (field 1): not UTF-8}}
	bad := protowire.AppendBytes(protowire.AppendTag(nil, 1, protowire.BytesType), stringField(1, "r\xc3"))
	if err := st.SendMsg(&bad); err != nil {
		t.Fatal(err)
	}
	err = st.RecvMsg(&out)
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("malformed stream message: %v, want InvalidArgument", err)
	}
}

// TestServerMessageLimit: servers take 4 MiB requests unless configured otherwise.
func TestServerMessageLimit(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	big := func(n int) []byte {
		b, _ := proto.Marshal(&kvcv1.GetWorkerRequest{WorkerId: strings.Repeat("w", n)})
		return b
	}
	// Past the size check the request reaches validation (an id that long is refused there).
	decoded := func(err error) bool {
		return status.Code(err) == codes.InvalidArgument && strings.Contains(err.Error(), "longer than")
	}
	cc := serveRaw(t)
	var out []byte
	in := big(grpcx.ServerMaxRecvMsgSize - 16)
	if err := cc.Invoke(ctx, kvcv1.AdminService_GetWorker_FullMethodName, &in, &out); !decoded(err) {
		t.Fatalf("just under 4 MiB: %v", err)
	}
	in = big(grpcx.ServerMaxRecvMsgSize + 1)
	if err := cc.Invoke(ctx, kvcv1.AdminService_GetWorker_FullMethodName, &in, &out); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("over 4 MiB: %v, want ResourceExhausted", err)
	}
	cc8 := serveRaw(t, grpcx.WithMaxRecvMsgSize(8<<20))
	if err := cc8.Invoke(ctx, kvcv1.AdminService_GetWorker_FullMethodName, &in, &out); !decoded(err) {
		t.Fatalf("over 4 MiB with an 8 MiB limit: %v", err)
	}
}
