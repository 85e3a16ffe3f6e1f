package kvcv1

import (
	"fmt"
	"unicode/utf8"
)

// MaxIDLen bounds every id (worker, session, node) carried in the API.
const MaxIDLen = 256

// ValidateID checks an id field: non-empty, at most MaxIDLen bytes, valid UTF-8, printable
// (no control characters or '/', which would break etcd key layout).
func ValidateID(field, v string) error {
	if v == "" {
		return fmt.Errorf("%s is required", field)
	}
	if len(v) > MaxIDLen {
		return fmt.Errorf("%s is %d bytes, longer than %d", field, len(v), MaxIDLen)
	}
	if plainASCII(v) {
		return nil // the common id: one pass over its bytes (the checks below decode runes twice)
	}
	if !utf8.ValidString(v) {
		return fmt.Errorf("%s is not valid UTF-8", field)
	}
	for _, r := range v {
		if r < 0x20 || r == 0x7f || r == '/' {
			return fmt.Errorf("%s contains a forbidden character %q", field, r)
		}
	}
	return nil
}

// plainASCII reports whether v is printable ASCII without '/': an id ValidateID accepts, found
// in one pass over its bytes, eight at a time.
func plainASCII(v string) bool {
	const ones, highs = 0x0101010101010101, 0x8080808080808080
	i := 0
	for ; i+8 <= len(v); i += 8 {
		w := v[i : i+8]
		x := uint64(w[0]) | uint64(w[1])<<8 | uint64(w[2])<<16 | uint64(w[3])<<24 |
			uint64(w[4])<<32 | uint64(w[5])<<40 | uint64(w[6])<<48 | uint64(w[7])<<56 // one load
		// Any byte < 0x20, any >= 0x7f, any == '/': each test is exact for "some byte of x"
		// (a borrow or carry crosses into the next byte only from a byte the test flags).
		below := (x - 0x20*ones) &^ x
		above := (x + ones) | x
		y := x ^ '/'*ones
		slash := (y - ones) &^ y
		if (below|above|slash)&highs != 0 {
			return false
		}
	}
	for ; i < len(v); i++ {
		if c := v[i]; c < 0x20 || c >= 0x7f || c == '/' {
			return false
		}
	}
	return true
}

// ValidateOptionalID is ValidateID for fields that may be empty.
func ValidateOptionalID(field, v string) error {
	if v == "" {
		return nil
	}
	return ValidateID(field, v)
}

// ValidateTokenIDs checks an optional token id field that covers tokens tokens: empty, or
// exactly tokens ids, each in [0, 2^31) (int32 holds nothing above; negative ids are refused).
func ValidateTokenIDs(field string, ids []int32, tokens int64) error {
	if len(ids) == 0 {
		return nil
	}
	if int64(len(ids)) != tokens {
		return fmt.Errorf("%s: %d ids for %d tokens (want exactly %d, or none)", field, len(ids), tokens, tokens)
	}
	for i, id := range ids {
		if id < 0 {
			return fmt.Errorf("%s[%d] = %d is negative (ids are in [0, 2^31))", field, i, id)
		}
	}
	return nil
}

// Validate implements the request validation of AdminService.GetWorker.
func (r *GetWorkerRequest) Validate() error { return ValidateID("worker_id", r.GetWorkerId()) }

// Validate implements the request validation of AdminService.GetSession.
func (r *GetSessionRequest) Validate() error { return ValidateID("session_id", r.GetSessionId()) }

// Validate implements the request validation of AdminService.DrainWorker.
func (r *DrainWorkerRequest) Validate() error { return ValidateID("worker_id", r.GetWorkerId()) }

// Validate implements the request validation of AdminService.ListSessions.
func (r *ListSessionsRequest) Validate() error {
	if r.GetPageSize() < 0 || r.GetPageSize() > 1000 {
		return fmt.Errorf("page_size %d out of range [0, 1000]", r.GetPageSize())
	}
	if len(r.GetPageToken()) > 4*MaxIDLen {
		return fmt.Errorf("page_token too long")
	}
	return ValidateOptionalID("worker_id", r.GetWorkerId())
}

// Validate implements the request validation of AdminService.ListWorkers.
func (r *ListWorkersRequest) Validate() error {
	if _, ok := WorkerRole_name[int32(r.GetRole())]; !ok {
		return fmt.Errorf("unknown role %d", r.GetRole())
	}
	return nil
}

// Validate implements the request validation of AdminService.UpdatePolicy (shape only; the
// control plane checks ranges of the merged policy).
func (r *UpdatePolicyRequest) Validate() error {
	if r.GetPolicy() == nil {
		return fmt.Errorf("policy is required")
	}
	return nil
}
