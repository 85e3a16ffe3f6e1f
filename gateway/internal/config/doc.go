// Package config parses kvc-gateway's command line: every flag is also settable by a KVC_* env
// var (the flag wins), and bad values are reported as one clear error (the binary exits 2).
package config
