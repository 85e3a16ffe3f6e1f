package flagenv

import (
	"errors"
	"flag"
	"fmt"
	"strings"
)

// EnvName is the environment variable of a flag: KVC_ plus the name in upper snake case.
func EnvName(flagName string) string {
	return "KVC_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// Apply sets every flag of fs that was not given on the command line (fs is parsed) from its
// EnvName variable, looked up with getenv (os.Getenv in production), when that is not empty.
// Every bad value is reported, joined, each naming the variable and the flag.
func Apply(fs *flag.FlagSet, getenv func(string) string) error {
	if getenv == nil {
		return nil
	}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		if given[f.Name] {
			return
		}
		env := EnvName(f.Name)
		v := getenv(env)
		if v == "" {
			return
		}
		if err := fs.Set(f.Name, v); err != nil {
			errs = append(errs, fmt.Errorf("%s=%q (flag --%s): %w", env, v, f.Name, err))
		}
	})
	return errors.Join(errs...)
}

// Parse parses args into fs, refuses positional arguments, then applies the environment (Apply).
func Parse(fs *flag.FlagSet, args []string, getenv func(string) string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	return Apply(fs, getenv)
}
