"""Stochastic Gradient Push (SGP) and Overlap SGP (Assran et al., ICML 2019).

State: the push-sum numerator `x` and the push-sum `weight` (starts at 1). The model's parameters (the flat
vector `w` of the base class) hold the de-biased z = x / weight between steps, so the gradient, the L2 term
and evaluation all see z. Step t is x <- x - lr * d(g(z)) followed by gossip round t: with the k
out-peers of iteration t (`context.out_peers(t)`), x and weight are divided by k + 1; the node keeps one share
and pushes one share (the tensors x, the header `weight`) to each out-peer. A received share is added to x and
weight. The mixing is column-stochastic, which is all push-sum needs: z converges to the exact average on any
strongly connected directed (or time-varying) graph, and on regular graphs the weight stays 1.

Rounds. Round t is the one step t sends; its messages carry t as their clock. A node knows only its own
out-peers, so it expects as many shares in round t as it sends (k = len(out_peers(t))). Every node receives
exactly as many as it sends on static undirected graphs (out-peers = neighbours), on directed graphs whose
in-degree equals the out-degree at every node, and on the circulant dynamic kinds (dynamic-exponential,
npeer-exponential). The bipartite kinds do not qualify (their passive ranks receive but never send): they are
AD-PSGD's. Shares are kept by round and sender: a share that comes before this node has sent that round waits
(it is not scaled into this node's own round), a repeated delivery of a retried push overwrites its own entry
and one of an absorbed round is dropped, so no share is ever counted twice. Complete rounds are absorbed oldest
first.

SGP (synchronous, the paper's Algorithm 1): step t + 1 waits until round t is absorbed, so
x_{t+1} = W_t (x_t - lr * d(g(z_t))) and weight_{t+1} = W_t weight_t, W_t the column-stochastic matrix of
round t (own share plus the shares received).

Overlap SGP: the runtimes send a step's messages once its computation is done, so round t travels while step
t + 1 computes, and it is absorbed as soon as it is complete, between two steps: the messages of step t are
absorbed at step t + 1 and the step after the sending one never waits for them. Option `synch_freq` s >= 0
(default 0): a node blocks only once s further steps have passed without round t, i.e. round t must be absorbed
before step t + 2 + s starts. With s = 0 at most one round, the previous step's, is in flight when a step
starts: the reference implementation's bound, where a round is absorbed at the start of the step after the one
that sent it. Unlike that implementation, a node does not skip rounds while one is in flight, so with s > 0 up
to s + 1 rounds may be unabsorbed: every step sends its round, so that the rounds of all nodes stay aligned
with the iterations (a receiver knows which round a share belongs to and how many to expect) and no node waits
at the end of a job for a round that a finished in-peer never sends.

Robust push-sum (`algorithm.robust: {rule: self-centered-clip}`, nodeagent.robust). A share (x_s, y_s) stands for the
sender's de-biased model z_s = x_s / y_s with the mass y_s; push-sum's z is the weighted mean of what a node holds
and the shares it absorbs. So the clipping applies to z_s around the node's own z = x / weight (before the round's
shares are added), and the share is absorbed as (y_s clip(z_s), y_s):
    z' = (x + sum_s y_s clip(z_s)) / (weight + sum_s y_s),   ||z' - z|| <= tau,
a convex combination of values within tau of z, whatever the weights. A weight is taken in [0, n] (the weights of
all nodes sum to n, so no honest share is above it), and a share of weight 0 carries no numerator (a node that joined
has none), so a forged weight buys no more than tau. The price: an absorbed clipped share is not the sent one, so the
total mass sum_i x_i is exact only while no share is clipped (the exact average on which push-sum's proof rests
holds among honest nodes whose shares stay within tau of each other). A share that could make x non-finite is
refused whatever the rule: it counts as received with no mass, (0, 0), so the round completes.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Mapping

import torch
from pydantic import Field
from torch import nn

from nodeagent.algorithms.base import (
    Algorithm,
    AlgorithmOptions,
    Graph,
    NodeContext,
    Route,
    Send,
    Snapshot,
    push_sum_share,
)
from nodeagent.jobspec import AlgorithmSpec, JobSpec, JobSpecError
from nodeagent.robust import clipped_shares
from nodeagent.wire.message import Kind, Message, TensorSpec


class SGP(Algorithm):
    """Stochastic Gradient Push: push-sum averaging on directed, time-varying graphs in synchronous rounds (Assran
    et al., ICML 2019)."""

    name = "sgp"
    modes = ("sync",)
    changes_topology = True
    robust_rules = ("self-centered-clip",)

    def __init__(self, model: nn.Module, context: NodeContext, loss_fn: nn.Module | None = None):
        super().__init__(model, context, loss_fn)
        # How many of the latest rounds may still be unabsorbed when a step starts (0: synchronous).
        self.rounds_in_flight = self._rounds_in_flight()
        self.x = self.w.detach().clone()
        self.weight = 1.0
        # Shares received and not yet absorbed: round -> sender -> (x share, weight share).
        self.shares: dict[int, dict[int, tuple[torch.Tensor, float]]] = defaultdict(dict)
        # Rounds this node has sent and not yet absorbed, oldest first.
        self.open_rounds: deque[int] = deque()
        # The contexts of the rounds that may still be open, as (first round, context), oldest first: a round
        # counts its shares against the out-peers of the topology it was sent in (see change_topology).
        self._contexts: list[tuple[int, NodeContext]] = [(0, context)]
        self._outbox: list[Send] = []
        self.origin = self.w.detach().clone() if self.clipper is not None else None  # the shared initial model
        self.republish()

    @classmethod
    def check(cls, spec: JobSpec, topology: Graph) -> None:
        super().check(spec, topology)
        if topology.passive:
            # Push-sum nodes expect as many shares per round as they send; passive ranks send none.
            raise JobSpecError(f"topology.kind: {cls.name} needs every node to send; {spec.topology.kind} has "
                               "passive nodes (use it with ad-psgd)")

    def _rounds_in_flight(self) -> int:
        return 0

    def contribution_weight(self, context: NodeContext) -> float:
        return push_sum_share(context)

    # -- push-sum ------------------------------------------------------------------------------------------------

    def _split(self, out_degree: int) -> tuple[torch.Tensor, float]:
        """Keep one of out_degree + 1 equal shares of (x, weight); returns a copy of the share each out-peer gets."""
        self.x.div_(out_degree + 1)
        self.weight /= out_degree + 1
        return self.x.clone(), self.weight

    def _absorb(self, x_share: torch.Tensor, weight_share: float) -> None:
        self.x.add_(x_share)
        self.weight += weight_share

    def _absorb_complete_rounds(self) -> bool:
        """Absorb the sent rounds whose shares have all arrived, oldest first; whether any was."""
        absorbed = False
        while self.open_rounds:
            round_ = self.open_rounds[0]
            received = self.shares.get(round_, {})
            if len(received) < len(self._context_of(round_).out_peers(round_)):
                break
            # In sender order, not arrival order: the float sums then do not depend on timing.
            shares = self._clipped(received) if self.clipper is not None else [received[s] for s in sorted(received)]
            for x_share, weight_share in shares:
                self._absorb(x_share, weight_share)
            self.shares.pop(round_, None)
            self.open_rounds.popleft()
            absorbed = True
        return absorbed

    def _clipped(self, received: Mapping[int, tuple[torch.Tensor, float]]) -> list[tuple[torch.Tensor, float]]:
        """What the round adds to (x, weight), its shares' de-biased models clipped around this node's z (the module's
        text)."""
        assert self.clipper is not None and self.origin is not None
        own = self.x / self.weight if self.weight > 0 else self.w.detach()
        return clipped_shares(self.clipper, own, received, self.origin)

    def _context_of(self, round_: int) -> NodeContext:
        """The context round `round_` was sent in."""
        return next(context for first, context in reversed(self._contexts) if first <= round_)

    def change_topology(self, context: NodeContext) -> None:
        """Rounds from the switch step on go to the new out-peers; the rounds before it, still open, are absorbed
        as they were sent, with the shares of the old in-peers (the driver hands them over; their pushes are
        retried until delivered). No share is lost or counted twice, so the total mass, and with it the average,
        is exact across the change."""
        self._take_context(context)
        oldest = self.open_rounds[0] if self.open_rounds else self.clock
        covering = max(i for i, (first, _) in enumerate(self._contexts) if first <= oldest)
        self._contexts = [*self._contexts[covering:], (self.clock, context)]

    def _debias(self) -> None:
        """z = x / weight into the model's parameters, and publish the new state. A node that joined holds no
        weight until its first round is absorbed: its z stays the model it joined with."""
        if self.weight > 0:
            torch.div(self.x, self.weight, out=self.w)
        self.republish()

    def state_dict(self) -> dict[str, torch.Tensor | int | float]:
        # z alone cannot resume push-sum: the numerator and the weight are the state (shares in flight are lost).
        return {**super().state_dict(), "x": self.x.clone(), "weight": self.weight}

    def load_state_dict(self, state: Mapping[str, torch.Tensor | int | float]) -> None:
        x = state["x"]
        if not isinstance(x, torch.Tensor) or x.shape != self.x.shape:
            raise ValueError("the checkpoint's push-sum numerator does not fit this model")
        self.x.copy_(x)
        self.weight = float(state["weight"])
        super().load_state_dict(state)

    def _publish(self) -> Snapshot:
        # Shares are pushed, never pulled; the de-biased model z is served only for a restarted neighbour to rejoin
        # from (rejoin). The snapshot also reports clock, loss and push-sum weight.
        served = {(None, Kind.PARAMS): self.params.views(self.w.detach().clone())}
        return Snapshot(self.context.rank, self.clock, self.last_loss, served, weight=self.weight)

    # -- the interface -------------------------------------------------------------------------------------------

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss, grad = self.gradient(inputs, targets)  # at z, which `w` holds
        self.last_loss = loss
        self.x.sub_(self.descent(grad), alpha=self.spec.lr)
        peers = self.context.out_peers(self.clock)
        x_share, weight_share = self._split(len(peers))
        tensors = self.params.views(x_share)
        self._outbox = [
            Send(
                Route.PUSH, peer, Kind.PUSHSUM,
                Message(Kind.PUSHSUM, self.context.rank, peer, tensors, clock=self.clock, loss=loss,
                        weight=weight_share),
            )
            for peer in peers
        ]
        self.open_rounds.append(self.clock)
        self.clock += 1
        # The in-peers' shares of this round may have come already (a node without out-peers has none to wait for).
        self._absorb_complete_rounds()
        self._debias()
        return loss

    def sends(self) -> list[Send]:
        outbox, self._outbox = self._outbox, []
        return outbox

    def receive(self, message: Message) -> None:
        if message.kind != Kind.PUSHSUM:
            return  # a neighbour's model is only ever pulled, to rejoin, and the driver hands it to rejoin()
        round_ = message.clock
        if round_ < self.clock and round_ not in self.open_rounds:
            return  # a round absorbed already: a repeated delivery of a retried push
        share = self.params.flatten(message.tensors)
        weight = min(max(float(message.weight), 0.0), float(self.context.world_size))  # the whole mass is n
        if self.refused(message.sender, share):
            share, weight = torch.zeros_like(self.x), 0.0  # received, with no mass: the round completes
        self.shares[round_][message.sender] = (share, weight)
        if self._absorb_complete_rounds():
            self._debias()

    def ready(self) -> bool:
        return not self.open_rounds or self.open_rounds[0] >= self.clock - self.rounds_in_flight

    def rounds_ahead(self) -> int:
        """A node runs at most rounds_in_flight + P rounds ahead of each of its in-peers of the last P rounds (P: the
        period of a time-varying schedule, 1 for a static graph): it waits for their shares. A sender reaches this
        node through at most world_size - 1 such links (a rejoined node adds less than one), hence the bound."""
        period = max(1, len(self.context.peer_schedule))
        return self.context.world_size * (self.rounds_in_flight + period)

    def waiting_for(self) -> str:
        round_ = self.open_rounds[0]
        received = sorted(self.shares.get(round_, {}))
        expected = len(self._context_of(round_).out_peers(round_))
        return f"{expected - len(received)} more push-sum shares of round {round_} (from ranks so far: {received})"

    def expected(self, peer: int, kind: Kind) -> list[TensorSpec]:
        if kind == Kind.PARAMS:  # a neighbour's pull to rejoin, or its answer to ours
            return self.neighbor_specs(peer, kind, Kind.PARAMS)
        return self.neighbor_specs(peer, kind, Kind.PUSHSUM)

    def rejoin_kind(self) -> Kind | None:
        return Kind.PARAMS

    def join_kind(self) -> Kind | None:
        return Kind.PARAMS

    def join(self, states: Mapping[int, Message], at_step: int) -> None:
        """A node that joins a running job brings no push-sum mass: numerator 0 and weight 0, so the sum of the
        weights, and with it the average sum(x) / sum(weight) that push-sum converges to, is exactly what it was.
        Its first round is the job's switch step `at_step` (its neighbours' first round in the topology that
        includes it); the gradient of its first step is taken at its neighbours' models z (`neighbors_start`), and from
        the shares of that round on it holds mass and de-biases as every node does."""
        start = self.neighbors_start(states)
        with torch.no_grad():
            if start is not None:
                self.w.copy_(start)
            self.x.zero_()
        self.weight = 0.0
        self.clock = at_step
        self.shares.clear()
        self.open_rounds.clear()
        self._contexts = [(at_step, self.context)]
        self._momentum_buffer = None
        self.republish()

    def rejoin(self, states: Mapping[int, Message]) -> list[Send]:
        """After a restart: the node lost its push-sum mass and the shares in flight to it. It starts again at the
        latest round R of its neighbours (their snapshots' clocks) with their models (`neighbors_start`) as numerator
        and a weight of 1, and sends each out-peer its share of every round from the oldest that out-peer may still wait
        for up to R - 1 (shares it already has are dropped by it); shares to this node of rounds before R are
        dropped. Push-sum's total weight then differs from the number of nodes: z stays an average of the models,
        weighted slightly off uniform until the mixing evens it out."""
        round_ = max(state.clock for state in states.values())
        start = self.neighbors_start(states)
        with torch.no_grad():
            self.x.copy_(self.w if start is None else start)  # every model refused: the checkpoint's estimate
        self.weight = 1.0
        self.clock = round_
        self.shares.clear()
        self.open_rounds.clear()
        self._momentum_buffer = None
        self._debias()
        sends = []
        for t in range(max(0, min(s.clock for s in states.values()) - 1 - self.rounds_in_flight), round_):
            peers = self.context.out_peers(t)
            share = self.params.views((self.x / (len(peers) + 1)).clone())
            for peer in peers:
                if peer in states and t >= states[peer].clock - 1 - self.rounds_in_flight:
                    message = Message(Kind.PUSHSUM, self.context.rank, peer, share, clock=t,
                                      weight=self.weight / (len(peers) + 1))
                    sends.append(Send(Route.PUSH, peer, Kind.PUSHSUM, message))
        return sends


class OverlapSGPOptions(AlgorithmOptions):
    synch_freq: int = Field(0, ge=0, description="steps a node may run ahead of a round before it blocks for it, "
                            "beyond the one overlapped round")


class OverlapSGP(SGP):
    """Overlap SGP: SGP whose rounds overlap the next local steps."""

    name = "osgp"
    modes = ("async",)
    Options = OverlapSGPOptions
    options: OverlapSGPOptions

    @classmethod
    def synchronous(cls, spec: AlgorithmSpec) -> bool:
        return True  # overlapped, but a round still waits for every in-peer's share, synch_freq steps later

    def _rounds_in_flight(self) -> int:
        # The previous step's round is always allowed in flight (the overlap), plus synch_freq more.
        return 1 + self.options.synch_freq
