package prefill

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvcentric/kvcentric/sidecar-prefill/internal/store"
)

// Collectors are the prefill sidecar's own metrics: kvc_snapshot_store_token_id_bytes, the
// memory the store's token ids take (4 bytes a token, beside the KV pages), with its bound
// kvc_snapshot_store_token_id_capacity_bytes (4 bytes for every token the store's pages hold),
// and the SnapshotTokens answers by outcome.
func (s *Sidecar) Collectors() []prometheus.Collector {
	ids := func(f func(st *store.Store) int64) func() float64 {
		return func() float64 {
			if st := s.Store(); st != nil {
				return float64(f(st))
			}
			return 0
		}
	}
	return []prometheus.Collector{
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvc_snapshot_store_token_id_bytes",
			Help: "Bytes of the token ids the snapshot store holds with its entries and reservations (4 a token)."},
			ids(func(st *store.Store) int64 { return st.IDBytes() })),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvc_snapshot_store_token_id_capacity_bytes",
			Help: "The most the snapshot store's entries' token ids can take: 4 bytes for every token its pages hold (open reservations' ids come on top, at most as much again)."},
			ids(func(st *store.Store) int64 { return st.IDCapacityBytes() })),
		s.tokenAnswers,
	}
}
