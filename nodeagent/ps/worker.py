"""The worker half of the parameter-server family.

Each algorithm is one module binding a worker (a `PSWorker`, an I/O-free Algorithm) to its server half (a
`ServerHalf` around an update rule of nodeagent.ps): ssgd.py, asgd.py, dcasgd.py, adacomp.py, esync.py in
nodeagent/algorithms.

The protocol, over Route.SERVER (nodeagent.ps.messages):
- a local step ends with a `ServerPush` of the update, tagged with the server version it was computed on; the
  link delivers it exactly once, waits until the server releases the worker (at once for asynchronous rules,
  when the round completes for synchronous ones), and answers with the model: a `ServerModel`, in full or, with
  `pull_delta`, as a delta since the pushed version;
- ESync's workers also send `StepReport`s and get `ReadyAnswer`s;
- a refused call makes the worker rejoin: it sends a `ServerPull` and starts again from the server's model.

A worker's clock counts its answered pushes (one per local step; ESync: one per round; with a synchronous rule it
is the server's version, the rounds done), which is what the job's `steps` counts; a rejected push is answered
too (with the model to start again from). The server rules are plain SGD steps on the pushed gradient, so the
gradient-pushing workers refuse `algorithm.momentum`; ESync's local steps use it.

Robust rules (`algorithm.robust`, nodeagent.robust): a synchronous server (SSGD, ESync, DiLoCo's) aggregates each
round's updates by centered-clip, trimmed-mean, median or krum; an asynchronous one (ASGD, DC-ASGD, AdaComp) applies
each update on arrival, so it takes centered-clip alone (each update's norm clipped at the rule's radius).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from nodeagent.algorithms.base import Algorithm, AlgorithmOptions, Family, Graph, NodeContext, Route, Send, Snapshot
from nodeagent.jobspec import JobSpec, JobSpecError
from nodeagent.ps.messages import SERVER_RANK, ServerAnswer, ServerModel, ServerPull, ServerPush
from nodeagent.ps.server import ServerHalf, ServerOptions, initial_parameters
from nodeagent.robust import default_byzantine
from nodeagent.training.data import DatasetInfo
from nodeagent.wire.errors import Reason, WireError
from nodeagent.wire.message import Kind, Message, TensorSpec


class PSWorker(Algorithm):
    """Pushes one gradient per local step and waits for the model (SSGD, ASGD, DC-ASGD; AdaComp and ESync
    override the update they push and what they do with the answer)."""

    family = Family.SERVER
    Options: ClassVar[type[AlgorithmOptions]] = ServerOptions
    server_half: ClassVar[type[ServerHalf]]
    sends_after_receive = True
    refuses_momentum = "the workers push plain gradients and the server applies its rule; set momentum to 0"
    robust_rules = ("centered-clip",)
    robust_refusal = ("its server applies each update on arrival: there is no round of updates to trim, take the "
                      "median of or score")

    def __init__(self, model: nn.Module, context: NodeContext, loss_fn: nn.Module | None = None):
        super().__init__(model, context, loss_fn)
        self.version = 0  # the server version the local model came from (every node starts from the seeded w0)
        self.waiting = False  # an update is out and the model has not come back
        self.rejoining = False  # a pull is out to start again from the server's model
        self.pull_delta = False  # ask for the model as a delta since the pushed version
        self._outbox: list[Send] = []
        self.republish()

    @classmethod
    def check(cls, spec: JobSpec, topology: Graph) -> None:
        super().check(spec, topology)
        check_robust_workers(spec)
        if cls.server_half.synchronous and any(group.pushes > 1 for group in spec.simulation.byzantine):
            raise JobSpecError(f"simulation.byzantine: pushes needs an asynchronous server; {cls.name}'s takes one "
                               "update per worker and round")

    @classmethod
    def build_server(cls, spec: JobSpec, info: DatasetInfo) -> ServerHalf:
        """The server half of `spec`, starting from the job's seeded initial model (the workers' w0) shaped for the
        data `info` describes."""
        return cls.server_half(spec, initial_parameters(spec, info), cls.options_of(spec.algorithm))

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
        push = ServerPush(kind, dict(tensors), self.version, clock=self.clock, loss=self.last_loss,
                          pull_delta=self.pull_delta)
        return Send(Route.SERVER, SERVER_RANK, kind, push)

    def sends(self) -> list[Send]:
        outbox, self._outbox = self._outbox, []
        return outbox

    def receive(self, message: Message | ServerAnswer) -> None:
        if not isinstance(message, ServerModel):
            raise WireError(Reason.NOT_SERVER, f"{self.name} takes messages only from the server, not a "
                            f"{type(message).__name__}")
        if not self.waiting:
            raise RuntimeError(f"rank {self.context.rank}: a model from the server arrived with no push out")
        with torch.no_grad():
            self.apply_model(message)
        self.version = message.version
        self.waiting = False
        if self.server_half.synchronous:
            # Every worker takes part in every round, so its clock is the round count: rounds that went by while
            # it was away (restarted, or refused) count for it too, and all workers end with the job's last round.
            self.clock = message.version
        elif self.rejoining:
            # Restarted from an older checkpoint (or none): the steps the server applied already are not redone.
            self.clock = max(self.clock, message.step)
        else:
            self.clock += 1
        self.rejoining = False
        self.republish()

    def apply_model(self, model: ServerModel) -> None:
        """Take the pulled model (checked by `check_server_message`)."""
        self.w.copy_(self.params.flatten(model.tensors))

    def ready(self) -> bool:
        return not self.waiting

    def waiting_for(self) -> str:
        return f"the parameter server's model (version {self.version} was the last)"

    def failed(self, send: Send, reason: str) -> None:
        # The server refused a call (after a restart of this worker from an older checkpoint, a push of a round
        # it already has, a report out of step): this update is lost, and the worker pulls the server's model and
        # starts again from it. A refused pull gives up waiting, and the worker steps on from its own model.
        if isinstance(send.message, ServerPull):
            self.rejoining = self.waiting = False
            return
        self.rejoin()

    def rejoin(self) -> None:
        """Ask for the server's current model; `receive` then starts from it without counting a step."""
        self._outbox = [Send(Route.SERVER, SERVER_RANK, Kind.PARAMS, ServerPull())]
        self.waiting = self.rejoining = True

    # -- what the network threads may call (immutable configuration only) -----------------------------------------

    def server_specs(self, kind: Kind, shapes: list[tuple[str, tuple[int, ...]]]) -> list[TensorSpec]:
        """What a stream from the server of `kind` must hold (`shapes` from its manifest)."""
        if kind != Kind.PARAMS:
            raise WireError(Reason.UNEXPECTED_KIND, f"{self.name} pulls params, not {kind.name.lower()}")
        return self.params.specs

    def check_server_message(self, model: ServerModel) -> None:
        """Content checks beyond the stream's shapes, before the model reaches `receive()`; WireError."""

    def expected(self, peer: int, kind: Kind) -> list[TensorSpec]:
        raise WireError(Reason.NOT_NEIGHBOR, f"{self.name} exchanges only with the parameter server, not rank {peer}")

    def _publish(self) -> Snapshot:
        # Nothing is served to peers; the snapshot reports clock and loss.
        return Snapshot(self.context.rank, self.clock, self.last_loss, {})

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "version": self.version}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.version = int(state.get("version", 0))
        super().load_state_dict(state)


def check_robust_workers(spec: JobSpec) -> None:
    """Refuse a robust rule that cannot work with the job's workers and its assumed Byzantine count."""
    robust, workers = spec.algorithm.robust, spec.max_nodes
    if robust is None:
        return
    byzantine = default_byzantine(workers) if robust.byzantine is None else robust.byzantine
    if robust.rule == "trimmed-mean" and 2 * byzantine >= workers:
        raise JobSpecError(f"algorithm.robust.byzantine: trimmed-mean cannot drop {byzantine} of {workers} updates "
                           "at each end")
    if robust.rule == "krum" and workers - byzantine - 2 < 1:
        raise JobSpecError(f"algorithm.robust.byzantine: krum needs n - f - 2 >= 1 ({workers} workers, f = "
                           f"{byzantine})")
