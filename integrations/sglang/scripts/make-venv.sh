#!/usr/bin/env bash
# Creates (or reuses) the venv that `make test-sglang` runs in: SGLang 0.5.23's real Python
# classes on CPU. Prints the venv's path on its last line. The pip cache is reused between runs.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
SGLANG_VERSION="${KVC_SGLANG_VERSION:-0.5.23}"
VENV="${KVC_SGLANG_VENV:-$HOME/.cache/kvcentric/venv-sglang-$SGLANG_VERSION}"
stamp="$VENV/.kvc-stamp"
want="$(cat "$here/requirements-test.txt" "$0" | sha256sum | cut -c1-16)-$SGLANG_VERSION"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "$VENV"; exit 0
fi
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip >&2
"$VENV/bin/pip" install -q -r "$here/requirements-test.txt" >&2
"$VENV/bin/pip" install -q --no-deps "sglang==$SGLANG_VERSION" >&2
echo "$want" > "$stamp"
echo "$VENV"
