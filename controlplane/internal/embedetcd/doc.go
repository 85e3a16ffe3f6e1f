// Package embedetcd runs a single-member etcd inside the control plane process: the
// development default when no --etcd-endpoints are given. Data lives in the data directory;
// client and peer listen addresses are host:port (port 0 picks a free port).
package embedetcd
