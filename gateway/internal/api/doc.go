// Package api decodes the client-facing request bodies the gateway accepts (OpenAI
// /v1/chat/completions and /v1/completions, SGLang /generate) into one Request, and encodes the
// OpenAI-style answers and error objects. Everything here treats its input as untrusted: bad
// bodies become an *Error with a stable code and HTTP status, never a panic.
package api
