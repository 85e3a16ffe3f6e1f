// Package etcdembed starts a real embedded etcd member in a program or a test: one place for the
// embed.Config (URLs, cluster, logging, quota, compaction), the wait until the member serves, free
// loopback ports and the retry when another process takes a picked port first.
//
// It imports no testing code, so binaries may link it: controlplane's embedded etcd, kvc-local's
// throwaway cluster (sim/internal/cluster) and pkg/etcdtest's test clusters are all built on it.
package etcdembed
