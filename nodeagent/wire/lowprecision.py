"""Low-precision vectors on the wire: fp16, bf16, or int8 codes with absmax scales (DiLoCo's pseudo-gradients).

A vector travels as named tensors of a message, in the dtype it really has on the wire, so that the bytes every
runtime counts (`Message.payload_bytes`) are those that travel:
- full: {"delta": the parameters' dtype (n,)}, exact;
- fp16 / bf16: {"delta": float16 or bfloat16 (n,)}, rounded to nearest;
- int8: {"codes": int8 (n,), "scales": float32 (chunks,)}: the vector cut into chunks of `chunk` entries (0: one
  chunk, the whole vector, a per-tensor scale), each chunk's scale s = max |v| / 127 and its codes
  round(v / s) in [-127, 127]; decoding is codes * s. The error of an entry is at most s / 2 (half a step).

Decoding validates what a peer sent (shapes come from `specs`, checked by the wire before any state is touched) and
refuses non-finite scales, so a forged message cannot put NaN into a model.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from nodeagent.wire.errors import Reason, WireError
from nodeagent.wire.message import TensorSpec

Precision = Literal["full", "fp16", "bf16", "int8"]

_FLOAT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
INT8_LEVELS = 127


def chunk_count(length: int, chunk: int) -> int:
    """Scales of an int8 vector of `length` entries cut into chunks of `chunk` (0: one chunk)."""
    return 1 if chunk == 0 else max(1, math.ceil(length / chunk))


def specs(length: int, precision: Precision, chunk: int, dtype: torch.dtype) -> list[TensorSpec]:
    """The tensors a vector of `length` entries of `dtype` travels as."""
    if precision == "int8":
        return [TensorSpec("codes", torch.int8, (length,)),
                TensorSpec("scales", torch.float32, (chunk_count(length, chunk),))]
    return [TensorSpec("delta", _FLOAT_DTYPES.get(precision, dtype), (length,))]


def encode(vector: torch.Tensor, precision: Precision, chunk: int = 0) -> dict[str, torch.Tensor]:
    """The tensors that carry `vector` (a fresh copy: nothing aliases the caller's state)."""
    if precision != "int8":
        return {"delta": vector.detach().to(_FLOAT_DTYPES.get(precision, vector.dtype), copy=True)}
    length = vector.numel()
    count = chunk_count(length, chunk)
    size = length if chunk == 0 else chunk
    padded = torch.zeros(count * size, dtype=torch.float32, device=vector.device)
    padded[:length] = vector.detach()
    blocks = padded.view(count, size)
    scales = blocks.abs().amax(dim=1) / INT8_LEVELS
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[:, None]).clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return {"codes": codes.reshape(-1)[:length].clone(), "scales": scales}


def decode(tensors: dict[str, torch.Tensor], precision: Precision, chunk: int, dtype: torch.dtype) -> torch.Tensor:
    """The vector of `dtype` that `encode` made these tensors from (to its rounding)."""
    if precision != "int8":
        delta = tensors["delta"].to(dtype)
        if not bool(torch.isfinite(delta).all()):
            raise WireError(Reason.NON_FINITE, "a low-precision vector holds NaN or infinity")
        return delta
    codes, scales = tensors["codes"], tensors["scales"]
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise WireError(Reason.NON_FINITE, "an int8 vector's scales must be finite and not negative")
    length = codes.numel()
    size = length if chunk == 0 else chunk
    padded = torch.zeros(scales.numel() * size, dtype=torch.float32, device=codes.device)
    padded[:length] = codes.to(torch.float32)
    return (padded.view(scales.numel(), size) * scales[:, None]).reshape(-1)[:length].to(dtype)


def decode_rows(tensors: dict[str, torch.Tensor], precision: Precision, chunk: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, list[int]]:
    """The vectors of an all-gather (each tensor stacked over its rows, one row per member) as the rows of one tensor
    of `dtype`, and the indices of the rows kept: an int8 row whose scales `decode` refuses is left out; a float row
    is kept as it came, non-finite values and all, for the caller's own check of every row (one pass over the stack,
    not one per row)."""
    if precision != "int8":
        delta = tensors["delta"]
        return delta.to(dtype), list(range(delta.shape[0]))
    decoded, kept = [], []
    for row in range(tensors["codes"].shape[0]):
        try:
            decoded.append(decode({name: t[row] for name, t in tensors.items()}, precision, chunk, dtype))
        except WireError:
            continue
        kept.append(row)
    if not decoded:
        return torch.empty(0, tensors["codes"].shape[1], dtype=dtype, device=tensors["codes"].device), kept
    return torch.stack(decoded), kept

