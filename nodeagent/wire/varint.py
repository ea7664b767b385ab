"""Unsigned LEB128 varints, the one codec of them in the wire: one at a time for the protobuf frames built by hand
(frames.py), and many at once, vectorised, for AdaComp's compact encoding (sparse.py)."""

from __future__ import annotations

MAX_BYTES = 10  # a uint64, as protobuf writes it


def encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def decode_varint(data: memoryview | bytes, pos: int) -> tuple[int, int] | None:
    """The varint at data[pos:] and the position after it; None when it does not end within the data or within
    MAX_BYTES bytes."""
    value = 0
    shift = 0
    while pos < len(data) and shift < 7 * MAX_BYTES:
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return value, pos
        shift += 7
    return None
