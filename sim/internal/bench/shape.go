package bench

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/kvcentric/kvcentric/sim/internal/report"
)

// Shape is a local cluster's shape: prefill and decode workers, and optionally each decode
// worker's KV pool (0: the run's --decode-capacity-tokens).
type Shape struct {
	Name                 string // as given: "1P3D", "2P4D", "2P4D@700000"
	Prefill, Decode      int
	DecodeCapacityTokens int64
}

// Shape limits.
const (
	MaxWorkers      = 16
	MinShapePool    = 1024
	MaxShapePool    = 10_000_000
	MaxSweepLoad    = 100
	MaxSweepPoints  = 32
	shapeSyntaxHint = "want <P>P<D>D with 1-16 workers each, optionally @<decode pool tokens> (e.g. 1P3D, 2P4D, 2P4D@700000 or 2P4D@700K)"
)

var shapeRE = regexp.MustCompile(`^([0-9]+)P([0-9]+)D(?:@([0-9]+)([kK]?))?$`)

// ParseShape parses "<P>P<D>D[@tokens[K]]".
func ParseShape(s string) (Shape, error) {
	m := shapeRE.FindStringSubmatch(strings.TrimSpace(s))
	if m == nil {
		return Shape{}, fmt.Errorf("shape %q: %s", s, shapeSyntaxHint)
	}
	p, err1 := strconv.Atoi(m[1])
	d, err2 := strconv.Atoi(m[2])
	if err1 != nil || err2 != nil || p < 1 || p > MaxWorkers || d < 1 || d > MaxWorkers {
		return Shape{}, fmt.Errorf("shape %q: prefill and decode workers must be in [1, %d]", s, MaxWorkers)
	}
	sh := Shape{Name: strings.TrimSpace(s), Prefill: p, Decode: d}
	if m[3] != "" {
		n, err := strconv.ParseInt(m[3], 10, 64)
		if err == nil && m[4] != "" {
			if n > MaxShapePool {
				err = errors.New("too large")
			}
			n *= 1000
		}
		if err != nil || n < MinShapePool || n > MaxShapePool {
			return Shape{}, fmt.Errorf("shape %q: decode pool must be in [%d, %d] tokens", s, MinShapePool, MaxShapePool)
		}
		sh.DecodeCapacityTokens = n
	}
	return sh, nil
}

// ParseShapes parses a comma list of shapes (no duplicates).
func ParseShapes(s string) ([]Shape, error) {
	var out []Shape
	seen := map[string]bool{}
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		sh, err := ParseShape(f)
		if err != nil {
			return nil, err
		}
		if seen[sh.Name] {
			return nil, fmt.Errorf("shape %q given twice", sh.Name)
		}
		seen[sh.Name] = true
		out = append(out, sh)
	}
	if len(out) == 0 {
		return nil, errors.New("no shape given")
	}
	return out, nil
}

// SweepSpec is --sweep: the loads of every shape, or per shape.
type SweepSpec struct {
	// Loads apply to every shape of the run (the plain form "0.5,1,2").
	Loads []float64
	// PerShape, in the order given ("1P3D=0.5,1,2,3;2P4D=1,2,4,6;2P4D@700K=2"), replaces Loads.
	PerShape []ShapeLoads
}

// ShapeLoads are one shape's sweep loads.
type ShapeLoads struct {
	Shape Shape
	Loads []float64
}

// ParseSweep parses --sweep: "L1,L2,..." or "SHAPE=L1,L2;SHAPE=L3". Loads are in (0, 100], at
// most 32 per shape, and none twice.
func ParseSweep(s string) (SweepSpec, error) {
	var spec SweepSpec
	if !strings.Contains(s, "=") {
		l, err := parseLoads(s)
		spec.Loads = l
		return spec, err
	}
	seen := map[string]bool{}
	for _, g := range strings.Split(s, ";") {
		if g = strings.TrimSpace(g); g == "" {
			continue
		}
		name, loads, ok := strings.Cut(g, "=")
		if !ok {
			return spec, fmt.Errorf("%q: want SHAPE=LOADS in every ';'-separated group", g)
		}
		sh, err := ParseShape(name)
		if err != nil {
			return spec, err
		}
		if seen[sh.Name] {
			return spec, fmt.Errorf("shape %q given twice", sh.Name)
		}
		seen[sh.Name] = true
		l, err := parseLoads(loads)
		if err != nil {
			return spec, fmt.Errorf("shape %s: %w", sh.Name, err)
		}
		spec.PerShape = append(spec.PerShape, ShapeLoads{Shape: sh, Loads: l})
	}
	if len(spec.PerShape) == 0 {
		return spec, errors.New("no shape given")
	}
	return spec, nil
}

func parseLoads(s string) ([]float64, error) {
	var out []float64
	seen := map[float64]bool{}
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f == "" {
			continue
		}
		x, err := strconv.ParseFloat(f, 64)
		if err != nil || !(x > 0) || x > MaxSweepLoad {
			return nil, fmt.Errorf("load %q: want a number in (0, %d]", f, MaxSweepLoad)
		}
		if seen[x] {
			return nil, fmt.Errorf("load %g given twice", x)
		}
		seen[x] = true
		out = append(out, x)
	}
	if len(out) == 0 {
		return nil, errors.New("no load given")
	}
	if len(out) > MaxSweepPoints {
		return nil, fmt.Errorf("%d loads: at most %d", len(out), MaxSweepPoints)
	}
	return out, nil
}

// ShapeTargets are the targets stated for a shape (docs/benchmark.md, "Shapes and targets"):
// on a prefill-bound shape (at least three decode workers per prefill worker, the seeds' 1P3D)
// E4's direct-to-D turns relieve the scarce P, so issue 14's 1.2 × goodput applies; on a
// balanced shape (llm-d's 2P4D) goodput is bounded by the offered load at the demo's loads and
// parity is the target.
func ShapeTargets(sh Shape) report.Targets {
	if sh.Decode >= 3*sh.Prefill {
		return report.Targets{GoodputRatio: 1.2, Why: "issue 14; a prefill-bound shape: direct-to-D turns free the scarce prefill GPU"}
	}
	return report.Targets{GoodputRatio: 1.0, Why: "parity; a balanced shape: goodput is bound by the offered load until the baselines' prefill saturates (sim-fidelity review §3)"}
}
