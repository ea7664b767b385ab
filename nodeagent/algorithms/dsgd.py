"""DSGD (D-PSGD): local SGD steps mixed with the neighbours' parameters (Lian et al., NeurIPS 2017).

Asynchronous mode: an edge is exchanged (a symmetric swap of parameters) when the step counter meets the
edge's phase, and every step mixes with the last copy received from each neighbour, however stale. Before a
neighbour's first copy arrives, its copy is the shared seeded initial model.

Synchronous mode (D-PSGD of Lian et al.): at step t every node pushes its x_t to every neighbour and waits for
theirs; then x_{t+1} = self_weight * x_t + sum_j weight_j * x_j,t - lr * d(g(x_t)). Pushes never block a
sender, so no bipartite ordering is needed to avoid deadlock; copies are keyed by step, so a fast neighbour's
next-step copy can arrive early without harm.

Robust mixing (`algorithm.robust: {rule: self-centered-clip}`, nodeagent.robust): every neighbour's copy is clipped
around the node's own x before it is mixed, x_j <- x + min(1, tau / ||x_j - x||) (x_j - x), so a neighbour moves the
node by at most weight_j * tau per mix: in synchronous rounds around x_t; asynchronously once, at the first mix
after it arrived, around the x it is mixed into (the clipped copy is then mixed as it is until the next one replaces
it; the copies that arrived since the last mix are judged together, and a copy replaced before any mix is not judged
at all). A copy that could make x non-finite is refused whatever the rule: the asynchronous node keeps the
neighbour's previous copy, the synchronous one mixes its own x_t in its place (the round still completes).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch
from torch import nn

from nodeagent.algorithms.base import Algorithm, NodeContext, Route, Send, Snapshot
from nodeagent.robust import MixingWeights, mix_clipped, unsafe
from nodeagent.wire.message import Kind, Message, TensorSpec

# Synchronous mode: a neighbour runs at most one round ahead of this node (it completes a round only with this
# node's copy of it); one that rejoined after a restart starts at the latest round of its own neighbours, which may
# be two ahead of this node.
SYNC_ROUNDS_AHEAD = 2


class DSGD(Algorithm):
    """D-PSGD: local SGD steps mixed with the neighbours' parameters, asynchronously on edge phases or in
    synchronous rounds."""

    name = "dsgd"
    modes = ("async", "sync")
    changes_topology = True
    robust_rules = ("self-centered-clip",)

    def __init__(self, model: nn.Module, context: NodeContext, loss_fn: nn.Module | None = None):
        super().__init__(model, context, loss_fn)
        self.synchronous = self.mode == "sync"
        # Until a neighbour's first message, its copy is this node's parameters: one tensor for all of them, since
        # copies are replaced, never changed in place.
        self.last_copy = dict.fromkeys(context.neighbor_ranks, self.w.detach().clone())
        self.round_copies: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)
        self._pending_direction: torch.Tensor | None = None
        self._outbox: list[Send] = []
        self.origin = self.w.detach().clone() if self.clipper is not None else None  # the shared initial model
        self.unjudged: set[int] = set()  # asynchronous robust mixing: neighbours whose last copy is not clipped yet
        self._mixing: MixingWeights | None = None  # robust mixing: the context's weights (built at the first mix)
        self.republish()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss, grad = self.gradient(inputs, targets)
        self.last_loss = loss
        if self.synchronous:
            # x_t is pushed to every neighbour; the update completes once every neighbour's x_t has arrived,
            # which may be at once when their copies came early.
            self._outbox = [
                Send(Route.PUSH, n.rank, Kind.PARAMS, self._published.message_for(n.rank, Kind.PARAMS))
                for n in self.context.neighbors
            ]
            self._pending_direction = self.descent(grad).clone()
            self._complete_round()
            return loss
        with torch.no_grad():
            self.w.sub_(self.descent(grad), alpha=self.spec.lr)
            self._mix(self.last_copy)
        self.clock += 1
        self.republish()
        return loss

    def _mix(self, copies: dict[int, torch.Tensor]) -> None:
        if not self.context.neighbors:
            return
        if self.clipper is not None and (self.synchronous or self.unjudged):
            # The round's copies (synchronous), or those that arrived since the last mix, clipped around x.
            assert self.origin is not None
            if self._mixing is None:
                self._mixing = MixingWeights.of([(n.rank, n.weight) for n in self.context.neighbors],
                                                self.context.self_weight, self.w)
            judged = copies.keys() if self.synchronous else self.unjudged
            clipped = mix_clipped(self.clipper, self.w, copies, self._mixing, judged, self.origin)
            if not self.synchronous:
                copies.update(clipped)  # mixed as clipped until the neighbour's next copy
                self.unjudged.clear()
            return
        # In place: the same operations in the same order as into a new tensor, without allocating one per step.
        self.w.mul_(self.context.self_weight)
        for neighbor in self.context.neighbors:
            self.w.add_(copies[neighbor.rank], alpha=neighbor.weight)

    def _complete_round(self) -> None:
        copies = self.round_copies.get(self.clock, {})
        if self._pending_direction is None or len(copies) < len(self.context.neighbors):
            return
        with torch.no_grad():
            self._mix(copies)
            self.w.sub_(self._pending_direction, alpha=self.spec.lr)
        self.round_copies.pop(self.clock, None)  # none kept for a node without neighbours (a quarantined one)
        self._pending_direction = None
        self.clock += 1
        self.republish()

    def _publish(self) -> Snapshot:
        tensors = self.params.views(self.w.detach().clone())
        return Snapshot(self.context.rank, self.clock, self.last_loss, {(None, Kind.PARAMS): tensors})

    def change_topology(self, context: NodeContext) -> None:
        """A new neighbour's copy starts as this node's own parameters (mixing it changes nothing until its first
        exchange); a dropped neighbour's copy is forgotten. Synchronous rounds from the switch on wait for the new
        neighbours: rounds before it are complete (the switch comes between two steps)."""
        ranks = set(context.neighbor_ranks)
        own = self.w.detach().clone()
        self.last_copy = {rank: self.last_copy.get(rank, own) for rank in ranks}
        for copies in self.round_copies.values():
            for rank in set(copies) - ranks:
                del copies[rank]
        self._take_context(context)
        self._mixing = None

    def sends(self) -> list[Send]:
        if self.synchronous:
            outbox, self._outbox = self._outbox, []
            return outbox
        return [
            Send(Route.EXCHANGE, n.rank, Kind.PARAMS, self._published.message_for(n.rank, Kind.PARAMS))
            for n in self.due_neighbors()
        ]

    def receive(self, message: Message) -> None:
        if message.sender not in self.last_copy:
            return  # a neighbour that a topology change dropped: the rounds it took part in are complete
        copy = self.params.flatten(message.tensors)
        if self.refused(message.sender, copy):
            if not self.synchronous:
                return
            copy = self.w.detach().clone()  # x_t in its place: the round completes without it
        elif self.clipper is not None and not self.synchronous:
            self.unjudged.add(message.sender)  # clipped at the next mix (the module's text)
        self.last_copy[message.sender] = copy  # asynchronous: what is mixed; synchronous: for consensus_distance()
        if not self.synchronous:
            return
        if message.clock < self.clock:
            return  # a step this node has completed already (a duplicate delivery)
        self.round_copies[message.clock][message.sender] = copy
        self._complete_round()

    def ready(self) -> bool:
        return self._pending_direction is None

    def rounds_ahead(self) -> int | None:
        return SYNC_ROUNDS_AHEAD if self.synchronous else None  # asynchronous: one last copy per neighbour

    def rejoin_kind(self) -> Kind | None:
        return Kind.PARAMS if self.synchronous else None

    def join_kind(self) -> Kind | None:
        return Kind.PARAMS

    def join(self, states: Mapping[int, Message], at_step: int) -> None:
        """A node that joins a running job starts from its neighbours' models (`neighbors_start`: their mean, their
        median under a robust rule), which are its first copies of them (a refused one: its own state);
        asynchronous at the latest of their clocks, synchronous at the switch step `at_step`, the first round its
        neighbours wait for its part of."""
        super().join(states, at_step)
        own = self.w.detach().clone()
        self.last_copy = {n.rank: own for n in self.context.neighbors}
        for rank, state in states.items():
            copy = self.params.flatten(state.tensors)
            if rank in self.last_copy and not unsafe(copy):  # refused and counted by neighbors_start
                self.last_copy[rank] = copy
                if self.clipper is not None and not self.synchronous:
                    self.unjudged.add(rank)  # judged at the first mix, as a copy that arrived
        if self.synchronous:
            self.clock = at_step
            self.round_copies = defaultdict(dict)
            self._pending_direction = None
            self.republish()

    def rejoin(self, states: Mapping[int, Message]) -> list[Send]:
        """Synchronous mode after a restart: the neighbours wait at their rounds (their snapshot's clock holds
        each one's x_t of it) for this node's x_t. It starts again at the latest of their rounds R from their
        models (`neighbors_start`), sends each neighbour still at an earlier round this x for every round up to R
        (its part of those rounds; its own copies of them were lost), and keeps the copies of round R it pulled;
        the rest of round R's copies come as the neighbours complete their rounds. What the node had learned since
        its checkpoint is lost."""
        round_ = max(state.clock for state in states.values())
        start = self.neighbors_start(states)
        with torch.no_grad():
            if start is not None:  # else every model was refused: the checkpoint's
                self.w.copy_(start)
        own = self.w.detach().clone()
        copies = {rank: self.params.flatten(state.tensors) for rank, state in states.items()}
        copies = {rank: own if unsafe(copy) else copy for rank, copy in copies.items()}  # x_t in a refused one's place
        self.clock = round_
        self._pending_direction = None
        self._momentum_buffer = None
        self.round_copies = defaultdict(dict, {round_: {r: c for r, c in copies.items() if states[r].clock == round_}})
        self.republish()
        tensors = self._published.served[(None, Kind.PARAMS)]
        return [
            Send(Route.PUSH, rank, Kind.PARAMS, Message(Kind.PARAMS, self.context.rank, rank, tensors, clock=t))
            for rank, state in states.items() for t in range(state.clock, round_)
        ]

    def consensus_distance(self, peer: int) -> float | None:
        copy = self.last_copy.get(peer)
        return None if copy is None else float(torch.linalg.vector_norm(self.w - copy))

    def waiting_for(self) -> str:
        copies = self.round_copies.get(self.clock, {})
        missing = [n.rank for n in self.context.neighbors if n.rank not in copies]
        return f"the step-{self.clock} parameters of ranks {missing}"

    def expected(self, peer: int, kind: Kind) -> list[TensorSpec]:
        return self.neighbor_specs(peer, kind, Kind.PARAMS)
