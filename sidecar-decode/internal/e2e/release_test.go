package e2e

import (
	"encoding/json"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/sidecar"
	"github.com/kvcentric/kvcentric/pkg/sidecar/cptest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func simSessions(t *testing.T, url string) map[string]bool {
	t.Helper()
	resp, err := http.Get(url + "/kvc/sessions")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Sessions []struct {
			SessionID string `json:"session_id"`
		} `json:"sessions"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, s := range body.Sessions {
		out[s.SessionID] = true
	}
	return out
}

// TestCapacityReleaseProcesses fills a kvc-sim decode worker's pool past the release watermark
// with sessions of different idle times, through real sidecar processes: the decode sidecar
// pushes each chosen session's snapshot first (delta_tokens is larger than the sessions, so no
// push ran at commit), then sends the worker a release command; the releases come in priority
// order (longest idle first), each after its snapshot on the prefill sidecar covered the whole
// committed length, and each reaches the control plane as EVICTED.
func TestCapacityReleaseProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("integration test")
	}
	if bins["kvc-sim"] == "" {
		t.Fatal("kvc-sim binary not available")
	}
	d := int64(512)
	cp, err := cptest.Start(1, &kvcv1.Policy{SnapshotDeltaTokens: &d})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cp.Close)
	sp := startSimPrefill(t, "cp0", cp.Addr)
	p := sp.sc
	sock := filepath.Join(t.TempDir(), "d.sock")
	dec := startSidecarAt(t, "decode", "cd1", cp.Addr, sock, "--release-high-watermark", "0.6", "--release-low-watermark", "0.3",
		"--release-min-idle", "500ms")
	sim := startSim(t, "decode", "cd1", sock, t.TempDir()) // 8192 tokens
	url := "http://" + sim.ReadyString("http_addr")
	if err := cp.Wait(ctxT(t, 20*time.Second), func(v *cptest.View) bool { return v.Connected("cp0") && v.Connected("cd1") }); err != nil {
		t.Fatal(err)
	}
	// Seven sessions of 800 input tokens, seeded 1.1 s apart (so their idle times differ by
	// whole seconds): 7 × 804 = 5628 of 8192 tokens after the seventh, above the high watermark
	// (4915, not reached by six); the low one (2457) needs the four longest idle released; the
	// last (idle < 500 ms) is in use.
	ids := []string{"s-a", "s-b", "s-c", "s-d", "s-e", "s-f", "s-g"}
	for i, s := range ids {
		id, err := cp.Send("cd1", &kvcv1.Command{Action: &kvcv1.Command_SetSnapshotTarget{SetSnapshotTarget: &kvcv1.SetSnapshotTargetCommand{
			SessionId: s, PrefillWorkerId: "cp0", PeerAddr: p.peerAddr, TransferEndpoint: p.transfer, Generation: 1}}})
		if err != nil {
			t.Fatal(err)
		}
		if err := cp.Wait(ctxT(t, 10*time.Second), func(v *cptest.View) bool { return v.Ack(id) != nil }); err != nil {
			t.Fatal(err)
		}
		if i > 0 {
			time.Sleep(1100 * time.Millisecond) // the sessions' idle times are this test's input
		}
		seedSession(t, url, sp, s, int64(9300+i), 800)
	}
	want := []string{"s-a", "s-b", "s-c", "s-d"}
	var evicted []*kvcv1.SessionEvent
	if err := cp.Wait(ctxT(t, 20*time.Second), func(v *cptest.View) bool {
		evicted = evicted[:0]
		for _, e := range v.Events() {
			if e.Worker == "cd1" && e.Ev.GetKind() == kvcv1.SessionEventKind_SESSION_EVENT_KIND_EVICTED {
				evicted = append(evicted, e.Ev)
			}
		}
		return len(evicted) >= len(want)
	}); err != nil {
		t.Fatalf("capacity releases: %d EVICTED events: %v", len(evicted), err)
	}
	committed := sidecarSessionsAll(t, dec)
	for i, e := range evicted {
		if i >= len(want) || e.GetSessionId() != want[i] || !strings.Contains(e.GetDetail(), "capacity release") {
			t.Fatalf("EVICTED events %v; want %v in this order, detail capacity release", evicted, want)
		}
	}
	// Each release came after a push that made the snapshot cover the whole committed length.
	evs := readEvents(t, dec.events)
	for _, s := range want {
		var rel *sidecar.Event
		for i := range evs {
			if evs[i].Event == sidecar.EvSessionRelease && evs[i].Session == s {
				rel = &evs[i]
			}
		}
		if rel == nil || rel.Reason != "capacity" {
			t.Fatalf("no capacity release event of %s: %+v", s, rel)
		}
		var pushedTo int64
		for _, e := range evs {
			if e.Event == sidecar.EvPushSent && e.Session == s && !e.TS.After(rel.TS) {
				pushedTo = max(pushedTo, e.BaseLen+e.Tokens)
			}
		}
		if pushedTo != rel.Seqlen || rel.Seqlen < 800 {
			t.Fatalf("%s released at %d tokens with its snapshot pushed to %d", s, rel.Seqlen, pushedTo)
		}
		if st := snapshotStatus(t, p, s); !st.Exists || st.Seqlen != rel.Seqlen {
			t.Fatalf("snapshot of released %s: %+v, committed %d", s, st, rel.Seqlen)
		}
	}
	held := simSessions(t, url)
	for _, s := range want {
		if held[s] || committed[s] {
			t.Fatalf("%s still resident (worker %v, sidecar %v)", s, held, committed)
		}
	}
	if !held["s-e"] || !held["s-f"] || !held["s-g"] || !committed["s-e"] || !committed["s-f"] || !committed["s-g"] {
		t.Fatalf("the sessions in use were released: worker %v, sidecar %v", held, committed)
	}
	// The load report follows: 3 sessions left, all of them releasable this way once idle for
	// --release-min-idle (evictable_tokens counts only those: a report sent before the last of
	// them has been idle that long counts it as pinned).
	var l *kvcv1.WorkerLoad
	if err := cp.Wait(ctxT(t, 5*time.Second), func(v *cptest.View) bool {
		l = v.Load("cd1")
		return l.GetResidentSessions() == 3 && l.GetEvictableTokens() == 3*804
	}); err != nil || l.GetUsedTokens() != 3*804 || l.GetEvictableTokens() != 3*804 {
		t.Fatalf("load after the releases %v (%v)", l, err)
	}
}

func sidecarSessionsAll(t *testing.T, d *sidecarProc) map[string]bool {
	out := map[string]bool{}
	for s := range sidecarSessions(t, d) {
		out[s] = true
	}
	return out
}
