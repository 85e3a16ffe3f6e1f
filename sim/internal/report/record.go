package report

// Record is one request's line in metrics.jsonl.
type Record struct {
	Arm          string  `json:"arm"`
	SessionID    string  `json:"session_id"`
	Turn         int     `json:"turn"`
	StartS       float64 `json:"start_s"` // since the start of the arm's replay
	InputTokens  int64   `json:"input_tokens"`
	OutputTokens int64   `json:"output_tokens"` // asked for
	GotTokens    int64   `json:"completion_tokens"`
	// CachedTokens is what the decision said was already in KV (D's session or the snapshot).
	CachedTokens int64 `json:"cached_tokens"`
	// PrefillLoadedTokens: P loaded this many tokens of the session's snapshot from its store
	// and prefilled only the rest (prefill from the snapshot, X-KVC-Prefill-Load-Tokens).
	PrefillLoadedTokens int64 `json:"prefill_loaded_tokens,omitempty"`
	// UncachedTokens is what the worker that prefills computes at most: the input less what
	// the decision found in KV (CachedTokens) or P loads (PrefillLoadedTokens); a prefix cache
	// may serve more of it.
	UncachedTokens int64  `json:"uncached_tokens"`
	Mode           string `json:"execution_mode"`
	Reason         string `json:"reason"`
	DecisionID     string `json:"decision_id,omitempty"`
	DecodeWorker   string `json:"decode_worker,omitempty"`
	FailOpen       bool   `json:"fail_open"`
	Retries        int    `json:"retries"`
	SnapshotUsed   bool   `json:"snapshot_used"`
	// RetriedFrom names the decode workers of earlier attempts of this request that failed and
	// that the gateway retried through a new decision (X-KVC-Retried-From), in order.
	RetriedFrom []string `json:"retried_from,omitempty"`
	// ResumedFrom is the decode worker that died while this request streamed from it, and
	// ResumedOn the one a new decision continued the answer on (the gateway's
	// --resume-mid-stream; its trailers X-KVC-Resumed-From, X-KVC-Resumed-Decode-Worker).
	ResumedFrom string `json:"resumed_from,omitempty"`
	ResumedOn   string `json:"resumed_on,omitempty"`
	// ResumedAttempts is the continuation attempts the resume ran (X-KVC-Resumed-Attempts):
	// all but the last failed before their first token on the decode workers of
	// ResumedRetriedFrom, in order (X-KVC-Resumed-Retried-From), and were retried.
	ResumedAttempts    int      `json:"resumed_attempts,omitempty"`
	ResumedRetriedFrom []string `json:"resumed_retried_from,omitempty"`

	OK        bool    `json:"ok"`
	Status    int     `json:"http_status"`
	ErrorKind string  `json:"error_kind,omitempty"` // TIMEOUT, REJECTED_BY_D, ... or CLIENT_* on the bench side
	ErrorCode string  `json:"error_code,omitempty"`
	ErrorMsg  string  `json:"error_message,omitempty"`
	TTFTS     float64 `json:"ttft_s"` // measured by the bench client; 0 when no token came
	LatencyS  float64 `json:"latency_s"`

	// Real bytes, from the decode worker's meta_info.kvc.
	ReceivedBytes  int64   `json:"received_bytes"`
	VerifiedBytes  int64   `json:"verified_bytes"`
	VerifyFailures int64   `json:"verify_failures"`
	TransferMS     float64 `json:"transfer_ms"`
	KVLenAfter     int64   `json:"kv_len_after"`

	// kvc-refworker only (meta_info.kvc of a worker run with --verify-recompute): the request
	// was recomputed from scratch in its decode worker and compared (greedy tokens, logits,
	// KV); each violation of the stated tolerance is one mismatch.
	RecomputeChecked    bool    `json:"recompute_checked,omitempty"`
	RecomputeMismatches int64   `json:"recompute_mismatches,omitempty"`
	MaxAbsLogitDiff     float64 `json:"max_abs_logit_diff,omitempty"`
	MaxAbsKVDiff        float64 `json:"max_abs_kv_diff,omitempty"`
	// The decode worker's real (append-)prefill time and its wait from PrepareReceive to the
	// transfer's end, in ms (refworker: real compute; kvc-sim: modeled).
	WorkerPrefillMS float64 `json:"worker_prefill_ms,omitempty"`
	ReceiveWaitMS   float64 `json:"receive_wait_ms,omitempty"`
	// The rest of the decode worker's time to its first token (refworker): from the request's
	// arrival there (WorkerTTFTMS), the wait for the session's previous turn, for the device
	// (another request's forward) and for pages (evictions included), in ms.
	WorkerTTFTMS float64 `json:"worker_ttft_ms,omitempty"`
	TurnWaitMS   float64 `json:"turn_wait_ms,omitempty"`
	GPUWaitMS    float64 `json:"gpu_wait_ms,omitempty"`
	AllocMS      float64 `json:"alloc_ms,omitempty"`

	// Issue 13: the workload's history edit before this turn (its kind; "" = none), and the
	// token from which the decode worker rewrote the session it held (meta_info.kvc.truncated_to).
	Edit        string `json:"edit,omitempty"`
	TruncatedTo int64  `json:"truncated_to,omitempty"`
	// PrefixCachedTokens: a local first turn reused this many tokens the decode worker held
	// for other sessions (meta_info.kvc.prefix_cached_tokens) instead of prefilling them.
	PrefixCachedTokens int64 `json:"prefix_cached_tokens,omitempty"`
}

// Reseed reports whether the request was a reseed (via snapshot or re-prefill).
func (r *Record) Reseed() bool {
	return r.Mode == "RESEED_SNAPSHOT" || r.Mode == "RESEED_PREFILL"
}
