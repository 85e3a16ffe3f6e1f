package report

import (
	"math"
	"slices"
	"sort"
)

// Summary is one arm's line of summary.json (exactly these fields). Every percentile counts
// failed requests at the time they failed (their latency), and goodput counts them as SLO misses,
// so an arm cannot look faster by failing more; OK and Total stand beside every figure.
type Summary struct {
	OK               int     `json:"ok"`
	Total            int     `json:"total"`
	TTFTP50          float64 `json:"ttft_p50_s"`
	TTFTP90          float64 `json:"ttft_p90_s"`
	TTFTP99          float64 `json:"ttft_p99_s"`
	LatencyP50       float64 `json:"latency_p50_s"`
	LatencyP99       float64 `json:"latency_p99_s"`
	DirectToDShare   float64 `json:"direct_to_d_share"`
	ReseedCount      int     `json:"reseed_count"`
	ReseedTTFTP50    float64 `json:"reseed_ttft_p50_s"`
	SnapshotHitRate  float64 `json:"snapshot_hit_rate"`
	BytesMoved       int64   `json:"bytes_moved"`
	KVVerifyFailures int64   `json:"kv_verify_failures"`
	// DirectToDShareContinuing is the direct-to-D share over continuing turns (turn > 0; a first
	// turn can never be direct).
	DirectToDShareContinuing float64 `json:"direct_to_d_share_continuing"`
	// SnapshotStale counts the decisions that found the session's snapshot stale
	// (SNAPSHOT_STALE) and re-prefilled.
	SnapshotStale int `json:"snapshot_stale"`
	// GoodputRPS is the requests per (model) second that succeeded within the SLO (Options.SLO):
	// TTFT ≤ SLO.TTFT and time per output token ≤ SLO.TPOT, over the replay's span.
	GoodputRPS float64 `json:"goodput_rps"`
	// RecoveryS (runs with a decode worker killed mid-run, else 0): over the sessions the death
	// touched (see recovery), the longest time from the arrival of the first request it touched
	// to the first token of the session's first successful request from there on.
	RecoveryS float64 `json:"recovery_s"`
	// AffectedSessions and RecoveryTTFTP50 belong to RecoveryS: how many sessions it covers, and
	// the median TTFT of their first successful requests.
	AffectedSessions int     `json:"affected_sessions"`
	RecoveryTTFTP50  float64 `json:"recovery_ttft_p50_s"`
	// Unrecovered counts affected sessions with no successful request after the death touched them.
	Unrecovered int `json:"unrecovered"`
	// RecoveryExcessS is what the death cost beyond an ordinary turn: over the affected sessions,
	// the longest recovery delay minus the session's usual TTFT (at least 0; 0 when no session was
	// affected). The recovery target compares it (docs/benchmark.md, "Goodput and recovery").
	RecoveryExcessS float64 `json:"recovery_excess_s"`
	// RecoveryExcessPairedS (kvc-bench --recovery-control) is the excess against the same request
	// without the kill: over the affected sessions, the recovery delay minus the TTFT of the same
	// (session, turn) request in the arm's control replay (no kill), at least 0; a session whose
	// request did not succeed there falls back to its usual TTFT (RecoveryPairedFallbacks counts
	// those). 0 without a control run (RecoveryControl false). The target still reads
	// RecoveryExcessS.
	RecoveryExcessPairedS   float64 `json:"recovery_excess_paired_s"`
	RecoveryPairedFallbacks int     `json:"recovery_paired_fallbacks"`
	RecoveryControl         bool    `json:"recovery_control"`
	// TTFTP99Continuing is the TTFT p99 over continuing turns (turn > 0), failures included:
	// the turns a direct-to-D decision can serve without P; first turns are prefilled alike in
	// every arm.
	TTFTP99Continuing float64 `json:"ttft_p99_continuing_s"`
	// SLOMet counts the requests that succeeded within the SLO (the numerator of goodput), and
	// SLOAttainment is SLOMet / Total (a failure is a miss): the sweep's SLO capacity is the
	// highest load at which it stays >= 0.9.
	SLOMet        int     `json:"slo_met"`
	SLOAttainment float64 `json:"slo_attainment"`
	// PrefillBusyS and DecodeBusyS are each worker's GPU-busy model seconds over the arm (kvc-sim's
	// kvc_sim_busy_seconds_total: time with at least one prefill, append-prefill or decode step
	// running), by worker id; a worker killed mid-run is missing (its count died with it).
	PrefillBusyS map[string]float64 `json:"prefill_busy_s"`
	DecodeBusyS  map[string]float64 `json:"decode_busy_s"`
	// LinkBytes are the real KV bytes (at kvc-sim's reduced bytes per token) that crossed each
	// node's link over the arm, by worker id (every worker is its own node): see NodeFigures.
	LinkBytes map[string]LinkBytes `json:"link_bytes"`
	// PrefillCacheHitRate is the prefill workers' prefix-cache hit rate over the arm: the prompt
	// tokens P's prefix cache served (PrefillCacheHitTokens, kvc-sim's
	// kvc_sim_prefill_cache_hit_tokens_total; tier pulls not counted) over the prompt tokens of
	// P's prefill passes (PrefillPromptTokens, kvc_sim_prefill_prompt_tokens_total), summed over
	// the prefill workers; 0 when P prefilled nothing.
	PrefillCacheHitRate   float64 `json:"prefill_cache_hit_rate"`
	PrefillCacheHitTokens int64   `json:"prefill_cache_hit_tokens"`
	PrefillPromptTokens   int64   `json:"prefill_prompt_tokens"`
	// WastedKVFallbacks is the control plane's kvc_router_wasted_kv_fallbacks_total at the arm's
	// end (summed over the control planes): plain PD_FALLBACKs of a session that had a usable
	// snapshot or a resident copy (issue 20's target: 0). Always 0 in the baselines (plain P/D by
	// policy, never a fallback).
	WastedKVFallbacks int64 `json:"wasted_kv_fallbacks"`
	// KilledWorker is the decode worker the arm's kill took ("" without a kill), and
	// KilledWorkerSessions and KilledWorkerResident what it held then (KillTarget).
	KilledWorker         string `json:"killed_worker"`
	KilledWorkerSessions int    `json:"killed_worker_sessions"`
	KilledWorkerResident int    `json:"killed_worker_resident"`
}

// KillTarget is the decode worker an arm's kill took and what it held at that moment.
type KillTarget struct {
	Worker string
	// Sessions whose latest routed request went to it (the client's view, the same rule in every
	// arm: bench.Holders); what --kill-decode most maximizes.
	Sessions int
	// Resident is its kvc-sim's kvc_sim_resident_sessions then (sessions in its KV pool, stale
	// copies included; -1: not read).
	Resident int
}

// SetKill records which decode worker the arm's kill took.
func (s *Summary) SetKill(k KillTarget) {
	s.KilledWorker, s.KilledWorkerSessions, s.KilledWorkerResident = k.Worker, k.Sessions, k.Resident
}

// LinkBytes are one node's link bytes in each direction.
type LinkBytes struct {
	In  int64 `json:"in"`
	Out int64 `json:"out"`
}

// NodeFigures are what the cluster's workers and sidecars report about one arm (not the
// requests): GPU-busy seconds as measured (divided by the time scale when set into a Summary)
// and link bytes, by worker id.
type NodeFigures struct {
	PrefillBusyS, DecodeBusyS map[string]float64
	LinkBytes                 map[string]LinkBytes
	// PrefillPromptTokens and PrefillCacheHitTokens are each prefill worker's prompt tokens and
	// those its prefix cache served.
	PrefillPromptTokens, PrefillCacheHitTokens map[string]int64
	// WastedKVFallbacks is the control planes' kvc_router_wasted_kv_fallbacks_total.
	WastedKVFallbacks int64
}

// SetNodes puts n into s, busy times divided by div (the run's time scale).
func (s *Summary) SetNodes(n NodeFigures, div float64) {
	if !(div > 0) {
		div = 1
	}
	scale := func(m map[string]float64) map[string]float64 {
		if m == nil {
			return nil
		}
		out := make(map[string]float64, len(m))
		for k, v := range m {
			out[k] = round(v / div)
		}
		return out
	}
	s.PrefillBusyS, s.DecodeBusyS, s.LinkBytes = scale(n.PrefillBusyS), scale(n.DecodeBusyS), n.LinkBytes
	s.PrefillPromptTokens, s.PrefillCacheHitTokens, s.PrefillCacheHitRate = 0, 0, 0
	s.WastedKVFallbacks = n.WastedKVFallbacks
	for _, v := range n.PrefillPromptTokens {
		s.PrefillPromptTokens += v
	}
	for _, v := range n.PrefillCacheHitTokens {
		s.PrefillCacheHitTokens += v
	}
	if s.PrefillPromptTokens > 0 {
		s.PrefillCacheHitRate = round(float64(s.PrefillCacheHitTokens) / float64(s.PrefillPromptTokens))
	}
}

// SLO is the service level of goodput (model seconds).
type SLO struct {
	TTFT, TPOT float64
}

// Kill says which decode worker was killed and when (seconds since the replay's start, as
// measured, not divided).
type Kill struct {
	Worker string
	AtS    float64
}

// Options add the figures that need more than the records.
type Options struct {
	SLO  SLO
	Kill *Kill
	// Control are the records of the same arm's replay without the kill (kvc-bench
	// --recovery-control; nil: none): recovery's paired excess compares against them.
	Control []Record
}

// ModeStats are per-mode figures.
type ModeStats struct {
	Count, OK            int
	TTFTP50, TTFTP99     float64
	MeanUncached         float64
	BytesMoved, Verified int64
	// Requests recomputed and compared by a kvc-refworker, and their mismatches.
	RecomputeChecked    int
	RecomputeMismatches int64
	MaxAbsLogitDiff     float64
	MaxAbsKVDiff        float64
}

// Arm is everything the report says about one arm.
type Arm struct {
	Name       string
	Summary    Summary
	Modes      map[string]*ModeStats
	Reasons    map[string]int
	ErrorKinds map[string]int
	FailOpen   int
	Retries    int
	// Resumed: requests the gateway finished on another decode worker after theirs died
	// mid-stream (ResumedFrom, OK).
	Resumed  int
	Verified int64
	TTFTs    []float64 // every request, a failure at the time it failed, sorted (for the CDF plot)
	// PrefillTokens is the work of the prefill worker (whole inputs of SEED, RESEED_PREFILL and
	// PD_FALLBACK); AppendTokens the uncached tokens decode workers append-prefilled.
	PrefillTokens, AppendTokens int64
	// PrefillLoadedTokens: of PrefillTokens, those P loaded from its store (prefill from the
	// snapshot) instead of computing them.
	PrefillLoadedTokens int64
	// LatencyP90 is reported in report.md only (summary.json has a fixed field set).
	LatencyP90 float64
	// RecomputeChecked and RecomputeMismatches total the modes' (kvc-refworker, report.md only).
	RecomputeChecked    int
	RecomputeMismatches int64
	// Edited-history turns (report.md only): how many, how they were decided (reason), the
	// requests whose decode worker rewrote the session it held, and verify failures on them.
	Edited               int
	EditedReasons        map[string]int
	Rewrites             int
	EditedVerifyFailures int64
	// New sessions placed on content (report.md only): seeds placed on the decode worker with
	// the largest overlap (PREFIX_OVERLAP), first turns prefilled on it (LOCAL_FIRST_TURN), and
	// the prefill tokens those reused from its prefix cache.
	OverlapSeeds, LocalFirstTurns int
	PrefixCachedTokens            int64
	// Large appends by where they were prefilled (report.md only): on the session's own decode
	// worker (LOCAL_LARGE_APPEND) or on P (REAL_LARGE_APPEND), each with its sorted TTFTs
	// (model seconds, failures at the time they failed).
	LocalAppendTTFTs, PAppendTTFTs []float64
}

// Percentile is the nearest-rank percentile (q in [0,1]) of sorted values; 0 when empty.
func Percentile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	i = min(max(i, 0), len(sorted)-1)
	return sorted[i]
}

func round(x float64) float64 { return math.Round(x*1e6) / 1e6 }

// Compute builds an arm's statistics from its records. TTFT and latency percentiles are over
// every request: a failure enters them at the time it failed (its latency; failedTTFT), so an arm
// cannot look faster by failing more. Failures are also counted in ok/total and by kind. Times
// are divided by div (the run's time scale, to report model seconds; 1 = as measured).
func Compute(name string, recs []Record, div float64) *Arm {
	return ComputeWith(name, recs, div, Options{})
}

// ComputeWith is Compute with goodput at opt.SLO and recovery after opt.Kill.
func ComputeWith(name string, recs []Record, div float64, opt Options) *Arm {
	if !(div > 0) {
		div = 1
	}
	a := &Arm{Name: name, Modes: map[string]*ModeStats{}, Reasons: map[string]int{}, ErrorKinds: map[string]int{}, EditedReasons: map[string]int{}}
	var lat, reseedTTFT, contTTFT []float64
	var snap, reseed int
	uncached := map[string]int64{}
	modeTTFT := map[string][]float64{}
	for i := range recs {
		r := &recs[i]
		a.Summary.Total++
		mode := r.Mode
		if mode == "" {
			mode = "NONE"
		}
		ms := a.Modes[mode]
		if ms == nil {
			ms = &ModeStats{}
			a.Modes[mode] = ms
		}
		ms.Count++
		ms.BytesMoved += r.ReceivedBytes
		ms.Verified += r.VerifiedBytes
		if r.RecomputeChecked {
			ms.RecomputeChecked++
			ms.RecomputeMismatches += r.RecomputeMismatches
			ms.MaxAbsLogitDiff = max(ms.MaxAbsLogitDiff, r.MaxAbsLogitDiff)
			ms.MaxAbsKVDiff = max(ms.MaxAbsKVDiff, r.MaxAbsKVDiff)
			a.RecomputeChecked++
			a.RecomputeMismatches += r.RecomputeMismatches
		}
		uncached[mode] += r.UncachedTokens
		if r.Reason != "" {
			a.Reasons[r.Reason]++
		}
		if r.Edit != "" {
			a.Edited++
			a.EditedReasons[r.Reason]++
			a.EditedVerifyFailures += r.VerifyFailures
		}
		if r.TruncatedTo > 0 {
			a.Rewrites++
		}
		switch r.Reason {
		case "PREFIX_OVERLAP":
			a.OverlapSeeds++
		case "LOCAL_FIRST_TURN":
			a.LocalFirstTurns++
		}
		a.PrefixCachedTokens += r.PrefixCachedTokens
		if r.FailOpen {
			a.FailOpen++
		}
		a.Retries += r.Retries
		if r.ResumedFrom != "" && r.OK {
			a.Resumed++
		}
		a.Summary.BytesMoved += r.ReceivedBytes
		a.Verified += r.VerifiedBytes
		a.Summary.KVVerifyFailures += r.VerifyFailures
		if r.ErrorCode == "kv_verify_failed" {
			a.Summary.KVVerifyFailures++
		}
		if r.Reseed() {
			reseed++
			if r.SnapshotUsed {
				snap++
			}
		}
		switch r.Mode {
		case "DIRECT_TO_D":
			a.Summary.DirectToDShare++
			a.AppendTokens += r.UncachedTokens
		case "RESEED_SNAPSHOT":
			a.AppendTokens += r.UncachedTokens
		case "SEED", "RESEED_PREFILL", "PD_FALLBACK":
			a.PrefillTokens += r.InputTokens
			a.PrefillLoadedTokens += min(r.PrefillLoadedTokens, r.InputTokens)
		}
		if !r.OK {
			kind := r.ErrorKind
			if kind == "" {
				kind = "UNKNOWN"
			}
			a.ErrorKinds[kind]++
		} else {
			a.Summary.OK++
			ms.OK++
		}
		ttft := failedTTFT(r) / div
		a.TTFTs = append(a.TTFTs, ttft)
		lat = append(lat, r.LatencyS/div)
		modeTTFT[mode] = append(modeTTFT[mode], ttft)
		if r.Reseed() {
			reseedTTFT = append(reseedTTFT, ttft)
		}
		switch r.Reason {
		case "LOCAL_LARGE_APPEND":
			a.LocalAppendTTFTs = append(a.LocalAppendTTFTs, ttft)
		case "REAL_LARGE_APPEND":
			a.PAppendTTFTs = append(a.PAppendTTFTs, ttft)
		}
		if r.Turn > 0 {
			contTTFT = append(contTTFT, ttft)
		}
	}
	sort.Float64s(a.TTFTs)
	sort.Float64s(a.LocalAppendTTFTs)
	sort.Float64s(a.PAppendTTFTs)
	sort.Float64s(lat)
	sort.Float64s(reseedTTFT)
	sort.Float64s(contTTFT)
	s := &a.Summary
	s.TTFTP99Continuing = round(Percentile(contTTFT, .99))
	s.TTFTP50, s.TTFTP90, s.TTFTP99 = round(Percentile(a.TTFTs, .5)), round(Percentile(a.TTFTs, .9)), round(Percentile(a.TTFTs, .99))
	s.LatencyP50, s.LatencyP99 = round(Percentile(lat, .5)), round(Percentile(lat, .99))
	a.LatencyP90 = round(Percentile(lat, .9))
	if s.Total > 0 {
		s.DirectToDShare = round(s.DirectToDShare / float64(s.Total))
	}
	s.ReseedCount = reseed
	s.ReseedTTFTP50 = round(Percentile(reseedTTFT, .5))
	if reseed > 0 {
		s.SnapshotHitRate = round(float64(snap) / float64(reseed))
	}
	var cont, contDirect int
	for i := range recs {
		r := &recs[i]
		if r.Turn > 0 {
			cont++
			if r.Mode == "DIRECT_TO_D" {
				contDirect++
			}
		}
		if r.Reason == "SNAPSHOT_STALE" {
			s.SnapshotStale++
		}
	}
	if cont > 0 {
		s.DirectToDShareContinuing = round(float64(contDirect) / float64(cont))
	}
	var good float64
	good, s.SLOMet = goodput(recs, div, opt.SLO)
	s.GoodputRPS = round(good)
	if s.Total > 0 {
		s.SLOAttainment = round(float64(s.SLOMet) / float64(s.Total))
	}
	if opt.Kill != nil {
		recovery(recs, div, *opt.Kill, opt.Control, s)
	}
	for m, v := range modeTTFT {
		sort.Float64s(v)
		a.Modes[m].TTFTP50, a.Modes[m].TTFTP99 = Percentile(v, .5), Percentile(v, .99)
	}
	for m, ms := range a.Modes {
		ms.MeanUncached = float64(uncached[m]) / float64(ms.Count)
	}
	return a
}

// failedTTFT is the TTFT a request enters the percentiles with: its first token's for a success,
// the time it failed (its latency) for a failure, even one that streamed tokens before it broke.
func failedTTFT(r *Record) float64 {
	if r.OK {
		return r.TTFTS
	}
	return r.LatencyS
}

// goodput is the successful requests within slo per model second of the replay's span (first
// start to last end), and their count; with a zero SLO every successful request counts. A failed
// request is a miss.
func goodput(recs []Record, div float64, slo SLO) (float64, int) {
	first, last := math.Inf(1), math.Inf(-1)
	n := 0
	for i := range recs {
		r := &recs[i]
		first = min(first, r.StartS)
		last = max(last, r.StartS+r.LatencyS)
		if !r.OK {
			continue
		}
		ttft := r.TTFTS / div
		tpot := 0.0
		if r.GotTokens > 1 {
			tpot = (r.LatencyS - r.TTFTS) / div / float64(r.GotTokens-1)
		}
		if (slo.TTFT > 0 && ttft > slo.TTFT) || (slo.TPOT > 0 && tpot > slo.TPOT) {
			continue
		}
		n++
	}
	span := (last - first) / div
	if n == 0 || !(span > 0) {
		return 0, n
	}
	return float64(n) / span, n
}

// recovery fills s's recovery figures (docs/benchmark.md, "Goodput and recovery"), the same way
// in every arm whatever the arm keeps where.
//
// A session is affected when the death touched it: the last request it started before the kill
// ran on the killed worker (its KV, its host tier or the request itself was there), or a request
// of it was tried there and retried elsewhere by the gateway (RetriedFrom): in flight at the kill
// or routed there after it. Its recovery delay runs from the arrival of the first request the
// death touched — the one in flight at the kill when the gateway's retry rescued it, else the
// session's first request after the kill — to the first token of its first successful request
// from there on. Its excess is that delay minus the session's usual TTFT (the median of its
// successful continuing turns that ended before the kill; the arm's median of those when it has
// none), at least 0: what the death cost it beyond an ordinary turn.
//
// With control (the same arm's replay without the kill; nil: none) the paired excess subtracts
// instead the TTFT of the same (session, turn) request as the first successful one in control,
// when it succeeded there (else the usual TTFT, counted in RecoveryPairedFallbacks): a turn that
// is expensive with or without the death costs the death nothing.
func recovery(recs []Record, div float64, k Kill, control []Record, s *Summary) {
	type key struct {
		session string
		turn    int
	}
	ctrl := map[key]float64{}
	for i := range control {
		if r := &control[i]; r.OK {
			ctrl[key{r.SessionID, r.Turn}] = r.TTFTS
		}
	}
	type sess struct {
		lastBefore *Record
		after      []*Record
		usual      []float64
	}
	touched := func(r *Record) bool { return r.DecodeWorker == k.Worker || slices.Contains(r.RetriedFrom, k.Worker) }
	by := map[string]*sess{}
	var usualAll []float64
	for i := range recs {
		r := &recs[i]
		x := by[r.SessionID]
		if x == nil {
			x = &sess{}
			by[r.SessionID] = x
		}
		if r.StartS < k.AtS {
			if x.lastBefore == nil || r.Turn > x.lastBefore.Turn {
				x.lastBefore = r
			}
			if r.OK && r.Turn > 0 && r.StartS+r.LatencyS <= k.AtS {
				x.usual = append(x.usual, r.TTFTS)
				usualAll = append(usualAll, r.TTFTS)
			}
		} else {
			x.after = append(x.after, r)
		}
	}
	sort.Float64s(usualAll)
	armUsual := Percentile(usualAll, .5)
	var worst, excess, paired float64
	var ttfts []float64
	for _, x := range by {
		sort.Slice(x.after, func(i, j int) bool { return x.after[i].Turn < x.after[j].Turn })
		b := x.lastBefore
		var from []*Record // the first request the death touched, then the session's later ones
		switch {
		case b != nil && b.OK && b.StartS+b.TTFTS > k.AtS && slices.Contains(b.RetriedFrom, k.Worker):
			from = []*Record{b} // in flight at the kill, served by the gateway's retry elsewhere
		case b != nil && (b.DecodeWorker == k.Worker || (slices.Contains(b.RetriedFrom, k.Worker) && b.StartS+b.LatencyS > k.AtS)):
			from = x.after // its state or its request was there: served again by its next one
		default:
			for i, r := range x.after {
				if touched(r) {
					from = x.after[i:]
					break
				}
			}
		}
		if len(from) == 0 {
			continue // untouched, or no request after the kill to be served again
		}
		s.AffectedSessions++
		var ok *Record
		for _, r := range from {
			if r.OK {
				ok = r
				break
			}
		}
		if ok == nil {
			s.Unrecovered++
			continue
		}
		d := (ok.StartS + ok.TTFTS - from[0].StartS) / div
		usual := armUsual
		if len(x.usual) > 0 {
			sort.Float64s(x.usual)
			usual = Percentile(x.usual, .5)
		}
		worst = max(worst, d)
		excess = max(excess, d-usual/div)
		if control != nil {
			base, ok2 := ctrl[key{ok.SessionID, ok.Turn}]
			if !ok2 {
				base = usual
				s.RecoveryPairedFallbacks++
			}
			paired = max(paired, d-base/div)
		}
		ttfts = append(ttfts, ok.TTFTS/div)
	}
	sort.Float64s(ttfts)
	s.RecoveryS = round(worst)
	s.RecoveryExcessS = round(excess)
	s.RecoveryControl = control != nil
	s.RecoveryExcessPairedS = round(paired)
	s.RecoveryTTFTP50 = round(Percentile(ttfts, .5))
}
