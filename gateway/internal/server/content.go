package server

import (
	"context"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"sync"
	"time"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/pkg/pagehash"
	"github.com/kvcentric/kvcentric/pkg/tokenizer"
)

// Content is the gateway's view of a prompt's content (issue 13): the model's tokenizer and
// chat template (exact input token counts, the rendered prompt sent as input_ids), and the
// chained page hashes of the prompt's ids sent with the Route query, so the control plane
// reuses resident or snapshot KV only up to the prefix that really matches.
type Content struct {
	// Tok is the model's tokenizer; nil: input tokens are estimated (⌈bytes/4⌉) and chat
	// messages rendered as "role: content" lines, as before.
	Tok *tokenizer.Tokenizer
	// PageSize is the cluster's KV page size; 0: asked from a decode worker (kvc-sim's
	// /get_model_info or SGLang's /get_server_info "page_size") on first use.
	PageSize int
	// Key is the page-hash key (0 when the cluster has no secret; docs/tokenization.md).
	Key uint64
	// TokenizeCacheBytes bounds the per-session incremental tokenization cache (tokcache.go):
	// > 0 bytes, < 0 off, 0 = DefaultTokenizeCacheBytes (the gateway's --tokenize-cache-bytes
	// sets it).
	TokenizeCacheBytes int64
	// Limits bound the tokenizer's work (tokenize.go); nil: DefaultTokenizeLimits.
	Limits *TokenizeLimits

	mu       sync.Mutex
	hasher   *pagehash.Hasher
	lastTry  time.Time
	discover func(ctx context.Context) int // tests replace it

	cacheOnce sync.Once
	cache     *tokCache

	gateOnce sync.Once
	gate     *tokGate
}

// tokGate is the tokenizer's admission (tokenize.go), made on first use with the server's
// metrics registry.
func (s *Server) tokGate() *tokGate {
	c := s.opt.Content
	c.gateOnce.Do(func() {
		lim := DefaultTokenizeLimits()
		if c.Limits != nil {
			lim = *c.Limits
		}
		g, err := newTokGate(lim, s.m.reg)
		if err != nil { // checked by the flags; unregistered metrics rather than none at all
			s.log.Error().Err(err).Msg("tokenizer limits: defaults used")
			g, _ = newTokGate(DefaultTokenizeLimits(), nil)
		}
		c.gate = g
	})
	return c.gate
}

// tokCache is the incremental tokenization cache, made on first use; nil when off.
func (s *Server) tokCache() *tokCache {
	c := s.opt.Content
	c.cacheOnce.Do(func() {
		n := tokCacheBytes(c.TokenizeCacheBytes)
		c.cache = newTokCache(n)
		if c.cache != nil {
			s.log.Info().Int64("max_bytes", n).Msg("incremental tokenization: a session's next turn encodes only what follows its last prompt's longest shared cut")
			if c.Tok != nil && c.Tok.HasChatTemplate() {
				// The template's check (sample conversations rendered both ways) runs once, here.
				if ok, why := c.Tok.ChatIncremental(); ok {
					s.log.Info().Msg("incremental chat rendering: a session's next turn renders only the messages from its last user message on")
				} else {
					s.log.Info().Str("reason", why).Msg("incremental chat rendering off for this chat template: every turn renders the whole conversation")
				}
			}
		}
	})
	return c.cache
}

// renderPath is the chat_renders label of a rendering: "incremental" when it reused the
// session's last one, else "full".
func renderPath(r *tokenizer.ChatRender) string {
	if r.Reused > 0 {
		return "incremental"
	}
	return "full"
}

// discoverEvery bounds how often the page size is asked for while no decode worker answers.
const discoverEvery = 5 * time.Second

// pageHasher is the hasher for the cluster's page size, or nil while it is unknown.
func (s *Server) pageHasher(ctx context.Context) *pagehash.Hasher {
	c := s.opt.Content
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.hasher != nil {
		return c.hasher
	}
	ps := c.PageSize
	if ps <= 0 {
		if time.Since(c.lastTry) < discoverEvery {
			return nil
		}
		c.lastTry = time.Now()
		d := c.discover
		if d == nil {
			d = s.discoverPageSize
		}
		ps = d(ctx)
	}
	if ps <= 0 {
		return nil
	}
	h, err := pagehash.New(ps, c.Key)
	if err != nil {
		s.log.Warn().Err(err).Int("page_size", ps).Msg("no content addresses")
		return nil
	}
	c.hasher = h
	s.m.PageSize.Set(float64(ps))
	s.log.Info().Int("page_size", ps).Msg("content addresses: chained page hashes of the prompt go with every Route query")
	return h
}

// discoverPageSize asks a decode worker for the KV page size: kvc-sim's /get_model_info, then
// SGLang's /get_server_info (server args). 0 when none answers in time.
func (s *Server) discoverPageSize(ctx context.Context) int {
	dec, ok := s.pool.PickDecode()
	if !ok || dec.URL == "" {
		return 0
	}
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	for _, path := range []string{"/get_model_info", "/get_server_info"} {
		hr, err := http.NewRequestWithContext(ctx, http.MethodGet, dec.URL+path, nil)
		if err != nil {
			return 0
		}
		resp, err := s.hc.Do(hr)
		if err != nil {
			continue
		}
		var v struct {
			PageSize int `json:"page_size"`
		}
		err = json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&v)
		resp.Body.Close()
		if err == nil && resp.StatusCode == http.StatusOK && v.PageSize > 0 {
			return v.PageSize
		}
	}
	return 0
}

// prepare tokenizes the request with the model's tokenizer when the gateway has one (chat:
// the chat template rendered, then encoded; text: encoded with the model's special tokens) and
// computes the prompt's page chain when its ids are known. The worker then gets input_ids.
// Tokenization is bounded (tokenize.go: bytes and tokens per request and in flight) and stops
// when ctx ends; release gives back the prompt tokens the request holds: call it when the
// request ends.
func (s *Server) prepare(ctx context.Context, req *api.Request) (release func(), _ *api.Error) {
	release = func() {}
	c := s.opt.Content
	var tok *tokenizer.Tokenizer
	if c != nil {
		tok = c.Tok
	}
	if req.Kind == api.Chat && req.Tools.Template() && (tok == nil || !tok.HasChatTemplate()) {
		// The tools and template kwargs reach the model only through the chat template, which
		// only the gateway's tokenizer renders (the worker gets input_ids): refused rather than
		// served without them.
		return release, &api.Error{Status: http.StatusBadRequest, Code: api.CodeUnsupportedParameter,
			Message: "tools, chat_template_kwargs and reasoning_effort need the gateway's --tokenizer with the model's chat template"}
	}
	if tok != nil && len(req.InputIDs) == 0 {
		t0 := time.Now()
		var ids []uint32
		g := s.tokGate()
		switch {
		case req.Kind == api.Chat:
			if e := g.tooLarge(messageBytes(req)); e != nil {
				return release, e // not even rendered
			}
			opts := tokenizer.ChatOptions{AddGenerationPrompt: true}
			if req.Tools != nil {
				// The tools and template kwargs as SGLang passes them to apply_chat_template
				// (api/chattools.go), so the prompt — and the KV a SGLang worker caches for it —
				// is SGLang's.
				opts.ToolsJSON, opts.Vars = req.Tools.ToolsJSON, req.Tools.Vars
				if req.Tools.HasTools() {
					s.m.ToolRequests.WithLabelValues(req.Tools.Choice).Inc()
				}
			}
			// The rendering holds its special tokens as text. With the cache, the template renders
			// only the messages from the session's last user message on when the history before
			// it is unchanged (exactly ApplyChatTemplate: tokenizer.RenderChat), and only what
			// follows the longest cut this rendering shares with the session's last one is
			// encoded (exactly Encode(text, false): tokenizer.EncodeReuse). Encoding is bounded
			// and stops with ctx (tokenize.go).
			var e *api.Error
			if cache := s.tokCache(); cache != nil && req.SessionID != "" {
				prevEnc, prevChat := cache.getTurn(req.SessionID)
				r, err := tok.RenderChat(req.Messages, opts, prevChat)
				if err != nil {
					return release, api.BadRequest("chat template: %v", err)
				}
				s.m.ChatRenders.WithLabelValues(renderPath(r)).Inc()
				var enc *tokenizer.Encoded
				if ids, enc, release, e = g.encode(ctx, tok, r.Text, false, true, prevEnc); e != nil {
					return release, e
				}
				cache.putTurn(req.SessionID, enc, r)
			} else {
				text, err := tok.ApplyChatTemplate(req.Messages, opts)
				if err != nil {
					return release, api.BadRequest("chat template: %v", err)
				}
				if ids, _, release, e = g.encode(ctx, tok, text, false, false, nil); e != nil {
					return release, e
				}
			}
		case req.Text != "":
			var e *api.Error
			if ids, _, release, e = g.encode(ctx, tok, req.Text, true, false, nil); e != nil {
				return release, e
			}
		}
		s.m.TokenizeSeconds.Observe(time.Since(t0).Seconds())
		if len(ids) > 0 {
			req.InputIDs = make([]int64, len(ids))
			for i, id := range ids {
				req.InputIDs[i] = int64(id)
			}
			req.Text = ""
			if req.Estimated {
				req.InputTokens, req.Estimated = int64(len(ids)), false
				if req.InputTokens > api.MaxInputTokens {
					return release, api.BadRequest("input tokens %d out of range [1, %d]", req.InputTokens, api.MaxInputTokens)
				}
			}
		}
	}
	if req.Estimated {
		s.m.EstimatedInputs.Inc()
	}
	if len(req.InputIDs) == 0 || int64(len(req.InputIDs)) != req.InputTokens {
		return release, nil // no ids, or a client count that is not theirs: lengths alone
	}
	h := s.pageHasher(ctx)
	if h == nil {
		return release, nil
	}
	ids := make([]uint32, len(req.InputIDs))
	for i, v := range req.InputIDs {
		if v < 0 || v > math.MaxUint32 {
			return release, nil // not token ids of any vocabulary: no content address
		}
		ids[i] = uint32(v)
	}
	req.ContentIDs = ids
	req.PromptPages = h.Chain(ids)
	req.PageSize = h.PageSize()
	return release, nil
}

// outcomePages is the chain of the KV the decode worker holds after a successful turn, past
// the prompt's full pages (RouteOutcome.kv_pages): the prompt's ids then the generated ids,
// as far as the ids the gateway saw reach and, when the worker reported its KV length (kvLen >
// 0), up to ⌊kvLen / page⌋ pages.
func (s *Server) outcomePages(req *api.Request, out []int64, kvLen int64) []uint64 {
	c := s.opt.Content
	if c == nil || req.PageSize <= 0 || len(req.ContentIDs) == 0 {
		return nil
	}
	c.mu.Lock()
	h := c.hasher
	c.mu.Unlock()
	if h == nil {
		return nil
	}
	ps := int64(req.PageSize)
	from := int64(len(req.PromptPages)) * ps
	end := int64(len(req.ContentIDs)) + int64(len(out))
	if kvLen > 0 {
		end = min(end, kvLen)
	}
	end = end / ps * ps
	if end <= from {
		return nil
	}
	tail := make([]uint32, 0, end-from)
	for t := from; t < end; t++ {
		if t < int64(len(req.ContentIDs)) {
			tail = append(tail, req.ContentIDs[t])
			continue
		}
		v := out[t-int64(len(req.ContentIDs))]
		if v < 0 || v > math.MaxUint32 {
			break
		}
		tail = append(tail, uint32(v))
	}
	prev := h.Root()
	if n := len(req.PromptPages); n > 0 {
		prev = req.PromptPages[n-1]
	}
	return h.AppendChain(nil, prev, tail)
}
