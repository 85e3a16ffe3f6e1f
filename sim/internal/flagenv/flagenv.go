package flagenv

import (
	"flag"

	"github.com/kvcentric/kvcentric/pkg/flagenv"
)

// EnvName is pkg/flagenv.EnvName.
func EnvName(flagName string) string { return flagenv.EnvName(flagName) }

// Parse is pkg/flagenv.Parse (kept only until kvc-bench imports pkg/flagenv directly).
func Parse(fs *flag.FlagSet, args []string, getenv func(string) string) error {
	return flagenv.Parse(fs, args, getenv)
}
