package sidecar

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// DefaultEventBuffer bounds the session events a sidecar keeps for the control plane while the
// stream is down or slow.
const DefaultEventBuffer = 4096

// eventBuffer is the bounded FIFO of session events not yet sent to the control plane. When
// full, the oldest event is dropped (and counted): the newest events carry the latest state of
// their sessions, and the full resync on every connection carries the residency truth anyway.
type eventBuffer struct {
	mu  sync.Mutex
	q   []*kvcv1.SessionEvent // q[head:] are queued, oldest first
	max int
	// ready holds a token while events are queued (cap 1; the sender re-arms it).
	ready chan struct{}

	dropped  prometheus.Counter
	buffered prometheus.Gauge
	replayed prometheus.Counter
	silent   prometheus.Counter // control-plane connections left as silent (cpclient.Liveness)
}

func newEventBuffer(max int, reg prometheus.Registerer) *eventBuffer {
	if max <= 0 {
		max = DefaultEventBuffer
	}
	b := &eventBuffer{
		max:   max,
		ready: make(chan struct{}, 1),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_sidecar_cp_events_dropped_total",
			Help: "Session events for the control plane dropped, oldest first, because the buffer was full.",
		}),
		buffered: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvc_sidecar_cp_events_buffered", Help: "Session events waiting to be sent to the control plane.",
		}),
		replayed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_sidecar_cp_events_replayed_total",
			Help: "Session events raised while disconnected and sent after a reconnect's hello, before its full resync.",
		}),
		silent: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_sidecar_cp_silent_total",
			Help: "Control-plane connections left because they answered nothing for half the lease (--cp-lease: a paused leader, a frozen link).",
		}),
	}
	if reg != nil {
		reg.MustRegister(b.dropped, b.buffered, b.replayed, b.silent)
	}
	return b
}

// push appends ev, dropping the oldest queued event when full; it returns the dropped event.
func (b *eventBuffer) push(ev *kvcv1.SessionEvent) (dropped *kvcv1.SessionEvent) {
	b.mu.Lock()
	if len(b.q) >= b.max {
		dropped = b.q[0]
		b.q[0] = nil
		b.q = b.q[1:]
		b.dropped.Inc()
	}
	b.q = append(b.q, ev)
	b.buffered.Set(float64(len(b.q)))
	b.mu.Unlock()
	b.signal()
	return dropped
}

// take removes and returns up to n queued events (all of them when n <= 0), oldest first.
func (b *eventBuffer) take(n int) []*kvcv1.SessionEvent {
	b.mu.Lock()
	defer b.mu.Unlock()
	if n <= 0 || n > len(b.q) {
		n = len(b.q)
	}
	out := make([]*kvcv1.SessionEvent, n)
	copy(out, b.q[:n])
	clear(b.q[:n])
	b.q = b.q[n:]
	if len(b.q) == 0 {
		b.q = nil // let the backing array go
	}
	b.buffered.Set(float64(len(b.q)))
	return out
}

// putBack returns events that were taken but not sent to the front of the queue, keeping the
// order; what exceeds the bound is dropped from the oldest end.
func (b *eventBuffer) putBack(evs []*kvcv1.SessionEvent) {
	if len(evs) == 0 {
		return
	}
	b.mu.Lock()
	q := make([]*kvcv1.SessionEvent, 0, len(evs)+len(b.q))
	q = append(append(q, evs...), b.q...)
	if over := len(q) - b.max; over > 0 {
		clear(q[:over])
		q = q[over:]
		b.dropped.Add(float64(over))
	}
	b.q = q
	b.buffered.Set(float64(len(b.q)))
	b.mu.Unlock()
	b.signal()
}

// len is the number of queued events.
func (b *eventBuffer) len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.q)
}

func (b *eventBuffer) signal() {
	select {
	case b.ready <- struct{}{}:
	default:
	}
}
