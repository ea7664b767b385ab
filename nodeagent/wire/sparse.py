"""AdaComp's sparse updates: the worker's top-k selection and error feedback, and the
compact encoding that pushes and delta pulls travel in, as one uint8 tensor of a wire message. The server's rule
is nodeagent.ps.adacomp.

Worker side (pure functions): `select_topk` keeps, per tensor of n entries, the k = max(1, floor(n * rate))
entries of largest magnitude; `Residual` is the optional error feedback; `compress` chains them with the
compact encoding. A "tensor" is the slice [offset, offset + n) of the flat parameter vector, in the order of
`tensor_sizes` (FlatParameters.sizes); a sparse update is, per tensor, (indices into the slice, values).

Compact encoding (`encode_sparse` / `decode_sparse`), little-endian:
    u8      codec (0: fp32 values, 1: fp16, 2: int8 with a per-tensor fp32 scale)
    varint  number of tensors (must equal len(tensor_sizes))
    per tensor:
        varint  count c (0 <= c <= n)
        f32     scale, only for int8 and c > 0 (value = q * scale, scale = max |v| / 127)
        c varints  index gaps: the first index, then index[i] - index[i-1] - 1 (indices strictly increasing)
        c values   f32, f16 or i8
Varints are unsigned LEB128, at most 9 bytes, canonical (no trailing zero byte). At rate 0.01 the mean gap
is about 100, so most gaps take one byte: about 2.3 bytes per entry with int8 values, 3.3 with fp16, against
8 for int32 indices with fp32 values (only 50x less than dense ASGD). Gradient pushes can be lossy (with the
residual on, the quantisation error is fed back too); model pulls use fp32 and are exact.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nodeagent.wire.errors import Reason, WireError
from nodeagent.wire.message import all_finite
from nodeagent.wire.varint import decode_varints, encode_varints

Sparse = list[tuple[torch.Tensor, torch.Tensor]]  # per tensor: (indices int64 ascending, values float32)


class Codec(enum.IntEnum):
    """How values travel; the number is the encoding's first byte."""

    FP32 = 0
    FP16 = 1
    INT8 = 2


_VALUE_DTYPES = {Codec.FP32: np.dtype("<f4"), Codec.FP16: np.dtype("<f2"), Codec.INT8: np.dtype("i1")}


def select_topk(grad: torch.Tensor, tensor_sizes: Sequence[int], rate: float) -> Sparse:
    """Per tensor, the k = max(1, floor(n * rate)) entries of largest magnitude, indices ascending.

    Among equal magnitudes at the threshold the lowest indices win, so the selection is deterministic whatever
    order torch.topk returns ties in. On large tensors the exact k-th magnitude is found among candidates above a
    threshold estimated from a fixed sample (a few times faster than torch.topk on the whole tensor, same result:
    every entry at or above the k-th magnitude is a candidate).
    """
    if not 0 < rate <= 1:
        raise ValueError(f"rate must be in (0, 1], got {rate}")
    check_sizes(tensor_sizes, grad.numel())
    if not all_finite(grad):
        raise ValueError("gradient has non-finite entries")
    selected: Sparse = []
    offset = 0
    for n in tensor_sizes:
        segment = grad[offset : offset + n]
        magnitude = segment.abs()
        k = min(n, max(1, math.floor(n * rate)))
        candidates = _candidates(magnitude, k)
        values = magnitude[candidates]
        threshold = torch.topk(values, k, sorted=False).values.min()
        above = candidates[values > threshold]
        ties = candidates[values == threshold][: k - above.numel()]
        indices = torch.sort(torch.cat([above, ties])).values
        selected.append((indices, segment[indices].to(torch.float32)))
        offset += n
    return selected


_SAMPLE = 1 << 14


def _candidates(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices of a superset of the k largest magnitudes (all indices for small tensors)."""
    n = magnitude.numel()
    if n < 4 * _SAMPLE or 16 * k > n:
        return torch.arange(n, device=magnitude.device)
    # Drawn on the CPU's generator: the same sample, and so the same selection, on every device.
    picks = torch.randint(0, n, (_SAMPLE,), generator=torch.Generator().manual_seed(n ^ k)).to(magnitude.device)
    # Aim for about 2k candidates: the sample's quantile at 1 - 2k/n, with a margin for small k.
    keep = min(_SAMPLE, 2 * k * _SAMPLE // n + 16)
    estimate = torch.kthvalue(magnitude[picks], _SAMPLE - keep + 1).values
    candidates = torch.nonzero(magnitude >= estimate).flatten()
    return candidates if candidates.numel() >= k else torch.arange(n, device=magnitude.device)


def densify(sparse: Sparse, tensor_sizes: Sequence[int], device: torch.device | None = None) -> torch.Tensor:
    """The flat dense vector of a sparse update (zeros elsewhere), on `device` (default: the update's)."""
    device = device if device is not None else sparse[0][1].device
    flat = torch.zeros(sum(tensor_sizes), dtype=torch.float32, device=device)
    values = torch.cat([values for _, values in sparse]).to(device=device, dtype=torch.float32)
    flat[flat_indices(sparse, tensor_sizes).to(device)] = values
    return flat


def flat_indices(sparse: Sparse, tensor_sizes: Sequence[int]) -> torch.Tensor:
    """The indices of a sparse update in the flat vector (tensor offset + index)."""
    if len(sparse) != len(tensor_sizes):
        raise ValueError(f"{len(sparse)} tensors for {len(tensor_sizes)} tensor sizes")
    offsets = itertools.accumulate(tensor_sizes[:-1], initial=0)
    return torch.cat([indices.to(torch.int64) + offset for (indices, _), offset in zip(sparse, offsets, strict=True)])


class Residual:
    """Error feedback (off by default, as in the paper): what was not sent is added to the next gradient."""

    def __init__(self, numel: int, device: torch.device | None = None):
        self.error = torch.zeros(numel, dtype=torch.float32, device=device)

    def apply(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient to select from: this step's gradient plus everything not sent so far."""
        return grad + self.error

    def keep(self, corrected: torch.Tensor, sent: Sparse, tensor_sizes: Sequence[int]) -> None:
        """Keep what `sent` (as the server will apply it, quantisation included) left of `corrected`."""
        self.error = corrected - densify(sent, tensor_sizes, corrected.device)


def compress(
    grad: torch.Tensor, tensor_sizes: Sequence[int], rate: float, codec: Codec, residual: Residual | None = None
) -> tuple[bytes, Sparse]:
    """One worker push: the encoded payload and the update the server will decode from it."""
    corrected = residual.apply(grad) if residual is not None else grad
    payload = encode_sparse(select_topk(corrected, tensor_sizes, rate), tensor_sizes, codec)
    sent = decode_sparse(payload, tensor_sizes)
    if residual is not None:
        residual.keep(corrected, sent, tensor_sizes)
    return payload, sent


# -- the compact encoding ---------------------------------------------------------------------------------------


def encode_sparse(sparse: Sparse, tensor_sizes: Sequence[int], codec: Codec) -> bytes:
    check_sizes(tensor_sizes)
    if len(sparse) != len(tensor_sizes):
        raise ValueError(f"{len(sparse)} tensors for {len(tensor_sizes)} tensor sizes")
    parts = [bytes([Codec(codec)]), encode_varints(np.array([len(tensor_sizes)]))]
    for t, ((indices, values), n) in enumerate(zip(sparse, tensor_sizes, strict=True)):
        idx = indices.to(torch.int64).cpu().numpy()  # only the selected entries leave a GPU
        val = values.detach().to(torch.float32).cpu().numpy()
        if idx.ndim != 1 or val.shape != idx.shape:
            raise ValueError(f"tensor {t}: indices and values must be 1-D of one length")
        if idx.size and (idx[0] < 0 or idx[-1] >= n or (np.diff(idx) <= 0).any()):
            raise ValueError(f"tensor {t}: indices must be strictly increasing in [0, {n})")
        if not np.isfinite(val).all():
            raise ValueError(f"tensor {t}: values have non-finite entries")
        parts.append(encode_varints(np.array([idx.size])))
        if codec == Codec.INT8 and idx.size:
            scale = np.float32(np.abs(val).max() / 127)
            parts.append(scale.astype("<f4").tobytes())
            encoded = np.round(val / scale) if scale > 0 else np.zeros_like(val)
        else:
            encoded = val
        if codec == Codec.FP16 and idx.size and np.abs(val).max() > np.finfo(np.float16).max:
            raise ValueError(f"tensor {t}: values overflow FP16")
        parts.append(encode_varints(np.diff(idx, prepend=-1) - 1))
        parts.append(encoded.astype(_VALUE_DTYPES[Codec(codec)]).tobytes())
    return b"".join(parts)


def decode_sparse(payload: bytes, tensor_sizes: Sequence[int]) -> Sparse:
    """Decode and validate a payload from the network; every malformation raises ValueError saying where, and a
    NaN or an infinity among the values WireError(Reason.NON_FINITE), as in any other stream."""
    check_sizes(tensor_sizes)
    buf = np.frombuffer(payload, dtype=np.uint8)
    if buf.size == 0:
        raise ValueError("empty payload")
    try:
        codec = Codec(int(buf[0]))
    except ValueError:
        raise ValueError(f"unknown codec {int(buf[0])}") from None
    count, pos = decode_varints(buf, 1, 1, "tensor count")
    if int(count[0]) != len(tensor_sizes):
        raise ValueError(f"payload has {int(count[0])} tensors, the model {len(tensor_sizes)}")
    dtype = _VALUE_DTYPES[codec]
    sparse: Sparse = []
    for t, n in enumerate(tensor_sizes):
        counts, pos = decode_varints(buf, pos, 1, f"tensor {t} count")
        c = int(counts[0])
        if c > n:
            raise ValueError(f"tensor {t}: {c} entries for a tensor of {n}")
        scale = np.float32(1)
        if codec == Codec.INT8 and c:
            _need(buf, pos, 4, f"tensor {t} scale")
            scale = np.frombuffer(payload, dtype="<f4", count=1, offset=pos)[0]
            if not np.isfinite(scale) or scale < 0:
                raise ValueError(f"tensor {t}: scale {scale} is not a finite non-negative number")
            pos += 4
        gaps, pos = decode_varints(buf, pos, c, f"tensor {t} indices")
        if (gaps >= n).any():
            raise ValueError(f"tensor {t}: index gap {int(gaps.max())} out of range for a tensor of {n}")
        indices = np.cumsum(gaps + 1) - 1
        if c and indices[-1] >= n:
            raise ValueError(f"tensor {t}: index {int(indices[-1])} out of range [0, {n})")
        _need(buf, pos, c * dtype.itemsize, f"tensor {t} values")
        raw = np.frombuffer(payload, dtype=dtype, count=c, offset=pos)
        pos += c * dtype.itemsize
        # Checked as decoded: a finite int8 scale near float32's maximum times 127 is an infinity (refused below,
        # so numpy need not warn of it).
        with np.errstate(over="ignore"):
            values = raw.astype(np.float32) * scale if codec == Codec.INT8 else raw.astype(np.float32)
        if not np.isfinite(values).all():
            raise WireError(Reason.NON_FINITE, f"tensor {t}: values have non-finite entries")
        sparse.append((torch.from_numpy(indices.astype(np.int64)), torch.from_numpy(values)))
    if pos != buf.size:
        raise ValueError(f"{buf.size - pos} trailing bytes after the last tensor")
    return sparse


@dataclass(frozen=True)
class Traffic:
    """Bytes of one push, dense (fp32, as ASGD sends it) against sparse (the encoded payload)."""

    dense_bytes: int
    sparse_bytes: int
    entries: int

    @property
    def ratio(self) -> float:
        return self.dense_bytes / self.sparse_bytes

    @property
    def bytes_per_entry(self) -> float:
        return self.sparse_bytes / self.entries


def traffic(payload: bytes, tensor_sizes: Sequence[int]) -> Traffic:
    entries = sum(indices.numel() for indices, _ in decode_sparse(payload, tensor_sizes))
    return Traffic(dense_bytes=4 * sum(tensor_sizes), sparse_bytes=len(payload), entries=entries)


def _need(buf: np.ndarray, pos: int, size: int, what: str) -> None:
    if pos + size > buf.size:
        raise ValueError(f"truncated {what}: {size} bytes needed at byte {pos}, {buf.size - pos} left")


def check_sizes(tensor_sizes: Sequence[int], numel: int | None = None) -> None:
    """Raise ValueError unless the tensor sizes are positive (and add up to `numel`, when given)."""
    if not tensor_sizes or any(n < 1 for n in tensor_sizes):
        raise ValueError("tensor sizes must be a non-empty list of positive sizes")
    if numel is not None and sum(tensor_sizes) != numel:
        raise ValueError(f"tensor sizes add up to {sum(tensor_sizes)}, the vector has {numel}")
