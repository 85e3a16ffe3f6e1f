"""pytest setup: the package on sys.path, the watch thread off unless a test starts one,
prometheus_client in multiprocess mode over a temporary directory (as SGLang's --enable-metrics
runs its scheduler processes), SGLang's (slow) imports done once, the plugin installed and its
hooks applied once; the sidecar binaries, a short temporary directory, and the colocated decode
worker most tests start from."""

import atexit
import os
import shutil
import sys
import tempfile
import warnings

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("KVC_SGLANG_WATCH", "0")
# Before anything imports prometheus_client (it picks its value store at import): the plugin's
# metrics go to files here, read back by test_metrics.py as SGLang's /metrics reads them.
if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvcpy-prom-")
    atexit.register(shutil.rmtree, os.environ["PROMETHEUS_MULTIPROC_DIR"], True)
warnings.filterwarnings("ignore")


@pytest.fixture(scope="session")
def sglang_installed():
    """install() + apply_hooks(), as SGLang's load_plugins() does."""
    pytest.importorskip("sglang.srt.disaggregation.base.conn")
    from sglang.srt.plugins.hook_registry import HookRegistry

    # what a scheduler process has written before it handles requests
    from sglang.srt.runtime_context import get_parallel

    from kvcentric_sglang import plugin

    get_parallel().override_permanently(tp_rank=0)
    plugin.install()
    HookRegistry.apply_hooks()
    missing = [t for t in plugin.installed_hooks() if t not in HookRegistry._patched]
    assert not missing, "hooks not applied: %s" % missing
    return plugin


@pytest.fixture(scope="session")
def bins():
    import kvctest

    return {
        "decode": kvctest.binary("kvc-sidecar-decode", "sidecar-decode"),
        "prefill": kvctest.binary("kvc-sidecar-prefill", "sidecar-prefill"),
    }


@pytest.fixture
def tmp(tmp_path_factory):
    # Unix socket paths must stay short: use /tmp directly.
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="kvcpy-")
    yield d
    shutil.rmtree(d, ignore_errors=True)
    # the /dev/shm pool files of this test (kvctest.shm_path)
    for f in os.listdir("/dev/shm"):
        if f.startswith("kvcpy-%s-" % os.path.basename(d)):
            os.unlink(os.path.join("/dev/shm", f))


@pytest.fixture
def dside(sglang_installed, bins, tmp):
    """A colocated decode worker on a real decode sidecar "d0": kvctest.Colocated (SGLang's real
    pool in /dev/shm, allocator, radix cache and streaming sessions) whose pool is registered
    through a WorkerBridge that is the process's bridge, so the hooks commit and release through
    it. Yields (sidecar, worker); the worker's bridge and registration are w.bridge and
    w.registration. Afterwards the process's state is reset (a watcher a test started is
    stopped), the bridge closed and the sidecar stopped."""
    import kvctest
    from kvcentric_sglang import runtime

    runtime.state.reset()
    d = kvctest.Sidecar(bins["decode"], "d0", tmp)
    try:
        w = kvctest.Colocated(tmp, "d")
        w.attach(d.sock)
    except BaseException:
        d.stop()
        raise
    yield d, w
    if runtime.state.watch is not None:
        runtime.state.watch.stop()
    runtime.state.reset()
    w.bridge.close()
    d.stop()
