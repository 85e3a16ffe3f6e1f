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
	// Insecure is the explicit choice of plaintext (Names.Insecure's flag): with a Names that
	// has such a flag, Check refuses neither files nor Insecure.
	Insecure bool
}

// Names are the flag names that fill a Files; CA empty means the set has no CA flag (server-only
// TLS such as an HTTPS front door). Insecure non-empty names the flag that must be given to run
// without TLS (then plaintext is never a silent default).
type Names struct {
	Cert, Key, CA string
	Insecure      string
}

// GRPCNames are the flags of the mTLS identity every binary takes: mutual TLS, or plaintext
// only when --insecure says so.
var GRPCNames = Names{Cert: "tls-cert", Key: "tls-key", CA: "tls-ca", Insecure: "insecure"}

// Register defines n's flags on fs; what says what the identity is for (usage text).
func (f *Files) Register(fs *flag.FlagSet, n Names, what string) {
	fs.StringVar(&f.Cert, n.Cert, f.Cert, "PEM certificate (chain) "+what)
	fs.StringVar(&f.Key, n.Key, f.Key, "PEM private key of --"+n.Cert)
	if n.CA != "" {
		fs.StringVar(&f.CA, n.CA, f.CA, "PEM CA bundle that peers' certificates are verified against; with --"+n.Cert+" and --"+n.Key+" turns on mutual TLS")
	}
	if n.Insecure != "" {
		fs.BoolVar(&f.Insecure, n.Insecure, f.Insecure, "run gRPC in plaintext without authentication (development and tests only: anyone who reaches a port can act as any part); required when no --"+n.Cert+" is given")
	}
}

// Enabled reports whether any file is named.
func (f Files) Enabled() bool { return f.Cert != "" || f.Key != "" || f.CA != "" }

// Check accepts all of n's files or none of them; a partial set is an error naming what is
// missing. When n has an Insecure flag, none of them is accepted only with Insecure, and
// Insecure with files is refused.
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
	if n.Insecure != "" {
		switch {
		case len(set) == 0 && !f.Insecure:
			return fmt.Errorf("no transport security chosen: give --%s, --%s and --%s for mutual TLS, or --%s for plaintext (development only)", n.Cert, n.Key, n.CA, n.Insecure)
		case len(set) > 0 && f.Insecure:
			return fmt.Errorf("--%s contradicts %s: choose mutual TLS or plaintext", n.Insecure, strings.Join(set, ", "))
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
