package router

import (
	"testing"

	"github.com/kvcentric/kvcentric/controlplane/internal/policy"
	"github.com/kvcentric/kvcentric/controlplane/internal/router/routertest"
	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestTransferLandedEndsTheSlot: a reseed's transfer on its decode worker ends when the
// decode sidecar reports its KV landed (TRANSFER_DONE of the decision's room), not at the
// outcome after the turn decoded: its store-transfer slot is given back and the worker's
// LOCAL_LARGE_APPEND path, shut while the transfer runs, opens again at once; the reseed's
// tokens and its count in Transfers (the queue score's) stay until its outcome, which gives
// nothing back twice. Events of another session, worker or room, a second copy
// and one after the outcome change nothing. On the old ledger the slot held until the outcome
// and the large append went to P.
func TestTransferLandedEndsTheSlot(t *testing.T) {
	f := newFixture(t, routertest.Prefill("p1"), routertest.Decode("d1", 200_000, 0))
	f.c.PutSession(&kvcv1.SessionRecord{SessionId: "a", DecodeWorker: "d1", KvCommittedLen: 10_000, Generation: 1, LastSeenUnixMs: 1})
	f.c.PutSession(&kvcv1.SessionRecord{SessionId: "s", Generation: 1, LastSeenUnixMs: 1,
		Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: "p1", Seqlen: 5_000, Generation: 1, UpdatedUnixMs: f.now.UnixMilli()}})
	reseed := f.decide("s", 4, 5_050, 400)
	if reseed.Mode != kvcv1.RouteMode_ROUTE_MODE_RESEED_SNAPSHOT || reseed.Decode.GetWorkerId() != "d1" || reseed.BootstrapRoom == 0 {
		t.Fatalf("reseed: %v", reseed)
	}
	reserved := func() policy.Reserved {
		f.s.mu.Lock()
		defer f.s.mu.Unlock()
		return f.s.led.Reserved("d1")
	}
	held := reserved()
	if held.Transfers != 1 || held.StoreTransfers != 1 || held.Tokens != 5_450 {
		t.Fatalf("during the reseed's transfer: %+v", held)
	}
	if d := f.decide("a", 2, 20_000, 100); d.Reason != kvcv1.RouteReason_ROUTE_REASON_REAL_LARGE_APPEND {
		t.Fatalf("large append while the transfer runs: %s/%s, want REAL_LARGE_APPEND on P", d.Mode, d.Reason)
	} else {
		f.report(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_ABORTED, 0)
	}
	done := func(worker, session string, room int64) {
		f.s.TransferLanded(worker, &kvcv1.SessionEvent{SessionId: session, Kind: kvcv1.SessionEventKind_SESSION_EVENT_KIND_TRANSFER_DONE,
			Room: room, KvLen: 5_000, Detail: "snapshot"})
	}
	for _, ev := range []struct {
		name, worker, session string
		room                  int64
	}{
		{"another session", "d1", "a", reseed.BootstrapRoom},
		{"another worker", "d2", "s", reseed.BootstrapRoom},
		{"another room", "d1", "s", reseed.BootstrapRoom + 1},
		{"no room", "d1", "s", 0},
		{"a room past 2^53", "d1", "s", maxRoom + 2},
	} {
		done(ev.worker, ev.session, ev.room)
		if got := reserved(); got != held {
			t.Errorf("%s: %+v, want %+v", ev.name, got, held)
		}
	}
	done("d1", "s", reseed.BootstrapRoom)
	want := held
	want.Landed, want.StoreTransfers = 1, 0
	if got := reserved(); got != want {
		t.Fatalf("after the KV landed: %+v, want %+v (tokens and the transfer's count until the outcome)", got, want)
	}
	done("d1", "s", reseed.BootstrapRoom) // a second copy
	if got := reserved(); got != want {
		t.Fatalf("after a second copy: %+v, want %+v", got, want)
	}
	f.checkLedger()
	d := f.decide("a", 2, 20_000, 100)
	if d.Mode != kvcv1.RouteMode_ROUTE_MODE_DIRECT_TO_D || d.Reason != kvcv1.RouteReason_ROUTE_REASON_LOCAL_LARGE_APPEND {
		t.Fatalf("large append once the reseed's KV landed: %s/%s, want DIRECT_TO_D / LOCAL_LARGE_APPEND", d.Mode, d.Reason)
	}
	f.report(d.DecisionId, false, kvcv1.RouteErrorKind_ROUTE_ERROR_KIND_ABORTED, 0)
	f.report(reseed.DecisionId, true, okKind, 5_450)
	done("d1", "s", reseed.BootstrapRoom) // after the outcome
	if got := reserved(); got.Transfers != 0 || got.Landed != 0 || got.StoreTransfers != 0 || got.Tokens != 0 {
		t.Fatalf("after the outcome: %+v", got)
	}
	f.checkLedger()
	if n := testutil.ToFloat64(f.s.m.landed.WithLabelValues("released")); n != 1 {
		t.Errorf("released %v, want 1", n)
	}
	if n := testutil.ToFloat64(f.s.m.landed.WithLabelValues("unknown")); n != 7 {
		t.Errorf("unknown %v, want 7", n)
	}
}

// TestRoomSeq: roomSeq inverts room over the whole range, the base's wrap included, and
// refuses values room never gives.
func TestRoomSeq(t *testing.T) {
	for _, base := range []uint64{0, 12345, maxRoom - 3, maxRoom} {
		s := &Service{roomBase: base}
		for _, seq := range []uint64{1, 2, 3, 4, 5, 1 << 40} {
			got, ok := s.roomSeq(s.room(seq))
			if !ok || got != seq {
				t.Errorf("base %d: roomSeq(room(%d)) = %d, %v", base, seq, got, ok)
			}
		}
		for _, room := range []int64{0, -1, maxRoom + 2, s.room(0)} {
			if seq, ok := s.roomSeq(room); ok {
				t.Errorf("base %d: roomSeq(%d) = %d, want refused", base, room, seq)
			}
		}
	}
}
