package faults

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/kvcentric/kvcentric/pkg/launch"
)

// Scenario is one fault injected under load.
type Scenario struct {
	Name      string
	CI        bool   // part of the default (CI) subset of make test-faults
	Criterion string // the pass criterion, for the report and docs/reliability.md
	// Bound is the recovery bound, counted from the reference time Inject returns.
	Bound time.Duration
	// Inject injects the fault and returns the reference time recovery is counted from (the
	// fault, or the moment the restarted process is back), and the decode workers whose
	// residency the fault may legitimately forget (their kvc-sim lost its memory).
	Inject func(ctx context.Context, h *Harness, s *Step) (ref time.Time, drops []string, err error)
	// Restore brings the cluster back to full strength after the recovery was measured (e.g.
	// restarts a killed control plane); nil when nothing is needed.
	Restore func(ctx context.Context, h *Harness, s *Step) error
	// Shed, when set, says which failed requests the scenario's fault may legitimately refuse
	// (load shedding by a stated bound): counted in Outcome.Shed, not as failures.
	Shed func(Result) bool
}

// Step lets a scenario leave notes for its report.
type Step struct {
	notes []string
	// faultAt is set by the runner just before Inject; Inject may move it (when the fault is
	// the end of a setup, e.g. a black hole after a check).
	faultAt time.Time
}

// Note adds a line to the scenario's report.
func (s *Step) Note(format string, a ...any) { s.notes = append(s.notes, fmt.Sprintf(format, a...)) }

// Outcome is a scenario's measured result.
type Outcome struct {
	Name      string  `json:"name"`
	Criterion string  `json:"criterion"`
	Bound     float64 `json:"bound_s"`
	Recovered bool    `json:"recovered"` // within the bound
	Recovery  float64 `json:"recovery_s"`
	NeverBack bool    `json:"never_back"` // not whole again within the wait limit
	Requests  int     `json:"requests"`
	Failed    int     `json:"failed"`
	// KilledMidStream are requests that were streaming from a worker the fault killed (kill -9
	// of its engine: its sessions are Drops) when it died and that the gateway did not resume
	// (--resume-mid-stream off, or no decision for the continuation): the client sees the stream
	// break, as it would from a real engine's crash. Counted and noted, not failures of the
	// criterion.
	KilledMidStream int `json:"killed_mid_stream"`
	// Resumed are requests whose decode worker died mid-stream and that the gateway finished
	// through a new decision (Result.ResumedFrom).
	Resumed int `json:"resumed_mid_stream,omitempty"`
	// Retried are requests the gateway retried through a new decision after an attempt failed
	// before its first token (Result.RetriedFrom, ResumedRetriedFrom): each attempt is in the
	// history (OpsFromResults).
	Retried int `json:"retried,omitempty"`
	// Shed are requests refused by a bound the scenario states (Scenario.Shed), not failures.
	Shed       int            `json:"shed,omitempty"`
	FailOpen   int            `json:"fail_open"`
	Lost       int            `json:"lost"`
	Duplicated int            `json:"duplicated"`
	Phantom    int            `json:"phantom"` // the leader names a worker that does not hold the session
	Illegal    int            `json:"illegal_sessions"`
	Unknown    int            `json:"unknown_sessions"`
	Writes     int            `json:"acked_writes"`
	Ops        int            `json:"ops"`
	Modes      map[string]int `json:"modes"`
	Errors     []string       `json:"errors,omitempty"`
	Notes      []string       `json:"notes,omitempty"`
	// CheckFailed is a scenario-specific criterion that failed (e.g. detection time, memory).
	CheckFailed string `json:"check_failed,omitempty"`
	Passed      bool   `json:"passed"`
}

// RunConfig shapes a run.
type RunConfig struct {
	Out       io.Writer // the fault: lines and details
	Warm      time.Duration
	After     time.Duration // load kept after recovery
	WaitLimit time.Duration // longest wait for recovery
	Settle    time.Duration // after the load stops, before the quiescent reads
}

// Runner runs scenarios one after another on one cluster under one load generator.
type Runner struct {
	h    *Harness
	load *Load
	cfg  RunConfig
	// last quiescent read per session: the register's value where the next segment starts
	base     map[string]string
	baseAt   time.Time
	consumed int
	dups     map[string]bool // sessions held by two decode workers at the last quiescent point
}

// NewRunner returns a runner; Baseline must run before the first scenario.
func NewRunner(h *Harness, l *Load, cfg RunConfig) *Runner {
	if cfg.Warm <= 0 {
		cfg.Warm = 2 * time.Second
	}
	if cfg.After <= 0 {
		cfg.After = 2 * time.Second
	}
	if cfg.WaitLimit <= 0 {
		cfg.WaitLimit = 45 * time.Second
	}
	if cfg.Settle <= 0 {
		cfg.Settle = 500 * time.Millisecond
	}
	return &Runner{h: h, load: l, cfg: cfg, base: map[string]string{}}
}

func (r *Runner) printf(format string, a ...any) {
	if r.cfg.Out != nil {
		fmt.Fprintf(r.cfg.Out, format+"\n", a...)
	}
}

// Baseline runs the load on the healthy cluster for d, then takes the first quiescent reads.
// It reports the requests that failed (there should be none).
func (r *Runner) Baseline(ctx context.Context, d time.Duration) (Outcome, error) {
	sc := Scenario{Name: "baseline", Criterion: "healthy cluster: no failed request, history linearizable",
		Bound: 5 * time.Second, Inject: func(context.Context, *Harness, *Step) (time.Time, []string, error) {
			return time.Now(), nil, nil
		}}
	old := r.cfg.Warm
	r.cfg.Warm = d
	defer func() { r.cfg.Warm = old }()
	return r.Run(ctx, sc)
}

// Run runs one scenario: load, fault, recovery, restore, quiescent reads, checks.
func (r *Runner) Run(ctx context.Context, sc Scenario) (Outcome, error) {
	out := Outcome{Name: sc.Name, Criterion: sc.Criterion, Bound: sc.Bound.Seconds(), Modes: map[string]int{}}
	segStart := time.Now()
	lctx, stopLoad := context.WithCancel(ctx)
	loadDone := make(chan struct{})
	go func() { defer close(loadDone); r.load.Run(lctx) }()
	defer func() { stopLoad(); <-loadDone }()
	select {
	case <-time.After(r.cfg.Warm):
	case <-ctx.Done():
		return out, ctx.Err()
	}
	st := &Step{faultAt: time.Now()}
	evictedBefore := r.h.sumSims(ctx, "kvc_sim_evictions_total")
	ref, drops, err := sc.Inject(ctx, r.h, st)
	if err != nil {
		out.CheckFailed = firstLine(err.Error())
		st.Note("scenario check failed: %v", err)
	}
	if ref.IsZero() {
		ref = time.Now()
	}
	// Recovery: whole (a leader lists every worker READY and the gateway's route stream is up),
	// and every session served by a control-plane decision in a request started after ref.
	whole, wholeErr := r.waitWhole(ctx, ref, st)
	served, servedErr := r.waitServed(ctx, ref)
	end := whole
	if served.After(end) {
		end = served
	}
	switch {
	case wholeErr != nil || servedErr != nil:
		out.NeverBack = true
		out.Recovery = r.cfg.WaitLimit.Seconds()
		if wholeErr != nil {
			st.Note("never whole: %v", wholeErr)
		}
		if servedErr != nil {
			st.Note("sessions not served: %v", servedErr)
		}
	default:
		st.Note("whole %.1f s, every session served by a decision %.1f s after the reference", whole.Sub(ref).Seconds(), served.Sub(ref).Seconds())
		out.Recovery = end.Sub(ref).Seconds()
		out.Recovered = end.Sub(ref) <= sc.Bound
	}
	if sc.Restore != nil {
		if err := sc.Restore(ctx, r.h, st); err != nil {
			st.Note("restore: %v", err)
		}
		if _, err := r.waitWhole(ctx, time.Now(), nil); err != nil {
			st.Note("not whole after restore: %v", err)
		}
	}
	select {
	case <-time.After(r.cfg.After):
	case <-ctx.Done():
	}
	stopLoad()
	<-loadDone
	segEnd := time.Now()
	// The decode pools are full (DecodePoolTokens): LRU evictions from the fault on (a restarted
	// kvc-sim counts from 0, so this is a lower bound then).
	st.Note("decode LRU evictions %.0f", max(0, r.h.sumSims(ctx, "kvc_sim_evictions_total")-evictedBefore))

	results, next := r.load.Results(r.consumed)
	r.consumed = next
	r.dump(sc.Name, results)
	ops := []Op{}
	// The register's value at the segment's start: the previous quiescent read, as a write.
	for id, w := range r.base {
		ops = append(ops, Op{Session: id, Kind: opWrite, Worker: w, Call: r.baseAt, Return: r.baseAt, Source: "previous quiescent read"})
	}
	ops = append(ops, OpsFromResults(results)...)
	sessions := map[string]bool{}
	for _, res := range results {
		sessions[res.Session] = true
		out.Requests++
		if res.FailOpen {
			out.FailOpen++
		}
		if len(res.RetriedFrom)+len(res.ResumedRetriedFrom) > 0 {
			out.Retried++
		}
		if res.OK && res.ResumedFrom != "" {
			out.Resumed++
			st.Note("resumed mid-stream: %s turn %d from %s on %s (%s)", res.Session, res.Turn, res.ResumedFrom, res.Worker, res.Mode)
		}
		if !res.OK && killedMidStream(res, drops, st.faultAt) {
			out.KilledMidStream++
			st.Note("killed mid-stream: %s turn %d on %s (%s)", res.Session, res.Turn, res.Worker, res.Err)
		} else if !res.OK && sc.Shed != nil && sc.Shed(res) {
			out.Shed++
			st.Note("shed: %s turn %d (%s)", res.Session, res.Turn, firstLine(res.Err))
		} else if !res.OK {
			out.Failed++
			if len(out.Errors) < 8 {
				out.Errors = append(out.Errors, fmt.Sprintf("%s turn %d at %s: %s", res.Session, res.Turn, res.Call.UTC().Format("15:04:05.000"), res.Err))
			}
		}
		m := res.Mode
		switch {
		case res.FailOpen:
			m += "(fail-open)"
		case res.Mode != "DIRECT_TO_D" && res.Mode != "SEED" && res.Reason != "":
			m += "/" + res.Reason // why a session was reseeded or fell back
		}
		out.Modes[m]++
	}
	// Sessions a decode worker released on its own (capacity eviction, a move) are dropped
	// from the register legitimately: the decode sidecars' event logs say when.
	rel := r.h.releases(segStart, segEnd)
	for _, e := range rel {
		ops = append(ops, Op{Session: e.session, Kind: opDrop, Worker: e.worker, Call: e.at.Add(-100 * time.Millisecond), Return: e.at.Add(2 * time.Second), Source: "release event"})
	}
	if len(rel) > 0 {
		reasons := map[string]int{}
		for _, e := range rel {
			reasons[e.reason]++
		}
		st.Note("worker releases (legitimate drops) %v", reasons)
	}
	// Sessions the control plane re-homed (their decode worker died; rehome.go) are written to
	// their new decode worker without a client request: the log line says when.
	if rh := r.h.rehomes(segStart, segEnd); len(rh) > 0 {
		for _, e := range rh {
			ops = append(ops, Op{Session: e.session, Kind: opWrite, Worker: e.to, Call: e.at.Add(-time.Second), Return: e.at.Add(100 * time.Millisecond), Source: "re-home"})
		}
		st.Note("sessions re-homed by the control plane: %d", len(rh))
	}
	for _, d := range drops {
		for id := range sessions {
			ops = append(ops, Op{Session: id, Kind: opDrop, Worker: d, Call: st.faultAt, Return: segEnd, Source: "fault"})
		}
		for id := range r.base {
			if !sessions[id] {
				ops = append(ops, Op{Session: id, Kind: opDrop, Worker: d, Call: st.faultAt, Return: segEnd, Source: "fault"})
			}
		}
	}
	// Quiescent reads: the load is stopped and every answer is in; the gateway reports each
	// outcome on its route stream after the answer, so wait Settle before reading.
	select {
	case <-time.After(r.cfg.Settle):
	case <-ctx.Done():
	}
	r.base = map[string]string{}
	readIDs := make([]string, 0, len(sessions))
	for id := range sessions {
		readIDs = append(readIDs, id)
	}
	sort.Strings(readIDs)
	holdings, herr := r.h.DecodeHoldings(ctx)
	if herr != nil {
		st.Note("decode holdings: %v", herr)
	}
	held := map[string][]string{}
	for w, ss := range holdings {
		for _, s := range ss {
			held[s] = append(held[s], w)
		}
	}
	dupNow, carried := map[string]bool{}, 0
	for _, id := range readIDs {
		call := time.Now()
		var w string
		var err error
		for attempt := 0; attempt < 3; attempt++ { // a read is retried only when it fails
			cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			w, err = r.h.GetSession(cctx, id)
			cancel()
			if err == nil {
				break
			}
		}
		if err != nil {
			st.Note("GetSession %s: %v", id, err)
			continue
		}
		ret := time.Now()
		ops = append(ops, Op{Session: id, Kind: opRead, Worker: w, Call: call, Return: ret, Source: "GetSession"})
		r.base[id] = w
		if len(held[id]) > 1 {
			dupNow[id] = true
			if r.dups[id] {
				carried++
			} else {
				out.Duplicated++
				if out.Duplicated <= 5 {
					st.Note("duplicated: %s held by %s (leader says %q)", id, strings.Join(held[id], ","), w)
				}
			}
		}
		if w != "" && herr == nil && !contains(held[id], w) {
			out.Phantom++
			if out.Phantom <= 3 {
				st.Note("phantom: leader says %s is resident on %s, which does not hold it", id, w)
			}
		}
	}
	r.baseAt = time.Now()
	r.dups = dupNow
	if out.Duplicated > 5 {
		st.Note("duplicated: … %d more", out.Duplicated-5)
	}
	if carried > 0 {
		st.Note("%d sessions still duplicated from an earlier scenario (not counted again)", carried)
	}
	visDir := filepath.Join(r.h.cfg.WorkDir, "linearizability-"+sc.Name)
	v := CheckHistoryVisualize(ops, 20*time.Second, visDir)
	out.Lost, out.Illegal, out.Unknown, out.Writes, out.Ops = v.Lost, len(v.Illegal), len(v.Unknown), v.Writes, v.Ops
	if len(v.Illegal) > 0 && v.Lost == 0 {
		// Not linearizable although no single write was contradicted cleanly: count each such
		// session once.
		out.Lost = len(v.Illegal)
	}
	for i, d := range v.LostDetails {
		if i == 5 {
			st.Note("lost: … %d more", len(v.LostDetails)-5)
			break
		}
		st.Note("lost: %s", d)
	}
	if len(v.Illegal) > 0 {
		st.Note("not linearizable: %s (porcupine's view of each: %s/<session>.html)", strings.Join(first(v.Illegal, 6), ","), visDir)
	}
	out.Notes = st.notes
	out.Passed = out.Recovered && out.Failed == 0 && out.Lost == 0 && out.Duplicated == 0 && out.Illegal == 0 && out.CheckFailed == ""
	r.report(out)
	return out, nil
}

// dump writes a scenario's requests as JSON lines into the work directory.
func (r *Runner) dump(name string, rs []Result) {
	f, err := os.Create(filepath.Join(r.h.cfg.WorkDir, "requests-"+name+".jsonl"))
	if err != nil {
		return
	}
	defer f.Close()
	enc := json.NewEncoder(f)
	for _, x := range rs {
		_ = enc.Encode(x)
	}
}

// slot is a session id without its generation suffix (fs-07-3 → fs-07).
func slot(id string) string {
	if i := strings.LastIndexByte(id, '-'); i > 0 {
		return id[:i]
	}
	return id
}

func first(s []string, n int) []string {
	if len(s) > n {
		return append(append([]string(nil), s[:n]...), fmt.Sprintf("(+%d)", len(s)-n))
	}
	return s
}

func contains(xs []string, s string) bool {
	for _, x := range xs {
		if x == s {
			return true
		}
	}
	return false
}

func (r *Runner) report(o Outcome) {
	verdict := "PASS"
	if !o.Passed {
		verdict = "FAIL"
	}
	modes := make([]string, 0, len(o.Modes))
	for m, n := range o.Modes {
		modes = append(modes, fmt.Sprintf("%s=%d", m, n))
	}
	sort.Strings(modes)
	r.printf("  %s %s: bound %.1f s (%s); %d requests (%s), %d acked writes, %d ops checked, %d phantom, %d sessions unknown to the checker",
		verdict, o.Name, o.Bound, o.Criterion, o.Requests, strings.Join(modes, " "), o.Writes, o.Ops, o.Phantom, o.Unknown)
	for _, n := range o.Notes {
		r.printf("    note: %s", n)
	}
	for _, e := range o.Errors {
		r.printf("    failed: %s", e)
	}
	rec := fmt.Sprintf("%.1f", o.Recovery)
	if o.NeverBack {
		rec = ">" + rec
	}
	prefix := "fault:"
	if o.Name == "baseline" {
		prefix = "baseline:"
	}
	killed := ""
	if o.KilledMidStream > 0 {
		killed = fmt.Sprintf(", killed mid-stream %d", o.KilledMidStream)
	}
	if o.Resumed > 0 {
		killed += fmt.Sprintf(", resumed mid-stream %d", o.Resumed)
	}
	if o.Shed > 0 {
		killed += fmt.Sprintf(", shed %d", o.Shed)
	}
	r.printf("%s %s recovery %s s, failed %d, lost %d, duplicated %d%s", prefix, o.Name, rec, o.Failed, o.Lost, o.Duplicated, killed)
}

// waitWhole waits until a leader lists every worker READY and the gateway's route stream is
// up; it returns when that was first seen.
func (r *Runner) waitWhole(ctx context.Context, from time.Time, st *Step) (time.Time, error) {
	limit := r.cfg.WaitLimit - time.Since(from)
	if limit < time.Second {
		limit = time.Second
	}
	var leaderAt time.Time
	var lastErr error
	err := r.h.waitFor(ctx, "whole", limit, func(ctx context.Context) error {
		if leaderAt.IsZero() {
			if _, err := r.h.Leader(ctx); err == nil {
				leaderAt = time.Now()
			}
		}
		err := r.h.checkWhole(ctx)
		if err == nil {
			err = r.h.gatewayConnected(ctx)
		}
		if err != nil && !leaderAt.IsZero() {
			lastErr = err
		}
		return err
	})
	if st != nil {
		if !leaderAt.IsZero() {
			st.Note("a leader answered %.1f s after the reference", leaderAt.Sub(from).Seconds())
		}
		if lastErr != nil {
			st.Note("last wait before whole: %v", lastErr)
		}
	}
	return time.Now(), err
}

// waitServed waits until every session in use has an answer from a control-plane decision
// (200, not failed open) to a request started at or after ref; it returns the latest of
// those answers' return times.
func (r *Runner) waitServed(ctx context.Context, ref time.Time) (time.Time, error) {
	var latest time.Time
	missing := 0
	dctx, cancel := context.WithDeadline(ctx, ref.Add(r.cfg.WaitLimit))
	defer cancel()
	err := launch.WaitFor(dctx, nil, 50*time.Millisecond, func() bool {
		res, _ := r.load.Results(r.consumed)
		// Per session slot (a finished session is replaced by a new one in the same slot): the
		// first answer to a request started at or after ref.
		firstOK := map[string]time.Time{}
		for _, x := range res {
			if x.OK && !x.FailOpen && !x.Call.Before(ref) {
				k := slot(x.Session)
				if t, ok := firstOK[k]; !ok || x.Return.Before(t) {
					firstOK[k] = x.Return
				}
			}
		}
		latest, missing = time.Time{}, 0
		for _, id := range r.load.Sessions() {
			t, ok := firstOK[slot(id)]
			if !ok {
				missing++
				continue
			}
			if t.After(latest) {
				latest = t
			}
		}
		return missing == 0
	})
	switch {
	case err == nil:
		return latest, nil
	case ctx.Err() != nil:
		return time.Time{}, ctx.Err()
	}
	return time.Time{}, fmt.Errorf("%d sessions without a decision-served answer %s after the reference", missing, r.cfg.WaitLimit)
}

// killedMidStream reports whether res failed because the engine serving it was killed by the
// fault while it streamed: a worker of drops (its kvc-sim killed), the kill inside the request's
// interval, and the gateway's error for a decode stream that broke off.
func killedMidStream(res Result, drops []string, killedAt time.Time) bool {
	if res.OK || res.Worker == "" || !slices.Contains(drops, res.Worker) {
		return false
	}
	if res.Call.After(killedAt) || res.Return.Before(killedAt) {
		return false
	}
	return strings.Contains(res.Err, "worker_unreachable") && strings.Contains(res.Err, "decode stream")
}
