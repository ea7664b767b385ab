"""What travels between nodes, independent of how it is framed: a message of named tensors plus a header."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nodeagent._proto import wire_pb2


class Kind(enum.IntEnum):
    """What a message holds; values are those of the wire's MessageKind."""

    PARAMS = wire_pb2.KIND_PARAMS
    DUAL = wire_pb2.KIND_DUAL
    PUSHSUM = wire_pb2.KIND_PUSHSUM
    GRADIENT = wire_pb2.KIND_GRADIENT
    DELTA = wire_pb2.KIND_DELTA


class Encoding(enum.IntEnum):
    RAW = wire_pb2.ENCODING_RAW
    FP16 = wire_pb2.ENCODING_FP16
    BF16 = wire_pb2.ENCODING_BF16
    TOPK = wire_pb2.ENCODING_TOPK

    @classmethod
    def from_name(cls, name: str) -> Encoding:
        return cls[name.upper()]


# The dtypes a stream may carry, by the name the manifest uses.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """What a receiver expects of one tensor: its name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tensor.dtype, tuple(tensor.shape))

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec.of(name, tensor) for name, tensor in tensors.items()]


# Top-k indices travel as int32, so a tensor sent sparse holds fewer than 2**31 entries.
TOPK_MAX_NUMEL = (1 << 31) - 1


@dataclass(frozen=True)
class TopK:
    """A sparse tensor as it travels with ENCODING_TOPK: some entries of a tensor of `shape`, zeros elsewhere.

    `indices` are positions in the C-order flattened tensor, strictly increasing (so in range and without
    repeats); `values` has the tensor's dtype. Senders put a TopK in `Message.tensors` to send exactly these
    entries (AdaComp's selection); a stream encoded with Encoding.TOPK selects the largest magnitudes itself
    (`TopK.select`). `decode(..., sparse=True)` hands TopK values back instead of dense tensors.
    """

    indices: torch.Tensor  # int32 or int64, 1-D
    values: torch.Tensor  # 1-D, as many as indices
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.indices.dim() != 1 or self.values.dim() != 1 or self.indices.numel() != self.values.numel():
            raise ValueError("TopK: indices and values must be 1-D and of the same length")
        if self.indices.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"TopK: indices must be int32 or int64, not {self.indices.dtype}")

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def numel(self) -> int:
        return TensorSpec("", self.dtype, self.shape).numel

    @property
    def count(self) -> int:
        return self.indices.numel()

    @property
    def device(self) -> torch.device:
        return self.values.device

    def dense(self) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=self.dtype, device=self.values.device)
        out[self.indices.to(device=out.device, dtype=torch.int64)] = self.values
        return out.view(self.shape)

    @classmethod
    def select(cls, tensor: torch.Tensor, k: int) -> TopK:
        """The k entries of largest magnitude (ties broken arbitrarily), indices sorted; int32 indices."""
        tensor = tensor.detach()
        flat = tensor.reshape(-1)
        n = flat.numel()
        if n > TOPK_MAX_NUMEL:
            raise ValueError(f"TopK: {n} entries do not fit int32 indices")
        k = max(0, min(int(k), n))
        magnitude = flat.abs()
        if k == 0:
            index = torch.empty(0, dtype=torch.int64, device=flat.device)
        elif 64 * k < n and n >= 1 << 16:
            index = _sampled_topk(magnitude, k)
        else:
            index = torch.topk(magnitude, k, sorted=False).indices
        index = index.sort().values
        return cls(index.to(torch.int32), flat[index], tuple(tensor.shape))

    @classmethod
    def rate(cls, tensor: torch.Tensor, rate: float) -> TopK:
        """AdaComp's rule: k = max(1, floor(n * rate)) entries (none for an empty tensor)."""
        n = tensor.numel()
        return cls.select(tensor, min(n, max(1, int(n * rate))))


def _sampled_topk(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k indices of a large vector: a threshold from a random sample keeps a few times k candidates, and the
    exact top-k runs on those only (several times faster than torch.topk on the whole vector)."""
    n = magnitude.numel()
    samples = min(n, 1 << 16)
    generator = torch.Generator(device=magnitude.device).manual_seed(n ^ k)
    picks = torch.randint(0, n, (samples,), generator=generator, device=magnitude.device)
    # Aim for 2x the expected count above the threshold, so one pass nearly always suffices.
    keep = min(samples, max(1, (2 * k * samples) // n + 32))
    threshold = torch.kthvalue(magnitude[picks], samples - keep + 1).values
    candidates = torch.nonzero(magnitude >= threshold).squeeze(1)
    if candidates.numel() < k:
        return torch.topk(magnitude, k, sorted=False).indices
    return candidates[torch.topk(magnitude[candidates], k, sorted=False).indices]


@dataclass(frozen=True)
class Message:
    """A tensor set with its header. Algorithms produce and consume these; runtimes move them.

    `tensors` keeps insertion order, which is the order on the wire.
    """

    kind: Kind
    sender: int
    receiver: int
    tensors: Mapping[str, torch.Tensor | TopK]
    clock: int = 0
    loss: float = 0.0
    weight: float = 1.0
    model_version: int = 0

    @property
    def payload_bytes(self) -> int:
        """Bytes of the tensors as held (a TopK counts its indices and values)."""
        total = 0
        for t in self.tensors.values():
            if isinstance(t, TopK):
                total += t.indices.numel() * t.indices.element_size() + t.values.numel() * t.values.element_size()
            else:
                total += t.numel() * t.element_size()
        return total


def payload_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the tensors as held."""
    return sum(t.numel() * t.element_size() for t in tensors.values())
