"""DSGD (D-PSGD): local SGD steps mixed with the neighbours' parameters (ALGORITHMS.md, "DSGD").

Asynchronous mode: an edge is exchanged (a symmetric swap of parameters) when the step counter meets the edge's
phase, and every step mixes with the last copy received from each neighbour, however stale. Before a
neighbour's first copy arrives, its copy is the shared seeded initial model.
"""

from __future__ import annotations

import torch
from torch import nn

from nodeagent.algorithms.base import Algorithm, NodeContext, Route, Send, Snapshot
from nodeagent.wire.codec import WireError
from nodeagent.wire.message import Kind, Message, TensorSpec


class DSGD(Algorithm):
    name = "dsgd"

    def __init__(self, model: nn.Module, context: NodeContext, loss_fn: nn.Module | None = None):
        super().__init__(model, context, loss_fn)
        if context.spec.mode != "async":
            raise ValueError("dsgd: only mode 'async' is available in this version")
        self.last_copy = {n.rank: self.w.detach().clone() for n in context.neighbors}
        self._published = self._publish()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss, grad = self.gradient(inputs, targets)
        with torch.no_grad():
            self.w.sub_(self.sgd_direction(grad), alpha=self.spec.lr)
            self._mix()
        self.clock += 1
        self.last_loss = loss
        self._published = self._publish()
        return loss

    def _mix(self) -> None:
        if not self.context.neighbors:
            return
        mixed = self.w * self.context.self_weight
        for neighbor in self.context.neighbors:
            mixed.add_(self.last_copy[neighbor.rank], alpha=neighbor.weight)
        self.w.copy_(mixed)

    def _publish(self) -> Snapshot:
        tensors = self.params.views(self.w.detach().clone())
        return Snapshot(self.context.rank, self.clock, self.last_loss, {(None, Kind.PARAMS): tensors})

    def sends(self) -> list[Send]:
        out = []
        for neighbor in self.due_neighbors():
            message = self._published.message_for(neighbor.rank, Kind.PARAMS)
            out.append(Send(Route.EXCHANGE, neighbor.rank, Kind.PARAMS, message))
        return out

    def receive(self, message: Message) -> None:
        self.last_copy[message.sender] = self.params.flatten(message.tensors)

    def snapshot(self) -> Snapshot:
        return self._published

    def expected(self, peer: int, kind: Kind) -> list[TensorSpec]:
        self.reject_unless_neighbor(peer)
        if kind != Kind.PARAMS:
            raise WireError("unexpected_kind", f"dsgd accepts only params, not {kind.name.lower()}")
        return self.params.specs
