package tlsx

import (
	"flag"
	"fmt"
	"strings"
)

// Files names the PEM files of one TLS identity: certificate (chain), private key and the CA
// bundle that peers are verified against.
type Files struct {
	Cert, Key, CA string
}

// Names are the flag names that fill a Files; CA empty means the set has no CA flag (server-only
// TLS such as an HTTPS front door).
type Names struct {
	Cert, Key, CA string
}

// GRPCNames are the flags of the mTLS identity every binary takes.
var GRPCNames = Names{Cert: "tls-cert", Key: "tls-key", CA: "tls-ca"}

// Register defines n's flags on fs; what says what the identity is for (usage text).
func (f *Files) Register(fs *flag.FlagSet, n Names, what string) {
	fs.StringVar(&f.Cert, n.Cert, f.Cert, "PEM certificate (chain) "+what)
	fs.StringVar(&f.Key, n.Key, f.Key, "PEM private key of --"+n.Cert)
	if n.CA != "" {
		fs.StringVar(&f.CA, n.CA, f.CA, "PEM CA bundle that peers' certificates are verified against; with --"+n.Cert+" and --"+n.Key+" turns on mutual TLS")
	}
}

// Enabled reports whether any file is named.
func (f Files) Enabled() bool { return f.Cert != "" || f.Key != "" || f.CA != "" }

// Check accepts all of n's files or none of them; a partial set is an error naming what is
// missing.
func (f Files) Check(n Names) error {
	type item struct{ flag, val string }
	items := []item{{n.Cert, f.Cert}, {n.Key, f.Key}}
	if n.CA != "" {
		items = append(items, item{n.CA, f.CA})
	}
	var set, missing []string
	for _, it := range items {
		if it.val != "" {
			set = append(set, "--"+it.flag)
		} else {
			missing = append(missing, "--"+it.flag)
		}
	}
	if len(set) == 0 || len(missing) == 0 {
		return nil
	}
	all := make([]string, 0, len(items))
	for _, it := range items {
		all = append(all, "--"+it.flag)
	}
	return fmt.Errorf("%s go together: %s given but %s missing", strings.Join(all, ", "),
		strings.Join(set, ", "), strings.Join(missing, ", "))
}
