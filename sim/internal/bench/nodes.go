package bench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"github.com/kvcentric/kvcentric/sim/internal/cluster"
	"github.com/kvcentric/kvcentric/sim/internal/report"
)

// The control plane's defaults of the policy timers ScalePolicyTimers scales
// (controlplane/internal/policy/knobs.go; the sim module cannot import it).
const (
	defaultReservationTimeoutMs = 30_000
	defaultUnreachableGraceMs   = 30_000
	minReservationTimeoutMs     = 100
)

// ScalePolicyTimers multiplies the policy's decision-shaping timers by scale (0 or 1: as they
// are): reservation_timeout_ms and unreachable_grace_ms (their defaults when unset), and
// snapshot_max_staleness_ms when set; the control plane reads them in wall milliseconds, so at
// --time-scale X they last as many model seconds as at real speed.
func ScalePolicyTimers(p *kvcv1.Policy, scale float64) {
	if p == nil || !(scale > 0) || scale == 1 {
		return
	}
	ms := func(v *int64, def int64, floor int64) *int64 {
		x := def
		if v != nil {
			x = *v
		}
		return proto.Int64(max(int64(math.Round(float64(x)*scale)), floor))
	}
	p.ReservationTimeoutMs = ms(p.ReservationTimeoutMs, defaultReservationTimeoutMs, minReservationTimeoutMs)
	p.UnreachableGraceMs = ms(p.UnreachableGraceMs, defaultUnreachableGraceMs, 0)
	if p.GetSnapshotMaxStalenessMs() > 0 {
		p.SnapshotMaxStalenessMs = ms(p.SnapshotMaxStalenessMs, 0, 1)
	}
}

// SidecarTimerArgs are the flags that run a sidecar's timers at scale (nil at real speed): its
// --time-scale multiplies the heartbeat, the worker health probe interval and, on a decode
// sidecar, the idle flush, the release tick and the release's minimum idle time.
func SidecarTimerArgs(scale float64) []string {
	if !(scale > 0) || scale == 1 {
		return nil
	}
	return []string{"--time-scale", strconv.FormatFloat(scale, 'g', -1, 64)}
}

// scrapeNodes reads the live workers' GPU busy seconds, the link bytes their kvc-sims count
// (P→D sends, tier pulls) and P's prompt and prefix-cache hit tokens; a dead worker is left out.
// From the control planes it reads kvc_router_wasted_kv_fallbacks_total.
func scrapeNodes(c *cluster.Cluster) report.NodeFigures {
	n := report.NodeFigures{PrefillBusyS: map[string]float64{}, DecodeBusyS: map[string]float64{}, LinkBytes: map[string]report.LinkBytes{},
		PrefillPromptTokens: map[string]int64{}, PrefillCacheHitTokens: map[string]int64{}}
	hc := &http.Client{Timeout: 5 * time.Second}
	for _, w := range c.Workers {
		if w.WorkerURL == "" {
			continue
		}
		m, err := scrape(hc, w.WorkerURL, "kvc_sim_busy_seconds_total", "kvc_sim_sent_bytes_total", "kvc_sim_pulled_bytes_total",
			"kvc_sim_prefill_prompt_tokens_total", "kvc_sim_prefill_cache_hit_tokens_total")
		if err != nil {
			continue
		}
		lb := n.LinkBytes[w.ID]
		if w.Role == "prefill" {
			if v, ok := m["kvc_sim_busy_seconds_total"]; ok {
				n.PrefillBusyS[w.ID] = v
			}
			lb.Out += int64(m["kvc_sim_sent_bytes_total"])
			lb.In += int64(m["kvc_sim_pulled_bytes_total"])
			n.PrefillPromptTokens[w.ID] = int64(m["kvc_sim_prefill_prompt_tokens_total"])
			n.PrefillCacheHitTokens[w.ID] = int64(m["kvc_sim_prefill_cache_hit_tokens_total"])
		} else if v, ok := m["kvc_sim_busy_seconds_total"]; ok {
			n.DecodeBusyS[w.ID] = v
		}
		n.LinkBytes[w.ID] = lb
	}
	n.WastedKVFallbacks = wastedKVFallbacks(hc, c.ControlPlaneHTTP)
	return n
}

// wastedKVFallbacks sums kvc_router_wasted_kv_fallbacks_total over the control planes at urls:
// only a leader decides, a follower counts 0, and after a failover both have counted (a control
// plane that does not answer is left out).
func wastedKVFallbacks(hc *http.Client, urls []string) int64 {
	var n int64
	for _, u := range urls {
		if m, err := scrape(hc, u, "kvc_router_wasted_kv_fallbacks_total"); err == nil {
			n += int64(m["kvc_router_wasted_kv_fallbacks_total"])
		}
	}
	return n
}

// scrape returns the named metrics of url's /metrics (summed over label sets).
func scrape(hc *http.Client, url string, names ...string) (map[string]float64, error) {
	resp, err := hc.Get(strings.TrimRight(url, "/") + "/metrics")
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("%s/metrics: %s", url, resp.Status)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		for _, name := range names {
			rest, ok := strings.CutPrefix(line, name)
			if !ok || rest == "" || (rest[0] != ' ' && rest[0] != '{') {
				continue
			}
			if i := strings.LastIndexByte(rest, ' '); i >= 0 {
				if f, err := strconv.ParseFloat(strings.TrimSpace(rest[i+1:]), 64); err == nil {
					out[name] += f
				}
			}
		}
	}
	return out, sc.Err()
}

// logEvent is what addLogBytes reads of a sidecar event log line (pkg/sidecar.Event).
type logEvent struct {
	Event string `json:"event"`
	Bytes int64  `json:"bytes"`
	Peer  string `json:"peer"`
}

// addLogBytes adds the link bytes the sidecars' event logs record (they survive a killed
// worker): on a decode node every transfer received (transfer_done: seeds, plain P/D and store
// reseeds); on a prefill node the snapshot pushes it ingested (in at P, out at the pushing D) and
// the store reseeds it sent (snapshot_bypass_hit: out at P).
func addLogBytes(c *cluster.Cluster, n *report.NodeFigures) {
	if n.LinkBytes == nil {
		n.LinkBytes = map[string]report.LinkBytes{}
	}
	add := func(id string, in, out int64) {
		lb := n.LinkBytes[id]
		lb.In += in
		lb.Out += out
		n.LinkBytes[id] = lb
	}
	for _, w := range c.Workers {
		if w.EventLog == "" {
			continue
		}
		f, err := os.Open(w.EventLog)
		if err != nil {
			continue
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 64<<10), 4<<20)
		for sc.Scan() {
			var e logEvent
			if json.Unmarshal(sc.Bytes(), &e) != nil || e.Bytes <= 0 {
				continue
			}
			switch {
			case w.Role == "decode" && e.Event == "transfer_done":
				add(w.ID, e.Bytes, 0)
			case w.Role == "prefill" && e.Event == "snapshot_recv_ingested":
				add(w.ID, e.Bytes, 0)
				if e.Peer != "" {
					add(e.Peer, 0, e.Bytes)
				}
			case w.Role == "prefill" && e.Event == "snapshot_bypass_hit":
				add(w.ID, 0, e.Bytes)
			}
		}
		f.Close()
	}
}
