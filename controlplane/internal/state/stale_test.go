package state

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// queuedReleases drains st's command queue and returns the sessions it was told to release.
func queuedReleases(st *Stream) []string {
	var ids []string
	for {
		select {
		case m := <-st.Queue():
			if r := m.GetCommand().GetReleaseSession(); r != nil {
				ids = append(ids, r.GetSessionId())
			}
		default:
			return ids
		}
	}
}

// TestResyncStaleCopy: a decode worker's resync (issue 16 finding 1) must not override a record
// that is newer than the copy it reports — the session was reseeded elsewhere while the worker
// was away — and the stale copy is released on the reporting worker.
func TestResyncStaleCopy(t *testing.T) {
	for _, tc := range []struct {
		name string
		// the record before the resync
		recD    string
		recPrev string // previous_decode_worker
		recGen  uint64
		// d0's report
		gen         uint64
		wantD       string
		wantGen     uint64
		wantRelease bool
	}{
		{"reseeded elsewhere, report of an older generation", "d1", "", 3, 2, "d1", 3, true},
		{"reseeded elsewhere, report of unknown generation (sidecar restarted)", "d1", "", 3, 0, "d1", 3, true},
		{"reseeded elsewhere, report of the same generation", "d1", "", 3, 3, "d1", 3, true},
		{"report of a newer generation wins (the record lagged)", "d1", "", 3, 4, "d0", 4, false},
		{"resident nowhere, report of an older generation", "", "", 3, 2, "", 3, true},
		{"resident nowhere, report of unknown generation", "", "", 3, 0, "d0", 3, false},
		{"resident nowhere, report of the current generation", "", "", 3, 3, "d0", 3, false},
		{"resident nowhere, last on the reporter, report of unknown generation", "", "d0", 3, 0, "d0", 3, false},
		// half-open-sidecar-link: d0 was seeded while cut off (its target, so its generation,
		// never arrived), the session moved to d1, committed and was evicted there.
		{"resident nowhere, last on another worker, report of unknown generation", "", "d1", 3, 0, "", 3, true},
		{"resident nowhere, last on another worker, report of the current generation", "", "d1", 3, 3, "d0", 3, false},
		{"resident on the reporter", "d0", "", 3, 0, "d0", 3, false},
		{"unknown session", "-", "", 0, 5, "d0", 5, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, Config{})
			st := f.st
			d0, err := st.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
			must(t, err)
			d1, err := st.Attach(hello("d1", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
			must(t, err)
			if tc.recD != "-" {
				st.UpdateSession("s", func(r *kvcv1.SessionRecord) {
					r.DecodeWorker, r.PreviousDecodeWorker, r.Generation, r.KvCommittedLen = tc.recD, tc.recPrev, tc.recGen, 500
				})
			}
			queuedReleases(d0)
			queuedReleases(d1)
			must(t, st.Reconcile(d0, &kvcv1.ResidentSessions{FullSync: true, Sessions: []*kvcv1.ResidentSession{
				{SessionId: "s", KvCommittedLen: 300, Generation: tc.gen}}}))
			r, ok := st.Session("s")
			if !ok || r.GetDecodeWorker() != tc.wantD || r.GetGeneration() != tc.wantGen {
				t.Fatalf("record %v, want decode %q generation %d", r, tc.wantD, tc.wantGen)
			}
			if tc.wantD != "d0" && r.GetKvCommittedLen() != 500 {
				t.Fatalf("the stale report changed kv_committed_len: %v", r)
			}
			rel := queuedReleases(d0)
			if got := len(rel) == 1 && rel[0] == "s"; got != tc.wantRelease || (!tc.wantRelease && len(rel) > 0) {
				t.Fatalf("releases sent to d0: %v, want release %v", rel, tc.wantRelease)
			}
			// When the report wins over another worker, that worker's copy is the stale one.
			rel1 := queuedReleases(d1)
			if wantD1 := tc.recD == "d1" && tc.wantD == "d0"; (len(rel1) == 1 && rel1[0] == "s") != wantD1 || (!wantD1 && len(rel1) > 0) {
				t.Fatalf("releases sent to d1: %v, want release %v", rel1, wantD1)
			}
			if recs, _ := st.ListSessions("", 10, "d0"); (len(recs) == 1) != (tc.wantD == "d0") {
				t.Fatalf("index of d0: %v", recs)
			}
		})
	}
}

// TestCommitStaleCopy: a commit from a worker that is not the session's decode worker, of an
// older generation — the worker re-committed its sessions after its sidecar restarted, while
// the session was reseeded elsewhere (seen in the all-sidecars-restart fault scenario) — leaves
// the record as it is and releases that worker's copy. A commit of unknown or newer generation
// from another worker (a seed's commit ahead of its outcome) is left alone.
func TestCommitStaleCopy(t *testing.T) {
	for _, tc := range []struct {
		name        string
		gen         uint64
		wantRelease bool
	}{
		{"older generation", 2, true},
		{"unknown generation", 0, false},
		{"same generation", 3, false},
		{"newer generation", 4, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, Config{})
			st := f.st
			d0, err := st.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
			must(t, err)
			d1, err := st.Attach(hello("d1", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
			must(t, err)
			st.UpdateSession("s", func(r *kvcv1.SessionRecord) { r.DecodeWorker, r.Generation, r.KvCommittedLen = "d1", 3, 500 })
			queuedReleases(d0)
			queuedReleases(d1)
			must(t, st.ApplyEvent(d0, &kvcv1.SessionEvent{SessionId: "s", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED,
				KvLen: 300, Generation: tc.gen}))
			r, ok := st.Session("s")
			if !ok || r.GetDecodeWorker() != "d1" || r.GetGeneration() != 3 || r.GetKvCommittedLen() != 500 {
				t.Fatalf("record changed by another worker's commit: %v", r)
			}
			rel := queuedReleases(d0)
			if got := len(rel) == 1 && rel[0] == "s"; got != tc.wantRelease || (!tc.wantRelease && len(rel) > 0) {
				t.Fatalf("releases sent to d0: %v, want release %v", rel, tc.wantRelease)
			}
			if rel1 := queuedReleases(d1); len(rel1) > 0 {
				t.Fatalf("the record's worker was told to release: %v", rel1)
			}
		})
	}
}

// TestReplayedCommitOfMovedSession: the half-open-sidecar-link finding. d0's sidecar, cut off
// from the control planes, buffered a commit of unknown generation (a seed whose snapshot target
// never reached it) while the session moved to d1, committed and was evicted there. Replayed on
// reconnect before the resync, that commit must not make d0's older copy resident at the
// record's generation; the resync that follows releases it. On a stream already resynced, the
// same commit is a seed's commit ahead of its outcome and is applied as before.
func TestReplayedCommitOfMovedSession(t *testing.T) {
	for _, tc := range []struct {
		name       string
		resynced   bool // d0's stream sent its full resync before the commit
		prev       string
		wantD      string
		wantKV     int64
		wantResync string // decode worker after the full resync listing the copy
	}{
		{"replayed, last residency elsewhere", false, "d1", "", 500, ""},
		{"replayed, last residency on the reporter", false, "d0", "d0", 300, "d0"},
		{"live stream, last residency elsewhere (a seed ahead of its outcome)", true, "d1", "d0", 300, "d0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, Config{})
			st := f.st
			d0, err := st.Attach(hello("d0", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
			must(t, err)
			d1, err := st.Attach(hello("d1", kvcv1.WorkerRole_WORKER_ROLE_DECODE))
			must(t, err)
			if tc.resynced {
				must(t, st.Reconcile(d0, &kvcv1.ResidentSessions{FullSync: true}))
			}
			st.UpdateSession("s", func(r *kvcv1.SessionRecord) {
				r.DecodeWorker, r.PreviousDecodeWorker, r.Generation, r.KvCommittedLen = "", tc.prev, 3, 500
			})
			queuedReleases(d0)
			queuedReleases(d1)
			must(t, st.ApplyEvent(d0, &kvcv1.SessionEvent{SessionId: "s", Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_COMMITTED, KvLen: 300}))
			r, _ := st.Session("s")
			if r.GetDecodeWorker() != tc.wantD || r.GetKvCommittedLen() != tc.wantKV || r.GetGeneration() != 3 {
				t.Fatalf("after the commit: %v, want decode %q kv %d generation 3", r, tc.wantD, tc.wantKV)
			}
			must(t, st.Reconcile(d0, &kvcv1.ResidentSessions{FullSync: true, Sessions: []*kvcv1.ResidentSession{
				{SessionId: "s", KvCommittedLen: 300}}}))
			r, _ = st.Session("s")
			if r.GetDecodeWorker() != tc.wantResync {
				t.Fatalf("after the resync: %v, want decode %q", r, tc.wantResync)
			}
			rel := queuedReleases(d0)
			if wantRel := tc.wantResync == ""; (len(rel) == 1 && rel[0] == "s") != wantRel || (!wantRel && len(rel) > 0) {
				t.Fatalf("releases sent to d0: %v, want release %v", rel, wantRel)
			}
		})
	}
}
