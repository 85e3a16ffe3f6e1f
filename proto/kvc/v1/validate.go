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
// in one pass over its bytes.
func plainASCII(v string) bool {
	for i := 0; i < len(v); i++ {
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
