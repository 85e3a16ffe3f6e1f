// Package kvpool holds KV pools in shared memory for development and tests (a worker creates its
// pool in a /dev/shm file or memfd and its sidecar maps it: the CPU analog of CUDA IPC), and the
// known-bytes pattern (FillToken / CheckToken) with which simulated workers fill their KV so that
// every transferred byte is verified by the receiver.
package kvpool
