package pyjson

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/big"
	"strconv"
	"strings"
	"unicode"
)

// Object is a JSON object with its keys in the order they first appeared. A key given twice
// keeps its first position and its last value, as Python's json.loads builds a dict.
type Object struct {
	Keys   []string
	Values map[string]any
}

// Get returns the key's value and whether it is there.
func (o *Object) Get(k string) (any, bool) {
	v, ok := o.Values[k]
	return v, ok
}

// Set adds or replaces a key (a new key goes last).
func (o *Object) Set(k string, v any) {
	if o.Values == nil {
		o.Values = map[string]any{}
	}
	if _, ok := o.Values[k]; !ok {
		o.Keys = append(o.Keys, k)
	}
	o.Values[k] = v
}

// Int is a JSON integer (Python's int has no bound: the digits are kept).
type Int struct{ Digits string }

// MaxDepth bounds nesting (decoded values are client or model output).
const MaxDepth = 128

// ErrDepth is a value nested deeper than MaxDepth.
var ErrDepth = errors.New("JSON nested too deeply")

// Decode parses one JSON value: objects as *Object, arrays as []any, strings, bools, nil,
// integers as Int and other numbers as float64. Trailing data is an error.
func Decode(raw []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	v, err := decodeValue(dec, 0)
	if err != nil {
		return nil, err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, errors.New("trailing data after the JSON value")
	}
	return v, nil
}

func decodeValue(dec *json.Decoder, depth int) (any, error) {
	if depth > MaxDepth {
		return nil, ErrDepth
	}
	tok, err := dec.Token()
	if err != nil {
		return nil, err
	}
	switch x := tok.(type) {
	case json.Delim:
		switch x {
		case '{':
			o := &Object{Values: map[string]any{}}
			for dec.More() {
				kt, err := dec.Token()
				if err != nil {
					return nil, err
				}
				k, _ := kt.(string)
				v, err := decodeValue(dec, depth+1)
				if err != nil {
					return nil, err
				}
				o.Set(k, v)
			}
			if _, err := dec.Token(); err != nil {
				return nil, err
			}
			return o, nil
		case '[':
			list := []any{}
			for dec.More() {
				v, err := decodeValue(dec, depth+1)
				if err != nil {
					return nil, err
				}
				list = append(list, v)
			}
			if _, err := dec.Token(); err != nil {
				return nil, err
			}
			return list, nil
		}
		return nil, fmt.Errorf("unexpected %v", x)
	case json.Number:
		s := string(x)
		if !strings.ContainsAny(s, ".eE") {
			return Int{Digits: normInt(s)}, nil
		}
		f, err := strconv.ParseFloat(s, 64)
		if err != nil && !errors.Is(err, strconv.ErrRange) {
			return nil, err
		}
		return f, nil // out of range: ±Inf, as Python's float()
	default:
		return x, nil // string, bool, nil
	}
}

// normInt writes an integer literal as Python prints the int ("-0" is 0).
func normInt(s string) string {
	if s == "-0" {
		return "0"
	}
	return s
}

// Plain converts a decoded value to plain Go values (map[string]any, []any, string, bool,
// nil, int64 — float64 past int64 — and float64): for template variables, which need no key
// order.
func Plain(v any) any {
	switch x := v.(type) {
	case *Object:
		m := make(map[string]any, len(x.Keys))
		for _, k := range x.Keys {
			m[k] = Plain(x.Values[k])
		}
		return m
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			out[i] = Plain(e)
		}
		return out
	case Int:
		if n, err := strconv.ParseInt(x.Digits, 10, 64); err == nil {
			return n
		}
		f, _ := new(big.Float).SetString(x.Digits)
		g, _ := f.Float64()
		return g
	}
	return v
}

// Options of Dumps: Python's json.dumps keyword arguments the gateway needs.
type Options struct {
	// Compact: separators (",", ":") rather than the default (", ", ": ").
	Compact bool
	// SortKeys: sort_keys=True.
	SortKeys bool
	// ASCII: ensure_ascii=True (non-ASCII as \uXXXX escapes); false writes UTF-8.
	ASCII bool
}

// Dumps encodes v (a value Decode or Plain returns, or int/int64/float64) as Python's
// json.dumps(v, ensure_ascii=opt.ASCII, sort_keys=opt.SortKeys, separators=...) does.
func Dumps(v any, opt Options) string {
	var sb strings.Builder
	dump(&sb, v, opt)
	return sb.String()
}

func dump(sb *strings.Builder, v any, opt Options) {
	item, kv := ", ", ": "
	if opt.Compact {
		item, kv = ",", ":"
	}
	switch x := v.(type) {
	case nil:
		sb.WriteString("null")
	case bool:
		if x {
			sb.WriteString("true")
		} else {
			sb.WriteString("false")
		}
	case string:
		writeString(sb, x, opt.ASCII)
	case Int:
		sb.WriteString(x.Digits)
	case int:
		sb.WriteString(strconv.Itoa(x))
	case int64:
		sb.WriteString(strconv.FormatInt(x, 10))
	case float64:
		sb.WriteString(FloatRepr(x))
	case []any:
		sb.WriteByte('[')
		for i, e := range x {
			if i > 0 {
				sb.WriteString(item)
			}
			dump(sb, e, opt)
		}
		sb.WriteByte(']')
	case *Object:
		keys := x.Keys
		if opt.SortKeys {
			keys = sortedKeys(keys)
		}
		sb.WriteByte('{')
		for i, k := range keys {
			if i > 0 {
				sb.WriteString(item)
			}
			writeString(sb, k, opt.ASCII)
			sb.WriteString(kv)
			dump(sb, x.Values[k], opt)
		}
		sb.WriteByte('}')
	case map[string]any:
		keys := make([]string, 0, len(x))
		for k := range x {
			keys = append(keys, k)
		}
		o := &Object{Keys: keys, Values: x}
		if !opt.SortKeys {
			o.Keys = sortedKeys(keys) // a Go map has no order: sorted, the one stable choice
		}
		dump(sb, o, opt)
	default:
		b, _ := json.Marshal(x)
		sb.Write(b)
	}
}

// sortedKeys sorts as Python sorts str keys (by code point, which UTF-8 byte order matches).
func sortedKeys(keys []string) []string {
	out := append([]string(nil), keys...)
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && out[j] < out[j-1]; j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out
}

// FloatRepr is Python's repr(float) as json.dumps writes it: the shortest digits that round
// trip, scientific notation below 1e-4 and from 1e16, ".0" on integral values, NaN and
// Infinity as Python's json writes them.
func FloatRepr(f float64) string {
	switch {
	case math.IsNaN(f):
		return "NaN"
	case math.IsInf(f, 1):
		return "Infinity"
	case math.IsInf(f, -1):
		return "-Infinity"
	}
	s := strconv.FormatFloat(f, 'e', -1, 64) // d.ddde±XX
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	mant, expS, _ := strings.Cut(s, "e")
	exp, _ := strconv.Atoi(expS)
	digits := strings.Replace(mant, ".", "", 1)
	var out string
	if exp < -4 || exp >= 16 {
		m := digits[:1]
		if len(digits) > 1 {
			m += "." + digits[1:]
		}
		sign := "+"
		if exp < 0 {
			sign, exp = "-", -exp
		}
		out = fmt.Sprintf("%se%s%02d", m, sign, exp)
	} else if exp >= 0 {
		if len(digits) <= exp+1 {
			out = digits + strings.Repeat("0", exp+1-len(digits)) + ".0"
		} else {
			out = digits[:exp+1] + "." + digits[exp+1:]
		}
	} else {
		out = "0." + strings.Repeat("0", -exp-1) + digits
	}
	if neg {
		out = "-" + out
	}
	return out
}

func writeString(sb *strings.Builder, s string, ascii bool) {
	sb.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			sb.WriteString(`\"`)
		case '\\':
			sb.WriteString(`\\`)
		case '\n':
			sb.WriteString(`\n`)
		case '\r':
			sb.WriteString(`\r`)
		case '\t':
			sb.WriteString(`\t`)
		case '\b':
			sb.WriteString(`\b`)
		case '\f':
			sb.WriteString(`\f`)
		default:
			switch {
			case r < 0x20:
				fmt.Fprintf(sb, `\u%04x`, r)
			case ascii && r > 0x7f:
				if r > 0xffff {
					r -= 0x10000
					fmt.Fprintf(sb, `\u%04x\u%04x`, 0xd800+(r>>10), 0xdc00+(r&0x3ff))
				} else {
					fmt.Fprintf(sb, `\u%04x`, r)
				}
			default:
				sb.WriteRune(r)
			}
		}
	}
	sb.WriteByte('"')
}

// Strip is Python's str.strip(): Unicode whitespace and the separators \x1c-\x1f.
func Strip(s string) string {
	return strings.TrimFunc(s, func(r rune) bool { return unicode.IsSpace(r) || (r >= 0x1c && r <= 0x1f) })
}

// Truthy is Python's bool() of a decoded value (Decode's types): false for None, False, "", a
// zero number, an empty list or object.
func Truthy(v any) bool {
	switch x := v.(type) {
	case nil:
		return false
	case bool:
		return x
	case string:
		return x != ""
	case Int:
		return strings.Trim(strings.TrimPrefix(x.Digits, "-"), "0") != ""
	case float64:
		return x != 0
	case []any:
		return len(x) > 0
	case *Object:
		return len(x.Keys) > 0
	}
	return true
}
