"""Forming an all-reduce quorum through the job's rendezvous store (the protocol is nodeagent.agent.collective's
module text): `QuorumForming` performs it on an injected store, clock and pause; `may_close` is its one decision,
a pure function.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

log = logging.getLogger("nodeagent")

PRESENCE_POLL_S = 0.1  # how often a rank forming a quorum looks at who came
WAIT_LOGGED_AFTER_S = 10.0
MAX_FAILED_GROUPS = 3  # quorums in a row whose gloo group did not form (each within step_timeout_s) fail the job
ABANDONED = "-"

G = TypeVar("G")


class Store(Protocol):
    """The operations of a torch.distributed Store that the quorum uses; each raises RuntimeError when it fails."""

    def set(self, key: str, value: str) -> None: ...

    def get(self, key: str) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...

    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...

    def check(self, keys: list[str]) -> bool: ...


class GroupLost(RuntimeError):
    """Too few members for a quorum for longer than the wait time, or the job ended meanwhile."""


@dataclass(frozen=True)
class QuorumOptions:
    """The job's `failure` options for its all-reduce (nodeagent.jobspec.FailureSpec)."""

    step_timeout_s: float  # the longest one step's collective (and a group's forming) may take
    join_s: float  # how long a quorum waits for the ranks not there yet, once it has enough
    min_members: int  # the fewest members a quorum may have
    wait_s: float  # how long a rank waits for a quorum of at least min_members before it fails the job


@dataclass(frozen=True)
class Formed(Generic[G]):
    """A quorum closed with this rank in it, and its group."""

    number: int
    members: tuple[int, ...]  # job ranks, in the order of their group ranks
    knocks: int  # `knocks` when it was closed
    group: G


def may_close(number: int, present: int, world_size: int, waited_s: float, options: QuorumOptions) -> bool:
    """Whether quorum `number`, with `present` ranks there, may be closed after this rank waited `waited_s` in it:
    once every rank is there, or at least `min_members` are and the join time passed (a step's timeout for the
    job's first quorum, whose ranks start together: one later than that counts as lost)."""
    join_s = options.join_s if number > 0 else max(options.join_s, options.step_timeout_s)
    return present == world_size or (present >= options.min_members and waited_s >= join_s)


class QuorumForming:
    """Rank `rank`'s side of forming quorums in `store`; `clock()` in seconds, `pause(s)` waits (True when the job
    ended meanwhile), `tell(message, level, step)` a job event."""

    def __init__(self, store: Store, rank: int, world_size: int, options: QuorumOptions, *,
                 clock: Callable[[], float], pause: Callable[[float], bool], tell: Callable[[str, str, int], None],
                 job_id: str = ""):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.options = options
        self.clock = clock
        self.pause = pause
        self.tell = tell
        self.job_id = job_id
        self.last_number = -1  # the last quorum this rank was in
        self._token = (-1, 0)  # the quorum number this rank came to last, and its token there

    def form(self, step: int, make_group: Callable[[int, tuple[int, ...]], G]) -> Formed[G]:
        """Join the quorum being formed and wait until it is closed with this rank in it, then form its group with
        `make_group(number, members)` (RuntimeError when it does not form: the next quorum is formed)."""
        started = self.clock()
        deadline = started + self.options.wait_s
        number, arrived, knocked_in, again = -1, 0.0, -1, False
        logged, error, failed_groups = False, "", 0
        joined: tuple[int, ...] = ()  # the members of the quorum closed with this rank, whose group it forms
        knocks = 0
        while True:
            now = self.clock()
            try:
                if number < 0:
                    number = self._next_number(self.last_number + 1)
                    arrived = 0.0
                elif again:  # after a store error: a store that came back empty never goes below this quorum
                    self._next_number(number)
                closed = self._members(number)
                if closed is None:
                    if not arrived or again:  # (again: a store that came back empty lost this rank's key)
                        # The knock before the presence: a rank found present has been counted (_maybe_close).
                        if knocked_in != number:
                            self.store.add("knocks", 1)
                            knocked_in = number
                        self.store.set(f"q/{number}/here/{self.rank}", str(self.token_in(number)))
                        arrived = arrived or now
                    closed = self._maybe_close(number, now - arrived)
                again = False
                if closed is not None:
                    knocks, members = closed
                    if self.rank not in members:  # closed without this rank: wait in the next one
                        number = self._next_number(number + 1)
                        arrived = 0.0
                        continue
                    with contextlib.suppress(RuntimeError):  # every member moves `next` on: one is enough
                        self._next_number(number + 1)
                    joined = members
            except RuntimeError as failure:  # the store away (perhaps back fresh): this quorum again, once it answers
                if first_line(failure) != error:
                    log.info("job %s: rank %d, forming quorum %d: the rendezvous store failed: %s", self.job_id,
                             self.rank, number, first_line(failure))
                error = first_line(failure)
                again = number >= 0
            if joined:
                try:
                    group = make_group(number, joined)
                    self.last_number = number
                    return Formed(number, joined, knocks, group)
                except RuntimeError as failure:  # a member did not come (lost since it came), or is not reachable
                    failed_groups += 1
                    error = first_line(failure)
                    self.tell(f"rank {self.rank}: the group of all-reduce quorum {number} {list(joined)} was not "
                              f"formed for step {step} ({error}); forming the next", "WARNING", step)
                    if failed_groups >= MAX_FAILED_GROUPS:
                        raise GroupLost(f"the all-reduce's quorums for step {step} did not form their groups "
                                        f"{failed_groups} times in a row (last error: {error})") from failure
                    self.last_number, number, joined = number, -1, ()
                    deadline = self.clock() + self.options.wait_s  # enough ranks had come: wait for them again
                    continue
            if now >= deadline:
                absent = f"ranks {self._absent(number)}" if number >= 0 else "ranks (the store does not answer)"
                raise GroupLost(f"{absent} of the all-reduce did not come to a quorum of at least "
                                f"{self.options.min_members} members for step {step} within "
                                f"{self.options.wait_s:.0f} s{f' (last error: {error})' if error else ''}")
            if not logged and now - started >= WAIT_LOGGED_AFTER_S:
                log.warning("job %s: rank %d waits for a quorum for step %d (quorum %d)", self.job_id, self.rank,
                            step, number)
                logged = True
            if self.pause(PRESENCE_POLL_S):
                raise GroupLost("the job ended while the all-reduce quorum was being formed")

    def knocked_since(self, knocks: int) -> bool:
        """Whether a rank came to form a quorum since `knocks` was read (or the store restarted empty)."""
        return int(self.store.add("knocks", 0)) != knocks

    def token_in(self, number: int) -> int:
        """This rank's token in quorum `number`: a new random one for each quorum (one seen on a taken gloo pair
        is of no use in the next)."""
        if self._token[0] != number:
            self._token = (number, secrets.randbits(62))
        return self._token[1]

    def token_of(self, number: int, rank: int) -> int:
        """The token rank `rank` wrote with its presence in quorum `number`."""
        return int(self.store.get(f"q/{number}/here/{rank}"))

    def _next_number(self, at_least: int) -> int:
        """Move `next` on to at least `at_least` (never back), atomically; its value now."""
        while True:
            current = int(self.store.add("next", 0))
            if current >= at_least:
                return current
            if int(self.store.compare_set("next", str(current), str(at_least))) == at_least:
                return at_least

    def _members(self, number: int) -> tuple[int, tuple[int, ...]] | None:
        """`knocks` when quorum `number` was closed and its members (() when it was given up), or None while it is
        not closed."""
        key = f"q/{number}/members"
        if not self.store.check([key]):
            return None
        return _closed(self.store.get(key).decode())

    def _present(self, number: int) -> list[int]:
        return [rank for rank in range(self.world_size) if self.store.check([f"q/{number}/here/{rank}"])]

    def _absent(self, number: int) -> list[int]:
        try:
            present = set(self._present(number))
        except RuntimeError:
            return []
        return [rank for rank in range(self.world_size) if rank not in present]

    def _maybe_close(self, number: int, waited_s: float) -> tuple[int, tuple[int, ...]] | None:
        """Close quorum `number` if it may be closed now, or give it up when the ranks went on past it; its members
        once closed (by this rank or another), else None."""
        key = f"q/{number}/members"
        if int(self.store.add("next", 0)) > number:
            closed = self.store.compare_set(key, "", ABANDONED).decode()
        else:
            # The presence first, then `knocks`: every rank present knocked before it said so, so the members never
            # take one of their own for a rank waiting (each a regroup, frequent with a store a call away). A rank
            # counted here but not present knocks again in the next quorum, where the members notice it.
            present = self._present(number)
            knocks = int(self.store.add("knocks", 0))
            if not may_close(number, len(present), self.world_size, waited_s, self.options):
                return None
            value = f"{knocks}|{','.join(map(str, present))}"
            closed = self.store.compare_set(key, "", value).decode()
        return _closed(closed)


def _closed(value: str) -> tuple[int, tuple[int, ...]]:
    """A closed quorum's `members` value: `knocks` then, and its members (none when it was given up)."""
    if value == ABANDONED:
        return 0, ()
    knocks, members = value.split("|")
    return int(knocks), tuple(int(rank) for rank in members.split(","))


def first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
