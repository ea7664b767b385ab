"""The wire's one varint codec: the scalar half (hand-built protobuf frames) and the vectorised half (AdaComp's
compact encoding) write the same bytes; each reads as its format requires."""

import numpy as np
import pytest

from nodeagent.wire.varint import MAX_BYTES, decode_varint, decode_varints, encode_varint, encode_varints

pytestmark = pytest.mark.unit

VALUES = [0, 1, 127, 128, 300, 16_383, 16_384, 2**35 + 5, 2**63 - 1]


def test_scalar_and_vectorised_varints_are_the_same_bytes():
    packed = encode_varints(np.array(VALUES))
    assert packed == b"".join(encode_varint(value) for value in VALUES)
    values, end = decode_varints(np.frombuffer(packed, np.uint8), 0, len(VALUES), "values")
    assert values.tolist() == VALUES and end == len(packed)
    pos = 0
    for value in VALUES:
        read = decode_varint(packed, pos)
        assert read is not None and read[0] == value
        pos = read[1]


def test_a_scalar_varint_is_read_as_protobuf_reads_it():
    assert decode_varint(encode_varint(2**64 - 1), 0) == (2**64 - 1, MAX_BYTES)
    assert decode_varint(b"\x80\x00", 0) == (0, 2)  # not canonical, but protobuf accepts it
    assert decode_varint(b"\x80\x80", 0) is None  # truncated
    assert decode_varint(b"\x80" * MAX_BYTES + b"\x00", 0) is None  # longer than a uint64's


@pytest.mark.parametrize(
    ("data", "count", "message"),
    [
        (b"\x80\x00", 1, "non-canonical"),
        (b"\x80" * 9 + b"\x01", 1, "longer than 9 bytes"),
        (b"\x05\x80", 2, "truncated"),
    ],
)
def test_vectorised_varints_are_canonical_and_at_most_9_bytes(data, count, message):
    with pytest.raises(ValueError, match=message):
        decode_varints(np.frombuffer(data, np.uint8), 0, count, "values")
