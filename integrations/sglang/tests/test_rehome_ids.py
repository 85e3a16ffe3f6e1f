"""Issue 20 item 3 on SGLang's real classes: a session's token ids travel with its snapshot, so
a decode worker that loads the session without a client request (LoadSessionCommand, a
re-home) builds the fresh streaming slot's request from them.

D's commit hook sends the slot's origin_input_ids + output_ids with CommitSession; the real
decode sidecar pushes them with the snapshot into the real prefill sidecar's store; the store
answers SnapshotTokens (what the loading decode sidecar asks before its /generate) with exactly
those ids; D' builds the load's request from them (input_ids, max_new_tokens 0, the load's
kv_hints) on a fresh streaming session, and SGLang's real match / load-back path with the
KvcLinker lands the snapshot's pages in the request's slots: D's bytes, SGLang prefilling only
the partial last page."""

from array import array
from types import SimpleNamespace

import grpc

import kvctest
from kvcentric_sglang import sessions, wire
from kvctest import PAGE
from test_linker import cluster, dprime, make_snapshot  # noqa: F401 (cluster is a fixture)


def snapshot_tokens(peer_addr: str, sid: str, generation: int, seqlen: int):
    """TransferPeerService.SnapshotTokens on the prefill sidecar, as the loading decode sidecar
    calls it; returns (ids, stored generation, stored seqlen) or raises grpc.RpcError."""
    ch = grpc.insecure_channel(peer_addr)
    try:
        fn = ch.unary_unary(
            "/kvc.v1.TransferPeerService/SnapshotTokens", request_serializer=None, response_deserializer=None
        )
        raw = fn(wire.Writer().str(1, sid).int(2, generation).int(3, seqlen).done(), timeout=10)
    finally:
        ch.close()
    r = wire.parse(raw)
    return wire.unpack_varints(r.get(1)), r.get(2) or 0, wire.as_int64(r.get(3))


def load_req(w2, sid, ids, room, peer, rid="load-1"):
    """The load's request as SGLang builds it from the decode sidecar's /generate (input_ids =
    the store's ids, max_new_tokens 0, the load's kv_hints) on a fresh streaming session,
    through the hooked _create_generation_req."""
    n = len(ids)
    hints = kvctest.kvc_hints(
        mode="RESEED_SNAPSHOT",
        role="decode",
        session_id=sid,
        room=room,
        snapshot_seqlen=n,
        prefill_peer_addr=peer,
        input_tokens=n,
        cached_tokens=n,
        keep_session=True,
        open_session=True,
        load=True,
    )
    session = kvctest.streaming_session(sid)
    assert not session.req_nodes  # a fresh slot: no history to strip, the ids are the whole context
    r = kvctest.generation_req(rid, ids, hints, max_new_tokens=0, vocab_size=1 << 20)
    assert r.kv_hints is hints
    return r


def test_commit_ids_travel_to_the_store_and_back_into_a_load(cluster, tmp):  # noqa: F811
    from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cp, d, p, d2 = cluster
    prompt, out = [151000 + i for i in range(41)], [42, 43, 44, 45, 46, 47, 48]  # 48 tokens
    w, pages, _ = make_snapshot(cp, d, p, tmp, "s-ids", prompt, out)
    n = len(prompt) + len(out)
    assert sessions.resident_ids("s-ids") == prompt + out  # what the hook committed
    # the prefill store holds them with the entry: SnapshotTokens answers exactly them
    ids, gen, stored = snapshot_tokens(p.peer_addr, "s-ids", 1, n)
    assert (ids, gen, stored) == (prompt + out, 1, n)
    assert snapshot_tokens(p.peer_addr, "s-ids", 1, 20)[0] == (prompt + out)[:20]  # a shorter load
    precondition = grpc.StatusCode.FAILED_PRECONDITION
    for bad_gen, bad_len, code in ((2, n, precondition), (1, n + 1, precondition)):
        try:
            snapshot_tokens(p.peer_addr, "s-ids", bad_gen, bad_len)
            raise AssertionError("SnapshotTokens answered generation %d of %d tokens" % (bad_gen, bad_len))
        except grpc.RpcError as e:
            assert e.code() == code, e
    try:
        snapshot_tokens(p.peer_addr, "s-none", 1, 4)
        raise AssertionError("SnapshotTokens answered a session the store does not hold")
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e

    # D': the load's request is built from the ids; SGLang's match path finds no device prefix
    # and the linker answers the snapshot's full pages of the match key (input[:-1]).
    w2, lk = dprime(d2, tmp)
    r = load_req(w2, "s-ids", ids, room=779, peer=p.peer_addr)
    assert list(r.origin_input_ids) == prompt + out  # the session's history is the context's ids
    m = w2.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", ids[:-1])), req=r))
    want = (n - 1) // PAGE * PAGE  # 32: SGLang computes the partial last page itself
    assert m.device_prefix_len == 0 and m.host_hit_length == want, m
    r.last_node = m.last_device_node
    loaded, _ = w2.cache.init_load_back(
        InitLoadBackParams(best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=r)
    )
    assert loaded == want
    slots = w2.cache.linker.private_load_indices[r.rid]
    idx = w2.cache.ready_to_load_host_cache()  # PrepareReceive(SNAPSHOT) + WaitReceive
    lk.layer_done_counter.set_consumer(idx)
    for layer in range(kvctest.LAYERS):
        lk.layer_done_counter.wait_until(layer)
    assert w2.cache.finish_external_linker_loads([r]) == []
    got_pages = [int(x) // PAGE for x in slots[::PAGE].tolist()]
    assert kvctest.token_bytes(w2.kv, got_pages, want) == kvctest.token_bytes(w.kv, pages, want)


def test_commit_ids_of_a_finished_request():
    """The hook's ids: origin_input_ids then output_ids (capped at max_new_tokens, as the
    session's history counts them), cut to the committed range; none when they do not cover it
    or an id is outside [0, 2^31)."""
    sp = SimpleNamespace(max_new_tokens=3)
    req = SimpleNamespace(
        origin_input_ids=array("q", [5, 6, 7]), output_ids=array("q", [8, 9, 10, 11]), sampling_params=sp
    )
    assert sessions.commit_ids(req, 6) == [5, 6, 7, 8, 9, 10]
    assert sessions.commit_ids(req, 5) == [5, 6, 7, 8, 9]
    assert sessions.commit_ids(req, 7) == []  # the 4th output id is past max_new_tokens
    big = SimpleNamespace(origin_input_ids=array("q", [5, 1 << 31]), output_ids=array("q"), sampling_params=sp)
    assert sessions.commit_ids(big, 2) == []
