"""AdaComp (Chen et al., AAAI 2018): compressed asynchronous parameter server.

Worker: per step, the gradient of one minibatch; per tensor only the k = max(1, floor(n * rate)) entries of
largest magnitude travel, as one uint8 tensor "payload" in the compact encoding of nodeagent.wire.sparse (varint
index gaps, values in fp32, fp16 or int8), tagged with the server version it was computed on. With `residual`
the entries not sent (and the quantisation error) are added to the next gradient (error feedback; off by default,
as in the paper).

Server: nodeagent.ps.AdaCompServer: delay = version - v; each index is divided by its staleness, the number of
the last `delay` pushes that touched it (1 when none did); a push older than the window of `max_delay` pushes is
rejected and the worker pulls again. The pull is the full model (the paper) or, with `pull: delta`, the entries
changed since the worker's version, in the same compact encoding with exact fp32 values (the full model when the
worker is older than the window).

Options (algorithm.options): rate (0.01), codec ("fp32", "fp16" or "int8"), residual (false), max_delay (0: 16 per
worker, at least 64), pull ("full" or "delta"), and max_update_norm (unset) as every parameter-server algorithm.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from nodeagent.algorithms.base import NodeContext
from nodeagent.ps.adacomp import AdaCompServer
from nodeagent.ps.messages import ServerModel, ServerPush
from nodeagent.ps.rules import ParameterServer, ProtocolError
from nodeagent.ps.server import ServerHalf, ServerOptions
from nodeagent.ps.worker import PSWorker
from nodeagent.wire.errors import Reason, WireError
from nodeagent.wire.message import Kind, TensorSpec
from nodeagent.wire.sparse import Codec, Residual, Sparse, compress, decode_sparse, encode_sparse

PAYLOAD = "payload"
CODECS = {"fp32": Codec.FP32, "fp16": Codec.FP16, "int8": Codec.INT8}


def max_payload_bytes(tensor_sizes: list[int]) -> int:
    """An upper bound of any valid encoding of a model with these tensors (9-byte varints, 4-byte values)."""
    return 10 + sum(13 + 13 * n for n in tensor_sizes)


def payload_spec(shapes: list[tuple[str, tuple[int, ...]]], tensor_sizes: list[int]) -> list[TensorSpec]:
    """The one uint8 tensor of a compact-encoded stream, of the length its manifest announces (bounded)."""
    if len(shapes) != 1 or shapes[0][0] != PAYLOAD or len(shapes[0][1]) != 1:
        raise WireError(Reason.BAD_MANIFEST, f"expected one 1-D tensor {PAYLOAD!r}, got {[name for name, _ in shapes]}")
    length = shapes[0][1][0]
    if not 1 <= length <= max_payload_bytes(tensor_sizes):
        raise WireError(Reason.TOO_LARGE, f"a payload of {length} bytes cannot be a valid encoding of this model")
    return [TensorSpec(PAYLOAD, torch.uint8, (length,))]


def payload_tensor(payload: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def split_flat(indices: torch.Tensor, values: torch.Tensor, tensor_sizes: list[int]) -> Sparse:
    """Sorted flat indices of the whole vector as per-tensor (indices, values)."""
    bounds = torch.tensor([0, *torch.tensor(tensor_sizes).cumsum(0).tolist()], dtype=torch.int64)
    cuts = torch.searchsorted(indices, bounds).tolist()
    return [
        (indices[cuts[t] : cuts[t + 1]] - bounds[t], values[cuts[t] : cuts[t + 1]].to(torch.float32))
        for t in range(len(tensor_sizes))
    ]


class AdaCompOptions(ServerOptions):
    rate: float = Field(0.01, gt=0, le=1, description="the share of each tensor's entries sent")
    codec: Literal["fp32", "fp16", "int8"] = Field("fp32", description="how the values travel")
    residual: bool = Field(False, description="error feedback: entries not sent are added to the next gradient")
    max_delay: int = Field(0, ge=0, description="the staleness window in pushes; 0: 16 per worker, at least 64")
    pull: Literal["full", "delta"] = Field(
        "full", description="the model back in full, or only the entries changed since the worker's last pull")


class AdaCompServerHalf(ServerHalf):
    options: AdaCompOptions

    def build_rule(self, w0: torch.Tensor) -> ParameterServer:
        max_delay = self.options.max_delay or max(64, 16 * self.num_workers)
        return AdaCompServer(w0, self.num_workers, self.params.sizes, self.spec.algorithm.lr, max_delay,
                             max_update_norm=self.update_bound(self.spec.algorithm.lr),
                             robust=self.spec.algorithm.robust)

    def push_specs(self, kind: Kind, shapes: list[tuple[str, tuple[int, ...]]]) -> list[TensorSpec]:
        if kind != Kind.GRADIENT:
            raise WireError(Reason.UNEXPECTED_KIND, f"adacomp pushes gradient, not {kind.name.lower()}")
        return payload_spec(shapes, self.params.sizes)

    def decode(self, push: ServerPush) -> Sparse:
        payload = push.tensors.get(PAYLOAD)
        if payload is None or payload.dtype != torch.uint8 or payload.dim() != 1:
            raise ProtocolError(f"an adacomp push is one uint8 tensor {PAYLOAD!r}")
        try:
            return decode_sparse(payload.numpy().tobytes(), self.params.sizes)
        except ValueError as error:
            raise ProtocolError(f"bad adacomp payload: {error}") from None

    def pull(self, rank: int, since_version: int, delta: bool, now: float) -> ServerModel:
        if not delta:
            return super().pull(rank, since_version, delta, now)
        self.check_rank(rank)
        assert isinstance(self.rule, AdaCompServer)
        answer = self.rule.pull_delta(rank, since_version)
        if answer.indices is None:
            return ServerModel(Kind.PARAMS, self.params.views(answer.values), answer.version)
        sparse = split_flat(answer.indices, answer.values, self.params.sizes)
        payload = encode_sparse(sparse, self.params.sizes, Codec.FP32)
        return ServerModel(Kind.DELTA, {PAYLOAD: payload_tensor(payload)}, answer.version)


class AdaComp(PSWorker):
    """Asynchronous parameter server fed with compressed top-k gradients and a staleness-aware step (AdaComp)."""

    name = "adacomp"
    server_half = AdaCompServerHalf
    Options = AdaCompOptions
    options: AdaCompOptions

    def __init__(self, model: nn.Module, context: NodeContext, loss_fn: nn.Module | None = None):
        super().__init__(model, context, loss_fn)
        self.rate = self.options.rate
        self.codec = CODECS[self.options.codec]
        self.residual = Residual(self.params.numel, self.w.device) if self.options.residual else None
        self.pull_delta = self.options.pull == "delta"
        self.last_payload_bytes = 0

    def update_tensors(self, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        payload, _ = compress(grad, self.params.sizes, self.rate, self.codec, self.residual)
        self.last_payload_bytes = len(payload)
        return {PAYLOAD: payload_tensor(payload)}

    def server_specs(self, kind: Kind, shapes: list[tuple[str, tuple[int, ...]]]) -> list[TensorSpec]:
        if kind == Kind.DELTA and self.pull_delta:
            return payload_spec(shapes, self.params.sizes)
        return super().server_specs(kind, shapes)

    def check_server_message(self, model: ServerModel) -> None:
        if model.kind == Kind.DELTA:
            try:
                decode_sparse(model.tensors[PAYLOAD].numpy().tobytes(), self.params.sizes)
            except ValueError as error:
                raise WireError(Reason.BAD_PAYLOAD, f"delta from the server: {error}") from None

    def apply_model(self, model: ServerModel) -> None:
        if model.kind != Kind.DELTA:
            super().apply_model(model)
            return
        sparse = decode_sparse(model.tensors[PAYLOAD].numpy().tobytes(), self.params.sizes)
        offset = 0
        for (indices, values), n in zip(sparse, self.params.sizes, strict=True):
            self.w[(offset + indices).to(self.w.device)] = values.to(self.w.device, self.w.dtype)
            offset += n
