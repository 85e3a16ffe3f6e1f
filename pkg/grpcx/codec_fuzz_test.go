package grpcx

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// FuzzDecodeCodec: any bytes either decode (nothing recorded) or leave exactly one record that
// take turns into INVALID_ARGUMENT and forgets; Unmarshal itself never fails or panics.
func FuzzDecodeCodec(f *testing.F) {
	ok, _ := proto.Marshal(&kvcv1.ConnectRequest{Msg: &kvcv1.ConnectRequest_Hello{Hello: &kvcv1.Hello{WorkerId: "d0"}}})
	for _, s := range [][]byte{nil, ok, {0x08, 0xff}, {0x0a, 0x02, 0xff, 0xfe}, {0x0f}} {
		f.Add(s)
	}
	c := newDecodeCodec()
	f.Fuzz(func(t *testing.T, b []byte) {
		m := &kvcv1.ConnectRequest{}
		if err := c.Unmarshal(mem.BufferSlice{mem.SliceBuffer(b)}, m); err != nil {
			t.Fatalf("Unmarshal returned %v", err)
		}
		want := proto.Unmarshal(b, &kvcv1.ConnectRequest{})
		err := c.take(m)
		if (want == nil) != (err == nil) || (err != nil && status.Code(err) != codes.InvalidArgument) {
			t.Fatalf("take %v, proto.Unmarshal %v", err, want)
		}
		if c.take(m) != nil {
			t.Fatal("record not forgotten")
		}
	})
}
