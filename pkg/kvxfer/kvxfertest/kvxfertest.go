// Package kvxfertest holds test helpers for code that moves KV bytes with package kvxfer.
package kvxfertest

import (
	"github.com/kvcentric/kvcentric/pkg/kvxfer"
	"github.com/kvcentric/kvcentric/pkg/rdma"
)

// Requests plans tokens [from, to) from the local page map src to the remote page map dst in
// segment seg as the requests of one batch (kvxfer.PlanRuns, then Requests).
func Requests(src, dst kvxfer.PageMap, seg rdma.SegmentID, from, to int64) ([]rdma.Request, error) {
	p, err := kvxfer.PlanRuns(src, dst, from, to)
	if err != nil {
		return nil, err
	}
	return p.Requests(seg), nil
}
