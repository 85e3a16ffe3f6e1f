"""Fuzzing of the hand-written protobuf decoders (wire.parse / parse_all, the WatchCommands
message decoder): any input either decodes or raises ValueError; encode -> decode round-trips."""

import random

import pytest

from kvcentric_sglang import bridge, wire


def test_parse_random_bytes_never_crashes():
    rng = random.Random(11)
    for _ in range(20000):
        b = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 40)))
        try:
            a = wire.parse_all(b)
        except ValueError:
            continue
        assert all(isinstance(k, int) and isinstance(v, list) and v for k, v in a.items())
        assert wire.parse(b) == {k: v[-1] for k, v in a.items()}


def test_roundtrip_random_messages():
    rng = random.Random(12)
    for _ in range(3000):
        fields = []
        w = wire.Writer()
        for num in sorted(rng.sample(range(1, 30), rng.randrange(1, 6))):
            kind = rng.choice(["int", "bytes", "rbytes", "packed"])
            if kind == "int":
                v = rng.choice([rng.randrange(1, 1 << 62), -rng.randrange(1, 1 << 62), 1])
                w.int(num, v)
                fields.append((num, kind, v))
            elif kind == "bytes":
                v = bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 20)))
                w.bytes(num, v)
                fields.append((num, kind, v))
            elif kind == "rbytes":
                v = [bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 9))) for _ in range(rng.randrange(1, 4))]
                w.rbytes(num, v)
                fields.append((num, kind, v))
            else:
                v = [rng.randrange(0, 1 << 40) for _ in range(rng.randrange(1, 9))]
                w.packed(num, v)
                fields.append((num, kind, v))
        a = wire.parse_all(w.done())
        for num, kind, v in fields:
            if kind == "int":
                assert wire.as_int64(a[num][-1]) == v
            elif kind == "bytes":
                assert a[num] == [v]
            elif kind == "rbytes":
                assert a[num] == v  # every element, empty ones included
            else:
                assert wire.unpack_varints(a[num][-1]) == v


@pytest.mark.parametrize(
    "cmd",
    [
        wire.Writer().int(1, 7).msg(3, wire.Writer().str(1, "sc-1").bool(2, True).int(3, 4)),
        wire.Writer().int(1, 8).int(2, 1).msg(4, wire.Writer().str(1, "s-1")),
        wire.Writer().int(1, 9).int(2, 3).msg(5, wire.Writer().str(1, "s-2").int(2, 64)),
    ],
)
def test_worker_command_decoder(cmd):
    c = bridge.decode_worker_command(cmd.done())
    if c.attach is not None:
        assert (c.command_id, c.attach.sidecar_instance, c.attach.pool_registered, c.attach.resident_sessions) == (
            7,
            "sc-1",
            True,
            4,
        )
    elif c.release is not None:
        assert (c.command_id, c.reason, c.release) == (8, bridge.REASON_CAPACITY, "s-1")
    else:
        assert (c.command_id, c.reason, c.truncate) == (9, bridge.REASON_PREFIX_MISMATCH, ("s-2", 64))


def test_worker_command_decoder_fuzz():
    rng = random.Random(13)
    for _ in range(5000):
        b = bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 30)))
        try:
            bridge.decode_worker_command(b)
        except ValueError:  # the only error a malformed message may raise
            pass
