package tlsx

import (
	"crypto/x509"
	"fmt"
	"net/url"
	"strings"
)

// Role is what a certificate's holder may do.
type Role string

// The roles.
const (
	// RoleSidecar is a prefill or decode sidecar: SidecarService/Connect on the control plane,
	// TransferPeerService on other sidecars.
	RoleSidecar Role = "sidecar"
	// RoleGateway is kvc-gateway: RouterService/Route and AdminService/ListWorkers.
	RoleGateway Role = "gateway"
	// RoleOperatorRead may call AdminService reads.
	RoleOperatorRead Role = "operator-read"
	// RoleOperatorAdmin may call every AdminService method, mutations included.
	RoleOperatorAdmin Role = "operator-admin"
	// RoleControlPlane is kvc-controlplane's own certificate (server; and client wherever it
	// dials another part).
	RoleControlPlane Role = "controlplane"
)

// Roles lists every role.
var Roles = []Role{RoleSidecar, RoleGateway, RoleOperatorRead, RoleOperatorAdmin, RoleControlPlane}

// TrustDomain is the authority part of role URIs.
const TrustDomain = "kvcentric"

// RoleURIPrefix starts every role URI SAN: spiffe://kvcentric/role/<role>.
const RoleURIPrefix = "spiffe://" + TrustDomain + "/role/"

// Valid reports whether r is one of Roles.
func (r Role) Valid() bool {
	for _, x := range Roles {
		if r == x {
			return true
		}
	}
	return false
}

// URI is the URI SAN that names r.
func (r Role) URI() *url.URL {
	u, _ := url.Parse(RoleURIPrefix + string(r))
	return u
}

// RoleOf returns the role named in cert's URI SANs. Exactly one spiffe://kvcentric/role/ URI
// must be present, plain (no user, query, fragment or escapes) and name a known role; other URI
// SANs are ignored.
func RoleOf(cert *x509.Certificate) (Role, error) {
	if cert == nil {
		return "", fmt.Errorf("no certificate")
	}
	var found []Role
	for _, u := range cert.URIs {
		if u == nil || u.Scheme != "spiffe" || u.Host != TrustDomain || !strings.HasPrefix(u.Path, "/role/") {
			continue
		}
		if u.User != nil || u.RawQuery != "" || u.ForceQuery || u.Fragment != "" || u.EscapedPath() != u.Path {
			return "", fmt.Errorf("certificate %q carries a malformed role URI %q", cert.Subject.CommonName, u.String())
		}
		found = append(found, Role(strings.TrimPrefix(u.Path, "/role/")))
	}
	switch {
	case len(found) == 0:
		return "", fmt.Errorf("certificate %q carries no %s<role> URI SAN", cert.Subject.CommonName, RoleURIPrefix)
	case len(found) > 1:
		return "", fmt.Errorf("certificate %q carries %d role URI SANs; want exactly one", cert.Subject.CommonName, len(found))
	case !found[0].Valid():
		return "", fmt.Errorf("certificate %q names unknown role %q", cert.Subject.CommonName, found[0])
	}
	return found[0], nil
}
