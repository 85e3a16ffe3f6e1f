package report

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/kvcentric/kvcentric/sim/internal/plot"
)

// SweepPoint is one load of a sweep: its load multiplier, the arrival rate it meant (sessions
// per model second), and every arm's summary there.
type SweepPoint struct {
	Load       float64            `json:"load"`
	SessionsPS float64            `json:"sessions_per_s"`
	Sessions   int                `json:"sessions"`
	Arms       map[string]Summary `json:"arms"`
	Dir        string             `json:"dir"`
	Aborted    string             `json:"aborted,omitempty"`
}

// Sweep files.
const (
	SweepFile        = "sweep.json"
	SweepReport      = "sweep.md"
	GoodputPlot      = "goodput_vs_load.png"
	TTFTP50LoadPlot  = "ttft_p50_vs_load.png"
	TTFTP99LoadPlot  = "ttft_p99_vs_load.png"
	sweepPlotTitleFm = "%s vs load (SLO: TTFT ≤ %s, TPOT ≤ %s)"
)

// WriteSweep writes sweep.json, sweep.md and the goodput and TTFT-vs-load plots into dir.
func WriteSweep(dir string, slo SLO, arms []string, pts []SweepPoint) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(pts, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, SweepFile), append(b, '\n'), 0o644); err != nil {
		return err
	}
	line := func(f func(Summary) float64) []plot.Line {
		var out []plot.Line
		for _, a := range arms {
			l := plot.Line{Name: a + " " + armTitle(a)}
			for _, p := range pts {
				if s, ok := p.Arms[a]; ok {
					l.X = append(l.X, p.SessionsPS)
					l.Y = append(l.Y, f(s))
				}
			}
			out = append(out, l)
		}
		return out
	}
	x := "offered load (sessions started per model second)"
	for _, c := range []struct {
		file, what, y string
		logY          bool
		f             func(Summary) float64
	}{
		{GoodputPlot, "Goodput", "requests/s within the SLO", false, func(s Summary) float64 { return s.GoodputRPS }},
		{TTFTP50LoadPlot, "TTFT p50", "TTFT p50 (log)", true, func(s Summary) float64 { return s.TTFTP50 }},
		{TTFTP99LoadPlot, "TTFT p99", "TTFT p99 (log)", true, func(s Summary) float64 { return s.TTFTP99 }},
	} {
		var buf bytes.Buffer
		if err := plot.Lines(&buf, fmt.Sprintf(sweepPlotTitleFm, c.what, ms(slo.TTFT), ms(slo.TPOT)), x, c.y, c.logY, line(c.f)); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, c.file), buf.Bytes(), 0o644); err != nil {
			return err
		}
	}
	var w strings.Builder
	fmt.Fprintf(&w, "# kvc-bench load sweep\n\nSLO: TTFT ≤ %s, time per output token ≤ %s (model seconds). One directory per load with its report.md.\n\n", ms(slo.TTFT), ms(slo.TPOT))
	fmt.Fprintf(&w, "| load | sessions | sessions/s | arm | ok / total | goodput (req/s) | TTFT p50 | TTFT p99 | direct-to-D (continuing) |\n|---:|---:|---:|---|---:|---:|---:|---:|---:|\n")
	for _, p := range pts {
		for _, a := range arms {
			s, ok := p.Arms[a]
			if !ok {
				continue
			}
			fmt.Fprintf(&w, "| %g | %d | %.3f | %s | %d / %d | %.3f | %s | %s | %s |\n", p.Load, p.Sessions, p.SessionsPS, a, s.OK, s.Total, s.GoodputRPS, ms(s.TTFTP50), ms(s.TTFTP99), pct(s.DirectToDShareContinuing))
		}
		if p.Aborted != "" {
			fmt.Fprintf(&w, "\nLoad %g stopped early: %s\n\n", p.Load, p.Aborted)
		}
	}
	fmt.Fprintf(&w, "\n![goodput vs load](%s)\n\n![TTFT p50 vs load](%s)\n\n![TTFT p99 vs load](%s)\n", GoodputPlot, TTFTP50LoadPlot, TTFTP99LoadPlot)
	return os.WriteFile(filepath.Join(dir, SweepReport), []byte(w.String()), 0o644)
}
