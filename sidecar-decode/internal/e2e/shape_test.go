package e2e

import (
	"bytes"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvcentric/kvcentric/pkg/kvpool"
	"github.com/kvcentric/kvcentric/pkg/sidecar"
	"github.com/kvcentric/kvcentric/pkg/sidecar/cptest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// shape is how a test worker registers its pool.
type shape struct {
	mla            bool
	tpRank, tpSize int32
	aux            []int64
}

// newShapedWorker registers a pool of the given shape (MHA or MLA, tensor parallelism, aux
// rows) on sc.
func newShapedWorker(t *testing.T, sc *sidecarProc, pages int64, sh shape) *worker {
	t.Helper()
	p, err := kvpool.Create(t.TempDir(), kvpool.Spec{PageSize: pageSize, ItemLen: itemLen, NumLayers: numLayers, PageCount: pages, Name: sc.id, MLA: sh.mla})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	req := &kvcv1.RegisterKVPoolRequest{PageSize: pageSize, ItemLen: itemLen, PageCount: pages, NumLayers: numLayers, Model: "test",
		TpRank: sh.tpRank, TpSize: sh.tpSize, AuxItemLens: sh.aux}
	if sh.mla {
		req.Layout = kvcv1.PoolLayout_POOL_LAYOUT_MLA
	}
	for i := 0; i < p.NumBuffers(); i++ {
		layer, kind := int32(i/2), kvcv1.KVKind_KV_KIND_K
		if i%2 == 1 {
			kind = kvcv1.KVKind_KV_KIND_V
		}
		if sh.mla {
			layer, kind = int32(i), kvcv1.KVKind_KV_KIND_COMBINED
		}
		req.Buffers = append(req.Buffers, &kvcv1.KVBuffer{Layer: layer, Kind: kind, SizeBytes: pages * itemLen,
			Memory: &kvcv1.KVBuffer_Shm{Shm: &kvcv1.SharedMemoryRef{Path: p.Path(), Offset: p.Offset(i)}}})
	}
	res, err := sc.bridge.RegisterKVPool(ctxT(t, 10*time.Second), req)
	if err != nil {
		t.Fatalf("register %v pool on %s: %v", sh, sc.id, err)
	}
	if want := int64(p.NumBuffers() * tokenBytes); res.GetKvBytesPerToken() != want {
		t.Fatalf("kv bytes per token %d, want %d", res.GetKvBytesPerToken(), want)
	}
	return &worker{pool: p}
}

// poolBytes reads tokens [0, n) of every buffer (the snapshot_kv order).
func poolBytes(w *worker, pages []int64, n int64) []byte {
	var out []byte
	for b := 0; b < w.pool.NumBuffers(); b++ {
		buf := w.pool.Buffer(b)
		for tok := int64(0); tok < n; tok++ {
			off := pages[tok/pageSize]*itemLen + (tok%pageSize)*tokenBytes
			out = append(out, buf[off:off+tokenBytes]...)
		}
	}
	return out
}

func httpText(t *testing.T, url string) (int, string) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestAuxMLAAndTP runs real sidecar processes with MLA pools of tensor-parallel rank 1 of 2:
// a two-chunk seed whose aux rows reach the decode worker's WaitReceive with success, a D→P
// snapshot push, a reseed from the snapshot (no aux), and the refusals of an MHA pool, another
// rank and bad aux rows.
func TestAuxMLAAndTP(t *testing.T) {
	d := int64(delta)
	cp, err := cptest.Start(1, &kvcv1.Policy{SnapshotDeltaTokens: &d})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cp.Close)
	p := startSidecar(t, "prefill", "mp", cp.Addr, "--store-capacity-bytes", "8388608", "--tp-group", "grp-p")
	d1 := startSidecar(t, "decode", "md1", cp.Addr)
	d2 := startSidecar(t, "decode", "md2", cp.Addr)
	dMHA := startSidecar(t, "decode", "hd", "")
	dRank := startSidecar(t, "decode", "rd", "")

	// Before its worker comes, a sidecar says what it waits for.
	if code, body := httpText(t, "http://"+d1.httpAddr+"/readyz"); code != 503 || body != "not ready: waiting for worker to register its KV pool (no watcher connected)\n" {
		t.Fatalf("readyz before the worker: %d %q", code, body)
	}
	aux := []int64{8, 16, 4} // SGLang's metadata rows: output id, cached tokens, room (scaled)
	tp := shape{mla: true, tpRank: 1, tpSize: 2, aux: aux}
	wp := newShapedWorker(t, p, 256, tp)
	wd1 := newShapedWorker(t, d1, 512, tp)
	wd2 := newShapedWorker(t, d2, 512, tp)
	newShapedWorker(t, dMHA, 512, shape{tpRank: 1, tpSize: 2})
	newShapedWorker(t, dRank, 512, shape{mla: true, tpRank: 0, tpSize: 2})
	if err := cp.Wait(ctxT(t, 20*time.Second), func(v *cptest.View) bool {
		return v.Connected("mp") && v.Connected("md1") && v.Connected("md2")
	}); err != nil {
		t.Fatal(err)
	}
	// The hellos carry the registered rank and size, and the group (--tp-group; without it and
	// without --worker-url, none: the control plane refuses such a hello).
	if err := cp.Wait(ctxT(t, 5*time.Second), func(v *cptest.View) bool {
		hp, hd := v.Hello("mp"), v.Hello("md1")
		return hp.GetTpGroup() == "grp-p" && hp.GetTpRank() == 1 && hp.GetTpSize() == 2 &&
			hd.GetTpGroup() == "" && hd.GetTpRank() == 1 && hd.GetTpSize() == 2
	}); err != nil {
		t.Fatalf("hellos' tensor parallelism: %v", err)
	}
	var st sidecar.Status
	if code := getJSON(t, "http://"+d1.httpAddr+"/v1/status", &st); code != 200 || st.Layout != "MLA" || st.Buffers != numLayers ||
		st.TPRank != 1 || st.TPSize != 2 || len(st.AuxItemLens) != 3 || !st.Ready || st.SidecarInstance == "" {
		t.Fatalf("status %d %+v", code, st)
	}
	if code, body := httpText(t, "http://"+d1.httpAddr+"/readyz"); code != 200 || body != "ready\n" {
		t.Fatalf("readyz: %d %q", code, body)
	}
	mlaBPT := int64(numLayers * tokenBytes)

	const s = "mla-sess"
	n := int64(700)
	npages := int((n + pageSize - 1) / pageSize)
	ppages := wp.alloc(npages, 1)
	if err := kvpool.FillTokens(wp.pool, kvpool.SessionSeed(s), ppages, 0, n); err != nil {
		t.Fatal(err)
	}
	dpages := wd1.alloc(npages, 2)
	t.Run("seed with aux rows", func(t *testing.T) {
		const room = 8101
		if _, err := d1.bridge.PrepareReceive(ctxT(t, 5*time.Second), &kvcv1.PrepareReceiveRequest{Room: room, SessionId: s,
			Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED, Pages: dpages, Tokens: n, SourcePeerAddr: p.peerAddr}); err != nil {
			t.Fatal(err)
		}
		half := npages / 2
		if _, err := p.bridge.SendKV(ctxT(t, 20*time.Second), &kvcv1.SendKVRequest{Room: room, SessionId: s, Pages: ppages[:half]}); err != nil {
			t.Fatal(err)
		}
		// aux rows on a middle chunk, or rows that do not fit the registered aux buffers: refused
		if _, err := p.bridge.SendKV(ctxT(t, 5*time.Second), &kvcv1.SendKVRequest{Room: room, SessionId: s, Pages: ppages[half : half+1],
			FirstPage: int64(half), Aux: [][]byte{{1}}}); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("aux on a middle chunk: %v", err)
		}
		if _, err := p.bridge.SendKV(ctxT(t, 5*time.Second), &kvcv1.SendKVRequest{Room: room, SessionId: s, Pages: ppages[half:],
			FirstPage: int64(half), Last: true, Tokens: n, Aux: [][]byte{make([]byte, 9), {}, {}}}); status.Code(err) != codes.InvalidArgument ||
			!strings.Contains(err.Error(), "aux row 0 is 9 bytes") {
			t.Fatalf("aux row too long: %v", err)
		}
		rows := [][]byte{[]byte("tok=4242"), []byte("cached=0,lp=-0.1"), {0xde, 0xad, 0xbe, 0xef}}
		if _, err := p.bridge.SendKV(ctxT(t, 20*time.Second), &kvcv1.SendKVRequest{Room: room, SessionId: s, Pages: ppages[half:],
			FirstPage: int64(half), Last: true, Tokens: n, Aux: rows}); err != nil {
			t.Fatal(err)
		}
		res, err := d1.bridge.WaitReceive(ctxT(t, 10*time.Second), &kvcv1.WaitReceiveRequest{Room: room, TimeoutMs: 5000})
		if err != nil || !res.GetOk() || res.GetBytes() != n*mlaBPT {
			t.Fatalf("seed: %v %v", res, err)
		}
		if len(res.GetAux()) != 3 || !bytes.Equal(res.GetAux()[0], rows[0]) || !bytes.Equal(res.GetAux()[1], rows[1]) || !bytes.Equal(res.GetAux()[2], rows[2]) {
			t.Fatalf("aux rows %q, want %q", res.GetAux(), rows)
		}
		if bad, err := kvpool.CheckTokens(wd1.pool, kvpool.SessionSeed(s), dpages, 0, n); err != nil || bad != 0 {
			t.Fatalf("decode pages after the seed: %d mismatches, %v", bad, err)
		}
		if !bytes.Equal(poolBytes(wd1, dpages, n), poolBytes(wp, ppages, n)) {
			t.Fatal("decode KV differs from prefill KV")
		}
	})
	t.Run("snapshot push and reseed of an MLA session", func(t *testing.T) {
		id, err := cp.Send("md1", &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
			SessionId: s, PrefillWorkerId: "mp", PeerAddr: p.peerAddr, TransferEndpoint: p.transfer, Generation: 1}}})
		if err != nil {
			t.Fatal(err)
		}
		if err := cp.Wait(ctxT(t, 10*time.Second), func(v *cptest.View) bool { return v.Ack(id) != nil }); err != nil {
			t.Fatal(err)
		}
		if _, err := d1.bridge.CommitSession(ctxT(t, 5*time.Second), &kvcv1.CommitSessionRequest{SessionId: s, CommittedLen: n, Pages: dpages}); err != nil {
			t.Fatal(err)
		}
		if err := cp.Wait(ctxT(t, 20*time.Second), func(v *cptest.View) bool {
			e := v.FindEvent("mp", s, kvcv1.SessionEventKind_SESSION_EVENT_KIND_SNAPSHOT_INGESTED)
			return e != nil && e.GetKvLen() == n
		}); err != nil {
			t.Fatal(err)
		}
		if got, want := snapshotKV(t, p, s), poolBytes(wd1, dpages, n); !bytes.Equal(got, want) {
			t.Fatalf("snapshot of %d bytes differs from D's KV (%d bytes)", len(got), len(want))
		}
		const room = 8102
		pid, err := cp.Send("mp", &kvcv1.Command{Action: &kvcv1.Command_PushSnapshot{PushSnapshot: &kvcv1.PushSnapshotCommand{
			SessionId: s, Generation: 1, Seqlen: n, DecodeWorkerId: "md2", DecodePeerAddr: d2.peerAddr, DecodeTransferEndpoint: d2.transfer, Room: room}}})
		if err != nil {
			t.Fatal(err)
		}
		if err := cp.Wait(ctxT(t, 10*time.Second), func(v *cptest.View) bool { a := v.Ack(pid); return a != nil && a.GetOk() }); err != nil {
			t.Fatal(err)
		}
		d2pages := wd2.alloc(npages, 3)
		if _, err := d2.bridge.PrepareReceive(ctxT(t, 5*time.Second), &kvcv1.PrepareReceiveRequest{Room: room, SessionId: s,
			Kind: kvcv1.TransferKind_TRANSFER_KIND_SNAPSHOT, Pages: d2pages, Tokens: n, SourcePeerAddr: p.peerAddr}); err != nil {
			t.Fatal(err)
		}
		res, err := d2.bridge.WaitReceive(ctxT(t, 20*time.Second), &kvcv1.WaitReceiveRequest{Room: room, TimeoutMs: 15000})
		if err != nil || !res.GetOk() || res.GetBytes() != n*mlaBPT || len(res.GetAux()) != 0 {
			t.Fatalf("reseed: %v %v", res, err)
		}
		if bad, err := kvpool.CheckTokens(wd2.pool, kvpool.SessionSeed(s), d2pages, 0, n); err != nil || bad != 0 {
			t.Fatalf("reseeded pages: %d mismatches, %v", bad, err)
		}
	})
	t.Run("MHA decode pool and another rank are refused", func(t *testing.T) {
		for _, c := range []struct {
			sc   *sidecarProc
			want string
		}{{dMHA, "MLA"}, {dRank, "ranks differ"}} {
			_, err := c.sc.bridge.PrepareReceive(ctxT(t, 5*time.Second), &kvcv1.PrepareReceiveRequest{Room: 8200, SessionId: "x",
				Kind: kvcv1.TransferKind_TRANSFER_KIND_SEED, Pages: []int64{0}, Tokens: 4, SourcePeerAddr: p.peerAddr})
			if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("%s: %v; want FAILED_PRECONDITION with %q", c.sc.id, err, c.want)
			}
		}
	})
}
