// Package flagenv makes every flag of a flag.FlagSet also settable through a KVC_* environment
// variable (flag "bridge-socket" ↔ env KVC_BRIDGE_SOCKET). A flag given on the command line wins
// over the environment. The sim module's binaries (kvc-sim, kvc-local) use it.
package flagenv
