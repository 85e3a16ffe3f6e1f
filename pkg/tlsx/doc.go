// Package tlsx is kvcentric's transport security: mutual TLS between all parts, the caller's
// role carried in its certificate, and a per-method authorization table.
//
// Files: every binary takes --tls-cert, --tls-key and --tls-ca (KVC_TLS_CERT, KVC_TLS_KEY,
// KVC_TLS_CA). All three turn mTLS on; none keeps today's plaintext (the development default);
// any other combination is a flag error (Files.Check). A Source loads the files and re-reads
// them whenever one changes on disk (mtime, size or inode), at the next handshake, so a rotated
// certificate or CA is picked up without a restart; a reload that fails (a half-written pair)
// keeps the previous material and is retried at the next handshake.
//
// Roles: a certificate names its holder's role in one URI SAN, spiffe://kvcentric/role/<role>
// (RoleURIPrefix), with roles sidecar, gateway, operator-read, operator-admin and controlplane.
// A URI SAN is what SPIFFE uses for workload identity; it is independent of host names (which
// stay in DNS/IP SANs for ordinary host-name verification) and is checked by Go's x509
// verification like any other SAN-bearing certificate.
//
// Servers (grpcx.WithTLS) require and verify client certificates against the CA (TLS 1.3
// minimum) and check every call against Table: the caller's role must be listed for the full
// method name; methods missing from the table are denied; a denial is PERMISSION_DENIED naming
// role and method. Clients (ClientCredentials) verify the server's chain against the CA and its
// host name as usual, and also the server's role (a sidecar certificate cannot pose as the
// control plane).
//
// Worker identity: a sidecar certificate also names every worker id its holder may act as, one
// URI SAN each, spiffe://kvcentric/worker/<worker_id> (WorkerURIPrefix, WorkerURI, WorkersOf).
// Handlers whose request carries the caller's own worker id (the control plane's hello, a
// prefill sidecar's ReserveSnapshot and OfferReceive) call PeerAllowsWorker: nil on a plaintext
// connection, PERMISSION_DENIED naming the id when the certificate does not name it (or names
// no worker at all).
//
// Plaintext is never a default: GRPCNames has an Insecure flag (--insecure), and Files.Check
// refuses neither certificates nor --insecure, and both. Load logs --insecure at error level.
// Servers log every refused handshake at warn ("tls: handshake refused" with the peer and the
// reason; beyond 20 lines a second a flood's excess is counted in the next line's
// "suppressed") and count them (HandshakeFailures, kvc_tls_handshake_failures_total).
package tlsx
