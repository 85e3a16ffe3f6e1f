package api

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"math/big"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/kvcentric/kvcentric/gateway/internal/pyjson"
)

// samplingFields are the OpenAI and SGLang sampling fields of a chat or completions request
// (slices of the body: decoded one by one, each small).
type samplingFields struct {
	TopP              rawField `json:"top_p"`
	TopK              rawField `json:"top_k"`
	MinP              rawField `json:"min_p"`
	MinTokens         rawField `json:"min_tokens"`
	Stop              rawField `json:"stop"`
	StopTokenIDs      rawField `json:"stop_token_ids"`
	StopRegex         rawField `json:"stop_regex"`
	Seed              rawField `json:"seed"`
	PresencePenalty   rawField `json:"presence_penalty"`
	FrequencyPenalty  rawField `json:"frequency_penalty"`
	RepetitionPenalty rawField `json:"repetition_penalty"`
	Regex             rawField `json:"regex"`
	Ebnf              rawField `json:"ebnf"`
	JSONSchema        rawField `json:"json_schema"`
	NoStopTrim        rawField `json:"no_stop_trim"`
	IgnoreEOS         rawField `json:"ignore_eos"`
	SkipSpecialTokens rawField `json:"skip_special_tokens"`
	LogitBias         rawField `json:"logit_bias"`
	CustomParams      rawField `json:"custom_params"`
	Watermark         rawField `json:"watermark"`
	ResponseFormat    rawField `json:"response_format"`
	Logprobs          rawField `json:"logprobs"`
	Echo              rawField `json:"echo"`
	ReturnLogprob     rawField `json:"return_logprob"`
}

// Value kinds of a sampling field, with pydantic's coercions where the gateway follows them (an
// integral float is an int, an int is a float); a string or a bool where a number is meant,
// which pydantic would coerce, is refused (invalid_parameter) rather than guessed at.
type sampKind int

const (
	kFloat sampKind = iota
	kInt
	kBool
	kStr
	kStrList   // str or list of str (stop, stop_regex)
	kIntList   // list of int (stop_token_ids)
	kFloatDict // dict of str to float (logit_bias)
	kDict      // any object (custom_params)
)

// sampSpec is one key of SGLang's sampling_params dict: where it comes from in the request and
// its default when the request leaves it out (nil: None).
type sampSpec struct {
	out, in string
	kind    sampKind
	// optional: the request model's field is Optional (null is None: the default); otherwise a
	// null is pydantic's 400.
	optional bool
	def      any
}

// The keys of ChatCompletionRequest.to_sampling_params and of OpenAIServingCompletion
// ._build_sampling_params (SGLang 0.5.23), in their order; max_new_tokens, n and
// spaces_between_special_tokens are filled by the builder.
var (
	chatSampling = []sampSpec{
		{"temperature", "temperature", kFloat, true, 1.0}, {"max_new_tokens", "", 0, false, nil},
		{"min_new_tokens", "min_tokens", kInt, false, int64(0)}, {"stop", "stop", kStrList, true, nil},
		{"stop_token_ids", "stop_token_ids", kIntList, true, nil}, {"stop_regex", "stop_regex", kStrList, true, nil},
		{"top_p", "top_p", kFloat, true, 1.0}, {"top_k", "top_k", kInt, true, int64(-1)},
		{"min_p", "min_p", kFloat, true, 0.0}, {"presence_penalty", "presence_penalty", kFloat, false, 0.0},
		{"frequency_penalty", "frequency_penalty", kFloat, false, 0.0},
		{"repetition_penalty", "repetition_penalty", kFloat, true, 1.0}, {"regex", "regex", kStr, true, nil},
		{"ebnf", "ebnf", kStr, true, nil}, {"n", "", 0, false, nil},
		{"no_stop_trim", "no_stop_trim", kBool, false, false}, {"ignore_eos", "ignore_eos", kBool, false, false},
		{"skip_special_tokens", "skip_special_tokens", kBool, false, true},
		{"logit_bias", "logit_bias", kFloatDict, true, nil}, {"custom_params", "custom_params", kDict, true, nil},
		{"sampling_seed", "seed", kInt, true, nil}, {"spaces_between_special_tokens", "", 0, false, nil},
		{"watermark", "watermark", kDict, true, nil},
	}
	completionSampling = []sampSpec{
		{"temperature", "temperature", kFloat, false, 1.0}, {"max_new_tokens", "", 0, false, nil},
		{"min_new_tokens", "min_tokens", kInt, false, int64(0)}, {"stop", "stop", kStrList, true, nil},
		{"stop_token_ids", "stop_token_ids", kIntList, true, nil}, {"stop_regex", "stop_regex", kStrList, true, nil},
		{"top_p", "top_p", kFloat, false, 1.0}, {"top_k", "top_k", kInt, false, int64(-1)},
		{"min_p", "min_p", kFloat, false, 0.0}, {"presence_penalty", "presence_penalty", kFloat, false, 0.0},
		{"frequency_penalty", "frequency_penalty", kFloat, false, 0.0},
		{"repetition_penalty", "repetition_penalty", kFloat, false, 1.0}, {"regex", "regex", kStr, true, nil},
		{"json_schema", "json_schema", kStr, true, nil}, {"ebnf", "ebnf", kStr, true, nil}, {"n", "", 0, false, nil},
		{"no_stop_trim", "no_stop_trim", kBool, false, false}, {"ignore_eos", "ignore_eos", kBool, false, false},
		{"skip_special_tokens", "skip_special_tokens", kBool, false, true},
		{"logit_bias", "logit_bias", kFloatDict, true, nil}, {"custom_params", "custom_params", kDict, true, nil},
		{"sampling_seed", "seed", kInt, true, nil}, {"watermark", "watermark", kDict, true, nil},
	}
)

// generateKeys are SamplingParams' API fields (SGLang 0.5.23): the keys a /generate request's
// sampling_params may carry (another is SGLang's TypeError; its internal fields, such as
// is_normalized, are refused too).
var generateKeys = map[string]sampKind{
	"max_new_tokens": kInt, "stop": kStrList, "stop_token_ids": kIntList, "stop_regex": kStrList,
	"temperature": kFloat, "top_p": kFloat, "top_k": kInt, "min_p": kFloat, "frequency_penalty": kFloat,
	"presence_penalty": kFloat, "repetition_penalty": kFloat, "min_new_tokens": kInt, "n": kInt,
	"beam_width": kInt, "json_schema": kStr, "regex": kStr, "ebnf": kStr, "structural_tag": kStr,
	"ignore_eos": kBool, "skip_special_tokens": kBool, "spaces_between_special_tokens": kBool,
	"no_stop_trim": kBool, "stream_interval": kInt, "logit_bias": kFloatDict, "sampling_seed": kInt,
	"custom_params": kDict, "watermark": kDict,
}

// Bounds of SGLang's SamplingParams.normalize.
const (
	maxStopCount      = 32
	maxStopRegexLen   = 256
	maxStopRegexCount = 32
	samplingEps       = 1e-6
	// maxLogitBias bounds a logit_bias value on the OpenAI APIs, as OpenAI's reference does ("an
	// associated bias value from -100 to 100"; SGLang takes any float). A token id's upper bound
	// (the model's vocabulary) stays the worker's check: the gateway does not know it.
	maxLogitBias = 100
)

func invalidParam(format string, a ...any) *Error {
	return badRequestCode(CodeInvalidParameter, format, a...)
}

// field returns the body's raw value of a sampling field by its request name.
func (f *samplingFields) field(b *body, name string) rawField {
	switch name {
	case "temperature":
		return b.Temperature
	case "top_p":
		return f.TopP
	case "top_k":
		return f.TopK
	case "min_p":
		return f.MinP
	case "min_tokens":
		return f.MinTokens
	case "stop":
		return f.Stop
	case "stop_token_ids":
		return f.StopTokenIDs
	case "stop_regex":
		return f.StopRegex
	case "seed":
		return f.Seed
	case "presence_penalty":
		return f.PresencePenalty
	case "frequency_penalty":
		return f.FrequencyPenalty
	case "repetition_penalty":
		return f.RepetitionPenalty
	case "regex":
		return f.Regex
	case "ebnf":
		return f.Ebnf
	case "json_schema":
		return f.JSONSchema
	case "no_stop_trim":
		return f.NoStopTrim
	case "ignore_eos":
		return f.IgnoreEOS
	case "skip_special_tokens":
		return f.SkipSpecialTokens
	case "logit_bias":
		return f.LogitBias
	case "custom_params":
		return f.CustomParams
	case "watermark":
		return f.Watermark
	}
	return nil
}

// coerce checks v (a pyjson value) against kind as the request model does and returns the value
// as SGLang's dict holds it (an int field as Int, a float field as float64).
func coerce(name string, v any, kind sampKind) (any, *Error) {
	switch kind {
	case kFloat:
		switch x := v.(type) {
		case float64:
			return x, nil
		case pyjson.Int:
			f, _ := strconv.ParseFloat(x.Digits, 64)
			return f, nil
		}
		return nil, invalidParam("%s must be a number", name)
	case kInt:
		switch x := v.(type) {
		case pyjson.Int:
			return x, nil
		case float64:
			if x == math.Trunc(x) && !math.IsInf(x, 0) {
				return pyjson.Int{Digits: strconv.FormatFloat(x, 'f', 0, 64)}, nil
			}
		}
		return nil, invalidParam("%s must be an integer", name)
	case kBool:
		if _, ok := v.(bool); ok {
			return v, nil
		}
		return nil, invalidParam("%s must be a boolean", name)
	case kStr:
		if _, ok := v.(string); ok {
			return v, nil
		}
		return nil, invalidParam("%s must be a string", name)
	case kStrList:
		switch x := v.(type) {
		case string:
			return x, nil
		case []any:
			for _, e := range x {
				if _, ok := e.(string); !ok {
					return nil, invalidParam("%s must be a string or a list of strings", name)
				}
			}
			return x, nil
		}
		return nil, invalidParam("%s must be a string or a list of strings", name)
	case kIntList:
		x, ok := v.([]any)
		if !ok {
			return nil, invalidParam("%s must be a list of integers", name)
		}
		out := make([]any, len(x))
		for i, e := range x {
			c, err := coerce(name, e, kInt)
			if err != nil {
				return nil, invalidParam("%s must be a list of integers", name)
			}
			out[i] = c
		}
		return out, nil
	case kFloatDict:
		x, ok := v.(*pyjson.Object)
		if !ok {
			return nil, invalidParam("%s must be an object of numbers", name)
		}
		out := &pyjson.Object{}
		for _, k := range x.Keys {
			c, err := coerce(name, x.Values[k], kFloat)
			if err != nil {
				return nil, invalidParam("%s must be an object of numbers", name)
			}
			out.Set(k, c)
		}
		return out, nil
	case kDict:
		if _, ok := v.(*pyjson.Object); ok {
			return v, nil
		}
		return nil, invalidParam("%s must be an object", name)
	}
	return nil, invalidParam("%s: unexpected value", name)
}

func isNullRaw(f rawField) bool { return len(f) == 0 || string(bytes.TrimSpace(f)) == "null" }

// generationKeys are the generation_config.json keys SGLang's ModelConfig
// .get_default_sampling_params reads (--sampling-defaults model), in its order.
var generationKeys = []string{"repetition_penalty", "temperature", "top_k", "top_p", "min_p"}

// ParseGenerationConfig reads a model's generation_config.json (--generation-config) as SGLang's
// --sampling-defaults model reads it: its non-null repetition_penalty, temperature, top_k,
// top_p and min_p, the defaults of a chat request that leaves them unset. nil for empty input.
func ParseGenerationConfig(raw []byte) (*pyjson.Object, error) {
	if len(bytes.TrimSpace(raw)) == 0 {
		return nil, nil
	}
	v, err := pyjson.Decode(raw)
	if err != nil {
		return nil, fmt.Errorf("generation config: %w", err)
	}
	o, ok := v.(*pyjson.Object)
	if !ok {
		return nil, errors.New("generation config: not a JSON object")
	}
	out := &pyjson.Object{}
	for _, k := range generationKeys {
		x, _ := o.Get(k)
		if x == nil {
			continue
		}
		if _, isNum := num(x); !isNum {
			return nil, fmt.Errorf("generation config: %s is not a number", k)
		}
		out.Set(k, x)
	}
	return out, nil
}

// openAISampling builds a chat or completions request's sampling_params as SGLang 0.5.23's
// to_sampling_params / _build_sampling_params do, checked as SamplingParams.normalize and
// verify check them; the refusals are the parameters the gateway cannot serve as asked.
func openAISampling(kind Kind, b *body, r *Request, gen *pyjson.Object) ([]byte, *Error) {
	f := &b.samplingFields
	specs := chatSampling
	if kind == Completion {
		specs = completionSampling
		if !isNullRaw(f.Echo) && string(f.Echo) != "false" {
			return nil, badRequestCode(CodeUnsupportedParameter, "echo: the gateway does not return the prompt with the completion")
		}
	}
	if !isNullRaw(f.Logprobs) && !(kind == Chat && string(f.Logprobs) == "false") {
		return nil, badRequestCode(CodeUnsupportedParameter, "logprobs: the gateway does not return log probabilities")
	}
	if !isNullRaw(f.Watermark) {
		return nil, badRequestCode(CodeUnsupportedParameter, "watermark: not passed to the worker")
	}
	sp := &pyjson.Object{Keys: make([]string, 0, len(specs)+1), Values: make(map[string]any, len(specs)+1)}
	for _, s := range specs {
		switch s.out {
		case "max_new_tokens":
			sp.Set(s.out, r.MaxTokens)
			continue
		case "n":
			sp.Set(s.out, int64(1))
			continue
		case "spaces_between_special_tokens":
			sp.Set(s.out, spacesBetweenSpecialTokens(b))
			continue
		}
		def := s.def
		if kind == Chat && gen != nil && s.optional {
			// to_sampling_params' get_param: the request's value, else the model's
			// generation config (--generation-config), else the OpenAI default.
			if g, ok := gen.Get(s.in); ok {
				def = g
			}
		}
		raw := f.field(b, s.in)
		if len(raw) == 0 {
			sp.Set(s.out, def)
			continue
		}
		v, err := pyjson.Decode(raw)
		if err != nil {
			return nil, invalidParam("%s: %v", s.in, err)
		}
		if v == nil {
			if !s.optional {
				return nil, invalidParam("%s must not be null", s.in)
			}
			sp.Set(s.out, def)
			continue
		}
		if s.in == "logit_bias" {
			if e := checkLogitBias(v, true); e != nil {
				return nil, e
			}
		}
		c, e := coerce(s.in, v, s.kind)
		if e != nil {
			return nil, e
		}
		sp.Set(s.out, c)
	}
	if kind == Chat && r.Tools.HasTools() {
		// As serving_chat sets for a request whose model may call tools: the call markup stays
		// in the text the tool-call parser reads.
		sp.Set("skip_special_tokens", false)
	}
	if e := responseFormat(kind, f, sp, r); e != nil {
		return nil, e
	}
	if e := verifySampling(sp); e != nil {
		return nil, e
	}
	return dumpSampling(sp)
}

// spacesBetweenSpecialTokens is chat_template_kwargs' spaces_between_special_tokens (True when
// absent), as to_sampling_params reads it.
func spacesBetweenSpecialTokens(b *body) any {
	if isNullRaw(b.ChatTemplateKwargs) {
		return true
	}
	v, err := pyjson.Decode(b.ChatTemplateKwargs)
	if o, ok := v.(*pyjson.Object); err == nil && ok {
		if x, ok := o.Get("spaces_between_special_tokens"); ok {
			return x
		}
	}
	return true
}

// responseFormat adds response_format's grammar as SGLang does: json_object is the schema
// {"type": "object"}, json_schema its schema as json.dumps writes it; a structural tag is not
// served (unsupported_parameter).
func responseFormat(kind Kind, f *samplingFields, sp *pyjson.Object, r *Request) *Error {
	if isNullRaw(f.ResponseFormat) {
		return nil
	}
	v, err := pyjson.Decode(f.ResponseFormat)
	o, ok := v.(*pyjson.Object)
	if err != nil || !ok {
		return invalidParam("response_format must be an object")
	}
	t, _ := o.Get("type")
	switch t {
	case "text":
		return nil
	case "json_object":
		if kind == Chat && r.Tools.HasTools() {
			return badRequestCode(CodeUnsupportedParameter, "response_format with tools: SGLang then parses the answer as JSON, which the gateway does not do")
		}
		sp.Set("json_schema", `{"type": "object"}`)
		return nil
	case "json_schema":
	case "structural_tag":
		return badRequestCode(CodeUnsupportedParameter, "response_format structural_tag: not passed to the worker")
	default:
		return invalidParam("response_format.type must be one of text, json_object, json_schema")
	}
	if kind == Chat && r.Tools.HasTools() {
		return badRequestCode(CodeUnsupportedParameter, "response_format with tools: SGLang then parses the answer as JSON, which the gateway does not do")
	}
	js, _ := o.Get("json_schema")
	if kind == Chat && !pyjson.Truthy(js) {
		// set_json_schema: a schema at the top builds json_schema {name: its title or "Schema"}.
		if top, ok := o.Get("schema"); ok && pyjson.Truthy(top) {
			so, ok := top.(*pyjson.Object)
			if !ok {
				return invalidParam("response_format.schema must be an object")
			}
			if props, ok := so.Get("properties"); ok {
				if po, ok := props.(*pyjson.Object); ok {
					if _, has := po.Get("strict"); has {
						return badRequestCode(CodeUnsupportedParameter, "response_format.schema.properties.strict: not supported")
					}
				}
			}
			sp.Set("json_schema", pyjson.Dumps(so, pyjson.Options{ASCII: true}))
			return nil
		}
	}
	if js == nil {
		return invalidParam("schema_ is required for json_schema response format request.")
	}
	jo, ok := js.(*pyjson.Object)
	if !ok {
		return invalidParam("response_format.json_schema must be an object")
	}
	if n, ok := jo.Get("name"); !ok || func() bool { _, s := n.(string); return !s }() {
		return invalidParam("response_format.json_schema.name must be a string")
	}
	if s, ok := jo.Get("strict"); ok && s != nil {
		if _, b := s.(bool); !b {
			return invalidParam("response_format.json_schema.strict must be a boolean")
		}
	}
	schema, _ := jo.Get("schema")
	if schema == nil {
		return invalidParam("schema_ is required for json_schema response format request.")
	}
	so, ok := schema.(*pyjson.Object)
	if !ok {
		return invalidParam("response_format.json_schema.schema must be an object")
	}
	sp.Set("json_schema", pyjson.Dumps(so, pyjson.Options{ASCII: true}))
	return nil
}

// dumpSampling writes sp as json.dumps(sp, separators=(",", ":"), ensure_ascii=False); a number
// past float64's range (JSON has no Infinity) is refused.
func dumpSampling(sp *pyjson.Object) ([]byte, *Error) {
	if !finite(sp) {
		return nil, invalidParam("sampling parameters: a number is out of the float range")
	}
	return []byte(pyjson.Dumps(sp, pyjson.Options{Compact: true})), nil
}

// finite: no float in v is infinite or NaN.
func finite(v any) bool {
	switch x := v.(type) {
	case float64:
		return !math.IsInf(x, 0) && !math.IsNaN(x)
	case []any:
		for _, e := range x {
			if !finite(e) {
				return false
			}
		}
	case *pyjson.Object:
		for _, k := range x.Keys {
			if !finite(x.Values[k]) {
				return false
			}
		}
	}
	return true
}

// pyStr is Python's str() of a number as SamplingParams holds it.
func pyStr(v any) string {
	switch x := v.(type) {
	case pyjson.Int:
		return x.Digits
	case float64:
		switch {
		case math.IsInf(x, 1):
			return "inf"
		case math.IsInf(x, -1):
			return "-inf"
		case math.IsNaN(x):
			return "nan"
		}
		return pyjson.FloatRepr(x)
	case int64:
		return strconv.FormatInt(x, 10)
	}
	return fmt.Sprint(v)
}

// num is a number of the dict as a float64 (an Int past float64's range is ±Inf).
func num(v any) (float64, bool) {
	switch x := v.(type) {
	case pyjson.Int:
		f, _ := strconv.ParseFloat(x.Digits, 64)
		return f, true
	case float64:
		return x, true
	case int64:
		return float64(x), true
	}
	return 0, false
}

// getNum is the key's number, or def when it is absent or None.
func getNum(sp *pyjson.Object, k string, def float64) (float64, any) {
	v, _ := sp.Get(k)
	if v == nil {
		return def, def
	}
	f, _ := num(v)
	return f, v
}

// verifySampling checks sp as SGLang's SamplingParams(**sp) then normalize() and verify(vocab)
// do (0.5.23, sampling_params.py), with SGLang's messages.
func verifySampling(sp *pyjson.Object) *Error {
	// normalize: stop strings and regexes.
	if v, _ := sp.Get("stop"); v != nil {
		if l, ok := v.([]any); ok && len(l) > maxStopCount {
			return invalidParam("at most %d stop strings are allowed, got %d", maxStopCount, len(l))
		}
	}
	if v, _ := sp.Get("stop_regex"); v != nil {
		l, ok := v.([]any)
		if !ok {
			l = []any{v}
		}
		if len(l) > maxStopRegexCount {
			return invalidParam("at most %d stop_regex patterns are allowed, got %d", maxStopRegexCount, len(l))
		}
		for _, e := range l {
			if s, _ := e.(string); len(s) > maxStopRegexLen {
				return invalidParam("stop_regex is %d bytes, over the %d-byte limit", len(s), maxStopRegexLen)
			}
		}
	}
	// __post_init__: None is the default; a temperature below eps is greedy (top_k 1).
	temp, tempV := getNum(sp, "temperature", 1.0)
	topK, topKV := getNum(sp, "top_k", -1)
	if temp >= 0 && temp < samplingEps {
		temp, topK = 1.0, 1
	}
	if topK == -1 {
		topK = 1 << 30
	}
	if v, _ := sp.Get("beam_width"); v != nil {
		if bw, _ := num(v); bw < 1 {
			return invalidParam("beam_width must be at least 1, got %s.", pyStr(v))
		}
	}
	if math.IsInf(temp, 0) || math.IsNaN(temp) || temp < 0 {
		return invalidParam("temperature must be a non-negative finite number, got %s.", pyStr(tempV))
	}
	if p, pv := getNum(sp, "top_p", 1.0); !(p > 0 && p <= 1) {
		return invalidParam("top_p must be in (0, 1], got %s.", pyStr(pv))
	}
	if p, pv := getNum(sp, "min_p", 0.0); !(p >= 0 && p <= 1) {
		return invalidParam("min_p must be in [0, 1], got %s.", pyStr(pv))
	}
	if topK < 1 {
		return invalidParam("top_k must be -1 (disable) or at least 1, got %s.", pyStr(topKV))
	}
	if p, pv := getNum(sp, "frequency_penalty", 0.0); !(p >= -2 && p <= 2) {
		return invalidParam("frequency_penalty must be in [-2, 2], got %s.", pyStr(pv))
	}
	if p, pv := getNum(sp, "presence_penalty", 0.0); !(p >= -2 && p <= 2) {
		return invalidParam("presence_penalty must be in [-2, 2], got %s.", pyStr(pv))
	}
	if p, pv := getNum(sp, "repetition_penalty", 1.0); !(p > 0 && p <= 2) {
		return invalidParam("repetition_penalty must be in (0, 2] (1.0 = no penalty), got %s.", pyStr(pv))
	}
	minNew, minNewV := getNum(sp, "min_new_tokens", 0)
	if !(minNew >= 0) {
		return invalidParam("min_new_tokens must be in [0, max_new_tokens], got %s.", pyStr(minNewV))
	}
	if mv, _ := sp.Get("max_new_tokens"); mv != nil {
		maxNew, _ := num(mv)
		if maxNew < 0 {
			return invalidParam("max_new_tokens must be at least 0, got %s.", pyStr(mv))
		}
		if !(minNew <= maxNew) {
			return invalidParam("min_new_tokens must be in [0, max_new_tokens(%s)], got %s.", pyStr(mv), pyStr(minNewV))
		}
	}
	// logit_bias: its keys (token ids) were checked as it was read (checkLogitBias).
	if v, _ := sp.Get("sampling_seed"); v != nil {
		s, ok := v.(pyjson.Int)
		if !ok {
			return invalidParam("sampling_seed must be an integer, got %s.", pyTypeName(v))
		}
		if _, err := strconv.ParseInt(s.Digits, 10, 64); err != nil {
			return invalidParam("sampling_seed must be in [-2**63, 2**63 - 1], got %s.", s.Digits)
		}
	}
	grammars := 0
	for _, k := range []string{"json_schema", "regex", "ebnf", "structural_tag"} {
		if v, _ := sp.Get(k); pyjson.Truthy(v) {
			grammars++
		}
	}
	if grammars > 1 {
		return invalidParam("Only one of json_schema, regex, ebnf, or structural_tag can be set.")
	}
	return nil
}

// checkLogitBias checks a logit_bias object before any routing, naming the offending key: each
// key a token id (an integer as Python's int() reads it, not negative: SGLang's verify), each
// value a number — on the OpenAI APIs (openAI) in OpenAI's [-100, 100], where SGLang takes any
// float; /generate keeps SGLang's own API (no value bound). The token id's upper bound (the
// vocabulary) is the worker's check.
func checkLogitBias(v any, openAI bool) *Error {
	o, ok := v.(*pyjson.Object)
	if !ok {
		return invalidParam("logit_bias must be an object mapping token ids to biases, got %s", jsonTypeName(v))
	}
	for _, k := range o.Keys {
		id, ok := pyInt(k)
		if !ok {
			return invalidParam("logit_bias key %s is not a token id (an integer)", shownKey(k))
		}
		if id.Sign() < 0 {
			return invalidParam("logit_bias key %s is not a token id (it is negative)", shownKey(k))
		}
		val := o.Values[k]
		f, isNum := num(val)
		if !isNum {
			return invalidParam("logit_bias[%s] must be a number, got %s", shownKey(k), jsonTypeName(val))
		}
		if openAI && !(f >= -maxLogitBias && f <= maxLogitBias) {
			return invalidParam("logit_bias[%s] is %s, outside [-%d, %d]", shownKey(k), pyStr(val), maxLogitBias, maxLogitBias)
		}
	}
	return nil
}

// shownKey is a client's object key quoted for an error message, cut to 40 bytes.
func shownKey(k string) string {
	const max = 40
	if len(k) <= max {
		return strconv.Quote(k)
	}
	cut := max
	for cut > 0 && !utf8.RuneStart(k[cut]) {
		cut--
	}
	return strconv.Quote(k[:cut]) + "…"
}

// jsonTypeName names a decoded JSON value's type for an error message.
func jsonTypeName(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case bool:
		return "a boolean"
	case string:
		return "a string"
	case []any:
		return "an array"
	case *pyjson.Object:
		return "an object"
	}
	return "a number"
}

// pyInt parses s as Python's int(s) does for ASCII input: surrounding whitespace, a sign, and
// digits with single underscores between them.
func pyInt(s string) (*big.Int, bool) {
	s = pyjson.Strip(s)
	t := s
	if t != "" && (t[0] == '+' || t[0] == '-') {
		t = t[1:]
	}
	if t == "" || t[0] == '_' || t[len(t)-1] == '_' || strings.Contains(t, "__") {
		return nil, false
	}
	for i := 0; i < len(t); i++ {
		if (t[i] < '0' || t[i] > '9') && t[i] != '_' {
			return nil, false
		}
	}
	n, ok := new(big.Int).SetString(strings.ReplaceAll(s, "_", ""), 10)
	return n, ok
}

// pyStrRepr is Python's repr() of a str, for printable ASCII and common escapes (other
// characters as they are).
func pyStrRepr(s string) string {
	q := byte('\'')
	if strings.IndexByte(s, '\'') >= 0 && strings.IndexByte(s, '"') < 0 {
		q = '"'
	}
	var sb strings.Builder
	sb.WriteByte(q)
	for _, c := range s {
		switch {
		case c == rune(q) || c == '\\':
			sb.WriteByte('\\')
			sb.WriteRune(c)
		case c == '\n':
			sb.WriteString(`\n`)
		case c == '\t':
			sb.WriteString(`\t`)
		case c == '\r':
			sb.WriteString(`\r`)
		case c < 0x20 || c == 0x7f:
			fmt.Fprintf(&sb, `\x%02x`, c)
		case c == utf8.RuneError:
			sb.WriteString(`\ufffd`)
		default:
			sb.WriteRune(c)
		}
	}
	sb.WriteByte(q)
	return sb.String()
}

func pyTypeName(v any) string {
	switch v.(type) {
	case float64:
		return "float"
	case string:
		return "str"
	case bool:
		return "bool"
	case []any:
		return "list"
	case *pyjson.Object:
		return "dict"
	}
	return "int"
}

// generateSampling checks a /generate request's sampling_params as SamplingParams(**it) with
// normalize and verify would, and returns it as the worker gets it: the client's object, with
// max_new_tokens set to the gateway's count where it is absent or null (the gateway's
// --default-max-tokens standing in for SGLang's 128 or None).
func generateSampling(raw rawField, r *Request) ([]byte, *Error) {
	sp := &pyjson.Object{}
	if !isNullRaw(raw) {
		v, err := pyjson.Decode(raw)
		o, ok := v.(*pyjson.Object)
		if err != nil || !ok {
			return nil, invalidParam("sampling_params must be an object")
		}
		sp = o
	}
	for _, k := range sp.Keys {
		kind, ok := generateKeys[k]
		if !ok {
			return nil, invalidParam("Unexpected keyword argument %s", pyStrRepr(k))
		}
		v := sp.Values[k]
		if v == nil {
			continue
		}
		if k == "logit_bias" {
			if e := checkLogitBias(v, false); e != nil {
				return nil, e
			}
		}
		if !sameKind(v, kind) {
			return nil, invalidParam("sampling_params.%s: wrong type", k)
		}
	}
	if v, _ := sp.Get("beam_width"); v != nil {
		if f, _ := num(v); f > 1 {
			return nil, badRequestCode(CodeUnsupportedParameter, "sampling_params.beam_width > 1: beam search returns several sequences; one completion per request")
		}
	}
	if v, _ := sp.Get("max_new_tokens"); v == nil {
		sp.Set("max_new_tokens", r.MaxTokens)
	}
	if e := verifySampling(sp); e != nil {
		return nil, e
	}
	return dumpSampling(sp)
}

// sameKind: v (as sent, uncoerced: SamplingParams takes the dict as it is) is of kind's JSON
// type; a number field takes ints and floats (sampling_seed's check of an int is verify's).
func sameKind(v any, kind sampKind) bool {
	switch kind {
	case kFloat, kInt:
		_, ok := num(v)
		return ok
	case kBool:
		_, ok := v.(bool)
		return ok
	case kStr:
		_, ok := v.(string)
		return ok
	case kStrList:
		_, err := coerce("", v, kStrList)
		return err == nil
	case kIntList:
		_, err := coerce("", v, kIntList)
		return err == nil
	case kFloatDict:
		_, err := coerce("", v, kFloatDict)
		return err == nil
	case kDict:
		_, ok := v.(*pyjson.Object)
		return ok
	}
	return false
}
