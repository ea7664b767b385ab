"""The parameter-server family: the worker and server halves and the protocol between them (ALGORITHMS.md,
"Parameter-server algorithms").

Each algorithm is one module binding a worker (a `PSWorker`, an I/O-free Algorithm) to its server half (a
`ServerHalf` around the update rule of nodeagent.ps): ssgd.py, asgd.py, dcasgd.py, adacomp.py, esync.py. The
coordinator's gRPC service and the simulator host the same server halves, built by `build_server(spec)`.

Protocol over Route.SERVER (the server is SERVER_RANK to algorithms; on the wire it is rank `world_size`):
- Push: `Send(Route.SERVER, SERVER_RANK, kind, message)`, a message with tensors whose `model_version` is the
  version the update was computed on. The runtime delivers it exactly once (it names the push with an id and
  retries with the same id until the job ends), waits until the server releases the worker (at once for
  asynchronous rules, when the round completes for synchronous ones), then pulls the model, in full or, for a
  worker with `pull_delta`, as a delta since the version it pushed from, and hands it to `receive()` as a Message
  from SERVER_RANK whose `model_version` is the server's version.
- Step report (ESync): a `StepReport` (no tensors; `clock` = steps done in the round, the one just finished
  included). The runtime sets `duration_s` to that step's duration (measured on agents, slow-down included;
  virtual in the simulator); the decision comes back to `receive()` as a `ReadyAnswer`: READY, or how many local
  steps to run before the next report.
- `sends_after_receive`: a receive can produce a send (ESync pushes its delta once READY), so runtimes also call
  `sends()` after draining the inbox of these workers, not only after a step.

- Pull alone: `Send(Route.SERVER, SERVER_RANK, Kind.PARAMS, None)`; the full model comes back (runtimes offer it;
  the workers here start from the seeded model the server also starts from, and need no first pull).

A worker's clock counts its answered pushes (one per local step; ESync: one per round; with a synchronous rule it is
the server's version, the rounds done), which is what the job's `steps` counts; a rejected push is answered too
(with the model to start again from). The server rules are plain SGD steps on the pushed gradient, so the
gradient-pushing workers refuse `algorithm.momentum`; ESync's local steps use it.

Server halves keep the rule's state plus, per worker, the id of its last push and of its last released push:
that is what makes a retried push idempotent (a coordinator restart between a push and its answer makes the
worker retry). `events` lists what happened in order (pushes, and pulls that change the state, rounds), for
the run's log; runtimes drain it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from nodeagent.algorithms.base import (
    SERVER_RANK,
    Algorithm,
    FlatParameters,
    NodeContext,
    Route,
    Send,
    Snapshot,
    parse_options,
)
from nodeagent.jobspec import AlgorithmSpec, JobSpec
from nodeagent.ps.esync import Decision
from nodeagent.ps.rules import ParameterServer, ProtocolError, PushResult, RoundServer
from nodeagent.wire.errors import WireError
from nodeagent.wire.message import Kind, Message, TensorSpec

PUSH_ID_HEADER = "peertrain-push-id"  # gRPC metadata key naming a push (see the module docstring)


@dataclass(frozen=True)
class StepReport(Message):
    """ESync: "I finished a local step; may I stop?" The runtime fills in `duration_s`."""

    duration_s: float = math.nan


@dataclass(frozen=True)
class ReadyAnswer(Message):
    """ESync: the server's decision on a StepReport."""

    ready: bool = False
    steps_before_asking: int = 1  # when not ready: local steps to run before the next report


def wire_rank(world_size: int) -> int:
    """The server's rank on the wire (manifests carry unsigned ranks)."""
    return world_size


# -- the server half ---------------------------------------------------------------------------------------------


class ServerHalf:
    """A rule of nodeagent.ps behind the messages the runtimes move. Not thread-safe: the runtime serialises
    calls (the coordinator holds one lock per job; the simulator has one thread)."""

    synchronous: ClassVar[bool] = False  # pushes must be computed on the current version (one round at a time)
    pull_mutates: ClassVar[bool] = False  # a pull changes the state (DC-ASGD's backups)
    # Entries of the rule's state that no applied update depends on (losing their latest values costs at most a
    # rejected push): the coordinator persists them periodically rather than before every answer.
    volatile: ClassVar[tuple[str, ...]] = ()
    push_kind: ClassVar[Kind] = Kind.GRADIENT

    def __init__(self, spec: JobSpec, params: FlatParameters, options: Mapping[str, Any]):
        self.spec = spec
        self.params = params
        self.options = dict(options)
        self.num_workers = spec.nodes
        self.rule = self.build_rule(params.vector.detach().clone())
        self.last_push = [""] * self.num_workers
        self.released = [""] * self.num_workers
        self.events: list[dict[str, Any]] = []

    def build_rule(self, w0: torch.Tensor) -> ParameterServer:
        raise NotImplementedError

    @property
    def version(self) -> int:
        return self.rule.version

    @property
    def w(self) -> torch.Tensor:
        return self.rule.w

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_workers:
            raise ProtocolError(f"rank {rank} is not a worker of this job (0..{self.num_workers - 1})")

    # -- pushes ----------------------------------------------------------------------------------------------------

    def push_specs(self, kind: Kind, shapes: list[tuple[str, tuple[int, ...]]]) -> list[TensorSpec]:
        """What a push stream of `kind` must hold; `shapes` are the manifest's (name, shape) pairs, for
        variable-length payloads. Raises WireError for a stream the server does not accept."""
        if kind != self.push_kind:
            raise WireError("unexpected_kind", f"{self.spec.algorithm.name} pushes {self.push_kind.name.lower()}, "
                            f"not {kind.name.lower()}")
        return self.params.specs

    def decode(self, message: Message) -> Any:
        """The rule's update from a validated push stream; ProtocolError if its content is unusable."""
        return self.params.flatten(message.tensors)

    def apply(self, rank: int, update: Any, worker_version: int, now: float) -> PushResult:
        return self.rule.push(rank, update, worker_version)

    def push(self, rank: int, message: Message, push_id: str, now: float) -> PushResult:
        """Apply a push once; a retry (same id as the worker's last push) changes nothing."""
        self.check_rank(rank)
        if not push_id:
            raise ProtocolError("a push needs an id")
        if push_id == self.last_push[rank]:
            release = (rank,) if self.released[rank] == push_id else ()
            return PushResult(applied=False, version=self.version, release=release, duplicate=True)
        if message.kind != self.push_kind:
            raise ProtocolError(f"expected a {self.push_kind.name.lower()} push, got {message.kind.name.lower()}")
        if self.synchronous and message.model_version != self.version:
            reason = f"computed on version {message.model_version}, the round is {self.version}"
            result = PushResult(applied=False, version=self.version, release=(rank,), rejected=reason)
        else:
            update = self.decode(message)
            result = self.apply(rank, update, message.model_version, now)
        self.last_push[rank] = push_id
        for worker in result.release:
            self.released[worker] = self.last_push[worker]
        self.events.append({
            "event": "push", "time": now, "rank": rank, "push_id": push_id, "worker_version": message.model_version,
            "version": result.version, "applied": result.applied, "delay": result.delay, "rejected": result.rejected,
        })
        return result

    def is_released(self, rank: int, push_id: str) -> bool:
        return self.released[rank] == push_id

    # -- pulls and reports -----------------------------------------------------------------------------------------

    def holds_update(self, rank: int) -> bool:
        """Whether the current round already has worker `rank`'s update: a pull of that worker is answered once
        the round completes (a restarted worker that had pushed rejoins with the next round)."""
        return isinstance(self.rule, RoundServer) and self.rule.holds(rank)

    def pull(self, rank: int, since_version: int, delta: bool, now: float) -> Message:
        """The model for worker `rank` (full here; AdaComp can answer with a delta since `since_version`)."""
        self.check_rank(rank)
        w, version = self.rule.pull(rank)
        if self.pull_mutates:
            self.events.append({"event": "pull", "time": now, "rank": rank, "version": version})
        return Message(Kind.PARAMS, SERVER_RANK, rank, self.params.views(w), model_version=version)

    def report(self, rank: int, version: int, round_step: int, duration_s: float, now: float) -> Decision:
        raise ProtocolError(f"{self.spec.algorithm.name} takes no step reports")

    # -- persistence -----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"rule": self.rule.state_dict(), "last_push": list(self.last_push), "released": list(self.released)}

    def round_state(self) -> dict[str, torch.Tensor]:
        """The part of the rule's state that step reports change (ESync's round table), small enough to persist
        after every report; it overlays the rule's state_dict entries of the same names."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        ids = [state.get("last_push"), state.get("released")]
        for value in ids:
            if not isinstance(value, list) or len(value) != self.num_workers or not all(isinstance(v, str)
                                                                                        for v in value):
                raise ValueError(f"the server state's push ids must be {self.num_workers} strings")
        rule = state.get("rule")
        if not isinstance(rule, Mapping):
            raise ValueError("the server state has no rule state")
        self.rule.load_state_dict(rule)
        self.last_push, self.released = list(ids[0]), list(ids[1])

    def drain_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


def initial_parameters(spec: JobSpec) -> FlatParameters:
    """The job's seeded initial model as every node builds it (nodeagent.training.job.build_node)."""
    from nodeagent.training.data import IMAGE_SIDE, NUM_CLASSES
    from nodeagent.training.models import build_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = build_model(spec.model, (1, IMAGE_SIDE, IMAGE_SIDE), NUM_CLASSES)
    return FlatParameters(model)


def server_class(name: str) -> type[PSWorker] | None:
    """The worker class of a centralised algorithm, or None for the other families."""
    from nodeagent.algorithms import REGISTRY

    cls = REGISTRY.get(name)
    return cls if isinstance(cls, type) and issubclass(cls, PSWorker) else None


def build_server(spec: JobSpec) -> ServerHalf:
    cls = server_class(spec.algorithm.name)
    if cls is None:
        raise ValueError(f"algorithm.name: {spec.algorithm.name} has no parameter server")
    return cls.server_half(spec, initial_parameters(spec), cls.parse_options(spec.algorithm))


# -- the worker half ---------------------------------------------------------------------------------------------


class PSWorker(Algorithm):
    """Pushes one gradient per local step and waits for the model (SSGD, ASGD, DC-ASGD; AdaComp and ESync
    override the update they push and what they do with the answer)."""

    server_half: ClassVar[type[ServerHalf]]
    sends_after_receive: ClassVar[bool] = True
    pull_delta: ClassVar[bool] = False
    OPTIONS: ClassVar[dict[str, Any]] = {}
    pushes_gradients: ClassVar[bool] = True

    def __init__(self, model: nn.Module, context: NodeContext, loss_fn: nn.Module | None = None):
        super().__init__(model, context, loss_fn)
        self.options = self.parse_options(context.spec)
        self.version = 0  # the server version the local model came from (every node starts from the seeded w0)
        self.waiting = False  # an update is out and the model has not come back
        self.rejoining = False  # a pull is out to start again from the server's model
        self._outbox: list[Send] = []
        self.republish()

    @classmethod
    def parse_options(cls, spec: AlgorithmSpec) -> dict[str, Any]:
        if cls.pushes_gradients and (spec.momentum or spec.nesterov):
            raise ValueError(f"algorithm.momentum: {cls.name} pushes plain gradients (the server applies its rule)")
        options = parse_options(cls.name, spec.options, cls.OPTIONS)
        cls.check_options(options)
        return options

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """Ranges of the options' values; ValueError naming the field."""

    # -- steps and messages ----------------------------------------------------------------------------------------

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        loss, grad = self.gradient(inputs, targets)
        self.last_loss = loss
        self._outbox = [self.push(self.update_tensors(grad), self.server_half.push_kind)]
        self.waiting = True
        return loss

    def update_tensors(self, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        """What travels for this step's gradient (dense: the gradient's named views)."""
        return self.params.views(grad)

    def push(self, tensors: Mapping[str, torch.Tensor], kind: Kind) -> Send:
        message = Message(kind, self.context.rank, SERVER_RANK, dict(tensors), clock=self.clock, loss=self.last_loss,
                          model_version=self.version)
        return Send(Route.SERVER, SERVER_RANK, kind, message)

    def sends(self) -> list[Send]:
        outbox, self._outbox = self._outbox, []
        return outbox

    def receive(self, message: Message) -> None:
        if message.sender != SERVER_RANK:
            raise WireError("not_server", f"{self.name} takes messages only from the server, not rank {message.sender}")
        if not self.waiting:
            raise RuntimeError(f"rank {self.context.rank}: a model from the server arrived with no push out")
        with torch.no_grad():
            self.apply_model(message)
        self.version = message.model_version
        self.waiting = False
        if self.server_half.synchronous:
            # Every worker takes part in every round, so its clock is the round count: rounds that went by while
            # it was away (restarted, or refused) count for it too, and all workers end with the job's last round.
            self.clock = message.model_version
        elif not self.rejoining:
            self.clock += 1
        self.rejoining = False
        self.republish()

    def apply_model(self, message: Message) -> None:
        """Take the pulled model (checked by `check_server_message`)."""
        self.w.copy_(self.params.flatten(message.tensors))

    def ready(self) -> bool:
        return not self.waiting

    def failed(self, send: Send, reason: str) -> None:
        # The server refused a call (after a restart of this worker from an older checkpoint, a push of a round
        # it already has, a report out of step): this update is lost, and the worker pulls the server's model and
        # starts again from it. A refused pull gives up waiting, and the worker steps on from its own model.
        if send.message is None:
            self.rejoining = self.waiting = False
            return
        self.rejoin()

    def rejoin(self) -> None:
        """Ask for the server's current model; `receive` then starts from it without counting a step."""
        self._outbox = [Send(Route.SERVER, SERVER_RANK, Kind.PARAMS, None)]
        self.waiting = self.rejoining = True

    # -- what the network threads may call (immutable configuration only) -----------------------------------------

    def server_specs(self, kind: Kind, shapes: list[tuple[str, tuple[int, ...]]]) -> list[TensorSpec]:
        """What a stream from the server of `kind` must hold (`shapes` from its manifest)."""
        if kind != Kind.PARAMS:
            raise WireError("unexpected_kind", f"{self.name} pulls params, not {kind.name.lower()}")
        return self.params.specs

    def check_server_message(self, message: Message) -> None:
        """Content checks beyond the stream's shapes, before the message reaches `receive()`; WireError."""

    def expected(self, peer: int, kind: Kind) -> list[TensorSpec]:
        if peer != SERVER_RANK:
            raise WireError("not_neighbor", f"{self.name} exchanges only with the parameter server")
        return self.server_specs(kind, [])

    def _publish(self) -> Snapshot:
        # Nothing is served to peers; the snapshot reports clock and loss.
        return Snapshot(self.context.rank, self.clock, self.last_loss, {})

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "version": self.version}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.version = int(state.get("version", 0))
        super().load_state_dict(state)
