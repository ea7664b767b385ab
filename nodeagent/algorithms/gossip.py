"""Pairwise gossip averaging, the Dpwa family.

Pull only: a node fetches the latest published parameters of one neighbour and interpolates towards them,
w <- f * w_peer + (1 - f) * w; the peer is not changed by it. The peer is chosen by score (flow control):
the largest score + a uniform random integer in [10, 1000].

How Dpwa's loop "start a fetch, train the batch, wait for the fetch and mix" maps onto the interface, whose
runtimes call `sends()` right after each `step()` and transmit those sends once the step's compute is done:
- The fetch for batch t + 1 is planned at the end of step t (whose `sends()` returns it), so it travels while
  batch t + 1 is computed: fetch and computation overlap, which is the point of Dpwa. The first batch has no
  fetch; every node starts from the same seeded model, so there is nothing to pull yet.
- The fetch is mixed as soon as both its batch is trained and its reply is here: at the end of that `step()`
  when the reply came early, otherwise in `receive()`. Either way the mix falls between the same two local
  steps, so the parameters do not depend on when a reply arrives, only on what it holds: the simulator's
  timing stays deterministic, and so does the agent's arithmetic. Mixing at once (rather than at the start of
  the next step) means the model that is evaluated, checkpointed and served between steps, and the final one,
  is the mixed one, as after Dpwa's `update_wait`.
- `ready()` is False while a fetch whose batch is trained is still unanswered: the next step waits for it.
- So the fetch for batch t + 2 is planned while the one for batch t + 1 may still be unanswered: at most two
  fetches are outstanding, possibly to the same peer. A reply resolves the oldest outstanding fetch to its
  sender (both are snapshots of that peer, so the pairing cannot matter).

Failures: a refused or timed-out fetch costs the peer 100 points and is given up for its batch (the step does
not wait for a second attempt). The runtime only takes sends after a step, so the retry is the next fetch: it
is made whatever the fetch_probability draw says, and goes to the best-scoring other peer. A peer is never
dropped: its score stops at 10 and it stays a candidate, picked again once the others' scores fall within reach
of the random term (at the floor it can at best tie a peer at 1000: 10 + 1000 = 1000 + 10), and each success
adds 10 back.

Robust mixing (`algorithm.robust: {rule: self-centered-clip}`, nodeagent.robust): the fetched parameters are clipped
around w before the interpolation, so one fetch moves the node by at most f * tau; a reply that could make w
non-finite is refused whatever the rule (nothing is mixed for that fetch). The peer's clock and loss, which set f,
are bounded by f's own range [0, 1].

Clocks: `self.clock` stays the integer step counter the runtimes use. The clock of the interpolation rules,
`gossip_clock`, counts local steps and is mixed like the parameters (clock <- f * clock_peer + (1 - f) *
clock); it is what the snapshots serve in their clock header, rounded to the wire's integer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from torch import nn

from nodeagent.algorithms.base import Algorithm, AlgorithmOptions, NodeContext, Route, Send, Snapshot
from nodeagent.runtime.progress import IN_FLIGHT
from nodeagent.wire.message import Kind, Message, TensorSpec

# Flow control: the score range, the start, the random term and the rewards.
SCORE_MIN = 10
SCORE_MAX = 1000
SCORE_START = 1000
BONUS_MIN = 10
BONUS_MAX = 1000  # inclusive
SUCCESS_REWARD = 10
FAILURE_PENALTY = 100
RECOVERY_PER_DRAW = 1  # points a peer gains each time another is picked (see PeerScores.pick)



class GossipOptions(AlgorithmOptions):
    """`algorithm.options` of the gossip algorithm."""

    interpolation: Literal["constant", "clock", "loss"] = Field(
        "constant", description="the peer's weight f: constant (factor), by the clocks (c_peer / (c + c_peer)) or "
        "by the losses (l / (l + l_peer))")
    factor: float = Field(0.5, ge=0, le=1, description="f of the constant interpolation")
    divergence_threshold: float = Field(0.0, ge=0, description="d: when the loss is below d, f <- f * loss / d; "
                                        "0: off")
    fetch_probability: float = Field(1.0, ge=0, le=1, description="probability of a fetch before each batch")


def _share(part: float, other: float) -> float:
    """part / (part + other), the form of both the clock and the loss rule. Where it is undefined (both are 0,
    as for two fresh clocks or two perfect losses, or a NaN loss: a peer that has not trained yet serves NaN)
    it is 0.5, the value it takes when the two sides are equal. Losses are taken to be non-negative (like
    cross-entropy), so the share is in [0, 1]."""
    total = part + other
    share = part / total if total != 0 else math.nan
    return 0.5 if math.isnan(share) else share


def peer_weight(options: GossipOptions, clock: float, peer_clock: float, loss: float, peer_loss: float) -> float:
    """f, the peer's weight in w <- f * w_peer + (1 - f) * w."""
    if options.interpolation == "clock":
        factor = _share(peer_clock, clock)
    elif options.interpolation == "loss":
        factor = _share(loss, peer_loss)  # the node with the higher loss takes more from its peer
    else:
        factor = options.factor
    threshold = options.divergence_threshold
    if threshold > 0 and loss < threshold:
        factor *= loss / threshold
    return factor


class PeerScores:
    """The score of each neighbour, in [SCORE_MIN, SCORE_MAX], and the choice of the peer to fetch from."""

    def __init__(self, peers: Sequence[int]):
        self.scores = dict.fromkeys(peers, SCORE_START)

    def pick(self, bonus: Sequence[int], exclude: int | None = None) -> int:
        """The peer with the largest score + bonus (one bonus per peer, in the order of the peers); ties go to
        the earlier peer. `exclude` is left out unless it is the only peer."""
        candidates = [(peer, extra) for peer, extra in zip(self.scores, bonus, strict=True) if peer != exclude]
        if not candidates:
            candidates = list(zip(self.scores, bonus, strict=True))
        chosen = max(candidates, key=lambda candidate: self.scores[candidate[0]] + candidate[1])[0]
        # Deviation from the plain rule: with only +10 / -100, a peer at the floor can at best tie a healthy one
        # (10 + 1000 = 1000 + 10) and is never picked again while the others stay healthy. Every peer passed
        # over gains a point, so a peer that came back climbs into reach within a few hundred draws.
        for peer in self.scores:
            if peer != chosen:
                self.scores[peer] = min(SCORE_MAX, self.scores[peer] + RECOVERY_PER_DRAW)
        return chosen

    def succeeded(self, peer: int) -> None:
        self.scores[peer] = min(SCORE_MAX, self.scores[peer] + SUCCESS_REWARD)

    def failed(self, peer: int) -> None:
        self.scores[peer] = max(SCORE_MIN, self.scores[peer] - FAILURE_PENALTY)


@dataclass(eq=False)
class _Fetch:
    """An outstanding pull: mixed once the step count reaches `due` (its batch is trained) and it is answered."""

    peer: int
    due: int
    reply: Message | None = None


class PairwiseGossip(Algorithm):
    """Pairwise gossip averaging (Dpwa): pull one neighbour's parameters and interpolate towards them."""

    name = "gossip"
    Options = GossipOptions
    changes_topology = True
    robust_rules = ("self-centered-clip",)
    options: GossipOptions

    def __init__(self, model: nn.Module, context: NodeContext, loss_fn: nn.Module | None = None):
        super().__init__(model, context, loss_fn)
        self.scores = PeerScores(context.neighbor_ranks)
        self.gossip_clock = 0.0
        # One generator per node, so that peer choices and fetch decisions replay for a given job seed.
        self._rng = np.random.default_rng([context.seed, context.rank])
        self._fetches: list[_Fetch] = []
        self._retry_excluding: int | None = None  # the peer whose fetch failed; the next fetch avoids it
        self._outbox: list[Send] = []
        self.origin = self.w.detach().clone() if self.clipper is not None else None  # the shared initial model
        self.republish()

    def contribution_weight(self, context: NodeContext) -> float:
        return 0.5  # a pairwise average (the default factor, and what the clock and loss rules give equal peers)

    # -- the interface -----------------------------------------------------------------------------------------

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss, grad = self.gradient(inputs, targets)
        self.last_loss = loss
        with torch.no_grad():
            self.w.sub_(self.descent(grad), alpha=self.spec.lr)
        self.clock += 1
        self.gossip_clock += 1
        self._mix_due()
        self._outbox = self._plan_fetch()
        self.republish()
        return loss

    def sends(self) -> list[Send]:
        outbox, self._outbox = self._outbox, []
        return outbox

    def receive(self, message: Message) -> None:
        fetch = self._outstanding(message.sender)
        if fetch is None:
            return  # a reply whose fetch was given up already, or a duplicate delivery
        self.scores.succeeded(message.sender)
        fetch.reply = message
        if self._mix_due():
            self.republish()

    def failed(self, send: Send, reason: str) -> None:
        fetch = self._outstanding(send.peer)
        if send.route != Route.PULL or fetch is None:
            return
        self._fetches.remove(fetch)
        if reason != IN_FLIGHT:  # no call was made: it costs the peer no score
            self.scores.failed(send.peer)
        self._retry_excluding = send.peer

    def ready(self) -> bool:
        # Answered fetches are mixed as soon as they are due, so a due fetch still listed is unanswered.
        return all(fetch.due > self.clock for fetch in self._fetches)

    def waiting_for(self) -> str:
        return f"the parameters of rank {self._fetches[0].peer}, fetched for step {self._fetches[0].due}"

    def expected(self, peer: int, kind: Kind) -> list[TensorSpec]:
        return self.neighbor_specs(peer, kind, Kind.PARAMS)

    # -- the protocol ------------------------------------------------------------------------------------------

    def _plan_fetch(self) -> list[Send]:
        """The fetch for the next batch, if any."""
        if not self.context.neighbors:
            return []
        # Both draws are made every step, fetch or not, so the random stream does not depend on the outcomes.
        draw = float(self._rng.random())
        bonus = self._rng.integers(BONUS_MIN, BONUS_MAX + 1, size=len(self.context.neighbors)).tolist()
        retry, self._retry_excluding = self._retry_excluding, None
        if retry is None and draw >= self.options.fetch_probability:
            return []
        peer = self.scores.pick(bonus, exclude=retry)
        self._fetches.append(_Fetch(peer, due=self.clock + 1))
        return [Send(Route.PULL, peer, Kind.PARAMS)]

    def _outstanding(self, peer: int) -> _Fetch | None:
        """The oldest unanswered fetch to `peer`."""
        return next((f for f in self._fetches if f.peer == peer and f.reply is None), None)

    def _mix_due(self) -> bool:
        """Mix the answered fetches whose batch is trained, oldest first; whether any was mixed."""
        mixed = False
        while self._fetches and self._fetches[0].due <= self.clock:
            reply = self._fetches[0].reply
            if reply is None:
                break
            del self._fetches[0]
            self._mix(reply)
            mixed = True
        return mixed

    def _mix(self, reply: Message) -> None:
        factor = peer_weight(self.options, self.gossip_clock, reply.clock, float(self.last_loss), float(reply.loss))
        peer = self.params.flatten(reply.tensors)
        if self.refused(reply.sender, peer):
            return
        if self.clipper is not None:  # around w: lerp towards w + g (peer - w) is lerp towards peer by f g
            assert self.origin is not None
            factor *= self.clipper.scales(self.w, {reply.sender: peer}, self.origin)[reply.sender]
        with torch.no_grad():
            # lerp is exact at both ends: f = 0 keeps w, f = 1 copies the peer.
            self.w.lerp_(peer, factor)
        self.gossip_clock = factor * reply.clock + (1 - factor) * self.gossip_clock

    def change_topology(self, context: NodeContext) -> None:
        """A new neighbour starts at the full score, as at the start of a job, a kept one keeps its score, a dropped
        one is forgotten, and so is an unanswered fetch from it (its reply, if it comes, is ignored), so that no
        step waits for a former neighbour. Pull-only gossip keeps no other state of an edge."""
        scores = self.scores.scores
        self.scores = PeerScores(context.neighbor_ranks)
        self.scores.scores.update({peer: scores[peer] for peer in self.scores.scores if peer in scores})
        ranks = set(context.neighbor_ranks)
        self._fetches = [f for f in self._fetches if f.peer in ranks or f.reply is not None]
        if self._retry_excluding not in ranks:
            self._retry_excluding = None
        self._take_context(context)

    def join_kind(self) -> Kind | None:
        return Kind.PARAMS

    def join(self, states: Mapping[int, Message], at_step: int) -> None:
        """A node that joins a running job starts from its neighbours' models (`neighbors_start`), at the latest of
        their (gossip) clocks."""
        super().join(states, at_step)
        self.gossip_clock = float(self.clock)

    def state_dict(self) -> dict[str, torch.Tensor | int | float]:
        return {**super().state_dict(), "gossip_clock": self.gossip_clock}

    def load_state_dict(self, state: Mapping[str, torch.Tensor | int | float]) -> None:
        self.gossip_clock = float(state.get("gossip_clock", state["clock"]))
        super().load_state_dict(state)

    def _publish(self) -> Snapshot:
        tensors = self.params.views(self.w.detach().clone())
        served = {(None, Kind.PARAMS): tensors}
        return Snapshot(self.context.rank, round(self.gossip_clock), self.last_loss, served)
