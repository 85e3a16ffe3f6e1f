// Package proctest runs kvcentric binaries as real processes for the sidecar integration tests
// (internal/e2e) and the GPU benchmark harness (internal/gpubench): it finds them in
// $KVC_BIN_DIR or builds them, starts them with a ready file and waits for it, stops them, and
// reads their event logs. It is imported by tests only.
package proctest
