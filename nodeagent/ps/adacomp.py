"""AdaComp (Chen et al., AAAI 2018): top-k sparse pushes with staleness-scaled application on the server.

The worker side (top-k selection, error feedback, the compact encoding) is nodeagent.wire.sparse.

Server side: `AdaCompServer` keeps, per applied push, the flat indices it touched, in a window of the last
`max_delay` pushes. A push computed on version v has delay = version - v; each sent index has staleness = the
number of the last `delay` pushes that touched it, and w[idx] <- w[idx] - lr * g / max(1, staleness). A push
older than the window is rejected (the worker pulls and recomputes): clamping its delay to the window would
under-count its staleness and apply it with too large a step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from nodeagent.jobspec import RobustSpec
from nodeagent.ps.rules import ParameterServer, ProtocolError, PushResult, StateDict, state_int, state_tensor
from nodeagent.wire.message import all_finite
from nodeagent.wire.sparse import Sparse, check_sizes, flat_indices


@dataclass(frozen=True)
class DeltaPull:
    """A pull since the worker's version: the current values at the flat indices changed since then, or, with
    `indices` None, the full model (the worker's version is older than the window)."""

    version: int
    indices: torch.Tensor | None
    values: torch.Tensor


class AdaCompServer(ParameterServer):
    def __init__(self, w0: torch.Tensor, num_workers: int, tensor_sizes: Sequence[int], lr: float, max_delay: int,
                 *, max_update_norm: float | None = None, robust: RobustSpec | None = None):
        super().__init__(w0, num_workers, max_update_norm=max_update_norm, robust=robust)
        check_sizes(tensor_sizes, self.w.numel())
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
        values, clipped = self.bound(values)  # the sparse update's norm is its values' norm
        values, flagged = self.robust_clip(worker, values)
        staleness = self._staleness(flat, delay)
        self.w.index_add_(0, flat, values / staleness.clamp(min=1).to(values.dtype), alpha=-self.lr)
        self.window.append(flat)
        self.version += 1
        return PushResult(applied=True, version=self.version, release=(worker,), delay=delay, clipped=clipped,
                          flagged=flagged)

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
        if not all_finite(values):
            raise ProtocolError("update has non-finite values")
        return flat_indices(update, self.tensor_sizes), values
