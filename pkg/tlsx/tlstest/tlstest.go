// Package tlstest makes a private CA and role certificates in a directory, for tests of mutual
// TLS: real ECDSA keys and X.509 certificates made with crypto/x509, written as PEM files.
package tlstest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvcentric/kvcentric/pkg/tlsx"
)

// CA is a test certificate authority; its certificate is in Path.
type CA struct {
	Cert *x509.Certificate
	Key  *ecdsa.PrivateKey
	Path string
	dir  string
}

// NewCA makes a CA and writes it to dir/<name>.pem.
func NewCA(t testing.TB, dir, name string) *CA {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber:          serial(t),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	ca := &CA{Cert: cert, Key: key, Path: filepath.Join(dir, name+".pem"), dir: dir}
	writeAtomic(t, ca.Path, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	return ca
}

// Spec describes a leaf certificate.
type Spec struct {
	// Role goes into the spiffe://kvcentric/role/<role> URI SAN; empty: no role URI.
	Role tlsx.Role
	// Workers go into spiffe://kvcentric/worker/<id> URI SANs, one each: the worker ids a
	// sidecar certificate may act as.
	Workers []string
	// ExtraURIs are added as they are (tests of malformed roles).
	ExtraURIs []string
	// Expired makes a certificate whose validity ended an hour ago.
	Expired bool
	// Hosts are DNS names or IPs; default localhost, 127.0.0.1, ::1.
	Hosts []string
}

// Issue writes a certificate and key for spec to dir/<name>.pem and dir/<name>-key.pem and
// returns the Files (CA: the CA's file). Issuing again under the same name replaces the files
// atomically (rename), as a certificate rotation does.
func (ca *CA) Issue(t testing.TB, name string, spec Spec) tlsx.Files {
	t.Helper()
	return ca.IssueAt(t, ca.dir, name, spec)
}

// IssueAt is Issue into dir (dir/<name>.pem, dir/<name>-key.pem): a CA rotation replaces files
// that an older CA issued.
func (ca *CA) IssueAt(t testing.TB, dir, name string, spec Spec) tlsx.Files {
	t.Helper()
	key := newKey(t)
	nb, na := time.Now().Add(-time.Hour), time.Now().Add(12*time.Hour)
	if spec.Expired {
		nb, na = time.Now().Add(-3*time.Hour), time.Now().Add(-time.Hour)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(t),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    nb,
		NotAfter:     na,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	hosts := spec.Hosts
	if len(hosts) == 0 {
		hosts = []string{"localhost", "127.0.0.1", "::1"}
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	if spec.Role != "" {
		tmpl.URIs = append(tmpl.URIs, spec.Role.URI())
	}
	for _, w := range spec.Workers {
		tmpl.URIs = append(tmpl.URIs, tlsx.WorkerURI(w))
	}
	for _, s := range spec.ExtraURIs {
		u, err := url.Parse(s)
		if err != nil {
			t.Fatal(err)
		}
		tmpl.URIs = append(tmpl.URIs, u)
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	f := tlsx.Files{Cert: filepath.Join(dir, name+".pem"), Key: filepath.Join(dir, name+"-key.pem"), CA: ca.Path}
	// Key first, then certificate: a reader that sees the new certificate also sees its key.
	writeAtomic(t, f.Key, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), 0o600)
	writeAtomic(t, f.Cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	return f
}

// Serial reads the serial number of the certificate in path.
func Serial(t testing.TB, path string) *big.Int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil {
		t.Fatalf("%s: no PEM", path)
	}
	c, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return c.SerialNumber
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func serial(t testing.TB) *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func writeAtomic(t testing.TB, path string, data []byte, mode os.FileMode) {
	t.Helper()
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-*")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tmp.Write(data); err != nil {
		t.Fatal(err)
	}
	if err := tmp.Chmod(mode); err != nil {
		t.Fatal(err)
	}
	if err := tmp.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		t.Fatal(err)
	}
}

// WriteBundle writes the certificates of cas into path as one PEM bundle (atomically), as an
// operator does while rotating a CA.
func WriteBundle(t testing.TB, path string, cas ...*CA) {
	t.Helper()
	var out []byte
	for _, ca := range cas {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.Cert.Raw})...)
	}
	writeAtomic(t, path, out, 0o644)
}
