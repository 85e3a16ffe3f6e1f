package sidecar

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"gopkg.in/natefinch/lumberjack.v2"
)

// Event names written to the event log (and counted in kvc_sidecar_events_total).
const (
	EvPushEnqueued = "snapshot_push_enqueued"
	EvPushSent     = "snapshot_push_sent"
	EvPushFailed   = "snapshot_push_failed"
	EvPushAborted  = "snapshot_push_aborted"
	EvRecvIngested = "snapshot_recv_ingested"
	EvRecvRejected = "snapshot_recv_rejected"
	EvEvicted      = "snapshot_evicted"
	// EvCutBack: a re-tag append cut the store's snapshot back to its base (Seqlen; BaseLen is the
	// seqlen it had, Bytes what the snapshot's pages hold now).
	EvCutBack    = "snapshot_cut_back"
	EvBypassHit  = "snapshot_bypass_hit"
	EvBypassMiss = "snapshot_bypass_miss"
	// EvStoreLoad / EvStoreLoadMiss: a prefill worker loaded a session's snapshot prefix from
	// its own sidecar's store into its pool (prefill from the snapshot), or could not.
	EvStoreLoad      = "snapshot_store_load"
	EvStoreLoadMiss  = "snapshot_store_load_miss"
	EvTransferDone   = "transfer_done"
	EvTransferFailed = "transfer_failed"
	EvSessionRelease = "session_released"
)

// Event is one line of the JSON-lines event log. Zero fields are left out.
type Event struct {
	TS         time.Time `json:"ts"`
	Event      string    `json:"event"`
	Worker     string    `json:"worker,omitempty"`
	Session    string    `json:"session,omitempty"`
	Generation uint64    `json:"generation,omitempty"`
	BaseLen    int64     `json:"base_len,omitempty"`
	Tokens     int64     `json:"tokens,omitempty"`
	Seqlen     int64     `json:"seqlen,omitempty"`
	Bytes      int64     `json:"bytes,omitempty"`
	DurationMs float64   `json:"duration_ms,omitempty"`
	Room       int64     `json:"room,omitempty"`
	Kind       string    `json:"kind,omitempty"`
	Peer       string    `json:"peer,omitempty"`
	Reason     string    `json:"reason,omitempty"`
	Attempt    int       `json:"attempt,omitempty"`
	// RetagFrom: a push that re-tagged the store's snapshot of this older generation (a snapshot
	// reseed's valid base, [0, base_len), was not sent again).
	RetagFrom uint64 `json:"retag_from,omitempty"`
	// Phases splits a push's duration (snapshot_push_sent) into its steps.
	Phases *PushPhases `json:"phases,omitempty"`
}

// PushPhases are the steps of one push attempt, in milliseconds: the ReserveSnapshot RPC, the
// plan (runs checked against both page maps, before the first copy), the transfer (lay out,
// submit, copy, wait) and the CommitSnapshot RPC. With store credit (ReserveOverlapped) the
// reserve runs in parallel with CreditMs, the plan and copy of the push's first tokens into the
// writer's credit pages, and the plan of the rest (PlanMs) follows the reserve's answer while
// that copy still runs, and the rest is submitted behind it at once; TransferMs is then the
// rest's time after the credit copy ended. CriticalMs, the steps on the critical path, is the
// event's duration less the sidecar's own bookkeeping.
type PushPhases struct {
	ReserveMs  float64 `json:"reserve_ms"`
	PlanMs     float64 `json:"plan_ms"`
	TransferMs float64 `json:"transfer_ms"`
	CommitMs   float64 `json:"commit_ms"`
	// CreditMs is the copy of the first CreditTokens tokens into credit pages, overlapped with
	// the reserve (0 without credit).
	CreditMs          float64 `json:"credit_ms,omitempty"`
	CreditTokens      int64   `json:"credit_tokens,omitempty"`
	ReserveOverlapped bool    `json:"reserve_overlapped,omitempty"`
}

// CriticalMs is the time of the steps one after another: reserve and plan (or, overlapped, the
// longer of the credit copy and reserve + plan), then transfer and commit.
func (p PushPhases) CriticalMs() float64 {
	first := p.ReserveMs + p.PlanMs
	if p.ReserveOverlapped {
		first = max(first, p.CreditMs)
	}
	return first + p.TransferMs + p.CommitMs
}

// EventLog writes events as JSON lines and mirrors them into Prometheus metrics. A nil writer
// only counts. Safe for concurrent use.
type EventLog struct {
	mu     sync.Mutex
	w      io.Writer
	closer io.Closer
	worker string

	events    *prometheus.CounterVec
	pushBytes prometheus.Histogram
	pushDur   prometheus.Histogram
	retags    prometheus.Counter
	retagSave prometheus.Counter
	xferBytes *prometheus.HistogramVec
	xferDur   *prometheus.HistogramVec
}

// Rotation bounds the event log on disk (--event-log-max-mb, --event-log-max-backups): once the
// file would pass MaxMB megabytes it is renamed to a backup with the time in its name
// (sidecar-decode-0.events-2026-12-01T23-40-00.000.jsonl) and a new one started; the oldest
// backups past MaxBackups are removed (in the background, just after a rotation).
type Rotation struct {
	MaxMB      int
	MaxBackups int
}

// Check validates r.
func (r Rotation) Check() error {
	switch {
	case r.MaxMB < 1 || r.MaxMB > 1<<20:
		return fmt.Errorf("--event-log-max-mb %d out of range [1, %d]", r.MaxMB, 1<<20)
	case r.MaxBackups < 1 || r.MaxBackups > 10000:
		return fmt.Errorf("--event-log-max-backups %d out of range [1, 10000]", r.MaxBackups)
	}
	return nil
}

// OpenEventLog opens (appends to) path, rotated as rot says (gopkg.in/natefinch/lumberjack.v2);
// an empty path logs nowhere but still counts metrics.
func OpenEventLog(path, worker string, rot Rotation, reg prometheus.Registerer) (*EventLog, error) {
	var w io.Writer
	var c io.Closer
	if path != "" {
		if err := rot.Check(); err != nil {
			return nil, fmt.Errorf("event log: %w", err)
		}
		// The rotating writer opens the file at the first event: open it now too, so that a
		// path the sidecar cannot write is an error at start.
		f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			return nil, fmt.Errorf("event log: %w", err)
		}
		_ = f.Close()
		lj := &lumberjack.Logger{Filename: path, MaxSize: rot.MaxMB, MaxBackups: rot.MaxBackups, LocalTime: false}
		w, c = lj, lj
	}
	l := NewEventLog(w, worker, reg)
	l.closer = c
	return l, nil
}

// NewEventLog logs to w (may be nil) and registers its metrics on reg (may be nil).
func NewEventLog(w io.Writer, worker string, reg prometheus.Registerer) *EventLog {
	byteBuckets := prometheus.ExponentialBuckets(4096, 4, 12)
	durBuckets := prometheus.ExponentialBuckets(0.0005, 2, 16)
	l := &EventLog{
		w:      w,
		worker: worker,
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvc_sidecar_events_total", Help: "Sidecar events by name (see the event log).",
		}, []string{"event"}),
		pushBytes: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvc_snapshot_push_bytes", Help: "Bytes moved per successful D->P snapshot push.",
			Buckets: byteBuckets,
		}),
		pushDur: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "kvc_snapshot_push_duration_seconds", Help: "Duration of successful D->P snapshot pushes.",
			Buckets: durBuckets,
		}),
		retags: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_snapshot_retag_pushes_total", Help: "Successful D->P pushes that re-tagged the store's snapshot after a snapshot reseed instead of a full push.",
		}),
		retagSave: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvc_snapshot_retag_saved_bytes_total", Help: "Bytes the re-tagging pushes did not send again (the reseed's valid base, base_len tokens at the push's bytes per token).",
		}),
		xferBytes: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvc_transfer_bytes", Help: "Bytes per completed KV transfer by kind (seed, snapshot).",
			Buckets: byteBuckets,
		}, []string{"kind"}),
		xferDur: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvc_transfer_duration_seconds", Help: "Duration of completed KV transfers by kind.",
			Buckets: durBuckets,
		}, []string{"kind"}),
	}
	if reg != nil {
		reg.MustRegister(l.events, l.pushBytes, l.pushDur, l.retags, l.retagSave, l.xferBytes, l.xferDur)
	}
	return l
}

// Emit stamps and writes e and updates the metrics.
func (l *EventLog) Emit(e Event) {
	if l == nil {
		return
	}
	if e.TS.IsZero() {
		e.TS = time.Now()
	}
	if e.Worker == "" {
		e.Worker = l.worker
	}
	l.events.WithLabelValues(e.Event).Inc()
	switch e.Event {
	case EvPushSent:
		l.pushBytes.Observe(float64(e.Bytes))
		l.pushDur.Observe(e.DurationMs / 1e3)
		if e.RetagFrom != 0 && e.Tokens > 0 {
			l.retags.Inc()
			l.retagSave.Add(float64(e.BaseLen) * float64(e.Bytes) / float64(e.Tokens))
		}
	case EvTransferDone:
		l.xferBytes.WithLabelValues(e.Kind).Observe(float64(e.Bytes))
		l.xferDur.WithLabelValues(e.Kind).Observe(e.DurationMs / 1e3)
	}
	if l.w == nil {
		return
	}
	b, err := json.Marshal(e)
	if err != nil {
		return
	}
	b = append(b, '\n')
	l.mu.Lock()
	_, _ = l.w.Write(b)
	l.mu.Unlock()
}

// Close closes the underlying file, if any.
func (l *EventLog) Close() error {
	if l == nil || l.closer == nil {
		return nil
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.closer.Close()
}

// Ms converts a duration to float milliseconds for Event.DurationMs.
func Ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
