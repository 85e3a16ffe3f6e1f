package etcdtest

import (
	"context"
	"testing"
	"time"
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
