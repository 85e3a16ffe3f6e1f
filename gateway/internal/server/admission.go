package server

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
)

// Admission error codes (the "code" of the JSON error; stable, clients may switch on them).
const (
	// CodeTooManyRequests (429): --max-inflight-requests requests are in flight.
	CodeTooManyRequests = "too_many_requests"
	// CodeSaturated (503): admitting this body would take the bodies in flight past
	// --max-inflight-body-bytes (the gateway's memory for request bodies is saturated).
	CodeSaturated = "gateway_saturated"
	// CodeBodyTooLarge (413): the declared Content-Length is above --max-body-bytes (the same
	// code the handler uses when an undeclared body turns out too large).
	CodeBodyTooLarge = "body_too_large"
)

// AdmissionLimits are the gateway's admission limits.
type AdmissionLimits struct {
	// MaxInflight is the most client requests in flight at once (> 0).
	MaxInflight int
	// MaxInflightBodyBytes bounds the request bodies in flight: a request reserves its
	// Content-Length (MaxBodyBytes when the length is not declared) before its body is read
	// and releases it when it finishes (>= MaxBodyBytes).
	MaxInflightBodyBytes int64
	// MaxBodyBytes is the largest body accepted (--max-body-bytes).
	MaxBodyBytes int64
	// RetryAfter is the Retry-After of a 429 or 503 (rounded up to whole seconds, at least 1).
	RetryAfter time.Duration
	// Per client (ClientKey: API key, else remote host; clients.go): requests in flight
	// (--max-inflight-per-client) and prompt plus output tokens they hold
	// (--max-inflight-tokens-per-client); 0: unbounded.
	MaxInflightPerClient int
	MaxClientTokens      int64
	// ClientAbortLeak: an aborted request's tokens stay charged to its client, leaking out at
	// this many tokens per second (--client-aborted-tokens-per-second; 0: given back at once).
	ClientAbortLeak float64
}

// Admission refuses requests past its limits before their bodies are read, so that a flood of
// large bodies or of slow requests cannot take the gateway's memory: the body bytes in flight
// stay below MaxInflightBodyBytes, whatever the clients send. A nil *Admission admits all.
type Admission struct {
	lim        AdmissionLimits
	retryAfter string

	mu        sync.Mutex
	inflight  int
	bodyBytes int64

	gInflight prometheus.Gauge
	gBytes    prometheus.Gauge
	rejected  *prometheus.CounterVec

	clients *clients // per-client bounds; nil: none
}

// NewAdmission checks lim and registers the admission metrics on reg (nil: unregistered):
// kvc_gateway_admission_inflight_requests, kvc_gateway_admission_inflight_body_bytes,
// kvc_gateway_admission_rejected_total{reason="requests"|"body_bytes"|"body_too_large"}.
func NewAdmission(lim AdmissionLimits, reg prometheus.Registerer) (*Admission, error) {
	if err := lim.Check(); err != nil {
		return nil, err
	}
	ra := int64((lim.RetryAfter + time.Second - 1) / time.Second)
	a := &Admission{
		lim: lim, retryAfter: strconv.FormatInt(max(ra, 1), 10),
		gInflight: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvc_gateway_admission_inflight_requests",
			Help: "Client requests admitted and not finished (limit: --max-inflight-requests)."}),
		gBytes: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvc_gateway_admission_inflight_body_bytes",
			Help: "Request body bytes reserved by admitted requests (limit: --max-inflight-body-bytes)."}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvc_gateway_admission_rejected_total",
			Help: "Requests refused before their body was read, by reason: requests (429), body_bytes (503), body_too_large (413)."},
			[]string{"reason"}),
	}
	for _, r := range []string{"requests", "body_bytes", "body_too_large"} {
		a.rejected.WithLabelValues(r)
	}
	cs := []prometheus.Collector{a.gInflight, a.gBytes, a.rejected}
	if lim.MaxInflightPerClient > 0 || lim.MaxClientTokens > 0 {
		a.clients = newClients(lim.MaxInflightPerClient, lim.MaxClientTokens, lim.ClientAbortLeak)
		cs = append(cs, a.clients.collectors()...)
	}
	if reg != nil {
		for _, c := range cs {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return a, nil
}

// Check validates the limits (flag names in the messages).
func (l AdmissionLimits) Check() error {
	switch {
	case l.MaxInflight < 1:
		return fmt.Errorf("--max-inflight-requests must be at least 1, got %d", l.MaxInflight)
	case l.MaxBodyBytes < 1:
		return fmt.Errorf("--max-body-bytes must be positive, got %d", l.MaxBodyBytes)
	case l.MaxInflightBodyBytes < l.MaxBodyBytes:
		return fmt.Errorf("--max-inflight-body-bytes (%d) must be at least --max-body-bytes (%d), or no large body could ever be admitted", l.MaxInflightBodyBytes, l.MaxBodyBytes)
	case l.RetryAfter < 0:
		return fmt.Errorf("--admission-retry-after must not be negative, got %s", l.RetryAfter)
	case l.MaxInflightPerClient < 0:
		return fmt.Errorf("--max-inflight-per-client must not be negative, got %d", l.MaxInflightPerClient)
	case l.ClientAbortLeak < 0:
		return fmt.Errorf("--client-aborted-tokens-per-second must not be negative, got %v", l.ClientAbortLeak)
	case l.MaxClientTokens < 0:
		return fmt.Errorf("--max-inflight-tokens-per-client must not be negative, got %d", l.MaxClientTokens)
	}
	return nil
}

// Wrap admits each request to h or answers it at once: 413 body_too_large for a declared
// length above MaxBodyBytes, 429 too_many_requests at MaxInflight, 503 gateway_saturated when
// its body would not fit in MaxInflightBodyBytes; 429 and 503 carry Retry-After.
func (a *Admission) Wrap(h http.Handler) http.Handler {
	if a == nil {
		return h
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength > a.lim.MaxBodyBytes {
			a.rejected.WithLabelValues("body_too_large").Inc()
			w.Header().Set("Connection", "close") // the body is not read
			writeErr(w, &api.Error{Status: http.StatusRequestEntityTooLarge, Code: CodeBodyTooLarge,
				Message: fmt.Sprintf("body of %d bytes is larger than %d bytes", r.ContentLength, a.lim.MaxBodyBytes)}, nil)
			return
		}
		need := r.ContentLength
		if need < 0 { // not declared (chunked): the most it may be
			need = a.lim.MaxBodyBytes
		}
		if e := a.acquire(need); e != nil {
			w.Header().Set("Retry-After", a.retryAfter)
			w.Header().Set("Connection", "close")
			writeErr(w, e, nil)
			return
		}
		defer a.release(need)
		if a.clients != nil {
			key := ClientKey(r)
			if e := a.clients.enter(key); e != nil {
				w.Header().Set("Retry-After", a.retryAfter)
				w.Header().Set("Connection", "close")
				writeErr(w, e, nil)
				return
			}
			defer a.clients.leave(key)
			r = r.WithContext(context.WithValue(r.Context(), clientCtxKey{}, key))
		}
		h.ServeHTTP(w, r)
	})
}

func (a *Admission) acquire(need int64) *api.Error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.inflight >= a.lim.MaxInflight {
		a.rejected.WithLabelValues("requests").Inc()
		return &api.Error{Status: http.StatusTooManyRequests, Code: CodeTooManyRequests,
			Message: fmt.Sprintf("%d requests in flight, the gateway's limit (--max-inflight-requests); retry later", a.lim.MaxInflight)}
	}
	if a.bodyBytes+need > a.lim.MaxInflightBodyBytes {
		a.rejected.WithLabelValues("body_bytes").Inc()
		return &api.Error{Status: http.StatusServiceUnavailable, Code: CodeSaturated,
			Message: fmt.Sprintf("request bodies in flight would exceed %d bytes (--max-inflight-body-bytes); retry later", a.lim.MaxInflightBodyBytes)}
	}
	a.inflight++
	a.bodyBytes += need
	a.gInflight.Set(float64(a.inflight))
	a.gBytes.Set(float64(a.bodyBytes))
	return nil
}

func (a *Admission) release(need int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.inflight--
	a.bodyBytes -= need
	a.gInflight.Set(float64(a.inflight))
	a.gBytes.Set(float64(a.bodyBytes))
}
