"""What the members of an all-reduce quorum tell each other when it forms, and the rule they decide by: pure
functions of typed messages, no store, no group, no clock (nodeagent.agent.collective performs them).

State agreement. Every new quorum first agrees on the state the job goes on from. Each member gives a StateKey:
the last quorum it holds the job's state in (`held_in`, -1 for a rank restarted from its checkpoint), its step, and
whether the collective round of that step is applied already (`applied`: DiLoCo's clock does not move at a sync,
so a member whose sync at step t is applied and one whose sync at t is still pending hold the same step; allreduce
SGD's clock moves with each applied step, so it always says False). The greatest (held_in, step, applied) wins,
held by the lowest member with it, whose state is broadcast; when every member holds the same key nothing travels
(a restarted rank's key, -1, is never the same as a live one's, except in the job's first quorum, whose ranks all
start from the same seeded model). The key also carries the member's token (checked against the rendezvous store's).

Commit (nodeagent.agent.collective). A round's answer is applied on receipt, and the quorum's next round commits
it: a member enters a round only with its answer of the one before. A round in doubt (the next one failed: some
member may not have had its answer) is settled by the next quorum's agreement: the members that applied it hold
the next key (a later step, or `applied`) and bring the others to it; when none of them is there, it is taken
again. No separate vote travels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nodeagent.wire.message import Message


@dataclass(frozen=True)
class MemberState:
    """A member's state as the agreement needs it, taken at one moment: its group state (a PARAMS message at its
    step) and whether the round of that step is applied. Taken where the member runs, when it asks for a collective:
    a member that trains on meanwhile (DiLoCo's overlapped steps) hands the state of that moment."""

    message: Message
    applied: bool


@dataclass(frozen=True, order=True)
class StateKey:
    """One member's claim in a new quorum's agreement; ordered by (held_in, step, applied), token last."""

    held_in: int  # the last quorum whose state this member holds; -1: restarted, from its checkpoint
    step: int
    applied: bool  # the collective round of `step` is applied on this member
    token: int = 0  # the random number this member wrote to the store with its presence in this quorum

    @property
    def rank(self) -> tuple[int, int, bool]:
        return self.held_in, self.step, self.applied

    def encode(self) -> torch.Tensor:
        return torch.tensor([self.held_in, self.step, int(self.applied), self.token], dtype=torch.int64)

    @classmethod
    def decode(cls, tensor: torch.Tensor) -> StateKey:
        held_in, step, applied, token = (int(value) for value in tensor.tolist())
        return cls(held_in, step, bool(applied), token)


@dataclass(frozen=True)
class Agreement:
    """The outcome of a quorum's agreement: `source`, the index in the quorum of the member whose state every member
    takes up, or None when every member's state is the quorum's already; `best`, the winning key."""

    source: int | None
    best: StateKey


def agree(keys: list[StateKey], first_quorum: bool) -> Agreement:
    """The state a new quorum goes on from, given every member's key in quorum order (see the module's text)."""
    best = max(key.rank for key in keys)
    source = [key.rank for key in keys].index(best)  # the lowest member with it
    winner = keys[source]
    if all(key.rank == best for key in keys) and (best[0] >= 0 or first_quorum):
        return Agreement(None, winner)
    return Agreement(source, winner)
