// Package e2e holds the sidecars' integration tests: real kvc-sidecar-prefill and
// kvc-sidecar-decode processes over real sockets and the tcp transfer engine, the test process
// playing the SGLang workers (shared-memory KV pools filled with known bytes, WorkerBridge calls
// over the Unix sockets) and the control plane (a scripted one from pkg/sidecar/cptest, or the real
// kvc-controlplane binary).
package e2e
