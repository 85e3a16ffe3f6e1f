// Package launch starts kvcentric binaries as child processes and waits for them (their ready
// file, or any condition): the one launcher of the integration and fault tests, kvc-local and
// kvc-bench; it never imports testing (TB is the little of it the test helpers need).
package launch
