"""AdaComp (ALGORITHMS.md, "AdaComp"): top-k sparse pushes with staleness-scaled application on the server.

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

Server side: `AdaCompServer` keeps, per applied push, the flat indices it touched, in a window of the last
`max_delay` pushes. A push computed on version v has delay = version - v; each sent index has staleness = the
number of the last `delay` pushes that touched it, and w[idx] <- w[idx] - lr * g / max(1, staleness). A push
older than the window is rejected (the worker pulls and recomputes): clamping its delay to the window would
under-count its staleness and apply it with too large a step.
"""

from __future__ import annotations

import enum
import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nodeagent.ps.rules import ParameterServer, ProtocolError, PushResult, StateDict, state_int, state_tensor

Sparse = list[tuple[torch.Tensor, torch.Tensor]]  # per tensor: (indices int64 ascending, values float32)

_MAX_VARINT = 9  # 63 bits: any index of an int64-addressable tensor, and no int64 overflow while decoding


class Codec(enum.IntEnum):
    """How values travel; the number is the encoding's first byte."""

    FP32 = 0
    FP16 = 1
    INT8 = 2


_VALUE_DTYPES = {Codec.FP32: np.dtype("<f4"), Codec.FP16: np.dtype("<f2"), Codec.INT8: np.dtype("i1")}


# -- worker side ------------------------------------------------------------------------------------------------


def select_topk(grad: torch.Tensor, tensor_sizes: Sequence[int], rate: float) -> Sparse:
    """Per tensor, the k = max(1, floor(n * rate)) entries of largest magnitude, indices ascending.

    Among equal magnitudes at the threshold the lowest indices win, so the selection is deterministic whatever
    order torch.topk returns ties in. On large tensors the exact k-th magnitude is found among candidates above a
    threshold estimated from a fixed sample (a few times faster than torch.topk on the whole tensor, same result:
    every entry at or above the k-th magnitude is a candidate).
    """
    if not 0 < rate <= 1:
        raise ValueError(f"rate must be in (0, 1], got {rate}")
    _check_sizes(tensor_sizes, grad.numel())
    if not bool(torch.isfinite(grad).all()):
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
        return torch.arange(n)
    picks = torch.randint(0, n, (_SAMPLE,), generator=torch.Generator().manual_seed(n ^ k))
    # Aim for about 2k candidates: the sample's quantile at 1 - 2k/n, with a margin for small k.
    keep = min(_SAMPLE, 2 * k * _SAMPLE // n + 16)
    estimate = torch.kthvalue(magnitude[picks], _SAMPLE - keep + 1).values
    candidates = torch.nonzero(magnitude >= estimate).flatten()
    return candidates if candidates.numel() >= k else torch.arange(n)


def densify(sparse: Sparse, tensor_sizes: Sequence[int]) -> torch.Tensor:
    """The flat dense vector of a sparse update (zeros elsewhere)."""
    flat = torch.zeros(sum(tensor_sizes), dtype=torch.float32)
    flat[flat_indices(sparse, tensor_sizes)] = torch.cat([values for _, values in sparse]).to(torch.float32)
    return flat


def flat_indices(sparse: Sparse, tensor_sizes: Sequence[int]) -> torch.Tensor:
    """The indices of a sparse update in the flat vector (tensor offset + index)."""
    if len(sparse) != len(tensor_sizes):
        raise ValueError(f"{len(sparse)} tensors for {len(tensor_sizes)} tensor sizes")
    offsets = itertools.accumulate(tensor_sizes[:-1], initial=0)
    return torch.cat([indices.to(torch.int64) + offset for (indices, _), offset in zip(sparse, offsets, strict=True)])


class Residual:
    """Error feedback (off by default, as in the paper): what was not sent is added to the next gradient."""

    def __init__(self, numel: int):
        self.error = torch.zeros(numel, dtype=torch.float32)

    def apply(self, grad: torch.Tensor) -> torch.Tensor:
        """The gradient to select from: this step's gradient plus everything not sent so far."""
        return grad + self.error

    def keep(self, corrected: torch.Tensor, sent: Sparse, tensor_sizes: Sequence[int]) -> None:
        """Keep what `sent` (as the server will apply it, quantisation included) left of `corrected`."""
        self.error = corrected - densify(sent, tensor_sizes)


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
    _check_sizes(tensor_sizes)
    if len(sparse) != len(tensor_sizes):
        raise ValueError(f"{len(sparse)} tensors for {len(tensor_sizes)} tensor sizes")
    parts = [bytes([Codec(codec)]), _write_varints(np.array([len(tensor_sizes)]))]
    for t, ((indices, values), n) in enumerate(zip(sparse, tensor_sizes, strict=True)):
        idx = indices.to(torch.int64).numpy()
        val = values.detach().to(torch.float32).numpy()
        if idx.ndim != 1 or val.shape != idx.shape:
            raise ValueError(f"tensor {t}: indices and values must be 1-D of one length")
        if idx.size and (idx[0] < 0 or idx[-1] >= n or (np.diff(idx) <= 0).any()):
            raise ValueError(f"tensor {t}: indices must be strictly increasing in [0, {n})")
        if not np.isfinite(val).all():
            raise ValueError(f"tensor {t}: values have non-finite entries")
        parts.append(_write_varints(np.array([idx.size])))
        if codec == Codec.INT8 and idx.size:
            scale = np.float32(np.abs(val).max() / 127)
            parts.append(scale.astype("<f4").tobytes())
            encoded = np.round(val / scale) if scale > 0 else np.zeros_like(val)
        else:
            encoded = val
        if codec == Codec.FP16 and idx.size and np.abs(val).max() > np.finfo(np.float16).max:
            raise ValueError(f"tensor {t}: values overflow FP16")
        parts.append(_write_varints(np.diff(idx, prepend=-1) - 1))
        parts.append(encoded.astype(_VALUE_DTYPES[Codec(codec)]).tobytes())
    return b"".join(parts)


def decode_sparse(payload: bytes, tensor_sizes: Sequence[int]) -> Sparse:
    """Decode and validate a payload from the network; every malformation raises ValueError saying where."""
    _check_sizes(tensor_sizes)
    buf = np.frombuffer(payload, dtype=np.uint8)
    if buf.size == 0:
        raise ValueError("empty payload")
    try:
        codec = Codec(int(buf[0]))
    except ValueError:
        raise ValueError(f"unknown codec {int(buf[0])}") from None
    count, pos = _read_varints(buf, 1, 1, "tensor count")
    if int(count[0]) != len(tensor_sizes):
        raise ValueError(f"payload has {int(count[0])} tensors, the model {len(tensor_sizes)}")
    dtype = _VALUE_DTYPES[codec]
    sparse: Sparse = []
    for t, n in enumerate(tensor_sizes):
        counts, pos = _read_varints(buf, pos, 1, f"tensor {t} count")
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
        gaps, pos = _read_varints(buf, pos, c, f"tensor {t} indices")
        if (gaps >= n).any():
            raise ValueError(f"tensor {t}: index gap {int(gaps.max())} out of range for a tensor of {n}")
        indices = np.cumsum(gaps + 1) - 1
        if c and indices[-1] >= n:
            raise ValueError(f"tensor {t}: index {int(indices[-1])} out of range [0, {n})")
        _need(buf, pos, c * dtype.itemsize, f"tensor {t} values")
        raw = np.frombuffer(payload, dtype=dtype, count=c, offset=pos)
        pos += c * dtype.itemsize
        if not np.isfinite(raw).all():
            raise ValueError(f"tensor {t}: values have non-finite entries")
        values = raw.astype(np.float32) * scale if codec == Codec.INT8 else raw.astype(np.float32)
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


def _write_varints(values: np.ndarray) -> bytes:
    """Unsigned LEB128 of each value, vectorised (a push holds thousands)."""
    values = values.astype(np.int64)
    if (values < 0).any():
        raise ValueError("varints are unsigned")
    lengths = np.ones(values.size, dtype=np.int64)
    for j in range(1, _MAX_VARINT):
        lengths += values >= (1 << (7 * j))
    out = np.empty(int(lengths.sum()), dtype=np.uint8)
    starts = np.cumsum(lengths) - lengths
    for j in range(int(lengths.max(initial=0))):
        has = lengths > j
        more = (lengths[has] > j + 1).astype(np.int64) << 7
        out[starts[has] + j] = ((values[has] >> (7 * j)) & 0x7F) | more
    return out.tobytes()


def _read_varints(buf: np.ndarray, pos: int, count: int, what: str) -> tuple[np.ndarray, int]:
    """`count` varints from buf[pos:]; the values (int64) and the position after them."""
    if count == 0:
        return np.zeros(0, dtype=np.int64), pos
    window = buf[pos : pos + count * _MAX_VARINT]
    ends = np.flatnonzero(window < 0x80)[:count]
    starts = np.concatenate([[0], ends[:-1] + 1])
    lengths = ends - starts + 1
    # With count * 9 bytes at hand, fewer than count terminators means a varint ran past 9 bytes.
    if (ends.size and lengths.max() > _MAX_VARINT) or (ends.size < count and window.size == count * _MAX_VARINT):
        raise ValueError(f"{what}: a varint at byte {pos} or after is longer than {_MAX_VARINT} bytes")
    if ends.size < count:
        raise ValueError(f"truncated {what}: {ends.size} of {count} varints at byte {pos}")
    if (window[ends[lengths > 1]] == 0).any():
        raise ValueError(f"{what}: non-canonical varint (trailing zero byte)")
    body = window[: ends[-1] + 1].astype(np.int64)
    within = np.arange(body.size) - np.repeat(starts, lengths)
    values = np.add.reduceat((body & 0x7F) << (7 * within), starts)
    return values, pos + int(ends[-1]) + 1


def _need(buf: np.ndarray, pos: int, size: int, what: str) -> None:
    if pos + size > buf.size:
        raise ValueError(f"truncated {what}: {size} bytes needed at byte {pos}, {buf.size - pos} left")


def _check_sizes(tensor_sizes: Sequence[int], numel: int | None = None) -> None:
    if not tensor_sizes or any(n < 1 for n in tensor_sizes):
        raise ValueError("tensor sizes must be a non-empty list of positive sizes")
    if numel is not None and sum(tensor_sizes) != numel:
        raise ValueError(f"tensor sizes add up to {sum(tensor_sizes)}, the vector has {numel}")


# -- server side ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeltaPull:
    """A pull since the worker's version: the current values at the flat indices changed since then, or, with
    `indices` None, the full model (the worker's version is older than the window)."""

    version: int
    indices: torch.Tensor | None
    values: torch.Tensor


class AdaCompServer(ParameterServer):
    def __init__(self, w0: torch.Tensor, num_workers: int, tensor_sizes: Sequence[int], lr: float, max_delay: int):
        super().__init__(w0, num_workers)
        _check_sizes(tensor_sizes, self.w.numel())
        if max_delay < 1:
            raise ValueError(f"max_delay must be >= 1, got {max_delay}")
        self.tensor_sizes = list(tensor_sizes)
        self.lr = lr
        self.max_delay = max_delay
        # window[-d] holds the sorted flat indices touched by the push that made version `version - d + 1`.
        self.window: deque[torch.Tensor] = deque(maxlen=max_delay)

    def push(self, worker: int, update: Sparse, worker_version: int) -> PushResult:
        self.check_worker(worker)
        delay = self.delay_of(worker_version)
        flat, values = self._check_sparse(update)
        if delay > self.max_delay:
            reason = f"delay {delay} exceeds the staleness window of {self.max_delay} pushes"
            return PushResult(applied=False, version=self.version, release=(worker,), delay=delay, rejected=reason)
        staleness = self._staleness(flat, delay)
        self.w.index_add_(0, flat, values / staleness.clamp(min=1).to(values.dtype), alpha=-self.lr)
        self.window.append(flat)
        self.version += 1
        return PushResult(applied=True, version=self.version, release=(worker,), delay=delay)

    def pull_delta(self, worker: int, since_version: int) -> DeltaPull:
        self.check_worker(worker)
        delay = self.delay_of(since_version)
        if delay > len(self.window):
            return DeltaPull(self.version, None, self.w.clone())
        indices = self._recent(delay).unique()
        return DeltaPull(self.version, indices, self.w[indices])

    def state_dict(self) -> StateDict:
        lengths = torch.tensor([entry.numel() for entry in self.window], dtype=torch.int64)
        return {**super().state_dict(), "window_indices": self._recent(len(self.window)), "window_lengths": lengths}

    def load_state_dict(self, state: Mapping[str, torch.Tensor | int]) -> None:
        lengths = state.get("window_lengths")
        if not isinstance(lengths, torch.Tensor) or lengths.dtype != torch.int64 or lengths.dim() != 1:
            raise ValueError("state['window_lengths'] must be a 1-D int64 tensor")
        version = state_int(state, "version")
        if lengths.numel() != min(version, self.max_delay) or bool((lengths < 0).any()):
            raise ValueError(f"state['window_lengths'] must hold min(version, {self.max_delay}) lengths >= 0")
        total = int(lengths.sum())
        expected = torch.zeros(total, dtype=torch.int64)
        indices = state_tensor(state, "window_indices", expected)
        if total and (int(indices.min()) < 0 or int(indices.max()) >= self.w.numel()):
            raise ValueError("state['window_indices'] has indices outside the model")
        super().load_state_dict(state)
        self.window = deque((part.clone() for part in torch.split(indices, lengths.tolist())), maxlen=self.max_delay)

    def _recent(self, delay: int) -> torch.Tensor:
        if delay == 0:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat(list(self.window)[-delay:])

    def _staleness(self, flat: torch.Tensor, delay: int) -> torch.Tensor:
        # Each window entry is a set, so an index's count in the concatenation is the number of pushes touching it.
        recent = torch.sort(self._recent(delay)).values
        return torch.searchsorted(recent, flat, right=True) - torch.searchsorted(recent, flat, right=False)

    def _check_sparse(self, update: Sparse) -> tuple[torch.Tensor, torch.Tensor]:
        if len(update) != len(self.tensor_sizes):
            raise ProtocolError(f"update has {len(update)} tensors, the model {len(self.tensor_sizes)}")
        for t, ((indices, values), n) in enumerate(zip(update, self.tensor_sizes, strict=True)):
            if indices.dim() != 1 or values.shape != indices.shape or indices.dtype not in (torch.int32, torch.int64):
                raise ProtocolError(f"tensor {t}: indices (int32/int64) and values must be 1-D of one length")
            if indices.numel() and (
                int(indices[0]) < 0 or int(indices[-1]) >= n or bool((torch.diff(indices) <= 0).any())
            ):
                raise ProtocolError(f"tensor {t}: indices must be strictly increasing in [0, {n})")
        values = torch.cat([values for _, values in update]).to(self.w.dtype)
        if not bool(torch.isfinite(values).all()):
            raise ProtocolError("update has non-finite values")
        return flat_indices(update, self.tensor_sizes), values
