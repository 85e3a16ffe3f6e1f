package report

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/kvcentric/kvcentric/sim/internal/plot"
	"github.com/kvcentric/kvcentric/sim/internal/workload"
)

// Meta describes the run for the report's header.
type Meta struct {
	Command   string
	Target    string // "local cluster: 1 P + 3 D, 2 control planes" or the gateway URL
	Workload  string
	Stats     workload.Stats
	Notes     []string
	TimeScale float64 // workload clock
	// TimeDiv divides every measured time in the report (the common time scale of workload and
	// kvc-sim, so times read as model seconds); 1 = as measured.
	TimeDiv float64
	// Local cluster only.
	SimTimeScale         float64
	DecodeCapacityTokens int64
	SimArgs              []string
	ArmPolicies          map[string]string
	Started              time.Time
	ArmWall              map[string]time.Duration
	Aborted              string // why the run stopped early, if it did
	// SLO of goodput_rps (model seconds; zero: every successful request counts).
	SLO SLO
	// Kill: the decode worker killed mid-run (nil: none); ArmKills the kill time per arm.
	// KillWorker is what --kill-decode named (a worker or "most"), ArmKillTargets the worker each
	// arm's kill took and what it held, KillWorkerOnly whether the sidecar lived.
	KillWorker     string
	ArmKills       map[string]float64
	ArmKillTargets map[string]KillTarget
	KillWorkerOnly bool
	// ArmSimArgs are each arm's per-role kvc-sim flags (the baseline models).
	ArmSimArgs map[string]string
	// ArmGatewayArgs are each arm's extra gateway flags (the baselines': no mid-stream resume).
	ArmGatewayArgs map[string]string
	// ArmPushBytes are the D→P snapshot bytes the decode sidecars pushed per arm (real bytes,
	// at kvc-sim's reduced bytes per token).
	ArmPushBytes map[string]int64
	// Shape names the cluster shape ("1P3D", "2P4D", ...; "" when the run has one unnamed
	// shape), and Targets are the targets stated for it (zero: DefaultTargets).
	Shape   string
	Targets Targets
}

// Targets are the figures E4 is held to against the best baseline on one shape.
type Targets struct {
	// GoodputRatio: E4's goodput at the SLO ≥ this × the best baseline's.
	GoodputRatio float64
	// Why says where the ratio comes from (report.md).
	Why string
}

// DefaultTargets are issue 14's: 1.2 × the best baseline's goodput.
var DefaultTargets = Targets{GoodputRatio: 1.2, Why: "issue 14"}

// Files written by Write.
const (
	SummaryFile = "summary.json"
	ReportFile  = "report.md"
	CDFFile     = "ttft_cdf.png"
	ModesFile   = "mode_shares.png"
)

// Write writes summary.json, report.md and the two PNGs into dir.
func Write(dir string, meta Meta, arms []*Arm) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	sum := map[string]Summary{}
	for _, a := range arms {
		sum[a.Name] = a.Summary
	}
	b, err := json.MarshalIndent(sum, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, SummaryFile), append(b, '\n'), 0o644); err != nil {
		return err
	}
	var series []plot.Series
	var bars []plot.Bar
	for _, a := range arms {
		series = append(series, plot.Series{Name: a.Name + " " + armTitle(a.Name), Values: a.TTFTs})
		counts := map[string]int{}
		for m, ms := range a.Modes {
			counts[m] += ms.OK
			counts["FAILED"] += ms.Count - ms.OK
		}
		bars = append(bars, plot.Bar{Name: a.Name, Counts: counts})
	}
	var buf bytes.Buffer
	if err := plot.TTFTCDF(&buf, "Time to first token per arm (failures at the time they failed)", series); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, CDFFile), buf.Bytes(), 0o644); err != nil {
		return err
	}
	buf.Reset()
	if err := plot.ModeShares(&buf, "Execution mode of every request, per arm", bars); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, ModesFile), buf.Bytes(), 0o644); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, ReportFile), []byte(Markdown(meta, arms)), 0o644)
}

func armTitle(name string) string {
	switch name {
	case "E1":
		return "plain P/D, no prefix cache (lower bound)"
	case "PD":
		return "P/D + prefill prefix cache"
	case "SGL":
		return "SGLang: decode radix + decode offload to L3 + HiCache restore"
	case "LLMD":
		return "llm-d: P/D + P2P pull from the decode host's CPU tier"
	case "E3":
		return "KV-centric, no snapshots"
	case "E4":
		return "KV-centric + D→P snapshots"
	}
	return ""
}

func ms(s float64) string {
	if s >= 1 {
		return fmt.Sprintf("%.2f s", s)
	}
	return fmt.Sprintf("%.0f ms", s*1000)
}

// p50Max is "p50 / max" of sorted model seconds, or "–" when there are none.
func p50Max(sorted []float64) string {
	if len(sorted) == 0 {
		return "–"
	}
	return ms(Percentile(sorted, 0.5)) + " / " + ms(sorted[len(sorted)-1])
}

func pct(x float64) string { return fmt.Sprintf("%.1f%%", x*100) }

func mib(b int64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

// Markdown renders the report.
func Markdown(meta Meta, arms []*Arm) string {
	var w strings.Builder
	p := func(format string, a ...any) { fmt.Fprintf(&w, format+"\n", a...) }
	if meta.Shape != "" {
		p("# kvc-bench report: %s", meta.Shape)
	} else {
		p("# kvc-bench report")
	}
	p("")
	p("Generated %s by `%s`.", meta.Started.UTC().Format(time.RFC3339), meta.Command)
	p("")
	if meta.Aborted != "" {
		p("> **The run stopped early:** %s. The numbers below cover what finished.", meta.Aborted)
		p("")
	}
	p("- Target: %s", meta.Target)
	st := meta.Stats
	p("- Workload: %s — %d sessions (%d multi-turn, up to %d turns), %d requests; mean input %.0f tokens (max %.0f), mean append %.0f tokens (median %.0f), mean output %.0f tokens",
		meta.Workload, st.Sessions, st.MultiTurnSessions, st.MaxTurns, st.Requests, st.MeanInput, st.MaxInput, st.MeanAppend, st.MedianAppend, st.MeanOutput)
	for _, n := range meta.Notes {
		p("  - %s", n)
	}
	p("- Workload clock scale (arrivals, think times): %g", meta.TimeScale)
	if meta.TimeDiv > 0 && meta.TimeDiv != 1 {
		p("- **Times in this report are model seconds:** the whole system ran at time scale %g (workload clock and every modeled GPU/transfer duration), so each measured wall time is divided by %g. Raw measured seconds are in metrics.jsonl. Real software overheads (HTTP, gRPC, real byte movement on loopback) are inflated by the same 1/%g in this view, which makes the fast paths look slower than they would at real speed, never faster.", meta.TimeDiv, meta.TimeDiv, meta.TimeDiv)
	}
	if meta.DecodeCapacityTokens > 0 || len(meta.SimArgs) > 0 {
		p("- Simulated workers: decode KV capacity %d tokens each; kvc-sim modeled-time scale %g; extra kvc-sim flags `%s`",
			meta.DecodeCapacityTokens, meta.SimTimeScale, strings.Join(meta.SimArgs, " "))
	}
	for _, a := range arms {
		if pol := meta.ArmPolicies[a.Name]; pol != "" {
			p("- %s (%s): policy `%s`; wall time %s", a.Name, armTitle(a.Name), pol, meta.ArmWall[a.Name].Round(time.Second))
		}
		if sa := meta.ArmSimArgs[a.Name]; sa != "" {
			p("  - %s's kvc-sim baseline flags: %s", a.Name, sa)
		}
		if ga := meta.ArmGatewayArgs[a.Name]; ga != "" {
			p("  - %s's gateway flags: `%s`", a.Name, ga)
		}
	}
	p("")
	p("## What is modeled and what is real")
	p("")
	p("- **Modeled (timing):** every duration a GPU would spend — prefill, append-prefill, decode steps and the KV transfer time over the configured link — comes from kvc-sim's timing model (docs/simulator.md), calibrated to the seeds' H100/H200 measurements of Qwen3-30B-A3B%s. TTFT and latency below are wall-clock times measured by this client around real HTTP requests through the real gateway, control plane and sidecars, so they include the real software overheads on top of the modeled GPU time.", scaleNote(meta.SimTimeScale))
	p("- **Real:** routing decisions (control plane over gRPC), residency, evictions and capacity rejections in the simulated workers, and every KV byte: transfers move real bytes through the sidecars' transfer engines (tcp backend on loopback) into shared-memory KV pools, and the receiver checks each token against the known-bytes pattern. *Bytes moved* and *verify failures* are those real counts (at a reduced bytes-per-token, see the kvc-sim flags above), as reported by the decode worker in `meta_info.kvc`. Background D→P snapshot pushes are not included in the per-request bytes.")
	p("")
	p("## Summary")
	p("")
	p("| arm | ok / total | TTFT p50 | TTFT p90 | TTFT p99 | TTFT p99, continuing turns | latency p50 | latency p90 | latency p99 | within SLO | direct-to-D | reseeds | reseed TTFT p50 | snapshot hit rate | bytes moved | KV verify failures |")
	p("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, a := range arms {
		s := a.Summary
		p("| %s %s | %d / %d | %s | %s | %s | %s | %s | %s | %s | %d / %d (%s) | %s | %d | %s | %s | %s | %d |", a.Name, armTitle(a.Name), s.OK, s.Total,
			ms(s.TTFTP50), ms(s.TTFTP90), ms(s.TTFTP99), ms(s.TTFTP99Continuing), ms(s.LatencyP50), ms(a.LatencyP90), ms(s.LatencyP99),
			s.SLOMet, s.Total, pct(s.SLOAttainment), pct(s.DirectToDShare), s.ReseedCount,
			ms(s.ReseedTTFTP50), pct(s.SnapshotHitRate), mib(s.BytesMoved), s.KVVerifyFailures)
	}
	p("")
	p("Every TTFT and latency percentile counts every request: a failed one enters at the time it failed (its latency), so an arm cannot look faster by failing more (a fast refusal enters low: read ok / total and *within SLO* beside it). *Within SLO* counts the successful requests that met the SLO (TTFT and time per output token) out of all; failures are misses. Continuing turns are turns > 0 (a first turn is prefilled on P in every arm).")
	p("")
	p("## Goodput, continuing turns, snapshots, recovery")
	p("")
	if meta.SLO.TTFT > 0 || meta.SLO.TPOT > 0 {
		p("Goodput: successful requests per model second with TTFT ≤ %s and time per output token ≤ %s, over the replay's span.", ms(meta.SLO.TTFT), ms(meta.SLO.TPOT))
	} else {
		p("Goodput: successful requests per model second (no SLO given).")
	}
	if meta.KillWorker != "" {
		what := "kvc-sim and its sidecar: a node lost"
		if meta.KillWorkerOnly {
			what = "its kvc-sim only: the engine crashed, its sidecar lived and reported it down"
		}
		who := meta.KillWorker
		if who == "most" {
			who = "the decode worker holding the most sessions at that moment (the sessions whose latest routed request went there; worker per arm below)"
		}
		p("Recovery: %s (%s) was SIGKILLed mid-run (time per arm below). Affected sessions: those whose last request before the kill ran there, or that had a request tried there and retried elsewhere by the gateway (in flight at the kill or routed there after it). Recovery is the longest time from the arrival of an affected session's first touched request (the one in flight when the gateway's retry rescued it, else its next one) to the first token of its first successful request; the excess subtracts the session's usual TTFT (median of its continuing turns before the kill): what the death cost beyond an ordinary turn, 0 when no session was affected. The target compares the excess. Wasted-KV fallbacks: the control plane's `kvc_router_wasted_kv_fallbacks_total` at the arm's end (plain P/D fallbacks of a session that had a usable snapshot or resident copy; target 0).", who, what)
	}
	paired := false
	for _, a := range arms {
		paired = paired || a.Summary.RecoveryControl
	}
	if paired {
		p("")
		p("Paired excess (--recovery-control): each arm first replayed the same trace without the kill on a fresh cluster; per affected session, the recovery delay minus the TTFT of the same (session, turn) request in that control run (its usual TTFT when that request did not succeed there: the fallbacks), at least 0, the longest over the sessions. It does not charge the death with a turn that is as expensive without it; the target still reads the recovery excess.")
	}
	p("")
	pairedHead, pairedSep := "", ""
	if paired {
		pairedHead, pairedSep = " paired excess (fallbacks) |", "---:|"
	}
	p("| arm | goodput (req/s) | direct-to-D share, continuing turns | snapshot hit rate | stale snapshots | wasted-KV fallbacks | snapshot bytes pushed (D→P link) | killed at | killed worker (sessions held / resident) | affected sessions | recovery | recovery excess |%s their next TTFT p50 | unrecovered |", pairedHead)
	p("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|%s---:|---:|", pairedSep)
	for _, a := range arms {
		s := a.Summary
		kill, victim := "—", "—"
		if at, ok := meta.ArmKills[a.Name]; ok {
			kill = ms(at / max(meta.TimeDiv, 1e-9))
		}
		if s.KilledWorker != "" {
			res := "?"
			if s.KilledWorkerResident >= 0 {
				res = fmt.Sprint(s.KilledWorkerResident)
			}
			victim = fmt.Sprintf("%s (%d / %s)", s.KilledWorker, s.KilledWorkerSessions, res)
		}
		pairedCell := ""
		if paired {
			pairedCell = " — |"
			if s.RecoveryControl {
				pairedCell = fmt.Sprintf(" %s (%d) |", ms(s.RecoveryExcessPairedS), s.RecoveryPairedFallbacks)
			}
		}
		p("| %s | %.3f | %s | %s | %d | %d | %s | %s | %s | %d | %s | %s |%s %s | %d |", a.Name, s.GoodputRPS, pct(s.DirectToDShareContinuing), pct(s.SnapshotHitRate), s.SnapshotStale,
			s.WastedKVFallbacks, mib(meta.ArmPushBytes[a.Name]), kill, victim, s.AffectedSessions, ms(s.RecoveryS), ms(s.RecoveryExcessS), pairedCell, ms(s.RecoveryTTFTP50), s.Unrecovered)
	}
	p("")
	p("![TTFT CDF per arm](%s)", CDFFile)
	p("")
	p("![Execution mode shares per arm](%s)", ModesFile)
	p("")
	p("## Workers: GPU busy time, link bytes, P's prefix cache")
	p("")
	p("GPU busy: model seconds with at least one prefill, append-prefill or decode step running on the worker (kvc-sim's `kvc_sim_busy_seconds_total`, read at the arm's end; a worker killed mid-run is missing). Link bytes: real KV bytes (at kvc-sim's reduced bytes per token) in / out of each worker's node: P→D transfers (seeds, plain P/D and fallbacks), store reseeds (P's store → D), D→P snapshot pushes, and the baselines' tier pulls into P (SGL's L3 prefetch, LLMD's pull from a decode host) counted at P; the source side of a tier pull, SGL's decode-side L3 restore and the decode offload writes are not counted. P cache hit rate: the prompt tokens the prefill workers' prefix cache served over the prompt tokens of their prefill passes (kvc-sim's `kvc_sim_prefill_cache_hit_tokens_total` / `kvc_sim_prefill_prompt_tokens_total`; tier pulls are not hits, and a prefix E4 loads from P's store is neither a hit nor a prompt token: the Work table counts it); E3 and E4 send the decision's prefill priority as SGLang's request `priority` and run P with `--radix-eviction-policy priority`, the baselines LRU.")
	p("")
	p("| arm | prefill busy (per worker) | decode busy (per worker) | link bytes in / out (per worker) | P cache hit rate (hit / prompt tokens) |")
	p("|---|---|---|---|---|")
	for _, a := range arms {
		s := a.Summary
		p("| %s | %s | %s | %s | %s |", a.Name, busyList(s.PrefillBusyS), busyList(s.DecodeBusyS), linkList(s.LinkBytes), hitRate(s))
	}
	p("")
	if checks := baselineChecksWith(arms, meta.KillWorker != "", meta.Targets); len(checks) > 0 {
		tg := meta.Targets
		if tg.GoodputRatio == 0 {
			tg = DefaultTargets
		}
		if meta.Shape != "" {
			p("## Targets against the baselines on %s", meta.Shape)
		} else {
			p("## Targets against the baselines (issue 14)")
		}
		p("")
		p("Best baseline = the best of PD, SGL and LLMD on each figure separately. Goodput target on this shape: %.2g × the best baseline's (%s).", tg.GoodputRatio, tg.Why)
		p("")
		p("| target | measured | result |")
		p("|---|---|---|")
		for _, c := range checks {
			p("| %s | %s | %s |", c[0], c[1], c[2])
		}
		p("")
	}
	if checks := targetChecks(arms); len(checks) > 0 {
		p("## Demo targets")
		p("")
		p("| target | measured | result |")
		p("|---|---|---|")
		for _, c := range checks {
			p("| %s | %s | %s |", c[0], c[1], c[2])
		}
		p("")
	}
	p("## Execution modes")
	p("")
	p("| arm | mode | requests | share | ok | TTFT p50 | TTFT p99 | mean uncached tokens | bytes moved (real) | bytes verified |")
	p("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
	for _, a := range arms {
		for _, m := range sortedKeys(a.Modes) {
			x := a.Modes[m]
			p("| %s | %s | %d | %s | %d | %s | %s | %.0f | %s | %s |", a.Name, m, x.Count, pct(float64(x.Count)/float64(max(a.Summary.Total, 1))), x.OK,
				ms(x.TTFTP50), ms(x.TTFTP99), x.MeanUncached, mib(x.BytesMoved), mib(x.Verified))
		}
	}
	p("")
	if checked := recomputeChecked(arms); checked > 0 {
		p("## Exactness against recompute (kvc-refworker)")
		p("")
		p("Each decode worker recomputed every request from scratch and compared it with what it served (greedy tokens, logits, KV; bitwise where the arithmetic is the same, allclose otherwise: integrations/refworker/README.md).")
		p("")
		p("| arm | mode | requests checked | mismatches | max abs logit diff | max abs KV diff |")
		p("|---|---|---:|---:|---:|---:|")
		for _, a := range arms {
			for _, m := range sortedKeys(a.Modes) {
				if x := a.Modes[m]; x.RecomputeChecked > 0 {
					p("| %s | %s | %d | %d | %.3g | %.3g |", a.Name, m, x.RecomputeChecked, x.RecomputeMismatches, x.MaxAbsLogitDiff, x.MaxAbsKVDiff)
				}
			}
			p("| %s | **all** | %d | **%d** | | |", a.Name, a.RecomputeChecked, a.RecomputeMismatches)
		}
		p("")
	}
	p("## Reasons (every decision carries one)")
	p("")
	p("| arm | reason | requests |")
	p("|---|---|---:|")
	for _, a := range arms {
		for _, r := range sortedCounts(a.Reasons) {
			p("| %s | %s | %d |", a.Name, r, a.Reasons[r])
		}
	}
	p("")
	edited := false
	for _, a := range arms {
		edited = edited || a.Edited > 0 || a.Rewrites > 0
	}
	if edited {
		p("## Edited history (content-checked continuity)")
		p("")
		p("| arm | edited-history turns | decided as (reason) | sessions rewritten on D (truncated_to) | verify failures on edited turns |")
		p("|---|---:|---|---:|---:|")
		for _, a := range arms {
			var rs []string
			for _, r := range sortedCounts(a.EditedReasons) {
				rs = append(rs, fmt.Sprintf("%s %d", r, a.EditedReasons[r]))
			}
			p("| %s | %d | %s | %d | %d |", a.Name, a.Edited, strings.Join(rs, ", "), a.Rewrites, a.EditedVerifyFailures)
		}
		p("")
		p("An edited turn's prompt is not its resident KV plus an append: the control plane reuses KV only up to the common prefix of page hashes (PREFIX_TRUNCATED: cut on D; PREFIX_MISMATCH: reseed), and the decode worker cuts a divergence inside its partial last page itself (counted in the rewrites).")
		p("")
	}
	placed := false
	for _, a := range arms {
		placed = placed || a.OverlapSeeds > 0 || a.LocalFirstTurns > 0
	}
	if placed {
		p("## New sessions placed on content")
		p("")
		p("| arm | seeds placed on the largest overlap (PREFIX_OVERLAP) | first turns prefilled on D (LOCAL_FIRST_TURN) | prefill tokens saved (reused from D's prefix cache) |")
		p("|---|---:|---:|---:|")
		for _, a := range arms {
			p("| %s | %d | %d | %d |", a.Name, a.OverlapSeeds, a.LocalFirstTurns, a.PrefixCachedTokens)
		}
		p("")
		p("A seed placed on the overlap prefills on P what P's prefix cache (if the arm has one) does not hold: its saving is the later local turns and shared pages on D, not counted here. A local first turn prefills on D only what D does not already hold for another session. In SGL the last column counts the tokens its decode radix or L3 restore held (not received over the link).")
		p("")
	}
	appends := false
	for _, a := range arms {
		appends = appends || len(a.LocalAppendTTFTs) > 0 || len(a.PAppendTTFTs) > 0
	}
	if appends {
		p("## Large appends")
		p("")
		p("| arm | prefilled on the session's D (LOCAL_LARGE_APPEND) | TTFT p50 / max | prefilled on P (REAL_LARGE_APPEND) | TTFT p50 / max |")
		p("|---|---:|---:|---:|---:|")
		for _, a := range arms {
			p("| %s | %d | %s | %d | %s |", a.Name, len(a.LocalAppendTTFTs), p50Max(a.LocalAppendTTFTs), len(a.PAppendTTFTs), p50Max(a.PAppendTTFTs))
		}
		p("")
		p("A large append is a resident session's append over `direct_max_uncached_tokens`. Its own decode worker prefills it when its decode batch can take the prefill's stall within the TPOT SLO (docs/routing.md, \"Large appends\"); otherwise P does, from its store's snapshot where it holds one. The baselines' large appends are plain P/D requests like every other turn.")
		p("")
	}
	p("## Work")
	p("")
	p("| arm | tokens prefilled on P (whole inputs) | of them loaded from P's store | tokens append-prefilled on D | real KV bytes moved | real KV bytes verified |")
	p("|---|---:|---:|---:|---:|---:|")
	for _, a := range arms {
		p("| %s | %d | %d | %d | %s | %s |", a.Name, a.PrefillTokens, a.PrefillLoadedTokens, a.AppendTokens, mib(a.Summary.BytesMoved), mib(a.Verified))
	}
	p("")
	p("The second column is the prefill from the snapshot (E4; `prefill_loaded_tokens` per request): P loaded that much of the session's snapshot from its store and computed only the rest, so P computed at most the first column less the second (`uncached_tokens` per request). The first column counts whole inputs of the requests P served; in every arm but E1 kvc-sim's prefill worker has a prefix (radix) cache and computes only what it does not hold (and, in SGL/LLMD, what it could not pull from a tier): see docs/simulator.md, *Baseline models*. E1 (no prefix cache) is a pessimistic lower bound. The real bytes of every P→D transfer are the whole context in all arms (the sidecars have no suffix-only transfer); SGL's modeled transfer time counts only the suffix.")
	p("")
	p("## Failures and fallbacks")
	p("")
	p("| arm | failed | error kinds | fail-open requests | retries after 409 | resumed mid-stream |")
	p("|---|---:|---|---:|---:|---:|")
	for _, a := range arms {
		var kinds []string
		for _, k := range sortedCounts(a.ErrorKinds) {
			kinds = append(kinds, fmt.Sprintf("%s %d", k, a.ErrorKinds[k]))
		}
		if len(kinds) == 0 {
			kinds = []string{"none"}
		}
		p("| %s | %d | %s | %d | %d | %d |", a.Name, a.Summary.Total-a.Summary.OK, strings.Join(kinds, ", "), a.FailOpen, a.Retries, a.Resumed)
	}
	p("")
	p("Per-request records (mode, reason, TTFT, latency, uncached tokens, snapshot used, bytes, error kind) are in `metrics.jsonl`.")
	return w.String()
}

func recomputeChecked(arms []*Arm) int {
	n := 0
	for _, a := range arms {
		n += a.RecomputeChecked
	}
	return n
}

func scaleNote(s float64) string {
	if s == 0 || s == 1 {
		return " (run at real speed: time scale 1)"
	}
	return fmt.Sprintf(" and multiplied by kvc-sim's time scale %g (so real-speed figures are about 1/%g of the measured ones, overheads aside)", s, s)
}

func sortedKeys[V any](m map[string]V) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

func sortedCounts(m map[string]int) []string {
	ks := sortedKeys(m)
	sort.SliceStable(ks, func(i, j int) bool { return m[ks[i]] > m[ks[j]] })
	return ks
}

func busyList(m map[string]float64) string {
	if len(m) == 0 {
		return "—"
	}
	var out []string
	for _, k := range sortedKeys(m) {
		out = append(out, fmt.Sprintf("%s %s", k, ms(m[k])))
	}
	return strings.Join(out, ", ")
}

// hitRate is P's prefix-cache hit rate with its tokens ("—" when P prefilled nothing).
func hitRate(s Summary) string {
	if s.PrefillPromptTokens <= 0 {
		return "—"
	}
	return fmt.Sprintf("%.1f%% (%d / %d)", 100*s.PrefillCacheHitRate, s.PrefillCacheHitTokens, s.PrefillPromptTokens)
}

func linkList(m map[string]LinkBytes) string {
	if len(m) == 0 {
		return "—"
	}
	var out []string
	for _, k := range sortedKeys(m) {
		out = append(out, fmt.Sprintf("%s %s / %s", k, mib(m[k].In), mib(m[k].Out)))
	}
	return strings.Join(out, ", ")
}

// baselineChecks evaluates issue 14's targets of E4 against the best of the baselines PD, SGL
// and LLMD present (nil without E4 or without a baseline).
func baselineChecks(arms []*Arm, killed bool) [][3]string {
	return baselineChecksWith(arms, killed, DefaultTargets)
}

// baselineChecksWith is baselineChecks with a shape's targets (zero: DefaultTargets).
func baselineChecksWith(arms []*Arm, killed bool, tg Targets) [][3]string {
	if tg.GoodputRatio == 0 {
		tg = DefaultTargets
	}
	by := map[string]*Arm{}
	for _, a := range arms {
		by[a.Name] = a
	}
	e4 := by["E4"]
	var bl []*Arm
	for _, n := range []string{"PD", "SGL", "LLMD"} {
		if by[n] != nil {
			bl = append(bl, by[n])
		}
	}
	if e4 == nil || len(bl) == 0 {
		return nil
	}
	res := func(ok bool) string {
		if ok {
			return "met"
		}
		return "**missed**"
	}
	bestP99, bestCont, bestGood, bestRec := bl[0], bl[0], bl[0], bl[0]
	for _, a := range bl {
		if a.Summary.TTFTP99 < bestP99.Summary.TTFTP99 {
			bestP99 = a
		}
		if a.Summary.TTFTP99Continuing < bestCont.Summary.TTFTP99Continuing {
			bestCont = a
		}
		if a.Summary.GoodputRPS > bestGood.Summary.GoodputRPS {
			bestGood = a
		}
		// The recovery excess: a baseline the death did not touch lost nothing (0), and one whose
		// touched sessions were served at their usual speed lost about nothing either.
		if a.Summary.RecoveryExcessS < bestRec.Summary.RecoveryExcessS {
			bestRec = a
		}
	}
	e := e4.Summary
	out := [][3]string{
		{"E4 TTFT p99 ≤ the best baseline's", fmt.Sprintf("%s vs %s (%s)", ms(e.TTFTP99), ms(bestP99.Summary.TTFTP99), bestP99.Name), res(e.TTFTP99 <= bestP99.Summary.TTFTP99)},
		{"E4 TTFT p99 of continuing turns ≤ the best baseline's", fmt.Sprintf("%s vs %s (%s)", ms(e.TTFTP99Continuing), ms(bestCont.Summary.TTFTP99Continuing), bestCont.Name),
			res(e.TTFTP99Continuing <= bestCont.Summary.TTFTP99Continuing)},
		{fmt.Sprintf("E4 goodput ≥ %.2g × the best baseline's at the SLO", tg.GoodputRatio), fmt.Sprintf("%.3f vs %.2g × %.3f = %.3f req/s (%s); within SLO %d / %d vs %d / %d", e.GoodputRPS, tg.GoodputRatio, bestGood.Summary.GoodputRPS, tg.GoodputRatio*bestGood.Summary.GoodputRPS, bestGood.Name, e.SLOMet, e.Total, bestGood.Summary.SLOMet, bestGood.Summary.Total),
			res(e.GoodputRPS >= tg.GoodputRatio*bestGood.Summary.GoodputRPS)},
	}
	switch {
	case killed:
		b := bestRec.Summary
		out = append(out, [3]string{"E4 recovery after a decode worker's death ≤ 0.5 × the best baseline's",
			fmt.Sprintf("excess over the usual TTFT %s vs 0.5 × %s = %s (%s, %d affected sessions); recovery %s vs %s; E4 affected sessions %d, unrecovered %d",
				ms(e.RecoveryExcessS), ms(b.RecoveryExcessS), ms(0.5*b.RecoveryExcessS), bestRec.Name, b.AffectedSessions, ms(e.RecoveryS), ms(b.RecoveryS), e.AffectedSessions, e.Unrecovered),
			res(e.Unrecovered == 0 && e.RecoveryExcessS <= 0.5*b.RecoveryExcessS)})
	default:
		out = append(out, [3]string{"E4 recovery after a decode worker's death ≤ 0.5 × the best baseline's", "not measured (no --kill-decode)", "**missed**"})
	}
	out = append(out, [3]string{"E4 snapshot hit rate ≥ 90% of its reseeds", fmt.Sprintf("%s of %d reseeds (%d stale)", pct(e.SnapshotHitRate), e.ReseedCount, e.SnapshotStale),
		res(e.ReseedCount == 0 || e.SnapshotHitRate >= 0.9)})
	var vf int64
	for _, a := range arms {
		vf += a.Summary.KVVerifyFailures
	}
	out = append(out, [3]string{"zero KV verification failures (all arms)", fmt.Sprint(vf), res(vf == 0)})
	return out
}

// targetChecks evaluates the demo's done-when targets when E1, E3 and E4 are all present.
func targetChecks(arms []*Arm) [][3]string {
	by := map[string]*Arm{}
	for _, a := range arms {
		by[a.Name] = a
	}
	e1, e3, e4 := by["E1"], by["E3"], by["E4"]
	if e1 == nil || e3 == nil || e4 == nil {
		return nil
	}
	res := func(ok bool) string {
		if ok {
			return "met"
		}
		return "**missed**"
	}
	var out [][3]string
	out = append(out, [3]string{"E3 direct-to-D share ≥ 85%", pct(e3.Summary.DirectToDShare), res(e3.Summary.DirectToDShare >= 0.85)})
	out = append(out, [3]string{"E3 reseeds take seconds (reseed TTFT p50 ≥ 1 s)", fmt.Sprintf("%s over %d reseeds", ms(e3.Summary.ReseedTTFTP50), e3.Summary.ReseedCount),
		res(e3.Summary.ReseedCount > 0 && e3.Summary.ReseedTTFTP50 >= 1)})
	out = append(out, [3]string{"E4 reseed TTFT p50 ≤ 0.25 × E3's", fmt.Sprintf("%s vs 0.25 × %s = %s", ms(e4.Summary.ReseedTTFTP50), ms(e3.Summary.ReseedTTFTP50), ms(0.25*e3.Summary.ReseedTTFTP50)),
		res(e4.Summary.ReseedCount > 0 && e3.Summary.ReseedCount > 0 && e4.Summary.ReseedTTFTP50 <= 0.25*e3.Summary.ReseedTTFTP50)})
	out = append(out, [3]string{"E4 TTFT p99 ≤ E1 TTFT p99", fmt.Sprintf("%s vs %s", ms(e4.Summary.TTFTP99), ms(e1.Summary.TTFTP99)), res(e4.Summary.TTFTP99 <= e1.Summary.TTFTP99)})
	var vf int64
	for _, a := range arms {
		vf += a.Summary.KVVerifyFailures
	}
	out = append(out, [3]string{"zero KV verification failures", fmt.Sprint(vf), res(vf == 0)})
	return out
}

// ShapeRun is one cluster shape's arms, as Run wrote them into the shape's own directory.
type ShapeRun struct {
	Name string
	Meta Meta
	Arms []*Arm
}

// WriteShapes writes a multi-shape run's top-level summary.json ({shape: {arm: summary}}) and
// report.md (every shape's report in turn, its plots linked from the shape's directory) into
// dir; each shape's own files are in dir/<shape>/.
func WriteShapes(dir string, runs []ShapeRun) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	sum := map[string]map[string]Summary{}
	for _, r := range runs {
		m := map[string]Summary{}
		for _, a := range r.Arms {
			m[a.Name] = a.Summary
		}
		sum[r.Name] = m
	}
	b, err := json.MarshalIndent(sum, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, SummaryFile), append(b, '\n'), 0o644); err != nil {
		return err
	}
	var w strings.Builder
	w.WriteString("# kvc-bench report: ")
	var names []string
	for _, r := range runs {
		names = append(names, r.Name)
	}
	w.WriteString(strings.Join(names, ", ") + "\n\n")
	w.WriteString("One cluster shape after the other, each with every arm on a fresh cluster of its shape; each shape's files (metrics.jsonl, summary.json, plots, cluster logs) are in its own directory. `summary.json` here holds every shape: `{shape: {arm: summary}}`.\n\n")
	w.WriteString("| shape | arm | ok / total | TTFT p50 | TTFT p99 | TTFT p99, continuing | within SLO | goodput (req/s) | killed worker (sessions held) | recovery excess | wasted-KV fallbacks |\n|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|\n")
	for _, r := range runs {
		for _, a := range r.Arms {
			s := a.Summary
			victim := "—"
			if s.KilledWorker != "" {
				victim = fmt.Sprintf("%s (%d)", s.KilledWorker, s.KilledWorkerSessions)
			}
			fmt.Fprintf(&w, "| %s | %s | %d / %d | %s | %s | %s | %d / %d | %.3f | %s | %s | %d |\n", r.Name, a.Name, s.OK, s.Total, ms(s.TTFTP50), ms(s.TTFTP99),
				ms(s.TTFTP99Continuing), s.SLOMet, s.Total, s.GoodputRPS, victim, ms(s.RecoveryExcessS), s.WastedKVFallbacks)
		}
	}
	w.WriteString("\n")
	for _, r := range runs {
		w.WriteString(nestReport(Markdown(r.Meta, r.Arms), r.Name))
		w.WriteString("\n")
	}
	return os.WriteFile(filepath.Join(dir, ReportFile), []byte(w.String()), 0o644)
}

// nestReport demotes a shape's report by one heading level and points its images into the
// shape's directory.
func nestReport(md, sub string) string {
	lines := strings.Split(md, "\n")
	for i, l := range lines {
		if strings.HasPrefix(l, "#") {
			lines[i] = "#" + l
		}
		if strings.HasPrefix(l, "![") {
			if j := strings.Index(l, "]("); j >= 0 {
				lines[i] = l[:j+2] + sub + "/" + l[j+2:]
			}
		}
	}
	return strings.Join(lines, "\n")
}
