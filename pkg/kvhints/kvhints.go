package kvhints

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
	"google.golang.org/protobuf/encoding/protojson"
)

// The envelope's protocol version (SGLang's KvHintsEnvelope) and kvcentric's action in it.
const (
	ProtocolVersion = 1
	ActionType      = "kvc"
	// ActionVersion 2: the payload is an ExecutionPayload (version 1 was a mode name plus loose
	// fields, never deployed).
	ActionVersion = 2
)

// Stable error codes of a kv_hints envelope a worker refuses (Error.Code).
const (
	CodeMalformed       = "kv_hints_malformed"        // not an envelope, or a payload that is not an ExecutionPayload
	CodeProtocolVersion = "kv_hints_protocol_version" // another protocol_version
	CodeActionVersion   = "kv_hints_action_version"   // a kvc action of another action_version
	CodeTwoActions      = "kv_hints_two_actions"      // more than one kvc action
)

// Error is why an envelope was refused: a stable code and a message naming the field.
type Error struct {
	Code string
	Msg  string
}

func (e *Error) Error() string { return "kv_hints: " + e.Msg }

func errf(code, format string, a ...any) *Error {
	return &Error{Code: code, Msg: fmt.Sprintf(format, a...)}
}

// Envelope is SGLang's KvHintsEnvelope (sglang.srt.managers.kv_hints).
type Envelope struct {
	ProtocolVersion int      `json:"protocol_version"`
	MessageID       string   `json:"message_id"`
	Actions         []Action `json:"actions"`
}

// Action is one orchestrator's action in an envelope.
type Action struct {
	ActionID      string          `json:"action_id"`
	ActionType    string          `json:"action_type"`
	ActionVersion int             `json:"action_version"`
	Payload       json.RawMessage `json:"payload"`
}

var (
	marshal   = protojson.MarshalOptions{UseProtoNames: true}
	unmarshal = protojson.UnmarshalOptions{}
)

// RoleName is the action id's suffix for a worker role ("prefill", "decode", "" otherwise).
func RoleName(r kvcv1.WorkerRole) string {
	switch r {
	case kvcv1.WorkerRole_WORKER_ROLE_PREFILL:
		return "prefill"
	case kvcv1.WorkerRole_WORKER_ROLE_DECODE:
		return "decode"
	}
	return ""
}

// Build is the kv_hints envelope carrying p as its one kvc action, message id messageID and
// action id messageID/role.
func Build(messageID string, p *kvcv1.ExecutionPayload) (*Envelope, error) {
	raw, err := marshal.Marshal(p)
	if err != nil {
		return nil, fmt.Errorf("kv_hints payload: %w", err)
	}
	return &Envelope{ProtocolVersion: ProtocolVersion, MessageID: messageID, Actions: []Action{{
		ActionID: messageID + "/" + RoleName(p.GetRole()), ActionType: ActionType, ActionVersion: ActionVersion,
		Payload: raw,
	}}}, nil
}

// Parse returns the kvc action's payload of a kv_hints envelope in raw JSON (nil, nil when raw
// is empty or null, or the envelope carries no kvc action: the actions of other types are other
// orchestrators'). Every refusal is an *Error.
func Parse(raw json.RawMessage) (*kvcv1.ExecutionPayload, error) {
	if len(bytes.TrimSpace(raw)) == 0 || string(bytes.TrimSpace(raw)) == "null" {
		return nil, nil
	}
	var env Envelope
	if err := json.Unmarshal(raw, &env); err != nil {
		return nil, errf(CodeMalformed, "not an envelope: %v", err)
	}
	return FromEnvelope(&env)
}

// FromEnvelope is Parse of a decoded envelope.
func FromEnvelope(env *Envelope) (*kvcv1.ExecutionPayload, error) {
	if env.ProtocolVersion != ProtocolVersion {
		return nil, errf(CodeProtocolVersion, "protocol_version %d is not supported (want %d)", env.ProtocolVersion, ProtocolVersion)
	}
	var out *kvcv1.ExecutionPayload
	for i, a := range env.Actions {
		if a.ActionType != ActionType {
			continue
		}
		if a.ActionVersion != ActionVersion {
			return nil, errf(CodeActionVersion, "actions[%d]: kvc action_version %d is not supported (want %d)", i, a.ActionVersion, ActionVersion)
		}
		if out != nil {
			return nil, errf(CodeTwoActions, "more than one kvc action")
		}
		out = &kvcv1.ExecutionPayload{}
		if len(bytes.TrimSpace(a.Payload)) == 0 {
			return nil, errf(CodeMalformed, "actions[%d].payload: missing", i)
		}
		if err := unmarshal.Unmarshal(a.Payload, out); err != nil {
			return nil, errf(CodeMalformed, "actions[%d].payload: %v", i, err)
		}
	}
	return out, nil
}

// IsError reports whether err is a refused envelope, and its code.
func IsError(err error) (string, bool) {
	var e *Error
	if errors.As(err, &e) {
		return e.Code, true
	}
	return "", false
}
