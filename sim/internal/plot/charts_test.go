package plot

import (
	"bytes"
	"image/png"
	"testing"
)

func TestCharts(t *testing.T) {
	tests := []struct {
		name string
		draw func(*bytes.Buffer) error
		w, h int
	}{
		{"cdf", func(b *bytes.Buffer) error {
			return TTFTCDF(b, "TTFT", []Series{{"E1", []float64{.5, 1, 2, 3}}, {"E4", []float64{.03, .04, .05, .3}}, {"empty", nil}})
		}, 1100, 84 + 3*26 + 600},
		{"cdf all empty", func(b *bytes.Buffer) error { return TTFTCDF(b, "TTFT", nil) }, 1100, 84 + 600},
		{"modes", func(b *bytes.Buffer) error {
			return ModeShares(b, "modes", []Bar{{"E1", map[string]int{"PD_FALLBACK": 10}}, {"E3", map[string]int{"DIRECT_TO_D": 90, "SEED": 5, "RESEED_PREFILL": 4, "FAILED": 1}}, {"E0", nil}})
		}, 1100, 150 + 90*3},
		{"lines", func(b *bytes.Buffer) error {
			return Lines(b, "goodput", "load", "req/s", false, []Line{{"PD", []float64{1, 2, 4}, []float64{.5, .9, .7}}, {"E4", []float64{1, 2, 4}, []float64{.5, 1, 1.6}}})
		}, 1100, 84 + 2*26 + 560},
		{"lines log", func(b *bytes.Buffer) error {
			return Lines(b, "ttft", "load", "s", true, []Line{{"PD", []float64{1, 2}, []float64{.2, 3}}, {"none", nil, nil}})
		}, 1100, 84 + 2*26 + 560},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var b bytes.Buffer
			if err := tt.draw(&b); err != nil {
				t.Fatal(err)
			}
			img, err := png.Decode(&b)
			if err != nil {
				t.Fatal(err)
			}
			if r := img.Bounds(); r.Dx() != tt.w || r.Dy() != tt.h {
				t.Fatalf("size %v", r)
			}
		})
	}
}

func TestLinesRejectsRaggedLine(t *testing.T) {
	var b bytes.Buffer
	if err := Lines(&b, "x", "x", "y", false, []Line{{"bad", []float64{1, 2}, []float64{1}}}); err == nil {
		t.Fatal("ragged line accepted")
	}
}
