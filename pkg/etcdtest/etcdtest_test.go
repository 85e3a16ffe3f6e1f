package etcdtest

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/etcdembed"
)

func TestSingleMemberPutGetRestart(t *testing.T) {
	c := Start(t)
	cli := c.Client(t)
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	if _, err := cli.Put(ctx, "k", "v"); err != nil {
		t.Fatal(err)
	}
	c.Member(0).Kill()
	if c.Member(0).Running() {
		t.Fatal("member still running after Kill")
	}
	c.Member(0).Restart(t)
	if err := c.WaitHealthy(ctx, cli); err != nil {
		t.Fatal(err)
	}
	resp, err := cli.Get(ctx, "k")
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != "v" {
		t.Fatalf("after restart got %v", resp.Kvs)
	}
}

func TestThreeMembersSurviveOneKill(t *testing.T) {
	if testing.Short() {
		t.Skip("3-member cluster")
	}
	c := StartN(t, 3)
	if got := len(c.Endpoints()); got != 3 {
		t.Fatalf("endpoints = %d", got)
	}
	cli := c.Client(t)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	c.Member(0).Kill()
	if err := c.WaitHealthy(ctx, cli); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, "k", "v"); err != nil {
		t.Fatalf("put with 2 of 3: %v", err)
	}
}

// A test member's WAL segments are preallocated at the throwaway size, not etcd's 64 MB: a run of
// hundreds of members must fit on a nearly full CI disk.
func TestMembersPreallocateSmallWALSegments(t *testing.T) {
	c := Start(t)
	segs, err := filepath.Glob(filepath.Join(c.Member(0).Dir, "member", "wal", "*"))
	if err != nil {
		t.Fatal(err)
	}
	if len(segs) == 0 {
		t.Fatalf("no WAL files under %s", c.Member(0).Dir)
	}
	for _, p := range segs {
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if st.Size() > etcdembed.ThrowawayWALSegmentBytes {
			t.Errorf("%s: %d bytes, want at most %d", filepath.Base(p), st.Size(), etcdembed.ThrowawayWALSegmentBytes)
		}
	}
}
