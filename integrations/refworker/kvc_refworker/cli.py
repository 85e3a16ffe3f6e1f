"""kvc-refworker: command line. Every flag also as KVC_<UPPER_SNAKE> in the environment (the
flag wins), as the Go binaries do. Exit codes: 0 after SIGTERM/SIGINT, 1 on a start-up failure,
2 on bad flags."""

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

FLAGS = [
    # name, type, default, help
    ("role", str, "", "prefill | decode (required)"),
    ("worker-id", str, "", "worker id, as its sidecar's --worker-id (required)"),
    ("bridge-socket", str, "", "the sidecar's WorkerBridge Unix socket (required; waited for up to --bridge-wait)"),
    ("bridge-wait", float, 60.0, "seconds to wait for the sidecar's socket and RegisterKVPool"),
    ("http-addr", str, "127.0.0.1:0", "HTTP listen address (port 0: any)"),
    ("addr-file", str, "", "JSON {pid, http_addr} written as soon as the HTTP port is bound"),
    ("ready-file", str, "", "JSON ready file written once the pool is registered and the API serves"),
    ("model", str, "tiny", "tiny | qwen3-8b-shape"),
    ("dtype", str, "", "override the model's dtype (float32 | bfloat16 | float16)"),
    ("device", str, "cpu", "cpu | cuda | cuda:N"),
    (
        "attention",
        str,
        "auto",
        "auto | sdpa | kvc: kvc runs every shape on fused SDPA kernels (append-prefills "
        "with a bottom-right causal bias instead of a materialized mask); auto = kvc on "
        "CUDA, sdpa on CPU",
    ),
    ("seed", int, 1234, "weight seed (every worker of a run must use the same)"),
    ("kv-capacity-tokens", int, 0, "KV pool capacity in tokens (0: 16384 for tiny, 65536 otherwise)"),
    ("page-size", int, 16, "tokens per KV page (every worker and sidecar of a run the same)"),
    ("shm-dir", str, "/dev/shm", "where the CPU pool file lives (the sidecar maps it)"),
    ("transfer-timeout", float, 60.0, "seconds for WaitReceive / SendKV"),
    ("prealloc-wait", float, 0.0, "seconds a request may wait for pages before 503 no_capacity"),
    (
        "snapshot-wait",
        float,
        2.5,
        "seconds eviction passes over idle sessions whose D->P snapshot push is not done "
        "(their next turn would re-prefill); then least recently used first",
    ),
    (
        "verify-max-steps",
        int,
        16,
        "decode steps the recompute check compares (the rest are the same arithmetic; 0: all)",
    ),
    ("atol", float, -1.0, "recompute tolerance on logits and KV (-1: 1e-4 for float32, 1.0 for 16-bit)"),
    (
        "transfer-api",
        str,
        "auto",
        "how KV moves: plugin (kvcentric_sglang's KvcKVManager/Sender/Receiver and "
        "session hooks, as SGLang's scheduler drives them; needs sglang), bridge (its "
        "WorkerBridge client directly), auto (plugin when sglang is importable)",
    ),
    (
        "device-activity-dir",
        str,
        "auto",
        "directory where worker processes sharing a GPU publish their served "
        "requests in flight, so that a recompute check waits for all of them (auto: "
        "/dev/shm/kvc-refworker-<device> on CUDA, off on CPU; empty: off)",
    ),
    ("log-level", str, "info", "debug | info | warning | error"),
    ("log-format", str, "json", "json | console"),
]
BOOLS = [
    ("verify-recompute", "recompute every request from scratch in this worker and report mismatches in meta_info.kvc"),
    ("no-bitwise-strict", "treat bitwise-expected comparisons as allclose too (the default for 16-bit dtypes)"),
    ("bitwise-strict", "count a bitwise-expected comparison that is not bitwise as a mismatch also for 16-bit dtypes"),
    ("no-sglang-pool", "use the built-in pool even when sglang is importable"),
]


def _env(name):
    return os.environ.get("KVC_" + name.upper().replace("-", "_"))


def parse(argv):
    ap = argparse.ArgumentParser(prog="kvc-refworker", description="kvcentric reference worker (real model, real KV)")
    for name, typ, default, hlp in FLAGS:
        e = _env(name)
        if e is not None:
            try:
                default = typ(e)
            except ValueError:
                ap.error("KVC_%s=%r is not a %s" % (name.upper().replace("-", "_"), e, typ.__name__))
        ap.add_argument("--" + name, type=typ, default=default, help=hlp + " (default %(default)s)")
    for name, hlp in BOOLS:
        e = _env(name)
        ap.add_argument(
            "--" + name, action="store_true", help=hlp, default=e is not None and e.lower() in ("1", "true", "yes")
        )
    a = ap.parse_args(argv)
    if a.attention not in ("auto", "sdpa", "kvc"):
        ap.error("--attention must be auto, sdpa or kvc")
    if a.role not in ("prefill", "decode"):
        ap.error("--role must be prefill or decode")
    if not a.worker_id or not a.bridge_socket:
        ap.error("--worker-id and --bridge-socket are required")
    if (
        a.page_size <= 0
        or a.kv_capacity_tokens < 0
        or a.transfer_timeout <= 0
        or a.prealloc_wait < 0
        or a.snapshot_wait < 0
    ):
        ap.error("--page-size, --transfer-timeout must be > 0; capacities and waits >= 0")
    return a


class _JSONFormatter(logging.Formatter):
    def format(self, r):
        d = {
            "level": r.levelname.lower(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(r.created)),
            "component": "kvc-refworker",
            "message": r.getMessage(),
        }
        if isinstance(getattr(r, "served", None), dict):
            d["served"] = r.served  # one served request's figures (server.py: log_served)
        if r.exc_info:
            d["error"] = self.formatException(r.exc_info)
        return json.dumps(d)


def _activity_dir(flag: str, device: str) -> str:
    if flag != "auto":
        return flag
    if not device.startswith("cuda"):
        return ""
    return "/dev/shm/kvc-refworker-" + (device if ":" in device else "cuda:0").replace(":", "")


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def main(argv=None) -> int:
    try:
        a = parse(sys.argv[1:] if argv is None else argv)
    except SystemExit as e:
        return 0 if e.code == 0 else 2
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(
        _JSONFormatter() if a.log_format == "json" else logging.Formatter("%(asctime)s %(levelname)s %(message)s")
    )
    log = logging.getLogger("kvc_refworker")
    log.addHandler(h)
    log.setLevel(getattr(logging, a.log_level.upper(), logging.INFO))
    log.propagate = False

    from .server import Server, serve_in_thread

    host, _, port = a.http_addr.rpartition(":")
    info = {
        "model_path": "kvc-refworker/" + a.model,
        "kvc_role": a.role,
        "worker_id": a.worker_id,
        "page_size": a.page_size,
        "worker_kind": "refworker",
        "pid": os.getpid(),
    }
    try:
        srv = Server((host or "127.0.0.1", int(port)), info)
    except (OSError, ValueError) as e:
        log.error("listen %s: %s", a.http_addr, e)
        return 2
    http_addr = "%s:%d" % srv.server_address[:2]
    if a.addr_file:
        _write_json(a.addr_file, {"pid": os.getpid(), "http_addr": http_addr})
    serve_in_thread(srv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())

    pool = bridge = None
    try:
        import torch

        from kvcentric_sglang.bridge import BridgeError, WorkerBridge

        from . import model as M
        from .pool import KVPool
        from .worker import Config, Worker

        threads = int(os.environ.get("KVC_REFWORKER_THREADS", "0")) or 64
        torch.set_num_threads(max(1, min(torch.get_num_threads(), threads)))
        spec = M.spec_for(a.model, a.dtype)
        t0 = time.monotonic()
        model = M.build(spec, a.device, a.seed, a.attention)
        log.info(
            "model %s built on %s in %.1fs (%s, %d layers, hidden %d, %d/%d heads, head_dim %d, attention %s)",
            spec.name,
            a.device,
            time.monotonic() - t0,
            spec.dtype,
            spec.num_layers,
            spec.hidden_size,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            model.config._attn_implementation,
        )
        cap = a.kv_capacity_tokens or (16384 if a.model == "tiny" else 65536)
        pool = KVPool(
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            spec.dtype,
            cap,
            a.page_size,
            a.device,
            shm_dir=a.shm_dir,
            name="kvc-refworker-" + a.worker_id,
            use_sglang=not a.no_sglang_pool,
            seed=hash(a.worker_id) & 0xFFFF,
        )
        log.info(
            "KV pool: %s, %d pages of %d tokens, %d bytes per page per buffer, %s",
            pool.source,
            pool.num_pages,
            a.page_size,
            pool.item_len,
            pool.shm_path or a.device,
        )
        deadline = time.monotonic() + a.bridge_wait
        while not os.path.exists(a.bridge_socket):
            if stop.is_set() or time.monotonic() > deadline:
                raise RuntimeError("bridge socket %s did not appear within %.0fs" % (a.bridge_socket, a.bridge_wait))
            time.sleep(0.05)
        bridge = WorkerBridge(a.bridge_socket, timeout_s=a.transfer_timeout + 5)
        from . import transport

        while True:
            try:
                xfer = transport.make(
                    a.transfer_api, a.bridge_socket, bridge, pool, a.role, spec.name, a.transfer_timeout
                )
                break
            except BridgeError as e:
                if time.monotonic() > deadline or stop.is_set():
                    raise
                log.info("RegisterKVPool: %s; retrying", e)
                time.sleep(0.2)
        bpt, endpoint = xfer.kv_bytes_per_token, xfer.endpoint
        log.info(
            "pool registered through the %s path: %d KV bytes per token, transfer endpoint %s", xfer.name, bpt, endpoint
        )
        fp32 = spec.dtype == torch.float32
        atol = a.atol if a.atol >= 0 else (1e-4 if fp32 else 1.0)
        # Bitwise equality across processes holds on CPU in fp32; in bf16 on CUDA one process
        # reproduces itself bitwise (probe_exactness.py) but P's and D's kernels may differ.
        strict = (fp32 or a.bitwise_strict) and not a.no_bitwise_strict
        cfg = Config(
            role=a.role,
            worker_id=a.worker_id,
            model_name=spec.name,
            transfer_timeout_s=a.transfer_timeout,
            prealloc_wait_s=a.prealloc_wait,
            verify_recompute=a.verify_recompute,
            atol=atol,
            verify_max_steps=a.verify_max_steps,
            bitwise_strict=strict,
            snapshot_wait_s=a.snapshot_wait,
            device_activity_dir=_activity_dir(a.device_activity_dir, a.device),
        )
        worker = Worker(cfg, model, spec, pool, xfer)
        if a.role == "decode" and getattr(xfer, "bridge", None) is not None:
            from kvcentric_sglang import demand

            worker.demand = demand.start_for_process(xfer.bridge)  # running_requests to the sidecar
        transport.start_watch(xfer, worker, stop)
        srv.set_worker(worker)
        srv.info.update(
            transfer_api=xfer.name,
            kv_capacity_tokens=pool.size,
            kv_bytes_per_token=bpt,
            pool=pool.source,
            dtype=str(spec.dtype),
            verify_recompute=a.verify_recompute,
            atol=atol,
        )
        if a.ready_file:
            _write_json(
                a.ready_file,
                {
                    "pid": os.getpid(),
                    "worker_id": a.worker_id,
                    "http_addr": http_addr,
                    "role": a.role,
                    "shm_path": pool.shm_path,
                    "kv_capacity_tokens": pool.size,
                    "pool": pool.source,
                    "model": spec.name,
                    "transfer_api": xfer.name,
                },
            )
        log.info(
            "serving %s worker %s on http://%s (verify_recompute=%s, atol=%g, bitwise_strict=%s)",
            a.role,
            a.worker_id,
            http_addr,
            a.verify_recompute,
            atol,
            strict,
        )
        while not stop.wait(0.5):  # a timed wait: the signal handler runs promptly
            pass
        log.info("stopping")
        return 0
    except Exception as e:  # noqa: BLE001
        log.exception("start-up failed: %s", e)
        return 1
    finally:
        if pool is not None:
            pool.close()  # the file first: nothing below may keep it
        threading.Thread(target=srv.shutdown, daemon=True).start()
        if bridge is not None:
            threading.Thread(target=bridge.close, daemon=True).start()


def entry() -> None:
    """Console-script entry: exits at once after main (grpc and torch keep non-daemon threads)."""
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
