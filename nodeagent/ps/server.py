"""The server half of a parameter-server algorithm: a rule of nodeagent.ps behind the requests the runtimes move.

The coordinator's gRPC service (coordinator.ps_service) and the simulator (nodeagent.runtime.simulator) host the
same server halves, built by the worker class's `build_server(spec, info)` from the job's seeded initial model, so
the server starts from exactly the model every worker starts from. The model's shape is the data's (`info`): the
coordinator has no data, and takes the description its workers' ready reports agreed on (nodeagent.runtime.readiness).

Exactly once: the half keeps, per worker, the id of its last push and of its last released push. A retried push
(same id as the worker's last) changes nothing and is answered again, which is what makes a retry after a lost
answer safe (a coordinator restart between a push and its answer makes the worker retry). `events` lists what
happened in order (pushes, pulls that change the state, rounds), for the run's log; runtimes drain it.

Once per step (asynchronous servers): a push carries its worker's clock, the step it ends (0 to the job's
`steps` - 1), and the half applies a worker's push only for a step past that of its last applied push. A push for
an earlier step or past the job's last is answered with the model but not applied (`repeated`): a worker restarted
from an older checkpoint redoes steps the server has, and a worker that pushes more often than it steps lies, and
either way no worker moves the model more times than the job has steps (issue 28: a sign-flipping worker that
pushed 30 times a step was otherwise held only by the robust rule's rate bound). A push past the job's last step,
which no honest worker sends, is flagged for the coordinator's suspicion (`robust_counts`); a redone step is not
counted there, judged neither way. A worker that rejoins (a restart, from an older checkpoint or none) takes its
steps up from its pull's answer, which names the next step the half would apply (`ServerModel.step`), instead of
redoing the steps applied already.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from pydantic import Field

from nodeagent.algorithms.base import AlgorithmOptions, FlatParameters
from nodeagent.jobspec import JobSpec
from nodeagent.ps.esync import Decision
from nodeagent.ps.messages import ServerModel, ServerPush
from nodeagent.ps.rules import ParameterServer, ProtocolError, PushResult, RoundServer
from nodeagent.training.data import DatasetInfo
from nodeagent.training.models import initial_model
from nodeagent.wire.errors import Reason, WireError
from nodeagent.wire.message import Kind, TensorSpec

# The default bound of a pushed update: one update moves the global model by at most this root-mean-square per
# parameter (the bound is sqrt(parameters) * DEFAULT_UPDATE_RMS / the step the server scales updates by).
DEFAULT_UPDATE_RMS = 1.0


class ServerOptions(AlgorithmOptions):
    """The options every parameter-server algorithm takes (its own options extend these)."""

    max_update_norm: float | None = Field(
        None, gt=0,
        description="largest L2 norm of one pushed update (a gradient; ESync's delta; DiLoCo's pseudo-gradient): a "
        "longer one is scaled down to it before the server applies it, and counted (peertrain_ps_updates_clipped), "
        "so that one diverged or forged worker moves the global model by a bounded step; unset: derived from the "
        "job, sqrt(parameters) / the server's step (lr; ESync's global_lr; DiLoCo's outer_lr), so that one update "
        "moves the model by at most 1 per parameter in root mean square",
    )


def initial_parameters(spec: JobSpec, info: DatasetInfo) -> FlatParameters:
    """The parameters of the job's seeded initial model (every worker's w0) for the data `info` describes, leaving
    torch's random state alone."""
    with torch.random.fork_rng(devices=[]):
        return FlatParameters(initial_model(spec, info))


class ServerHalf:
    """Not thread-safe: the runtime serialises calls (the coordinator holds one lock per job; the simulator has
    one thread)."""

    synchronous: ClassVar[bool] = False  # pushes must be computed on the current version (one round at a time)
    pull_mutates: ClassVar[bool] = False  # a pull changes the state (DC-ASGD's backups)
    # Entries of the rule's state that no applied update depends on (losing their latest values costs at most a
    # rejected push): the coordinator persists them periodically rather than before every answer.
    volatile: ClassVar[tuple[str, ...]] = ()
    push_kind: ClassVar[Kind] = Kind.GRADIENT

    options: ServerOptions

    def __init__(self, spec: JobSpec, params: FlatParameters, options: ServerOptions):
        self.spec = spec
        self.params = params
        self.options = options
        self.num_workers = spec.nodes
        self.rule = self.build_rule(params.vector.detach().clone())
        self.last_push = [""] * self.num_workers
        self.released = [""] * self.num_workers
        # An asynchronous server's: per worker, the step (push clock) of its last applied push (module text).
        self.taken = [-1] * self.num_workers
        self.events: list[dict[str, Any]] = []
        # Issue 28: the workers whose pushes are ignored (the coordinator's ControlPlane decides), and per worker the
        # pushes taken and those the robust rule flagged (the coordinator's suspicion, `robust_counts`).
        self.quarantined: set[int] = set()
        self.pushes: dict[int, int] = {}
        self.flagged: dict[int, int] = {}

    def build_rule(self, w0: torch.Tensor) -> ParameterServer:
        raise NotImplementedError

    def update_bound(self, step: float) -> float:
        """`max_update_norm`, or its default for a rule that applies updates scaled by `step` (the option's text)."""
        if self.options.max_update_norm is not None:
            return self.options.max_update_norm
        return math.sqrt(self.params.numel) * DEFAULT_UPDATE_RMS / step

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
            raise WireError(Reason.UNEXPECTED_KIND, f"{self.spec.algorithm.name} pushes {self.push_kind.name.lower()}, "
                            f"not {kind.name.lower()}")
        return self.params.specs

    def decode(self, push: ServerPush) -> Any:
        """The rule's update from a validated push; ProtocolError if its content is unusable."""
        return self.params.flatten(push.tensors)

    def apply(self, rank: int, update: Any, worker_version: int, now: float) -> PushResult:
        return self.rule.push(rank, update, worker_version)

    def push(self, rank: int, push: ServerPush, push_id: str, now: float) -> PushResult:
        """Apply a push once; a retry (same id as the worker's last push) changes nothing."""
        self.check_rank(rank)
        if not push_id:
            raise ProtocolError("a push needs an id")
        if push_id == self.last_push[rank]:
            release = (rank,) if self.released[rank] == push_id else ()
            return PushResult(applied=False, version=self.version, release=release, duplicate=True)
        if push.kind != self.push_kind:
            raise ProtocolError(f"expected a {self.push_kind.name.lower()} push, got {push.kind.name.lower()}")
        if rank in self.quarantined:  # ignored: its update counts as zero, so that a round still completes
            push = dataclasses.replace(push, tensors={
                name: torch.zeros_like(t) if t.is_floating_point() else t for name, t in push.tensors.items()})
        if self.synchronous and push.version != self.version:
            reason = f"computed on version {push.version}, the round is {self.version}"
            result = PushResult(applied=False, version=self.version, release=(rank,), rejected=reason)
        else:
            update = self.decode(push)  # a malformed push is refused whatever its step
            if not self.synchronous and not self.taken[rank] < push.clock < self.spec.steps:
                # No honest worker pushes a step outside the job's: flagged. A step taken is a restarted worker's
                # redo (or a liar's repeat): neither judged nor counted.
                outside = () if 0 <= push.clock < self.spec.steps else (rank,)
                result = PushResult(applied=False, version=self.version, release=(rank,), repeated=True,
                                    flagged=outside)
            else:
                result = self.apply(rank, update, push.version, now)
                if result.applied and not self.synchronous:
                    self.taken[rank] = push.clock
        if not result.repeated or result.flagged:
            self.pushes[rank] = self.pushes.get(rank, 0) + 1
        self.last_push[rank] = push_id
        for worker in result.release:
            self.released[worker] = self.last_push[worker]
        for worker in result.flagged:
            self.flagged[worker] = self.flagged.get(worker, 0) + 1
        self.events.append({
            "event": "push", "time": now, "rank": rank, "push_id": push_id, "worker_version": push.version,
            "version": result.version, "applied": result.applied, "delay": result.delay, "rejected": result.rejected,
            "clipped": result.clipped, "flagged": list(result.flagged),
        })
        return result

    def robust_counts(self) -> dict[int, tuple[int, int]]:
        """Per worker: (pushes its robust rule flagged or that claimed a step outside the job's, pushes judged),
        cumulative."""
        return {rank: (self.flagged.get(rank, 0), pushes) for rank, pushes in self.pushes.items()}

    def is_released(self, rank: int, push_id: str) -> bool:
        return self.released[rank] == push_id

    # -- pulls and reports -----------------------------------------------------------------------------------------

    def holds_update(self, rank: int) -> bool:
        """Whether the current round already has worker `rank`'s update: a pull of that worker is answered once
        the round completes (a restarted worker that had pushed rejoins with the next round)."""
        return isinstance(self.rule, RoundServer) and self.rule.holds(rank)

    def pull(self, rank: int, since_version: int, delta: bool, now: float) -> ServerModel:
        """The model for worker `rank` (full here; AdaComp can answer with a delta since `since_version`)."""
        self.check_rank(rank)
        w, version = self.rule.pull(rank)
        if self.pull_mutates:
            self.events.append({"event": "pull", "time": now, "rank": rank, "version": version})
        return ServerModel(Kind.PARAMS, self.params.views(w), version, step=0 if self.synchronous else
                           self.taken[rank] + 1)

    def report(self, rank: int, version: int, round_step: int, duration_s: float, now: float) -> Decision:
        raise ProtocolError(f"{self.spec.algorithm.name} takes no step reports")

    # -- persistence -----------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"rule": self.rule.state_dict(), "last_push": list(self.last_push), "released": list(self.released),
                "taken": list(self.taken)}

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
        taken = state.get("taken", [-1] * self.num_workers)  # absent from a state saved before it was kept
        if not isinstance(taken, list) or len(taken) != self.num_workers or not all(
                type(step) is int and step >= -1 for step in taken):
            raise ValueError(f"the server state's steps taken must be {self.num_workers} integers >= -1")
        rule = state.get("rule")
        if not isinstance(rule, Mapping):
            raise ValueError("the server state has no rule state")
        self.rule.load_state_dict(rule)
        self.last_push, self.released, self.taken = list(ids[0]), list(ids[1]), list(taken)

    def drain_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events
