"""AD-PSGD: asynchronous bilateral gossip (Lian et al., ICML 2018).

Training never waits for gossip. Each step is plain SGD (optional momentum) on the node's model. Active nodes
(odd ranks) initiate exchanges; passive nodes (even ranks) only answer, so two nodes never start an exchange
with each other and no exchange can wait on another. An active node starts an exchange after a step when none
of its own is in flight: it sends its model to the next peer of its rotation and keeps training; the runtime
delivers the request to the peer, which answers with its latest published model.

Both ends then hold the average of the two exchanged models:
- the passive node, on receiving the request: w_j <- (w_j + w_i) / 2. Its reply was its model as published at
  the end of its last step (or averaging), which differs from the current w_j only when one of its steps fell
  between serving and receiving the request;
- the active node, on receiving the reply: w_i <- (w_i,sent + w_j) / 2 + (w_i - w_i,sent). The steps it took
  while the exchange was in flight computed their gradients on a model that has been averaged meanwhile, and
  they are applied to the averaged model: that staleness is the algorithm. With no step in between, both ends
  hold exactly (w_i + w_j) / 2.

Rotation: the peers of the active node's schedule (`context.peer_schedule`, one period flattened, so a
time-varying graph such as bipartite-exponential is followed in its order) or, on a static topology, its
neighbours; only passive (even) peers, so that two active nodes never exchange crosswise. Exchange n goes to
entry n mod len of the rotation: a step that starts none (one is in flight) skips no peer. A failed exchange is
dropped, and the next step starts one with the next peer.

Robust mixing (`algorithm.robust: {rule: self-centered-clip}`, nodeagent.robust): the peer's model is clipped around
the model it is averaged with (the passive node's w, the active node's w_i,sent) before the average, so one exchange
moves a node by at most tau / 2. A model that could make w non-finite is refused whatever the rule: that exchange
changes nothing here.
"""

from __future__ import annotations

import torch
from torch import nn

from nodeagent.algorithms.base import Algorithm, NodeContext, Route, Send, Snapshot
from nodeagent.wire.message import Kind, Message, TensorSpec


class ADPSGD(Algorithm):
    """Asynchronous bilateral averaging with active and passive nodes (AD-PSGD, Lian et al., ICML 2018)."""

    name = "ad-psgd"
    robust_rules = ("self-centered-clip",)

    def __init__(self, model: nn.Module, context: NodeContext, loss_fn: nn.Module | None = None):
        super().__init__(model, context, loss_fn)
        self.active = context.rank % 2 == 1
        schedule = context.peer_schedule or (context.neighbor_ranks,)
        self.rotation: tuple[int, ...] = (
            tuple(peer for peers in schedule for peer in peers if peer % 2 == 0) if self.active else ()
        )
        self.exchanges_started = 0
        self.partner: int | None = None  # the peer of the exchange in flight
        self._sent: torch.Tensor | None = None  # the model that exchange sent
        self._outbox: list[Send] = []
        self.origin = self.w.detach().clone() if self.clipper is not None else None  # the shared initial model
        self.republish()

    def contribution_weight(self, context: NodeContext) -> float:
        return 0.5  # a bilateral average

    def _publish(self) -> Snapshot:
        # The served copy; the active node's request is this snapshot too, and `_sent` keeps it.
        self._published_w = self.w.detach().clone()
        tensors = self.params.views(self._published_w)
        return Snapshot(self.context.rank, self.clock, self.last_loss, {(None, Kind.PARAMS): tensors})

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss, grad = self.gradient(inputs, targets)
        self.last_loss = loss
        self.w.sub_(self.descent(grad), alpha=self.spec.lr)
        self.clock += 1
        self.republish()
        if self.partner is None and self.rotation:
            self.partner = self.rotation[self.exchanges_started % len(self.rotation)]
            self.exchanges_started += 1
            self._sent = self._published_w  # published snapshots are never written to
            request = self._published.message_for(self.partner, Kind.PARAMS)
            self._outbox = [Send(Route.EXCHANGE, self.partner, Kind.PARAMS, request)]
        return loss

    def sends(self) -> list[Send]:
        outbox, self._outbox = self._outbox, []
        return outbox

    def receive(self, message: Message) -> None:
        received = self.params.flatten(message.tensors)
        answer = self._sent is not None and message.sender == self.partner
        if self.refused(message.sender, received):
            if answer:
                self.partner = None
                self._sent = None
            return
        if self.clipper is not None:
            assert self.origin is not None
            center = self._sent if answer and self._sent is not None else self.w
            received = self.clipper.clip(center, message.sender, received, self.origin)
        if answer and self._sent is not None:
            progress = self.w - self._sent  # the local steps taken while the exchange was in flight
            self.w.copy_((self._sent + received) / 2 + progress)
            self.partner = None
            self._sent = None
        else:
            self.w.add_(received).div_(2)
        self.republish()

    def failed(self, send: Send, reason: str) -> None:
        if send.peer == self.partner:
            self.partner = None
            self._sent = None

    def expected(self, peer: int, kind: Kind) -> list[TensorSpec]:
        return self.neighbor_specs(peer, kind, Kind.PARAMS)
