package launch

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
)

// Binaries returns the path of each binary of need (name → the directory of the module holding
// cmd/<name>, relative to the caller's working directory): from dir ($KVC_BIN_DIR) when it has
// it, else built with CGO_ENABLED=0 into a temporary directory that cleanup removes (cleanup is
// never nil). A binary named in optional whose cmd/<name> does not exist or does not build is
// left out.
func Binaries(dir string, need map[string]string, optional ...string) (bins map[string]string, cleanup func(), err error) {
	bins = map[string]string{}
	tmp := ""
	cleanup = func() {
		if tmp != "" {
			_ = os.RemoveAll(tmp)
		}
	}
	for name, mod := range need {
		if dir != "" {
			if p, err := filepath.Abs(filepath.Join(dir, name)); err == nil {
				if _, err := os.Stat(p); err == nil {
					bins[name] = p
					continue
				}
			}
		}
		if _, err := os.Stat(filepath.Join(mod, "cmd", name)); err != nil {
			if slices.Contains(optional, name) {
				continue
			}
			return nil, cleanup, fmt.Errorf("%s: no %s", name, filepath.Join(mod, "cmd", name))
		}
		if tmp == "" {
			if tmp, err = os.MkdirTemp("", "kvc-launch-bin-"); err != nil {
				return nil, cleanup, err
			}
		}
		out := filepath.Join(tmp, name)
		cmd := exec.Command("go", "build", "-o", out, "./cmd/"+name)
		cmd.Dir = mod
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if b, err := cmd.CombinedOutput(); err != nil {
			if slices.Contains(optional, name) {
				fmt.Fprintf(os.Stderr, "build %s (optional, left out): %v\n%s", name, err, b)
				continue
			}
			return nil, cleanup, fmt.Errorf("build %s (or set KVC_BIN_DIR): %v\n%s", name, err, b)
		}
		bins[name] = out
	}
	return bins, cleanup, nil
}
