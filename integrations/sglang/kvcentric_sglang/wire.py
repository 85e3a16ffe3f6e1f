"""Minimal protobuf (proto3) wire encoding for the WorkerBridge messages.

Only what kvc.v1.WorkerBridgeService needs: varints (int32/int64/uint64/bool/enum, negative values
as 10-byte two's complement), length-delimited fields (string, bytes, messages, packed repeated
int64) and fixed64 doubles. Field numbers come from proto/kvc/v1/bridge.proto.
"""

import struct

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _varint(v: int) -> bytes:
    if v < 0:
        v += 1 << 64
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(num: int, wt: int) -> bytes:
    return _varint((num << 3) | wt)


class Writer:
    """Appends fields in proto3 form; zero values are omitted, as proto3 does."""

    def __init__(self):
        self._b = bytearray()

    def int(self, num: int, v: int) -> "Writer":
        if v:
            self._b += _key(num, _VARINT) + _varint(int(v))
        return self

    def bool(self, num: int, v: bool) -> "Writer":
        return self.int(num, 1 if v else 0)

    def bytes(self, num: int, v: bytes) -> "Writer":
        if v:
            self._b += _key(num, _LEN) + _varint(len(v)) + v
        return self

    def str(self, num: int, v: str) -> "Writer":
        return self.bytes(num, v.encode("utf-8") if v else b"")

    def msg(self, num: int, w: "Writer") -> "Writer":
        body = w.done()
        self._b += _key(num, _LEN) + _varint(len(body)) + body
        return self

    def rbytes(self, num: int, vals) -> "Writer":
        """A repeated bytes field: every element is written, empty ones included."""
        for v in vals:
            v = bytes(v)
            self._b += _key(num, _LEN) + _varint(len(v)) + v
        return self

    def packed(self, num: int, vals) -> "Writer":
        vals = list(vals)
        if vals:
            body = b"".join(_varint(int(v)) for v in vals)
            self._b += _key(num, _LEN) + _varint(len(body)) + body
        return self

    def done(self) -> bytes:
        return bytes(self._b)


def _read_varint(b: bytes, i: int):
    shift = v = 0
    while True:
        if i >= len(b):
            raise ValueError("truncated varint")
        c = b[i]
        i += 1
        v |= (c & 0x7F) << shift
        if not c & 0x80:
            return v, i
        shift += 7
        if shift >= 70:
            raise ValueError("varint too long")


def parse(b: bytes) -> dict:
    """Returns {field number: last value} (varints as unsigned ints, LEN fields as bytes,
    fixed64 as raw 8 bytes). Unknown fields are kept; malformed input raises ValueError."""
    return {num: vals[-1] for num, vals in parse_all(b).items()}


def parse_all(b: bytes) -> dict:
    """Like parse, but {field number: [every value in order]}: repeated fields (repeated bytes,
    repeated messages, unpacked repeated scalars) keep all their elements."""
    out = {}
    i = 0
    while i < len(b):
        k, i = _read_varint(b, i)
        num, wt = k >> 3, k & 7
        if wt == _VARINT:
            v, i = _read_varint(b, i)
        elif wt == _I64:
            v, i = b[i : i + 8], i + 8
        elif wt == _LEN:
            n, i = _read_varint(b, i)
            v, i = b[i : i + n], i + n
        elif wt == _I32:
            v, i = b[i : i + 4], i + 4
        else:
            raise ValueError("unsupported wire type %d" % wt)
        if i > len(b):
            raise ValueError("truncated field %d" % num)
        out.setdefault(num, []).append(v)
    return out


def unpack_varints(v) -> list:
    """The elements of a packed repeated varint field (as unsigned ints)."""
    out, i, v = [], 0, v or b""
    while i < len(v):
        x, i = _read_varint(v, i)
        out.append(x)
    return out


def as_int64(v) -> int:
    v = v or 0
    if not isinstance(v, int):
        raise ValueError("field is not a varint")
    return v - (1 << 64) if v >= 1 << 63 else v


def as_str(v) -> str:
    if v is not None and not isinstance(v, (bytes, bytearray)):
        raise ValueError("field is not a string")
    return bytes(v or b"").decode("utf-8")  # UnicodeDecodeError is a ValueError


def as_msg(v) -> dict:
    """parse() of an embedded message field (absent: empty)."""
    if v is not None and not isinstance(v, (bytes, bytearray)):
        raise ValueError("field is not a message")
    return parse(bytes(v or b""))


def as_double(v) -> float:
    if v and (not isinstance(v, (bytes, bytearray)) or len(v) != 8):
        raise ValueError("field is not a fixed64 double")
    return struct.unpack("<d", v)[0] if v else 0.0
