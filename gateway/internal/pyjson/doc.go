// Package pyjson decodes JSON keeping object key order and encodes values as Python's
// json.dumps does, so the gateway writes what SGLang writes byte for byte.
package pyjson
