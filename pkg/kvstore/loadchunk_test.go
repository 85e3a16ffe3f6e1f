package kvstore

import (
	"fmt"
	"testing"
	"unsafe"

	"google.golang.org/protobuf/proto"

	"github.com/kvcentric/kvcentric/pkg/etcdtest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestLoadAllDecodesIntoChunks: LoadAll's session records are decoded into arrays of
// loadChunk (one allocation each, not one per record), a malformed record between them
// leaves no trace in the next one, and every record reads back as written.
func TestLoadAllDecodesIntoChunks(t *testing.T) {
	c := etcdtest.Start(t)
	cli := c.Client(t)
	s := newStore(t, cli, "/chunks/")
	ctx := t.Context()
	want := map[string]*kvcv1.SessionRecord{}
	for i := range loadChunk {
		r := &kvcv1.SessionRecord{SessionId: fmt.Sprintf("s%03d", i), DecodeWorker: fmt.Sprintf("d%d", i%4),
			KvCommittedLen: int64(i), Turn: int32(i % 9), Generation: 2}
		if i%3 == 0 {
			r.Snapshot = &kvcv1.SnapshotInfo{PrefillWorker: "p0", Seqlen: int64(i), Generation: 2}
		}
		want[r.SessionId] = r
		b, err := proto.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(ctx, s.SessionKey(r.SessionId), string(b)); err != nil {
			t.Fatal(err)
		}
	}
	// Sorts between s100 and s101: it partly decodes (a session id, then garbage) into the
	// slot s101 then takes.
	if _, err := cli.Put(ctx, s.SessionKey("s100x"), "\x0a\x05s100x\xff\xff\xff"); err != nil {
		t.Fatal(err)
	}
	snap, err := s.LoadAll(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(snap.Sessions) != loadChunk || snap.Malformed != 1 {
		t.Fatalf("loaded %d sessions (%d malformed), want %d and 1", len(snap.Sessions), snap.Malformed, loadChunk)
	}
	size := unsafe.Sizeof(kvcv1.SessionRecord{})
	for i, r := range snap.Sessions {
		if w := want[r.GetSessionId()]; !proto.Equal(r, w) {
			t.Errorf("record %d = %v, want %v", i, r, w)
		}
		if i == 0 {
			continue
		}
		if d := uintptr(unsafe.Pointer(r)) - uintptr(unsafe.Pointer(snap.Sessions[i-1])); d != size {
			t.Fatalf("record %d is %d bytes after record %d, want %d (one chunk)", i, int64(d), i-1, size)
		}
	}
}
