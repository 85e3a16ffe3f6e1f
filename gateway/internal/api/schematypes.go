package api

import (
	"strings"

	"github.com/kvcentric/kvcentric/gateway/internal/pyjson"
)

// The JSON Schema rewrite SGLang 0.5.23 applies to tool parameters before it renders them
// (function_call/utils.py normalize_json_schema_types, from _validate_request): database-style
// type names become JSON Schema types, in place, so the model sees "string" for "varchar".

var standardSchemaTypes = map[string]bool{"null": true, "boolean": true, "object": true, "array": true, "number": true, "string": true, "integer": true}

var schemaTypeAliases = map[string]string{
	"str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string", "uuid": "string",
	"date": "string", "datetime": "string", "time": "string", "timestamp": "string", "binary": "string",
	"blob": "string", "bytea": "string", "bytes": "string", "varbinary": "string",
	"bool": "boolean", "bigint": "integer", "smallint": "integer", "tinyint": "integer",
	"double": "number", "decimal": "number", "real": "number", "numeric": "number",
	"arr": "array", "tuple": "array", "set": "array", "map": "object",
}

var schemaTypePrefixes = []struct {
	prefixes []string
	target   string
}{
	{[]string{"int", "uint", "long", "short", "unsigned"}, "integer"},
	{[]string{"num", "float"}, "number"},
	{[]string{"list"}, "array"},
	{[]string{"dict"}, "object"},
}

// normalizeSchemaTypes rewrites v's "type" values as SGLang does, walking the same keywords.
func normalizeSchemaTypes(v any, depth int) {
	if depth > pyjson.MaxDepth {
		return
	}
	switch x := v.(type) {
	case []any:
		for _, e := range x {
			normalizeSchemaTypes(e, depth+1)
		}
		return
	case *pyjson.Object:
		if t, ok := x.Values["type"]; ok {
			switch tt := t.(type) {
			case string:
				x.Values["type"] = normalizeSchemaType(tt)
			case []any:
				x.Values["type"] = normalizeSchemaTypeList(tt)
			}
		}
		for _, k := range []string{"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"} {
			if o, ok := x.Values[k].(*pyjson.Object); ok {
				for _, kk := range o.Keys {
					normalizeSchemaTypes(o.Values[kk], depth+1)
				}
			}
		}
		for _, k := range []string{"anyOf", "oneOf", "allOf", "prefixItems"} {
			if l, ok := x.Values[k].([]any); ok {
				for _, e := range l {
					normalizeSchemaTypes(e, depth+1)
				}
			}
		}
		for _, k := range []string{"items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties"} {
			if e, ok := x.Values[k]; ok {
				normalizeSchemaTypes(e, depth+1)
			}
		}
	}
}

func normalizeSchemaType(raw string) string {
	if standardSchemaTypes[raw] {
		return raw
	}
	base, _, _ := strings.Cut(raw, "(")
	base = strings.ToLower(pyjson.Strip(base))
	if standardSchemaTypes[base] {
		return base
	}
	if m, ok := schemaTypeAliases[base]; ok {
		return m
	}
	for _, r := range schemaTypePrefixes {
		for _, p := range r.prefixes {
			if base == p || (len(base) > len(p) && strings.HasPrefix(base, p) && strings.ContainsRune("0123456789[<( \t", rune(base[len(p)]))) {
				return r.target
			}
		}
	}
	return raw
}

// normalizeSchemaTypeList normalizes each entry and drops repeats (Python's `in` on a list).
func normalizeSchemaTypeList(items []any) []any {
	out := make([]any, 0, len(items))
	for _, it := range items {
		if s, ok := it.(string); ok {
			it = normalizeSchemaType(s)
		}
		dup := false
		for _, o := range out {
			dup = dup || pyEqual(o, it)
		}
		if !dup {
			out = append(out, it)
		}
	}
	return out
}

// pyEqual is Python's == on decoded JSON values (True == 1 == 1.0).
func pyEqual(a, b any) bool {
	an, aok := pyNumber(a)
	bn, bok := pyNumber(b)
	if aok || bok {
		return aok && bok && an == bn
	}
	return pyjson.Dumps(a, pyjson.Options{SortKeys: true}) == pyjson.Dumps(b, pyjson.Options{SortKeys: true})
}

func pyNumber(v any) (float64, bool) {
	switch x := v.(type) {
	case bool:
		if x {
			return 1, true
		}
		return 0, true
	case pyjson.Int, float64:
		f, ok := pyjson.Plain(x).(float64)
		if !ok {
			f = float64(pyjson.Plain(x).(int64))
		}
		return f, true
	}
	return 0, false
}
