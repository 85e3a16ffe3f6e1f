"""Tensor parallelism: the gateway's kv_hints carry the prefill worker's rank peers
(prefill_peer_addrs, in rank order) and each decode rank receives from the prefill rank of its
own index (docs/sglang.md, "Tensor parallelism")."""

import types

import pytest

import kvctest
from kvcentric_sglang import runtime
from kvcentric_sglang.payload import peer_for


def hints(**shorthand):
    return {
        "protocol_version": 1,
        "message_id": "m",
        "actions": [
            {
                "action_id": "m/decode",
                "action_type": "kvc",
                "action_version": 2,
                "payload": kvctest.payload_json(role="decode", **shorthand),
            }
        ],
    }


PEERS = ["10.0.0.1:7000", "10.0.0.1:7001"]


@pytest.mark.parametrize(
    "rank,size,peers,want",
    [
        (0, 0, [], "p0"),  # no tensor parallelism: prefill_peer_addr
        (0, 2, PEERS, PEERS[0]),
        (1, 2, PEERS, PEERS[1]),
    ],
)
def test_peer_for_rank(rank, size, peers, want):
    h = runtime.parse_hint(
        hints(mode="SEED", room=7, prefill_peer_addr="p0" if not peers else PEERS[0], prefill_peer_addrs=peers)
    )
    assert h.receive.peer_addrs == peers
    assert peer_for(h.receive, rank, size) == want


@pytest.mark.parametrize("rank,size", [(0, 0), (1, 4), (2, 2)])
def test_unequal_tensor_parallelism_is_refused(rank, size):
    h = runtime.parse_hint(hints(mode="SEED", room=7, prefill_peer_addr=PEERS[0], prefill_peer_addrs=PEERS))
    with pytest.raises(ValueError, match="equal tensor parallelism"):
        peer_for(h.receive, rank, size)


@pytest.mark.parametrize("bad", ["10.0.0.1:7000", [1, 2], {"0": "x"}])
def test_malformed_peer_list(bad):
    env = hints(mode="SEED", room=7)
    env["actions"][0]["payload"]["receive"]["peer_addrs"] = bad
    with pytest.raises(ValueError, match="peer_addrs"):
        runtime.parse_hint(env)


def test_receiver_takes_its_rank_peer(sglang_installed):
    """The _create_receiver_and_enqueue hook puts this rank's prefill peer on the receiver, and
    refuses a request whose prefill worker has another tensor-parallel size."""
    from kvcentric_sglang import backend, plugin

    def receiver(rank, size):
        mgr = types.SimpleNamespace(registration=types.SimpleNamespace(tp_rank=rank, tp_size=size))
        return backend.KvcKVReceiver(mgr, "bootstrap:1", 7)

    def req(peers):
        return types.SimpleNamespace(
            kv_hints=hints(mode="SEED", room=7, session_id="s1", prefill_peer_addr=PEERS[0], prefill_peer_addrs=peers),
            origin_input_ids=[1, 2, 3],
            session=None,
        )

    r1 = receiver(1, 2)
    plugin._carry(r1, req(PEERS))
    assert r1.bootstrap_addr == PEERS[1] and r1.session_id == "s1" and r1.poll() != backend.KVPoll.Failed
    r0 = receiver(0, 0)
    plugin._carry(r0, req([]))
    assert r0.bootstrap_addr == PEERS[0]
    bad = receiver(1, 4)
    plugin._carry(bad, req(PEERS))
    assert bad.poll() == backend.KVPoll.Failed


def test_carry_acts_on_fields_not_mode(sglang_installed):
    """The request hook does what the payload's fields say, whatever the mode label: a SNAPSHOT
    receive is refused on a P/D decode worker under the label RESEED_PREFILL, a SEED receive is
    taken under the label RESEED_SNAPSHOT (a mode switch refused it), and a send's
    store_generation makes a store seed under the label PD_FALLBACK."""
    from kvcentric_sglang import backend, plugin
    from kvcentric_sglang import payload as P

    mgr = types.SimpleNamespace(registration=types.SimpleNamespace(tp_rank=0, tp_size=0))

    def req(payload):
        env = {"protocol_version": 1, "actions": [{"action_type": "kvc", "action_version": 2, "payload": payload}]}
        return types.SimpleNamespace(kv_hints=env, origin_input_ids=[1, 2, 3], session=None)

    snap = backend.KvcKVReceiver(mgr, "bootstrap:1", 7)
    plugin._carry(
        snap,
        req(
            {
                "mode": "ROUTE_MODE_RESEED_PREFILL",
                "session_id": "s1",
                "receive": {"kind": "TRANSFER_KIND_SNAPSHOT", "room": "7", "peer_addr": PEERS[0], "tokens": "3"},
            }
        ),
    )
    assert snap.poll() == backend.KVPoll.Failed and "colocated decode worker" in snap._error
    seed = backend.KvcKVReceiver(mgr, "bootstrap:1", 7)
    plugin._carry(
        seed,
        req(
            {
                "mode": "ROUTE_MODE_RESEED_SNAPSHOT",
                "session_id": "s1",
                "receive": {"kind": "TRANSFER_KIND_SEED", "room": "7", "peer_addr": PEERS[1]},
            }
        ),
    )
    assert seed.poll() != backend.KVPoll.Failed and seed.kind == P.TRANSFER_SEED and seed.bootstrap_addr == PEERS[1]
    tx = backend.KvcKVSender(mgr, "bootstrap:1", 7)
    plugin._carry(
        tx, req({"mode": "ROUTE_MODE_PD_FALLBACK", "session_id": "s1", "send": {"room": "7", "store_generation": "4"}})
    )
    assert (tx.to_store, tx.generation, tx.tokens, tx.session_id) == (True, 4, 3, "s1")
