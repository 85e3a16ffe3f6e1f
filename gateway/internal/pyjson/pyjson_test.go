package pyjson

import (
	"math"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestFloatRepr: the expected strings are CPython 3.11's json.dumps of the same floats.
func TestFloatRepr(t *testing.T) {
	for _, c := range []struct {
		f    float64
		want string
	}{
		{0.1, "0.1"}, {1.0, "1.0"}, {math.Copysign(0, -1), "-0.0"}, {1e16, "1e+16"}, {1e15, "1000000000000000.0"},
		{123456789012345678.0, "1.2345678901234568e+17"}, {1e-4, "0.0001"}, {1e-5, "1e-05"}, {1.5e-7, "1.5e-07"},
		{2.5, "2.5"}, {1e100, "1e+100"}, {3.141592653589793, "3.141592653589793"}, {5e-324, "5e-324"},
		{1.7976931348623157e308, "1.7976931348623157e+308"}, {100.0, "100.0"}, {0.30000000000000004, "0.30000000000000004"},
	} {
		if got := FloatRepr(c.f); got != c.want {
			t.Errorf("FloatRepr(%v) = %s, want %s", c.f, got, c.want)
		}
	}
}

// TestDumps: decoded JSON written back as CPython's json.dumps writes it (expected strings
// from CPython 3.11): key order kept (or sorted), separators, escapes, ensure_ascii.
func TestDumps(t *testing.T) {
	for _, c := range []struct {
		in   string
		opt  Options
		want string
	}{
		{`{"b":[1,"é\u2028\u007f\u0001\"\\\n"],"a":null,"c":{"z":true}}`, Options{}, "{\"b\": [1, \"é\u2028\u007f\\u0001\\\"\\\\\\n\"], \"a\": null, \"c\": {\"z\": true}}"},
		{`{"b":[1,"é😀"],"a":null}`, Options{ASCII: true, SortKeys: true, Compact: true}, `{"a":null,"b":[1,"\u00e9\ud83d\ude00"]}`},
		{`{"a":1,"a":2,"b":-0,"c":1E2,"d":123456789012345678901234567890}`, Options{Compact: true}, `{"a":2,"b":0,"c":100.0,"d":123456789012345678901234567890}`},
		{`[]`, Options{}, `[]`},
		{`{}`, Options{}, `{}`},
	} {
		v, err := Decode([]byte(c.in))
		if err != nil {
			t.Fatalf("%s: %v", c.in, err)
		}
		if got := Dumps(v, c.opt); got != c.want {
			t.Errorf("Dumps(%s)\n got %s\nwant %s", c.in, got, c.want)
		}
	}
}

func TestDecodeErrors(t *testing.T) {
	deep := ""
	for range MaxDepth + 2 {
		deep += "["
	}
	for _, in := range []string{``, `{`, `[1,]`, `1 2`, `NaN`, deep} {
		if _, err := Decode([]byte(in)); err == nil {
			t.Errorf("Decode(%q): no error", in)
		}
	}
}

func TestPlain(t *testing.T) {
	v, _ := Decode([]byte(`{"i":3,"big":123456789012345678901234567890,"f":2.0,"l":[true,null,"x"]}`))
	m := Plain(v).(map[string]any)
	if m["i"] != int64(3) || m["f"] != 2.0 || m["big"] != 1.2345678901234568e+29 || len(m["l"].([]any)) != 3 {
		t.Fatalf("plain %#v", m)
	}
}

func TestTruthy(t *testing.T) {
	for _, c := range []struct {
		json string
		want bool
	}{
		{`null`, false}, {`false`, false}, {`true`, true}, {`""`, false}, {`"0"`, true},
		{`0`, false}, {`-0`, false}, {`7`, true}, {`-3`, true}, {`0.0`, false}, {`0.5`, true},
		{`[]`, false}, {`[0]`, true}, {`{}`, false}, {`{"a":null}`, true},
	} {
		v, err := Decode([]byte(c.json))
		if err != nil {
			t.Fatalf("%s: %v", c.json, err)
		}
		if got := Truthy(v); got != c.want {
			t.Errorf("Truthy(%s) = %v, want %v (Python's bool())", c.json, got, c.want)
		}
	}
}
