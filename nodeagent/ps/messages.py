"""What a worker and its parameter server say to each other: the parameter-server family's own message types.

A worker's requests travel as `Send(Route.SERVER, SERVER_RANK, kind, request)`; runtimes hand them to the node's
`ServerLink` (nodeagent.ps.link) and nothing else, and the link hands the server's answer back to the worker's
`receive()`. The types are frozen values, separate from the peer-to-peer `Message`, so that no runtime needs to
ask what a message is:
- `ServerPush`: an update (a gradient, or ESync's delta), tagged with the server version it was computed on; the
  link delivers it exactly once and answers with the model (`ServerModel`) once the server releases the worker.
- `ServerPull`: the model alone, in full or as a delta since a version.
- `StepReport`: ESync's "I finished local step `round_step` of round `version`; may I stop?"; the link adds the
  step's duration, which the node driver stamps on the call, and answers with a `ReadyAnswer`.

The server is one identity everywhere: rank SERVER_RANK to algorithms, name SERVER_NAME in metrics and
manifests, and rank `server_wire_rank(world_size)` on the wire (manifests carry unsigned ranks). The wire form of
pushes and models is a `Message`; the four conversions below are the only place that maps between the two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nodeagent.wire.message import Kind, Message, payload_bytes

if TYPE_CHECKING:
    from nodeagent.ps.link import Answered, ServerLink

SERVER_RANK = -2  # the parameter server, as algorithms address it
SERVER_NAME = "coordinator"  # the parameter server in edge metrics and manifests (the coordinator hosts it)
PUSH_ID_HEADER = "peertrain-push-id"  # gRPC metadata naming a push, so that a retry is applied once


def server_wire_rank(world_size: int) -> int:
    """The server's rank on the wire: one past the workers'."""
    return world_size


@dataclass(frozen=True)
class ServerPush:
    """An update for the server, computed on the model of server version `version`."""

    kind: Kind  # Kind.GRADIENT, or Kind.DELTA for ESync
    tensors: Mapping[str, torch.Tensor]
    version: int
    clock: int = 0
    loss: float | torch.Tensor = 0.0  # as Message.loss: read where it leaves the process
    pull_delta: bool = False  # the model comes back as a delta since `version` (AdaComp's `pull: delta`)

    @property
    def payload_bytes(self) -> int:
        return payload_bytes(self.tensors)

    def send_on(self, link: ServerLink, call_id: str, step_s: float, answered: Answered) -> None:
        link.push(self, call_id, answered)


@dataclass(frozen=True)
class ServerPull:
    """The current model: in full, or (`delta`) the entries changed since `since_version`."""

    since_version: int = 0
    delta: bool = False

    def send_on(self, link: ServerLink, call_id: str, step_s: float, answered: Answered) -> None:
        link.pull(self, answered)


@dataclass(frozen=True)
class StepReport:
    """ESync: step `round_step` of round `version` is done (steps counted from the round's start, inclusive)."""

    version: int
    round_step: int

    def send_on(self, link: ServerLink, call_id: str, step_s: float, answered: Answered) -> None:
        link.report(self, step_s, answered)


ServerRequest = ServerPush | ServerPull | StepReport


@dataclass(frozen=True)
class ServerModel:
    """The server's model at `version`: Kind.PARAMS (the whole model) or Kind.DELTA (AdaComp's changed entries)."""

    kind: Kind
    tensors: Mapping[str, torch.Tensor]
    version: int
    step: int = 0  # an asynchronous server's pull: the worker's next step it would apply (nodeagent.ps.server)

    @property
    def payload_bytes(self) -> int:
        return payload_bytes(self.tensors)


@dataclass(frozen=True)
class ReadyAnswer:
    """ESync: the server's decision on a StepReport; when not ready, the local steps to run before asking again."""

    ready: bool
    steps_before_asking: int
    version: int


ServerAnswer = ServerModel | ReadyAnswer


# -- the wire form ---------------------------------------------------------------------------------------------


def push_message(push: ServerPush, rank: int, world_size: int) -> Message:
    return Message(push.kind, rank, server_wire_rank(world_size), push.tensors, clock=push.clock, loss=push.loss,
                   model_version=push.version)


def push_of(message: Message) -> ServerPush:
    return ServerPush(message.kind, message.tensors, message.model_version, clock=message.clock, loss=message.loss)


def model_message(model: ServerModel, rank: int, world_size: int) -> Message:
    return Message(model.kind, server_wire_rank(world_size), rank, model.tensors, clock=model.step,
                   model_version=model.version)


def model_of(message: Message) -> ServerModel:
    return ServerModel(message.kind, message.tensors, message.model_version, step=message.clock)
