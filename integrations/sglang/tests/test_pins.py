"""The venv is the one SGLang pins: integrations/constraints-sglang-<version>.txt carries every
versioned Requires-Dist of the installed sglang (no extras) as sglang states it, nothing stale, and
every installed package sglang names is at a version sglang accepts."""

import os
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

OURS = "# ---- ours"  # the constraints file's second section: the tests' own pins


def _sglang():
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        pytest.skip("sglang is not installed here")


def _constraints(version):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "constraints-sglang-%s.txt" % version)
    assert os.path.exists(path), "no %s for the installed sglang %s" % (path, version)
    sglang, ours, section = {}, {}, None
    for line in open(path):
        if line.startswith(OURS):
            section = ours
        line = line.split("#", 1)[0].strip()
        if line:
            r = Requirement(line)
            (sglang if section is None else ours)[canonicalize_name(r.name)] = r
    return sglang, ours


def _key(r):
    return str(r.specifier), str(r.marker or "")


def _sglang_requires():
    out = {}
    for s in metadata.requires("sglang") or []:
        r = Requirement(s)
        if r.marker is not None and "extra" in str(r.marker):
            continue
        out[canonicalize_name(r.name)] = r
    return out


def test_constraints_carry_sglangs_pins():
    version = _sglang()
    pinned, ours = _constraints(version)
    want = {n: r for n, r in _sglang_requires().items() if r.specifier}
    problems = []
    for n, r in sorted(want.items()):
        c = pinned.get(n)
        if c is None:
            problems.append("%s: sglang %s requires %s, the constraints file lacks it" % (n, version, r))
        elif _key(c) != _key(r):
            problems.append("%s: the constraints file says %s, sglang %s requires %s" % (n, c, version, r))
    for n in sorted(set(pinned) - set(want)):
        problems.append(
            "%s: in the SGLang section, but sglang %s does not pin it (move it under %r)" % (n, version, OURS)
        )
    for n in sorted(set(ours) & set(want)):
        problems.append("%s: pinned by sglang %s, so not ours to pin" % (n, version))
    assert not problems, "\n".join(problems)


def test_installed_versions_are_sglangs():
    version = _sglang()
    _, ours = _constraints(version)
    problems = []
    for n, r in sorted(list(_sglang_requires().items()) + list(ours.items()), key=lambda x: x[0]):
        if r.marker is not None and not r.marker.evaluate():
            continue
        try:
            have = metadata.version(n)
        except metadata.PackageNotFoundError:
            continue  # a constraint only holds what something installs (the GPU kernels stay out)
        if r.specifier and not r.specifier.contains(have, prereleases=True):
            problems.append("%s %s installed, the pin is %s" % (n, have, r))
    assert not problems, "\n".join(problems)
