"""Unsigned LEB128 varints, the one codec of them in the wire: one at a time for the protobuf frames built by hand
(frames.py), read as protobuf reads them (up to 10 bytes); and many at once, vectorised, for AdaComp's compact
encoding (sparse.py), which admits only canonical varints of at most 9 bytes."""

from __future__ import annotations

import numpy as np

MAX_BYTES = 10  # a uint64, as protobuf writes it
MAX_ARRAY_BYTES = 9  # 63 bits: any index of an int64-addressable tensor, and no int64 overflow while decoding


def encode_varint(value: int) -> bytes:
    """The shortest varint of `value` (unsigned)."""
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


def encode_varints(values: np.ndarray) -> bytes:
    """Unsigned LEB128 of each value, canonical and at most MAX_ARRAY_BYTES long; vectorised (an AdaComp push
    holds thousands)."""
    values = values.astype(np.int64)
    if (values < 0).any():
        raise ValueError("varints are unsigned")
    lengths = np.ones(values.size, dtype=np.int64)
    for j in range(1, MAX_ARRAY_BYTES):
        lengths += values >= (1 << (7 * j))
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    starts = np.cumsum(lengths) - lengths
    for j in range(int(lengths.max(initial=0))):
        has = lengths > j
        more = (lengths[has] > j + 1).astype(np.int64) << 7
        out[starts[has] + j] = ((values[has] >> (7 * j)) & 0x7F) | more
    return out.tobytes()


def decode_varints(buf: np.ndarray, pos: int, count: int, what: str) -> tuple[np.ndarray, int]:
    """`count` varints from buf[pos:]; the values (int64) and the position after them. A varint that is truncated,
    longer than MAX_ARRAY_BYTES or not canonical raises ValueError naming `what`."""
    if count == 0:
        return np.zeros(0, dtype=np.int64), pos
    window = buf[pos : pos + count * MAX_ARRAY_BYTES]
    ends = np.flatnonzero(window < 0x80)[:count]
    starts = np.concatenate([[0], ends[:-1] + 1])
    lengths = ends - starts + 1
    # With count * 9 bytes at hand, fewer than count terminators means a varint ran past 9 bytes.
    too_long = ends.size < count and window.size == count * MAX_ARRAY_BYTES
    if (ends.size and lengths.max() > MAX_ARRAY_BYTES) or too_long:
        raise ValueError(f"{what}: a varint at byte {pos} or after is longer than {MAX_ARRAY_BYTES} bytes")
    if ends.size < count:
        raise ValueError(f"truncated {what}: {ends.size} of {count} varints at byte {pos}")
    if (window[ends[lengths > 1]] == 0).any():
        raise ValueError(f"{what}: non-canonical varint (trailing zero byte)")
    body = window[: ends[-1] + 1].astype(np.int64)
    within = np.arange(body.size) - np.repeat(starts, lengths)
    values = np.add.reduceat((body & 0x7F) << (7 * within), starts)
    return values, pos + int(ends[-1]) + 1
