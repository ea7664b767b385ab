"""A node agent that lies, for the cluster tests of issue 28: the real agent, with a valid node certificate, whose
every tensor message it serves or sends is replaced by an attack's (nodeagent.byzantine), as a compromised machine
running the project's own code would send. Not part of the product.

    python -m lying_agent ATTACK[:STRENGTH] serve --coordinator ... (the rest of `nodeagent serve`'s command line)

The attacks that read the others' messages (alie, ipm, dissensus) read the latest tensor message the agent received
from each peer: the receiver's own for dissensus (at strength 0 it echoes each neighbour's state back).
"""

from __future__ import annotations

import dataclasses
import sys

from nodeagent.algorithms import base
from nodeagent.byzantine import forge
from nodeagent.cli import main
from nodeagent.runtime import driver
from nodeagent.wire.message import Kind, Message


def lie(attack: str, strength: float | None = None) -> None:
    """From now on every Snapshot (what a node serves and sends its neighbours) holds `attack`'s forgery."""
    honest = base.Snapshot.message_for
    hand_over = driver.NodeDriver._hand_over
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

    base.Snapshot.message_for = message_for  # type: ignore[method-assign]
    driver.NodeDriver._hand_over = recording_hand_over  # type: ignore[method-assign]


if __name__ == "__main__":
    name, _, value = sys.argv[1].partition(":")
    lie(name, float(value) if value else None)
    sys.exit(main(sys.argv[2:]))
