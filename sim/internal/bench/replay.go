package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvcentric/kvcentric/sim/internal/report"
	"github.com/kvcentric/kvcentric/sim/internal/workload"
)

// Options control one replay.
type Options struct {
	Arm string
	// TimeScale multiplies the workload's clock (arrival times, think times): 0.5 replays twice
	// as fast. It does not touch the system's own (modeled) durations.
	TimeScale float64
	// RequestTimeout bounds one request on the client side (the gateway has its own).
	RequestTimeout time.Duration
	// SendText sends a synthetic prompt of about InputTokens tokens (for real SGLang workers);
	// otherwise only the token count travels (kvc.input_tokens, which kvc-sim needs).
	SendText bool
	// SendIDs sends the context as input_ids, the way an agent holds its conversation: the
	// session's history (earlier inputs and the output_ids its answers carried) plus new
	// tokens up to the turn's input length (a shorter turn truncates the history: compaction).
	// For kvc-refworker, whose exactness check then covers real greedy continuations.
	SendIDs bool
	// IDVocab bounds the generated token ids of SendIDs (default 1000: within every
	// kvc-refworker model's vocabulary).
	IDVocab int64
	// Out receives one JSON line per request (may be nil).
	Out io.Writer
	// Progress is called after every request with done and total (may be nil).
	Progress func(done, total int, last *report.Record)
	// Holders, when set, learns each session's decode worker as its requests are routed (the
	// kill of --kill-decode most).
	Holders *Holders
}

// Replay sends every session of w to the gateway at baseURL and returns the records in
// completion order.
func Replay(ctx context.Context, baseURL string, w *workload.Workload, opt Options) ([]report.Record, error) {
	if opt.TimeScale <= 0 {
		return nil, fmt.Errorf("time scale must be > 0, got %v", opt.TimeScale)
	}
	if opt.RequestTimeout <= 0 {
		opt.RequestTimeout = 200 * time.Second
	}
	baseURL = strings.TrimRight(baseURL, "/")
	hc := &http.Client{Transport: &http.Transport{
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
		MaxIdleConnsPerHost: 256, IdleConnTimeout: 30 * time.Second, DisableCompression: true,
	}}
	defer hc.CloseIdleConnections()

	total := w.Requests()
	var (
		mu      sync.Mutex
		records = make([]report.Record, 0, total)
		werr    error
		enc     *json.Encoder
	)
	if opt.Out != nil {
		enc = json.NewEncoder(opt.Out)
	}
	add := func(r report.Record) {
		mu.Lock()
		defer mu.Unlock()
		records = append(records, r)
		if enc != nil && werr == nil {
			werr = enc.Encode(&r)
		}
		if opt.Progress != nil {
			opt.Progress(len(records), total, &r)
		}
	}
	scale := func(d time.Duration) time.Duration { return time.Duration(float64(d) * opt.TimeScale) }
	start := time.Now()
	var wg sync.WaitGroup
	for _, s := range w.Sessions {
		wg.Add(1)
		go func(s workload.Session) {
			defer wg.Done()
			if !sleepUntil(ctx, start.Add(scale(s.Start))) {
				return
			}
			var prevEnd time.Time
			var hist []int64 // SendIDs: the conversation as the client holds it
			for i, t := range s.Turns {
				at := start.Add(scale(t.At))
				if i > 0 {
					if th := prevEnd.Add(scale(t.Think)); th.After(at) {
						at = th
					}
				}
				if !sleepUntil(ctx, at) {
					return
				}
				var ids []int64
				if opt.SendIDs {
					// The history edited as the turn says, shared system prompts (workload.ContextIDs).
					ids = s.ContextIDs(hist, i, opt.IDVocab)
				}
				r, out := send(ctx, hc, baseURL, s.ID, i, len(s.Turns) > 1, t, ids, opt)
				if t.Edit != nil {
					r.Edit = t.Edit.Kind
				}
				if opt.SendIDs {
					hist = append(ids, out...)
				}
				r.StartS = time.Since(start).Seconds() - r.LatencyS
				prevEnd = time.Now()
				add(r)
			}
		}(s)
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return records, err
	}
	return records, werr
}

func sleepUntil(ctx context.Context, t time.Time) bool {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err() == nil
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// synthText is a deterministic prompt of about n tokens whose prefix is stable per session, so a
// real server's prefix cache sees each turn extend the previous one.
func synthText(session string, n int64) string {
	var b strings.Builder
	b.Grow(int(n) * 6)
	for i := int64(0); i < n; i++ {
		b.WriteString(" w")
		b.WriteString(strconv.FormatInt(i%997, 10))
	}
	return session + ":" + b.String()
}

// extendIDs is the next turn's context: hist cut or extended to n tokens, the new ones a
// deterministic function of (session, position) in [0, vocab).
func extendIDs(hist []int64, session string, n, vocab int64) []int64 {
	if vocab <= 0 {
		vocab = 1000
	}
	if int64(len(hist)) >= n {
		return append([]int64(nil), hist[:n]...)
	}
	out := make([]int64, len(hist), n)
	copy(out, hist)
	h := fnv.New64a()
	_, _ = h.Write([]byte(session))
	seed := h.Sum64()
	for i := int64(len(hist)); i < n; i++ {
		z := seed + uint64(i+1)*0x9E3779B97F4A7C15
		z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
		z = (z ^ (z >> 27)) * 0x94D049BB133111EB
		z ^= z >> 31
		out = append(out, int64(z%uint64(vocab)))
	}
	return out
}

type workerKVC struct {
	KVLenAfter          int64   `json:"kv_len_after"`
	ReceivedBytes       int64   `json:"received_bytes"`
	VerifiedBytes       int64   `json:"verified_bytes"`
	VerifyFailures      int64   `json:"verify_failures"`
	TransferMS          float64 `json:"transfer_ms"`
	RecomputeChecked    bool    `json:"recompute_checked"`
	RecomputeMismatches int64   `json:"recompute_mismatches"`
	MaxAbsLogitDiff     float64 `json:"max_abs_logit_diff"`
	MaxAbsKVDiff        float64 `json:"max_abs_kv_diff"`
	PrefillMS           float64 `json:"prefill_ms"`
	ReceiveWaitMS       float64 `json:"receive_wait_ms"`
	TTFTMS              float64 `json:"ttft_ms"`
	TurnWaitMS          float64 `json:"turn_wait_ms"`
	GPUWaitMS           float64 `json:"gpu_wait_ms"`
	AllocMS             float64 `json:"alloc_ms"`
	TruncatedTo         int64   `json:"truncated_to"`
	PrefixCachedTokens  int64   `json:"prefix_cached_tokens"`
}

type streamChunk struct {
	OutputIDs []int64 `json:"output_ids"`
	MetaInfo  *struct {
		CompletionTokens int64      `json:"completion_tokens"`
		KVC              *workerKVC `json:"kvc"`
	} `json:"meta_info"`
	Error *struct {
		Code    string `json:"code"`
		Message string `json:"message"`
		Kind    string `json:"kind"`
	} `json:"error"`
}

// send runs one request and records it; it never fails the replay. With ids it sends them as
// input_ids and returns the answer's output_ids.
func send(ctx context.Context, hc *http.Client, baseURL, session string, turn int, multiturn bool, t workload.Turn, ids []int64, opt Options) (r report.Record, out []int64) {
	r = report.Record{Arm: opt.Arm, SessionID: session, Turn: turn, InputTokens: t.InputTokens, OutputTokens: t.OutputTokens}
	body := map[string]any{
		"stream":          true,
		"sampling_params": map[string]any{"max_new_tokens": t.OutputTokens},
		"session_params":  map[string]any{"id": session},
		"kvc":             map[string]any{"input_tokens": t.InputTokens, "turn": turn, "multiturn": multiturn},
	}
	if opt.SendText {
		body["text"] = synthText(session, t.InputTokens)
	}
	if ids != nil {
		body["input_ids"] = ids
	}
	raw, _ := json.Marshal(body)
	rctx, cancel := context.WithTimeout(ctx, opt.RequestTimeout)
	defer cancel()
	t0 := time.Now()
	defer func() { r.LatencyS = time.Since(t0).Seconds() }()
	req, err := http.NewRequestWithContext(rctx, http.MethodPost, baseURL+"/generate", bytes.NewReader(raw))
	if err != nil {
		r.ErrorKind, r.ErrorMsg = "CLIENT_ERROR", err.Error()
		return r, out
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", session)
	resp, err := hc.Do(req)
	if err != nil {
		r.ErrorKind, r.ErrorMsg = clientErrKind(rctx, err), err.Error()
		return r, out
	}
	defer resp.Body.Close()
	r.Status = resp.StatusCode
	h := resp.Header
	r.Mode, r.Reason, r.DecisionID = h.Get("X-KVC-Mode"), h.Get("X-KVC-Reason"), h.Get("X-KVC-Decision-Id")
	r.DecodeWorker = h.Get("X-KVC-Decode-Worker")
	if resp.StatusCode == http.StatusOK {
		opt.Holders.Set(session, r.DecodeWorker)
	}
	r.FailOpen = h.Get("X-KVC-Fail-Open") == "true"
	r.Retries, _ = strconv.Atoi(h.Get("X-KVC-Retries"))
	if v := h.Get("X-KVC-Retried-From"); v != "" {
		r.RetriedFrom = strings.Split(v, ",")
	}
	r.CachedTokens, _ = strconv.ParseInt(h.Get("X-KVC-Cached-Tokens"), 10, 64)
	r.PrefillLoadedTokens, _ = strconv.ParseInt(h.Get("X-KVC-Prefill-Load-Tokens"), 10, 64)
	r.UncachedTokens = max(r.InputTokens-max(r.CachedTokens, r.PrefillLoadedTokens), 0)
	r.SnapshotUsed = r.Mode == "RESEED_SNAPSHOT"
	if resp.StatusCode != http.StatusOK {
		r.ErrorKind = h.Get("X-KVC-Error-Kind")
		if r.ErrorKind == "" {
			r.ErrorKind = "HTTP_" + strconv.Itoa(resp.StatusCode)
		}
		var e struct {
			Error struct{ Code, Message string } `json:"error"`
		}
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		if json.Unmarshal(b, &e) == nil {
			r.ErrorCode, r.ErrorMsg = e.Error.Code, e.Error.Message
		}
		return r, out
	}
	br := bufio.NewReaderSize(resp.Body, 64<<10)
	for {
		line, err := br.ReadBytes('\n')
		line = bytes.TrimSpace(line)
		if p, ok := bytes.CutPrefix(line, []byte("data:")); ok {
			p = bytes.TrimSpace(p)
			if bytes.Equal(p, []byte("[DONE]")) {
				r.OK = r.ErrorKind == ""
				// The gateway names a resume in trailers (the headers went out with the first
				// worker's): read to the end of the body for them.
				_, _ = io.Copy(io.Discard, io.LimitReader(br, 1<<20))
				if from := resp.Trailer.Get("X-KVC-Resumed-From"); from != "" {
					r.ResumedFrom, r.ResumedOn = from, resp.Trailer.Get("X-KVC-Resumed-Decode-Worker")
					r.ResumedAttempts, _ = strconv.Atoi(resp.Trailer.Get("X-KVC-Resumed-Attempts"))
					if v := resp.Trailer.Get("X-KVC-Resumed-Retried-From"); v != "" {
						r.ResumedRetriedFrom = strings.Split(v, ",")
					}
					if r.OK && r.ResumedOn != "" {
						opt.Holders.Set(session, r.ResumedOn)
					}
				}
				return r, out
			}
			var c streamChunk
			if jerr := json.Unmarshal(p, &c); jerr != nil {
				r.ErrorKind, r.ErrorMsg = "BAD_STREAM", jerr.Error()
				continue
			}
			if c.Error != nil {
				r.ErrorKind, r.ErrorCode, r.ErrorMsg = c.Error.Kind, c.Error.Code, c.Error.Message
				if r.ErrorKind == "" {
					r.ErrorKind = "WORKER_ERROR"
				}
				continue
			}
			if r.TTFTS == 0 {
				r.TTFTS = time.Since(t0).Seconds()
			}
			out = append(out, c.OutputIDs...)
			if c.MetaInfo != nil {
				r.GotTokens = c.MetaInfo.CompletionTokens
				if k := c.MetaInfo.KVC; k != nil {
					r.KVLenAfter, r.ReceivedBytes, r.VerifiedBytes, r.VerifyFailures, r.TransferMS = k.KVLenAfter, k.ReceivedBytes, k.VerifiedBytes, k.VerifyFailures, k.TransferMS
					r.RecomputeChecked, r.RecomputeMismatches, r.MaxAbsLogitDiff = k.RecomputeChecked, k.RecomputeMismatches, k.MaxAbsLogitDiff
					r.MaxAbsKVDiff = k.MaxAbsKVDiff
					r.WorkerPrefillMS, r.ReceiveWaitMS = k.PrefillMS, k.ReceiveWaitMS
					r.WorkerTTFTMS = max(r.WorkerTTFTMS, k.TTFTMS)
					r.TurnWaitMS, r.GPUWaitMS, r.AllocMS = k.TurnWaitMS, k.GPUWaitMS, k.AllocMS
					r.TruncatedTo = max(r.TruncatedTo, k.TruncatedTo)
					r.PrefixCachedTokens = max(r.PrefixCachedTokens, k.PrefixCachedTokens)
				}
			}
		}
		if err != nil {
			if r.ErrorKind == "" {
				r.ErrorKind, r.ErrorMsg = clientErrKind(rctx, err), "stream ended before [DONE]: "+err.Error()
			}
			return r, out
		}
	}
}

func clientErrKind(ctx context.Context, err error) string {
	switch {
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		return "TIMEOUT"
	case ctx.Err() != nil:
		return "ABORTED"
	}
	return "CONNECTION_ERROR"
}
