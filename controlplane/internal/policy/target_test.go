package policy

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"google.golang.org/protobuf/proto"
)

// TestTargetCommand: the one snapshot-target rule. The target is the current store while it is
// connected, else the emptiest; the valid base is named only when the chosen store holds it,
// it is not empty and its generation is not after the command's; the bases of a reseed, a
// store seed and a resync are the snapshots the decode worker was written from or pushed; the
// command never carries agent hints.
func TestTargetCommand(t *testing.T) {
	p1 := with(pW("p1", 0), func(w *kvcv1.Worker) { w.PeerAddr, w.TransferEndpoint = "p1:1", "p1:2" })
	p2 := with(pW("p2", 0), func(w *kvcv1.Worker) {
		w.PeerAddr, w.TransferEndpoint = "p2:1", "p2:2"
		w.Load.SnapshotBytesUsed, w.Load.SnapshotBytesCapacity = 1, 10
	})
	gone := with(pW("p3", 0), func(w *kvcv1.Worker) { w.State = kvcv1.WorkerState_WORKER_STATE_UNREACHABLE })
	ws := []*kvcv1.Worker{p1, p2, gone, dW("d1", 1000, 0)}
	cmd := func(p *kvcv1.Worker, gen uint64, base int64, baseGen uint64) *kvcv1.SetSnapshotTargetCommand {
		return &kvcv1.SetSnapshotTargetCommand{SessionId: "s", PrefillWorkerId: p.GetWorkerId(), PeerAddr: p.GetPeerAddr(),
			TransferEndpoint: p.GetTransferEndpoint(), Generation: gen, ValidBaseLen: base, BaseGeneration: baseGen}
	}
	rec := &kvcv1.SessionRecord{Generation: 5, Snapshot: &kvcv1.SnapshotInfo{PrefillWorker: "p2", Seqlen: 480, Generation: 5}}
	tests := []struct {
		name string
		ws   []*kvcv1.Worker
		t    Target
		want *kvcv1.SetSnapshotTargetCommand
	}{
		{"emptiest store", ws, Target{Session: "s", Generation: 5}, cmd(p1, 5, 0, 0)},
		{"the current store stays", ws, Target{Session: "s", Generation: 5, Current: "p2"}, cmd(p2, 5, 0, 0)},
		{"a current store that is gone", ws, Target{Session: "s", Generation: 5, Current: "p3"}, cmd(p1, 5, 0, 0)},
		{"reseed base on its store", ws, Target{Session: "s", Generation: 6, Current: "p2", Base: ReseedBase("p2", 400, 5)}, cmd(p2, 6, 400, 5)},
		{"reseed base on another store", ws, Target{Session: "s", Generation: 6, Base: ReseedBase("p2", 400, 5)}, cmd(p1, 6, 0, 0)},
		{"base of a later generation", ws, Target{Session: "s", Generation: 4, Current: "p2", Base: ReseedBase("p2", 400, 5)}, cmd(p2, 4, 0, 0)},
		{"empty base", ws, Target{Session: "s", Generation: 6, Current: "p2", Base: ReseedBase("p2", 0, 5)}, cmd(p2, 6, 0, 0)},
		{"base of unknown generation", ws, Target{Session: "s", Generation: 6, Current: "p2", Base: ReseedBase("p2", 400, 0)}, cmd(p2, 6, 0, 0)},
		{"store seed", ws, Target{Session: "s", Generation: 6, Current: "p2", Base: StoreSeedBase("p2", 900, 6)}, cmd(p2, 6, 900, 6)},
		{"not a store seed", ws, Target{Session: "s", Generation: 6, Current: "p2", Base: StoreSeedBase("p2", 900, 0)}, cmd(p2, 6, 0, 0)},
		{"resync of the snapshot's residency", ws, Target{Session: "s", Generation: 5, Current: "p2", Base: ResyncBase(rec, 500)}, cmd(p2, 5, 480, 5)},
		{"resync holding less than the snapshot", ws, Target{Session: "s", Generation: 5, Current: "p2", Base: ResyncBase(rec, 400)}, cmd(p2, 5, 0, 0)},
		{"resync of another generation", ws, Target{Session: "s", Generation: 6, Current: "p2",
			Base: ResyncBase(&kvcv1.SessionRecord{Generation: 6, Snapshot: rec.Snapshot}, 500)}, cmd(p2, 6, 0, 0)},
		{"no prefill worker of the TP size", ws, Target{Session: "s", Generation: 5, TP: 2}, nil},
		{"no prefill worker", []*kvcv1.Worker{gone}, Target{Session: "s", Generation: 5}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, p := TargetCommand(tt.ws, tt.t)
			if !proto.Equal(got, tt.want) {
				t.Fatalf("TargetCommand = %v, want %v", got, tt.want)
			}
			if (p == nil) != (tt.want == nil) || (p != nil && p.GetWorkerId() != tt.want.GetPrefillWorkerId()) {
				t.Fatalf("chosen worker %v, want %s", p, tt.want.GetPrefillWorkerId())
			}
		})
	}
}

// TestHintsCommand: the agent hints' own command — an expired pin is none; nothing is sent to
// tell a sidecar of no hints unless the hints changed (an unpin).
func TestHintsCommand(t *testing.T) {
	const now = 1_000_000
	tests := []struct {
		name   string
		until  int64
		low    bool
		always bool
		want   *kvcv1.SetSessionHintsCommand
	}{
		{"pinned", now + 5000, false, false, &kvcv1.SetSessionHintsCommand{SessionId: "s", PinnedUntilUnixMs: now + 5000}},
		{"low priority", 0, true, false, &kvcv1.SetSessionHintsCommand{SessionId: "s", LowPriority: true}},
		{"expired pin, nothing else", now - 1, false, false, nil},
		{"expired pin, low", now, true, false, &kvcv1.SetSessionHintsCommand{SessionId: "s", LowPriority: true}},
		{"none", 0, false, false, nil},
		{"none, changed: an unpin", 0, false, true, &kvcv1.SetSessionHintsCommand{SessionId: "s"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := HintsCommand("s", tt.until, tt.low, now, tt.always); !proto.Equal(got, tt.want) {
				t.Fatalf("HintsCommand = %v, want %v", got, tt.want)
			}
		})
	}
}
