package policy

// Admission is how a plan's decode worker admits it by the control plane's count
// (Decision.Admission). No plan is refused or downgraded for capacity or budget: a plan its D
// cannot admit now is sent there anyway and waits in the worker's prealloc queue, as every
// P/D router's request does.
type Admission uint8

// Admissions.
const (
	// AdmitFits: the D has room (fits) and, for a reseed from the store, a transfer slot.
	AdmitFits Admission = iota
	// AdmitOverCapacity: the D has no room for it now by the capacity rule (fits).
	AdmitOverCapacity
	// AdmitOverBudget: a reseed from the store onto a D whose store-transfer slots
	// (max_concurrent_transfers) are all taken.
	AdmitOverBudget
	// AdmitRejecter: a reseed onto a D that rejected the session since its last success (every
	// routable D did, or the others score lower).
	AdmitRejecter
)

// String is the metric label (kvc_router_queued_admissions_total{why}).
func (a Admission) String() string {
	switch a {
	case AdmitFits:
		return "fits"
	case AdmitOverCapacity:
		return "capacity"
	case AdmitOverBudget:
		return "transfer_budget"
	case AdmitRejecter:
		return "rejecter"
	}
	return "unknown"
}
