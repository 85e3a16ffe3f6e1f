package report

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/kvcentric/kvcentric/sim/internal/plot"
)

// SweepPoint is one load of a sweep on one shape: its load multiplier, the arrival rate it
// meant (sessions per model second), and every arm's summary there.
type SweepPoint struct {
	Load       float64            `json:"load"`
	SessionsPS float64            `json:"sessions_per_s"`
	Sessions   int                `json:"sessions"`
	Arms       map[string]Summary `json:"arms"`
	Dir        string             `json:"dir"`
	Aborted    string             `json:"aborted,omitempty"`
}

// SweepShape is one cluster shape's points ("" Name: a run of one unnamed shape).
type SweepShape struct {
	Name                 string
	DecodeCapacityTokens int64
	Points               []SweepPoint
}

// SweepRow is one object of sweep.json's points: one shape, load and arm.
type SweepRow struct {
	Shape                string  `json:"shape"`
	Load                 float64 `json:"load"`
	Sessions             int     `json:"sessions"`
	SessionsPS           float64 `json:"sessions_per_s"`
	DecodeCapacityTokens int64   `json:"decode_capacity_tokens,omitempty"`
	Arm                  string  `json:"arm"`
	OK                   int     `json:"ok"`
	Total                int     `json:"total"`
	SLOMet               int     `json:"slo_met"`
	SLOAttainment        float64 `json:"slo_attainment"`
	GoodputRPS           float64 `json:"goodput_rps"`
	TTFTP50              float64 `json:"ttft_p50_s"`
	TTFTP99              float64 `json:"ttft_p99_s"`
	TTFTP99Continuing    float64 `json:"ttft_p99_continuing_s"`
	Aborted              string  `json:"aborted,omitempty"`
}

// SweepJSON is sweep.json: every point, and each shape's SLO capacity per arm (SLOCapacity).
type SweepJSON struct {
	SLO         SLO                           `json:"slo"`
	Attainment  float64                       `json:"slo_capacity_attainment"`
	Points      []SweepRow                    `json:"points"`
	SLOCapacity map[string]map[string]float64 `json:"slo_capacity"`
	// CapacityBound says, per shape and arm, whether slo_capacity is "interpolated" between two
	// loads, a lower bound ("at_least": every load met it) or "below_lowest" (no load met it: 0).
	CapacityBound map[string]map[string]string `json:"slo_capacity_bound"`
}

// CapacityAttainment is the share of requests within the SLO that defines SLO capacity.
const CapacityAttainment = 0.9

// Bounds of SLOCapacity.
const (
	CapInterpolated = "interpolated"
	CapAtLeast      = "at_least"
	CapBelowLowest  = "below_lowest"
)

// SLOCapacity is the highest load at which at least target of the requests met the SLO:
// the highest measured load that meets it, moved toward the next higher load by linear
// interpolation of the attainment between the two (CapInterpolated). When every load meets it,
// the highest load (CapAtLeast: a lower bound); when none does, 0 (CapBelowLowest). loads and
// att are parallel, in any order.
func SLOCapacity(loads, att []float64, target float64) (float64, string) {
	type pt struct{ x, y float64 }
	var ps []pt
	for i := range loads {
		if i < len(att) {
			ps = append(ps, pt{loads[i], att[i]})
		}
	}
	sort.Slice(ps, func(i, j int) bool { return ps[i].x < ps[j].x })
	best := -1
	for i, p := range ps {
		if p.y >= target {
			best = i
		}
	}
	switch {
	case best < 0:
		return 0, CapBelowLowest
	case best == len(ps)-1:
		return ps[best].x, CapAtLeast
	}
	a, b := ps[best], ps[best+1]
	if a.y == b.y { // cannot happen (b misses, a meets), but never divide by zero
		return a.x, CapInterpolated
	}
	return round(a.x + (a.y-target)/(a.y-b.y)*(b.x-a.x)), CapInterpolated
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

// SweepData flattens shapes into sweep.json's rows and capacities.
func SweepData(slo SLO, arms []string, shapes []SweepShape) SweepJSON {
	out := SweepJSON{SLO: slo, Attainment: CapacityAttainment, Points: []SweepRow{},
		SLOCapacity: map[string]map[string]float64{}, CapacityBound: map[string]map[string]string{}}
	for _, sh := range shapes {
		capm, bound := map[string]float64{}, map[string]string{}
		for _, a := range arms {
			var loads, att []float64
			for _, p := range sh.Points {
				s, ok := p.Arms[a]
				if !ok {
					continue
				}
				out.Points = append(out.Points, SweepRow{Shape: sh.Name, Load: p.Load, Sessions: p.Sessions, SessionsPS: p.SessionsPS,
					DecodeCapacityTokens: sh.DecodeCapacityTokens, Arm: a, OK: s.OK, Total: s.Total, SLOMet: s.SLOMet, SLOAttainment: s.SLOAttainment,
					GoodputRPS: s.GoodputRPS, TTFTP50: s.TTFTP50, TTFTP99: s.TTFTP99, TTFTP99Continuing: s.TTFTP99Continuing, Aborted: p.Aborted})
				loads, att = append(loads, p.Load), append(att, s.SLOAttainment)
			}
			if len(loads) > 0 {
				capm[a], bound[a] = SLOCapacity(loads, att, CapacityAttainment)
			}
		}
		out.SLOCapacity[sh.Name], out.CapacityBound[sh.Name] = capm, bound
	}
	return out
}

// WriteSweep writes sweep.json, sweep.md and the goodput and TTFT-vs-load plots (per shape, in
// the shape's directory when it has a name) into dir.
func WriteSweep(dir string, slo SLO, arms []string, shapes []SweepShape) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	data := SweepData(slo, arms, shapes)
	b, err := json.MarshalIndent(data, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, SweepFile), append(b, '\n'), 0o644); err != nil {
		return err
	}
	var w strings.Builder
	fmt.Fprintf(&w, "# kvc-bench load sweep\n\nSLO: TTFT ≤ %s, time per output token ≤ %s (model seconds). One directory per shape and load with its report.md. Every figure counts failed requests (a failure is an SLO miss and enters TTFT percentiles at the time it failed).\n\n", ms(slo.TTFT), ms(slo.TPOT))
	fmt.Fprintf(&w, "## SLO capacity\n\nThe highest load (× the base sessions) at which ≥ %.0f%% of the requests met the SLO, interpolated linearly between the two loads around it; *≥* when every load met it (a lower bound), *< lowest* when none did.\n\n", 100*CapacityAttainment)
	fmt.Fprintf(&w, "| shape | %s |\n|---|%s\n", strings.Join(arms, " | "), strings.Repeat("---:|", len(arms)))
	for _, sh := range shapes {
		var cells []string
		for _, a := range arms {
			c, ok := data.SLOCapacity[sh.Name][a]
			switch {
			case !ok:
				cells = append(cells, "—")
			case data.CapacityBound[sh.Name][a] == CapAtLeast:
				cells = append(cells, fmt.Sprintf("≥ %g", c))
			case data.CapacityBound[sh.Name][a] == CapBelowLowest:
				cells = append(cells, "< lowest")
			default:
				cells = append(cells, fmt.Sprintf("%.2f", c))
			}
		}
		fmt.Fprintf(&w, "| %s | %s |\n", shapeLabel(sh.Name), strings.Join(cells, " | "))
	}
	w.WriteString("\n## Points\n\n")
	for _, sh := range shapes {
		sub := dir
		pre := ""
		if sh.Name != "" {
			sub, pre = filepath.Join(dir, sh.Name), sh.Name+"/"
			fmt.Fprintf(&w, "### %s\n\n", sh.Name)
			if sh.DecodeCapacityTokens > 0 {
				fmt.Fprintf(&w, "Decode pools: %d tokens each.\n\n", sh.DecodeCapacityTokens)
			}
		}
		if err := sweepPlots(sub, slo, arms, sh.Points); err != nil {
			return err
		}
		fmt.Fprintf(&w, "| load | sessions | sessions/s | arm | ok / total | within SLO | goodput (req/s) | TTFT p50 | TTFT p99 | TTFT p99, continuing | direct-to-D (continuing) |\n|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|\n")
		for _, p := range sh.Points {
			for _, a := range arms {
				s, ok := p.Arms[a]
				if !ok {
					continue
				}
				fmt.Fprintf(&w, "| %g | %d | %.3f | %s | %d / %d | %d (%s) | %.3f | %s | %s | %s | %s |\n", p.Load, p.Sessions, p.SessionsPS, a, s.OK, s.Total,
					s.SLOMet, pct(s.SLOAttainment), s.GoodputRPS, ms(s.TTFTP50), ms(s.TTFTP99), ms(s.TTFTP99Continuing), pct(s.DirectToDShareContinuing))
			}
			if p.Aborted != "" {
				fmt.Fprintf(&w, "\nLoad %g stopped early: %s\n\n", p.Load, p.Aborted)
			}
		}
		fmt.Fprintf(&w, "\n![goodput vs load](%s%s)\n\n![TTFT p50 vs load](%s%s)\n\n![TTFT p99 vs load](%s%s)\n\n", pre, GoodputPlot, pre, TTFTP50LoadPlot, pre, TTFTP99LoadPlot)
	}
	return os.WriteFile(filepath.Join(dir, SweepReport), []byte(w.String()), 0o644)
}

func shapeLabel(s string) string {
	if s == "" {
		return "(this cluster)"
	}
	return s
}

func sweepPlots(dir string, slo SLO, arms []string, pts []SweepPoint) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
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
	return nil
}
