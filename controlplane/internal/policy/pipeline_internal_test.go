package policy

import (
	"testing"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// TestFindWorkerMatchesScan: findWorker's last-byte filter finds exactly what a plain scan of
// id and role does (ids sharing their last byte, prefixes of each other, the empty id).
func TestFindWorkerMatchesScan(t *testing.T) {
	d, p := kvcv1.WorkerRole_WORKER_ROLE_DECODE, kvcv1.WorkerRole_WORKER_ROLE_PREFILL
	ws := []*kvcv1.Worker{
		{WorkerId: "p0", Role: p}, {WorkerId: "d0", Role: d}, {WorkerId: "dd0", Role: d}, {WorkerId: "x0", Role: d},
		{WorkerId: "d10", Role: d}, {WorkerId: "d0", Role: p}, {WorkerId: "", Role: d}, {WorkerId: "é", Role: d},
	}
	scan := func(id string, role kvcv1.WorkerRole) *kvcv1.Worker {
		for _, w := range ws {
			if w.WorkerId == id && w.Role == role {
				return w
			}
		}
		return nil
	}
	for _, id := range []string{"p0", "d0", "dd0", "x0", "d10", "0", "d1", "", "é", "\xa9", "d00"} {
		for _, role := range []kvcv1.WorkerRole{d, p} {
			if got, want := findWorker(ws, id, role), scan(id, role); got != want {
				t.Errorf("findWorker(%q, %v) = %p, want %p", id, role, got, want)
			}
		}
	}
}
