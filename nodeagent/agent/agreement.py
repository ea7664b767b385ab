"""What the members of an all-reduce quorum tell each other besides the data, and the rules they decide by: pure
functions of typed messages, no store, no group, no clock (nodeagent.agent.collective performs them).

State agreement. Every new quorum first agrees on the state the job goes on from. Each member gives a StateKey:
the last quorum it holds the job's state in (`held_in`, -1 for a rank restarted from its checkpoint), its step, and
whether the collective round of that step is applied already (`applied`: DiLoCo's clock does not move at a sync,
so a member whose sync at step t is applied and one whose sync at t is still pending hold the same step; allreduce
SGD's clock moves with each applied step, so it always says False). The greatest (held_in, step, applied) wins,
held by the lowest member with it, whose state is broadcast; when every member holds the same key nothing travels
(a restarted rank's key, -1, is never the same as a live one's, except in the job's first quorum, whose ranks all
start from the same seeded model). The key also carries the member's token (checked against the rendezvous store's).

Commit vote (as torchft's should_commit). A round's result is applied only if every member of the quorum voted
that its collective completed: each member that completed it votes (saying whether it saw a rank waiting to come
in), the votes are all-gathered, and the round is committed when every member's vote came. A member whose
collective failed drops the group instead of voting, which fails the vote of every other member: the round is
applied nowhere and retried by the next quorum. The vote itself can complete on some
members and fail on others (a member lost within the vote): those that committed hold the next key (a later step,
or `applied`), so the next quorum's agreement brings the others to it; the round is then applied everywhere.
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


@dataclass(frozen=True)
class Vote:
    """A member's vote that its collective of a round completed (a member whose collective failed gives none), and
    whether it saw a rank waiting to come in."""

    waiting: bool

    def encode(self) -> torch.Tensor:
        return torch.tensor([int(self.waiting)], dtype=torch.int64)

    @classmethod
    def decode(cls, tensor: torch.Tensor) -> Vote:
        return cls(bool(int(tensor[0])))


@dataclass(frozen=True)
class Outcome:
    """What every member that saw all the votes does: apply the round (`committed`), and leave the quorum after it
    for the next one with a waiting rank (`leave`)."""

    committed: bool
    leave: bool


def decide(votes: list[Vote], members: int) -> Outcome:
    """The outcome of a round from the votes gathered (every member's when the vote completed, else none)."""
    return Outcome(len(votes) == members, any(vote.waiting for vote in votes))
