"""pagehash.py runs its production path here: XXH64 from the xxhash package (SGLang's own
dependency, in requirements-test.txt), not the pure-Python fallback pagehash.py takes when the
package is missing, and that path gives the Go package's vectors (pkg/pagehash/testdata)."""

import os
import subprocess
import sys

from kvcentric_sglang import pagehash

REPO = os.path.join(os.path.dirname(__file__), "..", "..", "..")


def test_xxhash_backend_picked():
    assert pagehash.backend() == "xxhash", (
        "pagehash.py fell back to its pure-Python XXH64: the xxhash package is not importable in this venv "
        "(requirements-test.txt lists it; rebuild the venv)"
    )


def test_hashes_go_through_xxhash(monkeypatch):
    def fallback(data, seed=0):
        raise AssertionError("the pure-Python XXH64 ran")

    monkeypatch.setattr(pagehash, "xxh64_pure", fallback)
    ids = list(range(1000, 1100))
    chain = pagehash.chain(ids, 16, key=7)
    assert len(chain) == 6
    monkeypatch.undo()
    assert chain == [
        pagehash.next_hash(p, ids[i * 16 : (i + 1) * 16]) for i, p in enumerate([pagehash.root(16, 7)] + chain[:-1])
    ]


def test_go_vectors_with_both_backends():
    script = os.path.join(REPO, "pkg", "pagehash", "testdata", "check_vectors.py")
    p = subprocess.run([sys.executable, script, REPO], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "backends: pure-python, xxhash" in p.stdout, p.stdout
    assert " 0 failed" in p.stdout, p.stdout
