"""How a tensor travels: the encoding it is sent in, its dtype on the wire, and its length there."""

from __future__ import annotations

import torch

from nodeagent.wire.message import Encoding, TensorSpec

# Wire dtypes of the lossy encodings; they apply to floating tensors only, others travel raw.
_ENCODED_DTYPES = {Encoding.FP16: torch.float16, Encoding.BF16: torch.bfloat16}


def wire_encoding(dtype: torch.dtype, requested: Encoding) -> Encoding:
    """The encoding a tensor of `dtype` travels in when `requested` is asked for."""
    if requested in _ENCODED_DTYPES and dtype.is_floating_point and dtype != _ENCODED_DTYPES[requested]:
        return requested
    return Encoding.RAW


def wire_dtype(dtype: torch.dtype, encoding: Encoding) -> torch.dtype:
    return _ENCODED_DTYPES.get(encoding, dtype)


def wire_length(spec: TensorSpec, encoding: Encoding) -> int:
    return spec.numel * wire_dtype(spec.dtype, encoding).itemsize
