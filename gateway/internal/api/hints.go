package api

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"strings"
)

// Agent hints (issue 13 item 5): what an agent tells the control plane about its session.
// Each comes from a header, else from the OpenAI "metadata" object (string values, as OpenAI
// defines it; a JSON number or boolean is accepted too), else from the "kvc" extension object.
const (
	// HeaderPinMs pins the session on its decode worker for this many ms after the answer.
	HeaderPinMs = "X-KVC-Pin-Ms"
	// HeaderRelease ends the session after this request's answer.
	HeaderRelease = "X-KVC-Release"
	// HeaderPriority is "low" or "normal".
	HeaderPriority = "X-KVC-Priority"

	// MaxPinMs is the longest pin a client may ask for (24 h); the control plane clamps it
	// further to its policy (Policy.max_pin_ms).
	MaxPinMs = 24 * 60 * 60 * 1000
)

// Stable error codes of the hints (HTTP 400).
const (
	CodeInvalidPin      = "invalid_pin_ms"
	CodeInvalidRelease  = "invalid_release"
	CodeInvalidPriority = "invalid_priority"
	CodeConflictingHint = "conflicting_hints"
	CodeHintNoSession   = "hint_without_session"
)

// Hints are a request's agent hints.
type Hints struct {
	// PinMs > 0 pins the session for that long after the answer (RouteQuery.pin_ms).
	PinMs int64
	// Release ends the session once this request's answer is sent (the session-end path:
	// RouteQuery.end_session after the answer).
	Release bool
	// LowPriority marks the session low priority (RouteQuery.low_priority).
	LowPriority bool
}

func hintError(code, format string, a ...any) *Error {
	return &Error{Status: http.StatusBadRequest, Code: code, Message: fmt.Sprintf(format, a...)}
}

// hintValue is a hint's text: the header's, else the metadata's, else the kvc object's; src
// names where it came from (for the error message). ok is false when none sets it.
func hintValue(h http.Header, header string, meta map[string]json.RawMessage, metaKey string, ext json.RawMessage, extKey string) (v, src string, ok bool, err *Error) {
	if hv := h.Values(header); len(hv) > 0 {
		if len(hv) > 1 {
			return "", header, true, BadRequest("%s given %d times", header, len(hv))
		}
		return strings.TrimSpace(hv[0]), header, true, nil
	}
	raw, have := meta[metaKey]
	src = "metadata." + metaKey
	if !have && ext != nil {
		raw, have = json.RawMessage(ext), true
		src = "kvc." + extKey
	}
	if !have {
		return "", "", false, nil
	}
	t := strings.TrimSpace(string(raw))
	if t == "null" {
		return "", "", false, nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return strings.TrimSpace(s), src, true, nil
	}
	if t == "true" || t == "false" || (len(t) > 0 && (t[0] == '-' || (t[0] >= '0' && t[0] <= '9'))) {
		return t, src, true, nil
	}
	return "", src, true, BadRequest("%s must be a string, a number or a boolean", src)
}

// parseHints reads the agent hints of a request whose session id is sid.
func parseHints(h http.Header, b *body, sid string) (Hints, *Error) {
	var hs Hints
	meta := b.Metadata
	var ext kvcExt
	if b.KVC != nil {
		ext = *b.KVC
	}

	v, src, ok, err := hintValue(h, HeaderPinMs, meta, "kvc_pin_ms", ext.PinMs, "pin_ms")
	if err != nil {
		return hs, err
	}
	if ok {
		n, perr := strconv.ParseInt(v, 10, 64)
		if perr != nil || n < 0 || n > MaxPinMs {
			return hs, hintError(CodeInvalidPin, "%s %q: want a whole number of milliseconds in [0, %d]", src, v, MaxPinMs)
		}
		hs.PinMs = n
	}

	v, src, ok, err = hintValue(h, HeaderRelease, meta, "kvc_release", ext.Release, "release")
	if err != nil {
		return hs, err
	}
	if ok {
		r, perr := strconv.ParseBool(v)
		if perr != nil {
			return hs, hintError(CodeInvalidRelease, "%s %q: want true or false", src, v)
		}
		hs.Release = r
	}

	v, src, ok, err = hintValue(h, HeaderPriority, meta, "kvc_priority", ext.Priority, "priority")
	if err != nil {
		return hs, err
	}
	if ok {
		switch strings.ToLower(v) {
		case "low":
			hs.LowPriority = true
		case "normal", "":
		default:
			return hs, hintError(CodeInvalidPriority, "%s %q: want low or normal", src, v)
		}
	}

	if hs.Release && hs.PinMs > 0 {
		return hs, hintError(CodeConflictingHint, "a request cannot both pin its session (pin %d ms) and release it", hs.PinMs)
	}
	if sid == "" && (hs.PinMs > 0 || hs.Release || hs.LowPriority) {
		return hs, hintError(CodeHintNoSession, "agent hints (pin, release, priority) need a session id: set X-Session-ID or session_params.id")
	}
	return hs, nil
}
