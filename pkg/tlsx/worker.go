package tlsx

import (
	"context"
	"crypto/x509"
	"fmt"
	"net/url"
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	kvcv1 "github.com/kvcentric/kvcentric/proto/kvc/v1"
)

// WorkerURIPrefix starts every worker URI SAN: spiffe://kvcentric/worker/<worker_id>. A sidecar
// certificate lists the worker ids its holder may act as, one URI each.
const WorkerURIPrefix = "spiffe://" + TrustDomain + "/worker/"

const workerPath = "/worker/"

// WorkerURI is the URI SAN that names worker id (path-escaped where the id needs it).
func WorkerURI(id string) *url.URL {
	return &url.URL{Scheme: "spiffe", Host: TrustDomain, Path: workerPath + id, RawPath: workerPath + url.PathEscape(id)}
}

// WorkersOf returns the worker ids named in cert's spiffe://kvcentric/worker/ URI SANs, in
// certificate order, without duplicates; none is an empty list, not an error. Each such URI must
// be plain (no user, query or fragment), its last segment must be the id in canonical path
// escaping (url.PathEscape) and the id must be a valid API id (kvcv1.ValidateID, so no '/');
// otherwise the whole certificate is refused. Other URI SANs are ignored.
func WorkersOf(cert *x509.Certificate) ([]string, error) {
	if cert == nil {
		return nil, fmt.Errorf("no certificate")
	}
	var out []string
	for _, u := range cert.URIs {
		if u == nil || u.Scheme != "spiffe" || u.Host != TrustDomain || !strings.HasPrefix(u.Path, workerPath) {
			continue
		}
		bad := func(why string) error {
			return fmt.Errorf("certificate %q carries a malformed worker URI %q: %s", cert.Subject.CommonName, u.String(), why)
		}
		if u.User != nil || u.RawQuery != "" || u.ForceQuery || u.Fragment != "" || u.Opaque != "" {
			return nil, bad("user, query or fragment")
		}
		raw, ok := strings.CutPrefix(u.EscapedPath(), workerPath)
		if !ok {
			return nil, bad("escaped prefix")
		}
		id, err := url.PathUnescape(raw)
		if err != nil || url.PathEscape(id) != raw {
			return nil, bad("the worker id must be one path segment in canonical escaping")
		}
		if err := kvcv1.ValidateID("worker id", id); err != nil {
			return nil, bad(err.Error())
		}
		if !slices.Contains(out, id) {
			out = append(out, id)
		}
	}
	return out, nil
}

// CertAllowsWorker is nil when cert names worker id, else a PERMISSION_DENIED status naming the
// id, the certificate and the ids it does name.
func CertAllowsWorker(cert *x509.Certificate, id string) error {
	if cert == nil {
		return status.Errorf(codes.Unauthenticated, "no verified client certificate to act as worker %q", id)
	}
	ids, err := WorkersOf(cert)
	if err != nil {
		return status.Errorf(codes.PermissionDenied, "worker %q: %v", id, err)
	}
	if len(ids) == 0 {
		return status.Errorf(codes.PermissionDenied, "certificate %q names no worker (%s<worker_id> URI SAN); it may not act as worker %q",
			cert.Subject.CommonName, WorkerURIPrefix, id)
	}
	if !slices.Contains(ids, id) {
		return status.Errorf(codes.PermissionDenied, "certificate %q may not act as worker %q (it names %s)",
			cert.Subject.CommonName, id, strings.Join(quoteAll(ids), ", "))
	}
	return nil
}

// PeerAllowsWorker checks that the caller of the call in ctx may act as worker id: nil when its
// verified certificate names id, PERMISSION_DENIED when it does not, UNAUTHENTICATED when a TLS
// connection has no verified certificate. It is nil in plaintext mode (no TLS on the
// connection), where there is no identity to check.
func PeerAllowsWorker(ctx context.Context, id string) error {
	p, ok := peer.FromContext(ctx)
	if !ok || p.AuthInfo == nil {
		return nil
	}
	if _, ok := p.AuthInfo.(credentials.TLSInfo); !ok {
		return nil
	}
	return CertAllowsWorker(PeerCertificate(ctx), id)
}

func quoteAll(s []string) []string {
	out := make([]string, len(s))
	for i, x := range s {
		out[i] = fmt.Sprintf("%q", x)
	}
	return out
}
