"""The algorithm interface: I/O-free state machines that both runtimes (gRPC agent, simulator) drive.

An algorithm never opens a socket, starts a thread or sleeps. The node driver (nodeagent.runtime.driver) calls,
always from one thread (the agent's runner thread, or the simulator's loop):
- `step(inputs, targets)`: one local step on the batch it is given; returns the minibatch loss;
- `sends()`: the messages to send now (exchange, push, pull, all-reduce or all-gather, or a request to the
  parameter server);
- `receive(message)`: a message arrived (a peer's, a reply, an all-reduce mean, the parameter server's answer);
- `ready()`: whether the next local step may start (synchronous modes wait for their round's messages);
- `rounds_ahead()`: how many rounds ahead of the node's clock a received message may be (the driver drops one
  beyond);
- `failed(send, reason)`: a send of this node's could not be completed (the peer refused, timed out, ...);
- `consensus_distance(peer)`: for the edge metrics, at report time, how far this node is from its copy of a
  neighbour's parameters (algorithms that keep no such copy answer None);
- `state_dict()` / `load_state_dict()`: checkpoints.

Network threads call only two methods, which must read immutable state alone: `expected(peer, kind)` (what a
stream must hold, checked before any state is touched) and `snapshot()` (the immutable snapshot published after
the last change, which peers are served). Parameter-server workers add `server_specs()` and
`check_server_message()` for the link's threads (nodeagent.ps.worker).

Each algorithm also declares, without a model, what it needs and accepts: its `family`, its `modes`, its typed
`Options` (unknown keys refused) and `check(spec, topology)`, which refuses at validation every job its
constructor would refuse, naming the field. The registry (nodeagent.algorithms) is the only list of them.

The node's trainable parameters live in one flat vector `w` that the model's parameters are views of, so the
mathematics of the papers (w_i, g_i) is plain vector arithmetic and messages are zero-copy views.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
from pydantic import BaseModel, ConfigDict, ValidationError
from torch import nn

from nodeagent.jobspec import AlgorithmSpec, JobSpec, JobSpecError, Mode, Precision, format_validation_error
from nodeagent.ps.messages import ServerAnswer, ServerRequest
from nodeagent.robust import MixingCounts, SelfCenteredClip, coordinate_median, refuse_unsafe
from nodeagent.wire.errors import Reason, WireError
from nodeagent.wire.message import Kind, Message, TensorSpec, all_finite


@dataclass(frozen=True)
class Neighbor:
    """One edge as this node sees it (from the assignment)."""

    rank: int
    sign: int = 1  # A_ij of ECL-ISVR: +1 when this node's rank is the lower one
    phase: int = 0  # this node's phase on the edge, 0..interval-1
    weight: float = 0.0  # mixing weight of the neighbour
    peer_phase: int = 0  # the neighbour's own phase on the edge


@dataclass(frozen=True)
class NodeContext:
    rank: int
    world_size: int
    neighbors: tuple[Neighbor, ...]
    spec: AlgorithmSpec
    self_weight: float = 1.0
    seed: int = 0
    # Time-varying graphs: this node's out-peers at each iteration of one period (iteration t uses entry
    # t mod period); empty for static topologies. Every peer in it is also in `neighbors`.
    peer_schedule: tuple[tuple[int, ...], ...] = ()
    precision: Precision = "fp32"  # the job's training.precision: the arithmetic of forward and backward
    steps: int = 0  # the job's steps (0: not known): its last step is `steps`

    @property
    def neighbor_ranks(self) -> tuple[int, ...]:
        return tuple(n.rank for n in self.neighbors)

    def out_peers(self, iteration: int) -> tuple[int, ...]:
        if not self.peer_schedule:
            return self.neighbor_ranks
        return self.peer_schedule[iteration % len(self.peer_schedule)]


def push_sum_share(context: NodeContext) -> float:
    """The largest share of a push-sum round: a sender keeps 1 / (k + 1) of its mass and pushes as much to each of
    its k out-peers, k the fewest of any round of the schedule."""
    schedule = context.peer_schedule or (context.neighbor_ranks,)
    return 1.0 / (min(len(peers) for peers in schedule) + 1)


class Route(enum.StrEnum):
    EXCHANGE = "exchange"  # symmetric: send ours, the peer's reply arrives through receive()
    PUSH = "push"  # one way; the driver retries until delivered (synchronous rounds rely on every push)
    PULL = "pull"  # fetch the peer's snapshot of `kind`; it arrives through receive()
    ALLREDUCE = "allreduce"  # the runtime averages the message's tensors over all ranks; the mean arrives
    # through receive() as a message from ALLREDUCE_RANK with the same clock
    ALLGATHER = "allgather"  # the runtime gathers the message's tensors from all ranks (for tensors that cannot be
    # summed, like int8 codes): each arrives through receive() stacked in rank order along a new first dimension,
    # in one message from ALLREDUCE_RANK with the same clock
    SERVER = "server"  # a ServerRequest to the parameter server; its ServerAnswer arrives through receive()


# The pseudo rank of messages that come from the runtime's all-reduce rather than from a peer (the parameter
# server's is SERVER_RANK, nodeagent.ps.messages).
ALLREDUCE_RANK = -1


@dataclass(frozen=True)
class Send:
    route: Route
    peer: int
    kind: Kind
    message: Message | ServerRequest | None = None  # None for a pull; a ServerRequest on Route.SERVER


class SendFailed(Exception):
    """A send that could not be completed. `reason` is the failure label of the metrics (unavailable,
    deadline_exceeded, rejected, ...); `transient` says whether the same send may succeed if tried again."""

    def __init__(self, reason: str, detail: str = "", transient: bool = False):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.transient = transient


class Family(enum.StrEnum):
    """Whom an algorithm's nodes talk to; the coordinator plans nodes and services from it."""

    PEER = "peer"  # neighbours in the job's topology
    COLLECTIVE = "collective"  # every rank at once, through an all-reduce (the coordinator hosts its rendezvous)
    SERVER = "server"  # only the parameter server the coordinator hosts; no neighbours


class AlgorithmOptions(BaseModel):
    """An algorithm's `algorithm.options`: typed, checked, unknown keys refused (as strict as the job schema)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


class NoOptions(AlgorithmOptions):
    pass


class Graph(Protocol):
    """What `check()` may ask of a job's graph (coordinator.topology.Topology is one)."""

    @property
    def nodes(self) -> int: ...

    @property
    def passive(self) -> frozenset[int]:
        """Ranks that never send on their own, they only answer (the bipartite time-varying kinds)."""
        ...

    def degree(self, rank: int) -> int: ...

    @property
    def schedule_period(self) -> int:
        """Iterations after which a time-varying graph's schedule repeats (the length of each node's
        `peer_schedule`); 1 for a static graph."""
        ...


# A minibatch loss as a step returns it: a float on the CPU; on a GPU the 0-dim tensor itself, read (float()) only
# where a number is needed, so that a step does not wait for the device to finish it.
Loss = float | torch.Tensor


@dataclass(frozen=True)
class Snapshot:
    """What this node serves until the next snapshot: tensors by (peer or None for every peer, kind)."""

    rank: int
    clock: int
    loss: Loss
    served: Mapping[tuple[int | None, Kind], Mapping[str, torch.Tensor]]
    weight: float = 1.0

    def message_for(self, peer: int, kind: Kind) -> Message | None:
        tensors = self.served.get((peer, kind), self.served.get((None, kind)))
        if tensors is None:
            return None
        return Message(kind, self.rank, peer, tensors, clock=self.clock, loss=self.loss, weight=self.weight)


class FlatParameters:
    """A model's trainable parameters re-seated as views of one flat vector, plus flat gradients."""

    def __init__(self, model: nn.Module):
        self.model = model
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for _, p in named}
        if len(dtypes) != 1:
            raise ValueError(f"all trainable parameters must share one dtype, got {sorted(map(str, dtypes))}")
        self.names = [name for name, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        self.sizes = [p.numel() for _, p in named]
        self.parameters = [p for _, p in named]
        self.vector = torch.cat([p.detach().reshape(-1) for p in self.parameters])  # cat copies
        offset = 0
        for p, size, shape in zip(self.parameters, self.sizes, self.shapes, strict=True):
            p.data = self.vector[offset : offset + size].view(shape)
            offset += size
        self.specs = [TensorSpec(n, self.vector.dtype, s) for n, s in zip(self.names, self.shapes, strict=True)]

    @property
    def numel(self) -> int:
        return self.vector.numel()

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views of a flat vector laid out like the parameters (no copy)."""
        parts = torch.split_with_sizes(flat, self.sizes)  # one call for all the cuts: it runs at every step
        return {name: part.view(shape) for name, part, shape in zip(self.names, parts, self.shapes, strict=True)}

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One flat vector from named tensors laid out like the parameters (validated upstream)."""
        return torch.cat([tensors[name].reshape(-1) for name in self.names]).to(self.vector.device)

    def gradient(self, loss: torch.Tensor) -> torch.Tensor:
        """d loss / d parameters as one flat vector (zeros for a parameter the loss does not reach). Taken with
        autograd.grad rather than backward: no parameter's `.grad` is written, so a node holds no gradient between
        steps (the simulator holds thousands of nodes), and a small model's step skips the accumulation into it."""
        grads = torch.autograd.grad(loss, self.parameters, materialize_grads=True)
        return torch.cat([grad.reshape(-1) for grad in grads])


class LossScale:
    """fp16's dynamic loss scale, as torch.amp.GradScaler keeps it: the loss is multiplied by the scale before the
    backward pass so that small gradients do not vanish in fp16; a gradient that overflowed (not finite once
    unscaled) halves the scale and its step is skipped; GROWTH_INTERVAL finite steps in a row double it."""

    INITIAL = 2.0**16
    GROWTH_INTERVAL = 2000

    def __init__(self) -> None:
        self.scale = self.INITIAL
        self._finite_steps = 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale /= 2
            self._finite_steps = 0
            return
        self._finite_steps += 1
        if self._finite_steps == self.GROWTH_INTERVAL:
            self.scale *= 2
            self._finite_steps = 0


AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Algorithm(ABC):
    """Base of every algorithm; subclasses implement the update rule and the message protocol."""

    name: ClassVar[str]
    family: ClassVar[Family] = Family.PEER
    modes: ClassVar[tuple[Mode, ...]] = ("async",)  # the modes it runs; the first is its default
    Options: ClassVar[type[AlgorithmOptions]] = NoOptions
    # Non-empty: why `algorithm.momentum` (and nesterov) is refused, for algorithms whose rule uses the plain g.
    refuses_momentum: ClassVar[str] = ""
    # Whether receive() can produce sends (ESync pushes its delta once READY): the driver then also calls sends()
    # after handing over received messages, not only after a step.
    sends_after_receive: ClassVar[bool] = False
    # Whether its topology may change while the job runs (`change_topology`).
    changes_topology: ClassVar[bool] = False
    # The `algorithm.robust` rules it takes (nodeagent.robust), and why it takes no other (said when refused).
    robust_rules: ClassVar[tuple[str, ...]] = ()
    robust_refusal: ClassVar[str] = ""

    def __init__(self, model: nn.Module, context: NodeContext, loss_fn: nn.Module | None = None):
        self.options = type(self).options_of(context.spec)
        self.mode: Mode = context.spec.mode or self.modes[0]
        self.model = model
        self.context = context
        self.spec = context.spec
        self.loss_fn = loss_fn or nn.CrossEntropyLoss()
        model.train()  # what every step trains in (`gradient` switches only after an evaluation left it in eval)
        self.params = FlatParameters(model)
        self.w = self.params.vector
        self.clock = 0
        self.last_loss: Loss = math.nan
        self.autocast = AUTOCAST_DTYPES.get(context.precision)  # None: fp32
        self.loss_scale = LossScale() if context.precision == "fp16" else None
        # The ranks whose messages `expected` accepts: the neighbours, and while the topology changes those of the
        # next one too (replaced whole: network threads read it).
        self.accepted_ranks: frozenset[int] = frozenset(context.neighbor_ranks)
        self._momentum_buffer: torch.Tensor | None = None
        self._published: Snapshot
        # Robust mixing (peer-to-peer family): the clipping, when the job asks for it, and the counts per neighbour of
        # contributions seen, clipped and refused (refused ones: see nodeagent.robust.unsafe; always checked).
        robust = context.spec.robust
        self.clipper = (SelfCenteredClip(robust, self.contribution_weight(context))
                        if robust is not None and robust.rule == "self-centered-clip" else None)
        self.mixing = self.clipper.counts if self.clipper is not None else MixingCounts()
        # The collective family's all-gathers: each member's rows this node judged, by the member's job rank (the
        # edge is the all-reduce's; the coordinator scores each member from these, nodeagent.robust.count_gathered).
        self.judged = MixingCounts()

    # -- what a job may ask of it (no model needed) --------------------------------------------------------------

    @classmethod
    def options_of(cls, spec: AlgorithmSpec) -> AlgorithmOptions:
        """The algorithm's typed options, once mode and momentum are known to fit; JobSpecError names the field."""
        if spec.mode is not None and spec.mode not in cls.modes:
            runs = " or ".join(repr(mode) for mode in cls.modes)
            raise JobSpecError(f"algorithm.mode: {cls.name} runs only {runs}, not {spec.mode!r}")
        if cls.refuses_momentum and (spec.momentum or spec.nesterov):
            raise JobSpecError(f"algorithm.momentum: {cls.refuses_momentum}")
        if spec.robust is not None and spec.robust.rule not in cls.robust_rules:
            if not cls.robust_rules:
                raise JobSpecError(f"algorithm.robust: {cls.name} takes no robust rule: {cls.robust_refusal}")
            takes = " or ".join(cls.robust_rules)
            raise JobSpecError(f"algorithm.robust.rule: {cls.name} takes {takes}, not {spec.robust.rule}"
                               + (f": {cls.robust_refusal}" if cls.robust_refusal else ""))
        if spec.robust is not None and spec.robust.quarantine is not None and cls.family is Family.COLLECTIVE:
            raise JobSpecError(f"algorithm.robust.quarantine: {cls.name} aggregates every member's rows in each "
                               "round: the coordinator flags a member whose rows are outlying, but cannot quarantine "
                               "it (every member would have to drop its rows from the same round); the robust rule "
                               "bounds what it sends")
        try:
            return cls.Options.model_validate(spec.options)
        except ValidationError as error:
            known = ", ".join(field.alias or name for name, field in cls.Options.model_fields.items())
            unknown = f"unknown option of {cls.name}, which takes {known or 'no options'}"
            raise JobSpecError(format_validation_error(error, "algorithm.options", unknown)) from None

    @classmethod
    def synchronous(cls, spec: AlgorithmSpec) -> bool:
        """Whether its nodes wait for each other (or for the server's rounds): a node lost for good then stops the
        job, where an asynchronous job goes on without it."""
        return (spec.mode or cls.modes[0]) == "sync"

    @classmethod
    def check(cls, spec: JobSpec, topology: Graph) -> None:
        """Refuse a job this algorithm cannot run, with JobSpecError naming the field. It runs at validation,
        before any node exists, and refuses at least every job the constructor would; subclasses with
        constraints on the graph or between options extend it."""
        cls.options_of(spec.algorithm)
        if cls.family is not Family.SERVER and any(group.pushes > 1 for group in spec.simulation.byzantine):
            raise JobSpecError(f"simulation.byzantine: pushes is a parameter-server liar's; {cls.name} has no server")

    # -- local computation shared by the algorithms ------------------------------------------------------------

    def gradient(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[Loss, torch.Tensor]:
        """Minibatch loss and flat gradient g at the current parameters, with the L2 term l2 * w. With a reduced
        precision the forward pass runs under autocast (the parameters and g stay fp32); an fp16 gradient that
        overflowed is returned as zeros (its step skipped, as GradScaler skips it) and lowers the loss scale."""
        if not self.model.training:  # switching every module costs more than a small model's step
            self.model.train()
        if self.autocast is None:
            loss = self.loss_fn(self.model(inputs), targets)
        else:
            with torch.autocast(self.w.device.type, dtype=self.autocast):
                loss = self.loss_fn(self.model(inputs), targets)
        if self.loss_scale is None:
            grad = self.params.gradient(loss)
        else:
            grad = self.params.gradient(loss * self.loss_scale.scale).div_(self.loss_scale.scale)
            finite = all_finite(grad)
            self.loss_scale.update(finite)
            if not finite:
                grad.zero_()
        if self.spec.l2 > 0:
            grad = grad.add(self.w, alpha=self.spec.l2)
        loss = loss.detach()
        return (float(loss) if loss.device.type == "cpu" else loss.float()), grad

    def sgd_direction(self, grad: torch.Tensor) -> torch.Tensor:
        """The SGD step direction: the gradient, or its momentum (optionally Nesterov) combination."""
        momentum = self.spec.momentum
        if momentum == 0:
            return grad
        if self._momentum_buffer is None:
            self._momentum_buffer = grad.clone()
        else:
            self._momentum_buffer.mul_(momentum).add_(grad)
        if self.spec.nesterov:
            return grad.add(self._momentum_buffer, alpha=momentum)
        return self._momentum_buffer

    def descent(self, grad: torch.Tensor) -> torch.Tensor:
        """`sgd_direction` for a node that mixes its neighbours' models: under self-centered clipping the step's
        length lr * ||d|| is noted, the scale below which a neighbour's distance is an echo (nodeagent.robust)."""
        direction = self.sgd_direction(grad)
        if self.clipper is not None:
            self.clipper.stepped(direction, self.spec.lr)
        return direction

    def due_neighbors(self) -> list[Neighbor]:
        """Neighbours whose edge phase matches the step just taken (the asynchronous schedule)."""
        position = (self.clock - 1) % self.spec.interval
        return [n for n in self.context.neighbors if n.phase == position]

    def refused(self, peer: int, value: torch.Tensor) -> bool:
        """Whether a neighbour's contribution must be dropped before it is applied: mixing it could make this node's
        state non-finite (nodeagent.robust.unsafe). Counted per neighbour; the node keeps what it had."""
        return refuse_unsafe(self.mixing, peer, value)

    def reject_unless_neighbor(self, peer: int) -> None:
        if peer not in self.accepted_ranks:
            raise WireError(Reason.NOT_NEIGHBOR, f"rank {peer} is not a neighbour of rank {self.context.rank}")

    def neighbor_specs(self, peer: int, kind: Kind, accepted: Kind) -> list[TensorSpec]:
        """`expected` of an algorithm whose neighbours send one kind of message shaped like the model."""
        self.reject_unless_neighbor(peer)
        if kind != accepted:
            raise WireError(Reason.UNEXPECTED_KIND,
                            f"{self.name} accepts only {accepted.name.lower()}, not {kind.name.lower()}")
        return self.params.specs

    # -- the interface the runtimes drive -----------------------------------------------------------------------

    @abstractmethod
    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> Loss:
        """One local step; returns the minibatch loss (on a GPU, still on the device: see `Loss`)."""

    @abstractmethod
    def sends(self) -> list[Send]:
        """Messages to send now (called after each step, and after receiving when `sends_after_receive`)."""

    @abstractmethod
    def receive(self, message: Message | ServerAnswer) -> None:
        """Absorb a message that passed `expected` (or, for parameter-server workers, the server's answer)."""

    def snapshot(self) -> Snapshot:
        """The immutable state that network threads serve until the next one is published."""
        return self._published

    @abstractmethod
    def _publish(self) -> Snapshot:
        """A fresh snapshot of what this node serves; algorithms call `republish()` after each change."""

    def republish(self) -> None:
        self._published = self._publish()

    def state_dict(self) -> dict[str, torch.Tensor | int | float]:
        """What a checkpoint keeps to resume this node where it stopped; algorithms with more state add to it."""
        return {"clock": self.clock, "w": self.w.detach().clone()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor | int | float]) -> None:
        w = state["w"]
        if not isinstance(w, torch.Tensor) or w.shape != self.w.shape or w.dtype != self.w.dtype:
            raise ValueError(f"the checkpoint's parameters do not fit this model ({self.w.numel()} {self.w.dtype})")
        with torch.no_grad():
            self.w.copy_(w)
        self.clock = int(state["clock"])
        self.republish()

    @abstractmethod
    def expected(self, peer: int, kind: Kind) -> list[TensorSpec]:
        """The tensors a stream from `peer` of `kind` must hold; raises WireError if none is accepted."""

    def ready(self) -> bool:
        """Whether the next local step may start; asynchronous algorithms never wait."""
        return True

    def rounds_ahead(self) -> int | None:
        """How many rounds ahead of this node's clock a peer's message may be (None: any). Algorithms that keep the
        messages of rounds to come bound it by what their protocol allows, so that a forged far-future clock cannot
        make them hold messages without limit: the node driver drops, and counts, a message beyond it."""
        return None

    def waiting_for(self) -> str:
        """What the node waits for while not ready, in words for the log."""
        return "the messages it needs to go on"

    def consensus_distance(self, peer: int) -> float | None:
        """||w - this node's last copy of the neighbour `peer`'s w||, or None where the algorithm keeps no copy of a
        neighbour's parameters (only duals, shares, or nothing). Pure: it reads state and changes none."""
        return None

    def robust_clipped(self, peer: int) -> int:
        """How many of the neighbour `peer`'s contributions this node clipped or refused (nodeagent.robust)."""
        return self.mixing.clipped.get(peer, 0) + self.mixing.refused.get(peer, 0)

    def robust_judged(self, peer: int) -> int:
        """How many of the neighbour `peer`'s contributions this node's robust rule judged or refused."""
        return self.mixing.seen.get(peer, 0) + self.mixing.refused.get(peer, 0)

    def robust_outlying(self, peer: int) -> int:
        """How many of the neighbour `peer`'s contributions were outlying or refused (nodeagent.robust): what the
        coordinator's suspicion of a member is built from."""
        return self.mixing.outlying.get(peer, 0) + self.mixing.refused.get(peer, 0)

    def rejoin_kind(self) -> Kind | None:
        """What a restarted node pulls from each neighbour to rejoin its running job, or None when it needs nothing
        (an asynchronous node goes on from its checkpoint, and its neighbours do not wait for it)."""
        return None

    def rejoin(self, states: Mapping[int, Message]) -> list[Send]:
        """Take the job up where the neighbours are, from what they serve now (by rank). A restarted node lost the
        messages of the rounds since its checkpoint, and its neighbours wait for its part of theirs: returns the
        sends that give it to them."""
        return []

    def join_kind(self) -> Kind | None:
        """What a node that joins a running elastic job pulls from each neighbour to take the model up, or None
        when it starts from the job's seeded initial model."""
        return None

    def join(self, states: Mapping[int, Message], at_step: int) -> None:
        """This node joins a running job (elastic membership), whose nodes switch to the topology that includes
        it just before step `at_step`; `states` are what its neighbours serve now (`join_kind`), by rank. Only
        algorithms with `changes_topology` implement it: this default starts from the mean of the neighbours'
        models (those served as `Kind.PARAMS`), at the latest of their clocks, or at `at_step` with the seeded
        initial model when it pulled nothing."""
        if not self.changes_topology:
            raise NotImplementedError(f"{self.name} cannot join a running job")
        start = self.neighbors_start(states)
        if start is not None:
            with torch.no_grad():
                self.w.copy_(start)
        self.clock = max((s.clock for s in states.values()), default=at_step)
        self._momentum_buffer = None
        self.republish()

    def neighbors_start(self, states: Mapping[int, Message]) -> torch.Tensor | None:
        """Where a node that joins or rejoins starts from its neighbours' models (`Kind.PARAMS` states): their mean,
        or under a robust rule their coordinate-wise median, which one liar among three or more cannot move (among
        two it is the mean: the clipped mixes after it bound what the liar moved). A model that could make this
        node's state non-finite is refused, counted, and left out, rule or no rule. None when no model is left."""
        models = []
        for rank, state in states.items():
            model = self.params.flatten(state.tensors)
            if not self.refused(rank, model):
                models.append(model)
        if not models:
            return None
        stacked = torch.stack(models)
        return coordinate_median(stacked) if self.clipper is not None else stacked.mean(dim=0)

    def expect_neighbors(self, ranks: tuple[int, ...]) -> None:
        """A topology change is coming: accept messages from `ranks` too (the neighbours of the new topology, which
        may switch and send before this node does; the driver holds their messages until this node switches). The
        neighbours before the change stay accepted: their messages of the steps before the switch still count."""
        self.accepted_ranks = frozenset(self.context.neighbor_ranks) | frozenset(ranks)

    def change_topology(self, context: NodeContext) -> None:
        """Between two steps, at the switch step (`clock`): from now on the node's neighbours, weights, phases and
        peer schedule are `context`'s. Edges that disappear are dropped, edges that appear start clean. Only
        algorithms with `changes_topology` implement it."""
        raise NotImplementedError(f"{self.name} cannot change its topology while it runs")

    def _take_context(self, context: NodeContext) -> None:
        """The part of `change_topology` every algorithm shares: the new context, whose neighbours are accepted."""
        self.accepted_ranks = self.accepted_ranks | frozenset(context.neighbor_ranks)
        self.context = context
        if self.clipper is not None:
            self.clipper.weight = self.contribution_weight(context)

    def contribution_weight(self, context: NodeContext) -> float:
        """The largest weight one neighbour's contribution has in this node's mix (the auto radius of robust mixing,
        nodeagent.robust): here the neighbours' fixed mixing weights; pairwise and push-sum mixing say theirs."""
        return max((neighbor.weight for neighbor in context.neighbors), default=1.0)

    def failed(self, send: Send, reason: str) -> None:
        """A send could not be completed; `reason` is the failure label of the metrics (unavailable,
        deadline_exceeded, in_flight, rejected, ...). Algorithms that keep waiting for a reply must stop."""
        return None
