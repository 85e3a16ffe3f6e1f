package server

import (
	"context"
	"encoding/json"
	"errors"
	"math"
	"slices"
	"strconv"

	"github.com/kvcentric/kvcentric/gateway/internal/api"
	"github.com/kvcentric/kvcentric/gateway/internal/pyjson"
)

// A request whose decode worker dies after tokens went to the client (or into the gateway's
// buffer of a non-streaming answer) is resumed (--resume-mid-stream): a new decision for the
// same session and turn whose prompt is the original prompt extended by the tokens generated so
// far, asked for the tokens that remain with the same sampling parameters, its answer appended
// to the client's (docs/gateway.md, "Resume after a decode worker's death").

// Resume results (kvc_gateway_resumes_total{result}).
const (
	resumeOK          = "ok"             // the continuation finished the answer
	resumeFailed      = "failed"         // the continuation found no decision or failed itself
	resumeRetried     = "retried"        // a continuation failed before its first token: a new decision tries again
	resumeDisabled    = "disabled"       // --resume-mid-stream=false
	resumeNoIDs       = "no_prompt_ids"  // the prompt's token ids are unknown (text without --tokenizer)
	resumeIDsMismatch = "ids_mismatch"   // the streamed ids do not add up to the tokens generated
	resumeNoneLeft    = "no_tokens_left" // every token asked for was generated
	resumeConstrained = "constrained"    // regex, EBNF or JSON schema: the grammar cannot restart at the join
	resumeNotAllowed  = "not_allowed"    // the decision forbids a new attempt (retry_allowed false)
)

var resumeResults = []string{resumeOK, resumeFailed, resumeRetried, resumeDisabled, resumeNoIDs, resumeIDsMismatch, resumeNoneLeft, resumeConstrained, resumeNotAllowed}

// maxResumes bounds the resumes of one request: a continuation whose worker dies after its own
// first token ends the request with that failure.
const maxResumes = 1

// maxResumeRetries bounds the new decisions a resume takes for continuations that fail before
// their first token (their worker refused or dropped the connection, answered a 503 other than
// no_capacity or a 409, or its transfer failed): up to 1+maxResumeRetries continuation
// attempts, each excluding every worker found gone so far. Two, one more than a fresh request's
// maxRetries: the client already holds part of the answer, so giving up costs it the whole
// answer, and the workers that die together (a host's) are each excluded once found.
const maxResumeRetries = 2

// resumeRetryable: continuation res failed before its first token (no chunk of this attempt
// reached the sink) in a way a new decision may fix, and the decision allows one.
func resumeRetryable(res result, out *sink, p *plan) bool {
	return !res.ok && res.retry && p.exec.GetRetryAllowed() && res.ttft == 0 && out.segChunks == 0
}

// midStreamGone: the attempt failed because its worker went away (the connection refused, reset
// or closed before [DONE]: the retry classes that name a gone worker; never a client abort, a
// timeout or a worker's error answer) after D's first token, so retryable's fresh retry is no
// longer safe.
func midStreamGone(res result, out *sink) bool {
	return !res.ok && res.retry && res.gone != nil && (out.started || res.ttft > 0 || out.chunks > 0)
}

// resumeRequest is the continuation of req after attempt res: the prompt extended by the
// generated ids, the tokens that remain, the same sampling parameters (max_new_tokens and
// min_new_tokens counted down). nil and the reason when it cannot be resumed exactly enough: the
// prompt's ids or one of the generated ids is unknown (their count must equal the tokens the
// worker reported generating, else the tokens per chunk), nothing remains, or the answer is
// grammar-constrained.
func resumeRequest(req *api.Request, res result, segChunks int) (*api.Request, string) {
	if len(req.InputIDs) == 0 || int64(len(req.InputIDs)) != req.InputTokens {
		return nil, resumeNoIDs
	}
	gen := int64(len(res.outputIDs))
	want := res.outputTok // meta_info.completion_tokens of the last chunk
	if want == 0 {
		want = int64(segChunks) // no meta_info: one token per chunk
	}
	if gen == 0 || gen != want {
		return nil, resumeIDsMismatch
	}
	left := req.MaxTokens - gen
	if left <= 0 {
		return nil, resumeNoneLeft
	}
	sampling, err := continueSampling(req.Sampling, gen, left)
	if err != nil {
		if errors.Is(err, errConstrained) {
			return nil, resumeConstrained
		}
		return nil, resumeIDsMismatch
	}
	c := *req
	c.InputIDs = append(slices.Clip(req.InputIDs), res.outputIDs...) // a new array
	c.InputTokens = int64(len(c.InputIDs))
	c.Estimated = false
	c.MaxTokens = left
	c.Sampling = sampling
	c.Text = ""
	c.ContentIDs, c.PromptPages, c.PageSize = nil, nil, 0
	return &c, ""
}

// withContent gives a continuation its content address (the extended prompt's page chain) when
// the original had one.
func (s *Server) withContent(ctx context.Context, orig, c *api.Request) {
	if orig.PageSize <= 0 || len(orig.ContentIDs) == 0 {
		return
	}
	h := s.pageHasher(ctx)
	if h == nil {
		return
	}
	ids := make([]uint32, len(c.InputIDs))
	for i, v := range c.InputIDs {
		if v < 0 || v > math.MaxUint32 {
			return
		}
		ids[i] = uint32(v)
	}
	c.ContentIDs, c.PromptPages, c.PageSize = ids, h.Chain(ids), h.PageSize()
}

var errConstrained = errors.New("grammar-constrained answer")

// constrainedKeys are the sampling parameters whose grammar state at the join the continuation
// cannot rebuild (it would start the grammar over).
var constrainedKeys = []string{"regex", "ebnf", "json_schema", "structural_tag"}

// continueSampling is the continuation's sampling_params: raw (the request's, as the worker got
// it) with max_new_tokens = left and min_new_tokens less the gen tokens generated (at least 0).
// An empty raw stays empty (workerBody then sends max_new_tokens alone).
func continueSampling(raw []byte, gen, left int64) ([]byte, error) {
	if len(raw) == 0 {
		return nil, nil
	}
	v, err := pyjson.Decode(raw)
	if err != nil {
		return nil, err
	}
	sp, ok := v.(*pyjson.Object)
	if !ok {
		return nil, errors.New("sampling_params is not an object")
	}
	for _, k := range constrainedKeys {
		if x, _ := sp.Get(k); x != nil {
			return nil, errConstrained
		}
	}
	sp.Set("max_new_tokens", pyjson.Int{Digits: strconv.FormatInt(left, 10)})
	if x, _ := sp.Get("min_new_tokens"); x != nil {
		if n, ok := x.(pyjson.Int); ok {
			if m, err := strconv.ParseInt(n.Digits, 10, 64); err == nil {
				sp.Set("min_new_tokens", pyjson.Int{Digits: strconv.FormatInt(max(m-gen, 0), 10)})
			}
		}
	}
	return []byte(pyjson.Dumps(sp, pyjson.Options{Compact: true})), nil
}

// resumeBase is what the client had when its request was resumed: the continuation's counts
// and ids are reported over the whole answer.
type resumeBase struct {
	prompt int64   // the original prompt's tokens
	ids    []int64 // the tokens generated before the continuation
	from   string  // the decode worker that died
	// tried are the decode workers of the continuation attempts run so far, in order: all but
	// the last failed before their first token (X-KVC-Resumed-Attempts, -Retried-From).
	tried []string
}

// merged is the whole answer's result from the interrupted attempt's and the continuation's: the
// continuation's ending, the first attempt's TTFT, counts and ids over the whole answer.
func (b *resumeBase) merged(first, cont result) result {
	m := cont
	m.ttft = first.ttft
	m.promptTok = b.prompt
	m.outputTok = int64(len(b.ids)) + cont.outputTok
	m.outputIDs = append(slices.Clip(b.ids), cont.outputIDs...)
	m.meta = b.meta(cont.meta)
	return m
}

// meta rewrites a continuation's meta_info as the whole answer's: prompt_tokens the original
// prompt's, completion_tokens and a length finish_reason's length counting the tokens before the
// join. Anything it cannot read is passed as it is.
func (b *resumeBase) meta(raw json.RawMessage) json.RawMessage {
	if len(raw) == 0 {
		return raw
	}
	var mi map[string]json.RawMessage
	if json.Unmarshal(raw, &mi) != nil || mi == nil {
		return raw
	}
	n := int64(len(b.ids))
	if _, ok := mi["prompt_tokens"]; ok {
		mi["prompt_tokens"] = json.RawMessage(strconv.FormatInt(b.prompt, 10))
	}
	if v, ok := mi["completion_tokens"]; ok {
		if c, err := strconv.ParseInt(string(v), 10, 64); err == nil {
			mi["completion_tokens"] = json.RawMessage(strconv.FormatInt(c+n, 10))
		}
	}
	if v, ok := mi["finish_reason"]; ok {
		var fr map[string]json.RawMessage
		if json.Unmarshal(v, &fr) == nil && string(fr["type"]) == `"length"` {
			if l, err := strconv.ParseInt(string(fr["length"]), 10, 64); err == nil {
				fr["length"] = json.RawMessage(strconv.FormatInt(l+n, 10))
				if out, err := json.Marshal(fr); err == nil {
					mi["finish_reason"] = out
				}
			}
		}
	}
	out, err := json.Marshal(mi)
	if err != nil {
		return raw
	}
	return out
}
