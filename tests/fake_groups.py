"""In-memory process groups for the collective (nodeagent.agent.process_group), for members that are threads of
the test's process, and a wrapper that injects failures: no gloo, no sockets, no sleeps.

A group's collective completes once every member contributed (each then gets the answer), or fails on a member
whose contribution cannot complete because another member dropped the group, as gloo fails when a peer's process
goes away. A member that raises after its collective completed leaves the others with their answer.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from nodeagent.agent.process_group import GroupFactory, ProcessGroup

GUARD_S = 60.0  # a test that waits this long for a collective is broken: it fails rather than hangs


@dataclass
class _Quorum:
    size: int
    contributions: dict[int, dict[int, torch.Tensor]] = field(default_factory=dict)  # op -> group rank -> tensor
    dropped: bool = False


class FakeGroups:
    """The groups of one job's quorums; `__call__` is a GroupFactory."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.quorums: dict[int, _Quorum] = {}

    def __call__(self, number: int, members: tuple[int, ...], index: int) -> ProcessGroup:
        with self.changed:
            quorum = self.quorums.setdefault(number, _Quorum(len(members)))
        return FakeGroup(self, quorum, index)


class FakeGroup:
    def __init__(self, groups: FakeGroups, quorum: _Quorum, index: int):
        self.groups, self.quorum, self.index = groups, quorum, index
        self.ops = 0

    def _every(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        quorum, changed = self.quorum, self.groups.changed
        with changed:
            op, self.ops = self.ops, self.ops + 1
            if quorum.dropped:
                raise RuntimeError("fake group: a member dropped the group")
            parts = quorum.contributions.setdefault(op, {})
            parts[self.index] = tensor.clone()
            changed.notify_all()
            if not changed.wait_for(lambda: len(parts) == quorum.size or quorum.dropped, timeout=GUARD_S):
                raise AssertionError("fake group: a collective waited for its members too long")
            if len(parts) < quorum.size:
                raise RuntimeError("fake group: a member dropped the group")
            return [parts[index] for index in range(quorum.size)]

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        parts = self._every(tensor)
        total = torch.zeros_like(tensor)
        for part in parts:  # in group order, as gloo's ring fixes its order: every member gets the same bits
            total.add_(part)
        tensor.copy_(total)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self._every(tensor)

    def broadcast(self, tensor: torch.Tensor, source: int) -> None:
        tensor.copy_(self._every(tensor)[source])

    def close(self) -> None:
        with self.groups.changed:
            self.quorum.dropped = True
            self.groups.changed.notify_all()


class FailsAfterTheOthers:
    """One member's groups, which raise on that member once its `at`-th all-reduce has completed: the other members
    have their answer, this one does not."""

    def __init__(self, groups: GroupFactory, at: int):
        self.groups, self.at = groups, at
        self.count = 0
        self.failed = False

    def __call__(self, number: int, members: tuple[int, ...], index: int) -> ProcessGroup:
        return _Failing(self.groups(number, members, index), self)

    def completed(self) -> None:
        self.count += 1
        if self.count == self.at:
            self.failed = True
            raise RuntimeError("injected: this member's all-reduce failed after the others had their answer")


class _Failing:
    def __init__(self, inner: ProcessGroup, fault: FailsAfterTheOthers):
        self.inner, self.fault = inner, fault

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        self.inner.all_reduce_sum(tensor)
        self.fault.completed()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self.inner.all_gather(tensor)

    def broadcast(self, tensor: torch.Tensor, source: int) -> None:
        self.inner.broadcast(tensor, source)

    def close(self) -> None:
        self.inner.close()
