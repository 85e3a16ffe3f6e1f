#!/usr/bin/env python3
"""Checks integrations/sglang/kvcentric_sglang/pagehash.py against vectors.json (written by
the Go package). Runs the pure-Python XXH64 always, and the xxhash package too when it is
installed. Usage: check_vectors.py [REPO_ROOT]. Prints 'N passed, 0 failed' or exits 1."""
import importlib.util
import json
import os
import sys

here = os.path.dirname(os.path.abspath(__file__))
repo = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "..", "..")
path = os.path.join(repo, "integrations", "sglang", "kvcentric_sglang", "pagehash.py")
spec = importlib.util.spec_from_file_location("kvc_pagehash", path)
ph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ph)
vec = json.load(open(os.path.join(here, "vectors.json")))

backends = [("pure-python", None)]
if ph._xxhash is not None:
    backends.append(("xxhash", ph._xxhash))
passed = failed = 0


def check(what, got, want):
    global passed, failed
    if got == want:
        passed += 1
    else:
        failed += 1
        print(f"FAIL {what}: got {got:#018x} want {want:#018x}", file=sys.stderr)


for name, mod in backends:
    ph._xxhash = mod
    for v in vec["xxh64"]:
        check(f"{name} xxh64 {v['data_hex'][:16]} seed {v['seed']}", ph.xxh64(bytes.fromhex(v["data_hex"]), int(v["seed"], 16)), int(v["hash"], 16))
    for c in vec["cases"]:
        ps, key, ids = c["page_size"], int(c["key"], 16), c["ids"]
        check(f"{name} root P={ps}", ph.root(ps, key), int(c["root"], 16))
        got = ph.chain(ids, ps, key)
        want = [int(h, 16) for h in c["chain"]]
        if got != want:
            failed += 1
            print(f"FAIL {name} chain P={ps} n={len(ids)}", file=sys.stderr)
        else:
            passed += 1
        for p in c["prefix"]:
            check(f"{name} prefix P={ps} n={p['n']}", ph.prefix_hash(ids, p["n"], ps, key), int(p["hash"], 16))
        other = [int(h, 16) for h in c["edited_chain"]]
        n = ph.common_pages(want, other)
        if n != c["common_pages"]:
            failed += 1
            print(f"FAIL {name} common_pages {n} want {c['common_pages']}", file=sys.stderr)
        else:
            passed += 1
print("backends: " + ", ".join(b for b, _ in backends))
print(f"pagehash: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
