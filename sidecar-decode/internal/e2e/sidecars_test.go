package e2e

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	"github.com/kvcentric/kvcentric/pkg/sidecar/cptest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// cluster: a scripted control plane, two prefill sidecars (p0 large store, p1 small store), two
// decode sidecars (d1, d2) and a slow decode sidecar (d3, every transfer request delayed).
type cluster struct {
	cp             *cptest.Server
	p0, p1, p2     *sidecarProc
	d1, d2, d3     *sidecarProc
	wp0, wp1, wp2  *worker
	wd1, wd2, wd3  *worker
	storeSmallPage int64
}

const delta = 64

func newCluster(t *testing.T) *cluster {
	t.Helper()
	d := int64(delta)
	cp, err := cptest.Start(1, &kvcv1.Policy{SnapshotDeltaTokens: &d})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cp.Close)
	c := &cluster{cp: cp}
	pageBytes := int64(2 * numLayers * itemLen)
	c.storeSmallPage = 24
	c.p0 = startSidecar(t, "prefill", "p0", cp.Addr, "--store-capacity-bytes", "8388608")
	c.p1 = startSidecar(t, "prefill", "p1", cp.Addr, "--store-capacity-bytes", itoa(c.storeSmallPage*pageBytes))
	c.p2 = startSidecar(t, "prefill", "p2", cp.Addr, "--fault-transfer-delay", "40ms")
	c.d1 = startSidecar(t, "decode", "d1", cp.Addr)
	c.d2 = startSidecar(t, "decode", "d2", cp.Addr)
	c.d3 = startSidecar(t, "decode", "d3", cp.Addr, "--fault-transfer-delay", "40ms")
	c.wp0, c.wp1, c.wp2 = newWorker(t, c.p0, 256), newWorker(t, c.p1, 256), newWorker(t, c.p2, 256)
	c.wd1, c.wd2, c.wd3 = newWorker(t, c.d1, 2048), newWorker(t, c.d2, 2048), newWorker(t, c.d3, 2048)
	if err := cp.Wait(ctxT(t, 20*time.Second), func(v *cptest.View) bool {
		for _, id := range []string{"p0", "p1", "p2", "d1", "d2", "d3"} {
			if !v.Connected(id) || v.Resync(id) == nil {
				return false
			}
		}
		return true
	}); err != nil {
		t.Fatal(err)
	}
	return c
}

func itoa(v int64) string { return strconv.FormatInt(v, 10) }

func (c *cluster) target(t *testing.T, d, p *sidecarProc, session string, gen uint64) {
	t.Helper()
	id, err := c.cp.Send(d.id, &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
		SessionId: session, PrefillWorkerId: p.id, PeerAddr: p.peerAddr, TransferEndpoint: p.transfer, Generation: gen}}})
	if err != nil {
		t.Fatal(err)
	}
	c.ack(t, id, true)
}

func (c *cluster) ack(t *testing.T, id uint64, wantOK bool) *kvcv1.CommandAck {
	t.Helper()
	var a *kvcv1.CommandAck
	if err := c.cp.Wait(ctxT(t, 10*time.Second), func(v *cptest.View) bool { a = v.Ack(id); return a != nil }); err != nil {
		t.Fatal(err)
	}
	if a.GetOk() != wantOK {
		t.Fatalf("ack %v, want ok=%v", a, wantOK)
	}
	return a
}

func (c *cluster) waitIngested(t *testing.T, p *sidecarProc, session string, seqlen int64) {
	t.Helper()
	if err := c.cp.Wait(ctxT(t, 20*time.Second), func(v *cptest.View) bool {
		for _, e := range v.Events() {
			if e.Worker == p.id && e.Ev.GetSessionId() == session && e.Ev.GetKind() == kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_INGESTED && e.Ev.GetKvLen() == seqlen {
				return true
			}
		}
		return false
	}); err != nil {
		t.Fatalf("snapshot of %s at %d never ingested on %s: %v", session, seqlen, p.id, err)
	}
}

// turns commits n turns of a session on a decode worker, each appending a different number of
// tokens, waiting for the snapshot of each turn; it returns the pages and the final length.
func (c *cluster) turns(t *testing.T, d *sidecarProc, w *worker, p *sidecarProc, session string, lens []int64, stride int64) ([]int64, int64) {
	t.Helper()
	seed := kvpool.SessionSeed(session)
	var pages []int64
	var prev int64
	for _, n := range lens {
		need := int((n+pageSize-1)/pageSize) - len(pages)
		pages = append(pages, w.alloc(need, stride)...)
		if err := kvpool.FillTokens(w.pool, seed, pages, prev, n); err != nil {
			t.Fatal(err)
		}
		res, err := d.bridge.CommitSession(ctxT(t, 5*time.Second), &kvcv1.CommitSessionRequest{SessionId: session, CommittedLen: n, Pages: pages})
		if err != nil {
			t.Fatalf("commit %d: %v", n, err)
		}
		if !res.GetPushEnqueued() {
			t.Fatalf("commit %d of %s enqueued no push", n, session)
		}
		if p != nil {
			c.waitIngested(t, p, session, n)
		}
		prev = n
	}
	return pages, prev
}

func TestSidecars(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	c := newCluster(t)

	t.Run("incremental snapshots then reseed into another D", func(t *testing.T) {
		const s = "sess-incr"
		c.target(t, c.d1, c.p0, s, 1)
		lens := []int64{300}
		for i := 1; i < 10; i++ {
			lens = append(lens, lens[i-1]+int64(70+i*37))
		}
		pages, n := c.turns(t, c.d1, c.wd1, c.p0, s, lens, 1)

		// bytes moved per push are the append, not the context
		// D logs a push as sent once P's commit answer is back, just after P reported the ingest
		var sent []sidecar.Event
		waitFor(t, "every push logged as sent", 10*time.Second, func() bool {
			sent = filterEvents(readEvents(t, c.d1.events), sidecar.EvPushSent, s)
			return len(sent) >= len(lens)
		})
		if len(sent) != len(lens) {
			t.Fatalf("%d pushes for %d turns: %+v", len(sent), len(lens), sent)
		}
		var total int64
		for i, e := range sent {
			var base int64
			if i > 0 {
				base = lens[i-1]
			}
			if e.BaseLen != base || e.Tokens != lens[i]-base || e.Bytes != (lens[i]-base)*bpt || e.Seqlen != lens[i] {
				t.Fatalf("push %d: base %d tokens %d bytes %d seqlen %d; want base %d, %d tokens, %d bytes", i, e.BaseLen, e.Tokens, e.Bytes, e.Seqlen, base, lens[i]-base, (lens[i]-base)*bpt)
			}
			total += e.Bytes
		}
		if total != n*bpt {
			t.Fatalf("pushed %d bytes in all; the context is %d", total, n*bpt)
		}
		// P's snapshot equals D's KV byte for byte
		st := snapshotStatus(t, c.p0, s)
		if !st.Exists || st.Seqlen != n || st.Generation != 1 || st.Bytes == 0 {
			t.Fatalf("status %+v", st)
		}
		if got, want := snapshotKV(t, c.p0, s), kvBytes(c.wd1, pages, n); !bytes.Equal(got, want) {
			t.Fatalf("snapshot differs from D's KV (%d vs %d bytes)", len(got), len(want))
		}

		// D1 loses the session; the control plane reseeds it into D2 from the snapshot
		if _, err := c.d1.bridge.ReleaseSession(ctxT(t, 5*time.Second), &kvcv1.ReleaseSessionRequest{SessionId: s, Reason: kvcv1.ReleaseReason_RELEASE_REASON_EVICTED}); err != nil {
			t.Fatal(err)
		}
		if err := c.cp.Wait(ctxT(t, 5*time.Second), func(v *cptest.View) bool {
			return v.FindEvent("d1", s, kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED) != nil
		}); err != nil {
			t.Fatal(err)
		}
		const room = 7001
		id, err := c.cp.Send("p0", &kvcv1.Command{Action: &kvcv1.Command_PushSnapshot{PushSnapshot: &kvcv1.PushSnapshotCommand{
			SessionId: s, Generation: 1, Seqlen: n, DecodeWorkerId: "d2", DecodePeerAddr: c.d2.peerAddr, DecodeTransferEndpoint: c.d2.transfer, Room: room}}})
		if err != nil {
			t.Fatal(err)
		}
		c.ack(t, id, true)
		dpages := c.wd2.alloc(int((n+pageSize-1)/pageSize), 3)
		if _, err := c.d2.bridge.PrepareReceive(ctxT(t, 5*time.Second), &kvcv1.PrepareReceiveRequest{Room: room, SessionId: s,
			Kind: kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, Pages: dpages, Tokens: n, SourcePeerAddr: c.p0.peerAddr}); err != nil {
			t.Fatal(err)
		}
		res, err := c.d2.bridge.WaitReceive(ctxT(t, 20*time.Second), &kvcv1.WaitReceiveRequest{Room: room, TimeoutMs: 15000})
		if err != nil || !res.GetOk() || res.GetBytes() != n*bpt {
			t.Fatalf("reseed: %v %v", res, err)
		}
		if bad, err := kvpool.CheckTokens(c.wd2.pool, kvpool.SessionSeed(s), dpages, 0, n); err != nil || bad != 0 {
			t.Fatalf("D2 pages after reseed: %d mismatches, %v", bad, err)
		}
		if hits := filterEvents(readEvents(t, c.p0.events), sidecar.EvBypassHit, s); len(hits) != 1 || hits[0].Bytes != n*bpt {
			t.Fatalf("bypass hits %+v", hits)
		}
		if err := c.cp.Wait(ctxT(t, 5*time.Second), func(v *cptest.View) bool {
			e := v.FindEvent("d2", s, kvcv1.SessionEventKind_SESSION_EVENT_KIND_TRANSFER_DONE)
			return e != nil && e.GetBytes() == n*bpt && e.GetRoom() == room
		}); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("release during a slow push returns after the abort", func(t *testing.T) {
		const s = "sess-slow"
		c.target(t, c.d3, c.p0, s, 1)
		// scattered pages: one transfer request per page per buffer, each delayed 40 ms
		pages := c.wd3.alloc(32, 2)
		n := int64(32 * pageSize)
		if err := kvpool.FillTokens(c.wd3.pool, kvpool.SessionSeed(s), pages, 0, n); err != nil {
			t.Fatal(err)
		}
		if _, err := c.d3.bridge.CommitSession(ctxT(t, 5*time.Second), &kvcv1.CommitSessionRequest{SessionId: s, CommittedLen: n, Pages: pages}); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "the push to start", 10*time.Second, func() bool {
			var ss []struct {
				SessionID string `json:"session_id"`
				Pushing   bool   `json:"pushing"`
			}
			getJSON(t, "http://"+c.d3.httpAddr+"/v1/sessions", &ss)
			return len(ss) == 1 && ss[0].Pushing
		})
		res, err := c.d3.bridge.ReleaseSession(ctxT(t, 10*time.Second), &kvcv1.ReleaseSessionRequest{SessionId: s, Reason: kvcv1.ReleaseReason_RELEASE_REASON_RELEASED})
		if err != nil || !res.GetPushAborted() {
			t.Fatalf("release: %v %v", res, err)
		}
		// the abort is complete when ReleaseSession returns: it is already in the event log
		ab := filterEvents(readEvents(t, c.d3.events), sidecar.EvPushAborted, s)
		if len(ab) != 1 || ab[0].Bytes >= n*bpt {
			t.Fatalf("aborted events %+v", ab)
		}
		// the worker frees and reuses the pages; nothing may reach the store from them
		for b := 0; b < 2*numLayers; b++ {
			clear(c.wd3.pool.Buffer(b))
		}
		waitFor(t, "P to drop the reservation", 10*time.Second, func() bool {
			return len(filterEvents(readEvents(t, c.p0.events), sidecar.EvRecvRejected, s)) == 1
		})
		if st := snapshotStatus(t, c.p0, s); st.Exists {
			t.Fatalf("aborted push left a snapshot: %+v", st)
		}
		if ss := filterEvents(readEvents(t, c.d3.events), sidecar.EvPushSent, s); len(ss) != 0 {
			t.Fatalf("push reported sent after release: %+v", ss)
		}
	})

	t.Run("store full evicts LRU by bytes and the next reseed misses", func(t *testing.T) {
		// p1's store holds 24 pages; each session needs 10
		for _, s := range []string{"lru-a", "lru-b", "lru-c"} {
			c.target(t, c.d1, c.p1, s, 1)
			c.turns(t, c.d1, c.wd1, c.p1, s, []int64{160}, 1)
		}
		if err := c.cp.Wait(ctxT(t, 5*time.Second), func(v *cptest.View) bool {
			e := v.FindEvent("p1", "lru-a", kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_EVICTED)
			return e != nil && e.GetDetail() == "capacity"
		}); err != nil {
			t.Fatal(err)
		}
		if st := snapshotStatus(t, c.p1, "lru-b"); !st.Exists || st.Seqlen != 160 {
			t.Fatalf("lru-b: %+v", st)
		}
		ev := filterEvents(readEvents(t, c.p1.events), sidecar.EvEvicted, "lru-a")
		if len(ev) != 1 || ev[0].Reason != "capacity" || ev[0].Bytes != 10*2*numLayers*itemLen {
			t.Fatalf("evicted events %+v", ev)
		}
		const room = 7002
		id, _ := c.cp.Send("p1", &kvcv1.Command{Action: &kvcv1.Command_PushSnapshot{PushSnapshot: &kvcv1.PushSnapshotCommand{
			SessionId: "lru-a", Generation: 1, Seqlen: 160, DecodeWorkerId: "d2", DecodePeerAddr: c.d2.peerAddr, DecodeTransferEndpoint: c.d2.transfer, Room: room}}})
		if a := c.ack(t, id, false); !strings.Contains(a.GetError(), "snapshot_missing") {
			t.Fatalf("ack %v", a)
		}
		dpages := c.wd2.alloc(10, 1)
		if _, err := c.d2.bridge.PrepareReceive(ctxT(t, 5*time.Second), &kvcv1.PrepareReceiveRequest{Room: room, SessionId: "lru-a",
			Kind: kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, Pages: dpages, Tokens: 160, SourcePeerAddr: c.p1.peerAddr}); err != nil {
			t.Fatal(err)
		}
		res, err := c.d2.bridge.WaitReceive(ctxT(t, 10*time.Second), &kvcv1.WaitReceiveRequest{Room: room, TimeoutMs: 5000})
		if err != nil || res.GetOk() || !strings.Contains(res.GetError(), "snapshot_missing") {
			t.Fatalf("reseed of an evicted snapshot: %v %v", res, err)
		}
		if m := filterEvents(readEvents(t, c.p1.events), sidecar.EvBypassMiss, "lru-a"); len(m) != 1 || m[0].Reason != "snapshot_missing" {
			t.Fatalf("bypass miss events %+v", m)
		}

		// d1 still believes 160 tokens of lru-a are on p1: the next push meets a base mismatch and
		// falls back to a full push from 0
		pages := []int64{}
		var ss []struct {
			SessionID string `json:"session_id"`
		}
		getJSON(t, "http://"+c.d1.httpAddr+"/v1/sessions", &ss)
		pages = append(pages, c.wd1.alloc(10, 1)...) // the worker's pages of lru-a are re-filled below
		if err := kvpool.FillTokens(c.wd1.pool, kvpool.SessionSeed("lru-a"), pages, 0, 160); err != nil {
			t.Fatal(err)
		}
		more := append(pages, c.wd1.alloc(5, 1)...)
		if err := kvpool.FillTokens(c.wd1.pool, kvpool.SessionSeed("lru-a"), more, 160, 240); err != nil {
			t.Fatal(err)
		}
		if _, err := c.d1.bridge.CommitSession(ctxT(t, 5*time.Second), &kvcv1.CommitSessionRequest{SessionId: "lru-a", CommittedLen: 240, Pages: more}); err != nil {
			t.Fatal(err)
		}
		c.waitIngested(t, c.p1, "lru-a", 240)
		var sent []sidecar.Event
		waitFor(t, "the full push logged", 5*time.Second, func() bool {
			sent = filterEvents(readEvents(t, c.d1.events), sidecar.EvPushSent, "lru-a")
			return len(sent) == 2
		})
		failed := filterEvents(readEvents(t, c.d1.events), sidecar.EvPushFailed, "lru-a")
		if len(failed) != 1 || failed[0].BaseLen != 160 || !strings.Contains(failed[0].Reason, "does not match the stored seqlen 0") {
			t.Fatalf("mismatch events %+v", failed)
		}
		if sent[1].BaseLen != 0 || sent[1].Tokens != 240 || sent[1].Bytes != 240*bpt {
			t.Fatalf("full push %+v", sent[1])
		}
		if got, want := snapshotKV(t, c.p1, "lru-a"), kvBytes(c.wd1, more, 240); !bytes.Equal(got, want) {
			t.Fatal("snapshot after the full push differs from D's KV")
		}
	})

	t.Run("a failing push is retried once, then dropped", func(t *testing.T) {
		const s = "sess-dead-target"
		id, err := c.cp.Send("d2", &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
			SessionId: s, PrefillWorkerId: "p-gone", PeerAddr: "127.0.0.1:1", TransferEndpoint: "127.0.0.1:1", Generation: 1}}})
		if err != nil {
			t.Fatal(err)
		}
		c.ack(t, id, true)
		c.turns(t, c.d2, c.wd2, nil, s, []int64{100}, 1)
		var failed []sidecar.Event
		waitFor(t, "two failed attempts", 30*time.Second, func() bool {
			failed = filterEvents(readEvents(t, c.d2.events), sidecar.EvPushFailed, s)
			return len(failed) >= 2
		})
		if len(failed) != 2 || failed[0].Attempt != 1 || failed[1].Attempt != 2 {
			t.Fatalf("failed attempts %+v", failed)
		}
		var st []struct {
			SessionID     string `json:"session_id"`
			LastPushedLen int64  `json:"last_pushed_len"`
			Pushing       bool   `json:"pushing"`
		}
		waitFor(t, "the push to be dropped", 5*time.Second, func() bool {
			getJSON(t, "http://"+c.d2.httpAddr+"/v1/sessions", &st)
			for _, x := range st {
				if x.SessionID == s {
					return !x.Pushing && x.LastPushedLen == 0
				}
			}
			return false
		})
		if n := len(filterEvents(readEvents(t, c.d2.events), sidecar.EvPushFailed, s)); n != 2 {
			t.Fatalf("%d failed attempts after the drop", n)
		}
	})

	t.Run("seed P to D with SendKV before and after the offer", func(t *testing.T) {
		const s, room = "sess-seed", int64(7003)
		n := int64(1000)
		npages := int((n + pageSize - 1) / pageSize)
		ppages := c.wp0.alloc(npages, 1)
		if err := kvpool.FillTokens(c.wp0.pool, kvpool.SessionSeed(s), ppages, 0, n); err != nil {
			t.Fatal(err)
		}
		half := npages / 2
		var wg sync.WaitGroup
		var firstErr error
		wg.Add(1)
		go func() { // the first chunk arrives before the decode side's offer
			defer wg.Done()
			_, firstErr = c.p0.bridge.SendKV(ctxT(t, 20*time.Second), &kvcv1.SendKVRequest{Room: room, SessionId: s, Pages: ppages[:half], FirstPage: 0})
		}()
		dpages := c.wd2.alloc(npages, 1)
		if _, err := c.d2.bridge.PrepareReceive(ctxT(t, 5*time.Second), &kvcv1.PrepareReceiveRequest{Room: room, SessionId: s,
			Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED, Pages: dpages, Tokens: n, SourcePeerAddr: c.p0.peerAddr}); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		if firstErr != nil {
			t.Fatal(firstErr)
		}
		if _, err := c.p0.bridge.SendKV(ctxT(t, 20*time.Second), &kvcv1.SendKVRequest{Room: room, SessionId: s, Pages: ppages[half:],
			FirstPage: int64(half), Last: true, Tokens: n}); err != nil {
			t.Fatal(err)
		}
		res, err := c.d2.bridge.WaitReceive(ctxT(t, 10*time.Second), &kvcv1.WaitReceiveRequest{Room: room, TimeoutMs: 5000})
		if err != nil || !res.GetOk() || res.GetBytes() != n*bpt {
			t.Fatalf("seed: %v %v", res, err)
		}
		if bad, err := kvpool.CheckTokens(c.wd2.pool, kvpool.SessionSeed(s), dpages, 0, n); err != nil || bad != 0 {
			t.Fatalf("D2 pages after seed: %d mismatches, %v", bad, err)
		}
	})

	t.Run("prefill worker gone mid-transfer: the decode side is told, nothing hangs", func(t *testing.T) {
		const s, room = "sess-gone", int64(7004)
		n := int64(32 * pageSize)
		ppages := c.wp2.alloc(32, 2) // scattered: one slow request per page per buffer
		if err := kvpool.FillTokens(c.wp2.pool, kvpool.SessionSeed(s), ppages, 0, n); err != nil {
			t.Fatal(err)
		}
		dpages := c.wd2.alloc(32, 1)
		if _, err := c.d2.bridge.PrepareReceive(ctxT(t, 5*time.Second), &kvcv1.PrepareReceiveRequest{Room: room, SessionId: s,
			Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED, Pages: dpages, Tokens: n, SourcePeerAddr: c.p2.peerAddr}); err != nil {
			t.Fatal(err)
		}
		// the worker's call dies after 300 ms, in the middle of a ~10 s transfer
		_, err := c.p2.bridge.SendKV(ctxT(t, 300*time.Millisecond), &kvcv1.SendKVRequest{Room: room, SessionId: s, Pages: ppages, Last: true, Tokens: n})
		if status.Code(err) != codes.DeadlineExceeded {
			t.Fatalf("SendKV: %v", err)
		}
		res, err := c.d2.bridge.WaitReceive(ctxT(t, 10*time.Second), &kvcv1.WaitReceiveRequest{Room: room, TimeoutMs: 8000})
		if err != nil || res.GetOk() || !strings.Contains(res.GetError(), "went away") {
			t.Fatalf("decode side after the prefill worker left: %v %v", res, err)
		}
		// the room is closed on P: a late chunk is refused, not written
		if _, err := c.p2.bridge.SendKV(ctxT(t, 5*time.Second), &kvcv1.SendKVRequest{Room: room, SessionId: s, Pages: ppages[:1]}); status.Code(err) != codes.FailedPrecondition {
			t.Fatalf("late chunk: %v", err)
		}
	})

	t.Run("bad input", func(t *testing.T) {
		const s = "sess-bad"
		pages := c.wd1.alloc(4, 1)
		if _, err := c.d1.bridge.CommitSession(ctxT(t, 5*time.Second), &kvcv1.CommitSessionRequest{SessionId: s, CommittedLen: 60, Pages: pages}); err != nil {
			t.Fatal(err)
		}
		conn, err := grpc.NewClient(c.p1.peerAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		peer := kvcv1.NewTransferPeerServiceClient(conn)
		layout := &kvcv1.KVLayout{PageSize: pageSize, ItemLen: itemLen, NumLayers: numLayers, PageCount: 2048, BufferAddrs: make([]uint64, 2*numLayers)}
		tests := []struct {
			name string
			call func(ctx context.Context) error
			want codes.Code
		}{
			{"shrinking commit", func(ctx context.Context) error {
				_, err := c.d1.bridge.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: s, CommittedLen: 30, Pages: pages[:2]})
				return err
			}, codes.FailedPrecondition},
			{"page outside the pool", func(ctx context.Context) error {
				_, err := c.d1.bridge.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: s, CommittedLen: 64, Pages: []int64{0, 1, 2, 2048}})
				return err
			}, codes.OutOfRange},
			{"pages do not cover the length", func(ctx context.Context) error {
				_, err := c.d1.bridge.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: s, CommittedLen: 100, Pages: pages})
				return err
			}, codes.InvalidArgument},
			{"bad session id", func(ctx context.Context) error {
				_, err := c.d1.bridge.CommitSession(ctx, &kvcv1.CommitSessionRequest{SessionId: "a/b", CommittedLen: 1, Pages: pages[:1]})
				return err
			}, codes.InvalidArgument},
			{"release of an unknown session", func(ctx context.Context) error {
				_, err := c.d1.bridge.ReleaseSession(ctx, &kvcv1.ReleaseSessionRequest{SessionId: "nobody"})
				return err
			}, codes.NotFound},
			{"wait on an unknown room", func(ctx context.Context) error {
				_, err := c.d1.bridge.WaitReceive(ctx, &kvcv1.WaitReceiveRequest{Room: 999999})
				return err
			}, codes.NotFound},
			{"SendKV on a decode sidecar", func(ctx context.Context) error {
				_, err := c.d1.bridge.SendKV(ctx, &kvcv1.SendKVRequest{Room: 1})
				return err
			}, codes.FailedPrecondition},
			{"reserve larger than the store", func(ctx context.Context) error {
				_, err := peer.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: "big", Generation: 1, Tokens: 25 * pageSize, SourceLayout: layout})
				return err
			}, codes.ResourceExhausted},
			{"reserve with another geometry", func(ctx context.Context) error {
				l := &kvcv1.KVLayout{PageSize: 32, ItemLen: itemLen, NumLayers: numLayers, PageCount: 8, BufferAddrs: make([]uint64, 2*numLayers)}
				_, err := peer.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: "geo", Generation: 1, Tokens: 16, SourceLayout: l})
				return err
			}, codes.FailedPrecondition},
			{"push for a replaced generation", func(ctx context.Context) error {
				// lru-c holds generation 1 on p1; replace it with generation 2, then push generation 1
				r, err := peer.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: "lru-c", Generation: 2, Tokens: 16, SourceLayout: layout})
				if err != nil {
					return err
				}
				if _, err := peer.CommitSnapshot(ctx, &kvcv1.CommitSnapshotRequest{IngestId: r.GetIngestId()}); err != nil {
					return err
				}
				_, err = peer.ReserveSnapshot(ctx, &kvcv1.ReserveSnapshotRequest{SessionId: "lru-c", Generation: 1, BaseLen: 160, Tokens: 16, SourceLayout: layout})
				return err
			}, codes.FailedPrecondition},
			{"commit of an unknown ingest", func(ctx context.Context) error {
				_, err := peer.CommitSnapshot(ctx, &kvcv1.CommitSnapshotRequest{IngestId: 424242})
				return err
			}, codes.NotFound},
			{"offer without pages", func(ctx context.Context) error {
				_, err := peer.OfferReceive(ctx, &kvcv1.OfferReceiveRequest{Room: 5, SessionId: "x", Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED,
					DecodeLayout: layout, Tokens: 64, DecodePeerAddr: "127.0.0.1:1", DecodeTransferEndpoint: "127.0.0.1:1"})
				return err
			}, codes.InvalidArgument},
		}
		for _, tt := range tests {
			t.Run(tt.name, func(t *testing.T) {
				if err := tt.call(ctxT(t, 5*time.Second)); status.Code(err) != tt.want {
					t.Fatalf("got %v, want %v", err, tt.want)
				}
			})
		}
		// the session is unchanged by the refused commits
		var ss []struct {
			SessionID    string `json:"session_id"`
			CommittedLen int64  `json:"committed_len"`
		}
		getJSON(t, "http://"+c.d1.httpAddr+"/v1/sessions", &ss)
		found := false
		for _, x := range ss {
			if x.SessionID == s {
				found = x.CommittedLen == 60
			}
		}
		if !found {
			t.Fatalf("session after bad commits: %+v", ss)
		}
	})

	t.Run("metrics mirror the event log", func(t *testing.T) {
		for _, sc := range []*sidecarProc{c.d1, c.p0} {
			resp, err := http.Get("http://" + sc.httpAddr + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			for _, want := range map[string][]string{
				"d1": {`kvc_sidecar_events_total{event="snapshot_push_sent"}`, "kvc_snapshot_push_bytes_sum", "kvc_snapshot_push_duration_seconds_count"},
				"p0": {`kvc_sidecar_events_total{event="snapshot_recv_ingested"}`, `kvc_sidecar_events_total{event="snapshot_bypass_hit"}`},
			}[sc.id] {
				if !strings.Contains(string(b), want) {
					t.Fatalf("%s /metrics lacks %s", sc.id, want)
				}
			}
		}
	})

	t.Run("resync reports the residency truth", func(t *testing.T) {
		var sessions []string
		getJSON(t, "http://"+c.d1.httpAddr+"/v1/sessions", &[]any{})
		c.cp.Kick()
		if err := c.cp.Wait(ctxT(t, 10*time.Second), func(v *cptest.View) bool {
			if v.Connects("d1") < 2 || !v.Connected("d1") || v.Resync("d1") == nil {
				return false
			}
			sessions = sessions[:0]
			for _, r := range v.Resync("d1").GetSessions() {
				sessions = append(sessions, r.GetSessionId())
			}
			return true
		}); err != nil {
			t.Fatal(err)
		}
		var truth []struct {
			SessionID string `json:"session_id"`
		}
		getJSON(t, "http://"+c.d1.httpAddr+"/v1/sessions", &truth)
		if len(truth) != len(sessions) {
			t.Fatalf("resync %v, truth %+v", sessions, truth)
		}
		for i := range truth {
			if truth[i].SessionID != sessions[i] {
				t.Fatalf("resync %v, truth %+v", sessions, truth)
			}
		}
	})

	t.Run("a full push of a new generation copies into store credit first", func(t *testing.T) {
		const s = "sess-credit"
		const n = 300
		c.target(t, c.d1, c.p0, s, 1)
		pages, _ := c.turns(t, c.d1, c.wd1, c.p0, s, []int64{n}, 1)
		// generation 2 re-pushes everything from 0: a full push, now with the credit that the
		// first push's reservation asked for (d1's: it pushed to p0 before, so it already holds
		// credit there)
		c.target(t, c.d1, c.p0, s, 2)
		var sent []sidecar.Event
		waitFor(t, "the push of generation 2", 10*time.Second, func() bool {
			sent = filterEvents(readEvents(t, c.d1.events), sidecar.EvPushSent, s)
			return len(sent) == 2
		})
		e := sent[1]
		if e.Generation != 2 || e.BaseLen != 0 || e.Bytes != n*bpt || e.Phases == nil {
			t.Fatalf("push of generation 2: %+v", e)
		}
		if ph := e.Phases; !ph.ReserveOverlapped || ph.CreditMs <= 0 || ph.CriticalMs() > e.DurationMs+0.001 {
			t.Fatalf("push of generation 2 did not copy into credit while reserving: %+v (%.3f ms)", *ph, e.DurationMs)
		}
		waitFor(t, "generation 2 committed", 10*time.Second, func() bool {
			st := snapshotStatus(t, c.p0, s)
			return st.Exists && st.Generation == 2 && st.Seqlen == n
		})
		if got, want := snapshotKV(t, c.p0, s), kvBytes(c.wd1, pages, n); !bytes.Equal(got, want) {
			t.Fatalf("snapshot differs from D's KV (%d vs %d bytes)", len(got), len(want))
		}
	})
}
