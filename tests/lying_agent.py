"""A node agent that lies, for the cluster tests of issue 28: the real agent, with a valid node certificate, whose
every tensor message it serves or sends is replaced by an attack's (nodeagent.byzantine), as a compromised machine
running the project's own code would send. Not part of the product.

    python -m lying_agent ATTACK serve --coordinator ... (the rest of `nodeagent serve`'s command line)
"""

from __future__ import annotations

import dataclasses
import sys

from nodeagent.algorithms import base
from nodeagent.byzantine import forge
from nodeagent.cli import main
from nodeagent.wire.message import Kind, Message


def lie(attack: str) -> None:
    """From now on every Snapshot (what a node serves and sends its neighbours) holds `attack`'s forgery."""
    honest = base.Snapshot.message_for

    def message_for(self: base.Snapshot, peer: int, kind: Kind) -> Message | None:
        message = honest(self, peer, kind)
        return None if message is None else dataclasses.replace(message, tensors=forge(attack, message.tensors, []))

    base.Snapshot.message_for = message_for  # type: ignore[method-assign]


if __name__ == "__main__":
    lie(sys.argv[1])
    sys.exit(main(sys.argv[2:]))
