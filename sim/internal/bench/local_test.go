package bench

import (
	"context"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/sim/internal/cluster"
	"github.com/kvcentric/kvcentric/sim/internal/clustertest"
	"github.com/kvcentric/kvcentric/sim/internal/report"
	"github.com/kvcentric/kvcentric/sim/internal/workload"
)

// TestLocalArm runs a tiny E4 arm on a real local cluster (every binary, real gRPC, real bytes)
// and checks the outputs. It needs the binaries: under make test KVC_BIN_DIR names them.
func TestLocalArm(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a whole cluster")
	}
	arms, out := runLocal(t, 50*time.Millisecond, Config{Arms: []string{"E4"}})
	s := arms[0].Summary
	if s.Total != 5 || s.OK != 5 || s.KVVerifyFailures != 0 || s.BytesMoved <= 0 || s.DirectToDShare < 0.5 {
		t.Fatalf("summary %+v modes %+v errors %v", s, arms[0].Modes, arms[0].ErrorKinds)
	}
	raw, err := os.ReadFile(filepath.Join(out, report.SummaryFile))
	if err != nil {
		t.Fatal(err)
	}
	var sum map[string]map[string]any
	if err := json.Unmarshal(raw, &sum); err != nil {
		t.Fatal(err)
	}
	fields := []string{"ok", "total", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "latency_p50_s", "latency_p99_s", "direct_to_d_share",
		"reseed_count", "reseed_ttft_p50_s", "snapshot_hit_rate", "bytes_moved", "kv_verify_failures",
		"direct_to_d_share_continuing", "snapshot_stale", "goodput_rps", "recovery_s", "affected_sessions", "recovery_ttft_p50_s", "unrecovered", "recovery_excess_s",
		"ttft_p99_continuing_s", "slo_met", "slo_attainment", "prefill_busy_s", "decode_busy_s", "link_bytes",
		"prefill_cache_hit_rate", "prefill_cache_hit_tokens", "prefill_prompt_tokens",
		"wasted_kv_fallbacks", "killed_worker", "killed_worker_sessions", "killed_worker_resident",
		"recovery_excess_paired_s", "recovery_paired_fallbacks", "recovery_control"}
	if len(sum["E4"]) != len(fields) {
		t.Fatalf("summary fields %v", sum["E4"])
	}
	for _, f := range fields {
		if _, ok := sum["E4"][f]; !ok {
			t.Fatalf("summary lacks %s", f)
		}
	}
	// One busy time per worker, and the P→D bytes out of P's node and into the decode nodes.
	var dBusy float64
	for _, v := range s.DecodeBusyS {
		dBusy += v
	}
	var dIn int64
	for id, lb := range s.LinkBytes {
		if id != "prefill-0" {
			dIn += lb.In
		}
	}
	if len(s.PrefillBusyS) != 1 || s.PrefillBusyS["prefill-0"] <= 0 || len(s.DecodeBusyS) != 3 || dBusy <= 0 ||
		s.LinkBytes["prefill-0"].Out <= 0 || dIn < s.LinkBytes["prefill-0"].Out {
		t.Fatalf("busy %v %v link bytes %v", s.PrefillBusyS, s.DecodeBusyS, s.LinkBytes)
	}
	// P's prefix cache: its prompt tokens were scraped, and it served at most all of them.
	if s.PrefillPromptTokens <= 0 || s.PrefillCacheHitTokens < 0 || s.PrefillCacheHitTokens > s.PrefillPromptTokens {
		t.Fatalf("P prefix cache: %d hit of %d prompt tokens", s.PrefillCacheHitTokens, s.PrefillPromptTokens)
	}
	for _, f := range []string{report.ReportFile, report.CDFFile, report.ModesFile, "metrics.jsonl"} {
		if st, err := os.Stat(filepath.Join(out, f)); err != nil || st.Size() == 0 {
			t.Fatalf("%s: %v", f, err)
		}
	}
}

// TestLocalRecoveryControl: with RecoveryControl each arm first replays the workload without the
// kill on its own fresh cluster, into metrics-control.jsonl, and the kill run's summary carries
// the paired figures; metrics.jsonl keeps only the kill run's records.
func TestLocalRecoveryControl(t *testing.T) {
	if testing.Short() {
		t.Skip("starts two whole clusters")
	}
	arms, out := runLocal(t, 300*time.Millisecond, Config{
		Arms: []string{"SGL"}, KillDecode: KillMost, KillAfterRequests: 1, KillWorkerOnly: true, RecoveryControl: true,
	})
	s := arms[0].Summary
	if s.Total != 5 || !s.RecoveryControl || s.KilledWorker == "" {
		t.Fatalf("summary %+v", s)
	}
	count := func(name string) (n, ok int) {
		f, err := os.Open(filepath.Join(out, name))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		dec := json.NewDecoder(f)
		for {
			var r report.Record
			if err := dec.Decode(&r); err == io.EOF {
				return n, ok
			} else if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			n++
			if r.OK {
				ok++
			}
		}
	}
	if n, ok := count(ControlMetricsFile); n != 5 || ok != 5 {
		t.Fatalf("control records %d (%d ok), want 5 (5)", n, ok)
	}
	if n, _ := count("metrics.jsonl"); n != 5 {
		t.Fatalf("kill run records %d, want 5", n)
	}
	if st, err := os.Stat(filepath.Join(out, "control", "cluster-SGL")); err != nil || !st.IsDir() {
		t.Fatalf("control cluster dir: %v", err)
	}
}

// runLocal runs cfg's arms (bench.Run, Local) on fresh clusters of the built binaries over
// tinyWorkload(think), with what the local tests share: the time scale 0.2 (replay, kvc-sim and
// the policy's timers), 2 bytes per token per buffer, 20,000-token decode pools, a minute per
// request, 3 minutes in all. It returns the arms and the output dir.
func runLocal(t *testing.T, think time.Duration, cfg Config) ([]*report.Arm, string) {
	t.Helper()
	cfg.Local, cfg.BinDir, cfg.OutDir, cfg.Log = true, clustertest.BinDir(t, cluster.Binaries), t.TempDir(), io.Discard
	cfg.Workload = tinyWorkload(think)
	cfg.Meta = report.Meta{Command: "test", Workload: cfg.Workload.Name, Stats: cfg.Workload.Describe(), TimeScale: 0.2, TimeDiv: 0.2,
		Started: time.Now()}
	cfg.Replay = Options{TimeScale: 0.2, RequestTimeout: time.Minute}
	cfg.DecodeCapacityTokens = 20000
	cfg.SimArgs = []string{"--bytes-per-token-per-buffer", "2", "--time-scale", "0.2"}
	cfg.TimerScale = 0.2
	ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
	defer cancel()
	arms, err := Run(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return arms, cfg.OutDir
}

// tinyWorkload is two sessions of five turns in all, think seconds apart.
func tinyWorkload(think time.Duration) *workload.Workload {
	return &workload.Workload{Name: "tiny", Sessions: []workload.Session{
		{ID: "tiny-a", Turns: []workload.Turn{{InputTokens: 3000, OutputTokens: 4}, {Think: think, InputTokens: 3300, OutputTokens: 4}, {Think: think, InputTokens: 3600, OutputTokens: 4}}},
		{ID: "tiny-b", Start: 100 * time.Millisecond, Turns: []workload.Turn{{InputTokens: 2000, OutputTokens: 4}, {Think: think, InputTokens: 2300, OutputTokens: 4}}},
	}}
}
