// Package proctest reads the event logs of sidecar processes for the sidecar integration tests
// (internal/e2e) and the GPU benchmark harness (internal/gpubench), which start them with
// pkg/launch. It is imported by tests only.
package proctest
