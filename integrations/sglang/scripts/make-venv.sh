#!/usr/bin/env bash
# Creates (or reuses) the venv that `make test-sglang` runs in: SGLang's real Python classes on CPU,
# every package at SGLang's own pin (integrations/constraints-sglang-<version>.txt). Prints the
# venv's path on its last line. The pip cache is reused between runs.
#
# The venv is named by a hash of what it is made from (requirements, constraints, this script), so
# a change makes a new one instead of rewriting one that another checkout may be using; concurrent
# callers wait on a lock and one of them builds. KVC_SGLANG_VENV names a fixed path instead (rebuilt
# from scratch when its stamp differs). An unfinished build leaves no stamp and is redone.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
SGLANG_VERSION="${KVC_SGLANG_VERSION:-0.5.23}"
PYTHON="${KVC_PYTHON:-python3}"
constraints="$(cd "$here/.." && pwd)/constraints-sglang-$SGLANG_VERSION.txt"
if [[ ! -f "$constraints" ]]; then
  echo "make-venv.sh: $constraints missing: SGLang $SGLANG_VERSION's pins (see integrations/sglang/README.md)" >&2
  exit 1
fi
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "make-venv.sh: sglang $SGLANG_VERSION needs Python >= 3.11 ($PYTHON is $("$PYTHON" -V 2>&1); set KVC_PYTHON)" >&2
  exit 1
fi
want="$(cat "$here/requirements-test.txt" "$constraints" "$0" | sha256sum | cut -c1-12)-$SGLANG_VERSION"
VENV="${KVC_SGLANG_VENV:-$HOME/.cache/kvcentric/venv-sglang-$SGLANG_VERSION-${want%-*}}"
stamp="$VENV/.kvc-stamp"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "$VENV"; exit 0
fi
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
if command -v flock >/dev/null 2>&1 && ! flock -n 9; then
  echo "make-venv.sh: another build of $VENV is under way: waiting for it" >&2
  flock 9
fi
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
  echo "make-venv.sh: building $VENV (SGLang $SGLANG_VERSION; first use downloads ~3 GB)" >&2
  "$PYTHON" -m venv --clear "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >&2
  "$VENV/bin/pip" install -q -c "$constraints" -r "$here/requirements-test.txt" >&2
  "$VENV/bin/pip" install -q --no-deps "sglang==$SGLANG_VERSION" >&2
  echo "$want" > "$stamp"
fi
echo "$VENV"
