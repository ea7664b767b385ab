"""PDMM-ISVR and ADMM-ISVR: edge-consensus learning with implicit variance reduction (Niwa et al., KDD 2020).

Per edge (i, j) the node keeps the sign A_ij (+1 at the lower rank, so A_ij = -A_ji) and the received dual z_ij
(starts at 0). Each local step is one primal update

    w <- (w / mu - g + eta * sum_j A_ij z_ij) / (1 / mu + eta * E_i),

after which the node publishes y_ij = z_ij - 2 A_ij w for every edge. Only duals travel, one tensor set per
edge. On receipt of y_ji, PDMM overwrites z_ij <- y_ji (Peaceman-Rachford) and ADMM averages
z_ij <- (z_ij + y_ji) / 2 (Douglas-Rachford).

Atomic exchanges. One exchange must swap both duals exactly once; two swaps of one edge with no primal update in
between corrupt the duals. So on every edge only the lower-rank end initiates, at both endpoints' phases (its
own and its peer's), which keeps the rate of the asynchronous model (about two exchanges per K steps, at random
moments) while two exchanges of an edge can never cross. The higher-rank end only answers, from its snapshot.

When y is refreshed. y_ij is recomputed after each primal update and never when z_ij changes, so the published
y_ij is always the pair (z_ij, w) that produced the node's current w, as in the released code. This makes an
exchange one simultaneous swap whatever the timing: the answering end replies from the snapshot it published
before it absorbed the request, so both ends send duals of the same, pre-exchange state. Refreshing y on receipt
would instead make the reply depend on whether the peer served it before or after absorbing the request, and the
late case is a second swap with no primal update in between. It also makes a repeated PDMM delivery harmless
(overwriting with the same y twice is idempotent).

A robust rule is refused (`algorithm.robust`). The node never sees its neighbour's w_j, only y_ji = z_ji + 2 A_ij w_j,
and nothing of its own pulls the edge's dual back: z_ij is set by that neighbour alone. Self-centered clipping in dual
space, y_ji <- z_ij + min(1, tau / ||y_ji - z_ij||) (y_ji - z_ij), lets a liar walk z_ij away by tau at every
exchange (measured, benchmarks/byzantine.py, 16 nodes: a sign-flipping liar took PDMM-ISVR from 77.4 to 46.9, the
plain rule to 41.0). Clipping the primal it implies, w_j = A_ij (y_ji - y_ij,last) / 2 (exact under PDMM, whose
z_ji is the dual y_ij,last this node sent), around the node's own w did no better (8 nodes: 25.8 plain, 30.0
clipped). A dual that could make the state non-finite is refused whatever the job asks: the edge keeps its z.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from pydantic import Field
from torch import nn

from nodeagent.algorithms.base import Algorithm, AlgorithmOptions, Graph, Neighbor, NodeContext, Route, Send, Snapshot
from nodeagent.jobspec import JobSpec
from nodeagent.wire.message import Kind, Message, TensorSpec


def released_eta(lr: float, degree: int, interval: int) -> float:
    """eta = 1 / (mu (E_i (K - 1) + K)): the value of the released code, whose plots are the targets."""
    return 1.0 / (lr * (degree * (interval - 1) + interval))


def eta_of(rule: str, lr: float, degree: int, interval: int) -> float:
    return optimal_eta(lr, degree, interval) if rule == "optimal" else released_eta(lr, degree, interval)


def optimal_eta(lr: float, degree: int, interval: int) -> float:
    """eta = 1 / (mu E_i (K - 1)): the paper's optimum. It is unbounded when K = 1 (an exchange after every step)
    or E_i = 0, and the update has no finite eta that stands for it, so those cases are refused."""
    if degree * (interval - 1) == 0:
        raise ValueError(
            f"algorithm.options.eta: 'optimal' = 1 / (mu * E_i * (K - 1)) is unbounded for interval K={interval} "
            f"and degree E_i={degree}; use interval > 1 on a node with neighbours, or the default 'released' eta"
        )
    return 1.0 / (lr * degree * (interval - 1))


class ECLOptions(AlgorithmOptions):
    eta: Literal["released", "optimal"] = Field(
        "released", description="the dual step eta: released, 1 / (mu (E_i (K - 1) + K)) as in the authors' code; "
        "optimal, 1 / (mu E_i (K - 1)) as in the paper (needs interval >= 2)")


class PDMMISVR(Algorithm):
    """PDMM-ISVR (edge-consensus learning): asynchronous primal-dual updates; neighbours swap per-edge duals on
    random edge phases."""

    name = "pdmm-isvr"
    Options = ECLOptions
    changes_topology = True
    refuses_momentum = "pdmm-isvr and admm-isvr use the plain gradient g; set momentum to 0"
    robust_refusal = ("only duals travel, and an edge's dual is set by that neighbour alone: no clipping around this "
                      "node's state bounds what a lying neighbour does to it (see nodeagent.algorithms.ecl)")
    options: ECLOptions

    def __init__(self, model: nn.Module, context: NodeContext, loss_fn: nn.Module | None = None):
        super().__init__(model, context, loss_fn)
        _check_signs(context)
        self.eta_rule = self.options.eta  # recorded: which eta a run used
        self.eta = eta_of(self.eta_rule, self.spec.lr, len(context.neighbors), self.spec.interval)
        self.z = {n.rank: torch.zeros_like(self.w) for n in context.neighbors}
        self.republish()

    def change_topology(self, context: NodeContext) -> None:
        """The duals of the edges that stay are kept, those of new edges start at zero (as at the start of a job),
        those of dropped edges are forgotten; eta follows the new degree. PDMM's fixed point is the optimum on any
        connected graph, so the job goes on towards the same optimum from its current state."""
        _check_signs(context)
        self.eta = eta_of(self.eta_rule, self.spec.lr, len(context.neighbors), self.spec.interval)
        self.z = {n.rank: self.z[n.rank] if n.rank in self.z else torch.zeros_like(self.w) for n in context.neighbors}
        self._take_context(context)
        self.republish()

    @classmethod
    def check(cls, spec: JobSpec, topology: Graph) -> None:
        options = cls.options_of(spec.algorithm)
        for rank in range(topology.nodes):
            eta_of(options.eta, spec.algorithm.lr, topology.degree(rank), spec.algorithm.interval)

    # -- the mathematics ------------------------------------------------------------------------------------------

    def dual(self, neighbor: Neighbor) -> torch.Tensor:
        """y_ij = z_ij - 2 A_ij w at the current state (a new tensor, never a view of live state)."""
        return self.z[neighbor.rank] - 2 * neighbor.sign * self.w.detach()

    def merge(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The new z_ij from the received y_ji: PDMM overwrites."""
        return y

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss, grad = self.gradient(inputs, targets)
        self.last_loss = loss
        lr, eta = self.spec.lr, self.eta
        with torch.no_grad():
            pull = torch.zeros_like(self.w)
            for neighbor in self.context.neighbors:
                pull.add_(self.z[neighbor.rank], alpha=neighbor.sign)
            numerator = self.w / lr - grad + eta * pull
            self.w.copy_(numerator / (1 / lr + eta * len(self.context.neighbors)))
        self.clock += 1
        self.republish()
        return loss

    def state_dict(self) -> dict[str, torch.Tensor | int | float]:
        # The duals are the algorithm's memory of its neighbours: a resumed node must keep them.
        return {**super().state_dict(), **{f"z/{rank}": z.clone() for rank, z in self.z.items()}}

    def load_state_dict(self, state: Mapping[str, torch.Tensor | int | float]) -> None:
        for rank, z in self.z.items():
            saved = state.get(f"z/{rank}")
            if not isinstance(saved, torch.Tensor) or saved.shape != z.shape:
                raise ValueError(f"the checkpoint holds no dual for the edge to rank {rank}")
            z.copy_(saved)
        super().load_state_dict(state)

    def _publish(self) -> Snapshot:
        served = {(n.rank, Kind.DUAL): self.params.views(self.dual(n)) for n in self.context.neighbors}
        return Snapshot(self.context.rank, self.clock, self.last_loss, served)

    # -- the protocol ---------------------------------------------------------------------------------------------

    def sends(self) -> list[Send]:
        position = (self.clock - 1) % self.spec.interval
        return [
            Send(Route.EXCHANGE, n.rank, Kind.DUAL, self._published.message_for(n.rank, Kind.DUAL))
            for n in self.context.neighbors
            if self.context.rank < n.rank and position in (n.phase, n.peer_phase)
        ]

    def receive(self, message: Message) -> None:
        # A request from a lower-rank peer or the reply to our own request: either way the peer's y_ji.
        peer = message.sender
        if peer not in self.z:
            return  # an exchange of an edge that a topology change dropped
        y = self.params.flatten(message.tensors)
        if self.refused(peer, y):
            return
        self.z[peer] = self.merge(self.z[peer], y)

    def expected(self, peer: int, kind: Kind) -> list[TensorSpec]:
        return self.neighbor_specs(peer, kind, Kind.DUAL)


def _check_signs(context: NodeContext) -> None:
    for neighbor in context.neighbors:
        expected_sign = 1 if context.rank < neighbor.rank else -1
        if neighbor.sign != expected_sign:
            # A_ij = -A_ji holds only if both ends follow the same rule; a wrong sign breaks the
            # consensus constraint without any error, so it is refused here.
            raise ValueError(
                f"edge ({context.rank}, {neighbor.rank}): sign A_ij must be {expected_sign:+d} "
                f"(+1 at the lower rank), got {neighbor.sign}"
            )


class ADMMISVR(PDMMISVR):
    """ADMM-ISVR: PDMM-ISVR whose dual update averages the received dual with its own (Douglas-Rachford)."""

    name = "admm-isvr"

    def merge(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """ADMM averages the received dual into the kept one."""
        return (z + y) / 2
