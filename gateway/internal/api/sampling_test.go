package api

import (
	"encoding/json"
	"net/http"
	"os"
	"strings"
	"testing"

	"github.com/kvcentric/kvcentric/gateway/internal/pyjson"
)

// samplingGolden is one case of testdata/sampling.json (gen_sampling.py: SGLang 0.5.23's request
// models, to_sampling_params / _build_sampling_params, and SamplingParams' normalize and verify).
type samplingGolden struct {
	Name           string `json:"name"`
	API            string `json:"api"`
	Body           string `json:"body"`
	SamplingParams string `json:"sampling_params"`
	Error          string `json:"error"`
	// ErrorKind: "value" (SGLang's ValueError: its message), "type" (SamplingParams' TypeError:
	// its message), "pydantic" (the request model refused the body: any message).
	ErrorKind string `json:"error_kind"`
	// GenerationConfig is the model's generation_config.json the server runs with
	// (--generation-config; SGLang's --sampling-defaults model), if any.
	GenerationConfig string `json:"generation_config"`
}

// gatewayRefuses are the bodies SGLang accepts that the gateway refuses (invalid_parameter, this
// message): a number or a bool as a string, which SGLang's request model coerces, rather than
// guess at; a logit_bias value outside OpenAI's [-100, 100] on the OpenAI APIs (SGLang takes any
// float).
var gatewayRefuses = map[string]string{
	"chat temperature string":          "temperature must be a number",
	"chat ignore_eos string":           "ignore_eos must be a boolean",
	"chat logit_bias above 100":        `logit_bias["10"] is 100.5, outside [-100, 100]`,
	"chat logit_bias below -100":       `logit_bias["10"] is -101, outside [-100, 100]`,
	"chat logit_bias string value":     `logit_bias["5"] must be a number, got a string`,
	"completions logit_bias above 100": `logit_bias["50256"] is 150, outside [-100, 100]`,
}

// gatewayWords are SGLang's refusals the gateway words itself (invalid_parameter, this message):
// SGLang's say "invalid literal for int() with base 10: 'x'" and "logit_bias must has keys in
// [0, N]" without naming logit_bias or with the gateway's stand-in vocabulary.
var gatewayWords = map[string]string{
	"chat logit_bias negative key": `logit_bias key "-1" is not a token id (it is negative)`,
	"chat logit_bias bad key":      `logit_bias key "x" is not a token id (an integer)`,
	"generate logit_bias bad key":  `logit_bias key "x" is not a token id (an integer)`,
}

// goldenDefaultMax is gen_sampling.py's DEFAULT_MAX: the gateway's --default-max-tokens.
const goldenDefaultMax = 256

// TestSamplingGolden: the worker's sampling_params are SGLang's, byte for byte, and SGLang's
// refusals are invalid_parameter 400s with its messages.
func TestSamplingGolden(t *testing.T) {
	raw, err := os.ReadFile("testdata/sampling.json")
	if err != nil {
		t.Fatal(err)
	}
	var cases []samplingGolden
	if err := json.Unmarshal(raw, &cases); err != nil {
		t.Fatal(err)
	}
	if len(cases) < 30 {
		t.Fatalf("%d cases", len(cases))
	}
	kinds := map[string]Kind{"chat": Chat, "completions": Completion, "generate": Generate}
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			gen, err := ParseGenerationConfig([]byte(c.GenerationConfig))
			if err != nil {
				t.Fatal(err)
			}
			r, e := Parse(kinds[c.API], http.Header{}, []byte(c.Body), Options{DefaultMaxTok: goldenDefaultMax, GenerationDefaults: gen})
			switch {
			case gatewayRefuses[c.Name] != "":
				if c.SamplingParams == "" {
					t.Fatal("SGLang refuses it: drop it from gatewayRefuses")
				}
				if e == nil || e.Code != CodeInvalidParameter || e.Message != gatewayRefuses[c.Name] {
					t.Fatalf("got %v, want invalid_parameter: %s", e, gatewayRefuses[c.Name])
				}
			case gatewayWords[c.Name] != "":
				if c.ErrorKind == "" {
					t.Fatal("SGLang accepts it: drop it from gatewayWords")
				}
				if e == nil || e.Code != CodeInvalidParameter || e.Message != gatewayWords[c.Name] {
					t.Fatalf("got %v, want invalid_parameter: %s", e, gatewayWords[c.Name])
				}
			case c.ErrorKind == "pydantic":
				if e == nil || e.Code != CodeInvalidParameter && e.Code != "bad_request" || e.Status != http.StatusBadRequest {
					t.Fatalf("SGLang refuses the body; got %v", e)
				}
			case c.ErrorKind != "":
				if e == nil || e.Code != CodeInvalidParameter || e.Message != c.Error {
					t.Fatalf("got %v, want invalid_parameter: %s", e, c.Error)
				}
			default:
				if e != nil {
					t.Fatalf("refused: %v", e)
				}
				if string(r.Sampling) != c.SamplingParams {
					t.Fatalf("sampling_params\n got %s\nwant %s", r.Sampling, c.SamplingParams)
				}
			}
		})
	}
}

// The parameters the gateway cannot serve as asked are unsupported_parameter 400s.
func TestSamplingUnsupported(t *testing.T) {
	for _, tc := range []struct {
		name string
		kind Kind
		body string
	}{
		{"chat logprobs", Chat, `{"messages":[{"role":"user","content":"x"}],"logprobs":true}`},
		{"completions logprobs", Completion, `{"prompt":"x","logprobs":0}`},
		{"completions echo", Completion, `{"prompt":"x","echo":true}`},
		{"watermark", Chat, `{"messages":[{"role":"user","content":"x"}],"watermark":{"key":"k"}}`},
		{"structural tag", Chat, `{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"structural_tag","structures":[],"triggers":[]}}`},
		{"beam search", Generate, `{"text":"x","sampling_params":{"beam_width":2}}`},
		{"n 2", Chat, `{"messages":[{"role":"user","content":"x"}],"n":2}`},
		{"lora adapter", Chat, `{"messages":[{"role":"user","content":"x"}],"lora_path":"adapter-1"}`},
		{"lora adapter on generate", Generate, `{"text":"x","lora_path":["a"]}`},
		{"custom logit processor", Generate, `{"text":"x","custom_logit_processor":"{}"}`},
		{"continue final message", Chat, `{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"y"}],"continue_final_message":true}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, e := Parse(tc.kind, http.Header{}, []byte(tc.body), Options{DefaultMaxTok: 16})
			if e == nil || e.Code != CodeUnsupportedParameter || e.Status != http.StatusBadRequest {
				t.Fatalf("got %v, want unsupported_parameter", e)
			}
		})
	}
	// What is accepted as the defaults: logprobs false, echo false.
	for _, body := range []string{`{"messages":[{"role":"user","content":"x"}],"logprobs":false}`} {
		if _, e := Parse(Chat, http.Header{}, []byte(body), Options{DefaultMaxTok: 16}); e != nil {
			t.Fatalf("%s: %v", body, e)
		}
	}
	if _, e := Parse(Chat, http.Header{}, []byte(`{"messages":[{"role":"user","content":"x"}],"lora_path":null,"custom_logit_processor":null,"continue_final_message":false}`), Options{DefaultMaxTok: 16}); e != nil {
		t.Fatal(e)
	}
	if _, e := Parse(Completion, http.Header{}, []byte(`{"prompt":"x","echo":false,"logprobs":null}`), Options{DefaultMaxTok: 16}); e != nil {
		t.Fatal(e)
	}
}

// A chat request whose model may call tools gets skip_special_tokens false, as serving_chat sets.
func TestSamplingToolsKeepSpecialTokens(t *testing.T) {
	body := `{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}]}`
	r, e := Parse(Chat, http.Header{}, []byte(body), Options{DefaultMaxTok: 16})
	if e != nil {
		t.Fatal(e)
	}
	if !strings.Contains(string(r.Sampling), `"skip_special_tokens":false`) {
		t.Fatalf("sampling_params %s", r.Sampling)
	}
}

// FuzzSampling: any body is parsed without a panic; an accepted one's sampling_params are one
// JSON object.
func FuzzSampling(f *testing.F) {
	raw, err := os.ReadFile("testdata/sampling.json")
	if err != nil {
		f.Fatal(err)
	}
	var cases []samplingGolden
	if err := json.Unmarshal(raw, &cases); err != nil {
		f.Fatal(err)
	}
	for _, c := range cases {
		f.Add(c.API == "generate", []byte(c.Body))
	}
	f.Fuzz(func(t *testing.T, generate bool, body []byte) {
		for _, k := range []Kind{Chat, Completion, Generate} {
			if (k == Generate) != generate {
				continue
			}
			r, e := Parse(k, http.Header{}, body, Options{DefaultMaxTok: 16})
			if e != nil {
				if e.Status != http.StatusBadRequest {
					t.Fatalf("status %d", e.Status)
				}
				continue
			}
			var m map[string]any
			if err := json.Unmarshal(r.Sampling, &m); err != nil {
				t.Fatalf("sampling_params %q: %v", r.Sampling, err)
			}
		}
	})
}

// ParseGenerationConfig refuses what is not a generation config.
func TestParseGenerationConfigErrors(t *testing.T) {
	for _, raw := range []string{`[1]`, `{"temperature": "hot"}`, `{`, `{"top_k": true}`} {
		if _, err := ParseGenerationConfig([]byte(raw)); err == nil {
			t.Fatalf("%s accepted", raw)
		}
	}
	o, err := ParseGenerationConfig([]byte(`{"top_p": 0.9, "eos_token_id": 2, "temperature": null, "repetition_penalty": 1.1}`))
	if err != nil || strings.Join(o.Keys, ",") != "repetition_penalty,top_p" {
		t.Fatalf("%+v, %v", o, err)
	}
}

// logit_bias is checked before any routing, each refusal an invalid_parameter 400 naming the
// offending key: keys must be token ids (integers as Python's int() reads them, not negative),
// values numbers, and on the OpenAI APIs within OpenAI's [-100, 100] (SGLang takes any float;
// /generate keeps SGLang's own API). What passes reaches the worker as SGLang's float dict.
func TestLogitBias(t *testing.T) {
	long := strings.Repeat("k", 100)
	tests := []struct {
		name, bias string
		wantErr    string // "": accepted
		wantGen    string // /generate's, when it differs ("-": accepted there)
		wantDict   string // the worker's logit_bias on the OpenAI APIs, when accepted
	}{
		{name: "in range", bias: `{"5":1,"10":-100,"7":100,"8":0.25}`, wantDict: `{"5":1.0,"10":-100.0,"7":100.0,"8":0.25}`},
		{name: "int() spellings", bias: `{" 5 ":1,"+6":2,"1_0":3}`, wantDict: `{" 5 ":1.0,"+6":2.0,"1_0":3.0}`},
		{name: "empty", bias: `{}`, wantDict: `{}`},
		{name: "null", bias: `null`, wantDict: `null`},
		{name: "above 100", bias: `{"5":1,"10":100.01}`, wantErr: `logit_bias["10"] is 100.01, outside [-100, 100]`, wantGen: "-"},
		{name: "below -100", bias: `{"3":-1000.5}`, wantErr: `logit_bias["3"] is -1000.5, outside [-100, 100]`, wantGen: "-"},
		{name: "huge int", bias: `{"3":1000000000000000000000}`, wantErr: `logit_bias["3"] is 1000000000000000000000, outside [-100, 100]`, wantGen: "-"},
		{name: "key not an integer", bias: `{"5":1,"five":2}`, wantErr: `logit_bias key "five" is not a token id (an integer)`},
		{name: "key a float", bias: `{"5.0":2}`, wantErr: `logit_bias key "5.0" is not a token id (an integer)`},
		{name: "key empty", bias: `{"":2}`, wantErr: `logit_bias key "" is not a token id (an integer)`},
		{name: "key negative", bias: `{"-3":2}`, wantErr: `logit_bias key "-3" is not a token id (it is negative)`},
		{name: "long key cut", bias: `{"` + long + `":2}`, wantErr: `logit_bias key "` + long[:40] + `"… is not a token id (an integer)`},
		{name: "value a string", bias: `{"5":"1"}`, wantErr: `logit_bias["5"] must be a number, got a string`},
		{name: "value null", bias: `{"5":null}`, wantErr: `logit_bias["5"] must be a number, got null`},
		{name: "value a boolean", bias: `{"5":true}`, wantErr: `logit_bias["5"] must be a number, got a boolean`},
		{name: "value an object", bias: `{"5":{"b":1}}`, wantErr: `logit_bias["5"] must be a number, got an object`},
		{name: "not an object", bias: `[5]`, wantErr: `logit_bias must be an object mapping token ids to biases, got an array`},
	}
	bodies := map[Kind]func(bias string) string{
		Chat: func(b string) string {
			return `{"messages":[{"role":"user","content":"x"}],"max_tokens":4,"logit_bias":` + b + `}`
		},
		Completion: func(b string) string { return `{"prompt":"x","max_tokens":4,"logit_bias":` + b + `}` },
		Generate: func(b string) string {
			return `{"text":"x","sampling_params":{"max_new_tokens":4,"logit_bias":` + b + `}}`
		},
	}
	for _, tt := range tests {
		for _, kind := range []Kind{Chat, Completion, Generate} {
			t.Run(tt.name+"/"+kind.String(), func(t *testing.T) {
				want := tt.wantErr
				if kind == Generate && tt.wantGen != "" {
					want = ""
				}
				r, e := Parse(kind, http.Header{}, []byte(bodies[kind](tt.bias)), Options{DefaultMaxTok: 16})
				if want != "" {
					if e == nil || e.Status != http.StatusBadRequest || e.Code != CodeInvalidParameter || e.Message != want {
						t.Fatalf("got %v, want 400 invalid_parameter: %s", e, want)
					}
					return
				}
				if e != nil {
					t.Fatalf("refused: %v", e)
				}
				var sp struct {
					LogitBias json.RawMessage `json:"logit_bias"`
				}
				if err := json.Unmarshal(r.Sampling, &sp); err != nil {
					t.Fatal(err)
				}
				wantDict := tt.wantDict
				if kind == Generate {
					wantDict = tt.bias // as sent
				}
				if wantDict != "" && string(sp.LogitBias) != wantDict {
					t.Fatalf("worker's logit_bias %s, want %s", sp.LogitBias, wantDict)
				}
			})
		}
	}
}

// FuzzLogitBias: any logit_bias value, on the three APIs, is parsed without a panic; a refusal is
// a 400, and one about logit_bias an invalid_parameter naming it; what the OpenAI APIs accept
// reaches the worker with token-id keys and values in [-100, 100]. Seeds: testdata/fuzz.
func FuzzLogitBias(f *testing.F) {
	for _, s := range []string{`{"5":1}`, `{"5":-100,"6":100}`, `{" 1_0 ":0.5}`, `{"x":1}`, `{"-1":1}`, `{"5":"1"}`,
		`{"5":null}`, `{"5":100.5}`, `[1]`, `null`, `{"5":1e309}`, `{"":1}`, `{"5":1,"5":200}`} {
		f.Add([]byte(s))
	}
	bodies := map[Kind]func(b []byte) string{
		Chat: func(b []byte) string {
			return `{"messages":[{"role":"user","content":"x"}],"logit_bias":` + string(b) + `}`
		},
		Completion: func(b []byte) string { return `{"prompt":"x","logit_bias":` + string(b) + `}` },
		Generate:   func(b []byte) string { return `{"text":"x","sampling_params":{"logit_bias":` + string(b) + `}}` },
	}
	f.Fuzz(func(t *testing.T, bias []byte) {
		for _, k := range []Kind{Chat, Completion, Generate} {
			r, e := Parse(k, http.Header{}, []byte(bodies[k](bias)), Options{DefaultMaxTok: 16})
			if e != nil {
				if e.Status != http.StatusBadRequest {
					t.Fatalf("%v: status %d", k, e.Status)
				}
				if strings.HasPrefix(e.Message, "logit_bias") && e.Code != CodeInvalidParameter {
					t.Fatalf("%v: %v", k, e)
				}
				continue
			}
			v, err := pyjson.Decode(r.Sampling)
			if err != nil {
				t.Fatalf("%v: sampling_params %q: %v", k, r.Sampling, err)
			}
			lb, _ := v.(*pyjson.Object).Get("logit_bias")
			o, ok := lb.(*pyjson.Object)
			if lb == nil || k == Generate {
				continue
			}
			if !ok {
				t.Fatalf("%v: logit_bias %v", k, lb)
			}
			for _, key := range o.Keys {
				id, isInt := pyInt(key)
				f, isNum := num(o.Values[key])
				if !isInt || id.Sign() < 0 || !isNum || f < -maxLogitBias || f > maxLogitBias {
					t.Fatalf("%v: accepted logit_bias[%q] = %v", k, key, o.Values[key])
				}
			}
		}
	})
}
