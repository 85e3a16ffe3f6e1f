package config

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/pyjson"
	"github.com/kvcentric/kvcentric/gateway/internal/server"
	"github.com/kvcentric/kvcentric/gateway/internal/toolcall"
	"github.com/kvcentric/kvcentric/pkg/flagenv"
	"github.com/kvcentric/kvcentric/pkg/tlsx"
)

// HTTPTLSNames are the flags of the HTTPS front door's certificate.
var HTTPTLSNames = tlsx.Names{Cert: "http-tls-cert", Key: "http-tls-key"}

// Config is kvc-gateway's configuration.
type Config struct {
	LogLevel  string
	LogFormat string
	HTTPAddr  string
	// AdminAddr serves /metrics, /healthz and /readyz apart from the client API; "" keeps them
	// on HTTPAddr (the behaviour before the split).
	AdminAddr string
	// ShutdownGrace bounds the wait for in-flight requests (streams) at a stop; ShutdownDelay
	// keeps accepting that long after /readyz turned not ready.
	ShutdownGrace time.Duration
	ShutdownDelay time.Duration
	// Tracing: OTLP/gRPC collector (empty: none), plaintext to it, sample ratio of new traces.
	OTLPEndpoint     string
	OTLPInsecure     bool
	TraceSampleRatio float64
	ReadyFile        string
	ControlPlanes    []string
	RequestTimeout   time.Duration
	RouteTimeout     time.Duration
	CPLease          time.Duration
	ConnectTimeout   time.Duration
	WorkerRefresh    time.Duration
	// SessionTimeout is the idle timeout of the streaming sessions opened on decode workers.
	SessionTimeout time.Duration
	PrefillURLs    []Worker
	DecodeURLs     []Worker
	RequireSession bool
	// ResumeMidStream: a request whose decode worker dies after its first token continues
	// through a new decision from the tokens generated so far (server.Options).
	ResumeMidStream bool
	MaxBodyBytes    int64
	DefaultMaxTok   int64
	// Admission limits (server.AdmissionLimits).
	MaxInflightRequests  int
	MaxInflightBodyBytes int64
	AdmissionRetryAfter  time.Duration
	// Per-client bounds (server.ClientKey: API key, else remote host).
	MaxInflightPerClient int
	MaxClientTokens      int64
	ClientAbortLeak      float64
	// Tokenizer limits (server.TokenizeLimits).
	MaxTokenizeBytes         int64
	MaxRequestTokens         int
	MaxInflightTokenizeBytes int64
	MaxInflightTokens        int64
	// Tokenizer is the model's tokenizer folder (tokenizer.json + tokenizer_config.json) or
	// tokenizer.json file; "" = input tokens estimated from text length.
	Tokenizer string
	// ToolCallParser and ReasoningParser are SGLang's server arguments of the same names: the
	// chat answer's tool calls and reasoning are parsed out (toolcall package); "" = off.
	ToolCallParser  string
	ReasoningParser string
	// DefaultChatTemplateKwargs is SGLang's --default-chat-template-kwargs (a JSON object);
	// DefaultKwargs its decoded form.
	DefaultChatTemplateKwargs string
	DefaultKwargs             *pyjson.Object
	// GenerationConfig is the model's generation_config.json (SGLang's --sampling-defaults
	// model reads it from the model folder): a chat request's unset temperature, top_p, top_k,
	// min_p and repetition_penalty; "" = OpenAI's defaults. GenerationDefaults its values.
	GenerationConfig   string
	GenerationDefaults *pyjson.Object
	// KVPageSize is the cluster's KV page size for content addresses; 0 = asked from a decode
	// worker on first use.
	KVPageSize int
	// TokenizeCacheBytes bounds the per-session incremental tokenization cache; 0 = off.
	TokenizeCacheBytes int64
	// TLS is the mTLS identity (role gateway) for the control plane; none: plaintext.
	TLS tlsx.Files
	// HTTPTLS serves the HTTP front door over HTTPS; none: plain HTTP.
	HTTPTLS tlsx.Files
}

// Worker is a fail-open worker: its HTTP URL and (for prefill) its sidecar peer address, written
// on the command line as URL or URL|PEER_ADDR.
type Worker struct {
	URL      string
	PeerAddr string
}

// ErrHelp is returned when -h/--help was asked for (exit 0 after the usage text).
var ErrHelp = flag.ErrHelp

// Parse parses args (without the program name), filling unset flags from env (KVC_<UPPER_SNAKE>
// of the flag name). getenv is os.Getenv in production.
func Parse(args []string, getenv func(string) string, usage io.Writer) (*Config, error) {
	fs := flag.NewFlagSet("kvc-gateway", flag.ContinueOnError)
	fs.SetOutput(usage)
	c := &Config{}
	var cps, pre, dec string
	fs.StringVar(&c.LogLevel, "log-level", "info", "log level: debug, info, warn, error")
	fs.StringVar(&c.LogFormat, "log-format", "json", "log format: json or console")
	fs.StringVar(&c.HTTPAddr, "http-addr", "127.0.0.1:8080", "listen address of the HTTP API, /metrics, /healthz, /readyz")
	fs.StringVar(&c.AdminAddr, "admin-addr", "", "listen address of /metrics, /healthz and /readyz apart from the client API (plain HTTP; keep it off the clients' network); empty: served on --http-addr as well")
	fs.DurationVar(&c.ShutdownGrace, "shutdown-grace", 30*time.Second, "on SIGTERM: /readyz turns not ready, new connections are refused after --shutdown-delay, requests in flight (streams) get this long to finish, the rest are cut")
	fs.DurationVar(&c.ShutdownDelay, "shutdown-delay", 0, "on SIGTERM: keep accepting this long after /readyz turned not ready (a load balancer's probe interval), then close the listener")
	fs.StringVar(&c.OTLPEndpoint, "otlp-endpoint", "", "OpenTelemetry traces: OTLP/gRPC collector host:port (empty: the standard OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, _PROTOCOL ... variables, and without them no export; trace ids are still made and sent to workers as traceparent)")
	fs.BoolVar(&c.OTLPInsecure, "otlp-insecure", false, "send traces to --otlp-endpoint without TLS")
	fs.Float64Var(&c.TraceSampleRatio, "trace-sample-ratio", 1, "fraction of new traces sampled, in (0, 1]; OTEL_TRACES_SAMPLER, when set, decides instead (a client's sampled traceparent is followed)")
	fs.StringVar(&c.ReadyFile, "ready-file", "", "write a JSON ready file here once serving")
	fs.StringVar(&cps, "control-plane", "", "comma list of control plane gRPC addresses (empty: always fail-open)")
	fs.DurationVar(&c.RequestTimeout, "request-timeout", 180*time.Second, "timeout of one client request, end to end")
	fs.DurationVar(&c.RouteTimeout, "route-timeout", 2*time.Second, "how long to wait for a routing decision before failing open")
	fs.DurationVar(&c.CPLease, "cp-lease", 5*time.Second, "the control planes' --election-ttl: a control plane that answers nothing for half of it (paused, its link frozen) is left for the next")
	fs.DurationVar(&c.ConnectTimeout, "connect-timeout", 5*time.Second, "TCP connect timeout to workers")
	fs.DurationVar(&c.WorkerRefresh, "worker-refresh", 5*time.Second, "how often fail-open worker lists are refreshed from AdminService/ListWorkers")
	fs.DurationVar(&c.SessionTimeout, "session-timeout", 24*time.Hour, "idle timeout of the streaming sessions the gateway opens on decode workers (SGLang open_session timeout)")
	fs.StringVar(&pre, "prefill-urls", "", "fail-open prefill workers: comma list of URL or URL|PEER_ADDR")
	fs.StringVar(&dec, "decode-urls", "", "fail-open decode workers: comma list of URLs")
	fs.BoolVar(&c.RequireSession, "require-session", true, "reject requests without a session id (400); false serves them as single-shot plain P/D")
	fs.BoolVar(&c.ResumeMidStream, "resume-mid-stream", true, "a request whose decode worker dies after tokens were streamed continues through a new decision (the prompt extended by the tokens generated so far, the same sampling parameters, the tokens that remain) in the same client answer, once per request; needs the prompt's token ids (input_ids or --tokenizer); false: it fails with the worker's error, as SGLang's router and llm-d do (docs/gateway.md)")
	fs.Int64Var(&c.MaxBodyBytes, "max-body-bytes", 32<<20, "largest accepted request body")
	fs.Int64Var(&c.DefaultMaxTok, "default-max-tokens", 256, "max output tokens when the client names none")
	fs.IntVar(&c.MaxInflightRequests, "max-inflight-requests", 4096, "client requests in flight at once; past it requests are answered 429 too_many_requests with Retry-After")
	fs.Int64Var(&c.MaxInflightBodyBytes, "max-inflight-body-bytes", 64<<20, "request body bytes in flight at once (each request reserves its Content-Length, --max-body-bytes when undeclared, before its body is read); past it requests are answered 503 gateway_saturated with Retry-After; at least --max-body-bytes")
	fs.IntVar(&c.MaxInflightPerClient, "max-inflight-per-client", 256, "requests one client (its API key: Authorization bearer token or X-API-Key; without one, its remote host) may have in flight; past it: 429 client_too_many_requests with Retry-After; 0: unbounded")
	fs.Int64Var(&c.MaxClientTokens, "max-inflight-tokens-per-client", 1<<20, "prompt plus output tokens one client's requests in flight may hold (the KV they make the decode workers keep); past it: 429 client_too_many_tokens with Retry-After; size it below the cluster's decode KV so one tenant cannot flush the others; 0: unbounded")
	fs.Float64Var(&c.ClientAbortLeak, "client-aborted-tokens-per-second", 16384, "an aborted request's tokens (its client went away) stay charged to the client's --max-inflight-tokens-per-client, leaking out at this rate: a client that opens streams and aborts them at once cannot evict every session; 0: given back at once")
	fs.StringVar(&c.Tokenizer, "tokenizer", "", "the model's tokenizer: a folder with tokenizer.json and tokenizer_config.json (chat template), or the tokenizer.json path; exact input token counts, chat templates and page hashes of the prompt. Empty: input tokens are estimated as ⌈bytes/4⌉ (logged at start, metric kvc_gateway_tokenizer_loaded 0)")
	fs.StringVar(&c.ToolCallParser, "tool-call-parser", "", "as SGLang's --tool-call-parser (qwen25, qwen, hermes): a whole chat answer's tool calls (tool_choice auto) become message.tool_calls with finish_reason tool_calls; empty: the answer's text as generated. Streaming with tools is then a 400 unsupported_parameter")
	fs.StringVar(&c.ReasoningParser, "reasoning-parser", "", "as SGLang's --reasoning-parser (qwen3, deepseek-r1): a chat answer's reasoning block becomes message.reasoning_content (streamed: delta.reasoning_content); empty: off")
	fs.StringVar(&c.GenerationConfig, "generation-config", "", "the model's generation_config.json: its temperature, top_p, top_k, min_p and repetition_penalty are a chat request's defaults, as SGLang's --sampling-defaults model (its default) takes them from the model folder. Empty: OpenAI's defaults (SGLang's --sampling-defaults openai)")
	fs.StringVar(&c.DefaultChatTemplateKwargs, "default-chat-template-kwargs", "", `as SGLang's --default-chat-template-kwargs: a JSON object of chat template kwargs filling what a chat request leaves unset (e.g. '{"enable_thinking": false}'); its reasoning_effort stands in for a request without one. Needs --tokenizer`)
	fs.Int64Var(&c.MaxTokenizeBytes, "max-tokenize-bytes", server.DefaultMaxTokenizeBytes, "with --tokenizer: the longest text one request may have tokenized (the chat messages, then their rendering, or text); longer: 413 tokenize_too_large")
	fs.IntVar(&c.MaxRequestTokens, "max-request-tokens", server.DefaultMaxRequestTokens, "with --tokenizer: the most prompt tokens one request may have (tokenization stops there); more: 413 too_many_tokens")
	fs.Int64Var(&c.MaxInflightTokenizeBytes, "max-inflight-tokenize-bytes", server.DefaultMaxInflightTokenizeBytes, "with --tokenizer: bytes being tokenized at once (a byte costs up to ~135 bytes of allocation while it is encoded); past it: 503 tokenizer_saturated with Retry-After; at least --max-tokenize-bytes")
	fs.Int64Var(&c.MaxInflightTokens, "max-inflight-tokens", server.DefaultMaxInflightTokens, "with --tokenizer: prompt tokens held by the requests in flight (reserved as one per byte while encoding, then the prompt's count until the request ends); past it: 503 tokenizer_saturated; at least --max-request-tokens")
	fs.IntVar(&c.KVPageSize, "kv-page-size", 0, "the cluster's KV page size for the prompt's page hashes; 0: asked from a decode worker (get_model_info / get_server_info) on first use")
	fs.Int64Var(&c.TokenizeCacheBytes, "tokenize-cache-bytes", server.DefaultTokenizeCacheBytes, "bound of the incremental tokenization cache (per session the last chat prompt rendered and its ids, so the next turn encodes only what follows; docs/tokenization.md), in bytes; 0 turns it off")
	fs.DurationVar(&c.AdmissionRetryAfter, "admission-retry-after", time.Second, "Retry-After of admission refusals (whole seconds, at least 1)")
	c.TLS.Register(fs, tlsx.GRPCNames, "of this gateway (role gateway) for mutual TLS to the control plane")
	c.HTTPTLS.Register(fs, HTTPTLSNames, "of the HTTPS front door (API, /metrics, probes); with --http-tls-key serves HTTPS instead of HTTP")
	if err := flagenv.Parse(fs, args, getenv); err != nil {
		return nil, err
	}
	if err := applyLegacyEnv(fs, getenv); err != nil {
		return nil, err
	}
	c.ControlPlanes = splitList(cps)
	var err error
	if c.PrefillURLs, err = parseWorkers("prefill-urls", pre); err != nil {
		return nil, err
	}
	if c.DecodeURLs, err = parseWorkers("decode-urls", dec); err != nil {
		return nil, err
	}
	return c, c.validate()
}

// LegacyEnv maps environment variables from before a knob became a flag to the flag, read
// when neither the flag nor its own variable (flagenv.EnvName) is set.
var LegacyEnv = map[string]string{"KVC_GATEWAY_TOKENIZE_CACHE_BYTES": "tokenize-cache-bytes"}

func applyLegacyEnv(fs *flag.FlagSet, getenv func(string) string) error {
	if getenv == nil {
		return nil
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var errs []error
	for env, name := range LegacyEnv {
		v := getenv(env)
		if v == "" || given[name] || getenv(flagenv.EnvName(name)) != "" {
			continue
		}
		if err := fs.Set(name, v); err != nil {
			errs = append(errs, fmt.Errorf("%s=%q (flag --%s): %w", env, v, name, err))
		}
	}
	return errors.Join(errs...)
}

func (c *Config) validate() error {
	var errs []error
	if _, err := zerolog.ParseLevel(strings.ToLower(c.LogLevel)); err != nil || c.LogLevel == "" {
		errs = append(errs, fmt.Errorf("--log-level %q: want debug, info, warn or error", c.LogLevel))
	}
	if c.LogFormat != "json" && c.LogFormat != "console" {
		errs = append(errs, fmt.Errorf("--log-format %q: want json or console", c.LogFormat))
	}
	if c.HTTPAddr == "" {
		errs = append(errs, errors.New("--http-addr is required"))
	}
	if c.AdminAddr != "" && c.AdminAddr == c.HTTPAddr && !strings.HasSuffix(c.AdminAddr, ":0") {
		errs = append(errs, fmt.Errorf("--admin-addr %s must differ from --http-addr", c.AdminAddr))
	}
	if c.TraceSampleRatio <= 0 || c.TraceSampleRatio > 1 {
		errs = append(errs, fmt.Errorf("--trace-sample-ratio %v must be in (0, 1]", c.TraceSampleRatio))
	}
	if c.ShutdownGrace <= 0 || c.ShutdownDelay < 0 {
		errs = append(errs, fmt.Errorf("--shutdown-grace (%v) must be positive and --shutdown-delay (%v) not negative", c.ShutdownGrace, c.ShutdownDelay))
	}
	for name, d := range map[string]time.Duration{"request-timeout": c.RequestTimeout, "route-timeout": c.RouteTimeout, "cp-lease": c.CPLease, "connect-timeout": c.ConnectTimeout, "worker-refresh": c.WorkerRefresh, "session-timeout": c.SessionTimeout} {
		if d <= 0 {
			errs = append(errs, fmt.Errorf("--%s must be positive, got %v", name, d))
		}
	}
	if c.RouteTimeout > 0 && c.RequestTimeout > 0 && c.RouteTimeout >= c.RequestTimeout {
		errs = append(errs, fmt.Errorf("--route-timeout (%v) must be shorter than --request-timeout (%v)", c.RouteTimeout, c.RequestTimeout))
	}
	if err := toolcall.CheckParsers(c.ToolCallParser, c.ReasoningParser); err != nil {
		errs = append(errs, err)
	}
	if o, err := api.ParseDefaultKwargs(c.DefaultChatTemplateKwargs); err != nil {
		errs = append(errs, err)
	} else {
		c.DefaultKwargs = o
		if o != nil && c.Tokenizer == "" {
			errs = append(errs, errors.New("--default-chat-template-kwargs needs --tokenizer (the kwargs reach the model only through the chat template the gateway renders)"))
		}
	}
	if c.GenerationConfig != "" {
		raw, err := os.ReadFile(c.GenerationConfig)
		if err == nil {
			c.GenerationDefaults, err = api.ParseGenerationConfig(raw)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("--generation-config: %w", err))
		}
	}
	if c.MaxBodyBytes < 1024 {
		errs = append(errs, fmt.Errorf("--max-body-bytes must be at least 1024, got %d", c.MaxBodyBytes))
	}
	if c.DefaultMaxTok < 1 || c.DefaultMaxTok > 1_000_000 {
		errs = append(errs, fmt.Errorf("--default-max-tokens must be in [1, 1000000], got %d", c.DefaultMaxTok))
	}
	if c.MaxInflightRequests < 1 || c.MaxInflightRequests > 1_000_000 {
		errs = append(errs, fmt.Errorf("--max-inflight-requests must be in [1, 1000000], got %d", c.MaxInflightRequests))
	}
	if c.MaxInflightBodyBytes < c.MaxBodyBytes {
		errs = append(errs, fmt.Errorf("--max-inflight-body-bytes (%d) must be at least --max-body-bytes (%d)", c.MaxInflightBodyBytes, c.MaxBodyBytes))
	}
	if c.MaxInflightPerClient < 0 {
		errs = append(errs, fmt.Errorf("--max-inflight-per-client must not be negative, got %d", c.MaxInflightPerClient))
	}
	if c.MaxClientTokens < 0 {
		errs = append(errs, fmt.Errorf("--max-inflight-tokens-per-client must not be negative, got %d", c.MaxClientTokens))
	}
	if c.ClientAbortLeak < 0 {
		errs = append(errs, fmt.Errorf("--client-aborted-tokens-per-second must not be negative, got %v", c.ClientAbortLeak))
	}
	if err := c.TokenizeLimits().Check(); err != nil {
		errs = append(errs, err)
	}
	if c.TokenizeCacheBytes < 0 {
		errs = append(errs, fmt.Errorf("--tokenize-cache-bytes must not be negative (0 turns the cache off), got %d", c.TokenizeCacheBytes))
	}
	if c.KVPageSize < 0 || c.KVPageSize > 4096 {
		errs = append(errs, fmt.Errorf("--kv-page-size must be in [0, 4096], got %d", c.KVPageSize))
	}
	if c.AdmissionRetryAfter < 0 || c.AdmissionRetryAfter > time.Hour {
		errs = append(errs, fmt.Errorf("--admission-retry-after must be in [0, 1h], got %v", c.AdmissionRetryAfter))
	}
	// Plaintext gRPC must be chosen (--insecure) when the gateway dials gRPC at all: the control
	// plane, or prefill sidecars' peer addresses.
	if err := c.TLS.Check(tlsx.GRPCNames); err != nil && (c.dialsGRPC() || c.TLS.Enabled() || c.TLS.Insecure) {
		errs = append(errs, err)
	}
	if err := c.HTTPTLS.Check(HTTPTLSNames); err != nil {
		errs = append(errs, err)
	}
	if len(c.ControlPlanes) == 0 && (len(c.PrefillURLs) == 0 || len(c.DecodeURLs) == 0) {
		errs = append(errs, errors.New("give --control-plane, or both --prefill-urls and --decode-urls"))
	}
	return errors.Join(errs...)
}

// AdmissionLimits are the admission flags as the server takes them.
func (c *Config) AdmissionLimits() server.AdmissionLimits {
	return server.AdmissionLimits{MaxInflight: c.MaxInflightRequests, MaxInflightBodyBytes: c.MaxInflightBodyBytes,
		MaxBodyBytes: c.MaxBodyBytes, RetryAfter: c.AdmissionRetryAfter,
		MaxInflightPerClient: c.MaxInflightPerClient, MaxClientTokens: c.MaxClientTokens, ClientAbortLeak: c.ClientAbortLeak}
}

// TokenizeLimits are the tokenizer flags as the server takes them.
func (c *Config) TokenizeLimits() server.TokenizeLimits {
	return server.TokenizeLimits{MaxBytes: c.MaxTokenizeBytes, MaxTokens: c.MaxRequestTokens,
		MaxInflightBytes: c.MaxInflightTokenizeBytes, MaxInflightTokens: c.MaxInflightTokens, RetryAfter: c.AdmissionRetryAfter}
}

// dialsGRPC reports whether the gateway dials any gRPC server.
func (c *Config) dialsGRPC() bool {
	if len(c.ControlPlanes) > 0 {
		return true
	}
	for _, w := range c.PrefillURLs {
		if w.PeerAddr != "" {
			return true
		}
	}
	return false
}

func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

func parseWorkers(flagName, s string) ([]Worker, error) {
	var out []Worker
	for _, item := range splitList(s) {
		u, peer, _ := strings.Cut(item, "|")
		pu, err := url.Parse(u)
		if err != nil || (pu.Scheme != "http" && pu.Scheme != "https") || pu.Host == "" {
			return nil, fmt.Errorf("--%s: %q is not an http(s) URL", flagName, u)
		}
		out = append(out, Worker{URL: strings.TrimRight(u, "/"), PeerAddr: peer})
	}
	return out, nil
}

// Getenv is os.Getenv (handy for callers).
var Getenv = os.Getenv
