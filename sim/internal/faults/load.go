package faults

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/errgroup"
)

// Result is one client request through the gateway as the load generator saw it.
type Result struct {
	Session  string
	Turn     int
	Call     time.Time
	Return   time.Time
	Status   int
	OK       bool   // 200 and the stream ended with [DONE], no error event
	Err      string // why not OK
	Mode     string // X-KVC-Mode
	Reason   string // X-KVC-Reason
	Worker   string // X-KVC-Decode-Worker
	FailOpen bool   // X-KVC-Fail-Open
	Retries  int    // X-KVC-Retries
	// RetriedFrom are the decode workers of the attempts that failed before their first token
	// and that the gateway retried through a new decision, in order (X-KVC-Retried-From); Mode
	// and Worker are the last attempt's. Each was a decision too (OpsFromResults: a Maybe).
	RetriedFrom []string
	// A request the gateway resumed after its decode worker died mid-stream (the trailers
	// X-KVC-Resumed-From, -Decode-Worker, -Mode, -Fail-Open): Mode, Worker and FailOpen are then
	// the continuation's, FirstMode, ResumedFrom and FirstFailOpen the interrupted attempt's
	// (OpsFromResults: two ops).
	ResumedFrom   string
	FirstMode     string
	FirstFailOpen bool
	// ResumedRetriedFrom are the decode workers of the continuation's attempts that failed
	// before their first token and were retried (the trailer X-KVC-Resumed-Retried-From).
	ResumedRetriedFrom []string
}

// LoadConfig shapes the session traffic.
type LoadConfig struct {
	URL          string
	Sessions     int           // concurrent sessions (default 24)
	Clients      int           // goroutines (default 4); each owns every Clients-th session
	Rate         float64       // requests per second in all (default 30)
	Turns        int           // turns per session before a new session id replaces it (default 16)
	Timeout      time.Duration // one request (default 15 s)
	OutputTokens int           // max_new_tokens (default 8)
	// KeyPerClient: each goroutine sends X-API-Key load-<n>, a client of its own for the
	// gateway's per-client bounds.
	KeyPerClient bool
}

// Load is a bounded session load generator: Clients goroutines send multi-turn sessions
// (SGLang /generate, streaming, X-Session-ID) through the gateway at a total of Rate requests
// per second. Every answer is kept (Results), in completion order.
type Load struct {
	cfg  LoadConfig
	hc   *http.Client
	sess []*loadSession

	mu      sync.Mutex
	results []Result
	gen     int
}

type loadSession struct {
	id   string
	turn int
}

// NewLoad returns a generator with its sessions at turn 0.
func NewLoad(cfg LoadConfig) *Load {
	if cfg.Sessions <= 0 {
		cfg.Sessions = 24
	}
	if cfg.Clients <= 0 {
		cfg.Clients = 4
	}
	if cfg.Rate <= 0 {
		cfg.Rate = 30
	}
	if cfg.Turns <= 0 {
		cfg.Turns = 16
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 15 * time.Second
	}
	if cfg.OutputTokens <= 0 {
		cfg.OutputTokens = 8
	}
	l := &Load{cfg: cfg, hc: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: cfg.Clients * 2}}}
	for i := 0; i < cfg.Sessions; i++ {
		l.sess = append(l.sess, &loadSession{id: fmt.Sprintf("fs-%02d-0", i)})
	}
	return l
}

// Run sends requests until ctx ends, then waits for those in flight (each bounded by the
// request timeout) and returns.
func (l *Load) Run(ctx context.Context) {
	tokens := make(chan struct{})
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { // the pacer: one token per 1/Rate
		t := time.NewTicker(time.Duration(float64(time.Second) / l.cfg.Rate))
		defer t.Stop()
		for {
			select {
			case <-gctx.Done():
				return nil
			case <-t.C:
				select {
				case tokens <- struct{}{}:
				default: // every client busy: the generator stays bounded, it does not queue
				}
			}
		}
	})
	for c := 0; c < l.cfg.Clients; c++ {
		g.Go(func() error {
			for i := c; ; i += l.cfg.Clients {
				if i >= len(l.sess) {
					i = c
				}
				select {
				case <-gctx.Done():
					return nil
				case <-tokens:
				}
				s := l.sess[i]
				// A request already started finishes (bounded by its timeout) even when ctx
				// ends: its answer is part of the history.
				key := ""
				if l.cfg.KeyPerClient {
					key = fmt.Sprintf("load-%d", c)
				}
				r := l.send(context.WithoutCancel(gctx), s.id, s.turn, key)
				l.mu.Lock()
				l.results = append(l.results, r)
				s.turn++
				if s.turn >= l.cfg.Turns {
					l.gen++
					s.id, s.turn = fmt.Sprintf("fs-%02d-%d", i, l.gen), 0
				}
				l.mu.Unlock()
			}
		})
	}
	_ = g.Wait()
}

// Results returns the answers from index from on, and the index to continue from.
func (l *Load) Results(from int) ([]Result, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]Result(nil), l.results[from:]...), len(l.results)
}

// Sessions returns the ids of the sessions in use now.
func (l *Load) Sessions() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]string, len(l.sess))
	for i, s := range l.sess {
		out[i] = s.id
	}
	return out
}

// inputTokens grows a session by 240 tokens a turn: a small append (direct-to-D).
func inputTokens(turn int) int64 { return 400 + 240*int64(turn) }

// inputIDs is a session's prompt of n tokens: each turn's prompt extends the previous one
// (the same prefix, so continuity checked on content holds), distinct per session.
func inputIDs(session string, n int64) []int64 {
	var seed int64
	for _, c := range session {
		seed = seed*31 + int64(c)
	}
	out := make([]int64, n)
	for i := range out {
		out[i] = (seed + int64(i)*7919) % 150000
		if out[i] < 0 {
			out[i] = -out[i]
		}
	}
	return out
}

func (l *Load) send(ctx context.Context, session string, turn int, key string) (r Result) {
	r = Result{Session: session, Turn: turn, Call: time.Now()}
	defer func() { r.Return = time.Now() }()
	body, _ := json.Marshal(map[string]any{
		"input_ids":       inputIDs(session, inputTokens(turn)),
		"stream":          true,
		"sampling_params": map[string]any{"max_new_tokens": l.cfg.OutputTokens},
		"session_params":  map[string]any{"id": session},
		"kvc":             map[string]any{"input_tokens": inputTokens(turn), "turn": turn, "multiturn": true},
	})
	ctx, cancel := context.WithTimeout(ctx, l.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, l.cfg.URL+"/generate", bytes.NewReader(body))
	if err != nil {
		r.Err = err.Error()
		return r
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	if key != "" {
		req.Header.Set("X-API-Key", key)
	}
	resp, err := l.hc.Do(req)
	if err != nil {
		r.Err = "transport: " + err.Error()
		return r
	}
	defer resp.Body.Close()
	h := resp.Header
	r.Status = resp.StatusCode
	r.Mode, r.Reason, r.Worker = h.Get("X-KVC-Mode"), h.Get("X-KVC-Reason"), h.Get("X-KVC-Decode-Worker")
	r.FailOpen = h.Get("X-KVC-Fail-Open") == "true"
	r.Retries, _ = strconv.Atoi(h.Get("X-KVC-Retries"))
	r.RetriedFrom = workerList(h.Get("X-KVC-Retried-From"))
	br := bufio.NewReaderSize(resp.Body, 64<<10)
	if resp.StatusCode != http.StatusOK {
		b, _ := br.Peek(300)
		r.Err = fmt.Sprintf("HTTP %d %s: %s", resp.StatusCode, h.Get("X-KVC-Error-Kind"), bytes.TrimSpace(b))
		return r
	}
	for {
		line, err := br.ReadBytes('\n')
		if p, ok := bytes.CutPrefix(bytes.TrimSpace(line), []byte("data:")); ok {
			p = bytes.TrimSpace(p)
			if bytes.Equal(p, []byte("[DONE]")) {
				r.OK = r.Err == ""
				_, _ = io.Copy(io.Discard, io.LimitReader(br, 1<<20)) // to the trailers
				if from := resp.Trailer.Get("X-KVC-Resumed-From"); from != "" {
					r.ResumedFrom, r.FirstMode, r.FirstFailOpen = from, r.Mode, r.FailOpen
					r.Mode, r.Worker = resp.Trailer.Get("X-KVC-Resumed-Mode"), resp.Trailer.Get("X-KVC-Resumed-Decode-Worker")
					r.FailOpen = resp.Trailer.Get("X-KVC-Resumed-Fail-Open") == "true"
					r.ResumedRetriedFrom = workerList(resp.Trailer.Get("X-KVC-Resumed-Retried-From"))
				}
				return r
			}
			var c struct {
				Error *struct{ Code, Message, Kind string } `json:"error"`
			}
			if json.Unmarshal(p, &c) == nil && c.Error != nil {
				r.Err = fmt.Sprintf("stream error %s %s: %s", c.Error.Kind, c.Error.Code, c.Error.Message)
			}
		}
		if err != nil {
			if r.Err == "" {
				r.Err = "stream ended without [DONE]: " + err.Error()
			}
			return r
		}
	}
}

// workerList splits a header's comma-separated worker names (nil when empty).
func workerList(v string) []string {
	var out []string
	for _, w := range strings.Split(v, ",") {
		if w = strings.TrimSpace(w); w != "" {
			out = append(out, w)
		}
	}
	return out
}
