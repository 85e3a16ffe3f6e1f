// Package kvhints encodes and decodes kvcentric's action in SGLang's kv_hints envelope: one
// typed kvc.v1.ExecutionPayload per worker call, in protojson (docs/interfaces.md).
package kvhints
