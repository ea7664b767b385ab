"""A node agent that lies, for the cluster tests and benchmarks of issue 28: the real agent, with a valid node
certificate, whose every tensor message it serves or sends, to its neighbours or to the parameter server, is replaced
by an attack's (nodeagent.byzantine), as a compromised machine running the project's own code would send. Not part
of the product.

    python -m lying_agent ATTACK[:STRENGTH][@SPEED] serve --coordinator ...  (`nodeagent serve`'s command line)

The attacks that read the others' messages (alie, ipm, dissensus) read the latest tensor message the agent received
from each peer: the receiver's own for dissensus (at strength 0 it echoes each neighbour's state back).

SPEED (a parameter-server job's fast liar): the agent steps SPEED times as often as the job's pace (`min_step_s` /
SPEED), and counts one step in SPEED: an asynchronous server answers each push at once, so the liar pushes SPEED
times as often as an honest worker for as long as the job runs. Its pushes claim one step each, 0, 1, 2...: the
server applies one push per step of a worker, so pushes that claimed their step would be one push a step.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch

from nodeagent.agent import runner
from nodeagent.algorithms import base
from nodeagent.byzantine import forge
from nodeagent.cli import main
from nodeagent.ps.messages import ServerAnswer
from nodeagent.ps.worker import PSWorker
from nodeagent.runtime import driver
from nodeagent.wire.message import Kind, Message


def lie(attack: str, strength: float | None = None, speed: int = 1) -> None:
    """From now on every Snapshot (what a node serves and sends its neighbours) and every update pushed to the server
    holds `attack`'s forgery; a parameter-server worker steps `speed` times as fast (see the module's text)."""
    honest = base.Snapshot.message_for
    hand_over = driver.NodeDriver._hand_over
    honest_update = PSWorker.update_tensors
    received: dict[int, dict] = {}  # peer -> the tensors of its latest message

    def message_for(self: base.Snapshot, peer: int, kind: Kind) -> Message | None:
        message = honest(self, peer, kind)
        if message is None:
            return None
        forged = forge(attack, message.tensors, list(received.values()), received.get(peer), strength)
        return dataclasses.replace(message, tensors=forged)

    def recording_hand_over(self: driver.NodeDriver, sends: list) -> None:
        for item in self._arrived:
            if isinstance(item, Message) and item.tensors:
                received[item.sender] = dict(item.tensors)
        hand_over(self, sends)

    def forged_update(self: PSWorker, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        return forge(attack, honest_update(self, grad), [], None, strength)

    base.Snapshot.message_for = message_for  # type: ignore[method-assign]
    driver.NodeDriver._hand_over = recording_hand_over  # type: ignore[method-assign]
    PSWorker.update_tensors = forged_update  # type: ignore[method-assign]
    if speed > 1:
        hurry(speed)


def hurry(speed: int) -> None:
    """A parameter-server worker's steps `speed` times as often as the job's pace, one in `speed` counted."""
    honest_init = runner.NodeLoop.__init__
    honest_receive = PSWorker.receive
    honest_push = PSWorker.push
    answers = [0]
    claimed = [0]  # the step the next push claims

    def fast_init(self: runner.NodeLoop, *args: Any, **kwargs: Any) -> None:
        honest_init(self, *args, **kwargs)
        self.min_step_s /= speed

    def slow_clock_receive(self: PSWorker, message: Message | ServerAnswer) -> None:
        clock = self.clock
        honest_receive(self, message)
        if self.clock == clock + 1:
            answers[0] += 1
            if answers[0] % speed:
                self.clock = clock

    def claiming_push(self: PSWorker, tensors: Any, kind: Kind) -> base.Send:
        send = honest_push(self, tensors, kind)
        claimed[0] += 1
        return dataclasses.replace(send, message=dataclasses.replace(send.message, clock=claimed[0] - 1))

    runner.NodeLoop.__init__ = fast_init  # type: ignore[method-assign]
    PSWorker.receive = slow_clock_receive  # type: ignore[method-assign]
    PSWorker.push = claiming_push  # type: ignore[method-assign]


if __name__ == "__main__":
    lie_text, _, speed_text = sys.argv[1].partition("@")
    name, _, value = lie_text.partition(":")
    lie(name, float(value) if value else None, int(speed_text) if speed_text else 1)
    sys.exit(main(sys.argv[2:]))
