"""How a worker reaches its parameter server: one interface, a gRPC implementation (nodeagent.runtime.grpc_server,
the coordinator's PsPush, PsPull and PsReport calls) and a simulated one (nodeagent.runtime.simulator).

Runtimes route every `Route.SERVER` send to `ServerLink.call` and nothing else; the request itself picks the
call (`send_on`), so no runtime asks what it holds. The answer, or a `SendFailed` saying why there is none, goes
to `answered` exactly once: at once, from another thread, or later in virtual time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Protocol

from nodeagent.algorithms.base import SendFailed
from nodeagent.ps.messages import ServerAnswer, ServerModel, ServerPull, ServerPush, ServerRequest, StepReport
from nodeagent.wire.message import Kind, TensorSpec

Answered = Callable[[ServerAnswer | SendFailed], None]


class ServerExpectation(Protocol):
    """What a worker accepts from its server (PSWorker implements it); a link's threads call it, so it reads only
    immutable configuration."""

    def server_specs(self, kind: Kind, shapes: list[tuple[str, tuple[int, ...]]]) -> list[TensorSpec]: ...

    def check_server_message(self, model: ServerModel) -> None: ...


class ServerLink(ABC):
    def call(self, request: ServerRequest, call_id: str, step_s: float, answered: Answered) -> None:
        """Perform `request`. `call_id` names a push: a retry with the same id is applied once. `step_s` is the
        duration of the local step the request follows (a StepReport carries it to ESync's decision)."""
        request.send_on(self, call_id, step_s, answered)

    @abstractmethod
    def push(self, push: ServerPush, call_id: str, answered: Answered) -> None:
        """Deliver the update once, wait until the server releases this worker, then answer with the model."""

    @abstractmethod
    def pull(self, pull: ServerPull, answered: Answered) -> None:
        """Answer with the server's current model."""

    @abstractmethod
    def report(self, report: StepReport, step_s: float, answered: Answered) -> None:
        """Answer with the server's ReadyAnswer to the report."""
