package server

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
)

// Per-client admission error codes (429 with Retry-After, or 413; stable).
const (
	// CodeClientTooManyRequests: the client has --max-inflight-per-client requests in flight.
	CodeClientTooManyRequests = "client_too_many_requests"
	// CodeClientTooManyTokens: the client's requests in flight would hold more than
	// --max-inflight-tokens-per-client prompt and output tokens (KV they make the cluster hold);
	// 413 instead of 429 for one request larger than the bound by itself.
	CodeClientTooManyTokens = "client_too_many_tokens"
)

// ClientKey names the client of a request for the per-client bounds (issue 23 item 5): its API
// key — the bearer token of Authorization, else X-API-Key — as "key:" and the first 16 hex
// digits of its SHA-256 (the key itself is never kept or logged); a request without one is
// its remote host's ("host:<ip>").
func ClientKey(r *http.Request) string {
	key := ""
	if a := r.Header.Get("Authorization"); len(a) > 7 && strings.EqualFold(a[:7], "bearer ") {
		key = strings.TrimSpace(a[7:])
	}
	if key == "" {
		key = strings.TrimSpace(r.Header.Get("X-API-Key"))
	}
	if key != "" {
		h := sha256.Sum256([]byte(key))
		return "key:" + hex.EncodeToString(h[:8])
	}
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	return "host:" + host
}

type clientCtxKey struct{}

// clientState is one client's requests and tokens in flight, and the tokens of its aborted
// requests still charged to it.
type clientState struct {
	requests int
	tokens   int64
	aborted  float64   // charged tokens of aborted requests, leaking at abortLeak per second
	at       time.Time // when aborted was last brought up to date
}

// charge is what the client holds now: in flight plus what its aborted requests still charge.
func (st *clientState) charge(now time.Time, leak float64) int64 {
	if st.aborted > 0 {
		st.aborted = max(0, st.aborted-leak*now.Sub(st.at).Seconds())
	}
	st.at = now
	return st.tokens + int64(st.aborted)
}

func (st *clientState) idle() bool { return st.requests <= 0 && st.tokens <= 0 && st.aborted <= 0 }

// clients bounds what one client has in flight (Admission's part for issue 23 item 5): so that
// one tenant's burst — a thousand streams it aborts at once — cannot take every decode
// worker's KV and flush the other tenants' resident sessions.
//
// An aborted request — its client went away — keeps its tokens charged to the client, leaking
// out at abortLeak tokens per second: the KV it allocated on a full decode worker evicted other
// sessions all the same, and a client that opens streams and aborts them at once would
// otherwise have only a moment in flight each, its rate unbounded. Clients that read their
// answers are bounded by what they have in flight alone.
type clients struct {
	maxRequests int     // 0: unbounded
	maxTokens   int64   // 0: unbounded
	abortLeak   float64 // tokens per second; 0: an aborted request's tokens come back at once
	now         func() time.Time

	mu sync.Mutex
	m  map[string]*clientState

	rejected *prometheus.CounterVec
	active   prometheus.GaugeFunc
}

func newClients(maxRequests int, maxTokens int64, abortLeak float64) *clients {
	c := &clients{maxRequests: maxRequests, maxTokens: maxTokens, abortLeak: abortLeak, now: time.Now, m: map[string]*clientState{},
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_client_rejected_total",
			Help: "Requests refused 429 by the per-client bounds, by code: client_too_many_requests, client_too_many_tokens."},
			[]string{"code"})}
	c.active = prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "kvc_gateway_clients_inflight",
		Help: "Clients (API keys, or remote hosts without one) with requests in flight."},
		func() float64 { c.mu.Lock(); defer c.mu.Unlock(); return float64(len(c.m)) })
	for _, code := range []string{CodeClientTooManyRequests, CodeClientTooManyTokens} {
		c.rejected.WithLabelValues(code)
	}
	return c
}

func (c *clients) collectors() []prometheus.Collector {
	return []prometheus.Collector{c.rejected, c.active}
}

// enter admits one more request of key; leave must follow an admission.
func (c *clients) enter(key string) *api.Error {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.m[key]
	if st == nil {
		st = &clientState{}
		c.m[key] = st
	}
	if len(c.m) > maxTrackedClients {
		c.sweepLocked()
	}
	if c.maxRequests > 0 && st.requests >= c.maxRequests {
		c.rejected.WithLabelValues(CodeClientTooManyRequests).Inc()
		return &api.Error{Status: http.StatusTooManyRequests, Code: CodeClientTooManyRequests,
			Message: fmt.Sprintf("this client has %d requests in flight, the per-client limit (--max-inflight-per-client); retry later", c.maxRequests)}
	}
	st.requests++
	return nil
}

func (c *clients) leave(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.m[key]
	if st == nil {
		return
	}
	st.requests--
	st.charge(c.now(), c.abortLeak)
	if st.idle() {
		delete(c.m, key)
	}
}

// maxTrackedClients: past it, clients whose aborted charge has leaked out are swept.
const maxTrackedClients = 4096

func (c *clients) sweepLocked() {
	now := c.now()
	for k, st := range c.m {
		if st.charge(now, c.abortLeak); st.idle() {
			delete(c.m, k)
		}
	}
}

// hold takes n tokens for the client key (a request admitted by Wrap) until release; release
// with aborted set leaves them charged, leaking out at abortLeak.
func (c *clients) hold(key string, n int64) (release func(aborted bool), _ *api.Error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.m[key]
	if st == nil { // not admitted through Wrap (tests): nothing to bound
		return func(bool) {}, nil
	}
	if c.maxTokens > 0 && n > c.maxTokens { // never admitted, however long it waits
		c.rejected.WithLabelValues(CodeClientTooManyTokens).Inc()
		return func(bool) {}, &api.Error{Status: http.StatusRequestEntityTooLarge, Code: CodeClientTooManyTokens,
			Message: fmt.Sprintf("the request's %d prompt and output tokens are more than a client may hold, %d (--max-inflight-tokens-per-client)", n, c.maxTokens)}
	}
	if c.maxTokens > 0 && st.charge(c.now(), c.abortLeak)+n > c.maxTokens {
		c.rejected.WithLabelValues(CodeClientTooManyTokens).Inc()
		return func(bool) {}, &api.Error{Status: http.StatusTooManyRequests, Code: CodeClientTooManyTokens,
			Message: fmt.Sprintf("this client's requests in flight (and those it aborted lately) would hold more than %d prompt and output tokens, the per-client limit (--max-inflight-tokens-per-client); retry later", c.maxTokens)}
	}
	st.tokens += n
	var once sync.Once
	return func(aborted bool) {
		once.Do(func() {
			c.mu.Lock()
			defer c.mu.Unlock()
			st.charge(c.now(), c.abortLeak)
			st.tokens -= n
			if aborted && c.abortLeak > 0 {
				st.aborted += float64(n)
			}
			if st.idle() && c.m[key] == st {
				delete(c.m, key)
			}
		})
	}, nil
}

// clientOf is the client key Wrap put in ctx ("" when none).
func clientOf(ctx context.Context) string {
	k, _ := ctx.Value(clientCtxKey{}).(string)
	return k
}

// HoldClientTokens takes the request's prompt and output tokens from its client's bound
// (Wrap must have admitted it; a nil Admission or one without the bound admits all). release
// gives them back when the request ends.
// release's aborted says the client went away before its answer ended.
func (a *Admission) HoldClientTokens(ctx context.Context, req *api.Request) (release func(aborted bool), _ *api.Error) {
	if a == nil || a.clients == nil {
		return func(bool) {}, nil
	}
	key := clientOf(ctx)
	if key == "" {
		return func(bool) {}, nil
	}
	return a.clients.hold(key, max(0, req.InputTokens)+max(0, req.MaxTokens))
}
