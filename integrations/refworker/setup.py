"""kvc-refworker's dependencies (pyproject.toml declares them dynamic for this one reason).

kvcentric-sglang, the plugin's WorkerBridge client, lives next to this package in the repository
(integrations/sglang) and on no package index. Built from a checkout, the requirement is a direct
reference to that folder, so `pip install integrations/refworker` works in a fresh venv; built
where the folder is absent (an unpacked sdist) it names the package, which must then be installed
first (pip install integrations/sglang). tests/test_package.py checks that every module the
package imports is declared here or in an extra."""

from pathlib import Path

from setuptools import setup

plugin = Path(__file__).resolve().parent.parent / "sglang"
if (plugin / "pyproject.toml").is_file():
    kvcentric_sglang = "kvcentric-sglang @ " + plugin.as_uri()
else:
    kvcentric_sglang = "kvcentric-sglang"

setup(install_requires=[kvcentric_sglang, "grpcio>=1.60", "torch>=2.4", "transformers>=4.51"])
