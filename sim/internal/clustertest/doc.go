// Package clustertest finds the built kvcentric binaries for the sim module's tests that run
// them (cluster, bench, kvc-local); only _test.go files import it (no binary links testing).
package clustertest
