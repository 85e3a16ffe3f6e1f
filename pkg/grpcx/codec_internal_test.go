package grpcx

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestDecodeCodecRecordsCounted: a message that did not decode is found by take (and only
// once); once every record is taken or forgotten, the count that lets received messages skip
// the lookup is back at 0, and a message that decoded is never refused.
func TestDecodeCodecRecordsCounted(t *testing.T) {
	c := newDecodeCodec()
	bad := mem.BufferSlice{mem.SliceBuffer([]byte{0xff})} // a truncated tag: does not decode
	good := mem.BufferSlice{mem.SliceBuffer([]byte{0x0a, 0x01, 'w'})}
	var a, b, ok kvcv1.GetWorkerRequest
	for _, step := range []struct {
		name string
		data mem.BufferSlice
		m    *kvcv1.GetWorkerRequest
	}{{"a", bad, &a}, {"a again", bad, &a}, {"b", bad, &b}, {"ok", good, &ok}} {
		if err := c.Unmarshal(step.data, step.m); err != nil {
			t.Fatalf("%s: Unmarshal reported %v (it records instead)", step.name, err)
		}
	}
	if n := c.nbad.Load(); n != 2 {
		t.Fatalf("%d records counted, want 2 (a twice is one record)", n)
	}
	if err := c.take(&ok); err != nil {
		t.Fatalf("a decoded message refused: %v", err)
	}
	if err := c.take(&a); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("take(a) = %v, want INVALID_ARGUMENT", err)
	}
	if err := c.take(&a); err != nil {
		t.Fatalf("take(a) twice: %v", err)
	}
	c.forget(&b)
	if n := c.nbad.Load(); n != 0 {
		t.Fatalf("%d records counted after all were taken or forgotten, want 0", n)
	}
}
