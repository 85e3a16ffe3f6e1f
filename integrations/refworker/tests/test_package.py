"""kvc-refworker installs on its own: its wheel builds from a copy of the repository's
integrations/ folder, `pip install integrations/refworker` into a fresh venv resolves every declared
requirement without a package index (kvcentric-sglang from the folder next to it, the rest from
what this venv holds) and the installed package imports there; and every module the package
imports is a declared requirement (or an extra's), not something that merely happens to be here."""

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import unittest
import zipfile
from email.parser import Parser
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

HERE = os.path.dirname(os.path.abspath(__file__))
INTEGRATIONS = os.path.normpath(os.path.join(HERE, "..", ".."))
MODULES = ["cli", "model", "pool", "request", "server", "transport", "worker"]
_JUNK = shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "results", "tests", "tools")


def _pip(*args, timeout=300):
    p = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if p.returncode != 0:
        raise AssertionError("pip %s:\n%s%s" % (" ".join(args), p.stdout[-3000:], p.stderr[-3000:]))
    return p


class TestInstallsOnItsOwn(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="kvc-refworker-pkg-")
        src = os.path.join(cls.tmp, "integrations")
        for name in ("sglang", "refworker"):  # a clean copy: the checkout keeps no build output
            shutil.copytree(os.path.join(INTEGRATIONS, name), os.path.join(src, name), ignore=_JUNK)
        cls.src = src
        _pip(
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            os.path.join(cls.tmp, "dist"),
            os.path.join(src, "refworker"),
        )
        (cls.wheel,) = [os.path.join(cls.tmp, "dist", f) for f in os.listdir(os.path.join(cls.tmp, "dist"))]
        with zipfile.ZipFile(cls.wheel) as z:
            cls.names = z.namelist()
            meta = next(n for n in cls.names if n.endswith(".dist-info/METADATA"))
            cls.meta = Parser().parsestr(z.read(meta).decode())
            cls.sources = {n: z.read(n).decode() for n in cls.names if n.startswith("kvc_refworker/")}

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def requires(self):
        return [Requirement(r) for r in self.meta.get_all("Requires-Dist") or []]

    def test_wheel_holds_every_module(self):
        want = {"kvc_refworker/%s.py" % m for m in MODULES + ["__init__", "__main__"]}
        self.assertEqual(want - set(self.names), set())

    def test_plugin_requirement_points_at_the_folder_beside_it(self):
        r = {canonicalize_name(r.name): r for r in self.requires()}.get("kvcentric-sglang")
        self.assertIsNotNone(r, "kvc-refworker does not declare kvcentric-sglang (it imports its bridge client)")
        self.assertEqual(
            r.url,
            "file://" + os.path.join(self.src, "sglang"),
            "kvcentric-sglang is on no index: the requirement must name the folder beside it",
        )

    def test_every_import_is_declared(self):
        stdlib = set(sys.stdlib_module_names)
        imported = {}
        for name, text in self.sources.items():
            for node in ast.walk(ast.parse(text, name)):
                if isinstance(node, ast.Import):
                    tops = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    tops = [node.module.split(".")[0]]
                else:
                    continue
                for t in tops:
                    if t not in stdlib and t != "kvc_refworker":
                        imported.setdefault(t, name)
        declared = {canonicalize_name(r.name) for r in self.requires()}
        providers = metadata.packages_distributions()
        problems = []
        for mod, where in sorted(imported.items()):
            dists = {canonicalize_name(d) for d in providers.get(mod, [])}
            if not dists:
                problems.append("%s (imported by %s): no installed distribution provides it" % (mod, where))
            elif not dists & declared:
                problems.append(
                    "%s (imported by %s) comes from %s, which kvc-refworker does not declare"
                    % (mod, where, ", ".join(sorted(dists)))
                )
        self.assertEqual(problems, [])
        self.assertIn("torch", imported)  # the walk sees the imports it must

    def test_pip_install_into_a_fresh_venv(self):
        venv = os.path.join(self.tmp, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
        py = os.path.join(venv, "bin", "python")
        site = subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        # What is installed here stands in for an index: the fresh venv sees it (a .pth line) but
        # pip may take nothing from the network, so every requirement must be satisfiable as declared.
        with open(os.path.join(site, "kvc-test-deps.pth"), "w") as f:
            f.write(sysconfig.get_paths()["purelib"] + "\n")
        _pip("--python", py, "install", "-q", "--no-index", "--no-build-isolation", os.path.join(self.src, "refworker"))
        code = (
            "import importlib, kvc_refworker\n"
            "for m in %r: importlib.import_module('kvc_refworker.' + m)\n"
            "import kvcentric_sglang\n"
            "print(kvc_refworker.__file__); print(kvcentric_sglang.__file__)" % MODULES
        )
        p = subprocess.run(
            [py, "-c", code],
            capture_output=True,
            text=True,
            cwd=self.tmp,
            timeout=300,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        self.assertEqual(p.returncode, 0, p.stderr[-3000:])
        where = p.stdout.split()
        self.assertTrue(where[0].startswith(site), "kvc_refworker imported from %s, not the fresh venv" % where[0])
        self.assertTrue(where[1].startswith(site), "kvcentric_sglang imported from %s, not the fresh venv" % where[1])


if __name__ == "__main__":
    unittest.main()
