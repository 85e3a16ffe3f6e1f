"""The WatchCommands client against the real decode sidecar: re-registration after the sidecar
process is restarted, and capacity releases of streaming sessions (SGLang never evicts them)
carried out through SGLang's real session code, in priority order, each after its snapshot
was current."""

import time
from types import SimpleNamespace

import kvctest


class _ReleaseCluster:
    """A colocated decode worker with the plugin's watcher attached to the real decode sidecar
    (release watermarks 0.7 / low, minimum idle 0) and a real prefill sidecar whose store takes
    the snapshots, under a scripted control plane: cp, d, p, pb (P's bridge), w, b, reg, wc."""

    def __init__(self, bins, tmp, low):
        from kvcentric_sglang import runtime, watch

        self.cp = kvctest.ScriptedControlPlane(delta_tokens=16)
        self.d = kvctest.Sidecar(
            bins["decode"],
            "d0",
            tmp,
            self.cp.addr,
            extra=[
                "--snapshot-delta-tokens",
                "16",
                "--release-high-watermark",
                "0.7",
                "--release-low-watermark",
                str(low),
                "--release-min-idle",
                "0s",
            ],
        )
        self.p = kvctest.Sidecar(
            bins["prefill"], "p0", tmp, self.cp.addr, extra=["--store-capacity-bytes", str(16 << 20)]
        )
        try:
            self.pb, _ = kvctest.Colocated(tmp, "p").attach(self.p.sock, process=False)
            runtime.state.reset()
            self.w = kvctest.Colocated(tmp, "d")
            self.b, self.reg = self.w.attach(self.d.sock)
            assert self.cp.wait(lambda c: "d0" in c.hellos and "p0" in c.hellos), (self.d.tail(), self.p.tail())
            self.wc = watch.start_for_process(self.b, self.reg)
            assert self.wc.wait_for(lambda c: len(c.attaches) >= 1, 20)
        except BaseException:
            self.close()
            raise

    def close(self):
        from kvcentric_sglang import runtime

        if runtime.state.watch is not None:
            runtime.state.watch.stop()
        runtime.state.reset()
        for s in (self.d, self.p):
            s.stop()


def _scheduler(w, **extra):
    """The scheduler attributes SGLang's process_input_requests touches (plus extra)."""
    from sglang.srt.session.session_controller import SessionController

    return SimpleNamespace(
        session_controller=SessionController(w.cache),
        tree_cache=w.cache,
        scheduler_stage_metrics=None,
        external_corpus_manager=None,
        flush_wrapper=SimpleNamespace(check_pending=lambda: None),
        _event_loop_should_restart=False,
        **extra,
    )


def test_reregisters_and_recommits_after_sidecar_restart(dside, monkeypatch):
    from kvcentric_sglang import watch

    monkeypatch.setenv("KVC_SGLANG_WATCH", "1")
    d, w = dside
    b = w.bridge
    w.committed_session("s-w", list(range(1, 41)), [7] * 8)
    wc = watch.start_for_process(b, w.registration)
    assert wc.wait_for(lambda c: len(c.attaches) >= 1, 20), wc.errors
    first = wc.attaches[0]
    assert first.pool_registered and first.resident_sessions == 1
    assert wc.reregistrations == 0

    d.kill()  # the sidecar crashes; systemd starts a new one on the same socket
    d.start()
    assert kvctest.sessions_of(d) == {}  # the new process knows nothing yet
    assert wc.wait_for(lambda c: c.reregistrations >= 1, 30), (wc.attaches, wc.errors, d.tail())
    new = [a for a in wc.attaches if a.sidecar_instance != first.sidecar_instance]
    assert new and not new[0].pool_registered
    got = kvctest.sessions_of(d)
    assert got["s-w"]["committed_len"] == 48  # re-committed from the worker's own record
    # the pool is registered again: the next commit of the session is accepted
    assert not b.commit_session("s-w", 48, w.slot_pages("s-w", 48))


def test_capacity_release_in_priority_order_after_snapshot(sglang_installed, bins, tmp, monkeypatch):
    monkeypatch.setenv("KVC_SGLANG_WATCH", "1")
    rc = _ReleaseCluster(bins, tmp, 0.4)
    cp, d, pb, w, wc = rc.cp, rc.d, rc.pb, rc.w, rc.wc
    try:
        # five sessions, oldest first and largest first: C 128, E 96, A 80, B 64, D 32 tokens
        # (400 of the pool's ~512: above the 0.7 high watermark; the low watermark is 0.4)
        sizes = [("s-C", 120), ("s-E", 88), ("s-A", 72), ("s-B", 56), ("s-D", 24)]
        committed = {}
        for sid, prompt in sizes:
            cp.set_snapshot_target("d0", sid, "p0")
            w.committed_session(sid, list(range(1, prompt + 1)), [7] * 8)
            committed[sid] = prompt + 8
        # the scheduler loop: SGLang's (hooked) process_input_requests runs the queued commands
        # on the scheduler thread
        from sglang.srt.managers.scheduler import Scheduler

        sched = _scheduler(w)
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and len([s for s in committed if s not in w.streaming.slots]) < 2:
            wc.wait_for(lambda c: not c.pending.empty(), 1)
            Scheduler.process_input_requests(sched, [])
        released = [s for s, _ in sizes if s not in w.streaming.slots]
        assert released == ["s-C", "s-E"], (released, cp.events, d.tail())
        # further passes of the sidecar (1 s interval) send nothing more: below the low watermark
        assert not wc.wait_for(lambda c: not c.pending.empty(), 2.5)
        assert [s for s, _ in sizes if s not in w.streaming.slots] == ["s-C", "s-E"]
        # the order of the releases, and each came after its full snapshot was in P's store
        ev = cp.events
        order = [e["session"] for e in ev if e["kind"] == "evicted"]
        assert order == ["s-C", "s-E"], ev
        for sid in order:
            i_rel = next(i for i, e in enumerate(ev) if e["kind"] == "evicted" and e["session"] == sid)
            assert any(
                e["kind"] == "snapshot_ingested" and e["session"] == sid and e["kv_len"] == committed[sid]
                for e in ev[:i_rel]
            ), (sid, ev)
            assert pb.snapshot_status(sid).seqlen == committed[sid]
        assert set(kvctest.sessions_of(d)) == {"s-A", "s-B", "s-D"}
    finally:
        rc.close()
        cp.close()
