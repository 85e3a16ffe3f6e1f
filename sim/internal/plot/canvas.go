package plot

import (
	"image"
	"image/color"
	"image/draw"
	"math"
	"sync"

	"golang.org/x/image/font"
	"golang.org/x/image/font/gofont/gobold"
	"golang.org/x/image/font/gofont/goregular"
	"golang.org/x/image/font/opentype"
	"golang.org/x/image/math/fixed"
	"golang.org/x/image/vector"
)

type pt struct{ X, Y float64 }

// canvas is an RGBA image with antialiased drawing helpers.
type canvas struct {
	img *image.RGBA
}

func newCanvas(w, h int, bg color.Color) *canvas {
	img := image.NewRGBA(image.Rect(0, 0, w, h))
	draw.Draw(img, img.Bounds(), image.NewUniform(bg), image.Point{}, draw.Src)
	return &canvas{img: img}
}

func (c *canvas) fillPoly(col color.Color, polys ...[]pt) {
	src := image.NewUniform(col)
	for _, p := range polys {
		if len(p) < 3 {
			continue
		}
		// One rasterizer per polygon, sized to its bounding box: overlapping shapes are
		// composited one over the other instead of accumulating coverage.
		x0, y0, x1, y1 := math.Inf(1), math.Inf(1), math.Inf(-1), math.Inf(-1)
		for _, v := range p {
			x0, y0, x1, y1 = math.Min(x0, v.X), math.Min(y0, v.Y), math.Max(x1, v.X), math.Max(y1, v.Y)
		}
		r := image.Rect(int(math.Floor(x0)), int(math.Floor(y0)), int(math.Ceil(x1))+1, int(math.Ceil(y1))+1)
		clip := r.Intersect(c.img.Bounds())
		if clip.Empty() {
			continue
		}
		ras := vector.NewRasterizer(clip.Dx(), clip.Dy())
		ox, oy := float64(clip.Min.X), float64(clip.Min.Y)
		ras.MoveTo(float32(p[0].X-ox), float32(p[0].Y-oy))
		for _, v := range p[1:] {
			ras.LineTo(float32(v.X-ox), float32(v.Y-oy))
		}
		ras.ClosePath()
		ras.Draw(c.img, clip, src, image.Point{})
	}
}

func (c *canvas) rect(x0, y0, x1, y1 float64, col color.Color) {
	c.fillPoly(col, []pt{{x0, y0}, {x1, y0}, {x1, y1}, {x0, y1}})
}

func circle(cx, cy, r float64, n int) []pt {
	p := make([]pt, n)
	for i := range p {
		a := 2 * math.Pi * float64(i) / float64(n)
		p[i] = pt{cx + r*math.Cos(a), cy + r*math.Sin(a)}
	}
	return p
}

// polyline strokes pts with width w (round joins), optionally dashed (dash > 0: on/off length).
func (c *canvas) polyline(pts []pt, w float64, col color.Color, dash float64) {
	var polys [][]pt
	seg := func(a, b pt) {
		dx, dy := b.X-a.X, b.Y-a.Y
		l := math.Hypot(dx, dy)
		if l == 0 {
			return
		}
		nx, ny := -dy/l*w/2, dx/l*w/2
		polys = append(polys, []pt{{a.X + nx, a.Y + ny}, {b.X + nx, b.Y + ny}, {b.X - nx, b.Y - ny}, {a.X - nx, a.Y - ny}})
	}
	for i := 1; i < len(pts); i++ {
		a, b := pts[i-1], pts[i]
		if dash <= 0 {
			seg(a, b)
			if w > 1.5 {
				polys = append(polys, circle(b.X, b.Y, w/2, 12))
			}
			continue
		}
		l := math.Hypot(b.X-a.X, b.Y-a.Y)
		for s := 0.0; s < l; s += 2 * dash {
			e := math.Min(s+dash, l)
			seg(pt{a.X + (b.X-a.X)*s/l, a.Y + (b.Y-a.Y)*s/l}, pt{a.X + (b.X-a.X)*e/l, a.Y + (b.Y-a.Y)*e/l})
		}
	}
	c.fillPoly(col, polys...)
}

var (
	fontOnce          sync.Once
	regularTT, boldTT *opentype.Font
	faceCache         = map[[2]int]font.Face{}
	faceMu            sync.Mutex
)

func face(size int, bold bool) font.Face {
	fontOnce.Do(func() {
		regularTT, _ = opentype.Parse(goregular.TTF)
		boldTT, _ = opentype.Parse(gobold.TTF)
	})
	faceMu.Lock()
	defer faceMu.Unlock()
	k := [2]int{size, 0}
	f := regularTT
	if bold {
		k[1], f = 1, boldTT
	}
	if fc, ok := faceCache[k]; ok {
		return fc
	}
	fc, err := opentype.NewFace(f, &opentype.FaceOptions{Size: float64(size), DPI: 72, Hinting: font.HintingFull})
	if err != nil {
		panic(err) // the embedded Go fonts always parse
	}
	faceCache[k] = fc
	return fc
}

// align: 0 left, 1 center, 2 right; y is the baseline.
func (c *canvas) text(x, y float64, s string, f font.Face, col color.Color, align int) {
	d := &font.Drawer{Dst: c.img, Src: image.NewUniform(col), Face: f}
	w := float64(d.MeasureString(s)) / 64
	switch align {
	case 1:
		x -= w / 2
	case 2:
		x -= w
	}
	d.Dot = fixed.P(int(math.Round(x)), int(math.Round(y)))
	d.DrawString(s)
}

func textWidth(s string, f font.Face) float64 {
	return float64(font.MeasureString(f, s)) / 64
}

// vtext draws s rotated 90° counter-clockwise, centred on (x, y).
func (c *canvas) vtext(x, y float64, s string, f font.Face, col color.Color) {
	w := int(textWidth(s, f)) + 4
	m := f.Metrics()
	h := (m.Ascent + m.Descent).Ceil() + 2
	tmp := image.NewRGBA(image.Rect(0, 0, w, h))
	d := &font.Drawer{Dst: tmp, Src: image.NewUniform(col), Face: f, Dot: fixed.P(2, m.Ascent.Ceil())}
	d.DrawString(s)
	x0, y0 := int(x)-h/2, int(y)-w/2
	for ty := 0; ty < h; ty++ {
		for tx := 0; tx < w; tx++ {
			src := tmp.RGBAAt(tx, ty)
			if src.A == 0 {
				continue
			}
			dx, dy := x0+ty, y0+(w-1-tx)
			if !image.Pt(dx, dy).In(c.img.Bounds()) {
				continue
			}
			dst := c.img.RGBAAt(dx, dy)
			a := uint32(src.A)
			blend := func(s, d uint8) uint8 { return uint8((uint32(s)*255 + uint32(d)*(255-a)) / 255) }
			c.img.SetRGBA(dx, dy, color.RGBA{blend(src.R, dst.R), blend(src.G, dst.G), blend(src.B, dst.B), 255})
		}
	}
}
