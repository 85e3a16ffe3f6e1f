package server

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/pkg/tokenizer"
)

// Tokenizer admission error codes (stable; docs/gateway.md, docs/reliability.md).
const (
	// CodeTokenizeTooLarge (413): the text to tokenize (the rendered chat, or text) is longer
	// than --max-tokenize-bytes.
	CodeTokenizeTooLarge = "tokenize_too_large"
	// CodeTooManyTokens (413): the prompt has more than --max-request-tokens tokens.
	CodeTooManyTokens = "too_many_tokens"
	// CodeTokenizerSaturated (503, Retry-After): tokenizing this request would take the bytes
	// being tokenized past --max-inflight-tokenize-bytes, or the tokens held by requests in
	// flight past --max-inflight-tokens.
	CodeTokenizerSaturated = "tokenizer_saturated"
)

// TokenizeLimits bound the gateway's tokenizer work (issue 23 item 3): per request, the bytes
// encoded and the tokens they make; in all, the bytes being encoded at once and the tokens
// that requests in flight hold (their ids live until the request ends).
type TokenizeLimits struct {
	MaxBytes          int64         // per request (--max-tokenize-bytes)
	MaxTokens         int           // per request (--max-request-tokens)
	MaxInflightBytes  int64         // in all (--max-inflight-tokenize-bytes), >= MaxBytes
	MaxInflightTokens int64         // in all (--max-inflight-tokens), >= MaxTokens
	RetryAfter        time.Duration // Retry-After of a 503 (whole seconds, at least 1)
}

// Defaults of the tokenizer limits. A byte of pathological text (one run of letters, where the
// BPE merges one piece of megabytes) costs up to about 135 bytes of allocation while it is
// encoded, ordinary text about 15; a token held costs about 12 (int64 ids and the uint32
// content ids).
const (
	DefaultMaxTokenizeBytes         = 4 << 20
	DefaultMaxRequestTokens         = 1 << 20
	DefaultMaxInflightTokenizeBytes = 8 << 20
	DefaultMaxInflightTokens        = 8 << 20
)

// DefaultTokenizeLimits are the flags' defaults.
func DefaultTokenizeLimits() TokenizeLimits {
	return TokenizeLimits{MaxBytes: DefaultMaxTokenizeBytes, MaxTokens: DefaultMaxRequestTokens,
		MaxInflightBytes: DefaultMaxInflightTokenizeBytes, MaxInflightTokens: DefaultMaxInflightTokens, RetryAfter: time.Second}
}

// Check validates the limits (flag names in the messages).
func (l TokenizeLimits) Check() error {
	switch {
	case l.MaxBytes < 1:
		return fmt.Errorf("--max-tokenize-bytes must be positive, got %d", l.MaxBytes)
	case l.MaxTokens < 1:
		return fmt.Errorf("--max-request-tokens must be positive, got %d", l.MaxTokens)
	case l.MaxInflightBytes < l.MaxBytes:
		return fmt.Errorf("--max-inflight-tokenize-bytes (%d) must be at least --max-tokenize-bytes (%d)", l.MaxInflightBytes, l.MaxBytes)
	case l.MaxInflightTokens < int64(l.MaxTokens):
		return fmt.Errorf("--max-inflight-tokens (%d) must be at least --max-request-tokens (%d)", l.MaxInflightTokens, l.MaxTokens)
	case l.RetryAfter < 0:
		return fmt.Errorf("retry-after must not be negative, got %s", l.RetryAfter)
	}
	return nil
}

// tokGate enforces TokenizeLimits.
type tokGate struct {
	lim        TokenizeLimits
	retryAfter string

	mu     sync.Mutex
	bytes  int64 // being encoded
	tokens int64 // reserved or held by requests in flight

	gBytes, gTokens prometheus.Gauge
	rejected        *prometheus.CounterVec
	cancelled       prometheus.Counter
}

func newTokGate(lim TokenizeLimits, reg prometheus.Registerer) (*tokGate, error) {
	if err := lim.Check(); err != nil {
		return nil, err
	}
	ra := int64((lim.RetryAfter + time.Second - 1) / time.Second)
	g := &tokGate{lim: lim, retryAfter: strconv.FormatInt(max(ra, 1), 10),
		gBytes: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvc_gateway_tokenize_inflight_bytes",
			Help: "Bytes being tokenized (limit: --max-inflight-tokenize-bytes)."}),
		gTokens: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvc_gateway_tokenize_inflight_tokens",
			Help: "Prompt tokens reserved or held by requests in flight (limit: --max-inflight-tokens)."}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_tokenize_rejected_total",
			Help: "Requests refused by the tokenizer limits, by code: tokenize_too_large, too_many_tokens (413), tokenizer_saturated (503)."},
			[]string{"code"}),
		cancelled: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvc_gateway_tokenize_cancelled_total",
			Help: "Tokenizations stopped because the request ended (client gone or timed out)."}),
	}
	for _, c := range []string{CodeTokenizeTooLarge, CodeTooManyTokens, CodeTokenizerSaturated} {
		g.rejected.WithLabelValues(c)
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{g.gBytes, g.gTokens, g.rejected, g.cancelled} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return g, nil
}

func (g *tokGate) refuse(status int, code, format string, a ...any) *api.Error {
	g.rejected.WithLabelValues(code).Inc()
	return &api.Error{Status: status, Code: code, Message: fmt.Sprintf(format, a...)}
}

// tooLarge refuses a request whose text (n bytes) is over the per-request limit; called before
// the chat template is rendered (on the messages' bytes) and after (on the rendering).
func (g *tokGate) tooLarge(n int64) *api.Error {
	if n > g.lim.MaxBytes {
		return g.refuse(http.StatusRequestEntityTooLarge, CodeTokenizeTooLarge,
			"%d bytes to tokenize, more than the gateway's limit of %d (--max-tokenize-bytes)", n, g.lim.MaxBytes)
	}
	return nil
}

// acquire reserves n bytes of encoding and the most tokens they can make (one per byte plus
// the special tokens, at most MaxTokens).
func (g *tokGate) acquire(n int64) (tokens int64, e *api.Error) {
	if e := g.tooLarge(n); e != nil {
		return 0, e
	}
	tokens = min(n+16, int64(g.lim.MaxTokens))
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.bytes+n > g.lim.MaxInflightBytes {
		return 0, g.refuse(http.StatusServiceUnavailable, CodeTokenizerSaturated,
			"bytes being tokenized would exceed %d (--max-inflight-tokenize-bytes); retry later", g.lim.MaxInflightBytes)
	}
	if g.tokens+tokens > g.lim.MaxInflightTokens {
		return 0, g.refuse(http.StatusServiceUnavailable, CodeTokenizerSaturated,
			"prompt tokens held by requests in flight would exceed %d (--max-inflight-tokens); retry later", g.lim.MaxInflightTokens)
	}
	g.bytes += n
	g.tokens += tokens
	g.gBytes.Set(float64(g.bytes))
	g.gTokens.Set(float64(g.tokens))
	return tokens, nil
}

// done ends the encoding of n bytes: the token reservation becomes what the request keeps
// (held, 0 on failure) until the returned release is called.
func (g *tokGate) done(n, reserved, held int64) (release func()) {
	g.mu.Lock()
	g.bytes -= n
	g.tokens += held - reserved
	g.gBytes.Set(float64(g.bytes))
	g.gTokens.Set(float64(g.tokens))
	g.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			g.mu.Lock()
			g.tokens -= held
			g.gTokens.Set(float64(g.tokens))
			g.mu.Unlock()
		})
	}
}

// encode tokenizes text under the gate and ctx (the request's: tokenization stops when the
// client goes): with prev (the session's last encoding, incremental) when reuse is set, else
// Encode(text, addSpecial). release gives back the tokens the request holds; call it when the
// request ends (also after an error).
func (g *tokGate) encode(ctx context.Context, tok *tokenizer.Tokenizer, text string, addSpecial, reuse bool, prev *tokenizer.Encoded) (ids []uint32, enc *tokenizer.Encoded, release func(), e *api.Error) {
	n := int64(len(text))
	reserved, e := g.acquire(n)
	if e != nil {
		return nil, nil, func() {}, e
	}
	lim := tokenizer.Limit{Ctx: ctx, MaxTokens: g.lim.MaxTokens}
	var err error
	if reuse {
		enc, _, err = tok.EncodeReuseContext(lim, text, prev)
		if enc != nil {
			ids = enc.IDs
		}
	} else {
		ids, err = tok.EncodeContext(lim, text, addSpecial)
	}
	release = g.done(n, reserved, int64(len(ids)))
	var le *tokenizer.TokenLimitError
	switch {
	case err == nil:
		return ids, enc, release, nil
	case errors.As(err, &le):
		return nil, nil, release, g.refuse(http.StatusRequestEntityTooLarge, CodeTooManyTokens,
			"prompt has more than %d tokens, the gateway's limit (--max-request-tokens)", le.Limit)
	case errors.Is(err, context.DeadlineExceeded):
		g.cancelled.Inc()
		return nil, nil, release, &api.Error{Status: http.StatusGatewayTimeout, Code: "timeout", Message: "request timed out while tokenizing"}
	default:
		g.cancelled.Inc()
		return nil, nil, release, &api.Error{Status: 499, Code: "client_closed", Message: "client went away while the prompt was tokenized"}
	}
}

// messageBytes is the bytes of a chat request's messages (what the rendering holds, less the
// template's own text): a body too large to tokenize is refused before it is rendered.
func messageBytes(req *api.Request) int64 {
	var n int64
	for _, m := range req.Messages {
		n += int64(len(m.Content))
		if m.ReasoningContent != nil {
			n += int64(len(*m.ReasoningContent))
		}
		for _, tc := range m.ToolCalls {
			n += int64(len(tc.Function.Arguments))
		}
	}
	return n + req.Tools.Size()
}
