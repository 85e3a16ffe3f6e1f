package flagenv

import (
	"flag"
	"fmt"
	"strings"
)

// EnvName is the environment variable of a flag: KVC_ plus the name in upper snake case.
func EnvName(flagName string) string {
	return "KVC_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// Parse parses args into fs, then sets every flag that was not on the command line from its
// KVC_* environment variable (looked up with getenv) when that is non-empty. An invalid
// environment value is an error naming the variable.
func Parse(fs *flag.FlagSet, args []string, getenv func(string) string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if err != nil || given[f.Name] || getenv == nil {
			return
		}
		env := EnvName(f.Name)
		v := getenv(env)
		if v == "" {
			return
		}
		if e := fs.Set(f.Name, v); e != nil {
			err = fmt.Errorf("invalid value %q for %s (flag --%s): %v", v, env, f.Name, e)
		}
	})
	return err
}
