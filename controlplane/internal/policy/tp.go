package policy

import (
	"slices"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// Tensor parallelism. A worker of the cluster view may be a tensor-parallel group (one record
// for its tp_size ranks, controlplane/internal/state/tp.go); its transfers pair rank r of the
// prefill worker with rank r of the decode worker, so a decision pairs a prefill and a decode
// worker only when their tp_size is equal: the decode candidates of a pick are those some
// prefill worker (in any state) has the tp_size of, the prefill worker of a decision one of the
// decode worker's tp_size, and a snapshot is reseeded only into a decode worker of its holder's
// tp_size. Unequal TP on P and D is not supported: such workers are never paired (and the state
// lists them with a tp_problem). Where every worker has tp_size 1 nothing changes.

// TPSize is a worker's tensor-parallel size (0 and 1 alike: none).
func TPSize(w *kvcv1.Worker) int32 { return max(w.GetTpSize(), 1) }

// FindTP is the tensor-parallel size of worker id in ws (1 when it is not there).
func FindTP(ws []*kvcv1.Worker, id string) int32 {
	for _, w := range ws {
		if w.GetWorkerId() == id {
			return TPSize(w)
		}
	}
	return 1
}

// prefillSizes collects the prefill workers' tensor-parallel sizes once per cycle.
func (c *Cycle) prefillSizes() []int32 {
	if !c.pDone {
		c.pDone = true
		for _, w := range c.In.Workers {
			if w.Role == kvcv1.WorkerRole_WORKER_ROLE_PREFILL && !slices.Contains(c.pSizes, TPSize(w)) {
				c.pSizes = append(c.pSizes, TPSize(w))
			}
		}
	}
	return c.pSizes
}

// pairable: some prefill worker has d's tensor-parallel size, or there is no prefill worker at
// all (then nothing is paired with anything; the decision's own rules say what happens).
func (c *Cycle) pairable(d *kvcv1.Worker) bool {
	ps := c.prefillSizes()
	return len(ps) == 0 || slices.Contains(ps, TPSize(d))
}
