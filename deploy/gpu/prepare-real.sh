#!/usr/bin/env bash
# Prepares the real-model GPU run (issue 12 item 4) on a machine WITH Go: static, stripped
# binaries of every part kvc-bench starts (control plane, both sidecars, gateway) plus kvc-bench
# and kvc-local, packed into one xz tarball small enough to carry (the GPU machine takes 64 MiB
# per upload; the tarball is ~25 MiB). The Python side (integrations/refworker,
# integrations/sglang) is plain source in the repository and needs no build.
#
#   bash deploy/gpu/prepare-real.sh          # -> bin/real.tar.xz (and bin/real/)
#
# Then, on the GPU machine, from the repository root with bin/real.tar.xz carried:
#   bash deploy/gpu/run-real.sh
set -euo pipefail
# Go 1.27 (go.work, every go.mod): the go command fetches this toolchain from the module proxy.
export GOTOOLCHAIN=go1.27.3
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="$root/bin/real"
mkdir -p "$out"
build() { # module cmd
	echo "build $2" >&2
	(cd "$root/$1" && CGO_ENABLED=0 go build -trimpath -ldflags="-s -w" -o "$out/$2" "./cmd/$2")
}
build controlplane kvc-controlplane
build sidecar-prefill kvc-sidecar-prefill
build sidecar-decode kvc-sidecar-decode
build gateway kvc-gateway
build sim kvc-bench
build sim kvc-local
tar -C "$root/bin" -cJf "$root/bin/real.tar.xz" real
ls -l "$root/bin/real.tar.xz" >&2
echo "carry bin/real.tar.xz to the GPU machine and run: bash deploy/gpu/run-real.sh" >&2
