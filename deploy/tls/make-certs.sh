#!/usr/bin/env bash
# make-certs.sh — a private CA and role certificates for kvcentric's mutual TLS (openssl).
#
#   make-certs.sh DIR ca                          # DIR/ca.pem, DIR/ca-key.pem (keep the key offline)
#   make-certs.sh DIR cert NAME ROLE [worker:ID ...] [HOST ...]
#                                                 # DIR/NAME.pem, DIR/NAME-key.pem, signed by DIR/ca.pem
#
# ROLE is one of controlplane, sidecar, gateway, operator-read, operator-admin, or "-" for a
# certificate without a role (an etcd server or etcd client certificate, the gateway's HTTPS
# front door). A sidecar certificate must name, with worker:ID arguments, every worker id
# (--worker-id) that its holder may act as: the control plane refuses a hello for any other id
# and a prefill sidecar refuses snapshot reservations and offers made for any other worker. One
# per sidecar is the tightest; one per node listing that node's workers is allowed. IDs here
# are letters, digits, . _ - (other ids: issue with your own tooling, path-escaped). HOSTs are
# DNS names or IP addresses that clients dial (server certificates must name them:
# --advertise-addr, --advertise-peer-addr); none for client-only certificates.
#
# Example: make-certs.sh /etc/kvcentric/tls cert n1-d0 sidecar worker:n1-d0 n1.example 10.0.0.21
#
# Layout of a leaf certificate:
#   subject        CN=NAME (etcd takes its user name from the CN: use kvc-controlplane there)
#   SAN URI        spiffe://kvcentric/role/ROLE   (exactly one; absent for ROLE "-")
#   SAN URI        spiffe://kvcentric/worker/ID   (sidecar only; one per worker:ID, at least one)
#   SAN DNS / IP   the HOSTs
#   key usage      digitalSignature; extended: serverAuth+clientAuth for controlplane, sidecar
#                  and "-", clientAuth for gateway and operators
#   key            ECDSA P-256 (PKCS#8, mode 0600); validity DAYS (default 90; CA: CA_DAYS, 3650)
set -euo pipefail

die() { echo "make-certs.sh: $*" >&2; exit 2; }
[ $# -ge 2 ] || die "usage: make-certs.sh DIR ca | make-certs.sh DIR cert NAME ROLE [worker:ID ...] [HOST ...]"
command -v openssl >/dev/null || die "openssl not found"
dir=$1 cmd=$2
shift 2
mkdir -p "$dir"
umask 077

case "$cmd" in
ca)
  [ ! -e "$dir/ca-key.pem" ] || die "$dir/ca-key.pem exists; refusing to replace a CA"
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$dir/ca-key.pem"
  openssl req -x509 -new -key "$dir/ca-key.pem" -sha256 -days "${CA_DAYS:-3650}" -subj "/CN=kvcentric CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$dir/ca.pem"
  chmod 0644 "$dir/ca.pem"
  echo "wrote $dir/ca.pem and $dir/ca-key.pem"
  ;;
cert)
  [ $# -ge 2 ] || die "usage: make-certs.sh DIR cert NAME ROLE [worker:ID ...] [HOST ...]"
  name=$1 role=$2
  shift 2
  [[ "$name" =~ ^[A-Za-z0-9._-]+$ ]] || die "NAME $name: letters, digits, . _ - only"
  [ -f "$dir/ca.pem" ] && [ -f "$dir/ca-key.pem" ] || die "no CA in $dir (run: make-certs.sh $dir ca)"
  case "$role" in
  controlplane|sidecar|-) eku="serverAuth,clientAuth" ;;
  gateway|operator-read|operator-admin) eku="clientAuth" ;;
  *) die "ROLE $role: want controlplane, sidecar, gateway, operator-read, operator-admin or -" ;;
  esac
  sans=() workers=()
  [ "$role" = "-" ] || sans+=("URI:spiffe://kvcentric/role/$role")
  for h in "$@"; do
    if [[ "$h" == worker:* ]]; then
      w=${h#worker:}
      [[ "$w" =~ ^[A-Za-z0-9._-]+$ ]] || die "worker id \"$w\": letters, digits, . _ - only"
      [ "$role" = sidecar ] || die "worker:$w given for ROLE $role; only sidecar certificates name workers"
      workers+=("$w")
      sans+=("URI:spiffe://kvcentric/worker/$w")
    elif [[ "$h" =~ ^[0-9.]+$ || "$h" == *:* ]]; then sans+=("IP:$h"); else sans+=("DNS:$h"); fi
  done
  [ "$role" != sidecar ] || [ ${#workers[@]} -gt 0 ] ||
    die "a sidecar certificate must name its worker ids (worker:ID ...); the control plane refuses one that names none"
  tmp=$(mktemp -d "$dir/.tmp.XXXXXX") # same file system: the mv below is a rename
  trap 'rm -rf "$tmp"' EXIT
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature"
    echo "extendedKeyUsage=$eku"
    if [ ${#sans[@]} -gt 0 ]; then (IFS=,; echo "subjectAltName=${sans[*]}"); fi
  } >"$tmp/ext"
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$tmp/key.pem"
  openssl req -new -key "$tmp/key.pem" -subj "/CN=$name" -out "$tmp/csr.pem"
  openssl x509 -req -in "$tmp/csr.pem" -CA "$dir/ca.pem" -CAkey "$dir/ca-key.pem" -set_serial "0x$(openssl rand -hex 16)" \
    -sha256 -days "${DAYS:-90}" -extfile "$tmp/ext" -out "$tmp/cert.pem" 2>/dev/null
  chmod 0644 "$tmp/cert.pem"
  # Replace atomically, key first: a process reloading in between sees a mismatched pair, keeps
  # its previous certificates and retries at the next handshake.
  mv -f "$tmp/key.pem" "$dir/$name-key.pem"
  mv -f "$tmp/cert.pem" "$dir/$name.pem"
  shown=$role
  [ "$role" != "-" ] || shown=none
  [ ${#workers[@]} -eq 0 ] || shown="$shown, workers ${workers[*]}"
  echo "wrote $dir/$name.pem and $dir/$name-key.pem (role $shown)"
  ;;
*)
  die "unknown command $cmd (want ca or cert)"
  ;;
esac
