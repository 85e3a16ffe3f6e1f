package bench

import (
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

func TestParseShape(t *testing.T) {
	tests := []struct {
		in      string
		want    Shape
		wantErr string
	}{
		{"1P3D", Shape{Name: "1P3D", Prefill: 1, Decode: 3}, ""},
		{"2P4D", Shape{Name: "2P4D", Prefill: 2, Decode: 4}, ""},
		{" 16P16D ", Shape{Name: "16P16D", Prefill: 16, Decode: 16}, ""},
		{"2P4D@700000", Shape{Name: "2P4D@700000", Prefill: 2, Decode: 4, DecodeCapacityTokens: 700000}, ""},
		{"2P4D@700K", Shape{Name: "2P4D@700K", Prefill: 2, Decode: 4, DecodeCapacityTokens: 700000}, ""},
		{"2P4D@176k", Shape{Name: "2P4D@176k", Prefill: 2, Decode: 4, DecodeCapacityTokens: 176000}, ""},
		{"0P3D", Shape{}, "must be in [1, 16]"},
		{"1P0D", Shape{}, "must be in [1, 16]"},
		{"17P3D", Shape{}, "must be in [1, 16]"},
		{"1P99999999999999999999D", Shape{}, "must be in [1, 16]"},
		{"2P4D@10", Shape{}, "decode pool must be in"},
		{"2P4D@20000K", Shape{}, "decode pool must be in"},
		{"2P4D@99999999999999999999K", Shape{}, "decode pool must be in"},
		{"1p3d", Shape{}, "want <P>P<D>D"},
		{"3D1P", Shape{}, "want <P>P<D>D"},
		{"1P3D@", Shape{}, "want <P>P<D>D"},
		{"", Shape{}, "want <P>P<D>D"},
		{"-1P3D", Shape{}, "want <P>P<D>D"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := ParseShape(tt.in)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("ParseShape(%q) = %+v, %v; want %+v", tt.in, got, err, tt.want)
			}
		})
	}
	if _, err := ParseShapes("1P3D,2P4D,1P3D"); err == nil || !strings.Contains(err.Error(), "twice") {
		t.Fatalf("duplicate: %v", err)
	}
	if _, err := ParseShapes(" , "); err == nil {
		t.Fatal("empty list accepted")
	}
	if sh, err := ParseShapes("1P3D, 2P4D"); err != nil || len(sh) != 2 || sh[1].Decode != 4 {
		t.Fatalf("%+v %v", sh, err)
	}
}

func TestParseSweep(t *testing.T) {
	tests := []struct {
		in       string
		loads    []float64
		perShape map[string][]float64
		wantErr  string
	}{
		{"0.5,1,2", []float64{.5, 1, 2}, nil, ""},
		{"1P3D=0.5,1,2,3;2P4D=1,2,4,6;2P4D@700K=2", nil, map[string][]float64{"1P3D": {.5, 1, 2, 3}, "2P4D": {1, 2, 4, 6}, "2P4D@700K": {2}}, ""},
		{"1P3D=1;", nil, map[string][]float64{"1P3D": {1}}, ""},
		{"0", nil, nil, "want a number in (0, 100]"},
		{"-1,2", nil, nil, "want a number in (0, 100]"},
		{"101", nil, nil, "want a number in (0, 100]"},
		{"NaN", nil, nil, "want a number in (0, 100]"},
		{"x", nil, nil, "want a number in (0, 100]"},
		{"1,1", nil, nil, "given twice"},
		{"", nil, nil, "no load given"},
		{"1P3D=", nil, nil, "no load given"},
		{"1P3D=0.5;2P4D", nil, nil, "want SHAPE=LOADS"},
		{"1P3D=1;1P3D=2", nil, nil, "given twice"},
		{"9P99D=1", nil, nil, "must be in [1, 16]"},
		{"2P4D=1,200", nil, nil, "shape 2P4D: load \"200\""},
		{"1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33", nil, nil, "at most 32"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			sp, err := ParseSweep(tt.in)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(sp.Loads, tt.loads) || len(sp.PerShape) != len(tt.perShape) {
				t.Fatalf("%+v", sp)
			}
			for _, g := range sp.PerShape {
				if !slices.Equal(g.Loads, tt.perShape[g.Shape.Name]) {
					t.Errorf("%s: %v, want %v", g.Shape.Name, g.Loads, tt.perShape[g.Shape.Name])
				}
			}
		})
	}
}

func TestShapeTargets(t *testing.T) {
	for _, tt := range []struct {
		shape string
		ratio float64
	}{{"1P3D", 1.2}, {"2P6D", 1.2}, {"2P4D", 1}, {"2P4D@700K", 1}, {"1P1D", 1}} {
		sh, err := ParseShape(tt.shape)
		if err != nil {
			t.Fatal(err)
		}
		if got := ShapeTargets(sh).GoodputRatio; got != tt.ratio {
			t.Errorf("%s: goodput ratio %v, want %v", tt.shape, got, tt.ratio)
		}
	}
}

// TestScalePolicyTimers: at time scale X the control plane's policy timers are X times their
// model-time length (defaults filled in), and real speed leaves the policy alone.
func TestScalePolicyTimers(t *testing.T) {
	tests := []struct {
		name                    string
		in                      *kvcv1.Policy
		scale                   float64
		reservation, grace, stl int64 // -1: left unset
	}{
		{"real speed untouched", &kvcv1.Policy{}, 1, -1, -1, -1},
		{"zero scale untouched", &kvcv1.Policy{}, 0, -1, -1, -1},
		{"defaults scaled", &kvcv1.Policy{}, .3, 9000, 9000, -1},
		{"set values scaled", &kvcv1.Policy{ReservationTimeoutMs: proto.Int64(1000), UnreachableGraceMs: proto.Int64(0), SnapshotMaxStalenessMs: proto.Int64(5000)}, .5, 500, 0, 2500},
		{"the reservation timeout's floor", &kvcv1.Policy{ReservationTimeoutMs: proto.Int64(150)}, .1, 100, 3000, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := proto.Clone(tt.in).(*kvcv1.Policy)
			ScalePolicyTimers(p, tt.scale)
			for _, c := range []struct {
				name string
				v    *int64
				want int64
			}{{"reservation_timeout_ms", p.ReservationTimeoutMs, tt.reservation}, {"unreachable_grace_ms", p.UnreachableGraceMs, tt.grace}, {"snapshot_max_staleness_ms", p.SnapshotMaxStalenessMs, tt.stl}} {
				switch {
				case c.want == -1 && c.v != nil:
					t.Errorf("%s set to %d, want it left unset", c.name, *c.v)
				case c.want >= 0 && (c.v == nil || *c.v != c.want):
					t.Errorf("%s = %v, want %d", c.name, c.v, c.want)
				}
			}
		})
	}
	if a := SidecarTimerArgs(.3); !slices.Equal(a, []string{"--time-scale", "0.3"}) {
		t.Errorf("sidecar args %v", a)
	}
	if a := SidecarTimerArgs(1); a != nil {
		t.Errorf("real speed: %v", a)
	}
}
