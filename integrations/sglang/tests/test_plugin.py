"""The plugin's registration with SGLang: entry point, load_plugins, the transfer backend
choice, and the hook-target check."""

import pytest


def test_entry_point_is_what_load_plugins_finds(sglang_installed):
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "kvcentric"]
    assert len(eps) == 1, "pip install integrations/sglang registers the sglang.srt.plugins entry point"
    assert eps[0].load() is sglang_installed.install
    from sglang.srt.plugins import load_plugins_by_group

    found = load_plugins_by_group("sglang.srt.plugins")
    assert "kvcentric" in found and found["kvcentric"][0] is sglang_installed.install


def test_backend_choice_enum_and_classes(sglang_installed):
    import argparse

    from sglang.srt.disaggregation import decode, prefill
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    from sglang.srt.server_args import ServerArgs

    from kvcentric_sglang import backend

    be = TransferBackend("kvcentric")
    assert be is TransferBackend.KVCENTRIC and be.name == "KVCENTRIC" and be in list(TransferBackend)
    assert TransferBackend("mooncake") is TransferBackend.MOONCAKE  # the others untouched
    for mod in (prefill, decode):  # the hooked get_kv_class, as each module imported it
        assert mod.get_kv_class(be, KVClassType.MANAGER) is backend.KvcKVManager
        assert mod.get_kv_class(be, KVClassType.SENDER) is backend.KvcKVSender
        assert mod.get_kv_class(be, KVClassType.RECEIVER) is backend.KvcKVReceiver
        assert mod.get_kv_class(be, KVClassType.BOOTSTRAP_SERVER) is backend.KvcKVBootstrapServer
        assert mod.get_kv_class(TransferBackend.FAKE, KVClassType.SENDER).__name__ == "FakeKVSender"
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(
        ["--model-path", "m", "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "kvcentric"]
    )
    assert ns.disaggregation_transfer_backend == "kvcentric"


def test_verify_hooks_names_a_renamed_target(sglang_installed, monkeypatch):
    from sglang.srt.session.streaming_session import StreamingSession

    sglang_installed.verify_hooks()  # all present in this SGLang
    # SGLang renames release_session (as a new version might): the check fails loudly
    monkeypatch.delattr(StreamingSession, "release_session")
    with pytest.raises(sglang_installed.HookTargetMissing) as e:
        sglang_installed.verify_hooks()
    msg = str(e.value)
    assert "sglang.srt.session.streaming_session.StreamingSession.release_session" in msg
    assert "SGLang %s" % sglang_installed.sglang_version() in msg and "checked against 0.5.23" in msg
    # a module that moved
    with pytest.raises(sglang_installed.HookTargetMissing, match="sglang.srt.disaggregation.nowhere.get_kv_class"):
        sglang_installed.verify_hooks([("sglang.srt.disaggregation.nowhere.get_kv_class", "AROUND")])


def test_hooks_were_applied_not_skipped(sglang_installed):
    """apply_hooks() skips a failing target with only a log line: every target the plugin
    registered must be in HookRegistry._patched and actually wrapped."""
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.session.streaming_session import StreamingSession

    for t in sglang_installed.installed_hooks():
        assert t in HookRegistry._patched, t
        assert getattr(pkgutil.resolve_name(t), "__wrapped__", None) is not None, "%s is not wrapped" % t
    assert StreamingSession.release_session.__wrapped__.__module__ == "sglang.srt.session.streaming_session"


LINKER_ARGS = [
    "--enable-unified-cache-external-linker",
    "--unified-cache-external-linker-backend",
    "dynamic",
    "--unified-cache-external-linker-config",
    '{"linker": "KvcLinker", "linker_module_path": "kvcentric_sglang.linker", "linker_extra_config": {}}',
]
PREFILL_ARGS = [
    "--model-path",
    "Qwen/Qwen3-30B-A3B",
    "--port",
    "30000",
    "--base-gpu-id",
    "0",
    "--page-size",
    "16",
    "--disaggregation-mode",
    "prefill",
    "--disaggregation-transfer-backend",
    "kvcentric",
    "--radix-eviction-policy",
    "priority",
] + LINKER_ARGS
DECODE_ARGS = [
    "--model-path",
    "Qwen/Qwen3-30B-A3B",
    "--port",
    "31000",
    "--base-gpu-id",
    "1",
    "--page-size",
    "16",
    "--enable-streaming-session",
] + LINKER_ARGS


def test_launch_commands_of_docs_parse(sglang_installed):
    """The worker command lines of docs/sglang.md, through SGLang's own argument parser."""
    import argparse

    from sglang.srt.mem_cache.unified_cache.linker_config import UnifiedCacheLinkerConfig
    from sglang.srt.server_args import ServerArgs

    from kvcentric_sglang.linker import KvcLinker

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    pre = parser.parse_args(PREFILL_ARGS)
    assert (pre.disaggregation_mode, pre.disaggregation_transfer_backend, pre.page_size) == ("prefill", "kvcentric", 16)
    assert pre.radix_eviction_policy == "priority"  # P evicts the prefixes of direct-to-D sessions first
    # P's KvcLinker: prefill from the snapshot (LoadFromStore into the request's prefix slots)
    assert pre.enable_unified_cache_external_linker and pre.unified_cache_external_linker_backend == "dynamic"
    dec = parser.parse_args(DECODE_ARGS)
    assert dec.disaggregation_mode == "null" and dec.enable_streaming_session
    assert dec.enable_unified_cache_external_linker and dec.unified_cache_external_linker_backend == "dynamic"
    cfg = UnifiedCacheLinkerConfig.from_dict(dec.unified_cache_external_linker_config)
    import importlib

    assert getattr(importlib.import_module(cfg.linker_module_path), cfg.linker) is KvcLinker


def test_sglang_launcher_loads_the_plugin_in_a_fresh_process(sglang_installed):
    """SGLang's own launcher (python -m sglang.launch_server) loads the plugin through its entry
    point before parsing the command line, and a scheduler process's load_plugins() applies every
    hook: both in fresh interpreters, as in production."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "mooncake_tcp,kvcentric}" in out.stdout
    code = (
        "import warnings; warnings.filterwarnings('ignore')\n"
        "from sglang.srt.plugins import load_plugins\n"
        "from sglang.srt.plugins.hook_registry import HookRegistry\n"
        "load_plugins()\n"
        "from kvcentric_sglang import plugin\n"
        "from sglang.srt.disaggregation.utils import TransferBackend\n"
        "assert TransferBackend('kvcentric').name == 'KVCENTRIC'\n"
        "plugin.verify_applied()\n"
        "print('applied', sorted(t for t in plugin.installed_hooks() if t in HookRegistry._patched))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    applied = out.stdout.split("applied", 1)[1]
    for t in sglang_installed.installed_hooks():
        assert t in applied, t
