package plot

import (
	"fmt"
	"image/color"
	"image/png"
	"io"
	"math"
	"sort"
)

// Palette: colour-blind-friendly (Okabe-Ito) hues.
var (
	bg        = color.RGBA{255, 255, 255, 255}
	ink       = color.RGBA{33, 37, 41, 255}
	muted     = color.RGBA{108, 117, 125, 255}
	gridMajor = color.RGBA{222, 226, 230, 255}
	gridMinor = color.RGBA{241, 243, 245, 255}
	armColors = []color.RGBA{{230, 159, 0, 255}, {0, 114, 178, 255}, {0, 158, 115, 255}, {204, 121, 167, 255}, {86, 180, 233, 255}, {213, 94, 0, 255}}
	// ModeColors colours execution modes consistently across figures.
	ModeColors = map[string]color.RGBA{
		"DIRECT_TO_D":     {0, 158, 115, 255},
		"SEED":            {86, 180, 233, 255},
		"RESEED_SNAPSHOT": {0, 114, 178, 255},
		"RESEED_PREFILL":  {230, 159, 0, 255},
		"PD_FALLBACK":     {160, 160, 160, 255},
		"FAILED":          {213, 94, 0, 255},
	}
	// ModeOrder is the stacking order.
	ModeOrder = []string{"DIRECT_TO_D", "SEED", "RESEED_SNAPSHOT", "RESEED_PREFILL", "PD_FALLBACK", "FAILED"}
)

// Series is one arm's sorted TTFTs (seconds).
type Series struct {
	Name   string
	Values []float64
}

func fmtSeconds(s float64) string {
	switch {
	case s < 1e-3:
		return fmt.Sprintf("%g µs", math.Round(s*1e6))
	case s < 1:
		return fmt.Sprintf("%g ms", math.Round(s*1e3*10)/10)
	default:
		return fmt.Sprintf("%g s", math.Round(s*100)/100)
	}
}

// TTFTCDF writes a PNG of the empirical CDF of each series on a log10 time axis, with p50 and
// p99 marked.
func TTFTCDF(w io.Writer, title string, series []Series) error {
	const W = 1100
	const left, right, bottom = 90.0, 40.0, 80.0
	top := 70.0 + 26*float64(len(series)) + 14
	H := int(top) + 520 + int(bottom)
	c := newCanvas(W, H, bg)
	pw, ph := W-left-right, float64(H)-top-bottom
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, s := range series {
		for _, v := range s.Values {
			if v > 0 {
				lo, hi = math.Min(lo, v), math.Max(hi, v)
			}
		}
	}
	if math.IsInf(lo, 1) {
		lo, hi = 0.01, 1
	}
	dlo, dhi := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
	if dhi <= dlo {
		dhi = dlo + 1
	}
	xOf := func(v float64) float64 { return left + (math.Log10(v)-dlo)/(dhi-dlo)*pw }
	yOf := func(q float64) float64 { return top + (1-q)*ph }

	// Grid.
	for d := dlo; d <= dhi; d++ {
		for m := 2.0; m < 10 && d < dhi; m++ {
			x := xOf(m * math.Pow(10, d))
			c.polyline([]pt{{x, top}, {x, top + ph}}, 1, gridMinor, 0)
		}
	}
	for d := dlo; d <= dhi; d++ {
		x := xOf(math.Pow(10, d))
		c.polyline([]pt{{x, top}, {x, top + ph}}, 1, gridMajor, 0)
		c.text(x, top+ph+24, fmtSeconds(math.Pow(10, d)), face(15, false), ink, 1)
	}
	for q := 0.0; q <= 1.0001; q += 0.25 {
		y := yOf(q)
		c.polyline([]pt{{left, y}, {left + pw, y}}, 1, gridMajor, 0)
		c.text(left-10, y+5, fmt.Sprintf("%d%%", int(math.Round(q*100))), face(15, false), ink, 2)
	}
	for _, q := range []float64{0.5, 0.99} {
		y := yOf(q)
		c.polyline([]pt{{left, y}, {left + pw, y}}, 1, muted, 5)
		c.text(left+pw-4, y-6, fmt.Sprintf("p%d", int(q*100)), face(13, false), muted, 2)
	}
	c.polyline([]pt{{left, top + ph}, {left + pw, top + ph}}, 1.5, ink, 0)
	c.polyline([]pt{{left, top}, {left, top + ph}}, 1.5, ink, 0)

	// Curves.
	for i, s := range series {
		col := armColors[i%len(armColors)]
		vals := append([]float64(nil), s.Values...)
		sort.Float64s(vals)
		n := float64(len(vals))
		var pts []pt
		for j, v := range vals {
			v = math.Max(v, math.Pow(10, dlo))
			x := xOf(v)
			if j == 0 {
				pts = append(pts, pt{x, yOf(0)})
			}
			pts = append(pts, pt{x, yOf(float64(j) / n)}, pt{x, yOf(float64(j+1) / n)})
		}
		c.polyline(pts, 2.5, col, 0)
		for _, q := range []float64{0.5, 0.99} {
			if len(vals) == 0 {
				continue
			}
			k := int(math.Ceil(q*n)) - 1
			v := math.Max(vals[max(k, 0)], math.Pow(10, dlo))
			c.fillPoly(col, circle(xOf(v), yOf(q), 5, 16))
		}
	}

	// Legend with p50 / p99 per arm.
	lx, ly := left+16, 62.0
	labels := make([]string, len(series))
	for i, s := range series {
		vals := append([]float64(nil), s.Values...)
		sort.Float64s(vals)
		p := func(q float64) float64 {
			if len(vals) == 0 {
				return 0
			}
			return vals[max(int(math.Ceil(q*float64(len(vals))))-1, 0)]
		}
		labels[i] = fmt.Sprintf("%s   p50 %s   p99 %s   (n=%d)", s.Name, fmtSeconds(p(.5)), fmtSeconds(p(.99)), len(vals))

	}
	for i := range series {
		y := ly + float64(i)*26 + 10
		c.polyline([]pt{{lx, y}, {lx + 28, y}}, 3, armColors[i%len(armColors)], 0)
		c.text(lx+38, y+5, labels[i], face(15, false), ink, 0)
	}

	c.text(W/2, 38, title, face(22, true), ink, 1)
	c.text(left+pw/2, float64(H)-24, "time to first token (log scale)", face(16, false), ink, 1)
	c.vtext(26, top+ph/2, "share of successful requests", face(16, false), ink)
	return png.Encode(w, c.img)
}

// Bar is one arm's counts per mode (use the key "FAILED" for failed requests).
type Bar struct {
	Name   string
	Counts map[string]int
}

// ModeShares writes a PNG of stacked horizontal bars: the share of each execution mode per arm.
func ModeShares(w io.Writer, title string, bars []Bar) error {
	const W = 1100
	H := 150 + 90*len(bars)
	const left, right, top = 80.0, 40.0, 110.0
	c := newCanvas(W, H, bg)
	pw := W - left - right
	c.text(W/2, 38, title, face(22, true), ink, 1)

	// Legend row.
	lx := left
	for _, m := range ModeOrder {
		c.rect(lx, 62, lx+18, 80, ModeColors[m])
		c.text(lx+24, 77, m, face(14, false), ink, 0)
		lx += 24 + textWidth(m, face(14, false)) + 26
	}
	for q := 0.0; q <= 1.0001; q += 0.25 {
		x := left + q*pw
		c.polyline([]pt{{x, top - 6}, {x, top + float64(90*len(bars))}}, 1, gridMajor, 0)
		c.text(x, top+float64(90*len(bars))+22, fmt.Sprintf("%d%%", int(math.Round(q*100))), face(14, false), muted, 1)
	}
	for i, b := range bars {
		total := 0
		for _, n := range b.Counts {
			total += n
		}
		y0 := top + float64(i)*90 + 12
		y1 := y0 + 56
		c.text(left-12, (y0+y1)/2+7, b.Name, face(20, true), ink, 2)
		if total == 0 {
			continue
		}
		x := left
		for _, m := range ModeOrder {
			n := b.Counts[m]
			if n == 0 {
				continue
			}
			share := float64(n) / float64(total)
			x1 := x + share*pw
			c.rect(x, y0, x1, y1, ModeColors[m])
			label := fmt.Sprintf("%.1f%%", share*100)
			if x1-x > textWidth(label, face(15, true))+10 {
				fg := color.RGBA{255, 255, 255, 255}
				if m == "SEED" || m == "PD_FALLBACK" {
					fg = ink
				}
				c.text((x+x1)/2, (y0+y1)/2+6, label, face(15, true), fg, 1)
			}
			x = x1
		}
		c.text(left+pw, y1+16, fmt.Sprintf("n = %d", total), face(13, false), muted, 2)
	}
	return png.Encode(w, c.img)
}
