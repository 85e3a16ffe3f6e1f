package plot

import (
	"fmt"
	"image/png"
	"io"
	"math"
)

// Line is one arm's curve: Y at each X (same length; points are drawn in X order as given).
type Line struct {
	Name string
	X, Y []float64
}

// Lines writes a PNG of line charts (goodput or TTFT against load): a linear X axis, a linear
// Y axis from 0 (or a log10 Y axis with logY, for latencies), one marked curve per line.
func Lines(w io.Writer, title, xLabel, yLabel string, logY bool, lines []Line) error {
	const W = 1100
	const left, right, bottom = 100.0, 40.0, 80.0
	top := 70.0 + 26*float64(len(lines)) + 14
	H := int(top) + 480 + int(bottom)
	c := newCanvas(W, H, bg)
	pw, ph := W-left-right, float64(H)-top-bottom
	xlo, xhi, ylo, yhi := math.Inf(1), math.Inf(-1), math.Inf(1), math.Inf(-1)
	for _, l := range lines {
		if len(l.X) != len(l.Y) {
			return fmt.Errorf("line %q: %d x values, %d y values", l.Name, len(l.X), len(l.Y))
		}
		for i := range l.X {
			xlo, xhi = math.Min(xlo, l.X[i]), math.Max(xhi, l.X[i])
			if !logY || l.Y[i] > 0 {
				ylo, yhi = math.Min(ylo, l.Y[i]), math.Max(yhi, l.Y[i])
			}
		}
	}
	if math.IsInf(xlo, 1) {
		xlo, xhi = 0, 1
	}
	if xhi <= xlo {
		xhi = xlo + 1
	}
	if math.IsInf(ylo, 1) {
		ylo, yhi = 0.01, 1
	}
	var yOf func(float64) float64
	var yTicks []float64
	if logY {
		dlo, dhi := math.Floor(math.Log10(ylo)), math.Ceil(math.Log10(yhi))
		if dhi <= dlo {
			dhi = dlo + 1
		}
		yOf = func(v float64) float64 {
			v = math.Max(v, math.Pow(10, dlo))
			return top + (1-(math.Log10(v)-dlo)/(dhi-dlo))*ph
		}
		for d := dlo; d <= dhi; d++ {
			yTicks = append(yTicks, math.Pow(10, d))
		}
	} else {
		ylo = 0
		if yhi <= 0 {
			yhi = 1
		}
		yhi *= 1.1
		yOf = func(v float64) float64 { return top + (1-(v-ylo)/(yhi-ylo))*ph }
		for i := 0; i <= 5; i++ {
			yTicks = append(yTicks, ylo+(yhi-ylo)*float64(i)/5)
		}
	}
	xOf := func(v float64) float64 { return left + (v-xlo)/(xhi-xlo)*pw }
	for _, v := range yTicks {
		y := yOf(v)
		c.polyline([]pt{{left, y}, {left + pw, y}}, 1, gridMajor, 0)
		lbl := fmt.Sprintf("%.3g", v)
		if logY {
			lbl = fmtSeconds(v)
		}
		c.text(left-10, y+5, lbl, face(15, false), ink, 2)
	}
	seen := map[float64]bool{}
	for _, l := range lines {
		for _, x := range l.X {
			if seen[x] {
				continue
			}
			seen[x] = true
			px := xOf(x)
			c.polyline([]pt{{px, top}, {px, top + ph}}, 1, gridMinor, 0)
			c.text(px, top+ph+24, fmt.Sprintf("%.3g", x), face(15, false), ink, 1)
		}
	}
	c.polyline([]pt{{left, top + ph}, {left + pw, top + ph}}, 1.5, ink, 0)
	c.polyline([]pt{{left, top}, {left, top + ph}}, 1.5, ink, 0)
	for i, l := range lines {
		col := armColors[i%len(armColors)]
		var pts []pt
		for j := range l.X {
			pts = append(pts, pt{xOf(l.X[j]), yOf(l.Y[j])})
		}
		if len(pts) > 1 {
			c.polyline(pts, 2.5, col, 0)
		}
		for _, p := range pts {
			c.fillPoly(col, circle(p.X, p.Y, 5, 16))
		}
		y := 62.0 + float64(i)*26 + 10
		c.polyline([]pt{{left + 16, y}, {left + 44, y}}, 3, col, 0)
		c.text(left+54, y+5, l.Name, face(15, false), ink, 0)
	}
	c.text(W/2, 38, title, face(22, true), ink, 1)
	c.text(left+pw/2, float64(H)-24, xLabel, face(16, false), ink, 1)
	c.vtext(26, top+ph/2, yLabel, face(16, false), ink)
	return png.Encode(w, c.img)
}
