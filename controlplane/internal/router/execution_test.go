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

// TestCommittedLenWithoutReport: an outcome without kv_len_after never writes input +
// max_output (an early stop commits less); the input is the floor until the commit arrives.
func TestCommittedLenWithoutReport(t *testing.T) {
	f := newFixture(t, basicCluster()...)
	d := f.decide("s", 0, 4000, 2000)
	f.report(d.DecisionId, true, okKind, 0)
	if rec := f.session("s"); rec.KvCommittedLen != 4000 {
		t.Fatalf("after a seed without kv_len_after: kv_committed_len %d, want 4000", rec.KvCommittedLen)
	}
	// The sidecar's commit is the writer: a later outcome without a length does not lower it.
	f.c.UpdateSession("s", func(rec *kvcv1.SessionRecord) { rec.KvCommittedLen = 4100 })
	d = f.decide("s", 1, 4050, 2000)
	f.report(d.DecisionId, true, okKind, 0)
	if rec := f.session("s"); rec.KvCommittedLen != 4100 {
		t.Fatalf("after a direct turn without kv_len_after: %d, want the commit's 4100", rec.KvCommittedLen)
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
