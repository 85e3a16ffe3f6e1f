"""The worker HTTP API, the same subset kvc-sim serves (docs/interfaces.md, docs/simulator.md):
POST /generate (JSON or SSE streaming), POST /open_session, POST /close_session, GET /health,
/healthz, /readyz, /get_model_info, /kvc/sessions, /metrics."""

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from . import request as R
from .worker import ApiError, Verifier, Worker

log = logging.getLogger("kvc_refworker")
MAX_BODY = 64 << 20


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, info: dict):
        super().__init__(addr, Handler)
        self.worker: Worker = None  # set once the model, pool and sidecar are up
        self.info = info

    def set_worker(self, w: Worker) -> None:
        self.worker = w


class _ClientGone(Exception):
    pass


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Server

    def log_message(self, fmt, *args):  # quiet: requests are logged by the worker
        log.debug("%s " + fmt, self.address_string(), *args)

    def _json(self, status: int, obj) -> None:
        b = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def _error(self, e: ApiError) -> None:
        self._json(e.status, {"error": {"code": e.code, "message": e.msg}})

    def _text(self, status: int, s: str, ctype="text/plain") -> None:
        b = s.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def _body(self):
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY:
            raise ApiError(400, "bad_request", "body of %d bytes exceeds %d" % (n, MAX_BODY))
        raw = self.rfile.read(n) if n else b""
        try:
            return json.loads(raw or b"{}")
        except ValueError as e:
            raise ApiError(400, "bad_request", "malformed JSON body: %s" % e) from e

    def do_GET(self):
        w, path = self.server.worker, self.path.split("?")[0]
        if path in ("/health", "/healthz"):
            return self._text(200, "ok\n")
        if path == "/readyz":
            return self._text(200 if w else 503, "ready\n" if w else "starting\n")
        if path == "/get_model_info":
            return self._json(
                200, dict(self.server.info, is_generation=True, kv_capacity_tokens=w.capacity_tokens if w else 0)
            )
        if path == "/kvc/sessions":
            if not w:
                return self._error(ApiError(503, "internal", "worker is starting"))
            return self._json(
                200,
                {
                    "worker_id": w.cfg.worker_id,
                    "role": w.cfg.role,
                    "sessions": w.session_list(),
                    "stats": dict(w.stats, free_pages=w.pool.free_pages, pages=w.pool.num_pages),
                },
            )
        if path == "/metrics":
            lines = []
            if w:
                for k, v in sorted(w.stats.items()):
                    lines.append("# TYPE kvc_refworker_%s counter\nkvc_refworker_%s %s" % (k, k, v))
                lines.append("kvc_refworker_free_pages %d" % w.pool.free_pages)
            return self._text(200, "\n".join(lines) + "\n", "text/plain; version=0.0.4")
        self._error(ApiError(404, "not_found", "no such path %s" % path))

    def do_POST(self):
        path = self.path.split("?")[0]
        try:
            if path == "/generate":
                return self._generate()
            if path in ("/open_session", "/close_session"):
                return self._session_call(path)
            raise ApiError(404, "not_found", "no such path %s" % path)
        except ApiError as e:
            self._error(e)

    def _session_call(self, path):
        """SGLang's POST /open_session (streaming sessions only; answers the id as a JSON string;
        refuses an id this worker holds, so the caller closes the stale copy first - no state is
        kept for an open session without KV) and POST /close_session (releases the session's KV
        once its running turn ended: ReleaseSession to the sidecar, then free)."""
        w = self.server.worker
        body = self._body()
        if not isinstance(body, dict):
            raise ApiError(400, "bad_request", "the body must be a JSON object")
        if w is None:
            raise ApiError(503, "internal", "worker is starting")
        if w.cfg.role != "decode":
            raise ApiError(400, "bad_request", "sessions live on decode workers; this is a prefill worker")
        sid = body.get("session_id")
        if not isinstance(sid, str) or not sid:
            raise ApiError(400, "bad_request", "session_id is required")
        try:
            R._valid_id("session_id", sid)
        except R.BadRequest as e:
            raise ApiError(400, "bad_request", str(e)) from e
        to = body.get("timeout")
        if to is not None and (not isinstance(to, (int, float)) or isinstance(to, bool) or to < 0):
            raise ApiError(400, "bad_request", "timeout %r must be a non-negative number of seconds" % (to,))
        if path == "/open_session":
            if body.get("streaming") is not True:
                raise ApiError(400, "bad_request", 'only streaming sessions are supported ("streaming": true)')
            with w.mu:
                held = sid in w.sessions
            if held:
                raise ApiError(400, "bad_request", "session %r is already open on %s" % (sid, w.cfg.worker_id))
            return self._json(200, sid)
        return self._json(200, {"session_id": sid, "closed": w.close_session(sid)})

    def _generate(self):
        w = self.server.worker
        t_start = time.monotonic()
        try:
            body = self._body()
            if w is None:
                raise ApiError(503, "internal", "worker is starting (model, pool or sidecar not ready)")
            try:
                p = R.parse(body, w.cfg.role, w.capacity_tokens, w.spec.vocab_size)
            except R.BadRequest as e:
                raise ApiError(400, "bad_request", str(e)) from e
        except ApiError as e:
            return self._error(e)
        if not p.rid:
            p.rid = "ref-%x" % time.time_ns()
        w.stats["requests"] += 1
        if w.cfg.role == "prefill":
            try:
                meta = w.serve_prefill(p)
            except ApiError as e:
                w.stats["errors"] += 1
                return self._error(e)
            log_served(p, meta, time.monotonic() - t_start)
            ans = {
                "text": "",
                "output_ids": [],
                "meta_info": {
                    "id": p.rid,
                    "prompt_tokens": p.input,
                    "completion_tokens": 0,
                    "cached_tokens": 0,
                    "finish_reason": {"type": "length", "length": 0},
                    "e2e_latency": time.monotonic() - t_start,
                    "kvc": meta,
                },
            }
            if p.stream:
                self._sse_start()
                self._sse(ans)
                self._sse_done()
            else:
                self._json(200, ans)
            return
        self._decode(w, p, t_start)

    def _sse_start(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _sse(self, obj):
        try:
            self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            self.wfile.flush()
        except OSError as e:
            raise _ClientGone(str(e)) from e

    def _sse_done(self):
        try:
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except OSError:
            pass

    def _decode(self, w: Worker, p, t_start: float):
        try:
            t = w.begin(p)
        except ApiError as e:
            w.stats["errors"] += 1
            return self._error(e)
        ok = False
        started = [False]

        def mi(n):
            t.meta["kv_len_after"] = p.input + n
            return {
                "id": p.rid,
                "prompt_tokens": p.input,
                "completion_tokens": n,
                "cached_tokens": p.cached,
                "kvc": dict(t.meta),
            }

        def emit(i, tok):
            if i == 0:
                t.meta["ttft_ms"] = round((time.monotonic() - t_start) * 1000.0, 3)
            if p.stream:
                if not started[0]:
                    self._sse_start()
                    started[0] = True
                self._sse({"text": " t%d" % tok, "output_ids": [tok], "meta_info": mi(i + 1)})

        try:
            w.decode_steps(t, emit)
            # a load without ids has nothing to recompute (its next turn does); with the
            # snapshot's ids it is held to a full prefill of them like any received KV
            if w.cfg.verify_recompute and (not p.load or p.ids is not None):
                t.meta.update(Verifier(w).check(t))
                if t.meta["recompute_mismatches"] == 0 and t.meta.get("received_bytes"):
                    t.meta["verified_bytes"] = t.meta["received_bytes"]
            ok = True
            w.finish(t, ok=True)  # commit before the final chunk: a client holding it knows
            log_served(p, t.meta, time.monotonic() - t_start)
            final = mi(p.max_new)
            final["finish_reason"] = {"type": "length", "length": p.max_new}
            final["e2e_latency"] = time.monotonic() - t_start
            if p.stream:
                if not started[0]:
                    self._sse_start()
                    started[0] = True
                self._sse({"text": "", "output_ids": [], "meta_info": final})
                self._sse_done()
            else:
                self._json(
                    200, {"text": "".join(" t%d" % x for x in t.out), "output_ids": list(t.out), "meta_info": final}
                )
        except _ClientGone:
            log.info("client went away: %s", p.rid)
        except ApiError as e:
            w.stats["errors"] += 1
            if started[0]:
                try:
                    self._sse({"error": {"code": e.code, "message": e.msg}})
                    self._sse_done()
                except _ClientGone:
                    pass
            else:
                self._error(e)
        except Exception as e:  # noqa: BLE001 - a bug must answer 500, not hang the gateway
            log.exception("internal error in %s", p.rid)
            w.stats["errors"] += 1
            err = ApiError(500, "internal", "%s: %s" % (type(e).__name__, e))
            if started[0]:
                try:
                    self._sse({"error": {"code": err.code, "message": err.msg}})
                    self._sse_done()
                except _ClientGone:
                    pass
            else:
                self._error(err)
        finally:
            if not t.finished:
                w.finish(t, ok=ok)


def log_served(p, meta: dict, elapsed_s: float) -> None:
    """One info line per request served to its end, with the plan's identity and the worker's
    figures (the meta_info.kvc it answers): a JSON log line {"message": "served", "served": {...}}
    that a run's analysis can join with the client's records by session and input length (P's
    answer never reaches the client: the gateway streams D's)."""
    log.info(
        "served",
        extra={
            "served": {
                "rid": p.rid,
                "decision_id": p.decision_id,
                "session_id": p.session_id,
                "mode": p.mode,
                "input_tokens": p.input,
                "cached_tokens": p.cached,
                "load_prefix_tokens": p.load_prefix,
                "receive_from": p.receive_from,
                "elapsed_ms": round(elapsed_s * 1000.0, 3),
                **{k: v for k, v in meta.items() if isinstance(v, (int, float, str, bool))},
            }
        },
    )


def serve_in_thread(srv: Server) -> threading.Thread:
    th = threading.Thread(target=srv.serve_forever, name="http", daemon=True)
    th.start()
    return th
