package router

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"google.golang.org/grpc/codes"
)

// TestDecisionCarriesExecution: every decision on the wire carries the policy's execution
// plan; a migration names the decode worker to close the session on, with its address.
func TestDecisionCarriesExecution(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	d := f.decide("s", 0, 4000, 200)
	e := d.GetExecution()
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_SEED || !e.GetCallPrefill() || !e.GetCallDecode() || !e.GetKeepSession() ||
		!e.GetOpenSession() || e.GetTransfer() != kvcv1.TransferKind_TRANSFER_KIND_SEED || len(e.GetCloseSessionOn()) != 0 ||
		e.GetOnDecodeRefused() != kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D || !e.GetRetryAllowed() {
		t.Fatalf("seed execution: %v", e)
	}
	from := d.Decode.WorkerId
	f.report(d.DecisionId, true, okKind, 4200)
	d = f.decide("s", 1, 4300, 100)
	if e = d.GetExecution(); d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || e.GetCallPrefill() || !e.GetKeepSession() ||
		e.GetOpenSession() || e.GetTransfer() != kvcv1.TransferKind_TRANSFER_KIND_UNSPECIFIED {
		t.Fatalf("direct execution: %v", e)
	}
	// Three rejections by D: the next turn migrates, and the old D is named for close_session.
	for i := 0; i < 3; i++ {
		f.report(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 0)
		d = f.decide("s", int32(2+i), 4300, 100)
	}
	e = d.GetExecution()
	if d.Reason != kvcv1.RouteReason_ROUTE_REASON_MIGRATED_AFTER_REJECTS || d.Decode.GetWorkerId() == from ||
		len(e.GetCloseSessionOn()) != 1 || e.GetCloseSessionOn()[0].GetWorkerId() != from ||
		e.GetCloseSessionOn()[0].GetWorkerUrl() != "http://"+from || !e.GetOpenSession() {
		t.Fatalf("migration: %v", d)
	}
}

// TestExcludeWorkers: a retry's excluded workers are not chosen, and a session resident on an
// excluded D is reseeded elsewhere; bad lists are INVALID_ARGUMENT.
func TestExcludeWorkers(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	d := f.decide("s", 0, 4000, 200)
	dead := d.Decode.WorkerId
	f.report(d.DecisionId, true, okKind, 4200)
	resp := f.s.Handle(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{
		RequestId: "retry", SessionId: "s", Turn: 1, InputTokens: 4300, MaxOutputTokens: 100, ExcludeWorkers: []string{dead, "p2"}}}})
	d = resp.GetDecision()
	if d == nil || d.Decode.GetWorkerId() == dead || d.Decode == nil || d.Prefill.GetWorkerId() == "p2" ||
		d.Mode == kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D {
		t.Fatalf("retry with %s excluded: %v", dead, resp)
	}
	f.checkLedger()
	for _, bad := range [][]string{{"a/b"}, {""}, make([]string, 17)} {
		if len(bad) == 17 {
			for i := range bad {
				bad[i] = "w"
			}
		}
		resp := f.s.Handle(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{
			RequestId: "bad", SessionId: "s", InputTokens: 10, ExcludeWorkers: bad}}})
		if resp.GetError().GetCode() != int32(codes.InvalidArgument) {
			t.Errorf("exclude %q: %v", bad, resp)
		}
	}
}

// TestCommittedLenIsTheCommits: kv_committed_len is the decode sidecar's commit only. An
// outcome's kv_len_after (the worker's own report, or none) never writes it: a seed's commit
// that came first is the new residency's length, one that comes after sets it then, and a
// direct turn's outcome leaves the commit's length as it is.
func TestCommittedLenIsTheCommits(t *testing.T) {
	tests := []struct {
		name        string
		commitFirst int64 // the seed's commit before its outcome (0: none)
		kvLenAfter  int64 // the seed's outcome's kv_len_after
		commitAfter int64 // the seed's commit after its outcome (0: none)
		want        int64 // after the seed
		direct      int64 // a direct turn's outcome's kv_len_after (its commit: 4300)
	}{
		{name: "commit first", commitFirst: 4010, kvLenAfter: 6000, want: 4010, direct: 9999},
		{name: "commit first, no kv_len_after", commitFirst: 4010, want: 4010},
		{name: "outcome first", kvLenAfter: 4010, want: 0},
		{name: "outcome first, then the commit", kvLenAfter: 4010, commitAfter: 4010, want: 4010, direct: 4300},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := newFixture(t, basicCluster()...)
			d := f.decide("s", 0, 4000, 2000)
			on := d.Decode.GetWorkerId()
			if tt.commitFirst > 0 {
				f.c.Commit(on, "s", tt.commitFirst)
			}
			f.s.Handle(outcome(d.DecisionId, true, okKind, tt.kvLenAfter))
			if tt.commitAfter > 0 {
				f.c.Commit(on, "s", tt.commitAfter)
			}
			if rec := f.session("s"); rec.DecodeWorker != on || rec.KvCommittedLen != tt.want {
				t.Fatalf("after the seed: %s committed %d, want %s %d", rec.DecodeWorker, rec.KvCommittedLen, on, tt.want)
			}
			if tt.want == 0 {
				return
			}
			d = f.decide("s", 1, 4200, 100)
			if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D {
				t.Fatalf("turn 1: %v", d)
			}
			f.c.Commit(on, "s", 4300)
			f.s.Handle(outcome(d.DecisionId, true, okKind, tt.direct))
			if rec := f.session("s"); rec.KvCommittedLen != 4300 {
				t.Fatalf("after a direct turn reporting kv_len_after %d: %d, want the commit's 4300", tt.direct, rec.KvCommittedLen)
			}
		})
	}
}

// TestMoveTakesTheNewWorkersCommit: a reseed onto another decode worker whose commit reached
// the control plane while the record still named the old one: the outcome makes the session
// resident there with that commit's length, not the old worker's.
func TestMoveTakesTheNewWorkersCommit(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	d := f.decide("s", 0, 4000, 100)
	from := d.Decode.GetWorkerId()
	f.report(d.DecisionId, true, okKind, 4100)
	for i := range 3 { // rejections move it
		d = f.decide("s", int32(1+i), 4200, 100)
		f.report(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_REJECTED_BY_D, 0)
	}
	d = f.decide("s", 4, 4200, 100)
	to := d.Decode.GetWorkerId()
	if to == from || d.Reason != kvcv1.RouteReason_ROUTE_REASON_MIGRATED_AFTER_REJECTS {
		t.Fatalf("turn 4: %v, want a migration off %s", d, from)
	}
	f.c.Commit(to, "s", 4250)
	if rec := f.session("s"); rec.DecodeWorker != from || rec.KvCommittedLen != 4100 {
		t.Fatalf("before the outcome: %v", rec)
	}
	f.s.Handle(outcome(d.DecisionId, true, okKind, 0))
	if rec := f.session("s"); rec.DecodeWorker != to || rec.KvCommittedLen != 4250 || rec.PreviousDecodeWorker != from {
		t.Fatalf("after the migration: %v, want %s with its commit's 4250", rec, to)
	}
}

// TestEndSession: a session end names the D to close it on, reserves nothing, changes no
// record (the D's sidecar reports the release), and its outcome is acknowledged.
func TestEndSession(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	d := f.decide("s", 0, 4000, 200)
	on := d.Decode.WorkerId
	f.report(d.DecisionId, true, okKind, 4200)
	before := f.session("s")
	resp := f.s.Handle(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{
		RequestId: "end", SessionId: "s", EndSession: true}}})
	d = resp.GetDecision()
	e := d.GetExecution()
	if d == nil || d.Reason != kvcv1.RouteReason_ROUTE_REASON_SESSION_END || d.Mode != kvcv1.RouteMode_ROUTE_MODE_UNSPECIFIED ||
		d.Decode != nil || d.Prefill != nil || e.GetCallDecode() || e.GetCallPrefill() || len(e.GetCloseSessionOn()) != 1 ||
		e.GetCloseSessionOn()[0].GetWorkerId() != on || d.BootstrapRoom != 0 {
		t.Fatalf("end: %v", resp)
	}
	if after := f.session("s"); after.Turn != before.Turn || after.DecodeWorker != on {
		t.Fatalf("end changed the record: %v -> %v", before, after)
	}
	f.checkLedger()
	f.report(d.DecisionId, true, okKind, 0)
	if f.pending() != 0 {
		t.Fatalf("%d reservations pending", f.pending())
	}
	// A session never seen: nothing to close, no record created.
	d = f.s.Handle(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{
		RequestId: "end2", SessionId: "never", EndSession: true}}}).GetDecision()
	if d == nil || len(d.GetExecution().GetCloseSessionOn()) != 0 {
		t.Fatalf("end of an unknown session: %v", d)
	}
	if _, ok := f.c.Session("never"); ok {
		t.Fatal("a session end created a record")
	}
	// input_tokens 0 is valid only for a session end.
	resp = f.s.Handle(&kvcv1.RouteRequest{Kind: &kvcv1.RouteRequest_Query{Query: &kvcv1.RouteQuery{RequestId: "x", SessionId: "s"}}})
	if resp.GetError().GetCode() != int32(codes.InvalidArgument) {
		t.Fatalf("query without input: %v", resp)
	}
}
